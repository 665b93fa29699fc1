"""training/finetune.py: fine-tuning lowers the validation loss and leaves a complete checkpoint and card; LoRA
trains only its adapters and merges exactly; bad input stops before training; a killed run resumes exactly;
transformers' Trainer and PEFT's get_peft_model work on a decoderlab model.

The base is a 2-layer, 32-wide model with Tiny Shakespeare's 65-character vocabulary; the data are the
first lines of Tiny Shakespeare's speeches, as prompt/completion pairs ("ROMEO:\\n" -> the line) and as
chats ("Speak as ROMEO" -> the line), made by training/shakespeare_sft_data.py from the first 95,000
characters. Runs take a few seconds each.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import datasets
import pytest
import torch
from huggingface_hub import ModelCard
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

import decoderlab
from tests.paths import INPUT_TXT, REPO_ROOT
from tests.training_runs import (
    char_model_config,
    char_tokenizer_without_special_tokens,
    final_eval_loss,
    folder_snapshot,
    kill_when_saved,
    metrics,
    save_checkpoint_folder,
    subprocess_env,
    train_losses,
)
from training import evaluate, finetune
from training.data import train_char_tokenizer
from training.finetune_args import FinetuneConfig
from training.sft_data import DEFAULT_CHAT_TEMPLATE
from training.shakespeare_sft_data import write_speech_data

FINETUNE = REPO_ROOT / "training" / "finetune.py"

pytestmark = pytest.mark.usefixtures("one_thread")  # here and in the subprocesses: the same arithmetic


@pytest.fixture(scope="module")
def corpus() -> str:
    return INPUT_TXT.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory, corpus) -> pathlib.Path:
    """A freshly initialised tiny decoderlab model with a character tokenizer, saved like a pretraining output."""
    tokenizer = train_char_tokenizer([corpus])
    torch.manual_seed(0)
    model = decoderlab.DecoderLabForCausalLM(char_model_config(tokenizer))
    return save_checkpoint_folder(model, tokenizer, tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def speech_data(tmp_path_factory, corpus) -> pathlib.Path:
    """{prompt_completion,chat}_{train,validation}.jsonl from about 580 and 120 speeches."""
    texts = {"train": corpus[:80_000], "validation": corpus[80_000:95_000]}
    return write_speech_data(texts, tmp_path_factory.mktemp("speeches"))


def finetune_argv(base, data, data_format: str, output_dir, *extra: str) -> list[str]:
    """A complete command line for a fine-tuning run that takes seconds."""
    return [
        "--model_name_or_path", str(base), "--data_format", data_format,
        "--train_file", str(data / f"{data_format}_train.jsonl"),
        "--validation_file", str(data / f"{data_format}_validation.jsonl"),
        "--block_size", "96", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "64",
        "--learning_rate", "3e-3", "--num_warmup_steps", "5", "--logging_steps", "5", "--eval_steps", "20",
        "--checkpointing_steps", "20", "--checkpoints_total_limit", "50", "--seed", "0",
        "--output_dir", str(output_dir), *extra,
    ]  # fmt: skip


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits


# ----------------------------------------------------------------------------------------------
# Whole runs


def test_finetuning_lowers_validation_loss_and_leaves_a_complete_checkpoint(tmp_path, base_checkpoint, speech_data):
    """Full fine-tuning on prompt/completion pairs lowers the loss on held-out completions (measured by
    evaluate.py before and after); the output loads with the Auto classes, reproduces that loss, keeps the
    base's tokenizer, records its configuration, and its card names the base model and the dataset."""
    validation = str(speech_data / "prompt_completion_validation.jsonl")
    measure = ["--data_file", validation, "--data_format", "prompt_completion", "--block_size", "96",
               "--model_card", "false"]  # fmt: skip
    before = evaluate.main([str(base_checkpoint), *measure, "--output_file", str(tmp_path / "before.json")])
    out = tmp_path / "out"
    finetune.main(finetune_argv(base_checkpoint, speech_data, "prompt_completion", out, "--max_train_steps", "60"))

    assert final_eval_loss(out) < before["eval_loss"] - 1.0  # from about ln(65) = 4.2
    after = evaluate.main([str(out), *measure, "--output_file", str(tmp_path / "after.json")])
    assert after["eval_loss"] == pytest.approx(final_eval_loss(out), rel=1e-6)
    assert after["scored_tokens"] == before["scored_tokens"]  # the same completion tokens, prompts excluded

    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, decoderlab.DecoderLabForCausalLM)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(base_checkpoint).get_vocab()
    import yaml

    resolved = FinetuneConfig(**yaml.safe_load((out / "training_config.yaml").read_text()))
    assert resolved.max_train_steps == 60 and resolved.data_format == "prompt_completion"
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == base_checkpoint.name  # a local base is named by its folder, never its path
    assert {r.dataset_name for r in card.data.eval_results} == {
        f"{speech_data.name}/prompt_completion_validation.jsonl"
    }
    assert "prompt_completion_train.jsonl" in card.text and str(tmp_path) not in card.content


def test_rerunning_a_finished_fine_tuning_run_leaves_it_as_it_was(tmp_path, base_checkpoint, speech_data, capsys):
    """The same LoRA (merged) command again with --resume_from_checkpoint latest says it is already finished and
    rewrites nothing: not the merged weights, the adapter folder, the card or the metrics."""
    out = tmp_path / "out"
    argv = finetune_argv(base_checkpoint, speech_data, "chat", out, "--max_train_steps", "10", "--use_lora",
                         "--merge_lora", "--resume_from_checkpoint", "latest")  # fmt: skip
    finetune.main(argv)
    finished = folder_snapshot(out)
    assert "adapter/adapter_model.safetensors" in finished and "README.md" in finished
    capsys.readouterr()
    finetune.main(argv)
    assert "already finished at step 10" in capsys.readouterr().out
    assert folder_snapshot(out) == finished


def test_lora_trains_only_adapters_and_the_merged_model_equals_base_plus_adapter(
    tmp_path, base_checkpoint, speech_data
):
    """A LoRA chat run with --merge_lora: the adapter file holds only LoRA weights; in the merged model the
    layers LoRA did not target are bit-identical to the base and the targeted ones changed; the merged model's
    logits equal the base with the saved adapter applied (peft); the default chat template is saved."""
    out = tmp_path / "lora"
    lora = ["--use_lora", "--lora_target_modules", "q_proj,v_proj", "--lora_r", "4", "--merge_lora"]
    finetune.main(
        finetune_argv(base_checkpoint, speech_data, "chat", out, "--max_train_steps", "30", "--learning_rate", "1e-2",
                      *lora)
    )  # fmt: skip

    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_A" in name or "lora_B" in name for name in adapter)
    assert any("lora_B" in name and tensor.abs().max() > 0 for name, tensor in adapter.items())  # B starts at 0
    base = AutoModelForCausalLM.from_pretrained(base_checkpoint)
    merged = AutoModelForCausalLM.from_pretrained(out)
    merged_weights = merged.state_dict()
    for name, weight in base.state_dict().items():
        targeted = ".q_proj." in name or ".v_proj." in name
        assert torch.equal(weight, merged_weights[name]) != targeted, name

    input_ids = torch.randint(0, base.config.vocab_size, (2, 40))
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_checkpoint), out / "adapter")
    torch.testing.assert_close(logits(merged, input_ids), logits(with_adapter, input_ids), atol=1e-5, rtol=1e-5)
    assert AutoTokenizer.from_pretrained(out).chat_template == DEFAULT_CHAT_TEMPLATE


def test_lora_keeps_the_best_evaluations_adapter(tmp_path, base_checkpoint, speech_data):
    """load_best_model_at_end, which the fine-tuning recipes turn on, with LoRA: the folder holds the adapter of the
    best periodic evaluation, merged. "Best" is made the highest loss here (greater_is_better), so it is the first
    evaluation and not the last step: the final evaluation, over the same blocks, equals that evaluation's loss, and
    the merged model in the folder reproduces it."""
    out = tmp_path / "best"
    finetune.main(finetune_argv(base_checkpoint, speech_data, "prompt_completion", out, "--max_train_steps", "60",
                                "--use_lora", "--merge_lora", "--load_best_model_at_end", "true",
                                "--greater_is_better", "true"))  # fmt: skip
    evals = {r["step"]: r["eval_loss"] for r in metrics(out) if "eval_loss" in r and "best_global_step" not in r}
    final = metrics(out)[-1]
    assert final["best_global_step"] == 20 and evals[20] > evals[40]  # the first evaluation, the worst
    assert final["eval_loss"] == pytest.approx(evals[20], rel=1e-6)
    validation = str(speech_data / "prompt_completion_validation.jsonl")
    measured = evaluate.main([str(out), "--data_file", validation, "--data_format", "prompt_completion",
                              "--block_size", "96", "--model_card", "false", "--output_file", str(tmp_path / "e.json")])  # fmt: skip
    assert measured["eval_loss"] == pytest.approx(evals[20], rel=1e-5)
    assert json.loads((out / "run_info.json").read_text())["saved_weights_step"] == 20


BAD_INPUT = {
    "tokenizer missing": ([], "has no tokenizer: none of tokenizer.json"),
    "unknown LoRA target": (
        ["--use_lora", "--lora_target_modules", "q_proj,qkv"],
        r"names \['qkv'\], which this model does not have.*\['down_proj', 'embed_tokens', 'gate_proj', "
        r"'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]",
    ),
    "missing column": (["--completion_column_name", "answer"], r"needs the column\(s\) \['prompt', 'answer'\]"),
    "prompt longer than the block": (["--block_size", "8", "--overlong_prompt", "refuse"], "block_size=8"),
    "llama checkpoint": ([], r"is a llama checkpoint\. Convert it .*python -m decoderlab\.convert --from llama"),
    "tokenizer bigger than the vocabulary": ([], r"The tokenizer has \d+ tokens but .* embeds only vocab_size=16"),
    "tokenizer without special tokens": ([], r"has no eos_token and no pad_token .* Add --add_special_tokens"),
    "new token with an unmerged adapter": (["--add_special_tokens", "--use_lora"], r"Add --merge_lora"),
    "Muon on LoRA adapters": (
        ["--use_lora", "--optimizer", "muon"], r"optimizer=muon with use_lora=True: .*--optimizer adamw",
    ),
}


def old_char_checkpoint(folder: pathlib.Path, tokenizer) -> pathlib.Path:
    """A tiny checkpoint saved before the scripts' tokenizers had special tokens: the characters of ``tokenizer``
    only (ids 0..64), no EOS, padding or BOS, in the tokenizer, config or generation config."""
    chars = [token for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if len(token) == 1]
    old = char_tokenizer_without_special_tokens(["".join(chars)])
    torch.manual_seed(0)
    return save_checkpoint_folder(decoderlab.DecoderLabForCausalLM(char_model_config(old)), old, folder)


def test_add_special_tokens_fine_tunes_an_old_checkpoint_into_one_tools_accept(tmp_path, base_checkpoint, speech_data):
    """--add_special_tokens on a checkpoint without special tokens: <|endoftext|> becomes id 65 after the 65
    characters, the embeddings grow to 66 rows, and the output's tokenizer, config and generation config all
    name it as EOS, padding and BOS."""
    base = old_char_checkpoint(tmp_path / "old", AutoTokenizer.from_pretrained(base_checkpoint))
    out = tmp_path / "out"
    finetune.main(
        finetune_argv(base, speech_data, "prompt_completion", out, "--max_train_steps", "3", "--add_special_tokens")
    )
    tokenizer, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    old_vocab = AutoTokenizer.from_pretrained(base).get_vocab()
    assert tokenizer.get_vocab() == {**old_vocab, "<|endoftext|>": 65}
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (65, 65, 65)
    assert model.config.vocab_size == 66 and model.get_input_embeddings().num_embeddings == 66
    for config in (model.config, model.generation_config):
        assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (65, 65, 65)


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_stops_before_training(tmp_path, base_checkpoint, speech_data, case):
    """Each problem is a ValueError naming it before the first training step (no metrics.jsonl, no checkpoint)."""
    extra, message = BAD_INPUT[case]
    base = base_checkpoint
    if case == "tokenizer missing":
        base = tmp_path / "no_tokenizer"
        shutil.copytree(base_checkpoint, base, ignore=shutil.ignore_patterns("tokenizer*"))
    if case == "llama checkpoint":
        base = tmp_path / "llama"
        tokenizer = AutoTokenizer.from_pretrained(base_checkpoint)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2)  # fmt: skip
        save_checkpoint_folder(LlamaForCausalLM(config), tokenizer, base)
    if case == "tokenizer bigger than the vocabulary":
        base = tmp_path / "small_vocab"
        shutil.copytree(base_checkpoint, base)
        config = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps({**config, "vocab_size": 16}))
    if case in ("tokenizer without special tokens", "new token with an unmerged adapter"):
        base = old_char_checkpoint(tmp_path / "old", AutoTokenizer.from_pretrained(base_checkpoint))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        finetune.main(finetune_argv(base, speech_data, "prompt_completion", out, "--max_train_steps", "5", *extra))
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("step_*"))


@pytest.mark.slow
def test_sigkilled_lora_chat_run_resumes_to_the_same_losses(tmp_path, base_checkpoint, speech_data):
    """A LoRA run on padded chat rows, killed with SIGKILL and resumed with --resume_from_checkpoint latest,
    logs the same training losses and final validation loss as an uninterrupted run (weights, AdamW moments,
    schedule, RNG, e.g. LoRA dropout's, and the data position all restore; 1e-6 allows a last-bit difference).
    Its unmerged output is the adapter alone, which AutoModelForCausalLM loads onto the base."""
    steps = ["--max_train_steps", "120", "--checkpointing_steps", "10", "--eval_steps", "40"]
    lora = ["--use_lora", "--lora_target_modules", "q_proj,k_proj,v_proj,o_proj,up_proj", "--packing", "false"]
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    finetune.main(finetune_argv(base_checkpoint, speech_data, "chat", reference, *steps, *lora))

    command = [
        sys.executable,
        str(FINETUNE),
        *finetune_argv(base_checkpoint, speech_data, "chat", interrupted, *steps, *lora),
    ]
    kill_when_saved(command, interrupted / "step_20")
    assert not (interrupted / "step_120").exists(), "the kill came after the last checkpoint: nothing was resumed"
    finetune.main(
        finetune_argv(base_checkpoint, speech_data, "chat", interrupted, *steps, *lora, "--resume_from_checkpoint", "latest")
    )  # fmt: skip
    expected, resumed = train_losses(reference), train_losses(interrupted)
    assert sorted(resumed) == sorted(expected)
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], abs=1e-6), step
    assert final_eval_loss(interrupted) == pytest.approx(final_eval_loss(reference), abs=1e-6)

    assert (interrupted / "adapter_config.json").is_file() and not (interrupted / "config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(interrupted)  # peft installed: the base plus this adapter
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_checkpoint), interrupted)
    input_ids = torch.randint(0, loaded.config.vocab_size, (2, 40))
    base_logits = logits(AutoModelForCausalLM.from_pretrained(base_checkpoint), input_ids)
    torch.testing.assert_close(logits(loaded, input_ids), logits(with_adapter, input_ids), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(loaded, input_ids), base_logits, atol=1e-3)


@pytest.mark.slow
def test_two_processes_weigh_each_target_as_one_process_does(tmp_path, base_checkpoint, speech_data):
    """Padded prompt/completion rows of different lengths, 2 torchrun processes each taking 2 micro-batches of
    2 rows per step, against 1 process of batch 8 without accumulation: the same rows per step and the same loss,
    the mean over every completion token of the step, whichever process and micro-batch holds it (the count
    is summed over processes). Averaging each process's or micro-batch's mean instead would weigh a short
    completion's tokens more than a long one's (6e-4 apart by step 5 here). Tolerance 1e-4 as for pretraining's DDP
    test (sums in another order)."""
    steps = ["--max_train_steps", "16", "--checkpointing_steps", "none", "--eval_steps", "none", "--packing", "false"]
    single, parallel = tmp_path / "single", tmp_path / "parallel"
    finetune.main(finetune_argv(base_checkpoint, speech_data, "prompt_completion", single, *steps,
                                "--per_device_train_batch_size", "8"))  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv = finetune_argv(base_checkpoint, speech_data, "prompt_completion", parallel, *steps,
                         "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2")  # fmt: skip
    result = subprocess.run([*launcher, str(FINETUNE), *argv], env=subprocess_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    expected, got = train_losses(single), train_losses(parallel)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-4), step
    assert final_eval_loss(parallel) == pytest.approx(final_eval_loss(single), abs=1e-4)


# ----------------------------------------------------------------------------------------------
# The tools users already fine-tune with


def test_transformers_trainer_and_peft_train_a_decoderlab_model(tmp_path, corpus):
    """transformers.Trainer trains a decoderlab model (the loss falls over 30 steps); PEFT's get_peft_model
    wraps it with LoRA on q_proj/v_proj, and a Trainer run then changes exactly the LoRA weights."""
    tokenizer = train_char_tokenizer([corpus])
    ids = torch.tensor(tokenizer(corpus[:30_000], add_special_tokens=False)["input_ids"])
    blocks = ids[: len(ids) // 32 * 32].view(-1, 32).tolist()
    dataset = datasets.Dataset.from_dict({"input_ids": blocks, "labels": blocks})
    model = decoderlab.DecoderLabForCausalLM(char_model_config(tokenizer, max_position_embeddings=32))

    def run(model, steps: int) -> list[float]:
        arguments = TrainingArguments(
            output_dir=str(tmp_path / "trainer"), max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
            logging_steps=5, save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=model, args=arguments, train_dataset=dataset)
        trainer.train()
        return [record["loss"] for record in trainer.state.log_history if "loss" in record]

    losses = run(model, 30)
    assert losses[-1] < losses[0] - 0.5

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 2 * 2 and all(".lora_A." in n or ".lora_B." in n for n in trainable)  # layers x A/B
    before = {name: p.detach().clone() for name, p in peft_model.named_parameters()}
    run(peft_model, 10)
    changed = {name for name, p in peft_model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == trainable
