"""training.optim: which parameter gets which optimizer rule, rate and weight decay.

The groups of every preset are printed (``pytest -s tests/test_optim.py``) and checked against the module's rules,
so a new rule that moves a tensor to another group shows here first.
"""

import pytest

import decoderlab
from decoderlab import DecoderLabConfig
from decoderlab.configuration_decoderlab import PRESETS
from training.args import TrainConfig
from training.optim import describe_groups, make_optimizer, make_scheduler, param_groups


def expected_group(name: str, tied: bool, embedding_rate: bool) -> str:
    """The group a tensor belongs in, by its name alone (the rules of training.optim's docstring)."""
    token_embedding = name == "model.embed_tokens.weight" or (tied and name == "lm_head.weight")
    if token_embedding and embedding_rate:
        return "embeddings"
    if name.endswith("proj.weight") or name == "lm_head.weight":
        return "matrices"
    return "other"  # norms, biases, learned positions, the token embeddings without a rate of their own


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("embedding_learning_rate", [None, 4e-3])
def test_groups_of_every_preset(preset, embedding_learning_rate):
    """Every preset's parameters, each in exactly one named group with the rate and decay its rule gives; printed."""
    config = DecoderLabConfig.from_preset(preset, vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=48)  # fmt: skip
    model = decoderlab.DecoderLabForCausalLM(config)
    cfg = TrainConfig(learning_rate=1e-3, weight_decay=0.1, embedding_learning_rate=embedding_learning_rate)
    groups = param_groups(model, cfg)
    described = describe_groups(model, groups)
    print(f"\n{preset} (embedding_learning_rate={embedding_learning_rate}):")
    for group in described:
        print(f"  {group['name']:<10} lr={group['lr']:g} wd={group['weight_decay']:g} "
              f"{group['parameters']:>6} parameters: {', '.join(group['tensors'])}")  # fmt: skip
    found = {tensor: group["name"] for group in described for tensor in group["tensors"]}
    names = [name for name, _ in model.named_parameters()]  # a tied head is listed once, as the embedding
    assert sorted(found) == sorted(names)
    assert sum(len(group["params"]) for group in groups) == len(names)
    tied = config.tie_word_embeddings
    assert found == {name: expected_group(name, tied, embedding_learning_rate is not None) for name in names}
    settings = {group["name"]: (group["lr"], group["weight_decay"]) for group in groups}
    assert settings["matrices"] == (1e-3, 0.1) and settings["other"] == (1e-3, 0.0)
    assert settings.get("embeddings") == (None if embedding_learning_rate is None else (4e-3, 0.0))


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
