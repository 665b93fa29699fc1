"""Loader throughput: tokens per second one rank's batches deliver from prepared token shards.

    python -m benchmarks.data_loader --json_out benchmarks/results/data_loader.json

A corpus laid out like FineWeb-Edu (``benchmarks.prepare_data.write_corpus``) is prepared once by
``training/prepare_data.py`` (a character tokenizer, uint16 ids: the loader reads ids, whatever they mean) into
shards in a temporary folder; then the batches a rank of the ``fineweb_edu_bpe`` recipe reads (16 blocks of 1024
tokens, rank 0 of 8) are timed three ways, alternating: ``BlockBatches`` over the memory-mapped shards as the loop
calls it, the same through the prefetch thread (``Prefetched``), and nanoGPT's ``get_batch`` (random offsets into
one memory-mapped uint16 file, a row at a time through ``torch.from_numpy``) over the same tokens. The shards sit
in the page cache (the corpus is read once before timing); on a corpus larger than memory the disk's random-read
rate bounds all three. A GPT-2-small rank on an H100 consumes about 0.5M tokens/s; the goal is 50M.
"""

import argparse
import os
import pathlib
import statistics
import tempfile
import time

import numpy as np
import torch

from benchmarks.common import load_average, machine_line, write_timing
from benchmarks.prepare_data import write_corpus
from training import prepare_data
from training.data import BlockBatches, Prefetched
from training.token_shards import PreparedData

BLOCK, BATCH, RANKS = 1024, 16, 8


def nanogpt_batches(tokens: np.ndarray, seed: int = 0):
    """nanoGPT's get_batch, endlessly: BATCH random windows of BLOCK tokens from one uint16 array."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(len(tokens) - BLOCK, (BATCH,), generator=generator)
        x = torch.stack([torch.from_numpy(tokens[i : i + BLOCK].astype(np.int64)) for i in starts.tolist()])
        yield {"input_ids": x, "labels": x}


def tokens_per_second(batches, n: int) -> float:
    next(batches)
    start = time.perf_counter()
    for _ in range(n):
        next(batches)
    return n * BATCH * BLOCK / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=100.0, help="size of the corpus's text (= tokens, chars)")
    parser.add_argument("--batches", type=int, default=2000, help="batches per timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args(argv)
    load_before = load_average()
    print(machine_line(torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        write_corpus(tmp / "corpus", args.megabytes)
        os.environ["HF_DATASETS_CACHE"] = str(tmp / "cache")  # the Arrow copy of the corpus goes with the folder
        prepare_data.main(["--dataset_name", str(tmp / "corpus"), "--output_dir", str(tmp / "data"),
                           "--tokenizer_type", "char", "--documents_per_shard", "5000"])  # fmt: skip
        data = PreparedData(tmp / "data")
        whole = np.concatenate([np.asarray(f) for f in data.train_files])  # nanoGPT's one file, in the page cache
        single = tmp / "train.bin"
        whole.tofile(single)
        del whole
        blocks = data.train_blocks(BLOCK)
        print(f"{data.meta['train_tokens']:,} tokens in {len(data.train_files)} shards, {len(blocks):,} blocks")
        paths = {
            "BlockBatches (memmap shards)": lambda: BlockBatches(blocks, BATCH, seed=0, num_processes=RANKS).iterate(),
            "BlockBatches + prefetch thread": lambda: Prefetched(
                BlockBatches(blocks, BATCH, seed=0, num_processes=RANKS).iterate(), depth=4
            ),
            "nanoGPT get_batch (one memmap)": lambda: nanogpt_batches(np.memmap(single, dtype=np.uint16, mode="r")),
        }
        samples = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, make in paths.items():
                batches = make()
                samples[name].append(tokens_per_second(batches, args.batches))
                if isinstance(batches, Prefetched):
                    batches.close()
    medians = {name: statistics.median(s) for name, s in samples.items()}
    for name, value in medians.items():
        print(f"  {name:32s} {value / 1e6:8.1f}M tokens/s (goal >= 50M)")
    write_timing(args.json_out, torch.get_num_threads(), load_before, megabytes=args.megabytes, block_size=BLOCK,
                 batch_size=BATCH, ranks=RANKS, median_tokens_per_s=medians, samples_tokens_per_s=samples)  # fmt: skip


if __name__ == "__main__":
    main()
