"""The character tokenizer takes any text: characters it has not seen become <|unk|>, where tools hand it text of
their own (AutoTokenizer, transformers' pipeline, EleutherAI's lm-evaluation-harness). Before, a digit or an accent
stopped each of them with "WordLevel error: Missing [UNK] token from the vocabulary"."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import decoderlab
from tests.paths import INPUT_TXT
from tests.training_runs import char_model_config, save_checkpoint_folder
from training.data import train_char_tokenizer

TEXT = "Café 1234"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, randomize):
    """A tiny character-level checkpoint of Tiny Shakespeare's vocabulary (no digits, no accents)."""
    tokenizer = train_char_tokenizer([INPUT_TXT.read_text(encoding="utf-8")])
    torch.manual_seed(0)
    model = randomize(decoderlab.DecoderLabForCausalLM(char_model_config(tokenizer)))
    return save_checkpoint_folder(model, tokenizer, tmp_path_factory.mktemp("unk") / "checkpoint")


def test_auto_tokenizer_and_pipeline_take_text_outside_the_vocabulary(checkpoint):
    """AutoTokenizer encodes "Café 1234" with <|unk|> (its registered unk_token) for é and the digits it has not
    seen, one per character, and
    pipeline("text-generation") continues it: greedy, the same continuation as generate() on those ids."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    unk = tokenizer.unk_token_id
    assert tokenizer.unk_token == "<|unk|>" and unk == 66
    vocab = tokenizer.get_vocab()
    assert ids == [vocab.get(c, unk) for c in TEXT] and ids.count(unk) == 4  # é, 1, 2, 4 (Shakespeare has a 3)
    generator = pipeline("text-generation", model=str(checkpoint), device="cpu")
    out = generator(TEXT, max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    generated = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :]
    assert out == tokenizer.decode(generated, skip_special_tokens=True) and len(generated) == 8


def test_lm_eval_hflm_scores_text_with_digits_and_accents(checkpoint):
    """lm-eval's HFLM (its `hf` model) gives a rolling log-likelihood for a text with digits and accents, equal to
    the direct sum over its tokens (unknown characters scored as <|unk|>) after the prefix token."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    text = "In 1597, Roméo et Juliette: 2 actes."
    lm = HFLM(pretrained=str(checkpoint), device="cpu", batch_size=1)
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", doc={}, arguments=(text,), idx=0)])
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        log_probs = model(input_ids=torch.tensor([[tokenizer.bos_token_id] + ids[:-1]])).logits[0].log_softmax(-1)
    assert rolling == pytest.approx(log_probs[torch.arange(len(ids)), ids].sum().item(), rel=1e-4)
    assert tokenizer.unk_token_id in ids


@pytest.mark.slow
def test_lm_eval_command_runs_a_task_with_digits_and_accents(checkpoint, tmp_path):
    """`lm_eval run --model hf` on a local task whose lines hold digits and accents finishes with a finite bits per
    byte (it crashed in tokenizer.encode before the character tokenizer had an unknown token)."""
    lines = ["Café 1234 au lait", "Año 2024: 3 niños", "Ünïcödé 42"]
    (tmp_path / "lines.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "lines.yaml").write_text(
        f"task: unknown_lines\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'lines.jsonl'}\n"
        'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: bits_per_byte\n"
    )
    lm_eval = pathlib.Path(sys.executable).parent / "lm_eval"
    command = [str(lm_eval), "run", "--model", "hf", "--model_args", f"pretrained={checkpoint},trust_remote_code=True",
               "--include_path",
               str(tasks), "--tasks", "unknown_lines", "--device", "cpu", "--batch_size", "4", "--output_path",
               str(tmp_path / "results")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())["results"]
    assert math.isfinite(results["unknown_lines"]["bits_per_byte,none"])


@pytest.mark.slow
def test_trl_sft_trainer_trains_on_text_with_digits_and_accents(checkpoint, tmp_path):
    """TRL's SFTTrainer tokenizes a dataset of lines with digits and accents through the checkpoint's tokenizer
    (<|unk|> where the vocabulary lacks a character) and trains two steps to finite losses."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    lines = ["Café 1234 au lait", "Año 2024: 3 niños", "ROMEO: 42 ducats", "Ünïcödé 7"] * 2
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=2, per_device_train_batch_size=4, logging_steps=1,
                     report_to=[], save_strategy="no", use_cpu=True, max_length=32)  # fmt: skip
    trainer = SFTTrainer(model=str(checkpoint), args=args, train_dataset=Dataset.from_dict({"text": lines}))
    unk = trainer.processing_class.unk_token_id
    assert any(unk in ids for ids in trainer.train_dataset["input_ids"])
    trainer.train()
    losses = [record["loss"] for record in trainer.state.log_history if "loss" in record]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
