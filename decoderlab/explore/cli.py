"""python -m decoderlab.explore CKPT [--host 127.0.0.1] [--port 7860] [--save report.html]

A web page over a checkpoint that shows each of the Transformer's mechanisms at work on a prompt you type:
attention maps and the scale, heads sharing keys and values, positions, norm placement, generation step by step.
With --save, the same views for one prompt go into one self-contained HTML file and no server starts.
"""

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

import torch
from transformers.utils.logging import disable_progress_bar

from .loading import ExploreError, load
from .views import DEFAULT_PROMPT, Explorer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m decoderlab.explore",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "checkpoint",
        help="a decoderlab checkpoint (folder or Hub id), or a Llama, GPT-2 or GPT-NeoX one (converted on load)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=7860, help="port to listen on")
    parser.add_argument("--save", metavar="REPORT.html", help="write every view for --prompt to this file and exit")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt of the saved report")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="run the checkpoint's own modeling code instead of the installed package's")  # fmt: skip
    parser.add_argument(
        "--attn_implementation",
        default="eager",
        help="attention backend; eager returns the weights the attention and heads views draw, others (sdpa) do not",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the fresh models and the prompt's shuffle")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's, one per core); a small model answers alike with one, a large one "
        "needs them all (python -m benchmarks.explore_speed)",
    )
    return parser


def save_problem(path: Path) -> str | None:
    """Why the report cannot be written to ``path``, or None."""
    if path.is_dir():
        return "is a folder; give the file to write, e.g. report.html inside it."
    folder = path.parent
    if not folder.is_dir():
        return f"its folder {folder} does not exist; create it first (mkdir -p {folder})."
    if not os.access(folder, os.W_OK):
        return f"its folder {folder} is not writable."
    return None


def listening_line(host: str, url: str) -> str:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    reach = (
        "only this machine can reach it; --host 0.0.0.0 opens it to the network"
        if loopback
        else "other machines on the network can reach it"
    )
    return f"decoderlab explorer listening on {host}, at {url} ({reach}). Ctrl-C stops it."


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        print(f"error: --port {args.port}: give a port from 0 to 65535 (0: any free port).", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"error: --threads {args.threads}: give at least 1.", file=sys.stderr)
        return 2
    if args.save:
        problem = save_problem(Path(args.save))
        if problem:  # before the model loads and every view is drawn
            print(f"error: --save {args.save}: {problem}", file=sys.stderr)
            return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("decoderlab").setLevel(logging.INFO)  # the conversion's summary line; not the web server's
    disable_progress_bar()
    try:
        loaded = load(args.checkpoint, args.trust_remote_code, args.attn_implementation)
    except ExploreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    explorer = Explorer(loaded, seed=args.seed)
    explorer.fresh_models()  # the norm view's models of every block layout, built before the first request
    if args.save:
        try:
            explorer.encode(args.prompt)
        except ExploreError as err:
            print(f"error: --prompt: {err}", file=sys.stderr)
            return 2
        Path(args.save).write_text(explorer.report(args.prompt), encoding="utf-8")
        print(f"wrote {args.save}")
        return 0

    from .app import build, launch  # Gradio only where a page is served

    demo = build(explorer)
    try:
        url = launch(demo, args.host, args.port)
    except OSError as err:
        print(f"error: cannot listen on {args.host}:{args.port} ({err}). Pick another --port.", file=sys.stderr)
        return 2
    print(listening_line(args.host, url), flush=True)
    try:
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    return 0
