"""A Llama-shaped decoderlab config is transformers' LlamaForCausalLM: same state dict, same logits, same text.

Llama-shaped: pre-norm RMSNorm, RoPE (rope_theta != 10000 so a wrong base shows), SwiGLU, no biases,
grouped-query attention. The weights are a random LlamaForCausalLM's, re-drawn so the logits are O(1).
"""

from unittest.mock import patch

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import decoderlab.kernels_decoderlab as kernels
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM

SIZES = dict(
    vocab_size=99,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def llama_pair(randomize, tie_word_embeddings: bool, **sizes) -> tuple[LlamaForCausalLM, DecoderLabForCausalLM]:
    sizes = {**SIZES, **sizes}
    rope = {"rope_type": "default", "rope_theta": 5e5}
    llama = LlamaForCausalLM(
        LlamaConfig(
            **sizes,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=None,
            eos_token_id=None,  # Llama's default eos (2) would stop its generations early; ours has none
        )
    )
    randomize(llama).eval()
    if tie_word_embeddings:  # as lm_head, unit-variance embeddings would make every token predict itself
        llama.model.embed_tokens.weight.data.mul_(sizes["hidden_size"] ** -0.5)
    ours = DecoderLabForCausalLM(
        DecoderLabConfig(
            **sizes,
            norm_eps=1e-6,
            rope_parameters=dict(rope),
            tie_word_embeddings=tie_word_embeddings,
            norm_placement="pre",
            norm_type="rmsnorm",
            mlp_type="gated",
            hidden_act="silu",
            position_embedding_type="rope",
        )
    ).eval()
    assert ours.state_dict().keys() == llama.state_dict().keys()
    ours.load_state_dict(llama.state_dict(), strict=True)
    return llama, ours


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_llama_shaped_config_has_llamas_state_dict_and_logits(randomize, tie_word_embeddings):
    """Identical state-dict keys and shapes; logits equal to LlamaForCausalLM's in fp32 (atol 1e-5),
    with and without a padding mask, with tied and untied embeddings."""
    llama, ours = llama_pair(randomize, tie_word_embeddings)
    if tie_word_embeddings:
        assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    for name, tensor in llama.state_dict().items():
        assert ours.state_dict()[name].shape == tensor.shape, name
    x = torch.randint(0, 99, (3, 40))
    mask = torch.ones_like(x)
    mask[0, :7] = 0  # left padding in the first row
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, llama(x).logits, rtol=0, atol=1e-5)
        theirs = llama(x, attention_mask=mask).logits
        mine = ours(x, attention_mask=mask).logits
    torch.testing.assert_close(mine[mask.bool()], theirs[mask.bool()], rtol=0, atol=1e-5)
    assert ours(x).logits.abs().max() > 1.0  # the comparison above is not between near-zero numbers


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_llama_shaped_config_generates_llamas_tokens(randomize, tie_word_embeddings):
    """Greedy generation (KV-cached) gives exactly LlamaForCausalLM's tokens."""
    llama, ours = llama_pair(randomize, tie_word_embeddings)
    prompt = torch.randint(0, 99, (2, 8))
    settings = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
    expected = llama.generate(prompt, **settings)
    assert torch.equal(ours.generate(prompt, **settings), expected)
    assert len(set(expected[:, 8:].flatten().tolist())) > 3  # not a degenerate repeat of one token


@pytest.mark.parametrize("batch_size", [1, 4])
def test_few_rows_decoding_kernel_keeps_llamas_tokens(randomize, batch_size):
    """With DecoderLabLinear's few-rows product chosen for every layer (as on a machine where it times faster),
    the decoding steps' logits stay within float32 rounding of Llama's and greedy generation gives Llama's
    tokens, for one sequence and for a batch; the product really runs."""
    wide = dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6, vocab_size=512)
    llama, ours = llama_pair(randomize, tie_word_embeddings=False, **wide)
    prompt = torch.randint(0, 512, (batch_size, 8))
    settings = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = llama.generate(prompt, **settings)
    kernels.forget_kernel_timings()  # a shape remembered as slower here would skip the forced choice
    with (
        patch.object(kernels, "few_rows_is_faster", return_value=True),
        patch.object(kernels, "few_rows_product", wraps=kernels.few_rows_product) as product,
    ):
        generated = ours.generate(prompt, **settings)
        assert product.call_count > 0
        assert torch.equal(generated, expected)
        with torch.no_grad():  # the last step alone: one row per sequence through every layer, against Llama's
            positions = torch.full((batch_size, 1), 27)
            mine = ours(expected[:, -1:], position_ids=positions).logits
            theirs = llama(expected[:, -1:], position_ids=positions).logits
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_llama_training_step_matches(randomize):
    """The loss and every gradient equal Llama's: same loss function (labels shifted inside) and backward."""
    llama, ours = llama_pair(randomize, tie_word_embeddings=False)
    x = torch.randint(0, 99, (2, 24))
    loss_theirs = llama(x, labels=x).loss
    loss_ours = ours(x, labels=x).loss
    torch.testing.assert_close(loss_ours, loss_theirs, rtol=0, atol=1e-5)
    loss_theirs.backward()
    loss_ours.backward()
    theirs = dict(llama.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)
