"""What the experiments share: the command line, the data, training one small model, recording attention,
figures and the report.

Each experiment is a thin ``main(argv)`` over these helpers. Data loading, tokenizing, packing, the model
factory and the training loop are ``training/``'s (the pretraining script's own), so an experiment's run is
a pretraining run with a different configuration, not a second implementation of one.
"""

import argparse
import concurrent.futures
import dataclasses
import io
import json
import math
import multiprocessing
import os
import pathlib
import shlex
import sys
import tempfile
import time
import typing
from dataclasses import dataclass, field

import numpy as np
import PIL.Image
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from matplotlib.figure import Figure
from transformers import AttentionInterface, PreTrainedTokenizerBase
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from decoderlab import DecoderLabForCausalLM
from decoderlab.modeling_decoderlab import repeat_kv
from training.args import Config, TrainConfig, add_flags, coerce, option, parse_config
from training.checkpointing import git_commit, hardware_description, package_versions
from training.data import (
    Packing,
    block_tensor,
    load_text_splits,
    pack,
    prepare_data,
    tiny_shakespeare,
    training_batches,
)
from training.loop import NonFiniteLossError, make_accelerator, train
from training.models import build_model
from training.preflight import preflight

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "experiments" / "results"
DPI = 80  # small PNGs: the committed results stay well under 1 MB
DEFAULT_SEEDS = 3  # every trained comparison: a difference counts only when it exceeds the seed-to-seed spread


# ----------------------------------------------------------------------------------------------
# Command line: shared flags, plus one flag per field of the experiment's settings dataclass


@dataclass
class ExperimentOptions(Config):
    """The flags every experiment has, besides one per field of its settings."""

    quick: bool = option(False, "CI-sized smoke run: seconds, numbers meaningless")
    output_dir: str | None = option(None, "report and plots (default: experiments/results/NAME)")
    dataset_name: str | None = option(
        None, "Hub dataset id or local Hub-layout folder (default: ../shared/data/tiny_shakespeare when present, "
        "else karpathy/tiny_shakespeare)"
    )  # fmt: skip
    device: typing.Literal["auto", "cpu", "cuda"] = option("auto", "auto: a GPU if present")
    threads: int = option(2, "torch CPU threads (of each parallel run with --jobs)")
    seed: int = option(0, "first seed: run i of a setting uses weights and data order of seed + i")
    seeds: int | None = option(None, f"runs per trained setting (default {DEFAULT_SEEDS}; --quick: 1)")
    jobs: int = option(1, "training runs at once, each in its own process (CPU: e.g. --jobs 2 --threads 1)")

    def check(self) -> None:
        if self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}.")
        if self.seeds is not None and self.seeds < 1:
            raise ValueError(f"--seeds must be at least 1, got {self.seeds}.")
        if self.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {self.jobs}.")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but torch sees no CUDA GPU. Use --device cpu or auto.")


def parse_args(
    name: str, description: str, default, quick, argv: list[str] | None
) -> tuple[ExperimentOptions, typing.Any]:
    """(options, settings): ``settings`` is ``quick`` with ``--quick`` and ``default`` otherwise, with every
    ``--FIELD VALUE`` given on the command line replacing that field (typed and checked by training.args)."""
    parser = argparse.ArgumentParser(prog=f"python -m experiments.{name}", description=description, allow_abbrev=False)
    add_flags(parser, ExperimentOptions)
    settings_help = lambda f: (
        f"(default {format_value(getattr(default, f.name))}; --quick {format_value(getattr(quick, f.name))})"
    )
    add_flags(parser, type(default), help_for=settings_help)
    given = vars(parser.parse_args(argv))
    own = {f.name for f in dataclasses.fields(ExperimentOptions)}
    options = ExperimentOptions(**{key: value for key, value in given.items() if key in own})
    hints = typing.get_type_hints(type(default))
    overrides = {key: coerce(key, value, hints[key]) for key, value in given.items() if key not in own}
    return options, dataclasses.replace(quick if options.quick else default, **overrides)


def format_value(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


# ----------------------------------------------------------------------------------------------
# A session: threads, seed, device, output and scratch folders, the clock


@dataclass
class Session:
    name: str
    args: ExperimentOptions
    settings: typing.Any
    argv: list[str]
    output_dir: pathlib.Path
    work_dir: pathlib.Path  # scratch: each training run's metrics and tokenizer; deleted at the end
    device: torch.device
    hardware: str = "?"  # set by the first Accelerator
    started: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def command(self) -> str:
        """The command line as a reader reruns it from the repository root: a path inside the checkout or beside
        it (``../shared/data/...``, the offline data) written relative to the checkout, so the report names no
        machine's folders."""
        beside = f"{REPO_ROOT.parent}/"
        argv = [os.path.relpath(a, REPO_ROOT) if a.startswith(beside) else a for a in self.argv]
        return shlex.join(["python", "-m", f"experiments.{self.name}", *argv])

    @property
    def seeds(self) -> list[int]:
        """The seeds every trained setting runs with: ``--seed`` and the ones after it."""
        count = self.args.seeds if self.args.seeds is not None else 1 if self.args.quick else DEFAULT_SEEDS
        return [self.args.seed + i for i in range(count)]

    def log(self, message: str) -> None:
        print(f"[{self.name} {self.elapsed():6.0f} s] {message}", flush=True)


def start_session(name: str, args: ExperimentOptions, settings, argv: list[str] | None, scratch) -> Session:
    """Threads and seed set, output folder created; ``scratch`` is the path of an existing scratch folder."""
    torch.set_num_threads(args.threads)
    set_seed(args.seed)
    output_dir = pathlib.Path(args.output_dir) if args.output_dir else RESULTS_DIR / name
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.device == "auto":  # what Accelerate picks for the training runs too
        device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
    else:
        device = torch.device(args.device)
    argv = list(argv) if argv is not None else sys.argv[1:]
    return Session(name, args, settings, argv, output_dir, pathlib.Path(scratch), device)


def run_experiment(name: str, doc: str, default, quick, run: typing.Callable, argv: list[str] | None) -> None:
    """An experiment's ``main``: parse the command line, open a session with a scratch folder, ``run(session,
    settings)``; the scratch folder (each training run's metrics and tokenizer) is deleted at the end."""
    args, settings = parse_args(name, " ".join(doc.split("\n\n")[0].split()), default, quick, argv)  # 1st paragraph
    with tempfile.TemporaryDirectory(prefix="decoderlab-experiment-") as scratch:
        run(start_session(name, args, settings, argv, scratch), settings)


# ----------------------------------------------------------------------------------------------
# Data: training/'s loading, character tokenizer and packing


def dataset_name(args: ExperimentOptions) -> str:
    return args.dataset_name if args.dataset_name is not None else tiny_shakespeare()


@dataclass
class Corpus:
    """Character-level Tiny Shakespeare packed into blocks: what every training run of an experiment reads."""

    cfg: TrainConfig  # the data fields every run's TrainConfig starts from
    tokenizer: PreTrainedTokenizerBase
    train_blocks: torch.Tensor  # (N, block_size) token ids
    eval_blocks: torch.Tensor  # (M, block_size): the first blocks of the validation split

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def validation_blocks(self, length: int, limit: int) -> torch.Tensor:
        """(at most ``limit``, ``length``) blocks of the validation split, for evaluating at other lengths."""
        _, validation = load_text_splits(self.cfg)
        if validation is None:
            raise ValueError(
                f"{self.cfg.dataset_name} has no validation split, which this experiment evaluates on: pass a "
                "--dataset_name that has one."
            )
        packing = dataclasses.replace(Packing.of(self.cfg), block_size=length)
        blocks = block_tensor(pack(validation, self.tokenizer, packing, "validation"))
        if len(blocks) == 0:
            raise ValueError(f"The validation split of {self.cfg.dataset_name} is shorter than one block of {length}.")
        return blocks[:limit]


def load_corpus(session: Session, block_size: int, max_eval_blocks: int) -> Corpus:
    cfg = TrainConfig(
        dataset_name=dataset_name(session.args),
        tokenizer_type="char",
        block_size=block_size,
        output_dir=str(session.work_dir / "data"),
        per_device_train_batch_size=1,
        seed=session.args.seed,
    )
    tokenizer, batches, eval_blocks = prepare_data(cfg, accelerator_for(session, cfg))
    return Corpus(cfg, tokenizer, batches.blocks, eval_blocks[:max_eval_blocks])


# ----------------------------------------------------------------------------------------------
# Training one model with training/'s loop


# The TrainConfig fields every run of an experiment takes unless its Spec sets them; the rest are TrainConfig's
# defaults (AdamW, betas 0.9/0.99, weight decay 0.1). A Spec that picks another scheduler gives its kwargs too.
RUN_DEFAULTS = dict(
    learning_rate=1e-3,
    num_warmup_steps=0,
    lr_scheduler_type="cosine_with_min_lr",
    lr_scheduler_kwargs={"min_lr_rate": 0.1},  # the cosine decays to 10 % of the peak
    max_grad_norm=1.0,
    window_sampling="blocks",
    logging_steps=10,
    eval_steps=None,  # only the final evaluation, on every eval block
    max_eval_samples=64,  # blocks of each periodic evaluation
    per_device_eval_batch_size=64,
)
# The fields of a recipe file that shape how its model trains; the experiment sets the others (data, evaluation,
# logging, checkpoints) alike for every run it compares
TRAINING_FIELDS = (
    "per_device_train_batch_size", "max_train_steps", "learning_rate", "embedding_learning_rate",
    "lr_scheduler_type", "lr_scheduler_kwargs", "num_warmup_steps", "weight_decay", "adam_beta1", "adam_beta2",
    "max_grad_norm", "window_sampling", "optimizer", "muon_learning_rate", "muon_momentum", "muon_nesterov",
    "muon_weight_decay", "muon_adjust_lr_fn", "muon_ns_steps",
)  # fmt: skip


def recipe(path: str | os.PathLike) -> tuple[dict, dict]:
    """(model fields, TrainConfig fields) of a recipe file as ``training/pretrain.py --config PATH`` reads it: its
    ``model:`` mapping, and its values of ``TRAINING_FIELDS`` (TrainConfig's default where the file is silent), for
    a Spec that trains as the recipe does (with any fields of the experiment's own over them)."""
    cfg = parse_config(TrainConfig, ["--config", str(path)])
    return dict(cfg.model), {name: getattr(cfg, name) for name in TRAINING_FIELDS}


@dataclass
class Run:
    name: str
    model: DecoderLabForCausalLM | None  # trained (or as it was when it diverged), in eval mode; None once dropped
    train_curve: list[tuple[int, float]]  # (step, mean training loss over the logging window)
    eval_curve: list[tuple[int, float]]  # (step, validation loss), the last one over every eval block
    diverged_by: int | None  # the logging step whose window held a NaN/inf loss; None if training finished
    seconds: float

    @property
    def final_eval_loss(self) -> float:
        return self.eval_curve[-1][1] if self.diverged_by is None else math.nan

    @property
    def final_train_loss(self) -> float:
        return self.train_curve[-1][1] if self.train_curve and self.diverged_by is None else math.nan


def fresh_model(corpus: Corpus, model_fields: dict, seed: int, prepare: typing.Callable | None = None):
    """``training.models.build_model``'s model for ``model_fields`` and the corpus's vocabulary, seeded; then
    ``prepare(model)`` (an experiment's own initialisation, say), drawing from the same seeded generator."""
    set_seed(seed)
    model = build_model(model_fields, corpus.tokenizer, corpus.cfg.block_size)
    if prepare is not None:
        prepare(model)
    return model


@dataclass(frozen=True)
class Spec:
    """One trained setting: its name, model fields and TrainConfig fields (``training``, over ``RUN_DEFAULTS``; it
    names at least ``max_train_steps`` and ``per_device_train_batch_size``); it is trained once per seed of the
    session. ``prepare``: a module-level function (parallel runs pickle it) applied to each fresh model before
    training; ``keep_model``: keep the trained models (for measurements after training), or only their numbers."""

    name: str
    model_fields: dict
    training: dict
    prepare: typing.Callable | None = None
    keep_model: bool = True

    def __post_init__(self):
        missing = [name for name in ("max_train_steps", "per_device_train_batch_size") if name not in self.training]
        if missing:
            raise ValueError(f"Spec {self.name!r} sets no {' and no '.join(missing)}: name the run's length and batch.")


def run_config(corpus: Corpus, spec: Spec, seed: int, output_dir: pathlib.Path) -> TrainConfig:
    """The TrainConfig of one run: the corpus's data fields, ``RUN_DEFAULTS``, the spec's fields, and what the
    harness fixes (the run's scratch folder, no checkpoints, the seed); built anew, so TrainConfig checks it."""
    fields = {**RUN_DEFAULTS, **spec.training, "output_dir": str(output_dir), "checkpointing_steps": None, "seed": seed}
    return dataclasses.replace(corpus.cfg, **fields)


def train_model(session: Session, corpus: Corpus, spec: Spec, seed: int) -> Run:
    """Train a fresh ``DecoderLabForCausalLM`` (``spec.model_fields`` plus the tokenizer's vocabulary) with
    ``training.loop.train``; the weights and the data order depend only on the seed and the fields, so two
    runs that differ in a field with no parameters (``attention_scale``) start from identical weights."""
    name = f"{spec.name}, seed {seed}"
    cfg = run_config(corpus, spec, seed, session.work_dir / name)
    # the training scripts' own check of settings that must fit each other (the model's among them)
    preflight(dataclasses.replace(cfg, model=dict(spec.model_fields)), cpu=session.args.device == "cpu")
    model = fresh_model(corpus, spec.model_fields, seed, spec.prepare)
    accelerator = accelerator_for(session, cfg)
    batches = training_batches(cfg, corpus.train_blocks, dict(seed=seed, process_index=0, num_processes=1))
    started = time.perf_counter()
    diverged_by = None
    try:
        result = train(model, batches, corpus.eval_blocks, cfg, accelerator, show_progress=False)
        model, records = accelerator.unwrap_model(result.model), result.history
    except NonFiniteLossError as diverged:
        model = accelerator.unwrap_model(model)  # train() wraps in place on one process; no-op otherwise
        records = diverged.history
    train_curve = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    eval_curve = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if not eval_curve or eval_curve[-1][0] != cfg.max_train_steps:  # no final evaluation: the loop stopped early
        logged = train_curve[-1][0] if train_curve else 0
        diverged_by = min(logged + cfg.logging_steps, cfg.max_train_steps)
    kept = model.eval() if spec.keep_model else None
    run = Run(name, kept, train_curve, eval_curve, diverged_by, time.perf_counter() - started)
    outcome = f"diverged by step {diverged_by}" if diverged_by else f"validation loss {run.final_eval_loss:.4f}"
    session.log(f"{name}: {outcome} ({run.seconds:.0f} s)")
    return run


@dataclass
class Trials:
    """The runs of one setting, one per seed (``seeds[i]`` gave ``runs[i]``)."""

    name: str
    seeds: list[int]
    runs: list[Run]

    @property
    def losses(self) -> np.ndarray:
        """(seeds,) final validation losses; NaN for a run that diverged."""
        return np.array([run.final_eval_loss for run in self.runs])

    @property
    def mean(self) -> float:
        return float(np.mean(self.losses))  # NaN when any seed diverged: a setting is only as good as its worst run

    @property
    def std(self) -> float:
        """Seed-to-seed standard deviation of the final loss (sample, n - 1); 0 for a single seed."""
        return spread(self.losses)

    @property
    def model(self):
        """The first seed's trained model (the one figures of trained weights show)."""
        return self.runs[0].model

    @property
    def seconds(self) -> float:
        return sum(run.seconds for run in self.runs)

    def count(self, predicate: typing.Callable[[Run], bool]) -> int:
        return sum(bool(predicate(run)) for run in self.runs)

    def __str__(self) -> str:
        """'2.345 ± 0.012' (mean ± standard deviation over the seeds); 'NaN (2 of 3 diverged)' and the like."""
        diverged = sum(run.diverged_by is not None for run in self.runs)
        if diverged:
            return f"NaN ({diverged} of {len(self.runs)} diverged)"
        return mean_pm(self.losses)


def per_seed(values) -> np.ndarray:
    """The per-seed numbers of a ``Trials`` (its final losses) or of a sequence of per-seed measurements."""
    return values.losses if isinstance(values, Trials) else np.asarray(values, dtype=float)


def spread(values) -> float:
    """Seed-to-seed standard deviation (sample, n - 1); 0 for a single seed."""
    values = per_seed(values)
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def lower_beyond_spread(a, b) -> bool:
    """Whether ``a``'s mean is below ``b``'s by more than the seed-to-seed spread: the gap between the means exceeds
    the sum of the two standard deviations (with one seed each, any lower mean counts). ``a`` and ``b``: ``Trials``
    (their final losses) or per-seed measurements."""
    return bool(per_seed(b).mean() - per_seed(a).mean() > spread(a) + spread(b))


def spread_note(a, b) -> str:
    """'gap +0.034 vs spread 0.012' (``b``'s mean minus ``a``'s) for a check's evidence column."""
    return f"gap {per_seed(b).mean() - per_seed(a).mean():+.3f} vs spread {spread(a) + spread(b):.3f}"


def mean_pm(values, digits: int = 3) -> str:
    """'1.234 ± 0.012' over the seeds ('1.234' for one seed)."""
    values = per_seed(values)
    return (
        f"{values.mean():.{digits}f} ± {spread(values):.{digits}f}"
        if len(values) > 1
        else f"{values.mean():.{digits}f}"
    )


def train_all(session: Session, corpus: Corpus, specs: dict, seeds: dict | None = None) -> dict:
    """``{key: Trials}``: every spec of ``{key: Spec}`` trained once per seed of the session, or per seed of
    ``seeds[key]`` where ``seeds`` (``{key: [seed, ...]}``) names the key. The runs start in the order of ``specs``.
    With ``--jobs N`` the runs go to N worker processes (each with ``--threads`` threads), so CPU cores train
    separate models."""
    seeds_of = {key: list((seeds or {}).get(key, session.seeds)) for key in specs}
    tasks = [(key, spec, seed) for key, spec in specs.items() for seed in seeds_of[key]]
    if session.args.jobs == 1:
        runs = [train_model(session, corpus, spec, seed) for _, spec, seed in tasks]
    else:
        context = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch thread pools
        with concurrent.futures.ProcessPoolExecutor(session.args.jobs, mp_context=context) as pool:
            futures = [pool.submit(_train_in_worker, session, corpus, spec, seed) for _, spec, seed in tasks]
            runs = [future.result() for future in futures]
    trials = {key: Trials(spec.name, seeds_of[key], []) for key, spec in specs.items()}
    for (key, _, _), run in zip(tasks, runs):
        trials[key].runs.append(run)
    return trials


def _train_in_worker(session: Session, corpus: Corpus, spec: Spec, seed: int) -> Run:
    torch.set_num_threads(session.args.threads)
    return train_model(session, corpus, spec, seed)


@torch.no_grad()
def token_losses(model: DecoderLabForCausalLM, blocks: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """(N, T - 1) next-token losses of every position of ``blocks`` (N, T)."""
    device = next(model.parameters()).device
    losses = []
    for chunk in blocks.split(batch_size):
        input_ids = chunk.long().to(device)
        logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1]  # (B, T - 1, V)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")
        losses.append(loss.float().cpu())
    return torch.cat(losses)


# ----------------------------------------------------------------------------------------------
# Recording attention: the model's own attention, through a registered attention function


RECORDING_ATTENTION = "decoderlab_experiments_recording"


class AttentionRecorder:
    """Inside ``with AttentionRecorder(config) as rec:``, every attention call of a module built from
    ``config`` appends its scores ``Q K^T * scale`` (B, nh, T, S) to ``rec.scores`` (before the causal
    mask and the softmax) and its weights to ``rec.weights``, in call order (layer 0 first).

    The module's q, k, v (after RoPE and the KV cache) reach the layer's own eager kernel unchanged
    (``module.eager_attention``: with learned sinks, the one that adds them to the softmax's denominator, so a
    row of recorded weights sums to 1 minus the sink's share); the function is registered with transformers'
    attention and mask interfaces (the eager masks, a sliding layer's window included), so the model computes
    exactly what ``attn_implementation="eager"`` computes. Weights keep their graph, so gradients can flow
    through them.
    """

    def __init__(self, config):
        self.config = config
        self.scores: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []

    def __enter__(self) -> "AttentionRecorder":
        AttentionInterface.register(RECORDING_ATTENTION, self.attend)
        AttentionMaskInterface.register(RECORDING_ATTENTION, eager_mask)
        self.previous = self.config._attn_implementation
        self.config._attn_implementation = RECORDING_ATTENTION
        return self

    def __exit__(self, *exc) -> None:
        self.config._attn_implementation = self.previous

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        keys = repeat_kv(key, module.num_key_value_groups)  # (B, nh, S, hs)
        self.scores.append((query @ keys.transpose(2, 3) * scaling).detach())  # (B, nh, T, S)
        out, weights = module.eager_attention(module, query, key, value, attention_mask, scaling, **kwargs)
        self.weights.append(weights)
        return out, weights


# ----------------------------------------------------------------------------------------------
# Figures and the report


def figure(ncols: int = 1, nrows: int = 1, width: float = 5.0, height: float = 3.6) -> tuple[Figure, typing.Any]:
    """A matplotlib Figure (no pyplot, so no global state and no display) and its axes."""
    fig = Figure(figsize=(width * ncols, height * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def save_figure(fig: Figure, session: Session, filename: str, alt: str) -> str:
    """Saves ``fig`` as a PNG in the output folder; returns the Markdown that shows it.

    The PNG is stored with a 256-colour palette: plots have few colours, and it makes the files about three
    times smaller than full RGBA, which keeps the committed results small.
    """
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    image = PIL.Image.open(buffer).convert("RGB").quantize(colors=256)
    image.save(session.output_dir / filename, optimize=True)
    return f"![{alt}]({filename})"


def plot_mean_and_seeds(ax, x, trials: list[Trials], top: float | None = None, **style) -> None:
    """Mean final loss ± its seed-to-seed standard deviation at each ``x`` (error bars; none where a seed
    diverged), and each seed's own loss as a faint dot; a diverged run is drawn at ``top`` (when given) as a cross."""
    x = np.asarray(x, dtype=float)
    losses = np.array([t.losses for t in trials])  # (points, seeds)
    bars = ax.errorbar(x, [t.mean for t in trials], yerr=[t.std for t in trials], marker="o", capsize=3, **style)
    color = bars.lines[0].get_color()
    for column in losses.T:
        finite = np.isfinite(column)
        ax.scatter(x[finite], column[finite], s=10, color=color, alpha=0.35, zorder=2)
        if top is not None and not finite.all():
            ax.scatter(x[~finite], np.full((~finite).sum(), top), marker="x", s=40, color=color, zorder=3)


def plot_seed_curves(ax, trials: Trials, color: str, ls: str = "-", label: str | None = None,
                     curve: str = "train_curve") -> None:  # fmt: skip
    """One faint line per seed (each run's ``train_curve`` or ``eval_curve``) and, labelled, their mean over the
    steps every seed reached."""
    curves = [getattr(run, curve) for run in trials.runs if getattr(run, curve)]
    if not curves:
        return
    for points in curves:
        ax.plot(*zip(*points), color=color, ls=ls, alpha=0.25, lw=0.8)
    reached = min(len(points) for points in curves)
    steps = [step for step, _ in curves[0][:reached]]
    mean = np.mean([[value for _, value in points[:reached]] for points in curves], axis=0)
    ax.plot(steps, mean, color=color, ls=ls, label=label or trials.name)


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return "NaN" if math.isnan(value) else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Check:
    """One measurable part of a claim, decided from the numbers."""

    statement: str
    held: bool
    evidence: str


def verdict(checks: list[Check]) -> str:
    held = sum(c.held for c in checks)
    if held == len(checks):
        return "holds"
    return "does not hold" if held == 0 else "partly holds"


def since_previous(output_dir: pathlib.Path, held: str, revision: str) -> str:
    """One line comparing this verdict with the one the output folder's results.json held before this run (none
    there: an empty string), with ``revision``, what this version of the experiment changed and why. A re-run of
    the same version to the same verdict (the previous results.json has the same ``revision`` and verdict) keeps
    that run's line: the comparison that matters is with the version before, not with an identical run."""
    path = output_dir / "results.json"
    if not path.is_file():
        return ""
    previous = json.loads(path.read_text())
    same_version = revision and previous.get("revision") == revision and previous.get("verdict") == held
    if same_version and previous.get("since_previous"):
        return previous["since_previous"]
    seeds = len(previous.get("seeds", [previous.get("settings", {}).get("seed", 0)]))
    where = f", commit {previous['commit'][:12]}" if previous.get("commit") else ""
    held_before = sum(c["held"] for c in previous.get("checks", []))
    return (
        f"\n**Since the previous run** ({seeds} seed{'s' if seeds > 1 else ''}{where}: the claim "
        f"{previous.get('verdict', '?')}, {held_before} of {len(previous.get('checks', []))} checks held): "
        f"{'the same verdict' if previous.get('verdict') == held else f'now it {held}'}. {revision}\n"
    )


def write_report(session: Session, *, title: str, claim: str, setup: str, results: str, checks: list[Check],
                 discussion: str, numbers: dict, revision: str = "") -> pathlib.Path:  # fmt: skip
    """``report.md`` (claim, setup, results, verdict, how it compares with the previous run in the same folder,
    how to reproduce, wall time) and ``results.json`` (the numbers behind it) in the output folder.
    ``revision``: what this version of the experiment changed from the previous one, and why."""
    held = verdict(checks)
    previous = since_previous(session.output_dir, held, revision)
    check_rows = [[c.statement, "yes" if c.held else "**no**", c.evidence] for c in checks]
    git = git_commit(ignore=("experiments/results",))  # what earlier experiments wrote is not code
    commit = f"{git['commit'][:12]}{' (with uncommitted changes)' if git['dirty'] else ''}" if git["commit"] else "?"
    versions = package_versions()
    quick = (
        "\n\n> **--quick run**: a smoke test of the code path; its numbers mean nothing." if session.args.quick else ""
    )
    parallel = f", {session.args.jobs} training runs at a time" if session.args.jobs > 1 else ""
    seeds = f"seeds {', '.join(map(str, session.seeds))}"
    text = f"""# {title}{quick}

**Claim.** {claim}

## Setup

{setup}

## Results

{results}

## Verdict

**Verdict: the claim {held} at this scale.**

{markdown_table(["check", "held", "numbers"], check_rows)}
{previous}
{discussion}

## Reproduce

```bash
{session.command()}
```

Wall time {session.elapsed():.0f} s on {session.hardware}{parallel}; {seeds}; torch {versions["torch"]},
transformers {versions["transformers"]}, decoderlab commit {commit}.
"""
    path = session.output_dir / "report.md"
    path.write_text(text, encoding="utf-8")
    summary = {
        "experiment": session.name,
        "verdict": held,
        "checks": [dataclasses.asdict(c) for c in checks],
        "settings": dataclasses.asdict(session.settings),
        "seeds": session.seeds,
        "commit": git["commit"],
        "wall_time_s": round(session.elapsed(), 1),
        "revision": revision,
        "since_previous": previous,
        "numbers": numbers,
    }
    (session.output_dir / "results.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return path


def accelerator_for(session: Session, cfg: TrainConfig) -> Accelerator:
    """training/'s Accelerator for ``cfg`` on the session's device; remembers what the hardware is."""
    accelerator = make_accelerator(cfg, cpu=session.args.device == "cpu")
    session.hardware = hardware_description(accelerator)
    return accelerator
