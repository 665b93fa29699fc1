"""Claim 2, RoPE encodes relative position (Su et al. 2021): rotated query-key scores depend only on the offset
between the query and the key, not on where the pair sits; absolute encodings (learned, sinusoidal) do not.

    python -m experiments.rope_relative --jobs 2 --threads 1   # about 10 minutes on 2 CPU cores
    python -m experiments.rope_relative --quick                # smoke test

One model per ``position_embedding_type`` (rope, sinusoidal, learned, none) is trained on Tiny Shakespeare
at a short length, once per seed; the absolute encodings get token embeddings of the original Transformer's scale
(std 1/sqrt(d) multiplied by sqrt(d)), so position and content enter at comparable sizes. Then (a) the first layer's scores q·k for a sequence of one repeated character, read from
the model's own attention call, as a map over (query position, key position); (b) the same text placed at
two different absolute positions; (c) the loss at every position of sequences longer than the training length.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import common

NAME = "rope_relative"
POSITION_TYPES = ("rope", "sinusoidal", "learned", "none")
ABSOLUTE = ("sinusoidal", "learned")  # added to the token embeddings at the bottom of the model
REVISION = (
    "This version multiplies the absolute encodings' token embeddings by sqrt(d) as the original Transformer does "
    "(before, the sinusoidal model's position signal started about 35 times larger than its content), trains 500 "
    "steps instead of 800 to fit three seeds in the same time, and counts the length check only beyond the "
    "seed-to-seed spread."
)
SINUSOID_RMS = 0.5**0.5  # every entry of the sinusoidal table is a sin or cos of the position


@dataclass(frozen=True)
class Settings:
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    block_size: int = 64  # the training length
    eval_length: int = 512  # evaluation length; also max_position_embeddings of every model
    eval_sequences: int = 48  # validation sequences of eval_length
    batch_size: int = 16
    steps: int = 500
    learning_rate: float = 1e-3
    eval_blocks: int = 256
    map_length: int = 64  # size of the score map
    shift: int = 100  # the second absolute position of the shifted text


QUICK = Settings(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, block_size=16, eval_length=48, eval_sequences=2,
    batch_size=4, steps=4, eval_blocks=8, map_length=12, shift=20,
)  # fmt: skip


@torch.no_grad()
def first_layer_scores(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(nh, T, T) scores q·k·scale of layer 0 for one sequence (1, T), as the model computes them."""
    device = next(model.parameters()).device
    if position_ids is not None:
        position_ids = position_ids.to(device)
    with common.AttentionRecorder(model.config) as recorder:
        model(input_ids=input_ids.to(device), position_ids=position_ids, use_cache=False)
    return recorder.scores[0][0].float().cpu()


def diagonal_spread(scores: torch.Tensor) -> float:
    """How far a causal score map (T, T) is from constant along its diagonals: the mean over offsets of the
    scores' standard deviation along that diagonal, relative to the standard deviation of all the scores.
    0 for a map that depends only on the offset; NaN when every score is the same (nothing to compare)."""
    T = scores.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    spread = scores[causal].std().item()
    if spread <= 1e-6 * scores[causal].abs().mean().item():
        return float("nan")
    per_offset = [scores.diagonal(-offset).std().item() for offset in range(T - 1)]  # diagonals with >= 2 entries
    return float(np.mean(per_offset)) / spread


def vaswani_embeddings(model) -> None:
    """Embeddings at the original Transformer's scale (Vaswani et al. 2017, section 3.4): token embeddings of std
    1/sqrt(d), which ``embedding_multiplier`` sqrt(d) brings to unit scale; a learned position table is drawn at the
    sinusoidal table's root mean square, so both absolute encodings add a position signal of the same size."""
    nn.init.normal_(model.model.embed_tokens.weight, std=model.config.hidden_size**-0.5)
    if model.config.position_embedding_type == "learned":
        nn.init.normal_(model.model.embed_positions.weight, std=SINUSOID_RMS)


def position_fields(kind: str, hidden_size: int) -> dict:
    """The fields that select ``kind``; absolute encodings with the original Transformer's embedding scale."""
    scale = {"embedding_multiplier": math.sqrt(hidden_size)} if kind in ABSOLUTE else {}
    return {"position_embedding_type": kind, **scale}


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    return np.convolve(values, np.ones(window) / window, mode="valid")


def main(argv: list[str] | None = None) -> None:
    common.run_experiment(NAME, __doc__, Settings(), QUICK, run, argv)


@dataclass
class Measured:
    """What is measured on the trained models: (a) score maps, (b) the shift test, (c) the loss by position."""

    char: str  # the repeated character of the score maps
    maps: dict  # kind -> (T, T) layer-0 head-0 scores of the first seed's model
    spreads: dict  # kind -> diagonal spread of its map
    shift_change: dict  # kind -> relative change of layer 0's scores when the text moves
    seed_position_loss: dict  # kind -> (seeds, eval_length - 1) loss at each position
    train_length: int  # block_size: the positions trained on

    @property
    def position_loss(self) -> dict:
        """kind -> (eval_length - 1,) mean over the seeds; [i] is the loss of predicting position i + 1."""
        return {kind: losses.mean(0) for kind, losses in self.seed_position_loss.items()}

    @property
    def seed_rise(self) -> dict:
        """kind -> (seeds,) loss beyond the training length minus loss well inside it."""
        T = self.train_length
        inside = slice(T // 2 - 1, T - 1)  # predictions of positions T/2 .. T-1: well inside the training length
        beyond = slice(T - 1, None)  # predictions of positions T .. eval_length-1: never trained on
        return {kind: losses[:, beyond].mean(1) - losses[:, inside].mean(1)
                for kind, losses in self.seed_position_loss.items()}  # fmt: skip

    @property
    def rise(self) -> dict:
        return {kind: float(values.mean()) for kind, values in self.seed_rise.items()}

    def band_loss(self, kind: str, band: tuple[int, int]) -> float:
        """Mean loss of predicting the positions ``band[0]`` to ``band[1] - 1``."""
        return float(self.position_loss[kind][max(band[0] - 1, 0) : band[1] - 1].mean())


def run(session: common.Session, settings: Settings) -> None:
    if settings.eval_length <= settings.block_size:
        raise ValueError(
            f"--eval_length {settings.eval_length} must exceed --block_size {settings.block_size}: the experiment "
            "evaluates beyond the training length."
        )
    corpus = common.load_corpus(session, settings.block_size, settings.eval_blocks)
    long_blocks = corpus.validation_blocks(settings.eval_length, settings.eval_sequences)
    training = dict(
        max_train_steps=settings.steps, per_device_train_batch_size=settings.batch_size,
        learning_rate=settings.learning_rate, num_warmup_steps=settings.steps // 10,
        logging_steps=max(1, settings.steps // 20), max_eval_samples=settings.eval_blocks,
    )  # fmt: skip
    model_fields = dict(
        hidden_size=settings.hidden_size, num_hidden_layers=settings.num_hidden_layers,
        num_attention_heads=settings.num_attention_heads,
        # learned and sinusoidal tables need a row for every evaluated position; rows past block_size are
        # never trained (learned) or never seen in training (sinusoidal)
        max_position_embeddings=settings.eval_length,
    )  # fmt: skip
    specs = {
        kind: common.Spec(
            kind, {**model_fields, **position_fields(kind, settings.hidden_size)}, training,
            vaswani_embeddings if kind in ABSOLUTE else None,
        )
        for kind in POSITION_TYPES
    }  # fmt: skip
    runs = common.train_all(session, corpus, specs)  # kind -> Trials; maps and shifts read the first seed's model
    measured = measure(settings, corpus, runs, long_blocks)
    session.log("measured score maps, shifts and long-sequence losses")

    maps_png = maps_figure(session, settings, measured)
    length_png = length_figure(session, settings, measured, len(long_blocks))
    common.write_report(
        session,
        title="RoPE encodes relative position",
        claim=(
            "Rotary position embeddings make the query-key score depend only on the offset between the two "
            "positions (Su et al. 2021): for fixed content the score map over (query position, key position) is "
            "constant along its diagonals, which is not so for absolute encodings. Compared with them, RoPE, "
            "sinusoidal, learned and no positions are also evaluated beyond the training length."
        ),
        setup=setup_text(session, settings, training, measured, len(long_blocks)),
        results=f"""{maps_png}

{structure_table(settings, runs, measured)}

{length_png}

Mean loss (nats/char) by position band:

{length_table(settings, measured)}""",
        checks=checks(settings, measured),
        discussion=discussion(session, settings, runs, measured),
        revision=REVISION,
        numbers={
            "char": measured.char, "diagonal_spread": measured.spreads, "shift_change": measured.shift_change,
            "rise_beyond": measured.rise,
            "position_loss": {kind: loss.round(4).tolist() for kind, loss in measured.position_loss.items()},
            "rise_beyond_per_seed": {kind: values.tolist() for kind, values in measured.seed_rise.items()},
            "runs": {kind: {"final_eval_losses": t.losses.tolist(), "eval_curves": [r.eval_curve for r in t.runs],
                     "seconds": t.seconds} for kind, t in runs.items()},
        },
    )  # fmt: skip
    session.log(f"wrote {session.output_dir / 'report.md'}")


def measure(settings: Settings, corpus: common.Corpus, runs: dict, long_blocks: torch.Tensor) -> Measured:
    # (a) score maps for fixed content: one character repeated, the most frequent one in the validation text
    char_id = int(torch.bincount(corpus.eval_blocks.flatten().long()).argmax())
    repeated = torch.full((1, settings.map_length), char_id)
    maps = {kind: first_layer_scores(run.model, repeated)[0] for kind, run in runs.items()}  # head 0: (T, T)

    # (b) a real text at absolute positions 0.. and shift..: does layer 0 score it the same?
    text = corpus.eval_blocks[:1, : settings.map_length].long()
    positions = torch.arange(settings.map_length)[None]
    shift_change = {}
    for kind, run in runs.items():
        at_start = first_layer_scores(run.model, text, positions)
        shifted = first_layer_scores(run.model, text, positions + settings.shift)
        causal = torch.ones(settings.map_length, settings.map_length, dtype=torch.bool).tril()
        shift_change[kind] = ((shifted - at_start)[:, causal].abs().max() / at_start[:, causal].abs().max()).item()

    # (c) loss at every position of sequences longer than the training length, every seed's model
    seed_position_loss = {
        kind: np.array([common.token_losses(run.model, long_blocks).mean(0).numpy() for run in trials.runs])
        for kind, trials in runs.items()
    }  # kind -> (seeds, eval_length - 1)
    return Measured(
        corpus.tokenizer.decode([char_id]), maps, {kind: diagonal_spread(m) for kind, m in maps.items()},
        shift_change, seed_position_loss, settings.block_size,
    )  # fmt: skip


def maps_figure(session: common.Session, settings: Settings, measured: Measured) -> str:
    """Each model's score map for the repeated character, and its scores against the offset at a few queries."""
    fig, axes = common.figure(ncols=len(POSITION_TYPES), nrows=2, width=3.6, height=3.4)
    causal = torch.ones(settings.map_length, settings.map_length, dtype=torch.bool).tril()
    for col, (kind, scores) in enumerate(measured.maps.items()):
        ax = axes[0][col]
        shown = scores.masked_fill(~causal, float("nan")).numpy()
        image = ax.imshow(shown, cmap="viridis", origin="upper")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        spreads = measured.spreads
        spread = "n/a (all equal)" if np.isnan(spreads[kind]) else f"{spreads[kind]:.2g}"
        ax.set(title=f"{kind}: diagonal spread {spread}", xlabel="key position", ylabel="query position")
        ax = axes[1][col]
        queries = np.linspace(settings.map_length // 4, settings.map_length - 1, 4).astype(int)
        for width, query in zip((4.0, 2.8, 1.8, 1.0), queries):  # thinner on top: overlapping lines stay visible
            offsets = np.arange(query + 1)
            ax.plot(offsets, scores[query, query - offsets].numpy(), lw=width, label=f"query at {query}")
        ax.set(title=f"{kind}: score vs offset", xlabel="offset (query - key)", ylabel="score q·k·scale")
        ax.legend(fontsize=7)
    return common.save_figure(
        fig, session, "score_maps.png", f"layer-0 head-0 score maps for the repeated character {measured.char!r}"
    )


def length_figure(session: common.Session, settings: Settings, measured: Measured, sequences: int) -> str:
    """The loss at each position of the long validation sequences, each seed and their mean."""
    T = settings.block_size
    fig, axes = common.figure(ncols=1, width=7.5, height=4.2)
    ax = axes[0][0]
    window = max(1, min(16, settings.eval_length // 16))
    for i, (kind, losses) in enumerate(measured.seed_position_loss.items()):
        x = np.arange(len(smooth(losses[0], window))) + 1 + window // 2
        for loss in losses:  # one faint line per seed, the mean on top
            ax.plot(x, smooth(loss, window), color=f"C{i}", alpha=0.25, lw=0.8)
        ax.plot(x, smooth(losses.mean(0), window), color=f"C{i}", label=f"{kind} (mean of {len(losses)} seeds)")
    ax.axvline(T, color="gray", ls=":", label=f"training length {T}")
    ax.set(xlabel="position of the predicted character", ylabel=f"loss (nats/char, mean of {window})",
           title=f"loss by position on {sequences} validation sequences of {settings.eval_length}")  # fmt: skip
    ax.set_ylim(top=min(6.0, max(float(loss.max()) for loss in measured.position_loss.values()) + 0.2))
    ax.legend()
    return common.save_figure(fig, session, "length_generalization.png", "loss by position beyond the training length")


def checks(settings: Settings, measured: Measured) -> list[common.Check]:
    """The claim's parts, decided from the numbers."""
    spreads, shift_change, seed_rise = measured.spreads, measured.shift_change, measured.seed_rise
    return [
        common.Check(
            "RoPE's scores for fixed content are constant along every diagonal (spread under 1e-4)",
            bool(spreads["rope"] < 1e-4),
            f"diagonal spread {spreads['rope']:.2g}",
        ),
        common.Check(
            "learned and sinusoidal positions' scores are not (spread above 0.01)",
            bool(spreads["learned"] > 0.01 and spreads["sinusoidal"] > 0.01),
            f"learned {spreads['learned']:.2g}, sinusoidal {spreads['sinusoidal']:.2g}",
        ),
        common.Check(
            f"moving a text by {settings.shift} positions leaves RoPE's scores unchanged (relative change under 1e-4)"
            " and changes the absolute encodings' (above 0.01)",
            bool(shift_change["rope"] < 1e-4 and min(shift_change["learned"], shift_change["sinusoidal"]) > 0.01),
            ", ".join(f"{kind} {shift_change[kind]:.2g}" for kind in POSITION_TYPES),
        ),
        common.Check(
            f"beyond the training length ({settings.block_size}), RoPE's loss rises less than learned and sinusoidal "
            "positions' (by more than the seed-to-seed spread)",
            all(common.lower_beyond_spread(seed_rise["rope"], seed_rise[kind]) for kind in ABSOLUTE),
            ", ".join(f"{kind} {common.mean_pm(seed_rise[kind])}" for kind in POSITION_TYPES)
            + "; rope vs "
            + ", ".join(f"{kind}: {common.spread_note(seed_rise['rope'], seed_rise[kind])}" for kind in ABSOLUTE),
        ),
    ]


def bands(settings: Settings) -> list[tuple[int, int]]:
    """Position bands (first, last + 1): the first and second half of the training length, then beyond it."""
    T = settings.block_size
    bands = [(0, T // 2), (T // 2, T), (T, 2 * T), (2 * T, 4 * T), (4 * T, settings.eval_length)]
    return [(a, min(b, settings.eval_length)) for a, b in bands if a < settings.eval_length]


def length_table(settings: Settings, measured: Measured) -> str:
    T = settings.block_size
    return common.markdown_table(
        ["positions", "in training?", "rope", "sinusoidal", "learned", "none"],
        [
            [f"{a}-{b - 1}", "yes" if b <= T else "no", *(measured.band_loss(kind, (a, b)) for kind in POSITION_TYPES)]
            for a, b in bands(settings)
        ]
        + [["rise: beyond minus inside", "", *(common.mean_pm(measured.seed_rise[kind]) for kind in POSITION_TYPES)]],
    )  # fmt: skip


def structure_table(settings: Settings, runs: dict, measured: Measured) -> str:
    spreads = measured.spreads
    return common.markdown_table(
        ["positions", "diagonal spread (fixed content)", f"score change when shifted by {settings.shift}",
         f"validation loss at {settings.block_size}", "train time (s)"],
        [
            [kind, "n/a (all scores equal)" if np.isnan(spreads[kind]) else spreads[kind], measured.shift_change[kind],
             str(runs[kind]), round(runs[kind].seconds)]
            for kind in POSITION_TYPES
        ],
    )  # fmt: skip


def discussion(session: common.Session, settings: Settings, runs: dict, measured: Measured) -> str:
    T, rise = settings.block_size, measured.rise
    best_beyond = min(POSITION_TYPES, key=lambda kind: rise[kind])
    near, far = next(band for band in bands(settings) if band[0] >= T), bands(settings)[-1]
    at = lambda band: ", ".join(f"{kind} {measured.band_loss(kind, band):.3f}" for kind in POSITION_TYPES)
    if best_beyond == "rope":
        extrapolation = "Here RoPE degraded least beyond the training length."
    else:
        extrapolation = (
            "Encoding relative position did not by itself make the model extrapolate best: that is why long-context "
            "models rescale RoPE (`rope_parameters` with `linear`, `dynamic`, `yarn`, ...)."
        )
    weakest = max(POSITION_TYPES, key=lambda kind: runs[kind].mean)
    return f"""**Why the maps look as they do.** With RoPE, layer 0 sees the same content vector at every position and
rotates its query by the angle of position m and its key by that of n, so q·k depends on n - m alone: every
diagonal of the map is one value (the spread left is float32 rounding). Learned and sinusoidal positions add a
different vector to each position *before* the projections, so a score mixes content-position and
position-position terms that depend on m and n separately. Without positions (NoPE) every query and key of
repeated content is the same vector: the map is flat, and layer 0 cannot tell positions apart at all; such a model
can only learn position from the causal mask, in later layers. The shift test is the same property on real text.

**Beyond the training length.** The learned table's rows past {T} were never trained (they keep their random
initialisation), and sinusoidal rows past {T} were never seen, so both models meet inputs unlike any in training;
`max_position_embeddings={settings.eval_length}` only lets them run at all (shorter tables raise a `ValueError` by
design). RoPE never meets a new vector, but it does meet offsets larger than any it was trained on. Here the
smallest rise beyond the training length was {best_beyond}'s ({rise[best_beyond]:+.3f} nats/char); RoPE's was
{rise["rope"]:+.3f}. The average hides a change with distance: just past the training length (positions
{near[0]}-{near[1] - 1}) the losses are {at(near)}; in the last band ({far[0]}-{far[1] - 1}) they are {at(far)}.
{extrapolation}

**Inside the training length** the validation losses (mean ± standard deviation over {len(session.seeds)} seeds) are
{", ".join(f"{kind} {runs[kind]}" for kind in POSITION_TYPES)}; the weakest is {weakest}. As in Vaswani et al., the
absolute encodings' token embeddings start at unit scale (std 1/sqrt(d) times `embedding_multiplier` sqrt(d) =
{math.sqrt(settings.hidden_size):.3g}) and the position signal they are added to has root mean square
{SINUSOID_RMS:.2f} (the sinusoidal table, and the learned table as initialised here), so neither signal swamps the
other at the start; RoPE and NoPE keep decoderlab's embeddings (std {runs["rope"].model.config.initializer_range}),
which RoPE's rotation and the first norm do not mix with any position vector."""


def setup_text(session, settings: Settings, training: dict, measured: Measured, sequences: int) -> str:
    T = settings.block_size
    return f"""Four models, identical except `position_embedding_type` (rope, sinusoidal, learned, none):
{settings.num_hidden_layers} layers, hidden size {settings.hidden_size}, {settings.num_attention_heads} heads,
pre-RMSNorm, SwiGLU, `max_position_embeddings={settings.eval_length}`; the sinusoidal and learned models multiply
their token embeddings (std 1/sqrt(d)) by sqrt(d), as the original Transformer does, and the learned table starts at
the sinusoidal table's root mean square {SINUSOID_RMS:.2f}. Every model is trained with {len(session.seeds)} seeds
(weights and data order); (a) and (b) read the first seed's model, (c) every seed's. Each is trained on character-level Tiny
Shakespeare in blocks of {T} characters (the training length) for {settings.steps} steps of batch
{settings.batch_size}, AdamW at peak learning rate {settings.learning_rate}, {training["num_warmup_steps"]} warm-up steps,
cosine decay, clipping at 1.0.

(a) *Score maps*: layer 0, head 0 scores q·k·scale of the character {measured.char!r} repeated {settings.map_length} times,
read from the model's own attention call (an attention function registered with transformers that records the
scores and then runs decoderlab's eager kernel). The *diagonal spread* is the mean standard deviation along the
diagonals divided by the standard deviation of the whole causal map: 0 when the score depends on the offset alone.
(b) *Shift*: the first {settings.map_length} validation characters scored at positions 0.. and at {settings.shift}..
(`position_ids`); the change is the largest score difference relative to the largest score, over all heads of
layer 0. (c) *Length*: the next-character loss at each position of {sequences} validation sequences of
{settings.eval_length} characters; *inside* is positions {T // 2}-{T - 1}, *beyond* is {T}-{settings.eval_length - 1}."""


if __name__ == "__main__":
    main()
