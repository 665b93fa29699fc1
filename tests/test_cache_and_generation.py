"""KV cache and generate(): cached decoding is exact, batching with left padding changes nothing,
and transformers' decoding strategies run on the model reproducibly; a training forward builds no cache."""

import copy
from unittest.mock import patch

import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin


def test_incremental_decoding_equals_full_recomputation(tiny_model, position_type, block_variant):
    """Prefill 6 tokens, then feed one token at a time through the cache: every step's logits equal
    the logits of one forward pass over the whole sequence."""
    model = tiny_model(position_embedding_type=position_type, **block_variant)
    x = torch.randint(0, 99, (2, 16))
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :6], use_cache=True)
        assert isinstance(out.cache, DynamicCache) and out.cache.get_seq_length() == 6
        steps = [out.logits]
        for t in range(6, 16):
            out = model(x[:, t : t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_chunked_prefill_through_the_cache(tiny_model, position_type):
    """Feeding the prompt in chunks of several tokens (each attending to the cache and causally within
    itself) also equals the full pass."""
    model = tiny_model(position_embedding_type=position_type)
    x = torch.randint(0, 99, (2, 15))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(x).logits
        chunks = [model(x[:, i : i + 5], cache=cache, use_cache=True).logits for i in range(0, 15, 5)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-5)


GREEDY = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)


def test_greedy_generate_with_and_without_cache(tiny_model, position_type):
    """generate(use_cache=True) and generate(use_cache=False) produce the same tokens."""
    model = tiny_model(position_embedding_type=position_type)
    prompt = torch.randint(1, 99, (2, 7))
    cached = model.generate(prompt, use_cache=True, **GREEDY)
    uncached = model.generate(prompt, use_cache=False, **GREEDY)
    assert cached.shape == (2, 19)
    assert torch.equal(cached, uncached)


def test_left_padded_batch_generates_what_each_prompt_generates_alone(tiny_model, position_type):
    """Prompts of different lengths, left-padded into one batch with an attention mask, generate the same
    continuations as each prompt on its own (positions must come from the mask for absolute positions)."""
    model = tiny_model(position_embedding_type=position_type, pad_token_id=0)
    prompts = [torch.randint(1, 99, (length,)) for length in (4, 9, 6)]
    longest = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, prompt in enumerate(prompts):
        batch[row, longest - len(prompt) :] = prompt
        mask[row, longest - len(prompt) :] = 1
    together = model.generate(batch, attention_mask=mask, **GREEDY)[:, longest:]
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], **GREEDY)[0, len(prompt) :]
        assert torch.equal(together[row], alone), row


@pytest.mark.parametrize("assistant", ["same model", "smaller model", "prompt lookup"])
def test_speculative_decoding_reproduces_greedy(tiny_model, position_type, assistant):
    """Assisted generation verifies several drafted tokens in one cached forward pass and crops the cache
    where a draft is rejected; greedy output must not change. The model as its own assistant has every
    draft accepted (multi-token steps); a different small model has most rejected (cache cropping)."""
    model = tiny_model(position_embedding_type=position_type)
    prompt = torch.randint(1, 99, (1, 12))
    prompt[0, 6:] = prompt[0, :6]  # a repeat for prompt lookup to find
    speculation = {
        "same model": dict(assistant_model=copy.deepcopy(model)),
        "smaller model": dict(assistant_model=tiny_model(position_embedding_type=position_type, num_hidden_layers=1)),
        "prompt lookup": dict(prompt_lookup_num_tokens=3),
    }[assistant]
    assert torch.equal(model.generate(prompt, **GREEDY, **speculation), model.generate(prompt, **GREEDY))


@pytest.mark.parametrize("position_embedding_type", ["rope", "learned"])
def test_static_cache_generates_the_same_tokens(tiny_model, position_embedding_type):
    """cache_implementation='static' (preallocated, compile-friendly) gives the dynamic cache's greedy tokens."""
    model = tiny_model(position_embedding_type=position_embedding_type)
    prompt = torch.randint(1, 99, (2, 7))
    dynamic = model.generate(prompt, **GREEDY)
    static = model.generate(prompt, cache_implementation="static", **GREEDY)
    assert torch.equal(static, dynamic)
    # left padding with a static cache takes GenerationMixin's input preparation (a 4D mask at every step)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    dynamic = model.generate(prompt, attention_mask=mask, **GREEDY)
    static = model.generate(prompt, attention_mask=mask, cache_implementation="static", **GREEDY)
    assert torch.equal(static, dynamic)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("mask", ["none", "all ones", "left padding"])
def test_short_decoding_step_preparation_gives_generation_mixins_logits(tiny_model, cache_implementation, mask):
    """DecoderLabForCausalLM.prepare_inputs_for_generation takes a short path for plain decoding steps: the
    step's logits equal those from GenerationMixin's preparation of the same step (which builds a 4D mask for
    a static cache), and the short path really runs where it should (with a static cache, no mask is passed
    unless there is padding)."""
    model = tiny_model(pad_token_id=0)
    prompt = torch.randint(1, 99, (2, 7))
    attention_mask = None if mask == "none" else torch.ones_like(prompt)
    if mask == "left padding":
        attention_mask[0, :3] = 0
    seen = []
    original = type(model).prepare_inputs_for_generation

    def spy(self, *args, **kwargs):
        seen.append((args, {**kwargs, "cache": copy.deepcopy(kwargs["cache"])}))  # the cache before this step
        return original(self, *args, **kwargs)

    with patch.object(type(model), "prepare_inputs_for_generation", spy):
        model.generate(prompt, attention_mask=attention_mask, cache_implementation=cache_implementation, **GREEDY)
    (input_ids,), step = seen[-1]  # the last decoding step
    assert step["next_sequence_length"] == 1 and not step.get("is_first_iteration")
    logits = {}
    for name, prepare in (("ours", original), ("GenerationMixin", GenerationMixin.prepare_inputs_for_generation)):
        inputs = prepare(model, input_ids, **{**step, "cache": copy.deepcopy(step["cache"])})
        if name == "ours" and cache_implementation == "static":
            assert ("attention_mask" in inputs) == (mask == "left padding")
        with torch.no_grad():
            logits[name] = model(**inputs).logits
    torch.testing.assert_close(logits["ours"], logits["GenerationMixin"], rtol=0, atol=1e-6)


def test_top_k_one_sampling_is_greedy(tiny_model):
    """Sampling restricted to the single most likely token is greedy decoding: the sampling path reads the
    same logits."""
    model = tiny_model()
    prompt = torch.randint(1, 99, (2, 7))
    sampled = model.generate(prompt, do_sample=True, top_k=1, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(sampled, model.generate(prompt, **GREEDY))


DECODING_STRATEGIES = {
    "sampling": dict(do_sample=True, temperature=0.8),
    "top_k_top_p": dict(do_sample=True, top_k=20, top_p=0.9),
    "beam_search": dict(num_beams=3, do_sample=False),
    "beam_sampling": dict(num_beams=3, do_sample=True),
    "repetition_penalty": dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2),
    "diverse_returns": dict(do_sample=True, num_return_sequences=3),
}


@pytest.mark.parametrize("strategy", list(DECODING_STRATEGIES))
def test_decoding_strategies_run_and_are_reproducible(tiny_model, strategy):
    """Each strategy returns well-formed sequences (the prompt kept, ids in the vocabulary), and the same seed
    gives the same output."""
    model = tiny_model()
    prompt = torch.randint(1, 99, (2, 5))
    settings = dict(max_new_tokens=10, pad_token_id=0, **DECODING_STRATEGIES[strategy])
    outputs = []
    for _ in range(2):
        torch.manual_seed(1234)
        outputs.append(model.generate(prompt, **settings))
    copies = settings.get("num_return_sequences", 1)
    assert outputs[0].shape == (2 * copies, 15)
    assert torch.equal(outputs[0][:, :5], prompt.repeat_interleave(copies, dim=0))
    assert 0 <= outputs[0].min() and outputs[0].max() < 99
    assert torch.equal(outputs[0], outputs[1])


def test_no_repeat_ngram_is_enforced(tiny_model):
    """no_repeat_ngram_size=2: no bigram occurs twice in the output, although greedy decoding of this
    model does repeat one (the constraint changes the output, i.e. it reaches the model's logits)."""
    model = tiny_model()
    prompt = torch.randint(1, 99, (1, 5))

    def repeats_a_bigram(sequence: list[int]) -> bool:
        bigrams = list(zip(sequence, sequence[1:]))
        return len(bigrams) != len(set(bigrams))

    greedy = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)[0].tolist()
    assert repeats_a_bigram(greedy)
    constrained = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0, no_repeat_ngram_size=2)
    assert not repeats_a_bigram(constrained[0].tolist())


def test_training_forward_builds_no_cache_unless_asked(tiny_model):
    """In training mode with gradients on, the forward builds no KV cache (nothing would read it) unless
    use_cache=True is passed; without gradients or in eval mode it builds one as before. Without a cache,
    transformers' mask honours packed position_ids, so examples packed into one row of a training batch
    attend only within themselves even when the training code does not pass use_cache=False."""
    model = tiny_model().train()
    x = torch.randint(0, 99, (2, 10))
    assert model(x, labels=x).cache is None
    assert isinstance(model(x, labels=x, use_cache=True).cache, DynamicCache)
    with torch.no_grad():
        assert isinstance(model(x).cache, DynamicCache)
    assert isinstance(model.eval()(x).cache, DynamicCache)

    model.train()
    first, second = torch.randint(0, 99, (1, 5)), torch.randint(0, 99, (1, 7))
    packed = model(torch.cat((first, second), dim=1), position_ids=torch.tensor([[*range(5), *range(7)]])).logits
    torch.testing.assert_close(packed[:, :5], model(first).logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[:, 5:], model(second).logits, rtol=0, atol=1e-5)
