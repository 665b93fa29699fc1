"""Features large-scale training and serving rely on: activation checkpointing, bfloat16,
device_map="auto", and torch.compile (also inside generate with a static cache)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, CompileConfig


def loss_and_grads(model, x) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(x, labels=x).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("method", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
def test_activation_checkpointing_gives_the_same_gradients(tiny_model, block_variant, method):
    """Recomputing activations in backward (both the v5 name and its deprecated alias) changes neither the
    loss nor any gradient, and really recomputes: each attention runs twice per step instead of once."""
    model = tiny_model(**block_variant).train()
    checkpointed = copy.deepcopy(model)
    getattr(checkpointed, method)()
    assert checkpointed.is_activation_checkpointing

    calls = []
    checkpointed.model.layers[0].self_attn.register_forward_hook(lambda *args: calls.append(1))
    x = torch.randint(0, 99, (2, 16))
    expected_loss, expected_grads = loss_and_grads(model, x)
    loss, grads = loss_and_grads(checkpointed, x)
    assert len(calls) == 2
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_activation_checkpointing_with_an_embedding_multiplier(tiny_model):
    """The scaled token embedding sits outside the checkpointed blocks: recomputing the blocks in backward leaves
    the loss and every gradient, the embedding's included, as they were."""
    model = tiny_model(embedding_multiplier=8.0, norm_placement="post", position_embedding_type="sinusoidal").train()
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable()
    assert checkpointed.is_activation_checkpointing
    x = torch.randint(0, 99, (2, 16))
    expected_loss, expected_grads = loss_and_grads(model, x)
    loss, grads = loss_and_grads(checkpointed, x)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bfloat16_loading_runs(tmp_path, tiny_model):
    """from_pretrained(dtype=torch.bfloat16) gives a bf16 model whose logits track the fp32 ones and which
    generates."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    half = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    x = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        logits = half(x).logits
        expected = model(x).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert (logits.float() - expected).abs().max() < 0.1 * expected.abs().max()
    generated = half.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 17)


def test_device_map_auto_loads(tmp_path, tiny_model):
    """device_map="auto" (Accelerate's big-model loading) places the model and leaves the logits unchanged;
    with too little memory it offloads whole blocks to disk (_no_split_modules) and still computes the same
    logits and greedy tokens."""
    model = tiny_model(position_embedding_type="sinusoidal")
    model.save_pretrained(tmp_path / "checkpoint")
    x = torch.randint(0, 99, (2, 12))
    with torch.no_grad():
        expected = model(x).logits
        placed = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", device_map="auto").eval()
        torch.testing.assert_close(placed(x.to(placed.device)).logits.cpu(), expected, rtol=0, atol=1e-5)

        offloaded = AutoModelForCausalLM.from_pretrained(
            tmp_path / "checkpoint",
            device_map="auto",
            max_memory={"cpu": 300_000},  # bytes: room for the embeddings, not for the blocks
            offload_folder=tmp_path / "offload",
        ).eval()
        assert set(offloaded.hf_device_map.values()) == {"cpu", "disk"}
        torch.testing.assert_close(offloaded(x).logits, expected, rtol=0, atol=1e-5)
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(offloaded.generate(x, **settings), model.generate(x, **settings))


@pytest.mark.slow
@pytest.mark.cpu_features  # inductor's vectorised code, bf16 autocast or kernel timings
def test_compiled_forward_matches_eager(tiny_model):
    """torch.compile(fullgraph=True) traces the whole forward without graph breaks (the model claims
    _can_compile_fullgraph) and gives the eager logits."""
    model = tiny_model()
    x = torch.randint(0, 99, (2, 12))
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x).logits, model(x).logits, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.cpu_features  # inductor's vectorised code, bf16 autocast or kernel timings
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_static_cache_with_compiled_forward_generates_the_same_tokens(tiny_model, wide):
    """generate with a static cache and a compiled forward (generate compiles it itself; on CPU only when
    asked to through CompileConfig) gives the uncompiled greedy tokens; wide: with layers of tiny's width."""
    model = tiny_model(hidden_size=384, intermediate_size=1024, num_attention_heads=6) if wide else tiny_model()
    prompt = torch.randint(1, 99, (2, 7))
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = model.generate(prompt, **settings)
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # transformers compiles automatically only on accelerators
    generated = model.generate(prompt, cache_implementation="static", compile_config=compile_config, **settings)
    assert hasattr(model, "_compiled_call")  # the decoding steps really ran compiled
    assert torch.equal(generated, expected)
