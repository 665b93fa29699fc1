"""The speed paths of decoderlab compute what the plain paths compute (never timings: see benchmarks/).

- RMSNorm: training goes through a hand-written backward (``RMSNormFunction``), inference through one
  ``F.rms_norm`` call; both against LlamaRMSNorm and against autograd of the textbook formula.
- Loss: ``causal_lm_loss`` / ``CrossEntropyFunction`` against transformers' ForCausalLMLoss, value and
  gradient, with ignored labels, gradient accumulation, given shift_labels and bfloat16 logits.
- "gelu_new" runs as PyTorch's fused tanh GELU; no dropout modules when dropout is 0.
- The benchmark's references: our nanoGPT re-implementation equals decoderlab built nanoGPT-shaped, and
  the benchmark's GPT-2 pair equals GPT2LMHeadModel; the nanoGPT recipe runs and reports its losses.
"""

import copy
import math
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.models.llama.modeling_llama import LlamaRMSNorm

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
from decoderlab.modeling_decoderlab import CrossEntropyFunction, DecoderLabRMSNorm, RMSNormFunction, causal_lm_loss

# ----------------------------------------------------------------------------------------------
# RMSNorm


def textbook_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def norms_with_weight(weight: torch.Tensor) -> tuple[DecoderLabRMSNorm, LlamaRMSNorm]:
    ours, llama = DecoderLabRMSNorm(weight.numel(), eps=1e-5), LlamaRMSNorm(weight.numel(), eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(weight)
        llama.weight.copy_(weight)
    return ours, llama


def test_rms_norm_equals_llamas_bit_for_bit_with_and_without_autograd():
    """Both paths (the training Function, and F.rms_norm under no_grad) give LlamaRMSNorm's outputs exactly,
    which keeps the Llama-shaped model's logits identical to LlamaForCausalLM's."""
    ours, llama = norms_with_weight(1 + 0.1 * torch.randn(48))
    x = 3 * torch.randn(4, 7, 48)
    expected = llama(x)
    assert torch.equal(ours(x.requires_grad_()), expected)  # RMSNormFunction
    with torch.no_grad():
        assert torch.equal(ours(x), expected)  # F.rms_norm


def test_rms_norm_backward_equals_autograd():
    """The hand-written gradients equal autograd's through the textbook formula, for x and the weight."""
    weight = (1 + 0.1 * torch.randn(48)).requires_grad_()
    x = (3 * torch.randn(4, 7, 48)).requires_grad_()
    grad = torch.randn(4, 7, 48)
    ours = torch.autograd.grad(RMSNormFunction.apply(x, weight, 1e-5), (x, weight), grad)
    expected = torch.autograd.grad(textbook_rms_norm(x, weight, 1e-5), (x, weight), grad)
    for mine, reference in zip(ours, expected):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6)


def test_rms_norm_function_passes_gradcheck():
    """Finite differences in float64 agree with the analytic backward (input and weight)."""
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = (1 + 0.1 * torch.randn(8, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, w: RMSNormFunction.apply(a, w, 1e-6), (x, weight))


def test_rms_norm_bfloat16_matches_llama():
    """bfloat16 input and weight: computed in float32 and cast back like LlamaRMSNorm; gradients close to
    autograd through Llama's module (bfloat16 rounding of the outputs only)."""
    weight = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
    ours, llama = norms_with_weight(weight)
    ours, llama = ours.to(torch.bfloat16), llama.to(torch.bfloat16)
    x = torch.randn(2, 9, 64, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 9, 64, dtype=torch.bfloat16)
    out_ours, out_llama = ours(x), llama(x)
    assert out_ours.dtype == torch.bfloat16 and torch.equal(out_ours, out_llama)
    ours_grads = torch.autograd.grad(out_ours, (x, ours.weight), grad)
    llama_grads = torch.autograd.grad(out_llama, (x, llama.weight), grad)
    for mine, reference in zip(ours_grads, llama_grads):
        assert mine.dtype == torch.bfloat16
        torch.testing.assert_close(mine, reference, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------------------------
# Loss


def loss_and_grad(loss_fn, logits: torch.Tensor, labels: torch.Tensor, **kwargs):
    logits = logits.detach().requires_grad_()
    loss = loss_fn(logits=logits, labels=labels, vocab_size=logits.shape[-1], **kwargs)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss, grad


LOSS_CASES = {
    "mean": {},
    "num_items_in_batch tensor": {"num_items_in_batch": torch.tensor(37)},
    "num_items_in_batch int": {"num_items_in_batch": 29},
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_causal_lm_loss_equals_transformers(case):
    """Same value and same gradient as transformers' ForCausalLMLoss: labels shifted by one, -100 ignored,
    the mean over counted targets or the sum / num_items_in_batch."""
    logits = 4 * torch.randn(2, 11, 50)
    labels = torch.randint(0, 50, (2, 11))
    labels[0, :4] = -100
    labels[1, 7] = -100
    ours = loss_and_grad(causal_lm_loss, logits, labels, **LOSS_CASES[case])
    theirs = loss_and_grad(ForCausalLMLoss, logits, labels, **LOSS_CASES[case])
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-7)


def test_causal_lm_loss_with_shift_labels_and_bfloat16_logits():
    """Pre-shifted labels (shift_labels=) are used as given; bfloat16 logits are computed in float32, as
    ForCausalLMLoss's upcast does, and the gradient comes back in bfloat16."""
    logits = (4 * torch.randn(3, 6, 40)).to(torch.bfloat16)
    shift_labels = torch.randint(0, 40, (3, 6))
    shift_labels[2, 5] = -100
    labels = torch.zeros(3, 6, dtype=torch.long)  # ignored when shift_labels is given
    ours = loss_and_grad(causal_lm_loss, logits, labels, shift_labels=shift_labels)
    theirs = loss_and_grad(ForCausalLMLoss, logits, labels, shift_labels=shift_labels)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.bfloat16
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[1].float(), theirs[1].float(), rtol=1e-2, atol=1e-4)


def test_causal_lm_loss_of_all_ignored_labels_is_nan_like_transformers():
    """Every target ignored: 0 / 0, as F.cross_entropy's mean gives, not a silent 0."""
    logits = torch.randn(1, 4, 10)
    labels = torch.full((1, 4), -100)
    assert math.isnan(causal_lm_loss(logits, labels, 10).item())
    assert math.isnan(ForCausalLMLoss(logits, labels, 10).item())


def test_cross_entropy_function_passes_gradcheck():
    """Finite differences in float64 agree with the backward that writes softmax - one_hot."""
    logits = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, -100, 6, 2, -100])
    assert torch.autograd.gradcheck(lambda z: CrossEntropyFunction.apply(z, targets, -100), (logits,))


def test_model_uses_causal_lm_loss_unless_another_is_assigned(tiny_model):
    """The model's loss is causal_lm_loss; assigning model.loss_function (as transformers allows) wins."""
    model = tiny_model()
    x = torch.randint(0, 99, (2, 9))
    assert model.loss_function is causal_lm_loss
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.sum() * 0 + 7.0
    assert model(x, labels=x).loss.item() == 7.0


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


@pytest.mark.parametrize("bias", [False, True])
def test_linear_few_rows_kernel_equals_f_linear_and_runs_only_where_it_should(bias):
    """DecoderLabLinear computes 1 to 32 rows of float32 on a CPU, without autograd, with its own kernel when
    its weight is large: the output equals F.linear's to float32 rounding, in every input shape, contiguous
    like F.linear's (one row without bias: a strided view, values the same). More rows, autograd, bfloat16
    and small weights take F.linear (identical outputs), and an input of the wrong width gets F.linear's
    error, not a silently reshaped product."""
    torch.manual_seed(0)
    large, small = modeling.DecoderLabLinear(384, 1024, bias=bias), modeling.DecoderLabLinear(128, 128, bias=bias)
    assert large.few_rows_kernel and not small.few_rows_kernel
    assert large.FEW_ROWS_KERNEL_MAX_ROWS == 32
    shapes = ((384,), (1, 384), (1, 1, 384), (2, 384), (8, 1, 384), (4, 8, 384), (32, 384))
    with torch.no_grad(), patch("torch.mm", wraps=torch.mm) as kernel:  # F.linear does not go through torch.mm
        for shape in shapes:
            x = torch.randn(shape)
            y = large(x)
            assert y.shape == (*shape[:-1], 1024)
            assert y.is_contiguous() or (not bias and y.numel() == 1024)  # one row: column 0 of W @ [x, x]^T
            torch.testing.assert_close(y, F.linear(x, large.weight, large.bias), rtol=0, atol=1e-5)
        assert kernel.call_count == len(shapes)
        x = torch.randn(33, 1, 384)
        assert torch.equal(large(x), F.linear(x, large.weight, large.bias))
        assert torch.equal(small(x[:2, :, :128]), F.linear(x[:2, :, :128], small.weight, small.bias))
        bf16 = copy.deepcopy(large).to(torch.bfloat16)
        assert torch.equal(bf16(x[:2].bfloat16()), F.linear(x[:2].bfloat16(), bf16.weight, bf16.bias))
        assert kernel.call_count == len(shapes)
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            large(torch.randn(2, 192))  # 384 numbers: one row's worth, in the wrong shape
    x = torch.randn(2, 1, 384, requires_grad=True)
    with patch("torch.mm", wraps=torch.mm) as kernel:
        large(x).sum().backward()
    assert kernel.call_count == 0 and x.grad is not None and large.weight.grad is not None


def traced_calls(layer: torch.nn.Module, x: torch.Tensor) -> str:
    """The functions dynamo's graph of ``layer(x)`` calls, as one string (no inductor: the traced graph)."""
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(layer, backend=record, fullgraph=True)(x)
    return " ".join(str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function")


def test_linear_kernels_traced_by_torch_compile():
    """Inside torch.compile, one row goes through the reduction (vecdot) in every layer, small ones too; 2 to
    32 rows go through W @ X^T in layers large enough for the few-rows kernel; more rows, and several rows in
    small layers, through F.linear."""
    small, large = modeling.DecoderLabLinear(128, 352), modeling.DecoderLabLinear(384, 1024)
    assert "vecdot" in traced_calls(small, torch.randn(1, 1, 128))
    assert "vecdot" in traced_calls(large, torch.randn(1, 1, 384))
    assert "built-in method mm" in traced_calls(large, torch.randn(8, 1, 384))
    assert "linear" in traced_calls(large, torch.randn(33, 1, 384))
    assert "linear" in traced_calls(small, torch.randn(8, 1, 128))


@pytest.mark.slow
def test_linear_few_rows_inside_torch_compile_equals_f_linear():
    """Compiled with inductor, DecoderLabLinear's output equals F.linear's to float32 rounding for one row (the
    reduction), a few rows (W @ X^T in the large layer) and many rows (F.linear)."""
    torch.manual_seed(0)
    for layer in (modeling.DecoderLabLinear(128, 352), modeling.DecoderLabLinear(384, 1024)):
        compiled = torch.compile(layer, fullgraph=True)
        with torch.no_grad():
            for rows in ((1, 1), (3, 5), (40, 1)):
                x = torch.randn(*rows, layer.in_features)
                torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=1e-5)


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


def test_peft_lora_wraps_the_few_rows_kernel():
    """On a projection wide enough for DecoderLabLinear's few-rows kernel, LoRA's output for one row and
    for a few rows (decoding steps) is the base layer's plus the adapter's, as for 40 rows (F.linear): the
    adapter is not skipped."""
    import peft

    torch.manual_seed(0)
    layer = torch.nn.Sequential()
    layer.add_module("q_proj", modeling.DecoderLabLinear(384, 384, bias=False))
    lora = peft.get_peft_model(layer, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
        x = torch.randn(40, 1, 384)
        one_row, four_rows, many_rows = lora(x[:1]), lora(x[:4]), lora(x)
        base = F.linear(x[:1], layer.q_proj.base_layer.weight)
    torch.testing.assert_close(one_row, many_rows[:1], rtol=0, atol=1e-5)
    torch.testing.assert_close(four_rows, many_rows[:4], rtol=0, atol=1e-5)
    assert (one_row - base).abs().max() > 1e-3
