"""Acting on the health verdict (opt-in, every action off by default): drain the node in Slurm, set
NodeConditions on its Kubernetes node, run an operator's hook, file Guest Health Reports with Azure.

:class:`HealthActions` is fed every verdict by the loop and returns at once. It acts once per
*transition* (a change of the level or of the set of findings), on one worker thread per action
kind (:mod:`gpumon.health.actions.worker`). The last transition each action carried out is kept in
``<state_dir>/health-actions.json``, so a restart with the same sticky verdict does not run the
hook again, while a verdict that changed while gpumon was down is acted on at start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from gpumon.backoff import Backoff
from gpumon.health.actions import azure_ghr, hook, kube_events, kube_taint, kubernetes, memory, slurm
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.actions.worker import Action, Worker
from gpumon.health.stage import Verdict

log = logging.getLogger("gpumon.health.actions")
STATE_FILE = "health-actions.json"
HEALTHY_KEY: list[Any] = [0, []]
NOTHING_AT_HEALTHY_START = ("hook", "kube_events", "azure_ghr")
"""Actions that report a change (a healthy first start is none); the others reconcile at start."""


def transition_key(verdict: Verdict) -> list[Any]:
    """What makes two verdicts the same transition: the level and the set of findings (rule, subject)."""
    keys = sorted(str(f.get("rule", "")) + "".join(f"|{k}={v}" for k, v in sorted(dict(f.get("subject") or {})
                                                                                   .items()))
                  for f in verdict.findings)
    return [int(verdict.level), keys]


class HealthActions:
    """The runner the loop calls: ``on_verdict`` after every health update, ``close`` at shutdown."""

    def __init__(self, settings: ActionSettings, state_dir: str, credential: Any = None) -> None:
        """``credential``: the azure-identity credential ``azure_ghr`` takes its ARM token from."""
        self.settings = settings
        self._path = os.path.join(state_dir, STATE_FILE)
        self._lock = threading.Lock()
        self._done = self._load()
        self._seen: list[Any] | None = None
        self._workers: dict[str, Worker] = {}
        for action in _actions(settings, state_dir, credential):
            backoff = Backoff(settings.backoff_initial, settings.backoff_max)
            self._workers[action.kind] = Worker(action, backoff, self._recorder(action.kind))

    def on_verdict(self, verdict: Verdict) -> None:
        """Hand a changed verdict to every action's slot; an unchanged one costs a comparison."""
        key = transition_key(verdict)
        with self._lock:
            if key == self._seen:
                return
            first, self._seen = self._seen is None, key
            done = dict(self._done)
        for kind, worker in self._workers.items():
            # At start, an action whose last carried-out transition is this one has nothing to do; the
            # hook and the Events, never run before, treat a healthy start as no change. Slurm,
            # NodeConditions and the taint reconcile at start: the node may have been left drained,
            # tainted or its conditions stale.
            last = done.get(kind, HEALTHY_KEY if kind in NOTHING_AT_HEALTHY_START else None)
            if not first or key != last:
                worker.submit(verdict)

    def stats(self) -> dict[str, dict[str, int]]:
        return {kind: worker.stats() for kind, worker in self._workers.items()}

    def outcomes(self) -> dict[str, dict[str, int]]:
        """Per action kind that counts them, what its attempts came to (azure_ghr: filed, rejected, ...)."""
        return {kind: dict(counts) for kind, worker in self._workers.items()
                if isinstance(counts := getattr(worker.action, "counts", None), dict)}

    def close(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for worker in self._workers.values():
            worker.close(deadline)

    # -- what was carried out, across restarts -----------------------------------------------------
    def _recorder(self, kind: str):
        def record(verdict: Verdict) -> None:
            with self._lock:
                self._done[kind] = transition_key(verdict)
                self._save()
        return record

    def _load(self) -> dict[str, Any]:
        try:
            return memory.load(self._path)
        except (OSError, ValueError) as exc:
            log.warning("health actions: cannot read %s (%s); every action reconciles at start", self._path, exc)
            return {}

    def _save(self) -> None:
        try:
            memory.save(self._path, self._done)
        except OSError as exc:
            log.debug("health actions: cannot save %s: %s", self._path, exc)


def _actions(settings: ActionSettings, state_dir: str, credential: Any) -> list[Action]:
    out: list[Action] = []
    if settings.slurm:
        out.append(slurm.SlurmAction(settings))
    if settings.kubernetes:
        out.append(kubernetes.KubernetesAction(settings))
    if settings.kube_events:
        out.append(kube_events.KubeEventsAction(settings))
    if settings.kube_taint:
        out.append(kube_taint.KubeTaintAction(settings))
    if settings.hook:
        out.append(hook.HookAction(settings))
    if settings.azure_ghr:
        out.append(azure_ghr.GuestHealthReportAction(settings, state_dir, credential))
    return out


def check(settings: ActionSettings) -> list[str]:
    """Problems ``gpumon check`` prints: an action that is on but cannot work on this host."""
    return slurm.check(settings) + kubernetes.check(settings) + hook.check(settings) + azure_ghr.check(settings)


__all__ = ["ActionSettings", "HealthActions", "check", "transition_key"]
