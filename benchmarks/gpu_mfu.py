"""bf16 training throughput and MFU on one GPU: decoderlab against LlamaForCausalLM, eager and compiled.

    python -m benchmarks.gpu_mfu                  # on a CUDA machine; under 5 minutes on an H200
    python -m benchmarks.gpu_mfu --dry_run        # CPU, a tiny model, a few steps: checks that it runs

The model is GPT-2-small-sized (12 layers x 768 hidden x 12 heads, block 1024, vocabulary 50304 = GPT-2's
padded to a multiple of 64) in decoderlab's ``llama`` architecture (RoPE, RMSNorm, SwiGLU), and
LlamaForCausalLM with the same weights. Both use SDPA attention, which on CUDA in bfloat16 runs
FlashAttention-2 kernels. Each variant trains ``--steps`` timed steps after ``--warmup`` (compilation
happens there): AdamW (fused), bfloat16 autocast over float32 weights, ``--batch_size`` x 1024 tokens.

MFU = achieved FLOP/s / peak. FLOPs per token = 6 N + 12 L T d (PaLM, appendix B; nanoGPT's estimate):
N the parameters in matrix multiplies (every weight except the input embedding table), L layers, T the
sequence length, d the hidden size; the attention term counts the full T x T scores, not the causal half.
Peak: 989 TFLOP/s, NVIDIA's dense (no sparsity) BF16 Tensor Core figure for the H200 SXM (the same as
the H100 SXM's); ``--peak_tflops`` for another GPU. The target in the issue is MFU >= 40% on an H200.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from benchmarks.common import write_results
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.export.families import llama_config_from_decoderlab

H200_BF16_DENSE_TFLOPS = 989.0


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


def flops_per_token(model: torch.nn.Module, block_size: int) -> float:
    config = model.config
    embedding = model.get_input_embeddings().weight
    matmul_params = sum(p.numel() for p in model.parameters() if p is not embedding)
    if config.tie_word_embeddings:  # the tied table is also the output projection
        matmul_params += embedding.numel()
    return 6 * matmul_params + 12 * config.num_hidden_layers * block_size * config.hidden_size


def train_throughput(model, batch_size: int, block_size: int, steps: int, warmup: int, device: str) -> dict:
    """Tokens/s over ``steps`` timed steps (after ``warmup`` untimed ones), and the peak memory."""
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(model.config.vocab_size, (batch_size, block_size), generator=generator).to(device)

    def step() -> float:
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
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
    return {
        "tokens_per_s": steps * batch_size * block_size / elapsed,
        "step_ms": 1e3 * elapsed / steps,
        "warmup_s": warmup_s,
        "final_loss": loss.item(),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None,
    }


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry_run", action="store_true", help="CPU, tiny model, 2 steps: does the script run?")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peak_tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="dense BF16 peak")
    parser.add_argument("--variants", nargs="+", default=["decoderlab-compiled", "llama-compiled", "decoderlab-eager",
                        "llama-eager"], help="which to run, in this order")  # fmt: skip
    parser.add_argument("--budget_s", type=float, default=270, help="skip variants that would start past this")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.dry_run:  # CPU compilation is slow: no time budget
        device, args.batch_size, args.block_size, args.steps, args.warmup = "cpu", 2, 32, 2, 1
        args.budget_s = float("inf")
    elif not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run on a GPU machine, or pass --dry_run to check the script on CPU.")
    else:
        device = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = True  # only float32 leftovers; the matmuls run in bf16
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (dry run)'}, torch {torch.__version__}")

    ours, reference = build_models(args.dry_run)
    fpt = flops_per_token(ours, args.block_size)
    print(f"{sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M parameters, {fpt / 1e9:.3f} GFLOP per token, "
          f"batch {args.batch_size} x {args.block_size}, peak {args.peak_tflops:.0f} TFLOP/s")  # fmt: skip
    models = {"decoderlab": ours, "llama": reference}
    results, start = {}, time.perf_counter()
    for variant in args.variants:
        if time.perf_counter() - start > args.budget_s:
            print(f"{variant}: skipped (past the {args.budget_s:.0f} s budget)")
            continue
        name, mode = variant.split("-")
        model = models[name]
        if mode == "compiled":
            model.forward = torch.compile(model.forward)
        result = train_throughput(model, args.batch_size, args.block_size, args.steps, args.warmup, device)
        if mode == "compiled":
            del model.forward  # back to the class's eager forward for the next variant
        result["mfu"] = fpt * result["tokens_per_s"] / (args.peak_tflops * 1e12)
        results[variant] = result
        memory = f", peak {result['peak_memory_gb']:.1f} GB" if result["peak_memory_gb"] is not None else ""
        print(f"{variant:20s} {result['tokens_per_s']:12,.0f} tokens/s  {result['step_ms']:8.1f} ms/step  "
              f"MFU {100 * result['mfu']:5.1f}%  (warm-up {result['warmup_s']:.0f} s{memory})", flush=True)  # fmt: skip
    for mode in ("compiled", "eager"):
        if f"decoderlab-{mode}" in results and f"llama-{mode}" in results:
            ratio = results[f"decoderlab-{mode}"]["tokens_per_s"] / results[f"llama-{mode}"]["tokens_per_s"]
            print(f"decoderlab / Llama, {mode}: {ratio:.3f}")
    if args.json is not None:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "flops_per_token": fpt, "results": results}
        write_results(args.json, report, torch.get_num_threads())


if __name__ == "__main__":
    main()
