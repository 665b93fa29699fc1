"""Loading what the explorer looks at: a decoderlab checkpoint (folder or Hub id, through the package or through the
checkpoint's own code), or a Llama, GPT-2 or GPT-NeoX checkpoint converted on load by ``decoderlab.export``'s
readers."""

import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from decoderlab.export.checkpoint import lora_adapter_problem
from decoderlab.export.families import FROM, convert_from

logger = logging.getLogger(__name__)

MODEL_TYPE = "decoderlab"
# model_type in config.json -> the family name convert_from takes
CONVERTIBLE = {conversion.source_type: family for family, conversion in FROM.items()}


class ExploreError(ValueError):
    """A problem with what the explorer was asked to do, in words meant for the person who asked."""


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    source: str  # what was asked for: a folder or a Hub id
    converted_from: str | None = None  # "llama", "gpt2" or "neox" when converted on load
    remote_code: bool = False  # the checkpoint's own modeling code, not the installed package's
    keep: list = field(default_factory=list)  # the converted copy's temporary folder, removed with this object


def read_model_type(name: str) -> str:
    """``model_type`` from the config.json of the folder or Hub repo ``name``, or an ExploreError saying why the
    name is not a checkpoint."""
    path = Path(name)
    if path.exists() and not path.is_dir():
        raise ExploreError(f"{name} is a file; pass the checkpoint folder that holds config.json and the weights.")
    adapter = lora_adapter_problem(path, "the explorer") if path.is_dir() else None
    if adapter:
        raise ExploreError(adapter)
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(p.name for p in path.iterdir())[:12]
        raise ExploreError(
            f"{name} is not a checkpoint folder: it has no config.json (it holds {found or 'nothing'}). Pass a folder "
            "written by save_pretrained or training/pretrain.py (its output_dir), or a Hub repo id."
        )
    try:
        config, _ = PretrainedConfig.get_config_dict(name)
    except (OSError, ValueError, json.JSONDecodeError) as err:
        raise ExploreError(
            f"{name!r} is neither a checkpoint folder nor a Hub repo whose config.json could be read "
            f"({type(err).__name__}: {err}). Pass a local folder, or a Hub id while online."
        ) from err
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE and model_type not in CONVERTIBLE:
        raise ExploreError(
            f"{name} holds a {model_type!r} checkpoint (config.json model_type). The explorer reads decoderlab "
            f"checkpoints, and converts {', '.join(map(repr, CONVERTIBLE))} ones on load."
        )
    return model_type


def checkpoint_code(name: str) -> type:
    """The causal-LM class in the checkpoint's own modeling file (its config.json's ``auto_map``), loaded through
    transformers' dynamic modules: what ``trust_remote_code`` runs where decoderlab is not installed. (With the
    package installed, the Auto classes pick the package's registered class instead.)"""
    config, _ = PretrainedConfig.get_config_dict(name)
    reference = (config.get("auto_map") or {}).get("AutoModelForCausalLM")
    if reference is None:
        raise ExploreError(
            f"--trust_remote_code: {name} carries no modeling code of its own (config.json has no auto_map entry for "
            "AutoModelForCausalLM). Leave the flag out to load it with the installed package."
        )
    return get_class_from_dynamic_module(reference, name)


def load(name: str, trust_remote_code: bool = False, attn_implementation: str = "eager") -> Loaded:
    """The model (float32, eval mode, ``attn_implementation``; eager returns attention weights) and tokenizer of the
    checkpoint ``name``. Llama, GPT-2 and GPT-NeoX checkpoints are converted into a temporary folder first
    (``decoderlab.export.convert_from``), so every model the explorer shows is a decoderlab model."""
    model_type = read_model_type(name)
    loaded = Loaded(model=None, tokenizer=None, source=name)
    folder = name
    if model_type in CONVERTIBLE:
        family = CONVERTIBLE[model_type]
        scratch = tempfile.TemporaryDirectory(prefix="decoderlab-explore-")
        loaded.keep.append(scratch)
        try:
            folder = str(convert_from(family, name, Path(scratch.name) / family))
        except ValueError as err:
            raise ExploreError(f"Could not convert the {model_type} checkpoint {name} to decoderlab: {err}") from err
        loaded.converted_from = family
        logger.info("converted the %s checkpoint %s to decoderlab in %s", family, name, folder)
    model_class = checkpoint_code(folder) if trust_remote_code else AutoModelForCausalLM
    try:
        loaded.model = model_class.from_pretrained(
            folder, dtype=torch.float32, attn_implementation=attn_implementation
        ).eval()
    except (OSError, ValueError, ImportError) as err:
        raise ExploreError(f"Could not load the model in {name} ({type(err).__name__}: {err}).") from err
    loaded.remote_code = trust_remote_code
    try:
        loaded.tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as err:
        raise ExploreError(
            f"The checkpoint {name} has no tokenizer the explorer can load ({type(err).__name__}: {err}). Save the "
            "tokenizer the model was trained with into the folder (tokenizer.save_pretrained)."
        ) from err
    return loaded
