"""A real single-node Slurm cluster on loopback for the tests: munged, slurmctld and slurmd from
Debian's ``slurm-wlm`` and ``munge``, with every file (key, socket, state, spool, logs) in one
temporary directory and a generated slurm.conf that ``scontrol``/``sinfo`` find through SLURM_CONF.

Needs root (slurmd runs as SlurmdUser=root); scripts/test.sh installs the packages.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import wait_for

START_TIMEOUT = 30.0
SBIN = "/usr/sbin:/sbin:/usr/local/sbin"


def short_hostname() -> str:
    return socket.gethostname().split(".")[0]


def listen_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999): one picked inside it can be taken by
    any outgoing connection on this busy host before slurmctld or slurmd binds it."""
    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 20000-32000")


def _which(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=SBIN)
    assert found, f"{name} not found: apt-get install slurm-wlm munge (scripts/test.sh does)"
    return found


class SlurmCluster:
    """One controller and one compute node (this host, under its short hostname), started and stopped."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.node = short_hostname()
        self.conf = directory / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen] = []

    def start(self) -> None:
        self.dir.chmod(0o755)  # munged wants every directory above its socket searchable
        for sub in ("munge", "state", "spool"):
            (self.dir / sub).mkdir(mode=0o755, exist_ok=True)
        key = self.dir / "munge" / "munge.key"
        subprocess.run([_which("mungekey"), "--create", "--keyfile", str(key)], check=True, timeout=10,
                       capture_output=True)
        self.socket = self.dir / "munge" / "munge.sock"
        self._spawn([_which("munged"), "--foreground", "--force", f"--socket={self.socket}",
                     f"--key-file={key}", f"--pid-file={self.dir / 'munge' / 'munged.pid'}",
                     f"--log-file={self.dir / 'munge' / 'munged.log'}", f"--seed-file={self.dir / 'munge' / 'seed'}"],
                    "munged")
        wait_for(self.socket.exists, timeout=10)
        # Ports are picked free but not held: another test may take one first. Try once more then.
        for attempt in (1, 2):
            self.conf.write_text(self._config())
            self._spawn([_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
            self._spawn([_which("slurmd"), "-D", "-f", str(self.conf)], "slurmd")
            if wait_for(self._up_or_exited, timeout=START_TIMEOUT, interval=0.1) == "up":
                return
            self._stop(self._procs[1:])
            del self._procs[1:]
            assert attempt == 1, f"Slurm did not start:\n{self.logs()}\n{subprocess.run(['ss', '-ltnp'], capture_output=True, text=True).stdout}"

    def _up_or_exited(self) -> str:
        if any(p.poll() is not None for p in self._procs):
            return "exited"
        return "up" if self.state() in ("idle", "mixed", "allocated") else ""

    def _config(self) -> str:
        d = self.dir
        return "\n".join([
            "ClusterName=gpumontest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={listen_port()}",
            f"SlurmdPort={listen_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/linear",
            "ReturnToService=2",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def _spawn(self, argv: list[str], name: str) -> None:
        log = open(self.dir / f"{name}.out", "wb")  # noqa: SIM115 - lives as long as the process
        self._procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True))
        log.close()

    def run(self, *argv: str) -> str:
        out = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=15, check=False)
        assert out.returncode == 0, f"{' '.join(argv)}: {out.stderr}"
        return out.stdout

    def state(self) -> str:
        """sinfo's long state of the node ("idle", "drained", "draining", "idle*"...); "" when unreachable."""
        out = subprocess.run([_which("sinfo"), "-h", "-N", "-n", self.node, "-o", "%T"], env=self.env,
                             capture_output=True, text=True, timeout=15, check=False)
        return out.stdout.strip() if out.returncode == 0 else ""

    def reason(self) -> str:
        """The full drain reason (sinfo -R shows only its first 20 characters)."""
        return self.run(_which("sinfo"), "-h", "-N", "-n", self.node, "-o", "%E").strip()

    def drain(self, reason: str) -> None:
        self.run(_which("scontrol"), "update", f"nodename={self.node}", "state=drain", f"reason={reason}")

    def resume(self) -> None:
        self.run(_which("scontrol"), "update", f"nodename={self.node}", "state=resume")
        wait_for(lambda: self.state() == "idle", timeout=15, interval=0.05)

    def stop(self) -> None:
        self._stop(self._procs)

    @staticmethod
    def _stop(procs: list[subprocess.Popen]) -> None:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in reversed(procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted(self.dir.glob("*.out")) + sorted(self.dir.glob("*.log")))
