"""Which parameter gets which optimizer rule, learning rate and weight decay: the one place that answers it.

``param_groups(model, cfg)`` is the only function from a model and a run configuration to optimizer groups; every
group is named, so the run records the split (``recorded_groups``: ``run_info.json`` and the model card) and a test
prints it for every preset. ``make_optimizer`` builds the optimizer over those groups and
``make_scheduler`` transformers' schedule over the optimizer (it scales each group's own peak rate, so groups with a
rate of their own keep their ratio to the others).

The rules, read top to bottom in ``param_groups``:

- ``matrices``: the weight matrices (ndim >= 2) that are not embeddings: q/k/v/o, the MLP's projections and an
  untied ``lm_head``; weight decay ``cfg.weight_decay``.
- ``embeddings``: with ``cfg.embedding_learning_rate``, the token embeddings (and a tied ``lm_head``, the same
  matrix) at that peak rate, without decay.
- ``other``: everything else, without decay: norm gains, biases, learned positions, and the token embeddings when
  they have no rate of their own. Decaying an embedding row pulls rare tokens toward zero for no gain, and decaying
  norm gains or biases fights the scale they exist to set (GPT-2, nanoGPT and Llama recipes all exempt them).

Under ``parametrization: mup`` (the model's config; m = hidden_size / mup_base_width), Tensor Programs V's Table 8:

- ``matrices`` holds only the hidden matrices (the linear layers of the decoder blocks: q/k/v/o, the MLP's), at
  ``learning_rate`` x ``mup_lr_multiplier`` (1/m for Adam); its ``lr_multiplier`` records the factor.
- ``output``: the other weight matrices, whose one side stays fixed as the width grows (TP5's "vector-like"
  parameters): an untied ``lm_head`` and, under LoRA, the adapters (rank fixed), at ``learning_rate`` with
  ``weight_decay``. The logits' own 1/m is the model's ``logit_scale``, in its forward pass.
- ``other`` and ``embeddings`` are as above: muP leaves vector-like parameters' rates alone.

Weight decay under muP: AdamW decays by lr x weight_decay per step, so the hidden matrices, at lr / m, decay by
lr x weight_decay / m: ``weight_decay`` is not rescaled (nanoGPT-mup's convention, and about what Qiu et al. 2025
found best for decoupled decay, proportional to 1/width; microsoft/mup's MuAdam instead multiplies it by m).
"""

import torch
from torch import nn
from transformers import get_scheduler

from decoderlab.modeling_decoderlab import DecoderLabAbsolutePositionalEmbedding

EMBEDDING_MODULES = (nn.Embedding, DecoderLabAbsolutePositionalEmbedding)


def mup_lr_multiplier(config, rule: str = "adamw") -> float:
    """The factor muP puts on the learning rate of the hidden matrices updated by optimizer ``rule``: 1/m for Adam
    (Tensor Programs V, Table 8), m = ``config.mup_width_multiplier``; 1.0 in the standard parametrization. A rule
    with no muP factor of its own is refused rather than given Adam's."""
    if getattr(config, "parametrization", "standard") != "mup":
        return 1.0
    if rule == "adamw":
        return 1.0 / config.mup_width_multiplier
    raise ValueError(f"parametrization='mup' has no learning-rate rule for the optimizer {rule!r}; it has one for 'adamw'.")


def hidden_matrices(model: nn.Module) -> set[int]:
    """The ids of the hidden matrices' weights: the linear layers inside decoder blocks (modeling_decoderlab marks
    them ``is_hidden_matrix``)."""
    return {id(m.weight) for m in model.modules() if getattr(m, "is_hidden_matrix", False)}


def param_groups(model: nn.Module, cfg) -> list[dict]:
    """Named optimizer groups (``name``, ``params``, ``lr``, ``weight_decay``; under muP ``lr_multiplier`` too)
    covering every trainable parameter of ``model`` exactly once, by the rules of this module's docstring; groups
    left empty are dropped."""
    config = getattr(model, "config", None)
    mup = getattr(config, "parametrization", "standard") == "mup"
    embedding_params = {id(p) for m in model.modules() if isinstance(m, EMBEDDING_MODULES) for p in m.parameters()}
    own_rate = set()
    if cfg.embedding_learning_rate is not None:
        own_rate = {id(p) for p in model.get_input_embeddings().parameters()}
    hidden = hidden_matrices(model) if mup else set()
    multiplier = mup_lr_multiplier(config)
    groups = {
        "matrices": {"params": [], "lr": cfg.learning_rate * multiplier, "weight_decay": cfg.weight_decay},
        "other": {"params": [], "lr": cfg.learning_rate, "weight_decay": 0.0},
        "embeddings": {"params": [], "lr": cfg.embedding_learning_rate, "weight_decay": 0.0},
        "output": {"params": [], "lr": cfg.learning_rate, "weight_decay": cfg.weight_decay},  # muP only
    }  # in this order: a checkpoint's optimizer state lists its groups by position
    if mup:
        groups["matrices"]["lr_multiplier"] = multiplier
    for param in model.parameters():  # each tensor once, a tied one included
        if not param.requires_grad:
            continue
        if id(param) in own_rate:
            name = "embeddings"
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
    """The optimizer's groups as a run records them (``run_info.json``, the model card): name, peak rate, weight
    decay and the parameters and tensors each holds; ``describe_groups`` without the tensors' names."""
    groups = [{**group, "lr": group.get("initial_lr", group["lr"])} for group in optimizer.param_groups]
    keep = ("name", "lr", "weight_decay", "parameters", "lr_multiplier")
    return [
        {key: group[key] for key in keep if key in group} | {"tensors": len(group["tensors"])}
        for group in describe_groups(model, groups)
    ]


def group_text(group: dict) -> str:
    """One ``recorded_groups`` entry in words: ``matrices: lr 0.0026, wd 0.1, 786,432 parameters`` (under muP the
    hidden matrices' factor too: ``matrices: lr 0.0005 (x 0.1667, muP), ...``)."""
    factor = f" (x {group['lr_multiplier']:.4g}, muP)" if "lr_multiplier" in group else ""
    return f"{group['name']}: lr {group['lr']:g}{factor}, wd {group['weight_decay']:g}, {group['parameters']:,} parameters"


def groups_text(recorded: list[dict]) -> str:
    """``recorded_groups`` in one line, for the card: ``matrices: lr 0.0026, wd 0.1, 786,432 parameters; ...``."""
    return "; ".join(map(group_text, recorded))


def groups_comment(recorded: list[dict]) -> str:
    """``recorded_groups`` as YAML comment lines, for the end of ``training_config.yaml``: the rates the settings
    above gave each group, for a reader (a comment: reading the file back as a TrainConfig is unchanged)."""
    lines = ["The optimizer groups these settings gave (training/optim.py; run_info.json has them as data):"]
    lines += [f"  {group_text(group)}" for group in recorded]
    return "".join(f"# {line}\n" for line in lines)


def make_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW over ``param_groups``; the fused kernel where torch has one (CPU and CUDA): one call updates every
    tensor, instead of a Python loop over them (about 4x faster for the nano model on CPU)."""
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in model.parameters())
    return torch.optim.AdamW(
        param_groups(model, cfg),
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        fused=fused or None,
    )


def make_scheduler(optimizer: torch.optim.Optimizer, cfg, num_training_steps: int):
    """transformers' scheduler ``cfg.lr_scheduler_type``; stepped once per optimizer step."""
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
