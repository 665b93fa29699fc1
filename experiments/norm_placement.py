"""Claim 3, norm placement (Xiong et al. 2020): post-LN is unstable in deep models without learning-rate warmup;
pre-LN is stable. Sandwich-LN (Ding et al. 2021) is measured beside them.

    python -m experiments.norm_placement --jobs 2 --threads 1   # about 10 minutes on 2 CPU cores
    python -m experiments.norm_placement --quick                # smoke test

The models are the original Transformer's decoder (the ``vaswani`` preset: LayerNorm, sinusoidal positions, ReLU
MLP, tied embeddings) with the norm moved. Two set-ups are compared side by side: the paper's (Xavier-initialised
projections, token embeddings of std 1/sqrt(d), which the preset's sqrt(d) multiplier brings to unit scale) and
decoderlab's default initialisation (normal std 0.02, GPT-2's scaled residual projections). For each, the gradient norm of every
layer's second FFN matrix at initialisation (the paper's Figure 3 quantity), and a learning-rate sweep with and
without warmup at one depth, every run repeated over seeds, without gradient clipping (clipping hides exactly the
large updates the claim is about).
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.ticker import MaxNLocator
from torch import nn

from decoderlab.configuration_decoderlab import PRESETS, DecoderLabConfig

from . import common

NAME = "norm_placement"
PLACEMENTS = ("pre", "post", "sandwich")
WARMUPS = ("warmup", "no warmup")
INITS = {
    "paper": "Xavier init, unit-scale embeddings (Xiong et al.)",
    "decoderlab": "decoderlab's init (std 0.02, scaled residuals)",
}
REVISION = (
    "This version sets the experiment up as the paper does (the vaswani architecture with Xavier initialisation and "
    "unit-scale embeddings; the Figure 3 quantity ‖∂L/∂W2‖ instead of the norm of all of a layer's parameters; a "
    "learning-rate sweep instead of one rate), repeats every run over seeds, and shows decoderlab's initialisation "
    "as a second column instead of a second report."
)
FAILURE_MARGIN = 0.1  # nats/char: a model this close to the unigram loss has learned next to nothing from the context


@dataclass(frozen=True)
class Settings:
    depths: tuple[int, ...] = (2, 6, 12, 24)  # gradient norms at initialisation
    sweep_depth: int = 6  # the learning-rate sweep (the paper's 6-layer models)
    learning_rates: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    hidden_size: int = 64
    num_attention_heads: int = 2
    block_size: int = 64
    batch_size: int = 16
    steps: int = 150
    warmup_steps: int = 50  # linear warmup of the "warmup" runs; then the learning rate stays constant
    max_grad_norm: float | None = None  # no clipping
    eval_blocks: int = 128
    grad_batches: int = 2  # batches averaged for the gradient norms at initialisation


QUICK = Settings(
    depths=(1, 3), sweep_depth=2, learning_rates=(1e-3, 3e-3), hidden_size=32, block_size=16, batch_size=4, steps=6,
    warmup_steps=3, eval_blocks=8, grad_batches=1,
)  # fmt: skip


def model_fields(settings: Settings, placement: str, depth: int) -> dict:
    """The vaswani preset's architecture (embeddings multiplied by sqrt(d) included) at this size and depth, with
    ``placement``. Both set-ups use it; they differ only in the initialisation."""
    sizes = dict(hidden_size=settings.hidden_size, num_hidden_layers=depth,
                 num_attention_heads=settings.num_attention_heads)  # fmt: skip
    preset = DecoderLabConfig.from_preset("vaswani", **sizes)
    fields = {**{key: getattr(preset, key) for key in PRESETS["vaswani"]}, **sizes}
    return {**fields, "norm_placement": placement}


def xavier_init(model) -> None:
    """The paper's initialisation: every projection Xavier-uniform (Glorot & Bengio 2010) with zero bias, token
    embeddings N(0, 1/d), which ``embedding_multiplier`` sqrt(d) brings to unit scale; norms stay at weight 1,
    bias 0. The tied output projection is the embedding matrix, so it keeps the embedding's initialisation."""
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, nn.Linear) and not (tied and module is model.lm_head):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    nn.init.normal_(model.model.embed_tokens.weight, std=model.config.hidden_size**-0.5)


PREPARE = {"paper": xavier_init, "decoderlab": None}


def ffn_output_gradient_norms(model, batches: list[torch.Tensor]) -> np.ndarray:
    """(L,) ‖∂L/∂W2‖ of each decoder layer's second FFN matrix (``mlp.down_proj.weight``, Xiong et al.'s W^{2,l}),
    at the model's current weights, averaged over ``batches``."""
    device = next(model.parameters()).device
    model.train()
    norms = []
    for input_ids in batches:
        model.zero_grad(set_to_none=True)
        input_ids = input_ids.long().to(device)
        model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
        norms.append([layer.mlp.down_proj.weight.grad.norm().item() for layer in model.model.layers])
    model.zero_grad(set_to_none=True)
    return np.mean(norms, axis=0)


def unigram_entropy(blocks: torch.Tensor, vocab_size: int) -> float:
    """Entropy (nats) of the character frequencies: the loss of a model that ignores the context."""
    p = torch.bincount(blocks.flatten().long(), minlength=vocab_size).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def main(argv: list[str] | None = None) -> None:
    common.run_experiment(NAME, __doc__, Settings(), QUICK, run, argv)


@dataclass(frozen=True)
class Failure:
    """When a run failed: it diverged (NaN/inf) or ended within FAILURE_MARGIN of the context-free unigram loss
    ``baseline`` (or above it)."""

    baseline: float

    def failed(self, run: common.Run) -> bool:
        return run.diverged_by is not None or run.final_eval_loss >= self.baseline - FAILURE_MARGIN

    def fails(self, t: common.Trials) -> bool:
        """Most seeds failed."""
        return t.count(self.failed) > len(t.runs) / 2

    def trains(self, t: common.Trials) -> bool:
        """No seed failed."""
        return t.count(self.failed) == 0

    def count(self, t: common.Trials) -> str:
        return f"{t.count(self.failed)}/{len(t.runs)} failed"


def run(session: common.Session, settings: Settings) -> None:
    corpus = common.load_corpus(session, settings.block_size, settings.eval_blocks)
    failure = Failure(unigram_entropy(corpus.train_blocks, corpus.vocab_size))
    grad_batches = list(corpus.train_blocks[: settings.grad_batches * settings.batch_size].split(settings.batch_size))

    # gradient norms at initialisation: every set-up, depth and placement, every seed
    grad_norms = {}  # (init, placement, depth) -> (seeds, L)
    for init in INITS:
        for depth in settings.depths:
            for placement in PLACEMENTS:
                fields = model_fields(settings, placement, depth)
                grad_norms[init, placement, depth] = np.array([
                    ffn_output_gradient_norms(common.fresh_model(corpus, fields, seed, PREPARE[init]), grad_batches)
                    for seed in session.seeds
                ])  # fmt: skip
    session.log("measured gradient norms at initialisation")

    trials = common.train_all(session, corpus, specs(settings))
    grad_png = grad_norm_figure(session, settings, grad_norms)
    loss_png = loss_figure(session, settings, trials, failure.baseline)
    common.write_report(
        session,
        title="Norm placement: pre-LN, post-LN and sandwich-LN, learning rate and warmup",
        claim=(
            "Post-LN Transformers are unstable when deep unless the learning rate is warmed up; pre-LN Transformers "
            "train stably without warmup (Xiong et al. 2020, On Layer Normalization in the Transformer Architecture)."
        ),
        setup=setup_text(session, settings, corpus, len(grad_batches)),
        results=f"""{grad_png}

‖∂L/∂W2‖ at initialisation, first and last layer (mean over seeds):

{grad_table(settings, grad_norms)}

{loss_png}

Final validation loss (nats/char), paper set-up, {settings.sweep_depth} layers:

{loss_table(settings, trials, failure, "paper")}

The same with decoderlab's initialisation:

{loss_table(settings, trials, failure, "decoderlab")}""",
        checks=checks(settings, trials, grad_norms, failure),
        discussion=discussion(session, settings, trials, grad_norms, failure),
        revision=REVISION,
        numbers={
            "unigram_loss": failure.baseline,
            "runs": {", ".join(map(str, key)): {"final_eval_losses": t.losses.tolist(), "mean": t.mean, "std": t.std,
                     "failed": t.count(failure.failed), "diverged_by": [r.diverged_by for r in t.runs],
                     "seconds": t.seconds} for key, t in trials.items()},
            "ffn_output_grad_norm_at_init": {", ".join(map(str, key)): g.tolist() for key, g in grad_norms.items()},
        },
    )  # fmt: skip
    session.log(f"wrote {session.output_dir / 'report.md'}")


def specs(settings: Settings) -> dict:
    """(init, placement, learning rate, warmup) -> Spec: the sweep at ``sweep_depth``, a constant rate after the
    warmup (none in the "no warmup" runs)."""

    def training(learning_rate: float, warmup: str) -> dict:
        return dict(
            max_train_steps=settings.steps, per_device_train_batch_size=settings.batch_size,
            learning_rate=learning_rate, num_warmup_steps=settings.warmup_steps if warmup == "warmup" else 0,
            lr_scheduler_type="constant_with_warmup", lr_scheduler_kwargs={}, max_grad_norm=settings.max_grad_norm,
            logging_steps=max(1, settings.steps // 30), max_eval_samples=settings.eval_blocks,
        )  # fmt: skip

    return {
        (init, placement, lr, warmup): common.Spec(
            f"{init} init, {placement}-LN, lr {lr:g}, {warmup}",
            model_fields(settings, placement, settings.sweep_depth), training(lr, warmup), PREPARE[init],
            keep_model=False,
        )
        for init in INITS for placement in PLACEMENTS for lr in settings.learning_rates for warmup in WARMUPS
    }  # fmt: skip


def grad_norm_figure(session: common.Session, settings: Settings, grad_norms: dict) -> str:
    """The gradient norm of W2 per layer at initialisation, each set-up and depth."""
    fig, axes = common.figure(ncols=len(settings.depths), nrows=len(INITS), width=3.2, height=3.0)
    for row, init in enumerate(INITS):
        for ax, depth in zip(axes[row], settings.depths):
            for i, placement in enumerate(PLACEMENTS):
                norms = grad_norms[init, placement, depth]  # (seeds, L)
                for seed_norms in norms:
                    ax.plot(np.arange(depth), seed_norms, color=f"C{i}", alpha=0.25, lw=0.8)
                ax.plot(np.arange(depth), norms.mean(0), marker="o", ms=3, color=f"C{i}", label=f"{placement}-LN")
            ax.set(yscale="log", xlabel="layer (0 = nearest the input)", ylabel="‖∂L/∂W2‖ at init",
                   title=f"{init} init, {depth} layers")  # fmt: skip
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=7)
    return common.save_figure(fig, session, "grad_norm_at_init.png", "gradient norm of W2 per layer at init")


def loss_figure(session: common.Session, settings: Settings, trials: dict, baseline: float) -> str:
    """Final loss against learning rate, per set-up; and the training curves of the paper's set-up."""
    top = baseline + 0.5
    fig, axes = common.figure(ncols=len(INITS) + 1, width=4.6, height=3.8)
    x = np.log10(settings.learning_rates)
    for ax, init in zip(axes[0], INITS):
        for i, placement in enumerate(PLACEMENTS):
            for warmup, ls in zip(WARMUPS, ("-", "--")):
                row = [trials[init, placement, lr, warmup] for lr in settings.learning_rates]
                offset = (i - 1) * 0.03 + (0.01 if warmup == "warmup" else -0.01)  # keep error bars apart
                common.plot_mean_and_seeds(ax, x + offset, row, top=top, color=f"C{i}", ls=ls,
                                           label=f"{placement}-LN, {warmup}")  # fmt: skip
        ax.axhline(baseline, color="gray", ls=":", label=f"unigram loss {baseline:.2f}")
        ax.set(xticks=x, xticklabels=[f"{lr:g}" for lr in settings.learning_rates], xlabel="learning rate",
               ylabel="final validation loss (nats/char)", ylim=(None, top + 0.1),
               title=f"{INITS[init]}\n{settings.sweep_depth} layers, x = diverged")  # fmt: skip
        ax.legend(fontsize=6)
    ax = axes[0][-1]
    largest = settings.learning_rates[-1]
    for i, placement in enumerate(PLACEMENTS):
        for warmup, ls in zip(WARMUPS, ("-", "--")):
            common.plot_seed_curves(ax, trials["paper", placement, largest, warmup], f"C{i}", ls,
                                    label=f"{placement}-LN, {warmup}")  # fmt: skip
    ax.axhline(baseline, color="gray", ls=":", label="unigram loss")
    ax.set(xlabel="step", ylabel="training loss (nats/char)", title=f"paper set-up, lr {largest:g}: every seed")
    ax.set_ylim(top=max(4.5, baseline + 1))
    ax.legend(fontsize=6)
    return common.save_figure(
        fig, session, "loss_vs_lr.png", "final loss against learning rate, with and without warmup"
    )


def checks(settings: Settings, trials: dict, grad_norms: dict, failure: Failure) -> list[common.Check]:
    """The claim's parts, decided from the numbers (the paper's set-up)."""
    deepest = settings.depths[-1]
    ratio = {
        p: grad_norms["paper", p, deepest].mean(0)[-1] / grad_norms["paper", p, deepest].mean(0)[0] for p in PLACEMENTS
    }
    rates = settings.learning_rates
    paper = {key[1:]: t for key, t in trials.items() if key[0] == "paper"}  # (placement, lr, warmup) -> Trials
    fails, trains = failure.fails, failure.trains
    post_fails = [lr for lr in rates if fails(paper["post", lr, "no warmup"]) and trains(paper["pre", lr, "no warmup"])]
    rescued = [lr for lr in post_fails if trains(paper["post", lr, "warmup"])]
    pre_trains = [lr for lr in rates if trains(paper["pre", lr, "no warmup"])]
    post_trains = [lr for lr in rates if trains(paper["post", lr, "no warmup"])]

    def best(placement: str, warmup: str) -> common.Trials:
        finite = [paper[placement, lr, warmup] for lr in rates if np.isfinite(paper[placement, lr, warmup].mean)]
        return min(finite, key=lambda t: t.mean) if finite else paper[placement, rates[0], warmup]

    pre_best, post_best = best("pre", "no warmup"), best("post", "warmup")
    failures = failure.count
    return [
        common.Check(
            f"at initialisation, post-LN's ‖∂L/∂W2‖ grows toward the output ({deepest} layers: last/first > 2) while "
            "pre-LN's stays about the same in every layer (within 2x), as in the paper's Figure 3",
            bool(ratio["post"] > 2 and 0.5 < ratio["pre"] < 2),
            f"last/first layer, mean over seeds: post {ratio['post']:.3g}, pre {ratio['pre']:.3g}, sandwich "
            f"{ratio['sandwich']:.3g}",
        ),
        common.Check(
            "without warmup, post-LN fails at a learning rate where pre-LN trains (most seeds fail; every pre-LN seed "
            "trains)",
            bool(post_fails),
            f"at {', '.join(f'{lr:g}' for lr in post_fails) or 'no learning rate'}; post-LN without warmup: "
            + ", ".join(f"{lr:g} {failures(paper['post', lr, 'no warmup'])}" for lr in rates),
        ),
        common.Check(
            "warmup rescues post-LN at those learning rates (every seed trains)",
            bool(post_fails) and rescued == post_fails,
            (
                f"rescued at {', '.join(f'{lr:g}' for lr in rescued) or 'none'}; "
                if post_fails
                else "nothing to rescue; "
            )
            + "post-LN with warmup: "
            + ", ".join(f"{lr:g} {failures(paper['post', lr, 'warmup'])}" for lr in rates),
        ),
        common.Check(
            "pre-LN without warmup trains at every learning rate post-LN does, and reaches a lower loss than post-LN "
            "with warmup (best learning rate of each, beyond the seed-to-seed spread)",
            set(post_trains) <= set(pre_trains) and common.lower_beyond_spread(pre_best, post_best),
            f"pre-LN trains at {', '.join(f'{lr:g}' for lr in pre_trains) or 'none'}, post-LN at "
            f"{', '.join(f'{lr:g}' for lr in post_trains) or 'none'}; best: pre-LN no warmup {pre_best}, post-LN "
            f"warmup {post_best}, {common.spread_note(pre_best, post_best)}",
        ),
    ]


def loss_table(settings: Settings, trials: dict, failure: Failure, init: str) -> str:
    """Final validation loss of one set-up: a row per learning rate, a column per placement and warmup."""

    def cell(t: common.Trials) -> str:
        return f"{t}" + (f" ({failure.count(t)})" if t.count(failure.failed) else "")

    return common.markdown_table(
        ["learning rate"] + [f"{p}-LN {w}" for p in PLACEMENTS for w in WARMUPS],
        [
            [f"{lr:g}"] + [cell(trials[init, p, lr, w]) for p in PLACEMENTS for w in WARMUPS]
            for lr in settings.learning_rates
        ],
    )


def grad_table(settings: Settings, grad_norms: dict) -> str:
    return common.markdown_table(
        ["layers"] + [f"{init}: {p}-LN first / last" for init in INITS for p in PLACEMENTS],
        [
            [d] + [f"{g[0]:.3g} / {g[-1]:.3g}" for init in INITS for p in PLACEMENTS
                   for g in [grad_norms[init, p, d].mean(0)]]
            for d in settings.depths
        ],
    )  # fmt: skip


def toward(profile: np.ndarray) -> str:
    """Where a gradient-norm profile over the layers grows."""
    r = profile[-1] / profile[0]
    if 0.5 < r < 2:
        return "is about the same in every layer"
    return "grows toward the output" if r > 1 else "grows toward the input"


def discussion(session: common.Session, settings: Settings, trials: dict, grad_norms: dict, failure: Failure) -> str:
    deepest, baseline, n_seeds = settings.depths[-1], failure.baseline, len(session.seeds)
    seconds = sum(t.seconds for t in trials.values())
    profiles = {
        init: {p: grad_norms[init, p, deepest].mean(0) for p in ("post", "pre")} for init in INITS
    }  # fmt: skip
    return f"""A run *failed* when its loss became NaN/inf or its final validation loss ended less than
{FAILURE_MARGIN} nats below the unigram loss {baseline:.3f} (what a model that ignores the context achieves); a setting
*fails* when most of its {n_seeds} seeds failed and *trains* when none did. Cells are mean ± standard deviation over
the seeds. All {sum(len(t.runs) for t in trials.values())} runs took {seconds:.0f} s of training together.

Xiong et al. explain the claim by the gradients at initialisation: in post-LN the gradient of the parameters near the
output is large, so a full learning rate from step 0 takes destructive steps there, and warmup keeps the first steps
small until the model leaves that region; in pre-LN the gradient norm is the same in every layer. Measured at
{deepest} layers in the paper's set-up, post-LN's ‖∂L/∂W2‖ {toward(profiles["paper"]["post"])}
({profiles["paper"]["post"][0]:.3g} at the first layer, {profiles["paper"]["post"][-1]:.3g} at the last) and pre-LN's
{toward(profiles["paper"]["pre"])} ({profiles["paper"]["pre"][0]:.3g} to {profiles["paper"]["pre"][-1]:.3g}); with
decoderlab's initialisation post-LN's {toward(profiles["decoderlab"]["post"])}
({profiles["decoderlab"]["post"][0]:.3g} to {profiles["decoderlab"]["post"][-1]:.3g}) and pre-LN's
{toward(profiles["decoderlab"]["pre"])} ({profiles["decoderlab"]["pre"][0]:.3g} to
{profiles["decoderlab"]["pre"][-1]:.3g}). Adam normalises each parameter's step, so a larger gradient in one layer does
not by itself mean a larger update there. Rerun with `--learning_rates`, `--sweep_depth`, `--steps`,
`--warmup_steps`, `--max_grad_norm` or larger sizes to see where the boundaries lie."""


def setup_text(session: common.Session, settings: Settings, corpus: common.Corpus, grad_batches: int) -> str:
    clipping = (
        "no gradient clipping" if settings.max_grad_norm is None else f"gradient clipping at {settings.max_grad_norm}"
    )
    n_seeds = len(session.seeds)
    return f"""The original Transformer's decoder (`DecoderLabConfig.from_preset("vaswani")`: LayerNorm, sinusoidal
positions, ReLU MLP, tied embeddings) with {settings.hidden_size} hidden units and {settings.num_attention_heads}
heads, the norm placed pre, post or sandwich (post-LN has no final norm: every block ends in one). Two set-ups:
*paper*, as Xiong et al. analyse it: every projection Xavier-uniform with zero bias, token embeddings of std
1/sqrt(d) multiplied by sqrt(d) = {math.sqrt(settings.hidden_size):.3g} (unit scale); *decoderlab*, its default
initialisation: normal std 0.02 (embeddings too, so {0.02 * math.sqrt(settings.hidden_size):.2g} after the multiplier),
residual output projections scaled by 1/sqrt(2 x layers) as in GPT-2.
*Gradient norms at initialisation* (the paper's Figure 3): ‖∂L/∂W2‖ of each layer's second FFN matrix at
{", ".join(map(str, settings.depths))} layers, averaged over {grad_batches} training batches, for each of
{n_seeds} seeds (faint lines) and their mean. *Learning-rate sweep* at {settings.sweep_depth} layers: every
(set-up, placement, learning rate {", ".join(f"{lr:g}" for lr in settings.learning_rates)}) trained *with warmup* (linear over
{settings.warmup_steps} steps) and *without*, then constant, for {settings.steps} steps of batch
{settings.batch_size} x {settings.block_size} characters of Tiny Shakespeare; AdamW, weight decay 0.1, {clipping};
{n_seeds} seeds each (weights and data order); final validation loss on {len(corpus.eval_blocks)} validation
blocks."""


if __name__ == "__main__":
    main()
