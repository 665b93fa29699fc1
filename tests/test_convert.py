"""decoderlab.export.families (and its command, decoderlab.convert): Llama / GPT-2 / GPT-NeoX checkpoints to
decoderlab, and decoderlab to Llama and Qwen3.

The reference is always transformers' own implementation: a random-weight LlamaForCausalLM,
GPT2LMHeadModel or GPTNeoXForCausalLM built here, saved, converted, and compared logit for logit
(fp32, atol 1e-5, which an exact GELU in place of GPT-2's tanh approximation already exceeds) and
token for token under greedy decoding.
"""

import json
import subprocess
import sys

import pytest
import torch
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
    PreTrainedTokenizerFast,
    Qwen3ForCausalLM,
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


@pytest.mark.parametrize("name", sorted(SWITCHES))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_switch_is_refused_by_name_by_llama_and_qwen3(name, family):
    """Each switch of the table, on (its example) on a model both families otherwise express, is refused by --to
    llama and --to qwen3 in a line naming it and what the family does instead; off, the same model exports."""
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, qk_norm=family == "qwen3")
    export = qwen3_config_from_decoderlab if family == "qwen3" else llama_config_from_decoderlab
    export(DecoderLabConfig.from_preset("llama", **base))
    config = DecoderLabConfig.from_preset("llama", **{**base, **SWITCHES[name].example})
    with pytest.raises(ValueError, match="stand in the way") as refused:
        export(config)
    reason = SWITCHES[name].reason(config, family.capitalize())
    assert any(line.startswith(f"  {name}=") and line.endswith(reason) for line in str(refused.value).splitlines())


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
