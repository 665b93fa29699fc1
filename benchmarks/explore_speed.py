"""How fast each view of the mechanics explorer answers, at the default recipe's shape and at 12 x 768.

    python -m benchmarks.explore_speed                 # about a minute on 2 cores
    python -m benchmarks.explore_speed --json_out benchmarks/results/explore_speed.json

The goals: every view within 1 s for the default recipe's model (training/configs/shakespeare_char.yaml:
4 x 128, 64 positions, the 67-token character vocabulary) and within 5 s for a 12 x 768 model (the llama preset's "small"
size with GPT-2's 50,304-token vocabulary and 1024 positions). Prompts of 64 tokens (the recipe's block), and for
12 x 768 also of 256, the longest the explorer draws. Weights are random: a view's cost does not depend on them.
torch's own number of threads by default (one per core), as the explorer runs unless its --threads says otherwise.

Each view is timed as ``Explorer`` answers it on the server, HTML included: *cold*, for a prompt never seen (the one
forward with attention weights and its backward, ``measure.analyse``, included: what the first view after Run
costs), and *warm*, once another view has run that forward (what the other views after Run cost). The norm view's
fresh models (one per block layout) are built once when the explorer starts: timed apart. Medians of --repeats.
"""

import pathlib
import statistics
import time

import torch

from benchmarks.common import load_average, machine_line, timing_parser, write_timing
from benchmarks.reference_nanogpt import DEFAULT_DATA_PATH
from decoderlab import DecoderLabConfig, DecoderLabForCausalLM
from decoderlab.explore import Explorer
from decoderlab.explore.loading import Loaded
from training.args import TrainConfig, parse_config
from training.data import train_char_tokenizer

RECIPE = pathlib.Path(__file__).resolve().parents[1] / "training" / "configs" / "shakespeare_char.yaml"
GOALS_S = {"shakespeare_char": 1.0, "12x768": 5.0}
# prompt lengths timed: the recipe's block of 64 tokens, and for 12 x 768 also the longest prompt the views draw
PROMPT_TOKENS = {"shakespeare_char": (64,), "12x768": (64, 256)}


def config_for(shape: str, vocab_size: int) -> DecoderLabConfig:
    if shape == "shakespeare_char":
        recipe = parse_config(TrainConfig, ["--config", str(RECIPE)])  # read as training/pretrain.py reads it
        return DecoderLabConfig(vocab_size=vocab_size, max_position_embeddings=recipe.block_size, **recipe.model)
    return DecoderLabConfig.from_preset("llama", "small", vocab_size=50304, max_position_embeddings=1024)


def views(explorer: Explorer, prompt: str) -> dict:
    """Each view with the page's default controls (the generation view: 20 tokens, the model's sampling defaults),
    and the attention tab's button that re-runs the model at each scale."""
    sampling = explorer.sampling_defaults
    return {
        "attention": lambda: explorer.attention(prompt, 0, 0),
        "scale re-runs": lambda: explorer.scale_losses(prompt),
        "heads": lambda: explorer.heads(prompt, 0),
        "positions": lambda: explorer.positions(prompt, 0, 0, -1, 0),
        "norm placement": lambda: explorer.norms(prompt),
        "generation": lambda: explorer.generation(prompt, 20, sampling["temperature"], sampling["top_k"],
                                                  sampling["top_p"], 0),  # fmt: skip
    }


def seconds(run) -> float:
    start = time.perf_counter()
    page = run()
    elapsed = time.perf_counter() - start
    if 'role="alert"' in page:
        raise RuntimeError(f"the view answered with a message instead of its figures: {page[:400]}")
    return elapsed


def build_explorer(shape: str, tokenizer) -> tuple[Explorer, float]:
    """An explorer over a random model of ``shape`` (eager attention, the recipe's sampling defaults), and the
    seconds its fresh models took to build."""
    torch.manual_seed(0)
    model = DecoderLabForCausalLM(config_for(shape, len(tokenizer))).eval()
    model.set_attn_implementation("eager")
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.8
    model.generation_config.top_k = 200
    explorer = Explorer(Loaded(model=model, tokenizer=tokenizer, source=shape))
    start = time.perf_counter()
    explorer.fresh_models()
    return explorer, time.perf_counter() - start


def time_views(explorer: Explorer, repeats: int, tokens: int, text: str) -> dict:
    """Median seconds of each view, cold and warm, and of the prompt's forward and backward alone."""
    prompts = [text[i * 1000 : i * 1000 + tokens] for i in range(repeats + 1)]  # a new prompt each round
    seconds(views(explorer, prompts[-1])["attention"])  # warm-up: first calls into each kernel
    cold, warm, analysis = {}, {}, []
    for prompt in prompts[:repeats]:
        for name, run in views(explorer, prompt).items():
            explorer.forget()
            cold.setdefault(name, []).append(seconds(run))
            explorer.forget()
            start = time.perf_counter()
            explorer.analysis(prompt)
            analysis.append(time.perf_counter() - start)
            warm.setdefault(name, []).append(seconds(run))
    return {
        "prompt_tokens": tokens,
        "analysis_s": statistics.median(analysis),
        "cold_s": {name: statistics.median(v) for name, v in cold.items()},
        "warm_s": {name: statistics.median(v) for name, v in warm.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__, repeats=3)
    parser.set_defaults(threads=torch.get_num_threads())
    parser.add_argument("--shapes", default="shakespeare_char,12x768", help="comma-separated: shakespeare_char, 12x768")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16-token prompts, one round")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    text = DEFAULT_DATA_PATH.read_text(encoding="utf-8")  # Tiny Shakespeare, read from ../shared/data
    tokenizer = train_char_tokenizer([text])
    load_before = load_average()
    results = {}
    for shape in args.shapes.split(","):
        if shape not in GOALS_S:
            parser.error(f"--shapes: unknown shape {shape!r}; choose from {', '.join(GOALS_S)}.")
        explorer, fresh_s = build_explorer(shape, tokenizer)
        config, goal = explorer.config, GOALS_S[shape]
        described = (f"{config.num_hidden_layers} x {config.hidden_size}, {config.num_attention_heads} heads, "
                     f"vocabulary {config.vocab_size}")  # fmt: skip
        print(f"\n{shape}: {described}; goal: every view within {goal:g} s")
        print(f"  fresh models of the norm view, built once at start-up: {fresh_s:.2f} s")
        runs = []
        for tokens in (16,) if args.quick else PROMPT_TOKENS[shape]:
            run = time_views(explorer, 1 if args.quick else args.repeats, tokens, text)
            runs.append(run)
            print(f"  prompt of {tokens} tokens: its forward with attention weights and backward (once per prompt) "
                  f"{run['analysis_s']:.3f} s")  # fmt: skip
            print(f"    {'view':<16} {'cold (new prompt)':>18} {'warm':>8}  within {goal:g} s")
            for name, cold in run["cold_s"].items():
                print(f"    {name:<16} {cold:>16.3f} s {run['warm_s'][name]:>6.3f} s  {'yes' if cold <= goal else 'NO'}")
            total = run["analysis_s"] + sum(run["warm_s"].values())
            print(f"    all of them for one prompt (the forward once, then each view): {total:.2f} s")
        results[shape] = {"model": described, "goal_s": goal, "fresh_models_s": fresh_s, "prompts": runs}
    write_timing(args.json_out, args.threads, load_before, repeats=args.repeats, results=results)


if __name__ == "__main__":
    main()
