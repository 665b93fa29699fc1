"""The kernels beside the model (decoderlab/kernels_decoderlab.py) compute what the plain ops compute, and the
machine-dependent one is chosen by measurement (never timings asserted: see benchmarks/).

- DecoderLabLinear: the few-rows product equals F.linear in every shape; it is chosen only where timed faster
  (a path made artificially slow loses), and never under autograd, torch.compile, other dtypes or tensor
  subclasses; PEFT's LoRA on top is not skipped and still finds q_proj and v_proj; Llama's greedy tokens with
  the product forced on.
- RMSNorm: training goes through a hand-written backward (``RMSNormFunction``), inference through one
  ``F.rms_norm`` call; both against LlamaRMSNorm and against autograd of the textbook formula.
- Loss: ``causal_lm_loss`` / ``CrossEntropyFunction`` against transformers' ForCausalLMLoss, value and
  gradient, with ignored labels, gradient accumulation, given shift_labels and bfloat16 logits.
"""

import copy
import math
import time
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import decoderlab.kernels_decoderlab as kernels
from decoderlab import kernels_decoderlab
from decoderlab.kernels_decoderlab import CrossEntropyFunction, DecoderLabLinear, RMSNormFunction, causal_lm_loss
from decoderlab.modeling_decoderlab import DecoderLabRMSNorm

# ----------------------------------------------------------------------------------------------
# Linear layers


@pytest.fixture(autouse=True)
def _fresh_timings():
    """Every test starts with no remembered kernel timing, and leaves none behind."""
    kernels.forget_kernel_timings()
    yield
    kernels.forget_kernel_timings()


def slow(product, seconds=2e-2):
    """``product`` made slower by far more than a busy machine's preemption can add to the other product's best of
    five timing rounds (a 64 x 256 product takes microseconds; 2 ms was seen to lose on a machine at load 8)."""

    def slowed(x, weight):
        time.sleep(seconds)
        return product(x, weight)

    return slowed


SHAPES = ((384,), (1, 384), (1, 1, 384), (2, 384), (8, 1, 384), (4, 8, 384), (32, 384))


@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_product_equals_f_linear_in_every_shape(bias):
    """With the few-rows product chosen, 1 to 32 rows give F.linear's output to float32 rounding, in every input
    shape, contiguous like F.linear's (one row without bias: a strided view, values the same), and an input of
    the wrong width gets F.linear's error, not a silently reshaped product."""
    torch.manual_seed(0)
    layer = DecoderLabLinear(384, 1024, bias=bias)
    with torch.no_grad(), patch.object(kernels, "few_rows_is_faster", return_value=True) as chosen:
        for shape in SHAPES:
            x = torch.randn(shape)
            y = layer(x)
            assert y.shape == (*shape[:-1], 1024)
            assert y.is_contiguous() or (not bias and y.numel() == 1024)
            torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=0, atol=1e-5)
        assert chosen.call_count == len(SHAPES)
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            layer(torch.randn(2, 192))  # 384 numbers: one row's worth, in the wrong shape


def test_selection_picks_whichever_product_is_faster_here():
    """The choice is a timing on this machine, per shape and thread count: with the few-rows product made
    artificially slow, F.linear is chosen, and with F.linear's product made slow, the few-rows product; the
    choice is remembered (no second timing) until forgotten, and a different number of rows is timed anew."""
    layer = DecoderLabLinear(64, 256, bias=False)
    x = torch.randn(4, 64)
    with torch.no_grad():
        with patch.object(kernels, "few_rows_product", slow(kernels.few_rows_product)):
            assert not kernels.few_rows_is_faster(x, layer.weight)
        kernels.forget_kernel_timings()
        with patch.object(kernels, "plain_product", slow(kernels.plain_product)):
            assert kernels.few_rows_is_faster(x, layer.weight)
            with patch.object(kernels, "few_rows_product", wraps=kernels.few_rows_product) as product:
                torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=0, atol=1e-5)
                assert product.call_count == 1  # the remembered choice: no timing, one product
                layer(x[:2])  # 2 rows: a new key, timed (several calls) before the product
                assert product.call_count > 2
    key = (256, 64, 4, torch.get_num_threads())
    assert kernels._FEW_ROWS_FASTER[key] is True


def test_a_shape_timed_slower_goes_straight_to_f_linear():
    """Once a shape has been timed slower with the few-rows product, its later calls take F.linear at once: no
    eligibility check, no timing, no few-rows product (a decoding step makes hundreds of these calls)."""
    layer = DecoderLabLinear(64, 256, bias=True)
    x = torch.randn(3, 1, 64)
    with torch.no_grad(), patch.object(kernels, "few_rows_product", slow(kernels.few_rows_product)):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # timed here: F.linear wins
    assert kernels._FEW_ROWS_FASTER[(256, 64, 3, torch.get_num_threads())] is False
    with (
        torch.no_grad(),
        patch.object(kernels, "few_rows_path_applies", wraps=kernels.few_rows_path_applies) as applies,
        patch.object(kernels, "few_rows_is_faster", wraps=kernels.few_rows_is_faster) as timed,
        patch.object(kernels, "few_rows_product", wraps=kernels.few_rows_product) as product,
    ):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        layer(x[:2])  # two rows: not timed yet, so checked and timed
    assert applies.call_count == 1 and timed.call_count == 1
    assert product.call_count > 0  # the timing of the two-row shape ran it


def test_layers_take_f_linear_where_the_few_rows_path_does_not_apply():
    """Even where the few-rows product would be chosen: more than 32 rows, autograd, bfloat16, a weight that is
    a tensor subclass (a quantized weight) and an input on the meta device all go to F.linear (identical
    outputs), without timing anything."""
    layer = DecoderLabLinear(384, 1024)
    x = torch.randn(33, 1, 384)
    with patch.object(kernels, "few_rows_is_faster", return_value=True) as chosen:
        with torch.no_grad():
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
            bf16 = copy.deepcopy(layer).to(torch.bfloat16)
            assert torch.equal(bf16(x[:2].bfloat16()), F.linear(x[:2].bfloat16(), bf16.weight, bf16.bias))
            meta = copy.deepcopy(layer).to("meta")
            assert meta(x[:2].to("meta")).shape == (2, 1, 1024)

            class Subclass(torch.Tensor):
                pass

            quantized = copy.deepcopy(layer)
            quantized.weight = torch.nn.Parameter(layer.weight.detach().clone().as_subclass(Subclass))
            assert not quantized.takes_few_rows_path(x[:2])
        grad_x = x[:2].clone().requires_grad_()
        layer(grad_x).sum().backward()
        assert grad_x.grad is not None and layer.weight.grad is not None
    assert chosen.call_count == 0


def test_no_few_rows_path_inside_torch_compile():
    """A traced graph calls F.linear for one row and for a few rows: inside torch.compile nothing can be timed, so
    the plain op is used."""
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    layer = DecoderLabLinear(384, 1024)
    with patch.object(kernels, "few_rows_is_faster", return_value=True), torch.no_grad():
        for rows in (1, 8):
            torch._dynamo.reset()
            torch.compile(layer, backend=record, fullgraph=True)(torch.randn(rows, 1, 384))
    calls = [" ".join(str(n.target) for n in g.graph.nodes if n.op == "call_function") for g in graphs]
    assert len(calls) == 2 and all("linear" in c and "mm" not in c for c in calls)


def test_traced_linear_layers_put_no_guard_on_the_number_of_rows():
    """torch.export of a layer with a dynamic number of rows accepts any number, below and above MAX_FEW_ROWS: the
    few-rows choice is not even read while tracing (reading it guarded the rows to <= 32, and torch.export then
    refused a model whose sequence length could exceed it)."""
    layer = DecoderLabLinear(64, 96).eval()
    rows = torch.export.Dim("rows", min=1, max=4 * DecoderLabLinear.MAX_FEW_ROWS)
    with torch.no_grad():
        program = torch.export.export(layer, (torch.randn(8, 64),), dynamic_shapes=({0: rows},)).module()
        for n in (1, DecoderLabLinear.MAX_FEW_ROWS + 1, 4 * DecoderLabLinear.MAX_FEW_ROWS):
            x = torch.randn(n, 64)
            assert torch.equal(program(x), F.linear(x, layer.weight, layer.bias))


def test_peft_lora_wraps_the_few_rows_path():
    """With the few-rows product chosen, LoRA's output for one row and for a few rows (decoding steps) is the base
    layer's plus the adapter's, as for 40 rows (F.linear): the adapter is not skipped."""
    import peft

    torch.manual_seed(0)
    layer = torch.nn.Sequential()
    layer.add_module("q_proj", DecoderLabLinear(384, 384, bias=False))
    lora = peft.get_peft_model(layer, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with torch.no_grad(), patch.object(kernels, "few_rows_is_faster", return_value=True) as chosen:
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
        x = torch.randn(40, 1, 384)
        one_row, four_rows, many_rows = lora(x[:1]), lora(x[:4]), lora(x)
        base = F.linear(x[:1], layer.q_proj.base_layer.weight)
    assert chosen.call_count == 2
    torch.testing.assert_close(one_row, many_rows[:1], rtol=0, atol=1e-5)
    torch.testing.assert_close(four_rows, many_rows[:4], rtol=0, atol=1e-5)
    assert (one_row - base).abs().max() > 1e-3


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


def test_rms_norm_backward_takes_a_gradient_laid_out_in_another_order():
    """An output gradient that is a permuted view (as a transpose in the layer above can hand back) gives the same
    gradients as its contiguous copy: the backward reshapes it, never views it as (tokens, C)."""
    weight = (1 + 0.1 * torch.randn(16)).requires_grad_()
    x = torch.randn(3, 5, 4, 16).requires_grad_()
    grad = torch.randn(3, 4, 5, 16).transpose(1, 2)  # (3, 5, 4, 16), not contiguous
    assert not grad.is_contiguous()
    strided = torch.autograd.grad(RMSNormFunction.apply(x, weight, 1e-5), (x, weight), grad)
    contiguous = torch.autograd.grad(RMSNormFunction.apply(x, weight, 1e-5), (x, weight), grad.contiguous())
    for a, b in zip(strided, contiguous):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


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


@pytest.fixture(params=["F.cross_entropy", "CrossEntropyFunction"])
def loss_path(request, monkeypatch):
    """Each loss test runs through both paths of causal_lm_loss: the threshold moved so that these small logits
    take the lean path too."""
    if request.param == "CrossEntropyFunction":
        monkeypatch.setattr(kernels_decoderlab, "LEAN_LOSS_MIN_LOGITS", 0)
    return request.param


LOSS_CASES = {
    "mean": {},
    "num_items_in_batch tensor": {"num_items_in_batch": torch.tensor(37)},
    "num_items_in_batch int": {"num_items_in_batch": 29},
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_causal_lm_loss_equals_transformers(case, loss_path):
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


def test_causal_lm_loss_with_shift_labels_and_bfloat16_logits(loss_path):
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


def test_causal_lm_loss_of_all_ignored_labels_is_nan_like_transformers(loss_path):
    """Every target ignored: 0 / 0, as F.cross_entropy's mean gives, not a silent 0."""
    logits = torch.randn(1, 4, 10)
    labels = torch.full((1, 4), -100)
    assert math.isnan(causal_lm_loss(logits, labels, 10).item())
    assert math.isnan(ForCausalLMLoss(logits, labels, 10).item())


def test_causal_lm_loss_takes_the_lean_path_from_the_threshold_on(monkeypatch):
    """Logits from LEAN_LOSS_MIN_LOGITS on go through CrossEntropyFunction, smaller ones through F.cross_entropy."""
    calls = []
    monkeypatch.setattr(CrossEntropyFunction, "apply", lambda *args: calls.append(args) or torch.tensor(1.0))
    logits, labels = torch.randn(2, 5, 10), torch.randint(0, 10, (2, 5))  # 100 logits
    for threshold, lean in ((101, False), (100, True), (99, True)):
        calls.clear()
        monkeypatch.setattr(kernels_decoderlab, "LEAN_LOSS_MIN_LOGITS", threshold)
        causal_lm_loss(logits, labels, 10)
        assert bool(calls) == lean, threshold


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
