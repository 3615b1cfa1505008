"""The Azure Monitor Logs Ingestion sink, in one folder: :mod:`.sink` (the sink over the shared
Uploader: spool records, send, classify, dead-letter) and :mod:`.rows` (snapshots folded into the
GPU, InfiniBand, event and generic rows, and the column table the DCR template is generated from).

The Azure SDK is imported only when the sink starts or checks, so importing this package is cheap."""

from __future__ import annotations

from gpumon.sinks.azure_monitor.sink import (
    IMDS_ALIASES,
    MONITORING_METRICS_PUBLISHER,
    OPTIONS,
    AzureMonitorSettings,
    AzureMonitorSink,
)

__all__ = ["IMDS_ALIASES", "MONITORING_METRICS_PUBLISHER", "OPTIONS", "AzureMonitorSettings",
           "AzureMonitorSink"]
