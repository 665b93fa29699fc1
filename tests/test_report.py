"""benchmarks.report: the README's headline table and docs/performance.md say what benchmarks/results/*.json says,
and ``--check`` names the page, the table and the results file when they do not (figures are data, never typed by hand).

The real pages are checked against the real results; the failures are shown on a copy of them in a temporary
folder, one thing changed at a time."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from benchmarks import report
from tests.paths import REPO_ROOT

NOTES = REPO_ROOT / "benchmarks" / "notes"
INVESTIGATIONS = sorted(
    p.stem for p in (REPO_ROOT / "benchmarks" / "investigations").glob("*.py") if p.stem != "__init__"
)


@pytest.fixture
def copy(tmp_path, monkeypatch):
    """The pages, results and notes copied into a folder that benchmarks.report takes for the repository."""
    for page in report.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO_ROOT / page, tmp_path / page)
    shutil.copytree(report.RESULTS, tmp_path / "benchmarks" / "results")
    shutil.copytree(NOTES, tmp_path / "benchmarks" / "notes")
    monkeypatch.setattr(report, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path / "benchmarks" / "results")
    monkeypatch.setattr(report, "NOTES", tmp_path / "benchmarks" / "notes")
    monkeypatch.setattr(report, "PERFORMANCE", tmp_path / "docs" / "performance.md")
    return tmp_path


def check(capsys) -> tuple[int, str]:
    status = report.main(["--check"])
    return status, capsys.readouterr().out


def test_the_pages_say_what_the_results_say(capsys):
    """The committed README and docs/performance.md are exactly what the committed results render to."""
    status, out = check(capsys)
    assert status == 0, out


def test_the_check_runs_without_torch():
    """CI runs ``python3 -m benchmarks.report --check`` with the machine's bare Python, before anything is
    installed: with torch (and everything that imports it) made unimportable, the check still passes."""
    blocked = "import sys, runpy; sys.modules.update(dict.fromkeys(['torch', 'transformers', 'decoderlab'])); "
    run = subprocess.run(
        [sys.executable, "-c", blocked + "sys.argv = ['report', '--check']; "
         "runpy.run_module('benchmarks.report', run_name='__main__')"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_stored_memory_verdicts_are_what_the_stored_rows_give():
    """The memory table shows the verdicts stored in training_memory.json; they are what ``goals`` computes from
    the stored rows, so the report reading them instead of importing the benchmark loses nothing."""
    from benchmarks.training_memory import goals

    stored = json.loads((report.RESULTS / "training_memory.json").read_text())
    assert stored["goals"] == goals(stored["rows"])


def test_a_figure_changed_on_the_page_is_named_with_its_page_table_and_json(copy, capsys):
    """A figure edited by hand in a table fails --check with the page, the table, the results file the row comes
    from, and both versions of the line."""
    page = copy / "docs" / "performance.md"
    text = page.read_text()
    row = next(
        line for line in text.splitlines() if line.startswith("| train tokens/s | nano | `LlamaForCausalLM` | 12,829")
    )
    page.write_text(text.replace(row, row.replace("| 1.05 |", "| 1.25 |")))
    status, out = check(capsys)
    assert status == 1
    assert "docs/performance.md: table 'speed' differs from benchmarks/results/speed.json" in out
    assert "| 1.25 |" in out and "| 1.05 |" in out
    assert "README.md" not in out  # the other page still agrees


def test_a_changed_results_file_is_named_on_every_page_that_shows_it(copy, capsys):
    """A results file whose figure changed fails --check for each page and table that shows the figure: the
    README's headline and the performance page's table."""
    path = copy / "benchmarks" / "results" / "vllm_speed.json"
    data = json.loads(path.read_text())
    data["rows"][0]["vllm_over_generate"] = 9.99
    path.write_text(json.dumps(data))
    status, out = check(capsys)
    assert status == 1
    assert "README.md: table 'headline' differs from benchmarks/results/vllm_speed.json" in out
    assert "docs/performance.md: table 'vllm' differs from benchmarks/results/vllm_speed.json" in out
    assert "9.99×" in out


def test_writing_renders_the_tables_and_keeps_the_hand_written_text(copy, capsys):
    """Without --check the tables are rewritten from the results (the tampered figure goes), the text around them
    stays as written, and --check then passes."""
    page = copy / "docs" / "performance.md"
    original = page.read_text()
    page.write_text(original.replace("| 1.05 |", "| 1.25 |", 1).replace("## Export formats", "## Export formats!"))
    assert report.main([]) == 0
    assert page.read_text() == original.replace("## Export formats", "## Export formats!")
    assert check(capsys)[0] == 0


def test_a_results_file_no_table_shows_is_named(copy, capsys):
    """Every current results file is on a page: one that no table shows fails --check by name (a superseded run
    belongs in results/archive/, which is not rendered)."""
    shutil.copyfile(
        copy / "benchmarks" / "results" / "speed.json", copy / "benchmarks" / "results" / "speed-rerun.json"
    )
    status, out = check(capsys)
    assert status == 1 and "benchmarks/results/speed-rerun.json is shown by no table" in out
    (copy / "benchmarks" / "results" / "speed-rerun.json").rename(
        copy / "benchmarks" / "results" / "archive" / "x.json"
    )
    assert check(capsys)[0] == 0


def test_a_page_without_a_tables_markers_is_named(copy, capsys):
    """A page that lost a table's marker lines fails, naming the page, the table and the lines to add."""
    readme = copy / "README.md"
    readme.write_text(
        re.sub(r"<!-- report:headline -->.*<!-- /report:headline -->\n", "", readme.read_text(), flags=re.S)
    )
    status, out = check(capsys)
    assert status == 1 and "README.md: no table 'headline'; put the lines <!-- report:headline -->" in out


def test_a_results_file_without_provenance_is_refused(copy):
    """A results file that does not say where it was measured cannot be rendered: the error names it and the writer
    to use."""
    path = copy / "benchmarks" / "results" / "rms_norm.json"
    data = json.loads(path.read_text())
    del data["provenance"]
    path.write_text(json.dumps(data))
    with pytest.raises(
        SystemExit, match="rms_norm.json has no provenance: write it with benchmarks.common.write_results"
    ):
        report.main(["--check"])


def test_every_results_file_records_its_provenance():
    """Every results file, archived ones too, says where it was measured: at run time, or backfilled from git
    (then with the commit that added it, and marked so)."""
    for path in sorted(report.RESULTS.rglob("*.json")):
        provenance = json.loads(path.read_text()).get("provenance")
        assert provenance, f"{path.name} has no provenance"
        if provenance["recorded"] == "at run time":
            assert provenance["commit"] and provenance["dirty"] is not None and provenance["date"], path.name
        else:
            assert provenance["recorded"] == "backfilled from git history", path.name
            assert provenance["commit"] is None and re.fullmatch(r"[0-9a-f]{40}", provenance["committed_in"]), path.name


def test_every_investigation_is_reported_by_a_note_and_every_link_resolves():
    """Each script in benchmarks/investigations/ is cited by a note in benchmarks/notes/, and the relative links of
    the notes and of the performance page lead to files that exist."""
    notes = {path: path.read_text() for path in NOTES.glob("*.md")}
    for name in INVESTIGATIONS:
        assert any(f"benchmarks.investigations.{name}" in text for text in notes.values()), f"no note cites {name}"
    pages = {**notes, report.PERFORMANCE: report.PERFORMANCE.read_text()}
    for path, text in pages.items():
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (path.parent / target).exists(), f"{path.name} links {target}, which does not exist"
