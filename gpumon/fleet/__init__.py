"""Reading the fleet back from Prometheus: what the job rules computed, for ``gpumon job``.

The daemon never talks to other hosts; fleet-wide judgement lives in Prometheus recording rules. This
package only asks a Prometheus-compatible query API (Prometheus, Thanos, Mimir, Azure Managed
Prometheus) for their results.
"""
