"""The data benchmarks (benchmarks/prepare_data.py, data_loader.py, resume_time.py, rss.py) run on small sizes and
report what they promise: the CPU, both sides, a ratio that is their quotient. Subprocesses, so slow."""

import json
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT
from tests.training_runs import subprocess_env

pytestmark = pytest.mark.slow


def run_module(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                            env=subprocess_env())  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_prepare_data_benchmark_compares_with_nanogpts_method_on_the_same_ids(tmp_path):
    """Both preparations of a 2 MB corpus count the same tokens (tiktoken and the tokenizer agree on every sampled
    document), and the ratio is the quotient of the medians."""
    out = tmp_path / "prepare.json"
    stdout = run_module("benchmarks.prepare_data", "--megabytes", "2", "--repeats", "1", "--vocab_size", "1000",
                        "--json_out", str(out))  # fmt: skip
    assert stdout.startswith("CPU: ")
    result = json.loads(out.read_text())
    assert result["same_ids_fraction"] == 1.0
    (ours,), (theirs,) = result["runs"]["ours"], result["runs"]["nanogpt"]
    assert ours["tokens"] == theirs["tokens"] > 0
    medians = result["median_tokens_per_s_per_core"]
    assert result["ratio_ours_over_nanogpt"] == pytest.approx(medians["ours"] / medians["nanogpt"])


def test_loader_and_rss_benchmarks_report_each_path(tmp_path):
    """The loader's three paths and the peak memory of both training paths, on a small corpus."""
    loader, rss = tmp_path / "loader.json", tmp_path / "rss.json"
    run_module("benchmarks.data_loader", "--megabytes", "5", "--batches", "20", "--repeats", "1", "--json_out",
               str(loader))  # fmt: skip
    assert len(json.loads(loader.read_text())["median_tokens_per_s"]) == 3
    run_module("benchmarks.rss", "--megabytes", "3", "--json_out", str(rss))
    peaks = json.loads(rss.read_text())["peak_rss_bytes"]
    assert set(peaks) == {"prepared", "in_memory"} and all(v > 100 * 2**20 for v in peaks.values())
