"""Where a training step's time goes: matrix multiplies against everything else, decoderlab and Llama.

    python -m benchmarks.profile_step               # nano and tiny, about 1 minute on 2 cores
    python -m benchmarks.profile_step --sizes nano --top 25

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
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import SIZES, Size, llama_pair, train_step_fn


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per model")
    parser.add_argument("--top", type=int, default=12, help="decoderlab ops to list")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
