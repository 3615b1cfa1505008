"""The daemon's own metrics: the loop's self-metrics, prometheus-client's ``process_*`` and the
health stage's, each declared once (name, type, typed unit, help, labels, sink hints)."""

from __future__ import annotations

from gpumon.catalogue.hints import Domain, Kind, OtelMetric
from gpumon.catalogue.units import (
    BYTES,
    COUNT,
    ERRORS,
    EVENTS,
    INFO,
    SECONDS,
    STATE,
    Unit,
    count,
)
from gpumon.model import MetricSpec, MetricType

# --- the loop (stages/selfmetrics.py) ----------------------------------------------------------------------
BUILD_INFO = MetricSpec("gpumon_build_info", MetricType.INFO, "gpumon version and the Python running it.",
unit=INFO,
                        labels=("version", "python"))
COLLECTOR_UP = MetricSpec("gpumon_collector_up", MetricType.GAUGE,
                          "1 when the collector's latest run succeeded within its deadline; its series "
                          "are withdrawn while 0.", unit=STATE, labels=("collector",))
COLLECTOR_DURATION = MetricSpec("gpumon_collector_duration_seconds", MetricType.GAUGE,
                                "Wall time of the collector's latest completed run.", SECONDS,
                                ("collector",))
COLLECTOR_RUNS = MetricSpec("gpumon_collector_runs_total", MetricType.COUNTER,
                            "Completed runs of the collector, successful or not.",
                            unit=count("run"), labels=("collector",))
COLLECTOR_ERRORS = MetricSpec("gpumon_collector_errors_total", MetricType.COUNTER,
                              "Faults counted by the collector (unreadable values, failed calls) and by "
                              "the loop (exception, deadline), by reason.",
                              unit=ERRORS, labels=("collector", "reason"))
SINK_UP = MetricSpec("gpumon_sink_up", MetricType.GAUGE, "1 while the sink is able to deliver.", unit=STATE,
                     labels=("sink",))
SINK_EXPORTED = MetricSpec("gpumon_sink_exported_total", MetricType.COUNTER,
                           "Items the sink delivered: scrapes served, data points or rows accepted.",
                           unit=count("item"),
                           labels=("sink",))
SINK_FAILED = MetricSpec("gpumon_sink_failed_total", MetricType.COUNTER,
                         "Deliveries that failed (and were retried or dropped).",
                         unit=count("request"), labels=("sink",))
SINK_DROPPED = MetricSpec("gpumon_sink_dropped_total", MetricType.COUNTER,
                          "Items the sink gave up on (spool full, rejected by the service).",
                          unit=count("item"), labels=("sink",))


def sink_gauge(key: str, unit: Unit = COUNT) -> MetricSpec:
    """A sink's own gauge ``gpumon_sink_<key>``, one per key of its ``SinkHealth.extra``."""
    return MetricSpec(f"gpumon_sink_{key}", MetricType.GAUGE, f"Sink-specific gauge {key!r} (see the sink's docs).",
                      unit, ("sink",))


SINK_GAUGES = {spec.name: spec for spec in (
    sink_gauge("spool_bytes", Unit("", "By")),
    sink_gauge("last_success_timestamp_seconds", Unit("", "s")),
    sink_gauge("queued_records", count("record")),
    sink_gauge("consecutive_failures", count("failure")),
    sink_gauge("exported_data_points", count("data_point")),
    sink_gauge("exported_log_records", count("record")),
    sink_gauge("connections", COUNT),
    sink_gauge("requests_queued", COUNT),
    sink_gauge("rows_queued", COUNT),
    sink_gauge("unmapped_metrics", COUNT),
)}
"""The built-in sinks' own gauges (OpenTelemetry, Prometheus, remote write, Azure Monitor) by name. The
Prometheus word of each is left empty, as these series have always been exposed (no ``# UNIT``); the
UCUM code is what the OpenTelemetry sink sends. A plugin sink's other keys get :func:`sink_gauge`'s
``{count}``."""

COLLECTOR_STATE = MetricSpec("gpumon_collector_state", MetricType.GAUGE,
                             "1 for each collector, labelled with its state (ok, down, unavailable) and "
                             "why (a fixed vocabulary), so an unmounted /host/sys and a host without an "
                             "HCA can be told apart.", unit=STATE, labels=("collector", "state", "reason"))

CONFIG_RELOADS = MetricSpec("gpumon_config_reloads_total", MetricType.COUNTER,
                            "SIGHUP reloads by result; a failed one keeps the running configuration.",
                            unit=count("reload"),
                            labels=("result",))
CONFIG_RELOAD_OK = MetricSpec("gpumon_config_last_reload_successful", MetricType.GAUGE,
                              "0 when the latest reload was rejected and an older configuration runs.",
                              unit=STATE)

SELF_SPECS = (BUILD_INFO, COLLECTOR_UP, COLLECTOR_STATE, COLLECTOR_DURATION, COLLECTOR_RUNS, COLLECTOR_ERRORS,
              SINK_UP, SINK_EXPORTED, SINK_FAILED, SINK_DROPPED, CONFIG_RELOADS, CONFIG_RELOAD_OK)
"""The loop's self-metrics (:mod:`gpumon.stages.selfmetrics` builds them)."""


def _process(name: str, kind: MetricType, help: str, unit: Unit, otel: OtelMetric | None = None) -> MetricSpec:
    return MetricSpec(name, kind, help, unit, otel=(otel,) if otel else ())


PROCESS_SPECS = (
    _process("process_cpu_seconds_total", MetricType.COUNTER,
             "Total user and system CPU time spent in seconds.", SECONDS,
             OtelMetric("process.cpu.time", "s", Kind.COUNTER, Domain.PROCESS, semconv=True, cpu_modes=True,
                        description="CPU time of the gpumon process.")),
    _process("process_resident_memory_bytes", MetricType.GAUGE, "Resident memory size in bytes.", BYTES,
             OtelMetric("process.memory.usage", "By", Kind.UPDOWN, Domain.PROCESS, semconv=True)),
    _process("process_virtual_memory_bytes", MetricType.GAUGE, "Virtual memory size in bytes.", BYTES,
             OtelMetric("process.memory.virtual", "By", Kind.UPDOWN, Domain.PROCESS, semconv=True)),
    _process("process_open_fds", MetricType.GAUGE, "Number of open file descriptors.", count("file_descriptor"),
             OtelMetric("process.unix.file_descriptor.count", "{file_descriptor}", Kind.UPDOWN,
                        Domain.PROCESS, semconv=True)),
    _process("process_max_fds", MetricType.GAUGE, "Maximum number of open file descriptors.", count("file_descriptor")),
    _process("process_start_time_seconds", MetricType.GAUGE,
             "Start time of the process since unix epoch in seconds.", SECONDS),
)
"""The process_* metrics prometheus-client reads from /proc (names and meaning are its own), declared
here so that they carry their sink hints (the process.* semantic conventions) and the docs list them.
prometheus-client, not gpumon, makes the samples: :meth:`SelfMetrics._read_process` pairs each with
its declaration by name, the one place a hint is found through a metric's name."""


# --- the health stage (health/stage.py) ----------------------------------------------------------
HEALTH_STATE = MetricSpec("gpumon_health_state", MetricType.GAUGE,
                          "Health of one rule on one GPU, port or the node: 0 ok, 1 degraded, 2 unhealthy.",
                          unit=STATE, labels=("rule", "gpu", "device", "port"))
NODE_HEALTH = MetricSpec("gpumon_node_health", MetricType.GAUGE,
                         "The node's verdict: 0 healthy, 1 degraded, 2 unhealthy (the worst of gpumon_health_state).",
                         unit=COUNT)
ACTION_RUNS = MetricSpec("gpumon_health_action_runs_total", MetricType.COUNTER,
                         "Attempts of a health action (slurm, kubernetes, hook), retries included.",
                         unit=count("run"),
                         labels=("action",))
ACTION_FAILURES = MetricSpec("gpumon_health_action_failures_total", MetricType.COUNTER,
                             "Failed attempts of a health action (each retried with backoff).",
                             unit=count("failure"),
                             labels=("action",))
GHR_REPORTS = MetricSpec("gpumon_health_azure_ghr_reports_total", MetricType.COUNTER,
                         "Guest Health Reports by outcome: filed, already_filed (409), rate_limited, rejected "
                         "(400), not_onboarded (403), unauthorized (401), dry_run.",
                         unit=EVENTS, labels=("outcome",))
HEALTH_SPECS = (HEALTH_STATE, NODE_HEALTH, ACTION_RUNS, ACTION_FAILURES, GHR_REPORTS)
"""The health stage's metrics (:mod:`gpumon.health.stage` builds them)."""
