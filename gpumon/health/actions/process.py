"""Run a command bounded in time: one that hangs is killed with its whole process group.

``scontrol`` and an operator's hook share this; a hook that forks (a shell script calling curl)
must not leave a child behind holding the pipe open past the timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class ActionError(Exception):
    """An attempt that failed and is worth retrying; its text is what gets logged. ``retry_after``:
    the seconds the server asked to wait (Retry-After), which the worker's backoff honours."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def run_bounded(argv: Sequence[str], timeout: float, stdin: bytes = b"",
                env: Mapping[str, str] | None = None) -> Outcome:
    """Run ``argv`` with ``stdin`` in a session of its own; kill the group at ``timeout`` seconds."""
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                                env=dict(env) if env is not None else None)
    except OSError as exc:
        raise ActionError(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ActionError(f"{argv[0]} did not finish within {timeout:g} s; killed") from None
    finally:
        if proc.returncode is None:
            _kill_group(proc)
    return Outcome(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group (the child leads it) and reap the child, closing our pipe ends."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        proc.kill()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    proc.wait()
