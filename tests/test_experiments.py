"""experiments/: every experiment runs end to end in --quick mode, and the measurements they rest on are right.

The smoke tests run each experiment's ``main`` in this process (tiny models, a few steps) into a temporary folder
and check what a reader gets: a report that states a verdict and shows PNG plots that exist. The other tests
check the instruments against references: the attention recorder against the eager attention's own output,
the softmax-Jacobian formula against autograd, the diagonal test on models built here, the KV-cache bytes against
the cache's shape arithmetic.
"""

import json
import math
import re
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

import decoderlab
from experiments import attention_scale, common, heads, layouts, norm_placement, rope_relative, sample_efficiency

EXPERIMENTS = {
    "attention_scale": attention_scale,
    "rope_relative": rope_relative,
    "norm_placement": norm_placement,
    "heads": heads,
    "sample_efficiency": sample_efficiency,
    "layouts": layouts,
}
VERDICT = re.compile(r"^\*\*Verdict: the claim (holds|partly holds|does not hold) at this scale\.\*\*$", re.M)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """The experiments read the offline copy of Tiny Shakespeare; never ask the Hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_quick_run_writes_report_with_verdict_and_plots(name, tmp_path):
    """Each experiment runs in --quick mode and writes report.md (claim, verdict, reproduce command), the PNGs the
    report shows, and results.json with the same verdict."""
    EXPERIMENTS[name].main(["--quick", "--output_dir", str(tmp_path), "--threads", str(torch.get_num_threads())])

    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    verdict = VERDICT.search(report)
    assert verdict, report
    assert "**Claim.**" in report and f"python -m experiments.{name} --quick" in report
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert images, "the report shows no plot"
    for image in images:
        data = (tmp_path / image).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, image
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["verdict"] == verdict.group(1)
    assert summary["checks"] and all(isinstance(c["held"], bool) for c in summary["checks"])


def test_bad_settings_are_refused(tmp_path):
    """Impossible settings raise a ValueError naming them instead of running (or crashing) half-way."""
    with pytest.raises(ValueError, match="--threads"):
        attention_scale.main(["--quick", "--threads", "0", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--eval_length 16 must exceed --block_size 16"):
        rope_relative.main(["--quick", "--eval_length", "16", "--threads", "1", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="depths must be comma-separated integer values, e.g. 2,6,12, got '2,six'"):
        norm_placement.main(["--quick", "--depths", "2,six", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--sliding_window 32 must be shorter than --block_size 32"):
        layouts.main(["--quick", "--sliding_window", "32", "--threads", "1", "--output_dir", str(tmp_path)])


def test_a_run_trains_with_the_recipe_file_and_the_specs_fields(tmp_path):
    """common.recipe reads a recipe file as `--config` does (its model, and its TRAINING_FIELDS with TrainConfig's
    default where the file is silent; its evaluation and seed stay the experiment's), and a run's TrainConfig is the
    corpus's data fields, then RUN_DEFAULTS, then the spec's fields, then what the harness fixes (the scratch
    folder, no checkpoints, the run's seed), built anew so that TrainConfig checks it."""
    from training.args import TrainConfig

    path = tmp_path / "recipe.yaml"
    path.write_text(
        "model: {hidden_size: 32, num_attention_heads: 4}\nmax_train_steps: 7\nlearning_rate: 3.0e-3\n"
        "optimizer: muon\neval_steps: 5\nseed: 9\n"
    )
    model, training = common.recipe(path)
    assert model == {"hidden_size": 32, "num_attention_heads": 4} and set(training) == set(common.TRAINING_FIELDS)
    assert (training["max_train_steps"], training["learning_rate"], training["optimizer"]) == (7, 3e-3, "muon")
    assert training["muon_momentum"] == TrainConfig().muon_momentum

    corpus = common.Corpus(TrainConfig(dataset_name="x", block_size=16, per_device_train_batch_size=1), *[None] * 3)
    spec = common.Spec("s", model, {**training, "per_device_train_batch_size": 4, "seed": 5, "logging_steps": 3})
    cfg = common.run_config(corpus, spec, 2, tmp_path / "run")
    assert (cfg.dataset_name, cfg.block_size) == ("x", 16)
    assert (cfg.per_device_train_batch_size, cfg.logging_steps, cfg.optimizer) == (4, 3, "muon")
    assert cfg.learning_rate == 3e-3
    assert (cfg.eval_steps, cfg.max_eval_samples, cfg.per_device_eval_batch_size) == (None, 64, 64)
    assert (cfg.seed, cfg.checkpointing_steps, cfg.output_dir) == (2, None, str(tmp_path / "run"))
    with pytest.raises(ValueError, match="learning_rate"):
        common.run_config(corpus, common.Spec("bad", {}, {**spec.training, "learning_rate": -1.0}), 0, tmp_path)
    with pytest.raises(ValueError, match="sets no max_train_steps"):
        common.Spec("unsized", {}, {"per_device_train_batch_size": 4})


def test_recorder_sees_what_eager_attention_computes(tiny_model):
    """The recorder changes nothing (same logits as eager), its weights are eager's output_attentions, and
    softmax(recorded scores + causal mask) gives those weights back, for grouped-query attention too."""
    model = tiny_model(num_key_value_heads=2)
    model.config._attn_implementation = "eager"
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        eager = model(input_ids=input_ids, output_attentions=True)
        with common.AttentionRecorder(model.config) as recorder:
            recorded = model(input_ids=input_ids)
    assert model.config._attn_implementation == "eager"  # restored on exit
    torch.testing.assert_close(recorded.logits, eager.logits)
    causal = torch.full((12, 12), float("-inf")).triu(1)
    for layer, weights in enumerate(eager.attentions):
        torch.testing.assert_close(recorder.weights[layer], weights)
        torch.testing.assert_close(torch.softmax(recorder.scores[layer] + causal, dim=-1), weights)


def test_recorder_runs_each_layers_own_kernel_sinks_and_windows_included(tiny_model):
    """With learned sinks and sliding windows the recorder still computes what eager computes (same logits, its
    weights are output_attentions'), because it runs the layer's own eager kernel: a row of weights sums to 1 minus
    the sink's share, softmax([scores + mask, s_h]) without the sink's column, and a sliding layer's weights are 0
    outside its window. (A recorder running the plain softmax would make every row sum to 1 and miss the sinks.)"""
    window = 4
    model = tiny_model(attention_sinks=True, layer_types=["sliding_attention", "full_attention"], sliding_window=window)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, model.config.num_attention_heads))
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        eager = model(input_ids=input_ids, output_attentions=True)
        with common.AttentionRecorder(model.config) as recorder:
            recorded = model(input_ids=input_ids)
    torch.testing.assert_close(recorded.logits, eager.logits)
    i, j = torch.arange(12)[:, None], torch.arange(12)[None]
    for layer, weights in enumerate(eager.attentions):
        torch.testing.assert_close(recorder.weights[layer], weights)
        allowed = (j <= i) & ((i - j < window) if layer == 0 else True)
        scores = recorder.scores[layer].masked_fill(~allowed, float("-inf"))
        sinks = model.model.layers[layer].self_attn.sinks.view(1, -1, 1, 1).expand(2, -1, 12, 1)
        expected = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1]
        torch.testing.assert_close(recorder.weights[layer], expected)
        assert (weights.sum(-1) < 0.99).all()  # every row gave some attention to its sink
    assert recorder.weights[0][..., (i - j >= window)].abs().max() == 0  # nothing outside the window


def test_where_attention_goes_reads_the_first_token_and_the_missing_share():
    """layouts.where_attention_goes: the first token's weight and the share given to no token (the sink's), each
    averaged over queries 1..T-1 and the sequences, against loops written here."""
    torch.manual_seed(0)
    L, B, nh, T = 2, 3, 2, 5
    weights = torch.softmax(torch.randn(L, B, nh, T, T + 1), dim=-1)[..., :T]  # a sink's column dropped
    weights = weights.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0.0)
    first, sink = layouts.where_attention_goes(weights)
    for layer in range(L):
        on_first = [weights[layer, b, h, q, 0].item() for b in range(B) for h in range(nh) for q in range(1, T)]
        assert first[layer] == pytest.approx(sum(on_first) / len(on_first), rel=1e-5)
        for h in range(nh):
            missing = [1 - weights[layer, b, h, q].sum().item() for b in range(B) for q in range(1, T)]
            assert sink[layer, h] == pytest.approx(sum(missing) / len(missing), rel=1e-5)
    assert sink.min() > 0


def test_layouts_switch_one_field_each():
    """The experiment's settings differ from the recipe's model in exactly their own switch: three of four layers
    sliding (every fourth full, as SmolLM3 counts its RoPE-free layers), RoPE off on every fourth layer, sinks."""
    settings = layouts.Settings()
    assert layouts.layout_fields("full", settings, 8) == {}
    assert layouts.layout_fields("sliding", settings, 8) == {
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
        "sliding_window": 64,
    }
    config = decoderlab.DecoderLabConfig(num_hidden_layers=8, **layouts.layout_fields("rope_free", settings, 8))
    assert config.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
    assert layouts.layout_fields("sinks", settings, 8) == {"attention_sinks": True}


def test_softmax_jacobian_norm_matches_autograd():
    """The closed form of ||d softmax / d s||_F equals the norm of autograd's Jacobian, from flat to saturated rows."""
    scores = (
        torch.randn(5, 7, dtype=torch.float64) * torch.tensor([0.1, 1.0, 3.0, 10.0, 40.0], dtype=torch.float64)[:, None]
    )
    for row in scores:
        jacobian = torch.autograd.functional.jacobian(lambda s: torch.softmax(s, -1), row)
        expected = jacobian.norm().item()
        got = attention_scale.softmax_jacobian_norm(torch.softmax(row, -1)).item()
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-7)


def test_diagonal_spread_separates_rope_from_absolute_positions(tiny_model):
    """For one repeated token, layer 0 of a RoPE model scores by offset only (spread ~0); learned and sinusoidal
    positions do not; without positions every score is equal (NaN: nothing to compare)."""
    repeated = torch.full((1, 16), 3)
    spread = {}
    for kind in ("rope", "learned", "sinusoidal", "none"):
        model = tiny_model(position_embedding_type=kind)
        spread[kind] = rope_relative.diagonal_spread(rope_relative.first_layer_scores(model, repeated)[0])
    assert spread["rope"] < 1e-4
    assert spread["learned"] > 0.01 and spread["sinusoidal"] > 0.01
    assert spread["none"] != spread["none"]  # NaN


def test_kv_cache_bytes_follow_the_key_value_heads(tiny_config):
    """The measured cache of MHA, GQA and MQA models holds 2 x layers x KV heads x head_dim x tokens x 4 bytes."""
    for kv_heads in (4, 2, 1):
        config = tiny_config(num_key_value_heads=kv_heads)
        model = AutoModelForCausalLM.from_config(config).eval()
        expected = 2 * config.num_hidden_layers * kv_heads * config.head_dim * 20 * 4
        assert heads.kv_cache_bytes(model, 20) == expected


def test_head_divergence_is_zero_for_identical_heads_and_positive_otherwise():
    """Jensen-Shannon divergence between heads: 0 when every head has the same pattern, > 0 when one differs."""
    weights = torch.softmax(torch.randn(1, 2, 1, 6, 6), dim=-1).expand(1, 2, 3, 6, 6).clone()  # (L, B, nh, T, T)
    assert heads.head_divergence(weights) == pytest.approx([0.0], abs=1e-9)
    weights[:, :, 0] = torch.eye(6)
    assert heads.head_divergence(weights)[0] > 0.05


def _trials(losses) -> common.Trials:
    runs = [
        common.Run(f"seed {i}", None, [(1, 9.9)], [(1, loss)], None if loss == loss else 1, 0.0)
        for i, loss in enumerate(losses)
    ]
    return common.Trials("setting", list(range(len(losses))), runs)


def test_trials_report_mean_and_sample_spread_over_seeds():
    """A setting's seeds give mean ± sample standard deviation (n - 1), and a diverged seed makes the mean NaN and
    is named in the summary rather than averaged away."""
    trials = _trials([1.0, 1.2, 1.4])
    assert trials.mean == pytest.approx(1.2) and trials.std == pytest.approx(0.2)
    assert str(trials) == "1.200 ± 0.200"
    assert _trials([1.5]).std == 0.0 and str(_trials([1.5])) == "1.500"
    diverged = _trials([1.0, float("nan"), 1.1])
    assert math.isnan(diverged.mean) and str(diverged) == "NaN (1 of 3 diverged)"


def test_a_difference_counts_only_beyond_the_seed_spread():
    """lower_beyond_spread: the gap between two means must exceed the sum of their standard deviations; a gap inside
    the spread does not count, however the means are ordered; per-seed measurements work like Trials."""
    low, high = _trials([1.0, 1.1, 1.2]), _trials([1.5, 1.6, 1.7])  # stds 0.1 each, gap 0.5
    assert common.lower_beyond_spread(low, high) and not common.lower_beyond_spread(high, low)
    noisy = _trials([1.0, 1.6, 2.2])  # mean 1.6, std 0.6: gap 0.5 < 0.1 + 0.6
    assert not common.lower_beyond_spread(low, noisy)
    assert common.lower_beyond_spread([0.1, 0.2], [0.5, 0.6]) and not common.lower_beyond_spread([0.1, 0.5], [0.4, 0.6])
    assert common.spread_note(low, high) == "gap +0.500 vs spread 0.200"


def test_every_setting_runs_three_seeds_by_default_and_one_in_quick_mode(tmp_path):
    """The default is 3 seeds (--seed, --seed + 1, ...), --quick runs 1, --seeds N any other count; 0 is refused."""

    def seeds(*argv):
        options, settings = common.parse_args("heads", "", heads.Settings(), heads.QUICK, list(argv))
        return common.start_session("heads", options, settings, list(argv), tmp_path).seeds

    assert seeds("--output_dir", str(tmp_path)) == [0, 1, 2]
    assert seeds("--quick", "--output_dir", str(tmp_path)) == [0]
    assert seeds("--seeds", "2", "--seed", "5", "--output_dir", str(tmp_path)) == [5, 6]
    with pytest.raises(ValueError, match="--seeds must be at least 1, got 0"):
        seeds("--seeds", "0")
    with pytest.raises(ValueError, match="--jobs must be at least 1, got 0"):
        seeds("--jobs", "0")


@pytest.mark.slow
def test_parallel_runs_give_the_numbers_of_one_process(tmp_path):
    """--jobs 2 trains the same models as --jobs 1 (each run is seeded by itself, and both use one thread), so
    the committed results do not depend on how many runs went at once."""
    results = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        argv = ["--quick", "--seeds", "2", "--threads", "1", "--jobs", str(jobs), "--output_dir", str(out)]
        attention_scale.main(argv)
        training = json.loads((out / "results.json").read_text())["numbers"]["training"]
        results[jobs] = {label: run["final_eval_losses"] for label, run in training.items()}
    assert results[1] == results[2]
    assert all(len(losses) == 2 and losses[0] != losses[1] for losses in results[1].values())  # seeds differ


def test_a_rerun_says_how_its_verdict_compares_with_the_previous_one(tmp_path):
    """A report written over an earlier run's results.json states that run's verdict and seeds, and what this version
    of the experiment changed; a first run has no such line, and a re-run of the same version keeps the line."""
    argv = ["--quick", "--output_dir", str(tmp_path), "--threads", str(torch.get_num_threads())]
    attention_scale.main(argv)
    assert "Since the previous run" not in (tmp_path / "report.md").read_text(encoding="utf-8")
    previous = json.loads((tmp_path / "results.json").read_text())["verdict"]
    attention_scale.main(argv)
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    line = next(line for line in report.splitlines() if line.startswith("**Since the previous run**"))
    assert "(1 seed, commit " in line and f"the claim {previous}," in line
    assert attention_scale.REVISION in line
    # A third run of the same version to the same verdict keeps that line (the comparison with the version before),
    # instead of comparing with the identical second run, whose commit is marked here to tell the two apart
    results = json.loads((tmp_path / "results.json").read_text())
    (tmp_path / "results.json").write_text(json.dumps({**results, "commit": "f" * 40}))
    attention_scale.main(argv)
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert next(line for line in report.splitlines() if line.startswith("**Since the previous run**")) == line
    assert "ffffffffffff" not in report.split("## Reproduce")[0]


def test_xavier_init_is_the_papers_and_keeps_tied_embeddings_at_unit_scale(tmp_path):
    """norm_placement's paper set-up: projections Xavier-uniform (inside ±sqrt(6 / (fan_in + fan_out)), with the
    matching variance), biases 0, token embeddings N(0, 1/d), which the vaswani multiplier sqrt(d) brings to unit
    scale; the tied output projection stays the embedding matrix."""
    settings = norm_placement.Settings(hidden_size=64, num_attention_heads=2)
    fields = {**norm_placement.model_fields(settings, "post", 2), "vocab_size": 512, "max_position_embeddings": 64}
    model = AutoModelForCausalLM.from_config(decoderlab.DecoderLabConfig(**fields))
    norm_placement.xavier_init(model)
    up = model.model.layers[0].mlp.up_proj
    fan_out, fan_in = up.weight.shape
    bound = math.sqrt(6 / (fan_in + fan_out))
    assert up.weight.abs().max() <= bound and up.weight.var().item() == pytest.approx(bound**2 / 3, rel=0.05)
    assert torch.count_nonzero(up.bias) == 0
    embeddings = model.get_input_embeddings()
    assert model.lm_head.weight is embeddings.weight
    assert embeddings.weight.std().item() == pytest.approx(64**-0.5, rel=0.05)
    scaled = embeddings(torch.arange(512)[None])
    assert scaled.std().item() == pytest.approx(1.0, rel=0.05)


def test_results_of_earlier_experiments_do_not_mark_the_code_as_changed(tmp_path, monkeypatch):
    """Experiments run one after another write results into the checkout; the next report's commit must not be
    marked "with uncommitted changes" for that, but still is for a changed source file."""
    from training import checkpointing

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "experiments" / "results").mkdir(parents=True)
    (tmp_path / "experiments" / "results" / "report.md").write_text("old\n")
    (tmp_path / "model.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    monkeypatch.setattr(checkpointing, "REPO_ROOT", tmp_path)
    (tmp_path / "experiments" / "results" / "report.md").write_text("new\n")
    assert checkpointing.git_commit()["dirty"] is True
    assert checkpointing.git_commit(ignore=("experiments/results",))["dirty"] is False
    (tmp_path / "model.py").write_text("x = 2\n")
    assert checkpointing.git_commit(ignore=("experiments/results",))["dirty"] is True


def test_a_reports_command_line_names_no_machines_folders():
    """Paths inside the checkout and beside it (the offline data under ../shared) are written relative to the
    checkout, as a reader reruns the command from its root; other arguments are kept as given."""
    import torch

    from experiments import common

    root = common.REPO_ROOT
    argv = ["--output_dir", str(root / "experiments" / "results" / "x"), "--dataset_name",
            str(root.parent / "shared" / "data" / "tiny_shakespeare"), "--jobs", "2", "/elsewhere/data"]  # fmt: skip
    session = common.Session("x", None, None, argv, root, root, torch.device("cpu"))
    assert session.command() == (
        "python -m experiments.x --output_dir experiments/results/x --dataset_name ../shared/data/tiny_shakespeare "
        "--jobs 2 /elsewhere/data"
    )
