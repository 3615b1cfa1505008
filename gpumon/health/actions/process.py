"""Run a command bounded in time: one that hangs is killed with its whole process group.

``scontrol`` and an operator's hook share this; a hook that forks (a shell script calling curl)
must not leave a child behind holding the pipe open past the timeout.

The command gets a clean environment (:func:`clean_environment`): gpumon's own environment holds
secrets (``GPUMON_REMOTE_WRITE_PASSWORD``, ``AZURE_CLIENT_SECRET``, ``GPUMON_*`` options) that a
hook, and whatever it runs, has no business seeing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KEPT = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "HOSTNAME",
                  "NODE_NAME", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT",
                  "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"})
"""What a command run by gpumon keeps of gpumon's environment: where programs are, the locale and time
zone, who and where it runs, and the host's proxies. Everything else (every ``GPUMON_*`` option,
``AZURE_*`` credentials, ``OTEL_*`` headers, any password a service manager set) is left out."""


def clean_environment(prefixes: tuple[str, ...] = (), extra: Mapping[str, str] | None = None,
                      source: Mapping[str, str] | None = None) -> dict[str, str]:
    """``source`` (gpumon's environment) reduced to :data:`KEPT`, ``LC_*`` and the names starting with
    one of ``prefixes`` (``SLURM_`` for scontrol: ``SLURM_CONF``, a ``SLURM_JWT`` it authenticates
    with), plus ``extra``."""
    env = os.environ if source is None else source
    out = {k: v for k, v in env.items()
           if k in KEPT or k.startswith("LC_") or (prefixes and k.startswith(prefixes))}
    out.update(extra or {})
    return out


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
    """Run ``argv`` with ``stdin`` in a session of its own; kill the group at ``timeout`` seconds.
    ``env`` is the whole environment it gets (default: :func:`clean_environment`)."""
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                                env=dict(env) if env is not None else clean_environment())
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
