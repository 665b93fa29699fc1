"""Helpers for the tests that run training/'s scripts: a tiny base checkpoint, the runs' metrics, a SIGKILL at a
checkpoint, a folder's snapshot; and for the tests whose child processes must not see decoderlab."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import decoderlab
from tests.paths import INPUT_TXT, REPO_ROOT
from training.loop import METRICS_NAME, read_metrics


def char_model_config(tokenizer, max_position_embeddings: int = 128) -> decoderlab.DecoderLabConfig:
    """2 layers x 32 wide x 2 heads over the tokenizer's vocabulary, with its special tokens (None if it has none)."""
    return decoderlab.DecoderLabConfig(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=max_position_embeddings,
    )


def char_tokenizer_without_special_tokens(texts) -> PreTrainedTokenizerFast:
    """The character tokenizer as the training scripts made it before it had an end-of-text token:
    the sorted characters only, no EOS, padding or BOS; what older checkpoints hold."""
    chars = sorted(set().union(*map(set, texts)))
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)


def save_checkpoint_folder(model, tokenizer, folder: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def text_files_in(folder: pathlib.Path, train_chars: int) -> tuple[pathlib.Path, pathlib.Path]:
    """train.txt (Tiny Shakespeare's first ``train_chars`` characters) and validation.txt (characters 60,000 to
    66,000, past every training text the tests cut) in ``folder``: a run's --train_file and --validation_file."""
    corpus = INPUT_TXT.read_text(encoding="utf-8")
    (folder / "train.txt").write_text(corpus[:train_chars])
    (folder / "validation.txt").write_text(corpus[60_000:66_000])
    return folder / "train.txt", folder / "validation.txt"


def metrics(output_dir) -> list[dict]:
    return read_metrics(pathlib.Path(output_dir) / METRICS_NAME)


def train_losses(output_dir) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in metrics(output_dir) if "train_loss" in r}


def train_rows(output_dir) -> dict[int, dict]:
    """The training rows of a run's metrics.jsonl (not its evaluations), by step."""
    return {r["step"]: r for r in metrics(output_dir) if "train_loss" in r}


def final_eval_loss(output_dir) -> float:
    return [r["eval_loss"] for r in metrics(output_dir) if "eval_loss" in r][-1]


def subprocess_env() -> dict:
    """Offline, with one thread like the tests' own process (the ``one_thread`` fixture): the same arithmetic; and
    this checkout first on the path, so a script's ``training`` and ``decoderlab`` are the ones under test even
    where another checkout is the installed one."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": path}


def kill_when_saved(command: list[str], checkpoint: pathlib.Path, timeout: float = 300) -> None:
    """Run ``command`` and SIGKILL it as soon as the checkpoint folder ``checkpoint`` appears."""
    process = subprocess.Popen(command, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while not checkpoint.exists():
        assert process.poll() is None, f"the run ended before it could be killed:\n{process.stderr.read().decode()}"
        assert time.monotonic() < deadline, f"no checkpoint within {timeout} s"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stderr.close()
    assert process.returncode == -signal.SIGKILL


def folder_snapshot(folder: pathlib.Path) -> dict:
    """Every file under ``folder``: its bytes and modification time."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()
    }


# Code that makes `import decoderlab` fail in the process that runs it, as on a machine without the package
# (whatever sys.path holds, the editable install included): a checkpoint must then load through its own files
HIDE_DECODERLAB = """
import importlib.abc, sys
class HideDecoderlab(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "decoderlab":
            raise ModuleNotFoundError("decoderlab is hidden in this test process", name=name)
sys.meta_path.insert(0, HideDecoderlab())
"""


def run_without_decoderlab(code: str, args: dict, cwd: pathlib.Path, timeout: float = 600) -> dict:
    """Run ``code`` in a fresh interpreter in ``cwd`` with decoderlab hidden (``HIDE_DECODERLAB``), offline and on one
    thread (``subprocess_env``), no standard input; ``code`` reads ``args`` as JSON from ``sys.argv[1]`` and writes its
    results as JSON to ``result.json`` in ``cwd``, which this returns."""
    command = [sys.executable, "-c", HIDE_DECODERLAB + code, json.dumps(args)]
    run = subprocess.run(
        command, cwd=cwd, env=subprocess_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    if run.returncode:
        raise AssertionError(f"child process failed ({run.returncode}):\n{run.stderr[-4000:]}")
    return json.loads((cwd / "result.json").read_text())
