"""Resume cost: time from launching training/pretrain.py to its first step, resuming at step 10 and at step 10,000.

    python -m benchmarks.resume_time --json_out benchmarks/results/resume_time.json

Two kinds of data, on one corpus laid out like FineWeb-Edu (``benchmarks.prepare_data.write_corpus``): prepared
token shards (``--prepared_data``) and the stream (``--streaming``). A tiny model trains 10 real steps of the ``fineweb_edu_bpe`` recipe's data shape
(16 blocks of 1024 tokens of a byte-level BPE; the stream shuffles windows of 1000 blocks) and saves a checkpoint; the checkpoint at step 10,000 is that checkpoint with its step set to 10,000 and, for the stream, the
data position a stream really reaches after 10,000 batches (``StreamBatches`` read that far here, untimed): what
resuming costs depends on the data position, not on the weights. Each resume is a fresh process, timed from launch
until its first step's record is in metrics.jsonl; the stream is also resumed without its saved position (the
replay older checkpoints fall back on, the only way before). The runs alternate, ``--repeats`` times.

    python -m benchmarks.resume_time --tiny_shakespeare --json_out benchmarks/results/resume_time-tiny_shakespeare.json

times instead ``make demo``'s recipe on Tiny Shakespeare from a fresh start (launch to first step, and
the loop; ``--steps``): in memory, in memory without the read-ahead thread, and from prepared shards; what decides whether the
small corpus needs the preparation step, and that the thread costs ``make demo`` nothing.
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import load_average, machine_line, write_timing
from benchmarks.prepare_data import REPO_ROOT, write_corpus

PRETRAIN = REPO_ROOT / "training" / "pretrain.py"
# the fineweb_edu_bpe recipe's data shape (blocks of 1024 tokens, 16 a step, a byte-level BPE) with a tiny model
BLOCK, BATCH, WINDOW = 1024, 16, 1000
TINY = ["--block_size", str(BLOCK), "--per_device_train_batch_size", str(BATCH), "--logging_steps", "1",
        "--eval_steps", "none", "--max_eval_samples", "4", "--model.hidden_size", "32", "--model.num_hidden_layers",
        "1", "--model.num_attention_heads", "2", "--checkpoints_total_limit", "5"]  # fmt: skip
FAR = 10_000


def environment(tmp: pathlib.Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "HF_DATASETS_CACHE": str(tmp / "cache"), "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip


def time_to_first_step(arguments: list[str], output: pathlib.Path, first: int, env: dict) -> float:
    """Launch pretrain.py and return the seconds until metrics.jsonl records step ``first``; then stop it."""
    metrics = output / "metrics.jsonl"
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, str(PRETRAIN), *arguments], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    while not (metrics.is_file() and any(json.loads(line)["step"] == first for line in metrics.read_text().splitlines())):
        if process.poll() is not None:
            raise RuntimeError(f"pretrain.py ended before step {first}:\n{process.stderr.read()[-3000:]}")
        time.sleep(0.01)
    seconds = time.perf_counter() - start
    process.kill()
    process.wait()
    process.stderr.close()
    return seconds


def far_checkpoint(near: pathlib.Path, far: pathlib.Path, stream_position: dict | None) -> None:
    """``near`` (step 10) copied to ``far`` as step FAR, with the stream's position after FAR batches."""
    shutil.copytree(near, far)
    state = json.loads((far / "training_state.json").read_text())
    (far / "training_state.json").write_text(json.dumps({**state, "step": FAR}))
    if stream_position is not None:
        (far / "data_state_0.json").write_text(json.dumps(stream_position))


def stream_position_after(corpus: pathlib.Path, tokenizer_folder: pathlib.Path, batches: int) -> dict:
    """Where the stream of the runs below stands after ``batches`` micro-batches (read here, untimed)."""
    from transformers import AutoTokenizer

    from training.args import TrainConfig
    from training.data import Packing, StreamBatches, load_text_splits, prepare_streaming

    cfg = TrainConfig(dataset_name=str(corpus), streaming=True, block_size=BLOCK, streaming_validation_texts=1000)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    texts, _ = prepare_streaming(*load_text_splits(cfg), tokenizer, Packing.of(cfg), cfg.streaming_validation_texts)
    stream = StreamBatches(texts, tokenizer, Packing.of(cfg), BATCH, seed=1337, shuffle_buffer_size=WINDOW)
    iterator = stream.iterate()
    for _ in range(batches):
        next(iterator)
    return stream.state_dict(batches)


def first_step_and_loop(arguments: list[str], output: pathlib.Path, env: dict) -> tuple[float, float]:
    """Run pretrain.py to its end: (seconds from launch to step 1's record, the loop's seconds from step 1 to the
    last step, from metrics.jsonl's elapsed_s)."""
    metrics = output / "metrics.jsonl"
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, str(PRETRAIN), *arguments], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    while not (metrics.is_file() and metrics.read_text().strip()):
        if process.poll() is not None:
            raise RuntimeError(f"pretrain.py {' '.join(arguments)} failed")
        time.sleep(0.01)
    first = time.perf_counter() - start
    process.wait()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    trained = [r for r in records if "train_loss" in r]
    return first, trained[-1]["elapsed_s"] - trained[0]["elapsed_s"]


def tiny_shakespeare(repeats: int, steps: int, json_out: str | None) -> None:
    """``make demo``'s recipe on Tiny Shakespeare, ``steps`` steps, three ways, each a fresh start: in memory (the
    tokenized blocks in datasets' cache after the first run), in memory without the read-ahead thread
    (``--prefetch_batches 0``), and from prepared shards (prepared once, timed apart)."""
    from training.data import tiny_shakespeare as dataset

    load_before = load_average()
    print(machine_line(threads=2))
    recipe = ["--config", str(REPO_ROOT / "training" / "configs" / "shakespeare_char.yaml"), "--logging_steps", "1",
              "--max_train_steps", str(steps), "--eval_steps", "none", "--load_best_model_at_end", "false",
              "--checkpointing_steps", "none", "--max_eval_samples", "32"]  # fmt: skip
    samples: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        env = {**environment(tmp), "OMP_NUM_THREADS": "2"}  # make demo's threads
        start = time.perf_counter()
        subprocess.run([sys.executable, str(REPO_ROOT / "training" / "prepare_data.py"), *recipe[:2], "--dataset_name",
                        dataset(), "--output_dir", str(tmp / "data")], env=env, check=True, capture_output=True)  # fmt: skip
        preparing = time.perf_counter() - start
        print(f"  prepare_data.py, once: {preparing:.2f} s")
        runs = {
            "in memory (make demo)": ["--dataset_name", dataset()],
            "in memory, no read-ahead": ["--dataset_name", dataset(), "--prefetch_batches", "0"],
            "prepared shards": ["--prepared_data", str(tmp / "data")],
        }
        for round_index in range(repeats + 1):  # the first round fills datasets' cache, untimed
            for index, (name, source) in enumerate(runs.items()):
                output = tmp / f"run-{round_index}-{index}"
                first, loop = first_step_and_loop([*recipe, *source, "--output_dir", str(output)], output, env)
                if round_index:
                    run = samples.setdefault(name, {"first_step_s": [], "loop_s": []})
                    run["first_step_s"].append(first)
                    run["loop_s"].append(loop)
                print(f"  {name:26s} first step after {first:6.2f} s, {steps - 1} steps in {loop:6.2f} s"
                      f"{'' if round_index else ' (warm-up)'}")  # fmt: skip
    medians = {name: {k: statistics.median(v) for k, v in run.items()} for name, run in samples.items()}
    for name, median in medians.items():
        print(f"median {name:26s} first step {median['first_step_s']:6.2f} s, loop {median['loop_s']:6.2f} s")
    write_timing(json_out, 2, load_before, prepare_data_s=preparing, medians=medians, samples=samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=30.0, help="size of the corpus's text")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny_shakespeare", action="store_true",
                        help="instead: make demo's fresh start in memory against from prepared shards")  # fmt: skip
    parser.add_argument("--steps", type=int, default=200, help="--tiny_shakespeare: steps of each run")
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args(argv)
    if args.tiny_shakespeare:
        tiny_shakespeare(args.repeats, args.steps, args.json_out)
        return
    load_before = load_average()
    print(machine_line(threads=1))
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        env = environment(tmp)
        write_corpus(tmp / "corpus", args.megabytes)
        subprocess.run([sys.executable, str(REPO_ROOT / "training" / "prepare_data.py"), "--dataset_name",
                        str(tmp / "corpus"), "--output_dir", str(tmp / "data"), "--tokenizer_type", "bpe",
                        "--bpe_vocab_size", "8192", "--tokenizer_train_texts", "2000"],
                       env=env, check=True, capture_output=True)  # fmt: skip
        sources = {
            "prepared": ["--prepared_data", str(tmp / "data")],
            "stream": ["--dataset_name", str(tmp / "corpus"), "--streaming", "true", "--tokenizer_type", "pretrained",
                       "--tokenizer_name", str(tmp / "data" / "tokenizer"), "--shuffle_buffer_size", str(WINDOW)],
        }
        runs = {}
        for name, source in sources.items():
            base = tmp / f"{name}-base"
            subprocess.run([sys.executable, str(PRETRAIN), *TINY, *source, "--max_train_steps", "10",
                            "--checkpointing_steps", "10", "--output_dir", str(base)],
                           env=env, check=True, capture_output=True)  # fmt: skip
            position = stream_position_after(tmp / "corpus", tmp / "data" / "tokenizer", FAR) if name == "stream" else None
            far_checkpoint(base / "step_10", tmp / f"{name}-far", position)
            runs[f"{name}, resumed at step 10"] = (source, base / "step_10", 11)
            runs[f"{name}, resumed at step {FAR:,}"] = (source, tmp / f"{name}-far", FAR + 1)
        replay = tmp / "stream-replay"
        shutil.copytree(tmp / "stream-far", replay)
        (replay / "data_state_0.json").unlink()  # a checkpoint without the stream's position: replayed
        runs[f"stream, replayed to step {FAR:,} (before)"] = (sources["stream"], replay, FAR + 1)
        for round_index in range(args.repeats):
            for name, (source, checkpoint, first) in runs.items():
                output = tmp / f"out-{round_index}-{len(samples.get(name, []))}-{abs(hash(name))}"
                arguments = [*TINY, *source, "--max_train_steps", str(first + 5), "--checkpointing_steps", "none",
                             "--output_dir", str(output), "--resume_from_checkpoint", str(checkpoint)]  # fmt: skip
                seconds = time_to_first_step(arguments, output, first, env)
                samples.setdefault(name, []).append(seconds)
                print(f"  {name:42s} {seconds:6.2f} s")
    medians = {name: statistics.median(s) for name, s in samples.items()}
    print("median seconds from launch to the first step:")
    for name, value in medians.items():
        print(f"  {name:42s} {value:6.2f} s")
    write_timing(args.json_out, 1, load_before, megabytes=args.megabytes, far_step=FAR,
                 median_seconds_to_first_step=medians, samples_s=samples)  # fmt: skip


if __name__ == "__main__":
    main()
