"""The two ways the default recipe's character tokenizer can encode Tiny Shakespeare, timed on this machine.

    python -m benchmarks.investigations.char_packing                # about 15 seconds
    python -m benchmarks.investigations.char_packing --json_out benchmarks/results/char_packing.json

``training.data.pack`` encodes the text of a character tokenizer (``train_char_tokenizer``'s kind) with
``CharEncoder``, a table lookup from code points to ids, instead of the tokenizer's own call, which splits the
text into one-character words with a regex first. Both give the same ids (checked here, and in
tests/test_pretrain_data.py). This prints the time of each on the train split (nanoGPT's first 90%: about a
million characters), interleaved (A B A B ...), and their ratio. The packing runs once per dataset and
tokenizer, on a run's first start: ``datasets`` caches the blocks for the runs after it.
"""

import argparse

import datasets
import torch

from benchmarks.common import interleaved_medians, load_average, machine_line, write_results
from training.data import CharEncoder, tiny_shakespeare, train_char_tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args(argv)
    splits = datasets.load_dataset(tiny_shakespeare())
    text = splits["train"][0]["text"]
    tokenizer = train_char_tokenizer([text, splits["validation"][0]["text"]])
    encoder = CharEncoder.of(tokenizer)
    if encoder(text).tolist() != tokenizer(text, add_special_tokens=False)["input_ids"]:
        raise SystemExit("CharEncoder and the tokenizer disagree: nothing to compare")
    machine = machine_line(torch.get_num_threads())
    print(machine)
    load_before = load_average()
    times = interleaved_medians(
        {
            "tokenizer": lambda: tokenizer([text], add_special_tokens=False, return_attention_mask=False),
            "CharEncoder": lambda: encoder(text),
        },
        repeats=args.repeats,
    )
    slow, fast = times["tokenizer"]["median_s"], times["CharEncoder"]["median_s"]
    print(f"train split: {len(text):,} characters, the same ids from both")
    print(f"tokenizer call  {slow * 1e3:9.1f} ms")
    print(f"CharEncoder     {fast * 1e3:9.1f} ms   ({slow / fast:.0f}x faster)")
    if args.json_out:
        result = {"machine": machine, "load_average": [load_before, load_average()],
                  "characters": len(text), "tokenizer_ms": round(slow * 1e3, 2),
                  "char_encoder_ms": round(fast * 1e3, 2), "ratio": round(slow / fast, 1)}  # fmt: skip
        write_results(args.json_out, result, torch.get_num_threads())


if __name__ == "__main__":
    main()
