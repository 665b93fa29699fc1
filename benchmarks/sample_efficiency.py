"""make demo's recipe before Muon and now: each one's wall time, beside the tokens each needs to a validation loss.

    python -m benchmarks.sample_efficiency --json_out benchmarks/results/sample_efficiency.json
    python -m benchmarks.sample_efficiency --quick   # smoke test: 10-step recipes

1. **The recipes** (wall time, which load changes): make demo's command, ``training/pretrain.py --config
   training/configs/shakespeare_char.yaml``, against the recipe before Muon, ``--config
   training/configs/shakespeare_char_adamw.yaml``, each a fresh process on ``--num_threads`` threads, alternating
   (before, now, before, now), scored as ``benchmarks/shakespeare_char.py`` scores it: the loss over every
   64-character window of the validation split, the whole command's and the training loop's time, and now / before
   for each pair.
2. **The grid** (tokens to a loss, which no machine load changes) is not run here: it is read from the results of
   ``python -m experiments.sample_efficiency`` (``experiments/results/sample_efficiency/results.json``, or
   ``--experiment_dir``), which trains each setting and draws the figure (``tokens_to_target.png`` beside its
   report): per setting, tokens to the target per seed, their mean and spread, the final validation loss.

The JSON holds both, the CPU and the load average before and after. The machine these run on may be shared: only
the ratios of one pair compare wall times. How long each part takes: benchmarks/notes/main-job-recipe.md.
"""

import argparse
import json
import pathlib
import statistics
import tempfile

import numpy as np
import torch

from benchmarks.common import cpu_features, load_average, write_results
from benchmarks.shakespeare_char import run_ours
from experiments.common import RESULTS_DIR
from experiments.sample_efficiency import ADAMW_RECIPE, NAME, RECIPE
from training.checkpointing import cpu_model
from training.data import tiny_shakespeare

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPES = {"before": ADAMW_RECIPE, "now": RECIPE}  # timed in this order, alternating
GOAL_LOSS = 1.60  # the goal the recipe was changed for: validation <= 1.60 in no more wall time than before


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


def read_grid(folder: pathlib.Path) -> dict:
    """The grid of the experiment's results.json in ``folder``: where it is, the experiment's wall time, and
    ``grid_summary`` of its numbers."""
    path = folder / "results.json"
    if not path.is_file():
        raise ValueError(
            f"{path} does not exist: run `python -m experiments.sample_efficiency` (its results go to "
            f"{RESULTS_DIR.relative_to(REPO_ROOT) / NAME}) or pass --experiment_dir with the folder it wrote."
        )
    results = json.loads(path.read_text())
    if results.get("experiment") != NAME:
        raise ValueError(f"{path} holds the results of {results.get('experiment')!r}, not of {NAME}.")
    folder = folder.resolve()
    where = str(folder.relative_to(REPO_ROOT)) if folder.is_relative_to(REPO_ROOT) else None
    return {"experiment": where, "wall_time_s": results["wall_time_s"], **grid_summary(results)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset_name", default=None, help="default: the local copy if present, else the Hub id")
    parser.add_argument("--num_threads", type=int, default=2, help="torch threads of each recipe run (make demo's)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each recipe, alternating; medians reported")
    parser.add_argument("--quick", action="store_true", help="smoke test: 10-step recipes")
    parser.add_argument("--experiment_dir", type=pathlib.Path, default=RESULTS_DIR / NAME,
                        help="the experiment's report folder, whose results.json gives the grid "
                        "(default: experiments/results/sample_efficiency)")  # fmt: skip
    parser.add_argument("--json_out", type=pathlib.Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    dataset = args.dataset_name or tiny_shakespeare()

    results = {"cpu": cpu_model(), "cpu_features": cpu_features(), "torch": torch.__version__,
               "load_average_before": round(load_average(), 2)}  # fmt: skip
    print(
        f"CPU: {results['cpu']} ({', '.join(results['cpu_features'])}); load average {results['load_average_before']}"
    )
    results["grid"] = read_grid(args.experiment_dir)
    with tempfile.TemporaryDirectory(prefix="decoderlab-sample-efficiency-") as tmp:
        results["recipes"] = time_recipes(args, dataset, pathlib.Path(tmp))
    results["load_average_after"] = round(load_average(), 2)
    print(f"load average after: {results['load_average_after']}")
    if args.json_out is not None:
        write_results(args.json_out, results, args.num_threads)


def time_recipes(args, dataset: str, tmp: pathlib.Path) -> dict:
    """make demo's recipe before and now, alternating; per run its loss over every window and its times."""
    quick = ["--max_train_steps", "10", "--eval_steps", "5", "--checkpointing_steps", "none"] if args.quick else []
    runs = {name: [] for name in RECIPES}
    for repeat in range(args.repeats):
        for name, recipe in RECIPES.items():
            # run_ours's command starts with the default recipe's --config; a later one replaces it (argparse
            # keeps the last)
            run = run_ours(dataset, tmp / f"recipe-{name}", args.num_threads, ["--config", str(recipe), *quick])
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
    summary["recipe_files"] = {name: recipe.relative_to(REPO_ROOT).as_posix() for name, recipe in RECIPES.items()}
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
