"""One thread per action kind: the latest transition wins, failures are retried with backoff.

The loop must never wait on Slurm, the API server or a hook. Each action therefore has a slot of
length one that :meth:`Worker.submit` overwrites: a worker busy with (or backing off from) an older
verdict picks up only the newest, so a burst of transitions costs one run, not a queue of them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from gpumon.backoff import Backoff
from gpumon.health.actions.process import ActionError
from gpumon.health.stage import Verdict
from gpumon.log_once import LogOnce

log = logging.getLogger("gpumon.health.actions")


class Action(Protocol):
    kind: str

    def act(self, verdict: Verdict) -> None:
        """Bring the outside world in line with ``verdict``; raise :class:`ActionError` to be retried."""


class Worker:
    """Runs one action on its own thread; counts runs (attempts), failures and retries."""

    def __init__(self, action: Action, backoff: Backoff, on_done=None) -> None:
        self.action = action
        self._backoff = backoff
        self._on_done = on_done or (lambda verdict: None)
        self._cond = threading.Condition()
        self._pending: Verdict | None = None
        self._stopping = False
        self._logged = LogOnce(log)
        self.counts = {"runs": 0, "failures": 0, "retries": 0}
        self._thread = threading.Thread(target=self._run, name=f"gpumon-action-{action.kind}", daemon=True)
        self._thread.start()

    def submit(self, verdict: Verdict) -> None:
        """Replace whatever waits in the slot; never blocks beyond taking the lock."""
        with self._cond:
            self._pending = verdict
            # a failing target (scontrol hung, the API server refusing) keeps its backoff across new
            # transitions: a flapping verdict must not drive it with no backoff at all
            self._cond.notify()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return dict(self.counts)

    def close(self, deadline: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def _take(self) -> Verdict | None:
        """The next verdict to act on, once its backoff (if any) has passed; None when stopping."""
        with self._cond:
            while not self._stopping:
                wait = self._backoff.not_before - time.monotonic()
                if self._pending is not None and wait <= 0:
                    verdict, self._pending = self._pending, None
                    return verdict
                self._cond.wait(wait if self._pending is not None else None)
            return None

    def _run(self) -> None:
        while (verdict := self._take()) is not None:
            retry = self._backoff.failures > 0
            try:
                self.action.act(verdict)
            except ActionError as exc:
                self._failed(verdict, str(exc), retry, exc.retry_after)
            except Exception as exc:  # a bug must not end the thread: count it like any failure
                log.debug("health action %s raised", self.action.kind, exc_info=True)
                self._failed(verdict, f"{type(exc).__name__}: {exc}", retry)
            else:
                self._succeeded(retry)
                self._on_done(verdict)

    def _failed(self, verdict: Verdict, error: str, retry: bool, retry_after: float | None = None) -> None:
        with self._cond:
            self.counts["runs"] += 1
            self.counts["failures"] += 1
            self.counts["retries"] += retry
            if self._pending is None:  # a newer transition, if any, replaces this retry
                self._pending = verdict
            delay = self._backoff.failed(time.monotonic(), retry_after)
        self._logged.warning(self.action.kind, "health action %s failed (%s); retrying with backoff, "
                             "next in %.1f s, logged once until it succeeds", self.action.kind, error, delay)

    def _succeeded(self, retry: bool) -> None:
        with self._cond:
            self.counts["runs"] += 1
            self.counts["retries"] += retry
            self._backoff.succeeded()
        self._logged.clear(self.action.kind)
