"""Guest Health Reporting: tell Azure about an unhealthy finding, so the host is taken out and repaired.

One impact report per new unhealthy finding whose rule has an AzNHC fault code
(:mod:`gpumon.health.faultcodes`), filed with the Impact Reporting API as the VM's managed identity:
``PUT {arm}/subscriptions/{sub}/providers/Microsoft.Impact/workloadImpacts/{name}`` (Azure's REST
spec, ``specification/impact/resource-manager/Microsoft.Impact/preview/2023-12-01-preview/impact.json``).

The report's name is derived from the VM id, the rule, the subject and the finding's start, so a
restart or a re-evaluation asks ARM for the same resource again instead of filing a second one (and
the names filed are remembered in ``<state_dir>/azure-ghr.json``). A 409 means ARM has it already.
Reports are limited per impact category (``[health] azure_ghr_rate_limit`` per
``azure_ghr_rate_window``): a flapping finding must not flood the repair pipeline. Failures are
retried by the action's worker with the shared backoff, honouring Retry-After; a 400 (the API
rejecting the body) is logged with the field it names and not retried.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

from gpumon import imds
from gpumon.health.actions import memory
from gpumon.health.actions.process import ActionError
from gpumon.health.actions.settings import ActionSettings
from gpumon.health.catalogue import Level
from gpumon.health.faultcodes import nhc_line, with_code
from gpumon.health.stage import Verdict
from gpumon.log_once import LogOnce
from gpumon.sinks.common import retry_after_from_headers

log = logging.getLogger("gpumon.health.actions.azure_ghr")

API_VERSION = "2023-12-01-preview"
AUDIENCE = "https://management.azure.com"
"""The token's resource (IMDS ``resource=``); azure-identity takes it as the scope ``<resource>/.default``."""
STATE_FILE = "azure-ghr.json"
NAMESPACE = uuid.UUID("6f1c43b5-6a1b-4c53-9d0e-2f8b7c1e9a40")
"""Fixed namespace of gpumon's report names (uuid5): the same finding always has the same name."""
KEEP_FILED = 30 * 86400.0
"""Seconds a filed name is remembered (a sticky finding lasting longer is filed at most once more)."""
MAX_DESCRIPTION = 1000


def report_name(vm_id: str, finding: dict[str, Any]) -> str:
    """``gpumon-<uuid5>``: deterministic, and within the spec's name pattern
    ``^[a-zA-Z0-9][a-zA-Z0-9-:]*[a-zA-Z0-9]{3,120}$``."""
    subject = ",".join(f"{k}={v}" for k, v in sorted(dict(finding.get("subject") or {}).items()))
    key = f"{vm_id}|{finding.get('rule')}|{subject}|{float(finding.get('since') or 0):.3f}"
    return f"gpumon-{uuid.uuid5(NAMESPACE, key)}"


def iso(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def reportable(verdict: Verdict) -> list[dict[str, Any]]:
    """The findings Azure is told about: unhealthy, with an impact category."""
    return [f for f in verdict.findings if f.get("severity") == Level.UNHEALTHY.label and f.get("impact_category")]


def body(instance: imds.AzureInstance, finding: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    """The WorkloadImpact resource for one finding (only the writable properties of the spec)."""
    subject = dict(finding.get("subject") or {})
    gpu = (facts.get("gpus") or {}).get(subject.get("gpu", ""), {}) if "gpu" in subject else {}
    extra = {"VmUniqueId": instance.vm_id, "PhysicalHostName": facts.get("physical_host") or "",
             "SerialNumber": gpu.get("serial", ""), "PciBusId": gpu.get("pci_bus_id", ""),
             "GpuUuid": gpu.get("uuid", ""), "FaultCode": finding.get("fault_code") or "",
             "Rule": finding.get("rule", ""), "LogLine": nhc_line(str(finding.get("rule")), str(finding.get("reason")))}
    reason = with_code(f"gpumon {finding.get('rule')}: {finding.get('reason')}", finding.get("fault_code"))
    return {"properties": {
        "startDateTime": iso(float(finding.get("since") or time.time())),
        "impactedResourceId": instance.resource_id,
        "impactCategory": finding["impact_category"],
        "impactDescription": reason[:MAX_DESCRIPTION],
        "additionalProperties": {k: v for k, v in extra.items() if v},
    }}


def schema_error(detail: str) -> str:
    """The field an ARM error body names (``error.details[].target``, else ``error.target``) and its
    message, for the log line; the raw text where it is not ARM's error shape."""
    try:
        error = json.loads(detail).get("error") or {}
    except (ValueError, AttributeError):
        return detail[:300]
    parts = [f"{d.get('target') or '?'}: {d.get('message', '')}" for d in error.get("details") or []
             if isinstance(d, dict)]
    head = f"{error.get('code', '')} {error.get('target') or ''}: {error.get('message', '')}".strip()
    return "; ".join([head, *parts])[:500]


class GuestHealthReportAction:
    kind = "azure_ghr"

    def __init__(self, settings: ActionSettings, state_dir: str, credential: Any = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.arm = settings.azure_ghr_arm.rstrip("/")
        self.dry_run = settings.azure_ghr_dry_run
        self.limit = settings.azure_ghr_rate_limit
        self.window = settings.azure_ghr_rate_window
        self.timeout = settings.timeout
        self.credential = credential
        self.imds = imds.client(settings.imds_url, settings.imds_timeout)
        self._clock = clock
        self._path = os.path.join(state_dir, STATE_FILE)
        self._logged = LogOnce(log)
        self._lock = threading.Lock()
        self.counts = {"filed": 0, "already_filed": 0, "rate_limited": 0, "rejected": 0, "not_onboarded": 0,
                       "unauthorized": 0, "dry_run": 0}
        self.disabled = ""
        """Why the action does nothing on this host (IMDS names no subscription or resource); "" while on."""
        self._budget_logged = False
        doc = self._load()
        filed, sent = doc.get("filed"), doc.get("sent")
        self.filed: dict[str, dict[str, Any]] = {
            str(k): v for k, v in (filed.items() if isinstance(filed, dict) else ())
            if isinstance(v, dict) and isinstance(v.get("at"), (int, float))}
        self.sent: dict[str, list[float]] = {
            str(k): [float(t) for t in v if isinstance(t, (int, float))]
            for k, v in (sent.items() if isinstance(sent, dict) else ()) if isinstance(v, list)}
        self._open: dict[str, tuple[str, str]] = {}
        """name -> (finding key, impact), of findings filed and still present; ``impact`` (category and
        subject) is what Azure is told: gpu.lost and gpu.xid.79 on one GPU are one XID79FallenOffBus."""
        self._unfiled: dict[str, str] = {}  # name -> finding key, of findings whose report failed so far
        self._dry: set[str] = set()
        self._tls = ssl.create_default_context()

    # -- one verdict --------------------------------------------------------------------------------
    def act(self, verdict: Verdict) -> None:
        now = self._clock()
        findings = reportable(verdict)
        if self.disabled:
            return
        self._note_cleared(verdict)
        if not findings:
            return
        if verdict.budget_spent:  # the node waits for its hardware to be replaced: nothing more is filed
            if not self._budget_logged:
                log.warning("azure_ghr: the node's remediation budget is spent (node.remediation_budget); "
                            "no more impact reports are filed until it is cleared")
                self._budget_logged = True
            return
        self._budget_logged = False
        try:
            instance = self.imds.instance()
        except imds.ImdsError as exc:
            raise ActionError(f"cannot ask IMDS who this VM is: {exc}") from None
        if not instance.subscription_id or not instance.resource_id:
            self.disabled = ("IMDS names no subscriptionId or resourceId: this is not an Azure VM, and "
                             "there is nothing to report an impact on")
            log.error("azure_ghr: %s; Guest Health Reporting is disabled", self.disabled)
            return
        errors: list[ActionError] = []
        for finding in findings:
            name = report_name(instance.vm_id, finding)
            if name in self.filed or name in self._dry:
                self._open[name] = (_occurrence(finding), _impact(finding))
                continue
            told = next((n for n, (_, impact) in self._open.items() if impact == _impact(finding)), None)
            if told is not None:
                log.info("azure_ghr: %s is the impact report %s already filed; not filed again", _key(finding), told)
                continue
            try:
                self._report(instance, name, finding, verdict.facts, now)
            except _Rejected:
                self.filed[name] = {"key": _key(finding), "rejected": True, "at": now}  # never sent again
            except ActionError as exc:
                self._unfiled[name] = _occurrence(finding)
                errors.append(exc)
            else:
                self._unfiled.pop(name, None)
        self._save(now)
        if errors:
            wait = max((e.retry_after or 0.0 for e in errors), default=0.0)
            raise ActionError("; ".join(str(e) for e in errors), wait or None)

    def _note_cleared(self, verdict: Verdict) -> None:
        occurrences = {_occurrence(f) for f in verdict.findings}
        for name, (key, _) in list(self._open.items()):
            if key not in occurrences:
                del self._open[name]
                log.info("azure_ghr: %s cleared; its impact report %s stays filed (no second report)", key, name)
        for name, key in list(self._unfiled.items()):
            if key not in occurrences:
                del self._unfiled[name]
                log.info("azure_ghr: %s cleared before its impact report %s could be filed; none filed", key, name)

    def _report(self, instance: imds.AzureInstance, name: str, finding: dict[str, Any], facts: dict[str, Any],
                now: float) -> None:
        category = str(finding["impact_category"])
        recent = [t for t in self.sent.get(category, []) if now - t < self.window]
        recent = [min(t, now) for t in recent]  # a clock that jumped back: count them, and let them age
        self.sent[category] = recent
        if len(recent) >= self.limit:
            self.counts["rate_limited"] += 1
            self._logged.warning(("rate", category), "azure_ghr: %d reports of %s within %g s already; %s not "
                                 "filed (logged once per category, counted every time)", len(recent),
                                 category, self.window, _key(finding))
            return
        payload = json.dumps(body(instance, finding, facts), sort_keys=True)
        url = (f"{self.arm}/subscriptions/{urllib.parse.quote(instance.subscription_id, safe='')}/providers/"
               f"Microsoft.Impact/workloadImpacts/{name}?api-version={API_VERSION}")
        if self.dry_run:
            self.counts["dry_run"] += 1
            self._dry.add(name)
            self._open[name] = (_occurrence(finding), _impact(finding))
            log.warning("azure_ghr: dry run, not sent: PUT %s %s", url, payload)
            return
        status = self._put(url, payload.encode(), _key(finding))
        self.filed[name] = {"key": _key(finding), "category": category, "at": now}
        self._open[name] = (_occurrence(finding), _impact(finding))
        recent.append(now)
        if status == 409:
            self.counts["already_filed"] += 1
            log.info("azure_ghr: %s was filed before (409); not filed again", name)
        else:
            self.counts["filed"] += 1
            log.warning("azure_ghr: filed impact report %s (%s) for %s", name, category, _key(finding))

    def _put(self, url: str, data: bytes, what: str) -> int:
        """PUT the report; the HTTP status of a report ARM has (2xx, or 409: it had it already)."""
        request = urllib.request.Request(url, data=data, method="PUT", headers={
            "Content-Type": "application/json", "Accept": "application/json", "User-Agent": "gpumon",
            "Authorization": f"Bearer {self._token()}"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self._tls) as resp:
                resp.read(1 << 16)
                self._logged.clear()
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            detail = exc.read(4096).decode("utf-8", "replace").strip()
            status, headers = exc.code, exc.headers
            exc.close()
        except (OSError, ValueError) as exc:  # URLError, timeouts, TLS failures
            raise ActionError(f"PUT {_path(url)}: {getattr(exc, 'reason', None) or exc}") from None
        if status == 409:
            return 409
        if status == 400:  # the API rejects the body: retrying the same body cannot help
            self.counts["rejected"] += 1
            log.error("azure_ghr: the Impact Reporting API rejected the report for %s (HTTP 400): %s; not retried",
                      what, schema_error(detail))
            raise _Rejected()
        if status == 403:
            self.counts["not_onboarded"] += 1
            self._logged.error("403", "azure_ghr: HTTP 403 %s. The identity needs the Impact Reporter role on the "
                               "subscription, and the subscription must be onboarded to Guest Health Reporting "
                               "(docs/health-actions.md); the node's verdict is unchanged. Logged once, counted "
                               "every time", schema_error(detail))
        if status == 401:
            self.counts["unauthorized"] += 1
        wait = retry_after_from_headers(headers)
        raise ActionError(f"PUT {_path(url)}: HTTP {status} {schema_error(detail)}"
                          + (f" (retry after {wait:g} s)" if wait is not None else ""), wait)

    def _token(self) -> str:
        if self.credential is None:
            raise ActionError("no managed identity credential")
        try:
            return str(self.credential.get_token(AUDIENCE + "/.default").token)
        except Exception as exc:  # noqa: BLE001 - azure-identity raises its own kinds; each is a retry
            raise ActionError(f"cannot get a token for {AUDIENCE} from the managed identity: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None

    # -- memory across restarts -----------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        try:
            return memory.load(self._path)
        except (OSError, ValueError) as exc:
            log.warning("azure_ghr: cannot read %s (%s); reports already filed may be filed again (ARM "
                        "answers 409 for those)", self._path, exc)
            return {}

    def _save(self, now: float) -> None:
        self.filed = {k: v for k, v in self.filed.items() if now - float(v.get("at", now)) < KEEP_FILED}
        try:
            memory.save(self._path, {"filed": self.filed, "sent": self.sent})
        except OSError as exc:
            self._logged.warning("save", "azure_ghr: cannot save %s (%s)", self._path, exc)


class _Rejected(Exception):
    """The API rejected a report's body (400): logged with the field, never retried."""


def _path(url: str) -> str:
    return urllib.parse.urlsplit(url).path


def _impact(finding: dict[str, Any]) -> str:
    return str(finding.get("impact_category", "")) + "".join(
        f"|{k}={v}" for k, v in sorted(dict(finding.get("subject") or {}).items()))


def _occurrence(finding: dict[str, Any]) -> str:
    """One occurrence of a finding: its key and when it started (the same rule on the same GPU
    after it cleared is a new one)."""
    return f"{_key(finding)}@{float(finding.get('since') or 0):.3f}"


def _key(finding: dict[str, Any]) -> str:
    return str(finding.get("rule", "")) + "".join(f"|{k}={v}" for k, v in sorted(dict(finding.get("subject")
                                                                                       or {}).items()))


def check(settings: ActionSettings) -> list[str]:
    """What ``gpumon check`` says about the action: whether IMDS names the VM to report on."""
    if not settings.azure_ghr:
        return []
    try:
        instance = imds.client(settings.imds_url, settings.imds_timeout).instance()
    except imds.ImdsError as exc:
        return [f"[health] azure_ghr is on but IMDS does not answer ({exc}): not an Azure VM?"]
    if not instance.subscription_id or not instance.resource_id:
        return ["[health] azure_ghr is on but IMDS names no subscriptionId or resourceId: not an Azure VM; "
                "the action stays disabled"]
    return []
