"""The README and the docs site keep their promises: every Python block runs, every command a page shows
is accepted by its script's own parser, every relative link resolves, the generated reference covers the code, the
site builds with ``mkdocs build --strict``, and a browser shows it with its equations and plots.

The pages whose blocks take long (``<!-- snippets: slow -->``: trainers, graph exports) run in the slow tests; the
others in ``make test``.
"""

import contextlib
import dataclasses
import os
import pathlib
import shlex
import subprocess
import sys
import textwrap

import pytest

from doctools import DOCS_DIR, REPO_ROOT, doc_pages
from doctools.commands import (
    SHORT_TRAINING,
    CommandError,
    offline_reason,
    parse_with_script,
    project_command,
    runnable_argv,
)
from doctools.generate import (
    GenerateError,
    config_fields,
    config_flags_markdown,
    experiment_files,
    experiment_markdown,
    flags_markdown,
    published_files,
    site_links,
)
from doctools.markdown import MarkdownError, broken_links, fences, is_slow_page, shell_lines
from doctools.snippets import SnippetError, run_page

PAGES = doc_pages()
SHELLS = ("bash", "sh", "shell")


def page_id(path: pathlib.Path) -> str:
    return str(path.relative_to(REPO_ROOT))


def page_params(pages, slow_pages_slow: bool = False):
    """One parameter per page; with ``slow_pages_slow``, the pages marked ``<!-- snippets: slow -->`` run as slow."""
    slow = [pytest.mark.slow]
    return [pytest.param(p, id=page_id(p), marks=slow if slow_pages_slow and is_slow_page(p) else []) for p in pages]


# ----------------------------------------------------------------------------------------------
# Every ```python block runs


@pytest.mark.parametrize(
    "page", page_params([p for p in PAGES if any(f.lang == "python" for f in fences(p))], slow_pages_slow=True)
)
def test_python_blocks_run(page, tmp_path):
    """Each page's ```python blocks run top to bottom in one namespace in a fresh folder, offline on the CPU, so no
    example depends on a name, file or checkpoint it does not make (the drifted torchao, TRL and performance
    snippets of the old README did)."""
    ran, skipped = run_page(page, tmp_path)
    assert ran + sum(skipped.values()) == sum(f.lang == "python" for f in fences(page))


def test_skip_markers_are_known_and_explained():
    """Every skip marker names a known reason, stands before a ```python block, and the paragraph above it says why
    in words a reader sees (the marker itself is invisible on the page); fences() refuses anything else."""
    skipped = {}
    for page in PAGES:
        for fence in fences(page):
            if fence.skip:
                skipped.setdefault(fence.skip, []).append(fence.where(REPO_ROOT))
    assert set(skipped) <= {"needs-gpu", "needs-network", "needs-vllm"}, skipped


def test_failing_block_names_its_file_and_line(tmp_path):
    """Bad input: a block that raises stops with a SnippetError starting with the page's path and the line that
    failed, the way a reader finds it."""
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```python\nx = 1\n```\n\nText.\n\n```python\ny = x + 1\nprint(undefined_name)\n```\n")
    with pytest.raises(SnippetError, match=r"page\.md:11: NameError: name 'undefined_name' is not defined"):
        run_page(page, tmp_path)


def test_blocks_share_a_namespace_and_skip_what_is_marked(tmp_path):
    """A page's blocks see each other's names, and a block after a skip marker is counted, not run."""
    page = tmp_path / "page.md"
    page.write_text(
        textwrap.dedent("""\
            # A page

            ```python
            value = 41
            ```

            The next block needs a GPU.

            <!-- snippet: skip needs-gpu -->
            ```python
            raise RuntimeError("must not run")
            ```

            ```python
            assert value + 1 == 42
            ```
            """)
    )
    ran, skipped = run_page(page, tmp_path)
    assert (ran, dict(skipped)) == (2, {"needs-gpu": 1})


@pytest.mark.parametrize(
    "marker, above, error",
    [
        ("<!-- snippet: skip needs-tpu -->", "It needs a TPU.", "unknown skip reason 'needs-tpu'"),
        ("<!-- snippet: skip needs-gpu -->", "Some text.", "does not say so"),
        ("<!-- snippet: skp needs-gpu -->", "It needs a GPU.", "is not a snippet marker"),
    ],
)
def test_bad_skip_markers_are_refused(tmp_path, marker, above, error):
    """Bad input: an unknown reason, a marker without a sentence saying why, or a misspelt marker is a MarkdownError
    naming the file and line, not a block silently skipped or run."""
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\n{above}\n\n{marker}\n```python\nprint(1)\n```\n")
    with pytest.raises(MarkdownError, match=rf"page\.md:5: .*{error}"):
        fences(page)


# ----------------------------------------------------------------------------------------------
# Every command a page shows is parsed by its script's own parser


def project_commands(page: pathlib.Path):
    for fence in fences(page):
        if fence.lang in SHELLS:
            for line, text in shell_lines(fence):
                command = project_command(text)
                if command is not None:
                    yield f"{page_id(page)}:{line}", command


@pytest.mark.parametrize("page", page_params([p for p in PAGES if any(f.lang in SHELLS for f in fences(p))]))
def test_commands_parse(page):
    """Every shell line that runs a project script (python training/X.py, python -m decoderlab.X, under accelerate
    launch or torchrun too) is accepted by that script's own parser and, for the training scripts, by the config
    dataclass's checks: a flag that was renamed or removed fails here, naming the page and line."""
    problems = []
    for where, command in project_commands(page):
        try:
            parse_with_script(command)
        except CommandError as err:
            problems.append(f"{where}: {err}")
    assert not problems, "\n".join(problems)


WALKTHROUGH_FIRST = ("docs/guides/pretraining.md", "docs/guides/fine-tuning.md")  # they make what the others read


@pytest.mark.slow
def test_offline_commands_run(tmp_path):
    """Every documented command that can run offline on a CPU runs, in the pages' order, in one scratch checkout
    (the scripts linked in, ../shared beside it), training runs shortened to a few steps: the pretraining guide's
    checkpoint is what the fine-tuning, evaluation, deploy and explorer pages then use. Each command that cannot
    run here is listed with its reason (network, more processes, a server, a benchmark)."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("training", "decoderlab", "benchmarks", "experiments", "model_cards"):
        (checkout / name).symlink_to(REPO_ROOT / name)
    (tmp_path / "shared").symlink_to(REPO_ROOT.parent / "shared")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    ordered = [REPO_ROOT / p for p in WALKTHROUGH_FIRST] + [p for p in PAGES if page_id(p) not in WALKTHROUGH_FIRST]
    ran, skipped = [], []
    for page in ordered:
        for where, command in project_commands(page):
            with contextlib.chdir(checkout):
                parsed = parse_with_script(command)
            reason = offline_reason(command, parsed, checkout)
            if reason is not None:
                skipped.append(f"{where}: {reason}")
                continue
            run = subprocess.run(runnable_argv(command, sys.executable), cwd=checkout, env=env, capture_output=True,
                                 text=True, timeout=900)  # fmt: skip
            assert run.returncode == 0, f"{where}: {shlex.join(runnable_argv(command, 'python'))}\n{run.stderr[-3000:]}"
            ran.append(where)
    print("ran:", *ran, "not run here:", *skipped, sep="\n  ")
    pages_ran = {where.split(":")[0] for where in ran}
    assert {"docs/guides/pretraining.md", "docs/guides/fine-tuning.md", "docs/deploy/llama-cpp.md"} <= pages_ran, ran


def test_offline_commands_are_told_from_the_others(tmp_path):
    """The rule that picks the commands the slow test runs: a launcher, a benchmark, a server, the Hub and a
    missing Hub-like path are each named as the reason; a local training command runs, shortened (a run sized by a
    budget without it)."""
    (tmp_path / "out" / "ckpt").mkdir(parents=True)
    cases = {
        "accelerate launch training/finetune.py --config training/configs/finetune_shakespeare_chat.yaml": "accelerate",
        "python -m benchmarks.rss": "benchmark",
        "python -m decoderlab.explore out/ckpt": "web server",
        "python -m decoderlab.push out/ckpt ORG/NAME": "Hub",
        "python training/evaluate.py ORG/NAME --dataset_name karpathy/tiny_shakespeare": "network",
        "python -m decoderlab.convert --to gguf out/ckpt model.gguf": None,
    }
    for line, expected in cases.items():
        command = project_command(line)
        with contextlib.chdir(REPO_ROOT):
            parsed = parse_with_script(command)
        reason = offline_reason(command, parsed, tmp_path)
        assert (reason is None) if expected is None else (expected in reason), (line, reason)
    pretrain = project_command("python training/pretrain.py --config training/configs/shakespeare_char.yaml")
    with contextlib.chdir(REPO_ROOT):
        assert "is not here" in offline_reason(pretrain, parse_with_script(pretrain), tmp_path)  # the Hub dataset
    assert runnable_argv(pretrain, "python")[-6:] == ["--max_train_steps", "6", "--eval_steps", "3",
                                                      "--checkpointing_steps", "3"]  # fmt: skip
    budget = project_command("python training/pretrain.py --max_train_steps none --target_flops 1e15 --seed 3 "
                             "--tokens_per_parameter=20")  # fmt: skip
    assert runnable_argv(budget, "python")[3:] == ["--max_train_steps", "none", "--seed", "3", *SHORT_TRAINING]


@pytest.mark.parametrize(
    "line, error",
    [
        ("python training/pretrain.py --learning_rat 1e-3", "Unknown argument '--learning_rat'. Did you mean 'learning_rate'"),
        ("python training/pretrain.py --model.num_hidden_layrs 3", "num_hidden_layrs is not a DecoderLabConfig field"),
        ("python training/pretrain.py --block_size 1", "block_size must be at least 2"),
        ("python -m decoderlab.convert --to gguff a b", "invalid choice: 'gguff'"),
        ("python training/generate.py", "the following arguments are required: checkpoint"),
        ("accelerate launch --num_machinez 2 training/pretrain.py", "accelerate launch refuses"),
        ("torchrun --node_count 2 training/pretrain.py", "torchrun refuses"),
    ],
)
def test_drifted_commands_are_refused(line, error):
    """Bad input: a misspelt flag, an unknown model field, an impossible value, a wrong choice, a missing argument
    and a launcher's misspelt flag are each refused with the parser's own message."""
    with pytest.raises(CommandError, match=error):
        parse_with_script(project_command(line))


def test_unknown_project_script_is_refused():
    """Bad input: a command that runs a project script that does not exist is an error, not a line ignored."""
    with pytest.raises(CommandError, match="no such script"):
        project_command("python training/pretrain_everything.py --help")


def test_other_commands_are_not_parsed():
    """make, pip, curl and tools of other projects are not project scripts; bash quoting and VAR=value are read as
    bash reads them."""
    assert project_command("make demo") is None
    assert project_command("vllm serve out/x --trust-remote-code") is None
    command = project_command("OMP_NUM_THREADS=1 python training/generate.py ck --stop $'\\n\\n' # comment")
    assert command.module == "training.generate" and command.argv == ("ck", "--stop", "\n\n")


# ----------------------------------------------------------------------------------------------
# Links


NOTES = sorted((REPO_ROOT / "benchmarks" / "notes").glob("*.md"))


@pytest.mark.parametrize("page", page_params(PAGES + NOTES))
def test_links_resolve(page):
    """Every relative link and image of the README, the docs and the benchmark notes (which the site carries) points
    at a file that exists (or that the build adds: the experiments' reports and plots), and every #anchor at a
    heading of its page; external links are not fetched."""
    assert not broken_links(page, experiment_files())


def test_links_to_the_repository_are_rewritten_for_the_site():
    """The site carries the results files and notes at their repository paths, and each experiment's report and
    plots at experiments/NAME/: a docs page's link to one, and a note's link into docs/, point at their place in the
    site; links inside docs/ and external ones stay."""
    published = published_files()
    assert "benchmarks/results/rss.json" in published and "benchmarks/notes/data-pipeline.md" in published
    page = "[a](../../benchmarks/results/rss.json) [b](../performance.md#headline) [c](https://x.org/a.md)"
    assert site_links(page, "guides/data.md") == (
        "[a](../benchmarks/results/rss.json) [b](../performance.md#headline) [c](https://x.org/a.md)"
    )
    plot = "![p](../experiments/results/heads/loss_and_cache.png)"
    assert site_links(plot, "performance.md") == "![p](experiments/heads/loss_and_cache.png)"
    note = "[p](../../docs/performance.md#the-data-pipeline) [r](../results/archive/x.json)"
    assert site_links(note, "benchmarks/notes/data-pipeline.md") == (
        "[p](../../performance.md#the-data-pipeline) [r](../results/archive/x.json)"
    )


def test_a_page_leaves_no_accelerate_state_behind(tmp_path):
    """A page whose Accelerator chose bf16 (as TRL's trainers do) leaves the next page, and the tests after it, free
    to create an Accelerator of another precision in the same process."""
    from accelerate import Accelerator

    page = tmp_path / "page.md"
    page.write_text('# Page\n\n```python\nfrom accelerate import Accelerator\n\nAccelerator(mixed_precision="bf16")\n```\n')
    assert run_page(page, tmp_path) == (1, {})
    assert Accelerator(mixed_precision="no").mixed_precision == "no"


def test_broken_links_are_reported(tmp_path):
    """Bad input: a missing file and a missing anchor are each reported with the file and line."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#a-section) [gone](missing.md)\n\n[bad anchor](other.md#no-such)\n")
    problems = broken_links(page)
    assert len(problems) == 2
    assert "page.md:3: 'missing.md'" in problems[0] and "page.md:5: 'other.md#no-such'" in problems[1]


# ----------------------------------------------------------------------------------------------
# The README


def test_readme_is_short_and_has_the_headline_block():
    """The README stays a front page (at most 200 lines) and keeps exactly one headline block between the markers
    that `python -m benchmarks.report` fills."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert text.count("<!-- report:headline -->") == 1 and text.count("<!-- /report:headline -->") == 1
    assert text.index("<!-- report:headline -->") < text.index("<!-- /report:headline -->")


def test_readme_commands_are_the_makefile_targets():
    """The two commands the README gives are targets of the Makefile, and the CI script runs the test target's
    superset."""
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    for target in ("demo", "test", "test-all", "docs"):
        assert f"\n{target}:" in makefile and f"make {target}" in readme
    assert "make test-all" in (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# Generated reference


def test_config_reference_covers_every_field():
    """The configuration reference is generated from DecoderLabConfig: every field the class declares is there, in
    its group, with its docstring (a field added to the class appears on the page by itself)."""
    from decoderlab import DecoderLabConfig

    fields = config_fields()
    assert [f.name for f in fields] == list(DecoderLabConfig.__annotations__)
    assert all(f.doc.strip() and f.group for f in fields)
    assert {f.group for f in fields} == {"sizes", "attention", "positions", "normalisation", "MLP", "other"}


def test_config_field_without_docstring_stops_the_build(tmp_path, monkeypatch):
    """Bad input: a field without a docstring is a GenerateError naming it, so the build fails instead of
    publishing a field nobody explained."""
    import doctools.generate as generate

    source = generate.CONFIG_SOURCE.read_text(encoding="utf-8")
    docstring = '    """Decoder blocks."""\n'
    assert docstring in source
    copy = tmp_path / "configuration_decoderlab.py"
    copy.write_text(source.replace(docstring, ""), encoding="utf-8")
    monkeypatch.setattr(generate, "CONFIG_SOURCE", copy)
    with pytest.raises(GenerateError, match="DecoderLabConfig.num_hidden_layers has no docstring"):
        config_fields()


def test_script_reference_covers_every_flag():
    """The flag tables come from the scripts' own parsers and Config dataclasses: every TrainConfig field is a row
    of pretrain.py's table, fine-tuning's own fields of finetune.py's, every option of convert's parser of its."""
    from training.args import TrainConfig
    from training.finetune_args import FinetuneConfig

    pretrain = flags_markdown("training/pretrain.py")
    assert all(f"`--{f.name}`" in pretrain for f in dataclasses.fields(TrainConfig))
    finetune = flags_markdown("training/finetune.py")
    assert all(f"`--{name}`" in finetune for name in FinetuneConfig.__annotations__)
    assert "Every flag of `TrainConfig` works here too" in finetune
    convert = flags_markdown("decoderlab.convert")
    assert all(target in convert for target in ("llama", "qwen3", "gguf", "onnx", "executorch"))


def test_a_new_config_field_is_a_new_row():
    """A field added to a script's Config dataclass (as the data pipeline's flags are) appears in the table with its
    type, default and help, without touching the docs."""
    from training.args import TrainConfig, option

    @dataclasses.dataclass
    class Extended(TrainConfig):
        shard_pattern: str | None = option(None, "glob of the data shards")

    assert "| `--shard_pattern` | a string or none | `None` | glob of the data shards |" in config_flags_markdown(
        Extended
    )


def test_every_training_script_has_a_flag_table():
    """Each script in training/ with a main() has its flag table in the script reference, so a new script is not
    left out."""
    reference = (DOCS_DIR / "reference" / "scripts.md").read_text(encoding="utf-8")
    for path in sorted((REPO_ROOT / "training").glob("*.py")):
        if "\ndef main(" in path.read_text(encoding="utf-8"):
            assert f"<!-- generate: flags training/{path.name} -->" in reference, path.name


def test_experiment_block_reads_the_results():
    """A concept page's experiment block states the verdict and every check of the experiment's results.json and
    shows each plot its report shows, linked relative to the page."""
    import json

    results = json.loads((REPO_ROOT / "experiments/results/heads/results.json").read_text(encoding="utf-8"))
    block = experiment_markdown("heads", "concepts/heads.md")
    assert f"the claim {results['verdict']} at this scale" in block
    assert all(check["evidence"].split(";")[0] in block for check in results["checks"])
    assert "](../experiments/heads/loss_and_cache.png)" in block and "](../experiments/heads/report.md)" in block
    with pytest.raises(GenerateError, match="No results for experiment 'nonexistent'"):
        experiment_markdown("nonexistent", "concepts/heads.md")


# ----------------------------------------------------------------------------------------------
# The site: mkdocs build --strict, then a browser


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The site built once by `mkdocs build --strict` (KaTeX from `make katex` when it is not unpacked yet)."""
    if not (DOCS_DIR / "assets" / "katex" / "katex.min.js").is_file():
        subprocess.run(["make", "katex"], cwd=REPO_ROOT, check=True)
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-5000:]
    return site


@pytest.mark.slow
def test_site_builds_strict(built_site):
    """`mkdocs build --strict` passes (no broken link or anchor, no page outside the nav, no API page that
    mkdocstrings cannot render) and the generated pages carry what the code says."""
    from decoderlab import DecoderLabConfig

    reference = (built_site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    assert all(f"<code>{name}</code>" in reference for name in DecoderLabConfig.__annotations__)
    assert (built_site / "experiments" / "attention_scale" / "scale_vs_dk.png").is_file()
    assert "arithmatex" in (built_site / "concepts" / "attention" / "index.html").read_text(encoding="utf-8")


@pytest.mark.slow
def test_site_in_a_browser(built_site, tmp_path):
    """Headless Chromium opens the built site as a reader would: the home page renders, the attention concept page's
    equations are all typeset by KaTeX without errors, and its experiment plot has loaded (naturalWidth > 0)."""
    from doctools.browser import check_site

    found = check_site(built_site, tmp_path)
    assert found["math"] >= 5 and found["typeset"] == found["math"] and found["katex_errors"] == 0
    assert found["plot_width"] > 0
    assert (tmp_path / "home.png").stat().st_size > 10_000 and (tmp_path / "concept.png").stat().st_size > 10_000
