"""decoderlab.export.families (and its command, decoderlab.convert): Llama / Qwen3 / Mistral / SmolLM3 / GPT-2 /
GPT-NeoX checkpoints to decoderlab, and decoderlab to Llama and Qwen3, per-layer layouts (sliding windows, RoPE-free
layers) included where the family has them, refused by name where it has not.

The reference is always transformers' own implementation: a random-weight LlamaForCausalLM, GPT2LMHeadModel,
GPTNeoXForCausalLM, Qwen3ForCausalLM, MistralForCausalLM or SmolLM3ForCausalLM built here, saved, converted, and
compared logit for logit (fp32, atol 1e-5, which an exact GELU in place of GPT-2's tanh approximation already exceeds)
and token for token under greedy decoding.
"""

import json
import subprocess
import sys

import pytest
import torch
from conftest import left_padding
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.cli import run_command
from decoderlab.convert import convert_from, convert_to_llama, convert_to_qwen3, main
from decoderlab.export.families import (
    CARRIED_FIELDS,
    SWITCHES,
    llama_config_from_decoderlab,
    qwen3_config_from_decoderlab,
)
from decoderlab.modeling_decoderlab import cpu_flex_attention_defect

VOCAB = 99
SIZES = dict(vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)


def llama(**overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(
        LlamaConfig(
            **SIZES, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, **overrides
        )
    )


def gpt2(**overrides) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=64,
            n_embd=64,
            n_layer=2,
            n_head=4,
            bos_token_id=None,
            eos_token_id=None,
            **overrides,
        )
    )


def neox(**overrides) -> GPTNeoXForCausalLM:
    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            **SIZES, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, **overrides
        )
    )


# (family, reference builder, overrides): the shapes each converter must get right
SOURCES = {
    "llama-gqa-theta5e5-untied": (
        "llama",
        llama,
        dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    ),
    "llama-mqa-tied-biases-headdim-linear-rope": (
        "llama",
        llama,
        dict(
            num_key_value_heads=1,
            head_dim=32,  # != hidden / heads
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            hidden_act="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
    ),
    "gpt2-tied": ("gpt2", gpt2, {}),
    "gpt2-untied-unscaled": ("gpt2", gpt2, dict(tie_word_embeddings=False, scale_attn_weights=False, n_inner=96)),
    "neox-parallel-quarter-rotary": ("neox", neox, dict(use_parallel_residual=True, rotary_pct=0.25)),
    "neox-sequential-half-rotary-tied": (
        "neox",
        neox,
        dict(use_parallel_residual=False, rotary_pct=0.5, rotary_emb_base=20000, tie_word_embeddings=True),
    ),
}


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 10))


def assert_same_model(reference, converted, ids: torch.Tensor) -> None:
    """Same logits (atol 1e-5) and the same greedy continuation, through converted's KV cache."""
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)
        greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(converted.generate(ids, **greedy), reference.generate(ids, **greedy))


def saved(model, folder):
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", list(SOURCES))
def test_convert_from_matches_reference(case, tmp_path, randomize, ids):
    """Each family's converter maps config and weights so that decoderlab computes what transformers'
    own model computes: GQA/MQA, explicit head_dim, RoPE theta and scaling, partial rotary, parallel and
    sequential NeoX blocks, GPT-2's Conv1D and fused q/k/v, NeoX's per-head fused q/k/v, tied and untied heads.
    Query and key weights go across unpermuted: equal logits confirm that HF Llama, HF GPT-NeoX and decoderlab
    share one RoPE layout (rotate_half over the two halves of each head's rotary part)."""
    family, build, overrides = SOURCES[case]
    reference = randomize(build(**overrides)).eval()
    dst = convert_from(family, saved(reference, tmp_path / "src"), tmp_path / "dst")
    converted = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert isinstance(converted, DecoderLabForCausalLM)
    assert converted.config.tie_word_embeddings == reference.config.tie_word_embeddings
    assert converted.config.embedding_multiplier == 1.0  # none of the three families scales its embeddings
    assert_same_model(reference, converted, ids)


def test_dtype_is_kept(tmp_path, randomize):
    """A bfloat16 checkpoint stays bfloat16, bit for bit: tensors are moved, never cast, and config.json
    says so, so from_pretrained's default dtype="auto" loads it in bfloat16 too."""
    reference = randomize(neox()).to(torch.bfloat16)
    dst = convert_from("neox", saved(reference, tmp_path / "src"), tmp_path / "dst")
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    converted = AutoModelForCausalLM.from_pretrained(dst)
    assert converted.dtype == torch.bfloat16
    qkv = reference.gpt_neox.layers[0].attention.query_key_value.weight.unflatten(0, (4, 3, 16))  # (nh, q/k/v, hs, C)
    assert torch.equal(converted.model.layers[0].self_attn.k_proj.weight, qkv[:, 1].flatten(0, 1))


def test_tolerance_catches_exact_gelu_for_gpt2(tmp_path, randomize, ids):
    """The 1e-5 tolerance above has teeth: GPT-2 converted with the exact GELU instead of its tanh
    approximation ("gelu_new") already differs by more, so a converter that got hidden_act wrong fails."""
    reference = randomize(gpt2()).eval()
    dst = convert_from("gpt2", saved(reference, tmp_path / "src"), tmp_path / "dst")
    wrong = AutoModelForCausalLM.from_pretrained(dst, hidden_act="gelu").eval()
    with torch.no_grad():
        assert (wrong(ids).logits - reference(ids).logits).abs().max() > 1e-5


def hub_layout(folder, family: str) -> None:
    """Rewrite a checkpoint saved by transformers 5 the way the original Hub files store it: GPT-2
    (openai-community/gpt2) without the "transformer." prefix and with causal-mask buffers; Pythia with
    mask and RoPE buffers in its layers (transformers 5 already saves its head as "embed_out", as Pythia does)."""
    tensors = load_file(folder / "model.safetensors")
    if family == "gpt2":
        tensors = {name.removeprefix("transformer."): t for name, t in tensors.items()}
        tensors["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
        tensors["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    else:
        assert "embed_out.weight" in tensors
        tensors["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 64, 64, dtype=torch.bool)
        tensors["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
        tensors["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("family, build", [("gpt2", gpt2), ("neox", neox)])
def test_original_hub_layouts_convert(family, build, tmp_path, randomize, ids):
    """Real GPT-2 and Pythia files differ from what transformers 5 saves (no prefix, embed_out, stored
    buffers); the converter reads them, skipping the buffers, rather than only its own round trips."""
    reference = randomize(build()).eval()
    src = saved(reference, tmp_path / "src")
    hub_layout(src, family)
    dst = convert_from(family, src, tmp_path / "dst")
    assert_same_model(reference, AutoModelForCausalLM.from_pretrained(dst).eval(), ids)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<unk>", "<s>", "</s>", "to", "be", "or", "not", "that", "is", "the", "question"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_tokenizer_and_generation_config_are_carried_over(tmp_path, randomize):
    """The tokenizer and generation settings travel with the weights, so DST is usable on its own."""
    src = saved(randomize(gpt2()), tmp_path / "src")
    tiny_tokenizer().save_pretrained(src)
    dst = convert_from("gpt2", src, tmp_path / "dst")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    text = "to be or not to be that is the question"
    assert AutoTokenizer.from_pretrained(dst)(text).input_ids == tiny_tokenizer()(text).input_ids == [
        3, 4, 5, 6, 3, 4, 7, 8, 9, 10,
    ]  # fmt: skip


def test_converted_folder_loads_with_remote_code_alone(tmp_path, randomize, ids):
    """DST carries decoderlab's code and auto_map: a Python that never imports decoderlab loads it with
    trust_remote_code=True and computes the reference's logits."""
    reference = randomize(neox()).eval()
    dst = convert_from("neox", saved(reference, tmp_path / "src"), tmp_path / "dst")
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(dst)!r}, trust_remote_code=True).eval()\n"
        "assert 'decoderlab' not in sys.modules, 'the installed package was imported'\n"
        "assert type(model).__module__.startswith('transformers_modules'), type(model).__module__\n"
        f"with torch.no_grad(): torch.save(model(torch.load({str(tmp_path / 'ids.pt')!r})).logits, {str(tmp_path / 'logits.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=120)
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), reference(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_decoderlab_llama_decoderlab_round_trip(tied, tmp_path, randomize, ids):
    """--to llama writes a checkpoint that plain transformers loads as LlamaForCausalLM (no remote code)
    with the same logits, and --from llama brings back exactly the same weights and config. Small shards
    make both directions write and read a sharded checkpoint with its index."""
    config = DecoderLabConfig.from_preset(
        "llama",
        **SIZES,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        tie_word_embeddings=tied,
    )
    original = randomize(DecoderLabForCausalLM(config)).eval()
    src = saved(original, tmp_path / "decoderlab")
    exported = convert_to_llama(src, tmp_path / "llama", max_shard_size="20KB")

    assert json.loads((exported / "config.json").read_text())["model_type"] == "llama"
    assert "auto_map" not in json.loads((exported / "config.json").read_text())
    assert not list(exported.glob("*.py")) and len(list(exported.glob("*.safetensors"))) > 1
    as_llama = AutoModelForCausalLM.from_pretrained(exported).eval()  # no trust_remote_code
    assert type(as_llama) is LlamaForCausalLM
    assert_same_model(original, as_llama, ids)

    back = AutoModelForCausalLM.from_pretrained(convert_from("llama", exported, tmp_path / "back", "20KB"))
    before, after = original.state_dict(), back.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    volatile = {"architectures", "auto_map", "transformers_version", "_name_or_path", "dtype"}
    assert {k: v for k, v in back.config.to_dict().items() if k not in volatile} == {
        k: v for k, v in original.config.to_dict().items() if k not in volatile
    }


def test_every_config_field_is_a_switch_or_carried():
    """The switch table is complete: every field of DecoderLabConfig is a switch the exports refuse when it is on
    (SWITCHES) or one they take as it is (CARRIED_FIELDS), never both; a new field fails here until it is classified,
    so it cannot reach an export unexamined."""
    fields = {f for f in DecoderLabConfig.__annotations__ if not f.startswith(("model_type", "keys_to", "base_model_"))}
    switch_fields = {name.split("[")[0] for name in SWITCHES}
    assert not (switch_fields & CARRIED_FIELDS) - {"rope_parameters"}  # a RoPE sub-key is a switch, RoPE is carried
    assert fields == switch_fields | CARRIED_FIELDS, fields ^ (switch_fields | CARRIED_FIELDS)


# (switch, family) for every switch of the table and each Llama-shaped family: refused unless the family carries it
EXPORTS = {"llama": llama_config_from_decoderlab, "qwen3": qwen3_config_from_decoderlab}
REFUSED = [(name, family) for name in sorted(SWITCHES) for family in EXPORTS
           if family.capitalize() not in SWITCHES[name].carried_by]  # fmt: skip
CARRIED = [(name, family) for name in sorted(SWITCHES) for family in EXPORTS
           if family.capitalize() in SWITCHES[name].carried_by]  # fmt: skip


def switch_base(family: str) -> dict:
    """A small model both families express but for QK-norm, which only Qwen3 has; 3 layers, for the per-layer
    switches."""
    return dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, qk_norm=family == "qwen3")


@pytest.mark.parametrize(("name", "family"), REFUSED)
def test_every_switch_is_refused_by_name_where_the_family_lacks_it(name, family):
    """Each switch of the table, on (its example) on a model both families otherwise express, is refused by the
    export to each family that does not carry it (--to llama, --to qwen3) in a line naming it and what the family does
    instead; off, the same model exports."""
    export = EXPORTS[family]
    export(DecoderLabConfig.from_preset("llama", **switch_base(family)))
    config = DecoderLabConfig.from_preset("llama", **{**switch_base(family), **SWITCHES[name].example})
    with pytest.raises(ValueError, match="stand in the way") as refused:
        export(config)
    reason = SWITCHES[name].reason(config, family.capitalize())
    assert any(line.startswith(f"  {name}=") and line.endswith(reason) for line in str(refused.value).splitlines())


@pytest.mark.parametrize(("name", "family"), CARRIED)
def test_every_switch_a_family_carries_exports_to_it_exactly(name, family, tmp_path, randomize):
    """Each switch a family carries (its ``carried_by``: Qwen3's sliding layers), on (its example), exports through
    the command to that family's own transformers class, which gives decoderlab's logits within 1e-5 over 16 tokens
    (four times the example's window) and its greedy tokens 12 past the prompt; the same weights without the switch
    compute something else, so the switch got across."""
    fields = {**switch_base(family), **SIZES}
    config = DecoderLabConfig.from_preset("llama", **fields, **SWITCHES[name].example)
    original = randomize(DecoderLabForCausalLM(config))
    main(["--to", family, str(saved(original.eval(), tmp_path / "src")), str(tmp_path / "dst")])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert type(exported).__name__ == f"{family.capitalize()}ForCausalLM"
    ids = torch.randint(0, VOCAB, (2, 16))
    plain = DecoderLabForCausalLM(DecoderLabConfig.from_preset("llama", **fields)).eval()
    assert plain.load_state_dict(original.state_dict(), strict=False).missing_keys == []
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, original(ids).logits, rtol=0, atol=1e-5)
        assert (plain(ids).logits - original(ids).logits).abs().max() > 1e-3
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(exported.generate(ids[:, :4], **greedy), original.generate(ids[:, :4], **greedy))


def test_llama_export_refusal_lists_every_field_in_the_way():
    """A configuration Llama cannot express is refused with one error naming every offending field and
    value, so the user fixes them all at once; a Llama-shaped config with any activation, tying, GQA,
    biases or head_dim is accepted."""
    vaswani = DecoderLabConfig.from_preset("vaswani", "nano")
    with pytest.raises(ValueError) as refused:
        llama_config_from_decoderlab(vaswani)
    for field in (
        "norm_placement='post'",
        "norm_type='layernorm'",
        "norm_bias=True",
        "position_embedding_type=",
        "embedding_multiplier=11.31",  # sqrt(128), Vaswani et al.'s scale at the nano width
    ):
        assert field in str(refused.value)
    scaled_llama = DecoderLabConfig.from_preset("llama", "nano", embedding_multiplier=2.0)
    with pytest.raises(ValueError, match=r"these fields stand in the way:\n  embedding_multiplier=2.0: Llama uses"):
        llama_config_from_decoderlab(scaled_llama)

    neox_like = DecoderLabConfig.from_preset("neox", "nano", qk_norm=True, attention_scale=1.0)
    with pytest.raises(ValueError) as refused:
        llama_config_from_decoderlab(neox_like)
    message = str(refused.value)
    for field in (
        "use_parallel_residual=True",
        "norm_type='layernorm'",
        "partial_rotary_factor']=0.25",
        "mlp_type='plain'",
        "qk_norm=True",
        "attention_scale=1.0",
    ):
        assert field in message
    assert "norm_placement" not in message and "position_embedding_type" not in message  # those are Llama's

    accepted = DecoderLabConfig.from_preset(
        "llama", "nano", hidden_act="gelu", tie_word_embeddings=True, num_key_value_heads=1, head_dim=16,
        attention_bias=True, mlp_bias=True, attention_scale=16**-0.5,
    )  # fmt: skip
    assert llama_config_from_decoderlab(accepted).head_dim == 16


def test_export_refusal_writes_nothing(tmp_path, randomize):
    """A refused export stops before DST is created: no half-written checkpoint to mistake for a good one."""
    src = saved(
        DecoderLabForCausalLM(
            DecoderLabConfig.from_preset(
                "gpt2", vocab_size=VOCAB, num_hidden_layers=1, hidden_size=32, num_attention_heads=2
            )
        ),
        tmp_path / "src",
    )
    with pytest.raises(ValueError, match="position_embedding_type='learned'"):
        convert_to_llama(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_wrong_family_is_named(tmp_path):
    """--from gpt2 on a Llama folder (or --to llama on one) names the model_type found and the one
    expected, and suggests the right flag, instead of failing on a tensor name."""
    src = saved(llama(), tmp_path / "src")
    with pytest.raises(ValueError, match=r"'llama' checkpoint .* --from gpt2 expects 'gpt2'\. Use --from llama\."):
        convert_from("gpt2", src, tmp_path / "dst")
    with pytest.raises(ValueError, match=r"'llama' checkpoint .* --to llama expects 'decoderlab'"):
        convert_to_llama(src, tmp_path / "dst")
    with pytest.raises(ValueError, match="Unknown source family 'gpt3'"):
        convert_from("gpt3", src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_gpt2_switches_decoderlab_lacks_are_refused(tmp_path):
    """GPT-2's per-layer attention scale changes what the model computes; it is refused by name rather
    than dropped, which would convert into a model with different outputs."""
    src = saved(gpt2(scale_attn_by_inverse_layer_idx=True), tmp_path / "src")
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True"):
        convert_from("gpt2", src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_unknown_and_missing_tensors_are_listed(tmp_path, randomize):
    """A checkpoint whose tensors do not match its config (an extra tensor, a missing one) is refused
    with their names before anything is written, never converted into a silently broken model."""
    src = saved(gpt2(), tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    tensors["transformer.h.0.attn.rotary.weight"] = torch.zeros(2)
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as refused:
        convert_from("gpt2", src, tmp_path / "dst")
    assert "h.0.attn.rotary.weight" in str(refused.value)
    assert "model.layers.1.mlp.up_proj.bias" in str(refused.value)
    assert not (tmp_path / "dst").exists()


def test_bad_sources_and_destinations_are_refused(tmp_path):
    """Clear errors for a SRC that is neither a folder nor a Hub repo id, a folder without safetensors
    weights or config, and a DST that already holds files."""
    with pytest.raises(ValueError, match="neither a local folder nor a Hub repo"):
        convert_from("llama", tmp_path / "missing", tmp_path / "dst")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="No config.json"):
        convert_from("llama", tmp_path / "empty", tmp_path / "dst")
    src = saved(llama(), tmp_path / "src")
    (src / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="No safetensors weights"):
        convert_from("llama", src, tmp_path / "dst")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty folder"):
        convert_from("llama", src, tmp_path / "full")


def test_cli_both_directions(tmp_path, randomize, ids, capsys):
    """``python -m decoderlab.convert`` runs each direction (Llama -> decoderlab -> Llama gives back the
    reference's logits) and reports a refusal as an error message and exit status 1, not a traceback."""
    reference = randomize(llama(num_key_value_heads=2)).eval()
    src = saved(reference, tmp_path / "src")
    main(["--from", "llama", str(src), str(tmp_path / "decoderlab")])
    main(["--to", "llama", str(tmp_path / "decoderlab"), str(tmp_path / "llama")])
    assert_same_model(reference, LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval(), ids)

    vaswani = saved(
        DecoderLabForCausalLM(
            DecoderLabConfig.from_preset(
                "vaswani", vocab_size=VOCAB, num_hidden_layers=1, hidden_size=32, num_attention_heads=2
            )
        ),
        tmp_path / "vaswani",
    )
    with pytest.raises(SystemExit) as exited:
        run_command(main, ["--to", "llama", str(vaswani), str(tmp_path / "refused")])
    assert exited.value.code == 1
    assert "error: A Llama checkpoint cannot express" in capsys.readouterr().err

    # Llama-shaped but for its embedding scale: that field alone is named, and nothing is written
    scaled = DecoderLabForCausalLM.from_pretrained(tmp_path / "decoderlab", embedding_multiplier=2.0)
    assert scaled.config.embedding_multiplier == 2.0
    with pytest.raises(SystemExit) as exited:
        run_command(main, ["--to", "llama", str(saved(scaled, tmp_path / "scaled")), str(tmp_path / "refused")])
    assert exited.value.code == 1
    stand_in_the_way = capsys.readouterr().err.split("stand in the way:\n")[1].split("\nOnly models")[0]
    assert stand_in_the_way == "  embedding_multiplier=2.0: Llama uses its token embeddings unscaled (1.0)"
    assert not (tmp_path / "refused").exists()


# ----------------------------------------------------------------------------------------------
# decoderlab -> Qwen3: Llama-shaped models with QK-norm, the default recipe's among them

QWEN3_CASES = {
    "mha-untied": dict(num_key_value_heads=4),
    # ReLU squared (Primer; the speedrun's MLP): Qwen3's MLP looks its activation up in the same ACT2FN
    "relu2": dict(hidden_act="relu2"),
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "mqa-headdim32-biases-gelu-theta5e5": dict(
        num_key_value_heads=1,
        head_dim=32,
        attention_bias=True,
        hidden_act="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        norm_eps=1e-5,
    ),
    # training/configs/shakespeare_char.yaml's model, what `make demo` trains
    "default-recipe": dict(
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        initializer_range=0.06,
        embedding_initializer_range=0.24,
        tie_word_embeddings=False,
    ),
}


def qk_norm_model(randomize, **overrides) -> DecoderLabForCausalLM:
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
    config = DecoderLabConfig.from_preset("llama", **SIZES, **{**sizes, "qk_norm": True, **overrides})
    return randomize(DecoderLabForCausalLM(config)).eval()


@pytest.mark.parametrize("case", list(QWEN3_CASES))
def test_qk_norm_models_export_to_plain_qwen3(case, tmp_path, randomize, ids):
    """--to qwen3 writes a checkpoint plain transformers loads as Qwen3ForCausalLM (no remote code, no auto_map,
    no .py files) computing decoderlab's logits (fp32, atol 1e-5) and greedy tokens through Qwen3's own KV cache:
    QK-norm's weights and eps, MHA/GQA/MQA, tied and untied heads, explicit head_dim, attention biases, another
    activation, RoPE theta, and the default recipe's shape. No sliding window: every layer attends fully."""
    original = qk_norm_model(randomize, **QWEN3_CASES[case])
    exported = convert_to_qwen3(saved(original, tmp_path / "decoderlab"), tmp_path / "qwen3")
    written = json.loads((exported / "config.json").read_text())
    assert written["model_type"] == "qwen3" and "auto_map" not in written
    assert not list(exported.glob("*.py"))
    as_qwen3 = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(as_qwen3) is Qwen3ForCausalLM
    assert as_qwen3.config.layer_types == ["full_attention"] * original.config.num_hidden_layers
    assert as_qwen3.config.sliding_window is None
    assert as_qwen3.config.tie_word_embeddings == original.config.tie_word_embeddings
    assert_same_model(original, as_qwen3, ids)


def test_qk_norm_eps_and_weights_matter_to_the_qwen3_check(tmp_path, randomize, ids):
    """The comparison above has teeth for what only Qwen3 adds: the same export with QK-norm's weights reset to
    ones differs by more than the tolerance, so a converter that dropped or misplaced q_norm/k_norm fails."""
    original = qk_norm_model(randomize)
    exported = convert_to_qwen3(saved(original, tmp_path / "decoderlab"), tmp_path / "qwen3")
    wrong = AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        for layer in wrong.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
        assert (wrong(ids).logits - original(ids).logits).abs().max() > 1e-3


def test_qwen3_export_refusal_lists_every_field_in_the_way(tmp_path, randomize):
    """What Qwen3 cannot express is refused field by field, in Qwen3's words: a model without QK-norm (Qwen3
    always normalises q and k, so it is pointed to --to llama), MLP biases (Qwen3's MLP has none), and all that
    Llama refuses too; nothing is written."""
    with pytest.raises(ValueError) as refused:
        qwen3_config_from_decoderlab(DecoderLabConfig.from_preset("vaswani", "nano"))
    message = str(refused.value)
    assert message.startswith("A Qwen3 checkpoint cannot express this decoderlab configuration")
    for field in (
        "norm_placement='post': Qwen3 normalises before each sublayer",
        "norm_type='layernorm'",
        "position_embedding_type=",
        "embedding_multiplier=11.31",
        "qk_norm=False: Qwen3 always normalises each head's queries and keys (True); export this model with --to llama",
    ):
        assert field in message

    src = saved(qk_norm_model(randomize, qk_norm=False, mlp_bias=True), tmp_path / "src")
    with pytest.raises(ValueError) as refused:
        convert_to_qwen3(src, tmp_path / "dst")
    stand_in_the_way = str(refused.value).split("stand in the way:\n")[1].split("\nOnly models")[0]
    assert stand_in_the_way.splitlines() == [
        "  qk_norm=False: Qwen3 always normalises each head's queries and keys (True); export this model with "
        "--to llama",
        "  mlp_bias=True: Qwen3's MLP has no biases (False)",
    ]
    assert not (tmp_path / "dst").exists()


def test_llama_refusal_of_qk_norm_points_to_qwen3(tmp_path, randomize):
    """The default recipe's model, refused by --to llama for its QK-norm alone, is told where it does export."""
    src = saved(qk_norm_model(randomize, **QWEN3_CASES["default-recipe"]), tmp_path / "src")
    with pytest.raises(
        ValueError, match=r"way:\n  qk_norm=True: Llama does not normalise .* \(--to qwen3 does\)\nOnly"
    ):
        convert_to_llama(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_cli_to_qwen3(tmp_path, randomize, ids, capsys):
    """`python -m decoderlab.convert --to qwen3 SRC DST` writes the Qwen3 checkpoint; a model it cannot express
    exits with status 1 and the field-by-field error, not a traceback."""
    original = qk_norm_model(randomize, num_key_value_heads=2)
    main(["--to", "qwen3", str(saved(original, tmp_path / "src")), str(tmp_path / "qwen3")])
    assert_same_model(original, Qwen3ForCausalLM.from_pretrained(tmp_path / "qwen3").eval(), ids)
    plain = saved(qk_norm_model(randomize, qk_norm=False), tmp_path / "plain")
    with pytest.raises(SystemExit) as exited:
        run_command(main, ["--to", "qwen3", str(plain), str(tmp_path / "refused")])
    assert exited.value.code == 1
    assert "error: A Qwen3 checkpoint cannot express" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logit_softcapping_and_value_residual_are_refused_by_name(family, tmp_path, randomize, capsys):
    """final_logit_softcapping changes every logit and value_residual every later layer's values, and neither Llama
    nor Qwen3 has either: --to llama and --to qwen3 refuse each by name (the value and why), in the command's error
    message, and write nothing; the model without them exports. zero_residual_init, an initialisation only, exports
    as it is."""
    model = qk_norm_model(randomize, qk_norm=family == "qwen3", final_logit_softcapping=15.0, zero_residual_init=True,
                          value_residual=True)  # fmt: skip
    src = saved(model, tmp_path / "src")
    capsys.readouterr()  # the save's progress bar
    with pytest.raises(SystemExit) as exit_info:
        run_command(main, ["--to", family, str(src), str(tmp_path / "dst")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    name = family.capitalize()
    assert f"\n  final_logit_softcapping=15.0: {name} returns its logits uncapped (None)" in err
    assert f"\n  value_residual=True: {name}'s layers use their own values only (False)" in err
    assert not (tmp_path / "dst").exists()
    model = qk_norm_model(randomize, qk_norm=family == "qwen3", zero_residual_init=True)
    convert = convert_to_qwen3 if family == "qwen3" else convert_to_llama
    convert(saved(model, tmp_path / "uncapped"), tmp_path / "dst")


# ----------------------------------------------------------------------------------------------
# Per-layer layouts: Qwen3, Mistral and SmolLM3 -> decoderlab, decoderlab -> Qwen3 and back

S, F = "sliding_attention", "full_attention"
WINDOW = 5
LAYOUT_SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None)  # fmt: skip


def without_layer_types(folder) -> None:
    """config.json as older Qwen3 checkpoints on the Hub write it: use_sliding_window and max_window_layers, no
    layer_types (Qwen3Config derives them: sliding from layer max_window_layers on)."""
    config = json.loads((folder / "config.json").read_text())
    del config["layer_types"]
    (folder / "config.json").write_text(json.dumps(config))


# name -> (--from family, the reference, a change to its saved files, the layout decoderlab must read)
LAYOUT_SOURCES = {
    "qwen3-sliding-layers-headdim32": (
        "qwen3",
        lambda: Qwen3ForCausalLM(Qwen3Config(**LAYOUT_SIZES, head_dim=32, use_sliding_window=True,
                                             sliding_window=WINDOW, layer_types=[S, F, S, S])),
        None,
        dict(layer_types=[S, F, S, S], sliding_window=WINDOW, qk_norm=True),
    ),
    "qwen3-max-window-layers-biases-tied": (
        "qwen3",
        lambda: Qwen3ForCausalLM(Qwen3Config(**LAYOUT_SIZES, head_dim=16, use_sliding_window=True,
                                             sliding_window=WINDOW, max_window_layers=1, attention_bias=True,
                                             tie_word_embeddings=True)),
        without_layer_types,
        dict(layer_types=[F, S, S, S], sliding_window=WINDOW, attention_bias=True, tie_word_embeddings=True),
    ),
    "mistral-window": (
        "mistral",
        lambda: MistralForCausalLM(MistralConfig(**LAYOUT_SIZES, sliding_window=WINDOW)),
        None,
        dict(layer_types=[S] * 4, sliding_window=WINDOW, attention_bias=False),
    ),
    "mistral-no-window": (
        "mistral",
        lambda: MistralForCausalLM(MistralConfig(**LAYOUT_SIZES, sliding_window=None)),
        None,
        dict(layer_types=[F] * 4, sliding_window=None),
    ),
    "smollm3-rope-free-every-second-tied": (
        "smollm3",
        lambda: SmolLM3ForCausalLM(SmolLM3Config(**LAYOUT_SIZES, no_rope_layer_interval=2)),
        None,
        dict(no_rope_layers=[1, 0, 1, 0], layer_types=[F] * 4, tie_word_embeddings=True),
    ),
    "smollm3-sliding-rope-free-layers-biases": (
        "smollm3",
        lambda: SmolLM3ForCausalLM(SmolLM3Config(**LAYOUT_SIZES, no_rope_layers=[0, 1, 1, 0], use_sliding_window=True,
                                                 sliding_window=WINDOW, attention_bias=True, mlp_bias=True,
                                                 tie_word_embeddings=False)),
        None,
        dict(no_rope_layers=[0, 1, 1, 0], layer_types=[S, F, F, S], sliding_window=WINDOW, mlp_bias=True),
    ),
}  # fmt: skip


def reference_model(build, randomize):
    """``build()`` re-drawn; a tied head scaled by 1/sqrt(hidden_size), so that the logits are O(1) and not dominated
    by the input token's own embedding."""
    model = randomize(build()).eval()
    if model.config.tie_word_embeddings:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(model.config.hidden_size**-0.5)
    return model


def assert_same_layout_model(reference, converted, ids: torch.Tensor, padding: torch.Tensor) -> None:
    """Logits within 1e-5 for each attention kernel, each side on the same kernel, with and without left padding (at
    the real positions); greedy tokens 30 past an 8-token prompt, through each side's own KV cache, with eager and
    SDPA. (Flex attention's decoding step does not compile on this CPU build of torch, for transformers' models as
    for decoderlab's, so it is compared on whole sequences only. Where torch's CPU flex kernel is wrong for these heads,
    AVX2 and heads of 16, the converted model refuses it by name instead.)"""
    real = padding.bool()
    kernels = ["eager", "sdpa", "flex_attention"]
    if cpu_flex_attention_defect(converted.config.head_dim) is not None:  # torch's CPU kernel is wrong here: refused
        kernels.remove("flex_attention")
        converted.set_attn_implementation("flex_attention")
        with pytest.raises(ValueError, match="flex_attention"):
            converted(ids)
    with torch.no_grad():
        for kernel in kernels:
            reference.set_attn_implementation(kernel)
            converted.set_attn_implementation(kernel)
            torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=1e-5, msg=kernel)
            padded, expected = (model(ids, attention_mask=padding).logits for model in (converted, reference))
            torch.testing.assert_close(padded[real], expected[real], rtol=0, atol=1e-5, msg=kernel)
        greedy = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
        for kernel in ("eager", "sdpa"):
            reference.set_attn_implementation(kernel)
            converted.set_attn_implementation(kernel)
            assert torch.equal(converted.generate(ids[:, :8], **greedy), reference.generate(ids[:, :8], **greedy))


@pytest.mark.parametrize("case", list(LAYOUT_SOURCES))
def test_convert_from_qwen3_mistral_smollm3_keeps_each_layout(case, tmp_path, randomize):
    """`python -m decoderlab.convert --from qwen3|mistral|smollm3` reads each family's per-layer layout as its config
    resolves it (Qwen3's layer_types, or its use_sliding_window / max_window_layers where an older config.json has no
    layer_types; Mistral's one window on every layer; SmolLM3's no_rope_layer_interval or no_rope_layers, and its
    sliding layers) into decoderlab's fields, with QK-norm, head_dim, biases and tying: the converted model gives
    transformers' logits within 1e-5 over 40 tokens (eight windows) on every kernel, left-padded too, and its greedy
    tokens 30 past the prompt. The same weights without the layout differ, so each layout is one that matters."""
    family, build, change, layout = LAYOUT_SOURCES[case]
    reference = reference_model(build, randomize)
    src = saved(reference, tmp_path / "src")
    if change is not None:
        change(src)
    main(["--from", family, str(src), str(tmp_path / "dst")])
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert isinstance(converted, DecoderLabForCausalLM)
    assert {key: getattr(converted.config, key) for key in layout} == layout
    ids = torch.randint(0, VOCAB, (3, 40))
    assert_same_layout_model(reference, converted, ids, left_padding(3, 40))
    if layout.get("sliding_window") or 0 in layout.get("no_rope_layers", [1]):
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", layer_types=[F] * 4, no_rope_layers=[1] * 4)
        with torch.no_grad():
            assert (plain.eval()(ids).logits - converted(ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize(
    "layout", [[S, F, S, S], [S] * 4, [F, F, S, S]], ids=["mixed", "all-sliding", "full-then-sliding"]
)
def test_sliding_layers_go_to_qwen3_and_back(layout, tmp_path, randomize):
    """--to qwen3 keeps decoderlab's sliding layers (layer_types, sliding_window, use_sliding_window=True, and
    max_window_layers at the first sliding layer): transformers' own Qwen3ForCausalLM, no remote code, gives
    decoderlab's logits within 1e-5 over 40 tokens on every kernel, left-padded too, and its greedy tokens 30 past the
    prompt; --from qwen3 then brings back exactly the same weights and config."""
    config = DecoderLabConfig.from_preset("llama", **LAYOUT_SIZES, qk_norm=True, layer_types=layout,
                                          sliding_window=WINDOW)  # fmt: skip
    original = randomize(DecoderLabForCausalLM(config)).eval()
    main(["--to", "qwen3", str(saved(original, tmp_path / "decoderlab")), str(tmp_path / "qwen3")])
    written = json.loads((tmp_path / "qwen3" / "config.json").read_text())
    assert "auto_map" not in written and not list((tmp_path / "qwen3").glob("*.py"))
    assert (written["layer_types"], written["sliding_window"], written["use_sliding_window"]) == (layout, WINDOW, True)
    assert written["max_window_layers"] == layout.index(S)
    as_qwen3 = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3").eval()
    assert type(as_qwen3) is Qwen3ForCausalLM
    ids = torch.randint(0, VOCAB, (3, 40))
    assert_same_layout_model(as_qwen3, original, ids, left_padding(3, 40))

    main(["--from", "qwen3", str(tmp_path / "qwen3"), str(tmp_path / "back")])
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    before, after = original.state_dict(), back.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)
    volatile = {"architectures", "auto_map", "transformers_version", "_name_or_path", "dtype", "_attn_implementation"}
    assert {k: v for k, v in back.config.to_dict().items() if k not in volatile} == {
        k: v for k, v in original.config.to_dict().items() if k not in volatile
    }


def layout_checkpoint(tmp_path, randomize, qk_norm: bool):
    """A decoderlab checkpoint with all three layouts: sliding layers 0, 2 and 3, layers 1 and 3 without RoPE, sinks."""
    layout = dict(layer_types=[S, F, S, S], sliding_window=WINDOW, no_rope_layers=[1, 0, 1, 0], attention_sinks=True)
    config = DecoderLabConfig.from_preset("llama", **LAYOUT_SIZES, qk_norm=qk_norm, **layout)
    return saved(randomize(DecoderLabForCausalLM(config)), tmp_path / "src")


def test_llama_refuses_each_layout_naming_its_layers(tmp_path, randomize, capsys):
    """--to llama refuses sliding layers, RoPE-free layers and sinks, each on its line naming the layers (and where
    sliding layers do export: --to qwen3); --to qwen3, which keeps the sliding layers, refuses the other two. Nothing
    is written."""
    src = layout_checkpoint(tmp_path, randomize, qk_norm=False)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_command(main, ["--to", "llama", str(src), str(tmp_path / "dst")])
    assert exited.value.code == 1
    lines = capsys.readouterr().err.split("stand in the way:\n")[1].splitlines()
    assert lines[:3] == [
        "  layer_types=['sliding_attention', 'full_attention', 'sliding_attention', 'sliding_attention']: layers 0, "
        "2, 3 are 'sliding_attention' (each query sees the last sliding_window=5 tokens), but Llama attends to every "
        "earlier token in every layer ('full_attention'); Qwen3 keeps sliding layers: export a model with QK-norm "
        "with --to qwen3",
        "  no_rope_layers=[1, 0, 1, 0]: layers 1, 3 skip RoPE (0), but Llama applies it in every layer (all 1)",
        "  attention_sinks=True: every layer's softmax has a learned sink logit per head (self_attn.sinks), but "
        "Llama's has none (False); gpt-oss's has, with another block",
    ]
    src = layout_checkpoint(tmp_path / "qk", randomize, qk_norm=True)
    with pytest.raises(ValueError) as refused:
        convert_to_qwen3(src, tmp_path / "dst")
    names = [line.split("=")[0].strip() for line in str(refused.value).splitlines() if line.startswith("  ")]
    assert names == ["no_rope_layers", "attention_sinks"]
    assert not (tmp_path / "dst").exists()


def test_gpt_oss_is_refused_with_what_it_lacks(tmp_path, capsys):
    """--from gpt_oss names the mixture of experts decoderlab has no switch for (and that its attention alone would
    be another model), before reading SRC; a gpt-oss folder given to --from llama says the same; nothing is written."""
    with pytest.raises(SystemExit) as exited:
        run_command(main, ["--from", "gpt_oss", str(tmp_path / "anything"), str(tmp_path / "dst")])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: gpt-oss cannot be converted to decoderlab: each of its blocks ends in a mixture of "
                          "experts") and "computes something else, so nothing is converted" in err  # fmt: skip
    (tmp_path / "oss").mkdir()
    (tmp_path / "oss" / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    with pytest.raises(ValueError, match=r"holds a 'gpt_oss' checkpoint .* expects 'llama'\. gpt-oss cannot be conv"):
        convert_from("llama", tmp_path / "oss", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    ("family", "build", "match"),
    [
        (
            "qwen3",
            lambda: Qwen3ForCausalLM(Qwen3Config(**LAYOUT_SIZES, layer_types=[S, F, F, S], use_sliding_window=False)),
            r"Qwen3 checkpoint's layer_types makes layers 0, 3 'sliding_attention', but use_sliding_window=False "
            r"leaves sliding_window=None: transformers' Qwen3 cannot build their mask either",
        ),
        (
            "smollm3",
            lambda: SmolLM3ForCausalLM(
                SmolLM3Config(**LAYOUT_SIZES, layer_types=[F, S, F, F], sliding_window=WINDOW, use_sliding_window=False)
            ),  # fmt: skip
            r"SmolLM3 checkpoint's layer_types makes layer 1 'sliding_attention' with sliding_window=5, but "
            r"use_sliding_window=False: .* depends on the kernel",
        ),
    ],
    ids=["qwen3-sliding-without-window", "smollm3-window-off"],
)
def test_sliding_layers_without_one_meaning_are_refused(family, build, match, tmp_path):
    """A Qwen3 checkpoint with sliding layers but no window (use_sliding_window=False clears it: transformers' own
    Qwen3 fails at its first forward) and a SmolLM3 one whose window is off for flash attention but on in its masks
    are refused with the fields and layers named, before anything is written: converting either would pick a meaning."""
    with pytest.raises(ValueError, match=match):
        convert_from(family, saved(build(), tmp_path / "src"), tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
