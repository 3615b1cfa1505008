"""dcgm-exporter names from a simulated ND H100 v5 snapshot: values, units, labels, XID semantics."""

from __future__ import annotations

import dataclasses
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpumon.model import MetricFamily, MetricSpec, MetricType, Sample, Snapshot
from gpumon.sinks.prometheus.dcgm_compat import FIELDS, DcgmCompat
from tests.fakes.simulated_host import SimulatedOnce


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Snapshot:
    return SimulatedOnce(str(tmp_path_factory.mktemp("dcgm") / "state")).snapshot()


def parsed(text: str) -> dict[str, list]:
    return {fam.name: fam.samples for fam in text_string_to_metric_families(text)}


def gpumon_value(snap: Snapshot, name: str, gpu: str, **match: str) -> float:
    fam = snap.family(name)
    assert fam is not None, name
    for s in fam.samples:
        if s.label("gpu") == gpu and all(s.label(k) == v for k, v in match.items()):
            return s.value
    raise AssertionError(f"{name} {gpu} {match}")


def test_every_default_field_with_a_source_is_served_for_every_gpu(snapshot) -> None:
    got = parsed(DcgmCompat("nd-node").render(snapshot))
    expected = {f.name for f in FIELDS if snapshot.family(f.source.name) is not None and any(
        all(s.label(k) == v for k, v in f.match) for s in snapshot.family(f.source.name).samples)}
    assert len(expected) >= 20  # all but the encoder (gpumon reads no encoder utilisation)
    expected.add("DCGM_FI_DEV_XID_ERRORS")
    assert set(got) >= expected
    for name in expected:
        assert sorted(s.labels["gpu"] for s in got[name]) == [str(i) for i in range(8)], name


def test_units_are_dcgm_exporters(snapshot) -> None:
    got = parsed(DcgmCompat("nd-node").render(snapshot))

    def one(name: str) -> float:
        return next(s.value for s in got[name] if s.labels["gpu"] == "3")

    assert one("DCGM_FI_DEV_SM_CLOCK") == gpumon_value(snapshot, "gpumon_gpu_clock_hertz", "3", clock="sm") / 1e6
    assert one("DCGM_FI_DEV_GPU_UTIL") == pytest.approx(
        100 * gpumon_value(snapshot, "gpumon_gpu_utilization_ratio", "3", engine="gpu"))
    assert one("DCGM_FI_DEV_FB_USED") == pytest.approx(
        gpumon_value(snapshot, "gpumon_gpu_memory_used_bytes", "3") / 2**20)
    assert one("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION") == pytest.approx(
        1000 * gpumon_value(snapshot, "gpumon_gpu_energy_joules_total", "3"))
    assert one("DCGM_FI_DEV_GPU_TEMP") == gpumon_value(snapshot, "gpumon_gpu_temperature_celsius", "3", sensor="gpu")
    assert one("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL") == pytest.approx(
        gpumon_value(snapshot, "gpumon_gpu_nvlink_bytes_total", "3", direction="rx")
        + gpumon_value(snapshot, "gpumon_gpu_nvlink_bytes_total", "3", direction="tx"))


def test_identity_labels_are_dcgm_exporters(snapshot) -> None:
    got = parsed(DcgmCompat("nd-node").render(snapshot))
    sample = next(s for s in got["DCGM_FI_DEV_POWER_USAGE"] if s.labels["gpu"] == "5")
    info = next(s for s in snapshot.family("gpumon_gpu_info").samples if s.label("gpu") == "5")
    assert sample.labels == {
        "gpu": "5", "UUID": info.label("uuid"), "pci_bus_id": info.label("pci_bus_id"), "device": "nvidia5",
        "modelName": info.label("model"), "Hostname": "nd-node",
        "DCGM_FI_DRIVER_VERSION": info.label("driver_version")}


def with_family(snap: Snapshot, fam: MetricFamily) -> Snapshot:
    families = tuple(f for f in snap.families if f.name != fam.name) + (fam,)
    return dataclasses.replace(snap, families=families)


XID = MetricSpec("gpumon_gpu_xid_errors_total", MetricType.COUNTER, "XIDs", labels=("gpu", "uuid", "xid"))


def test_xid_errors_is_the_last_xid_not_a_count(snapshot) -> None:
    compat = DcgmCompat("nd-node")

    def xid_of(snap: Snapshot, gpu: str) -> tuple[float, str]:
        s = next(s for s in parsed(compat.render(snap))["DCGM_FI_DEV_XID_ERRORS"] if s.labels["gpu"] == gpu)
        return s.value, s.labels["err_code"]

    assert xid_of(snapshot, "2") == (0.0, "0")
    first = with_family(snapshot, MetricFamily(XID, (Sample((("gpu", "2"), ("uuid", "u"), ("xid", "79")), 1.0),)))
    assert xid_of(first, "2") == (79.0, "79")
    second = with_family(snapshot, MetricFamily(XID, (
        Sample((("gpu", "2"), ("uuid", "u"), ("xid", "79")), 1.0),
        Sample((("gpu", "2"), ("uuid", "u"), ("xid", "13")), 1.0))))
    assert xid_of(second, "2") == (13.0, "13")  # 13 came after 79
    assert xid_of(second, "1") == (0.0, "0")


ALLOC = MetricSpec("gpumon_gpu_allocation_info", MetricType.INFO, "who holds a GPU",
                   labels=("gpu", "uuid", "namespace", "pod", "container", "job_id"))


def test_attributed_gpus_carry_pod_or_hpc_job_one_series_per_holder(snapshot) -> None:
    snap = with_family(snapshot, MetricFamily(ALLOC, (
        Sample((("gpu", "0"), ("uuid", "u0"), ("namespace", "ml"), ("pod", "train-0"), ("container", "main"),
                ("job_id", "")), 1.0),
        Sample((("gpu", "1"), ("uuid", "u1"), ("namespace", ""), ("pod", ""), ("container", ""),
                ("job_id", "4242")), 1.0),
        Sample((("gpu", "1"), ("uuid", "u1"), ("namespace", ""), ("pod", ""), ("container", ""),
                ("job_id", "4243")), 1.0))))
    util = parsed(DcgmCompat("nd-node").render(snap))["DCGM_FI_DEV_GPU_UTIL"]
    g0 = [s.labels for s in util if s.labels["gpu"] == "0"]
    assert [(x["namespace"], x["pod"], x["container"]) for x in g0] == [("ml", "train-0", "main")]
    assert sorted(s.labels["hpc_job"] for s in util if s.labels["gpu"] == "1") == ["4242", "4243"]
    assert all("pod" not in s.labels and "hpc_job" not in s.labels for s in util if s.labels["gpu"] == "2")


def test_no_gpu_no_compat_families() -> None:
    assert DcgmCompat("h").render(Snapshot("h", 0.0, (), (), ())) == ""


def test_the_migration_guide_lists_every_name() -> None:
    from gpumon.sinks.prometheus.dcgm_compat import markdown_table
    from tests.conftest import REPO

    with open(os.path.join(REPO, "docs", "dcgm-exporter.md"), encoding="utf-8") as fh:
        assert markdown_table() in fh.read(), "regenerate with python -m gpumon.sinks.prometheus.dcgm_compat"


def test_relabelled_copies_of_a_series_are_summed_once(snapshot) -> None:
    """[attribution] labels = true gives a shared GPU's series once per holder; NVLink's total must
    still add rx and tx once each."""
    from gpumon.attribution_labels import relabel

    alloc = MetricFamily(ALLOC, tuple(
        Sample((("gpu", "1"), ("uuid", "u1"), ("namespace", "ml"), ("pod", p), ("container", "c"), ("job_id", "")),
               1.0) for p in ("a", "b")))
    snap = with_family(snapshot, alloc)
    relabelled = dataclasses.replace(snap, families=tuple(relabel(snap.families, alloc)))
    util = parsed(DcgmCompat("nd-node").render(relabelled))["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"]
    got = {s.labels["pod"]: s.value for s in util if s.labels["gpu"] == "1"}
    want = (gpumon_value(snapshot, "gpumon_gpu_nvlink_bytes_total", "1", direction="rx")
            + gpumon_value(snapshot, "gpumon_gpu_nvlink_bytes_total", "1", direction="tx"))
    assert got == {"a": pytest.approx(want), "b": pytest.approx(want)}
