"""One job's GPUs (and hosts' InfiniBand ports), worst first, from the straggler recording rules.

The contract with the rules in deploy/prometheus/job-rules.yaml (docs/job-health.md):
``gpumon_job:straggler_score`` (labels ``job_id``, ``instance``, ``gpu``, ``signal``: how far the GPU sits
from its job's median on its worst signal; a series with ``device`` and ``port`` and no ``gpu`` scores an
InfiniBand port of the host) and ``gpumon_job_host:straggler_score`` (``job_id``, ``instance``,
``signal``: the host's roll-up). GPUs in no job are scored with ``job_id=""``. Everything else is read
from the series gpumon exports, joined on ``instance`` and ``gpu``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

from gpumon.catalogue import gpu as gpu_metrics
from gpumon.catalogue import host as host_metrics
from gpumon.fleet.promql import Client, QueryFailed, Sample

GPU_SCORE = "gpumon_job:straggler_score"
HOST_SCORE = "gpumon_job_host:straggler_score"
RECORDING_RULES = (GPU_SCORE, HOST_SCORE)
STRAGGLER_ALERT = "GpumonJobStraggler"
STALLED_ALERT = "GpumonJobStalled"
ALLOCATION = host_metrics.ALLOCATION.name
VERDICTS = {0: "healthy", 1: "degraded", 2: "unhealthy"}
IB_WINDOW = "1m"
FLAP_WINDOW = "1h"


class UnknownJob(QueryFailed):
    """No GPU of any host is held by the job (or its series went stale)."""


class RulesMissing(QueryFailed):
    """The job's GPUs are there but the straggler recording rules are not evaluated."""


@dataclass
class Row:
    """One GPU of the job, or (``gpu`` empty) one host's InfiniBand ports: ``score`` and ``signal`` are
    the GPU's own (the worst port's, named by ``device`` and ``port``), the host's roll-up beside them."""

    instance: str
    host: str
    gpu: str
    device: str = ""
    port: str = ""
    verdict: str = "unknown"
    score: float = math.nan
    signal: str = ""
    host_score: float = math.nan
    host_signal: str = ""
    activity: float = math.nan          # ratio 0-1 (SM activity where GPM answers, else utilization)
    power_watts: float = math.nan
    sm_clock_hertz: float = math.nan
    sm_clock_ratio: float = math.nan    # of the GPU's maximum SM clock
    ib_transmit_bytes_per_second: float = math.nan   # the host's InfiniBand ports together (not Ethernet)
    ib_flaps: float = math.nan          # link flaps on the host's ports in the last hour
    alerts: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: NaN (no data) and an empty ``gpu`` (a host's ports), ``device`` or ``port`` become null."""
        out = asdict(self)
        out["alerts"] = list(self.alerts)
        return {k: (None if (isinstance(v, float) and math.isnan(v)) or (k in ("gpu", "device", "port") and v == "")
                    else v) for k, v in out.items()}


@dataclass(frozen=True)
class JobSummary:
    job_id: str
    hosts: int
    gpus: int
    worst_score: float
    worst_signal: str
    worst_instance: str
    worst_gpu: str
    worst_device: str
    worst_port: str
    alerts: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["alerts"] = list(self.alerts)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def _quote(value: str) -> str:
    """A PromQL string literal (double-quoted, backslash and quote escaped)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def host_of(instance: str) -> str:
    """The host part of an ``instance`` (``node7:9470`` -> ``node7``; ``[::1]:9470`` -> ``::1``)."""
    if instance.startswith("["):
        return instance[1:].partition("]")[0]
    return re.sub(r":\d+$", "", instance)


def _sort_key(row: Row) -> tuple[int, float, float, str, int]:
    """Worst first: a firing alert, then the GPU's score, then its host's; no score sorts last."""
    score = -row.score if not math.isnan(row.score) else math.inf
    host = -row.host_score if not math.isnan(row.host_score) else math.inf
    gpu = int(row.gpu) if row.gpu.isdigit() else 1 << 30
    return (0 if row.alerts else 1, score, host, row.instance, gpu)


class JobView:
    """The queries behind ``gpumon job``; each method asks the server afresh (``--watch`` calls again)."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def missing_rules(self) -> list[str]:
        """The contract's recording rules the server does not evaluate: from its rules API where it has
        one, else from whether any series of that name exists."""
        loaded = self.client.recording_rules()
        if loaded is not None:
            return [name for name in RECORDING_RULES if name not in loaded]
        return [name for name in RECORDING_RULES if not self.client.query(f"count({name})")]

    def _require_rules(self) -> None:
        missing = self.missing_rules()
        if missing:
            raise RulesMissing(f"{self.client.shown} does not evaluate the recording rule(s) {', '.join(missing)}: "
                               "load deploy/prometheus/job-rules.yaml and recording-rules.yaml (docs/job-health.md)")

    def rows(self, job_id: str) -> list[Row]:
        """Every GPU of ``job_id``, worst first."""
        j = _quote(job_id)
        members = (f"group by (instance, gpu) ({GPU_SCORE}{{job_id={j}}}) "
                   f"or group by (instance, gpu) ({ALLOCATION}{{job_id={j}}})")
        found = self.client.query(members)
        if not found:
            raise UnknownJob(f"no GPU is held by job {job_id!r} at {self.client.shown} "
                             "(no gpumon_gpu_allocation_info{job_id=...} series: unknown, or ended)")
        self._require_rules()
        rows = {(s.labels.get("instance", ""), s.labels.get("gpu", "")): Row(
            s.labels.get("instance", ""), host_of(s.labels.get("instance", "")), s.labels.get("gpu", ""))
            for s in found}
        on_gpu = f"and on (instance, gpu) ({members})"
        on_host = f"and on (instance) group by (instance) ({members})"

        def per_gpu(expr: str, apply: Callable[[Row, Sample], None]) -> None:
            for s in self.client.query(expr):
                row = rows.get((s.labels.get("instance", ""), s.labels.get("gpu", "")))
                if row is not None:
                    apply(row, s)

        def per_host(expr: str, apply: Callable[[Row, Sample], None]) -> None:
            by_instance: dict[str, list[Row]] = {}
            for row in rows.values():
                by_instance.setdefault(row.instance, []).append(row)
            for s in self.client.query(expr):
                for row in by_instance.get(s.labels.get("instance", ""), []):
                    apply(row, s)

        def best(row: Row, s: Sample, score: str, signal: str) -> None:
            if math.isnan(getattr(row, score)) or s.value > getattr(row, score):
                setattr(row, score, s.value)
                setattr(row, signal, s.labels.get("signal", ""))
                if score == "score" and not row.gpu:
                    row.device, row.port = s.labels.get("device", ""), s.labels.get("port", "")

        per_gpu(f"{GPU_SCORE}{{job_id={j}}}", lambda r, s: best(r, s, "score", "signal"))
        per_host(f"{HOST_SCORE}{{job_id={j}}}", lambda r, s: best(r, s, "host_score", "host_signal"))
        # The host roll-up is its own rule group, which reads the scores as their groups last recorded
        # them: it can lag a member's newer score by one evaluation. A host is never shown below its worst
        # member.
        worst: dict[str, Row] = {}
        for row in rows.values():
            if not math.isnan(row.score) and (row.instance not in worst or row.score > worst[row.instance].score):
                worst[row.instance] = row
        for row in rows.values():
            top = worst.get(row.instance)
            if top is not None and (math.isnan(row.host_score) or top.score > row.host_score):
                row.host_score, row.host_signal = top.score, top.signal
        per_gpu(f'gpumon_gpu_utilization_ratio{{engine="gpu"}} {on_gpu}', lambda r, s: setattr(r, "activity", s.value))
        per_gpu(f'gpumon_gpu_activity_ratio{{activity="sm"}} {on_gpu}', lambda r, s: setattr(r, "activity", s.value))
        per_gpu(f"{gpu_metrics.POWER.name} {on_gpu}", lambda r, s: setattr(r, "power_watts", s.value))
        per_gpu(f'gpumon_gpu_clock_hertz{{clock="sm"}} {on_gpu}', lambda r, s: setattr(r, "sm_clock_hertz", s.value))
        per_gpu(f'gpumon_gpu_clock_hertz{{clock="sm"}} / ignoring(clock) '
                f'gpumon_gpu_clock_max_hertz{{clock="sm"}} {on_gpu}',
                lambda r, s: setattr(r, "sm_clock_ratio", s.value))
        per_host(f"sum by (instance) (rate(gpumon_ib_port_data_transmitted_bytes_total[{IB_WINDOW}]) "
                 f'and on (instance, device, port) gpumon_ib_port_info{{link_layer="InfiniBand"}} {on_host})',
                 lambda r, s: setattr(r, "ib_transmit_bytes_per_second", s.value))
        per_host(f"sum by (instance) (increase(gpumon_ib_link_flaps_total[{FLAP_WINDOW}]) {on_host})",
                 lambda r, s: setattr(r, "ib_flaps", s.value))
        # a GPU's verdict: its own rules', and those about the whole node or its ports (not other GPUs')
        node: dict[str, int] = {}
        for s in self.client.query(f'max by (instance) (gpumon_health_state{{gpu=""}}) {on_host} '
                                   f"or max by (instance) (gpumon_node_health) {on_host}"):
            if not math.isnan(s.value):
                node[s.labels.get("instance", "")] = int(s.value)
        own: dict[tuple[str, str], int] = {}
        for s in self.client.query(f'max by (instance, gpu) (gpumon_health_state{{gpu!=""}}) {on_gpu}'):
            if not math.isnan(s.value):
                own[(s.labels.get("instance", ""), s.labels.get("gpu", ""))] = int(s.value)
        for key, row in rows.items():
            levels = [v for v in (own.get(key), node.get(row.instance)) if v is not None]
            row.verdict = VERDICTS.get(max(levels), "unknown") if levels else "unknown"
        for s in self.client.query(f'ALERTS{{alertstate="firing", job_id={j}}}'):
            name, instance, gpu = s.labels.get("alertname", ""), s.labels.get("instance", ""), s.labels.get("gpu", "")
            for key, row in rows.items():
                if name == STALLED_ALERT:   # the whole job hangs; the alert names the host that went quiet first
                    hit = True
                elif gpu:
                    hit = key == (instance, gpu)
                else:   # a port's (or a host's) alert: its host's ports row, else every GPU of the host
                    hit = row.instance == instance and (not row.gpu or (instance, "") not in rows)
                if hit and name not in row.alerts:
                    row.alerts = (*row.alerts, name)
        return sorted(rows.values(), key=_sort_key)

    def jobs(self) -> list[JobSummary]:
        """Every job holding GPUs now, worst first."""
        held = self.client.query(f'count by (job_id, instance) ({ALLOCATION}{{job_id!=""}})')
        scored = self.client.query(f'count by (job_id, instance) ({GPU_SCORE}{{job_id!="", gpu!=""}})')
        if not held and not scored:
            return []
        self._require_rules()
        hosts: dict[str, dict[str, int]] = {}
        for s in held + scored:
            per = hosts.setdefault(s.labels.get("job_id", ""), {})
            per[s.labels.get("instance", "")] = max(per.get(s.labels.get("instance", ""), 0), int(s.value))
        worst: dict[str, Sample] = {}
        for s in self.client.query(f'topk by (job_id) (1, {GPU_SCORE}{{job_id!=""}})'):
            job = s.labels.get("job_id", "")
            if job not in worst or s.value > worst[job].value:
                worst[job] = s
        alerts: dict[str, set[str]] = {}
        for s in self.client.query('ALERTS{alertstate="firing", job_id!=""}'):
            alerts.setdefault(s.labels["job_id"], set()).add(s.labels.get("alertname", ""))
        out = []
        for job, per in hosts.items():
            w = worst.get(job)
            labels = w.labels if w else {}
            out.append(JobSummary(job, len(per), sum(per.values()), w.value if w else math.nan,
                                  labels.get("signal", ""), labels.get("instance", ""), labels.get("gpu", ""),
                                  labels.get("device", ""), labels.get("port", ""), tuple(sorted(alerts.get(job, ())))))
        return sorted(out, key=lambda s: (not s.alerts, -s.worst_score if not math.isnan(s.worst_score)
                                          else math.inf, s.job_id))
