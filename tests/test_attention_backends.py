"""The attention kernels are interchangeable: eager and SDPA give the same logits for every
position type x block layout x MHA/GQA/MQA, with and without padding, and so does flex attention; the optional outputs
(attention weights, hidden states) have the documented shapes and meaning."""

import pytest
import torch


def left_padding_mask(batch: int, length: int) -> torch.Tensor:
    """(B, T) attention mask: row b starts with 2*b padding positions."""
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        mask[b, : 2 * b] = 0
    return mask


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padding"])
def test_eager_and_sdpa_agree(tiny_model, position_type, block_variant, attention_heads, padded):
    """Same weights, same input: eager and SDPA logits agree to 1e-5 at every real (non-padding) position."""
    model = tiny_model(position_embedding_type=position_type, **block_variant, **attention_heads)
    x = torch.randint(0, 99, (3, 14))
    mask = left_padding_mask(3, 14) if padded else None
    logits = {}
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = model(x, attention_mask=mask).logits
    real = mask.bool() if padded else torch.ones(3, 14, dtype=torch.bool)
    assert torch.isfinite(logits["sdpa"][real]).all()
    torch.testing.assert_close(logits["sdpa"][real], logits["eager"][real], rtol=0, atol=1e-5)


def test_flex_attention_agrees_with_eager_and_decodes_the_same(tiny_model, attention_heads):
    """PyTorch's flex attention (transformers' "flex_attention" backend, compiled on first use): logits equal
    eager's at every real position of a left-padded batch, and greedy generation through the KV cache is
    identical. (Heads of 32: torch's CPU flex kernel is wrong at 16 with AVX2, and such a model is refused there; see
    the next test.)"""
    model = tiny_model(num_hidden_layers=2, head_dim=32, **attention_heads)
    x = torch.randint(0, 99, (3, 14))
    mask = left_padding_mask(3, 14)
    logits, generated = {}, {}
    for implementation in ("eager", "flex_attention"):
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        with torch.no_grad():
            logits[implementation] = model(x, attention_mask=mask).logits
        generated[implementation] = model.generate(x[:1], max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(logits["flex_attention"][mask.bool()], logits["eager"][mask.bool()], rtol=0, atol=1e-5)
    assert torch.equal(generated["flex_attention"], generated["eager"])


def torch_cpu_flex_is_right(head_dim: int) -> bool:
    """Whether torch's compiled flex attention gives SDPA's causal attention on this CPU, for heads of ``head_dim``
    at the sequence lengths where it was seen wrong with AVX2 (8, 24 and 40 tokens), each freshly compiled."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    for length in (8, 24, 40):
        torch._dynamo.reset()
        q, k, v = (torch.randn(3, 4, length, head_dim) for _ in range(3))
        block_mask = create_block_mask(lambda b, h, i, j: i >= j, 3, 4, length, length, device="cpu")
        out = torch.compile(flex_attention)(q, k, v, block_mask=block_mask)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        if not torch.allclose(out, expected, rtol=0, atol=1e-4):
            return False
    return True


@pytest.mark.cpu_features
def test_flex_attention_is_refused_on_a_cpu_whose_kernel_is_wrong(tiny_model):
    """torch's CPU flex attention compiled for AVX2 returns wrong numbers (or NaN) for heads of 16 dimensions: a
    model with such heads refuses flex attention on a CPU exactly where the kernel is wrong (the error names the
    kernel, the head_dim and what to use), and runs it where it is right; heads of 32 run everywhere. Under
    ``make test-avx2`` (kernels held to AVX2) the refusal is the branch taken; on an AVX-512 CPU the other."""
    from decoderlab.modeling_decoderlab import cpu_flex_attention_defect

    right = torch_cpu_flex_is_right(16)
    model = tiny_model(num_hidden_layers=1)  # hidden_size 64, 4 heads: head_dim 16
    assert model.config.head_dim == 16
    model.set_attn_implementation("flex_attention")
    x = torch.randint(0, 99, (2, 24))
    if right:
        assert cpu_flex_attention_defect(16) is None
        with torch.no_grad():
            flex = model(x).logits
        model.set_attn_implementation("eager")
        with torch.no_grad():
            torch.testing.assert_close(flex, model(x).logits, rtol=0, atol=1e-5)
    else:
        with pytest.raises(ValueError, match=r"flex_attention.*head_dim=16.*attn_implementation='sdpa'"):
            model(x)
    assert torch_cpu_flex_is_right(32) and cpu_flex_attention_defect(32) is None


def test_padding_is_masked_out(tiny_model, position_type):
    """With an attention mask, the real tokens' logits do not depend on what sits in the padding."""
    model = tiny_model(position_embedding_type=position_type)
    x = torch.randint(0, 99, (3, 14))
    mask = left_padding_mask(3, 14)
    other = torch.where(mask.bool(), x, (x + 7) % 99)  # different tokens under the padding only
    with torch.no_grad():
        a = model(x, attention_mask=mask).logits[mask.bool()]
        b = model(other, attention_mask=mask).logits[mask.bool()]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_a_left_padded_row_scores_as_it_scores_alone_without_position_ids(tiny_model, position_type):
    """A left-padded batch given only an attention mask (how TRL's GRPO scores its completions) gives each row's real
    tokens the logits of that row alone: absolute positions count from the first real token, as generate() numbers
    them, and relative ones never depended on the offset. With no mask the positions stay 0, 1, 2, ..."""
    model = tiny_model(position_embedding_type=position_type)
    x = torch.randint(0, 99, (3, 14))
    mask = left_padding_mask(3, 14)
    with torch.no_grad():
        batch = model(x, attention_mask=mask).logits
        for row in range(3):
            real = mask[row].bool()
            alone = model(x[row, real][None]).logits[0]
            torch.testing.assert_close(batch[row, real], alone, rtol=0, atol=1e-5)
        unpadded = model(x, attention_mask=torch.ones_like(mask)).logits
        torch.testing.assert_close(unpadded, model(x).logits, rtol=0, atol=0)
        given = model(x, attention_mask=mask, position_ids=torch.arange(14)[None].expand(3, 14)).logits
    if position_type in ("learned", "sinusoidal"):  # positions given explicitly are used as they are
        assert (given[mask.bool()] - batch[mask.bool()]).abs().max() > 1e-3


def test_output_attentions_are_causal_distributions(tiny_model, attention_heads):
    """output_attentions (eager) returns one (B, heads, T, T) tensor per layer; each row sums to 1 and
    puts no weight on future positions."""
    model = tiny_model(**attention_heads)
    model.set_attn_implementation("eager")
    x = torch.randint(0, 99, (2, 9))
    with torch.no_grad():
        attentions = model(x, output_attentions=True).attentions
    assert len(attentions) == model.config.num_hidden_layers
    for weights in attentions:
        assert weights.shape == (2, 4, 9, 9)  # all query heads, even with fewer key/value heads
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 9), rtol=0, atol=1e-5)
        assert weights.triu(1).abs().max() == 0


def test_output_hidden_states(tiny_model, block_variant):
    """output_hidden_states gives num_layers + 1 states: the first layer's input, each layer's output
    (the last one after the final norm), each (B, T, C); the last equals last_hidden_state."""
    model = tiny_model(**block_variant)
    x = torch.randint(0, 99, (2, 9))
    with torch.no_grad():
        out = model.model(x, output_hidden_states=True)
    states = out.hidden_states
    assert len(states) == model.config.num_hidden_layers + 1
    assert all(state.shape == (2, 9, 64) for state in states)
    torch.testing.assert_close(states[0], model.model.embed_tokens(x), rtol=0, atol=0)  # RoPE adds nothing here
    torch.testing.assert_close(states[-1], out.last_hidden_state, rtol=0, atol=0)
