"""Everything a GPU user depends on, checked on one CUDA GPU in under 8 minutes: one table, one JSON file.

    python -m benchmarks.gpu_check              # one CUDA GPU; writes benchmarks/results/gpu_check.json
    python -m benchmarks.gpu_check --dry_run    # CPU, tiny sizes, the same code path (CI runs it)

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
6. 300 steps of the ``shakespeare_char_gpu`` recipe (``training/pretrain.py``, a subprocess as a user runs it):
   the validation loss and the training tokens/s.
7. ``generate`` tokens/s at batch 1 and 64 (greedy, 128 new tokens after a 128-token prompt, KV-cached, bf16).

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
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import transformers
from transformers import DynamicCache

from benchmarks.common import Size, llama_pair, write_results
from benchmarks.gpu_mfu import H200_BF16_DENSE_TFLOPS, build_models, flops_per_token, train_throughput
from decoderlab.model_card import METRICS_NAME, read_metrics
from training.data import tiny_shakespeare

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results" / "gpu_check.json"
MFU_GOAL = 0.40
# The model of checks 1-4: decoderlab's llama preset, small enough to compile in seconds
CHECK_SIZE = Size(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, vocab_size=1024, block_size=128,
                  batch_size=4)  # fmt: skip
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
    recipe_steps: int
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
    """gpu_mfu's measurement: bf16 autocast training of the GPT-2-small shape, four variants, the MFU of each."""
    ours, reference = build_models(setup.dry_run)
    batch, block, steps, warmup = (2, 32, 2, 1) if setup.dry_run else (16, 1024, 20, 5)
    fpt = flops_per_token(ours, block)
    models = {"decoderlab": ours, "llama": reference}
    rows, results, start = [], {}, time.perf_counter()
    for variant in ("decoderlab-compiled", "llama-compiled", "decoderlab-eager", "llama-eager"):
        if time.perf_counter() - start > budget_s:
            rows.append(Row(f"train {variant}", f"skipped: past the {budget_s:.0f} s budget", None))
            continue
        name, mode = variant.split("-")
        model = models[name]
        if mode == "compiled":
            model.forward = torch.compile(model.forward, backend=setup.compile_backend)
        result = train_throughput(model, batch, block, steps, warmup, setup.device)
        if mode == "compiled":
            del model.forward
        result["mfu"] = fpt * result["tokens_per_s"] / (setup.peak_tflops * 1e12)
        results[variant] = result
        goal = result["mfu"] >= MFU_GOAL if name == "decoderlab" and not setup.dry_run else None
        value = f"{result['tokens_per_s']:,.0f} tokens/s, MFU {100 * result['mfu']:.1f}%"
        rows.append(Row(f"train {variant} (bf16)", value, goal, details=result))
    for mode in ("compiled", "eager"):
        if f"decoderlab-{mode}" in results and f"llama-{mode}" in results:
            ratio = results[f"decoderlab-{mode}"]["tokens_per_s"] / results[f"llama-{mode}"]["tokens_per_s"]
            same_loss = abs(results[f"decoderlab-{mode}"]["final_loss"] - results[f"llama-{mode}"]["final_loss"])
            rows.append(Row(f"train decoderlab / Llama, {mode}", f"{ratio:.3f}x, loss difference {same_loss:.1e}",
                            same_loss < 1e-2, details={"ratio": ratio}))  # fmt: skip
    return rows


def recipe_run(setup: Setup) -> Row:
    """``setup.recipe_steps`` steps of shakespeare_char_gpu through training/pretrain.py, in a subprocess."""
    output_dir = setup.output_dir / "shakespeare_char_gpu"
    command = [sys.executable, "-m", "training.pretrain",  # from REPO_ROOT: this checkout's scripts
               "--config", str(REPO_ROOT / "training" / "configs" / "shakespeare_char_gpu.yaml"),
               "--dataset_name", setup.dataset_name, "--output_dir", str(output_dir), "--overwrite_output_dir",
               "--max_train_steps", str(setup.recipe_steps), "--checkpointing_steps", "none", "--eval_steps", "none",
               "--logging_steps", str(max(1, setup.recipe_steps // 6))]  # fmt: skip
    if setup.dry_run:  # a tiny model in float32 (the recipe's bf16 is a GPU setting)
        command += ["--model.hidden_size", "32", "--model.num_hidden_layers", "1", "--model.num_attention_heads", "2",
                    "--per_device_train_batch_size", "2", "--block_size", "32", "--mixed_precision", "no"]  # fmt: skip
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        return Row("shakespeare_char_gpu recipe", f"failed: {result.stderr.strip().splitlines()[-1]}"[:200], False)
    records = read_metrics(output_dir / METRICS_NAME)
    eval_loss = [r["eval_loss"] for r in records if "eval_loss" in r][-1]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    tokens_per_s = sorted(speeds)[len(speeds) // 2]  # the median logging window: the first includes warm-up
    vocab = json.loads((output_dir / "config.json").read_text())["vocab_size"]
    # it learned something (a dry run's 3 steps, still in warm-up, need not)
    passed = math.isfinite(eval_loss) and (setup.dry_run or eval_loss < math.log(vocab))
    value = f"validation loss {eval_loss:.3f} after {setup.recipe_steps} steps, {tokens_per_s:,.0f} tokens/s"
    return Row("shakespeare_char_gpu recipe", value, passed, details={"eval_loss": eval_loss,
               "tokens_per_s": tokens_per_s, "steps": setup.recipe_steps})  # fmt: skip


def generation_speed(setup: Setup) -> list[Row]:
    """Greedy ``generate`` of ``setup.new_tokens`` tokens after ``setup.prompt_length``: batch 1 and 64, bf16 on
    a GPU, the GPT-2-small-shaped model of the throughput check."""
    model, _ = build_models(setup.dry_run)
    dtype = torch.bfloat16 if setup.device == "cuda" else torch.float32
    model = model.to(setup.device, dtype).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    greedy = dict(max_new_tokens=setup.new_tokens, min_new_tokens=setup.new_tokens, do_sample=False)
    rows = []
    for batch in (1, 64):
        prompt = torch.randint(1, model.config.vocab_size, (batch, setup.prompt_length)).to(setup.device)
        with torch.no_grad():
            model.generate(prompt, **greedy)  # warm-up
            synchronize(setup.device)
            start = time.perf_counter()
            model.generate(prompt, **greedy)
            synchronize(setup.device)
        tokens_per_s = batch * setup.new_tokens / (time.perf_counter() - start)
        rows.append(Row(f"generate batch {batch}", f"{tokens_per_s:,.0f} tokens/s", None,
                        details={"tokens_per_s": tokens_per_s}))  # fmt: skip
    return rows


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry_run", action="store_true", help="CPU, tiny sizes: the same code path, in CI")
    parser.add_argument("--json_out", type=pathlib.Path, default=None,
                        help=f"where the JSON goes (default {RESULTS.relative_to(REPO_ROOT)}; dry run: out/)")  # fmt: skip
    parser.add_argument("--output_dir", type=pathlib.Path, default=REPO_ROOT / "out" / "gpu_check")
    parser.add_argument("--dataset_name", default=tiny_shakespeare(), help="Tiny Shakespeare: local copy or Hub id")
    parser.add_argument("--peak_tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="dense bf16 peak")
    parser.add_argument("--train_budget_s", type=float, default=180, help="no training variant starts past this")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run on a GPU machine, or pass --dry_run to check the code path on CPU.")
    device = "cpu" if args.dry_run else "cuda"
    setup = Setup(device=device, dry_run=args.dry_run, check_size=DRY_CHECK_SIZE if args.dry_run else CHECK_SIZE,
                  prompt_length=8 if args.dry_run else 128, new_tokens=8 if args.dry_run else 128,
                  recipe_steps=3 if args.dry_run else 300, peak_tflops=args.peak_tflops,
                  compile_backend="eager" if args.dry_run else "inductor",
                  backends=("sdpa",) if args.dry_run else ("sdpa", "flex_attention"),
                  dataset_name=args.dataset_name, output_dir=args.output_dir)  # fmt: skip
    json_out = args.json_out or (args.output_dir / "gpu_check-dry-run.json" if args.dry_run else RESULTS)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run: tiny sizes, figures mean nothing)"
    print(f"device: {name}, torch {torch.__version__}, transformers {transformers.__version__}", flush=True)

    start = time.perf_counter()
    rows = []
    for rows_of, *rest in (
        (check_backends, setup),
        (check_bf16_against_llama, setup),
        (check_compiled_static_generation, setup),
        (check_no_sync_per_decoding_step, setup),
        (generation_speed, setup),
        (training_throughput, setup, args.train_budget_s if not args.dry_run else float("inf")),
        (recipe_run, setup),
    ):
        torch.manual_seed(0)
        rows += timed(rows_of, *rest)
        print(f"  {rows[-1].check}: {rows[-1].value}", flush=True)
    total = time.perf_counter() - start
    print(table(rows))
    print(f"total {total:.0f} s")
    report = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
              "dry_run": args.dry_run, "total_s": round(total, 1), "peak_tflops": args.peak_tflops,
              "rows": [asdict(row) for row in rows]}  # fmt: skip
    write_results(json_out, report, torch.get_num_threads())
    return 1 if any(row.passed is False for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
