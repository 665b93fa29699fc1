"""training/evaluate.py: its loss and perplexity equal a direct computation written here, for packed text and
for completion-only scoring, and land in the model card; EleutherAI's lm-evaluation-harness runs the
checkpoint through its `hf` model type, without decoderlab installed, on local tasks."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from huggingface_hub import ModelCard

import decoderlab
from tests.paths import INPUT_TXT, REPO_ROOT, SHARED_DATA
from tests.training_runs import char_model_config, save_checkpoint_folder
from training import evaluate
from training.data import train_char_tokenizer

LM_EVAL_TASK = REPO_ROOT / "training" / "lm_eval_tasks" / "tiny_shakespeare.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")  # as in the other training tests


@pytest.fixture(scope="module")
def corpus() -> str:
    return INPUT_TXT.read_text(encoding="utf-8")


@pytest.fixture
def checkpoint(tmp_path, corpus, randomize):
    """A tiny decoderlab checkpoint whose weights are re-drawn so that losses are O(1) and differ per token."""
    tokenizer = train_char_tokenizer([corpus])
    model = randomize(decoderlab.DecoderLabForCausalLM(char_model_config(tokenizer)))
    return save_checkpoint_folder(model, tokenizer, tmp_path / "checkpoint")


def load(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def test_evaluate_matches_a_direct_computation_and_fills_the_model_card(tmp_path, corpus, checkpoint):
    """Packed text: the mean cross-entropy over every next-token prediction of the file's blocks of 32 characters.
    Prompt/completion (packed): the cross-entropy over the completion characters and the end-of-text token after
    them, of each pair run on its own.
    Both results go to the JSON file and the card's model-index, the second without removing the first."""
    text_file = tmp_path / "validation.txt"
    text_file.write_text(corpus[-3000:], encoding="utf-8")
    pairs = [
        ("ROMEO:\n", "Ay me!"),
        ("JULIET:\n", "O Romeo, Romeo!"),
        ("NURSE:\n", "Even or odd, of all days in the year"),
    ]
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    model, tokenizer = load(checkpoint)

    text = evaluate.main([str(checkpoint), "--data_file", str(text_file), "--block_size", "32", "--batch_size", "7"])
    ids = torch.tensor(tokenizer(corpus[-3000:])["input_ids"])
    blocks = ids[: len(ids) // 32 * 32].view(-1, 32)  # 93 blocks: the last batch of 7 is short
    with torch.no_grad():
        predictions = model(input_ids=blocks).logits[:, :-1]
    expected = F.cross_entropy(predictions.reshape(-1, predictions.shape[-1]), blocks[:, 1:].reshape(-1)).item()
    assert text["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert text["perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)
    assert text["scored_tokens"] == blocks.shape[0] * 31
    assert json.loads((checkpoint / "eval_results.json").read_text()) == text

    pair = evaluate.main([str(checkpoint), "--data_file", str(pairs_file), "--data_format", "prompt_completion"])
    total, count = 0.0, 0
    eos = [tokenizer.eos_token_id]  # every completion ends with the end-of-text token, which is scored too
    for prompt, completion in pairs:
        prompt_ids, completion_ids = tokenizer(prompt)["input_ids"], tokenizer(completion)["input_ids"] + eos
        example = torch.tensor([prompt_ids + completion_ids])
        with torch.no_grad():
            example_logits = model(input_ids=example).logits[0]
        n = len(prompt_ids)
        total += F.cross_entropy(example_logits[n - 1 : -1], example[0, n:], reduction="sum").item()
        count += len(completion_ids)
    assert pair["eval_loss"] == pytest.approx(total / count, rel=1e-6)
    assert pair["scored_tokens"] == count == sum(len(c) + 1 for _, c in pairs)

    card = ModelCard.load(checkpoint / "README.md")
    recorded = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert recorded[(f"{tmp_path.name}/pairs.jsonl", "loss")] == pair["eval_loss"]
    assert recorded[(f"{tmp_path.name}/validation.txt", "loss")] == text["eval_loss"]
    assert recorded[(f"{tmp_path.name}/validation.txt", "perplexity")] == text["perplexity"]
    assert "| Perplexity |" in card.text

    again = evaluate.main([str(checkpoint), "--data_file", str(text_file), "--block_size", "16"])  # replaces, not adds
    card = ModelCard.load(checkpoint / "README.md")
    losses = [r.metric_value for r in card.data.eval_results if r.dataset_name.endswith("validation.txt")
              and r.metric_type == "loss"]  # fmt: skip
    assert losses == [again["eval_loss"]] and again["eval_loss"] != text["eval_loss"]


def test_evaluate_names_a_missing_split(checkpoint):
    """A split the dataset does not have is an error listing the ones it has."""
    dataset = str(SHARED_DATA / "tiny_shakespeare")
    with pytest.raises(ValueError, match=r"has no split 'test'; its splits are \['train', 'validation'\]"):
        evaluate.main([str(checkpoint), "--dataset_name", dataset, "--split", "test"])


def test_evaluate_needs_exactly_one_data_source(checkpoint, tmp_path):
    """Neither or both of --dataset_name and --data_file is refused before the model is loaded."""
    with pytest.raises(ValueError, match="Pass exactly one of --dataset_name"):
        evaluate.main([str(checkpoint)])
    with pytest.raises(ValueError, match="Pass exactly one of --dataset_name"):
        evaluate.main([str(checkpoint), "--dataset_name", "x/y", "--data_file", str(tmp_path / "a.txt")])


def test_lm_eval_hflm_scores_a_checkpoint_given_only_its_folder(checkpoint):
    """lm-eval's HFLM with pretrained= and trust_remote_code=True only (no prefix_token_id) takes the tokenizer's
    BOS, <|endoftext|>, as its prefix token, and its log-likelihood of a continuation equals the direct sum of
    log-probabilities; a rolling log-likelihood conditions the first character on that prefix token."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(checkpoint), trust_remote_code=True, device="cpu", batch_size=2)
    model, tokenizer = load(checkpoint)
    assert lm.prefix_token_id == tokenizer.eos_token_id == 65
    pairs = [("ROMEO:", "\nAy me!"), ("First Citizen:", " Speak, speak.")]  # lm-eval moves a context's end space
    requests = [Instance("loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    scores = [score for score, _ in lm.loglikelihood(requests)]
    text = "JULIET:\nO Romeo!"
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", doc={}, arguments=(text,), idx=0)])

    def direct(context_ids: list[int], target: str) -> float:
        target_ids = tokenizer(target)["input_ids"]
        ids = torch.tensor([context_ids + target_ids])
        with torch.no_grad():
            log_probs = model(input_ids=ids).logits[0, :-1].log_softmax(-1)  # (T - 1, V): predicts ids[1:]
        return log_probs[torch.arange(len(context_ids) - 1, ids.shape[1] - 1), target_ids].sum().item()

    expected = [direct(tokenizer(context)["input_ids"], target) for context, target in pairs]
    assert scores == pytest.approx(expected, rel=1e-4)
    assert rolling == pytest.approx(direct([tokenizer.bos_token_id], text), rel=1e-4)


@pytest.mark.slow
def test_lm_evaluation_harness_runs_the_checkpoint_through_trust_remote_code(tmp_path, corpus, checkpoint):
    """`lm_eval run --model hf` in a process where `import decoderlab` fails, so the model is the checkpoint's
    own code (trust_remote_code=True) and the only model arguments are pretrained= and trust_remote_code=. On a
    task of short lines its bits per byte equal the direct computation: each line's log-likelihood given the
    prefix token (the tokenizer's BOS, <|endoftext|>) and its earlier characters. The repository's Tiny
    Shakespeare task (local data) runs in the same call."""
    lines = [line for line in corpus[-4000:].splitlines() if 10 < len(line) < 60][:25]
    (tmp_path / "lines.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_shakespeare.yaml").write_text(LM_EVAL_TASK.read_text())  # its data path is relative to the repo
    (tasks / "lines.yaml").write_text(
        f"task: shakespeare_lines\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'lines.jsonl'}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: bits_per_byte\n'
    )
    blocker = tmp_path / "blocker" / "decoderlab"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('decoderlab is not installed in this test')\n")

    lm_eval = pathlib.Path(sys.executable).parent / "lm_eval"
    model_args = f"pretrained={checkpoint},trust_remote_code=True"
    command = [str(lm_eval), "run", "--model", "hf", "--model_args", model_args, "--include_path", str(tasks),
               "--tasks", "shakespeare_lines,tiny_shakespeare_ppl", "--device", "cpu", "--batch_size", "16",
               "--output_path", str(tmp_path / "results")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(blocker.parent), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    run = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())["results"]

    model, tokenizer = load(checkpoint)
    log_likelihood = 0.0
    for line in lines:
        ids = tokenizer(line)["input_ids"]
        inputs = torch.tensor([[tokenizer.bos_token_id] + ids[:-1]])
        with torch.no_grad():
            log_probs = model(input_ids=inputs).logits[0].log_softmax(-1)
        log_likelihood += log_probs[torch.arange(len(ids)), ids].sum().item()
    n_bytes = sum(len(line.encode("utf-8")) for line in lines)
    expected = -log_likelihood / n_bytes / math.log(2)
    assert results["shakespeare_lines"]["bits_per_byte,none"] == pytest.approx(expected, rel=1e-4)
    assert 0 < results["tiny_shakespeare_ppl"]["bits_per_byte,none"] < 100
