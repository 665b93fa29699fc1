"""Claim 4, multiple heads (Vaswani et al. 2017, section 3.2.2): heads attend to information from different
representation subspaces, so several narrow heads do better than one wide head; grouped-query (Ainslie et al.
2023) and multi-query attention (Shazeer 2019) share keys and values between heads to shrink the KV cache.

    python -m experiments.heads --jobs 2 --threads 1   # about 8 minutes on 2 CPU cores
    python -m experiments.heads --quick                # smoke test

At a fixed hidden size (so a fixed parameter count), models with 1, 2, 4 and 8 heads are trained on Tiny
Shakespeare; at 8 query heads, 8 (MHA), 2 (GQA) and 1 (MQA) key/value heads are compared by loss and by the bytes
their KV cache holds. The trained model's attention maps are drawn head by head, and how differently the heads of
a layer attend is measured against the same model before training.
"""

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from . import common

NAME = "heads"
REVISION = (
    "This version trains every model with three seeds: one head against several, and GQA/MQA against MHA, count "
    "only beyond the seed-to-seed spread, and the head-diversity check must hold for every seed's model."
)
GQA_MARGIN = 0.05  # nats/char: sharing keys and values "costs little" when the loss rises less than this


@dataclass(frozen=True)
class Settings:
    head_counts: tuple[int, ...] = (1, 2, 4, 8)
    kv_head_counts: tuple[int, ...] = (8, 2, 1)  # at the largest head count: MHA, GQA, MQA
    hidden_size: int = 128
    num_hidden_layers: int = 3
    block_size: int = 64
    batch_size: int = 16
    steps: int = 500
    learning_rate: float = 1e-3
    eval_blocks: int = 256
    cache_length: int = 1024  # tokens in the KV cache whose bytes are measured
    map_length: int = 40  # characters of the text whose attention maps are drawn
    diversity_blocks: int = 16  # validation blocks over which head diversity is averaged


QUICK = Settings(
    head_counts=(1, 2), kv_head_counts=(2, 1), hidden_size=32, num_hidden_layers=1, block_size=16, batch_size=4,
    steps=4, eval_blocks=8, cache_length=32, map_length=12, diversity_blocks=2,
)  # fmt: skip


@torch.no_grad()
def attention_weights(model, blocks: torch.Tensor) -> torch.Tensor:
    """(L, B, nh, T, T) attention weights of every layer and head, as the model computes them."""
    device = next(model.parameters()).device
    with common.AttentionRecorder(model.config) as recorder:
        model(input_ids=blocks.long().to(device), use_cache=False)
    return torch.stack(recorder.weights).float().cpu()


def head_divergence(weights: torch.Tensor) -> np.ndarray:
    """(L,) mean Jensen-Shannon divergence (nats, at most ln 2) between the attention distributions of every pair
    of heads of a layer, averaged over queries and sequences; 0 when all heads of the layer attend alike."""
    L, B, nh, T, _ = weights.shape
    if nh < 2:
        return np.full(L, np.nan)
    w = weights.double().clamp_min(1e-12)

    def kl(p, q):
        return (p * (p / q).log()).sum(-1)

    pairs = []
    for a, b in itertools.combinations(range(nh), 2):
        p, q = w[:, :, a], w[:, :, b]  # (L, B, T, T)
        m = (p + q) / 2
        pairs.append(((kl(p, m) + kl(q, m)) / 2)[:, :, 1:].mean(dim=(1, 2)))  # query 0 has one key: skip it
    return torch.stack(pairs).mean(0).numpy()


def attention_distance(weights: torch.Tensor) -> np.ndarray:
    """(L, nh) mean distance, in positions, between each query and the keys it attends to."""
    T = weights.shape[-1]
    offsets = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp_min(0).float()  # (T, T): query - key
    return (weights * offsets).sum(-1).mean(dim=(1, 3)).numpy()


@torch.no_grad()
def kv_cache_bytes(model, length: int) -> int:
    """Bytes of the key and value tensors a ``DynamicCache`` holds after a forward pass over ``length`` tokens."""
    device = next(model.parameters()).device
    input_ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    cache = model(input_ids=input_ids.to(device), use_cache=True).cache
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def main(argv: list[str] | None = None) -> None:
    common.run_experiment(NAME, __doc__, Settings(), QUICK, run, argv)


@dataclass
class Measured:
    """What is measured on the trained models besides their loss."""

    cache: dict  # KV heads -> bytes of the KV cache, measured
    expected: dict  # KV heads -> 2 (k and v) x layers x KV heads x head_dim x tokens x 4 bytes
    params: dict  # (query heads, KV heads) -> parameters
    divergence_trained: np.ndarray  # (seeds, L) JS divergence between heads, each seed's trained model
    divergence_initial: np.ndarray  # (seeds, L) the same model at its initial weights
    distance: np.ndarray  # (L, nh) mean attention distance of the first seed's model
    diversity_blocks: int  # validation blocks the divergence is averaged over


def run(session: common.Session, settings: Settings) -> None:
    n_heads = max(settings.head_counts)
    for count in (*settings.head_counts, *settings.kv_head_counts):
        if settings.hidden_size % count or n_heads % min(count, n_heads):
            raise ValueError(
                f"--head_counts {settings.head_counts} and --kv_head_counts {settings.kv_head_counts} must divide "
                f"--hidden_size {settings.hidden_size}, and each KV head count must divide {n_heads} heads."
            )
    corpus = common.load_corpus(session, settings.block_size, settings.eval_blocks)
    training = dict(
        max_train_steps=settings.steps, per_device_train_batch_size=settings.batch_size,
        learning_rate=settings.learning_rate, num_warmup_steps=settings.steps // 10,
        logging_steps=max(1, settings.steps // 25), max_eval_samples=settings.eval_blocks,
    )  # fmt: skip
    specs = {
        (heads, heads): common.Spec(f"{heads} heads", model_fields(settings, heads, heads), training)
        for heads in settings.head_counts
    }
    for kv_heads in settings.kv_head_counts:
        name = f"{n_heads} heads, {kv_heads} KV heads"
        specs.setdefault((n_heads, kv_heads), common.Spec(name, model_fields(settings, n_heads, kv_heads), training))
    runs = common.train_all(session, corpus, specs)  # (query heads, KV heads) -> Trials, one run per seed
    measured = measure(session, settings, corpus, runs)
    session.log("measured caches and head diversity")

    maps_png = maps_figure(session, settings, corpus, runs, measured)
    loss_png = loss_figure(session, settings, runs, measured)
    common.write_report(
        session,
        title="Multiple heads, and MHA vs GQA vs MQA",
        claim=(
            "Multi-head attention lets the model attend to information from different representation subspaces "
            "(Vaswani et al. 2017): heads attend differently, and several narrow heads beat one wide head. Sharing keys "
            "and values across heads (grouped-query, multi-query) shrinks the KV cache at little cost in quality."
        ),
        setup=setup_text(session, settings, corpus, training, measured),
        results=f"""{loss_png}

{runs_table(settings, runs, measured)}

{maps_png}

{diversity_table(settings, measured)}""",
        checks=checks(settings, runs, measured),
        discussion=discussion(session, settings, measured),
        revision=REVISION,
        numbers={
            "runs": {f"{h} heads, {kv} kv": {"final_eval_losses": t.losses.tolist(), "mean": t.mean, "std": t.std,
                     "parameters": measured.params[h, kv], "seconds": t.seconds} for (h, kv), t in runs.items()},
            "kv_cache_bytes": measured.cache, "js_divergence_trained": measured.divergence_trained.mean(0).tolist(),
            "js_divergence_initial": measured.divergence_initial.mean(0).tolist(),
            "attention_distance": measured.distance.tolist(),
        },
    )  # fmt: skip
    session.log(f"wrote {session.output_dir / 'report.md'}")


def model_fields(settings: Settings, heads: int, kv_heads: int) -> dict:
    return dict(hidden_size=settings.hidden_size, num_hidden_layers=settings.num_hidden_layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads)  # fmt: skip


def measure(session: common.Session, settings: Settings, corpus: common.Corpus, runs: dict) -> Measured:
    """KV cache bytes, measured and by the formula; how differently the heads attend, each seed's trained model
    against its own initial weights; the attention distance of the first seed's model (the one whose maps are drawn)."""
    n_heads = max(settings.head_counts)
    head_dim = settings.hidden_size // n_heads
    cache = {kv: kv_cache_bytes(runs[n_heads, kv].model, settings.cache_length) for kv in settings.kv_head_counts}
    expected = {kv: 2 * settings.num_hidden_layers * kv * head_dim * settings.cache_length * 4 for kv in cache}
    params = {key: run.model.num_parameters() for key, run in runs.items()}
    blocks = corpus.eval_blocks[: settings.diversity_blocks]
    trained, initial = [], []  # (seeds, L) each
    for seed, run in zip(session.seeds, runs[n_heads, n_heads].runs):
        fresh = common.fresh_model(corpus, model_fields(settings, n_heads, n_heads), seed).eval()
        trained.append(head_divergence(attention_weights(run.model, blocks)))
        initial.append(head_divergence(attention_weights(fresh, blocks)))
    distance = attention_distance(attention_weights(runs[n_heads, n_heads].model, blocks))  # (L, nh)
    return Measured(cache, expected, params, np.array(trained), np.array(initial), distance, len(blocks))


def maps_figure(session, settings: Settings, corpus: common.Corpus, runs: dict, measured: Measured) -> str:
    """The attention weights of every head of the first seed's trained model on a piece of validation text."""
    n_heads, L = max(settings.head_counts), settings.num_hidden_layers
    text_ids = corpus.eval_blocks[:1, : settings.map_length]
    text = corpus.tokenizer.decode(text_ids[0].tolist())
    maps = attention_weights(runs[n_heads, n_heads].model, text_ids)[:, 0]  # (L, nh, T, T)
    fig, axes = common.figure(ncols=n_heads, nrows=L, width=max(2.0, 6.0 / n_heads), height=2.1)
    for layer, head in itertools.product(range(L), range(n_heads)):
        ax = axes[layer][head]
        ax.imshow(maps[layer, head].numpy(), cmap="Blues", vmin=0, vmax=1)
        ax.set_title(f"layer {layer} head {head}\nmean distance {measured.distance[layer, head]:.1f}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    for layer in range(L):
        axes[layer][0].set_ylabel("query →", fontsize=8)
    for head in range(n_heads):
        axes[L - 1][head].set_xlabel("key →", fontsize=8)
    fig.suptitle(f"attention weights of the trained {n_heads}-head model\non the validation text {text!r}", fontsize=9)
    return common.save_figure(fig, session, "head_maps.png", "attention maps of every head of the trained model")


def loss_figure(session, settings: Settings, runs: dict, measured: Measured) -> str:
    """Loss by head count; MHA/GQA/MQA loss; their KV cache bytes."""
    n_heads, cache = max(settings.head_counts), measured.cache
    fig, axes = common.figure(ncols=3, width=4.4, height=3.6)
    ax = axes[0][0]
    x = range(len(settings.head_counts))  # head counts evenly spaced, labelled below
    common.plot_mean_and_seeds(ax, x, [runs[h, h] for h in settings.head_counts], color="C0")
    ax.set(xlabel="heads (hidden size fixed)", ylabel="final validation loss (nats/char)",
           title=f"heads at hidden size {settings.hidden_size}")  # fmt: skip
    ax.set_xticks(x, [str(h) for h in settings.head_counts])
    ax = axes[0][1]
    kv_labels = [f"{kv} KV" for kv in settings.kv_head_counts]
    kv_trials = [runs[n_heads, kv] for kv in settings.kv_head_counts]
    kv_losses = [t.mean for t in kv_trials]
    ax.bar(kv_labels, kv_losses, yerr=[t.std for t in kv_trials], capsize=4, color="C1")
    ax.bar_label(ax.containers[-1], fmt="%.3f", label_type="center")
    for i, t in enumerate(kv_trials):  # each seed's loss
        ax.scatter(np.full(len(t.runs), i), t.losses, s=10, color="black", alpha=0.4, zorder=3)
    ax.set(ylim=(min(kv_losses) - 0.1, max(kv_losses) + 0.05), ylabel="final validation loss (nats/char)",
           title=f"{n_heads} query heads: MHA / GQA / MQA (± std over seeds)")  # fmt: skip
    ax = axes[0][2]
    ax.bar(kv_labels, [cache[kv] / 2**10 for kv in settings.kv_head_counts], color="C2")
    ax.bar_label(ax.containers[0], fmt="%.0f KiB")
    ax.set(ylabel="KV cache (KiB, measured)", title=f"KV cache for {settings.cache_length} tokens, batch 1")
    ax.set_ylim(top=1.15 * max(cache.values()) / 2**10)
    return common.save_figure(fig, session, "loss_and_cache.png", "loss by heads, and MHA/GQA/MQA loss and cache")


def checks(settings: Settings, runs: dict, measured: Measured) -> list[common.Check]:
    """The claim's parts, decided from the numbers."""
    n_heads, cache = max(settings.head_counts), measured.cache
    one = runs.get((1, 1))
    multi = {h: runs[h, h] for h in settings.head_counts if h > 1}
    best = min(multi, key=lambda h: multi[h].mean) if multi else None
    mha = runs[n_heads, n_heads]
    cost = {kv: runs[n_heads, kv].mean - mha.mean for kv in settings.kv_head_counts}
    divergence_trained, divergence_initial = measured.divergence_trained.mean(0), measured.divergence_initial.mean(0)
    return [
        common.Check(
            "several heads reach a lower loss than one head of the same total width (the best head count, by more "
            "than the seed-to-seed spread)",
            bool(best is not None and one is not None and common.lower_beyond_spread(multi[best], one)),
            f"1 head {one}; "
            + ", ".join(f"{h} heads {t}" for h, t in multi.items())
            + (f"; {best} heads vs 1: {common.spread_note(multi[best], one)}" if best and one else ""),
        ),
        common.Check(
            f"after training, the heads of each layer attend differently (mean pairwise Jensen-Shannon divergence "
            f"at least 5x that of the same model at initialisation, {n_heads} heads, every seed)",
            bool(np.all(measured.divergence_trained >= 5 * measured.divergence_initial)),
            "per layer, trained vs initial (mean over seeds): "
            + ", ".join(f"{t:.3g} vs {i:.2g}" for t, i in zip(divergence_trained, divergence_initial)),
        ),
        common.Check(
            "the KV cache shrinks in proportion to the KV heads (measured bytes equal 2 x layers x KV heads x "
            "head_dim x tokens x 4)",
            all(cache[kv] == measured.expected[kv] for kv in cache),
            ", ".join(f"{kv} KV heads: {cache[kv] / 2**10:.0f} KiB" for kv in cache),
        ),
        common.Check(
            f"grouped-query and multi-query attention cost little quality (validation loss within {GQA_MARGIN} nats "
            "of MHA, or no worse beyond the seed-to-seed spread)",
            all(
                cost[kv] < GQA_MARGIN or not common.lower_beyond_spread(mha, runs[n_heads, kv])
                for kv in settings.kv_head_counts
            ),
            ", ".join(
                f"{kv} KV heads {cost[kv]:+.4f} ({common.spread_note(mha, runs[n_heads, kv])})"
                for kv in settings.kv_head_counts
            ),
        ),
    ]


def runs_table(settings: Settings, runs: dict, measured: Measured) -> str:
    n_heads, cache = max(settings.head_counts), measured.cache
    return common.markdown_table(
        ["query heads", "KV heads", "head_dim", "parameters", "final validation loss", "KV cache (KiB)",
         "train time (s)"],
        [
            [h, kv, settings.hidden_size // h, f"{measured.params[h, kv]:,}", str(trials),
             f"{cache[kv] / 2**10:.0f}" if h == n_heads and kv in cache else "", round(trials.seconds)]
            for (h, kv), trials in runs.items()
        ],
    )  # fmt: skip


def diversity_table(settings: Settings, measured: Measured) -> str:
    divergence_trained, divergence_initial = measured.divergence_trained.mean(0), measured.divergence_initial.mean(0)
    return common.markdown_table(
        ["layer", "JS divergence between heads, trained", "at initialisation", "mean attention distance per head"],
        [
            [layer, divergence_trained[layer], divergence_initial[layer],
             " / ".join(f"{d:.1f}" for d in measured.distance[layer])]
            for layer in range(settings.num_hidden_layers)
        ],
    )  # fmt: skip


def discussion(session: common.Session, settings: Settings, measured: Measured) -> str:
    n_heads = max(settings.head_counts)
    head_dim = settings.hidden_size // n_heads
    divergence_trained, divergence_initial = measured.divergence_trained.mean(0), measured.divergence_initial.mean(0)
    distance = measured.distance
    uniform = (settings.block_size - 1) / 4  # mean distance of uniform causal attention over a block
    return f"""**What "different subspaces" means here.** Each head has its own slice of W_Q, W_K and W_V, so it
compares queries and keys in its own {head_dim}-dimensional projection; nothing forces the heads to use their
subspaces differently, so whether they do is an empirical question. The mean Jensen-Shannon divergence between the
heads of a layer is {", ".join(f"{d:.3g}" for d in divergence_initial)} (layer by layer) at initialisation and
{", ".join(f"{d:.3g}" for d in divergence_trained)} after training (ln 2 = 0.693 is the most two distributions can
differ). After training the mean attention distance per head ranges from {distance.min():.1f} to
{distance.max():.1f} positions, against {uniform:.1f} for a head that attends uniformly over the causal context.

**Heads versus loss.** At a fixed hidden size every head count has the same parameters; more heads trade width per
head for more attention patterns per layer. **MHA, GQA and MQA.** Sharing keys and values cuts the cache in
proportion to the KV heads ({n_heads // min(settings.kv_head_counts)}x fewer bytes with {min(settings.kv_head_counts)}
KV head(s) than with {n_heads}) and removes parameters from `k_proj` and `v_proj`. Every setting ran with
{len(session.seeds)} seeds; a loss difference counts only when the gap between the means exceeds the sum of the two
seed-to-seed standard deviations."""


def setup_text(session, settings: Settings, corpus: common.Corpus, training: dict, measured: Measured) -> str:
    n_heads = max(settings.head_counts)
    return f"""Models with hidden size {settings.hidden_size}, {settings.num_hidden_layers} layers, RoPE, pre-RMSNorm,
SwiGLU; {", ".join(map(str, settings.head_counts))} heads (head_dim = {settings.hidden_size} / heads, so every model
has the same attention parameters), and at {n_heads} query heads {", ".join(map(str, settings.kv_head_counts))} key/value
heads. Each is trained on character-level Tiny Shakespeare in blocks of {settings.block_size} for {settings.steps}
steps of batch {settings.batch_size}, AdamW at peak learning rate {settings.learning_rate} with
{training["num_warmup_steps"]} warm-up steps and cosine decay, clipping at 1.0, each with {len(session.seeds)} seeds (weights
and data order; losses are mean ± standard deviation over them); validation loss on
{len(corpus.eval_blocks)} validation blocks. *KV cache*: the bytes of the key and value tensors held by the
`DynamicCache` after one forward pass over {settings.cache_length} tokens (float32, batch 1). *Head diversity*: the
mean Jensen-Shannon divergence between the attention distributions of every pair of heads of a layer, over
{measured.diversity_blocks} validation blocks, for each seed's trained {n_heads}-head model and for the same model at
initialisation; attention weights are read from the model's own attention call; maps and distances show the first
seed's model."""


if __name__ == "__main__":
    main()
