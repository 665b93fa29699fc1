"""How the scripts in ``training/`` run as programs (``python training/pretrain.py ...``), in one place.

    from training.program import prepare_imports, run_program  # first

    prepare_imports(__name__)
    import torch  # ... the heavy imports
    ...
    if __name__ == "__main__":
        run_program(main)

Python's cyclic garbage collector makes full passes over every live object while torch, transformers,
Accelerate and datasets import (several passes over about half a million objects), and once more when the
interpreter exits. A short script pays both on top of its own work; the objects involved live until the end
anyway, so nothing is collected by those passes. As a program, a script therefore imports with the
collector off, runs ``main`` with it on, and freezes it before exiting.

While the libraries import, the warnings that an optional package transformers brings in logs about itself stay
off the console (``QUIET_WHILE_IMPORTING``): with the ``dev`` extra installed, transformers' quantizer registry
imports torchao, which says it failed to load its CUDA kernels on a CPU build of torch and trips a deprecation in
torch's pytree registry; neither concerns a training script. Their loggers get their levels back before ``main``
runs. Imported as a module (tests, notebooks), a script changes nothing.

A user's mistake ends the program with one ``error: ...`` line (``decoderlab.cli.run_command``): exit status 2 for
a flag's value or flags that do not go together (``UsageError``), 1 for other expected errors (a missing file, a
folder holding another run, bad data); ``--debug`` anywhere on the command line shows the traceback too. Launched
as several processes (torchrun, ``accelerate launch``), only the first (``RANK`` 0) prints that line; the others
exit with the same status in silence.

Launched as several processes, a script also ends without the interpreter's shutdown: it runs the exit handlers
(``atexit``: logging's flush, the libraries' own), flushes its output and leaves with ``os._exit`` and its status.
The process group outlives ``destroy_process_group`` (``Accelerator.end_training``): FSDP2's device mesh keeps the
group, and torch's DTensor caches keep the mesh, so gloo's worker threads (``pt_gloo_runloop``) are still running
when the interpreter tears down. A finished run then now and then aborts there ("terminate called without an active
exception", SIGABRT, after its work is saved), and torchrun reports it failed: 1 of about 190 resumed FSDP launches
looped on 2 cores, and once in CI. The cause torch's pull request 179291 gives for that abort: a gloo worker that
needs the GIL while the interpreter shuts down.
"""

import atexit
import gc
import logging
import os
import sys
from collections.abc import Callable

# Loggers whose warnings at import time are about optional packages, not about the run
QUIET_WHILE_IMPORTING = ("torchao", "torch.utils._pytree")
_levels_before: dict[str, int] = {}


def prepare_imports(module_name: str) -> None:
    """If ``module_name`` (the caller's ``__name__``) is ``"__main__"``: switch the cyclic collector off and quiet
    ``QUIET_WHILE_IMPORTING`` until ``run_program``. Call it before the heavy imports."""
    if module_name != "__main__":
        return
    gc.disable()
    for name in QUIET_WHILE_IMPORTING:
        logger = logging.getLogger(name)
        _levels_before.setdefault(name, logger.level)
        logger.setLevel(logging.ERROR)


def run_program(main: Callable[[list[str]], object]) -> None:
    """Give the quieted loggers their levels back, run ``main(argv)`` with the collector on under
    ``decoderlab.cli.run_command`` (one line for a user's mistake), then freeze what is left so the exit does not
    walk it again. Exits with ``main``'s status (an int it returns, else 0); never returns."""
    from decoderlab.cli import USER_ERRORS, exit_status, run_command  # after prepare_imports: decoderlab imports torch
    from training.hardware import launched_processes

    while _levels_before:
        name, level = _levels_before.popitem()
        logging.getLogger(name).setLevel(level)
    gc.enable()
    first_process = int(os.environ.get("RANK", "0")) == 0  # torchrun and accelerate launch set RANK per process

    def program(argv: list[str]) -> int | None:
        try:
            status = main(argv)
        except USER_ERRORS as err:
            if first_process:
                raise
            raise SystemExit(exit_status(err)) from None  # the first process says it once
        finally:  # a run that stopped at a signal (training.preemption.RunStopped) exits as quickly
            gc.freeze()
        return status if isinstance(status, int) and not isinstance(status, bool) else None

    try:
        run_command(program)
    except SystemExit as done:
        if launched_processes() > 1:
            leave(done.code)
        raise


def leave(code: object) -> None:
    """End the process with ``code`` (``SystemExit``'s: None is 0, an int itself, anything else printed and 1) after
    the exit handlers, skipping the interpreter's shutdown (the module docstring says why). Never returns."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()  # what a normal exit runs first, while every module is still there
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(status)
