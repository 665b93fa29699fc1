"""Convert a checkpoint to or from decoderlab: the one command over ``decoderlab.export``.

    python -m decoderlab.convert --from FAMILY SRC DST               # llama, qwen3, mistral, smollm3, gpt2, neox
    python -m decoderlab.convert --to llama SRC DST                  # decoderlab -> plain LlamaForCausalLM
    python -m decoderlab.convert --to qwen3 SRC DST                  # with QK-norm -> plain Qwen3ForCausalLM
    python -m decoderlab.convert --to gguf SRC OUT.gguf [--outtype f32|f16|bf16|q8_0]   # -> llama.cpp, Ollama
    python -m decoderlab.convert --to onnx SRC OUT.onnx              # -> ONNX Runtime (no cache, any batch and length)
    python -m decoderlab.convert --to executorch SRC OUT.pte         # -> ExecuTorch (XNNPACK, static KV cache)

or from Python, ``convert_from("gpt2", src, dst)``, ``convert_to_llama(src, dst)``, ``convert_to_qwen3(src, dst)``,
``convert_to_gguf(src, out, outtype)``, ``export_onnx(src, out)`` and ``export_executorch(src, out)``, importable
from here or from ``decoderlab.export``, whose modules say how each conversion works (``families``, ``gguf_file``,
``onnx_executorch``). SRC is a local folder or a Hub repo id. Every one checks SRC, DST and the configuration before
it writes anything.
"""

import argparse
import logging

from transformers.utils.hub import convert_file_size_to_int

from .cli import UsageError, run_command
from .export import (
    OUTTYPES,
    convert_from,
    convert_to_gguf,
    convert_to_llama,
    convert_to_qwen3,
    export_executorch,
    export_onnx,
)
from .export.checkpoint import DEFAULT_MAX_SHARD_SIZE
from .export.families import (
    FROM,
    REFUSED_SOURCES,
    TO_LLAMA,
    TO_QWEN3,
    Conversion,
    convert,
    decoderlab_config_from_gpt2,
    decoderlab_config_from_llama,
    decoderlab_config_from_mistral,
    decoderlab_config_from_neox,
    decoderlab_config_from_qwen3,
    decoderlab_config_from_smollm3,
    llama_config_from_decoderlab,
    qwen3_config_from_decoderlab,
)

__all__ = [
    "convert_from",
    "convert_to_llama",
    "convert_to_qwen3",
    "convert_to_gguf",
    "export_onnx",
    "export_executorch",
    "convert",
    "Conversion",
    "FROM",
    "TO_LLAMA",
    "TO_QWEN3",
    "decoderlab_config_from_llama",
    "decoderlab_config_from_qwen3",
    "decoderlab_config_from_mistral",
    "decoderlab_config_from_smollm3",
    "decoderlab_config_from_gpt2",
    "decoderlab_config_from_neox",
    "llama_config_from_decoderlab",
    "qwen3_config_from_decoderlab",
    "main",
]

# --to TARGET -> the function that writes it, called with (SRC, DST) and the options of that target
TARGETS = {
    "llama": lambda args: convert_to_llama(args.src, args.dst, args.max_shard_size),
    "qwen3": lambda args: convert_to_qwen3(args.src, args.dst, args.max_shard_size),
    "gguf": lambda args: convert_to_gguf(args.src, args.dst, args.outtype or "f32"),
    "onnx": lambda args: export_onnx(args.src, args.dst),
    "executorch": lambda args: export_executorch(args.src, args.dst),
}


# Warnings about optional packages the conversion does not use (torch's ONNX exporter lists torchvision's ops it
# skips registering)
QUIET_LOGGERS = ("torch.onnx._internal.exporter._registration",)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m decoderlab.convert",
        description=(
            "Convert Llama / Qwen3 / Mistral / SmolLM3 / GPT-2 / GPT-NeoX checkpoints to decoderlab, or decoderlab to "
            "a Llama or Qwen3 checkpoint, "
            "a GGUF file (llama.cpp, Ollama), an ONNX model (ONNX Runtime) or an ExecuTorch program."
        ),
    )
    direction = parser.add_mutually_exclusive_group(required=True)
    # gpt_oss is a choice so that it is refused with the reason (REFUSED_SOURCES), not as an unknown name
    direction.add_argument(
        "--from", dest="family", choices=[*FROM, *REFUSED_SOURCES], help="convert this family to decoderlab"
    )
    direction.add_argument(
        "--to", dest="target", choices=list(TARGETS), help="convert decoderlab to this family or format"
    )
    parser.add_argument("src", help="checkpoint folder, or a Hub repo id (downloaded)")
    parser.add_argument("dst", help="new folder for the converted checkpoint (gguf, onnx, executorch: a new file)")
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="--from, --to llama/qwen3: largest output file, e.g. 2GB, 500MB (default %(default)s)",
    )
    parser.add_argument(
        "--outtype", choices=OUTTYPES, help="--to gguf: how matrices are stored (default f32; vectors stay f32)"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    cli = parser()
    args = cli.parse_args(argv)
    try:
        convert_file_size_to_int(args.max_shard_size)
    except ValueError as err:
        raise UsageError(
            f"--max-shard-size {args.max_shard_size!r} is not a size; give a number and a unit, e.g. 2GB or 500MB."
        ) from err
    if args.outtype and args.target != "gguf":
        raise UsageError(f"--outtype {args.outtype} applies to --to gguf only; leave it out for --to {args.target}.")
    # Each conversion's summary line (decoderlab's loggers at INFO), and the warnings of every other library; not
    # their INFO progress (onnxscript's optimizer logs a line per replaced initializer, over a hundred for ONNX)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("decoderlab").setLevel(logging.INFO)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # a bad SRC, DST or configuration: ValueError / ImportError, one "error:" line from run_command
    if args.family:
        convert_from(args.family, args.src, args.dst, args.max_shard_size)
    else:
        TARGETS[args.target](args)


if __name__ == "__main__":
    run_command(main)
