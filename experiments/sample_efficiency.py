"""Claim (the modded-nanogpt speedrun, Jordan et al. 2024): Muon and the speedrun's architecture switches each make
a language model learn more per token, so a recipe that takes them reaches a given validation loss on fewer tokens.

    python -m experiments.sample_efficiency --jobs 2 --threads 1   # about 34 minutes on 2 idle CPU cores
    python -m experiments.sample_efficiency --quick                 # smoke test

At ``make demo``'s shape (4 layers x 128, blocks of 64 characters, training/configs/shakespeare_char.yaml) each
switch is added alone to the recipe as it was before it took any (AdamW, SwiGLU, cosine schedule: ``BEFORE``), and
the recipe as it is now (the YAML file) runs beside them; every setting trains with 3 seeds and is scored by the
tokens it needs to reach validation loss ``--target_loss`` (1.70), and by its validation loss at the end. At
nanoGPT's GPU shape (6 x 384) the GPU recipe as it was and with the switches the demo recipe took run for a few
hundred steps, scored by the tokens they need to reach the old recipe's highest final loss over its seeds.
"""

import dataclasses
import math
import pathlib
from dataclasses import dataclass

import numpy as np
import yaml

from . import common

NAME = "sample_efficiency"
REVISION = "The first version of this experiment."
RECIPE = common.REPO_ROOT / "training" / "configs" / "shakespeare_char.yaml"
GPU_RECIPE = common.REPO_ROOT / "training" / "configs" / "shakespeare_char_gpu.yaml"
GOAL_RATIO = 1.3  # issue 46: the demo recipe's tokens to the target at least 1.3x fewer than before

# make demo's recipe as it was before issue 46 (commit 75f4f77): what each switch is added to
BEFORE_MODEL = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, position_embedding_type="rope", norm_type="rmsnorm",
    mlp_type="gated", hidden_act="silu", intermediate_size=256, qk_norm=True, tie_word_embeddings=False,
    hidden_dropout=0.0, attention_dropout=0.0, initializer_range=0.06, embedding_initializer_range=0.24,
    scale_residual_init=False,
)  # fmt: skip
BEFORE_TRAINING = dict(
    per_device_train_batch_size=16, max_train_steps=1250, learning_rate=2.6e-3, embedding_learning_rate=1.04e-2,
    lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, num_warmup_steps=100,
    weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, window_sampling="shifted",
)  # fmt: skip
# the GPU recipe as it was (training/configs/shakespeare_char_gpu.yaml at 75f4f77), at a CPU's batch and length
BEFORE_GPU_MODEL = dict(
    hidden_size=384, num_hidden_layers=6, num_attention_heads=6, position_embedding_type="rope", norm_type="rmsnorm",
    mlp_type="gated", hidden_act="silu", tie_word_embeddings=False, hidden_dropout=0.2, attention_dropout=0.0,
)  # fmt: skip
BEFORE_GPU_TRAINING = dict(
    learning_rate=1e-3, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
    weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, window_sampling="shifted",
)  # fmt: skip
# the TrainConfig fields a recipe file may set that shape its training (the rest: data, logging, checkpoints)
TRAINING_FIELDS = (
    "per_device_train_batch_size", "max_train_steps", "learning_rate", "embedding_learning_rate",
    "lr_scheduler_type", "lr_scheduler_kwargs", "num_warmup_steps", "weight_decay", "adam_beta1", "adam_beta2",
    "max_grad_norm", "window_sampling", "optimizer", "muon_learning_rate", "muon_momentum", "muon_nesterov",
    "muon_weight_decay", "muon_adjust_lr_fn", "muon_ns_steps",
)  # fmt: skip


@dataclass(frozen=True)
class Mechanism:
    label: str
    model: dict  # DecoderLabConfig fields
    options: dict  # TrainConfig fields


def mechanisms(settings) -> dict[str, Mechanism]:
    """Each switch, as the fields that turn it on (the WSD decay spans ``wsd_decay`` of the run's steps)."""
    wsd = {"decay_type": "linear", "min_lr_ratio": 0.1}
    return {
        "muon": Mechanism("Muon", {}, {"optimizer": "muon", "muon_learning_rate": settings.muon_learning_rate}),
        "relu2": Mechanism("ReLU²", {"hidden_act": "relu2"}, {}),
        "zero_init": Mechanism("zero-init o_proj, down_proj", {"zero_residual_init": True}, {}),
        "softcap": Mechanism(f"logit soft-cap {settings.softcap:g}", {"final_logit_softcapping": settings.softcap}, {}),
        "wsd": Mechanism("warmup-stable-decay", {}, {"lr_scheduler_type": "warmup_stable_decay", "wsd": wsd}),
        "value_residual": Mechanism("value residual", {"value_residual": True}, {}),
    }


@dataclass(frozen=True)
class Settings:
    target_loss: float = 1.70  # make demo's shape: tokens to this validation loss
    eval_every: int = 50  # steps between evaluations (make demo's shape)
    eval_stride: int = 8  # evaluations score every N-th validation block (218 of 1742 at block 64)
    mechanisms: tuple[str, ...] = ("muon", "relu2", "zero_init", "softcap", "wsd", "value_residual")
    muon_learning_rate: float = 0.02  # Muon alone at make demo's shape (the recipe row takes the recipe's own)
    softcap: float = 15.0
    wsd_decay: float = 0.4  # of the steps: modded-nanogpt's cooldown fraction
    wide_steps: int = 200  # 6 x 384: steps of each run
    wide_batch_size: int = 8
    wide_eval_every: int = 25
    wide_eval_stride: int = 16
    wide_settings: tuple[str, ...] = ("recipe",)  # besides the GPU recipe as it was (a Muon run costs 2.2x here)
    # sizes: None takes the recipes' own (the quick run shrinks them)
    hidden_size: int | None = None
    wide_hidden_size: int | None = None
    num_hidden_layers: int | None = None
    steps: int | None = None
    batch_size: int | None = None
    block_size: int = 64


QUICK = Settings(
    eval_every=2, eval_stride=64, mechanisms=("muon", "wsd", "value_residual"), wide_steps=4, wide_batch_size=2,
    wide_eval_every=2, wide_eval_stride=64, wide_settings=("muon",), hidden_size=32, wide_hidden_size=48,
    num_hidden_layers=2, steps=6, batch_size=4, block_size=16,
)  # fmt: skip


def recipe_file(path: pathlib.Path) -> tuple[dict, dict]:
    """(model fields, training fields) of a recipe YAML, the training fields limited to ``TRAINING_FIELDS``."""
    values = yaml.safe_load(path.read_text(encoding="utf-8"))
    return dict(values.get("model") or {}), {k: values[k] for k in TRAINING_FIELDS if k in values}


def shrink(model: dict, options: dict, settings: Settings, wide: bool) -> tuple[dict, dict]:
    """The sizes ``settings`` override (the quick run's), applied to a setting's fields."""
    hidden = settings.wide_hidden_size if wide else settings.hidden_size
    model, options = dict(model), dict(options)
    if hidden is not None:
        heads = model.get("num_attention_heads", 4)
        model.update(hidden_size=hidden, num_attention_heads=min(heads, 2), intermediate_size=2 * hidden)
    if settings.num_hidden_layers is not None:
        model["num_hidden_layers"] = settings.num_hidden_layers
    if not wide and settings.steps is not None:
        kwargs = dict(options.get("lr_scheduler_kwargs") or {})
        if "num_decay_steps" in kwargs:  # a recipe's WSD decay, in steps: the same fraction of the shorter run
            kwargs["num_decay_steps"] = max(1, kwargs["num_decay_steps"] * settings.steps // options["max_train_steps"])
            options["lr_scheduler_kwargs"] = kwargs
        options["max_train_steps"] = settings.steps
        options["num_warmup_steps"] = min(options.get("num_warmup_steps", 0), settings.steps // 3)
    if not wide and settings.batch_size is not None:
        options["per_device_train_batch_size"] = settings.batch_size
    return model, options


def spec(name: str, model: dict, options: dict, settings: Settings, wide: bool) -> common.Spec:
    """A trained setting: ``options`` (TrainConfig fields) over the shape's evaluation plan; the WSD decay is sized
    to the run's steps here (transformers' get_wsd_schedule takes it in steps)."""
    options = dict(options)
    steps, batch = options.pop("max_train_steps"), options.pop("per_device_train_batch_size")
    wsd = options.pop("wsd", None)
    if wsd is not None:
        options["lr_scheduler_kwargs"] = {"num_decay_steps": max(1, round(settings.wsd_decay * steps)), **wsd}
    recipe = common.Recipe(
        steps=steps, batch_size=batch, learning_rate=options.pop("learning_rate"),
        warmup_steps=options.pop("num_warmup_steps", 0), scheduler=options.pop("lr_scheduler_type"),
        max_grad_norm=options.pop("max_grad_norm", 1.0), log_every=settings.wide_eval_every if wide else settings.eval_every,
        eval_every=settings.wide_eval_every if wide else settings.eval_every, eval_samples=10**9,
        window_sampling=options.pop("window_sampling", "blocks"), options=options,
    )  # fmt: skip
    return common.Spec(name, model, recipe, keep_model=False)


def tokens_to(run: common.Run, target: float, tokens_per_step: int) -> float:
    """Tokens at which ``run``'s validation curve first reaches ``target``, linearly interpolated between the two
    evaluations around the crossing; NaN when it never does (or diverged)."""
    points = [(0, math.inf)] + [(step * tokens_per_step, loss) for step, loss in run.eval_curve]
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if l1 <= target:
            if not math.isfinite(l0):
                return float(t1)
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return math.nan


def main(argv: list[str] | None = None) -> None:
    common.run_experiment(NAME, __doc__, Settings(), QUICK, run, argv)


def run(session: common.Session, settings: Settings) -> None:
    unknown = sorted(set(settings.mechanisms) - set(mechanisms(settings)))
    if unknown:
        raise ValueError(f"--mechanisms names {unknown}; choose from {sorted(mechanisms(settings))}.")
    corpus = common.load_corpus(session, settings.block_size, 10**9)
    corpus = dataclasses.replace(corpus, eval_blocks=corpus.eval_blocks[:: settings.eval_stride])
    wide_corpus = dataclasses.replace(corpus, eval_blocks=corpus.eval_blocks[:: settings.wide_eval_stride])
    switches = mechanisms(settings)

    # make demo's shape: the recipe before, each switch added alone, the recipe now
    demo = {"before": spec("recipe before (AdamW)", *shrink(BEFORE_MODEL, BEFORE_TRAINING, settings, False),
                           settings, False)}  # fmt: skip
    for key in settings.mechanisms:
        m = switches[key]
        fields = shrink({**BEFORE_MODEL, **m.model}, {**BEFORE_TRAINING, **m.options}, settings, False)
        demo[key] = spec(m.label, *fields, settings, False)
    now_model, now_training = recipe_file(RECIPE)
    demo["recipe"] = spec("recipe now", *shrink(now_model, {**BEFORE_TRAINING, **now_training}, settings, False),
                          settings, False)  # fmt: skip
    demo_runs = common.train_all(session, corpus, demo)
    session.log("make demo's shape done")

    # nanoGPT's GPU shape, a few hundred steps at a CPU's batch
    wide_options = dict(BEFORE_GPU_TRAINING, max_train_steps=settings.wide_steps,
                        per_device_train_batch_size=settings.wide_batch_size, num_warmup_steps=settings.wide_steps // 10)  # fmt: skip
    gpu_model, gpu_training = recipe_file(GPU_RECIPE)
    wide = {"before": spec("GPU recipe before (AdamW)", *shrink(BEFORE_GPU_MODEL, wide_options, settings, True),
                           settings, True)}  # fmt: skip
    for key in settings.wide_settings:
        if key == "recipe":  # the GPU recipe's model and optimizer now, at the same CPU batch and length
            kept = ("per_device_train_batch_size", "max_train_steps", "num_warmup_steps", "window_sampling")
            switched = {k: v for k, v in gpu_training.items() if k not in kept}
            if switched.get("lr_scheduler_type") == "warmup_stable_decay":  # its decay as a fraction of these steps
                kwargs = switched.pop("lr_scheduler_kwargs")
                switched["wsd"] = {k: v for k, v in kwargs.items() if k != "num_decay_steps"}
            fields = shrink({**BEFORE_GPU_MODEL, **gpu_model}, {**wide_options, **switched}, settings, True)
            wide[key] = spec("GPU recipe now", *fields, settings, True)
        else:
            m = switches[key]
            fields = shrink({**BEFORE_GPU_MODEL, **m.model}, {**wide_options, **m.options}, settings, True)
            wide[key] = spec(m.label, *fields, settings, True)
    wide_runs = common.train_all(session, wide_corpus, wide)
    session.log("6 x 384 done")

    # tokens to the targets, per seed
    def per_token(specs, runs, target):
        out = {}
        for key, trials in runs.items():
            recipe = specs[key].recipe
            per_step = recipe.batch_size * settings.block_size
            out[key] = np.array([tokens_to(r, target, per_step) for r in trials.runs])
        return out

    demo_tokens = per_token(demo, demo_runs, settings.target_loss)
    # the highest final loss of the old recipe's seeds: a loss every one of them reaches
    wide_target = float(np.max([r.final_eval_loss for r in wide_runs["before"].runs]))
    wide_tokens = per_token(wide, wide_runs, wide_target)
    write(session, settings, demo, demo_runs, demo_tokens, wide, wide_runs, wide_tokens, wide_target, corpus,
          wide_corpus)  # fmt: skip


def fewer_tokens(tokens: dict, key: str, base: str = "before") -> bool:
    """``key`` reached the target on fewer tokens than ``base`` beyond the seed-to-seed spread (every seed reached
    it)."""
    a, b = tokens[key], tokens[base]
    return bool(np.all(np.isfinite(a)) and np.all(np.isfinite(b)) and common.lower_beyond_spread(a, b))


def ratio(tokens: dict, key: str, base: str = "before") -> float:
    """Mean tokens of ``base`` over mean tokens of ``key`` (NaN when a seed never reached the target)."""
    return float(np.mean(tokens[base]) / np.mean(tokens[key]))


def token_gap(a: np.ndarray, b: np.ndarray) -> str:
    """``common.spread_note`` in thousands of tokens: 'gap +204k vs spread 41k'."""
    return f"gap {(np.mean(b) - np.mean(a)) / 1e3:+,.0f}k vs spread {(common.spread(a) + common.spread(b)) / 1e3:,.0f}k"


def tokens_text(values: np.ndarray) -> str:
    if not np.all(np.isfinite(values)):
        return f"not reached by {int(np.sum(~np.isfinite(values)))} of {len(values)} seeds"
    if values.mean() < 1e4:  # the quick run's
        return f"{values.mean():,.0f} ± {common.spread(values):,.0f}"
    return f"{values.mean() / 1e3:,.0f}k ± {common.spread(values) / 1e3:,.0f}k"


def write(session, settings, demo, demo_runs, demo_tokens, wide, wide_runs, wide_tokens, wide_target, corpus,
          wide_corpus) -> None:  # fmt: skip
    # figures: validation loss against tokens (mean over seeds), each shape; tokens to the target
    fig, axes = common.figure(ncols=3, width=4.8, height=3.8)
    for ax, specs, runs, target, title in (
        (axes[0][0], demo, demo_runs, settings.target_loss, "make demo's shape (4 x 128)"),
        (axes[0][1], wide, wide_runs, wide_target, "6 x 384, a CPU's batch"),
    ):
        for i, (key, trials) in enumerate(runs.items()):
            per_step = specs[key].recipe.batch_size * settings.block_size
            curves = [[(s * per_step / 1e6, loss) for s, loss in run.eval_curve] for run in trials.runs if run.eval_curve]
            if not curves:
                continue
            reached = min(len(c) for c in curves)
            x = [t for t, _ in curves[0][:reached]]
            y = np.mean([[loss for _, loss in c[:reached]] for c in curves], axis=0)
            style = dict(lw=2.2, color="black") if key in ("before", "recipe") else dict(lw=1.0, color=f"C{i}")
            ax.plot(x, y, ls="--" if key == "before" else "-", label=trials.name, **style)
        ax.axhline(target, color="grey", lw=0.8, ls=":")
        low = min(min(loss for _, loss in run.eval_curve) for t in runs.values() for run in t.runs if run.eval_curve)
        ax.set(xlabel="training tokens (millions)", ylabel="validation loss (nats/char)", title=title,
               ylim=(low - 0.03, target + 0.45))  # fmt: skip
        ax.legend(fontsize=7)
    ax = axes[0][2]
    keys = [k for k in demo_runs if k != "before"]
    ratios = [ratio(demo_tokens, k) for k in keys]
    ax.barh([demo_runs[k].name for k in keys], ratios, color=["C3" if k == "recipe" else "C0" for k in keys])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(GOAL_RATIO, color="grey", lw=0.8, ls=":")
    ax.set(xlabel=f"tokens to {settings.target_loss} of the recipe before / this one's", title="fewer tokens: > 1")
    curves_png = common.save_figure(fig, session, "tokens_to_target.png",
                                    "validation loss against training tokens, and tokens to the target")  # fmt: skip

    def table(specs, runs, tokens, target):
        rows = []
        for key, trials in runs.items():
            finals = np.array([run.final_eval_loss for run in trials.runs])
            rows.append([trials.name, tokens_text(tokens[key]), "1" if key == "before" else f"{ratio(tokens, key):.2f}",
                         common.mean_pm(finals), f"{trials.seconds / len(trials.runs):.0f}"])  # fmt: skip
        return common.markdown_table(
            ["setting", f"tokens to {target:.3f}", "fewer tokens than before (x)", "final validation loss",
             "train time per run (s)"], rows,
        )  # fmt: skip

    checks = []
    for key in settings.mechanisms:
        checks.append(common.Check(
            f"{demo_runs[key].name} alone reaches {settings.target_loss} on fewer tokens than the recipe before it "
            "(beyond the seed-to-seed spread)",
            fewer_tokens(demo_tokens, key),
            f"{tokens_text(demo_tokens[key])} vs {tokens_text(demo_tokens['before'])} tokens "
            f"({ratio(demo_tokens, key):.2f}x; {token_gap(demo_tokens[key], demo_tokens['before'])})",
        ))  # fmt: skip
    checks.append(common.Check(
        f"the recipe now (training/configs/shakespeare_char.yaml) reaches {settings.target_loss} on at least "
        f"{GOAL_RATIO}x fewer tokens than the recipe before (issue 46's goal)",
        bool(ratio(demo_tokens, "recipe") >= GOAL_RATIO and fewer_tokens(demo_tokens, "recipe")),
        f"{tokens_text(demo_tokens['recipe'])} vs {tokens_text(demo_tokens['before'])} tokens "
        f"({ratio(demo_tokens, 'recipe'):.2f}x)",
    ))  # fmt: skip
    for key in wide_runs:
        if key != "before":
            checks.append(common.Check(
                f"at 6 x 384, {wide_runs[key].name} reaches the old GPU recipe's final loss ({wide_target:.3f}) on fewer "
                "tokens than the GPU recipe before (beyond the seed-to-seed spread)",
                fewer_tokens(wide_tokens, key),
                f"{tokens_text(wide_tokens[key])} vs {tokens_text(wide_tokens['before'])} tokens "
                f"({ratio(wide_tokens, key):.2f}x)",
            ))  # fmt: skip

    before = demo["before"].recipe
    now = demo["recipe"].recipe
    setup = f"""*make demo's shape*: the recipe as it was before issue 46 (`BEFORE_MODEL`, `BEFORE_TRAINING` in the
script: 4 layers x 128, SwiGLU with SiLU, QK-norm, AdamW at {before.learning_rate} with the token embeddings at
{before.options.get('embedding_learning_rate')}, cosine to 10% after {before.warmup_steps} warm-up steps,
{before.steps} steps of {before.batch_size} windows of {settings.block_size} characters, cut at a new offset each
pass), then the same with one switch each: {", ".join(demo_runs[k].name for k in settings.mechanisms)}; Muon (the
blocks' matrices; AdamW keeps the embeddings, head, norms) at {settings.muon_learning_rate}, WSD's linear decay over
the last {settings.wsd_decay:.0%} of the steps to 10%. *Recipe now*: `training/configs/shakespeare_char.yaml` as
committed ({now.steps} steps of {now.batch_size}). Validation loss every {settings.eval_every} steps on every
{settings.eval_stride}th validation block ({len(corpus.eval_blocks)} blocks of {settings.block_size}; Tiny
Shakespeare's last 10%); tokens to {settings.target_loss}: linear between the two evaluations around the crossing.
*6 x 384*: nanoGPT's GPU shape with the GPU recipe's AdamW settings and dropout 0.2, {settings.wide_steps} steps of
{settings.wide_batch_size} windows of {settings.block_size} (a CPU's budget, not the GPU recipe's batch of 64 x 256),
{settings.wide_steps // 10} warm-up steps; validation every {settings.wide_eval_every} steps on every
{settings.wide_eval_stride}th block ({len(wide_corpus.eval_blocks)} blocks); the target is the old recipe's highest
final loss. Every setting: {len(session.seeds)} seeds (weights and data order)."""
    results = f"""{curves_png}

make demo's shape, tokens to {settings.target_loss}:

{table(demo, demo_runs, demo_tokens, settings.target_loss)}

6 x 384, tokens to the old GPU recipe's highest final loss (every seed of it reaches it):

{table(wide, wide_runs, wide_tokens, wide_target)}"""
    discussion = """**Why tokens.** Tokens to a loss do not depend on the machine or its load, so a CPU's count carries to a
GPU at the same shape and batch; a step's time does not (Muon's Newton-Schulz products cost a CPU much more, next
to a small batch's forward and backward, than a GPU running the speedrun's 500k-token steps). The wall time of the
recipes is measured by `python -m benchmarks.sample_efficiency`, which runs this experiment and times both recipes,
interleaved. **Scale.** These are models of 0.6M and 10.6M parameters on a 1M-character corpus, a few hundred to a
thousand steps: a switch that helps GPT-2 small on FineWeb need not help here, and one that does not help here may
still help there."""

    def numbers(runs, tokens, specs):
        return {key: {"name": t.name, "tokens": tokens[key].tolist(),
                      "final_eval_losses": [r.final_eval_loss for r in t.runs],
                      "curves": [[(s * specs[key].recipe.batch_size * settings.block_size, loss) for s, loss in r.eval_curve]
                                 for r in t.runs],
                      "seconds": [r.seconds for r in t.runs], "steps": specs[key].recipe.steps,
                      "batch_size": specs[key].recipe.batch_size}
                for key, t in runs.items()}  # fmt: skip

    common.write_report(
        session,
        title="Learning more per token: Muon and the speedrun's switches",
        claim=(
            "Muon, ReLU², zero-initialised residual projections, logit soft-capping, a warmup-stable-decay schedule "
            "and a value residual each let a small language model reach a given validation loss on fewer tokens "
            "(the modded-nanogpt speedrun, where together they cut GPT-2 small's tokens to 3.28 several-fold)."
        ),
        setup=setup,
        results=results,
        checks=checks,
        discussion=discussion,
        revision=REVISION,
        numbers={"target_loss": settings.target_loss, "wide_target_loss": wide_target,
                 "block_size": settings.block_size, "demo": numbers(demo_runs, demo_tokens, demo),
                 "wide": numbers(wide_runs, wide_tokens, wide)},  # fmt: skip
    )
    session.log(f"wrote {session.output_dir / 'report.md'}")


if __name__ == "__main__":
    main()
