"""One-off measurements behind a decision, kept runnable (``python -m benchmarks.investigations.NAME``); the note
that reports each, with its figures and what was decided, is in ``benchmarks/notes/``:

- ``nanogpt_gap``: where nanoGPT's 3-5% lead in the training step goes (notes/nanogpt-gap.md)
- ``profile_step``: the matmul share of a step, the per-token cost of decoding (notes/speed-vs-references.md)
- ``rms_norm``, ``loss_paths``: RMSNorm's written-out backward, the loss at small vocabularies (notes/kernels.md)
- ``eval_batch``: the main job's evaluation batch size (notes/main-job-recipe.md)
- ``cpu_mixed_precision``: bf16 autocast on a CPU (notes/cpu-mixed-precision.md)
- ``char_packing``: the character tokenizer's table lookup against its call (notes/char-packing.md)
"""
