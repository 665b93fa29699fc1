"""Decoding that uses the GPU: a static KV cache and a compiled forward on CUDA, through transformers' own mechanisms.

``generate`` compiles its decoding step by itself when the cache is compileable (``cache_implementation="static"``)
and the model sits on an accelerator, the way ``generation_config.compile_config`` says (Inductor with CUDA graphs,
``mode="reduce-overhead"``, by default). Small models are slow to decode eagerly on a GPU because every token costs
the Python and kernel launches of a whole forward (121 tokens/s at batch 1 for a GPT-2-small shape on an H200,
``benchmarks/results/gpu_check-h200-ba4ff63.json``); a compiled step replays one CUDA graph instead. On a CPU the
same switch would need measuring first, so ``"auto"`` is on for CUDA only.

``set_compiled_decoding(model, compile)`` sets the generation config; ``generate(model, ...)`` is ``model.generate``
that, when compiling fails (an unknown backend, a compiler error), logs one warning naming why and decodes the same
call again eagerly from the same random state: the tokens are then eager decoding's, never those of a half-built
graph.
"""

import logging

import torch
from transformers import CompileConfig, PreTrainedModel

logger = logging.getLogger(__name__)

COMPILE_CHOICES = ("auto", "on", "off")


def why_not_compileable(model: PreTrainedModel) -> str | None:
    """Why ``model``'s decoding step cannot be compiled with a static cache, or None when it can."""
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} does not declare that its forward compiles (_can_compile_fullgraph)"
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return f"its quantization ({type(quantizer).__name__}) does not compile"
    if not getattr(model.config, "use_cache", True):
        return "its config has use_cache=False, and a compiled decoding step needs the static KV cache"
    return None


def wants_compiled_decoding(model: PreTrainedModel, compile: str = "auto") -> bool:
    """Whether ``model`` should decode compiled: ``compile="on"``, or ``"auto"`` on CUDA, and the model can
    (``why_not_compileable``; a warning says why not when ``"on"`` or ``"auto"`` asked for it)."""
    if compile not in COMPILE_CHOICES:
        raise ValueError(f"compile={compile!r}: choose one of {', '.join(COMPILE_CHOICES)}.")
    on = compile == "on" or (compile == "auto" and model.device.type == "cuda")
    if on and (reason := why_not_compileable(model)) is not None:
        logger.warning("compiled decoding is off: %s; decoding eagerly", reason)
        return False
    return on


def compile_config(model: PreTrainedModel, backend: str = "inductor") -> CompileConfig:
    """How the decoding step compiles: Inductor with CUDA graphs (``reduce-overhead``) on a GPU, where they remove
    the per-token launch cost; other backends and devices take no mode."""
    mode = "reduce-overhead" if backend == "inductor" and model.device.type == "cuda" else None
    config = CompileConfig(backend=backend, mode=mode)
    config._compile_all_devices = True  # transformers' switch for compiling on a CPU too ("on" there)
    return config


def set_compiled_decoding(model: PreTrainedModel, compile: str = "auto", backend: str = "inductor") -> bool:
    """Make ``model.generate`` decode with a static cache and a ``torch.compile``'d forward (``compile="on"``),
    eagerly with a dynamic cache (``"off"``), or the first on CUDA and the second elsewhere (``"auto"``). A model
    that cannot compile (``why_not_compileable``) decodes eagerly, with a warning. Returns whether compiled
    decoding is on."""
    generation = model.generation_config
    if not wants_compiled_decoding(model, compile):
        generation.cache_implementation, generation.compile_config, generation.disable_compile = None, None, True
        return False
    generation.cache_implementation, generation.compile_config = "static", compile_config(model, backend)
    generation.disable_compile = False
    return True


def warn_falling_back(err: Exception) -> None:
    """The one warning line of a compiled decoding that failed: the error's type and first line."""
    first_line = (str(err).strip().splitlines() or [""])[0][:200]
    logger.warning(
        "compiled decoding failed (%s: %s); decoding eagerly with a dynamic cache instead",
        type(err).__name__,
        first_line,
    )


def compiled_decoding_is_on(model: PreTrainedModel) -> bool:
    generation = model.generation_config
    return generation.cache_implementation == "static" and not generation.disable_compile


def generate(model: PreTrainedModel, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """``model.generate(input_ids, **kwargs)``; where compiled decoding fails to compile, a warning naming why, then
    the same call decoded eagerly (``set_compiled_decoding(model, "off")`` from then on) from the random state the
    first attempt started with, so a sample is the one eager decoding draws."""
    if not compiled_decoding_is_on(model):
        return model.generate(input_ids, **kwargs)
    cpu_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        return model.generate(input_ids, **kwargs)
    except RuntimeError as err:  # torch.compile's errors are: an unknown backend, a compiler failure, a graph break
        warn_falling_back(err)
        set_compiled_decoding(model, "off")
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        return model.generate(input_ids, **kwargs)
