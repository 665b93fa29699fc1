"""Pretrain a decoderlab model from scratch on a public dataset: the project's main job.

    accelerate launch training/pretrain.py --config training/configs/shakespeare_char.yaml [--FIELD VALUE ...]
    python training/pretrain.py --config training/configs/shakespeare_char.yaml \\
        --dataset_name ../shared/data/tiny_shakespeare          # offline: a local copy of the dataset
    python training/pretrain.py --config ... --prepared_data DATA   # token shards of training/prepare_data.py
    torchrun --standalone --nproc_per_node 2 training/pretrain.py --config ...   # two processes (DDP)

The result in ``--output_dir`` loads with ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained``; ``python training/generate.py OUTPUT_DIR --prompt "ROMEO:"``
prints a sample. Every field of ``training.args.TrainConfig`` is a flag (``--help`` lists them).
"""

from training.program import prepare_imports, run_program  # isort: skip (first)

prepare_imports(__name__)

import logging
import pathlib
import shutil

from accelerate.utils import set_seed

from training.args import TrainConfig, parse_config
from training.checkpointing import (
    check_resume_tensors,
    claim_output_dir,
    record_config,
    resolve_checkpoint,
)
from training.data import prepare_data
from training.finish import finish_run
from training.loop import make_accelerator, setup_script_logging, train
from training.models import build_model, load_base_model, load_base_tokenizer, set_sampling_defaults
from training.preflight import preflight
from training.token_shards import prepared_batches

logger = logging.getLogger("training.pretrain")


def start_tokenizer(cfg: TrainConfig):
    """Training on from ``--model_name_or_path``: its token ids mean what its own tokenizer says, so that is
    the run's tokenizer (or ``--tokenizer_type pretrained --tokenizer_name``, checked against the vocabulary);
    a checkpoint without one is refused rather than paired with a new vocabulary."""
    if cfg.tokenizer_type == "pretrained":
        return load_base_tokenizer(cfg.tokenizer_name)
    logger.info(f"Using the tokenizer of {cfg.model_name_or_path} (tokenizer_type={cfg.tokenizer_type!r} is not used).")
    return load_base_tokenizer(cfg.model_name_or_path)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(TrainConfig, argv)
    preflight(cfg)  # every setting that does not fit another, the launch or the hardware: before anything is read
    accelerator = make_accelerator(cfg)
    setup_script_logging(accelerator)
    set_seed(cfg.seed)

    checkpoint = resolve_checkpoint(cfg.resume_from_checkpoint, cfg.output_dir)
    claim_output_dir(accelerator, cfg, checkpoint, base_model=cfg.model_name_or_path)
    tokenizer = None  # built from the data (tokenizer_type), or a resumed run's own
    if cfg.model_name_or_path is not None and checkpoint is None:
        tokenizer = start_tokenizer(cfg)
    read = prepared_batches if cfg.prepared_data is not None else prepare_data
    new_folder = not pathlib.Path(cfg.output_dir).exists()
    try:
        tokenizer, batches, eval_blocks = read(cfg, accelerator, checkpoint, tokenizer=tokenizer)
    except Exception:  # data that cannot train (too short, unknown characters): no folder holding only a tokenizer
        if new_folder and accelerator.is_main_process:
            shutil.rmtree(cfg.output_dir, ignore_errors=True)
        raise
    if cfg.model_name_or_path is None:
        model = build_model(cfg.model, tokenizer, cfg.block_size)
    else:
        model = load_base_model(cfg.model_name_or_path, tokenizer, cfg.block_size)
        set_sampling_defaults(model, tokenizer)
    logger.info(
        f"{model.num_parameters():,} parameters, {len(tokenizer)} tokens in the vocabulary, "
        f"{accelerator.num_processes} process(es) on {accelerator.device}, {len(eval_blocks)} validation blocks"
    )
    check_resume_tensors(checkpoint, model)
    record_config(accelerator, cfg, checkpoint)
    result = train(model, batches, eval_blocks, cfg, accelerator, tokenizer=tokenizer, resume_from=checkpoint)
    finish_run(
        accelerator, result, tokenizer, cfg, verb="Pretrained", scored=f"{len(eval_blocks)} validation blocks",
        next_step=f"Sample from it: python training/generate.py {cfg.output_dir} --prompt {cfg.sample_prompt!r}",
        training={} if cfg.model_name_or_path is None else {"tokenizer": f"{cfg.model_name_or_path}'s"},
    )  # fmt: skip


if __name__ == "__main__":
    run_program(main)
