"""The stand-ins the tests and the benchmarks share: loopback servers speaking the real protocols
(IMDS, Logs Ingestion, ARM, kubelet PodResources, the Kubernetes API, OTLP, remote write), a Slurm
cluster, and a simulated host run by hand. Not shipped: the wheel packages ``gpumon`` only."""
