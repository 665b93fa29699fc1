"""decoderlab: a small decoder-only language model for transformers, with every mechanism a switch.

Importing the package registers the model with transformers' Auto classes.
"""

import logging
from contextlib import contextmanager

# transformers' model code imports its quantizer registry, which imports torchao whenever it is installed (the
# dev extra): torchao then logs that its CUDA kernels failed to load (on a CPU build of torch, or another torch
# than it was built for) and trips a deprecation warning in torch's pytree registry, on every command, --help
# included. Neither concerns decoderlab, which quantizes nothing: while the package imports transformers' model
# code these two loggers show errors only, and they get their levels back afterwards. Quantizing through
# TorchAoConfig works as before (docs/guides/quantization.md).
QUIET_WHILE_IMPORTING = ("torchao", "torch.utils._pytree")


@contextmanager
def _quiet_optional_backends():
    loggers = [logging.getLogger(name) for name in QUIET_WHILE_IMPORTING]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


with _quiet_optional_backends():
    import transformers.modeling_utils  # noqa: F401  (the import that pulls in torchao; see above)

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from .configuration_decoderlab import DecoderLabConfig  # noqa: E402
from .modeling_decoderlab import (  # noqa: E402
    DecoderLabForCausalLM,
    DecoderLabForSequenceClassification,
    DecoderLabModel,
    DecoderLabPreTrainedModel,
)

__version__ = "0.1.0"

AutoConfig.register(DecoderLabConfig.model_type, DecoderLabConfig, exist_ok=True)
AutoModel.register(DecoderLabConfig, DecoderLabModel, exist_ok=True)
AutoModelForCausalLM.register(DecoderLabConfig, DecoderLabForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(DecoderLabConfig, DecoderLabForSequenceClassification, exist_ok=True)

__all__ = [
    "DecoderLabConfig",
    "DecoderLabPreTrainedModel",
    "DecoderLabModel",
    "DecoderLabForCausalLM",
    "DecoderLabForSequenceClassification",
]
