"""Where the tests find the repository and the shared data (read from ../shared, never copied in)."""

import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
INPUT_TXT = SHARED_DATA / "tinyshakespeare" / "input.txt"  # the Tiny Shakespeare corpus
