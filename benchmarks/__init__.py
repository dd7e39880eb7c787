"""Side-by-side performance measurements: ``python -m benchmarks``.

Every comparison runs in one process against a private server started for the run, as
ratios of medians of interleaved repetitions: absolute times on a shared machine drift,
but two workloads measured alternately through the same client drift together.
"""
