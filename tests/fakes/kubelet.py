"""A stand-in kubelet: a real grpcio server speaking PodResources v1 on a unix socket.

The messages come from ``tests/fakes/kubelet_podresources.proto`` compiled by protoc (grpcio-tools) at
test time, so what the server sends is real protobuf, independent of gpumon's hand-written reader.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

_HERE = os.path.dirname(os.path.abspath(__file__))
_lock = threading.Lock()
_compiled: Any = None


def messages() -> Any:
    """The compiled ``kubelet_podresources_pb2`` module (compiled once per test session)."""
    global _compiled
    with _lock:
        if _compiled is None:
            from grpc_tools import protoc

            out = tempfile.mkdtemp(prefix="gpumon-kubelet-pb-")
            rc = protoc.main(["protoc", f"-I{_HERE}", f"--python_out={out}", "kubelet_podresources.proto"])
            if rc != 0:
                raise RuntimeError(f"protoc failed with {rc}")
            sys.path.insert(0, out)
            try:
                _compiled = importlib.import_module("kubelet_podresources_pb2")
            finally:
                sys.path.remove(out)
        return _compiled


@dataclass
class Behaviour:
    """What the stand-in answers; tests change it while the server runs."""

    pods: list[Any] = field(default_factory=list)
    allocatable: list[Any] = field(default_factory=list)
    fail: grpc.StatusCode | None = None
    hang: threading.Event | None = None  # when set: List waits on it (a hung kubelet)
    garbage: bytes | None = None  # when set: List answers these bytes instead of a message
    calls: int = 0


class KubeletServer:
    """``with KubeletServer(path) as k: k.behaviour.pods = [...]``."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.behaviour = Behaviour()
        self.pb = messages()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handlers = {
            "List": grpc.unary_unary_rpc_method_handler(
                self._list, request_deserializer=lambda b: b, response_serializer=lambda b: b),
            "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
                self._allocatable, request_deserializer=lambda b: b,
                response_serializer=lambda m: m.SerializeToString()),
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v1.PodResourcesLister", handlers),))
        self._server.add_insecure_port(f"unix://{socket_path}")

    def _list(self, _request: bytes, context: grpc.ServicerContext) -> bytes:
        b = self.behaviour
        b.calls += 1
        if b.hang is not None:
            b.hang.wait(10)
        if b.fail is not None:
            context.abort(b.fail, "stand-in kubelet failing on purpose")
        if b.garbage is not None:
            return b.garbage
        return self.pb.ListPodResourcesResponse(pod_resources=b.pods).SerializeToString()

    def _allocatable(self, _request: bytes, context: grpc.ServicerContext) -> Any:
        if self.behaviour.fail is not None:
            context.abort(self.behaviour.fail, "stand-in kubelet failing on purpose")
        return self.pb.AllocatableResourcesResponse(devices=self.behaviour.allocatable)

    def pod(self, namespace: str, name: str, containers: dict[str, list[tuple[str, list[str]]]],
            claims: dict[str, list[dict]] | None = None) -> Any:
        """A PodResources message: containers map to (resource, device ids) pairs, and optionally
        to DRA claim resources (dicts of ClaimResource fields)."""
        pb = self.pb
        out = []
        for cname, devices in containers.items():
            dyn = [pb.DynamicResource(claim_name=f"{cname}-claim", claim_namespace=namespace,
                                      claim_resources=[pb.ClaimResource(**c) for c in claims[cname]])
                   ] if claims and cname in claims else []
            out.append(pb.ContainerResources(
                name=cname, cpu_ids=[2, 3],
                devices=[pb.ContainerDevices(resource_name=r, device_ids=ids,
                                             topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=0)]))
                         for r, ids in devices],
                dynamic_resources=dyn))
        return pb.PodResources(name=name, namespace=namespace, containers=out)

    def __enter__(self) -> KubeletServer:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.behaviour.hang is not None:
            self.behaviour.hang.set()
        self._server.stop(grace=None).wait(5)
