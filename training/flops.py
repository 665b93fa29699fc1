"""What a training run computes: FLOPs per token, the peak it is measured against (MFU), and a run sized by a budget.

    fpt = flops_per_token(model.config, block_size)     # 6 N + 12 x (each layer's context) x d_attn
    peak = peak_flops(accelerator.device, "no")        # FLOP/s one process can reach: measured (CPU) or a datasheet's
    budget = run_budget(cfg, model.config, processes)  # the steps of --target_flops / --tokens_per_parameter

**FLOPs per token** of a training step (forward and backward) are counted as the matrix products compute them, the
convention of PaLM's MFU (Chowdhery et al. 2022, appendix B) and nanoGPT's ``estimate_mfu``:

- ``6 N``: N the weights of the model's linear layers (q/k/v/o, the MLP's, ``lm_head``: counted when tied too, since
  the tied table is then also a matrix product). A weight is used once per token forward (a multiply and an add: 2
  FLOPs) and twice backward (the gradients of the input and of the weight: 4). The token and learned position
  tables are lookups, not products; norms, biases, activations, RoPE, the softmax and the loss are elementwise and
  left out (a few percent of a small model's FLOPs at most). Under GQA the k/v projections are their real, narrower
  size.
- ``12 x sum over layers of context x d_attn``: the scores ``Q K^T`` and their product with ``V`` cost ``2 x context
  x d_attn`` each per token forward (``d_attn`` = query heads x head width), three times that with the backward.
  Kaplan et al. (2020, Table 1) write the scores as ``2 n_layer n_ctx d_attn`` forward (6 with the backward), the
  causal half; dense kernels compute the whole square and ``torch.utils.flop_counter.FlopCounterMode`` counts it,
  so this is twice Kaplan's term, as PaLM and nanoGPT count it. The context is the run's block size for a full
  layer, and ``min(sliding_window, block size)`` for a sliding one: the work the model needs (a kernel that skips
  the blocks outside the window does about that much; a dense kernel computes the rest too, which MFU does not
  credit).

A LoRA run computes no gradient for its frozen weights (about 4 N, not 6 N, per token): its FLOPs and MFU are
overstated by up to 1.5x.

**MFU** is the run's FLOPs per second (FLOPs per token x tokens per second) over the peak FLOP/s of its processes
together. On a GPU the peak is the datasheet's dense figure for the run's matmul dtype (``GPU_PEAKS``; an unknown GPU
has none and its rows log ``mfu: null``). On a CPU there is no datasheet figure to trust (the rate depends on the
vector extensions, the thread count and the kernels torch picks), so each process measures it once, before the first
step: the fastest of a few products of two 512 x 512 and of two 1024 x 1024 matrices in the run's dtype at the run's
thread count (``matmul_rate``, about a quarter of a second on two cores, remembered for later runs in the same
process). A results file could say what another process measured on the same CPU model, but not at this thread
count, with these kernel limits, now; ``python -m benchmarks.matmul_peak`` records the rates by size for the machine
it runs on. A CPU busy with other work measures a lower peak, and the run's MFU is then the share of what it could
get.
"""

import functools
import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.cli import UsageError
from decoderlab.model_card import count_parameters

logger = logging.getLogger(__name__)

# Dense (no sparsity) peak TFLOP/s of the matrix units, by a fragment of the name torch.cuda.get_device_name gives,
# the first fragment found in the name wins. From NVIDIA's datasheets (H100 and H200: "NVIDIA H100 Tensor Core GPU"
# and "NVIDIA H200 Tensor Core GPU", whose tensor figures are with sparsity, halved here; A100: "NVIDIA A100 Tensor
# Core GPU", dense). fp32 is the plain CUDA cores' rate (torch's default for float32 matmuls); tf32 the tensor cores'
# when torch.backends.cuda.matmul allows it.
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    ("H100 NVL", {"bf16": 835, "fp16": 835, "tf32": 418, "fp32": 60}),
    ("H100", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200 NVL", {"bf16": 835, "fp16": 835, "tf32": 418, "fp32": 60}),
    ("H200", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),  # SXM
    ("A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
)
MATMUL_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # TrainConfig.mixed_precision
# the matrices a run's start times, the faster taken: where this machine's rate tops out with one thread and with two
# (benchmarks/notes/flops-and-health.md)
MEASURED_SIZES = (512, 1024)


# ----------------------------------------------------------------------------------------------
# FLOPs per token


def meta_model(config: DecoderLabConfig) -> DecoderLabForCausalLM:
    """The causal LM of ``config`` on the meta device: its modules and shapes, no memory."""
    with torch.device("meta"):
        return DecoderLabForCausalLM(config)


def matmul_parameters(config: DecoderLabConfig) -> int:
    """N of ``6 N``: the weights of every linear layer of the causal LM of ``config``, ``lm_head`` included (tied or
    not); no embedding table, norm, bias or scalar."""
    return sum(m.weight.numel() for m in meta_model(config).modules() if isinstance(m, nn.Linear))


def attention_contexts(config: DecoderLabConfig, seq_len: int) -> list[int]:
    """The keys each query is scored against, per layer, in blocks of ``seq_len`` tokens: ``seq_len`` for a full
    layer, the window (at most ``seq_len``) for a sliding one."""
    return [min(config.sliding_window, seq_len) if kind == "sliding_attention" else seq_len
            for kind in config.layer_types]  # fmt: skip


def flops_per_token(config: DecoderLabConfig, seq_len: int) -> int:
    """FLOPs of one token's forward and backward pass in blocks of ``seq_len`` tokens: ``6 N + 12 x sum(context) x
    d_attn`` (the module's docstring says what is counted)."""
    d_attn = config.num_attention_heads * config.head_dim
    return 6 * matmul_parameters(config) + 12 * sum(attention_contexts(config, seq_len)) * d_attn


# ----------------------------------------------------------------------------------------------
# The peak


def gpu_peak(name: str, dtype: str) -> float | None:
    """The datasheet's dense peak FLOP/s of the GPU called ``name`` for ``dtype`` (bf16, fp16, tf32, fp32), or None
    for a GPU ``GPU_PEAKS`` does not list."""
    for fragment, peaks in GPU_PEAKS:
        if fragment.lower() in name.lower():
            return peaks[dtype] * 1e12
    return None


def matmul_rate(dtype: torch.dtype, size: int, repeats: int = 5, device: str = "cpu") -> float:
    """FLOP/s of the fastest of ``repeats`` products of two ``size`` x ``size`` matrices of ``dtype`` on ``device``
    (after one untimed product), at torch's current thread count: ``2 size^3`` FLOPs each."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(device=device, dtype=dtype) for _ in range(2))
    synchronize = torch.accelerator.synchronize if device != "cpu" else (lambda: None)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


@functools.cache
def cpu_peak(dtype: torch.dtype, threads: int) -> float:
    """The fastest ``matmul_rate`` of ``MEASURED_SIZES`` on this CPU, measured once a process for each dtype and thread
    count."""
    return max(matmul_rate(dtype, size) for size in MEASURED_SIZES)


@dataclass(frozen=True)
class Peak:
    flops: float | None  # FLOP/s of one process; None: unknown (a GPU GPU_PEAKS does not list)
    source: str  # where the figure comes from, for the run's record


def peak_flops(device: torch.device, mixed_precision: str) -> Peak:
    """The peak FLOP/s one process of a run on ``device`` can reach with ``mixed_precision``'s matmuls: a GPU's
    datasheet figure, or this CPU's measured rate (the module's docstring says why each)."""
    dtype = MATMUL_DTYPES[mixed_precision]
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    if device.type == "cpu":
        threads = torch.get_num_threads()
        rate = cpu_peak(dtype, threads)
        plural = "s" if threads != 1 else ""
        return Peak(rate, f"{name} matmul rate measured at the start on this CPU ({threads} thread{plural})")
    if device.type != "cuda":
        return Peak(None, f"no peak known for {device.type} devices")
    if name == "fp32" and torch.get_float32_matmul_precision() != "highest":
        name = "tf32"
    gpu = torch.cuda.get_device_name(device)
    rate = gpu_peak(gpu, name)
    if rate is None:
        logger.warning(f"No datasheet peak for {gpu} in training.flops.GPU_PEAKS: the rows log mfu null. Add its "
                       "dense peak there to log it.")  # fmt: skip
        return Peak(None, f"no datasheet peak for {gpu}")
    return Peak(rate, f"{gpu} {name} dense datasheet peak")


# ----------------------------------------------------------------------------------------------
# A run sized by its budget


@dataclass(frozen=True)
class Budget:
    """The steps of a run sized by ``target_flops`` or ``tokens_per_parameter``, and the numbers they came from."""

    source: str  # "target_flops" or "tokens_per_parameter"
    target: float  # the setting's value
    steps: int
    flops_per_token: int
    tokens_per_step: int
    parameters: int  # all of the model's parameters (a tied matrix once): what tokens_per_parameter multiplies

    @property
    def flops(self) -> int:
        return self.steps * self.tokens_per_step * self.flops_per_token

    def record(self) -> dict:
        """For ``run_info.json`` and the trackers."""
        return {"from": self.source, self.source: self.target, "max_train_steps": self.steps,
                "flops_per_token": self.flops_per_token, "tokens_per_step": self.tokens_per_step,
                "parameters": self.parameters, "parameters_counted": "all (Chinchilla's count)",
                "tokens": self.steps * self.tokens_per_step, "flops": self.flops}  # fmt: skip

    def text(self) -> str:
        """The steps and where they came from, in one line (the card, ``training_config.yaml``'s header)."""
        step = f"({self.flops_per_token:,} FLOPs per token x {self.tokens_per_step:,} tokens per step)"
        if self.source == "target_flops":
            return f"{self.steps:,} steps = target_flops {self.target:.4g} / {step}, rounded down"
        return (f"{self.steps:,} steps = tokens_per_parameter {self.target:g} x {self.parameters:,} parameters / "
                f"{self.tokens_per_step:,} tokens per step, rounded up ({self.flops:.4g} FLOPs)")  # fmt: skip


def tokens_per_step(cfg, num_processes: int) -> int:
    """Positions one optimizer step computes over all processes: batch x block x accumulation x processes."""
    return cfg.per_device_train_batch_size * cfg.block_size * cfg.gradient_accumulation_steps * num_processes


def run_budget(cfg, config: DecoderLabConfig, num_processes: int, vocabulary_known: bool = True) -> Budget | None:
    """The steps ``cfg.target_flops`` (rounded down: the run never spends more) or ``cfg.tokens_per_parameter``
    (rounded up: the run sees at least that many tokens per parameter, all parameters counted as Chinchilla does) give
    a model of ``config`` trained on ``num_processes`` processes; None without either. A budget smaller than one step
    is a ``UsageError`` (asked by the pre-flight check before any data is read, where a new model's vocabulary may be
    unknown yet: ``vocabulary_known`` False, ``config`` counting the smallest; and by the loop, which knows it)."""
    if cfg.target_flops is None and cfg.tokens_per_parameter is None:
        return None
    fpt, tokens = flops_per_token(config, cfg.block_size), tokens_per_step(cfg, num_processes)
    parameters = count_parameters(config)[0]
    if cfg.target_flops is not None:
        step_flops = fpt * tokens
        if cfg.target_flops < step_flops:
            least = "" if vocabulary_known else "at least "
            unread = "" if vocabulary_known else "; the vocabulary, read with the data, not counted yet"
            raise UsageError(
                f"target_flops={cfg.target_flops:.4g} is less than one optimizer step, {least}{step_flops:.4g} FLOPs "
                f"({least}{fpt:,} FLOPs per token x {tokens:,} tokens per step{unread}): raise --target_flops above "
                "that, or make the step smaller (--per_device_train_batch_size, --gradient_accumulation_steps, "
                "--block_size)."
            )
        steps = int(cfg.target_flops // step_flops)
        return Budget("target_flops", cfg.target_flops, steps, fpt, tokens, parameters)
    steps = math.ceil(cfg.tokens_per_parameter * parameters / tokens)
    return Budget("tokens_per_parameter", cfg.tokens_per_parameter, steps, fpt, tokens, parameters)
