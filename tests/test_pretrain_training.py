"""training/: the loop, crash-safe checkpoints, exact resume, two-process DDP, and the final checkpoint folder.

Runs use a tiny model (2 layers x 32 hidden) on 60,000 characters of Tiny Shakespeare, tens to a few
hundred steps, so each takes seconds. Single-process runs call ``training.pretrain.main`` in this
process; the SIGKILL and the two-process runs are subprocesses with the same thread count, so their
arithmetic is the same as in-process.
"""

import copy
import itertools
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import decoderlab
from tests.paths import REPO_ROOT
from tests.training_runs import (
    final_eval_loss,
    folder_snapshot,
    kill_when_saved,
    metrics,
    subprocess_env,
    text_files_in,
    train_losses,
    train_rows,
)
from training import checkpointing, loop, preflight, pretrain
from training.args import TrainConfig, parse_config
from training.checkpointing import TrainState, list_checkpoints, resolve_checkpoint, save_checkpoint, save_final_folder
from training.data import BlockBatches, train_char_tokenizer
from training.loop import (
    NonFiniteLossError,
    evaluate,
    make_accelerator,
    train,
)
from training.sharding import SHARDED_NAME

PRETRAIN = REPO_ROOT / "training" / "pretrain.py"
TINY_MODEL = ["--model.hidden_size", "32", "--model.num_hidden_layers", "2", "--model.num_attention_heads", "2"]


pytestmark = pytest.mark.usefixtures("one_thread")  # here and in the subprocesses: the same arithmetic


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    return text_files_in(tmp_path_factory.mktemp("text"), 60_000)


def tiny_argv(text_files, output_dir, *extra: str) -> list[str]:
    """A complete command line for a run that takes seconds."""
    train_file, validation_file = text_files
    return [
        "--dataset_name", "none", "--train_file", str(train_file), "--validation_file", str(validation_file),
        "--block_size", "16", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "64",
        "--learning_rate", "3e-3", "--num_warmup_steps", "5", "--logging_steps", "5", "--eval_steps", "20",
        "--checkpointing_steps", "10", "--checkpoints_total_limit", "50", "--seed", "0",
        "--output_dir", str(output_dir), *TINY_MODEL, *extra,
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The loop's parts


def test_evaluate_weights_every_predicted_token_once(tiny_model):
    """evaluate() equals the plain mean cross-entropy over every next-token prediction of every block,
    whatever the batch size (the last batch is smaller here)."""
    model = tiny_model()
    blocks = torch.randint(0, 99, (10, 12))
    accelerator = make_accelerator(TrainConfig())
    logits = model(input_ids=blocks).logits[:, :-1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 99), blocks[:, 1:].reshape(-1)).item()
    result = evaluate(model, blocks, batch_size=4, accelerator=accelerator)
    assert result["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)


class SecondOfTwoProcesses:
    """What evaluate() reads of an Accelerator, as process 1 of 2 sees it (the reduction left to the test)."""

    process_index, num_processes, device = 1, 2, torch.device("cpu")

    def reduce(self, tensor, reduction):
        return tensor


def test_evaluate_of_a_sharded_model_runs_as_many_batches_on_every_process(tiny_model, monkeypatch):
    """A sharded model's forward gathers weights from every process, so each process must run as many batches:
    with 5 blocks, batch 2 and 2 processes, process 1 holds blocks 1 and 3 (one batch) but runs two, the second
    weighing nothing, and its share of the loss is still exactly its own blocks' mean."""
    model = tiny_model()
    blocks = torch.randint(0, 99, (5, 12))
    logits = model(input_ids=blocks[1::2]).logits[:, :-1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 99), blocks[1::2, 1:].reshape(-1)).item()
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    monkeypatch.setattr(loop, "is_sharded", lambda _: True)
    result = evaluate(model, blocks, batch_size=2, accelerator=SecondOfTwoProcesses())
    assert len(forwards) == 2  # as many as process 0, which holds blocks 0, 2 and 4
    assert result["eval_loss"] == pytest.approx(expected, abs=1e-6)
    forwards.clear()
    monkeypatch.setattr(loop, "is_sharded", lambda _: False)
    assert evaluate(model, blocks, batch_size=2, accelerator=SecondOfTwoProcesses())["eval_loss"] == pytest.approx(
        expected, abs=1e-6
    )
    assert len(forwards) == 1  # unsharded: only its own


@pytest.fixture
def launch_env(monkeypatch):
    """No sharding variable from the test's own environment; the ones a test sets, and the one Accelerate's FSDP
    plugin writes (FSDP_CPU_RAM_EFFICIENT_LOADING), are restored afterwards."""
    for variable in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def test_fsdp_launch_that_cannot_shard_is_refused(launch_env):
    """An FSDP launch on CPU, where Accelerate would quietly run plain data parallelism (here: one process,
    distributed type NO), stops while the Accelerator is built, naming FSDP, what would have run instead, why,
    and the CPU data-parallel config to use."""
    launch_env.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --config_file fsdp.yaml` sets
    with pytest.raises(ValueError, match="asked for FSDP sharding") as error:
        make_accelerator(TrainConfig())
    message = str(error.value)
    assert "whole model (nothing sharded)" in message and "need a GPU-like device" in message
    assert "training/accelerate_configs/cpu_ddp.yaml" in message and "--fsdp true" in message


def test_deepspeed_launch_that_cannot_shard_is_refused(launch_env):
    """The same for DeepSpeed, and before Accelerate's own "DeepSpeed is not installed" (installing it would
    only lead to the unsharded run): a ValueError naming DeepSpeed, not an ImportError."""
    launch_env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="asked for DeepSpeed sharding") as error:
        make_accelerator(TrainConfig())
    assert "whole model (nothing sharded)" in str(error.value) and "cpu_ddp.yaml" in str(error.value)


def test_launch_without_sharding_is_unaffected(launch_env):
    """No sharding asked for, or the variables set to "false" (read as Accelerate reads them): the Accelerator
    is built as before."""
    assert make_accelerator(TrainConfig()).distributed_type == "NO"
    launch_env.setenv("ACCELERATE_USE_FSDP", "false")
    launch_env.setenv("ACCELERATE_USE_DEEPSPEED", "False")
    assert make_accelerator(TrainConfig()).distributed_type == "NO"


def test_bf16_refusal_stops_the_script_before_any_data(tmp_path, text_files, monkeypatch):
    """--mixed_precision bf16 on a CPU without bfloat16 instructions (oneDNN's answer replaced by "none"), through
    pretrain.py's main(): the pre-flight check stops it, and nothing is read or written (tests/test_preflight.py has
    the check itself, tests/test_cpu_features.py the same on a CPU held to AVX2)."""
    monkeypatch.setattr(preflight, "cpu_has_bf16", lambda: False)
    with pytest.raises(ValueError, match="without bfloat16 instructions"):
        pretrain.main(tiny_argv(text_files, tmp_path / "bf16", "--mixed_precision", "bf16"))
    assert not (tmp_path / "bf16").exists()


class ListBatches:
    """The loop's batch protocol over a fixed list of batches, repeated."""

    def __init__(self, batches: list[dict]):
        self.batches = batches

    def iterate(self, start: int = 0):
        for index in itertools.count(start):
            yield self.batches[index % len(self.batches)]


def padded_batch(lengths: list[int], width: int, vocab: int = 99) -> dict[str, torch.Tensor]:
    """Right-padded rows of the given lengths (every real token a target), cut to ``width`` columns."""
    input_ids = torch.randint(0, vocab, (len(lengths), width))
    attention_mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": input_ids.masked_fill(attention_mask == 0, -100),
    }


def test_tokens_count_the_real_tokens_of_every_micro_batch(tmp_path, tiny_model):
    """metrics.jsonl's tokens (and the final state's) are the non-padding tokens of every micro-batch seen,
    whatever the batches' widths: here 3 + 5 + 2 + 8 = 18 real tokens per two micro-batches of 16 and 24 slots."""
    batches = ListBatches([padded_batch([3, 5], width=8), padded_batch([2, 8, 1], width=8)])
    per_cycle = 3 + 5 + 2 + 8 + 1
    cfg = TrainConfig(output_dir=str(tmp_path), max_train_steps=6, logging_steps=2, eval_steps=None,
                      checkpointing_steps=None, num_warmup_steps=0)  # fmt: skip
    result = train(tiny_model(), batches, torch.randint(0, 99, (4, 8)), cfg, make_accelerator(cfg), show_progress=False)
    logged = {r["step"]: r["tokens"] for r in metrics(tmp_path) if "train_loss" in r}
    assert logged == {2: per_cycle, 4: 2 * per_cycle, 6: 3 * per_cycle}
    assert result.state.tokens == 3 * per_cycle
    assert result.history == metrics(tmp_path)  # the run's records, without reading the file back


def test_an_accumulated_step_is_the_full_batch_step(tmp_path, tiny_model):
    """Two micro-batches of 2 rows with 3 and 21 targets make the same optimizer step as one batch of the 4
    rows: the loss is the mean over all 24 targets of the step (not the mean of the two micro-batches' means,
    which weighs each of the 3 targets 7 times as much as each of the 21), and so are the gradients.

    AdamW's first step is lr * g / (|g| + eps); with eps = 1e4 >> |g| and lr = eps it moves each weight by
    -g (to 1e-4 relative), so equal weight updates mean equal gradients. Tolerance: float32 rounding of
    the sums, done in another order (1e-5 of updates about 1e-2).
    """
    short, long = padded_batch([2, 3], width=12), padded_batch([12, 11], width=12)  # 1 + 2 and 11 + 10 targets
    full = {name: torch.cat([short[name], long[name]]) for name in short}
    settings = dict(max_train_steps=1, logging_steps=1, eval_steps=None, checkpointing_steps=None,
                    num_warmup_steps=0, learning_rate=1e4, adam_epsilon=1e4, weight_decay=0.0, max_grad_norm=None)  # fmt: skip
    model = tiny_model().train()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    logits = model(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits[:, :-1]
    targets = full["labels"][:, 1:]
    expected_loss = torch.nn.functional.cross_entropy(logits[targets != -100], targets[targets != -100]).item()

    updates, losses = {}, {}
    for name, batches, accumulation in (("accumulated", [short, long], 2), ("full", [full], 1)):
        cfg = TrainConfig(output_dir=str(tmp_path / name), gradient_accumulation_steps=accumulation, **settings)
        run = copy.deepcopy(model)
        train(run, ListBatches(batches), full["input_ids"], cfg, make_accelerator(cfg), show_progress=False)
        updates[name] = {n: p.detach() - initial[n] for n, p in run.named_parameters()}
        losses[name] = [r["train_loss"] for r in metrics(tmp_path / name) if "train_loss" in r][0]
    assert losses["accumulated"] == pytest.approx(expected_loss, rel=1e-5)
    assert losses["full"] == pytest.approx(expected_loss, rel=1e-5)
    for name, update in updates["full"].items():
        torch.testing.assert_close(updates["accumulated"][name], update, rtol=1e-4, atol=1e-6, msg=name)


def test_interrupted_checkpoint_is_never_taken_for_a_complete_one(tmp_path, tiny_model, monkeypatch):
    """A save interrupted by an exception leaves nothing; one killed halfway leaves only step_N.tmp: 'latest' still
    resolves to the previous complete checkpoint, and the next save of that step replaces the leftover."""
    accelerator = make_accelerator(TrainConfig(output_dir=str(tmp_path)))
    model, optimizer = accelerator.prepare(tiny_model(), torch.optim.AdamW(tiny_model().parameters()))
    save_checkpoint(accelerator, tmp_path, TrainState(step=10))

    def dies_halfway(output_dir, **kwargs):
        pathlib.Path(output_dir).mkdir(parents=True, exist_ok=True)
        pathlib.Path(output_dir, "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(accelerator, "save_state", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(accelerator, tmp_path, TrainState(step=20))
    # an exception (Ctrl-C twice) removes the folder it interrupted; SIGKILL leaves it, as made here
    assert not (tmp_path / "step_20.tmp").exists() and not (tmp_path / "step_20").exists()
    (tmp_path / "step_20.tmp").mkdir()
    (tmp_path / "step_20.tmp" / "model.safetensors").write_bytes(b"partial")
    assert resolve_checkpoint("latest", tmp_path) == tmp_path / "step_10"
    monkeypatch.undo()
    save_checkpoint(accelerator, tmp_path, TrainState(step=20))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_10", "step_20"]
    assert not (tmp_path / "step_20.tmp").exists()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_checkpoint(str(tmp_path / "step_30"), tmp_path)


def test_final_folder_of_a_compiled_model_holds_the_models_own_weights(tmp_path, tiny_model):
    """A ``torch.compile`` wrapper prefixes every parameter name with ``_orig_mod.``; the final folder keeps
    the model's own names, so it loads back with exactly the trained weights."""
    model = tiny_model()
    accelerator = make_accelerator(TrainConfig(output_dir=str(tmp_path)))
    compiled = accelerator.prepare(torch.compile(model))  # compiled lazily: nothing runs here
    save_final_folder(accelerator, compiled, train_char_tokenizer(["abc"]), tmp_path, {}, {})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, text_files):
    """From the 26th training step on the final norm's output is NaN (so are the logits and the loss): the
    run stops at the next log (step 30) with a clear error naming the intact checkpoint (step_20), saves
    nothing after it, and step_20's weights are finite."""
    cfg = parse_config(TrainConfig, tiny_argv(text_files, tmp_path, "--max_train_steps", "60"))
    corpus = text_files[0].read_text()
    tokenizer = train_char_tokenizer([corpus])
    ids = torch.tensor(tokenizer(corpus, add_special_tokens=False)["input_ids"])
    blocks = ids[: len(ids) // 16 * 16].view(-1, 16)
    model = decoderlab.DecoderLabForCausalLM(
        decoderlab.DecoderLabConfig(
            vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2
        )
    )
    calls = []

    def poison(module, args, output):
        calls.extend([1] if module.training else [])  # count training steps, not evaluation batches
        return output * float("nan") if len(calls) > 25 else output

    model.model.norm.register_forward_hook(poison)
    accelerator = make_accelerator(cfg)
    with pytest.raises(NonFiniteLossError) as info:
        train(model, BlockBatches(blocks, 4, seed=0), blocks[:8], cfg, accelerator, show_progress=False)
    message = str(info.value)
    assert "The training loss is nan at step 30" in message
    assert "step_20, is intact" in message and "--learning_rate" in message
    assert [r["step"] for r in info.value.history if "train_loss" in r] == [5, 10, 15, 20, 25]  # up to the last good
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_10", "step_20"]
    assert not list(tmp_path.glob("*.tmp"))
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "step_20" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


# ----------------------------------------------------------------------------------------------
# Whole runs


@pytest.mark.slow
def test_pretrain_learns_and_leaves_a_loadable_checkpoint(tmp_path, text_files, capsys):
    """A short run lowers the loss and leaves a complete Hugging Face folder: AutoModelForCausalLM and
    AutoTokenizer load it, the loaded model reproduces the final validation loss, generate.py samples from
    it, and the folder records the resolved configuration, versions, commit, metrics and a model card."""
    out = tmp_path / "run"
    pretrain.main(tiny_argv(text_files, out, "--max_train_steps", "60"))
    losses = train_losses(out)
    evals = [r["eval_loss"] for r in metrics(out) if "eval_loss" in r]  # steps 20, 40 and the final one
    assert losses[60] < losses[5] - 0.5  # from about ln(65) = 4.2
    assert evals[0] > evals[1] > evals[2]

    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "training_config.yaml", "run_info.json", "metrics.jsonl", "README.md"):  # fmt: skip
        assert (out / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert isinstance(model, decoderlab.DecoderLabForCausalLM) and len(tokenizer) == model.config.vocab_size
    validation = text_files[1].read_text()
    ids = torch.tensor(tokenizer(validation, add_special_tokens=False)["input_ids"])
    blocks = ids[: len(ids) // 16 * 16].view(-1, 16)
    with torch.no_grad():
        loss = model(input_ids=blocks, labels=blocks).loss.item()
    assert loss == pytest.approx(final_eval_loss(out), rel=1e-5)

    info = json.loads((out / "run_info.json").read_text())
    assert (
        info["packages"]["torch"] == torch.__version__.split("+")[0] or info["packages"]["torch"] == torch.__version__
    )
    assert "commit" in info["git"] and info["num_processes"] == 1
    groups = {group["name"]: group for group in info["optimizer_groups"]}  # training.optim's split, with its rates
    assert list(groups) == ["matrices", "other"] and groups["matrices"]["weight_decay"] == 0.1
    assert groups["matrices"]["lr"] == groups["other"]["lr"] == 3e-3
    assert sum(g["parameters"] for g in groups.values()) == model.num_parameters()
    assert "matrices: lr 0.003, wd 0.1, " in (out / "README.md").read_text()
    resolved = yaml.safe_load((out / "training_config.yaml").read_text())
    assert TrainConfig(**resolved).max_train_steps == 60  # the saved configuration reproduces the run

    capsys.readouterr()
    from training import generate

    generate.main([str(out), "--prompt", "ROMEO:", "--max_new_tokens", "40", "--seed", "1337"])  # one known sample
    sample = capsys.readouterr().out
    # 40 sampled characters, fewer only if the model samples <|endoftext|> (it ends the text; not printed)
    assert sample.startswith("ROMEO:") and len("ROMEO:") < len(sample.rstrip("\n")) <= len("ROMEO:") + 40

    # --stop ends the (greedy, so repeatable) text right after the first occurrence of the stop string
    generate.main([str(out), "--prompt", "ROMEO:", "--max_new_tokens", "40", "--greedy"])
    full = capsys.readouterr().out[len("ROMEO:") : -1]  # print's newline removed
    stop = full[10:12]
    generate.main([str(out), "--prompt", "ROMEO:", "--max_new_tokens", "40", "--greedy", "--stop", stop])
    assert capsys.readouterr().out == "ROMEO:" + full[: full.index(stop) + len(stop)] + "\n"


def test_rerunning_a_finished_run_leaves_it_as_it_was_and_more_steps_continue_it(tmp_path, text_files, capsys):
    """The same command again (``--resume_from_checkpoint latest``) on a finished run says it is already
    finished, returns normally and rewrites nothing (no byte and no modification time changes); with a
    raised ``--max_train_steps`` it trains on from the last checkpoint instead."""
    out = tmp_path / "run"
    argv = tiny_argv(text_files, out, "--max_train_steps", "20", "--resume_from_checkpoint", "latest")
    pretrain.main(argv)
    finished = folder_snapshot(out)
    capsys.readouterr()

    pretrain.main(argv)
    assert "already finished at step 20" in capsys.readouterr().out
    assert folder_snapshot(out) == finished

    pretrain.main(tiny_argv(text_files, out, "--max_train_steps", "30", "--resume_from_checkpoint", "latest"))
    assert sorted(train_losses(out)) == [5, 10, 15, 20, 25, 30]  # the first run's records are kept
    assert json.loads((out / "step_30" / checkpointing.STATE_NAME).read_text())["tokens"] == 30 * 4 * 16


def test_training_on_from_a_checkpoint_keeps_its_tokenizer(tmp_path, text_files):
    """--model_name_or_path continues with the checkpoint's own tokenizer, so every token id keeps its meaning,
    here on lower-case text, whose own character vocabulary would number the characters differently; a
    checkpoint without a tokenizer is refused before anything is written."""
    base, more, refused = tmp_path / "base", tmp_path / "more", tmp_path / "refused"
    pretrain.main(tiny_argv(text_files, base, "--max_train_steps", "10"))
    lower = []
    for path in text_files:
        lower.append(tmp_path / f"lower_{path.name}")
        lower[-1].write_text(path.read_text().lower())

    def from_base(out, base) -> list[str]:  # the checkpoint's architecture: --model.FIELD flags would be refused
        argv = tiny_argv(lower, out, "--max_train_steps", "10", "--model_name_or_path", str(base))
        start = argv.index(TINY_MODEL[0])
        return argv[:start] + argv[start + len(TINY_MODEL) :]

    pretrain.main(from_base(more, base))
    assert AutoTokenizer.from_pretrained(more).get_vocab() == AutoTokenizer.from_pretrained(base).get_vocab()
    assert train_losses(more)[5] < train_losses(base)[5] - 0.2  # the weights carry over too

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((base / name).read_bytes())
    with pytest.raises(ValueError, match="has no tokenizer: none of tokenizer.json"):
        pretrain.main(from_base(refused, bare))
    assert not refused.exists()


def test_muon_run_accumulates_resumes_exactly_and_records_its_groups(tmp_path, text_files):
    """--optimizer muon through the whole loop (training.optim.MuonWithAdamW: torch's Muon for the blocks' matrices,
    AdamW for the rest):

    - gradient accumulation: 2 micro-batches of 4 make the steps one batch of 8 makes (the same mean gradient;
      only the order of float32 sums differs, which bfloat16's Newton-Schulz mostly rounds away: 1e-4 on losses);
    - exact resume: a run resumed from the reference run's step_10 logs its losses and final evaluation (1e-6,
      float formatting): the checkpoint holds Muon's momentum beside AdamW's moments, and the schedule;
    - the record: run_info.json and the card name each group with its optimizer, rate and size, and
      training_config.yaml reads back as the TrainConfig that ran (optimizer muon)."""
    steps = ["--max_train_steps", "20", "--checkpointing_steps", "10", "--eval_steps", "10", "--optimizer", "muon"]
    reference, accumulated, resumed = tmp_path / "reference", tmp_path / "accumulated", tmp_path / "resumed"
    pretrain.main(tiny_argv(text_files, reference, *steps, "--per_device_train_batch_size", "8"))
    pretrain.main(tiny_argv(text_files, accumulated, *steps, "--gradient_accumulation_steps", "2"))
    resume = ["--resume_from_checkpoint", str(reference / "step_10"), "--per_device_train_batch_size", "8"]
    pretrain.main(tiny_argv(text_files, resumed, *steps, *resume))

    expected = train_losses(reference)
    for step, loss in train_losses(accumulated).items():
        assert loss == pytest.approx(expected[step], abs=1e-4), step
    continued = train_losses(resumed)
    assert sorted(continued) == [15, 20]
    for step in continued:
        assert continued[step] == pytest.approx(expected[step], abs=1e-6), step
    assert final_eval_loss(resumed) == pytest.approx(final_eval_loss(reference), abs=1e-6)
    # the health figures go on across the resume: the spike count and its running mean are in the checkpoint
    for step, row in train_rows(resumed).items():
        for key in ("loss_spikes", "flops", "tokens"):
            assert row[key] == train_rows(reference)[step][key], (step, key)
        assert row["grad_norm"] == pytest.approx(train_rows(reference)[step]["grad_norm"], rel=1e-4), step

    groups = {g["name"]: g for g in json.loads((reference / "run_info.json").read_text())["optimizer_groups"]}
    assert list(groups) == ["matrices", "other", "muon_matrices"]  # the untied head is AdamW's, with decay
    assert groups["muon_matrices"]["optimizer"] == "muon" and groups["muon_matrices"]["lr"] == 0.02
    assert groups["muon_matrices"]["tensors"] == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    assert {groups[name]["optimizer"] for name in ("matrices", "other")} == {"adamw"}
    assert "muon_matrices (Muon): lr 0.02, wd 0, " in (reference / "README.md").read_text()
    recorded = (reference / "training_config.yaml").read_text()
    resolved = TrainConfig(**yaml.safe_load(recorded))
    assert resolved.optimizer == "muon" and resolved.muon_learning_rate == 0.02
    assert recorded.startswith("# Optimizer groups of this run (training/optim.py's rules; a record, not a setting):\n")
    assert "\n#   muon_matrices: Muon, lr 0.02, wd 0, " in recorded and " parameters in 14 tensors\n" in recorded


def test_every_row_carries_the_runs_health_and_cost_to_the_trackers(tmp_path, text_files):
    """A short run through pretrain.py with --with_tracking: every training row of metrics.jsonl (those of logging
    steps, of an unaligned checkpoint and of the last step) carries the gradient norm, the FLOPs so far (FLOPs per
    token x the tokens), the MFU, the spike count and each optimizer group's update ratio; TensorBoard's event file,
    which Accelerate's tracker writes, holds every one of them at the same steps; run_info.json and the card record
    the FLOPs."""
    out = tmp_path / "run"
    pretrain.main(tiny_argv(text_files, out, "--max_train_steps", "8", "--logging_steps", "3", "--checkpointing_steps",
                            "4", "--eval_steps", "none", "--with_tracking", "--report_to", "tensorboard"))  # fmt: skip
    rows = list(train_rows(out).values())
    assert [r["step"] for r in rows] == [3, 4, 6, 8]
    info = json.loads((out / "run_info.json").read_text())
    fpt = info["compute"]["flops_per_token"]
    health = ["grad_norm", "flops", "mfu", "loss_spikes", "update_rms/matrices", "update_rms/other"]
    for row in rows:
        assert all(key in row for key in health), row
        assert row["grad_norm"] > 0 and 0 < row["mfu"] < 1 and row["loss_spikes"] >= 0, row
        assert row["flops"] == fpt * row["tokens"] and 0 < row["update_rms/matrices"] < 1, row
    assert info["compute"]["flops"] == fpt * rows[-1]["tokens"] and info["compute"]["peak_flops"] > 0
    assert "| Training compute (FLOPs) |" in (out / "README.md").read_text()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "decoderlab"))
    events.Reload()
    for key in health:
        logged = {e.step: e.value for e in events.Scalars(key)}
        assert logged == pytest.approx({r["step"]: r[key] for r in rows}, rel=1e-6), key


def test_a_run_sized_by_its_budget_records_where_its_steps_came_from(tmp_path, text_files):
    """--tokens_per_parameter with --max_train_steps none: the run trains the steps that see that many tokens per
    parameter (all parameters, rounded up to whole steps), and training_config.yaml (in a comment: the file still
    reads back as the settings that ran), run_info.json and the model card say the steps came from the budget."""
    out = tmp_path / "run"
    pretrain.main(tiny_argv(text_files, out, "--max_train_steps", "none", "--tokens_per_parameter", "0.02",
                            "--eval_steps", "none"))  # fmt: skip
    budget = json.loads((out / "run_info.json").read_text())["budget"]
    parameters = AutoModelForCausalLM.from_pretrained(out).num_parameters()
    assert budget["parameters"] == parameters and budget["tokens_per_step"] == 4 * 16
    assert budget["max_train_steps"] == math.ceil(0.02 * parameters / (4 * 16))
    assert max(r["step"] for r in metrics(out)) == budget["max_train_steps"]
    recorded = (out / "training_config.yaml").read_text()
    assert f"#   {budget['max_train_steps']} steps = tokens_per_parameter 0.02 x {parameters:,} parameters" in recorded
    assert TrainConfig(**yaml.safe_load(recorded)).max_train_steps is None
    assert f"| Steps from the budget | {budget['max_train_steps']} steps = tokens_per_parameter" in (
        out / "README.md"
    ).read_text()


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_same_losses(tmp_path, text_files):
    """A run killed with SIGKILL mid-training and resumed with --resume_from_checkpoint latest logs the same
    training losses and final validation loss as an uninterrupted run with the same seed.

    Tolerance: none beyond float formatting. The checkpoint restores the weights, AdamW's moments,
    the schedule, the RNG states and the data position exactly, and fp32 arithmetic on CPU with the
    same thread count is deterministic, so the resumed run repeats the same operations on the same
    numbers; 1e-6 only allows for a last-bit difference should a kernel reorder a reduction.
    """
    steps = ["--max_train_steps", "300", "--checkpointing_steps", "25", "--eval_steps", "100"]
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    pretrain.main(tiny_argv(text_files, reference, *steps))

    command = [sys.executable, str(PRETRAIN), *tiny_argv(text_files, interrupted, *steps)]
    kill_when_saved(command, interrupted / "step_50")
    killed_at = max(int(p.name.split("_")[1]) for p in list_checkpoints(interrupted))
    assert killed_at < 300, "the kill came after the last checkpoint: nothing was resumed"

    pretrain.main(tiny_argv(text_files, interrupted, *steps, "--resume_from_checkpoint", "latest"))
    expected, resumed = train_losses(reference), train_losses(interrupted)
    assert sorted(resumed) == sorted(expected)  # every logged step once: none lost, none repeated
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], abs=1e-6), step
    assert final_eval_loss(interrupted) == pytest.approx(final_eval_loss(reference), abs=1e-6)
    assert json.loads((interrupted / "step_300" / checkpointing.STATE_NAME).read_text())["tokens"] == 300 * 4 * 16


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_processes_follow_the_single_process_curve(tmp_path, text_files, optimizer):
    """torchrun with 2 gloo processes of batch 4 is data-parallel (gradients averaged every step) and so
    follows one process with batch 8: the same blocks per step (BlockBatches) and the same mean gradient; with
    Muon too (every process orthogonalises the same averaged gradient).

    Tolerance 1e-4 on losses of ~2-4: the only differences are the order of floating-point sums (the
    all-reduce vs. one batch), ~1e-7 relative per step, growing slowly over 30 steps. Processes training
    independently (no gradient exchange) would drift apart by ~1e-2 within these steps.
    """
    steps = ["--max_train_steps", "30", "--checkpointing_steps", "none", "--eval_steps", "none", "--optimizer", optimizer]
    single, parallel = tmp_path / "single", tmp_path / "parallel"
    pretrain.main(tiny_argv(text_files, single, *steps, "--per_device_train_batch_size", "8"))
    env = subprocess_env()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*launcher, str(PRETRAIN), *tiny_argv(text_files, parallel, *steps)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads((parallel / "run_info.json").read_text())
    assert info["num_processes"] == 2 and info["distributed_type"] == "DistributedType.MULTI_CPU"
    expected, got = train_losses(single), train_losses(parallel)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-4), step
    assert final_eval_loss(parallel) == pytest.approx(final_eval_loss(single), abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fsdp_shards_follows_one_process_resumes_exactly_and_writes_the_same_folder(tmp_path, text_files, optimizer):
    """--fsdp under torchrun, 2 gloo processes of batch 4 (torch's FSDP2, each decoder layer one unit) against one
    process of batch 8, 20 steps with a checkpoint at step 10, then a second launch resumed from that checkpoint;
    with AdamW, and with Muon for the blocks' matrices (torch.optim.Muon has no code for sharded parameters: its
    Newton-Schulz products run on FSDP's DTensor shards, and DTensor gathers what each product needs, so every
    process orthogonalises the whole update, as one process does).

    - Sharded: step_10 holds no whole weights, only torch.distributed.checkpoint shards, two per weight and per
      optimizer state (AdamW's moments, Muon's momentum) (one from each process) for every decoder layer.
    - Follows one process: FSDP reduce-scatters the mean gradient of the same 8 blocks per step (BlockBatches), so
      only the order of float32 sums differs (about 1e-7 relative per step, 4e-7 measured over 20 steps);
      tolerance 1e-4 on losses of 3-4, as for DDP. Processes without gradient exchange drift by about 1e-2.
    - Resumes exactly: the resumed run logs the uninterrupted run's losses to 1e-6 (same shards, same RNG, same
      data position).
    - The whole model's health: each row's gradient norm (the shards' norms combined) and each group's update ratio
      (the shards' squares summed over processes) are one process's: to 1e-5 with AdamW (3e-7 measured); with Muon,
      whose bfloat16 products round apart on shards (below), to 1e-3 on the norm and 1e-2 on the ratios (3e-4 and
      1.8e-3 measured).
    - The same folder: the files a one-process run writes, config, generation config and tokenizer byte for byte,
      the weights within 1e-5, and from_pretrained loads it."""
    steps = ["--max_train_steps", "20", "--checkpointing_steps", "10", "--eval_steps", "10", "--optimizer", optimizer]
    single, sharded, resumed = tmp_path / "single", tmp_path / "sharded", tmp_path / "resumed"
    pretrain.main(tiny_argv(text_files, single, *steps, "--per_device_train_batch_size", "8"))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    fsdp_run = [*launcher, str(PRETRAIN), *tiny_argv(text_files, sharded, *steps, "--fsdp", "true")]
    result = subprocess.run(fsdp_run, env=subprocess_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    resume = ["--resume_from_checkpoint", str(sharded / "step_10")]
    resumed_run = [*launcher, str(PRETRAIN), *tiny_argv(text_files, resumed, *steps, "--fsdp", "true", *resume)]
    result = subprocess.run(resumed_run, env=subprocess_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]

    checkpoint = sharded / "step_10"
    assert not list(checkpoint.glob("*.safetensors")) and not list(checkpoint.glob("*.bin"))
    metadata = dcp.FileSystemReader(checkpoint / SHARDED_NAME).read_metadata().state_dict_metadata
    for layer in range(2):
        for name in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            key = f"model.layers.{layer}.{name}"
            moments = ["momentum_buffer"] if optimizer == "muon" and "proj" in name else ["exp_avg", "exp_avg_sq"]
            for stored in (f"model.{key}", *(f"optimizer.state.{key}.{moment}" for moment in moments)):
                assert len(metadata[stored].chunks) == 2, stored

    expected, got = train_losses(single), train_losses(sharded)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-4), step
    assert final_eval_loss(sharded) == pytest.approx(final_eval_loss(single), abs=1e-4)
    continued = train_losses(resumed)
    assert sorted(continued) == [15, 20]
    for step in continued:
        assert continued[step] == pytest.approx(got[step], abs=1e-6), step
    assert final_eval_loss(resumed) == pytest.approx(final_eval_loss(sharded), abs=1e-6)
    one, two = train_rows(single), train_rows(sharded)
    norm_rel, ratio_rel = (1e-5, 1e-5) if optimizer == "adamw" else (1e-3, 1e-2)
    for step, row in one.items():
        assert two[step]["grad_norm"] == pytest.approx(row["grad_norm"], rel=norm_rel), step
        ratios = {key: value for key, value in row.items() if key.startswith("update_rms/")}
        assert ratios and set(ratios) == {key for key in two[step] if key.startswith("update_rms/")}, step
        for key, value in ratios.items():
            assert two[step][key] == pytest.approx(value, rel=ratio_rel), (step, key)

    final_files = lambda folder: sorted(p.name for p in folder.iterdir() if p.is_file())  # noqa: E731
    assert final_files(sharded) == final_files(single)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (sharded / name).read_bytes() == (single / name).read_bytes(), name
    assert json.loads((sharded / "run_info.json").read_text())["num_processes"] == 2
    assert yaml.safe_load((sharded / "training_config.yaml").read_text())["fsdp"] is True
    single_model = AutoModelForCausalLM.from_pretrained(single)
    sharded_model = AutoModelForCausalLM.from_pretrained(sharded)
    assert type(sharded_model) is type(single_model)
    single_weights = single_model.state_dict()
    # Muon's Newton-Schulz products run in bfloat16, and DTensor splits them into partial products that round apart:
    # the same orthogonalisation up to that rounding (about 1.5% of the update either way), 3.6e-3 on the weights
    # after 20 steps of about 4e-3 each (measured), while the losses above agree to 1e-4
    atol = 1e-5 if optimizer == "adamw" else 1e-2
    for name, weight in sharded_model.state_dict().items():
        torch.testing.assert_close(weight, single_weights[name], rtol=0, atol=atol, msg=name)


@pytest.mark.slow
def test_fsdp_config_on_cpus_stops_before_training(tmp_path, text_files):
    """`accelerate launch --config_file training/accelerate_configs/fsdp.yaml --num_processes 2` on a machine
    without GPUs used to train 2 DDP processes (MULTI_CPU, the model whole on each) and exit 0 without a word
    about sharding. Now it exits non-zero with the reason, before reading data or writing anything."""
    output_dir = tmp_path / "fsdp"
    config = REPO_ROOT / "training" / "accelerate_configs" / "fsdp.yaml"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                "--num_processes", "2", "--mixed_precision", "no"]  # fmt: skip
    steps = ["--max_train_steps", "3", "--checkpointing_steps", "none", "--eval_steps", "none"]
    result = subprocess.run(
        [*launcher, str(PRETRAIN), *tiny_argv(text_files, output_dir, *steps)],
        env=subprocess_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode != 0
    assert "asked for FSDP sharding" in result.stderr, result.stderr[-3000:]
    assert "MULTI_CPU: 2 data-parallel processes on cpu" in result.stderr
    assert "cpu_ddp.yaml" in result.stderr
    assert not output_dir.exists()  # no checkpoint, no metrics, no final folder
