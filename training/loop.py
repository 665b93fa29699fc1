"""The training loop: AdamW, warm-up then cosine decay, accumulation, clipping, mixed precision, evaluation, logs.

``train(model, batches, eval_blocks, cfg, accelerator)`` is the core that every script calls with its
own model and data. It prepares the model and optimizer with Accelerate, resumes from a checkpoint
when asked, runs ``cfg.max_train_steps`` optimizer steps, evaluates every ``cfg.eval_steps``, saves
a crash-safe checkpoint every ``cfg.checkpointing_steps`` and at the end, and returns the trained
(still wrapped) model with a summary. It stops with ``NonFiniteLossError`` on a NaN or infinite loss
before any checkpoint could store the damage.

Per-step costs are kept to what a step needs: the loss, the gradient norm and the run's other health figures stay
on the device between logging steps (``training.health``: no ``.item()`` synchronisation per step), batches are
slices of an in-memory tensor, and the periodic evaluations can be limited to ``cfg.max_eval_samples`` blocks. Each
training row also carries the FLOPs so far and the MFU (``training.flops``); a run sized by ``cfg.target_flops`` or
``cfg.tokens_per_parameter`` takes its number of steps from them.
"""

import contextlib
import datetime
import json
import logging
import math
import pathlib
import time
from dataclasses import dataclass, field
from types import MethodType

import datasets
import torch
import transformers
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, InitProcessGroupKwargs, extract_model_from_parallel
from accelerate.utils.operations import ConvertOutputsToFp32
from torch import nn
from tqdm.auto import tqdm

from decoderlab.model_card import METRICS_NAME, read_metrics  # the file's one reader (the card reads it too)

from .args import TrainConfig
from .best_model import BestModel, best_checkpoint, stopped_early
from .checkpointing import (
    TrainState,
    list_checkpoints,
    load_checkpoint,
    read_data_state,
    read_state,
    save_checkpoint,
)
from .data import Prefetched, count_targets, real_tokens
from .flops import Budget, flops_per_token, peak_flops, run_budget
from .hardware import SHARDING_ENGINES, requested_sharding, runs_on_cpu
from .health import RunHealth
from .optim import decoder_of, make_optimizer, make_scheduler, recorded_groups
from .preemption import StopControl
from .sharding import is_sharded, shard_model, step_only_when_synced

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the run stopped without saving the damaged state.

    ``history`` holds the metrics records logged before it (as ``TrainResult.history`` would).
    """

    def __init__(self, message: str, history: list[dict] | None = None):
        super().__init__(message)
        self.history = history if history is not None else []


def refuse_unsharded(state: PartialState | AcceleratorState) -> None:
    """Stop a run whose launcher asked for FSDP or DeepSpeed when Accelerate set it up as something else.

    Accelerate 1.15 turns FSDP and DeepSpeed on only over GPU-like devices (``accelerate/state.py``); on CPUs it
    runs the same launch as MULTI_CPU data parallelism without a word, so a model chosen for sharding would be
    replicated whole on every process. Called before any data is read.
    """
    engine = requested_sharding()
    if engine is None or state.distributed_type == SHARDING_ENGINES[engine][1]:
        return
    variable = SHARDING_ENGINES[engine][0]
    if state.distributed_type == DistributedType.NO:
        instead = f"one process on {state.device.type} holding the whole model (nothing sharded)"
    else:
        instead = (
            f"{state.num_processes} data-parallel processes on {state.device.type}, each holding the whole model, "
            "its gradients and optimizer state (DDP: nothing sharded)"
        )
    if state.device.type == "cpu":
        why = (
            "FSDP and DeepSpeed through Accelerate need a GPU-like device (CUDA, XPU, NPU, ...), and this run is on CPU"
        )
    else:
        why = "Accelerate enables them only in processes started by `accelerate launch` (or torchrun)"
    raise ValueError(
        f"The launch asked for {engine} sharding ({variable}=true, from `accelerate launch --config_file ...` or "
        f"its --use_{engine.lower()} flag), but Accelerate set this run up as {state.distributed_type.value}: "
        f"{instead}. {why}. For data parallelism on CPUs, launch with --config_file "
        "training/accelerate_configs/cpu_ddp.yaml; for sharded training on CPUs, with torch's FSDP2: "
        "`torchrun --standalone --nproc_per_node 2 training/pretrain.py ... --fsdp true`."
    )


def make_accelerator(cfg: TrainConfig | None = None, cpu: bool = False) -> Accelerator:
    """The Accelerator every script uses: accumulation, mixed precision and trackers from ``cfg`` (none of
    them without one: evaluation).

    ``cpu=True`` on machines without an accelerator: Accelerate only turns processes started by
    ``torchrun`` into gloo data-parallel ranks when told it runs on CPU; otherwise each process would
    silently train its own copy of the model. ``cpu=True`` also forces the CPU where there is a GPU.

    A launch that asks for FSDP or DeepSpeed where Accelerate cannot give it stops here (``refuse_unsharded``: what
    Accelerate made of the launch is known only now); the settings that do not fit a launch or the hardware were
    refused before, by ``training.preflight``.
    """
    cpu = runs_on_cpu(cpu)
    if cpu and requested_sharding() == "DeepSpeed":
        # Accelerate never enables DeepSpeed with cpu=True (state.py: `... and not cpu`). Checked before building the
        # Accelerator, which would otherwise stop at "DeepSpeed is not installed" where it is not (a run started
        # with the variable set but not by `accelerate launch`, which refuses by itself): installing it would
        # only lead to the data-parallel run.
        refuse_unsharded(PartialState(cpu=True))
    if cfg is None:
        accelerator = Accelerator(cpu=cpu)
    else:
        accelerator = Accelerator(
            cpu=cpu,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            mixed_precision=cfg.mixed_precision,
            log_with=[name.strip() for name in cfg.report_to.split(",")] if cfg.with_tracking else None,
            project_dir=cfg.output_dir,
            # how long a process waits for the others at a barrier or collective (Trainer's ddp_timeout)
            kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=cfg.ddp_timeout))],
        )
    refuse_unsharded(accelerator.state)
    return accelerator


@contextlib.contextmanager
def outputs_in_compute_dtype(model: nn.Module):
    """Inside the block, ``model`` (as ``Accelerator.prepare`` returned it, or unwrapped) returns its outputs in the
    dtype it computed them in: under mixed precision, Accelerate wraps ``forward`` in ``convert_outputs_to_fp32``
    (autocast inside, a float32 copy of every half-precision output around it), which in training copies the logits
    to float32 every micro-batch (16 x 1024 x 50304 x 4 bytes = 3.3 GB at GPT-2-small's shape) when only the loss,
    already float32, is used. The autocast stays; the float32 wrapper is taken off for the block and put back after,
    so the model the loop returns converts as Accelerate documents. Nothing changes without the wrapper."""
    module = extract_model_from_parallel(model, keep_fp32_wrapper=True)
    forward = module.__dict__.get("forward")
    converting = getattr(getattr(forward, "__func__", None), "__wrapped__", None)
    if not isinstance(converting, ConvertOutputsToFp32):
        yield
        return
    module.forward = MethodType(converting.model_forward, module)  # the autocast forward it wraps
    try:
        yield
    finally:
        module.forward = forward


def setup_script_logging(accelerator: Accelerator) -> None:
    """The console of a training script's ``main()``: INFO logs from the main process only, warnings from the
    others, whose progress bars are off. Called by the scripts, never by the library."""
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        level=logging.INFO if accelerator.is_main_process else logging.WARNING,
    )
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # one INFO line per file of every checkpoint
    if not accelerator.is_main_process:
        datasets.disable_progress_bars()
        transformers.utils.logging.set_verbosity_error()


# ----------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(
    model: nn.Module,
    blocks: torch.Tensor | dict[str, torch.Tensor],
    batch_size: int,
    accelerator: Accelerator,
    max_samples: int | None = None,
) -> dict[str, float]:
    """Mean next-token loss (and its exp, the perplexity) over ``blocks`` (N, T), each predicted token weighted once.

    ``blocks`` may also be a dict of (N, T) model inputs (``BlockBatches``' fine-tuning rows): then only
    targets whose ``labels`` are not -100 count, e.g. the completion tokens of prompt/completion pairs.
    Process ``r`` evaluates blocks ``r, r + P, r + 2P, ...``; the sums are reduced over processes, so
    every block counts exactly once whatever the number of processes. A sharded model's layers gather their
    weights from every process, so there every process runs as many batches as the first (which has the most);
    one without blocks left runs its first batch again with weight 0.
    """
    was_training = model.training
    model.eval()
    rows = blocks if isinstance(blocks, dict) else {"input_ids": blocks}
    all_rows = {name: column[:max_samples] for name, column in rows.items()}
    mine = slice(accelerator.process_index, None, accelerator.num_processes)
    rows = {name: column[mine] for name, column in all_rows.items()}
    # a sharded model: every process runs as many batches as the first, which has the most blocks
    n_rows = math.ceil(len(all_rows["input_ids"]) / accelerator.num_processes) if is_sharded(model) else None
    n_batches = math.ceil((n_rows or len(rows["input_ids"])) / batch_size)
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # (sum of losses, predicted tokens)
    for start in range(0, n_batches * batch_size, batch_size):
        weight = 1.0
        if start >= len(rows["input_ids"]):  # sharded, and this process's blocks are done: a batch that counts 0
            rows, start, weight = all_rows, 0, 0.0
        batch = {name: x[start : start + batch_size].long().to(accelerator.device) for name, x in rows.items()}
        labels = batch.setdefault("labels", batch["input_ids"])
        loss = model(**batch, use_cache=False).loss  # mean over the predicted tokens of the batch
        n_predicted = count_targets(labels).double() * weight
        # a batch with nothing to predict has loss 0/0 = nan and weight 0: it adds nothing
        totals += torch.stack([torch.where(n_predicted > 0, loss.double() * n_predicted, 0.0), n_predicted])
    totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    eval_loss = (totals[0] / totals[1]).item()
    return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 700.0))}


# ----------------------------------------------------------------------------------------------
# Metrics


class MetricsLog:
    """``metrics.jsonl`` in the output folder (one JSON object per line, read back by ``read_metrics``), the
    same records in memory (``records``, on every process), and Accelerate's trackers.

    On resume, records after the resumed step are dropped: the resumed run writes them again.
    """

    def __init__(self, output_dir, accelerator: Accelerator, with_tracking: bool, resume_step: int = 0):
        self.accelerator, self.with_tracking = accelerator, with_tracking
        self.path = pathlib.Path(output_dir) / METRICS_NAME
        self.records: list[dict] = []
        if resume_step and self.path.is_file():
            self.records = [record for record in read_metrics(self.path) if record["step"] <= resume_step]
        accelerator.wait_for_everyone()  # every process has read the file before the main one rewrites it
        if accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json.dumps(record) + "\n" for record in self.records))

    def log(self, record: dict) -> None:
        self.records.append(record)
        if self.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.with_tracking:
            values = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            self.accelerator.log(values, step=record["step"])


def tracker_config(config: dict) -> dict:
    """The run configuration flattened to the scalar values trackers accept (``model.hidden_size``, ...)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in tracker_config(value).items()})
        elif isinstance(value, (bool, int, float, str)):
            flat[key] = value
        else:
            flat[key] = str(value)
    return flat


# ----------------------------------------------------------------------------------------------
# The loop


@dataclass
class TrainResult:
    model: nn.Module  # as prepared by Accelerate (unwrap with accelerator.unwrap_model)
    state: TrainState
    train_loss: float | None  # mean of the last logging window
    eval_metrics: dict = field(default_factory=dict)  # the final evaluation over every validation block
    already_finished: bool = False  # resumed from a checkpoint at or past max_train_steps: nothing was run
    history: list[dict] = field(default_factory=list)  # every record of metrics.jsonl, the resumed run's before
    optimizer_groups: list[dict] = field(default_factory=list)  # training.optim.recorded_groups: the run's record
    budget: Budget | None = None  # the steps --target_flops or --tokens_per_parameter gave (None: max_train_steps)
    compute: dict = field(default_factory=dict)  # FLOPs per token, the FLOPs trained, the peak MFU is measured against


def train(
    model: nn.Module,
    batches,
    eval_blocks: torch.Tensor,
    cfg: TrainConfig,
    accelerator: Accelerator,
    *,
    tokenizer=None,
    resume_from=None,
    show_progress: bool = True,
) -> TrainResult:
    """Train ``model`` for ``cfg.max_train_steps`` optimizer steps and evaluate it on ``eval_blocks``.

    Args:
        model: a causal LM taking ``input_ids``/``labels`` and returning ``.loss`` (unprepared).
        batches: ``BlockBatches`` or ``StreamBatches`` (anything with ``iterate(start) -> Iterator[dict]``
            yielding model inputs, resumable at micro-batch ``start``; with ``state_dict(consumed)`` and
            ``load_state_dict``, its position is saved in each checkpoint and restored first on resume). A
            background thread reads ``cfg.prefetch_batches`` micro-batches ahead (``Prefetched``).
        eval_blocks: (N, T) token ids for ``evaluate``.
        cfg: the run configuration (optimizer, schedule, evaluation, checkpoints, tracking).
        accelerator: from ``make_accelerator(cfg)``.
        tokenizer: saved into every checkpoint, so a resumed run uses the same vocabulary.
        resume_from: a checkpoint folder (``checkpointing.resolve_checkpoint``) to continue from exactly.
        show_progress: a tqdm bar (loss, tokens/s, ETA) on the main process.

    The caller saves what it needs, then calls ``accelerator.end_training()`` (closes the trackers and
    the process group, after which processes can no longer wait for each other). Resumed from a checkpoint
    that already reached ``max_train_steps``, it returns at once with ``already_finished`` set, having
    touched nothing (a finished run started again is left exactly as it was).
    """
    decoder_config = decoder_of(model).config
    budget = run_budget(cfg, decoder_config, accelerator.num_processes)
    max_steps = budget.steps if budget is not None else num_training_steps(cfg, batches)
    if resume_from is not None and (done := read_state(resume_from)).step >= max_steps:
        return TrainResult(model, done, train_loss=None, already_finished=True, budget=budget)
    if resume_from is not None and stopped_early(cfg.early_stopping_patience, done):  # finished too: left as it was
        return TrainResult(model, done, train_loss=None, already_finished=True, budget=budget)
    fpt = flops_per_token(decoder_config, cfg.block_size)
    # the peak FLOP/s of every process together, found before anything else runs (training.flops: measured on a CPU)
    peak = peak_flops(accelerator.device, cfg.mixed_precision)
    peak_total = peak.flops if peak.flops is not None else math.nan
    if accelerator.num_processes > 1:
        peak_total = accelerator.reduce(torch.tensor(peak_total, device=accelerator.device), reduction="sum").item()
    compute = {"flops_per_token": fpt, "peak_flops": peak_total if math.isfinite(peak_total) else None,
               "peak": f"{peak.source}, x {accelerator.num_processes} process(es)"}  # fmt: skip
    if cfg.fsdp:  # torch's FSDP2 (training/sharding.py): the optimizer is made over the sharded parameters
        model = shard_model(model, accelerator)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg, max_steps)
    optimizer_groups = recorded_groups(model, optimizer)
    if cfg.torch_compile:
        model.compile(backend=cfg.torch_compile_backend or "inductor")
    if cfg.fsdp:
        optimizer = step_only_when_synced(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)

    if cfg.with_tracking:
        recorded = cfg.to_dict() | ({"budget": budget.record()} if budget is not None else {})
        accelerator.init_trackers(cfg.project_name, config=tracker_config(recorded))
    sharded = (model, optimizer) if cfg.fsdp else None  # saved and restored by every process, apart from Accelerate
    state = load_checkpoint(accelerator, resume_from, sharded=sharded) if resume_from is not None else TrainState()
    metrics = MetricsLog(cfg.output_dir, accelerator, cfg.with_tracking, resume_step=state.step)
    best = BestModel(cfg)
    if cfg.load_best_model_at_end and state.best_global_step is not None:
        best_checkpoint(cfg.output_dir, state)  # a resumed run's best checkpoint must still be there, before any step
    # batches with a position of their own (training.data: state_dict / load_state_dict) save and restore it
    saves_position = hasattr(batches, "state_dict")
    if saves_position and resume_from is not None:
        if data_state := read_data_state(resume_from, accelerator.process_index):
            batches.load_state_dict(data_state)  # a stream continues from its saved position instead of replaying
    consumed = lambda: state.step * cfg.gradient_accumulation_steps  # micro-batches used so far
    pin_memory = cfg.dataloader_pin_memory and accelerator.device.type == "cuda"
    micro_batches = Prefetched(batches.iterate(start=consumed()), cfg.prefetch_batches, pin_memory)
    parameters = list(model.parameters())  # for clipping: listed once, not walked through the modules every step
    sharded_weights = is_sharded(model) or accelerator.distributed_type == DistributedType.FSDP
    health = RunHealth(optimizer, accelerator, state, cfg.logging_steps, cfg.loss_spike_margin, sharded_weights)
    # A training row comes after each logging step, each checkpoint and the last step (and, unplanned, after a stop
    # signal's or the clock's checkpoint); the step before a planned row keeps the weights its update is measured by
    log_due_at = lambda step: step % cfg.logging_steps == 0 or step == max_steps
    checkpoint_due_at = lambda step: cfg.checkpointing_steps is not None and (
        step % cfg.checkpointing_steps == 0 or step == max_steps
    )
    # the reading thread stops however the loop ends; stop signals and the clock ask for checkpoints (preemption.py);
    # the loop uses losses only: no float32 copy of the logits
    control = StopControl(cfg.stop_signals, cfg.checkpointing_minutes, accelerator.num_processes)
    with contextlib.closing(micro_batches), control, outputs_in_compute_dtype(model):
        bar = tqdm(
            total=max_steps,
            initial=state.step,
            desc="training",
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,  # redrawn once a second: drawing costs about a millisecond, a small model's step tens
            disable=not (show_progress and accelerator.is_local_main_process),
        )
        # The training window since the last log: each step's loss and the other health figures (`health`, on the
        # device: no per-step synchronisation), real (non-padding) tokens of all processes, optimizer steps and
        # training time (evaluations and checkpoints excluded). This process's tokens are summed over processes only
        # when something is logged or saved (`new_tokens` until then).
        window_tokens, window_steps, window_time, waited_before = 0, 0, 0.0, 0.0
        new_tokens = 0
        train_loss, norm_text = None, "-"
        run_start, elapsed_before = time.perf_counter(), state.elapsed_s
        elapsed = lambda: round(elapsed_before + time.perf_counter() - run_start, 3)
        segment_start = time.perf_counter()
        # the first step of this run (compilation, warm-up) is timed apart: its seconds and its tokens on every process
        first_step: tuple[float, int] | None = None
        first_step_logged = False
        stop = False  # a stop signal (training.preemption) asks for a checkpoint and the end

        # A step's loss is the mean over every target of its micro-batches on every process (as transformers'
        # Trainer does): each micro-batch's loss is its summed loss over that count (`num_items_in_batch`), so
        # a short batch weighs as many targets as it has. Accelerate divides each loss by the accumulation steps
        # and DDP averages the gradients over processes; `loss_scale` undoes both.
        loss_scale = cfg.gradient_accumulation_steps * accelerator.num_processes
        model.train()
        while state.step < max_steps:
            step_batches = [next(micro_batches) for _ in range(cfg.gradient_accumulation_steps)]
            # counted on the CPU copies, copied without blocking the host (from pinned memory on CUDA)
            num_items = sum(count_targets(batch["labels"]) for batch in step_batches)
            num_items = num_items.pin_memory() if accelerator.device.type == "cuda" else num_items
            num_items = num_items.to(accelerator.device, non_blocking=True)
            if accelerator.num_processes > 1:
                num_items = accelerator.reduce(num_items, reduction="sum")
            num_items = num_items.clamp(min=1)  # a step without targets (none in practice) adds nothing
            if log_due_at(state.step + 1) or checkpoint_due_at(state.step + 1):
                health.keep_weights()  # this step's row measures its update
            grad_norm = None
            for batch in step_batches:
                new_tokens += real_tokens(batch)  # counted on the CPU copy: no device synchronisation
                batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
                with accelerator.accumulate(model):
                    loss = model(**batch, use_cache=False, num_items_in_batch=num_items).loss
                    accelerator.backward(loss * loss_scale if loss_scale != 1 else loss)
                    if accelerator.sync_gradients:  # the whole model's norm before clipping, left on the device
                        grad_norm = accelerator.clip_grad_norm_(parameters, cfg.max_grad_norm or math.inf)
                    optimizer.step()  # Accelerate skips these until the last micro-batch of the step
                    optimizer.zero_grad(set_to_none=True)
                health.add_loss(loss)  # this process's share of the step's mean
            health.end_step(grad_norm)
            scheduler.step()
            state.step += 1
            window_steps += 1
            bar.update(1)
            if first_step is None:
                if accelerator.device.type != "cpu":
                    torch.accelerator.synchronize()  # once a run: the first step's device work belongs to its time
                tokens = accelerator.reduce(torch.tensor(new_tokens, device=accelerator.device), reduction="sum")
                first_step = (time.perf_counter() - segment_start, int(tokens))

            last = state.step == max_steps
            log_due = log_due_at(state.step)
            eval_due = cfg.eval_steps is not None and state.step % cfg.eval_steps == 0 and not last
            eval_due = eval_due or (last and cfg.load_best_model_at_end)  # the last weights compete for the best
            checkpoint_due = checkpoint_due_at(state.step)
            early_stop = False  # set by an evaluation under early_stopping_patience
            stop, on_clock = control.poll(state.step)  # the same on every process; the last step ends the run as usual
            stop = stop and not last
            eval_due = eval_due and not stop  # a stopping run saves at once
            checkpoint_due = checkpoint_due or stop or on_clock
            if not (log_due or eval_due or checkpoint_due):
                continue
            window_time += time.perf_counter() - segment_start
            new_tokens = int(accelerator.reduce(torch.tensor(new_tokens, device=accelerator.device), reduction="sum"))
            state.tokens, window_tokens, new_tokens = state.tokens + new_tokens, window_tokens + new_tokens, 0
            if log_due or checkpoint_due:  # a checkpoint must never store a state whose loss went bad
                health_row = health.read()  # the window's one host read: its step losses, the norms
                train_loss = health_row.pop("train_loss")  # the mean over the window's steps
                if not math.isfinite(train_loss):
                    raise non_finite_error(train_loss, state.step, cfg, metrics.records)
                timed_tokens, timed_time, first = window_tokens, window_time, {}
                if not first_step_logged:  # the steady state's speed leaves the first step out (unless it is all)
                    first_step_logged, first = True, {"first_step_s": round(first_step[0], 4)}
                    if window_steps > 1:
                        timed_tokens, timed_time = window_tokens - first_step[1], window_time - first_step[0]
                tokens_per_s = timed_tokens / max(timed_time, 1e-9)
                grad_norm = health_row.pop("grad_norm")
                metrics.log(
                    {
                        "step": state.step,
                        "tokens": state.tokens,
                        "train_loss": train_loss,
                        "grad_norm": grad_norm,
                        "lr": scheduler.get_last_lr()[0],
                        "elapsed_s": elapsed(),
                        "tokens_per_s": round(tokens_per_s),
                        # this process's wait for its batches since the last record: data is the bottleneck when it
                        # approaches the window's training time
                        "data_wait_s": round(micro_batches.waited_s - waited_before, 4),
                        "flops": fpt * state.tokens,  # so far, every process's (training.flops: 6N + attention)
                        # the window's FLOP/s over the peak of every process together (null: no peak known)
                        "mfu": float(f"{fpt * tokens_per_s / peak_total:.4g}") if math.isfinite(peak_total) else None,
                        **health_row,
                        **first,
                    }
                )
                waited_before = micro_batches.waited_s
                norm_text = f"{grad_norm:.3g}" if grad_norm is not None else "-"
                bar.set_postfix(loss=f"{train_loss:.4f}", grad_norm=norm_text, tokens_per_s=f"{round(tokens_per_s):,}",
                                refresh=False)  # fmt: skip
                window_tokens, window_steps, window_time = 0, 0, 0.0
            if eval_due:
                result = evaluate(model, eval_blocks, cfg.per_device_eval_batch_size, accelerator, cfg.max_eval_samples)
                metrics.log({"step": state.step, "tokens": state.tokens, **result, "elapsed_s": elapsed()})
                if best.enabled:
                    improved = best.update(state, result)
                    # a new best is kept as a checkpoint (the last step's weights are at hand anyway)
                    checkpoint_due = checkpoint_due or (improved and best.keep_checkpoint and not last)
                    early_stop = best.should_stop(state) and not last
                    # the run ends here: its state stays resumable (unless its evaluation went bad)
                    finite = math.isfinite(result[best.metric])
                    checkpoint_due = checkpoint_due or (early_stop and cfg.checkpointing_steps is not None and finite)
                bar.set_postfix(loss=f"{train_loss:.4f}" if train_loss is not None else "-", grad_norm=norm_text,
                                eval=f"{result['eval_loss']:.4f}")  # fmt: skip
            if checkpoint_due:
                state.elapsed_s = elapsed()
                data_state = batches.state_dict(consumed()) if saves_position else None
                checkpoint = save_checkpoint(
                    accelerator,
                    cfg.output_dir,
                    state,
                    tokenizer=tokenizer,
                    total_limit=cfg.checkpoints_total_limit,
                    sharded=sharded,
                    data_state=data_state,
                    keep_step=state.best_global_step if best.keep_checkpoint else None,
                )
                control.saved()
                if stop:  # saved where every process stands: end the program with its own status
                    bar.close()
                    accelerator.end_training()
                    raise control.stopped(checkpoint, state.step, log=accelerator.is_main_process)
            segment_start = time.perf_counter()
            if early_stop:
                logger.info(
                    f"Early stopping at step {state.step}: {cfg.early_stopping_patience} evaluations without "
                    f"improving {best.metric} by more than {cfg.early_stopping_threshold} on the best, "
                    f"{state.best_metric} at step {state.best_global_step}."
                )
                break
        bar.close()
        state.elapsed_s = elapsed()

        saved = {}  # the final evaluation's record: which step's weights it scored, when not the last step's
        if cfg.load_best_model_at_end and state.best_global_step is not None:
            if state.best_global_step != state.step:
                load_checkpoint(accelerator, best_checkpoint(cfg.output_dir, state), sharded=sharded)
            saved = {"best_global_step": state.best_global_step}
        final = evaluate(model, eval_blocks, cfg.per_device_eval_batch_size, accelerator)  # every block
        metrics.log({"step": state.step, "tokens": state.tokens, **final, "elapsed_s": elapsed(), **saved})
        compute["flops"] = fpt * state.tokens
        return TrainResult(model, state, train_loss, final, history=metrics.records, optimizer_groups=optimizer_groups,
                           budget=budget, compute=compute)  # fmt: skip


def num_training_steps(cfg: TrainConfig, batches) -> int:
    """``cfg.max_train_steps``, or ``cfg.num_train_epochs`` epochs of ``batches`` when it is None."""
    if cfg.max_train_steps is not None:
        return cfg.max_train_steps
    per_epoch = getattr(batches, "batches_per_epoch", None)
    if per_epoch is None:
        raise ValueError("These batches have no epoch length (a stream): set --max_train_steps.")
    return cfg.num_train_epochs * max(1, per_epoch // cfg.gradient_accumulation_steps)


def non_finite_error(loss: float, step: int, cfg: TrainConfig, history: list[dict]) -> NonFiniteLossError:
    checkpoints = list_checkpoints(cfg.output_dir)
    last_good = (
        f"The last good checkpoint, {checkpoints[-1]}, is intact (nothing was saved after the loss went bad)."
        if checkpoints
        else "No checkpoint had been saved yet."
    )
    return NonFiniteLossError(
        f"The training loss is {loss} at step {step}: training diverged, so the run stopped. {last_good} "
        f"Lower --learning_rate (now {cfg.learning_rate}), lengthen --num_warmup_steps (now {cfg.num_warmup_steps}) "
        f"or lower --max_grad_norm (now {cfg.max_grad_norm}), and start again"
        + (
            " (--overwrite_output_dir), or resume from that checkpoint with --resume_from_checkpoint latest to retry "
            "from there."
            if checkpoints
            else " (--overwrite_output_dir replaces this run)."
        ),
        history,
    )
