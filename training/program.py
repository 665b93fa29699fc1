"""How the scripts in ``training/`` run as programs (``python training/pretrain.py ...``), in one place.

    from training.program import pause_collector_while_importing, run_program  # first

    pause_collector_while_importing(__name__)
    import torch  # ... the heavy imports
    ...
    if __name__ == "__main__":
        run_program(main)

Python's cyclic garbage collector makes full passes over every live object while torch, transformers,
Accelerate and datasets import (several passes over about half a million objects), and once more when the
interpreter exits. A short script pays both on top of its own work; the objects involved live until the end
anyway, so nothing is collected by those passes. As a program, a script therefore imports with the
collector off, runs ``main`` with it on, and freezes it before exiting. Imported as a module (tests,
notebooks), a script changes nothing.
"""

import gc
from collections.abc import Callable


def pause_collector_while_importing(module_name: str) -> None:
    """Switch the cyclic collector off until ``run_program``, if ``module_name`` (the caller's ``__name__``) is
    ``"__main__"``; call it before the heavy imports."""
    if module_name == "__main__":
        gc.disable()


def run_program(main: Callable[[], None]) -> None:
    """Run ``main`` with the collector on, then freeze what is left so the exit does not walk it again."""
    gc.enable()
    main()
    gc.freeze()
