"""training.optim: which parameter gets which optimizer rule, rate and weight decay.

The groups of every preset are printed (``pytest -s tests/test_optim.py``) and checked against the module's rules,
so a new rule that moves a tensor to another group shows here first.
"""

import copy

import pytest
import torch
import yaml

import decoderlab
from decoderlab import DecoderLabConfig
from decoderlab.configuration_decoderlab import PRESETS
from training.args import TrainConfig
from training.optim import (
    BatchedMuon,
    describe_groups,
    groups_comment,
    groups_text,
    make_optimizer,
    make_scheduler,
    newton_schulz_dtype,
    param_groups,
    recorded_groups,
)


def expected_group(name: str, tied: bool, embedding_rate: bool, muon: bool = False, mup: bool = False) -> str:
    """The group a tensor belongs in, by its name alone (the rules of training.optim's docstring)."""
    token_embedding = name == "model.embed_tokens.weight" or (tied and name == "lm_head.weight")
    if token_embedding and embedding_rate:
        return "embeddings"
    if muon and name.startswith("model.layers.") and name.endswith("proj.weight"):
        return "muon_matrices"  # a block's 2-D weight: q/k/v/o, the MLP's projections
    if name.endswith("proj.weight"):
        return "matrices"
    if name == "lm_head.weight":
        return "output" if mup else "matrices"  # under muP an untied head is no hidden matrix
    return "other"  # norms, biases, learned positions, the token embeddings without a rate of their own


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("embedding_learning_rate", [None, 4e-3])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("parametrization", ["standard", "mup"])
def test_groups_of_every_preset(preset, embedding_learning_rate, optimizer, parametrization):
    """Every preset's parameters, each in exactly one named group with the rate and decay its rule gives; printed.
    With optimizer muon, the blocks' 2-D weights (and only they) are Muon's; the embeddings, a tied or untied head,
    norms, biases and learned positions stay in AdamW's groups, whatever the preset. Under muP (m = 4) AdamW's hidden
    matrices train at learning_rate / 4, Muon's at its own rate (no factor), and an untied head is a group of its own
    at learning_rate, with decay."""
    mup = parametrization == "mup"
    config = DecoderLabConfig.from_preset(preset, vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=48,
                                          **(dict(parametrization="mup", mup_base_width=8) if mup else {}))  # fmt: skip
    model = decoderlab.DecoderLabForCausalLM(config)
    cfg = TrainConfig(learning_rate=1e-3, weight_decay=0.1, embedding_learning_rate=embedding_learning_rate,
                      optimizer=optimizer, muon_learning_rate=0.03, muon_weight_decay=0.01)  # fmt: skip
    groups = param_groups(model, cfg)
    described = describe_groups(model, groups)
    print(f"\n{preset}, {parametrization} (optimizer={optimizer}, embedding_learning_rate={embedding_learning_rate}):")
    for group in described:
        print(f"  {group['name']:<13} {'Muon ' if group['use_muon'] else 'AdamW'} lr={group['lr']:g} "
              f"wd={group['weight_decay']:g} {group['parameters']:>6} parameters: {', '.join(group['tensors'])}")  # fmt: skip
    found = {tensor: group["name"] for group in described for tensor in group["tensors"]}
    names = [name for name, _ in model.named_parameters()]  # a tied head is listed once, as the embedding
    assert sorted(found) == sorted(names)
    assert sum(len(group["params"]) for group in groups) == len(names)
    tied, muon = config.tie_word_embeddings, optimizer == "muon"
    assert found == {name: expected_group(name, tied, embedding_learning_rate is not None, muon, mup) for name in names}
    settings = {group["name"]: (group["lr"], group["weight_decay"], group["use_muon"]) for group in groups}
    assert settings.get("matrices", (2.5e-4 if mup else 1e-3, 0.1, False)) == (2.5e-4 if mup else 1e-3, 0.1, False)
    assert settings["other"] == (1e-3, 0.0, False)
    assert settings.get("embeddings") == (None if embedding_learning_rate is None else (4e-3, 0.0, False))
    assert settings.get("muon_matrices") == ((0.03, 0.01, True) if muon else None)
    assert settings.get("output") == (None if tied or not mup else (1e-3, 0.1, False))
    multipliers = {group["name"]: group.get("lr_multiplier") for group in groups}
    if mup:
        assert multipliers.get("matrices", 0.25) == 0.25 and multipliers.get("muon_matrices", 1.0) == 1.0
    else:
        assert set(multipliers.values()) == {None}
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
    """optimizer muon: MuonWithAdamW steps its Muon group exactly as torch.optim.Muon does (its batched products in
    bfloat16, torch's dtype, give torch's numbers bit for bit) and its AdamW groups exactly as torch.optim.AdamW does
    (the same tensors updated by the two torch optimizers side by side), through a schedule that scales every group's
    rate; one state_dict holds both states, and loading it continues exactly."""
    cfg = TrainConfig(optimizer="muon", learning_rate=2e-3, muon_learning_rate=0.03, muon_weight_decay=0.01,
                      muon_momentum=0.9, num_warmup_steps=2, max_train_steps=8, muon_ns_dtype="bfloat16")  # fmt: skip
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


MUON_SHAPES = [(24, 24)] * 3 + [(40, 24)] * 2 + [(24, 40)] * 2 + [(7, 5)]  # square, tall, wide, one alone


def muon_twins(count: int = 3) -> list[list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    weights = [0.1 * torch.randn(shape) for shape in MUON_SHAPES]
    return [[torch.nn.Parameter(w.clone()) for w in weights] for _ in range(count)]


def feed(optimizers_params, steps: int = 4):
    """``steps`` steps of every (optimizer, params) pair on the same random gradients."""
    for _ in range(steps):
        grads = [torch.randn(shape) for shape in MUON_SHAPES]
        for optimizer, params in optimizers_params:
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            optimizer.step()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_batched_muon_in_bfloat16_is_torch_muon_bit_for_bit(nesterov, adjust_lr_fn):
    """BatchedMuon orthogonalises every matrix of one shape in one batched product; in bfloat16 (torch's dtype) its
    parameters and momentum buffers equal torch.optim.Muon's exactly, for square, tall and wide matrices, with and
    without Nesterov, weight decay and either per-shape rate."""
    ours, theirs = muon_twins(2)
    settings = dict(lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    batched, reference = BatchedMuon(ours, ns_dtype=torch.bfloat16, **settings), torch.optim.Muon(theirs, **settings)
    feed([(batched, ours), (reference, theirs)])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(batched.state[a]["momentum_buffer"], reference.state[b]["momentum_buffer"],
                                   rtol=0, atol=0)  # fmt: skip


def reference_muon_step(params, grads, buffers, lr=0.02, momentum=0.95, weight_decay=0.05, coefficients=(3.4445,
                        -4.7750, 2.0315), steps=5):  # fmt: skip
    """Muon in float64, one matrix at a time, written from torch.optim.Muon's docstring: B <- mu B + (1 - mu) G,
    Nesterov's G + mu (B - G), Newton-Schulz on the smaller side, decay, then the rate x sqrt(max(1, out/in))."""
    a, b, c = coefficients
    for p, g, buf in zip(params, grads, buffers):
        buf.mul_(momentum).add_(g, alpha=1 - momentum)
        x = g + momentum * (buf - g)
        x = x.T if x.shape[0] > x.shape[1] else x
        x = x / x.norm()
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.T if g.shape[0] > g.shape[1] else x
        p.mul_(1 - lr * weight_decay).sub_(x, alpha=lr * max(1.0, p.shape[0] / p.shape[1]) ** 0.5)


def test_batched_muon_in_float32_is_muons_arithmetic():
    """In float32 (what muon_ns_dtype auto takes on a CPU without bfloat16 instructions), BatchedMuon follows the
    algorithm computed in float64, one matrix at a time, to float32 rounding (5e-6 after 4 steps of rate 0.02),
    closer than torch's bfloat16 products come (their rounding is about 2e-3 of each update)."""
    (ours,) = muon_twins(1)
    batched = BatchedMuon(ours, ns_dtype=torch.float32, lr=0.02, weight_decay=0.05)
    exact = [p.detach().double().clone() for p in ours]
    buffers = [torch.zeros_like(p) for p in exact]
    for _ in range(4):
        grads = [torch.randn(shape) for shape in MUON_SHAPES]
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        batched.step()
        reference_muon_step(exact, [g.double() for g in grads], buffers)
    for a, b in zip(ours, exact):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=5e-6)


def test_newton_schulz_dtype_auto_follows_the_hardware():
    """muon_ns_dtype auto: bfloat16 on an accelerator and on a CPU that computes bfloat16 in hardware (oneDNN's
    answer, as for --mixed_precision bf16), float32 on any other CPU; a dtype given is used as given, and recorded."""
    from training.hardware import cpu_has_bf16

    assert newton_schulz_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert newton_schulz_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    assert newton_schulz_dtype("float32", torch.device("cuda")) == torch.float32
    model = decoderlab.DecoderLabForCausalLM(DecoderLabConfig.from_preset("llama", vocab_size=50, hidden_size=32,
                                             num_hidden_layers=1, num_attention_heads=4))  # fmt: skip
    optimizer = make_optimizer(model, TrainConfig(optimizer="muon", muon_ns_dtype="float32"))
    recorded = {g["name"]: g for g in recorded_groups(model, optimizer)}
    assert recorded["muon_matrices"]["newton_schulz"] == "float32" and "newton_schulz" not in recorded["other"]


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
                           "parameters": recorded[0]["parameters"], "optimizer": "adamw", "tensors": 14}  # fmt: skip
    assert groups_text(recorded).startswith("matrices: lr 0.00025 (x 0.25, muP), wd 0.1, ")
    comment = groups_comment(recorded)
    assert yaml.safe_load("learning_rate: 0.001\n" + comment) == {"learning_rate": 0.001}  # comments only
    assert "#   matrices: AdamW, lr 0.00025 (x 0.25, muP), wd 0.1, " in comment
    assert "#   output: AdamW, lr 0.001, wd 0.1, 6,336 parameters in 1 tensor\n" in comment


def test_mup_with_muon_leaves_muons_rate_alone(tiny_config):
    """muP and Muon together: AdamW's groups keep muP's rules (an untied head in output), the blocks' matrices are
    Muon's at muon_learning_rate with no width factor (recorded as x 1). (muon_adjust_lr_fn match_rms_adamw, whose
    update grows like sqrt(width), is refused by the pre-flight check: tests/test_preflight.py.)"""
    model = decoderlab.DecoderLabForCausalLM(tiny_config(parametrization="mup", mup_base_width=16))  # m = 4
    cfg = TrainConfig(learning_rate=1e-3, optimizer="muon", muon_learning_rate=0.02)
    recorded = {g["name"]: g for g in recorded_groups(model, make_optimizer(model, cfg))}
    assert list(recorded) == ["other", "muon_matrices", "output"]
    assert (recorded["muon_matrices"]["lr"], recorded["muon_matrices"]["lr_multiplier"]) == (0.02, 1.0)
    assert recorded["output"]["lr"] == 1e-3 and recorded["muon_matrices"]["tensors"] == 14
