"""The fast state watcher and the infiniband collector feed one detector: flaps on a live simulated
tree are counted once, the flapping flag and the events follow, and the window survives a restart."""

from __future__ import annotations

import json
import os
import threading
import time

from gpumon.collectors.base import Context
from gpumon.collectors.infiniband import InfinibandCollector
from gpumon.collectors.linkflap import LinkflapCollector
from gpumon.config import Section
from gpumon.simulate.sysfs import build_tree
from tests.conftest import values, wait_for

KEY = ("mlx5_ib0", "1")




def setup(tmp_path, profile: str = "hbv4", **options):
    fabric = build_tree(profile, str(tmp_path / "sys"))
    ctx = Context("host", sysfs_root=str(tmp_path / "sys"), state_dir=str(tmp_path / "state"))
    watcher = LinkflapCollector(ctx, Section("linkflap", options) if options else None)
    return ctx, fabric, watcher, InfinibandCollector(ctx)


def test_defaults_and_own_interval(tmp_path) -> None:
    _, _, watcher, ib = setup(tmp_path)
    assert watcher.interval(10.0) == 1.0
    assert ib.interval(10.0) == 10.0
    assert InfinibandCollector.implies == ("linkflap",)
    assert watcher.probe().available
    assert LinkflapCollector(Context("h", sysfs_root=str(tmp_path / "none"))).probe().available is False


def test_quiet_ports_export_zeros(tmp_path) -> None:
    _, _, watcher, _ = setup(tmp_path, "nd-h100-v5")
    coll = watcher.collect()
    assert coll.events == [] and coll.errors == {}
    assert set(values(coll, "gpumon_ib_link_flaps_total").values()) == {0}
    assert len(values(coll, "gpumon_ib_port_flapping")) == 9
    assert values(coll, "gpumon_ib_last_flap_timestamp_seconds") == {}
    assert sum(len(f.samples) for f in coll.families) == 9 * 7  # series for nd-h100-v5
    assert all(type(s.value) is float for f in coll.families for s in f.samples)
    assert {f.spec for f in coll.families} <= set(LinkflapCollector.metrics())


def test_port_down_and_up_gives_events_a_flap_and_the_down_duration(tmp_path) -> None:
    _, fabric, watcher, ib = setup(tmp_path)
    ib.collect()
    watcher.collect()
    fabric.set_down("mlx5_ib0", 1)
    coll = watcher.collect()
    assert [e.kind for e in coll.events] == ["ib_link_down"]
    assert values(coll, "gpumon_ib_port_down_seconds")[KEY] >= 0
    ib.collect()  # link_downed +1 arrives via the counter collector while the port is down
    fabric.set_up("mlx5_ib0", 1)
    coll = watcher.collect()
    # link_downed counted the flap as the link went down; state and carrier join it as it returns.
    assert sorted(e.kind for e in coll.events) == ["ib_link_flap", "ib_link_up"]
    up = next(e for e in coll.events if e.kind == "ib_link_up")
    assert up.attributes["down_seconds"] >= 0
    assert values(coll, "gpumon_ib_link_flaps_total")[KEY] == 1
    assert values(coll, "gpumon_ib_port_last_down_duration_seconds")[KEY] >= 0
    signals = values(coll, "gpumon_ib_link_flap_signals_total")
    assert signals[KEY + ("state",)] == 1
    assert signals[KEY + ("link_downed",)] == 1
    assert signals[KEY + ("carrier_changes",)] == 1
    assert values(coll, "gpumon_ib_last_flap_timestamp_seconds")[KEY] > 1e9


def test_short_flap_is_seen_by_the_next_watch_run_and_counted_once(tmp_path) -> None:
    _, fabric, watcher, ib = setup(tmp_path)
    ib.collect()
    watcher.collect()
    fabric.flap("mlx5_ib0", 1)
    coll = watcher.collect()  # carrier_changes: visible within one watch interval
    assert values(coll, "gpumon_ib_link_flaps_total")[KEY] == 1
    flap = [e for e in coll.events if e.kind == "ib_link_flap"]
    assert len(flap) == 1 and flap[0].attributes["signals"] == ["carrier_changes"]
    ib.collect()  # link_downed +1: the same flap
    coll = watcher.collect()
    assert values(coll, "gpumon_ib_link_flaps_total")[KEY] == 1
    assert values(coll, "gpumon_ib_link_flap_signals_total")[KEY + ("link_downed",)] == 1


def test_without_carrier_the_counter_collector_still_catches_short_flaps(tmp_path) -> None:
    _, fabric, watcher, ib = setup(tmp_path, carrier_changes=False)
    ib.collect()
    watcher.collect()
    fabric.flap("mlx5_ib0", 1)
    assert values(watcher.collect(), "gpumon_ib_link_flaps_total")[KEY] == 0
    ib.collect()
    coll = watcher.collect()
    assert values(coll, "gpumon_ib_link_flaps_total")[KEY] == 1
    assert [e.attributes["signals"] for e in coll.events if e.kind == "ib_link_flap"] == [["link_downed"]]


def test_saturated_link_downed_falls_back_to_the_other_signals(tmp_path) -> None:
    _, fabric, watcher, ib = setup(tmp_path, "saturated-link-downed", carrier_changes=False)
    ib.collect()
    watcher.collect()
    for _ in range(2):
        fabric.set_down("mlx5_ib0", 1)
        watcher.collect()
        fabric.set_up("mlx5_ib0", 1)
        watcher.collect()
        ib.collect()
    coll = watcher.collect()
    assert values(coll, "gpumon_ib_link_flaps_total")[KEY] == 2
    assert values(coll, "gpumon_ib_link_flap_signals_total")[KEY + ("link_downed",)] == 0


def test_threshold_makes_the_port_flapping_and_it_survives_restart(tmp_path) -> None:
    ctx, fabric, watcher, _ = setup(tmp_path, flap_threshold=3)
    watcher.collect()
    events = []
    for _ in range(3):
        fabric.flap("mlx5_ib0", 1)
        coll = watcher.collect()
        events += coll.events
    assert values(coll, "gpumon_ib_port_flapping")[KEY] == 1
    assert values(coll, "gpumon_ib_port_flaps_in_window")[KEY] == 3
    assert [e.kind for e in events].count("ib_port_flapping") == 1
    with open(os.path.join(ctx.state_dir, "ib_flaps.json"), encoding="utf-8") as fh:
        saved = json.load(fh)["ports"]
    with open(os.path.join(ctx.sysfs_root, "class", "infiniband", "mlx5_ib0", "node_guid"), encoding="ascii") as fh:
        guid = fh.read().strip()
    assert len(saved[f"{guid}/1"]) == 3   # keyed on the HCA, not the device name

    restarted = Context("host", sysfs_root=ctx.sysfs_root, state_dir=ctx.state_dir)
    again = LinkflapCollector(restarted, Section("linkflap", {"flap_threshold": 3}))
    coll = again.collect()
    assert values(coll, "gpumon_ib_port_flapping")[KEY] == 1
    assert values(coll, "gpumon_ib_link_flaps_total")[KEY] == 0


def test_corrupt_state_file_is_counted_and_replaced(tmp_path) -> None:
    os.makedirs(tmp_path / "state")
    (tmp_path / "state" / "ib_flaps.json").write_text("{broken")
    _, _, watcher, _ = setup(tmp_path)
    coll = watcher.collect()
    assert coll.errors == {"state_corrupt": 1}
    assert json.loads((tmp_path / "state" / "ib_flaps.json").read_text())["version"] == 1


def test_bad_state_file_content_is_counted_and_the_rest_goes_on(tmp_path) -> None:
    _, fabric, watcher, _ = setup(tmp_path, "nd-a100-v4")
    with open(os.path.join(fabric.port_dir("mlx5_ib1"), "state"), "w", encoding="ascii") as fh:
        fh.write("garbage\n")
    coll = watcher.collect()
    assert coll.errors == {"parse": 1}
    assert len(values(coll, "gpumon_ib_link_flaps_total")) == 9


def test_vanished_device_series_are_withdrawn(tmp_path) -> None:
    _, fabric, watcher, _ = setup(tmp_path, "nd-a100-v4")
    watcher.collect()
    fabric.unplug("mlx5_ib7")
    coll = watcher.collect()
    assert ("mlx5_ib7", "1") not in values(coll, "gpumon_ib_link_flaps_total")
    fabric.replug("mlx5_ib7")
    assert ("mlx5_ib7", "1") in values(watcher.collect(), "gpumon_ib_link_flaps_total")


def test_both_collectors_on_their_own_threads_count_each_flap_once(tmp_path) -> None:
    """The loop's shape: each collector in its own thread; the simulation flaps meanwhile."""
    _, fabric, watcher, ib = setup(tmp_path, "nd-h100-v5")
    ib.collect()
    watcher.collect()
    stop = threading.Event()
    failures: list[BaseException] = []

    def loop(collector) -> None:
        try:
            while not stop.is_set():
                collector.collect()
        except BaseException as exc:  # surfaced by the assertion below
            failures.append(exc)

    threads = [threading.Thread(target=loop, args=(c,)) for c in (ib, watcher)]
    for t in threads:
        t.start()
    try:
        for _ in range(5):
            fabric.flap("mlx5_ib2", 1)
            fabric.tick(0.1)
            time.sleep(0.05)  # spacing the injected flaps, not waiting for a result
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not failures
    ib.collect()
    coll = watcher.collect()
    total = values(coll, "gpumon_ib_link_flaps_total")[("mlx5_ib2", "1")]
    signals = values(coll, "gpumon_ib_link_flap_signals_total")
    assert signals[("mlx5_ib2", "1", "link_downed")] == 5
    assert signals[("mlx5_ib2", "1", "carrier_changes")] == 5
    assert total == 5


def test_a_netdev_that_appears_after_the_hca_is_picked_up(tmp_path) -> None:
    """ib_ipoib loaded after gpumon started (or a udev rename): the netdev label and the
    carrier_changes signal follow without a restart."""
    ctx, fabric, watcher, ib = setup(tmp_path)
    ndir = fabric.netdev_dir("mlx5_ib0", 1)
    aside = str(tmp_path / "aside")
    os.rename(ndir, aside)
    info = values(ib.collect(), "gpumon_ib_port_info")
    assert [k[-1] for k in info if k[0] == "mlx5_ib0"] == [""]            # no netdev yet
    watcher.collect()
    os.rename(aside, ndir)
    info = values(ib.collect(), "gpumon_ib_port_info")
    assert [k[-1] for k in info if k[0] == "mlx5_ib0"] == ["ib0"]
    watcher.collect()
    with open(os.path.join(ndir, "carrier_changes"), encoding="ascii") as fh:
        before = int(fh.read())
    with open(os.path.join(ndir, "carrier_changes"), "w", encoding="ascii") as fh:
        fh.write(f"{before + 2}\n")                  # a flap only the netdev saw
    coll = watcher.collect()
    assert values(coll, "gpumon_ib_link_flap_signals_total")[KEY + ("carrier_changes",)] == 1


def test_the_detector_and_its_totals_survive_a_reload(tmp_path) -> None:
    """SIGHUP builds a new Context; the flap detector (totals, baselines, open outages) carries over
    when the state directory is the same, so gpumon_ib_link_flaps_total does not reset."""
    from gpumon.cli import schemas
    from gpumon.config import load
    from gpumon.daemon import Daemon

    fabric = build_tree("hbv4", str(tmp_path / "sys"))
    env = {"GPUMON_DAEMON_SYSFS_ROOT": str(tmp_path / "sys"), "GPUMON_DAEMON_STATE_DIR": str(tmp_path / "state"),
           "GPUMON_DAEMON_COLLECTORS": "infiniband", "GPUMON_DAEMON_SINKS": "",
           "GPUMON_LINKFLAP_WATCH_INTERVAL": "0.05", "GPUMON_DAEMON_INTERVAL": "0.05"}
    daemon = Daemon(load(schemas(), None, env, {}))
    daemon.start()
    try:
        def flaps() -> float | None:
            snap = daemon.loop.latest if daemon.loop else None
            fam = snap.family("gpumon_ib_link_flaps_total") if snap else None
            return next((s.value for s in fam.samples if s.label("device") == "mlx5_ib0"), None) if fam else None

        wait_for(lambda: flaps() == 0.0)
        fabric.flap("mlx5_ib0", 1)
        wait_for(lambda: flaps() == 1.0)
        detector = daemon.ctx.get_shared("flaps", lambda: None)
        daemon.reload(load(schemas(), None, {**env, "GPUMON_LINKFLAP_FLAP_THRESHOLD": "2"}, {}))
        assert daemon.ctx.get_shared("flaps", lambda: None) is detector
        wait_for(lambda: detector.threshold == 2)     # the new rule, applied on the first new run
        assert flaps() == 1.0
        fabric.flap("mlx5_ib0", 1)
        wait_for(lambda: flaps() == 2.0)
    finally:
        daemon.stop(timeout=3.0)


def test_a_week_long_window_is_whole_on_the_first_run_after_a_restart(tmp_path) -> None:
    fabric = build_tree("hbv4", str(tmp_path / "sys"))
    with open(os.path.join(fabric.device_dir("mlx5_ib0"), "node_guid"), encoding="ascii") as fh:
        guid = fh.read().strip()
    os.makedirs(tmp_path / "state")
    now = time.time()
    with open(tmp_path / "state" / "ib_flaps.json", "w", encoding="utf-8") as fh:
        json.dump({"version": 1, "ports": {f"{guid}/1": [now - 3 * 86400, now - 2.5 * 86400, now - 2 * 86400]}}, fh)
    ctx = Context("host", sysfs_root=str(tmp_path / "sys"), state_dir=str(tmp_path / "state"))
    ib = InfinibandCollector(ctx)
    ib.collect()                                   # identifies the ports before the watcher's rule is known
    watcher = LinkflapCollector(ctx, Section("linkflap", {"flap_window": 7 * 86400.0, "flap_threshold": 3}))
    coll = watcher.collect()
    assert values(coll, "gpumon_ib_port_flaps_in_window")[KEY] == 3
    assert values(coll, "gpumon_ib_port_flapping")[KEY] == 1
