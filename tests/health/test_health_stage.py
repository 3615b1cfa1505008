"""The health stage on a simulated ND H100 v5: verdicts, stickiness, hold times, persistence."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from gpumon.health.catalogue import Level
from gpumon.health.rules import Thresholds
from gpumon.health.stage import HealthSettings, HealthStage
from gpumon.health.state import clear
from tests.fakes.simulated_host import SimulatedHost
from tests.support.health_stage import ND_H100, Clock, Host, stage, until


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return Host(tmp_path_factory.mktemp("health-host"))


def series(result, rule: str) -> dict[tuple[str, str, str], float]:
    fam = next(f for f in result.families if f.name == "gpumon_health_state")
    return {(s.label("gpu"), s.label("device"), s.label("port")): s.value for s in fam.samples
            if s.label("rule") == rule}


def test_a_healthy_nd_h100_v5_is_healthy_with_a_series_per_gpu_and_port(tmp_path, host) -> None:
    result = stage(tmp_path, Clock()).update(host.snapshot())
    assert result.verdict.level is Level.OK and result.verdict.sku == "ND H100 v5"
    assert result.events == ()
    assert len(series(result, "gpu.lost")) == 8
    assert len(series(result, "ib.port.down")) == 8  # the Ethernet mlx5_an0 is not judged
    assert set(series(result, "ib.port.rate").values()) == {0.0}
    assert series(result, "gpu.missing") == {("", "", ""): 0.0}
    node = next(f for f in result.families if f.name == "gpumon_node_health")
    assert node.samples[0].value == 0


def test_xid_48_is_unhealthy_sticky_and_survives_a_restart_until_cleared(tmp_path) -> None:
    host, clock = Host(tmp_path), Clock()
    s = stage(tmp_path, clock)
    s.update(host.snapshot())
    host.sim.apply({"action": "xid", "gpu": 3, "xid": 48})
    result = until(s, host, lambda r: r.verdict.level is not Level.OK)
    assert result.verdict.level is Level.UNHEALTHY and result.verdict.action == "reset_gpu"
    assert series(result, "gpu.xid.48") == {("3", "", ""): 2.0}
    (event,) = result.events
    assert event.kind == "health_changed" and event.attributes["current"] == "unhealthy"
    assert "XID 48" in event.message
    clock.now += 3600  # an XID is an event: the count does not rise again, the verdict stays
    again = s.update(host.snapshot())
    assert again.verdict.level is Level.UNHEALTHY and again.events == ()
    restarted = stage(tmp_path, clock)  # same boot
    assert restarted.update(host.snapshot()).verdict.level is Level.UNHEALTHY
    assert clear(str(tmp_path / "state"), "gpu.xid.48") == ["gpu.xid.48|gpu=3"]
    cleared = restarted.update(host.snapshot())
    assert cleared.verdict.level is Level.OK
    assert cleared.events[0].attributes["previous"] == "unhealthy"


def test_a_reboot_clears_sticky_verdicts(tmp_path) -> None:
    host, clock = Host(tmp_path), Clock()
    s = stage(tmp_path, clock)
    s.update(host.snapshot())
    host.sim.apply({"action": "xid", "gpu": 1, "xid": 95})
    assert until(s, host, lambda r: r.verdict.level is not Level.OK).verdict.level is Level.UNHEALTHY
    assert stage(tmp_path, clock, boot="boot-2").update(host.snapshot()).verdict.level is Level.OK


def test_gpu_lost_is_unhealthy_with_reboot(tmp_path) -> None:
    host, clock = Host(tmp_path), Clock()
    s = stage(tmp_path, clock)
    host.sim.apply({"action": "xid", "gpu": 2, "xid": 79})
    verdict = s.update(host.snapshot()).verdict
    assert verdict.level is Level.UNHEALTHY and verdict.action == "reboot"
    assert any(f["rule"] == "gpu.lost" and f["subject"] == {"gpu": "2"} for f in verdict.findings)


def test_a_port_down_clears_itself_after_the_hold_time(tmp_path) -> None:
    host, clock = Host(tmp_path), Clock()
    s = stage(tmp_path, clock)
    s.update(host.snapshot())
    host.sim.apply({"action": "port_down", "device": "mlx5_ib4", "port": 1})
    down = s.update(host.snapshot())
    assert down.verdict.level is Level.UNHEALTHY and down.verdict.action == "check_fabric"
    assert series(down, "ib.port.down")[("", "mlx5_ib4", "1")] == 2.0
    host.sim.apply({"action": "port_up", "device": "mlx5_ib4", "port": 1})
    clock.now += 60
    assert s.update(host.snapshot()).verdict.level is Level.UNHEALTHY  # within the hold time
    clock.now += 300
    back = s.update(host.snapshot())
    assert back.verdict.level is Level.OK and back.events[0].attributes["current"] == "ok"


def test_five_flaps_in_a_day_is_flapping(tmp_path) -> None:
    host, clock = Host(tmp_path), Clock()
    s = stage(tmp_path, clock)
    s.update(host.snapshot())
    for _ in range(4):
        host.sim.apply({"action": "flap", "device": "mlx5_ib0", "port": 1})
        clock.now += 60
        assert s.update(host.snapshot()).verdict.level is Level.OK
    host.sim.apply({"action": "flap", "device": "mlx5_ib0", "port": 1})
    result = s.update(host.snapshot())
    assert result.verdict.level is Level.DEGRADED
    assert series(result, "ib.port.flapping")[("", "mlx5_ib0", "1")] == 1.0


def test_unknown_vm_size_takes_the_first_healthy_run_as_baseline(tmp_path, host) -> None:
    clock = Clock()
    result = stage(tmp_path, clock, vm_size="Standard_Unknown_v9").update(host.snapshot())
    assert result.verdict.sku == "baseline" and result.verdict.level is Level.OK
    with open(tmp_path / "state" / "health.json", encoding="utf-8") as fh:
        baseline = json.load(fh)["baseline"]
    assert baseline == {"gpus": 8, "gpu_model": "NVIDIA H100 80GB HBM3", "ib_ports": 8, "ib_rate_gbps": 400,
                        "pcie_gen": 5, "pcie_width": 16, "vm_size": "Standard_Unknown_v9"}


def test_no_baseline_while_the_gpu_collector_is_not_up(tmp_path, host) -> None:
    """A driver still loading at boot: the GPUs are absent because NVML is not up yet, which must not
    become the norm the node is held to; a resize takes the baseline again."""
    snap = host.snapshot()
    down = dataclasses.replace(snap, collectors=tuple(
        dataclasses.replace(c, ok=False, available=False, error="Driver Not Loaded") if c.name == "nvml" else c
        for c in snap.collectors), families=tuple(f for f in snap.families if not f.name.startswith("gpumon_gpu")))
    clock = Clock()
    s = stage(tmp_path, clock, vm_size="Standard_Unknown_v9")
    assert s.update(down).verdict.sku == ""
    assert s.update(snap).verdict.sku == "baseline"
    resized = stage(tmp_path, clock, vm_size="Standard_Unknown_v10")
    resized.update(snap)
    with open(tmp_path / "state" / "health.json", encoding="utf-8") as fh:
        assert json.load(fh)["baseline"]["vm_size"] == "Standard_Unknown_v10"


def test_a_smaller_node_than_its_vm_size_is_unhealthy(tmp_path, host) -> None:
    """An ND H200 v5 that shows H100s is the wrong hardware; the inventory rules say so."""
    result = stage(tmp_path, Clock(), vm_size="Standard_ND96isr_H200_v5").update(host.snapshot())
    assert result.verdict.level is Level.DEGRADED
    assert any(f["rule"] == "gpu.model" for f in result.verdict.findings)


def test_the_vm_size_comes_from_the_host_identity_on_the_snapshot(tmp_path, host) -> None:
    """No ``[health] vm_size``: the identity the loop stamped says ND H200 v5, and the H100s are wrong."""
    from gpumon.model import AzureInstance, HostIdentity

    h200 = HostIdentity(AzureInstance("id", "Standard_ND96isr_H200_v5", "eastus2", "n", "r"), asked=True)
    result = stage(tmp_path, Clock(), vm_size="").update(dataclasses.replace(host.snapshot(), identity=h200))
    assert any(f["rule"] == "gpu.model" for f in result.verdict.findings)
    unknown = stage(tmp_path / "unknown", Clock(), vm_size="").update(
        dataclasses.replace(host.snapshot(), identity=HostIdentity()))  # not looked yet: no inventory held
    assert not any(f["rule"] == "gpu.model" for f in unknown.verdict.findings)


def test_a_corrupt_state_file_is_set_aside(tmp_path, host, caplog) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "health.json").write_text("{not json")
    result = stage(tmp_path, Clock()).update(host.snapshot())
    assert result.verdict.level is Level.OK
    assert [p for p in os.listdir(state) if p.startswith("health.json.corrupt-")]
    assert "not a health state" in caplog.text


def test_disabled_rules_are_not_evaluated(tmp_path, host) -> None:
    result = stage(tmp_path, Clock(), disabled=frozenset({"ib.port.down"})).update(host.snapshot())
    assert series(result, "ib.port.down") == {}


def test_nvlink_fabric_faults_on_gb200(tmp_path) -> None:
    """The fabric call is a slow one (about every 5th run): each step collects until it shows."""
    host, clock = SimulatedHost(str(tmp_path / "gb"), profile="nd-gb200-v6"), Clock()
    s = stage(tmp_path, clock, vm_size="Standard_ND128isr_NDR_GB200_v6")

    def until(predicate):
        for _ in range(12):
            clock.now += 10
            result = s.update(host.snapshot())
            if predicate(result):
                return result
        raise AssertionError("the fabric fault never showed")

    assert s.update(host.snapshot()).verdict.level is Level.OK
    host.sim.apply({"action": "fabric", "gpu": 1, "health": {"degraded_bw": "true"}})
    degraded = until(lambda r: series(r, "gpu.fabric.health").get(("1", "", "")) == 1.0)
    assert degraded.verdict.level is Level.DEGRADED and degraded.verdict.action == "check_fabric"
    host.sim.apply({"action": "fabric", "gpu": 2, "health": {"route_unhealthy": "true"}})
    assert until(lambda r: r.verdict.level is Level.UNHEALTHY).verdict.action == "check_fabric"
    host.sim.apply({"action": "fabric", "gpu": 3, "state": "in_progress"})
    until(lambda r: series(r, "gpu.fabric.registration").get(("3", "", "")) == 1.0)


def test_the_guide_lists_every_rule_xid_and_vm_size() -> None:
    from gpumon.health.doc import markdown
    from tests.conftest import REPO

    with open(os.path.join(REPO, "docs", "health.md"), encoding="utf-8") as fh:
        assert markdown() in fh.read(), "regenerate with python -m gpumon.health.doc"


def test_kernel_log_xids_are_judged_per_gpu_by_pci_address(tmp_path, host) -> None:
    """gpumon_kmsg_xid_errors_total names the GPU by PCI address: each GPU's count is followed on
    its own, and the finding names the GPU index that gpumon_gpu_info gives that address."""
    from gpumon.model import MetricFamily, MetricSpec, MetricType, Sample

    spec = MetricSpec("gpumon_kmsg_xid_errors_total", MetricType.COUNTER, "x", labels=("pci_bus_id", "xid"))
    snap = host.snapshot()
    info = {s.label("gpu"): s.label("pci_bus_id") for s in snap.family("gpumon_gpu_info").samples}

    def with_kmsg(counts: dict[str, float]):
        fam = MetricFamily(spec, tuple(Sample((("pci_bus_id", info[g].lower()), ("xid", "94")), v)
                                       for g, v in counts.items()))
        return dataclasses.replace(snap, families=snap.families + (fam,))

    clock = Clock()
    s = stage(tmp_path, clock)
    s.update(with_kmsg({"1": 0.0, "2": 0.0}))
    first = s.update(with_kmsg({"1": 1.0, "2": 0.0}))
    assert [f["subject"] for f in first.verdict.findings if f["rule"] == "gpu.xid.94"] == [{"gpu": "1"}]
    clock.now += 600
    again = s.update(with_kmsg({"1": 1.0, "2": 0.0}))
    assert again.events == ()  # the count did not rise again: no new finding, no flip-flop


def test_a_read_only_stage_leaves_a_corrupt_state_file_where_it_is(tmp_path, host) -> None:
    """`gpumon once` and `gpumon health` read the daemon's state and never change it."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "health.json").write_text("{not json")
    settings = HealthSettings(Thresholds(), hold_seconds=300.0, vm_size=ND_H100)
    result = HealthStage(str(state), settings, clock=Clock(), boot="boot-1", persist=False).update(host.snapshot())
    assert result.verdict.level is Level.OK
    assert os.listdir(state) == ["health.json"]
