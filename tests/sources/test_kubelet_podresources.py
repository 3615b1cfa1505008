"""The PodResources reader against a real gRPC server speaking the kubelet's v1 messages."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from gpumon.sources.kubelet import (
    Allocation,
    NvidiaDevice,
    PodResourcesClient,
    PodResourcesError,
    is_nvidia_resource,
    parse_list_response,
    parse_nvidia_device_id,
)
from gpumon.sources.protowire import WireError, fields
from tests.fakes.kubelet import KubeletServer, messages

UUID0 = "GPU-8a3b0c2e-6f1d-4b7a-9c5e-0d1f2a3b4c5d"
UUID1 = "GPU-1f2e3d4c-5b6a-4789-8abc-def012345678"
MIG = "MIG-4f6a1c2b-3d5e-5f70-8192-a3b4c5d6e7f8"


@pytest.fixture
def kubelet(tmp_path):
    path = os.path.join(str(tmp_path), "kubelet.sock")
    with KubeletServer(path) as server:
        yield server


def test_list_names_pod_container_and_every_kind_of_nvidia_device(kubelet) -> None:
    kubelet.behaviour.pods = [
        kubelet.pod("ml", "trainer-0", {"main": [("nvidia.com/gpu", [UUID0, UUID1])],
                                        "sidecar": [("example.com/foo", ["foo-1"])]}),
        kubelet.pod("dev", "notebook", {"nb": [("nvidia.com/gpu.shared", [f"{UUID0}::3"])]}),
        kubelet.pod("dev", "mig-user", {"c": [("nvidia.com/mig-1g.10gb", [MIG])]}),
        kubelet.pod("empty", "no-devices", {"c": []}),
    ]
    client = PodResourcesClient(kubelet.socket_path)
    try:
        got = client.list(timeout=5)
    finally:
        client.close()
    assert Allocation("ml", "trainer-0", "main", "nvidia.com/gpu", UUID0) in got
    assert Allocation("ml", "trainer-0", "main", "nvidia.com/gpu", UUID1) in got
    assert Allocation("ml", "trainer-0", "sidecar", "example.com/foo", "foo-1") in got
    assert Allocation("dev", "notebook", "nb", "nvidia.com/gpu.shared", f"{UUID0}::3") in got
    assert Allocation("dev", "mig-user", "c", "nvidia.com/mig-1g.10gb", MIG) in got
    assert len(got) == 5


def test_dynamic_resource_claims_are_read(kubelet) -> None:
    pb = messages()
    kubelet.behaviour.pods = [kubelet.pod("dra", "p", {"c": []}, claims={"c": [
        {"driver_name": "gpu.nvidia.com", "pool_name": "node-1", "device_name": "gpu-3",
         "cdi_devices": [pb.CDIDevice(name="k8s.gpu.nvidia.com/gpu=gpu-3")]}]})]
    client = PodResourcesClient(kubelet.socket_path)
    try:
        (alloc,) = client.list(timeout=5)
    finally:
        client.close()
    assert (alloc.namespace, alloc.pod, alloc.container) == ("dra", "p", "c")
    assert alloc.claim is not None
    assert (alloc.claim.driver, alloc.claim.pool, alloc.claim.device) == ("gpu.nvidia.com", "node-1", "gpu-3")
    assert alloc.claim.cdi_devices == ("k8s.gpu.nvidia.com/gpu=gpu-3",)


def test_allocatable_tells_which_ids_are_gpus(kubelet) -> None:
    pb = messages()
    kubelet.behaviour.allocatable = [
        pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[UUID0, UUID1]),
        pb.ContainerDevices(resource_name="rdma/ib", device_ids=["ib0"])]
    client = PodResourcesClient(kubelet.socket_path)
    try:
        assert client.allocatable(timeout=5) == {"nvidia.com/gpu": [UUID0, UUID1], "rdma/ib": ["ib0"]}
    finally:
        client.close()


def test_a_failing_kubelet_is_an_error_naming_the_status(kubelet) -> None:
    kubelet.behaviour.fail = grpc.StatusCode.UNAVAILABLE
    client = PodResourcesClient(kubelet.socket_path)
    try:
        with pytest.raises(PodResourcesError, match="UNAVAILABLE"):
            client.list(timeout=5)
    finally:
        client.close()


def test_a_hung_kubelet_is_cut_at_the_deadline(kubelet) -> None:
    kubelet.behaviour.hang = threading.Event()
    client = PodResourcesClient(kubelet.socket_path)
    start = time.monotonic()
    try:
        with pytest.raises(PodResourcesError, match="DEADLINE_EXCEEDED"):
            client.list(timeout=0.3)
    finally:
        client.close()
        kubelet.behaviour.hang.set()
    assert time.monotonic() - start < 3


def test_garbage_from_the_kubelet_is_a_clear_error(kubelet) -> None:
    kubelet.behaviour.garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length far past the end
    client = PodResourcesClient(kubelet.socket_path)
    try:
        with pytest.raises(PodResourcesError, match="malformed"):
            client.list(timeout=5)
    finally:
        client.close()


def test_no_socket_is_an_error_not_a_hang(tmp_path) -> None:
    client = PodResourcesClient(os.path.join(str(tmp_path), "absent.sock"))
    start = time.monotonic()
    try:
        with pytest.raises(PodResourcesError):
            client.list(timeout=1)
    finally:
        client.close()
    assert time.monotonic() - start < 5


def test_reader_matches_protobuf_on_unknown_future_fields() -> None:
    """A newer kubelet adds fields (pod-level cpu_ids=4, memory=5): the reader skips them."""
    pb = messages()
    msg = pb.ListPodResourcesResponse(pod_resources=[pb.PodResources(
        name="p", namespace="n", cpu_ids=[1, 2, 3],
        memory=[pb.ContainerMemory(memory_type="memory", size=1 << 30)],
        containers=[pb.ContainerResources(name="c", devices=[pb.ContainerDevices(
            resource_name="nvidia.com/gpu", device_ids=[UUID0])])])])
    assert parse_list_response(msg.SerializeToString()) == [
        Allocation("n", "p", "c", "nvidia.com/gpu", UUID0)]


def test_wire_reader_refuses_truncation() -> None:
    with pytest.raises(WireError):
        list(fields(b"\x08\x80"))  # a varint cut short
    with pytest.raises(WireError):
        list(fields(b"\x0b"))  # wire type 3 (group): not in proto3


@pytest.mark.parametrize(("device_id", "expected"), [
    (UUID0, NvidiaDevice(gpu_uuid=UUID0)),
    (f"{UUID0}::0", NvidiaDevice(gpu_uuid=UUID0, replica=0)),
    (f"{UUID0}::12", NvidiaDevice(gpu_uuid=UUID0, replica=12)),
    (MIG, NvidiaDevice(mig_uuid=MIG)),
    (f"MIG-{UUID1}/7/0", NvidiaDevice(gpu_uuid=UUID1, gpu_instance=7)),
    ("ib0", None),
])
def test_nvidia_device_ids(device_id: str, expected: NvidiaDevice | None) -> None:
    assert parse_nvidia_device_id(device_id) == expected


def test_nvidia_resource_names() -> None:
    assert all(is_nvidia_resource(n) for n in ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb"))
    assert not any(is_nvidia_resource(n) for n in ("amd.com/gpu", "rdma/ib", "nvidia.com/foo"))
