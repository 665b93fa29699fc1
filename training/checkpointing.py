"""Checkpoints that survive a crash, resuming from them, and the final Hugging Face folder.

Layout of ``output_dir`` during and after a run::

    output_dir/
        step_500/ step_1000/     resumable Accelerate states (the newest ``checkpoints_total_limit``)
        step_1500.tmp/           a checkpoint being written: never resumed from, removed by the next save
        config.json, model.safetensors, generation_config.json, tokenizer.json, ...   the final model
        training_config.yaml, run_info.json, metrics.jsonl, README.md                what made it

A checkpoint is written into ``step_N.tmp`` by every process (weights, optimizer, scheduler, each
process's RNG state, plus ``training_state.json``: step, tokens, elapsed time; under ``--fsdp`` the weights and
optimizer state are each process's shards, in ``sharded/``, see ``training/sharding.py``; and each process's
position in its data, ``data_state_R.json``, which a stream needs to continue without reading again), flushed to disk, and
only then renamed to ``step_N`` by the main process. A rename is atomic, so a process killed at any
instant leaves either a complete ``step_N`` or a ``.tmp`` folder that ``latest`` ignores: never a
checkpoint that looks complete but is not. Resuming needs ``output_dir`` on a filesystem all
processes share (one machine, or a cluster's shared disk).
"""

import dataclasses
import json
import logging
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata

import torch
import yaml
from accelerate import Accelerator

from decoderlab.cli import UsageError, UserError

from .sharding import is_sharded, load_sharded, save_sharded, unsharded_copy

logger = logging.getLogger(__name__)

STATE_NAME = "training_state.json"
DATA_STATE_NAME = "data_state_{}.json"  # each process's position in its data (training.data: state_dict)
CHECKPOINT_PATTERN = re.compile(r"step_(\d+)")
TMP_SUFFIX = ".tmp"
DELETING_SUFFIX = ".deleting"  # a checkpoint being deleted: never resumed from
COMPILED_PREFIX = "_orig_mod."  # torch.compile's OptimizedModule holds the model as `_orig_mod`
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = (
    "decoderlab",
    "torch",
    "transformers",
    "accelerate",
    "datasets",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
)


@dataclass
class TrainState:
    """Where a run is; saved in every checkpoint so that a resumed run continues the counts."""

    step: int = 0  # optimizer steps done
    tokens: int = 0  # training tokens seen by all processes together
    elapsed_s: float = 0.0  # wall time spent training so far, summed over resumed runs
    # the best periodic evaluation so far (metric_for_best_model; TrainerState's names) and the evaluations since
    # one improved on the best by more than early_stopping_threshold (EarlyStoppingCallback's counter)
    best_metric: float | None = None
    best_global_step: int | None = None
    early_stopping_patience_counter: int = 0
    # the steps whose loss spiked so far, and the running mean of the step losses they are judged by (training.health)
    loss_spikes: int = 0
    loss_mean: float | None = None


# ----------------------------------------------------------------------------------------------
# Saving


def fsync_tree(folder: pathlib.Path) -> None:
    """Flush every file, then the folders, so that a rename after this never exposes unwritten data."""
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for directory in (folder, folder.parent):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(
    accelerator: Accelerator,
    output_dir,
    state: TrainState,
    *,
    tokenizer=None,
    total_limit: int | None = None,
    sharded: tuple | None = None,
    data_state: dict | None = None,
    keep_step: int | None = None,
) -> pathlib.Path:
    """Write ``output_dir/step_N`` atomically (see the module docstring) and keep the newest ``total_limit``, and
    ``step_{keep_step}`` besides (the best model's checkpoint under ``load_best_model_at_end``).
    ``sharded``: the (model, optimizer) of an FSDP2 run, whose shards every process writes. ``data_state``: this
    process's position in its data (``data_state_R.json``, one per process R)."""
    output_dir = pathlib.Path(output_dir)
    final = output_dir / f"step_{state.step}"
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
    accelerator.wait_for_everyone()
    try:
        write_checkpoint(
            accelerator, output_dir, state, final, tmp, tokenizer, total_limit, sharded, data_state, keep_step
        )
    except BaseException:  # e.g. a second Ctrl-C (KeyboardInterrupt): no half-written folder stays behind
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()
    return final


def write_checkpoint(
    accelerator, output_dir, state, final, tmp, tokenizer, total_limit, sharded, data_state, keep_step
) -> None:
    """``save_checkpoint``'s writing into ``tmp`` and the renaming to ``final``."""
    accelerator.save_state(str(tmp))  # every process: weights (main), optimizer, scheduler, its own RNG state
    if sharded is not None:
        save_sharded(*sharded, tmp)
    if data_state is not None:
        (tmp / DATA_STATE_NAME.format(accelerator.process_index)).write_text(json.dumps(data_state) + "\n")
    if accelerator.is_main_process:
        (tmp / STATE_NAME).write_text(json.dumps(dataclasses.asdict(state), indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)  # resuming reuses exactly this vocabulary
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        fsync_tree(tmp)
        if final.exists():  # saving the same step again (a resumed run that ends where it started)
            remove_checkpoint(final)
        os.replace(tmp, final)
        fsync_tree(final)
        rotate_checkpoints(output_dir, total_limit, keep_step)
        logger.info(f"Saved checkpoint {final}")


def list_checkpoints(output_dir) -> list[pathlib.Path]:
    """Complete ``step_N`` folders, oldest first."""
    output_dir = pathlib.Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and CHECKPOINT_PATTERN.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT_PATTERN.fullmatch(p.name).group(1)))


def remove_checkpoint(folder: pathlib.Path) -> None:
    """Delete a ``step_N`` folder by renaming it out of ``list_checkpoints``' sight first (atomic), so a process
    killed while deleting never leaves a partly deleted ``step_N`` that could be taken for a checkpoint."""
    doomed = folder.with_name(folder.name + DELETING_SUFFIX)
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(folder, doomed)
    shutil.rmtree(doomed)


def rotate_checkpoints(output_dir, total_limit: int | None, keep_step: int | None = None) -> None:
    """Delete all but the newest ``total_limit`` checkpoints, and never ``step_{keep_step}`` (as Trainer keeps its
    ``best_model_checkpoint``)."""
    if total_limit is None:
        return
    protected = pathlib.Path(output_dir) / f"step_{keep_step}"
    for old in [path for path in list_checkpoints(output_dir)[:-total_limit] if path != protected]:
        remove_checkpoint(old)
        logger.info(f"Deleted old checkpoint {old}")


# ----------------------------------------------------------------------------------------------
# Resuming


def resolve_checkpoint(spec: str | None, output_dir) -> pathlib.Path | None:
    """The folder ``--resume_from_checkpoint`` names: ``latest`` (None when there is none yet, said in the log) or a
    path."""
    checkpoint = find_checkpoint(spec, output_dir)
    if spec == "latest" and checkpoint is None:
        logger.info(f"--resume_from_checkpoint latest: no checkpoint in {output_dir} yet, starting from scratch.")
    return checkpoint


def find_checkpoint(spec: str | None, output_dir) -> pathlib.Path | None:
    """``resolve_checkpoint`` without a word in the log (the pre-flight check looks before logging is set up)."""
    if spec is None:
        return None
    if spec == "latest":
        checkpoints = list_checkpoints(output_dir)
        return checkpoints[-1] if checkpoints else None
    path = pathlib.Path(spec)
    if not (path / STATE_NAME).is_file():
        found = ", ".join(p.name for p in list_checkpoints(output_dir)) or "none"
        raise ValueError(
            f"--resume_from_checkpoint {spec}: not a complete checkpoint (no {STATE_NAME} in it). "
            f"Pass 'latest' or a step_N folder; checkpoints in {output_dir}: {found}."
        )
    return path


def read_state(path) -> TrainState:
    """Where the run saved in the checkpoint folder ``path`` was: step, tokens, elapsed time."""
    return TrainState(**json.loads((pathlib.Path(path) / STATE_NAME).read_text()))


def read_data_state(path, process_index: int) -> dict | None:
    """Process ``process_index``'s data position saved in the checkpoint ``path``; the first process's when there is
    none for it (a run with more processes than the checkpoint's: ``training.data`` checks whether it carries
    over); None for a checkpoint saved before data positions were."""
    folder = pathlib.Path(path)
    for name in (DATA_STATE_NAME.format(process_index), DATA_STATE_NAME.format(0)):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    return None


def load_checkpoint(accelerator: Accelerator, path, sharded: tuple | None = None) -> TrainState:
    """Restore weights, optimizer, scheduler and RNG states into the prepared objects (and into the sharded
    (model, optimizer) of an FSDP2 run); return the run's state."""
    accelerator.load_state(str(path))
    if sharded is not None:
        load_sharded(*sharded, pathlib.Path(path))
    state = read_state(path)
    logger.info(f"Resumed from {path} at step {state.step}")
    return state


# ----------------------------------------------------------------------------------------------
# The final folder


def git_commit(ignore: tuple[str, ...] = ()) -> dict:
    """The commit of the checkout the code runs from, and whether it had uncommitted changes (outside the folders
    ``ignore`` names, relative to the repository root: e.g. results that earlier runs wrote). Both None where the
    project's root is not the top level of a git repository: a copy of the tree without its ``.git`` (an archive,
    a folder copied to another machine) sits inside some other repository, or none, whose commit says nothing
    about this code."""

    def git(*args) -> str | None:
        try:
            result = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or pathlib.Path(top).resolve() != REPO_ROOT.resolve():
        return {"commit": None, "dirty": None}
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":(exclude){path}" for path in ignore))
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def package_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` shows it (from /proc/cpuinfo), e.g. 'AMD EPYC 9B14'."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    names = re.findall(r"model name\s*:\s*(.+)", cpuinfo.read_text()) if cpuinfo.is_file() else []
    return names[0].strip() if names else platform.processor() or platform.machine()


def hardware_description(accelerator: Accelerator) -> str:
    """E.g. '2 x NVIDIA H100 80GB HBM3' or '1 process on CPU (AMD EPYC, 2 threads per process)'."""
    n = accelerator.num_processes
    if accelerator.device.type == "cuda":
        return f"{n} x {torch.cuda.get_device_name(accelerator.device)}"
    cpu = cpu_model()
    threads = torch.get_num_threads()
    process, thread = "process" if n == 1 else "processes", "thread" if threads == 1 else "threads"
    return f"{n} {process} on {accelerator.device.type.upper()} ({cpu}, {threads} {thread} per process)"


def run_info(accelerator: Accelerator) -> dict:
    """What reproduces a run besides its configuration: code version, packages, launch, hardware."""
    return {
        "git": git_commit(),
        "packages": package_versions(),
        "command": [pathlib.Path(sys.argv[0]).name, *sys.argv[1:]],
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "mixed_precision": accelerator.mixed_precision,
        "hardware": hardware_description(accelerator),
    }


def save_final_folder(
    accelerator: Accelerator,
    model,
    tokenizer,
    output_dir,
    config: dict,
    info: dict,
    config_comment: str = "",
) -> pathlib.Path:
    """Write a complete Hugging Face checkpoint into ``output_dir``: weights (safetensors), config, generation
    config, tokenizer, the resolved training configuration (after ``config_comment``, YAML comment lines that a
    reader of the file sees and ``yaml.safe_load`` skips) and ``run_info.json``. ``metrics.jsonl`` is already there
    (the loop appends to it); the model card is written last, by the script."""
    output_dir = pathlib.Path(output_dir)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)  # without DDP's and torch.compile's wrappers
    if is_sharded(unwrapped):  # --fsdp: the full weights gathered into a plain copy on the main process
        plain = unsharded_copy(unwrapped, accelerator.is_main_process)
        if plain is not None:
            plain.save_pretrained(output_dir)
    else:
        state_dict = accelerator.get_state_dict(model)  # gathered from every process under FSDP and DeepSpeed
        if state_dict is not None:  # torch.compile's wrapper prefixes each name; the checkpoint keeps the model's own
            state_dict = {name.removeprefix(COMPILED_PREFIX): tensor for name, tensor in state_dict.items()}
        unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, state_dict=state_dict)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
        (output_dir / "training_config.yaml").write_text(config_comment + yaml.safe_dump(config, sort_keys=False))
        (output_dir / "run_info.json").write_text(json.dumps(info, indent=2) + "\n")
    accelerator.wait_for_everyone()
    return output_dir


# ----------------------------------------------------------------------------------------------
# One run per folder

# What shows that a folder holds a run's result: its model (or LoRA adapter) or its resumable checkpoints
RUN_MARKERS = ("config.json", "model.safetensors", "model.safetensors.index.json", "adapter_config.json")
# Everything a training run writes into its output_dir (``--overwrite_output_dir`` removes these, nothing else)
RUN_OUTPUTS = (
    *RUN_MARKERS, "model-*.safetensors", "generation_config.json", "adapter", "adapter_model.safetensors",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "vocab.json", "merges.txt", "training_config.yaml", "run_info.json", "metrics.jsonl", "README.md",
    "eval_results.json", "training_curve.png", "*_decoderlab.py", "step_*",
)  # fmt: skip


def previous_run(output_dir) -> list[str]:
    """The names in ``output_dir`` that show it holds a run already: its model files and ``step_N`` checkpoints."""
    folder = pathlib.Path(output_dir)
    if not folder.is_dir():
        return []
    found = [name for name in RUN_MARKERS if (folder / name).exists()]
    return found + [p.name for p in list_checkpoints(folder)]


def claim_output_dir(accelerator: Accelerator, cfg, checkpoint: pathlib.Path | None, base_model: str | None = None):
    """Make ``cfg.output_dir`` this run's, before any data is read or step taken: a folder holding another run's model
    or checkpoints is refused (``UserError`` naming ``--resume_from_checkpoint latest`` and ``--overwrite_output_dir``),
    unless this run resumes one of its checkpoints or ``cfg.overwrite_output_dir`` asks to replace it, in which case
    the main process removes every file a run writes there (``RUN_OUTPUTS``, and the trackers' folder) first."""
    folder = pathlib.Path(cfg.output_dir)
    if base_model is not None and pathlib.Path(base_model).resolve() == folder.resolve():
        raise UsageError(
            f"--output_dir {cfg.output_dir} is the base checkpoint (--model_name_or_path): training would write over "
            "the weights it starts from. Pass another --output_dir."
        )
    held = previous_run(folder)
    if not held or (checkpoint is not None and checkpoint.resolve().parent == folder.resolve()):
        return  # a new folder, or this run continues the one it holds
    if not cfg.overwrite_output_dir:
        listed = ", ".join(held[:6]) + (", ..." if len(held) > 6 else "")
        if cfg.resume_from_checkpoint == "latest":
            what = f"holds a run's model ({listed}) but no step_N checkpoint to resume from"
            options = "Replace it with --overwrite_output_dir, or pass another --output_dir."
        else:
            what = f"holds another run ({listed})"
            options = (
                "Continue that run with --resume_from_checkpoint latest, replace it with --overwrite_output_dir, "
                "or pass another --output_dir."
            )
        raise UserError(f"--output_dir {cfg.output_dir} {what}: a new run there would mix with it. {options}")
    here = pathlib.Path.cwd().resolve()
    if folder.resolve() in (here, *here.parents) or (folder / ".git").exists():
        raise UsageError(
            f"--overwrite_output_dir will not clear {cfg.output_dir}: it holds the working directory or a git "
            "repository. Train into a folder of its own."
        )
    accelerator.wait_for_everyone()  # every process has looked at the folder before it changes
    if accelerator.is_main_process:
        doomed = {path for pattern in RUN_OUTPUTS for path in folder.glob(pattern)}
        doomed |= {folder / cfg.project_name} if (folder / cfg.project_name).is_dir() else set()
        for path in sorted(doomed):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        logger.info(f"--overwrite_output_dir: removed the previous run from {folder} ({len(doomed)} entries).")
    accelerator.wait_for_everyone()


# ----------------------------------------------------------------------------------------------
# A resume that fits

# The settings a checkpoint's weights and optimizer state depend on: another value builds other parameters or
# other optimizer groups, which torch would refuse with a list of tensor names
SHAPING_FIELDS = (
    "model_name_or_path", "tokenizer_type", "tokenizer_name", "bpe_vocab_size", "add_special_tokens", "use_lora",
    "lora_r", "lora_target_modules", "fsdp", "optimizer",
)  # fmt: skip
CONFIG_NAME = "training_config.yaml"
WRAPPER_PREFIXES = ("module.", COMPILED_PREFIX)  # DDP's and torch.compile's, in the names Accelerate saves


def record_config(accelerator: Accelerator, cfg, checkpoint: pathlib.Path | None) -> None:
    """Write ``cfg`` (the resolved configuration) into ``output_dir/training_config.yaml`` before the first step of a
    new run, so that a resume from one of its checkpoints can be compared with it (``preflight.resume_fits``); the final
    folder writes it again. A resumed run (``checkpoint``) leaves the record as it is until it finishes."""
    if checkpoint is None and accelerator.is_main_process:
        folder = pathlib.Path(cfg.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_NAME).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def check_resume_tensors(checkpoint: pathlib.Path | None, model: torch.nn.Module) -> None:
    """For a checkpoint whose run left no ``training_config.yaml`` beside it (the pre-flight check compares the
    settings of every other): a ``UsageError`` in one line naming every tensor whose name or shape differs from
    ``model``'s, before any weight is loaded."""
    if checkpoint is None or (pathlib.Path(checkpoint).parent / CONFIG_NAME).is_file():
        return
    differences = tensor_differences(pathlib.Path(checkpoint), model)
    if differences:
        raise UsageError(resume_refusal(checkpoint, differences))


def resume_refusal(checkpoint, differences: list[str]) -> str:
    """The one line that refuses a resume from ``checkpoint``, naming what differs (the checkpoint's value -> the
    given one)."""
    shown = "; ".join(differences[:8]) + ("; ..." if len(differences) > 8 else "")
    return (
        f"--resume_from_checkpoint {checkpoint} does not fit this run (checkpoint's value -> given): {shown}. "
        f"Resume with the checkpoint's settings, or start a new run (another --output_dir, or "
        "--overwrite_output_dir without --resume_from_checkpoint)."
    )


def tensor_differences(checkpoint: pathlib.Path, model: torch.nn.Module) -> list[str]:
    """The weights whose names or shapes differ between ``checkpoint/model.safetensors`` and ``model``: e.g.
    ``model.layers.4.mlp.up_proj.weight: absent -> [256, 128]`` (nothing for a sharded checkpoint: no such file)."""
    from safetensors import safe_open

    path = checkpoint / "model.safetensors"
    if not path.is_file():
        return []
    with safe_open(str(path), framework="pt") as f:
        saved = {}
        for key in f.keys():
            name = key
            for prefix in WRAPPER_PREFIXES:
                name = name.removeprefix(prefix)
            saved[name] = list(f.get_slice(key).get_shape())
    state = model.state_dict()
    own = {name: list(t.shape) for name, t in state.items()}
    for name, tensor in state.items():  # a tied weight is saved once, under one of its names
        if name not in saved and any(t is not tensor and t.data_ptr() == tensor.data_ptr() and other in saved
                                     for other, t in state.items()):  # fmt: skip
            saved[name] = own[name]
    names = sorted(set(saved) | set(own), key=lambda n: (n not in saved or n not in own, n))
    return [
        f"{name}: {saved.get(name, 'absent')} -> {own.get(name, 'absent')}"
        for name in names
        if saved.get(name) != own.get(name)
    ]
