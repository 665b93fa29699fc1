"""DecoderLab configuration: every mechanism of the decoder is a field here, validated once.

This file travels inside checkpoints (``trust_remote_code``), so it imports only ``transformers``
and ``huggingface_hub`` (which transformers depends on), and ``compat_decoderlab.py`` beside it.
"""

# First: on an unsupported transformers, its version check raises one clear error before an import below fails
from .compat_decoderlab import OUTPUT_CACHE_FIELD  # isort: skip

import copy
import difflib
import functools
import math
import types
import typing
from typing import Literal

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers import GenerationConfig, PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters
from transformers.utils import logging

logger = logging.get_logger(__name__)

PositionEmbeddingType = Literal["rope", "sinusoidal", "learned", "none"]
NormPlacement = Literal["pre", "post", "sandwich"]
NormType = Literal["layernorm", "rmsnorm"]
MlpType = Literal["gated", "plain"]
HiddenAct = Literal["gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish", "tanh", "relu2"]
Parametrization = Literal["standard", "mup"]
# each layer's attention (layer_types' entries): transformers' names, which its masks and caches read
LayerType = Literal["full_attention", "sliding_attention"]


# muP's base model (mup_base_shapes): the sizes besides hidden_size (mup_base_width) that a matrix's sides are made of
MUP_BASE_SHAPE_FIELDS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def _choices(literal) -> tuple[str, ...]:
    return typing.get_args(literal)


def is_mup(config) -> bool:
    """Whether ``config`` (a DecoderLabConfig, another model's config, or None) is in the maximal update
    parametrization: the one test of it every module uses."""
    return getattr(config, "parametrization", "standard") == "mup"


@strict
class DecoderLabConfig(PreTrainedConfig):
    """Configuration of a DecoderLab decoder-only language model.

    Every mechanism of the decoder is a field (sizes, attention, positions, normalisation, MLP, the rest), with
    Hugging Face's standard name wherever one exists; each field's docstring says what it does. The config
    validates itself once, when it is built: a bad value raises ``ValueError`` naming the field, the value and
    what is allowed. ``DecoderLabConfig.from_preset`` builds the named architectures (Llama, GPT-2, GPT-NeoX, the
    original Transformer) at named sizes.
    """

    model_type = "decoderlab"
    keys_to_ignore_at_inference = [OUTPUT_CACHE_FIELD]  # the outputs' cache: "past_key_values" before 5.24
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    # sizes
    vocab_size: int = 32000
    """Tokens in the vocabulary: the rows of ``embed_tokens`` and ``lm_head``."""
    hidden_size: int = 768
    """Width of the residual stream, C."""
    num_hidden_layers: int = 12
    """Decoder blocks."""
    num_attention_heads: int = 12
    """Query heads."""
    num_key_value_heads: int | None = None
    """Key/value heads (``None``: ``num_attention_heads``). Equal to the query heads is multi-head attention, fewer is
    grouped-query attention (Ainslie et al. 2023), 1 is multi-query attention (Shazeer 2019); it must divide the
    query heads."""
    head_dim: int | None = None
    """Width of each head (``None``: ``hidden_size // num_attention_heads``); set it to decouple the heads from C."""
    intermediate_size: int | None = None
    """MLP width (``None``: 4C for the plain MLP, 8C/3 rounded up to a multiple of 64 for the gated one, which gives
    the two about the same parameter count)."""
    max_position_embeddings: int = 2048
    """Longest sequence for learned and sinusoidal positions (longer input raises ``ValueError``); the reference length
    of RoPE scaling."""
    # attention
    attention_scale: float | None = None
    """The factor in softmax(Q K^T * scale) V (``None``: 1/sqrt(head_dim), Vaswani et al. 2017); ``1.0`` turns scaling
    off."""
    qk_norm: bool = False
    """Normalise each head's queries and keys (with ``norm_type``) before RoPE, as OLMo 2 and Qwen 3 do."""
    attention_bias: bool = False
    """Biases on ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj``."""
    attention_dropout: float = 0.0
    """Dropout on the attention weights, in training."""
    value_residual: bool = False
    """Every layer after the first mixes the first layer's values into its own, v <- v + l (v_1 - v), with l a learned
    scalar per layer, 0.5 at first (Zhou et al. 2024; modded-nanogpt, record of 2024-11-06): later layers keep access
    to the tokens' own values."""
    layer_types: list[str] | None = None
    """Each layer's attention, one entry per layer (``None``: ``"full_attention"`` on every layer).
    ``"full_attention"``: a query attends to every token up to itself. ``"sliding_attention"``: only to the last
    ``sliding_window`` tokens, itself included (Beltagy et al. 2020, Longformer; Mistral 7B, Jiang et al. 2023, on
    every layer; Gemma 2 alternates the two). transformers' names (Qwen3, Gemma 2): its masking utilities build each
    kind's mask, and ``DynamicCache(config=...)`` keeps only the last ``sliding_window - 1`` keys and values of a
    sliding layer, so its cache stays bounded however long the text grows."""
    sliding_window: int | None = None
    """How many tokens a ``"sliding_attention"`` layer's query sees: itself and the ``sliding_window - 1`` tokens
    before it (transformers' definition). Needed when ``layer_types`` has a sliding layer; read by nothing else, so
    with every layer full it changes nothing (as in Qwen3's config; transformers' tools set it on any config that has
    the field). Mistral's one window for every layer is ``layer_types=["sliding_attention"] * num_hidden_layers``."""
    attention_sinks: bool = False
    """A learned logit s_h per query head joins each softmax's denominator and is then dropped (gpt-oss's ``sinks``,
    OpenAI 2025; a learned form of the attention sinks of Xiao et al. 2024): the weights are exp(l_j) / (exp(s_h) +
    sum_k exp(l_k)), so a head can give its tokens less than all of its attention, down to none. Each layer's
    ``self_attn.sinks`` has ``num_attention_heads`` entries, drawn as gpt-oss draws them (normal, std
    ``initializer_range``). Runs with ``attn_implementation="eager"``, which such a model picks by default: sdpa and
    flex attention normalise inside their kernels, where no term can join the denominator, so they are refused."""
    # positions
    position_embedding_type: PositionEmbeddingType = "rope"
    """``"rope"`` rotary (Su et al. 2021), ``"sinusoidal"`` (Vaswani et al. 2017), ``"learned"`` absolute (GPT-2) or
    ``"none"`` (NoPE: causal masking alone)."""
    rope_parameters: RopeParameters | dict | None = None
    """RoPE settings in transformers' format (``None``: ``{"rope_type": "default", "rope_theta": 10000.0}``):
    ``rope_theta``, ``partial_rotary_factor`` (the fraction of each head that rotates, GPT-NeoX) and the scaling
    types of ``transformers.modeling_rope_utils`` (linear, dynamic, yarn, longrope, llama3) with their keys. The
    legacy ``rope_theta=``, ``partial_rotary_factor=`` and ``rope_scaling=`` keywords are accepted and moved here. A
    config without RoPE has no ``rope_parameters``."""
    no_rope_layers: list[int] | None = None
    """Which layers rotate their queries and keys, one entry per layer as SmolLM3 writes it: 1 = this layer applies
    RoPE, 0 = it skips RoPE and sees positions only through causal masking (NoPE layers between RoPE layers: SmolLM3,
    Hugging Face 2025; Yang et al. 2025, "Rope to Nope and Back Again"). ``None``: from ``no_rope_layer_interval``,
    or 1 on every layer. Only with ``position_embedding_type="rope"``; a config without RoPE has none."""
    no_rope_layer_interval: int | None = None
    """SmolLM3's shorthand for ``no_rope_layers``: every n-th layer (the n-th, 2n-th, ..., counting from 1) skips
    RoPE, no_rope_layers[i] = int((i + 1) % n != 0). ``None``: RoPE on every layer (SmolLM3's own default is 4;
    decoderlab's keeps the plain model). Given together, the two must agree."""
    # normalisation
    norm_placement: NormPlacement = "pre"
    """``"pre"``: x + f(LN(x)) (GPT-2, Llama; stable, Xiong et al. 2020); ``"post"``: LN(x + f(x)) (the original
    Transformer; needs warmup when deep); ``"sandwich"``: x + LN(f(LN(x))) (CogView, Gemma 2)."""
    norm_type: NormType = "rmsnorm"
    """``"rmsnorm"`` (Zhang & Sennrich 2019) or ``"layernorm"``."""
    norm_eps: float = 1e-5
    """Epsilon of every norm."""
    norm_bias: bool = True
    """Bias of LayerNorm (RMSNorm has none)."""
    use_parallel_residual: bool = False
    """The GPT-J / GPT-NeoX block, x + Attn(LN_1(x)) + MLP(LN_2(x)); needs ``norm_placement="pre"``."""
    # MLP
    mlp_type: MlpType = "gated"
    """``"gated"``: down(act(gate(x)) * up(x)) (SwiGLU with silu, Shazeer 2020); ``"plain"``: down(act(up(x)))."""
    hidden_act: HiddenAct = "silu"
    """The MLP's activation: ``gelu`` (exact), ``gelu_new`` / ``gelu_pytorch_tanh`` (GPT-2's tanh approximation),
    ``relu``, ``relu2``, ``silu`` / ``swish``, ``tanh``."""
    mlp_bias: bool = False
    """Biases on the MLP projections."""
    # other
    embedding_multiplier: float = 1.0
    """Factor on the token embeddings, applied before absolute positions are added: sqrt(hidden_size) in the original
    Transformer (Vaswani et al. 2017, section 3.4; Gemma too). Part of ``embed_tokens``, as in transformers' Gemma,
    so ``get_input_embeddings()(ids)`` is scaled and ``inputs_embeds`` passed in are used as they are. ``1.0``
    builds a plain ``nn.Embedding``."""
    hidden_dropout: float = 0.0
    """Dropout on the embeddings and on each sublayer's output, in training."""
    tie_word_embeddings: bool = False
    """Share ``lm_head.weight`` with ``embed_tokens.weight``."""
    initializer_range: float | None = None
    """Standard deviation of the normal initialisation (``None``: 0.02, GPT-2's; under muP the standard deviation at
    the base width, ``None``: 1/sqrt(mup_base_width), Tensor Programs V's variance 1/fan_in there, which muP's 1/sqrt(m)
    carries to every width. A base model's 0.02 is GPT-2's value for width 768: at a base width of 64 it starts
    every hidden matrix 6x colder than 1/sqrt(fan_in), and muP keeps it that cold at every width)."""
    scale_residual_init: bool = True
    """GPT-2's initialisation of the residual output projections (``o_proj``, ``down_proj``): std / sqrt(2 x layers).
    Drawn on the projections themselves, so it holds on every transformers release; saved checkpoints are not
    affected."""
    zero_residual_init: bool = False
    """Start the residual output projections (``o_proj``, ``down_proj``) at zero, so every block begins as the
    identity and its output grows from there (modded-nanogpt, record of 2024-10-14); their biases start at zero too.
    Only the start of training changes, and it wins over ``scale_residual_init`` (a scaled zero is zero)."""
    embedding_initializer_range: float | None = None
    """Standard deviation of the token embeddings' initialisation (``None``: ``initializer_range``; a tied ``lm_head``
    is the same matrix). Only the start of training changes: every other weight draws what it would have drawn."""
    parametrization: Parametrization = "standard"
    """``"standard"``: the usual parametrization, whose best learning rate drifts as ``hidden_size`` grows.
    ``"mup"``: the maximal update parametrization (Yang et al. 2022, "Tensor Programs V", Table 8), so that the
    learning rate and initialisation tuned at ``mup_base_width`` stay right at any width. With the width multiplier
    m = hidden_size / mup_base_width: the hidden matrices (q/k/v/o and the MLP's projections) draw with std
    ``initializer_range`` / sqrt(m) and train at the learning rate / m under Adam (the training scripts'
    ``training/optim.py``); the attention scale is sqrt(base head_dim)/head_dim instead of 1/sqrt(head_dim)
    (``mup_attention_multiplier``; unless ``attention_scale`` is set: then that fixed factor is used at every width); the logits are multiplied by
    ``mup_output_multiplier`` / m (``logit_scale``), in the forward pass, so a tied ``lm_head`` works. Embeddings,
    an untied ``lm_head``, norms and biases keep their initialisation and learning rate. Each matrix takes m from its
    own sides (``mup_base_shapes``: every dimension grows with ``hidden_size`` unless it says otherwise);
    ``roles_decoderlab.py`` has the table."""
    mup_base_width: int | None = None
    """muP's base width: the ``hidden_size`` the learning rate and initialisation were tuned at (needed with
    ``parametrization="mup"``, from 1 to ``hidden_size``; read by nothing else). At ``hidden_size ==
    mup_base_width`` a muP model is the standard one."""
    mup_base_shapes: dict | None = None
    """muP's base model: its ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads`` and ``head_dim``
    (its ``hidden_size`` is ``mup_base_width``). Each matrix's width multipliers are its own sides' widths over the base
    model's (Tensor Programs V; microsoft/mup's base shapes), so a dimension that does not grow with ``hidden_size``
    (a fixed ``intermediate_size``, fixed key/value heads) is stated here and gets its own factors. A size left out
    grows with ``hidden_size``: the base value is this model's times mup_base_width / hidden_size (possibly not a
    whole number: only the ratios are used). Under muP the config records the complete base shapes, so a checkpoint
    says which base it was tuned at; read only with ``parametrization="mup"``."""
    mup_output_multiplier: float = 1.0
    """muP's output multiplier alpha_out, tuned at the base width like a learning rate: the logits are multiplied by
    alpha_out / m. Read only with ``parametrization="mup"``."""
    mup_attention_multiplier: float | None = None
    """muP's attention multiplier alpha_attn: the attention scale is alpha_attn / head_dim (Tensor Programs V, section
    4; microsoft/mup's ``attn_mult``). ``None``: sqrt of the base model's head_dim (``mup_base_shapes``), so that at
    its base width a muP model attends exactly as the standard one, 1/sqrt(head_dim), and heads wider than the base's
    go as 1/head_dim from there (where the heads grow in number and keep their width, the base shapes' default, the
    scale stays the standard one). 1.0 is the uncorrected 1/head_dim, which at the base width already scales the logits down by
    sqrt(head_dim): the rule of muP checkpoints saved before base shapes were recorded, which keep it when loaded.
    Read only with ``parametrization="mup"``."""
    final_logit_softcapping: float | None = None
    """Soft-cap the logits, z -> c * tanh(z / c) with c this value, right after ``lm_head`` (Gemma 2's field: the loss
    and generation both see the capped logits); ``None``: logits as they are. A logit can then never exceed c in
    size, and logits well below c pass nearly unchanged (modded-nanogpt caps at 30, later 15)."""
    use_cache: bool = True
    """Return a KV cache from ``forward`` (generation uses one either way); a training-mode forward with gradients
    builds none unless passed ``use_cache=True``."""
    pad_token_id: int | None = None
    """Padding token, as in every transformers config."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token, or several."""

    def __post_init__(self, **kwargs):
        _check_keywords(kwargs)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}: pick sizes that divide, or set head_dim explicitly."
                )
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        if self.layer_types is None:  # resolved here, as Qwen3's config does: one entry per layer
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.intermediate_size is None:
            if self.mlp_type == "gated":
                self.intermediate_size = 64 * -(-8 * self.hidden_size // (3 * 64))
            else:
                self.intermediate_size = 4 * self.hidden_size
        super().__post_init__(**kwargs)  # standardises rope_parameters (rope_theta, rope_scaling kwargs)
        if self.position_embedding_type != "rope":
            # Nothing rotates: like GPT2Config, the config has no rope_parameters at all, so that tools that look
            # for RoPE settings (transformers' RoPE utilities, serving engines' RoPE scaling) find none
            del self.rope_parameters
        self._check()

    def _check(self) -> None:
        """Validate every field once; each error names the field, the value and what is allowed.

        Not a ``validate_*`` method on purpose: ``@strict`` would wrap those errors in its own
        exception types, and users catch ``ValueError``.
        """
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by num_key_value_heads="
                f"{self.num_key_value_heads}: each key/value head must serve a whole group of query heads."
            )
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}.")
        if self.attention_scale is not None and self.attention_scale <= 0:
            raise ValueError(
                f"attention_scale must be positive (1.0 turns scaling off) or None for 1/sqrt(head_dim), "
                f"got {self.attention_scale}."
            )
        if not (math.isfinite(self.embedding_multiplier) and self.embedding_multiplier > 0):
            raise ValueError(
                f"embedding_multiplier must be a finite positive number (1.0 leaves the embeddings as they are), "
                f"got {self.embedding_multiplier}."
            )
        for name in ("initializer_range", "embedding_initializer_range"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite standard deviation >= 0, got {value}.")
        cap = self.final_logit_softcapping
        if cap is not None and not (math.isfinite(cap) and cap > 0):
            raise ValueError(
                f"final_logit_softcapping must be a positive number, the cap c of c * tanh(logits / c) (None: no "
                f"cap), got {cap}."
            )
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}.")
        if self.use_parallel_residual and self.norm_placement != "pre":
            raise ValueError(
                f"use_parallel_residual=True needs norm_placement='pre' (GPT-NeoX's block), "
                f"got norm_placement={self.norm_placement!r}."
            )
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not an activation transformers knows.")
        if self.position_embedding_type == "rope":
            self._check_rope()
        self._check_layer_types()
        self.no_rope_layers = self._resolve_no_rope_layers()
        self._check_parametrization()
        if self.initializer_range is None:
            self.initializer_range = self.mup_base_width**-0.5 if is_mup(self) else 0.02

    def _check_layer_types(self) -> None:
        n, window = self.num_hidden_layers, self.sliding_window
        if len(self.layer_types) != n:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, but num_hidden_layers={n}: give one attention type "
                "per layer, or leave layer_types out for full attention on every layer."
            )
        allowed = _choices(LayerType)
        for i, kind in enumerate(self.layer_types):
            if kind not in allowed:
                raise ValueError(
                    f"layer_types[{i}]={kind!r} is not an attention type decoderlab builds; allowed: "
                    f"{', '.join(map(repr, allowed))}."
                )
        sliding = [i for i, kind in enumerate(self.layer_types) if kind == "sliding_attention"]
        if window is not None and (isinstance(window, bool) or window < 1):
            raise ValueError(
                f"sliding_window must be a positive number of tokens (a sliding layer's query sees itself and the "
                f"sliding_window - 1 tokens before it), got {window!r}."
            )
        if sliding and window is None:
            raise ValueError(
                f"layer_types makes layers {sliding} 'sliding_attention', but sliding_window is None: set "
                "sliding_window, how many tokens each of their queries sees (itself included)."
            )

    def _resolve_no_rope_layers(self) -> list[int] | None:
        """``no_rope_layers`` checked and complete (from ``no_rope_layer_interval`` as SmolLM3's config derives it,
        else 1 on every layer); None without RoPE."""
        n, given, interval = self.num_hidden_layers, self.no_rope_layers, self.no_rope_layer_interval
        if interval is not None and (isinstance(interval, bool) or interval < 1):
            raise ValueError(
                f"no_rope_layer_interval must be a positive integer (every n-th layer skips RoPE), got {interval!r}."
            )
        from_interval = None if interval is None else [int((i + 1) % interval != 0) for i in range(n)]
        if given is not None:
            if len(given) != n:
                raise ValueError(
                    f"no_rope_layers has {len(given)} entries, but num_hidden_layers={n}: give one per layer, 1 where "
                    "the layer applies RoPE and 0 where it skips it (SmolLM3's convention)."
                )
            for i, value in enumerate(given):
                if value not in (0, 1):
                    raise ValueError(
                        f"no_rope_layers[{i}]={value!r}: each entry is 1 (the layer applies RoPE) or 0 (it skips "
                        "RoPE), as SmolLM3 writes it."
                    )
            if from_interval is not None and [int(v) for v in given] != from_interval:
                raise ValueError(
                    f"no_rope_layers={list(given)} and no_rope_layer_interval={interval} disagree (the interval gives "
                    f"{from_interval}): pass one of them."
                )
        if self.position_embedding_type != "rope":
            skipping = "no_rope_layer_interval" if interval is not None else None
            if skipping is None and 0 in (given or []):
                skipping = "no_rope_layers"
            if skipping is not None:
                raise ValueError(
                    f"{skipping}={getattr(self, skipping)!r} makes layers skip RoPE, but position_embedding_type="
                    f"{self.position_embedding_type!r} rotates no layer: use position_embedding_type='rope', or leave "
                    f"{skipping} out."
                )
            return None  # nothing rotates, so there is nothing to list (as rope_parameters, which such a config lacks)
        if given is not None:
            return [int(v) for v in given]
        return from_interval if from_interval is not None else [1] * n

    def _check_parametrization(self) -> None:
        if not is_mup(self):
            given = [f"{name}={getattr(self, name)!r}" for name, unset in (("mup_base_width", None),
                     ("mup_base_shapes", None), ("mup_output_multiplier", 1.0), ("mup_attention_multiplier", None))
                     if getattr(self, name) != unset]  # fmt: skip
            if given:
                raise ValueError(
                    f"{' and '.join(given)} {'are' if len(given) > 1 else 'is'} read only with parametrization='mup', "
                    f"but parametrization={self.parametrization!r}: set parametrization='mup', or leave "
                    f"{'them' if len(given) > 1 else 'it'} out."
                )
            return
        if self.mup_base_width is None:
            raise ValueError(
                "parametrization='mup' needs mup_base_width, the hidden_size the learning rate was tuned at "
                f"(from 1 to hidden_size={self.hidden_size}; e.g. mup_base_width=128 for a rate tuned at the nano size)."
            )
        if not 1 <= self.mup_base_width <= self.hidden_size:
            raise ValueError(
                f"mup_base_width must be from 1 to hidden_size={self.hidden_size} (the width the hyperparameters were "
                f"tuned at, no wider than this model), got {self.mup_base_width}."
            )
        if not (math.isfinite(self.mup_output_multiplier) and self.mup_output_multiplier > 0):
            raise ValueError(
                f"mup_output_multiplier must be a finite positive number (1.0: the logits are divided by the width "
                f"multiplier alone), got {self.mup_output_multiplier}."
            )
        attention = self.mup_attention_multiplier
        if attention is not None and not (math.isfinite(attention) and attention > 0):
            raise ValueError(
                f"mup_attention_multiplier must be a finite positive number (None: sqrt of the base head_dim, the "
                f"standard scale at the base width), got {attention}."
            )
        self.mup_base_shapes = self._resolve_base_shapes()
        if self.final_logit_softcapping is not None:
            # here the cap acts on the logits after muP's factor, c * tanh(s * z / c); vLLM, which reads both fields,
            # caps first and scales after, s * c * tanh(z / c): the same checkpoint would be another model there
            raise ValueError(
                f"final_logit_softcapping={self.final_logit_softcapping} with parametrization='mup' is not supported: "
                "decoderlab caps the logits after muP's factor (logit_scale), vLLM before it, so the two would serve "
                "different models. Use one of them: final_logit_softcapping=None, or parametrization='standard'."
            )

    def _resolve_base_shapes(self) -> dict:
        """``mup_base_shapes`` complete: the sizes given, checked, and the others grown with ``hidden_size``."""
        given = dict(self.mup_base_shapes or {})
        unknown = sorted(set(given) - set(MUP_BASE_SHAPE_FIELDS))
        if unknown:
            raise ValueError(
                f"mup_base_shapes has no size {', '.join(map(repr, unknown))}: it gives the base model's "
                f"{', '.join(MUP_BASE_SHAPE_FIELDS)} (its hidden_size is mup_base_width)."
            )
        for name, value in given.items():
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"mup_base_shapes[{name!r}] must be a positive number, got {value!r}.")
        ratio = self.mup_base_width / self.hidden_size
        grown = {name: getattr(self, name) * ratio for name in MUP_BASE_SHAPE_FIELDS}
        grown["head_dim"] = self.head_dim  # the heads grow in number, each as wide as before (the named sizes' way)
        resolved = {name: given.get(name, grown[name]) for name in MUP_BASE_SHAPE_FIELDS}
        return {name: int(v) if float(v).is_integer() else v for name, v in resolved.items()}

    @property
    def mup_width_multiplier(self) -> float:
        """muP's m = hidden_size / mup_base_width; 1.0 for the standard parametrization."""
        return self.hidden_size / self.mup_base_width if is_mup(self) else 1.0

    @property
    def mup_widths(self) -> dict[str, float]:
        """How many times wider each width of the model is than in muP's base model: ``hidden_size``,
        ``intermediate_size``, ``attention`` (heads x head_dim) and ``key_value`` (key/value heads x head_dim); every one
        1.0 in the standard parametrization. A matrix's sides are two of these (``parameter_roles``)."""
        if not is_mup(self):
            return dict.fromkeys(("hidden_size", "intermediate_size", "attention", "key_value"), 1.0)
        base = self.mup_base_shapes
        return {
            "hidden_size": self.hidden_size / self.mup_base_width,
            "intermediate_size": self.intermediate_size / base["intermediate_size"],
            "attention": self.num_attention_heads * self.head_dim / (base["num_attention_heads"] * base["head_dim"]),
            "key_value": self.num_key_value_heads * self.head_dim / (base["num_key_value_heads"] * base["head_dim"]),
        }

    @property
    def logit_scale(self) -> float:
        """The factor on the logits: ``mup_output_multiplier`` / m under muP (Tensor Programs V, Table 8), 1.0
        otherwise. Cohere's configs name their logit factor so; vLLM's Transformers backend reads it by that name."""
        if not is_mup(self):
            return 1.0
        return self.mup_output_multiplier / self.mup_width_multiplier

    @property
    def default_attention_scale(self) -> float:
        """The attention scale when ``attention_scale`` is unset: 1/sqrt(head_dim) (Vaswani et al. 2017: q.k has
        variance near 1 for unit-variance q, k); under muP alpha_attn/head_dim (Yang et al. 2022, section 4: training
        correlates q with k, and q.k then grows like head_dim), with alpha_attn = ``mup_attention_multiplier``, by
        default sqrt(base head_dim): the standard scale at the base width."""
        if not is_mup(self):
            return self.head_dim**-0.5
        attention = self.mup_attention_multiplier
        return (attention if attention is not None else self.mup_base_shapes["head_dim"] ** 0.5) / self.head_dim

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """transformers' ``from_dict`` (what ``from_pretrained`` and the Auto classes call), which keeps the function
        of a muP checkpoint saved before ``mup_base_shapes`` was recorded: such a config.json has no
        ``mup_base_shapes`` key, and its attention scale was 1/head_dim, so it loads with
        ``mup_attention_multiplier=1.0`` (unless it or the caller sets one)."""
        saved_before = (
            config_dict.get("parametrization") == "mup"
            and "mup_base_shapes" not in config_dict
            and config_dict.get("mup_attention_multiplier") is None
            and "mup_attention_multiplier" not in kwargs
        )
        if saved_before:
            config_dict = {**config_dict, "mup_attention_multiplier": 1.0}
        return super().from_dict(config_dict, **kwargs)

    def validate_rope(self) -> None:
        """transformers' RoPE checks (which ``@strict`` runs on every config) concern RoPE configs only:
        without rotation an odd head_dim is fine."""
        if self.position_embedding_type == "rope":
            super().validate_rope()

    def _check_rope(self) -> None:
        rope = self.rope_parameters
        rope_types = ("default", *ROPE_INIT_FUNCTIONS)
        if rope.get("rope_type") not in rope_types:
            raise ValueError(
                f"rope_parameters['rope_type']={rope.get('rope_type')!r} is not a RoPE type transformers "
                f"provides; allowed: {', '.join(map(repr, rope_types))}."
            )
        factor = rope.get("partial_rotary_factor", 1.0)
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}.")
        rotary_dim = int(self.head_dim * factor)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"RoPE rotates pairs of dimensions, so the rotary dimension head_dim * partial_rotary_factor "
                f"= {self.head_dim} * {factor} -> {rotary_dim} must be even and at least 2."
            )
        if rope.get("rope_theta") is None or rope["rope_theta"] <= 0:
            raise ValueError(f"rope_theta must be positive, got {rope.get('rope_theta')}.")
        try:
            self.validate_rope()  # transformers' own checks of each scaling type's keys
        except KeyError as err:  # e.g. rope_type="linear" without "factor"
            raise ValueError(f"rope_parameters={rope}: {err.args[0]}") from err

    @classmethod
    def from_preset(cls, name: str, size: str | None = None, **overrides) -> "DecoderLabConfig":
        """A named architecture (``PRESETS``), optionally at a named size (``SIZES``), plus overrides.

        ``DecoderLabConfig.from_preset("llama", "tiny", vocab_size=65)``. Each keyword replaces the
        preset's field whole (``rope_parameters={...}`` replaces the preset's dict, it is not merged).

        =========  =====================================================================================
        llama      pre-RMSNorm, RoPE, SwiGLU MLP, no biases, untied embeddings; GQA via num_key_value_heads
        gpt2       pre-LayerNorm, learned positions (1024), GELU (tanh approximation) MLP, biases, tied
        neox       Pythia: pre-LayerNorm, RoPE on 25% of each head, parallel residual, GELU MLP, biases
        vaswani    the original decoder: post-LayerNorm, sinusoidal positions, ReLU MLP, tied embeddings
                   multiplied by sqrt(hidden_size) (at the hidden_size the preset is built with)
        =========  =====================================================================================

        Sizes (layers x hidden x heads): ``nano`` 4 x 128 x 4 (nanoGPT's CPU recipe), ``tiny``
        6 x 384 x 6 (nanoGPT's Shakespeare recipe), ``small`` 12 x 768 x 12 (GPT-2 small). Presets fix
        the architecture only: dropout stays 0 (GPT-2 and Vaswani et al. trained with 0.1) and the
        vocabulary stays 32000 unless overridden.
        """
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}; choose one of {', '.join(map(repr, PRESETS))}.")
        if size is not None and size not in SIZES:
            raise ValueError(
                f"Unknown size {size!r}; choose one of {', '.join(map(repr, SIZES))}, or None to set sizes yourself."
            )
        # deep copy: the config standardises rope_parameters in place, and PRESETS must stay as written
        fields = {**copy.deepcopy({**PRESETS[name], **SIZES.get(size, {})}), **overrides}
        # a preset's value may depend on the sizes it is built at (vaswani's sqrt(hidden_size)): computed last
        return cls(**{key: value(fields) if callable(value) else value for key, value in fields.items()})


# Keywords that are not fields but that transformers reads (legacy RoPE keys, torch_dtype, num_labels, what
# from_pretrained passes; sep_token_id from transformers 4's configs) or other models' configs carry under names
# near one of ours without meaning it (BERT's type_vocab_size, GPT-Neo's attention_layers, Phi-3's
# original_max_position_embeddings, ...); generation settings are added below. They stay plain attributes.
KNOWN_KEYWORDS = frozenset(
    {"rope_scaling", "rope_theta", "partial_rotary_factor", "original_max_position_embeddings", "torch_dtype",
     "num_labels", "name_or_path", "attn_implementation", "experts_implementation", "output_attentions",
     "per_layer_config", "sep_token_id", "type_vocab_size", "attention_layers", "ffn_hidden_size", "no_bias"}
)  # fmt: skip


# Other models' names for the norms' epsilon: transformers' own test utilities (testing_utils.
# set_config_for_less_flaky_test) set every one of them on any config, and configs converted by hand carry them.
# They load, with a warning naming decoderlab's field, since they change nothing here.
OTHER_EPSILON_NAMES = frozenset(
    {"rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "post_norm_eps", "batch_norm_eps"}
)


@functools.cache
def _known_keywords() -> frozenset[str]:
    return KNOWN_KEYWORDS | frozenset(GenerationConfig().to_dict())


def _check_keywords(kwargs: dict) -> None:
    """A keyword that is no field becomes an attribute (transformers keeps what other tools write into
    config.json), unless it is a near miss of one of DecoderLabConfig's fields: ``num_hidden_layer=6`` would
    otherwise build the default 12 layers without a word."""
    fields = [name for name in DecoderLabConfig.__annotations__ if not name.startswith("_")]
    for key, value in kwargs.items():
        if key.startswith("_") or key in _known_keywords():
            continue
        if key in OTHER_EPSILON_NAMES:
            logger.warning_once(f"DecoderLabConfig does not read {key}={value!r}: the norms' epsilon is norm_eps.")
            continue
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.8)
        if close:
            raise ValueError(
                f"DecoderLabConfig has no field {key!r} (given {key}={value!r}): did you mean {close[0]!r}? "
                "Fields are listed in the configuration reference (docs/reference/config.md)."
            )


# The field's class-level default would still answer `hasattr(config, "rope_parameters")` for configs without
# RoPE; `__init__` keeps its own copy of the default.
del DecoderLabConfig.rope_parameters


def _config_eq(self, other) -> bool:
    # The dataclass `__eq__` reads every field, rope_parameters too, which configs without RoPE do not have
    return isinstance(other, DecoderLabConfig) and self.to_dict() == other.to_dict()


DecoderLabConfig.__eq__ = _config_eq

# `@strict` checks field types (and `Literal` choices) as fields are set, raising its own
# StrictDataclassFieldValidationError, which is not a ValueError. Re-raise those as ValueError so that
# `except ValueError` catches every bad configuration, whether it comes from Python or a config.json.
_strict_init = DecoderLabConfig.__init__


def _takes_float(field: str) -> bool:
    hint = DecoderLabConfig.__annotations__.get(field)
    return hint is float or (
        typing.get_origin(hint) in (typing.Union, types.UnionType) and float in typing.get_args(hint)
    )


@functools.wraps(_strict_init)
def _init_raising_value_error(self, *args, **kwargs):
    # A whole number for a float field (`embedding_multiplier: 8` in YAML, `norm_eps=1` in Python) is that float,
    # as in JSON; @strict alone would refuse the int
    kwargs = {
        k: float(v) if type(v) is int and _takes_float(k) else v  # bool is an int subclass: left to @strict
        for k, v in kwargs.items()
    }
    try:
        _strict_init(self, *args, **kwargs)
    except StrictDataclassError as err:
        field = getattr(err, "field", None)
        allowed = ""
        hint = DecoderLabConfig.__annotations__.get(field)
        if typing.get_origin(hint) is Literal:
            allowed = f" Allowed: {', '.join(repr(c) for c in _choices(hint))}."
        raise ValueError(f"Invalid DecoderLabConfig: {err}{allowed}") from err


DecoderLabConfig.__init__ = _init_raising_value_error

# ----------------------------------------------------------------------------------------------
# Presets: named architectures and sizes for DecoderLabConfig.from_preset. Each architecture sets
# every field that defines it, so a preset reads the same whatever the defaults above become. A value
# may be a function of the preset's resolved fields (sizes and overrides), for fields that follow a size.


def _sqrt_hidden_size(fields: dict) -> float:
    return math.sqrt(fields.get("hidden_size", DecoderLabConfig.hidden_size))


PRESETS: dict[str, dict] = {
    # Touvron et al. 2023
    "llama": dict(
        position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        norm_placement="pre",
        norm_type="rmsnorm",
        use_parallel_residual=False,
        mlp_type="gated",
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    ),
    # Radford et al. 2019; "gelu_new" is GPT-2's tanh approximation of GELU
    "gpt2": dict(
        position_embedding_type="learned",
        max_position_embeddings=1024,
        norm_placement="pre",
        norm_type="layernorm",
        norm_bias=True,
        use_parallel_residual=False,
        mlp_type="plain",
        hidden_act="gelu_new",
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    ),
    # Black et al. 2022 (GPT-NeoX-20B), Biderman et al. 2023 (Pythia)
    "neox": dict(
        position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        norm_placement="pre",
        norm_type="layernorm",
        norm_bias=True,
        use_parallel_residual=True,
        mlp_type="plain",
        hidden_act="gelu",
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    ),
    # Vaswani et al. 2017: FFN(x) = max(0, x W1 + b1) W2 + b2 (eq. 2); embeddings shared with the
    # pre-softmax projection and multiplied by sqrt(d_model) (section 3.4).
    "vaswani": dict(
        embedding_multiplier=_sqrt_hidden_size,
        position_embedding_type="sinusoidal",
        norm_placement="post",
        norm_type="layernorm",
        norm_bias=True,
        use_parallel_residual=False,
        mlp_type="plain",
        hidden_act="relu",
        attention_bias=False,
        mlp_bias=True,
        tie_word_embeddings=True,
    ),
}

SIZES: dict[str, dict] = {
    "nano": dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4),  # nanoGPT's CPU recipe
    "tiny": dict(num_hidden_layers=6, hidden_size=384, num_attention_heads=6),  # nanoGPT's Shakespeare recipe
    "small": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12),  # GPT-2 small
}

__all__ = ["DecoderLabConfig", "PRESETS", "SIZES", "is_mup"]
