"""muP's promise (Yang et al. 2022, "Tensor Programs V"): under the maximal update parametrization the best
learning rate does not depend on the width, so a rate tuned on a narrow model is right for a wide one; under the
standard parametrization it drifts as the width grows, and under muP a wider model is never worse than a narrower
one at its best rate.

    python -m experiments.mup_transfer --jobs 2 --threads 1   # about 30 minutes on 2 CPU cores
    python -m experiments.mup_transfer --quick                # smoke test

Models of widths 64 to 512 (2 layers, 4 heads: head_dim grows with the width) are trained on character-level Tiny
Shakespeare at every learning rate of a grid spaced by factors of 2, in the standard parametrization and under muP
(``parametrization: mup``, ``mup_base_width`` the narrowest width), with the training scripts' own loop and
optimizer groups. The best rate of each width is read from the mean validation loss over the seeds, refined between
grid points by a parabola through the best rate and its two neighbours (in log2 of the rate).
"""

import math
from dataclasses import dataclass

import numpy as np

from training.mup_tune import best_rate  # the best rate of a grid, refined between grid points

from . import common

NAME = "mup_transfer"
REVISION = "The first version of this experiment."
PARAMETRIZATIONS = ("standard", "mup")
TRANSFER_LIMIT = 2.0  # muP's best rate may move by less than this factor across the widths
TUNED_WIDTH = 128  # the width the guide tunes at (nano): its best rate is carried to the widest model


@dataclass(frozen=True)
class Settings:
    widths: tuple[int, ...] = (64, 128, 256, 512)
    learning_rates: tuple[float, ...] = (2**-12, 2**-11, 2**-10, 2**-9, 2**-8, 2**-7, 2**-6)
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    block_size: int = 64
    batch_size: int = 8
    steps: int = 120
    warmup_steps: int = 12
    eval_blocks: int = 128


QUICK = Settings(
    widths=(32, 64), learning_rates=(2**-9, 2**-7, 2**-5), num_hidden_layers=1, block_size=16, batch_size=4, steps=4,
    warmup_steps=1, eval_blocks=8,
)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    common.run_experiment(NAME, __doc__, Settings(), QUICK, run, argv)


def run(session: common.Session, settings: Settings) -> None:
    base = min(settings.widths)
    for width in settings.widths:
        if width % settings.num_attention_heads:
            raise ValueError(f"--widths {settings.widths} must divide by --num_attention_heads {settings.num_attention_heads}.")
    corpus = common.load_corpus(session, settings.block_size, settings.eval_blocks)
    specs = {}
    for width in sorted(settings.widths, reverse=True):  # the slowest first: the two workers finish together
        for parametrization in PARAMETRIZATIONS:
            fields = dict(hidden_size=width, num_hidden_layers=settings.num_hidden_layers,
                          num_attention_heads=settings.num_attention_heads, parametrization=parametrization)  # fmt: skip
            if parametrization == "mup":
                fields["mup_base_width"] = base
            for lr in settings.learning_rates:
                recipe = common.Recipe(
                    steps=settings.steps, batch_size=settings.batch_size, learning_rate=lr,
                    warmup_steps=settings.warmup_steps, log_every=max(1, settings.steps // 10),
                    eval_samples=settings.eval_blocks,
                )  # fmt: skip
                specs[parametrization, width, lr] = common.Spec(
                    f"{parametrization} width {width} lr {lr:.3g}", fields, recipe, keep_model=False
                )
    runs = common.train_all(session, corpus, specs)
    rates = np.array(settings.learning_rates)
    widths = sorted(settings.widths)
    mean = {(p, w): np.array([runs[p, w, lr].mean for lr in rates]) for p in PARAMETRIZATIONS for w in widths}
    best = {key: best_rate(rates, losses) for key, losses in mean.items()}  # (rate, loss, inside the grid)

    fig, axes = common.figure(ncols=2, width=5.2, height=4.0)
    top = np.nanmax([np.nanmax(m) for m in mean.values() if np.isfinite(m).any()])
    low = np.nanmin([np.nanmin(m) for m in mean.values() if np.isfinite(m).any()])
    for ax, parametrization in zip(axes[0], PARAMETRIZATIONS):
        for i, width in enumerate(widths):
            color = f"C{i}"
            common.plot_mean_and_seeds(ax, rates, [runs[parametrization, width, lr] for lr in rates], top=top,
                                       color=color, label=f"width {width}")  # fmt: skip
            rate, loss, _ = best[parametrization, width]
            if math.isfinite(rate):
                ax.axvline(rate, color=color, ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="learning rate", ylabel="validation loss (nats/char)",
               title="standard parametrization" if parametrization == "standard" else f"muP (base width {base})")  # fmt: skip
        ax.set_ylim(low - 0.02, min(top, low + 1.0) + 0.02)
        ax.legend(fontsize=7)
    plot = common.save_figure(fig, session, "loss_vs_lr.png", "validation loss against learning rate at every width")

    def spread(parametrization: str) -> float:
        found = [best[parametrization, w][0] for w in widths]
        return max(found) / min(found) if all(math.isfinite(r) for r in found) else math.inf

    def rates_text(parametrization: str) -> str:
        return ", ".join(
            f"{w}: {best[parametrization, w][0]:.2g}{'' if best[parametrization, w][2] else ' (grid edge)'}"
            for w in widths
        )

    mup_best_loss = [best["mup", w][1] for w in widths]
    narrow, wide = widths[0], widths[-1]
    tuned_at = TUNED_WIDTH if TUNED_WIDTH in widths else widths[min(1, len(widths) - 1)]

    def regret(parametrization: str) -> float:
        """Loss at the widest width with the grid rate nearest the best one at ``tuned_at``, minus its best loss."""
        tuned = best[parametrization, tuned_at][0]
        nearest = int(np.argmin(np.abs(np.log2(rates) - np.log2(tuned)))) if math.isfinite(tuned) else 0
        return float(mean[parametrization, wide][nearest] - np.nanmin(mean[parametrization, wide]))

    checks = [
        common.Check(
            f"under muP the best learning rate moves by less than {TRANSFER_LIMIT:g}x across widths {narrow}-{wide} "
            "(and lies inside the grid at every width)",
            spread("mup") < TRANSFER_LIMIT and all(best["mup", w][2] for w in widths),
            f"best rate by width: {rates_text('mup')}; max/min {spread('mup'):.2f}x",
        ),
        common.Check(
            f"under the standard parametrization the best learning rate drifts: it falls by at least "
            f"{TRANSFER_LIMIT:g}x from width {narrow} to {wide}",
            best["standard", narrow][0] / best["standard", wide][0] >= TRANSFER_LIMIT,
            f"best rate by width: {rates_text('standard')}; width {narrow} / width {wide}: "
            f"{best['standard', narrow][0] / best['standard', wide][0]:.2f}x",
        ),
        common.Check(
            "under muP a wider model is never worse than a narrower one at its best rate (mean over the seeds)",
            all(b <= a for a, b in zip(mup_best_loss, mup_best_loss[1:])),
            "best loss by width: " + ", ".join(f"{w}: {loss:.4f}" for w, loss in zip(widths, mup_best_loss)),
        ),
        common.Check(
            f"the rate tuned at width {tuned_at} costs less at width {wide} under muP than under the standard "
            "parametrization (loss at the grid rate nearest the tuned one, minus the best loss at that width)",
            regret("mup") < regret("standard"),
            f"muP +{regret('mup'):.4f}, standard +{regret('standard'):.4f} nats",
        ),
    ]

    rows = []
    for parametrization in PARAMETRIZATIONS:
        for width in widths:
            rate, loss, inside = best[parametrization, width]
            cells = [str(runs[parametrization, width, lr]) for lr in rates]
            rows.append([parametrization, width, *cells, f"{rate:.3g}{'' if inside else ' (edge)'}"])
    table = common.markdown_table(
        ["parametrization", "width", *(f"lr {lr:.3g}" for lr in rates), "best rate"], rows
    )
    seconds = {p: sum(runs[key].seconds for key in runs if key[0] == p) for p in PARAMETRIZATIONS}
    results = (
        f"{plot}\n\nValidation loss (mean ± std over the seeds; NaN: a seed diverged) at each learning rate, and the "
        f"best rate (refined between grid points):\n\n{table}\n\nTraining time, all runs: standard "
        f"{seconds['standard'] / 60:.1f} min, muP {seconds['mup'] / 60:.1f} min (CPU minutes, summed over the runs)."
    )
    setup = (
        f"Widths {', '.join(map(str, widths))}; {settings.num_hidden_layers} layers, {settings.num_attention_heads} "
        f"heads (head_dim {narrow // settings.num_attention_heads} to {wide // settings.num_attention_heads}), the "
        f"default (Llama-like) architecture. muP: `parametrization: mup`, `mup_base_width: {base}` (so the narrowest "
        f"muP model differs from the standard one only in its 1/head_dim attention scale). Learning rates "
        f"{', '.join(f'{lr:.3g}' for lr in rates)}. Each run: {settings.steps} AdamW steps of "
        f"{settings.batch_size} x {settings.block_size} characters, linear warmup over {settings.warmup_steps} steps "
        f"then cosine decay to 10 % (transformers' LambdaLR, which scales each optimizer group's own rate, so muP's "
        f"1/m on the hidden matrices holds at every step); betas 0.9/0.99, weight decay 0.1 on the matrices, coupled to "
        f"each group's rate as AdamW does (muP's hidden matrices decay by lr x 0.1 / m per step), gradient clipping "
        f"1.0. Validation loss over the first {settings.eval_blocks} validation blocks."
    )
    discussion = (
        "The standard parametrization's best rate falls as the width grows because Adam moves every entry of a "
        "hidden matrix by about the rate, and a matrix's output then changes by about (rate x width): the "
        "coordinate check (`mup_coord_check`) shows that growth directly. muP divides the hidden matrices' rate by "
        "m = width / base width, the logits by m and the attention logits by head_dim instead of its square root, "
        "so the same rate moves every layer's activations by the same amount at every width. These are short runs "
        "of small models on a small corpus: the best rate of a longer run is lower, and whether a rate tuned this "
        "way transfers to depth, batch size or training length is not tested here (muP transfers across width only)."
    )
    numbers = {
        "widths": widths,
        "learning_rates": list(settings.learning_rates),
        "losses": {f"{p} {w}": [runs[p, w, lr].losses.tolist() for lr in rates] for p in PARAMETRIZATIONS for w in widths},
        "best_rate": {f"{p} {w}": best[p, w][0] for p in PARAMETRIZATIONS for w in widths},
        "best_rate_inside_grid": {f"{p} {w}": best[p, w][2] for p in PARAMETRIZATIONS for w in widths},
        "best_loss": {f"{p} {w}": best[p, w][1] for p in PARAMETRIZATIONS for w in widths},
        "regret_at_widest": {p: regret(p) for p in PARAMETRIZATIONS},
    }
    common.write_report(
        session, title="muP: the learning rate transfers across width", claim=__doc__.split("\n\n")[0].replace("\n", " "),
        setup=setup, results=results, checks=checks, discussion=discussion, numbers=numbers, revision=REVISION,
    )  # fmt: skip


if __name__ == "__main__":
    main()
