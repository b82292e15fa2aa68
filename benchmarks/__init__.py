"""Benchmark scripts of dsv4 (see README.md): A/B harness, standard workloads, hardware."""
