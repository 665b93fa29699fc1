"""training/sampling.py: windows at every offset (``window_sampling``), seeded, resumable in constant time, per
process, never into the validation text; and a run that resumes with them repeats the uninterrupted losses.

The samplers are tested on their own (numbers in, window starts out), then through the real data paths
(``data.prepare_data`` on a text whose validation part is marked) and the real command (``pretrain.main``).
"""

import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.paths import INPUT_TXT, REPO_ROOT
from tests.training_runs import metrics, subprocess_env, train_losses
from training import data, prepare_data, pretrain
from training.args import TrainConfig
from training.data import BlockBatches, training_batches
from training.loop import make_accelerator
from training.preflight import preflight
from training.sampling import SAMPLERS, TokenWindows, WindowBatches
from training.token_shards import PreparedData

SAMPLINGS = sorted(SAMPLERS)  # permutation, random, shifted
PRETRAIN = REPO_ROOT / "training" / "pretrain.py"

pytestmark = pytest.mark.usefixtures("one_thread")


def windows(sampling: str, n_tokens: int = 400, block_size: int = 4, batch_size: int = 3, seed: int = 0,
            **shard) -> WindowBatches:  # fmt: skip
    """Batches of ``sampling`` over the tokens 0..n_tokens-1, so a window's first token is its start."""
    tokens = TokenWindows([torch.arange(n_tokens, dtype=torch.int32)])
    return WindowBatches(tokens, sampling, block_size, batch_size, seed, **shard)


def take(batches, start: int, n: int) -> list[torch.Tensor]:
    iterator = batches.iterate(start)
    return [next(iterator)["input_ids"] for _ in range(n)]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_windows_are_consecutive_tokens_that_are_also_the_labels(sampling):
    """Every window is block_size consecutive tokens of the text, the same tensor as its labels (the model
    shifts them), as a fixed block is."""
    batch = next(windows(sampling).iterate())
    assert batch["labels"] is batch["input_ids"] and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"] - batch["input_ids"][:, :1], torch.arange(4).expand(3, 4))


def test_window_starts_cover_every_offset_modulo_block_size():
    """Fixed blocks start only at multiples of block_size. 'permutation' starts one window at every offset in a
    pass over them (each once); 'random' reaches every offset modulo block_size within one epoch (as many windows
    as the text has tokens); 'shifted' starts each pass at one offset of its own, every token once a pass, and
    its passes together reach every offset modulo block_size."""
    block_size = 4
    fixed = BlockBatches(torch.arange(400).view(100, block_size), batch_size=3, seed=0)
    starts = torch.cat(take(fixed, 0, fixed.batches_per_epoch))[:, 0]
    assert set((starts % block_size).tolist()) == {0}

    permutation = windows("permutation")
    per_pass = permutation.sampler.batches_per_pass  # 397 offsets // 3 = 132 batches
    starts = torch.cat(take(permutation, 0, per_pass))[:, 0].tolist()
    assert len(starts) == len(set(starts)) == 396 and set(starts) <= set(range(397))

    random = windows("random")
    starts = torch.cat(take(random, 0, random.batches_per_epoch))[:, 0]
    assert set((starts % block_size).tolist()) == set(range(block_size))

    shifted = windows("shifted")
    per_pass = shifted.sampler.batches_per_pass  # 99 blocks a pass // 3 = 33 batches
    residues = set()
    for p in range(12):
        starts = torch.cat(take(shifted, p * per_pass, per_pass))[:, 0]
        assert len(set((starts % block_size).tolist())) == 1  # one offset for the whole pass
        assert len(set(starts.tolist())) == len(starts)  # no window twice in a pass
        residues |= set((starts % block_size).tolist())
    assert residues == set(range(block_size))


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_same_seed_same_windows_another_seed_other_windows(sampling):
    a, b, c = (take(windows(sampling, seed=seed), 0, 40) for seed in (5, 5, 6))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, z) for x, z in zip(a, c))


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_resume_at_any_batch_gives_the_uninterrupted_windows_without_replaying(sampling):
    """iterate(start=k) of a new object yields what an uninterrupted iteration yields from batch k on, across
    pass boundaries; batch 10**12 is computed at once (a replay would never end)."""
    straight = take(windows(sampling), 0, 300)  # passes of 132 (permutation) and 33 (shifted) batches
    for k in (1, 33, 131, 132, 200):
        assert all(torch.equal(x, y) for x, y in zip(straight[k:], take(windows(sampling), k, 300 - k))), k
    start = time.perf_counter()
    far = take(windows(sampling), 10**12, 2)
    assert time.perf_counter() - start < 1.0 and far[0].shape == (3, 4)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_processes_take_their_rows_of_one_global_batch_and_resume_with_another_count(sampling):
    """Two processes of batch 3 see, step by step, the 6 windows one process of batch 6 sees; a checkpoint of the
    two continues in one process of batch 6 (the same global batch), and another global batch, seed or sampling
    is refused by name, as is a checkpoint of fixed blocks."""
    single = take(windows(sampling, batch_size=6), 0, 50)
    ranks = [take(windows(sampling, batch_size=3, process_index=r, num_processes=2), 0, 50) for r in (0, 1)]
    for whole, a, b in zip(single, *ranks):
        assert torch.equal(whole, torch.cat([a, b]))
    saved = windows(sampling, batch_size=3, process_index=1, num_processes=2).state_dict(10)
    assert json.loads(json.dumps(saved)) == saved  # what a checkpoint's data_state_R.json holds
    windows(sampling, batch_size=6).load_state_dict(saved)
    with pytest.raises(ValueError, match="global_batch_size 6 in the checkpoint, 8 now"):
        windows(sampling, batch_size=8).load_state_dict(saved)
    with pytest.raises(ValueError, match="seed 0 in the checkpoint, 1 now"):
        windows(sampling, batch_size=6, seed=1).load_state_dict(saved)
    other = next(s for s in SAMPLINGS if s != sampling)
    with pytest.raises(ValueError, match=f"window_sampling='{sampling}' and this run's with window_sampling='{other}'"):
        windows(other, batch_size=6).load_state_dict(saved)
    blocks = BlockBatches(torch.zeros(100, 4), batch_size=6, seed=0)
    with pytest.raises(ValueError, match=f"Resume with --window_sampling {sampling}"):
        blocks.load_state_dict(saved)
    with pytest.raises(ValueError, match="drawn with window_sampling='blocks'.*Resume with --window_sampling blocks"):
        windows(sampling, batch_size=6).load_state_dict(blocks.state_dict(10))


def test_prepared_windows_read_the_training_shards_only(prepared):
    """From prepared shards, the windows' text is the training shards' tokens one after the other, across shard
    ends; the validation file is never among them."""
    shards = PreparedData(prepared)
    tokens = TokenWindows(shards.train_files)
    assert len(shards.train_files) == 8 and len(tokens) == shards.meta["train_tokens"]
    whole = np.concatenate(shards.train_files)
    starts = np.array([0, 2590, len(whole) - 16])  # 2590: across the first shard's end (2597 tokens)
    assert torch.equal(
        tokens.read(starts, 16), torch.from_numpy(whole[starts[:, None] + np.arange(16)].astype(np.int64))
    )


def test_windows_read_across_pieces_as_one_text():
    """Prepared shards are read one after the other: a window across two (or three) of them, or in an empty one,
    holds the tokens the concatenated text holds."""
    text = np.arange(40, dtype=np.uint16)
    pieces = [text[:15], text[15:15], text[15:17], text[17:]]
    starts = np.array([0, 10, 13, 14, 30, 34])
    assert torch.equal(TokenWindows(pieces).read(starts, 6), TokenWindows([text]).read(starts, 6))


def test_bad_window_input_is_refused_by_name():
    """A text shorter than one window, a text too short for one global batch of a pass, an unknown sampling, and
    windows asked of a stream are clear errors."""
    with pytest.raises(ValueError, match="holds 10 tokens, fewer than one window of block_size=16"):
        windows("random", n_tokens=10, block_size=16)
    with pytest.raises(ValueError, match="window_sampling='shifted' gets fewer windows of block_size=4 per pass"):
        windows("shifted", n_tokens=20, batch_size=8)
    with pytest.raises(ValueError, match="window_sampling must be one of 'blocks', 'random', 'shifted', 'permutation'"):
        TrainConfig(window_sampling="offsets")
    with pytest.raises(ValueError, match="a stream .* never holds: stream with window_sampling blocks"):
        preflight(TrainConfig(window_sampling="random", streaming=True))


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_no_training_window_holds_validation_tokens(tmp_path, sampling):
    """Without a validation split, the last blocks of the text validate (validation_split_percentage): no
    training window of any sampling holds one of their tokens, and windows reach the last training token. The
    validation part is written in capitals, the training part in lower case."""
    train = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1520))
    (tmp_path / "train.txt").write_text(train + "QWERTYUIOPASDFGHJKLZ" * 4)  # 1600 characters: 100 blocks of 16
    cfg = TrainConfig(dataset_name=None, train_file=str(tmp_path / "train.txt"), block_size=16,
                      validation_split_percentage=5, window_sampling=sampling, per_device_train_batch_size=4,
                      output_dir=str(tmp_path / "out"))  # fmt: skip
    tokenizer, batches, eval_blocks = data.prepare_data(cfg, make_accelerator(cfg))
    assert tokenizer.decode(eval_blocks.flatten().tolist()) == "QWERTYUIOPASDFGHJKLZ" * 4
    seen = torch.cat(take(batches, 0, 2000))  # (8000, 16): a pass of every offset; 85 of 'shifted'
    assert tokenizer.decode(seen.flatten().tolist()).islower()
    last = tokenizer(train[-16:], add_special_tokens=False)["input_ids"]
    assert last in seen.tolist()


def test_blocks_stay_todays_fixed_blocks():
    """window_sampling 'blocks' (every recipe's default unless it says otherwise) is today's BlockBatches."""
    blocks = torch.arange(200).view(50, 4)
    cfg = TrainConfig(per_device_train_batch_size=3, block_size=4)
    shard = dict(seed=1, process_index=0, num_processes=1)
    assert all(torch.equal(a, b) for a, b in
               zip(take(training_batches(cfg, blocks, shard), 0, 40), take(BlockBatches(blocks, 3, 1), 0, 40)))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Runs of the real command


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    corpus = INPUT_TXT.read_text(encoding="utf-8")
    folder = tmp_path_factory.mktemp("text")
    (folder / "train.txt").write_text(corpus[:20_000])
    (folder / "validation.txt").write_text(corpus[20_000:22_000])
    return folder / "train.txt", folder / "validation.txt"


def run_argv(text_files, output_dir, sampling: str, *extra: str) -> list[str]:
    train_file, validation_file = text_files
    return [
        "--dataset_name", "none", "--train_file", str(train_file), "--validation_file", str(validation_file),
        "--window_sampling", sampling, "--block_size", "16", "--per_device_train_batch_size", "4",
        "--learning_rate", "3e-3", "--num_warmup_steps", "2", "--logging_steps", "2", "--eval_steps", "none",
        "--checkpointing_steps", "6", "--checkpoints_total_limit", "5", "--max_train_steps", "12", "--seed", "0",
        "--model.hidden_size", "32", "--model.num_hidden_layers", "1", "--model.num_attention_heads", "2",
        "--output_dir", str(output_dir), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def prepared(text_files, tmp_path_factory) -> pathlib.Path:
    """The same text prepared into token shards of 100 lines each (8 shards: windows cross their ends)."""
    output = tmp_path_factory.mktemp("prepared") / "data"
    prepare_data.main(["--train_file", str(text_files[0]), "--validation_file", str(text_files[1]),
                       "--output_dir", str(output), "--documents_per_shard", "100"])  # fmt: skip
    return output


def source_argv(source: str, prepared: pathlib.Path) -> list[str]:
    return ["--prepared_data", str(prepared)] if source == "prepared" else []


@pytest.mark.parametrize("source, sampling", [("memory", "shifted"), ("prepared", "random")])
def test_resumed_run_repeats_the_uninterrupted_losses(tmp_path, text_files, prepared, source, sampling):
    """Resumed from its step-6 checkpoint in a new folder, a run with windows at every offset, in memory and from
    prepared shards, logs the uninterrupted run's losses at steps 8 to 12 (1e-6: same weights, optimizer, RNG and
    data position; the windows of step 7 on are computed from the step, not replayed)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    data = source_argv(source, prepared)
    pretrain.main(run_argv(text_files, straight, sampling, *data))
    assert json.loads((straight / "step_6" / "data_state_0.json").read_text())["window_sampling"] == sampling
    pretrain.main(run_argv(text_files, resumed, sampling, *data, "--resume_from_checkpoint", str(straight / "step_6")))
    expected, got = train_losses(straight), train_losses(resumed)
    assert sorted(got) == [8, 10, 12]
    for step in got:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step


def test_a_block_longer_than_the_text_stops_before_any_step(tmp_path, text_files):
    """--block_size longer than the training text, with windows at every offset: the data step's clear error, and
    no step logged."""
    with pytest.raises(ValueError, match="The train text is too short: it has 20000 tokens, fewer than 1 block"):
        pretrain.main(run_argv(text_files, tmp_path / "out", "random", "--block_size", "30000"))
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("source, sampling", [("memory", "shifted"), ("prepared", "permutation")])
def test_two_processes_resume_one_process_checkpoint_to_its_losses(tmp_path, text_files, prepared, source, sampling):
    """torchrun with 2 gloo processes of batch 2 resumes a one-process run of batch 4 (the same global batch) from
    its step-6 checkpoint and logs its losses at steps 8 to 12, in memory and from prepared shards: each process
    takes its rows of the same windows. Tolerance 1e-4: the all-reduce sums in another order than one batch does
    (as the two-process curve test in test_pretrain_training.py)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    data = source_argv(source, prepared)
    pretrain.main(run_argv(text_files, straight, sampling, *data))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv = run_argv(text_files, resumed, sampling, *data, "--per_device_train_batch_size", "2",
                    "--resume_from_checkpoint", str(straight / "step_6"))  # fmt: skip
    result = subprocess.run([*launcher, str(PRETRAIN), *argv], env=subprocess_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((resumed / "run_info.json").read_text())["num_processes"] == 2
    expected, got = train_losses(straight), train_losses(resumed)
    assert sorted(got) == [8, 10, 12]
    for step in got:
        assert got[step] == pytest.approx(expected[step], abs=1e-4), step
    assert len([r for r in metrics(resumed) if "train_loss" in r]) == 3
