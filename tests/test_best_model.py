"""The best model kept (``load_best_model_at_end``), early stopping, and compilation that does not recompile at each
evaluation.

The runs overfit on purpose: 3,000 characters of Tiny Shakespeare to train on, a model of 2 x 64, a high learning
rate, so the validation loss falls, then rises within 150 steps (2-3 s each, in this process). Which step is the
best is read from the run's own evaluations, never written into the test.
"""

import json
import math
import pathlib
import shutil

import pytest
import torch
import torch._dynamo
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import decoderlab
from tests.training_runs import metrics, text_files_in
from training import pretrain
from training.args import TrainConfig, parse_config
from training.checkpointing import STATE_NAME, list_checkpoints
from training.data import BlockBatches
from training.loop import make_accelerator, train

pytestmark = pytest.mark.usefixtures("one_thread")  # the same arithmetic in every run: resumes compare exactly


@pytest.fixture(scope="module")
def overfit_files(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    return text_files_in(tmp_path_factory.mktemp("overfit"), 3000)


def overfit_argv(files, output_dir, *extra: str) -> list[str]:
    train_file, validation_file = files
    return [
        "--dataset_name", "none", "--train_file", str(train_file), "--validation_file", str(validation_file),
        "--block_size", "32", "--per_device_train_batch_size", "8", "--learning_rate", "1e-2",
        "--num_warmup_steps", "5", "--logging_steps", "10", "--eval_steps", "10", "--max_eval_samples", "16",
        "--checkpointing_steps", "50", "--checkpoints_total_limit", "1", "--max_train_steps", "150", "--seed", "0",
        "--output_dir", str(output_dir), "--model.hidden_size", "64", "--model.num_hidden_layers", "2",
        "--model.num_attention_heads", "2", *extra,
    ]  # fmt: skip


def periodic_evals(output_dir) -> dict[int, float]:
    """The periodic evaluations (on max_eval_samples blocks), without the final one over every block."""
    records = [r for r in metrics(output_dir) if "eval_loss" in r]
    return {r["step"]: r["eval_loss"] for r in records[:-1]}


def validation_ids(output_dir, files) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    return torch.tensor(tokenizer(files[1].read_text()[:2000], add_special_tokens=False)["input_ids"])[None]


def logits_of(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def checkpoint_logits(output_dir, step: int, ids) -> torch.Tensor:
    """The logits of the weights saved in the resumable checkpoint step_N."""
    model = AutoModelForCausalLM.from_pretrained(output_dir)  # the architecture; weights replaced below
    model.load_state_dict(load_file(pathlib.Path(output_dir) / f"step_{step}" / "model.safetensors"))
    return logits_of(model, ids)


@pytest.mark.slow
def test_saved_folder_holds_the_best_steps_weights_and_the_last_state_stays_resumable(tmp_path, overfit_files):
    """With --load_best_model_at_end the folder's logits are exactly those of the best periodic evaluation's
    checkpoint (not the last step's), run_info.json, the card and the final record name that step and value, the
    best checkpoint survived rotation (limit 1), and the last step's checkpoint is there to resume from."""
    out = tmp_path / "best"
    pretrain.main(overfit_argv(overfit_files, out, "--load_best_model_at_end", "true"))
    evals = periodic_evals(out)
    best_step = min(evals, key=evals.get)
    assert best_step < 150 and evals[150] > evals[best_step] + 0.05  # the run did overfit: the test can fail
    assert [p.name for p in list_checkpoints(out)] == [f"step_{best_step}", "step_150"]

    ids = validation_ids(out, overfit_files)
    saved = logits_of(AutoModelForCausalLM.from_pretrained(out), ids)
    assert torch.equal(saved, checkpoint_logits(out, best_step, ids))
    assert not torch.allclose(saved, checkpoint_logits(out, 150, ids), atol=1e-3)

    info = json.loads((out / "run_info.json").read_text())
    assert info["saved_weights_step"] == best_step and info["best_loss"] == evals[best_step]
    final = metrics(out)[-1]
    assert final["best_global_step"] == best_step and final["step"] == 150
    # the final evaluation (every block) scores the saved weights: the folder loaded back gives the same loss
    blocks = AutoTokenizer.from_pretrained(out)(overfit_files[1].read_text(), add_special_tokens=False)["input_ids"]
    blocks = torch.tensor(blocks[: len(blocks) // 32 * 32]).view(-1, 32)
    with torch.no_grad():
        loss = AutoModelForCausalLM.from_pretrained(out)(input_ids=blocks, labels=blocks).loss.item()
    assert loss == pytest.approx(final["eval_loss"], rel=1e-5)
    card = (out / "README.md").read_text()
    assert f"| Saved weights: the best evaluation's step | {best_step} |" in card
    state = json.loads((out / "step_150" / STATE_NAME).read_text())
    assert state["best_global_step"] == best_step and state["best_metric"] == evals[best_step]


@pytest.mark.slow
def test_resumed_run_keeps_tracking_the_best(tmp_path, overfit_files):
    """A run stopped after a checkpoint and resumed (here: its folder as a kill right after step_50 or step_100
    leaves it) ends with the uninterrupted run's best step, value and saved weights: the best so far travels in
    the checkpoint, before the best (step 50: a later best is found) and after it (step 100: the earlier one is
    kept)."""
    reference = tmp_path / "reference"
    keep_all = ("--checkpoints_total_limit", "none", "--load_best_model_at_end", "true")
    pretrain.main(overfit_argv(overfit_files, reference, *keep_all))
    evals = periodic_evals(reference)
    best_step = min(evals, key=evals.get)
    assert 50 < best_step < 100, "the overfitting run's best moved: pick other resume points"
    ids = validation_ids(reference, overfit_files)
    expected = logits_of(AutoModelForCausalLM.from_pretrained(reference), ids)
    for resume_at in (50, 100):
        out = tmp_path / f"resumed_{resume_at}"
        out.mkdir()
        for step in sorted({resume_at, best_step} if resume_at > best_step else {resume_at}):
            shutil.copytree(reference / f"step_{step}", out / f"step_{step}")
        kept = [r for r in metrics(reference) if r["step"] <= resume_at]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        pretrain.main(overfit_argv(overfit_files, out, *keep_all, "--resume_from_checkpoint", "latest"))
        info = json.loads((out / "run_info.json").read_text())
        assert (info["saved_weights_step"], info["best_loss"]) == (best_step, evals[best_step]), resume_at
        assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(out), ids), expected), resume_at


def test_early_stopping_stops_after_the_patience_and_ends_normally(tmp_path, overfit_files, capsys):
    """--early_stopping_patience 3: the run stops at the third evaluation in a row that does not improve on the best
    (by more than the threshold), saves a checkpoint there and a complete folder with its card; the same command
    again says it is finished and changes nothing."""
    out = tmp_path / "early"
    argv = overfit_argv(overfit_files, out, "--early_stopping_patience", "3", "--resume_from_checkpoint", "latest")
    pretrain.main(argv)
    evals = periodic_evals(out)
    best, misses, expected_stop = math.inf, 0, None
    for step in sorted(evals):  # the rule, applied to the run's own evaluations
        misses = 0 if evals[step] < best else misses + 1
        best = min(best, evals[step])
        if misses == 3:
            expected_stop = step
            break
    assert expected_stop is not None and expected_stop < 150
    assert max(evals) == expected_stop  # no evaluation after the stop
    assert metrics(out)[-1]["step"] == expected_stop  # the final evaluation, at the stopping step
    assert (out / f"step_{expected_stop}").is_dir() and (out / "model.safetensors").is_file()
    assert "Early stopping" in (out / "README.md").read_text()
    state = json.loads((out / f"step_{expected_stop}" / STATE_NAME).read_text())
    assert state["step"] == expected_stop and state["early_stopping_patience_counter"] == 3
    capsys.readouterr()
    pretrain.main(argv)
    assert f"already finished at step {expected_stop} (stopped early" in capsys.readouterr().out


def test_off_is_todays_behaviour(tmp_path, overfit_files):
    """Without the new fields: the folder holds the last step's weights, the evaluations are the periodic ones plus
    the final one, no extra checkpoint is kept, and nothing about a best model is recorded."""
    out = tmp_path / "off"
    pretrain.main(overfit_argv(overfit_files, out))
    records = [r for r in metrics(out) if "eval_loss" in r]
    assert [r["step"] for r in records] == [*range(10, 150, 10), 150]
    assert all("best_global_step" not in r for r in records)
    assert [p.name for p in list_checkpoints(out)] == ["step_150"]
    ids = validation_ids(out, overfit_files)
    assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(out), ids), checkpoint_logits(out, 150, ids))
    info = json.loads((out / "run_info.json").read_text())
    assert not {"saved_weights_step", "best_loss", "early_stopping"} & info.keys()
    state = json.loads((out / "step_150" / STATE_NAME).read_text())
    assert state["best_global_step"] is None and state["early_stopping_patience_counter"] == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--load_best_model_at_end", "true", "--eval_steps", "none"), "load_best_model_at_end need periodic"),
        (("--early_stopping_patience", "2", "--eval_steps", "none"), "early_stopping_patience need periodic"),
        (("--load_best_model_at_end", "true", "--metric_for_best_model", "accuracy"), "'accuracy' is never logged"),
        (("--early_stopping_patience", "0"), "early_stopping_patience must be a positive integer"),
        (("--early_stopping_threshold", "-0.1"), "early_stopping_threshold cannot be negative"),
        (("--torch_compile_backend", "eager"), "torch_compile is false"),
        (("--torch_compile", "true", "--torch_compile_backend", "no_such"), "'no_such' is not a torch.compile backend"),
    ],
)
def test_bad_best_model_settings_stop_before_any_step(tmp_path, overfit_files, flags, message):
    """Each impossible setting is a ValueError naming it, raised while the configuration is read: nothing is
    written."""
    with pytest.raises(ValueError, match=message):
        pretrain.main(overfit_argv(overfit_files, tmp_path / "bad", *flags))
    assert not (tmp_path / "bad").exists()


def test_aliases_and_direction_of_the_metric():
    """``loss`` is ``eval_loss`` (Trainer's "eval_" prefix), ``eval_perplexity`` is ``perplexity``; both are lower
    is better unless greater_is_better says otherwise."""
    assert parse_config(TrainConfig, ["--metric_for_best_model", "loss"]).metric_for_best_model == "eval_loss"
    cfg = parse_config(TrainConfig, ["--metric_for_best_model", "eval_perplexity"])
    assert cfg.metric_for_best_model == "perplexity" and cfg.greater_is_better is False
    assert parse_config(TrainConfig, ["--greater_is_better", "true"]).greater_is_better is True


COMPILES = []


@torch._dynamo.register_backend(name="decoderlab_test_counting")
def counting_backend(graph_module, example_inputs):
    """A torch.compile backend that records each graph Dynamo hands it and runs it as traced (no code generated)."""
    COMPILES.append(graph_module)
    return graph_module.forward


@pytest.mark.slow
def test_evaluations_do_not_recompile_and_the_first_step_is_timed_apart(tmp_path):
    """With --torch_compile, the graphs compiled do not grow with the number of evaluations: a run with 2 and a
    run with 6 periodic evaluations (train -> eval -> train each time, batches of 16 and a last one of 8) compile
    the same number of graphs. The first training record holds the first step's time (tracing included), far
    above the steady state's per-step time that its tokens/s leaves it out of."""
    counts, first_records = {}, {}
    for evals in (2, 6):
        torch._dynamo.reset()
        COMPILES.clear()
        torch.manual_seed(0)
        model = decoderlab.DecoderLabForCausalLM(
            decoderlab.DecoderLabConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        max_position_embeddings=64)
        )  # fmt: skip
        blocks = torch.randint(0, 50, (64, 16))
        cfg = TrainConfig(output_dir=str(tmp_path / str(evals)), max_train_steps=3 * evals + 1, eval_steps=3,
                          logging_steps=3, checkpointing_steps=None, num_warmup_steps=0, torch_compile=True,
                          torch_compile_backend="decoderlab_test_counting", per_device_train_batch_size=4,
                          per_device_eval_batch_size=16, max_eval_samples=40)  # fmt: skip
        result = train(model, BlockBatches(blocks[:48], 4, seed=0), blocks[48:], cfg, make_accelerator(cfg),
                       show_progress=False)  # fmt: skip
        assert len([r for r in result.history if "eval_loss" in r]) == evals + 1  # and the final one
        counts[evals] = len(COMPILES)
        first_records[evals] = [r for r in result.history if "train_loss" in r]
    torch._dynamo.reset()
    assert counts[2] == counts[6] and counts[2] >= 2  # a training graph, an evaluation graph (at least)
    for records in first_records.values():
        assert "first_step_s" in records[0] and not any("first_step_s" in r for r in records[1:])
        steady_step_s = 4 * 16 / records[0]["tokens_per_s"]  # a step's tokens over the steady rate
        assert records[0]["first_step_s"] > 5 * steady_step_s


@pytest.mark.slow
def test_the_default_recipe_run_past_its_best_saves_its_best(tmp_path):
    """training/configs/shakespeare_char.yaml as a user copies it, on a small text of their own (5,000 characters
    of Tiny Shakespeare, a validation text apart) for 400 steps, about 80 passes over the text, evaluated every 100:
    the validation loss has turned by the last step, and the folder holds the weights of the best evaluation, whose
    loss the saved model reproduces, not the last step's."""
    files = text_files_in(tmp_path, 5_000)
    out = tmp_path / "run"
    recipe = pathlib.Path(__file__).resolve().parents[1] / "training" / "configs" / "shakespeare_char.yaml"
    pretrain.main(["--config", str(recipe), "--dataset_name", "none", "--train_file", str(files[0]),
                   "--validation_file", str(files[1]), "--max_train_steps", "400", "--eval_steps", "100",
                   "--output_dir", str(out)])  # fmt: skip
    records = [r for r in metrics(out) if "eval_loss" in r]
    periodic, final = {r["step"]: r["eval_loss"] for r in records[:-1]}, records[-1]
    best = min(periodic, key=periodic.get)
    assert best < 400 and periodic[400] > periodic[best]  # the run went past its best
    assert final["best_global_step"] == best
    # every validation block is in the periodic evaluations here (fewer than max_eval_samples): the same loss
    assert final["eval_loss"] == pytest.approx(periodic[best], rel=1e-6)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor(tokenizer(files[1].read_text(), add_special_tokens=False)["input_ids"])
    blocks = ids[: len(ids) // 64 * 64].view(-1, 64)
    with torch.no_grad():
        saved = AutoModelForCausalLM.from_pretrained(out)(input_ids=blocks, labels=blocks).loss.item()
    assert saved == pytest.approx(periodic[best], rel=1e-5)
    assert f"| Saved weights: the best evaluation's step | {best} |" in (out / "README.md").read_text()
