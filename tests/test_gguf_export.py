"""decoderlab.export.gguf_file: decoderlab checkpoints as GGUF files, checked by two readers nobody here wrote.

1. transformers' GGUF loader (``from_pretrained(DIR, gguf_file=NAME)``, which builds a LlamaForCausalLM, q/k
   de-interleaved, or for QK-norm models a Qwen3ForCausalLM, from llama.cpp's metadata keys) must give
   decoderlab's logits (fp32, atol 1e-4) and its tokenizer the same ids as the checkpoint's.
2. llama.cpp itself (llama-cpp-python 0.3.36 built from source by ``make llamacpp`` into .venv-llamacpp, run in a
   subprocess by tests/llamacpp_runner.py) must give the same token ids, the same greedy continuation and
   last-token logits within 1e-3 for the f32 file; f16, bf16 and q8_0 within looser, stated tolerances.

Models are random (conftest's ``randomize``, so that every weight matters), built from the ``llama`` preset,
with and without QK-norm (llama.cpp's ``qwen3`` and ``llama`` architectures), with the tokenizers the training scripts make (character, byte-level BPE) and a GPT-2-style one (vocab and
merges, <|endoftext|> last, the model's vocabulary padded beyond the tokenizer's).

The per-layer layouts (sliding windows, RoPE-free layers, attention sinks) are refused by name before anything is
written: neither reader honours them for these two architectures, which a file with a window key shows.
"""

import json
import os
import subprocess
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Tokenizer

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.cli import run_command
from decoderlab.convert import main
from decoderlab.export import gguf_file
from decoderlab.export.gguf_file import convert_to_gguf, interleave_rope_rows
from tests.paths import INPUT_TXT, REPO_ROOT
from training.data import EOS_TOKEN, train_bpe_tokenizer, train_char_tokenizer

LLAMACPP_PYTHON = REPO_ROOT / ".venv-llamacpp" / "bin" / "python"
RUNNER = REPO_ROOT / "tests" / "llamacpp_runner.py"

TEXTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "First Citizen:\n\nBefore we proceed any further,  hear me speak.\n",
    f"  Speak, speak.{EOS_TOKEN}KING RICHARD III:\nNow is the winter",
]
NEW_TOKENS = 8
SLIDING, FULL = "sliding_attention", "full_attention"


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return INPUT_TXT.read_text(encoding="utf-8")


def gpt2_style(bpe) -> GPT2Tokenizer:
    """A GPT-2-style tokenizer (vocab + merges, <|endoftext|> the last id, as GPT-2's own), from ``bpe``'s."""
    model = json.loads(bpe.backend_tokenizer.to_str())["model"]
    vocab = {t: i - 1 for t, i in model["vocab"].items() if t != EOS_TOKEN}  # the scripts' BPE has it at 0
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return GPT2Tokenizer(vocab=vocab, merges=merges)


@pytest.fixture(scope="module")
def tokenizers(shakespeare) -> dict:
    bpe = train_bpe_tokenizer([shakespeare[:200_000]], 400)
    return {"char": train_char_tokenizer([shakespeare]), "bpe": bpe, "gpt2-style": gpt2_style(bpe)}


# the default recipe's model (training/configs/shakespeare_char.yaml, what `make demo` trains), QK-norm included
DEFAULT_RECIPE = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256, qk_norm=True,
    initializer_range=0.06, embedding_initializer_range=0.24, tie_word_embeddings=False,
)  # fmt: skip

# tokenizer, config overrides: MHA and GQA/MQA, tied and untied, explicit head_dim, a padded vocabulary; QK-norm
CASES = {
    "char-default-recipe-qknorm": ("char", DEFAULT_RECIPE),
    "bpe-qknorm-gqa-tied": ("bpe", dict(qk_norm=True, num_key_value_heads=2, tie_word_embeddings=True)),
    "char-mha-untied": ("char", dict(num_key_value_heads=4)),
    "bpe-gqa-tied": ("bpe", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "gpt2style-mqa-headdim32-theta5e5-padded": (
        "gpt2-style",
        dict(
            num_key_value_heads=1,
            head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
            vocab_size=448,  # the tokenizer's 400, padded to a multiple of 64
        ),
    ),
}


def llama_model(randomize, vocab_size: int, **overrides) -> DecoderLabForCausalLM:
    sizes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    config = DecoderLabConfig.from_preset(
        "llama", vocab_size=vocab_size, max_position_embeddings=128, **{**sizes, **overrides}
    )
    return randomize(DecoderLabForCausalLM(config)).eval()


def checkpoint(folder: Path, model, tokenizer) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def case(request, tokenizers, randomize, tmp_path):
    """(decoderlab model, tokenizer, checkpoint folder) for CASES[request.param]."""
    kind, overrides = CASES[request.param]
    tokenizer = tokenizers[kind]
    model = llama_model(randomize, **{"vocab_size": len(tokenizer), **overrides})
    return model, tokenizer, checkpoint(tmp_path / "src", model, tokenizer)


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


# ----------------------------------------------------------------------------------------------
# transformers' GGUF loader


def load_gguf(out: Path, config: DecoderLabConfig):
    """transformers' GGUF loader on ``out``. Its qwen3 mapping reads no head_dim (it has no attention.key_length,
    so Qwen3Config's default of 128 stands and the weights do not fit), so for qwen3 files head_dim is given
    here; llama.cpp, which reads the key, checks it in the llama.cpp tests below."""
    head_dim = {"head_dim": config.head_dim} if config.qk_norm else {}
    return AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name, **head_dim).eval()


@pytest.mark.parametrize("case", list(CASES), indirect=True)
def test_transformers_gguf_loader_reads_the_same_model_and_tokenizer(case, tmp_path):
    """The f32 file read back by transformers' own GGUF loader is decoderlab's model: logits within 1e-4 (fp32)
    at every position, the same tokenizer ids for text with newlines, runs of spaces and <|endoftext|>, and the
    same tying. It protects the tensor names and metadata keys, the q/k interleaving (the loader undoes
    llama.cpp's layout, so a missing or wrong permutation shows here), head_dim, GQA, and the vocabulary; with
    QK-norm, llama.cpp's qwen3 architecture, its attn_q_norm / attn_k_norm and q/k rows left as they are."""
    model, tokenizer, src = case
    out = convert_to_gguf(src, tmp_path / "model.gguf")
    reader = gguf.GGUFReader(out)
    arch = "qwen3" if model.config.qk_norm else "llama"
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == arch
    assert ("blk.0.attn_q_norm.weight" in {t.name for t in reader.tensors}) == model.config.qk_norm
    loaded = load_gguf(out, model.config)
    assert type(loaded).__name__ == ("Qwen3ForCausalLM" if model.config.qk_norm else "LlamaForCausalLM")
    assert loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert loaded.config.num_key_value_heads == model.config.num_key_value_heads
    gguf_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert gguf_tokenizer(text).input_ids == ids, text
        assert gguf_tokenizer.decode(ids) == tokenizer.decode(ids) == text
        torch.testing.assert_close(logits(loaded, ids), logits(model, ids), atol=1e-4, rtol=0)


# measured max |logit difference| / max |logit| on these models is below a third of each bound (docs/performance.md)
RELATIVE_TOLERANCE = {"f16": 2e-3, "bf16": 2e-2, "q8_0": 2e-2}


@pytest.mark.parametrize("outtype", list(RELATIVE_TOLERANCE))
def test_smaller_outtypes_agree_within_their_tolerance(outtype, tokenizers, randomize, tmp_path):
    """f16, bf16 and q8_0 files, dequantized by transformers' loader, stay within the stated fraction of the
    largest logit, and are smaller than the f32 file (q8_0: about a quarter, f16/bf16: half the matrices)."""
    tokenizer = tokenizers["char"]
    src = checkpoint(tmp_path / "src", llama_model(randomize, len(tokenizer)), tokenizer)
    f32 = convert_to_gguf(src, tmp_path / "f32.gguf")
    small = convert_to_gguf(src, tmp_path / f"{outtype}.gguf", outtype)
    assert small.stat().st_size < (0.3 if outtype == "q8_0" else 0.55) * f32.stat().st_size
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=f32.name).eval()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=small.name).eval()
    ids = tokenizer(TEXTS[0]).input_ids
    expected = logits(reference, ids)
    difference = (logits(loaded, ids) - expected).abs().max() / expected.abs().max()
    assert 0 < difference < RELATIVE_TOLERANCE[outtype]


def test_interleave_rope_rows_pairs_the_two_halves_of_each_head():
    """Row 2i of each head is its row i, row 2i+1 its row i + head_dim/2: the layout llama.cpp's "llama" graph
    rotates (adjacent pairs), from HF's rotate_half halves, per head, for GQA's fewer key heads too."""
    rows = torch.arange(2 * 8).float().unsqueeze(1)  # 2 heads of head_dim 8
    assert interleave_rope_rows(rows, 2).squeeze(1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


# ----------------------------------------------------------------------------------------------
# llama.cpp


def run_llamacpp(jobs: list[dict]) -> list[list[dict]]:
    """tests/llamacpp_runner.py in the llama.cpp environment: per job, per prompt, ids, text, logits, greedy."""
    if not LLAMACPP_PYTHON.is_file():
        pytest.fail(f"llama.cpp's environment {LLAMACPP_PYTHON.parent.parent} is missing: run `make llamacpp`.")
    done = subprocess.run(
        [str(LLAMACPP_PYTHON), str(RUNNER)],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def greedy(model, ids: list[int]) -> list[int]:
    """decoderlab's greedy continuation; the attention mask is given, since generate would otherwise mask every
    token equal to pad_token_id (the character tokenizer's id 0 is the newline)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_llamacpp_runs_the_f32_export_like_decoderlab(tokenizers, randomize, tmp_path):
    """llama.cpp itself loads each f32 file: it tokenizes every text to the checkpoint tokenizer's ids (and back
    to the text), its last-token logits are decoderlab's within 1e-3, and 8 greedy tokens through its KV cache
    are decoderlab's. It protects what only llama.cpp checks: that q/k rows are in the pair layout its RoPE
    rotates, its tokenizer model and pre-tokenizer, head_dim, GQA, and the fallback to token_embd when tied."""
    models, jobs = {}, []
    for name, (kind, overrides) in CASES.items():
        tokenizer = tokenizers[kind]
        model = llama_model(randomize, **{"vocab_size": len(tokenizer), **overrides})
        out = convert_to_gguf(checkpoint(tmp_path / name, model, tokenizer), tmp_path / f"{name}.gguf")
        models[name] = (model, tokenizer)
        jobs.append({"model": str(out), "prompts": TEXTS, "new_tokens": NEW_TOKENS, "n_ctx": 128})
    for (name, (model, tokenizer)), results in zip(models.items(), run_llamacpp(jobs)):
        for text, result in zip(TEXTS, results):
            ids = tokenizer(text).input_ids
            assert result["ids"] == ids, (name, text)
            assert result["text"] == text, name
            expected = logits(model, ids)[-1]
            torch.testing.assert_close(
                torch.tensor(result["last_logits"], dtype=torch.float64), expected.double(), atol=1e-3, rtol=0
            )
            assert result["greedy"] == greedy(model, ids), (name, text)


# llama.cpp's own kernels on smaller files: max |logit difference| / max |logit| (measured well below these)
LLAMACPP_RELATIVE_TOLERANCE = {"f32": 1e-4, "f16": 5e-3, "bf16": 3e-2, "q8_0": 3e-2}


@pytest.mark.slow
def test_llamacpp_runs_every_outtype_within_its_tolerance(tokenizers, randomize, tmp_path):
    """Each --outtype file runs in llama.cpp, last-token logits within the stated fraction of the largest logit
    of decoderlab's (f32 1e-4, f16 5e-3, bf16 and q8_0 3e-2), for a character model (llama architecture) and a
    tied BPE model with QK-norm (qwen3 architecture)."""
    models, jobs = [], []
    bpe = {"tie_word_embeddings": True, "num_key_value_heads": 2, "qk_norm": True}
    for kind, overrides in (("char", {}), ("bpe", bpe)):
        tokenizer = tokenizers[kind]
        model = llama_model(randomize, len(tokenizer), **overrides)
        src = checkpoint(tmp_path / kind, model, tokenizer)
        for outtype in LLAMACPP_RELATIVE_TOLERANCE:
            out = convert_to_gguf(src, tmp_path / f"{kind}-{outtype}.gguf", outtype)
            models.append((kind, outtype, model, tokenizer))
            jobs.append({"model": str(out), "prompts": TEXTS[:2], "new_tokens": 0, "n_ctx": 128})
    for (kind, outtype, model, tokenizer), results in zip(models, run_llamacpp(jobs)):
        for text, result in zip(TEXTS[:2], results):
            expected = logits(model, tokenizer(text).input_ids)[-1].double()
            difference = (
                torch.tensor(result["last_logits"], dtype=torch.float64) - expected
            ).abs().max() / expected.abs().max()
            assert difference < LLAMACPP_RELATIVE_TOLERANCE[outtype], (kind, outtype, difference.item())


@pytest.mark.slow
def test_llamacpp_reads_no_window_from_llama_or_qwen3_files(tokenizers, randomize, tmp_path, monkeypatch):
    """Why the export refuses sliding layers: a llama or qwen3 file that also says attention.sliding_window=3 (the key
    llama.cpp reads for the architectures it windows) runs in llama.cpp, and in transformers' GGUF loader, as the same
    weights with every layer full (last-token logits within 1e-3 after 24 tokens, eight windows), not as the model with
    the window on every layer. Should a release start reading the key for these architectures, this fails, and the
    export can carry windows instead of refusing them."""
    tokenizer = tokenizers["char"]
    write = gguf_file.write_metadata

    def with_a_window(writer, *args):
        write(writer, *args)
        writer.add_sliding_window(3)

    monkeypatch.setattr(gguf_file, "write_metadata", with_a_window)
    text = TEXTS[0][:24]
    ids = tokenizer(text).input_ids
    models, jobs = {}, []
    for arch, qk_norm in (("llama", False), ("qwen3", True)):
        model = llama_model(randomize, len(tokenizer), qk_norm=qk_norm)
        out = convert_to_gguf(checkpoint(tmp_path / arch, model, tokenizer), tmp_path / f"{arch}.gguf")
        field = gguf.GGUFReader(out).fields[f"{arch}.attention.sliding_window"]
        assert int(field.parts[-1][0]) == 3
        windowed = llama_model(randomize, len(tokenizer), qk_norm=qk_norm, layer_types=[SLIDING, SLIDING],
                               sliding_window=3)  # fmt: skip
        windowed.load_state_dict(model.state_dict())
        models[arch] = (model, windowed, out)
        jobs.append({"model": str(out), "prompts": [text], "new_tokens": 0, "n_ctx": 128})
    for (arch, (model, windowed, out)), results in zip(models.items(), run_llamacpp(jobs)):
        llamacpp = torch.tensor(results[0]["last_logits"], dtype=torch.float64)
        full, slid = logits(model, ids)[-1].double(), logits(windowed, ids)[-1].double()
        torch.testing.assert_close(llamacpp, full, atol=1e-3, rtol=0, msg=arch)
        assert (llamacpp - slid).abs().max() > 1e-2, arch
        torch.testing.assert_close(logits(load_gguf(out, model.config), ids)[-1].double(), full, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------
# Bad input: a clear error, and nothing left in the output folder


def refused(src, out: Path, match: str, outtype: str = "f32") -> None:
    before = sorted(out.parent.iterdir()) if out.parent.is_dir() else None
    with pytest.raises(ValueError, match=match):
        convert_to_gguf(src, out, outtype)
    assert (sorted(out.parent.iterdir()) if out.parent.is_dir() else None) == before


@pytest.fixture
def char_checkpoint(tokenizers, randomize, tmp_path) -> Path:
    tokenizer = tokenizers["char"]
    return checkpoint(tmp_path / "src", llama_model(randomize, len(tokenizer)), tokenizer)


def test_unknown_outtype_is_refused(char_checkpoint, tmp_path, capsys):
    """An --outtype GGUF export does not offer (q4_0) is refused, naming the choices, from Python and the CLI."""
    refused(char_checkpoint, tmp_path / "out" / "m.gguf", r"Unknown outtype 'q4_0'; choose one of 'f32', 'f16'", "q4_0")
    with pytest.raises(SystemExit) as exit:
        run_command(main, ["--to", "gguf", str(char_checkpoint), str(tmp_path / "m.gguf"), "--outtype", "q4_0"])
    assert exit.value.code == 2 and "invalid choice: 'q4_0'" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()


def test_outtype_without_gguf_is_refused(char_checkpoint, tmp_path, capsys):
    """--outtype with --to llama is a mistake, not silently ignored."""
    with pytest.raises(SystemExit) as exit:
        run_command(main, ["--to", "llama", str(char_checkpoint), str(tmp_path / "llama"), "--outtype", "f16"])
    assert exit.value.code == 2 and "--outtype f16 applies to --to gguf only" in capsys.readouterr().err


def test_missing_output_folder_existing_file_and_folder_are_refused(char_checkpoint, tmp_path):
    """OUT's folder must exist; an existing OUT is never overwritten; a folder is not a file name."""
    refused(char_checkpoint, tmp_path / "nowhere" / "m.gguf", r"The folder of OUT, .*nowhere.*, does not exist")
    (tmp_path / "taken.gguf").write_bytes(b"keep")
    refused(char_checkpoint, tmp_path / "taken.gguf", r"exists; choose a new file name")
    assert (tmp_path / "taken.gguf").read_bytes() == b"keep"
    refused(char_checkpoint, tmp_path, r"is a folder; give the path of the .gguf file")


def test_a_checkpoint_that_is_not_decoderlab_is_refused(randomize, tmp_path):
    """A plain Llama checkpoint is pointed to --from llama first, before anything is written."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=66, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                 num_attention_heads=4)).save_pretrained(tmp_path / "llama")  # fmt: skip
    (tmp_path / "out").mkdir()
    refused(
        tmp_path / "llama", tmp_path / "out" / "m.gguf", r"holds a 'llama' checkpoint .* --to gguf expects 'decoderlab'"
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(norm_placement="post", mlp_type="plain"), r"norm_placement='post'.*\n.*mlp_type='plain'"),  # Llama's
        (dict(qk_norm=True, mlp_bias=True), r"A Qwen3 checkpoint .*\n  mlp_bias=True: Qwen3's MLP has no biases"),
        (
            dict(qk_norm=True, attention_bias=True, hidden_act="gelu"),
            r"exports to Qwen3 but not to GGUF.*\n  hidden_act='gelu': llama.cpp's Qwen3 MLP gates with SiLU.*\n"
            r"  attention_bias=True: transformers' GGUF loader builds Qwen3 without biases.*\n.*--to qwen3 instead",
        ),
        (
            dict(hidden_act="gelu_pytorch_tanh"),
            r"hidden_act='gelu_pytorch_tanh': llama.cpp's Llama MLP gates with SiLU",
        ),
        (dict(attention_bias=True, mlp_bias=True), r"attention_bias=True.*\n.*mlp_bias=True"),
        (dict(qk_norm=True, hidden_act="relu2"), r"hidden_act='relu2': llama.cpp's Qwen3 MLP gates with SiLU"),
        (dict(final_logit_softcapping=30.0), r"final_logit_softcapping=30.0: Llama returns its logits uncapped"),
        (dict(qk_norm=True, value_residual=True), r"value_residual=True: Qwen3's layers use their own values only"),
        (
            dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
            r"rope_parameters\['rope_type'\]='linear'",
        ),
        # the per-layer layouts: --to qwen3 keeps sliding layers, but neither GGUF reader does for qwen3 files
        (
            dict(qk_norm=True, layer_types=[SLIDING, FULL], sliding_window=4),
            r"exports to Qwen3 but not to GGUF.*\n  layer_types=\['sliding_attention', 'full_attention'\]: layer 0 "
            r"is 'sliding_attention' \(sliding_window=4\), but llama.cpp's qwen3 graph and transformers' GGUF loader "
            r"read no window for qwen3 files: both would attend to every earlier token in every layer\n.*--to qwen3 "
            r"instead",
        ),
        (
            dict(layer_types=[SLIDING, SLIDING], sliding_window=4),
            r"A Llama checkpoint .*\n  layer_types=.*: layers 0, 1 are 'sliding_attention'",
        ),
        (
            dict(qk_norm=True, no_rope_layers=[0, 1]),
            r"A Qwen3 checkpoint .*\n  no_rope_layers=\[0, 1\]: layer 0 skips RoPE",
        ),
        (dict(no_rope_layer_interval=2), r"A Llama checkpoint .*\n  no_rope_layers=\[1, 0\]: layer 1 skips RoPE"),
        (
            dict(qk_norm=True, attention_sinks=True),
            r"A Qwen3 checkpoint .*\n  attention_sinks=True: every layer's softmax has a learned sink logit",
        ),
    ],
)
def test_configurations_gguf_cannot_carry_are_refused_field_by_field(overrides, match, tokenizers, randomize, tmp_path):
    """What --to llama (without QK-norm) or --to qwen3 (with it) refuses is refused with its field-by-field error
    (RoPE-free layers and attention sinks among them, each naming its layers); what Llama or Qwen3 has but llama.cpp's
    graph or transformers' GGUF loader would not read back (another activation, biases, scaled RoPE, Qwen3's sliding
    layers) is refused too, each field named with its value and the family's --to flag offered instead, rather than
    written into a file that computes something else."""
    tokenizer = tokenizers["char"]
    model = llama_model(randomize, len(tokenizer), **overrides)
    (tmp_path / "out").mkdir()
    refused(checkpoint(tmp_path / "src", model, tokenizer), tmp_path / "out" / "m.gguf", match)


def test_tokenizers_gguf_cannot_carry_are_refused(randomize, tmp_path):
    """A character tokenizer with non-ASCII characters (not one byte each) and a checkpoint without a tokenizer
    are refused with the reason, not exported with ids that would differ."""
    tokenizer = train_char_tokenizer(["naïve café"])
    model = llama_model(randomize, len(tokenizer))
    (tmp_path / "out").mkdir()
    refused(
        checkpoint(tmp_path / "src", model, tokenizer),
        tmp_path / "out" / "m.gguf",
        r"characters outside ASCII \['é', 'ï'\]",
    )
    model.save_pretrained(tmp_path / "bare")
    refused(
        tmp_path / "bare", tmp_path / "out" / "m.gguf", r"No tokenizer.json in .*: a GGUF file carries its tokenizer"
    )


def test_a_failure_while_writing_leaves_nothing_behind(char_checkpoint, tmp_path, monkeypatch):
    """An error halfway through the tensors (here: the disk 'fills up') removes the temporary file: OUT's folder
    is as it was, and OUT does not exist."""
    import gguf

    def full_disk(self, tensor, tensor_endianess=None):
        raise OSError("No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full_disk)
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError, match="No space left"):
        convert_to_gguf(char_checkpoint, tmp_path / "out" / "m.gguf")
    assert list((tmp_path / "out").iterdir()) == []


def test_cli_writes_the_file_and_reports_errors(char_checkpoint, tmp_path, caplog, capsys):
    """`python -m decoderlab.convert --to gguf SRC OUT --outtype q8_0` writes OUT and logs its summary; a refused
    export exits with status 1 and the error, not a traceback."""
    out = tmp_path / "m.gguf"
    with caplog.at_level("INFO", logger="decoderlab.export.gguf_file"):
        main(["--to", "gguf", str(char_checkpoint), str(out), "--outtype", "q8_0"])
    assert out.read_bytes()[:4] == b"GGUF" and f"Wrote {out}" in caplog.text and "q8_0" in caplog.text
    with pytest.raises(SystemExit) as exit:
        run_command(main, ["--to", "gguf", str(char_checkpoint), str(out)])
    assert exit.value.code == 1 and "exists; choose a new file name" in capsys.readouterr().err
