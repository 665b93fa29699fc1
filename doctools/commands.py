"""A shell line of the docs, parsed by the argument parser of the project script it runs.

    python training/pretrain.py --config training/configs/shakespeare_char.yaml --learning_rate 2e-3
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 training/pretrain.py --fsdp true ...
    accelerate launch --config_file training/accelerate_configs/ddp.yaml training/pretrain.py ...
    python -m decoderlab.convert --to gguf out/shakespeare_char model.gguf

``project_command(line)`` finds the project script a line runs (a file or module of ``training``,
``decoderlab``, ``benchmarks`` or ``experiments``) and its arguments; where ``accelerate launch`` or
``torchrun`` starts it, the launcher's own parser splits its flags from the script's (and so checks them too).
``parse_with_script(command)`` runs the script's ``main`` until its parser has read the arguments, and stops
it there: argparse's ``parse_args`` returning, or a ``training.args.Config`` built and checked from them.
Nothing else of the script runs. A flag the script lacks, or a value its config refuses, is a ``CommandError``.
``capture_parser(module)`` gives the ``argparse`` parser a script builds, for the reference pages.
"""

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import io
import pathlib
import re
import shlex
import sys
from unittest import mock

from . import REPO_ROOT

PROJECT_PACKAGES = ("training", "decoderlab", "benchmarks", "experiments")
PYTHONS = ("python", "python3")


class CommandError(ValueError):
    """A documented command that its script's parser (or its launcher's) refuses."""


@dataclasses.dataclass(frozen=True)
class Command:
    module: str  # the script as a module: training/pretrain.py -> training.pretrain
    argv: tuple[str, ...]
    launcher: str = "python"


def split_words(line: str) -> list[str]:
    """The words bash would pass: $'...' quoting decoded, comments dropped, leading VAR=value assignments removed."""
    line = re.sub(
        r"\$'((?:[^'\\]|\\.)*)'", lambda m: shlex.quote(m[1].encode().decode("unicode_escape")), line
    )  # bash's ANSI-C quoting, e.g. $'USER: hi\n\nASSISTANT: '
    words = shlex.split(line, comments=True)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words.pop(0)
    return words


def argparse_error(stderr: io.StringIO) -> str:
    """argparse's own message (its last line, ``prog: error: ...``), without the usage lines above it."""
    lines = stderr.getvalue().strip().splitlines()
    return lines[-1] if lines else "(no message)"


def _launcher_args(parser: argparse.ArgumentParser, words: list[str], name: str) -> argparse.Namespace:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(words)
    except SystemExit:
        raise CommandError(f"{name} refuses {shlex.join(words)!r}: {argparse_error(stderr)}") from None


def _script_module(script: str, is_module: bool) -> str | None:
    if is_module:
        module = script
    else:
        path = pathlib.Path(script)
        if path.is_absolute() or path.suffix != ".py":
            return None
        module = ".".join(path.with_suffix("").parts)
    if module.split(".")[0] not in PROJECT_PACKAGES:
        return None
    as_path = REPO_ROOT / pathlib.Path(*module.split("."))
    if not (as_path.with_suffix(".py").is_file() or (as_path / "__main__.py").is_file() or as_path.is_dir()):
        raise CommandError(f"{script!r}: no such script in the project ({as_path.relative_to(REPO_ROOT)}.py).")
    return module


def project_command(line: str) -> Command | None:
    """The project script ``line`` runs and its arguments, or None for any other command (make, pip, curl, ...)."""
    words = split_words(line)
    if not words:
        return None
    if words[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import launch_command_parser

        ns = _launcher_args(launch_command_parser(), words[2:], "accelerate launch")
        launcher, script, args, is_module = "accelerate launch", ns.training_script, ns.training_script_args, ns.module
    elif words[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        ns = _launcher_args(get_args_parser(), words[1:], "torchrun")
        launcher, script, args, is_module = "torchrun", ns.training_script, ns.training_script_args, ns.module
    elif words[0] in PYTHONS and len(words) > 1:
        launcher = "python"
        if words[1] == "-m" and len(words) > 2:
            script, args, is_module = words[2], words[3:], True
        elif words[1].endswith(".py"):
            script, args, is_module = words[1], words[2:], False
        else:
            return None  # python -c ..., python -V
    else:
        return None
    module = _script_module(script, is_module)
    return None if module is None else Command(module, tuple(args), launcher)


class _Parsed(Exception):
    def __init__(self, result):
        super().__init__("parsed")
        self.result = result


def _call_main(module_name: str, argv: list[str]):
    module = importlib.import_module(module_name)
    main = getattr(module, "main", None)
    if main is None:
        raise CommandError(f"{module_name} has no main() to parse a command line with.")
    if inspect.signature(main).parameters:
        return main(argv)
    with mock.patch.object(sys, "argv", [module_name, *argv]):
        return main()


def parse_with_script(command: Command):
    """The namespace or ``Config`` the script of ``command`` makes of its arguments; CommandError if it refuses
    them. The script stops as soon as they are parsed and checked."""
    from training.args import Config

    real_parse_args, real_post_init = argparse.ArgumentParser.parse_args, Config.__post_init__

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(real_parse_args(self, args, namespace))

    def post_init(self):
        real_post_init(self)
        raise _Parsed(self)

    stderr = io.StringIO()
    shown = shlex.join([command.launcher, command.module, *command.argv])
    try:
        with (
            mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args),
            mock.patch.object(Config, "__post_init__", post_init),
            contextlib.redirect_stderr(stderr),
        ):
            _call_main(command.module, list(command.argv))
    except _Parsed as parsed:
        return parsed.result
    except SystemExit as stop:
        if stop.code in (0, None):  # --help
            return None
        raise CommandError(f"{command.module} refuses {shown!r}: {argparse_error(stderr)}") from None
    except ValueError as err:
        raise CommandError(f"{command.module} refuses {shown!r}: {err}") from None
    raise CommandError(f"{command.module}.main() returned without parsing {shown!r}.")


def capture_parser(module_name: str) -> argparse.ArgumentParser:
    """The ``argparse`` parser the script ``module_name`` builds, taken from its ``main`` before it parses."""
    def parse_known_args(self, args=None, namespace=None):
        raise _Parsed(self)

    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_known_args):
            _call_main(module_name, [])
    except _Parsed as captured:
        return captured.result
    raise CommandError(f"{module_name}.main() built no argparse parser.")


# ----------------------------------------------------------------------------------------------
# Running the offline commands (make test-all)

# appended to a training command so a page's walkthrough runs in seconds; later flags win over earlier ones
SHORT_TRAINING = ("--max_train_steps", "6", "--eval_steps", "3", "--checkpointing_steps", "3")
# a run sized by its budget is shortened without it (the pre-flight check refuses a budget beside --max_train_steps)
BUDGET_FLAGS = ("--target_flops", "--tokens_per_parameter")
# (training.mup_tune passes what follows its "--" to each of its pretraining runs: the documented command has one)
TRAINING_SCRIPTS = ("training.pretrain", "training.finetune", "training.mup_tune")
OUTPUT_FLAGS = ("--output_dir", "--save", "--json_out")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def offline_reason(command: Command, parsed, workdir: pathlib.Path) -> str | None:
    """Why ``command`` cannot run here, offline on a CPU in a short form (None: it can). ``parsed`` is what its
    parser made of it (``parse_with_script``); paths are checked against ``workdir``, after the page's earlier
    commands have run there, so a checkpoint an earlier line trains counts as present."""
    if command.launcher != "python":
        return f"{command.launcher}: more processes (the distributed tests launch them)"
    if command.module.split(".")[0] in ("benchmarks", "experiments"):
        return "a benchmark or experiment run (their quick forms run in the tests)"
    if command.module == "decoderlab.explore" and "--save" not in command.argv:
        return "starts a web server (tests/test_explore_browser.py starts it)"
    if command.module == "decoderlab.push" or "--push_to_hub" in command.argv:
        return "uploads to the Hub (network)"
    prepared = getattr(parsed, "prepared_data", None)
    from_files = bool(getattr(parsed, "train_file", None)) or bool(
        prepared and (workdir / prepared / "meta.json").is_file()
    )
    for field in ("dataset_name", "model_name_or_path", "tokenizer_name"):
        value = getattr(parsed, field, None)
        if isinstance(value, str) and not (workdir / value).exists() and not (field == "dataset_name" and from_files):
            return f"{field} {value!r} is not here: a Hub repository (network)"
    outputs = {command.argv[i + 1] for i, word in enumerate(command.argv[:-1]) if word in OUTPUT_FLAGS}
    for word in command.argv:
        if HUB_ID.match(word) and word not in outputs and not (workdir / word).exists():
            return f"{word!r} is not here: a Hub repository (network) or a folder the page does not make"
    if command.module == "decoderlab.convert" and command.argv and command.argv[0] == "--from":
        source = command.argv[2] if len(command.argv) > 2 else ""
        if not (workdir / source).exists():
            return f"{source!r} is not here: a checkpoint the page does not make"
    return None


def runnable_argv(command: Command, python: str) -> list[str]:
    """The command as a subprocess runs it: ``python -m MODULE ARGS``, a training run shortened (a run sized by a
    budget, ``BUDGET_FLAGS``, without its budget: it then trains the short run's steps)."""
    if command.module not in TRAINING_SCRIPTS:
        return [python, "-m", command.module, *command.argv]
    argv, skip = [], False
    for word in command.argv:
        if not skip and word.split("=")[0] in BUDGET_FLAGS:
            skip = "=" not in word  # its value is the next word
            continue
        if not skip:
            argv.append(word)
        skip = False
    return [python, "-m", command.module, *argv, *SHORT_TRAINING]
