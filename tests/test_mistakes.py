"""A user's mistakes with the training scripts: each ends in one clear error, before anything is written,
and no run mixes into another.

Most mistakes are shown in-process, through the scripts' own ``main`` (the exception it raises is what
``decoderlab.cli.run_command`` turns into the ``error:`` line); a representative set runs the real command in a
subprocess (marked slow) to show the exit status, the single line and that no traceback is printed."""

import json
import logging
import math
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import decoderlab
from decoderlab.cli import UsageError, UserError
from tests.paths import INPUT_TXT, REPO_ROOT
from tests.training_runs import folder_snapshot, save_checkpoint_folder
from training import evaluate, finetune, generate, pretrain
from training.args import TrainConfig, parse_config
from training.data import check_unknown_characters, train_char_tokenizer
from training.loop import non_finite_error
from training.preflight import preflight

TINY = [
    "--block_size", "16", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--num_warmup_steps", "1",
    "--logging_steps", "2", "--eval_steps", "none", "--checkpointing_steps", "2", "--seed", "0",
    "--model.hidden_size", "32", "--model.num_hidden_layers", "1", "--model.num_attention_heads", "2",
    "--model.intermediate_size", "64",
]  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(INPUT_TXT.read_text(encoding="utf-8")[:20_000])
    return path


def argv(text_file, output_dir, *extra: str) -> list[str]:
    return ["--dataset_name", "none", "--train_file", str(text_file), "--output_dir", str(output_dir), *TINY, *extra]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, text_file) -> pathlib.Path:
    """A pretraining run of 4 steps: the final model, step_2 and step_4."""
    out = tmp_path_factory.mktemp("runs") / "finished"
    pretrain.main(argv(text_file, out, "--max_train_steps", "4"))
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path) -> pathlib.Path:
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


@pytest.fixture(scope="module")
def learned_checkpoint(tmp_path_factory) -> pathlib.Path:
    """A character model with a learned position table of 64 entries."""
    tokenizer = train_char_tokenizer([INPUT_TXT.read_text(encoding="utf-8")])
    config = decoderlab.DecoderLabConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=64, position_embedding_type="learned", eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("learned") / "checkpoint"
    return save_checkpoint_folder(decoderlab.DecoderLabForCausalLM(config), tokenizer, folder)


# ----------------------------------------------------------------------------------------------
# Flags and recipes: usage errors (exit status 2), caught before anything runs


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--learning_rat", "1e-3"], "Did you mean 'learning_rate'"),
        (["--max_train_steps", "0"], "max_train_steps must be a positive integer, got 0"),
        (["--lr_scheduler_kwargs", "{min_lr_rate: [0.1"], "lr_scheduler_kwargs must be a mapping"),
        (
            ["--model_name_or_path", "out/x", "--model.num_hidden_layers", "6"],
            r"model fields \{'num_hidden_layers': 6\}",
        ),
        (["--block_size", "128", "--model.max_position_embeddings", "64"], "--block_size 128 is longer than model.max"),
        (["--overwrite_output_dir", "--resume_from_checkpoint", "latest"], "pass one of them"),
    ],
)
def test_flag_mistakes_are_usage_errors_naming_the_flag(flags, message):
    """Bad input: a misspelt flag, an impossible value, an unparsable mapping, model fields beside a checkpoint whose
    architecture they cannot change (pretrain.py trained it silently and recorded the fields), a block longer than
    the new model's positions (RoPE included: its config said 64, its card 128), and flags that contradict."""
    with pytest.raises(UsageError, match=message):
        preflight(parse_config(TrainConfig, flags))


def test_window_sampling_is_refused_where_examples_are_trained_whole():
    """Bad input: --window_sampling for chat or prompt/completion data (rows are whole examples, never windows of
    one text) was ignored without a word; it is refused naming both settings."""
    from training.finetune_args import FinetuneConfig

    base = ["--model_name_or_path", "out/x", "--train_file", "chat.jsonl", "--window_sampling", "shifted"]
    with pytest.raises(UsageError, match="window_sampling='shifted' draws windows from one packed text"):
        preflight(parse_config(FinetuneConfig, [*base, "--data_format", "chat"]))
    preflight(parse_config(FinetuneConfig, [*base, "--data_format", "text"]))  # packed text: windows apply


def test_a_recipe_that_is_not_yaml_is_named(tmp_path):
    """Bad input: a YAML syntax error names the recipe file (and the line), as a usage error."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 1e-3\nmodel: {hidden_size: 64\n")
    with pytest.raises(UsageError, match=rf"--config {recipe} is not valid YAML.*line"):
        parse_config(TrainConfig, ["--config", str(recipe)])


def test_generate_flag_mistakes_exit_with_status_2(capsys):
    """Bad input: generate.py's own argparse errors exit with status 2 (a missing checkpoint, a window of 0)."""
    for flags in ([], ["ck", "--window", "0"], ["ck", "--temperature", "-1"]):
        with pytest.raises(SystemExit) as stop:
            generate.main(flags)
        assert stop.value.code == 2
    assert "--window must be a positive integer" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# One run per folder


def test_a_new_run_into_a_folder_holding_a_run_is_refused_and_changes_nothing(run_copy, text_file):
    """A second run into a finished run's folder stopped mixing with it (the 20-step model beside
    the 60-step checkpoint). It is refused before any step, naming how to continue or replace it; not a file of the
    folder changes. `--resume_from_checkpoint latest` on a folder holding only a final model is refused too."""
    before = folder_snapshot(run_copy)
    with pytest.raises(UserError, match=r"holds another run \(config.json.*step_2, step_4\).*"
                       r"--resume_from_checkpoint latest.*--overwrite_output_dir"):  # fmt: skip
        pretrain.main(argv(text_file, run_copy, "--max_train_steps", "2"))
    for step in ("step_2", "step_4"):
        shutil.rmtree(run_copy / step)
    before = folder_snapshot(run_copy)
    with pytest.raises(UserError, match="no step_N checkpoint to resume from.*--overwrite_output_dir"):
        pretrain.main(argv(text_file, run_copy, "--max_train_steps", "2", "--resume_from_checkpoint", "latest"))
    assert folder_snapshot(run_copy) == before


def test_overwrite_output_dir_replaces_the_run_and_keeps_other_files(run_copy, text_file):
    """``--overwrite_output_dir``: the old run's files are gone before the new one writes (its checkpoints, metrics
    and records are the new run's only); a file no run writes stays."""
    (run_copy / "notes.txt").write_text("mine")
    pretrain.main(argv(text_file, run_copy, "--max_train_steps", "2", "--overwrite_output_dir"))
    assert sorted(p.name for p in run_copy.glob("step_*")) == ["step_2"]
    steps = [json.loads(line)["step"] for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2
    assert "max_train_steps: 2\n" in (run_copy / "training_config.yaml").read_text()
    assert (run_copy / "notes.txt").read_text() == "mine"


def test_the_base_checkpoint_cannot_be_the_output_dir(run_copy, text_file):
    """Bad input: fine-tuning into the folder it starts from would write over its base (with --overwrite_output_dir,
    delete it): refused as a usage error."""
    before = folder_snapshot(run_copy)
    with pytest.raises(UsageError, match="is the base checkpoint"):
        finetune.main(["--model_name_or_path", str(run_copy), "--train_file", str(text_file),
                       "--output_dir", str(run_copy), "--overwrite_output_dir"])  # fmt: skip
    assert folder_snapshot(run_copy) == before


# ----------------------------------------------------------------------------------------------
# A resume that does not fit


def test_a_resume_with_another_architecture_names_each_setting(run_copy, text_file):
    """Resuming with another model printed torch's size-mismatch lines. Now one line names each
    setting that differs (checkpoint's value -> given), from the run's training_config.yaml; a folder without that
    record names the weights that differ. Nothing is written."""
    before = folder_snapshot(run_copy)
    resume = ["--max_train_steps", "6", "--resume_from_checkpoint", "latest"]
    with pytest.raises(UsageError, match=r"model.num_hidden_layers: 1 -> 2; model.tie_word_embeddings: False -> True"):
        pretrain.main(argv(text_file, run_copy, *resume, "--model.num_hidden_layers", "2",
                           "--model.tie_word_embeddings", "true"))  # fmt: skip
    with pytest.raises(UsageError, match=r"embedding_learning_rate: None -> 0.01"):
        pretrain.main(argv(text_file, run_copy, *resume, "--embedding_learning_rate", "0.01"))
    with pytest.raises(UsageError, match=r"optimizer: 'adamw' -> 'muon'"):  # other groups, another state
        pretrain.main(argv(text_file, run_copy, *resume, "--optimizer", "muon"))
    assert folder_snapshot(run_copy) == before
    (run_copy / "training_config.yaml").unlink()
    with pytest.raises(UsageError, match=r"model.layers.1.input_layernorm.weight: absent -> \[32\]"):
        pretrain.main(argv(text_file, run_copy, *resume, "--model.num_hidden_layers", "2"))


def test_fine_tuning_into_a_pretraining_folder_names_what_differs(run_copy, finished_run, text_file):
    """finetune.py resuming a pretraining run's checkpoint (torch's "different number of parameter groups" before)
    names the base model and tokenizer settings that differ."""
    with pytest.raises(UsageError, match=r"model_name_or_path: None -> .*tokenizer_type: 'char' -> 'pretrained'"):
        finetune.main(["--model_name_or_path", str(finished_run), "--train_file", str(text_file), "--block_size", "16",
                       "--output_dir", str(run_copy), "--resume_from_checkpoint", "latest"])  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Data


@pytest.mark.parametrize("content, what", [("", "empty"), ("\n  \n\t\n", "whitespace only")])
def test_an_empty_or_blank_data_file_stops_every_script_before_anything_is_written(
    tmp_path, content, what, learned_checkpoint
):
    """An empty text file ended in a 43-line `datasets` traceback; a blank one left an output folder
    holding only a tokenizer. pretrain.py, finetune.py and evaluate.py now stop naming the file, writing nothing."""
    data = tmp_path / "data.txt"
    data.write_text(content)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=f"Data file {data} is {what}"):
        pretrain.main(["--dataset_name", "none", "--train_file", str(data), "--output_dir", str(out)])
    with pytest.raises(ValueError, match=f"Data file {data} is {what}"):
        finetune.main(["--model_name_or_path", str(learned_checkpoint), "--train_file", str(data),
                       "--output_dir", str(out), "--block_size", "32"])  # fmt: skip
    before = folder_snapshot(learned_checkpoint)
    with pytest.raises(ValueError, match=f"Data file {data} is {what}"):
        evaluate.main([str(learned_checkpoint), "--data_file", str(data), "--block_size", "32"])
    assert not out.exists() and folder_snapshot(learned_checkpoint) == before


def test_text_too_short_for_a_block_leaves_no_folder_behind(tmp_path):
    """A data file that cannot fill one block stops pretrain.py before its first step, and the folder the run had
    started (its tokenizer saved for the other processes) is gone again."""
    data = tmp_path / "short.txt"
    data.write_text("To be, or not to be.\n")
    with pytest.raises(ValueError, match="too short"):
        pretrain.main(["--dataset_name", "none", "--train_file", str(data), "--output_dir", str(tmp_path / "out"),
                       "--block_size", "64"])  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


def test_unknown_characters_are_counted_named_and_stop_training_above_one_percent(learned_checkpoint, caplog):
    """Characters outside a character vocabulary became <|unk|> without a word. The check counts
    and names them once; above 1% of the characters it stops unless allowed; below it (or allowed) it warns."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(learned_checkpoint)
    texts = ["ROMEO 😀 said 42 times", "JULIET: 😀"]  # 😀 twice, 4 and 2 once: 4 of 30 characters
    with pytest.raises(ValueError, match=r"4 of the 30 characters of the train split \(13.3%; 3 distinct: '😀', "
                       r"'4', '2'\).*--allow_unknown_characters"):  # fmt: skip
        check_unknown_characters(tokenizer, texts, "the train split")
    with caplog.at_level(logging.WARNING, logger="training.data"):
        check_unknown_characters(tokenizer, texts, "the train split", allow=True)
        check_unknown_characters(tokenizer, ["ROMEO said" * 20 + "4"], "the prompt", allow=False)  # 1 in 201
    assert caplog.text.count("are not in the tokenizer's vocabulary") == 2 and "1 of the 201" in caplog.text


def test_chat_data_with_unknown_characters_is_refused_by_finetune(tmp_path, learned_checkpoint):
    """The chat format (and prompt/completion) go through the same check as text, in finetune.py, before a step;
    ``--allow_unknown_characters`` lets the run go on past it."""
    rows = [{"messages": [{"role": "user", "content": "Speak 😀😀"}, {"role": "assistant", "content": "Nay 😀"}]}] * 8
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = ["--model_name_or_path", str(learned_checkpoint), "--train_file", str(data), "--data_format", "chat",
              "--block_size", "64", "--max_train_steps", "1", "--per_device_train_batch_size", "2"]  # fmt: skip
    with pytest.raises(ValueError, match=r"characters of the train split \(\d+\.\d%; 1 distinct: '😀'\)"):
        finetune.main([*common, "--output_dir", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()
    finetune.main([*common, "--output_dir", str(tmp_path / "allowed"), "--allow_unknown_characters"])
    assert (tmp_path / "allowed" / "config.json").is_file()


# ----------------------------------------------------------------------------------------------
# Positions, generation, a diverged run


def test_evaluate_block_size_and_generate_window_past_a_position_table_name_the_flag(learned_checkpoint):
    """evaluate.py --block_size 128 and generate.py --window 128 on a model of 64 learned positions
    raised a model-level traceback naming neither flag."""
    with pytest.raises(ValueError, match=r"--block_size 128 is longer than the 64 positions"):
        evaluate.main([str(learned_checkpoint), "--data_file", str(INPUT_TXT), "--block_size", "128"])
    with pytest.raises(ValueError, match=r"--window 128 is longer than the 64 positions.*Lower --window"):
        generate.main([str(learned_checkpoint), "--window", "128", "--max_new_tokens", "2"])


def test_generate_refuses_a_step_checkpoint_saying_where_the_model_is(finished_run):
    """generate.py on a step_N folder said "Should have a model_type key"; it now says what the folder is."""
    with pytest.raises(ValueError, match=r"step_2 is a resumable training checkpoint.*saved in .*finished"):
        generate.main([str(finished_run / "step_2")])


def test_generate_temperature_0_is_greedy_and_each_run_prints_its_seed(learned_checkpoint, capsys):
    """``--temperature 0`` means greedy (transformers refused it); sampling prints the seed it used, a fresh one
    per run, and ``--seed`` repeats a sample."""
    common = [str(learned_checkpoint), "--prompt", "ROMEO:", "--max_new_tokens", "12"]
    generate.main([*common, "--greedy"])
    greedy = capsys.readouterr().out
    generate.main([*common, "--temperature", "0"])
    assert capsys.readouterr().out == greedy
    seeds, samples = [], []
    for _ in range(2):
        generate.main(common)
        captured = capsys.readouterr()
        seeds.append(int(captured.err.split("seed ")[1].split()[0]))
        samples.append(captured.out)
    assert seeds[0] != seeds[1]
    generate.main([*common, "--seed", str(seeds[0])])
    assert capsys.readouterr().out == samples[0]


def test_generate_names_the_prompt_characters_the_tokenizer_does_not_know(learned_checkpoint, caplog):
    """`ROMEO 😀 said 42 times:` came back as `ROMEO  said  times:` without a word."""
    with caplog.at_level(logging.WARNING, logger="training.data"):
        generate.main([str(learned_checkpoint), "--prompt", "ROMEO 😀 said 42 times:", "--max_new_tokens", "2"])
    assert "3 of the 22 characters of the prompt" in caplog.text and "'😀', '4', '2'" in caplog.text


def test_a_nan_stop_without_a_checkpoint_does_not_advise_resuming_from_one(tmp_path):
    """The NaN message said no checkpoint was saved, then advised resuming from it."""
    cfg = TrainConfig(output_dir=str(tmp_path / "empty"))
    message = str(non_finite_error(math.nan, 3, cfg, []))
    assert "No checkpoint had been saved yet" in message and "--resume_from_checkpoint" not in message
    (tmp_path / "empty" / "step_2").mkdir(parents=True)
    assert "--resume_from_checkpoint latest" in str(non_finite_error(math.nan, 3, cfg, []))


# ----------------------------------------------------------------------------------------------
# The real commands: one error line, the exit status, no traceback, nothing changed


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "training" / script), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip


def assert_one_error_line(result: subprocess.CompletedProcess, status: int, *words: str) -> str:
    assert result.returncode == status, result.stderr[-3000:]
    assert "Traceback (most recent call last)" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


@pytest.mark.slow
def test_commands_end_a_mistake_with_one_line_and_its_status(run_copy, text_file, learned_checkpoint, tmp_path):
    """training/*.py printed 10 to 40 lines of traceback above even good messages. Through the real
    commands: a misspelt flag (status 2, argparse's own parser errors too), a folder holding another run and an empty
    data file or a Latin-1 one (status 1), a window past the positions: one `error:` line each, no traceback, nothing changed or left
    behind; ``--debug`` shows the traceback."""
    before = folder_snapshot(run_copy)
    result = run_script("pretrain.py", *argv(text_file, run_copy, "--max_train_steps", "2"))
    assert_one_error_line(result, 1, "holds another run", "--resume_from_checkpoint latest", "--overwrite_output_dir")
    assert folder_snapshot(run_copy) == before

    result = run_script("pretrain.py", "--learning_rat", "1e-3", "--output_dir", str(tmp_path / "a"))
    assert_one_error_line(result, 2, "Did you mean 'learning_rate'")
    result = run_script("pretrain.py", "--learning_rat", "1e-3", "--output_dir", str(tmp_path / "a"), "--debug")
    assert result.returncode == 2 and "Traceback (most recent call last)" in result.stderr

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = run_script("pretrain.py", "--dataset_name", "none", "--train_file", str(empty), "--output_dir",
                        str(tmp_path / "b"))  # fmt: skip
    assert_one_error_line(result, 1, f"Data file {empty} is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "run"]

    latin = tmp_path / "latin.txt"
    latin.write_bytes("Café\n".encode("latin-1") * 100)
    result = run_script("prepare_data.py", "--dataset_name", "none", "--train_file", str(latin), "--output_dir",
                        str(tmp_path / "c"))  # fmt: skip
    assert_one_error_line(result, 1, f"Data file {latin} is not UTF-8 text: byte 0xE9 at offset 3", "iconv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "latin.txt", "run"]

    result = run_script("generate.py", str(learned_checkpoint), "--window", "128")
    assert_one_error_line(result, 1, "--window 128", "64 positions")


def test_help_documents_debug(capsys):
    """Every script's --help names --debug (run_command takes it off the command line before the parser sees it)."""
    for main in (pretrain.main, finetune.main, evaluate.main, generate.main):
        with pytest.raises(SystemExit) as stop:
            main(["--help"])
        assert stop.value.code == 0 and "--debug" in capsys.readouterr().out


def test_a_large_blank_file_is_refused_and_text_after_blanks_is_not(tmp_path):
    """A whitespace-only file over the first 1 MB piece is still named as blank; text after 2 MB of spaces is text."""
    from training.data import check_not_empty

    blank, late = tmp_path / "blank.txt", tmp_path / "late.txt"
    blank.write_bytes(b" \n" * 2**20)
    late.write_bytes(b" " * 2**21 + b"ROMEO:")
    with pytest.raises(ValueError, match="blank.txt is whitespace only"):
        check_not_empty(blank)
    check_not_empty(late)


# ----------------------------------------------------------------------------------------------
# Text files that are not UTF-8

LATIN_1_BOOK = "Le café du Dauphiné, où l'on sert des crêpes.\n" * 400  # 18 KB, "é" at byte 6 of each line


@pytest.fixture
def latin_1_file(tmp_path) -> pathlib.Path:
    path = tmp_path / "book.txt"
    path.write_bytes(LATIN_1_BOOK.encode("latin-1"))
    return path


def test_a_latin_1_file_stops_every_command_naming_the_file_offset_and_the_fix(tmp_path, latin_1_file,
                                                                              learned_checkpoint):  # fmt: skip
    """A Latin-1 book given as --train_file, --validation_file or --data_file ended in a DatasetGenerationError
    traceback; pretrain.py, finetune.py, prepare_data.py and evaluate.py now stop before anything is written, naming
    the file, the first bad byte and its offset and line, and how to convert it (iconv) or read it (--encoding)."""
    from training import prepare_data

    good = tmp_path / "good.txt"
    good.write_text(INPUT_TXT.read_text(encoding="utf-8")[:20_000])
    words = (f"Data file {latin_1_file} is not UTF-8 text: byte 0xE9 at offset 6 (line 1 of book.txt)",
             "iconv -f latin1 -t utf-8", "--encoding latin-1")  # fmt: skip
    out = tmp_path / "out"
    commands = [
        lambda: pretrain.main(argv(latin_1_file, out)),
        lambda: pretrain.main(argv(good, out, "--validation_file", str(latin_1_file))),
        lambda: finetune.main(["--model_name_or_path", str(learned_checkpoint), "--train_file", str(latin_1_file),
                               "--output_dir", str(out), "--block_size", "32"]),  # fmt: skip
        lambda: prepare_data.main(["--dataset_name", "none", "--train_file", str(latin_1_file), "--output_dir",
                                   str(out)]),  # fmt: skip
        lambda: evaluate.main([str(learned_checkpoint), "--data_file", str(latin_1_file), "--block_size", "32"]),
    ]
    before = folder_snapshot(learned_checkpoint)
    for command in commands:
        with pytest.raises(ValueError) as refused:
            command()
        assert all(word in str(refused.value) for word in words), str(refused.value)
    assert not out.exists() and folder_snapshot(learned_checkpoint) == before


def test_the_offset_is_the_files_own_across_pieces_and_a_character_cut_at_the_end(tmp_path, monkeypatch):
    """The offset and line counted across the 16 MB pieces the check reads (here pieces of 3 bytes, so characters
    straddle them), and a file ending inside a character named as such."""
    from training import data

    monkeypatch.setattr(data, "ENCODING_CHECK_PIECE", 3)
    straddling = tmp_path / "straddling.txt"
    straddling.write_bytes("éé\nvoilà\n".encode() + b"\xff")  # the bad byte at offset 5 + 7 = 12, on line 3
    with pytest.raises(ValueError, match=r"byte 0xFF at offset 12 \(line 3 of straddling.txt\).*invalid start byte"):
        data.check_encoding(straddling)
    cut = tmp_path / "cut.txt"
    cut.write_bytes(b"ab" + "é".encode()[:1])
    with pytest.raises(ValueError, match=r"byte 0xC3 at offset 2 \(line 1 of cut.txt\).*unexpected end of data"):
        data.check_encoding(cut)
    data.check_encoding(straddling, "latin-1")  # every byte is a Latin-1 character


def test_encoding_latin_1_trains_on_the_file_as_written(tmp_path, latin_1_file):
    """--encoding latin-1 reads the same book through datasets' own decoding: the run trains, and its character
    vocabulary holds the accented characters; a name Python does not know, or --encoding without a local file, is
    refused naming the flag."""
    out = tmp_path / "run"
    pretrain.main(argv(latin_1_file, out, "--encoding", "latin-1", "--max_train_steps", "2"))
    vocabulary = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert {"é", "ù", "ê"} <= set(vocabulary)
    with pytest.raises(ValueError, match="encoding='latin-2000' is not a text encoding Python knows"):
        parse_config(TrainConfig, ["--encoding", "latin-2000"])
    with pytest.raises(ValueError, match="applies to --train_file and --validation_file"):
        preflight(parse_config(TrainConfig, ["--encoding", "latin-1", "--dataset_name", "karpathy/tiny_shakespeare"]))
