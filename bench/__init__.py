"""gpumon benchmarks: see bench/README.md and `python -m bench --help`."""
