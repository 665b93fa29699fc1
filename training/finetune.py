"""Fine-tune a decoderlab checkpoint on text, prompt/completion pairs or chat messages, fully or with LoRA.

    accelerate launch training/finetune.py --config training/configs/finetune_shakespeare_chat.yaml
    python training/finetune.py --model_name_or_path out/shakespeare_char --dataset_name ../shared/data/tiny_shakespeare \\
        --output_dir out/shakespeare_more --max_train_steps 200          # continued pretraining, offline
    python training/finetune.py --config ... --use_lora --lora_r 16 --merge_lora

The base is a decoderlab folder or Hub id (``--revision``, ``--trust_remote_code``); Llama, GPT-2 and
GPT-NeoX checkpoints are converted first (``python -m decoderlab.convert``). Data, loss masking and
packing are ``training.sft_data``'s; the optimizer, schedule, accumulation, mixed precision, evaluation,
crash-safe checkpoints, resume, tracking and progress bar are the pretraining loop's (``training.loop``).

The output folder is a complete checkpoint (``AutoModelForCausalLM.from_pretrained(output_dir)``) with a
model card naming the base model and the dataset. A LoRA run without ``--merge_lora`` saves the adapter
instead (``adapter_config.json``, ``adapter_model.safetensors``) plus the tokenizer and card: with peft
installed, ``AutoModelForCausalLM.from_pretrained(output_dir)`` loads the base and applies the adapter,
as does ``peft.AutoPeftModelForCausalLM.from_pretrained(output_dir)``. ``--merge_lora`` saves the merged
weights and keeps the adapter in ``output_dir/adapter``.
"""

from training.program import prepare_imports, run_program  # isort: skip (first)

prepare_imports(__name__)

import logging
import pathlib

from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from transformers import PreTrainedModel

from decoderlab import DecoderLabConfig
from decoderlab.model_card import public_dataset_name
from training.args import parse_config
from training.checkpointing import (
    check_resume_tensors,
    claim_output_dir,
    record_config,
    resolve_checkpoint,
)
from training.finetune_args import FinetuneConfig
from training.finish import finish_run
from training.loop import make_accelerator, setup_script_logging, train
from training.models import (
    add_special_tokens,
    check_special_tokens,
    load_base_model,
    load_base_tokenizer,
    missing_special_tokens,
)
from training.preflight import preflight
from training.sft_data import prepare_finetune_data, set_chat_template

logger = logging.getLogger("training.finetune")


def lora_targets(model: nn.Module) -> list[str]:
    """Names (last part) of the layers LoRA can adapt: linear layers and token embeddings."""
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    return sorted(names)


def apply_lora(model: PreTrainedModel, cfg: FinetuneConfig):
    """``model`` wrapped by peft with LoRA on ``cfg.target_modules()``: only the adapters train."""
    from peft import LoraConfig, get_peft_model  # a training extra, imported only when LoRA is asked for

    available = lora_targets(model)
    unknown = [name for name in cfg.target_modules() if name not in available]
    if unknown:
        raise ValueError(
            f"lora_target_modules names {unknown}, which this model does not have. The layers LoRA can adapt "
            f"are {available} (Hugging Face names: q_proj,k_proj,v_proj,o_proj for attention, "
            "gate_proj,up_proj,down_proj for the MLP)."
        )
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.target_modules(),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


# ----------------------------------------------------------------------------------------------
# The output


def final_model(accelerator: Accelerator, model: nn.Module, cfg: FinetuneConfig) -> nn.Module:
    """What the output folder holds: every weight (full fine-tuning, or LoRA merged into them; the adapter
    is then kept in ``output_dir/adapter``), or the LoRA adapter alone."""
    if not (cfg.use_lora and cfg.merge_lora):
        return model
    adapter = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        adapter.save_pretrained(pathlib.Path(cfg.output_dir) / "adapter")
    return adapter.merge_and_unload()  # W + (alpha / r) B A in every adapted layer, adapters removed


def method(cfg: FinetuneConfig) -> str:
    if not cfg.use_lora:
        return "full fine-tuning"
    kept = "merged into the weights" if cfg.merge_lora else "adapter only: load it on top of the base model"
    return f"LoRA r={cfg.lora_r}, alpha={cfg.lora_alpha} on {cfg.lora_target_modules} ({kept})"


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(FinetuneConfig, argv)
    preflight(cfg)  # every setting that does not fit another, the launch or the hardware: before anything is read
    accelerator = make_accelerator(cfg)
    setup_script_logging(accelerator)
    set_seed(cfg.seed)
    checkpoint = resolve_checkpoint(cfg.resume_from_checkpoint, cfg.output_dir)
    claim_output_dir(accelerator, cfg, checkpoint, base_model=cfg.model_name_or_path)

    # Everything that can be wrong is checked here, before the first step: tokenizer, model, data, LoRA.
    own_tokenizer = cfg.tokenizer_name == cfg.model_name_or_path
    tokenizer = load_base_tokenizer(cfg.tokenizer_name, cfg.revision if own_tokenizer else None, cfg.trust_remote_code)
    if not cfg.add_special_tokens:
        check_special_tokens(tokenizer, cfg.tokenizer_name)
    elif tokenizer.eos_token is None and cfg.use_lora and not cfg.merge_lora:
        raise ValueError(
            f"--add_special_tokens gives {cfg.tokenizer_name}'s tokenizer a new token, whose embedding rows an "
            "unmerged LoRA adapter would not carry (it loads onto the unchanged base). Add --merge_lora, or "
            "fine-tune fully."
        )
    model = load_base_model(cfg.model_name_or_path, tokenizer, cfg.block_size, cfg.revision, cfg.trust_remote_code)
    if cfg.add_special_tokens and missing_special_tokens(tokenizer):
        added = add_special_tokens(model, tokenizer)
        logger.info(
            f"Added the special tokens: {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) is the end-of-text, "
            f"padding and BOS token; {added} new token(s), {len(tokenizer)} in the vocabulary."
        )
    base_config = DecoderLabConfig.from_dict(model.config.to_dict())
    if cfg.data_format == "chat":
        set_chat_template(tokenizer, cfg.chat_template)
    batches, eval_rows = prepare_finetune_data(cfg, accelerator, tokenizer)
    if cfg.use_lora:
        model = apply_lora(model, cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(
        f"{method(cfg)}: {trainable:,} of {sum(p.numel() for p in model.parameters()):,} parameters train; "
        f"{accelerator.num_processes} process(es) on {accelerator.device}"
    )
    check_resume_tensors(checkpoint, model)
    record_config(accelerator, cfg, checkpoint)
    result = train(model, batches, eval_rows, cfg, accelerator, tokenizer=tokenizer, resume_from=checkpoint)
    adapter_only = cfg.use_lora and not cfg.merge_lora
    scored = {"text": "tokens", "prompt_completion": "completion tokens", "chat": "assistant tokens"}[cfg.data_format]
    finish_run(
        accelerator,
        result,
        tokenizer,
        cfg,
        verb="Fine-tuned",
        scored=f"validation {scored}",
        next_step=f"Load it with AutoModelForCausalLM.from_pretrained({cfg.output_dir!r})"
        + (" (peft installed: the adapter is applied to its base model)." if adapter_only else "."),
        final_model=lambda model: final_model(accelerator, model, cfg),
        training={"tokenizer": "the base model's", "data_format": cfg.data_format, "method": method(cfg)},
        base_model=public_dataset_name(cfg.model_name_or_path),  # a Hub id as is; a local folder by its name only
        config=base_config if adapter_only else None,
    )


if __name__ == "__main__":
    run_program(main)
