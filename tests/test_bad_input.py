"""Bad input gets a clear Python exception naming the problem, never an opaque index error or a silent
wrong answer: token ids outside the vocabulary, sequences past a fixed position table, ambiguous inputs,
and broken checkpoints."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM


@pytest.mark.parametrize("bad_id", [-1, 99, 1000])
def test_token_ids_outside_the_vocabulary(tiny_model, bad_id):
    """An id < 0 or >= vocab_size raises ValueError naming the allowed range and the ids found, in forward
    and in generate (where the embedding lookup would otherwise fail with an IndexError)."""
    model = tiny_model()
    x = torch.tensor([[5, bad_id, 7]])
    pattern = rf"input_ids must lie in \[0, vocab_size=99\).*{bad_id}"
    with pytest.raises(ValueError, match=pattern):
        model(x)
    with pytest.raises(ValueError, match=pattern):
        model.generate(x, max_new_tokens=2, pad_token_id=0)


def test_token_ids_after_resize_token_embeddings(tiny_model):
    """After resize_token_embeddings to a larger vocabulary (adding special tokens before fine-tuning), the new
    ids pass the check and reach the new rows; ids past the new size are still refused, naming it."""
    model = tiny_model()
    model.resize_token_embeddings(103)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 101, 102]])).logits
    assert logits.shape == (1, 3, 103) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=103\).*103"):
        model(torch.tensor([[5, 103]]))


def test_range_checks_on_an_accelerator_read_nothing_back():
    """Off the CPU the checks are device-side assertions: nothing is copied to the host (here the meta device,
    whose tensors hold no values, so any read of one would raise), and the assertion carries the message."""
    from unittest.mock import patch

    from decoderlab.modeling_decoderlab import check_indices

    ids = torch.randint(0, 99, (2, 5), device="meta")
    with patch("torch._assert_async", wraps=torch._assert_async) as asserted:
        check_indices(ids, 99, lambda low, high: f"ids out of range ({low}, {high})")
    (condition, message), _ = asserted.call_args
    assert condition.device.type == "meta" and message == "ids out of range (None, None)"
    with pytest.raises(ValueError, match=r"ids out of range \(-1, 3\)"):
        check_indices(torch.tensor([3, -1]), 99, lambda low, high: f"ids out of range ({low}, {high})")


@pytest.mark.parametrize("position_type", ["learned", "sinusoidal"])
def test_sequence_longer_than_the_position_table(tiny_model, position_type):
    """Learned and sinusoidal tables have max_position_embeddings rows (64 here): a longer input, or a
    generation that runs past the table, raises ValueError saying how long the sequence is and what to do."""
    model = tiny_model(position_embedding_type=position_type)
    with torch.no_grad():
        model(torch.randint(0, 99, (1, 64)))  # exactly the table: fine
    with pytest.raises(ValueError, match=r"Position 69 is past max_position_embeddings=64.*70 long.*rope"):
        model(torch.randint(0, 99, (1, 70)))
    with pytest.raises(ValueError, match=r"Position 64 is past max_position_embeddings=64.*65 long"):
        model.generate(torch.randint(0, 99, (1, 60)), max_new_tokens=10, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match=r"Position 80 is past max_position_embeddings=64"):
        model(torch.randint(0, 99, (1, 5)), position_ids=torch.arange(76, 81)[None])


@pytest.mark.parametrize("position_type", ["rope", "none"])
def test_rope_and_no_positions_have_no_length_limit(tiny_model, position_type):
    """RoPE (and NoPE) run past max_position_embeddings; with RoPE, a window placed at positions 70-99 gives
    the same logits as at 0-29 (only offsets matter), so the long positions are not garbage."""
    model = tiny_model(position_embedding_type=position_type)
    x = torch.randint(0, 99, (1, 30))
    with torch.no_grad():
        far = model(x, position_ids=torch.arange(70, 100)[None]).logits
        near = model(x).logits
        assert model(torch.randint(0, 99, (1, 100))).logits.isfinite().all()
    torch.testing.assert_close(far, near, rtol=0, atol=1e-4)
    generated = model.generate(torch.randint(0, 99, (1, 60)), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 80)


def test_input_ids_and_inputs_embeds_are_exclusive(tiny_model):
    """Passing both input_ids and inputs_embeds (or neither) is ambiguous: ValueError."""
    model = tiny_model()
    x = torch.randint(0, 99, (1, 5))
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids=x, inputs_embeds=model.model.embed_tokens(x))
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model()


def test_inputs_embeds_equal_input_ids(tiny_model):
    """The inputs_embeds path (used e.g. by prompt tuning) is the same computation as the ids path."""
    model = tiny_model(position_embedding_type="learned")
    x = torch.randint(0, 99, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(inputs_embeds=model.model.embed_tokens(x)).logits, model(x).logits)


@pytest.fixture
def checkpoint(tmp_path, tiny_model):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    return tmp_path


def test_checkpoint_without_weights(checkpoint):
    """A folder with config.json but no model.safetensors: OSError naming the missing file and the folder."""
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(OSError, match=r"model.safetensors.*" + str(checkpoint)):
        AutoModelForCausalLM.from_pretrained(checkpoint)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupted_weights_file(checkpoint, damage):
    """A truncated or overwritten model.safetensors raises OSError naming the folder and saying the file is
    damaged, instead of safetensors' bare 'Error while deserializing header'."""
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"not safetensors" * 20, "empty": b""}[damage])
    with pytest.raises(OSError, match=rf"(?s){checkpoint}.*truncated or corrupted.*save the checkpoint again"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_weights_of_the_wrong_shape(checkpoint, tiny_config):
    """Weights saved for another vocabulary size do not load silently into this config."""
    config = json.loads((checkpoint / "config.json").read_text())
    config["vocab_size"] = 50
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_config_json_with_an_unknown_choice(checkpoint):
    """Loading a model whose config.json names an unknown position type fails with a ValueError listing the
    allowed ones, before any weights are read."""
    config = json.loads((checkpoint / "config.json").read_text())
    config["position_embedding_type"] = "alibi"
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"(?s)position_embedding_type.*'rope', 'sinusoidal', 'learned', 'none'.*alibi"
    ):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_checkpoint_missing_a_decoder_weight_loads_it_initialized_and_reports_it(checkpoint, caplog):
    """A weights file that lacks one tensor of the decoder loads as every transformers model does: the tensor is
    initialized (not left as uninitialized memory), listed in the loading info's missing_keys and named in a
    warning, while every other weight comes from the file."""
    from safetensors.torch import load_file, save_file
    from transformers.utils import logging as hf_logging

    weights = checkpoint / "model.safetensors"
    tensors = load_file(weights)
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, weights, metadata={"format": "pt"})
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            model, info = AutoModelForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    finally:
        hf_logging.disable_propagation()
    assert set(info["missing_keys"]) == {"model.layers.1.mlp.up_proj.weight"}
    assert "model.layers.1.mlp.up_proj.weight" in caplog.text
    up = model.model.layers[1].mlp.up_proj.weight
    assert (
        torch.isfinite(up).all()
        and 0.5 * model.config.initializer_range < up.std() < 2 * model.config.initializer_range
    )
    for name, tensor in tensors.items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_new_task_head_may_be_missing(checkpoint):
    """Loading a classifier from a causal-LM checkpoint still works: only the new head (score) is missing."""
    from transformers import AutoModelForSequenceClassification

    model, info = AutoModelForSequenceClassification.from_pretrained(checkpoint, output_loading_info=True)
    assert info["missing_keys"] == {"score.weight"}
