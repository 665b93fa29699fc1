"""Push a decoderlab checkpoint folder to the Hugging Face Hub, after checking that it loads anywhere.

    python -m decoderlab.push FOLDER ORG/NAME [--private] [--revision BRANCH] [--include_checkpoints]

The token comes from ``hf auth login`` or ``HF_TOKEN``. Before anything is uploaded the folder must be a
complete checkpoint: ``config.json`` with an ``auto_map`` for AutoConfig, AutoModel and
AutoModelForCausalLM whose classes exist in the folder's two ``.py`` files, weights in safetensors, and
no pickle files (loading those can run arbitrary code). The intermediate training checkpoints inside it
(``checkpoint-*``, ``step_*``) stay local unless ``include_checkpoints``: then they are uploaded as the
training scripts wrote them, Accelerate's pickled optimizer, scheduler and RNG states included (training state
to resume from, which only ``accelerator.load_state`` reads; the model that ``from_pretrained`` loads stays
pickle-free). Folders still being written (``step_N.tmp``) never are.

A failure to reach the Hub or to authenticate raises ``HubAccessError``, naming the endpoint and what to check.
"""

import argparse
import ast
import contextlib
import fnmatch
import json
import os
import pathlib
import re
import shutil
import struct
import tempfile

from huggingface_hub import HfApi, errors, get_token
from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled
from transformers.utils import logging

from .cli import run_command
from .export.checkpoint import lora_adapter_problem
from .model_card import CARD_NAME, card_for_repo, write_model_card

logger = logging.get_logger(__name__)

CODE_FILES = ("configuration_decoderlab.py", "modeling_decoderlab.py")
REQUIRED_AUTO_CLASSES = ("AutoConfig", "AutoModel", "AutoModelForCausalLM")
INTERMEDIATE_CHECKPOINTS = ("checkpoint-*", "step_*")  # folder names the training scripts use
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")  # torch.save / pickle formats
NEVER_UPLOADED = (".git", ".cache", "__pycache__", "*.tmp")  # *.tmp: a checkpoint still being written
REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
# What huggingface_hub's HTTP client raises when the Hub cannot be reached (httpx's errors, not OSErrors)
TRANSPORT_ERROR = getattr(errors, "HTTPError", OSError)


class HubAccessError(ConnectionError):
    """The Hub could not be reached, or refused the token; the message names the endpoint and what to check."""


def hub_access_error(err: Exception, endpoint: str, repo_id: str) -> HubAccessError:
    """``err`` (raised talking to the Hub at ``endpoint``) in words that say what to check."""
    login = "log in with `hf auth login` (or `huggingface-cli login`), or set HF_TOKEN to a token with write access"
    if isinstance(err, LocalTokenNotFoundError):
        return HubAccessError(f"No Hub token, so nothing can be pushed to {endpoint}: {login}.")
    if isinstance(err, OfflineModeIsEnabled):
        return HubAccessError(
            f"Offline mode is on (HF_HUB_OFFLINE=1), so nothing can be pushed to {endpoint}: unset HF_HUB_OFFLINE."
        )
    if isinstance(err, HfHubHTTPError) and err.response is not None:
        status = err.response.status_code
        if status == 401:
            return HubAccessError(
                f"{endpoint} refused the token (401 Unauthorized): it is invalid or expired. Check it with "
                f"`hf auth whoami`, and {login}."
            )
        if status == 403:
            return HubAccessError(
                f"{endpoint} refused to write to {repo_id} (403 Forbidden): the token has no write access to that "
                "namespace. Use a token with write access, or a repository under your own name."
            )
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return HubAccessError(f"{endpoint} answered {status} for {repo_id}: {first_line}")
    return HubAccessError(
        f"Cannot reach the Hub at {endpoint} ({type(err).__name__}: {err}). Check the network connection, and the "
        "HF_ENDPOINT variable if you set one."
    )


@contextlib.contextmanager
def talking_to_hub(endpoint: str, repo_id: str):
    """Turns what a Hub request raises (connection errors, HTTP answers, a missing token) into ``HubAccessError``."""
    try:
        yield
    except (OSError, TRANSPORT_ERROR) as err:
        raise hub_access_error(err, endpoint, repo_id) from err


def upload_candidates(folder: pathlib.Path, include_checkpoints: bool) -> list[str]:
    """Relative paths of the files to upload: all of them, less caches and (unless asked) intermediate checkpoints."""
    skipped = NEVER_UPLOADED + (() if include_checkpoints else INTERMEDIATE_CHECKPOINTS)
    files = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and not any(fnmatch.fnmatch(part, pattern) for part in relative.parts for pattern in skipped):
            files.append(relative.as_posix())
    return files


def model_files(files: list[str]) -> list[str]:
    """``files`` less those inside intermediate checkpoints: what ``from_pretrained`` reads, which must be
    pickle-free (an intermediate checkpoint's pickles are Accelerate's training state)."""
    inside = lambda name: "/" in name and any(fnmatch.fnmatch(name.split("/")[0], p) for p in INTERMEDIATE_CHECKPOINTS)
    return [name for name in files if not inside(name)]


def top_level_classes(source: pathlib.Path) -> set[str]:
    """Names of the classes a Python file defines at module level (read with ``ast``, never imported)."""
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    except (SyntaxError, UnicodeDecodeError):
        return set()  # reported as missing classes
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


def is_safetensors(path: pathlib.Path) -> bool:
    """True if the file starts like safetensors: an 8-byte little-endian header length, then a JSON object."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return False
        (length,) = struct.unpack("<Q", head)
        if not 1 < length <= path.stat().st_size - 8:
            return False
        try:
            return isinstance(json.loads(f.read(length)), dict)
        except ValueError:  # not UTF-8 / not JSON
            return False


def relative_imports(source: pathlib.Path) -> set[str]:
    """File names of the sibling modules a Python file imports as ``from .name import ...`` (read with ``ast``)."""
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    except (SyntaxError, UnicodeDecodeError):
        return set()
    return {f"{node.module}.py" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}


def checkpoint_problems(folder: pathlib.Path, files: list[str]) -> list[str]:
    """Everything that would stop the pushed repository loading safely where decoderlab is not installed."""
    problems = [f"{name} is missing" for name in CODE_FILES if name not in files]
    model = model_files(files)
    siblings = {(sibling, name) for name in CODE_FILES if name in files for sibling in relative_imports(folder / name)}
    problems += [
        f"{sibling} is missing (imported by {name})" for sibling, name in sorted(siblings) if sibling not in files
    ]
    pickles = [name for name in model if name.lower().endswith(PICKLE_SUFFIXES)]
    if pickles:
        problems.append(f"pickle files would be uploaded: {', '.join(pickles)}; delete them (weights: safetensors)")
    weights = [name for name in model if name.endswith(".safetensors")]
    if not weights:
        problems.append("there are no .safetensors weights (save with model.save_pretrained)")
    problems += [f"{name} is not a safetensors file" for name in weights if not is_safetensors(folder / name)]
    if "config.json" not in files:
        return problems + ["config.json is missing"]
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except ValueError as err:
        return problems + [f"config.json is not valid JSON ({err})"]
    if config.get("model_type") != "decoderlab":
        problems.append(f"config.json has model_type={config.get('model_type')!r}, not 'decoderlab'")
    auto_map = config.get("auto_map") or {}
    missing = [name for name in REQUIRED_AUTO_CLASSES if name not in auto_map]
    if missing:
        problems.append(
            f"config.json's auto_map lacks {', '.join(missing)} (without it transformers cannot find the model "
            "code; save with decoderlab's save_pretrained, which writes the full auto_map)"
        )
    defined = {name.removesuffix(".py"): top_level_classes(folder / name) for name in CODE_FILES if name in files}
    references = [  # an auto_map value is "module.Class", or a list of them (tokenizers: slow, fast)
        (f"auto_map[{key!r}]", reference)
        for key, value in auto_map.items()
        for reference in (value if isinstance(value, list) else [value])
        if reference is not None
    ]
    references += [("architectures", f"modeling_decoderlab.{name}") for name in config.get("architectures") or []]
    for where, reference in references:
        module, _, name = str(reference).rpartition(".")
        if name not in defined.get(module, set()):
            problems.append(f"config.json {where} names {reference!r}, which is not a class defined in {module}.py")
    return problems


def stage(folder: pathlib.Path, files: list[str], staging: pathlib.Path, repo_id: str) -> None:
    """Mirror ``files`` into ``staging`` as links, with the model card naming ``repo_id``."""
    for name in files:
        target = staging / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name == CARD_NAME:
            target.write_text(card_for_repo(folder / name, repo_id), encoding="utf-8")
            continue
        try:
            os.symlink((folder / name).resolve(), target)
        except OSError:  # no symlinks (e.g. Windows without developer mode)
            shutil.copy2(folder / name, target)


def push_to_hub(
    folder,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    include_checkpoints: bool = False,
) -> str:
    """Upload a checkpoint folder to the Hub repository ``repo_id`` (created if needed), in one commit.

    Args:
        folder: a folder written by ``save_pretrained`` (plus tokenizer, model card, metrics).
        repo_id: ``"ORG/NAME"``.
        private: create the repository private (an existing repository keeps its visibility).
        revision: a branch to commit to, created from ``main`` if absent; ``None`` commits to ``main``.
        token: a Hub token with write access; ``None`` uses the stored login or ``HF_TOKEN``.
        commit_message: defaults to "Upload decoderlab checkpoint FOLDER_NAME".
        include_checkpoints: also upload the intermediate ``checkpoint-*`` / ``step_*`` folders as they are, the
            pickled training state in them included (see the module docstring).

    Returns:
        The URL of the commit; its last path component is the commit hash to pin ``revision`` to.

    Raises:
        ValueError: ``repo_id`` is not ``ORG/NAME``, or the folder is not a complete, pickle-free checkpoint.
        HubAccessError: the Hub could not be reached, or refused the token.
    """
    folder = pathlib.Path(folder)
    if not REPO_ID.fullmatch(repo_id):
        raise ValueError(f"repo_id={repo_id!r} must be 'ORG/NAME' (letters, digits, '-', '_', '.').")
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder: pass the checkpoint folder that save_pretrained wrote.")
    adapter = lora_adapter_problem(folder, "python -m decoderlab.push")
    if adapter:
        raise ValueError(adapter)
    files = upload_candidates(folder, include_checkpoints)
    problems = checkpoint_problems(folder, files)
    if problems:
        raise ValueError(
            f"{folder} is not a complete decoderlab checkpoint, so it was not pushed:\n- "
            + "\n- ".join(problems)
            + "\nSave the model with DecoderLabForCausalLM.save_pretrained(folder) and try again."
        )
    if include_checkpoints and len(model_files(files)) < len(files):
        logger.warning(
            f"Uploading {len(files) - len(model_files(files))} files of intermediate checkpoints as the training "
            "scripts wrote them, pickled optimizer/scheduler/RNG states included: only accelerator.load_state reads "
            "them; load them only from a repository you trust."
        )

    api = HfApi(token=token)
    if token is None and get_token() is None:  # no stored login, no HF_TOKEN: the Hub would answer 401
        raise hub_access_error(LocalTokenNotFoundError(), api.endpoint, repo_id)
    with talking_to_hub(api.endpoint, repo_id):  # first, so that a push that cannot happen changes nothing here
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
    if CARD_NAME not in files:
        logger.warning(f"{folder} has no {CARD_NAME}; writing a model card from config.json and metrics.jsonl.")
        write_model_card(folder)
        files = upload_candidates(folder, include_checkpoints)
    if "tokenizer_config.json" not in files:
        logger.warning(f"{folder} has no tokenizer: AutoTokenizer and pipeline() will not load from {repo_id}.")
    with tempfile.TemporaryDirectory(prefix="decoderlab-push-") as staging:
        stage(folder, files, pathlib.Path(staging), repo_id)
        with talking_to_hub(api.endpoint, repo_id):
            commit = api.upload_folder(
                folder_path=staging,
                repo_id=repo_id,
                revision=revision,
                commit_message=commit_message or f"Upload decoderlab checkpoint {folder.resolve().name}",
            )
    logger.info(f"Pushed {len(files)} files from {folder} to {commit.commit_url}")
    return commit.commit_url


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m decoderlab.push", description="Push a decoderlab checkpoint folder to the Hugging Face Hub."
    )
    parser.add_argument("folder", type=pathlib.Path, help="checkpoint folder written by save_pretrained")
    parser.add_argument("repo_id", help="ORG/NAME of the Hub model repository (created if needed)")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--revision", help="branch to push to (created from main if needed); default main")
    parser.add_argument(
        "--include_checkpoints",
        action="store_true",
        help="also upload the checkpoint-*/step_* folders as they are: training state to resume from, with "
        "Accelerate's pickled optimizer/RNG states (load only from a repository you trust)",
    )
    parser.add_argument("--commit_message", help="first line of the commit")
    args = parser.parse_args(argv)
    commit_url = push_to_hub(
        args.folder,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        commit_message=args.commit_message,
        include_checkpoints=args.include_checkpoints,
    )
    commit = commit_url.rstrip("/").rsplit("/", 1)[-1]
    print(f"Pushed {args.folder} to {commit_url}")
    print(
        "Load it without decoderlab, pinned to this commit:\n"
        f'  AutoModelForCausalLM.from_pretrained("{args.repo_id}", trust_remote_code=True, revision="{commit}")'
    )


if __name__ == "__main__":
    run_command(main)
