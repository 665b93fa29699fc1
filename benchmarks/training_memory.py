"""What one bf16 training step keeps and allocates, compiled and eager: decoderlab against nanoGPT and Llama.

    python -m benchmarks.training_memory --json_out benchmarks/results/training_memory.json
    python -m benchmarks.training_memory --quick    # a tiny shape, compiled with aot_eager: checks that it runs

At a reduced GPT-2 shape (2 layers x 256 wide x 4 heads, block 256, batch 4, vocabulary 50304), bf16 autocast on
a CPU, one forward with the loss and its backward (the optimizer's step is the same for every model and left out),
measured after one untimed step (compilation happens there):

- saved: the bytes autograd keeps for the backward (``torch.autograd.graph.saved_tensors_hooks``: every saved
  tensor's storage once, the parameters themselves not counted), compiled graphs' saved activations included;
- peak: the most bytes allocated at once during the step beyond what was allocated before it (the profiler's
  allocation and free events, ``profile_memory=True``: they come from the CPU allocator, so the buffers compiled
  code allocates count too), the gradients included;
- largest: the largest single allocations of the step, which name a logits-sized buffer when there is one
  (4 x 256 x 50304 logits: 103 MB in float32, 52 MB in bfloat16).

Rows: each model alone (nanoGPT's ``train.py`` way: autocast, forward, backward), and the models the training
script trains through its Accelerate set-up (``training.loop``: ``make_accelerator``, ``accelerator.prepare``,
``outputs_in_compute_dtype``, ``accelerator.backward``). Two rows put back the two choices that each once cost a
GPU step one float32 logits-sized buffer more than nanoGPT's: the lean loss under compile (``CrossEntropyFunction``
taken inside the graph) and Accelerate's float32 copy of the logits. A CPU shows which buffers exist; GPU figures
come from ``benchmarks/gpu_mfu.py``.
"""

from __future__ import annotations

import contextlib
import gc

import torch
from transformers import LlamaForCausalLM

from benchmarks.common import load_average, machine_line, timing_parser, write_timing
from benchmarks.reference_nanogpt import NanoGPT, NanoGPTConfig
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM, kernels_decoderlab
from decoderlab.export.families import llama_config_from_decoderlab

SHAPE = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=50304)
BLOCK, BATCH = 256, 4
QUICK_SHAPE = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=512)
QUICK_BLOCK, QUICK_BATCH = 16, 2
TOP = 4  # largest allocations listed per row


def build(name: str, shape: dict, block: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "nanogpt":
        config = NanoGPTConfig(block_size=block, vocab_size=shape["vocab_size"], n_layer=shape["num_hidden_layers"],
                               n_head=shape["num_attention_heads"], n_embd=shape["hidden_size"], bias=True)  # fmt: skip
        return NanoGPT(config)
    preset = "gpt2" if name == "decoderlab-gpt2" else "llama"
    config = DecoderLabConfig.from_preset(preset, **shape, max_position_embeddings=block)
    config._attn_implementation = "sdpa"
    if name == "llama":
        return LlamaForCausalLM(llama_config_from_decoderlab(config))
    return DecoderLabForCausalLM(config)


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    """The next-token loss over ``ids`` (B, block + 1): block positions in, block logits out for every model, as
    nanoGPT's get_batch feeds x = ids[:, :-1], y = ids[:, 1:] (an HF model's labels are its inputs, shifted inside:
    one target fewer per row, the same logits)."""
    if isinstance(model, NanoGPT):
        return model(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())[1]
    inputs = ids[:, :-1].contiguous()
    return model(input_ids=inputs, labels=inputs, use_cache=False).loss


@contextlib.contextmanager
def saved_bytes(parameters: set[int], record: list):
    """Sum into ``record[0]`` the bytes of every storage autograd saves inside the block, each once, parameters
    excluded."""
    seen = set()

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and storage.data_ptr() not in parameters:
            seen.add(storage.data_ptr())
            record[0] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def allocations(profile, device: str = "cpu") -> tuple[int, list[int]]:
    """The peak of bytes allocated on ``device`` ("cpu" or "cuda": allocations minus frees, from the block's start)
    and the largest allocations there."""
    device_type = getattr(torch.autograd.DeviceType, device.upper())
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in profile.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == device_type
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, sorted((n for _, n in events if n > 0), reverse=True)[:TOP]


def measure(name: str, mode: str, route: str, quick: bool, variant: str = "") -> dict:
    """One row: ``name`` trained one step ``mode`` ("eager" / "compiled") through ``route`` ("model" or
    "accelerate"); ``variant`` "lean loss compiled" or "fp32 logits" brings back a cause as it was."""
    shape, block, batch = (QUICK_SHAPE, QUICK_BLOCK, QUICK_BATCH) if quick else (SHAPE, BLOCK, BATCH)
    model = build(name, shape, block).train()
    ids = torch.randint(shape["vocab_size"], (batch, block + 1), generator=torch.Generator().manual_seed(0))
    backend = "aot_eager" if quick else "inductor"
    restore = contextlib.ExitStack()
    if variant == "lean loss compiled":  # the earlier choice: the lean loss inside compiled graphs too
        restore.enter_context(swapped(kernels_decoderlab, "takes_lean_loss_path",
                                      lambda n, device_type="cpu": n >= kernels_decoderlab.LEAN_LOSS_MIN_LOGITS))  # fmt: skip
        restore.enter_context(swapped(kernels_decoderlab, "LEAN_LOSS_MIN_LOGITS", 0 if quick else 2**24))
    with restore:
        if route == "model":
            if mode == "compiled":
                model.compile(backend=backend)

            def step():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_of(model, ids)
                loss.backward()
        else:
            step = accelerate_step(model, ids, mode, backend, keep_fp32_wrapper=variant == "fp32 logits")
        step()  # compilation, first-touch allocations
        model.zero_grad(set_to_none=True)
        gc.collect()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        peak, largest = allocations(prof)
        model.zero_grad(set_to_none=True)
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved, graphs = [0], torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with saved_bytes(parameters, saved):  # a step of its own: the hooks cannot change what the peak saw
            step()
        recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs
    return {"model": name, "mode": mode, "route": route, "variant": variant, "saved_mb": saved[0] / 1e6,
            "peak_mb": peak / 1e6, "largest_mb": [n / 1e6 for n in largest],
            "recompiled_under_hooks": recompiled}  # fmt: skip


@contextlib.contextmanager
def swapped(owner, name: str, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def accelerate_step(model, ids: torch.Tensor, mode: str, backend: str, keep_fp32_wrapper: bool):
    """The training loop's set-up and micro-batch: bf16 Accelerator on the CPU, ``model.compile`` before
    ``prepare``, the loss over ``num_items_in_batch`` targets, ``accelerator.backward``."""
    from accelerate.state import AcceleratorState, GradientState

    from training.args import TrainConfig
    from training.loop import make_accelerator, outputs_in_compute_dtype

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    # on a CPU without bf16 instructions bf16 runs in software: slower, the same buffers (bytes are measured here)
    accelerator = make_accelerator(TrainConfig(mixed_precision="bf16"), cpu=True)
    if mode == "compiled":
        model.compile(backend=backend)
    prepared = accelerator.prepare(model)
    inputs = ids[:, :-1].contiguous()
    num_items = torch.tensor(inputs[:, 1:].numel())

    def step():
        outputs = contextlib.nullcontext() if keep_fp32_wrapper else outputs_in_compute_dtype(prepared)
        with outputs:
            loss = prepared(input_ids=inputs, labels=inputs, use_cache=False, num_items_in_batch=num_items).loss
            accelerator.backward(loss)

    return step


ROWS = [
    # (model, mode, route, variant)
    *[(name, mode, "model", "") for mode in ("compiled", "eager")
      for name in ("nanogpt", "decoderlab-gpt2", "llama", "decoderlab-llama")],
    *[(name, mode, "accelerate", "") for mode in ("compiled", "eager")
      for name in ("decoderlab-gpt2", "llama", "decoderlab-llama")],
    ("decoderlab-gpt2", "compiled", "model", "lean loss compiled"),
    ("decoderlab-gpt2", "compiled", "accelerate", "fp32 logits"),
]  # fmt: skip


# Bytes within which two figures count as equal: a few scalars (a target count, a loss) are not buffers
SCALARS = 4096


def goals(rows: list[dict]) -> list[dict]:
    """decoderlab's saved and peak bytes against its reference's in the same mode (at most ``SCALARS`` bytes more):
    nanoGPT alone (what its train.py runs) for the gpt2 preset, ``LlamaForCausalLM`` the same way for the llama
    preset."""
    slack = SCALARS / 1e6
    by = {(r["model"], r["mode"], r["route"], r["variant"]): r for r in rows}
    checks = []
    for (name, mode, route, variant), row in by.items():
        if variant or not name.startswith("decoderlab"):
            continue
        reference = (
            by.get(("nanogpt", mode, "model", "")) if name == "decoderlab-gpt2" else by.get(("llama", mode, route, ""))
        )
        if reference is None:
            continue
        checks.append({"model": name, "mode": mode, "route": route, "reference": reference["model"],
                       "saved_ratio": row["saved_mb"] / reference["saved_mb"],
                       "peak_ratio": row["peak_mb"] / reference["peak_mb"],
                       "passed": row["saved_mb"] <= reference["saved_mb"] + slack
                       and row["peak_mb"] <= reference["peak_mb"] + slack})  # fmt: skip
    return checks


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__, repeats=1)
    parser.add_argument("--quick", action="store_true", help="a tiny shape and aot_eager: checks that it runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = load_average()
    print(machine_line(args.threads))
    rows = []
    for name, mode, route, variant in ROWS:
        row = measure(name, mode, route, args.quick, variant)
        rows.append(row)
        largest = ", ".join(f"{mb:.1f}" for mb in row["largest_mb"])
        label = f"{name} {mode} via {route}" + (f" ({variant})" if variant else "")
        print(f"{label:58s} saved {row['saved_mb']:7.1f} MB  peak {row['peak_mb']:7.1f} MB  largest {largest}",
              flush=True)  # fmt: skip
    checks = goals(rows)
    for check in checks:
        print(f"{check['model']} {check['mode']} via {check['route']} / {check['reference']}: saved "
              f"{check['saved_ratio']:.3f}x, peak {check['peak_ratio']:.3f}x {'PASS' if check['passed'] else 'FAIL'}")  # fmt: skip
    shape = QUICK_SHAPE if args.quick else SHAPE
    write_timing(args.json_out, args.threads, load_before, quick=args.quick,
                 shape={**shape, "block_size": QUICK_BLOCK if args.quick else BLOCK,
                        "batch_size": QUICK_BATCH if args.quick else BATCH},
                 rows=rows, goals=checks)  # fmt: skip


if __name__ == "__main__":
    main()
