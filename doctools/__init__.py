"""What keeps the documentation true: the docs site's generated parts and the checks the tests run on the pages.

- ``doctools.markdown``: the fenced blocks, skip markers, links and headings of README.md and docs/**/*.md.
- ``doctools.commands``: a shell line of the docs, parsed by the argument parser of the project script it runs.
- ``doctools.generate``: the Markdown the site renders from the code (config fields, presets, script flags) and
  from the experiments' results (plot and verdict).
- ``doctools.mkdocs_hooks``: the mkdocs hooks that put those into the pages (``hooks:`` in mkdocs.yml).

Nothing here is part of the decoderlab package; it runs from a checkout, like ``benchmarks/`` and ``experiments/``.
"""

import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS_DIR = REPO_ROOT / "docs"


def doc_pages() -> list[pathlib.Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [REPO_ROOT / "README.md", *sorted(DOCS_DIR.rglob("*.md"))]
