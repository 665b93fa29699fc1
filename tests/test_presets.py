"""DecoderLabConfig.from_preset: the named architectures (llama, gpt2, neox, vaswani) and sizes.

That each preset computes what its namesake computes is tested in test_convert.py, where checkpoints
of transformers' Llama, GPT-2 and GPT-NeoX are loaded into configs built from these presets and give
the same logits. Here: every preset at every size builds, runs and round-trips, has its namesake's
parameter count at GPT-2-small size, and bad names are refused.
"""

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.configuration_decoderlab import PRESETS, SIZES
from decoderlab.modeling_decoderlab import (
    DecoderLabPostNormDecoderLayer,
    DecoderLabSinusoidalPositionalEmbedding,
)

VOCAB = 99


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied matrix once


@pytest.mark.parametrize("size", ["nano", "tiny"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_builds_runs_and_round_trips(preset, size, tmp_path):
    """Each preset at each CPU-sized size builds, runs forward and generation, and comes back from
    save_pretrained/from_pretrained with the same config and the same logits."""
    config = DecoderLabConfig.from_preset(preset, size, vocab_size=VOCAB)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == tuple(SIZES[size].values())
    model = DecoderLabForCausalLM(config).eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 16, VOCAB) and torch.isfinite(logits).all()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.to_diff_dict() == model.config.to_diff_dict()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)
        assert loaded.generate(ids[:, :4], max_new_tokens=4, do_sample=False).shape == (2, 8)


def small(preset: str, **overrides) -> DecoderLabForCausalLM:
    """The preset at the ``small`` size, built on the meta device: shapes without memory or time."""
    with torch.device("meta"):
        return DecoderLabForCausalLM(DecoderLabConfig.from_preset(preset, "small", **overrides))


# transformers' own model with the same sizes, built on the meta device
REFERENCES = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config()),  # GPT2Config() is GPT-2 small: 124M parameters
    "llama": lambda: LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=2048
        )
    ),
    "neox": lambda: GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
        )
    ),
}


@pytest.mark.parametrize("preset", list(REFERENCES))
def test_small_presets_have_their_namesakes_parameters(preset):
    """At GPT-2-small size with GPT-2's vocabulary, each preset has exactly as many parameters as
    transformers' model of that family: same layers, biases, norms, positions and tying."""
    with torch.device("meta"):
        reference = REFERENCES[preset]()
    overrides = dict(vocab_size=50257)
    if preset == "llama":
        overrides["intermediate_size"] = 2048  # the preset's default 8/3 x 768 rounded to 64
        assert small("llama", vocab_size=50257).config.intermediate_size == 2048
    assert parameter_count(small(preset, **overrides)) == parameter_count(reference)


def test_vaswani_preset_is_the_original_decoder():
    """vaswani has no transformers reference, so check its parts: post-LN blocks and no final norm,
    fixed sinusoids (no position parameters), ReLU, tied embeddings scaled by sqrt(d_model); at small
    size that is GPT-2 small's count minus the position table, the attention biases and the final LayerNorm."""
    model = small("vaswani", vocab_size=50257)
    assert all(isinstance(layer, DecoderLabPostNormDecoderLayer) for layer in model.model.layers)
    assert isinstance(model.model.norm, torch.nn.Identity)
    assert isinstance(model.model.embed_positions, DecoderLabSinusoidalPositionalEmbedding)
    assert isinstance(model.model.layers[0].mlp.act_fn, torch.nn.ReLU)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.multiplier == 768**0.5  # section 3.4: embeddings times sqrt(d_model)
    C, L = 768, 12
    gpt2_small = parameter_count(small("gpt2", vocab_size=50257))
    assert parameter_count(model) == gpt2_small - 1024 * C - L * 4 * C - 2 * C


@pytest.mark.parametrize("size, overrides, expected", [
    (None, {}, 768**0.5),
    ("nano", {}, 128**0.5),
    ("tiny", {}, 384**0.5),
    ("small", {}, 768**0.5),
    ("nano", {"hidden_size": 96}, 96**0.5),  # follows an overridden width
    (None, {"hidden_size": 256, "num_attention_heads": 4}, 16.0),
    ("tiny", {"embedding_multiplier": 1.0}, 1.0),  # an explicit value wins
    ("nano", {"hidden_size": 256, "embedding_multiplier": 2.5}, 2.5),
])  # fmt: skip
def test_vaswani_multiplies_embeddings_by_sqrt_hidden_size(size, overrides, expected):
    """Vaswani et al. 2017, section 3.4: embeddings times sqrt(d_model), d_model being the hidden_size the preset
    is built with (its size or an override), unless embedding_multiplier itself is given; the other presets
    leave the embeddings unscaled."""
    config = DecoderLabConfig.from_preset("vaswani", size, **overrides)
    assert config.embedding_multiplier == expected
    assert all(
        DecoderLabConfig.from_preset(name, size).embedding_multiplier == 1.0 for name in PRESETS if name != "vaswani"
    )


def test_overrides_replace_fields_and_leave_presets_untouched():
    """Keywords win over the preset, whole fields at a time; building configs never edits PRESETS
    (the config standardises rope_parameters in place, which must not leak into the next preset)."""
    before = copy.deepcopy(PRESETS)
    config = DecoderLabConfig.from_preset(
        "neox", "nano", use_parallel_residual=False, rope_parameters={"rope_theta": 5e5}
    )
    assert config.use_parallel_residual is False
    assert config.rope_parameters["rope_theta"] == 5e5 and "partial_rotary_factor" not in config.rope_parameters
    DecoderLabConfig.from_preset("llama")
    DecoderLabConfig.from_preset("vaswani", "nano", hidden_size=96)
    assert PRESETS == before


def test_unknown_preset_or_size_lists_the_choices():
    """A typo names the bad value and every valid one, as a ValueError."""
    with pytest.raises(ValueError, match="Unknown preset 'lama'; choose one of 'llama', 'gpt2', 'neox', 'vaswani'"):
        DecoderLabConfig.from_preset("lama")
    with pytest.raises(ValueError, match="Unknown size 'medium'; choose one of 'nano', 'tiny', 'small'"):
        DecoderLabConfig.from_preset("gpt2", "medium")
