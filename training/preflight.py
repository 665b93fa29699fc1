"""One pre-flight check: every refusal that involves more than one setting, before any data is read or folder written.

    cfg = parse_config(TrainConfig, argv)
    launch = preflight(cfg)          # a UsageError (one ``error:`` line, exit status 2) for the first problem

A configuration checks each of its own fields when it is built (``TrainConfig.check``: a type, a range). What no single
field can say lives here, in ``CHECKS``, one small function per refusal, read top to bottom: settings that need one
another, settings of one optimizer given to the other, the launch (processes, sharding engines) and the hardware
(bfloat16 instructions), the model the run trains (muP with Muon), and a resumed run's recorded settings. Pretraining
and fine-tuning call it right after parsing; ``training/prepare_data.py`` for its data settings.

The policy for the other optimizer's fields: refused, like the model's ``mup_*`` fields without muP. A ``muon_*`` field
set away from its default while ``optimizer`` is adamw is an ``error:`` line naming it, so that a recipe never carries a
setting that does nothing.
"""

import codecs
import dataclasses
import functools
import pathlib
from collections.abc import Callable

import torch
import yaml
from transformers import get_scheduler

from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.cli import UsageError
from decoderlab.configuration_decoderlab import is_mup
from decoderlab.roles_decoderlab import muon_width_problems

from .args import PrepareConfig, TrainConfig
from .checkpointing import CONFIG_NAME, SHAPING_FIELDS, find_checkpoint, resume_refusal
from .finetune_args import FinetuneConfig
from .flops import run_budget
from .hardware import cpu_has_bf16, launched_processes, requested_sharding, runs_on_cpu
from .models import read_model_config
from .optim import schedule_fits

MUON_FIELDS = ("muon_learning_rate", "muon_momentum", "muon_nesterov", "muon_weight_decay", "muon_adjust_lr_fn",
               "muon_ns_steps", "muon_ns_dtype")  # fmt: skip


class Launch:
    """What a run is about to use besides its settings, as far as it can be known before any data is read; each
    answer is looked up when a check first asks for it, without writing anything."""

    def __init__(self, cfg: TrainConfig, cpu: bool = False, allow_emulated_bf16: bool = False):
        self.cfg = cfg
        self.cpu = runs_on_cpu(cpu)  # the run's Accelerator will use the CPU
        self.allow_emulated_bf16 = allow_emulated_bf16  # for what does not depend on speed: bf16 in software will do
        self.processes = launched_processes()  # processes the launcher started
        self.sharding = requested_sharding()  # "FSDP" or "DeepSpeed" when the launch asks Accelerate for it

    @functools.cached_property
    def bf16_in_hardware(self) -> bool:
        """This CPU computes bfloat16 in hardware (an accelerator always does)."""
        return cpu_has_bf16() if self.cpu else True

    @functools.cached_property
    def model(self) -> DecoderLabConfig | None:
        """The config of the model the run trains: its ``model:`` fields for a new model, the base checkpoint's
        otherwise (None where that is no decoderlab checkpoint or cannot be read: loading it reports why)."""
        cfg = self.cfg
        if cfg.model_name_or_path is None:
            return DecoderLabConfig(**cfg.model)
        return read_model_config(cfg.model_name_or_path, getattr(cfg, "revision", None),
                                 getattr(cfg, "trust_remote_code", False))  # fmt: skip

    @functools.cached_property
    def checkpoint(self) -> pathlib.Path | None:
        """The checkpoint --resume_from_checkpoint names (None: a new run)."""
        return find_checkpoint(self.cfg.resume_from_checkpoint, self.cfg.output_dir)

    @functools.cached_property
    def recorded(self) -> dict | None:
        """The settings of the run that saved the checkpoint (its training_config.yaml), None without a record."""
        path = self.checkpoint.parent / CONFIG_NAME if self.checkpoint is not None else None
        recorded = yaml.safe_load(path.read_text()) if path is not None and path.is_file() else None
        return recorded if isinstance(recorded, dict) else None


def preflight(cfg: TrainConfig, cpu: bool = False, allow_emulated_bf16: bool = False, checks=None) -> Launch:
    """Refuse ``cfg`` with a ``UsageError`` (one line) at the first of ``checks`` (default: every one, ``CHECKS``) that
    finds a problem; else return what they saw of the launch. ``cpu``: the run is forced onto the CPU;
    ``allow_emulated_bf16``: skip only the check that bf16 runs in hardware (for measuring what does not depend on
    speed, which bf16 emulated in software gives as well)."""
    launch = Launch(cfg, cpu, allow_emulated_bf16)
    for check in CHECKS if checks is None else checks:
        problem = check(cfg, launch)
        if problem:
            raise UsageError(problem)
    return launch


# ----------------------------------------------------------------------------------------------
# The checks: each returns the error line of one refusal, or None


def data_source(cfg: TrainConfig, launch: Launch) -> str | None:
    if isinstance(cfg, TrainConfig) and not isinstance(cfg, PrepareConfig) and cfg.prepared_data is not None:
        return None  # prepared shards are checked when they are opened
    if cfg.train_file is None and cfg.dataset_name is None:
        return "No data: pass --dataset_name (a Hub id or a local dataset folder) or --train_file."
    if cfg.validation_file is not None and cfg.train_file is None:
        return "validation_file needs train_file: give both local files, or use dataset_name alone."
    if cfg.train_file is None and codecs.lookup(cfg.encoding).name != "utf-8":
        return (
            f"encoding={cfg.encoding!r} applies to --train_file and --validation_file, but the data comes from "
            f"dataset_name={cfg.dataset_name!r}, read as the dataset stores it. Drop --encoding."
        )
    return None


def tokenizer_source(cfg: TrainConfig, launch: Launch) -> str | None:
    if cfg.tokenizer_type == "pretrained" and not cfg.tokenizer_name:
        return "tokenizer_type='pretrained' needs --tokenizer_name (a Hub id or a tokenizer folder)."
    if cfg.tokenizer_type == "bpe" and cfg.bpe_vocab_size < 257:
        return (
            f"bpe_vocab_size={cfg.bpe_vocab_size} is too small: a byte-level BPE needs the 256 bytes plus its "
            "end-of-text token. Use 257 or more (a few thousand is typical)."
        )
    return None


def streaming(cfg: TrainConfig, launch: Launch) -> str | None:
    if not cfg.streaming:
        return None
    if cfg.window_sampling != "blocks":
        return (
            f"window_sampling={cfg.window_sampling!r} draws windows from the whole training text, which a stream "
            "(streaming=True) never holds: stream with window_sampling blocks, or prepare the data once "
            "(training/prepare_data.py) and train on it with --prepared_data."
        )
    if cfg.max_train_steps is None and cfg.target_flops is None and cfg.tokens_per_parameter is None:
        return (
            "streaming=True needs --max_train_steps (or a budget: --target_flops, --tokens_per_parameter): a streamed "
            "dataset has no length to count epochs."
        )
    return None


def best_model(cfg: TrainConfig, launch: Launch) -> str | None:
    wanted = [name for name in ("load_best_model_at_end", "early_stopping_patience") if getattr(cfg, name)]
    if wanted and cfg.eval_steps is None:
        turn_off = ", ".join(
            f"--{name} {'false' if name == 'load_best_model_at_end' else 'none'}" for name in wanted
        )
        return (
            f"{' and '.join(wanted)} need periodic evaluations to compare, but eval_steps is none. "
            f"Set --eval_steps N (e.g. 250), or turn them off: {turn_off}."
        )
    return None


def compile_backend(cfg: TrainConfig, launch: Launch) -> str | None:
    if cfg.torch_compile_backend is not None and not cfg.torch_compile:
        return (
            f"torch_compile_backend={cfg.torch_compile_backend!r} is set but torch_compile is false: add "
            "--torch_compile true, or drop the backend."
        )
    return None


def hub_upload(cfg: TrainConfig, launch: Launch) -> str | None:
    if cfg.push_to_hub and not cfg.hub_model_id:
        return "push_to_hub=True needs --hub_model_id ORG/NAME, the Hub repository to upload to."
    if isinstance(cfg, FinetuneConfig) and cfg.push_to_hub and cfg.use_lora and not cfg.merge_lora:
        return (
            "push_to_hub with an unmerged LoRA adapter: decoderlab pushes complete checkpoints only. Add "
            "--merge_lora, or upload the adapter folder with peft's PeftModel.push_to_hub yourself."
        )
    return None


def model_source(cfg: TrainConfig, launch: Launch) -> str | None:
    if cfg.model_name_or_path is not None and cfg.model and not isinstance(cfg, FinetuneConfig):
        return (
            f"--model_name_or_path {cfg.model_name_or_path} trains that checkpoint's architecture, so the model "
            f"fields {cfg.model} cannot apply. Remove the model mapping / --model.FIELD flags to train on from "
            "it, or drop --model_name_or_path to train a new model of those fields from scratch."
        )
    positions = cfg.model.get("max_position_embeddings")
    if isinstance(positions, int) and positions < cfg.block_size:
        return (
            f"--block_size {cfg.block_size} is longer than model.max_position_embeddings={positions}: the "
            f"model's config (and card) would promise a context of {positions} tokens for a model trained on "
            f"{cfg.block_size}. Raise --model.max_position_embeddings to at least {cfg.block_size} (or leave "
            "it unset: it follows --block_size), or lower --block_size."
        )
    return None


def resume_or_overwrite(cfg: TrainConfig, launch: Launch) -> str | None:
    if cfg.overwrite_output_dir and cfg.resume_from_checkpoint is not None:
        return (
            "--overwrite_output_dir replaces the run in output_dir and --resume_from_checkpoint continues it: "
            "pass one of them."
        )
    return None


def finetune_data(cfg: TrainConfig, launch: Launch) -> str | None:
    if not isinstance(cfg, FinetuneConfig):
        return None
    packed_text = cfg.data_format == "text" and cfg.packing
    if cfg.streaming and not packed_text:
        return (
            f"streaming=True works for packed text only, not data_format={cfg.data_format!r} with "
            f"packing={cfg.packing}: examples are fitted to the block up front. Turn streaming off."
        )
    if cfg.window_sampling != "blocks" and not packed_text:
        return (
            f"window_sampling={cfg.window_sampling!r} draws windows from one packed text, but "
            f"data_format={cfg.data_format!r} with packing={cfg.packing} trains on whole examples, one a row: "
            "remove --window_sampling (or use --data_format text with packing)."
        )
    return None


def lora(cfg: TrainConfig, launch: Launch) -> str | None:
    if not isinstance(cfg, FinetuneConfig):
        return None
    if cfg.use_lora and not cfg.target_modules():
        return "lora_target_modules is empty: name modules to adapt, e.g. q_proj,v_proj."
    if cfg.merge_lora and not cfg.use_lora:
        return "merge_lora=True needs use_lora=True: there is no adapter to merge in full fine-tuning."
    if cfg.use_lora and cfg.optimizer == "muon":
        return (
            "optimizer=muon with use_lora=True: LoRA trains each adapted matrix as two thin factors (r x in, "
            "out x r), and Muon would orthogonalise each factor's update on its own, which is not the update of "
            "the matrix they make (and no measurement here says it trains well). Fine-tune the adapters with "
            "--optimizer adamw, or fine-tune every weight with Muon (drop --use_lora)."
        )
    return None


def other_optimizer_fields(cfg: TrainConfig, launch: Launch) -> str | None:
    if cfg.optimizer == "muon":
        return None
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in MUON_FIELDS}
    given = [f"{name}={getattr(cfg, name)!r}" for name in MUON_FIELDS if getattr(cfg, name) != defaults[name]]
    if not given:
        return None
    return (
        f"{', '.join(given)} {'are' if len(given) > 1 else 'is'} read only with optimizer muon, but optimizer is "
        f"{cfg.optimizer!r}: set --optimizer muon, or leave {'them' if len(given) > 1 else 'it'} out (for make demo's "
        "recipe under AdamW: --config training/configs/shakespeare_char_adamw.yaml)."
    )


def sharding(cfg: TrainConfig, launch: Launch) -> str | None:
    if cfg.optimizer == "muon" and launch.sharding == "DeepSpeed":
        return (
            "--optimizer muon cannot run under DeepSpeed: ZeRO steps the optimizer on flat 1-D partitions of the "
            "weights, and Muon orthogonalises whole 2-D matrices. Use --optimizer adamw with DeepSpeed, or shard "
            "with FSDP2 (training/accelerate_configs/fsdp.yaml on GPUs, --fsdp true under torchrun on CPUs), whose "
            "matrices stay 2-D."
        )
    if not cfg.fsdp:
        return None
    if launch.processes < 2:
        return (
            "--fsdp true shards the model over several processes, but this run has one. Launch it with "
            "`torchrun --standalone --nproc_per_node 2 training/pretrain.py ...` (or more processes), or drop --fsdp."
        )
    if launch.sharding is not None:
        return (
            f"--fsdp true is torch's FSDP2 for launches Accelerate cannot shard (CPUs), but this launch asks "
            f"Accelerate for {launch.sharding} already: drop --fsdp and keep the launch config."
        )
    if cfg.mixed_precision != "no":
        return (
            f"--fsdp true trains in full precision; --mixed_precision {cfg.mixed_precision} is not supported with it. "
            "Use --mixed_precision no, or on GPUs Accelerate's FSDP2 config (training/accelerate_configs/fsdp.yaml), "
            "which handles mixed precision."
        )
    return None


def bf16_hardware(cfg: TrainConfig, launch: Launch) -> str | None:
    if cfg.mixed_precision == "bf16" and launch.cpu and not launch.bf16_in_hardware and not launch.allow_emulated_bf16:
        return (
            "--mixed_precision bf16 on a CPU without bfloat16 instructions (oneDNN finds neither AVX-512 nor AMX "
            "nor Arm BF16 here): bf16 would be emulated, slower than float32. Use --mixed_precision no."
        )
    return None


def schedule(cfg: TrainConfig, launch: Launch) -> str | None:
    """The scheduler takes its keyword arguments, and a warmup-stable-decay schedule fits in the run."""
    try:  # transformers' own check of the keywords, on a throwaway optimizer
        get_scheduler(cfg.lr_scheduler_type, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                      num_warmup_steps=cfg.num_warmup_steps, num_training_steps=cfg.max_train_steps or 10**6,
                      scheduler_specific_kwargs=cfg.lr_scheduler_kwargs)  # fmt: skip
    except (TypeError, ValueError) as err:
        return f"lr_scheduler_kwargs={cfg.lr_scheduler_kwargs} do not fit lr_scheduler_type={cfg.lr_scheduler_type!r}: {err}"
    return schedule_fits(cfg, cfg.max_train_steps) if cfg.max_train_steps is not None else None


def mup_with_muon(cfg: TrainConfig, launch: Launch) -> str | None:
    model = launch.model
    if cfg.optimizer != "muon" or not is_mup(model):
        return None
    if cfg.muon_adjust_lr_fn != "original":
        return (
            f"muon_adjust_lr_fn={cfg.muon_adjust_lr_fn!r} with a muP model: that rule scales Muon's update with "
            "sqrt(max(out, in)), which grows with the width, so the rate tuned at mup_base_width would not carry. "
            "Use muon_adjust_lr_fn original (muP's rule for Muon: no width factor)."
        )
    with torch.device("meta"):  # the model's roles, without its weights
        roles = DecoderLabForCausalLM(model).parameter_roles()
    apart = muon_width_problems(roles, cfg.optimizer, model.parametrization)
    if apart:
        shown = "; ".join(apart[:4]) + ("; ..." if len(apart) > 4 else "")
        return (
            f"optimizer muon under muP needs each Muon matrix's two sides to grow together (its update's size then "
            f"does not change with the width), but these grow apart: {shown} (mup_base_shapes "
            f"{model.mup_base_shapes}). Scale those dimensions with hidden_size, or train with --optimizer adamw, "
            "whose muP factors follow each matrix's own sides."
        )
    return None


def budget(cfg: TrainConfig, launch: Launch) -> str | None:
    """A run sized by its budget (``training/flops.py``): one budget, no ``max_train_steps`` beside it, and at least
    one step's FLOPs. A new model's vocabulary comes from the data, so here it counts at its smallest (one token) and
    the loop, which knows it, asks again."""
    given = [name for name in ("target_flops", "tokens_per_parameter") if getattr(cfg, name) is not None]
    if not given:
        return None
    if len(given) == 2:
        return (
            f"target_flops={cfg.target_flops:g} and tokens_per_parameter={cfg.tokens_per_parameter:g} each set the "
            "number of steps: keep one of them."
        )
    name = given[0]
    if cfg.max_train_steps is not None:
        return (
            f"--{name} {getattr(cfg, name):g} sets the number of steps from the budget, but max_train_steps="
            f"{cfg.max_train_steps} sets it too (the flag's or the recipe's value): pass --max_train_steps none to size "
            f"the run by its budget, or drop --{name}."
        )
    model = launch.model
    if model is None:  # a base checkpoint that cannot be read: loading it reports why
        return None
    known = cfg.model_name_or_path is not None or "vocab_size" in cfg.model
    if cfg.model_name_or_path is None:
        model = DecoderLabConfig(**{"vocab_size": 1, **cfg.model})
    try:
        run_budget(cfg, model, launch.processes, vocabulary_known=known)
    except UsageError as err:
        return str(err)
    return None


def resume_fits(cfg: TrainConfig, launch: Launch) -> str | None:
    """A resumed run's settings that shape its weights or optimizer state are the ones its checkpoint was saved with
    (its run's training_config.yaml; checkpoints without one are compared tensor by tensor once the model is
    built: ``checkpointing.check_resume_tensors``)."""
    if launch.checkpoint is None or launch.recorded is None:
        return None
    recorded, given = launch.recorded, cfg.to_dict()
    default = lambda name: _field_default(cfg, name)
    differences = [
        f"{name}: {recorded.get(name, default(name))!r} -> {given.get(name)!r}"
        for name in SHAPING_FIELDS
        if recorded.get(name, default(name)) != given.get(name)
    ]
    if recorded.get("model_name_or_path") is None and given.get("model_name_or_path") is None:
        before, now = recorded.get("model") or {}, given.get("model") or {}
        defaults = DecoderLabConfig()
        for name in sorted(set(before) | set(now)):
            unset = getattr(defaults, name, None)
            if before.get(name, unset) != now.get(name, unset):
                differences.append(f"model.{name}: {before.get(name, unset)!r} -> {now.get(name, unset)!r}")
    if (recorded.get("embedding_learning_rate") is None) != (cfg.embedding_learning_rate is None):
        differences.append(  # a third optimizer group, or none
            f"embedding_learning_rate: {recorded.get('embedding_learning_rate')!r} -> {cfg.embedding_learning_rate!r}"
        )
    return resume_refusal(launch.checkpoint, differences) if differences else None


def _field_default(cfg, name: str):
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    if name not in fields:
        return None
    f = fields[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


# In the order a reader meets the settings: data, tokenizer, model, optimizer, launch, schedule, resume
CHECKS: tuple[Callable[[TrainConfig, Launch], str | None], ...] = (
    data_source,
    tokenizer_source,
    streaming,
    finetune_data,
    model_source,
    lora,
    other_optimizer_fields,
    mup_with_muon,
    sharding,
    bf16_hardware,
    budget,
    schedule,
    best_model,
    compile_backend,
    hub_upload,
    resume_or_overwrite,
    resume_fits,
)
# What training/prepare_data.py asks of a recipe: where the text comes from and how it is tokenized
DATA_CHECKS = (data_source, tokenizer_source, streaming)
