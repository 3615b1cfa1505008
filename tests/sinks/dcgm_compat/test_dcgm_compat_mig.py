"""dcgm-exporter compat under MIG: a simulated ND H100 v5 with GPU 0 split into three GPU instances.

dcgm-exporter's default ``--devices f`` serves a MIG GPU per GPU instance, labelled GPU_I_PROFILE
and GPU_I_ID (NVIDIA/dcgm-exporter d5e5f51: internal/pkg/devicemonitoring/device_monitoring.go,
internal/pkg/rendermetrics/render_metrics.go); gpumon_gpu_mig_* are the instances' own values.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpumon.model import MetricFamily, MetricSpec, MetricType, Sample, Snapshot
from gpumon.simulate import control
from gpumon.sinks.prometheus.dcgm_compat import DcgmCompat
from tests.fakes.simulated_host import SimulatedOnce

INSTANCES = ["7", "8", "9"]  # the double's GPU instance ids (gpumon/simulate/nvml.py set_mig)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Snapshot:
    state = str(tmp_path_factory.mktemp("dcgm-mig") / "state")
    os.makedirs(state)
    # dropped before the host starts: the simulation applies it before gpumon discovers the GPUs
    control(os.path.join(state, "simulate", "nd-h100-v5"), {"action": "mig", "gpu": 0, "instances": 3})
    return SimulatedOnce(state).snapshot()


def parsed(text: str) -> dict[str, list]:
    return {fam.name: fam.samples for fam in text_string_to_metric_families(text)}


def mig_value(snap: Snapshot, name: str, gi: str, **match: str) -> float:
    fam = snap.family(name)
    assert fam is not None, name
    return next(s.value for s in fam.samples if s.label("gpu") == "0" and s.label("gpu_instance") == gi
                and all(s.label(k) == v for k, v in match.items()))


def test_gpumon_names_each_mig_device_with_its_profile(snapshot) -> None:
    info = snapshot.family("gpumon_gpu_mig_info")
    assert info is not None
    assert sorted((s.label("gpu_instance"), s.label("compute_instance"), s.label("profile")) for s in info.samples) \
        == [(gi, "0", "1g.10gb") for gi in INSTANCES]
    assert all((s.label("mig_uuid") or "").startswith("MIG-") for s in info.samples)


def test_a_mig_gpu_is_served_once_per_gpu_instance_with_profile_and_id(snapshot) -> None:
    got = parsed(DcgmCompat("nd-node").render(snapshot))
    temps = got["DCGM_FI_DEV_GPU_TEMP"]
    gpu0 = [s.labels for s in temps if s.labels["gpu"] == "0"]
    assert sorted(x["GPU_I_ID"] for x in gpu0) == INSTANCES     # no series for the whole GPU
    assert {x["GPU_I_PROFILE"] for x in gpu0} == {"1g.10gb"}
    others = [s.labels for s in temps if s.labels["gpu"] != "0"]
    assert len(others) == 7 and all("GPU_I_ID" not in x and "GPU_I_PROFILE" not in x for x in others)
    # a device-wide field repeats the GPU's own value on each of its instances
    temp = next(s.value for s in snapshot.family("gpumon_gpu_temperature_celsius").samples
                if s.label("gpu") == "0" and s.label("sensor") == "gpu")
    assert {s.value for s in temps if s.labels["gpu"] == "0"} == {temp}


def test_the_mig_labels_sit_where_dcgm_exporter_puts_them(snapshot) -> None:
    """After modelName, before the host (render_metrics.go's template)."""
    line = next(x for x in DcgmCompat("nd-node").render(snapshot).splitlines()
                if x.startswith("DCGM_FI_DEV_POWER_USAGE{") and 'GPU_I_ID="8"' in x)
    names = [part.split("=")[0] for part in line[line.index("{") + 1:line.index("}")].split('",')]
    assert names == ["gpu", "UUID", "pci_bus_id", "device", "modelName", "GPU_I_PROFILE", "GPU_I_ID", "Hostname",
                     "DCGM_FI_DRIVER_VERSION"]


def test_framebuffer_and_profiling_fields_are_each_instances_own(snapshot) -> None:
    got = parsed(DcgmCompat("nd-node").render(snapshot))

    def per_instance(name: str) -> dict[str, float]:
        return {s.labels["GPU_I_ID"]: s.value for s in got[name] if s.labels["gpu"] == "0"}

    mib = 2.0 ** 20
    for gi in INSTANCES:
        total = mig_value(snapshot, "gpumon_gpu_mig_memory_total_bytes", gi)
        used = mig_value(snapshot, "gpumon_gpu_mig_memory_used_bytes", gi)
        assert per_instance("DCGM_FI_DEV_FB_USED")[gi] == pytest.approx(used / mib)
        assert per_instance("DCGM_FI_DEV_FB_FREE")[gi] == pytest.approx((total - used) / mib)
        assert total < 16 * 2**30                                  # an instance's memory, not the GPU's 80 GB
        for field, activity in (("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "graphics"),
                                ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor"),
                                ("DCGM_FI_PROF_DRAM_ACTIVE", "dram_bandwidth")):
            assert per_instance(field)[gi] == pytest.approx(
                mig_value(snapshot, "gpumon_gpu_mig_activity_ratio", gi, activity=activity)), field


def test_fields_without_a_per_instance_value_are_absent_under_mig(snapshot) -> None:
    """DCGM leaves DCGM_FI_DEV_*_UTIL blank for GPU instances (dcgm-exporter issues #50, #105), and
    the whole GPU's framebuffer is not an instance's."""
    got = parsed(DcgmCompat("nd-node").render(snapshot))
    for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_FB_RESERVED"):
        gpus = {s.labels["gpu"] for s in got[name]}
        assert "0" not in gpus and len(gpus) == 7, name
    xid = [s for s in got["DCGM_FI_DEV_XID_ERRORS"] if s.labels["gpu"] == "0"]
    assert sorted(s.labels["GPU_I_ID"] for s in xid) == INSTANCES and {s.value for s in xid} == {0.0}


ALLOC = MetricSpec("gpumon_gpu_allocation_info", MetricType.INFO, "who holds a GPU",
                   labels=("gpu", "uuid", "gpu_instance", "namespace", "pod", "container", "job_id"))


def test_a_pod_or_job_holding_an_instance_labels_only_that_instances_series(snapshot) -> None:
    """dcgm-exporter maps a MIG device to its holder by GPU and GPU instance (internal/pkg/
    transformation/hpc.go: ``<GPU>.<GPU_I_ID>`` files; collector/types.go GetIDOfType)."""
    alloc = MetricFamily(ALLOC, (
        Sample((("gpu", "0"), ("uuid", "u0"), ("gpu_instance", "8"), ("namespace", "ml"), ("pod", "infer-1"),
                ("container", "main"), ("job_id", "")), 1.0),
        Sample((("gpu", "0"), ("uuid", "u0"), ("gpu_instance", "9"), ("namespace", ""), ("pod", ""),
                ("container", ""), ("job_id", "4242")), 1.0)))
    snap = dataclasses.replace(snapshot, families=snapshot.families + (alloc,))
    used = [s.labels for s in parsed(DcgmCompat("nd-node").render(snap))["DCGM_FI_DEV_FB_USED"]
            if s.labels["gpu"] == "0"]
    by_gi = {x["GPU_I_ID"]: (x.get("pod"), x.get("hpc_job")) for x in used}
    assert by_gi == {"7": (None, None), "8": ("infer-1", None), "9": (None, "4242")}
