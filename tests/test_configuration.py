"""DecoderLabConfig: derived defaults, serialisation round trips, Auto registration, and validation.

Every bad configuration must reach the user as a ValueError whose message names the field, the
value and what is allowed, whether it comes from Python keyword arguments or from a config.json.
"""

import copy
import json
import subprocess
import sys
import typing

import pytest
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from decoderlab import (
    DecoderLabConfig,
    DecoderLabForCausalLM,
    DecoderLabForSequenceClassification,
    DecoderLabModel,
)
from decoderlab.configuration_decoderlab import PRESETS, SIZES

# A value different from the default for every field, so a field that is not saved or not read back shows up.
NON_DEFAULT_FIELDS = dict(
    vocab_size=123,
    hidden_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=200,
    max_position_embeddings=77,
    attention_scale=0.3,
    qk_norm=True,
    attention_bias=True,
    attention_dropout=0.1,
    value_residual=True,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    sliding_window=5,
    attention_sinks=True,
    position_embedding_type="rope",
    rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0, "partial_rotary_factor": 0.5},
    no_rope_layers=[1, 0, 1],
    no_rope_layer_interval=2,
    norm_placement="pre",
    norm_type="layernorm",
    norm_eps=1e-6,
    norm_bias=False,
    use_parallel_residual=True,
    mlp_type="plain",
    hidden_act="gelu_new",
    mlp_bias=True,
    embedding_multiplier=9.8,
    hidden_dropout=0.2,
    tie_word_embeddings=True,
    initializer_range=0.05,
    scale_residual_init=False,
    zero_residual_init=True,
    embedding_initializer_range=0.3,
    parametrization="mup",
    mup_base_width=48,
    mup_base_shapes={"intermediate_size": 200, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 32},
    mup_output_multiplier=2.5,
    mup_attention_multiplier=3.0,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=[2, 3],
)

MUP_FIELDS = ("parametrization", "mup_base_width", "mup_base_shapes", "mup_output_multiplier", "mup_attention_multiplier")
# the fields muP does not combine with (final_logit_softcapping: vLLM would cap before muP's factor), set on the
# standard parametrization instead
NON_DEFAULT_STANDARD_FIELDS = {
    **{name: value for name, value in NON_DEFAULT_FIELDS.items() if name not in MUP_FIELDS},
    "final_logit_softcapping": 15.0,
}
ROUND_TRIPS = [NON_DEFAULT_FIELDS, NON_DEFAULT_STANDARD_FIELDS]


def test_non_default_fields_cover_every_field():
    """Keeps the round-trip tests below honest: a new config field must get a non-default value there."""
    own_fields = set(DecoderLabConfig.__annotations__) - {"model_type", "keys_to_ignore_at_inference"}
    own_fields -= {name for name in own_fields if name.startswith("base_model_")}
    assert own_fields <= set(NON_DEFAULT_FIELDS) | set(NON_DEFAULT_STANDARD_FIELDS)


def test_derived_defaults():
    """head_dim, num_key_value_heads and intermediate_size are filled in from the other sizes."""
    config = DecoderLabConfig(hidden_size=768, num_attention_heads=12)
    assert config.head_dim == 64
    assert config.num_key_value_heads == 12  # multi-head by default
    assert config.intermediate_size == 2048  # gated: 8/3 x 768 = 2048, already a multiple of 64
    assert DecoderLabConfig(hidden_size=64, num_attention_heads=4).intermediate_size == 192  # 170.7 rounded up to 64s
    assert DecoderLabConfig(hidden_size=64, num_attention_heads=4, mlp_type="plain").intermediate_size == 256
    assert DecoderLabConfig(hidden_size=64, num_attention_heads=4, head_dim=32).head_dim == 32  # explicit wins
    assert DecoderLabConfig(num_attention_heads=12, num_key_value_heads=1).num_key_value_heads == 1
    assert DecoderLabConfig(rope_theta=5e5).rope_parameters == {"rope_type": "default", "rope_theta": 5e5}


@pytest.mark.parametrize("position_type", ["sinusoidal", "learned", "none"])
def test_configs_without_rope_have_no_rope_parameters(tmp_path, position_type):
    """Like GPT2Config, a config whose positions do not rotate has no rope_parameters at all (tools detect RoPE
    by that attribute), also when one is passed or read from a config.json that has one; it still compares,
    copies, saves and loads."""
    config = DecoderLabConfig(
        position_embedding_type=position_type, rope_parameters={"rope_type": "default", "rope_theta": 5.0}
    )
    assert not hasattr(config, "rope_parameters") and "rope_parameters" not in config.to_dict()
    assert config == copy.deepcopy(config) and config != DecoderLabConfig()
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" not in saved
    (tmp_path / "config.json").write_text(json.dumps({**saved, "rope_parameters": None}))
    assert not hasattr(AutoConfig.from_pretrained(tmp_path), "rope_parameters")
    assert DecoderLabConfig().rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("fields", ROUND_TRIPS, ids=["mup", "standard"])
def test_dict_round_trip(fields):
    """to_dict -> from_dict gives back every field unchanged."""
    config = DecoderLabConfig(**fields)
    again = DecoderLabConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()
    for name, value in fields.items():
        assert getattr(again, name) == value or name == "rope_parameters", name
    assert again.rope_parameters["factor"] == 2.0 and again.rope_parameters["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("fields", ROUND_TRIPS, ids=["mup", "standard"])
def test_save_load_round_trip(tmp_path, fields):
    """save_pretrained writes model_type 'decoderlab'; AutoConfig reads the same config back."""
    config = DecoderLabConfig(**fields)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "decoderlab"
    again = AutoConfig.from_pretrained(tmp_path)
    assert type(again) is DecoderLabConfig
    saved, loaded = config.to_dict(), again.to_dict()
    loaded.pop("_name_or_path"), saved.pop("_name_or_path")  # where it was loaded from
    assert loaded == saved


def test_for_model_builds_a_decoderlab_config():
    """AutoConfig.for_model('decoderlab', ...) works once decoderlab is imported."""
    config = AutoConfig.for_model("decoderlab", hidden_size=128, num_attention_heads=4, norm_placement="post")
    assert type(config) is DecoderLabConfig
    assert (config.hidden_size, config.head_dim, config.norm_placement) == (128, 32, "post")


def test_import_registers_all_auto_classes():
    """Before `import decoderlab` transformers does not know the model; after it all four Auto classes do.

    Runs in a fresh interpreter, since this test session has imported decoderlab already.
    """
    code = """
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification
try:
    AutoConfig.for_model("decoderlab")
    print("known before import")
except ValueError:
    pass
import decoderlab
config = AutoConfig.for_model("decoderlab", vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
for auto in (AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification):
    print(auto.__name__, type(auto.from_config(config)).__name__)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split("\n")[:3] == [
        "AutoModel DecoderLabModel",
        "AutoModelForCausalLM DecoderLabForCausalLM",
        "AutoModelForSequenceClassification DecoderLabForSequenceClassification",
    ]


def test_registration_in_this_process():
    """The Auto mappings point at decoderlab's classes (what `from_config`/`from_pretrained` dispatch on)."""
    assert AutoModel._model_mapping[DecoderLabConfig] is DecoderLabModel
    assert AutoModelForCausalLM._model_mapping[DecoderLabConfig] is DecoderLabForCausalLM
    assert AutoModelForSequenceClassification._model_mapping[DecoderLabConfig] is DecoderLabForSequenceClassification


def test_rope_checks_apply_only_to_rope():
    """An odd head_dim is fine without RoPE (nothing is rotated); it is refused only with RoPE."""
    for position_type in ("sinusoidal", "learned", "none"):
        config = DecoderLabConfig(hidden_size=63, num_attention_heads=3, position_embedding_type=position_type)
        assert config.head_dim == 21
    with pytest.raises(ValueError, match="must be even"):
        DecoderLabConfig(hidden_size=63, num_attention_heads=3, position_embedding_type="rope")


# ----------------------------------------------------------------------------------------------
# Validation: (overrides, a regex the message must match)

BAD_CONFIGS = {
    "hidden not divisible by heads": (
        dict(hidden_size=66, num_attention_heads=4),
        r"hidden_size=66 is not divisible by num_attention_heads=4.*set head_dim",
    ),
    "heads not divisible by kv heads": (
        dict(num_attention_heads=4, num_key_value_heads=3),
        r"num_attention_heads=4 is not divisible by num_key_value_heads=3",
    ),
    "odd rotary dimension": (dict(hidden_size=60, num_attention_heads=4), r"15 must be even"),
    "partial rotary to one dimension": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
        r"partial_rotary_factor = 16 \* 0.1 -> 1 must be even",
    ),
    "partial_rotary_factor above 1": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}),
        r"partial_rotary_factor must be in \(0, 1\], got 1.5",
    ),
    "partial_rotary_factor zero": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0}),
        r"partial_rotary_factor must be in \(0, 1\], got 0.0",
    ),
    "unknown rope_type": (
        dict(rope_parameters={"rope_type": "spiral", "rope_theta": 1e4}),
        r"rope_type'\]='spiral' is not a RoPE type.*'linear'.*'yarn'",
    ),
    "linear scaling without factor": (
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}),
        r"Missing required keys.*'linear'.*factor",
    ),
    "yarn scaling without factor": (
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
        r"Missing required keys.*'yarn'.*factor",
    ),
    "negative rope_theta": (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), r"rope_theta.*-1"),
    "wrong type": (dict(hidden_size="64"), r"hidden_size.*expected int.*'64'"),
    "float where int": (dict(vocab_size=3.5), r"vocab_size.*expected int.*3.5"),
    "string where bool": (dict(qk_norm="yes"), r"qk_norm.*expected bool.*'yes'"),
    "hidden_dropout 1.5": (dict(hidden_dropout=1.5), r"hidden_dropout must be in \[0, 1\), got 1.5"),
    "attention_dropout negative": (dict(attention_dropout=-0.1), r"attention_dropout must be in \[0, 1\), got -0.1"),
    "zero attention_scale": (dict(attention_scale=0.0), r"attention_scale must be positive.*got 0.0"),
    "zero norm_eps": (dict(norm_eps=0.0), r"norm_eps must be positive, got 0.0"),
    "string embedding_multiplier": (dict(embedding_multiplier="sqrt"), r"embedding_multiplier.*expected float.*'sqrt'"),
    "parallel residual with post-LN": (
        dict(use_parallel_residual=True, norm_placement="post"),
        r"use_parallel_residual=True needs norm_placement='pre'.*'post'",
    ),
    "parallel residual with sandwich": (
        dict(use_parallel_residual=True, norm_placement="sandwich"),
        r"use_parallel_residual=True needs norm_placement='pre'.*'sandwich'",
    ),
}
for _size in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
    BAD_CONFIGS[f"zero {_size}"] = (dict({_size: 0}), rf"{_size} must be a positive integer, got 0")
for _size in ("num_key_value_heads", "head_dim", "intermediate_size"):
    BAD_CONFIGS[f"zero {_size}"] = (dict({_size: 0}), rf"{_size} must be a positive integer, got 0")
for _factor in (0.0, -8.0, float("inf"), float("nan")):
    BAD_CONFIGS[f"embedding_multiplier {_factor}"] = (
        dict(embedding_multiplier=_factor),
        rf"embedding_multiplier must be a finite positive number \(1.0 leaves .*\), got {_factor}\.",
    )
for _name in ("initializer_range", "embedding_initializer_range"):
    for _std in (-0.02, float("inf"), float("nan")):
        BAD_CONFIGS[f"{_name} {_std}"] = (
            dict({_name: _std}),
            rf"^{_name} must be a finite standard deviation >= 0, got {_std}\.",
        )


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_raises_value_error(case):
    """Each invalid setting raises ValueError (not a huggingface_hub strict-dataclass error) naming the problem."""
    overrides, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=message):
        DecoderLabConfig(**{"hidden_size": 64, "num_attention_heads": 4, **overrides})


LITERAL_FIELDS = [
    name for name, hint in DecoderLabConfig.__annotations__.items() if typing.get_origin(hint) is typing.Literal
]


def test_every_choice_field_is_checked():
    """The list below is derived from the annotations; guard against it silently becoming empty."""
    assert set(LITERAL_FIELDS) >= {"position_embedding_type", "norm_placement", "norm_type", "mlp_type", "hidden_act"}


@pytest.mark.parametrize("field", LITERAL_FIELDS)
def test_unknown_choice_names_field_value_and_choices(field):
    """An unknown choice for any closed set of options is a ValueError listing what is allowed."""
    allowed = typing.get_args(DecoderLabConfig.__annotations__[field])
    with pytest.raises(ValueError) as info:
        DecoderLabConfig(**{field: "bogus"})
    message = str(info.value)
    assert field in message and "bogus" in message
    assert all(repr(choice) in message for choice in allowed)


def test_unknown_choice_in_config_json(tmp_path):
    """A config.json edited by hand with an unknown choice fails at AutoConfig.from_pretrained with a ValueError."""
    DecoderLabConfig(hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["norm_placement"] = "middle"
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"(?s)norm_placement.*'pre', 'post', 'sandwich'.*middle"):
        AutoConfig.from_pretrained(tmp_path)


def test_invalid_combination_in_config_json(tmp_path):
    """A config.json whose fields clash (not a single bad field) is refused the same way."""
    DecoderLabConfig(hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["num_key_value_heads"] = 3
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        AutoConfig.from_pretrained(tmp_path)


def test_whole_numbers_for_float_fields_are_floats():
    """`embedding_multiplier: 8` in a recipe, `norm_eps=1` in Python: a whole number given to a float field is that
    float (as JSON and YAML write it), stored as a float and saved as one; a bool or a string is still refused with
    the field named."""
    config = DecoderLabConfig(embedding_multiplier=8, norm_eps=1, attention_scale=1)
    assert (config.embedding_multiplier, config.norm_eps, config.attention_scale) == (8.0, 1.0, 1.0)
    assert all(type(v) is float for v in (config.embedding_multiplier, config.norm_eps, config.attention_scale))
    assert DecoderLabConfig.from_dict(config.to_dict()) == config
    for bad in (True, "8"):
        with pytest.raises(ValueError, match="embedding_multiplier"):
            DecoderLabConfig(embedding_multiplier=bad)


# ----------------------------------------------------------------------------------------------
# Keywords that are not fields


@pytest.mark.parametrize(
    "build",
    [
        lambda **kw: DecoderLabConfig(**kw),
        lambda **kw: AutoConfig.for_model("decoderlab", **kw),
        lambda **kw: DecoderLabConfig.from_preset("llama", **kw),
    ],
    ids=["DecoderLabConfig", "AutoConfig.for_model", "from_preset"],
)
def test_misspelt_keyword_is_an_error_naming_the_field(build):
    """``num_hidden_layer=6`` built the default 12 layers without a word: a keyword close to a field is an error
    naming the field and the value given."""
    with pytest.raises(ValueError, match=r"no field 'num_hidden_layer' \(given num_hidden_layer=6\): did you mean "
                       r"'num_hidden_layers'\?"):  # fmt: skip
        build(num_hidden_layer=6, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"did you mean 'norm_placement'"):
        build(norm_placment="post")


def test_other_models_epsilon_names_load_with_a_warning_naming_norm_eps(caplog):
    """``rms_norm_eps``, ``norm_epsilon``, ...: other models' names for the norms' epsilon, which transformers' own
    test utilities set on every config (``set_config_for_less_flaky_test``), load; one warning names ``norm_eps``,
    and the field keeps its value."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        config = DecoderLabConfig(hidden_size=64, num_attention_heads=4, norm_epsilon=1.0, rms_norm_eps=1e-6)
    assert config.norm_eps == DecoderLabConfig().norm_eps
    assert "norm_epsilon=1.0" in caplog.text and "norm_eps" in caplog.text
    DecoderLabConfig(**config.to_dict())  # and again from its own dict, as the common tests rebuild it


def test_misspelt_key_in_config_json_is_an_error(tmp_path):
    """The same typo in a hand-edited config.json is refused on load, naming the field."""
    DecoderLabConfig(hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["qk_nrom"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"did you mean 'qk_norm'"):
        AutoConfig.from_pretrained(tmp_path)


# What transformers and other tools legitimately put into a config.json beside the fields
FOREIGN_KEYS = {
    "_name_or_path": "org/model",
    "architectures": ["DecoderLabForCausalLM"],
    "transformers_version": "5.12.0",
    "torch_dtype": "bfloat16",
    "auto_map": {"AutoConfig": "configuration_decoderlab.DecoderLabConfig"},
    "quantization_config": {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int8WeightOnlyConfig"}}},
    "id2label": {"0": "NEGATIVE", "1": "POSITIVE"},
    "label2id": {"NEGATIVE": 0, "POSITIVE": 1},
    "problem_type": "single_label_classification",
    "use_cache": False,
    "max_length": 64,
    "do_sample": True,
    "temperature": 0.7,
    "sep_token_id": 2,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    "original_max_position_embeddings": 1024,
    "base_model_name_or_path": "org/base",  # a tool's own record
    "my_tool_setting": {"anything": 1},
}


def test_keys_other_tools_write_still_load(tmp_path):
    """A config.json holding what transformers (other versions too), PEFT, quantizers, generation settings and a
    tool of one's own write loads; the legacy RoPE keys still become rope_parameters."""
    DecoderLabConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(config | FOREIGN_KEYS))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.num_hidden_layers == 3 and loaded.use_cache is False
    assert loaded.rope_parameters["rope_theta"] == 500000.0 and loaded.rope_parameters["rope_type"] == "linear"
    assert loaded.my_tool_setting == {"anything": 1} and loaded.id2label == {0: "NEGATIVE", 1: "POSITIVE"}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_and_size_round_trips_through_config_json(preset, tmp_path):
    """What the project writes still loads under the keyword check: every preset at every size, saved and read
    back as config.json."""
    for size in (None, *SIZES):
        config = DecoderLabConfig.from_preset(preset, size, vocab_size=65)
        config.save_pretrained(tmp_path)
        loaded = AutoConfig.from_pretrained(tmp_path)
        loaded._name_or_path = config._name_or_path
        assert loaded.to_dict() == config.to_dict()


def test_real_llama_gpt2_neox_configs_convert_under_the_keyword_check():
    """transformers' own Llama, GPT-2 and GPT-NeoX configs, through to_dict and back as a checkpoint's config.json
    would be, convert to decoderlab configs: the converters pass fields only, never the other family's keys."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

    from decoderlab.export.families import (
        decoderlab_config_from_gpt2,
        decoderlab_config_from_llama,
        decoderlab_config_from_neox,
    )

    for family, convert in (
        (LlamaConfig, decoderlab_config_from_llama),
        (GPT2Config, decoderlab_config_from_gpt2),
        (GPTNeoXConfig, decoderlab_config_from_neox),
    ):
        source = family.from_dict(family(num_hidden_layers=2, num_attention_heads=4).to_dict())
        assert convert(source).num_hidden_layers == 2
