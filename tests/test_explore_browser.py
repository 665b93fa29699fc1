"""The explorer in a real browser: ``python -m decoderlab.explore`` serves a small trained checkpoint on 127.0.0.1,
Playwright drives Debian's headless Chromium (/usr/bin/chromium, never a browser of Playwright's own) through every
view, and what the page shows is checked against what the model computes directly in the test process (eager
attention's weights, hidden states and a forward hook, RoPE written out from the paper, softmax of the logits).
Across position types x block layouts, MHA, GQA and MQA; and the bad inputs, each a message in the page while the
server goes on serving. Screenshots of every view are saved into the test's tmp dir (printed with -s)."""

import hashlib
import html
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from playwright.sync_api import sync_playwright
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import free_port
from tests.explore_checkpoints import train_char_checkpoint
from tests.training_runs import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
PROMPT = "ROMEO:\nBut soft, what light through yonder window?"
WAIT_MS = 120_000

# position type x block layout, with MHA (4 key/value heads), GQA (2) and MQA (1) among them
LAYOUTS = {
    "rope-pre-gqa": dict(position_embedding_type="rope", qk_norm=True, num_key_value_heads=2),
    "rope-post-mqa": dict(position_embedding_type="rope", norm_placement="post", num_key_value_heads=1),
    "sinusoidal-post-mha": dict(position_embedding_type="sinusoidal", norm_placement="post", norm_type="layernorm"),
    "learned-sandwich-mqa": dict(position_embedding_type="learned", norm_placement="sandwich", num_key_value_heads=1),
    "none-parallel-gqa": dict(position_embedding_type="none", use_parallel_residual=True, num_key_value_heads=2),
}


class Server:
    """``python -m decoderlab.explore`` in a subprocess on 127.0.0.1 and a free port; stopped by its pid."""

    def __init__(self, checkpoint: pathlib.Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = open(checkpoint.parent / f"server-{self.port}.log", "w+")  # noqa: SIM115 (closed in stop)
        command = [sys.executable, "-m", "decoderlab.explore", str(checkpoint), "--port", str(self.port), *args]
        self.process = subprocess.Popen(command, env=subprocess_env(), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            assert self.process.poll() is None, f"the explorer exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"the explorer did not answer within 180 s:\n{self.output()}"
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.5)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1300, "height": 1000})
    yield context.new_page()
    context.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One small checkpoint per layout, trained for 40 steps on Tiny Shakespeare (so its heads have structure)."""
    root = tmp_path_factory.mktemp("explore")
    return {name: train_char_checkpoint(root / name, steps=40, **fields) for name, fields in LAYOUTS.items()}


def prompt_id(prompt: str) -> str:
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:12]


# each tab and the element of its view (Gradio renders a tab's content once the tab is opened)
VIEWS = {"Attention": "attention-view", "Heads": "heads-view", "Positions": "positions-view",
         "Norm placement": "norms-view", "Generation": "generation-view"}  # fmt: skip


def wait_for_answer(page, element: str, prompt: str) -> None:
    page.wait_for_selector(f'#{element} [data-prompt-id="{prompt_id(prompt)}"]', state="attached", timeout=WAIT_MS)


def run_prompt(page, url: str | None, prompt: str, check=None) -> None:
    """Open the page at ``url`` (None: stay on it), type ``prompt``, press Run, open every tab and wait until its
    view answers the prompt, then call ``check(tab, element)`` with the tab still open."""
    if url is not None:
        page.goto(url)
    page.locator("#prompt textarea").fill(prompt)
    page.click("#run")
    wait_for_answer(page, "status", prompt)
    for tab, element in VIEWS.items():
        page.get_by_role("tab", name=tab).click()
        wait_for_answer(page, element, prompt)
        if check is not None:
            check(tab, element)
    page.get_by_role("tab", name="Attention").click()


def open_tab(page, name: str, shots: pathlib.Path, shot: str) -> None:
    page.get_by_role("tab", name=name).click()
    page.wait_for_selector(f"#{VIEWS[name]}", timeout=WAIT_MS)
    page.screenshot(path=shots / f"{shot}.png", full_page=True)


def set_number(page, elem_id: str, value) -> None:
    """Type into a control's number box (a slider's too) and confirm it, as a person does."""
    box = page.locator(f"#{elem_id} input[type=number]").first
    box.fill(str(value))
    box.press("Enter")


def values(page, selector: str, attribute: str = "value") -> list[float]:
    return [float(v) for v in page.eval_on_selector_all(selector, f"els => els.map(e => e.dataset.{attribute})")]


def messages(page, within: str = "") -> list[str]:
    """The messages shown in the page (or in the element ``within``, a CSS selector)."""
    return [
        m.strip() for m in page.eval_on_selector_all(f'{within} [role="alert"]', "els => els.map(e => e.textContent)")
    ]


def load_direct(folder: pathlib.Path):
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(folder)


def last_layer_output(model, ids: torch.Tensor) -> torch.Tensor:
    """(T, C) the residual stream after the last layer (before the final norm), from a forward hook."""
    seen = []
    handle = model.model.layers[-1].register_forward_hook(lambda module, args, out: seen.append(out[0]))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return seen[0]


def rope_score(q: torch.Tensor, k: torch.Tensor, m: int, n: int, theta: float, rotary: int, scale: float) -> float:
    """RoPE (Su et al. 2021) written out in float64 on the first ``rotary`` dimensions: pairs (x_i, x_{i+r/2})
    rotated by p / theta^(2i/r); the rest pass through."""
    freq = theta ** (-torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)

    def rotate(x, p):
        x = x.double()
        x1, x2 = x[: rotary // 2], x[rotary // 2 : rotary]
        c, s = torch.cos(p * freq), torch.sin(p * freq)
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c, x[rotary:]])

    return float(rotate(q, m) @ rotate(k, n)) * scale


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_view_shows_what_the_model_computes(layout, checkpoints, page, tmp_path):
    """For each layout: type a prompt, open every view, and compare the page with the model loaded here: layer 1 head
    2's attention weights, the prompt's loss with the scale multiplied by 4 (against a model built with that scale),
    the key/value groups and the heads' similarities, the positions view (the RoPE offset
    curve and its shift deviation < 1e-5; the position-similarity spread; the permuted prompt's change after the
    first layer), the residual stream norms, and the top-5 candidates of the first two generation steps."""
    folder = checkpoints[layout]
    model, tokenizer = load_direct(folder)
    config = model.config
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    T = ids.shape[1]
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True, output_hidden_states=True)
    server = Server(folder)
    try:
        run_prompt(page, server.url, PROMPT)
        assert not messages(page)

        # attention: layer 1, head 2, every cell of the causal map
        set_number(page, "attention-layer", 1)
        set_number(page, "attention-head", 2)
        page.wait_for_selector('svg.attention-map[data-layer="1"][data-head="2"]', timeout=WAIT_MS)
        open_tab(page, "Attention", tmp_path, f"{layout}-attention")
        cells = page.eval_on_selector_all(
            'svg.attention-map[data-layer="1"][data-head="2"] rect[data-v]',
            "els => els.map(e => [+e.dataset.r, +e.dataset.c, +e.dataset.v])",
        )
        assert len(cells) == T * (T + 1) // 2
        shown = torch.zeros(T, T)
        for r, c, v in cells:
            shown[int(r), int(c)] = v
        torch.testing.assert_close(shown, out.attentions[1][0, 2], rtol=0, atol=1e-6)

        # the scale: the button re-runs the model with every layer's scale multiplied; at x4, a model built so
        page.click("#scale-losses")
        page.wait_for_selector("#scale-losses-view .scale-losses", timeout=WAIT_MS)
        losses = values(page, "#scale-losses-view .scale-losses td[data-value]")
        scaled = AutoModelForCausalLM.from_pretrained(folder, attention_scale=4 * config.head_dim**-0.5).eval()
        with torch.no_grad():
            assert losses[-1] == pytest.approx(scaled(input_ids=ids, labels=ids).loss.item(), rel=1e-5)
            assert losses[2] == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-5)

        # heads: which query heads read each key/value head, and the mean similarity of heads sharing one
        open_tab(page, "Heads", tmp_path, f"{layout}-heads")
        groups = page.eval_on_selector_all(".kv-groups tbody tr td:last-child", "els => els.map(e => e.textContent)")
        per_group = config.num_attention_heads // config.num_key_value_heads
        assert groups == [", ".join(str(g * per_group + i) for i in range(per_group))
                          for g in range(config.num_key_value_heads)]  # fmt: skip
        maps = out.attentions[0][0, :, 1:].flatten(1)
        maps = maps / maps.norm(dim=-1, keepdim=True)
        similarity = maps @ maps.T
        shown_similarity = values(page, "svg.head-similarity rect[data-v]", "v")
        torch.testing.assert_close(torch.tensor(shown_similarity).view_as(similarity), similarity, rtol=0, atol=1e-5)

        # positions
        open_tab(page, "Positions", tmp_path, f"{layout}-positions")
        kind = config.position_embedding_type
        if kind == "rope":
            deviation = values(page, ".rope-deviation")[0]
            assert deviation < 1e-5
            attn = model.model.layers[0].self_attn
            seen = []
            handle = attn.register_forward_pre_hook(lambda module, args, kwargs: seen.append(args[0][0]),
                                                    with_kwargs=True)  # fmt: skip
            with torch.no_grad():
                model(input_ids=ids)
                handle.remove()
                q = attn.q_proj(seen[0][-1]).view(-1, attn.head_dim)
                k = attn.k_proj(seen[0][0]).view(-1, attn.head_dim)
                if attn.q_norm is not None:
                    q, k = attn.q_norm(q), attn.k_norm(k)
            rotary = int(attn.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
            theta = config.rope_parameters["rope_theta"]
            curve = values(page, ".rope-offsets td[data-value]")
            offsets = [int(o) for o in page.eval_on_selector_all(".rope-offsets tbody tr td:first-child",
                                                                  "els => els.map(e => e.textContent)")]  # fmt: skip
            for offset, score in zip(offsets, curve):
                expected = rope_score(q[0], k[0], offset, 0, theta, rotary, attn.scaling)
                assert score == pytest.approx(expected, rel=1e-5, abs=1e-6)
                shifted = rope_score(q[0], k[0], offset + 17, 17, theta, rotary, attn.scaling)
                assert abs(shifted - expected) < 1e-5
        elif kind in ("sinusoidal", "learned"):
            n = min(128, config.max_position_embeddings)
            vectors = model.model.embed_positions(torch.arange(n)[None])[0].double().detach()
            unit = vectors / vectors.norm(dim=-1, keepdim=True)
            similarity = unit @ unit.T
            spread = max((similarity.diagonal(-d).max() - similarity.diagonal(-d).min()).item() for d in range(n))
            assert values(page, ".offset-spread")[0] == pytest.approx(spread, rel=1e-5, abs=1e-7)
        else:
            change = values(page, ".permutation-depths td[data-value]")
            assert change[0] == 0 and change[1] < 1e-5 and change[2] > 1e-4

        # norm placement: this checkpoint's residual stream norms at every depth
        open_tab(page, "Norm placement", tmp_path, f"{layout}-norms")
        hidden = [h[0] for h in out.hidden_states[: config.num_hidden_layers]] + [last_layer_output(model, ids)]
        expected = torch.stack([h.norm(dim=-1).mean() for h in hidden])
        rows = page.eval_on_selector_all(
            ".residual-norms tbody tr td:nth-child(2)", "els => els.map(e => +e.dataset.value)"
        )
        torch.testing.assert_close(torch.tensor(rows), expected, rtol=1e-5, atol=1e-6)

        # generation: greedy, three tokens; the first two steps' top-5 against the softmax of a plain forward
        page.get_by_role("tab", name="Generation").click()
        set_number(page, "gen-steps", 3)
        page.locator("#gen-temperature input").fill("0")
        page.click("#generate")
        page.wait_for_function(
            "() => document.querySelectorAll('#generation-view .generation-steps tbody tr').length === 3",
            timeout=WAIT_MS,
        )
        open_tab(page, "Generation", tmp_path, f"{layout}-generation")
        rows = page.eval_on_selector_all(
            "#generation-view .generation-steps tbody tr",
            "rows => rows.map(r => [...r.querySelectorAll('.candidate')].map(c => [+c.dataset.tokenId, +c.dataset.p]))",
        )
        sequence = ids
        for step in rows[:2]:
            with torch.no_grad():
                probabilities = model(input_ids=sequence).logits[0, -1].softmax(-1)
            top = probabilities.topk(5)
            assert [t for t, _ in step] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor([p for _, p in step]), top.values, rtol=1e-5, atol=1e-7)
            sequence = torch.cat([sequence, top.indices[:1][None]], dim=-1)  # greedy: the first candidate
        assert not messages(page)
    finally:
        server.stop()
    print(f"screenshots of {layout}: {tmp_path}")


def test_bad_input_gets_a_message_in_the_page_and_the_server_goes_on(checkpoints, page, tmp_path):
    """An empty prompt, a prompt longer than the model's 64 positions, a layer that does not exist: each shows its
    message in the page; characters outside the vocabulary get a note naming them and the unknown token they become,
    and every view answers; then a good prompt is answered in full."""
    server = Server(checkpoints["learned-sandwich-mqa"])
    try:
        page.goto(server.url)
        cases = [
            ("", "The prompt is empty"),
            ("a" * 70, "The prompt is 70 tokens long, but this model has positions for 64 tokens"),
        ]
        for number, (prompt, expected) in enumerate(cases):

            def said(tab: str, element: str, expected=expected) -> None:
                shown = messages(page, "#status") + messages(page, f"#{element}")
                assert len(shown) == 2 and all(expected in html.unescape(m) for m in shown), (tab, shown)

            run_prompt(page, None, prompt, said)
            page.screenshot(path=tmp_path / f"bad-input-{number}.png", full_page=True)

        def noted(tab: str, element: str) -> None:
            notes = page.eval_on_selector_all("#status .note", "els => els.map(e => e.textContent)")
            assert not messages(page, "#status") and not messages(page, f"#{element}"), tab
            assert any("'é' (U+00E9), '☕' (U+2615)" in n and "'<|unk|>'" in n for n in notes), (tab, notes)

        run_prompt(page, None, "café ☕", noted)
        run_prompt(page, server.url, PROMPT)
        assert not messages(page)
        set_number(page, "attention-layer", 1)
        set_number(page, "attention-head", 1)
        page.wait_for_selector('svg.attention-map[data-layer="1"][data-head="1"]', timeout=WAIT_MS)
        assert not messages(page)
    finally:
        server.stop()


def test_a_backend_without_weights_says_so_in_the_page(checkpoints, page, tmp_path):
    """Started with --attn_implementation sdpa (no attention weights), the attention and heads views say so and name
    the fix, and the other views answer."""
    server = Server(checkpoints["rope-pre-gqa"], "--attn_implementation", "sdpa")
    try:
        run_prompt(page, server.url, PROMPT)
        open_tab(page, "Attention", tmp_path, "sdpa-attention")
        shown = messages(page, "#attention-view") + messages(page, "#heads-view")
        assert len(shown) == 2 and all("'sdpa' computes attention without returning its weights" in m for m in shown)
        assert (
            not messages(page, "#positions-view") + messages(page, "#norms-view") + messages(page, "#generation-view")
        )
        assert page.locator("#positions-view .rope-deviation").count() == 1
        assert page.locator("#generation-view .generation-steps").count() == 1
    finally:
        server.stop()


def test_start_up_refuses_a_folder_that_is_not_a_checkpoint_and_says_where_it_listens(checkpoints, tmp_path):
    """A folder without config.json: the command exits with status 2 and says why, before serving. A checkpoint:
    the start-up line says it listens on 127.0.0.1 and that only this machine can reach it."""
    (tmp_path / "empty").mkdir()
    run = subprocess.run([sys.executable, "-m", "decoderlab.explore", str(tmp_path / "empty")], env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2 and "is not a checkpoint folder: it has no config.json" in run.stderr
    server = Server(checkpoints["rope-pre-gqa"])
    try:
        deadline = time.monotonic() + 30
        while "listening on" not in server.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "listening on 127.0.0.1" in server.output() and "only this machine can reach it" in server.output()
    finally:
        server.stop()
