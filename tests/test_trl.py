"""Post-training with TRL: SFTTrainer padded and packed, DPOTrainer with a LoRA adapter, RewardTrainer on
AutoModelForSequenceClassification, GRPOTrainer with a toy reward, each on a checkpoint the way the training scripts
write it (character tokenizer, <|endoftext|> as EOS, padding and BOS).

The trainers run in child processes in which `import decoderlab` fails, so the model is the checkpoint's own code
(trust_remote_code=True), as for a user who has only transformers and TRL. Each child writes what TRL computed and the
same quantities computed by hand from the model's own forward on each sequence alone; the assertions are here.

What TRL 1.16 does with `packing=True` (its default strategy "bfd"): it turns padding-free on, so a batch is one row of
whole documents, `position_ids` restarting at 0 at each one and no `attention_mask` (plus `cu_seq_lens_q/k` for
flash-attention kernels). With eager or SDPA attention transformers' `create_causal_mask` finds the restarts in
`position_ids` and makes the causal mask block-diagonal, which works only because decoderlab hands the caller's
`position_ids` to it; learned and sinusoidal positions must restart too. The fast test checks that for every position
type and block layout with TRL's own collator; the slow one through SFTTrainer itself.
"""

import math

import pytest
import torch
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from decoderlab.modeling_decoderlab import DecoderLabForCausalLM
from tests.paths import INPUT_TXT
from tests.training_runs import char_model_config, run_without_decoderlab, save_checkpoint_folder
from training.data import train_char_tokenizer

# fp32 sums of a few dozen log-probabilities, computed on differently shaped batches
ATOL = 1e-4


@pytest.fixture(scope="module")
def lines() -> list[str]:
    """Short lines of Tiny Shakespeare, of different lengths (so padding and packing both matter)."""
    return [line for line in INPUT_TXT.read_text(encoding="utf-8").splitlines() if 10 < len(line) < 40][:48]


@pytest.fixture
def checkpoint(tmp_path, randomize):
    """``checkpoint(**config_overrides)``: the folder of a tiny character-level checkpoint as the training scripts write
    it, its weights re-drawn so that log-probabilities are O(1) and differ per token."""

    def make(**overrides) -> str:
        tokenizer = train_char_tokenizer([INPUT_TXT.read_text(encoding="utf-8")])
        config = char_model_config(tokenizer)
        for name, value in overrides.items():
            setattr(config, name, value)
        folder = tmp_path / "_".join(["checkpoint", *map(str, overrides.values())])
        return str(save_checkpoint_folder(randomize(DecoderLabForCausalLM(config)), tokenizer, folder))

    return make


# ----------------------------------------------------------------------------------------------
# Fast: TRL's padding-free collator against the model in this process


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_padding_free_batches_give_each_sequence_its_own_loss(tiny_model, all_block_variants, position_type,
                                                              attn_implementation):  # fmt: skip
    """TRL's padding-free batch (what SFTTrainer's packing makes: several sequences in one row, position_ids
    restarting at 0, no attention mask): each sequence's summed log-loss equals the loss of that sequence run alone,
    and the model's loss is their token-weighted mean, for every position type x block layout, eager and SDPA. A model
    that let a sequence attend to the one before it, or numbered positions across the row, fails here. (TRL passes
    use_cache=False; with a KV cache transformers' create_causal_mask does not look for packed sequences, in
    decoderlab as in Llama.)"""
    sequences = [torch.randint(0, 99, (n,)).tolist() for n in (7, 19, 2, 12, 9)]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": s} for s in sequences])
    assert "attention_mask" not in batch and batch["input_ids"].shape == (1, sum(map(len, sequences)))
    starts = batch["cu_seq_lens_q"].tolist()
    for name, overrides in all_block_variants.items():
        model = tiny_model(position_embedding_type=position_type, **overrides)
        model.config._attn_implementation = attn_implementation
        with torch.no_grad():
            packed = model(**batch, use_cache=False)  # as TRL calls it: with a cache, transformers looks for no packing
            log_probs = packed.logits[0].log_softmax(-1)  # (T, V)
            total = 0.0
            for sequence, start, end in zip(sequences, starts, starts[1:]):
                alone = model(input_ids=torch.tensor([sequence])).logits[0].log_softmax(-1)
                targets = torch.tensor(sequence[1:])
                expected = alone[torch.arange(len(sequence) - 1), targets].sum()
                got = log_probs[torch.arange(start, end - 1), targets].sum()
                torch.testing.assert_close(got, expected, rtol=0, atol=ATOL, msg=f"{name}: sequence at {start}")
                total -= expected
        n_targets = sum(len(s) - 1 for s in sequences)
        torch.testing.assert_close(packed.loss, total / n_targets, rtol=1e-5, atol=0, msg=name)


# ----------------------------------------------------------------------------------------------
# Slow: the trainers themselves, in processes without decoderlab

# Loading as a user would, and the hand computations each child compares TRL with
CHILD = """
import json, sys
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

args = json.loads(sys.argv[1])
torch.manual_seed(0)


def load(folder, auto=AutoModelForCausalLM, **kwargs):
    # trust_remote_code for the tokenizer too: it reads the config, whose auto_map would make transformers ask
    model = auto.from_pretrained(folder, trust_remote_code=True, **kwargs)
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    return model, AutoTokenizer.from_pretrained(folder, trust_remote_code=True)


def trl_args(config_class, **kwargs):
    return config_class(
        output_dir="out", report_to="none", save_strategy="no", use_cpu=True, logging_steps=1, seed=0, **kwargs
    )


@torch.no_grad()
def nll(model, ids):
    # -log p(ids[1:] | earlier ids), summed: the model's own forward on the sequence alone
    log_probs = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].log_softmax(-1)
    return -log_probs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum().item()


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def finish(result):
    result["decoderlab_imported"] = any(m.split(".")[0] == "decoderlab" for m in sys.modules)
    open("result.json", "w").write(json.dumps(result))
"""


def run_trainer(code: str, tmp_path, **args) -> dict:
    result = run_without_decoderlab(CHILD + code, args, tmp_path)
    assert result.pop("decoderlab_imported") is False
    return result


SFT_PADDED = """
from trl import SFTConfig, SFTTrainer

model, tokenizer = load(args["checkpoint"])
config = trl_args(SFTConfig, max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2, max_length=64)
trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": args["texts"]}),
                     processing_class=tokenizer)
batch = next(iter(trainer.get_train_dataloader()))
rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
model.eval()
with torch.no_grad():
    trl_loss = trainer.compute_loss(model, dict(batch)).item()
    row_log_probs = model(**batch, fused_lm_head=True).log_probs.sum(-1).tolist()
result = {"rows": rows, "padded": batch["attention_mask"].eq(0).any().item(), "eos": tokenizer.eos_token_id,
          "trl_loss": trl_loss, "trl_row_nll": [-x for x in row_log_probs], "row_nll": [nll(model, r) for r in rows]}
model.train()
trainer.train()
result["losses"] = logged(trainer, "loss")
trainer.save_model("saved")
# Accelerate left its bf16 autocast around model.forward; the weights themselves are float32, as saved
model = trainer.accelerator.unwrap_model(model, keep_fp32_wrapper=False).eval()
saved = AutoModelForCausalLM.from_pretrained("saved", trust_remote_code=True).eval()
result["saved_nll"], result["trained_nll"] = nll(saved, rows[0]), nll(model, rows[0])
finish(result)
"""


@pytest.mark.slow
@pytest.mark.cpu_features  # inductor's vectorised code, bf16 autocast or kernel timings
def test_sft_trainer_padded(tmp_path, checkpoint, lines):
    """SFTTrainer on plain text, padded batches, TRL's defaults otherwise (bf16 autocast, gradient checkpointing):
    on the first batch TRL's loss is the token-weighted mean of each row's loss on its own (its real tokens, the
    appended <|endoftext|> included, without padding), and so is each row's; six steps lower the loss; the model
    TRL saves loads again through its own code and gives the trained model's loss."""
    result = run_trainer(SFT_PADDED, tmp_path, checkpoint=checkpoint(), texts=lines)
    assert result["padded"]  # the rows differ in length: padding is in play
    assert all(row[-1] == result["eos"] for row in result["rows"])
    assert result["trl_row_nll"] == pytest.approx(result["row_nll"], abs=ATOL)
    n_targets = sum(len(row) - 1 for row in result["rows"])
    assert result["trl_loss"] == pytest.approx(sum(result["row_nll"]) / n_targets, rel=1e-5)
    losses = result["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert result["saved_nll"] == pytest.approx(result["trained_nll"], rel=1e-6)
    assert result["trained_nll"] < result["row_nll"][0]


SFT_PACKED = """
from trl import SFTConfig, SFTTrainer

result = {}
for name, folder in args["checkpoints"].items():
    for attn in ("eager", "sdpa"):
        model, tokenizer = load(folder, attn_implementation=attn)
        config = trl_args(SFTConfig, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2, max_length=64,
                          packing=True)
        trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": args["texts"]}),
                             processing_class=tokenizer)
        batch = next(iter(trainer.get_train_dataloader()))
        bounds = batch["cu_seq_lens_q"].tolist()
        row = batch["input_ids"][0].tolist()
        sequences = [row[a:b] for a, b in zip(bounds, bounds[1:])]
        model.eval()
        with torch.no_grad():
            trl_loss = trainer.compute_loss(model, dict(batch)).item()
            log_probs = model(**batch, fused_lm_head=True).log_probs[0]  # (T - 1): each token's next-token log-prob
            # the same row as one sequence, with no boundaries: what packing without them would compute
            plain = model(input_ids=batch["input_ids"], use_cache=False).logits[0].log_softmax(-1)
        targets = torch.tensor(row[1:] + [0])
        run = {
            "keys": sorted(batch), "position_ids": batch["position_ids"][0].tolist(), "bounds": bounds,
            "trl_loss": trl_loss, "nll": [nll(model, s) for s in sequences],
            "packed_nll": [-log_probs[a:b - 1].sum().item() for a, b in zip(bounds, bounds[1:])],
            "unbounded_nll": [-plain[torch.arange(a, b - 1), targets[a:b - 1]].sum().item()
                              for a, b in zip(bounds, bounds[1:])],
        }
        if name == "rope" and attn == "sdpa":
            model.train()
            trainer.train()
            run["losses"] = logged(trainer, "loss")
        result[f"{name}-{attn}"] = run
finish(result)
"""


@pytest.mark.slow
@pytest.mark.cpu_features  # inductor's vectorised code, bf16 autocast or kernel timings
def test_sft_trainer_packed(tmp_path, checkpoint, lines):
    """SFTTrainer with packing=True: TRL 1.16 makes padding-free rows of whole documents (position_ids restarting
    at each, no attention mask). For RoPE and learned positions, eager and SDPA, each document's loss inside the packed
    row equals its loss on its own, TRL's loss is their token-weighted mean, and a forward of the same row without
    the boundaries gives other losses (so the check can tell). Four packed steps lower the loss."""
    checkpoints = {"rope": checkpoint(), "learned": checkpoint(position_embedding_type="learned")}
    result = run_trainer(SFT_PACKED, tmp_path, checkpoints=checkpoints, texts=lines)
    assert sorted(result) == ["learned-eager", "learned-sdpa", "rope-eager", "rope-sdpa"]
    for name, run in result.items():
        assert "attention_mask" not in run["keys"] and "position_ids" in run["keys"], name
        bounds = run["bounds"]
        assert len(bounds) > 3, name  # several documents in the row
        assert [run["position_ids"][b] for b in bounds[:-1]] == [0] * (len(bounds) - 1), name
        assert run["packed_nll"] == pytest.approx(run["nll"], abs=ATOL), name
        n_targets = sum(b - a - 1 for a, b in zip(bounds, bounds[1:]))
        assert run["trl_loss"] == pytest.approx(sum(run["nll"]) / n_targets, rel=1e-5), name
        later = zip(run["unbounded_nll"][1:], run["nll"][1:])
        assert max(abs(u - n) for u, n in later) > 0.1, name
    losses = result["rope-sdpa"]["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0], losses


DPO_LORA = """
from peft import LoraConfig
from trl import DPOConfig, DPOTrainer

model, tokenizer = load(args["checkpoint"])
dataset = Dataset.from_dict(args["pairs"])
config = trl_args(DPOConfig, max_steps=5, per_device_train_batch_size=len(dataset), learning_rate=5e-2, beta=0.1,
                  bf16=False, max_length=64)
lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=lora)
examples = list(trainer.train_dataset)


def completion_logps(model):
    model.eval()
    return {
        key: [nll(model, e["prompt_ids"]) - nll(model, e["prompt_ids"] + e[key + "_ids"]) for e in examples]
        for key in ("chosen", "rejected")
    }


before = completion_logps(trainer.model)
trainer.train()
with trainer.model.disable_adapter():
    reference = completion_logps(trainer.model)
result = {
    "peft": type(trainer.model).__name__, "eos": tokenizer.eos_token_id, "before": before, "reference": reference,
    "ends": [(e["chosen_ids"][-1], e["rejected_ids"][-1]) for e in examples], "after": completion_logps(trainer.model),
    "losses": logged(trainer, "loss"), "logged_chosen": logged(trainer, "logps/chosen"),
    "logged_rejected": logged(trainer, "logps/rejected"), "margins": logged(trainer, "rewards/margins"),
    "lora_b": {n: p.abs().max().item() for n, p in trainer.model.named_parameters() if "lora_B" in n},
}
finish(result)
"""


@pytest.mark.slow
def test_dpo_trainer_with_a_lora_adapter(tmp_path, checkpoint):
    """DPOTrainer with a LoRA adapter on q_proj and v_proj (the reference is the model with the adapter off): its
    first logged log-probabilities of the chosen and rejected completions (each ending in <|endoftext|>) are the
    model's own log p(completion | prompt), its first loss is log 2 (policy = reference), and after five steps the
    loss is lower, the margin positive, every adapter matrix B has left zero, the chosen completions gained on the
    rejected ones, and with the adapter off the model is the one DPO started from."""
    pairs = {
        "prompt": ["ROMEO:\n", "JULIET:\n", "NURSE:\n", "KING HENRY:\n"],
        "chosen": ["Ay me!", "O Romeo, Romeo!", "Even or odd.", "Once more unto the breach."],
        "rejected": ["zzq xj", "Qq, kkk!", "vvv; zz", "X; jjj qq zzz."],
    }
    result = run_trainer(DPO_LORA, tmp_path, checkpoint=checkpoint(), pairs=pairs)
    assert result["peft"] == "PeftModel"
    assert all(end == [result["eos"]] * 2 for end in result["ends"])
    mean = lambda xs: sum(xs) / len(xs)
    before, after = result["before"], result["after"]
    assert result["logged_chosen"][0] == pytest.approx(mean(before["chosen"]), abs=ATOL)
    assert result["logged_rejected"][0] == pytest.approx(mean(before["rejected"]), abs=ATOL)
    losses = result["losses"]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.05, losses
    assert result["margins"][-1] > 0
    assert len(result["lora_b"]) == 4 and min(result["lora_b"].values()) > 0, result["lora_b"]
    # the adapter off: the base model is the one DPO started from, as the reference must be
    for key in ("chosen", "rejected"):
        assert result["reference"][key] == pytest.approx(before[key], abs=ATOL)
    margin = lambda logps: mean(logps["chosen"]) - mean(logps["rejected"])
    assert margin(after) > margin(before)


REWARD = """
from transformers import AutoModelForSequenceClassification
from trl import RewardConfig, RewardTrainer

model, tokenizer = load(args["checkpoint"], AutoModelForSequenceClassification, num_labels=1)
config = trl_args(RewardConfig, max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2, bf16=False,
                  max_length=64)
trainer = RewardTrainer(model=model, args=config, train_dataset=Dataset.from_dict(args["pairs"]),
                        processing_class=tokenizer)
batch = next(iter(trainer.get_train_dataloader()))  # chosen rows, then rejected rows, right-padded
model.eval()
rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
with torch.no_grad():
    rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0].tolist()
    trl_loss = trainer.compute_loss(model, dict(batch)).item()
    hidden = [model.model(input_ids=torch.tensor([r]), use_cache=False).last_hidden_state[0] for r in rows]
    at_last_character = [model.score(h[-2]).item() for h in hidden]  # the token before the appended <|endoftext|>
    at_end_of_text = [model.score(h[-1]).item() for h in hidden]
model.train()
trainer.train()
finish({
    "class": type(model).__name__, "eos": tokenizer.eos_token_id, "pad": model.config.pad_token_id, "rows": rows,
    "padded": batch["attention_mask"].eq(0).any().item(), "rewards": rewards, "trl_loss": trl_loss,
    "at_last_character": at_last_character, "at_end_of_text": at_end_of_text, "losses": logged(trainer, "loss"),
})
"""


@pytest.mark.slow
def test_reward_trainer_on_a_sequence_classification_head(tmp_path, checkpoint):
    """RewardTrainer on AutoModelForSequenceClassification (num_labels=1) loaded from a causal-LM checkpoint through
    its own code. TRL appends <|endoftext|> to every text and pads on the right with the same token; transformers'
    head scores the rightmost token that is not the padding token, so with padding = end of text the reward is read
    at each row's last character (the same whatever the padding), not at the appended end of text. The first loss is
    -log sigmoid(chosen - rejected) of those rewards; six steps lower it."""
    pairs = {
        "chosen": ["ROMEO:\nAy me!", "JULIET:\nO Romeo, Romeo!", "NURSE:\nEven or odd.", "KING:\nOnce more."] * 2,
        "rejected": ["ROMEO:\nzzq xj", "JULIET:\nQq, kkk!", "NURSE:\nvvv; zz", "KING:\nX; jjj qq zzz."] * 2,
    }
    result = run_trainer(REWARD, tmp_path, checkpoint=checkpoint(), pairs=pairs)
    assert result["class"] == "DecoderLabForSequenceClassification"
    assert result["pad"] == result["eos"] and result["padded"]
    assert all(row[-1] == result["eos"] and row[-2] != result["eos"] for row in result["rows"])
    assert result["rewards"] == pytest.approx(result["at_last_character"], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(result["rewards"], result["at_end_of_text"])) > 1e-3
    chosen, rejected = result["rewards"][:4], result["rewards"][4:]
    expected = sum(math.log1p(math.exp(r - c)) for c, r in zip(chosen, rejected)) / 4  # -log sigmoid(c - r)
    assert result["trl_loss"] == pytest.approx(expected, rel=1e-5)
    losses = result["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


GRPO = """
from trl import GRPOConfig, GRPOTrainer

result = {}
for name, folder in args["checkpoints"].items():
    model, tokenizer = load(folder)
    rewards, checks = [], []

    def share_of_e(completions, **kwargs):
        # the toy reward: how much of the completion is the letter e
        values = [c.count("e") / max(len(c), 1) for c in completions]
        rewards.append(values)
        return values

    def compare_with_rows_alone(module, _, kwargs, output):
        # TRL's first forward over prompt + completion (no cache): left-padded prompts, right-padded completions.
        # Each row's real tokens alone must give the same hidden states.
        mask = kwargs.get("attention_mask")
        if checks or kwargs.get("use_cache") is not False or mask is None:  # None: this hook's own call below
            return
        with torch.no_grad():
            for ids, row_mask, hidden in zip(kwargs["input_ids"], mask, output.last_hidden_state):
                alone = module(input_ids=ids[row_mask.bool()][None], use_cache=False).last_hidden_state[0]
                checks.append((alone - hidden[row_mask.bool()]).abs().max().item())
        checks.append(-1.0 if mask[:, 0].eq(0).any() else -2.0)  # -1: some prompt was left-padded

    model.model.register_forward_hook(compare_with_rows_alone, with_kwargs=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = trl_args(GRPOConfig, max_steps=2 if name == "rope" else 1, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=12, learning_rate=1e-2, beta=0.0, bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=share_of_e, args=config,
                          train_dataset=Dataset.from_dict({"prompt": args["prompts"]}), processing_class=tokenizer)
    trainer.train()
    result[name] = {
        "rewards": rewards, "logged_reward": logged(trainer, "reward"), "checks": checks,
        "changed": sum(not torch.equal(p, before[n]) for n, p in model.named_parameters()),
        "parameters": len(before),
    }
finish(result)
"""


@pytest.mark.slow
def test_grpo_trainer_two_steps_with_a_toy_reward(tmp_path, checkpoint):
    """GRPOTrainer, generation through transformers (no vLLM), for two steps with a toy reward (the share of the
    letter e): each step's logged reward is the mean of what the reward function returned for its 8 completions (2
    prompts x 4), and the update moved every parameter. TRL's forward over left-padded prompts and their completions
    gives each row's hidden states as the row alone would. It passes no position_ids: RoPE does not depend on the
    offset, and learned (or sinusoidal) positions count from each row's first real token when only a mask is given,
    so the learned checkpoint's rows match too."""
    prompts = ["ROMEO:\n", "JULIET:\nO", "KING HENRY:\n", "NURSE:"]
    checkpoints = {"rope": checkpoint(), "learned": checkpoint(position_embedding_type="learned")}
    result = run_trainer(GRPO, tmp_path, checkpoints=checkpoints, prompts=prompts)
    rope, learned = result["rope"], result["learned"]
    assert [len(r) for r in rope["rewards"]] == [8, 8]
    assert rope["logged_reward"] == pytest.approx([sum(r) / 8 for r in rope["rewards"]], abs=1e-6)
    assert rope["changed"] == rope["parameters"]
    assert rope["checks"][-1] == -1.0 and len(rope["checks"]) == 9  # 8 rows, some left-padded
    assert max(rope["checks"][:-1]) < 1e-4, rope["checks"]
    assert learned["checks"][-1] == -1.0 and max(learned["checks"][:-1]) < 1e-4, learned["checks"]
    assert learned["changed"] == learned["parameters"]
