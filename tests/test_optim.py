"""training.optim: which parameter gets which optimizer rule, rate and weight decay.

The groups of every preset are printed (``pytest -s tests/test_optim.py``) and checked against the module's rules,
so a new rule that moves a tensor to another group shows here first.
"""

import copy

import pytest
import torch

import decoderlab
from decoderlab import DecoderLabConfig
from decoderlab.configuration_decoderlab import PRESETS
from training.args import TrainConfig
from training.optim import describe_groups, make_optimizer, make_scheduler, param_groups


def expected_group(name: str, tied: bool, embedding_rate: bool, muon: bool = False) -> str:
    """The group a tensor belongs in, by its name alone (the rules of training.optim's docstring)."""
    token_embedding = name == "model.embed_tokens.weight" or (tied and name == "lm_head.weight")
    if token_embedding and embedding_rate:
        return "embeddings"
    if muon and name.startswith("model.layers.") and name.endswith("proj.weight"):
        return "muon_matrices"  # a block's 2-D weight: q/k/v/o, the MLP's projections
    if name.endswith("proj.weight") or name == "lm_head.weight":
        return "matrices"
    return "other"  # norms, biases, learned positions, the token embeddings without a rate of their own


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("embedding_learning_rate", [None, 4e-3])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_groups_of_every_preset(preset, embedding_learning_rate, optimizer):
    """Every preset's parameters, each in exactly one named group with the rate and decay its rule gives; printed.
    With optimizer muon, the blocks' 2-D weights (and only they) are Muon's; the embeddings, a tied or untied head,
    norms, biases and learned positions stay in AdamW's groups, whatever the preset."""
    config = DecoderLabConfig.from_preset(preset, vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=48)  # fmt: skip
    model = decoderlab.DecoderLabForCausalLM(config)
    cfg = TrainConfig(learning_rate=1e-3, weight_decay=0.1, embedding_learning_rate=embedding_learning_rate,
                      optimizer=optimizer, muon_learning_rate=0.03, muon_weight_decay=0.01)  # fmt: skip
    groups = param_groups(model, cfg)
    described = describe_groups(model, groups)
    print(f"\n{preset} (optimizer={optimizer}, embedding_learning_rate={embedding_learning_rate}):")
    for group in described:
        print(f"  {group['name']:<13} {'Muon ' if group['use_muon'] else 'AdamW'} lr={group['lr']:g} "
              f"wd={group['weight_decay']:g} {group['parameters']:>6} parameters: {', '.join(group['tensors'])}")  # fmt: skip
    found = {tensor: group["name"] for group in described for tensor in group["tensors"]}
    names = [name for name, _ in model.named_parameters()]  # a tied head is listed once, as the embedding
    assert sorted(found) == sorted(names)
    assert sum(len(group["params"]) for group in groups) == len(names)
    tied, muon = config.tie_word_embeddings, optimizer == "muon"
    assert found == {name: expected_group(name, tied, embedding_learning_rate is not None, muon) for name in names}
    settings = {group["name"]: (group["lr"], group["weight_decay"], group["use_muon"]) for group in groups}
    assert settings.get("matrices", (1e-3, 0.1, False)) == (1e-3, 0.1, False)  # only an untied head, with Muon
    assert settings["other"] == (1e-3, 0.0, False)
    assert settings.get("embeddings") == (None if embedding_learning_rate is None else (4e-3, 0.0, False))
    assert settings.get("muon_matrices") == ((0.03, 0.01, True) if muon else None)
    assert all(p.ndim == 2 for group in groups if group["use_muon"] for p in group["params"])
    make_optimizer(model, cfg)  # torch.optim.Muon itself accepts its group (it refuses any tensor not 2-D)


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


def test_muon_with_adamw_is_torch_muon_and_torch_adamw(tiny_config):
    """optimizer muon: MuonWithAdamW steps its Muon group exactly as torch.optim.Muon does and its AdamW groups
    exactly as torch.optim.AdamW does (the same tensors updated by the two torch optimizers side by side), through
    a schedule that scales every group's rate; one state_dict holds both states, and loading it continues exactly."""
    cfg = TrainConfig(optimizer="muon", learning_rate=2e-3, muon_learning_rate=0.03, muon_weight_decay=0.01,
                      muon_momentum=0.9, num_warmup_steps=2, max_train_steps=8)  # fmt: skip
    torch.manual_seed(0)
    model = decoderlab.DecoderLabForCausalLM(tiny_config())
    twin = copy.deepcopy(model)
    combined = make_optimizer(model, cfg)
    scheduler = make_scheduler(combined, cfg, cfg.max_train_steps)
    groups = param_groups(twin, cfg)
    muon = torch.optim.Muon([g for g in groups if g["use_muon"]], lr=0.03, weight_decay=0.01, momentum=0.9)
    adamw = torch.optim.AdamW([g for g in groups if not g["use_muon"]], lr=2e-3, betas=(0.9, 0.99), eps=1e-8, fused=True)
    schedulers = [make_scheduler(o, cfg, cfg.max_train_steps) for o in (muon, adamw)]
    ids = torch.randint(0, tiny_config().vocab_size, (4, 12))

    def step(net, optimizers, schedules):
        net(input_ids=ids, labels=ids).loss.backward()
        for optimizer, schedule in zip(optimizers, schedules):
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()

    for _ in range(4):
        step(model, [combined], [scheduler])
        step(twin, [muon, adamw], schedulers)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert {g["name"]: g["lr"] for g in combined.param_groups}["muon_matrices"] == pytest.approx(
        muon.param_groups[0]["lr"]
    )
    state = combined.state_dict()
    kinds = {key for per_param in state["state"].values() for key in per_param}
    assert kinds == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}

    # exact continuation from the state_dict (a checkpoint), into a fresh model and optimizer
    saved = copy.deepcopy((model.state_dict(), state, scheduler.state_dict()))
    step(model, [combined], [scheduler])
    after = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(saved[0])
    restored = make_optimizer(model, cfg)
    restored_scheduler = make_scheduler(restored, cfg, cfg.max_train_steps)
    restored.load_state_dict(saved[1])  # after the schedule is made, as a resumed run loads it
    restored_scheduler.load_state_dict(saved[2])
    step(model, [restored], [restored_scheduler])
    for a, b in zip(model.parameters(), after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_warmup_stable_decay_is_transformers_schedule(tiny_config):
    """lr_scheduler_type warmup_stable_decay is transformers' get_wsd_schedule with the kwargs as given (a linear
    decay to a floor, as in modded-nanogpt, instead of its default cosine to 0); a warm-up and decay longer than
    the run are refused with the numbers."""
    from transformers import get_wsd_schedule

    kwargs = {"num_decay_steps": 4, "decay_type": "linear", "min_lr_ratio": 0.1}
    cfg = TrainConfig(lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs=kwargs, num_warmup_steps=2,
                      max_train_steps=10, learning_rate=1e-3)  # fmt: skip
    model = decoderlab.DecoderLabForCausalLM(tiny_config())
    ours = make_optimizer(model, cfg)
    reference = make_optimizer(model, cfg)
    schedules = [make_scheduler(ours, cfg, 10), get_wsd_schedule(reference, 2, num_training_steps=10, **kwargs)]
    rates = []
    for _ in range(11):
        rates.append([s.get_last_lr()[0] for s in schedules])
        for optimizer, schedule in zip((ours, reference), schedules):
            optimizer.step()
            schedule.step()
    assert [a for a, _ in rates] == [b for _, b in rates]
    assert rates[2][0] == rates[5][0] == 1e-3 and rates[10][0] == pytest.approx(1e-4)  # stable, then the floor
    long = TrainConfig(lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs={"num_decay_steps": 9},
                       num_warmup_steps=2, max_train_steps=10)  # fmt: skip
    with pytest.raises(ValueError, match="num_warmup_steps=2 plus lr_scheduler_kwargs num_decay_steps=9 exceed the run's 10"):
        make_scheduler(make_optimizer(model, long), long, 10)


def test_unknown_optimizer_is_one_error_line(capsys):
    """--optimizer with a name training.optim does not build: exit status 2 and one error: line naming the
    choices (the command line's usual check), before any data is read."""
    from decoderlab.cli import run_command
    from training import pretrain

    with pytest.raises(SystemExit) as exit_info:
        run_command(pretrain.main, ["--optimizer", "sgd", "--max_train_steps", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: optimizer must be one of 'adamw', 'muon', got 'sgd' (str)."], err
