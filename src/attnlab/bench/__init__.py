"""Benchmarks: throughput and memory, attnlab against the tools our users use now."""
