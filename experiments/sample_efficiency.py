"""Claim (the modded-nanogpt speedrun, Jordan et al. 2024): Muon and the speedrun's architecture switches each make
a language model learn more per token, so a recipe that takes them reaches a given validation loss on fewer tokens.

    python -m experiments.sample_efficiency --jobs 2 --threads 1   # about 34 minutes on 2 idle CPU cores
    python -m experiments.sample_efficiency --quick                 # smoke test

At ``make demo``'s shape (4 layers x 128, blocks of 64 characters) each switch is added alone to the recipe as it was
before it took any (AdamW, SwiGLU, cosine schedule: training/configs/shakespeare_char_adamw.yaml), and the recipe as
it is now (training/configs/shakespeare_char.yaml) runs beside them; every setting trains with 3 seeds and is scored
by the tokens it needs to reach validation loss ``--target_loss`` (1.70), and by its validation loss at the end. At
nanoGPT's GPU shape (6 x 384) the GPU recipe as it was (training/configs/shakespeare_char_gpu_adamw.yaml) and with
the switches the demo recipe took run for a few hundred steps at a CPU's batch, scored by the tokens they need to
reach the old recipe's highest final loss over its seeds.
"""

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from . import common

NAME = "sample_efficiency"
REVISION = "The first version of this experiment."
CONFIGS = common.REPO_ROOT / "training" / "configs"
RECIPE = CONFIGS / "shakespeare_char.yaml"  # make demo's recipe now
ADAMW_RECIPE = CONFIGS / "shakespeare_char_adamw.yaml"  # make demo's recipe before Muon: what each switch is added to
GPU_RECIPE = CONFIGS / "shakespeare_char_gpu.yaml"
GPU_ADAMW_RECIPE = CONFIGS / "shakespeare_char_gpu_adamw.yaml"  # the GPU recipe before Muon
GOAL_RATIO = 1.3  # the goal the demo recipe was changed for: the target on at least 1.3x fewer tokens than before
# the GPU recipe's fields that stay the shrunk old recipe's when its optimisation now is compared at a CPU's budget
WIDE_KEPT = ("per_device_train_batch_size", "max_train_steps", "num_warmup_steps", "window_sampling")


@dataclass(frozen=True)
class Mechanism:
    label: str
    model: dict  # DecoderLabConfig fields
    training: dict  # TrainConfig fields


def mechanisms(settings) -> dict[str, Mechanism]:
    """Each switch, as the fields that turn it on (the WSD decay spans ``wsd_decay`` of the run's steps: ``spec``)."""
    wsd = {
        "lr_scheduler_type": "warmup_stable_decay",
        "lr_scheduler_kwargs": {"decay_type": "linear", "min_lr_ratio": 0.1},
    }
    return {
        "muon": Mechanism("Muon", {}, {"optimizer": "muon", "muon_learning_rate": settings.muon_learning_rate}),
        "relu2": Mechanism("ReLU²", {"hidden_act": "relu2"}, {}),
        "zero_init": Mechanism("zero-init o_proj, down_proj", {"zero_residual_init": True}, {}),
        "softcap": Mechanism(f"logit soft-cap {settings.softcap:g}", {"final_logit_softcapping": settings.softcap}, {}),
        "wsd": Mechanism("warmup-stable-decay", {}, wsd),
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


def shrink(model: dict, training: dict, settings: Settings, wide: bool) -> tuple[dict, dict]:
    """The sizes ``settings`` override (the quick run's), applied to a setting's fields."""
    hidden = settings.wide_hidden_size if wide else settings.hidden_size
    model, training = dict(model), dict(training)
    if hidden is not None:
        heads = model.get("num_attention_heads", 4)
        model.update(hidden_size=hidden, num_attention_heads=min(heads, 2), intermediate_size=2 * hidden)
    if settings.num_hidden_layers is not None:
        model["num_hidden_layers"] = settings.num_hidden_layers
    if not wide and settings.steps is not None:
        kwargs = dict(training.get("lr_scheduler_kwargs") or {})
        if "num_decay_steps" in kwargs:  # a recipe's WSD decay, in steps: the same fraction of the shorter run
            kwargs["num_decay_steps"] = max(
                1, kwargs["num_decay_steps"] * settings.steps // training["max_train_steps"]
            )
            training["lr_scheduler_kwargs"] = kwargs
        training["max_train_steps"] = settings.steps
        training["num_warmup_steps"] = min(training.get("num_warmup_steps", 0), settings.steps // 3)
    if not wide and settings.batch_size is not None:
        training["per_device_train_batch_size"] = settings.batch_size
    return model, training


def spec(name: str, model: dict, training: dict, settings: Settings, wide: bool) -> common.Spec:
    """A trained setting: ``training`` (TrainConfig fields) with the shape's evaluation plan. A warmup-stable-decay
    schedule that names no ``num_decay_steps`` decays over ``wsd_decay`` of the run's steps (transformers'
    get_wsd_schedule takes the decay in steps)."""
    training = dict(training)
    kwargs = training.get("lr_scheduler_kwargs") or {}
    if training.get("lr_scheduler_type") == "warmup_stable_decay" and "num_decay_steps" not in kwargs:
        decay = max(1, round(settings.wsd_decay * training["max_train_steps"]))
        training["lr_scheduler_kwargs"] = {"num_decay_steps": decay, **kwargs}
    every = settings.wide_eval_every if wide else settings.eval_every
    training.update(logging_steps=every, eval_steps=every, max_eval_samples=10**9)  # every eval block, every time
    return common.Spec(name, model, training, keep_model=False)


def specs_at_demo_shape(settings: Settings) -> dict[str, common.Spec]:
    """make demo's shape: the recipe before, each switch added alone to it, the recipe now."""
    switches = mechanisms(settings)
    before_model, before_training = common.recipe(ADAMW_RECIPE)
    specs = {"before": spec("recipe before (AdamW)", *shrink(before_model, before_training, settings, False),
                            settings, False)}  # fmt: skip
    for key in settings.mechanisms:
        m = switches[key]
        fields = shrink({**before_model, **m.model}, {**before_training, **m.training}, settings, False)
        specs[key] = spec(m.label, *fields, settings, False)
    specs["recipe"] = spec("recipe now", *shrink(*common.recipe(RECIPE), settings, False), settings, False)
    return specs


def specs_at_gpu_shape(settings: Settings) -> dict[str, common.Spec]:
    """nanoGPT's GPU shape, a few hundred steps at a CPU's batch: the GPU recipe before, and with the switches in
    ``wide_settings`` (``recipe``: its model and optimisation now)."""
    switches = mechanisms(settings)
    before_model, before_training = common.recipe(GPU_ADAMW_RECIPE)
    before_training.update(max_train_steps=settings.wide_steps, per_device_train_batch_size=settings.wide_batch_size,
                           num_warmup_steps=settings.wide_steps // 10)  # fmt: skip
    specs = {"before": spec("GPU recipe before (AdamW)", *shrink(before_model, before_training, settings, True),
                            settings, True)}  # fmt: skip
    for key in settings.wide_settings:
        if key == "recipe":  # the GPU recipe's model and optimizer now, at the same CPU batch and length
            gpu_model, gpu_training = common.recipe(GPU_RECIPE)
            switched = {k: v for k, v in gpu_training.items() if k not in WIDE_KEPT}
            if switched["lr_scheduler_type"] == "warmup_stable_decay":  # its decay as a fraction of these steps
                switched["lr_scheduler_kwargs"] = {
                    k: v for k, v in switched["lr_scheduler_kwargs"].items() if k != "num_decay_steps"
                }
            fields = shrink({**before_model, **gpu_model}, {**before_training, **switched}, settings, True)
            specs[key] = spec("GPU recipe now", *fields, settings, True)
        else:
            m = switches[key]
            fields = shrink({**before_model, **m.model}, {**before_training, **m.training}, settings, True)
            specs[key] = spec(m.label, *fields, settings, True)
    return specs


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


def tokens_per_step(spec: common.Spec, settings: Settings) -> int:
    return spec.training["per_device_train_batch_size"] * settings.block_size


def per_token(specs: dict, runs: dict, target: float, settings: Settings) -> dict:
    """key -> (seeds,) tokens each seed's run needed to reach ``target``."""
    return {
        key: np.array([tokens_to(r, target, tokens_per_step(specs[key], settings)) for r in trials.runs])
        for key, trials in runs.items()
    }


@dataclass
class Shape:
    """One shape's settings, their runs and tokens to its target."""

    title: str
    specs: dict
    runs: dict
    tokens: dict
    target: float
    corpus: common.Corpus


def main(argv: list[str] | None = None) -> None:
    common.run_experiment(NAME, __doc__, Settings(), QUICK, run, argv)


def run(session: common.Session, settings: Settings) -> None:
    unknown = sorted(set(settings.mechanisms) - set(mechanisms(settings)))
    if unknown:
        raise ValueError(f"--mechanisms names {unknown}; choose from {sorted(mechanisms(settings))}.")
    corpus = common.load_corpus(session, settings.block_size, 10**9)
    corpus = dataclasses.replace(corpus, eval_blocks=corpus.eval_blocks[:: settings.eval_stride])
    wide_corpus = dataclasses.replace(corpus, eval_blocks=corpus.eval_blocks[:: settings.wide_eval_stride])

    demo_specs = specs_at_demo_shape(settings)
    demo_runs = common.train_all(session, corpus, demo_specs)
    session.log("make demo's shape done")
    wide_specs = specs_at_gpu_shape(settings)
    wide_runs = common.train_all(session, wide_corpus, wide_specs)
    session.log("6 x 384 done")

    # tokens to the targets, per seed; at 6 x 384 the old recipe's highest final loss, which each of its seeds reaches
    wide_target = float(np.max([r.final_eval_loss for r in wide_runs["before"].runs]))
    demo = Shape("make demo's shape (4 x 128)", demo_specs, demo_runs,
                 per_token(demo_specs, demo_runs, settings.target_loss, settings), settings.target_loss, corpus)  # fmt: skip
    wide = Shape("6 x 384, a CPU's batch", wide_specs, wide_runs,
                 per_token(wide_specs, wide_runs, wide_target, settings), wide_target, wide_corpus)  # fmt: skip
    write(session, settings, demo, wide)


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


def write(session: common.Session, settings: Settings, demo: Shape, wide: Shape) -> None:
    results = f"""{figure(session, settings, demo, wide)}

make demo's shape, tokens to {settings.target_loss}:

{table(demo)}

6 x 384, tokens to the old GPU recipe's highest final loss (every seed of it reaches it):

{table(wide)}"""
    common.write_report(
        session,
        title="Learning more per token: Muon and the speedrun's switches",
        claim=(
            "Muon, ReLU², zero-initialised residual projections, logit soft-capping, a warmup-stable-decay schedule "
            "and a value residual each let a small language model reach a given validation loss on fewer tokens "
            "(the modded-nanogpt speedrun, where together they cut GPT-2 small's tokens to 3.28 several-fold)."
        ),
        setup=setup_text(session, settings, demo, wide),
        results=results,
        checks=checks(settings, demo, wide),
        discussion=DISCUSSION,
        revision=REVISION,
        numbers={
            "target_loss": settings.target_loss,
            "wide_target_loss": wide.target,
            "block_size": settings.block_size,
            "demo": numbers(settings, demo),
            "wide": numbers(settings, wide),
        },  # fmt: skip
    )
    session.log(f"wrote {session.output_dir / 'report.md'}")


def figure(session: common.Session, settings: Settings, demo: Shape, wide: Shape) -> str:
    """Validation loss against tokens (mean over seeds) at each shape; tokens to the target against the recipe
    before's."""
    fig, axes = common.figure(ncols=3, width=4.8, height=3.8)
    for ax, shape in zip(axes[0], (demo, wide)):
        for i, (key, trials) in enumerate(shape.runs.items()):
            per_step = tokens_per_step(shape.specs[key], settings)
            curves = [
                [(s * per_step / 1e6, loss) for s, loss in run.eval_curve] for run in trials.runs if run.eval_curve
            ]
            if not curves:
                continue
            reached = min(len(c) for c in curves)
            x = [t for t, _ in curves[0][:reached]]
            y = np.mean([[loss for _, loss in c[:reached]] for c in curves], axis=0)
            style = dict(lw=2.2, color="black") if key in ("before", "recipe") else dict(lw=1.0, color=f"C{i}")
            ax.plot(x, y, ls="--" if key == "before" else "-", label=trials.name, **style)
        ax.axhline(shape.target, color="grey", lw=0.8, ls=":")
        low = min(
            min(loss for _, loss in run.eval_curve) for t in shape.runs.values() for run in t.runs if run.eval_curve
        )
        ax.set(xlabel="training tokens (millions)", ylabel="validation loss (nats/char)", title=shape.title,
               ylim=(low - 0.03, shape.target + 0.45))  # fmt: skip
        ax.legend(fontsize=7)
    ax = axes[0][2]
    keys = [k for k in demo.runs if k != "before"]
    ratios = [ratio(demo.tokens, k) for k in keys]
    ax.barh([demo.runs[k].name for k in keys], ratios, color=["C3" if k == "recipe" else "C0" for k in keys])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(GOAL_RATIO, color="grey", lw=0.8, ls=":")
    ax.set(xlabel=f"tokens to {settings.target_loss} of the recipe before / this one's", title="fewer tokens: > 1")
    return common.save_figure(fig, session, "tokens_to_target.png",
                              "validation loss against training tokens, and tokens to the target")  # fmt: skip


def table(shape: Shape) -> str:
    rows = []
    for key, trials in shape.runs.items():
        finals = np.array([run.final_eval_loss for run in trials.runs])
        rows.append([trials.name, tokens_text(shape.tokens[key]),
                     "1" if key == "before" else f"{ratio(shape.tokens, key):.2f}", common.mean_pm(finals),
                     f"{trials.seconds / len(trials.runs):.0f}"])  # fmt: skip
    return common.markdown_table(
        ["setting", f"tokens to {shape.target:.3f}", "fewer tokens than before (x)", "final validation loss",
         "train time per run (s)"], rows,
    )  # fmt: skip


def checks(settings: Settings, demo: Shape, wide: Shape) -> list[common.Check]:
    """The claim's parts, decided from the numbers: each switch alone, the recipe now, and the 6 x 384 settings."""
    tokens = demo.tokens
    out = []
    for key in settings.mechanisms:
        out.append(common.Check(
            f"{demo.runs[key].name} alone reaches {settings.target_loss} on fewer tokens than the recipe before it "
            "(beyond the seed-to-seed spread)",
            fewer_tokens(tokens, key),
            f"{tokens_text(tokens[key])} vs {tokens_text(tokens['before'])} tokens "
            f"({ratio(tokens, key):.2f}x; {token_gap(tokens[key], tokens['before'])})",
        ))  # fmt: skip
    out.append(common.Check(
        f"the recipe now (training/configs/shakespeare_char.yaml) reaches {settings.target_loss} on at least "
        f"{GOAL_RATIO}x fewer tokens than the recipe before (the goal it was changed for)",
        bool(ratio(tokens, "recipe") >= GOAL_RATIO and fewer_tokens(tokens, "recipe")),
        f"{tokens_text(tokens['recipe'])} vs {tokens_text(tokens['before'])} tokens "
        f"({ratio(tokens, 'recipe'):.2f}x)",
    ))  # fmt: skip
    for key in wide.runs:
        if key != "before":
            out.append(common.Check(
                f"at 6 x 384, {wide.runs[key].name} reaches the old GPU recipe's final loss ({wide.target:.3f}) on fewer "
                "tokens than the GPU recipe before (beyond the seed-to-seed spread)",
                fewer_tokens(wide.tokens, key),
                f"{tokens_text(wide.tokens[key])} vs {tokens_text(wide.tokens['before'])} tokens "
                f"({ratio(wide.tokens, key):.2f}x)",
            ))  # fmt: skip
    return out


def setup_text(session: common.Session, settings: Settings, demo: Shape, wide: Shape) -> str:
    before, now = demo.specs["before"].training, demo.specs["recipe"].training
    return f"""*make demo's shape*: the recipe as it was before Muon and the speedrun's switches
(`training/configs/shakespeare_char_adamw.yaml`: 4 layers x 128, SwiGLU with SiLU, QK-norm, AdamW at
{before["learning_rate"]} with the token embeddings at {before["embedding_learning_rate"]}, cosine to 10% after
{before["num_warmup_steps"]} warm-up steps, {before["max_train_steps"]} steps of {before["per_device_train_batch_size"]}
windows of {settings.block_size} characters, cut at a new offset each pass), then the same with one switch each:
{", ".join(demo.runs[k].name for k in settings.mechanisms)}; Muon (the blocks' matrices; AdamW keeps the embeddings,
head, norms) at {settings.muon_learning_rate}, WSD's linear decay over the last {settings.wsd_decay:.0%} of the steps
to 10%. *Recipe now*: `training/configs/shakespeare_char.yaml` as committed ({now["max_train_steps"]} steps of
{now["per_device_train_batch_size"]}). Validation loss every {settings.eval_every} steps on every
{settings.eval_stride}th validation block ({len(demo.corpus.eval_blocks)} blocks of {settings.block_size}; Tiny
Shakespeare's last 10%); tokens to {settings.target_loss}: linear between the two evaluations around the crossing.
*6 x 384*: nanoGPT's GPU shape with the GPU recipe as it was (`training/configs/shakespeare_char_gpu_adamw.yaml`: AdamW,
dropout 0.2), {settings.wide_steps} steps of {settings.wide_batch_size} windows of {settings.block_size} (a CPU's
budget, not the GPU recipe's batch of 64 x 256), {settings.wide_steps // 10} warm-up steps; validation every
{settings.wide_eval_every} steps on every {settings.wide_eval_stride}th block ({len(wide.corpus.eval_blocks)} blocks);
the target is the old recipe's highest final loss. Every setting: {len(session.seeds)} seeds (weights and data
order)."""


DISCUSSION = """**Why tokens.** Tokens to a loss do not depend on the machine or its load, so a CPU's count carries to a
GPU at the same shape and batch; a step's time does not (Muon's Newton-Schulz products cost a CPU much more, next
to a small batch's forward and backward, than a GPU running the speedrun's 500k-token steps). The wall time of the
recipes is measured by `python -m benchmarks.sample_efficiency`, which times both recipes, interleaved, beside this
experiment's committed numbers. **Scale.** These are models of 0.6M and 10.6M parameters on a 1M-character corpus, a
few hundred to a thousand steps: a switch that helps GPT-2 small on FineWeb need not help here, and one that does not
help here may still help there."""


def numbers(settings: Settings, shape: Shape) -> dict:
    """Per setting: its tokens to the target and final loss per seed, its validation curves in tokens, its size."""
    out = {}
    for key, t in shape.runs.items():
        training = shape.specs[key].training
        per_step = tokens_per_step(shape.specs[key], settings)
        out[key] = {
            "name": t.name, "tokens": shape.tokens[key].tolist(),
            "final_eval_losses": [r.final_eval_loss for r in t.runs],
            "curves": [[(s * per_step, loss) for s, loss in r.eval_curve] for r in t.runs],
            "seconds": [r.seconds for r in t.runs], "steps": training["max_train_steps"],
            "batch_size": training["per_device_train_batch_size"],
        }  # fmt: skip
    return out


if __name__ == "__main__":
    main()
