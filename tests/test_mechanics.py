"""The Transformer mechanics decoderlab makes switchable, each shown on the model's own modules.

Attention scale, position encodings (RoPE shift invariance, absolute positions, partial rotary,
the sinusoidal table), the embedding multiplier, causality, multi-head / grouped-query / multi-query
attention against a per-head loop written here, QK-norm, every norm placement against its equation, the
activations (GPT-2's "gelu_new" as PyTorch's fused tanh GELU) and dropout (no module when the rate is 0).
"""

import math

import pytest
import torch
from transformers import GPTNeoXConfig, LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rotary_pos_emb

from decoderlab.modeling_decoderlab import (
    DecoderLabAttention,
    DecoderLabForCausalLM,
    DecoderLabRotaryEmbedding,
    activation,
    apply_rotary_pos_emb,
)


def causal_mask(T: int) -> torch.Tensor:
    """(1, 1, T, T) additive mask: 0 on and below the diagonal, -inf above."""
    return torch.full((T, T), float("-inf")).triu(1)[None, None]


# ----------------------------------------------------------------------------------------------
# Attention scale


def dot_product_variance(tiny_config, head_dim: int, attention_scale: float | None) -> float:
    """Mean over queries of Var_j(scale * q.k_j), read from the attention weights of a one-head module.

    q_proj and k_proj are random orthogonal maps of unit-variance inputs, so q and k have unit-variance
    components. log(softmax(s)) = s - logsumexp(s), so each row of log-weights is the row of scaled
    scores shifted by a constant, with the same variance.
    """
    config = tiny_config(
        hidden_size=head_dim, num_attention_heads=1, attention_scale=attention_scale, position_embedding_type="none"
    )
    config._attn_implementation = "eager"  # returns the weights
    attn = DecoderLabAttention(config, layer_idx=0).eval()
    torch.nn.init.orthogonal_(attn.q_proj.weight)
    torch.nn.init.orthogonal_(attn.k_proj.weight)
    x = torch.randn(64, 32, head_dim)  # (B, T, C): independent unit-variance tokens
    with torch.no_grad():
        _, weights = attn(x, attention_mask=None)  # no mask: every query sees all 32 keys
    return weights.double().log().var(dim=-1).mean().item()


def test_scale_keeps_dot_product_variance_near_one(tiny_config):
    """Vaswani et al.'s 1/sqrt(d_k) keeps Var(q.k) near 1 at every d_k; unscaled it grows like d_k."""
    for head_dim in (4, 16, 64):
        scaled = dot_product_variance(tiny_config, head_dim, None)
        unscaled = dot_product_variance(tiny_config, head_dim, 1.0)
        assert 0.8 < scaled < 1.25, (head_dim, scaled)
        assert 0.8 < unscaled / head_dim < 1.25, (head_dim, unscaled)


def test_default_scale_is_inverse_sqrt_head_dim(tiny_model, randomize):
    """attention_scale=None is exactly 1/sqrt(head_dim); another scale (here 1.0, no scaling) changes the outputs."""
    default = tiny_model()
    x = torch.randint(0, 99, (2, 12))
    explicit = tiny_model(attention_scale=16**-0.5)
    unscaled = tiny_model(attention_scale=1.0)
    explicit.load_state_dict(default.state_dict())
    unscaled.load_state_dict(default.state_dict())
    with torch.no_grad():
        logits = default(x).logits
        torch.testing.assert_close(explicit(x).logits, logits, rtol=0, atol=1e-6)
        assert (unscaled(x).logits - logits).abs().max() > 0.1


def test_qk_norm_changes_outputs(tiny_model):
    """qk_norm=True inserts a norm on each head's q and k: same other weights, different logits."""
    plain = tiny_model()
    normed = tiny_model(qk_norm=True)
    missing, unexpected = normed.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and missing and all(".q_norm." in k or ".k_norm." in k for k in missing)
    x = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        assert (normed(x).logits - plain(x).logits).abs().max() > 0.1


# ----------------------------------------------------------------------------------------------
# Multi-head attention against a per-head loop


def reference_attention(attn: DecoderLabAttention, config, x, cos=None, sin=None) -> torch.Tensor:
    """Causal attention one head at a time, then concatenate and project with o_proj.

    Query head h reads key/value head h // (heads / kv_heads). RoPE (if cos/sin are given) is
    transformers' GPT-NeoX rotation of the first cos.shape[-1] dimensions of each head.
    """
    nh, n_kv, hs = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    scale = config.attention_scale if config.attention_scale is not None else 1 / math.sqrt(hs)
    q_all, k_all, v_all = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)  # (B, T, heads * hs)
    T = x.shape[1]
    outputs = []
    for h in range(nh):
        g = h // (nh // n_kv)
        q = q_all[..., h * hs : (h + 1) * hs]  # (B, T, hs)
        k = k_all[..., g * hs : (g + 1) * hs]
        v = v_all[..., g * hs : (g + 1) * hs]
        if config.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        if cos is not None:
            q, k = neox_apply_rotary_pos_emb(q[:, None], k[:, None], cos, sin)
            q, k = q[:, 0], k[:, 0]
        scores = q @ k.transpose(1, 2) * scale + causal_mask(T)[0]  # (B, T, T)
        outputs.append(torch.softmax(scores, dim=-1) @ v)  # (B, T, hs)
    return attn.o_proj(torch.cat(outputs, dim=-1))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("partial_rotary_factor", [None, 1.0, 0.5])
def test_attention_equals_per_head_loop(
    tiny_config, randomize, attention_heads, attn_implementation, qk_norm, partial_rotary_factor
):
    """MHA, GQA and MQA (one batched op over all heads) equal a loop over heads, with and without RoPE
    (full and partial, rotated by transformers' GPT-NeoX functions) and QK-norm."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": partial_rotary_factor or 1.0}
    config = tiny_config(
        **attention_heads,
        qk_norm=qk_norm,
        norm_type="layernorm",
        position_embedding_type="rope" if partial_rotary_factor else "none",
        rope_parameters=rope,
    )
    config._attn_implementation = attn_implementation
    attn = randomize(DecoderLabAttention(config, layer_idx=0)).eval()
    x = torch.randn(2, 10, config.hidden_size)
    position_ids = torch.arange(10)[None].expand(2, -1)
    ours_pe = theirs_pe = (None, None)
    if partial_rotary_factor:
        ours_pe = DecoderLabRotaryEmbedding(config)(x, position_ids)
        neox = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope)
        theirs_pe = GPTNeoXRotaryEmbedding(neox)(x, position_ids)
    with torch.no_grad():
        ours, _ = attn(
            x, position_embeddings=ours_pe if partial_rotary_factor else None, attention_mask=causal_mask(10)
        )
        expected = reference_attention(attn, config, x, *theirs_pe)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Positions


def test_rope_is_invariant_to_shifting_positions_but_absolute_positions_are_not(tiny_model, position_type):
    """RoPE (and no positions) depend only on relative offsets: adding a constant to every position id
    leaves the logits unchanged. Sinusoidal and learned absolute positions change them."""
    model = tiny_model(position_embedding_type=position_type)
    x = torch.randint(0, 99, (2, 16))
    positions = torch.arange(16)[None].expand(2, -1)
    with torch.no_grad():
        difference = (model(x, position_ids=positions).logits - model(x, position_ids=positions + 37).logits).abs()
    if position_type in ("rope", "none"):
        assert difference.max() < 1e-4
    else:
        assert difference.max() > 0.1


def test_partial_rotary_leaves_the_other_dimensions_unrotated(tiny_model):
    """With partial_rotary_factor=0.5 only the first half of each head's q/k rotates (GPT-NeoX layout).

    Zero the rotary half of every q_proj/k_proj: scores then come from unrotated dimensions only, so
    even a non-shift change of positions (stretching them 3x) leaves the logits unchanged. Zero the
    other half instead and the same change alters the logits.
    """
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    x = torch.randint(0, 99, (1, 12))
    positions = torch.arange(12)[None]
    for zeroed, should_change in ((slice(0, 8), False), (slice(8, 16), True)):
        model = tiny_model(rope_parameters=rope)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    proj.weight.view(-1, 16, 64)[:, zeroed] = 0.0  # (heads, head_dim, hidden)
            difference = (model(x, position_ids=positions).logits - model(x, position_ids=3 * positions).logits).abs()
        assert (difference.max() > 0.1) == should_change, (zeroed, difference.max())


LLAMA_ROPE_TYPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}


@pytest.mark.parametrize("rope_type", list(LLAMA_ROPE_TYPES))
def test_rope_tables_match_llama(tiny_config, rope_type):
    """cos/sin equal transformers' LlamaRotaryEmbedding for the same settings (sin with the sign of
    rotate_half folded into its first half), for each scaling type, including positions past
    max_position_embeddings (where dynamic NTK scaling kicks in); q and k rotated with them equal Llama's
    apply_rotary_pos_emb, in both layouts of q and k."""
    rope = {**LLAMA_ROPE_TYPES[rope_type], "rope_theta": 5e5}
    ours = DecoderLabRotaryEmbedding(tiny_config(rope_parameters=dict(rope)))
    llama_config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=64, rope_parameters=dict(rope)
    )
    theirs = LlamaRotaryEmbedding(llama_config)
    x = torch.randn(1, 100, 64)
    for positions in (torch.arange(50)[None], torch.arange(100)[None]):
        (cos, signed_sin), (llama_cos, llama_sin) = ours(x, positions), theirs(x, positions)
        half = llama_sin.shape[-1] // 2
        torch.testing.assert_close(cos, llama_cos, rtol=0, atol=1e-6)
        torch.testing.assert_close(signed_sin[..., :half], -llama_sin[..., :half], rtol=0, atol=1e-6)
        torch.testing.assert_close(signed_sin[..., half:], llama_sin[..., half:], rtol=0, atol=1e-6)
        q, k = torch.randn(2, 1, 4, positions.shape[1], 16).unbind(0)
        for mine, reference in zip(
            apply_rotary_pos_emb(q, k, cos, signed_sin), llama_apply_rotary_pos_emb(q, k, llama_cos, llama_sin)
        ):
            torch.testing.assert_close(mine, reference, rtol=0, atol=1e-6)
        # the layout the attention uses, heads in dimension 2: (B, T, nh, hs)
        q_bthd, k_bthd = q.transpose(1, 2), k.transpose(1, 2)
        for mine, reference in zip(
            apply_rotary_pos_emb(q_bthd, k_bthd, cos, signed_sin, unsqueeze_dim=2),
            llama_apply_rotary_pos_emb(q_bthd, k_bthd, llama_cos, llama_sin, unsqueeze_dim=2),
        ):
            torch.testing.assert_close(mine, reference, rtol=0, atol=1e-6)


def test_sinusoidal_table_is_vaswani(tiny_model):
    """PE(p, 2i) = sin(p / 10000^(2i/C)) and PE(p, 2i+1) = cos(p / 10000^(2i/C)), added to the token embeddings."""
    model = tiny_model(position_embedding_type="sinusoidal")
    C, P = 64, 64
    expected = torch.tensor(
        [[(math.sin if j % 2 == 0 else math.cos)(p / 10000 ** ((j - j % 2) / C)) for j in range(C)] for p in range(P)]
    )
    torch.testing.assert_close(model.model.embed_positions.table, expected, rtol=0, atol=1e-5)
    x = torch.randint(0, 99, (1, 20))
    with torch.no_grad():
        first_layer_input = model(x, output_hidden_states=True).hidden_states[0]
    torch.testing.assert_close(first_layer_input, model.model.embed_tokens(x) + expected[:20], rtol=0, atol=1e-5)


def test_learned_positions_are_added_to_the_embeddings(tiny_model):
    """Learned absolute positions: the first layer sees embed_tokens(x) + embed_positions.weight[position]."""
    model = tiny_model(position_embedding_type="learned")
    x = torch.randint(0, 99, (1, 20))
    positions = torch.arange(5, 25)[None]
    with torch.no_grad():
        first_layer_input = model(x, position_ids=positions, output_hidden_states=True).hidden_states[0]
        expected = model.model.embed_tokens(x) + model.model.embed_positions.weight[5:25]
    torch.testing.assert_close(first_layer_input, expected, rtol=0, atol=1e-6)


def test_embedding_multiplier_scales_the_token_embeddings_before_positions(tiny_model, position_type):
    """Vaswani et al. 2017, section 3.4: the model with embedding_multiplier m computes exactly what the model
    with multiplier 1 computes when its embedding matrix is multiplied by m, for every position type, so the
    factor reaches the token embeddings alone (absolute positions are added after it; RoPE never sees it).
    ``inputs_embeds`` taken from ``get_input_embeddings()`` are already scaled, as in transformers' Gemma."""
    m = 8.0  # sqrt(64): the original Transformer's factor at this width
    scaled = tiny_model(position_embedding_type=position_type, embedding_multiplier=m)
    plain = tiny_model(position_embedding_type=position_type)
    plain.load_state_dict(scaled.state_dict())
    with torch.no_grad():
        plain.model.embed_tokens.weight.mul_(m)
    x = torch.randint(0, 99, (2, 20))
    positions = torch.arange(3, 23)[None]  # off zero, so rows of the position tables past the first count
    with torch.no_grad():
        expected = plain.model(x, position_ids=positions).last_hidden_state
        assert torch.equal(scaled.model(x, position_ids=positions).last_hidden_state, expected)
        embeds = scaled.get_input_embeddings()(x)
        assert torch.equal(scaled.model(inputs_embeds=embeds, position_ids=positions).last_hidden_state, expected)
        if scaled.model.embed_positions is not None:  # learned / sinusoidal: the positions are not scaled
            first_layer_input = scaled(x, position_ids=positions, output_hidden_states=True).hidden_states[0]
            unscaled_positions = scaled.model.embed_positions(positions)
            assert torch.equal(first_layer_input, m * scaled.model.embed_tokens.weight[x] + unscaled_positions)


@pytest.mark.parametrize("tie", [False, True])
def test_embedding_initializer_range_sets_the_token_embeddings_init_only(tiny_config, tie):
    """embedding_initializer_range is the std of the token embeddings' init (a tied head is the same matrix);
    every other weight keeps initializer_range's init, draw for draw."""
    torch.manual_seed(0)
    plain = DecoderLabForCausalLM(tiny_config(vocab_size=4000, initializer_range=0.02, tie_word_embeddings=tie))
    torch.manual_seed(0)
    wide = DecoderLabForCausalLM(
        tiny_config(vocab_size=4000, initializer_range=0.02, embedding_initializer_range=0.3, tie_word_embeddings=tie)
    )
    assert wide.model.embed_tokens.weight.std().item() == pytest.approx(0.3, rel=0.02)
    assert plain.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.02)
    for (name, a), (_, b) in zip(plain.named_parameters(), wide.named_parameters()):
        if name != "model.embed_tokens.weight":
            assert torch.equal(a, b), name
    assert (wide.lm_head.weight is wide.model.embed_tokens.weight) == tie


@pytest.mark.parametrize("mlp_type", ["gated", "plain"])
def test_scale_residual_init_draws_the_residual_outputs_smaller(tiny_config, mlp_type):
    """scale_residual_init (GPT-2's init) draws o_proj and down_proj with std / sqrt(2 x layers), their biases
    zero, and every other matrix with std; off, those two draw std too. (transformers from 5.13 on never calls
    _init_weights on the attention and MLP modules of code outside the library, so the draw is the projection's.)"""
    sizes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                 initializer_range=0.05, mlp_type=mlp_type, attention_bias=True, mlp_bias=True)  # fmt: skip
    scaled_std = 0.05 / math.sqrt(2 * 8)
    for scaled in (True, False):
        model = DecoderLabForCausalLM(tiny_config(**sizes, scale_residual_init=scaled))
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                assert param.std().item() == pytest.approx(scaled_std if scaled else 0.05, rel=0.05), name
            elif name.endswith("proj.weight"):
                assert param.std().item() == pytest.approx(0.05, rel=0.05), name
            elif name.endswith("proj.bias"):
                assert not param.any(), name


@pytest.mark.parametrize("mlp_type", ["gated", "plain"])
def test_zero_residual_init_starts_every_block_as_the_identity(tiny_config, mlp_type):
    """zero_residual_init starts o_proj and down_proj (weights and biases) at zero, whatever scale_residual_init
    says, and draws every other tensor as without it, draw for draw; so each block adds nothing at first (the
    last layer's output is the embedding) while gradients still reach the zeroed projections."""
    sizes = dict(mlp_type=mlp_type, attention_bias=True, mlp_bias=True, initializer_range=0.05)
    torch.manual_seed(0)
    plain = DecoderLabForCausalLM(tiny_config(**sizes))
    for scaled in (True, False):
        torch.manual_seed(0)
        zero = DecoderLabForCausalLM(tiny_config(**sizes, zero_residual_init=True, scale_residual_init=scaled))
        for (name, a), (_, b) in zip(zero.named_parameters(), plain.named_parameters()):
            if ".o_proj." in name or ".down_proj." in name:
                assert not a.any(), name
            else:
                assert torch.equal(a, b), name
    ids = torch.randint(0, zero.config.vocab_size, (2, 8))
    out = zero(input_ids=ids, labels=ids, output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[-2], zero.model.embed_tokens(ids))  # the last block's input
    out.loss.backward()
    assert zero.model.layers[0].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert zero.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_final_logit_softcapping_caps_the_logits_the_loss_and_generation_see(tiny_model):
    """final_logit_softcapping c: the logits are c * tanh(z / c) of the uncapped model's z (same weights), the loss
    is the cross-entropy of the capped logits (the project's own lean loss included: pitfall of fused losses that
    take hidden states), and generate's scores are the capped logits too; no logit reaches c."""
    plain = tiny_model()
    capped = tiny_model(final_logit_softcapping=2.0)
    capped.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        z = plain(input_ids=ids).logits
        out = capped(input_ids=ids, labels=ids)
    assert z.abs().max() > 2.0  # the cap matters here
    torch.testing.assert_close(out.logits, 2.0 * torch.tanh(z / 2.0))
    assert out.logits.abs().max() < 2.0
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 99), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    big = torch.randint(0, 99, (8, 64))  # enough logits for the lean CPU loss path (kernels_decoderlab)
    with torch.no_grad():
        lean = capped(input_ids=big, labels=big)
    reference = torch.nn.functional.cross_entropy(lean.logits[:, :-1].reshape(-1, 99), big[:, 1:].reshape(-1))
    torch.testing.assert_close(lean.loss, reference)
    generated = capped.generate(ids[:1, :5], max_new_tokens=3, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        again = capped(input_ids=generated.sequences[:, :-1]).logits[:, -3:]
    torch.testing.assert_close(torch.stack(generated.logits, dim=1), again)
    assert torch.stack(generated.logits).abs().max() < 2.0


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_value_residual_equals_its_equation(tiny_model, kv_heads):
    """value_residual: every layer after the first computes attention with v_l + l_l (v_1 - v_l), v_1 the first
    layer's values of the same tokens; the reference here is the model without the switch, the same weights, with
    v_proj's outputs mixed by forward hooks (the mix is per element, so before or after the heads are split is the
    same). Each l is learned (a gradient reaches it, and the first layer's v_proj through the later layers), gradient
    checkpointing gives the same gradients, and cached generation equals uncached."""
    model = tiny_model(num_key_value_heads=kv_heads, value_residual=True)
    plain = tiny_model(num_key_value_heads=kv_heads)
    lambdas = [layer.self_attn.value_residual.weight for layer in model.model.layers[1:]]
    with torch.no_grad():
        for i, weight in enumerate(lambdas):
            weight.fill_(0.2 + 0.3 * i)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "value_residual" not in k})
    first = {}
    plain.model.layers[0].self_attn.v_proj.register_forward_hook(lambda module, args, out: first.__setitem__("v", out))
    for weight, layer in zip(lambdas, plain.model.layers[1:]):
        layer.self_attn.v_proj.mixing = weight.detach().clone()
        layer.self_attn.v_proj.register_forward_hook(lambda module, args, out: out + module.mixing * (first["v"] - out))
    ids = torch.randint(0, 99, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert type(model.model.layers[0].self_attn.value_residual).__name__ == "DecoderLabFirstValues"

    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert all(weight.grad.abs().sum() > 0 for weight in lambdas)
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(input_ids=ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)
    model.gradient_checkpointing_disable()
    model.eval()
    generate = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:, :4], use_cache=True, **generate),
                       model.generate(ids[:, :4], use_cache=False, **generate))  # fmt: skip


def test_value_residual_starts_at_one_half(tiny_config):
    """A fresh model's mixing weights are 0.5 (the first layer has none), and they sit with the norms in the
    optimizer groups (1-D: AdamW, no weight decay)."""
    model = DecoderLabForCausalLM(tiny_config(num_hidden_layers=3, value_residual=True))
    named = {name: p for name, p in model.named_parameters() if "value_residual" in name}
    assert sorted(named) == [f"model.layers.{i}.self_attn.value_residual.weight" for i in (1, 2)]
    assert all(p.shape == (1,) and p.item() == 0.5 for p in named.values())


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")])
def test_final_logit_softcapping_must_be_positive(tiny_config, cap):
    """A cap <= 0 (or not finite) is refused naming the field, the value and what it means."""
    with pytest.raises(ValueError, match=rf"final_logit_softcapping must be a positive number.*got {cap}"):
        tiny_config(final_logit_softcapping=cap)


def test_embedding_multiplier_one_is_the_plain_embedding(tiny_model):
    """The default 1.0 builds a plain nn.Embedding: the default model computes what it did before the field."""
    model = tiny_model()
    assert model.config.embedding_multiplier == 1.0
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    assert type(tiny_model(embedding_multiplier=2.0).model.embed_tokens) is not torch.nn.Embedding


# ----------------------------------------------------------------------------------------------
# Causality


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_future_tokens_do_not_change_past_logits(tiny_model, position_type, block_variant, attn_implementation):
    """Changing token t+1 leaves the logits at positions <= t unchanged, and does change those at t+1."""
    model = tiny_model(position_embedding_type=position_type, **block_variant)
    model.set_attn_implementation(attn_implementation)
    x = torch.randint(0, 99, (1, 16))
    t = 9
    changed = x.clone()
    changed[0, t + 1] = (x[0, t + 1] + 1) % 99
    with torch.no_grad():
        before, after = model(x).logits, model(changed).logits
    torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], rtol=0, atol=1e-5)
    assert (after[:, t + 1] - before[:, t + 1]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------
# Norm placement: each block equals its equation, built from the block's own submodules


def block_equation(layer, x, attend, variant: str) -> torch.Tensor:
    mlp = layer.mlp
    if variant == "pre":  # h = x + Attn(LN_1(x)); out = h + MLP(LN_2(h))
        h = x + attend(layer.input_layernorm(x))
        return h + mlp(layer.post_attention_layernorm(h))
    if variant == "post":  # h = LN_1(x + Attn(x)); out = LN_2(h + MLP(h))
        h = layer.post_attention_layernorm(x + attend(x))
        return layer.post_feedforward_layernorm(h + mlp(h))
    if variant == "sandwich":  # h = x + LN_b(Attn(LN_a(x))); out = h + LN_d(MLP(LN_c(h)))
        h = x + layer.post_attention_layernorm(attend(layer.input_layernorm(x)))
        return h + layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(h)))
    # parallel: out = x + Attn(LN_1(x)) + MLP(LN_2(x))
    return x + attend(layer.input_layernorm(x)) + mlp(layer.post_attention_layernorm(x))


BLOCK_NORMS = {
    "pre": {"input_layernorm", "post_attention_layernorm"},
    "post": {"post_attention_layernorm", "post_feedforward_layernorm"},
    "sandwich": {
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    },
    "parallel": {"input_layernorm", "post_attention_layernorm"},
}


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_each_block_equals_its_equation(tiny_model, block_variant, norm_type):
    """Every layer of every placement computes its equation (norm weights randomized, so swapping two
    norms would show), has exactly the norms the equation names, and the model stacks the blocks with a
    final norm for every placement but post-LN (whose blocks already end in one)."""
    variant = "parallel" if block_variant.get("use_parallel_residual") else block_variant["norm_placement"]
    model = tiny_model(norm_type=norm_type, **block_variant)
    x = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        hidden = model.model.embed_tokens(x)
        position_embeddings = model.model.rotary_emb(hidden, torch.arange(12)[None].expand(2, -1))
        mask = causal_mask(12)
        for layer in model.model.layers:
            norms = {name for name, _ in layer.named_children() if name.endswith("layernorm")}
            assert norms == BLOCK_NORMS[variant]

            def attend(h, layer=layer):
                return layer.self_attn(h, position_embeddings=position_embeddings, attention_mask=mask)[0]

            expected = block_equation(layer, hidden, attend, variant)
            torch.testing.assert_close(
                layer(hidden, attention_mask=mask, position_embeddings=position_embeddings), expected, rtol=0, atol=1e-5
            )
            hidden = expected
        if variant != "post":
            hidden = model.model.norm(hidden)
        torch.testing.assert_close(model(x).logits, model.lm_head(hidden), rtol=0, atol=1e-4)
    assert (variant == "post") == (sum(p.numel() for p in model.model.norm.parameters()) == 0)


# ----------------------------------------------------------------------------------------------
# Activation and dropout


def test_gelu_new_runs_as_pytorchs_tanh_gelu():
    """GPT-2's "gelu_new" becomes PyTorch's fused tanh-approximation GELU: the same formula."""
    x = torch.linspace(-8, 8, 1001)
    assert type(activation("gelu_new")) is type(ACT2FN["gelu_pytorch_tanh"])
    torch.testing.assert_close(activation("gelu_new")(x), ACT2FN["gelu_new"](x), rtol=0, atol=1e-6)
    assert type(activation("silu")) is type(ACT2FN["silu"])


def test_dropout_modules_only_when_dropout_is_set(tiny_model):
    """hidden_dropout=0 leaves the layers and the embeddings without a dropout module (nothing to call); a
    positive rate still drops in training mode and not in eval mode."""
    x = torch.randint(0, 99, (2, 10))
    plain = tiny_model()
    assert plain.model.dropout is None and all(layer.dropout is None for layer in plain.model.layers)
    dropping = tiny_model(hidden_dropout=0.5)
    assert dropping.model.dropout.p == 0.5 and all(layer.dropout.p == 0.5 for layer in dropping.model.layers)
    with torch.no_grad():
        assert torch.equal(dropping(x).logits, dropping(x).logits)
        dropping.train()
        assert not torch.equal(dropping(x).logits, dropping(x).logits)


def test_final_logit_softcapping_is_refused_with_mup(tiny_config):
    """muP's logit factor and the soft-cap do not combine: decoderlab caps after the factor, vLLM (which reads both
    fields from config.json) before it, so the checkpoint would be another model there; refused when configured."""
    with pytest.raises(ValueError, match=r"final_logit_softcapping=15.0 with parametrization='mup' is not supported"):
        tiny_config(final_logit_softcapping=15.0, parametrization="mup", mup_base_width=16)
    tiny_config(final_logit_softcapping=15.0)  # either alone is fine
    tiny_config(parametrization="mup", mup_base_width=16)
