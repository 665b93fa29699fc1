"""training.optim: which parameter gets which optimizer rule, rate and weight decay.

The groups of every preset are printed (``pytest -s tests/test_optim.py``) and checked against the module's rules,
so a new rule that moves a tensor to another group shows here first.
"""

import pytest
import yaml

import decoderlab
from decoderlab import DecoderLabConfig
from decoderlab.configuration_decoderlab import PRESETS
from training.args import TrainConfig
from training.optim import (
    describe_groups,
    groups_comment,
    groups_text,
    make_optimizer,
    make_scheduler,
    mup_lr_multiplier,
    param_groups,
    recorded_groups,
)


def expected_group(name: str, tied: bool, embedding_rate: bool, mup: bool = False) -> str:
    """The group a tensor belongs in, by its name alone (the rules of training.optim's docstring)."""
    token_embedding = name == "model.embed_tokens.weight" or (tied and name == "lm_head.weight")
    if token_embedding and embedding_rate:
        return "embeddings"
    if name.endswith("proj.weight"):
        return "matrices"
    if name == "lm_head.weight" and not tied:
        return "output" if mup else "matrices"
    return "other"  # norms, biases, learned positions, the token embeddings without a rate of their own


# muP at 4x its base width: the hidden matrices' AdamW rate is divided by 4
PARAMETRIZATIONS = {"standard": {}, "mup": dict(parametrization="mup", mup_base_width=8)}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("embedding_learning_rate", [None, 4e-3])
@pytest.mark.parametrize("parametrization", list(PARAMETRIZATIONS))
def test_groups_of_every_preset(preset, embedding_learning_rate, parametrization):
    """Every preset's parameters, each in exactly one named group with the rate and decay its rule gives; printed.
    Under muP (m = 4) the hidden matrices' rate is learning_rate / 4, and an untied head is a group of its own at
    learning_rate, with decay."""
    config = DecoderLabConfig.from_preset(preset, vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=48,
                                          **PARAMETRIZATIONS[parametrization])  # fmt: skip
    model = decoderlab.DecoderLabForCausalLM(config)
    cfg = TrainConfig(learning_rate=1e-3, weight_decay=0.1, embedding_learning_rate=embedding_learning_rate)
    groups = param_groups(model, cfg)
    described = describe_groups(model, groups)
    print(f"\n{preset}, {parametrization} (embedding_learning_rate={embedding_learning_rate}):")
    for group in described:
        print(f"  {group['name']:<10} lr={group['lr']:g} wd={group['weight_decay']:g} "
              f"{group['parameters']:>6} parameters: {', '.join(group['tensors'])}")  # fmt: skip
    found = {tensor: group["name"] for group in described for tensor in group["tensors"]}
    names = [name for name, _ in model.named_parameters()]  # a tied head is listed once, as the embedding
    assert sorted(found) == sorted(names)
    assert sum(len(group["params"]) for group in groups) == len(names)
    tied, mup = config.tie_word_embeddings, parametrization == "mup"
    assert found == {name: expected_group(name, tied, embedding_learning_rate is not None, mup) for name in names}
    settings = {group["name"]: (group["lr"], group["weight_decay"]) for group in groups}
    assert settings["matrices"] == ((2.5e-4 if mup else 1e-3), 0.1) and settings["other"] == (1e-3, 0.0)
    assert settings.get("embeddings") == (None if embedding_learning_rate is None else (4e-3, 0.0))
    assert settings.get("output") == (None if tied or not mup else (1e-3, 0.1))
    assert [group.get("lr_multiplier") for group in groups if group["name"] == "matrices"] == [0.25 if mup else None]


def test_mup_rates_keep_their_ratio_through_the_schedule_and_are_recorded(tiny_config):
    """transformers' schedule scales each group's own peak rate (never sets one rate for all), so muP's 1/m stays
    at every step of warmup and decay; the record (run_info.json, the card) names the factor."""
    model = decoderlab.DecoderLabForCausalLM(tiny_config(parametrization="mup", mup_base_width=16))  # m = 4
    cfg = TrainConfig(learning_rate=1e-3, num_warmup_steps=3, max_train_steps=12)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg, cfg.max_train_steps)
    groups = {group["name"]: group for group in optimizer.param_groups}
    assert list(groups) == ["matrices", "other", "output"]  # the new group last: standard runs keep their order
    for _ in range(cfg.max_train_steps - 1):
        optimizer.step()
        scheduler.step()
        assert groups["matrices"]["lr"] == pytest.approx(groups["output"]["lr"] / 4) and groups["other"]["lr"] > 0
    recorded = recorded_groups(model, optimizer)
    assert recorded[0] == {"name": "matrices", "lr": 2.5e-4, "weight_decay": 0.1, "lr_multiplier": 0.25,
                           "parameters": recorded[0]["parameters"], "tensors": 14}  # fmt: skip
    assert groups_text(recorded).startswith("matrices: lr 0.00025 (x 0.25, muP), wd 0.1, ")
    comment = groups_comment(recorded)
    assert yaml.safe_load("learning_rate: 0.001\n" + comment) == {"learning_rate": 0.001}  # comments only
    assert "#   output: lr 0.001, wd 0.1, 6,336 parameters" in comment


def test_mup_has_no_rule_for_an_optimizer_it_does_not_know(tiny_config):
    """muP's factor depends on the optimizer (1/m for Adam; Muon's orthogonalised update needs none): a rule
    without one is refused by name rather than given Adam's."""
    config = tiny_config(parametrization="mup", mup_base_width=16)
    assert mup_lr_multiplier(config) == 0.25 and mup_lr_multiplier(tiny_config()) == 1.0
    with pytest.raises(ValueError, match=r"no learning-rate rule for the optimizer 'sgd'; it has one for 'adamw'"):
        mup_lr_multiplier(config, "sgd")


def test_weight_decay_skips_norms_biases_and_embeddings(tiny_config):
    """Only weight matrices decay: not norm gains, biases, token or learned position embeddings (nor a tied head)."""
    for overrides in ({}, {"tie_word_embeddings": True, "position_embedding_type": "learned", "attention_bias": True}):
        model = decoderlab.DecoderLabForCausalLM(tiny_config(**overrides))
        decay, no_decay = (group["params"] for group in param_groups(model, TrainConfig(weight_decay=0.1)))
        names = {id(p): n for n, p in model.named_parameters()}
        decayed = {names[id(p)] for p in decay}
        assert all(("proj" in n and n.endswith("weight")) or n == "lm_head.weight" for n in decayed), decayed
        assert not any("norm" in n or "bias" in n or "embed" in n for n in decayed)
        assert len(decay) + len(no_decay) == len(list(model.parameters()))
        assert ("lm_head.weight" in decayed) == (not overrides)


def test_embedding_learning_rate_is_a_group_of_its_own_that_follows_the_schedule(tiny_config):
    """--embedding_learning_rate puts the token embeddings (and a tied head, the same matrix) into a third,
    undecayed group with that peak rate; the schedule scales it by the same factor as the others."""
    for tie in (False, True):
        model = decoderlab.DecoderLabForCausalLM(tiny_config(tie_word_embeddings=tie))
        cfg = TrainConfig(learning_rate=1e-3, embedding_learning_rate=4e-3, num_warmup_steps=2, max_train_steps=10)
        optimizer = make_optimizer(model, cfg)
        scheduler = make_scheduler(optimizer, cfg, cfg.max_train_steps)
        *others, embeddings = optimizer.param_groups
        assert embeddings["name"] == "embeddings" and embeddings["params"] == [model.model.embed_tokens.weight]
        assert embeddings["weight_decay"] == 0.0 and embeddings["initial_lr"] == 4e-3
        assert all(group["initial_lr"] == 1e-3 for group in others)
        assert sum(len(group["params"]) for group in optimizer.param_groups) == len(list(model.parameters()))
        for _ in range(5):
            optimizer.step()
            scheduler.step()
            assert embeddings["lr"] == pytest.approx(4 * others[0]["lr"]) and others[0]["lr"] > 0
    # without it: two groups, as before
    assert [g["name"] for g in make_optimizer(model, TrainConfig(learning_rate=1e-3)).param_groups] == [
        "matrices", "other"
    ]  # fmt: skip
