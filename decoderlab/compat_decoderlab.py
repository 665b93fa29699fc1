"""The transformers APIs that changed between 5.12 and 5.24, under one name each.

A checkpoint carries this file beside ``modeling_decoderlab.py`` (transformers copies every file reached by a
relative import), so the model code runs on whichever transformers its user has in ``SUPPORTED``. Each shim
says which versions need it and why. Imports only ``torch``, ``transformers`` and the standard library.
"""

import dataclasses
import functools
import inspect
import re
import warnings

import torch
import transformers

SUPPORTED = ">=5.12,<6"


def minor_version(version: str = transformers.__version__) -> tuple[int, int]:
    """(5, 24) for "5.24.0" or "5.24.0.dev0"; (0, 0) for what it cannot read."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def check_transformers_version(version: str = transformers.__version__) -> None:
    """One clear error for a transformers outside ``SUPPORTED``, before an import deep inside fails instead."""
    if not (5, 12) <= minor_version(version) < (6, 0):
        raise ImportError(
            f"decoderlab's model code needs transformers{SUPPORTED}, but transformers {version} is installed. "
            f'Install a supported release: pip install "transformers{SUPPORTED}".'
        )


check_transformers_version()

# After the check, so that an unsupported version gets the error above rather than a missing name
from transformers.generation import GenerationMixin  # noqa: E402
from transformers.masking_utils import create_causal_mask as _create_causal_mask  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    create_sliding_window_causal_mask as _create_sliding_window_causal_mask,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast  # noqa: E402
from transformers.modeling_rope_utils import dynamic_rope_update as _dynamic_rope_update  # noqa: E402

# 5.24 renamed the KV cache from `past_key_values` to `cache`: in the output dataclasses (which generate() reads
# it back from) and in the keyword generate() passes to prepare_inputs_for_generation and forward.
_OUTPUT_FIELDS = {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}
OUTPUT_CACHE_FIELD = "cache" if "cache" in _OUTPUT_FIELDS else "past_key_values"
_GENERATE_PARAMETERS = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
GENERATE_CACHE_KWARG = "cache" if "cache" in _GENERATE_PARAMETERS else "past_key_values"


def base_model_output(last_hidden_state: torch.Tensor, cache, **fields) -> BaseModelOutputWithPast:
    """``BaseModelOutputWithPast`` with the cache under this version's field name (5.12-5.23 have no ``cache=``)."""
    return BaseModelOutputWithPast(last_hidden_state=last_hidden_state, **{OUTPUT_CACHE_FIELD: cache}, **fields)


def causal_lm_output(logits: torch.Tensor, cache, **fields) -> CausalLMOutputWithPast:
    """``CausalLMOutputWithPast`` with the cache under this version's field name (see ``base_model_output``)."""
    return CausalLMOutputWithPast(logits=logits, **{OUTPUT_CACHE_FIELD: cache}, **fields)


def output_cache(outputs):
    """The cache an output holds: ``outputs.cache`` does not exist before 5.24, and warns as ``past_key_values`` on it."""
    return getattr(outputs, OUTPUT_CACHE_FIELD)


def accepts_past_key_values(method):
    """Decorator for ``forward`` and ``prepare_inputs_for_generation``, which take the cache as ``cache``: a cache
    passed as ``past_key_values`` (generate() before 5.24, PEFT, older callers) arrives as ``cache``.

    Replaces ``@deprecate_kwarg("past_key_values", new_name="cache")``, which keeps ``cache`` whenever both names
    arrive, even ``cache=None``: before 5.24 GenerationMixin's prepare_inputs_for_generation passes the cache as
    ``past_key_values`` and forwards every other keyword it is given, so an override handing it ``cache=None``
    made forward drop the real cache; decoding then ran without the past, with no error and different tokens.
    From 5.24, where ``cache`` is the name, the old one warns as transformers' models warn.
    """

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if "past_key_values" in kwargs:
            past_key_values = kwargs.pop("past_key_values")
            if GENERATE_CACHE_KWARG == "cache" and past_key_values is not None:
                warnings.warn(
                    f"`past_key_values` is deprecated for `{method.__qualname__}` since transformers 5.24. "
                    "Use `cache` instead.",
                    FutureWarning,
                    stacklevel=2,
                )
            if kwargs.get("cache") is None:
                kwargs["cache"] = past_key_values
            elif past_key_values is not None and past_key_values is not kwargs["cache"]:
                raise ValueError(
                    "Got two different KV caches, as `cache` and as `past_key_values` (its name before transformers "
                    "5.24): pass it once, as `cache`."
                )
        return method(*args, **kwargs)

    return wrapper


def create_causal_mask(config, inputs_embeds: torch.Tensor, attention_mask, cache, position_ids=None):
    """transformers' ``create_causal_mask``, its arguments passed by position: the 4th parameter is
    ``past_key_values`` in 5.12-5.23 and ``cache`` from 5.24, and 5.12-5.13 have no ``layer_idx`` yet."""
    return _create_causal_mask(config, inputs_embeds, attention_mask, cache, position_ids)


def create_sliding_window_causal_mask(config, inputs_embeds: torch.Tensor, attention_mask, cache, position_ids=None):
    """transformers' ``create_sliding_window_causal_mask`` (the window from ``config.sliding_window``), its arguments
    passed by position for the same reason as ``create_causal_mask``'s. It exists with these five parameters on every
    supported release; with a cache it sizes the mask by the cache's first sliding layer on each."""
    return _create_sliding_window_causal_mask(config, inputs_embeds, attention_mask, cache, position_ids)


def dynamic_rope_update(rope_forward):
    """transformers' decorator for the rotary module's ``forward`` (rescales "dynamic" and "longrope" RoPE to the
    input's length). 5.12 records a grown length under ``None_max_seq_len_cached`` (fixed in 5.13), so "dynamic"
    RoPE kept its stretched frequencies for every shorter input after a long one; read it back where it lands."""
    updating_forward = _dynamic_rope_update(rope_forward)
    if minor_version() >= (5, 13):
        return updating_forward

    @functools.wraps(rope_forward)
    def wrapper(self, x, position_ids, *args, **kwargs):
        out = updating_forward(self, x, position_ids, *args, **kwargs)
        if "None_max_seq_len_cached" in self.__dict__:
            self.max_seq_len_cached = self.__dict__.pop("None_max_seq_len_cached")
        return out

    return wrapper


try:  # transformers' own from 5.21 (absent in 5.12-5.20)
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The positions to compute logits for (transformers 5.24's definition): the last ``logits_to_keep`` for
        an int (0: all), given positions for a 1D or 2D integer tensor, the True ones for a 2D bool mask
        (flattened to (N, C))."""
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
            if logits_to_keep.dtype == torch.bool:
                return hidden_states[logits_to_keep]
            return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
        if isinstance(logits_to_keep, int):
            logits_to_keep = slice(-logits_to_keep, None)
        return hidden_states[:, logits_to_keep, :]


__all__ = [
    "SUPPORTED",
    "minor_version",
    "check_transformers_version",
    "OUTPUT_CACHE_FIELD",
    "GENERATE_CACHE_KWARG",
    "base_model_output",
    "causal_lm_output",
    "output_cache",
    "accepts_past_key_values",
    "create_causal_mask",
    "create_sliding_window_causal_mask",
    "dynamic_rope_update",
    "slice_logits_to_keep",
]
