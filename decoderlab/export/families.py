"""Checkpoints of the Hugging Face families: Llama, Qwen3, Mistral, SmolLM3, GPT-2 and GPT-NeoX to decoderlab, and
decoderlab to Llama and Qwen3, one tensor at a time.

    python -m decoderlab.convert --from {llama,qwen3,mistral,smollm3,gpt2,neox} SRC DST   # SRC: a folder or Hub repo id
    python -m decoderlab.convert --to llama SRC DST      # decoderlab -> plain LlamaForCausalLM
    python -m decoderlab.convert --to qwen3 SRC DST      # with QK-norm -> plain Qwen3ForCausalLM, sliding layers kept

or from Python, ``convert_from("gpt2", src, dst)``, ``convert_to_llama(src, dst)`` and ``convert_to_qwen3(src, dst)``.
Each family's config mapping (``llama_config_from_decoderlab`` ...) is also what the GGUF export starts from.

How: the source config becomes the target config (``--from`` builds it from the matching preset,
``DecoderLabConfig.from_preset``). Every tensor name is mapped before anything is written, and the
mapped names must be exactly the target model's, so an unknown or missing tensor stops the conversion
with DST untouched. Then each tensor is read from the memory-mapped safetensors files (``safe_open``),
renamed (GPT-2's Conv1D weights transposed, fused q/k/v projections split) and written into shards of
at most ``max_shard_size`` bytes (default 1GB): beyond the memory-mapped source, peak memory is about
one output shard plus one tensor, never a second copy of the model.

DST's config.json, generation_config.json and, for decoderlab, the two model code files come from
``save_pretrained`` on a weightless skeleton of the target model built on the meta device, so they are
exactly what transformers itself writes (for decoderlab: ``auto_map`` for every Auto class, so
``trust_remote_code`` loads work without the package). Tokenizer files are copied over.

RoPE layout: HF Llama, HF Qwen3, HF GPT-NeoX and decoderlab all rotate the two halves of each head (HF's
``rotate_half``), so query and key weights are copied unpermuted. Checkpoints in Meta's original
interleaved layout must go through transformers' own Llama converter first.

Per-layer layouts: Qwen3's sliding layers (``layer_types``, ``sliding_window``), Mistral's one window for every layer
and SmolLM3's RoPE-free layers (``no_rope_layers``) become decoderlab's fields of the same names. ``--to qwen3`` writes
sliding layers back (``qwen3_window_fields``); ``--to llama`` refuses them, and both refuse RoPE-free layers and
attention sinks, naming the layers (the switch table, ``SWITCHES``). gpt-oss is refused (``REFUSED_SOURCES``): its
mixture of experts is nothing decoderlab computes.
"""

import copy
import logging
import math
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
)
from transformers.utils.hub import convert_file_size_to_int

from ..configuration_decoderlab import DecoderLabConfig, is_mup
from ..modeling_decoderlab import DecoderLabForCausalLM
from .checkpoint import (
    DEFAULT_MAX_SHARD_SIZE,
    TOKENIZER_FILES,
    CheckpointReader,
    ShardWriter,
    config_json,
    resolve_source,
)

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Configs: each source family's config as a decoderlab config, and a decoderlab config as Llama's


def _token_ids(config: PreTrainedConfig) -> dict:
    return {name: getattr(config, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}


# decoderlab fields that LlamaConfig has under the same name and meaning, plus the one it names differently;
# both directions read these, so they cannot drift apart
LLAMA_SAME_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
    "rope_parameters", "attention_bias", "attention_dropout", "mlp_bias", "tie_word_embeddings", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip
LLAMA_FIELDS = {**{name: name for name in LLAMA_SAME_FIELDS}, "norm_eps": "rms_norm_eps"}  # ours -> Llama's


# Qwen3Config has Llama's fields but mlp_bias (its MLP has none); Mistral's layers have no biases at all; SmolLM3Config
# has no head_dim (its attention divides hidden_size among the heads unless the config carries one)
QWEN3_FIELDS = {ours: theirs for ours, theirs in LLAMA_FIELDS.items() if ours != "mlp_bias"}
MISTRAL_FIELDS = {ours: theirs for ours, theirs in LLAMA_FIELDS.items() if ours not in ("attention_bias", "mlp_bias")}
SMOLLM3_FIELDS = {ours: theirs for ours, theirs in LLAMA_FIELDS.items() if ours != "head_dim"}

SLIDING, FULL = "sliding_attention", "full_attention"


def name_layers(indices: list[int]) -> str:
    """ "layer 3" or "layers 0, 1, 2": the layers a message is about."""
    return f"layer{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


def sliding_layers(layer_types: list[str]) -> list[int]:
    return [i for i, kind in enumerate(layer_types) if kind == SLIDING]


def _from_llama_shaped(source: PreTrainedConfig, fields: dict[str, str], **family) -> DecoderLabConfig:
    """The ``llama`` preset with ``fields`` (ours -> theirs) read from ``source``, and ``family``: what the family
    fixes or keeps under other names (QK-norm, no biases, its per-layer layout)."""
    values = {ours: copy.deepcopy(getattr(source, theirs)) for ours, theirs in fields.items()}
    values["attention_dropout"] = float(values["attention_dropout"] or 0.0)  # the configs allow None and ints
    return DecoderLabConfig.from_preset("llama", **values, **family)


def decoderlab_config_from_llama(llama: LlamaConfig) -> DecoderLabConfig:
    """``llama`` preset; sizes, grouped-query heads, RoPE (theta and scaling), biases and tying as in ``llama``."""
    return _from_llama_shaped(llama, LLAMA_FIELDS)


def _refuse_windowless_sliding_layers(source: PreTrainedConfig, family: str, why: str) -> None:
    """A ValueError when ``source.layer_types`` has sliding layers that ``source`` gives no window: transformers'
    sliding mask needs one, so such a checkpoint does not run in ``family`` itself either (``why``: the field that
    left the window out)."""
    sliding = sliding_layers(source.layer_types)
    if sliding and source.sliding_window is None:
        raise ValueError(
            f"This {family} checkpoint's layer_types makes {name_layers(sliding)} 'sliding_attention', but {why}: "
            f"transformers' {family} cannot build their mask either. Set the window in config.json (sliding_window, "
            "with use_sliding_window=true) or make those layers 'full_attention', then convert."
        )


def decoderlab_config_from_qwen3(qwen3: Qwen3Config) -> DecoderLabConfig:
    """``llama`` preset with QK-norm (Qwen3's q_norm / k_norm, eps rms_norm_eps), no MLP biases, and Qwen3's
    per-layer layout as its config resolves it: ``layer_types`` (given, or sliding from layer ``max_window_layers``
    on) and ``sliding_window``, which Qwen3Config sets to None unless ``use_sliding_window``."""
    _refuse_windowless_sliding_layers(qwen3, "Qwen3", f"use_sliding_window={qwen3.use_sliding_window!r} leaves "
                                      f"sliding_window={qwen3.sliding_window!r}")  # fmt: skip
    return _from_llama_shaped(
        qwen3, QWEN3_FIELDS, qk_norm=True, mlp_bias=False, layer_types=list(qwen3.layer_types),
        sliding_window=qwen3.sliding_window,
    )  # fmt: skip


def decoderlab_config_from_mistral(mistral: MistralConfig) -> DecoderLabConfig:
    """``llama`` preset without biases; Mistral's one window, ``sliding_window``, on every layer (None: every layer
    attends fully). MistralForCausalLM reads no ``layer_types``, so none is taken from its config."""
    n, window = mistral.num_hidden_layers, mistral.sliding_window
    layer_types = [SLIDING if window is not None else FULL] * n
    return _from_llama_shaped(
        mistral, MISTRAL_FIELDS, attention_bias=False, mlp_bias=False, layer_types=layer_types, sliding_window=window
    )


def decoderlab_config_from_smollm3(smollm3: SmolLM3Config) -> DecoderLabConfig:
    """``llama`` preset with SmolLM3's RoPE-free layers (``no_rope_layers``, which its config derives from
    ``no_rope_layer_interval``) and sliding layers (``layer_types``: by default the RoPE-free ones, when
    ``use_sliding_window`` and ``sliding_window`` are set). A sliding layer with ``use_sliding_window=False`` is
    refused: transformers' SmolLM3 then puts the window in its masks (eager, SDPA, flex attention) but not in flash
    attention's call, so the checkpoint has no one meaning."""
    _refuse_windowless_sliding_layers(smollm3, "SmolLM3", f"sliding_window={smollm3.sliding_window!r}")
    sliding = sliding_layers(smollm3.layer_types)
    if sliding and not smollm3.use_sliding_window:
        raise ValueError(
            f"This SmolLM3 checkpoint's layer_types makes {name_layers(sliding)} 'sliding_attention' with "
            f"sliding_window={smollm3.sliding_window}, but use_sliding_window=False: transformers' SmolLM3 then "
            "applies the window in its masks (eager, sdpa, flex attention) and not with flash attention, so what it "
            "computes depends on the kernel. Set use_sliding_window=true (the window on those layers) or make them "
            "'full_attention' in config.json, then convert."
        )
    head_dim = getattr(smollm3, "head_dim", None) or smollm3.hidden_size // smollm3.num_attention_heads
    return _from_llama_shaped(
        smollm3, SMOLLM3_FIELDS, head_dim=head_dim, no_rope_layers=list(smollm3.no_rope_layers),
        layer_types=list(smollm3.layer_types), sliding_window=smollm3.sliding_window,
    )  # fmt: skip


# Families whose checkpoints decoderlab cannot compute, by their --from name: why, and what to do instead
REFUSED_SOURCES = {
    "gpt_oss": (
        "gpt-oss cannot be converted to decoderlab: each of its blocks ends in a mixture of experts (a router picks "
        "num_experts_per_tok of num_local_experts MLPs per token, each a clamped SwiGLU with biases), and decoderlab "
        "has one dense MLP per block and no switch for experts. Its attention decoderlab does have (attention_sinks="
        "True; layer_types and sliding_window for its alternating windows), but a model with the experts left out "
        "computes something else, so nothing is converted. Run it with transformers' GptOssForCausalLM."
    ),
}


def decoderlab_config_from_gpt2(gpt2: GPT2Config) -> DecoderLabConfig:
    """``gpt2`` preset. GPT-2's two extra attention switches are honoured or refused, never dropped."""
    unsupported = [
        f"{name}=True" for name in ("scale_attn_by_inverse_layer_idx", "add_cross_attention") if getattr(gpt2, name)
    ]
    if unsupported:
        raise ValueError(
            f"This GPT-2 checkpoint sets {', '.join(unsupported)}, which decoderlab has no switch for "
            "(a per-layer attention scale; cross-attention to an encoder). It cannot be converted."
        )
    return DecoderLabConfig.from_preset(
        "gpt2",
        vocab_size=gpt2.vocab_size,
        hidden_size=gpt2.n_embd,
        num_hidden_layers=gpt2.n_layer,
        num_attention_heads=gpt2.n_head,
        intermediate_size=gpt2.n_inner or 4 * gpt2.n_embd,
        max_position_embeddings=gpt2.n_positions,
        hidden_act=gpt2.activation_function,
        norm_eps=gpt2.layer_norm_epsilon,
        attention_scale=None if gpt2.scale_attn_weights else 1.0,
        attention_dropout=float(gpt2.attn_pdrop),
        hidden_dropout=float(gpt2.resid_pdrop),  # decoderlab has one rate for embeddings and residuals
        tie_word_embeddings=gpt2.tie_word_embeddings,
        initializer_range=gpt2.initializer_range,
        **_token_ids(gpt2),
    )


def decoderlab_config_from_neox(neox: GPTNeoXConfig) -> DecoderLabConfig:
    """``neox`` preset; partial rotary and the parallel residual as in ``neox`` (Pythia has both)."""
    return DecoderLabConfig.from_preset(
        "neox",
        vocab_size=neox.vocab_size,
        hidden_size=neox.hidden_size,
        num_hidden_layers=neox.num_hidden_layers,
        num_attention_heads=neox.num_attention_heads,
        intermediate_size=neox.intermediate_size,
        max_position_embeddings=neox.max_position_embeddings,
        rope_parameters=dict(neox.rope_parameters),  # includes partial_rotary_factor (rotary_pct)
        hidden_act=neox.hidden_act,
        norm_eps=neox.layer_norm_eps,
        use_parallel_residual=neox.use_parallel_residual,
        attention_bias=neox.attention_bias,
        attention_dropout=float(neox.attention_dropout),
        hidden_dropout=float(neox.hidden_dropout),
        tie_word_embeddings=neox.tie_word_embeddings,
        initializer_range=neox.initializer_range,
        **_token_ids(neox),
    )


def refuse_fields(
    in_the_way: dict[str, tuple[bool, str]], config: PreTrainedConfig, values: dict, what: str, instead: str
) -> None:
    """A ValueError when any field of ``in_the_way`` (name -> (blocks, why)) blocks: ``what``, then one line
    ``"  field=value: why"`` per blocking field (the value from ``values`` where given, as for a key inside a
    dict field, else from ``config``), then ``instead``."""
    problems = [
        f"  {name}={values.get(name, getattr(config, name, None))!r}: {why}"
        for name, (blocks, why) in in_the_way.items()
        if blocks
    ]
    if problems:
        raise ValueError(f"{what}; these fields stand in the way:\n" + "\n".join(problems) + f"\n{instead}")


def _rotary_fraction(config: DecoderLabConfig) -> float:
    return (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)


def _sliding_reason(config: DecoderLabConfig, family: str) -> str:
    sliding = sliding_layers(config.layer_types)
    return (
        f"{name_layers(sliding)} {'is' if len(sliding) == 1 else 'are'} 'sliding_attention' (each query sees the last "
        f"sliding_window={config.sliding_window} tokens), but {family} attends to every earlier token in every layer "
        "('full_attention'); Qwen3 keeps sliding layers: export a model with QK-norm with --to qwen3"
    )


def _no_rope_reason(config: DecoderLabConfig, family: str) -> str:
    skipping = [i for i, rotates in enumerate(config.no_rope_layers or []) if not rotates]
    verb = "skips" if len(skipping) == 1 else "skip"
    return f"{name_layers(skipping)} {verb} RoPE (0), but {family} applies it in every layer (all 1)"


@dataclass(frozen=True)
class Switch:
    """A DecoderLabConfig field that, switched on, makes the model compute what plain Llama cannot (and Qwen3 and GGUF
    through them, unless they carry it): ``on(config)`` says whether a config uses it, ``why`` (with ``{family}``)
    what a family without it does instead, ``example`` the fields that switch it on (what the tests export, to see it
    refused or carried), ``carried_by`` the families whose checkpoints express it, so that their export writes it
    instead of refusing it (``Qwen3Config`` has ``layer_types`` and ``sliding_window``)."""

    on: Callable[[DecoderLabConfig], bool]
    why: str | Callable[[DecoderLabConfig, str], str]
    example: dict
    carried_by: frozenset[str] = frozenset()

    def reason(self, config: DecoderLabConfig, family: str) -> str:
        return self.why(config, family) if callable(self.why) else self.why.format(family=family)


# The switch table: every model switch, as the exports see it. A field of DecoderLabConfig is either a switch here or
# one of CARRIED_FIELDS (what a Llama-shaped family takes as it is, or what does not change the function), so a new
# field cannot reach an export unclassified (tests/test_convert.py checks both, and exports every switch's example to
# each family: refused by name where the family lacks it, the same logits where it carries it)
SWITCHES: dict[str, Switch] = {
    "norm_placement": Switch(lambda c: c.norm_placement != "pre", "{family} normalises before each sublayer ('pre')",
                             {"norm_placement": "post"}),
    "use_parallel_residual": Switch(lambda c: c.use_parallel_residual, "{family}'s sublayers run one after the other",
                                    {"use_parallel_residual": True}),
    "norm_type": Switch(lambda c: c.norm_type != "rmsnorm", "{family} uses RMSNorm ('rmsnorm')",
                        {"norm_type": "layernorm", "norm_bias": False}),
    "norm_bias": Switch(lambda c: c.norm_type == "layernorm" and c.norm_bias, "RMSNorm has no bias",
                        {"norm_type": "layernorm", "norm_bias": True}),
    "position_embedding_type": Switch(lambda c: c.position_embedding_type != "rope", "{family} uses RoPE ('rope')",
                                      {"position_embedding_type": "learned"}),
    "rope_parameters['partial_rotary_factor']": Switch(
        lambda c: c.position_embedding_type == "rope" and _rotary_fraction(c) != 1.0,
        "{family} rotates every dimension of each head (1.0)",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ),
    "mlp_type": Switch(lambda c: c.mlp_type != "gated", "{family}'s MLP is gated ('gated')", {"mlp_type": "plain"}),
    "embedding_multiplier": Switch(lambda c: c.embedding_multiplier != 1.0,
                                   "{family} uses its token embeddings unscaled (1.0)", {"embedding_multiplier": 2.0}),
    "attention_scale": Switch(
        lambda c: c.attention_scale is not None and not math.isclose(c.attention_scale, c.head_dim**-0.5),
        lambda c, family: f"{family} scales attention by 1/sqrt(head_dim) = {c.head_dim**-0.5:.6g} (None)",
        {"attention_scale": 1.0},
    ),
    "final_logit_softcapping": Switch(lambda c: c.final_logit_softcapping is not None,
                                      "{family} returns its logits uncapped (None); Gemma 2 caps them, with another "
                                      "block", {"final_logit_softcapping": 30.0}),
    "value_residual": Switch(lambda c: c.value_residual, "{family}'s layers use their own values only (False)",
                             {"value_residual": True}),
    "layer_types": Switch(lambda c: SLIDING in c.layer_types, _sliding_reason,
                          {"layer_types": [FULL, SLIDING, SLIDING], "sliding_window": 4},
                          carried_by=frozenset({"Qwen3"})),
    "no_rope_layers": Switch(lambda c: 0 in (c.no_rope_layers or []), _no_rope_reason, {"no_rope_layers": [1, 0, 0]}),
    "attention_sinks": Switch(lambda c: c.attention_sinks, "every layer's softmax has a learned sink logit per head "
                              "(self_attn.sinks), but {family}'s has none (False); gpt-oss's has, with another block",
                              {"attention_sinks": True}),
}  # fmt: skip
# The other fields, and why a Llama-shaped export can take them: a size, a token id, a setting Llama has under its
# own name (LLAMA_FIELDS); what only training or the first step sees (dropout, initialisation); QK-norm and MLP
# biases, which each family decides (Llama and Qwen3 differ); muP's fields, folded into the weights or refused
# (mup_in_the_way, mup_folds); what only a switch's layers read or what only writes a switch (sliding_window, read by
# sliding layers alone; no_rope_layer_interval, resolved into no_rope_layers)
CARRIED_FIELDS = frozenset(LLAMA_FIELDS) | {
    "hidden_dropout", "scale_residual_init", "zero_residual_init", "embedding_initializer_range", "qk_norm",
    "parametrization", "mup_base_width", "mup_base_shapes", "mup_output_multiplier", "mup_attention_multiplier",
    "sliding_window",
    "no_rope_layer_interval",
}  # fmt: skip


def llama_shaped_in_the_way(config: DecoderLabConfig, family: str) -> dict[str, tuple[bool, str]]:
    """For ``refuse_fields``: the switches (``SWITCHES``) ``config`` turns on that ``family`` (Llama, Qwen3: named in
    each reason) cannot express, every switch but those it carries. QK-norm and MLP biases are left to each family."""
    return {
        name: (switch.on(config), switch.reason(config, family))
        for name, switch in SWITCHES.items()
        if family not in switch.carried_by
    }


def mup_in_the_way(config: DecoderLabConfig, family: str) -> dict[str, tuple[bool, str]]:
    """For ``refuse_fields``: muP's multipliers that cannot be folded into ``family``'s weights. The logits' factor
    folds into an untied ``lm_head``; a tied one is the token embedding too, which the factor must not change."""
    return {
        "parametrization": (
            is_mup(config) and config.tie_word_embeddings and config.logit_scale != 1.0,
            f"muP multiplies the logits by mup_output_multiplier / m = {config.logit_scale:.6g}, which {family} has "
            "no factor for; folded into lm_head it would change the token embedding tied to it (tie_word_embeddings"
            "=True). Train with tie_word_embeddings=False to export a muP model",
        ),
    }


def mup_folds(config: DecoderLabConfig) -> dict[str, float]:
    """What exporting ``config`` to a family without muP's multipliers multiplies into the weights, exactly: a
    regex over decoderlab's tensor names -> the factor. The readout (``parameter_roles``: an untied ``lm_head``;
    ``mup_in_the_way`` refuses a tied one) takes the factor its rule puts on its output in the forward pass,
    ``logit_scale``. muP's attention scale alpha_attn/head_dim (``default_attention_scale``, when ``attention_scale``
    is unset) is 1/sqrt(head_dim) times alpha_attn/sqrt(head_dim): the second factor goes into the queries, through the query
    norm's weight with QK-norm (which would undo a factor on q_proj) and through q_proj's weight and bias otherwise;
    RoPE rotates q linearly, so it commutes. Nothing for the standard parametrization."""
    if not is_mup(config):
        return {}
    with torch.device("meta"):  # the roles, without weights
        roles = DecoderLabForCausalLM(config).parameter_roles()
    folds = {}
    if config.logit_scale != 1.0:
        folds.update({re.escape(name): config.logit_scale for name, role in roles.items() if role.role == "readout"})
    if config.attention_scale is None:
        query = r"q_norm\.weight" if config.qk_norm else r"q_proj\.(weight|bias)"
        folds[r"model\.layers\.\d+\.self_attn\." + query] = config.default_attention_scale / config.head_dim**-0.5
    return folds


def fold(name: str, tensor: torch.Tensor, folds: dict[str, float]) -> torch.Tensor:
    """``tensor`` (decoderlab's ``name``) times the factor of the first pattern of ``folds`` that matches its name,
    computed in float32 and stored in its own dtype; itself when none matches."""
    for pattern, factor in folds.items():
        if re.fullmatch(pattern, name):
            return (tensor.to(torch.float32) * factor).to(tensor.dtype)
    return tensor


def exported_config(
    config: DecoderLabConfig,
    target: type[PreTrainedConfig],
    fields: dict[str, str],
    family_in_the_way: dict[str, tuple[bool, str]],
    instead: str,
    family_fields: dict | None = None,
) -> PreTrainedConfig:
    """``target`` built from ``fields`` (ours -> theirs) of ``config`` and ``family_fields`` (the target's own fields
    for the switches it carries), or one ValueError listing every field in the way: what ``llama_shaped_in_the_way``
    lists, then what ``family_in_the_way`` adds for ``target``."""
    family = target.model_type.capitalize()  # Llama, Qwen3
    refuse_fields(
        {**llama_shaped_in_the_way(config, family), **family_in_the_way, **mup_in_the_way(config, family)},
        config,
        {"rope_parameters['partial_rotary_factor']": _rotary_fraction(config)},
        f"A {family} checkpoint cannot express this decoderlab configuration",
        instead,
    )
    if config.hidden_dropout:
        logger.warning(
            f"hidden_dropout={config.hidden_dropout} has no {family} equivalent and is left out of the export; "
            "inference is unaffected, fine-tuning the export runs without that dropout."
        )
    values = {theirs: copy.deepcopy(getattr(config, ours)) for ours, theirs in fields.items()}
    return target(**values, **(family_fields or {}))


SHARE_INSTEAD = "Share this one as a decoderlab checkpoint instead (it loads anywhere with trust_remote_code=True)."


def llama_config_from_decoderlab(config: DecoderLabConfig) -> LlamaConfig:
    """The LlamaConfig computing exactly what ``config`` computes, or one ValueError listing every field
    Llama cannot express. Models built with ``DecoderLabConfig.from_preset("llama", ...)`` always export."""
    return exported_config(
        config,
        LlamaConfig,
        LLAMA_FIELDS,
        {"qk_norm": (config.qk_norm, "Llama does not normalise queries and keys (--to qwen3 does)")},
        f"Only models built like DecoderLabConfig.from_preset('llama', ...) export to Llama. {SHARE_INSTEAD}",
    )


def qwen3_window_fields(config: DecoderLabConfig) -> dict:
    """Qwen3Config's fields for ``config``'s sliding layers. transformers' Qwen3 reads ``layer_types`` and, on its
    sliding layers, ``sliding_window``, which Qwen3Config keeps only with ``use_sliding_window=True``.
    ``max_window_layers`` is the older way of saying the same (the layers from that index on slide): it is written as
    the first sliding layer, so a layout of full layers then sliding ones reads the same either way. vLLM's own Qwen3
    windows every layer or none, and refuses a mix unless max_window_layers equals the layer count (where it would
    run every layer full): the first sliding layer keeps that refusal. With no sliding layer, no window at all, as
    Qwen3Config itself writes a model without one."""
    sliding = sliding_layers(config.layer_types)
    return {
        "layer_types": list(config.layer_types),
        "use_sliding_window": bool(sliding),
        "sliding_window": config.sliding_window if sliding else None,
        "max_window_layers": sliding[0] if sliding else config.num_hidden_layers,
    }


def qwen3_config_from_decoderlab(config: DecoderLabConfig) -> Qwen3Config:
    """The Qwen3Config computing exactly what ``config`` computes, or one ValueError listing every field Qwen3
    cannot express. Qwen3 is Llama with QK-norm (an RMSNorm over each head's queries and keys, before RoPE,
    with the model's norm_eps), always on, and no MLP biases, and it keeps sliding layers (``layer_types``,
    ``sliding_window``: ``qwen3_window_fields``): ``from_preset("llama", qk_norm=True, ...)`` models without MLP
    biases, the default recipe's among them, always export, sliding layers included."""
    return exported_config(
        config,
        Qwen3Config,
        QWEN3_FIELDS,
        {
            "qk_norm": (
                not config.qk_norm,
                "Qwen3 always normalises each head's queries and keys (True); export this model with --to llama",
            ),
            "mlp_bias": (config.mlp_bias, "Qwen3's MLP has no biases (False)"),
        },
        "Only models built like DecoderLabConfig.from_preset('llama', qk_norm=True, ...) export to Qwen3. "
        + SHARE_INSTEAD,
        qwen3_window_fields(config),
    )


# ----------------------------------------------------------------------------------------------
# Tensors: the name and layout of each source tensor in the target


def split_gpt2_qkv(tensor: torch.Tensor, config: DecoderLabConfig) -> list[torch.Tensor]:
    """GPT-2's ``c_attn`` (3C, C) after the transpose, or its bias (3C,): rows are [q; k; v]."""
    return [part.clone(memory_format=torch.contiguous_format) for part in tensor.chunk(3, dim=0)]


def split_neox_qkv(tensor: torch.Tensor, config: DecoderLabConfig) -> list[torch.Tensor]:
    """GPT-NeoX's ``query_key_value`` (3C, C) or bias (3C,): GPT-NeoX views its output as (B, T, nh, 3 * hs),
    so rows are ordered (head, q/k/v, head_dim), interleaved per head, not [q; k; v]."""
    per_head = tensor.unflatten(0, (config.num_attention_heads, 3, config.head_dim))  # (nh, 3, hs, ...)
    return [per_head[:, i].flatten(0, 1).clone(memory_format=torch.contiguous_format) for i in range(3)]


@dataclass(frozen=True)
class Conversion:
    """One direction: what SRC must hold, and how its config and tensors become the target's."""

    source_type: str  # model_type in SRC's config.json
    source_config: type[PreTrainedConfig]  # parses SRC's config.json, legacy keys included
    target_model: type[PreTrainedModel]  # its weightless skeleton names the expected tensors, writes config.json
    make_config: Callable[[PreTrainedConfig], PreTrainedConfig]
    prefix: str = ""  # stripped from source names before matching
    # regex over the stripped name -> target name; "{}" in a target marks a fused q/k/v tensor, split in three
    renames: dict[str, str] = field(default_factory=lambda: {r"(.+)": r"\1"})
    skipped: str = r"$^"  # buffers older checkpoints saved (causal masks, RoPE tables): not weights
    transposed: str = r"$^"  # weights stored (in, out), as GPT-2's Conv1D does, instead of nn.Linear's (out, in)
    split_qkv: Callable[[torch.Tensor, DecoderLabConfig], list[torch.Tensor]] = split_gpt2_qkv
    # the source config -> factors multiplied into its tensors by name (``mup_folds``); none by default
    folds: Callable[[PreTrainedConfig], dict[str, float]] = lambda config: {}

    def targets(self, name: str) -> list[str] | None:
        """Target names of one source tensor: [] for a skipped buffer, None for a name not understood."""
        name = name.removeprefix(self.prefix)
        if re.fullmatch(self.skipped, name):
            return []
        for pattern, target in self.renames.items():
            if match := re.fullmatch(pattern, name):
                target = match.expand(target)
                return [target.format(part) for part in "qkv"] if "{}" in target else [target]
        return None

    def tensors(self, name: str, tensor: torch.Tensor, config: PreTrainedConfig) -> list[torch.Tensor]:
        """The tensors of ``targets(name)``, in the same order."""
        stripped = name.removeprefix(self.prefix)
        if re.fullmatch(self.transposed, stripped):
            tensor = tensor.t().contiguous()
        if len(self.targets(name)) == 3:
            return self.split_qkv(tensor, config)
        return [tensor]


LAYER = r"(?:h|layers)\.(\d+)"  # GPT-2 calls its blocks h.N, GPT-NeoX layers.N

ROTARY_BUFFERS = r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq"  # what older Llama-shaped files saved


def llama_shaped_source(
    model_type: str, config_class: type[PreTrainedConfig], make_config: Callable[[PreTrainedConfig], DecoderLabConfig]
) -> Conversion:
    """A family with Llama's tensor names, which decoderlab's Llama-shaped model uses (and Qwen3's q_norm / k_norm for
    QK-norm): every tensor keeps its name; the RoPE tables older files saved are skipped."""
    return Conversion(
        source_type=model_type,
        source_config=config_class,
        target_model=DecoderLabForCausalLM,
        make_config=make_config,
        skipped=ROTARY_BUFFERS,
    )


FROM = {
    "llama": llama_shaped_source("llama", LlamaConfig, decoderlab_config_from_llama),
    "qwen3": llama_shaped_source("qwen3", Qwen3Config, decoderlab_config_from_qwen3),
    "mistral": llama_shaped_source("mistral", MistralConfig, decoderlab_config_from_mistral),
    "smollm3": llama_shaped_source("smollm3", SmolLM3Config, decoderlab_config_from_smollm3),
    "gpt2": Conversion(
        source_type="gpt2",
        source_config=GPT2Config,
        target_model=DecoderLabForCausalLM,
        make_config=decoderlab_config_from_gpt2,
        prefix="transformer.",  # GPT2LMHeadModel's; the original Hub files have none
        renames={
            r"wte\.weight": "model.embed_tokens.weight",
            r"wpe\.weight": "model.embed_positions.weight",
            rf"{LAYER}\.ln_1\.(weight|bias)": r"model.layers.\1.input_layernorm.\2",
            rf"{LAYER}\.attn\.c_attn\.(weight|bias)": r"model.layers.\1.self_attn.{}_proj.\2",
            rf"{LAYER}\.attn\.c_proj\.(weight|bias)": r"model.layers.\1.self_attn.o_proj.\2",
            rf"{LAYER}\.ln_2\.(weight|bias)": r"model.layers.\1.post_attention_layernorm.\2",
            rf"{LAYER}\.mlp\.c_fc\.(weight|bias)": r"model.layers.\1.mlp.up_proj.\2",
            rf"{LAYER}\.mlp\.c_proj\.(weight|bias)": r"model.layers.\1.mlp.down_proj.\2",
            r"ln_f\.(weight|bias)": r"model.norm.\1",
            r"lm_head\.weight": "lm_head.weight",
        },
        skipped=rf"{LAYER}\.attn\.(bias|masked_bias)",
        transposed=rf"{LAYER}\.(attn|mlp)\.c_\w+\.weight",
        split_qkv=split_gpt2_qkv,
    ),
    "neox": Conversion(
        source_type="gpt_neox",
        source_config=GPTNeoXConfig,
        target_model=DecoderLabForCausalLM,
        make_config=decoderlab_config_from_neox,
        prefix="gpt_neox.",
        renames={
            r"embed_in\.weight": "model.embed_tokens.weight",
            rf"{LAYER}\.(input_layernorm|post_attention_layernorm)\.(weight|bias)": r"model.layers.\1.\2.\3",
            rf"{LAYER}\.attention\.query_key_value\.(weight|bias)": r"model.layers.\1.self_attn.{}_proj.\2",
            rf"{LAYER}\.attention\.dense\.(weight|bias)": r"model.layers.\1.self_attn.o_proj.\2",
            rf"{LAYER}\.mlp\.dense_h_to_4h\.(weight|bias)": r"model.layers.\1.mlp.up_proj.\2",
            rf"{LAYER}\.mlp\.dense_4h_to_h\.(weight|bias)": r"model.layers.\1.mlp.down_proj.\2",
            r"final_layer_norm\.(weight|bias)": r"model.norm.\1",
            r"(?:embed_out|lm_head)\.weight": "lm_head.weight",  # Pythia's files say embed_out
        },
        skipped=rf"{LAYER}\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",
        split_qkv=split_neox_qkv,
    ),
}

# identical names again: the refusal in llama_config_from_decoderlab leaves only Llama-shaped models
TO_LLAMA = Conversion(
    source_type=DecoderLabConfig.model_type,
    source_config=DecoderLabConfig,
    target_model=LlamaForCausalLM,
    make_config=llama_config_from_decoderlab,
    folds=mup_folds,
)
# the same names, q_norm and k_norm included: decoderlab's QK-norm weights are Qwen3's
TO_QWEN3 = Conversion(
    source_type=DecoderLabConfig.model_type,
    source_config=DecoderLabConfig,
    target_model=Qwen3ForCausalLM,
    make_config=qwen3_config_from_decoderlab,
    folds=mup_folds,
)


# ----------------------------------------------------------------------------------------------
# The conversion


def read_source_config(folder: Path, conversion: Conversion, flag: str) -> PreTrainedConfig:
    """SRC's config, after checking that it is the family ``flag`` (the CLI option) expects."""
    found = config_json(folder).get("model_type")
    if found != conversion.source_type:
        hint = next((f" Use --from {name}." for name, c in FROM.items() if c.source_type == found), "")
        hint = f" {REFUSED_SOURCES[found]}" if found in REFUSED_SOURCES else hint
        raise ValueError(
            f"{folder} holds a {found!r} checkpoint (config.json model_type), but {flag} expects "
            f"{conversion.source_type!r}.{hint}"
        )
    return conversion.source_config.from_pretrained(folder)


def expected_names(model: PreTrainedModel) -> set[str]:
    """The tensor names ``save_pretrained`` writes for ``model``: its state dict minus tied copies."""
    names = set(model.state_dict())
    if model.config.tie_word_embeddings:
        names -= set(model._tied_weights_keys or {})
    return names


def plan_tensors(reader: CheckpointReader, conversion: Conversion, skeleton: PreTrainedModel) -> dict[str, list]:
    """Source name -> target names, checked against the target model before anything is written."""
    expected = expected_names(skeleton)
    tied_copies = set(skeleton._tied_weights_keys or {}) if skeleton.config.tie_word_embeddings else set()
    plan, unknown = {}, []
    for name in reader.names():
        targets = conversion.targets(name)
        if targets is None:
            unknown.append(name)
        else:
            plan[name] = [t for t in targets if t not in tied_copies]  # a tied lm_head is the embedding again
    produced = [t for targets in plan.values() for t in targets]
    missing = sorted(expected - set(produced))
    unexpected = sorted(set(produced) - expected)
    duplicated = sorted(t for t, n in Counter(produced).items() if n > 1)
    problems = {
        "tensors this converter does not understand": unknown,
        "tensors the target model has no place for": unexpected,
        "tensors the target model needs but SRC lacks": missing,
        "tensors SRC provides twice": duplicated,
    }
    if any(problems.values()):
        details = "; ".join(
            f"{what}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
            for what, names in problems.items()
            if names
        )
        raise ValueError(
            f"{reader.folder} does not match a {conversion.source_type!r} checkpoint of its config.json: {details}."
        )
    return plan


def make_skeleton(model_class: type[PreTrainedModel], config: PreTrainedConfig, dtype) -> PreTrainedModel:
    """The target model without weights (meta device): names the tensors and writes config.json and code."""
    with torch.device("meta"):
        model = model_class(config)
    return model.to(dtype or torch.float32)  # save_pretrained records the parameters' dtype in config.json


def prepare_destination(dst: str | os.PathLike, src: Path) -> Path:
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"DST {str(dst)!r} exists and is not an empty folder; choose a new one.")
    if dst.resolve() == src.resolve():
        raise ValueError("DST must differ from SRC.")
    return dst


def convert(
    conversion: Conversion,
    src: str | os.PathLike,
    dst: str | os.PathLike,
    flag: str,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Convert the checkpoint in SRC with ``conversion`` into the new folder DST; returns DST."""
    max_shard_size = convert_file_size_to_int(max_shard_size)
    src_dir = resolve_source(src)
    dst = prepare_destination(dst, src_dir)
    source_config = read_source_config(src_dir, conversion, flag)
    config = conversion.make_config(source_config)
    folds = conversion.folds(source_config)  # after make_config's refusals
    skeleton = make_skeleton(conversion.target_model, config, source_config.dtype)
    with CheckpointReader(src_dir) as reader:
        plan = plan_tensors(reader, conversion, skeleton)
        dst.mkdir(parents=True, exist_ok=True)
        skeleton.save_pretrained(dst, state_dict={})  # config.json, generation_config.json, code; no weights
        writer = ShardWriter(dst, max_shard_size)
        for name, targets in plan.items():
            if targets:
                for target, tensor in zip(targets, conversion.tensors(name, reader[name], config)):
                    writer.add(target, fold(name, tensor, folds))
        writer.close()
    carried = [name for name in TOKENIZER_FILES if (src_dir / name).is_file()]
    for name in carried:
        shutil.copyfile(src_dir / name, dst / name)
    logger.info(
        f"Wrote {type(skeleton).__name__} ({writer.total_bytes / 1e6:.1f} MB in {len(writer.shards)} shard(s)) "
        f"to {dst}; carried over: {', '.join(carried) or 'no tokenizer files'}."
    )
    return dst


def convert_from(
    family: str, src: str | os.PathLike, dst: str | os.PathLike, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> Path:
    """A ``llama`` (LlamaForCausalLM), ``qwen3`` (Qwen3ForCausalLM), ``mistral`` (MistralForCausalLM), ``smollm3``
    (SmolLM3ForCausalLM), ``gpt2`` (GPT2LMHeadModel) or ``neox`` (GPTNeoXForCausalLM) checkpoint in SRC (folder or Hub
    repo id) -> a decoderlab checkpoint in the new folder DST, loadable with
    ``AutoModelForCausalLM.from_pretrained(DST)`` and computing the same, sliding windows and RoPE-free layers
    included. Returns DST.

    Raises ValueError, before anything is written, for a family decoderlab cannot compute (``REFUSED_SOURCES``:
    ``gpt_oss``) and for a setting of SRC's config that decoderlab has no switch for, each named."""
    if family in REFUSED_SOURCES:
        raise ValueError(REFUSED_SOURCES[family])
    if family not in FROM:
        raise ValueError(f"Unknown source family {family!r}; choose one of {', '.join(map(repr, FROM))}.")
    return convert(FROM[family], src, dst, f"--from {family}", max_shard_size)


def convert_to_llama(
    src: str | os.PathLike, dst: str | os.PathLike, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> Path:
    """A decoderlab checkpoint in SRC -> a plain Llama checkpoint in the new folder DST, which loads with
    ``AutoModelForCausalLM.from_pretrained(DST)`` and no remote code. Returns DST.

    Raises ValueError listing every field that Llama cannot express (see ``llama_config_from_decoderlab``)."""
    return convert(TO_LLAMA, src, dst, "--to llama", max_shard_size)


def convert_to_qwen3(
    src: str | os.PathLike, dst: str | os.PathLike, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> Path:
    """A decoderlab checkpoint with QK-norm in SRC (the default recipe's) -> a plain Qwen3 checkpoint in the new
    folder DST, which loads with ``AutoModelForCausalLM.from_pretrained(DST)`` and no remote code. Returns DST.

    Raises ValueError listing every field that Qwen3 cannot express (see ``qwen3_config_from_decoderlab``)."""
    return convert(TO_QWEN3, src, dst, "--to qwen3", max_shard_size)
