"""Claim 3, norm placement (Xiong et al. 2020): post-LN is unstable in deep models without learning-rate warmup;
pre-LN is stable. Sandwich-LN (Ding et al. 2021) is measured beside them.

    python -m experiments.norm_placement            # about 10 minutes on 2 CPU cores
    python -m experiments.norm_placement --quick    # smoke test

Every placement (pre, post, sandwich) at every depth is trained twice from the same initial weights, with and
without warmup, at one learning rate and without gradient clipping (clipping hides exactly the large updates
the claim is about). Before training, the gradient norm of each layer is measured at initialisation.
"""

from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.ticker import MaxNLocator

from . import common

NAME = "norm_placement"
PLACEMENTS = ("pre", "post", "sandwich")
WARMUPS = ("warmup", "no warmup")
FAILURE_MARGIN = 0.1  # nats/char: a model this close to the unigram loss has learned next to nothing from the context


@dataclass(frozen=True)
class Settings:
    depths: tuple[int, ...] = (2, 6, 12, 24)
    hidden_size: int = 64
    num_attention_heads: int = 2
    block_size: int = 64
    batch_size: int = 16
    steps: int = 150
    warmup_steps: int = 50  # linear warmup of the "warmup" runs; then the learning rate stays constant
    learning_rate: float = 1e-3
    max_grad_norm: float | None = None  # no clipping
    # The paper's regime by default: weights ~ N(0, 1/hidden_size) (Xavier-like) and no down-scaled residual
    # projections. decoderlab's own defaults are 0.02 and true (GPT-2's scheme): pass them to see the difference.
    initializer_range: float | None = None  # None: 1/sqrt(hidden_size)
    scale_residual_init: bool = False
    eval_blocks: int = 128
    grad_batches: int = 4  # batches averaged for the gradient norms at initialisation


QUICK = Settings(
    depths=(1, 3), hidden_size=32, block_size=16, batch_size=4, steps=6, warmup_steps=3, eval_blocks=8, grad_batches=1
)


def layer_gradient_norms(model, batches: list[torch.Tensor]) -> np.ndarray:
    """(L,) the norm of the loss gradient with respect to each decoder layer's parameters, at the model's
    current weights, averaged over ``batches``."""
    device = next(model.parameters()).device
    model.train()
    norms = []
    for input_ids in batches:
        model.zero_grad(set_to_none=True)
        input_ids = input_ids.long().to(device)
        model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
        norms.append(
            [torch.cat([p.grad.flatten() for p in layer.parameters()]).norm().item() for layer in model.model.layers]
        )
    model.zero_grad(set_to_none=True)
    model.eval()
    return np.mean(norms, axis=0)


def unigram_entropy(blocks: torch.Tensor, vocab_size: int) -> float:
    """Entropy (nats) of the character frequencies: the loss of a model that ignores the context."""
    p = torch.bincount(blocks.flatten().long(), minlength=vocab_size).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def main(argv: list[str] | None = None) -> None:
    common.run_experiment(NAME, __doc__, Settings(), QUICK, run, argv)


def run(session: common.Session, settings: Settings) -> None:
    init_std = settings.initializer_range or settings.hidden_size**-0.5
    corpus = common.load_corpus(session, settings.block_size, settings.eval_blocks)
    baseline = unigram_entropy(corpus.train_blocks, corpus.vocab_size)
    recipes = {
        warmup: common.Recipe(
            steps=settings.steps, batch_size=settings.batch_size, learning_rate=settings.learning_rate,
            warmup_steps=settings.warmup_steps if warmup == "warmup" else 0, scheduler="constant_with_warmup",
            max_grad_norm=settings.max_grad_norm, log_every=max(1, settings.steps // 30), eval_samples=settings.eval_blocks,
        )
        for warmup in WARMUPS
    }  # fmt: skip
    grad_batches = list(corpus.train_blocks[: settings.grad_batches * settings.batch_size].split(settings.batch_size))

    grad_norms, runs = {}, {}
    for depth in settings.depths:
        for placement in PLACEMENTS:
            fields = dict(
                hidden_size=settings.hidden_size, num_hidden_layers=depth,
                num_attention_heads=settings.num_attention_heads, norm_placement=placement,
                initializer_range=init_std, scale_residual_init=settings.scale_residual_init,
            )  # fmt: skip
            model = common.fresh_model(corpus, fields, session.args.seed).to(session.device)
            grad_norms[placement, depth] = layer_gradient_norms(model, grad_batches)
            for warmup, recipe in recipes.items():
                name = f"{placement}-LN, {depth} layers, {warmup}"
                runs[placement, depth, warmup] = common.train_model(session, corpus, name, fields, recipe)
                runs[placement, depth, warmup].model = None  # keep only the numbers: 24 models add up

    def failed(run: common.Run) -> bool:
        """Diverged (NaN/inf) or ended within FAILURE_MARGIN of the context-free unigram loss (or above it)."""
        return run.diverged_by is not None or run.final_eval_loss >= baseline - FAILURE_MARGIN

    # final loss against depth
    fig, axes = common.figure(ncols=2, width=5.4, height=4.0)
    ax = axes[0][0]
    depths = np.array(settings.depths)
    x = np.arange(len(depths))  # depths evenly spaced, labelled below
    top = baseline + 0.6
    for i, placement in enumerate(PLACEMENTS):
        for warmup, style in zip(WARMUPS, ("-", "--")):
            losses = np.array([runs[placement, d, warmup].final_eval_loss for d in depths])
            shown = np.where(np.isfinite(losses), np.minimum(losses, top), top)
            ax.plot(x, shown, marker="o", ls=style, color=f"C{i}", label=f"{placement}-LN, {warmup}")
            bad = [failed(runs[placement, d, warmup]) for d in depths]
            ax.scatter(x[bad], shown[bad], marker="x", s=90, color="black", zorder=3)
    ax.axhline(baseline, color="gray", ls=":", label=f"unigram loss {baseline:.2f}")
    ax.set(xticks=x, xticklabels=[str(d) for d in depths], xlabel="layers",
           ylabel="final validation loss (nats/char)", ylim=(None, top + 0.1),
           title=f"after {settings.steps} steps at lr {settings.learning_rate:g} (x = failed)")  # fmt: skip
    ax.legend(fontsize=7, loc="upper left")
    ax = axes[0][1]
    deepest = settings.depths[-1]
    for i, placement in enumerate(PLACEMENTS):
        for warmup, style in zip(WARMUPS, ("-", "--")):
            curve = runs[placement, deepest, warmup].train_curve
            if curve:
                ax.plot(*zip(*curve), ls=style, color=f"C{i}", label=f"{placement}-LN, {warmup}")
    ax.axhline(baseline, color="gray", ls=":", label="unigram loss")
    ax.set(xlabel="step", ylabel="training loss (nats/char)", title=f"training curves, {deepest} layers")
    ax.set_ylim(top=max(4.5, baseline + 1))
    ax.legend(fontsize=7)
    loss_png = common.save_figure(fig, session, "loss_vs_depth.png", "final loss against depth and training curves")

    # gradient norm per layer at initialisation
    fig, axes = common.figure(ncols=len(settings.depths), width=3.4, height=3.4)
    for ax, depth in zip(axes[0], settings.depths):
        for i, placement in enumerate(PLACEMENTS):
            ax.plot(
                np.arange(depth), grad_norms[placement, depth], marker="o", ms=3, color=f"C{i}", label=f"{placement}-LN"
            )
        ax.set(yscale="log", xlabel="layer (0 = nearest the input)", ylabel="‖∂L/∂θ_layer‖ at init",
               title=f"{depth} layers")  # fmt: skip
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    grad_png = common.save_figure(fig, session, "grad_norm_at_init.png", "gradient norm per layer at initialisation")

    # the claim's parts, decided from the numbers
    deep = [d for d in settings.depths if d >= 6] or list(settings.depths[-1:])
    post_failed = [d for d in deep if failed(runs["post", d, "no warmup"])]
    post_rescued = [d for d in post_failed if not failed(runs["post", d, "warmup"])]
    pre_failed = [(d, w) for d in settings.depths for w in WARMUPS if failed(runs["pre", d, w])]
    warmup_gain = {
        d: runs["post", d, "no warmup"].final_eval_loss - runs["post", d, "warmup"].final_eval_loss for d in deep
    }
    ratio = lambda placement: grad_norms[placement, deepest][-1] / grad_norms[placement, deepest][0]  # last / first
    checks = [
        common.Check(
            f"without warmup, deep post-LN fails to train (at one or more of {', '.join(map(str, deep))} layers)",
            bool(post_failed),
            f"failed at {', '.join(map(str, post_failed)) or 'no depth'}; final losses "
            + ", ".join(f"{d}: {runs['post', d, 'no warmup'].final_eval_loss:.3f}" for d in deep),
        ),
        common.Check(
            "warmup fixes it (the same post-LN models train with warmup)",
            bool(post_failed) and post_rescued == post_failed,
            (f"rescued at {', '.join(map(str, post_rescued)) or 'no depth'}" if post_failed else "nothing to fix")
            + "; loss without minus with warmup "
            + ", ".join(f"{d}: {gain:+.3f}" for d, gain in warmup_gain.items()),
        ),
        common.Check(
            "pre-LN trains at every depth, with or without warmup",
            not pre_failed,
            "failed: " + (", ".join(f"{d} layers {w}" for d, w in pre_failed) if pre_failed else "none"),
        ),
        common.Check(
            f"at initialisation, post-LN's gradient norm grows toward the output ({deepest} layers: last/first > 2) "
            "while pre-LN's does not (< 2)",
            bool(ratio("post") > 2 and ratio("pre") < 2),
            f"last/first layer: post {ratio('post'):.3g}, pre {ratio('pre'):.3g}, sandwich {ratio('sandwich'):.3g}",
        ),
    ]

    header = ["layers"] + [f"{p}-LN {w}" for p in PLACEMENTS for w in WARMUPS]

    def cell(run: common.Run) -> str:
        if run.diverged_by is not None:
            return f"NaN by step {run.diverged_by}"
        return f"{run.final_eval_loss:.3f}" + (" (failed)" if failed(run) else "")

    loss_table = common.markdown_table(
        header, [[d] + [cell(runs[p, d, w]) for p in PLACEMENTS for w in WARMUPS] for d in settings.depths]
    )
    grad_table = common.markdown_table(
        ["layers"] + [f"{p}-LN {what}" for p in PLACEMENTS for what in ("first layer", "last layer")],
        [[d] + [float(grad_norms[p, d][i]) for p in PLACEMENTS for i in (0, -1)] for d in settings.depths],
    )
    seconds = sum(run.seconds for run in runs.values())
    clipping = (
        "no gradient clipping" if settings.max_grad_norm is None else f"gradient clipping at {settings.max_grad_norm}"
    )
    post_profile, pre_profile = grad_norms["post", deepest], grad_norms["pre", deepest]

    def toward(profile: np.ndarray) -> str:
        ratio = profile[-1] / profile[0]
        if 2 / 3 < ratio < 3 / 2:
            return "is nearly the same in every layer"
        return "grows toward the output" if ratio > 1 else "grows toward the input"

    init_note = (
        "These models use decoderlab's own initialisation (std 0.02, residual output projections scaled by "
        "1/sqrt(2 x layers) as in GPT-2), which keeps every residual branch small at the start."
        if settings.scale_residual_init
        else f"These models are initialised as in the paper's analysis (weights with std 1/sqrt(hidden_size) = "
        f"{init_std:.3g}, no down-scaled residual projections). decoderlab's own defaults (std 0.02, residual output "
        "projections scaled by 1/sqrt(2 x layers) as in GPT-2) keep every residual branch small at the start and can "
        "change the picture: rerun with `--initializer_range 0.02 --scale_residual_init true` to see it."
    )
    discussion = f"""A run *failed* when its loss became NaN/inf or its final validation loss ended less than
{FAILURE_MARGIN} nats below the unigram loss {baseline:.3f} (what a model that ignores the context achieves). All {len(runs)} runs took {seconds:.0f} s of
training together. {init_note}

Xiong et al. explain the claim by the gradients at initialisation: in post-LN the parameters near the output get
large gradients, so a full learning rate from step 0 takes destructive steps there, and warmup keeps the first
steps small until the model leaves that region; in pre-LN the gradients are well-behaved. Measured here at
{deepest} layers, post-LN's gradient norm {toward(post_profile)} ({post_profile[0]:.3g} at the first layer,
{post_profile[-1]:.3g} at the last) and pre-LN's {toward(pre_profile)} ({pre_profile[0]:.3g} to
{pre_profile[-1]:.3g}). Adam normalises each parameter's step, so a larger gradient in one layer does not by itself
mean a larger update there. Rerun with `--learning_rate`, `--steps`, `--warmup_steps`, `--max_grad_norm` or larger
sizes (`--hidden_size`, `--depths`) to see where the boundaries lie."""
    common.write_report(
        session,
        title="Norm placement: pre-LN, post-LN and sandwich-LN with and without warmup",
        claim=(
            "Post-LN Transformers are unstable when deep unless the learning rate is warmed up; pre-LN Transformers "
            "train stably without warmup (Xiong et al. 2020, On Layer Normalization in the Transformer Architecture)."
        ),
        setup=f"""Models with {settings.hidden_size} hidden units, {settings.num_attention_heads} heads, RoPE, RMSNorm,
SwiGLU, initialised with std {init_std:.3g}{" and GPT-2's residual scaling" if settings.scale_residual_init else ""}, at {", ".join(map(str, settings.depths))} layers, with `norm_placement` pre, post or sandwich (post-LN has
no final norm: every block ends in one). For each (placement, depth) one initialisation is trained twice:
*warmup*, the learning rate rising linearly to {settings.learning_rate:g} over {settings.warmup_steps} steps, and
*no warmup*, {settings.learning_rate:g} from step 0; both then constant for the rest of {settings.steps} steps of
batch {settings.batch_size} x {settings.block_size} characters of Tiny Shakespeare; AdamW, weight decay 0.1,
{clipping}. Final validation loss on {len(corpus.eval_blocks)} validation blocks. Gradient norms at
initialisation: the norm of the gradient of the loss with respect to all of one layer's parameters, averaged over
{len(grad_batches)} training batches.""",
        results=f"""{loss_png}

Final validation loss (nats/char):

{loss_table}

{grad_png}

Gradient norm at initialisation, first and last layer:

{grad_table}""",
        checks=checks,
        discussion=discussion,
        numbers={
            "unigram_loss": baseline,
            "runs": {", ".join(map(str, key)): {"final_eval_loss": r.final_eval_loss, "diverged_by": r.diverged_by,
                     "train_curve": r.train_curve, "seconds": r.seconds} for key, r in runs.items()},
            "grad_norm_at_init": {f"{p}, {d}": g.tolist() for (p, d), g in grad_norms.items()},
        },
    )  # fmt: skip
    session.log(f"wrote {session.output_dir / 'report.md'}")


if __name__ == "__main__":
    main()
