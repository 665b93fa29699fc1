"""bf16 training throughput, MFU and peak memory on one GPU: decoderlab against nanoGPT and Llama, eager and compiled.

    python -m benchmarks.gpu_mfu                  # on a CUDA machine; under 5 minutes on an H200
    python -m benchmarks.gpu_mfu --profile out/gpu_profile.txt   # also the top kernels by time of each variant
    python -m benchmarks.gpu_mfu --dry_run        # CPU, a tiny model, a few steps: checks that it runs

The models are GPT-2-small-sized (12 layers x 768 hidden x 12 heads, block 1024, vocabulary 50304 = GPT-2's
padded to a multiple of 64), in two pairs: decoderlab's ``gpt2`` preset beside ``reference_nanogpt.NanoGPT``
(nanoGPT's ``model.py``) at that shape, and decoderlab's ``llama`` preset (RoPE, RMSNorm, SwiGLU) beside
LlamaForCausalLM with the same weights. All use SDPA attention, which on CUDA in bfloat16 runs
FlashAttention-2 kernels. Each variant trains ``--steps`` timed steps after ``--warmup`` (compilation
happens there): AdamW (fused), bfloat16 autocast over float32 weights, ``--batch_size`` x 1024 tokens; the peak
memory of the timed steps (``torch.cuda.max_memory_allocated``) is reported beside each. Goals: each
decoderlab preset >= 1.0x its reference's tokens/s, compiled and eager, MFU >= 40%, peak memory <= the reference's.

MFU = achieved FLOP/s / peak. FLOPs per token: ``training.flops.flops_per_token``, the count the training loop logs,
6 N + 12 L T d_attn (PaLM, appendix B; nanoGPT's estimate): N the weights of the linear layers (every matrix
product's, lm_head's included), L layers, T the sequence length, d_attn the query heads' width; the attention term
counts the full T x T scores, not the causal half (docs/concepts/compute.md). Peak: 989 TFLOP/s, NVIDIA's dense (no
sparsity) BF16 Tensor Core figure for the H200 SXM (``training.flops.GPU_PEAKS``; the same as the H100 SXM's);
``--peak_tflops`` for another GPU. The MFU goal, 40%, is set for an H200.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from benchmarks.common import write_results
from benchmarks.reference_nanogpt import NanoGPT, NanoGPTConfig
from benchmarks.training_memory import allocations
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.export.families import llama_config_from_decoderlab
from training.flops import flops_per_token, gpu_peak

H200_BF16_DENSE_TFLOPS = gpu_peak("H200", "bf16") / 1e12
# variant "model-mode": decoderlab's llama preset ("decoderlab") beside "llama", its gpt2 preset ("decoderlab_gpt2")
# beside "nanogpt"
VARIANTS = [f"{name}-{mode}" for mode in ("compiled", "eager") for name in ("decoderlab_gpt2", "nanogpt", "decoderlab",
            "llama")]  # fmt: skip
REFERENCE = {"decoderlab": "llama", "decoderlab_gpt2": "nanogpt"}  # each decoderlab preset's reference
PROFILE_STEPS = 3


def positive_tflops(text: str) -> float:
    """``--peak_tflops``: a number of TFLOP/s above 0 (MFU divides by it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--peak_tflops must be a number of TFLOP/s, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(
            f"--peak_tflops must be above 0 (the GPU's dense bf16 peak in TFLOP/s, {H200_BF16_DENSE_TFLOPS:g} for an "
            f"H200), got {text}"
        )
    return value


def build_models(dry_run: bool) -> tuple[DecoderLabForCausalLM, LlamaForCausalLM]:
    if dry_run:
        sizes = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
    else:
        sizes = dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50304)
    config = DecoderLabConfig.from_preset("llama", **sizes, max_position_embeddings=1024)
    ours = DecoderLabForCausalLM(config)
    reference = LlamaForCausalLM(llama_config_from_decoderlab(config))
    reference.load_state_dict(ours.state_dict())
    return ours, reference


def build_gpt2_pair(dry_run: bool) -> tuple[DecoderLabForCausalLM, NanoGPT]:
    """decoderlab's ``gpt2`` preset and nanoGPT's model at the same shape (each its own initialisation)."""
    if dry_run:
        sizes = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
    else:
        sizes = dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50304)
    torch.manual_seed(0)
    ours = DecoderLabForCausalLM(DecoderLabConfig.from_preset("gpt2", **sizes, max_position_embeddings=1024))
    reference = NanoGPT(NanoGPTConfig(block_size=1024, vocab_size=sizes["vocab_size"], n_layer=sizes["num_hidden_layers"],
                                      n_head=sizes["num_attention_heads"], n_embd=sizes["hidden_size"], bias=True))  # fmt: skip
    return ours, reference


def build_variant_models(dry_run: bool) -> dict[str, torch.nn.Module]:
    """Every model ``VARIANTS`` names."""
    ours, llama = build_models(dry_run)
    gpt2, nanogpt = build_gpt2_pair(dry_run)
    return {"decoderlab": ours, "llama": llama, "decoderlab_gpt2": gpt2, "nanogpt": nanogpt}


def training_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of ``batch`` (B, T): through ``labels`` for an HF model, through nanoGPT's
    ``targets`` (the batch shifted by one, the last position predicting the first) for NanoGPT: T logits each."""
    if isinstance(model, NanoGPT):
        return model(batch, torch.roll(batch, -1, dims=1))[1]
    return model(input_ids=batch, labels=batch).loss


def train_throughput(
    model, batch_size: int, block_size: int, steps: int, warmup: int, device: str, profile_steps: int = 0
) -> dict:
    """Tokens/s over ``steps`` timed steps (after ``warmup`` untimed ones), and the peak memory; with
    ``profile_steps``, that many more steps under ``torch.profiler`` give ``top_kernels``, the ops and kernels
    with the most self time (CUDA time on a GPU, CPU time on a CPU)."""
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(model.config.vocab_size, (batch_size, block_size), generator=generator).to(device)

    def step() -> float:
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = training_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    start = time.perf_counter()
    for _ in range(warmup):
        step()
    synchronize(device)
    warmup_s = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    synchronize(device)
    elapsed = time.perf_counter() - start
    result = {
        "tokens_per_s": steps * batch_size * block_size / elapsed,
        "step_ms": 1e3 * elapsed / steps,
        "warmup_s": warmup_s,
        "final_loss": loss.item(),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None,
    }
    if profile_steps:
        result.update(profiled(step, profile_steps, device))
    return result


def profiled(step, steps: int, device: str, limit: int = 15) -> dict:
    """``steps`` calls of ``step`` under ``torch.profiler``: ``top_kernels``, the ``limit`` ops (kernels on a GPU)
    with the most self time, each with its total per step in ms and its calls per step; and, from the allocations
    on ``device`` (``training_memory.allocations``), ``largest_allocations_mb``: the buffers that make a peak, a
    logits-sized float32 one among them when there is one."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    averages = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:limit]
    kernels = [{"name": e.key, "ms_per_step": getattr(e, key) / 1e3 / steps, "calls_per_step": e.count / steps}
               for e in averages]  # fmt: skip
    return {"top_kernels": kernels, "largest_allocations_mb": [n / 1e6 for n in allocations(prof, device)[1]]}


def profile_table(results: dict[str, dict]) -> str:
    """The top kernels of each profiled variant, one block per variant, decoderlab's beside its reference's."""
    blocks = []
    for variant, result in results.items():
        if "top_kernels" not in result:
            continue
        largest = ", ".join(f"{mb:,.0f}" for mb in result["largest_allocations_mb"])
        lines = [f"## {variant}: {result['step_ms']:.1f} ms/step timed; largest allocations {largest} MB",
                 f"{'ms/step':>9} {'calls':>6}  kernel"]  # fmt: skip
        lines += [
            f"{k['ms_per_step']:9.3f} {k['calls_per_step']:6.1f}  {k['name'][:110]}" for k in result["top_kernels"]
        ]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def goal_rows(results: dict[str, dict]) -> list[dict]:
    """Each decoderlab preset against its reference in each mode: the tokens/s ratio (goal >= 1.0), decoderlab's MFU
    (goal >= 40%) and the peak memory against the reference's (goal <=, on a GPU)."""
    rows = []
    for mode in ("compiled", "eager"):
        for ours, reference in REFERENCE.items():
            a, b = results.get(f"{ours}-{mode}"), results.get(f"{reference}-{mode}")
            if a is None or b is None:
                continue
            ratio = a["tokens_per_s"] / b["tokens_per_s"]
            memory = (a["peak_memory_gb"] <= b["peak_memory_gb"]) if a["peak_memory_gb"] is not None else None
            rows.append({"variant": f"{ours}-{mode}", "reference": f"{reference}-{mode}", "ratio": ratio,
                         "mfu": a["mfu"], "peak_memory_gb": a["peak_memory_gb"],
                         "reference_peak_memory_gb": b["peak_memory_gb"], "ratio_goal": ratio >= 1.0,
                         "mfu_goal": a["mfu"] >= 0.40, "memory_goal": memory})  # fmt: skip
    return rows


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry_run", action="store_true", help="CPU, tiny model, 2 steps: does the script run?")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peak_tflops", type=positive_tflops, default=H200_BF16_DENSE_TFLOPS, help="dense BF16 peak")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS, help="which to run, in this order")
    parser.add_argument("--budget_s", type=float, default=270, help="skip variants that would start past this")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--profile", type=Path, default=None,
                        help=f"also profile {PROFILE_STEPS} steps of each variant and write its top kernels here")  # fmt: skip
    args = parser.parse_args(argv)
    backend = "inductor"
    if args.dry_run:  # CPU compilation is slow: no time budget, and TorchDynamo's graphs run eagerly (as gpu_check's)
        device, args.batch_size, args.block_size, args.steps, args.warmup = "cpu", 2, 32, 2, 1
        args.budget_s, backend = float("inf"), "eager"
    elif not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run on a GPU machine, or pass --dry_run to check the script on CPU.")
    else:
        device = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = True  # only float32 leftovers; the matmuls run in bf16
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (dry run)'}, torch {torch.__version__}")

    models = build_variant_models(args.dry_run)
    fpt = {
        name: flops_per_token(models[ours].config, args.block_size)
        for ours, ref in REFERENCE.items()
        for name in (ours, ref)
    }
    for ours, reference in REFERENCE.items():
        print(f"{ours} / {reference}: {sum(p.numel() for p in models[ours].parameters()) / 1e6:.1f}M parameters, "
              f"{fpt[ours] / 1e9:.3f} GFLOP per token")  # fmt: skip
    print(f"batch {args.batch_size} x {args.block_size}, peak {args.peak_tflops:.0f} TFLOP/s")
    results, start = {}, time.perf_counter()
    for variant in args.variants:
        if time.perf_counter() - start > args.budget_s:
            print(f"{variant}: skipped (past the {args.budget_s:.0f} s budget)")
            continue
        name, mode = variant.split("-")
        model = models[name]
        if mode == "compiled":
            model.forward = torch.compile(model.forward, backend=backend)
        profile_steps = PROFILE_STEPS if args.profile is not None else 0
        result = train_throughput(model, args.batch_size, args.block_size, args.steps, args.warmup, device,
                                  profile_steps)  # fmt: skip
        if mode == "compiled":
            del model.forward  # back to the class's eager forward for the next variant
        model.to("cpu")  # the next variant's peak memory is its own
        result["mfu"] = fpt[name] * result["tokens_per_s"] / (args.peak_tflops * 1e12)
        results[variant] = result
        memory = f", peak {result['peak_memory_gb']:.2f} GB" if result["peak_memory_gb"] is not None else ""
        print(f"{variant:24s} {result['tokens_per_s']:12,.0f} tokens/s  {result['step_ms']:8.1f} ms/step  "
              f"MFU {100 * result['mfu']:5.1f}%  (warm-up {result['warmup_s']:.0f} s{memory})", flush=True)  # fmt: skip
    goals = goal_rows(results)
    for goal in goals:
        memory = "" if goal["memory_goal"] is None else f", peak memory <= reference's: {goal['memory_goal']}"
        print(f"{goal['variant']} / {goal['reference']}: {goal['ratio']:.3f}x (goal >= 1.0), "
              f"MFU {100 * goal['mfu']:.1f}% (goal >= 40%){memory}")  # fmt: skip
    for mode in ("compiled", "eager"):  # the line earlier runs printed, for comparison
        if f"decoderlab-{mode}" in results and f"llama-{mode}" in results:
            ratio = results[f"decoderlab-{mode}"]["tokens_per_s"] / results[f"llama-{mode}"]["tokens_per_s"]
            print(f"decoderlab / Llama, {mode}: {ratio:.3f}")
    if args.profile is not None:
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        args.profile.write_text(profile_table(results))
        print(f"wrote {args.profile}")
    if args.json is not None:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "flops_per_token": fpt["decoderlab"],
                  "flops_per_token_by_model": fpt, "results": results, "goals": goals}  # fmt: skip
        write_results(args.json, report, torch.get_num_threads())


if __name__ == "__main__":
    main()
