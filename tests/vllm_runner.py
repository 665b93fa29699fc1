"""Serve checkpoints with vLLM's offline ``LLM``, one after another in this process, and write what came out.

    .venv-vllm/bin/python tests/vllm_runner.py JOBS.json RESULTS.json

Runs in ``.venv-vllm`` (``make vllm``), where decoderlab is not installed; it is also hidden here, so the only
model code that can run is the checkpoint's own (``trust_remote_code``). Each job names a checkpoint folder and
token-id prompts; each checkpoint gets its own ``LLM(model_impl="transformers", dtype=float32)`` (or the job's
``model_impl``: ``"auto"`` serves a plain family's checkpoint with vLLM's own implementation), answers every
prompt greedily (one batch, which vLLM schedules together), and is shut down before the next one starts. One
engine per process would cost vLLM's import (about half a minute) per checkpoint; sequential engines in one
process cost it once. A job that raises is recorded with its error and the rest still run.

Results, per job name: ``tokens`` (generated ids per prompt), ``logprobs`` (the log-probability vLLM gave each
generated token, before any sampling processing: ``raw_logprobs``), ``prompt_logprobs`` (that of every prompt
token after the first), ``seconds`` (engine start to shutdown), or ``error``. The file also says whether
decoderlab was imported and which checkpoint modules were.

Used by tests/test_vllm.py.
"""

import gc
import importlib.abc
import json
import sys
import time
import traceback


class HideDecoderlab(importlib.abc.MetaPathFinder):
    """``import decoderlab`` fails, as on a machine without the package."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "decoderlab":
            raise ModuleNotFoundError("decoderlab is hidden in the vLLM test process", name=name)


def serve(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=job["path"],
        model_impl=job.get("model_impl", "transformers"),
        trust_remote_code=True,
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,  # token ids in, token ids out
        max_model_len=job["max_model_len"],
        max_num_seqs=len(job["prompts"]),
        max_num_batched_tokens=max(256, job["max_model_len"]),
        kv_cache_memory_bytes=64 * 2**20,  # the CPU backend otherwise reserves 92% of the machine's memory
        enforce_eager=job.get("enforce_eager", True),
    )
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=job["new_tokens"], logprobs=0, prompt_logprobs=0, detokenize=False
        )
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens, logprobs, prompt_logprobs = [], [], []
        for prompt, output in zip(job["prompts"], outputs):
            completion = output.outputs[0]
            tokens.append(list(completion.token_ids))
            logprobs.append([step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs)])
            # position 0 has no logprob (nothing precedes it)
            prompt_logprobs.append([step[t].logprob for t, step in zip(prompt[1:], output.prompt_logprobs[1:])])
    finally:
        del llm
        cleanup_dist_env_and_memory()
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    jobs_path, results_path = sys.argv[1:3]
    sys.meta_path.insert(0, HideDecoderlab())
    # vLLM runs full garbage collections several times per engine start and stop (after unfreezing the whole heap),
    # which with torch and vLLM imported cost more than a tiny model's load; the youngest two generations hold an
    # engine's garbage, and Python's own full collections still run as the heap grows.
    full_collect = gc.collect
    gc.collect = lambda generation=2: full_collect(min(generation, 1))
    results = {}
    for job in json.loads(open(jobs_path).read()):
        try:
            results[job["name"]] = serve(job)
        except Exception as error:  # recorded for the test to judge; the other checkpoints still run
            results[job["name"]] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        with open(results_path, "w") as out:  # after every job, so a crash keeps what was done
            json.dump(
                {
                    "results": results,
                    "decoderlab_imported": any(m.split(".")[0] == "decoderlab" for m in sys.modules),
                    "checkpoint_modules": sorted(m for m in sys.modules if m.startswith("transformers_modules.")),
                },
                out,
            )


if __name__ == "__main__":  # vLLM's engine may start worker processes, which re-import this file
    main()
