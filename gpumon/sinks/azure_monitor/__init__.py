"""The Azure Monitor Logs Ingestion sink, in one folder: :mod:`.sink` (the sink over the shared
Uploader: spool records, send, bisect refused chunks), :mod:`.options` (the section's options and
settings, and the checks that make a bad target or spool directory exit 2), :mod:`.classify` (what an
HTTP answer means and the message that says what to fix), :mod:`.deadletter` (rows rejected for good,
kept aside) and :mod:`.rows` (snapshots folded into the GPU, InfiniBand, event and generic rows, and the
column table the DCR template is generated from).

The Azure SDK is imported only when the sink starts or checks, so importing this package is cheap."""

from __future__ import annotations

from gpumon.sinks.azure_monitor.classify import MONITORING_METRICS_PUBLISHER
from gpumon.sinks.azure_monitor.options import IMDS_ALIASES, OPTIONS, AzureMonitorSettings
from gpumon.sinks.azure_monitor.sink import AzureMonitorSink

__all__ = ["IMDS_ALIASES", "MONITORING_METRICS_PUBLISHER", "OPTIONS", "AzureMonitorSettings",
           "AzureMonitorSink"]
