"""benchmarks/: the scripts behind the README's Performance figures run end to end and report what they claim to.

Smoke tests only: one timed round each, nothing asserted about the times (speed is measured by running the
scripts, never inside tests), only that every comparison ran, checked its pair and wrote a usable figure.

And the references they compare against: our nanoGPT re-implementation equals decoderlab built nanoGPT-shaped
with the same weights, the Llama and GPT-2 pairs hold the same weights, and nanoGPT's recipe (schedule,
character split) is nanoGPT's.
"""

import dataclasses
import datetime
import json
import math
import subprocess
import sys

import pytest
import torch
import transformers

from benchmarks import gpu_mfu, layouts, reference_nanogpt, report, sample_efficiency, shakespeare_char
from benchmarks.common import (
    Size,
    decoderlab_state_from_nanogpt,
    gpt2_pair,
    llama_pair,
    logits,
    max_logit_difference,
    nanogpt_pairs,
    write_timing,
)
from benchmarks.speed import BENCHMARKS, COMPILE_BATCHES, combine_runs
from tests.paths import REPO_ROOT
from tests.training_runs import char_tokenizer_without_special_tokens
from training.checkpointing import git_commit
from training.data import train_bpe_tokenizer, train_char_tokenizer


def run_module(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_loss_comparison_accepts_nanogpts_characters_then_special_tokens_only():
    """The every-window loss compares with nanoGPT's only for its 65 sorted characters at ids 0..64: the
    scripts' tokenizer (then <|endoftext|>) and one made before it had that token pass; a character vocabulary
    of other text, a BPE, and the 65 characters followed by an ordinary token are refused."""
    chars = reference_nanogpt.load_char_data().chars
    assert shakespeare_char.same_characters(train_char_tokenizer([chars]), chars)
    assert shakespeare_char.same_characters(char_tokenizer_without_special_tokens([chars]), chars)
    assert not shakespeare_char.same_characters(train_char_tokenizer([chars[1:]]), chars)
    assert not shakespeare_char.same_characters(train_bpe_tokenizer([chars * 20], vocab_size=300), chars)
    extra_character = char_tokenizer_without_special_tokens([chars + "\u00e9"])  # é sorts after every character
    assert not shakespeare_char.same_characters(extra_character, chars)


def speed_report(*rows: tuple[str, str, float, float]) -> dict:
    """A one-process speed report with rows (benchmark, unit, decoderlab, reference)."""
    results = [
        {"benchmark": name, "size": "nano", "reference": "Ref", "pair": "ref", "unit": unit, "decoderlab": ours,
         "reference_value": ref, "ratio": ours / ref, "load": [1.0, 1.5]}
        for name, unit, ours, ref in rows
    ]  # fmt: skip
    return {"environment": {"processor": "test CPU"}, "sizes": {}, "repeats": 3, "results": results}


def test_runs_in_fresh_processes_combine_to_the_median_ratio_its_range_and_a_verdict():
    """--runs N: per comparison the median of the N ratios and their range; "faster" only when every run is, a
    ratio below 1.0 is the better one for ms and MB, and rows on both sides of 1.0 are within the runs' spread."""
    runs = [
        speed_report(("train", "tokens/s", 110, 100), ("decode", "tokens/s", 95, 100), ("prefill", "ms", 9, 10)),
        speed_report(("train", "tokens/s", 120, 100), ("decode", "tokens/s", 105, 100), ("prefill", "ms", 8, 10)),
        speed_report(("train", "tokens/s", 105, 100), ("decode", "tokens/s", 99, 100), ("prefill", "ms", 11, 10)),
    ]
    combined = combine_runs(runs)
    train, decode, prefill = combined["results"]
    assert train["ratio"] == pytest.approx(1.10) and train["ratio_range"] == pytest.approx([1.05, 1.20])
    assert train["verdict"] == "faster" and train["ratios"] == pytest.approx([1.10, 1.20, 1.05])
    assert decode["ratio"] == pytest.approx(0.99) and decode["verdict"] == "within the runs' spread"
    assert prefill["verdict"] == "within the runs' spread"
    assert combine_runs(runs[:2])["results"][2]["verdict"] == "faster"  # 0.9 and 0.8 of the reference's ms
    assert combined["processes"] == 3 and combined["runs"] == runs and train["load"] == [1.0, 1.5]
    slower = combine_runs([speed_report(("decode", "tokens/s", 90, 100))] * 2)["results"][0]
    assert slower["verdict"] == "slower"
    with pytest.raises(RuntimeError, match="decode .*ran in only 1 of the runs"):
        combine_runs([runs[0], speed_report(("train", "tokens/s", 1, 1), ("prefill", "ms", 1, 1))])


@pytest.mark.slow
def test_speed_runs_in_fresh_processes_writes_the_combined_table(tmp_path):
    """``--runs 2``: two processes, one combined row per comparison with the ratios of both; ``--runs 0`` is
    refused with a message naming the flag."""
    refused = subprocess.run(
        [sys.executable, "-m", "benchmarks.speed", "--runs", "0"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "--runs must be at least 1, got 0" in refused.stderr
    out = tmp_path / "speed.json"
    stdout = run_module(
        "benchmarks.speed", "--runs", "2", "--quick", "--repeats", "1", "--benchmarks", "prefill", "--json", str(out)
    )
    report = json.loads(out.read_text())
    assert report["processes"] == 2 and len(report["runs"]) == 2
    assert {row["pair"] for row in report["results"]} == {"llama", "gpt2"}
    for row in report["results"]:
        assert len(row["ratios"]) == 2 and row["ratio_range"][0] <= row["ratio"] <= row["ratio_range"][1]
    assert "verdict" in stdout and f"wrote {out}" in stdout


@pytest.mark.slow
def test_speed_quick_run_writes_every_comparison(tmp_path):
    """``python -m benchmarks.speed --quick`` (one round): every benchmark writes its rows at nano, each with
    both figures and their ratio, and the table is printed."""
    out = tmp_path / "speed.json"
    stdout = run_module("benchmarks.speed", "--quick", "--repeats", "1", "--json", str(out))
    report = json.loads(out.read_text())
    rows = report["results"]
    assert {row["size"] for row in rows} == {"nano"}
    for row in rows:
        assert row["decoderlab"] > 0 and row["reference_value"] > 0
        assert math.isclose(row["ratio"], row["decoderlab"] / row["reference_value"])
    names = {row["benchmark"] for row in rows}
    expected = {  # one row name each benchmark writes (the first four at least once per reference)
        "train": "train tokens/s",
        "memory": "train peak memory added",
        "decode": "decode tokens/s, batch 8",
        "prefill": "prefill 512 tokens, ms",
        "compile": "decode tokens/s, static cache + compile (inductor)",
    }
    assert expected.keys() == set(BENCHMARKS) and set(expected.values()) <= names
    compiled = [row for row in rows if "compile" in row["benchmark"]]
    # per compiled run: against the reference compiled the same way, and against its plain generate
    assert len(compiled) == 2 * sum(len(batches) for batches in COMPILE_BATCHES.values())
    assert f"wrote {out}" in stdout and "ratio" in stdout


@pytest.mark.slow
def test_profile_step_reports_the_breakdowns():
    """``python -m benchmarks.investigations.profile_step`` at nano (one profiled step): the matmul share of a
    training step for both models, the decoding breakdown, and the linear layers alone."""
    stdout = run_module(
        "benchmarks.investigations.profile_step", "--sizes", "nano", "--steps", "1", "--decode_repeats", "1"
    )
    for model in ("decoderlab", "LlamaForCausalLM"):
        assert any(line.strip().startswith(model) and "matmuls" in line for line in stdout.splitlines())
    assert "generate's own work" in stdout and "PyTorch ops per forward" in stdout
    assert "the linear layers alone, one token" in stdout


@pytest.mark.slow
@pytest.mark.cpu_features  # inductor's vectorised code, bf16 autocast or kernel timings
def test_gpu_mfu_dry_run_compares_like_with_like(tmp_path):
    """``python -m benchmarks.gpu_mfu --dry_run`` (CPU, a tiny model), the script to run when a GPU is lent: all
    four variants train, MFU is the FLOP count times the throughput over the peak, and decoderlab and
    LlamaForCausalLM, holding the same weights and fed the same batch, end at the same loss in each mode."""
    out, profile = tmp_path / "mfu.json", tmp_path / "profile.txt"
    stdout = run_module("benchmarks.gpu_mfu", "--dry_run", "--json", str(out), "--profile", str(profile))
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == set(gpu_mfu.VARIANTS)  # both presets beside their references (nanoGPT, Llama)
    peak = float(report["args"]["peak_tflops"]) * 1e12
    for variant, result in results.items():
        assert result["tokens_per_s"] > 0
        fpt = report["flops_per_token_by_model"][variant.split("-")[0]]
        assert math.isclose(result["mfu"], fpt * result["tokens_per_s"] / peak)
        assert result["top_kernels"] and f"## {variant}:" in profile.read_text()
    assert {(g["variant"], g["reference"]) for g in report["goals"]} >= {("decoderlab_gpt2-compiled", "nanogpt-compiled"),
                                                                         ("decoderlab-eager", "llama-eager")}  # fmt: skip
    for mode in ("compiled", "eager"):
        ours, reference = results[f"decoderlab-{mode}"], results[f"llama-{mode}"]
        assert math.isfinite(ours["final_loss"])
        assert abs(ours["final_loss"] - reference["final_loss"]) < 1e-3, mode
        assert f"decoderlab / Llama, {mode}:" in stdout


@pytest.mark.parametrize("peak", ["0", "-5", "nan", "fast"])
def test_gpu_mfu_refuses_a_peak_that_is_not_above_zero(peak, capsys):
    """MFU divides by ``--peak_tflops``: zero, a negative number, nan or no number stops the script with one line
    naming the value, before any model is built."""
    with pytest.raises(SystemExit) as stopped:
        gpu_mfu.main(["--dry_run", "--peak_tflops", peak])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--peak_tflops must" in error and peak in error, error


@pytest.mark.slow
@pytest.mark.cpu_features  # inductor's vectorised code, bf16 autocast or kernel timings
def test_gpu_check_dry_run_runs_every_check_and_writes_one_table(tmp_path):
    """``python -m benchmarks.gpu_check --dry_run``, the code a GPU run executes, on CPU at tiny sizes: every check
    has its row in the table and the JSON, the equivalence checks pass (backends, bf16 against Llama, static cache
    with a compiled forward, decoderlab and Llama ending at the same training loss), the gpt2 preset and nanoGPT
    are profiled in both modes, the recipe's subprocess ran to a finite validation loss, and the exit status is 0."""
    out = tmp_path / "check.json"
    stdout = run_module("benchmarks.gpu_check", "--dry_run", "--output_dir", str(tmp_path), "--json_out", str(out))
    report = json.loads(out.read_text())
    rows = {row["check"]: row for row in report["rows"]}
    assert report["dry_run"] is True and "cpu (dry run" in report["device"]
    must_pass = [
        "attention backends equal eager", "bf16 logits vs LlamaForCausalLM", "static cache + torch.compile == eager",
        "train decoderlab / Llama, compiled", "train decoderlab / Llama, eager", "shakespeare_char_gpu recipe",
        "compiled generate == eager greedy (GPT-2 small)",
    ]  # fmt: skip
    for check in must_pass:
        assert rows[check]["passed"] is True, rows[check]
    assert rows["no host-device sync per decoding step"]["passed"] is None  # CUDA only
    assert rows["generate batch 1, static cache + compile"]["details"]["compiled"] is True  # no fall back to eager
    for check in (
        "generate batch 1",
        "generate batch 64",
        "generate batch 1, static cache + compile",
        "train decoderlab-compiled (bf16)",
        "train llama-eager (bf16)",
    ):
        assert rows[check]["details"]["tokens_per_s"] > 0, check
    for variant in ("decoderlab_gpt2-compiled", "nanogpt-compiled", "decoderlab_gpt2-eager", "nanogpt-eager"):
        kernels = rows[f"train {variant} (bf16)"]["details"]["top_kernels"]  # the profile the GPU note reads
        assert kernels and all(k["ms_per_step"] >= 0 and k["calls_per_step"] > 0 for k in kernels), variant
        largest = rows[f"train {variant} (bf16)"]["details"]["largest_allocations_mb"]
        assert largest and largest == sorted(largest, reverse=True) and largest[0] > 0, variant
        assert f"## {variant}:" in stdout, variant
    assert "top_kernels" not in rows["train llama-compiled (bf16)"]["details"]
    recipe = rows["shakespeare_char_gpu recipe"]["details"]  # the whole command, its folder scored by evaluate.py
    assert math.isfinite(recipe["saved_eval_loss"])
    assert recipe["saved_eval_loss"] == pytest.approx(recipe["saved_eval_loss_in_run"], rel=1e-5)
    assert math.isfinite(rows["nanoGPT reference recipe (whole command)"]["details"]["best_val_loss"])
    script = rows["training script (fineweb_edu_bpe shape)"]["details"]  # prepared shards, pretrain, the bare loop
    assert script["tokens_per_s"] > 0 and script["bare_loop_tokens_per_s"] > 0 and script["data_wait_s"] >= 0
    for check in rows:
        assert any(line.startswith(check) for line in stdout.splitlines()), check  # the table's row


@pytest.mark.slow
def test_compiled_step_counts_the_products_of_each_compiled_step(tmp_path):
    """``python -m benchmarks.investigations.compiled_step --quick``: the CPU named; each model's compiled step
    calls matrix products and attention and Inductor generated kernels for it; the gpt2 preset calls exactly 6 more
    products per layer than nanoGPT (q, k and v apart: 2 forward, 4 backward) and the llama preset as many as
    Llama."""
    out = tmp_path / "compiled_step.json"
    stdout = run_module("benchmarks.investigations.compiled_step", "--quick", "--json_out", str(out))
    assert "CPU:" in stdout
    rows = {row["model"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"nanogpt", "decoderlab-gpt2", "llama", "decoderlab-llama"}
    for row in rows.values():
        assert row["products_total"] > 0 and row["attention_calls"] > 0 and row["generated_kernels"] > 0, row
    layers = rows["nanogpt"]["layers"]
    assert rows["decoderlab-gpt2"]["products_total"] - rows["nanogpt"]["products_total"] == 6 * layers
    assert rows["decoderlab-llama"]["products"] == rows["llama"]["products"]


@pytest.mark.slow
def test_shakespeare_char_reports_both_wall_times_the_cpu_and_the_ratios(tmp_path):
    """A short run of both recipes: the JSON names the CPU and the threads, and for each recipe the whole
    command's and the training loop's wall times (the command's the larger) and the every-window loss; the
    ratios are ours / nanoGPT's of those times."""
    out = tmp_path / "bench.json"
    shakespeare_char.main(["--reference_max_iters", "20", "--num_threads", "1", "--json_out", str(out), "--",
                           "--max_train_steps", "20", "--eval_steps", "none", "--load_best_model_at_end", "false",
                           "--checkpointing_steps", "none"])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["cpu"] and result["num_threads"] == 1 and result["load_average_before"] >= 0
    for name in ("ours", "nanogpt"):
        r = result[name]
        assert 0 < r["loop_s"] < r["command_s"], name
        assert 1.0 < r["val_loss_every_window"] < 5.0, name  # from ln(65) = 4.2 after 20 steps
    assert result["ours"]["steps"] == 20 and result["nanogpt"]["steps"] == 21  # nanoGPT runs 0 .. max_iters
    assert result["ratio_command"] == pytest.approx(
        result["ours"]["command_s"] / result["nanogpt"]["command_s"], rel=1e-2
    )
    assert result["ratio_loop"] == pytest.approx(result["ours"]["loop_s"] / result["nanogpt"]["loop_s"], rel=1e-2)
    assert result["wins"] is False  # 20 steps reach nowhere near 1.65


@pytest.mark.slow
def test_eval_batch_times_every_batch_size_against_the_recipes(tmp_path):
    """``python -m benchmarks.investigations.eval_batch``: one rate per batch size, the recipe's own among them at
    1.00x, the CPU named; a block count that some batch size does not divide is refused by name."""
    out = tmp_path / "eval_batch.json"
    stdout = run_module("benchmarks.investigations.eval_batch", "--batch_sizes", "16", "--blocks", "32",
                        "--repeats", "1", "--threads", "1", "--json_out", str(out))  # fmt: skip
    assert stdout.startswith("CPU: ")
    result = json.loads(out.read_text())
    chosen = str(result["recipe_batch_size"])
    assert set(result["tokens_per_s"]) == {"16", chosen} and all(v > 0 for v in result["tokens_per_s"].values())
    assert any(line.split()[:1] == [chosen] and line.endswith("1.00x") for line in stdout.splitlines())
    command = [sys.executable, "-m", "benchmarks.investigations.eval_batch", "--batch_sizes", "24", "--blocks", "32"]
    failed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert failed.returncode != 0 and "must be a multiple of every batch size" in failed.stderr


@pytest.mark.slow
def test_char_packing_times_both_encodings_of_the_same_ids(tmp_path):
    """``python -m benchmarks.investigations.char_packing``: the CPU named, both encodings of the train split timed
    (it exits before timing if their ids differ), the ratio their quotient."""
    out = tmp_path / "char_packing.json"
    stdout = run_module("benchmarks.investigations.char_packing", "--repeats", "1", "--json_out", str(out))
    assert stdout.startswith("CPU: ") and "the same ids from both" in stdout
    result = json.loads(out.read_text())
    assert result["characters"] == 1_003_854
    assert result["tokenizer_ms"] > 0 and result["char_encoder_ms"] > 0
    assert result["ratio"] == pytest.approx(result["tokenizer_ms"] / result["char_encoder_ms"], rel=0.05, abs=1)


@pytest.mark.slow
@pytest.mark.cpu_features  # inductor's vectorised code, bf16 autocast or kernel timings
def test_rms_norm_times_the_training_path_against_llamas_module_and_layer_norm(tmp_path):
    """``python -m benchmarks.investigations.rms_norm``: the CPU named, the three norms timed at every shape (it
    exits before timing if RMSNormFunction's gradients differ from autograd's through LlamaRMSNorm), the ratio their
    quotient."""
    out = tmp_path / "rms_norm.json"
    stdout = run_module(
        "benchmarks.investigations.rms_norm", "--repeats", "1", "--threads", "1", "--json_out", str(out)
    )
    assert stdout.startswith("CPU: ")
    rows = json.loads(out.read_text())["rows"]
    assert [row["dims"][-1] for row in rows] == [128, 32, 384]
    for row in rows:
        assert row["RMSNormFunction_us"] > 0 and row["LlamaRMSNorm_us"] > 0 and row["F.layer_norm_us"] > 0
        assert row["llama_over_ours"] == pytest.approx(row["LlamaRMSNorm_us"] / row["RMSNormFunction_us"], rel=1e-2)


@pytest.mark.cpu_features  # bf16 rates where the CPU has its instructions
def test_matmul_peak_times_every_size_in_float32_and_the_cpus_bfloat16(tmp_path):
    """``python -m benchmarks.matmul_peak``: the CPU named, a positive rate at every size for float32 and, where the
    CPU computes bfloat16 in hardware, for bfloat16 (and only there), with the sizes a training run takes its peak
    from."""
    from training.hardware import cpu_has_bf16

    out = tmp_path / "matmul_peak.json"
    stdout = run_module("benchmarks.matmul_peak", "--repeats", "1", "--threads", "1", "--json_out", str(out))
    assert stdout.startswith("CPU: ")
    result = json.loads(out.read_text())
    assert set(result["gflops_per_s"]) == ({"float32", "bfloat16"} if cpu_has_bf16() else {"float32"})
    for rates in result["gflops_per_s"].values():
        assert set(rates) == {str(size) for size in result["sizes"]} and min(rates.values()) > 0
    assert set(result["measured_sizes"]) <= set(result["sizes"])


def test_nanogpt_gap_steps_compute_what_the_models_they_take_apart_compute():
    """benchmarks.investigations.nanogpt_gap: nanoGPT with q, k, v as three layers gives nanoGPT's logits and
    gradients, and decoderlab's modules called in sequence give ``model(input_ids=x, labels=y).loss`` (else the gap
    it reports would compare different computations)."""
    import torch

    from benchmarks.common import SIZES, nanogpt_pairs
    from benchmarks.investigations.nanogpt_gap import modules_loss, split_qkv

    pair = nanogpt_pairs(SIZES["nano"])[0]
    x, y = torch.randint(65, (2, 64)), torch.randint(65, (2, 64))
    nanogpt, split = pair.reference.train(), split_qkv(pair.reference).train()
    nanogpt(x, y)[1].backward()
    split(x, y)[1].backward()
    torch.testing.assert_close(split(x, y)[0], nanogpt(x, y)[0])
    for block, split_block in zip(nanogpt.transformer.h, split.transformer.h):
        grads = torch.cat(
            [split_block.attn.q.weight.grad, split_block.attn.k.weight.grad, split_block.attn.v.weight.grad]
        )
        torch.testing.assert_close(grads, block.attn.c_attn.weight.grad)
    decoderlab = pair.ours.train()
    torch.testing.assert_close(modules_loss(decoderlab, x, y), decoderlab(input_ids=x, labels=y).loss)


@pytest.mark.slow
def test_nanogpt_gap_times_the_four_steps_against_nanogpts(tmp_path):
    """``python -m benchmarks.investigations.nanogpt_gap``: the CPU named, the four steps timed, each ratio nanoGPT's
    time over the row's (nanoGPT's own row 1.0)."""
    out = tmp_path / "nanogpt_gap.json"
    stdout = run_module("benchmarks.investigations.nanogpt_gap", "--repeats", "1", "--steps", "1", "--threads", "1",
                        "--json_out", str(out))  # fmt: skip
    assert stdout.startswith("CPU: ")
    rows = json.loads(out.read_text())["rows"]
    assert [row["step"] for row in rows] == [
        "nanoGPT",
        "nanoGPT, q/k/v as three layers",
        "decoderlab's modules, called directly",
        "DecoderLabForCausalLM",
    ]
    for row in rows:
        assert row["nanogpt_over_this"] == pytest.approx(rows[0]["ms"] / row["ms"], rel=1e-2)


# ----------------------------------------------------------------------------------------------
# The benchmarks' references: nanoGPT re-implemented, and the pairs with the same weights

SMALL = Size(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50, block_size=16, batch_size=2)


def test_nanogpt_reimplementation_equals_decoderlab_nanogpt_shaped():
    """Our nanoGPT re-implementation and decoderlab configured as nanoGPT (learned positions, bias-free
    LayerNorm, exact GELU, tied embeddings), loaded with the same weights, give the same logits: the
    benchmark's "same weights" nanoGPT pair compares implementations, not models."""
    same_weights = nanogpt_pairs(SMALL)[0]
    with torch.no_grad():  # larger weights than the 0.02 init, so that a 1e-5 tolerance means something
        for param in same_weights.reference.parameters():
            param.normal_(0.0, 0.5)
    same_weights.ours.load_state_dict(
        decoderlab_state_from_nanogpt(same_weights.reference.state_dict(), SMALL.hidden_size)
    )
    x = torch.randint(0, SMALL.vocab_size, (3, SMALL.block_size))
    torch.testing.assert_close(logits(same_weights.ours, x), logits(same_weights.reference, x), rtol=0, atol=1e-5)
    assert logits(same_weights.ours, x).abs().max() > 1  # not vanishing logits


def test_benchmark_pairs_agree():
    """The Llama and GPT-2 pairs built for the speed benchmark hold the same weights (logits agree);
    the Llama-shaped one exactly."""
    assert max_logit_difference(llama_pair(SMALL), SMALL) == 0.0
    assert max_logit_difference(gpt2_pair(SMALL), SMALL) < 1e-5


def test_nanogpt_recipe_runs_and_reports(tmp_path):
    """A few steps of the reference recipe: the documented keys, losses that start near ln(65) (uniform over
    Tiny Shakespeare's 65 characters) and are finite, steps 0..max_iters inclusive, and torch's thread count
    restored afterwards."""
    threads = torch.get_num_threads()
    result = reference_nanogpt.run_nanogpt_recipe(max_iters=4, eval_interval=2, eval_iters=1, num_threads=1)
    assert torch.get_num_threads() == threads
    assert result["steps"] == 5 and [h["iter"] for h in result["history"]] == [0, 2, 4]
    assert abs(result["history"][0]["val"] - math.log(65)) < 0.3
    for key in ("wall_time_s", "train_time_s", "tokens_per_s", "val_loss", "val_loss_every_window"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["model_config"]["vocab_size"] == 65 and result["recipe"]["lr_decay_iters"] == 4


def test_nanogpt_learning_rate_schedule():
    """nanoGPT's schedule: linear warm-up (it + 1) / (warmup + 1), cosine to min_lr at lr_decay_iters, then flat."""
    recipe = reference_nanogpt.NanoGPTRecipe()
    assert reference_nanogpt.learning_rate_at(0, recipe) == pytest.approx(1e-3 / 101)
    assert reference_nanogpt.learning_rate_at(99, recipe) == pytest.approx(1e-3 * 100 / 101)
    assert reference_nanogpt.learning_rate_at(100, recipe) == pytest.approx(1e-3)
    assert reference_nanogpt.learning_rate_at(1050, recipe) == pytest.approx((1e-3 + 1e-4) / 2)
    assert reference_nanogpt.learning_rate_at(2000, recipe) == pytest.approx(1e-4)
    assert reference_nanogpt.learning_rate_at(5000, recipe) == pytest.approx(1e-4)


def test_nanogpt_data_is_the_character_split():
    """65 characters, the first 90% for training: the split nanoGPT's prepare.py writes."""
    data = reference_nanogpt.load_char_data()
    assert data.vocab_size == 65
    assert len(data.train) == 1_003_854 and len(data.val) == 111_540
    with pytest.raises(ValueError, match="Tiny Shakespeare not found"):
        reference_nanogpt.load_char_data("/nonexistent/input.txt")


def test_every_results_file_starts_with_what_reproduces_it(tmp_path):
    """``write_timing`` (every benchmark's JSON writer goes through ``write_results``) records the checkout's commit
    and whether it had uncommitted changes, the date, the CPU, the threads and the library versions, before the
    figures: no results file may lack them (a figure without its machine and commit cannot be compared)."""
    out = tmp_path / "timing.json"
    write_timing(str(out), 3, 0.5, rows=[{"ratio": 1.0}])
    result = json.loads(out.read_text())
    assert list(result)[:4] == ["provenance", "machine", "load_average", "rows"]
    provenance = result["provenance"]
    assert provenance["recorded"] == "at run time"
    assert provenance["commit"] == git_commit()["commit"] and len(provenance["commit"]) == 40
    assert isinstance(provenance["dirty"], bool)
    assert datetime.datetime.fromisoformat(provenance["date"]).tzinfo is not None
    assert provenance["cpu"] and provenance["threads"] == 3 and provenance["cores"] >= 1
    assert provenance["versions"]["torch"] == torch.__version__
    assert provenance["versions"]["transformers"] == transformers.__version__


@pytest.mark.slow
def test_sampler_curves_runs_each_sampling_beside_the_reference_and_plots_them(tmp_path):
    """A short run of the window-sampling benchmark: one validation curve per sampling asked for and one for
    nanoGPT's recipe, each with its best loss at one of its evaluated steps, the same steps for all, the CPU named,
    and the plot drawn; the report renders its table from the JSON."""
    from benchmarks import report, sampler_curves

    out = tmp_path / "curves.json"
    sampler_curves.main(["--train_chars", "4096", "--val_chars", "1024", "--passes", "1", "--eval_steps", "2",
                         "--eval_iters", "1", "--threads", "1", "--samplings", "shifted",
                         "--json_out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["provenance"]["cpu"] and result["steps"] == 4 and result["passes"] == 1.0
    names = [run["sampling"] for run in result["runs"]]
    assert names == ["shifted", "reference"]
    for run in result["runs"]:
        assert [p["step"] for p in run["curve"]] == [0, 2, 4] if run["sampling"] == "reference" else [2, 4]
        assert run["best_val"] == min(p["val"] for p in run["curve"]) and 1.0 < run["best_val"] < 5.0
    assert out.with_suffix(".png").stat().st_size > 10_000
    table = "\n".join(line.text for line in report.sampler_curves_rows(result, result))
    assert "window_sampling=shifted" in table and "nanoGPT's recipe" in table


@pytest.mark.parametrize(
    "before, now",
    [("shakespeare_char_adamw.yaml", "shakespeare_char.yaml"),
     ("shakespeare_char_gpu_adamw.yaml", "shakespeare_char_gpu.yaml")],
)  # fmt: skip
def test_each_adamw_recipe_is_its_muon_recipe_before_muon(before, now):
    """The AdamW recipes are the baselines the Muon recipes are measured against (benchmarks.sample_efficiency times
    shakespeare_char_adamw.yaml against shakespeare_char.yaml; experiments.sample_efficiency trains both pairs): each
    must differ from its Muon recipe only in how the model trains (the optimizer and its schedule, the model's
    fields) and where it writes, so that a comparison measures the optimisation on the same data, evaluation and
    checkpoints. The demo baseline is the 1250-step recipe the committed timings measured."""
    from experiments.common import TRAINING_FIELDS
    from training.args import TrainConfig, parse_config

    configs = REPO_ROOT / "training" / "configs"
    was = parse_config(TrainConfig, ["--config", str(configs / before)])
    is_now = parse_config(TrainConfig, ["--config", str(configs / now)])
    differ = {f.name for f in dataclasses.fields(TrainConfig) if getattr(was, f.name) != getattr(is_now, f.name)}
    assert "optimizer" in differ and differ <= {*TRAINING_FIELDS, "model", "output_dir"}, differ
    assert (was.optimizer, is_now.optimizer) == ("adamw", "muon")
    assert was.output_dir != is_now.output_dir  # a run of one does not refuse to start over the other's folder
    if before == "shakespeare_char_adamw.yaml":
        assert (was.max_train_steps, was.per_device_train_batch_size) == (1250, 16)


def test_sample_efficiency_reads_the_grid_from_the_experiments_results(tmp_path):
    """The benchmark does not re-run the experiment: its grid is the experiment's results.json summarised (tokens per
    seed, their mean, how many times fewer than the recipe before), and a folder without that experiment's results
    is refused with the command that writes them."""
    folder = REPO_ROOT / "experiments" / "results" / "sample_efficiency"
    committed = json.loads((folder / "results.json").read_text())
    grid = sample_efficiency.read_grid(folder)
    assert grid["experiment"] == "experiments/results/sample_efficiency"
    assert (grid["wall_time_s"], grid["seeds"]) == (committed["wall_time_s"], committed["seeds"])
    before, recipe = committed["numbers"]["demo"]["before"]["tokens"], committed["numbers"]["demo"]["recipe"]["tokens"]
    assert grid["demo"]["recipe"]["tokens"] == recipe
    assert grid["demo"]["recipe"]["tokens_mean"] == pytest.approx(sum(recipe) / len(recipe))
    assert grid["demo"]["recipe"]["fewer_tokens_x"] == pytest.approx(sum(before) / sum(recipe))
    assert grid["demo"]["before"]["fewer_tokens_x"] == 1.0
    with pytest.raises(ValueError, match="run `python -m experiments.sample_efficiency`"):
        sample_efficiency.read_grid(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"experiment": "heads"}))
    with pytest.raises(ValueError, match="holds the results of 'heads', not of sample_efficiency"):
        sample_efficiency.read_grid(tmp_path)


@pytest.mark.slow
def test_sample_efficiency_quick_run_times_both_recipe_files(tmp_path):
    """A --quick run: make demo's command with the AdamW recipe file and with the recipe now, alternating, with their
    ratios (the two train differently: their losses differ), and the grid read from the experiment's committed
    results; nothing else is written beside the JSON (the figure is the experiment's)."""
    out = tmp_path / "sample_efficiency.json"
    sample_efficiency.main(["--quick", "--repeats", "1", "--num_threads", "1", "--json_out", str(out)])
    result = json.loads(out.read_text())
    grid, recipes = result["grid"], result["recipes"]
    assert grid["target_loss"] == 1.70 and {"before", "muon", "recipe"} <= set(grid["demo"])
    assert recipes["recipe_files"] == {
        "before": "training/configs/shakespeare_char_adamw.yaml",
        "now": "training/configs/shakespeare_char.yaml",
    }
    assert recipes["before"]["steps"] == recipes["now"]["steps"] == 10
    assert recipes["before"]["val_loss_every_window"] != recipes["now"]["val_loss_every_window"]
    assert recipes["ratio_loop"] == pytest.approx(recipes["now"]["loop_s"] / recipes["before"]["loop_s"], rel=1e-2)
    assert recipes["meets_goal"] is False  # 10 steps reach nowhere near 1.60
    assert [path.name for path in tmp_path.iterdir()] == ["sample_efficiency.json"]


@pytest.mark.slow
@pytest.mark.cpu_features  # kernel timings
def test_few_rows_decode_times_decoding_with_the_product_chosen_and_off_against_the_reference(tmp_path):
    """``python -m benchmarks.investigations.few_rows_decode``: the CPU named, for each preset decoderlab as chosen,
    with the few-rows product off and the reference timed, and every shape it timed listed with its choice (the
    layers' shapes at the prompt's rows and at one row, the head's at one row)."""
    out = tmp_path / "few_rows_decode.json"
    stdout = run_module(
        "benchmarks.investigations.few_rows_decode", "--size", "nano", "--repeats", "1", "--threads", "1",
        "--json_out", str(out),
    )  # fmt: skip
    assert stdout.startswith("CPU: ")
    rows = json.loads(out.read_text())["rows"]
    assert [row["preset"] for row in rows] == ["gpt2", "llama"]
    for row in rows:
        assert list(row["tokens_per_s"]) == ["decoderlab", "decoderlab, few-rows product off",
                                             {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[row["preset"]]]  # fmt: skip
        assert all(rate > 0 for rate in row["tokens_per_s"].values())
        assert row["few_rows_kept"] and all(isinstance(kept, bool) for kept in row["few_rows_kept"].values())
        assert any(shape.endswith(", 1 rows") for shape in row["few_rows_kept"])


def test_layouts_quick_run_compares_each_backend_side_by_side_and_measures_the_cache(tmp_path):
    """``python -m benchmarks.layouts --quick`` on SDPA and eager (nothing to compile): each workload at both blocks on
    each backend, the windowed and the full model's figures with the rounds' own ratios (their median) and their peaks,
    the backend named and marked as not skipping blocks; the cache after each generation holds what the formula says
    (a sliding layer the last w - 1 tokens, a full one L - 1) and stays within the bound; the goals are decided from
    the rows (no backend that skips blocks ran: training's is not met, and says so); the report renders the rows."""
    out = tmp_path / "layouts.json"
    layouts.main(["--quick", "--backends", "sdpa", "eager", "--threads", "1", "--json_out", str(out)])
    result = json.loads(out.read_text())
    assert result["provenance"]["threads"] == 1 and result["machine"].startswith("CPU: ")
    blocks, window = layouts.QUICK["blocks"], layouts.QUICK["window"]
    expected = {(w, b, k) for w in layouts.WORKLOADS for b in blocks for k in ("sdpa", "eager")}
    assert {(r["workload"], r["block"], r["backend"]) for r in result["rows"]} == expected
    for row in result["rows"]:
        assert "error" not in row and row["skips_blocks"] is False
        full, windowed = (row["samples_s"][layout][0] for layout in ("full", "windowed"))  # one round
        assert row["ratio"] == pytest.approx(windowed / full if row["workload"] == "masks" else full / windowed)
        assert row["ratio_range"] == [row["ratio"], row["ratio"]] and min(row["figures"].values()) > 0
        assert row["unit"] == ("ms" if row["workload"] == "masks" else "tokens/s")
        peak = row["peak_mb"]
        assert row["peak_ratio"] == (pytest.approx(peak["windowed"] / peak["full"]) if peak["full"] else None)
        # SDPA's full model makes no mask at all (its kernel's own causal path): no operator to list
        assert set(row["profile_ms"]) == {"full", "windowed"} and row["profile_ms"]["windowed"]
    for row in result["cache"]:
        L = row["tokens"]
        assert row["windowed"]["tokens_held"] == [min(L - 1, window - 1)] * 3 + [L - 1]
        assert row["full"]["tokens_held"] == [L - 1] * 4
        for side in ("full", "windowed"):
            assert row[side]["bytes"] == row[side]["expected_bytes"]
        assert row["ratio"] <= row["bound"] == pytest.approx((3 * window + L) / (4 * L))
    training, cache = result["goals"]
    assert training["met"] is False and training["evidence"] == "no such backend ran"
    assert cache["met"] is True
    table = "\n".join(line.text for line in report.layouts_rows(result) + report.layouts_cache_rows(result))
    assert "`sdpa`" in table and "`eager`" in table and "| **not met** |" in table and "| **met** |" in table


def test_a_backend_that_cannot_run_a_workload_gets_a_row_saying_what_it_raised(monkeypatch):
    """A workload a backend cannot run (torch's flex attention has no backward on a CPU) becomes a row with the error's
    type, first line and where torch raised it, instead of figures; the training goal counts it as not met and quotes
    it; the report shows the row as not run."""
    models = layouts.build_pair(window=4, max_positions=32)

    def cannot(name, model, size, new_tokens):
        def work():
            raise NotImplementedError("FlexAttention does not support backward on CPU.\nmore detail")

        return work, 1

    monkeypatch.setattr(layouts, "workload", cannot)
    row = layouts.compare("flex_attention", 32, "train", models, layouts.size_of(32, 64), 4, repeats=1)
    assert row["error"] == "NotImplementedError: FlexAttention does not support backward on CPU."
    assert row["skips_blocks"] is True and "figures" not in row
    (goal, _) = layouts.goals([row], [], goal_block=32)
    assert goal["met"] is False and goal["evidence"] == f"flex_attention: {row['error']}"
    line = report.layouts_rows({"rows": [row]})[-1].text
    assert "`flex_attention` | yes | not run: NotImplementedError: FlexAttention" in line


@pytest.mark.slow
def test_layouts_quick_run_on_flex_attention_skips_blocks_in_the_forward(tmp_path):
    """``--quick --backends flex_attention``: flex attention's forward and its block masks run for both layouts (the
    block mask is what lets the kernel skip the blocks outside the window); every workload it cannot run here says
    what it raised."""
    out = tmp_path / "layouts.json"
    layouts.main(["--quick", "--backends", "flex_attention", "--threads", "1", "--json_out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {r["backend"] for r in rows} == {"flex_attention"} and all(r["skips_blocks"] for r in rows)
    assert all("figures" in r for r in rows if r["workload"] in ("forward", "masks"))
    assert all(("error" in r) != ("figures" in r) for r in rows)
