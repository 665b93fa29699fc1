"""A run's health between two training rows, kept on the device and read once per row: the loss of each step, the
gradient norm, the loss spikes and the size of the updates.

    health = RunHealth(optimizer, accelerator, state, cfg.logging_steps, cfg.loss_spike_margin, sharded)
    health.keep_weights()              # before a step whose row is due: what its update is measured against
    health.add_loss(loss)              # each micro-batch: this process's share of the step's mean loss
    health.end_step(grad_norm)         # after the optimizer step
    row = health.read()                # at the row: one host read of all of it

Nothing here reads a device value between rows: ``add_loss`` and ``end_step`` queue device work only, and ``read``
makes the one host read a row already made for its loss (with the collectives it needs: the losses summed over
processes, and under FSDP the shards' update norms).

What a row gets:

- ``train_loss``: the mean over the window's steps of each step's loss (the mean over every target of its
  micro-batches on every process).
- ``grad_norm``: the L2 norm of the whole model's gradients before clipping, at the window's last step (as Trainer
  logs the current step's): what ``accelerator.clip_grad_norm_`` returns (DDP: the gradients are already averaged;
  FSDP2: the shards' norms combined), computed with nothing clipped when ``max_grad_norm`` is none. Under DeepSpeed
  it is what the engine reports (null where it reports none).
- ``loss_spikes``: how many steps of the run so far had a loss above ``(1 + loss_spike_margin)`` times the running
  mean before them: an exponential moving average of the step losses, each new step weighing ``1 / SPIKE_MEMORY``
  (about the last 50 steps), started at the first step's loss. A falling loss stays under its lagging mean; a step
  20% (the default margin) above it is one a run should be looked at for, above the few percent batches vary by
  (benchmarks/notes/flops-and-health.md). Counted on the host from the window's step losses when the row is read, so
  the count and the mean are exact at every checkpoint (``TrainState``) and a resumed run goes on counting.
- ``update_rms/GROUP``: for each optimizer group (``training/optim.py``'s names: matrices, muon_matrices,
  embeddings, other, output, ...), rms(weights after the row's step - weights before) / rms(weights before), over
  all the group's tensors together (the Frobenius norms' ratio). Measured on the row's own step: before a step whose
  row is planned (``keep_weights``) the loop keeps a copy of the weights, so a row's step costs one copy of the
  weights in memory and time and two norms of them; steps without a row cost nothing. A row the loop did not plan (a
  stop signal's or the clock's checkpoint) has no update ratios. Not under DeepSpeed, whose partitioned weights
  the loop does not see.
"""

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from .checkpointing import TrainState
from .optim import is_distributed_tensor

SPIKE_MEMORY = 50  # steps: the running mean's weight on each new step loss is 1 / SPIKE_MEMORY


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """This process's part of ``param``: its shard of a sharded (DTensor) parameter, else the tensor itself."""
    return param.to_local() if is_distributed_tensor(param) else param


def squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of ``tensors`` taken together (a 0-d float32 tensor)."""
    return torch.stack([n.float() for n in torch._foreach_norm(tensors)]).square().sum()


class RunHealth:
    """The window's health on the device, between two rows (the module's docstring says what each value is)."""

    def __init__(self, optimizer, accelerator: Accelerator, state: TrainState, window: int, spike_margin: float,
                 sharded: bool):  # fmt: skip
        self.accelerator, self.state, self.spike_margin, self.sharded = accelerator, state, spike_margin, sharded
        # DeepSpeed partitions the weights behind the optimizer: there are no update ratios to measure
        deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        self.groups = [] if deepspeed else list(optimizer.param_groups)
        self.losses = torch.zeros(window, device=accelerator.device)  # this process's share of each step's mean loss
        self.steps = 0  # steps in the window
        self.grad_norm: torch.Tensor | float | None = None  # the last step's, before clipping
        self.kept: list[list[torch.Tensor]] | None = None  # each group's weights before the step, when its row is due
        self.updates: torch.Tensor | None = None  # (groups, 2): squared norms of the update and of the weights before

    def keep_weights(self) -> None:
        """Copy each group's weights (this process's shards), before a step whose row is due."""
        self.kept = [[local_tensor(p).detach().clone() for p in group["params"]] for group in self.groups]

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add one micro-batch's loss (this process's share of the step's mean) to the current step."""
        self.losses[self.steps].add_(loss.detach())

    def end_step(self, grad_norm: torch.Tensor | float | None) -> None:
        """The step's optimizer update is done: keep its gradient norm, and measure its update if the weights before
        it were kept."""
        self.grad_norm = grad_norm.detach() if isinstance(grad_norm, torch.Tensor) else grad_norm
        if self.kept is not None:
            rows = []
            for group, before in zip(self.groups, self.kept):
                update = torch._foreach_sub([local_tensor(p).detach() for p in group["params"]], before)
                rows.append(torch.stack([squared_norm(update), squared_norm(before)]))
            self.updates, self.kept = (torch.stack(rows) if rows else None), None
        self.steps += 1

    def read(self) -> dict:
        """The window's row values (``train_loss``, ``grad_norm``, ``loss_spikes``, ``update_rms/GROUP``), in one
        host read; the window starts again."""
        steps, parts = self.steps, []
        step_losses = self.accelerator.reduce(self.losses[:steps], reduction="sum")  # (steps,) each step's mean
        parts.append(step_losses)
        norm_on_device = isinstance(self.grad_norm, torch.Tensor)
        if norm_on_device:
            parts.append(self.grad_norm.float().reshape(1))  # on the device, as the gradients
        updates = self.updates
        if updates is not None:
            if self.sharded:  # each process holds its shards: the squares add up over processes
                updates = self.accelerator.reduce(updates, reduction="sum")
            parts.append(updates.flatten())
        values = torch.cat(parts).tolist()  # the row's one host read
        losses, rest = values[:steps], values[steps:]
        grad_norm = rest.pop(0) if norm_on_device else self.grad_norm
        spikes = count_spikes(self.state, losses, self.spike_margin)
        row = {"train_loss": sum(losses) / steps, "grad_norm": grad_norm, "loss_spikes": spikes}
        if updates is not None:
            for group, (update, weights) in zip(self.groups, zip(rest[::2], rest[1::2])):
                row[f"update_rms/{group['name']}"] = (update / weights) ** 0.5 if weights > 0 else float("inf")
        self.losses.zero_()
        self.steps, self.updates = 0, None
        return row


def count_spikes(state: TrainState, losses: list[float], margin: float) -> int:
    """Add the spikes among the step ``losses`` (in order) to ``state.loss_spikes``, moving the running mean
    ``state.loss_mean`` along, and return the count: a step is a spike when its loss is above ``(1 + margin)`` times
    the mean of the steps before it (an exponential moving average, ``1 / SPIKE_MEMORY`` on each new step, started at
    the run's first step loss)."""
    for loss in losses:
        if state.loss_mean is None:
            state.loss_mean = loss
            continue
        if loss > (1 + margin) * state.loss_mean:
            state.loss_spikes += 1
        state.loss_mean += (loss - state.loss_mean) / SPIKE_MEMORY
    return state.loss_spikes
