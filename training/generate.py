"""Print text sampled from a checkpoint.

    python training/generate.py out/shakespeare_char --prompt "ROMEO:" --max_new_tokens 300
    python training/generate.py out/shakespeare_chat --prompt $'USER: Speak as ROMEO\n\nASSISTANT: ' --stop $'\n\n'

The checkpoint is any folder (or Hub id) that ``AutoModelForCausalLM`` and ``AutoTokenizer`` load.
A model trained on blocks of ``max_position_embeddings`` tokens has never seen a longer context, so
longer texts are generated in a sliding window: each chunk continues the last half-window of text
and stops before the window is full, so no token is predicted from more context than training used.
``--stop TEXT`` ends a sample where TEXT first appears (transformers' ``stop_strings``); a sample also ends
when the model emits the end-of-text token. ``--stop`` is the way to end an answer for a checkpoint whose
tokenizer has no end-of-text token (character-level ones made before it had ``<|endoftext|>``).
The model runs on CUDA when there is a GPU (``CUDA_VISIBLE_DEVICES=""`` keeps it on the CPU). There,
``--compile auto`` (the default) decodes with a static KV cache and a compiled forward (``decoderlab.generation``);
on a CPU it decodes eagerly, where compiling is not measured to pay. ``--compile off`` decodes eagerly everywhere;
``--compile on`` compiles on a CPU too. Where compiling fails, a one-line warning names why and the sample is
decoded eagerly: the same tokens.
"""

from training.program import prepare_imports, run_program  # isort: skip (first)

prepare_imports(__name__)

import argparse
import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import decoderlab  # noqa: F401  (registers decoderlab with the Auto classes)
from decoderlab.cli import UsageError
from decoderlab.generation import COMPILE_CHOICES, generate, set_compiled_decoding
from training.args import add_debug_flag
from training.data import check_unknown_characters
from training.models import check_model_folder, check_positions_fit


def generate_in_window(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    window: int,
    stop_strings: list[str] | None = None,
    tokenizer=None,
    **generate_kwargs,
) -> torch.Tensor:
    """``input_ids`` (1, T) followed by up to ``max_new_tokens`` sampled tokens, never attending over more
    than ``window`` tokens: after the first chunk, each chunk starts from the last ``window // 2`` tokens.
    With ``stop_strings`` (and the ``tokenizer``), the text ends once one of them has been generated."""
    if stop_strings:
        generate_kwargs.update(stop_strings=stop_strings, tokenizer=tokenizer)
    ids = input_ids
    remaining = max_new_tokens
    while remaining > 0:
        context = ids[:, -(window // 2) :] if ids.shape[1] >= window else ids
        n = min(remaining, window - context.shape[1])
        out = generate(model, context, max_new_tokens=n, **generate_kwargs)  # eager again if compiling fails
        new = out[:, context.shape[1] :]
        ids = torch.cat([ids, new], dim=1)
        remaining -= n
        eos = model.generation_config.eos_token_id
        if new.shape[1] < n or (eos is not None and new.shape[1] and int(new[0, -1]) == eos):
            break  # the model ended the text
        if stop_strings and any(s in tokenizer.decode(ids[0, input_ids.shape[1] :]) for s in stop_strings):
            break  # a stop string that spans two chunks
    return ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print a sample from a checkpoint.")
    parser.add_argument("checkpoint", help="folder or Hub id of a saved model and tokenizer")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=300)
    parser.add_argument(
        "--temperature", type=float, default=None, help="default: the checkpoint's generation config; 0 means greedy"
    )
    parser.add_argument("--top_k", type=int, default=None, help="default: the checkpoint's generation config")
    parser.add_argument("--greedy", action="store_true", help="most likely token each step instead of sampling")
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the sampling (default: a fresh one each run, printed to stderr)"
    )
    parser.add_argument("--window", type=int, default=None, help="context window (default: max_position_embeddings)")
    parser.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="end a sample where TEXT appears (repeatable)"
    )
    parser.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                        help="static KV cache + compiled decoding step (auto: on for CUDA, off for CPU)")  # fmt: skip
    parser.add_argument("--compile_backend", default="inductor",
                        help="torch.compile backend of --compile (eager: capture the graph only, for checks)")  # fmt: skip
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "num_samples", "window", "top_k"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    if args.temperature is not None and args.temperature < 0:
        parser.error(f"--temperature must be 0 (greedy) or more, got {args.temperature}.")

    check_model_folder(args.checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    set_compiled_decoding(model, args.compile, args.compile_backend)
    try:
        input_ids = tokenizer(args.prompt, add_special_tokens=False, return_tensors="pt").input_ids
    except Exception as err:  # e.g. a character the character-level vocabulary does not have
        raise ValueError(
            f"The prompt {args.prompt!r} cannot be tokenized by {args.checkpoint}'s tokenizer: {err}"
        ) from err
    if input_ids.shape[1] == 0:
        raise UsageError("The prompt is empty after tokenization; pass some text with --prompt.")
    check_unknown_characters(tokenizer, [args.prompt], "the prompt", allow=None)
    input_ids = input_ids.to(model.device)
    window = args.window or model.config.max_position_embeddings
    if args.window is not None:
        check_positions_fit(model.config, args.window, args.checkpoint, flag="--window")
    greedy = args.greedy or args.temperature == 0  # the limit of sampling as the temperature goes to 0
    options = {"do_sample": not greedy}
    if not greedy:
        options.update({k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k)) if v is not None})
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
        print(f"seed {seed} (--seed {seed} repeats these samples)", file=sys.stderr)
        torch.manual_seed(seed)
    with torch.no_grad():
        for i in range(args.num_samples):
            ids = generate_in_window(model, input_ids, args.max_new_tokens, window, args.stop, tokenizer, **options)
            if args.num_samples > 1:
                print(f"--- sample {i + 1}")
            print(tokenizer.decode(ids[0], skip_special_tokens=True))


if __name__ == "__main__":
    run_program(main)
