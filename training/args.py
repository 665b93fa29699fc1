"""The command line of every entry point: one typed dataclass, read from a YAML recipe and overridden by flags.

    python training/pretrain.py --config training/configs/shakespeare_char.yaml --learning_rate 2e-3 \\
        --model.num_hidden_layers 6 --with_tracking

Every field of ``TrainConfig`` is a flag of the same name; where transformers' ``run_clm_no_trainer.py``
has an argument with the same meaning, the name is the same. ``--model.FIELD VALUE`` sets one
``DecoderLabConfig`` field of the ``model:`` mapping. The YAML file gives values, the command line
overrides them, and the dataclass checks the result once, in ``__post_init__``: a value of the wrong
type, an unknown field or an impossible value is a ``ValueError`` naming the field, the value and what
is allowed.

A fine-tuning script extends ``TrainConfig`` by subclassing it and reuses ``parse_config``; any other
entry point (``training/evaluate.py``, the experiments) declares its own ``Config`` subclass or dataclass
with ``option`` fields and gets the same flags, types and errors from ``parse_config`` / ``add_flags``.
"""

import argparse
import codecs
import dataclasses
import difflib
import math
import pathlib
import types
import typing
from dataclasses import dataclass, field
from typing import Literal, Union

import yaml
from transformers import SchedulerType

from decoderlab import DecoderLabConfig
from decoderlab.cli import DEBUG_FLAG, UsageError

from .preemption import DEFAULT_STOP_SIGNALS, parse_stop_signals

TOKENIZER_TYPES = Literal["char", "bpe", "pretrained"]
MIXED_PRECISION = Literal["no", "bf16", "fp16"]
TOKEN_DTYPES = Literal["auto", "uint16", "uint32"]
OPTIMIZERS = Literal["adamw", "muon"]  # training.optim builds each; muon: Muon for the blocks' matrices, AdamW for the rest
MUON_NS_DTYPES = Literal["auto", "bfloat16", "float32"]  # training.optim.newton_schulz_dtype resolves auto
MUON_LR_ADJUSTMENTS = Literal["original", "match_rms_adamw"]  # torch.optim.Muon's adjust_lr_fn
WINDOW_SAMPLINGS = Literal["blocks", "random", "shifted", "permutation"]  # training.sampling describes each
DATA_FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".parquet", ".csv")
NONE_STRINGS = ("none", "null", "~")
DEBUG_HELP = "show the full traceback of an error, not just its one error: line"
TRUE_STRINGS = ("true", "yes", "1", "on")
FALSE_STRINGS = ("false", "no", "0", "off")
# metric_for_best_model: the names accepted (Trainer adds "eval_" to a name without it) -> the key of the
# evaluation's record (training.loop.evaluate)
BEST_MODEL_METRICS = {"eval_loss": "eval_loss", "loss": "eval_loss", "perplexity": "perplexity",
                      "eval_perplexity": "perplexity"}  # fmt: skip
ITEM_NAMES = {int: "integer", float: "number", str: "string"}  # the items of a tuple field, as the help names them


def option(default=dataclasses.MISSING, help: str = "", positional: bool = False, **kwargs):
    """A dataclass field carrying its ``--help`` text; ``positional``: a required argument without ``--``."""
    metadata = {"help": help, "positional": positional}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


@dataclass
class Config:
    """A command-line configuration: every field a flag, every value coerced to the field's type (command-line
    strings and YAML values alike) and then checked once by ``check``, in ``__post_init__``."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, coerce(f.name, getattr(self, f.name), hints[f.name]))
        self.check()

    def check(self) -> None:
        """Reject values no run can use, with a ValueError naming the field, the value and what to do."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class TrainConfig(Config):
    """Everything a training run needs. Data and optimisation defaults are the ``shakespeare_char`` recipe's;
    the model is ``DecoderLabConfig(**model)``, so its size comes from the recipe's ``model:`` mapping."""

    # --- data
    dataset_name: str | None = option(
        "karpathy/tiny_shakespeare",
        "Hub dataset id, or a local folder laid out like a Hub dataset repository (offline copies).",
    )
    dataset_config_name: str | None = option(None, "dataset configuration (subset), e.g. sample-10BT")
    train_file: str | None = option(None, "local .txt/.json/.jsonl/.parquet/.csv training file; replaces dataset_name")
    validation_file: str | None = option(None, "local validation file (same formats); needs train_file")
    encoding: str = option(
        "utf-8",
        "text encoding of train_file and validation_file (.txt/.json/.jsonl/.csv), as Python names it: utf-8, "
        "latin-1, cp1252, ...",
    )
    text_column_name: str = option("text", "column holding the text")
    validation_split_name: str = option("validation", "the dataset's validation split; carved off train if absent")
    validation_split_percentage: float = option(5.0, "percent of train carved off when there is no validation split")
    streaming: bool = option(False, "stream the dataset instead of downloading it (corpora bigger than the disk)")
    streaming_validation_texts: int = option(1000, "streaming without a validation split: first N texts validate")
    shuffle_buffer_size: int = option(10_000, "streaming: blocks shuffled together (one window, read again on resume)")
    block_size: int = option(64, "tokens per training sequence; texts are concatenated and cut into blocks")
    window_sampling: WINDOW_SAMPLINGS = option(
        "blocks",
        "where training windows start: blocks (fixed blocks, shuffled), random (any offset, with replacement: "
        "nanoGPT's), shifted (blocks cut at a new random offset each pass), permutation (every offset once a pass)",
    )
    preprocessing_num_workers: int | None = option(None, "processes for tokenization (datasets.map num_proc)")
    overwrite_cache: bool = option(False, "re-tokenize even when a cached tokenization exists")
    prepared_data: str | None = option(
        None, "folder of token shards written by training/prepare_data.py: train from them (np.memmap) instead"
    )
    prefetch_batches: int = option(4, "micro-batches a background thread reads ahead of the step (0: none)")
    dataloader_pin_memory: bool = option(True, "page-locked batches for faster copies to a CUDA device")
    allow_unknown_characters: bool = option(
        False,
        "train even when over 1 percent of the characters are unknown to the tokenizer (they become its unk token)",
    )
    # --- tokenizer
    tokenizer_type: TOKENIZER_TYPES = option(
        "char", "char: one token per character; bpe: byte-level BPE trained on the data; pretrained: tokenizer_name"
    )
    tokenizer_name: str | None = option(None, "existing tokenizer (Hub id or folder) for tokenizer_type=pretrained")
    bpe_vocab_size: int = option(8192, "vocabulary size of the trained byte-level BPE")
    tokenizer_train_texts: int = option(100_000, "most texts read to build a char/BPE vocabulary")
    # --- model
    model_name_or_path: str | None = option(
        None, "start from these weights (a decoderlab folder or Hub id) and its own tokenizer, instead of from scratch"
    )
    model: dict = option({}, "DecoderLabConfig fields for a model trained from scratch (--model.FIELD VALUE)")
    # --- optimisation
    per_device_train_batch_size: int = option(12, "sequences per process per micro-batch")
    per_device_eval_batch_size: int = option(64, "sequences per process per evaluation batch")
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step")
    learning_rate: float = option(2e-3, "peak learning rate (AdamW)")
    embedding_learning_rate: float | None = option(
        None, "peak learning rate of the token embeddings (a tied lm_head is the same matrix); none: learning_rate"
    )
    weight_decay: float = option(0.1, "AdamW weight decay; never applied to norms, biases and embeddings")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.99, "AdamW beta2")
    adam_epsilon: float = option(1e-8, "AdamW epsilon")
    max_grad_norm: float | None = option(1.0, "clip the gradient norm to this; none disables clipping")
    # --- Muon (optimizer muon; training/optim.py: which tensors it takes, the others stay AdamW's)
    optimizer: OPTIMIZERS = option(
        "adamw",
        "adamw: AdamW for every parameter; muon: torch.optim.Muon for the 2-D weights inside the decoder blocks, AdamW "
        "(learning_rate, embedding_learning_rate) for the embeddings, the head, norms and biases",
    )
    muon_learning_rate: float = option(0.02, "optimizer muon: peak learning rate of the Muon group (the schedule scales it)")
    muon_momentum: float = option(0.95, "optimizer muon: Muon's momentum")
    muon_nesterov: bool = option(True, "optimizer muon: Nesterov momentum")
    muon_weight_decay: float = option(
        0.0, "optimizer muon: decoupled weight decay of the Muon group, times its unadjusted learning rate (torch's: 0.1)"
    )
    muon_adjust_lr_fn: MUON_LR_ADJUSTMENTS = option(
        "original",
        "optimizer muon: the per-shape rate, original: lr x sqrt(max(1, out/in)) (Keller Jordan's; speedrun rates), "
        "match_rms_adamw: lr x 0.2 x sqrt(max(out, in)) (Moonlight's; takes AdamW-sized rates)",
    )
    muon_ns_steps: int = option(5, "optimizer muon: Newton-Schulz iterations that orthogonalise each update")
    muon_ns_dtype: MUON_NS_DTYPES = option(
        "auto",
        "optimizer muon: the dtype of the Newton-Schulz products; auto: bfloat16 on GPUs and on CPUs that compute it "
        "in hardware (torch's and the speedrun's), float32 on other CPUs (bfloat16 in software is about 30x slower)",
    )
    lr_scheduler_type: str = option("cosine_with_min_lr", "transformers scheduler name (SchedulerType)")
    lr_scheduler_kwargs: dict = option({"min_lr_rate": 0.1}, "extra scheduler arguments, e.g. min_lr_rate")
    num_warmup_steps: int = option(100, "linear warm-up steps")
    max_train_steps: int | None = option(2000, "optimizer steps; none means num_train_epochs epochs")
    num_train_epochs: int = option(1, "epochs when max_train_steps is none")
    target_flops: float | None = option(
        None,
        "size the run by compute: as many optimizer steps as fit in this many FLOPs (6N + attention per token, "
        "docs/concepts/compute.md), rounded down; with --max_train_steps none",
    )
    tokens_per_parameter: float | None = option(
        None,
        "size the run by data: train on this many tokens per parameter (all of them; Chinchilla's compute-optimal "
        "ratio is about 20), rounded up to whole steps; with --max_train_steps none",
    )
    mixed_precision: MIXED_PRECISION = option("no", "autocast dtype: no, bf16 (GPUs and recent CPUs) or fp16 (GPUs)")
    torch_compile: bool = option(False, "compile the model with torch.compile")
    torch_compile_backend: str | None = option(
        None, "torch.compile backend for torch_compile (none: inductor; eager or aot_eager to debug)"
    )
    fsdp: bool = option(
        False, "shard weights, gradients and optimizer state over the processes (torch FSDP2; torchrun on CPUs)"
    )
    seed: int = option(1337, "seed for weights, data order and dropout")
    ddp_timeout: int = option(1800, "seconds a process waits for the others (barriers, all-reduce) before failing")
    # --- evaluation and logging
    eval_steps: int | None = option(500, "evaluate every N steps (and at the end); none: only at the end")
    max_eval_samples: int | None = option(None, "blocks used by the periodic evaluations; the final one uses all")
    logging_steps: int = option(50, "log the mean training loss every N steps")
    loss_spike_margin: float = option(
        0.2,
        "the logged loss_spikes count steps whose loss is above the running mean of the step losses (about the last "
        "50) by more than this fraction of it",
    )
    # --- the best model (transformers' TrainingArguments and EarlyStoppingCallback names)
    load_best_model_at_end: bool = option(
        False, "save the weights of the best periodic evaluation (metric_for_best_model) instead of the last step's"
    )
    metric_for_best_model: str = option("eval_loss", "what picks the best evaluation: eval_loss (or loss), perplexity")
    greater_is_better: bool | None = option(None, "whether a larger metric is better; none: false (both are losses)")
    early_stopping_patience: int | None = option(
        None, "stop after N periodic evaluations without an improvement above early_stopping_threshold; none: off"
    )
    early_stopping_threshold: float = option(0.0, "how much the metric must improve to reset the patience")
    # --- checkpoints
    output_dir: str = option("out/shakespeare_char", "the final Hugging Face checkpoint and the step_N checkpoints")
    checkpointing_steps: int | None = option(500, "save a resumable checkpoint every N steps (and at the end)")
    checkpoints_total_limit: int | None = option(2, "keep only the newest N step_N checkpoints")
    resume_from_checkpoint: str | None = option(None, "'latest' or a step_N folder to continue from")
    checkpointing_minutes: float | None = option(
        None, "also save a resumable checkpoint every M minutes of wall time (every process agrees on the step)"
    )
    stop_signals: str | None = option(
        DEFAULT_STOP_SIGNALS,
        "signals that stop the run at the next step with a checkpoint, exit status 75 (a second Ctrl-C stops at "
        "once); none: signals act as by default",
    )
    overwrite_output_dir: bool = option(
        False, "replace the run output_dir holds (its model, checkpoints, records); without it such a folder is refused"
    )
    # --- tracking and the Hub
    with_tracking: bool = option(False, "log metrics through Accelerate's trackers")
    report_to: str = option("tensorboard", "tracker(s) for with_tracking: tensorboard, wandb, ... or all")
    project_name: str = option("decoderlab", "tracker project / run group name")
    push_to_hub: bool = option(False, "upload the final folder to the Hub (needs hub_model_id)")
    hub_model_id: str | None = option(None, "ORG/NAME of the Hub model repository")
    sample_prompt: str = option("ROMEO:", "prompt of the generation example in the model card")

    def check(self) -> None:
        positive = (
            "block_size", "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
            "max_train_steps", "num_train_epochs", "eval_steps", "logging_steps", "checkpointing_steps",
            "checkpoints_total_limit", "max_eval_samples", "bpe_vocab_size", "tokenizer_train_texts",
            "streaming_validation_texts", "shuffle_buffer_size", "preprocessing_num_workers", "ddp_timeout",
        )  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}.")
        if not 0 <= self.prefetch_batches <= 1024:
            raise ValueError(f"prefetch_batches must be from 0 (no read-ahead) to 1024, got {self.prefetch_batches}.")
        if self.block_size < 2:
            raise ValueError("block_size must be at least 2 (a block predicts its tokens after the first), got 1.")
        for name in ("learning_rate", "embedding_learning_rate", "adam_epsilon"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        for name, what in (("target_flops", "a number of FLOPs, e.g. 1e15"),
                           ("tokens_per_parameter", "tokens per parameter, e.g. 20 (Chinchilla's)"),
                           ("loss_spike_margin", "a fraction of the running mean loss, e.g. 0.2")):  # fmt: skip
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive, {what}; got {value}.")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive, or none to disable clipping, got {self.max_grad_norm}.")
        if self.weight_decay < 0 or self.num_warmup_steps < 0:
            raise ValueError(
                f"weight_decay and num_warmup_steps cannot be negative, got {self.weight_decay}, {self.num_warmup_steps}."
            )
        self.check_muon()
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}.")
        if not 0.0 < self.validation_split_percentage < 100.0:
            raise ValueError(
                f"validation_split_percentage must be in (0, 100), got {self.validation_split_percentage}."
            )
        schedulers = [s.value for s in SchedulerType]
        if self.lr_scheduler_type not in schedulers:
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r} is unknown; choose one of {schedulers}.")
        self.check_files()
        self.check_best_model()
        if self.torch_compile_backend is not None:
            self.check_compile_backend()
        if self.checkpointing_minutes is not None and not self.checkpointing_minutes > 0:
            raise ValueError(
                f"checkpointing_minutes must be a positive number of minutes, got {self.checkpointing_minutes}; "
                "none saves on checkpointing_steps only."
            )
        parse_stop_signals(self.stop_signals)  # a ValueError naming an unknown signal or one this platform lacks
        check_model_fields(self.model)

    def check_muon(self) -> None:
        """Muon's settings, each in its range (whether they may be set at all is the pre-flight check's question)."""
        if not self.muon_learning_rate > 0:
            raise ValueError(f"muon_learning_rate must be positive, got {self.muon_learning_rate}.")
        if self.muon_weight_decay < 0:
            raise ValueError(f"muon_weight_decay cannot be negative, got {self.muon_weight_decay}.")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"muon_momentum must be in [0, 1), got {self.muon_momentum}.")
        if not 1 <= self.muon_ns_steps < 100:  # torch.optim.Muon refuses 100 or more, at the first step
            raise ValueError(f"muon_ns_steps must be from 1 to 99 Newton-Schulz iterations, got {self.muon_ns_steps}.")

    def check_compile_backend(self) -> None:
        import torch._dynamo  # only here: reading a configuration does not import the compiler otherwise

        backends = torch._dynamo.list_backends(exclude_tags=())
        if self.torch_compile_backend not in backends:
            raise ValueError(
                f"torch_compile_backend={self.torch_compile_backend!r} is not a torch.compile backend here; "
                f"choose one of {backends} (none: inductor)."
            )

    def check_best_model(self) -> None:
        """The best-model fields: a metric the evaluation logs (its canonical key replaces an alias), a positive
        patience and a threshold that is not negative; greater_is_better derived when unset."""
        if self.metric_for_best_model not in BEST_MODEL_METRICS:
            raise ValueError(
                f"metric_for_best_model={self.metric_for_best_model!r} is never logged: the evaluation logs "
                f"eval_loss (alias loss) and perplexity (alias eval_perplexity). Use one of {sorted(BEST_MODEL_METRICS)}."
            )
        self.metric_for_best_model = BEST_MODEL_METRICS[self.metric_for_best_model]
        if self.greater_is_better is None:
            self.greater_is_better = False  # both metrics are losses (Trainer's rule, `not name.endswith("loss")`,
            # would call perplexity greater-is-better)
        if self.early_stopping_patience is not None and self.early_stopping_patience < 1:
            raise ValueError(
                f"early_stopping_patience must be a positive integer (evaluations), or none for no early stopping, "
                f"got {self.early_stopping_patience}."
            )
        if self.early_stopping_threshold < 0:
            raise ValueError(f"early_stopping_threshold cannot be negative, got {self.early_stopping_threshold}.")

    def check_files(self) -> None:
        """The data files' suffixes and the text encoding's name (whether they fit the data source: preflight)."""
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path is not None and pathlib.Path(path).suffix not in DATA_FILE_SUFFIXES:
                raise ValueError(f"{name}={path!r} must end in one of {', '.join(DATA_FILE_SUFFIXES)}.")
        check_encoding_name(self.encoding)


def check_encoding_name(encoding: str) -> None:
    """A ValueError unless Python knows the text encoding ``encoding``."""
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise ValueError(
            f"encoding={encoding!r} is not a text encoding Python knows; use one of its names, such as utf-8, "
            "latin-1 (ISO-8859-1) or cp1252 (Windows Western)."
        ) from None


@dataclass
class PrepareConfig(TrainConfig):
    """A training recipe's data fields, and where ``training/prepare_data.py`` writes the token shards.

    ``output_dir`` is the shards' folder, given on the command line; a recipe's own ``output_dir`` names its
    training run's folder, so it is not read here, and without the flag the recipe's ``prepared_data`` is used."""

    IGNORED_YAML_FIELDS = ("output_dir",)

    output_dir: str | None = option(None, "folder of the token shards (default: the recipe's prepared_data)")
    documents_per_shard: int = option(50_000, "documents per training shard of a map-style dataset (streams: a file)")
    token_dtype: TOKEN_DTYPES = option("auto", "dtype of the shards' token ids; auto: uint16, uint32 when needed")

    def check(self) -> None:
        super().check()
        if self.documents_per_shard < 1:
            raise ValueError(f"documents_per_shard must be a positive integer, got {self.documents_per_shard}.")
        if self.output_dir is None:
            self.output_dir = self.prepared_data
        if self.output_dir is None:
            raise ValueError("Where should the shards go? Pass --output_dir DATA (or set prepared_data in the recipe).")


def check_model_fields(model: dict) -> None:
    """The ``model:`` mapping must name DecoderLabConfig fields with valid values (checked by the config itself)."""
    known = {f.name for f in dataclasses.fields(DecoderLabConfig)}
    for key in model:
        if key not in known:
            raise ValueError(f"model.{key} is not a DecoderLabConfig field.{suggestion(key, known)}")
    DecoderLabConfig(**model)  # raises ValueError naming the field for a bad value or type


# ----------------------------------------------------------------------------------------------
# Types: values from YAML are typed already (except YAML 1.1's "1e-3", a string); values from the
# command line are strings. Both go through `coerce`, which converts what is unambiguous and refuses the rest.


def describe(hint) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(hint))
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return f"comma-separated {ITEM_NAMES.get(item, describe(item))} values, e.g. 2,6,12"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}.get(
        hint, "none" if hint is type(None) else str(hint)
    )


def coerce(name: str, value, hint):
    """``value`` as type ``hint``, or a ValueError saying what ``name`` must be."""
    wrong = ValueError(f"{name} must be {describe(hint)}, got {value!r} ({type(value).__name__}).")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in NONE_STRINGS)):
            return None
        for option_type in (a for a in args if a is not type(None)):
            try:
                return coerce(name, value, option_type)
            except ValueError:
                continue
        raise wrong
    if origin is Literal:
        if value in args:
            return value
        raise wrong
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in TRUE_STRINGS + FALSE_STRINGS:
            return value.lower() in TRUE_STRINGS
        raise wrong
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                raise wrong from None
        raise wrong
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise wrong from None
        raise wrong
    if hint is str:
        if isinstance(value, str):
            return value
        raise wrong
    if origin is tuple:  # tuple[T, ...]: "2,6,12" on the command line, a list in YAML
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, (list, tuple)) and items:
            try:
                return tuple(coerce(name, item, args[0]) for item in items)
            except ValueError:
                raise wrong from None
        raise wrong
    if hint is dict or origin is dict:
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value.strip() else {}
            except yaml.YAMLError:
                raise wrong from None
        if isinstance(value, dict):
            parse = parse_model_value if name == "model" else (lambda _, v: parse_scalar(v))
            return {key: parse(key, v) for key, v in value.items()}
        raise wrong
    raise TypeError(f"coerce() does not handle the annotation {hint} of {name}")  # a bug in a config class


def parse_scalar(value):
    """A command-line or YAML scalar with an obvious type: '256' -> 256, '1e-3' -> 0.001, 'true' -> True."""
    if not isinstance(value, str):
        return value
    lowered = value.lower()
    if lowered in NONE_STRINGS:
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            pass
    return value


def parse_model_value(field_name: str, value):
    """A ``DecoderLabConfig`` field's value: a named choice stays a string (``position_embedding_type``
    ``none`` is the choice "none", not None); a mapping field takes a YAML flow mapping
    (``--model.mup_base_shapes "{intermediate_size: 512}"``); anything else is parsed like any scalar."""
    hint = DecoderLabConfig.__annotations__.get(field_name)
    if typing.get_origin(hint) is Literal and value in typing.get_args(hint):
        return value
    if isinstance(value, str) and value.lstrip().startswith("{") and dict in typing.get_args(hint):
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError:
            return value  # the config names the field and the type it wants
    return parse_scalar(value)


def suggestion(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


# ----------------------------------------------------------------------------------------------
# Reading a configuration


def load_yaml(path) -> dict:
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file. Recipes live in training/configs/.")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:  # names the line and column, not the file
        raise ValueError(f"--config {path} is not valid YAML: {' '.join(str(err).split())}") from err
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a mapping of field: value, not a {type(values).__name__}.")
    return values


def add_flags(parser: argparse.ArgumentParser, cls, help_for: typing.Callable | None = None) -> None:
    """One flag per field of the dataclass ``cls`` (``help_for(field)`` for the help text, default: the field's
    own and its default); only flags actually given appear in the parsed namespace, as strings to ``coerce``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("positional"):
            parser.add_argument(f.name, help=f.metadata.get("help", ""))
            continue
        if help_for is None:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = f"{f.metadata.get('help', '')} (default: {default})"
        else:
            help_text = help_for(f)
        kwargs = {"default": argparse.SUPPRESS, "help": help_text}
        if hints[f.name] is bool:
            kwargs.update(nargs="?", const="true", metavar="BOOL")  # `--flag` alone means true
        parser.add_argument(f"--{f.name}", **kwargs)


def build_parser(cls: type[Config], **parser_kwargs) -> argparse.ArgumentParser:
    """``--config YAML`` and one flag per field of ``cls``."""
    epilog = "--model.FIELD VALUE sets one DecoderLabConfig field of the model: mapping." if has_model(cls) else None
    parser = argparse.ArgumentParser(
        **{"description": (cls.__doc__ or "").split("\n")[0], "allow_abbrev": False, "epilog": epilog, **parser_kwargs}
    )
    parser.add_argument("--config", help="YAML recipe whose values the other flags override")
    add_flags(parser, cls)
    add_debug_flag(parser)
    return parser


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """``--debug`` in ``--help``: ``decoderlab.cli.run_command`` takes it off the command line before parsing."""
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)


def has_model(cls) -> bool:
    return "model" in {f.name for f in dataclasses.fields(cls)}


def parse_config(cls: type[Config] = TrainConfig, argv: list[str] | None = None, **parser_kwargs) -> Config:
    """``cls`` from ``--config YAML`` (optional) overridden by the other flags of ``argv``. A value no run can use,
    an unknown field or a recipe that does not parse is a ``UsageError`` (a ValueError: exit status 2)."""
    try:
        return read_config(cls, argv, **parser_kwargs)
    except UsageError:
        raise
    except ValueError as err:
        raise UsageError(str(err)) from err


def read_config(cls: type[Config], argv: list[str] | None, **parser_kwargs) -> Config:
    namespace, rest = build_parser(cls, **parser_kwargs).parse_known_args(argv)
    overrides = vars(namespace)
    overrides.pop(DEBUG_FLAG.lstrip("-"), None)
    config_path = overrides.pop("config", None)
    values = load_yaml(config_path) if config_path else {}
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ValueError(f"{config_path}: {key!r} is not a {cls.__name__} field.{suggestion(key, known)}")
    for key in getattr(cls, "IGNORED_YAML_FIELDS", ()):  # a recipe's value that means something else to cls
        values.pop(key, None)
    values.update(overrides)
    model_overrides = parse_dotted(rest, known, allow_model=has_model(cls))
    if model_overrides:
        values["model"] = {**(values.get("model") or {}), **model_overrides}
    return cls(**values)


def parse_dotted(rest: list[str], known, allow_model: bool = True) -> dict:
    """``--model.FIELD VALUE`` / ``--model.FIELD=VALUE`` pairs left over by argparse."""
    overrides, i = {}, 0
    while i < len(rest):
        flag = rest[i]
        if not (allow_model and flag.startswith("--model.")):
            name = flag.lstrip("-").split("=")[0]
            raise ValueError(f"Unknown argument {flag!r}.{suggestion(name, known)} See --help for every field.")
        key, _, value = flag[len("--model.") :].partition("=")
        if not value:
            if i + 1 >= len(rest):
                raise ValueError(f"{flag} needs a value, e.g. {flag} 256.")
            value, i = rest[i + 1], i + 1
        overrides[key] = parse_model_value(key, value)
        i += 1
    return overrides
