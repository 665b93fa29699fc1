"""Why the scaling-law fit misses the run at 4x its largest budget: the schedule, or the text seen again and again?

    python -m benchmarks.investigations.scaling_repetition                 # seconds: fits only, no training
    python -m benchmarks.investigations.scaling_repetition --previous e724e25

Reads the ``scaling_laws`` experiment's ``results.json`` (the grid's runs and the two held-out runs) and answers
two questions without training anything:

- **The schedule.** With ``--previous REV`` (a commit whose results.json was run with another recipe, read with
  ``git show``), each run the two versions share is listed with both losses and the change, grouped by how many times
  the run saw the training text. The first version decayed the rate by a cosine to 10 % of its peak, the second
  linearly to zero.
- **Repeated text.** Muennighoff et al. 2023 ("Scaling Data-Constrained Language Models") count repeated tokens as
  worth less: U unique tokens seen R + 1 times count as D' = U + U R* (1 - exp(-R / R*)). The law
  L = E + A / N^alpha + B / D'^beta (six parameters, R* among them) is fitted here as the experiment fits its own
  (Huber loss on log L, many starts), and both laws' predictions of the held-out runs are printed side by side.

The fit is post hoc: it was written after the held-out runs were measured, so it can explain a miss but is no
prediction of them.
"""

import argparse
import itertools
import json
import pathlib
import subprocess

import numpy as np
from scipy.optimize import least_squares
from scipy.special import logsumexp

from benchmarks.common import machine_line
from experiments.scaling_laws import LAW_PARAMETERS, Law

RESULTS = pathlib.Path("experiments/results/scaling_laws/results.json")
TRAINING_CHARACTERS = 1_003_840  # Tiny Shakespeare's training split, one token per character: the report's "passes"
STARTS = dict(log_a=(0.0, 5.0, 10.0), log_b=(0.0, 5.0, 10.0, 15.0), log_e=(-1.0, 0.0, 0.5), alpha=(0.2, 0.5),
              beta=(0.3, 0.7), log_r=(1.0, 2.0, 3.0, 4.0))  # fmt: skip
BOUNDS = ([-60, -60, -60, 0.01, 0.01, -3], [60, 60, 60, 3, 3, 8])


def effective_tokens(tokens: np.ndarray, unique: float, r_star: float) -> np.ndarray:
    """Muennighoff et al.'s D': the first pass counts in full, each repeat a little less than the one before."""
    repeats = np.maximum(tokens / unique - 1.0, 0.0)
    return np.where(tokens > unique, unique + unique * r_star * (1.0 - np.exp(-repeats / r_star)), tokens)


def repetition_log_loss(x, n: np.ndarray, d: np.ndarray, unique: float) -> np.ndarray:
    log_a, log_b, log_e, alpha, beta, log_r = x
    d_eff = effective_tokens(d, unique, float(np.exp(log_r)))
    terms = [log_a - alpha * np.log(n), log_b - beta * np.log(d_eff), np.full_like(n, log_e)]
    return logsumexp(np.stack(terms), axis=0)


def fit_repetition_law(n, d, loss, unique: float, huber: float) -> np.ndarray:
    """The six variables (log A, log B, log E, alpha, beta, log R*) with the lowest Huber objective over the starts."""
    best = None
    for start in itertools.product(*STARTS.values()):
        fit = least_squares(lambda x: repetition_log_loss(x, n, d, unique) - np.log(loss), start, loss="huber",
                            f_scale=huber, bounds=BOUNDS)  # fmt: skip
        if best is None or fit.cost < best.cost:
            best = fit
    return best.x


def previous_results(revision: str) -> dict:
    shown = subprocess.run(["git", "show", f"{revision}:{RESULTS.as_posix()}"], capture_output=True, text=True,
                           check=False)  # fmt: skip
    if shown.returncode:
        raise SystemExit(f"error: git show {revision}:{RESULTS} failed: {shown.stderr.strip()}")
    return json.loads(shown.stdout)


def compare_recipes(now: dict, before: dict, unique: float) -> None:
    def key(run):
        return run["num_hidden_layers"], run["hidden_size"], run["budget"], run["seed"]

    old = {key(run): run["validation_loss"] for run in before["numbers"]["runs"]}
    rows = sorted((run["tokens"] / unique, key(run), old[key(run)], run["validation_loss"])
                  for run in now["numbers"]["runs"] if key(run) in old)  # fmt: skip
    print(f"\nThe runs both versions trained ({len(rows)}): {before['revision']!r} -> {now['revision'][:60]!r}...")
    print(f"{'passes':>7} {'layers x hidden':>15} {'budget':>8} {'seed':>4} {'before':>7} {'now':>7} {'change':>7}")
    for passes, (layers, hidden, budget, seed), was, is_now in rows:
        print(f"{passes:7.1f} {f'{layers} x {hidden}':>15} {budget:8.2g} {seed:4d} {was:7.4f} {is_now:7.4f} "
              f"{is_now - was:+7.4f}")  # fmt: skip
    for low, high in ((0, 2), (2, 8), (8, 1000)):
        changes = [now_ - was for passes, _, was, now_ in rows if low <= passes < high]
        if changes:
            print(f"  runs seeing the text {low} to {high} times: mean change {np.mean(changes):+.4f} ({len(changes)})")
    def held_key(h):  # by what was trained: a label such as "4x the largest budget" moves with the grid
        return h["num_hidden_layers"], h["hidden_size"], h["budget"]

    held_before = {held_key(h): h for h in before["numbers"]["held_out"]}
    for h in now["numbers"]["held_out"]:
        if held_key(h) in held_before:
            b = held_before[held_key(h)]
            print(f"  held out, {h['label']}: measured {b['measured']:.4f} -> {h['measured']:.4f}, predicted "
                  f"{b['predicted']:.4f} -> {h['predicted']:.4f}, off by {b['error']:.4f} -> {h['error']:.4f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS, help="the experiment's results.json")
    parser.add_argument("--previous", default=None, help="a git revision whose results.json to compare with")
    parser.add_argument("--unique_tokens", type=float, default=TRAINING_CHARACTERS, help="U, the text's tokens")
    args = parser.parse_args()
    now = json.loads(args.results.read_text())
    numbers, fit = now["numbers"], now["numbers"]["fit"]
    unique = args.unique_tokens
    print(machine_line(1))
    print(f"{args.results}: {len(numbers['runs'])} grid runs, {len(numbers['held_out'])} held out; {unique:,.0f} "
          "unique training tokens")  # fmt: skip
    if args.previous:
        compare_recipes(now, previous_results(args.previous), unique)
    runs = numbers["runs"]
    n, d, loss = (np.array([run[k] for run in runs], dtype=float) for k in ("parameters", "tokens", "validation_loss"))
    x = fit_repetition_law(n, d, loss, unique, fit.get("huber_delta", 1e-3))
    r_star = float(np.exp(x[5]))
    fitted = np.exp(repetition_log_loss(x, n, d, unique))
    plain = Law(**{name: fit[name] for name in LAW_PARAMETERS}).loss(n, d)
    print(f"\nWith repeats worth less: E {np.exp(x[2]):.3f}, A {np.exp(x[0]):.4g}, alpha {x[3]:.3f}, B {np.exp(x[1]):.4g}, "
          f"beta {x[4]:.3f}, R* {r_star:.2f}; RMS residual {np.sqrt(np.mean((fitted - loss) ** 2)):.4f} nats "
          f"(the experiment's law: {np.sqrt(np.mean((plain - loss) ** 2)):.4f})")  # fmt: skip
    print(f"{'held out':>28} {'passes':>6} {'measured':>8} {'law':>7} {'off':>7} {'repeats':>7} {'off':>7}")
    for h in numbers["held_out"]:
        size, tokens = np.array([h["parameters"]], float), np.array([h["tokens"]], float)
        with_repeats = float(np.exp(repetition_log_loss(x, size, tokens, unique))[0])
        print(f"{h['label']:>28} {h['tokens'] / unique:6.1f} {h['measured']:8.4f} {h['predicted']:7.4f} "
              f"{h['predicted'] - h['measured']:+7.4f} {with_repeats:7.4f} {with_repeats - h['measured']:+7.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
