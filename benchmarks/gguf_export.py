"""What each GGUF --outtype costs: file size, and agreement with decoderlab in both readers of the file.

    make llamacpp && python -m benchmarks.gguf_export                 # trains a small model first (about a minute)
    python -m benchmarks.gguf_export --src out/shakespeare_char       # or measure a checkpoint you have

Without --src, the default recipe (``shakespeare_char``, 4 x 128 x 4, characters, QK-norm: llama.cpp's ``qwen3``
architecture) is trained for 300 steps. Each outtype's file is then read by
- transformers' GGUF loader: max |logit difference| from decoderlab over every position of the prompts;
- llama.cpp (tests/llamacpp_runner.py in .venv-llamacpp): max |difference| of the last-token logits, and
  how many of 32 greedy tokens per prompt equal decoderlab's greedy tokens.
Writes benchmarks/results/gguf_export.json and prints a Markdown table for the README.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.common import machine_line, write_results
from decoderlab.export.gguf_file import OUTTYPES, convert_to_gguf

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "training" / "configs" / "shakespeare_char.yaml"
DATA = REPO_ROOT.parent / "shared" / "data" / "tiny_shakespeare"
LLAMACPP_PYTHON = REPO_ROOT / ".venv-llamacpp" / "bin" / "python"
RUNNER = REPO_ROOT / "tests" / "llamacpp_runner.py"
PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed", "KING RICHARD III:\nNow is the winter of our"]
NEW_TOKENS = 32


def train(folder: pathlib.Path) -> pathlib.Path:
    command = [sys.executable, str(REPO_ROOT / "training" / "pretrain.py"), "--config", str(RECIPE)]
    command += ["--dataset_name", str(DATA) if DATA.is_dir() else "karpathy/tiny_shakespeare"]
    command += ["--output_dir", str(folder), "--max_train_steps", "300"]
    command += ["--eval_steps", "none", "--load_best_model_at_end", "false", "--checkpointing_steps", "none",
                "--max_eval_samples", "8"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--src", type=pathlib.Path, help="a decoderlab checkpoint that exports to GGUF (default: train one)"
    )
    parser.add_argument(
        "--results", type=pathlib.Path, default=REPO_ROOT / "benchmarks" / "results" / "gguf_export.json"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        src = args.src or train(tmp / "model")
        model = AutoModelForCausalLM.from_pretrained(src).eval()
        tokenizer = AutoTokenizer.from_pretrained(src)
        prompts = [tokenizer(p).input_ids for p in PROMPTS]
        with torch.no_grad():
            reference = [model(torch.tensor([ids])).logits[0] for ids in prompts]
            greedy = [
                model.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids)),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                )[0, len(ids) :].tolist()
                for ids in prompts
            ]
        files = {outtype: convert_to_gguf(src, tmp / f"{outtype}.gguf", outtype) for outtype in OUTTYPES}
        jobs = [{"model": str(f), "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "n_ctx": 128} for f in files.values()]
        done = subprocess.run([str(LLAMACPP_PYTHON), str(RUNNER)], input=json.dumps(jobs), capture_output=True,
                              text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        rows = {}
        # transformers' qwen3 GGUF mapping reads no head_dim (Qwen3Config's default 128 would stand)
        head_dim = {"head_dim": model.config.head_dim} if model.config.qk_norm else {}
        for (outtype, path), llamacpp in zip(files.items(), json.loads(done.stdout)):
            loaded = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, **head_dim).eval()
            with torch.no_grad():
                hf_diff = max(
                    (loaded(torch.tensor([ids])).logits[0] - r).abs().max().item() for ids, r in zip(prompts, reference)
                )
            rows[outtype] = {
                "file_bytes": path.stat().st_size,
                "transformers_max_logit_diff": hf_diff,
                "llamacpp_max_last_logit_diff": max(
                    (torch.tensor(run["last_logits"]) - r[-1].double()).abs().max().item()
                    for run, r in zip(llamacpp, reference)
                ),
                "llamacpp_same_ids": all(run["ids"] == ids for run, ids in zip(llamacpp, prompts)),
                "llamacpp_greedy_matching": sum(
                    sum(a == b for a, b in zip(run["greedy"], g)) for run, g in zip(llamacpp, greedy)
                ),
                "greedy_total": NEW_TOKENS * len(PROMPTS),
            }
    results = {
        "machine": machine_line(torch.get_num_threads()),
        "model": str(args.src or "shakespeare_char recipe (QK-norm, llama.cpp's qwen3 architecture), 300 steps"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "max_abs_logit": max(r.abs().max().item() for r in reference),
        "outtypes": rows,
    }
    write_results(args.results, results, torch.get_num_threads())
    print(
        "| outtype | file size | transformers: max logit diff | llama.cpp: max last-token logit diff | llama.cpp greedy tokens equal |"
    )
    print("|---|---|---|---|---|")
    for outtype, row in rows.items():
        print(
            f"| {outtype} | {row['file_bytes'] / 1e6:.2f} MB | {row['transformers_max_logit_diff']:.2g} | "
            f"{row['llamacpp_max_last_logit_diff']:.2g} | {row['llamacpp_greedy_matching']}/{row['greedy_total']} |"
        )


if __name__ == "__main__":
    main()
