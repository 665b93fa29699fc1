"""Stopping a run without losing it: a signal or Ctrl-C saves where the run stands, and checkpoints on a clock.

    with StopControl(cfg.stop_signals, cfg.checkpointing_minutes, accelerator.num_processes) as control:
        while ...:
            ...one optimizer step...
            stop, on_clock = control.poll(step)   # the same answer on every process
            if stop or on_clock: save a checkpoint (control.saved()); if stop: raise control.stopped(...)

A signal of ``stop_signals`` (SIGTERM, SIGUSR1 and SIGINT by default) only sets a flag: the step in flight finishes,
the processes agree on a step to stop at, the loop saves a complete checkpoint there (``save_checkpoint``, atomic as
ever) and ends the program with ``STOPPED_EXIT_STATUS``. A second SIGINT (Ctrl-C twice) raises KeyboardInterrupt at
once, as Python does by default; a checkpoint being written then is removed, never left half-written.

The processes agree without touching the accelerator: every process puts its flags (stop requested, clock due) in a
tiny CPU tensor reduced (its maximum) over a gloo process group (the default group on CPUs, a gloo group of its own
next to NCCL). One process does not wait for the others at every step: they exchange at the steps the last exchange chose, about
``AGREE_EVERY_S`` seconds of training apart (the shortest interval any process proposed), so a signal that reaches one
process only (a worker killed by hand) or every process (``torchrun`` forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT
from the launcher to each worker) stops all of them at the same step. A single process decides at every step.
"""

import logging
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The exit status of a run that stopped at a signal after saving: EX_TEMPFAIL of sysexits.h ("a temporary failure:
# try again later"), neither success (0), nor a failure (1, or 2 for a usage error), nor death by a signal (128 + N).
STOPPED_EXIT_STATUS = 75
# Signals a run can stop at: the ones job schedulers and terminals send to ask a program to end (SIGKILL and SIGSTOP
# cannot be caught).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
AGREE_EVERY_S = 1.0  # the wall time between two exchanges of several processes (at most MAX_AGREE_STEPS steps)
MAX_AGREE_STEPS = 1000


def platform_signals() -> set[str]:
    """The names of the signals this platform has (e.g. Windows has no SIGUSR1 or SIGHUP)."""
    return {sig.name for sig in signal.valid_signals() if isinstance(sig, signal.Signals)}


def default_stop_signals(available: set[str] | None = None) -> str:
    """SIGTERM (schedulers, ``kill``), SIGUSR1 (SLURM's usual early warning) where the platform (``available``,
    default this one) has it, which Windows does not, and SIGINT (Ctrl-C)."""
    available = platform_signals() if available is None else available
    return ",".join(name for name in ("SIGTERM", "SIGUSR1", "SIGINT") if name in available)


DEFAULT_STOP_SIGNALS = default_stop_signals()  # TrainConfig.stop_signals' default


def parse_stop_signals(spec: str | None, available: set[str] | None = None) -> tuple[str, ...]:
    """``"SIGTERM,usr1"`` -> ``("SIGTERM", "SIGUSR1")``; ``None`` or ``"none"`` -> ``()``. A ValueError for a name that
    is not one of ``STOP_SIGNALS``, or that ``available`` (default: this platform's signals) lacks."""
    if spec is None or spec.strip().lower() in ("", "none"):
        return ()
    available = platform_signals() if available is None else available
    names = []
    for item in spec.split(","):
        name = item.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in STOP_SIGNALS:
            raise ValueError(
                f"stop_signals: {item.strip()!r} is not a signal a run can stop at; choose from "
                f"{', '.join(STOP_SIGNALS)} (comma-separated), or none."
            )
        if name not in available:
            raise ValueError(
                f"stop_signals: {name} does not exist on this platform ({sys.platform}), which has "
                f"{', '.join(s for s in STOP_SIGNALS if s in available)} of those a run can stop at. "
                f"Leave {name} out of --stop_signals."
            )
        if name not in names:
            names.append(name)
    return tuple(names)


def agreement_group(num_processes: int):
    """The process group the flags are exchanged over: None for one process; the default group when it is gloo
    already (CPUs); else a new gloo group (every process must call this, once, at the same point)."""
    if num_processes == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD if "gloo" in dist.get_backend() else dist.new_group(backend="gloo")


class RunStopped(SystemExit):
    """The run stopped at a signal after saving ``checkpoint``: the program ends with ``STOPPED_EXIT_STATUS``
    (a SystemExit, so whoever called ``train`` exits with that status unless it catches this)."""

    def __init__(self, checkpoint, step: int, reason: str):
        super().__init__(STOPPED_EXIT_STATUS)
        self.checkpoint, self.step, self.reason = checkpoint, step, reason


class StopControl:
    """The signal handlers and the clock of one run, and the decision the processes agree on (module docstring).

    Args:
        stop_signals: ``TrainConfig.stop_signals`` (checked there); none: no handler is installed.
        checkpointing_minutes: also save every this many minutes of wall time (None: never on the clock).
        num_processes: the run's processes; with more than one, the flags are reduced over ``agreement_group``.
    """

    def __init__(self, stop_signals: str | None, checkpointing_minutes: float | None, num_processes: int):
        self.signals = [getattr(signal, name) for name in parse_stop_signals(stop_signals)]
        self.period_s = None if checkpointing_minutes is None else checkpointing_minutes * 60.0
        self.group = agreement_group(num_processes)
        self.received: str | None = None  # the first stop signal's name
        self.previous: dict = {}
        self.last_save = time.monotonic()
        self.next_check, self.checked_at, self.checked_time = 0, None, None

    def __enter__(self) -> "StopControl":
        if self.signals and threading.current_thread() is not threading.main_thread():
            logger.warning("train() runs outside the main thread: signals cannot be handled, a signal ends the run.")
            return self
        for sig in self.signals:
            self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def handle(self, signum, frame) -> None:
        """Remember the first stop signal (nothing else: the loop acts between steps). After it, Ctrl-C is Python's
        own again: a second one raises KeyboardInterrupt at once."""
        if self.received is None:
            self.received = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def saved(self) -> None:
        """A checkpoint was just written: the clock starts again."""
        self.last_save = time.monotonic()

    def poll(self, step: int) -> tuple[bool, bool]:
        """After optimizer step ``step``: (stop now, save on the clock now), the same on every process."""
        stop = self.received is not None
        on_clock = self.period_s is not None and time.monotonic() - self.last_save >= self.period_s
        if self.group is None:
            return stop, on_clock
        if step < self.next_check:
            return False, False
        now = time.monotonic()
        interval = 1
        if self.checked_at is not None and step > self.checked_at:
            step_s = (now - self.checked_time) / (step - self.checked_at)
            interval = int(min(MAX_AGREE_STEPS, max(1, AGREE_EVERY_S / max(step_s, 1e-9))))
        # the maximum: any process's flag counts, and the interval is the shortest proposed (its negation's maximum)
        flags = torch.tensor([int(stop), int(on_clock), -interval], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        self.checked_at, self.checked_time = step, time.monotonic()
        self.next_check = step - int(flags[2])
        if flags[0] and self.received is None:
            self.received = "a stop signal to another process"
        return bool(flags[0]), bool(flags[1])

    def stopped(self, checkpoint, step: int, log: bool = True) -> RunStopped:
        """The SystemExit to raise, after the one line a stopped run ends with (``log``: on the main process)."""
        reason = self.received or "a stop signal"
        if log:
            logger.warning(
                f"Stopped at step {step} on {reason}: saved the checkpoint {checkpoint}. Resume with the same "
                f"command and --resume_from_checkpoint latest. Exiting with status {STOPPED_EXIT_STATUS} (stopped "
                "and saved)."
            )
        return RunStopped(checkpoint, step, reason)
