"""Verdicts that outlive a daemon: restored ones say so with their age, ones about a GPU the host no
longer has are stale and count nowhere, a cleared finding's window starts afresh, and a simulated
reboot clears sticky verdicts under a running daemon."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading

from gpumon.health.catalogue import Level
from gpumon.health.rules import Thresholds
from gpumon.health.stage import HealthSettings, HealthStage
from gpumon.health.state import clear
from gpumon.model import CollectorStatus, Snapshot
from gpumon.report import health_table
from tests.fakes.simulated_host import SimulatedHost

ND_H100 = "Standard_ND96isr_H100_v5"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def stage(tmp_path, clock: Clock, boot: str = "boot-1", persist: bool = True, **kw) -> HealthStage:
    return HealthStage(str(tmp_path / "state"), HealthSettings(Thresholds(), hold_seconds=300.0, vm_size=ND_H100),
                       clock=clock, boot=boot, persist=persist, **kw)


def until(s: HealthStage, host: SimulatedHost, done):
    for _ in range(50):
        result = s.update(host.snapshot())
        if done(result):
            return result
        threading.Event().wait(0.02)
    raise AssertionError("the injected fault never reached the verdict")


def rules(findings) -> set[str]:
    return {f"{f['rule']}|{f['subject'].get('gpu', '')}" for f in findings}


def test_a_restored_verdict_says_so_with_its_age_until_seen_again(tmp_path, caplog) -> None:
    host, clock = SimulatedHost(str(tmp_path / "host")), Clock()
    first = stage(tmp_path, clock)
    first.update(host.snapshot())
    host.sim.apply({"action": "xid", "gpu": 3, "xid": 48})
    found = until(first, host, lambda r: r.verdict.level is Level.UNHEALTHY)
    assert found.verdict.findings[0]["restored"] is False

    clock.now += 3 * 3600 + 12 * 60  # the daemon restarts three hours later, same boot
    with caplog.at_level(logging.WARNING, logger="gpumon.health.stage"):
        second = stage(tmp_path, clock)
    assert "1 verdict(s) restored from" in caplog.text and "gpu.xid.48 gpu=3 unhealthy" in caplog.text
    assert "first seen 3h12m ago" in caplog.text
    result = second.update(host.snapshot())
    finding = result.verdict.findings[0]
    assert result.verdict.level is Level.UNHEALTHY  # a restored verdict still counts
    assert finding["restored"] is True and finding["age_seconds"] == 3 * 3600 + 12 * 60
    assert "restored from the state directory, first seen 3h12m ago" in result.events[0].message
    assert "3h12m restored" in health_table(result.verdict)

    # `gpumon health` (another process, read-only) shows what the daemon carried over
    looker = stage(tmp_path, clock, persist=False)
    assert looker.update(host.snapshot()).verdict.findings[0]["restored"] is True

    host.sim.apply({"action": "xid", "gpu": 3, "xid": 48})  # the condition happens again: live now
    seen = until(second, host, lambda r: not r.verdict.findings[0]["restored"])
    assert seen.verdict.level is Level.UNHEALTHY
    host.close()


def lost_on(tmp_path, clock: Clock) -> None:
    """A daemon that saw GPU 2 fall off the bus (its UUID known), then stopped."""
    host = SimulatedHost(str(tmp_path / "old-host"))
    s = stage(tmp_path, clock)
    s.update(host.snapshot())
    host.sim.apply({"action": "gpu_lost", "gpu": 2})
    # the lost GPU may be judged a run before its XID 79 arrives: wait for both findings
    result = until(s, host, lambda r: {"gpu.lost", "gpu.xid.79"} <= {f["rule"] for f in r.verdict.findings})
    assert next(f for f in result.verdict.findings if f["rule"] == "gpu.lost")["uuid"].startswith("GPU-")
    host.close()


def test_a_verdict_about_a_gpu_with_another_uuid_is_stale_and_counts_nowhere(tmp_path) -> None:
    clock = Clock()
    lost_on(tmp_path, clock)
    path = tmp_path / "state" / "health.json"
    doc = json.loads(path.read_text())
    for item in doc["active"]:
        if item["subject"] == [["gpu", "2"]]:
            item["uuid"] = "GPU-00000000-1111-2222-3333-444444444444"  # the board was replaced since
    path.write_text(json.dumps(doc))
    clock.now += 3600  # the node was down an hour: gpu.missing (held, not sticky) has run out

    host = SimulatedHost(str(tmp_path / "new-host"))  # every GPU answers
    result = stage(tmp_path, clock).update(host.snapshot())
    assert result.verdict.level is Level.OK and result.verdict.action == "none"
    assert rules(result.verdict.stale) == {"gpu.lost|2", "gpu.xid.79|2"} and not result.verdict.findings
    stale = next(f for f in result.verdict.stale if f["rule"] == "gpu.lost")
    assert stale["stale"].startswith("GPU 2 is GPU-") and "GPU-00000000-1111" in stale["stale"]
    state = next(f for f in result.families if f.name == "gpumon_health_state")
    assert {s.value for s in state.samples if s.label("gpu") == "2"} == {0.0}  # GPU 2's rules judged afresh
    assert result.verdict.as_dict()["stale"] and "Stale (about hardware" in health_table(result.verdict)
    host.close()


def no_gpu(snapshot: Snapshot) -> Snapshot:
    """The same host with no NVIDIA driver at all: the GPU collector has no source."""
    return dataclasses.replace(
        snapshot, families=tuple(f for f in snapshot.families if not f.name.startswith("gpumon_gpu")),
        collectors=tuple(CollectorStatus("nvml", False, 0.0, "NVML Shared Library Not Found", available=False)
                         if c.name == "nvml" else c for c in snapshot.collectors))


def test_a_sticky_verdict_on_a_host_without_that_gpu_is_stale_not_a_live_fault(tmp_path) -> None:
    clock = Clock()
    lost_on(tmp_path, clock)
    clock.now += 3600
    host = SimulatedHost(str(tmp_path / "no-gpu"), collectors=("nvml", "infiniband", "linkflap"))
    s = stage(tmp_path, clock)
    result = s.update(no_gpu(host.snapshot()))
    assert "gpu.lost|2" in rules(result.verdict.stale)
    assert next(f for f in result.verdict.stale if f["rule"] == "gpu.lost")["stale"] == "this host has no GPU 2 now"
    assert not any(f["subject"].get("gpu") for f in result.verdict.findings)
    assert not [e for e in result.events if "fell off the bus" in e.message]  # nothing CRITICAL about GPU 2
    # while the GPU collector is down (not absent), nothing can be said: the verdict counts as before
    down = dataclasses.replace(no_gpu(host.snapshot()), collectors=tuple(
        CollectorStatus("nvml", False, 0.0, "timeout") if c.name == "nvml" else c for c in host.snapshot().collectors))
    assert "gpu.lost|2" in rules(s.update(down).verdict.findings)
    host.close()


def test_clear_forgets_the_flap_window_so_the_finding_needs_new_flaps(tmp_path) -> None:
    host, clock = SimulatedHost(str(tmp_path / "host")), Clock()
    s = stage(tmp_path, clock)
    s.update(host.snapshot())
    for _ in range(5):
        host.sim.apply({"action": "flap", "device": "mlx5_ib0", "port": 1})
        clock.now += 60
        result = s.update(host.snapshot())
    assert "ib.port.flapping|" in rules(result.verdict.findings)

    assert clear(str(tmp_path / "state"), "ib.port.flapping") == ["ib.port.flapping|device=mlx5_ib0|port=1"]
    saved = json.loads((tmp_path / "state" / "health.json").read_text())
    assert "mlx5_ib0|1" not in saved["history"]["flap_times"]
    clock.now += 3
    after = s.update(host.snapshot())  # the running daemon takes the clear: no flap since, no finding
    assert after.verdict.level is Level.OK
    clock.now += 600
    assert s.update(host.snapshot()).verdict.level is Level.OK
    assert stage(tmp_path, clock).update(host.snapshot()).verdict.level is Level.OK  # nor after a restart

    for _ in range(5):  # new flaps bring it back
        host.sim.apply({"action": "flap", "device": "mlx5_ib0", "port": 1})
        clock.now += 60
        result = s.update(host.snapshot())
    assert "ib.port.flapping|" in rules(result.verdict.findings)
    host.close()


def test_a_simulated_reboot_clears_sticky_verdicts_under_a_running_daemon(tmp_path) -> None:
    host, clock = SimulatedHost(str(tmp_path / "host")), Clock()
    s = stage(tmp_path, clock, boot=host.sim.boot_id)
    s.update(host.snapshot())
    host.sim.apply({"action": "xid", "gpu": 2, "xid": 79})
    assert until(s, host, lambda r: r.verdict.level is Level.UNHEALTHY).verdict.action == "reboot"
    reloaded = threading.Event()
    host.sim.on_reboot = reloaded.set  # `gpumon run` reloads: the collectors start over on the host
    host.sim.apply({"action": "reboot"})
    assert reloaded.is_set()
    assert s.update(host.snapshot()).verdict.level is Level.UNHEALTHY  # the old loop, once more
    host.close()
    host.sim.stop()
    rebooted = SimulatedHost(str(tmp_path / "host"))  # the reload's view of the host, and a new stage
    result = stage(tmp_path, clock, boot=rebooted.sim.boot_id).update(rebooted.snapshot())
    assert result.verdict.level is Level.OK and result.verdict.findings == ()
    saved = json.loads((tmp_path / "state" / "health.json").read_text())
    assert saved["boot_id"] == rebooted.sim.boot_id == host.sim.boot_id and saved["active"] == []
    rebooted.close()
