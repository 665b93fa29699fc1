"""Sharded training with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), for launches Accelerate cannot shard.

    torchrun --standalone --nproc_per_node 2 training/pretrain.py --config ... --fsdp true

Accelerate 1.15 enables FSDP only over GPU-like devices (``accelerate/state.py``), so on CPUs ``--fsdp`` shards
the model with torch's own ``fully_shard`` instead, over the gloo process group Accelerate set up; the rest of the
loop (accumulation, clipping, logging, the scheduler and random states in checkpoints) stays Accelerate's. Each
decoder layer (the model's ``_no_split_modules``) is one FSDP unit, and the root module takes what is left
(embeddings, final norm, ``lm_head``): parameters, gradients and AdamW's state are sharded over the processes, a
layer's full weights exist only while it computes.

Checkpoints keep the sharded state: each process writes its own shards of the weights and the optimizer state
through ``torch.distributed.checkpoint`` (``step_N/sharded/``), so no process ever holds the whole model and
optimizer, which is what sharding is for. The final folder is gathered instead: the full weights on the main
process, saved by an unsharded copy of the model, so it is the same Hugging Face folder a one-process run writes.
"""

import pathlib

import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

SHARDED_NAME = "sharded"  # the folder of a checkpoint holding every process's shards (torch.distributed.checkpoint)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def shard_model(model: nn.Module, accelerator: Accelerator) -> nn.Module:
    """``fully_shard`` each decoder layer (the classes in ``model._no_split_modules``), then the root, over all the
    processes; in place (the module's class becomes FSDP's subclass of it), returned for clarity."""
    units = set(getattr(model, "_no_split_modules", None) or ())
    if not units:
        raise ValueError(
            f"--fsdp shards a model by the layer classes it lists in _no_split_modules, and {type(model).__name__} "
            "lists none (a LoRA-wrapped model, for one): train it without --fsdp."
        )
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    for module in model.modules():
        if type(module).__name__ in units:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step_only_when_synced(optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
    """The optimizer wrapped as ``accelerator.prepare`` would (its ``step`` and ``zero_grad`` wait for the last
    micro-batch of an accumulated step), without registering it with the Accelerator, whose ``save_state`` would
    save the main process's shards of its state as if they were all of it."""
    return AcceleratedOptimizer(optimizer, device_placement=False)


def save_sharded(model: nn.Module, optimizer: AcceleratedOptimizer, folder: pathlib.Path) -> None:
    """Every process writes its shards of the weights and of the optimizer state into ``folder/sharded``."""
    model_state, optimizer_state = get_state_dict(model, optimizer.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / SHARDED_NAME)


def load_sharded(model: nn.Module, optimizer: AcceleratedOptimizer, folder: pathlib.Path) -> None:
    """Read back what ``save_sharded`` wrote, each process its own shards, into the sharded model and optimizer."""
    model_state, optimizer_state = get_state_dict(model, optimizer.optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder / SHARDED_NAME)
    set_state_dict(model, optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def unsharded_copy(model: nn.Module, is_main_process: bool) -> nn.Module | None:
    """On the main process, a plain copy of the sharded ``model`` (the class it had before ``fully_shard``) holding
    the full weights, gathered from every process; None on the others. Every process must call it.

    ``save_pretrained`` cannot save the sharded module itself: its class is FSDP's, so the folder would get torch's
    FSDP source files and an ``auto_map`` naming them instead of the model's own code."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main_process:
        return None
    plain_class = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    copy = plain_class(model.config)
    copy.load_state_dict(full)
    copy.generation_config = model.generation_config
    return copy.eval()
