"""Which pod, container or Slurm job holds each GPU: the join series ``gpumon_gpu_allocation_info``.

Every source the host has is used, each optional:

- **Kubernetes**: the kubelet's PodResources API (:mod:`gpumon.sources.kubelet`): whole GPUs,
  time-sliced replicas, MIG devices and DRA claims, by device id.
- **Slurm**: a job-mapping directory in dcgm-exporter's format (:mod:`gpumon.sources.jobmap`),
  kept by the prolog and epilog under ``deploy/slurm/``.
- **Processes**: with no mapping directory, the compute processes NVML reported on each GPU, by
  cgroup (:mod:`gpumon.sources.cgroup`): the Slurm job, or the container as a fallback.

GPU identities and processes come from the NVML collector's last run through the shared
:class:`~gpumon.collectors.gpu_directory.GpuDirectory`: no NVML call is made here. A kubelet that
fails keeps its last good answer for at most three intervals, then its allocations are withdrawn:
never stale for long.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from gpumon.catalogue.host import (
    ALLOCATION,
)
from gpumon.catalogue.host import (
    ATTRIBUTION_SOURCE_UP as SOURCE_UP,
)
from gpumon.collectors.base import Availability, Collector, Context
from gpumon.collectors.gpu_directory import KEY as DIRECTORY_KEY
from gpumon.collectors.gpu_directory import GpuDirectory, GpuEntry
from gpumon.config import Option, Section, SectionSchema
from gpumon.log_once import LogOnce
from gpumon.model import Collection, MetricSpec, StateReason
from gpumon.sources import cgroup, jobmap, kubelet

log = logging.getLogger(__name__)


KEEP_STALE_INTERVALS = 3
MAX_HOLDERS_PER_GPU = 64
"""Holders kept per GPU (MPS serves at most 48 clients a GPU; time-slicing replicas and MIG instances
are fewer in practice). Past it, the rest are dropped and counted (``holders_cut``): a kubelet that
lists 46,000 pods on one GPU must not multiply every GPU series by 46,000."""
STALE_DIRECTORY = 300.0
"""Seconds after which the NVML collector's GPU list is too old to attribute by."""
_GPU_N = re.compile(r"^gpu-(\d+)$")
_UUID_IN = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F-]{27}")


@dataclass(frozen=True)
class Holder:
    """One allocation row: a GPU (or MIG instance) and who holds it."""

    gpu: str
    uuid: str
    gpu_instance: str = ""
    namespace: str = ""
    pod: str = ""
    container: str = ""
    job_id: str = ""


@dataclass(frozen=True)
class AttributionSettings:
    interval: float
    kubelet_socket: str
    job_mapping_dir: str
    processes: bool
    proc_root: str
    timeout: float
    labels: bool


OPTIONS = SectionSchema("attribution", "Workload attribution.", (
    Option("interval", float, 10.0, "Seconds between attribution runs.", min=0.5, max=3600.0),
    Option("kubelet_socket", str, kubelet.DEFAULT_SOCKET,
           "The kubelet's PodResources socket; absent means no Kubernetes attribution."),
    Option("job_mapping_dir", str, "",
           "A dcgm-exporter style job-mapping directory (one file per GPU index, job ids as lines); "
           "empty: Slurm jobs are found through the GPUs' processes instead."),
    Option("processes", bool, True,
           "Attribute GPUs through their compute processes' cgroups (Slurm jobs, containers)."),
    Option("proc_root", str, "/proc", "Where /proc is (/host/proc in a container)."),
    Option("timeout", float, 2.0, "Seconds one kubelet call may take.", min=0.05, max=60.0),
    Option("labels", bool, False,
           "Also put namespace, pod, container and job_id on every per-GPU series, as dcgm-exporter "
           "does. Multiplies those series by the holders per GPU: see docs/collectors/attribution.md."),
), AttributionSettings)


class AttributionCollector(Collector):
    name: ClassVar[str] = "attribution"
    description: ClassVar[str] = "Pods, containers and Slurm jobs holding each GPU (kubelet, job mapping, cgroups)"
    options = OPTIONS
    settings: AttributionSettings

    clock: Callable[[], float] = staticmethod(time.monotonic)
    """The monotonic clock the stale-answer limit is measured on (a test can step it)."""

    def __init__(self, ctx: Context, cfg: Section | None = None) -> None:
        super().__init__(ctx, cfg)
        self._directory = ctx.get_shared(DIRECTORY_KEY, GpuDirectory)
        self._client: kubelet.PodResourcesClient | None = None
        self._kube_last: list[kubelet.Allocation] = []
        self._kube_ok_at: float | None = None
        self._logged = LogOnce(log)
        self._waited = False

    # -- availability ---------------------------------------------------------------------------
    def probe(self) -> Availability:
        if self.settings.kubelet_socket and os.path.exists(self.settings.kubelet_socket):
            return Availability(True)
        mapping = self.settings.job_mapping_dir
        if mapping and os.path.isdir(mapping):
            return Availability(True)
        if self.settings.processes and (self.ctx.simulation is not None or os.path.exists("/dev/nvidiactl")):
            return Availability(True)
        return Availability(False, "no kubelet socket, no job mapping directory and no NVIDIA driver "
                                   "whose processes could be attributed", cause=StateReason.ERROR)

    # -- a run ----------------------------------------------------------------------------------
    def collect(self) -> Collection:
        out = Collection()
        if not self._waited:  # the first run starts beside the NVML collector's: let it publish first
            self._waited = True
            self._directory.wait_first(min(2.0, self.settings.interval / 2))
        gpus, read_at = self._directory.latest()
        if read_at is not None and time.monotonic() - read_at > STALE_DIRECTORY:
            gpus = ()  # the NVML collector has not run for minutes (down, driver gone): no stale holders
        holders: list[Holder] = []
        up: list[tuple[str, float]] = []
        if self.settings.kubelet_socket and os.path.exists(self.settings.kubelet_socket):
            ok = self._kubernetes(gpus, holders, out)
            up.append(("kubelet", 1.0 if ok else 0.0))
        mapping = self.settings.job_mapping_dir
        if not up and not mapping and self.ctx.simulation is not None:
            holders.extend(simulated_holders(self.ctx.simulation.allocations, gpus))
            up.append(("simulation", 1.0))
        elif mapping:
            up.append(("job_mapping", 1.0 if self._job_mapping(mapping, gpus, holders, out) else 0.0))
        elif self.settings.processes:
            self._processes(gpus, holders, pods_known=any(s == "kubelet" and v for s, v in up))
            up.append(("processes", 1.0))
        rows = self._bounded(list(dict.fromkeys(holders)), out)
        out.add(ALLOCATION, (ALLOCATION.sample(1.0, h.gpu, h.uuid, h.gpu_instance, h.namespace, h.pod,
                                               h.container, h.job_id) for h in rows))
        out.add(SOURCE_UP, (SOURCE_UP.sample(v, s) for s, v in up))
        return out

    def _bounded(self, rows: list[Holder], out: Collection) -> list[Holder]:
        """At most :data:`MAX_HOLDERS_PER_GPU` holders per GPU (the first in a stable order), the rest
        counted and logged once."""
        per_gpu: dict[str, int] = {}
        for row in rows:
            per_gpu[row.gpu] = per_gpu.get(row.gpu, 0) + 1
        if all(n <= MAX_HOLDERS_PER_GPU for n in per_gpu.values()):
            return rows
        kept: list[Holder] = []
        taken: dict[str, int] = {}
        for row in sorted(rows, key=lambda h: (h.gpu, h.gpu_instance, h.namespace, h.pod, h.container, h.job_id)):
            if taken.get(row.gpu, 0) < MAX_HOLDERS_PER_GPU:
                taken[row.gpu] = taken.get(row.gpu, 0) + 1
                kept.append(row)
        dropped = len(rows) - len(kept)
        out.count_error("holders_cut", dropped)
        self._log_once("holders-cut", "attribution: more than %d holders of one GPU (%d dropped this run): only "
                       "the first %d of each GPU are kept", MAX_HOLDERS_PER_GPU, dropped, MAX_HOLDERS_PER_GPU)
        return kept

    def _kubernetes(self, gpus: tuple[GpuEntry, ...], holders: list[Holder], out: Collection) -> bool:
        """Ask the kubelet; on failure keep its last answer for a few intervals, then none."""
        ok = True
        try:
            if self._client is None:
                self._client = kubelet.PodResourcesClient(self.settings.kubelet_socket)
            timeout = min(self.settings.timeout, max(0.05, self.settings.interval / 2))
            self._kube_last = self._client.list(timeout)
            self._kube_ok_at = self.clock()
            self._logged.clear("kubelet")
        except ImportError as exc:  # grpcio is the optional `attribution` extra
            ok = False
            out.count_error("kubelet_grpc_missing")
            self._log_once("kubelet-grpc", "attribution: the kubelet's PodResources API is gRPC and grpcio is "
                           "not installed (%s): install gpumon-exporter[attribution]; jobs and containers are "
                           "still attributed by process", exc)
            self._kube_last = []
        except kubelet.PodResourcesError as exc:
            ok = False
            out.count_error("kubelet")
            self._log_once("kubelet", "attribution: kubelet PodResources failed: %s", exc)
            too_old = self.settings.interval * KEEP_STALE_INTERVALS
            if self._kube_ok_at is None or self.clock() - self._kube_ok_at > too_old:
                self._kube_last = []
        cut = {(a.namespace, a.pod) for a in self._kube_last if a.cut}
        if cut and ok:
            out.count_error("kubelet_name_cut", len(cut))
            self._log_once("kubelet-name-cut", "attribution: the kubelet named %d pods with a pod, namespace or "
                           "container name longer than Kubernetes allows (%d characters): cut to that length",
                           len(cut), kubelet.MAX_NAME)
        holders.extend(kubernetes_holders(self._kube_last, gpus))
        return ok

    def _job_mapping(self, directory: str, gpus: tuple[GpuEntry, ...], holders: list[Holder],
                     out: Collection) -> bool:
        found = jobmap.read_job_map(directory)
        if found.malformed:
            out.count_error("job_mapping_malformed", len(found.malformed))
            self._log_once("mapping:" + ",".join(found.malformed),
                           "attribution: skipped malformed job-mapping files in %s: %s",
                           directory, ", ".join(found.malformed))
        by_index = {g.index: g for g in gpus}
        for (index, gi), jobs in sorted(found.jobs.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)):
            entry = by_index.get(str(index))
            uuid = entry.uuid if entry else ""
            for job in jobs:
                holders.append(Holder(str(index), uuid, "" if gi is None else str(gi), job_id=job))
        return os.path.isdir(directory)

    def _processes(self, gpus: tuple[GpuEntry, ...], holders: list[Holder], pods_known: bool) -> None:
        """Jobs (and, with no kubelet, containers) from the cgroups of each GPU's processes."""
        root = self.settings.proc_root
        for gpu in gpus:
            for proc in gpu.processes:
                owner = cgroup.owner_of_pid(proc.pid, root)
                if not owner:
                    continue  # exited mid-read, or a process nobody owns
                gi = "" if proc.gpu_instance is None else str(proc.gpu_instance)
                if owner.job_id:
                    holders.append(Holder(gpu.index, gpu.uuid, gi, job_id=owner.job_id))
                elif owner.container_id and not pods_known:
                    holders.append(Holder(gpu.index, gpu.uuid, gi, container=owner.container_id[:12]))

    def _log_once(self, key: str, msg: str, *args: object) -> None:
        self._logged.warning(key, msg, *args)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return (ALLOCATION, SOURCE_UP)


def kubernetes_holders(allocations: list[kubelet.Allocation], gpus: tuple[GpuEntry, ...]) -> list[Holder]:
    """Kubelet allocations of NVIDIA devices, mapped to GPU indexes (and MIG GPU instances)."""
    by_uuid = {g.uuid: g for g in gpus}
    by_mig = {mig_uuid: (g, gi) for g in gpus for gi, mig_uuid in g.mig}
    by_index = {g.index: g for g in gpus}
    out: list[Holder] = []
    for a in allocations:
        target: tuple[GpuEntry, str] | None = None
        if a.claim is not None:
            target = _claim_target(a.claim, by_uuid, by_index)
        elif kubelet.is_nvidia_resource(a.resource):
            dev = kubelet.parse_nvidia_device_id(a.device_id)
            if dev is not None and dev.mig_uuid and dev.mig_uuid in by_mig:
                g, gi = by_mig[dev.mig_uuid]
                target = (g, str(gi))
            elif dev is not None and dev.gpu_uuid in by_uuid:
                gi_text = "" if dev.gpu_instance is None else str(dev.gpu_instance)
                target = (by_uuid[dev.gpu_uuid], gi_text)
        if target is not None:
            g, gi_label = target
            out.append(Holder(g.index, g.uuid, gi_label, a.namespace, a.pod, a.container))
    return out


def simulated_holders(allocations: list[dict[str, Any]], gpus: tuple[GpuEntry, ...]) -> list[Holder]:
    """A simulated host's allocations (set through its control directory), as the real sources give."""
    by_index = {g.index: g for g in gpus}
    out = []
    for a in allocations:
        g = by_index.get(str(a["gpu"]))
        if g is not None:
            out.append(Holder(g.index, g.uuid, "", a["namespace"], a["pod"], a["container"], a["job_id"]))
    return out


def _claim_target(claim: kubelet.ClaimDevice, by_uuid: dict[str, GpuEntry],
                  by_index: dict[str, GpuEntry]) -> tuple[GpuEntry, str] | None:
    """A DRA device: a GPU UUID in its device or CDI names, else NVIDIA's ``gpu-<index>`` name."""
    if not claim.driver.endswith("nvidia.com"):
        return None
    for name in (claim.device, *claim.cdi_devices):
        for uuid in _UUID_IN.findall(name):
            if uuid in by_uuid:
                return by_uuid[uuid], ""
    match = _GPU_N.match(claim.device)
    if match and match[1] in by_index:
        return by_index[match[1]], ""
    return None
