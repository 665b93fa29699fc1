"""The Markdown the docs site renders from the code and the results, so that it cannot drift from them.

A page asks for a block with a marker line, which ``doctools.mkdocs_hooks`` replaces at build time:

    <!-- generate: config-fields -->          every DecoderLabConfig field: type, default, its docstring
    <!-- generate: presets -->                DecoderLabConfig.from_preset's architectures and sizes
    <!-- generate: flags training/pretrain.py -->   a script's flags, from its parser (and its Config dataclass)
    <!-- generate: experiment attention_scale -->   an experiment's verdict, checks and plots (results.json)

Each generator raises ``GenerateError`` when its source lacks what the page needs (a config field without a
docstring, a script without a parser, an experiment without results), so ``mkdocs build`` fails instead of
printing a hole.
"""

import argparse
import ast
import dataclasses
import json
import pathlib
import posixpath
import re
import typing

from . import REPO_ROOT
from .commands import capture_parser, project_command

MARKER = re.compile(r"^<!--\s*generate:\s*(?P<kind>[\w-]+)(?:\s+(?P<arg>\S+))?\s*-->\s*$", re.MULTILINE)
EXPERIMENTS_DIR = REPO_ROOT / "experiments" / "results"
EXPERIMENTS_SITE_DIR = "experiments"  # where the build puts each experiment's report.md and plots (site paths)
CONFIG_SOURCE = REPO_ROOT / "decoderlab" / "configuration_decoderlab.py"


class GenerateError(ValueError):
    """A generated block cannot be made from its source; the message says what is missing."""


def cell(text: str) -> str:
    """Text for a Markdown table cell: one line, pipes escaped outside code spans (inside them, the tables
    extension leaves pipes alone and an escape would show)."""
    parts = re.split(r"(`[^`]*`)", " ".join(str(text).split()))
    return "".join(part if part.startswith("`") else part.replace("|", "\\|") for part in parts)


def code(value) -> str:
    return f"`{value}`"


def markdown_from_rst(text: str) -> str:
    """A docstring's ``literal`` spans as Markdown code spans."""
    return re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))


# ----------------------------------------------------------------------------------------------
# DecoderLabConfig


@dataclasses.dataclass(frozen=True)
class ConfigField:
    name: str
    group: str
    annotation: str
    default: object
    doc: str


def config_fields() -> list[ConfigField]:
    """Every field of DecoderLabConfig in the order of its source, with the group comment above it (``# sizes``)
    and the docstring under it; GenerateError names a field that has none."""
    from decoderlab import DecoderLabConfig

    source = CONFIG_SOURCE.read_text(encoding="utf-8")
    lines = source.splitlines()
    cls = next(
        node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "DecoderLabConfig"
    )
    defaults = {f.name: f.default for f in dataclasses.fields(DecoderLabConfig)}
    found, group, body = [], "", cls.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        comment = lines[node.lineno - 2].strip()
        if comment.startswith("# "):
            group = comment[2:]
        name = node.target.id
        after = body[i + 1] if i + 1 < len(body) else None
        if not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            raise GenerateError(
                f"DecoderLabConfig.{name} has no docstring (a string on the line after the field, saying what it "
                f"does): the configuration reference is generated from them. Add one in {CONFIG_SOURCE.name}."
            )
        found.append(ConfigField(name, group, ast.unparse(node.annotation), defaults.get(name), after.value.value))
    missing = set(DecoderLabConfig.__dict__.get("__annotations__", {})) - {f.name for f in found}
    if missing:
        raise GenerateError(f"DecoderLabConfig fields not found in its class body: {sorted(missing)}.")
    return found


def describe_annotation(annotation: str) -> str:
    """``PositionEmbeddingType`` (a Literal alias of the config module) as its choices; other types as written."""
    from decoderlab import configuration_decoderlab

    alias = getattr(configuration_decoderlab, annotation, None)
    if typing.get_origin(alias) is typing.Literal:
        return " | ".join(f'`"{choice}"`' for choice in typing.get_args(alias))
    return code(annotation)


def config_fields_markdown() -> str:
    out, group = [], None
    for f in config_fields():
        if f.group != group:
            group = f.group
            out += ["", f"### {group[0].upper()}{group[1:]}", "", "| field | type | default | what it does |", "|---|---|---|---|"]
        default = code(repr(f.default))
        out.append(
            f"| `{f.name}` | {cell(describe_annotation(f.annotation))} | {cell(default)} | {cell(markdown_from_rst(f.doc))} |"
        )
    return "\n".join(out).strip() + "\n"


def presets_markdown() -> str:
    """Two tables: each preset's fields (one column per preset), and the sizes."""
    from decoderlab.configuration_decoderlab import PRESETS, SIZES

    names = list(PRESETS)
    fields = list(dict.fromkeys(key for preset in PRESETS.values() for key in preset))

    def show(value) -> str:
        if callable(value):  # a value computed from the preset's sizes
            return cell((value.__doc__ or value.__name__).split(":")[0].strip())
        return cell(code(json.dumps(value) if isinstance(value, dict) else repr(value)))

    out = ["| field | " + " | ".join(f"`{n}`" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in fields:
        values = [show(PRESETS[n][key]) if key in PRESETS[n] else "" for n in names]
        out.append(f"| `{key}` | " + " | ".join(values) + " |")
    out += ["", "| size | " + " | ".join(f"`{k}`" for k in next(iter(SIZES.values()))) + " |"]
    out.append("|---" * (len(next(iter(SIZES.values()))) + 1) + "|")
    for size, values in SIZES.items():
        out.append(f"| `{size}` | " + " | ".join(str(v) for v in values.values()) + " |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------
# Script flags


def config_class_of(module_name: str, parser: argparse.ArgumentParser):
    """The ``training.args.Config`` dataclass whose fields are exactly the flags of ``parser`` (the scripts that
    read ``parse_config``), or None for a plain argparse script."""
    import importlib

    from training.args import Config

    flags = {a.dest for a in parser._actions if a.dest not in ("help", "config", "debug")}
    module = importlib.import_module(module_name)
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, Config) and value is not Config:
            if {f.name for f in dataclasses.fields(value)} == flags:
                return value
    return None


def flags_markdown(script: str) -> str:
    """The flags of ``script`` (``training/pretrain.py``, ``decoderlab.convert``): from its Config dataclass
    (type, default, help) when it reads one, else from its argparse parser."""
    command = project_command(f"python {script}" if script.endswith(".py") else f"python -m {script}")
    if command is None:
        raise GenerateError(f"{script!r} is not a project script (training/*.py or a decoderlab/benchmarks module).")
    parser = capture_parser(command.module)
    cls = config_class_of(command.module, parser)
    return config_flags_markdown(cls) if cls is not None else argparse_flags_markdown(parser)


def config_flags_markdown(cls) -> str:
    from training.args import Config, describe

    hints = typing.get_type_hints(cls)
    parent = next((base for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) and base is not Config), None)
    own = set(cls.__dict__.get("__annotations__", {})) if parent is not None else None
    rows = ["| flag | type | default | what it sets |", "|---|---|---|---|"]
    if any(f.name == "model" for f in dataclasses.fields(cls)) or parent is not None:
        rows.append("| `--config FILE` | YAML file | | a recipe whose values the other flags override |")
    for f in dataclasses.fields(cls):
        if own is not None and f.name not in own:
            continue
        if f.metadata.get("positional"):
            flag, default = f.name.upper(), "(required)"
        else:
            flag = f"--{f.name}"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = code(default)
        rows.append(f"| `{flag}` | {cell(describe(hints[f.name]))} | {cell(default)} | {cell(f.metadata.get('help', ''))} |")
    if any(f.name == "model" for f in dataclasses.fields(cls)):
        rows.append("| `--model.FIELD VALUE` | | | one `DecoderLabConfig` field of `model` (see the configuration reference) |")
    if parent is None:  # a subclass's table lists only its own flags
        from training.args import DEBUG_HELP

        rows.append(f"| `--debug` | switch | | {DEBUG_HELP} |")
    text = "\n".join(rows) + "\n"
    if parent is not None:
        text += f"\nEvery flag of `{parent.__name__}` works here too; the table lists the ones this script adds or gives another default.\n"
    return text


def argparse_flags_markdown(parser: argparse.ArgumentParser) -> str:
    formatter = parser._get_formatter()
    rows = ["| flag | values | default | what it sets |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = ", ".join(action.option_strings) or action.dest.upper()
        if action.choices:
            values = ", ".join(map(str, action.choices))
        elif action.nargs == 0:
            values = "switch"
        else:
            values = getattr(action.type, "__name__", "") or "text"
            values = "text" if values in ("", "str") else values
        required = not action.option_strings or action.required
        default = "(required)" if required else ("" if action.default in (None, False) else code(action.default))
        help_text = formatter._expand_help(action) if action.help else ""
        rows.append(f"| `{flag}` | {cell(values)} | {cell(default)} | {cell(help_text)} |")
    return "\n".join(rows) + "\n"


# ----------------------------------------------------------------------------------------------
# Experiments


def experiment_files() -> dict[str, pathlib.Path]:
    """Site path -> file, for every experiment's report.md and plots (``experiments/NAME/report.md``)."""
    files = {}
    for folder in sorted(p for p in EXPERIMENTS_DIR.iterdir() if p.is_dir()):
        for path in sorted(folder.iterdir()):
            if path.suffix in (".md", ".png"):
                files[f"{EXPERIMENTS_SITE_DIR}/{folder.name}/{path.name}"] = path
    return files


# Repository folders the site carries at the same paths (the performance page links its results files and the notes
# that tell their history; the notes link the archived results)
PUBLISHED_DIRS = ("benchmarks/results", "benchmarks/notes")
SITE_LINK = re.compile(r"(?P<head>\]\(\s*<?)(?P<target>[^)\s>#]+)(?P<tail>[^)]*\))")


def published_files() -> dict[str, pathlib.Path]:
    """Site path -> file for every results file, plot and note (``benchmarks/results/speed.json``): the same path as in
    the repository, so their links to each other hold as they are."""
    return {
        path.relative_to(REPO_ROOT).as_posix(): path
        for folder in PUBLISHED_DIRS
        for path in sorted((REPO_ROOT / folder).rglob("*"))
        if path.is_file() and path.suffix in (".json", ".md", ".png")  # results, notes, the plots drawn from them
    }


def repository_path(site_path: str) -> pathlib.Path:
    """Where the page at ``site_path`` lives in the repository: docs/ for the docs, its own path for a published
    file, experiments/results/ for the experiments' reports."""
    if site_path.startswith(tuple(folder + "/" for folder in PUBLISHED_DIRS)):
        return REPO_ROOT / site_path
    if site_path.startswith(EXPERIMENTS_SITE_DIR + "/"):
        return EXPERIMENTS_DIR / site_path.removeprefix(EXPERIMENTS_SITE_DIR + "/")
    return REPO_ROOT / "docs" / site_path


def site_links(markdown: str, site_path: str) -> str:
    """The page's relative links, written for reading in the repository, rewritten for the site where the two
    differ: a docs page's link to a published file (``../benchmarks/results/x.json``) or to an experiment's report or
    plot (``../experiments/results/NAME/x.png``), and a note's link into docs/ (``../../docs/performance.md``), point
    at the file's place in the site. Other links are left as they are."""
    page = repository_path(site_path)
    docs = REPO_ROOT / "docs"
    published = published_files()
    experiments = {path: site for site, path in experiment_files().items()}

    def rewrite(match: re.Match) -> str:
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("/"):
            return match[0]
        resolved = pathlib.Path(posixpath.normpath((page.parent / target).as_posix()))
        if resolved.is_relative_to(docs):
            site = resolved.relative_to(docs).as_posix()
        elif resolved.is_relative_to(REPO_ROOT) and resolved.relative_to(REPO_ROOT).as_posix() in published:
            site = resolved.relative_to(REPO_ROOT).as_posix()
        elif resolved in experiments:
            site = experiments[resolved]
        else:
            return match[0]
        new = posixpath.relpath(site, posixpath.dirname(site_path) or ".")
        return match["head"] + new + match["tail"]

    return SITE_LINK.sub(rewrite, markdown)


def experiment_markdown(name: str, page_path: str) -> str:
    """An experiment's verdict, its checks and its plots, read from ``experiments/results/NAME``; links relative to
    the page at site path ``page_path`` (``concepts/attention.md``)."""
    folder = EXPERIMENTS_DIR / name
    if not (folder / "results.json").is_file():
        raise GenerateError(f"No results for experiment {name!r}: {folder / 'results.json'} does not exist.")
    results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    report = (folder / "report.md").read_text(encoding="utf-8")
    claim = re.search(r"^\*\*Claim\.\*\*\s*(.+)$", report, re.MULTILINE)
    base = posixpath.relpath(f"{EXPERIMENTS_SITE_DIR}/{name}", posixpath.dirname(page_path) or ".")
    held = sum(check["held"] for check in results["checks"])
    out = [f'!!! example "Experiment `{name}`: the claim {results["verdict"]} at this scale"', ""]
    if claim:
        out.append(f"    **Claim.** {claim[1].strip()}")
        out.append("")
    out.append(f"    {held} of {len(results['checks'])} checks held:")
    out.append("")
    out.append("    | check | held | evidence |")
    out.append("    |---|---|---|")
    for check in results["checks"]:
        out.append(f"    | {cell(check['statement'])} | {'yes' if check['held'] else '**no**'} | {cell(check['evidence'])} |")
    out.append("")
    for alt, image in re.findall(r"!\[([^\]]*)\]\(([^)]+\.png)\)", report):
        out.append(f"    ![{alt}]({base}/{image})")
        out.append("")
    seeds = len(results.get("seeds", [])) or 1
    out.append(
        f"    Seeds: {seeds}; run at decoderlab commit `{results['commit'][:12]}` in {results['wall_time_s'] / 60:.0f} "
        f"minutes. Setup, every number and how to rerun it: [the full report]({base}/report.md)."
    )
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------


def expand(markdown: str, page_path: str) -> str:
    """``markdown`` with every ``<!-- generate: ... -->`` marker replaced by its block."""

    def block(match: re.Match) -> str:
        kind, arg = match["kind"], match["arg"]
        if kind == "config-fields":
            return config_fields_markdown()
        if kind == "presets":
            return presets_markdown()
        if kind == "flags" and arg:
            return flags_markdown(arg)
        if kind == "experiment" and arg:
            return experiment_markdown(arg, page_path)
        raise GenerateError(f"{page_path}: unknown marker {match.group(0)!r}.")

    return MARKER.sub(block, markdown)
