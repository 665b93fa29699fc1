"""torchao int8 quantization through transformers' TorchAoConfig: a decoderlab checkpoint loads quantized and
generates greedily at batch 1 and 8, with logits close to the unquantized model's.

The sizes are tiny's width (hidden 384, vocabulary 8192, so an 8192 x 384 head) on 2 layers: wide enough that
DecoderLabLinear's few-rows kernel engages on the decoder's projections (384 x 384 = 147456 weights, above its
threshold of 2**17), which is where a quantized weight, a tensor subclass that implements ``linear`` but not
``mm``, must take F.linear instead. TorchAoConfig leaves the output embedding (``lm_head``) in float32 by
default, so the quantized layers are the 14 projections of the two blocks.
"""

import pytest
import torch
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
from torchao.utils import TorchAOBaseTensor
from transformers import AutoModelForCausalLM, TorchAoConfig

TINY_WIDTH = dict(
    vocab_size=8192,
    hidden_size=384,
    num_hidden_layers=2,
    num_attention_heads=6,
    max_position_embeddings=256,
    pad_token_id=0,
)

QUANTIZATIONS = {
    "int8_weight_only": Int8WeightOnlyConfig,
    "int8_dynamic_activation_int8_weight": Int8DynamicActivationInt8WeightConfig,
}

# Logits from the randomized weights have std 1. Per-channel symmetric int8 rounds each weight by at most half a
# step, 1/254 of its row's largest magnitude; the dynamic config also rounds each token's activations to int8.
# Measured over 8 x 16 positions (torchao 0.18, F.linear for every layer): largest |logit error| 0.06 weight-only,
# 0.11 with int8 activations; mean 0.010 and 0.017. The bounds leave 2-4x of margin and still fail on any real
# mistake (a wrong scale, a transposed or unquantized-then-dropped weight gives errors of order 1).
LOGIT_ATOL = 0.25
LOGIT_MEAN_ATOL = 0.05
# The dynamic config multiplies int8 activations by int8 weights in torch._int_mm (oneDNN). On a CPU without VNNI
# instructions (AVX2 only, like most laptops; or ONEDNN_MAX_CPU_ISA=AVX2) that product is not exact: the pairs of
# 8-bit products are summed in 16 bits and saturate, so int8 activations lose more. Measured there (4 seeds, the
# same sizes): largest |logit error| 0.25-0.28, mean 0.035-0.037, against 0.11 and 0.017 with an exact product. Which
# bounds apply is decided by trying the product on this machine (int_mm_is_exact), not by reading CPU flags.
SATURATING_LOGIT_ATOL = 0.5
SATURATING_LOGIT_MEAN_ATOL = 0.08


def int_mm_is_exact() -> bool:
    """Whether torch._int_mm gives the exact int32 product of int8 matrices on this CPU (it does with VNNI or AMX)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (16, 384), dtype=torch.int8, generator=generator)
    b = torch.randint(-128, 128, (384, 384), dtype=torch.int8, generator=generator)
    return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())


def logit_bounds(quantization: str) -> tuple[float, float]:
    """(largest, mean) |logit error| allowed for ``quantization`` on this machine."""
    if quantization == "int8_dynamic_activation_int8_weight" and not int_mm_is_exact():
        return SATURATING_LOGIT_ATOL, SATURATING_LOGIT_MEAN_ATOL
    return LOGIT_ATOL, LOGIT_MEAN_ATOL


@pytest.fixture
def checkpoint(tmp_path, tiny_model):
    """A saved decoderlab checkpoint of tiny's width with randomized (unit-scale) weights."""
    tiny_model(**TINY_WIDTH).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
def test_int8_quantized_checkpoint_generates(checkpoint, quantization, batch_size):
    """from_pretrained(quantization_config=TorchAoConfig(...)) quantizes every decoder projection; greedy generate
    runs (prefill and decoding steps, the few-rows case of every layer); the quantized model's logits on the
    generated sequence stay within int8 rounding of the unquantized model's, and each token it picked is the
    unquantized model's choice up to that rounding (greedy tokens may differ where two logits nearly tie). The
    bounds of int8 activations are looser where this CPU's int8 product saturates (``int_mm_is_exact``)."""
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    quantized = AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=TorchAoConfig(QUANTIZATIONS[quantization]())
    ).eval()
    projections = {
        name: module.weight for name, module in quantized.model.named_modules() if isinstance(module, torch.nn.Linear)
    }
    assert len(projections) == 14
    assert all(isinstance(weight, TorchAOBaseTensor) for weight in projections.values()), {
        name: type(weight).__name__ for name, weight in projections.items()
    }

    prompt_length, new_tokens = 6, 10
    prompts = torch.randint(1, TINY_WIDTH["vocab_size"], (batch_size, prompt_length))
    sequences = quantized.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    assert sequences.shape == (batch_size, prompt_length + new_tokens)

    with torch.no_grad():
        expected = reference(sequences).logits  # (B, T, V)
        logits = quantized(sequences).logits
    error = (logits - expected).abs()
    atol, mean_atol = logit_bounds(quantization)
    assert error.max() <= atol and error.mean() <= mean_atol, (error.max().item(), error.mean().item())

    # Each generated token against the unquantized logits at the step that chose it: |error| <= atol on both
    # the chosen and the best token bounds the shortfall by 2 * LOGIT_ATOL
    chosen = sequences[:, prompt_length:]  # (B, new_tokens)
    step_logits = expected[:, prompt_length - 1 : -1]  # (B, new_tokens, V): the logits each token was drawn from
    shortfall = step_logits.max(-1).values - step_logits.gather(-1, chosen[..., None]).squeeze(-1)
    assert shortfall.max() <= 2 * atol, shortfall

