"""Our default recipe against nanoGPT's shakespeare_char CPU recipe, on this machine, one after the other.

    python -m benchmarks.shakespeare_char                            # both recipes, 4-5 minutes on 2 idle cores
    python -m benchmarks.shakespeare_char --skip_reference           # only ours
    python -m benchmarks.shakespeare_char -- --max_train_steps 200   # anything after -- goes to pretrain.py

Each recipe runs in a fresh process with the same number of threads (2 by default):
``training/pretrain.py --config training/configs/shakespeare_char.yaml`` and
``benchmarks/reference_nanogpt.py`` (nanoGPT's model and recipe, re-implemented). For both it
prints:

- the validation loss over every 64-token window of the validation split: the split (nanoGPT's
  last 10% of Tiny Shakespeare) cut into consecutive, non-overlapping windows that cover all of it,
  each token after a window's first predicted from the tokens before it in its window, averaged
  over tokens (``reference_nanogpt.windowed_val_loss``, the same function for both models);
- the wall time of the training loop, periodic evaluations included (start-up, data preparation and
  the final evaluation and save excluded, for both); for ours also the whole process's time;
- the ratio of the two loop times.

The load average is printed before and after. Measure on an idle machine: with two threads per
process, any other busy process makes PyTorch's OpenMP threads wait for each other and a run
several times slower (seen here: 3-25x).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import decoderlab  # noqa: F401  (registers decoderlab with the Auto classes)
from benchmarks.reference_nanogpt import load_char_data, windowed_val_loss
from training.data import tiny_shakespeare
from training.loop import METRICS_NAME, read_metrics

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "training" / "configs" / "shakespeare_char.yaml"
BLOCK_SIZE = 64


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_ours(dataset: str, output_dir: pathlib.Path, threads: int, extra: list[str]) -> dict:
    """Train the default recipe in a fresh process; its loop time is the last training record's elapsed_s."""
    command = [sys.executable, str(REPO_ROOT / "training" / "pretrain.py"), "--config", str(RECIPE)]
    command += ["--dataset_name", dataset, "--output_dir", str(output_dir), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    process_time = time.perf_counter() - start
    records = read_metrics(output_dir / METRICS_NAME)
    last_train = [r for r in records if "train_loss" in r][-1]
    return {"steps": last_train["step"], "wall_time_s": last_train["elapsed_s"], "process_time_s": process_time}


def run_reference(threads: int, output: pathlib.Path) -> dict:
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "reference_nanogpt.py"), "--quiet"]
    command += ["--num_threads", str(threads), "--json_out", str(output)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return json.loads(output.read_text())


@torch.no_grad()
def every_window_loss(checkpoint: pathlib.Path) -> float:
    """Our checkpoint's loss over every 64-token window of nanoGPT's validation split."""
    data = load_char_data()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))] != list(data.chars):
        raise ValueError(
            f"{checkpoint}'s vocabulary is not nanoGPT's 65 sorted characters: the losses would not compare."
        )
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    return windowed_val_loss(lambda ids: model(input_ids=ids, use_cache=False).logits, data.val, BLOCK_SIZE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset_name", default=None, help="default: the local copy if present, else the Hub id")
    parser.add_argument("--num_threads", type=int, default=2, help="torch threads of each run")
    parser.add_argument("--skip_reference", action="store_true", help="run only our recipe")
    parser.add_argument("--output_dir", type=pathlib.Path, default=None, help="keep our checkpoint here")
    parser.add_argument("--json_out", type=pathlib.Path, default=None, help="also write the results here")
    parser.add_argument("pretrain_args", nargs="*", help="extra pretrain.py flags, after --")
    args = parser.parse_args()
    dataset = args.dataset_name or tiny_shakespeare()

    print(f"load average before: {load_average()}")
    with tempfile.TemporaryDirectory(prefix="decoderlab-bench-") as tmp:
        output_dir = args.output_dir or pathlib.Path(tmp) / "shakespeare_char"
        results = {"ours": run_ours(dataset, output_dir, args.num_threads, args.pretrain_args)}
        results["ours"]["val_loss_every_window"] = every_window_loss(output_dir)
        if not args.skip_reference:
            reference = run_reference(args.num_threads, pathlib.Path(tmp) / "reference.json")
            results["nanogpt"] = {k: reference[k] for k in ("steps", "wall_time_s", "val_loss_every_window")}
    print(f"load average after:  {load_average()}")

    print(f"\n{'recipe':<32}{'steps':>7}{'loop time':>12}{'val loss, every 64-token window':>34}")
    for name, label in (("nanogpt", "nanoGPT shakespeare_char (CPU)"), ("ours", "decoderlab shakespeare_char")):
        if name in results:
            r = results[name]
            print(f"{label:<32}{r['steps']:>7}{r['wall_time_s']:>11.1f}s{r['val_loss_every_window']:>34.4f}")
    print(f"(decoderlab's whole process, start-up and saving included: {results['ours']['process_time_s']:.1f} s)")
    if "nanogpt" in results:
        ratio = results["ours"]["wall_time_s"] / results["nanogpt"]["wall_time_s"]
        print(f"time ratio decoderlab / nanoGPT: {ratio:.2f}")
        results["time_ratio"] = ratio
    results.update(num_threads=args.num_threads, dataset=pathlib.Path(dataset).name, torch=torch.__version__)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
