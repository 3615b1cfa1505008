"""The simulated ND GB200 v6 host: 4 GB200 GPUs in one NVLink domain, 4 NDR InfiniBand ports, a power
swing, and NVLink fabric faults through the control directory."""

from __future__ import annotations

import os

import pytest

from gpumon.collectors.base import Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.simulate import HOSTS, Simulation, control
from tests.conftest import gpu_values


@pytest.fixture
def sim(tmp_path):
    s = Simulation("nd-gb200-v6", str(tmp_path))
    yield s
    s.stop()


def test_the_host_is_azures_nd_gb200_v6(sim) -> None:
    assert HOSTS["nd-gb200-v6"].gpu_count == 4
    nvml = sim.nvml
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 4
    assert nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA GB200"
    assert int(nvml.driver_version.split(".")[0]) >= 570   # Blackwell needs R570 or later
    ib = os.path.join(sim.sysfs_root, "class", "infiniband")
    devices = sorted(os.listdir(ib))
    assert devices == ["mlx5_an0", "mlx5_ib0", "mlx5_ib1", "mlx5_ib2", "mlx5_ib3"]
    for dev in devices[1:]:
        with open(os.path.join(ib, dev, "ports", "1", "rate"), encoding="utf-8") as fh:
            assert fh.read().strip() == "400 Gb/sec (4X NDR)"


def test_a_fabric_fault_dropped_in_the_control_directory_reaches_the_collector(sim) -> None:
    ctx = Context(hostname="sim", nvml=sim.nvml)
    c = NvmlCollector(ctx, None)
    sim.step(10)
    out = c.collect()
    assert gpu_values(out, "gpumon_gpu_fabric_health_condition", condition="degraded_bandwidth")["2"] == 0.0
    control(sim.workdir, {"action": "fabric", "gpu": 2, "health": {"degraded_bw": True}})
    control(sim.workdir, {"action": "fabric", "gpu": 3, "state": "in_progress"})
    control(sim.workdir, {"action": "fabric", "gpu": 9, "health": {"no_such_field": "true"}})  # ignored
    events = []
    for _ in range(12):
        sim.step(10)
        out = c.collect()
        events.extend(e for e in out.events if e.kind == "gpu_fabric_changed")
        if gpu_values(out, "gpumon_gpu_fabric_state").get("3") == 2.0 and \
                gpu_values(out, "gpumon_gpu_fabric_health_condition", condition="degraded_bandwidth")["2"] == 1.0:
            break
    assert gpu_values(out, "gpumon_gpu_fabric_health_condition", condition="degraded_bandwidth")["2"] == 1.0
    assert gpu_values(out, "gpumon_gpu_fabric_state")["3"] == 2.0
    assert {(e.subject["gpu"], e.attributes.get("condition", e.attributes["what"])) for e in events} >= \
        {("2", "degraded_bandwidth"), ("3", "state")}
    assert os.listdir(sim.control_dir) == []
    # the simulated host's power swings between 600 and 1200 W within each interval
    assert gpu_values(out, "gpumon_gpu_power_max_watts")["0"] - gpu_values(out, "gpumon_gpu_power_min_watts")["0"] > 500
    c.close()
