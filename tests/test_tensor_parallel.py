"""Tensor-parallel inference: ``from_pretrained(CKPT, tp_plan="auto")`` under torchrun gives the one-process model.

The plan (``DecoderLabConfig.base_model_tp_plan``, Llama's: q/k/v and gate/up split by output columns, o_proj and
down_proj by input rows, ``lm_head`` by columns and gathered) gives each process whole attention heads; embeddings,
positions and norms are replicated. A layout whose heads do not divide by the number of processes is refused
before any weight is read (``check_tensor_parallel``).
"""

import itertools
import json
import subprocess
import sys

import pytest

from decoderlab import DecoderLabConfig
from decoderlab.modeling_decoderlab import DecoderLabForCausalLM, check_tensor_parallel, requested_tensor_parallel_size
from tests.conftest import BLOCK_VARIANTS, TINY_SIZES
from tests.paths import REPO_ROOT
from tests.training_runs import subprocess_env

WORKER = REPO_ROOT / "tests" / "tensor_parallel_worker.py"
POSITION_TYPES = ("rope", "sinusoidal", "learned", "none")
# Beyond the position x block grid: the other switches that touch the sharded projections
EXTRA_LAYOUTS = {
    "gqa_qknorm_biases_tied_layernorm": dict(
        num_key_value_heads=2, qk_norm=True, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        norm_type="layernorm",
    ),
    "plain_mlp_partial_rotary_head_dim": dict(
        mlp_type="plain", hidden_act="gelu", head_dim=8, embedding_multiplier=8.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
}  # fmt: skip
MQA = dict(num_key_value_heads=1)


def test_heads_that_do_not_divide_are_refused_with_the_sizes_that_do():
    """The bad-input rule itself: MQA over 2 processes, 4 heads over 3, and the message names the heads, the
    number of processes and the numbers that would work; a layout that divides passes."""
    config = DecoderLabConfig(**TINY_SIZES, num_key_value_heads=2)
    check_tensor_parallel(config, 2)  # 4 heads, 2 key/value heads: fine
    check_tensor_parallel(config, 1)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 and num_key_value_heads=2 do not both divide by 3"):
        check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match=r"divides both \(2\)"):
        check_tensor_parallel(config, 4)
    mqa = DecoderLabConfig(**TINY_SIZES, **MQA)
    with pytest.raises(ValueError, match="one key/value head cannot be split") as error:
        check_tensor_parallel(mqa, 2)
    assert "without tp_plan" in str(error.value) and "divides both" not in str(error.value)


def test_the_requested_degree_is_read_from_every_form_of_the_request():
    """from_pretrained's tensor-parallel arguments as transformers 5.12 to 5.24 take them: ``tp_plan`` alone means
    every process (0), ``tp_size`` or a DistributedConfig's size wins, an FSDP-only config or none asks for none."""

    class Distributed:  # a 5.24 DistributedConfig, as far as the check reads it
        tp_size = 2

    assert requested_tensor_parallel_size({}) is None
    assert requested_tensor_parallel_size({"tp_plan": "auto"}) == 0
    assert requested_tensor_parallel_size({"tp_plan": "auto", "tp_size": 4}) == 4
    assert requested_tensor_parallel_size({"distributed_config": Distributed()}) == 2
    assert requested_tensor_parallel_size({"distributed_config": {"tp_size": 2}}) == 2
    assert requested_tensor_parallel_size({"distributed_config": {"tp_plan": "auto"}}) == 0
    assert requested_tensor_parallel_size({"distributed_config": {"fsdp_size": 2}}) is None


@pytest.mark.slow
def test_tensor_parallel_logits_and_generation_equal_one_process(tmp_path, randomize):
    """Two gloo processes, one torchrun launch, every position type x every norm placement (and the parallel
    block), plus GQA with QK-norm, biases, tied embeddings and LayerNorm, and a plain MLP with partial rotary and a
    decoupled head_dim: the tensor-parallel logits equal the whole model's within 1e-5 and greedy generation gives
    the same tokens. The weights are randomized (logits of order 1-10); the only difference is the order of float32
    sums (each o_proj/down_proj/lm_head result is two partial sums added by the all-reduce), about 1e-6 here.

    An MQA checkpoint (one key/value head over two processes) is refused with the heads named, and before its
    weights are read: its model.safetensors is garbage, which reading would report as a damaged file instead."""
    layouts = {
        f"{position}_{block}": dict(position_embedding_type=position, **BLOCK_VARIANTS[block])
        for position, block in itertools.product(POSITION_TYPES, BLOCK_VARIANTS)
    }
    layouts.update(EXTRA_LAYOUTS)
    root = tmp_path / "checkpoints"
    for name, overrides in {**layouts, "mqa_unreadable_weights": MQA}.items():
        model = randomize(DecoderLabForCausalLM(DecoderLabConfig(**TINY_SIZES, **overrides)))
        model.save_pretrained(root / name)
    (root / "mqa_unreadable_weights" / "model.safetensors").write_bytes(b"not a safetensors file" * 100)

    out = tmp_path / "results.json"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*launcher, str(WORKER), str(root), str(out)], env=subprocess_env(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results.pop("world_size") == 2

    refused = results.pop("mqa_unreadable_weights")
    assert "num_key_value_heads=1" in refused.get("error", ""), refused
    assert "one key/value head cannot be split" in refused["error"]
    assert sorted(results) == sorted(layouts)
    for name, got in results.items():
        assert "error" not in got, (name, got)
        config = DecoderLabConfig(**TINY_SIZES, **layouts[name])
        assert 2 * got["local_rows"] == config.num_attention_heads * config.head_dim, (name, got)  # half of q_proj
        assert got["max_logit_difference"] < 1e-5, (name, got["max_logit_difference"])
        assert got["tp_tokens"] == got["whole_tokens"], name
        assert got["few_rows_calls"] == 0, name  # sharded weights are never plain Parameters: F.linear throughout
