"""Shared fixtures: tiny configurations and models, seeding, and the switch values most tests sweep.

Fixtures here are generic on purpose (several test files use them); do not rename them.

- ``tiny_config(**overrides)``: a DecoderLabConfig small enough for CPU tests (vocab 99, hidden 64,
  2 layers, 4 heads), with any field overridden.
- ``tiny_model(config=None, **overrides)``: a DecoderLabForCausalLM in eval mode whose weights are
  re-drawn by ``randomize`` so that outputs are O(1) and every parameter matters.
- ``randomize(module)``: re-draws every parameter of any torch module (also a transformers Llama):
  matrices ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2), embeddings ~ N(0, 1).
  The default init (std 0.02) makes logits so small that a tolerance of 1e-5 would hide real bugs.
- ``position_type``: parametrizes a test over every ``position_embedding_type``.
- ``block_variant``: parametrizes over every norm placement plus the parallel residual, as config overrides.
- ``attention_heads``: parametrizes over multi-head, grouped-query and multi-query attention.
- ``all_block_variants``: the same block layouts as one dict, for a test that covers them all in one go.
- ``position_and_block``: each position type paired with one block layout (four cases, every value of both), for
  tests too slow for the whole product (graph exports).
- ``fresh_accelerate_state``: Accelerate's process-wide state reset before and after a test.
- ``free_port()`` (a function, imported by the tests that start servers): a free TCP port on 127.0.0.1.
- ``left_padding(batch, length)`` (a function): an attention mask whose row b starts with 3*b padding positions.
"""

import os

# No test may reach the real Hub (huggingface_hub reads this at import; the Hub tests talk only to
# servers they start on 127.0.0.1).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import socket
import typing

import pytest
import torch
from torch import nn

import decoderlab  # noqa: F401  (registers the Auto classes)
from decoderlab.configuration_decoderlab import NormPlacement, PositionEmbeddingType
from decoderlab.modeling_decoderlab import DecoderLabForCausalLM

TINY_SIZES = dict(
    vocab_size=99,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)

# config overrides for each block layout: the three norm placements, and GPT-NeoX's parallel residual
BLOCK_VARIANTS = {placement: {"norm_placement": placement} for placement in typing.get_args(NormPlacement)}
BLOCK_VARIANTS["parallel"] = {"norm_placement": "pre", "use_parallel_residual": True}

# each position type with one block layout: positions act below the blocks (added) or inside attention (rotated),
# norms around the sublayers, so the four pairs reach every value of both without the product's sixteen
POSITION_BLOCK_PAIRS = dict(zip(typing.get_args(PositionEmbeddingType), BLOCK_VARIANTS))

# num_key_value_heads with 4 query heads
ATTENTION_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


def left_padding(batch: int, length: int) -> torch.Tensor:
    """(B, T) attention mask: row b starts with 3*b padding positions (a function, imported by the tests that pad)."""
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        mask[b, : 3 * b] = 0
    return mask


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, for a server a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True, scope="session")
def _few_threads():
    """The CI machine has 2 cores; more threads only add contention. Under pytest-xdist (``make test`` runs one
    worker per core) each worker computes on one thread, so the workers do not compete for the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, previous))
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state whose mixed precision cannot change: each test that uses it builds its
    own Accelerator from scratch."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def one_thread():
    """One thread, for tests that train (and subprocesses started with the same setting): a tiny model gains
    nothing from more, and on a busy machine two OpenMP threads per process spin-wait for each other and run
    20x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state, so a failure reproduces."""
    torch.manual_seed(0)


@torch.no_grad()
def _randomize(module: nn.Module) -> nn.Module:
    for name, param in module.named_parameters():
        if param.ndim >= 2 and "embed" in name:
            param.normal_(0.0, 1.0)
        elif param.ndim >= 2:
            param.normal_(0.0, param.shape[-1] ** -0.5)  # (out, in): unit-variance outputs
        elif name.endswith("bias"):
            param.normal_(0.0, 0.1)
        else:  # norm weights
            param.normal_(1.0, 0.1)
    return module


@pytest.fixture(scope="session")  # a pure function: module-scoped fixtures build checkpoints with it
def randomize():
    return _randomize


@pytest.fixture
def tiny_config():
    def make(**overrides) -> decoderlab.DecoderLabConfig:
        return decoderlab.DecoderLabConfig(**{**TINY_SIZES, **overrides})

    return make


@pytest.fixture
def tiny_model(tiny_config):
    def make(config: decoderlab.DecoderLabConfig | None = None, **overrides) -> DecoderLabForCausalLM:
        config = config if config is not None else tiny_config(**overrides)
        return _randomize(DecoderLabForCausalLM(config)).eval()

    return make


@pytest.fixture(params=typing.get_args(PositionEmbeddingType))
def position_type(request) -> str:
    return request.param


@pytest.fixture(params=list(BLOCK_VARIANTS))
def block_variant(request) -> dict:
    """Config overrides selecting one block layout (pre, post, sandwich, parallel)."""
    return BLOCK_VARIANTS[request.param]


@pytest.fixture(params=[f"{position}-{block}" for position, block in POSITION_BLOCK_PAIRS.items()])
def position_and_block(request) -> dict:
    """Config overrides: rope with pre-norm, sinusoidal with post-norm, learned with sandwich, none with parallel."""
    position, block = request.param.split("-")
    return {"position_embedding_type": position, **BLOCK_VARIANTS[block]}


@pytest.fixture
def all_block_variants() -> dict[str, dict]:
    """{"pre": overrides, "post": ..., "sandwich": ..., "parallel": ...}."""
    return dict(BLOCK_VARIANTS)


@pytest.fixture(params=list(ATTENTION_HEADS))
def attention_heads(request) -> dict:
    """Config overrides selecting MHA, GQA or MQA for 4 query heads."""
    return {"num_key_value_heads": ATTENTION_HEADS[request.param]}
