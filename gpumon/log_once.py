"""Log a fault the first time it is seen, not on every run or retry: gpumon's one "logged once".

Below collectors, sinks, the health actions and the core's clients (IMDS, sd_notify, the flap
state), so that every one of them keeps its "logged once" set here rather than writing its own.
A fault is still counted every time by its owner; only the log line is once per key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any

__all__ = ["COUNTED", "LogOnce"]

COUNTED = " (logged once, counted every time)"
"""The suffix of a collector's fault line that is counted on every run and logged on the first."""


class LogOnce:
    """Logs a message the first time its key is seen and again only after the key was cleared.

    A sink that fails every second for an hour writes one line, not 3,600; ``clear`` (on success)
    re-arms a key, or every key, so the next outage is logged too. ``suffix`` is appended to every
    message (e.g. :data:`COUNTED`). ``limit`` bounds the keys remembered where they are open-ended
    (a server's error text): past it, they are all forgotten and logged again when next seen.
    Thread-safe; the line is attributed to the caller, not to this module.
    """

    def __init__(self, logger: logging.Logger, suffix: str = "", limit: int | None = None) -> None:
        self._log = logger
        self._suffix = suffix
        self._limit = limit
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def _first(self, key: Hashable) -> bool:
        with self._lock:
            if key in self._seen:
                return False
            if self._limit is not None and len(self._seen) > self._limit:
                self._seen.clear()
            self._seen.add(key)
        return True

    def _emit(self, level: int, key: Hashable, msg: str, args: tuple[Any, ...], exc_info: Any) -> bool:
        if not self._first(key):
            return False
        # stacklevel 3: the line names the caller of log()/warning()/..., not this module
        self._log.log(level, msg + self._suffix, *args, exc_info=exc_info, stacklevel=3)
        return True

    def log(self, level: int, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` was logged since it was last cleared;
        True when it was logged now."""
        return self._emit(level, key, msg, args, exc_info)

    def info(self, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        return self._emit(logging.INFO, key, msg, args, exc_info)

    def warning(self, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        return self._emit(logging.WARNING, key, msg, args, exc_info)

    def error(self, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        return self._emit(logging.ERROR, key, msg, args, exc_info)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._seen

    def clear(self, key: Hashable | None = None) -> None:
        """Forget ``key`` (every key when None): it is logged again the next time it is seen."""
        with self._lock:
            if key is None:
                self._seen.clear()
            else:
                self._seen.discard(key)
