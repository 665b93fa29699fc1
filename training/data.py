"""Data for training: load a dataset, build or load a tokenizer, tokenize once, pack into blocks, batch.

The path from a dataset to batches:

1. ``load_text_splits``: ``datasets.load_dataset`` on a Hub id, a local Hub-layout folder or local
   files, optionally streamed; returns the train split and the validation split if there is one.
2. ``build_tokenizer``: one token per character, a byte-level BPE trained on the data, or an
   existing tokenizer. Every kind is a ``tokenizers`` tokenizer wrapped for transformers, so
   ``save_pretrained`` writes ``tokenizer.json`` and ``AutoTokenizer.from_pretrained`` loads it back.
3. ``pack``: tokenize every text, concatenate (documents separated by the tokenizer's end-of-text
   token, if it has one) and cut into blocks of ``block_size`` tokens. ``datasets`` caches the result
   under a fingerprint of the dataset, the tokenizer and the packing settings, so a second run with
   the same data and tokenizer reads the blocks from disk instead of tokenizing again.
4. ``BlockBatches`` / ``StreamBatches``: endless batches in a seeded order, sharded over processes,
   resumable at any batch without reading again the ones before it (a stream from the position its checkpoint
   saved); ``Prefetched`` reads them ahead in a thread. ``TrainConfig.window_sampling`` other than "blocks" draws
   windows at any offset of the same tokens instead of fixed blocks (``training.sampling``, ``training_batches``).

Corpora too large to tokenize at every start are prepared once into token shards instead
(``training/prepare_data.py``, ``training.token_shards``), which ``BlockBatches`` reads through np.memmap.

Batches follow the transformers convention: ``labels`` are the input ids and the model shifts them.
"""

import codecs
import collections
import itertools
import json
import logging
import pathlib
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import datasets
import numpy as np
import torch
from accelerate import Accelerator
from datasets.distributed import split_dataset_by_node
from datasets.fingerprint import Hasher
from huggingface_hub import constants as hub_constants
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .args import TrainConfig
from .sampling import TokenWindows, WindowBatches, check_same_position, check_sampling

logger = logging.getLogger(__name__)

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"  # the character tokenizer's token for characters outside its vocabulary
# The end-of-text token is also the padding token (padded positions are masked, so any id would do, and this
# needs no extra one) and the beginning-of-sequence token, as in GPT-2: what ends one document is what the next
# follows in packed training, so tools that put a BOS before a text (lm-eval's prefix token) condition on it.
SPECIAL_TOKENS = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "bos_token": EOS_TOKEN}
IGNORE_INDEX = -100  # transformers' label for "no loss here"
# train_char_tokenizer's pre-tokenizer: every character (newlines included: Oniguruma's (?m) makes '.' match them)
# is its own word; CHAR_SPLIT is how tokenizer.json stores it
CHAR_PATTERN = "(?m)."
CHAR_SPLIT = {"type": "Split", "pattern": {"Regex": CHAR_PATTERN}, "behavior": "Isolated", "invert": False}
PACKING_VERSION = 1  # part of the cache fingerprint: bump when `pack` changes what it writes
TEXTS_PER_CALL = 256  # texts tokenized per batched call
KEPT_STATES = 4096  # a stream's positions kept for the batches read ahead of the step (prefetch_batches is fewer)

TextSplit = datasets.Dataset | datasets.IterableDataset

# Tiny Shakespeare, the default recipe's data: a Hub-layout copy beside the checkout, or the Hub's
TINY_SHAKESPEARE_LOCAL = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "tiny_shakespeare"
TINY_SHAKESPEARE_HUB = "karpathy/tiny_shakespeare"


# ----------------------------------------------------------------------------------------------
# 1. Loading


def tiny_shakespeare() -> str:
    """Where Tiny Shakespeare is read from: the offline copy when it sits beside the checkout
    (``../shared/data/tiny_shakespeare``, as ``make demo`` reads it), else the Hub dataset id."""
    return str(TINY_SHAKESPEARE_LOCAL) if TINY_SHAKESPEARE_LOCAL.is_dir() else TINY_SHAKESPEARE_HUB


def load_text_splits(cfg: TrainConfig) -> tuple[TextSplit, TextSplit | None]:
    """(train, validation or None) with ``cfg.text_column_name``; validation is None when the data has none."""
    train, validation = load_splits(cfg)
    for name, split in (("train", train), ("validation", validation)):
        if split is not None:
            check_text_column(split, cfg.text_column_name, name)
    return train, validation


def load_splits(cfg: TrainConfig) -> tuple[TextSplit, TextSplit | None]:
    """(train, validation or None) as loaded, whatever their columns (fine-tuning data checks its own)."""
    if cfg.train_file is not None:
        if cfg.dataset_name is not None:
            logger.info(f"Training on --train_file {cfg.train_file}; dataset_name={cfg.dataset_name!r} is not used.")
        splits = load_files(cfg.train_file, cfg.validation_file, streaming=cfg.streaming, encoding=cfg.encoding)
    else:
        splits = load_named_dataset(cfg.dataset_name, cfg.dataset_config_name, streaming=cfg.streaming)
    if "train" not in splits:
        raise ValueError(
            f"{cfg.dataset_name or cfg.train_file} has no 'train' split, only {list(splits)}. "
            "Pass a dataset with a train split, or --train_file."
        )
    train = splits["train"]
    validation = splits.get(cfg.validation_split_name)
    if validation is None and cfg.validation_split_name != "validation":
        raise ValueError(
            f"validation_split_name={cfg.validation_split_name!r} is not a split of the dataset; it has {list(splits)}."
        )
    return train, validation


def load_files(
    train_file: str, validation_file: str | None = None, streaming: bool = False, encoding: str = "utf-8"
) -> dict[str, TextSplit]:
    """``{"train": ...}`` (and ``"validation"``) from local .txt/.json/.jsonl/.parquet/.csv files, the text ones read
    in ``encoding`` (checked whole first: ``check_encoding``)."""
    data_files = {"train": train_file}
    if validation_file is not None:
        data_files["validation"] = validation_file
    for path in data_files.values():
        if not pathlib.Path(path).is_file():
            raise ValueError(
                f"Data file {path} does not exist. Check the path given to --train_file/--validation_file."
            )
        check_not_empty(path)
        if pathlib.Path(path).suffix != ".parquet":  # parquet stores its strings as UTF-8 itself
            check_encoding(path, encoding)
    suffix = pathlib.Path(train_file).suffix
    # text files: one row per line, line breaks kept, so concatenating the rows gives the file back
    extra = {"keep_linebreaks": True} if suffix == ".txt" else {}
    if suffix != ".parquet" and codecs.lookup(encoding).name != "utf-8":
        extra["encoding"] = encoding  # datasets' text, json and csv builders decode with it
    return datasets.load_dataset(BUILDERS[suffix], data_files=data_files, streaming=streaming, **extra)


ENCODING_CHECK_PIECE = 2**24  # bytes decoded at a time by check_encoding


def check_encoding(path, encoding: str = "utf-8") -> None:
    """A ValueError in one line, naming the file, the byte offset, line and what is wrong, unless the whole file
    decodes in ``encoding``; ``datasets`` would stop at the first bad byte with a DatasetGenerationError traceback
    instead, after writing part of its cache. Read once, in 16 MB pieces, before anything is written."""
    decoder = codecs.getincrementaldecoder(encoding)()
    offset = lines = 0
    with open(path, "rb") as f:
        while True:
            piece = f.read(ENCODING_CHECK_PIECE)
            try:
                decoder.decode(piece, final=not piece)
            except UnicodeDecodeError as err:
                # err.object: this piece after the bytes of a character the previous piece cut
                data = err.object
                bad = offset - (len(data) - len(piece)) + err.start
                line = lines + data.count(b"\n", 0, err.start) + 1
                bad_bytes = data[err.start : err.end]
                raise ValueError(encoding_error(path, encoding, bad_bytes, bad, line, err.reason)) from None
            if not piece:
                return
            offset += len(piece)
            lines += piece.count(b"\n")


def encoding_error(path, encoding: str, bad: bytes, offset: int, line: int, reason: str) -> str:
    shown = " ".join(f"0x{b:02X}" for b in bad[:4])
    name = "UTF-8" if codecs.lookup(encoding).name == "utf-8" else encoding
    source = pathlib.Path(path).name
    if name == "UTF-8":
        fix = (
            f"Convert it to UTF-8 first, e.g. from Latin-1: iconv -f latin1 -t utf-8 {path} > "
            f"{pathlib.Path(path).with_name(pathlib.Path(path).stem + '.utf8' + pathlib.Path(path).suffix)} "
            "(`file -i FILE` guesses the encoding), or pass the file's encoding: --encoding latin-1"
        )
    else:
        fix = "Pass the file's own encoding with --encoding (utf-8 by default), or convert it to UTF-8 with iconv"
    return (
        f"Data file {path} is not {name} text: byte {shown} at offset {offset} (line {line} of {source}) cannot be "
        f"decoded ({reason}). {fix}."
    )


def check_not_empty(path) -> None:
    """A ValueError for a data file without text: empty or whitespace only. ``datasets`` would stop at an empty file
    with a schema error, and a blank one leaves nothing to train on or score. Read in 1 MB pieces up to the first
    byte that is not whitespace: the first piece for any real file."""
    with open(path, "rb") as f:
        size = 0
        while piece := f.read(2**20):
            size += len(piece)
            if piece.strip():
                return
    what = "empty (0 bytes)" if size == 0 else "whitespace only"
    raise ValueError(f"Data file {path} is {what}: there is no text in it. Pass a file holding the data.")


def load_named_dataset(name: str, config_name: str | None = None, streaming: bool = False) -> dict[str, TextSplit]:
    """The splits of a Hub dataset id or a local Hub-layout folder, or a ValueError saying what was tried."""
    try:
        return datasets.load_dataset(name, config_name, streaming=streaming)
    except (FileNotFoundError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as err:
        local = pathlib.Path(name)
        offline = (
            " Offline mode is on (HF_HUB_OFFLINE=1), so the Hub was not asked." if hub_constants.HF_HUB_OFFLINE else ""
        )
        raise ValueError(
            f"Could not load dataset {name!r}. Tried it as a local folder ({local.resolve()} "
            f"{'exists but could not be read' if local.exists() else 'does not exist'}) and as a Hub dataset id "
            f"({type(err).__name__}: {err}).{offline} Without network access, use a local copy: "
            "--dataset_name path/to/folder (a folder laid out like the Hub repository, e.g. data/train-*.parquet) "
            "or --train_file / --validation_file (txt, json, jsonl, parquet or csv)."
        ) from err


def check_text_column(split: TextSplit, column: str, split_name: str) -> None:
    columns = split.column_names
    if columns is None:  # a streamed dataset whose features are unknown until read
        columns = list(next(iter(split)).keys())
    if column not in columns:
        raise ValueError(
            f"The {split_name} split has no column {column!r}; its columns are {columns}. "
            "Pass --text_column_name with the column that holds the text."
        )


def iter_texts(split: TextSplit, column: str, limit: int | None = None) -> Iterator[str]:
    """The first ``limit`` texts of a split (all of them when None)."""
    if isinstance(split, datasets.IterableDataset):
        rows = (row[column] for row in split)
    else:
        rows = (text for batch in split.select_columns(column).iter(batch_size=1000) for text in batch[column])
    return itertools.islice(rows, limit)


UNKNOWN_CHARACTERS_LIMIT = 0.01  # above this share of a data set's characters unknown to the tokenizer, a run stops
UNKNOWN_CHARACTERS_SAMPLE = 100_000  # texts read to count them (the first N of a split)


def unknown_characters(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> tuple[collections.Counter, int]:
    """(how often each character of ``texts`` that ``tokenizer`` can only encode as its unknown token occurs, the
    number of characters). Empty for a tokenizer without an unknown token (a byte-level BPE knows every text)."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return collections.Counter(), 0
    counts = collections.Counter()
    for text in texts:
        counts.update(text)
    total = sum(counts.values())
    unknown = collections.Counter()
    for char, n in counts.items():
        if unk in tokenizer(char, add_special_tokens=False)["input_ids"]:
            unknown[char] = n
    return unknown, total


def check_unknown_characters(
    tokenizer: PreTrainedTokenizerBase, texts: Iterable[str], where: str, allow: bool | None = False, warn=True
) -> None:
    """Warn once, naming them, when ``texts`` hold characters ``tokenizer`` encodes as its unknown token; above
    ``UNKNOWN_CHARACTERS_LIMIT`` of the characters a ValueError unless ``allow`` (None: warn only, e.g. a prompt
    or an evaluation). ``where`` names the data, e.g. "the train split"; ``warn=False``: no warning (processes but
    the first)."""
    unknown, total = unknown_characters(tokenizer, texts)
    if not unknown:
        return
    n = sum(unknown.values())
    listed = ", ".join(repr(char) for char, _ in unknown.most_common(20)) + (" ..." if len(unknown) > 20 else "")
    share = n / max(total, 1)
    message = (
        f"{n:,} of the {total:,} characters of {where} ({share:.1%}; {len(unknown)} distinct: {listed}) are not in "
        f"the tokenizer's vocabulary and become {tokenizer.unk_token}"
    )
    if share > UNKNOWN_CHARACTERS_LIMIT and allow is False:
        raise ValueError(
            f"{message}: more than {UNKNOWN_CHARACTERS_LIMIT:.0%}, so the model would learn from text it cannot see. "
            "Clean the data, use a tokenizer that covers it, or pass --allow_unknown_characters to train anyway."
        )
    if warn:
        logger.warning(f"{message}.")


# ----------------------------------------------------------------------------------------------
# 2. Tokenizers


def wrap_tokenizer(tokenizer: Tokenizer, **extra_special_tokens) -> PreTrainedTokenizerFast:
    """A transformers tokenizer around a ``tokenizers`` one that holds ``EOS_TOKEN``: no clean-up of spaces, so
    decode(encode(s)) == s, and the special tokens tools look for (``SPECIAL_TOKENS``, and e.g. ``unk_token``).
    Padding is on the left, as batched generation with a decoder-only model needs (the fine-tuning data pads its
    own rows)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, clean_up_tokenization_spaces=False, padding_side="left",
        **SPECIAL_TOKENS, **extra_special_tokens,
    )  # fmt: skip


def train_char_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """One token per character, then ``<|endoftext|>`` and ``<|unk|>``: ids 0..N-1 are the sorted characters' ranks
    (nanoGPT's ``shakespeare_char`` ids, so losses compare), id N the end-of-text token, id N+1 the unknown token
    (67 tokens for Tiny Shakespeare).

    A character outside the vocabulary encodes as ``<|unk|>`` (the tokenizer's ``unk_token``), so every tool that
    hands the tokenizer text of its own (lm-eval's tasks, ``pipeline``, TRL) gets ids instead of an error. One
    unknown token rather than a byte fallback: a character model never trains on the 256 byte tokens a fallback
    would add (they appear only in text it has not seen), so they would carry no more meaning than one token does,
    at 256 rows of embedding and output each. Character tokenizers saved before it (no unknown token) load as they
    were and still refuse such characters.
    """
    chars = sorted(set().union(*map(set, texts)))
    if not chars:
        raise ValueError("Cannot build a character vocabulary from empty text.")
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({EOS_TOKEN: len(chars), UNK_TOKEN: len(chars) + 1})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(CHAR_PATTERN), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # concatenate the characters back, no spaces added
    tokenizer.add_special_tokens([EOS_TOKEN, UNK_TOKEN])  # matched whole in text, kept at their ids N and N+1
    return wrap_tokenizer(tokenizer, unk_token=UNK_TOKEN)


class CharEncoder:
    """The ids a character tokenizer of ``train_char_tokenizer``'s kind gives, looked up in a table of code points:
    the tokenizer's own ids without its regex split of the text into one-character words, the slow part of
    packing (``python -m benchmarks.investigations.char_packing`` times both). ``of`` returns None for any other
    tokenizer.

    A character outside the vocabulary becomes the unknown token's id, with a warning naming it (once per
    character); a tokenizer without an unknown token (saved before it had one) refuses it with a ValueError naming
    the characters, as that tokenizer itself does.
    """

    def __init__(self, vocab: dict[str, int], special_tokens: list[str], unk_token: str | None = None):
        chars = {char: token_id for char, token_id in vocab.items() if len(char) == 1}
        self.unk_id = vocab[unk_token] if unk_token is not None else -1
        # one entry per code point up to the largest character's, then one for every code point beyond
        self.table = np.full(max(map(ord, chars)) + 2, self.unk_id, dtype=np.int64)
        for char, token_id in chars.items():
            self.table[ord(char)] = token_id
        self.special_tokens = special_tokens
        self.unknown: set[str] = set()  # the characters warned about

    @classmethod
    def of(cls, tokenizer) -> "CharEncoder | None":
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        state = json.loads(backend.to_str())
        model = state["model"]
        # no normalizer (it could change characters)
        if model["type"] != "WordLevel" or state["normalizer"] is not None or state["pre_tokenizer"] != CHAR_SPLIT:
            return None
        vocab, unk_token = model["vocab"], model.get("unk_token")
        special_tokens = [token["content"] for token in state["added_tokens"]]
        if unk_token is not None and unk_token not in vocab:
            unk_token = None  # named but not in the vocabulary: the tokenizer refuses unknown characters
        if not any(len(token) == 1 for token in vocab) or any(
            len(token) != 1 and token not in special_tokens for token in vocab
        ):
            return None
        return cls(vocab, special_tokens, unk_token)

    def __call__(self, text: str) -> np.ndarray | None:
        """The ids of ``text``, or None when it holds an added token (such as ``<|endoftext|>``), which the
        tokenizer matches as one token: then only the tokenizer itself gives its ids."""
        if any(token in text for token in self.special_tokens):
            return None
        points = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
        ids = self.table[np.minimum(points, len(self.table) - 1)]  # the last entry: unknown
        if (ids == self.unk_id).any():
            unknown = [chr(point) for point in np.unique(points[ids == self.unk_id])]
            listed = f"{''.join(unknown[:20])!r}{' ...' if len(unknown) > 20 else ''}"
            if self.unk_id < 0:
                raise ValueError(
                    f"The text holds {len(unknown)} character(s) the character tokenizer does not know: {listed}. "
                    "Its vocabulary is fixed when it is built, and this tokenizer (saved before character tokenizers "
                    "had <|unk|>) has no unknown token; train on text it covers, or build a new tokenizer "
                    "(--tokenizer_type char without --model_name_or_path)."
                )
            if new := set(unknown) - self.unknown:
                self.unknown |= new
                logger.info(f"Characters outside the character vocabulary become {UNK_TOKEN}: {sorted(new)}")
        return ids


class TextEncoder:
    """The token ids of many texts at once, without special tokens, as int64 arrays: ``CharEncoder``'s table for a
    character tokenizer, tiktoken for a byte-level BPE when it is installed (``TiktokenBPE``), else the ``tokenizers``
    tokenizer's batched call (Rust, no Python per token). A text holding an added token (``<|endoftext|>``) goes
    to the tokenizer itself, which matches that token whole."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer, self.chars = tokenizer, CharEncoder.of(tokenizer)
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.bpe = TiktokenBPE.of(tokenizer) if self.chars is None else None

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        ids = [None] * len(texts)
        if self.chars is not None:
            ids = [self.chars(text) for text in texts]
        elif self.bpe is not None:
            ids = self.bpe(texts)
        if rest := [i for i, row in enumerate(ids) if row is None]:  # the tokenizer's own call, batched
            if self.backend is not None:
                some = [texts[i] for i in rest]
                encoded = [e.ids for e in self.backend.encode_batch_fast(some, add_special_tokens=False)]
            else:
                encoded = self.tokenizer([texts[i] for i in rest], add_special_tokens=False)["input_ids"]
            for i, row in zip(rest, encoded):
                ids[i] = np.array(row, dtype=np.int64)
        return ids


def byte_level_characters() -> dict[int, str]:
    """The character a byte-level BPE writes for each byte (GPT-2's table): printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


# GPT-2's pre-tokenizer pattern, as tiktoken writes it: what the ByteLevel pre-tokenizer splits text by
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TiktokenBPE:
    """A byte-level BPE of ``train_bpe_tokenizer``'s kind run by tiktoken, faster than the ``tokenizers`` library
    (``python -m benchmarks.prepare_data`` measures the preparation), for preparing and packing data.

    tiktoken merges, in each pre-tokenized word, the adjacent pair whose joined bytes form the token of the lowest
    id, until none does. A BPE trainer numbers its tokens in the order it learns the merges and applies each merge
    to every word as it learns it, so that is the merge the trained tokenizer makes too, and the ids agree; the first
    ``CHECKED`` texts are encoded both ways to make sure, and any difference switches tiktoken off (with a warning).
    ``of`` gives None for any other tokenizer, or without tiktoken."""

    CHECKED = 64  # texts encoded both ways by each encoder (one per shard when preparing)

    def __init__(self, encoding, backend, special_tokens: list[str]):
        self.encoding, self.backend, self.special_tokens = encoding, backend, special_tokens
        self.unchecked, self.agrees = self.CHECKED, True

    @classmethod
    def of(cls, tokenizer) -> "TiktokenBPE | None":
        backend = getattr(tokenizer, "backend_tokenizer", None)
        try:
            import tiktoken
        except ImportError:
            return None
        if backend is None:
            return None
        state = json.loads(backend.to_str())
        model, pre = state["model"], state["pre_tokenizer"] or {}
        byte_level = pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
        if model["type"] != "BPE" or not byte_level or state["normalizer"] is not None or model.get("dropout"):
            return None
        special_tokens = [token["content"] for token in state["added_tokens"]]
        to_byte = {char: byte for byte, char in byte_level_characters().items()}
        ranks = {}
        for token, token_id in model["vocab"].items():
            if token in special_tokens:
                continue
            if any(char not in to_byte for char in token):
                return None
            ranks[bytes(to_byte[char] for char in token)] = token_id
        if len(ranks) < 256:
            return None
        encoding = tiktoken.Encoding("decoderlab-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
        return cls(encoding, backend, special_tokens)

    def __call__(self, texts: list[str]) -> list[np.ndarray | None]:
        """The ids of each text, None for one holding an added token (left to the tokenizer) or when tiktoken was
        found to disagree."""
        if not self.agrees:
            return [None] * len(texts)
        plain = [i for i, text in enumerate(texts) if not any(token in text for token in self.special_tokens)]
        encoded = [self.encoding.encode_ordinary(texts[i]) for i in plain]
        if self.unchecked > 0:
            n = min(self.unchecked, len(plain))
            reference = self.backend.encode_batch_fast([texts[i] for i in plain[:n]], add_special_tokens=False)
            self.unchecked -= n
            if any(ids != e.ids for ids, e in zip(encoded, reference)):
                logger.warning("tiktoken's ids differ from the tokenizer's: tokenizing with the tokenizer itself.")
                self.agrees = False
                return [None] * len(texts)
        ids: list[np.ndarray | None] = [None] * len(texts)
        for i, row in zip(plain, encoded):
            ids[i] = np.array(row, dtype=np.int64)
        return ids


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2's scheme) trained on ``texts``, with ``<|endoftext|>`` (id 0) as its end-of-text,
    padding and beginning-of-sequence token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no text is ever unknown
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return wrap_tokenizer(tokenizer)


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except OSError as err:
        raise ValueError(
            f"Could not load tokenizer {name_or_path!r} as a folder or a Hub id ({err}). "
            "Offline, pass the folder of a saved tokenizer (tokenizer.json + tokenizer_config.json)."
        ) from err


def build_tokenizer(
    cfg: TrainConfig, train_texts: Iterable[str], validation_texts: Iterable[str] = ()
) -> PreTrainedTokenizerBase:
    """The tokenizer ``cfg.tokenizer_type`` asks for, trained on ``train_texts`` (a character vocabulary also covers
    ``validation_texts``, so that evaluation meets no unknown character)."""
    if cfg.tokenizer_type == "pretrained":
        return load_tokenizer(cfg.tokenizer_name)
    if cfg.tokenizer_type == "char":
        return train_char_tokenizer(itertools.chain(train_texts, validation_texts))
    return train_bpe_tokenizer(train_texts, cfg.bpe_vocab_size)


def tokenizer_for_run(
    cfg: TrainConfig, accelerator: Accelerator, train: TextSplit, validation: TextSplit | None, checkpoint=None
) -> PreTrainedTokenizerBase:
    """A resumed run's tokenizer is its checkpoint's. Otherwise the main process builds it and saves it
    into ``output_dir``, and the other processes load that copy (BPE training is not promised to be
    bit-for-bit reproducible, so each process training its own could disagree)."""
    if checkpoint is not None:
        return load_tokenizer(str(checkpoint))
    with accelerator.main_process_first():
        if accelerator.is_main_process:
            column, limit = cfg.text_column_name, cfg.tokenizer_train_texts
            validation_texts = iter_texts(validation, column, limit) if validation is not None else ()
            tokenizer = build_tokenizer(cfg, iter_texts(train, column, limit), validation_texts)
            tokenizer.save_pretrained(cfg.output_dir)
        else:
            tokenizer = load_tokenizer(cfg.output_dir)
    return tokenizer


# ----------------------------------------------------------------------------------------------
# 3. Packing


@dataclass(frozen=True)
class Packing:
    """How ``pack`` turns texts into blocks: ``block_size`` tokens each, from the ``column`` of each row. Whole
    documents are separated by the tokenizer's end-of-text token, if it has one; the lines of one text file
    (``documents=False``) are not. ``overwrite_cache`` and ``num_proc`` go to ``datasets.map``."""

    block_size: int
    column: str = "text"
    documents: bool = True
    overwrite_cache: bool = False
    num_proc: int | None = None

    @classmethod
    def of(cls, cfg: TrainConfig) -> "Packing":
        """The packing ``cfg`` asks for (a ``--train_file`` ending in .txt holds lines, not documents)."""
        rows_are_lines = cfg.train_file is not None and cfg.train_file.endswith(".txt")
        return cls(cfg.block_size, cfg.text_column_name, not rows_are_lines, cfg.overwrite_cache,
                   cfg.preprocessing_num_workers)  # fmt: skip


def pack(split: TextSplit, tokenizer: PreTrainedTokenizerBase, packing: Packing, split_name: str) -> TextSplit:
    """Tokenize the texts of ``split`` and cut their concatenation into rows of ``block_size`` ``input_ids``.

    Map-style splits are cached by ``datasets`` under a fingerprint of (the split, the tokenizer, the
    packing settings); the tail of each batch of 1000 texts that does not fill a block is dropped.
    """
    block_size, column = packing.block_size, packing.column
    separator = [tokenizer.eos_token_id] if packing.documents and tokenizer.eos_token_id is not None else []
    separator_ids = np.array(separator, dtype=np.int64)
    encode = TextEncoder(tokenizer)

    def tokenize_and_cut(batch: dict) -> dict:
        pieces = [piece for row in encode(batch[column]) for piece in (row, separator_ids)]
        flat = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
        n_blocks = len(flat) // block_size
        return {"input_ids": flat[: n_blocks * block_size].reshape(n_blocks, block_size)}

    columns = split.column_names or list(next(iter(split)))  # a stream may not know its columns before reading
    kwargs = dict(batched=True, remove_columns=columns)
    if isinstance(split, datasets.Dataset):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        tokenizer_state = backend.to_str() if backend is not None else Hasher.hash(tokenizer)
        fingerprint = Hasher.hash([split._fingerprint, tokenizer_state, block_size, column, separator, PACKING_VERSION])
        kwargs.update(
            new_fingerprint=fingerprint,
            load_from_cache_file=not packing.overwrite_cache,
            num_proc=packing.num_proc,
            desc=f"Tokenizing and packing {split_name} into blocks of {block_size}",
        )
    return split.map(tokenize_and_cut, **kwargs)


def block_tensor(blocks: datasets.Dataset) -> torch.Tensor:
    """All packed blocks as one (N, block_size) tensor (int32 when the ids fit), read straight from Arrow."""
    if blocks.num_rows == 0:  # an empty map result has no columns at all
        return torch.empty(0, 0, dtype=torch.int64)
    column = blocks.data.column("input_ids")
    flat = np.concatenate([chunk.flatten().to_numpy() for chunk in column.chunks])
    tensor = torch.from_numpy(flat.reshape(blocks.num_rows, -1))
    return tensor.to(torch.int32) if tensor.max() < 2**31 else tensor


def too_short_error(
    split: TextSplit, tokenizer, column: str, block_size: int, split_name: str, needed: int = 1
) -> ValueError:
    n_tokens = sum(
        len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in iter_texts(split, column, 10_000)
    )
    return ValueError(
        f"The {split_name} text is too short: it has {n_tokens} tokens, fewer than {needed} block(s) of "
        f"block_size={block_size} tokens. Lower --block_size or give more text."
    )


def split_blocks(blocks: torch.Tensor, percentage: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the last ``percentage`` % of the blocks validate (nanoGPT's split is the last 10 %)."""
    n_validation = max(1, round(len(blocks) * percentage / 100))
    return blocks[: len(blocks) - n_validation], blocks[len(blocks) - n_validation :]


def prepare_map_style(
    train: datasets.Dataset, validation: datasets.Dataset | None, tokenizer, packing: Packing, percentage: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train blocks, validation blocks) as tensors; without a validation split the last ``percentage`` % of
    the train blocks validate."""
    too_short = lambda split, name, needed=1: too_short_error(
        split, tokenizer, packing.column, packing.block_size, name, needed
    )
    train_blocks = block_tensor(pack(train, tokenizer, packing, "train"))
    if validation is None:
        if len(train_blocks) < 2:
            raise too_short(train, "train", needed=2)
        logger.info(f"No validation split: the last {percentage}% of the train blocks validate.")
        return split_blocks(train_blocks, percentage)
    if len(train_blocks) == 0:
        raise too_short(train, "train")
    validation_blocks = block_tensor(pack(validation, tokenizer, packing, "validation"))
    if len(validation_blocks) == 0:
        raise too_short(validation, "validation")
    return train_blocks, validation_blocks


def prepare_streaming(
    train: datasets.IterableDataset,
    validation: datasets.IterableDataset | None,
    tokenizer,
    packing: Packing,
    validation_texts: int,
    max_eval_samples: int | None = None,
) -> tuple[datasets.IterableDataset, torch.Tensor]:
    """(training texts, streamed; validation blocks, in memory, at most ``max_eval_samples``).

    Without a validation split the first ``validation_texts`` documents validate, and they are taken out of the
    whole stream by their text, before ``StreamBatches`` splits it over processes: no process trains on them,
    whatever the number of processes or files (a ``skip`` would be divided among the files of a split stream,
    and the process holding the first file would train on most of them). A training document identical to a
    validation one is left out too."""
    if validation is None:
        validation = train.take(validation_texts)
        held_out = frozenset(iter_texts(validation, packing.column))
        train = train.filter(lambda text: text not in held_out, input_columns=packing.column)
    rows = list(itertools.islice(pack(validation, tokenizer, packing, "validation"), max_eval_samples))
    if not rows:
        raise too_short_error(validation, tokenizer, packing.column, packing.block_size, "validation")
    blocks = torch.from_numpy(np.stack([np.asarray(r["input_ids"]) for r in rows]))
    return train, blocks


# ----------------------------------------------------------------------------------------------
# 4. Batches


class BlockBatches:
    """Endless batches of packed blocks: seeded, sharded over processes, resumable at any batch.

    Global batch ``b`` holds blocks ``order[b * G : (b + 1) * G]`` of its epoch's permutation, with
    ``G = batch_size * num_processes``; process ``r`` takes rows ``[r * batch_size, (r + 1) * batch_size)``
    of it. The permutation depends only on ``(seed, epoch)``, so ``iterate(start=b)`` yields exactly
    what an uninterrupted run yields from batch ``b`` on, and one process with batch size ``G`` sees
    the same blocks at each step as ``num_processes`` processes with ``batch_size`` each. Blocks left
    over after the last full global batch of an epoch are skipped in that epoch only.

    ``blocks`` is an (N, T) tensor of token ids (batches: ``input_ids`` and ``labels``, the same ids), or
    prepared token shards (``token_shards.ShardBlocks``, read through np.memmap), or, for fine-tuning, a dict of
    (N, T) tensors whose rows belong together (``input_ids``, ``labels`` with -100 where no loss is taken,
    ``attention_mask`` or ``position_ids``): batches then hold those rows.

    A checkpoint records the global batch size and the number of blocks (``state_dict``): a resume with another
    number of processes at the same global batch continues exactly (each process takes its rows of the same
    global batches); another global batch or other data is refused (``load_state_dict``).
    """

    kind = "blocks"

    def __init__(
        self,
        blocks: torch.Tensor | dict[str, torch.Tensor],
        batch_size: int,
        seed: int,
        process_index: int = 0,
        num_processes: int = 1,
    ):
        self.blocks, self.batch_size, self.seed = blocks, batch_size, seed
        self.rows = blocks if isinstance(blocks, dict) else {"input_ids": blocks}  # {name: (N, T)}
        self.num_blocks = len(self.rows["input_ids"])
        self.process_index, self.global_batch_size = process_index, batch_size * num_processes
        self.batches_per_epoch = self.num_blocks // self.global_batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"Only {self.num_blocks} training blocks, fewer than one global batch of {self.global_batch_size} "
                f"({batch_size} per process x {num_processes} processes). Lower the batch size or block_size, "
                "or give more text."
            )

    def state_dict(self, consumed: int) -> dict:
        """What a checkpoint after ``consumed`` micro-batches must match to continue exactly (the step says where)."""
        return {"kind": self.kind, "num_processes": self.global_batch_size // self.batch_size,
                "global_batch_size": self.global_batch_size, "blocks": self.num_blocks, "seed": self.seed}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        check_data_state(state, self.kind, self.global_batch_size // self.batch_size)
        now = {"global_batch_size": self.global_batch_size, "blocks": self.num_blocks, "seed": self.seed}
        check_same_position(state, now, "blocks")

    def order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(self.seed + epoch))

    def iterate(self, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        epoch, index = divmod(start, self.batches_per_epoch)
        order = self.order(epoch)
        while True:
            if index == self.batches_per_epoch:
                epoch, index, order = epoch + 1, 0, self.order(epoch + 1)
            first = index * self.global_batch_size + self.process_index * self.batch_size
            picked = order[first : first + self.batch_size]
            batch = {name: rows[picked].long() for name, rows in self.rows.items()}  # each (B, T)
            batch.setdefault("labels", batch["input_ids"])
            yield batch
            index += 1


class StreamBatches:
    """Batches of a streamed dataset, tokenized and packed as they are read, shuffled, split over processes, and
    resumable exactly from a small state, without reading again what was trained on.

    The texts are split over processes first (``split_dataset_by_node``: whole files per process when their
    number divides evenly, else every P-th document), then each process tokenizes its texts (documents separated
    by the end-of-text token) into blocks of ``block_size``. Blocks are shuffled in windows: about
    ``shuffle_buffer_size`` consecutive blocks, yielded in an order seeded by (seed, process, epoch, window).

    ``state_dict(b)`` is where the stream stands after micro-batch ``b``: the dataset's own state at the start of
    the current window (``IterableDataset.state_dict``), the tokens carried into it (fewer than a block), and how
    many of its blocks were used. ``load_state_dict`` then ``iterate()`` reads that one window again and goes on:
    a resume at step 19,000 costs what one at step 10 costs. Without a loaded state, ``iterate(start)`` replays
    the stream from its beginning and drops the first ``start`` batches (what older checkpoints need).
    """

    kind = "stream"

    def __init__(
        self,
        texts: datasets.IterableDataset,
        tokenizer,
        packing: Packing,
        batch_size: int,
        seed: int,
        process_index: int = 0,
        num_processes: int = 1,
        shuffle_buffer_size: int = 10_000,
    ):
        self.texts = split_dataset_by_node(texts, rank=process_index, world_size=num_processes)
        self.column, self.block_size, self.batch_size = packing.column, packing.block_size, batch_size
        self.encode = TextEncoder(tokenizer)
        documents = packing.documents and tokenizer.eos_token_id is not None
        self.separator = np.array([tokenizer.eos_token_id] if documents else [], dtype=np.int64)
        self.seed, self.process_index, self.num_processes = seed, process_index, num_processes
        self.window_blocks = shuffle_buffer_size
        self.states: dict[int, dict] = {}  # micro-batch index -> the state after it (kept for the few read ahead)
        self.loaded: dict | None = None

    def windows(self, start: dict) -> Iterator[tuple[dict, np.ndarray]]:
        """(the state at the window's start, its blocks (N, T) in shuffled order), from the state ``start`` on."""
        epoch, dataset_state, window = start["epoch"], start["dataset"], start["window"]
        leftover = np.array(start["leftover"], dtype=np.int64)
        while True:
            self.texts.set_epoch(epoch)
            if dataset_state is not None:
                self.texts.load_state_dict(dataset_state)
            rows, blocks_this_epoch = iter(self.texts), 0
            while True:
                state = {"epoch": epoch, "window": window, "dataset": dataset_state, "leftover": leftover.tolist()}
                pieces, n_tokens, ended = [leftover], len(leftover), False
                while n_tokens < self.window_blocks * self.block_size and not ended:
                    texts = [row[self.column] for row in itertools.islice(rows, TEXTS_PER_CALL)]
                    ended = len(texts) < TEXTS_PER_CALL
                    for ids in self.encode(texts):
                        pieces.extend((ids, self.separator))
                        n_tokens += len(ids) + len(self.separator)
                flat = np.concatenate(pieces)
                n_blocks = len(flat) // self.block_size
                blocks = flat[: n_blocks * self.block_size].reshape(n_blocks, self.block_size)
                order = np.random.default_rng([self.seed, self.process_index, epoch, window]).permutation(n_blocks)
                blocks_this_epoch += n_blocks
                if n_blocks:
                    yield state, blocks[order]
                if ended:
                    break
                leftover, window = flat[n_blocks * self.block_size :], window + 1
                dataset_state = self.texts.state_dict()
            if blocks_this_epoch == 0:
                raise ValueError(
                    f"Process {self.process_index} of {self.num_processes} gets no block of {self.block_size} tokens "
                    "from its part of the stream: give more text, lower block_size, or use fewer processes."
                )
            epoch, window, dataset_state, leftover = epoch + 1, 0, None, np.empty(0, dtype=np.int64)

    def iterate(self, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        position = self.loaded or {"epoch": 0, "window": 0, "dataset": None, "leftover": [], "used": 0}
        skip, replay = position["used"], 0 if self.loaded else start
        if replay:
            logger.info(f"Resuming a stream without its saved position: reading past the first {replay} batches.")
        batch, index = [], start
        for state, blocks in self.windows(position):
            for used, block in enumerate(blocks[skip:], start=skip + 1):
                batch.append(block)
                if len(batch) < self.batch_size:
                    continue
                if replay:
                    replay, batch = replay - 1, []
                    continue
                self.states[index] = {**state, "used": used}
                self.states.pop(index - KEPT_STATES, None)  # far behind the batches read ahead
                input_ids = torch.from_numpy(np.stack(batch))  # (B, T)
                batch, index = [], index + 1
                yield {"input_ids": input_ids, "labels": input_ids}
            skip = 0

    def state_dict(self, consumed: int) -> dict:
        """Where this process's stream stands once ``consumed`` micro-batches have been used."""
        return {"kind": self.kind, "num_processes": self.num_processes, **self.states[consumed - 1]}

    def load_state_dict(self, state: dict) -> None:
        check_data_state(state, self.kind, self.num_processes)
        self.loaded = state


def check_data_state(state: dict, kind: str, num_processes: int) -> None:
    """Refuse a checkpoint's data position that this run's data cannot continue from: another kind of data (a
    stream, blocks), or a stream saved by another number of processes (each process's position is its own)."""
    if kind == "blocks" and state["kind"] == WindowBatches.kind:
        check_sampling(state, "blocks")  # names the checkpoint's window_sampling
    if state["kind"] != kind:
        raise ValueError(
            f"The checkpoint was trained on {state['kind']} data and this run reads {kind} data: its position in "
            "the data does not carry over. Resume with the data it was trained on."
        )
    if kind == "stream" and state["num_processes"] != num_processes:
        raise ValueError(
            f"The checkpoint's stream positions were saved by {state['num_processes']} process(es) and this run has "
            f"{num_processes} (num_processes): each process reads its own part of a stream, so its position does not "
            f"carry over to another split. Resume with {state['num_processes']} processes, or train from prepared "
            "shards (--prepared_data), which resume with any number of processes at the same global batch."
        )


class Prefetched:
    """The batches of ``iterator``, read ``depth`` ahead by a background thread (page-locked with ``pin_memory``, for
    copies to a CUDA device that overlap compute), so reading and tokenizing happen while the model computes;
    ``waited_s`` is the time the consumer spent waiting for them. With ``depth`` 0 each batch is read when asked
    for, and ``waited_s`` is the time reading took."""

    def __init__(self, iterator: Iterator[dict], depth: int, pin_memory: bool = False):
        self.iterator, self.pin_memory, self.waited_s = iterator, pin_memory, 0.0
        self.queue: queue.Queue | None = None
        if depth > 0:
            self.queue, self.stopped = queue.Queue(maxsize=depth), threading.Event()
            self.thread = threading.Thread(target=self.fill, name="prefetch", daemon=True)
            self.thread.start()

    def fill(self) -> None:
        try:
            for batch in self.iterator:
                if self.pin_memory:
                    batch = {name: tensor.pin_memory() for name, tensor in batch.items()}
                while not self.stopped.is_set():
                    try:
                        self.queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.stopped.is_set():
                    return
        except BaseException as error:  # raised again in the consumer, where it stops the run
            self.queue.put(error)

    def __iter__(self) -> "Prefetched":
        return self

    def __next__(self) -> dict:
        start = time.perf_counter()
        item = next(self.iterator) if self.queue is None else self.queue.get()
        self.waited_s += time.perf_counter() - start
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the reading thread: it ends within 0.1 s once its current batch is read (a daemon thread, so one
        stuck in a read does not keep the process alive)."""
        if self.queue is not None:
            self.stopped.set()
            self.thread.join(timeout=5)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """The tokens a batch's loss is taken on: position t predicts ``labels[t + 1]``, unless that is -100."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens of a batch that are not padding: what ``tokens`` and ``tokens_per_s`` count.

    Right-padded rows (an ``attention_mask``, ``sft_data.pad_examples``): the mask's ones. Packed rows
    (``position_ids`` restarting at 0 for each example, ``sft_data.pack_examples``): all but the padding
    that ends a row, the one sequence of a row without a single target (each packed example has one).
    Blocks of text: every token.
    """
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    input_ids = batch["input_ids"]
    if "position_ids" not in batch:
        return input_ids.numel()
    sequence = (batch["position_ids"] == 0).cumsum(dim=1)  # (B, T): which packed sequence each token is in
    last = sequence == sequence[:, -1:]  # (B, T): the tokens of each row's last sequence
    last_is_padding = ~((batch["labels"] != IGNORE_INDEX) & last).any(dim=1)  # (B,)
    return input_ids.numel() - int(last[last_is_padding].sum())


def batched(rows: Iterable, n: int) -> Iterator[list]:
    """Lists of ``n`` consecutive items (the last one shorter); ``itertools.batched`` from Python 3.12 on."""
    rows = iter(rows)
    while batch := list(itertools.islice(rows, n)):
        yield batch


def prepare_data(cfg: TrainConfig, accelerator: Accelerator, checkpoint=None, tokenizer=None):
    """(tokenizer, training batches, validation blocks) for ``cfg``; downloads, tokenizer training and
    tokenization happen on the main process first, the others then read its caches. A given ``tokenizer``
    (fine-tuning: the base model's) is used as it is instead of ``tokenizer_for_run``'s."""
    with accelerator.main_process_first():
        train, validation = load_text_splits(cfg)
    built_here = tokenizer is None and checkpoint is None and cfg.tokenizer_type != "pretrained"  # knows the data
    if tokenizer is None:
        tokenizer = tokenizer_for_run(cfg, accelerator, train, validation, checkpoint)
    for split, name in ((train, "the train split"), (validation, "the validation split")):  # every process stops
        if split is not None and not built_here:  # a tokenizer not built from this data may not know its characters
            texts = iter_texts(split, cfg.text_column_name, UNKNOWN_CHARACTERS_SAMPLE)
            check_unknown_characters(tokenizer, texts, name, cfg.allow_unknown_characters, accelerator.is_main_process)
    shard = dict(seed=cfg.seed, process_index=accelerator.process_index, num_processes=accelerator.num_processes)
    with accelerator.main_process_first():
        if cfg.streaming:
            packing = Packing.of(cfg)
            train_texts, eval_blocks = prepare_streaming(
                train, validation, tokenizer, packing, cfg.streaming_validation_texts, cfg.max_eval_samples
            )
            batches = StreamBatches(
                train_texts, tokenizer, packing, cfg.per_device_train_batch_size,
                shuffle_buffer_size=cfg.shuffle_buffer_size, **shard,
            )  # fmt: skip
        else:
            train_blocks, eval_blocks = prepare_map_style(
                train, validation, tokenizer, Packing.of(cfg), cfg.validation_split_percentage
            )
            batches = training_batches(cfg, train_blocks, shard)
    return tokenizer, batches, eval_blocks


def training_batches(cfg: TrainConfig, blocks, shard: dict, tokens: TokenWindows | None = None):
    """The training batches ``cfg.window_sampling`` asks for: ``BlockBatches`` of the fixed ``blocks`` ("blocks"),
    else ``sampling.WindowBatches`` of windows at any offset of the same tokens (``tokens``, or the blocks' own, in
    order). ``shard``: seed, process_index and num_processes."""
    if cfg.window_sampling == "blocks":
        return BlockBatches(blocks, cfg.per_device_train_batch_size, **shard)
    tokens = tokens if tokens is not None else TokenWindows.of_blocks(blocks)
    return WindowBatches(tokens, cfg.window_sampling, cfg.block_size, cfg.per_device_train_batch_size, **shard)
