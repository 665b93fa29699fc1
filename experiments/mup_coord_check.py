"""The muP coordinate check (Yang et al. 2022, "Tensor Programs V", section 7 and the mup package's "coord check"):
after a few training steps, the typical size of every layer's activations stays the same at every width under
muP, and grows with the width under the standard parametrization.

    python -m experiments.mup_coord_check            # about a minute on 2 CPU cores
    python -m experiments.mup_coord_check --quick    # smoke test

Models of 2 layers and 4 heads (so head_dim grows with the width, which is where muP's 1/head_dim attention scale
matters) at widths 64 to 1024, both parametrizations, each trained with the training scripts' own optimizer groups
(``training.optim.make_optimizer``: under muP the hidden matrices at learning_rate / m) for a few Adam steps at
a constant, large rate on one batch of Tiny Shakespeare, repeated (as the mup package's check does). Before each
step and after the last, the mean absolute value of each coordinate ("l1") of the token embeddings' output, the
attention logits (q.k x scale, below the causal mask's diagonal), each attention block's and each MLP's output
and the logits is recorded; the slope of log(l1) against log(width) at the last step decides.
"""

from dataclasses import dataclass

import numpy as np
import torch

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from training.args import TrainConfig
from training.optim import make_optimizer

from . import common

NAME = "mup_coord_check"
REVISION = (
    "muP's defaults changed: the attention scale is sqrt(base head_dim)/head_dim (the base shapes record the base "
    "model's heads, as many, each narrower) and an unset initializer_range is 1/sqrt(mup_base_width); the first "
    "version used 1/head_dim and 0.02."
)
ACTIVATIONS = ("embedding", "attention logits", "attention output", "MLP output", "logits")
CHANGES = tuple(f"{name} change" for name in ACTIVATIONS)
PARAMETRIZATIONS = ("standard", "mup")
# |slope| of log l1 against log width: below FLAT it keeps its scale (a width 16x larger changes it by less than
# 16^0.3 = 2.3x); above GROWS it grows (16^0.5 = 4x over the same range)
FLAT, GROWS = 0.3, 0.5


@dataclass(frozen=True)
class Settings:
    widths: tuple[int, ...] = (64, 128, 256, 512, 1024)
    base_width: int = 64  # muP's mup_base_width: the narrowest model
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    steps: int = 4
    learning_rate: float = 3e-3  # large for these models (the mup package advises a large rate for the check)
    batch_size: int = 4
    block_size: int = 32


QUICK = Settings(widths=(32, 64), base_width=32, num_hidden_layers=1, steps=2, batch_size=2, block_size=16)


class Recorder:
    """Forward hooks recording the l1 (mean |x|) of the activations named in ``ACTIVATIONS``, averaged over layers,
    and a wrapper of the attention function for the logits (``common.AttentionRecorder``); and the l1 of each one's
    change since the first call (x_t - x_0: what training moved, which muP keeps the same size at every width)."""

    def __init__(self, model: DecoderLabForCausalLM):
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.first: dict[str, list[torch.Tensor]] | None = None
        self.handles = [model.model.embed_tokens.register_forward_hook(self.hook("embedding"))]
        for layer in model.model.layers:
            self.handles.append(layer.self_attn.register_forward_hook(self.hook("attention output")))
            self.handles.append(layer.mlp.register_forward_hook(self.hook("MLP output")))
        self.handles.append(model.lm_head.register_forward_hook(self.hook("logits")))

    def hook(self, name: str):
        def record(module, args, output):
            value = output[0] if isinstance(output, tuple) else output
            self.outputs.setdefault(name, []).append(value.detach().clone())

        return record

    def take(self, scores: list[torch.Tensor]) -> dict[str, float]:
        """The l1 of each activation since the last call and of its change since the first call ("NAME change"),
        each the mean over the layers; then clear."""
        T = scores[0].shape[-1]
        kept = T * (T + 1) / 2  # (B, nh, T, T): the scores the causal mask keeps

        def l1(name: str, x: torch.Tensor) -> float:
            return (
                (x.tril().abs().sum(dim=(-1, -2)) / kept).mean().item()
                if name == "attention logits"
                else x.abs().mean().item()
            )

        self.outputs["attention logits"] = [s.detach().clone() for s in scores]
        if self.first is None:
            self.first = self.outputs
        values = {}
        for name in ACTIVATIONS:
            now, start = self.outputs[name], self.first[name]
            values[name] = float(np.mean([l1(name, x) for x in now]))
            values[f"{name} change"] = float(np.mean([l1(name, x - x0) for x, x0 in zip(now, start)]))
        self.outputs = {}
        return values

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def model_fields(settings: Settings, width: int, parametrization: str, vocab_size: int) -> dict:
    fields = dict(
        vocab_size=vocab_size, hidden_size=width, num_hidden_layers=settings.num_hidden_layers,
        num_attention_heads=settings.num_attention_heads, max_position_embeddings=settings.block_size,
        parametrization=parametrization,
    )  # fmt: skip
    if parametrization == "mup":  # the base model: as many heads, each narrower (head_dim grows with the width)
        heads = settings.num_attention_heads
        fields["mup_base_width"] = settings.base_width
        fields["mup_base_shapes"] = dict(num_attention_heads=heads, num_key_value_heads=heads,
                                         head_dim=settings.base_width // heads)  # fmt: skip
    return fields


def coordinates(settings: Settings, batch: torch.Tensor, vocab_size: int, width: int, parametrization: str,
                seed: int) -> list[dict[str, float]]:  # fmt: skip
    """The l1 of every activation of ``ACTIVATIONS`` at each step 0..steps (0: at initialisation) of one model
    trained on ``batch`` (B, T), repeated, by the training scripts' AdamW groups at a constant rate."""
    torch.manual_seed(seed)
    model = DecoderLabForCausalLM(DecoderLabConfig(**model_fields(settings, width, parametrization, vocab_size)))
    model.train()
    cfg = TrainConfig(learning_rate=settings.learning_rate, weight_decay=0.0, max_grad_norm=None)
    optimizer = make_optimizer(model, cfg)
    recorder = Recorder(model)
    measured = []
    try:
        for step in range(settings.steps + 1):
            with common.AttentionRecorder(model.config) as attention:
                loss = model(input_ids=batch, labels=batch).loss
            measured.append(recorder.take(attention.scores) | {"loss": loss.item()})
            if step == settings.steps:
                break
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        recorder.close()
    return measured


def slope(widths, values) -> float:
    """The least-squares slope of log(values) against log(widths): 0 flat, 1 proportional to the width."""
    return float(np.polyfit(np.log(widths), np.log(values), 1)[0])


def coordinate_check(settings: Settings, batch: torch.Tensor, vocab_size: int, seeds: list[int]) -> dict:
    """``{parametrization: {"l1": {activation: (widths, steps + 1) mean over seeds}, "slope": {activation: slope of
    the last step}, "change": and "change_slope": the same of x_t - x_0, "loss": (widths, steps + 1)}}``."""
    out = {}
    for parametrization in PARAMETRIZATIONS:
        runs = np.array([
            [[[step[name] for name in (*ACTIVATIONS, *CHANGES, "loss")] for step in coordinates(
                settings, batch, vocab_size, width, parametrization, seed)] for width in settings.widths]
            for seed in seeds
        ]).mean(0)  # (widths, steps + 1, activations + loss)  # fmt: skip
        l1 = {name: runs[:, :, i] for i, name in enumerate(ACTIVATIONS)}
        change = {name: runs[:, :, len(ACTIVATIONS) + i] for i, name in enumerate(ACTIVATIONS)}
        out[parametrization] = {
            "l1": l1,
            "slope": {name: slope(settings.widths, values[:, -1]) for name, values in l1.items()},
            "change": change,
            "change_slope": {name: slope(settings.widths, values[:, -1]) for name, values in change.items()},
            "loss": runs[:, :, -1],
        }
    return out


def main(argv: list[str] | None = None) -> None:
    common.run_experiment(NAME, __doc__, Settings(), QUICK, run, argv)


def run(session: common.Session, settings: Settings) -> None:
    if settings.base_width > min(settings.widths):
        raise ValueError(
            f"--base_width {settings.base_width} must be at most the narrowest of --widths {settings.widths}: "
            "muP's base width is the model the hyperparameters were tuned at."
        )
    corpus = common.load_corpus(session, settings.block_size, 1)
    batch = corpus.train_blocks[: settings.batch_size].long()
    result = coordinate_check(settings, batch, corpus.vocab_size, session.seeds)
    session.log("measured every width")
    plot = figure(session, settings, result)
    numbers = {
        parametrization: {
            "slope": result[parametrization]["slope"],
            "change_slope": result[parametrization]["change_slope"],
            "l1": {name: values.tolist() for name, values in result[parametrization]["l1"].items()},
            "loss": result[parametrization]["loss"].tolist(),
        }
        for parametrization in PARAMETRIZATIONS
    } | {"widths": list(settings.widths)}
    common.write_report(
        session, title="The muP coordinate check", claim=__doc__.split("\n\n")[0].replace("\n", " "),
        setup=setup_text(settings), results=results_text(settings, result, plot), checks=checks(settings, result),
        discussion=DISCUSSION, numbers=numbers, revision=REVISION,
    )  # fmt: skip


def figure(session: common.Session, settings: Settings, result: dict) -> str:
    """Mean |activation| against the width, one panel per parametrization and activation, one line per step."""
    widths = np.array(settings.widths)
    fig, axes = common.figure(ncols=len(ACTIVATIONS), nrows=2, width=3.2, height=2.9)
    for row, parametrization in enumerate(PARAMETRIZATIONS):
        for col, name in enumerate(ACTIVATIONS):
            ax = axes[row][col]
            values = result[parametrization]["l1"][name]  # (widths, steps + 1)
            for step in range(values.shape[1]):
                ax.plot(widths, values[:, step], marker="o", ms=3, color=f"C{step}", label=f"t={step}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{parametrization}: {name}", fontsize=9)
            ax.set_xlabel("width", fontsize=8)
            if col == 0:
                ax.set_ylabel("mean |x|", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    return common.save_figure(fig, session, "coord_check.png", "mean |activation| against width, each step")


def checks(settings: Settings, result: dict) -> list[common.Check]:
    """The claim's parts, decided from the numbers."""
    widths = settings.widths
    growing = [name for name in ACTIVATIONS if name != "embedding"]
    mup, standard = result["mup"]["slope"], result["standard"]["slope"]
    return [
        common.Check(
            f"under muP every activation keeps its scale across widths {widths[0]}-{widths[-1]} after "
            f"{settings.steps} steps (|slope| < {FLAT})",
            all(abs(mup[name]) < FLAT for name in ACTIVATIONS),
            ", ".join(f"{name} {mup[name]:+.2f}" for name in ACTIVATIONS),
        ),
        common.Check(
            f"under muP no activation grows with the width (slope < {FLAT}; the initial part of the attention "
            "logits and of the logits may shrink, as muP lets it)",
            all(mup[name] < FLAT for name in ACTIVATIONS),
            ", ".join(f"{name} {mup[name]:+.2f}" for name in ACTIVATIONS),
        ),
        common.Check(
            f"under the standard parametrization the attention logits, the attention and MLP outputs and the logits "
            f"grow with the width (slope > {GROWS})",
            all(standard[name] > GROWS for name in growing),
            ", ".join(f"{name} {standard[name]:+.2f}" for name in growing),
        ),
        common.Check(
            f"the embeddings' output keeps its scale under both (|slope| < {FLAT}: the embedding is a vector-like "
            "parameter, trained alike by both)",
            abs(standard["embedding"]) < FLAT and abs(mup["embedding"]) < FLAT,
            f"standard {standard['embedding']:+.2f}, muP {mup['embedding']:+.2f}",
        ),
    ]


def results_text(settings: Settings, result: dict, plot: str) -> str:
    mup, standard = result["mup"]["slope"], result["standard"]["slope"]
    moved = result["mup"]["change_slope"], result["standard"]["change_slope"]
    rows = [
        [name, f"{standard[name]:+.2f}", f"{mup[name]:+.2f}", f"{moved[1][name]:+.2f}", f"{moved[0][name]:+.2f}",
         f"{result['standard']['l1'][name][-1, -1] / result['standard']['l1'][name][0, -1]:.3g}x",
         f"{result['mup']['l1'][name][-1, -1] / result['mup']['l1'][name][0, -1]:.3g}x"]
        for name in ACTIVATIONS
    ]  # fmt: skip
    ratio = f"{settings.widths[-1]} / {settings.widths[0]}"
    return (
        f"{plot}\n\nSlope of log mean |x| against log width after step {settings.steps}, the same for the change "
        f"since initialisation (mean |x_t - x_0|), and the ratio of mean |x| at width {ratio}:\n\n"
        + common.markdown_table(
            [
                "activation",
                "standard slope",
                "muP slope",
                "standard: change's slope",
                "muP: change's slope",
                f"standard {ratio}",
                f"muP {ratio}",
            ],
            rows,
        )
    )


def setup_text(settings: Settings) -> str:
    widths = settings.widths
    return (
        f"Widths {', '.join(map(str, settings.widths))}; {settings.num_hidden_layers} layers, "
        f"{settings.num_attention_heads} heads (head_dim {widths[0] // settings.num_attention_heads} to "
        f"{widths[-1] // settings.num_attention_heads}), the default (Llama-like) architecture; muP with "
        f"mup_base_width {settings.base_width} (base shapes: {settings.num_attention_heads} heads of "
        f"{settings.base_width // settings.num_attention_heads}, so the attention scale is "
        f"sqrt({settings.base_width // settings.num_attention_heads})/head_dim). Each model is trained with `training.optim.make_optimizer`'s AdamW "
        f"groups at a constant learning rate {settings.learning_rate:g}, no weight decay, no clipping, for "
        f"{settings.steps} steps on one batch of {settings.batch_size} x {settings.block_size} characters of Tiny "
        "Shakespeare, repeated; the l1 of each activation is recorded before every step (t=0: at initialisation) "
        "and after the last, averaged over the layers and over the seeds."
    )


DISCUSSION = (
    "Under the standard parametrization Adam moves every weight entry by about the learning rate whatever the "
    "width, so a hidden matrix's update changes its output by about (learning rate x width): the activations "
    "after the first step grow with the width, and the learning rate that is right at one width is too large "
    "at a wider one. muP's 1/m on the hidden matrices' rate, 1/m on the logits and 1/head_dim on the attention "
    "logits (times sqrt of the base head_dim) undo each of those growths, which is what lets a learning rate tuned at a small width carry over "
    "(see the `mup_transfer` experiment). At t=0 muP's logits shrink like 1/sqrt(width) (the head is drawn "
    "at a fixed std and multiplied by 1/m), the transient the mup package describes; after a few steps the "
    "updates dominate. With the base width's initialisation at 1/sqrt(fan-in) that initial part is several times "
    "larger than with 0.02, and it still weighs at step 4: the attention logits (whose initial part goes as "
    "1/sqrt(head_dim) under muP's 1/head_dim scaling) and the logits shrink with the width, while what training "
    "moved, x_t - x_0, keeps its size in the blocks' outputs; in the attention logits it shrinks too (slope near "
    "-0.4), since after 4 steps it is still mostly the cross terms of the initial queries and keys with their "
    "updates, which the 1/head_dim scale shrinks. Nothing grows with the width, which is what the transfer needs "
    "(`mup_transfer`); zero-initialised queries, which Tensor Programs V suggests, would remove the initial part and "
    "are not measured here."
)


if __name__ == "__main__":
    main()
