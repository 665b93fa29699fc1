"""The run configuration of training/: YAML recipes, command-line overrides, and the errors for bad values."""

import pathlib

import pytest
import yaml

from training.args import TrainConfig, parse_config
from training.finetune_args import FinetuneConfig
from training.preflight import preflight

CONFIGS = sorted((pathlib.Path(__file__).resolve().parents[1] / "training" / "configs").glob("*.yaml"))


def test_there_are_recipes():
    """The recipe folder is found (otherwise the parametrized test below would silently test nothing)."""
    assert {"shakespeare_char.yaml", "shakespeare_char_gpu.yaml"} <= {path.name for path in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_recipe_parses_into_the_dataclass(path):
    """Each YAML in training/configs/ names only real fields with values of the right type and range
    (fields of FinetuneConfig for the fine-tuning recipes, finetune_*.yaml)."""
    cfg = parse_config(FinetuneConfig if path.name.startswith("finetune_") else TrainConfig, ["--config", str(path)])
    written = yaml.safe_load(path.read_text())
    for key, value in written.items():
        if key != "model":
            assert getattr(cfg, key) == pytest.approx(value) if isinstance(value, float) else getattr(cfg, key) == value
    assert cfg.model == written.get("model", {})


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_recipe_that_evaluates_keeps_its_best_model(path):
    """A recipe that evaluates during training saves the weights of its best evaluation
    (load_best_model_at_end), so a run longer than the data bears, on a small text of one's own, saves its best
    instead of an overfit last step (tests/test_best_model.py runs the default recipe past its best)."""
    cfg = parse_config(FinetuneConfig if path.name.startswith("finetune_") else TrainConfig, ["--config", str(path)])
    assert cfg.eval_steps is not None and cfg.load_best_model_at_end, path.name


def test_default_recipe_is_nano_size():
    """shakespeare_char is nanoGPT's CPU model size and block length, which the quality bar is measured at, in
    fewer steps than nanoGPT's 2000 and no more rows than 2000 of its batches of 12 (the time bar is nanoGPT's wall
    time)."""
    cfg = parse_config(TrainConfig, ["--config", str(CONFIGS[0].parent / "shakespeare_char.yaml")])
    assert (cfg.model["num_hidden_layers"], cfg.model["hidden_size"], cfg.model["num_attention_heads"]) == (4, 128, 4)
    assert (cfg.block_size, cfg.per_device_train_batch_size, cfg.max_train_steps) == (64, 16, 1000)
    # Muon: fewer tokens to the same loss, so 1000 steps take less time than the AdamW recipe's 1250
    assert (cfg.optimizer, cfg.muon_momentum) == ("muon", 0.9)
    assert cfg.per_device_train_batch_size * cfg.max_train_steps <= 12 * 2000
    assert cfg.tokenizer_type == "char"


def test_command_line_overrides_yaml(tmp_path):
    """Flags win over the YAML, are converted to each field's type, and --model.FIELD reaches the model mapping."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1.0e-3\nmodel: {hidden_size: 64, num_attention_heads: 4}\nwith_tracking: false\n")
    cfg = parse_config(
        TrainConfig,
        ["--config", str(recipe), "--learning_rate", "3e-3", "--model.hidden_size", "32", "--model.qk_norm=true"]
        + ["--with_tracking", "--max_train_steps", "none", "--lr_scheduler_kwargs", "{min_lr_rate: 0.0}"],
    )
    assert cfg.learning_rate == 3e-3 and isinstance(cfg.learning_rate, float)
    assert cfg.model == {"hidden_size": 32, "num_attention_heads": 4, "qk_norm": True}
    assert cfg.with_tracking is True and cfg.max_train_steps is None
    assert cfg.lr_scheduler_kwargs == {"min_lr_rate": 0.0}


def test_model_choice_named_none_stays_a_string(tmp_path):
    """position_embedding_type "none" is a choice, not None, both from a flag and from the YAML; a field whose
    value may be None (head_dim) still reads "none" as None."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {position_embedding_type: none, head_dim: none}\n")
    cfg = parse_config(TrainConfig, ["--config", str(recipe)])
    assert cfg.model == {"position_embedding_type": "none", "head_dim": None}
    cfg = parse_config(TrainConfig, ["--config", str(recipe), "--model.position_embedding_type", "none"])
    assert cfg.model["position_embedding_type"] == "none"


def test_yaml_scientific_notation_is_a_number(tmp_path):
    """YAML 1.1 reads `1e-3` as a string; a float field still gets the number, not a type error."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-3\n")
    assert parse_config(TrainConfig, ["--config", str(recipe)]).learning_rate == 1e-3


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("block_size: sixty-four\n", "block_size must be an integer, got 'sixty-four'"),
        ("per_device_train_batch_size: 12.5\n", "per_device_train_batch_size must be an integer, got 12.5"),
        ("streaming: maybe\n", "streaming must be true/false, got 'maybe'"),
        ("tokenizer_type: word\n", "tokenizer_type must be one of 'char', 'bpe', 'pretrained', got 'word'"),
        ("learning_rate: fast\n", "learning_rate must be a number, got 'fast'"),
        ("model: [4, 128]\n", "model must be a mapping"),
    ],
)
def test_wrong_type_in_yaml(tmp_path, yaml_text, message):
    """A value of the wrong type is a ValueError naming the field, the value and the expected type."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml_text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_config(TrainConfig, ["--config", str(recipe)])


def test_unknown_field_in_yaml_suggests_the_right_name(tmp_path):
    """A misspelt YAML key is refused (not silently ignored) with the closest field name."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learnig_rate: 1.0e-3\n")
    with pytest.raises(ValueError, match=r"'learnig_rate' is not a TrainConfig field. Did you mean 'learning_rate'\?"):
        parse_config(TrainConfig, ["--config", str(recipe)])


def test_unknown_flag_and_unknown_model_field():
    """Misspelt flags and model fields are errors with a suggestion, not ignored."""
    with pytest.raises(ValueError, match=r"Unknown argument '--block_sise'. Did you mean 'block_size'\?"):
        parse_config(TrainConfig, ["--block_sise", "32"])
    with pytest.raises(
        ValueError, match=r"model.hiden_size is not a DecoderLabConfig field. Did you mean 'hidden_size'"
    ):
        parse_config(TrainConfig, ["--model.hiden_size", "32"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--block_size", "0"], "block_size must be a positive integer, got 0"),
        (["--learning_rate", "-1"], "learning_rate must be positive, got -1.0"),
        (["--embedding_learning_rate", "0"], "embedding_learning_rate must be positive, got 0.0"),
        (["--adam_beta2", "1.0"], r"adam_beta2 must be in \[0, 1\), got 1.0"),
        (["--lr_scheduler_type", "cosine_annealing"], "lr_scheduler_type='cosine_annealing' is unknown"),
        (["--push_to_hub"], "push_to_hub=True needs --hub_model_id"),
        (["--tokenizer_type", "pretrained"], "tokenizer_type='pretrained' needs --tokenizer_name"),
        (["--streaming", "--max_train_steps", "none"], "streaming=True needs --max_train_steps"),
        (["--target_flops", "0"], "target_flops must be positive, a number of FLOPs, e.g. 1e15; got 0.0"),
        (["--tokens_per_parameter", "-20"], r"tokens_per_parameter must be positive, tokens per parameter, e.g. 20 "
                                            r"\(Chinchilla's\); got -20.0"),
        (["--loss_spike_margin", "0"], "loss_spike_margin must be positive, a fraction of the running mean loss, "
                                       "e.g. 0.2; got 0.0"),
        (["--target_flops", "1e15"], "--target_flops 1e\\+15 sets the number of steps from the budget, but "
                                     "max_train_steps=2000 sets it too"),
        (["--train_file", "data.xml"], r"train_file='data.xml' must end in one of .txt"),
        (["--dataset_name", "none"], "No data: pass --dataset_name"),
        (["--model.hidden_size", "100", "--model.num_attention_heads", "3"], "hidden_size=100 is not divisible"),
        (["--model.norm_type", "batchnorm"], "norm_type.*'layernorm', 'rmsnorm'.*batchnorm"),
    ],
)
def test_invalid_values(argv, message):
    """Impossible values, and values that do not fit each other, fail before any data is loaded (parsing, then the
    pre-flight check), with the field, the value and what to do."""
    with pytest.raises(ValueError, match=message):
        preflight(parse_config(TrainConfig, argv))


def test_missing_config_file():
    """--config pointing nowhere says so instead of training the defaults."""
    with pytest.raises(ValueError, match="no such file"):
        parse_config(TrainConfig, ["--config", "training/configs/nope.yaml"])


def test_prepare_config_writes_where_the_flag_or_prepared_data_says_never_the_recipes_output_dir(tmp_path):
    """prepare_data.py reads a training recipe whole, but the recipe's output_dir is its training run's folder: the
    shards go to --output_dir, else to the recipe's prepared_data, and with neither the command says what to pass."""
    from training.args import PrepareConfig

    recipe = tmp_path / "r.yaml"
    recipe.write_text("output_dir: out/run\nprepared_data: data/shards\nblock_size: 32\n")
    assert parse_config(PrepareConfig, ["--config", str(recipe)]).output_dir == "data/shards"
    assert parse_config(PrepareConfig, ["--config", str(recipe), "--output_dir", "elsewhere"]).output_dir == "elsewhere"
    recipe.write_text("output_dir: out/run\n")
    with pytest.raises(ValueError, match="Pass --output_dir DATA"):
        parse_config(PrepareConfig, ["--config", str(recipe)])
    assert parse_config(TrainConfig, ["--config", str(recipe)]).output_dir == "out/run"  # training reads it


def test_ddp_timeout_and_prefetch_batches_are_checked():
    """--ddp_timeout must be a positive number of seconds; --prefetch_batches from 0 (no read-ahead) to 1024."""
    with pytest.raises(ValueError, match="ddp_timeout must be a positive integer, got 0"):
        TrainConfig(ddp_timeout=0)
    with pytest.raises(ValueError, match="prefetch_batches must be from 0 \\(no read-ahead\\) to 1024, got -1"):
        TrainConfig(prefetch_batches=-1)
    assert TrainConfig(prefetch_batches=0).prefetch_batches == 0
