"""Benchmarks of sglang-relay (``sglang-relay bench ...``): workloads, drivers, reports."""
