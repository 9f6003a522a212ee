"""Tools beside the pipeline: the CLI, the benchmark, profiling, reports, parity helpers, tiny models."""
