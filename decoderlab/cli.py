"""How every command of the project ends on a user's mistake: one ``error: ...`` line, not a traceback.

    from decoderlab.cli import run_command

    if __name__ == "__main__":
        run_command(main)   # main(argv) -> None | int

A command raises as usual; ``run_command`` decides what the user sees:

- ``UsageError`` (a flag's value, or flags that do not go together): ``error: ...`` and exit status 2, as argparse
  does for the flags it checks itself;
- the errors a user's input causes (``USER_ERRORS``: a bad value, a missing or existing file, a refused download):
  ``error: ...`` and exit status 1;
- Ctrl-C: exit status 130, without a traceback;
- anything else is a bug: Python's traceback, as always.

``--debug`` anywhere on the command line (taken out before ``main`` sees it) shows the traceback of expected errors
too. This module owns the console of the commands that call it; the library itself never prints.
"""

import sys
import traceback
from collections.abc import Callable

DEBUG_FLAG = "--debug"


class UsageError(ValueError):
    """A command-line mistake: a flag's value, or flags that do not go together (exit status 2)."""


class UserError(RuntimeError):
    """An expected failure that is not about the flags themselves, e.g. a folder that holds another run (status 1)."""


# What a user's input or environment raises, as opposed to a bug: shown as one line. OSError covers missing files,
# permissions and the network (huggingface_hub's and httpx's connection errors derive from it).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, UserError, OSError, ImportError)


def exit_status(err: BaseException) -> int:
    """2 for a usage error, 1 for any other expected error."""
    return 2 if isinstance(err, UsageError) else 1


def one_line(err: BaseException) -> str:
    """``err``'s message after ``error:``."""
    message = str(err).strip() or type(err).__name__
    return f"error: {message}"


def run_command(main: Callable[..., int | None], argv: list[str] | None = None) -> None:
    """Run ``main(argv)`` (``sys.argv[1:]`` by default) and exit with its status, or with one line on an expected
    error (see the module docstring). Never returns."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args
    args = [arg for arg in args if arg != DEBUG_FLAG]
    try:
        status = main(args)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("error: interrupted (Ctrl-C).", file=sys.stderr)
        sys.exit(130)
    except USER_ERRORS as err:
        if debug:
            traceback.print_exc()
        print(one_line(err), file=sys.stderr)
        sys.exit(exit_status(err))
    sys.exit(status or 0)
