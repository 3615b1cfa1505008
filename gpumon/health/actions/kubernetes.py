"""NodeConditions on the pod's own node, in the types AKS's node-problem-detector uses for GPU nodes.

gpumon's rules map onto AKS's condition types where one exists, so dashboards, alerts and
remediators already written for AKS's GPU health monitoring see gpumon's verdict; every other rule
reports under ``GpumonUnhealthy`` (an unhealthy finding) or ``GpumonDegraded`` (a degraded one).
Every type gpumon owns is sent on each transition, ``True`` while a problem is present and
``False`` once it cleared, as one strategic-merge PATCH of ``nodes/<node>/status`` (the API
server merges ``conditions`` by ``type``, leaving the kubelet's and other detectors' alone).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from gpumon.health.actions.kubeapi import STRATEGIC_MERGE, KubeApi
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.catalogue import Level
from gpumon.health.faultcodes import with_code
from gpumon.health.stage import Verdict

UNHEALTHY, DEGRADED = "GpumonUnhealthy", "GpumonDegraded"
# gpumon rule id (or its longest dotted prefix) -> the AKS condition type. The NVLink XIDs (74, and
# 144-150 on GB200) say a link failed: NVLinkStatusInactive rather than XIDErrors.
AKS_TYPES: dict[str, str] = {
    "gpu.lost": "GPUMissing",
    "gpu.missing": "GPUMissing",
    "gpu.xid": "XIDErrors",
    **{f"gpu.xid.{xid}": "NVLinkStatusInactive" for xid in (74, *range(144, 151))},
    "gpu.thermal_slowdown": "GPUClockThrottling",
    "ib.port.flapping": "IBLinkFlapping",
}
CONDITION_TYPES: tuple[str, ...] = tuple(dict.fromkeys([*AKS_TYPES.values(), UNHEALTHY, DEGRADED]))


def condition_type(rule: str, level: str) -> str:
    """The condition a finding of ``rule`` at ``level`` ("degraded"/"unhealthy") reports under."""
    parts = rule.split(".")
    for n in range(len(parts), 0, -1):
        mapped = AKS_TYPES.get(".".join(parts[:n]))
        if mapped:
            return mapped
    return UNHEALTHY if level == Level.UNHEALTHY.label else DEGRADED


def camel(rule: str) -> str:
    """A condition reason in Kubernetes' CamelCase: gpu.xid.79 -> GpuXid79."""
    return "".join(part[:1].upper() + part[1:] for part in rule.replace("_", ".").split("."))


def rfc3339(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def conditions(verdict: Verdict, since: dict[str, tuple[str, str]], now: float) -> list[dict[str, str]]:
    """Every owned type's condition for ``verdict``; ``since`` (type -> (status, transition time)) is
    updated so lastTransitionTime moves only when the status does."""
    problems: dict[str, list[dict[str, Any]]] = {t: [] for t in CONDITION_TYPES}
    for finding in verdict.findings:
        problems[condition_type(str(finding.get("rule", "")), str(finding.get("severity", "")))].append(finding)
    out = []
    for ctype, found in problems.items():
        status = "True" if found else "False"
        previous = since.get(ctype)
        transition = previous[1] if previous and previous[0] == status else rfc3339(now)
        since[ctype] = (status, transition)
        if found:
            reason = camel(str(found[0].get("rule", "")))
            message = "; ".join(with_code(str(f.get("reason", "")), f.get("fault_code"))
                                for f in found)
        else:
            reason, message = f"No{ctype}", f"gpumon: no {ctype} problem"
        out.append({"type": ctype, "status": status, "reason": reason, "message": message[:1024],
                    "lastHeartbeatTime": rfc3339(now), "lastTransitionTime": transition})
    return out


class KubernetesAction:
    kind = "kubernetes"

    def __init__(self, settings: ActionSettings, clock: Callable[[], float] | None = None) -> None:
        self.api = KubeApi(settings)
        self.since: dict[str, tuple[str, str]] = {}
        self._clock = clock or time.time
        if settings.kube_api_url().startswith("http://"):  # only with [health] kube_api_allow_http (checked with the config)
            logging.getLogger("gpumon.health.actions").warning(
                "health: kube_api %s is plain http: the service-account token is sent in cleartext "
                "(kube_api_allow_http = true)", settings.kube_api_url())

    def act(self, verdict: Verdict) -> None:
        self.api.ready()
        since = dict(self.since)
        body = {"status": {"conditions": conditions(verdict, since, self._clock())}}
        self.api.call("PATCH", self.api.node_path("/status"), body, STRATEGIC_MERGE)
        self.since = since  # only once the server took it


def check(settings: ActionSettings) -> list[str]:
    """Problems of the Kubernetes actions (NodeConditions, Events, the taint): they share the API."""
    if not (settings.kubernetes or settings.kube_events or settings.kube_taint):
        return []
    problems = []
    if not settings.kube_node_name():
        problems.append("[health] a Kubernetes action is on but no node name: set node_name or NODE_NAME from the "
                        "downward API (spec.nodeName)")
    if not settings.kube_api_url():
        problems.append("[health] a Kubernetes action is on but no API server: set kube_api, or run in a pod "
                        "(KUBERNETES_SERVICE_HOST)")
    for what, path in (("token", settings.kube_token_file), ("CA", settings.kube_ca_file)):
        if not os.access(path, os.R_OK):
            problems.append(f"[health] a Kubernetes action is on but the service-account {what} {path} is not readable")
    return problems
