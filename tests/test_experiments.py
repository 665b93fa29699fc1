"""experiments/: every experiment runs end to end in --quick mode, and the measurements they rest on are right.

The smoke tests run each experiment's ``main`` in this process (tiny models, a few steps) into a temporary folder
and check what a reader gets: a report that states a verdict and shows PNG plots that exist. The other tests
check the instruments against references: the attention recorder against the eager attention's own output,
the softmax-Jacobian formula against autograd, the diagonal test on models built here, the KV-cache bytes against
the cache's shape arithmetic.
"""

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from experiments import attention_scale, common, heads, norm_placement, rope_relative

EXPERIMENTS = {
    "attention_scale": attention_scale,
    "rope_relative": rope_relative,
    "norm_placement": norm_placement,
    "heads": heads,
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
