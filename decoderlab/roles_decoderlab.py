"""What each kind of parameter gets: one table from (role, optimizer, parametrization) to its rules.

``DecoderLabPreTrainedModel.parameter_roles()`` names every parameter's role once (hidden matrix, residual output,
readout, token or position embedding, gain, bias, scalar, attention sink, adapter). ``RULES`` says what a parameter of each role gets:
its optimizer group and update rule, its peak rate and muP's factor on it, its weight decay, and how it starts. The
model's ``_init_weights``, the training scripts' optimizer groups (``training/optim.py``) and the exporters' muP folds
all read this one table; a parameter the model names no role for is refused by name.

muP (Yang et al. 2022, "Tensor Programs V", Table 8, for Adam) gives a matrix its factors from its own width
multipliers: ``ParameterRole.fan_in`` and ``fan_out``, how many times wider each side is than in the base model
(``DecoderLabConfig.mup_base_shapes``; 1 in the standard parametrization, so every factor below is 1 there):

- hidden (both sides grow): drawn with std / sqrt(fan_in), trained at the Adam rate / fan_in;
- output-like (only the input side grows): std / fan_in, rate / fan_in. The readout (``lm_head``) takes the
  equivalent form instead: its output is multiplied by alpha_out / fan_in in the forward pass (``logit_scale``), and
  it keeps its std and rate (Tensor Programs V, Table 9; microsoft/mup's MuReadout);
- input-like (only the output side grows: the embeddings, gains, biases, a matrix from a fixed width): std and rate
  as at the base width.

Muon's orthogonalised update has a spectral norm that does not grow with the width when a matrix's two sides grow
together (Yang, Simon & Bernstein 2023), so its rate takes no factor; under muP, a Muon matrix whose sides grow apart
has no rule here and is refused (``muon_width_problems``).

This file travels inside checkpoints with ``modeling_decoderlab.py``, so it imports nothing but the standard library.
"""

import math
from dataclasses import dataclass
from typing import Literal

Role = Literal[
    "hidden_matrix",  # a block's linear layer read by the next computation (q/k/v, the MLP's gate and up)
    "residual_output",  # a block's linear layer that writes into the residual stream (o_proj, down_proj)
    "readout",  # the logits' matrix (lm_head; a classifier's score)
    "token_embedding",  # the token embeddings (and a tied lm_head: the same tensor)
    "position_embedding",  # learned absolute positions
    "gain",  # a norm's weight
    "bias",  # any bias
    "scalar",  # a learned number that mixes two paths (the value residual's lambda)
    "attention_sink",  # a learned logit per query head in the attention softmax's denominator (gpt-oss's sinks)
    "adapter",  # a LoRA factor (peft's lora_A / lora_B): one side the rank, fixed
]
ANY = "*"


@dataclass(frozen=True)
class ParameterRole:
    """A parameter's role, and for a matrix the width multipliers of its input and output sides under muP."""

    role: Role
    fan_in: float = 1.0  # how many times wider the input side is than in the base model (1.0: as wide, or standard)
    fan_out: float = 1.0

    @property
    def grows_apart(self) -> bool:
        """The two sides of a matrix grow by different factors (one may stay fixed)."""
        return not math.isclose(self.fan_in, self.fan_out)


@dataclass(frozen=True)
class Rule:
    role: Role
    optimizer: str  # TrainConfig.optimizer this row applies to (ANY: both)
    parametrization: str  # DecoderLabConfig.parametrization this row applies to (ANY: both)
    group: str  # the optimizer group (training/optim.py): parameters with the same rule train together
    update: Literal["adamw", "muon"]
    rate: str  # the TrainConfig field holding the group's peak learning rate
    rate_per_fan_in: bool  # muP: the rate is divided by the matrix's fan_in (Adam's hidden and output-like rule)
    decay: str | None  # the TrainConfig field holding its weight decay; None: never decayed
    init: str  # how it starts: see init_std and DecoderLabPreTrainedModel._init_weights


# Read a row as: a parameter of this role, trained with this optimizer under this parametrization, goes to this group,
# is updated by this rule at this rate (divided by its fan_in when marked), decays by this field, and starts as init.
# Token embeddings without an embedding_learning_rate of their own train in group "other" at learning_rate.
# fmt: off
RULES: tuple[Rule, ...] = (
    #    role                  optimizer  param.      group            update   rate                       / fan_in  decay                init
    Rule("hidden_matrix",      "adamw",   ANY,        "matrices",      "adamw", "learning_rate",           True,     "weight_decay",      "matrix"),
    Rule("hidden_matrix",      "muon",    ANY,        "muon_matrices", "muon",  "muon_learning_rate",      False,    "muon_weight_decay", "matrix"),
    Rule("residual_output",    "adamw",   ANY,        "matrices",      "adamw", "learning_rate",           True,     "weight_decay",      "residual"),
    Rule("residual_output",    "muon",    ANY,        "muon_matrices", "muon",  "muon_learning_rate",      False,    "muon_weight_decay", "residual"),
    Rule("readout",            ANY,       "standard", "matrices",      "adamw", "learning_rate",           False,    "weight_decay",      "normal"),
    Rule("readout",            ANY,       "mup",      "output",        "adamw", "learning_rate",           False,    "weight_decay",      "normal"),
    Rule("adapter",            ANY,       "standard", "matrices",      "adamw", "learning_rate",           False,    "weight_decay",      "own"),
    Rule("adapter",            ANY,       "mup",      "output",        "adamw", "learning_rate",           False,    "weight_decay",      "own"),
    Rule("token_embedding",    ANY,       ANY,        "embeddings",    "adamw", "embedding_learning_rate", False,    None,                "embedding"),
    Rule("position_embedding", ANY,       ANY,        "other",         "adamw", "learning_rate",           False,    None,                "normal"),
    Rule("gain",               ANY,       ANY,        "other",         "adamw", "learning_rate",           False,    None,                "ones"),
    Rule("bias",               ANY,       ANY,        "other",         "adamw", "learning_rate",           False,    None,                "zeros"),
    Rule("scalar",             ANY,       ANY,        "other",         "adamw", "learning_rate",           False,    None,                "own"),
    Rule("attention_sink",     ANY,       ANY,        "other",         "adamw", "learning_rate",           False,    None,                "normal"),
)
# fmt: on
# The groups in the order an optimizer holds them: a checkpoint's optimizer state lists its groups by position
GROUP_ORDER = ("matrices", "other", "embeddings", "muon_matrices", "output")


def rule_for(role: Role, optimizer: str, parametrization: str) -> Rule:
    """The row of ``RULES`` for a parameter of ``role`` trained with ``optimizer`` under ``parametrization``."""
    for rule in RULES:
        if rule.role == role and rule.optimizer in (optimizer, ANY) and rule.parametrization in (parametrization, ANY):
            return rule
    raise ValueError(
        f"No rule for a {role} parameter with optimizer={optimizer!r} and parametrization={parametrization!r}."
    )


def init_of(role: Role) -> str:
    """How a parameter of ``role`` starts (the same in every row of the role)."""
    return next(rule.init for rule in RULES if rule.role == role)


def mup_std_factor(role: ParameterRole) -> float:
    """muP's factor on a matrix's initial std (1 where nothing grows): 1/sqrt(fan_in) when both sides grow (hidden),
    1/fan_in when only the input side grows (output-like), 1 when only the output side grows (input-like)."""
    if math.isclose(role.fan_in, 1.0):
        return 1.0
    return 1.0 / (role.fan_in if math.isclose(role.fan_out, 1.0) else math.sqrt(role.fan_in))


def init_std(role: ParameterRole, config) -> float | None:
    """The standard deviation a parameter of ``role`` is drawn with, or None for one that is not drawn (gains, biases,
    scalars, adapters).

    ``initializer_range`` for matrices (times muP's factor), the readout, learned positions and attention sinks (as
    gpt-oss draws its sinks);
    ``embedding_initializer_range`` (when set) for the token embeddings; a residual output also shrinks by
    sqrt(2 x layers) with ``scale_residual_init`` (GPT-2, Radford et al. 2019: the residual stream's variance stays
    bounded with depth). With ``zero_residual_init`` it is drawn and then zeroed (see _init_weights)."""
    std = config.initializer_range
    how = init_of(role.role)
    if how == "embedding":
        return std if config.embedding_initializer_range is None else config.embedding_initializer_range
    if how == "normal":
        return std
    if how == "matrix":
        return std * mup_std_factor(role)
    if how == "residual":
        depth = math.sqrt(2 * config.num_hidden_layers) if config.scale_residual_init else 1.0
        return std * mup_std_factor(role) / depth
    return None


def rate_factor(rule: Rule, role: ParameterRole) -> float:
    """muP's factor on the rate of a parameter of ``role`` under ``rule``: 1 / fan_in where the rule says so, else 1."""
    return 1.0 / role.fan_in if rule.rate_per_fan_in else 1.0


def muon_width_problems(roles: dict[str, ParameterRole], optimizer: str, parametrization: str) -> list[str]:
    """The Muon matrices whose two sides grow apart under muP (``name: fan_in x A, fan_out x B``), for which this
    table has no rule; empty otherwise."""
    return [
        f"{name}: fan_in x {role.fan_in:.4g}, fan_out x {role.fan_out:.4g}"
        for name, role in roles.items()
        if rule_for(role.role, optimizer, parametrization).update == "muon" and role.grows_apart
    ]
