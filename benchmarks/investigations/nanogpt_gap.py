"""Where decoderlab's training step loses to nanoGPT's at nano with the same weights, taken apart on this machine.

    python -m benchmarks.investigations.nanogpt_gap              # about a minute on 2 cores
    python -m benchmarks.investigations.nanogpt_gap --json_out benchmarks/results/nanogpt_gap.json

``python -m benchmarks.speed`` compares one training step (forward, backward, fused AdamW; nano, batch 12 x 64)
of nanoGPT and of decoderlab holding the same weights. This times four steps on the same batch, interleaved
(A B C D A B C D ...), each model with its own copy of the weights and its own optimizer:

- ``nanoGPT``: benchmarks.reference_nanogpt's model, q, k and v from one fused ``c_attn`` product;
- ``nanoGPT, q/k/v as three layers``: the same model with ``c_attn`` cut into three ``nn.Linear``, the layout of
  decoderlab's (and Llama's) state dict: what the standard names cost by themselves;
- ``decoderlab's modules, called directly``: decoderlab's embeddings, decoder layers, final norm, head and loss
  called in sequence, without ``DecoderLabForCausalLM.forward`` and the transformers machinery around it (the
  cache argument, config defaults, output capture, the mask helper, output classes);
- ``DecoderLabForCausalLM``: the model as users call it, ``model(input_ids=x, labels=y).loss``.

Each ratio is nanoGPT's time per step over the row's: below 1.0 is slower. Before timing, the two nanoGPT
variants are checked to give the same loss, and so are the two decoderlab ones.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import (
    SIZES,
    interleaved_medians,
    load_average,
    machine_line,
    nanogpt_pairs,
    optimizer_step_fn,
    timing_parser,
    training_batch,
    write_timing,
)
from benchmarks.reference_nanogpt import NanoGPT, NanoGPTAttention
from decoderlab import DecoderLabForCausalLM


class SplitQKVAttention(nn.Module):
    """nanoGPT's attention with q, k and v as three ``nn.Linear`` (``c_attn``'s rows, in order)."""

    def __init__(self, fused: NanoGPTAttention):
        super().__init__()
        self.n_head = fused.n_head
        C = fused.c_proj.in_features
        self.q, self.k, self.v = (nn.Linear(C, C, bias=False) for _ in range(3))
        with torch.no_grad():
            for layer, rows in zip((self.q, self.k, self.v), fused.c_attn.weight.split(C)):
                layer.weight.copy_(rows)
        self.c_proj = fused.c_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (
            layer(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for layer in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def split_qkv(model: NanoGPT) -> NanoGPT:
    """A copy of ``model`` whose attention layers compute q, k and v with three products."""
    split = copy.deepcopy(model)
    for block in split.transformer.h:
        block.attn = SplitQKVAttention(block.attn)
    return split


def modules_loss(model: DecoderLabForCausalLM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss ``model(input_ids=x, labels=y)`` computes (learned positions, no padding, no cache), from its
    modules called one after another."""
    body = model.model
    hidden = body.embed_tokens(x) + body.embed_positions(torch.arange(x.shape[1])[None])
    for layer in body.layers:
        hidden = layer(hidden, None, None, None)  # no mask (SDPA's causal path), no RoPE, no cache
    logits = model.lm_head(body.norm(hidden))
    return model.loss_function(logits=logits, labels=y, vocab_size=model.config.vocab_size)


def training_steps(seed: int = 0) -> dict:
    """The four steps of the docstring on one nano batch, after checking the losses that must agree."""
    size = SIZES["nano"]
    pair = nanogpt_pairs(size, seed)[0]
    x, y = training_batch(size, seed)
    nanogpt, decoderlab = pair.reference.train(), pair.ours.train()
    split, direct = split_qkv(nanogpt).train(), copy.deepcopy(decoderlab).train()
    losses = {
        "nanoGPT": lambda: nanogpt(x, y)[1],
        "nanoGPT, q/k/v as three layers": lambda: split(x, y)[1],
        "decoderlab's modules, called directly": lambda: modules_loss(direct, x, y),
        "DecoderLabForCausalLM": lambda: decoderlab(input_ids=x, labels=y).loss,
    }
    with torch.no_grad():
        values = [loss().item() for loss in losses.values()]
    for first, second, what in ((0, 1, "nanoGPT's"), (2, 3, "decoderlab's")):
        if abs(values[first] - values[second]) > 1e-5:
            raise RuntimeError(f"The two {what} steps compute different losses: {values[first]} and {values[second]}.")
    models = (nanogpt, split, direct, decoderlab)
    return {name: optimizer_step_fn(model, loss) for (name, loss), model in zip(losses.items(), models)}


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__, repeats=15)
    parser.add_argument("--steps", type=int, default=10, help="training steps per timing")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    load_before = load_average()
    times = interleaved_medians(training_steps(), repeats=args.repeats, warmup=1, inner=args.steps)
    reference = times["nanoGPT"]["median_s"]
    print(f"\n{'training step, nano, batch 12 x 64':<42} {'ms':>7} {'nanoGPT / this':>15}")
    rows = []
    for name, timing in times.items():
        ms, ratio = timing["median_s"] * 1e3, reference / timing["median_s"]
        print(f"{name:<42} {ms:>7.2f} {ratio:>14.3f}x")
        rows.append({"step": name, "ms": round(ms, 3), "nanogpt_over_this": round(ratio, 4),
                     "samples_ms": [round(s * 1e3, 3) for s in timing["samples_s"]]})  # fmt: skip
    print("below 1.0x: slower than nanoGPT's step")
    write_timing(args.json_out, args.threads, load_before, steps_per_timing=args.steps, rows=rows)


if __name__ == "__main__":
    main()
