"""Benchmarks: offline throughput and online load over gRPC, with their workloads and reports."""
