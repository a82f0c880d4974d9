"""Benchmarks: the platform against the bare vLLM server and against a LiteLLM proxy.

``python -m benchmarks.run`` (``make bench``) runs the same streaming workload against the three
targets, one engine at a time, and writes the results table and plot into docs/benchmarks.md.
``benchmarks.controlplane`` measures admission and ledger writes per second; ``benchmarks.engine_profile``
measures one-stream and batched tokens/s of an engine profile (CPU here, GPUs on lent machines).
"""
