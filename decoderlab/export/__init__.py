"""Exporters: decoderlab checkpoints to other formats and families, and other families' checkpoints to decoderlab.

None of these files travels inside a checkpoint (the four ``*_decoderlab.py`` files beside this package do).
Imports run one way, from the formats down to the shared checkpoint reader:

    checkpoint        SRC (folder or Hub repo id), its config.json, its safetensors tensors; the shard writer
      families        Llama / Qwen3 / Mistral / SmolLM3 / GPT-2 / GPT-NeoX -> decoderlab, decoderlab -> Llama / Qwen3
        gguf_file         decoderlab -> one GGUF file (llama.cpp, Ollama), named as Llama or Qwen3
        onnx_executorch   decoderlab -> ONNX (ONNX Runtime), ExecuTorch program (XNNPACK)

and ``python -m decoderlab.convert`` (``decoderlab/convert.py``) is the command over all of them.
"""

from .families import convert_from, convert_to_llama, convert_to_qwen3
from .gguf_file import OUTTYPES, convert_to_gguf
from .onnx_executorch import export_executorch, export_onnx, export_static_cache

__all__ = [
    "convert_from",
    "convert_to_llama",
    "convert_to_qwen3",
    "convert_to_gguf",
    "OUTTYPES",
    "export_onnx",
    "export_executorch",
    "export_static_cache",
]
