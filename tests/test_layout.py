"""The package's layout: what travels inside checkpoints stays apart, and decoderlab's modules import one another in
one direction (``convert`` -> ``export`` -> ``gguf_export`` -> ``convert`` was once a circle, hidden in imports
inside functions).

Read from the source with ``ast``, every import counted, those inside functions too."""

import ast
import pathlib

import decoderlab

PACKAGE = pathlib.Path(decoderlab.__file__).parent
# The files save_pretrained copies into every checkpoint (tests/test_save_load.py checks the copy itself)
TRAVELLING = {"configuration_decoderlab", "modeling_decoderlab", "kernels_decoderlab", "roles_decoderlab", "compat_decoderlab"}


def module_name(path: pathlib.Path) -> str:
    parts = ("decoderlab", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def decoderlab_imports(path: pathlib.Path) -> set[str]:
    """The decoderlab modules ``path`` imports, absolute or relative, at the top or inside a function."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names if alias.name.split(".")[0] == "decoderlab"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "decoderlab":
                continue
            # "from . import x" and "from .export import families" name modules; "from .x import name" does not
            submodules = {f"{target}.{alias.name}" for alias in node.names}
            modules |= (submodules & set(MODULES)) or {target}
    return modules


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: decoderlab_imports(path) - {name} for name, path in MODULES.items()}


def test_decoderlab_modules_import_each_other_without_a_circle():
    """No chain of imports leads from a decoderlab module back to itself (a package's ``__init__`` re-exporting its
    modules is the one allowed way up). A circle makes import order matter and hides in function-level imports."""
    graph = {name: {m for m in imports if not name.startswith(m + ".")} for name, imports in GRAPH.items()}
    circles = []

    def visit(name: str, path: list[str]) -> None:
        for imported in sorted(graph.get(name, ())):
            if imported in path:
                circles.append(" -> ".join([*path[path.index(imported) :], imported]))
            elif imported in graph:
                visit(imported, [*path, imported])

    for name in graph:
        visit(name, [name])
    assert not circles, f"decoderlab's modules import one another in a circle: {sorted(set(circles))}"


def test_travelling_files_import_only_each_other():
    """The four files a checkpoint carries import no other decoderlab module: a checkpoint loaded with
    ``trust_remote_code`` and without the package has only them."""
    assert TRAVELLING <= {name.rpartition(".")[2] for name in MODULES}
    outside = {
        name: sorted(imported for imported in GRAPH[name] if imported.rpartition(".")[2] not in TRAVELLING)
        for name in (f"decoderlab.{stem}" for stem in TRAVELLING)
    }
    assert not any(outside.values()), f"travelling files import tools that never travel: {outside}"


def test_exporters_import_downwards_to_the_checkpoint_reader():
    """``decoderlab.export``'s modules import in the order its docstring draws: the reader imports no exporter,
    ``families`` only the reader, the formats the two below them, and nothing imports the command on top."""
    allowed = {
        "decoderlab.export.checkpoint": set(),
        "decoderlab.export.families": {"decoderlab.export.checkpoint"},
        "decoderlab.export.gguf_file": {"decoderlab.export.checkpoint", "decoderlab.export.families"},
        "decoderlab.export.onnx_executorch": {"decoderlab.export.checkpoint", "decoderlab.export.families"},
    }
    for name, below in allowed.items():
        exporters = {m for m in GRAPH[name] if m.startswith("decoderlab.export")}
        assert exporters <= below, f"{name} imports {sorted(exporters - below)}, which sit above it or beside it"
    importers = sorted(name for name, imports in GRAPH.items() if "decoderlab.convert" in imports)
    assert not importers, f"{importers} import the command decoderlab.convert; import from decoderlab.export instead"


# torch APIs the package uses as it is imported (subclassed or called at import time), and the first torch release
# that has each: the floor pyproject.toml declares must be at least the newest of them
TORCH_AT_IMPORT = {"torch.optim.Muon": (2, 9)}  # training/optim.py: class BatchedMuon(torch.optim.Muon)


def test_the_torch_floor_has_every_api_used_at_import():
    """pyproject.toml's torch requirement admits no release that lacks an API the package needs as soon as it is
    imported (a training script on torch 2.8 would fail to import, AdamW runs included), and each such API is
    really used where the table says."""
    import re

    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    requirement = re.search(r'^\s*"(torch[^"]*)",', pyproject, re.MULTILINE).group(1)
    floor = tuple(int(part) for part in re.fullmatch(r"torch>=(\d+)\.(\d+)", requirement).groups())
    assert floor >= max(TORCH_AT_IMPORT.values()), requirement
    optim = (PACKAGE.parent / "training" / "optim.py").read_text()
    assert "class BatchedMuon(torch.optim.Muon)" in optim
