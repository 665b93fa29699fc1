"""Render the measured figures from benchmarks/results/*.json into the pages that show them.

    python -m benchmarks.report           # rewrite the generated tables of docs/performance.md and README.md
    python -m benchmarks.report --check   # change nothing; exit 1 naming the page, table and JSON that disagree

A generated table sits in its page between the lines ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->``;
everything outside those lines is written by hand. Each table opens with where its figures were measured: the
CPU, threads, date and commit each results file records (its ``provenance``, written by
``benchmarks.common.write_results``; older files say what git history proves and that it was backfilled), the
files themselves and the dated note that tells their history. ``--check`` also fails for a results file that
no table shows: a figure is either on a page or in ``results/archive/``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
from collections.abc import Callable
from dataclasses import dataclass

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
NOTES = REPO_ROOT / "benchmarks" / "notes"
PERFORMANCE = REPO_ROOT / "docs" / "performance.md"
# stands for the results folder in a rendered line; render() makes it relative to the page
RESULTS_LINK = "@results/"
BLOCK = re.compile(r"^<!-- report:(?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /report:(?P=name) -->$", re.M | re.S)


@dataclass
class Line:
    """One line of a rendered table and the results file its figures come from (None: all of the table's)."""

    text: str
    source: str | None = None


@dataclass
class Table:
    name: str
    sources: tuple[str, ...]  # results files, relative to benchmarks/results
    note: str | None  # the note under benchmarks/notes that tells the history, if any
    rows: Callable[..., list[Line]]  # rows(*loaded sources) -> the table's lines


# ----------------------------------------------------------------------------------------------
# Formatting


def number(x: float) -> str:
    """A figure as the tables print it: whole and thousands-separated from 1000, one decimal from 10, two from 1,
    three significant digits below."""
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if abs(x) >= 1 else f"{x:.3g}"


def times(ratio: float) -> str:
    return f"{ratio:.2f}×"


def small(x: float) -> str:
    """A logit difference: two significant digits."""
    return f"{x:.2g}"


def megabytes(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.2f} MB"


def markdown_table(header: list[str], align: str, rows: list[tuple[list[str], str]]) -> list[Line]:
    """``rows`` as (cells, source) under ``header``; ``align`` has one letter per column, l or r."""
    lines = [
        Line("| " + " | ".join(header) + " |"),
        Line("|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"),
    ]
    return lines + [Line("| " + " | ".join(cells) + " |", source) for cells, source in rows]


def link(page: pathlib.Path, target: pathlib.Path, text: str) -> str:
    return f"[{text}]({pathlib.Path(os.path.relpath(target, page.parent)).as_posix()})"


def kernels_text(kernels: dict) -> str:
    """``cpu_kernels()`` in a few words: ``kernels AVX2, bf16 in software, held by ONEDNN_MAX_CPU_ISA=AVX2 ...``."""
    limits = " ".join(f"{name}={value}" for name, value in kernels.get("limits", {}).items())
    return f"kernels {kernels['dispatch']}, bf16 in {kernels['bf16']}" + (f", held by {limits}" if limits else "")


def measured_on(provenance: dict) -> str:
    """Where and when, from a results file's provenance: what the run recorded, or what was backfilled."""
    versions = provenance.get("versions") or {}
    cpu = provenance.get("cpu") or "a CPU the file does not name"
    threads = provenance.get("threads")
    where = f"{cpu}, {threads} thread{'s' if threads != 1 else ''}" if threads else cpu
    if (provenance.get("cpu_kernels") or {}).get("limits"):  # run with the CPU's extensions hidden
        where += f" ({kernels_text(provenance['cpu_kernels'])})"
    if provenance.get("accelerator"):
        where += f", {provenance['accelerator']}"
    if provenance.get("recorded") == "at run time":
        dirty = " with uncommitted changes" if provenance.get("dirty") else ""
        code = f"commit {(provenance.get('commit') or 'unknown')[:7]}{dirty}"
        when = provenance["date"][:16].replace("T", " ")
    else:
        code = f"code no newer than commit {provenance['committed_in'][:7]} (backfilled from git: no commit recorded)"
        when = (provenance.get("date") or "")[:16] or f"by {provenance['committed_on']}"
    libraries = ", ".join(f"{name} {versions[name]}" for name in ("torch", "transformers") if versions.get(name))
    return f"{where}, {when}, {code}" + (f"; {libraries}" if libraries else "")


def header(table: Table, loaded: dict[str, dict], page: pathlib.Path) -> list[Line]:
    """The sentence above a table: each distinct provenance, with the files that share it, and the note."""
    groups: dict[str, list[str]] = {}
    for name in table.sources:
        groups.setdefault(measured_on(loaded[name]["provenance"]), []).append(name)
    parts = [
        ", ".join(link(page, RESULTS / name, f"`{name}`") for name in names) + f": {where}"
        for where, names in groups.items()
    ]
    sentence = "Measured: " + "; ".join(parts) + "."
    if table.note:
        sentence += " History: " + link(page, NOTES / table.note, table.note) + "."
    return [Line(f"*{sentence}*"), Line("")]


# ----------------------------------------------------------------------------------------------
# The tables


LOWER_IS_BETTER = {"ms", "MB"}
PAIRS = {"nanogpt-same-weights": "nanoGPT, same weights", "nanogpt-llama-shaped": "nanoGPT vs the Llama-shaped default"}


def measure(row: dict) -> str:
    label = row["benchmark"].replace("train peak memory added", "training peak memory added, MB")
    return label + (" (lower is better)" if row["unit"] in LOWER_IS_BETTER else "")


def reference(row: dict) -> str:
    """The reference's class in code type, e.g. "`LlamaForCausalLM`, dynamic cache, eager"."""
    model, _, rest = row["reference"].partition(", ")
    return PAIRS.get(row["pair"], f"`{model}`" + (f", {rest}" if rest else ""))


def speed_rows(report: dict, source: str) -> list[Line]:
    """One process of ``python -m benchmarks.speed``: both figures and their ratio."""
    rows = [
        (
            [
                measure(r),
                r["size"],
                reference(r),
                number(r["decoderlab"]),
                number(r["reference_value"]),
                f"{r['ratio']:.2f}",
            ],
            source,
        )
        for r in report["results"]
    ]
    return markdown_table(["measure", "size", "against", "decoderlab", "reference", "ratio"], "lllrrr", rows)


def combined_rows(report: dict, source: str, benchmarks: tuple[str, ...] = ()) -> list[Line]:
    """``--runs 3``: the median ratio of three fresh processes, their range and the verdict."""
    rows = [
        ([measure(r), r["size"], reference(r), f"{r['ratio']:.2f}", f"{r['ratio_range'][0]:.2f}–{r['ratio_range'][1]:.2f}",
          r["verdict"]], source)
        for r in report["results"]
        if not benchmarks or r["benchmark"].startswith(benchmarks)
    ]  # fmt: skip
    return markdown_table(["measure", "size", "against", "median ratio", "range", "verdict"], "lllrrl", rows)


def main_job_rows(*runs: dict) -> list[Line]:
    rows = []
    for source, run in zip(MAIN_JOB.sources, runs):
        for side, label in (("nanogpt", "nanoGPT `shakespeare_char` (CPU)"), ("ours", "decoderlab `shakespeare_char`")):
            r = run[side]
            ratio = side == "ours"
            rows.append(([
                source, label, str(r["steps"]),
                f"{r['command_s']:.1f} s" + (f" ({times(run['ratio_command'])})" if ratio else ""),
                f"{r['loop_s']:.1f} s" + (f" ({times(run['ratio_loop'])})" if ratio else ""),
                f"{r['val_loss_every_window']:.3f}",
            ], source))  # fmt: skip
    return markdown_table(
        ["results file", "recipe", "steps", "whole command", "training loop", "validation loss"], "llrrrr", rows
    )


def export_rows(report: dict) -> list[Line]:
    source = "export_formats.json"
    runtimes = {"onnx": f"ONNX Runtime {report['versions']['onnxruntime']}",
                "executorch": f"ExecuTorch {report['versions']['executorch']} (XNNPACK)"}  # fmt: skip
    rows = [
        ([row["model"], f"{row['parameters'] / 1e6:.2f}M", runtimes[fmt], small(row[fmt]["max_abs_logit_difference"]),
          megabytes(row[fmt]["bytes"]), f"{row[fmt]['export_seconds']:.0f} s"], source)
        for row in report["rows"]
        for fmt in runtimes
    ]  # fmt: skip
    return markdown_table(
        ["model", "parameters", "runtime", "max logit difference", "file size", "export time"], "lrlrrr", rows
    )


def gguf_rows(report: dict) -> list[Line]:
    source = "gguf_export.json"
    rows = [
        ([outtype, megabytes(r["file_bytes"]), small(r["transformers_max_logit_diff"]),
          small(r["llamacpp_max_last_logit_diff"]), f"{r['llamacpp_greedy_matching']}/{r['greedy_total']}",
          "yes" if r["llamacpp_same_ids"] else "no"], source)
        for outtype, r in report["outtypes"].items()
    ]  # fmt: skip
    header = ["outtype", "file size", "transformers' GGUF loader: max logit diff", "llama.cpp: max last-token logit diff",
              "llama.cpp: greedy tokens equal", "same token ids"]  # fmt: skip
    return markdown_table(header, "lrrrrl", rows)


def vllm_rows(report: dict) -> list[Line]:
    source = "vllm_speed.json"
    rows = [
        ([str(r["batch_size"]), f"{number(r['generate_tokens_per_s'])} tok/s", f"{number(r['vllm_tokens_per_s'])} tok/s",
          times(r["vllm_over_generate"]), "yes" if r["same_greedy_tokens_row0"] else "no"], source)
        for r in report["rows"]
    ]  # fmt: skip
    return markdown_table(["batch", "`generate`", "vLLM", "vLLM / `generate`", "same greedy tokens"], "rrrrl", rows)


def bf16_rows(*reports: dict) -> list[Line]:
    rows = []
    for source, report in zip(CPU_BF16.sources, reports):
        for size in ("nano", "tiny"):
            if size in report:
                r = report[size]
                rows.append(([
                    source, size, number(r["no"]["tokens_per_s"]), number(r["bf16"]["tokens_per_s"]),
                    times(r["ratio_bf16_over_fp32"]),
                    f"{r['no']['last_train_loss']:.4f} / {r['bf16']['last_train_loss']:.4f}",
                ], source))  # fmt: skip
    return markdown_table(
        ["results file", "size", "fp32 tokens/s", "bf16 tokens/s", "bf16 / fp32", "last training loss fp32 / bf16"],
        "llrrrr",
        rows,
    )


def nanogpt_gap_rows(first: dict, second: dict) -> list[Line]:
    rows = [
        ([a["step"], f"{a['ms']:.2f} ms, {a['nanogpt_over_this']:.3f}×", f"{b['ms']:.2f} ms, {b['nanogpt_over_this']:.3f}×"],
         None)
        for a, b in zip(first["rows"], second["rows"])
    ]  # fmt: skip
    return markdown_table(["training step, nano (nanoGPT's time / the row's)", "first run", "second run"], "lrr", rows)


def rms_norm_rows(report: dict) -> list[Line]:
    rows = [
        ([r["shape"], number(r["RMSNormFunction_us"]), number(r["LlamaRMSNorm_us"]), number(r["F.layer_norm_us"]),
          times(r["llama_over_ours"])], "rms_norm.json")
        for r in report["rows"]
    ]  # fmt: skip
    header = [
        "forward and backward of",
        "decoderlab, µs",
        "`LlamaRMSNorm`, µs",
        "`F.layer_norm`, µs",
        "Llama / decoderlab",
    ]
    return markdown_table(header, "lrrrr", rows)


def loss_paths_rows(report: dict) -> list[Line]:
    rows = [
        ([r["logits"], number(r["f_cross_entropy_ms"]), number(r["cross_entropy_function_ms"]), f"`{r['path']}`"],
         "loss_paths.json")
        for r in report["rows"]
    ]  # fmt: skip
    header = ["logits", "`F.cross_entropy`, ms", "`CrossEntropyFunction`, ms", "decoderlab's path"]
    return markdown_table(header, "lrrl", rows)


def training_memory_rows(report: dict) -> list[Line]:
    """One compiled / eager bf16 training step at the reduced GPT-2 shape: saved and peak bytes, the largest
    allocations, and decoderlab's against its reference (the verdicts ``training_memory.goals`` stored in the
    results file: the report runs without torch)."""
    checks = {(c["model"], c["mode"], c["route"]): c for c in report["goals"]}
    rows = []
    for r in report["rows"]:
        check = checks.get((r["model"], r["mode"], r["route"])) if not r["variant"] else None
        verdict = "" if check is None else f"{'≤' if check['passed'] else '>'} {check['reference']}"
        route = "model alone" if r["route"] == "model" else "training loop's Accelerate set-up"
        what = f"`{r['model']}`" + (f" ({r['variant']}, as the code was before the GPU memory fixes)" if r["variant"] else "")
        largest = ", ".join(f"{mb:.0f}" for mb in r["largest_mb"])
        rows.append(([what, r["mode"], route, number(r["saved_mb"]), number(r["peak_mb"]), largest, verdict],
                     "training_memory.json"))  # fmt: skip
    header = ["model", "mode", "through", "saved for backward, MB", "peak, MB", "largest allocations, MB", "goal"]
    return markdown_table(header, "lllrrll", rows)


def compiled_step_rows(report: dict) -> list[Line]:
    """Counts of one compiled training step (``benchmarks.investigations.compiled_step``): the products the compiled
    code calls and the kernels Inductor generates, each decoderlab preset beside its reference."""
    rows = []
    for r in report["rows"]:
        products = ", ".join(f"{op.removeprefix('aten::')} {n}" for op, n in r["products"].items() if n)
        rows.append(([f"`{r['model']}`", str(r["layers"]), f"{r['products_total']} ({products})",
                      str(r["attention_calls"]), str(r["generated_kernels"])], "compiled_step.json"))  # fmt: skip
    header = ["model", "layers", "matrix products called", "attention kernels", "kernels Inductor generated"]
    return markdown_table(header, "lrlrr", rows)


def eval_batch_rows(report: dict) -> list[Line]:
    chosen = str(report["recipe_batch_size"])
    rows = [
        ([size + (" (the recipe's)" if size == chosen else ""), number(rate)], "eval_batch.json")
        for size, rate in report["tokens_per_s"].items()
    ]
    return markdown_table(["evaluation batch size", "tokens/s"], "lr", rows)


def matmul_peak_rows(report: dict) -> list[Line]:
    """The CPU's matrix-product rate by size and dtype (``benchmarks.matmul_peak``); the sizes a training run takes its
    peak from are marked."""
    sizes, measured = report["sizes"], set(report["measured_sizes"])
    rows = [([dtype, *(number(rates[str(size)]) for size in sizes)], "matmul_peak.json")
            for dtype, rates in report["gflops_per_s"].items()]  # fmt: skip
    header = ["dtype", *(f"{size}² GFLOP/s" + (" (a run's)" if size in measured else "") for size in sizes)]
    return markdown_table(header, "l" + "r" * len(sizes), rows)


def char_packing_rows(report: dict) -> list[Line]:
    cells = [f"{report['characters']:,}", number(report["tokenizer_ms"]), number(report["char_encoder_ms"]),
             f"{report['ratio']:.0f}×"]  # fmt: skip
    return markdown_table(
        ["characters", "tokenizer call, ms", "`CharEncoder`, ms", "ratio"], "rrrr", [(cells, "char_packing.json")]
    )


def spread(result: dict, key: str) -> str:
    """The median of ``key`` over a shape's runs, and their range."""
    values = [run[key] for run in result["runs"]]
    return f"{number(result['median'][key])} ({number(min(values))}–{number(max(values))})"


def signal_exit_rows(report: dict) -> list[Line]:
    """Medians, and for the save and the whole the range over the runs (the machine's load varied)."""
    rows = []
    for shape, result in report["shapes"].items():
        m = result["median"]
        cells = [f"{shape}, {len(result['runs'])} runs", f"{m['checkpoint_bytes'] / 2**20:,.0f} MiB", number(m["step_s"]),
                 number(m["step_in_flight_s"]), spread(result, "save_s"), number(m["exit_s"]),
                 f"**{spread(result, 'signal_to_exit_s')}**"]  # fmt: skip
        rows.append((cells, "signal_exit.json"))
    header = ["shape", "checkpoint", "one step, s", "step in flight, s", "save, s (range)", "exit, s",
              "signal to exit, s (range)"]  # fmt: skip
    return markdown_table(header, "lrrrrrr", rows)


def gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def data_pipeline_rows(prepare: dict, loader: dict, resume: dict, tiny: dict, rss: dict) -> list[Line]:
    """The four speed and memory goals against nanoGPT and Llama, each beside its reference and its goal, and make demo's two data paths."""
    rate = prepare["median_tokens_per_s_per_core"]
    batches = loader["median_tokens_per_s"]
    first = resume["median_seconds_to_first_step"]
    far = f"{resume['far_step']:,}"
    peak = rss["peak_rss_bytes"]
    demo = tiny["medians"]
    rows = [
        ([f"preparing shards, tokens/s per core ({prepare['megabytes']:.0f} MB corpus, {prepare['processes']} processes)",
          number(rate["ours"]), f"nanoGPT's method (tiktoken, `datasets.map`, one uint16 file): {number(rate['nanogpt'])}",
          f"{times(prepare['ratio_ours_over_nanogpt'])} (goal ≥ 1.00×)"], "prepare_data.json"),
        ([f"one rank's batches from shards, tokens/s ({loader['batch_size']} × {loader['block_size']})",
          number(batches["BlockBatches (memmap shards)"]),
          f"nanoGPT's `get_batch` on one memmap: {number(batches['nanoGPT get_batch (one memmap)'])}",
          "goal ≥ 50,000,000"], "data_loader.json"),
        ([f"launch to first step, resumed at step 10 / {far}, prepared shards",
          f"{first['prepared, resumed at step 10']:.1f} s / {first['prepared, resumed at step 10,000']:.1f} s", "-",
          "goal: equal within noise"], "resume_time.json"),
        ([f"launch to first step, resumed at step 10 / {far}, stream", f"{first['stream, resumed at step 10']:.1f} s / "
          f"{first['stream, resumed at step 10,000']:.1f} s",
          f"the replay it replaced, at step {far}: {first['stream, replayed to step 10,000 (before)']:.1f} s", "-"],
         "resume_time.json"),
        ([f"peak RSS of one rank, {rss['train_tokens'] / 1e6:.0f}M training tokens", f"{gib(peak['prepared'])} from shards",
          f"in memory: {gib(peak['in_memory'])}", "goal < 1.5 GB"], "rss.json"),
        (["`make demo`: first step / 99 steps, prepared shards", f"{demo['prepared shards']['first_step_s']:.1f} s / "
          f"{demo['prepared shards']['loop_s']:.1f} s",
          f"in memory (what `make demo` uses): {demo['in memory (make demo)']['first_step_s']:.1f} s / "
          f"{demo['in memory (make demo)']['loop_s']:.1f} s; preparing first: {tiny['prepare_data_s']:.1f} s", "-"],
         "resume_time-tiny_shakespeare.json"),
    ]  # fmt: skip
    return markdown_table(["measure", "decoderlab", "beside it", "against the goal"], "lrll", rows)


def sampler_curves_rows(*reports: dict) -> list[Line]:
    """Each run's best validation loss (and its step), and its last: fixed blocks against windows at every offset
    and nanoGPT's recipe, over many passes of one text; one group of rows per results file (seed)."""
    rows = []
    for report, name in zip(reports, SAMPLER_CURVES):
        per_pass = report["steps"] / report["passes"]
        rows += [
            ([run["name"], str(report.get("seed", 1337)), f"{run['best_val']:.3f}",
              f"{run['best_step']} ({run['best_step'] / per_pass:.1f} passes)",
              f"{run['curve'][-1]['val']:.3f} (step {run['curve'][-1]['step']})"],
             name)
            for run in report["runs"]
        ]  # fmt: skip
    return markdown_table(
        ["training windows", "seed", "best validation loss", "at step", "last evaluated"],
        "lrrrr",
        rows,
    )


SAMPLER_CURVES = ("sampler_curves.json", "sampler_curves-seed2.json")


def sampler_demo_rows(*reports: dict) -> list[Line]:
    """``make demo``'s recipe with each window sampling: the validation loss it ends with, and its loop's time with
    the threads and the load average (before, after) it ran under; one group of rows per results file."""
    rows = []
    for report, name in zip(reports, SAMPLER_DEMO):
        load = "-".join(f"{x:.1f}" for x in report["load_average"])
        rows += [
            ([f"`{run['sampling']}`", f"{run['final_val']:.4f}", f"{run['best_val']:.4f} (step {run['best_step']})",
              f"{run['loop_s']:.0f} s", f"{report['provenance']['threads']}, load {load}"], name)
            for run in report["runs"]
        ]  # fmt: skip
    return markdown_table(
        ["`window_sampling`", "final validation loss", "best periodic validation (256 blocks)", "training loop",
         "threads, load average"], "lrrrl", rows,
    )  # fmt: skip


SAMPLER_DEMO = ("sampler_demo.json", "sampler_demo-2threads.json")


EXPLORE_VIEWS = ("attention", "scale re-runs", "heads", "positions", "norm placement", "generation")


def explore_rows(report: dict) -> list[Line]:
    """Each view's time for a new prompt (cold: the shared forward pass included) / for the same prompt again."""
    rows = [
        ([f"{name} ({result['model']})", str(prompt["prompt_tokens"]), f"{result['goal_s']:.0f} s"]
         + [f"{prompt['cold_s'][view]:.2f} / {prompt['warm_s'][view]:.2f}" for view in EXPLORE_VIEWS],
         "explore_speed.json")
        for name, result in report["results"].items()
        for prompt in result["prompts"]
    ]  # fmt: skip
    return markdown_table(
        ["checkpoint", "prompt tokens", "goal"] + [f"{view}, s" for view in EXPLORE_VIEWS], "lrr" + "r" * 6, rows
    )


def sample_efficiency_rows(report: dict) -> list[Line]:
    """The sample-efficiency grid: each setting's tokens to the target (mean ± standard deviation over the seeds), how many times
    fewer than the recipe before, its final validation loss; make demo's shape, then 6 x 384."""
    grid, rows = report["grid"], []
    for shape, label, target in (("demo", "4 x 128 (`make demo`)", grid["target_loss"]),
                                 ("wide", "6 x 384", grid["wide_target_loss"])):  # fmt: skip
        for setting in grid[shape].values():
            tokens = (f"{setting['tokens_mean'] / 1e3:,.0f}k ± {setting['tokens_std'] / 1e3:,.0f}k"
                      if setting["tokens_mean"] is not None else "not reached by every seed")  # fmt: skip
            fewer = times(setting["fewer_tokens_x"]) if setting["fewer_tokens_x"] is not None else "-"
            rows.append(([label, setting["name"], f"{setting['steps']} x {setting['batch_size']}", f"{target:.3f}",
                          tokens, fewer, f"{setting['final_eval_loss_mean']:.3f} ± {setting['final_eval_loss_std']:.3f}"],
                         "sample_efficiency.json"))  # fmt: skip
    return markdown_table(
        ["shape", "setting", "steps x batch", "target", "tokens to the target", "fewer than before",
         "final validation loss"], "lllrrrr", rows,
    )  # fmt: skip


def sample_efficiency_recipe_rows(report: dict) -> list[Line]:
    """make demo's recipe before Muon (the AdamW recipe) and now, alternating: the loss over every validation window, the whole
    command's and the loop's median time, and now / before (the median of the pairs' ratios, then each pair's)."""
    recipes = report["recipes"]
    rows = []
    for name, label in (("before", "before (AdamW, SwiGLU, cosine)"), ("now", "now (`shakespeare_char.yaml`)")):
        r = recipes[name]
        ratio_command = f" ({times(recipes['ratio_command'])})" if name == "now" else ""
        ratio_loop = f" ({times(recipes['ratio_loop'])})" if name == "now" else ""
        rows.append(([label, str(r["steps"]), f"{r['command_s']:.1f} s{ratio_command}", f"{r['loop_s']:.1f} s{ratio_loop}",
                      f"{r['val_loss_every_window']:.3f}"], "sample_efficiency.json"))  # fmt: skip
    verdict = "met" if recipes["meets_goal"] else "not met"
    pairs = [", ".join(times(pair[key]) for pair in recipes["ratios"]) for key in ("command", "loop")]
    rows.append((["each pair, now / before", "", *pairs, ""], "sample_efficiency.json"))
    rows.append(([f"goal: validation <= {recipes['goal_loss']} in no more time", "", "", "", verdict],
                 "sample_efficiency.json"))  # fmt: skip
    return markdown_table(["recipe", "steps", "whole command", "training loop", "validation loss"], "lrrrr", rows)


def muon_step_rows(*reports: dict) -> list[Line]:
    """Muon's step per run of benchmarks/investigations/muon_step.py (this CPU as it is, then with its extensions
    hidden): torch.optim.Muon against BatchedMuon in bfloat16 and float32, fused AdamW and the model's own step for
    scale, and what ``muon_ns_dtype: auto`` takes there."""
    rows = []
    for name, report in zip(MUON_STEP, reports):
        kernels = report["provenance"]["cpu_kernels"]["dispatch"]
        for r in report["rows"]:
            ms = r["step_ms"]
            cells = [kernels, r["model"], number(ms["torch.optim.Muon"]), number(ms["BatchedMuon bfloat16"]),
                     number(ms["BatchedMuon float32"]), number(ms["AdamW (fused)"]),
                     number(ms["model forward + backward"]), report["auto_dtype"]]  # fmt: skip
            rows.append((cells, name))
    header = ["kernels", "model", "`torch.optim.Muon`, ms", "batched bf16, ms", "batched fp32, ms", "AdamW, ms",
              "forward + backward, ms", "auto takes"]  # fmt: skip
    return markdown_table(header, "llrrrrrl", rows)


def few_rows_decode_rows(*reports: dict) -> list[Line]:
    """Decoding per run of benchmarks/investigations/few_rows_decode.py (this CPU's kernels, then held to AVX2):
    decoderlab with the few-rows product as its timing chose, with it off, the reference, and the shapes it kept."""
    rows = []
    for name, report in zip(FEW_ROWS_DECODE, reports):
        kernels = report["provenance"]["cpu_kernels"]["dispatch"]
        for r in report["rows"]:
            rates = list(r["tokens_per_s"].values())  # as chosen, product off, the reference
            kept = [shape for shape, faster in r["few_rows_kept"].items() if faster]
            cells = [kernels, f"{r['preset']} at {r['size']}, batch {r['batch_size']}", *map(number, rates),
                     f"{rates[0] / rates[1]:.2f}", f"{len(kept)} of {len(r['few_rows_kept'])}: " + (", ".join(kept) or "none")]  # fmt: skip
            rows.append((cells, name))
    header = ["kernels", "model", "decoderlab, tokens/s", "product off", "reference", "chosen / off", "shapes kept"]
    return markdown_table(header, "llrrrrl", rows)


LAYOUT_WORKLOADS = {"train": "training, tokens/s", "forward": "forward without gradients, tokens/s",
                    "masks": "making the forward's attention masks, ms (lower is better)",
                    "decode": "decoding, new tokens/s"}  # fmt: skip


def layouts_rows(report: dict) -> list[Line]:
    """Sliding windows on three of four layers against full attention on the same backend, interleaved: both figures
    (medians), windowed / full (the median of the rounds' own ratios, and their range), and both peaks of allocated
    memory; a backend that could not run a workload says what it raised."""
    rows = []
    for r in report["rows"]:
        skips = "yes" if r["skips_blocks"] else "no"
        what = [LAYOUT_WORKLOADS[r["workload"]], str(r["block"]), f"`{r['backend']}`", skips]
        if "error" in r:
            cells = [*what, f"not run: {r['error']}", "", "", "", ""]
        else:
            figure, peak, (low, high) = r["figures"], r["peak_mb"], r["ratio_range"]
            cells = [*what, number(figure["full"]), number(figure["windowed"]),
                     f"**{times(r['ratio'])}** ({low:.2f}–{high:.2f})", f"{number(peak['full'])} / "
                     f"{number(peak['windowed'])}", times(r["peak_ratio"]) if r["peak_ratio"] else "-"]  # fmt: skip
        rows.append((cells, "layouts.json"))
    header = ["measure", "block", "backend", "skips the blocks outside the window", "full attention", "windowed",
              "windowed / full (rounds' range)", "peak MB, full / windowed", "peak, windowed / full"]  # fmt: skip
    return markdown_table(header, "lrllrrrrr", rows)


def layouts_cache_rows(report: dict) -> list[Line]:
    """The KV cache after a generation of L tokens, windowed against full, beside the bound; then both goals."""
    window = report["shape"]["sliding_window"]
    rows = [
        ([f"{r['tokens']:,}", f"{r['full']['bytes']:,}", f"{r['windowed']['bytes']:,}", f"{r['ratio']:.3f}",
          f"{r['bound']:.3f}", "yes" if all(r[side]["bytes"] == r[side]["expected_bytes"] for side in ("full", "windowed"))
          else "no", " / ".join(map(str, r["windowed"]["tokens_held"]))], "layouts.json")
        for r in report["cache"]
    ]  # fmt: skip
    header = ["tokens generated (L)", "full attention, bytes", "windowed, bytes", "windowed / full",
              f"bound (3 × {window} + L) / (4 L)", "bytes as the formula says", "tokens each windowed layer holds"]  # fmt: skip
    goals = [(["goal: " + g["goal"], "**met**" if g["met"] else "**not met**", g["evidence"]], "layouts.json")
             for g in report["goals"]]  # fmt: skip
    cache = markdown_table(header, "rrrrrll", rows)
    return cache + [Line("")] + markdown_table(["goal", "verdict", "numbers"], "lll", goals)


def short_measured(name: str, data: dict) -> str:
    """E.g. "[Intel Xeon, 2026-12-03](link to the file)": the headline's column; the rest is on the performance page."""
    provenance = data["provenance"]
    cpu = re.sub(r"\((R|TM)\)|\b(Processor|CPU)\b|\s+\d+-Core.*", "", provenance.get("cpu") or "") or "CPU not recorded"
    day = (provenance.get("date") or provenance.get("committed_on") or "")[:10]
    return f"[{' '.join(cpu.split())}, {day}]({RESULTS_LINK}{name})"


def headline_rows(
    shakespeare: dict,
    train: dict,
    decode: dict,
    compiled: dict,
    vllm: dict,
    onnx: dict,
    gguf: dict,
    prepare: dict,
    resume: dict,
) -> list[Line]:
    """The README's few figures, each from its results file, each a link away from the rest."""

    def ratios(report: dict, benchmark: str, pair: str) -> dict[str, float]:
        return {r["size"]: r["ratio"] for r in report["results"] if r["benchmark"] == benchmark and r["pair"] == pair}

    train_llama, train_gpt2 = ratios(train, "train tokens/s", "llama"), ratios(train, "train tokens/s", "gpt2")
    decode_1 = ratios(decode, "decode tokens/s, batch 1", "llama")
    decode_8 = ratios(decode, "decode tokens/s, batch 8", "llama")
    plain = [r["ratio"] for r in compiled["results"] if r["pair"] == "llama-plain"]
    onnx_worst = max(row["onnx"]["max_abs_logit_difference"] for row in onnx["rows"])
    executorch_worst = max(row["executorch"]["max_abs_logit_difference"] for row in onnx["rows"])
    sizes = " / ".join
    measured = dict(zip(HEADLINE_SOURCES, (shakespeare, train, decode, compiled, vllm, onnx, gguf, prepare, resume)))
    first = resume["median_seconds_to_first_step"]
    rows = [
        (["the main job, `make demo`'s recipe", "nanoGPT's `shakespeare_char` CPU recipe",
          f"validation loss {shakespeare['ours']['val_loss_every_window']:.3f} against "
          f"{shakespeare['nanogpt']['val_loss_every_window']:.3f} in {times(shakespeare['ratio_command'])} the time"],
         "shakespeare_char.json"),
        (["training, tokens/s, nano / tiny", "`LlamaForCausalLM`, same weights",
          sizes(times(train_llama[s]) for s in ("nano", "tiny"))], "speed-runs3-train-rmsnorm.json"),
        (["training, tokens/s, nano / tiny", "`GPT2LMHeadModel`, same weights",
          sizes(times(train_gpt2[s]) for s in ("nano", "tiny"))], "speed-runs3-train-rmsnorm.json"),
        (["greedy decoding, batch 1 / 8, nano", "`LlamaForCausalLM`, same weights",
          f"{times(decode_1['nano'])} / {times(decode_8['nano'])}"], "speed-runs3.json"),
        (["static cache + `torch.compile` decoding", "`LlamaForCausalLM`'s plain `generate`",
          f"{times(min(plain))}–{times(max(plain))}"], "speed-runs3-prefill-compile.json"),
        (["serving in vLLM (CPU), batch 1 / 16", "`generate`",
          " / ".join(times(r["vllm_over_generate"]) for r in vllm["rows"])], "vllm_speed.json"),
        (["ONNX Runtime / ExecuTorch", "the model in transformers",
          f"logits within {small(onnx_worst)} / {small(executorch_worst)}"], "export_formats.json"),
        (["llama.cpp, GGUF f32", "the model in transformers",
          f"last-token logits within {small(gguf['outtypes']['f32']['llamacpp_max_last_logit_diff'])}"],
         "gguf_export.json"),
        (["preparing token shards, tokens/s per core", "nanoGPT's tiktoken + `datasets.map` method",
          times(prepare["ratio_ours_over_nanogpt"])], "prepare_data.json"),
        ([f"resuming a stream at step {resume['far_step']:,}, launch to first step", "replaying the trained batches",
          f"{first['stream, resumed at step 10,000']:.1f} s against "
          f"{first['stream, replayed to step 10,000 (before)']:.0f} s"], "resume_time.json"),
    ]  # fmt: skip
    rows = [(cells + [short_measured(source, measured[source])], source) for cells, source in rows]
    return markdown_table(["what", "against", "decoderlab", "measured"], "llll", rows)


HEADLINE_SOURCES = (
    "shakespeare_char.json",
    "speed-runs3-train-rmsnorm.json",
    "speed-runs3.json",
    "speed-runs3-prefill-compile.json",
    "vllm_speed.json",
    "export_formats.json",
    "gguf_export.json",
    "prepare_data.json",
    "resume_time.json",
)
MAIN_JOB = Table(
    "main-job",
    ("shakespeare_char.json", "shakespeare_char-second-run.json", "shakespeare_char-unk-token.json"),
    "main-job-recipe.md",
    main_job_rows,
)
MUON_STEP = ("muon_step.json", "muon_step-avx2.json")
FEW_ROWS_DECODE = ("few_rows_decode.json", "few_rows_decode-avx2.json")
CPU_BF16 = Table(
    "cpu-bf16", ("cpu_mixed_precision.json", "cpu_mixed_precision-amd-epyc.json"), "cpu-mixed-precision.md", bf16_rows
)
TABLES = [
    Table("headline", HEADLINE_SOURCES, None, headline_rows),
    MAIN_JOB,
    Table("speed", ("speed.json",), "speed-vs-references.md", lambda r: speed_rows(r, "speed.json")),
    Table(
        "speed-train-runs3",
        ("speed-runs3-train-rmsnorm.json",),
        "speed-vs-references.md",
        lambda r: combined_rows(r, "speed-runs3-train-rmsnorm.json"),
    ),
    Table(
        "speed-decode-runs3",
        ("speed-runs3.json",),
        "speed-vs-references.md",
        lambda r: combined_rows(r, "speed-runs3.json", ("decode",)),
    ),
    Table(
        "speed-prefill-compile-runs3",
        ("speed-runs3-prefill-compile.json",),
        "speed-vs-references.md",
        lambda r: combined_rows(r, "speed-runs3-prefill-compile.json"),
    ),
    Table(
        "speed-avx2",
        ("speed-avx2-runs3.json",),
        "speed-vs-references.md",
        lambda r: combined_rows(r, "speed-avx2-runs3.json"),
    ),
    Table("few-rows-decode", FEW_ROWS_DECODE, "speed-vs-references.md", few_rows_decode_rows),
    Table(
        "speed-amd-epyc",
        ("speed-amd-epyc-cc2ad5b.json",),
        "speed-vs-references.md",
        lambda r: speed_rows(r, "speed-amd-epyc-cc2ad5b.json"),
    ),
    Table("export-formats", ("export_formats.json",), "export-formats.md", export_rows),
    Table("gguf", ("gguf_export.json",), "export-formats.md", gguf_rows),
    Table("layouts", ("layouts.json",), "layouts.md", layouts_rows),
    Table("layouts-cache", ("layouts.json",), "layouts.md", layouts_cache_rows),
    Table("vllm", ("vllm_speed.json",), "vllm.md", vllm_rows),
    CPU_BF16,
    Table("nanogpt-gap", ("nanogpt_gap.json", "nanogpt_gap-second-run.json"), "nanogpt-gap.md", nanogpt_gap_rows),
    Table("rms-norm", ("rms_norm.json",), "kernels.md", rms_norm_rows),
    Table("loss-paths", ("loss_paths.json",), "kernels.md", loss_paths_rows),
    Table("eval-batch", ("eval_batch.json",), "main-job-recipe.md", eval_batch_rows),
    Table("training-memory", ("training_memory.json",), "gpu-training-2026-12-04.md", training_memory_rows),
    Table("compiled-step", ("compiled_step.json",), "gpu-training-2026-12-04.md", compiled_step_rows),
    Table("char-packing", ("char_packing.json",), "char-packing.md", char_packing_rows),
    Table("matmul-peak", ("matmul_peak.json",), "flops-and-health.md", matmul_peak_rows),
    Table("explore", ("explore_speed.json",), "explorer-speed.md", explore_rows),
    Table("sampler-curves", SAMPLER_CURVES, "window-sampling.md", sampler_curves_rows),
    Table("sampler-demo", SAMPLER_DEMO, "window-sampling.md", sampler_demo_rows),
    Table(
        "data-pipeline",
        ("prepare_data.json", "data_loader.json", "resume_time.json", "resume_time-tiny_shakespeare.json", "rss.json"),
        "data-pipeline.md",
        data_pipeline_rows,
    ),
    Table("signal-exit", ("signal_exit.json",), None, signal_exit_rows),
    Table("sample-efficiency", ("sample_efficiency.json",), None, sample_efficiency_rows),
    Table("sample-efficiency-recipe", ("sample_efficiency.json",), None, sample_efficiency_recipe_rows),
    Table("muon-step", MUON_STEP, "muon-step.md", muon_step_rows),
]
PAGES = {
    "README.md": ["headline"],
    "docs/performance.md": [table.name for table in TABLES],
    "docs/guides/data.md": ["data-pipeline", "sampler-curves", "sampler-demo"],
    "docs/guides/explore.md": ["explore"],
    "docs/guides/multi-node.md": ["signal-exit"],
}
# the GPU check's results files (gpu_check-GPU[-COMMIT].json), each shown on the performance page, newest first
GPU_CHECK = "gpu_check-*.json"
# what a reader must know about a GPU check file that its rows do not say
GPU_CHECK_NOTES = {
    "gpu_check-h200-ba4ff63.json": "The first GPU run, at main ba4ff63, before the GPU fixes that followed it: "
    "generation is eager with a dynamic cache only, and the training rows are the code before those fixes. It was run from an "
    "archive of that commit's tree (no .git), so its commit was written into the file by hand.",
}


def gpu_check_files() -> list[str]:
    files = [path for path in RESULTS.glob(GPU_CHECK) if "dry-run" not in path.name]
    dates = {path.name: json.loads(path.read_text())["provenance"].get("date") or "" for path in files}
    return sorted(dates, key=lambda name: (dates[name], name), reverse=True)


def gpu_check_lines(page: pathlib.Path) -> list[Line]:
    """Each GPU check's rows, newest first, or the sentence saying none has run."""
    names = gpu_check_files()
    if not names:
        return [Line("*Not measured: no `benchmarks/results/gpu_check-*.json` exists. No GPU has run "
                     "`python -m benchmarks.gpu_check` yet; only its CPU dry run runs, in the tests.*")]  # fmt: skip
    lines = []
    for name in names:
        report = json.loads((RESULTS / name).read_text())
        rows = [([row["check"], {True: "pass", False: "FAIL", None: "-"}[row["passed"]], str(row["value"])], name)
                for row in report["rows"]]  # fmt: skip
        note = f" {GPU_CHECK_NOTES[name]}" if name in GPU_CHECK_NOTES else ""
        lines += [Line(f"*Measured: {link(page, RESULTS / name, f'`{name}`')}: {measured_on(report['provenance'])}, "
                       f"{report['total_s']:.0f} s in all.{note}*", name), Line("")]  # fmt: skip
        lines += markdown_table(["check", "result", "value"], "lll", rows) + [Line("")]
    return lines[:-1]


# ----------------------------------------------------------------------------------------------
# Pages


def load(name: str) -> dict:
    path = RESULTS / name
    if not path.is_file():
        raise SystemExit(f"benchmarks/results/{name} does not exist, but a table of benchmarks/report.py reads it.")
    data = json.loads(path.read_text())
    if "provenance" not in data:
        raise SystemExit(
            f"benchmarks/results/{name} has no provenance: write it with benchmarks.common.write_results "
            "(or write_timing), which records the commit, date, CPU, threads and library versions."
        )
    return data


def render(table_name: str, page: pathlib.Path) -> list[Line]:
    if table_name == "gpu-check":
        return gpu_check_lines(page)
    table = next(t for t in TABLES if t.name == table_name)
    loaded = {name: load(name) for name in table.sources}
    if (
        table.name == "headline"
    ):  # the headline: each row links its file; where and when in full on the performance page
        where = (
            "the tables below give"
            if page == PERFORMANCE
            else f"{link(page, PERFORMANCE, 'the performance page')} gives"
        )
        top = [Line(f"*Each figure links its results file; {where} every table with its machine, date and commit.*"),
               Line("")]  # fmt: skip
    else:
        top = header(table, loaded, page)
    prefix = pathlib.Path(os.path.relpath(RESULTS, page.parent)).as_posix() + "/"
    lines = top + table.rows(*(loaded[name] for name in table.sources))
    return [Line(line.text.replace(RESULTS_LINK, prefix), line.source) for line in lines]


def page_tables(page: str) -> list[str]:
    return PAGES[page] + (["gpu-check"] if page == "docs/performance.md" else [])


def blocks(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def sources(table: str) -> tuple[str, ...]:
    return tuple(gpu_check_files()) if table == "gpu-check" else next(t.sources for t in TABLES if t.name == table)


def difference(page: str, table: str, expected: list[Line], found: str) -> str | None:
    """None when the page's block holds exactly ``expected``, else the first line that differs and the results file
    that line's figures come from (every file of the table for its header and layout)."""
    lines = found.rstrip("\n").split("\n") if found.strip() else []
    for i in range(max(len(lines), len(expected))):
        want = expected[i] if i < len(expected) else None
        have = lines[i] if i < len(lines) else None
        if want is None or have != want.text:
            files = [want.source] if want is not None and want.source else sources(table)
            return (
                f"{page}: table {table!r} differs from {', '.join(f'benchmarks/results/{f}' for f in files)} at its "
                f"line {i + 1}:\n  page: {have!r}\n  JSON: {want.text if want else None!r}\n"
                "  Run python -m benchmarks.report to regenerate the page from the JSON."
            )
    return None


def unshown() -> list[str]:
    """Results files (outside archive/) that no table renders."""
    shown = {name for table in TABLES for name in table.sources} | set(gpu_check_files())
    return sorted(p.name for p in RESULTS.glob("*.json") if p.name not in shown)


def check_or_write(page: str, write: bool) -> list[str]:
    """The problems of one page; with ``write``, its generated tables rewritten first (the rest kept as it is)."""
    path = REPO_ROOT / page
    if not path.is_file():
        return [f"{page} does not exist; it holds the tables {', '.join(page_tables(page))}."]
    text = path.read_text()
    rendered = {name: render(name, path) for name in page_tables(page)}
    missing = [name for name in rendered if name not in blocks(text)]
    if write:
        text = BLOCK.sub(
            lambda m: m[0] if m["name"] not in rendered else
            f"<!-- report:{m['name']} -->\n" + "".join(line.text + "\n" for line in rendered[m["name"]])
            + f"<!-- /report:{m['name']} -->",
            text,
        )  # fmt: skip
        path.write_text(text)
    found = blocks(text)
    problems = [
        f"{page}: no table {name!r}; put the lines <!-- report:{name} --> and <!-- /report:{name} --> where it goes, "
        "then run python -m benchmarks.report."
        for name in missing
    ]
    return problems + [
        problem
        for name, expected in rendered.items()
        if name in found and (problem := difference(page, name, expected, found[name]))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a page differs from the JSON")
    args = parser.parse_args(argv)
    problems = [
        f"benchmarks/results/{name} is shown by no table of benchmarks/report.py: add one, or move the file to "
        "benchmarks/results/archive/ if a newer run supersedes it."
        for name in unshown()
    ]
    for page in PAGES:
        problems += check_or_write(page, write=not args.check)
    for problem in problems:
        print(problem)
    if not problems:
        print(
            f"{', '.join(PAGES)}: every table as benchmarks/results says" if args.check else f"wrote {', '.join(PAGES)}"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
