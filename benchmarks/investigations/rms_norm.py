"""RMSNorm's training path, timed against autograd through Llama's module and against LayerNorm, on this machine.

    python -m benchmarks.investigations.rms_norm                  # about 15 seconds on 2 cores
    python -m benchmarks.investigations.rms_norm --json_out benchmarks/results/rms_norm.json

Under autograd ``DecoderLabRMSNorm`` runs ``kernels_decoderlab.RMSNormFunction``: LlamaRMSNorm's forward, op for op
(the same outputs), with the backward written out. This times forward + backward of three norms on the same input
and output gradient, interleaved (A B A B ...), at the norm shapes of the default recipe (its 17 norms per step:
9 over the hidden size, 8 QK-norms over each head) and of benchmarks.common's tiny size:

- ``RMSNormFunction``, decoderlab's training path;
- ``LlamaRMSNorm``, transformers' module, whose backward autograd derives from its forward: what the same
  norm costs without the written-out backward;
- ``F.layer_norm`` without bias: one fused CPU kernel each way, which torch 2.13 does not have for RMSNorm; the
  floor a fused RMSNorm could approach, for scale.

Before timing, the gradients of the first two are checked to agree.
"""

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from benchmarks.common import interleaved_medians, load_average, machine_line, timing_parser, write_timing
from decoderlab.kernels_decoderlab import RMSNormFunction

EPS = 1e-6
# (name, shape of the normalised activations): the last dimension is normalised
SHAPES = (
    ("shakespeare_char, hidden (16 x 64, 128)", (16, 64, 128)),
    ("shakespeare_char, QK-norm (16 x 64 x 4 heads, 32)", (16, 64, 4, 32)),
    ("tiny, hidden (12 x 256, 384)", (12, 256, 384)),
)


def norm_paths(shape: tuple[int, ...]) -> dict:
    """Forward + backward of each norm on the same input and output gradient; gradients dropped after each call."""
    size = shape[-1]
    x = torch.randn(shape).requires_grad_()
    grad = torch.randn(shape)
    llama = LlamaRMSNorm(size, eps=EPS)
    weight = llama.weight
    with torch.no_grad():
        weight.mul_(1 + 0.1 * torch.randn(size))

    ours_grads = torch.autograd.grad(RMSNormFunction.apply(x, weight, EPS), (x, weight), grad)
    llama_grads = torch.autograd.grad(llama(x), (x, weight), grad)
    for mine, theirs in zip(ours_grads, llama_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)

    def run(forward):
        def call() -> None:
            forward().backward(grad)
            x.grad = weight.grad = None

        return call

    return {
        "RMSNormFunction": run(lambda: RMSNormFunction.apply(x, weight, EPS)),
        "LlamaRMSNorm": run(lambda: llama(x)),
        "F.layer_norm": run(lambda: F.layer_norm(x, (size,), weight, None, EPS)),
    }


def main(argv: list[str] | None = None) -> None:
    args = timing_parser(__doc__).parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    load_before, rows_out = load_average(), []
    header = f"{'forward + backward, µs':<52} {'RMSNormFunction':>16} {'LlamaRMSNorm':>13} {'F.layer_norm':>13}"
    print(f"\n{header}  Llama / ours")
    for name, shape in SHAPES:
        inner = max(1, 2**22 // torch.Size(shape).numel())  # about 4M elements per timing
        times = interleaved_medians(norm_paths(shape), repeats=args.repeats, warmup=1, inner=inner)
        us = {path: t["median_s"] * 1e6 for path, t in times.items()}
        ratio = us["LlamaRMSNorm"] / us["RMSNormFunction"]
        print(
            f"{name:<52} {us['RMSNormFunction']:>16.1f} {us['LlamaRMSNorm']:>13.1f} {us['F.layer_norm']:>13.1f}"
            f"  {ratio:>11.2f}x"
        )
        rows_out.append({"shape": name, "dims": list(shape), **{f"{path}_us": round(v, 2) for path, v in us.items()},
                         "llama_over_ours": round(ratio, 3)})  # fmt: skip
    print("Llama / ours above 1: the written-out backward is the faster")
    write_timing(args.json_out, args.threads, load_before, rows=rows_out)


if __name__ == "__main__":
    main()
