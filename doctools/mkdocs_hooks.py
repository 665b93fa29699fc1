"""mkdocs hooks (``hooks:`` in mkdocs.yml): the generated blocks and the experiments' files.

- ``on_files``: each experiment's ``report.md`` and plots, from ``experiments/results/NAME/``, become site files
  at ``experiments/NAME/`` (read where they are, never copied into docs/).
- ``on_page_markdown``: every ``<!-- generate: ... -->`` marker of a page becomes its block (``doctools.generate``).
"""

import pathlib
import sys

from mkdocs.structure.files import File

REPO_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:  # mkdocs loads this file by its path; doctools is a folder of the checkout
    sys.path.insert(0, REPO_ROOT)

from doctools.generate import expand, experiment_files  # noqa: E402


def on_files(files, config):
    for site_path, source in experiment_files().items():
        files.append(File.generated(config, site_path, abs_src_path=str(source)))
    return files


def on_page_markdown(markdown, page, config, files):
    return expand(markdown, page.file.src_uri)
