"""The Gradio page over an ``Explorer``: a prompt, five tabs (one per view) and each view's controls.

Every output is one of the ``Explorer``'s HTML strings, so the page shows exactly what ``--save`` writes.
"""

import gradio as gr

from . import drawing
from .views import DEFAULT_PROMPT, MAX_NEW_TOKENS, Explorer

# The browser never fetches a font (the page works offline): system fonts only
THEME_FONTS = dict(
    font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "Consolas", "monospace"]
)


def slider(maximum: int, label: str, elem_id: str) -> gr.Slider:
    # a slider needs a range: with one layer or head, 0..1 (1 answers with a message that it does not exist)
    return gr.Slider(0, max(maximum, 1), value=0, step=1, label=label, elem_id=elem_id)


def build(explorer: Explorer) -> gr.Blocks:
    config = explorer.config
    layers, heads = config.num_hidden_layers - 1, config.num_attention_heads - 1
    sampling = explorer.sampling_defaults
    with gr.Blocks(title=f"decoderlab explorer: {explorer.loaded.source}", analytics_enabled=False) as demo:
        gr.HTML(explorer.summary(), elem_id="summary")
        with gr.Row():
            prompt = gr.Textbox(value=DEFAULT_PROMPT, label="Prompt", lines=3, scale=6, elem_id="prompt")
            run = gr.Button("Run", variant="primary", scale=1, elem_id="run")
        status = gr.HTML(drawing.div("<p>Type a prompt and press Run.</p>"), elem_id="status")
        with gr.Tabs(elem_id="views"):
            with gr.Tab("Attention", id="attention", elem_id="tab-attention"):
                with gr.Row():
                    attention_layer = slider(layers, "Layer", "attention-layer")
                    attention_head = slider(heads, "Head", "attention-head")
                attention = gr.HTML(elem_id="attention-view")
                rerun = gr.Button("Re-run the model at each scale (the prompt's loss)", elem_id="scale-losses")
                scale_losses = gr.HTML(elem_id="scale-losses-view")
            with gr.Tab("Heads", id="heads", elem_id="tab-heads"):
                heads_layer = slider(layers, "Layer", "heads-layer")
                heads_view = gr.HTML(elem_id="heads-view")
            with gr.Tab("Positions", id="positions", elem_id="tab-positions"):
                rope = config.position_embedding_type == "rope"
                with gr.Row(visible=rope):
                    positions_layer = slider(layers, "Layer", "positions-layer")
                    positions_head = slider(heads, "Head", "positions-head")
                    query = gr.Number(-1, precision=0, label="Query token (-1: the last)", elem_id="positions-query")
                    key = gr.Number(0, precision=0, label="Key token", elem_id="positions-key")
                positions = gr.HTML(elem_id="positions-view")
            with gr.Tab("Norm placement", id="norms", elem_id="tab-norms"):
                norms = gr.HTML(elem_id="norms-view")
            with gr.Tab("Generation", id="generation", elem_id="tab-generation"):
                with gr.Row():
                    steps = gr.Slider(1, MAX_NEW_TOKENS, value=20, step=1, label="New tokens", elem_id="gen-steps")
                    temperature = gr.Number(sampling["temperature"], label="Temperature (0: greedy)",
                                            elem_id="gen-temperature")  # fmt: skip
                    top_k = gr.Number(sampling["top_k"], precision=0, label="top-k (0: off)", elem_id="gen-top-k")
                    top_p = gr.Number(sampling["top_p"], label="top-p (1: off)", elem_id="gen-top-p")
                    seed = gr.Number(0, precision=0, label="Seed", elem_id="gen-seed")
                    generate = gr.Button("Generate", elem_id="generate")
                generation = gr.HTML(elem_id="generation-view")

        ran = [run.click, prompt.submit]
        views = [
            (explorer.prompt_status, [prompt], status, []),
            (explorer.attention, [prompt, attention_layer, attention_head], attention,
             [attention_layer.change, attention_head.change]),
            (explorer.heads, [prompt, heads_layer], heads_view, [heads_layer.change]),
            (explorer.positions, [prompt, positions_layer, positions_head, query, key], positions,
             [positions_layer.change, positions_head.change, query.submit, key.submit]),
            (explorer.norms, [prompt], norms, []),
            (explorer.generation, [prompt, steps, temperature, top_k, top_p, seed], generation, [generate.click]),
        ]  # fmt: skip
        rerun.click(explorer.scale_losses, inputs=[prompt], outputs=scale_losses, show_progress="minimal")
        for fn, inputs, output, controls in views:
            # always_last: a control changed while its view is computing is answered afterwards with the latest values
            # (Gradio's default for gr.on, "once", would drop it and leave the view showing the earlier setting)
            gr.on(triggers=ran + controls, fn=fn, inputs=inputs, outputs=output, show_progress="minimal",
                  trigger_mode="always_last")  # fmt: skip
    return demo


def launch(demo: gr.Blocks, host: str, port: int) -> str:
    """Start serving ``demo`` on host:port in a background thread (offline: system fonts, no telemetry, no share
    link) and return its local URL; ``demo.block_thread()`` then keeps the process serving."""
    _, url, _ = demo.launch(
        server_name=host,
        server_port=port,
        share=False,
        ssr_mode=False,
        quiet=True,
        show_error=True,
        prevent_thread_lock=True,
        theme=gr.themes.Default(**THEME_FONTS),
        css=drawing.CSS,
        footer_links=[],
    )
    return url
