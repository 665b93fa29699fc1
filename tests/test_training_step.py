"""What a GPU training step depends on, checked on a CPU: no host-device synchronisation in a step
between logging steps, no float32 copy of the logits under mixed precision, no graph break in any preset's
training forward and loss, and a loss whose value and gradient are ``F.cross_entropy``'s, eager and compiled."""

import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM, kernels_decoderlab
from decoderlab.configuration_decoderlab import PRESETS
from decoderlab.kernels_decoderlab import causal_lm_loss
from training.args import TrainConfig
from training.data import BlockBatches
from training.loop import make_accelerator, outputs_in_compute_dtype, train

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

LOOP_FILE = "training/loop.py"
# Reading a tensor's value on the host: on CUDA each waits for the device to finish what was queued
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
# Reads that stay on the host on a GPU too: training/data.py counts the tokens of the CPU copies of the batches;
# the model's check_indices reads positions only on a CPU (on an accelerator it is a device-side assertion)
HOST_SIDE = ("training/data.py:", "modeling_decoderlab.py:check_indices:")


def tiny(preset: str = "llama", vocab_size: int = 64) -> DecoderLabForCausalLM:
    sizes = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=vocab_size)
    return DecoderLabForCausalLM(DecoderLabConfig.from_preset(preset, **sizes, max_position_embeddings=128))


@contextlib.contextmanager
def recorded_syncs():
    """Patch the points where a step would wait for the device, recording each call: every read of a tensor's value
    on the host (``READS``) except the ones that stay on the host on a GPU too (``HOST_SIDE``), and
    every blocking ``Tensor.to`` with a device made by the loop itself (on CUDA a copy from pageable memory that
    waits; on a CPU the devices cannot be told apart, so any blocking move the loop makes counts)."""
    events = []

    def caller() -> str:
        """file:function:line of the patched method's caller, and of its caller's (a generator expression's
        function is its own)."""
        frames = [sys._getframe(2), sys._getframe(3)]
        return " < ".join(f"{f.f_code.co_filename}:{f.f_code.co_name}:{f.f_lineno}" for f in frames).replace("\\", "/")

    originals = {name: getattr(torch.Tensor, name) for name in (*READS, "to")}

    def reading(name):
        def read(self, *args, **kwargs):
            where = caller()
            if not any(place in where for place in HOST_SIDE):
                events.append(f"{name} at {where}")
            return originals[name](self, *args, **kwargs)

        return read

    def to(self, *args, **kwargs):
        moves = any(isinstance(a, (torch.device, str)) for a in args) or "device" in kwargs
        if moves and not kwargs.get("non_blocking", False) and LOOP_FILE in (where := caller()):
            events.append(f"blocking to(device) at {where}")
        return originals["to"](self, *args, **kwargs)

    for name in READS:
        setattr(torch.Tensor, name, reading(name))
    torch.Tensor.to = to
    try:
        yield events
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def run_steps(tmp_path, steps: int, mixed_precision: str = "no", model=None, logging_steps: int = 1000
              ) -> tuple[list[str], object]:  # fmt: skip
    torch.manual_seed(0)
    model = model if model is not None else tiny()
    blocks = torch.randint(0, 64, (64, 16))
    cfg = TrainConfig(dataset_name="unused", output_dir=str(tmp_path / f"run{steps}-{logging_steps}"),
                      max_train_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      logging_steps=logging_steps,
                      eval_steps=None, checkpointing_steps=None, per_device_eval_batch_size=8,
                      mixed_precision=mixed_precision, learning_rate=1e-3, num_warmup_steps=0)  # fmt: skip
    # bf16 in software where the CPU has no bf16 instructions: slower, the same dtypes (what these tests check)
    accelerator = make_accelerator(cfg, cpu=True)
    with recorded_syncs() as events:
        result = train(model, BlockBatches(blocks, 4, seed=0), blocks[:8], cfg, accelerator, show_progress=False)
    return events, result


def test_a_training_step_does_not_wait_for_the_device(tmp_path):
    """Two and six optimizer steps (2 micro-batches each, logging only at the last step, no evaluation or
    checkpoint before the end) make the same host-device synchronisations: the ones of the last step's log and
    the final evaluation, none per step. Fails on a per-step ``.item()``, ``bool()`` of a device value or the
    blocking copy of the target count the loop once made."""
    two, _ = run_steps(tmp_path, 2)
    six, result = run_steps(tmp_path, 6)
    assert result.state.step == 6
    assert sorted(six) == sorted(two), f"per-step synchronisation: 2 steps {sorted(two)}, 6 steps {sorted(six)}"


def test_the_loop_reads_the_device_once_per_row_whatever_it_logs(tmp_path):
    """The rows' gradient norm, update ratios, spike count, FLOPs and MFU add no wait per step: the host reads and
    blocking copies of a run depend on how many rows it logs, not on its steps (6 steps logged every 2 make exactly
    those of 12 steps logged every 4), and each row costs the same (12 steps logged every 2, 6 rows, make those of
    one row plus 5 times a row's; one row costs at least one read)."""
    reads = {(steps, every): run_steps(tmp_path, steps, logging_steps=every) for steps, every in
             ((6, 2), (12, 4), (12, 12), (12, 2))}  # fmt: skip
    assert all(key in reads[12, 2][1].history[0] for key in ("grad_norm", "update_rms/matrices", "mfu", "flops"))
    count = {key: len(events) for key, (events, _) in reads.items()}
    assert sorted(reads[6, 2][0]) == sorted(reads[12, 4][0]), "the reads depend on the steps, not the rows"
    per_row = (count[12, 4] - count[12, 12]) / 2
    assert per_row >= 1 and count[12, 2] == count[12, 12] + 5 * per_row, count


def test_the_loop_keeps_the_loss_the_mean_over_every_target(tmp_path):
    """The count of targets now crosses to the device without blocking: the loss is still the mean over every
    target of the step's micro-batches (the first logged loss equals the model's plain mean loss on the same
    8 blocks before any update)."""
    torch.manual_seed(0)
    model = tiny()
    blocks = torch.randint(0, 64, (64, 16))
    first = next(BlockBatches(blocks, 8, seed=0).iterate(start=0))
    with torch.no_grad():
        expected = model(input_ids=first["input_ids"], labels=first["labels"]).loss.item()
    cfg = TrainConfig(dataset_name="unused", output_dir=str(tmp_path / "run"), max_train_steps=1,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2, logging_steps=1, eval_steps=None,
                      checkpointing_steps=None, mixed_precision="no", max_grad_norm=None)  # fmt: skip
    result = train(model, BlockBatches(blocks, 4, seed=0), blocks[:8], cfg, make_accelerator(cfg, cpu=True),
                   show_progress=False)  # fmt: skip
    assert result.history[0]["train_loss"] == pytest.approx(expected, rel=1e-5)


def test_mixed_precision_training_makes_no_float32_logits(tmp_path):
    """Under bf16 mixed precision Accelerate's ``convert_outputs_to_fp32`` would copy the logits to float32 after
    every forward; in the loop the model returns them in bfloat16 (seen by a forward hook, which runs after that
    wrapper), and the model the loop returns converts again, as Accelerate documents."""
    model = tiny()
    dtypes = []
    model.register_forward_hook(lambda module, args, output: dtypes.append(output.logits.dtype))
    _, result = run_steps(tmp_path, 2, mixed_precision="bf16", model=model)
    assert set(dtypes) == {torch.bfloat16}, dtypes  # 4 training micro-batches and the evaluations
    with torch.no_grad():
        assert result.model(input_ids=torch.randint(0, 64, (1, 8))).logits.dtype == torch.float32


def test_outputs_in_compute_dtype_keeps_the_loss_and_changes_nothing_without_the_wrapper():
    """The same float32 loss with and without Accelerate's float32 wrapper; a model that has none is untouched."""
    accelerator = make_accelerator(TrainConfig(mixed_precision="bf16"), cpu=True)
    model = accelerator.prepare(tiny())
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        wrapped = model(input_ids=ids, labels=ids)
        with outputs_in_compute_dtype(model):
            inside = model(input_ids=ids, labels=ids)
    assert (wrapped.logits.dtype, inside.logits.dtype, inside.loss.dtype) == (torch.float32, torch.bfloat16,
                                                                              torch.float32)  # fmt: skip
    assert inside.loss.item() == wrapped.loss.item()
    plain = tiny()
    forward = plain.forward
    with outputs_in_compute_dtype(plain):
        assert plain.forward == forward


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.cpu_features])], ids=["eager", "compiled"]
)
def test_the_loss_and_its_gradient_are_cross_entropys(monkeypatch, compiled):
    """``causal_lm_loss`` with the lean path enabled from 0 logits (so eager takes it) equals
    ``F.cross_entropy``'s mean over the shifted targets in value and gradient (ignored targets included), eager
    and under ``torch.compile`` (Inductor), where the plain ``F.cross_entropy`` must be the path taken."""
    monkeypatch.setattr(kernels_decoderlab, "LEAN_LOSS_MIN_LOGITS", 0)
    torch.manual_seed(0)
    logits = torch.randn(2, 9, 50, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, 3] = labels[1, 7] = -100
    lean_calls = []
    monkeypatch.setattr(kernels_decoderlab.CrossEntropyFunction, "forward",
                        staticmethod(record_calls(kernels_decoderlab.CrossEntropyFunction.forward, lean_calls)))  # fmt: skip
    loss_of = torch.compile(causal_lm_loss, backend="inductor", fullgraph=True) if compiled else causal_lm_loss
    loss = loss_of(logits, labels, 50)
    (grad,) = torch.autograd.grad(loss, logits)
    reference = logits.detach().clone().requires_grad_()
    expected = F.cross_entropy(reference[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1), ignore_index=-100)
    (expected_grad,) = torch.autograd.grad(expected, reference)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert bool(lean_calls) == (not compiled)  # eager: the lean path; compiled: F.cross_entropy, never traced


def record_calls(function, calls: list):
    def recorded(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return recorded


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_no_graph_break_in_the_training_forward_and_loss(preset):
    """``torch._dynamo.explain`` of each preset's training forward with labels (the loss included), at the GPT-2
    vocabulary's padded size so the loss is past the lean path's threshold: one graph, no break."""
    model = tiny(preset, vocab_size=50304).train()
    ids = torch.randint(0, 50304, (4, 96))  # 4 x 96 x 50304 logits: past LEAN_LOSS_MIN_LOGITS (2^24)
    assert ids.numel() * 50304 >= kernels_decoderlab.LEAN_LOSS_MIN_LOGITS
    explanation = torch._dynamo.explain(lambda x: model(input_ids=x, labels=x, use_cache=False).loss)(ids)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


def test_training_memory_benchmark_measures_saved_and_peak_bytes():
    """``benchmarks.training_memory`` at its quick shape, eager, through the model and through the loop's
    Accelerate set-up: saved bytes and a peak that are positive, the peak at least the largest allocation and the
    saved bytes (both are allocated inside the step), and a goal row comparing decoderlab with nanoGPT."""
    from benchmarks import training_memory

    rows = [training_memory.measure(name, "eager", route, quick=True)
            for name, route in (("nanogpt", "model"), ("decoderlab-gpt2", "model"), ("decoderlab-gpt2", "accelerate"))]  # fmt: skip
    for row in rows:
        assert 0 < row["saved_mb"] <= row["peak_mb"] and 0 < row["largest_mb"][0] <= row["peak_mb"], row
    checks = training_memory.goals(rows)
    assert {(c["model"], c["route"], c["reference"]) for c in checks} == {("decoderlab-gpt2", "model", "nanogpt"),
                                                                         ("decoderlab-gpt2", "accelerate", "nanogpt")}  # fmt: skip


def test_the_lean_loss_is_taken_only_eager_on_a_cpu_from_its_threshold(monkeypatch):
    """Where the lean loss was measured to pay (eager, a CPU, from LEAN_LOSS_MIN_LOGITS logits) it is taken;
    on any other device (meta tensors stand for one here) the plain F.cross_entropy is, the default until a
    benchmark on that device says otherwise."""
    calls = []
    monkeypatch.setattr(kernels_decoderlab.CrossEntropyFunction, "forward",
                        staticmethod(record_calls(kernels_decoderlab.CrossEntropyFunction.forward, calls)))  # fmt: skip
    monkeypatch.setattr(kernels_decoderlab, "LEAN_LOSS_MIN_LOGITS", 100)
    for device, rows, lean in (("cpu", 10, True), ("cpu", 9, False), ("meta", 10, False)):
        calls.clear()
        logits = torch.randn(2, rows // 2, 10, device=device)  # rows x 10 logits
        causal_lm_loss(logits, torch.randint(0, 10, (2, rows // 2), device=device), 10)
        assert bool(calls) == lean, (device, rows)
