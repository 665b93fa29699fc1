"""Prepared token shards: a corpus tokenized once into flat files of token ids, which training maps with np.memmap.

    python training/prepare_data.py --config training/configs/fineweb_edu_bpe.yaml --output_dir data/fineweb_edu
    python training/pretrain.py --config training/configs/fineweb_edu_bpe.yaml --prepared_data data/fineweb_edu

A prepared folder holds::

    DATA/
        tokenizer/               the tokenizer the ids mean (tokenizer.json, tokenizer_config.json, ...)
        plan.json                what is being prepared: source, tokenizer hash, dtype, shards (written first)
        train-00000.bin ...      token ids, ``dtype`` (uint16, or uint32 when the vocabulary needs it), no header;
        train-00000.json ...     each shard's token and document counts, written after its .bin
        validation.bin/.json     the held-out documents, whole, never in a training shard
        meta.json                everything above with the totals: written last, so only a finished folder has it

Documents follow each other in a shard, each followed by the tokenizer's end-of-text token. Every file is written
under a temporary name, flushed and renamed, so a killed preparation leaves complete files or ``.tmp`` ones; run
again, it keeps the shards that are complete and writes the others. Training refuses a folder without
``meta.json``, a shard that is missing or whose size is not its token count, and a tokenizer other than its own.
"""

import dataclasses
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np
import torch
from accelerate import Accelerator

from .args import PrepareConfig, TrainConfig
from .checkpointing import git_commit, package_versions
from .data import (
    TEXTS_PER_CALL,
    BlockBatches,
    Packing,
    TextEncoder,
    TextSplit,
    batched,
    build_tokenizer,
    iter_texts,
    load_tokenizer,
    training_batches,
)
from .sampling import TokenWindows

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_NAME, PLAN_NAME, TOKENIZER_DIR = "meta.json", "plan.json", "tokenizer"
VALIDATION_NAME = "validation"
TMP_SUFFIX = ".tmp"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
FLUSH_TOKENS = 1 << 24  # a worker writes its shard out in pieces of about this many tokens


# ----------------------------------------------------------------------------------------------
# Identity of a tokenizer and the dtype of its ids


def tokenizer_hash(tokenizer) -> str:
    """SHA-256 of the tokenizer's complete ``tokenizers`` serialization (vocabulary, merges, normalizer,
    pre-tokenizer, added tokens): two tokenizers with one hash give every text the same ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer: prepared shards need one.")
    canonical = json.dumps(json.loads(backend.to_str()), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def token_dtype(vocab_size: int, requested: str = "auto") -> str:
    """``uint16`` when every id fits (at most 65,536 tokens), else ``uint32``; a requested dtype too small for the
    vocabulary is a ValueError."""
    fits = "uint16" if vocab_size <= 1 << 16 else "uint32"
    if requested == "auto":
        return fits
    if vocab_size > np.iinfo(DTYPES[requested]).max + 1:
        raise ValueError(
            f"--token_dtype {requested} holds ids up to {np.iinfo(DTYPES[requested]).max}, but the tokenizer has "
            f"{vocab_size} tokens. Use --token_dtype uint32 (or auto)."
        )
    return requested


# ----------------------------------------------------------------------------------------------
# Files written atomically


def write_atomically(path: pathlib.Path, write) -> None:
    """``write(file)`` into ``path.tmp``, flushed to disk, then renamed to ``path``: ``path`` is complete or absent."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: pathlib.Path, value: dict) -> None:
    write_atomically(path, lambda f: f.write((json.dumps(value, indent=2) + "\n").encode("utf-8")))


def read_json(path: pathlib.Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


# ----------------------------------------------------------------------------------------------
# Preparing


@dataclasses.dataclass
class Source:
    """Where the documents of a preparation come from: the training split cut into ``pieces`` (one shard each:
    ranges of ``documents_per_shard`` rows, or a stream's files), and the validation documents."""

    train: TextSplit
    column: str
    pieces: int
    documents_per_shard: int | None  # rows per piece of a map-style split; None for a stream (one file per piece)
    train_rows: int | None  # map-style: rows 0..train_rows-1 train (the rest may validate)
    validation_texts: list[str]
    validation_from: str  # how the validation documents were chosen, for plan.json

    def __post_init__(self):
        self.held_out = frozenset(self.validation_texts)  # never in a training shard, nor in a tokenizer's sample

    def piece_texts(self, index: int) -> Iterator[str]:
        if self.documents_per_shard is None:
            return iter_texts(self.train.shard(num_shards=self.pieces, index=index), self.column)
        start = index * self.documents_per_shard
        rows = range(start, min(start + self.documents_per_shard, self.train_rows))
        return iter_texts(self.train.select(rows), self.column)


def choose_source(cfg: PrepareConfig, train: TextSplit, validation: TextSplit | None) -> Source:
    """The pieces and the validation documents: the validation split when there is one; otherwise a stream's first
    ``streaming_validation_texts`` documents, or a map-style split's last ``validation_split_percentage`` %."""
    column = cfg.text_column_name
    if isinstance(train, datasets.IterableDataset):
        if validation is not None:
            texts, chosen = list(iter_texts(validation, column)), "the validation split"
        else:
            n = cfg.streaming_validation_texts
            texts, chosen = list(iter_texts(train, column, n)), f"the first {n} documents of the stream"
        return Source(train, column, train.num_shards, None, None, texts, chosen)
    rows = train.num_rows
    if rows == 0:
        raise ValueError(f"The training data ({cfg.dataset_name or cfg.train_file}) holds no documents: empty corpus.")
    if validation is not None:
        texts, chosen = list(iter_texts(validation, column)), "the validation split"
    else:
        n = max(1, round(rows * cfg.validation_split_percentage / 100))
        if rows - n < 1:
            raise ValueError(
                f"The training data holds {rows} document(s), too few to hold whole ones out for validation. "
                "Give a validation split (--validation_file) or more documents."
            )
        texts = list(iter_texts(train.select(range(rows - n, rows)), column))
        chosen, rows = f"the last {n} documents ({cfg.validation_split_percentage}%)", rows - n
    pieces = -(-rows // cfg.documents_per_shard)
    return Source(train, column, pieces, cfg.documents_per_shard, rows, texts, chosen)


@dataclasses.dataclass
class ShardWriter:
    """Tokenizes documents into one shard file: each document's ids, then the end-of-text token (``separator``),
    as ``dtype``; documents in ``held_out`` (the validation texts) are left out."""

    tokenizer: Any
    dtype: str
    separator: list[int]
    held_out: frozenset = frozenset()

    def write(self, texts: Iterator[str], path: pathlib.Path) -> dict:
        encode, separator = TextEncoder(self.tokenizer), np.array(self.separator, dtype=self.dtype)
        counts = {"tokens": 0, "documents": 0, "held_out_documents": 0}
        pending: list[np.ndarray] = []

        def flush(f) -> None:
            if pending:
                np.concatenate(pending).tofile(f)
                pending.clear()

        def write_all(f) -> None:
            size = 0
            for batch in batched(texts, TEXTS_PER_CALL):
                kept = [text for text in batch if text and text not in self.held_out]  # empty ones: nothing to end
                counts["held_out_documents"] += len(batch) - len(kept)
                for ids in encode(kept):
                    pending.extend((ids.astype(self.dtype), separator))
                    size += len(ids) + len(separator)
                counts["documents"] += len(kept)
                if size >= FLUSH_TOKENS:
                    counts["tokens"] += size
                    size = 0
                    flush(f)
            counts["tokens"] += size
            flush(f)

        write_atomically(path, write_all)
        info = {"file": path.name, **counts, "bytes": path.stat().st_size}
        write_json(path.with_suffix(".json"), info)
        return info


def complete_shard(folder: pathlib.Path, name: str, dtype: str) -> dict | None:
    """The recorded counts of shard ``name`` when both its files are there and agree, else None."""
    info = read_json(folder / f"{name}.json")
    if info is None:
        return None
    path = folder / info["file"]
    expected = info["tokens"] * np.dtype(dtype).itemsize
    return info if path.is_file() and path.stat().st_size == expected == info["bytes"] else None


_JOB: tuple | None = None  # what forked worker processes work on (set before the fork, read by them)


def _write_piece(index: int) -> tuple[int, dict]:
    writer, source, folder = _JOB
    return index, writer.write(source.piece_texts(index), folder / f"train-{index:05d}.bin")


def describe_source(cfg: PrepareConfig) -> dict:
    return {
        "dataset_name": None if cfg.train_file else cfg.dataset_name,
        "dataset_config_name": None if cfg.train_file else cfg.dataset_config_name,
        "train_file": cfg.train_file,
        "validation_file": cfg.validation_file,
        "text_column_name": cfg.text_column_name,
        "streaming": cfg.streaming,
    }


def processes_for(cfg: PrepareConfig, jobs: int) -> int:
    """``cfg.preprocessing_num_workers`` processes (default: every core), no more than there are ``jobs``."""
    return max(1, min(cfg.preprocessing_num_workers or os.cpu_count() or 1, jobs))


def run_pieces(function, job: tuple, indices: list[int], processes: int) -> Iterator:
    """``function(i)`` for each piece index, in ``processes`` forked processes that share ``job`` (as ``_JOB``)."""
    global _JOB
    _JOB = job
    try:
        if processes < 2:
            yield from map(function, indices)
            return
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            yield from pool.imap(function, indices)
    finally:
        _JOB = None


def _sample_piece(index: int) -> list[str]:
    source, limit = _JOB
    return list(itertools.islice((t for t in source.piece_texts(index) if t not in source.held_out), limit))


def sample_texts(source: Source, limit: int, processes: int) -> list[str]:
    """About ``limit`` training documents (never validation ones) for a tokenizer to learn from, read in parallel:
    the same number from the start of each piece, so that the sample spans the corpus (every file of a stream)."""
    per_piece = -(-limit // source.pieces)
    pieces = run_pieces(_sample_piece, (source, per_piece), list(range(source.pieces)), processes)
    return list(itertools.islice(itertools.chain.from_iterable(pieces), limit))


def preparation_tokenizer(cfg: PrepareConfig, source: Source):
    """The tokenizer of a new preparation (``data.build_tokenizer``): a character vocabulary or byte-level BPE learnt
    from a parallel sample of the training documents (``sample_texts``), or ``cfg.tokenizer_name``'s."""
    if cfg.tokenizer_type == "pretrained":
        return build_tokenizer(cfg, ())
    sample = sample_texts(source, cfg.tokenizer_train_texts, processes_for(cfg, source.pieces))
    return build_tokenizer(cfg, sample, source.validation_texts)


def tokenizer_settings(cfg: PrepareConfig) -> dict:
    names = ["tokenizer_type"] + {"pretrained": ["tokenizer_name"], "char": ["tokenizer_train_texts"],
                                  "bpe": ["bpe_vocab_size", "tokenizer_train_texts"]}[cfg.tokenizer_type]  # fmt: skip
    return {name: getattr(cfg, name) for name in names}


def prepare_shards(cfg: PrepareConfig, tokenizer, source: Source) -> dict:
    """Tokenize ``source``'s training and validation documents into ``cfg.output_dir`` (the layout in the module
    docstring), over ``cfg.preprocessing_num_workers`` processes (default: every core); returns the metadata.

    Run again on the same folder, it keeps every complete shard and writes the others; a folder prepared with
    other settings (source, tokenizer, dtype, shard size) is refused, naming what differs."""
    folder = pathlib.Path(cfg.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    packing = Packing.of(cfg)
    dtype = token_dtype(len(tokenizer), cfg.token_dtype)
    if not source.validation_texts:
        raise ValueError("No validation documents: the validation split is empty. Give one with text in it.")
    separator = [tokenizer.eos_token_id] if packing.documents and tokenizer.eos_token_id is not None else []
    plan = {
        "format_version": FORMAT_VERSION,
        "source": describe_source(cfg),
        "tokenizer_settings": tokenizer_settings(cfg),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "dtype": dtype,
        "separator": separator,
        "train_shards": source.pieces,
        "documents_per_shard": source.documents_per_shard,
        "validation_from": source.validation_from,
    }
    check_plan(folder, plan)
    write_json(folder / PLAN_NAME, plan)

    validation_info = complete_shard(folder, VALIDATION_NAME, dtype)
    if validation_info is None:
        writer = ShardWriter(tokenizer, dtype, separator)
        validation_info = writer.write(iter(source.validation_texts), folder / f"{VALIDATION_NAME}.bin")
    writer = ShardWriter(tokenizer, dtype, separator, source.held_out)
    shards = {i: complete_shard(folder, f"train-{i:05d}", dtype) for i in range(source.pieces)}
    missing = [i for i, info in shards.items() if info is None]
    if len(missing) < source.pieces:
        logger.info(f"{source.pieces - len(missing)} of {source.pieces} training shards are complete already.")
    processes = processes_for(cfg, len(missing))
    logger.info(f"Tokenizing {len(missing)} training shard(s) in {processes} process(es) into {folder}")
    shards.update(run_pieces(_write_piece, (writer, source, folder), missing, processes))
    train_infos = [shards[i] for i in range(source.pieces)]
    train_tokens = sum(info["tokens"] for info in train_infos)
    if train_tokens == 0:
        raise ValueError(
            f"The training documents of {cfg.dataset_name or cfg.train_file} hold no tokens (empty corpus, or every "
            "document held out for validation). Give text to train on."
        )
    meta = {
        **plan,
        "tokenizer": {"files": sorted(p.name for p in (folder / TOKENIZER_DIR).iterdir()),
                      "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id},  # fmt: skip
        "train": train_infos,
        "validation": validation_info,
        "train_tokens": train_tokens,
        "train_documents": sum(info["documents"] for info in train_infos),
        "held_out_documents": sum(info["held_out_documents"] for info in train_infos),
        "versions": package_versions(),
        "git": git_commit(),
    }
    write_json(folder / META_NAME, meta)
    return meta


def check_plan(folder: pathlib.Path, plan: dict) -> None:
    """A folder prepared (or being prepared) with other settings is refused, naming what differs."""
    before = read_json(folder / PLAN_NAME)
    if before is None or before == plan:
        return
    differ = {key: (before.get(key), plan[key]) for key in plan if before.get(key) != plan[key]}
    listed = "; ".join(f"{key}: {old!r} there, {new!r} now" for key, (old, new) in differ.items())
    raise ValueError(
        f"{folder} holds shards prepared with other settings ({listed}). Prepare into another --output_dir, or "
        "delete that folder to start over."
    )


def tokenizer_folder(folder) -> pathlib.Path:
    return pathlib.Path(folder) / TOKENIZER_DIR


def save_tokenizer(tokenizer, folder) -> None:
    """The tokenizer into ``folder/tokenizer``, atomically (written beside it, then renamed)."""
    final = tokenizer_folder(folder)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, final)


# ----------------------------------------------------------------------------------------------
# Reading


class ShardBlocks:
    """The training shards as blocks of ``block_size`` tokens, read through np.memmap: ``blocks[index]`` is the
    (len(index), block_size) int64 tensor of those blocks. Block ``i`` of the whole is a block of one shard (a
    shard's tail shorter than a block is not used); nothing is read until a block is asked for, and the pages
    read are the operating system's cache, shared by every process on the machine."""

    def __init__(self, files: list[np.memmap], block_size: int):
        self.block_size = block_size
        self.shards = [f[: len(f) // block_size * block_size].reshape(-1, block_size) for f in files]
        self.starts = np.cumsum([0] + [len(shard) for shard in self.shards])  # (S + 1,): first block of each

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        index = np.asarray(index)
        shard = np.searchsorted(self.starts, index, side="right") - 1
        out = np.empty((len(index), self.block_size), dtype=np.int64)
        for s in np.unique(shard):
            rows = shard == s
            out[rows] = self.shards[s][index[rows] - self.starts[s]]
        return torch.from_numpy(out)


class PreparedData:
    """A prepared folder, checked when opened: ``meta.json`` present, every shard there with the size its token count
    gives; ``tokenizer`` is the tokenizer the ids mean. A ValueError names whatever is wrong."""

    def __init__(self, folder):
        self.folder = pathlib.Path(folder)
        if not self.folder.is_dir():
            raise ValueError(
                f"--prepared_data {folder}: no such folder. Make it with "
                f"`python training/prepare_data.py --config RECIPE --output_dir {folder}`."
            )
        meta = read_json(self.folder / META_NAME)
        if meta is None:
            state = "its preparation has not finished" if (self.folder / PLAN_NAME).is_file() else "nothing prepared"
            raise ValueError(
                f"--prepared_data {folder} has no {META_NAME} ({state}). Run training/prepare_data.py with "
                f"--output_dir {folder} (again: it resumes at the first missing shard) before training on it."
            )
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{folder} is in shard format {meta.get('format_version')}; this code reads format {FORMAT_VERSION}. "
                "Prepare it again with this version of training/prepare_data.py."
            )
        self.meta, self.dtype = meta, np.dtype(meta["dtype"])
        if meta["tokenizer"]["vocab_size"] > np.iinfo(self.dtype).max + 1:
            raise ValueError(
                f"{folder}: a vocabulary of {meta['tokenizer']['vocab_size']} tokens cannot be stored as {self.dtype} "
                "ids. Prepare it again (the dtype is chosen from the vocabulary unless --token_dtype forces it)."
            )
        self.train_files = [self.open(info) for info in meta["train"]]
        self.validation_file = self.open(meta["validation"])
        self._tokenizer = None

    def open(self, info: dict) -> np.memmap:
        path = self.folder / info["file"]
        if not path.is_file():
            raise ValueError(
                f"Shard {path} is missing ({META_NAME} lists it with {info['tokens']} tokens). Run "
                f"training/prepare_data.py again with --output_dir {self.folder}, or copy the whole folder again."
            )
        expected = info["tokens"] * self.dtype.itemsize
        if path.stat().st_size != expected:
            raise ValueError(
                f"Shard {path} is {path.stat().st_size} bytes, but {META_NAME} records {info['tokens']} {self.dtype} "
                f"tokens ({expected} bytes): it is truncated or was changed. Delete it and its .json, and run "
                f"training/prepare_data.py again with --output_dir {self.folder}."
            )
        if info["tokens"] == 0:
            return np.empty(0, dtype=self.dtype)
        return np.memmap(path, dtype=self.dtype, mode="r")

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(str(tokenizer_folder(self.folder)))
            found = tokenizer_hash(self._tokenizer)
            if found != self.meta["tokenizer_hash"]:
                raise ValueError(
                    f"{tokenizer_folder(self.folder)} has tokenizer hash {found[:16]}, but the shards were written "
                    f"with {self.meta['tokenizer_hash'][:16]}: the folder was changed. Prepare it again."
                )
        return self._tokenizer

    def check_tokenizer(self, other, whose: str) -> None:
        """Refuse ``other`` (``whose`` tokenizer: the checkpoint's, the base model's, the config's) unless it gives
        the same ids as the shards' tokenizer, naming both hashes."""
        theirs, ours = tokenizer_hash(other), self.meta["tokenizer_hash"]
        if theirs != ours:
            raise ValueError(
                f"The prepared data in {self.folder} was tokenized with tokenizer {ours[:16]}, but {whose} tokenizer "
                f"is {theirs[:16]}: the same ids would mean other tokens. Prepare the data with that tokenizer "
                "(--tokenizer_type pretrained --tokenizer_name ...), or train with the data's own."
            )

    def train_blocks(self, block_size: int) -> ShardBlocks:
        return ShardBlocks(self.train_files, block_size)

    def validation_blocks(self, block_size: int) -> torch.Tensor:
        """The validation shard as an (N, block_size) tensor (it is small: whole documents held out)."""
        n = len(self.validation_file) // block_size
        if n == 0:
            raise ValueError(
                f"The validation documents of {self.folder} hold {len(self.validation_file)} tokens, fewer than one "
                f"block of block_size={block_size}. Lower --block_size, or prepare with more validation documents "
                "(--streaming_validation_texts, --validation_split_percentage)."
            )
        blocks = np.asarray(self.validation_file[: n * block_size], dtype=np.int64).reshape(n, block_size)
        return torch.from_numpy(blocks)


def prepared_batches(cfg: TrainConfig, accelerator: Accelerator, checkpoint=None, tokenizer=None):
    """(tokenizer, training batches, validation blocks) from ``cfg.prepared_data``, like ``data.prepare_data``:
    every process maps the same shards and takes its rows of each global batch (``BlockBatches``). The tokenizer is
    the data's; a resumed checkpoint's, a given one (the base model's) or the config's ``tokenizer_name`` must be
    the same tokenizer, else a ValueError names both hashes."""
    data = PreparedData(cfg.prepared_data)
    others = []
    if checkpoint is not None:
        others.append((load_tokenizer(str(checkpoint)), f"the checkpoint {checkpoint}'s"))
    if tokenizer is not None:
        others.append((tokenizer, "the base model's"))
    elif cfg.tokenizer_type == "pretrained":
        others.append((load_tokenizer(cfg.tokenizer_name), f"--tokenizer_name {cfg.tokenizer_name}'s"))
    for other, whose in others:
        data.check_tokenizer(other, whose)
    eval_blocks = data.validation_blocks(cfg.block_size)
    shard = dict(seed=cfg.seed, process_index=accelerator.process_index, num_processes=accelerator.num_processes)
    if cfg.window_sampling == "blocks":
        batches = BlockBatches(data.train_blocks(cfg.block_size), cfg.per_device_train_batch_size, **shard)
        cut = f"{len(batches.rows['input_ids']):,} blocks of {cfg.block_size}"
    else:
        batches = training_batches(cfg, None, shard, tokens=TokenWindows(data.train_files))
        cut = f"window_sampling={cfg.window_sampling!r}, windows of {cfg.block_size}"
    logger.info(
        f"Training on {data.meta['train_tokens']:,} prepared tokens in {len(data.train_files)} shard(s) of "
        f"{cfg.prepared_data} ({cut})"
    )
    return data.tokenizer, batches, eval_blocks
