"""The optimizer groups of a run, from the model's parameter roles and the one rule table, and the optimizers.

``param_groups(model, cfg)`` is the only function from a model and a run configuration to optimizer groups. It asks
the model for each parameter's role (``DecoderLabPreTrainedModel.parameter_roles``) and the table for that role's rule
(``decoderlab/roles_decoderlab.py``: ``RULES``, keyed by role, ``cfg.optimizer`` and the model's parametrization), so
every rule (group, Muon or AdamW, peak rate, muP's factor, weight decay) is read in one place; this module only gathers
the tensors that share a rule. Every group is named, so the run records the split (``recorded_groups``:
``run_info.json``, the model card and comment lines atop ``training_config.yaml``) and a test prints it for every
preset. ``make_optimizer`` builds the optimizer over those groups (AdamW, or ``MuonWithAdamW``) and ``make_scheduler``
transformers' schedule over it (it scales each group's own peak rate, so groups keep their ratios).

What the table gives, in words (its docstring has muP's reasons):

- ``matrices``: the blocks' matrices (q/k/v/o, the MLP's) and, in the standard parametrization, an untied
  ``lm_head``; ``weight_decay``. Under muP (AdamW) each matrix's rate is divided by its own fan-in multiplier
  (``lr_multiplier`` records the factor); matrices with different factors are groups of their own.
- ``muon_matrices`` (``optimizer: muon``): the blocks' matrices, to ``torch.optim.Muon`` at ``muon_learning_rate``
  with ``muon_weight_decay``; no muP factor (Muon's orthogonalised update has a width-independent spectral norm). The
  embeddings and the head stay on AdamW: Muon suits a map between hidden spaces, not a lookup table or the logits
  (Keller Jordan's Muon README; every modded-nanogpt record keeps them on Adam); vectors are 1-D, which Muon refuses.
- ``embeddings``: the token embeddings (and a tied ``lm_head``, the same matrix) at ``embedding_learning_rate``,
  without decay; without that rate they train in ``other``.
- ``other``: gains, biases, learned positions and scalars, at ``learning_rate``, without decay: decaying an
  embedding row pulls rare tokens toward zero for no gain, and decaying gains or biases fights the scale they exist
  to set (GPT-2, nanoGPT and Llama recipes all exempt them).
- ``output`` (muP only): an untied ``lm_head`` and LoRA adapters, whose one side stays fixed as the width grows, at
  ``learning_rate`` with ``weight_decay``; the logits' own 1/m is the model's ``logit_scale``, in its forward pass.

Weight decay under muP: AdamW decays by lr x weight_decay per step, so the hidden matrices, at lr / m, decay by
lr x weight_decay / m: ``weight_decay`` is not rescaled (nanoGPT-mup's convention, and about what Qiu et al. 2025
found best for decoupled decay, proportional to 1/width; microsoft/mup's MuAdam instead multiplies it by m).
"""

import math

import torch
from torch import nn
from transformers import get_scheduler

from decoderlab.cli import UsageError
from decoderlab.configuration_decoderlab import is_mup
from decoderlab.modeling_decoderlab import DecoderLabPreTrainedModel
from decoderlab.roles_decoderlab import GROUP_ORDER, ParameterRole, rate_factor, rule_for

from .hardware import cpu_has_bf16

OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon"}


def decoder_of(model: nn.Module) -> DecoderLabPreTrainedModel:
    """The decoderlab model inside ``model``: itself, or the one PEFT (``get_base_model``) or a wrapper
    (``module``) holds."""
    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, DecoderLabPreTrainedModel):
            return candidate
        base = getattr(candidate, "get_base_model", None)
        if base is not None and isinstance(base(), DecoderLabPreTrainedModel):
            return base()
    raise ValueError(f"{type(model).__name__} holds no decoderlab model: its parameters have no roles to group by.")


def roles_by_tensor(model: nn.Module) -> dict[int, tuple[str, ParameterRole]]:
    """``id(tensor) -> (name, role)`` for every parameter of the decoderlab model inside ``model``."""
    decoder = decoder_of(model)
    roles = decoder.parameter_roles()
    return {id(param): (name, roles[name]) for name, param in decoder.named_parameters()}


def param_groups(model: nn.Module, cfg) -> list[dict]:
    """Named optimizer groups (``name``, ``params``, ``lr``, ``weight_decay``, ``use_muon``; under muP
    ``lr_multiplier`` too) covering every trainable parameter of ``model`` exactly once, each by its role's rule in
    ``roles_decoderlab.RULES``; in ``GROUP_ORDER`` (a checkpoint's optimizer state lists its groups by position)."""
    decoder = decoder_of(model)
    parametrization = decoder.config.parametrization
    known = roles_by_tensor(decoder)
    groups: dict[tuple[str, float], dict] = {}
    for param in model.parameters():  # each tensor once, a tied one included
        if not param.requires_grad:
            continue
        if id(param) not in known:
            raise ValueError(
                f"A trainable tensor of shape {tuple(param.shape)} is not a parameter of the decoderlab model, so it has "
                "no role and no rule: train only the model's own parameters (or LoRA adapters on them)."
            )
        role = known[id(param)][1]
        rule = rule_for(role.role, cfg.optimizer, parametrization)
        name, rate = rule.group, getattr(cfg, rule.rate)
        if rate is None:  # the token embeddings without a rate of their own
            name, rate = "other", cfg.learning_rate
        factor = rate_factor(rule, role)
        group = groups.setdefault((name, factor), {
            "params": [], "lr": rate * factor, "weight_decay": getattr(cfg, rule.decay) if rule.decay else 0.0,
            "use_muon": rule.update == "muon",
        })  # fmt: skip
        if is_mup(decoder.config) and (rule.rate_per_fan_in or rule.update == "muon"):
            group["lr_multiplier"] = factor
        group["params"].append(param)
    factors: dict[str, list[float]] = {}
    for name, factor in groups:
        factors.setdefault(name, []).append(factor)
    ordered = sorted(groups, key=lambda key: (GROUP_ORDER.index(key[0]), -key[1]))
    return [
        {"name": name if len(factors[name]) == 1 else f"{name} (x {factor:.4g})", **groups[name, factor]}
        for name, factor in ordered
    ]


def describe_groups(model: nn.Module, groups: list[dict]) -> list[dict]:
    """What ``groups`` hold, for the run's record: each group's name, settings (everything but the tensors), its
    parameter count and the names of its tensors (as ``model.named_parameters`` gives them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "parameters": sum(p.numel() for p in group["params"]),
            "tensors": [names.get(id(p), "?") for p in group["params"]],
        }
        for group in groups
    ]


def recorded_groups(model: nn.Module, optimizer: torch.optim.Optimizer | list[dict]) -> list[dict]:
    """The optimizer's groups (or ``param_groups``' own, before any optimizer) as a run records them
    (``run_info.json``, the model card, ``training_config.yaml``'s comments): name, optimizer, peak rate (and muP's
    factor in it), weight decay and the parameters and tensors each holds; ``describe_groups`` without the tensors'
    names."""
    param_groups = optimizer if isinstance(optimizer, list) else optimizer.param_groups
    groups = [{**group, "lr": group.get("initial_lr", group["lr"])} for group in param_groups]
    keep = ("name", "lr", "weight_decay", "parameters", "lr_multiplier")
    ns_dtype = getattr(optimizer, "ns_dtype", None)
    return [
        {key: group[key] for key in keep if key in group}
        | {"optimizer": "muon" if group.get("use_muon") else "adamw", "tensors": len(group["tensors"])}
        | ({"newton_schulz": str(ns_dtype).removeprefix("torch.")} if group.get("use_muon") and ns_dtype else {})
        for group in describe_groups(model, groups)
    ]


def group_text(group: dict, optimizer: bool = False) -> str:
    """One ``recorded_groups`` entry in words: ``matrices: lr 0.0026, wd 0.1, 786,432 parameters``; with
    ``optimizer``, its optimizer after the name (``muon_matrices (Muon): ...``); under muP the hidden matrices' factor
    (``matrices: lr 0.0005 (x 0.1667, muP), ...``)."""
    label = f" ({OPTIMIZER_NAMES[group.get('optimizer', 'adamw')]})" if optimizer else ""
    factor = f" (x {group['lr_multiplier']:.4g}, muP)" if "lr_multiplier" in group else ""
    size = f", {group['parameters']:,} parameters" if "parameters" in group else ""
    return f"{group['name']}{label}: lr {group['lr']:g}{factor}, wd {group['weight_decay']:g}{size}"


def groups_text(recorded: list[dict]) -> str:
    """``recorded_groups`` in one line, for the card: ``matrices: lr 0.0026, wd 0.1, 786,432 parameters; ...``;
    each group's optimizer in parentheses when Muon takes part (``muon_matrices (Muon): lr 0.02, ...``)."""
    mixed = any(g.get("optimizer") == "muon" for g in recorded)
    return "; ".join(group_text(g, optimizer=mixed) for g in recorded)


def groups_comment(recorded: list[dict], title: str = "Optimizer groups of this run") -> str:
    """``recorded_groups`` as YAML comment lines, for the top of the run's ``training_config.yaml`` (or a recipe
    ``training/mup_tune.py`` writes): the split and each group's optimizer and peak rate where the settings are
    (comments: reading the file back as a TrainConfig skips them)."""
    lines = [f"{title} (training/optim.py's rules; a record, not a setting):"]
    lines += [
        f"  {g['name']}: {OPTIMIZER_NAMES[g.get('optimizer', 'adamw')]}, {group_text(g).split(': ', 1)[1]} in "
        f"{g['tensors']} tensor{'s' if g['tensors'] != 1 else ''}"
        for g in recorded
    ]
    return "".join(f"# {line}\n" for line in lines)


# ----------------------------------------------------------------------------------------------
# Muon's step, batched


def newton_schulz(updates: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """torch.optim.Muon's orthogonalisation of each matrix of ``updates`` (n, rows, cols) at once, in ``dtype``: X =
    G / ||G||_F (each matrix transposed first when it has more rows than columns), then ``steps`` quintic iterations
    X <- a X + (b A + c A^2) X with A = X X^T. The result's singular values lie near 1 (not exactly: the quintic is
    tuned for speed, Keller Jordan's Muon)."""
    a, b, c = coefficients
    x = updates.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT  # (n, r, r), r the smaller side
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def muon_rate(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The rate torch.optim.Muon gives a matrix of ``shape`` (out, in): ``original`` lr x sqrt(max(1, out/in)),
    ``match_rms_adamw`` lr x 0.2 x sqrt(max(out, in))."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def is_distributed_tensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class BatchedMuon(torch.optim.Muon):
    """``torch.optim.Muon``, its arithmetic and its state (``momentum_buffer``), with the Newton-Schulz products of all
    the matrices of one shape done as one batched product (``newton_schulz``), in ``ns_dtype``.

    Why: torch's Muon orthogonalises one matrix at a time in bfloat16; batched, a step of make demo's model costs about
    half as much on two CPU cores, and on a CPU without bfloat16 instructions (bfloat16 then runs in software) float32
    products cost a small fraction of bfloat16's (the figures and how they were measured: benchmarks/notes/muon-step.md;
    ``python -m benchmarks.investigations.muon_step`` times each way on the machine it runs on). Sharded (DTensor)
    parameters take torch's own step, which DTensor runs on the whole matrices."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        if any(is_distributed_tensor(p) for group in self.param_groups for p in group["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)  # torch's: the momentum buffers, made on first use
            if not params:
                continue
            lr, momentum, decay = float(group["lr"]), group["momentum"], group["weight_decay"]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)  # B <- mu B + (1 - mu) G
            updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            if decay:
                torch._foreach_mul_(params, 1 - lr * decay)  # decoupled, at the unadjusted rate (torch's)
            shapes: dict[torch.Size, list[int]] = {}
            for i, param in enumerate(params):
                shapes.setdefault(param.shape, []).append(i)
            for shape, index in shapes.items():
                stacked = torch.stack([updates[i] for i in index])  # (n, out, in)
                ortho = newton_schulz(stacked, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                ortho = ortho.to(params[index[0]].dtype)
                rate = muon_rate(lr, group["adjust_lr_fn"], shape)
                torch._foreach_add_([params[i] for i in index], list(ortho.unbind(0)), alpha=-rate)
        return loss


def newton_schulz_dtype(setting: str, device: torch.device) -> torch.dtype:
    """``muon_ns_dtype`` as a dtype: ``auto`` is bfloat16 on accelerators (torch's and the speedrun's choice) and on
    CPUs that compute bfloat16 in hardware, float32 on the other CPUs (``BatchedMuon``'s docstring has the timings)."""
    if setting != "auto":
        return getattr(torch, setting)
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32

class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (``BatchedMuon``: torch.optim.Muon, batched) for the groups marked ``use_muon``, ``torch.optim.AdamW`` for the
    others, as one optimizer.

    One list of ``param_groups`` and one ``state``, so that everything that takes one optimizer takes this one
    unchanged: a transformers schedule (a ``LambdaLR`` scales every group's own peak rate), ``accelerator.prepare``
    (gradient accumulation, DDP), ``save_state`` / ``load_state`` and ``torch.distributed.checkpoint`` (one
    ``state_dict`` in torch's format: Muon's momentum buffers beside AdamW's moments). The arithmetic is torch's: the
    two torch optimizers inside hold the very same group dicts and the same state, and are linked to them again
    whenever ``load_state_dict`` replaces them.
    """

    def __init__(self, groups: list[dict], muon: dict, adamw: dict):
        self.inner = {
            use_muon: (BatchedMuon if use_muon else torch.optim.AdamW)(chosen, **(muon if use_muon else adamw))
            for use_muon in (True, False)
            if (chosen := [group for group in groups if group["use_muon"] == use_muon])
        }  # each fills its own defaults into its groups (betas, fused / momentum, nesterov, ...)
        super().__init__(groups, defaults={})
        self._link()

    @property
    def ns_dtype(self) -> torch.dtype | None:
        """The dtype of Muon's Newton-Schulz products (None without a Muon group), for the run's record."""
        muon = self.inner.get(True)
        return muon.ns_dtype if muon is not None else None

    def _link(self) -> None:
        for use_muon, optimizer in self.inner.items():
            optimizer.param_groups = [group for group in self.param_groups if group["use_muon"] == use_muon]
            optimizer.state = self.state

    def __setstate__(self, state: dict) -> None:  # load_state_dict ends here with new group dicts and a new state
        super().__setstate__(state)
        if "inner" in self.__dict__:
            self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.inner.values():
            optimizer.step()
        return loss


def make_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW over ``param_groups`` (``cfg.optimizer == "adamw"``), or ``MuonWithAdamW`` (``"muon"``); AdamW takes the
    fused kernel where torch has one (CPU and CUDA): one call updates every tensor, instead of a Python loop over
    them (the nanoGPT reference in benchmarks/common.py uses the same kernel; its docstring has the timing)."""
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in model.parameters())
    adamw = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=fused or None)
    groups = param_groups(model, cfg)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, **adamw)
    device = next(model.parameters()).device
    muon = dict(
        ns_dtype=newton_schulz_dtype(cfg.muon_ns_dtype, device),
        lr=cfg.muon_learning_rate,
        weight_decay=cfg.muon_weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr_fn,
    )
    return MuonWithAdamW(groups, muon=muon, adamw=adamw)


def schedule_fits(cfg, num_training_steps: int) -> str | None:
    """``warmup_stable_decay`` (transformers' ``get_wsd_schedule``) with its decay as a number of steps: warm-up and
    decay must fit in the run, or the stable phase would have a negative length. Asked by the pre-flight check, and by
    ``make_scheduler`` for a run counted in epochs, whose length is known only once the data is."""
    kwargs = cfg.lr_scheduler_kwargs or {}
    decay, stable = kwargs.get("num_decay_steps"), kwargs.get("num_stable_steps")
    if cfg.lr_scheduler_type == "warmup_stable_decay" and isinstance(decay, int) and stable is None:
        if cfg.num_warmup_steps + decay > num_training_steps:
            return (
                f"lr_scheduler_type=warmup_stable_decay: num_warmup_steps={cfg.num_warmup_steps} plus "
                f"lr_scheduler_kwargs num_decay_steps={decay} exceed the run's {num_training_steps} steps. Shorten "
                "the warm-up or the decay (e.g. num_decay_steps of 40% of the steps, modded-nanogpt's cooldown)."
            )
    return None


def make_scheduler(optimizer: torch.optim.Optimizer, cfg, num_training_steps: int):
    """transformers' scheduler ``cfg.lr_scheduler_type`` with ``cfg.lr_scheduler_kwargs``; stepped once per optimizer
    step. ``warmup_stable_decay`` (transformers' ``get_wsd_schedule``) takes its decay as a number of steps
    (``num_decay_steps``, with ``decay_type`` and ``min_lr_ratio``: its defaults are a cosine decay to 0).

    The pre-flight check refused keywords the scheduler does not take and a schedule longer than the run before any
    data was read; a run counted in epochs learns its length only from the data, so ``schedule_fits`` is asked again
    here."""
    problem = schedule_fits(cfg, num_training_steps)
    if problem:
        raise UsageError(problem)
    return get_scheduler(
        cfg.lr_scheduler_type,
        optimizer,
        num_warmup_steps=cfg.num_warmup_steps,
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs=cfg.lr_scheduler_kwargs,
    )
