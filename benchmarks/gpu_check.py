"""Everything a GPU user depends on, checked on one CUDA GPU within 9 minutes: one table, one JSON file.

    python -m benchmarks.gpu_check              # one CUDA GPU; writes benchmarks/results/gpu_check-GPU.json
    python -m benchmarks.gpu_check --dry_run    # CPU, tiny sizes, the same code path (CI runs it)
    python -m benchmarks.gpu_check --only generation generation_tokens   # a quick re-run of some checks

``benchmarks/gpu_session.sh`` prepares a run on a GPU machine without a package index and prints its command.

The checks, fastest first (each a row of the table: what, the figure, PASS / FAIL / n/a):

1. Attention backends: eager, SDPA and flex attention give the same float32 logits (and flash-attention 2, where
   ``flash_attn`` is installed, the same bfloat16 logits as SDPA in bfloat16, as closely as bfloat16 allows).
2. bfloat16 against ``LlamaForCausalLM`` in bfloat16 (the same weights): decoderlab's error from Llama's float32
   logits is at most twice Llama's own bfloat16 error.
3. Static cache + ``torch.compile``: greedy generation gives the tokens of eager generation (float32).
4. No host-device synchronisation in a decoding step: eight cached one-token forwards (and their argmax) run
   under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronising call (an ``.item()``, a
   ``bool()`` of a device tensor, a device-to-host copy). Not checkable on a CPU: n/a there.
5. bfloat16 training throughput and MFU of a GPT-2-small shape (12 x 768 x 12, block 1024) against
   ``LlamaForCausalLM``, eager and compiled (``benchmarks/gpu_mfu.py``'s measurement; MFU against the H200's
   dense bf16 specification, 989 TFLOP/s, ``--peak_tflops`` for another GPU). The goal is MFU >= 40%.
6. The whole ``shakespeare_char_gpu`` command (``training/pretrain.py``, a subprocess as a user runs it, no step
   limit): the best periodic validation loss and its step, the saved folder's validation loss (scored again by
   ``training/evaluate.py``) and the whole command's wall time, beside ``benchmarks/reference_nanogpt.py``'s recipe at
   nanoGPT's GPU settings (6 x 384, block 256, batch 64, dropout 0.2, 5000 iterations, compiled, bf16), also a
   whole command, in the same run. The goal: a saved model at validation loss <= 1.47 in no more time
   than nanoGPT's command.
7. ``generate`` tokens/s at batch 1 and 64 (greedy, 128 new tokens after a 128-token prompt, KV-cached, bf16),
   eager with a dynamic cache, and at batch 1 with a static cache and a compiled decoding step
   (``decoderlab.generation``, what ``training/generate.py`` does on CUDA): the goal is 5x the eager 121 tokens/s.
8. That compiled decoding gives eager greedy decoding's tokens at the GPT-2-small shape (float32, batch 1), and a
   ``generate(cache_implementation="static")`` (so ``pipeline`` given it) compiles by itself too.

Each check has a name (``--only NAME ...``) and an estimated time on an H200 (``CHECKS``); a check that would end
past ``--budget_s`` (9 minutes) is skipped with a row saying so.

A check that fails makes the exit status 1. ``--dry_run`` runs every check on the CPU at tiny sizes, so what CI
runs is this code path; its figures say nothing about a GPU. To stay within a CI budget it compiles with
``backend="eager"`` (TorchDynamo captures the same graphs, Inductor generates no code) and leaves out flex
attention, which compiles its kernel with Inductor (the fast tests check it on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import transformers
from transformers import DynamicCache

from benchmarks.common import Size, llama_pair, write_results
from benchmarks.gpu_mfu import (
    H200_BF16_DENSE_TFLOPS,
    PROFILE_STEPS,
    REFERENCE,
    VARIANTS,
    build_models,
    build_variant_models,
    goal_rows,
    positive_tflops,
    profile_table,
    train_throughput,
)
from benchmarks.reference_nanogpt import DEFAULT_DATA_PATH
from decoderlab.generation import compiled_decoding_is_on, generate, set_compiled_decoding
from decoderlab.model_card import METRICS_NAME, read_metrics
from training.data import tiny_shakespeare
from training.flops import flops_per_token

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"


def results_path(gpu: str) -> pathlib.Path:
    """``benchmarks/results/gpu_check-h200.json`` for an "NVIDIA H200": the GPU in the name."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower().replace("nvidia", "")).strip("-")
    return RESULTS / f"gpu_check-{slug}.json"


MFU_GOAL = 0.40
PROFILED = ("decoderlab_gpt2", "nanogpt")  # the training rows also profiled, for gpu_mfu.PROFILE_STEPS more steps
RECIPE_GOAL = 1.47  # the saved model's validation loss (nanoGPT's best on the H200: 1.463)
# generate at batch 1, GPT-2-small shape, bf16, eager with a dynamic cache, on the H200 at ba4ff63
# (benchmarks/results/gpu_check-h200-ba4ff63.json); compiled decoding's goal is GENERATION_GOAL times that
EAGER_BATCH_1_H200 = 121
GENERATION_GOAL = 5.0
# The model of checks 1-4: decoderlab's llama preset, small enough to compile in seconds
CHECK_SIZE = Size(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, vocab_size=1024, block_size=128,
                  batch_size=4)  # fmt: skip
# a dry run's recipe: a tiny model in float32 (bf16 is a GPU setting), traced but not compiled to code, evaluated
# often enough to keep a best checkpoint and to load it at the end
DRY_RECIPE_OVERRIDES = ("--model.hidden_size", "32", "--model.num_hidden_layers", "1", "--model.num_attention_heads",
                        "2", "--per_device_train_batch_size", "2", "--block_size", "32", "--mixed_precision", "no",
                        "--torch_compile_backend", "eager", "--eval_steps", "2", "--max_eval_samples", "8",
                        "--checkpointing_steps", "3", "--logging_steps", "2")  # fmt: skip
# nanoGPT's config/train_shakespeare_char.py on a GPU, through benchmarks/reference_nanogpt.py
NANOGPT_GPU_ARGS = ("--device", "cuda", "--dtype", "bfloat16", "--compile_backend", "inductor", "--batch_size", "64",
                    "--block_size", "256", "--n_layer", "6", "--n_head", "6", "--n_embd", "384", "--dropout", "0.2",
                    "--max_iters", "5000", "--eval_interval", "250", "--eval_iters", "200", "--log_interval", "10",
                    "--num_threads", "none")  # fmt: skip
DRY_REFERENCE_ARGS = ("--compile_backend", "eager", "--batch_size", "2", "--block_size", "32", "--n_layer", "1",
                      "--n_head", "2", "--n_embd", "32", "--dropout", "0.2", "--max_iters", "6", "--eval_interval",
                      "2", "--eval_iters", "1", "--log_interval", "2", "--num_threads", "1")  # fmt: skip
DRY_CHECK_SIZE = Size(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, block_size=16,
                      batch_size=2)  # fmt: skip


@dataclass
class Row:
    check: str
    value: str
    passed: bool | None  # None: not applicable here
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


@dataclass
class Setup:
    device: str
    dry_run: bool
    check_size: Size
    prompt_length: int
    new_tokens: int
    recipe_steps: int | None  # None: the recipe's own (the whole command); a dry run's few steps
    recipe_overrides: tuple[str, ...]  # flags after the recipe's (a dry run's tiny sizes)
    reference_args: tuple[str, ...]  # benchmarks/reference_nanogpt.py's flags (nanoGPT's GPU settings on a GPU)
    compile_backend: str  # torch.compile's: "inductor", "eager" in a dry run
    backends: tuple[str, ...]  # the attention implementations compared with eager
    peak_tflops: float
    dataset_name: str
    output_dir: pathlib.Path


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def check_model(setup: Setup, dtype: torch.dtype = torch.float32, seed: int = 0):
    """decoderlab's ``llama`` preset at ``setup.check_size`` and ``LlamaForCausalLM`` with the same weights, on the
    device, in ``dtype``, eval mode."""
    pair = llama_pair(setup.check_size, seed)
    return pair.ours.to(setup.device, dtype), pair.reference.to(setup.device, dtype)


def tokens(setup: Setup, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, setup.check_size.vocab_size, (batch, length), generator=generator).to(setup.device)


@torch.no_grad()
def logits_with(model, implementation: str, input_ids: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation(implementation)
    return model(input_ids=input_ids).logits.float()


def flash_attention_available(device: str) -> bool:
    if device != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def check_backends(setup: Setup) -> Row:
    """Eager, SDPA and flex attention in float32 (largest difference from eager at most 1e-4), and flash-attention
    2 in bfloat16 against SDPA in bfloat16 (at most twice SDPA's own bfloat16 error from float32, plus 1e-3)."""
    ours, _ = check_model(setup)
    ids = tokens(setup, setup.check_size.batch_size, setup.check_size.block_size)
    eager = logits_with(ours, "eager", ids)
    differences = {name: (logits_with(ours, name, ids) - eager).abs().max().item() for name in setup.backends}
    passed = all(d <= 1e-4 for d in differences.values())
    if flash_attention_available(setup.device):
        ours.to(torch.bfloat16)
        sdpa_bf16 = logits_with(ours, "sdpa", ids)
        flash = logits_with(ours, "flash_attention_2", ids)
        bf16_error = (sdpa_bf16 - eager).abs().max().item()
        differences["flash_attention_2 (bf16, vs SDPA bf16)"] = (flash - sdpa_bf16).abs().max().item()
        passed = passed and differences["flash_attention_2 (bf16, vs SDPA bf16)"] <= 2 * bf16_error + 1e-3
    value = ", ".join(f"{name} {d:.1e}" for name, d in differences.items())
    if not flash_attention_available(setup.device):
        value += " (flash_attn not installed)" if setup.device == "cuda" else ""
    return Row("attention backends equal eager", value, passed, details={"max_abs_difference": differences})


def check_bf16_against_llama(setup: Setup) -> Row:
    """Both models' bfloat16 logits against Llama's float32 ones: decoderlab's error at most twice Llama's + 1e-3."""
    ours, reference = check_model(setup)
    ids = tokens(setup, setup.check_size.batch_size, setup.check_size.block_size)
    with torch.no_grad():
        exact = reference(input_ids=ids).logits.float()
        ours.to(torch.bfloat16), reference.to(torch.bfloat16)
        ours_error = (ours(input_ids=ids).logits.float() - exact).abs().max().item()
        llama_error = (reference(input_ids=ids).logits.float() - exact).abs().max().item()
    passed = ours_error <= 2 * llama_error + 1e-3
    value = f"decoderlab bf16 {ours_error:.3f}, Llama bf16 {llama_error:.3f} (from Llama fp32)"
    return Row(
        "bf16 logits vs LlamaForCausalLM", value, passed, details={"decoderlab": ours_error, "llama": llama_error}
    )


def check_compiled_static_generation(setup: Setup) -> Row:
    """Greedy tokens: static cache with a compiled forward against a dynamic cache, eager (float32)."""
    ours, _ = check_model(setup)
    ours.generation_config.pad_token_id = 0
    prompt = tokens(setup, 2, setup.prompt_length)
    greedy = dict(max_new_tokens=setup.new_tokens, min_new_tokens=setup.new_tokens, do_sample=False)
    with torch.no_grad():
        eager = ours.generate(prompt, **greedy)
        ours.forward = torch.compile(ours.forward, backend=setup.compile_backend)
        try:
            compiled = ours.generate(prompt, cache_implementation="static", **greedy)
        finally:
            del ours.forward  # the class's eager forward again
    same = torch.equal(eager, compiled)
    value = f"{'same' if same else 'different'} tokens ({2} x {setup.new_tokens})"
    return Row("static cache + torch.compile == eager", value, same)


def sync_guard(device: str):
    """Raise at any host-device synchronisation inside the block (CUDA only)."""
    if device != "cuda":
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def guard():
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return guard()


def check_no_sync_per_decoding_step(setup: Setup) -> Row:
    """Prefill, one warm-up step, then eight decoding steps (forward with the cache, argmax) under ``sync_guard``."""
    ours, _ = check_model(setup, torch.bfloat16 if setup.device == "cuda" else torch.float32)
    cache = DynamicCache(config=ours.config)
    with torch.no_grad():
        next_ids = ours(input_ids=tokens(setup, 1, setup.prompt_length), cache=cache).logits[:, -1:].argmax(-1)
        next_ids = ours(input_ids=next_ids, cache=cache).logits[:, -1:].argmax(-1)  # first-call work happens here
        synchronize(setup.device)
        try:
            with sync_guard(setup.device):
                for _ in range(8):
                    next_ids = ours(input_ids=next_ids, cache=cache).logits[:, -1:].argmax(-1)
        except RuntimeError as err:
            return Row("no host-device sync per decoding step", f"synchronised: {err}"[:200], False)
    if setup.device != "cuda":
        return Row("no host-device sync per decoding step", "not checkable on CPU (ran 8 steps)", None)
    return Row("no host-device sync per decoding step", "none in 8 steps", True)


def training_throughput(setup: Setup, budget_s: float) -> list[Row]:
    """gpu_mfu's measurement: bf16 autocast training of the GPT-2-small shape, decoderlab's gpt2 preset beside
    nanoGPT's model and its llama preset beside ``LlamaForCausalLM``, compiled then eager; the MFU and peak memory
    of each, and per pair and mode the training goals (>= 1.0x the reference's tokens/s, MFU >= 40%, peak
    memory <= the reference's). The gpt2 preset and nanoGPT are also profiled (``gpu_mfu.profiled``: the
    kernels with the most device time per step and the largest allocations, in the row's details and printed side
    by side)."""
    models = build_variant_models(setup.dry_run)
    batch, block, steps, warmup = (2, 32, 2, 1) if setup.dry_run else (16, 1024, 20, 5)
    fpt = {name: flops_per_token(models[ours].config, block) for ours, ref in REFERENCE.items() for name in (ours, ref)}
    rows, results, start = [], {}, time.perf_counter()
    for variant in VARIANTS:
        if time.perf_counter() - start > budget_s:
            rows.append(Row(f"train {variant}", f"skipped: past the {budget_s:.0f} s budget", None))
            continue
        name, mode = variant.split("-")
        model = models[name]
        if mode == "compiled":
            model.forward = torch.compile(model.forward, backend=setup.compile_backend)
        # the gpt2 pair is profiled too: the note on the remaining gap reads its top kernels
        profile_steps = PROFILE_STEPS if name in PROFILED else 0
        result = train_throughput(model, batch, block, steps, warmup, setup.device, profile_steps=profile_steps)
        if mode == "compiled":
            del model.forward
        model.to("cpu")  # the next variant's peak memory is its own
        result["mfu"] = fpt[name] * result["tokens_per_s"] / (setup.peak_tflops * 1e12)
        results[variant] = result
        goal = result["mfu"] >= MFU_GOAL if name in REFERENCE and not setup.dry_run else None
        memory = f", peak {result['peak_memory_gb']:.2f} GB" if result["peak_memory_gb"] is not None else ""
        value = f"{result['tokens_per_s']:,.0f} tokens/s, MFU {100 * result['mfu']:.1f}%{memory}"
        rows.append(Row(f"train {variant} (bf16)", value, goal, details=result))
    if any("top_kernels" in result for result in results.values()):
        print(profile_table(results), flush=True)
    for goal in goal_rows(results):
        ours, reference = results[goal["variant"]], results[goal["reference"]]
        mode = goal["variant"].split("-")[1]
        memory = "" if goal["memory_goal"] is None else (
            f", peak {goal['peak_memory_gb']:.2f} / {goal['reference_peak_memory_gb']:.2f} GB")  # fmt: skip
        if goal["variant"].startswith("decoderlab-"):  # the same weights and batch: the same loss
            same_loss = abs(ours["final_loss"] - reference["final_loss"])
            passed = same_loss < 1e-2 and (setup.dry_run or (goal["ratio_goal"] and goal["memory_goal"] is not False))
            rows.append(Row(f"train decoderlab / Llama, {mode}", f"{goal['ratio']:.3f}x, loss difference "
                            f"{same_loss:.1e}{memory}", passed, details=goal))  # fmt: skip
        else:  # nanoGPT's own initialisation: the losses are not comparable
            passed = None if setup.dry_run else goal["ratio_goal"] and goal["memory_goal"] is not False
            rows.append(Row(f"train decoderlab gpt2 / nanoGPT, {mode}", f"{goal['ratio']:.3f}x{memory}", passed,
                            details=goal))  # fmt: skip
    return rows


def synthetic_corpus(folder: pathlib.Path, documents: int, seed: int = 0) -> tuple[pathlib.Path, pathlib.Path]:
    """train.txt and validation.txt of ``documents`` and ``documents // 50`` lines: Zipf-distributed words drawn from
    60,000 random lowercase words, enough distinct merges for a 32,768-token BPE. Local, so no download is needed."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 11, (60_000,), generator=generator)
    letters = torch.randint(0, 26, (int(lengths.sum()),), generator=generator).add_(ord("a")).to(torch.uint8)
    words = bytes(letters.tolist()).decode()
    offsets = [0, *torch.cumsum(lengths, 0).tolist()]
    vocabulary = [words[a:b] for a, b in zip(offsets, offsets[1:])]
    weights = 1.0 / torch.arange(1, len(vocabulary) + 1, dtype=torch.float64)  # Zipf's law
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, count in (("train", documents), ("validation", max(1, documents // 50))):
        ids = torch.multinomial(weights, count * 200, replacement=True, generator=generator).view(count, 200).tolist()
        path = folder / f"{name}.txt"
        path.write_text("".join(" ".join(vocabulary[i] for i in row) + ".\n" for row in ids))
        paths.append(path)
    return paths[0], paths[1]


def training_script_run(setup: Setup) -> Row:
    """``training/pretrain.py`` with ``fineweb_edu_bpe``'s architecture and batch (bf16, compiled) from shards that
    ``training/prepare_data.py`` made of a local synthetic corpus, for about a minute on a GPU: its tokens/s (the
    median logging window) against the bare loop's (``train_throughput`` of the same model, micro-batch and compile
    mode), and the time it waited for data. Goal: >= 0.95x the bare loop, data wait under 5% of the training time."""
    recipe = str(REPO_ROOT / "training" / "configs" / "fineweb_edu_bpe.yaml")
    folder = setup.output_dir / "training_script"
    train_file, validation_file = synthetic_corpus(folder / "corpus", 100 if setup.dry_run else 20_000)
    shards, output_dir = folder / "shards", folder / "run"
    data = ["--train_file", str(train_file), "--validation_file", str(validation_file), "--streaming", "false"]
    small = ["--bpe_vocab_size", "300", "--block_size", "32"] if setup.dry_run else []
    prepare = [sys.executable, "-m", "training.prepare_data", "--config", recipe, *data, "--output_dir", str(shards),
               *small, *(["--preprocessing_num_workers", "1"] if setup.dry_run else [])]  # fmt: skip
    steps = 4 if setup.dry_run else 500
    pretrain = [sys.executable, "-m", "training.pretrain", "--config", recipe, *data, "--prepared_data", str(shards),
                "--output_dir", str(output_dir), "--overwrite_output_dir", "--max_train_steps", str(steps),
                "--eval_steps", "none", "--load_best_model_at_end", "false", "--checkpointing_steps", "none",
                "--logging_steps", str(max(1, steps // 10)), "--max_eval_samples", "64",
                "--num_warmup_steps", "10", "--torch_compile", str(not setup.dry_run).lower()]  # fmt: skip
    if setup.dry_run:  # a tiny model in float32, eager
        pretrain += ["--model.hidden_size", "32", "--model.num_hidden_layers", "1", "--model.num_attention_heads", "2",
                     "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
                     "--mixed_precision", "no", *small]  # fmt: skip
    for command in (prepare, pretrain):
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            lines = result.stderr.strip().splitlines() or ["no output"]
            return Row("training script (fineweb_edu_bpe shape)", f"failed: {lines[-1]}"[:200], False)
    records = [r for r in read_metrics(output_dir / METRICS_NAME) if "tokens_per_s" in r]
    speeds = sorted(r["tokens_per_s"] for r in records[1:] or records)  # the first window includes compilation
    script_tokens_per_s = speeds[len(speeds) // 2]
    waited = sum(r["data_wait_s"] for r in records)
    trained_s = sum(r["tokens"] - before for r, before in zip(records, [0] + [r["tokens"] for r in records]))
    trained_s = trained_s / script_tokens_per_s  # the windows' training time at the median speed
    from decoderlab import DecoderLabConfig, DecoderLabForCausalLM  # the run's own architecture and vocabulary

    model = DecoderLabForCausalLM(DecoderLabConfig.from_pretrained(output_dir))
    batch = 2 if setup.dry_run else 16
    block = 32 if setup.dry_run else 1024
    if not setup.dry_run:
        model.forward = torch.compile(model.forward, backend=setup.compile_backend)
    bare = train_throughput(model, batch, block, 2 if setup.dry_run else 20, 1 if setup.dry_run else 5, setup.device)
    model.to("cpu")
    ratio = script_tokens_per_s / bare["tokens_per_s"]
    wait_share = waited / max(trained_s, 1e-9)
    passed = None if setup.dry_run else ratio >= 0.95 and wait_share < 0.05
    value = (f"{script_tokens_per_s:,.0f} tokens/s = {ratio:.3f}x the bare loop's {bare['tokens_per_s']:,.0f}, "
             f"data wait {waited:.2f} s ({100 * wait_share:.1f}%) over {steps} steps")  # fmt: skip
    details = {"tokens_per_s": script_tokens_per_s, "bare_loop_tokens_per_s": bare["tokens_per_s"], "ratio": ratio,
               "data_wait_s": waited, "data_wait_share": wait_share, "steps": steps,
               "bare_loop_peak_memory_gb": bare["peak_memory_gb"]}  # fmt: skip
    return Row("training script (fineweb_edu_bpe shape)", value, passed, details=details)


def whole_command(command: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``command`` from the checkout's root as a user would; (its result, its wall time in seconds)."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    return result, time.perf_counter() - start


def failure(check: str, result: subprocess.CompletedProcess) -> Row:
    lines = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()
    return Row(check, f"failed: {lines[-1]}"[:200], False)


def recipe_run(setup: Setup) -> list[Row]:
    """The whole shakespeare_char_gpu command through training/pretrain.py, its saved folder scored again by
    training/evaluate.py, and benchmarks/reference_nanogpt.py's recipe at nanoGPT's GPU settings: subprocesses."""
    check = "shakespeare_char_gpu recipe"
    output_dir = setup.output_dir / "shakespeare_char_gpu"
    shutil.rmtree(output_dir, ignore_errors=True)  # a fresh run, never a resumed one
    command = [sys.executable, "-m", "training.pretrain",  # from REPO_ROOT: this checkout's scripts
               "--config", str(REPO_ROOT / "training" / "configs" / "shakespeare_char_gpu.yaml"),
               "--dataset_name", setup.dataset_name, "--output_dir", str(output_dir), *setup.recipe_overrides]  # fmt: skip
    if setup.recipe_steps is not None:
        command += ["--max_train_steps", str(setup.recipe_steps)]
    result, seconds = whole_command(command)
    if result.returncode != 0:
        return [failure(check, result)]
    records = read_metrics(output_dir / METRICS_NAME)
    periodic = [r for r in records[:-1] if "eval_loss" in r]  # the last record: the final evaluation of the folder
    best = min(periodic, key=lambda r: r["eval_loss"])
    final = records[-1]
    trained = max(r["step"] for r in records)
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    tokens_per_s = sorted(speeds)[len(speeds) // 2]  # the median logging window
    first_step_s = next((r["first_step_s"] for r in records if "first_step_s" in r), None)
    scored = output_dir / "eval_results.json"
    evaluation, _ = whole_command([sys.executable, "-m", "training.evaluate", str(output_dir), "--dataset_name",
                                   setup.dataset_name, "--split", "validation", "--batch_size", "64",
                                   "--output_file", str(scored), "--model_card", "false"])  # fmt: skip
    if evaluation.returncode != 0:
        return [failure(check + ": evaluate.py on the saved folder", evaluation)]
    saved_loss = json.loads(scored.read_text())["eval_loss"]

    reference_check = "nanoGPT reference recipe (whole command)"
    reference_json = setup.output_dir / "reference_nanogpt.json"
    reference_command = [sys.executable, "-m", "benchmarks.reference_nanogpt", *setup.reference_args, "--quiet",
                         "--json_out", str(reference_json)]  # fmt: skip
    reference, reference_seconds = whole_command(reference_command)
    if reference.returncode != 0:
        reference_row = failure(reference_check, reference)
        reference_seconds = None
    else:
        nano = json.loads(reference_json.read_text())
        value = (f"best validation {nano['best_val_loss']:.3f} at step {nano['best_iter']}, last "
                 f"{nano['val_loss']:.3f} at step {nano['steps'] - 1}, whole command {reference_seconds:.0f} s")  # fmt: skip
        reference_row = Row(reference_check, value, None, details={
            "best_val_loss": nano["best_val_loss"], "best_iter": nano["best_iter"], "last_val_loss": nano["val_loss"],
            "whole_command_s": reference_seconds, "train_loop_s": nano["wall_time_s"],
            "tokens_per_s": nano["tokens_per_s"], "arguments": list(setup.reference_args)})  # fmt: skip

    finite = math.isfinite(saved_loss) and math.isfinite(best["eval_loss"])
    if setup.dry_run:  # the code path only: a few steps of a tiny model learn nothing worth a goal
        passed = finite
    else:
        passed = finite and saved_loss <= RECIPE_GOAL and reference_seconds is not None and seconds <= reference_seconds
    value = (f"best validation {best['eval_loss']:.3f} at step {best['step']}, saved folder {saved_loss:.3f} "
             f"(step {final.get('best_global_step', trained)}), {trained} steps, whole command {seconds:.0f} s")  # fmt: skip
    details = {"best_eval_loss": best["eval_loss"], "best_step": best["step"], "saved_eval_loss": saved_loss,
               "saved_eval_loss_in_run": final["eval_loss"], "saved_step": final.get("best_global_step", trained),
               "steps": trained, "whole_command_s": seconds, "first_step_s": first_step_s,
               "tokens_per_s": tokens_per_s, "goal_eval_loss": RECIPE_GOAL,
               "eval_curve": {r["step"]: r["eval_loss"] for r in periodic}}  # fmt: skip
    return [Row(check, value, passed, details=details), reference_row]


def generation_model(setup: Setup, dtype: torch.dtype):
    """The GPT-2-small-shaped model of the throughput check (tiny in a dry run), on the device in ``dtype``, set to
    generate exactly ``setup.new_tokens`` tokens (no end-of-text token)."""
    model, _ = build_models(setup.dry_run)
    model = model.to(setup.device, dtype).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def timed_generate(setup: Setup, model, prompt: torch.Tensor, repeats: int) -> float:
    """Tokens/s of the fastest of ``repeats`` greedy generations (after one untimed: compiling, CUDA graphs)."""
    greedy = dict(max_new_tokens=setup.new_tokens, min_new_tokens=setup.new_tokens, do_sample=False)
    with torch.no_grad():
        generate(model, prompt, **greedy)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            synchronize(setup.device)
            start = time.perf_counter()
            generate(model, prompt, **greedy)
            synchronize(setup.device)
            best = min(best, time.perf_counter() - start)
    return prompt.shape[0] * setup.new_tokens / best


def generation_speed(setup: Setup) -> list[Row]:
    """Greedy ``generate`` of ``setup.new_tokens`` tokens after ``setup.prompt_length``, bf16 on a GPU, the
    GPT-2-small-shaped model of the throughput check: batch 1 and 64 eager with a dynamic cache (plain
    ``generate``'s default), and batch 1 with a static cache and a compiled decoding step
    (``decoderlab.generation``, what ``training/generate.py`` does on CUDA), whose goal is
    ``GENERATION_GOAL`` x the 121 tokens/s the H200 measured eagerly at ba4ff63."""
    model = generation_model(setup, torch.bfloat16 if setup.device == "cuda" else torch.float32)
    rows = []
    for batch in (1, 64):
        set_compiled_decoding(model, "off")
        prompt = torch.randint(1, model.config.vocab_size, (batch, setup.prompt_length)).to(setup.device)
        tokens_per_s = timed_generate(setup, model, prompt, repeats=1)
        rows.append(Row(f"generate batch {batch}", f"{tokens_per_s:,.0f} tokens/s", None,
                        details={"tokens_per_s": tokens_per_s}))  # fmt: skip
    eager = rows[0].details["tokens_per_s"]
    prompt = torch.randint(1, model.config.vocab_size, (1, setup.prompt_length)).to(setup.device)
    set_compiled_decoding(model, "on", setup.compile_backend)
    tokens_per_s = timed_generate(setup, model, prompt, repeats=3)
    compiled = compiled_decoding_is_on(model)  # False: compiling failed and generate() fell back to eager
    goal = GENERATION_GOAL * EAGER_BATCH_1_H200
    passed = None if setup.dry_run else compiled and tokens_per_s >= goal
    value = (f"{tokens_per_s:,.0f} tokens/s, {tokens_per_s / eager:.1f}x eager here, "
             f"{tokens_per_s / EAGER_BATCH_1_H200:.1f}x the H200's {EAGER_BATCH_1_H200} (goal {GENERATION_GOAL}x)"
             + ("" if compiled else "; compiling FAILED, eager"))  # fmt: skip
    rows.append(Row("generate batch 1, static cache + compile", value, passed,
                    details={"tokens_per_s": tokens_per_s, "eager_tokens_per_s": eager, "compiled": compiled,
                             "goal_tokens_per_s": goal, "backend": setup.compile_backend}))  # fmt: skip
    return rows


def generation_tokens(setup: Setup) -> list[Row]:
    """``decoderlab.generation``'s compiled decoding (static cache, the forward compiled by ``generate`` itself, as
    ``training/generate.py`` runs it) gives eager greedy decoding's tokens with a dynamic cache: batch 1,
    ``setup.new_tokens`` after ``setup.prompt_length``, the GPT-2-small shape, float32 (bfloat16's rounding may
    differ between fused and unfused kernels and so flip a near tie)."""
    model = generation_model(setup, torch.float32)
    prompt = torch.randint(1, model.config.vocab_size, (1, setup.prompt_length)).to(setup.device)
    greedy = dict(max_new_tokens=setup.new_tokens, min_new_tokens=setup.new_tokens, do_sample=False)
    with torch.no_grad():
        set_compiled_decoding(model, "off")
        eager = generate(model, prompt, **greedy)
        set_compiled_decoding(model, "on", setup.compile_backend)
        compiled = generate(model, prompt, **greedy)
    really_compiled = compiled_decoding_is_on(model) and hasattr(model, "_compiled_call")
    same = torch.equal(eager, compiled)
    differ = (eager != compiled)[0, setup.prompt_length :].nonzero()
    value = (f"{'same' if same else 'different'} tokens (1 x {setup.new_tokens}, float32)"
             + ("" if same else f", first difference at new token {int(differ[0])}")
             + ("" if really_compiled else "; compiling FAILED, both eager"))  # fmt: skip
    row = Row("compiled generate == eager greedy (GPT-2 small)", value, same and really_compiled,
              details={"same": same, "compiled": really_compiled})  # fmt: skip
    return [row, saved_config_compiles(setup, model, prompt, eager)]


PIPELINE_ROW = "generate(cache_implementation='static') compiles on CUDA (pipeline)"


def saved_config_compiles(setup: Setup, model, prompt: torch.Tensor, eager: torch.Tensor) -> Row:
    """A plain ``model.generate`` asked for a static cache and no compile settings, as ``pipeline("text-generation",
    ..., cache_implementation="static")`` runs it (saved checkpoints keep the dynamic cache until this row has
    measured the static one on a GPU: training.models.set_sampling_defaults): on CUDA transformers runs
    the decoding steps through the compiled call by itself (counted here), with eager's tokens. On a CPU it does
    not compile: n/a."""
    generation = model.generation_config
    generation.cache_implementation, generation.compile_config, generation.disable_compile = "static", None, False
    calls = []
    if hasattr(model, "_compiled_call"):  # the one generation_tokens built: transformers' default config equals it
        compiled_call = model._compiled_call
        model._compiled_call = lambda *args, **kwargs: calls.append(1) or compiled_call(*args, **kwargs)
    greedy = dict(max_new_tokens=setup.new_tokens, min_new_tokens=setup.new_tokens, do_sample=False)
    with torch.no_grad():
        tokens = model.generate(prompt, **greedy)
    same = torch.equal(tokens, eager)
    value = f"{len(calls)} compiled decoding steps, {'same' if same else 'different'} tokens as eager"
    if setup.device != "cuda":
        return Row(PIPELINE_ROW, f"not on a CPU ({value})", None)
    passed = same and len(calls) >= setup.new_tokens - 1
    return Row(PIPELINE_ROW, value, passed,
               details={"compiled_steps": len(calls), "same": same})  # fmt: skip


def timed(rows_of, *args) -> list[Row]:
    start = time.perf_counter()
    rows = rows_of(*args)
    rows = rows if isinstance(rows, list) else [rows]
    for row in rows:
        row.seconds = round((time.perf_counter() - start) / len(rows), 1)
    return rows


def table(rows: list[Row]) -> str:
    mark = {True: "PASS", False: "FAIL", None: "n/a"}
    width = max(len(row.check) for row in rows)
    lines = [f"{'check':{width}}  {'result':6}  {'s':>6}  value"]
    lines += [f"{row.check:{width}}  {mark[row.passed]:6}  {row.seconds:6.1f}  {row.value}" for row in rows]
    return "\n".join(lines)


# Every check, in the order a run takes them (the goals' checks first), with its estimated seconds on an H200: the
# per-row seconds of benchmarks/results/gpu_check-h200-ba4ff63.json rounded up (four training variants took 94 s,
# eager generation 21 s), or, for a check added since, a guess from its compilations (Inductor takes 40-60 s per model
# and shape there). A check that would end past the budget is skipped with its row: the default run holds about 9
# minutes, and `--only generation_tokens training_script` is the second command of a GPU session (docs/development.md)
CHECKS = {
    "backends": (check_backends, 20),
    "bf16": (check_bf16_against_llama, 5),
    "static_compile": (check_compiled_static_generation, 15),
    "no_sync": (check_no_sync_per_decoding_step, 5),
    "training": (training_throughput, 200),  # eight variants, each compiled or eager, 30 steps; 4 profiled
    "recipe": (recipe_run, 230),  # the whole recipe (compiled, stops early) + nanoGPT's 124 s command + a scoring
    "generation": (generation_speed, 60),  # 21 s at ba4ff63 (eager only), + one bf16 compilation
    "generation_tokens": (generation_tokens, 45),  # one float32 compilation, one eager and one compiled generate
    "training_script": (training_script_run, 150),  # shards of a synthetic corpus, 500 compiled steps, the bare loop
}
BUDGET_S = 540  # 9 minutes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry_run", action="store_true", help="CPU, tiny sizes: the same code path, in CI")
    parser.add_argument("--json_out", type=pathlib.Path, default=None,
                        help="where the JSON goes, a file or a folder (default benchmarks/results/gpu_check-GPU.json; "
                        "dry run: out/)")  # fmt: skip
    parser.add_argument("--output_dir", type=pathlib.Path, default=REPO_ROOT / "out" / "gpu_check")
    parser.add_argument("--dataset_name", default=tiny_shakespeare(), help="Tiny Shakespeare: local copy or Hub id")
    parser.add_argument("--nanogpt_data", type=pathlib.Path, default=DEFAULT_DATA_PATH,
                        help="Tiny Shakespeare's input.txt, for the nanoGPT reference recipe (default %(default)s)")  # fmt: skip
    parser.add_argument("--peak_tflops", type=positive_tflops, default=H200_BF16_DENSE_TFLOPS, help="dense bf16 peak")
    parser.add_argument("--train_budget_s", type=float, default=180, help="no training variant starts past this")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), metavar="ROW",
                        help=f"run only these checks (a quick re-run): {', '.join(CHECKS)}")  # fmt: skip
    parser.add_argument("--budget_s", type=float, default=None,
                        help=f"a check whose estimated H200 seconds (CHECKS) would end past this is skipped, with its "
                        f"row (default {BUDGET_S}; none in a dry run)")  # fmt: skip
    parser.add_argument("--commit", default=None, help="the commit this tree was copied from, recorded where it "
                        "has no .git of its own (benchmarks/gpu_session.sh passes it)")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run on a GPU machine, or pass --dry_run to check the code path on CPU.")
    device = "cpu" if args.dry_run else "cuda"
    setup = Setup(device=device, dry_run=args.dry_run, check_size=DRY_CHECK_SIZE if args.dry_run else CHECK_SIZE,
                  prompt_length=8 if args.dry_run else 128, new_tokens=8 if args.dry_run else 128,
                  recipe_steps=6 if args.dry_run else None,
                  recipe_overrides=DRY_RECIPE_OVERRIDES if args.dry_run else (),
                  reference_args=(*(DRY_REFERENCE_ARGS if args.dry_run else NANOGPT_GPU_ARGS),
                                  "--data_path", str(args.nanogpt_data.resolve())),
                  peak_tflops=args.peak_tflops,
                  compile_backend="eager" if args.dry_run else "inductor",
                  backends=("sdpa",) if args.dry_run else ("sdpa", "flex_attention"),
                  dataset_name=args.dataset_name, output_dir=args.output_dir)  # fmt: skip
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run: tiny sizes, figures mean nothing)"
    json_out = args.json_out or (args.output_dir / "gpu_check-dry-run.json" if args.dry_run else results_path(name))
    if json_out.is_dir():  # a folder: the file named as in benchmarks/results
        json_out = json_out / results_path(name).name
    print(f"device: {name}, torch {torch.__version__}, transformers {transformers.__version__}", flush=True)

    start = time.perf_counter()
    rows = []
    names = args.only or list(CHECKS)
    budget_s = args.budget_s if args.budget_s is not None else float("inf") if args.dry_run else BUDGET_S
    planned = sum(CHECKS[check][1] for check in names)
    print(f"checks: {', '.join(names)} (about {planned:.0f} s on an H200; budget {budget_s:.0f} s)", flush=True)
    for check in names:
        rows_of, estimate_s = CHECKS[check]
        elapsed = time.perf_counter() - start
        if elapsed + estimate_s > budget_s:
            rows.append(Row(check, f"skipped: {elapsed:.0f} s + about {estimate_s:.0f} s is past the "
                                   f"{budget_s:.0f} s budget (--only {check} runs it)", None))  # fmt: skip
            print(f"  {rows[-1].check}: {rows[-1].value}", flush=True)
            continue
        torch.manual_seed(0)
        train_budget = args.train_budget_s if not args.dry_run else float("inf")
        rows += timed(rows_of, setup, *((train_budget,) if rows_of is training_throughput else ()))
        print(f"  {rows[-1].check}: {rows[-1].value}", flush=True)
    total = time.perf_counter() - start
    print(table(rows))
    print(f"total {total:.0f} s")
    report = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
              "dry_run": args.dry_run, "total_s": round(total, 1), "peak_tflops": args.peak_tflops,
              "checks": names, "rows": [asdict(row) for row in rows]}  # fmt: skip
    write_results(json_out, report, torch.get_num_threads(), source_commit=args.commit)
    return 1 if any(row.passed is False for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
