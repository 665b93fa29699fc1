"""Small trained checkpoints for the explorer's tests: a character model of Tiny Shakespeare (read from
../shared/data), built as pretrain.py builds one, trained for a few dozen AdamW steps so its attention has
structure, saved with its tokenizer."""

import pathlib

import torch

from tests.paths import INPUT_TXT
from training.data import train_char_tokenizer
from training.models import build_model

# 2 layers x 32 wide x 4 heads: every layout the tests sweep trains in a couple of seconds on one thread
SHAPE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
BLOCK = 64


def corpus() -> str:
    return INPUT_TXT.read_text(encoding="utf-8")


def train_char_checkpoint(folder: pathlib.Path, steps: int = 40, seed: int = 0, **overrides) -> pathlib.Path:
    """Train a character model of shape ``SHAPE`` plus ``overrides`` (any DecoderLabConfig field) for ``steps``
    steps of 8 blocks of 64 characters, and save it and its tokenizer into ``folder``."""
    text = corpus()
    tokenizer = train_char_tokenizer([text])
    torch.manual_seed(seed)
    model = build_model({**SHAPE, **overrides}, tokenizer, BLOCK)
    data = torch.tensor(tokenizer(text[:200_000])["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(data) - BLOCK, (8,), generator=generator)
        batch = torch.stack([data[s : s + BLOCK] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
