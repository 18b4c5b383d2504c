"""``bench-gpu --trace``: the arms on learned routing (a trained model's recorded trace replayed in
every MoE layer), their inputs, expert sets (``learned-sets``), one arm's process and the report.
Called by ``benchmarks.gpu_bench`` and the CLI; arms run as ``python -m reap_swap.benchmarks.learned.arm``."""
