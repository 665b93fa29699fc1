"""Export a decoderlab checkpoint to ONNX (for ONNX Runtime) or to an ExecuTorch program (for ExecuTorch).

    python -m decoderlab.convert --to onnx SRC OUT.onnx         # input_ids (B, T) -> logits (B, T, V), no cache
    python -m decoderlab.convert --to executorch SRC OUT.pte    # XNNPACK, with a static KV cache, batch 1

or from Python, ``export_onnx(src, out)`` and ``export_executorch(src, out, max_cache_len=None)``;
``export_static_cache(model)`` gives the ``torch.export`` program that the ExecuTorch one is lowered from.

How: SRC (a folder or a Hub repo id) is loaded in float32 with SDPA attention and traced by ``torch.export``.
ONNX: ``torch.onnx.export(..., dynamo=True)`` of the causal LM without a cache, batch and sequence length dynamic
(weights past 2GB go to ``OUT.data`` beside it). ExecuTorch: transformers' ``TorchExportableModuleForDecoderOnlyLM``
wraps the model with a ``StaticCache`` of ``max_cache_len`` positions (default ``max_position_embeddings``), so the
program is ``forward(input_ids (1, T), cache_position (T,)) -> logits (1, T, V)``, a prefill of T tokens or one
decoding step, the keys and values kept inside the program; it is lowered to the XNNPACK backend. The program also
answers the metadata methods ExecuTorch's LLM runner reads (``get_max_seq_len``, ``get_vocab_size``, ...).

Every check (SRC is a decoderlab causal LM, the configuration can be traced, OUT's folder exists and OUT does not)
runs before anything is traced; the file is written into a temporary folder beside OUT and renamed into place
only when complete, so a failure leaves nothing behind.

The packages: ``pip install "decoderlab[export]"`` (onnx, onnxruntime, onnxscript, executorch).
"""

import copy
import importlib.util
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..configuration_decoderlab import DecoderLabConfig
from ..modeling_decoderlab import DecoderLabForCausalLM
from .checkpoint import config_json, resolve_source
from .families import TO_LLAMA, read_source_config

logger = logging.getLogger(__name__)

# rope_type -> why torch.export cannot trace it. (longrope's switch between its two tables is a torch.where in
# transformers >= 5.24, which traces; the test suite checks it.)
UNTRACEABLE_ROPE = {
    "dynamic": (
        "it recomputes the rotary frequencies whenever a sequence grows past the longest one seen so far, a branch on "
        "the values of position_ids that torch.export cannot trace"
    ),
}
# example length the graphs are traced at; a length of 1 would be specialised by torch.export
TRACE_LENGTH = 8


# ----------------------------------------------------------------------------------------------
# Checks and loading, shared by both formats


def check_output(out: str | os.PathLike, suffix: str, flag: str) -> Path:
    """OUT as a Path, after checking that it ends in ``suffix``, does not exist and its folder does."""
    out = Path(out)
    if out.suffix != suffix:
        raise ValueError(f"OUT {str(out)!r} should end in {suffix} for {flag}; name the file, e.g. model{suffix}.")
    if out.exists():
        raise ValueError(f"OUT {str(out)!r} already exists; choose a new name or remove it first.")
    if not out.parent.is_dir():
        raise ValueError(
            f"The folder of OUT, {str(out.parent)!r}, does not exist; create it first (mkdir -p {out.parent}) "
            "or choose another path."
        )
    return out


def check_exportable(config: DecoderLabConfig, flag: str) -> None:
    """Refuse, naming the field and the reason, a configuration that torch.export cannot trace."""
    if config.position_embedding_type != "rope":
        return
    rope_type = config.rope_parameters["rope_type"]
    if rope_type in UNTRACEABLE_ROPE:
        raise ValueError(
            f"{flag} cannot export rope_parameters['rope_type']={rope_type!r}: {UNTRACEABLE_ROPE[rope_type]}. "
            "Export a checkpoint with another rope_type (e.g. 'linear' or 'yarn' with the same factor), or use it "
            "in transformers."
        )


def load_for_export(src: str | os.PathLike, flag: str) -> DecoderLabForCausalLM:
    """The causal LM in SRC in float32 with SDPA attention, in eval mode, after checking that SRC is a complete
    decoderlab causal-LM checkpoint whose configuration can be exported."""
    folder = resolve_source(src)
    config = read_source_config(folder, TO_LLAMA, flag)  # a decoderlab config.json, or an error naming what it is
    architectures = config_json(folder).get("architectures") or []
    if architectures and DecoderLabForCausalLM.__name__ not in architectures:
        raise ValueError(
            f"{folder} holds a {', '.join(architectures)} checkpoint; {flag} exports a language model "
            f"({DecoderLabForCausalLM.__name__}), whose lm_head this checkpoint lacks."
        )
    check_exportable(config, flag)
    model, info = DecoderLabForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
    )
    if info["missing_keys"]:
        raise ValueError(
            f"{folder} lacks weights a {DecoderLabForCausalLM.__name__} needs: {', '.join(sorted(info['missing_keys']))}."
        )
    return model.eval()


def write_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    """``write(path)`` writes the file (and any files beside it, such as ONNX external data) at ``path``, a name
    in a new temporary folder beside OUT; they are moved into place only once it returns, OUT last. The folder is
    removed whatever happens."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        write(staging / out.name)
        for written in sorted(staging.iterdir(), key=lambda path: path.name == out.name):  # OUT last
            os.replace(written, out.parent / written.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def require(module: str, flag: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f'{flag} needs the package {module!r}: pip install "decoderlab[export]".')


# ----------------------------------------------------------------------------------------------
# ONNX


class LogitsOnly(nn.Module):
    """input_ids (B, T) -> logits (B, T, V): the causal LM without a cache, a plain tensor out for graph export."""

    def __init__(self, model: DecoderLabForCausalLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def longest_input(config: DecoderLabConfig) -> int | None:
    """The longest sequence the model can take: the table's length for absolute positions, else no limit."""
    return config.max_position_embeddings if config.position_embedding_type in ("learned", "sinusoidal") else None


def onnx_program(model: DecoderLabForCausalLM) -> "torch.onnx.ONNXProgram":
    """``model`` (input_ids -> logits, no cache) as an ONNX program, batch and sequence length dynamic."""
    longest = longest_input(model.config)
    example = torch.zeros(2, min(TRACE_LENGTH, longest or TRACE_LENGTH), dtype=torch.long)
    batch, length = torch.export.Dim("batch"), torch.export.Dim("sequence_length", max=longest)
    with torch.no_grad(), warnings.catch_warnings():
        # torch's exporter copies its own pytree specs through an API torch deprecated: nothing a user can change
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        return torch.onnx.export(
            LogitsOnly(model).eval(),
            (example,),
            dynamo=True,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_shapes={"input_ids": {0: batch, 1: length}},
            verbose=False,  # it prints its progress otherwise
        )


def export_onnx(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """The decoderlab causal LM in SRC (folder or Hub repo id) -> an ONNX model at OUT (``.onnx``, new) that
    ONNX Runtime runs: input ``input_ids`` (int64, batch x length), output ``logits`` (float32). Returns OUT."""
    flag = "--to onnx"
    out = check_output(out, ".onnx", flag)
    for module in ("onnx", "onnxscript"):
        require(module, flag)
    model = load_for_export(src, flag)
    program = onnx_program(model)
    write_atomically(out, lambda path: program.save(path))
    logger.info(f"Wrote {out} ({out.stat().st_size / 1e6:.1f} MB).")
    return out


# ----------------------------------------------------------------------------------------------
# torch.export with a static cache, and ExecuTorch


def default_max_cache_len(config: DecoderLabConfig) -> int:
    return config.max_position_embeddings


def export_static_cache(model: DecoderLabForCausalLM, max_cache_len: int | None = None) -> torch.export.ExportedProgram:
    """``model`` with a ``StaticCache`` of ``max_cache_len`` positions (batch 1), traced by ``torch.export`` through
    transformers' ``TorchExportableModuleForDecoderOnlyLM``: ``forward(input_ids=(1, T), cache_position=(T,))``
    returns the logits (1, T, V) of T tokens placed at ``cache_position``, for 1 <= T < max_cache_len, and keeps
    their keys and values in the program's buffers for the next call.

    Tracing leaves some modules of ``model`` holding traced tensors (transformers' longrope caches one); use a fresh
    copy of the model afterwards."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    config = model.config
    flag = "torch.export"
    check_exportable(config, flag)
    max_cache_len = max_cache_len or default_max_cache_len(config)
    longest = longest_input(config)
    if max_cache_len < 2 or (longest is not None and max_cache_len > longest):
        allowed = f"2 to max_position_embeddings={longest}" if longest else "2 or more"
        raise ValueError(
            f"max_cache_len={max_cache_len} cannot be used with position_embedding_type="
            f"{config.position_embedding_type!r}: choose {allowed}."
        )
    # the wrapper reads the cache type from the generation config: set it on a copy, leave the caller's alone
    generation_config = model.generation_config
    model.generation_config = copy.deepcopy(generation_config)
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    try:
        exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len)
    finally:
        model.generation_config = generation_config
    length = min(TRACE_LENGTH, max_cache_len - 1)
    sequence_length = torch.export.Dim("sequence_length", min=1, max=max_cache_len - 1)
    with torch.no_grad():
        return exportable.export(
            input_ids=torch.zeros(1, length, dtype=torch.long),
            cache_position=torch.arange(length),
            dynamic_shapes={"input_ids": {1: sequence_length}, "cache_position": {0: sequence_length}},
        )


def runner_metadata(config: DecoderLabConfig, max_cache_len: int) -> dict:
    """The constant methods ExecuTorch's LLM runner reads from a program."""
    eos = config.eos_token_id
    metadata = {
        "get_max_seq_len": max_cache_len,
        "get_max_context_len": max_cache_len,
        "get_vocab_size": config.vocab_size,
        "use_kv_cache": True,
        "enable_dynamic_shape": True,
    }
    if config.bos_token_id is not None:
        metadata["get_bos_id"] = config.bos_token_id
    if eos is not None:
        metadata["get_eos_ids"] = eos if isinstance(eos, list) else [eos]
    return metadata


def executorch_program(program: torch.export.ExportedProgram, metadata: dict):
    """``program`` lowered to ExecuTorch with the XNNPACK backend (``ExecutorchProgramManager``)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()], constant_methods=metadata)
    return edge.to_executorch()


def export_executorch(src: str | os.PathLike, out: str | os.PathLike, max_cache_len: int | None = None) -> Path:
    """The decoderlab causal LM in SRC (folder or Hub repo id) -> an ExecuTorch program at OUT (``.pte``, new),
    XNNPACK backend, static KV cache of ``max_cache_len`` positions (default max_position_embeddings); see
    ``export_static_cache`` for its inputs and outputs. Returns OUT."""
    flag = "--to executorch"
    out = check_output(out, ".pte", flag)
    require("executorch", flag)
    model = load_for_export(src, flag)
    max_cache_len = max_cache_len or default_max_cache_len(model.config)
    program = executorch_program(
        export_static_cache(model, max_cache_len), runner_metadata(model.config, max_cache_len)
    )
    write_atomically(out, lambda path: path.write_bytes(program.buffer))
    logger.info(f"Wrote {out} ({out.stat().st_size / 1e6:.1f} MB, static cache of {max_cache_len} positions).")
    return out


__all__ = ["export_onnx", "export_executorch", "export_static_cache"]
