"""python -m decoderlab.explore: see ``decoderlab.explore.cli``."""

from ..cli import run_command
from .cli import main

if __name__ == "__main__":
    run_command(main)
