"""The parts of a Markdown page the checks read: fenced blocks with their markers, links, and headings.

A fence that cannot run offline on a CPU is preceded by a marker line, and the paragraph just above the marker
says why in words a reader sees (the marker itself is an HTML comment, invisible on the page)::

    The call below needs a GPU.

    <!-- snippet: skip needs-gpu -->
    ```python
    ...

A page whose Python blocks are too slow for ``make test`` (trainers, graph exports) carries
``<!-- snippets: slow -->`` on a line of its own; the slow tests run them.
"""

import dataclasses
import pathlib
import re
import unicodedata

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})(?P<info>[^`]*)$")
SKIP_MARKER = re.compile(r"^\s*<!--\s*snippet:\s*skip\s+(?P<reason>[\w-]+)\s*-->\s*$")
SLOW_PAGE_MARKER = re.compile(r"^<!--\s*snippets:\s*slow\s*-->\s*$", re.MULTILINE)
# the words that must appear in the paragraph above a skip marker, so the page says it in prose
SKIP_REASONS = {
    "needs-gpu": ("GPU",),
    "needs-network": ("network", "online", "Hub", "internet"),
    # vLLM pins its own torch and transformers, so it lives in .venv-vllm (make vllm), never in the test environment;
    # tests/test_vllm.py serves checkpoints there
    "needs-vllm": ("vLLM",),
}
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\((?P<target><[^>]+>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"(?P<target>[^\"]+)\"")
HEADING = re.compile(r"^(?P<hashes>#{1,6})\s+(?P<title>.+?)\s*#*\s*$")
EXPLICIT_ID = re.compile(r"\{\s*#(?P<id>[\w-]+)[^}]*\}\s*$")


class MarkdownError(ValueError):
    """A page breaks a rule of the docs contract; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class Fence:
    path: pathlib.Path
    line: int  # 1-based line of the opening fence; the code starts on the next line
    lang: str
    code: str
    skip: str | None = None  # the reason of a `<!-- snippet: skip REASON -->` marker

    def where(self, root: pathlib.Path | None = None) -> str:
        path = self.path.relative_to(root) if root is not None else self.path
        return f"{path}:{self.line}"


def fences(path: pathlib.Path) -> list[Fence]:
    """Every fenced block of ``path``, with the skip marker that precedes it (a marker before anything but a
    ```python fence, an unknown reason, or a marker without a sentence above it saying why, is a MarkdownError)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, ticks = opening["indent"], opening["ticks"]
        lang = opening["info"].strip().split(" ")[0].lower()
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^{re.escape(indent)}{ticks[0]}{{{len(ticks)},}}\s*$", lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise MarkdownError(f"{path}:{i + 1}: this ``` fence is never closed.")
        found.append(Fence(path, i + 1, lang, "\n".join(body) + "\n", skip_reason(path, lines, i, lang)))
        i = j + 1
    return found


def skip_reason(path: pathlib.Path, lines: list[str], fence_index: int, lang: str) -> str | None:
    """The reason of the skip marker on the last non-blank line before the fence, checked; None without one."""
    k = fence_index - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    marker = SKIP_MARKER.match(lines[k]) if k >= 0 else None
    if marker is None:
        if k >= 0 and "snippet:" in lines[k] and "<!--" in lines[k]:
            raise MarkdownError(
                f"{path}:{k + 1}: {lines[k].strip()!r} is not a snippet marker; write "
                f"<!-- snippet: skip REASON --> with REASON one of {', '.join(SKIP_REASONS)}."
            )
        return None
    reason = marker["reason"]
    if reason not in SKIP_REASONS:
        raise MarkdownError(
            f"{path}:{k + 1}: unknown skip reason {reason!r}; use one of {', '.join(SKIP_REASONS)}."
        )
    if lang != "python":
        raise MarkdownError(f"{path}:{k + 1}: a skip marker stands before a ```{lang} fence; only ```python runs.")
    paragraph = []
    m = k - 1
    while m >= 0 and not lines[m].strip():
        m -= 1
    while m >= 0 and lines[m].strip() and not FENCE.match(lines[m]):
        paragraph.append(lines[m])
        m -= 1
    words = SKIP_REASONS[reason]
    if not any(word in " ".join(paragraph) for word in words):
        raise MarkdownError(
            f"{path}:{k + 1}: the block is skipped ({reason}) but the paragraph above the marker does not say so; "
            f"write a sentence there that mentions {' or '.join(words)}."
        )
    return reason


def is_slow_page(path: pathlib.Path) -> bool:
    return bool(SLOW_PAGE_MARKER.search(path.read_text(encoding="utf-8")))


def shell_lines(fence: Fence) -> list[tuple[int, str]]:
    """The commands of a ```bash fence as (line number, command): continuation lines joined, comments and blank
    lines dropped."""
    commands, pending, start = [], "", None
    for offset, raw in enumerate(fence.code.splitlines(), start=fence.line + 1):
        if start is None:
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            start = offset
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        commands.append((start, pending + raw))
        pending, start = "", None
    return commands


# ----------------------------------------------------------------------------------------------
# Links and headings


def slugify(title: str) -> str:
    """The id Python-Markdown's toc extension (mkdocs) gives a heading."""
    text = title.replace("`", "").replace("*", "")  # the rendered text of code spans and emphasis
    text = re.sub(r"<[^>]+>", "", text)  # and of inline HTML
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: pathlib.Path) -> set[str]:
    """The ids of the headings of ``path`` (outside fences), numbered -1, -2 on repeats as the toc extension does."""
    ids: set[str] = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        heading = None if in_fence else HEADING.match(line)
        if heading is None:
            continue
        explicit = EXPLICIT_ID.search(heading["title"])
        slug = explicit["id"] if explicit else slugify(heading["title"])
        unique, n = slug, 1
        while unique in ids:
            unique, n = f"{slug}_{n}", n + 1
        ids.add(unique)
    return ids


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link and image and every HTML href/src outside code."""
    found, in_fence = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        prose = re.sub(r"`[^`]*`", "", line)  # a link inside inline code is code
        for pattern in (LINK, HTML_LINK):
            found.extend((number, m["target"].strip("<>")) for m in pattern.finditer(prose))
    return found


def broken_links(path: pathlib.Path, extra_files: dict[str, pathlib.Path] | None = None) -> list[str]:
    """What is wrong with the relative links of ``path``: a missing file, or an anchor no heading of the target
    has. External links (a scheme such as https:) are not fetched. ``extra_files`` maps site paths that the build
    adds (relative to docs/) to the files they come from."""
    problems = []
    extra_files = extra_files or {}
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # https:, mailto:, ...
        file_part, _, anchor = target.partition("#")
        if file_part:
            resolved = (path.parent / file_part).resolve()
            if not resolved.exists():
                docs_dir = pathlib.Path(__file__).resolve().parent.parent / "docs"
                try:
                    site_path = resolved.relative_to(docs_dir).as_posix()
                except ValueError:
                    site_path = None
                if site_path in extra_files:
                    resolved = extra_files[site_path]
                else:
                    problems.append(f"{path}:{line}: {target!r}: no such file {resolved}")
                    continue
        else:
            resolved = path
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{path}:{line}: {target!r}: {resolved.name} has no heading with the id #{anchor}")
    return problems
