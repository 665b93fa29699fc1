"""training/data.py: tokenizers, loading errors, packing and the resumable, sharded batches."""

import json
import logging

import datasets
import pytest
import torch
from huggingface_hub import constants as hub_constants
from transformers import AutoTokenizer

from tests.paths import INPUT_TXT, SHARED_DATA
from training.args import TrainConfig
from training.data import (
    BlockBatches,
    CharEncoder,
    Packing,
    block_tensor,
    load_text_splits,
    pack,
    prepare_map_style,
    split_blocks,
    train_bpe_tokenizer,
    train_char_tokenizer,
)

HUB_LAYOUT_COPY = SHARED_DATA / "tiny_shakespeare"


@pytest.fixture(scope="module")
def corpus() -> str:
    return INPUT_TXT.read_text(encoding="utf-8")


def test_char_tokenizer_round_trips_the_corpus_with_nanogpts_ids(corpus, tmp_path):
    """Saved and reloaded through AutoTokenizer, the character tokenizer gives back all of Tiny Shakespeare
    unchanged, with 65 character tokens numbered like nanoGPT's shakespeare_char (sorted characters), then the
    end-of-text token (id 65) as EOS, padding and BOS, and the unknown token (id 66), none of them added to the text
    by encoding."""
    train_char_tokenizer([corpus]).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer(corpus)["input_ids"]
    chars = sorted(set(corpus))
    assert len(tokenizer) == 67
    assert tokenizer.convert_ids_to_tokens(list(range(65))) == chars
    assert tokenizer.convert_ids_to_tokens([65, 66]) == ["<|endoftext|>", "<|unk|>"]
    assert tokenizer.unk_token_id == 66
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (65, 65, 65)
    assert ids[:1000] == [chars.index(c) for c in corpus[:1000]]
    assert len(ids) == len(corpus)
    assert tokenizer.decode(ids) == corpus


def test_char_tokenizer_maps_unknown_characters_to_its_unknown_token(tmp_path):
    """A character outside the vocabulary becomes <|unk|> (one token per unknown character, so positions still
    line up with the characters), in the tokenizer as AutoTokenizer loads it and in the packing table alike; a
    character tokenizer saved before it had <|unk|> still loads and still refuses such a character."""
    train_char_tokenizer(["abc"]).save_pretrained(tmp_path / "new")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "new")
    ids = tokenizer("abz é1", add_special_tokens=False)["input_ids"]
    unk = tokenizer.unk_token_id
    assert ids == [0, 1, unk, unk, unk, unk] and unk == 4 and tokenizer.eos_token_id == 3
    assert tokenizer.decode(ids) == "ab<|unk|><|unk|><|unk|><|unk|>"
    assert CharEncoder.of(tokenizer)("abz é1").tolist() == ids

    from tests.training_runs import char_tokenizer_without_special_tokens

    char_tokenizer_without_special_tokens(["abc"]).save_pretrained(tmp_path / "old")
    old = AutoTokenizer.from_pretrained(tmp_path / "old")
    assert old("cab")["input_ids"] == [2, 0, 1] and old.unk_token is None
    with pytest.raises(Exception, match="UNK|unk|vocabulary"):
        old("abz")
    with pytest.raises(ValueError, match="1 character\\(s\\) the character tokenizer does not know: 'z'"):
        CharEncoder.of(old)("abz")


def test_char_encoder_gives_the_tokenizers_ids(corpus, tmp_path):
    """The table lookup that packs character-tokenized text gives the tokenizer's own ids for all of Tiny
    Shakespeare, also for the tokenizer reloaded by AutoTokenizer; a text holding the end-of-text token (which
    the tokenizer matches as one token) is left to the tokenizer, and tokenizers of other kinds get no table."""
    tokenizer = train_char_tokenizer([corpus])
    tokenizer.save_pretrained(tmp_path)
    for loaded in (tokenizer, AutoTokenizer.from_pretrained(tmp_path)):
        encoder = CharEncoder.of(loaded)
        assert encoder is not None
        assert encoder(corpus).tolist() == tokenizer(corpus, add_special_tokens=False)["input_ids"]
    assert encoder("To be<|endoftext|>") is None
    assert CharEncoder.of(train_bpe_tokenizer([corpus[:20_000]], vocab_size=300)) is None


def test_packing_names_characters_the_char_tokenizer_lacks(tmp_path, caplog):
    """Packing text with characters outside a character vocabulary gives them the unknown token's id and warns,
    naming them."""
    (tmp_path / "train.txt").write_text("abc\nabéz\nz\n" * 10)
    cfg = TrainConfig(train_file=str(tmp_path / "train.txt"), block_size=4, dataset_name=None)
    train, _ = load_text_splits(cfg)
    tokenizer = train_char_tokenizer(["abc\n"])
    with caplog.at_level(logging.INFO, logger="training.data"):  # the run's warning is check_unknown_characters'
        blocks = block_tensor(pack(train, tokenizer, Packing.of(cfg), "train"))
    expected = tokenizer("abc\nabéz\nz\n" * 10, add_special_tokens=False)["input_ids"]
    assert blocks.flatten().tolist() == expected[: blocks.numel()] and tokenizer.unk_token_id in expected
    assert "become <|unk|>: ['z', 'é']" in caplog.text


def test_bpe_tokenizer_round_trips_and_has_eos(corpus, tmp_path):
    """The byte-level BPE reaches the asked vocabulary size, compresses, decodes text back exactly
    (including bytes it never saw) and has an end-of-text token to separate documents."""
    train_bpe_tokenizer([corpus[:200_000]], vocab_size=400).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    sample = corpus[500_000:502_000] + " naïve café ✓"
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    assert len(tokenizer) == 400
    assert tokenizer.eos_token == tokenizer.pad_token == tokenizer.bos_token == "<|endoftext|>"
    assert len(ids) < 0.7 * len(sample)
    assert tokenizer.decode(ids) == sample


def test_local_hub_layout_folder_loads_with_both_splits():
    """The offline copy in the Hub layout gives a train and a validation split with a text column."""
    train, validation = load_text_splits(TrainConfig(dataset_name=str(HUB_LAYOUT_COPY)))
    assert len(train[0]["text"]) == 1_003_854 and len(validation[0]["text"]) == 111_540


def test_dataset_not_found_says_what_was_tried(monkeypatch):
    """A dataset that is neither a folder nor reachable on the Hub names both attempts and the offline fix."""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as info:
        load_text_splits(TrainConfig(dataset_name="someone/no_such_dataset"))
    message = str(info.value)
    assert "Could not load dataset 'someone/no_such_dataset'" in message
    assert "does not exist" in message and "Hub dataset id" in message
    assert "HF_HUB_OFFLINE" in message and "--train_file" in message


def test_missing_data_file():
    """A --train_file that does not exist is named in the error."""
    with pytest.raises(ValueError, match="Data file nowhere/train.txt does not exist"):
        load_text_splits(TrainConfig(train_file="nowhere/train.txt"))


def test_missing_text_column_lists_the_columns(tmp_path):
    """Asking for a column the data lacks lists the columns it has."""
    path = tmp_path / "train.jsonl"
    path.write_text('{"content": "hello", "id": 1}\n{"content": "world", "id": 2}\n')
    with pytest.raises(ValueError, match=r"no column 'text'; its columns are \['content', 'id'\]"):
        load_text_splits(TrainConfig(train_file=str(path)))


def test_text_shorter_than_one_block(tmp_path):
    """Text too short to fill a block is an error that gives the token count and the block size."""
    (tmp_path / "train.txt").write_text("To be, or not to be\n")
    (tmp_path / "validation.txt").write_text("that is the question\n")
    cfg = TrainConfig(
        train_file=str(tmp_path / "train.txt"), validation_file=str(tmp_path / "validation.txt"), block_size=64
    )
    train, validation = load_text_splits(cfg)
    tokenizer = train_char_tokenizer([train[0]["text"], validation[0]["text"]])
    with pytest.raises(
        ValueError, match=r"train text is too short: it has 20 tokens, fewer than 1 block\(s\) of block_size=64"
    ):
        prepare_map_style(train, validation, tokenizer, Packing.of(cfg), cfg.validation_split_percentage)


def test_packing_concatenates_and_caches(corpus, tmp_path):
    """Packed blocks are the tokenized text cut into block_size pieces, and a second pack of the same data
    with the same tokenizer is read from the cache (same fingerprint) instead of being recomputed."""
    path = tmp_path / "train.txt"
    path.write_text(corpus[:20_000])
    cfg = TrainConfig(train_file=str(path), block_size=32, dataset_name=None)
    train, _ = load_text_splits(cfg)
    tokenizer = train_char_tokenizer([corpus])
    first = pack(train, tokenizer, Packing.of(cfg), "train")
    blocks = block_tensor(first)
    expected = torch.tensor(tokenizer(corpus[:20_000], add_special_tokens=False)["input_ids"])
    # rows are lines, concatenated; with fewer than 1000 lines the only loss is the tail past the last block
    assert torch.equal(blocks.flatten().long(), expected[: blocks.numel()])
    assert blocks.shape == (20_000 // 32, 32)
    second = pack(train, tokenizer, Packing.of(cfg), "train")
    assert second._fingerprint == first._fingerprint
    assert second.cache_files == first.cache_files
    other = pack(train, train_char_tokenizer([corpus[:20_000]]), Packing.of(cfg), "train")
    assert other._fingerprint != first._fingerprint  # another vocabulary: tokenized again


def test_documents_are_separated_by_the_end_of_text_token(tmp_path):
    """Rows of a multi-document dataset (jsonl) are packed as each document's characters followed by the
    character tokenizer's end-of-text token (id 65 after 65 characters); the lines of a .txt file are not. The
    end-of-text token written inside a text is that token, as the tokenizer reads it."""
    documents = ["To be, or not to be", "that is the question:", "Whether 'tis<|endoftext|> nobler in the mind"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    (tmp_path / "lines.txt").write_text("".join(d + "\n" for d in documents))
    tokenizer = train_char_tokenizer(documents + ["\n"])
    eos = tokenizer.eos_token_id
    assert eos == len(set("".join(documents + ["\n"])))
    expected = {
        "docs.jsonl": [i for d in documents for i in tokenizer(d)["input_ids"] + [eos]],
        "lines.txt": tokenizer("".join(d + "\n" for d in documents))["input_ids"],
    }
    for name, ids in expected.items():
        cfg = TrainConfig(train_file=str(tmp_path / name), block_size=8, dataset_name=None)
        blocks = block_tensor(pack(load_text_splits(cfg)[0], tokenizer, Packing.of(cfg), "train"))
        assert blocks.flatten().tolist() == ids[: len(ids) // 8 * 8], name


def test_validation_carved_off_the_end():
    """Without a validation split, the last blocks validate, like nanoGPT's last-10% split."""
    blocks = torch.arange(100).view(50, 2)
    train, validation = split_blocks(blocks, 10.0)
    assert torch.equal(train, blocks[:45]) and torch.equal(validation, blocks[45:])


def take(batches: BlockBatches, start: int, n: int) -> list[torch.Tensor]:
    iterator = batches.iterate(start)
    return [next(iterator)["input_ids"] for _ in range(n)]


def test_batches_resume_exactly_and_cover_each_epoch():
    """iterate(start=b) continues exactly where an uninterrupted iteration is at batch b, across epochs;
    each epoch visits each block at most once and differs in order from the next."""
    blocks = torch.arange(40 * 4).view(40, 4)
    batches = BlockBatches(blocks, batch_size=3, seed=7)  # 13 batches per epoch, one block left out
    straight = take(batches, 0, 30)
    assert all(torch.equal(a, b) for a, b in zip(straight[17:], take(batches, 17, 13)))
    epoch0 = torch.cat(straight[:13])[:, 0].tolist()
    epoch1 = torch.cat(straight[13:26])[:, 0].tolist()
    assert len(set(epoch0)) == 39 and len(set(epoch1)) == 39 and epoch0 != epoch1


def test_sharded_batches_match_one_process_with_the_global_batch():
    """Two processes with batch 3 see, step by step, the same 6 blocks as one process with batch 6:
    the data side of 'two processes follow the single-process curve at the same global batch'."""
    blocks = torch.arange(50 * 2).view(50, 2)
    single = take(BlockBatches(blocks, batch_size=6, seed=1), 0, 20)
    rank0 = take(BlockBatches(blocks, batch_size=3, seed=1, process_index=0, num_processes=2), 0, 20)
    rank1 = take(BlockBatches(blocks, batch_size=3, seed=1, process_index=1, num_processes=2), 0, 20)
    for whole, a, b in zip(single, rank0, rank1):
        assert torch.equal(whole, torch.cat([a, b]))


def test_too_few_blocks_for_a_batch():
    """Fewer blocks than one global batch is a clear error, not an endless loop of empty batches."""
    with pytest.raises(ValueError, match="Only 5 training blocks, fewer than one global batch of 8"):
        BlockBatches(torch.zeros(5, 4), batch_size=4, seed=0, num_processes=2)


def test_streaming_carves_validation_and_resumes_from_its_saved_position(corpus, tmp_path):
    """A streamed dataset (read lazily, as FineWeb-Edu would be) without a validation split: its first texts
    validate and no training batch holds them; batches have the block shape; and a stream restored from the
    position saved after batch b (a fresh StreamBatches, as a resumed run builds) yields what the uninterrupted
    stream yields from b on, as does the replay of the first b batches that older checkpoints fall back on."""
    from training.data import StreamBatches, prepare_streaming

    path = tmp_path / "docs.jsonl"
    documents = [corpus[i : i + 3000] for i in range(0, 300_000, 3000)]  # 100 documents
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    cfg = TrainConfig(
        train_file=str(path), streaming=True, streaming_validation_texts=5, block_size=32, tokenizer_type="bpe"
    )
    train, validation = load_text_splits(cfg)
    assert isinstance(train, datasets.IterableDataset) and validation is None
    tokenizer = train_bpe_tokenizer([corpus[:100_000]], vocab_size=300)
    packing = Packing.of(cfg)
    train_texts, eval_blocks = prepare_streaming(train, validation, tokenizer, packing, validation_texts=5)
    validation_text = "".join(d + "<|endoftext|>" for d in documents[:5])
    validation_ids = tokenizer(validation_text, add_special_tokens=False)["input_ids"]
    assert eval_blocks.shape == (len(validation_ids) // 32, 32)
    assert eval_blocks.flatten().tolist() == validation_ids[: eval_blocks.numel()]
    assert [row["text"] for row in train_texts] == documents[5:]  # the validation documents are out

    def make() -> StreamBatches:
        return StreamBatches(train_texts, tokenizer, packing, batch_size=4, seed=3, shuffle_buffer_size=50)

    batches = make()
    iterator = batches.iterate()
    straight = [next(iterator)["input_ids"] for _ in range(60)]  # past the first windows of 50 blocks
    assert straight[0].shape == (4, 32)
    for b in (7, 13, 40):
        resumed = make()
        resumed.load_state_dict(json.loads(json.dumps(batches.state_dict(b))))  # as a checkpoint stores it
        continued = resumed.iterate(start=b)
        assert all(torch.equal(next(continued)["input_ids"], expected) for expected in straight[b:]), b
    replayed = make().iterate(start=7)
    assert all(torch.equal(next(replayed)["input_ids"], expected) for expected in straight[7:])
    trained = tokenizer.decode(torch.cat(straight).flatten().tolist())
    assert not any(d[100:200] in trained for d in documents[:5])


def test_tiktoken_gives_the_byte_level_bpes_own_ids(corpus):
    """TextEncoder runs a byte-level BPE through tiktoken (TiktokenBPE: each token's bytes ranked by its id) and
    gets the tokenizer's own ids for every one of 1,000 documents of Tiny Shakespeare and for text it never saw
    (accents, emoji, digits, runs of spaces), with its check of the first texts passed; a text holding
    <|endoftext|> is left to the tokenizer, which matches the token whole."""
    from training.data import TextEncoder, TiktokenBPE

    tokenizer = train_bpe_tokenizer([corpus[:300_000]], vocab_size=2000)
    encode = TextEncoder(tokenizer)
    assert isinstance(encode.bpe, TiktokenBPE)
    texts = [corpus[i : i + 1000] for i in range(0, 1_000_000, 1000)]
    texts += ["naïve café ✓ 1234   spaces\n\n\ttabs 🙂", "To be<|endoftext|>or not", "", "  x"]
    expected = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    assert [ids.tolist() for ids in encode(texts)] == expected
    assert encode.bpe.agrees and encode.bpe.unchecked == 0
    assert TiktokenBPE.of(train_char_tokenizer(["abc"])) is None


def test_prefetched_batches_are_the_batches_in_order_and_errors_reach_the_consumer():
    """The read-ahead thread yields exactly the iterator's batches, in order, for depths 0, 1 and 4; counts the
    time the consumer waited; stops when closed; and an error raised while reading reaches the consumer (a run
    stops with the data's own error rather than waiting forever)."""
    from training.data import Prefetched

    blocks = torch.arange(40 * 4).view(40, 4)
    expected = take(BlockBatches(blocks, batch_size=3, seed=7), 0, 30)
    for depth in (0, 1, 4):
        prefetched = Prefetched(BlockBatches(blocks, batch_size=3, seed=7).iterate(), depth)
        assert all(torch.equal(next(prefetched)["input_ids"], batch) for batch in expected)
        assert prefetched.waited_s > 0
        prefetched.close()

    def failing():
        yield {"input_ids": blocks[:2]}
        raise ValueError("shard train-00003.bin is truncated")

    prefetched = Prefetched(failing(), depth=2)
    next(prefetched)
    with pytest.raises(ValueError, match="truncated"):
        next(prefetched)
    prefetched.close()
