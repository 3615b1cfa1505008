"""Where ``gpumon run`` says which address it got: ``<state_dir>/listen`` and ``--listen-file PATH``.

``--listen 127.0.0.1:0`` lets the kernel choose a free port at bind time, which no other program can
take in between (a port picked first and bound later can be). The file is one line, ``HOST:PORT`` as
``--listen`` spells it, written after the socket is bound, by rename (a reader sees no file, the
previous address or the new one, never half a line), rewritten when a reload moves the endpoint, and
removed on a clean stop: a file left behind means the daemon was killed. Only one ``gpumon run``
holds a state directory (:mod:`gpumon.statelock`), so ``<state_dir>/listen`` is never another's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

from gpumon.log_once import LogOnce

LISTEN_FILE = "listen"
"""Its name under ``[daemon] state_dir``."""

log = logging.getLogger("gpumon.listen")


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` by rename in the same directory (readable by all, as a PID file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class ListenFiles:
    """The files that carry the bound address: the state directory's always, ``explicit`` when asked.

    A failure to write ``explicit`` raises (whoever asked for it waits on it); the state directory's
    is best effort, logged once (a read-only state directory runs without one)."""

    def __init__(self, explicit: str | None) -> None:
        self.explicit = explicit
        self._written: dict[str, str] = {}
        self._log = LogOnce(log)

    def update(self, address: str | None, state_dir: str) -> None:
        """Write ``address`` (None: nothing listens) to each file; drop a file no longer wanted
        (a reload that moved the state directory)."""
        wanted = [os.path.join(state_dir, LISTEN_FILE)] + ([self.explicit] if self.explicit else [])
        for path in [p for p in self._written if p not in wanted or address is None]:
            self._unlink(path)
        if address is None:
            return
        for path in wanted:
            if self._written.get(path) == address:
                continue
            try:
                write_atomic(path, address + "\n")
            except OSError as exc:
                if path == self.explicit:
                    raise
                self._log.warning(path, "cannot write the listen address to %s: %s", path, exc.strerror or exc)
                continue
            self._written[path] = address
            log.info("listening on %s (written to %s)", address, path)

    def remove(self) -> None:
        """A clean stop: the address is no longer served."""
        for path in list(self._written):
            self._unlink(path)

    def _unlink(self, path: str) -> None:
        self._written.pop(path, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
