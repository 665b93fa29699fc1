"""The checkpoint round trip across transformers releases, each in its own virtual environment.

    python3 tests/version_matrix/run_matrix.py [--versions 5.12.1,...,5.24.0] [--source DIR] [--jobs 2]

Creates (once) one environment per release under ``.venv-tf/<major.minor>`` (transformers and safetensors only:
decoderlab is never installed there; torch 2.13.0 is installed once, in ``.venv-tf/_torch``, which every
environment reads through a .pth file), then with ``roundtrip.py``:

- saves the checkpoint matrix under every release (each also checks its own cached / uncached / padded
  generations agree);
- checks what the newest release saved under every other release, and re-saves it there;
- checks, under the newest release, what every older release saved and re-saved (and, with ``--same-release``,
  what the newest saved: the same trust_remote_code load, within one release).

Prints a PASS/FAIL table (rows: where the checkpoints were saved; columns: where they were checked) and exits 1
if any cell failed. Checks run from a scratch directory without decoderlab, so only the checkpoints' own code
files are used. Standard library only: it runs with whatever python3 creates the environments.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
ROUNDTRIP = HERE / "roundtrip.py"
TORCH = "torch==2.13.0"  # the tested CPU build; installed first, so transformers' dependency on torch adds nothing
VERSIONS = ("5.12.1", "5.16.1", "5.19.0", "5.22.2", "5.24.0", "5.25.0")  # the newest patch of each minor tested
# transformers 5.25 requires `kernels` (the Hub kernels library) >= 0.19.1, which a package index may not carry yet
# (benchmarks/notes/transformers-versions.md tells when this project's index gained it). Such a release is installed
# without the requirements the index lacks, and when `kernels` is among them its checks run with Hub kernels
# switched off (transformers' USE_HUB_KERNELS=NO), since from 5.25 from_pretrained otherwise refuses to load any
# model without it. decoderlab's model has no layer
# that Hub kernels replace, so the switch changes nothing in what is compared.
OPTIONAL_FOR_THE_ROUND_TRIP = ("kernels",)


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def ensure_torch(venvs: pathlib.Path, python: str) -> pathlib.Path:
    """One installation of torch (and what it needs) that every release's environment shares (``ensure_venv`` puts
    it on their path): torch is most of an environment's size, and the same build for every release."""
    shared = venvs / "_torch"
    marker = shared / ".installed"
    if marker.exists() and marker.read_text().strip() == TORCH:
        return shared
    shutil.rmtree(shared, ignore_errors=True)
    shared.parent.mkdir(parents=True, exist_ok=True)
    log = venvs / "install-torch.log"
    with log.open("w") as out:
        command = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(shared), TORCH]
        if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            raise RuntimeError(f"Installing {TORCH} into {shared} failed; see {log}")
    marker.write_text(TORCH + "\n")
    return shared


def ensure_venv(venvs: pathlib.Path, version: str, python: str, torch_dir: pathlib.Path) -> pathlib.Path:
    """The environment for ``version``, created unless it already holds exactly that release; torch comes from
    ``torch_dir`` (``ensure_torch``), through a .pth file after the environment's own packages."""
    venv = venvs / minor(version)
    marker = venv / ".installed"
    if marker.exists() and marker.read_text().splitlines()[:1] == [version]:
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venvs / f"install-{minor(version)}.log"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    missing: list[str] = []
    with log.open("w") as out:

        def run(command: list[str]) -> bool:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode == 0

        if not run([python, "-m", "venv", str(venv)]):
            raise RuntimeError(f"Creating {venv} failed; see {log}")
        site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        (pathlib.Path(site) / "shared_torch.pth").write_text(str(torch_dir.resolve()) + "\n")
        if not run(pip + [f"transformers=={version}", "safetensors"]):
            missing = install_without_unavailable(pip, version, run)
            if not missing or any(requirement_name(r) not in OPTIONAL_FOR_THE_ROUND_TRIP for r in missing):
                raise RuntimeError(
                    f"Installing transformers=={version} into {venv} failed"
                    + (f" (the package index lacks {', '.join(missing)})" if missing else "")
                    + f"; see {log}"
                )
    marker.write_text("\n".join([version, *missing]) + "\n")
    return venv


def requirement_name(requirement: str) -> str:
    """ "kernels" for "kernels<0.20,>=0.19.1" (a requirement's distribution name, lower case)."""
    return re.match(r"[A-Za-z0-9._-]*", requirement.strip())[0].lower()


def install_without_unavailable(pip: list[str], version: str, run) -> list[str]:
    """transformers ``version`` without its dependencies (``pip``: the environment's ``pip install`` command), then
    each requirement it declares outside its extras, one at a time; returns those the package index cannot satisfy
    (none if transformers itself failed)."""
    if not run(pip + ["--no-deps", f"transformers=={version}"]):
        return []
    listed = subprocess.run(
        [pip[0], "-c", "import importlib.metadata as m, json; print(json.dumps(m.requires('transformers') or []))"],
        capture_output=True,
        text=True,
    )
    requirements = [r for r in json.loads(listed.stdout or "[]") if "extra ==" not in r]
    return [r for r in requirements + ["safetensors"] if not run(pip + [r.split(";")[0].strip()])]


def missing_requirements(venv: pathlib.Path) -> list[str]:
    """The requirements ``ensure_venv`` could not install into ``venv`` (none for a complete environment)."""
    return (venv / ".installed").read_text().splitlines()[1:]


class Task:
    """One roundtrip.py run under one release, started once the tasks it needs have finished."""

    def __init__(self, name: str, venv: pathlib.Path, args: list[str], json_path: pathlib.Path, needs=()):
        self.name, self.venv, self.args, self.json_path, self.needs = name, venv, args, json_path, list(needs)
        self.returncode: int | None = None
        self.seconds = 0.0

    def run(self, workdir: pathlib.Path) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1")
        if any(requirement_name(r) == "kernels" for r in missing_requirements(self.venv)):
            env["USE_HUB_KERNELS"] = "NO"  # from 5.25 loading refuses to run without `kernels` otherwise
        command = [str(self.venv / "bin" / "python"), str(ROUNDTRIP), *self.args, "--json", str(self.json_path)]
        start = time.monotonic()
        with (workdir / "logs" / f"{self.name}.log").open("w") as log:
            # cwd: a directory without decoderlab, so `import decoderlab` fails in the checks
            self.returncode = subprocess.run(
                command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT
            ).returncode
        self.seconds = time.monotonic() - start

    def results(self) -> dict[str, list[str]] | None:
        if not self.json_path.exists():
            return None  # the process died before writing its results: see its log
        return json.loads(self.json_path.read_text())["results"]


def run_all(tasks: list[Task], jobs: int, workdir: pathlib.Path) -> None:
    """Run the tasks, ``jobs`` at a time, each after those it needs."""
    pending, running = list(tasks), []
    while pending or running:
        running = [t for t in running if t.is_alive()]
        done = {task.name for task in tasks if task.returncode is not None}
        for task in [t for t in pending if set(t.needs) <= done][: max(0, jobs - len(running))]:
            pending.remove(task)
            thread = threading.Thread(target=task.run, args=(workdir,))
            thread.start()
            running.append(thread)
        time.sleep(0.2)


def cell(task: Task, root: pathlib.Path | None = None) -> str:
    """PASS n / FAIL failed/n for the checkpoints ``task`` handled (those under ``root`` only, if given)."""
    results = task.results()
    if results is not None and root is not None:
        results = {k: v for k, v in results.items() if pathlib.Path(k).parent == root}
    if not results:
        return "ERROR"  # the process died before writing its results, or handled nothing: see its log
    failed = sum(bool(problems) for problems in results.values())
    return f"FAIL {failed}/{len(results)}" if failed else f"PASS {len(results)}"


def create_environments(versions: list[str], venvs: pathlib.Path, python: str, jobs: int) -> dict[str, pathlib.Path]:
    """``ensure_venv`` for every version, ``jobs`` at a time (each install is mostly waiting on pip)."""
    made: dict[str, pathlib.Path] = {}
    errors: list[str] = []

    try:
        torch_dir = ensure_torch(venvs, python)
    except RuntimeError as err:
        raise SystemExit(str(err)) from None

    def make(version: str) -> None:
        try:
            made[version] = ensure_venv(venvs, version, python, torch_dir)
        except RuntimeError as err:
            errors.append(str(err))

    for i in range(0, len(versions), jobs):
        threads = [threading.Thread(target=make, args=(v,)) for v in versions[i : i + jobs]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise SystemExit("\n".join(errors))
    return made


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def print_failures(failed: list[Task], workdir: pathlib.Path) -> None:
    for task in failed:
        log = workdir / "logs" / f"{task.name}.log"
        print(f"\n--- {task.name} (exit {task.returncode}): {log}")
        lines, problems, in_failure = log.read_text().splitlines(), [], False
        for line in lines:  # each "FAIL name" line and the indented lines that explain it
            in_failure = line.startswith("FAIL ") or (in_failure and line.startswith("       "))
            problems += [line] if in_failure else []
        print("\n".join(problems[:40] or lines[-15:]))  # no FAIL lines: the process died, show how


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default=",".join(VERSIONS), help="comma-separated; the newest is the reference")
    parser.add_argument("--venvs", type=pathlib.Path, default=REPO_ROOT / ".venv-tf", help="the environments' home")
    parser.add_argument("--source", type=pathlib.Path, default=REPO_ROOT, help="the directory holding decoderlab/")
    parser.add_argument(
        "--workdir", type=pathlib.Path, help="keep checkpoints and logs here (default: a temporary one)"
    )
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time")
    parser.add_argument("--python", default=sys.executable, help="interpreter the environments are created from")
    parser.add_argument("--same-release", action="store_true", help="also check the newest's checkpoints under itself")
    args = parser.parse_args()

    versions = sorted(args.versions.split(","), key=lambda v: tuple(int(p) for p in v.split(".")))
    newest, older = versions[-1], versions[:-1]
    started = time.monotonic()
    venvs = create_environments(versions, args.venvs, args.python, args.jobs)
    venv_seconds = time.monotonic() - started

    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="version_matrix_"))
    for sub in ("saved", "resaved", "json", "logs"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
        (workdir / sub).mkdir(parents=True)
    saved = {v: workdir / "saved" / minor(v) for v in versions}
    resaved = {v: workdir / "resaved" / minor(v) for v in older}

    def task(name: str, version: str, *arguments, needs=()) -> Task:
        return Task(name, venvs[version], [str(a) for a in arguments], workdir / "json" / f"{name}.json", needs)

    save = {v: task(f"save-{v}", v, "save", saved[v], "--source", args.source.resolve()) for v in versions}
    # under each older release: the newest's checkpoints, re-saving some; under the newest: the older ones' and those
    check_newest = {
        v: task(f"check-{v}", v, "check", saved[newest], "--resave-to", resaved[v], needs=[f"save-{newest}"])
        for v in older
    }
    check_older = {
        v: task(f"check-{newest}-of-{v}", newest, "check", saved[v], resaved[v], needs=[f"save-{v}", f"check-{v}"])
        for v in older
    }
    same = task(f"check-{newest}", newest, "check", saved[newest], needs=[f"save-{newest}"])
    tasks = [save[newest], *check_newest.values(), *(save[v] for v in older), *check_older.values()]
    tasks += [same] if args.same_release else []
    run_all(tasks, args.jobs, workdir)

    # rows: where the checkpoints were saved ("at save": their own generations agreed); columns: where checked
    blank = [""] * len(older)
    rows = [
        [newest, cell(save[newest]), *(cell(check_newest[v]) for v in older), cell(same) if args.same_release else ""]
    ]
    rows += [[v, cell(save[v]), *blank, cell(check_older[v], saved[v])] for v in older]
    rows += [[f"{newest}, re-saved under {v}", "", *blank, cell(check_older[v], resaved[v])] for v in older]
    print_table(["saved under", "at save", *versions], rows)
    for version, venv in venvs.items():
        if missing := missing_requirements(venv):
            print(f"{version}: installed without {', '.join(missing)} (not on the package index); Hub kernels off")

    failed = [t for t in tasks if t.returncode != 0]
    print_failures(failed, workdir)
    slowest = max(tasks, key=lambda t: t.seconds)
    keep = bool(failed) or args.workdir is not None
    print(
        f"\n{'FAIL' if failed else 'PASS'}: {len(tasks)} runs; environments {venv_seconds:.0f} s, round trips "
        f"{time.monotonic() - started - venv_seconds:.0f} s (longest run: {slowest.name}, {slowest.seconds:.0f} s)"
        + (f"; checkpoints and logs in {workdir}" if keep else "")
    )
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
