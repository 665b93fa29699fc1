"""decoderlab.explore without a browser: each measurement against a direct computation of the same quantity (a
reference written here, transformers' own generate, autograd), the views' messages for bad input, loading
converted and remote-code checkpoints, and the self-contained report."""

import html
import json
import math
import re

import pytest
import torch
from huggingface_hub import HfApi
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

import decoderlab
from decoderlab.explore import ExploreError, Explorer, drawing, load, measure
from decoderlab.explore.cli import build_parser, listening_line, main
from decoderlab.modeling_decoderlab import apply_rotary_pos_emb, repeat_kv
from tests.test_hub import hub  # noqa: F401  (the local Hub fixture)
from training.data import CHAR_PATTERN, train_char_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nJULIET: Ay me!\n"
PROMPT = "ROMEO: But soft, what light"


@pytest.fixture(scope="module")
def tokenizer():
    return train_char_tokenizer([TEXT])


@pytest.fixture(scope="module")
def legacy_tokenizer():
    """A character tokenizer as decoderlab saved them before the unknown token: it refuses characters it lacks."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from training.data import EOS_TOKEN, wrap_tokenizer

    vocab = {c: i for i, c in enumerate(sorted(set(TEXT)))}
    vocab[EOS_TOKEN] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(CHAR_PATTERN), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([EOS_TOKEN])
    return wrap_tokenizer(backend)


def eager(model):
    model.set_attn_implementation("eager")
    return model.eval()


@pytest.fixture
def model(tiny_model, tokenizer):
    """A tiny random model over the character vocabulary, eager attention."""

    def make(**overrides):
        return eager(tiny_model(vocab_size=len(tokenizer), **overrides))

    return make


@pytest.fixture
def checkpoint(tmp_path, model, tokenizer, legacy_tokenizer):
    """A saved checkpoint folder (model, tokenizer) of a tiny random model with ``overrides``; ``legacy``: with a
    character tokenizer from before the unknown token."""

    def make(name="ckpt", legacy=False, **overrides):
        folder = tmp_path / name
        model(**overrides).save_pretrained(folder)
        (legacy_tokenizer if legacy else tokenizer).save_pretrained(folder)
        return folder

    return make


def ids_of(tokenizer, text=PROMPT) -> torch.Tensor:
    return torch.tensor(tokenizer(text)["input_ids"])


def layer0_weights(model, ids: torch.Tensor, sink_column: bool = False) -> torch.Tensor:
    """Layer 0's attention weights written out: embeddings (+ absolute positions), the block's first norm (pre-LN),
    q and k projections, QK-norm, RoPE from the model's tables (unless no_rope_layers leaves layer 0 without),
    softmax(q k^T * scale + causal mask, a sliding layer's window in it), with the sinks' logits s_h as one more
    column where the model has sinks. (nh, T, T), or (nh, T, T + 1) with the sink's column when ``sink_column``."""
    inner, attn = model.model, model.model.layers[0].self_attn
    T = ids.numel()
    x = inner.embed_tokens(ids[None])
    if inner.embed_positions is not None:
        x = x + inner.embed_positions(torch.arange(T)[None])
    x = model.model.layers[0].input_layernorm(x)
    q = attn.q_proj(x).view(1, T, -1, attn.head_dim)
    k = attn.k_proj(x).view(1, T, -1, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if inner.rotary_emb is not None and model.config.no_rope_layers[0]:
        q, k = apply_rotary_pos_emb(q, k, *inner.rotary_emb(x, torch.arange(T)[None]), unsqueeze_dim=2)
    q, k = q.transpose(1, 2), repeat_kv(k.transpose(1, 2), attn.num_key_value_groups)
    scores = q @ k.transpose(-1, -2) * attn.scaling
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    window = model.config.sliding_window if model.config.layer_types[0] == "sliding_attention" else T
    scores = scores.masked_fill(~((j <= i) & (i - j < window)), float("-inf"))
    if attn.sinks is not None:
        scores = torch.cat((scores, attn.sinks.view(1, -1, 1, 1).expand(1, -1, T, 1)), dim=-1)
    weights = scores.softmax(-1)[0]
    return weights if sink_column or attn.sinks is None else weights[..., :T]


# ----------------------------------------------------------------------------------------------
# The one forward per prompt


def test_analysis_weights_are_the_softmax_of_the_scaled_scores(model, tokenizer, attention_heads, position_type):
    """analyse's layer-0 weights equal softmax(q k^T / sqrt(d) + mask) written out from the model's modules, for
    every position type and MHA/GQA/MQA, and every layer's equal what output_attentions returns."""
    m = model(position_embedding_type=position_type, qk_norm=position_type == "rope", **attention_heads)
    ids = ids_of(tokenizer)
    analysis = measure.analyse(m, ids)
    torch.testing.assert_close(analysis.attentions[0], layer0_weights(m, ids).detach(), rtol=1e-5, atol=1e-6)
    reference = m(input_ids=ids[None], output_attentions=True).attentions
    torch.testing.assert_close(analysis.attentions, torch.stack([w[0] for w in reference]).detach())


def test_analysis_residual_stream_and_gradients_match_hidden_states_and_autograd(model, tokenizer, block_variant):
    """The residual stream recorded by the hooks is output_hidden_states' (the last one before the final norm), and
    ||dL/dW2|| per layer is what autograd gives for the prompt's next-token loss, for every block layout."""
    m = model(**block_variant)
    ids = ids_of(tokenizer)
    analysis = measure.analyse(m, ids)
    hidden = m(input_ids=ids[None], output_hidden_states=True).hidden_states
    L = m.config.num_hidden_layers
    torch.testing.assert_close(analysis.residual[:L], torch.stack([h[0] for h in hidden[:L]]).detach())
    torch.testing.assert_close(m.model.norm(analysis.residual[L]), hidden[L][0].detach())
    loss = m(input_ids=ids[None], labels=ids[None]).loss
    grads = torch.autograd.grad(loss, [layer.mlp.down_proj.weight for layer in m.model.layers])
    torch.testing.assert_close(analysis.ffn_grad_norms, torch.stack([g.norm() for g in grads]))
    assert analysis.loss == pytest.approx(loss.item(), rel=1e-6)
    assert all(p.grad is None for p in m.parameters()), "analyse leaves no gradients behind"
    torch.testing.assert_close(measure.residual_norms(analysis.residual), analysis.residual.norm(dim=-1).mean(-1))


# ----------------------------------------------------------------------------------------------
# Attention


def causal_softmax(nh: int, T: int) -> torch.Tensor:
    scores = torch.randn(nh, T, T) * 2
    return scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)


def test_head_summary_equals_loops_over_queries_and_keys():
    """Entropy, largest weight, look-back distance, weight on the previous and on the first token, each averaged
    over queries 1..T-1, against plain loops."""
    w = causal_softmax(3, 7)
    summary = measure.head_summary(w)
    for h in range(3):
        rows = range(1, 7)
        expected = {
            "entropy": sum(-sum(p * math.log(p) for p in w[h, i, : i + 1].tolist() if p > 0) for i in rows) / 6,
            "max_weight": sum(max(w[h, i, : i + 1].tolist()) for i in rows) / 6,
            "look_back": sum(sum(w[h, i, j].item() * (i - j) for j in range(i + 1)) for i in rows) / 6,
            "previous": sum(w[h, i, i - 1].item() for i in rows) / 6,
            "first": sum(w[h, i, 0].item() for i in rows) / 6,
        }
        for name, value in expected.items():
            assert summary[name][h].item() == pytest.approx(value, rel=1e-5), name


def test_softmax_jacobian_norm_equals_autograd_jacobian():
    """The closed form of ||diag(w) - w w^T||_F equals the Frobenius norm of autograd's Jacobian of the softmax."""
    scores = torch.randn(5, dtype=torch.float64) * 3
    jacobian = torch.autograd.functional.jacobian(lambda s: s.softmax(-1), scores)
    assert measure.softmax_jacobian_norm(scores.softmax(-1)).item() == pytest.approx(jacobian.norm().item(), rel=1e-6)
    assert measure.softmax_jacobian_norm(torch.tensor([1.0, 0.0, 0.0])).item() == 0.0  # saturated: no gradient


def with_sinks(m, low: float = -1.0, high: float = 2.0):
    """``m`` with its heads' sink logits spread over [low, high]: some heads give their sinks a large share."""
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(low, high, m.config.num_attention_heads))
    return m


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_scale_sweep_equals_a_model_built_with_that_scale(model, tokenizer, sinks):
    """The sweep's softmax at multiplier m, computed from the weights, is the layer-0 softmax of the same model with
    attention_scale = m / sqrt(d) (layer 0 reads the same input either way): entropy, largest weight, Jacobian
    norm; with learned sinks too, whose logits the scale does not multiply (the sweep takes them from the layer).
    And the whole-model loss at m is that model's loss; the model's scale is restored afterwards."""
    m = model(position_embedding_type="rope", attention_sinks=sinks)
    if sinks:
        with_sinks(m)
    ids = ids_of(tokenizer)
    weights = measure.analyse(m, ids).attentions[0]
    multipliers = (0.25, 4.0)
    sweep = measure.scale_sweep(weights, multipliers, measure.layer_layout(m, 0).sink_logits)
    losses = measure.scaled_losses(m, ids, multipliers)
    for i, factor in enumerate(multipliers):
        scaled = eager(decoderlab.DecoderLabForCausalLM(m.config.__class__.from_dict(
            {**m.config.to_dict(), "attention_scale": factor * m.config.head_dim**-0.5})))  # fmt: skip
        scaled.load_state_dict(m.state_dict())
        reference = measure.analyse(scaled, ids).attentions[0][:, 1:]
        expected = {
            "entropy": measure.entropy(reference).mean(-1),
            "max_weight": reference.amax(-1).mean(-1),
            "jacobian_norm": measure.softmax_jacobian_norm(reference).mean(-1),
        }
        for name, value in expected.items():
            torch.testing.assert_close(sweep[name][i], value, rtol=1e-4, atol=1e-5)
        assert losses[i] == pytest.approx(measure.analyse(scaled, ids).loss, rel=1e-5)
    assert all(layer.self_attn.scaling == m.config.head_dim**-0.5 for layer in m.model.layers)
    assert sweep["entropy"][0].mean() > sweep["entropy"][1].mean()  # a larger scale sharpens the softmax


# ----------------------------------------------------------------------------------------------
# Per-layer layouts

S, F = "sliding_attention", "full_attention"
LAYOUT = dict(layer_types=[S, F], sliding_window=4, no_rope_layers=[1, 0], attention_sinks=True)


def test_layer_layout_reads_each_layers_window_rope_and_sinks(model):
    """layer_layout says what each layer was built with: layer 0 slides over 4 tokens with RoPE, layer 1 attends to
    everything without RoPE, both have their own sink logits; a plain model's layers have none of it, and a model
    without RoPE rotates in no layer."""
    m = with_sinks(model(**LAYOUT))
    first, second = measure.layer_layout(m, 0), measure.layer_layout(m, 1)
    assert (first.sliding_window, first.rope, second.sliding_window, second.rope) == (4, True, None, False)
    torch.testing.assert_close(first.sink_logits, m.model.layers[0].self_attn.sinks.detach())
    plain = measure.layer_layout(model(), 1)
    assert (plain.sliding_window, plain.rope, plain.sink_logits) == (None, True, None)
    assert not measure.layer_layout(model(position_embedding_type="learned"), 0).rope


def test_a_sliding_layers_weights_and_its_sinks_shares_are_the_layers_softmax(model, tokenizer):
    """The analysis' layer-0 weights of a sliding layer with sinks equal the softmax written out here (the window in
    the mask, the sink's logit in the denominator): zero outside window_mask, and sink_shares is the mean of the
    sink's column over queries 1..T-1."""
    m = with_sinks(model(**LAYOUT))
    ids = ids_of(tokenizer)
    weights = measure.analyse(m, ids).attentions[0]
    reference = layer0_weights(m, ids, sink_column=True).detach()
    T = ids.numel()
    torch.testing.assert_close(weights, reference[..., :T], rtol=1e-5, atol=1e-6)
    assert weights[:, ~measure.window_mask(T, 4)].abs().max() == 0
    assert measure.window_mask(T, 4).sum() == sum(min(i + 1, 4) for i in range(T))
    torch.testing.assert_close(measure.sink_shares(weights), reference[:, 1:, T].mean(-1), rtol=1e-5, atol=1e-6)
    assert measure.sink_shares(weights).min() > 0.01


# ----------------------------------------------------------------------------------------------
# Heads


def test_kv_groups_are_the_heads_repeat_kv_copies(attention_heads):
    """kv_groups says query head h reads key/value head g exactly where repeat_kv puts head g's copy at h."""
    n_kv = attention_heads["num_key_value_heads"]
    kv = torch.randn(1, n_kv, 3, 2)
    repeated = repeat_kv(kv, 4 // n_kv)
    for g, heads in enumerate(measure.kv_groups(4, n_kv)):
        for h in heads:
            torch.testing.assert_close(repeated[:, h], kv[:, g])
    assert sorted(h for heads in measure.kv_groups(4, n_kv) for h in heads) == [0, 1, 2, 3]


def test_head_similarity_is_the_cosine_of_the_flattened_maps():
    """1 between a map and itself, the cosine of the two flattened maps (queries 1..T-1) otherwise; the group means
    average the right pairs, NaN where a kind of pair does not exist."""
    w = causal_softmax(4, 6)
    similarity = measure.head_similarity(w)
    a, b = w[0, 1:].flatten(), w[2, 1:].flatten()
    assert similarity[0, 2].item() == pytest.approx((a @ b / a.norm() / b.norm()).item(), rel=1e-5)
    torch.testing.assert_close(similarity.diagonal(), torch.ones(4))
    same, other = measure.group_similarity(similarity, [[0, 1], [2, 3]])
    assert same == pytest.approx((similarity[0, 1] + similarity[2, 3]).item() / 2, rel=1e-6)
    assert other == pytest.approx(similarity[[0, 0, 1, 1], [2, 3, 2, 3]].mean().item(), rel=1e-6)
    assert math.isnan(measure.group_similarity(similarity, [[0], [1], [2], [3]])[0])  # MHA
    assert math.isnan(measure.group_similarity(similarity, [[0, 1, 2, 3]])[1])  # MQA


# ----------------------------------------------------------------------------------------------
# Positions


def reference_rope_score(q: torch.Tensor, k: torch.Tensor, m: int, n: int, theta: float, scale: float) -> float:
    """Su et al. 2021 written out in float64: rotate each pair (x_i, x_{i+d/2}) by p / theta^(2i/d)."""
    d = q.numel()
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)

    def rotate(x, p):
        x1, x2 = x[: d // 2].double(), x[d // 2 :].double()
        c, s = torch.cos(p * freq), torch.sin(p * freq)
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c])

    return float(rotate(q, m) @ rotate(k, n)) * scale


def test_rope_scores_depend_only_on_the_offset(model, tokenizer):
    """The offset curve equals RoPE written out from the paper for the head's own query and key; moving both positions
    together changes the score by rounding error only (< 1e-10 in float64), and the model's float32 path stays close."""
    m = model(position_embedding_type="rope", qk_norm=True, num_key_value_heads=2)
    ids = ids_of(tokenizer)
    analysis = measure.analyse(m, ids)
    x_q, x_k = analysis.attention_inputs[1, -1], analysis.attention_inputs[1, 3]
    result = measure.rope_offsets(m, 1, 3, x_q, x_k)
    q, k = measure.head_query_key(m, 1, 3, x_q, x_k)
    theta, scale = m.config.rope_parameters["rope_theta"], m.model.layers[1].self_attn.scaling
    for offset in (0, 1, 7, len(result.offsets) - 1):
        expected = reference_rope_score(q.detach(), k.detach(), offset, 0, theta, scale)
        assert result.scores[offset].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert result.deviation < 1e-10 and result.deviation_model_dtype < 1e-4
    assert len(result.shifts) > 1 and max(result.shifts) + len(result.offsets) <= m.config.max_position_embeddings
    score_map = measure.rope_score_map(m, 1, 3, x_q, x_k, n=12)
    for diagonal in range(12):
        assert score_map.diagonal(-diagonal).std().item() < 1e-10 if diagonal < 11 else True


def test_rope_offsets_with_partial_rotary_factor(model, tokenizer):
    """GPT-NeoX's partial rotary: only the first quarter of each head rotates, the score still depends on the offset
    alone, and at offset 0 it is the plain q·k·scale."""
    m = model(position_embedding_type="rope", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.25})  # fmt: skip
    analysis = measure.analyse(m, ids_of(tokenizer))
    x = analysis.attention_inputs[0]
    result = measure.rope_offsets(m, 0, 1, x[-1], x[2])
    q, k = measure.head_query_key(m, 0, 1, x[-1], x[2])
    assert result.scores[0].item() == pytest.approx((q @ k).item() * m.model.layers[0].self_attn.scaling, rel=1e-5)
    assert result.deviation < 1e-10


def test_sinusoidal_similarity_depends_only_on_the_offset_and_learned_need_not(model):
    """The sinusoidal matrix is the cosine similarity of Vaswani et al.'s table (written out here), constant along
    each diagonal; the learned one is the cosine similarity of the model's own weight table."""
    m = model(position_embedding_type="sinusoidal")
    n, C = 16, m.config.hidden_size
    position = torch.arange(n, dtype=torch.float64)[:, None]
    freq = 10000 ** (-torch.arange(0, C, 2, dtype=torch.float64) / C)
    table = torch.zeros(n, C, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(position * freq), torch.cos(position * freq)
    unit = table / table.norm(dim=-1, keepdim=True)
    result = measure.position_similarity(m, n)
    torch.testing.assert_close(result.similarity, (unit @ unit.T).float(), rtol=1e-5, atol=1e-6)
    assert result.offset_spread < 1e-5
    learned = model(position_embedding_type="learned")
    weights = learned.model.embed_positions.weight[:n].detach()
    unit = weights / weights.norm(dim=-1, keepdim=True)
    result = measure.position_similarity(learned, n)
    torch.testing.assert_close(result.similarity, unit @ unit.T, rtol=1e-5, atol=1e-6)
    assert result.offset_spread > 0.1


def test_permutation_leaves_the_first_layer_and_changes_the_next_without_positions(model, tokenizer):
    """No positions: with every token but the last shuffled, the last token's stream after layer 0 is unchanged up to
    summation order, and differs after layer 1; with RoPE it differs already after layer 0."""
    ids = ids_of(tokenizer)
    nope = measure.permutation_effect(model(position_embedding_type="none"), ids, seed=1)
    assert sorted(nope.order.tolist()) == list(range(len(ids))) and nope.order[-1] == len(ids) - 1
    assert not torch.equal(nope.order, torch.arange(len(ids)))
    assert nope.change[0] == 0 and nope.change[1] < 1e-5 and nope.change[2] > 1e-3
    rope = measure.permutation_effect(model(position_embedding_type="rope"), ids, seed=1)
    assert rope.change[1] > 1e-3


# ----------------------------------------------------------------------------------------------
# Norm placement


def test_fresh_models_draw_the_same_weights_with_every_placement(model):
    """fresh_model builds each norm placement of the same shape from one seed: the same projections, another block
    class; twice with the same seed, the same model. A parallel-residual (pre-norm) checkpoint is compared with post
    and sandwich."""
    m = model(position_embedding_type="learned")
    fresh = {placement: measure.fresh_model(m, placement, seed=3) for placement in measure.PLACEMENTS}
    assert {p: measure.layout_of(f.config) for p, f in fresh.items()} == {p: p for p in measure.PLACEMENTS}
    assert len({type(f.model.layers[0]).__name__ for f in fresh.values()}) == 3
    weights = [f.model.layers[1].mlp.down_proj.weight for f in fresh.values()]
    assert all(torch.equal(w, weights[0]) for w in weights)
    again = measure.fresh_model(m, "post", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), fresh["post"].state_dict().values()))
    assert not fresh["pre"].training and fresh["pre"].config.position_embedding_type == "learned"
    assert measure.other_placements(model(use_parallel_residual=True).config) == ["post", "sandwich"]
    assert measure.other_placements(model(norm_placement="sandwich").config) == ["pre", "post"]


# ----------------------------------------------------------------------------------------------
# Generation


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_generation_steps_equal_generate_and_a_forward_without_cache(model, tokenizer, sampling):
    """Token by token over the KV cache, the tokens are generate()'s (greedy, or sampled after torch.manual_seed with
    the same temperature, top-k and top-p); each step's candidates are the top 5 of the softmax of a plain forward
    over the whole sequence so far, and the sampling probabilities sum to at most 1."""
    m = model(position_embedding_type="rope", num_key_value_heads=2)
    ids = ids_of(tokenizer)
    steps = measure.generate_steps(m, ids, 6, seed=11, **sampling)
    options = dict(do_sample=False) if sampling["temperature"] == 0 else dict(do_sample=True, **sampling)
    torch.manual_seed(11)
    expected = m.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=6,
                          eos_token_id=None, pad_token_id=tokenizer.pad_token_id, **options)  # fmt: skip
    assert [s.token_id for s in steps] == expected[0, len(ids) :].tolist()
    sequence = ids.tolist()
    for step in steps:
        probabilities = m(input_ids=torch.tensor([sequence])).logits[0, -1].softmax(-1)
        top = probabilities.topk(5)
        assert [c.token_id for c in step.candidates] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([c.probability for c in step.candidates]), top.values.detach())
        assert step.probability == pytest.approx(probabilities[step.token_id].item(), rel=1e-5)
        assert sum(c.sampling_probability for c in step.candidates) <= 1 + 1e-6
        sequence.append(step.token_id)


def test_generation_stops_at_the_end_of_text_token(model, tokenizer):
    """Generation ends after the end-of-sequence token, as generate() does."""
    m = model()
    eos = tokenizer.eos_token_id

    def end_of_text_first(module, inputs, logits):  # make the end of text the only likely token
        return logits.index_add(-1, torch.tensor([eos]), torch.full((*logits.shape[:-1], 1), 100.0))

    m.lm_head.register_forward_hook(end_of_text_first)
    steps = measure.generate_steps(m, ids_of(tokenizer), 5, temperature=0.0, eos_token_ids=[eos])
    assert [s.token_id for s in steps] == [eos]


# ----------------------------------------------------------------------------------------------
# The views: bad input becomes a message in the page


@pytest.fixture
def explorer(checkpoint):
    def make(attn_implementation="eager", **overrides):  # overrides: the config's, and legacy (the tokenizer)
        return Explorer(load(str(checkpoint(**overrides)), attn_implementation=attn_implementation))

    return make


def messages(page: str) -> list[str]:
    """The messages of a view, as the reader sees them."""
    return [html.unescape(m) for m in re.findall(r'class="message" role="alert">(.*?)</p>', page, flags=re.S)]


def text(page: str) -> str:
    return html.unescape(page)


def test_every_view_answers_a_good_prompt_without_a_message(explorer):
    """Each view of a GQA RoPE model on a good prompt: its claim, numbers, no message; the same prompt's forward is
    computed once and reused."""
    ex = explorer(num_key_value_heads=2, qk_norm=True)
    calls = []
    original = measure.analyse
    measure.analyse = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        views = [ex.attention(PROMPT, 1, 2), ex.heads(PROMPT, 1), ex.positions(PROMPT, 1, 2, -1, 0), ex.norms(PROMPT),
                 ex.generation(PROMPT, 5, 0.8, 10, 0.95, 0), ex.scale_losses(PROMPT)]  # fmt: skip
    finally:
        measure.analyse = original
    for page in views[:-1]:
        assert 'class="claim"' in page and not messages(page), page[:300]
    assert len(calls) == 1 + 2  # the prompt once, then the norm view's fresh models (the two other placements) once
    losses = [float(v) for v in re.findall(r'data-value="([^"]+)"', views[-1])]
    analysis = ex.analysis(PROMPT)[1]
    expected = measure.scaled_losses(ex.model, analysis.input_ids)
    assert losses == pytest.approx(expected, rel=1e-5) and losses[2] == pytest.approx(analysis.loss, rel=1e-7)


@pytest.mark.parametrize(
    "prompt, legacy, expected",
    [
        ("", False, "The prompt is empty"),
        ("a" * 65, False, "The prompt is 65 tokens long, but this model has positions for 64 tokens"),
        ("toé ☕", True, "outside this model's vocabulary: 'é' (U+00E9), '☕' (U+2615)"),
    ],
)
def test_bad_prompts_become_a_message_in_every_view(explorer, prompt, legacy, expected):
    """An empty prompt, one longer than the model's positions, and characters a character tokenizer without an
    unknown token (saved before decoderlab's had one) has no id for: every view says so in words (naming the value
    and what to do), and the next request is answered normally."""
    ex = explorer(position_embedding_type="learned", legacy=legacy)
    for page in (ex.attention(prompt), ex.heads(prompt), ex.positions(prompt), ex.norms(prompt),
                 ex.generation(prompt), ex.prompt_status(prompt)):  # fmt: skip
        assert len(messages(page)) == 1 and expected in messages(page)[0], page[:400]
    assert not messages(ex.attention(PROMPT))


def test_a_tokenizer_with_an_unknown_token_gets_a_note_and_the_views_run(checkpoint):
    """decoderlab's character tokenizer maps characters outside its vocabulary to <|unk|>: the views run on what the
    model reads, with a note naming the characters and the token."""
    ex = Explorer(load(str(checkpoint(position_embedding_type="rope"))))
    status = ex.prompt_status("café")
    assert "'é' (U+00E9)" in text(status) and "'<|unk|>'" in text(status) and not messages(status)
    assert not messages(ex.attention("café"))


def test_out_of_range_controls_become_messages(explorer):
    """A layer, head or token index outside the model or the prompt, and sampling settings out of range, each get a
    message naming the value and the allowed range."""
    ex = explorer()
    assert "Layer 5 does not exist: this model has layers 0 to 1" in messages(ex.attention(PROMPT, 5, 0))[0]
    assert "Head 4 does not exist: this model has heads 0 to 3" in messages(ex.attention(PROMPT, 0, 4))[0]
    assert "The query token 99 is outside the prompt" in messages(ex.positions(PROMPT, 0, 0, 99, 0))[0]
    assert "Temperature -1.0 must be 0 (greedy) or positive" in messages(ex.generation(PROMPT, 5, -1))[0]
    assert "top-p 1.5 must be in (0, 1]" in messages(ex.generation(PROMPT, 5, 1.0, 0, 1.5))[0]
    assert "outside 1..200" in messages(ex.generation(PROMPT, 0))[0]


def test_the_views_show_a_sliding_window_a_rope_free_layer_and_each_heads_sink(explorer):
    """A sliding layer's map hatches exactly the cells outside its window (their weight is 0) and its page says how
    wide the window is; a full layer's map hatches none. The attention view of a model with sinks shows each head's
    share to its sink on the prompt and its learned logit; the positions view of a RoPE-free layer says the layer
    applies no RoPE and draws no RoPE curve, and of a sliding RoPE layer says which offsets it scores. The summary
    names all three. A plain model's views show none of it."""
    ex = explorer(**LAYOUT)
    with_sinks(ex.model)
    page = ex.attention(PROMPT, 0, 1)
    assert not messages(page)
    cells = re.findall(r'<rect [^>]*data-r="(\d+)" data-c="(\d+)" data-v="([^"]+)"( data-outside)?', page)
    outside = {(int(r), int(c)) for r, c, _, mark in cells if mark}
    assert outside == {(r, c) for r, c, _, _ in ((int(a), int(b), v, m) for a, b, v, m in cells) if r - c >= 4}
    assert outside and all(float(v) == 0 for r, c, v, mark in cells if mark)
    assert 'data-window="4"' in page and "each query sees itself and the 3 tokens before it" in text(page)
    assert "data-outside" not in ex.attention(PROMPT, 1, 0)
    analysis = ex.analysis(PROMPT)[1]
    table = re.search(r'<table class="numbers head-summary">(.*?)</table>', page, flags=re.S)[1]
    assert "to its sink" in table and "sink logit" in table
    rows = [[float(v) for v in re.findall(r'data-value="([^"]+)"', row)] for row in re.findall(r"<tr.*?</tr>", table)[1:]]
    shares = measure.sink_shares(analysis.attentions[0])
    for h, row in enumerate(rows):
        assert row[-2] == pytest.approx(shares[h].item(), rel=1e-6)
        assert row[-1] == pytest.approx(ex.model.model.layers[0].self_attn.sinks[h].item(), rel=1e-6)
    rope_free = ex.positions(PROMPT, 1, 0, -1, 0)
    assert 'class="rope-free"' in rope_free and "rope-curve" not in rope_free and not messages(rope_free)
    assert "Layer 1 applies no RoPE" in text(rope_free) and "Layer 0 applies RoPE" in text(rope_free)
    sliding = ex.positions(PROMPT, 0, 0, -1, 0)
    assert "rope-curve" in sliding and "it only ever scores offsets 0 to 3" in text(sliding)
    summary = text(ex.summary())
    assert "a sliding window of 4 tokens on layer 0" in summary and "no RoPE on layer 1" in summary
    assert "a learned attention sink per head" in summary
    plain = explorer()
    page = plain.attention(PROMPT, 0, 0)
    assert "data-outside" not in page and "to its sink" not in page and 'class="layer-layout"' not in page
    assert "sliding window" not in text(plain.summary()) and "attention sink" not in text(plain.summary())
    assert 'class="rope-free"' not in plain.positions(PROMPT, 1, 0, -1, 0)


def test_a_backend_without_weights_gets_a_message_and_the_other_views_work(explorer):
    """With SDPA, which returns no attention weights, the attention and heads views say so and name the fix; the
    positions, norm and generation views still answer."""
    ex = explorer("sdpa")
    for page in (ex.attention(PROMPT), ex.heads(PROMPT)):
        (said,) = messages(page)
        assert "The attention backend 'sdpa' computes attention without returning its weights" in said
        assert "--attn_implementation eager" in said
    for page in (ex.positions(PROMPT), ex.norms(PROMPT), ex.generation(PROMPT, 3)):
        assert not messages(page) and 'class="claim"' in page


def test_generation_with_absolute_positions_stops_at_the_last_position(explorer):
    """Learned positions end at max_position_embeddings: asking for more tokens than fit gives those that fit and a
    note; a prompt filling every position gets a message."""
    ex = explorer(position_embedding_type="learned")
    page = ex.generation("a" * 60, 10, 0.0)
    assert "Generating 4 tokens, not 10" in text(page) and page.count('<tr><td class="text">') == 4
    assert "fills all 64 positions" in messages(ex.generation("a" * 64, 3, 0.0))[0]


# ----------------------------------------------------------------------------------------------
# Loading


def test_a_folder_that_is_not_a_checkpoint_is_refused_at_start_up(tmp_path, capsys):
    """A folder without config.json, a file, and a non-decoderlab model type: load raises a message naming the
    problem, and the command exits with status 2 printing it, before any server starts."""
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ExploreError, match=r"is not a checkpoint folder: it has no config.json \(it holds \['notes"):
        load(str(tmp_path))
    with pytest.raises(ExploreError, match="is a file; pass the checkpoint folder"):
        load(str(tmp_path / "notes.txt"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ExploreError, match="holds a 'bert' checkpoint"):
        load(str(tmp_path))
    assert main([str(tmp_path), "--port", "1"]) == 2
    assert "error: " in capsys.readouterr().err


def tiny_reference(family: str, vocab_size: int):
    sizes = dict(vocab_size=vocab_size, max_position_embeddings=64)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, **sizes))  # fmt: skip
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=vocab_size))
    return GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, **sizes))  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "gpt2", "neox"])
def test_llama_gpt2_and_neox_checkpoints_are_converted_on_load(tmp_path, tokenizer, randomize, family):
    """A Llama, GPT-2 or GPT-NeoX folder loads as a decoderlab model converted with decoderlab.convert, computing the
    original's logits, and its views answer."""
    reference = randomize(tiny_reference(family, len(tokenizer))).eval()
    reference.save_pretrained(tmp_path / family)
    tokenizer.save_pretrained(tmp_path / family)
    loaded = load(str(tmp_path / family))
    assert isinstance(loaded.model, decoderlab.DecoderLabForCausalLM) and loaded.converted_from == family
    ids = ids_of(tokenizer)[None]
    torch.testing.assert_close(loaded.model(input_ids=ids).logits, reference(input_ids=ids).logits,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    ex = Explorer(loaded)
    assert f"converted from {family} on load" in ex.summary()
    assert not messages(ex.attention(PROMPT) + ex.positions(PROMPT))


def test_remote_code_checkpoint_loads_through_its_own_files(checkpoint):
    """With --trust_remote_code the model's classes come from the checkpoint's own modeling file (transformers' dynamic
    modules, as where decoderlab is not installed), and the views that use its functions (RoPE) answer the same
    numbers as through the package."""
    folder = str(checkpoint(position_embedding_type="rope", num_key_value_heads=1))
    remote, package = Explorer(load(folder, trust_remote_code=True)), Explorer(load(folder))
    assert remote.loaded.remote_code and not type(remote.model).__module__.startswith("decoderlab.")
    assert not package.loaded.remote_code
    values = [re.findall(r'data-value="([^"]+)"', ex.positions(PROMPT, 1, 2)) for ex in (remote, package)]
    assert values[0] == values[1] and values[0]


# ----------------------------------------------------------------------------------------------
# The report and the command line


def test_saved_report_is_one_self_contained_file_with_every_view(checkpoint, tmp_path, capsys):
    """--save writes one HTML file holding the five views' claims and numbers, its pictures inline (SVG, PNG data
    URIs), no script and no address outside the file; no server starts."""
    out = tmp_path / "report.html"
    assert main([str(checkpoint(position_embedding_type="sinusoidal")), "--save", str(out), "--prompt", PROMPT]) == 0
    report = out.read_text(encoding="utf-8")
    for section in ("attention", "heads", "positions", "norm-placement", "generation"):
        assert f'id="{section}"' in report
    assert report.count('class="claim"') == 5 and "Sinusoidal positions make the similarity" in report
    assert "<script" not in report and not re.findall(r'(?:src|href)="(?!data:|#)', report)
    assert "data:image/png;base64," in report and "<svg" in report
    assert f"wrote {out}" in capsys.readouterr().out


def test_a_bad_report_prompt_exits_with_the_message(checkpoint, tmp_path, capsys):
    """--save with a prompt the model cannot read exits with status 2 and says why; no file is written."""
    out = tmp_path / "report.html"
    assert main([str(checkpoint(legacy=True)), "--save", str(out), "--prompt", "ünïcode"]) == 2
    assert "outside this model's vocabulary" in capsys.readouterr().err and not out.exists()


def test_command_line_listens_on_loopback_unless_told_and_says_so():
    """The defaults are 127.0.0.1:7860; the start-up line says who can reach the page."""
    args = build_parser().parse_args(["ckpt"])
    assert (args.host, args.port, args.save, args.attn_implementation) == ("127.0.0.1", 7860, None, "eager")
    assert "only this machine can reach it" in listening_line("127.0.0.1", "http://127.0.0.1:7860/")
    assert "other machines on the network can reach it" in listening_line("0.0.0.0", "http://0.0.0.0:7860/")


def test_speed_benchmark_times_every_view(tmp_path, capsys):
    """``python -m benchmarks.explore_speed --quick``: the CPU named, every view timed cold and warm against the goal,
    the JSON written through benchmarks.common.write_timing."""
    from benchmarks import explore_speed

    out = tmp_path / "explore_speed.json"
    explore_speed.main(["--quick", "--shapes", "shakespeare_char", "--json_out", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("CPU: ") and "goal: every view within 1 s" in printed
    result = json.loads(out.read_text())
    run = result["results"]["shakespeare_char"]["prompts"][0]
    views = {"attention", "scale re-runs", "heads", "positions", "norm placement", "generation"}
    assert set(run["cold_s"]) == set(run["warm_s"]) == views and all(t > 0 for t in run["cold_s"].values())
    assert result["machine"].startswith("CPU: ") and len(result["load_average"]) == 2


def test_drawing_escapes_text_and_keeps_exact_values():
    """Text from a prompt cannot inject markup or Gradio template expressions, and a heatmap's data-v round-trips each
    float32 value exactly."""
    assert "<" not in drawing.esc("<script>${x}{{y}}") and "$" not in drawing.esc("${x}")
    values = torch.rand(3, 3)
    svg = drawing.heatmap_svg(values, ["a"] * 3, ["b"] * 3, vmin=0, vmax=1)
    read = torch.tensor([float(v) for v in re.findall(r'data-v="([^"]+)"', svg)]).view(3, 3)
    assert torch.equal(read, values)


# ----------------------------------------------------------------------------------------------
# Hub ids, through the tests' local Hub


@pytest.mark.slow
def test_hub_ids_load_as_folders_do(hub, checkpoint, tmp_path, tokenizer, randomize):  # noqa: F811 (the fixture)
    """A decoderlab repository and a GPT-2 one on a Hub (the tests' local server), named by repo id: the first loads
    as its folder does, the second is downloaded and converted on load; both answer the attention view with the
    numbers their folders give."""
    api = HfApi(endpoint=hub.url, token=hub.token)
    folders = {"decoderlab": checkpoint("dl", num_key_value_heads=2)}
    reference = randomize(tiny_reference("gpt2", len(tokenizer))).eval()
    reference.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    folders["gpt2"] = tmp_path / "gpt2"
    for name, folder in folders.items():
        repo_id = f"decoderlab-org/explore-{name}"
        api.create_repo(repo_id)
        api.upload_folder(repo_id=repo_id, folder_path=folder)
        from_hub, from_folder = Explorer(load(repo_id)), Explorer(load(str(folder)))
        assert from_hub.loaded.converted_from == (None if name == "decoderlab" else "gpt2")
        values = [re.findall(r'data-v="([^"]+)"', ex.attention(PROMPT, 1, 1)) for ex in (from_hub, from_folder)]
        assert values[0] == values[1] and values[0]
