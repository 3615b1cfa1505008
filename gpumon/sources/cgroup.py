"""From a process to its owner: the Slurm job, the Kubernetes pod and the container, by cgroup.

``/proc/<pid>/cgroup`` names the process's cgroup path (cgroup v2: one ``0::/path`` line; v1: one
line per hierarchy). The layouts recognised, with where each comes from:

- Slurm, cgroup v1: ``/slurm/uid_<uid>/job_<id>/step_<s>/task_<n>`` at the root of a controller's
  hierarchy, ``slurm_<node>`` with several slurmd on one host (Slurm's cgroups.shtml);
  cgroup v2: ``/system.slice/slurmstepd.scope/job_<id>/step_<s>/...``, the scope possibly
  ``<node>_slurmstepd.scope`` (cgroup_v2.shtml: slurmd puts ``slurmstepd.scope`` in ``system.slice``).
  Slurm 26.05 may name the job directory by its SLUID (``sEKNKTV3WPV500``) unless
  ``CgroupJobIdPaths=yes``: then the job id is that SLUID. Only these layouts, anchored at the
  root (past the ``/..`` a cgroup namespace puts before a path outside it), name a job: a user may
  create ``job_999`` in a subtree delegated to them (``user@1000.service/app.slice/job_999``), and
  that is no Slurm job.
- Kubernetes pods: ``kubepods[-<qos>].slice/...-pod<uid with _>.slice`` (systemd driver) or
  ``/kubepods/<qos>/pod<uid>`` (cgroupfs driver).
- Containers: ``cri-containerd-<id>.scope``, ``crio-<id>.scope``, ``docker-<id>.scope`` (systemd
  driver), or a bare 64-hex directory under a pod or ``/docker/`` (cgroupfs driver).

A process that exits between listing and reading is simply not there: no error.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_OUTSIDE = r"^(?:/\.\.)*"
"""What a cgroup namespace shows before a path outside it (``/../../system.slice/...``)."""
_SLURM_V1 = re.compile(_OUTSIDE + r"/slurm(?:_[^/]+)?/uid_[0-9]+/job_(?P<id>[0-9]+|s[0-9A-Z]{10,})(?:/|$)")
_SLURM_V2 = re.compile(_OUTSIDE + r"/system\.slice/(?:[^/]+_)?slurmstepd\.scope/"
                       r"(?:job_(?P<id>[0-9]+|s[0-9A-Z]{10,})|(?P<sluid>s[0-9A-Z]{10,}))(?:/|$)")
_POD_SYSTEMD = re.compile(r"-pod(?P<uid>[0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12})\.slice")
_POD_CGROUPFS = re.compile(r"/pod(?P<uid>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})(?:/|$)")
_CONTAINER_SCOPE = re.compile(r"(?P<runtime>cri-containerd|crio|docker|libpod)-(?P<id>[0-9a-f]{64})\.scope")
_CONTAINER_DIR = re.compile(r"/(?P<id>[0-9a-f]{64})(?:/|$)")


@dataclass(frozen=True)
class Owner:
    """Who a process belongs to; empty strings where a layout does not say."""

    job_id: str = ""
    pod_uid: str = ""
    container_id: str = ""
    runtime: str = ""

    def __bool__(self) -> bool:
        return bool(self.job_id or self.pod_uid or self.container_id)


def owner_of_path(path: str) -> Owner:
    """The owner named by one cgroup path."""
    job = _SLURM_V1.match(path) or _SLURM_V2.match(path)
    job_id = (job["id"] or job.groupdict().get("sluid") or "") if job else ""
    pod_uid = ""
    pod = _POD_SYSTEMD.search(path)
    if pod:
        pod_uid = pod["uid"].replace("_", "-")
    else:
        pod = _POD_CGROUPFS.search(path)
        if pod:
            pod_uid = pod["uid"]
    container_id = runtime = ""
    scope = _CONTAINER_SCOPE.search(path)
    if scope:
        container_id, runtime = scope["id"], {"cri-containerd": "containerd"}.get(scope["runtime"], scope["runtime"])
    else:
        bare = _CONTAINER_DIR.search(path)
        if bare and (pod_uid or "/docker/" in path):
            container_id, runtime = bare["id"], ("docker" if "/docker/" in path else "")
    return Owner(job_id, pod_uid, container_id, runtime)


def parse_proc_cgroup(text: str) -> Owner:
    """The owner from the whole of ``/proc/<pid>/cgroup``: the v2 line first, then v1 hierarchies."""
    paths = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths.append((parts[0] != "0", parts[2]))
    found = Owner()
    for _, path in sorted(paths):
        owner = owner_of_path(path)
        found = Owner(found.job_id or owner.job_id, found.pod_uid or owner.pod_uid,
                      found.container_id or owner.container_id, found.runtime or owner.runtime)
    return found


def owner_of_pid(pid: int, proc_root: str = "/proc") -> Owner | None:
    """The owner of a running process, or None when it is gone or unreadable (it may have exited)."""
    try:
        with open(os.path.join(proc_root, str(pid), "cgroup"), encoding="utf-8", errors="replace") as fh:
            return parse_proc_cgroup(fh.read(65536))
    except OSError:
        return None
