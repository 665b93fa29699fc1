"""The five views, each an HTML string: the claim in one sentence, then the numbers beside the pictures.

``Explorer`` holds one loaded model and answers each view for a prompt. The prompt's forward with attention weights
(``measure.analyse``) runs once and is kept for the next views and controls; the fresh models of the norm view are
built once. A problem with a request (an empty prompt, a character outside the vocabulary, a number out of range)
becomes a message in the view, never an exception out of it, so the page goes on serving.
"""

import hashlib
import html as html_module
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import drawing as d
from . import measure
from .loading import ExploreError, Loaded

# The longest prompt the views draw (the maps have one cell per pair of tokens)
MAX_TOKENS = 256
MAX_NEW_TOKENS = 200
CACHED_PROMPTS = 8
DEFAULT_PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"

POSITION_NAMES = {"rope": "RoPE", "sinusoidal": "sinusoidal", "learned": "learned", "none": "no positions (NoPE)"}
LAYOUT_NAMES = {"pre": "pre-LN", "post": "post-LN", "sandwich": "sandwich-LN", "parallel": "parallel (pre-LN)"}


@dataclass
class Encoded:
    ids: torch.Tensor  # (T,)
    tokens: list[str]  # each token's text, whitespace visible
    notes: list[str]  # things the reader should know (characters mapped to the unknown token)


def prompt_id(prompt: str) -> str:
    """A short fingerprint of a prompt (the first 12 hex digits of its SHA-1)."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:12]


def attention_kind(config) -> str:
    if config.num_key_value_heads == config.num_attention_heads:
        return "MHA"
    return "MQA" if config.num_key_value_heads == 1 else "GQA"


def numbers_of(values) -> list[float]:
    return [float(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]


class Explorer:
    """One model and tokenizer, answering every view for a prompt; thread-safe (one computation at a time)."""

    def __init__(self, loaded: Loaded, seed: int = 0):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = self.model.config
        self.seed = seed
        self.max_tokens = min(MAX_TOKENS, self.config.max_position_embeddings)
        self.lock = threading.RLock()
        self.analyses: OrderedDict[str, tuple[Encoded, measure.Analysis]] = OrderedDict()
        self.norm_profiles: OrderedDict[str, dict] = OrderedDict()
        self.losses: OrderedDict[str, list[float]] = OrderedDict()
        self.fresh: dict[str, torch.nn.Module] | None = None
        generation = getattr(self.model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.sampling_defaults = {
            "temperature": float(getattr(generation, "temperature", None) or 1.0),
            "top_k": int(getattr(generation, "top_k", None) or 0),
            "top_p": float(getattr(generation, "top_p", None) or 1.0),
        }

    # ------------------------------------------------------------------------------------------
    # Prompts

    def token_text(self, token_id: int) -> str:
        return d.show_token(self.tokenizer.decode([token_id]))

    def encode(self, prompt: str) -> Encoded:
        """The prompt's ids, or an ExploreError naming what is wrong with it and what to do instead."""
        if not prompt:
            raise ExploreError("The prompt is empty: type some text for the model to read.")
        try:
            encoding = self.tokenizer(prompt, return_offsets_mapping=getattr(self.tokenizer, "is_fast", False))
        except Exception as err:  # tokenizers raises a bare Exception for a character it has no id for
            raise ExploreError(self.refused_characters(prompt, err)) from err
        ids = encoding["input_ids"]
        notes = []
        unk = self.tokenizer.unk_token_id
        if unk is not None and unk in ids:
            spans = encoding.get("offset_mapping") or []
            unknown = sorted({prompt[a:b] for i, (a, b) in zip(ids, spans) if i == unk and b > a})
            what = ", ".join(self.describe_characters(unknown)) if unknown else "part of the prompt"
            notes.append(
                f"Not in this model's vocabulary: {what}. The tokenizer maps it to its unknown token "
                f"{self.tokenizer.unk_token!r}, which is what the model reads (and what the views show) there."
            )
        if not ids:
            raise ExploreError("The prompt gives no tokens at all: type some text for the model to read.")
        if len(ids) > self.max_tokens:
            limit = (
                f"this model has positions for {self.config.max_position_embeddings} tokens (max_position_embeddings)"
                if self.max_tokens == self.config.max_position_embeddings
                else f"the explorer draws maps for at most {MAX_TOKENS} tokens"
            )
            raise ExploreError(
                f"The prompt is {len(ids)} tokens long, but {limit}. Shorten it to at most {self.max_tokens} tokens."
            )
        ids = torch.tensor(ids)
        return Encoded(ids, [self.token_text(i) for i in ids.tolist()], notes)

    @staticmethod
    def describe_characters(characters) -> list[str]:
        return [repr(c) + (f" (U+{ord(c):04X})" if len(c) == 1 else "") for c in characters]

    def refused_characters(self, prompt: str, err: Exception) -> str:
        refused = []
        for character in dict.fromkeys(prompt):
            try:
                self.tokenizer(character)
            except Exception:  # the same bare Exception, for this character alone
                refused.append(character)
        if not refused:
            return f"The tokenizer refused the prompt ({err}). Try other text."
        return (
            f"The prompt has characters outside this model's vocabulary: {', '.join(self.describe_characters(refused))}"
            ". Its tokenizer has no unknown token, so it cannot read them: remove or replace them with characters "
            "from the text the model was trained on."
        )

    def analysis(self, prompt: str) -> tuple[Encoded, measure.Analysis]:
        """The prompt's one forward with attention weights (and backward), computed once and kept."""
        with self.lock:
            if prompt in self.analyses:
                self.analyses.move_to_end(prompt)
                return self.analyses[prompt]
            encoded = self.encode(prompt)
            result = (encoded, measure.analyse(self.model, encoded.ids))
            self.analyses[prompt] = result
            while len(self.analyses) > CACHED_PROMPTS:
                self.analyses.popitem(last=False)
            return result

    def forget(self) -> None:
        """Drop every prompt's kept results (the fresh models stay): the next view of any prompt computes afresh."""
        with self.lock:
            self.analyses.clear()
            self.norm_profiles.clear()
            self.losses.clear()

    def guarded(self, view, prompt: str, *args) -> str:
        """``view(prompt, *args)``, or the problem with the request as a message; wrapped in an element stamped with
        the prompt's ``prompt_id``, so a page (or a test) can tell which prompt a view answers."""
        try:
            with self.lock:
                content = view(prompt, *args)
        except ExploreError as err:
            content = d.message(str(err))
        return f'<div data-prompt-id="{prompt_id(prompt)}">{content}</div>'

    # ------------------------------------------------------------------------------------------
    # The model, in one paragraph

    def summary(self) -> str:
        c = self.config
        params = sum(p.numel() for p in self.model.parameters())
        origin = f", converted from {self.loaded.converted_from} on load" if self.loaded.converted_from else ""
        code = " (the checkpoint's own code)" if self.loaded.remote_code else ""
        layout = LAYOUT_NAMES[measure.layout_of(c)]
        return d.div(
            f"<p><b>{d.esc(self.loaded.source)}</b>{d.esc(origin)}{d.esc(code)}: {c.num_hidden_layers} layers × "
            f"{c.hidden_size} wide, {c.num_attention_heads} query heads and {c.num_key_value_heads} key/value heads "
            f"({attention_kind(c)}), {POSITION_NAMES[c.position_embedding_type]} positions, {layout} {c.norm_type}, "
            f"{params / 1e6:.2f}M parameters, {c.max_position_embeddings} positions, vocabulary {c.vocab_size}"
            f"{d.esc(self.layouts_text())}; attention backend <code>{d.esc(c._attn_implementation)}</code>.</p>"
        )

    def layouts(self) -> list[measure.LayerLayout]:
        return [measure.layer_layout(self.model, i) for i in range(self.config.num_hidden_layers)]

    def layouts_text(self) -> str:
        """The per-layer layouts the model has, for the summary line ("" for a plain model): which layers slide and
        with what window, which skip RoPE, and whether the heads have sinks."""
        layouts, parts = self.layouts(), []
        windows = sorted({x.sliding_window for x in layouts if x.sliding_window is not None})
        for window in windows:
            layers = [i for i, x in enumerate(layouts) if x.sliding_window == window]
            parts.append(f"a sliding window of {window} tokens on layer{'s' if len(layers) > 1 else ''} "
                         f"{', '.join(map(str, layers))}")  # fmt: skip
        if self.config.position_embedding_type == "rope":
            free = [i for i, x in enumerate(layouts) if not x.rope]
            if free:
                parts.append(f"no RoPE on layer{'s' if len(free) > 1 else ''} {', '.join(map(str, free))}")
        if any(x.sink_logits is not None for x in layouts):
            parts.append("a learned attention sink per head")
        return f", {', '.join(parts)}" if parts else ""

    def layer_text(self, layer: int, layout: measure.LayerLayout) -> str:
        """What layer ``layer``'s attention does besides the plain causal softmax, in a sentence or three ("" if
        nothing)."""
        parts = []
        if layout.sliding_window is not None:
            w = layout.sliding_window
            parts.append(f"Layer {layer} is a sliding layer: each query sees itself and the {w - 1} tokens before it "
                         f"(sliding_window = {w}); the hatched cells lie outside its window and get no weight.")  # fmt: skip
        if self.config.position_embedding_type == "rope" and not layout.rope:
            parts.append(f"Layer {layer} applies no RoPE (no_rope_layers): its scores do not depend on where a token "
                         "sits, only on the causal mask.")  # fmt: skip
        if layout.sink_logits is not None:
            parts.append(f"Each head of layer {layer} has a learned sink: a logit s_h in the softmax's denominator "
                         "that takes a share of the attention and passes on no value, so a row of weights sums to "
                         "less than 1.")  # fmt: skip
        return " ".join(parts)

    def prompt_status(self, prompt: str) -> str:
        return self.guarded(self._prompt_status, prompt)

    def _prompt_status(self, prompt: str) -> str:
        encoded = self.encode(prompt)
        tokens = "".join(f'<span class="tok">{d.esc(t)}</span> ' for t in encoded.tokens)
        notes = "".join(d.note(n) for n in encoded.notes)
        return d.div(f"<p>{len(encoded.tokens)} tokens: {tokens}</p>{notes}")

    # ------------------------------------------------------------------------------------------
    # 1. Attention

    def check_layer(self, layer) -> int:
        layer = int(layer)
        if not 0 <= layer < self.config.num_hidden_layers:
            raise ExploreError(
                f"Layer {layer} does not exist: this model has layers 0 to {self.config.num_hidden_layers - 1}."
            )
        return layer

    def check_head(self, head) -> int:
        head = int(head)
        if not 0 <= head < self.config.num_attention_heads:
            raise ExploreError(
                f"Head {head} does not exist: this model has heads 0 to {self.config.num_attention_heads - 1}."
            )
        return head

    def no_weights(self) -> str:
        return (
            f"The attention backend {self.config._attn_implementation!r} computes attention without returning its "
            "weights, so there are no maps to show (the other views work). Start the explorer with "
            "--attn_implementation eager, whose kernel returns them."
        )

    def weights_or_message(self, analysis: measure.Analysis) -> torch.Tensor:
        if analysis.attentions is None:
            raise ExploreError(self.no_weights())
        return analysis.attentions

    def attention(self, prompt: str, layer=0, head=0) -> str:
        return self.guarded(self._attention, prompt, layer, head)

    def _attention(self, prompt: str, layer, head) -> str:
        layer, head = self.check_layer(layer), self.check_head(head)
        encoded, analysis = self.analysis(prompt)
        weights = self.weights_or_message(analysis)[layer]  # (nh, T, T)
        tokens = encoded.tokens
        T = len(tokens)

        def describe(r, c, v):
            return f"query {r} {tokens[r]!r} → key {c} {tokens[c]!r}: {v:.4f}"

        layout = measure.layer_layout(self.model, layer)
        window = f' data-window="{layout.sliding_window}"' if layout.sliding_window is not None else ""
        detail = d.heatmap_svg(
            weights[head], tokens, tokens, vmin=0.0, vmax=1.0, gamma=0.5, causal=True, cls="attention-map",
            window=layout.sliding_window, attributes=f'data-layer="{layer}" data-head="{head}"{window}',
            describe=describe,
        )  # fmt: skip
        summary = measure.head_summary(weights)
        header = ["head", "entropy (nats)", "largest weight", "look-back (tokens)", "on previous token", "on first token"]  # fmt: skip
        rows = [
            [f"{h}", *(float(summary[k][h]) for k in ("entropy", "max_weight", "look_back", "previous", "first"))]
            for h in range(weights.shape[0])
        ]
        if layout.sink_logits is not None:  # what each head gives its sink on this prompt, and the logit it learned
            header += ["to its sink", "sink logit s<sub>h</sub>"]
            shares = measure.sink_shares(weights)
            rows = [row + [float(shares[h]), float(layout.sink_logits[h])] for h, row in enumerate(rows)]
        summary_table = d.table(header, rows, cls="head-summary", chosen=head)
        about = self.layer_text(layer, layout)
        thumbs = "".join(
            f'<figure class="{"chosen" if h == head else ""}"><img alt="layer {layer} head {h}" '
            f'src="{d.png_heatmap(weights[h], 0.0, 1.0, pixels=110, gamma=0.5)}"><figcaption>head {h}</figcaption></figure>'
            for h in range(weights.shape[0])
        )
        uniform = math.log(T) if T > 1 else 0.0
        parts = [
            d.claim(
                "Each head spreads every token's attention over the tokens before it in a pattern of its own, and the "
                "1/√d<sub>k</sub> scale keeps those softmaxes out of the saturated region where their gradient "
                "vanishes (Vaswani et al. 2017, section 3.2.1)."
            ),
            f"<h3>Layer {layer}, head {head}: attention weights (rows: queries, columns: keys)</h3>",
            f'<p class="layer-layout">{d.esc(about)}</p>' if about else "",
            f'<div class="row"><div>{detail}<br>{d.colour_bar(0.0, 1.0, gamma=0.5, label="weight")}</div><div class="side">',
            f"<h4>The heads of layer {layer}</h4>{summary_table}",
            f"<p>Averaged over the queries 1..{T - 1} (the first token can only attend to itself). A uniform row "
            f"over all {T} tokens would have entropy ln {T} = {d.fmt(uniform)}; a one-hot row 0.</p>",
            "</div></div>",
            f'<h4>All heads of layer {layer}</h4><div class="thumbs">{thumbs}</div>',
            self.scale_section(prompt, analysis, weights, layer, head),
        ]
        return d.div(*parts, cls="dlx view-attention")

    def scale_section(self, prompt: str, analysis: measure.Analysis, weights, layer: int, head: int) -> str:
        multipliers = measure.SCALE_MULTIPLIERS
        sweep = measure.scale_sweep(weights, multipliers, measure.layer_layout(self.model, layer).sink_logits)
        scale = self.model.model.layers[layer].self_attn.scaling
        rows = []
        for i, m in enumerate(multipliers):
            rows.append([
                f"× {m:g} (scale {d.fmt(scale * m)})",
                float(sweep["entropy"][i, head]), float(sweep["max_weight"][i, head]),
                float(sweep["jacobian_norm"][i, head]),
                float(sweep["entropy"][i].mean()), float(sweep["max_weight"][i].mean()),
                float(sweep["jacobian_norm"][i].mean()),
            ])  # fmt: skip
        sweep_table = d.table(
            ["scale", f"head {head}: entropy", f"head {head}: largest weight", f"head {head}: ‖∂softmax/∂scores‖",
             "mean over heads: entropy", "largest weight", "‖∂softmax/∂scores‖"],
            rows, cls="scale-sweep", chosen=multipliers.index(1.0),
        )  # fmt: skip
        charts = "".join(
            d.line_chart(
                multipliers,
                {f"head {h}": numbers_of(sweep[key][:, h]) for h in range(weights.shape[0])},
                x_label="scale multiplier",
                y_label=label,
                log_x=True,
                x_ticks=multipliers,
                width=330,
                height=230,
                highlight=f"head {head}",
            )  # fmt: skip
            for key, label in (
                ("entropy", "entropy (nats)"),
                ("max_weight", "largest weight"),
                ("jacobian_norm", "‖∂softmax/∂scores‖"),
            )  # fmt: skip
        )
        return (
            f"<h3>The scale: layer {layer}'s scores Q·K<sup>T</sup>·scale multiplied by ¼ … 4</h3>"
            "<p>Larger scores push each softmax towards one-hot: its entropy falls, its largest weight nears 1 and "
            "the size of its Jacobian with respect to the scores, ‖diag(w) − w w<sup>T</sup>‖, the gradient that "
            "reaches Q and K, shrinks towards 0. Rows of the table: each multiplier of the model's scale "
            f"{d.fmt(scale)} (× 1 is the model as trained), applied to this layer's scores as the model computed "
            "them.</p>"
            f'{sweep_table}<div class="row">{charts}</div>'
        )

    def scale_losses(self, prompt: str) -> str:
        return self.guarded(self._scale_losses, prompt)

    def _scale_losses(self, prompt: str) -> str:
        """The prompt's loss with every layer's scale multiplied: the model re-run once per multiplier (kept)."""
        encoded, analysis = self.analysis(prompt)
        multipliers = measure.SCALE_MULTIPLIERS
        if prompt not in self.losses:
            others = [m for m in multipliers if m != 1.0]
            losses = dict(zip(others, measure.scaled_losses(self.model, encoded.ids, others)))
            self.losses[prompt] = [analysis.loss if m == 1.0 else losses[m] for m in multipliers]
            while len(self.losses) > CACHED_PROMPTS:
                self.losses.popitem(last=False)
        losses = self.losses[prompt]
        rows = [[f"× {m:g}", loss] for m, loss in zip(multipliers, losses)]
        chart = d.line_chart(
            multipliers, {"prompt loss": losses}, x_label="scale multiplier, every layer", y_label="loss (nats/token)",
            log_x=True, x_ticks=multipliers, width=360, height=230, cls="scale-loss-chart",
        )  # fmt: skip
        return d.div(
            "<h4>The whole model re-run with every layer's scale multiplied</h4>",
            "<p>The prompt's next-token loss (nats per token): how far from the trained scale the model still "
            "works.</p>",
            f'<div class="row"><div>{d.table(["scale", "loss"], rows, cls="scale-losses", chosen=2)}</div>'
            f"<div>{chart}</div></div>",
            cls="dlx view-scale-losses",
        )

    # ------------------------------------------------------------------------------------------
    # 2. Heads

    def heads(self, prompt: str, layer=0) -> str:
        return self.guarded(self._heads, prompt, layer)

    def _heads(self, prompt: str, layer) -> str:
        layer = self.check_layer(layer)
        c = self.config
        groups = measure.kv_groups(c.num_attention_heads, c.num_key_value_heads)
        kv_bytes, mha_bytes = measure.kv_cache_bytes_per_token(c)
        kind = attention_kind(c)
        facts = d.table(
            ["", "value"],
            [["attention", kind], ["query heads", c.num_attention_heads], ["key/value heads", c.num_key_value_heads],
             ["query heads per key/value head", len(groups[0])],
             ["KV cache per token (float32)", f"{kv_bytes / 1024:.2f} KiB"],
             ["the same width as MHA", f"{mha_bytes / 1024:.2f} KiB"]],
            cls="head-facts",
        )  # fmt: skip
        sharing = d.table(
            ["key/value head", "query heads reading it"],
            [[f"{g}", ", ".join(map(str, heads))] for g, heads in enumerate(groups)],
            cls="kv-groups",
        )
        claim = d.claim(
            "Grouped-query and multi-query attention let several query heads read one key/value head, which "
            "shrinks the KV cache by the group size, while each head keeps its own queries and so its own map "
            "(Ainslie et al. 2023; Shazeer 2019)."
        )
        parts = [claim, f'<div class="row"><div>{facts}</div><div>{self.sharing_svg(groups)}</div>'
                        f"<div>{sharing}</div></div>"]  # fmt: skip
        encoded, analysis = self.analysis(prompt)
        if analysis.attentions is None:
            parts.append(f'<p class="message" role="alert">{d.esc(self.no_weights())}</p>')
            return d.div(*parts, cls="dlx view-heads")
        similarity = measure.head_similarity(analysis.attentions[layer])
        labels = [f"h{h}" for h in range(c.num_attention_heads)]
        matrix = d.heatmap_svg(
            similarity, labels, labels, vmin=0.0, vmax=1.0, cls="head-similarity", attributes=f'data-layer="{layer}"',
            describe=lambda r, col, v: f"head {r} and head {col}: cosine similarity {v:.4f}",
            max_pixels=300,
        )  # fmt: skip
        per_layer = []
        for i in range(c.num_hidden_layers):
            same, other = measure.group_similarity(measure.head_similarity(analysis.attentions[i]), groups)
            per_layer.append([f"{i}", same, other])
        layer_table = d.table(
            ["layer", "same key/value head", "different key/value heads"], per_layer, cls="group-similarity",
            chosen=layer,
        )  # fmt: skip
        parts += [
            f"<h3>Layer {layer}: how alike the heads' maps are</h3>",
            "<p>Cosine similarity between two heads' attention maps on this prompt (1: the same map). The table "
            "averages it over pairs of heads that share a key/value head and pairs that do not (a dash: no such "
            "pair, as in MHA or MQA).</p>",
            f'<div class="row"><div>{matrix}<br>{d.colour_bar(0.0, 1.0, label="cosine similarity")}</div>'
            f"<div>{layer_table}</div></div>",
        ]
        return d.div(*parts, cls="dlx view-heads")

    @staticmethod
    def sharing_svg(groups: list[list[int]]) -> str:
        """Query heads on top, key/value heads below, a line from each query head to the head it reads."""
        n = sum(len(g) for g in groups)
        step = max(18, min(44, 520 // max(n, 1)))
        width = n * step + 20
        parts = []
        for g, heads in enumerate(groups):
            kv_x = 10 + (heads[0] + heads[-1]) / 2 * step + step / 2
            for h in heads:
                qx = 10 + h * step + step / 2
                parts.append(f'<line x1="{qx}" y1="34" x2="{kv_x}" y2="86" stroke="#8aa4c8" stroke-width="1.4"/>')
                parts.append(f'<rect x="{qx - step * 0.4}" y="14" width="{step * 0.8}" height="20" rx="3" '
                             f'fill="#dbe7f5" stroke="#1f5fa8"/>'
                             f'<text x="{qx}" y="28" font-size="10" text-anchor="middle">q{h}</text>')  # fmt: skip
            parts.append(f'<rect x="{kv_x - 16}" y="86" width="32" height="20" rx="3" fill="#fbe3d6" stroke="#c0392b"/>'
                         f'<text x="{kv_x}" y="100" font-size="10" text-anchor="middle">kv{g}</text>')  # fmt: skip
        return (
            f'<svg class="kv-sharing" xmlns="http://www.w3.org/2000/svg" width="{width}" height="112">'
            f'<text x="4" y="10" font-size="10">query heads</text>{"".join(parts)}</svg>'
        )

    # ------------------------------------------------------------------------------------------
    # 3. Positions

    def positions(self, prompt: str, layer=0, head=0, query=-1, key=0) -> str:
        return self.guarded(self._positions, prompt, layer, head, query, key)

    def _positions(self, prompt: str, layer, head, query, key) -> str:
        kind = self.config.position_embedding_type
        encoded, analysis = self.analysis(prompt)
        if kind == "rope":
            layer = self.check_layer(layer)
            if not measure.layer_layout(self.model, layer).rope:
                return self.rope_free_view(layer)
            return self.rope_view(encoded, analysis, layer, self.check_head(head), query, key)
        if kind in ("sinusoidal", "learned"):
            return self.absolute_view(kind)
        return self.permutation_view(encoded)

    def token_index(self, value, encoded: Encoded, what: str) -> int:
        T = len(encoded.tokens)
        index = int(value)
        if not -T <= index < T:
            raise ExploreError(
                f"The {what} token {index} is outside the prompt, which has tokens 0 to {T - 1} (or -1 for the last)."
            )
        return index % T

    def rope_view(self, encoded: Encoded, analysis: measure.Analysis, layer: int, head: int, query, key) -> str:
        qi, ki = self.token_index(query, encoded, "query"), self.token_index(key, encoded, "key")
        x_q, x_k = analysis.attention_inputs[layer, qi], analysis.attention_inputs[layer, ki]
        offsets = measure.rope_offsets(self.model, layer, head, x_q, x_k)
        score_map = measure.rope_score_map(self.model, layer, head, x_q, x_k)
        chart = d.line_chart(
            numbers_of(offsets.offsets), {"score": numbers_of(offsets.scores)}, x_label="offset m − n (positions)",
            y_label="score q·k·scale", width=520, height=260, markers=False, cls="rope-curve",
        )  # fmt: skip
        picks = [o for o in (0, 1, 2, 3, 4, 8, 16, 32, 64, 128, 255) if o < len(offsets.offsets)]
        offset_rows = [[f"{o}", float(offsets.scores[o])] for o in picks]
        n = score_map.shape[0]
        low, high = float(score_map.min()), float(score_map.max())
        map_svg = d.heatmap_svg(
            score_map, [str(i) for i in range(n)], [str(i) for i in range(n)], vmin=low, vmax=high,
            cls="rope-map", describe=lambda r, c, v: f"query at {r}, key at {c} (offset {r - c}): {v:.4f}",
            max_pixels=330,
        )  # fmt: skip
        deviation = (
            f"<p>Largest change of the score when both positions shift together by {', '.join(map(str, offsets.shifts))}"
            f" over offsets 0..{len(offsets.offsets) - 1}: "
            f'<b class="rope-deviation" data-value="{d.exact(offsets.deviation)}">{d.fmt(offsets.deviation, 3)}</b> '
            f"in float64 (rounding error, against scores up to {d.fmt(offsets.score_scale)}); "
            f'<span class="rope-deviation-model" data-value="{d.exact(offsets.deviation_model_dtype)}">'
            f"{d.fmt(offsets.deviation_model_dtype, 3)}</span> in the model's {str(self.model.dtype).removeprefix('torch.')} arithmetic, where the "
            "angle p·θ is rounded to the float's precision at position p.</p>"
        )
        return d.div(
            d.claim(
                "RoPE rotates each query and key by angles proportional to its position, so the score of a query "
                "and a key depends only on how far apart they are, not on where they sit (Su et al. 2021)."
            ),
            f"<p>Layer {layer}, head {head}: the query of token {qi} <span class='tok'>{d.esc(encoded.tokens[qi])}"
            f"</span> and the key of token {ki} <span class='tok'>{d.esc(encoded.tokens[ki])}</span>, as the layer "
            "projects them, placed at positions m (query) and n (key) by the model's own rotary module."
            f"{d.esc(self.window_offsets(layer))}</p>",
            deviation,
            f'<div class="row"><div><h4>Score against the offset (key at 0)</h4>{chart}</div>'
            f"<div><h4>Score at each pair of positions (constant along diagonals)</h4>{map_svg}<br>"
            f"{d.colour_bar(low, high, label='score')}</div>"
            f"<div><h4>Some offsets</h4>{d.table(['offset', 'score'], offset_rows, cls='rope-offsets')}</div></div>",
            cls="dlx view-positions",
        )

    def window_offsets(self, layer: int) -> str:
        """For a sliding layer, which of the offsets drawn it ever scores ("" for a full layer)."""
        window = measure.layer_layout(self.model, layer).sliding_window
        if window is None:
            return ""
        return (f" Layer {layer} is a sliding layer: it only ever scores offsets 0 to {window - 1} (sliding_window = "
                f"{window}); the larger ones show the rotation alone.")  # fmt: skip

    def rope_free_view(self, layer: int) -> str:
        """A layer that ``no_rope_layers`` leaves without RoPE: what that means, and the layers that rotate."""
        rotating = [i for i, x in enumerate(self.layouts()) if x.rope]
        if rotating:
            which = (
                f"Layers {', '.join(map(str, rotating))} apply" if len(rotating) > 1 else f"Layer {rotating[0]} applies"
            )
            others = f"{which} RoPE: choose one to see the score against the offset."
        else:
            others = "No layer of this model applies RoPE."
        return d.div(
            d.claim(
                "A layer without RoPE scores a query and a key by their content alone, q·k/√d<sub>k</sub>, the same "
                "wherever the two sit; it knows the order of the tokens only through the causal mask (NoPE; SmolLM3 "
                "leaves every fourth layer so)."
            ),
            f'<p class="rope-free" data-layer="{layer}">Layer {layer} applies no RoPE (<code>no_rope_layers[{layer}] '
            f"= 0</code>): its queries and keys are not rotated, so its scores do not change when the tokens move. "
            f"{d.esc(others)}</p>",
            cls="dlx view-positions",
        )

    def absolute_view(self, kind: str) -> str:
        result = measure.position_similarity(self.model)
        n = result.similarity.shape[0]
        labels = [str(i) for i in range(n)]
        matrix = d.heatmap_svg(
            result.similarity, labels, labels, vmin=-1.0, vmax=1.0, diverging=True, cls="position-similarity",
            describe=lambda r, c, v: f"positions {r} and {c}: cosine similarity {v:.4f}", max_pixels=384,
        )  # fmt: skip
        chart = d.line_chart(
            list(range(n)), {"mean similarity": numbers_of(result.by_offset)}, x_label="offset (positions)",
            y_label="cosine similarity", width=440, height=250, markers=False, cls="position-offsets",
        )  # fmt: skip
        picks = [o for o in (1, 2, 3, 4, 8, 16, 32, 64, 127) if o < n]
        rows = [[f"{o}", float(result.by_offset[o])] for o in picks]
        if kind == "sinusoidal":
            claim = ("Sinusoidal positions make the similarity of two positions a function of their offset alone, "
                     "the same at every place in the sequence (Vaswani et al. 2017, section 3.5).")  # fmt: skip
        else:
            claim = ("Learned positions are free vectors, so nothing forces their similarity to depend on the offset "
                     "alone: the matrix shows what training made of them (GPT-2).")  # fmt: skip
        return d.div(
            d.claim(claim),
            f"<p>Cosine similarity of the vectors the model adds for positions 0..{n - 1} (its "
            "<code>embed_positions</code>). Largest spread along one diagonal (0 if only the offset counts): "
            f'<b class="offset-spread" data-value="{d.exact(result.offset_spread)}">{d.fmt(result.offset_spread, 3)}</b>.</p>',
            f'<div class="row"><div>{matrix}<br>{d.colour_bar(-1.0, 1.0, diverging=True, label="cosine similarity")}'
            f"</div><div>{chart}{d.table(['offset', 'mean similarity'], rows, cls='offset-similarity')}</div></div>",
            cls="dlx view-positions",
        )

    def top_tokens(self, logits: torch.Tensor, k: int = 5) -> list:
        probabilities = torch.softmax(logits.float(), dim=-1)
        top = probabilities.topk(min(k, probabilities.numel()))
        return [[f"<span class='tok'>{d.esc(self.token_text(i))}</span>", p]
                for p, i in zip(top.values.tolist(), top.indices.tolist())]  # fmt: skip

    def permutation_view(self, encoded: Encoded) -> str:
        result = measure.permutation_effect(self.model, encoded.ids, seed=self.seed)
        permuted_text = self.tokenizer.decode(encoded.ids[result.order].tolist())
        original_text = self.tokenizer.decode(encoded.ids.tolist())
        depth_rows = [
            ["embeddings" if i == 0 else f"after layer {i - 1}", float(v)] for i, v in enumerate(result.change)
        ]
        chart = d.line_chart(
            list(range(len(result.change))), {"relative change": numbers_of(result.change)},
            x_label="depth (0: embeddings, i: after layer i − 1)", y_label="‖h′ − h‖ / ‖h‖ (last token)",
            log_y=True, width=440, height=250, cls="permutation-change",
        )  # fmt: skip
        both = d.table(
            ["original: next token", "probability", "permuted: next token", "probability"],
            [a + b for a, b in zip(self.top_tokens(result.logits), self.top_tokens(result.permuted_logits))],
            text_columns=(0, 2), cls="permutation-next",
        )  # fmt: skip
        return d.div(
            d.claim(
                "Without positions, attention sums over its keys in any order, so the first layer's output for a "
                "token ignores the order of the tokens before it; under the causal mask every later layer still "
                "sees order, because each earlier token saw a different prefix (Haviv et al. 2022)."
            ),
            '<div class="row">'
            f'<div><h4>Original</h4><div class="prompt">{d.esc(original_text)}</div></div>'
            f'<div><h4>Shuffled (all but the last token)</h4><div class="prompt">{d.esc(permuted_text)}</div></div>'
            "</div>",
            f'<div class="row"><div><h4>The last token\'s residual stream, shuffled against original</h4>{chart}'
            f"{d.table(['depth', 'relative change'], depth_rows, cls='permutation-depths')}</div>"
            f"<div><h4>What the model predicts next</h4>{both}</div></div>",
            cls="dlx view-positions",
        )

    # ------------------------------------------------------------------------------------------
    # 4. Norm placement

    def fresh_models(self) -> dict[str, torch.nn.Module]:
        """A newly initialised model of the checkpoint's shape with each norm placement it does not have, one seed;
        built once."""
        if self.fresh is None:
            self.fresh = {
                placement: measure.fresh_model(self.model, placement, self.seed)
                for placement in measure.other_placements(self.config)
            }
        return self.fresh

    def norm_profile(self, prompt: str) -> dict[str, tuple]:
        if prompt not in self.norm_profiles:
            encoded, analysis = self.analysis(prompt)
            profiles = {"this checkpoint": analysis}
            for placement, model in self.fresh_models().items():
                profiles[f"fresh {LAYOUT_NAMES[placement]}"] = measure.analyse(model, encoded.ids, attentions=False)
            self.norm_profiles[prompt] = profiles
            while len(self.norm_profiles) > CACHED_PROMPTS:
                self.norm_profiles.popitem(last=False)
        return self.norm_profiles[prompt]

    def norms(self, prompt: str) -> str:
        return self.guarded(self._norms, prompt)

    def _norms(self, prompt: str) -> str:
        profiles = self.norm_profile(prompt)
        residual = {name: numbers_of(measure.residual_norms(a.residual)) for name, a in profiles.items()}
        grads = {name: numbers_of(a.ffn_grad_norms) for name, a in profiles.items()}
        L = self.config.num_hidden_layers
        names = list(profiles)
        residual_chart = d.line_chart(
            list(range(L + 1)), residual, x_label="depth (0: embeddings, i: after layer i − 1)",
            y_label="mean ‖residual stream‖", log_y=True, width=440, height=270, cls="residual-chart",
            highlight="this checkpoint",
        )  # fmt: skip
        grad_chart = d.line_chart(
            list(range(L)), grads, x_label="layer", y_label="‖∂L/∂W2‖", log_y=True, width=440, height=270,
            cls="grad-chart", highlight="this checkpoint",
        )  # fmt: skip
        header = ["depth", *[d.esc(n) for n in names]]
        residual_rows = [
            ["embeddings" if i == 0 else f"after layer {i - 1}", *(residual[n][i] for n in names)] for i in range(L + 1)
        ]
        grad_rows = [[f"layer {i}", *(grads[n][i] for n in names)] for i in range(L)]
        loss_row = [["prompt loss (nats/token)", *(profiles[n].loss for n in names)]]
        return d.div(
            d.claim(
                "Where the norms sit decides how the residual stream and the gradients scale with depth: pre-LN lets "
                "the stream grow layer by layer, post-LN renormalises it after every sublayer and, at "
                "initialisation, gives the layers nearest the output the largest gradients (Xiong et al. 2020)."
            ),
            f"<p>This checkpoint ({d.esc(LAYOUT_NAMES[measure.layout_of(self.config)])}, trained) beside newly "
            "initialised models of the same shape with each other norm placement, drawn from one seed "
            f"({self.seed}), on this prompt. Residual stream: the mean over tokens of its L2 norm "
            "entering layer 0 and after each layer. Gradient: ‖∂L/∂W2‖ of each layer's second MLP matrix for the "
            "prompt's next-token loss, the quantity of Xiong et al.'s Figure 3 (as in experiments/norm_placement.py)."
            "</p>",
            f'<div class="row"><div><h4>Residual stream norm</h4>{residual_chart}</div>'
            f"<div><h4>Gradient norm per layer</h4>{grad_chart}</div></div>",
            f"<h4>Residual stream norm</h4>{d.table(header, residual_rows, cls='residual-norms')}",
            f"<h4>Gradient norm ‖∂L/∂W2‖</h4>{d.table(header, grad_rows + loss_row, cls='grad-norms')}",
            cls="dlx view-norms",
        )

    # ------------------------------------------------------------------------------------------
    # 5. Generation

    def check_sampling(self, steps, temperature, top_k, top_p) -> tuple[int, float, int, float]:
        steps, temperature, top_k, top_p = int(steps), float(temperature), int(top_k), float(top_p)
        if not 1 <= steps <= MAX_NEW_TOKENS:
            raise ExploreError(f"Tokens to generate: {steps} is outside 1..{MAX_NEW_TOKENS}.")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ExploreError(f"Temperature {temperature} must be 0 (greedy) or positive.")
        if top_k < 0:
            raise ExploreError(f"top-k {top_k} must be 0 (off) or a positive number of tokens.")
        if not 0 < top_p <= 1:
            raise ExploreError(f"top-p {top_p} must be in (0, 1] (1 is off).")
        return steps, temperature, top_k, top_p

    def generation(self, prompt: str, steps=20, temperature=1.0, top_k=0, top_p=1.0, seed=0) -> str:
        return self.guarded(self._generation, prompt, steps, temperature, top_k, top_p, seed)

    def _generation(self, prompt: str, steps, temperature, top_k, top_p, seed) -> str:
        steps, temperature, top_k, top_p = self.check_sampling(steps, temperature, top_k, top_p)
        encoded = self.encode(prompt)
        notes = list(encoded.notes)
        T = len(encoded.tokens)
        if self.config.position_embedding_type in ("learned", "sinusoidal"):
            room = self.config.max_position_embeddings - T
            if room < 1:
                raise ExploreError(
                    f"The prompt fills all {self.config.max_position_embeddings} positions of this model: shorten it "
                    "to leave room for new tokens."
                )
            if steps > room:
                notes.append(f"Generating {room} tokens, not {steps}: the model has positions for "
                             f"{self.config.max_position_embeddings}.")  # fmt: skip
                steps = room
        generated = measure.generate_steps(
            self.model, encoded.ids, steps, temperature, top_k, top_p, seed=int(seed), eos_token_ids=self.eos_token_ids
        )
        if temperature == 0:
            mode = "greedy (temperature 0)"
        else:
            mode = (f"sampling: temperature {temperature:g}, top-k {top_k or 'off'}, "
                    f"top-p {'off' if top_p >= 1 else format(top_p, 'g')}, seed {int(seed)}")  # fmt: skip
        rows = []
        for i, step in enumerate(generated):
            cells = [f"{i + 1}", f"<span class='tok'>{d.esc(self.token_text(step.token_id))}</span>"]
            cells.append(f"{d.fmt(step.probability, 3)} → {d.fmt(step.sampling_probability, 3)}")
            for c in step.candidates:
                bar = f'<span style="display:inline-block;height:8px;width:{60 * c.probability:.0f}px;background:#1f5fa8"></span>'
                cells.append(
                    f'<span class="candidate" data-token-id="{c.token_id}" data-p="{d.exact(c.probability)}" '
                    f'data-sampling-p="{d.exact(c.sampling_probability)}"><span class="tok">'
                    f"{d.esc(self.token_text(c.token_id))}</span> {d.fmt(c.probability, 3)}"
                    f" → {d.fmt(c.sampling_probability, 3)}<br>{bar}</span>"
                )
            rows.append(cells)
        header = ["step", "token", "p → p′", *[f"candidate {k + 1}: p → p′" for k in range(5)]]
        text = self.tokenizer.decode(encoded.ids.tolist())
        new = self.tokenizer.decode([s.token_id for s in generated])
        return d.div(
            d.claim(
                "A causal LM writes one token at a time: each step turns the last position's logits into a "
                "distribution, reshaped by temperature, top-k and top-p, draws a token from it and feeds that token "
                "back, reusing the earlier tokens' keys and values from the KV cache."
            ),
            "".join(d.note(n) for n in notes),
            f"<p>{d.esc(mode)}; {len(generated)} tokens, each one forward of one token over a DynamicCache "
            "after the prompt's. p: the model's probability; p′: after temperature, top-k and top-p (what the "
            "token is drawn from).</p>",
            f'<div class="prompt generated-text">{d.esc(text)}<b>{d.esc(new)}</b></div>',
            d.table(header, rows, cls="generation-steps", text_columns=tuple(range(8))),
            cls="dlx view-generation",
        )

    # ------------------------------------------------------------------------------------------
    # The report: every view for one prompt, one self-contained file

    def report(self, prompt: str, layer: int = 0, head: int = 0, steps: int = 20, seed: int = 0) -> str:
        sampling = self.sampling_defaults
        sections = [
            ("Attention", self.attention(prompt, layer, head) + self.scale_losses(prompt)),
            ("Heads", self.heads(prompt, layer)),
            ("Positions", self.positions(prompt, layer, head, -1, 0)),
            ("Norm placement", self.norms(prompt)),
            (
                "Generation",
                self.generation(prompt, steps, sampling["temperature"], sampling["top_k"], sampling["top_p"], seed),
            ),  # fmt: skip
        ]
        body = "".join(f'<section><h2 id="{title.lower().replace(" ", "-")}">{title}</h2>{content}</section>'
                       for title, content in sections)  # fmt: skip
        contents = " · ".join(f'<a href="#{t.lower().replace(" ", "-")}">{t}</a>' for t, _ in sections)
        title = f"decoderlab explorer: {self.loaded.source}"
        return (
            f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{d.esc(title)}</title>'
            f"<style>body {{ max-width: 1280px; margin: 20px auto; padding: 0 16px; }} {d.CSS}</style></head>"
            f'<body class="dlx"><h1>{d.esc(title)}</h1>{self.summary()}'
            f'<p>Prompt:</p><div class="dlx"><div class="prompt">{html_module.escape(prompt)}</div></div>'
            f"{self.prompt_status(prompt)}<p>{contents}</p>{body}</body></html>"
        )
