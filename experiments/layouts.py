"""Claim (Mistral, Gemma 2 and 3, SmolLM3, gpt-oss): per-layer attention layouts are free where the model was
trained and help beyond it. Sliding windows on most layers (Beltagy et al. 2020; Jiang et al. 2023), layers without
RoPE (SmolLM3; Yang et al. 2025) and learned attention sinks (gpt-oss; Xiao et al. 2024) each give the validation
loss of full attention with RoPE on every layer at the training length, and a lower one at two and four times that
length; with sinks, the heads stop piling attention on the first token.

    python -m experiments.layouts --jobs 2 --threads 1   # about 30 minutes on 2 CPU cores
    python -m experiments.layouts --quick                # smoke test

Four models of ``make demo``'s recipe (training/configs/shakespeare_char.yaml: its model and its optimisation, Muon
included) at blocks of 256 characters, identical but for one switch each: full attention on every layer; sliding
windows of 64 tokens on three of every four layers (``layer_types``, ``sliding_window``); no RoPE on every fourth
layer (``no_rope_layer_interval=4``); learned sinks on every layer (``attention_sinks``). Each is trained once per
seed on Tiny Shakespeare, then scored on the same validation text cut into sequences of 1, 2 and 4 times the
training length (the length question of ``experiments/rope_relative.py``), and its attention weights, read from its
own attention call, say how much of each query's attention lands on the first token (and, with sinks, on the sink).
"""

from dataclasses import dataclass

import numpy as np
import torch

from decoderlab.explore.measure import head_summary

from . import common

NAME = "layouts"
REVISION = "The first version of this experiment."
RECIPE = common.REPO_ROOT / "training" / "configs" / "shakespeare_char.yaml"
SETTINGS = ("full", "sliding", "rope_free", "sinks")  # the keys of the trained settings, the baseline first
LABELS = {"full": "full attention", "sliding": "sliding, 3 of 4 layers", "rope_free": "RoPE-free every 4th",
          "sinks": "attention sinks"}  # fmt: skip
EVERY = 4  # one layer in EVERY keeps full attention (the sliding setting) or skips RoPE (the RoPE-free one)


@dataclass(frozen=True)
class Settings:
    block_size: int = 256  # the training length
    sliding_window: int = 64  # tokens a sliding layer's query sees, itself included
    batch_size: int = 16
    steps: int = 400
    warmup_steps: int = 40
    length_multiples: tuple[int, ...] = (1, 2, 4)  # evaluation lengths, in training lengths
    eval_sequences: int = 32  # validation sequences of the longest evaluation length: the text every length reads
    mass_sequences: int = 16  # validation blocks of the training length whose attention weights are read


QUICK = Settings(block_size=32, sliding_window=8, batch_size=4, steps=4, warmup_steps=1, eval_sequences=2,
                 mass_sequences=2)  # fmt: skip


def layout_fields(setting: str, settings: Settings, num_hidden_layers: int) -> dict:
    """The fields that switch ``setting`` on for a model of ``num_hidden_layers`` layers: every EVERY-th layer (the
    EVERY-th, 2 EVERY-th, ..., counting from 1, as SmolLM3 counts its RoPE-free layers) keeps full attention in the
    sliding setting and skips RoPE in the RoPE-free one."""
    if setting == "sliding":
        kinds = ["full_attention" if (i + 1) % EVERY == 0 else "sliding_attention" for i in range(num_hidden_layers)]
        return {"layer_types": kinds, "sliding_window": settings.sliding_window}
    if setting == "rope_free":
        return {"no_rope_layer_interval": EVERY}
    if setting == "sinks":
        return {"attention_sinks": True}
    return {}


@dataclass
class Measured:
    """What is measured on the trained models besides their training curves."""

    lengths: list[int]  # evaluation lengths in tokens
    losses: dict  # setting -> (seeds, lengths) mean validation loss over every position of sequences of that length
    position_loss: dict  # setting -> (longest length - 1,) loss at each position, mean over sequences and seeds
    first_token: dict  # setting -> (seeds, L) weight on the first token, mean over heads and queries 1..T-1
    sink_share: np.ndarray  # (seeds, L, nh) the sinks model's attention given to its sinks, mean over queries 1..T-1
    sink_logits: np.ndarray  # (seeds, L, nh) the sinks model's learned sink logits s_h

    def at(self, setting: str, multiple_index: int) -> np.ndarray:
        """(seeds,) validation losses of ``setting`` at the evaluation length ``lengths[multiple_index]``."""
        return self.losses[setting][:, multiple_index]

    def first_token_mean(self, setting: str) -> np.ndarray:
        """(seeds,) weight on the first token, mean over the layers too."""
        return self.first_token[setting].mean(1)


def main(argv: list[str] | None = None) -> None:
    common.run_experiment(NAME, __doc__, Settings(), QUICK, run, argv)


def run(session: common.Session, settings: Settings) -> None:
    if settings.sliding_window >= settings.block_size:
        raise ValueError(
            f"--sliding_window {settings.sliding_window} must be shorter than --block_size {settings.block_size}: a "
            "window as long as the training block is full attention there."
        )
    model_fields, recipe_training = common.recipe(RECIPE)
    longest = settings.block_size * max(settings.length_multiples)
    # RoPE has no table to run out of; max_position_embeddings only has to admit the longest evaluation
    model_fields = {**model_fields, "max_position_embeddings": longest}
    training = {
        **recipe_training, "max_train_steps": settings.steps, "per_device_train_batch_size": settings.batch_size,
        "num_warmup_steps": settings.warmup_steps, "logging_steps": max(1, settings.steps // 20),
        "max_eval_samples": 4 * settings.eval_sequences,
    }  # fmt: skip
    layers = model_fields["num_hidden_layers"]
    specs = {
        setting: common.Spec(LABELS[setting], {**model_fields, **layout_fields(setting, settings, layers)}, training)
        for setting in SETTINGS
    }
    corpus = common.load_corpus(session, settings.block_size, 4 * settings.eval_sequences)
    text = corpus.validation_blocks(longest, settings.eval_sequences)  # (N, longest): every length reads this text
    runs = common.train_all(session, corpus, specs)  # setting -> Trials
    measured = measure(settings, runs, text)
    session.log("measured the losses at every length and where the attention goes")

    length_png = length_figure(session, settings, measured)
    mass_png = mass_figure(session, settings, measured, runs)
    kernel = {setting: trials.model.config._attn_implementation for setting, trials in runs.items()}
    common.write_report(
        session,
        title="Per-layer attention layouts: what sliding windows, RoPE-free layers and sinks buy",
        claim=(
            "Sliding windows on three of four layers, RoPE-free layers and learned attention sinks each give the "
            "validation loss of full attention with RoPE on every layer at the training length, and a lower loss "
            "at two and four times the training length; with sinks, less attention lands on the first token."
        ),
        setup=setup_text(session, settings, model_fields, training, kernel, len(text)),
        results=f"""{length_png}

Validation loss (nats/char, mean ± standard deviation over the seeds) on the same text cut into sequences of each
length:

{length_table(measured, runs)}

{mass_png}

{mass_table(measured, layers)}""",
        checks=checks(settings, measured),
        discussion=discussion(session, settings, measured, layers),
        revision=REVISION,
        numbers={
            "lengths": measured.lengths,
            "losses": {setting: values.tolist() for setting, values in measured.losses.items()},
            "position_loss": {setting: values.round(4).tolist() for setting, values in measured.position_loss.items()},
            "first_token": {setting: values.tolist() for setting, values in measured.first_token.items()},
            "sink_share": measured.sink_share.tolist(), "sink_logits": measured.sink_logits.tolist(),
            "attn_implementation": kernel,
            "runs": {setting: {"final_eval_losses": t.losses.tolist(), "eval_curves": [r.eval_curve for r in t.runs],
                               "seconds": [r.seconds for r in t.runs]} for setting, t in runs.items()},
        },
    )  # fmt: skip
    session.log(f"wrote {session.output_dir / 'report.md'}")


@torch.no_grad()
def attention_weights(model, blocks: torch.Tensor) -> torch.Tensor:
    """(L, B, nh, T, T) every layer's attention weights, from the model's own attention call (a sinks layer's rows
    sum to less than 1: the rest went to its sink)."""
    device = next(model.parameters()).device
    with common.AttentionRecorder(model.config) as recorder:
        model(input_ids=blocks.long().to(device), use_cache=False)
    return torch.stack(recorder.weights).float().cpu()


def where_attention_goes(weights: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """From (L, B, nh, T, T) weights: (L,) the weight on the first token and (L, nh) the share that went to no token
    (the sink's: 1 minus the row's sum), each averaged over the queries 1..T-1 (the first token's own query has no
    choice) and the sequences; the first over the heads too."""
    first = np.stack([
        np.mean([head_summary(w)["first"].numpy() for w in layer]) for layer in weights
    ])  # fmt: skip
    sink = (1 - weights[..., 1:, :].sum(-1)).mean(dim=(1, 3)).numpy()  # (L, nh)
    return first, sink


def measure(settings: Settings, runs: dict, text: torch.Tensor) -> Measured:
    """Every seed's model scored at every length on ``text`` (N, longest) and its attention weights read on the
    first ``mass_sequences`` blocks of the training length."""
    T, longest = settings.block_size, text.shape[1]
    lengths = [T * m for m in settings.length_multiples]
    blocks = text[:, :T][: settings.mass_sequences]
    losses, position_loss, first_token = {}, {}, {}
    sink_share, sink_logits = [], []
    for setting, trials in runs.items():
        per_seed, by_position, first = [], [], []
        for run in trials.runs:
            at_lengths = []
            for length in lengths:
                token_losses = common.token_losses(run.model, text.reshape(-1, length), batch_size=8)
                at_lengths.append(token_losses.mean().item())
                if length == longest:
                    by_position.append(token_losses.mean(0).numpy())
            per_seed.append(at_lengths)
            layer_first, layer_sink = where_attention_goes(attention_weights(run.model, blocks))
            first.append(layer_first)
            if setting == "sinks":
                sink_share.append(layer_sink)
                sink_logits.append(torch.stack([layer.self_attn.sinks.detach().float().cpu()
                                                for layer in run.model.model.layers]).numpy())  # fmt: skip
        losses[setting] = np.array(per_seed)
        position_loss[setting] = np.mean(by_position, axis=0)
        first_token[setting] = np.array(first)
    return Measured(lengths, losses, position_loss, first_token, np.array(sink_share), np.array(sink_logits))


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    return np.convolve(values, np.ones(window) / window, mode="valid")


def length_figure(session: common.Session, settings: Settings, measured: Measured) -> str:
    """The loss at each evaluation length (mean and each seed), and at each position of the longest sequences."""
    fig, axes = common.figure(ncols=2, width=6.0, height=4.0)
    ax = axes[0][0]
    for i, setting in enumerate(SETTINGS):
        trials = [per_seed_trials(measured.at(setting, j)) for j in range(len(measured.lengths))]
        common.plot_mean_and_seeds(ax, measured.lengths, trials, color=f"C{i}", label=LABELS[setting])
    ax.set_xscale("log", base=2)
    ax.set(xticks=measured.lengths, xticklabels=[str(n) for n in measured.lengths], xlabel="sequence length",
           ylabel="validation loss (nats/char)", title=f"loss by length (trained at {settings.block_size})")  # fmt: skip
    ax.legend(fontsize=8)
    ax = axes[0][1]
    longest = measured.lengths[-1]
    window = max(1, min(16, longest // 32))
    for i, setting in enumerate(SETTINGS):
        loss = smooth(measured.position_loss[setting], window)
        ax.plot(np.arange(len(loss)) + 1 + window // 2, loss, color=f"C{i}", label=LABELS[setting])
    ax.axvline(settings.block_size, color="gray", ls=":", label=f"training length {settings.block_size}")
    top = max(float(loss[settings.block_size :].max()) for loss in measured.position_loss.values())
    ax.set_ylim(top=min(top + 0.2, 6.0))
    ax.set(xlabel="position of the predicted character", ylabel=f"loss (nats/char, mean of {window})",
           title=f"loss by position in sequences of {longest} (mean of the seeds)")  # fmt: skip
    ax.legend(fontsize=8)
    return common.save_figure(fig, session, "loss_by_length.png", "validation loss at 1, 2 and 4 times the training "
                              "length, and by position")  # fmt: skip


def per_seed_trials(losses: np.ndarray) -> common.Trials:
    """Per-seed losses as the Trials that ``common.plot_mean_and_seeds`` draws."""
    runs = [common.Run(f"seed {i}", None, [], [(0, float(loss))], None, 0.0) for i, loss in enumerate(losses)]
    return common.Trials("", list(range(len(losses))), runs)


def mass_figure(session: common.Session, settings: Settings, measured: Measured, runs: dict) -> str:
    """Each layer's weight on the first token in each setting, and the sinks model's share to its sink per head."""
    fig, axes = common.figure(ncols=2, width=6.0, height=4.0)
    ax = axes[0][0]
    layers = measured.first_token["full"].shape[1]
    width = 0.8 / len(SETTINGS)
    for i, setting in enumerate(SETTINGS):
        values = measured.first_token[setting]  # (seeds, L)
        x = np.arange(layers) + (i - (len(SETTINGS) - 1) / 2) * width
        ax.bar(x, values.mean(0), width, yerr=values.std(0, ddof=1) if len(values) > 1 else None, capsize=2,
               color=f"C{i}", label=LABELS[setting])  # fmt: skip
    kinds = runs["sliding"].model.config.layer_types
    ax.set_xticks(np.arange(layers), [f"{i}\n({'window' if kind == 'sliding_attention' else 'full'} in sliding)"
                                      for i, kind in enumerate(kinds)], fontsize=8)  # fmt: skip
    ax.set(xlabel="layer", ylabel="weight on the first token",
           title=f"attention on the first token (queries 1..{settings.block_size - 1})")  # fmt: skip
    ax.legend(fontsize=8)
    ax = axes[0][1]
    share = measured.sink_share  # (seeds, L, nh)
    heads = share.shape[2]
    for head in range(heads):
        ax.plot(np.arange(layers), share[:, :, head].mean(0), marker="o", lw=1, label=f"head {head}")
        for seed_values in share[:, :, head]:
            ax.scatter(np.arange(layers), seed_values, s=8, alpha=0.3, color=f"C{head}")
    ax.set_xticks(np.arange(layers))
    ax.set(xlabel="layer", ylabel="attention given to the sink", ylim=(0, max(0.05, float(share.max()) * 1.1)),
           title="sinks model: each head's share to its sink (mean of the seeds; dots: each seed)")  # fmt: skip
    ax.legend(fontsize=8)
    return common.save_figure(fig, session, "attention_mass.png", "attention on the first token per layer, and each "
                              "head's share to its sink")  # fmt: skip


def checks(settings: Settings, measured: Measured) -> list[common.Check]:
    """The claim's parts, decided from the numbers: at the training length no setting is worse than full attention
    beyond the seed spread; beyond it each is better at every longer length; with sinks less weight on token 0."""
    T = settings.block_size
    longer = range(1, len(measured.lengths))
    result = []
    for setting in SETTINGS[1:]:
        result.append(common.Check(
            f"{LABELS[setting]}: at the training length ({T}) the loss is no higher than full attention's (beyond the "
            "seed-to-seed spread)",
            not common.lower_beyond_spread(measured.at("full", 0), measured.at(setting, 0)),
            f"{common.mean_pm(measured.at(setting, 0))} vs {common.mean_pm(measured.at('full', 0))}; "
            + common.spread_note(measured.at(setting, 0), measured.at("full", 0)),
        ))  # fmt: skip
    for setting in SETTINGS[1:]:
        result.append(common.Check(
            f"{LABELS[setting]}: at " + " and ".join(str(measured.lengths[j]) for j in longer)
            + " tokens the loss is lower than full attention's (beyond the seed-to-seed spread)",
            all(common.lower_beyond_spread(measured.at(setting, j), measured.at("full", j)) for j in longer),
            "; ".join(f"{measured.lengths[j]}: {common.mean_pm(measured.at(setting, j))} vs "
                      f"{common.mean_pm(measured.at('full', j))}" for j in longer),
        ))  # fmt: skip
    sinks, full = measured.first_token_mean("sinks"), measured.first_token_mean("full")
    result.append(common.Check(
        "with sinks, less of each query's attention lands on the first token than with full attention alone "
        "(mean over layers, beyond the seed-to-seed spread)",
        common.lower_beyond_spread(sinks, full),
        f"{common.mean_pm(sinks)} with sinks vs {common.mean_pm(full)} without; the sinks take "
        f"{common.mean_pm(measured.sink_share.mean(axis=(1, 2)))}",
    ))  # fmt: skip
    return result


def length_table(measured: Measured, runs: dict) -> str:
    lengths = [f"at {n}" + (" (training)" if j == 0 else f" ({n // measured.lengths[0]}x)")
               for j, n in enumerate(measured.lengths)]  # fmt: skip
    rows = []
    for setting in SETTINGS:
        values = [common.mean_pm(measured.at(setting, j)) for j in range(len(measured.lengths))]
        rise = measured.at(setting, -1) - measured.at(setting, 0)
        seconds = np.mean([run.seconds for run in runs[setting].runs])
        rows.append([LABELS[setting], *values, common.mean_pm(rise), f"{seconds:.0f}"])
    return common.markdown_table(
        ["setting", *lengths, f"rise at {measured.lengths[-1]}", "training time per seed (s)"], rows
    )


def mass_table(measured: Measured, layers: int) -> str:
    """Per layer: the weight on the first token of each setting, and the sinks model's share to its sinks."""
    rows = []
    for layer in range(layers):
        first = [common.mean_pm(measured.first_token[setting][:, layer]) for setting in SETTINGS]
        share = measured.sink_share[:, layer]  # (seeds, nh)
        heads = ", ".join(f"{v:.2f}" for v in share.mean(0))
        rows.append([str(layer), *first, f"{common.mean_pm(share.mean(1))} (heads: {heads})"])
    return common.markdown_table(
        ["layer", *(f"first token: {LABELS[s]}" for s in SETTINGS), "sinks model: share to the sink"], rows
    )


def discussion(session: common.Session, settings: Settings, measured: Measured, layers: int) -> str:
    T, w = settings.block_size, settings.sliding_window
    rise = {s: float((measured.at(s, -1) - measured.at(s, 0)).mean()) for s in SETTINGS}
    rises = ", ".join(f"{LABELS[s]} {rise[s]:+.3f}" for s in SETTINGS)
    full_layers = layers // EVERY
    logits = measured.sink_logits
    return f"""**Beyond the training length.** A sliding layer's query never meets a key more
than {w - 1} tokens back, in training or after it, so at {measured.lengths[-1]} tokens its RoPE angles and its softmax's
number of keys are ones it was trained on; only the {full_layers} full layer{"s" if full_layers > 1 else ""} of the
{layers} meet{"" if full_layers > 1 else "s"} offsets past {T - 1}. Full attention with RoPE on every layer meets them in
every layer. The rise of the loss from {T} to {measured.lengths[-1]} tokens: {rises} nats/char (mean of
{len(session.seeds)} seeds).

**RoPE-free layers** see where a token is only through the causal mask (the number of keys it averages over), so
they meet no new angle beyond the training length either; but their softmax spreads over more keys than in
training, and the other layers keep RoPE on every unseen offset.

**Sinks.** A head with a sink can give part of its attention to no token (a row of weights sums to less than 1). The
sinks model's heads give {common.mean_pm(measured.sink_share.mean(axis=(1, 2)))} of their attention to their sinks
(mean over layers, heads and queries), with learned sink logits from {logits.min():.2f} to {logits.max():.2f}; without
sinks the weight on the first token is {common.mean_pm(measured.first_token_mean("full"))} (mean over layers), and
with them {common.mean_pm(measured.first_token_mean("sinks"))}. In a sliding layer the first token is outside the
window of every query past position {w - 1}, so its weight there is near 0 by construction.

**Cost.** The loss is one side; the time each layout takes on a CPU (sliding windows with a kernel that skips the
blocks outside the window, and without one), and the KV cache a long generation keeps, are measured by
`python -m benchmarks.layouts` (the performance page's table)."""


def setup_text(session, settings: Settings, model_fields: dict, training: dict, kernel: dict, sequences: int) -> str:
    T, w = settings.block_size, settings.sliding_window
    L = model_fields["num_hidden_layers"]
    sliding = ", ".join(str(i) for i in range(L) if (i + 1) % EVERY != 0)
    every = [str(i) for i in range(L) if (i + 1) % EVERY == 0]
    seeds = len(session.seeds)
    return f"""Four models of `make demo`'s recipe (`training/configs/shakespeare_char.yaml`: {L} layers, hidden size
{model_fields["hidden_size"]}, {model_fields["num_attention_heads"]} heads, RoPE, pre-RMSNorm, SwiGLU of width
{model_fields["intermediate_size"]}, QK-norm), identical but for one switch each:

- **full attention**: every layer attends to every earlier token and applies RoPE (the recipe as it is);
- **sliding, 3 of 4 layers**: `layer_types` makes layers {sliding} `"sliding_attention"` with `sliding_window={w}`
  (each query sees itself and the {w - 1} tokens before it); every {EVERY}th layer keeps full attention;
- **RoPE-free every 4th**: `no_rope_layer_interval={EVERY}` (SmolLM3's default): layer {", ".join(every)} goes
  without RoPE;
- **attention sinks**: `attention_sinks=True`, one learned logit per head and layer in the softmax's denominator.

Attention kernels: {", ".join(f"{LABELS[s]} `{kernel[s]}`" for s in SETTINGS)}. A model with sinks runs on the eager
attention written in `modeling_decoderlab.py`, the only one that adds the sink to the softmax (SDPA and flex attention
refuse sinks); every kernel computes the same function for the layouts it runs, so the kernel changes the time, not
the loss.

Each model is trained with {seeds} seed{"s" if seeds > 1 else ""} (weights and data order) on character-level Tiny Shakespeare in
blocks of {T} characters (the training length): {settings.steps} steps of batch {settings.batch_size}, the recipe's
optimisation (Muon at {training["muon_learning_rate"]} for the blocks' matrices, AdamW at {training["learning_rate"]} and
{training["embedding_learning_rate"]} for the embeddings, {settings.warmup_steps} warm-up steps, cosine decay to 10 %,
clipping at 1.0, windows shifted each pass). `max_position_embeddings={T * max(settings.length_multiples)}` only
admits the longest evaluation: RoPE has no table to run out of.

*Loss by length*: the first {sequences} × {T * max(settings.length_multiples)} characters of the validation split, cut
into sequences of {", ".join(str(T * m) for m in settings.length_multiples)} characters (the same text at every length),
scored at every position (next-character loss, mean over positions and sequences), for every seed's model.
*Where the attention goes*: every layer's attention weights on {settings.mass_sequences} validation blocks of {T},
read from the model's own attention call (`common.AttentionRecorder`, which runs each layer's own eager kernel, the
sinks' included): the weight on the first token, and for the sinks model the share of attention that went to no
token (1 minus the row's sum), each averaged over the queries 1..{T - 1} and the heads."""


if __name__ == "__main__":
    main()
