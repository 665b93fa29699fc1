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

import argparse
import json
import logging
import pathlib
import typing

import torch
import yaml
from transformers import AutoModelForCausalLM

import decoderlab  # noqa: F401  (registers decoderlab with the Auto classes)
from decoderlab.model_card import add_eval_results
from training.data import load_files, load_named_dataset, too_short_error
from training.finetune_args import DATA_FORMATS, OVERLONG_PROMPT, FinetuneConfig
from training.loop import evaluate, make_accelerator, setup_script_logging
from training.models import load_base_tokenizer
from training.sft_data import rows_for_split, set_chat_template

logger = logging.getLogger("training.evaluate")

RESULTS_NAME = "eval_results.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Loss and perplexity of a checkpoint on a dataset split.")
    parser.add_argument("checkpoint", help="folder or Hub id of a saved model (or LoRA adapter) with its tokenizer")
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", help="Hub dataset id, or a local folder laid out like a Hub dataset")
    data.add_argument("--dataset_config_name", help="dataset configuration (subset)")
    data.add_argument("--data_file", help="a local .txt/.json/.jsonl/.parquet/.csv file instead of --dataset_name")
    data.add_argument("--split", default="validation", help="the split to score (default: validation)")
    data.add_argument("--data_format", default="text", choices=typing.get_args(DATA_FORMATS))
    data.add_argument("--text_column_name", default="text")
    data.add_argument("--prompt_column_name", default="prompt")
    data.add_argument("--completion_column_name", default="completion")
    data.add_argument("--messages_column_name", default="messages")
    data.add_argument("--chat_template", help="chat: Jinja template file (default: the tokenizer's own)")
    data.add_argument(
        "--block_size", type=int, help="tokens per row (default: the checkpoint's training block_size if recorded)"
    )
    data.add_argument("--no_packing", action="store_true", help="one example per padded row instead of packing")
    data.add_argument("--overlong_prompt", default="truncate", choices=typing.get_args(OVERLONG_PROMPT))
    data.add_argument("--max_eval_samples", type=int, help="score only the first N rows")
    parser.add_argument("--batch_size", type=int, default=16, help="rows per forward pass")
    parser.add_argument("--revision", help="branch, tag or commit of a Hub checkpoint")
    parser.add_argument("--trust_remote_code", action="store_true", help="run the checkpoint's own model code")
    parser.add_argument("--output_file", help=f"where the JSON goes (default: CHECKPOINT/{RESULTS_NAME}, or ./)")
    parser.add_argument("--no_model_card", action="store_true", help="do not write the results into the model card")
    return parser.parse_args(argv)


def default_block_size(checkpoint: str, model) -> int:
    """The block size the checkpoint was trained with (its training_config.yaml), else its position count."""
    recorded = pathlib.Path(checkpoint) / "training_config.yaml"
    if recorded.is_file():
        block_size = (yaml.safe_load(recorded.read_text()) or {}).get("block_size")
        if isinstance(block_size, int):
            return block_size
    return model.config.max_position_embeddings


def load_split(cfg: FinetuneConfig, split: str):
    """The split to score: a local file is a split of its own; a dataset must have ``split``."""
    if cfg.train_file is not None:
        return load_files(cfg)["train"]
    splits = load_named_dataset(cfg)
    if split not in splits:
        raise ValueError(f"{cfg.dataset_name} has no split {split!r}; its splits are {list(splits)}. Pass --split.")
    return splits[split]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if (args.dataset_name is None) == (args.data_file is None):
        raise SystemExit("Pass exactly one of --dataset_name (a Hub id or dataset folder) and --data_file.")
    local = pathlib.Path(args.checkpoint).is_dir()
    tokenizer = load_base_tokenizer(args.checkpoint, args.revision, args.trust_remote_code)
    if args.data_format == "chat":
        set_chat_template(tokenizer, args.chat_template)
    model = AutoModelForCausalLM.from_pretrained(
        args.checkpoint, revision=args.revision, trust_remote_code=args.trust_remote_code, dtype=torch.float32
    )
    cfg = FinetuneConfig(
        model_name_or_path=args.checkpoint,
        dataset_name=args.dataset_name,
        dataset_config_name=args.dataset_config_name,
        train_file=args.data_file,
        data_format=args.data_format,
        text_column_name=args.text_column_name,
        prompt_column_name=args.prompt_column_name,
        completion_column_name=args.completion_column_name,
        messages_column_name=args.messages_column_name,
        block_size=args.block_size or default_block_size(args.checkpoint, model),
        packing=not args.no_packing,
        overlong_prompt=args.overlong_prompt,
        per_device_eval_batch_size=args.batch_size,
        output_dir=args.checkpoint if local else ".",
    )
    accelerator = make_accelerator(cfg)
    setup_script_logging(accelerator)

    split_name = pathlib.Path(args.data_file).name if args.data_file else args.split  # a file is a split of its own
    split = load_split(cfg, args.split)
    rows = rows_for_split(split, tokenizer, cfg, split_name)
    rows = rows if isinstance(rows, dict) else {"input_ids": rows, "labels": rows}
    rows = {name: x[: args.max_eval_samples] for name, x in rows.items()}
    if len(rows["input_ids"]) == 0:
        raise too_short_error(split, tokenizer, cfg, split_name)
    metrics = evaluate(model.to(accelerator.device), rows, args.batch_size, accelerator)

    dataset = args.data_file or args.dataset_name
    results = {
        "checkpoint": args.checkpoint,
        "dataset": dataset,
        "dataset_config": args.dataset_config_name,
        "split": None if args.data_file else args.split,
        "data_format": args.data_format,
        "block_size": cfg.block_size,
        "packing": cfg.packing,
        "rows": len(rows["input_ids"]),
        "scored_tokens": int((rows["labels"][:, 1:] != -100).sum()),  # position t is scored on labels[t + 1]
        **metrics,
    }
    if accelerator.is_main_process:
        output = pathlib.Path(args.output_file or (pathlib.Path(args.checkpoint if local else ".") / RESULTS_NAME))
        output.write_text(json.dumps(results, indent=2) + "\n")
        has_card = (pathlib.Path(args.checkpoint) / "README.md").is_file()
        if local and not args.no_model_card and (has_card or model.config.model_type == "decoderlab"):
            context = {"dataset": dataset, "split": results["split"], "dataset_config": args.dataset_config_name}
            card_results = {**metrics, **{k: v for k, v in context.items() if v is not None}}
            add_eval_results(args.checkpoint, card_results)
        print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
