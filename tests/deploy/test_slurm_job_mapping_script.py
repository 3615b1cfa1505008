"""deploy/slurm/gpumon-job-mapping.sh run as slurmd runs a prolog and epilog, read back by gpumon."""

from __future__ import annotations

import os
import subprocess

from gpumon.sources.jobmap import read_job_map

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "slurm", "gpumon-job-mapping.sh")


def run(directory: str, context: str, job: str, **env: str) -> subprocess.CompletedProcess:
    full = {"PATH": os.environ["PATH"], "GPUMON_JOB_MAPPING_DIR": directory,
            "SLURM_SCRIPT_CONTEXT": context, "SLURM_JOB_ID": job, **env}
    return subprocess.run(["bash", SCRIPT], env=full, capture_output=True, text=True, timeout=20)


def test_prolog_maps_the_jobs_gpus_and_epilog_removes_only_that_job(tmp_path) -> None:
    d = str(tmp_path / "map")
    assert run(d, "prolog_slurmd", "101", SLURM_JOB_GPUS="0,1").returncode == 0
    assert run(d, "prolog_slurmd", "102", SLURM_JOB_GPUS="1,3").returncode == 0  # shares GPU 1
    assert read_job_map(d).jobs == {(0, None): ["101"], (1, None): ["101", "102"], (3, None): ["102"]}
    assert run(d, "epilog_slurmd", "101", SLURM_JOB_GPUS="0,1").returncode == 0
    got = read_job_map(d)
    assert got.jobs == {(1, None): ["102"], (3, None): ["102"]} and got.malformed == []
    assert not os.path.exists(os.path.join(d, "0"))  # an emptied GPU has no file
    assert sorted(os.listdir(d)) == [".lock", "1", "3"]  # no temporary files left


def test_cuda_visible_devices_when_slurm_job_gpus_is_unset(tmp_path) -> None:
    d = str(tmp_path / "map")
    run(d, "prolog_slurmd", "7", CUDA_VISIBLE_DEVICES="2")
    assert read_job_map(d).jobs == {(2, None): ["7"]}


def test_a_prolog_run_twice_maps_the_job_once(tmp_path) -> None:
    d = str(tmp_path / "map")
    run(d, "prolog_slurmd", "5", SLURM_JOB_GPUS="0")
    run(d, "prolog_slurmd", "5", SLURM_JOB_GPUS="0")
    assert read_job_map(d).jobs == {(0, None): ["5"]}


def test_bad_input_never_fails_the_job(tmp_path) -> None:
    """A non-zero prolog exit drains the node: every problem is logged and the exit stays 0."""
    d = str(tmp_path / "map")
    bad = run(d, "prolog_slurmd", "5; rm -rf /", SLURM_JOB_GPUS="0")
    assert bad.returncode == 0 and "not a job id" in bad.stderr
    uuids = run(d, "prolog_slurmd", "6", CUDA_VISIBLE_DEVICES="GPU-1234")
    assert uuids.returncode == 0 and "not an index" in uuids.stderr
    assert run(d, "", "6", SLURM_JOB_GPUS="0").returncode == 0  # not run by slurmd: nothing done
    assert run(d, "prolog_slurmd", "8").returncode == 0  # a job with no GPUs
    assert read_job_map(d).jobs == {}
