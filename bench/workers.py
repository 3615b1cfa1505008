"""The parent's side of :mod:`bench.worker`: start one, send it commands, read its CPU from /proc."""

from __future__ import annotations

import subprocess
import sys

from bench.common import REPO, clean_env, cpu_seconds


class Worker:
    """One collector in its own process (see :mod:`bench.worker` for the protocol)."""

    def __init__(self, collector: str, sysfs_root: str, state_dir: str, read_mode: str = "pread") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.worker", "--collector", collector, "--sysfs-root", sysfs_root,
             "--state-dir", state_dir, "--read-mode", read_mode],
            cwd=REPO, env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        words = self._reply()
        if words[0] != "ready":
            raise RuntimeError(f"worker for {collector} did not start: {' '.join(words)}")
        self.series, self.errors = int(words[1]), int(words[2])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _reply(self) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait(5)}")
        return line.split()

    def _ask(self, command: str) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        words = self._reply()
        if words[0] != "ok":
            raise RuntimeError(" ".join(words))
        return words

    def run(self, n: int) -> tuple[float, float, float]:
        """``n`` runs back to back: (CPU from /proc, CPU the worker measured, wall seconds)."""
        c0 = cpu_seconds(self.pid)
        words = self._ask(f"run {n}")
        return cpu_seconds(self.pid) - c0, float(words[1]), float(words[2])

    def loop(self, interval: float, seconds: float) -> tuple[float, float, int]:
        """Runs every ``interval`` for ``seconds``: (CPU from /proc, CPU the worker measured, runs)."""
        c0 = cpu_seconds(self.pid)
        words = self._ask(f"loop {interval} {seconds}")
        return cpu_seconds(self.pid) - c0, float(words[1]), int(words[2])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
