"""Peak memory of a training rank: from prepared token shards, and from the same corpus read in memory.

    python -m benchmarks.rss --json_out benchmarks/results/rss.json      # 314M training tokens: ~1.4 GB on disk

A corpus laid out like FineWeb-Edu (``benchmarks.prepare_data.write_corpus``) of ``--megabytes`` MB of text is made in
a temporary folder and prepared with a character tokenizer, so its tokens are its characters (314M of them train by
default, 5% of the documents validate). A
tiny model then trains 20 steps on it in a fresh process, each way: ``--prepared_data`` (the shards memory-mapped)
and ``--dataset_name`` (the map-style path: tokenized by ``datasets.map`` into its Arrow cache, then every block in
one tensor). The figure is the process's peak resident memory (VmHWM, the kernel's high-water mark), read when
training is done; pages of the memory-mapped shards it touched count in it (they are the page cache's, shared by
every rank of a machine). The goal for the prepared path is under 1.5 GB per rank.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from benchmarks.common import _memory_status_bytes, load_average, machine_line, write_timing
from benchmarks.prepare_data import REPO_ROOT, write_corpus

TINY = ["--block_size", "256", "--per_device_train_batch_size", "8", "--max_train_steps", "20", "--logging_steps",
        "10", "--eval_steps", "none", "--max_eval_samples", "16", "--checkpointing_steps", "none",
        "--model.hidden_size", "64", "--model.num_hidden_layers", "2", "--model.num_attention_heads", "2"]  # fmt: skip


def worker(arguments: list[str]) -> None:
    """Train with ``arguments`` in this process, then print its peak resident memory as JSON."""
    from training import pretrain

    pretrain.main(arguments)
    print(json.dumps({"peak_rss_bytes": _memory_status_bytes("VmHWM")}))


def peak_rss(arguments: list[str], env: dict) -> int:
    command = [sys.executable, "-m", "benchmarks.rss", "--worker", json.dumps(arguments)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_bytes"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=330.0, help="size of the corpus's text (= its tokens)")
    parser.add_argument("--skip_in_memory", action="store_true", help="measure the prepared path only")
    parser.add_argument("--json_out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    load_before = load_average()
    print(machine_line(threads=1))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "HF_DATASETS_CACHE": str(tmp / "cache"), "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
        write_corpus(tmp / "corpus", args.megabytes)
        prepare = [sys.executable, str(REPO_ROOT / "training" / "prepare_data.py"), "--dataset_name",
                   str(tmp / "corpus"), "--output_dir", str(tmp / "data"), "--tokenizer_type", "char"]  # fmt: skip
        subprocess.run(prepare, env=env, check=True, capture_output=True)
        meta = json.loads((tmp / "data" / "meta.json").read_text())
        print(f"prepared corpus: {meta['train_tokens']:,} training tokens in {len(meta['train'])} shards")
        results["prepared"] = peak_rss([*TINY, "--prepared_data", str(tmp / "data"), "--output_dir",
                                        str(tmp / "run-prepared")], env)  # fmt: skip
        print(f"  --prepared_data: peak RSS {results['prepared'] / 2**30:.2f} GiB (goal < 1.5 GB)")
        if not args.skip_in_memory:
            results["in_memory"] = peak_rss([*TINY, "--dataset_name", str(tmp / "corpus"), "--tokenizer_type",
                                             "pretrained", "--tokenizer_name", str(tmp / "data" / "tokenizer"),
                                             "--output_dir", str(tmp / "run-memory")], env)  # fmt: skip
            print(f"  --dataset_name (in memory): peak RSS {results['in_memory'] / 2**30:.2f} GiB")
    write_timing(args.json_out, 1, load_before, megabytes=args.megabytes, train_tokens=meta["train_tokens"],
                 peak_rss_bytes=results)  # fmt: skip


if __name__ == "__main__":
    main()
