"""experiments/scaling_laws.py: the quick grid runs end to end, the fit recovers a law it is given, the
compute-optimal size is the closed form's, and the ``predict`` and ``run`` commands answer with a number on their
last line, or with one ``error:`` line."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from decoderlab.cli import run_command
from experiments import scaling_laws
from experiments.scaling_laws import FlopsPerToken, Law, fit_law, fit_with_bootstrap, optimum

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# a law of the size the experiment's grid measures (losses of 1.5 to 2.5 nats per character)
TRUE_LAW = Law(E=1.0, A=60.0, B=200.0, alpha=0.4, beta=0.35)
GRID_N = np.array([57_536, 110_784, 227_616, 480_592, 860_544])  # the default grid's sizes
GRID_BUDGETS = (2.5e12, 5e12, 1e13, 2e13)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One --quick run with 2 seeds (so the smallest budget runs both and the others one), shared by the tests."""
    out = tmp_path_factory.mktemp("scaling_laws")
    scaling_laws.main(["--quick", "--seeds", "2", "--threads", "1", "--output_dir", str(out)])
    return out


def synthetic_runs(noise: float, seed: int = 0):
    """(N, D, loss) of the default grid's sizes and budgets under TRUE_LAW, each loss times exp(noise x a normal)."""
    n = np.repeat(GRID_N[None], len(GRID_BUDGETS), axis=0).ravel()
    d = np.array([budget / (6.5 * size) for budget in GRID_BUDGETS for size in GRID_N])
    loss = TRUE_LAW.loss(n, d) * np.exp(np.random.default_rng(seed).normal(0.0, noise, len(n)))
    return n, d, loss


def command(argv, capsys) -> tuple[int, list[str], list[str]]:
    """(exit status, stdout lines, stderr lines) of ``python -m experiments.scaling_laws ARGV``, in this process."""
    with pytest.raises(SystemExit) as stop:
        run_command(scaling_laws.main, argv)
    captured = capsys.readouterr()
    return stop.value.code, captured.out.strip().splitlines(), captured.err.strip().splitlines()


def write_fit(folder, law: Law, parameters_range=(57_536, 860_544), tokens_range=(1e5, 5e7)) -> None:
    fit = {**law.record(), "parameters_range": list(parameters_range), "tokens_range": list(tokens_range),
           "vocab_size": 67, "head_dim": 16, "block_size": 64, "quick": False}  # fmt: skip
    (folder / "results.json").write_text(json.dumps({"experiment": "scaling_laws", "numbers": {"fit": fit}}))


def test_quick_run_writes_report_results_and_plots(quick_run):
    """--quick trains the grid, fits it, trains the two held-out runs and writes report.md (claim, verdict, the
    command), the PNGs it shows and results.json: the fit predict reads, every run with its seed (both seeds at the
    smallest budget, one elsewhere), the optimum at each budget and both held-out runs, predicted and measured."""
    report = (quick_run / "report.md").read_text(encoding="utf-8")
    assert re.search(r"^\*\*Verdict: the claim (holds|partly holds|does not hold) at this scale\.\*\*$", report, re.M)
    assert "**Claim.**" in report and "python -m experiments.scaling_laws --quick" in report
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert set(images) == {"isoflop.png", "loss_vs_compute.png"}
    for image in images:
        data = (quick_run / image).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, image

    numbers = json.loads((quick_run / "results.json").read_text())["numbers"]
    fit = numbers["fit"]
    assert {"E", "A", "B", "alpha", "beta", "intervals", "parameters_range", "tokens_range", "vocab_size"} <= set(fit)
    assert fit["quick"] is True and len(numbers["optima"]) == len(scaling_laws.QUICK.budgets)
    smallest = min(scaling_laws.QUICK.budgets)
    tokens_per_step = scaling_laws.QUICK.batch_size * scaling_laws.QUICK.block_size
    for run in numbers["runs"]:  # each run's steps are its budget's: budget // (FLOPs per token x tokens per step)
        assert run["steps"] == run["budget"] // (run["flops_per_token"] * tokens_per_step)
        assert run["tokens"] == run["steps"] * tokens_per_step
    seeds = {run["budget"]: set() for run in numbers["runs"]}
    for run in numbers["runs"]:
        seeds[run["budget"]].add(run["seed"])
    assert seeds.pop(smallest) == {0, 1} and all(s == {0} for s in seeds.values())
    largest = max(scaling_laws.QUICK.budgets)
    assert [h["budget"] for h in numbers["held_out"]] == [4 * largest, 1e8, 8 * largest]
    assert [h["checked"] for h in numbers["held_out"]] == [True, True, False]
    assert [h["seeds"] for h in numbers["held_out"]] == [[0, 1], [0, 1], [0]]  # held_out_seeds, capped by --seeds
    assert all(math.isfinite(h["predicted"]) and math.isfinite(h["measured"]) for h in numbers["held_out"])


def test_predict_reads_what_the_experiment_wrote(quick_run, capsys):
    """predict on the quick run's folder prints the law's loss for the size and tokens as its last line, and warns
    that the fit is a --quick one."""
    status, out, err = command(["predict", "--hidden_size", "16", "--num_hidden_layers", "1", "--tokens", "5000",
                                "--output_dir", str(quick_run)], capsys)  # fmt: skip
    fit = json.loads((quick_run / "results.json").read_text())["numbers"]["fit"]
    law = Law(**{name: fit[name] for name in scaling_laws.LAW_PARAMETERS})
    n = fit["parameters_range"][0]  # 1 x 16 is the quick grid's smallest size
    assert status == 0 and float(out[-1]) == pytest.approx(float(law.loss(n, 5000)), abs=1e-4)
    assert any("--quick run" in line for line in err)


def test_fit_recovers_a_known_law():
    """From the default grid's sizes and budgets with losses drawn from a known law (0.2 % noise), the fit finds its
    exponents to within 0.03 and E to within 0.1 and predicts a run beyond the grid to within 0.01 nats; the bootstrap
    intervals of the exponents hold the fitted ones and narrow with less noise; noise-free losses give the law back
    exactly."""
    law, _ = fit_law(*synthetic_runs(noise=0.0))
    for name in scaling_laws.LAW_PARAMETERS:
        assert getattr(law, name) == pytest.approx(getattr(TRUE_LAW, name), rel=1e-6), name

    fit = fit_with_bootstrap(*synthetic_runs(noise=0.002), resamples=20, seed=0)
    assert fit.law.alpha == pytest.approx(TRUE_LAW.alpha, abs=0.03)
    assert fit.law.beta == pytest.approx(TRUE_LAW.beta, abs=0.03)
    assert fit.law.E == pytest.approx(TRUE_LAW.E, abs=0.1)
    assert fit.law.loss(1.7e6, 3e7) == pytest.approx(TRUE_LAW.loss(1.7e6, 3e7), abs=0.01)
    quieter = fit_with_bootstrap(*synthetic_runs(noise=0.0005), resamples=20, seed=0)
    for name in ("alpha", "beta"):  # the intervals hold the fit, and narrow with the noise
        low, high = fit.interval(name)
        assert low <= getattr(fit.law, name) <= high and high - low > 0, (name, low, high)
        assert np.subtract(*quieter.interval(name)[::-1]) < (high - low) / 2, name


def test_the_compute_optimal_size_is_the_closed_forms():
    """With FLOPs per token exactly 6 N, the optimum found numerically is Chinchilla's closed form:
    N* = G (C / 6)^(beta / (alpha + beta)) with G = (alpha A / (beta B))^(1 / (alpha + beta)), D* = C / (6 N*)."""
    flops = FlopsPerToken(log_n=(math.log(1e4), math.log(1e6)), log_ratio=(math.log(6.0), math.log(6.0)))
    law = TRUE_LAW
    g = (law.alpha * law.A / (law.beta * law.B)) ** (1 / (law.alpha + law.beta))
    for budget in (1e12, 1e15, 1e18):
        found = optimum(law, flops, budget)
        expected = g * (budget / 6) ** (law.beta / (law.alpha + law.beta))
        assert found.parameters == pytest.approx(expected, rel=1e-3)
        assert found.tokens == pytest.approx(budget / (6 * found.parameters))
        assert found.loss == pytest.approx(float(law.loss(found.parameters, found.tokens)))


def test_predict_prints_the_number_last_and_warns_outside_the_grid(tmp_path, capsys):
    """predict's last line is the law's loss alone; inside the fitted ranges nothing is said on stderr, outside them a
    warning says how far out (here N, 4 x 256 having 3.75 times the largest fitted N) and it predicts anyway."""
    write_fit(tmp_path, TRUE_LAW)
    status, out, err = command(["predict", "--hidden_size", "96", "--num_hidden_layers", "2", "--tokens", "1e6",
                                "--output_dir", str(tmp_path)], capsys)  # fmt: skip
    assert status == 0 and err == []
    assert out[-1] == f"{float(TRUE_LAW.loss(227_616, 1e6)):.4f}"

    status, out, err = command(["predict", "--hidden_size", "256", "--num_hidden_layers", "4", "--tokens", "1e6",
                                "--output_dir", str(tmp_path)], capsys)  # fmt: skip
    assert status == 0 and out[-1] == f"{float(TRUE_LAW.loss(3_228_416, 1e6)):.4f}"
    assert err == ["warning: N is 3.8x the largest fitted N (860,544): the law is extrapolated."]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["predict", "--hidden_size", "64", "--num_hidden_layers", "2", "--tokens", "0"],
         "error: --tokens must be a positive number of training tokens, got 0."),
        (["run", "--hidden_size", "64", "--num_hidden_layers", "2", "--tokens", "-5"],
         "error: --tokens must be a positive number of training tokens, got -5."),
        (["run", "--hidden_size", "100", "--num_hidden_layers", "2", "--tokens", "1e6"],
         "error: hidden_size 100 is not a whole number of heads of head_dim 16: pass a multiple of 16, e.g. 96 or 112."),
        (["predict", "--hidden_size", "100", "--num_hidden_layers", "2", "--tokens", "1e6", "--output_dir", "FIT"],
         "error: hidden_size 100 is not a whole number of heads of head_dim 16: pass a multiple of 16, e.g. 96 or 112."),
        (["predict", "--hidden_size", "64", "--num_hidden_layers", "2", "--tokens", "1e6", "--output_dir", "EMPTY"],
         "error: No fit at EMPTY/results.json: run `python -m experiments.scaling_laws --jobs 2 --threads 1` first (it "
         "writes one there), or pass --output_dir of a folder that holds one."),
    ],
    ids=["tokens-zero", "tokens-negative", "heads-run", "heads-predict", "no-fit"],
)  # fmt: skip
def test_bad_input_is_one_error_line_with_status_2(argv, message, tmp_path, capsys):
    """Each mistake stops before any work with exit status 2 and one line saying what was wrong and what to do."""
    (tmp_path / "fit").mkdir()
    (tmp_path / "empty").mkdir()
    write_fit(tmp_path / "fit", TRUE_LAW)
    folders = {"FIT": str(tmp_path / "fit"), "EMPTY": str(tmp_path / "empty")}
    status, out, err = command([folders.get(arg, arg) for arg in argv], capsys)
    assert status == 2 and out == []
    assert err == [message.replace("EMPTY", folders["EMPTY"])]


def test_run_trains_the_size_and_prints_its_loss_last(capsys):
    """run trains the size for the tokens (rounded to whole steps of the recipe's batch) and prints the measured
    validation loss alone on its last line."""
    status, out, _ = command(["run", "--hidden_size", "64", "--num_hidden_layers", "1", "--tokens", "2048",
                              "--threads", "1"], capsys)  # fmt: skip
    assert status == 0
    assert any("2 steps of 1,024 tokens = 2,048 tokens" in line for line in out)
    assert 2.0 < float(out[-1]) < 6.0  # after 2 steps: about log(67) = 4.2, the uniform guess


def test_bad_settings_are_refused(tmp_path):
    """A grid whose sizes and depths do not pair up, a held-out budget inside the grid, a run beyond that is not
    beyond the checked one, no held-out seeds, or a decay that does not end at zero, is refused by name."""
    with pytest.raises(ValueError, match="must pair up"):
        scaling_laws.main(["--quick", "--hidden_sizes", "16,32", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--held_out_multiple must exceed 1"):
        scaling_laws.main(["--quick", "--held_out_multiple", "1", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--decay must be one of linear, cosine .each ends at zero., got 'constant'"):
        scaling_laws.main(["--quick", "--decay", "constant", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--beyond_multiple must exceed --held_out_multiple \(4\), or be 0 .* got 3"):
        scaling_laws.main(["--quick", "--beyond_multiple", "3", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--held_out_seeds must be at least 1, got 0"):
        scaling_laws.main(["--quick", "--held_out_seeds", "0", "--output_dir", str(tmp_path)])


def test_the_held_out_runs_are_the_two_checked_ones_and_the_one_beyond_unless_it_is_off():
    """Beyond the grid the size comes from ``chosen`` at each run's own budget; the checked runs train
    ``held_out_seeds`` seeds, the one beyond one seed; ``--beyond_multiple 0`` leaves it out."""
    settings = dataclasses.replace(scaling_laws.Settings(), held_out_seeds=2)
    between = object()

    def chosen(budget):
        return f"size at {budget:g}"

    plans = scaling_laws.held_out_plans(settings, [2.5e12, 1e13], chosen, between)
    assert plans == [(scaling_laws.FAR, "size at 4e+13", 4e13, 2), (scaling_laws.BETWEEN, between, 1e13, 2),
                     (scaling_laws.BEYOND, "size at 8e+13", 8e13, 1)]  # fmt: skip
    off = scaling_laws.held_out_plans(dataclasses.replace(settings, beyond_multiple=0), [2.5e12, 1e13], chosen, between)
    assert [plan[0] for plan in off] == [scaling_laws.FAR, scaling_laws.BETWEEN]
