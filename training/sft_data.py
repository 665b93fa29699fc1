"""Fine-tuning data: plain text, prompt/completion pairs or chat conversations, as rows of token ids and labels.

The three formats (``ExampleFormat.data_format``) and the columns each needs:

- ``text``: ``text_column_name``. Continued pretraining: every token is a target. Packed, it is exactly
  the pretraining pipeline (``training.data.prepare_data``): texts concatenated and cut into blocks.
- ``prompt_completion``: ``prompt_column_name`` and ``completion_column_name``. The prompt is tokenized
  as a user's prompt is at inference (``tokenizer(prompt)``), the completion after it, followed by the
  end-of-text token when the tokenizer has one; only completion tokens (and that end) are targets.
- ``chat``: ``messages_column_name``, a list of ``{"role", "content"}``. Rendered with the tokenizer's
  chat template (``DEFAULT_CHAT_TEMPLATE`` when it has none); only the assistant messages are targets.

Every example becomes ``input_ids`` and ``labels``, the labels -100 wherever no loss is taken (the model
shifts them: position t is scored on ``labels[t + 1]``). ``fit_examples`` applies the block size: a
prompt that fills the whole block is cut from the left (``overlong_prompt=truncate``, with a warning)
or refused (``refuse``); anything still longer than the block is cut at its end. Then either

- ``pack_examples``: whole examples placed one after another into rows of ``block_size`` tokens, with
  ``position_ids`` restarting at 0 for each example. transformers' mask builder reads restarts as
  separate sequences (``masking_utils.find_packed_sequence_indices``, which runs when there is no KV
  cache, as in training and evaluation), so attention stays inside each example (a block-diagonal causal
  mask) and a packed example scores exactly as it would alone; or
- ``pad_examples``: one example per row, right-padded, with an ``attention_mask``; ``TrimmedBatches``
  cuts each batch to its longest row.

Rows are dicts of (N, T) tensors that ``training.data.BlockBatches`` batches and ``training.loop.evaluate``
scores, so the rest of fine-tuning is the pretraining loop.
"""

import dataclasses
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import datasets
import numpy as np
import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from .data import (
    IGNORE_INDEX,
    UNKNOWN_CHARACTERS_SAMPLE,
    BlockBatches,
    Packing,
    block_tensor,
    check_unknown_characters,
    load_splits,
    pack,
    prepare_data,
)
from .finetune_args import DATA_FORMATS, OVERLONG_PROMPT, FinetuneConfig

logger = logging.getLogger(__name__)

# The config fields naming the columns each format reads
FORMAT_COLUMNS = {
    "text": ("text_column_name",),
    "prompt_completion": ("prompt_column_name", "completion_column_name"),
    "chat": ("messages_column_name",),
}

# Plain role headers that a character-level vocabulary of English text can spell (no <|im_start|>-style
# markers, which a char or small BPE tokenizer would split into many rare pieces). An assistant turn
# ends with the end-of-text token when the tokenizer has one, so generation learns to stop.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | upper }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' and eos_token %}{{ eos_token }}{% endif %}"
    "{{ '\\n\\n' }}"  # an expression: the chat-template Jinja trims a newline that follows a tag
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)


@dataclass(frozen=True)
class ExampleFormat:
    """How a dataset's rows become training rows: the format and the columns it reads, the block, packing or
    padding, and what to do with a prompt that fills the block (``FinetuneConfig``'s fields of these names;
    ``ExampleFormat.of(cfg)`` takes them from any configuration that has them)."""

    data_format: DATA_FORMATS = "text"
    block_size: int = 256
    text_column_name: str = "text"
    prompt_column_name: str = "prompt"
    completion_column_name: str = "completion"
    messages_column_name: str = "messages"
    packing: bool = True
    overlong_prompt: OVERLONG_PROMPT = "truncate"

    @classmethod
    def of(cls, cfg) -> "ExampleFormat":
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    def columns(self) -> list[str]:
        return [getattr(self, field) for field in FORMAT_COLUMNS[self.data_format]]


# ----------------------------------------------------------------------------------------------
# Checking the data and the tokenizer


def check_columns(split, fmt: ExampleFormat, split_name: str) -> None:
    """The split has every column ``fmt.data_format`` reads, or a ValueError naming what is missing and what exists."""
    needed = fmt.columns()
    columns = split.column_names or list(next(iter(split)).keys())  # a stream may not know them before reading
    missing = [name for name in needed if name not in columns]
    if missing:
        flags = ", ".join(f"--{field}" for field in FORMAT_COLUMNS[fmt.data_format])
        raise ValueError(
            f"data_format={fmt.data_format!r} needs the column(s) {needed}, but the {split_name} split has no "
            f"{missing}; its columns are {columns}. Name the right columns with {flags}, or choose the format "
            "that fits the data: text (one text column), prompt_completion (a prompt and a completion column) "
            "or chat (a column of message lists)."
        )


def set_chat_template(tokenizer: PreTrainedTokenizerBase, template_file: str | None) -> None:
    """Give ``tokenizer`` the chat template chat fine-tuning uses: ``template_file`` if given, else its own,
    else ``DEFAULT_CHAT_TEMPLATE``; ``save_pretrained`` then stores it with the tokenizer."""
    if template_file is not None:
        try:
            with open(template_file, encoding="utf-8") as f:
                tokenizer.chat_template = f.read()
        except OSError as err:
            raise ValueError(f"--chat_template {template_file}: cannot read it ({err}); pass a Jinja file.") from err
    elif tokenizer.chat_template is None:
        logger.info("The tokenizer has no chat template; using decoderlab's plain 'ROLE: content' template.")
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that fills padding; never attended to nor scored, so any valid id would do."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    return 0


# ----------------------------------------------------------------------------------------------
# Tokenizing: every example as (input_ids, labels)


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def chat_segments(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_target) pieces: each assistant message is the text that
    rendering it adds after the generation prompt, i.e. exactly what the model must write at inference.
    An assistant message that opens the conversation answers nothing and is context, not a target."""
    full, segments, done = render(tokenizer, messages, False), [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        prompt_text = render(tokenizer, messages[:i], True)  # everything up to the generation prompt
        end_text = render(tokenizer, messages[: i + 1], False)
        if not (full.startswith(end_text) and end_text.startswith(prompt_text) and len(prompt_text) >= done):
            raise ValueError(
                "The chat template does not render a conversation as a prefix of its continuation (for example, it "
                "changes earlier turns once a later one exists), so the assistant tokens cannot be located. Pass a "
                "template that appends turns with --chat_template FILE."
            )
        segments += [(full[done : len(prompt_text)], False), (full[len(prompt_text) : len(end_text)], True)]
        done = len(end_text)
    segments.append((full[done:], False))
    return [(text, target) for text, target in segments if text]


def check_messages(messages, column: str, index: int) -> None:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError(
            f"Example {index}: column {column!r} must hold a list of {{'role': str, 'content': str}} messages, "
            f"got {str(messages)[:200]}."
        )


def tokenize_example(row: dict, tokenizer: PreTrainedTokenizerBase, fmt: ExampleFormat, index: int) -> dict:
    """``input_ids`` and ``labels`` (-100 where no loss is taken) of one example."""

    def encode(text: str, special_tokens: bool = False) -> list[int]:
        try:
            return tokenizer(text, add_special_tokens=special_tokens)["input_ids"]
        except Exception as err:  # tokenizers' own errors, e.g. a character outside a character-level vocabulary
            raise ValueError(
                f"Example {index} cannot be tokenized with the base model's tokenizer ({type(err).__name__}: {err}). "
                "A character-level tokenizer knows only the characters of its training text: remove the others "
                "from the data, or fine-tune a model whose tokenizer covers them."
            ) from err

    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if fmt.data_format == "text":
        ids = encode(row[fmt.text_column_name]) + eos
        return {"input_ids": ids, "labels": ids}
    if fmt.data_format == "prompt_completion":
        prompt = encode(row[fmt.prompt_column_name], special_tokens=True)  # as a prompt is encoded at inference
        completion = encode(row[fmt.completion_column_name]) + eos
        return {"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion}
    messages = row[fmt.messages_column_name]
    check_messages(messages, fmt.messages_column_name, index)
    ids, labels = [], []
    for text, target in chat_segments(tokenizer, messages):
        piece = encode(text)
        ids += piece
        labels += piece if target else [IGNORE_INDEX] * len(piece)
    return {"input_ids": ids, "labels": labels}


def example_texts(split: datasets.Dataset, fmt: ExampleFormat) -> Iterator[str]:
    """The texts the examples of ``split`` hold (the first ``UNKNOWN_CHARACTERS_SAMPLE``): a text, a prompt and its
    completion, or each message's content."""
    for row in itertools.islice(split.select_columns(fmt.columns()), UNKNOWN_CHARACTERS_SAMPLE):
        if fmt.data_format == "chat":
            messages = row[fmt.messages_column_name]
            yield from (
                m["content"] for m in messages or [] if isinstance(m, dict) and isinstance(m.get("content"), str)
            )
        else:
            yield from (row[column] for column in fmt.columns() if isinstance(row[column], str))


def tokenize_examples(
    split: datasets.Dataset,
    tokenizer,
    fmt: ExampleFormat,
    split_name: str,
    overwrite_cache: bool = False,
    num_proc: int | None = None,
) -> datasets.Dataset:
    """The split as ``input_ids``/``labels`` rows; ``datasets`` caches the result under a fingerprint of the
    split, the tokenizer (chat template included) and these settings."""

    def tokenize(batch: dict, indices: list[int]) -> dict:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        out = [tokenize_example(row, tokenizer, fmt, index) for row, index in zip(rows, indices)]
        return {"input_ids": [o["input_ids"] for o in out], "labels": [o["labels"] for o in out]}

    columns = fmt.columns()
    return split.select_columns(columns).map(
        tokenize,
        batched=True,
        with_indices=True,
        remove_columns=columns,
        load_from_cache_file=not overwrite_cache,
        num_proc=num_proc,
        desc=f"Tokenizing {split_name} ({fmt.data_format})",
    )


# ----------------------------------------------------------------------------------------------
# Fitting examples into blocks


def fit_examples(examples: datasets.Dataset, fmt: ExampleFormat, split_name: str) -> list[tuple[list, list]]:
    """(input_ids, labels) of every example, at most ``block_size`` tokens long, each with a target to learn.

    A prompt (the tokens before the first target) of ``block_size`` tokens or more leaves no room for its
    completion: ``overlong_prompt=refuse`` raises a ValueError, ``truncate`` keeps its last
    ``block_size // 2`` tokens and warns. An example still longer than the block loses its end (a
    warning). An example with no target after its first token (an empty completion, a conversation
    without an assistant turn) teaches nothing and is dropped (a warning).
    """
    block, keep = fmt.block_size, fmt.block_size // 2
    fitted, long_prompts, cut, empty = [], [], 0, 0
    for index, (ids, labels) in enumerate(zip(examples["input_ids"], examples["labels"])):
        targets = np.flatnonzero(np.asarray(labels) != IGNORE_INDEX)
        prompt_length = int(targets[0]) if len(targets) else len(ids)
        if prompt_length >= block and len(targets):
            long_prompts.append((prompt_length, index))
            ids, labels = ids[prompt_length - keep :], labels[prompt_length - keep :]
        if len(ids) > block:
            ids, labels, cut = ids[:block], labels[:block], cut + 1
        if all(label == IGNORE_INDEX for label in labels[1:]):
            empty += 1
            continue
        fitted.append((ids, labels))
    n = len(examples)
    if long_prompts:
        longest, at = max(long_prompts)
        what = (
            f"{len(long_prompts)} of {n} {split_name} examples have a prompt of block_size={block} tokens or more "
            f"(the longest, example {at}, has {longest}), so none of their completion fits in a block"
        )
        if fmt.overlong_prompt == "refuse":
            raise ValueError(
                f"{what}. Raise --block_size, shorten those prompts, or pass --overlong_prompt truncate to keep "
                f"the last {keep} tokens of each."
            )
        logger.warning(f"{what}: kept the last {keep} tokens of each (--overlong_prompt truncate).")
    if cut:
        logger.warning(f"{cut} of {n} {split_name} examples are longer than block_size={block}: their ends were cut.")
    if empty:
        logger.warning(f"{empty} of {n} {split_name} examples have no target tokens (nothing to learn): dropped.")
    if not fitted:
        raise ValueError(
            f"No {split_name} example has a target token to learn (completions or assistant messages). "
            f"Check the data and data_format={fmt.data_format!r}."
        )
    return fitted


def pack_examples(examples: list[tuple[list, list]], block_size: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Rows of ``block_size`` tokens filled with whole examples in order, ``position_ids`` restarting at each.

    The padding that ends a row is a sequence of its own (positions from 0, labels -100), so no example
    attends to it. Returns ``input_ids``, ``labels`` and ``position_ids``, each (N, block_size) int32.
    """
    rows, row = [], ([], [], [])

    def close(row):
        n_pad = block_size - len(row[0])
        rows.append((row[0] + [pad_id] * n_pad, row[1] + [IGNORE_INDEX] * n_pad, row[2] + list(range(n_pad))))

    for ids, labels in examples:
        if len(row[0]) + len(ids) > block_size:
            close(row)
            row = ([], [], [])
        row[0].extend(ids)
        row[1].extend(labels)
        row[2].extend(range(len(ids)))
    close(row)
    columns = zip(*rows)
    return {
        name: torch.tensor(values, dtype=torch.int32)
        for name, values in zip(("input_ids", "labels", "position_ids"), columns)
    }


def pad_examples(examples: list[tuple[list, list]], block_size: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One example per row, right-padded to ``block_size``: ``input_ids``, ``labels`` and ``attention_mask``."""
    input_ids = torch.full((len(examples), block_size), pad_id, dtype=torch.int32)
    labels = torch.full((len(examples), block_size), IGNORE_INDEX, dtype=torch.int32)
    attention_mask = torch.zeros((len(examples), block_size), dtype=torch.int32)
    for i, (ids, row_labels) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(row_labels)
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def example_rows(examples: datasets.Dataset, tokenizer, fmt: ExampleFormat, split_name: str) -> dict[str, torch.Tensor]:
    """Tokenized examples fitted to the block, then packed or padded as ``fmt.packing`` says."""
    fitted = fit_examples(examples, fmt, split_name)
    arrange = pack_examples if fmt.packing else pad_examples
    return arrange(fitted, fmt.block_size, pad_token_id(tokenizer))


def rows_for_split(
    split: datasets.Dataset, tokenizer, fmt: ExampleFormat, split_name: str, documents: bool = True, **cache
):
    """A whole split as model inputs: packed text blocks (N, T) (``documents``: see ``data.Packing``), or a
    dict of (N, T) example rows. ``cache``: ``overwrite_cache`` and ``num_proc`` for ``datasets.map``."""
    check_columns(split, fmt, split_name)
    if fmt.data_format == "text" and fmt.packing:
        packing = Packing(fmt.block_size, fmt.text_column_name, documents, **cache)
        return block_tensor(pack(split, tokenizer, packing, split_name))
    return example_rows(tokenize_examples(split, tokenizer, fmt, split_name, **cache), tokenizer, fmt, split_name)


# ----------------------------------------------------------------------------------------------
# Batches


class TrimmedBatches:
    """``BlockBatches`` of right-padded rows, each batch cut to its longest row: no compute spent on
    columns that are padding in every row. Resumes at any batch exactly as ``BlockBatches`` does."""

    def __init__(self, rows: dict[str, torch.Tensor], batch_size: int, **shard):
        self.batches = BlockBatches(rows, batch_size, **shard)
        self.batches_per_epoch = self.batches.batches_per_epoch

    def iterate(self, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.batches.iterate(start):
            length = int(batch["attention_mask"].sum(dim=1).max())
            yield {name: x[:, :length] for name, x in batch.items()}


def prepare_finetune_data(cfg: FinetuneConfig, accelerator: Accelerator, tokenizer: PreTrainedTokenizerBase):
    """(training batches, validation rows) for ``cfg.data_format``, tokenized with the base model's tokenizer.

    Packed text goes through the pretraining pipeline unchanged. Otherwise, without a validation split
    the last ``validation_split_percentage`` % of the examples validate. Everything is checked (columns,
    prompt lengths, tokenization) here, before any training step.
    """
    if cfg.data_format == "text" and cfg.packing:
        _, batches, eval_blocks = prepare_data(cfg, accelerator, tokenizer=tokenizer)
        return batches, eval_blocks
    fmt, cache = (
        ExampleFormat.of(cfg),
        dict(overwrite_cache=cfg.overwrite_cache, num_proc=cfg.preprocessing_num_workers),
    )
    with accelerator.main_process_first():
        train, validation = load_splits(cfg)
        check_columns(train, fmt, "train")
        if validation is not None:
            check_columns(validation, fmt, "validation")
        for split, name in ((train, "the train split"), (validation, "the validation split")):
            if split is not None:
                check_unknown_characters(
                    tokenizer,
                    example_texts(split, fmt),
                    name,
                    cfg.allow_unknown_characters,
                    accelerator.is_main_process,
                )
        train_examples = tokenize_examples(train, tokenizer, fmt, "train", **cache)
        if validation is None:
            n = len(train_examples)
            n_validation = max(1, round(n * cfg.validation_split_percentage / 100))
            if n - n_validation < 1:
                raise ValueError(f"The train split has {n} example(s): too few to carve off a validation split.")
            logger.info(f"No validation split: the last {n_validation} of {n} examples validate.")
            validation_examples = train_examples.select(range(n - n_validation, n))
            train_examples = train_examples.select(range(n - n_validation))
        else:
            validation_examples = tokenize_examples(validation, tokenizer, fmt, "validation", **cache)
        train_rows = example_rows(train_examples, tokenizer, fmt, "train")
        eval_rows = example_rows(validation_examples, tokenizer, fmt, "validation")
    shard = dict(seed=cfg.seed, process_index=accelerator.process_index, num_processes=accelerator.num_processes)
    batches_class = BlockBatches if cfg.packing else TrimmedBatches
    return batches_class(train_rows, cfg.per_device_train_batch_size, **shard), eval_rows
