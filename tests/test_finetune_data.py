"""training/sft_data.py: completion-only labels at known positions, packing that keeps examples apart,
the block-size policy for long prompts, and the errors for data a format cannot use."""

import logging

import datasets
import pytest
import torch
import torch.nn.functional as F

from tests.paths import INPUT_TXT
from training.data import real_tokens, train_char_tokenizer
from training.sft_data import (
    DEFAULT_CHAT_TEMPLATE,
    IGNORE_INDEX,
    ExampleFormat,
    TrimmedBatches,
    check_columns,
    fit_examples,
    pack_examples,
    pad_examples,
    tokenize_example,
)


@pytest.fixture(scope="module")
def char_tokenizer():
    """One token per character of Tiny Shakespeare: token i is character i, so positions are character offsets."""
    return train_char_tokenizer([INPUT_TXT.read_text(encoding="utf-8")])


def config(**overrides) -> ExampleFormat:
    return ExampleFormat(**overrides)


def trained_positions(labels: list[int]) -> list[int]:
    return [i for i, label in enumerate(labels) if label != IGNORE_INDEX]


def test_prompt_completion_labels_mask_exactly_the_prompt(char_tokenizer, tiny_model):
    """Every prompt character is -100, every completion character and the end-of-text token after them is its
    own id, and the model's loss with these labels is the cross-entropy of predicting the completion characters
    and that end only (position t scores t + 1)."""
    prompt, completion = "ROMEO:\n", "Ay me!"
    cfg = config(data_format="prompt_completion")
    example = tokenize_example({"prompt": prompt, "completion": completion}, char_tokenizer, cfg, 0)
    ids, labels = example["input_ids"], example["labels"]
    assert ids == char_tokenizer(prompt + completion)["input_ids"] + [char_tokenizer.eos_token_id]
    assert trained_positions(labels) == list(range(7, 14))  # "ROMEO:\n" is 7 characters, "Ay me!" 6, then EOS
    assert [labels[i] for i in range(7, 14)] == ids[7:]

    model = tiny_model(vocab_size=len(char_tokenizer))
    input_ids, labels = torch.tensor([ids]), torch.tensor([labels])
    logits = model(input_ids=input_ids).logits[0]
    expected = F.cross_entropy(logits[6:13], input_ids[0, 7:14])  # predictions made at positions 6..12
    assert model(input_ids=input_ids, labels=labels).loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_chat_labels_cover_exactly_the_assistant_turns(char_tokenizer):
    """With the default template, the targets are each assistant message, the end-of-text token after it and
    the blank line closing it: never the role headers, the user's words or the opening assistant greeting (no
    question before it)."""
    char_tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    messages = [
        {"role": "assistant", "content": "Welcome."},
        {"role": "user", "content": "Speak as ROMEO"},
        {"role": "assistant", "content": "Ay me!"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Ay."},
    ]
    example = tokenize_example({"messages": messages}, char_tokenizer, config(data_format="chat"), 0)
    text = "ASSISTANT: Welcome.E\n\nUSER: Speak as ROMEO\n\nASSISTANT: Ay me!E\n\nUSER: Again\n\nASSISTANT: Ay.E\n\n"
    assert char_tokenizer.decode(example["input_ids"]) == text.replace("E\n", "<|endoftext|>\n")
    # positions are tokens: one per character, one for each end-of-text (E above)
    first = len("ASSISTANT: Welcome.E\n\nUSER: Speak as ROMEO\n\nASSISTANT: ")
    second = first + len("Ay me!E\n\nUSER: Again\n\nASSISTANT: ")
    expected = list(range(first, first + len("Ay me!E\n\n"))) + list(range(second, second + len("Ay.E\n\n")))
    assert trained_positions(example["labels"]) == expected


def test_packed_and_padded_rows_score_each_example_as_it_scores_alone(tiny_model, position_type):
    """Packing restarts position_ids at each example, so transformers' mask keeps attention inside it (without
    a KV cache, as in training): the logits of an example inside a packed row equal its logits when run alone,
    for every position type. A
    padded row with its attention mask gives the same logits too, and TrimmedBatches drops all-padding columns."""
    model = tiny_model(position_embedding_type=position_type)
    examples = [torch.randint(0, 99, (n,)).tolist() for n in (5, 9, 7, 12)]
    pairs = [(ids, ids) for ids in examples]
    alone = [model(input_ids=torch.tensor([ids])).logits[0] for ids in examples]

    packed = pack_examples(pairs, block_size=24, pad_id=0)  # rows: 5 + 9 + 7 (+ 3 padding), 12 (+ 12 padding)
    assert packed["input_ids"].shape == (2, 24)
    assert packed["position_ids"][0].tolist() == [*range(5), *range(9), *range(7), *range(3)]
    inputs = {"input_ids": packed["input_ids"].long(), "position_ids": packed["position_ids"].long()}
    logits = model(**inputs, use_cache=False).logits
    starts = [(0, 0), (0, 5), (0, 14), (1, 0)]
    for (row, start), ids, expected in zip(starts, examples, alone):
        torch.testing.assert_close(logits[row, start : start + len(ids)], expected, atol=1e-5, rtol=1e-5)
    assert (packed["labels"][0, 21:] == IGNORE_INDEX).all() and (packed["labels"][1, 12:] == IGNORE_INDEX).all()

    padded = pad_examples(pairs, block_size=24, pad_id=0)
    inputs = {"input_ids": padded["input_ids"].long(), "attention_mask": padded["attention_mask"].long()}
    logits = model(**inputs, use_cache=False).logits
    for row, (ids, expected) in enumerate(zip(examples, alone)):
        torch.testing.assert_close(logits[row, : len(ids)], expected, atol=1e-5, rtol=1e-5)
    batch = next(TrimmedBatches(padded, batch_size=4, seed=0).iterate())
    assert batch["input_ids"].shape == (4, 12)  # the longest example, not the block


def test_real_tokens_leave_out_the_padding_of_packed_and_padded_rows():
    """real_tokens counts the examples' tokens: not the padding that ends a packed row (a sequence of its own),
    nor a padded row's masked tail; a packed row filled to the end has none. Examples with a prompt (-100
    labels) and a target first token both count in full."""
    prompt = [IGNORE_INDEX] * 3
    examples = [([1] * 5, prompt + [1] * 2), ([2] * 9, [2] * 9), ([3] * 7, prompt + [3] * 4), ([4] * 12, [4] * 12)]
    packed = pack_examples(examples, block_size=21, pad_id=0)  # rows: 5 + 9 + 7 (full), 12 (+ 9 padding)
    assert packed["input_ids"].shape == (2, 21)
    batch = {name: x.long() for name, x in packed.items()}
    assert real_tokens(batch) == 5 + 9 + 7 + 12
    assert real_tokens({name: x[1:] for name, x in batch.items()}) == 12
    padded = {name: x.long() for name, x in pad_examples(examples, block_size=21, pad_id=0).items()}
    assert real_tokens(padded) == 5 + 9 + 7 + 12
    assert real_tokens({"input_ids": torch.zeros(3, 8, dtype=torch.long)}) == 24  # blocks of text: every token


def test_a_prompt_longer_than_the_block_is_truncated_with_a_warning_or_refused(caplog):
    """A prompt of block_size tokens or more leaves no room for its completion: 'refuse' stops with an
    error naming how many, the longest and the block size; 'truncate' keeps the prompt's last block_size // 2
    tokens and warns. Examples merely longer than the block lose their end; examples with nothing to learn go."""
    ids = list(range(14))
    rows = {
        "input_ids": [ids, ids[:6], ids[:4]],
        "labels": [[IGNORE_INDEX] * 10 + ids[10:], [IGNORE_INDEX] * 2 + ids[2:6], [IGNORE_INDEX] * 4],
    }  # prompts of 10, 2 and 4 (all prompt) tokens
    examples = datasets.Dataset.from_dict(rows)
    with pytest.raises(ValueError, match=r"1 of 3 train examples have a prompt of block_size=8 tokens or more .*"
                                         r"example 0, has 10\).*--overlong_prompt truncate"):  # fmt: skip
        fit_examples(examples, config(block_size=8, overlong_prompt="refuse"), "train")

    with caplog.at_level(logging.WARNING, logger="training.sft_data"):
        fitted = fit_examples(examples, config(block_size=8, overlong_prompt="truncate"), "train")
    assert fitted == [(ids[6:14], [IGNORE_INDEX] * 4 + ids[10:14]), (ids[:6], rows["labels"][1])]
    assert "kept the last 4 tokens" in caplog.text and "no target tokens" in caplog.text


def test_missing_columns_are_named_with_the_ones_that_exist():
    """Each format names the columns it needs, the ones missing and the ones the split has."""
    split = datasets.Dataset.from_dict({"prompt": ["a"], "answer": ["b"]})
    with pytest.raises(ValueError, match=r"data_format='prompt_completion' needs the column\(s\) \['prompt', "
                                         r"'completion'\].*no \['completion'\]; its columns are \['prompt', 'answer'\]"):  # fmt: skip
        check_columns(split, config(data_format="prompt_completion"), "train")
    with pytest.raises(ValueError, match=r"\['messages'\].*--messages_column_name"):
        check_columns(split, config(data_format="chat"), "train")
    check_columns(split, config(data_format="prompt_completion", completion_column_name="answer"), "train")


def test_malformed_messages_and_unknown_characters_are_clear_errors(char_tokenizer):
    """A chat row that is not a list of role/content messages, and text outside the vocabulary of a character
    tokenizer without an unknown token (saved before they had <|unk|>), each name the example instead of failing
    inside the tokenizer or the template. Today's character tokenizer gives such characters its <|unk|> id."""
    char_tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    with pytest.raises(ValueError, match=r"Example 3: column 'messages' must hold a list of"):
        tokenize_example({"messages": [{"role": "user"}]}, char_tokenizer, config(data_format="chat"), 3)
    from tests.training_runs import char_tokenizer_without_special_tokens

    old = char_tokenizer_without_special_tokens([INPUT_TXT.read_text(encoding="utf-8")])
    example = {"prompt": "<|user|>", "completion": "x"}
    with pytest.raises(ValueError, match=r"Example 5 cannot be tokenized .*character-level tokenizer"):
        tokenize_example(example, old, config(data_format="prompt_completion"), 5)
    ids = tokenize_example(example, char_tokenizer, config(data_format="prompt_completion"), 5)["input_ids"]
    assert char_tokenizer.unk_token_id in ids
