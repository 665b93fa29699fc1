"""decoderlab's benchmark scripts; run them as modules from the repository root, e.g. ``python -m benchmarks.speed``."""
