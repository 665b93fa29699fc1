"""Pictures and tables as HTML strings: SVG heatmaps and line charts, PNG thumbnails, tables of numbers.

The same strings fill the Gradio page and the saved report, so nothing here depends on Gradio or on a server:
every picture is inline SVG or a PNG data URI. Cells of a heatmap carry their value in a tooltip and in
``data-*`` attributes, which is also where the browser tests read what the page shows.
"""

import base64
import html
import io
import math
from collections.abc import Sequence

import numpy as np
import torch

# Sequential (0 -> 1: white to dark blue) and diverging (-1 -> 1: blue, white, red) colour ramps, RGB anchors
SEQUENTIAL = np.array([(255, 255, 255), (205, 224, 241), (120, 170, 214), (40, 105, 170), (12, 40, 92)], float)
DIVERGING = np.array([(34, 84, 160), (150, 185, 225), (255, 255, 255), (235, 160, 140), (170, 30, 40)], float)
SERIES_COLOURS = ("#1f5fa8", "#c0392b", "#2e8b57", "#8e44ad", "#d4880f", "#16a0a8", "#7f7f7f", "#b5651d")

CSS = """
.dlx { font-family: ui-sans-serif, system-ui, sans-serif; font-size: 14px; color: #1b1b1b; line-height: 1.45; }
.dlx .claim { font-size: 15px; border-left: 4px solid #1f5fa8; background: #f1f6fc; padding: 6px 10px;
  margin: 4px 0 10px 0; }
.dlx .message { border-left: 4px solid #c0392b; background: #fdf0ee; padding: 6px 10px; margin: 4px 0; }
.dlx .note { border-left: 4px solid #d4880f; background: #fdf6e9; padding: 6px 10px; margin: 4px 0; }
.dlx .row { display: flex; flex-wrap: wrap; gap: 18px; align-items: flex-start; }
.dlx .row > .side { flex: 1 1 380px; min-width: 0; }
.dlx table.numbers { border-collapse: collapse; font-variant-numeric: tabular-nums; margin: 4px 0 10px 0; }
.dlx table.numbers th, .dlx table.numbers td { border: 1px solid #d5d9de; padding: 2px 7px; text-align: right; }
.dlx table.numbers th { background: #f3f4f6; font-weight: 600; }
.dlx table.numbers td.text, .dlx table.numbers th.text { text-align: left; }
.dlx table.numbers tr.chosen td { background: #fff7d6; }
.dlx h3 { font-size: 16px; margin: 14px 0 4px 0; }
.dlx h4 { font-size: 14px; margin: 10px 0 4px 0; }
.dlx .thumbs { display: flex; flex-wrap: wrap; gap: 10px; }
.dlx .thumbs figure { margin: 0; text-align: center; font-size: 12px; }
.dlx .thumbs img { image-rendering: pixelated; border: 1px solid #d5d9de; }
.dlx .thumbs figure.chosen img { outline: 3px solid #d4880f; }
.dlx code, .dlx .tok { font-family: ui-monospace, monospace; background: #f3f4f6; padding: 0 3px; border-radius: 3px; }
.dlx svg text { font-family: ui-sans-serif, system-ui, sans-serif; }
.dlx .prompt { font-family: ui-monospace, monospace; white-space: pre-wrap; background: #f7f7f9;
  border: 1px solid #e1e4e8; padding: 6px 8px; }
"""


def esc(text) -> str:
    """``text`` safe inside HTML and SVG, and inert in Gradio's template substitution (``${...}``, ``{{...}}``)."""
    return (
        html.escape(str(text), quote=True)
        .replace("$", "&#36;")
        .replace("{", "&#123;")
        .replace("}", "&#125;")
        .replace("`", "&#96;")
    )


def show_token(text: str) -> str:
    """A token's text with its whitespace made visible (a space as ␣, a newline as ⏎, a tab as ⇥)."""
    return text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥").replace("\r", "␍") or "∅"


def fmt(value: float, digits: int = 4) -> str:
    """A number for reading: ``digits`` significant digits, scientific when tiny or huge, a dash for NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:.{digits}g}"
    return f"{value:.{max(1, digits - 2)}e}"


def exact(value: float) -> str:
    """A float written so that reading it back gives the same float32 (the page's machine-readable copy)."""
    return format(float(value), ".9g")


def div(*parts: str, cls: str = "dlx") -> str:
    return f'<div class="{cls}">{"".join(parts)}</div>'


def claim(text: str) -> str:
    return f'<p class="claim">{text}</p>'


def message(text: str) -> str:
    """A problem with the request, said in the page (the server goes on serving)."""
    return div(f'<p class="message" role="alert">{esc(text)}</p>')


def note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def table(header: Sequence[str], rows: Sequence[Sequence], cls: str = "", chosen: int | None = None,
          text_columns: Sequence[int] = (0,)) -> str:  # fmt: skip
    """An HTML table; a cell is a string (shown as it is: escape it first), a number (formatted with ``fmt``, its
    exact value in ``data-value``) or None."""
    head = "".join(f'<th class="{"text" if i in text_columns else ""}">{h}</th>' for i, h in enumerate(header))
    body = []
    for r, row in enumerate(rows):
        cells = []
        for i, cell in enumerate(row):
            klass = ' class="text"' if i in text_columns else ""
            if isinstance(cell, (int, float)) and not isinstance(cell, bool):
                cells.append(f'<td{klass} data-value="{exact(cell)}">{fmt(cell)}</td>')
            else:
                cells.append(f"<td{klass}>{'' if cell is None else cell}</td>")
        row_class = ' class="chosen"' if chosen == r else ""
        body.append(f"<tr{row_class}>{''.join(cells)}</tr>")
    return f'<table class="numbers {cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def colours(values: np.ndarray, ramp: np.ndarray) -> np.ndarray:
    """RGB (..., 3) uint8 of ``values`` in [0, 1] along ``ramp``'s anchors, linearly interpolated."""
    x = np.clip(np.nan_to_num(values, nan=0.0), 0.0, 1.0) * (len(ramp) - 1)
    low = np.minimum(np.floor(x).astype(int), len(ramp) - 2)
    t = (x - low)[..., None]
    return np.round(ramp[low] * (1 - t) + ramp[low + 1] * t).astype(np.uint8)


def normalise(matrix: np.ndarray, vmin: float, vmax: float, gamma: float = 1.0, diverging: bool = False) -> np.ndarray:
    """``matrix`` onto [0, 1] for ``colours``: linearly from [vmin, vmax], or from [-a, a] with 0 in the middle when
    ``diverging`` (a the larger of |vmin|, |vmax|); then raised to ``gamma`` (below 1 makes small values visible)."""
    if diverging:
        return (matrix / max(abs(vmin), abs(vmax), 1e-30) + 1) / 2
    unit = np.clip((matrix - vmin) / (vmax - vmin), 0, 1) if vmax > vmin else np.zeros_like(matrix)
    return unit**gamma


def hex_colour(rgb) -> str:
    r, g, b = (int(c) for c in rgb)
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap_svg(
    matrix,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    *,
    vmin: float,
    vmax: float,
    diverging: bool = False,
    gamma: float = 1.0,
    causal: bool = False,
    window: int | None = None,
    cls: str = "heatmap",
    attributes: str = "",
    describe=None,
    max_pixels: int = 520,
) -> str:
    """An SVG heatmap of ``matrix`` (R, C), one rect per cell (above the diagonal left out when ``causal``), each
    with ``data-r``, ``data-c``, ``data-v`` (the exact value) and a tooltip ``describe(r, c, v)``; the labels are
    drawn along the axes when the cells are large enough to read them. With ``window`` (a sliding layer's), the
    cells a query cannot see, ``window`` or more tokens back, are hatched grey and marked ``data-outside``."""
    m = matrix.detach().double().cpu().numpy() if isinstance(matrix, torch.Tensor) else np.asarray(matrix, float)
    R, C = m.shape
    cell = max(3, min(22, max_pixels // max(R, C)))
    labelled = cell >= 9
    left = 46 if labelled else 4
    top = 40 if labelled else 4
    rgb = colours(normalise(m, vmin, vmax, gamma, diverging), DIVERGING if diverging else SEQUENTIAL)
    describe = describe or (lambda r, c, v: f"row {r}, column {c}: {fmt(v)}")
    parts = [OUTSIDE_PATTERN] if window is not None else []
    for r in range(R):
        for c in range(C if not causal else min(C, r + 1)):
            v = m[r, c]
            outside = window is not None and r - c >= window
            fill = "url(#dlx-outside)" if outside else hex_colour(rgb[r, c])
            title = describe(r, c, v) + (f" (outside the window of {window} tokens)" if outside else "")
            parts.append(
                f'<rect x="{left + c * cell}" y="{top + r * cell}" width="{cell}" height="{cell}" '
                f'fill="{fill}" data-r="{r}" data-c="{c}" data-v="{exact(v)}"{" data-outside" if outside else ""}>'
                f"<title>{esc(title)}</title></rect>"
            )
    if labelled:
        font = min(12, cell - 1)
        for r, label in enumerate(row_labels):
            parts.append(
                f'<text x="{left - 4}" y="{top + r * cell + cell * 0.75}" font-size="{font}" '
                f'text-anchor="end">{esc(label)}</text>'
            )
        for c, label in enumerate(col_labels):
            x, y = left + c * cell + cell * 0.7, top - 4
            parts.append(
                f'<text x="{x}" y="{y}" font-size="{font}" transform="rotate(-60 {x} {y})">{esc(label)}</text>'
            )
    width, height = left + C * cell + 4, top + R * cell + 4
    border = f'<rect x="{left}" y="{top}" width="{C * cell}" height="{R * cell}" fill="none" stroke="#c9ced6"/>'
    return (
        f'<svg class="{cls}" {attributes} xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">{border}{"".join(parts)}</svg>'
    )


# Grey diagonal hatching: the cells of a sliding layer's map that lie outside its window
OUTSIDE_PATTERN = (
    '<defs><pattern id="dlx-outside" width="4" height="4" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)"><rect width="4" height="4" fill="#eef0f3"/>'
    '<line x1="0" y1="0" x2="0" y2="4" stroke="#b9bfc8" stroke-width="1.5"/></pattern></defs>'
)


def colour_bar(vmin: float, vmax: float, diverging: bool = False, label: str = "", gamma: float = 1.0) -> str:
    """A small horizontal legend for a heatmap's colours (with ``gamma``, the middle of the bar is vmin + (vmax -
    vmin) / 2^(1/gamma): labelled)."""
    steps = 40
    ramp = DIVERGING if diverging else SEQUENTIAL
    rgb = colours(np.linspace(0, 1, steps), ramp)
    middle = (
        f'<text x="{steps * 2}" y="23" font-size="11" text-anchor="middle">'
        f"{esc(fmt(vmin + (vmax - vmin) * 0.5 ** (1 / gamma)))}</text>"
        if gamma != 1.0
        else ""
    )
    rects = "".join(
        f'<rect x="{i * 4}" y="0" width="4" height="10" fill="{hex_colour(c)}"/>' for i, c in enumerate(rgb)
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{steps * 4 + 150}" height="26">{rects}'
        f'<text x="0" y="23" font-size="11">{esc(fmt(vmin))}</text>'
        f'<text x="{steps * 4}" y="23" font-size="11" text-anchor="end">{esc(fmt(vmax))}</text>{middle}'
        f'<text x="{steps * 4 + 8}" y="10" font-size="11">{esc(label)}</text></svg>'
    )


def png_heatmap(
    matrix: torch.Tensor, vmin: float, vmax: float, pixels: int = 120, diverging: bool = False, gamma: float = 1.0
) -> str:
    """A PNG data URI of ``matrix`` (R, C), each cell a block of pixels (at most ``pixels`` wide): for thumbnails."""
    from PIL import Image

    m = matrix.detach().double().cpu().numpy()
    rgb = colours(normalise(m, vmin, vmax, gamma, diverging), DIVERGING if diverging else SEQUENTIAL)
    scale = max(1, pixels // max(m.shape))
    image = Image.fromarray(np.ascontiguousarray(rgb)).resize((m.shape[1] * scale, m.shape[0] * scale), Image.NEAREST)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    start = math.ceil(low / step) * step
    return [start + i * step for i in range(int((high - start) / step + 1e-9) + 1)]


def line_chart(
    x: Sequence[float],
    series: dict[str, Sequence[float]],
    *,
    x_label: str,
    y_label: str,
    log_x: bool = False,
    log_y: bool = False,
    width: int = 420,
    height: int = 250,
    x_ticks: Sequence[float] | None = None,
    cls: str = "chart",
    markers: bool = True,
    highlight: str | None = None,
) -> str:
    """An SVG line chart: one polyline per series (NaN and, on a log axis, non-positive points left out), axes with
    round ticks, a legend; the series ``highlight`` drawn thicker."""
    left, right, top, bottom = 62, 12, 12, 42
    legend_height = 16 * ((len(series) + 1) // 2) if len(series) > 1 else 0
    plot_w, plot_h = width - left - right, height - top - bottom

    def transform(values, log):
        arr = np.asarray(values, float)
        if log:
            arr = np.where(arr > 0, arr, np.nan)
            return np.log10(arr)
        return arr

    xs = transform(x, log_x)
    ys = {name: transform(v, log_y) for name, v in series.items()}
    finite_y = np.concatenate([v[np.isfinite(v)] for v in ys.values()] or [np.array([0.0])])
    if finite_y.size == 0:
        finite_y = np.array([0.0, 1.0])
    y_low, y_high = float(finite_y.min()), float(finite_y.max())
    if y_high - y_low < 1e-12:
        y_low, y_high = y_low - 0.5, y_high + 0.5
    pad = 0.05 * (y_high - y_low)
    y_low, y_high = y_low - pad, y_high + pad
    x_low, x_high = float(np.nanmin(xs)), float(np.nanmax(xs))
    if x_high - x_low < 1e-12:
        x_low, x_high = x_low - 0.5, x_high + 0.5

    def px(value):
        return left + (value - x_low) / (x_high - x_low) * plot_w

    def py(value):
        return top + (1 - (value - y_low) / (y_high - y_low)) * plot_h

    parts = [f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fbfbfc" stroke="#c9ced6"/>']
    y_ticks = nice_ticks(y_low, y_high) if not log_y else [t for t in range(math.ceil(y_low), math.floor(y_high) + 1)]
    for t in y_ticks:
        label = fmt(10**t if log_y else t, 3)
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#e6e8eb"/>')
        parts.append(f'<text x="{left - 5}" y="{py(t) + 4:.1f}" font-size="11" text-anchor="end">{esc(label)}</text>')
    ticks = [math.log10(t) if log_x else t for t in x_ticks] if x_ticks is not None else nice_ticks(x_low, x_high)
    if x_ticks is None and not log_x and all(float(v).is_integer() for v in x):
        ticks = [t for t in ticks if float(t).is_integer()]  # layers, offsets: no tick between two of them
    for t in ticks:
        label = fmt(10**t if log_x else t, 3)
        parts.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{top}" y2="{top + plot_h}" stroke="#e6e8eb"/>')
        parts.append(
            f'<text x="{px(t):.1f}" y="{top + plot_h + 15}" font-size="11" text-anchor="middle">{esc(label)}</text>'
        )
    parts.append(
        f'<text x="{left + plot_w / 2}" y="{top + plot_h + 32}" font-size="12" text-anchor="middle">{esc(x_label)}</text>'
    )
    parts.append(
        f'<text x="14" y="{top + plot_h / 2}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 14 {top + plot_h / 2})">{esc(y_label)}</text>'
    )
    for i, (name, values) in enumerate(ys.items()):
        colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
        thick = 3 if name == highlight else 1.6
        points = [(px(a), py(b)) for a, b in zip(xs, values) if math.isfinite(a) and math.isfinite(b)]
        if points:
            path = " ".join(f"{a:.1f},{b:.1f}" for a, b in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="{thick}"/>')
            if markers and len(points) <= 40:
                parts += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.6" fill="{colour}"/>' for a, b in points]
        if len(series) > 1:
            lx, ly = left + (i % 2) * (plot_w / 2), height + 12 + 16 * (i // 2)
            parts.append(f'<rect x="{lx}" y="{ly - 8}" width="14" height="4" fill="{colour}"/>')
            parts.append(f'<text x="{lx + 18}" y="{ly - 3}" font-size="11">{esc(name)}</text>')
    total = height + legend_height + (6 if legend_height else 0)
    return (
        f'<svg class="{cls}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total}" '
        f'viewBox="0 0 {width} {total}">{"".join(parts)}</svg>'
    )
