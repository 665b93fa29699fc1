"""Run the ```python blocks of a Markdown page as the docs contract says: top to bottom, in one namespace, in a
fresh working directory, offline, on the CPU.

    ran, skipped = run_page(pathlib.Path("docs/guides/pretraining.md"), tmp_path)

A block preceded by ``<!-- snippet: skip REASON -->`` is not run and is counted in ``skipped``. A block that raises
stops the page with a ``SnippetError`` whose message starts with the file and the line that failed
(``docs/guides/trl.md:57: NameError: ...``); the traceback shows the same line, since each block is compiled under
the page's path at its own line numbers.
"""

import collections
import contextlib
import os
import pathlib
import traceback

from . import REPO_ROOT
from .markdown import fences


class SnippetError(AssertionError):
    """A ```python block of the docs failed; the message names its file and line."""


def shown_path(path: pathlib.Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


@contextlib.contextmanager
def forgetting_accelerate_state():
    """Accelerate keeps one process-wide state (its device, distributed setup and mixed precision) from the first
    ``Accelerator`` on: a page whose Trainer chose bf16 (TRL's configs do on a CPU with bfloat16) would make every
    later ``Accelerator(mixed_precision="no")`` in the same process fail. Each page starts and ends without it, as a
    reader's fresh interpreter would."""

    def forget() -> None:
        try:
            from accelerate.state import AcceleratorState, GradientState
        except ImportError:
            return
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    forget()
    try:
        yield
    finally:
        forget()


def run_page(path: pathlib.Path, workdir: pathlib.Path) -> tuple[int, collections.Counter]:
    """Run every ```python block of ``path`` in ``workdir``; returns (blocks run, Counter of skip reasons)."""
    import torch

    filename = shown_path(path)
    namespace = {"__name__": "__docs__", "__file__": filename}
    ran, skipped = 0, collections.Counter()
    torch.manual_seed(0)
    with contextlib.chdir(workdir), forgetting_accelerate_state():
        for fence in fences(path):
            if fence.lang != "python":
                continue
            if fence.skip:
                skipped[fence.skip] += 1
                continue
            code = compile("\n" * fence.line + fence.code, filename, "exec")  # line numbers are the page's
            try:
                exec(code, namespace)  # noqa: S102 (the docs' own examples)
            except Exception as err:
                line = next(
                    (f.lineno for f in reversed(traceback.extract_tb(err.__traceback__)) if f.filename == filename),
                    fence.line,
                )
                raise SnippetError(
                    f"{filename}:{line}: {type(err).__name__}: {err} (in the ```python block that starts at line "
                    f"{fence.line}; blocks run in {os.fspath(workdir)})"
                ) from err
            ran += 1
    return ran, skipped
