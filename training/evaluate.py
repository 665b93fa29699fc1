"""Loss and perplexity of a checkpoint on a dataset split, as JSON, recorded in the checkpoint's model card.

    python training/evaluate.py out/shakespeare_char --dataset_name karpathy/tiny_shakespeare --split validation
    python training/evaluate.py out/shakespeare_char --dataset_name ../shared/data/tiny_shakespeare   # offline
    python training/evaluate.py out/chat --data_file data/chat_test.jsonl --data_format chat --block_size 256

The data goes through fine-tuning's own pipeline (``training.sft_data``): ``text`` is packed into blocks
of ``--block_size`` tokens and every next token is scored; ``prompt_completion`` and ``chat`` score the
completion / assistant tokens only, exactly the fine-tuning validation loss. The loss is the mean
cross-entropy (nats) over every scored token of the split, the perplexity its exponential.

The JSON goes to stdout and to ``--output_file`` (default: ``eval_results.json`` in a local checkpoint
folder); for a local folder the numbers are also written into its model card (``model-index``).
For benchmark tasks, the same checkpoint runs under EleutherAI's lm-evaluation-harness (see the
README and ``training/lm_eval_tasks/``).
"""

from training.program import prepare_imports, run_program  # isort: skip (first)

prepare_imports(__name__)

import json
import logging
import pathlib
from dataclasses import dataclass

import torch
import yaml
from transformers import AutoModelForCausalLM

import decoderlab  # noqa: F401  (registers decoderlab with the Auto classes)
from decoderlab.model_card import add_eval_results
from training.args import Config, check_encoding_name, option, parse_config
from training.data import (
    UNKNOWN_CHARACTERS_SAMPLE,
    check_unknown_characters,
    count_targets,
    iter_texts,
    load_files,
    load_named_dataset,
    too_short_error,
)
from training.finetune_args import DATA_FORMATS, OVERLONG_PROMPT
from training.loop import evaluate, make_accelerator, setup_script_logging
from training.models import check_positions_fit, load_base_tokenizer
from training.sft_data import ExampleFormat, example_texts, rows_for_split, set_chat_template

logger = logging.getLogger("training.evaluate")

RESULTS_NAME = "eval_results.json"


@dataclass
class EvalConfig(Config):
    """Loss and perplexity of a checkpoint on a dataset split."""

    checkpoint: str = option(
        help="folder or Hub id of a saved model (or LoRA adapter) with its tokenizer", positional=True
    )
    # --- data
    dataset_name: str | None = option(None, "Hub dataset id, or a local folder laid out like a Hub dataset")
    dataset_config_name: str | None = option(None, "dataset configuration (subset)")
    data_file: str | None = option(None, "a local .txt/.json/.jsonl/.parquet/.csv file instead of --dataset_name")
    encoding: str = option("utf-8", "text encoding of --data_file (.txt/.json/.jsonl/.csv): utf-8, latin-1, ...")
    split: str = option("validation", "the split of --dataset_name to score")
    data_format: DATA_FORMATS = option("text", "text (every token scored), prompt_completion or chat")
    text_column_name: str = option("text", "text: the column holding the texts")
    prompt_column_name: str = option("prompt", "prompt_completion: the column holding the prompts")
    completion_column_name: str = option("completion", "prompt_completion: the column holding the completions")
    messages_column_name: str = option("messages", "chat: the column holding lists of {role, content} messages")
    chat_template: str | None = option(None, "chat: Jinja template file (default: the tokenizer's own)")
    block_size: int | None = option(None, "tokens per row (default: the checkpoint's training block_size if recorded)")
    packing: bool = option(True, "pack examples into rows (false: one example per padded row)")
    overlong_prompt: OVERLONG_PROMPT = option("truncate", "a prompt that fills the whole block: truncate or refuse")
    max_eval_samples: int | None = option(None, "score only the first N rows")
    # --- the model and the output
    batch_size: int = option(16, "rows per forward pass")
    revision: str | None = option(None, "branch, tag or commit of a Hub checkpoint")
    trust_remote_code: bool = option(False, "run the checkpoint's own model code")
    output_file: str | None = option(None, f"where the JSON goes (default: CHECKPOINT/{RESULTS_NAME}, or ./)")
    model_card: bool = option(True, "write the results into a local checkpoint's model card")

    def check(self) -> None:
        if (self.dataset_name is None) == (self.data_file is None):
            raise ValueError("Pass exactly one of --dataset_name (a Hub id or dataset folder) and --data_file.")
        check_encoding_name(self.encoding)
        for name in ("block_size", "max_eval_samples", "batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}.")


def default_block_size(checkpoint: str, model) -> int:
    """The block size the checkpoint was trained with (its training_config.yaml), else its position count."""
    recorded = pathlib.Path(checkpoint) / "training_config.yaml"
    if recorded.is_file():
        block_size = (yaml.safe_load(recorded.read_text()) or {}).get("block_size")
        if isinstance(block_size, int):
            return block_size
    return model.config.max_position_embeddings


def load_split(cfg: EvalConfig):
    """The split to score: a local file is a split of its own; a dataset must have ``cfg.split``."""
    if cfg.data_file is not None:
        return load_files(cfg.data_file, encoding=cfg.encoding)["train"]
    splits = load_named_dataset(cfg.dataset_name, cfg.dataset_config_name)
    if cfg.split not in splits:
        raise ValueError(f"{cfg.dataset_name} has no split {cfg.split!r}; its splits are {list(splits)}. Pass --split.")
    return splits[cfg.split]


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(EvalConfig, argv)
    accelerator = make_accelerator()
    setup_script_logging(accelerator)
    local = pathlib.Path(cfg.checkpoint).is_dir()
    tokenizer = load_base_tokenizer(cfg.checkpoint, cfg.revision, cfg.trust_remote_code)
    if cfg.data_format == "chat":
        set_chat_template(tokenizer, cfg.chat_template)
    model = AutoModelForCausalLM.from_pretrained(
        cfg.checkpoint, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code, dtype=torch.float32
    )
    if cfg.block_size is None:
        cfg.block_size = default_block_size(cfg.checkpoint, model)
    check_positions_fit(model.config, cfg.block_size, cfg.checkpoint)

    split_name = pathlib.Path(cfg.data_file).name if cfg.data_file else cfg.split  # a file is a split of its own
    split = load_split(cfg)
    fmt = ExampleFormat.of(cfg)
    texts = iter_texts(split, cfg.text_column_name, UNKNOWN_CHARACTERS_SAMPLE) if cfg.data_format == "text" else None
    check_unknown_characters(tokenizer, texts or example_texts(split, fmt), f"the {split_name} split", allow=None)
    lines = cfg.data_file is not None and cfg.data_file.endswith(".txt")  # a text file's rows are its lines
    rows = rows_for_split(split, tokenizer, fmt, split_name, documents=not lines)
    rows = rows if isinstance(rows, dict) else {"input_ids": rows, "labels": rows}
    rows = {name: x[: cfg.max_eval_samples] for name, x in rows.items()}
    if len(rows["input_ids"]) == 0:
        raise too_short_error(split, tokenizer, cfg.text_column_name, cfg.block_size, split_name)
    metrics = evaluate(model.to(accelerator.device), rows, cfg.batch_size, accelerator)

    dataset = cfg.data_file or cfg.dataset_name
    results = {
        "checkpoint": cfg.checkpoint,
        "dataset": dataset,
        "dataset_config": cfg.dataset_config_name,
        "split": None if cfg.data_file else cfg.split,
        "data_format": cfg.data_format,
        "block_size": cfg.block_size,
        "packing": cfg.packing,
        "rows": len(rows["input_ids"]),
        "scored_tokens": int(count_targets(rows["labels"])),
        **metrics,
    }
    if accelerator.is_main_process:
        output = pathlib.Path(cfg.output_file or (pathlib.Path(cfg.checkpoint if local else ".") / RESULTS_NAME))
        output.write_text(json.dumps(results, indent=2) + "\n")
        has_card = (pathlib.Path(cfg.checkpoint) / "README.md").is_file()
        if local and cfg.model_card and (has_card or model.config.model_type == "decoderlab"):
            context = {"dataset": dataset, "split": results["split"], "dataset_config": cfg.dataset_config_name}
            card_results = {**metrics, **{k: v for k, v in context.items() if v is not None}}
            add_eval_results(cfg.checkpoint, card_results)
        print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    run_program(main)
