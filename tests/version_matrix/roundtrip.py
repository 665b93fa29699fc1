"""Checkpoint round trip across transformers releases: save under one, load and compare under another.

    python tests/version_matrix/roundtrip.py save DIR [--source REPO]     # needs decoderlab (from REPO)
    python tests/version_matrix/roundtrip.py check DIR [DIR ...] [--resave-to OUT] [--json FILE]

``save`` builds one tiny model per position type x block layout x attention type (4 x 4 x 3), plus one per RoPE
scaling type (``ROPE_SCALINGS``), two under muP (``MUP_LAYOUTS``: the logits' and attention's multipliers), per
set of the speedrun's switches (``SPEEDRUN``) and one per-layer attention layout (``LAYOUT``), its weights
re-drawn so logits are O(1) (the default init makes them so small that a 1e-5 tolerance would hide bugs), and
writes each with ``save_pretrained`` beside ``reference.pt``: fp32 logits of a fixed batch and of a left-padded
one (with RoPE also of a sequence longer than max_position_embeddings, and of the batch again after it), and
greedy generations (cached, uncached, left-padded batch). It first checks that those agree with each
other under the saving version (a cache silently dropped during ``generate`` shows up here).

``check`` loads every checkpoint under DIR with ``trust_remote_code=True``, from the folder's own code only
(it refuses to run where ``import decoderlab`` works), recomputes the same outputs and requires identical
logits (atol 1e-5) and identical tokens. ``--resave-to OUT`` then saves loaded models again under this
version into OUT (with their references), for a later ``check`` under another release: the 16 ``resaved`` picks,
one per position type x block layout, the attention type rotating (all 48 would add a third to the matrix's run time).

Protects: the promise that a checkpoint saved under any transformers 5.12-5.25 loads and decodes
identically under every other. ``run_matrix.py`` drives it across the versions' environments.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
import traceback

# A fresh dynamic-module cache: each load must copy and import the checkpoint's own code files, never reuse
# modules another run (or another transformers) left behind. Read by transformers at import.
_MODULES_CACHE = tempfile.mkdtemp(prefix="hf_modules_")
os.environ["HF_MODULES_CACHE"] = _MODULES_CACHE
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

POSITIONS = ("rope", "sinusoidal", "learned", "none")
BLOCKS = {
    "pre": {"norm_placement": "pre"},
    "post": {"norm_placement": "post"},
    "sandwich": {"norm_placement": "sandwich"},
    "parallel": {"norm_placement": "pre", "use_parallel_residual": True},
}
ATTENTION = {"mha": 4, "gqa": 2, "mqa": 1}  # num_key_value_heads for 4 query heads
# Each position type also brings the rest of a known architecture, so more of the code crosses versions
POSITION_STYLES = {
    "rope": dict(norm_type="rmsnorm", mlp_type="gated", hidden_act="silu"),  # Llama
    "sinusoidal": dict(norm_type="layernorm", mlp_type="plain", hidden_act="relu", tie_word_embeddings=True),  # Vaswani
    "learned": dict(
        norm_type="layernorm", mlp_type="plain", hidden_act="gelu_new", tie_word_embeddings=True, attention_bias=True
    ),  # GPT-2
    "none": dict(norm_type="rmsnorm", mlp_type="gated", hidden_act="silu", qk_norm=True),  # NoPE with QK-norm
}
# RoPE scaling (transformers' ROPE_INIT_FUNCTIONS, rescaled per input length by dynamic_rope_update for "dynamic"
# and "longrope"), each on the pre-norm GQA layout; rotary dimension 8, so 4 longrope factors
ROPE_SCALINGS = {
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 2.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "longrope": {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 32},
}
# parametrization "mup" on a Llama layout (untied head) and a GPT-2 one (tied): m = 32 / 16 = 2
MUP = dict(parametrization="mup", mup_base_width=16, mup_output_multiplier=1.5)
MUP_LAYOUTS = ("rope_pre_gqa", "learned_pre_mha")
# modded-nanogpt's switches: ReLU squared in the gated and the plain MLP, the final logits soft-capped (at
# 2, so that the cap changes the O(1) logits of the re-drawn weights), the residual projections zero-initialised, the
# value residual
SPEEDRUN = {
    "speedrun": dict(hidden_act="relu2", final_logit_softcapping=2.0, zero_residual_init=True, qk_norm=True,
                     value_residual=True),
    "speedrunplain": dict(hidden_act="relu2", mlp_type="plain", final_logit_softcapping=2.0),
}
# a per-layer attention layout: a sliding layer (window 4, well under the 16 tokens a generation reaches) without
# RoPE, then a full one with it, and learned attention sinks in both (eager attention, which such a model picks)
LAYOUT = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4, no_rope_layers=[0, 1],
              attention_sinks=True)  # fmt: skip
SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
PAD = 0
NEW_TOKENS = 6
LONG = 80  # tokens, past max_position_embeddings (RoPE only: absolute positions refuse it)
ATOL = 1e-5


def resaved(name: str) -> bool:
    """One attention type per position type x block layout, rotating: each value of each axis is re-saved."""
    position, block, attention = name.split("_")
    if position not in POSITIONS:  # the RoPE scaling types: all of them
        return True
    turn = (POSITIONS.index(position) + list(BLOCKS).index(block)) % len(ATTENTION)
    return attention == list(ATTENTION)[turn]


def matrix() -> dict[str, dict]:
    """Name -> DecoderLabConfig keyword arguments, for the whole product."""
    configs = {}
    for position in POSITIONS:
        for block, block_fields in BLOCKS.items():
            for attention, kv_heads in ATTENTION.items():
                fields = dict(SIZES, **POSITION_STYLES[position], **block_fields)
                fields.update(position_embedding_type=position, num_key_value_heads=kv_heads)
                fields.update(pad_token_id=PAD, bos_token_id=None, eos_token_id=None)  # no eos: full-length generations
                if position == "rope":
                    factor = 0.5 if block == "parallel" else 1.0  # GPT-NeoX rotates part of each head
                    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
                    if factor != 1.0:
                        fields["rope_parameters"]["partial_rotary_factor"] = factor
                configs[f"{position}_{block}_{attention}"] = fields
    for kind, parameters in ROPE_SCALINGS.items():
        fields = dict(configs["rope_pre_gqa"])
        fields["rope_parameters"] = {"rope_type": kind, "rope_theta": 10000.0, **parameters}
        configs[f"rope{kind}_pre_gqa"] = fields
    for name in MUP_LAYOUTS:  # muP's multipliers (logits x 1.5 / 2, attention 1/head_dim), the head untied and tied
        configs[f"{name.split('_')[0]}mup_{name.split('_', 1)[1]}"] = dict(configs[name], **MUP)
    for name, mechanisms in SPEEDRUN.items():  # the speedrun's switches, on the pre-norm Llama layouts
        configs[f"rope{name}_pre_gqa"] = dict(configs["rope_pre_gqa"], **mechanisms)
    configs["ropelayout_pre_gqa"] = dict(configs["rope_pre_gqa"], **LAYOUT)
    return configs


@torch.no_grad()
def randomize(model: torch.nn.Module) -> None:
    """tests/conftest.py's rule: embeddings ~ N(0, 1), matrices ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2), norm
    weights ~ 1 + N(0, 0.1^2). (Not imported: this script runs where neither decoderlab nor pytest exists.)"""
    for name, param in model.named_parameters():
        if param.ndim >= 2 and "embed" in name:
            param.normal_(0.0, 1.0)
        elif param.ndim >= 2:
            param.normal_(0.0, param.shape[-1] ** -0.5)
        elif name.endswith("bias"):
            param.normal_(0.0, 0.1)
        else:
            param.normal_(1.0, 0.1)


def inputs(vocab_size: int) -> dict[str, torch.Tensor]:
    """A fixed batch of two prompts, and the same two left-padded to a common length (the second cut short)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, vocab_size, (2, 10), generator=g)  # ids from 1: 0 is the pad
    long = torch.randint(1, vocab_size, (1, LONG), generator=g)
    padded = ids.clone()
    padded[1, :4] = PAD  # row 1: a 6-token prompt, left-padded
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return {"ids": ids, "padded": padded, "mask": mask, "long": long}


@torch.no_grad()
def outputs(model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Everything compared across versions: logits and greedy generations."""
    ids, padded, mask = batch["ids"], batch["padded"], batch["mask"]
    generate = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    ones = torch.ones_like(ids)
    out = {
        "logits": model(ids).logits,
        "padded_logits": model(padded, attention_mask=mask).logits.where(mask[..., None].bool(), 0.0),  # pads: 0
        "cached": model.generate(ids, attention_mask=ones, use_cache=True, **generate),
        "uncached": model.generate(ids, attention_mask=ones, use_cache=False, **generate),
        "padded_cached": model.generate(padded, attention_mask=mask, use_cache=True, **generate),
        # row 1 of the padded batch alone, without padding: what the padded generation must reproduce
        "short_alone": model.generate(ids[1:, 4:], use_cache=True, **generate),
    }
    if model.config.position_embedding_type == "rope":  # last: "dynamic" RoPE stretches for the long input, then resets
        out["long_logits"] = model(batch["long"]).logits
        out["logits_after_long"] = model(ids).logits
    return out


def self_consistent(out: dict[str, torch.Tensor]) -> list[str]:
    """Generations that must agree within one version (cache on/off, padding on/off)."""
    problems = []
    if not torch.equal(out["cached"], out["uncached"]):
        problems.append(f"cached != uncached greedy tokens:\n{out['cached'].tolist()}\n{out['uncached'].tolist()}")
    if not torch.equal(out["padded_cached"][0], out["cached"][0]):
        problems.append("left-padded batch, row 0 (no padding) != the unpadded generation")
    if not torch.equal(out["padded_cached"][1, 4:], out["short_alone"][0]):
        problems.append("left-padded batch, row 1 != the same prompt generated alone")
    return problems


def compare(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    for key in ("logits", "padded_logits", "long_logits", "logits_after_long"):
        if (key in actual) != (key in expected):
            problems.append(f"{key}: {'missing' if key in expected else 'not in the reference'}")
        if key not in actual or key not in expected:
            continue
        diff = (actual[key] - expected[key]).abs().max().item()
        if not diff <= ATOL:
            problems.append(f"{key}: max |difference| {diff:.3g} > {ATOL}")
    for key in ("cached", "uncached", "padded_cached", "short_alone"):
        if not torch.equal(actual[key], expected[key]):
            problems.append(
                f"{key} greedy tokens differ:\n  got      {actual[key].tolist()}\n  expected {expected[key].tolist()}"
            )
    return problems


def version_tag(prefix: str) -> str:
    major, minor = transformers.__version__.split(".")[:2]
    return f"{prefix}{major}_{minor}"


def save(root: pathlib.Path, source: pathlib.Path, results: dict) -> int:
    """Save every checkpoint of the matrix under ``root``; folder names carry the version, so that module names
    (transformers_modules.<folder>) stay distinct when one process loads checkpoints of several versions."""
    sys.path.insert(0, str(source))
    from decoderlab import DecoderLabConfig, DecoderLabForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    failures = 0
    for index, (name, fields) in enumerate(matrix().items()):
        folder = root / f"{version_tag('v')}_{name}"
        try:
            torch.manual_seed(index)
            model = DecoderLabForCausalLM(DecoderLabConfig(**fields)).eval()
            randomize(model)
            model.save_pretrained(folder)
            out = outputs(model, inputs(model.config.vocab_size))
            problems = self_consistent(out)
            torch.save({"name": name, "outputs": out, "saved_with": transformers.__version__}, folder / "reference.pt")
        except Exception:  # one broken configuration must not hide the others
            problems = [traceback.format_exc(limit=-3).rstrip()]
        results[str(folder)] = problems
        failures += report(folder.name, problems)
    return failures


def load(folder: pathlib.Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=torch.float32, output_loading_info=True
    )
    problems = [
        f"{key}: {sorted(info[key])}" for key in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(key)
    ]
    module = sys.modules[type(model).__module__]
    if not pathlib.Path(module.__file__).resolve().is_relative_to(pathlib.Path(_MODULES_CACHE).resolve()):
        problems.append(f"the model class comes from {module.__file__}, not from the checkpoint's own code")
    return model.eval(), problems


def check(folders: list[pathlib.Path], resave_to: pathlib.Path | None, results: dict) -> int:
    if importlib.util.find_spec("decoderlab") is not None:
        raise SystemExit(
            f"decoderlab is importable here ({importlib.util.find_spec('decoderlab').origin}): the check would not "
            "test the checkpoints' own code. Run it from another directory, in an environment without decoderlab."
        )
    failures = 0
    for folder in folders:
        try:
            reference = torch.load(folder / "reference.pt", weights_only=True)
            model, problems = load(folder)
            actual = outputs(model, inputs(model.config.vocab_size))
            problems += compare(actual, reference["outputs"])
            if resave_to is not None and resaved(reference["name"]):
                target = resave_to / f"{version_tag('re')}_{folder.name}"
                model.save_pretrained(target)
                shutil.copy(folder / "reference.pt", target / "reference.pt")
                code, code_saved = ({p.name for p in d.glob("*.py")} for d in (folder, target))
                if code != code_saved:
                    problems.append(f"re-saved code files {sorted(code_saved)} != the checkpoint's {sorted(code)}")
        except Exception:  # one broken checkpoint must not hide the others
            problems = [traceback.format_exc(limit=-3).rstrip()]
        results[str(folder)] = problems
        failures += report(folder.name, problems)
    return failures


def report(name: str, problems: list[str]) -> int:
    print(f"{'FAIL' if problems else 'ok  '} {name}")
    for problem in problems:
        print("       " + problem.replace("\n", "\n       "))
    return bool(problems)


def checkpoints(roots: list[pathlib.Path]) -> list[pathlib.Path]:
    found = sorted(p.parent for root in roots for p in root.glob("*/reference.pt"))
    if not found:
        raise SystemExit(f"No checkpoints (folders with a reference.pt) under {', '.join(map(str, roots))}.")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_save = sub.add_parser("save", help="save the matrix of checkpoints and their reference outputs")
    p_save.add_argument("dir", type=pathlib.Path)
    p_save.add_argument("--json", type=pathlib.Path, help="write {checkpoint: [problems]} here")
    p_save.add_argument(
        "--source",
        type=pathlib.Path,
        default=pathlib.Path(__file__).resolve().parents[2],
        help="directory holding the decoderlab package to save (default: this repository)",
    )
    p_check = sub.add_parser("check", help="load checkpoints without decoderlab and compare with their references")
    p_check.add_argument("dirs", type=pathlib.Path, nargs="+", help="folders saved by `save` (or `--resave-to`)")
    p_check.add_argument("--resave-to", type=pathlib.Path, help="save the models `resaved` picks again, here")
    p_check.add_argument("--json", type=pathlib.Path, help="write {checkpoint: [problems]} here")
    args = parser.parse_args()

    torch.set_num_threads(1)  # tiny models; the driver runs several versions side by side
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: {args.command}")
    results: dict[str, list[str]] = {}
    try:
        if args.command == "save":
            failures = save(args.dir, args.source, results)
        else:
            failures = check(checkpoints(args.dirs), args.resave_to, results)
        if args.json:
            args.json.write_text(json.dumps({"transformers": transformers.__version__, "results": results}, indent=1))
    finally:
        shutil.rmtree(_MODULES_CACHE, ignore_errors=True)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
