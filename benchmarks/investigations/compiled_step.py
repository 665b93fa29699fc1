"""What torch.compile makes of one training step, decoderlab beside its reference: the matrix products the compiled
code calls and the kernels Inductor generates. Both are counts, not times: the graph Inductor builds and the
products it hands to the BLAS library (cuBLAS on a GPU) come from the same decomposition on every device, so a CPU
shows which launches a GPU step will make, though not what they cost there.

    python -m benchmarks.investigations.compiled_step               # the reduced GPT-2 shape of training_memory
    python -m benchmarks.investigations.compiled_step --quick        # a tiny shape: checks that it runs

For each model of ``benchmarks.training_memory`` (nanoGPT and the ``gpt2`` preset; ``LlamaForCausalLM`` and the
``llama`` preset), with bf16 autocast and Inductor: one step compiles (forward with the loss, backward), then one
more step runs under ``torch.profiler``, which counts the calls to ``aten::mm``, ``aten::addmm`` and ``aten::bmm``
(the compiled code's extern products) and to the attention kernel; ``torch._inductor.metrics`` counts the kernels
Inductor generated for the step's forward and backward graphs.
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch._inductor.metrics as inductor_metrics

from benchmarks.common import machine_line, write_results
from benchmarks.training_memory import BATCH, BLOCK, QUICK_BATCH, QUICK_BLOCK, QUICK_SHAPE, SHAPE, build, loss_of

MODELS = ("nanogpt", "decoderlab-gpt2", "llama", "decoderlab-llama")
REFERENCE = {"decoderlab-gpt2": "nanogpt", "decoderlab-llama": "llama"}
PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm")


def count(name: str, quick: bool) -> dict:
    """One model's compiled training step: products called (by op) and kernels generated."""
    shape, block, batch = (QUICK_SHAPE, QUICK_BLOCK, QUICK_BATCH) if quick else (SHAPE, BLOCK, BATCH)
    torch._dynamo.reset()
    inductor_metrics.reset()
    model = build(name, shape, block).train()
    model.compile(backend="inductor")
    ids = torch.randint(shape["vocab_size"], (batch, block + 1), generator=torch.Generator().manual_seed(0))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, ids)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # compiles the forward and the backward graphs
    kernels = inductor_metrics.generated_kernel_count
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    calls = collections.Counter(event.name for event in prof.events())
    attention = sum(n for op, n in calls.items() if op.startswith("aten::_scaled_dot_product"))
    products = {op: calls[op] for op in PRODUCTS}
    return {"model": name, "layers": shape["num_hidden_layers"], "products": products,
            "products_total": sum(products.values()), "attention_calls": attention,
            "generated_kernels": kernels}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape: checks that it runs")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--json_out", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # counts do not depend on threads; one thread compiles and runs the same code
    print(machine_line(1))
    rows = {}
    for name in args.models:
        row = rows[name] = count(name, args.quick)
        products = ", ".join(f"{op.removeprefix('aten::')} {n}" for op, n in row["products"].items())
        print(f"{name:18s} products {row['products_total']:3d} ({products}), attention {row['attention_calls']}, "
              f"generated kernels {row['generated_kernels']}", flush=True)  # fmt: skip
    for ours, reference in REFERENCE.items():
        if ours in rows and reference in rows:
            a, b = rows[ours], rows[reference]
            print(f"{ours} - {reference}: {(a['products_total'] - b['products_total']) / a['layers']:+.1f} products "
                  f"and {(a['generated_kernels'] - b['generated_kernels']) / a['layers']:+.1f} generated kernels "
                  "per layer")  # fmt: skip
    if args.json_out:
        write_results(args.json_out, {"quick": args.quick, "rows": list(rows.values())}, 1)


if __name__ == "__main__":
    main()
