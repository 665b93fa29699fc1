"""Per-layer attention layouts: sliding windows (``layer_types``, ``sliding_window``), RoPE-free layers
(``no_rope_layers``) and learned attention sinks (``attention_sinks``).

Each layout equals a reference written here (its attention spelled out: an explicit window and padding mask, RoPE
skipped on the chosen layers, the sink's logit in the softmax's denominator) on every attention kernel that runs it,
and transformers' own classes where they express the same thing, weights copied across: Qwen3's and Mistral's sliding
windows, SmolLM3's RoPE-free layers, gpt-oss's attention with sinks. Also: the sliding layers' KV cache stays at the
window while the full layers' grows, cached decoding equals uncached, flex attention's block mask skips the blocks
outside the window, the masks are made once per forward and only of the kinds the layers use, the static-cache
compiled path decodes a sliding layout, and every bad layout is refused when its config is built.
"""

import copy
import math
import sys
import types
from unittest.mock import patch

import pytest
import torch
from conftest import left_padding
from torch.nn.attention.flex_attention import BlockMask, create_mask
from transformers import (
    GptOssConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation import GenerationMixin
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

import decoderlab.compat_decoderlab as compat
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.generation import compiled_decoding_is_on, generate, set_compiled_decoding
from decoderlab.kernels_decoderlab import DecodingStepFastPath
from decoderlab.modeling_decoderlab import (
    DecoderLabAttention,
    DecoderLabRotaryEmbedding,
    check_tensor_parallel,
)
from decoderlab.roles_decoderlab import init_std, rule_for

S, F = "sliding_attention", "full_attention"
WINDOW = 4
# heads of 32: torch's CPU flex kernel is wrong for heads of 16 with AVX2 (tests/test_attention_backends.py)
SIZES = dict(vocab_size=99, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128)  # fmt: skip
LAYOUTS = {
    "sliding": dict(layer_types=[S, F, S, S], sliding_window=WINDOW),
    "all sliding": dict(layer_types=[S] * 4, sliding_window=WINDOW),
    "rope-free": dict(no_rope_layers=[1, 0, 1, 0]),
    "sinks": dict(attention_sinks=True),
    "mix": dict(layer_types=[S, F, S, F], sliding_window=WINDOW, no_rope_layers=[0, 1, 1, 0], attention_sinks=True),
    "mix without sinks": dict(layer_types=[S, F, S, F], sliding_window=WINDOW, no_rope_layers=[0, 1, 1, 0]),
}
# the kernels that run each layout: sinks only in the eager attention (the others are refused, tested below)
KERNEL_LAYOUTS = [
    pytest.param(kernel, name, id=f"{kernel}-{name}")
    for kernel in ("eager", "sdpa", "flex_attention")
    for name, layout in LAYOUTS.items()
    if kernel == "eager" or not layout.get("attention_sinks")
]


def layout_model(randomize, layout: dict, attn_implementation: str | None = None, **sizes) -> DecoderLabForCausalLM:
    """A Llama-shaped model with ``layout``, weights re-drawn (O(1) logits), sinks spread over [-2, 2] so that some
    heads give their tokens much less than all of their attention and others nearly all of it."""
    model = randomize(DecoderLabForCausalLM(DecoderLabConfig(**{**SIZES, **sizes}, **layout))).eval()
    if model.config.attention_sinks:
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, model.config.num_attention_heads) + 0.3 * i)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model


# ----------------------------------------------------------------------------------------------
# The reference: each layout's attention written out


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+d/2}) of x: (B, heads, T, d) by p * theta^(-2i/d) at position p = 0, 1, ..."""
    d, T = x.shape[-1], x.shape[-2]
    angle = torch.arange(T).float()[:, None] * theta ** (-torch.arange(0, d, 2).float() / d)  # (T, d/2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()), dim=-1)


def reference_attention(attn, x: torch.Tensor, padding: torch.Tensor, config, layer: int) -> torch.Tensor:
    """Query i sees key j when j <= i, the key is no padding and, in a sliding layer, i - j < sliding_window; RoPE
    only where no_rope_layers says 1; with sinks, softmax over [scores, s_h] and the sink's column dropped."""
    B, T, _ = x.shape
    nh, hs = config.num_attention_heads, config.head_dim
    q = attn.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
    k, v = (proj(x).view(B, T, -1, hs).transpose(1, 2).repeat_interleave(nh // config.num_key_value_heads, dim=1)
            for proj in (attn.k_proj, attn.v_proj))  # fmt: skip
    if config.no_rope_layers[layer]:
        q, k = rope(q, config.rope_parameters["rope_theta"]), rope(k, config.rope_parameters["rope_theta"])
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    window = config.sliding_window if config.layer_types[layer] == S else T
    allowed = (j <= i) & (i - j < window) & padding.bool()[:, None, None, :]  # (B, 1, T, T)
    scores = (q @ k.transpose(2, 3) / math.sqrt(hs)).masked_fill(~allowed, torch.finfo(torch.float32).min)
    if config.attention_sinks:
        scores = torch.cat((scores, attn.sinks.view(1, nh, 1, 1).expand(B, nh, T, 1)), dim=-1)
    weights = torch.softmax(scores, dim=-1)[..., :T]
    return attn.o_proj((weights @ v).transpose(1, 2).reshape(B, T, nh * hs))


@torch.no_grad()
def reference_logits(model: DecoderLabForCausalLM, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """The pre-norm decoder (Llama's block) around reference_attention, with the model's own norms and MLPs."""
    h = model.model.embed_tokens(ids)
    for i, layer in enumerate(model.model.layers):
        h = h + reference_attention(layer.self_attn, layer.input_layernorm(h), padding, model.config, i)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h))


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize(("kernel", "layout"), KERNEL_LAYOUTS)
def test_every_kernel_computes_the_reference(randomize, kernel, layout, padded):
    """Eager, sdpa and flex attention give the reference's logits (within 1e-5) for every layout they run, on 24
    tokens (six windows), at every real position of a left-padded batch too."""
    model = layout_model(randomize, LAYOUTS[layout], kernel)
    ids = torch.randint(0, 99, (3, 24))
    padding = left_padding(3, 24) if padded else torch.ones_like(ids)
    with torch.no_grad():
        logits = model(ids, attention_mask=padding if padded else None).logits
    expected = reference_logits(model, ids, padding)
    real = padding.bool()
    assert model.config._attn_implementation == kernel
    torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "mix without sinks"])
def test_each_layout_changes_what_the_model_computes(randomize, layout):
    """The same weights with the layout and without it give different logits over 24 tokens (six windows): each
    switch reaches the computation, so the comparisons above are not between equal things by accident."""
    model = layout_model(randomize, LAYOUTS[layout])
    plain = DecoderLabForCausalLM(DecoderLabConfig(**SIZES)).eval()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert missing == [] and all(name.endswith("self_attn.sinks") for name in unexpected)
    ids = torch.randint(0, 99, (2, 24))
    with torch.no_grad():
        assert (model(ids).logits - plain(ids).logits).abs().max() > 0.1


def test_a_window_without_sliding_layers_changes_nothing(randomize):
    """sliding_window on a model whose layers are all full (as transformers' common tests set it on every config that
    has the field, and as Qwen3's config keeps it) is read by no layer: the plain model's logits, one kind of mask."""
    model = layout_model(randomize, dict(sliding_window=2))
    plain = DecoderLabForCausalLM(DecoderLabConfig(**SIZES)).eval()
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)
    assert list(model.model.mask_functions) == [F]


def test_rope_free_layers_everywhere_are_the_model_without_positions(randomize):
    """no_rope_layers all 0 is NoPE: the same weights compute what position_embedding_type='none' computes."""
    model = layout_model(randomize, dict(no_rope_layers=[0, 0, 0, 0]))
    nope = DecoderLabForCausalLM(DecoderLabConfig(**SIZES, position_embedding_type="none")).eval()
    nope.load_state_dict(model.state_dict())
    ids = torch.randint(0, 99, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, nope(ids).logits, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Masks, kernels and caches


def test_masks_are_made_once_per_forward_and_only_of_the_kinds_used(randomize):
    """A forward calls transformers' create_causal_mask and create_sliding_window_causal_mask once each when the
    layers use both kinds, and only the first for a model without sliding layers (the default: as before)."""
    ids = torch.randint(0, 99, (2, 12))
    for layout, expected in ((LAYOUTS["sliding"], (1, 1)), ({}, (1, 0)), (LAYOUTS["all sliding"], (0, 1))):
        model = layout_model(randomize, layout, "sdpa")
        with (
            patch.object(compat, "_create_causal_mask", wraps=compat._create_causal_mask) as full,
            patch.object(
                compat, "_create_sliding_window_causal_mask", wraps=compat._create_sliding_window_causal_mask
            ) as sliding,  # fmt: skip
            torch.no_grad(),
        ):
            model(ids, attention_mask=torch.ones_like(ids))
        assert (full.call_count, sliding.call_count) == expected, layout


def test_flex_attention_skips_the_blocks_outside_the_window(randomize):
    """With flex attention each sliding layer gets a BlockMask holding the window (query i sees keys i-127 ... i):
    over 512 tokens, 128 a block, it marks more blocks empty (skipped by the kernel) than a full layer's causal
    mask, and the logits equal eager's."""
    model = layout_model(randomize, dict(layer_types=[S, F], sliding_window=128), "flex_attention",
                         hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=32, intermediate_size=64,
                         num_hidden_layers=2, max_position_embeddings=512)  # fmt: skip
    masks = {}

    def record(attention, args) -> None:  # the mask the layer is called with: (x, position_embeddings, mask, cache)
        masks[attention.attention_type] = args[2]

    hooks = [layer.self_attn.register_forward_pre_hook(record) for layer in model.model.layers]
    ids = torch.randint(0, 99, (1, 512))
    with torch.no_grad():
        flex = model(ids).logits
    for hook in hooks:
        hook.remove()
    assert isinstance(masks[S], BlockMask) and isinstance(masks[F], BlockMask)
    i, j = torch.arange(512)[:, None], torch.arange(512)[None]
    window = create_mask(masks[S].mask_mod, 1, 1, 512, 512, device="cpu")[0, 0]
    assert torch.equal(window, (j <= i) & (i - j < 128))
    assert masks[S].sparsity() > masks[F].sparsity() + 10  # percent of blocks skipped: 7 of 16 visited against 10 of 16
    model.set_attn_implementation("eager")
    with torch.no_grad():
        torch.testing.assert_close(flex, model(ids).logits, rtol=0, atol=1e-5)


def test_sinks_run_eager_and_other_kernels_are_refused_by_name(randomize):
    """A model with attention sinks is built with the eager attention by default; sdpa and flex attention are refused
    by name when the model is built with them and when set later (the model stays eager); without sinks they run.
    Tensor parallelism, which would split the heads but not their sinks, is refused too."""
    model = layout_model(randomize, LAYOUTS["sinks"])
    assert model.config._attn_implementation == "eager"
    for kernel in ("sdpa", "flex_attention"):
        message = rf"attn_implementation='{kernel}' cannot apply attention_sinks=True.*attn_implementation='eager'"
        with pytest.raises(ValueError, match=message):
            DecoderLabForCausalLM(DecoderLabConfig(**SIZES, attention_sinks=True, attn_implementation=kernel))
        with pytest.raises(ValueError, match=message):
            model.set_attn_implementation(kernel)
        assert model.config._attn_implementation == "eager"
        plain = DecoderLabForCausalLM(DecoderLabConfig(**SIZES, attn_implementation=kernel))
        assert plain.config._attn_implementation == kernel
    with pytest.raises(ValueError, match="attention_sinks' logits"):
        check_tensor_parallel(model.config, 2)


@pytest.mark.parametrize("checked", [True, False], ids=["vllm-with-check_sinks", "vllm-without"])
def test_sinks_go_to_vllms_attention_only_where_it_checks_that_they_arrive(randomize, monkeypatch, checked):
    """vLLM's Transformers backend registers its attention as "vllm" and takes each layer's sinks from the ``s_aux=``
    argument of the one attention call in DecoderLabAttention.forward: a model with sinks is built on that kernel
    only where the module registering it also has vLLM's ``check_sinks`` (which stops the engine if its attention did
    not take them), and each layer then hands the kernel its own sinks; without that check (a vLLM that could drop
    them) it is refused by name. Models without sinks hand it None. Here a stand-in for vLLM's module computes what
    the eager attention with sinks computes, with its own causal mask (as vLLM's kernel, which reads no mask)."""
    backend = types.ModuleType("stand_in_for_vllm_backend")
    handed = []

    def vllm_attention(module, query, key, value, attention_mask, **kwargs):
        handed.append(kwargs["s_aux"])
        T, S = query.shape[-2], key.shape[-2]
        causal = torch.full((T, S), torch.finfo(query.dtype).min).triu(S - T + 1)
        return module.eager_attention(module, query, key, value, causal, **kwargs)  # with sinks where it has them

    vllm_attention.__module__ = backend.__name__
    if checked:
        backend.check_sinks = lambda *args: None
    monkeypatch.setitem(sys.modules, backend.__name__, backend)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "vllm", vllm_attention)
    eager = layout_model(randomize, LAYOUTS["sinks"])
    if not checked:
        with pytest.raises(ValueError, match=r"This vLLM cannot apply attention_sinks=True: .* \(check_sinks\)"):
            eager.set_attn_implementation("vllm")
        return
    on_vllm = copy.deepcopy(eager)
    on_vllm.set_attn_implementation("vllm")
    assert on_vllm.config._attn_implementation == "vllm"
    ids = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(on_vllm(ids).logits, eager(ids).logits, rtol=0, atol=0)
    assert [id(sinks) for sinks in handed] == [id(layer.self_attn.sinks) for layer in on_vllm.model.layers]
    handed.clear()
    plain = layout_model(randomize, {}, "vllm")
    with torch.no_grad():
        plain(ids)
    assert handed == [None] * 4


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padding"])
def test_the_decoding_fast_path_keeps_the_window(randomize, padded):
    """generate()'s decoding steps on a CPU take DecodingStepFastPath's short preparation (GenerationMixin's own runs
    for the prompt alone), which hands the model the 2D mask and the cache, so the window comes from the same masks
    and sliding cache layers: greedy tokens 30 past the window, left-padded too, equal those of GenerationMixin's own
    preparation at every step and of decoding without a cache."""
    model = layout_model(randomize, LAYOUTS["mix"])
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    prompt = torch.randint(1, 99, (3, 9))
    mask = left_padding(3, 9) if padded else torch.ones_like(prompt)
    greedy = dict(attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False)
    general = GenerationMixin.prepare_inputs_for_generation
    with patch.object(GenerationMixin, "prepare_inputs_for_generation", autospec=True, side_effect=general) as slow:
        fast = model.generate(prompt, **greedy)
    assert slow.call_count == 1  # the prompt; every decoding step took the short path
    with patch.object(DecodingStepFastPath, "SHORT_PATH_KWARGS", frozenset()):  # the short path never applies
        assert torch.equal(model.generate(prompt, **greedy), fast)
    assert torch.equal(model.generate(prompt, use_cache=False, **greedy), fast)


@pytest.mark.parametrize("layout", ["mix", "all sliding"])
def test_sliding_caches_stay_at_the_window_and_cached_decoding_is_exact(randomize, layout):
    """Decoding 40 tokens one at a time far past the window: each sliding layer's cache holds sliding_window - 1
    keys and values (all its next query needs besides its own), each full layer's every token; every step's logits
    equal one pass over the whole sequence, as do chunks of 5 fed through the cache; generate() gives the same tokens
    with and without the cache."""
    model = layout_model(randomize, LAYOUTS[layout])
    ids = torch.randint(0, 99, (2, 46))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6], use_cache=True)
        steps = [out.logits]
        for t in range(6, 46):
            out = model(ids[:, t : t + 1], cache=compat.output_cache(out), use_cache=True)
            steps.append(out.logits)
        chunks, cache = [], None
        for start in range(0, 46, 5):
            out = model(ids[:, start : start + 5], cache=cache, use_cache=True)
            chunks.append(out.logits)
            cache = compat.output_cache(out)  # out.cache from transformers 5.24
    for kind, layer in zip(model.config.layer_types, cache.layers):
        assert type(layer) is (DynamicSlidingWindowLayer if kind == S else DynamicLayer)
        assert layer.keys.shape[-2] == (WINDOW - 1 if kind == S else 46)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-5)
    greedy = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
    prompt = ids[:, :6]
    assert torch.equal(
        model.generate(prompt, use_cache=True, **greedy), model.generate(prompt, use_cache=False, **greedy)
    )


@pytest.mark.skipif(
    compat.minor_version() < (5, 14),
    reason="before transformers 5.14 a sliding cache layer cannot be rolled back (its crop refuses once it is full)",
)
@pytest.mark.parametrize("assistant", ["same model", "prompt lookup"])
def test_speculative_decoding_with_sliding_layers_reproduces_greedy(randomize, assistant):
    """Assisted generation verifies drafted tokens in one cached forward and, for a rejected draft, rolls the cache
    back, sliding layers' included (transformers keeps their past until the crop): greedy tokens 30 past the window
    do not change."""
    model = layout_model(randomize, LAYOUTS["mix"])
    prompt = torch.randint(1, 99, (1, 12))
    prompt[0, 6:] = prompt[0, :6]  # a repeat for prompt lookup to find
    greedy = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
    speculation = {"same model": dict(assistant_model=copy.deepcopy(model)),
                   "prompt lookup": dict(prompt_lookup_num_tokens=3)}[assistant]  # fmt: skip
    assert torch.equal(model.generate(prompt, **greedy, **speculation), model.generate(prompt, **greedy))


def test_static_cache_and_compiled_decoding_run_a_sliding_layout(randomize):
    """A static cache (its sliding layers as bounded as the dynamic cache's) decodes a mixed layout's tokens, left
    padding included (generate() then makes one mask per attention type itself); decoderlab's compiled decoding,
    forced on with TorchDynamo's eager backend, gives eager decoding's tokens 30 tokens past the window, no fallback."""
    model = layout_model(randomize, LAYOUTS["mix"])
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    prompt = torch.randint(1, 99, (2, 7))
    padding = torch.ones_like(prompt)
    padding[0, :3] = 0
    greedy = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False)
    for mask in (None, padding):
        dynamic = model.generate(prompt, attention_mask=mask, **greedy)
        assert torch.equal(
            model.generate(prompt, attention_mask=mask, cache_implementation="static", **greedy), dynamic
        )
    eager = model.generate(prompt, **greedy)
    assert set_compiled_decoding(model, "on", backend="eager") is True
    with torch.no_grad():
        assert torch.equal(generate(model, prompt, **greedy), eager)
    assert compiled_decoding_is_on(model) and hasattr(model, "_compiled_call")


# ----------------------------------------------------------------------------------------------
# transformers' own classes, weights copied across

WIDE = 8  # the window of the comparisons, on 40 tokens (five windows)
HF_SIZES = {**SIZES, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
            "tie_word_embeddings": False, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}  # fmt: skip


def decoderlab_twin(theirs, randomize, **layout) -> DecoderLabForCausalLM:
    """``theirs`` re-drawn, and the decoderlab model with the same state dict (the same names: Llama's) and layout."""
    randomize(theirs).eval()
    sizes = {k: v for k, v in HF_SIZES.items() if k != "rms_norm_eps"}
    ours = DecoderLabForCausalLM(DecoderLabConfig.from_preset("llama", **sizes, norm_eps=1e-6, **layout)).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours


HF_TWINS = {
    "qwen3 sliding layers": (
        lambda: Qwen3ForCausalLM(
            Qwen3Config(**HF_SIZES, use_sliding_window=True, sliding_window=WIDE, layer_types=[F, S, F, S])
        ),  # fmt: skip
        dict(qk_norm=True, layer_types=[F, S, F, S], sliding_window=WIDE),
    ),
    "mistral window": (
        lambda: MistralForCausalLM(MistralConfig(**HF_SIZES, sliding_window=WIDE)),
        dict(layer_types=[S] * 4, sliding_window=WIDE),
    ),
    "smollm3 rope-free layers": (
        lambda: SmolLM3ForCausalLM(SmolLM3Config(**HF_SIZES, no_rope_layer_interval=2)),
        dict(no_rope_layer_interval=2),
    ),
}


@pytest.mark.parametrize("twin", list(HF_TWINS))
def test_transformers_classes_with_the_same_layout_compute_the_same(randomize, twin):
    """Qwen3 with sliding layers (layer_types, sliding_window), Mistral (one window for every layer) and SmolLM3 (every
    second layer without RoPE): our model with their weights and the same layout gives their logits within 1e-5 on
    40 tokens, five windows, left-padded too, with eager, sdpa and flex attention, and their greedy tokens 30 past
    the window."""
    make, layout = HF_TWINS[twin]
    theirs = make()
    ours = decoderlab_twin(theirs, randomize, **layout)
    if "smollm3" in twin:
        assert ours.config.no_rope_layers == theirs.config.no_rope_layers == [1, 0, 1, 0]
    ids = torch.randint(0, 99, (3, 40))
    padding = left_padding(3, 40)
    theirs.set_attn_implementation("eager")
    with torch.no_grad():
        expected = theirs(ids).logits, theirs(ids, attention_mask=padding).logits
        for kernel in ("eager", "sdpa", "flex_attention"):
            ours.set_attn_implementation(kernel)
            torch.testing.assert_close(ours(ids).logits, expected[0], rtol=0, atol=1e-5, msg=kernel)
            padded = ours(ids, attention_mask=padding).logits
            torch.testing.assert_close(
                padded[padding.bool()], expected[1][padding.bool()], rtol=0, atol=1e-5, msg=kernel
            )
    ours.set_attn_implementation("sdpa")
    prompt = ids[:2, :8]
    greedy = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **greedy), theirs.generate(prompt, **greedy))


@pytest.mark.parametrize("layer_type", [F, S])
def test_one_attention_layer_with_sinks_is_gpt_oss(randomize, layer_type):
    """gpt-oss's attention (eager, its sinks in the softmax's denominator) and ours with attention_sinks, the same
    weights, RoPE tables and mask (causal, or its 6-token window, with left padding) give the same outputs and
    attention weights within 1e-5. One layer only: gpt-oss's blocks end in a mixture of experts with a clamped
    SwiGLU, which no decoderlab MLP computes, so whole models cannot be compared."""
    hf = GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=1,
                      layer_types=[layer_type], sliding_window=6, rope_parameters={"rope_type": "default",
                      "rope_theta": 1e4}, attention_bias=True, vocab_size=99)  # fmt: skip
    hf._attn_implementation = "eager"
    theirs = randomize(GptOssAttention(hf, layer_idx=0)).eval()
    config = DecoderLabConfig(**{**SIZES, "num_hidden_layers": 1}, attention_bias=True, attention_sinks=True,
                              layer_types=[layer_type], sliding_window=6 if layer_type == S else None,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e4})  # fmt: skip
    config._attn_implementation = "eager"
    ours = DecoderLabAttention(config, layer_idx=0).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(3, 20, 64)
    padding = left_padding(3, 20)
    i, j = torch.arange(20)[:, None], torch.arange(20)[None]
    window = 6 if layer_type == S else 20
    allowed = (j <= i) & (i - j < window) & padding.bool()[:, None, None, :]
    mask = torch.zeros(3, 1, 20, 20).masked_fill(~allowed, torch.finfo(torch.float32).min)
    positions = torch.arange(20)[None]
    with torch.no_grad():
        expected, expected_weights = theirs(x, GptOssRotaryEmbedding(hf)(x, positions), mask)
        out, weights = ours(x, DecoderLabRotaryEmbedding(config)(x, positions), mask)
    real = padding.bool()
    torch.testing.assert_close(out[real], expected[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=1e-5)
    assert (weights.sum(-1) < 0.99).any()  # the sinks took some of the attention


# ----------------------------------------------------------------------------------------------
# The sinks' role, and bad layouts


def test_sinks_are_a_role_of_their_own_drawn_as_gpt_oss_draws_them():
    """Each layer's self_attn.sinks has the role attention_sink: AdamW in the "other" group, no weight decay, under
    either optimizer and parametrization; it starts normal with std initializer_range (gpt-oss's _init_weights), here
    measured over 2 x 2048 heads, and a model without the switch has no such parameter."""
    config = DecoderLabConfig(vocab_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=2048, head_dim=2,
                              num_key_value_heads=1, intermediate_size=8, attention_sinks=True, initializer_range=0.05)  # fmt: skip
    model = DecoderLabForCausalLM(config)
    roles = model.parameter_roles()
    sinks = [name for name in roles if name.endswith("self_attn.sinks")]
    assert sinks == ["model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"]
    assert all(roles[name].role == "attention_sink" for name in sinks)
    for optimizer in ("adamw", "muon"):
        for parametrization in ("standard", "mup"):
            rule = rule_for("attention_sink", optimizer, parametrization)
            assert (rule.group, rule.update, rule.decay) == ("other", "adamw", None)
    drawn = torch.cat([dict(model.named_parameters())[name].detach() for name in sinks])
    assert init_std(roles[sinks[0]], config) == 0.05
    assert drawn.std().item() == pytest.approx(0.05, rel=0.05) and abs(drawn.mean().item()) < 0.005
    assert not any("sinks" in name for name, _ in DecoderLabForCausalLM(DecoderLabConfig(**SIZES)).named_parameters())


def test_smollm3s_interval_gives_smollm3s_list():
    """no_rope_layer_interval=n derives no_rope_layers as SmolLM3Config does (every n-th layer 0, counting from 1),
    and without either field every layer of a RoPE model applies RoPE; a model without RoPE has no list."""
    for interval, layers in ((4, 8), (2, 5), (1, 3), (7, 3)):
        theirs = SmolLM3Config(no_rope_layer_interval=interval, num_hidden_layers=layers, pad_token_id=None)
        ours = DecoderLabConfig(no_rope_layer_interval=interval, num_hidden_layers=layers)
        assert ours.no_rope_layers == theirs.no_rope_layers, interval
    assert DecoderLabConfig(num_hidden_layers=3).no_rope_layers == [1, 1, 1]
    assert DecoderLabConfig(num_hidden_layers=3).layer_types == [F, F, F]
    assert DecoderLabConfig(position_embedding_type="learned", no_rope_layers=[1] * 12).no_rope_layers is None


BAD_LAYOUTS = {
    "layer_types too short": (dict(layer_types=[F, S], sliding_window=4),
                              r"layer_types has 2 entries, but num_hidden_layers=3: give one attention type per layer"),
    "unknown layer type": (dict(layer_types=[F, "chunked_attention", F]),
                           r"layer_types\[1\]='chunked_attention' is not an attention type.*'full_attention', "
                           r"'sliding_attention'"),
    "window of zero": (dict(layer_types=[S, F, F], sliding_window=0), r"sliding_window must be a positive.*got 0"),
    "negative window": (dict(layer_types=[S, F, F], sliding_window=-3), r"sliding_window must be a positive.*got -3"),
    "no window": (dict(layer_types=[S, F, S]), r"layer_types makes layers \[0, 2\] 'sliding_attention', but "
                                               r"sliding_window is None: set sliding_window"),
    "rope-free list without rope": (dict(position_embedding_type="learned", no_rope_layers=[1, 0, 1]),
                                    r"no_rope_layers=\[1, 0, 1\] makes layers skip RoPE, but position_embedding_type="
                                    r"'learned' rotates no layer"),
    "interval without rope": (dict(position_embedding_type="none", no_rope_layer_interval=2),
                              r"no_rope_layer_interval=2 makes layers skip RoPE, but position_embedding_type='none'"),
    "rope-free list too long": (dict(no_rope_layers=[1, 0, 1, 0]), r"no_rope_layers has 4 entries, but "
                                                                   r"num_hidden_layers=3: give one per layer, 1 where"),
    "rope-free list of other values": (dict(no_rope_layers=[1, 2, 1]), r"no_rope_layers\[1\]=2: each entry is 1 \(the "
                                                                       r"layer applies RoPE\) or 0"),
    "interval of zero": (dict(no_rope_layer_interval=0), r"no_rope_layer_interval must be a positive integer.*got 0"),
    "list and interval disagree": (dict(no_rope_layers=[1, 1, 1], no_rope_layer_interval=2),
                                   r"no_rope_layers=\[1, 1, 1\] and no_rope_layer_interval=2 disagree \(the interval "
                                   r"gives \[1, 0, 1\]\): pass one of them"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_LAYOUTS))
def test_bad_layouts_are_refused_when_the_config_is_built(case):
    """Each bad layout is one ValueError from DecoderLabConfig, naming the field, the value and what to do (before
    transformers' own checks, whose messages say less)."""
    fields, message = BAD_LAYOUTS[case]
    with pytest.raises(ValueError, match=message):
        DecoderLabConfig(num_hidden_layers=3, **fields)
