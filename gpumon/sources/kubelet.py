"""The kubelet's PodResources API v1: which pod and container hold which device.

Served by the kubelet on a unix socket (``/var/lib/kubelet/pod-resources/kubelet.sock``), gRPC
service ``v1.PodResourcesLister`` (``List``, ``GetAllocatableResources``; GA since Kubernetes 1.28).
Field numbers are those of ``k8s.io/kubelet/pkg/apis/podresources/v1/api.proto``; a restatement of it
(``tests/fakes/kubelet_podresources.proto``) the tests compile with protoc to serve real messages. The
messages are read with :mod:`gpumon.sources.protowire`, so no generated code ties gpumon to one
protobuf runtime. ``grpcio`` is imported only when a client is made.
"""

from __future__ import annotations

import builtins
import os
import re
from dataclasses import dataclass
from typing import Any

from gpumon.sources.protowire import LEN, WireError, fields, text

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
SERVICE = "/v1.PodResourcesLister/"
MAX_NAME = 253
"""The longest name Kubernetes allows (a pod's: a DNS-1123 subdomain, 253 characters; namespaces and
containers are DNS-1123 labels, 63). A longer pod, namespace or container name (only a hostile or
broken kubelet sends one) is cut to this length and the allocation marked ``cut``: the names become
label values on every GPU series with ``[attribution] labels = true``."""
# The kubelet limits this API to 100 QPS with a burst of 10 (pkg/kubelet/apis/podresources/constants.go):
# one List and one GetAllocatableResources per attribution run are far below it.


@dataclass(frozen=True)
class ClaimDevice:
    """One device of a dynamic resource claim (DRA): ``driver/pool/device`` and its CDI names."""

    driver: str
    pool: str
    device: str
    cdi_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Allocation:
    """One device held by one container: a device-plugin id or a DRA claim's device."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str
    claim: ClaimDevice | None = None
    cut: bool = False
    """A name was longer than :data:`MAX_NAME` and was cut."""


class PodResourcesError(Exception):
    """The kubelet could not be asked or answered something that is not a PodResources reply."""


# ---------------------------------------------------------------------------------- decoding


def _strings(raw: bytes, wanted: dict[int, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for number, wire, value in fields(raw):
        name = wanted.get(number)
        if name is not None and wire == LEN:
            out.setdefault(name, []).append(text(value))
    return out


def _container_devices(raw: bytes) -> tuple[str, list[str]]:
    """ContainerDevices{resource_name=1, device_ids=2, topology=3}."""
    got = _strings(raw, {1: "resource", 2: "ids"})
    return (got.get("resource") or [""])[-1], got.get("ids", [])


def _claim_resource(raw: bytes) -> ClaimDevice:
    """ClaimResource{cdi_devices=1 CDIDevice{name=1}, driver_name=2, pool_name=3, device_name=4}."""
    cdi: list[str] = []
    got: dict[str, str] = {}
    for number, wire, value in fields(raw):
        if wire != LEN:
            continue
        if number == 1:
            cdi += _strings(value, {1: "name"}).get("name", [])  # type: ignore[arg-type]
        elif number in (2, 3, 4):
            got[{2: "driver", 3: "pool", 4: "device"}[number]] = text(value)
    return ClaimDevice(got.get("driver", ""), got.get("pool", ""), got.get("device", ""), tuple(cdi))


def _dynamic_resource(raw: bytes) -> list[ClaimDevice]:
    """DynamicResource{claim_name=2, claim_namespace=3, claim_resources=4} (field 1 is a tombstone)."""
    return [_claim_resource(value) for number, wire, value in fields(raw)
            if number == 4 and wire == LEN and isinstance(value, bytes)]


def _name(raw: bytes) -> tuple[str, bool]:
    """A pod, namespace or container name, and whether it had to be cut to :data:`MAX_NAME`
    (decoding only what is kept: a 4 MB name costs no 4 MB string)."""
    if len(raw) <= MAX_NAME:
        return text(raw), False
    return raw[:MAX_NAME].decode("utf-8", "ignore"), True  # "ignore": a character split by the cut


def _container(raw: bytes, namespace: str, pod: str, cut: bool) -> list[Allocation]:
    """ContainerResources{name=1, devices=2, cpu_ids=3, memory=4, dynamic_resources=5}."""
    name = ""
    devices: list[tuple[str, list[str]]] = []
    claims: list[ClaimDevice] = []
    for number, wire, value in fields(raw):
        if wire != LEN or not isinstance(value, bytes):
            continue
        if number == 1:
            name, long_name = _name(value)
            cut = cut or long_name
        elif number == 2:
            devices.append(_container_devices(value))
        elif number == 5:
            claims += _dynamic_resource(value)
    out = [Allocation(namespace, pod, name, resource, device_id, cut=cut)
           for resource, ids in devices for device_id in ids]
    out += [Allocation(namespace, pod, name, claim.driver, claim.device, claim, cut) for claim in claims]
    return out


def parse_list_response(raw: bytes) -> list[Allocation]:
    """ListPodResourcesResponse{pod_resources=1 PodResources{name=1, namespace=2, containers=3}}."""
    out: list[Allocation] = []
    try:
        for number, wire, pod_raw in fields(raw):
            if number != 1 or wire != LEN or not isinstance(pod_raw, bytes):
                continue
            pod = namespace = ""
            cut = long_name = False
            containers: list[bytes] = []
            for n, w, value in fields(pod_raw):
                if w != LEN or not isinstance(value, bytes):
                    continue
                if n == 1:
                    pod, long_name = _name(value)
                    cut = cut or long_name
                elif n == 2:
                    namespace, long_name = _name(value)
                    cut = cut or long_name
                elif n == 3:
                    containers.append(value)
            for container in containers:
                out += _container(container, namespace, pod, cut)
    except WireError as exc:
        raise PodResourcesError(f"malformed ListPodResourcesResponse: {exc}") from exc
    return out


def parse_allocatable_response(raw: bytes) -> dict[str, list[str]]:
    """AllocatableResourcesResponse{devices=1 ContainerDevices}: device ids by resource name."""
    out: dict[str, list[str]] = {}
    try:
        for number, wire, value in fields(raw):
            if number == 1 and wire == LEN and isinstance(value, bytes):
                resource, ids = _container_devices(value)
                out.setdefault(resource, []).extend(ids)
    except WireError as exc:
        raise PodResourcesError(f"malformed AllocatableResourcesResponse: {exc}") from exc
    return out


# ------------------------------------------------------------------------- NVIDIA device ids

_REPLICA = re.compile(r"^(?P<base>.+?)::(?P<n>\d+)$")
_LEGACY_MIG = re.compile(r"^MIG-(?P<gpu>GPU-[0-9a-fA-F-]+)/(?P<gi>\d+)/(?P<ci>\d+)$")


@dataclass(frozen=True)
class NvidiaDevice:
    """What an NVIDIA device-plugin id names: a GPU (by UUID) or a MIG device, maybe a replica."""

    gpu_uuid: str = ""
    mig_uuid: str = ""
    gpu_instance: int | None = None
    replica: int | None = None


def parse_nvidia_device_id(device_id: str) -> NvidiaDevice | None:
    """``GPU-<uuid>``, ``GPU-<uuid>::<n>`` (time-slicing/MPS replica: split on the first ``::``),
    ``MIG-<uuid>`` or the legacy ``MIG-GPU-<uuid>/<gi>/<ci>`` (k8s-device-plugin
    internal/rm/device_map.go and api/config/v1/replicas.go); None for anything else."""
    replica = None
    match = _REPLICA.match(device_id)
    if match:
        device_id, replica = match["base"], int(match["n"])
    legacy = _LEGACY_MIG.match(device_id)
    if legacy:
        return NvidiaDevice(gpu_uuid=legacy["gpu"], gpu_instance=int(legacy["gi"]), replica=replica)
    if device_id.startswith("MIG-"):
        return NvidiaDevice(mig_uuid=device_id, replica=replica)
    if device_id.startswith("GPU-"):
        return NvidiaDevice(gpu_uuid=device_id, replica=replica)
    return None


def is_nvidia_resource(name: str) -> bool:
    """``nvidia.com/gpu``, ``nvidia.com/gpu.shared`` (renamed replicas), ``nvidia.com/mig-*``."""
    return name.startswith("nvidia.com/gpu") or name.startswith("nvidia.com/mig-")


# ---------------------------------------------------------------------------------- the client


class PodResourcesClient:
    """A gRPC channel to the kubelet's socket; each call has a deadline and never hangs a run."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET) -> None:
        import grpc  # only when Kubernetes attribution is on

        self.socket_path = socket_path
        self._grpc = grpc
        self._channel = grpc.insecure_channel(f"unix://{os.path.abspath(socket_path)}")
        self._list = self._channel.unary_unary(
            SERVICE + "List", request_serializer=_empty, response_deserializer=bytes)
        self._allocatable = self._channel.unary_unary(
            SERVICE + "GetAllocatableResources", request_serializer=_empty, response_deserializer=bytes)

    def list(self, timeout: float) -> list[Allocation]:
        return parse_list_response(self._call(self._list, timeout))

    def allocatable(self, timeout: float) -> dict[str, builtins.list[str]]:  # list: the method above
        return parse_allocatable_response(self._call(self._allocatable, timeout))

    def _call(self, method: Any, timeout: float) -> bytes:
        try:
            return bytes(method(b"", timeout=timeout))
        except self._grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = getattr(code, "name", "UNKNOWN")
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise PodResourcesError(f"kubelet {name}: {details}") from exc

    def close(self) -> None:
        self._channel.close()


def _empty(_: Any) -> bytes:
    return b""  # ListPodResourcesRequest and AllocatableResourcesRequest have no fields
