"""The fine-tuning configuration: ``TrainConfig`` plus the base checkpoint, the data format and LoRA.

    python training/finetune.py --config training/configs/finetune_shakespeare_chat.yaml --use_lora --lora_r 16

Read exactly like the pretraining configuration (``training.args.parse_config``): a YAML recipe, then
``--FIELD VALUE`` overrides, checked once. Every optimisation, evaluation, checkpoint and tracking
field is ``TrainConfig``'s; the defaults below are the ones that differ for fine-tuning.
"""

from dataclasses import dataclass
from typing import Literal

from .args import TOKENIZER_TYPES, TrainConfig, option

DATA_FORMATS = Literal["text", "prompt_completion", "chat"]
OVERLONG_PROMPT = Literal["truncate", "refuse"]


@dataclass
class FinetuneConfig(TrainConfig):
    """Fine-tune a decoderlab checkpoint, fully or with LoRA, on text, prompt/completion pairs or chat messages."""

    # --- TrainConfig fields with fine-tuning defaults
    dataset_name: str | None = option(None, "Hub dataset id, or a local folder laid out like a Hub dataset repository")
    block_size: int = option(256, "tokens per training row: the longest example, or the packed row length")
    tokenizer_type: TOKENIZER_TYPES = option("pretrained", "always 'pretrained': the base checkpoint's tokenizer")
    tokenizer_name: str | None = option(None, "tokenizer to use instead of the base checkpoint's own (a folder or id)")
    model_name_or_path: str | None = option(None, "the base checkpoint: a folder or a Hub id (required)")
    per_device_train_batch_size: int = option(8, "rows per process per micro-batch")
    learning_rate: float = option(1e-4, "peak learning rate (AdamW); LoRA usually wants about 10x more")
    weight_decay: float = option(0.0, "AdamW weight decay; never applied to norms, biases and embeddings")
    num_warmup_steps: int = option(20, "linear warm-up steps")
    max_train_steps: int | None = option(None, "optimizer steps; none means num_train_epochs epochs")
    eval_steps: int | None = option(100, "evaluate every N steps (and at the end); none: only at the end")
    logging_steps: int = option(10, "log the mean training loss every N steps")
    output_dir: str = option("out/finetune", "the fine-tuned checkpoint (or adapter) and the step_N checkpoints")
    checkpointing_steps: int | None = option(200, "save a resumable checkpoint every N steps (and at the end)")
    # --- the base checkpoint
    revision: str | None = option(None, "branch, tag or commit of a Hub base checkpoint (and of its tokenizer)")
    trust_remote_code: bool = option(False, "run the checkpoint's own model code (Hub repos, decoderlab not installed)")
    add_special_tokens: bool = option(
        False,
        "give a tokenizer without an end-of-text or padding token <|endoftext|> as both (and BOS), resizing the "
        "embeddings; without it such a checkpoint is refused",
    )
    # --- the data
    data_format: DATA_FORMATS = option(
        "text",
        "text (continued pretraining), prompt_completion (loss on completions) or chat (loss on assistant turns)",
    )
    prompt_column_name: str = option("prompt", "prompt_completion: the column holding the prompts")
    completion_column_name: str = option("completion", "prompt_completion: the column holding the completions")
    messages_column_name: str = option("messages", "chat: the column holding lists of {role, content} messages")
    chat_template: str | None = option(None, "chat: Jinja template file; default the tokenizer's, else decoderlab's")
    packing: bool = option(True, "pack several examples into each row (false: one example per row, padded)")
    overlong_prompt: OVERLONG_PROMPT = option(
        "truncate", "a prompt that fills the whole block: truncate (keep its end, warn) or refuse (stop with an error)"
    )
    # --- LoRA (peft)
    use_lora: bool = option(False, "train low-rank adapters (peft LoRA) instead of every weight")
    lora_r: int = option(8, "LoRA rank")
    lora_alpha: int = option(16, "LoRA alpha: the update is scaled by alpha / r")
    lora_dropout: float = option(0.05, "dropout on the LoRA branch's input")
    lora_target_modules: str = option("q_proj,k_proj,v_proj,o_proj", "comma-separated module names to adapt")
    merge_lora: bool = option(False, "save base + adapter merged into plain weights (and the adapter in adapter/)")

    def __post_init__(self):
        if self.tokenizer_name is None:  # the base checkpoint's own tokenizer
            self.tokenizer_name = self.model_name_or_path
        super().__post_init__()

    def check(self) -> None:
        if self.model_name_or_path is None:
            raise ValueError("Fine-tuning needs --model_name_or_path: the base checkpoint, a folder or a Hub id.")
        if self.tokenizer_type != "pretrained":
            raise ValueError(
                f"tokenizer_type={self.tokenizer_type!r}: fine-tuning keeps the base model's vocabulary, so the "
                "tokenizer is the base checkpoint's (or --tokenizer_name). Remove tokenizer_type from the recipe."
            )
        if self.model:
            raise ValueError(
                f"model: {self.model}: fine-tuning keeps the base checkpoint's architecture. Remove the model "
                "mapping / --model.FIELD flags (convert or pretrain a different model instead)."
            )
        super().check()
        if self.lora_r < 1 or self.lora_alpha <= 0:
            raise ValueError(f"lora_r and lora_alpha must be positive, got {self.lora_r} and {self.lora_alpha}.")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}.")

    def target_modules(self) -> list[str]:
        return [name.strip() for name in self.lora_target_modules.split(",") if name.strip()]
