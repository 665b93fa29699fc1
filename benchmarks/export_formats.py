"""Exports a model to ONNX and ExecuTorch through ``decoderlab.export.onnx_executorch`` and measures how far each
runtime's logits are from the model's, and how big each file is: the figures of the README's "Export formats" table.

    python -m benchmarks.export_formats                       # the two benchmark shapes below, random weights
    python -m benchmarks.export_formats --checkpoint out/shakespeare_char

Random weights are drawn as the tests draw them (matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1)), so logits are
O(1-10) and every weight matters. ONNX Runtime runs a (1, 64) and a (4, max_position_embeddings) batch of random ids
against the model without a cache; the ExecuTorch program runs a 32-token prefill and 10 greedy decoding steps
against eager decoding with a StaticCache. Results go to benchmarks/results/export_formats.json.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time
from importlib.metadata import version

import onnxruntime
import torch
from executorch.runtime import Runtime
from transformers.cache_utils import StaticCache

from benchmarks.common import machine_line, write_results
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.export.onnx_executorch import export_executorch, export_onnx

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

SHAPES = {
    # training/configs/shakespeare_char.yaml's model, over the character tokenizer (65 symbols + end of text)
    "shakespeare_char": dict(
        vocab_size=66,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=256,
        qk_norm=True,
        max_position_embeddings=64,
    ),
    # benchmarks/common.py's "tiny" size: nanoGPT's Shakespeare model with a BPE-sized vocabulary
    "tiny": dict(
        vocab_size=8192, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, max_position_embeddings=1024
    ),
}
PREFILL, STEPS = 32, 10


@torch.no_grad()
def randomize(model: torch.nn.Module) -> torch.nn.Module:
    for name, param in model.named_parameters():
        if param.ndim >= 2:
            param.normal_(0.0, 1.0 if "embed" in name else param.shape[-1] ** -0.5)
        else:
            param.normal_(1.0, 0.1)  # norm weights (no biases in these shapes)
    return model


@torch.no_grad()
def onnx_difference(model: DecoderLabForCausalLM, path: pathlib.Path) -> float:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for shape in [(1, 64), (4, model.config.max_position_embeddings)]:
        ids = torch.randint(0, model.config.vocab_size, shape)
        (logits,) = session.run(["logits"], {"input_ids": ids.numpy()})
        worst = max(worst, (torch.from_numpy(logits) - model(input_ids=ids, use_cache=False).logits).abs().max().item())
    return worst


@torch.no_grad()
def executorch_difference(model: DecoderLabForCausalLM, path: pathlib.Path) -> float:
    forward = Runtime.get().load_program(path).load_method("forward")
    cache = StaticCache(config=model.config, max_cache_len=model.config.max_position_embeddings)
    ids = torch.randint(0, model.config.vocab_size, (1, PREFILL))
    positions = torch.arange(PREFILL)
    worst = 0.0
    for _ in range(STEPS + 1):
        expected = model(input_ids=ids, cache=cache, use_cache=True).logits
        logits = forward.execute([ids, positions])[0]
        worst = max(worst, (logits - expected).abs().max().item())
        ids, positions = expected[:, -1:].argmax(-1), positions[-1:] + 1
    return worst


def measure(name: str, checkpoint: pathlib.Path, folder: pathlib.Path) -> dict:
    model = DecoderLabForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    weights = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    row = {"model": name, "parameters": model.num_parameters(), "safetensors_bytes": weights}
    for fmt, export, difference in [
        ("onnx", export_onnx, onnx_difference),
        ("executorch", export_executorch, executorch_difference),
    ]:
        out = folder / f"{name}.{'onnx' if fmt == 'onnx' else 'pte'}"
        start = time.perf_counter()
        export(checkpoint, out)
        row[fmt] = {
            "export_seconds": round(time.perf_counter() - start, 1),
            "bytes": sum(p.stat().st_size for p in folder.glob(out.name + "*")),  # with ONNX external data, if any
            "max_abs_logit_difference": difference(model, out),
        }
        print(name, fmt, row[fmt], flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=pathlib.Path, help="a decoderlab checkpoint instead of the shapes")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--output", type=pathlib.Path, default=REPO_ROOT / "benchmarks/results/export_formats.json")
    args = parser.parse_args(argv)
    machine = machine_line(torch.get_num_threads())
    print(machine, flush=True)
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        if args.checkpoint:
            rows.append(measure(args.checkpoint.name, args.checkpoint, folder))
        for name in [] if args.checkpoint else args.shapes:
            checkpoint = folder / f"{name}-checkpoint"
            randomize(DecoderLabForCausalLM(DecoderLabConfig(**SHAPES[name]))).save_pretrained(checkpoint)
            rows.append(measure(f"{name} (random weights)", checkpoint, folder))
    packages = ["torch", "transformers", "onnx", "onnxruntime", "onnxscript", "executorch"]
    result = {
        "machine": machine,
        "versions": {p: version(p) for p in packages},
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    write_results(args.output, result, torch.get_num_threads())


if __name__ == "__main__":
    main()
