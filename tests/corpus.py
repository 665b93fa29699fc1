"""A local corpus laid out like FineWeb-Edu's sample folders, for the data tests: ``data/train-000NN-of-000FF.parquet``
files with a ``text`` and an ``id`` column, whose documents can be told apart in any training block.

Each document is pieces of Tiny Shakespeare, every piece after its document's tag ``<NNNNN>``: 7 characters every 47
at most, so each block of 64 characters that lies inside a document names it (``tags``).
"""

import pathlib
import random
import re

import pyarrow as pa
import pyarrow.parquet as pq

from tests.paths import INPUT_TXT

TAG = re.compile(r"<(\d{5})>")
PIECE = 40  # characters of text between two tags


def document(index: int, text: str, length: int, rng: random.Random) -> str:
    """About ``length`` characters: tag, 40 characters of ``text`` from a random place, tag, ..."""
    pieces = []
    while sum(map(len, pieces)) < length:
        start = rng.randrange(len(text) - PIECE)
        pieces.append(f"<{index:05d}>" + text[start : start + PIECE])
    return "".join(pieces)


def write_fineweb_like(folder: pathlib.Path, files: int = 14, documents_per_file: int = 40, seed: int = 0) -> list[str]:
    """Write the corpus into ``folder`` (a dataset folder in the Hub layout); returns its documents in file order,
    document ``i`` tagged ``i``. Lengths vary from 200 to 800 characters."""
    rng = random.Random(seed)
    text = INPUT_TXT.read_text(encoding="utf-8").replace("<", "(")
    (folder / "data").mkdir(parents=True, exist_ok=True)
    documents = []
    for f in range(files):
        rows = [document(len(documents) + i, text, rng.randrange(200, 800), rng) for i in range(documents_per_file)]
        ids = [f"<urn:uuid:{len(documents) + i:08d}>" for i in range(documents_per_file)]
        table = pa.table({"text": rows, "id": ids})
        pq.write_table(table, folder / "data" / f"train-{f:05d}-of-{files:05d}.parquet", row_group_size=16)
        documents += rows
    return documents


def tags(text: str) -> set[int]:
    """The documents named in ``text``."""
    return {int(tag) for tag in TAG.findall(text)}
