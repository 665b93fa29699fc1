"""What the explorer measures: pure functions over a decoderlab model and a prompt's token ids, no browser.

Everything comes from the model as transformers runs it: attention weights from ``output_attentions`` (the eager
kernel returns them), the residual stream and each attention's input from forward hooks on the standard modules
(``model.model.layers[i]``, ``.self_attn``), RoPE from the model's own rotary module and rotation function,
sampling from transformers' logits warpers over a ``DynamicCache``. Nothing here changes the model's code.

One ``analyse`` call per prompt (a forward with attention weights and a backward for the gradient norms) feeds
every view; the other functions take its tensors, or run the small extra computations a view needs.
"""

import copy
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LogitsProcessorList, StaticCache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from decoderlab.generation import compile_config, wants_compiled_decoding, warn_falling_back

# Multipliers of the model's attention scale in the scale sweep (1 is the model as trained)
SCALE_MULTIPLIERS = (0.25, 0.5, 1.0, 2.0, 4.0)

# The norm placements a model can be rebuilt with (Xiong et al. 2020; sandwich: Ding et al. 2021)
PLACEMENTS = ("pre", "post", "sandwich")


def layout_of(config) -> str:
    """``config``'s block layout: its norm placement, or "parallel" for GPT-NeoX's parallel residual (pre-norm)."""
    return "parallel" if config.use_parallel_residual else config.norm_placement


def other_placements(config) -> list[str]:
    """The norm placements ``config`` does not have (a parallel-residual block's placement is pre)."""
    return [placement for placement in PLACEMENTS if placement != config.norm_placement]


# ----------------------------------------------------------------------------------------------
# One forward (with attention weights) and one backward per prompt


@dataclass
class Analysis:
    """What one forward and backward of the model on one prompt (1, T) leave behind, for every view."""

    input_ids: torch.Tensor  # (T,)
    attentions: torch.Tensor | None  # (L, nh, T, T) softmax weights; None when the attention backend returns none
    residual: torch.Tensor  # (L + 1, T, C): the stream entering layer 0 (embeddings, positions), then after each layer
    attention_inputs: torch.Tensor  # (L, T, C): what each layer's attention reads (after its norm, where there is one)
    ffn_grad_norms: torch.Tensor  # (L,) ||dL/dW2|| of each layer's second MLP matrix (mlp.down_proj.weight)
    loss: float  # next-token loss of the prompt (nats/token); NaN for a single token
    next_token_logits: torch.Tensor  # (V,) after the last token


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.model.layers


@contextmanager
def recording(model) -> Iterator[tuple[list, list]]:
    """Forward hooks on the decoder layers for the duration of the block: yields two lists that the next forward of
    one sequence fills, the residual stream (L + 1 entries (T, C): entering layer 0, then after each layer) and each
    layer's attention input (L entries (T, C)), detached."""
    layers = decoder_layers(model)
    residual: list[torch.Tensor | None] = [None] * (len(layers) + 1)
    attention_inputs: list[torch.Tensor | None] = [None] * len(layers)

    def record_input(into: list, index: int):
        def hook(module, args, kwargs):
            into[index] = (args[0] if args else kwargs["hidden_states"])[0].detach()

        return hook

    def record_output(index: int):
        def hook(module, args, out):
            residual[index + 1] = (out if isinstance(out, torch.Tensor) else out[0])[0].detach()

        return hook

    handles = [layers[0].register_forward_pre_hook(record_input(residual, 0), with_kwargs=True)]
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(record_output(i)))
        handles.append(layer.self_attn.register_forward_pre_hook(record_input(attention_inputs, i), with_kwargs=True))
    try:
        yield residual, attention_inputs
    finally:
        for handle in handles:
            handle.remove()


def analyse(model, input_ids: torch.Tensor, attentions: bool = True) -> Analysis:
    """Run ``model`` once on ``input_ids`` (T,) with ``output_attentions`` (when ``attentions``), recording the
    residual stream and each attention's input, then backpropagate the prompt's next-token loss for each layer's
    ||dL/dW2|| (Xiong et al. 2020, Figure 3: the quantity ``experiments/norm_placement.py`` measures)."""
    ids = input_ids[None]
    labels = ids if ids.shape[1] > 1 else None
    layers = decoder_layers(model)
    grad_norms = torch.full((len(layers),), math.nan)
    with recording(model) as (residual, attention_inputs), torch.enable_grad():
        out = model(input_ids=ids, labels=labels, use_cache=False, output_attentions=attentions)
        if labels is not None:
            # only the W2 matrices' gradients: autograd skips every other weight's (the LM head's above all)
            grads = torch.autograd.grad(out.loss, [layer.mlp.down_proj.weight for layer in layers])
            grad_norms = torch.stack([g.norm() for g in grads])
    weights = None
    if attentions and out.attentions and all(w is not None for w in out.attentions):
        weights = torch.stack([w[0].detach().float() for w in out.attentions])  # (L, nh, T, T)
    return Analysis(
        input_ids=input_ids,
        attentions=weights,
        residual=torch.stack(residual),
        attention_inputs=torch.stack(attention_inputs),
        ffn_grad_norms=grad_norms,
        loss=out.loss.item() if labels is not None else math.nan,
        next_token_logits=out.logits[0, -1].detach(),
    )


# ----------------------------------------------------------------------------------------------
# Attention: per-head summary, and the scale sweep


def entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each softmax row (..., S) -> (...)."""
    return -(weights * weights.clamp_min(1e-30).log()).sum(-1)


def softmax_jacobian_norm(weights: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of d softmax / d scores = diag(w) - w w^T for each row w (..., S) -> (...).

    ||J||^2 = sum_i (w_i - w_i^2)^2 + sum_{i != j} w_i^2 w_j^2 = sum w^2 - 2 sum w^3 + (sum w^2)^2, which is
    1/S - 1/S^2 for a uniform row and 0 for a one-hot (saturated) row.
    """
    w = weights.double()
    s2, s3 = (w**2).sum(-1), (w**3).sum(-1)
    return (s2 - 2 * s3 + s2**2).clamp_min(0).sqrt().float()


def head_summary(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per head of one layer's weights (nh, T, T), averaged over the queries that have a choice (positions 1..T-1;
    the first token can only attend to itself): entropy (nats), largest weight, mean look-back distance
    sum_j w_ij (i - j) in tokens, weight on the previous token and weight on the first token. NaN for T = 1."""
    T = weights.shape[-1]
    offsets = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp_min(0).to(weights.dtype)  # (T, T): i - j
    rows = weights[:, 1:]  # (nh, T-1, T)
    return {
        "entropy": entropy(rows).mean(-1),
        "max_weight": rows.amax(-1).mean(-1),
        "look_back": (rows * offsets[1:]).sum(-1).mean(-1),
        "previous": weights.diagonal(-1, dim1=-2, dim2=-1).mean(-1),  # w[i, i-1]
        "first": rows[..., 0].mean(-1),
    }


def scale_sweep(
    weights: torch.Tensor, multipliers: Sequence[float] = SCALE_MULTIPLIERS, sink_logits: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """(M, nh) entropy, largest weight and softmax-Jacobian norm per head when one layer's scores Q K^T * scale
    (weights (nh, T, T)) are multiplied by each of ``multipliers``, averaged over queries 1..T-1.

    The scores come back from the weights: a softmax row is unchanged by adding a constant, so
    softmax(m * log w) = softmax(m * scores) row by row (masked keys have w = 0, log w = -inf, and stay masked;
    a weight that underflowed to 0 in float32 was below e^-103 and stays negligible at m >= 1/4).

    With learned sinks (``sink_logits`` (nh,): s_h, which the scale does not multiply) a row's weights are
    exp(score) / Z with Z = exp(s_h) + sum exp(score), and the sink's share 1 - sum w is exp(s_h) / Z: so
    log Z = s_h - log(1 - sum w) gives the scores back, and the scaled weights are softmax over the m * scores and
    s_h, the sink's column dropped, as the layer computes them."""
    log_w = weights[:, 1:].double().log()  # (nh, T-1, T)
    sink = None
    if sink_logits is not None:
        sink = sink_logits.double()[:, None, None].expand(*log_w.shape[:2], 1)  # (nh, T-1, 1)
        missing = (1 - weights[:, 1:].double().sum(-1, keepdim=True)).clamp_min(1e-30)  # the sink's share
        log_w = log_w + sink - missing.log()  # the scores themselves
    stats = {"entropy": [], "max_weight": [], "jacobian_norm": []}
    for m in multipliers:
        if sink is None:
            w = torch.softmax(m * log_w, dim=-1)
        else:
            w = torch.softmax(torch.cat((m * log_w, sink), dim=-1), dim=-1)[..., :-1]
        stats["entropy"].append(entropy(w).mean(-1))
        stats["max_weight"].append(w.amax(-1).mean(-1))
        stats["jacobian_norm"].append(softmax_jacobian_norm(w).mean(-1))
    return {name: torch.stack(values).float() for name, values in stats.items()}


@torch.no_grad()
def scaled_losses(model, input_ids: torch.Tensor, multipliers: Sequence[float] = SCALE_MULTIPLIERS) -> list[float]:
    """The prompt's next-token loss with every layer's attention scale multiplied by each of ``multipliers`` (the
    model re-run; ``scaling`` restored afterwards). NaN for a single token."""
    if input_ids.numel() < 2:
        return [math.nan] * len(multipliers)
    modules = [layer.self_attn for layer in decoder_layers(model)]
    original = [module.scaling for module in modules]
    losses = []
    try:
        for m in multipliers:
            for module, scaling in zip(modules, original):
                module.scaling = scaling * m
            losses.append(model(input_ids=input_ids[None], labels=input_ids[None], use_cache=False).loss.item())
    finally:
        for module, scaling in zip(modules, original):
            module.scaling = scaling
    return losses


# ----------------------------------------------------------------------------------------------
# Per-layer layouts: a sliding layer's window, a RoPE-free layer, each head's sink


@dataclass
class LayerLayout:
    """What one layer's attention does besides the plain causal softmax, read from the layer as it was built."""

    sliding_window: int | None  # tokens a query sees, itself included; None: every earlier token (full attention)
    rope: bool  # whether it rotates its queries and keys (False: a RoPE-free layer, or a model without RoPE)
    sink_logits: torch.Tensor | None  # (nh,) the learned sink logit s_h of each head; None: no sinks


def layer_layout(model, layer: int) -> LayerLayout:
    """Layer ``layer``'s window (``layer_types``, ``sliding_window``), RoPE (``no_rope_layers``) and sinks
    (``attention_sinks``), from its attention module's own attributes; a checkpoint's older code that has none of
    them has full attention, RoPE where its positions are RoPE, and no sinks."""
    attn = decoder_layers(model)[layer].self_attn
    skips_rope = hasattr(attn, "rotary") and attn.rotary is None
    rope = model.config.position_embedding_type == "rope" and not skips_rope
    sinks = getattr(attn, "sinks", None)
    logits = sinks.detach().float().cpu() if sinks is not None else None
    return LayerLayout(getattr(attn, "sliding_window", None), rope, logits)


def window_mask(T: int, window: int | None) -> torch.Tensor:
    """(T, T) True where query i may attend to key j: j <= i and, in a sliding layer, i - j < window."""
    offset = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # i - j
    return (offset >= 0) & (offset < window) if window is not None else offset >= 0


def sink_shares(weights: torch.Tensor) -> torch.Tensor:
    """(nh,) the share of each head's attention that went to its sink, 1 minus the sum of a row of weights
    (nh, T, T) (the sink's column is dropped after the softmax), averaged over the queries 1..T-1 as
    ``head_summary`` averages; NaN for T = 1."""
    return (1 - weights[:, 1:].double().sum(-1)).mean(-1).float()


# ----------------------------------------------------------------------------------------------
# Heads: which query heads share a key/value head, and how alike their maps are


def kv_groups(num_attention_heads: int, num_key_value_heads: int) -> list[list[int]]:
    """Query heads served by each key/value head: repeat_kv's order, kv head g serves [g * r, (g + 1) * r)."""
    r = num_attention_heads // num_key_value_heads
    return [list(range(g * r, (g + 1) * r)) for g in range(num_key_value_heads)]


def head_similarity(weights: torch.Tensor) -> torch.Tensor:
    """(nh, nh) cosine similarity between the attention maps (nh, T, T) of one layer's heads, over the queries that
    have a choice (rows 1..T-1); 1 on the diagonal."""
    maps = weights[:, 1:].flatten(1).double()  # (nh, (T-1) * T)
    maps = maps / maps.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return (maps @ maps.T).float()


def group_similarity(similarity: torch.Tensor, groups: list[list[int]]) -> tuple[float, float]:
    """Mean similarity between different heads of the same key/value group, and between heads of different groups
    (NaN where there is no such pair: MHA has no shared group, MQA only one)."""
    group_of = {h: g for g, heads in enumerate(groups) for h in heads}
    n = similarity.shape[0]
    same = [similarity[a, b].item() for a in range(n) for b in range(n) if a != b and group_of[a] == group_of[b]]
    other = [similarity[a, b].item() for a in range(n) for b in range(n) if group_of[a] != group_of[b]]
    return (sum(same) / len(same) if same else math.nan, sum(other) / len(other) if other else math.nan)


def kv_cache_bytes_per_token(config, bytes_per_value: int = 4) -> tuple[int, int]:
    """Bytes the KV cache holds per token for this model, and what multi-head attention of the same width would."""
    per_head = 2 * config.head_dim * bytes_per_value * config.num_hidden_layers  # a key and a value per layer
    return per_head * config.num_key_value_heads, per_head * config.num_attention_heads


# ----------------------------------------------------------------------------------------------
# Positions


def modeling_function(model, name: str) -> Callable:
    """A function of the module that defines the model's classes (the package's, or a checkpoint's own code)."""
    return getattr(sys.modules[type(model).__module__], name)


def head_query_key(model, layer: int, head: int, query_input: torch.Tensor, key_input: torch.Tensor):
    """Head ``head``'s query from ``query_input`` (C,) and its key/value head's key from ``key_input`` (C,), as the
    layer's projections (and QK-norm, if any) make them, before RoPE: two (head_dim,) vectors."""
    attn = decoder_layers(model)[layer].self_attn
    hs = attn.head_dim
    q = attn.q_proj(query_input).view(-1, hs)
    k = attn.k_proj(key_input).view(-1, hs)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q[head], k[head // attn.num_key_value_groups]


def rope_scores(model, rotary, q: torch.Tensor, k: torch.Tensor, q_positions, k_positions, scaling: float):
    """(P,) scores q·k * scale with q rotated to each of ``q_positions`` and k to ``k_positions`` (P,), by the
    model's rotary module ``rotary`` (cos/sin tables) and its ``apply_rotary_pos_emb``, in ``rotary``'s dtype."""
    apply_rotary = modeling_function(model, "apply_rotary_pos_emb")
    dtype = rotary.inv_freq.dtype
    P = len(q_positions)
    q = q.to(dtype).expand(1, P, 1, -1)  # (B, T, heads, hs)
    k = k.to(dtype).expand(1, P, 1, -1)
    cos_q, sin_q = rotary(q, torch.as_tensor(q_positions)[None])
    cos_k, sin_k = rotary(k, torch.as_tensor(k_positions)[None])
    q_rot, _ = apply_rotary(q, q, cos_q, sin_q, unsqueeze_dim=2)
    _, k_rot = apply_rotary(k, k, cos_k, sin_k, unsqueeze_dim=2)
    return (q_rot * k_rot).sum(-1)[0, :, 0] * scaling


@dataclass
class RopeOffsets:
    offsets: torch.Tensor  # (D,) 0..D-1
    scores: torch.Tensor  # (D,) the query at position offset, the key at position 0 (float64)
    shifts: list[int]  # both positions moved together by each of these
    deviation: float  # max |score(offset + s, s) - score(offset, 0)| over offsets and shifts, in float64
    deviation_model_dtype: float  # the same in the model's own dtype (float32: the angles' rounding grows with p)
    score_scale: float  # max |score|, to read the deviations against


@torch.no_grad()
def rope_offsets(model, layer: int, head: int, query_input: torch.Tensor, key_input: torch.Tensor) -> RopeOffsets:
    """RoPE (Su et al. 2021): the score of one query and one key of the prompt as a function of their offset
    (query at position offset, key at 0), and its largest change when both positions shift together, through the
    model's own rotary module both in float64 and in the model's dtype. Offsets run over half the model's positions
    (at most 256), shifts over the other half."""
    positions = model.config.max_position_embeddings
    span = max(2, min(256, positions // 2))
    offsets = torch.arange(span)
    room = max(1, positions - span)
    shifts = sorted({int(s) for s in torch.linspace(1, room, 8).round()})
    q, k = head_query_key(model, layer, head, query_input, key_input)
    scaling = decoder_layers(model)[layer].self_attn.scaling
    rotary = model.model.rotary_emb

    def deviation(rope) -> tuple[torch.Tensor, float]:
        base = rope_scores(model, rope, q, k, offsets, torch.zeros_like(offsets), scaling)
        worst = max(
            (rope_scores(model, rope, q, k, offsets + s, torch.full_like(offsets, s), scaling) - base)
            .abs()
            .max()
            .item()
            for s in shifts
        )
        return base, worst

    scores, deviation64 = deviation(copy.deepcopy(rotary).double())
    _, deviation_model = deviation(rotary)
    return RopeOffsets(offsets, scores, shifts, deviation64, deviation_model, scores.abs().max().item())


@torch.no_grad()
def rope_score_map(model, layer: int, head: int, query_input: torch.Tensor, key_input: torch.Tensor, n: int = 48):
    """(n, n) scores of the same query and key placed at positions m (rows) and n (columns): constant along each
    diagonal when the score depends only on m - n."""
    q, k = head_query_key(model, layer, head, query_input, key_input)
    rotary = copy.deepcopy(model.model.rotary_emb).double()
    m, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    scaling = decoder_layers(model)[layer].self_attn.scaling
    return rope_scores(model, rotary, q, k, m.flatten(), j.flatten(), scaling).view(n, n)


@dataclass
class PositionSimilarity:
    similarity: torch.Tensor  # (n, n) cosine similarity of the position vectors of positions 0..n-1
    by_offset: torch.Tensor  # (n,) mean similarity at each offset 0..n-1
    offset_spread: float  # max over offsets of (max - min) similarity along that diagonal: 0 if only the offset counts


@torch.no_grad()
def position_similarity(model, n: int | None = None) -> PositionSimilarity:
    """Absolute positions (sinusoidal, Vaswani et al. 2017; learned, GPT-2): the cosine similarity of the vectors
    the model adds for positions 0..n-1 (n: at most 128), from its own ``embed_positions`` module."""
    n = n or min(128, model.config.max_position_embeddings)
    vectors = model.model.embed_positions(torch.arange(n)[None])[0].double()  # (n, C)
    unit = vectors / vectors.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    similarity = unit @ unit.T
    diagonals = [similarity.diagonal(-d) for d in range(n)]
    spread = max((d.max() - d.min()).item() for d in diagonals)
    return PositionSimilarity(similarity.float(), torch.stack([d.mean() for d in diagonals]).float(), spread)


@dataclass
class Permutation:
    order: torch.Tensor  # (T,) the permuted prompt is input_ids[order]; the last token stays last
    change: torch.Tensor  # (L + 1,) ||h_perm - h|| / ||h|| of the last token's residual stream, per depth
    logits: torch.Tensor  # (V,) after the original prompt
    permuted_logits: torch.Tensor  # (V,) after the permuted prompt


@torch.no_grad()
def permutation_effect(model, input_ids: torch.Tensor, seed: int = 0) -> Permutation:
    """No positions: the prompt with every token but the last shuffled (a seeded permutation), run beside the
    original. The last token's stream after the first layer is the same (its attention sums over the same keys and
    values); from the second layer on it is not, because under the causal mask each earlier token saw a different
    prefix. That is all "permutation-invariant" means once a causal mask is in place."""
    T = input_ids.numel()
    order = torch.arange(T)
    if T > 2:
        order[:-1] = torch.randperm(T - 1, generator=torch.Generator().manual_seed(seed))
    original = stream_and_logits(model, input_ids)
    permuted = stream_and_logits(model, input_ids[order])
    last, last_permuted = original[0][:, -1], permuted[0][:, -1]  # (L + 1, C)
    change = (last_permuted - last).norm(dim=-1) / last.norm(dim=-1).clamp_min(1e-30)
    return Permutation(order, change, original[1], permuted[1])


@torch.no_grad()
def stream_and_logits(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L + 1, T, C) residual stream and (V,) next-token logits of one forward, without weights or gradients."""
    with recording(model) as (residual, _):
        logits = model(input_ids=input_ids[None], use_cache=False).logits[0, -1]
    return torch.stack(residual), logits


# ----------------------------------------------------------------------------------------------
# Norm placement


def residual_norms(residual: torch.Tensor) -> torch.Tensor:
    """(L + 1,) mean over tokens of the residual stream's L2 norm (L + 1, T, C) at each depth."""
    return residual.norm(dim=-1).mean(-1)


def fresh_model(model, placement: str, seed: int):
    """A newly initialised model of ``model``'s class and shape with the norm placement ``placement`` (sequential
    sublayers), weights drawn from ``seed`` (the same draws for every placement: the blocks create their projections
    in the same order, and their norms start at one), in eval mode."""
    fields = {**model.config.to_dict(), "norm_placement": placement, "use_parallel_residual": False}
    config = type(model.config).from_dict(fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = type(model)(config)
    return fresh.to(next(model.parameters()).dtype).eval()


# ----------------------------------------------------------------------------------------------
# Generation, token by token through the KV cache


@dataclass
class Candidate:
    token_id: int
    probability: float  # the model's softmax
    sampling_probability: float  # after temperature, top-k and top-p: what the token is drawn from


@dataclass
class Step:
    token_id: int  # the token chosen
    probability: float  # its probability under the model's softmax
    sampling_probability: float  # and under the warped distribution it was drawn from
    candidates: list[Candidate]  # the most probable tokens, best first


def sampling_warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """transformers' warpers in generate()'s order (temperature, top-k, top-p), each only where it changes anything."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    return warpers


@torch.no_grad()
def generate_steps(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    candidates: int = 5,
    eos_token_ids: Sequence[int] = (),
    compile: str = "auto",
    backend: str = "inductor",
) -> list[Step]:
    """Generate up to ``max_new_tokens`` after ``input_ids`` (T,), one forward per token over a ``DynamicCache``
    (the prompt once, then one new token each), recording each step's ``candidates`` most probable tokens.
    temperature 0 is greedy; otherwise each token is drawn from the warped distribution with a generator seeded by
    ``seed``, which draws what ``generate(do_sample=True, ...)`` draws after ``torch.manual_seed(seed)``.
    Stops after an end-of-sequence token. With ``compile`` on (``"auto"``: a model on CUDA; see
    ``decoderlab.generation``) the one-token steps run through a ``StaticCache`` and transformers' compiled forward;
    where compiling fails, a warning names why and the steps are computed again eagerly."""
    if wants_compiled_decoding(model, compile):
        try:
            return _generate_steps(model, input_ids, max_new_tokens, temperature, top_k, top_p, seed, candidates,
                                   eos_token_ids, backend)  # fmt: skip
        except RuntimeError as err:  # torch.compile's errors: an unknown backend, a compiler failure, a graph break
            warn_falling_back(err)
    return _generate_steps(model, input_ids, max_new_tokens, temperature, top_k, top_p, seed, candidates,
                           eos_token_ids, None)  # fmt: skip


def _generate_steps(
    model, input_ids, max_new_tokens, temperature, top_k, top_p, seed, candidates, eos_token_ids, backend
) -> list[Step]:
    """``generate_steps``; compiled with ``backend`` (not None)."""
    warpers = sampling_warpers(temperature, top_k, top_p) if temperature > 0 else None
    generator = torch.Generator().manual_seed(seed)
    ids = input_ids[None].to(model.device)
    if backend is None:
        cache, step_forward = DynamicCache(config=model.config), model
    else:
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + max_new_tokens)
        step_forward = model.get_compiled_call(compile_config(model, backend))
    step_input = ids
    steps = []
    for step in range(max_new_tokens):
        forward = model if step == 0 else step_forward  # the prompt eagerly (its length varies), as generate() does
        logits = forward(input_ids=step_input, cache=cache, use_cache=True).logits[:, -1].float().cpu()  # (1, V)
        probabilities = F.softmax(logits, dim=-1)
        if warpers is None:
            sampling = F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
            token = logits.argmax(-1, keepdim=True)
        else:
            sampling = F.softmax(warpers(ids, logits), dim=-1)
            token = torch.multinomial(sampling, num_samples=1, generator=generator)
        top = probabilities[0].topk(min(candidates, logits.shape[-1]))
        chosen = int(token)
        steps.append(
            Step(
                chosen,
                float(probabilities[0, chosen]),
                float(sampling[0, chosen]),
                [
                    Candidate(int(i), float(p), float(sampling[0, i]))
                    for p, i in zip(top.values.tolist(), top.indices.tolist())
                ],
            )
        )
        ids = torch.cat([ids, token.to(ids.device)], dim=-1)
        step_input = token.to(ids.device)
        if int(token) in eos_token_ids:
            break
    return steps
