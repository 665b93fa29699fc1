"""Training helpers for decoderlab, shared by the pretraining and fine-tuning scripts and the experiments.

- ``training.args``: the typed run configuration (``TrainConfig``), read from YAML plus command-line overrides.
- ``training.data``: datasets, tokenizers, tokenize-once caching, packing into blocks, resumable batches (blocks
  and streams), the read-ahead thread.
- ``training.token_shards``: prepared token shards (``prepare_data.py`` writes them, ``pretrain.py --prepared_data``
  maps them with np.memmap), their checks and the batches read from them.
- ``training.models``: the model and tokenizer of a run: a fresh model, or a checkpoint with its own tokenizer,
  checked against the tokenizer and the block size.
- ``training.loop``: optimizer, schedule, the accumulation/clipping/mixed-precision loop, evaluation, logging.
- ``training.checkpointing``: crash-safe Accelerate checkpoints, resume, and the final Hugging Face folder.
- ``training.finish``: the end of every training script: the final folder, the model card, the summary, the upload.
- ``training.program``: how the scripts run as programs (Python's garbage collector paused while the libraries
  import, frozen at exit).
- ``training.finetune_args``: ``FinetuneConfig``, the fine-tuning configuration (base checkpoint, data format, LoRA).
- ``training.sft_data``: fine-tuning data: prompt/completion and chat examples with completion-only labels,
  packed (examples kept apart) or padded.

Nothing here prints or reads environment variables; the scripts (``pretrain.py``, ``prepare_data.py``,
``finetune.py``, ``evaluate.py``, ``generate.py``, ``shakespeare_sft_data.py``) own the console.
"""
