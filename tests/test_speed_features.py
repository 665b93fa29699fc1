"""The model's own speed choices compute what the plain paths compute (never timings: see benchmarks/); the
kernels beside the model are tested in test_kernels.py.

- "gelu_new" runs as PyTorch's fused tanh GELU; no dropout modules when dropout is 0; training forwards build no
  KV cache.
- The benchmark's references: our nanoGPT re-implementation equals decoderlab built nanoGPT-shaped, and
  the benchmark's GPT-2 pair equals GPT2LMHeadModel; the nanoGPT recipe runs and reports its losses.
- PEFT's LoRA still wraps the projections.
"""

import math

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache

import decoderlab.modeling_decoderlab as modeling
from benchmarks import reference_nanogpt
from benchmarks.common import (
    Size,
    decoderlab_state_from_nanogpt,
    gpt2_pair,
    llama_pair,
    logits,
    max_logit_difference,
    nanogpt_pairs,
)

# ----------------------------------------------------------------------------------------------
# Activation, dropout


def test_gelu_new_runs_as_pytorchs_tanh_gelu():
    """GPT-2's "gelu_new" becomes PyTorch's fused tanh-approximation GELU: the same formula."""
    x = torch.linspace(-8, 8, 1001)
    assert type(modeling.activation("gelu_new")) is type(ACT2FN["gelu_pytorch_tanh"])
    torch.testing.assert_close(modeling.activation("gelu_new")(x), ACT2FN["gelu_new"](x), rtol=0, atol=1e-6)
    assert type(modeling.activation("silu")) is type(ACT2FN["silu"])


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


def test_training_forward_builds_no_cache_unless_asked(tiny_model):
    """In training mode with gradients on, the forward builds no KV cache (nothing would read it) unless
    use_cache=True is passed; without gradients or in eval mode it builds one as before. Without a cache,
    transformers' mask honours packed position_ids, so examples packed into one row of a training batch
    attend only within themselves even when the training code does not pass use_cache=False."""
    model = tiny_model().train()
    x = torch.randint(0, 99, (2, 10))
    assert model(x, labels=x).cache is None
    assert isinstance(model(x, labels=x, use_cache=True).cache, DynamicCache)
    with torch.no_grad():
        assert isinstance(model(x).cache, DynamicCache)
    assert isinstance(model.eval()(x).cache, DynamicCache)

    model.train()
    first, second = torch.randint(0, 99, (1, 5)), torch.randint(0, 99, (1, 7))
    packed = model(torch.cat((first, second), dim=1), position_ids=torch.tensor([[*range(5), *range(7)]])).logits
    torch.testing.assert_close(packed[:, :5], model(first).logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[:, 5:], model(second).logits, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# The benchmark's references

SMALL = Size(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50, block_size=16, batch_size=2)


def test_nanogpt_reimplementation_equals_decoderlab_nanogpt_shaped():
    """Our nanoGPT re-implementation and decoderlab configured as nanoGPT (learned positions, bias-free
    LayerNorm, exact GELU, tied embeddings), loaded with the same weights, give the same logits: the
    benchmark's "same weights" nanoGPT pair compares implementations, not models."""
    same_weights = nanogpt_pairs(SMALL)[0]
    with torch.no_grad():  # larger weights than the 0.02 init, so that a 1e-5 tolerance means something
        for param in same_weights.reference.parameters():
            param.normal_(0.0, 0.5)
    same_weights.ours.load_state_dict(
        decoderlab_state_from_nanogpt(same_weights.reference.state_dict(), SMALL.hidden_size)
    )
    x = torch.randint(0, SMALL.vocab_size, (3, SMALL.block_size))
    torch.testing.assert_close(logits(same_weights.ours, x), logits(same_weights.reference, x), rtol=0, atol=1e-5)
    assert logits(same_weights.ours, x).abs().max() > 1  # not vanishing logits


def test_benchmark_pairs_agree():
    """The Llama and GPT-2 pairs built for the speed benchmark hold the same weights (logits agree);
    the Llama-shaped one exactly."""
    assert max_logit_difference(llama_pair(SMALL), SMALL) == 0.0
    assert max_logit_difference(gpt2_pair(SMALL), SMALL) < 1e-5


def test_nanogpt_recipe_runs_and_reports(tmp_path):
    """A few steps of the reference recipe: the documented keys, losses that start near ln(65) (uniform over
    Tiny Shakespeare's 65 characters) and are finite, steps 0..max_iters inclusive, and torch's thread count
    restored afterwards."""
    threads = torch.get_num_threads()
    result = reference_nanogpt.run_nanogpt_recipe(max_iters=4, eval_interval=2, eval_iters=1, num_threads=1)
    assert torch.get_num_threads() == threads
    assert result["steps"] == 5 and [h["iter"] for h in result["history"]] == [0, 2, 4]
    assert abs(result["history"][0]["val"] - math.log(65)) < 0.3
    for key in ("wall_time_s", "train_time_s", "tokens_per_s", "val_loss", "val_loss_every_window"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["model_config"]["vocab_size"] == 65 and result["recipe"]["lr_decay_iters"] == 4


def test_nanogpt_learning_rate_schedule():
    """nanoGPT's schedule: linear warm-up (it + 1) / (warmup + 1), cosine to min_lr at lr_decay_iters, then flat."""
    recipe = reference_nanogpt.NanoGPTRecipe()
    assert reference_nanogpt.learning_rate_at(0, recipe) == pytest.approx(1e-3 / 101)
    assert reference_nanogpt.learning_rate_at(99, recipe) == pytest.approx(1e-3 * 100 / 101)
    assert reference_nanogpt.learning_rate_at(100, recipe) == pytest.approx(1e-3)
    assert reference_nanogpt.learning_rate_at(1050, recipe) == pytest.approx((1e-3 + 1e-4) / 2)
    assert reference_nanogpt.learning_rate_at(2000, recipe) == pytest.approx(1e-4)
    assert reference_nanogpt.learning_rate_at(5000, recipe) == pytest.approx(1e-4)


def test_nanogpt_data_is_the_character_split():
    """65 characters, the first 90% for training: the split nanoGPT's prepare.py writes."""
    data = reference_nanogpt.load_char_data()
    assert data.vocab_size == 65
    assert len(data.train) == 1_003_854 and len(data.val) == 111_540
    with pytest.raises(ValueError, match="Tiny Shakespeare not found"):
        reference_nanogpt.load_char_data("/nonexistent/input.txt")


def test_peft_lora_still_targets_q_and_v_projections(tiny_model):
    """The speed paths leave the projections as nn.Linear modules called as modules, so PEFT's LoRA on
    q_proj/v_proj wraps them, changes the output once its B matrices are non-zero, and trains (gradients
    reach only the adapters through the custom RMSNorm and loss backward passes)."""
    import peft  # a dev dependency; imported here because it is slow to import

    model = tiny_model()
    x = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        before = model(x).logits
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    wrapped = {name for name, module in lora.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)}
    assert len(wrapped) == 2 * 2 and all(name.endswith(("q_proj", "v_proj")) for name in wrapped)
    with torch.no_grad():
        torch.testing.assert_close(lora(x).logits, before, rtol=0, atol=0)  # B = 0: LoRA starts as identity
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
        assert (lora(x).logits - before).abs().max() > 1e-3
    lora.train()
    lora(x, labels=x).loss.backward()
    with_grad = {name for name, param in lora.named_parameters() if param.grad is not None}
    assert with_grad and all("lora_" in name for name in with_grad)
