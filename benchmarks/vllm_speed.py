"""Greedy decoding speed of vLLM (the CPU build, offline ``LLM``) against transformers' ``generate``, same checkpoint.

    python -m benchmarks.vllm_speed                 # the main venv; vLLM runs from .venv-vllm (make vllm)
    python -m benchmarks.vllm_speed --size nano --new_tokens 64 --repeats 2

A decoderlab model of ``--size`` (benchmarks.common.SIZES) is saved with its code; ``generate`` runs it here (fp32,
SDPA, the dynamic KV cache) and vLLM serves the same folder in a process of ``.venv-vllm`` where decoderlab cannot
be imported (``model_impl="transformers"``, ``trust_remote_code``, fp32, the default compiled engine). Both decode
``--new_tokens`` tokens after the same random ``--prompt_tokens``-token prompts (no end token: every sequence runs
to its length) at batch 1 and 16, ``--repeats`` timed rounds after one untimed, with ``--threads`` threads each
(vLLM's OpenMP threads are bound to the first ``--threads`` cores). Figures are new tokens/s over the whole call
(prefill included), medians; vLLM's engine start is not timed. Not a test: the figures depend on the machine and its
load, which the output reports.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "vllm_speed.json"
BATCH_SIZES = (1, 16)


def prompts(batch_size: int, prompt_tokens: int, vocab_size: int) -> list[list[int]]:
    """The same prompts for both sides: seeded, ids from 1 (0 may be a special token)."""
    import torch

    generator = torch.Generator().manual_seed(batch_size)
    return torch.randint(1, vocab_size, (batch_size, prompt_tokens), generator=generator).tolist()


def vllm_worker(request: dict) -> dict:
    """In .venv-vllm: start one engine on the folder, time ``LLM.generate`` per batch size."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=request["folder"], model_impl="transformers", trust_remote_code=True, dtype="float32", seed=0,
        skip_tokenizer_init=True, max_model_len=request["max_model_len"], max_num_seqs=max(request["batches"]),
        kv_cache_memory_bytes=512 * 2**20,
    )  # fmt: skip
    startup_s = time.perf_counter() - start
    params = SamplingParams(
        temperature=0.0, max_tokens=request["new_tokens"], min_tokens=request["new_tokens"], ignore_eos=True,
        detokenize=False,
    )  # fmt: skip
    results = {}
    for batch_size, batch in zip(request["batches"], request["prompts"]):
        inputs = [TokensPrompt(prompt_token_ids=ids) for ids in batch]
        samples = []
        for round_index in range(1 + request["repeats"]):
            start = time.perf_counter()
            outputs = llm.generate(inputs, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if round_index:
                samples.append(elapsed)
        assert all(len(o.outputs[0].token_ids) == request["new_tokens"] for o in outputs)
        results[str(batch_size)] = {"samples_s": samples, "first_tokens": list(outputs[0].outputs[0].token_ids)}
    return {"startup_s": startup_s, "results": results}


def run_vllm(request: dict, threads: int) -> dict:
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"vLLM is not installed at {VLLM_PYTHON}: run `make vllm` first.")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env.update(
        HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", OMP_NUM_THREADS=str(threads),
    )  # fmt: skip
    done = subprocess.run(
        [str(VLLM_PYTHON), __file__, "--worker", json.dumps(request)],
        env=env, cwd=request["folder"], capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"the vLLM worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", help="a size of benchmarks.common.SIZES (default tiny: 6 x 384)")
    parser.add_argument("--prompt_tokens", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=pathlib.Path, default=DEFAULT_JSON, help="where to write the results")
    args = parser.parse_args()

    import torch

    from benchmarks.common import SIZES, cpu_model, load_average, machine_line, write_results
    from decoderlab import DecoderLabConfig, DecoderLabForCausalLM

    torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    max_model_len = args.prompt_tokens + args.new_tokens
    config = DecoderLabConfig(  # the default architecture (RoPE, RMSNorm, SwiGLU) at this size
        num_hidden_layers=size.num_hidden_layers, hidden_size=size.hidden_size, vocab_size=size.vocab_size,
        num_attention_heads=size.num_attention_heads, max_position_embeddings=max_model_len,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DecoderLabForCausalLM(config).eval()
    print(machine_line(args.threads))
    print(f"model: decoderlab {args.size} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), "
          f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, fp32")  # fmt: skip
    batches = {b: prompts(b, args.prompt_tokens, size.vocab_size) for b in BATCH_SIZES}
    load_before = load_average()

    generate = {}
    for batch_size, batch in batches.items():
        ids = torch.tensor(batch)

        def timed(ids=ids) -> tuple[float, list[int]]:
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
                )
            return time.perf_counter() - start, out[0, args.prompt_tokens :].tolist()

        samples, first = [], None
        for round_index in range(1 + args.repeats):
            elapsed, first = timed()
            if round_index:
                samples.append(elapsed)
        generate[str(batch_size)] = {"samples_s": samples, "first_tokens": first}

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        request = dict(
            folder=folder, max_model_len=max_model_len, new_tokens=args.new_tokens, repeats=args.repeats,
            batches=list(batches), prompts=list(batches.values()),
        )  # fmt: skip
        vllm = run_vllm(request, args.threads)
    load_after = load_average()

    rows = []
    for batch_size in map(str, BATCH_SIZES):
        tokens = int(batch_size) * args.new_tokens
        hf = tokens / statistics.median(generate[batch_size]["samples_s"])
        served = tokens / statistics.median(vllm["results"][batch_size]["samples_s"])
        same = generate[batch_size]["first_tokens"] == vllm["results"][batch_size]["first_tokens"]
        rows.append({"batch_size": int(batch_size), "generate_tokens_per_s": hf, "vllm_tokens_per_s": served,
                     "vllm_over_generate": served / hf, "same_greedy_tokens_row0": same})  # fmt: skip
        print(f"batch {batch_size:>2}: generate {hf:8.1f} tok/s   vLLM {served:8.1f} tok/s   "
              f"vLLM/generate {served / hf:5.2f}x   same greedy tokens (row 0): {same}")  # fmt: skip
    print(f"vLLM engine start (not timed above): {vllm['startup_s']:.1f} s; load average {load_before:.1f} before, "
          f"{load_after:.1f} after")  # fmt: skip

    import transformers

    report = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "threads": args.threads, "machine": machine_line(args.threads),
        "torch": torch.__version__, "transformers_generate": transformers.__version__,
        "vllm": "vllm-cpu 0.32.0 (transformers it pins, in .venv-vllm)", "size": args.size,
        "parameters": sum(p.numel() for p in model.parameters()), "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "load_average_before": load_before,
        "load_average_after": load_after, "vllm_startup_s": vllm["startup_s"], "rows": rows,
        "samples_s": {"generate": generate, "vllm": vllm["results"]},
        "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    write_results(args.json, report, args.threads)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # in .venv-vllm, started by run_vllm
        print(json.dumps(vllm_worker(json.loads(sys.argv[2]))))
    else:
        main()
