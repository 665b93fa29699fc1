"""Experiments that test the textbook claims behind decoderlab's switches; run them as modules from the
repository root, e.g. ``python -m experiments.attention_scale``. ``experiments/README.md`` lists them."""
