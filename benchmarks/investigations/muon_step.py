"""Muon's optimizer step on this machine: torch.optim.Muon against training.optim.BatchedMuon in bfloat16 and float32.

    python -m benchmarks.investigations.muon_step                   # about a minute on 2 cores
    python -m benchmarks.investigations.muon_step --json_out benchmarks/results/muon_step.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m benchmarks.investigations.muon_step --demo_only \
        --json_out benchmarks/results/muon_step-avx2.json   # as a CPU without AVX-512 runs it (bfloat16 emulated)

For the Muon group of two recipes' models (make demo's 4 x 128 and the GPU recipe's 6 x 384, the shapes their blocks
hold), this times one step of: torch.optim.Muon (one matrix at a time, Newton-Schulz products in bfloat16),
BatchedMuon in bfloat16 (the same numbers, every matrix of one shape in one batched product) and in float32, and,
for scale, fused AdamW over the same matrices and the model's own forward and backward on one batch of its recipe,
interleaved (A B A B ...). ``muon_ns_dtype: auto`` takes bfloat16 where the CPU computes it in hardware and float32
elsewhere; the line below the table says which this machine gets. On a CPU the step can cost as much as the
model's forward and backward at make demo's size (a Newton-Schulz iteration is O(width^3) per matrix, the model
O(tokens x width^2)); the GPU figures are for a GPU run to give.
"""

import torch

from benchmarks.common import interleaved_medians, load_average, machine_line, timing_parser, write_timing
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from training.args import TrainConfig, parse_config
from training.optim import BatchedMuon, newton_schulz_dtype, param_groups

RECIPES = (
    ("make demo (4 x 128, batch 16 x 64)", "training/configs/shakespeare_char.yaml"),
    ("GPU recipe at 6 x 384 (batch 64 x 256)", "training/configs/shakespeare_char_gpu.yaml"),
)
VOCAB = 65  # Tiny Shakespeare's characters


def workloads(recipe: str) -> dict:
    """One step of each optimizer over the model's block matrices (random gradients), and the model's own step."""
    cfg = parse_config(TrainConfig, ["--config", recipe])
    torch.manual_seed(0)
    model = DecoderLabForCausalLM(DecoderLabConfig(vocab_size=VOCAB, **cfg.model))
    ids = torch.randint(0, VOCAB, (cfg.per_device_train_batch_size, cfg.block_size))
    matrices = next(g["params"] for g in param_groups(model, cfg) if g["use_muon"])  # the blocks' matrices
    settings = dict(lr=0.02, weight_decay=0.0, momentum=0.95)

    def optimizer_step(make) -> callable:
        params = [torch.nn.Parameter(p.detach().clone()) for p in matrices]
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer = make(params)
        return optimizer.step

    def model_step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return {
        "torch.optim.Muon": optimizer_step(lambda ps: torch.optim.Muon(ps, **settings)),
        "BatchedMuon bfloat16": optimizer_step(lambda ps: BatchedMuon(ps, ns_dtype=torch.bfloat16, **settings)),
        "BatchedMuon float32": optimizer_step(lambda ps: BatchedMuon(ps, ns_dtype=torch.float32, **settings)),
        "AdamW (fused)": optimizer_step(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
        "model forward + backward": model_step,
    }, len(matrices)


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__, repeats=5)
    parser.add_argument("--demo_only", action="store_true",
                        help="make demo's model only (with bfloat16 emulated, 6 x 384's bfloat16 steps take minutes)")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    load_before, rows = load_average(), []
    for name, recipe in RECIPES[:1] if args.demo_only else RECIPES:
        work, count = workloads(recipe)
        times = interleaved_medians(work, repeats=args.repeats, warmup=1)
        ms = {key: round(value["median_s"] * 1e3, 3) for key, value in times.items()}
        print(f"\n{name}: {count} block matrices, one step in ms (median of {args.repeats})")
        for key, value in ms.items():
            print(f"  {key:<26} {value:>10.2f}")
        torch_ms = ms["torch.optim.Muon"]
        print(f"  torch's / batched: {torch_ms / ms['BatchedMuon bfloat16']:.2f}x (bfloat16), "
              f"{torch_ms / ms['BatchedMuon float32']:.2f}x (float32)")  # fmt: skip
        rows.append({"model": name, "recipe": recipe, "matrices": count, "step_ms": ms})
    chosen = str(newton_schulz_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    print(f"\nmuon_ns_dtype auto takes {chosen} on this CPU")
    write_timing(args.json_out, args.threads, load_before, auto_dtype=chosen, rows=rows)


if __name__ == "__main__":
    main()
