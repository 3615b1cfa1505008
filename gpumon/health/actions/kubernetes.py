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
import json
import logging
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from gpumon.health.actions.process import ActionError
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.catalogue import Level
from gpumon.health.faultcodes import with_code
from gpumon.health.stage import Verdict
from gpumon.sinks.common import retry_after_from_headers

PATCH_TYPE = "application/strategic-merge-patch+json"
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
        self.node = settings.kube_node_name()
        self.api = settings.kube_api_url()
        self.token_file = settings.kube_token_file
        self.ca_file = settings.kube_ca_file
        self.timeout = settings.timeout
        self.since: dict[str, tuple[str, str]] = {}
        self._clock = clock or time.time
        if self.api.startswith("http://"):  # only with [health] kube_api_allow_http (checked with the config)
            logging.getLogger("gpumon.health.actions").warning(
                "health: kube_api %s is plain http: the service-account token is sent in cleartext "
                "(kube_api_allow_http = true)", self.api)

    def act(self, verdict: Verdict) -> None:
        if not self.node or not self.api:
            raise ActionError("no node name (NODE_NAME) or API server address (KUBERNETES_SERVICE_HOST)")
        since = dict(self.since)
        body = {"status": {"conditions": conditions(verdict, since, self._clock())}}
        self._patch(json.dumps(body).encode())
        self.since = since  # only once the server took it

    def _patch(self, body: bytes) -> None:
        url = f"{self.api}/api/v1/nodes/{urllib.parse.quote(self.node, safe='')}/status"
        request = urllib.request.Request(url, data=body, method="PATCH", headers={
            "Content-Type": PATCH_TYPE, "Accept": "application/json", "User-Agent": "gpumon",
            "Authorization": f"Bearer {self._token()}"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self._tls()) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read(512).decode("utf-8", "replace").strip()
            wait = retry_after_from_headers(exc.headers)
            raise ActionError(f"PATCH {url}: HTTP {exc.code} {detail}"
                              + (f" (retry after {wait:g} s)" if wait is not None else "")) from None
        except (OSError, ValueError) as exc:  # URLError, timeouts, TLS failures, a malformed URL
            raise ActionError(f"PATCH {url}: {getattr(exc, 'reason', None) or exc}") from None

    def _token(self) -> str:
        """Re-read on every request: the kubelet rotates projected service-account tokens."""
        try:
            with open(self.token_file, encoding="utf-8") as fh:
                return fh.read().strip()
        except OSError as exc:
            raise ActionError(f"cannot read the service-account token {self.token_file}: {exc.strerror}") from None

    def _tls(self) -> ssl.SSLContext:
        try:
            return ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ActionError(f"cannot load the cluster CA {self.ca_file}: {exc}") from None


def check(settings: ActionSettings) -> list[str]:
    if not settings.kubernetes:
        return []
    problems = []
    if not settings.kube_node_name():
        problems.append("[health] kubernetes is on but no node name: set node_name or NODE_NAME from the "
                        "downward API (spec.nodeName)")
    if not settings.kube_api_url():
        problems.append("[health] kubernetes is on but no API server: set kube_api, or run in a pod "
                        "(KUBERNETES_SERVICE_HOST)")
    for what, path in (("token", settings.kube_token_file), ("CA", settings.kube_ca_file)):
        if not os.access(path, os.R_OK):
            problems.append(f"[health] kubernetes is on but the service-account {what} {path} is not readable")
    return problems
