"""What the speed benchmarks share: sizes, model pairs with identical weights, interleaved timing, peak memory.

A *pair* is decoderlab and a reference implementation built for the same configuration and holding the
same weights (checked: their logits agree before anything is timed), so a ratio between them measures the
implementation and nothing else.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from benchmarks.reference_nanogpt import NanoGPT, NanoGPTConfig, NanoGPTRecipe, make_optimizer
from benchmarks.report import kernels_text
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.export.families import FROM, decoderlab_config_from_gpt2, llama_config_from_decoderlab
from training.checkpointing import cpu_model, git_commit, package_versions

# where results files live, relative to the repository root
RESULTS_DIR = "benchmarks/results"


@dataclass(frozen=True)
class Size:
    """A benchmark size: the model's shape and the training batch (batch x block tokens per step)."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    block_size: int
    batch_size: int


SIZES = {
    # nanoGPT's shakespeare_char CPU recipe
    "nano": Size(
        num_hidden_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=65, block_size=64, batch_size=12
    ),
    # nanoGPT's Shakespeare model size, with a BPE-sized vocabulary
    "tiny": Size(
        num_hidden_layers=6, hidden_size=384, num_attention_heads=6, vocab_size=8192, block_size=256, batch_size=12
    ),
}
# Every model gets positions up to 1024 (GPT-2's), so a 512-token prefill fits the learned-position ones too.
MAX_POSITIONS = 1024


# ----------------------------------------------------------------------------------------------
# Pairs: decoderlab and a reference with the same weights


@dataclass
class Pair:
    name: str  # e.g. "llama": what decoderlab is compared with
    ours: nn.Module
    reference: nn.Module
    reference_label: str  # e.g. "LlamaForCausalLM"


def _shape(size: Size) -> dict:
    return dict(
        num_hidden_layers=size.num_hidden_layers,
        hidden_size=size.hidden_size,
        num_attention_heads=size.num_attention_heads,
        vocab_size=size.vocab_size,
    )


def _ready(model: nn.Module) -> nn.Module:
    """Greedy generation without an end token (every run generates exactly max_new_tokens), eval mode."""
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return model.eval()


def llama_configs(size: Size) -> tuple[DecoderLabConfig, LlamaConfig]:
    """decoderlab's ``llama`` preset and the LlamaConfig computing the same (``decoderlab.export.families``)."""
    config = DecoderLabConfig.from_preset("llama", **_shape(size), max_position_embeddings=MAX_POSITIONS)
    return config, llama_config_from_decoderlab(config)


def gpt2_configs(size: Size) -> tuple[DecoderLabConfig, GPT2Config]:
    """GPT-2 without dropout, and its decoderlab config (``decoderlab.export.families``)."""
    gpt2_config = GPT2Config(
        n_layer=size.num_hidden_layers,
        n_embd=size.hidden_size,
        n_head=size.num_attention_heads,
        vocab_size=size.vocab_size,
        n_positions=MAX_POSITIONS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return decoderlab_config_from_gpt2(gpt2_config), gpt2_config


def llama_pair(size: Size, seed: int = 0) -> Pair:
    """decoderlab's ``llama`` preset and transformers' LlamaForCausalLM (SDPA), one state dict."""
    torch.manual_seed(seed)
    config, llama_config = llama_configs(size)
    ours = DecoderLabForCausalLM(config)
    reference = LlamaForCausalLM(llama_config)
    reference.load_state_dict(ours.state_dict())
    return Pair("llama", _ready(ours), _ready(reference), "LlamaForCausalLM")


def gpt2_pair(size: Size, seed: int = 0) -> Pair:
    """transformers' GPT2LMHeadModel (SDPA) and decoderlab converted from it (Conv1D weights transposed,
    c_attn split into q/k/v) with ``decoderlab.export.families``' mapping."""
    torch.manual_seed(seed)
    config, gpt2_config = gpt2_configs(size)
    reference = GPT2LMHeadModel(gpt2_config)
    ours = DecoderLabForCausalLM(config)
    conversion = FROM["gpt2"]
    state = {}
    for name, tensor in reference.state_dict().items():
        state.update(zip(conversion.targets(name), conversion.tensors(name, tensor, config)))
    ours.load_state_dict(state)
    return Pair("gpt2", _ready(ours), _ready(reference), "GPT2LMHeadModel")


def nanogpt_shaped_config(size: Size) -> DecoderLabConfig:
    """nanoGPT's model as a decoderlab config: the ``gpt2`` preset without biases and with exact GELU,
    positions up to block_size."""
    return DecoderLabConfig.from_preset(
        "gpt2",
        **_shape(size),
        max_position_embeddings=size.block_size,
        norm_bias=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="gelu",
    )


def decoderlab_state_from_nanogpt(state: dict[str, torch.Tensor], n_embd: int) -> dict[str, torch.Tensor]:
    """nanoGPT names -> decoderlab names; ``c_attn`` (3C, C) splits into q, k, v."""
    renames = {
        "transformer.wte.weight": "model.embed_tokens.weight",
        "transformer.wpe.weight": "model.embed_positions.weight",
        "transformer.ln_f.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    block = {
        "ln_1.weight": "input_layernorm.weight",
        "attn.c_proj.weight": "self_attn.o_proj.weight",
        "ln_2.weight": "post_attention_layernorm.weight",
        "mlp.c_fc.weight": "mlp.up_proj.weight",
        "mlp.c_proj.weight": "mlp.down_proj.weight",
    }
    out = {}
    for name, tensor in state.items():
        if name in renames:
            out[renames[name]] = tensor
            continue
        _, _, layer, rest = name.split(".", 3)  # transformer.h.<i>.<rest>
        prefix = f"model.layers.{layer}."
        if rest == "attn.c_attn.weight":
            for part, piece in zip("qkv", tensor.split(n_embd, dim=0)):
                out[f"{prefix}self_attn.{part}_proj.weight"] = piece
        else:
            out[prefix + block[rest]] = tensor
    return out


def nanogpt_pairs(size: Size, seed: int = 0) -> list[Pair]:
    """Our nanoGPT re-implementation against decoderlab twice: nanoGPT-shaped with the same weights, and
    the Llama-shaped default architecture at the same size (what the ``shakespeare_char`` recipe trains)."""
    torch.manual_seed(seed)
    reference = NanoGPT(NanoGPTConfig(**{**_nanogpt_shape(size), "block_size": size.block_size}))
    same = DecoderLabForCausalLM(nanogpt_shaped_config(size))
    same.load_state_dict(decoderlab_state_from_nanogpt(reference.state_dict(), size.hidden_size))
    llama_shaped = llama_pair(size, seed).ours
    return [
        Pair("nanogpt-same-weights", _ready(same), reference.eval(), "nanoGPT (re-implemented)"),
        Pair("nanogpt-llama-shaped", llama_shaped, reference.eval(), "nanoGPT (re-implemented)"),
    ]


def _nanogpt_shape(size: Size) -> dict:
    return dict(n_layer=size.num_hidden_layers, n_head=size.num_attention_heads, n_embd=size.hidden_size,
                vocab_size=size.vocab_size)  # fmt: skip


def logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits from an HF model or from NanoGPT (which returns them when given targets)."""
    with torch.no_grad():
        if isinstance(model, NanoGPT):
            return model(input_ids, input_ids)[0]
        return model(input_ids=input_ids).logits


def max_logit_difference(pair: Pair, size: Size) -> float:
    """The pair's largest logit difference on one random batch: the "same weights" check."""
    input_ids = torch.randint(size.vocab_size, (2, min(size.block_size, 32)))
    return (logits(pair.ours, input_ids) - logits(pair.reference, input_ids)).abs().max().item()


# ----------------------------------------------------------------------------------------------
# Workloads: each returns a zero-argument function that does one unit of work


def training_batch(size: Size, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One (batch, block) batch of random ids and targets, the same for every model given the same seed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(size.vocab_size, (size.batch_size, size.block_size), generator=generator)
    y = torch.randint(size.vocab_size, (size.batch_size, size.block_size), generator=generator)
    return x, y


def optimizer_step_fn(model: nn.Module, loss: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """One training step of ``model`` on ``loss()``: backward, AdamW, gradients dropped. Every model gets the same
    optimizer: nanoGPT's groups and hyper-parameters, ``fused=True`` (torch's fastest CPU AdamW; measured here
    0.6 ms per step at nano against 2.3 ms for the default loop)."""
    optimizer = make_optimizer(model, NanoGPTRecipe(), fused=True)

    def step() -> None:
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def train_step_fn(model: nn.Module, size: Size, seed: int = 0) -> Callable[[], None]:
    """Forward, backward and AdamW (``optimizer_step_fn``) on one (batch, block) batch."""
    x, y = training_batch(size, seed)
    model.train()
    if isinstance(model, NanoGPT):
        return optimizer_step_fn(model, lambda: model(x, y)[1])
    return optimizer_step_fn(model, lambda: model(input_ids=x, labels=y).loss)


def generate_fn(model: nn.Module, batch_size: int, prompt_length: int, new_tokens: int, vocab_size: int, **kwargs):
    """Greedy ``generate`` of exactly ``new_tokens`` tokens after a random prompt."""
    prompt = torch.randint(1, vocab_size, (batch_size, prompt_length), generator=torch.Generator().manual_seed(0))

    def run() -> None:
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)

    return run


def prefill_fn(model: nn.Module, prompt_length: int, vocab_size: int) -> Callable[[], None]:
    """One forward over a (1, prompt_length) prompt that fills a fresh KV cache: generate's first step."""
    prompt = torch.randint(vocab_size, (1, prompt_length), generator=torch.Generator().manual_seed(0))

    def run() -> None:
        with torch.no_grad():
            model(input_ids=prompt, use_cache=True, logits_to_keep=1)

    return run


# ----------------------------------------------------------------------------------------------
# Timing


def interleaved_medians(
    workloads: dict[str, Callable[[], None]], repeats: int, warmup: int = 1, inner: int = 1
) -> dict[str, dict]:
    """Run the workloads in turn (A B A B ...), ``repeats`` times after ``warmup`` untimed rounds; each
    timing covers ``inner`` calls. Returns per workload the median seconds per call and every sample."""
    samples = {name: [] for name in workloads}
    for round_index in range(warmup + repeats):
        for name, work in workloads.items():
            start = time.perf_counter()
            for _ in range(inner):
                work()
            elapsed = (time.perf_counter() - start) / inner
            if round_index >= warmup:
                samples[name].append(elapsed)
    return {name: {"median_s": statistics.median(s), "samples_s": s} for name, s in samples.items()}


def load_average() -> float:
    """The 1-minute load average: how busy the machine was while a figure was taken."""
    return os.getloadavg()[0]


def cpu_features() -> list[str]:
    """The CPU's vector and matrix extensions that decide which kernels oneDNN and MKL run (AVX2, AVX-512,
    its BF16 part, AMX), from /proc/cpuinfo's flags."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    flags = re.findall(r"flags\s*:\s*(.+)", cpuinfo.read_text()) if cpuinfo.is_file() else []
    return sorted(
        f for f in (flags[0].split() if flags else []) if f.startswith(("avx2", "avx512f", "avx512_bf16", "amx"))
    )


# The environment variables that hold torch's and oneDNN's kernels below what the CPU has: ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2 makes an AVX-512 machine run what an AVX2-only one runs (docs/development.md)
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def cpu_kernels() -> dict:
    """What the kernels that ran used, which /proc/cpuinfo's flags alone do not tell when ``ISA_LIMITS`` hold them
    lower: torch's vectorised kernels (``dispatch``: DEFAULT, AVX2, AVX512, ...), whether oneDNN computes bfloat16
    in hardware, and the limits set."""
    mkldnn = torch.backends.mkldnn.is_available()
    return {
        "dispatch": torch.backends.cpu.get_cpu_capability(),
        "bf16": "hardware" if mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported() else "software",
        "limits": {name: os.environ[name] for name in ISA_LIMITS if name in os.environ},
    }


def machine_line(threads: int) -> str:
    """One line naming what a benchmark ran on, printed by every benchmark before its figures."""
    return (
        f"CPU: {cpu_model()} ({os.cpu_count()} cores, {threads} threads; {kernels_text(cpu_kernels())}), "
        f"torch {torch.__version__}, transformers {transformers.__version__}, load {load_average():.1f}"
    )


def timing_parser(doc: str, repeats: int = 7) -> argparse.ArgumentParser:
    """The command line every kernel timing shares (``--repeats``, ``--threads``, ``--json_out``), described by the
    first paragraph of the benchmark's docstring ``doc``; a benchmark adds its own options to it."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=repeats, help="timed rounds of each path")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--json_out", default=None, help="also write the results here")
    return parser


def provenance(threads: int, source_commit: str | None = None) -> dict:
    """What a figure was measured with, the first field of every results JSON: the code (commit, and whether the
    checkout had uncommitted changes outside benchmarks/results), the date, the CPU (model, vector extensions,
    cores), the torch threads, the GPU if any, and the library versions. ``benchmarks.report`` prints it above each
    table. ``source_commit``: the commit a copy of the tree without its ``.git`` was made from (a GPU machine's),
    recorded, with ``commit_source`` saying so, only where git finds no repository of the project's own."""
    code = git_commit(ignore=(RESULTS_DIR,))
    if code["commit"] is None and source_commit is not None:
        code = {"commit": source_commit, "dirty": None, "commit_source": "given on the command line (no .git here)"}
    return {
        "recorded": "at run time",
        **code,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "cpu_kernels": cpu_kernels(),
        "cores": os.cpu_count(),
        "threads": threads,
        "accelerator": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "versions": package_versions(),
    }


def write_results(path: str | os.PathLike, result: dict, threads: int, source_commit: str | None = None) -> None:
    """Write a benchmark's ``result`` to ``path`` as JSON, ``provenance(threads, source_commit)`` first: the one
    writer of every results file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"provenance": provenance(threads, source_commit), **result}, indent=2) + "\n")
    print(f"wrote {path}")


def write_timing(json_out: str | None, threads: int, load_before: float, **fields) -> None:
    """Write a timing's ``fields`` to ``json_out`` (when given) after the machine line and the load average before
    and after, the preamble every benchmark's JSON starts with (after its provenance)."""
    if json_out:
        result = {"machine": machine_line(threads), "load_average": [load_before, load_average()], **fields}
        write_results(json_out, result, threads)


# ----------------------------------------------------------------------------------------------
# Peak training memory, each model in a fresh process


MEMORY_MODELS = {
    "decoderlab-llama": lambda size: DecoderLabForCausalLM(llama_configs(size)[0]),
    "LlamaForCausalLM": lambda size: LlamaForCausalLM(llama_configs(size)[1]),
    "decoderlab-gpt2": lambda size: DecoderLabForCausalLM(gpt2_configs(size)[0]),
    "GPT2LMHeadModel": lambda size: GPT2LMHeadModel(gpt2_configs(size)[1]),
}


def peak_training_memory(model_name: str, size_name: str, steps: int = 3, threads: int = 2) -> dict:
    """Peak resident memory of training, measured in a fresh subprocess that builds only this model, so
    nothing else's allocations count: RSS once model and batch are built, then the peak (the kernel's
    high-water mark VmHWM; ``ru_maxrss`` would not do, Linux carries it over from the parent across
    fork and exec) after ``steps`` training steps. The difference is what training adds: activations,
    gradients, AdamW state and allocator slack. (tracemalloc does not see torch's allocations.)"""
    request = json.dumps({"model": model_name, "size": size_name, "steps": steps, "threads": threads})
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.common", request],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _memory_status_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes: VmRSS (resident now) or VmHWM (the peak so far)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"{field} not in /proc/self/status: the memory benchmark needs Linux.")


def _memory_worker(request: dict) -> None:
    torch.set_num_threads(request["threads"])
    size = SIZES[request["size"]]
    model = MEMORY_MODELS[request["model"]](size)
    step = train_step_fn(model, size)
    before = _memory_status_bytes("VmRSS")
    for _ in range(request["steps"]):
        step()
    peak = _memory_status_bytes("VmHWM")
    print(json.dumps({**request, "rss_before_bytes": before, "peak_rss_bytes": peak, "added_bytes": peak - before}))


if __name__ == "__main__":
    _memory_worker(json.loads(sys.argv[1]))
