"""Speed of decoderlab against transformers' Llama and GPT-2 and against nanoGPT, side by side.

    python -m benchmarks.speed            # everything, 5-7 minutes on 2 cores; JSON to benchmarks/results/
    python -m benchmarks.speed --quick    # nano only, fewer repeats and tokens, about 1 minute
    python -m benchmarks.speed --runs 3 --benchmarks train decode   # three fresh processes: the ratios' spread

Each comparison builds decoderlab and the reference for the same configuration with the same weights
(their logits are checked to agree first), feeds them the same inputs, and runs them interleaved
(A B A B ...) so that a change in machine load hits both; figures are medians over the repeats, and
every ratio is decoderlab / reference from the same run. fp32 on CPU, ``--threads`` intra-op threads.

On a shared VM a comparison can come out a few percent apart, either way, from one process to the next, although the
rounds inside one process agree (seen here: 0.95x and 1.12x for the same pair an hour apart). ``--runs N`` therefore
runs the whole selection in N fresh processes, one after another, and reports per comparison the median of the N
ratios, their lowest and highest, and a verdict: faster (or slower) only when every run says so, else "within the
runs' spread".

- train: forward + backward + AdamW (fused, same settings for both) on one batch; tokens/s.
- memory: peak resident memory a training run adds, each model alone in a fresh process; MB.
- decode: greedy ``generate`` with the default (dynamic) KV cache at batch 1 and 8; new tokens/s.
- prefill: one forward over a 512-token prompt filling a fresh cache; ms.
- compile: ``generate(cache_implementation="static")`` with ``model.forward = torch.compile(...)`` (inductor's
  defaults at batch 1 and 8, and its C++ wrapper at batch 1), against the reference compiled the same way and
  against the reference's plain ``generate`` at the same batch size; new tokens/s.

References: ``LlamaForCausalLM`` (decoderlab's ``llama`` preset), ``GPT2LMHeadModel`` (``gpt2`` preset),
both with SDPA attention, and nanoGPT (benchmarks/reference_nanogpt.py) for training at nano, against
decoderlab both nanoGPT-shaped (same weights) and Llama-shaped (the default architecture).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import transformers

from benchmarks.common import (
    SIZES,
    Pair,
    Size,
    cpu_model,
    generate_fn,
    gpt2_pair,
    interleaved_medians,
    llama_pair,
    load_average,
    machine_line,
    max_logit_difference,
    nanogpt_pairs,
    peak_training_memory,
    prefill_fn,
    train_step_fn,
    write_results,
)

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "speed.json"
BENCHMARKS = ("train", "memory", "decode", "prefill", "compile")


def result(benchmark: str, size: str, pair: Pair, unit: str, ours: float, reference: float, **extra) -> dict:
    """One row: both figures, the ratio decoderlab / reference, and the load while it was measured."""
    return {
        "benchmark": benchmark,
        "size": size,
        "reference": pair.reference_label,
        "pair": pair.name,
        "unit": unit,
        "decoderlab": ours,
        "reference_value": reference,
        "ratio": ours / reference,
        **extra,
    }


def check_same_weights(pair: Pair, size: Size) -> float:
    difference = max_logit_difference(pair, size)
    if difference > 1e-4:
        raise RuntimeError(f"{pair.name}: decoderlab and {pair.reference_label} disagree by {difference:.2e}.")
    return difference


def bench_train(size_name: str, repeats: int) -> list[dict]:
    size = SIZES[size_name]
    tokens = size.batch_size * size.block_size
    pairs = [llama_pair(size), gpt2_pair(size)] + (nanogpt_pairs(size) if size_name == "nano" else [])
    rows = []
    for pair in pairs:
        if pair.name != "nanogpt-llama-shaped":
            check_same_weights(pair, size)
        load = load_average()
        times = interleaved_medians(
            {"ours": train_step_fn(pair.ours, size), "reference": train_step_fn(pair.reference, size)},
            repeats=repeats,
            warmup=2,
            inner=2 if size_name == "nano" else 1,
        )
        rows.append(
            result(
                "train tokens/s",
                size_name,
                pair,
                "tokens/s",
                tokens / times["ours"]["median_s"],
                tokens / times["reference"]["median_s"],
                load=[load, load_average()],
                samples_s=times,
            )
        )
    return rows


def bench_memory(size_name: str) -> list[dict]:
    rows = []
    for pair_name, ours, reference in (
        ("llama", "decoderlab-llama", "LlamaForCausalLM"),
        ("gpt2", "decoderlab-gpt2", "GPT2LMHeadModel"),
    ):
        load = load_average()
        threads = torch.get_num_threads()
        mine = peak_training_memory(ours, size_name, threads=threads)
        theirs = peak_training_memory(reference, size_name, threads=threads)
        pair = Pair(pair_name, None, None, reference)
        rows.append(
            result(
                "train peak memory added",
                size_name,
                pair,
                "MB",
                mine["added_bytes"] / 2**20,
                theirs["added_bytes"] / 2**20,
                load=[load, load_average()],
                detail={"decoderlab": mine, "reference": theirs},
            )
        )
    return rows


def decode_lengths(size_name: str, quick: bool) -> tuple[int, int]:
    """(prompt tokens, new tokens) for the decoding benchmarks."""
    new_tokens = {"nano": 48, "tiny": 64}[size_name]
    return 16, new_tokens // 2 if quick else new_tokens


def bench_decode(size_name: str, repeats: int, quick: bool) -> list[dict]:
    size = SIZES[size_name]
    prompt, new = decode_lengths(size_name, quick)
    rows = []
    for pair in (llama_pair(size), gpt2_pair(size)):
        check_same_weights(pair, size)
        for batch in (1, 8):
            load = load_average()
            times = interleaved_medians(
                {
                    name: generate_fn(model, batch, prompt, new, size.vocab_size)
                    for name, model in (("ours", pair.ours), ("reference", pair.reference))
                },
                repeats=repeats,
            )
            rows.append(
                result(
                    f"decode tokens/s, batch {batch}",
                    size_name,
                    pair,
                    "tokens/s",
                    batch * new / times["ours"]["median_s"],
                    batch * new / times["reference"]["median_s"],
                    load=[load, load_average()],
                    prompt_tokens=prompt,
                    new_tokens=new,
                    samples_s=times,
                )
            )
    return rows


def bench_prefill(size_name: str, repeats: int, prompt_length: int = 512) -> list[dict]:
    size = SIZES[size_name]
    rows = []
    for pair in (llama_pair(size), gpt2_pair(size)):
        load = load_average()
        times = interleaved_medians(
            {
                "ours": prefill_fn(pair.ours, prompt_length, size.vocab_size),
                "reference": prefill_fn(pair.reference, prompt_length, size.vocab_size),
            },
            repeats=repeats,
            warmup=2,
        )
        rows.append(
            result(
                f"prefill {prompt_length} tokens, ms",
                size_name,
                pair,
                "ms",
                1e3 * times["ours"]["median_s"],
                1e3 * times["reference"]["median_s"],
                load=[load, load_average()],
                samples_s=times,
            )
        )
    return rows


# torch.compile settings timed: inductor's defaults, and its C++ wrapper, which calls the compiled kernels
# from generated C++ instead of Python (less overhead per step, which is what batch-1 decoding is made of)
COMPILE_OPTIONS = {"inductor": {}, "inductor cpp_wrapper": {"cpp_wrapper": True}}
# Batch sizes timed for each setting: batch 8 once, with inductor's defaults
COMPILE_BATCHES = {"inductor": (1, 8), "inductor cpp_wrapper": (1,)}


def bench_compile(size_name: str, repeats: int, quick: bool) -> list[dict]:
    """Static cache + compiled forward for each of COMPILE_OPTIONS, at the batch sizes of COMPILE_BATCHES. The
    compiled models are also timed against the reference's plain generate (dynamic cache, eager) at the same
    batch size, the figure a user switching gets."""
    size = SIZES[size_name]
    prompt, new = decode_lengths(size_name, quick)
    pair = llama_pair(size)
    runs = [(setting, batch) for setting, batches in COMPILE_BATCHES.items() for batch in batches]
    # Dynamo keeps compiled graphs per code object, and every forward wrapped by transformers' deprecate_kwarg
    # shares one: each compiled model and batch size adds a prefill and a decoding graph, which soon passes
    # dynamo's default limit of 8.
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(runs) * 2)
    batch_sizes = sorted({batch for _, batch in runs})
    workloads, batch_of = {}, {}  # name -> work, name -> its batch size
    for batch in batch_sizes:  # uncompiled
        name = f"plain, batch {batch}"
        workloads[name] = generate_fn(copy.deepcopy(pair.reference), batch, prompt, new, size.vocab_size)
        batch_of[name] = batch
    compile_s = {}
    for setting, batch in runs:
        for model_name, model in (("ours", pair.ours), ("reference", pair.reference)):
            model = copy.deepcopy(model)
            model.forward = torch.compile(
                model.forward, fullgraph=True, dynamic=False, options=COMPILE_OPTIONS[setting]
            )
            run = generate_fn(model, batch, prompt, new, size.vocab_size, cache_implementation="static")
            start = time.perf_counter()
            run()  # compiles the prefill and decode graphs
            run()
            name = f"{model_name}, {setting}, batch {batch}"
            compile_s[name] = time.perf_counter() - start
            workloads[name], batch_of[name] = run, batch
    load = load_average()
    times = interleaved_medians(workloads, repeats=repeats)
    rate = {name: batch_of[name] * new / t["median_s"] for name, t in times.items()}
    common = dict(load=[load, load_average()], prompt_tokens=prompt, new_tokens=new, compile_s=compile_s)
    plain = Pair("llama-plain", None, None, "LlamaForCausalLM, dynamic cache, eager")
    rows = []
    for setting, batch in runs:
        ours_name, reference_name = f"ours, {setting}, batch {batch}", f"reference, {setting}, batch {batch}"
        label = "" if batch == 1 else f", batch {batch}"
        rows.append(
            result(
                f"decode tokens/s{label}, static cache + compile ({setting})",
                size_name,
                pair,
                "tokens/s",
                rate[ours_name],
                rate[reference_name],
                samples_s={"ours": times[ours_name], "reference": times[reference_name]},
                batch_size=batch,
                **common,
            )
        )
        rows.append(
            result(
                f"decode tokens/s{label}, static + compile ({setting}) vs plain",
                size_name,
                plain,
                "tokens/s",
                rate[ours_name],
                rate[f"plain, batch {batch}"],
                batch_size=batch,
                **common,
            )
        )
    return rows


def environment(threads: int) -> dict:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": cpu_model(),
        "cpus": os.cpu_count(),
        "threads": threads,
        "dtype": "float32",
        "start": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def row_label(row: dict) -> str:
    """A row's first three columns: benchmark, size, and the reference with its pair."""
    return f"{row['benchmark']:64s} {row['size']:5s} {row['reference'] + ' [' + row['pair'] + ']':52.52s}"


def format_table(rows: list[dict], header: bool = True) -> str:
    title = (
        f"{'benchmark':64s} {'size':5s} {'reference [pair]':52s} {'decoderlab':>11s} {'reference':>11s} {'ratio':>6s}"
        "  load"
    )
    lines = [title, "-" * len(title)] if header else []
    for row in rows:
        lines.append(
            f"{row_label(row)} "
            f"{row['decoderlab']:11.1f} {row['reference_value']:11.1f} {row['ratio']:6.2f}  "
            f"{row['load'][0]:.1f}-{row['load'][1]:.1f}"
        )
    return "\n".join(lines)


LOWER_IS_BETTER = {"ms", "MB"}  # units whose ratio below 1.0 is the better figure


def verdict(unit: str, ratios: list[float]) -> str:
    """The verdict "faster" (or "less memory") when every run's ratio is on decoderlab's side of 1.0, the opposite when every
    run's is on the reference's side, else "within the runs' spread"."""
    better, worse = ("less memory", "more memory") if unit == "MB" else ("faster", "slower")
    wins = [ratio < 1.0 if unit in LOWER_IS_BETTER else ratio > 1.0 for ratio in ratios]
    return better if all(wins) else worse if not any(wins) else "within the runs' spread"


def combine_runs(reports: list[dict]) -> dict:
    """One report from those of several fresh processes: per comparison (benchmark, size, pair), the median of the
    figures and of the ratios, the ratios' range, the verdict, and every run's ratio; the runs' own reports are
    kept under "runs"."""
    rows: dict[tuple, list[dict]] = {}
    for report in reports:
        for row in report["results"]:
            rows.setdefault((row["benchmark"], row["size"], row["pair"]), []).append(row)
    combined = []
    for same in rows.values():
        if len(same) != len(reports):
            raise RuntimeError(f"{same[0]['benchmark']} ({same[0]['pair']}) ran in only {len(same)} of the runs.")
        ratios = [row["ratio"] for row in same]
        combined.append(
            {
                **{key: same[0][key] for key in ("benchmark", "size", "reference", "pair", "unit")},
                "decoderlab": statistics.median(row["decoderlab"] for row in same),
                "reference_value": statistics.median(row["reference_value"] for row in same),
                "ratio": statistics.median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
                "ratios": ratios,
                "verdict": verdict(same[0]["unit"], ratios),
                "load": [min(row["load"][0] for row in same), max(row["load"][1] for row in same)],
            }
        )
    first = reports[0]
    return {
        "environment": first["environment"],
        "sizes": first["sizes"],
        "repeats": first["repeats"],
        "processes": len(reports),
        "results": combined,
        "runs": reports,
    }


def run_in_fresh_processes(argv: list[str], runs: int, threads: int) -> dict:
    """``python -m benchmarks.speed ARGV`` in ``runs`` fresh processes, one after another; their reports combined."""
    reports = []
    with tempfile.TemporaryDirectory() as folder:
        for run in range(1, runs + 1):
            print(f"[{time.strftime('%H:%M:%S')}] process {run} of {runs}", flush=True)
            part = Path(folder) / f"run{run}.json"
            command = [sys.executable, "-m", "benchmarks.speed", *argv, "--threads", str(threads), "--json", str(part)]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            reports.append(json.loads(part.read_text()))
    return combine_runs(reports)


def format_combined(rows: list[dict]) -> str:
    title = f"{'benchmark':64s} {'size':5s} {'reference [pair]':52s} {'ratio':>6s} {'range':>11s}  verdict"
    lines = [title, "-" * len(title)]
    for row in rows:
        low, high = row["ratio_range"]
        lines.append(f"{row_label(row)} {row['ratio']:6.2f} {low:5.2f}-{high:5.2f}  {row['verdict']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", nargs="+", choices=list(SIZES), default=None, help="default: nano tiny (nano with --quick)"
    )
    parser.add_argument("--benchmarks", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="fewer repeats and tokens; nano only unless --sizes")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per comparison (default 7, quick 3)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    parser.add_argument(
        "--runs", type=int, default=1, help="run everything in this many fresh processes and combine them (default 1)"
    )
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}.")
    if args.runs > 1:
        argv = ["--benchmarks", *args.benchmarks] + (["--sizes", *args.sizes] if args.sizes else [])
        argv += (["--quick"] if args.quick else []) + (["--repeats", str(args.repeats)] if args.repeats else [])
        print(machine_line(args.threads), flush=True)
        report = run_in_fresh_processes(argv, args.runs, args.threads)
        print()
        print(format_combined(report["results"]))
        write_results(args.json, report, args.threads)
        return
    sizes = args.sizes or (["nano"] if args.quick else list(SIZES))
    repeats = args.repeats or (3 if args.quick else 7)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # generate's notes on unset sampling options, once per call

    rows = []
    report = {
        "environment": environment(args.threads),
        "sizes": {name: asdict(SIZES[name]) for name in sizes},
        "repeats": repeats,
        "results": rows,
    }
    print(machine_line(args.threads), flush=True)
    for size_name in sizes:
        for benchmark in args.benchmarks:
            print(f"[{time.strftime('%H:%M:%S')}] {benchmark} at {size_name} (load {load_average():.1f})", flush=True)
            if benchmark == "train":
                new_rows = bench_train(size_name, repeats)
            elif benchmark == "memory":
                new_rows = bench_memory(size_name)
            elif benchmark == "decode":
                new_rows = bench_decode(size_name, repeats, args.quick)
            elif benchmark == "prefill":
                new_rows = bench_prefill(size_name, repeats)
            else:
                new_rows = bench_compile(size_name, repeats, args.quick)
            print(format_table(new_rows, header=False), flush=True)
            rows += new_rows
            write_results(args.json, report, args.threads)  # after each benchmark: a crash keeps the rest
    print()
    print(format_table(rows))


if __name__ == "__main__":
    main()
