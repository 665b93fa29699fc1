"""training/health.py: the gradient norm, the update ratios and the loss spikes a training row logs, each against the
same figure computed by hand on the same step."""

import copy
import math

import pytest
import torch

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from training.args import TrainConfig
from training.checkpointing import TrainState
from training.data import BlockBatches
from training.health import SPIKE_MEMORY, count_spikes
from training.loop import make_accelerator, train
from training.optim import param_groups

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_accelerate_state")


def tiny() -> DecoderLabForCausalLM:
    torch.manual_seed(0)
    config = DecoderLabConfig.from_preset("llama", num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                          vocab_size=64, max_position_embeddings=32)  # fmt: skip
    return DecoderLabForCausalLM(config)


def one_step(tmp_path, model, **fields) -> dict:
    """Train ``model`` one optimizer step of 2 micro-batches of 4 blocks, logging it; its training row."""
    blocks = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(dataset_name="unused", output_dir=str(tmp_path / "run"), max_train_steps=1,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2, logging_steps=1, eval_steps=None,
                      checkpointing_steps=None, num_warmup_steps=0, **fields)  # fmt: skip
    result = train(model, BlockBatches(blocks, 4, seed=0), blocks[:8], cfg, make_accelerator(cfg, cpu=True),
                   show_progress=False)  # fmt: skip
    return result.history[0]


@pytest.mark.parametrize("max_grad_norm", [0.01, None], ids=["clipped", "not-clipped"])
def test_grad_norm_is_the_whole_gradients_norm_before_clipping(tmp_path, max_grad_norm):
    """The row's grad_norm is the L2 norm of the step's whole gradient (the mean loss over the 8 blocks of its two
    micro-batches, computed here in one batch), before clipping: the same whether the run clips it to 0.01 or does
    not clip at all."""
    model = tiny()
    reference = copy.deepcopy(model)
    blocks = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    first = next(BlockBatches(blocks, 8, seed=0).iterate(start=0))  # the step's two micro-batches of 4
    reference(input_ids=first["input_ids"], labels=first["labels"]).loss.backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()
    row = one_step(tmp_path, model, max_grad_norm=max_grad_norm, optimizer="adamw")
    assert expected > 0.05  # far above the clip: a logged norm after clipping would be 0.01
    assert row["grad_norm"] == pytest.approx(expected, rel=1e-4)


def test_update_ratio_is_each_groups_update_over_its_weights(tmp_path):
    """update_rms/GROUP is ||weights after - weights before|| / ||weights before|| over each optimizer group's tensors
    together (= the ratio of their RMS), measured on the logged step, for every group param_groups names."""
    model = tiny()
    cfg = TrainConfig(embedding_learning_rate=1e-2)  # a third group: the embeddings
    before = {id(p): p.detach().clone() for p in model.parameters()}
    row = one_step(tmp_path, model, embedding_learning_rate=1e-2, learning_rate=1e-3)
    groups = param_groups(model, cfg)
    assert {f"update_rms/{g['name']}" for g in groups} == {key for key in row if key.startswith("update_rms/")}
    for group in groups:
        update = sum((p.detach() - before[id(p)]).square().sum() for p in group["params"])
        weights = sum(before[id(p)].square().sum() for p in group["params"])
        assert row[f"update_rms/{group['name']}"] == pytest.approx(math.sqrt(update / weights), rel=1e-4), group["name"]


def test_a_spike_is_a_step_above_the_running_mean_by_the_margin():
    """count_spikes: the first step starts the mean; a later step is a spike when above (1 + margin) x the mean of
    the steps before it, which moves 1/SPIKE_MEMORY of the way to each step; a falling loss is never one; the count
    and the mean carry over from call to call (a window to the next, a checkpoint to its resume)."""
    state = TrainState()
    assert count_spikes(state, [4.0, 3.0, 2.5, 2.0], margin=0.1) == 0  # falling
    mean = 4.0
    for loss in (3.0, 2.5, 2.0):
        mean += (loss - mean) / SPIKE_MEMORY
    assert state.loss_mean == pytest.approx(mean)
    limit = 1.1 * mean
    assert count_spikes(state, [limit * 0.999], margin=0.1) == 0  # just under the margin
    assert count_spikes(state, [limit * 1.2, 1.0], margin=0.1) == 1  # over it, then back down
    assert count_spikes(state, [10.0], margin=10.0) == 1  # a wider margin lets it pass
    again = TrainState(loss_spikes=state.loss_spikes, loss_mean=state.loss_mean)
    assert count_spikes(again, [100.0], margin=0.1) == 2
