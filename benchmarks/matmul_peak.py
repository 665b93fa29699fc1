"""The CPU's matrix-product rate by size and dtype: the peak a training run's MFU is measured against, on this machine.

    python -m benchmarks.matmul_peak                  # about 20 seconds on 2 cores
    python -m benchmarks.matmul_peak --threads 1 --json_out benchmarks/results/matmul_peak.json

A training run on a CPU measures its peak once, before its first step: ``training.flops.matmul_rate``, the fastest
of a few products of two square matrices of each of ``training.flops.MEASURED_SIZES`` in the run's dtype at its
thread count (``training.flops`` says why measured, not read from a table). This times the same function at every
size of ``SIZES`` (the best of ``--repeats`` products each), for float32 and, where the CPU computes it in hardware,
bfloat16, so that the sizes a run times can be seen against the rate other sizes reach. The load average before and after is recorded: a CPU
busy with other work gives lower rates.
"""

import torch

from benchmarks.common import load_average, machine_line, timing_parser, write_timing
from training.flops import MEASURED_SIZES, matmul_rate
from training.hardware import cpu_has_bf16

SIZES = (256, 512, 1024, 2048)


def rates(dtype: torch.dtype, repeats: int) -> dict[int, float]:
    """GFLOP/s of the best of ``repeats`` products at each size."""
    return {size: matmul_rate(dtype, size, repeats) / 1e9 for size in SIZES}


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__, repeats=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = load_average()
    print(machine_line(args.threads))
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_has_bf16() else [])
    results = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        results[name] = rates(dtype, args.repeats)
        row = "  ".join(f"{size}: {rate:7.1f}" for size, rate in results[name].items())
        print(f"{name:>9} GFLOP/s by size  {row}  (a run takes the faster of {MEASURED_SIZES})")
    write_timing(args.json_out, args.threads, load_before, sizes=list(SIZES), measured_sizes=list(MEASURED_SIZES),
                 repeats=args.repeats, gflops_per_s=results)  # fmt: skip


if __name__ == "__main__":
    main()
