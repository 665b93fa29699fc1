"""Preemption without loss (training/preemption.py): a signal or Ctrl-C saves where the run stands and exits with
status 75; checkpoints on a clock; every process of a torchrun launch agrees on the step; a torn save is never
resumed from; bad settings stop before any step.

Real processes and real signals: each interrupted run is a subprocess, signalled once its own output shows it is
training (a metrics record or a checkpoint folder), never after a fixed sleep, so the tests hold on a loaded machine.
The runs log every step (``--logging_steps 1``), so an interrupted and resumed run's metrics.jsonl can be compared
record by record with an uninterrupted run's.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.paths import REPO_ROOT
from tests.test_finetune import base_checkpoint, corpus, finetune_argv, speech_data  # noqa: F401 (fixtures)
from tests.training_runs import folder_snapshot, metrics, subprocess_env, text_files_in
from training import finetune, pretrain
from training.args import TrainConfig
from training.checkpointing import STATE_NAME, list_checkpoints, resolve_checkpoint
from training.preemption import STOPPED_EXIT_STATUS, default_stop_signals, parse_stop_signals

PRETRAIN = REPO_ROOT / "training" / "pretrain.py"
FINETUNE = REPO_ROOT / "training" / "finetune.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
# the signals Python has on Windows (the signal module's documentation): no SIGUSR1, SIGUSR2 or SIGHUP
WINDOWS_SIGNALS = {"SIGABRT", "SIGBREAK", "SIGFPE", "SIGILL", "SIGINT", "SIGSEGV", "SIGTERM"}
COMPARED = ("step", "tokens", "train_loss", "lr", "eval_loss")  # a record's fields that do not depend on timing

pytestmark = pytest.mark.usefixtures("one_thread")  # here and in the subprocesses: the same arithmetic


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    return text_files_in(tmp_path_factory.mktemp("text"), 60_000)


def run_argv(text_files, output_dir, *extra: str, hidden: int = 32) -> list[str]:
    """A pretraining run of a tiny model that logs every step."""
    train_file, validation_file = text_files
    return [
        "--dataset_name", "none", "--train_file", str(train_file), "--validation_file", str(validation_file),
        "--block_size", "32", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "64",
        "--learning_rate", "3e-3", "--num_warmup_steps", "5", "--logging_steps", "1", "--eval_steps", "none",
        "--max_eval_samples", "32", "--checkpoints_total_limit", "50", "--seed", "0", "--output_dir", str(output_dir),
        "--model.hidden_size", str(hidden), "--model.num_hidden_layers", "2", "--model.num_attention_heads", "2",
        *extra,
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Running, watching and signalling a subprocess


class Run:
    """A training command in a subprocess, its output in a file (a pipe nobody reads could fill and block it)."""

    def __init__(self, command: list[str], log: pathlib.Path):
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(command, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT)
        self.signalled_at = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_until(self, condition, what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.process.poll() is None, f"the run ended before {what}:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"not {what} within {timeout} s:\n{self.output()[-4000:]}"
            time.sleep(0.01)

    def kill(self, sig: signal.Signals, pid: int | None = None) -> None:
        os.kill(self.process.pid if pid is None else pid, sig)
        self.signalled_at = self.signalled_at or time.monotonic()

    def finish(self, timeout: float = 120) -> tuple[int, float]:
        """The exit status and the seconds from the first signal to the exit."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"still running {timeout} s after the signal:\n{self.output()[-4000:]}") from None
        return self.process.returncode, time.monotonic() - (self.signalled_at or time.monotonic())

    def workers(self) -> dict[int, int]:
        """A torchrun launcher's workers: rank -> pid (read from /proc)."""
        children = pathlib.Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        ranks = {}
        for pid in map(int, children):
            environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            variables = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
            ranks[int(variables["RANK"])] = pid
        return ranks


def last_step(output_dir: pathlib.Path) -> int:
    """The last training step in metrics.jsonl (its complete lines), 0 before any."""
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().split("\n")[:-1] if line]
    return max((json.loads(line)["step"] for line in lines if "train_loss" in line), default=0)


def state_of(checkpoint: pathlib.Path) -> dict:
    return json.loads((checkpoint / STATE_NAME).read_text())


def comparable(output_dir: pathlib.Path) -> list[tuple]:
    return [tuple(record.get(key) for key in COMPARED) for record in metrics(output_dir)]


def assert_same_run(got: pathlib.Path, expected: pathlib.Path) -> None:
    """Every metrics record (timing fields aside) and the final model's logits are those of the uninterrupted run.
    Exact up to 1e-6: the checkpoint restores weights, AdamW's moments, schedule, RNG and data position, and fp32 on
    one thread repeats the same operations (as the SIGKILL resume tests in test_pretrain_training.py)."""
    expected_records, got_records = comparable(expected), comparable(got)
    assert [r[0] for r in got_records] == [r[0] for r in expected_records]  # every step once, none lost or repeated
    for mine, theirs in zip(got_records, expected_records):
        assert mine == pytest.approx(theirs, abs=1e-6), mine[0]
    input_ids = torch.randint(0, 60, (2, 24))
    with torch.no_grad():
        logits = [
            AutoModelForCausalLM.from_pretrained(folder)(input_ids=input_ids).logits for folder in (got, expected)
        ]
    torch.testing.assert_close(*logits, rtol=0, atol=1e-6)


def assert_stopped_and_saved(run: Run, output_dir: pathlib.Path, status: int | None = STOPPED_EXIT_STATUS) -> int:
    """The run exited with ``status`` (None: any, for torchrun's launcher) after one log line naming its complete
    checkpoint, the newest, and how to resume; no half-written folder is left. Returns the step it stopped at."""
    code, seconds = run.finish()
    output = run.output()
    if status is not None:
        assert code == status, output[-4000:]
    assert seconds < 60, f"{seconds:.1f} s from the signal to the exit"
    stops = [line for line in output.splitlines() if "Stopped at step" in line]
    assert len(stops) == 1, output[-4000:]
    newest = list_checkpoints(output_dir)[-1]
    assert f"saved the checkpoint {newest}" in stops[0] and "--resume_from_checkpoint latest" in stops[0]
    assert f"status {STOPPED_EXIT_STATUS}" in stops[0]
    assert not list(output_dir.glob("*.tmp")) and not (output_dir / "config.json").exists()  # no final folder
    step = state_of(newest)["step"]
    assert newest.name == f"step_{step}" and f"Stopped at step {step} " in stops[0]
    return step


# ----------------------------------------------------------------------------------------------
# Bad input


def test_bad_stop_settings_are_refused_before_any_step(tmp_path, text_files):
    """--checkpointing_minutes zero or negative, a signal name that is not a stop signal (or cannot be caught), and a
    signal the platform lacks (SIGUSR1 on Windows, checked against Windows' signal set): a ValueError naming the
    value, raised while the flags are read, so nothing is written."""
    out = tmp_path / "out"
    for flags, message in [
        (["--checkpointing_minutes", "0"], "checkpointing_minutes must be a positive number of minutes, got 0.0"),
        (["--checkpointing_minutes", "-5"], "checkpointing_minutes must be a positive number of minutes, got -5.0"),
        (["--stop_signals", "SIGTERM,SIGFOO"], "'SIGFOO' is not a signal a run can stop at; choose from SIGTERM"),
        (["--stop_signals", "KILL"], "'KILL' is not a signal a run can stop at"),
    ]:
        with pytest.raises(ValueError, match=message):
            pretrain.main(run_argv(text_files, out, "--max_train_steps", "5", *flags))
        assert not out.exists()
    with pytest.raises(ValueError, match=r"SIGUSR1 does not exist on this platform .* has SIGTERM, SIGINT of those"):
        parse_stop_signals("SIGTERM,SIGUSR1", available=WINDOWS_SIGNALS)
    assert parse_stop_signals("term, usr1,SIGINT,sigterm") == ("SIGTERM", "SIGUSR1", "SIGINT")
    # the default is what the platform has: no error on Windows, where SIGUSR1 is left out
    assert TrainConfig().stop_signals == "SIGTERM,SIGUSR1,SIGINT"
    assert parse_stop_signals(default_stop_signals(WINDOWS_SIGNALS), WINDOWS_SIGNALS) == ("SIGTERM", "SIGINT")
    assert parse_stop_signals("none") == () and TrainConfig(stop_signals="none").stop_signals is None


# ----------------------------------------------------------------------------------------------
# One process


@pytest.mark.slow
def test_sigterm_between_checkpoints_saves_there_and_resumes_exactly(tmp_path, text_files):
    """SIGTERM after the checkpoint at step 150 of 300: the run finishes its step, saves step_S (150 < S < 300),
    logs one line saying so and how to resume, and exits with 75; resumed with --resume_from_checkpoint latest, it
    ends exactly where an uninterrupted run ends (every metrics record, the final logits)."""
    steps = ["--max_train_steps", "300", "--checkpointing_steps", "150"]
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    pretrain.main(run_argv(text_files, reference, *steps))

    run = Run([sys.executable, str(PRETRAIN), *run_argv(text_files, interrupted, *steps)], tmp_path / "run.log")
    run.wait_until(lambda: (interrupted / "step_150").is_dir(), "step_150 was saved")
    run.kill(signal.SIGTERM)
    stopped = assert_stopped_and_saved(run, interrupted)
    assert 150 < stopped < 300 and "on SIGTERM" in run.output()
    assert [p.name for p in list_checkpoints(interrupted)] == ["step_150", f"step_{stopped}"]

    pretrain.main(run_argv(text_files, interrupted, *steps, "--resume_from_checkpoint", "latest"))
    assert_same_run(interrupted, reference)


@pytest.mark.slow
def test_ctrl_c_twice_exits_at_once_without_a_partial_folder_and_sigkill_in_a_save_keeps_the_last(tmp_path, text_files):
    """Ctrl-C twice: the first SIGINT starts the save at the next step; the second, sent once the save's step_N.tmp
    exists, stops the process at once (KeyboardInterrupt), and the half-written folder is removed. SIGKILL during a
    save (after a SIGTERM) leaves step_N.tmp, which is never resumed from: the previous checkpoint is intact and is
    the one --resume_from_checkpoint latest resolves to. A 512-wide model makes a save long enough to hit."""
    wide = dict(hidden=512)
    twice = tmp_path / "twice"
    run = Run([sys.executable, str(PRETRAIN), *run_argv(text_files, twice, "--max_train_steps", "2000",
                                                       "--checkpointing_steps", "none", **wide)], tmp_path / "twice.log")  # fmt: skip
    run.wait_until(lambda: last_step(twice) >= 2, "training started")
    run.kill(signal.SIGINT)
    run.wait_until(lambda: list(twice.glob("step_*.tmp")), "the save started")
    run.kill(signal.SIGINT)
    code, seconds = run.finish()
    # the KeyboardInterrupt ends the program through decoderlab.cli's run_command: status 130 and its one line; never
    # 0 or 75, which would claim a finished or saved run
    assert code == 128 + signal.SIGINT, run.output()[-3000:]
    assert "error: interrupted (Ctrl-C)." in run.output() and "Stopped at step" not in run.output()
    assert seconds < 30 and not list(twice.glob("step_*")), sorted(p.name for p in twice.iterdir())

    killed = tmp_path / "killed"
    steps = ["--max_train_steps", "2000", "--checkpointing_steps", "3"]
    run = Run([sys.executable, str(PRETRAIN), *run_argv(text_files, killed, *steps, **wide)], tmp_path / "killed.log")
    run.wait_until(lambda: (killed / "step_3").is_dir(), "step_3 was saved")
    run.kill(signal.SIGTERM)
    before = folder_snapshot(killed / "step_3")
    run.wait_until(lambda: [p for p in killed.glob("step_*.tmp") if p.name != "step_3.tmp"], "the stop's save started")
    run.kill(signal.SIGKILL)
    assert run.finish()[0] == -signal.SIGKILL
    assert list(killed.glob("step_*.tmp")), "the kill came after the save"
    latest = list_checkpoints(killed)[-1]
    assert resolve_checkpoint("latest", killed) == latest and state_of(latest)["step"] % 3 == 0  # a periodic one
    assert folder_snapshot(killed / "step_3") == before


@pytest.mark.slow
def test_checkpointing_minutes_saves_on_the_clock(tmp_path, text_files):
    """--checkpointing_minutes 0.01 (0.6 s) in a run whose step checkpoints would come only at its end: checkpoints
    at steps before the end, each at least 0.6 s of wall time after the previous one (``elapsed_s`` of its
    training_state.json), and the end's."""
    out = tmp_path / "out"
    pretrain.main(run_argv(text_files, out, "--max_train_steps", "400", "--checkpointing_steps", "1000",
                           "--checkpointing_minutes", "0.01"))  # fmt: skip
    saved = [state_of(p) for p in list_checkpoints(out)]
    on_clock = [s for s in saved if s["step"] < 400]
    assert on_clock, f"no checkpoint on the clock: {[s['step'] for s in saved]}"
    assert saved[-1]["step"] == 400
    elapsed = [0.0] + [s["elapsed_s"] for s in on_clock]
    # 0.59: the clock starts a moment (the progress bar's creation) before the run's elapsed time does
    assert all(later - earlier >= 0.59 for earlier, later in zip(elapsed, elapsed[1:])), elapsed


# ----------------------------------------------------------------------------------------------
# Two processes (torchrun)


@pytest.mark.slow
def test_torchrun_stops_every_process_at_one_step_whoever_got_the_signal(tmp_path, text_files):
    """Two torchrun processes: SIGTERM to the launcher (which forwards it to both workers), then, resumed, to the
    second worker only (the first learns it from the flags exchanged over gloo), then to both workers: each time
    one consistent checkpoint (the step in training_state.json, both processes' data positions), saved by both
    processes at the same step, and the exit within 60 s; every launch also saves on the clock
    (--checkpointing_minutes), which both processes must agree on too. Resumed a last time to the end, the run
    equals an uninterrupted two-process run (every record, the logits). The launcher itself exits with 1 whenever
    it or a worker ended otherwise than with 0 (torch.distributed.elastic), whatever the workers' status (75)."""
    # long enough that no launch reaches the end before its signal on an idle machine (about 100 steps/s there)
    steps = ["--max_train_steps", "1000", "--checkpointing_steps", "none", "--checkpointing_minutes", "0.02"]
    reference, out = tmp_path / "reference", tmp_path / "out"
    done = subprocess.run([*TORCHRUN, str(PRETRAIN), *run_argv(text_files, reference, *steps)], env=subprocess_env(),
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    stopped = 0
    for case in ("launcher", "one worker", "both workers"):
        resume = ["--resume_from_checkpoint", "latest"] if stopped else []
        run = Run([*TORCHRUN, str(PRETRAIN), *run_argv(text_files, out, *steps, *resume)], tmp_path / f"{case}.log")
        run.wait_until(lambda start=stopped: last_step(out) >= start + 3, f"{case}: training resumed")
        workers = run.workers()
        assert sorted(workers) == [0, 1]
        if case == "launcher":
            run.kill(signal.SIGTERM)
        for rank in {"launcher": [], "one worker": [1], "both workers": [0, 1]}[case]:
            run.kill(signal.SIGTERM, workers[rank])
        step = assert_stopped_and_saved(run, out, status=None)
        assert run.process.returncode == 1, case
        assert step > stopped, case
        assert sorted(p.name for p in (out / f"step_{step}").glob("data_state_*.json")) == [
            "data_state_0.json", "data_state_1.json"]  # fmt: skip
        reason = "a stop signal to another process" if case == "one worker" else "SIGTERM"
        assert f"Stopped at step {step} on {reason}" in run.output(), case
        stopped = step
    assert stopped < 1000, "the last stop came after the end"
    done = subprocess.run([*TORCHRUN, str(PRETRAIN), *run_argv(text_files, out, *steps, "--resume_from_checkpoint",
                           "latest")], env=subprocess_env(), capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(out, reference)


# ----------------------------------------------------------------------------------------------
# Fine-tuning


@pytest.mark.slow
@pytest.mark.parametrize("method, sig", [("full", signal.SIGINT), ("lora", signal.SIGUSR1)], ids=["full", "lora"])
def test_finetuning_stops_saves_and_resumes_the_same_way(tmp_path, base_checkpoint, speech_data, method, sig):  # noqa: F811
    """training/finetune.py, fully (stopped by one Ctrl-C, SIGINT) and with merged LoRA (stopped by SIGUSR1, SLURM's
    usual early signal): saved at the step reached, status 75, and resumed to exactly the uninterrupted run."""
    lora = ["--use_lora", "--lora_target_modules", "q_proj,v_proj", "--merge_lora"] if method == "lora" else []
    steps = ["--max_train_steps", "80", "--checkpointing_steps", "40", "--eval_steps", "none", "--logging_steps", "1",
             *lora]  # fmt: skip
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    finetune.main(finetune_argv(base_checkpoint, speech_data, "prompt_completion", reference, *steps))

    argv = finetune_argv(base_checkpoint, speech_data, "prompt_completion", interrupted, *steps)
    run = Run([sys.executable, str(FINETUNE), *argv], tmp_path / "run.log")
    run.wait_until(lambda: last_step(interrupted) >= 3, "training started")
    run.kill(sig)
    stopped = assert_stopped_and_saved(run, interrupted)
    assert stopped < 80 and f"on {sig.name}" in run.output()
    finetune.main([*argv, "--resume_from_checkpoint", "latest"])
    assert_same_run(interrupted, reference)


# ----------------------------------------------------------------------------------------------
# The benchmark


@pytest.mark.slow
def test_signal_exit_benchmark_times_the_step_the_save_and_the_exit(tmp_path, text_files):
    """benchmarks/signal_exit.py's run on a tiny model: status 75 after a checkpoint, and the three parts it reports
    (step in flight, save, exit) add up to the signal-to-exit time it reports."""
    from benchmarks.signal_exit import one_run

    arguments = run_argv(
        text_files, tmp_path / "unused", "--max_train_steps", "100000", "--checkpointing_steps", "none"
    )
    arguments = arguments[: arguments.index("--output_dir")] + arguments[arguments.index("--output_dir") + 2 :]
    run = one_run(arguments, tmp_path / "run", subprocess_env())
    parts = run["step_in_flight_s"] + run["save_s"] + run["exit_s"]
    assert parts == pytest.approx(run["signal_to_exit_s"], abs=0.01), run
    assert run["save_s"] >= 0 and run["step_s"] > 0 and run["checkpoint_bytes"] > 100_000, run
