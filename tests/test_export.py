"""decoderlab.export.onnx_executorch: ONNX models and ExecuTorch programs, each run by its own runtime and compared with the model.

The references are the eager model's logits (float32): without a cache for ONNX, and prefill plus greedy decoding
steps with transformers' StaticCache for the torch.export and ExecuTorch programs, which keep that cache inside.
Tolerances: 1e-5 for the torch.export program (the same ATen ops, only traced); 1e-4 for ONNX Runtime and
ExecuTorch's XNNPACK kernels, which sum in other orders. Logits of these random-weight models are O(1-10).
"""

import copy

import numpy as np
import onnxruntime
import pytest
import torch
from executorch.runtime import Runtime
from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import StaticCache

from decoderlab import DecoderLabForCausalLM
from decoderlab.cli import run_command
from decoderlab.convert import main
from decoderlab.export import onnx_executorch
from decoderlab.export.onnx_executorch import export_onnx, export_static_cache, longest_input

DECODING_STEPS = 10
MAX_CACHE_LEN = 48
# Every switch the position / block fixtures leave at their defaults, at once: QK-norm, multi-query attention,
# LayerNorm with biases, a plain GELU MLP, scaled embeddings, a set attention scale, a tied head, partial rotary, and
# longrope, whose frequencies switch tables past original_max_position_embeddings (the tests cross it)
OTHER_SWITCHES = dict(
    qk_norm=True,
    num_key_value_heads=1,
    norm_type="layernorm",
    attention_bias=True,
    mlp_bias=True,
    mlp_type="plain",
    hidden_act="gelu_new",
    embedding_multiplier=2.0,
    attention_scale=0.3,
    tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0] * 4,
        "long_factor": [2.0] * 4,
        "original_max_position_embeddings": 32,
    },
)


def saved(model: DecoderLabForCausalLM, tmp_path) -> str:
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    return str(folder)


@torch.no_grad()
def eager_static_decoding(model, prompt: torch.Tensor, max_cache_len: int) -> tuple[list, list]:
    """Prefill ``prompt`` (1, T) into a StaticCache, then DECODING_STEPS greedy steps: the logits of each call and
    the token fed to each step."""
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    logits = [model(input_ids=prompt, cache=cache, use_cache=True).logits]
    tokens = []
    for _ in range(DECODING_STEPS):
        tokens.append(logits[-1][:, -1:].argmax(-1))  # (1, 1)
        logits.append(model(input_ids=tokens[-1], cache=cache, use_cache=True).logits)
    return logits, tokens


@torch.no_grad()
def program_decoding(forward, prompt: torch.Tensor, tokens: list) -> list:
    """The same calls to a program's ``forward(input_ids, cache_position)``: the prompt, then the given tokens."""
    T = prompt.shape[1]
    logits = [forward(prompt, torch.arange(T))]
    for i, token in enumerate(tokens):
        logits.append(forward(token, torch.tensor([T + i])))
    return logits


def largest_difference(reference: list, got: list) -> float:
    assert len(reference) == len(got)
    for a, b in zip(reference, got):
        assert a.shape == b.shape
    return max((a - b).abs().max().item() for a, b in zip(reference, got))


def onnx_difference(model, path, shapes) -> float:
    """The largest difference between ONNX Runtime's logits and the model's, over random ids of each shape."""
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids"]
    differences = []
    for shape in shapes:
        ids = torch.randint(0, model.config.vocab_size, shape)
        with torch.no_grad():
            expected = model(input_ids=ids, use_cache=False).logits
        (logits,) = session.run(["logits"], {"input_ids": ids.numpy()})
        assert logits.shape == tuple(expected.shape) and logits.dtype == np.float32
        differences.append((torch.from_numpy(logits) - expected).abs().max().item())
    return max(differences)


# ----------------------------------------------------------------------------------------------
# ONNX


def test_cli_onnx_export_runs_in_onnx_runtime(tiny_model, tmp_path, capsys):
    """`python -m decoderlab.convert --to onnx SRC OUT.onnx` writes one file that ONNX Runtime runs, with the
    model's logits (1e-4) at a batch and length other than those traced, and nothing else beside it."""
    model = tiny_model()
    out = tmp_path / "exported" / "model.onnx"
    out.parent.mkdir()
    main(["--to", "onnx", saved(model, tmp_path), str(out)])
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx"]
    assert onnx_difference(model, out, [(3, 13)]) < 1e-4


@pytest.mark.slow
def test_onnx_runtime_matches_every_position_type_and_block(tiny_model, position_and_block, tmp_path):
    """For each position type and norm placement (and the parallel residual), ONNX Runtime's logits equal the
    model's within 1e-4 at two sequence lengths (one the full table of absolute positions) and two batch sizes:
    batch and length stay dynamic in the exported graph."""
    model = tiny_model(**position_and_block)
    out = export_onnx(saved(model, tmp_path), tmp_path / "model.onnx")
    assert onnx_difference(model, out, [(1, 5), (3, model.config.max_position_embeddings)]) < 1e-4


@pytest.mark.slow
def test_onnx_runtime_matches_every_other_switch(tiny_model, tmp_path):
    """QK-norm, MQA, LayerNorm, biases, a plain GELU MLP, scaled embeddings, a set attention scale, a tied head and
    partial longrope export too: ONNX Runtime within 1e-4 below and above longrope's switch of tables (32)."""
    model = tiny_model(**OTHER_SWITCHES)
    out = export_onnx(saved(model, tmp_path), tmp_path / "model.onnx")
    assert onnx_difference(model, out, [(2, 5), (1, 60)]) < 1e-4


# modded-nanogpt's switches: ReLU squared, the final logits capped (at 2: these weights' logits change
# under it), the value residual; both graph exports trace them with the model
SPEEDRUN_SWITCHES = dict(hidden_act="relu2", final_logit_softcapping=2.0, value_residual=True, qk_norm=True)


@pytest.mark.slow
def test_onnx_and_torch_export_carry_the_speedrun_switches(tiny_model, tmp_path):
    """ReLU², final-logit soft-capping and the value residual export to ONNX (ONNX Runtime within 1e-4) and through
    torch.export with a static cache (decoding within 1e-5 of eager), the capped logits below the cap."""
    model = tiny_model(**SPEEDRUN_SWITCHES)
    out = export_onnx(saved(model, tmp_path), tmp_path / "model.onnx")
    assert onnx_difference(model, out, [(2, 5), (1, 40)]) < 1e-4
    prompt = torch.randint(0, model.config.vocab_size, (1, 7))
    reference, tokens = eager_static_decoding(model, prompt, MAX_CACHE_LEN)
    program = export_static_cache(copy.deepcopy(model), MAX_CACHE_LEN).module()
    got = program_decoding(lambda ids, pos: program(input_ids=ids, cache_position=pos), prompt, tokens)
    assert largest_difference(reference, got) < 1e-5
    assert max(logits.abs().max().item() for logits in got) < 2.0


# ----------------------------------------------------------------------------------------------
# torch.export with a static cache, and ExecuTorch


@pytest.mark.slow
def test_torch_export_decoding_matches_eager_static_cache(tiny_model, position_and_block):
    """For each position type and norm placement, the torch.export program (transformers' executorch wrapper with
    a StaticCache) gives the logits of eager static-cache decoding within 1e-5: a 7-token prefill, then 10 greedy
    decoding steps, each reading the keys and values the program kept from the calls before."""
    model = tiny_model(**position_and_block)
    prompt = torch.randint(0, model.config.vocab_size, (1, 7))
    reference, tokens = eager_static_decoding(model, prompt, MAX_CACHE_LEN)
    program = export_static_cache(copy.deepcopy(model), MAX_CACHE_LEN).module()
    got = program_decoding(lambda ids, pos: program(input_ids=ids, cache_position=pos), prompt, tokens)
    assert largest_difference(reference, got) < 1e-5


@pytest.mark.slow
def test_torch_export_decoding_matches_eager_with_every_other_switch(tiny_model):
    """The same with every other switch (see OTHER_SWITCHES): a 28-token prefill and 10 steps, so the decoding
    crosses longrope's switch of tables at position 32; within 1e-5 of eager decoding, absolute plus relative (the
    tied head, N(0, 1) embeddings, makes these logits up to about 20)."""
    model = tiny_model(**OTHER_SWITCHES)
    prompt = torch.randint(0, model.config.vocab_size, (1, 28))
    reference, tokens = eager_static_decoding(model, prompt, MAX_CACHE_LEN)
    program = export_static_cache(copy.deepcopy(model), MAX_CACHE_LEN).module()
    got = program_decoding(lambda ids, pos: program(input_ids=ids, cache_position=pos), prompt, tokens)
    for expected, logits in zip(reference, got, strict=True):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_executorch_program_matches_eager_static_cache(tiny_model, tmp_path):
    """`python -m decoderlab.convert --to executorch SRC OUT.pte` writes an ExecuTorch program (XNNPACK) that
    executorch.runtime runs: prefill and 10 greedy decoding steps give eager static-cache decoding's logits within
    1e-4, and the metadata methods ExecuTorch's LLM runner reads give the cache length and vocabulary."""
    model = tiny_model(num_key_value_heads=2)  # rope, pre-norm, grouped-query: the Llama layout
    out = tmp_path / "model.pte"
    main(["--to", "executorch", saved(model, tmp_path), str(out)])
    max_cache_len = model.config.max_position_embeddings  # the default
    prompt = torch.randint(0, model.config.vocab_size, (1, 7))
    reference, tokens = eager_static_decoding(model, prompt, max_cache_len)

    program = Runtime.get().load_program(out)
    forward = program.load_method("forward")
    got = program_decoding(lambda ids, pos: forward.execute([ids, pos])[0], prompt, tokens)
    assert largest_difference(reference, got) < 1e-4
    assert program.load_method("get_max_seq_len").execute([])[0] == max_cache_len
    assert program.load_method("get_vocab_size").execute([])[0] == model.config.vocab_size


# ----------------------------------------------------------------------------------------------
# Bad input: each refused before anything is traced or written


def folder_listing(folder) -> list:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("target, suffix", [("onnx", ".onnx"), ("executorch", ".pte")])
def test_bad_input_is_named_and_nothing_is_written(target, suffix, tiny_model, tmp_path, capsys):
    """Each bad input stops the export with an error naming it and what to do, and leaves the folders as they
    were: a wrong suffix, an OUT that exists, an OUT whose folder does not, a checkpoint of another family, a
    classifier checkpoint (no lm_head), and dynamic RoPE, which torch.export cannot trace."""
    source = saved(tiny_model(), tmp_path)
    llama = tmp_path / "llama"
    LlamaForCausalLM(
        LlamaConfig(vocab_size=99, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4)
    ).save_pretrained(llama)
    classifier = tmp_path / "classifier"
    AutoModelForSequenceClassification.from_config(tiny_model().config).save_pretrained(classifier)
    dynamic = tmp_path / "dynamic"
    tiny_model(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}).save_pretrained(dynamic)
    (tmp_path / f"taken{suffix}").write_text("keep me")
    cases = {
        (source, tmp_path / "model.bin"): f"should end in {suffix}",
        (source, tmp_path / f"taken{suffix}"): "already exists",
        (source, tmp_path / "missing" / f"model{suffix}"): "does not exist; create it first",
        (llama, tmp_path / f"model{suffix}"): "holds a 'llama' checkpoint",
        (classifier, tmp_path / f"model{suffix}"): "DecoderLabForSequenceClassification checkpoint",
        (dynamic, tmp_path / f"model{suffix}"): "cannot export rope_parameters['rope_type']='dynamic'",
    }
    before = folder_listing(tmp_path)
    for (src, out), message in cases.items():
        with pytest.raises(SystemExit) as stopped:
            run_command(main, ["--to", target, str(src), str(out)])
        assert stopped.value.code == 1
        assert message in capsys.readouterr().err, (src, out)
    assert folder_listing(tmp_path) == before
    assert (tmp_path / f"taken{suffix}").read_text() == "keep me"


def test_a_failed_write_leaves_nothing_behind(tiny_model, tmp_path, monkeypatch):
    """A write that fails halfway (here: the disk fills after the first bytes of the ONNX file) leaves neither OUT
    nor its temporary folder."""
    source = saved(tiny_model(), tmp_path)
    out = tmp_path / "exports" / "model.onnx"
    out.parent.mkdir()

    class HalfWritten:
        def save(self, path):
            path.write_bytes(b"half")
            raise OSError("No space left on device")

    monkeypatch.setattr(onnx_executorch, "onnx_program", lambda model: HalfWritten())
    with pytest.raises(OSError, match="No space left"):
        export_onnx(source, out)
    assert list(out.parent.iterdir()) == []


def test_static_cache_length_must_fit_the_position_table(tiny_model):
    """A static cache longer than the table of learned positions (or shorter than 2) is refused with the range
    that works, before tracing."""
    model = tiny_model(position_embedding_type="learned")
    with pytest.raises(ValueError, match="max_cache_len=65 cannot be used .*choose 2 to max_position_embeddings=64"):
        export_static_cache(model, 65)
    with pytest.raises(ValueError, match="max_cache_len=1 cannot"):
        export_static_cache(model, 1)
    assert longest_input(tiny_model().config) is None  # RoPE: no limit
