"""training/flops.py: the FLOPs per token the loop logs, against torch's own count of a training step; the peak MFU is
measured against; and the steps a budget gives."""

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.cli import UsageError
from decoderlab.model_card import count_parameters
from tests.paths import REPO_ROOT
from training import flops
from training.args import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

DEMO_MODEL = yaml.safe_load((REPO_ROOT / "training/configs/shakespeare_char.yaml").read_text())["model"]
# (name, the model, its block size): make demo's model (gated MLP, QK-norm, untied, 67 characters); GQA with tied
# embeddings over a long block, where attention's term is 56% of 6N (Kaplan's causal half of it would be 18% short: a
# wrong attention term cannot hide under 5%); GPT-2's shape (biases, a plain MLP, learned positions, tied)
CONFIGS = [
    ("demo", DecoderLabConfig(**DEMO_MODEL, vocab_size=67, max_position_embeddings=64), 64),
    ("gqa-tied", DecoderLabConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  vocab_size=300, tie_word_embeddings=True, max_position_embeddings=256), 256),
    ("gpt2", DecoderLabConfig.from_preset("gpt2", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                          vocab_size=500, max_position_embeddings=128), 128),
]  # fmt: skip


@pytest.mark.parametrize("config, block", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_flops_per_token_is_what_a_training_step_computes(config, block):
    """One training step (forward with the loss, backward) of two blocks, counted by torch's FlopCounterMode (every
    matrix product; eager attention, whose two products it sees), is within 5% of flops_per_token x the tokens: the
    formula counts the linear layers' weights (lm_head tied or not, k/v at GQA's width) and the full score square.
    The embedding lookup and the loss are no matrix product, in neither count (here the two agree exactly)."""
    torch.manual_seed(0)
    model = DecoderLabForCausalLM(config)
    model.config._attn_implementation = "eager"  # CPU SDPA's kernel has no entry in FlopCounterMode's table
    ids = torch.randint(0, config.vocab_size, (2, block))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = counter.get_total_flops()
    assert flops.flops_per_token(config, block) * ids.numel() == pytest.approx(counted, rel=0.05)


def test_a_sliding_layer_counts_its_window():
    """A sliding layer's attention term counts its window, not the block: with every layer sliding over 16 of 64
    tokens, the FLOPs per token are the full layers' less 12 x (64 - 16) x d_attn per layer; a window longer than the
    block counts the block."""
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    full = DecoderLabConfig(**sizes)
    sliding = DecoderLabConfig(**sizes, layer_types=["sliding_attention"] * 2, sliding_window=16)
    d_attn = 4 * full.head_dim
    assert flops.flops_per_token(full, 64) - flops.flops_per_token(sliding, 64) == 2 * 12 * (64 - 16) * d_attn
    assert flops.flops_per_token(sliding, 8) == flops.flops_per_token(full, 8)


def budget_cfg(**fields) -> TrainConfig:
    return TrainConfig(max_train_steps=None, block_size=64, per_device_train_batch_size=16, **fields)


def test_a_budget_sets_the_steps():
    """target_flops gives the steps whose FLOPs fit in it (rounded down: 2.9 steps' worth trains 2); tokens_per_parameter
    the steps that see at least that many tokens per parameter, all parameters counted (rounded up); both count every
    process's tokens (batch x block x accumulation x processes)."""
    config = CONFIGS[0][1]
    fpt = flops.flops_per_token(config, 64)
    budget = flops.run_budget(budget_cfg(target_flops=2.9 * fpt * 16 * 64 * 2), config, num_processes=2)
    assert (budget.steps, budget.tokens_per_step, budget.flops_per_token) == (2, 16 * 64 * 2, fpt)
    parameters = count_parameters(config)[0]
    budget = flops.run_budget(budget_cfg(tokens_per_parameter=20.0), config, num_processes=1)
    assert budget.steps == -(-20 * parameters // (16 * 64)) and budget.parameters == parameters
    assert budget.steps * budget.tokens_per_step >= 20 * parameters > (budget.steps - 1) * budget.tokens_per_step
    assert "rounded up" in budget.text() and budget.record()["max_train_steps"] == budget.steps
    assert flops.run_budget(TrainConfig(), config, 1) is None


def test_a_budget_smaller_than_one_step_is_refused():
    """Bad input: a target below one optimizer step's FLOPs is one line naming the flag, the value, one step's FLOPs
    and what to change."""
    config = CONFIGS[0][1]
    with pytest.raises(UsageError, match=r"target_flops=1e\+06 is less than one optimizer step, [0-9.e+]+ FLOPs \([0-9,]+ "
                                         r"FLOPs per token x 1,024 tokens per step\): raise --target_flops") as error:  # fmt: skip
        flops.run_budget(budget_cfg(target_flops=1e6), config, num_processes=1)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989), ("NVIDIA H100 PCIe", "bf16", 756), ("NVIDIA H200", "fp32", 67),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156), ("NVIDIA GeForce RTX 4090", "bf16", None),
])  # fmt: skip
def test_a_gpus_peak_is_its_datasheets(name, dtype, tflops):
    """Each GPU gets its own variant's dense figure (an H100 PCIe is not taken for the SXM part whose name it
    contains), and a GPU the table does not list has none (its rows log mfu null rather than a wrong one)."""
    peak = flops.gpu_peak(name, dtype)
    assert peak == (tflops * 1e12 if tflops is not None else None)


def test_a_cpus_peak_is_measured_in_the_runs_dtype():
    """On a CPU the peak is this machine's measured matrix-product rate in the dtype the run's matmuls use (float32
    without mixed precision), at its thread count, which the record names; measured once a process."""
    peak = flops.peak_flops(torch.device("cpu"), "no")
    assert peak.flops > 1e8 and "fp32 matmul rate measured" in peak.source and "(1 thread)" in peak.source
    assert flops.peak_flops(torch.device("cpu"), "no").flops == peak.flops  # remembered, not measured again
