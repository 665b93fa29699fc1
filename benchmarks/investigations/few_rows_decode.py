"""Decoding with and without the few-rows product on this machine: what DecoderLabLinear's per-CPU choice is worth.

    python -m benchmarks.investigations.few_rows_decode                 # tiny, GPT-2 and Llama presets, batch 1
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-avx2 \
        python -m benchmarks.investigations.few_rows_decode --json_out benchmarks/results/few_rows_decode-avx2.json

``DecoderLabLinear`` times its few-rows product against ``F.linear`` once per layer shape and row count, on the
machine it runs on, and keeps the faster (decoderlab/kernels_decoderlab.py). This times greedy decoding (the
benchmark's ``generate`` at batch 1 or 8) three ways, interleaved (A B C A B C ...): decoderlab as it runs,
decoderlab with the few-rows product switched off (every layer ``F.linear``), and the transformers reference with
the same weights. It then prints the choice each shape got: ``True`` where the few-rows product was kept.
"""

import torch

from benchmarks.common import (
    SIZES,
    generate_fn,
    gpt2_pair,
    interleaved_medians,
    llama_pair,
    load_average,
    machine_line,
    timing_parser,
    write_timing,
)
from decoderlab import kernels_decoderlab

PAIRS = {"gpt2": gpt2_pair, "llama": llama_pair}
PROMPT, NEW_TOKENS = 16, {"nano": 48, "tiny": 64}  # benchmarks.speed's decoding lengths


def without_few_rows(run) -> callable:
    """``run`` with DecoderLabLinear's choice answered "F.linear" for every shape."""
    chosen = kernels_decoderlab.few_rows_is_faster

    def plain() -> None:
        kernels_decoderlab.few_rows_is_faster = lambda x, weight: False
        try:
            run()
        finally:
            kernels_decoderlab.few_rows_is_faster = chosen

    return plain


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__, repeats=9)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--presets", nargs="+", choices=sorted(PAIRS), default=["gpt2", "llama"])
    parser.add_argument("--batch_size", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    size, new = SIZES[args.size], NEW_TOKENS[args.size]
    load_before, rows = load_average(), []
    for preset in args.presets:
        pair = PAIRS[preset](size)
        kernels_decoderlab.forget_kernel_timings()  # each preset times its own shapes afresh
        ours = generate_fn(pair.ours, args.batch_size, PROMPT, new, size.vocab_size)
        work = {
            "decoderlab": ours,
            "decoderlab, few-rows product off": without_few_rows(ours),
            pair.reference_label: generate_fn(pair.reference, args.batch_size, PROMPT, new, size.vocab_size),
        }
        times = interleaved_medians(work, repeats=args.repeats)
        rates = {name: round(args.batch_size * new / t["median_s"], 2) for name, t in times.items()}
        choices = {
            f"{out} x {inp}, {rows_} rows": faster
            for (out, inp, rows_, _threads), faster in sorted(kernels_decoderlab._FEW_ROWS_FASTER.items())
        }
        print(f"\n{preset} preset at {args.size}, batch {args.batch_size}: new tokens/s (median of {args.repeats})")
        for name, rate in rates.items():
            print(f"  {name:<36} {rate:>9.1f}")
        kept = [shape for shape, faster in choices.items() if faster]
        print(
            f"  few-rows product kept for {len(kept)} of {len(choices)} shapes timed"
            + (f": {', '.join(kept)}" if kept else "")
        )
        rows.append({"preset": preset, "size": args.size, "batch_size": args.batch_size, "new_tokens": new,
                     "tokens_per_s": rates, "few_rows_kept": choices})  # fmt: skip
    write_timing(args.json_out, args.threads, load_before, rows=rows)


if __name__ == "__main__":
    main()
