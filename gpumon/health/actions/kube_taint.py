"""Taint the node ``gpumon.io/unhealthy=<rule>:NoSchedule`` while the verdict is unhealthy, so the
scheduler places no new pods on it; untaint it once the verdict clears.

``spec.taints`` has no merge key in the Node's schema: a strategic-merge patch replaces the whole
list. So the Node is read first (``get`` on nodes) and the list written back with only gpumon's
taint changed, every other taint (the GPU operator's, an operator's cordon) kept as it was; the
patch carries the ``resourceVersion`` read, so a Node changed in between answers 409 Conflict and
the attempt is retried (read again) with backoff, never overwriting another writer's taints.
"""

from __future__ import annotations

import re
from typing import Any

from gpumon.health.actions.kubeapi import STRATEGIC_MERGE, KubeApi
from gpumon.health.actions.process import ActionError
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.catalogue import Level
from gpumon.health.stage import Verdict

TAINT_KEY = "gpumon.io/unhealthy"
EFFECT = "NoSchedule"
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9._-]")


def taint_value(verdict: Verdict) -> str:
    """The rule of the finding that set the node's action, as a label value (63 characters of
    ``[A-Za-z0-9._-]``, alphanumeric at both ends)."""
    chosen = next((f for f in verdict.findings
                   if f.get("severity") == Level.UNHEALTHY.label and f.get("action") == verdict.action),
                  verdict.findings[0] if verdict.findings else {})
    value = _LABEL_VALUE_BAD.sub("_", str(chosen.get("rule", "health")))[:63].strip("._-")
    return value or "health"


def wanted(verdict: Verdict) -> dict[str, str] | None:
    if verdict.level is not Level.UNHEALTHY:
        return None
    return {"key": TAINT_KEY, "value": taint_value(verdict), "effect": EFFECT}


def new_taints(current: list[dict[str, Any]], taint: dict[str, str] | None) -> list[dict[str, Any]]:
    """``current`` with gpumon's taint set to ``taint`` (or removed), the others in their order."""
    out = [t for t in current if t.get("key") != TAINT_KEY]
    mine = [t for t in current if t.get("key") == TAINT_KEY]
    if taint is not None:
        same = next((t for t in mine if t.get("effect") == EFFECT and t.get("value") == taint["value"]), None)
        out.append(same or taint)
    return out


class KubeTaintAction:
    kind = "kube_taint"

    def __init__(self, settings: ActionSettings) -> None:
        self.api = KubeApi(settings)

    def act(self, verdict: Verdict) -> None:
        self.api.ready()
        node = self.api.call("GET", self.api.node_path())
        if not isinstance(node, dict):
            raise ActionError(f"GET {self.api.node_path()}: the answer is not a Node")
        current = list((node.get("spec") or {}).get("taints") or [])
        taints = new_taints(current, wanted(verdict))
        if taints == current:
            return
        version = (node.get("metadata") or {}).get("resourceVersion")
        body: dict[str, Any] = {"spec": {"taints": taints}}
        if version:
            body["metadata"] = {"resourceVersion": version}
        self.api.call("PATCH", self.api.node_path(), body, STRATEGIC_MERGE)
