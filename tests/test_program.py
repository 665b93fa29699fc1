"""training/program.py: the scripts' collector switches act only when a script runs as a program."""

import gc

import pytest

from training.program import pause_collector_while_importing, run_program


@pytest.fixture
def collector_restored():
    was_enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


def test_imported_as_a_module_the_collector_is_left_alone(collector_restored):
    gc.enable()
    pause_collector_while_importing("training.pretrain")
    assert gc.isenabled()


def test_as_a_program_the_collector_pauses_for_the_imports_runs_main_with_it_on_then_freezes(collector_restored):
    gc.enable()
    pause_collector_while_importing("__main__")
    assert not gc.isenabled()
    seen = []
    run_program(lambda: seen.append(gc.isenabled()))
    assert seen == [True]  # main ran, with the collector on
    assert gc.get_freeze_count() > 0  # what was left is frozen: the exit does not walk it again
