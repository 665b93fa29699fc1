"""Evaluation speed of the default recipe's model against the evaluation batch size, on this machine.

    python -m benchmarks.investigations.eval_batch                      # about 30 seconds on 2 cores
    python -m benchmarks.investigations.eval_batch --batch_sizes 16,32,64,128,256 \
        --json_out benchmarks/results/eval_batch.json

The model is ``training/configs/shakespeare_char.yaml``'s architecture (untrained: the speed of a forward does
not depend on the weights) over blocks of its ``block_size``; each batch size runs the forward with the loss,
as ``training.loop.evaluate`` does, interleaved with the others (A B C ... A B C ...) so that a change in the
machine's load hits all of them. It prints validation tokens per second for each batch size and its ratio to
the recipe's ``per_device_eval_batch_size``. Why it matters: the recipe evaluates all 1,742 validation blocks at
the end of every run, and on a CPU the rate falls once a batch's activations no longer fit in the cache.
"""

import pathlib

import torch

from benchmarks.common import interleaved_medians, load_average, machine_line, timing_parser, write_timing
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from training.args import TrainConfig, parse_config

RECIPE = pathlib.Path(__file__).resolve().parents[2] / "training" / "configs" / "shakespeare_char.yaml"
VOCAB_SIZE = 66  # the recipe's character vocabulary: the 65 characters of Tiny Shakespeare and <|endoftext|>


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__, repeats=5)
    parser.add_argument("--batch_sizes", default="16,32,64,128,256", help="comma-separated evaluation batch sizes")
    parser.add_argument("--blocks", type=int, default=512, help="validation blocks per timing (a multiple of each)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    recipe = parse_config(TrainConfig, ["--config", str(RECIPE)])  # read as training/pretrain.py reads it
    block_size, chosen = recipe.block_size, recipe.per_device_eval_batch_size
    sizes = sorted({int(b) for b in args.batch_sizes.split(",")} | {chosen})
    if any(args.blocks % b for b in sizes):
        raise ValueError(f"--blocks {args.blocks} must be a multiple of every batch size {sizes}.")
    print(machine_line(args.threads))

    torch.manual_seed(0)
    config = DecoderLabConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=block_size, **recipe.model)
    model = DecoderLabForCausalLM(config).eval()
    blocks = torch.randint(0, VOCAB_SIZE, (args.blocks, block_size))

    def evaluate_in_batches(batch_size: int):
        def run() -> None:
            with torch.no_grad():
                for start in range(0, args.blocks, batch_size):
                    batch = blocks[start : start + batch_size]
                    model(input_ids=batch, labels=batch, use_cache=False)

        return run

    load_before = load_average()
    times = interleaved_medians({b: evaluate_in_batches(b) for b in sizes}, repeats=args.repeats, warmup=1)
    rates = {b: args.blocks * block_size / times[b]["median_s"] for b in sizes}
    print(f"\n{'eval batch':>10}  {'tokens/s':>10}  vs batch {chosen} (the recipe's)")
    for b in sizes:
        print(f"{b:>10}  {rates[b]:>10,.0f}  {rates[b] / rates[chosen]:.2f}x")
    write_timing(
        args.json_out,
        args.threads,
        load_before,
        recipe_batch_size=chosen,
        tokens_per_s={str(b): round(rates[b]) for b in sizes},
        samples_s={str(b): times[b]["samples_s"] for b in sizes},
    )


if __name__ == "__main__":
    main()
