"""Compiled decoding: ``decoderlab.generation`` and ``training/generate.py --compile``, on a CPU.

A CPU cannot show the speed (``benchmarks/gpu_check.py``'s rows do, on a GPU); what it shows is the switch itself:
off by default here, the same tokens as eager decoding when forced on (TorchDynamo's ``eager`` backend captures the
graphs without generating code), and a fall back to eager decoding, with one warning naming why, where compiling
cannot work. Also gpu_check's ``--only`` and budget, and the commit provenance records for a copied tree."""

import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check
from decoderlab.generation import compiled_decoding_is_on, generate, set_compiled_decoding
from tests.paths import REPO_ROOT
from training import generate as generate_script
from training.data import train_char_tokenizer
from training.models import build_model

GREEDY = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
SAMPLED = dict(max_new_tokens=12, min_new_tokens=12, do_sample=True, temperature=0.8, top_k=20)


def decode(model, prompt, seed=0, **options):
    torch.manual_seed(seed)
    with torch.no_grad():
        return generate(model, prompt, **options)


@pytest.fixture
def model_and_prompt(tiny_model):
    model = tiny_model()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model, torch.randint(1, model.config.vocab_size, (1, 6))


def test_auto_is_off_on_a_cpu_and_on_gives_eager_tokens(model_and_prompt):
    """``"auto"`` leaves a CPU model eager with a dynamic cache; ``"on"`` with the eager backend really compiles the
    decoding step (transformers builds its compiled call) and gives eager decoding's greedy and sampled tokens."""
    model, prompt = model_and_prompt
    assert set_compiled_decoding(model, "auto") is False
    assert model.generation_config.cache_implementation is None and not compiled_decoding_is_on(model)
    eager_greedy, eager_sampled = decode(model, prompt, **GREEDY), decode(model, prompt, **SAMPLED)
    assert not hasattr(model, "_compiled_call")

    assert set_compiled_decoding(model, "on", backend="eager") is True
    assert model.generation_config.cache_implementation == "static"
    assert torch.equal(decode(model, prompt, **GREEDY), eager_greedy)
    assert torch.equal(decode(model, prompt, **SAMPLED), eager_sampled)
    assert hasattr(model, "_compiled_call") and compiled_decoding_is_on(model)  # no fallback happened


def test_a_backend_that_fails_falls_back_to_eager_with_one_warning(model_and_prompt, caplog):
    """A backend torch.compile cannot use: one warning naming the error, then the sample eager decoding draws from
    the same seed (the random state is restored), and eager decoding from then on."""
    model, prompt = model_and_prompt
    set_compiled_decoding(model, "off")
    eager = decode(model, prompt, seed=3, **SAMPLED)
    set_compiled_decoding(model, "on", backend="no_such_backend")
    with caplog.at_level(logging.WARNING, logger="decoderlab.generation"):
        fallen_back = decode(model, prompt, seed=3, **SAMPLED)
    assert torch.equal(fallen_back, eager)
    warnings = [r.getMessage() for r in caplog.records if r.name == "decoderlab.generation"]
    assert len(warnings) == 1 and "InvalidBackend" in warnings[0] and "no_such_backend" in warnings[0], warnings
    assert "\n" not in warnings[0]
    assert not compiled_decoding_is_on(model)


def test_a_model_that_cannot_use_a_static_cache_stays_eager(tiny_model, caplog):
    """``"on"`` for a config without a KV cache (``use_cache=False``): a warning saying so, eager decoding."""
    model = tiny_model(use_cache=False)
    with caplog.at_level(logging.WARNING, logger="decoderlab.generation"):
        assert set_compiled_decoding(model, "on", backend="eager") is False
    assert "use_cache=False" in caplog.text and not compiled_decoding_is_on(model)
    with pytest.raises(ValueError, match="compile='sometimes'"):
        set_compiled_decoding(model, "sometimes")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny character checkpoint saved as the training scripts save one (generation config included)."""
    folder = tmp_path_factory.mktemp("generate") / "ck"
    tokenizer = train_char_tokenizer(["ROMEO: O, she doth teach the torches to burn bright!\nJULIET: Ay me.\n"])
    torch.manual_seed(0)
    model = build_model({"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}, tokenizer, 32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_generate_script_compile_flag(checkpoint, capsys):
    """generate.py: the saved generation config keeps transformers' dynamic cache (a plain ``generate`` on a CPU is
    not slowed by an uncompiled static one);
    ``--compile on --compile_backend eager`` prints what ``--compile off`` and the default print on a CPU, across
    the sliding window (40 tokens in a 32-token window); an unknown ``--compile`` is refused."""
    assert json.loads((checkpoint / "generation_config.json").read_text()).get("cache_implementation") is None
    argv = [str(checkpoint), "--prompt", "ROMEO:", "--max_new_tokens", "40", "--seed", "0"]  # one sample
    texts = {}
    for flags in ((), ("--compile", "off"), ("--compile", "on", "--compile_backend", "eager")):
        generate_script.main([*argv, *flags])
        texts[flags] = capsys.readouterr().out
    assert len(set(texts.values())) == 1 and texts[()].startswith("ROMEO:"), texts
    with pytest.raises(SystemExit) as stop:
        generate_script.main([*argv, "--compile", "sometimes"])
    assert stop.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err


@pytest.mark.slow  # a fresh process: torch and transformers imported again
def test_generate_script_falls_back_with_a_one_line_warning(checkpoint, capsys):
    """generate.py, as a user runs it, with a backend that cannot compile: exit 0, the greedy text of ``--compile
    off``, and one stderr line that names why."""
    argv = [str(checkpoint), "--prompt", "ROMEO:", "--max_new_tokens", "20", "--greedy"]
    generate_script.main([*argv, "--compile", "off"])
    eager = capsys.readouterr().out
    done = subprocess.run([sys.executable, str(REPO_ROOT / "training" / "generate.py"), *argv, "--compile", "on",
                           "--compile_backend", "no_such_backend"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == eager
    lines = [line for line in done.stderr.splitlines() if "compil" in line]
    assert len(lines) == 1 and "no_such_backend" in lines[0] and "decoding eagerly" in lines[0], done.stderr


def test_gpu_check_only_and_budget(tmp_path, capsys):
    """gpu_check --dry_run --only runs just the named checks (their rows, in the JSON too); a check whose H200
    estimate would end past --budget_s (training: 190 s > 80 s) has a row saying it was skipped; an unknown name is
    refused, naming it."""
    out = tmp_path / "check.json"
    status = gpu_check.main(["--dry_run", "--only", "bf16", "generation_tokens", "training", "--budget_s", "80",
                             "--output_dir", str(tmp_path), "--json_out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    rows = {row["check"]: row for row in report["rows"]}
    assert status == 0 and report["checks"] == ["bf16", "generation_tokens", "training"]
    assert report["device"].startswith("cpu (dry run")
    assert set(rows) == {"bf16 logits vs LlamaForCausalLM", "compiled generate == eager greedy (GPT-2 small)",
                         "generate(cache_implementation='static') compiles on CUDA (pipeline)", "training"}, set(rows)  # fmt: skip
    assert rows["generate(cache_implementation='static') compiles on CUDA (pipeline)"]["passed"] is None  # CUDA only
    assert rows["compiled generate == eager greedy (GPT-2 small)"]["passed"] is True
    assert rows["compiled generate == eager greedy (GPT-2 small)"]["details"]["compiled"] is True
    assert rows["training"]["value"].startswith("skipped:") and rows["training"]["passed"] is None
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--dry_run", "--only", "generation", "speed_of_light"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "invalid choice: 'speed_of_light'" in err and "generation_tokens" in err


def git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.mark.slow  # a fresh process: torch and transformers imported again
def test_git_commit_trusts_only_the_projects_own_repository(tmp_path):
    """A copy of the project without its .git inside another repository records no commit (not the other one's),
    and benchmarks' provenance then records the commit given on the command line; the copy made a repository of
    its own records that repository's commit."""
    outer = tmp_path / "outer"
    project = outer / "exported"
    for package in ("training", "benchmarks", "decoderlab"):
        shutil.copytree(REPO_ROOT / package, project / package, ignore=shutil.ignore_patterns("__pycache__", "results"))
    git("init", "-q", cwd=outer)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "other", cwd=outer)
    # one process (torch imports once): the copy inside the other repository, then the copy as a repository itself
    script = """
import json, subprocess
from benchmarks.common import provenance
from training.checkpointing import git_commit
given = provenance(1, source_commit="abc1234")
before = [git_commit(), given["commit"], given.get("commit_source")]
user = ["-c", "user.name=t", "-c", "user.email=t@t"]
for args in (["init", "-q"], ["add", "-A"], [*user, "commit", "-q", "-m", "own"]):
    subprocess.run(["git", *args], check=True, capture_output=True)
own = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
given = provenance(1, source_commit="abc1234")
print(json.dumps([before, [git_commit(), given["commit"], given.get("commit_source")], own]))
"""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(project), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=project, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    before, after, own = json.loads(done.stdout.strip().splitlines()[-1])
    code, commit, source = before
    assert code == {"commit": None, "dirty": None} and commit == "abc1234" and "given" in source
    code, commit, source = after
    assert code == {"commit": own, "dirty": False} and commit == own and source is None


def test_explorer_generation_steps_compiled_equal_eager(model_and_prompt, caplog):
    """The explorer's step-by-step generation (``measure.generate_steps``), forced on with the eager backend (a
    static cache, transformers' compiled call for the one-token steps), records eager's tokens and probabilities,
    greedy and sampled; a backend that fails gives one warning and eager's steps."""
    from decoderlab.explore import measure

    model, prompt = model_and_prompt
    for temperature in (0.0, 0.8):
        options = dict(temperature=temperature, top_k=20, seed=5)
        eager = measure.generate_steps(model, prompt[0], 10, compile="off", **options)
        compiled = measure.generate_steps(model, prompt[0], 10, compile="on", backend="eager", **options)
        assert [s.token_id for s in compiled] == [s.token_id for s in eager]
        for a, b in zip(compiled, eager):
            assert a.probability == pytest.approx(b.probability, abs=1e-5)
    assert hasattr(model, "_compiled_call")
    with caplog.at_level(logging.WARNING, logger="decoderlab.generation"):
        fallen_back = measure.generate_steps(model, prompt[0], 10, compile="on", backend="no_such_backend", **options)
    assert [s.token_id for s in fallen_back] == [s.token_id for s in eager]
    assert len([r for r in caplog.records if "no_such_backend" in r.getMessage()]) == 1
