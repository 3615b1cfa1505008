"""The ``[azure_monitor]`` section: its options, the settings they parse into, and the checks that make
a target or a spool directory that cannot work a configuration mistake (exit 2) before anything starts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gpumon.config import Option, SectionSchema, readable_file_check
from gpumon.identity import IMDS_URL
from gpumon.sinks.azure_monitor.rows import DEFAULT_STREAMS, EVENTS, GPU, IB, METRICS
from gpumon.sinks.options import azure_credential_options, spool_options, tls_options


def _ca_file_check(value: str) -> str | None:
    """``readable_file_check``, saying "no such file" in this sink's words for a path not there."""
    if value and not os.path.lexists(value):
        return f"no such file: {value}"
    return readable_file_check(value)


@dataclass(frozen=True)
class AzureMonitorSettings:
    endpoint: str
    dcr_immutable_id: str
    stream_gpu: str
    stream_infiniband: str
    stream_events: str
    stream_metrics: str
    credential: str
    client_id: str
    tenant_id: str
    client_secret: str = field(repr=False)  # a secret: never in a repr
    audience: str
    upload_interval: float
    spool_dir: str
    spool_max_bytes: int
    omit_zero_increases: bool
    static_every: float
    ca_file: str
    timeout: float
    imds_url: str


OPTIONS = SectionSchema(
    "azure_monitor",
    "Azure Monitor Logs Ingestion: rows into GpuMonGpu_CL, GpuMonInfiniBand_CL, GpuMonEvents_CL and "
    "GpuMonMetrics_CL through a data collection rule (deploy/azure/ creates it).",
    (
        Option("endpoint", str, "",
               "Logs ingestion endpoint: the Direct DCR's `logsIngestion` endpoint or a DCE's, "
               "https://<name>.<region>-1.ingest.monitor.azure.com (template output `endpoint`)."),
        Option("dcr_immutable_id", str, "", "The DCR's immutable id, dcr-<32 hex> (template output)."),
        Option("stream_gpu", str, DEFAULT_STREAMS[GPU], "Stream declared for GPU rows."),
        Option("stream_infiniband", str, DEFAULT_STREAMS[IB], "Stream declared for InfiniBand port rows."),
        Option("stream_events", str, DEFAULT_STREAMS[EVENTS], "Stream declared for event rows."),
        Option("stream_metrics", str, DEFAULT_STREAMS[METRICS],
               "Stream declared for generic rows (Name, Labels, Value) of metrics without columns of their "
               "own, such as a plugin's; empty: such metrics are logged and counted but not sent (a DCR "
               "deployed before the stream existed)."),
        *azure_credential_options("azure_monitor"),
        Option("upload_interval", float, 60.0,
               "Seconds aggregated into one GPU/port row; events are sent within seconds regardless.",
               min=0.05, max=3600.0),
        *spool_options("azure_monitor", "rows"),
        Option("omit_zero_increases", bool, True,
               "Leave out counter `...Increase` columns that are 0 (most error counters, most of the "
               "time): about a third less data; in KQL sum() is unchanged, coalesce(x, 0) shows zeros."),
        Option("static_every", float, 3600.0,
               "Seconds between rows that repeat unchanged static columns (model, serial, firmware, limits, "
               "sizes); a change is sent at once; 0 = on every row.", min=0.0, max=86400.0),
        *tls_options("endpoint", client=False, ca_aliases=("ca_bundle",), check=_ca_file_check),
        Option("timeout", float, 30.0, "Seconds to connect or to wait for a response.", min=0.1, max=600.0),
        Option("imds_url", str, IMDS_URL,
               "Deprecated alias of `[azure] imds_url` (where the rows' VM and placement columns come "
               "from), honoured when set (with a warning); empty leaves those columns out."),
    ),
    AzureMonitorSettings,
)
IMDS_ALIASES = {"imds_url": "imds_url"}
"""This section's deprecated IMDS key -> the ``[azure]`` key it stands for."""


def target_problem(opt: AzureMonitorSettings) -> tuple[str, str] | None:
    """(key, what is wrong) for the first target setting that cannot work, or None."""
    for key in ("endpoint", "dcr_immutable_id"):
        if not getattr(opt, key):
            return key, "is required (see the outputs of deploy/azure/)"
    if not opt.endpoint.startswith("https://"):
        return "endpoint", f"must be an https:// URL (got {opt.endpoint!r})"
    if opt.ca_file and not os.path.isfile(opt.ca_file):
        return "ca_file", f"no such file: {opt.ca_file}"
    if opt.credential == "service_principal":
        for key in ("tenant_id", "client_id", "client_secret"):
            if not getattr(opt, key):
                return key, "is required with credential = service_principal"
    return None


def directory_problem(path: str) -> str | None:
    """Why the spool cannot live at ``path`` (checked on its nearest existing ancestor, creating
    nothing: a rejected reload must leave no trace), or None."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None
