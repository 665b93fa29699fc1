"""The shared checkpoint reader under every exporter: where SRC is (a folder, or a Hub repo id downloaded), what
its config.json says, its safetensors tensors read one at a time from memory-mapped files, and the shard writer
that writes a converted folder's tensors.

Every exporter (``families``, ``gguf_file``, ``onnx_executorch``) imports this module; it imports none of them.
"""

import json
import os
from contextlib import ExitStack
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from safetensors import safe_open
from safetensors.torch import save_file

# Files carried from SRC to DST as they are
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
# What a Hub download fetches: configs, weights and the files above
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
# Transposed and split tensors are copies held until their shard is written, so this bounds the memory a
# conversion needs beyond the memory-mapped source; renamed tensors are written straight from the map.
DEFAULT_MAX_SHARD_SIZE = "1GB"


ADAPTER_CONFIG = "adapter_config.json"  # what peft's save_pretrained writes beside a LoRA adapter's weights


def lora_adapter_problem(folder: str | os.PathLike, command: str) -> str | None:
    """What to say when ``folder`` is a LoRA adapter (peft's ``adapter_config.json``, no ``config.json``) where
    ``command`` needs a whole model; ``None`` for any other folder."""
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() or (folder / "config.json").is_file():
        return None
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (ValueError, AttributeError):
        base = None
    base = base or "BASE"
    return (
        f"{folder} is a LoRA adapter ({ADAPTER_CONFIG}: low-rank updates for the base model {base}), not a whole "
        f"model, and {command} needs the model with the adapter merged into its weights. Fine-tune with "
        "--merge_lora to save the merged model (the adapter is then kept in adapter/), or merge this adapter with "
        f"peft: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {str(folder)!r})"
        ".merge_and_unload().save_pretrained(NEW_FOLDER), and save the tokenizer into NEW_FOLDER too."
    )


def resolve_source(src: str | os.PathLike) -> Path:
    """A local checkpoint folder as it is, or a Hub repo id downloaded (configs, safetensors, tokenizer)."""
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"SRC {str(src)!r} is a file; pass the checkpoint folder that holds it.")
    try:
        return Path(snapshot_download(str(src), allow_patterns=HUB_PATTERNS))
    except (HFValidationError, HfHubHTTPError, OSError) as err:
        raise ValueError(
            f"SRC {str(src)!r} is neither a local folder nor a Hub repo that could be downloaded "
            f"({type(err).__name__}: {err})."
        ) from err


def config_json(folder: Path) -> dict:
    """SRC's config.json as a dict, or a ValueError when the folder has none."""
    config_file = folder / "config.json"
    adapter = lora_adapter_problem(folder, "python -m decoderlab.convert")
    if adapter:
        raise ValueError(adapter)
    if not config_file.is_file():
        raise ValueError(f"No config.json in {folder}: is it a transformers checkpoint folder?")
    return json.loads(config_file.read_text())


class CheckpointReader:
    """The tensors of a safetensors checkpoint (``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``), each read on demand from memory-mapped files."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map = json.loads(index.read_text())["weight_map"]  # tensor name -> shard file
        elif (folder / "model.safetensors").is_file():
            with safe_open(folder / "model.safetensors", framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            found = sorted(p.name for p in folder.iterdir())
            raise ValueError(
                f"No safetensors weights in {folder} (model.safetensors or model.safetensors.index.json); found "
                f"{found}. Load the model with transformers and save_pretrained it to get safetensors."
            )
        self.folder = folder
        self._stack = ExitStack()
        self._files: dict[str, object] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __getitem__(self, name: str) -> torch.Tensor:
        shard = self.weight_map[name]
        if shard not in self._files:
            self._files[shard] = self._stack.enter_context(safe_open(self.folder / shard, framework="pt"))
        return self._files[shard].get_tensor(name)


class ShardWriter:
    """Writes tensors into safetensors shards of at most ``max_shard_size`` bytes (a bigger tensor gets a
    shard of its own), named as ``save_pretrained`` names them, with an index when there are several."""

    def __init__(self, folder: Path, max_shard_size: int):
        self.folder = folder
        self.max_shard_size = max_shard_size
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # tensor names of each shard written
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_size:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        save_file(self.pending, self.folder / f"shard-{len(self.shards)}.tmp", metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            (self.folder / "shard-0.tmp").rename(self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.shards):
            shard = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            (self.folder / f"shard-{i}.tmp").rename(self.folder / shard)
            weight_map.update(dict.fromkeys(names, shard))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
