"""Tokens to a validation loss, and make demo's recipe in wall time, before and after issue 46's switches, in one run.

    python -m benchmarks.sample_efficiency --json_out benchmarks/results/sample_efficiency.json   # about 42 min idle
    python -m benchmarks.sample_efficiency --skip_grid       # only the recipes' wall time (both, alternating)
    python -m benchmarks.sample_efficiency --skip_recipes    # only the grid of tokens to the target

1. **The grid** (tokens to a loss, which no machine load changes): ``experiments.sample_efficiency``, whose report
   goes to ``experiments/results/sample_efficiency/`` as usual: make demo's shape with the recipe before issue 46,
   each switch alone on it (Muon, ReLU², zero-initialised residual projections, logit soft-capping, the
   warmup-stable-decay schedule, a value residual), and the recipe now; 6 x 384 (nanoGPT's GPU shape) for a few
   hundred steps with the GPU recipe before and now; 3 seeds each, two runs at a time on one thread each: 34 minutes
   on 2 idle AMD EPYC cores: 24 of those minutes for the 24 runs of about 1,200 steps at make demo's shape, two at a
   time, and 10 for the 6 x 384 runs, whose time Muon's Newton-Schulz products double on a CPU.
2. **The recipes** (wall time, which load changes): make demo's command, ``training/pretrain.py --config
   training/configs/shakespeare_char.yaml``, as committed and with the flags that give the recipe before back
   (``before_flags``), each a fresh process on ``--num_threads`` threads, alternating (before, now, before, now),
   scored as ``benchmarks/shakespeare_char.py`` scores it: the loss over every 64-character window of the validation
   split, the whole command's and the training loop's time, and now / before for each pair (about 8 minutes for
   three pairs).

The JSON holds both (per setting: tokens to the target per seed, their mean and spread, the final validation loss;
per recipe run: losses and times), the CPU and the load average before and after; the plot is the experiment's,
copied beside it. The machine these run on may be shared: only the ratios of one pair compare wall times.
"""

import argparse
import dataclasses
import json
import pathlib
import shutil
import statistics
import tempfile

import numpy as np
import torch
import yaml

from benchmarks.common import cpu_features, load_average, write_results
from benchmarks.shakespeare_char import RECIPE, run_ours
from decoderlab import DecoderLabConfig
from experiments import sample_efficiency as experiment
from training.args import TrainConfig
from training.checkpointing import cpu_model
from training.data import tiny_shakespeare

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
GOAL_LOSS = 1.60  # issue 46: make demo's recipe at validation <= 1.60, in no more wall time than before
PLOT = "sample_efficiency.png"


def flag_value(value) -> str:
    """A value as a command-line flag takes it (mappings as YAML flow, None as none)."""
    if isinstance(value, dict):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    if value is None:
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def before_flags(recipe: pathlib.Path = RECIPE) -> list[str]:
    """Flags that turn the recipe file back into the recipe before issue 46 (``experiment.BEFORE_*``): its training
    fields and model fields, and every other field the file sets put back to its default."""
    values = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    training = {name: values[name] for name in experiment.TRAINING_FIELDS if name in values}
    defaults = {f.name: getattr(TrainConfig(), f.name) for f in dataclasses.fields(TrainConfig)}
    flags = []
    for name in sorted(set(training) | set(experiment.BEFORE_TRAINING)):
        flags += [f"--{name}", flag_value(experiment.BEFORE_TRAINING.get(name, defaults[name]))]
    model = values.get("model") or {}
    default_config = DecoderLabConfig()
    for name in sorted(set(model) | set(experiment.BEFORE_MODEL)):
        value = experiment.BEFORE_MODEL.get(name, getattr(default_config, name, None))
        flags += [f"--model.{name}", flag_value(value)]
    return flags


def grid_summary(results: dict) -> dict:
    """The experiment's numbers, per shape and setting: tokens to the target per seed and their mean and spread, the
    final validation loss per seed and its mean, the ratio of the recipe before's mean tokens to the setting's."""
    numbers = results["numbers"]
    summary = {"target_loss": numbers["target_loss"], "wide_target_loss": numbers["wide_target_loss"],
               "verdict": results["verdict"], "checks": results["checks"], "seeds": results["seeds"]}  # fmt: skip
    for shape in ("demo", "wide"):
        settings = numbers[shape]
        base = np.mean(settings["before"]["tokens"])
        summary[shape] = {}
        for key, setting in settings.items():
            tokens = np.array(setting["tokens"], dtype=float)
            finals = np.array(setting["final_eval_losses"], dtype=float)
            reached = bool(np.all(np.isfinite(tokens)))
            summary[shape][key] = {
                "name": setting["name"],
                "tokens": setting["tokens"],
                "tokens_mean": float(tokens.mean()) if reached else None,
                "tokens_std": float(tokens.std(ddof=1)) if reached and len(tokens) > 1 else 0.0,
                "fewer_tokens_x": float(base / tokens.mean()) if reached and np.isfinite(base) else None,
                "final_eval_losses": setting["final_eval_losses"],
                "final_eval_loss_mean": float(finals.mean()),
                "final_eval_loss_std": float(finals.std(ddof=1)) if len(finals) > 1 else 0.0,
                "steps": setting["steps"],
                "batch_size": setting["batch_size"],
                "seconds_per_run": float(np.mean(setting["seconds"])),
            }
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset_name", default=None, help="default: the local copy if present, else the Hub id")
    parser.add_argument("--num_threads", type=int, default=2, help="torch threads of each recipe run (make demo's)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each recipe, alternating; medians reported")
    parser.add_argument("--jobs", type=int, default=2, help="the grid's training runs at once, one thread each")
    parser.add_argument("--skip_grid", action="store_true", help="only the recipes' wall time")
    parser.add_argument("--skip_recipes", action="store_true", help="only the grid of tokens to the target")
    parser.add_argument("--quick", action="store_true", help="smoke test: the experiment's --quick, 10-step recipes")
    parser.add_argument("--experiment_dir", type=pathlib.Path, default=None,
                        help="the experiment's report folder (default: experiments/results/sample_efficiency)")  # fmt: skip
    parser.add_argument("--json_out", type=pathlib.Path, default=None, help="write the results here (and the plot beside)")
    args = parser.parse_args(argv)
    dataset = args.dataset_name or tiny_shakespeare()

    results = {"cpu": cpu_model(), "cpu_features": cpu_features(), "torch": torch.__version__,
               "load_average_before": round(load_average(), 2)}  # fmt: skip
    print(f"CPU: {results['cpu']} ({', '.join(results['cpu_features'])}); load average {results['load_average_before']}")
    with tempfile.TemporaryDirectory(prefix="decoderlab-sample-efficiency-") as tmp:
        tmp = pathlib.Path(tmp)
        if not args.skip_grid:
            out = args.experiment_dir or (tmp / "quick" if args.quick else experiment.common.RESULTS_DIR / experiment.NAME)
            experiment_argv = ["--jobs", str(args.jobs), "--threads", "1", "--output_dir", str(out),
                               "--dataset_name", dataset, *(["--quick"] if args.quick else [])]  # fmt: skip
            experiment.main(experiment_argv)
            report = json.loads((out / "results.json").read_text())
            results["grid"] = {"experiment": str(out.relative_to(REPO_ROOT)) if out.is_relative_to(REPO_ROOT) else None,
                               "wall_time_s": report["wall_time_s"], **grid_summary(report)}  # fmt: skip
            if args.json_out is not None:
                args.json_out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(out / "tokens_to_target.png", args.json_out.parent / PLOT)
        if not args.skip_recipes:
            results["recipes"] = time_recipes(args, dataset, tmp)
    results["load_average_after"] = round(load_average(), 2)
    print(f"load average after: {results['load_average_after']}")
    if args.json_out is not None:
        write_results(args.json_out, results, args.num_threads)


def time_recipes(args, dataset: str, tmp: pathlib.Path) -> dict:
    """make demo's recipe before and now, alternating; per run its loss over every window and its times."""
    before = before_flags()
    quick = ["--max_train_steps", "10", "--eval_steps", "5", "--checkpointing_steps", "none"] if args.quick else []
    runs = {"before": [], "now": []}
    for repeat in range(args.repeats):
        for name, extra in (("before", before), ("now", [])):
            run = run_ours(dataset, tmp / f"recipe-{name}", args.num_threads, [*extra, *quick])
            runs[name].append(run)
            print(f"{name:<7} run {repeat + 1}: validation {run['val_loss_every_window']:.4f}, whole command "
                  f"{run['command_s']:.1f} s, loop {run['loop_s']:.1f} s", flush=True)  # fmt: skip
    pairs = [
        {"command": now["command_s"] / was["command_s"], "loop": now["loop_s"] / was["loop_s"]}
        for was, now in zip(runs["before"], runs["now"])
    ]
    summary = {
        name: {
            "val_loss_every_window": measured[-1]["val_loss_every_window"],  # seeded: the same in every repeat
            "steps": measured[-1]["steps"],
            "command_s": statistics.median(r["command_s"] for r in measured),
            "loop_s": statistics.median(r["loop_s"] for r in measured),
            "runs": measured,
        }
        for name, measured in runs.items()
    }
    summary["before_flags"] = before
    summary["ratios"] = pairs
    summary["ratio_command"] = round(statistics.median(p["command"] for p in pairs), 3)
    summary["ratio_loop"] = round(statistics.median(p["loop"] for p in pairs), 3)
    summary["goal_loss"] = GOAL_LOSS
    summary["meets_goal"] = bool(
        summary["now"]["val_loss_every_window"] <= GOAL_LOSS and summary["ratio_command"] <= 1.0
    )
    print(f"now / before: whole command {summary['ratio_command']:.2f}x, loop {summary['ratio_loop']:.2f}x; "
          f"validation {summary['now']['val_loss_every_window']:.4f} (goal <= {GOAL_LOSS} in no more time: "
          f"{'yes' if summary['meets_goal'] else 'no'})")  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
