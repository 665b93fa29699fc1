"""training/program.py: the scripts' collector and import-noise switches act only when a script runs as a program."""

import gc
import logging
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT
from training.program import QUIET_WHILE_IMPORTING, prepare_imports, run_program


@pytest.fixture
def collector_restored():
    was_enabled = gc.isenabled()
    levels = {name: logging.getLogger(name).level for name in QUIET_WHILE_IMPORTING}
    yield
    gc.unfreeze()
    if was_enabled:
        gc.enable()
    else:
        gc.disable()
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_imported_as_a_module_nothing_is_switched(collector_restored):
    gc.enable()
    levels = {name: logging.getLogger(name).level for name in QUIET_WHILE_IMPORTING}
    prepare_imports("training.pretrain")
    assert gc.isenabled()
    assert {name: logging.getLogger(name).level for name in QUIET_WHILE_IMPORTING} == levels


def test_as_a_program_the_collector_pauses_for_the_imports_runs_main_with_it_on_then_freezes(collector_restored):
    gc.enable()
    prepare_imports("__main__")
    assert not gc.isenabled()
    seen = []
    with pytest.raises(SystemExit) as stop:
        run_program(lambda argv: seen.append(gc.isenabled()))
    assert seen == [True] and stop.value.code == 0  # main ran, with the collector on
    assert gc.get_freeze_count() > 0  # what was left is frozen: the exit does not walk it again


def test_as_a_program_the_import_noise_is_quiet_until_main_which_sees_the_levels_it_had(collector_restored):
    """The optional packages' loggers are at ERROR while the libraries import; ``main`` runs with the levels they
    had before (here INFO for one, unset for the other), so nothing the run itself logs is hidden."""
    first, second = QUIET_WHILE_IMPORTING
    logging.getLogger(first).setLevel(logging.INFO)
    logging.getLogger(second).setLevel(logging.NOTSET)
    prepare_imports("__main__")
    assert all(logging.getLogger(name).level == logging.ERROR for name in QUIET_WHILE_IMPORTING)
    seen = []
    with pytest.raises(SystemExit):
        run_program(lambda argv: seen.append([logging.getLogger(name).level for name in QUIET_WHILE_IMPORTING]))
    assert seen == [[logging.INFO, logging.NOTSET]]


@pytest.mark.slow
def test_a_script_run_as_a_program_prints_no_import_noise():
    """``python training/generate.py --help`` (imports as the training scripts do) writes nothing to stderr: with
    the dev extra's torchao installed, its 'Failed to load' lines and torch's pytree deprecation would be there."""
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "training" / "generate.py"), "--help"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in result.stdout.lower()
    assert "Failed to load" not in result.stderr and "Enum subclass" not in result.stderr, result.stderr[-2000:]
