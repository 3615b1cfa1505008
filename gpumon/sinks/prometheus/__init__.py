"""The Prometheus endpoint, in one folder: :mod:`.sink` (the sink: options, publish renders the page,
health, check), :mod:`.page` (one snapshot's exposition in every variant), :mod:`.server` (the routes
and the listening socket), :mod:`.front` (the event loop that holds connections, TLS handshakes and
request heads; :mod:`.connections`: each connection, their table, the limits), :mod:`.webconfig` (the exporter-toolkit web config: TLS, basic auth, its reload) and
:mod:`.dcgm_compat` (dcgm-exporter's names, for ``compat = "dcgm-exporter"``)."""

from __future__ import annotations

from gpumon.sinks.prometheus.sink import OPTIONS, PrometheusSettings, PrometheusSink

__all__ = ["OPTIONS", "PrometheusSettings", "PrometheusSink"]
