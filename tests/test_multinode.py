"""Two "nodes" on one machine: two torchrun launchers joined by c10d rendezvous on 127.0.0.1, one gloo process each,
training from prepared token shards (the layout of a multi-node job, with 127.0.0.1 for the first node's address)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import free_port
from tests.corpus import write_fineweb_like
from tests.paths import REPO_ROOT
from tests.training_runs import final_eval_loss, subprocess_env, train_losses
from training import prepare_data, pretrain

PRETRAIN = REPO_ROOT / "training" / "pretrain.py"
RUN = ["--block_size", "64", "--learning_rate", "3e-3", "--num_warmup_steps", "5", "--logging_steps", "5",
       "--eval_steps", "none", "--max_eval_samples", "32", "--checkpointing_steps", "10", "--seed", "0",
       "--max_train_steps", "20", "--model.hidden_size", "32", "--model.num_hidden_layers", "2",
       "--model.num_attention_heads", "2", "--ddp_timeout", "300"]  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")


def two_nodes(arguments: list[str]) -> None:
    """``pretrain.py arguments`` launched as two nodes (``--nnodes 2 --node_rank 0|1``), both waited for."""
    port = free_port()
    launchers = []
    for node_rank in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
                   "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                   "--rdzv_id", "decoderlab-test", str(PRETRAIN), *arguments]  # fmt: skip
        env = {**subprocess_env(), "GLOO_SOCKET_IFNAME": "lo"}  # the loopback interface, as both "nodes" are here
        launchers.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [launcher.communicate(timeout=600) for launcher in launchers]
    for launcher, (_, stderr) in zip(launchers, outputs):
        assert launcher.returncode == 0, stderr[-3000:]


@pytest.mark.slow
def test_two_nodes_follow_one_process_save_once_and_resume_exactly(tmp_path):
    """Two nodes of one process with batch 4 against one process with batch 8, on the same prepared shards: the
    same blocks per step (each node maps the shards and takes its half of each global batch) and the all-reduced
    mean gradient, so the same losses (1e-4: float32 sums in another order, as in the one-machine DDP test). One
    checkpoint folder per step is written (by the first node), with both processes' data positions; both nodes
    launched again from step 10 log the first launch's losses for steps 15 and 20 to 1e-6."""
    dataset = tmp_path / "corpus"
    write_fineweb_like(dataset)
    data = tmp_path / "data"
    prepare_data.main(["--dataset_name", str(dataset), "--output_dir", str(data), "--tokenizer_type", "char"])
    single, nodes, resumed = tmp_path / "single", tmp_path / "nodes", tmp_path / "resumed"
    common = ["--prepared_data", str(data), *RUN]
    pretrain.main([*common, "--per_device_train_batch_size", "8", "--output_dir", str(single)])
    two_nodes([*common, "--per_device_train_batch_size", "4", "--output_dir", str(nodes)])

    info = json.loads((nodes / "run_info.json").read_text())
    assert info["num_processes"] == 2 and info["distributed_type"] == "DistributedType.MULTI_CPU"
    expected, got = train_losses(single), train_losses(nodes)
    assert sorted(got) == sorted(expected) == [5, 10, 15, 20]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-4), step
    assert final_eval_loss(nodes) == pytest.approx(final_eval_loss(single), abs=1e-4)
    assert sorted(p.name for p in (nodes / "step_10").glob("data_state_*.json")) == [
        "data_state_0.json", "data_state_1.json"]  # fmt: skip

    resume = ["--resume_from_checkpoint", str(nodes / "step_10")]
    two_nodes([*common, "--per_device_train_batch_size", "4", "--output_dir", str(resumed), *resume])
    continued = train_losses(resumed)
    assert sorted(continued) == [15, 20]
    for step in continued:
        assert continued[step] == pytest.approx(got[step], abs=1e-6), step
