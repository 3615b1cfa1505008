"""The attribution collector: kubelet, job mapping and processes, and what it does when they fail."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from gpumon.collectors.attribution import AttributionCollector
from gpumon.collectors.base import Context
from gpumon.collectors.gpu_directory import KEY, GpuDirectory, GpuEntry, GpuProcess
from gpumon.config import Section
from tests.fakes.kubelet import KubeletServer

U = [f"GPU-0000000{i}-1111-4222-8333-44445555666{i}" for i in range(4)]
MIG = "MIG-aaaaaaaa-bbbb-5ccc-8ddd-eeeeeeeeeeee"


def make(tmp_path, **options) -> tuple[AttributionCollector, GpuDirectory]:
    ctx = Context(hostname="h", state_dir=str(tmp_path))
    directory = ctx.get_shared(KEY, GpuDirectory)
    directory.publish(tuple(GpuEntry(str(i), U[i], f"00000000:0{i}:00.0") for i in range(3))
                      + (GpuEntry("3", U[3], "00000000:03:00.0", mig=((2, MIG),)),))
    values = {"kubelet_socket": "", "job_mapping_dir": "", "proc_root": str(tmp_path / "proc"),
              "interval": 1.0, "timeout": 0.5, **options}
    return AttributionCollector(ctx, Section("attribution", values)), directory


def rows(collection) -> set[tuple[str, ...]]:
    fams = [f for f in collection.families if f.name == "gpumon_gpu_allocation_info"]
    return {tuple(v for _, v in s.labels) for f in fams for s in f.samples}


def source_up(collection) -> dict[str, float]:
    fam = next(f for f in collection.families if f.name == "gpumon_attribution_source_up")
    return {s.label("source"): s.value for s in fam.samples}


@pytest.fixture
def kubelet(tmp_path):
    with KubeletServer(str(tmp_path / "kubelet.sock")) as server:
        yield server


def test_pods_hold_whole_gpus_replicas_and_mig_instances(tmp_path, kubelet) -> None:
    kubelet.behaviour.pods = [
        kubelet.pod("ml", "train-0", {"main": [("nvidia.com/gpu", [U[0], U[1]])]}),
        kubelet.pod("dev", "nb-a", {"nb": [("nvidia.com/gpu.shared", [f"{U[2]}::0"])]}),
        kubelet.pod("dev", "nb-b", {"nb": [("nvidia.com/gpu.shared", [f"{U[2]}::1"])]}),
        kubelet.pod("dev", "mig", {"c": [("nvidia.com/mig-1g.10gb", [MIG])]}),
        kubelet.pod("x", "other", {"c": [("rdma/ib", ["ib0"])]}),
    ]
    collector, _ = make(tmp_path, kubelet_socket=kubelet.socket_path, processes=False)
    out = collector.collect()
    collector.close()
    assert rows(out) == {
        ("0", U[0], "", "ml", "train-0", "main", ""), ("1", U[1], "", "ml", "train-0", "main", ""),
        ("2", U[2], "", "dev", "nb-a", "nb", ""), ("2", U[2], "", "dev", "nb-b", "nb", ""),
        ("3", U[3], "2", "dev", "mig", "c", "")}
    assert source_up(out) == {"kubelet": 1.0}


def test_a_failing_kubelet_keeps_the_last_answer_three_intervals_then_withdraws(tmp_path, kubelet) -> None:
    kubelet.behaviour.pods = [kubelet.pod("ml", "p", {"c": [("nvidia.com/gpu", [U[0]])]})]
    collector, _ = make(tmp_path, kubelet_socket=kubelet.socket_path, processes=False, interval=0.5)
    now = [100.0]
    collector.clock = lambda: now[0]
    assert len(rows(collector.collect())) == 1
    kubelet.behaviour.fail = grpc.StatusCode.UNAVAILABLE
    failing = collector.collect()
    assert len(rows(failing)) == 1 and source_up(failing) == {"kubelet": 0.0}
    assert failing.errors == {"kubelet": 1}
    now[0] += 0.5 * 3 - 0.1  # just under three intervals since the last answer: still kept
    assert len(rows(collector.collect())) == 1
    now[0] += 0.2
    assert rows(collector.collect()) == set()
    collector.close()


def test_a_hung_kubelet_does_not_outlive_the_timeout(tmp_path, kubelet) -> None:
    kubelet.behaviour.hang = threading.Event()
    collector, _ = make(tmp_path, kubelet_socket=kubelet.socket_path, processes=False, timeout=0.2)
    start = time.monotonic()
    out = collector.collect()
    assert time.monotonic() - start < 2
    assert out.errors == {"kubelet": 1}
    kubelet.behaviour.hang.set()
    collector.close()


def test_job_mapping_directory_names_jobs_and_skips_malformed_files(tmp_path) -> None:
    d = tmp_path / "map"
    d.mkdir()
    (d / "0").write_text("1001\n")
    (d / "1").write_text("1001\n")
    (d / "3.2").write_text("2002\n")
    (d / "2").write_bytes(b"\xff")
    collector, _ = make(tmp_path, job_mapping_dir=str(d))
    out = collector.collect()
    assert rows(out) == {("0", U[0], "", "", "", "", "1001"), ("1", U[1], "", "", "", "", "1001"),
                         ("3", U[3], "2", "", "", "", "2002")}
    assert out.errors == {"job_mapping_malformed": 1}
    assert source_up(out) == {"job_mapping": 1.0}


def test_processes_name_slurm_jobs_and_containers_by_cgroup(tmp_path) -> None:
    proc = tmp_path / "proc"
    for pid, text in ((100, "0::/system.slice/slurmstepd.scope/job_555/step_0/user/task_0\n"),
                      (200, "0::/system.slice/docker-" + "ab" * 32 + ".scope\n"),
                      (300, "0::/user.slice/user-1000.slice/session-1.scope\n")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(text)
    collector, directory = make(tmp_path)
    directory.publish((GpuEntry("0", U[0], processes=(GpuProcess(100), GpuProcess(999))),
                       GpuEntry("1", U[1], processes=(GpuProcess(200), GpuProcess(300)))))
    out = collector.collect()
    assert rows(out) == {("0", U[0], "", "", "", "", "555"), ("1", U[1], "", "", "", "abababababab", "")}
    assert source_up(out) == {"processes": 1.0}


def test_unavailable_without_any_source(tmp_path) -> None:
    collector, _ = make(tmp_path, kubelet_socket=str(tmp_path / "none.sock"))
    if os.path.exists("/dev/nvidiactl"):
        pytest.fail("this test host unexpectedly has an NVIDIA driver")
    availability = collector.probe()
    assert not availability.available and "kubelet" in availability.reason


def test_without_grpcio_the_kubelet_source_is_down_and_processes_still_attribute(tmp_path, kubelet,
                                                                                  monkeypatch, caplog) -> None:
    """grpcio is the optional `attribution` extra: a node with the kubelet socket but no grpcio still
    attributes jobs by process, and says what to install, once."""
    import sys

    monkeypatch.setitem(sys.modules, "grpc", None)  # as if grpcio were not installed
    proc = tmp_path / "proc" / "100"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_555/step_0/user/task_0\n")
    collector, directory = make(tmp_path, kubelet_socket=kubelet.socket_path)
    directory.publish((GpuEntry("0", U[0], processes=(GpuProcess(100),)),))
    for _ in range(2):
        out = collector.collect()
    assert rows(out) == {("0", U[0], "", "", "", "", "555")}
    assert source_up(out) == {"kubelet": 0.0, "processes": 1.0}
    assert out.errors == {"kubelet_grpc_missing": 1}
    assert sum("gpumon-exporter[attribution]" in r.getMessage() for r in caplog.records) == 1


def test_a_hostile_kubelets_huge_names_and_pod_count_are_cut_and_counted(tmp_path, kubelet, caplog) -> None:
    # the two attacks as found (each alone fits gRPC's 4 MiB message limit): one pod named with 3.9 MB,
    # then 46,694 one-GPU pods on the node's GPUs
    pb = kubelet.pb
    kubelet.behaviour.pods = [kubelet.pod("ml", "p" * 3_900_000, {"main": [("nvidia.com/gpu", [U[0]])]}),
                              kubelet.pod("ml", "fine", {"main": [("nvidia.com/gpu", [U[2]])]})]
    collector, _ = make(tmp_path, kubelet_socket=kubelet.socket_path, processes=False, timeout=10.0, interval=30.0)
    out = collector.collect()
    assert rows(out) == {("0", U[0], "", "ml", "p" * 253, "main", ""),       # Kubernetes' longest name
                         ("2", U[2], "", "ml", "fine", "main", "")}
    assert out.errors == {"kubelet_name_cut": 1}

    device = pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[U[1]])
    kubelet.behaviour.pods = [pb.PodResources(name=f"p{i}", namespace="n", containers=[
        pb.ContainerResources(name="c", devices=[device])]) for i in range(46_694)]
    many = collector.collect()
    again = collector.collect()
    collector.close()
    assert len(rows(many)) == 64 and {r[0] for r in rows(many)} == {"1"}   # bounded per GPU ...
    assert many.errors == {"holders_cut": 46_694 - 64}                      # ... and counted, every run
    assert again.errors == many.errors and rows(again) == rows(many)        # the same holders kept
    logged = [r.getMessage() for r in caplog.records if "attribution:" in r.getMessage()]
    assert len(logged) == 2 and all(len(m) < 300 for m in logged)           # once each, no name in them
