"""Model cards: the metadata parses back with huggingface_hub, the tables match the config and the metrics,
and the training curve plots exactly what metrics.jsonl holds."""

import json
import math
import re
import sys

import pytest
from hub_server import validate_metadata
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results

import decoderlab
from decoderlab import model_card
from decoderlab.model_card import HUB_ID_PLACEHOLDER, plot_training_curve, read_metrics, write_model_card

SIZES = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
EVAL = {
    "eval_loss": 1.625,
    "perplexity": math.exp(1.625),
    "dataset": "karpathy/tiny_shakespeare",
    "split": "validation",
}


def metrics_records() -> list[dict]:
    """A short run: train loss every step, eval loss every 5, a warmup learning rate."""
    records = []
    for step in range(1, 11):
        records.append({"step": step, "train_loss": 4.0 - 0.2 * step, "lr": 1e-3 * min(1, step / 4),
                        "tokens": 512 * step, "elapsed_s": 0.5 * step})  # fmt: skip
        if step % 5 == 0:
            records.append({"step": step, "eval_loss": 4.1 - 0.2 * step, "tokens": 512 * step, "elapsed_s": 0.5 * step})
    return records


def make_checkpoint(folder, metrics: list[dict] | None = None, **overrides):
    """A checkpoint folder as far as the card needs it: config.json (and metrics.jsonl)."""
    config = decoderlab.DecoderLabConfig(**{**SIZES, **overrides})
    config.save_pretrained(folder)
    if metrics is not None:
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return config


def table(text: str, first_column: str) -> dict[str, list[str]]:
    """The rows of the Markdown table whose header starts with ``first_column``: {first cell: other cells}."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0]] = cells[1:]
    return rows


def test_metadata_parses_back(tmp_path):
    """The YAML block loads with huggingface_hub as written: library, pipeline, license, dataset, base model,
    tags, and a model-index whose eval results are the measured numbers; the test Hub's validator accepts it."""
    make_checkpoint(tmp_path, metrics_records())
    path = write_model_card(tmp_path, dataset="karpathy/tiny_shakespeare", base_model="decoderlab-org/base",
                            training={"batch_size": 8}, eval_results=EVAL)  # fmt: skip
    card = ModelCard.load(path)
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation"
    assert data["license"] == "apache-2.0"
    assert data["datasets"] == ["karpathy/tiny_shakespeare"]
    assert data["base_model"] == "decoderlab-org/base"
    assert {"decoderlab", "rope", "mha", "pre-ln", "rmsnorm", "swiglu"} <= set(data["tags"])
    name, results = model_index_to_eval_results(data["model-index"])
    assert name == tmp_path.name
    assert {(r.metric_type, r.metric_value) for r in results} == {("loss", 1.625), ("perplexity", EVAL["perplexity"])}
    assert {(r.task_type, r.dataset_type, r.dataset_split) for r in results} == {
        ("text-generation", "karpathy/tiny_shakespeare", "validation")
    }
    assert validate_metadata(path.read_text()) == ([], [])


@pytest.mark.parametrize(
    ("overrides", "tags"),
    [
        ({"num_key_value_heads": 2}, {"rope", "gqa", "pre-ln", "rmsnorm", "swiglu"}),
        (
            {"position_embedding_type": "learned", "norm_type": "layernorm", "mlp_type": "plain",
             "hidden_act": "gelu_new", "tie_word_embeddings": True},
            {"learned-positions", "mha", "pre-ln", "layernorm", "gelu-new-mlp", "tied-embeddings"},
        ),
        (
            {"num_key_value_heads": 1, "norm_placement": "sandwich", "qk_norm": True,
             "position_embedding_type": "sinusoidal", "hidden_act": "gelu"},
            {"sinusoidal-positions", "mqa", "sandwich-ln", "rmsnorm", "geglu", "qk-norm"},
        ),
        (
            {"use_parallel_residual": True, "position_embedding_type": "none", "norm_placement": "pre",
             "norm_type": "layernorm", "mlp_type": "plain", "hidden_act": "relu"},
            {"nope", "mha", "pre-ln", "layernorm", "relu-mlp", "parallel-residual"},
        ),
        ({"norm_placement": "post", "hidden_act": "relu"}, {"rope", "mha", "post-ln", "rmsnorm", "reglu"}),
    ],
    ids=["llama-gqa", "gpt2", "mqa-sandwich", "neox-nope", "post-ln"],
)  # fmt: skip
def test_tags_name_the_mechanisms(tmp_path, overrides, tags):
    """Each configuration gets exactly the tags of the mechanisms it switches on."""
    make_checkpoint(tmp_path, **overrides)
    card = ModelCard.load(write_model_card(tmp_path))
    assert set(card.data.tags) == {"decoderlab", "custom_code"} | tags


def test_architecture_table_lists_every_switch(tmp_path):
    """Every DecoderLabConfig field is a row of the architecture table, showing the value config.json holds and
    saying what it does; the mechanisms sentence names a non-default embedding multiplier."""
    make_checkpoint(
        tmp_path, num_key_value_heads=2, attention_scale=0.5, qk_norm=True, norm_eps=1e-6, embedding_multiplier=8.0
    )
    text = write_model_card(tmp_path).read_text()
    rows = table(text, "Switch")
    assert [name.strip("`") for name in rows] == list(decoderlab.DecoderLabConfig.__annotations__)
    assert all(meaning for _value, meaning in rows.values())
    assert "; token embeddings multiplied by 8." in text
    saved = json.loads((tmp_path / "config.json").read_text())
    for name, (value, _meaning) in rows.items():
        name = name.strip("`")
        if name == "rope_parameters":
            assert all(f"`{key}={val}`" in value for key, val in saved[name].items())
        else:
            assert value == f"`{saved[name]}`"


def test_training_curve_plots_the_metrics(tmp_path):
    """The figure's lines are metrics.jsonl's train loss, eval loss and learning rate against their steps."""
    records = metrics_records()
    figure = plot_training_curve(records, tmp_path / "curve.png")
    loss_axes, lr_axes = figure.axes
    lines = {line.get_label(): line.get_xydata().tolist() for line in loss_axes.lines}
    assert lines["train loss"] == [[r["step"], r["train_loss"]] for r in records if "train_loss" in r]
    assert lines["eval loss"] == [[r["step"], r["eval_loss"]] for r in records if "eval_loss" in r]
    assert lr_axes.lines[0].get_xydata().tolist() == [[r["step"], r["lr"]] for r in records if "lr" in r]
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_card_links_the_plot_and_fills_the_recipe_from_metrics(tmp_path):
    """What the script passes is shown as given; steps, tokens, wall time and final losses it omits come from
    the last records of metrics.jsonl."""
    make_checkpoint(tmp_path, metrics_records())
    text = write_model_card(tmp_path, training={"batch_size": 8, "hardware": "2 CPU cores"}).read_text()
    assert "![Training curve" in text and "(training_curve.png)" in text
    assert (tmp_path / "training_curve.png").is_file()
    recipe = table(text, "Setting")
    assert recipe["Optimizer steps"] == ["10"]
    assert recipe["Tokens seen"] == ["5,120"]
    assert recipe["Wall time"] == ["5 s"]
    assert recipe["Final train loss"] == [f"{4.0 - 0.2 * 10:.4g}"]
    assert recipe["Final eval loss"] == [f"{4.1 - 0.2 * 10:.4g}"]
    assert recipe["Batch size (sequences)"] == ["8"]
    assert recipe["Hardware"] == ["2 CPU cores"]
    overridden = table(write_model_card(tmp_path, training={"steps": 999}).read_text(), "Setting")
    assert overridden["Optimizer steps"] == ["999"]


def test_card_without_metrics_or_matplotlib_says_why_there_is_no_plot(tmp_path, monkeypatch, caplog):
    """No metrics.jsonl: no plot and the card says so. No matplotlib: a warning, and the card says that instead."""
    make_checkpoint(tmp_path)
    assert "No `metrics.jsonl` in the checkpoint" in write_model_card(tmp_path).read_text()
    assert not (tmp_path / "training_curve.png").exists()

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_records()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    text = write_model_card(tmp_path).read_text()
    assert "matplotlib was not installed" in text and "![Training curve" not in text
    assert not (tmp_path / "training_curve.png").exists()


def test_local_dataset_path_is_not_published(tmp_path):
    """A local dataset appears by folder name only: no machine path in the card, no bogus Hub dataset id."""
    data = tmp_path / "data" / "tiny_shakespeare"
    data.mkdir(parents=True)
    checkpoint = tmp_path / "model"
    make_checkpoint(checkpoint)
    path = write_model_card(checkpoint, dataset=str(data), eval_results={"eval_loss": 1.5, "split": "validation"})
    text = path.read_text()
    assert str(tmp_path) not in text
    assert "`tiny_shakespeare` (a local dataset)" in text
    card = ModelCard.load(path)
    assert card.data.datasets is None
    assert card.data.eval_results[0].dataset_type == "tiny_shakespeare"
    (data / "input.txt").write_text("text")  # a local file is named with its folder
    text = write_model_card(checkpoint, dataset=str(data / "input.txt")).read_text()
    assert str(tmp_path) not in text and "`tiny_shakespeare/input.txt` (a local dataset)" in text


def test_card_names_the_hub_repository_only_through_the_placeholder(tmp_path):
    """Every mention of the repository is the placeholder that decoderlab.push fills in; the generation example
    uses the script's prompt, escaped into a valid Python string."""
    make_checkpoint(tmp_path)
    text = write_model_card(tmp_path, training={"prompt": 'He said "hi"\n'}).read_text()
    assert text.count(f'"{HUB_ID_PLACEHOLDER}"') == 5
    assert 'generate("He said \\"hi\\"\\n", max_new_tokens' in text
    filled = model_card.card_for_repo(tmp_path / "README.md", "org/name")
    assert HUB_ID_PLACEHOLDER not in filled and filled.count('"org/name"') == 5


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('{"step": 1, "train_loss": 2.0}\nnot json\n', "line 2 is not JSON"),
        ('{"train_loss": 2.0}\n', "line 1 must be a JSON object with an integer 'step'"),
        ('[1, 2]\n', "line 1 must be a JSON object"),
    ],
)  # fmt: skip
def test_bad_metrics_lines_are_named(tmp_path, lines, message):
    """A malformed metrics.jsonl fails with the line number, not deep inside the plot."""
    (tmp_path / "metrics.jsonl").write_text(lines)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_metrics(tmp_path / "metrics.jsonl")


def test_bad_inputs_raise_clear_errors(tmp_path):
    """No config.json, a metric that is not a number, and eval results with no dataset are each refused by name."""
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        write_model_card(tmp_path)
    make_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"eval_results\['eval_loss'\] = 'low' is not a finite number"):
        write_model_card(tmp_path, dataset="org/data", eval_results={"eval_loss": "low"})
    with pytest.raises(ValueError, match="names no dataset"):
        write_model_card(tmp_path, eval_results={"eval_loss": 1.0})


def test_cli_rewrites_the_card_of_an_existing_checkpoint(tmp_path, capsys):
    """`python -m decoderlab.model_card FOLDER --dataset ... --eval_results FILE` writes the card from files."""
    make_checkpoint(tmp_path / "model", metrics_records())
    (tmp_path / "eval.json").write_text(json.dumps(EVAL))
    model_card.main([str(tmp_path / "model"), "--dataset", "karpathy/tiny_shakespeare",
                     "--eval_results", str(tmp_path / "eval.json")])  # fmt: skip
    assert "Wrote" in capsys.readouterr().out
    card = ModelCard.load(tmp_path / "model" / "README.md")
    assert card.data.eval_results[0].metric_value == EVAL["eval_loss"]
    assert (tmp_path / "model" / "training_curve.png").is_file()
