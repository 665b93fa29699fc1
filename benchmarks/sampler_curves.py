"""Validation loss against step for each ``window_sampling``, beside nanoGPT's recipe, over many passes of one text.

    nice -n 5 python -m benchmarks.sampler_curves --json_out benchmarks/results/sampler_curves.json   # ~10 min
    python -m benchmarks.sampler_curves --demo --json_out benchmarks/results/sampler_demo.json   # make demo's recipe

A text seen 20 times or more is where the training windows matter: fixed blocks show the model the same
few hundred windows every pass, and it learns them by heart. To see that on two CPU cores within minutes, every run
trains on the first ``--train_chars`` characters of nanoGPT's Tiny Shakespeare training split (its first 90%)
for ``--passes`` passes, and is scored on the first ``--val_chars`` characters of its validation split (the last
10%), which it never trains on. The runs, one after the other in fresh processes, each with ``--threads`` threads:

- decoderlab's default recipe (``training/configs/shakespeare_char.yaml``: 4 layers x 128, blocks of 64, batch 16,
  its learning rates and schedule) with each ``--window_sampling`` asked for; every run evaluates every block of
  the validation text at every ``--eval_steps``;
- ``benchmarks/reference_nanogpt.py``'s recipe (nanoGPT's model and ``get_batch``: random offsets with
  replacement) at the same model size, batch and steps, on the same text; its periodic estimate is nanoGPT's
  (``--eval_iters`` random batches of the validation text), its last point the loss over every window of it.

Losses do not depend on the machine's load; the times in the JSON do (the CPU and the load average are recorded).
The JSON holds every curve, each run's best validation loss and its step; ``--plot`` draws them (matplotlib).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from benchmarks.common import load_average, machine_line, write_results
from benchmarks.reference_nanogpt import CharData, NanoGPTConfig, load_char_data, run_nanogpt_recipe
from training.data import tiny_shakespeare
from training.loop import METRICS_NAME, read_metrics

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "training" / "configs" / "shakespeare_char.yaml"
BLOCK_SIZE, BATCH_SIZE = 64, 16  # the default recipe's
SAMPLINGS = ("blocks", "random", "shifted", "permutation")


def subset(data: CharData, train_chars: int, val_chars: int) -> CharData:
    return CharData(train=data.train[:train_chars], val=data.val[:val_chars], chars=data.chars)


def steps_for(train_chars: int, passes: float) -> int:
    """Steps of ``BATCH_SIZE`` windows of ``BLOCK_SIZE`` tokens that hold ``passes`` times the text's tokens."""
    return max(1, round(passes * train_chars / (BATCH_SIZE * BLOCK_SIZE)))


def pretrain(command: list[str], threads: int, output: pathlib.Path) -> tuple[float, list[dict], list[dict]]:
    """Run a training.pretrain ``command`` offline on ``threads`` threads: its wall time, its metrics records and its
    validation curve ([{"step", "val"}])."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, cwd=REPO_ROOT)
    wall = time.perf_counter() - start
    records = read_metrics(output / METRICS_NAME)
    return wall, records, [{"step": r["step"], "val": r["eval_loss"]} for r in records if "eval_loss" in r]


def run_decoderlab(sampling: str, files: tuple[pathlib.Path, pathlib.Path], steps: int, eval_steps: int,
                   threads: int, work: pathlib.Path, extra: list[str]) -> dict:  # fmt: skip
    """``training/pretrain.py`` with the default recipe on ``files`` (train, validation): its validation curve."""
    output = work / f"run-{sampling}"
    command = [
        sys.executable, "-m", "training.pretrain", "--config", str(RECIPE), "--train_file", str(files[0]),
        "--validation_file", str(files[1]), "--output_dir", str(output), "--overwrite_output_dir", "--window_sampling", sampling,
        "--max_train_steps", str(steps), "--eval_steps", str(eval_steps), "--max_eval_samples", "none",
        "--logging_steps", str(eval_steps), "--checkpointing_steps", "none", *extra,
    ]  # fmt: skip
    wall, records, curve = pretrain(command, threads, output)
    train = [{"step": r["step"], "train": r["train_loss"]} for r in records if r.get("train_loss") is not None]
    return {"name": f"decoderlab, window_sampling={sampling}", "sampling": sampling, "wall_time_s": wall,
            "curve": curve, "train_curve": train, "final_val": curve[-1]["val"]}  # fmt: skip


def run_demo(sampling: str, threads: int, work: pathlib.Path, extra: list[str]) -> dict:
    """``make demo``'s training command (the default recipe on the whole of Tiny Shakespeare) with ``sampling``:
    its final validation loss (every validation block), its curve, and its training loop's time."""
    output = work / f"demo-{sampling}"
    command = [
        sys.executable, "-m", "training.pretrain", "--config", str(RECIPE), "--dataset_name", tiny_shakespeare(),
        "--output_dir", str(output), "--overwrite_output_dir", "--window_sampling", sampling, *extra,
    ]  # fmt: skip
    wall, records, curve = pretrain(command, threads, output)
    last_train = [r for r in records if r.get("train_loss") is not None][-1]
    return {"name": f"make demo, window_sampling={sampling}", "sampling": sampling, "command_s": wall,
            "loop_s": last_train["elapsed_s"], "steps": last_train["step"], "curve": curve,
            "final_val": curve[-1]["val"]}  # fmt: skip


def run_reference(data: CharData, steps: int, eval_steps: int, eval_iters: int, threads: int, seed: int) -> dict:
    """nanoGPT's recipe (random offsets with replacement) at the default recipe's model size, batch and steps."""
    config = NanoGPTConfig(block_size=BLOCK_SIZE, vocab_size=data.vocab_size, n_layer=4, n_head=4, n_embd=128)
    result = run_nanogpt_recipe(steps, eval_interval=eval_steps, eval_iters=eval_iters, num_threads=threads,
                                model_config=config, data=data, batch_size=BATCH_SIZE, seed=seed)  # fmt: skip
    # nanoGPT's loop estimates before step `iter` runs, so its estimate at `iter` follows `iter` steps
    curve = [{"step": h["iter"], "val": h["val"]} for h in result["history"]]
    train = [{"step": h["iter"], "train": h["train"]} for h in result["history"]]
    return {"name": "nanoGPT's recipe (reference_nanogpt.py: random offsets)", "sampling": "reference",
            "wall_time_s": result["wall_time_s"], "curve": curve, "train_curve": train,
            "final_val": result["val_loss_every_window"], "num_parameters": result["num_parameters"]}  # fmt: skip


def best(run: dict) -> dict:
    point = min(run["curve"], key=lambda p: p["val"])
    return {"best_val": point["val"], "best_step": point["step"]}


def plot(runs: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        steps, losses = zip(*((p["step"], p["val"]) for p in run["curve"]))
        axes.plot(steps, losses, marker=".", label=run["name"])
    axes.set_xlabel("step")
    axes.set_ylabel("validation loss")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train_chars", type=int, default=40_000, help="characters of the training split used")
    parser.add_argument("--val_chars", type=int, default=32_768, help="characters of the validation split used")
    parser.add_argument("--passes", type=float, default=20.0, help="times each run sees the training text")
    parser.add_argument("--eval_steps", type=int, default=100)
    parser.add_argument("--eval_iters", type=int, default=40, help="the reference's random validation batches")
    parser.add_argument("--samplings", nargs="+", default=list(SAMPLINGS), choices=SAMPLINGS)
    parser.add_argument("--skip_reference", action="store_true")
    parser.add_argument("--seed", type=int, default=1337, help="every run's seed (the recipe's and nanoGPT's: 1337)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json_out", default=None)
    parser.add_argument("--plot", default=None, help="a PNG of the curves (default: beside --json_out)")
    parser.add_argument("--demo", action="store_true", help="instead: make demo's recipe with each sampling")
    parser.add_argument("extra", nargs="*", help="after --: more pretrain.py flags for the decoderlab runs")
    args = parser.parse_args(argv)
    load_before = load_average()
    print(machine_line(args.threads))
    if args.demo:
        return demo(args, load_before)
    data = subset(load_char_data(), args.train_chars, args.val_chars)
    steps = steps_for(len(data.train), args.passes)
    print(f"{len(data.train):,} training characters, {steps} steps of {BATCH_SIZE} x {BLOCK_SIZE}: "
          f"{steps * BATCH_SIZE * BLOCK_SIZE / len(data.train):.1f} passes")  # fmt: skip
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        files = (work / "train.txt", work / "validation.txt")
        for path, ids in zip(files, (data.train, data.val)):
            path.write_text("".join(data.chars[i] for i in ids.tolist()), encoding="utf-8")
        for sampling in args.samplings:
            extra = ["--seed", str(args.seed), *args.extra]
            runs.append(run_decoderlab(sampling, files, steps, args.eval_steps, args.threads, work, extra))
            print(f"{runs[-1]['name']}: best {best(runs[-1])}, {runs[-1]['wall_time_s']:.0f} s", flush=True)
    if not args.skip_reference:
        runs.append(run_reference(data, steps, args.eval_steps, args.eval_iters, args.threads, args.seed))
        print(f"{runs[-1]['name']}: best {best(runs[-1])}, {runs[-1]['wall_time_s']:.0f} s", flush=True)
    for run in runs:
        run.update(best(run))
    result = {
        "machine": machine_line(args.threads),
        "load_average": [load_before, load_average()],
        "train_chars": len(data.train),
        "val_chars": len(data.val),
        "block_size": BLOCK_SIZE,
        "batch_size": BATCH_SIZE,
        "steps": steps,
        "passes": steps * BATCH_SIZE * BLOCK_SIZE / len(data.train),
        "eval_steps": args.eval_steps,
        "seed": args.seed,
        "runs": runs,
    }
    print(json.dumps([{k: run[k] for k in ("name", "best_val", "best_step", "final_val")} for run in runs], indent=1))
    if args.json_out:
        write_results(args.json_out, result, args.threads)
    plot_path = args.plot or (pathlib.Path(args.json_out).with_suffix(".png") if args.json_out else None)
    if plot_path is not None:
        title = (f"{len(data.train):,} characters of Tiny Shakespeare, {result['passes']:.0f} passes, "
                 f"blocks of {BLOCK_SIZE}, batch {BATCH_SIZE}")  # fmt: skip
        plot(runs, pathlib.Path(plot_path), title)
    return result


def demo(args: argparse.Namespace, load_before: float) -> dict:
    """``--demo``: the default recipe as ``make demo`` trains it, once per sampling; the final validation loss
    decides (the times depend on the machine's load)."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for sampling in args.samplings:
            runs.append(run_demo(sampling, args.threads, pathlib.Path(tmp), args.extra))
            print(f"{runs[-1]['name']}: final validation {runs[-1]['final_val']:.4f}, loop {runs[-1]['loop_s']:.0f} s",
                  flush=True)  # fmt: skip
    for run in runs:
        run.update(best(run))
    result = {"machine": machine_line(args.threads), "load_average": [load_before, load_average()],
              "recipe": str(RECIPE.relative_to(REPO_ROOT)), "extra": args.extra, "runs": runs}  # fmt: skip
    if args.json_out:
        write_results(args.json_out, result, args.threads)
    return result


if __name__ == "__main__":
    main()
