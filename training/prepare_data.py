"""Tokenize a corpus once into token shards that training/pretrain.py maps with np.memmap (--prepared_data).

    python training/prepare_data.py --config training/configs/fineweb_edu_bpe.yaml --output_dir data/fineweb_edu
    python training/prepare_data.py --config training/configs/shakespeare_char.yaml \\
        --dataset_name ../shared/data/tiny_shakespeare --output_dir data/tiny_shakespeare
    python training/pretrain.py --config training/configs/shakespeare_char.yaml --prepared_data data/tiny_shakespeare

The recipe's data and tokenizer fields say what to read and how to tokenize it (every field of
``training.args.PrepareConfig`` is a flag); ``--output_dir`` is the folder of the shards (a recipe's own
``output_dir`` is its training run's and is not read), by default the recipe's ``prepared_data``. Tokenizing runs
in ``--preprocessing_num_workers`` processes (default: every core), one shard at a time each. The tokenizer is built
first (a character or BPE tokenizer learnt from a sample of the corpus read in parallel) and saved with the shards.
Run again, the command keeps the complete shards and writes the missing ones; the folder's layout is in
``training/token_shards.py``.
"""

from training.program import prepare_imports, run_program  # isort: skip (first)

prepare_imports(__name__)

import logging
import os
import time

from training.args import PrepareConfig, parse_config
from training.data import load_text_splits, load_tokenizer
from training.preflight import DATA_CHECKS, preflight
from training.token_shards import (
    choose_source,
    preparation_tokenizer,
    prepare_shards,
    save_tokenizer,
    tokenizer_folder,
)

logger = logging.getLogger("training.prepare_data")


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(PrepareConfig, argv)
    preflight(cfg, checks=DATA_CHECKS)  # the recipe's data settings fit together, before anything is read
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    start = time.perf_counter()
    train, validation = load_text_splits(cfg)
    source = choose_source(cfg, train, validation)
    folder = tokenizer_folder(cfg.output_dir)
    if folder.is_dir():  # a preparation resumed: its shards hold this tokenizer's ids
        tokenizer = load_tokenizer(str(folder))
        logger.info(f"Using the tokenizer saved in {folder}")
    else:
        tokenizer = preparation_tokenizer(cfg, source)
        folder.parent.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tokenizer, cfg.output_dir)
    # each worker process tokenizes on one thread; the tokenizers library's own thread pool would compete with them
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    meta = prepare_shards(cfg, tokenizer, source)
    seconds = time.perf_counter() - start
    print(
        f"Prepared {meta['train_tokens']:,} training tokens ({meta['train_documents']:,} documents, "
        f"{len(meta['train'])} shard(s), {meta['dtype']}) and {meta['validation']['tokens']:,} validation tokens "
        f"({meta['validation']['documents']:,} documents held out: {meta['validation_from']}) in {seconds:.1f} s.\n"
        f"Saved to {cfg.output_dir}. Train on it: python training/pretrain.py --config RECIPE "
        f"--prepared_data {cfg.output_dir}"
    )
    return meta


if __name__ == "__main__":
    run_program(main)
