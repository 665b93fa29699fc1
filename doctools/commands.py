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
