"""`gpumon run --simulate` with attribution: pods and jobs from the control directory, a real kubelet
socket when one is configured, and the join documented in docs/collectors/attribution.md."""

from __future__ import annotations

import re

from gpumon.simulate import control
from tests.conftest import wait_for
from tests.fakes.kubelet import KubeletServer
from tests.support.attribution import allocation_rows


def test_simulated_pods_and_jobs_from_the_control_directory(gpumon_run, tmp_path) -> None:
    process = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1", env={"GPUMON_ATTRIBUTION_INTERVAL": "1"})
    sim = str(tmp_path / "state" / "simulate" / "nd-h100-v5")
    control(sim, {"action": "allocate", "gpu": 0, "namespace": "ml", "pod": "train-0", "container": "main"})
    control(sim, {"action": "allocate", "gpu": 5, "job_id": "4242"})
    wanted = {("0", "ml", "train-0", "main", ""), ("5", "", "", "", "4242")}
    wait_for(lambda: allocation_rows(process.metrics()) == wanted, timeout=20)
    control(sim, {"action": "release", "gpu": 0})
    wait_for(lambda: allocation_rows(process.metrics()) == {("5", "", "", "", "4242")}, timeout=20)


def test_a_configured_kubelet_socket_is_used_under_simulate(gpumon_run, tmp_path) -> None:
    socket_path = str(tmp_path / "kubelet.sock")
    with KubeletServer(socket_path) as kubelet:
        process = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1",
                             env={"GPUMON_ATTRIBUTION_INTERVAL": "1", "GPUMON_ATTRIBUTION_KUBELET_SOCKET": socket_path})
        page = process.metrics()
        uuids = dict(re.findall(r'gpumon_gpu_info\{gpu="(\d+)",uuid="([^"]+)"', page))
        wait_for(lambda: len(uuids) == 8 or uuids.update(
            re.findall(r'gpumon_gpu_info\{gpu="(\d+)",uuid="([^"]+)"', process.metrics())), timeout=20)
        kubelet.behaviour.pods = [kubelet.pod("ml", "trainer", {"main": [("nvidia.com/gpu", [uuids["2"], uuids["3"]])]})]
        wanted = {("2", "ml", "trainer", "main", ""), ("3", "ml", "trainer", "main", "")}
        wait_for(lambda: allocation_rows(process.metrics()) == wanted, timeout=20)
        assert 'gpumon_attribution_source_up{source="kubelet"} 1' in process.metrics()


def test_labels_on_every_gpu_series_and_gpu_events_name_the_holder(gpumon_run, tmp_path) -> None:
    process = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1",
                         env={"GPUMON_ATTRIBUTION_INTERVAL": "1", "GPUMON_ATTRIBUTION_LABELS": "true"})
    sim = str(tmp_path / "state" / "simulate" / "nd-h100-v5")
    control(sim, {"action": "allocate", "gpu": 2, "namespace": "ml", "pod": "train-0", "container": "main"})
    util = re.compile(r'^gpumon_gpu_power_watts\{gpu="2",.*namespace="ml",pod="train-0",container="main",'
                      r'job_id=""\} ', re.M)
    wait_for(lambda: util.search(process.metrics()), timeout=20)
    page = process.metrics()
    assert re.search(r'^gpumon_gpu_power_watts\{gpu="3",.*namespace="",pod="",container="",job_id=""\} ',
                     page, re.M)  # a GPU nobody holds: the labels are there, empty
    assert "gpumon_ib_port_state{" in page and 'gpumon_ib_port_state{device="mlx5_ib0",port="1"}' in page
    control(sim, {"action": "xid", "gpu": 2, "xid": 48})
    wait_for(lambda: 'xid="48"' in process.metrics(), timeout=20)
    code, output = process.stop()
    assert code == 0
    line = next(line for line in output.splitlines() if "XID 48" in line and "gpu_xid" in line)
    assert "pod=train-0" in line and "namespace=ml" in line


def test_a_hostile_kubelets_huge_pod_name_costs_253_characters_a_series(gpumon_run, tmp_path) -> None:
    """`[attribution] labels = true` with a kubelet naming a pod with 3.9 MB (the page reached 355 MB):
    the name is cut to Kubernetes' 253 characters on every GPU series, and the cut is counted."""
    socket_path = str(tmp_path / "kubelet.sock")
    with KubeletServer(socket_path) as kubelet:
        process = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1",
                             env={"GPUMON_ATTRIBUTION_INTERVAL": "1", "GPUMON_ATTRIBUTION_KUBELET_SOCKET": socket_path,
                                  "GPUMON_ATTRIBUTION_LABELS": "true"})
        uuids: dict[str, str] = {}
        wait_for(lambda: len(uuids) == 8 or uuids.update(
            re.findall(r'gpumon_gpu_info\{gpu="(\d+)",uuid="([^"]+)"', process.metrics())), timeout=20)
        kubelet.behaviour.pods = [kubelet.pod("ml", "p" * 3_900_000, {"main": [("nvidia.com/gpu", [uuids["0"]])]})]
        wait_for(lambda: ("0", "ml", "p" * 253, "main", "") in allocation_rows(process.metrics()), timeout=20)
        page = process.metrics()
        assert len(page) < 4_000_000 and "p" * 254 not in page
        assert 'reason="kubelet_name_cut"' in page
