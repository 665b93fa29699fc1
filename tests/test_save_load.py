"""Checkpoints: safetensors plus the source files, loading back to the same model with the package,
and without it through trust_remote_code (the way a Hub user without decoderlab installed loads one)."""

import json
import os
import subprocess
import sys
import textwrap
import typing

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from decoderlab import DecoderLabForCausalLM, DecoderLabForSequenceClassification
from decoderlab.configuration_decoderlab import PositionEmbeddingType

CHECKPOINT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "configuration_decoderlab.py",
    "modeling_decoderlab.py",
    "kernels_decoderlab.py",
    "roles_decoderlab.py",
    "compat_decoderlab.py",
}


def test_save_and_load_every_position_type_and_block(tmp_path, tiny_model, position_type, block_variant):
    """save_pretrained writes safetensors (no pickle), config.json with an auto_map for every Auto class and
    the source files (the modeling file and the siblings it imports); AutoModelForCausalLM.from_pretrained gives identical, finite logits. This catches
    buffers that are not saved (RoPE inv_freq, the sinusoidal table) and not rebuilt after transformers
    builds the model on the meta device."""
    model = tiny_model(position_embedding_type=position_type, **block_variant)
    model.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == CHECKPOINT_FILES
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_decoderlab.DecoderLabConfig"
    assert auto_map["AutoModel"] == "modeling_decoderlab.DecoderLabModel"
    assert auto_map["AutoModelForCausalLM"] == "modeling_decoderlab.DecoderLabForCausalLM"

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is DecoderLabForCausalLM and loaded.dtype == torch.float32
    x = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        expected, logits = model(x).logits, loaded(x).logits
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    for name, buffer in model.named_buffers():  # non-persistent buffers rebuilt exactly
        torch.testing.assert_close(dict(loaded.named_buffers())[name], buffer, rtol=0, atol=0, msg=name)


def test_tied_embeddings_survive_save_and_load(tmp_path, tiny_model):
    """With tie_word_embeddings the head is stored once and re-tied on load (not left random)."""
    model = tiny_model(tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def test_embedding_multiplier_survives_save_load_and_resize(tmp_path, tiny_model):
    """A checkpoint keeps embedding_multiplier in config.json and loads with the same scaled embedding and
    logits; resize_token_embeddings (adding tokens before fine-tuning) keeps the factor on old and new rows."""
    model = tiny_model(embedding_multiplier=8.0, position_embedding_type="sinusoidal", tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["embedding_multiplier"] == 8.0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.embedding_multiplier == 8.0 and loaded.model.embed_tokens.multiplier == 8.0
    x = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)
        hidden = loaded.model(x).last_hidden_state
    loaded.resize_token_embeddings(103)
    embed = loaded.get_input_embeddings()
    assert embed.multiplier == 8.0 and embed.num_embeddings == 103
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x).last_hidden_state, hidden, rtol=0, atol=0)
        torch.testing.assert_close(embed(torch.tensor([101])), 8.0 * embed.weight[101:102], rtol=0, atol=0)


def test_config_json_without_embedding_multiplier_loads_unscaled(tmp_path, tiny_model):
    """A checkpoint saved before the field existed (its config.json lacks the key) loads with 1.0, a plain
    nn.Embedding and bit-identical logits."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["embedding_multiplier"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.embedding_multiplier == 1.0
    assert type(loaded.model.embed_tokens) is torch.nn.Embedding
    x = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_sequence_classification_from_a_causal_lm_checkpoint(tmp_path, tiny_model):
    """AutoModelForSequenceClassification loads a causal-LM checkpoint: the decoder's weights come across,
    the new head scores the last real token, so right padding does not change a sequence's scores."""
    lm = tiny_model(pad_token_id=0)
    lm.save_pretrained(tmp_path)
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3).eval()
    assert type(classifier) is DecoderLabForSequenceClassification
    for name, tensor in lm.model.state_dict().items():
        torch.testing.assert_close(classifier.model.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    x = torch.randint(1, 99, (1, 8))
    padded = torch.cat([x, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        scores = classifier(x).logits
        assert scores.shape == (1, 3)
        torch.testing.assert_close(classifier(padded, attention_mask=(padded != 0).long()).logits, scores)
        torch.testing.assert_close(scores, classifier.score(lm.model(x).last_hidden_state[:, -1]), rtol=0, atol=1e-6)


# A fresh interpreter in which `import decoderlab` fails, whatever sys.path holds (the editable install
# included): each checkpoint must load through the source files it carries.
REMOTE_CODE_CHECK = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class BlockDecoderlab(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "decoderlab" or name.startswith("decoderlab."):
                raise ImportError(f"{name} is hidden in this test")
            return None

    sys.meta_path.insert(0, BlockDecoderlab())

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel, AutoModelForCausalLM

    try:
        import decoderlab
        sys.exit("decoderlab was importable")
    except ImportError:
        pass
    checkpoints = json.load(open("checkpoints.json"))
    x = load_file("inputs.safetensors")["input_ids"]
    results, classes = {}, set()
    for name, path in checkpoints.items():
        lm = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
        base = AutoModel.from_pretrained(path, trust_remote_code=True).eval()
        with torch.no_grad():
            results[name + ".logits"] = lm(x).logits
            results[name + ".hidden"] = base(x).last_hidden_state
        classes |= {type(lm).__module__.split(".")[0], type(base).__module__.split(".")[0]}
    save_file(results, "results.safetensors")
    print(sorted(classes), sorted(m for m in sys.modules if m.startswith("decoderlab")))
    """
)


@pytest.mark.slow
def test_trust_remote_code_without_the_package(tmp_path, tiny_model, all_block_variants):
    """Where decoderlab is not installed, AutoModelForCausalLM and AutoModel with trust_remote_code=True load
    every position type x block layout (and a model with embedding_multiplier) from the checkpoint's own
    source files, giving the same logits and hidden states as the original models. One subprocess checks all
    seventeen checkpoints."""
    x = torch.randint(0, 99, (2, 12))
    checkpoints, expected = {}, {}
    for position_type in typing.get_args(PositionEmbeddingType):
        for variant, overrides in all_block_variants.items():
            name = f"{position_type}_{variant}"
            model = tiny_model(position_embedding_type=position_type, **overrides)
            model.save_pretrained(tmp_path / name)
            checkpoints[name] = str(tmp_path / name)
            with torch.no_grad():
                expected[name + ".logits"] = model(x).logits
                expected[name + ".hidden"] = model.model(x).last_hidden_state
    model = tiny_model(position_embedding_type="sinusoidal", norm_placement="post", embedding_multiplier=8.0)
    model.save_pretrained(tmp_path / "vaswani_scaled")  # the scaled embedding module travels too
    checkpoints["vaswani_scaled"] = str(tmp_path / "vaswani_scaled")
    with torch.no_grad():
        expected["vaswani_scaled.logits"] = model(x).logits
        expected["vaswani_scaled.hidden"] = model.model(x).last_hidden_state
    (tmp_path / "checkpoints.json").write_text(json.dumps(checkpoints))
    save_file({"input_ids": x}, tmp_path / "inputs.safetensors")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_CHECK],
        cwd=tmp_path,  # outside the repository
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("['transformers_modules'] []"), result.stdout
    results = load_file(tmp_path / "results.safetensors")
    assert results.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(results[key], tensor, rtol=0, atol=1e-6, msg=key)


def test_auto_model_loads_the_decoder_alone(tmp_path, tiny_model):
    """AutoModel on a causal-LM checkpoint gives the decoder stack (no head) with the same hidden states."""
    model = tiny_model(position_embedding_type="learned")
    model.save_pretrained(tmp_path)
    base = AutoModel.from_pretrained(tmp_path).eval()
    assert not hasattr(base, "lm_head")
    x = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(base(x).last_hidden_state, model.model(x).last_hidden_state, rtol=0, atol=0)
