"""Which parameter gets which optimizer rule, learning rate and weight decay: the one place that answers it.

``param_groups(model, cfg)`` is the only function from a model and a run configuration to optimizer groups; every
group is named, so the run records the split (``recorded_groups``: ``run_info.json``, the model card and comment
lines atop ``training_config.yaml``) and a test prints it for every preset. ``make_optimizer`` builds the optimizer
over those groups (AdamW, or ``MuonWithAdamW``) and ``make_scheduler`` transformers' schedule over the optimizer (it
scales each group's own peak rate, so groups with a rate of their own keep their ratio to the others).

The rules, read top to bottom in ``param_groups``:

- ``matrices``: the weight matrices (ndim >= 2) that are not embeddings: q/k/v/o, the MLP's projections and an
  untied ``lm_head``; weight decay ``cfg.weight_decay``.
- ``embeddings``: with ``cfg.embedding_learning_rate``, the token embeddings (and a tied ``lm_head``, the same
  matrix) at that peak rate, without decay.
- ``other``: everything else, without decay: norm gains, biases, learned positions, and the token embeddings when
  they have no rate of their own. Decaying an embedding row pulls rare tokens toward zero for no gain, and decaying
  norm gains or biases fights the scale they exist to set (GPT-2, nanoGPT and Llama recipes all exempt them).
- ``muon_matrices``, with ``cfg.optimizer == "muon"`` only: the 2-D weights inside the decoder blocks (q/k/v/o and
  the MLP's projections: the modules the model lists in ``_no_split_modules``) go to ``torch.optim.Muon`` at
  ``cfg.muon_learning_rate`` with ``cfg.muon_weight_decay``; every other group stays AdamW's. The token embeddings
  and the head are 2-D too, but Muon orthogonalises a matrix's update as a whole, which suits a map from one hidden
  space to another and not a lookup table or the logits (Keller Jordan's Muon README; every modded-nanogpt record
  keeps them on Adam). Norm gains and biases are 1-D, which Muon refuses. Under muP (Yang et al. 2022), Muon's
  update already has a width-independent spectral norm, so its rate takes no 1/width factor.

Under ``parametrization: mup`` (the model's config; m = hidden_size / mup_base_width), Tensor Programs V's Table 8:

- ``matrices`` holds only the hidden matrices (the linear layers of the decoder blocks: q/k/v/o, the MLP's), at
  ``learning_rate`` x ``mup_lr_multiplier`` (1/m for Adam); its ``lr_multiplier`` records the factor.
- ``muon_matrices`` (optimizer muon) takes no factor: Muon's orthogonalised update already has a width-independent
  spectral norm under ``muon_adjust_lr_fn: original`` (its ``lr_multiplier`` records 1.0); ``match_rms_adamw``, whose
  update grows with the width, is refused with muP.
- ``output``: the other weight matrices, whose one side stays fixed as the width grows (TP5's "vector-like"
  parameters): an untied ``lm_head`` and, under LoRA, the adapters (rank fixed), at ``learning_rate`` with
  ``weight_decay``. The logits' own 1/m is the model's ``logit_scale``, in its forward pass.
- ``other`` and ``embeddings`` are as above: muP leaves vector-like parameters' rates alone.

Weight decay under muP: AdamW decays by lr x weight_decay per step, so the hidden matrices, at lr / m, decay by
lr x weight_decay / m: ``weight_decay`` is not rescaled (nanoGPT-mup's convention, and about what Qiu et al. 2025
found best for decoupled decay, proportional to 1/width; microsoft/mup's MuAdam instead multiplies it by m).
"""

import math

import torch
from torch import nn
from transformers import get_scheduler

from decoderlab.modeling_decoderlab import DecoderLabAbsolutePositionalEmbedding

EMBEDDING_MODULES = (nn.Embedding, DecoderLabAbsolutePositionalEmbedding)
OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon"}


def mup_lr_multiplier(config, rule: str = "adamw") -> float:
    """The factor muP puts on the learning rate of the hidden matrices updated by optimizer ``rule``: 1/m for Adam
    (Tensor Programs V, Table 8), m = ``config.mup_width_multiplier``; 1.0 for Muon (its update's spectral norm does
    not grow with the width: Yang, Simon & Bernstein 2023); 1.0 in the standard parametrization. A rule with no muP
    factor of its own is refused rather than given Adam's."""
    if getattr(config, "parametrization", "standard") != "mup":
        return 1.0
    if rule == "adamw":
        return 1.0 / config.mup_width_multiplier
    if rule == "muon":
        return 1.0
    raise ValueError(
        f"parametrization='mup' has no learning-rate rule for the optimizer {rule!r}; it has one for 'adamw' and 'muon'."
    )


def hidden_matrices(model: nn.Module) -> set[int]:
    """The ids of the hidden matrices' weights: the linear layers inside decoder blocks (modeling_decoderlab marks
    them ``is_hidden_matrix``)."""
    return {id(m.weight) for m in model.modules() if getattr(m, "is_hidden_matrix", False)}


def block_matrices(model: nn.Module) -> set[int]:
    """The ids of the 2-D weights inside the decoder blocks: the modules whose class ``model._no_split_modules``
    names (FSDP's subclass of one included), the units ``training.sharding`` shards by."""
    units = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if any(c.__name__ in units for c in type(m).__mro__)]
    return {id(p) for block in blocks for p in block.parameters() if p.ndim == 2}


def param_groups(model: nn.Module, cfg) -> list[dict]:
    """Named optimizer groups (``name``, ``params``, ``lr``, ``weight_decay``, ``use_muon``; under muP
    ``lr_multiplier`` too) covering every trainable parameter of ``model`` exactly once, by the rules of this
    module's docstring; groups left empty are dropped."""
    config = getattr(model, "config", None)
    mup = getattr(config, "parametrization", "standard") == "mup"
    embedding_params = {id(p) for m in model.modules() if isinstance(m, EMBEDDING_MODULES) for p in m.parameters()}
    own_rate = set()
    if cfg.embedding_learning_rate is not None:
        own_rate = {id(p) for p in model.get_input_embeddings().parameters()}
    muon = block_matrices(model) if cfg.optimizer == "muon" else set()
    hidden = hidden_matrices(model) if mup else set()
    adamw_factor, muon_factor = mup_lr_multiplier(config, "adamw"), mup_lr_multiplier(config, "muon")
    groups = {
        "matrices": {"params": [], "lr": cfg.learning_rate * adamw_factor, "weight_decay": cfg.weight_decay},
        "other": {"params": [], "lr": cfg.learning_rate, "weight_decay": 0.0},
        "embeddings": {"params": [], "lr": cfg.embedding_learning_rate, "weight_decay": 0.0},
        "muon_matrices": {"params": [], "lr": cfg.muon_learning_rate * muon_factor,
                          "weight_decay": cfg.muon_weight_decay},  # fmt: skip
        "output": {"params": [], "lr": cfg.learning_rate, "weight_decay": cfg.weight_decay},  # muP only
    }  # in this order: a checkpoint's optimizer state lists its groups by position
    for group_name, group in groups.items():
        group["use_muon"] = group_name == "muon_matrices"
    if mup:
        groups["matrices"]["lr_multiplier"], groups["muon_matrices"]["lr_multiplier"] = adamw_factor, muon_factor
    for param in model.parameters():  # each tensor once, a tied one included
        if not param.requires_grad:
            continue
        if id(param) in own_rate:
            name = "embeddings"
        elif id(param) in muon:
            name = "muon_matrices"
        elif param.ndim >= 2 and id(param) not in embedding_params:
            name = "output" if mup and id(param) not in hidden else "matrices"
        else:
            name = "other"
        groups[name]["params"].append(param)
    return [{"name": name, **group} for name, group in groups.items() if group["params"]]


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


def recorded_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's groups as a run records them (``run_info.json``, the model card, ``training_config.yaml``'s
    comments): name, optimizer, peak rate (and muP's factor in it), weight decay and the parameters and tensors each
    holds; ``describe_groups`` without the tensors' names."""
    groups = [{**group, "lr": group.get("initial_lr", group["lr"])} for group in optimizer.param_groups]
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
    return (
        f"{group['name']}{label}: lr {group['lr']:g}{factor}, wd {group['weight_decay']:g}, "
        f"{group['parameters']:,} parameters"
    )


def groups_text(recorded: list[dict]) -> str:
    """``recorded_groups`` in one line, for the card: ``matrices: lr 0.0026, wd 0.1, 786,432 parameters; ...``;
    each group's optimizer in parentheses when Muon takes part (``muon_matrices (Muon): lr 0.02, ...``)."""
    mixed = any(g.get("optimizer") == "muon" for g in recorded)
    return "; ".join(group_text(g, optimizer=mixed) for g in recorded)


def groups_comment(recorded: list[dict]) -> str:
    """``recorded_groups`` as YAML comment lines, for the top of the run's ``training_config.yaml``: the split and each
    group's optimizer and peak rate where the settings are (comments: reading the file back as a TrainConfig skips
    them)."""
    lines = ["Optimizer groups of this run (training/optim.py's rules; a record, not a setting):"]
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

    Why: torch's Muon orthogonalises one matrix at a time in bfloat16. For make demo's model (28 matrices of 128 x 128
    to 256) that is 20 ms a step on 2 cores of an AMD EPYC with bfloat16 instructions, 40% of the model's forward and
    backward; batched, 10 ms in bfloat16 and 15 ms in float32. On a CPU without bfloat16 instructions bfloat16 runs in
    software: 750 ms a step, ten times the model's own, where batched float32 takes 23 ms (``python -m
    benchmarks.investigations.muon_step`` times each way on the machine it runs on). Sharded (DTensor) parameters take
    torch's own step, which DTensor runs on the whole matrices."""

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
    from .loop import cpu_has_bf16  # here, not at the top: training.loop imports this module

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
    them (about 4x faster for the nano model on CPU)."""
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in model.parameters())
    adamw = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=fused or None)
    groups = param_groups(model, cfg)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, **adamw)
    config = getattr(model, "config", None)
    if getattr(config, "parametrization", "standard") == "mup" and cfg.muon_adjust_lr_fn != "original":
        raise ValueError(
            f"muon_adjust_lr_fn={cfg.muon_adjust_lr_fn!r} with a muP model: that rule scales Muon's update with "
            "sqrt(max(out, in)), which grows with the width, so the rate tuned at mup_base_width would not carry. "
            "Use muon_adjust_lr_fn original (muP's rule for Muon: no width factor)."
        )
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


def make_scheduler(optimizer: torch.optim.Optimizer, cfg, num_training_steps: int):
    """transformers' scheduler ``cfg.lr_scheduler_type``; stepped once per optimizer step.

    ``warmup_stable_decay`` (transformers' ``get_wsd_schedule``) takes its decay as a number of steps in
    ``lr_scheduler_kwargs`` (``num_decay_steps``, with ``decay_type`` and ``min_lr_ratio``: its defaults are a cosine
    decay to 0); warm-up and decay must fit in the run, or the stable phase would have a negative length."""
    decay = (cfg.lr_scheduler_kwargs or {}).get("num_decay_steps")
    stable = (cfg.lr_scheduler_kwargs or {}).get("num_stable_steps")
    if cfg.lr_scheduler_type == "warmup_stable_decay" and isinstance(decay, int) and stable is None:
        if cfg.num_warmup_steps + decay > num_training_steps:
            raise ValueError(
                f"lr_scheduler_type=warmup_stable_decay: num_warmup_steps={cfg.num_warmup_steps} plus "
                f"lr_scheduler_kwargs num_decay_steps={decay} exceed the run's {num_training_steps} steps. Shorten "
                "the warm-up or the decay (e.g. num_decay_steps of 40% of the steps, modded-nanogpt's cooldown)."
            )
    try:
        return get_scheduler(
            cfg.lr_scheduler_type,
            optimizer,
            num_warmup_steps=cfg.num_warmup_steps,
            num_training_steps=num_training_steps,
            scheduler_specific_kwargs=cfg.lr_scheduler_kwargs,
        )
    except TypeError as err:  # a keyword the scheduler does not take
        raise ValueError(
            f"lr_scheduler_kwargs={cfg.lr_scheduler_kwargs} do not fit lr_scheduler_type={cfg.lr_scheduler_type!r}: {err}"
        ) from err
