"""The health-action runner with real executables: once per transition, off the caller's thread,
the latest transition winning, a hung hook or scontrol killed with its process group at the timeout,
failures retried with backoff, counted and logged once, and `check` naming what cannot work."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path

import pytest

from gpumon.health.actions import ActionSettings, HealthActions, check
from tests.conftest import wait_for
from tests.support.health_verdicts import verdict

pytestmark = pytest.mark.timeout(60)


def script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def recorder(tmp_path: Path, extra: str = "") -> tuple[str, Path]:
    """A hook appending each verdict it is given to calls.jsonl, then running ``extra``."""
    log = tmp_path / "calls.jsonl"
    return script(tmp_path / "hook", f'cat >> "{log}"\n{extra}'), log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def runner(tmp_path: Path, **settings) -> HealthActions:
    options = {"timeout": 5.0, "backoff_initial": 0.05, "backoff_max": 0.2, **settings}
    return HealthActions(ActionSettings(**options), str(tmp_path / "state"))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is gone too: it waits for a parent that is not ours
        return fh.read().split(") ")[1].startswith("Z")


def test_the_hook_runs_once_per_transition_with_the_verdict_on_stdin(tmp_path) -> None:
    hook, log = recorder(tmp_path)
    a = runner(tmp_path, hook=hook)
    try:
        a.on_verdict(verdict("ok"))  # a healthy start is no transition
        bad = verdict("unhealthy", ("gpu.xid.48", "reset_gpu"))
        slowest = 0.0
        for _ in range(50):  # the loop calls after every update, mostly unchanged
            started = time.monotonic()
            a.on_verdict(bad)
            slowest = max(slowest, time.monotonic() - started)
        wait_for(lambda: len(calls(log)) == 1)
        worse = verdict("unhealthy", ("gpu.xid.48", "reset_gpu"), ("ib.port.down", "check_fabric"))
        a.on_verdict(worse)
        wait_for(lambda: len(calls(log)) == 2)
        a.on_verdict(verdict("ok", time=1_000_060.0))
        wait_for(lambda: len(calls(log)) == 3)
        # The hook writes its stdin before it exits; the run is counted once it has exited.
        wait_for(lambda: a.stats()["hook"]["runs"] == 3)
        assert [c["status"] for c in calls(log)] == ["unhealthy", "unhealthy", "healthy"]
        assert calls(log)[0] == json.loads(json.dumps(bad.as_dict()))
        assert [f["rule"] for f in calls(log)[1]["findings"]] == ["gpu.xid.48", "ib.port.down"]
        assert a.stats() == {"hook": {"runs": 3, "failures": 0, "retries": 0}}
        assert slowest < 0.05, f"on_verdict took {slowest:.3f} s"
    finally:
        a.close()


def test_the_latest_transition_wins_while_the_hook_is_busy(tmp_path) -> None:
    release = tmp_path / "release"
    hook, log = recorder(tmp_path, f'while [ ! -e "{release}" ]; do sleep 0.02; done\n')
    a = runner(tmp_path, hook=hook)
    try:
        a.on_verdict(verdict("unhealthy", ("gpu.xid.48", "reset_gpu")))
        wait_for(lambda: len(calls(log)) == 1)  # the hook is now busy with the first
        for gpu in ("1", "2", "3"):
            a.on_verdict(verdict("unhealthy", ("gpu.xid.48", "reset_gpu"), gpu=gpu))
        release.touch()
        wait_for(lambda: a.stats()["hook"]["runs"] == 2)
        assert [c["findings"][0]["subject"]["gpu"] for c in calls(log)] == ["0", "3"]
    finally:
        a.close()


def test_a_hanging_hook_is_killed_with_its_process_group_and_never_delays_the_caller(tmp_path) -> None:
    pids = tmp_path / "pids"
    hook = script(tmp_path / "hook", f'sleep 600 &\necho $! >> "{pids}"\nwait\n')
    a = runner(tmp_path, hook=hook, timeout=0.5, backoff_initial=5.0, backoff_max=5.0)
    try:
        started = time.monotonic()
        a.on_verdict(verdict("unhealthy", ("gpu.lost", "reboot")))
        assert time.monotonic() - started < 0.05
        wait_for(lambda: a.stats()["hook"]["failures"] == 1, timeout=10)
        (child,) = [int(p) for p in pids.read_text().split()]
        wait_for(lambda: gone(child), timeout=5)  # the hook's own child, killed with the group
    finally:
        started = time.monotonic()
        a.close(timeout=2.0)
        assert time.monotonic() - started < 2.5


def test_a_failing_hook_is_retried_with_backoff_counted_and_logged_once(tmp_path, caplog) -> None:
    count = tmp_path / "count"
    hook = script(tmp_path / "hook", f'n=$(cat "{count}" 2>/dev/null || echo 0); echo $((n + 1)) > "{count}"\n'
                                     f'[ "$n" -ge 2 ] || {{ echo "ticket system down" >&2; exit 3; }}\n')
    caplog.set_level(logging.WARNING, "gpumon.health.actions")
    a = runner(tmp_path, hook=hook)
    try:
        a.on_verdict(verdict("unhealthy", ("gpu.lost", "reboot")))
        wait_for(lambda: a.stats()["hook"]["runs"] == 3)
        assert a.stats()["hook"] == {"runs": 3, "failures": 2, "retries": 2}
        failures = [r for r in caplog.records if "health action hook failed" in r.getMessage()]
        assert len(failures) == 1 and "exited 3: ticket system down" in failures[0].getMessage()
    finally:
        a.close()


def test_a_restart_with_the_same_verdict_runs_nothing_again(tmp_path) -> None:
    hook, log = recorder(tmp_path)
    bad = verdict("unhealthy", ("gpu.xid.48", "reset_gpu"))
    a = runner(tmp_path, hook=hook)
    try:
        a.on_verdict(bad)
        wait_for(lambda: len(calls(log)) == 1)
    finally:
        a.close()
    again = runner(tmp_path, hook=hook)
    try:
        again.on_verdict(verdict("unhealthy", ("gpu.xid.48", "reset_gpu"), time=1_000_500.0))  # same sticky
        again.on_verdict(verdict("ok"))  # then repaired
        wait_for(lambda: len(calls(log)) == 2)
        wait_for(lambda: again.stats()["hook"]["runs"] >= 1)  # counted once the hook has exited
        assert calls(log)[1]["status"] == "healthy"
        assert again.stats()["hook"]["runs"] == 1
    finally:
        again.close()


def test_a_hanging_or_missing_scontrol_is_a_counted_failure_off_the_callers_thread(tmp_path) -> None:
    hung = script(tmp_path / "scontrol", "exec sleep 600\n")
    a = runner(tmp_path, slurm=True, slurm_node="node-1", scontrol=hung, timeout=0.3)
    missing = runner(tmp_path / "b", slurm=True, slurm_node="node-1", scontrol=str(tmp_path / "absent"))
    try:
        started = time.monotonic()
        a.on_verdict(verdict("unhealthy", ("gpu.lost", "reboot")))
        missing.on_verdict(verdict("unhealthy", ("gpu.lost", "reboot")))
        assert time.monotonic() - started < 0.05
        wait_for(lambda: a.stats()["slurm"]["failures"] >= 1 and missing.stats()["slurm"]["failures"] >= 1)
    finally:
        a.close()
        missing.close()


def test_check_names_each_action_that_cannot_work(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    not_executable = tmp_path / "hook"
    not_executable.write_text("#!/bin/sh\n")
    problems = check(ActionSettings(slurm=True, scontrol="no-such-scontrol", kubernetes=True,
                                    kube_token_file=str(tmp_path / "token"), hook=str(not_executable)))
    text = "\n".join(problems)
    assert "no-such-scontrol was not found on PATH" in text
    assert "no node name" in text and "no API server" in text and "token" in text
    assert f"hook {not_executable} is not an executable file" in text
    assert check(ActionSettings()) == []  # everything off: nothing to complain about


def test_a_flapping_verdict_does_not_drive_a_failing_action_faster_than_its_backoff(tmp_path) -> None:
    """Each new transition waits out the backoff a failing hook earned: 40 flips within a second make
    a handful of attempts, not 40."""
    hook, log = recorder(tmp_path, "exit 1\n")
    a = runner(tmp_path, hook=hook, backoff_initial=0.4, backoff_max=2.0)
    try:
        bad = verdict("unhealthy", ("gpu.xid.48", "reset_gpu"))
        worse = verdict("unhealthy", ("gpu.xid.48", "reset_gpu"), ("gpu.lost", "reboot"))
        deadline = time.monotonic() + 1.0
        flips = 0
        while time.monotonic() < deadline:
            a.on_verdict(bad if flips % 2 == 0 else worse)
            flips += 1
            time.sleep(0.025)
        assert flips >= 30
        assert 1 <= a.stats()["hook"]["runs"] <= 4, a.stats()
    finally:
        a.close()


def test_the_hook_and_scontrol_get_a_clean_environment_without_gpumons_secrets(tmp_path, monkeypatch) -> None:
    secrets = {"GPUMON_REMOTE_WRITE_PASSWORD": "hunter2", "GPUMON_OTEL_HEADERS": "authorization=Bearer t0k3n",
               "AZURE_CLIENT_SECRET": "s3cr3t", "OTEL_EXPORTER_OTLP_HEADERS": "api-key=k3y", "DB_PASSWORD": "pw"}
    for name, value in {**secrets, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "SLURM_CONF": "/etc/slurm/x.conf",
                        "TZ": "UTC"}.items():
        monkeypatch.setenv(name, value)
    hook_env, scontrol_env = tmp_path / "hook.env", tmp_path / "scontrol.env"
    hook = script(tmp_path / "hook", f'env > "{hook_env}"\n')
    # scontrol's place: records what it was given, then answers `show node` as scontrol prints it
    scontrol = script(tmp_path / "scontrol", f'env > "{scontrol_env}"\n'
                      'echo "NodeName=node-1 Arch=x86_64"\necho "   State=IDLE ThreadsPerCore=1"\n')
    a = runner(tmp_path, hook=hook, slurm=True, slurm_node="node-1", scontrol=scontrol)
    try:
        a.on_verdict(verdict("unhealthy", ("gpu.lost", "reboot")))
        wait_for(lambda: hook_env.exists() and scontrol_env.exists() and a.stats()["hook"]["runs"] >= 1)
    finally:
        a.close()
    for path in (hook_env, scontrol_env):
        env = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
        assert not set(secrets) & set(env), path.name
        assert not any(v in path.read_text() for v in secrets.values()), path.name
        assert env["PATH"] == os.environ["PATH"] and env["LANG"] == "C.UTF-8" and env["LC_ALL"] == "C.UTF-8"
        assert env["TZ"] == "UTC"
    hook_vars = dict(line.split("=", 1) for line in hook_env.read_text().splitlines() if "=" in line)
    assert hook_vars["GPUMON_HEALTH_ACTION"] == "reboot" and "SLURM_CONF" not in hook_vars
    assert "SLURM_CONF=/etc/slurm/x.conf" in scontrol_env.read_text()      # scontrol needs its own
