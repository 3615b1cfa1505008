"""gpumon: GPU and InfiniBand telemetry for GPU clusters, published to Prometheus, OTLP and Azure Monitor."""

__version__ = "0.1.0"
