"""Does bf16 autocast speed up training on this CPU? The real training loop, fp32 against bf16, side by side.

    python -m benchmarks.investigations.cpu_mixed_precision            # nano and tiny, 2 repeats each, about 9 minutes
    python -m benchmarks.investigations.cpu_mixed_precision --sizes nano --repeats 3

Each run is ``training/pretrain.py`` on Tiny Shakespeare (characters) in a fresh process with
``--mixed_precision no`` or ``bf16`` (Accelerate's CPU autocast: matmuls in bfloat16, through oneDNN's
AMX-BF16 or AVX512-BF16 kernels where the CPU has them; weights and optimizer stay fp32), alternating no, bf16, no, bf16, ... so a
change in machine load hits both. The figure is the training tokens/s after the first logging
window (warm-up excluded), from the run's own ``metrics.jsonl``; the median over repeats, and the
ratio bf16 / fp32 from the same invocation. The last training loss of each precision is printed too:
a speed-up that costs accuracy would show there.

- nano: the ``shakespeare_char`` recipe as it is (4 × 128, block 64, batch 12): tiny matmuls.
- tiny: 6 × 384 × 6, block 256, batch 8 (still the 65-character vocabulary): matmuls large enough
  for bf16 kernels to matter.
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import cpu_features, machine_line, write_results
from training.data import tiny_shakespeare
from training.loop import METRICS_NAME, read_metrics

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = REPO_ROOT / "training" / "configs" / "shakespeare_char.yaml"

SIZES = {
    "nano": ["--max_train_steps", "300", "--logging_steps", "50"],
    "tiny": [
        "--max_train_steps", "36", "--logging_steps", "6", "--block_size", "256",
        "--per_device_train_batch_size", "8", "--model.num_hidden_layers", "6", "--model.hidden_size", "384",
        "--model.num_attention_heads", "6", "--model.num_key_value_heads", "6", "--model.intermediate_size", "1024",
        "--model.max_position_embeddings", "256",
    ],
}  # fmt: skip


def run(size: str, precision: str, dataset: str, threads: int, folder: pathlib.Path) -> tuple[float, float]:
    """(steady training tokens/s, last training loss) of one pretrain.py run."""
    output_dir = folder / f"{size}_{precision}"
    command = [sys.executable, str(REPO_ROOT / "training" / "pretrain.py"), "--config", str(RECIPE)]
    command += ["--dataset_name", dataset, "--output_dir", str(output_dir), "--overwrite_output_dir"]
    command += ["--mixed_precision", precision]
    command += ["--eval_steps", "none", "--load_best_model_at_end", "false", "--checkpointing_steps", "none",
                "--max_eval_samples", "8", *SIZES[size]]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = read_metrics(output_dir / METRICS_NAME)
    train = [r for r in records if "train_loss" in r]
    first, last = train[0], train[-1]  # the first window holds the warm-up (allocations, first-call costs)
    tokens_per_s = (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"])
    return tokens_per_s, last["train_loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num_threads", type=int, default=2)
    parser.add_argument("--dataset_name", default=tiny_shakespeare())
    parser.add_argument("--json_out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    print(machine_line(args.num_threads))
    print(f"CPU bf16 instructions: {[f for f in cpu_features() if 'bf16' in f] or 'none found'}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            runs = {"no": [], "bf16": []}
            for _ in range(args.repeats):
                for precision in runs:
                    runs[precision].append(run(size, precision, args.dataset_name, args.num_threads, pathlib.Path(tmp)))
            results[size] = {
                precision: {
                    "tokens_per_s": statistics.median(t for t, _ in measured),
                    "last_train_loss": measured[-1][1],
                    "runs": measured,
                }
                for precision, measured in runs.items()
            }
            results[size]["ratio_bf16_over_fp32"] = (
                results[size]["bf16"]["tokens_per_s"] / results[size]["no"]["tokens_per_s"]
            )

    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(
        f"{'size':6} {'fp32 tokens/s':>14} {'bf16 tokens/s':>14} {'bf16 / fp32':>12} {'last loss fp32':>15} {'bf16':>8}"
    )
    for size, r in results.items():
        print(
            f"{size:6} {r['no']['tokens_per_s']:14,.0f} {r['bf16']['tokens_per_s']:14,.0f} "
            f"{r['ratio_bf16_over_fp32']:12.2f} {r['no']['last_train_loss']:15.4f} {r['bf16']['last_train_loss']:8.4f}"
        )
    if args.json_out:
        write_results(args.json_out, {"num_threads": args.num_threads, **results}, args.num_threads)


if __name__ == "__main__":
    main()
