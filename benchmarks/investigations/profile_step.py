"""Where a training step's time goes: matrix multiplies against everything else, decoderlab and Llama;
and where a decoding step's time goes: the model's forward against generate()'s own loop.

    python -m benchmarks.investigations.profile_step               # nano and tiny, about 2 minutes on 2 cores
    python -m benchmarks.investigations.profile_step --sizes nano --top 25

For each size of ``benchmarks.common`` (the ``llama`` pair: decoderlab's preset and LlamaForCausalLM with
the same weights, SDPA), ``torch.profiler`` records ``--steps`` training steps (forward, backward, fused
AdamW) of each model after a warm-up. It prints the step time, the time in ``aten::mm`` (the linear
layers; attention's own products run inside the SDPA kernel), the FLOP/s those matmuls reach
(6 x linear-layer weights x tokens per step) against a large (2048 x 2048) fp32 matmul measured in the same
run, and decoderlab's most expensive ops. This is the arithmetic behind the Performance section: when the
linear layers already run near the matmul peak and take most of the step, the rest of the step bounds
what any speed-up can win.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from benchmarks.common import SIZES, Size, generate_fn, interleaved_medians, llama_pair, machine_line, train_step_fn


def matmul_peak(n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of one large fp32 matmul: what this CPU's fp32 matmul reaches at its best."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def linear_flops_per_step(model: torch.nn.Module, size: Size) -> float:
    """6 x (weights in linear layers) x tokens: forward and the two backward products of every nn.Linear."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 6 * weights * size.batch_size * size.block_size


def profile_steps(model: torch.nn.Module, size: Size, steps: int) -> dict:
    step = train_step_fn(model, size)
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6 / steps  # seconds per step
    mm = sum(e.self_cpu_time_total for e in events if e.key == "aten::mm") / 1e6 / steps
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)
    return {
        "step_s": total,
        "mm_s": mm,
        "top": [(e.key, e.self_cpu_time_total / 1e6 / steps, e.count // steps) for e in top],
    }


PROMPT_TOKENS = 16  # the decoding measurements' prompt, at batch 1


def prefilled_cache(model: torch.nn.Module, vocab_size: int) -> tuple[DynamicCache, torch.Tensor]:
    """A fresh cache holding a random PROMPT_TOKENS-token prompt, and the prompt's last logits. No autograd."""
    prompt = torch.randint(1, vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits
    return cache, logits


def forward_loop_fn(model: torch.nn.Module, new_tokens: int, vocab_size: int):
    """Greedy decoding without generate(): prefill, then one cached forward and an argmax per new token."""

    def run() -> None:
        with torch.no_grad():
            cache, logits = prefilled_cache(model, vocab_size)
            for position in range(PROMPT_TOKENS, PROMPT_TOKENS + new_tokens - 1):
                token = logits[:, -1:].argmax(-1)
                logits = model(
                    input_ids=token,
                    position_ids=torch.tensor([[position]]),
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                ).logits

    return run


def linear_layers_ms(model: torch.nn.Module, through_module: bool, repeats: int = 100) -> tuple[float, float]:
    """Every nn.Linear of the model applied once to one token (batch 1): the matrix work and weight reads a
    decoding step cannot avoid. ``through_module``: called as the model calls them (decoderlab's layers
    choose their kernel); otherwise as plain F.linear (torch's BLAS). Returns (ms per token, MB of weights)."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, 1, m.in_features) for m in layers]

    def run() -> None:
        for layer, x in zip(layers, inputs):
            layer(x) if through_module else F.linear(x, layer.weight, layer.bias)

    with torch.no_grad():
        for _ in range(10):
            run()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        seconds = (time.perf_counter() - start) / repeats
    megabytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers) / 1e6
    return seconds * 1e3, megabytes


def ops_per_decoding_step(model: torch.nn.Module, vocab_size: int) -> int:
    """PyTorch operators one cached forward of one token calls (top-level aten ops, as the profiler sees them)."""
    with torch.no_grad():
        cache, _ = prefilled_cache(model, vocab_size)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(
                input_ids=torch.tensor([[1]]), position_ids=torch.tensor([[PROMPT_TOKENS]]), cache=cache, use_cache=True
            )
    return sum(1 for event in prof.events() if event.cpu_parent is None and event.name.startswith("aten::"))


def decode_breakdown(pair, size: Size, new_tokens: int, repeats: int) -> dict:
    """Per new token, ms: through generate and through the bare loop, for decoderlab and the reference."""
    workloads = {}
    for label, model in (("decoderlab", pair.ours), (pair.reference_label, pair.reference)):
        workloads[f"{label} generate"] = generate_fn(model, 1, PROMPT_TOKENS, new_tokens, size.vocab_size)
        workloads[f"{label} forward loop"] = forward_loop_fn(model, new_tokens, size.vocab_size)
    times = interleaved_medians(workloads, repeats=repeats)
    return {name: t["median_s"] / new_tokens * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per model")
    parser.add_argument("--top", type=int, default=12, help="decoderlab ops to list")
    parser.add_argument("--decode_repeats", type=int, default=7, help="interleaved rounds of the decoding timing")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads), flush=True)
    peak = matmul_peak()
    print(f"fp32 matmul peak here (2048 x 2048, {args.threads} threads): {peak / 1e9:.0f} GFLOP/s")
    for name in args.sizes:
        size = SIZES[name]
        pair = llama_pair(size)
        flops = linear_flops_per_step(pair.ours, size)
        print(f"\n{name}: {flops / 1e9:.2f} GFLOP per step in linear layers")
        results = {}
        for label, model in (("decoderlab", pair.ours), (pair.reference_label, pair.reference)):
            results[label] = r = profile_steps(model, size, args.steps)
            print(
                f"  {label:18s} step {r['step_s'] * 1e3:6.1f} ms, matmuls {r['mm_s'] * 1e3:6.1f} ms "
                f"({r['mm_s'] / r['step_s']:.0%} of the step) at {flops / r['mm_s'] / 1e9:.0f} GFLOP/s "
                f"({flops / r['mm_s'] / peak:.0%} of the peak); the rest {(r['step_s'] - r['mm_s']) * 1e3:.1f} ms"
            )
        print("  decoderlab's top ops (self time per step, calls per step):")
        for key, seconds, calls in results["decoderlab"]["top"][: args.top]:
            print(f"    {key[:60]:60s} {seconds * 1e3:7.2f} ms {calls:5d}")
        new_tokens = 200 if name == "nano" else 50
        ms = decode_breakdown(pair, size, new_tokens, args.decode_repeats)
        print(f"  greedy decoding, batch 1, {new_tokens} new tokens, ms per token (median of {args.decode_repeats}):")
        for label in ("decoderlab", pair.reference_label):
            total, forward = ms[f"{label} generate"], ms[f"{label} forward loop"]
            model = pair.ours if label == "decoderlab" else pair.reference
            print(
                f"    {label:18s} generate {total:6.3f}, bare forward loop {forward:6.3f}: generate's own work "
                f"{total - forward:6.3f} ({(total - forward) / total:.0%} of its time); "
                f"{ops_per_decoding_step(model, size.vocab_size)} PyTorch ops per forward"
            )
        blas_ms, megabytes = linear_layers_ms(pair.ours, through_module=False)
        ours_ms, _ = linear_layers_ms(pair.ours, through_module=True)
        print(
            f"    the linear layers alone, one token ({megabytes:.1f} MB of fp32 weights): as F.linear (BLAS) "
            f"{blas_ms:.3f} ms ({megabytes / blas_ms:.1f} GB/s), as decoderlab runs them {ours_ms:.3f} ms "
            f"({megabytes / ours_ms:.1f} GB/s); decoderlab's forward spends "
            f"{ms['decoderlab forward loop'] - ours_ms:.3f} ms per token on everything else"
        )


if __name__ == "__main__":
    main()
