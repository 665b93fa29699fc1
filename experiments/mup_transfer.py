"""muP's promise (Yang et al. 2022, "Tensor Programs V"): under the maximal update parametrization the best
learning rate does not depend on the width, so a rate tuned on a narrow model is right for a wide one; under the
standard parametrization it drifts as the width grows, and under muP a wider model is never worse than a narrower
one at its best rate.

    python -m experiments.mup_transfer --jobs 2 --threads 1   # about 20 minutes on 2 CPU cores
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
REVISION = (
    "muP's attention scale is now sqrt(base head_dim)/head_dim (mup_attention_multiplier's default; the base shapes "
    "record the base model's heads, as many, each base-width / heads wide), the standard scale at the base width; "
    "the first version used 1/head_dim, which at the base width already divided the attention logits by "
    "sqrt(head_dim) = 4, and under which every width trained like the base one. Two checks added: width pays "
    "under muP beyond the seed spread, and muP at the rate carried from the base width is no worse than the "
    "standard parametrization at its own best rate, per width."
)
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


@dataclass
class Grid:
    """The mean validation loss over the seeds at every grid point, and each width's best rate."""

    rates: np.ndarray  # the learning rates, ascending as given
    widths: list[int]  # ascending
    mean: dict  # (parametrization, width) -> (rates,) mean loss over the seeds
    best: dict  # (parametrization, width) -> (best rate, its loss, whether it lies inside the grid)
    runs: dict  # (parametrization, width, rate) -> the seeds' runs

    def spread(self, parametrization: str) -> float:
        """The largest best rate over the smallest, across the widths (inf if any is not found)."""
        found = [self.best[parametrization, w][0] for w in self.widths]
        return max(found) / min(found) if all(math.isfinite(r) for r in found) else math.inf

    def rates_text(self, parametrization: str) -> str:
        return ", ".join(
            f"{w}: {self.best[parametrization, w][0]:.2g}{'' if self.best[parametrization, w][2] else ' (grid edge)'}"
            for w in self.widths
        )

    @property
    def tuned_at(self) -> int:
        """The width a rate is tuned at: the guide's, else the second narrowest."""
        return TUNED_WIDTH if TUNED_WIDTH in self.widths else self.widths[min(1, len(self.widths) - 1)]

    def best_trials(self, parametrization: str, width: int):
        """The seeds' runs at the grid rate with the lowest mean loss at ``width``."""
        return self.runs[parametrization, width, self.rates[int(np.nanargmin(self.mean[parametrization, width]))]]

    @property
    def carried_rate(self) -> float:
        """muP's best grid rate at the narrowest (base) width: the one a user carries to every width."""
        return float(self.rates[int(np.nanargmin(self.mean["mup", self.widths[0]]))])

    def carried_trials(self, width: int):
        """muP's runs at ``width`` with the rate carried from the base width."""
        return self.runs["mup", width, self.carried_rate]

    def regret(self, parametrization: str) -> float:
        """Loss at the widest width with the grid rate nearest the best one at ``tuned_at``, minus its best loss."""
        tuned = self.best[parametrization, self.tuned_at][0]
        nearest = int(np.argmin(np.abs(np.log2(self.rates) - np.log2(tuned)))) if math.isfinite(tuned) else 0
        wide = self.widths[-1]
        return float(self.mean[parametrization, wide][nearest] - np.nanmin(self.mean[parametrization, wide]))


def run(session: common.Session, settings: Settings) -> None:
    for width in settings.widths:
        if width % settings.num_attention_heads:
            raise ValueError(
                f"--widths {settings.widths} must divide by --num_attention_heads {settings.num_attention_heads}."
            )
    corpus = common.load_corpus(session, settings.block_size, settings.eval_blocks)
    runs = common.train_all(session, corpus, specs(settings))
    rates = np.array(settings.learning_rates)
    widths = sorted(settings.widths)
    mean = {(p, w): np.array([runs[p, w, lr].mean for lr in rates]) for p in PARAMETRIZATIONS for w in widths}
    best = {key: best_rate(rates, losses) for key, losses in mean.items()}  # (rate, loss, inside the grid)
    grid = Grid(rates, widths, mean, best, runs)
    plot = figure(session, runs, grid)
    common.write_report(
        session, title="muP: the learning rate transfers across width", claim=__doc__.split("\n\n")[0].replace("\n", " "),
        setup=setup_text(settings, grid), results=results_text(runs, grid, plot), checks=checks(grid),
        discussion=DISCUSSION, numbers=numbers(settings, runs, grid), revision=REVISION,
    )  # fmt: skip


def specs(settings: Settings) -> dict:
    """(parametrization, width, learning rate) -> Spec: every width under both parametrizations at every rate."""
    base = min(settings.widths)
    training = dict(
        max_train_steps=settings.steps, per_device_train_batch_size=settings.batch_size,
        num_warmup_steps=settings.warmup_steps, logging_steps=max(1, settings.steps // 10),
        max_eval_samples=settings.eval_blocks,
    )  # fmt: skip
    out = {}
    for width in sorted(settings.widths, reverse=True):  # the slowest first: the two workers finish together
        for parametrization in PARAMETRIZATIONS:
            fields = dict(hidden_size=width, num_hidden_layers=settings.num_hidden_layers,
                          num_attention_heads=settings.num_attention_heads, parametrization=parametrization)  # fmt: skip
            if parametrization == "mup":  # the base model: as many heads, each narrower (head_dim grows)
                heads = settings.num_attention_heads
                fields["mup_base_width"] = base
                fields["mup_base_shapes"] = dict(num_attention_heads=heads, num_key_value_heads=heads,
                                                 head_dim=base // heads)  # fmt: skip
            for lr in settings.learning_rates:
                out[parametrization, width, lr] = common.Spec(
                    f"{parametrization} width {width} lr {lr:.3g}", fields, {**training, "learning_rate": lr},
                    keep_model=False,
                )  # fmt: skip
    return out


def figure(session: common.Session, runs: dict, grid: Grid) -> str:
    """Validation loss against the learning rate at every width, one panel per parametrization."""
    fig, axes = common.figure(ncols=2, width=5.2, height=4.0)
    top = np.nanmax([np.nanmax(m) for m in grid.mean.values() if np.isfinite(m).any()])
    low = np.nanmin([np.nanmin(m) for m in grid.mean.values() if np.isfinite(m).any()])
    for ax, parametrization in zip(axes[0], PARAMETRIZATIONS):
        for i, width in enumerate(grid.widths):
            color = f"C{i}"
            common.plot_mean_and_seeds(ax, grid.rates, [runs[parametrization, width, lr] for lr in grid.rates], top=top,
                                       color=color, label=f"width {width}")  # fmt: skip
            rate, loss, _ = grid.best[parametrization, width]
            if math.isfinite(rate):
                ax.axvline(rate, color=color, ls=":", lw=1)
        ax.set_xscale("log", base=2)
        title = "standard parametrization" if parametrization == "standard" else f"muP (base width {grid.widths[0]})"
        ax.set(xlabel="learning rate", ylabel="validation loss (nats/char)", title=title)
        ax.set_ylim(low - 0.02, min(top, low + 1.0) + 0.02)
        ax.legend(fontsize=7)
    return common.save_figure(fig, session, "loss_vs_lr.png", "validation loss against learning rate at every width")


def checks(grid: Grid) -> list[common.Check]:
    """The claim's parts, decided from the numbers."""
    best, widths = grid.best, grid.widths
    mup_best_loss = [best["mup", w][1] for w in widths]
    narrow, wide = widths[0], widths[-1]
    return [
        common.Check(
            f"under muP the best learning rate moves by less than {TRANSFER_LIMIT:g}x across widths {narrow}-{wide} "
            "(and lies inside the grid at every width)",
            grid.spread("mup") < TRANSFER_LIMIT and all(best["mup", w][2] for w in widths),
            f"best rate by width: {grid.rates_text('mup')}; max/min {grid.spread('mup'):.2f}x",
        ),
        common.Check(
            f"under the standard parametrization the best learning rate drifts: it falls by at least "
            f"{TRANSFER_LIMIT:g}x from width {narrow} to {wide}",
            best["standard", narrow][0] / best["standard", wide][0] >= TRANSFER_LIMIT,
            f"best rate by width: {grid.rates_text('standard')}; width {narrow} / width {wide}: "
            f"{best['standard', narrow][0] / best['standard', wide][0]:.2f}x",
        ),
        common.Check(
            "under muP a wider model is never worse than a narrower one at its best rate (mean over the seeds)",
            all(b <= a for a, b in zip(mup_best_loss, mup_best_loss[1:])),
            "best loss by width: " + ", ".join(f"{w}: {loss:.4f}" for w, loss in zip(widths, mup_best_loss)),
        ),
        common.Check(
            f"under muP width pays: width {wide} at its best rate is better than width {narrow} at its best by more "
            "than the seed-to-seed spread",
            common.lower_beyond_spread(grid.best_trials("mup", wide), grid.best_trials("mup", narrow)),
            common.spread_note(grid.best_trials("mup", wide), grid.best_trials("mup", narrow)),
        ),
        common.Check(
            f"muP at the rate carried from width {narrow} is no worse than the standard parametrization at its own "
            f"best rate, beyond the seed spread, at every width from {grid.widths[min(2, len(widths) - 1)]} up",
            all(
                not common.lower_beyond_spread(grid.best_trials("standard", w), grid.carried_trials(w))
                for w in widths[2:] or widths[-1:]
            ),
            "; ".join(
                f"{w}: muP {common.mean_pm(grid.carried_trials(w))} at {grid.carried_rate:.3g} vs standard "
                f"{common.mean_pm(grid.best_trials('standard', w))} at "
                f"{grid.rates[int(np.nanargmin(grid.mean['standard', w]))]:.3g}"
                for w in widths
            ),
        ),  # fmt: skip
        common.Check(
            f"the rate tuned at width {grid.tuned_at} costs less at width {wide} under muP than under the standard "
            "parametrization (loss at the grid rate nearest the tuned one, minus the best loss at that width)",
            grid.regret("mup") < grid.regret("standard"),
            f"muP +{grid.regret('mup'):.4f}, standard +{grid.regret('standard'):.4f} nats",
        ),
    ]


def results_text(runs: dict, grid: Grid, plot: str) -> str:
    rows = []
    for parametrization in PARAMETRIZATIONS:
        for width in grid.widths:
            rate, loss, inside = grid.best[parametrization, width]
            cells = [str(runs[parametrization, width, lr]) for lr in grid.rates]
            rows.append([parametrization, width, *cells, f"{rate:.3g}{'' if inside else ' (edge)'}"])
    table = common.markdown_table(
        ["parametrization", "width", *(f"lr {lr:.3g}" for lr in grid.rates), "best rate"], rows
    )
    seconds = {p: sum(runs[key].seconds for key in runs if key[0] == p) for p in PARAMETRIZATIONS}
    return (
        f"{plot}\n\nValidation loss (mean ± std over the seeds; NaN: a seed diverged) at each learning rate, and the "
        f"best rate (refined between grid points):\n\n{table}\n\nTraining time, all runs: standard "
        f"{seconds['standard'] / 60:.1f} min, muP {seconds['mup'] / 60:.1f} min (CPU minutes, summed over the runs)."
    )


def setup_text(settings: Settings, grid: Grid) -> str:
    narrow, wide = grid.widths[0], grid.widths[-1]
    return (
        f"Widths {', '.join(map(str, grid.widths))}; {settings.num_hidden_layers} layers, {settings.num_attention_heads} "
        f"heads (head_dim {narrow // settings.num_attention_heads} to {wide // settings.num_attention_heads}), the "
        f"default (Llama-like) architecture. muP: `parametrization: mup`, `mup_base_width: {narrow}` (so the narrowest "
        f"muP model is the standard one) and `mup_base_shapes` recording its {settings.num_attention_heads} heads of "
        f"{narrow // settings.num_attention_heads}, so muP's attention scale is "
        f"sqrt({narrow // settings.num_attention_heads})/head_dim. Learning rates "
        f"{', '.join(f'{lr:.3g}' for lr in grid.rates)}. Each run: {settings.steps} AdamW steps of "
        f"{settings.batch_size} x {settings.block_size} characters, linear warmup over {settings.warmup_steps} steps "
        f"then cosine decay to 10 % (transformers' LambdaLR, which scales each optimizer group's own rate, so muP's "
        f"1/m on the hidden matrices holds at every step); betas 0.9/0.99, weight decay 0.1 on the matrices, coupled to "
        f"each group's rate as AdamW does (muP's hidden matrices decay by lr x 0.1 / m per step), gradient clipping "
        f"1.0. Validation loss over the first {settings.eval_blocks} validation blocks."
    )


DISCUSSION = (
    "The standard parametrization's best rate falls as the width grows because Adam moves every entry of a "
    "hidden matrix by about the rate, and a matrix's output then changes by about (rate x width): the "
    "coordinate check (`mup_coord_check`) shows that growth directly. muP divides the hidden matrices' rate by "
    "m = width / base width, the logits by m and the attention logits by head_dim instead of its square root "
    "(times sqrt of the base head_dim, so that the base width attends as the standard model does), so the same rate moves every layer's activations by the same amount at every width. These are short runs "
    "of small models on a small corpus: the best rate of a longer run is lower, and whether a rate tuned this "
    "way transfers to depth, batch size or training length is not tested here (muP transfers across width only)."
)


def numbers(settings: Settings, runs: dict, grid: Grid) -> dict:
    keys = [(p, w) for p in PARAMETRIZATIONS for w in grid.widths]
    return {
        "widths": grid.widths,
        "learning_rates": list(settings.learning_rates),
        "losses": {f"{p} {w}": [runs[p, w, lr].losses.tolist() for lr in grid.rates] for p, w in keys},
        "best_rate": {f"{p} {w}": grid.best[p, w][0] for p, w in keys},
        "best_rate_inside_grid": {f"{p} {w}": grid.best[p, w][2] for p, w in keys},
        "best_loss": {f"{p} {w}": grid.best[p, w][1] for p, w in keys},
        "regret_at_widest": {p: grid.regret(p) for p in PARAMETRIZATIONS},
    }


if __name__ == "__main__":
    main()
