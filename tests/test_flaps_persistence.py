"""The flap window survives a restart; a corrupt or unwritable state file is reported, never fatal."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpumon.flaps import FlapDetector, state_path

KEY = ("mlx5_ib2", "1")


class Clock:
    def __init__(self) -> None:
        self.mono = 50.0
        self.wall = 1_700_000_000.0

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


def make(clock: Clock, path: str, **kwargs) -> FlapDetector:
    return FlapDetector(state_path=path, clock=lambda: clock.mono, wall_clock=lambda: clock.wall, **kwargs)


def flap_n(det: FlapDetector, clock: Clock, n: int) -> None:
    det.observe(KEY, clock.mono, link_downed=0)
    for value in range(1, n + 1):
        clock.advance(30)
        det.observe(KEY, clock.mono, link_downed=value)


def test_window_survives_restart_and_keeps_the_port_flapping(tmp_path) -> None:
    clock = Clock()
    path = state_path(str(tmp_path / "state"))
    det = make(clock, path, threshold=5)
    flap_n(det, clock, 5)
    assert det.status(KEY).flapping
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    assert document["version"] == 1 and len(document["ports"]["mlx5_ib2/1"]) == 5
    assert not [n for n in os.listdir(tmp_path / "state") if n.endswith(".tmp")]

    clock.advance(10)  # restart: a new process, a new monotonic origin
    clock.mono = 3.0
    again = make(clock, path, threshold=5)
    st = again.status(KEY)
    assert (st.window_flaps, st.flapping, st.flaps_total) == (5, True, 0)
    assert st.last_flap_timestamp is not None
    assert again.drain_errors() == {}
    assert "ib_port_flapping" not in [e.kind for e in again.drain_events()]


def test_entries_older_than_the_window_are_dropped_on_load(tmp_path) -> None:
    clock = Clock()
    path = state_path(str(tmp_path))
    det = make(clock, path, window=3600)
    flap_n(det, clock, 3)
    clock.advance(3600 - 30 + 1)  # flaps at +30, +60, +90 s: only the last is still inside
    again = make(clock, path, window=3600)
    assert again.status(KEY).window_flaps == 1


def test_corrupt_file_is_reported_kept_aside_and_replaced(tmp_path) -> None:
    clock = Clock()
    path = state_path(str(tmp_path))
    with open(path, "w", encoding="utf-8") as fh:
        fh.write('{"version": 1, "ports": {"mlx5_ib2/1": [1, "x"]}}')
    det = make(clock, path)
    assert det.drain_errors() == {"state_corrupt": 1}
    assert Path(path + ".corrupt").read_text(encoding="utf-8").startswith('{"version": 1')
    assert json.loads(Path(path).read_text(encoding="utf-8"))["ports"] == {}
    flap_n(det, clock, 1)
    assert json.loads(Path(path).read_text(encoding="utf-8"))["ports"]["mlx5_ib2/1"]


def test_every_shape_of_garbage_is_corruption_not_a_crash(tmp_path) -> None:
    for i, text in enumerate([
        "", "not json", "[]", '{"version": 2, "ports": {}}', '{"version": 1}',
        '{"version": 1, "ports": []}', '{"version": 1, "ports": {"noslash": []}}',
        '{"version": 1, "ports": {"a/1": [true]}}', '{"version": 1, "ports": {"a/1": [NaN]}}',
    ]):
        path = str(tmp_path / f"s{i}.json")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        det = FlapDetector(state_path=path)
        assert det.drain_errors() == {"state_corrupt": 1}, text
        assert json.loads(Path(path).read_text(encoding="utf-8"))["version"] == 1


def test_binary_garbage_is_corruption(tmp_path) -> None:
    path = str(tmp_path / "s.json")
    with open(path, "wb") as fh:
        fh.write(b"\xff\xfe\x00garbage")
    det = FlapDetector(state_path=path)
    assert det.drain_errors() == {"state_corrupt": 1}


def test_unwritable_state_dir_counts_an_error_and_detection_goes_on(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    clock = Clock()
    det = make(clock, str(blocker / "state" / "ib_flaps.json"))
    flap_n(det, clock, 2)
    assert det.status(KEY).flaps_total == 2
    assert det.drain_errors() == {"state_read": 1, "state_write": 2}
    assert det.drain_errors() == {}


def test_no_state_path_keeps_everything_in_memory() -> None:
    clock = Clock()
    det = FlapDetector(clock=lambda: clock.mono, wall_clock=lambda: clock.wall)
    flap_n(det, clock, 1)
    assert det.status(KEY).flaps_total == 1 and det.drain_errors() == {}


def test_a_window_longer_than_a_day_survives_a_restart(tmp_path) -> None:
    """The detector is built before the watcher's configured window is known: what it loads must not
    be cut to the default 24 h."""
    clock = Clock()
    path = state_path(str(tmp_path))
    det = make(clock, path, threshold=3, window=7 * 86400)
    for day in range(3):
        det.observe(KEY, clock.mono, link_downed=day)
        clock.advance(86400 * 2)
        det.observe(KEY, clock.mono, link_downed=day + 1)
    assert det.status(KEY).window_flaps == 3
    again = make(clock, path)              # default window until the watcher configures it
    again.configure(3, 7 * 86400)
    st = again.status(KEY)
    assert (st.window_flaps, st.flapping) == (3, True)


def test_the_window_follows_the_hca_not_the_device_name(tmp_path) -> None:
    """Device names are not stable across reboots; node_guid is. After a reboot that swaps two names,
    each HCA keeps its own flap history."""
    clock = Clock()
    path = state_path(str(tmp_path))
    det = make(clock, path, threshold=2)
    det.identify(("mlx5_ib0", "1"), "aaaa:0000:0000:0001")
    det.identify(("mlx5_ib1", "1"), "bbbb:0000:0000:0002")
    det.observe(("mlx5_ib0", "1"), clock.mono, link_downed=0)
    clock.advance(30)
    det.observe(("mlx5_ib0", "1"), clock.mono, link_downed=2)
    assert det.status(("mlx5_ib0", "1")).flapping
    saved = json.loads(Path(path).read_text(encoding="utf-8"))["ports"]
    assert set(saved) == {"aaaa:0000:0000:0001/1"}

    clock.mono = 3.0
    again = make(clock, path, threshold=2)
    again.identify(("mlx5_ib0", "1"), "bbbb:0000:0000:0002")   # the names swapped
    again.identify(("mlx5_ib1", "1"), "aaaa:0000:0000:0001")
    assert again.status(("mlx5_ib1", "1")).window_flaps == 2 and again.status(("mlx5_ib1", "1")).flapping
    assert again.status(("mlx5_ib0", "1")).window_flaps == 0


def test_a_name_taken_over_by_another_hca_does_not_count_its_counter_as_flaps(tmp_path) -> None:
    clock = Clock()
    det = make(clock, state_path(str(tmp_path)))
    key = ("mlx5_ib3", "1")
    det.identify(key, "aaaa:0000:0000:0001")
    det.observe(key, clock.mono, link_downed=1)
    clock.advance(30)
    det.observe(key, clock.mono, link_downed=2)
    assert det.status(key).flaps_total == 1
    det.identify(key, "cccc:0000:0000:0003")           # a VF re-plugged as another HCA
    clock.advance(30)
    det.observe(key, clock.mono, link_downed=40)       # that HCA's own history, not 38 new flaps
    assert det.status(key).flaps_total == 1


def test_a_state_file_keyed_by_device_name_is_still_read(tmp_path) -> None:
    clock = Clock()
    path = state_path(str(tmp_path))
    Path(path).write_text(json.dumps({"version": 1, "ports": {"mlx5_ib2/1": [clock.wall - 60, clock.wall - 30]}}),
                          encoding="utf-8")
    det = make(clock, path, threshold=2)
    det.identify(KEY, "aaaa:0000:0000:0001")
    assert det.status(KEY).window_flaps == 2
    det.observe(KEY, clock.mono, link_downed=0)
    assert set(json.loads(Path(path).read_text(encoding="utf-8"))["ports"]) == {"aaaa:0000:0000:0001/1"}


def test_a_detector_without_a_rule_yet_keeps_the_whole_loaded_window(tmp_path) -> None:
    """The collectors identify ports before the watcher's first run configures the rule: nothing may be
    cut (or written back cut) to the default 24 h in between."""
    clock = Clock()
    path = state_path(str(tmp_path))
    Path(path).write_text(json.dumps({"version": 1, "ports": {"aaaa:0000:0000:0001/1": [
        clock.wall - 3 * 86400, clock.wall - 2.5 * 86400, clock.wall - 2 * 86400]}}), encoding="utf-8")
    det = make(clock, path, window=None)
    det.identify(KEY, "aaaa:0000:0000:0001")
    det.observe(KEY, clock.mono, link_downed=0)          # a save may happen before the rule is known
    assert len(json.loads(Path(path).read_text(encoding="utf-8"))["ports"]["aaaa:0000:0000:0001/1"]) == 3
    det.configure(3, 7 * 86400)
    st = det.status(KEY)
    assert (st.window_flaps, st.flapping) == (3, True)
    assert "ib_port_flapping" not in [e.kind for e in det.drain_events()]   # known from before, not new


def test_names_swapping_in_a_running_process_move_each_window_with_its_hca(tmp_path) -> None:
    clock = Clock()
    det = make(clock, state_path(str(tmp_path)), threshold=2)
    a, b = ("mlx5_ib0", "1"), ("mlx5_ib1", "1")
    det.identify(a, "aaaa:0000:0000:0001")
    det.identify(b, "bbbb:0000:0000:0002")
    det.observe(b, clock.mono, link_downed=0)
    clock.advance(30)
    det.observe(b, clock.mono, link_downed=3)
    assert det.status(b).window_flaps == 3
    det.identify(a, "bbbb:0000:0000:0002")      # the VF of b re-plugged under a's name, and vice versa
    det.identify(b, "aaaa:0000:0000:0001")
    assert det.status(a).window_flaps == 3 and det.status(b).window_flaps == 0


def test_a_guid_that_cannot_be_read_once_keeps_the_port_identity(tmp_path) -> None:
    clock = Clock()
    det = make(clock, state_path(str(tmp_path)))
    det.identify(KEY, "aaaa:0000:0000:0001")
    det.observe(KEY, clock.mono, link_downed=1)
    det.identify(KEY, "")                          # a transient read error at rediscovery
    clock.advance(30)
    det.observe(KEY, clock.mono, link_downed=2)
    assert det.status(KEY).flaps_total == 1        # the baseline was kept: one flap, not a reset
