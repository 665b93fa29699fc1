"""Training helpers for decoderlab, shared by the pretraining and fine-tuning scripts and the experiments.

- ``training.args``: the typed run configuration (``TrainConfig``), read from YAML plus command-line overrides.
- ``training.data``: datasets, tokenizers, tokenize-once caching, packing into blocks, resumable batches.
- ``training.loop``: optimizer, schedule, the accumulation/clipping/mixed-precision loop, evaluation, logging.
- ``training.checkpointing``: crash-safe Accelerate checkpoints, resume, and the final Hugging Face folder.

Nothing here prints or reads environment variables; the scripts (``pretrain.py``, ``generate.py``) own the console.
"""
