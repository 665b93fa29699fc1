"""What the machine and the launch give a run: the questions the loop, the optimizer and the pre-flight check ask.

Below ``loop``, ``optim`` and ``preflight`` (it imports none of them), so each of them asks here and none asks another.
"""

import os

import torch
from accelerate.utils import DistributedType

# The sharding engines an `accelerate launch` config (or --use_fsdp / --use_deepspeed) selects, by the environment
# variable the launcher sets for them, and the distributed type Accelerate gives a run that really uses them.
SHARDING_ENGINES = {
    "FSDP": ("ACCELERATE_USE_FSDP", DistributedType.FSDP),
    "DeepSpeed": ("ACCELERATE_USE_DEEPSPEED", DistributedType.DEEPSPEED),
}


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX-512 or AMX on x86, BF16 on Arm), as oneDNN, which runs
    CPU autocast's bf16 matmuls, decides it; without, bf16 is emulated and slower than float32."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def runs_on_cpu(cpu: bool = False) -> bool:
    """Whether a run's Accelerator will use the CPU: asked for (``cpu``), or no accelerator is present."""
    return cpu or not torch.accelerator.is_available()


def requested_sharding() -> str | None:
    """``"FSDP"`` or ``"DeepSpeed"`` when the launcher asked for that engine, else None; read as Accelerate reads
    it (``accelerate/state.py``: the variable, lower-cased, equals ``"true"``)."""
    for engine, (variable, _) in SHARDING_ENGINES.items():
        if os.environ.get(variable, "false").lower() == "true":
            return engine
    return None


def launched_processes() -> int:
    """How many processes the launcher started (``WORLD_SIZE``, which torchrun and ``accelerate launch`` set; 1
    for a plain ``python`` run)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
