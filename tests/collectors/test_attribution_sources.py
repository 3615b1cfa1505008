"""Process -> owner by cgroup, and the dcgm-exporter job-mapping directory, on real files."""

from __future__ import annotations

import os

import pytest

from gpumon.sources.cgroup import Owner, owner_of_pid, parse_proc_cgroup
from gpumon.sources.jobmap import read_job_map

CID = "4f3c2b1a" * 8
POD = "0d3e7c9a-1b2c-4d5e-8f90-a1b2c3d4e5f6"

# Each line as /proc/<pid>/cgroup shows it for a process of that kind (layouts: Slurm's
# cgroups.shtml and cgroup_v2.shtml, the kubelet's systemd and cgroupfs drivers, Docker, CRI-O).
CASES = [
    ("slurm cgroup v1", "12:devices:/slurm/uid_1000/job_4242/step_0/task_0\n"
                        "11:freezer:/slurm/uid_1000/job_4242/step_0\n3:cpuset:/\n",
     Owner(job_id="4242")),
    ("slurm cgroup v2", "0::/system.slice/slurmstepd.scope/job_77/step_batch/user/task_0\n", Owner(job_id="77")),
    ("slurm v2, node-named scope", "0::/system.slice/node01_slurmstepd.scope/job_9/step_0/user/task_1\n",
     Owner(job_id="9")),
    ("slurm SLUID job directory", "0::/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_0/user/task_0\n",
     Owner(job_id="sEKNKTV3WPV500")),
    ("containerd, systemd driver",
     "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
     f"{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
     Owner(pod_uid=POD, container_id=CID, runtime="containerd")),
    ("guaranteed pod, cgroupfs driver", f"0::/kubepods/pod{POD}/{CID}\n", Owner(pod_uid=POD, container_id=CID)),
    ("cri-o", f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/crio-{CID}.scope\n",
     Owner(pod_uid=POD, container_id=CID, runtime="crio")),
    ("docker, systemd driver", f"0::/system.slice/docker-{CID}.scope\n", Owner(container_id=CID, runtime="docker")),
    ("docker, cgroup v1", f"4:memory:/docker/{CID}\n0::/\n", Owner(container_id=CID, runtime="docker")),
    ("a login shell", "0::/user.slice/user-1000.slice/session-3.scope\n", Owner()),
    ("slurm v2 seen from a cgroup namespace", "0::/../../system.slice/slurmstepd.scope/job_12/step_0/user/task_0\n",
     Owner(job_id="12")),
    ("slurm v1, several slurmd", "5:devices:/slurm_node07/uid_0/job_31/step_batch/task_0\n", Owner(job_id="31")),
    # a user's own delegated subtree may hold any directory name: no Slurm job without Slurm's layout
    ("job_ directory a user made", "0::/user.slice/user-1000.slice/user@1000.service/app.slice/job_999\n", Owner()),
    ("slurm-like names a user made", "0::/user.slice/user-1000.slice/user@1000.service/app.slice/"
                                     "slurmstepd.scope/job_998/step_0\n", Owner()),
    ("v1 job_ outside /slurm", "7:memory:/user.slice/job_997/step_0\n", Owner()),
    ("job_ inside a container", f"0::/system.slice/docker-{CID}.scope/job_996\n",
     Owner(container_id=CID, runtime="docker")),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_owner_from_proc_cgroup(text: str, expected: Owner) -> None:
    assert parse_proc_cgroup(text) == expected


def test_owner_of_pid_reads_a_proc_shaped_tree_and_ignores_gone_processes(tmp_path) -> None:
    proc = tmp_path / "proc"
    (proc / "123").mkdir(parents=True)
    (proc / "123" / "cgroup").write_text(CASES[1][1])
    assert owner_of_pid(123, str(proc)) == Owner(job_id="77")
    assert owner_of_pid(124, str(proc)) is None  # exited between the list and the read


def test_owner_of_this_process_on_the_real_proc() -> None:
    owner = owner_of_pid(os.getpid())
    assert owner is not None  # whatever it is, reading the real file works


def test_job_map_reads_gpus_and_mig_instances_and_skips_the_rest(tmp_path) -> None:
    d = tmp_path / "map"
    d.mkdir()
    (d / "0").write_text("1001\n")
    (d / "1").write_text("1001\n1002\n\n1001\n")  # two jobs share a GPU; a repeat counts once
    (d / "3.2").write_text("2001\n")
    (d / "README").write_text("not a mapping file")
    (d / "4").write_bytes(b"\xff\xfe binary")
    (d / "5").write_text("a job; rm -rf /\n")
    os.mkfifo(d / "6")  # must not block the run
    got = read_job_map(str(d))
    assert got.jobs == {(0, None): ["1001"], (1, None): ["1001", "1002"], (3, 2): ["2001"]}
    assert sorted(got.malformed) == ["4", "5", "6"]


def test_job_map_absent_directory_is_empty(tmp_path) -> None:
    got = read_job_map(str(tmp_path / "none"))
    assert got.jobs == {} and got.malformed == []
