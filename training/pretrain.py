"""Pretrain a decoderlab model from scratch on a public dataset: the project's main job.

    accelerate launch training/pretrain.py --config training/configs/shakespeare_char.yaml [--FIELD VALUE ...]
    python training/pretrain.py --config training/configs/shakespeare_char.yaml \\
        --dataset_name ../shared/data/tiny_shakespeare          # offline: a local copy of the dataset
    torchrun --standalone --nproc_per_node 2 training/pretrain.py --config ...   # two processes (DDP)

The result in ``--output_dir`` loads with ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained``; ``python training/generate.py OUTPUT_DIR --prompt "ROMEO:"``
prints a sample. Every field of ``training.args.TrainConfig`` is a flag (``--help`` lists them).
"""

import logging
import math

from accelerate.utils import set_seed

from decoderlab.model_card import write_model_card
from decoderlab.push import push_to_hub
from training.args import TrainConfig, parse_config
from training.checkpointing import TrainState, hardware_description, resolve_checkpoint, run_info, save_final_folder
from training.data import prepare_data
from training.loop import TrainResult, make_accelerator, setup_script_logging, train
from training.models import build_model, load_base_model, load_base_tokenizer, set_sampling_defaults

logger = logging.getLogger("training.pretrain")


def start_tokenizer(cfg: TrainConfig):
    """Training on from ``--model_name_or_path``: its token ids mean what its own tokenizer says, so that is
    the run's tokenizer (or ``--tokenizer_type pretrained --tokenizer_name``, checked against the vocabulary);
    a checkpoint without one is refused rather than paired with a new vocabulary."""
    if cfg.tokenizer_type == "pretrained":
        return load_base_tokenizer(cfg.tokenizer_name)
    logger.info(f"Using the tokenizer of {cfg.model_name_or_path} (tokenizer_type={cfg.tokenizer_type!r} is not used).")
    if cfg.model:
        logger.info(f"The architecture is {cfg.model_name_or_path}'s; the model fields {sorted(cfg.model)} are not used.")
    return load_base_tokenizer(cfg.model_name_or_path)


def summary(cfg: TrainConfig, result: TrainResult, hardware: str, num_processes: int) -> dict:
    """The recipe as the model card shows it."""
    state: TrainState = result.state
    return {
        "steps": state.step,
        "tokens": state.tokens,
        "batch_size": cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * num_processes,
        "block_size": cfg.block_size,
        "learning_rate": cfg.learning_rate,
        "precision": "fp32" if cfg.mixed_precision == "no" else f"{cfg.mixed_precision} autocast",
        "hardware": hardware,
        "wall_time_s": round(state.elapsed_s, 1),
        "final_train_loss": result.train_loss,
        "final_eval_loss": result.eval_metrics["eval_loss"],
        "tokenizer": cfg.tokenizer_type if cfg.tokenizer_type != "pretrained" else cfg.tokenizer_name,
        "prompt": cfg.sample_prompt,
    }


def already_finished_message(result: TrainResult, cfg: TrainConfig) -> str:
    return (
        f"{cfg.output_dir}: already finished at step {result.state.step} (max_train_steps={cfg.max_train_steps}), "
        "nothing to do; the folder is left as it was. Raise --max_train_steps to train on from there."
    )


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(TrainConfig, argv)
    accelerator = make_accelerator(cfg)
    setup_script_logging(accelerator)
    set_seed(cfg.seed)

    checkpoint = resolve_checkpoint(cfg.resume_from_checkpoint, cfg.output_dir)
    tokenizer = None  # built from the data (tokenizer_type), or a resumed run's own
    if cfg.model_name_or_path is not None and checkpoint is None:
        tokenizer = start_tokenizer(cfg)
    tokenizer, batches, eval_blocks = prepare_data(cfg, accelerator, checkpoint, tokenizer=tokenizer)
    if cfg.model_name_or_path is None:
        model = build_model(cfg.model, tokenizer, cfg.block_size)
    else:
        model = load_base_model(cfg.model_name_or_path, tokenizer, cfg.block_size)
        set_sampling_defaults(model, tokenizer)
    logger.info(
        f"{model.num_parameters():,} parameters, {len(tokenizer)} tokens in the vocabulary, "
        f"{accelerator.num_processes} process(es) on {accelerator.device}, {len(eval_blocks)} validation blocks"
    )
    result = train(model, batches, eval_blocks, cfg, accelerator, tokenizer=tokenizer, resume_from=checkpoint)
    if result.already_finished:
        if accelerator.is_main_process:
            print(already_finished_message(result, cfg))
        return

    info = run_info(accelerator)
    save_final_folder(accelerator, result.model, tokenizer, cfg.output_dir, cfg.to_dict(), info)
    accelerator.end_training()
    if not accelerator.is_main_process:
        return
    dataset = cfg.train_file or cfg.dataset_name
    eval_loss = result.eval_metrics["eval_loss"]
    write_model_card(
        cfg.output_dir,
        dataset=dataset,
        training=summary(cfg, result, hardware_description(accelerator), accelerator.num_processes),
        eval_results={
            "eval_loss": eval_loss,
            "perplexity": math.exp(eval_loss),
            "dataset": dataset,
            "split": "validation",
        },
    )
    print(
        f"Trained {result.state.step} steps ({result.state.tokens:,} tokens) in {result.state.elapsed_s:.1f} s: "
        f"train loss {result.train_loss:.4f}, validation loss {eval_loss:.4f} (perplexity {math.exp(eval_loss):.2f}) "
        f"over all {len(eval_blocks)} validation blocks.\n"
        f"Saved to {cfg.output_dir}. Sample from it: python training/generate.py {cfg.output_dir} --prompt "
        f"{cfg.sample_prompt!r}"
    )
    if cfg.push_to_hub:
        url = push_to_hub(cfg.output_dir, cfg.hub_model_id, commit_message=f"Pretrained {result.state.step} steps")
        print(f"Pushed {cfg.output_dir} to {url}")


if __name__ == "__main__":
    main()
