"""Preparation throughput: tokens per second per core of training/prepare_data.py against nanoGPT's method.

    python -m benchmarks.prepare_data --json_out benchmarks/results/prepare_data.json
    python -m benchmarks.prepare_data --megabytes 10 --repeats 1        # a quick look

nanoGPT's method (its ``data/openwebtext/prepare.py`` and ``fineweb.py``, written again here): tiktoken's byte-level
BPE through ``datasets.map(num_proc=N)``, each document's ids followed by the end-of-text id, then every id written
into one uint16 file. Ours is the command a user runs: ``training/prepare_data.py`` with ``N`` worker processes,
writing shards and the validation shard. Both read the same local corpus (parquet files laid out like FineWeb-Edu's,
made in a temporary folder from Tiny Shakespeare) and use the same vocabulary: GPT-2's own tiktoken file cannot be
downloaded here, so a byte-level BPE of 32,768 tokens (the ``fineweb_edu_bpe`` recipe's size) is trained on the
corpus once and handed to tiktoken as its mergeable ranks (bytes -> id) and to ours as ``tokenizer.json`` (which
tokenizes it with tiktoken too, when installed: ``training.data.TiktokenBPE``). Each run is
a fresh process that reports the time from its data being loaded to its files being written; the two alternate, so
a change of the machine's load hits both, and the figure is tokens / seconds / processes.
"""

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
FILES = 14


def write_corpus(folder: pathlib.Path, megabytes: float, files: int = FILES, seed: int = 0) -> int:
    """Parquet files ``folder/data/train-000NN-of-000FF.parquet`` with a ``text`` column: documents of 500 to 5,000
    characters cut from Tiny Shakespeare at random places, about ``megabytes`` MB in all; returns the documents."""
    rng = random.Random(seed)
    text = SHAKESPEARE.read_text(encoding="utf-8")
    per_file = int(megabytes * 1e6 / files)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    documents = 0
    for f in range(files):
        rows, size = [], 0
        while size < per_file:
            length = rng.randrange(500, 5000)
            start = rng.randrange(len(text) - length)
            rows.append(text[start : start + length])
            size += length
        pq.write_table(pa.table({"text": rows}), folder / "data" / f"train-{f:05d}-of-{files:05d}.parquet")
        documents += len(rows)
    return documents


def train_tokenizer(corpus: pathlib.Path, folder: pathlib.Path, vocab_size: int) -> None:
    """The byte-level BPE both sides use, trained on the corpus's first 20,000 documents, saved into ``folder``."""
    import datasets

    from training.data import iter_texts, train_bpe_tokenizer

    train = datasets.load_dataset(str(corpus), split="train")
    train_bpe_tokenizer(iter_texts(train, "text", 20_000), vocab_size).save_pretrained(folder)


def tiktoken_encoding(tokenizer_folder: pathlib.Path):
    """The tokenizer of ``tokenizer_folder`` as a tiktoken Encoding (``training.data.TiktokenBPE``: each token's bytes
    ranked by its id, GPT-2's split pattern)."""
    from transformers import AutoTokenizer

    from training.data import TiktokenBPE

    return TiktokenBPE.of(AutoTokenizer.from_pretrained(tokenizer_folder)).encoding


def run_nanogpt(corpus: pathlib.Path, tokenizer: pathlib.Path, output: pathlib.Path, processes: int) -> dict:
    """nanoGPT's preparation: tiktoken in datasets.map(num_proc), then one uint16 file of all ids."""
    import datasets

    encoding = tiktoken_encoding(tokenizer)
    eot = json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"]["<|endoftext|>"]
    train = datasets.load_dataset(str(corpus), split="train")
    start = time.perf_counter()

    def process(example: dict) -> dict:
        ids = encoding.encode_ordinary(example["text"])
        ids.append(eot)
        return {"ids": ids, "len": len(ids)}

    tokenized = train.map(process, remove_columns=["text"], num_proc=processes, load_from_cache_file=False)
    total = int(np.sum(tokenized["len"], dtype=np.uint64))
    out = np.memmap(output / "train.bin", dtype=np.uint16, mode="w+", shape=(total,))
    shards, index = 1024 if len(tokenized) >= 1024 else 1, 0
    for i in range(shards):
        batch = tokenized.shard(num_shards=shards, index=i, contiguous=True).with_format("numpy")
        ids = np.concatenate(batch["ids"])
        out[index : index + len(ids)] = ids
        index += len(ids)
    out.flush()
    return {"tokens": total, "seconds": time.perf_counter() - start}


def run_ours(corpus: pathlib.Path, tokenizer: pathlib.Path, output: pathlib.Path, processes: int) -> dict:
    """training/prepare_data.py's main with the shared tokenizer, timed from the loaded data to the written files."""
    import datasets

    from training import prepare_data

    datasets.load_dataset(str(corpus), split="train")  # the Arrow cache exists, as for the other side
    start = time.perf_counter()
    meta = prepare_data.main(["--dataset_name", str(corpus), "--output_dir", str(output), "--tokenizer_type",
                              "pretrained", "--tokenizer_name", str(tokenizer), "--preprocessing_num_workers",
                              str(processes), "--documents_per_shard", "2000"])  # fmt: skip
    return {"tokens": meta["train_tokens"] + meta["validation"]["tokens"], "seconds": time.perf_counter() - start}


def same_ids(corpus: pathlib.Path, tokenizer: pathlib.Path, documents: int = 500) -> float:
    """The fraction of the first ``documents`` documents to which tiktoken and the tokenizer give the same ids."""
    import datasets
    from transformers import AutoTokenizer

    encoding, ours = tiktoken_encoding(tokenizer), AutoTokenizer.from_pretrained(tokenizer)
    texts = datasets.load_dataset(str(corpus), split="train")[:documents]["text"]
    return sum(encoding.encode_ordinary(t) == ours(t, add_special_tokens=False)["input_ids"] for t in texts) / len(texts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=40.0, help="size of the corpus's text")
    parser.add_argument("--processes", type=int, default=os.cpu_count(), help="tokenizing processes of each side")
    parser.add_argument("--vocab_size", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side, alternating")
    parser.add_argument("--json_out", default=None)
    parser.add_argument("--worker", nargs=4, default=None, help=argparse.SUPPRESS)  # SIDE CORPUS TOKENIZER OUTPUT
    args = parser.parse_args(argv)
    if args.worker:
        side, corpus, tokenizer, output = args.worker
        run = {"ours": run_ours, "nanogpt": run_nanogpt}[side]
        print(json.dumps(run(pathlib.Path(corpus), pathlib.Path(tokenizer), pathlib.Path(output), args.processes)))
        return

    from benchmarks.common import load_average, machine_line, write_timing

    load_before = load_average()
    print(machine_line(threads=1), f"| {args.processes} tokenizing processes a side")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        documents = write_corpus(tmp / "corpus", args.megabytes)
        train_tokenizer(tmp / "corpus", tmp / "tokenizer", args.vocab_size)
        agreement = same_ids(tmp / "corpus", tmp / "tokenizer")
        print(f"corpus: {args.megabytes} MB, {documents} documents in {FILES} files; same ids on {agreement:.1%} of "
              "the first 500 documents")  # fmt: skip
        samples = {"ours": [], "nanogpt": []}
        for round_index in range(args.repeats + 1):  # the first round warms the caches, untimed
            for side in samples:
                output = tmp / f"{side}-{round_index}"
                output.mkdir()
                command = [sys.executable, "-m", "benchmarks.prepare_data", "--processes", str(args.processes),
                           "--worker", side, str(tmp / "corpus"), str(tmp / "tokenizer"), str(output)]  # fmt: skip
                done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO_ROOT, check=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                per_core = result["tokens"] / result["seconds"] / args.processes
                if round_index:
                    samples[side].append({**result, "tokens_per_s_per_core": per_core})
                print(f"  {side:8s} {result['tokens']:,} tokens in {result['seconds']:.2f} s: "
                      f"{per_core:,.0f} tokens/s per core{'' if round_index else ' (warm-up)'}")  # fmt: skip
    medians = {side: statistics.median(s["tokens_per_s_per_core"] for s in runs) for side, runs in samples.items()}
    ratio = medians["ours"] / medians["nanogpt"]
    print(f"median tokens/s per core: ours {medians['ours']:,.0f}, nanoGPT's method {medians['nanogpt']:,.0f}: "
          f"{ratio:.2f}x (goal >= 1.0x)")  # fmt: skip
    write_timing(args.json_out, 1, load_before, megabytes=args.megabytes, documents=documents,
                 processes=args.processes, vocab_size=args.vocab_size, same_ids_fraction=agreement,
                 median_tokens_per_s_per_core=medians, ratio_ours_over_nanogpt=ratio, runs=samples)  # fmt: skip


if __name__ == "__main__":
    main()
