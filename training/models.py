"""The model and tokenizer a run trains: a fresh decoderlab model, or a checkpoint with its own tokenizer.

- ``build_model(fields, tokenizer, block_size)``: a new ``DecoderLabForCausalLM`` from ``DecoderLabConfig``
  fields, its vocabulary the tokenizer's (pretraining from scratch, the experiments).
- ``load_base_tokenizer(name)`` and ``load_base_model(name, tokenizer, block_size)``: an existing decoderlab
  checkpoint (a folder or a Hub id) and the tokenizer it was trained with (continued pretraining,
  fine-tuning, evaluation).
- ``check_model_fits``: the checks every run makes before its first step, that the model can embed every
  token of the tokenizer and has a position for every token of a block.
- ``check_special_tokens`` and ``add_special_tokens``: a checkpoint whose tokenizer has no end-of-text or
  padding token (made before the scripts' tokenizers had them) is refused for fine-tuning, or given them.
"""

import logging
import pathlib

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM

from .data import EOS_TOKEN

# Files that hold a vocabulary (tokenizer_config.json alone does not)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
# model_type -> the --from flag of decoderlab.convert
CONVERTIBLE = {"llama": "llama", "gpt2": "gpt2", "gpt_neox": "neox"}
FIXED_POSITION_TABLES = ("learned", "sinusoidal")  # one embedding per position, up to max_position_embeddings

logger = logging.getLogger(__name__)


def check_model_fits(
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    name: str,
    *,
    new_model: bool = False,
    flag: str = "--block_size",
) -> None:
    """A ValueError unless the model ``name`` embeds every token id of ``tokenizer`` and has a position for each
    of ``block_size`` tokens: with a position table (learned or sinusoidal) always; with RoPE or no positions only
    for a ``new_model``, whose ``max_position_embeddings`` is the context it is built and recorded for (an existing
    RoPE model can be trained or run on longer blocks than it has seen). ``flag`` is the option that set the length."""
    if config.vocab_size < len(tokenizer):
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but {name} embeds only vocab_size={config.vocab_size}: "
            "some token ids would have no embedding. Use the tokenizer the model was trained with, or, for a new "
            "model, leave model.vocab_size unset (it follows the tokenizer) or make it at least that large."
        )
    check_positions_fit(config, block_size, name, new_model=new_model, flag=flag)


def check_positions_fit(config: PretrainedConfig, length: int, name: str, *, new_model=False, flag="--block_size"):
    """The position half of ``check_model_fits``: a ValueError naming ``flag`` and both lengths."""
    position_type = getattr(config, "position_embedding_type", None)
    if config.max_position_embeddings >= length or not (new_model or position_type in FIXED_POSITION_TABLES):
        return
    if new_model:
        raise ValueError(
            f"{flag} {length} is longer than the new model's max_position_embeddings={config.max_position_embeddings}: "
            f"its config (and model card) would promise a context of {config.max_position_embeddings} tokens for a "
            f"model trained on {length}. Raise --model.max_position_embeddings to at least {length} (or leave it "
            f"unset: it follows {flag}), or lower {flag}."
        )
    raise ValueError(
        f"{flag} {length} is longer than the {config.max_position_embeddings} positions of {name}'s "
        f"{position_type} position table (max_position_embeddings): it has no embedding for a position past "
        f"{config.max_position_embeddings - 1}. Lower {flag} to at most {config.max_position_embeddings}."
        + (" For a new model, raise model.max_position_embeddings." if flag == "--block_size" else "")
    )


def missing_special_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The tokens tools expect that ``tokenizer`` lacks: ``eos_token`` (generation stops, lm-eval's prefix,
    documents end) and ``pad_token`` (batches: pipelines, TRL)."""
    return [name for name in ("eos_token", "pad_token") if getattr(tokenizer, name) is None]


def check_special_tokens(tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    """A ValueError, saying how to add them, when the tokenizer of ``name`` lacks an end-of-text or padding token."""
    missing = missing_special_tokens(tokenizer)
    if missing:
        grows = "grows the vocabulary by one token" if tokenizer.eos_token is None else "adds no token"
        raise ValueError(
            f"The tokenizer of {name} has no {' and no '.join(missing)} (it was made before the training scripts' "
            "tokenizers had them): completions could not learn to end, and TRL, lm-eval and batched pipelines "
            f"need them. Add --add_special_tokens: {EOS_TOKEN} (or the existing end-of-text token) becomes the "
            f"end-of-text, padding and beginning-of-sequence token; this {grows} and resizes the model's "
            "embeddings to match (resize_token_embeddings), and the output checkpoint keeps them."
        )


def add_special_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    """Give ``tokenizer`` the end-of-text token (``EOS_TOKEN``, a new id, when it has none) and use it for padding
    and BOS where those are missing; grow ``model``'s embeddings to the tokenizer (new rows: transformers' mean
    of the old ones) and write the ids into its config and generation config. Returns the tokens added."""
    added = 0 if tokenizer.eos_token is not None else tokenizer.add_special_tokens({"eos_token": EOS_TOKEN})
    for name in ("pad_token", "bos_token"):
        if getattr(tokenizer, name) is None:
            setattr(tokenizer, name, tokenizer.eos_token)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    for config in (model.config, model.generation_config):
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            setattr(config, name, getattr(tokenizer, name))
    return added


def set_sampling_defaults(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Sampling defaults for ``generate()`` and pipelines (nanoGPT's sample.py uses temperature 0.8)."""
    generation = model.generation_config
    generation.do_sample, generation.temperature, generation.top_k, generation.max_new_tokens = True, 0.8, 200, 256
    generation.eos_token_id, generation.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
    # a tokenizer without a padding token (one made before decoderlab's had one): pad with the end of text
    generation.pad_token_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    # No cache_implementation: transformers' dynamic cache, the plain default. A saved static cache would make
    # generate() and pipeline() compile the decoding step on a GPU by themselves, but has not been measured there yet,
    # nor shown faster on a CPU uncompiled; generate.py and the explorer turn compiled decoding on for
    # CUDA themselves (decoderlab.generation.set_compiled_decoding), and pipeline users pass
    # cache_implementation="static".


def build_model(fields: dict, tokenizer: PreTrainedTokenizerBase, block_size: int) -> DecoderLabForCausalLM:
    """A fresh ``DecoderLabForCausalLM`` of ``DecoderLabConfig(**fields)``, with sampling defaults.

    The vocabulary defaults to the tokenizer's and may be larger (padding to a multiple of 64 is a common
    speed trick), never smaller; ``max_position_embeddings`` defaults to ``block_size``; the special tokens
    default to the tokenizer's.
    """
    fields = {"vocab_size": len(tokenizer), "max_position_embeddings": block_size, **fields}
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        fields.setdefault(name, getattr(tokenizer, name))
    config = DecoderLabConfig(**fields)
    check_model_fits(config, tokenizer, block_size, "the model", new_model=True)
    model = DecoderLabForCausalLM(config)
    set_sampling_defaults(model, tokenizer)
    return model


def check_model_folder(name: str) -> None:
    """A ValueError for a folder that holds a resumable ``step_N`` checkpoint (Accelerate's state: weights, optimizer,
    no config.json) instead of a model, saying where the model is; anything else is left to ``from_pretrained``."""
    folder = pathlib.Path(name)
    if folder.is_dir() and (folder / "training_state.json").is_file() and not (folder / "config.json").is_file():
        raise ValueError(
            f"{name} is a resumable training checkpoint (optimizer and data state for --resume_from_checkpoint), not "
            f"a model folder: it has no config.json. The run's model is saved in {folder.parent} when training ends; "
            f"to continue training from this step, run the training script again with --resume_from_checkpoint "
            f"{name}."
        )


def local_or_hub(name: str) -> str:
    """An existing local folder as an absolute path (a saved adapter then finds its base from any directory)."""
    path = pathlib.Path(name)
    return str(path.resolve()) if path.is_dir() else name


def load_base_tokenizer(name: str, revision: str | None = None, trust_remote_code: bool = False):
    """The tokenizer of a checkpoint folder or Hub id, or a ValueError saying it is missing and what to do."""
    check_model_folder(name)
    folder = pathlib.Path(name)
    if folder.is_dir() and not any((folder / file).is_file() for file in TOKENIZER_FILES):
        raise ValueError(
            f"The checkpoint {name} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is in it (it holds "
            f"{sorted(p.name for p in folder.iterdir())}). Save the tokenizer it was trained with into it "
            "(tokenizer.save_pretrained), or pass --tokenizer_name with a tokenizer folder or Hub id."
        )
    try:
        return AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"Could not load a tokenizer from {name!r} ({type(err).__name__}: {err}). Pass --tokenizer_name with "
            "a folder holding tokenizer.json, or a Hub id (offline: a local folder)."
        ) from err


def read_model_config(name: str, revision=None, trust_remote_code=False) -> DecoderLabConfig | None:
    """The config of the decoderlab checkpoint ``name`` (a folder or Hub id), read without its weights; None where it
    cannot be read or is another model's (``load_base_model`` says why when the run loads it)."""
    try:
        check_model_folder(name)
        config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    if config.model_type != DecoderLabConfig.model_type:
        return None
    return config if isinstance(config, DecoderLabConfig) else DecoderLabConfig.from_dict(config.to_dict())


def load_base_model(
    name: str, tokenizer: PreTrainedTokenizerBase, block_size: int, revision=None, trust_remote_code=False
) -> PreTrainedModel:
    """The decoderlab causal LM at ``name`` in float32 (mixed precision autocasts; AdamW keeps fp32 weights),
    checked against the tokenizer and the block size before any training."""
    try:
        config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"Could not load the base checkpoint {name!r} ({type(err).__name__}: {err}). Pass a folder holding "
            "config.json and model.safetensors, or a Hub id (with --trust_remote_code where decoderlab is absent)."
        ) from err
    if config.model_type in CONVERTIBLE:
        raise ValueError(
            f"{name} is a {config.model_type} checkpoint. Convert it to decoderlab first, then train the result: "
            f"python -m decoderlab.convert --from {CONVERTIBLE[config.model_type]} {name} out/{config.model_type}-dl"
        )
    if config.model_type != DecoderLabConfig.model_type:
        raise ValueError(
            f"{name} is a {config.model_type!r} checkpoint; the training scripts train decoderlab models "
            f"(and convert from {', '.join(CONVERTIBLE)} with python -m decoderlab.convert)."
        )
    check_model_fits(config, tokenizer, block_size, name)
    if block_size > config.max_position_embeddings:  # RoPE or no positions: trained on longer blocks, its context grows
        logger.info(
            f"{name} has max_position_embeddings={config.max_position_embeddings}; training on blocks of "
            f"{block_size} tokens extends it, so the result records max_position_embeddings={block_size}."
        )
        config.max_position_embeddings = block_size
    return AutoModelForCausalLM.from_pretrained(
        local_or_hub(name), config=config, revision=revision, trust_remote_code=trust_remote_code, dtype=torch.float32
    )
