"""DecoderLab: a small decoder-only Transformer whose mechanisms are configuration switches.

Read top to bottom: linear layers, norms, positions, attention, MLP, the decoder blocks (one small class per norm
placement), then the Hugging Face ``PreTrainedModel`` classes. Variants are chosen once in
``__init__``; every ``forward`` is straight-line.

This file travels inside checkpoints (``trust_remote_code``), so it imports only ``torch``,
``transformers`` (and ``safetensors``, which transformers requires) and ``.configuration_decoderlab``.
"""

import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.import_utils import is_torchdynamo_compiling
from transformers.utils.output_capturing import capture_outputs

from .configuration_decoderlab import DecoderLabConfig

logger = logging.get_logger(__name__)


# ----------------------------------------------------------------------------------------------
# Linear layers


class DecoderLabLinear(nn.Linear):
    """nn.Linear (same parameters and state dict; a subclass, so PEFT and quantizers treat it as one), with
    faster kernels for a few input rows of float32 on a CPU: the decoding steps of up to 32 sequences.

    F.linear computes X @ W^T. For a few rows, torch's CPU BLAS (MKL) barely uses a second thread on it: for
    tiny's 8192 x 384 head, one thread -> two, 1 row 0.29 -> 0.30 ms, 8 rows 1.09 -> 0.93 ms, while the same
    numbers computed as W @ X^T take 0.58 -> 0.29 and 1.46 -> 0.76 ms (one-off timing). So for 2 to
    ``FEW_ROWS_KERNEL_MAX_ROWS`` rows an eager call computes W @ X^T and transposes it back, and for one row
    W @ [x, x]^T, keeping one column (MKL threads only from two columns; the duplicate costs a re-read of x,
    from cache, not of W). Measured on 2 threads: tiny's 43 linear layers for one token (55 MB of weights,
    each read once) 5.7 -> 2.5 ms (python -m benchmarks.profile_step); greedy decoding at tiny runs 1.6-1.7x
    LlamaForCausalLM at batch 1 (about 1.0x with F.linear) and 1.4x at batch 8 (1.04x with F.linear for
    several rows), in python -m benchmarks.speed. Small weights stay in cache, where the plain BLAS call is
    cheaper, so eagerly the kernel starts at ``FEW_ROWS_KERNEL_MIN_WEIGHTS`` weights; from about 64 rows
    neither product wins every shape, so above 32 rows (the largest batch measured end to end) F.linear
    stays. Inside torch.compile every layer computes one row as a reduction, one dot product w_i . x per row
    of the weight, which inductor fuses into a parallel kernel of its own (static cache, decoding step: nano
    0.56 -> 0.47 ms, tiny 6.7 -> 2.0 ms); 2 to 32 rows take W @ X^T there too (static cache at tiny, batch
    8: 1.19x -> 1.69x LlamaForCausalLM's plain generate in a one-off run; python -m benchmarks.speed times
    it). Training, more rows, other dtypes and other devices use F.linear. The sums run in another order, so
    outputs agree with F.linear's to float32 rounding (about 1e-6 at tiny's logits), not bit for bit.
    """

    FEW_ROWS_KERNEL_MIN_WEIGHTS = 2**17  # 512 KB of float32: larger than nano's layers, smaller than tiny's
    FEW_ROWS_KERNEL_MAX_ROWS = 32

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        # Decided once, as a plain attribute: a cheap test at every call
        self.few_rows_kernel = in_features * out_features >= self.FEW_ROWS_KERNEL_MIN_WEIGHTS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compiling = is_torchdynamo_compiling()
        if not (self.few_rows_kernel or compiling):
            # A small layer, eagerly: straight to F.linear, skipping the tests below (about 2 us a call, most of
            # a small layer's own Python; nano decodes ~5% faster at batch 1)
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        if (
            0 < rows <= self.FEW_ROWS_KERNEL_MAX_ROWS
            and x.shape[-1] == self.in_features  # otherwise F.linear names the mismatch
            and (self.few_rows_kernel or (compiling and rows == 1))
            and x.device.type == "cpu"
            and x.dtype == self.weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        ):
            if compiling and rows == 1:
                y = torch.linalg.vecdot(self.weight, x.reshape(-1))  # (out_features,): w_i . x for each row w_i
            elif rows == 1:
                pair = x.reshape(1, -1).expand(2, -1).contiguous()  # (2, in_features): x twice
                # Column 0 as a strided view: copying it costs ~3 us a layer, 2-3% of tiny's decoding step (one-off)
                y = torch.mm(self.weight, pair.t())[:, 0]  # (out_features,)
            else:
                # X^T as a transposed view of X: with a row-major copy of X^T MKL is several times slower
                y = torch.mm(self.weight, x.reshape(rows, -1).t()).t().contiguous()  # (rows, out_features)
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


# ----------------------------------------------------------------------------------------------
# Norms


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or in float64 if it is float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNormFunction(torch.autograd.Function):
    """w * (x / rms(x)) with its gradient written out, for training.

    The forward runs LlamaRMSNorm's ops in its order (identical outputs). The backward, with
    x̂ = x / rms(x) and g' = g * w: dL/dx = (g' - x̂ * mean(g' * x̂)) / rms(x), dL/dw = sum over tokens of
    g * x̂. Autograd's backward of the same forward makes about twice the passes over (B, T, C) and
    zero-fills scratch tensors. Forward + backward, one thread: 320 -> 255 us at nano (12 x 64 x 128),
    7.6 -> 4.6 ms at tiny (12 x 256 x 384); LlamaRMSNorm takes 435 us and 7.9 ms.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = upcast(x)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        x_hat = x32 * rstd
        ctx.save_for_backward(x_hat, rstd, weight)
        ctx.input_dtype = x.dtype
        return weight * x_hat.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x_hat, rstd, weight = ctx.saved_tensors
        grad_w = upcast(grad * weight)  # g'
        dot = torch.linalg.vecdot(grad_w, x_hat).unsqueeze(-1).div_(x_hat.shape[-1])  # mean(g' * x̂): (..., 1)
        grad_x = torch.addcmul(grad_w, x_hat, dot, value=-1).mul_(rstd).to(ctx.input_dtype)
        grad_weight = (grad * x_hat.to(ctx.input_dtype)).flatten(0, -2).sum(0).to(weight.dtype)
        return grad_x, grad_weight, None


class DecoderLabRMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): x / rms(x) * w, computed in float32 like Llama's."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return RMSNormFunction.apply(x, self.weight, self.eps)
        # Without autograd: F.rms_norm runs the same ops in the same order (LlamaRMSNorm's outputs bit for
        # bit) in one call, 2.4 us less per norm than spelling them out (17 -> 14 us for one token)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def make_norm(config: DecoderLabConfig, dim: int) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return DecoderLabRMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.norm_bias)


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
        # No torch.no_grad() context (nothing here requires grad) and no multiply by a scaling of 1.0:
        # 26 -> 16 us per forward pass
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
    exact): one roll instead of chunk, neg and cat. Per layer at nano, q and k together: 25 -> 17 us for one
    token; forward + backward 314 -> 246 us for a training batch."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q, k: (B, nh, T, hs) by the tables of DecoderLabRotaryEmbedding, cos and sin: (B, T, d), the
    first half of sin negated. With d < hs (partial rotary, GPT-NeoX) only the first d dimensions of each
    head rotate; the rest pass through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, d): broadcast over heads
    d = cos.shape[-1]
    if d == q.shape[-1]:
        return rotate(q, cos, sin), rotate(k, cos, sin)
    q_rot, q_pass = q[..., :d], q[..., d:]
    k_rot, k_pass = k[..., :d], k[..., d:]
    return torch.cat((rotate(q_rot, cos, sin), q_pass), dim=-1), torch.cat((rotate(k_rot, cos, sin), k_pass), dim=-1)


class DecoderLabAbsolutePositionalEmbedding(nn.Module):
    """Base for positions added to the token embeddings; refuses positions past the table."""

    def check(self, position_ids: torch.Tensor) -> None:
        if is_torchdynamo_compiling():
            return
        longest = int(position_ids.max()) + 1 if position_ids.numel() else 0
        if longest > self.num_positions:
            raise ValueError(
                f"Position {longest - 1} is past max_position_embeddings={self.num_positions} of "
                f"{self.__class__.__name__}: the sequence (prompt plus generated tokens) is {longest} long. "
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
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, nh, T, S)
    if attention_mask is not None:
        scores = scores + attention_mask  # 0 where allowed, -inf (dtype min) where masked
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, T, nh, hs)
    return out, weights


class DecoderLabAttention(nn.Module):
    """Multi-head attention with grouped-query / multi-query variants and a switchable scale.

    Every head is computed in parallel as one batched matmul; the heads' outputs are concatenated
    and mixed by ``o_proj``. The kernel comes from transformers' attention interface, so
    ``attn_implementation`` "eager", "sdpa", "flex_attention" and "flash_attention_2" all work.
    """

    def __init__(self, config: DecoderLabConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        # Vaswani et al. 2017: 1/sqrt(d_k) keeps the variance of q.k near 1 when q, k have unit variance
        self.scaling = config.attention_scale if config.attention_scale is not None else self.head_dim**-0.5
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

    def forward(  # internal: no deprecate_kwarg wrapper here, 5 us per layer and token
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hs)
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if position_embeddings is not None:  # RoPE
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, n_kv, S, hs): past and present

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        y, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )  # y: (B, T, nh, hs)
        y = self.o_proj(y.reshape(B, T, -1))  # concatenate the heads, then mix them
        return y, weights


# ----------------------------------------------------------------------------------------------
# MLP


def activation(name: str) -> nn.Module:
    """transformers' activation ``name``. "gelu_new" (GPT-2's tanh approximation of GELU) is transformers'
    formula spelled out in seven ops; PyTorch's gelu(approximate="tanh") computes the same formula in one
    kernel (outputs within 2.4e-7): forward + backward 3.7 -> 1.5 ms at nano's MLP width, 56 -> 18 ms at tiny's."""
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
        # No module without dropout: calling nn.Dropout(0.0) costs 3 us, twice per layer and token
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
# Hugging Face models


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

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear, Embedding, norms, and the RoPE buffers
        std = self.config.initializer_range
        if isinstance(module, DecoderLabLearnedPositionalEmbedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DecoderLabSinusoidalPositionalEmbedding):
            init.copy_(module.table, module.compute_table())
        elif self.config.scale_residual_init and isinstance(
            module, (DecoderLabAttention, DecoderLabMLP, DecoderLabGatedMLP)
        ):
            # GPT-2 (Radford et al. 2019): residual outputs shrink with depth so the stream's variance stays bounded
            out = module.o_proj if isinstance(module, DecoderLabAttention) else module.down_proj
            init.normal_(out.weight, mean=0.0, std=std / math.sqrt(2 * self.config.num_hidden_layers))

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
    def from_pretrained(cls, pretrained_model_name_or_path, *args, output_loading_info: bool = False, **kwargs):
        # A damaged weights file otherwise surfaces as safetensors' bare "Error while deserializing header".
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
            )
        except SafetensorError as err:
            raise OSError(
                f"The weights of {pretrained_model_name_or_path} cannot be read: a .safetensors file there is "
                f"truncated or corrupted ({err}). Download or save the checkpoint again."
            ) from err
        # transformers only logs weights a checkpoint lacks and leaves them random. A new task head
        # (lm_head, score) may legitimately be missing; a missing piece of the decoder is a broken checkpoint.
        missing = sorted(k for k in info["missing_keys"] if not k.startswith(("lm_head.", "score.")))
        if missing:
            raise OSError(
                f"The checkpoint {pretrained_model_name_or_path} lacks {len(missing)} weight(s) of the decoder: "
                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. Its weight files are incomplete or "
                "were saved from a different configuration."
            )
        return (model, info) if output_loading_info else model


class DecoderLabModel(DecoderLabPreTrainedModel):
    """The decoder stack: embeddings (+ absolute positions), blocks, final norm."""

    def __init__(self, config: DecoderLabConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        position_type = config.position_embedding_type
        self.embed_positions = (
            ABSOLUTE_POSITIONS[position_type](config) if position_type in ABSOLUTE_POSITIONS else None
        )
        self.rotary_emb = DecoderLabRotaryEmbedding(config) if position_type == "rope" else None
        self.dropout = nn.Dropout(config.hidden_dropout) if config.hidden_dropout > 0 else None  # as in the layers
        layer_class = decoder_layer_class(config)
        self.layers = nn.ModuleList([layer_class(config, i) for i in range(config.num_hidden_layers)])
        # post-LN blocks already end in a norm, so only the other placements need a final one
        self.norm = make_norm(config, config.hidden_size) if config.norm_placement != "post" else nn.Identity()
        self.gradient_checkpointing = False
        self.post_init()

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        """An id outside the vocabulary would otherwise surface as an opaque index error."""
        if is_torchdynamo_compiling() or input_ids.numel() == 0:
            return
        low, high = (int(v) for v in torch.aminmax(input_ids))  # one reduction, Python comparisons: 6 -> 3 us
        if low < 0 or high >= self.vocab_size:
            raise ValueError(
                f"input_ids must lie in [0, vocab_size={self.vocab_size}), but range from {low} to {high}. "
                "Was the text tokenized with this model's tokenizer?"
            )

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
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
        # are consecutive, so create_causal_mask is spared its search for packing (a diff, a cumsum and a
        # device sync): 46 -> 9 us per call with a nano training batch
        given_position_ids = position_ids
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None] + past_seen

        # None when SDPA's own causal path suffices (no padding): no mask is materialised then
        causal_mask = create_causal_mask(self.config, inputs_embeds, attention_mask, cache, given_position_ids)

        hidden_states = inputs_embeds
        if self.embed_positions is not None:  # learned / sinusoidal: added once, at the bottom
            hidden_states = hidden_states + self.embed_positions(position_ids)
        if self.dropout is not None:
            hidden_states = self.dropout(hidden_states)
        # RoPE: cos/sin computed once, applied to q and k in every layer
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None

        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                cache=cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


# ----------------------------------------------------------------------------------------------
# Loss


class CrossEntropyFunction(torch.autograd.Function):
    """Sum over rows of -log softmax(logits)[target]; rows whose target is ``ignore_index`` count 0.

    F.cross_entropy(reduction="sum")'s value with fewer (N, V) buffers: F.cross_entropy keeps the
    log-probabilities for its backward, which then allocates a zero-filled gradient for them and a third
    (N, V) tensor for the logits'. Here only each row's log-sum-exp (N,) is kept, and the backward writes
    softmax - one_hot straight into the logits' gradient. Peak training memory at tiny (3072 x 8192 logits):
    1308 -> 1191 MB added by training (LlamaForCausalLM -> decoderlab); time about the same (one thread,
    forward + backward 182 -> 198 ms CPU time).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, 0)[:, None]  # (N, 1): ignored rows point anywhere, masked
        logits32 = upcast(logits)  # as transformers' loss, which upcasts the logits
        logprobs = F.log_softmax(logits32, dim=-1)  # (N, V), freed on return
        target_logprobs = logprobs.gather(1, safe_targets).squeeze(1)  # (N,)
        # log-sum-exp = x_j - log p_j for any j; at the row's maximum |log p_j| <= log V, the least rounding
        largest, at = logits32.max(dim=-1, keepdim=True)
        lse = (largest - logprobs.gather(1, at)).squeeze(1)  # (N,)
        ctx.save_for_backward(logits, lse, safe_targets, valid)
        return -torch.where(valid, target_logprobs, 0.0).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, safe_targets, valid = ctx.saved_tensors
        scale = torch.where(valid, grad, 0.0)[:, None]  # (N, 1): d(loss) / d(row's loss)
        grad_logits = torch.sub(upcast(logits), lse[:, None]).exp_().mul_(scale)  # softmax * scale
        return grad_logits.scatter_add_(1, safe_targets, -scale).to(logits.dtype), None, None  # - one_hot * scale


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss (same arguments, same value, computed in float32): position t predicts
    labels[t + 1]; the mean over targets that are not ``ignore_index``, or their sum / num_items_in_batch
    when that is given (gradient accumulation), through ``CrossEntropyFunction``."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    total = CrossEntropyFunction.apply(logits.reshape(-1, vocab_size), targets, ignore_index)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class DecoderLabForCausalLM(DecoderLabPreTrainedModel, GenerationMixin):
    """The decoder with a language-modelling head; ``generate`` comes from ``GenerationMixin``."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # applied if tie_word_embeddings
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: DecoderLabConfig):
        super().__init__(config)
        self.model = DecoderLabModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = DecoderLabLinear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def loss_function(self) -> Callable:
        """``causal_lm_loss``, unless another loss was assigned to ``model.loss_function``."""
        return getattr(self, "_loss_function", causal_lm_loss)

    @loss_function.setter
    def loss_function(self, value: Callable) -> None:
        self._loss_function = value

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
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
            # keeps them alive with the output. Forward + backward: 43.3 -> 42.0 ms at nano, 1.79 -> 1.77 s
            # at tiny, where the cache would hold 57 MB. Decided here: in DecoderLabModel.forward,
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
        logits = self.lm_head(hidden_states)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        **kwargs,
    ) -> dict:
        """GenerationMixin's, with a short path for the common decoding step: after the prompt, token ids on
        the model's device, a cache, only the arguments below, and no padding where a static cache would want
        the mask expanded to 4D. That step's inputs are the new ids and positions (and, with a dynamic cache,
        the 2D mask); with a static cache the causal mask is made inside ``forward`` (inside the compiled
        graph when ``forward`` is compiled) instead of here.
        Measured per call (nano, batch 1): 35 -> 10 us with a dynamic cache, 113 -> 10 us with a static one.
        Every other case (prompt, inputs_embeds, padding with a static cache, other arguments) goes to
        GenerationMixin's version."""
        short_path = (
            not is_first_iteration
            and next_sequence_length is not None
            and cache is not None
            and inputs_embeds is None
            and (attention_mask is None or not cache.is_compileable or bool(attention_mask.all()))
            and kwargs.keys() <= {"position_ids", "logits_to_keep", "use_cache"}
            and input_ids.device == self.lm_head.weight.device
        )
        if not short_path:
            return super().prepare_inputs_for_generation(
                input_ids,
                next_sequence_length=next_sequence_length,
                cache=cache,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                is_first_iteration=is_first_iteration,
                **kwargs,
            )
        # clone: the same contiguous strides at every step, as GenerationMixin gives (a compiled forward relies on it)
        contiguous = torch.contiguous_format
        model_inputs = {
            "input_ids": input_ids[:, -next_sequence_length:].clone(memory_format=contiguous),
            "cache": cache,
        }
        model_inputs.update(kwargs)
        if (position_ids := kwargs.get("position_ids")) is not None:
            model_inputs["position_ids"] = position_ids[..., -next_sequence_length:].clone(memory_format=contiguous)
        if attention_mask is not None and not cache.is_compileable:
            model_inputs["attention_mask"] = attention_mask
        return model_inputs


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
# Registered classes count as remote code, whose forward signature generate() inspects at every step
# (inspect.signature, 23 us); stored once, the signature is a lookup (6 us).
DecoderLabForCausalLM.forward.__signature__ = inspect.signature(DecoderLabForCausalLM.forward)

__all__ = [
    "DecoderLabPreTrainedModel",
    "DecoderLabModel",
    "DecoderLabForCausalLM",
    "DecoderLabForSequenceClassification",
]
