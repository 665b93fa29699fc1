"""The two paths of decoderlab's training loss, timed against each other on this machine.

    python -m benchmarks.investigations.loss_paths                  # about 20 seconds on 2 cores
    python -m benchmarks.investigations.loss_paths --json_out benchmarks/results/loss_paths.json

``causal_lm_loss`` computes transformers' ForCausalLMLoss through one of two paths, chosen by the number of
logits (``kernels_decoderlab.LEAN_LOSS_MIN_LOGITS``): ``F.cross_entropy`` (transformers' own call) below it,
``CrossEntropyFunction`` from it on, which keeps two fewer (N, V) float32 buffers. For the logits of each
training recipe's micro-batch (rows = batch x block, columns = vocabulary) this prints the forward and
backward time of both paths, interleaved (A B A B ...), their ratio, the memory of one (N, V) float32
buffer, and the path the threshold picks. The threshold is a memory rule; this shows what it costs in time.
"""

import torch
import torch.nn.functional as F

from benchmarks.common import interleaved_medians, load_average, machine_line, timing_parser, write_timing
from decoderlab.kernels_decoderlab import LEAN_LOSS_MIN_LOGITS, CrossEntropyFunction, takes_lean_loss_path

# (name, rows = batch x block, vocabulary): the micro-batches of training/configs/*.yaml and benchmarks.common's
# tiny size; fineweb_edu_bpe's 32 x 1024 rows are cut to 4 x 1024 to fit a CPU's memory
SHAPES = (
    ("shakespeare_char (16 x 64, 66)", 16 * 64, 66),
    ("tiny (12 x 256, 8192)", 12 * 256, 8192),
    ("fineweb_edu_bpe, 4 of 32 rows (4 x 1024, 32000)", 4 * 1024, 32000),
)


def loss_paths(rows: int, vocab: int) -> dict:
    """Forward + backward of both paths on the same random logits (sum over rows, as causal_lm_loss takes it)."""
    logits = (4 * torch.randn(rows, vocab)).requires_grad_()
    targets = torch.randint(0, vocab, (rows,))

    def plain() -> None:
        F.cross_entropy(logits, targets, reduction="sum").backward()
        logits.grad = None

    def lean() -> None:
        CrossEntropyFunction.apply(logits, targets, -100).backward()
        logits.grad = None

    return {"F.cross_entropy": plain, "CrossEntropyFunction": lean}


def main(argv: list[str] | None = None) -> None:
    args = timing_parser(__doc__).parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    load_before, rows_out = load_average(), []
    print(
        f"\n{'logits':<50} {'F.cross_entropy':>16} {'CrossEntropyFunction':>21} {'ratio':>6} {'(N, V) buffer':>14}  path"
    )
    for name, rows, vocab in SHAPES:
        inner = max(1, 2**22 // (rows * vocab))  # about 4M logits per timing, so small shapes are not all overhead
        times = interleaved_medians(loss_paths(rows, vocab), repeats=args.repeats, warmup=1, inner=inner)
        plain, lean = times["F.cross_entropy"]["median_s"], times["CrossEntropyFunction"]["median_s"]
        chosen = "CrossEntropyFunction" if takes_lean_loss_path(rows * vocab) else "F.cross_entropy"
        buffer_mb = rows * vocab * 4 / 2**20
        print(
            f"{name:<50} {plain * 1e3:>13.3f} ms {lean * 1e3:>18.3f} ms {plain / lean:>5.2f}x {buffer_mb:>11.1f} MB  {chosen}"
        )
        rows_out.append({
            "logits": name, "rows": rows, "vocab": vocab, "f_cross_entropy_ms": round(plain * 1e3, 4),
            "cross_entropy_function_ms": round(lean * 1e3, 4), "buffer_mb": round(buffer_mb, 2), "path": chosen,
        })  # fmt: skip
    print("ratio: F.cross_entropy's time / CrossEntropyFunction's (above 1: the lean path is the faster)")
    write_timing(args.json_out, args.threads, load_before, lean_loss_min_logits=LEAN_LOSS_MIN_LOGITS, rows=rows_out)


if __name__ == "__main__":
    main()
