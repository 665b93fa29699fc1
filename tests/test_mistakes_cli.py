"""A new user's mistakes with the ``python -m decoderlab.*`` commands : each runs the real command in a
fresh process and checks the exit status (2: a flag's value, 1: anything else expected), that no traceback is
printed, the words of the one ``error:`` line, and that nothing was written or changed.

The push's mistakes (no token, a refused token, an unreachable Hub, offline mode) need the test Hub and are in
``tests/test_hub.py``; the configuration's misspelt keywords in ``tests/test_configuration.py``.
"""

import importlib
import json
import pathlib
import subprocess
import sys

import pytest

from decoderlab.cli import run_command
from decoderlab.convert import main as convert_main
from decoderlab.explore import main as explore_main
from decoderlab.model_card import main as model_card_main
from tests.explore_checkpoints import train_char_checkpoint
from tests.training_runs import folder_snapshot, subprocess_env

COMMANDS = ("decoderlab.convert", "decoderlab.push", "decoderlab.model_card", "decoderlab.explore")


def run(*args: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=subprocess_env(), cwd=cwd, timeout=300
    )


def refused(result: subprocess.CompletedProcess, status: int, *words: str) -> str:
    """``result`` ended with ``status`` and exactly one line on stderr, ``error: ...`` holding each of ``words``."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert result.returncode == status, (result.returncode, result.stderr)
    return lines[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    """A character model saved as the training scripts save one (a step of training is enough here)."""
    return train_char_checkpoint(tmp_path_factory.mktemp("mistakes") / "ckpt", steps=1)


@pytest.fixture(scope="module")
def adapter(checkpoint) -> pathlib.Path:
    """What finetune.py --use_lora writes without --merge_lora: peft's adapter folder (adapter_config.json,
    adapter_model.safetensors) and the tokenizer, no config.json."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = checkpoint.parent / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(folder)
    assert (folder / "adapter_config.json").is_file() and not (folder / "config.json").exists()
    return folder


def test_help_prints_usage_only():
    """``--help`` prints the usage and nothing on stderr: importing decoderlab keeps torchao's import-time warnings
    (pulled in by transformers' quantizer registry where torchao is installed) off the console. Every command
    imports decoderlab the same way; one fresh process shows it."""
    result = run("-m", "decoderlab.push", "--help")
    assert result.returncode == 0
    assert result.stderr == ""
    assert result.stdout.startswith("usage: python -m decoderlab.push ")


@pytest.mark.parametrize("command", COMMANDS)
def test_usage_names_the_command_as_it_is_run(command, capsys):
    """Each command's usage line says ``python -m decoderlab.NAME`` (push said ``push.py``)."""
    main = importlib.import_module(command).main
    with pytest.raises(SystemExit) as exited:
        run_command(main, ["--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m {command} ")


def test_shakespeare_sft_data_help_prints_usage_only():
    """The same for training/shakespeare_sft_data.py, whose imports pull in peft and with it torchao."""
    result = run("training/shakespeare_sft_data.py", "--help", cwd=pathlib.Path(__file__).parents[1])
    assert result.returncode == 0 and result.stderr == ""


def test_convert_refuses_a_lora_adapter_folder_naming_merge_lora(adapter, tmp_path):
    """An unmerged LoRA adapter is not a checkpoint: the message says what the folder is and how to get a merged
    model (--merge_lora, or peft's merge_and_unload); nothing is written."""
    before = folder_snapshot(adapter)
    result = run("-m", "decoderlab.convert", "--to", "llama", str(adapter), str(tmp_path / "llama"))
    refused(result, 1, "is a LoRA adapter", "--merge_lora", "merge_and_unload")
    assert not (tmp_path / "llama").exists()
    assert folder_snapshot(adapter) == before


def test_explore_refuses_a_lora_adapter_folder_naming_merge_lora(adapter, capsys):
    """The explorer says the same, at start-up."""
    assert explore_main([str(adapter)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "is a LoRA adapter" in error and "--merge_lora" in error


def test_explore_checks_the_save_path_before_loading(tmp_path):
    """``--save`` into a missing folder fails before any work: with a checkpoint that does not exist either, the
    error is about --save, so the path was checked first; nothing is created."""
    missing = tmp_path / "missing" / "r.html"
    result = run("-m", "decoderlab.explore", str(tmp_path / "no-such-checkpoint"), "--save", str(missing))
    refused(result, 2, "--save", "does not exist; create it first")
    assert list(tmp_path.iterdir()) == []


def test_convert_missing_source_is_one_line(tmp_path, capsys):
    """A SRC that is neither a folder nor a reachable Hub repo (offline) is one line naming it."""
    with pytest.raises(SystemExit) as exited:
        run_command(convert_main, ["--to", "gguf", str(tmp_path / "nope"), str(tmp_path / "m.gguf")])
    assert exited.value.code == 1
    error = capsys.readouterr().err
    assert error.startswith("error: SRC") and "nope" in error and "Traceback" not in error
    assert list(tmp_path.iterdir()) == []


def test_model_card_of_a_folder_without_config_is_one_line(tmp_path):
    """A folder without config.json: exit 1, one line; nothing is written into it."""
    refused(run("-m", "decoderlab.model_card", str(tmp_path)), 1, "has no config.json")
    assert list(tmp_path.iterdir()) == []


def test_model_card_training_file_that_is_not_json_is_a_usage_error(checkpoint, tmp_path, capsys):
    """A --training file that is not JSON: exit 2, naming the file; the checkpoint folder is left as it was."""
    bad = tmp_path / "training.json"
    bad.write_text("{steps: 3}")
    before = folder_snapshot(checkpoint)
    with pytest.raises(SystemExit) as exited:
        run_command(model_card_main, [str(checkpoint), "--training", str(bad)])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "training.json is not valid JSON" in error
    assert folder_snapshot(checkpoint) == before


@pytest.mark.slow  # an ONNX export in a fresh process (about 10 s)
def test_onnx_export_prints_a_bounded_number_of_lines(checkpoint, tmp_path):
    """``--to onnx`` printed ~140 lines (119 of onnxscript's "Replaced initializer"): now the weights' progress bar
    and the summary line, and no warning about packages the export does not use."""
    out = tmp_path / "m.onnx"
    result = run("-m", "decoderlab.convert", "--to", "onnx", str(checkpoint), str(out))
    assert result.returncode == 0, result.stderr
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) <= 4, lines
    assert f"Wrote {out}" in lines[-1]
    assert not any(word in result.stderr for word in ("Replaced initializer", "torchvision", "Warning", "W1"))


def test_push_refuses_a_lora_adapter_folder_naming_merge_lora(adapter):
    """push_to_hub (and so the command) refuses the adapter before any request, naming --merge_lora."""
    from decoderlab.push import push_to_hub

    with pytest.raises(ValueError, match=r"is a LoRA adapter .*--merge_lora.*merge_and_unload"):
        push_to_hub(adapter, "decoderlab-org/adapter", token="unused")


def test_adapter_message_names_the_base_model(adapter):
    """The message's merge recipe names the adapter's base model, read from adapter_config.json."""
    from decoderlab.export.checkpoint import lora_adapter_problem

    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base and repr(base) in lora_adapter_problem(adapter, "x")
    assert lora_adapter_problem(adapter.parent / "ckpt", "x") is None  # a whole checkpoint is no adapter


# Found going through each command's flags as a new user would: (command, arguments with {ckpt} and {tmp}, exit
# status, words of the error line). Run in this process through run_command, as `python -m` runs them.
FLAG_MISTAKES = {
    "shard-size-not-a-size": (
        "decoderlab.convert", ["--to", "llama", "{ckpt}", "{tmp}/llama", "--max-shard-size", "lots"], 2,
        ["--max-shard-size 'lots' is not a size", "2GB"],
    ),
    "gguf-without-its-suffix": (
        "decoderlab.convert", ["--to", "gguf", "{ckpt}", "{tmp}/model.txt"], 1, ["should end in .gguf"],
    ),
    "convert-onto-the-source": (
        "decoderlab.convert", ["--to", "llama", "{ckpt}", "{ckpt}"], 1, ["exists and is not an empty folder"],
    ),
    "explore-port-out-of-range": ("decoderlab.explore", ["{ckpt}", "--port", "99999"], 2, ["--port 99999", "65535"]),
    "explore-save-into-a-folder": ("decoderlab.explore", ["{ckpt}", "--save", "{tmp}"], 2, ["is a folder"]),
    "card-training-file-missing": (
        "decoderlab.model_card", ["{ckpt}", "--training", "{tmp}/none.json"], 2, ["none.json does not exist"],
    ),
    "push-repo-id-without-namespace": ("decoderlab.push", ["{ckpt}", "justname"], 1, ["must be 'ORG/NAME'"]),
    "push-a-file": ("decoderlab.push", ["{ckpt}/config.json", "org/name"], 1, ["is not a folder"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FLAG_MISTAKES))
def test_flag_mistakes_are_one_line_and_change_nothing(name, checkpoint, tmp_path, capsys):
    """Each mistake ends with its exit status and one ``error:`` line holding its words, before any work: the
    checkpoint and the scratch folder are left as they were (exit 2 for a flag's value, 1 otherwise)."""
    command, args, status, words = FLAG_MISTAKES[name]
    args = [arg.format(ckpt=checkpoint, tmp=tmp_path) for arg in args]
    before = folder_snapshot(checkpoint)
    with pytest.raises(SystemExit) as exited:
        run_command(importlib.import_module(command).main, args)
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1 and "Traceback" not in error, error
    assert all(word in error for word in words), error
    assert exited.value.code == status
    assert folder_snapshot(checkpoint) == before and list(tmp_path.iterdir()) == []
