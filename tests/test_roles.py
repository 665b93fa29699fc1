"""Parameter roles and the rule table (decoderlab/roles_decoderlab.py): every parameter has one role, named by the model;
one table gives each role its group, rate, muP factor, decay and initialisation; muP takes each matrix's factors from
its own sides; a parameter without a role is refused by name; and runs saved before the table resume as they went on.

References: Tensor Programs V (Yang et al. 2022), Table 8 (hidden, output-like and input-like weights under Adam), and
runs saved by the code before the table (tests/data/runs_before_roles).
"""

import json
import shutil
import typing

import pytest
import torch
import yaml
from torch import nn

import decoderlab
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.cli import UsageError
from decoderlab.configuration_decoderlab import PRESETS
from decoderlab.modeling_decoderlab import BLOCK_MATRICES, DecoderLabForSequenceClassification
from decoderlab.roles_decoderlab import ANY, GROUP_ORDER, RULES, ParameterRole, Role, init_of, init_std, rule_for
from tests.paths import INPUT_TXT, REPO_ROOT
from training import pretrain
from training.args import OPTIMIZERS, TrainConfig
from training.optim import param_groups
from training.preflight import preflight

BEFORE = REPO_ROOT / "tests" / "data" / "runs_before_roles"


def test_the_table_has_exactly_one_rule_for_every_role_optimizer_and_parametrization():
    """Every (role, optimizer, parametrization) finds exactly one row; a role starts the same way in every row (the
    init column belongs to the role); only the blocks' matrices go to Muon, and only under optimizer muon; every
    group is one an optimizer holds in GROUP_ORDER; an optimizer the table does not know is refused by name."""
    for role in typing.get_args(Role):
        inits = {rule.init for rule in RULES if rule.role == role}
        assert len(inits) == 1, (role, inits)
        for optimizer in typing.get_args(OPTIMIZERS):
            for parametrization in ("standard", "mup"):
                matching = [r for r in RULES if r.role == role and r.optimizer in (optimizer, ANY)
                            and r.parametrization in (parametrization, ANY)]  # fmt: skip
                assert len(matching) == 1, (role, optimizer, parametrization, matching)
                rule = rule_for(role, optimizer, parametrization)
                assert rule.group in GROUP_ORDER
                assert (rule.update == "muon") == (optimizer == "muon" and role in ("hidden_matrix", "residual_output"))
    with pytest.raises(ValueError, match="No rule for a hidden_matrix parameter with optimizer='sgd'"):
        rule_for("hidden_matrix", "sgd", "standard")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_parameter_of_every_preset_has_its_role(preset):
    """parameter_roles names every parameter once (a tied head as the token embedding), for every preset, the
    classifier and the switches that add parameters (value residual, learned positions, QK-norm, biases, attention
    sinks): the blocks' linear layers are hidden matrices or residual outputs by BLOCK_MATRICES, lm_head and score
    readouts, norms' weights gains, biases biases, the value residual's lambda a scalar, the sinks attention sinks."""
    fields = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  value_residual=True, qk_norm=True, attention_sinks=True)  # fmt: skip
    for model in (DecoderLabForCausalLM(DecoderLabConfig.from_preset(preset, **fields)),
                  DecoderLabForSequenceClassification(DecoderLabConfig.from_preset(preset, **fields))):  # fmt: skip
        roles = model.parameter_roles()
        assert list(roles) == [name for name, _ in model.named_parameters()]
        for name, role in roles.items():
            if name.endswith("bias"):
                expected = "bias"
            elif name.endswith("embed_tokens.weight"):
                expected = "token_embedding"
            elif name.endswith("embed_positions.weight"):
                expected = "position_embedding"
            elif any(name.endswith(f"{suffix}.weight") for suffix in BLOCK_MATRICES):
                expected = "residual_output" if name.endswith(("o_proj.weight", "down_proj.weight")) else "hidden_matrix"
            elif name in ("lm_head.weight", "score.weight"):
                expected = "readout"
            elif name.endswith("value_residual.weight"):
                expected = "scalar"
            elif name.endswith("self_attn.sinks"):
                expected = "attention_sink"
            else:
                expected = "gain"
                assert "norm" in name, name
            assert role.role == expected, (name, role)


def test_a_new_parameter_without_a_role_is_refused_by_name(tiny_config):
    """A parameter the model names no role for (a new layer, a new learned number) stops the initialisation and the
    optimizer groups with one error naming it, instead of silently taking another's rule."""
    model = DecoderLabForCausalLM(tiny_config())
    model.model.layers[0].mlp.extra_proj = nn.Linear(64, 64)  # not in BLOCK_MATRICES
    with pytest.raises(ValueError, match=r"The parameter model\.layers\.0\.mlp\.extra_proj\.weight \(Linear\.weight"):
        model.parameter_roles()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra_proj\.weight .*has no role"):
        param_groups(model, TrainConfig())
    model = DecoderLabForCausalLM(tiny_config())
    model.model.layers[1].self_attn.temperature = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.temperature \(DecoderLabAttention"):
        model._init_weights(model.model.layers[1].self_attn)


@pytest.mark.parametrize("overrides", [{}, {"parametrization": "mup", "mup_base_width": 16},
                                       {"zero_residual_init": True, "embedding_initializer_range": 0.3}])  # fmt: skip
def test_every_parameter_starts_as_its_role_says(tiny_config, overrides):
    """Drawn tensors have the table's standard deviation (init_std: muP's factor, GPT-2's residual scaling, the
    embeddings' own range), gains start at 1, biases at 0, the value residual's lambda at 0.5, zeroed residual outputs
    at 0; wide matrices are drawn so that the measured std is within 5% of the table's."""
    config = tiny_config(hidden_size=256, intermediate_size=512, vocab_size=400, attention_bias=True,
                         value_residual=True, initializer_range=0.05, **overrides)  # fmt: skip
    model = DecoderLabForCausalLM(config)
    params = dict(model.named_parameters())
    for name, role in model.parameter_roles().items():
        tensor, how = params[name].detach(), init_of(role.role)
        if how == "ones":
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        elif how in ("zeros",) or (how == "residual" and config.zero_residual_init):
            assert torch.equal(tensor, torch.zeros_like(tensor)), name
        elif how == "own":
            assert torch.equal(tensor, torch.full_like(tensor, 0.5)), name
        else:
            assert tensor.std().item() == pytest.approx(init_std(role, config), rel=0.05), name


def mup_fixed_mlp(**fields) -> DecoderLabConfig:
    """m = 4 for the width and the heads; the MLP's width fixed at 512, the base model's too (mup_base_shapes)."""
    return DecoderLabConfig(vocab_size=64, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=512, initializer_range=0.05, parametrization="mup", mup_base_width=64,
                            mup_base_shapes={"intermediate_size": 512}, scale_residual_init=False, **fields)  # fmt: skip


def test_mup_takes_each_matrixs_factors_from_its_own_sides():
    """muP with an intermediate_size that does not grow with hidden_size (stated in mup_base_shapes): q/k/v/o grow on
    both sides (hidden: std / 2, Adam rate / 4), gate and up only on their input side (output-like: std / 4, rate /
    4), down only on its output side (input-like: std and rate as at the base). The Adam groups hold each factor
    apart; the config records the complete base shapes."""
    config = mup_fixed_mlp()
    assert config.mup_base_shapes == {"intermediate_size": 512, "num_attention_heads": 1, "num_key_value_heads": 1,
                                      "head_dim": 64}  # fmt: skip
    assert config.mup_widths == {"hidden_size": 4.0, "intermediate_size": 1.0, "attention": 4.0, "key_value": 4.0}
    model = DecoderLabForCausalLM(config)
    roles = model.parameter_roles()
    expected = {"self_attn.q_proj": (4, 4, 0.05 / 2), "self_attn.o_proj": (4, 4, 0.05 / 2),
                "mlp.up_proj": (4, 1, 0.05 / 4), "mlp.gate_proj": (4, 1, 0.05 / 4), "mlp.down_proj": (1, 4, 0.05)}  # fmt: skip
    params = dict(model.named_parameters())
    for suffix, (fan_in, fan_out, std) in expected.items():
        name = f"model.layers.0.{suffix}.weight"
        assert (roles[name].fan_in, roles[name].fan_out) == (fan_in, fan_out), name
        assert init_std(roles[name], config) == pytest.approx(std)
        assert params[name].std().item() == pytest.approx(std, rel=0.05), name
    groups = {g["name"]: g for g in param_groups(model, TrainConfig(learning_rate=1e-3))}
    names = {id(p): n for n, p in model.named_parameters()}
    assert groups["matrices (x 1)"]["lr"] == 1e-3 and groups["matrices (x 0.25)"]["lr"] == 2.5e-4
    assert {names[id(p)].split(".", 3)[-1] for p in groups["matrices (x 1)"]["params"]} == {"mlp.down_proj.weight"}
    assert [g["name"] for g in param_groups(model, TrainConfig())] == [
        "matrices (x 1)", "matrices (x 0.25)", "other", "output"]  # fmt: skip


def test_mup_with_muon_refuses_matrices_whose_sides_grow_apart(tmp_path):
    """Muon's rate needs no muP factor only where a matrix's two sides grow together: with a fixed intermediate_size
    the pre-flight check refuses optimizer muon, naming the MLP's matrices and their multipliers; with every size
    growing it passes."""
    fields = {"vocab_size": 64, "hidden_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
              "intermediate_size": 512, "parametrization": "mup", "mup_base_width": 64}  # fmt: skip
    run = dict(optimizer="muon", output_dir=str(tmp_path / "run"))
    with pytest.raises(UsageError, match=r"grow apart: model\.layers\.0\.mlp\.gate_proj\.weight: fan_in x 4, fan_out "
                                         r"x 1; .*mlp\.down_proj\.weight: fan_in x 1, fan_out x 4"):  # fmt: skip
        preflight(TrainConfig(model={**fields, "mup_base_shapes": {"intermediate_size": 512}}, **run))
    preflight(TrainConfig(model=fields, **run))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"mup_base_shapes": {"intermediate": 64}}, r"mup_base_shapes has no size 'intermediate'"),
        ({"mup_base_shapes": {"intermediate_size": 0}}, r"mup_base_shapes\['intermediate_size'\] must be a positive"),
        ({"mup_base_shapes": {"head_dim": "wide"}}, r"mup_base_shapes\['head_dim'\] must be a positive number"),
    ],
)
def test_bad_base_shapes_are_refused(tiny_config, fields, message):
    """A base shape the config does not know, or one that is not a positive number: one ValueError naming it; base
    shapes without muP are refused like the other mup_* fields."""
    with pytest.raises(ValueError, match=message):
        tiny_config(parametrization="mup", mup_base_width=16, **fields)
    with pytest.raises(ValueError, match=r"mup_base_shapes=\{'intermediate_size': 8\} is read only with"):
        tiny_config(mup_base_shapes={"intermediate_size": 8})


def test_a_config_saved_without_base_shapes_gets_the_multipliers_it_had(tmp_path, tiny_config):
    """A muP config.json written before mup_base_shapes existed loads with every size grown with hidden_size (one m
    for every matrix, as then), records those base shapes when saved again, and reloads to the same config."""
    config = tiny_config(parametrization="mup", mup_base_width=16, intermediate_size=96)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("mup_base_shapes")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    old = DecoderLabConfig.from_pretrained(tmp_path)
    assert old.mup_base_shapes == {"intermediate_size": 24, "num_attention_heads": 1, "num_key_value_heads": 1,
                                   "head_dim": 16}  # fmt: skip
    assert set(old.mup_widths.values()) == {4.0}
    old.save_pretrained(tmp_path / "again")
    assert DecoderLabConfig.from_pretrained(tmp_path / "again") == old


def copy_run(name: str, folder) -> tuple[list[str], dict]:
    """The saved run ``name`` in ``folder`` (its record and its step_6 checkpoint), the command line that resumes it
    (the same settings, the same text) and what the run did when it went on past the checkpoint."""
    source = BEFORE / name
    shutil.copytree(source / "step_6", folder / "step_6")
    shutil.copy(source / "training_config.yaml", folder / "training_config.yaml")
    text = INPUT_TXT.read_text(encoding="utf-8")
    (folder / "train.txt").write_text(text[:20000])
    (folder / "validation.txt").write_text(text[60000:62000])
    recorded = yaml.safe_load((source / "training_config.yaml").read_text())
    recorded.update(train_file=str(folder / "train.txt"), validation_file=str(folder / "validation.txt"),
                    output_dir=str(folder), resume_from_checkpoint=str(folder / "step_6"))  # fmt: skip
    (folder / "resume.yaml").write_text(yaml.safe_dump(recorded))
    return ["--config", str(folder / "resume.yaml")], json.loads((source / "continued.json").read_text())


@pytest.mark.parametrize("name", ["mup_muon", "adamw_tied"])
def test_a_run_saved_before_the_table_resumes_as_it_went_on(one_thread, tmp_path, name):
    """A checkpoint saved by the code before the role table (muP with Muon and its own embedding rate; AdamW with
    tied embeddings, learned positions and biases) resumes with today's: the same optimizer groups in the same order
    (its optimizer state loads into them), and the training losses of steps 7 to 12 and the final validation loss
    those runs logged when they went on then (to float32 rounding across CPUs' kernels)."""
    argv, continued = copy_run(name, tmp_path)
    pretrain.main(argv)
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["optimizer_groups"] == continued["optimizer_groups"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = {str(r["step"]): r["train_loss"] for r in records if "train_loss" in r}
    assert losses == pytest.approx(continued["train_losses"], rel=1e-4)
    final = [r["eval_loss"] for r in records if "eval_loss" in r][-1]
    assert final == pytest.approx(continued["final_eval_loss"], rel=1e-4)


def test_the_roles_reach_every_model_a_user_builds(tiny_config):
    """decoderlab's registered Auto classes build models whose parameters all have roles (what the training scripts
    group), and a role carries muP's multipliers only under muP."""
    model = decoderlab.AutoModelForCausalLM.from_config(tiny_config())
    assert all(role == ParameterRole(role.role) for role in model.parameter_roles().values())
    mup = DecoderLabForCausalLM(tiny_config(parametrization="mup", mup_base_width=16))
    assert mup.parameter_roles()["lm_head.weight"] == ParameterRole("readout", fan_in=4.0)
