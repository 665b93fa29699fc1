"""training/models.py: what a new model carries for the tools people use on it (its special tokens in every
saved file, batched pipelines), that checkpoints made before those tokens existed still load and generate, and
that adding the tokens to such a checkpoint leaves what it computes for the old tokens unchanged."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import decoderlab
from tests.paths import INPUT_TXT
from tests.training_runs import char_model_config, char_tokenizer_without_special_tokens, save_checkpoint_folder
from training.data import train_char_tokenizer
from training.models import add_special_tokens, build_model

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}


@pytest.fixture(scope="module")
def corpus() -> str:
    return INPUT_TXT.read_text(encoding="utf-8")


@pytest.fixture
def new_checkpoint(tmp_path, corpus, randomize):
    """A tiny model built as pretrain.py builds one (build_model, the character tokenizer), weights re-drawn so
    that greedy continuations depend on the context."""
    tokenizer = train_char_tokenizer([corpus])
    model = randomize(build_model(TINY, tokenizer, 64))
    return save_checkpoint_folder(model, tokenizer, tmp_path / "new")


def test_saved_files_name_the_end_of_text_token_as_eos_padding_and_bos(new_checkpoint):
    """tokenizer_config.json, config.json and generation_config.json all give <|endoftext|> (id 65, after the
    65 characters) as EOS, padding and BOS: what TRL, lm-eval and pipelines read."""
    tokenizer_config = json.loads((new_checkpoint / "tokenizer_config.json").read_text())
    assert {tokenizer_config[k] for k in ("eos_token", "pad_token", "bos_token")} == {"<|endoftext|>"}
    for name in ("config.json", "generation_config.json"):
        config = json.loads((new_checkpoint / name).read_text())
        assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (65, 65, 65), name
    assert json.loads((new_checkpoint / "config.json").read_text())["vocab_size"] == 67  # and <|unk|>, id 66


def test_text_generation_pipeline_batches_prompts_of_different_lengths(new_checkpoint):
    """pipeline("text-generation") with nothing but the saved model and tokenizer runs two prompts of different
    lengths as one left-padded batch, and each greedy continuation equals that prompt's continuation alone."""
    model = AutoModelForCausalLM.from_pretrained(new_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(new_checkpoint)
    assert tokenizer.padding_side == "left"
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompts = ["ROMEO:", "First Citizen:\nBefore we proceed"]
    batched = generator(prompts, batch_size=2, max_new_tokens=12, do_sample=False)
    alone = [generator(prompt, max_new_tokens=12, do_sample=False) for prompt in prompts]
    assert [b[0]["generated_text"] for b in batched] == [a[0]["generated_text"] for a in alone]
    assert all(len(b[0]["generated_text"]) > len(p) for b, p in zip(batched, prompts))


def test_checkpoint_without_special_tokens_still_loads_and_generates(tmp_path, corpus):
    """A checkpoint saved the way the scripts saved them before the end-of-text token (65 characters, no EOS,
    padding or BOS anywhere) loads with the Auto classes and generates the asked number of tokens."""
    tokenizer = char_tokenizer_without_special_tokens([corpus])
    torch.manual_seed(0)
    folder = save_checkpoint_folder(decoderlab.DecoderLabForCausalLM(char_model_config(tokenizer)), tokenizer,
                                    tmp_path / "old")  # fmt: skip
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 65 and tokenizer.eos_token_id is None and model.generation_config.eos_token_id is None
    input_ids = tokenizer("ROMEO:", return_tensors="pt").input_ids
    out = model.generate(input_ids, max_new_tokens=10, do_sample=False)
    assert out.shape == (1, input_ids.shape[1] + 10)
    assert tokenizer.decode(out[0]).startswith("ROMEO:")


def test_adding_special_tokens_keeps_the_old_tokens_logits(corpus, randomize):
    """add_special_tokens on an old model and tokenizer: <|endoftext|> becomes id 65, the embeddings and head grow
    by one row, the config and generation config name it, and the logits of the 65 old tokens are unchanged."""
    tokenizer = char_tokenizer_without_special_tokens([corpus])
    model = randomize(decoderlab.DecoderLabForCausalLM(char_model_config(tokenizer))).eval()
    input_ids = tokenizer("ROMEO:\nAy me!", return_tensors="pt").input_ids
    with torch.no_grad():
        before = model(input_ids=input_ids).logits
    assert add_special_tokens(model, tokenizer) == 1
    with torch.no_grad():
        after = model(input_ids=input_ids).logits
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (65, 65, 65)
    assert after.shape[-1] == 66 and model.config.vocab_size == 66
    for config in (model.config, model.generation_config):
        assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (65, 65, 65)
    torch.testing.assert_close(after[..., :65], before)


def test_new_models_train_the_end_of_text_embedding():
    """The end-of-text token is also the padding token, yet its embedding row is drawn like the others and gets
    a gradient (no padding_idx, which would zero and freeze it: with tied weights, its logit too)."""
    tokenizer = train_char_tokenizer(["abc"])
    model = build_model({**TINY, "tie_word_embeddings": True}, tokenizer, 16)
    eos = tokenizer.eos_token_id
    assert model.get_input_embeddings().weight[eos].abs().sum() > 0
    input_ids = torch.tensor([[0, 1, eos, 2]])
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert model.get_input_embeddings().weight.grad[eos].abs().sum() > 0
