"""The SLURM job script (training/slurm/pretrain.sbatch) on a real SLURM cluster of one node, started by the test:
Debian's slurm-wlm (slurmctld, slurmd, sbatch, scontrol, scancel) and munge, each daemon on its own socket, port and
folders under the test's temporary folder. `.ci/run` installs slurm-wlm as it installs chromium; elsewhere:
`apt-get install -y slurm-wlm` (as root: slurmd starts the job as the user who submitted it).

The near-limit signal is the one ``#SBATCH --signal=B:USR1@300`` asks for, sent by SLURM to the batch script; the
test sends it with ``scancel --batch --signal=USR1`` once the training is under way, instead of waiting for a time
limit (SLURM looks at time limits about every 30 s, so a limit cannot say when the signal arrives). From there on
everything is SLURM's and the script's: the trap, ``scancel --signal`` to the job step, srun, torchrun and its
two workers, the save, ``scontrol requeue``, the requeued job's start and its resume from ``latest``.
"""

import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.paths import REPO_ROOT
from tests.test_preemption import TORCHRUN, assert_same_run, last_step, run_argv
from tests.training_runs import subprocess_env, text_files_in

SCRIPT = REPO_ROOT / "training" / "slurm" / "pretrain.sbatch"
CONFIG = "training/configs/shakespeare_char.yaml"
REQUEUE_DELAY_S = 5  # AuthInfo cred_expire: how long a requeued job waits before it may start again (120 s by default)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def program(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    assert found, f"{name} is not installed: this test needs Debian's slurm-wlm (apt-get install -y slurm-wlm)"
    return found


class Cluster:
    """slurmctld and slurmd on this machine, and a munged of their own; ``run`` runs a SLURM command against them."""

    def __init__(self, folder: pathlib.Path):
        assert os.geteuid() == 0, "slurmd starts jobs as their users: this test runs as root (as CI does)"
        self.folder = folder
        for sub in ("state", "spool"):
            (folder / sub).mkdir()
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        folder.chmod(0o700)
        munge_socket = folder / "munge.socket"
        host = socket.gethostname().split(".")[0]  # addressed as 127.0.0.1: no name lookup needed
        self.conf = folder / "slurm.conf"
        self.conf.write_text(
            "\n".join([
                "ClusterName=decoderlab-test", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
                "AuthType=auth/munge", "CredType=cred/munge",
                f"AuthInfo=socket={munge_socket},cred_expire={REQUEUE_DELAY_S}",
                f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool'}",
                f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd.pid'}",
                f"SlurmctldLogFile={folder / 'slurmctld.log'}", f"SlurmdLogFile={folder / 'slurmd.log'}",
                f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
                "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
                "SelectType=select/cons_tres", "SchedulerType=sched/backfill",
                "SchedulerParameters=sched_interval=2,bf_interval=1", "ReturnToService=2", "MpiDefault=none",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
                f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            ]) + "\n"
        )  # fmt: skip
        self.env = {**subprocess_env(), "SLURM_CONF": str(self.conf)}
        self.daemons = []
        self.start([program("munged"), f"--socket={munge_socket}", f"--key-file={key}", "--force",
                    f"--pid-file={folder / 'munged.pid'}", f"--log-file={folder / 'munged.log'}",
                    f"--seed-file={folder / 'munged.seed'}"], folder / "munged.pid")  # fmt: skip
        self.start([program("slurmctld"), "-f", str(self.conf)], folder / "slurmctld.pid")
        self.start([program("slurmd"), "-f", str(self.conf), "-N", host], folder / "slurmd.pid")
        self.wait_for(lambda: " idle" in self.run("sinfo", "--noheader", "--format=%N %t"), "the node idle", 60)

    def start(self, command: list[str], pid_file: pathlib.Path) -> None:
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{command[0]}: {done.stderr}\n{self.logs()}"
        self.wait_for(pid_file.is_file, f"{pid_file.name}", 30)
        self.daemons.append(int(pid_file.read_text()))

    def run(self, *command: str) -> str:
        done = subprocess.run([program(command[0]), *command[1:]], env=self.env, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, f"{' '.join(command)}: {done.stderr}\n{self.logs()}"
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (while SLURM keeps the job: MinJobAge, 300 s after it ends)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "show", "job", job_id)))

    def wait_for(self, condition, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"not {what} within {timeout} s\n{self.logs()}"
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in self.folder.glob("*.log"))

    def stop(self) -> None:
        for pid in reversed(self.daemons):
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def test_the_guide_shows_the_script_as_committed():
    """docs/guides/multi-node.md shows training/slurm/pretrain.sbatch whole, so what a reader copies is what runs
    here."""
    guide = (REPO_ROOT / "docs" / "guides" / "multi-node.md").read_text()
    assert f"```bash\n{SCRIPT.read_text()}```\n" in guide


def test_the_script_run_outside_slurm_says_to_submit_it():
    """Run with bash instead of sbatch (no SLURM_JOB_ID), the script stops at once with one line saying how to
    submit it, instead of failing on a missing srun or scontrol."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"error: this is a SLURM job script: submit it with sbatch {SCRIPT} [pretrain.py flags ...]\n"


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_the_job_script_saves_before_the_limit_requeues_itself_and_resumes_exactly(tmp_path, cluster):
    """The documented job script, submitted with sbatch (one node, two torchrun processes on the CPU instead of the
    script's 2 x 8 GPUs), gets SLURM's near-limit signal while it trains: both processes stop at one step and save,
    the script requeues the job, SLURM starts it again and it resumes from that checkpoint to the end. The job ends
    COMPLETED with exit code 0 after one restart, its log shows both starts, the stop and the requeue, and the run
    equals an uninterrupted two-process torchrun run of the same command (every metrics record, the logits)."""
    text_files = text_files_in(tmp_path, 60_000)
    out, reference = tmp_path / "out", tmp_path / "reference"
    # long enough that the run is still training when the signal arrives (about 100 steps/s on an idle machine); no
    # evaluations, so the recipe's best-model choice is off too
    train = run_argv(text_files, out, "--max_train_steps", "1000", "--checkpointing_steps", "none",
                     "--load_best_model_at_end", "false")  # fmt: skip
    done = subprocess.run(
        [*TORCHRUN, "training/pretrain.py", "--config", CONFIG, *train, "--output_dir", str(reference),
         "--resume_from_checkpoint", "latest", "--checkpointing_minutes", "60"],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    log = tmp_path / "job.log"
    cluster.env.update(CONFIG=CONFIG, OUTPUT_DIR=str(out), PROCESSES_PER_NODE="2", RENDEZVOUS_PORT=str(free_port()),
                       PATH=os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ["PATH"]]))  # fmt: skip
    submitted = cluster.run(
        "sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={min(2, os.cpu_count())}",
        f"--output={log}", f"--chdir={REPO_ROOT}", str(SCRIPT), *train,
    )  # fmt: skip
    job_id = submitted.strip().split(";")[0]

    def job_log() -> str:
        return log.read_text(errors="replace") if log.is_file() else ""

    cluster.wait_for(lambda: last_step(out) >= 3, f"job {job_id} training\n{job_log()[-3000:]}", 240)
    cluster.run("scancel", "--batch", "--signal=USR1", job_id)  # what --signal=B:USR1@300 sends at the limit
    cluster.wait_for(lambda: cluster.job(job_id)["JobState"] == "COMPLETED" or "FAIL" in cluster.job(job_id)["JobState"],
                     f"job {job_id} completed\n{job_log()[-4000:]}", 300)  # fmt: skip

    job, text = cluster.job(job_id), job_log()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), text[-4000:]
    assert f"job {job_id} start 1 on" in text and f"job {job_id} start 2 on" in text, text[-4000:]
    stops = re.findall(r"Stopped at step (\d+) on SIGUSR1: saved the checkpoint (\S+)\.", text)
    assert len(stops) == 1, text[-4000:]  # the main process's line, for both
    ((step, checkpoint),) = stops
    assert 3 <= int(step) < 1000 and checkpoint == str(out / f"step_{step}")
    assert sorted(p.name for p in pathlib.Path(checkpoint).glob("data_state_*.json")) == [
        "data_state_0.json", "data_state_1.json"]  # fmt: skip
    assert text.count("saved and stopped before its time limit: requeued") == 1
    assert f"Resumed from {checkpoint} at step {step}" in text
    assert_same_run(out, reference)
