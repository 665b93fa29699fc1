"""Tune at a narrow width, train wide: muP's learning-rate transfer as one command.

    python training/mup_tune.py training/configs/shakespeare_char.yaml --target_size small \\
        --output training/configs/shakespeare_char_small_mup.yaml --jobs 2 -- --dataset_name ../shared/data/tiny_shakespeare

1. The proxy: RECIPE's model at the target's depth and head width (``head_dim``), ``hidden_size`` = ``--base_width``
   (default: the recipe's own), under ``parametrization: mup`` with that base width (every ``mup_*`` field the recipe
   sets is kept). Everything else (data, batch, steps, schedule, initialisation, optimizer) is RECIPE's, with the
   training flags given after ``--``.
2. One pretraining run (``training/pretrain.py``, each in its own process) per rate of ``--learning_rates``. The rate
   swept is the one the blocks' matrices train at, which muP carries across widths: ``learning_rate`` under AdamW
   (muP divides it by each matrix's width multiplier), ``muon_learning_rate`` under Muon (whose update needs no
   factor); the table in ``decoderlab/roles_decoderlab.py`` says which (``--rate`` picks another field). When the
   swept rate is ``learning_rate``, the token embeddings' own rate keeps its ratio to it.
3. The best rate by final validation loss (refined between grid points by a parabola in log2 of the rate) goes into
   ``--output``: RECIPE's settings with the model at the target size (every hidden dimension times m = target width
   / base width, the heads too, so ``head_dim`` stays), muP with the proxy as its base (``mup_base_width`` and
   ``mup_base_shapes``), and the rate found. Its header gives the command, the proxy's loss at each rate and the
   optimizer groups the wide recipe trains with (``training/optim.py``'s record of them); muP carries rates across
   width only, and a rate derived on a CPU is unmeasured where the recipe is meant to run until a run there measures it.
"""

import concurrent.futures
import dataclasses
import datetime
import math
import os
import pathlib
import shlex
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import torch
import yaml

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.cli import UsageError, UserError
from decoderlab.configuration_decoderlab import MUP_BASE_SHAPE_FIELDS, SIZES
from decoderlab.roles_decoderlab import rule_for
from training.args import Config, TrainConfig, load_yaml, option, parse_config
from training.loop import METRICS_NAME, read_metrics
from training.optim import groups_comment, param_groups, recorded_groups
from training.preflight import preflight
from training.program import run_program

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PRETRAIN = REPO_ROOT / "training" / "pretrain.py"
# flags after "--" that say where the data is, not what the runs do: the written recipe keeps its own
WHERE_THE_DATA_IS = ("dataset_name", "dataset_config_name", "train_file", "validation_file", "prepared_data", "output_dir")


@dataclass
class TuneConfig(Config):
    """Tune a muP recipe's learning rate at a narrow width on a CPU and write the wide recipe."""

    recipe: str = option(help="the training recipe (YAML) to tune", positional=True)
    target_size: str = option("small", f"the wide model: a named size ({', '.join(SIZES)})")
    base_width: int | None = option(None, "the proxy's hidden_size, muP's base width (default: the recipe's)")
    learning_rates: tuple[float, ...] = option(
        (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), "the rates tried at the proxy width (a grid of equal ratios)"
    )
    rate: str | None = option(
        None, "the TrainConfig rate to sweep (default: the one the blocks' matrices train at under the recipe's optimizer)"
    )
    output: str = option("out/mup_recipe.yaml", "where the wide recipe is written")
    work_dir: str = option("out/mup_tune", "the proxy runs' folders (one per rate)")
    jobs: int = option(1, "proxy runs at once, each in its own process with one thread (2 on two cores)")

    def check(self) -> None:
        if self.target_size not in SIZES:
            raise ValueError(f"target_size={self.target_size!r} is not a named size; choose one of {list(SIZES)}.")
        if len(self.learning_rates) < 3 or any(lr <= 0 for lr in self.learning_rates):
            raise ValueError(f"learning_rates needs three or more positive rates, got {self.learning_rates}.")
        if self.jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {self.jobs}.")
        rates = [f.name for f in dataclasses.fields(TrainConfig) if f.name.endswith("learning_rate")]
        if self.rate is not None and self.rate not in rates:
            raise ValueError(f"rate={self.rate!r} is not a rate of the recipe; choose one of {rates}.")


def best_rate(rates, losses) -> tuple[float, float, bool]:
    """(best learning rate, its loss, whether it lies inside the grid) from the loss at each rate (NaN or inf where a
    run diverged). Inside the grid the rate is the vertex of the parabola through the best grid point and its two
    neighbours, in log2 of the rate (kept between those neighbours); at the grid's edge, the edge."""
    x, y = np.log2(np.asarray(rates, dtype=float)), np.where(np.isfinite(losses), losses, np.inf)
    i = int(np.argmin(y))
    if not np.isfinite(y[i]):
        return math.nan, math.nan, False
    if i == 0 or i == len(y) - 1 or not np.isfinite(y[i - 1 : i + 2]).all():
        return float(2 ** x[i]), float(y[i]), False
    a, b, _ = np.polyfit(x[i - 1 : i + 2], y[i - 1 : i + 2], 2)
    vertex = float(np.clip(-b / (2 * a), x[i - 1], x[i + 1])) if a > 0 else float(x[i])
    return float(2**vertex), float(y[i]), True


def scaled_model(model: dict, width: int, layers: int, head_dim: int) -> dict:
    """``model`` (a recipe's ``model:`` mapping) at ``width`` and ``layers``, with heads of ``head_dim``: the heads and
    an explicit ``intermediate_size`` scale with the width (the recipe's ratio kept), so m scales every hidden
    dimension alike, as muP assumes."""
    hidden = model.get("hidden_size", 768)
    if width % head_dim:
        raise UsageError(f"hidden_size {width} is not a whole number of heads of head_dim {head_dim}.")
    scaled = {**model, "hidden_size": width, "num_hidden_layers": layers, "num_attention_heads": width // head_dim}
    scaled.pop("head_dim", None)
    scaled.pop("num_key_value_heads", None)  # grouped heads would need the recipe's ratio: multi-head here
    if model.get("intermediate_size"):
        scaled["intermediate_size"] = model["intermediate_size"] * width // hidden
    return scaled


def swept_rate(cfg: TuneConfig, recipe: TrainConfig) -> str:
    """The TrainConfig field ``--rate`` names, or the one the blocks' matrices train at under the recipe's optimizer
    (``roles_decoderlab.RULES``: ``learning_rate`` for AdamW, ``muon_learning_rate`` for Muon)."""
    return cfg.rate or rule_for("hidden_matrix", recipe.optimizer, "mup").rate


def rate_flags(rate: str, lr: float, embedding_ratio: float | None) -> dict[str, float]:
    """The rates a proxy run (or the written recipe) sets for the swept ``rate`` at ``lr``: the token embeddings' own
    rate follows ``learning_rate`` at the recipe's ratio."""
    flags = {rate: lr}
    if rate == "learning_rate" and embedding_ratio is not None:
        flags["embedding_learning_rate"] = lr * embedding_ratio
    return flags


def run_proxy(cfg: TuneConfig, train_args: list[str], model: dict, rates: dict[str, float]) -> float:
    """The final validation loss of one proxy run at ``rates`` (NaN if the run did not finish)."""
    lr = next(iter(rates.values()))
    out = pathlib.Path(cfg.work_dir) / f"lr_{lr:.4g}"
    argv = [sys.executable, str(PRETRAIN), "--config", cfg.recipe, *train_args, "--output_dir", str(out),
            "--overwrite_output_dir", "--checkpointing_steps", "none"]  # fmt: skip
    argv += [arg for name, value in rates.items() for arg in (f"--{name}", str(value))]
    argv += [arg for key, value in model.items() for arg in (f"--model.{key}", str(value))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if cfg.jobs > 1 else dict(os.environ)
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    records = read_metrics(out / METRICS_NAME) if done.returncode == 0 else []
    evaluations = [record["eval_loss"] for record in records if "eval_loss" in record]
    last = done.stderr.strip().splitlines()[-1:] if done.returncode else []
    print(f"  lr {lr:.4g}: " + (f"validation loss {evaluations[-1]:.4f}" if evaluations else f"failed {last}"))
    return evaluations[-1] if evaluations else math.nan


def base_shapes(model: dict) -> dict:
    """The proxy's sizes as the wide model's ``mup_base_shapes`` (what its base model was, every one stated)."""
    config = DecoderLabConfig(**model)
    return {name: getattr(config, name) for name in MUP_BASE_SHAPE_FIELDS}


def wide_groups(wide: dict, recipe_values: dict) -> str:
    """The optimizer groups the written recipe trains with (its model built on the meta device, its groups as
    ``training/optim.py`` makes and records them), as comment lines; without parameter counts, which the vocabulary
    (the data's) sets."""
    cfg = TrainConfig(**{**recipe_values, "model": wide})
    with torch.device("meta"):
        model = DecoderLabForCausalLM(DecoderLabConfig(**wide))
    recorded = [
        {key: value for key, value in group.items() if key != "parameters"}
        for group in recorded_groups(model, param_groups(model, cfg))
    ]
    return groups_comment(recorded, title=f"Optimizer groups at the {wide['hidden_size']} width")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    cfg = parse_config(TuneConfig, argv[: argv.index("--")] if "--" in argv else argv)
    recipe = parse_config(TrainConfig, ["--config", cfg.recipe, *train_args])  # the recipe must train as given
    if recipe.model_name_or_path is not None:
        raise UsageError("mup_tune tunes a model trained from scratch; the recipe sets model_name_or_path.")
    rate = swept_rate(cfg, recipe)
    own = ("parametrization", "mup_base_width", "mup_base_shapes")  # set here: the proxy is the base
    model = {key: value for key, value in recipe.model.items() if key not in own}
    base = cfg.base_width or model.get("hidden_size", 768)
    target = SIZES[cfg.target_size]
    head_dim = target["hidden_size"] // target["num_attention_heads"]
    if base >= target["hidden_size"]:
        raise UsageError(f"base_width {base} must be narrower than the {cfg.target_size} size's {target['hidden_size']}.")
    mup = {"parametrization": "mup", "mup_base_width": base}
    proxy = {**scaled_model(model, base, target["num_hidden_layers"], head_dim), **mup}
    wide = {**scaled_model(model, target["hidden_size"], target["num_hidden_layers"], head_dim), **mup,
            "mup_base_shapes": base_shapes(proxy)}  # fmt: skip
    for fields in (proxy, wide):  # both train as given: every setting, every refusal, before any run starts
        preflight(parse_config(TrainConfig, ["--config", cfg.recipe, *train_args,
                                             *(f"--model.{k}={v}" for k, v in fields.items())]))  # fmt: skip
    ratio = None if recipe.embedding_learning_rate is None else recipe.embedding_learning_rate / recipe.learning_rate

    print(f"Proxy: {proxy}; sweeping {rate} over {len(cfg.learning_rates)} runs, {cfg.jobs} at a time, in {cfg.work_dir}")
    with concurrent.futures.ThreadPoolExecutor(cfg.jobs) as pool:
        runs = [rate_flags(rate, lr, ratio) for lr in cfg.learning_rates]
        losses = list(pool.map(lambda rates: run_proxy(cfg, train_args, proxy, rates), runs))
    lr, loss, inside = best_rate(cfg.learning_rates, losses)
    if not math.isfinite(lr):
        raise UserError(f"No proxy run finished (see the folders under {cfg.work_dir}); nothing written.")
    if not inside:
        print(f"warning: the best rate, {lr:.4g}, is at the edge of the grid: extend --learning_rates past it.")

    values = load_yaml(cfg.recipe)
    given = parse_config(TrainConfig, ["--config", cfg.recipe]).to_dict()
    for key, value in recipe.to_dict().items():  # the flags after "--" shaped the proxy's runs: the recipe keeps them
        if value != given[key] and key not in WHERE_THE_DATA_IS:
            values[key] = value
    values["model"] = wide
    values.update({name: float(f"{value:.3g}") for name, value in rate_flags(rate, lr, ratio).items()})
    values["output_dir"] = f"out/{pathlib.Path(cfg.output).stem}"
    command = shlex.join(["python", "training/mup_tune.py", *argv])
    rows = "\n".join(f"#   {rate_value:.4g}: {value:.4f}" for rate_value, value in zip(cfg.learning_rates, losses))
    header = f"""# {pathlib.Path(cfg.output).stem}: {cfg.recipe}'s recipe at the {cfg.target_size} size ({wide['num_hidden_layers']} layers x
# {wide['hidden_size']} hidden x {wide['num_attention_heads']} heads) under muP, {rate} tuned at width {base}.
# Derived on {datetime.date.today()} by
#   {command}
# which trained the proxy ({proxy['num_hidden_layers']} x {base} x {proxy['num_attention_heads']} heads, muP at base width {base}; the same data,
# batch, steps and schedule) at each {rate}; final validation loss:
{rows}
# Best {rate} {lr:.4g} ({'refined between grid points' if inside else 'AT THE EDGE of the grid'}). muP carries it to
# width {wide['hidden_size']} (docs/concepts/mup.md); the proxy has the target's depth, data, batch and steps.
{wide_groups(wide, {k: v for k, v in values.items() if k != 'model'})}# UNMEASURED: this recipe has not been trained at its size (on a GPU) yet; a run there measures it.
"""
    text = header + "\n" + yaml.safe_dump(values, sort_keys=False)
    pathlib.Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(cfg.output).write_text(text, encoding="utf-8")
    parse_config(TrainConfig, ["--config", cfg.output])
    print(f"Best {rate} at width {base}: {lr:.4g} (validation loss {loss:.4f}). Wrote {cfg.output}.")


if __name__ == "__main__":
    run_program(main)
