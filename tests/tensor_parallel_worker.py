"""Run under ``torchrun --nproc_per_node N`` by tests/test_tensor_parallel.py: for every checkpoint folder in ROOT,
load it whole and with ``tp_plan="auto"``, and write what the test compares into OUT (JSON, from rank 0).

    torchrun --standalone --nproc_per_node 2 tests/tensor_parallel_worker.py ROOT OUT

Per checkpoint: the largest logit difference (a batch of 2 x 12 tokens), the greedy tokens of both models (8 new
tokens, KV-cached), the rows of q_proj this process holds (half of them: sharding really happened) and how many
times the few-rows product ran on the sharded model; or the error loading it raised.
"""

import json
import pathlib
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import decoderlab  # noqa: F401  (registers the Auto classes)
from decoderlab import kernels_decoderlab


def compare(folder: pathlib.Path) -> dict:
    ids = torch.randint(0, 99, (2, 12), generator=torch.Generator().manual_seed(0))
    try:
        sharded = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto").eval()
    except ValueError as err:
        return {"error": str(err)}
    whole = AutoModelForCausalLM.from_pretrained(folder).eval()
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        whole_logits = whole(ids).logits
    whole_tokens = whole.generate(ids, **greedy).tolist()
    few_rows_calls = []  # on the sharded model only
    real_product = kernels_decoderlab.few_rows_product
    kernels_decoderlab.few_rows_product = lambda x, w: few_rows_calls.append(1) or real_product(x, w)
    try:
        with torch.no_grad():
            difference = (sharded(ids).logits - whole_logits).abs().max().item()
        tp_tokens = sharded.generate(ids, **greedy).tolist()
    finally:
        kernels_decoderlab.few_rows_product = real_product
    weight = sharded.model.layers[0].self_attn.q_proj.weight
    return {
        "max_logit_difference": difference,
        "whole_tokens": whole_tokens,
        "tp_tokens": tp_tokens,
        "weight_class": type(weight.data).__name__,  # a DTensor from 5.2x, the local shard itself before
        "local_rows": (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0],
        "few_rows_calls": len(few_rows_calls),
    }


def main(root: str, out: str) -> None:
    torch.set_num_threads(1)
    results = {folder.name: compare(folder) for folder in sorted(pathlib.Path(root).iterdir())}
    if dist.get_rank() == 0:
        results["world_size"] = dist.get_world_size()
        pathlib.Path(out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
