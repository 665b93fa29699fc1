"""Model cards for decoderlab checkpoints: Hub metadata, the architecture, the recipe and a training curve.

``write_model_card(folder, ...)`` reads the folder's ``config.json`` and ``metrics.jsonl``, draws
``training_curve.png`` and writes ``README.md`` from the Jinja template ``model_cards/template.md``
through ``huggingface_hub.ModelCard``. The training scripts call it at the end of a run;
``python -m decoderlab.model_card FOLDER`` (re)writes the card of any checkpoint.

The card names its Hub repository as ``HUB_ID_PLACEHOLDER`` until ``decoderlab.push`` fills in the
repository it uploads to (``card_for_repo``).
"""

import argparse
import json
import math
import pathlib
import re

import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from transformers.utils import logging

from .cli import UsageError, run_command
from .configuration_decoderlab import DecoderLabConfig

logger = logging.get_logger(__name__)

CARD_NAME = "README.md"
METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "training_curve.png"
TEMPLATE_NAME = "template.md"
LICENSE = "apache-2.0"
HUB_ID_PLACEHOLDER = "<hub-user>/<model-name>"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
EVALUATION_SECTION = re.compile(r"^## Evaluation\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)

# One line per DecoderLabConfig switch, shown beside its value in the architecture table
SWITCH_MEANINGS = {
    "vocab_size": "tokens in the vocabulary",
    "hidden_size": "width of the residual stream",
    "num_hidden_layers": "decoder blocks",
    "num_attention_heads": "query heads per attention layer",
    "num_key_value_heads": "key/value heads: = query heads is MHA, fewer is GQA, 1 is MQA",
    "head_dim": "width of each head",
    "intermediate_size": "MLP hidden width",
    "max_position_embeddings": "longest sequence for learned/sinusoidal positions; RoPE cache size",
    "attention_scale": "factor in softmax(QK^T * scale)",
    "qk_norm": "normalise each head's queries and keys before RoPE",
    "attention_bias": "biases in q/k/v/o projections",
    "attention_dropout": "dropout on attention weights (training only)",
    "value_residual": "later layers mix the first layer's values in: v + l (v_1 - v), l learned",
    "layer_types": "each layer's attention: full, or sliding (the last sliding_window tokens only)",
    "sliding_window": "tokens a sliding layer's query sees, itself included",
    "attention_sinks": "a learned logit per head joins each softmax's denominator (gpt-oss's sinks)",
    "position_embedding_type": "how positions enter: rope, sinusoidal, learned or none",
    "rope_parameters": "RoPE base and scaling",
    "no_rope_layers": "per layer: 1 applies RoPE, 0 skips it (SmolLM3's NoPE layers)",
    "no_rope_layer_interval": "every n-th layer skips RoPE (SmolLM3's shorthand for no_rope_layers)",
    "norm_placement": "pre: x + f(LN(x)); post: LN(x + f(x)); sandwich: x + LN(f(LN(x)))",
    "norm_type": "LayerNorm or RMSNorm",
    "norm_eps": "epsilon inside each norm",
    "norm_bias": "LayerNorm bias",
    "use_parallel_residual": "GPT-J/NeoX block: x + attn(LN1(x)) + mlp(LN2(x))",
    "mlp_type": "gated: down(act(gate(x)) * up(x)); plain: down(act(up(x)))",
    "hidden_act": "MLP activation",
    "mlp_bias": "biases in the MLP projections",
    "embedding_multiplier": "factor on the token embeddings, before positions are added (Vaswani et al.: sqrt(hidden))",
    "hidden_dropout": "dropout on embeddings and sublayer outputs (training only)",
    "tie_word_embeddings": "lm_head shares the token embedding matrix",
    "initializer_range": "std of the initial weights",
    "embedding_initializer_range": "std of the initial token embeddings",
    "scale_residual_init": "GPT-2 init: residual projections scaled by 1/sqrt(2 x layers)",
    "parametrization": "standard, or mup: init, rates and multipliers that keep the best learning rate across widths",
    "mup_base_width": "muP: the hidden_size its learning rate was tuned at",
    "mup_base_shapes": "muP: the base model's other sizes, which each matrix's width multipliers are taken against",
    "mup_output_multiplier": "muP: the logits are multiplied by this / (hidden_size / mup_base_width)",
    "mup_attention_multiplier": "muP: the attention scale is this / head_dim (None: sqrt of the base head_dim)",
    "zero_residual_init": "residual projections (o_proj, down_proj) start at zero",
    "final_logit_softcapping": "logits capped as c * tanh(logits / c)",
    "use_cache": "keep a key/value cache while generating",
    "pad_token_id": "padding token",
    "bos_token_id": "beginning-of-sequence token",
    "eos_token_id": "end-of-sequence token",
}

# training-summary keys the scripts pass, with their labels in the recipe table; other keys are shown as written
RECIPE_LABELS = {
    "steps": "Optimizer steps",
    "steps_from_budget": "Steps from the budget",
    "tokens": "Tokens seen",
    "flops": "Training compute (FLOPs)",
    "flops_per_token": "FLOPs per token (6N + attention, forward and backward)",
    "batch_size": "Batch size (sequences)",
    "block_size": "Block size (tokens)",
    "learning_rate": "Peak learning rate",
    "embedding_learning_rate": "Peak learning rate of the token embeddings",
    "optimizer_groups": "Optimizer groups (peak rate, weight decay)",
    "precision": "Precision",
    "hardware": "Hardware",
    "wall_time_s": "Wall time",
    "final_train_loss": "Final train loss",
    "final_eval_loss": "Final eval loss",
    "saved_weights_step": "Saved weights: the best evaluation's step",
    "best_loss": "Best periodic eval loss",
    "best_perplexity": "Best periodic eval perplexity",
    "best_chosen_by": "Best chosen by",
    "early_stopping": "Early stopping",
}

# eval_results keys -> (model-index metric type, label); other numeric keys keep their own name
METRICS = {"eval_loss": ("loss", "Cross-entropy loss (nats/token)"), "perplexity": ("perplexity", "Perplexity")}
EVAL_CONTEXT_KEYS = ("dataset", "split", "dataset_config")


def template_path() -> pathlib.Path:
    """``model_cards/template.md``: beside the package in a source checkout, inside it when installed."""
    package = pathlib.Path(__file__).resolve().parent
    candidates = (package / "model_cards" / TEMPLATE_NAME, package.parent / "model_cards" / TEMPLATE_NAME)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"The model card template is missing; looked for {', '.join(map(str, candidates))}. "
        "Reinstall decoderlab (pip install -e .) or restore model_cards/template.md."
    )


# ----------------------------------------------------------------------------------------------
# Reading the checkpoint


def read_metrics(path: pathlib.Path) -> list[dict]:
    """The records of a ``metrics.jsonl``: one JSON object per line, each with an integer ``step``."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path.name} line {number} is not JSON ({err}): {line[:80]!r}") from err
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(
                f"{path.name} line {number} must be a JSON object with an integer 'step', got {line[:80]!r}."
            )
        records.append(record)
    return records


def count_parameters(config: DecoderLabConfig) -> tuple[int, int]:
    """(all parameters, those in the token embedding) of the causal LM, built on the meta device (no memory)."""
    from .modeling_decoderlab import DecoderLabForCausalLM

    with torch.device("meta"):
        model = DecoderLabForCausalLM(config)
    return sum(p.numel() for p in model.parameters()), model.get_input_embeddings().weight.numel()


# ----------------------------------------------------------------------------------------------
# Describing the architecture


def attention_kind(config: DecoderLabConfig) -> str:
    if config.num_key_value_heads == config.num_attention_heads:
        return "mha"
    return "mqa" if config.num_key_value_heads == 1 else "gqa"


def mlp_tag(config: DecoderLabConfig) -> str:
    if config.mlp_type == "plain":
        return f"{config.hidden_act.replace('_', '-')}-mlp"
    glu = {"silu": "swiglu", "swish": "swiglu", "relu": "reglu"}
    return glu.get(config.hidden_act, "geglu" if config.hidden_act.startswith("gelu") else "glu")


def mlp_name(config: DecoderLabConfig) -> str:
    names = {"swiglu": "SwiGLU", "geglu": "GeGLU", "reglu": "ReGLU", "glu": "gated"}
    return f"plain {config.hidden_act}" if config.mlp_type == "plain" else names[mlp_tag(config)]


def mechanism_tags(config: DecoderLabConfig) -> list[str]:
    """Hub tags naming the mechanisms this configuration switches on."""
    positions = {"rope": "rope", "sinusoidal": "sinusoidal-positions", "learned": "learned-positions", "none": "nope"}
    tags = [
        "decoderlab",
        "custom_code",
        positions[config.position_embedding_type],
        attention_kind(config),
        f"{config.norm_placement}-ln",
        config.norm_type,
        mlp_tag(config),
    ]
    optional = {"parallel-residual": config.use_parallel_residual, "qk-norm": config.qk_norm}
    optional["tied-embeddings"] = config.tie_word_embeddings
    return tags + [tag for tag, on in optional.items() if on]


def describe_mechanisms(config: DecoderLabConfig) -> str:
    """One sentence naming each mechanism, for readers who do not read config.json."""
    heads, kv, hs = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = {
        "mha": f"multi-head attention ({heads} heads of width {hs})",
        "gqa": f"grouped-query attention ({heads} query heads sharing {kv} key/value heads, width {hs})",
        "mqa": f"multi-query attention ({heads} query heads sharing one key/value head, width {hs})",
    }[attention_kind(config)]
    if config.position_embedding_type == "rope":
        positions = f"rotary position embeddings (RoPE, theta = {config.rope_parameters['rope_theta']:g})"
    else:
        positions = {
            "sinusoidal": "fixed sinusoidal positions",
            "learned": "learned absolute positions",
            "none": "no position embeddings (NoPE)",
        }[config.position_embedding_type]
    norm = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}[config.norm_type]
    block = "parallel attention and MLP (GPT-J)" if config.use_parallel_residual else "sequential attention then MLP"
    parts = [
        f"{config.num_hidden_layers} blocks of width {config.hidden_size}",
        f"{config.norm_placement}-norm {norm}",
        block,
        attention + (" with QK-norm" if config.qk_norm else ""),
        positions,
        f"{mlp_name(config)} MLP of width {config.intermediate_size}",
        "tied input and output embeddings" if config.tie_word_embeddings else "separate input and output embeddings",
    ]
    if config.embedding_multiplier != 1.0:
        parts.append(f"token embeddings multiplied by {config.embedding_multiplier:.4g}")
    if config.value_residual:
        parts.append("a value residual (later layers mix in the first layer's values)")
    if config.final_logit_softcapping is not None:
        parts.append(f"logits soft-capped at {config.final_logit_softcapping:g}")
    return "Mechanisms: " + "; ".join(parts) + "."


def format_switch(config: DecoderLabConfig, name: str) -> str:
    value = getattr(config, name, None)  # configs without RoPE have no rope_parameters
    if name == "attention_scale" and value is None:
        return f"`None` (1/sqrt(head_dim) = {config.head_dim**-0.5:.4g})"
    if name == "rope_parameters" and config.position_embedding_type != "rope":
        return "unused (no RoPE)"
    if name == "rope_parameters":
        return ", ".join(f"`{key}={val}`" for key, val in value.items())
    return f"`{value}`"


def architecture_rows(config: DecoderLabConfig) -> list[dict]:
    """One row per DecoderLabConfig switch, in the order the config declares them."""
    return [
        {"name": name, "value": format_switch(config, name), "meaning": SWITCH_MEANINGS.get(name, "")}
        for name in DecoderLabConfig.__annotations__
    ]


# ----------------------------------------------------------------------------------------------
# The training recipe, the curve and the evaluation


def human_count(n: float) -> str:
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:g}"


def format_value(key: str, value) -> str:
    if key == "wall_time_s" and isinstance(value, (int, float)):
        return f"{value:.0f} s" if value < 120 else f"{value / 60:.1f} min" if value < 7200 else f"{value / 3600:.1f} h"
    if isinstance(value, bool) or value is None:
        return f"`{value}`"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", " ")  # one Markdown table cell


def summarize_metrics(records: list[dict]) -> dict:
    """The recipe facts that metrics.jsonl holds: steps, tokens, wall time and the last losses."""
    summary = {}
    if records:
        summary["steps"] = max(record["step"] for record in records)
    for key, column in (
        ("tokens", "tokens"), ("wall_time_s", "elapsed_s"),
        ("final_train_loss", "train_loss"), ("final_eval_loss", "eval_loss"),
    ):  # fmt: skip
        values = [record[column] for record in records if record.get(column) is not None]
        if values:
            summary[key] = values[-1]
    return summary


def recipe_rows(dataset_text: str, base_model: str | None, training: dict, records: list[dict]) -> list[tuple]:
    """(label, value) rows: what the script reported, completed from metrics.jsonl."""
    facts = {**summarize_metrics(records), **training}
    rows = [("Dataset", dataset_text)] + ([("Base model", f"`{base_model}`")] if base_model else [])
    ordered = [key for key in RECIPE_LABELS if key in facts] + [key for key in facts if key not in RECIPE_LABELS]
    for key in ordered:
        rows.append((RECIPE_LABELS.get(key, key.replace("_", " ").capitalize()), format_value(key, facts[key])))
    return rows


def plot_training_curve(records: list[dict], path: pathlib.Path):
    """Draw train/eval loss (and the learning rate, if logged) against steps into ``path``.

    Returns the matplotlib Figure, or None when matplotlib is not installed (a training extra)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    except ImportError:
        logger.warning(
            "matplotlib is not installed, so the model card has no training curve; "
            "install it with `pip install 'decoderlab[train]'`."
        )
        return None
    # a final evaluation of the best step's weights (load_best_model_at_end) is drawn at that step, as a point
    saved = [r for r in records if r.get("best_global_step") is not None and r.get("eval_loss") is not None]
    records = [r for r in records if r.get("best_global_step") is None]
    logged = lambda key: [r for r in records if r.get(key) is not None]
    series = lambda key: ([r["step"] for r in logged(key)], [r[key] for r in logged(key)])
    has_lr = bool(logged("lr"))
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    axes = fig.subplots(1, 2, width_ratios=(2, 1)) if has_lr else [fig.subplots()]
    for key, style in (("train_loss", {"lw": 1.2}), ("eval_loss", {"marker": "o", "ms": 3.5, "lw": 1.2})):
        steps, values = series(key)
        if steps:
            axes[0].plot(steps, values, label=key.replace("_", " "), **style)
    for record in saved[-1:]:
        axes[0].plot(
            record["best_global_step"], record["eval_loss"], "*", ms=10, label="saved model (best step, every block)"
        )
    axes[0].set(xlabel="step", ylabel="loss (nats/token)", title="Loss")
    if axes[0].lines:
        axes[0].legend()
    if has_lr:
        axes[1].plot(*series("lr"), color="tab:green", lw=1.2)
        axes[1].set(xlabel="step", ylabel="learning rate", title="Learning rate")
        axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    return fig


def evaluation(eval_results: dict, dataset: str | None) -> tuple[list[EvalResult], list[dict]]:
    """model-index entries and table rows for ``{"eval_loss": 1.5, "perplexity": 4.5, "dataset": .., "split": ..}``."""
    dataset_id = eval_results.get("dataset", dataset)
    if dataset_id is None:
        raise ValueError(
            f"eval_results={eval_results} names no dataset: add a 'dataset' key or pass dataset= to write_model_card."
        )
    dataset_id, split = public_dataset_name(dataset_id), eval_results.get("split")
    results, rows = [], []
    for key, value in eval_results.items():
        if key in EVAL_CONTEXT_KEYS:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(
                f"eval_results[{key!r}] = {value!r} is not a finite number; metrics must be numbers "
                f"(context keys {EVAL_CONTEXT_KEYS} may be strings)."
            )
        metric_type, label = METRICS.get(key, (key, key))
        results.append(
            EvalResult(
                task_type="text-generation",
                dataset_type=dataset_id,
                dataset_name=dataset_id,
                dataset_split=split,
                dataset_config=eval_results.get("dataset_config"),
                metric_type=metric_type,
                metric_name=label,
                metric_value=float(value),
            )
        )
        rows.append({"name": label, "value": f"{value:.4g}", "dataset": dataset_id, "split": split or ""})
    return results, rows


def public_dataset_name(dataset: str) -> str:
    """A Hub dataset id as is; a local path by its last part(s) only (cards are published: no machine paths)."""
    path = pathlib.Path(dataset)
    if HUB_ID.fullmatch(dataset) and not path.exists():
        return dataset
    return f"{path.parent.name}/{path.name}" if path.is_file() else path.name  # a file: "tinyshakespeare/input.txt"


def dataset_markdown(dataset: str | None) -> str:
    if dataset is None:
        return "an unrecorded dataset"
    name = public_dataset_name(dataset)
    if name == dataset and HUB_ID.fullmatch(name):
        return f"[{name}](https://huggingface.co/datasets/{name})"
    return f"`{name}` (a local dataset)"


def context_facts(config: DecoderLabConfig, block_size: int | None) -> tuple[str, str]:
    """(the context length to advertise, the limitation to state)."""
    if config.position_embedding_type in ("learned", "sinusoidal"):
        n = f"{config.max_position_embeddings:,}"
        return f"{n} tokens", f"Its position table has {n} entries: prompt plus generated text must fit in {n} tokens."
    kind = {"rope": "RoPE", "none": "Having no position embeddings"}[config.position_embedding_type]
    if block_size is None:
        return "no hard limit", f"{kind} sets no hard length limit, but quality drops past the training length."
    trained = f"{block_size:,} tokens"
    return (
        f"{trained} (the training block size)",
        f"{kind} sets no hard length limit, but the model was trained on blocks of {trained}; "
        "expect worse text past that.",
    )


# ----------------------------------------------------------------------------------------------
# The card


def write_model_card(
    checkpoint_dir,
    *,
    dataset: str | None = None,
    base_model: str | None = None,
    training: dict | None = None,
    eval_results: dict | None = None,
    config: DecoderLabConfig | None = None,
) -> pathlib.Path:
    """Write ``README.md`` (and ``training_curve.png`` when ``metrics.jsonl`` exists) into a checkpoint folder.

    Args:
        checkpoint_dir: a folder with ``config.json`` (a DecoderLabConfig) and optionally ``metrics.jsonl``;
            without ``config.json`` (a LoRA adapter folder) when ``config`` is given.
        dataset: the training data, a Hub dataset id or a local path (only its folder name is published).
        base_model: the Hub id of the model this one was fine-tuned from.
        training: the recipe the script ran (``steps``, ``tokens``, ``batch_size``, ``block_size``,
            ``learning_rate``, ``precision``, ``hardware``, ``wall_time_s``, ``final_train_loss``, ... any
            other key is shown as written); missing facts are read from ``metrics.jsonl``. The optional key
            ``prompt`` sets the prompt of the card's generation example.
        eval_results: measured metrics, e.g. ``{"eval_loss": 1.47, "perplexity": 4.35,
            "dataset": "karpathy/tiny_shakespeare", "split": "validation"}``; they become the ``model-index``.
        config: the architecture to describe, instead of the folder's ``config.json`` (an adapter's base model).

    Returns:
        The path of the written README.md.
    """
    folder = pathlib.Path(checkpoint_dir)
    if config is None:
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"{folder} has no config.json: write_model_card needs a saved decoderlab checkpoint."
            )
        config = DecoderLabConfig.from_pretrained(folder)
    training = dict(training or {})
    prompt = training.pop("prompt", "Once upon a time")
    metrics_path = folder / METRICS_NAME
    records = read_metrics(metrics_path) if metrics_path.is_file() else []
    model_name = folder.resolve().name

    plot, no_plot_reason = None, f"No `{METRICS_NAME}` in the checkpoint, so there is no training curve."
    if records:
        no_plot_reason = "matplotlib was not installed when this card was written, so there is no training curve."
        if plot_training_curve(records, folder / PLOT_NAME) is not None:
            plot = PLOT_NAME
    results, evaluation_rows = evaluation(eval_results, dataset) if eval_results else ([], [])
    total, embedding = count_parameters(config)
    context_length, context_note = context_facts(config, training.get("block_size"))
    dataset_text = dataset_markdown(dataset)

    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=LICENSE,
        datasets=[dataset] if dataset and public_dataset_name(dataset) == dataset else None,
        base_model=base_model,
        tags=mechanism_tags(config),
        model_name=model_name,
        eval_results=results or None,
    )
    card = ModelCard.from_template(
        card_data,
        template_path=str(template_path()),
        model_title=model_name,
        repo_id=HUB_ID_PLACEHOLDER,
        summary=(
            "A decoder-only language model"
            + (f" fine-tuned from `{base_model}`" if base_model else "")
            + " built with decoderlab, where every Transformer mechanism is a configuration switch."
        ),
        mechanisms_sentence=describe_mechanisms(config),
        parameters=f"{total:,} ({human_count(embedding)} of them in the token embedding)",
        context_length=context_length,
        context_note=context_note,
        dataset_text=dataset_text,
        eval_dataset_text=dataset_markdown(eval_results.get("dataset", dataset)) if eval_results else None,
        license=LICENSE,
        architecture=architecture_rows(config),
        recipe=recipe_rows(dataset_text, base_model, training, records),
        plot=plot,
        no_plot_reason=no_plot_reason,
        evaluation=evaluation_rows,
        prompt=json.dumps(prompt, ensure_ascii=False),  # a JSON string is a valid Python string literal
    )
    path = folder / CARD_NAME
    card.save(path)
    logger.info(f"Wrote the model card {path}")
    return path


def add_eval_results(checkpoint_dir, eval_results: dict, *, dataset: str | None = None) -> pathlib.Path:
    """Record new measurements in a checkpoint's card: its ``model-index`` and its Evaluation table.

    ``eval_results`` is ``write_model_card``'s argument. Earlier results for the same dataset, configuration,
    split and metric are replaced, all others kept. A folder without a card gets one from ``write_model_card``.
    """
    folder = pathlib.Path(checkpoint_dir)
    path = folder / CARD_NAME
    if not path.is_file():
        return write_model_card(folder, dataset=dataset, eval_results=eval_results)
    card = ModelCard.load(path)
    new, _ = evaluation(eval_results, dataset)
    key = lambda r: (r.dataset_type, r.dataset_config, r.dataset_split, r.metric_type)
    replaced = {key(r) for r in new}
    results = [r for r in card.data.eval_results or [] if key(r) not in replaced] + new
    card.data.eval_results = results
    card.data.model_name = card.data.model_name or folder.resolve().name  # model-index entries need a name
    rows = [
        f"| {r.metric_name or r.metric_type} | {r.metric_value:.4g} | {r.dataset_name} | {r.dataset_split or ''} |"
        for r in results
    ]
    section = "\n".join(
        ["## Evaluation", "", "| Metric | Value | Dataset | Split |", "|---|---|---|---|", *rows, "",
         "The same numbers are in this card's `model-index` metadata.", "", ""]
    )  # fmt: skip
    text, found = EVALUATION_SECTION.subn(lambda _: section, card.text, count=1)
    card.text = text if found else card.text.rstrip("\n") + "\n\n" + section
    card.save(path)
    logger.info(f"Added evaluation results to {path}")
    return path


def card_for_repo(card_path: pathlib.Path, repo_id: str) -> str:
    """The card's text with its Hub repository filled in (the placeholder until the first push)."""
    return pathlib.Path(card_path).read_text(encoding="utf-8").replace(HUB_ID_PLACEHOLDER, repo_id)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m decoderlab.model_card",
        description="(Re)write the model card of a decoderlab checkpoint folder.",
    )
    parser.add_argument("folder", type=pathlib.Path, help="checkpoint folder with config.json (and metrics.jsonl)")
    parser.add_argument("--dataset", help="training dataset: a Hub id or a local path")
    parser.add_argument("--base_model", help="Hub id of the model this one was fine-tuned from")
    parser.add_argument("--training", type=pathlib.Path, help="JSON file: the training recipe summary")
    parser.add_argument("--eval_results", type=pathlib.Path, help="JSON file: the evaluation metrics")
    args = parser.parse_args(argv)

    def read(path: pathlib.Path | None):
        if path is None:
            return None
        if not path.is_file():
            raise UsageError(f"{path} does not exist: --training and --eval_results take a JSON file.")
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise UsageError(f"{path} is not valid JSON ({err}).") from err

    path = write_model_card(
        args.folder,
        dataset=args.dataset,
        base_model=args.base_model,
        training=read(args.training),
        eval_results=read(args.eval_results),
    )
    print(f"Wrote {path}")


if __name__ == "__main__":
    run_command(main)
