"""The pre-flight check (training/preflight.py): every refusal that involves more than one setting, the launch or the
hardware, one ``error:`` line each, before any data is read or any folder written, for pretraining and fine-tuning.

One case per refusal below; a test checks that every check of ``CHECKS`` has one, so a new refusal needs its case.
"""

import json

import pytest
import yaml

from decoderlab.cli import UsageError, run_command
from tests.training_runs import text_files_in
from training import finetune, preflight, pretrain
from training.args import TrainConfig, parse_config
from training.checkpointing import STATE_NAME
from training.finetune_args import FinetuneConfig

MUP_MODEL = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "parametrization": "mup",
             "mup_base_width": 16}  # fmt: skip
FINETUNE = {"model_name_or_path": "out/base", "train_file": "data.jsonl"}

# (the check that refuses, the configuration class, its fields, environment variables, CPU has bf16, the message)
CASES = [
    ("data_source", TrainConfig, {"dataset_name": None}, {}, True, "No data: pass --dataset_name"),
    ("data_source", TrainConfig, {"validation_file": "v.txt"}, {}, True, "validation_file needs train_file"),
    ("data_source", TrainConfig, {"encoding": "latin-1"}, {}, True,
     r"encoding='latin-1' applies to --train_file and --validation_file, but the data comes from dataset_name"),
    ("tokenizer_source", TrainConfig, {"tokenizer_type": "pretrained"}, {}, True,
     "tokenizer_type='pretrained' needs --tokenizer_name"),
    ("tokenizer_source", TrainConfig, {"tokenizer_type": "bpe", "bpe_vocab_size": 200}, {}, True,
     "bpe_vocab_size=200 is too small"),
    ("streaming", TrainConfig, {"streaming": True, "window_sampling": "shifted"}, {}, True,
     "window_sampling='shifted' draws windows from the whole training text, which a stream"),
    ("streaming", TrainConfig, {"streaming": True, "max_train_steps": None}, {}, True,
     "streaming=True needs --max_train_steps"),
    ("finetune_data", FinetuneConfig, {**FINETUNE, "streaming": True, "data_format": "chat", "max_train_steps": 5},
     {}, True, "streaming=True works for packed text only, not data_format='chat'"),
    ("finetune_data", FinetuneConfig, {**FINETUNE, "window_sampling": "random", "data_format": "prompt_completion"},
     {}, True, "window_sampling='random' draws windows from one packed text"),
    ("model_source", TrainConfig, {"model_name_or_path": "out/base", "model": {"num_hidden_layers": 6}}, {}, True,
     r"--model_name_or_path out/base trains that checkpoint's architecture, so the model fields"),
    ("model_source", TrainConfig, {"block_size": 128, "model": {"max_position_embeddings": 64}}, {}, True,
     "--block_size 128 is longer than model.max_position_embeddings=64"),
    ("lora", FinetuneConfig, {**FINETUNE, "use_lora": True, "lora_target_modules": " , "}, {}, True,
     "lora_target_modules is empty"),
    ("lora", FinetuneConfig, {**FINETUNE, "merge_lora": True}, {}, True, "merge_lora=True needs use_lora=True"),
    ("lora", FinetuneConfig, {**FINETUNE, "use_lora": True, "optimizer": "muon"}, {}, True,
     "optimizer=muon with use_lora=True: LoRA trains each adapted matrix as two thin factors"),
    ("other_optimizer_fields", TrainConfig, {"muon_momentum": 0.9, "muon_ns_steps": 4}, {}, True,
     r"muon_momentum=0.9, muon_ns_steps=4 are read only with optimizer muon, but optimizer is 'adamw'"),
    ("mup_with_muon", TrainConfig, {"optimizer": "muon", "muon_adjust_lr_fn": "match_rms_adamw", "model": MUP_MODEL},
     {}, True, "muon_adjust_lr_fn='match_rms_adamw' with a muP model"),
    ("mup_with_muon", TrainConfig, {"optimizer": "muon", "model": {**MUP_MODEL, "intermediate_size": 128,
                                                                   "mup_base_shapes": {"intermediate_size": 128}}},
     {}, True, r"these grow apart: model\.layers\.0\.mlp\.gate_proj\.weight: fan_in x 4, fan_out x 1"),
    ("sharding", TrainConfig, {"optimizer": "muon"}, {"ACCELERATE_USE_DEEPSPEED": "true"}, True,
     "--optimizer muon cannot run under DeepSpeed"),
    ("sharding", TrainConfig, {"fsdp": True}, {}, True, "--fsdp true shards the model over several processes, but "
     "this run has one"),
    ("sharding", TrainConfig, {"fsdp": True}, {"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true"}, True,
     "this launch asks Accelerate for FSDP already: drop --fsdp"),
    ("sharding", TrainConfig, {"fsdp": True, "mixed_precision": "bf16"}, {"WORLD_SIZE": "2"}, True,
     "--mixed_precision bf16 is not supported with it"),
    ("bf16_hardware", TrainConfig, {"mixed_precision": "bf16"}, {}, False,
     "--mixed_precision bf16 on a CPU without bfloat16 instructions"),
    ("budget", TrainConfig, {"target_flops": 1e15}, {}, True, r"--target_flops 1e\+15 sets the number of steps from "
     "the budget, but max_train_steps=2000 sets it too .*: pass --max_train_steps none"),
    ("budget", TrainConfig, {"tokens_per_parameter": 20.0, "max_train_steps": 500}, {}, True,
     "--tokens_per_parameter 20 sets the number of steps from the budget, but max_train_steps=500 sets it too"),
    ("budget", TrainConfig, {"target_flops": 1e15, "tokens_per_parameter": 20.0, "max_train_steps": None}, {}, True,
     r"target_flops=1e\+15 and tokens_per_parameter=20 each set the number of steps: keep one of them"),
    ("budget", TrainConfig, {"target_flops": 1e3, "max_train_steps": None}, {}, True,
     r"target_flops=1000 is less than one optimizer step, at least .* FLOPs \(at least .* FLOPs per token x 768 "
     r"tokens per step; the vocabulary, read with the data, not counted yet\): raise --target_flops above that"),
    ("schedule", TrainConfig, {"lr_scheduler_type": "linear"}, {}, True,
     r"lr_scheduler_kwargs=\{'min_lr_rate': 0.1\} do not fit lr_scheduler_type='linear'"),
    ("schedule", TrainConfig, {"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs":
     {"num_decay_steps": 9}, "num_warmup_steps": 2, "max_train_steps": 10}, {}, True,
     "num_warmup_steps=2 plus lr_scheduler_kwargs num_decay_steps=9 exceed the run's 10 steps"),
    ("best_model", TrainConfig, {"load_best_model_at_end": True, "eval_steps": None}, {}, True,
     "load_best_model_at_end need periodic evaluations to compare, but eval_steps is none"),
    ("compile_backend", TrainConfig, {"torch_compile_backend": "eager"}, {}, True,
     "torch_compile_backend='eager' is set but torch_compile is false"),
    ("hub_upload", TrainConfig, {"push_to_hub": True}, {}, True, "push_to_hub=True needs --hub_model_id"),
    ("hub_upload", FinetuneConfig, {**FINETUNE, "push_to_hub": True, "hub_model_id": "me/x", "use_lora": True}, {},
     True, "push_to_hub with an unmerged LoRA adapter"),
    ("resume_or_overwrite", TrainConfig, {"overwrite_output_dir": True, "resume_from_checkpoint": "latest"}, {}, True,
     "--overwrite_output_dir replaces the run in output_dir and --resume_from_checkpoint continues it"),
    ("resume_fits", TrainConfig, {"optimizer": "muon", "resume_from_checkpoint": "latest"}, {}, True,
     r"does not fit this run \(checkpoint's value -> given\): optimizer: 'adamw' -> 'muon'"),
]  # fmt: skip


@pytest.fixture
def launch(monkeypatch):
    """A plain one-process launch on a CPU with bf16 instructions, whatever the test's own environment; a case sets
    its variables and the hardware's answer over it."""
    for variable in ("WORLD_SIZE", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def saved_run(folder, **settings) -> None:
    """A run folder with one checkpoint (step_4) whose training_config.yaml records ``settings``."""
    (folder / "training_config.yaml").write_text(yaml.safe_dump(TrainConfig(**settings).to_dict()))
    (folder / "step_4").mkdir(parents=True)
    (folder / "step_4" / STATE_NAME).write_text(json.dumps({"step": 4}))


@pytest.mark.parametrize("check, cls, fields, env, bf16, message", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_refusal_is_one_line_naming_the_settings(launch, tmp_path, check, cls, fields, env, bf16, message):
    """Each configuration is valid field by field (it parses) and refused by exactly the check named, with a
    UsageError of one line that names the settings and what to do; the launch's variables and the CPU's bf16 answer
    are part of the case."""
    for variable, value in env.items():
        launch.setenv(variable, value)
    launch.setattr(preflight, "cpu_has_bf16", lambda: bf16)
    if check == "resume_fits":
        saved_run(tmp_path, optimizer="adamw")
    cfg = cls(**{"output_dir": str(tmp_path), **fields})
    failing = [c.__name__ for c in preflight.CHECKS if c(cfg, preflight.Launch(cfg, cpu=True))]
    assert failing == [check], failing
    with pytest.raises(UsageError, match=message) as error:
        preflight.preflight(cfg, cpu=True)
    assert "\n" not in str(error.value)


def test_every_check_has_its_case():
    """A refusal added to CHECKS without a case above fails here: every one is shown refusing something."""
    assert {c.__name__ for c in preflight.CHECKS} == {case[0] for case in CASES}


def test_bf16_emulated_is_allowed_where_only_dtypes_and_bytes_are_measured(launch, tmp_path):
    """allow_emulated_bf16 skips the bf16 hardware check and only it: the other refusals still stop the run."""
    launch.setattr(preflight, "cpu_has_bf16", lambda: False)
    preflight.preflight(TrainConfig(mixed_precision="bf16", output_dir=str(tmp_path)), cpu=True, allow_emulated_bf16=True)
    with pytest.raises(UsageError, match="read only with optimizer muon"):
        preflight.preflight(TrainConfig(mixed_precision="bf16", muon_momentum=0.9), cpu=True, allow_emulated_bf16=True)


def test_every_committed_recipe_passes(launch):
    """The recipes in training/configs pass the check as committed (the GPU recipe's bf16 on a CPU aside, which is
    its point), so the check refuses mistakes, not the project's own runs."""
    from tests.paths import REPO_ROOT

    for recipe in sorted((REPO_ROOT / "training" / "configs").glob("*.yaml")):
        cls = FinetuneConfig if recipe.name.startswith("finetune") else TrainConfig
        preflight.preflight(parse_config(cls, ["--config", str(recipe)]), allow_emulated_bf16=True)


@pytest.mark.parametrize("script, argv, message", [
    (pretrain, ["--optimizer", "adamw", "--muon_momentum", "0.9"], "read only with optimizer muon"),
    (finetune, ["--model_name_or_path", "out/base", "--use_lora", "--optimizer", "muon"], "optimizer=muon with use_lora"),
])  # fmt: skip
def test_the_scripts_refuse_before_reading_or_writing_anything(launch, tmp_path, capsys, script, argv, message):
    """pretrain.py and finetune.py run the check right after parsing: exit status 2, one error: line, and no output
    folder (nothing was read, nothing written)."""
    train_file, validation_file = text_files_in(tmp_path, 2000)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run_command(script.main, [*argv, "--train_file", str(train_file), "--validation_file", str(validation_file),
                                  "--dataset_name", "none", "--output_dir", str(out)])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not out.exists()
