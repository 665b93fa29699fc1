"""training/prepare_data.py and training/token_shards.py: token shards written once, read through np.memmap.

The corpus is laid out like FineWeb-Edu (``tests/corpus.py``: 14 parquet files, documents named by their tags in
every block), prepared by the real command in this process (its tokenizing in forked worker processes).
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tests.corpus import tags, write_fineweb_like
from tests.paths import REPO_ROOT
from tests.training_runs import kill_when_saved, metrics, subprocess_env, train_losses
from training import prepare_data, pretrain
from training.args import TrainConfig
from training.data import BlockBatches, Packing, StreamBatches, load_text_splits, prepare_streaming
from training.loop import make_accelerator
from training.token_shards import META_NAME, PreparedData, prepared_batches, tokenizer_hash

PREPARE = REPO_ROOT / "training" / "prepare_data.py"
FILES, PER_FILE = 14, 40
N_DOCS = FILES * PER_FILE
HELD_OUT = round(N_DOCS * 5 / 100)  # validation_split_percentage's default: the last 28 documents

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[pathlib.Path, list[str]]:
    folder = tmp_path_factory.mktemp("fineweb_like")
    return folder, write_fineweb_like(folder, files=FILES, documents_per_file=PER_FILE)


def prepare_argv(dataset: pathlib.Path, output: pathlib.Path, *extra: str) -> list[str]:
    return ["--dataset_name", str(dataset), "--output_dir", str(output), "--tokenizer_type", "char",
            "--documents_per_shard", "100", "--preprocessing_num_workers", "2", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> pathlib.Path:
    output = tmp_path_factory.mktemp("prepared") / "data"
    prepare_data.main(prepare_argv(corpus[0], output))
    return output


def test_shards_hold_each_training_document_once_then_end_of_text(corpus, prepared):
    """Each training shard is its 100 documents' character ids, each document followed by the end-of-text token,
    as uint16 (the same ids the tokenizer gives); the validation shard is the last 5% of the documents, whole, and
    no training shard holds them; meta.json counts tokens and documents and names the tokenizer by its hash; no
    temporary file is left."""
    _, documents = corpus
    meta = json.loads((prepared / META_NAME).read_text())
    tokenizer = AutoTokenizer.from_pretrained(prepared / "tokenizer")
    eos = tokenizer.eos_token_id

    def ids_of(texts: list[str]) -> list[int]:
        return [i for text in texts for i in tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]]

    training = documents[: N_DOCS - HELD_OUT]
    assert meta["dtype"] == "uint16" and len(meta["train"]) == 6  # 532 documents in shards of 100
    for k, info in enumerate(meta["train"]):
        shard = np.fromfile(prepared / info["file"], dtype=np.uint16)
        assert shard.tolist() == ids_of(training[k * 100 : (k + 1) * 100]), k
        assert info["tokens"] == len(shard) and info["documents"] == len(training[k * 100 : (k + 1) * 100])
    validation = np.fromfile(prepared / "validation.bin", dtype=np.uint16)
    assert validation.tolist() == ids_of(documents[N_DOCS - HELD_OUT :])
    assert meta["validation"]["documents"] == HELD_OUT and meta["train_documents"] == N_DOCS - HELD_OUT
    assert meta["train_tokens"] == sum(len(ids_of([d])) for d in training)
    assert meta["tokenizer_hash"] == tokenizer_hash(tokenizer)
    assert meta["source"]["dataset_name"] == str(corpus[0])
    assert not list(prepared.rglob("*.tmp"))


def test_a_streamed_source_is_prepared_one_shard_per_file(corpus, tmp_path):
    """--streaming true (FineWeb-Edu's case: nothing downloaded up front): one shard per parquet file, written by
    the worker processes; the first 20 documents of the stream validate and are in no shard; every other document
    is in its file's shard, in order, once. The BPE is learnt from a sample of every file."""
    dataset, documents = corpus
    argv = ["--dataset_name", str(dataset), "--output_dir", str(tmp_path / "data"), "--streaming", "true",
            "--streaming_validation_texts", "20", "--tokenizer_type", "bpe", "--bpe_vocab_size", "400",
            "--tokenizer_train_texts", "140", "--preprocessing_num_workers", "2"]  # fmt: skip
    meta = prepare_data.main(argv)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "data" / "tokenizer")
    assert len(meta["train"]) == FILES and meta["validation"]["documents"] == 20
    for f, info in enumerate(meta["train"]):
        ids = np.fromfile(tmp_path / "data" / info["file"], dtype=np.uint16).tolist()
        texts = tokenizer.decode(ids).split("<|endoftext|>")[:-1]
        assert texts == [d for d in documents[f * PER_FILE : (f + 1) * PER_FILE] if d not in documents[:20]], f
    validation = tokenizer.decode(np.fromfile(tmp_path / "data" / "validation.bin", dtype=np.uint16).tolist())
    assert validation.split("<|endoftext|>")[:-1] == documents[:20]


def epoch_tags(batches: BlockBatches | StreamBatches, tokenizer) -> set[int]:
    """The documents named in one epoch of one process's training blocks."""
    if isinstance(batches, BlockBatches):
        iterator = batches.iterate()
        blocks = [next(iterator)["input_ids"] for _ in range(batches.batches_per_epoch)]
    else:
        start = {"epoch": 0, "window": 0, "dataset": None, "leftover": []}
        blocks = []
        for state, window in batches.windows(start):
            if state["epoch"] > 0:
                break
            blocks.append(torch.from_numpy(window))
    return set().union(*(tags(tokenizer.decode(row)) for block in blocks for row in block.tolist()))


@pytest.mark.parametrize("num_processes", [1, 2, 3])
def test_no_validation_document_in_any_process_training_batches(corpus, prepared, num_processes):
    """For 1, 2 and 3 processes, over one epoch of every process's batches: prepared shards (the last 28 documents
    validate) and the stream (its first 20 documents validate; 14 files split by file over 2 processes and by
    document over 3) never put a validation document in a training block, and together the processes train on
    the other documents (every one whose blocks survive the epoch's cut)."""
    dataset, documents = corpus
    data = PreparedData(prepared)
    tokenizer = data.tokenizer
    validation_tags = set(range(N_DOCS - HELD_OUT, N_DOCS))
    seen = set()
    for rank in range(num_processes):
        batches = BlockBatches(data.train_blocks(64), 4, seed=0, process_index=rank, num_processes=num_processes)
        seen |= epoch_tags(batches, tokenizer)
    assert not seen & validation_tags
    assert len(seen) > 0.95 * (N_DOCS - HELD_OUT)

    cfg = TrainConfig(dataset_name=str(dataset), streaming=True, streaming_validation_texts=20, block_size=64)
    train, validation = load_text_splits(cfg)
    texts, eval_blocks = prepare_streaming(train, validation, tokenizer, Packing.of(cfg), validation_texts=20)
    assert tags(tokenizer.decode(eval_blocks.flatten().tolist())) == set(range(20))
    seen = set()
    for rank in range(num_processes):
        stream = StreamBatches(texts, tokenizer, Packing.of(cfg), 4, seed=0, process_index=rank,
                               num_processes=num_processes, shuffle_buffer_size=50)  # fmt: skip
        seen |= epoch_tags(stream, tokenizer)
    assert not seen & set(range(20))
    assert seen == set(range(20, N_DOCS))


def test_training_from_prepared_shards_equals_training_in_memory(tmp_path):
    """Tiny Shakespeare prepared into shards trains to the same losses as the in-memory path of `make demo` (the
    same blocks in the same order: the same token stream cut into the same blocks, and BlockBatches' order); each
    training record of metrics.jsonl says how long the process waited for its batches (data_wait_s)."""
    from tests.paths import SHARED_DATA

    dataset = str(SHARED_DATA / "tiny_shakespeare")
    prepare_data.main(["--dataset_name", dataset, "--output_dir", str(tmp_path / "data")])
    tiny = ["--model.hidden_size", "32", "--model.num_hidden_layers", "1", "--model.num_attention_heads", "2",
            "--max_train_steps", "10", "--logging_steps", "5", "--eval_steps", "none", "--max_eval_samples", "64",
            "--checkpointing_steps", "none"]  # fmt: skip
    pretrain.main(["--dataset_name", dataset, "--output_dir", str(tmp_path / "memory"), *tiny])
    pretrain.main(["--prepared_data", str(tmp_path / "data"), "--output_dir", str(tmp_path / "shards"), *tiny])
    assert train_losses(tmp_path / "shards") == train_losses(tmp_path / "memory")
    records = [r for r in metrics(tmp_path / "shards") if "train_loss" in r]
    assert all(0 <= r["data_wait_s"] < r["elapsed_s"] for r in records)  # the wait for batches, per record


def test_unfinished_or_changed_preparations_are_refused(corpus, prepared, tmp_path):
    """A folder without meta.json (a preparation killed or still running) is refused for training; a shard that is
    missing or truncated is named, never read; preparing into a folder made with other settings names them."""
    with pytest.raises(ValueError, match="has no meta.json \\(nothing prepared\\)"):
        PreparedData(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in prepared.iterdir():
        if path.is_file():
            (copy / path.name).write_bytes(path.read_bytes())
    (copy / "train-00003.bin").write_bytes((prepared / "train-00003.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match=f"Shard {copy / 'train-00003.bin'} is \\d+ bytes, but meta.json records"):
        PreparedData(copy)
    (copy / "train-00003.bin").unlink()
    with pytest.raises(ValueError, match=f"Shard {copy / 'train-00003.bin'} is missing"):
        PreparedData(copy)
    (copy / META_NAME).unlink()
    with pytest.raises(ValueError, match="its preparation has not finished"):
        PreparedData(copy)
    with pytest.raises(ValueError, match="prepared with other settings \\(dtype: 'uint16' there, 'uint32' now"):
        prepare_data.main(prepare_argv(corpus[0], prepared, "--token_dtype", "uint32"))


def test_tokenizer_other_than_the_datas_is_refused_naming_both_hashes(prepared, tmp_path):
    """Training on prepared shards with another tokenizer (the config's --tokenizer_name, or a resumed checkpoint's;
    here a character vocabulary of other text) stops before any step, naming the data's tokenizer hash and the
    other's."""
    from training.data import train_char_tokenizer

    other = train_char_tokenizer(["other text"])
    other.save_pretrained(tmp_path / "other")
    output = tmp_path / "run"
    ours, theirs = tokenizer_hash(PreparedData(prepared).tokenizer)[:16], tokenizer_hash(other)[:16]
    with pytest.raises(
        ValueError, match=f"tokenized with tokenizer {ours}, but --tokenizer_name .* tokenizer is {theirs}"
    ):
        pretrain.main(["--prepared_data", str(prepared), "--output_dir", str(output), "--tokenizer_type",
                       "pretrained", "--tokenizer_name", str(tmp_path / "other")])  # fmt: skip
    assert not (output / "metrics.jsonl").exists()
    checkpoint = tmp_path / "step_10"  # what a checkpoint of a run on other data holds: its tokenizer
    other.save_pretrained(checkpoint)
    cfg = TrainConfig(prepared_data=str(prepared), output_dir=str(output))
    with pytest.raises(ValueError, match=f"tokenizer {ours}, but the checkpoint {checkpoint}'s tokenizer is {theirs}"):
        prepared_batches(cfg, make_accelerator(cfg), checkpoint=checkpoint)


def test_bad_corpora_are_refused_before_any_step(tmp_path):
    """An empty corpus (documents without text: no character vocabulary to build, or, with a given tokenizer, no
    token to train on), a vocabulary too large for the requested dtype, and a corpus shorter than one global batch:
    each a ValueError saying what is wrong and what to do, before anything trains. (A dataset of no rows at all
    does not load: datasets stops first.)"""
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": ""}\n{"text": ""}\n')
    with pytest.raises(ValueError, match="Cannot build a character vocabulary from empty text"):
        prepare_data.main(["--train_file", str(empty), "--output_dir", str(tmp_path / "e1")])
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000}, "w0"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=big, eos_token="<|endoftext|>").save_pretrained(tmp_path / "big")
    words = tmp_path / "words.jsonl"
    words.write_text("".join(json.dumps({"text": f"w{i} w{i + 1}"}) + "\n" for i in range(40)))
    base = ["--train_file", str(words), "--tokenizer_type", "pretrained", "--tokenizer_name", str(tmp_path / "big")]
    with pytest.raises(ValueError, match="--token_dtype uint16 holds ids up to 65535, but the tokenizer has 70001"):
        prepare_data.main([*base, "--output_dir", str(tmp_path / "e2"), "--token_dtype", "uint16"])
    meta = prepare_data.main([*base, "--output_dir", str(tmp_path / "ok")])
    assert meta["dtype"] == "uint32"  # auto: the vocabulary needs it
    with pytest.raises(ValueError, match="Only 57 training blocks, fewer than one global batch of 64"):
        pretrain.main(["--prepared_data", str(tmp_path / "ok"), "--output_dir", str(tmp_path / "run"),
                       "--block_size", "2", "--per_device_train_batch_size", "64"])  # fmt: skip
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match="hold no tokens \\(empty corpus"):
        prepare_data.main([*base[:1], str(empty), *base[2:], "--output_dir", str(tmp_path / "e4")])


@pytest.mark.slow
def test_killed_preparation_resumes_at_the_missing_shards(corpus, tmp_path):
    """prepare_data.py killed with SIGKILL while writing its shards (one process, 140 shards of 4 documents) leaves
    no meta.json, so training refuses the folder; run again, it keeps the shards written before the kill (not
    rewritten: same modification times) and ends with the same files as a preparation never interrupted."""
    argv = ["--dataset_name", str(corpus[0]), "--tokenizer_type", "char", "--documents_per_shard", "4",
            "--preprocessing_num_workers", "1"]  # fmt: skip
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    kill_when_saved([sys.executable, str(PREPARE), *argv, "--output_dir", str(killed)], killed / "train-00010.json")
    assert not (killed / META_NAME).exists(), "the kill came after the preparation finished"
    with pytest.raises(ValueError, match="its preparation has not finished"):
        PreparedData(killed)
    # a shard is complete once its counts file follows its tokens; the kill can land between the two writes
    done = {p.name: p.stat().st_mtime_ns for p in killed.glob("train-*.bin") if p.with_suffix(".json").is_file()}
    assert 10 < len(done) < 133
    result = subprocess.run([sys.executable, str(PREPARE), *argv, "--output_dir", str(killed)], env=subprocess_env(),
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{len(done)} of 133 training shards are complete already" in result.stderr
    assert all(killed.joinpath(name).stat().st_mtime_ns == mtime for name, mtime in done.items())
    prepare_data.main([*argv, "--output_dir", str(clean)])
    for path in clean.glob("*.bin"):
        assert (killed / path.name).read_bytes() == path.read_bytes(), path.name
    assert PreparedData(killed).meta["train_tokens"] == PreparedData(clean).meta["train_tokens"]


TINY = ["--block_size", "64", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
        "--num_warmup_steps", "5", "--logging_steps", "5", "--eval_steps", "none", "--max_eval_samples", "32",
        "--checkpointing_steps", "10", "--checkpoints_total_limit", "5", "--seed", "0", "--max_train_steps", "20",
        "--model.hidden_size", "32", "--model.num_hidden_layers", "1", "--model.num_attention_heads", "2"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("source", ["prepared", "stream"])
def test_resume_from_a_checkpoint_repeats_the_uninterrupted_losses(corpus, prepared, tmp_path, source):
    """Resumed from its step-10 checkpoint in a new output folder, a run logs the uninterrupted run's losses at
    steps 15 and 20 (to 1e-6: same weights, optimizer, RNG and data position), from prepared shards and from a
    stream (whose checkpoint holds its position: the resumed run reads one window again, not ten steps)."""
    data = ["--prepared_data", str(prepared)] if source == "prepared" else [
        "--dataset_name", str(corpus[0]), "--streaming", "true", "--streaming_validation_texts", "20",
        "--shuffle_buffer_size", "30"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    pretrain.main([*data, *TINY, "--output_dir", str(straight)])
    assert (straight / "step_10" / "data_state_0.json").is_file()
    pretrain.main([*data, *TINY, "--output_dir", str(resumed), "--resume_from_checkpoint", str(straight / "step_10")])
    expected, got = train_losses(straight), train_losses(resumed)
    assert sorted(got) == [15, 20]
    for step in got:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step


def test_stream_position_from_another_number_of_processes_is_refused(corpus, prepared):
    """A stream's saved position belongs to its process's part of the stream: restoring one saved by 2 processes
    into a run of 3 is refused by name; blocks (prepared shards) continue with any number of processes at the same
    global batch, and refuse another global batch."""
    tokenizer = PreparedData(prepared).tokenizer
    cfg = TrainConfig(dataset_name=str(corpus[0]), streaming=True, streaming_validation_texts=20, block_size=64)
    texts, _ = prepare_streaming(*load_text_splits(cfg), tokenizer, Packing.of(cfg), validation_texts=20)
    two = StreamBatches(texts, tokenizer, Packing.of(cfg), 4, seed=0, process_index=0, num_processes=2)
    next(two.iterate())
    three = StreamBatches(texts, tokenizer, Packing.of(cfg), 4, seed=0, process_index=0, num_processes=3)
    with pytest.raises(ValueError, match="saved by 2 process\\(es\\) and this run has 3"):
        three.load_state_dict(two.state_dict(1))
    blocks = PreparedData(prepared).train_blocks(64)
    saved = BlockBatches(blocks, 4, seed=0, process_index=1, num_processes=2).state_dict(10)
    BlockBatches(blocks, 8, seed=0).load_state_dict(saved)  # one process of 8 = two of 4
    with pytest.raises(ValueError, match="global_batch_size 8 in the checkpoint, 12 now"):
        BlockBatches(blocks, 4, seed=0, num_processes=3).load_state_dict(saved)
