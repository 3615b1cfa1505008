"""PCIe AER on a sysfs tree laid out as the kernel lays it out (bus/pci/devices links into
devices/pci0000:00/<root port>/<switch up>/<switch down>/<endpoint>, class/infiniband/<dev>/device),
with aer_dev_* files from tests/fixtures/aer (format: linux Documentation/ABI/testing/
sysfs-bus-pci-devices-aer_stats): GPUs, the HCA and the bridges above them, labelled to join
gpumon_gpu_info and the IB series; few series by default; bad files counted; no AER is unavailable."""

from __future__ import annotations

from gpumon.collectors.aer import AerCollector
from gpumon.collectors.base import Context
from gpumon.model import Collection
from gpumon.sources.pci_aer import BadStats, parse_stats
from tests.fakes.aer_sysfs import SWITCH, build


def samples(out: Collection, name: str) -> list[dict[str, str]]:
    return [dict(s.labels) | {"value": s.value} for f in out.families if f.name == name for s in f.samples]


def test_gpus_hca_and_bridges_with_totals_and_only_nonzero_types(tmp_path):
    build(tmp_path)
    c = AerCollector(Context(hostname="t", sysfs_root=str(tmp_path)))
    assert c.probe().available
    out = c.collect()
    info = {s["sysfs_name"]: s for s in samples(out, "gpumon_pcie_function_info")}
    assert set(info) == {"0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:3b:00.0", "0000:02:01.0",
                         "0000:3c:00.0", "0000:80:02.0"}
    assert info["0000:3b:00.0"]["role"] == "gpu" and info["0000:3b:00.0"]["pci_bus_id"] == "00000000:3B:00.0"
    assert info["0000:3b:00.0"]["parent"] == "00000000:02:00.0"
    assert info["0000:3c:00.0"]["role"] == "hca" and info["0000:3c:00.0"]["device"] == "mlx5_0"
    assert info["0000:02:00.0"]["role"] == "bridge" and info["0000:00:01.0"]["parent"] == ""
    assert info["0000:80:02.0"]["role"] == "gpu"
    totals = samples(out, "gpumon_pcie_aer_errors_total")
    assert len(totals) == 3 * 7
    gpu = {s["severity"]: s["value"] for s in totals if s["pci_bus_id"] == "00000000:3B:00.0"}
    assert gpu == {"correctable": 4, "nonfatal": 1, "fatal": 0}
    types = {(s["severity"], s["type"]) for s in samples(out, "gpumon_pcie_aer_error_types_total")
             if s["pci_bus_id"] == "00000000:3B:00.0"}
    assert types == {("correctable", "BadTLP"), ("correctable", "BadDLLP"), ("nonfatal", "CmpltTO")}
    root = {s["severity"]: s["value"] for s in samples(out, "gpumon_pcie_aer_rootport_errors_total")}
    assert root == {"correctable": 7, "fatal": 0, "nonfatal": 1}
    assert out.errors == {}


def test_per_type_all_and_none(tmp_path):
    build(tmp_path)
    every = AerCollector(Context(hostname="t", sysfs_root=str(tmp_path)), {"per_type": "all"}).collect()
    assert len(samples(every, "gpumon_pcie_aer_error_types_total")) == 7 * (8 + 18 + 18)
    none = AerCollector(Context(hostname="t", sysfs_root=str(tmp_path)), {"per_type": "none"}).collect()
    assert samples(none, "gpumon_pcie_aer_error_types_total") == []


def test_a_bad_file_costs_its_function_only_and_is_logged_once(tmp_path, caplog):
    build(tmp_path)
    (tmp_path / SWITCH / "0000:3b:00.0" / "aer_dev_fatal").write_text("TOTAL_ERR_FATAL lots\n")
    c = AerCollector(Context(hostname="t", sysfs_root=str(tmp_path)))
    first, second = c.collect(), c.collect()
    assert first.errors == second.errors == {"parse": 1}
    assert len(samples(second, "gpumon_pcie_function_info")) == 6
    assert sum("aer_dev_fatal" in r.getMessage() for r in caplog.records) == 1


def test_parse_stats_splits_at_the_last_space_and_rejects_junk():
    assert parse_stats("Some Name 3\nTOTAL_ERR_COR 3\n") == {"Some Name": 3, "TOTAL_ERR_COR": 3}
    for junk in ("", "RxErr\n", "RxErr -1\n", "\x00\x01", f"RxErr {1 << 64}\n"):
        try:
            parse_stats(junk)
        except BadStats:
            continue
        raise AssertionError(f"accepted {junk!r}")


def test_no_aer_files_or_no_devices_is_unavailable(tmp_path):
    build(tmp_path / "noaer", aer=False)
    verdict = AerCollector(Context(hostname="t", sysfs_root=str(tmp_path / "noaer"))).probe()
    assert not verdict.available and "no AER statistics" in verdict.reason
    empty = AerCollector(Context(hostname="t", sysfs_root=str(tmp_path / "nothing"))).probe()
    assert not empty.available and "no NVIDIA GPU" in empty.reason
