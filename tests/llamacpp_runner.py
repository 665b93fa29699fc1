"""Runs GGUF files in llama.cpp (llama-cpp-python), for tests/test_gguf_export.py and benchmarks/gguf_export.py.

Run with the python of the llama.cpp environment (`make llamacpp` builds .venv-llamacpp), never imported:

    .venv-llamacpp/bin/python tests/llamacpp_runner.py < jobs.json > results.json

jobs.json: ``[{"model": "x.gguf", "prompts": ["text", ...], "new_tokens": 8}, ...]``. For each job and prompt
the result holds llama.cpp's token ids of the prompt (no BOS, special tokens parsed), the text they detokenize
to, the logits after the prompt's last token, and ``new_tokens`` greedy tokens (argmax, through the KV cache).
The KV cache is kept in float32 (llama.cpp's default is float16), so an f32 file is compared at fp32.
"""

import json
import sys

import llama_cpp
import numpy as np


def run(job: dict) -> list[dict]:
    llm = llama_cpp.Llama(
        model_path=job["model"],
        n_ctx=job.get("n_ctx", 64),
        n_threads=1,
        n_threads_batch=1,
        logits_all=True,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        verbose=False,
    )
    results = []
    for prompt in job["prompts"]:
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        last_logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        greedy = []
        for _ in range(job["new_tokens"]):
            greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([greedy[-1]])
        results.append(
            {
                "ids": ids,
                "text": llm.detokenize(ids, special=True).decode("utf-8"),
                "last_logits": last_logits.tolist(),
                "greedy": greedy,
            }
        )
    return results


if __name__ == "__main__":
    json.dump([run(job) for job in json.load(sys.stdin)], sys.stdout)
