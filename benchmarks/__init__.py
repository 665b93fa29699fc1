"""decoderlab's benchmarks; run them as modules from the repository root, e.g. ``python -m benchmarks.speed``.

At the top, the benchmarks a user reruns, whose figures ``python -m benchmarks.report`` renders into
docs/performance.md and the README from ``benchmarks/results/*.json``: ``speed`` (against Llama, GPT-2 and
nanoGPT), ``shakespeare_char`` (the main job against nanoGPT's recipe), ``export_formats``, ``gguf_export``,
``vllm_speed``, ``training_memory`` (what a compiled training step keeps and allocates), and the GPU scripts
``gpu_check`` and ``gpu_mfu``; ``matmul_peak`` times the CPU's matrix products, the peak a training run's MFU is
measured against; ``common`` and ``reference_nanogpt`` are what they
share. ``investigations/`` holds the one-off measurements behind a decision, each reported by a dated note in
``notes/``; superseded results files are kept in ``results/archive/``.
"""
