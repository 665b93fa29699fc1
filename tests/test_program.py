"""training/program.py: the scripts' collector and import-noise switches act only when a script runs as a program."""

import gc
import logging
import os
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


# A program as the training scripts are: prepare_imports first, run_program last. Its main trains one FSDP2 step
# over gloo when launched as several processes, tears the group down as Accelerator.end_training does, registers an
# exit handler, prints without a newline and returns the status it is given.
PROGRAM = """
import sys
sys.path.insert(0, {root!r})
from training.program import prepare_imports, run_program
prepare_imports(__name__)
import atexit, os, pathlib
import torch

def main(argv):
    folder, status = pathlib.Path(argv[0]), int(argv[1])
    rank = os.environ.get("RANK", "0")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("MASTER_ADDR"):
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo")
        model = fully_shard(torch.nn.Linear(4, 4))
        model(torch.ones(2, 4)).sum().backward()
        dist.destroy_process_group()
    atexit.register(lambda: (folder / f"exit handler ran on {{rank}}").touch())
    print(f"rank {{rank}} done", end="")
    return status

if __name__ == "__main__":
    run_program(main)
"""


def write_program(folder) -> str:
    path = folder / "program.py"
    path.write_text(PROGRAM.format(root=str(REPO_ROOT)))
    return str(path)


def test_launched_as_several_processes_a_program_leaves_with_its_status_after_the_exit_handlers(tmp_path):
    """With WORLD_SIZE > 1 a program ends by os._exit, past the interpreter's shutdown (where a process group kept
    alive by FSDP2's mesh can abort the process): main's status is the exit status, the exit handlers have run and
    what it printed without a newline is out."""
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_ADDR", None)
    result = subprocess.run([sys.executable, write_program(tmp_path), str(tmp_path), "3"], env=env,
                            capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stdout == "rank 1 done"
    assert (tmp_path / "exit handler ran on 1").exists()


@pytest.mark.slow
def test_an_fsdp_program_under_torchrun_exits_cleanly_on_every_process(tmp_path):
    """Two processes under torchrun, each training one FSDP2 step over gloo and destroying the group: both exit 0,
    both ran their exit handlers and flushed their output."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run([*launcher, write_program(tmp_path), str(tmp_path), "0"], cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 done" in result.stdout and "rank 1 done" in result.stdout
    assert (tmp_path / "exit handler ran on 0").exists() and (tmp_path / "exit handler ran on 1").exists()
