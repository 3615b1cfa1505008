"""The flap detector's logic: each signal alone, de-duplication across signals, resets, saturation,
the flapping rule and its events."""

from __future__ import annotations

import threading
import time

from gpumon.flaps import FlapDetector

KEY = ("mlx5_ib0", "1")
UP = {"state": 4, "phys_state": 5}
DOWN = {"state": 1, "phys_state": 2}


class Clock:
    """Monotonic and wall clocks a test moves by hand."""

    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = 1_700_000_000.0

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


def make(clock: Clock, **kwargs) -> FlapDetector:
    return FlapDetector(clock=lambda: clock.mono, wall_clock=lambda: clock.wall, **kwargs)


def kinds(det: FlapDetector) -> list[str]:
    return [e.kind for e in det.drain_events()]


def test_state_down_then_up_is_one_flap_with_down_duration() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, **UP)
    clock.advance(1)
    det.observe(KEY, clock.mono, **DOWN)
    events = det.drain_events()
    assert [e.kind for e in events] == ["ib_link_down"]
    assert events[0].subject == {"device": "mlx5_ib0", "port": "1"}
    clock.advance(3)
    assert det.status(KEY).down_seconds == 3
    clock.advance(4)
    det.observe(KEY, clock.mono, **UP)
    events = det.drain_events()
    assert [e.kind for e in events] == ["ib_link_up", "ib_link_flap"]
    assert events[0].attributes["down_seconds"] == 7
    assert events[1].attributes["signals"] == ["state"]
    st = det.status(KEY)
    assert (st.flaps_total, st.window_flaps, st.last_down_seconds, st.down_seconds) == (1, 1, 7, 0)
    assert st.last_flap_timestamp == clock.wall


def test_phys_state_alone_leaving_linkup_counts() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, **UP)
    clock.advance(1)
    det.observe(KEY, clock.mono, state=4, phys_state=2)  # Polling, read before state followed it
    clock.advance(1)
    det.observe(KEY, clock.mono, **UP)
    assert det.status(KEY).flaps_total == 1


def test_a_retrain_that_succeeds_is_not_a_flap() -> None:
    """ACTIVE + LinkErrorRecovery is a retrain in progress: link_error_recovery counts it when it
    succeeds; only a failed recovery (link_downed) takes the link down."""
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, **UP, link_downed=0)
    clock.advance(1)
    det.observe(KEY, clock.mono, state=4, phys_state=6)
    clock.advance(1)
    det.observe(KEY, clock.mono, **UP, link_downed=0)
    assert det.status(KEY).flaps_total == 0
    assert [e.kind for e in det.drain_events()] == []


def test_port_down_at_start_coming_up_is_not_a_flap() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, **DOWN)
    clock.advance(5)
    det.observe(KEY, clock.mono, **UP)
    assert kinds(det) == ["ib_link_up"]
    assert det.status(KEY).flaps_total == 0


def test_link_downed_increase_counts_each_flap_and_first_reading_is_a_baseline() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, link_downed=7)
    assert det.status(KEY).flaps_total == 0
    clock.advance(10)
    det.observe(KEY, clock.mono, link_downed=9)
    assert det.status(KEY).flaps_total == 2
    [event] = det.drain_events()                 # two flaps between two reads: one event that says 2
    assert (event.kind, event.attributes["flaps"]) == ("ib_link_flap", 2)


def test_a_jump_of_250_in_link_downed_is_one_event_with_the_count() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, link_downed=3)
    clock.advance(10)
    det.observe(KEY, clock.mono, link_downed=253)
    [event] = [e for e in det.drain_events() if e.kind == "ib_link_flap"]
    assert event.attributes == {"signals": ["link_downed"], "flaps": 250}
    assert "flapped 250 times" in event.message
    assert det.status(KEY).flaps_total == 250 and det.status(KEY).flapping


def test_an_absurd_counter_jump_is_counted_without_a_loop_per_flap() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, carrier_changes=0)
    clock.advance(10)
    started = time.monotonic()
    det.observe(KEY, clock.mono, carrier_changes=2 * 10**12)   # a hostile or broken sysfs file
    assert time.monotonic() - started < 2.0
    assert det.status(KEY).flaps_total == 10**12
    [event] = [e for e in det.drain_events() if e.kind == "ib_link_flap"]
    assert event.attributes["flaps"] == 10**12


def test_carrier_changes_two_per_cycle_even_split_across_reads() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, carrier_changes=2)
    clock.advance(1)
    det.observe(KEY, clock.mono, carrier_changes=4)
    assert det.status(KEY).flaps_total == 1
    clock.advance(1)
    det.observe(KEY, clock.mono, carrier_changes=5)  # went down, not back yet
    assert det.status(KEY).flaps_total == 1
    clock.advance(1)
    det.observe(KEY, clock.mono, carrier_changes=6)
    assert det.status(KEY).flaps_total == 2


def test_decrease_is_a_reset_never_a_wrap() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, link_downed=200, carrier_changes=40)
    clock.advance(1)
    det.observe(KEY, clock.mono, link_downed=0, carrier_changes=0)  # perfquery -R / driver reload
    assert det.status(KEY).flaps_total == 0
    clock.advance(1)
    det.observe(KEY, clock.mono, link_downed=1, carrier_changes=2)
    assert det.status(KEY).flaps_total == 1


def test_one_flap_seen_by_three_signals_counts_once() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, link_downed=3, carrier_changes=10, **UP)
    clock.advance(1)
    det.observe(KEY, clock.mono, **DOWN)
    clock.advance(1)
    det.observe(KEY, clock.mono, carrier_changes=11)
    clock.advance(1)
    det.observe(KEY, clock.mono, carrier_changes=12, **UP)  # watcher pass: state and carrier
    clock.advance(6)
    det.observe(KEY, clock.mono, link_downed=4)  # the counter collector, later
    st = det.status(KEY)
    assert st.flaps_total == 1
    assert st.signal_counts == {"state": 1, "link_downed": 1, "carrier_changes": 1}
    flap_events = [e for e in det.drain_events() if e.kind == "ib_link_flap"]
    assert len(flap_events) == 1
    assert flap_events[0].attributes["signals"] == ["carrier_changes", "state"]


def test_short_flap_counted_first_by_counter_then_matched_by_carrier() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, link_downed=0, carrier_changes=0)
    clock.advance(1)
    det.observe(KEY, clock.mono, link_downed=1)
    clock.advance(0.5)
    det.observe(KEY, clock.mono, carrier_changes=2)
    assert det.status(KEY).flaps_total == 1


def test_two_flaps_in_one_counter_interval_match_two_watched_flaps() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, link_downed=0, carrier_changes=0)
    for _ in range(2):
        clock.advance(3)
        det.observe(KEY, clock.mono, carrier_changes=det.status(KEY).signal_counts["carrier_changes"] * 2 + 2)
    assert det.status(KEY).flaps_total == 2
    clock.advance(3)
    det.observe(KEY, clock.mono, link_downed=3)  # two matched, one only the counter saw
    assert det.status(KEY).flaps_total == 3


def test_flaps_far_apart_are_not_merged() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, link_downed=0, carrier_changes=0)
    clock.advance(1)
    det.observe(KEY, clock.mono, carrier_changes=2)
    clock.advance(100)
    det.observe(KEY, clock.mono, link_downed=0)  # re-read: no change
    clock.advance(1)
    det.observe(KEY, clock.mono, link_downed=1)  # interval (100, 101]: not the old flap
    assert det.status(KEY).flaps_total == 2


def test_saturated_link_downed_falls_back_to_state_and_carrier() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, link_downed=255, link_downed_saturated=True, carrier_changes=8, **UP)
    for _ in range(3):
        clock.advance(1)
        det.observe(KEY, clock.mono, **DOWN)
        clock.advance(1)
        det.observe(KEY, clock.mono, **UP)
        det.observe(KEY, clock.mono, link_downed=255, link_downed_saturated=True)
    clock.advance(1)
    det.observe(KEY, clock.mono, carrier_changes=16)  # 4 cycles: 3 already seen by state, 1 new
    st = det.status(KEY)
    assert st.link_downed_saturated
    assert st.signal_counts["link_downed"] == 0
    assert st.flaps_total == 4


def test_link_downed_reaching_saturation_still_counts_the_last_steps() -> None:
    clock = Clock()
    det = make(clock)
    det.observe(KEY, clock.mono, link_downed=253)
    clock.advance(1)
    det.observe(KEY, clock.mono, link_downed=255, link_downed_saturated=True)
    assert det.status(KEY).flaps_total == 2


def test_threshold_in_window_sets_flapping_once_and_window_expiry_clears_it() -> None:
    clock = Clock()
    det = make(clock, threshold=3, window=3600)
    det.observe(KEY, clock.mono, link_downed=0)
    for value in range(1, 4):
        clock.advance(60)
        det.observe(KEY, clock.mono, link_downed=value)
    events = det.drain_events()
    assert [e.kind for e in events].count("ib_port_flapping") == 1
    flapping = [e for e in events if e.kind == "ib_port_flapping"][0]
    assert flapping.attributes == {"flaps": 3, "window_seconds": 3600, "threshold": 3}
    assert det.status(KEY).flapping
    clock.advance(60)
    det.observe(KEY, clock.mono, link_downed=4)
    assert "ib_port_flapping" not in kinds(det)  # already flapping: no repeat
    clock.advance(3600 - 120 + 1)  # the first two have left the window
    st = det.status(KEY)
    assert (st.window_flaps, st.flapping, st.flaps_total) == (2, False, 4)


def test_configure_changes_the_rule_for_known_ports() -> None:
    clock = Clock()
    det = make(clock, threshold=5)
    det.observe(KEY, clock.mono, link_downed=0)
    clock.advance(1)
    det.observe(KEY, clock.mono, link_downed=2)
    assert not det.status(KEY).flapping
    det.configure(threshold=2, window=86400)
    assert det.status(KEY).flapping


def test_unknown_port_reads_as_zero() -> None:
    det = FlapDetector()
    st = det.status(("mlx5_9", "1"))
    assert (st.flaps_total, st.flapping, st.last_flap_timestamp, st.down_seconds) == (0, False, None, 0)


def test_two_threads_feeding_one_detector_agree_on_the_count() -> None:
    det = FlapDetector(threshold=10**6)
    keys = [(f"mlx5_ib{i}", "1") for i in range(4)]
    barrier = threading.Barrier(2)
    rounds = 300

    def counters() -> None:
        barrier.wait(timeout=10)
        for value in range(rounds + 1):
            for key in keys:
                det.observe(key, None, link_downed=value)

    def watcher() -> None:
        barrier.wait(timeout=10)
        for i in range(rounds):
            for key in keys:
                det.observe(key, None, **(UP if i % 2 == 0 else DOWN))
            det.drain_events()

    threads = [threading.Thread(target=counters), threading.Thread(target=watcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    for key in keys:
        st = det.status(key)
        # Every link_downed step is a flap; state flaps can only match them, never add beyond them
        # while they overlap in time, and no update is lost.
        assert st.signal_counts["link_downed"] == rounds
        assert rounds <= st.flaps_total <= rounds + st.signal_counts["state"]


def test_an_outage_longer_than_the_match_horizon_is_still_one_flap() -> None:
    """link_downed reports the flap when the link goes down; the state signal only when it comes
    back, an hour later. The first report must still be there to be matched."""
    clock = Clock()
    det = make(clock, match_horizon=600)
    det.observe(KEY, clock.mono, **UP, link_downed=0)
    clock.advance(1)
    det.observe(KEY, clock.mono, **DOWN)
    for _ in range(400):                 # 66 minutes down, watched every 10 s
        clock.advance(10)
        det.observe(KEY, clock.mono, **DOWN, link_downed=1)
    clock.advance(1)
    det.observe(KEY, clock.mono, **UP, link_downed=1)
    st = det.status(KEY)
    assert st.flaps_total == 1
    assert st.signal_counts["state"] == 1 and st.signal_counts["link_downed"] == 1
