"""Speed tricks for ``modeling_decoderlab.py``, kept beside the reference model instead of inside it.

Each piece computes what the plain PyTorch it replaces computes (the tests compare them), and says in one line
why it exists. The one trick whose pay-off depends on the machine, the linear layers' few-rows product, is used
only where a timing on the machine running it, for that shape and thread count, found it faster. Measured
figures live in ``benchmarks/results/`` and ``benchmarks/notes/kernels.md``, not here.

This file travels inside checkpoints with ``modeling_decoderlab.py`` (transformers copies the files a module
reaches by relative import), so it imports only ``torch`` and ``transformers``.
"""

import time

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils.import_utils import is_torchdynamo_compiling

from .compat_decoderlab import GENERATE_CACHE_KWARG

# ----------------------------------------------------------------------------------------------
# Linear layers: a few rows of float32 on a CPU


def plain_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T as F.linear computes it; x: (rows, in) -> (rows, out)."""
    return F.linear(x, weight)


def few_rows_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same numbers as (weight @ x^T)^T; x: (rows, in) -> (rows, out).

    Why: for a few rows some CPU BLAS builds barely thread X @ W^T (one row: a single-threaded GEMV) but do
    thread W @ X^T. One row is computed as W @ [x, x]^T, keeping one column, since a one-column product is a
    GEMV again. On other machines this is slower, hence ``few_rows_is_faster``."""
    if x.shape[0] == 1:
        pair = x.expand(2, -1).contiguous()  # (2, in): x twice
        return torch.mm(weight, pair.t())[:, :1].t()  # (1, out), a strided view of column 0
    return torch.mm(weight, x.t()).t().contiguous()  # X^T as a view: a row-major copy of it is slower in BLAS


# (out_features, in_features, rows, threads) -> whether few_rows_product beat plain_product when timed here
_FEW_ROWS_FASTER: dict[tuple[int, int, int, int], bool] = {}
# The few-rows product must beat F.linear by this factor to be chosen: a tie goes to the plain op
_FEW_ROWS_MARGIN = 0.9
_TIMING_ROUNDS = 5
_TIMING_ROUND_SECONDS = 2e-4


def _best_round(product, x: torch.Tensor, weight: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        product(x, weight)
    return time.perf_counter() - start


def timing_key(out_features: int, in_features: int, rows: int) -> tuple[int, int, int, int]:
    """What a timing is remembered by: the weight's shape, the rows and the current thread count."""
    return out_features, in_features, rows, torch.get_num_threads()


def few_rows_is_faster(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``few_rows_product`` is clearly faster than ``plain_product`` for this shape on this machine at the
    current thread count: timed at its first use (both products alternately, best round of each, a few
    milliseconds at most for a large layer), then remembered."""
    key = timing_key(weight.shape[0], weight.shape[1], x.shape[0])
    faster = _FEW_ROWS_FASTER.get(key)
    if faster is None:
        start = time.perf_counter()
        plain_product(x, weight), few_rows_product(x, weight)  # warm-up: first-touch costs count for neither
        calls = max(1, int(_TIMING_ROUND_SECONDS / max(time.perf_counter() - start, 1e-7)))
        best = {plain_product: float("inf"), few_rows_product: float("inf")}
        for _ in range(_TIMING_ROUNDS):
            for product in best:
                best[product] = min(best[product], _best_round(product, x, weight, calls))
        faster = _FEW_ROWS_FASTER[key] = best[few_rows_product] < _FEW_ROWS_MARGIN * best[plain_product]
    return faster


def forget_kernel_timings() -> None:
    """Drop every remembered timing, so the next calls time the products again (after a change of machine load,
    or in tests)."""
    _FEW_ROWS_FASTER.clear()


class DecoderLabLinear(nn.Linear):
    """``nn.Linear`` (the same parameters and state dict; a subclass, so PEFT and quantizers treat it as one) that
    computes a few rows of float32 on a CPU with ``few_rows_product`` where that was timed faster on this machine.
    Everything else, and always under autograd, inside ``torch.compile``, for other dtypes and devices, and for
    weights that are tensor subclasses (quantized weights), runs ``F.linear``."""

    MAX_FEW_ROWS = 32  # decoding steps of up to 32 sequences; from about 64 rows neither product wins

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Read once: a module attribute costs about as much as a small layer's product, and a decoding step makes
        # hundreds of these calls. A shape already timed slower here goes straight to F.linear.
        weight, bias = self.weight, self.bias
        if is_torchdynamo_compiling():
            # Nothing can be timed inside a traced graph, and reading the rows first would put a guard on the
            # input's length into it (torch.export then refuses a dynamic length beyond MAX_FEW_ROWS)
            return F.linear(x, weight, bias)
        rows = self.few_rows(x)
        if (
            rows
            and _FEW_ROWS_FASTER.get(timing_key(self.out_features, self.in_features, rows)) is not False
            and few_rows_path_applies(x, weight, bias)
        ):
            x2d = x.reshape(rows, self.in_features)
            if few_rows_is_faster(x2d, weight):
                y = few_rows_product(x2d, weight)
                if bias is not None:
                    y = y + bias
                return y.view(*x.shape[:-1], weight.shape[0])  # a tensor-parallel shard has fewer than out_features
        return F.linear(x, weight, bias)

    def few_rows(self, x: torch.Tensor) -> int:
        """The rows of ``x`` when it is 1 to MAX_FEW_ROWS rows of the layer's width, else 0 (a wrong width is left
        to F.linear, which names the mismatch)."""
        rows = x.numel() // self.in_features if x.shape[-1] == self.in_features else 0
        return rows if rows <= self.MAX_FEW_ROWS else 0

    def takes_few_rows_path(self, x: torch.Tensor) -> bool:
        """Whether ``x`` may take the few-rows product (if timed faster): ``few_rows`` and ``few_rows_path_applies``."""
        return bool(self.few_rows(x)) and few_rows_path_applies(x, self.weight, self.bias)


def few_rows_path_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Float32 on a CPU, plain tensors, no autograd, not being traced."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and type(weight) is nn.Parameter  # not a quantized or other tensor subclass
        and weight.dtype == torch.float32
        and (bias is None or type(bias) is nn.Parameter)
        and type(x) is torch.Tensor
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not is_torchdynamo_compiling()
    )


# ----------------------------------------------------------------------------------------------
# RMSNorm with its gradient written out


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or in float64 if it is float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNormFunction(torch.autograd.Function):
    """w * (x / rms(x)) in LlamaRMSNorm's order of ops (identical outputs), with the backward written out:
    with x̂ = x / rms(x), dL/dx = (g * w - x̂ * mean(g * w * x̂)) / rms(x) and dL/dw = sum over tokens of g * x̂.
    Why: autograd's backward of the same forward makes about twice the passes over (B, T, C); here g * x̂ is
    formed once and serves both gradients (its row sums against w, mean(g * w * x̂), are one matrix-vector
    product)."""

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
        x_hat, rstd, weight = ctx.saved_tensors  # x̂ and rstd in float32 (float64 for float64 input)
        grad = upcast(grad)
        C = x_hat.shape[-1]
        grad_x_hat = (grad * x_hat).reshape(-1, C)  # g * x̂: (N, C)
        grad_weight = grad_x_hat.sum(0).to(weight.dtype)
        dot = torch.mv(grad_x_hat, weight.to(grad.dtype)).div_(C).view(rstd.shape)  # mean(g * w * x̂): (..., 1)
        grad_x = torch.addcmul(grad * weight, x_hat, dot, value=-1).mul_(rstd).to(ctx.input_dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's w * (x / rms(x)), computed in float32: under autograd through ``RMSNormFunction``, otherwise
    through ``F.rms_norm``, which runs the same ops in the same order in one call."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormFunction.apply(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


# ----------------------------------------------------------------------------------------------
# Loss


class CrossEntropyFunction(torch.autograd.Function):
    """Sum over rows of -log softmax(logits)[target]; rows whose target is ``ignore_index`` count 0.

    F.cross_entropy(reduction="sum")'s value with fewer (N, V) buffers. Why: F.cross_entropy keeps the
    log-probabilities for its backward, which then allocates a zero-filled gradient for them and a third (N, V)
    tensor for the logits'; here each row keeps only its log-sum-exp (N,), and the backward writes
    softmax - one_hot straight into the logits' gradient.
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


# From this many logits on, the loss goes through CrossEntropyFunction, for its two fewer (N, V) float32 buffers
# (64 MiB each at the threshold); below, through F.cross_entropy, transformers' own call, the faster one at small
# vocabularies (`python -m benchmarks.investigations.loss_paths` times both on this machine)
LEAN_LOSS_MIN_LOGITS = 2**24
# The devices where the lean path was measured to pay, eager: a CPU (benchmarks/results/loss_paths.json). Elsewhere
# the plain F.cross_entropy until a benchmark on that device says otherwise
LEAN_LOSS_DEVICES = frozenset({"cpu"})


def takes_lean_loss_path(num_logits: int, device_type: str = "cpu") -> bool:
    """Whether ``causal_lm_loss`` computes this many logits' loss, on a device of this type, through
    ``CrossEntropyFunction``: eager only. Inside ``torch.compile`` the plain ``F.cross_entropy`` is always taken:
    Inductor fuses its backward into one kernel writing the logits' gradient in their own dtype, where the lean
    backward's in-place ``scatter_add_`` makes it write a float32 gradient the size of the logits first
    (``benchmarks/training_memory.py`` shows the buffer)."""
    return num_logits >= LEAN_LOSS_MIN_LOGITS and device_type in LEAN_LOSS_DEVICES and not is_torchdynamo_compiling()


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
    labels[t + 1]; the mean over targets that are not ``ignore_index``, or their sum / num_items_in_batch when
    that is given (gradient accumulation): through ``F.cross_entropy``, as transformers computes it, or, eager on a
    CPU from ``LEAN_LOSS_MIN_LOGITS`` logits on, through ``CrossEntropyFunction`` (``takes_lean_loss_path``)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    logits = logits.reshape(-1, vocab_size)
    if takes_lean_loss_path(logits.numel(), logits.device.type):
        total = CrossEntropyFunction.apply(logits, targets, ignore_index)
    else:
        total = F.cross_entropy(upcast(logits), targets, ignore_index=ignore_index, reduction="sum")
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


# ----------------------------------------------------------------------------------------------
# Generation: the plain decoding step


class DecodingStepFastPath:
    """A mixin placed before ``GenerationMixin``: ``prepare_inputs_for_generation`` with a short path for the
    common decoding step on a CPU, whose inputs are just the new ids and positions (and, with a dynamic cache, the
    2D mask; with a static cache the causal mask is then made inside ``forward``, inside the compiled graph when
    ``forward`` is compiled). Why: GenerationMixin's general version costs several times more Python per step,
    which is a visible share of a small model's decoding step.

    The short path runs only with the arguments of the newer ``generate`` loops (``next_sequence_length``, and the
    cache under ``cache``, ``past_key_values`` before 5.24), after the prompt, ids on the model's CPU, no
    ``inputs_embeds``, only the keyword arguments below, and no padding where a static cache would want the mask
    expanded to 4D. Everything else is GenerationMixin's, called with exactly the arguments ``generate`` passed.
    """

    SHORT_PATH_KWARGS = frozenset(
        {"next_sequence_length", GENERATE_CACHE_KWARG, "attention_mask", "is_first_iteration", "position_ids"}
        | {"logits_to_keep", "use_cache", "inputs_embeds"}
    )

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, **kwargs) -> dict:
        step = kwargs.get("next_sequence_length")
        cache = kwargs.get(GENERATE_CACHE_KWARG)  # generate() passes it as past_key_values before 5.24
        attention_mask = kwargs.get("attention_mask")
        short_path = (
            step is not None
            and cache is not None
            and not kwargs.get("is_first_iteration")
            and kwargs.get("inputs_embeds") is None
            and kwargs.keys() <= self.SHORT_PATH_KWARGS
            and input_ids.device.type == "cpu"
            and input_ids.device == self.device
            and (attention_mask is None or not cache.is_compileable or bool(attention_mask.all()))
        )
        if not short_path:
            return super().prepare_inputs_for_generation(input_ids, **kwargs)
        # clone: the same contiguous strides at every step, as GenerationMixin gives (a compiled forward relies on it)
        contiguous = torch.contiguous_format
        model_inputs = {"input_ids": input_ids[:, -step:].clone(memory_format=contiguous), "cache": cache}
        for name in ("use_cache", "logits_to_keep"):
            if name in kwargs:
                model_inputs[name] = kwargs[name]
        if (position_ids := kwargs.get("position_ids")) is not None:
            model_inputs["position_ids"] = position_ids[..., -step:].clone(memory_format=contiguous)
        if attention_mask is not None and not cache.is_compileable:
            model_inputs["attention_mask"] = attention_mask
        return model_inputs
