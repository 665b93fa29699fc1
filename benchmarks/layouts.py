"""What sliding windows on three of four layers cost and save on a CPU: training, the forward and decoding against
full attention on the same attention backend, side by side, and the KV cache a long generation keeps.

    python -m benchmarks.layouts --json_out benchmarks/results/layouts.json   # about 3 minutes on 2 cores
    python -m benchmarks.layouts --quick                                     # tiny shapes, one round: it runs

Two models of the llama preset at the nano shape (4 layers x 128, 4 heads, vocabulary 65), with the same weights:
full attention on every layer, and ``layer_types`` sliding on layers 0-2 with ``sliding_window=64`` (the fourth layer
keeps full attention). Each attention backend runs both, interleaved (A B A B ...) so that a change in the machine's
load hits both; figures are medians over ``--repeats`` rounds, and each row's ratio windowed / full is the median of
the rounds' own ratios (each from two calls seconds apart), with their range. The backends: flex attention, whose block mask lets the kernel skip the blocks outside the window; SDPA,
whose CPU kernel gets the window as a mask and computes every block under the diagonal; the eager attention, which
computes every score. At blocks of 256 and 1024 tokens, 4,096 tokens a batch (16 x 256, 4 x 1024):

- train: forward, backward and AdamW (fused, ``benchmarks.common.optimizer_step_fn``) on one batch; tokens/s.
- forward: the same batch's forward without gradients, what a prefill costs; tokens/s.
- masks: the attention masks that forward makes before its layers run, one per kind of layer (flex attention's
  block masks, SDPA's and eager's boolean or additive masks; none where SDPA's own causal path needs none); ms.
- decode: greedy ``generate`` of 64 tokens at batch 1 after a prompt of block - 64 tokens already in the cache (a
  copy of one prefilled cache each round: the prefill is not timed); new tokens/s.
- peak memory, for each of the three: the most bytes allocated at once during one call beyond what was allocated
  before it (the profiler's CPU allocator events, as ``benchmarks.training_memory`` reads them); MB. The same
  profiled call records the operators that took the most CPU time (the results file's ``profile_ms``).

A backend that cannot run a workload on this machine gets a row with the error it raised instead of figures (torch's
flex attention has no backward on a CPU).

The KV cache: after a generation of L tokens (a 16-token prompt and L - 16 new ones) the bytes of the cache object's key
and value tensors, windowed and full, beside the formula: a full layer holds every token but the last, a sliding one
the last w - 1, so with three of four layers sliding the windowed cache is (3 min(L - 1, w - 1) + L - 1) / (4 (L - 1))
of the full one, at most (3 w + L) / (4 L).

The goals: at block 1024 the windowed layout trains faster than full attention on a backend that skips the blocks
outside the window; a generation of L tokens holds at most (3 w + L) / (4 L) of full attention's cache.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
import traceback

import torch
import transformers

from benchmarks.common import (
    Size,
    interleaved_medians,
    load_average,
    machine_line,
    optimizer_step_fn,
    timing_parser,
    training_batch,
    write_timing,
)
from benchmarks.training_memory import allocations
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.compat_decoderlab import GENERATE_CACHE_KWARG, output_cache

SHAPE = dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=65)
WINDOW = 64
BLOCKS = (256, 1024)
TOKENS_PER_BATCH = 4096
NEW_TOKENS = 64  # decoded after a prompt of block - NEW_TOKENS tokens
CACHE_LENGTHS = (256, 1024, 2048)  # tokens generated, the cache's bytes measured after each
PROMPT_TOKENS = 16  # the prompt of those generations
QUICK = dict(window=8, blocks=(32, 64), tokens_per_batch=128, new_tokens=8, cache_lengths=(32, 96))
# flex attention skips the blocks its block mask marks empty; SDPA and eager compute every block the causal mask
# leaves, the window applied as a mask inside them
BACKENDS = {"flex_attention": True, "sdpa": False, "eager": False}
WORKLOADS = ("train", "forward", "masks", "decode")
IN_MS = {"masks"}  # workloads reported in milliseconds a call (the others in tokens/s)
GOAL_BLOCK = 1024
PROFILED_OPS = 8  # operators kept per profiled call, by their own CPU time


def sliding_layout(num_hidden_layers: int) -> list[str]:
    """Three of every four layers sliding, every fourth full (as nanochat's SSSL pattern repeats)."""
    return ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(num_hidden_layers)]


def build_pair(window: int, max_positions: int) -> dict[str, DecoderLabForCausalLM]:
    """{"full": ..., "windowed": ...}: the llama preset at SHAPE, the windowed one loaded with the full one's weights
    (a sliding window adds no parameter), both in eval mode, greedy generation without an end token."""
    torch.manual_seed(0)
    fields = dict(SHAPE, max_position_embeddings=max_positions)
    full = DecoderLabForCausalLM(DecoderLabConfig.from_preset("llama", **fields))
    windowed = DecoderLabForCausalLM(DecoderLabConfig.from_preset(
        "llama", **fields, layer_types=sliding_layout(SHAPE["num_hidden_layers"]), sliding_window=window))  # fmt: skip
    windowed.load_state_dict(full.state_dict())
    models = {"full": full, "windowed": windowed}
    for model in models.values():
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
        model.eval()
    return models


def size_of(block: int, tokens_per_batch: int) -> Size:
    return Size(**SHAPE, block_size=block, batch_size=max(1, tokens_per_batch // block))


def workload(name: str, model: DecoderLabForCausalLM, size: Size, new_tokens: int):
    """(one call's work, the tokens it handles): a training step, a forward, the attention masks a forward of that
    batch makes (one per kind of layer, as ``DecoderLabModel.forward`` makes them), or a decode of ``new_tokens``."""
    if name == "train":
        x, y = training_batch(size)
        model.train()
        return optimizer_step_fn(model, lambda: model(input_ids=x, labels=y).loss), x.numel()
    model.eval()
    if name == "forward":
        x, _ = training_batch(size)

        def forward() -> None:
            with torch.no_grad():
                model(input_ids=x, use_cache=False)

        return forward, x.numel()
    if name == "masks":
        x, _ = training_batch(size)
        with torch.no_grad():
            embeds = model.get_input_embeddings()(x)

        def masks() -> None:
            with torch.no_grad():
                for make_mask in model.model.mask_functions.values():
                    make_mask(model.config, embeds, None, None, None)

        return masks, x.numel()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, size.vocab_size, (1, size.block_size - new_tokens), generator=generator)
    with torch.no_grad():
        prefilled = output_cache(model(input_ids=prompt[:, :-1], use_cache=True))  # generate feeds the last token

    def decode() -> None:
        with torch.no_grad():
            model.generate(prompt, **{GENERATE_CACHE_KWARG: copy.deepcopy(prefilled)}, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False)  # fmt: skip

    return decode, new_tokens


def profiled(work, top: int = PROFILED_OPS) -> tuple[float, dict[str, float]]:
    """One call of ``work`` under the profiler: the most megabytes allocated at once beyond what was allocated
    before it, and the ``top`` operators by their own CPU time, in ms (where the time goes: the attention kernels,
    the masks, the products)."""
    gc.collect()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        work()
    ops = sorted(profile.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return allocations(profile)[0] / 1e6, {e.key[:80]: round(e.self_cpu_time_total / 1e3, 2) for e in ops}


def error_text(err: Exception) -> str:
    """The error's type and first line (and a compiler's first error, where the message holds one), and where in
    torch it was raised: what the row says instead of figures."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    said = lines[0][:200] if lines else ""
    compiler = next((line.split("error:", 1)[1].strip() for line in lines if " error: " in line), None)
    if compiler:
        said += f" ({compiler[:160]})"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/torch/" in f.filename]
    where = f", raised in torch/{frames[-1].filename.split('/torch/')[-1]}" if frames else ""
    return f"{type(err).__name__}: {said}{where}"


def compare(backend: str, block: int, name: str, models: dict, size: Size, new_tokens: int, repeats: int) -> dict:
    """One row: ``name`` on ``backend`` for both layouts, interleaved; or the error that stopped it."""
    row = {"workload": name, "block": block, "backend": backend, "skips_blocks": BACKENDS[backend],
           "batch_size": 1 if name == "decode" else size.batch_size}  # fmt: skip
    torch._dynamo.reset()  # flex attention compiles afresh for this block's shapes (no dynamic-shape kernel)
    load = load_average()
    try:
        works, tokens = {}, 0
        for layout, model in models.items():
            model.set_attn_implementation(backend)
            works[layout], tokens = workload(name, model, size, new_tokens)
            works[layout]()  # the first call: compiles what flex attention compiles, or raises what cannot run
        times = interleaved_medians(works, repeats=repeats, warmup=1)
        profiles = {layout: profiled(work) for layout, work in works.items()}
    except Exception as err:  # a backend that cannot run this workload here: the row says what it raised
        return {**row, "error": error_text(err), "load": [load, load_average()]}
    figures = {layout: 1e3 * t["median_s"] if name in IN_MS else tokens / t["median_s"] for layout, t in times.items()}
    # each round's windowed / full from its two calls, seconds apart: a change of load between rounds cancels
    rounds = [full / windowed for full, windowed in zip(times["full"]["samples_s"], times["windowed"]["samples_s"])]
    if name in IN_MS:
        rounds = [1 / r for r in rounds]
    peaks = {layout: peak for layout, (peak, _) in profiles.items()}
    return {**row, "unit": "ms" if name in IN_MS else "tokens/s", "figures": figures,
            "ratio": statistics.median(rounds), "ratio_range": [min(rounds), max(rounds)], "peak_mb": peaks,
            "peak_ratio": peaks["windowed"] / peaks["full"] if peaks["full"] else None, "load": [load, load_average()],
            "samples_s": {layout: t["samples_s"] for layout, t in times.items()},
            "profile_ms": {layout: ops for layout, (_, ops) in profiles.items()}}  # fmt: skip


def cache_bytes(model: DecoderLabForCausalLM, length: int) -> tuple[int, list[int]]:
    """Bytes of the key and value tensors the cache holds after a generation of ``length`` tokens (PROMPT_TOKENS of
    prompt), and the tokens each layer holds."""
    prompt = torch.randint(1, SHAPE["vocab_size"], (1, min(PROMPT_TOKENS, length - 1)),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    new = length - prompt.shape[1]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True)  # fmt: skip
    cache = output_cache(out)
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers), [
        layer.keys.shape[-2] for layer in cache.layers
    ]


def expected_cache_bytes(config, length: int) -> int:
    """The formula: per layer, a key and a value of num_key_value_heads x head_dim float32 numbers for every token
    it holds: length - 1 in a full layer (the last token is never fed back), the last sliding_window - 1 in a sliding
    one."""
    per_token = 2 * config.num_key_value_heads * config.head_dim * 4
    held = [length - 1 if kind == "full_attention" else min(length - 1, config.sliding_window - 1)
            for kind in config.layer_types]  # fmt: skip
    return per_token * sum(held)


def cache_rows(models: dict, lengths, window: int) -> list[dict]:
    rows = []
    for length in lengths:
        row = {"tokens": length, "bound": (3 * window + length) / (4 * length)}
        for layout, model in models.items():
            model.set_attn_implementation("sdpa")
            measured, held = cache_bytes(model, length)
            row[layout] = {"bytes": measured, "expected_bytes": expected_cache_bytes(model.config, length),
                           "tokens_held": held}  # fmt: skip
        row["ratio"] = row["windowed"]["bytes"] / row["full"]["bytes"]
        rows.append(row)
    return rows


def goals(rows: list[dict], cache: list[dict], goal_block: int) -> list[dict]:
    """The two goals, decided from the rows: training at ``goal_block`` faster windowed than full on a backend that
    skips blocks (a backend that raised counts as not met, with its error); every generation's cache within the bound
    and equal to the formula."""
    training = [r for r in rows if r["workload"] == "train" and r["block"] == goal_block and r["skips_blocks"]]
    return [
        {"goal": f"at block {goal_block} the windowed layout trains faster than full attention on a backend that skips "
                 "the blocks outside the window",
         "met": bool(training) and all("error" not in r and r["ratio"] > 1.0 for r in training),
         "evidence": "; ".join(f"{r['backend']}: " + (r["error"] if "error" in r else f"{r['ratio']:.2f}x")
                               for r in training) or "no such backend ran"},
        {"goal": "a generation of L tokens holds at most (3 w + L) / (4 L) of full attention's cache",
         "met": all(r["ratio"] <= r["bound"] and all(r[layout]["bytes"] == r[layout]["expected_bytes"]
                                                     for layout in ("full", "windowed")) for r in cache),
         "evidence": "; ".join(f"L={r['tokens']}: {r['ratio']:.3f} <= {r['bound']:.3f}" for r in cache)},
    ]  # fmt: skip


def describe(row: dict) -> str:
    where = f"{row['workload']:8s} block {row['block']:5d} {row['backend']:15s}"
    if "error" in row:
        return f"{where} not run: {row['error']}"
    rates = row["figures"]
    low, high = row["ratio_range"]
    return (f"{where} full {rates['full']:9.1f}  windowed {rates['windowed']:9.1f} {row['unit']:8s}  "
            f"{row['ratio']:5.2f}x ({low:.2f}-{high:.2f})   "
            f"peak {row['peak_mb']['full']:7.1f} / {row['peak_mb']['windowed']:7.1f} MB  "
            f"load {row['load'][0]:.1f}-{row['load'][1]:.1f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__, repeats=5)
    parser.add_argument("--quick", action="store_true", help="tiny blocks, one round: checks that it runs")
    parser.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate's notes on unset sampling options, once per call
    try:
        measure(args)
    finally:  # a caller in the same process (the tests) keeps transformers' warnings
        transformers.logging.set_verbosity(verbosity)


def measure(args) -> None:
    settings = QUICK if args.quick else dict(window=WINDOW, blocks=BLOCKS, tokens_per_batch=TOKENS_PER_BATCH,
                                             new_tokens=NEW_TOKENS, cache_lengths=CACHE_LENGTHS)  # fmt: skip
    repeats = 1 if args.quick else args.repeats
    load_before = load_average()
    print(machine_line(args.threads), flush=True)
    models = build_pair(settings["window"], max(max(settings["blocks"]), max(settings["cache_lengths"])))
    rows = []
    for block in settings["blocks"]:
        size = size_of(block, settings["tokens_per_batch"])
        for name in WORKLOADS:
            for backend in args.backends:
                rows.append(compare(backend, block, name, models, size, settings["new_tokens"], repeats))
                print(f"[{time.strftime('%H:%M:%S')}] {describe(rows[-1])}", flush=True)
    cache = cache_rows(models, settings["cache_lengths"], settings["window"])
    for row in cache:
        print(f"KV cache after {row['tokens']:5d} tokens: full {row['full']['bytes']:>10,d} B, windowed "
              f"{row['windowed']['bytes']:>10,d} B: {row['ratio']:.3f} of full (bound {row['bound']:.3f})")  # fmt: skip
    checks = goals(rows, cache, max(settings["blocks"]) if args.quick else GOAL_BLOCK)
    for check in checks:
        print(f"goal {'met' if check['met'] else 'NOT met'}: {check['goal']} ({check['evidence']})")
    write_timing(args.json_out, args.threads, load_before, quick=args.quick, repeats=repeats,
                 shape={**SHAPE, "layer_types": sliding_layout(SHAPE["num_hidden_layers"]),
                        "sliding_window": settings["window"], "tokens_per_batch": settings["tokens_per_batch"],
                        "new_tokens": settings["new_tokens"], "prompt_tokens": PROMPT_TOKENS},
                 rows=rows, cache=cache, goals=checks)  # fmt: skip


if __name__ == "__main__":
    main()
