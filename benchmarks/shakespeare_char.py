"""Our default recipe against nanoGPT's shakespeare_char CPU recipe, on this machine, side by side.

    python -m benchmarks.shakespeare_char --json_out benchmarks/results/shakespeare_char.json   # ~4 minutes
    python -m benchmarks.shakespeare_char --repeats 2                # nanoGPT, ours, nanoGPT, ours: medians
    python -m benchmarks.shakespeare_char --skip_reference           # only ours
    python -m benchmarks.shakespeare_char -- --max_train_steps 200   # anything after -- goes to pretrain.py

Each recipe runs as a fresh process with the same number of threads (2 by default), as a user runs it:
``training/pretrain.py --config training/configs/shakespeare_char.yaml --dataset_name ...`` (the
command of ``make demo``) and ``benchmarks/reference_nanogpt.py`` (nanoGPT's model and recipe,
re-implemented). With ``--repeats N`` they alternate, so a change in the machine's load hits both.
For each it reports:

- the whole command's wall time, from start to exit: interpreter and imports, data, training, the
  final evaluation, saving (ours: the checkpoint folder, model card and plot). For nanoGPT the time of
  the reference's own extra, the every-window loss below, is left out; its ``prepare.py`` data step,
  which nanoGPT runs as a separate command, is inside (the reference reads the text itself);
- the training loop's wall time, periodic evaluations and checkpoints included;
- the validation loss over every 64-token window of the validation split (nanoGPT's last 10% of
  Tiny Shakespeare cut into consecutive, non-overlapping windows; ``reference_nanogpt.windowed_val_loss``,
  the same function for both models);
- the ratios ours / nanoGPT of both wall times.

The CPU model, the threads, and the 1-minute load average before and after are printed and saved too: with two
threads per process, any other busy process makes PyTorch's OpenMP threads wait for each other and a run
several times slower (seen here: 3-25x), so only figures taken on an idle machine compare across runs;
the ratio from one invocation compares the recipes under the same conditions.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import decoderlab  # noqa: F401  (registers decoderlab with the Auto classes)
from benchmarks.common import cpu_features, load_average, write_results
from benchmarks.reference_nanogpt import load_char_data, windowed_val_loss
from training.checkpointing import cpu_model
from training.data import tiny_shakespeare
from training.loop import METRICS_NAME, read_metrics

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "training" / "configs" / "shakespeare_char.yaml"
BLOCK_SIZE = 64
TARGET_LOSS = 1.65  # what the default recipe must reach, in no more time than nanoGPT's


def timed(command: list[str], threads: int) -> float:
    """Run ``command`` with ``threads`` OpenMP threads, offline; its wall time from start to exit."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def run_ours(dataset: str, output_dir: pathlib.Path, threads: int, extra: list[str]) -> dict:
    """The default recipe's command; its loop time is the last training record's elapsed_s."""
    command = [sys.executable, str(REPO_ROOT / "training" / "pretrain.py"), "--config", str(RECIPE)]
    command += ["--dataset_name", dataset, "--output_dir", str(output_dir), "--overwrite_output_dir", *extra]
    command_time = timed(command, threads)
    last_train = [r for r in read_metrics(output_dir / METRICS_NAME) if "train_loss" in r][-1]
    return {
        "steps": last_train["step"],
        "command_s": round(command_time, 2),
        "loop_s": last_train["elapsed_s"],
        "val_loss_every_window": every_window_loss(output_dir),
    }


def run_reference(threads: int, output: pathlib.Path, max_iters: int) -> dict:
    """nanoGPT's recipe (the re-implementation) as a command; its own every-window loss is not timed."""
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "reference_nanogpt.py"), "--quiet"]
    command += ["--num_threads", str(threads), "--max_iters", str(max_iters), "--json_out", str(output)]
    command_time = timed(command, threads)
    reference = json.loads(output.read_text())
    return {
        "steps": reference["steps"],
        "command_s": round(command_time - reference["window_eval_s"], 2),
        "loop_s": round(reference["wall_time_s"], 3),
        "val_loss_every_window": reference["val_loss_every_window"],
    }


def same_characters(tokenizer, chars: str) -> bool:
    """Whether ids 0..len(chars)-1 are ``chars`` in order and any later id is a special token (the end of text)."""
    first = tokenizer.convert_ids_to_tokens(list(range(min(len(chars), len(tokenizer)))))
    later = tokenizer.convert_ids_to_tokens(list(range(len(chars), len(tokenizer))))
    return first == list(chars) and all(token in tokenizer.all_special_tokens for token in later)


@torch.no_grad()
def every_window_loss(checkpoint: pathlib.Path) -> float:
    """Our checkpoint's loss over every 64-token window of nanoGPT's validation split."""
    data = load_char_data()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if not same_characters(tokenizer, data.chars):
        raise ValueError(
            f"{checkpoint}'s vocabulary is not nanoGPT's {len(data.chars)} sorted characters (ids 0..."
            f"{len(data.chars) - 1}, then special tokens only): the losses would not compare."
        )
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    return windowed_val_loss(lambda ids: model(input_ids=ids, use_cache=False).logits, data.val, BLOCK_SIZE)


def median_run(runs: list[dict]) -> dict:
    """Median wall times over repeats (the loss is the same in every repeat: the runs are seeded)."""
    return {
        "steps": runs[-1]["steps"],
        "command_s": statistics.median(r["command_s"] for r in runs),
        "loop_s": statistics.median(r["loop_s"] for r in runs),
        "val_loss_every_window": runs[-1]["val_loss_every_window"],
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset_name", default=None, help="default: the local copy if present, else the Hub id")
    parser.add_argument("--num_threads", type=int, default=2, help="torch threads of each run")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each recipe, alternating; medians reported")
    parser.add_argument("--skip_reference", action="store_true", help="run only our recipe")
    parser.add_argument("--reference_max_iters", type=int, default=2000, help="nanoGPT's max_iters (its recipe: 2000)")
    parser.add_argument("--output_dir", type=pathlib.Path, default=None, help="keep our (last) checkpoint here")
    parser.add_argument("--json_out", type=pathlib.Path, default=None, help="also write the results here")
    parser.add_argument("pretrain_args", nargs="*", help="extra pretrain.py flags, after --")
    args = parser.parse_args(argv)
    dataset = args.dataset_name or tiny_shakespeare()

    results = {
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "num_threads": args.num_threads,
        "torch": torch.__version__,
        "dataset": pathlib.Path(dataset).name,
        "load_average_before": round(load_average(), 2),
    }
    print(f"CPU: {results['cpu']} ({', '.join(results['cpu_features'])}); {args.num_threads} threads per run")
    print(f"load average before: {results['load_average_before']}", flush=True)
    runs = {"nanogpt": [], "ours": []}
    with tempfile.TemporaryDirectory(prefix="decoderlab-bench-") as tmp:
        output_dir = args.output_dir or pathlib.Path(tmp) / "shakespeare_char"
        for _ in range(args.repeats):
            if not args.skip_reference:
                reference = run_reference(
                    args.num_threads, pathlib.Path(tmp) / "reference.json", args.reference_max_iters
                )
                runs["nanogpt"].append(reference)
            runs["ours"].append(run_ours(dataset, output_dir, args.num_threads, args.pretrain_args))
    results["load_average_after"] = round(load_average(), 2)
    print(f"load average after:  {results['load_average_after']}\n")
    results.update({name: median_run(measured) for name, measured in runs.items() if measured})

    print(f"{'recipe':<32}{'steps':>7}{'whole command':>15}{'training loop':>15}{'val loss, every window':>24}")
    for name, label in (("nanogpt", "nanoGPT shakespeare_char (CPU)"), ("ours", "decoderlab shakespeare_char")):
        if name in results:
            r = results[name]
            print(f"{label:<32}{r['steps']:>7}{r['command_s']:>14.1f}s{r['loop_s']:>14.1f}s"
                  f"{r['val_loss_every_window']:>24.4f}")  # fmt: skip
    if "nanogpt" in results:
        ours, theirs = results["ours"], results["nanogpt"]
        results["ratio_command"] = round(ours["command_s"] / theirs["command_s"], 3)
        results["ratio_loop"] = round(ours["loop_s"] / theirs["loop_s"], 3)
        results["wins"] = ours["val_loss_every_window"] <= TARGET_LOSS and results["ratio_command"] <= 1.0
        print(
            f"decoderlab / nanoGPT: whole command {results['ratio_command']:.2f}x, training loop "
            f"{results['ratio_loop']:.2f}x; loss <= {TARGET_LOSS} in no more time: {'yes' if results['wins'] else 'no'}"
        )
    if args.json_out is not None:
        write_results(args.json_out, results, args.num_threads)


if __name__ == "__main__":
    main()
