"""decoderlab: a small decoder-only language model for transformers, with every mechanism a switch.

Importing the package registers the model with transformers' Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from .configuration_decoderlab import DecoderLabConfig
from .modeling_decoderlab import (
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
