"""Small fine-tuning datasets made from Tiny Shakespeare, for the offline fine-tuning demo and the tests.

    python training/shakespeare_sft_data.py                                   # from the local copy
    python training/shakespeare_sft_data.py --dataset_name karpathy/tiny_shakespeare --output_dir out/data/speeches

Every speech in the play becomes one example: who speaks, and the first line they say. Written as
JSON lines in ``--output_dir``, for the train and the validation split of the dataset:

- ``prompt_completion_{train,validation}.jsonl``: ``{"prompt": "ROMEO:\\n", "completion": "<first line>"}``
- ``chat_{train,validation}.jsonl``: ``{"messages": [{"role": "user", "content": "Speak as ROMEO"},
  {"role": "assistant", "content": "<first line>"}]}``

Every character comes from the play, so a character-level model pretrained on it can encode them all
(with decoderlab's default chat template, whose role names are plain capitals).
"""

import json
import pathlib
from dataclasses import dataclass

from training.args import Config, option, parse_config
from training.data import load_named_dataset, tiny_shakespeare

DATA_FORMATS = ("prompt_completion", "chat")


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, first line of the speech) for every speech: a paragraph that opens with ``NAME:`` on its own line."""
    pairs = []
    for paragraph in text.split("\n\n"):
        speaker, colon, speech = paragraph.partition(":\n")
        if colon and speech.strip() and "\n" not in speaker:
            pairs.append((speaker, speech.split("\n")[0]))
    return pairs


def examples(pairs: list[tuple[str, str]], data_format: str) -> list[dict]:
    if data_format == "prompt_completion":
        return [{"prompt": f"{speaker}:\n", "completion": line} for speaker, line in pairs]
    return [
        {"messages": [{"role": "user", "content": f"Speak as {speaker}"}, {"role": "assistant", "content": line}]}
        for speaker, line in pairs
    ]


def write_jsonl(rows: list[dict], path: pathlib.Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def write_speech_data(texts: dict[str, str], output_dir) -> pathlib.Path:
    """``{format}_{split}.jsonl`` in ``output_dir`` for each ``split: text`` of ``texts`` and each format."""
    output_dir = pathlib.Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for split, text in texts.items():
        pairs = speeches(text)
        for data_format in DATA_FORMATS:
            write_jsonl(examples(pairs, data_format), output_dir / f"{data_format}_{split}.jsonl")
    return output_dir


@dataclass
class SpeechDataConfig(Config):
    """Write speaker -> first-line fine-tuning data from Tiny Shakespeare."""

    dataset_name: str | None = option(
        None, "Hub id or local folder (default: the copy beside the checkout, else the Hub's)"
    )
    output_dir: str = option("out/data/shakespeare_speeches", "where the .jsonl files go")


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(SpeechDataConfig, argv)
    splits = load_named_dataset(cfg.dataset_name or tiny_shakespeare())  # its clear error when not found
    texts = {split: "".join(splits[split]["text"]) for split in ("train", "validation")}
    folder = write_speech_data(texts, cfg.output_dir)
    for split, text in texts.items():
        print(f"{split}: {len(speeches(text))} speeches -> {folder}/{{{','.join(DATA_FORMATS)}}}_{split}.jsonl")


if __name__ == "__main__":
    from training.program import run_program

    run_program(main)
