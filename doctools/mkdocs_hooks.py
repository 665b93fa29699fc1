"""mkdocs hooks (``hooks:`` in mkdocs.yml): the generated blocks and the experiments' files.

- ``on_files``: each experiment's ``report.md`` and plots, from ``experiments/results/NAME/``, become site files
  at ``experiments/NAME/`` (read where they are, never copied into docs/).
- ``on_files``: the results files and notes under ``benchmarks/`` become site files at the same paths, so the
  performance page's links to them work in the site too.
- ``on_page_markdown``: every ``<!-- generate: ... -->`` marker of a page becomes its block (``doctools.generate``),
  and links written for the repository are rewritten for the site where the two differ (``site_links``).
"""

import pathlib
import sys

from mkdocs.structure.files import File

REPO_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:  # mkdocs loads this file by its path; doctools is a folder of the checkout
    sys.path.insert(0, REPO_ROOT)

from doctools.generate import expand, experiment_files, published_files, site_links  # noqa: E402


def on_files(files, config):
    for site_path, source in {**experiment_files(), **published_files()}.items():
        files.append(File.generated(config, site_path, abs_src_path=str(source)))
    return files


def on_page_markdown(markdown, page, config, files):
    return site_links(expand(markdown, page.file.src_uri), page.file.src_uri)
