"""parametrization: mup: muP's initialisation, attention scale, output multiplier and learning rates, the
coordinate check that shows them working together, and every way a muP model leaves decoderlab (checkpoints,
--to llama / qwen3 / gguf, resumed runs) computing the same function or refused by name.

References: Tensor Programs V (Yang et al. 2022), Table 8 (the form with multipliers); a 20-line muP forward written
here; the standard model (a muP model at its base width is the standard one but for its attention scale).
"""

import json
import math
import subprocess
import sys

import gguf  # noqa: F401  (transformers' GGUF loader needs it: fail here, by name, if it is missing)
import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.cli import UsageError
from decoderlab.export.families import convert_to_llama, convert_to_qwen3, llama_config_from_decoderlab
from decoderlab.export.gguf_file import convert_to_gguf
from decoderlab.export.onnx_executorch import export_onnx
from decoderlab.model_card import read_metrics
from experiments import mup_coord_check
from tests.paths import INPUT_TXT, REPO_ROOT
from tests.training_runs import subprocess_env, text_files_in
from training import mup_tune, pretrain
from training.args import TrainConfig, parse_config
from training.checkpointing import STATE_NAME
from training.data import train_char_tokenizer
from training.preflight import preflight

MUP = dict(parametrization="mup", mup_base_width=16)  # with conftest's hidden_size 64: m = 4


# ----------------------------------------------------------------------------------------------
# Configuration: one clear error each


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(parametrization="mup"), r"parametrization='mup' needs mup_base_width.*from 1 to hidden_size=64"),
        (dict(parametrization="mup", mup_base_width=0), r"mup_base_width must be from 1 to hidden_size=64.*got 0"),
        (dict(parametrization="mup", mup_base_width=-8), r"mup_base_width must be from 1 to hidden_size=64.*got -8"),
        (dict(parametrization="mup", mup_base_width=128), r"mup_base_width must be from 1 to hidden_size=64.*got 128"),
        (dict(mup_base_width=16), r"mup_base_width=16 is read only with parametrization='mup'.*'standard'"),
        (dict(mup_output_multiplier=2.0), r"mup_output_multiplier=2.0 is read only with parametrization='mup'"),
        (dict(MUP, mup_output_multiplier=0.0), r"mup_output_multiplier must be a finite positive number.*got 0.0"),
        (dict(mup_attention_multiplier=1.0), r"mup_attention_multiplier=1.0 is read only with parametrization='mup'"),
        (dict(MUP, mup_attention_multiplier=-1.0), r"mup_attention_multiplier must be a finite positive.*got -1.0"),
        (dict(parametrization="maximal"), r"parametrization.*'standard', 'mup'.*maximal"),
    ],
)
def test_bad_mup_settings_are_refused(tiny_config, fields, message):
    """Each impossible muP setting is one ValueError naming the field, the value and what is allowed, from Python
    and from a recipe's --model flags alike."""
    with pytest.raises(ValueError, match=message):
        tiny_config(**fields)
    flags = [arg for key, value in fields.items() for arg in (f"--model.{key}", str(value))]
    with pytest.raises(ValueError, match=message):
        parse_config(TrainConfig, ["--model.hidden_size", "64", "--model.num_attention_heads", "4", *flags])


def test_the_training_script_says_what_is_wrong_in_one_line():
    """training/pretrain.py with muP but no base width exits with status 2 and one ``error:`` line, not a
    traceback."""
    result = subprocess.run(
        [sys.executable, "training/pretrain.py", "--model.parametrization", "mup", "--model.mup_base_width", "4096"],
        capture_output=True, text=True, env=subprocess_env(), cwd=REPO_ROOT, timeout=300,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "mup_base_width must be from 1 to hidden_size=768" in lines[0]


# ----------------------------------------------------------------------------------------------
# The model


def test_mup_at_its_base_width_is_the_standard_model(tiny_config):
    """At hidden_size == mup_base_width, m = 1, with the same initializer_range: the same initial weights draw for
    draw and the same logits, the attention scale included (sqrt(base head_dim)/head_dim is 1/sqrt(head_dim) there). Wider, the scale goes as
    sqrt(base head_dim)/head_dim: the standard scale where the heads grow in number (the default base shapes), smaller
    where they grow wider; mup_attention_multiplier=1.0 is the uncorrected 1/head_dim. Unset, muP's initializer_range
    is 1/sqrt(mup_base_width), the standard one 0.02."""
    standard = tiny_config()
    torch.manual_seed(0)
    reference = DecoderLabForCausalLM(standard).eval()
    torch.manual_seed(0)
    mup = DecoderLabForCausalLM(tiny_config(parametrization="mup", mup_base_width=64, initializer_range=0.02)).eval()
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), mup.state_dict().values()))
    assert mup.model.layers[0].self_attn.scaling == standard.head_dim**-0.5
    ids = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(mup(ids).logits, reference(ids).logits, rtol=0, atol=0)
    assert standard.initializer_range == 0.02 and tiny_config(**MUP).initializer_range == 16**-0.5  # 1/sqrt(fan_in)
    wide = tiny_config(**MUP)  # hidden 64, 4 heads, base width 16: by default the base has 1 head, as wide
    assert wide.mup_base_shapes["head_dim"] == 16 and wide.default_attention_scale == 16**-0.5
    narrow_heads = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=4)  # the heads grew wider instead
    assert tiny_config(**MUP, mup_base_shapes=narrow_heads).default_attention_scale == 4**0.5 / 16
    assert tiny_config(**MUP, mup_attention_multiplier=1.0).default_attention_scale == 1 / 16


def test_a_mup_checkpoint_saved_before_base_shapes_keeps_its_attention_scale(tiny_model, tmp_path):
    """A muP config.json without ``mup_base_shapes`` (written before they were recorded, when the attention scale was
    1/head_dim) loads with mup_attention_multiplier=1.0 and the logits it was saved with; one saved now loads as
    saved, the base-corrected scale included."""
    model = tiny_model(**MUP, mup_attention_multiplier=1.0)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for key in ("mup_base_shapes", "mup_attention_multiplier"):
        del saved[key]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.mup_attention_multiplier == 1.0 and loaded.model.layers[0].self_attn.scaling == 1 / 16
    ids = torch.randint(0, 99, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    now = tiny_model(**MUP)
    now.save_pretrained(tmp_path / "now")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "now")
    assert again.config.mup_attention_multiplier is None and again.config.default_attention_scale == 1 / 4


def test_mup_draws_hidden_matrices_with_variance_over_m_and_leaves_the_rest(tiny_config):
    """Under muP (m = 4) every q/k/v/o and MLP matrix draws with std initializer_range / sqrt(m) (o_proj and
    down_proj also / sqrt(2 x layers)); embeddings, the untied head and norms draw as in the standard model."""
    sizes = dict(hidden_size=256, num_attention_heads=4, initializer_range=0.04)
    torch.manual_seed(0)
    standard = DecoderLabForCausalLM(tiny_config(**sizes))
    torch.manual_seed(0)
    mup = DecoderLabForCausalLM(tiny_config(**sizes, parametrization="mup", mup_base_width=64))
    residual = math.sqrt(2 * 2)
    for name, param in mup.named_parameters():
        expected = standard.get_parameter(name).std().item()
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            expected = 0.04 / 2
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            expected = 0.04 / 2 / residual
        assert param.std().item() == pytest.approx(expected, rel=0.05), name


def mup_forward_reference(model: DecoderLabForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """TP5 Table 8's readout written out: logits = (alpha_out / m) * h W_head^T, h the final hidden state."""
    config = model.config
    hidden = model.model(ids).last_hidden_state
    factor = config.mup_output_multiplier * config.mup_base_width / config.hidden_size
    return factor * hidden @ model.lm_head.weight.T


@pytest.mark.parametrize("tie", [False, True])
def test_the_logits_carry_the_output_multiplier_tied_or_not(tiny_model, tie):
    """logits = alpha_out / m x (h W_head^T) with the head untied or tied to the embedding (whose lookup is then
    unscaled: the multiplier is in the forward pass, not in the shared matrix); logit_scale is that factor."""
    model = tiny_model(**MUP, mup_output_multiplier=3.0, tie_word_embeddings=tie)
    assert model.config.logit_scale == pytest.approx(3.0 / 4)
    ids = torch.randint(0, 99, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, mup_forward_reference(model, ids), rtol=1e-6, atol=1e-6)
        embedded = model.get_input_embeddings()(ids)
    torch.testing.assert_close(embedded, model.get_input_embeddings().weight[ids])
    assert model.config.parametrization == "mup" and tiny_model().config.logit_scale == 1.0


def test_resizing_the_vocabulary_keeps_the_multiplier(tiny_model):
    """resize_token_embeddings replaces the head by a plain nn.Linear: the multiplier, being the model's, stays."""
    model = tiny_model(**MUP)
    model.resize_token_embeddings(103)
    ids = torch.randint(0, 103, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, mup_forward_reference(model, ids), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_a_saved_mup_checkpoint_loads_with_the_same_logits(tiny_model, tmp_path, tie):
    """save_pretrained / from_pretrained (the Auto class and trust_remote_code's files) give back the same logits;
    the muP fields are in config.json, the derived logit_scale is not."""
    model = tiny_model(**MUP, mup_output_multiplier=2.0, tie_word_embeddings=tie)
    model.save_pretrained(tmp_path)
    saved = yaml.safe_load((tmp_path / "config.json").read_text())
    assert saved["parametrization"] == "mup" and saved["mup_base_width"] == 16 and "logit_scale" not in saved
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    ids = torch.randint(0, 99, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# The coordinate check


@pytest.fixture(scope="module")
def shakespeare_batch():
    """(batch, vocabulary size): the coordinate check's one batch of Tiny Shakespeare characters."""
    text = INPUT_TXT.read_text(encoding="utf-8")[:50_000]
    tokenizer = train_char_tokenizer([text])
    settings = mup_coord_check.Settings()
    ids = torch.tensor(tokenizer(text).input_ids[: settings.batch_size * settings.block_size])
    return ids.view(settings.batch_size, settings.block_size), len(tokenizer)


def test_coordinate_check_flat_under_mup_growing_under_standard(one_thread, shakespeare_batch):
    """The coordinate check (experiments/mup_coord_check.py's defaults: widths 64-1024, 2 layers, 4 Adam steps
    through training.optim's groups, 3 seeds): after the last step the slope of log mean |activation| against
    log width is within +-0.3 under muP for the embeddings and the attention and MLP outputs (a 16x wider model
    changes them by less than 2.3x), and below 0.3 for the attention logits and the logits, whose initial part muP
    lets shrink (1/sqrt(head_dim) and 1/m); above 0.5 under the standard parametrization for all but the
    embeddings (more than 4x), which keep their scale under both. What training moved (x_t - x_0) in the blocks'
    outputs is flat under muP too."""
    batch, vocab_size = shakespeare_batch
    result = mup_coord_check.coordinate_check(mup_coord_check.Settings(), batch, vocab_size, seeds=[0, 1, 2])
    mup, standard = result["mup"]["slope"], result["standard"]["slope"]
    print("\nslopes, muP:", {k: round(v, 2) for k, v in mup.items()})
    print("slopes, standard:", {k: round(v, 2) for k, v in standard.items()})
    flat = ("embedding", "attention output", "MLP output")
    assert all(abs(mup[name]) < mup_coord_check.FLAT for name in flat), mup
    assert all(abs(result["mup"]["change_slope"][name]) < mup_coord_check.FLAT for name in flat), result["mup"]
    assert all(slope < mup_coord_check.FLAT for slope in mup.values()), mup
    assert all(standard[name] > mup_coord_check.GROWS for name in mup_coord_check.ACTIVATIONS[1:]), standard
    assert abs(standard["embedding"]) < mup_coord_check.FLAT, standard
    assert np.isfinite(result["mup"]["loss"]).all()


# ----------------------------------------------------------------------------------------------
# Training runs: the rates applied and recorded; the tuning command


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    return text_files_in(tmp_path_factory.mktemp("text"), 30_000)


def run_argv(text_files, output_dir, *extra: str) -> list[str]:
    train_file, validation_file = text_files
    return [
        "--dataset_name", "none", "--train_file", str(train_file), "--validation_file", str(validation_file),
        "--block_size", "16", "--per_device_train_batch_size", "4", "--max_train_steps", "6", "--num_warmup_steps",
        "2", "--eval_steps", "3", "--checkpointing_steps", "none", "--learning_rate", "4e-3", "--output_dir",
        str(output_dir), "--model.hidden_size", "64", "--model.num_hidden_layers", "2", "--model.num_attention_heads",
        "4", "--model.parametrization", "mup", "--model.mup_base_width", "16", *extra,
    ]  # fmt: skip


def test_a_mup_run_records_its_groups_and_rates(one_thread, text_files, tmp_path):
    """training/pretrain.py under muP (m = 4): run_info.json records the hidden matrices at learning_rate / 4 with
    their factor and the untied head at learning_rate; training_config.yaml lists the same groups as comments and
    still reads back as the run's TrainConfig; the model card shows them."""
    out = tmp_path / "run"
    pretrain.main(run_argv(text_files, out))
    groups = {g["name"]: g for g in json.loads((out / "run_info.json").read_text())["optimizer_groups"]}
    assert groups["matrices"]["lr"] == pytest.approx(1e-3) and groups["matrices"]["lr_multiplier"] == 0.25
    assert groups["output"]["lr"] == pytest.approx(4e-3) and groups["output"]["weight_decay"] == 0.1
    recorded = (out / "training_config.yaml").read_text()
    assert "#   matrices: AdamW, lr 0.001 (x 0.25, muP), wd 0.1, " in recorded
    again = TrainConfig(**yaml.safe_load(recorded))
    assert again.model["mup_base_width"] == 16 and again.learning_rate == 4e-3
    assert "matrices: lr 0.001 (x 0.25, muP)" in (out / "README.md").read_text()


@pytest.mark.slow
def test_mup_tune_writes_the_wide_recipe_with_the_best_rate(text_files, tmp_path):
    """training/mup_tune.py trains the proxy (the target's depth and head width at the recipe's width, muP) at each
    rate, and writes the recipe at the target size with the rate whose validation loss was lowest (refined between
    grid points), the flags after "--" but the data's location, and a header marking it unmeasured; it trains."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "block_size": 16, "per_device_train_batch_size": 4, "max_train_steps": 4, "num_warmup_steps": 1,
        "eval_steps": 2, "learning_rate": 3e-3, "embedding_learning_rate": 6e-3,
        "model": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 64,
                  "parametrization": "mup", "mup_base_width": 16, "mup_output_multiplier": 2.0},
    }))  # fmt: skip
    train_file, validation_file = text_files
    out = tmp_path / "wide.yaml"
    argv = [str(recipe), "--target_size", "nano", "--learning_rates", "1e-3,4e-3,1.6e-2", "--output", str(out),
            "--work_dir", str(tmp_path / "work"), "--", "--dataset_name", "none", "--train_file", str(train_file),
            "--validation_file", str(validation_file), "--max_train_steps", "8"]  # fmt: skip
    mup_tune.main(argv)
    losses = [
        [
            r["eval_loss"]
            for r in read_metrics(tmp_path / "work" / f"lr_{lr:.4g}" / "metrics.jsonl")
            if "eval_loss" in r
        ][-1]
        for lr in (1e-3, 4e-3, 1.6e-2)
    ]
    best, _, _ = mup_tune.best_rate([1e-3, 4e-3, 1.6e-2], losses)
    proxy = yaml.safe_load((tmp_path / "work" / "lr_0.004" / "config.json").read_text())
    assert (proxy["hidden_size"], proxy["num_hidden_layers"], proxy["num_attention_heads"]) == (32, 4, 1)
    assert proxy["parametrization"] == "mup" and proxy["mup_base_width"] == 32 and proxy["intermediate_size"] == 64
    assert proxy["mup_output_multiplier"] == 2.0  # every mup_* field of the recipe is kept; the base is the proxy
    text = out.read_text()
    assert "UNMEASURED" in text and "mup_tune.py" in text
    # the header's groups are the ones the wide recipe trains with, from training/optim.py's record
    assert "# Optimizer groups at the 128 width (training/optim.py's rules; a record, not a setting):" in text
    assert f"#   matrices: AdamW, lr {wide_rate(best):g} (x 0.25, muP), wd 0.1 in 28 tensors" in text
    wide = parse_config(TrainConfig, ["--config", str(out)])
    assert wide.learning_rate == pytest.approx(best, rel=1e-2)
    assert wide.embedding_learning_rate == pytest.approx(2 * best, rel=1e-2)
    assert wide.max_train_steps == 8 and wide.train_file is None  # the flags, but not where the data was
    assert wide.model == {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                          "intermediate_size": 256, "mup_output_multiplier": 2.0, "parametrization": "mup",
                          "mup_base_width": 32, "mup_base_shapes": {"intermediate_size": 64, "num_attention_heads": 1,
                          "num_key_value_heads": 1, "head_dim": 32}}  # fmt: skip


def wide_rate(rate: float) -> float:
    """A rate as the written recipe holds it (three significant digits), times muP's 1/4 at the 128 width."""
    return float(f"{rate:.3g}") / 4


def test_mup_tune_sweeps_the_rate_the_blocks_matrices_train_at(tmp_path):
    """Under AdamW mup_tune sweeps learning_rate (muP divides it by each hidden matrix's m) and the token embeddings'
    own rate keeps its ratio; under Muon it sweeps muon_learning_rate (the blocks' matrices are Muon's, which muP
    leaves without a factor) and leaves AdamW's rates as the recipe has them. The header's groups say so, from the
    wide model's own groups."""
    recipe = TrainConfig(learning_rate=1e-3, embedding_learning_rate=4e-3)
    tune = mup_tune.TuneConfig(recipe="x.yaml")
    assert mup_tune.swept_rate(tune, recipe) == "learning_rate"
    assert mup_tune.rate_flags("learning_rate", 2e-3, 4.0) == {"learning_rate": 2e-3, "embedding_learning_rate": 8e-3}
    muon = TrainConfig(optimizer="muon", learning_rate=1e-3)
    assert mup_tune.swept_rate(tune, muon) == "muon_learning_rate"
    assert mup_tune.rate_flags("muon_learning_rate", 0.03, 4.0) == {"muon_learning_rate": 0.03}
    assert mup_tune.swept_rate(mup_tune.TuneConfig(recipe="x.yaml", rate="embedding_learning_rate"), muon) == (
        "embedding_learning_rate"
    )
    wide = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "parametrization": "mup",
            "mup_base_width": 32}  # fmt: skip
    header = mup_tune.wide_groups(wide, {"optimizer": "muon", "muon_learning_rate": 0.03, "learning_rate": 1e-3})
    assert "#   muon_matrices: Muon, lr 0.03 (x 1, muP), wd 0 in 14 tensors" in header
    assert "#   output: AdamW, lr 0.001, wd 0.1 in 1 tensor\n" in header and "matrices: AdamW" not in header
    with pytest.raises(UsageError, match="rate='momentum' is not a rate of the recipe"):
        parse_config(mup_tune.TuneConfig, ["x.yaml", "--rate", "momentum"])


def test_mup_tune_refuses_what_it_cannot_tune(tmp_path):
    """A target no wider than the proxy, a grid of fewer than three rates, an unknown size: one error each."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}}))
    with pytest.raises(UsageError, match="base_width 128 must be narrower than the nano size's 128"):
        mup_tune.main([str(recipe), "--target_size", "nano"])
    with pytest.raises(UsageError, match="learning_rates needs three or more positive rates"):
        mup_tune.main([str(recipe), "--learning_rates", "1e-3,2e-3"])
    with pytest.raises(UsageError, match="target_size='huge' is not a named size"):
        mup_tune.main([str(recipe), "--target_size", "huge"])


# ----------------------------------------------------------------------------------------------
# Resuming


def recorded_run(folder, model: dict) -> object:
    """A run folder whose training_config.yaml records ``model``, and its step_10 checkpoint folder."""
    (folder / "training_config.yaml").write_text(yaml.safe_dump(TrainConfig(model=model).to_dict()))
    checkpoint = folder / "step_10"
    checkpoint.mkdir()
    (checkpoint / STATE_NAME).write_text(json.dumps({"step": 10}))
    return checkpoint


@pytest.mark.parametrize(
    "given, named",
    [
        (
            dict(parametrization="standard", mup_base_width=None, mup_output_multiplier=None),
            "model.parametrization: 'mup' -> 'standard'",
        ),
        ({"mup_base_width": 64}, "model.mup_base_width: 128 -> 64"),
        ({"mup_output_multiplier": 2.0}, "model.mup_output_multiplier: 1.5 -> 2.0"),
    ],
)
def test_a_resume_with_other_mup_settings_is_refused(tmp_path, given, named):
    """Changing a muP setting between a run and its resume changes its learning rates, init and logits: the resume
    is refused before anything is read, naming the setting with the checkpoint's value and the given one."""
    before = dict(hidden_size=256, num_attention_heads=4, parametrization="mup", mup_base_width=128,
                  mup_output_multiplier=1.5)  # fmt: skip
    checkpoint = recorded_run(tmp_path, before)
    after = {key: value for key, value in {**before, **given}.items() if value is not None}
    resume = dict(resume_from_checkpoint=str(checkpoint), output_dir=str(tmp_path))
    with pytest.raises(UsageError, match=f"does not fit this run.*{named}"):
        preflight(TrainConfig(model=after, **resume))
    preflight(TrainConfig(model=before, **resume))  # the same settings resume


# ----------------------------------------------------------------------------------------------
# Exports: the multipliers folded into the weights, or refused by name


def llama_shaped(randomize, **fields) -> DecoderLabForCausalLM:
    sizes = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
    config = DecoderLabConfig.from_preset("llama", **{**sizes, **MUP, **fields})
    return randomize(DecoderLabForCausalLM(config)).eval()


@pytest.mark.parametrize(
    "convert, family, fields",
    [
        (
            convert_to_llama,
            LlamaForCausalLM,
            dict(
                mup_output_multiplier=2.0, attention_bias=True, mup_base_shapes=dict(num_attention_heads=4, head_dim=4)
            ),
        ),
        (convert_to_qwen3, Qwen3ForCausalLM, dict(qk_norm=True, mup_attention_multiplier=1.0)),
    ],
)
def test_export_folds_the_multipliers_into_the_weights(randomize, tmp_path, convert, family, fields):
    """--to llama / qwen3 of an untied muP model: the logits' alpha_out / m goes into lm_head and the attention
    scale's alpha_attn / sqrt(head_dim) into the queries (q_proj's weight and bias; with QK-norm the query norm's
    weight), so the plain transformers model computes the same logits; nothing else changes. (Heads 4 times wider than
    the base's: 0.5; the uncorrected 1/head_dim: 0.25.)"""
    model = llama_shaped(randomize, **fields)
    model.save_pretrained(tmp_path / "src")
    exported = family.from_pretrained(convert(tmp_path / "src", tmp_path / "dst")).eval()
    ids = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    query = "q_norm" if model.config.qk_norm else "q_proj"
    assert model.config.default_attention_scale / model.config.head_dim**-0.5 in (0.5, 0.25)
    for name, tensor in exported.state_dict().items():
        expected = model.state_dict()[name]
        if name == "lm_head.weight":
            expected = expected * model.config.logit_scale
        elif f"self_attn.{query}." in name:
            expected = expected * model.config.default_attention_scale / model.config.head_dim**-0.5
        torch.testing.assert_close(tensor, expected, rtol=1e-6, atol=0, msg=name)


def test_gguf_export_folds_them_too(randomize, tmp_path):
    """The GGUF file (llama.cpp's llama graph, q/k rows interleaved after the fold) read back by transformers' GGUF
    loader gives the muP model's logits."""
    tokenizer = train_char_tokenizer([INPUT_TXT.read_text(encoding="utf-8")])
    model = llama_shaped(randomize, vocab_size=len(tokenizer), max_position_embeddings=128,
                         mup_output_multiplier=2.0)  # fmt: skip
    model.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    out = convert_to_gguf(tmp_path / "src", tmp_path / "model.gguf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name).eval()
    ids = tokenizer("ROMEO:\nBut soft, what light").input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits,
                                   rtol=0, atol=1e-4)  # fmt: skip


def test_onnx_export_traces_the_multipliers(tiny_model, tmp_path):
    """ONNX traces the model's own forward, so a muP model's graph holds both multipliers: ONNX Runtime gives its
    logits (tied head, m = 4, alpha_out 2) within 1e-4 at a batch and length other than those traced."""
    import onnxruntime

    model = tiny_model(**MUP, mup_output_multiplier=2.0, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "src")
    out = export_onnx(tmp_path / "src", tmp_path / "model.onnx")
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, 99, (3, 13))
    (logits,) = session.run(["logits"], {"input_ids": ids.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), model(ids).logits, rtol=0, atol=1e-4)


def test_a_tied_mup_head_is_refused_by_name(randomize, tmp_path):
    """With a tied head the logits' factor cannot go into lm_head without changing the embedding: --to llama
    refuses, naming parametrization and the factor, and writes nothing; at m = 1 and alpha_out = 1 there is no
    factor, and the export goes through."""
    model = llama_shaped(randomize, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"parametrization='mup': muP multiplies the logits by .* = 0.25.*tie"):
        llama_config_from_decoderlab(model.config)
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(ValueError, match=r"stand in the way:\n  parametrization='mup'"):
        convert_to_llama(tmp_path / "src", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    at_base = DecoderLabConfig.from_preset("llama", "nano", parametrization="mup", mup_base_width=128,
                                           tie_word_embeddings=True)  # fmt: skip
    assert llama_config_from_decoderlab(at_base).tie_word_embeddings
