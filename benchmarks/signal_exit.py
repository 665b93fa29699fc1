"""Time from a stop signal to the exit of training/pretrain.py, and how long its save takes: what to give a job as its
grace period (SLURM's ``--signal=...@SECONDS``, Kubernetes' terminationGracePeriodSeconds).

    python -m benchmarks.signal_exit --json_out benchmarks/results/signal_exit.json

Two shapes, each a fresh ``pretrain.py`` on Tiny Shakespeare (the local copy) signalled with SIGTERM once its
metrics show five steps: ``make demo``'s recipe (training/configs/shakespeare_char.yaml: 4 x 128, 0.8M parameters) and
the GPT-2-small shape (the ``gpt2`` preset at 12 x 768 x 12 with GPT-2's 50,257-token vocabulary: 124M parameters;
blocks of 128 tokens, one a step, to keep a CPU step short). Each run is timed in three parts, from the
output folder watched every 5 ms: the step in flight (the signal until the save's ``step_N.tmp`` appears), the save
(until ``step_N`` appears: weights, AdamW's moments, RNG states, fsync and rename), and the exit (until the process
ends, status 75). On a GPU the step in flight is far shorter; the save is bound by the disk and by the size of the
state (12 bytes per parameter in float32 with AdamW: the weights and two moments), which is why it is reported apart.
"""

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

from benchmarks.common import load_average, machine_line, write_timing
from decoderlab.configuration_decoderlab import PRESETS, SIZES

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PRETRAIN = REPO_ROOT / "training" / "pretrain.py"
DATA = REPO_ROOT.parent / "shared" / "data" / "tiny_shakespeare"  # the offline copy beside the checkout
COMMON = ["--logging_steps", "1", "--eval_steps", "none", "--load_best_model_at_end", "false", "--max_eval_samples", "8",
          "--checkpointing_steps", "none", "--max_train_steps", "100000"]  # fmt: skip
WARM_STEPS = 5  # the signal comes after this many steps' records, once a step takes its usual time


def shapes(tmp: pathlib.Path) -> dict[str, list[str]]:
    """Each shape's pretrain.py arguments (before --output_dir)."""
    gpt2_small = tmp / "gpt2_small.yaml"
    model = {**PRESETS["gpt2"], **SIZES["small"], "vocab_size": 50257}
    gpt2_small.write_text(yaml.safe_dump({"model": model, "block_size": 128, "per_device_train_batch_size": 1}))
    return {
        "make demo (shakespeare_char)": ["--config", str(REPO_ROOT / "training" / "configs" / "shakespeare_char.yaml")],
        "GPT-2 small shape (124M)": ["--config", str(gpt2_small)],
    }


def folder_bytes(folder: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def one_run(arguments: list[str], output: pathlib.Path, env: dict) -> dict:
    """Launch, SIGTERM after ``WARM_STEPS`` steps, and time the step in flight, the save and the exit (seconds)."""
    metrics = output / "metrics.jsonl"
    log = output.with_name(output.name + ".log")  # a file: a pipe nobody reads while it runs could fill and block it
    with log.open("w") as stderr:
        process = subprocess.Popen([sys.executable, str(PRETRAIN), *arguments, "--output_dir", str(output)], env=env,
                                   stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= WARM_STEPS):
        if process.poll() is not None:
            raise RuntimeError(f"pretrain.py ended before step {WARM_STEPS}:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)
    elapsed = [json.loads(line)["elapsed_s"] for line in metrics.read_text().splitlines()]
    step_s = statistics.median(later - earlier for earlier, later in zip(elapsed[1:], elapsed[2:]))  # after the first
    signalled = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    marks = {}
    while process.poll() is None:
        names = {p.name for p in output.glob("step_*")}
        if "save_started" not in marks and names:
            marks["save_started"] = time.perf_counter()
        if "saved" not in marks and any(not name.endswith(".tmp") for name in names):
            marks["saved"] = time.perf_counter()
        time.sleep(0.005)
    exited = time.perf_counter()
    if process.returncode != 75 or "saved" not in marks:
        raise RuntimeError(
            f"pretrain.py exited with {process.returncode} without its checkpoint:\n{log.read_text()[-3000:]}"
        )
    marks.setdefault("save_started", marks["saved"])  # a save faster than the 5 ms watch
    checkpoint = next(p for p in output.glob("step_*") if not p.name.endswith(".tmp"))
    return {
        "step_s": round(step_s, 3),
        "step_in_flight_s": round(marks["save_started"] - signalled, 3),
        "save_s": round(marks["saved"] - marks["save_started"], 3),
        "exit_s": round(exited - marks["saved"], 3),
        "signal_to_exit_s": round(exited - signalled, 3),
        "checkpoint_bytes": folder_bytes(checkpoint),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each shape")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the runs (make demo's: 2)")
    parser.add_argument("--json_out", help="write the results here (benchmarks/results/signal_exit.json)")
    args = parser.parse_args(argv)

    load_before = load_average()
    print(machine_line(args.threads))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads),
               "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
        for name, arguments in shapes(tmp).items():
            runs = []
            for repeat in range(args.repeats):
                output = tmp / f"run-{repeat}"
                runs.append(one_run([*arguments, *COMMON, "--dataset_name", str(DATA)], output, env))
                shutil.rmtree(output)
                print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in runs[-1].items()))
            medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            results[name] = {"median": medians, "runs": runs}
            print(f"median {name}: signal to exit {medians['signal_to_exit_s']:.2f} s (step in flight "
                  f"{medians['step_in_flight_s']:.2f} s, save {medians['save_s']:.2f} s of "
                  f"{medians['checkpoint_bytes'] / 2**20:,.0f} MiB, exit {medians['exit_s']:.2f} s)")  # fmt: skip
    write_timing(args.json_out, args.threads, load_before, shapes=results)


if __name__ == "__main__":
    main()
