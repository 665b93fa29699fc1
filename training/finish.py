"""The end of every training script: the final folder, the model card, one summary on the console, the upload.

    result = train(model, batches, eval_rows, cfg, accelerator, tokenizer=tokenizer, resume_from=checkpoint)
    finish_run(accelerator, result, tokenizer, cfg, verb="Pretrained", next_step="Sample from it: ...")

A run resumed at its last step has nothing to add (``TrainResult.already_finished``): ``finish_run`` then
says so and leaves the folder exactly as it is.
"""

import math
from collections.abc import Callable

from accelerate import Accelerator
from torch import nn

from decoderlab.model_card import write_model_card
from decoderlab.push import push_to_hub

from .args import TrainConfig
from .best_model import stopped_early
from .checkpointing import hardware_description, run_info, save_final_folder
from .loop import TrainResult
from .optim import groups_comment, groups_text


def summary(cfg: TrainConfig, result: TrainResult, hardware: str, num_processes: int) -> dict:
    """The recipe as the model card shows it."""
    state = result.state
    return {
        "steps": state.step,
        **({"steps_from_budget": result.budget.text()} if result.budget is not None else {}),
        "tokens": state.tokens,
        **compute_facts(result.compute),
        "batch_size": cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * num_processes,
        "block_size": cfg.block_size,
        "learning_rate": cfg.learning_rate,
        **({} if cfg.embedding_learning_rate is None else {"embedding_learning_rate": cfg.embedding_learning_rate}),
        **({"optimizer_groups": groups_text(result.optimizer_groups)} if result.optimizer_groups else {}),
        "precision": "fp32" if cfg.mixed_precision == "no" else f"{cfg.mixed_precision} autocast",
        "hardware": hardware,
        "wall_time_s": round(state.elapsed_s, 1),
        "final_train_loss": result.train_loss,
        "final_eval_loss": result.eval_metrics["eval_loss"],
        **best_model_facts(cfg, state),
        "tokenizer": cfg.tokenizer_type if cfg.tokenizer_type != "pretrained" else cfg.tokenizer_name,
        "prompt": cfg.sample_prompt,
    }


def compute_facts(compute: dict) -> dict:
    """The FLOPs the run trained with and its FLOPs per token (``training.flops``), for the card."""
    if "flops" not in compute:
        return {}
    return {"flops": float(compute["flops"]), "flops_per_token": compute["flops_per_token"]}


def best_model_facts(cfg: TrainConfig, state) -> dict:
    """Which step's weights the folder holds under ``load_best_model_at_end``, the periodic evaluation that chose
    them, and where early stopping ended the run: for the card and ``run_info.json`` (nothing when both are off)."""
    facts = {}
    if cfg.load_best_model_at_end and state.best_global_step is not None:
        facts["saved_weights_step"] = state.best_global_step
        facts[f"best_{cfg.metric_for_best_model.removeprefix('eval_')}"] = state.best_metric
        facts["best_chosen_by"] = f"{cfg.metric_for_best_model} every {cfg.eval_steps} steps on " + (
            "every validation block" if cfg.max_eval_samples is None else f"the first {cfg.max_eval_samples} blocks"
        )
    if stopped_early(cfg.early_stopping_patience, state):
        facts["early_stopping"] = (
            f"stopped at step {state.step}: {cfg.early_stopping_patience} evaluations without improvement "
            f"> {cfg.early_stopping_threshold}"
        )
    return facts


def evaluation_context(cfg: TrainConfig) -> dict:
    """What the validation loss was measured on, as the model card records it: a validation file is a split
    of its own (as ``training/evaluate.py`` records it, so that a later evaluation replaces this one)."""
    if cfg.validation_file is not None:
        return {"dataset": cfg.validation_file}
    return {"dataset": cfg.train_file or cfg.dataset_name, "split": cfg.validation_split_name}


def finish_run(
    accelerator: Accelerator,
    result: TrainResult,
    tokenizer,
    cfg: TrainConfig,
    *,
    verb: str,
    next_step: str,
    scored: str = "validation tokens",
    final_model: Callable[[nn.Module], nn.Module] | None = None,
    training: dict | None = None,
    **card,
) -> None:
    """Save ``output_dir`` (weights, tokenizer, configuration, run information), write its model card, print
    one summary and push it when ``cfg.push_to_hub``; every process calls it.

    Args:
        verb: how the summary starts, e.g. "Pretrained" ("Pretrained 2000 steps (...)").
        next_step: the summary's last sentence, e.g. how to sample from or load the result.
        scored: what the validation loss is the mean over, e.g. "completion tokens".
        final_model: from the trained (prepared) model to the one to save, e.g. LoRA merged into the weights;
            default: the trained model itself.
        training: recipe facts for the card beyond ``summary``'s (they win over its keys); a ``method`` (e.g.
            "LoRA r=8, ...") is also printed.
        card: more ``write_model_card`` arguments (``base_model``, ``config``).
    """
    if result.already_finished:
        if accelerator.is_main_process:
            limit = "" if cfg.max_train_steps is None else f" (max_train_steps={cfg.max_train_steps})"
            raise_what = "--max_train_steps"
            if result.budget is not None:
                limit, raise_what = f" ({result.budget.text()})", f"--{result.budget.source}"
            if stopped_early(cfg.early_stopping_patience, result.state):
                limit = f" (stopped early: early_stopping_patience={cfg.early_stopping_patience})"
                raise_what = "--early_stopping_patience"
            print(
                f"{cfg.output_dir} already finished at step {result.state.step}{limit}: nothing to do, the folder "
                f"is left as it was. Raise {raise_what} to train on from there."
            )
        return
    model = result.model if final_model is None else final_model(result.model)
    info = {**run_info(accelerator), **best_model_facts(cfg, result.state), "optimizer_groups": result.optimizer_groups,
            "compute": result.compute}  # fmt: skip
    comment = groups_comment(result.optimizer_groups) if result.optimizer_groups else ""
    if result.budget is not None:
        info["budget"] = result.budget.record()
        comment += "# max_train_steps from the budget (training/flops.py; a record, not a setting):\n"
        comment += f"#   {result.budget.text()}\n"
    save_final_folder(accelerator, model, tokenizer, cfg.output_dir, cfg.to_dict(), info, config_comment=comment)
    accelerator.end_training()
    if not accelerator.is_main_process:
        return
    state, eval_loss = result.state, result.eval_metrics["eval_loss"]
    recipe = {**summary(cfg, result, hardware_description(accelerator), accelerator.num_processes), **(training or {})}
    write_model_card(
        cfg.output_dir,
        dataset=cfg.train_file or cfg.dataset_name,
        training=recipe,
        eval_results={"eval_loss": eval_loss, "perplexity": math.exp(eval_loss), **evaluation_context(cfg)},
        **card,
    )
    how = f", {recipe['method']}" if "method" in recipe else ""
    if "saved_weights_step" in recipe:
        how += f"; saved the best step's weights, step {recipe['saved_weights_step']}"
    print(
        f"{verb} {state.step} steps ({state.tokens:,} tokens{how}) in {state.elapsed_s:.1f} s: train loss "
        f"{result.train_loss:.4f}, validation loss {eval_loss:.4f} (perplexity {math.exp(eval_loss):.2f}) over the "
        f"{scored}.\nSaved to {cfg.output_dir}. {next_step}"
    )
    if cfg.push_to_hub:
        url = push_to_hub(cfg.output_dir, cfg.hub_model_id, commit_message=f"{verb} {state.step} steps")
        print(f"Pushed {cfg.output_dir} to {url}")
