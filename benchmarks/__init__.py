"""Benchmarks that print a table and write JSON under ``benchmarks/results/``.

``reap-swap bench-gpu`` (``gpu_bench``): stock vLLM vs reap-swap residency,
one process per arm, on a model with the Qwen3-30B-A3B expert shape.
"""
