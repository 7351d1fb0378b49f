"""``report.html``: an ``irgen verify`` result as one self-contained HTML file.

The page has a header (model, producer, verdict, thresholds, where each chain
starts to drift, counts, problems, every note of the result), the per-layer
error chart, the layer graph, a per-layer table (worst first) and histograms of
golden vs reference values for the layers the result carries them for. Every
chart is SVG generated here; CSS and the few lines of JavaScript (click a table
heading to sort) are inline, and a Content-Security-Policy forbids loading
anything else, so the file opens offline and anywhere it is copied to.

The page fits a 1280-pixel window: the chart and the table are sized for three
checks, long layer names are shortened (:func:`_short_name`, the full name in a
tooltip), and whatever is still wider scrolls inside its own box. In the chart
an exact 0 is a diamond and an error under the log axis' floor a left-pointing
triangle, so no value goes undrawn; :data:`DRIFT_RULE` says where a chain is
marked as starting to drift (:func:`_drift_start`).

Every string taken from the result is escaped: layer names come from model
files, which may be hostile.

Element ids the tests (and users' scripts) rely on: ``summary``, ``verdict``,
``problems``, ``notes``, ``drift-entire``/``drift-source``, ``layer-graph``,
``error-chart``, ``chart-legend``, ``layer-table``, ``histograms``; chart plot
areas are filled with :data:`COLORS` ``["plot"]`` and pass/fail bars with
``["pass"]``/``["fail"]``.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import tempfile
import textwrap
from html import escape
from pathlib import Path
from typing import Any, Iterable

from irgen.output import file_mode

__all__ = ["write_report", "render_report", "write_html", "COLORS", "DRIFT_RULE"]

CHECKS = ("single", "entire", "source")

#: Fill colours. ``plot`` is used for nothing but the error chart's plot areas,
#: ``pass``/``fail`` for nothing but its bars, so a screenshot can find both.
COLORS = {
    "pass": "#1b9e77",
    "fail": "#d7263d",
    "unsupported": "#9aa0a6",
    "missing": "#c08a00",
    "plot": "#eef3f8",
    "golden": "#4c72b0",
    "reference": "#e07b00",
    "drift": "#7b2cbf",
}

# Layer-graph box fills and strokes, by layer status.
_BOX = {
    "pass": ("#e3f4ee", "#5aa58a"),
    "fail": ("#fde2e4", "#c81d32"),
    "unsupported": ("#eceff1", "#8a9299"),
}
_BOX_OTHER = ("#fff8e1", "#c08a00")

_STATUS_RANK = {"fail": 0, "missing": 1, "unsupported": 2, "pass": 3}


# ------------------------------------------------------------------ helpers


def _e(value: Any) -> str:
    """Escape anything for HTML text and attribute values."""
    return escape("" if value is None else str(value), quote=True)


def _num(value: Any) -> float | None:
    """A float, or None for None, bools and anything non-numeric."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _fmt(value: Any, digits: int = 3) -> str:
    v = _num(value)
    if v is None:
        return "\u2014"
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == int(v) and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.{digits}g}"


def _fmt_cos(value: Any) -> str:
    """Cosine similarity readably near 1: ``1 - 5.7e-15`` rather than ``1``."""
    v = _num(value)
    if v is None or not math.isfinite(v) or v < 0.999995 or v >= 1.0:
        return _fmt(v, 7)
    return f"1 \u2212 {1.0 - v:.1e}"


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


_SEPS = "_./:"


def _short_name(name: str, n: int) -> str:
    """A layer name in at most ``n`` characters that keeps what tells layers apart.

    Exporters repeat a module's path in each part (``features_features.12_block_block.1_fc2_Conv``):
    a ``_``-part that the next part extends (``features`` before ``features.12``) is dropped
    first. What is still too long keeps a head and a tail cut at separators (``_ . / :``; an
    index stays with its word), the head at most ``n/2``, as many characters as fit, with ``…``
    between. The full name goes in a
    tooltip wherever the result differs from the name."""
    if len(name) <= n:
        return name
    parts = name.split("_")
    parts = [p for k, p in enumerate(parts) if not (k + 1 < len(parts) and p and parts[k + 1].startswith(p + "."))]
    text = "_".join(parts)
    if len(text) <= n:
        return text
    # a head text[:k] ends before a separator, but keeps an index with its word (``features.12``, not ``features``)
    heads = [k for k in range(1, n // 2 + 1) if text[k] in _SEPS and text[k - 1] not in _SEPS
             and not (text[k] == "." and text[k + 1:k + 2].isdigit())] or [max(1, n // 3)]
    starts = [k for k in range(1, len(text)) if text[k - 1] in _SEPS and text[k] not in _SEPS]  # a tail text[k:]
    best = None  # (characters kept, head length, tail start): the most kept, then the longer head
    for h in heads:
        tail = next((k for k in starts if k > h and h + 1 + len(text) - k <= n), None)
        if tail is not None and (best is None or (h + len(text) - tail, h) > best[:2]):
            best = (h + len(text) - tail, h, tail)
    if best is None:  # no tail part fits: cut inside the last one
        best = (0, heads[0], len(text) - (n - heads[0] - 1))
    _, h, tail = best
    return text[:h] + "\u2026" + text[tail:]


def _status(value: Any) -> str:
    return value if value in ("pass", "fail", "unsupported", "missing") else "missing"


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _layers(result: dict) -> list[dict]:
    return [layer for layer in _list(result.get("layers")) if isinstance(layer, dict)]


def _modes(result: dict, layers: list[dict]) -> list[str]:
    """Checks to show: the result's modes, else whichever checks any layer has."""
    modes = [m for m in _list(result.get("modes")) if isinstance(m, str)]
    if not modes:
        modes = [c for c in CHECKS if any(_dict(layer.get("checks")).get(c) for layer in layers)]
    return modes


def _error(layer: dict, m: dict) -> tuple[float | None, str]:
    """The chart's error of one check: (value, unit). Integer layers in LSB, float ones as max |diff|."""
    if layer.get("integer") and _num(m.get("max_lsb")) is not None:
        return _num(m.get("max_lsb")), "LSB"
    return _num(m.get("max_abs")), "abs"


def _threshold(unit: str, check: str, m: dict, thresholds: dict) -> float | None:
    """The error limit marked in the chart, as ``irgen verify`` applies it.

    Integer layers: ``max_lsb`` against the source runtime, exact (None: no
    line) in ``single``/``entire``. Float layers: ``atol``, scaled by
    ``max(1, max|golden|)`` in ``entire``/``source`` (``max|golden|`` is
    ``max_abs / max_rel``); ``rtol * |golden|`` comes on top elementwise.
    """
    if unit == "LSB":
        return _num(thresholds.get("max_lsb")) if check == "source" else None
    atol = _num(thresholds.get("atol"))
    if atol is None or check == "single":
        return atol
    err, rel = _num(m.get("max_abs")), _num(m.get("max_rel"))
    if err and rel and math.isfinite(err) and math.isfinite(rel) and rel > 0:
        return atol * max(1.0, err / rel)
    return atol


def _cosine(m: dict) -> float | None:
    """The check's cosine similarity; 1 for an exact match that left it null."""
    cos = _num(m.get("cosine"))
    return 1.0 if cos is None and m.get("exact") is True else cos


def _badness(layer: dict, modes: list[str], thresholds: dict) -> tuple:
    """Sort key, worst first: status, then the largest error relative to its threshold, then cosine."""
    worst_rel, worst_cos = 0.0, 1.0
    for check in modes:
        m = _dict(_dict(layer.get("checks")).get(check))
        err, unit = _error(layer, m)
        if err is not None:
            thr = _threshold(unit, check, m, thresholds) or 0.0
            rel = err / thr if thr > 0 else err * 1e12
            worst_rel = max(worst_rel, rel if not math.isnan(rel) else math.inf)
        cos = _cosine(m)
        if cos is not None and not math.isnan(cos):
            worst_cos = min(worst_cos, cos)
    return (_STATUS_RANK.get(_status(layer.get("status")), 1), -worst_rel, worst_cos)


# ------------------------------------------------------------------ layer graph


#: the layer graph's boxes (width, height), the gaps between them (across, down), the boxes a
#: row holds (five fit a 1280-pixel window) and the margin around the drawing, in pixels
_NODE_W, _NODE_H, _GAP_X, _GAP_Y, _ROW_NODES, _GRAPH_MARGIN = 210, 36, 26, 34, 5, 16


def _graph_svg(layers: list[dict]) -> str:
    """Layers as boxes, layered top to bottom by longest path from the inputs, edges from ``inputs``."""
    preds, level, uses_input = _graph_levels(layers)
    if not layers:
        return '<svg id="layer-graph" role="img" width="300" height="40"><text x="8" y="24">no layers</text></svg>'
    nodes: list[tuple[int, int]] = [(0, -1)] if uses_input else []  # (level, layer index or -1 for input)
    nodes += [(lv, i) for i, lv in enumerate(level)]
    width, height, pos, row_of = _graph_layout(nodes)
    edges = []
    for i, ps in enumerate(preds):
        srcs = list(ps) + ([-1] if uses_input and len(ps) < len(_list(layers[i].get("inputs"))) else [])
        for k, j in enumerate(dict.fromkeys(srcs)):
            edges.append(_graph_edge(pos[j], pos[i], row_of[i] - row_of[j], k, width))
    boxes = [_input_box(*pos[i]) if i < 0 else _layer_box(i, layers[i], *pos[i]) for _, i in nodes]
    return (
        f'<svg id="layer-graph" role="img" aria-label="layer graph" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}"><defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" '
        f'markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L8,4 L0,8 z" '
        f'fill="#78909c"/></marker></defs>' + "".join(edges) + "".join(boxes) + "</svg>")


def _graph_levels(layers: list[dict]) -> tuple[list[list[int]], list[int], bool]:
    """Each layer's predecessors (the earlier layers its ``inputs`` name), its level (1 + the
    highest of theirs; 1 without any), and whether any layer reads something else (a model
    input, or a producer the result does not list)."""
    index = {}
    for i, layer in enumerate(layers):
        index.setdefault(str(layer.get("name")), i)
    level: list[int] = []
    preds: list[list[int]] = []
    uses_input = False
    for i, layer in enumerate(layers):
        ps = []
        for src in _list(layer.get("inputs")):
            j = index.get(str(src))
            if j is not None and j < i:
                ps.append(j)
            else:
                uses_input = True  # "input", or a producer the result does not list
        preds.append(ps)
        level.append(1 + max((level[j] for j in ps), default=0))
    return preds, level, uses_input


def _graph_layout(nodes: list[tuple[int, int]]) -> tuple[int, int, dict[int, tuple[float, float]], dict[int, int]]:
    """Where the graph's ``nodes`` ((level, layer index or -1 for the input)) go: the drawing's
    width and height, each node's top-left corner and row. A level is a row of centred boxes;
    one wider than :data:`_ROW_NODES` wraps onto extra rows."""
    by_level: dict[int, list[int]] = {}
    for lv, i in nodes:
        by_level.setdefault(lv, []).append(i)
    rows: list[list[int]] = []
    for lv in sorted(by_level):
        members = by_level[lv]
        rows += [members[k:k + _ROW_NODES] for k in range(0, len(members), _ROW_NODES)]
    cols = max(len(r) for r in rows)
    width = _GRAPH_MARGIN * 2 + cols * _NODE_W + (cols - 1) * _GAP_X
    height = _GRAPH_MARGIN * 2 + len(rows) * _NODE_H + (len(rows) - 1) * _GAP_Y
    pos: dict[int, tuple[float, float]] = {}
    row_of: dict[int, int] = {}
    for r, members in enumerate(rows):
        row_w = len(members) * _NODE_W + (len(members) - 1) * _GAP_X
        x0 = (width - row_w) / 2
        for k, i in enumerate(members):
            pos[i] = (x0 + k * (_NODE_W + _GAP_X), _GRAPH_MARGIN + r * (_NODE_H + _GAP_Y))
            row_of[i] = r
    return width, height, pos, row_of


def _graph_edge(src: tuple[float, float], dst: tuple[float, float], span: int, k: int, width: int) -> str:
    """The arrow from the box at ``src`` down to the box at ``dst``, ``span`` rows below; a skip
    connection (more than one row) bows out to the side, by ``k`` (its rank among the edges into
    ``dst``), so that it does not run through the boxes between."""
    (x1, y1), (x2, y2) = src, dst
    sx, sy, ex, ey = x1 + _NODE_W / 2, y1 + _NODE_H, x2 + _NODE_W / 2, y2
    if span <= 1:
        d = f"M{sx:.1f},{sy:.1f} C{sx:.1f},{sy + _GAP_Y / 2:.1f} {ex:.1f},{ey - _GAP_Y / 2:.1f} {ex:.1f},{ey:.1f}"
    else:  # skip connection: bow out to the side so it does not run through the boxes between
        side = 1 if (ex >= width / 2) else -1
        off = side * (_NODE_W / 2 + 12 + 6 * (k % 3))
        d = (f"M{sx:.1f},{sy:.1f} C{sx + off:.1f},{sy + _GAP_Y:.1f} "
             f"{ex + off:.1f},{ey - _GAP_Y:.1f} {ex:.1f},{ey:.1f}")
    cls = "edge skip" if span > 1 else "edge"
    return f'<path class="{cls}" d="{d}" marker-end="url(#arrow)"/>'


def _input_box(x: float, y: float) -> str:
    """The graph's rounded ``input`` box at (``x``, ``y``)."""
    return (f'<g class="node input"><rect x="{x:.1f}" y="{y:.1f}" width="{_NODE_W}" height="{_NODE_H}" rx="18" '
            f'fill="#ffffff" stroke="#607d8b"/><text x="{x + _NODE_W / 2:.1f}" y="{y + 23:.1f}" '
            f'text-anchor="middle" class="nname">input</text></g>')


def _layer_box(i: int, layer: dict, x: float, y: float) -> str:
    """Layer ``i``'s box at (``x``, ``y``): its name, op, dtype and scheme, coloured by status, with
    a tooltip of its checks, linking to its table row."""
    status = _status(layer.get("status"))
    fill, stroke = _BOX.get(status, _BOX_OTHER)
    name = str(layer.get("name"))
    sub = " \u00b7 ".join(str(v) for v in (layer.get("op"), layer.get("dtype"), layer.get("scheme")) if v)
    tip = f"#{i} {name}\nop: {layer.get('op')}  dtype: {layer.get('dtype')}\nstatus: {status}"
    for check, m in _dict(layer.get("checks")).items():
        if isinstance(m, dict):
            tip += f"\n{check}: {_status(m.get('status'))}"
            if m.get("message"):
                tip += f" ({m.get('message')})"
    sw = 2.2 if status == "fail" else 1.2
    return (f'<a href="#layer-{i}"><g class="node {status}" id="node-{i}"><title>{_e(tip)}</title>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{_NODE_W}" height="{_NODE_H}" rx="4" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="{sw}"/>'
            f'<text x="{x + 8:.1f}" y="{y + 15:.1f}" class="nname">{_e(_short_name(name, 25))}</text>'
            f'<text x="{x + 8:.1f}" y="{y + 29:.1f}" class="nsub">{_e(_short(sub, 34))}</text></g></a>')


# ------------------------------------------------------------------ error chart

#: A float layer's chained error must grow past this many times its own single-layer error
#: (and past a tenth of its limit) for the report to call it drift; an integer layer's, past
#: its own by any LSB. See :func:`_drift_start`.
DRIFT_GROWTH = 10.0

DRIFT_RULE = (
    "A chain (entire: irgen's recompute chained from the model input; source: the source runtime's "
    "values end to end) drifts at the first layer, in IR order, whose chained error exceeds its limit "
    "or whose check fails, or whose chained error grows beyond the layer's own single-layer error "
    "(the single check; for the source check of a quantized model, the layer recomputed from the "
    "runtime's own inputs): integer layers by any LSB, float layers to more than "
    f"{DRIFT_GROWTH:g}\u00d7 it and more than a tenth of the limit.")


def _chain_errors(layer: dict, check: str, thresholds: dict) -> tuple[float | None, float | None, float | None, str] | None:
    """(chained error, the layer's own error, limit, unit) of a chained check, or None if it did not compare."""
    checks = _dict(layer.get("checks"))
    m = _dict(checks.get(check))
    if m.get("status") not in ("pass", "fail"):
        return None
    e2e = _dict(m.get("end_to_end"))
    if e2e:  # the source check of a quantized model: the verdict is local, the chain end to end
        chained, unit = _error(layer, e2e)
        own = _error(layer, m)[0]
        return chained, own, _threshold(unit, check, e2e, thresholds), unit
    chained, unit = _error(layer, m)
    single = _dict(checks.get("single"))
    own = _error(layer, single)[0] if single.get("status") in ("pass", "fail") else None
    limit = _threshold(unit, check, m, thresholds)
    return chained, own, (0.0 if limit is None and unit == "LSB" else limit), unit


def _drift_start(ordered_ir: list[tuple[int, dict]], check: str, thresholds: dict) -> dict | None:
    """The first layer where the ``check`` chain drifts, by :data:`DRIFT_RULE`, or None:
    ``{"index", "name", "chained", "own", "limit", "unit", "why"}``."""
    for i, layer in ordered_ir:
        errs = _chain_errors(layer, check, thresholds)
        if errs is None:
            continue
        chained, own, limit, unit = errs
        m = _dict(_dict(layer.get("checks")).get(check))
        why = None
        if chained is not None and limit is not None and not chained <= limit:
            why = f"error {_fmt(chained)} {unit} above its limit {_fmt(limit)} {unit}"
        elif m.get("status") == "fail" and not m.get("end_to_end"):
            why = f"fails its check: {m.get('message') or 'see the table'}"
        elif chained is not None and own is not None and (
                chained > own if unit == "LSB"
                else chained > DRIFT_GROWTH * own and chained > (limit or 0.0) / DRIFT_GROWTH):
            why = f"error {_fmt(chained)} {unit} grows beyond its own single-layer error {_fmt(own)} {unit}"
        if why:
            return {"index": i, "name": str(layer.get("name")), "chained": chained, "own": own,
                    "limit": limit, "unit": unit, "why": why}
    return None


class _LogAxis:
    """Decades ``10**lo`` .. ``10**hi`` onto ``0 .. width`` pixels; positive values under
    ``10**lo`` are below the floor (drawn as a marker, not a bar)."""

    def __init__(self, lo: int, hi: int, width: float):
        self.lo, self.hi, self.width = lo, hi, width

    def below(self, v: float) -> bool:
        return 0 < v < 10.0 ** self.lo

    def x(self, v: float) -> float:
        if v <= 0:
            return 0.0
        if math.isinf(v) or math.isnan(v):
            return self.width
        t = (math.log10(v) - self.lo) / (self.hi - self.lo)
        return max(2.0, min(self.width, t * self.width))

    def ticks(self) -> Iterable[int]:
        step = max(1, math.ceil((self.hi - self.lo) / max(1, int(self.width // 40))))
        return range(self.hi, self.lo - 1, -step)


def _exact_marker(x: float, cy: float, fill: str, cls: str = "bar exact") -> str:
    """A diamond: the value is exactly 0."""
    return f'<path class="{cls}" d="M{x + 1:.1f},{cy:.1f} l4,-4 l4,4 l-4,4 z" fill="{fill}"'


def _below_marker(x: float, cy: float, fill: str, cls: str = "bar below") -> str:
    """A triangle pointing left: above 0, below the axis floor."""
    return f'<path class="{cls}" d="M{x + 1:.1f},{cy:.1f} l8,-5 v10 z" fill="{fill}"'


def _drift_marker(x: float, cy: float, cls: str = "drift-mark") -> str:
    """A triangle pointing right, left of a panel: the chain drifts from this layer on."""
    return f'<path class="{cls}" d="M{x - 11:.1f},{cy - 5:.1f} l9,5 l-9,5 z" fill="{COLORS["drift"]}"'


def _bar_panel(x0: float, top: float, pw: float, rows: list[tuple[float | None, str, str, float | None]],
               axis: _LogAxis, row_h: float, title: str, drift_row: int | None = None) -> list[str]:
    """One panel of the chart: a plot area at ``x0`` with one bar per row.

    ``rows`` holds (value, status, tooltip, threshold); value None draws "n/a", 0 a diamond,
    a value under the axis floor a left-pointing triangle. ``drift_row``: the row where a
    chain starts to drift, outlined and marked left of the panel.
    """
    out = [f'<text x="{x0:.1f}" y="{top - 20:.1f}" class="psub">{_e(title)}</text>']
    plot_h = row_h * len(rows)
    out.append(f'<rect class="plot" x="{x0:.1f}" y="{top:.1f}" width="{pw:.1f}" height="{plot_h:.1f}" '
               f'fill="{COLORS["plot"]}"/>')
    for t in axis.ticks():
        tx = x0 + axis.x(10.0 ** t)
        out.append(f'<line class="grid" x1="{tx:.1f}" y1="{top:.1f}" x2="{tx:.1f}" y2="{top + plot_h:.1f}"/>')
        anchor = "end" if t == axis.hi else "start" if t == axis.lo else "middle"  # the panels' end labels stay inside
        out.append(f'<text x="{tx:.1f}" y="{top - 6:.1f}" class="tick" text-anchor="{anchor}">1e{t}</text>')
    floor = f"\n(below the axis floor 1e{axis.lo})"
    for r, (value, status, tip, thr) in enumerate(rows):
        y = top + r * row_h
        cy = y + row_h / 2
        color = COLORS.get(status, COLORS["missing"])
        if value is None:
            label = "n/a" if status in ("unsupported", "missing") else "\u2014"
            out.append(f'<text x="{x0 + 4:.1f}" y="{y + row_h - 4:.1f}" class="na">{label}<title>{_e(tip)}</title></text>')
        elif value == 0:  # exact: a small diamond on the axis
            out.append(_exact_marker(x0, cy, color) + f'><title>{_e(tip)}</title></path>')
        elif axis.below(value):
            out.append(_below_marker(x0, cy, color, f"bar below {status}") + f'><title>{_e(tip + floor)}</title></path>')
        else:
            w = axis.x(value)
            out.append(f'<rect class="bar {status}" x="{x0:.1f}" y="{y + 2:.1f}" width="{w:.1f}" '
                       f'height="{row_h - 4:.1f}" fill="{color}"><title>{_e(tip)}</title></rect>')
        if thr is not None and thr > 0:
            tx = x0 + axis.x(thr)
            out.append(f'<line class="thr" x1="{tx:.1f}" y1="{y + 1:.1f}" x2="{tx:.1f}" y2="{y + row_h - 1:.1f}"/>')
        if r == drift_row:
            out.append(f'<rect class="drift-row" x="{x0 - 0.5:.1f}" y="{y + 0.5:.1f}" width="{pw + 1:.1f}" '
                       f'height="{row_h - 1:.1f}" fill="none" stroke="{COLORS["drift"]}" stroke-width="1.5"/>')
    return out


#: The chart's geometry: it fits a 1280-pixel window with three checks (two panels each).
_CHART = {"row_h": 17, "label_w": 212, "err_w": 165, "cos_w": 92, "gap": 22, "group_gap": 34, "top": 78}


def _chart_svg(ordered: list[tuple[int, dict]], modes: list[str], thresholds: dict,
               drift: dict[str, dict] | None = None) -> str:
    """Per layer (rows, ir order) and per check: max error (log) and 1 - cosine (log).

    ``drift``: per chained check, :func:`_drift_start`'s layer, marked in that check's panels."""
    g = _CHART
    row_h, label_w, err_w, cos_w, gap, top = g["row_h"], g["label_w"], g["err_w"], g["cos_w"], g["gap"], g["top"]
    drift = drift or {}
    values = []
    for _, layer in ordered:
        for check in modes:
            m = _dict(_dict(layer.get("checks")).get(check))
            v, _ = _error(layer, m)
            if v is not None and v > 0 and math.isfinite(v):
                values.append(v)
    for key in ("max_lsb", "atol"):
        t = _num(thresholds.get(key))
        if t and t > 0:
            values.append(t)
    hi = max(1, math.ceil(math.log10(max(values)))) if values else 1
    err_axis = _LogAxis(min(-8, hi - 6), hi, err_w)
    cos_axis = _LogAxis(-8, 0, cos_w)
    min_cos = _num(thresholds.get("min_cosine"))
    n = max(1, len(ordered))
    group_w = err_w + gap + cos_w + g["group_gap"]
    width = max(label_w + len(modes) * group_w + 10, _LEGEND_W)
    row_of = {i: r for r, (i, _) in enumerate(ordered)}
    out = []
    for r, (i, layer) in enumerate(ordered):
        y = top + r * row_h
        status = _status(layer.get("status"))
        name = str(layer.get("name"))
        out.append(f'<a href="#layer-{i}"><text x="{label_w - 14}" y="{y + row_h - 5}" text-anchor="end" '
                   f'class="rlabel {status}">{_e(_short_name(name, 32))}<title>{_e(name)}</title></text></a>')
    x = label_w
    for check in modes:
        err_rows, cos_rows = [], []
        for i, layer in ordered:
            m = _dict(_dict(layer.get("checks")).get(check))
            st = _status(m.get("status")) if m else "missing"
            name = str(layer.get("name"))
            v, unit = _error(layer, m)
            thr = _threshold(unit, check, m, thresholds)
            msg = f"\ntensor {m.get('tensor')}" if m.get("tensor") else ""
            local = _dict(m.get("local"))
            if local:  # source, integer layers: recomputed from the runtime's own inputs
                msg += f"\nlocal (runtime's inputs): {_fmt(local.get('max_lsb'))} LSB"
            e2e = _dict(m.get("end_to_end"))
            if e2e:  # the verdict is local; the chained values against the runtime are drift
                msg += f"\nend to end: {_drift_text(e2e)}"
            if m.get("message"):
                msg += f"\n{m.get('message')}"
            err_rows.append((v, st, f"{name} [{check}] {st}\nmax error {_fmt(v)} {unit}{msg}", thr))
            cos = _cosine(m)
            dist = None if cos is None else (math.inf if math.isnan(cos) else max(0.0, min(2.0, 1.0 - cos)))
            cos_rows.append((dist, st, f"{name} [{check}] cosine {_fmt_cos(cos)}\n1 \u2212 cosine {_fmt(dist)}",
                             None if min_cos is None
                             else 1.0 - min_cos))
        start = _dict(drift.get(check))
        drift_row = row_of.get(start.get("index")) if start else None
        out.append(f'<text x="{x:.1f}" y="{top - 40:.1f}" class="ptitle">{_e(check)}</text>')
        out += _bar_panel(x, top, err_w, err_rows, err_axis, row_h, "max error, log", drift_row)
        if drift_row is not None:
            out.append(_drift_marker(x, top + drift_row * row_h + row_h / 2)
                       + f'><title>{_e(check)} chain drifts from {_e(start.get("name"))}: {_e(start.get("why"))}'
                       f'</title></path>')
        x += err_w + gap
        out += _bar_panel(x, top, cos_w, cos_rows, cos_axis, row_h, "1 \u2212 cosine, log", drift_row)
        x += cos_w + g["group_gap"]
    if not modes:
        out.append(f'<text x="{label_w}" y="{top}" class="na">no checks in this result</text>')
    lines = _legend_lines(width - 16)
    out += _legend(8, top + n * row_h + 22, err_axis.lo, cos_axis.lo, lines)
    height = top + n * row_h + 22 + 14 * (1 + len(lines)) + 6
    return (f'<svg id="error-chart" role="img" aria-label="per-layer error chart" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}">' + "".join(out) + "</svg>")


#: The chart's least width: its key's row of markers, and lines of text not too short.
_LEGEND_W = 960


def _legend_lines(width: float) -> list[str]:
    """The chart key's lines of text, wrapped for ``width`` pixels (SVG text does not wrap; its 10-pixel
    font is taken as 5.2 pixels a character, which DejaVu Sans and its likes do not exceed on average)."""
    chars = int(width / 5.2)
    return ["Colour: the check's status (green pass, red fail, grey unsupported, amber missing).",
            *textwrap.wrap("Bars: max |golden \u2212 reference|, in LSB for integer layers. Limits: integer layers "
                           "max_lsb against the source runtime (single, entire: exact); float layers atol (entire, "
                           "source: \u00d7 max(1, max|golden|)), plus rtol \u00b7 |golden| elementwise.", chars),
            *textwrap.wrap("Drift: " + DRIFT_RULE, chars)]


def _legend(x: float, y: float, err_floor: int, cos_floor: int, lines: list[str]) -> list[str]:
    """The chart's key: its markers drawn as in the chart (in grey: the status colours are the bars' alone)."""
    grey = "#52606d"
    out = ['<g id="chart-legend">',
           _exact_marker(x, y - 4, grey, "key exact") + "/>",
           f'<text x="{x + 13:.1f}" y="{y:.1f}" class="tick">exact (0)</text>',
           _below_marker(x + 90, y - 4, grey, "key below") + "/>",
           f'<text x="{x + 104:.1f}" y="{y:.1f}" class="tick">below the axis floor (max error &lt; 1e{err_floor}, '
           f'1 \u2212 cosine &lt; 1e{cos_floor}; the value is in the tooltip)</text>',
           f'<line class="thr" x1="{x + 610:.1f}" y1="{y - 9:.1f}" x2="{x + 610:.1f}" y2="{y + 1:.1f}"/>',
           f'<text x="{x + 617:.1f}" y="{y:.1f}" class="tick">the limit</text>',
           _drift_marker(x + 705, y - 4, "key drift") + "/>",
           f'<text x="{x + 708:.1f}" y="{y:.1f}" class="tick">where a chain starts to drift (rule below)</text>',
           "</g>"]
    for k, text in enumerate(lines):
        out.append(f'<text x="{x:.1f}" y="{y + 16 + 14 * k:.1f}" class="tick">{_e(text)}</text>')
    return out


# ------------------------------------------------------------------ histograms


def _histogram_svg(k: int, name: str, h: dict) -> str:
    w, hgt, ml, mr, mt, mb = 470, 190, 50, 12, 26, 34
    edges = [_num(v) for v in _list(h.get("edges"))]
    golden = [_num(v) for v in _list(h.get("golden"))]
    ref = [_num(v) for v in _list(h.get("reference"))]
    nb = len(edges) - 1
    title = f"{name} [{h.get('check') or '?'}]"
    head = (f'<svg class="histogram" id="hist-{k}" role="img" width="{w}" height="{hgt}" '
            f'viewBox="0 0 {w} {hgt}"><title>{_e(title)}</title>'
            f'<text x="{ml}" y="16" class="ptitle">{_e(_short_name(str(name), 48))} [{_e(h.get("check") or "?")}]</text>')
    if (nb < 1 or len(golden) != nb or len(ref) != nb or any(v is None or not math.isfinite(v) for v in edges)
            or any(v is None for v in golden + ref)):
        return head + f'<text x="{ml}" y="60" class="na">histogram data malformed</text></svg>'
    pw, ph = w - ml - mr, hgt - mt - mb
    top = max(max(golden), max(ref), 1.0)
    bw = pw / nb
    out = [f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#cfd8dc"/>']
    def scale(c: float) -> float:  # log counts: a spike (ReLU's zeros) does not flatten the rest
        return ph * math.log1p(max(c, 0.0)) / math.log1p(top)

    for b, c in enumerate(golden):
        bh = scale(c)
        out.append(f'<rect class="golden" x="{ml + b * bw:.2f}" y="{mt + ph - bh:.2f}" width="{max(bw - 0.5, 0.5):.2f}" '
                   f'height="{bh:.2f}" fill="{COLORS["golden"]}" fill-opacity="0.55"/>')
    pts = []
    for b, c in enumerate(ref):
        y = mt + ph - scale(c)
        pts.append(f"{ml + b * bw:.2f},{y:.2f} {ml + (b + 1) * bw:.2f},{y:.2f}")
    out.append(f'<polyline class="reference" points="{" ".join(pts)}" fill="none" '
               f'stroke="{COLORS["reference"]}" stroke-width="1.6"/>')
    out.append(f'<text x="{ml - 4}" y="{mt + 8}" class="tick" text-anchor="end">{_fmt(top)}</text>'
               f'<text x="{w - mr}" y="16" class="tick" text-anchor="end">count, log scale</text>')
    out.append(f'<text x="{ml - 4}" y="{mt + ph}" class="tick" text-anchor="end">0</text>')
    for frac, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
        v = edges[0] + frac * (edges[-1] - edges[0])
        out.append(f'<text x="{ml + frac * pw:.1f}" y="{mt + ph + 14}" class="tick" '
                   f'text-anchor="{anchor}">{_fmt(v, 4)}</text>')
    ly = hgt - 6
    out.append(f'<rect x="{ml}" y="{ly - 9}" width="12" height="9" fill="{COLORS["golden"]}" fill-opacity="0.55"/>'
               f'<text x="{ml + 16}" y="{ly}" class="tick">golden (irgen/TVM)</text>'
               f'<line x1="{ml + 150}" y1="{ly - 4}" x2="{ml + 164}" y2="{ly - 4}" '
               f'stroke="{COLORS["reference"]}" stroke-width="1.6"/>'
               f'<text x="{ml + 168}" y="{ly}" class="tick">reference</text>')
    return head + "".join(out) + "</svg>"


# ------------------------------------------------------------------ page

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
  margin:20px 28px;color:#1f2933;background:#fff}
h1{font-size:22px;margin:0 0 8px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d9e2ec;padding-bottom:4px}
code,.mono{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:12px;word-break:break-all}
.verdict{display:inline-block;padding:2px 12px;border-radius:4px;color:#fff;font-weight:700;margin-right:8px}
.verdict.pass{background:#1b7f5f}.verdict.fail{background:#c81d32}
.skipped{font-size:60%;font-weight:400;color:#8a5a00;margin-right:8px}
table.kv td{padding:1px 10px 1px 0;vertical-align:top}table.kv td:first-child{color:#52606d;white-space:nowrap}
.counts span{margin-right:16px}.problems li,.notes li{margin:2px 0;overflow-wrap:anywhere}
.scroll{overflow:auto;max-height:85vh;border:1px solid #e4e7eb}.tablewrap{overflow-x:auto;max-width:100%}
table.kv{table-layout:fixed;width:100%}table.kv td:first-child{width:92px}table.kv td{overflow-wrap:anywhere}
svg text{font-size:11px;fill:#1f2933}svg .nname{font-size:12px;font-weight:600}svg .nsub{font-size:10.5px;fill:#52606d}
svg .ptitle{font-size:12px;font-weight:600}svg .psub{font-size:10.5px;fill:#3e4c59}svg .tick{font-size:10px;fill:#52606d}svg .na{font-size:10px;fill:#7b8794}
svg .rlabel.fail{fill:#c81d32;font-weight:600}svg .edge{fill:none;stroke:#90a4ae;stroke-width:1.2}
svg .edge.skip{stroke-dasharray:4 3}svg .grid{stroke:#d5dde6;stroke-width:1}svg .thr{stroke:#1f2933;stroke-width:1.5}
svg rect.bar,svg rect.plot{shape-rendering:crispEdges}
table.layers{border-collapse:collapse;font-size:11.5px}
table.layers th,table.layers td{border:1px solid #e4e7eb;padding:2px 3px;text-align:right;white-space:nowrap}
table.layers th{background:#f5f7fa;cursor:pointer;user-select:none;vertical-align:bottom;font-weight:600}
table.layers td.l,table.layers th.l{text-align:left}table.layers td.name{max-width:240px;overflow:hidden;text-overflow:ellipsis}
td.chk.fail{color:#c81d32;font-weight:600}td.chk.unsupported,td.chk.missing{color:#7b8794}
.st{font-weight:600}.st.pass{color:#1b7f5f}.st.fail{color:#c81d32}.st.unsupported,.st.missing{color:#7b8794}
tr.fail{background:#fff5f6}tr:target{outline:2px solid #4c72b0}
.hists{display:flex;flex-wrap:wrap;gap:12px}.note{color:#52606d;font-size:12px}
"""

# Click a heading to sort by that column (numbers by data-v); the page works without it.
_JS = """
document.querySelectorAll("table.layers th").forEach(function (th, col) {
  th.addEventListener("click", function () {
    var body = th.closest("table").tBodies[0], rows = Array.prototype.slice.call(body.rows);
    var dir = th.dataset.dir === "asc" ? -1 : 1; th.dataset.dir = dir === 1 ? "asc" : "desc";
    rows.sort(function (a, b) {
      var x = a.cells[col].dataset.v, y = b.cells[col].dataset.v;
      var nx = parseFloat(x), ny = parseFloat(y);
      if (!isNaN(nx) && !isNaN(ny)) return dir * (nx - ny);
      return dir * String(x).localeCompare(String(y));
    });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
document.body.classList.add("js-ready");
"""


def _csp() -> str:
    digest = base64.b64encode(hashlib.sha256(_JS.encode()).digest()).decode()
    return f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'sha256-{digest}'"


def _cell(text: Any, v: Any = None, cls: str = "") -> str:
    sort = _fmt(v, 17) if _num(v) is not None else (v if v is not None else "")
    if sort == "\u2014":
        sort = ""
    c = f' class="{cls}"' if cls else ""
    return f'<td{c} data-v="{_e(sort)}">{_e(text)}</td>'


def _drift_text(e2e: dict) -> str:
    """A source check's end-to-end difference (drift): "exact", "3 LSB" or a float max |err|."""
    if e2e.get("exact") is True:
        return "exact"
    lsb = _num(e2e.get("max_lsb"))
    return f"{_fmt(lsb)} LSB" if lsb is not None else _fmt(e2e.get("max_abs"))


def _source_html(result: dict) -> tuple[str, str]:
    """(the verdict's addition, the header's lines) about the source check: skipped and why,
    or the runtime and kernels it ran and the end-to-end drift with its first layer."""
    src = _dict(result.get("source"))
    if src.get("skipped"):
        why = _e(src.get("skipped"))
        return (f'<span id="source-skipped" class="skipped">(source check skipped: {why})</span>',
                f"<b>skipped</b>: {why}")
    if not src.get("ran"):
        return "", ""
    line = _e(src.get("runtime") or "the source runtime")
    d = _dict(src.get("end_to_end"))
    first = _dict(d.get("first"))
    if first:
        beyond = _dict(d.get("first_beyond_max_lsb"))
        line += (f'<br><span id="drift">end-to-end drift (not a failure: the verdict is per layer, each recomputed '
                 f'from the runtime\'s own inputs): {_e(_fmt(d.get("layers"), 6))} layer(s) differ, up to '
                 f'{_e(_fmt(d.get("max_lsb"), 6))} LSB; first at <a href="#layer-{_e(first.get("index", ""))}">'
                 f'<code>{_e(first.get("layer"))}</code></a>'
                 + (f' ({_e(_fmt(first.get("max_lsb"), 6))} LSB)' if first.get("max_lsb") is not None else "")
                 + (f'; first beyond max_lsb at <code>{_e(beyond.get("layer"))}</code> '
                    f'({_e(_fmt(beyond.get("max_lsb"), 6))} LSB)' if beyond else "") + "</span>")
    elif d:
        line += '<br><span id="drift">end to end: every compared layer equals the source runtime</span>'
    return "", line


def _short_cell(text: str, n: int, cls: str) -> str:
    """A table cell of ``text`` shortened to ``n`` characters (:func:`_short_name`), the full text on hover."""
    short = _short_name(text, n)
    title = f' title="{_e(text)}"' if short != text else ""
    return f'<td class="{cls}" data-v="{_e(text)}"{title}>{_e(short)}</td>'


def _table(ordered: list[tuple[int, dict]], modes: list[str]) -> str:
    """Layers worst first; per check its error (coloured by the check's status; the message on
    hover), exact share, 1 - cosine and SQNR. Narrow enough for a 1280-pixel window with three checks."""
    schemes = any(layer.get("scheme") for _, layer in ordered)  # a float model has no scheme column
    e2e_col = any(_dict(_dict(layer.get("checks")).get("source")).get("end_to_end") for _, layer in ordered)
    head = [("#", ""), ("layer", ""), ("op", ""), ("dtype", "")] + [("scheme", "")] * schemes + [("status", "")]
    for check in modes:
        head += [(check, "error"), (check, "exact"), (check, "1\u2212cos"), (check, "SQNR")]
        if check == "source" and e2e_col:
            head.append(("source", "end to end"))
    rows = []
    for rank, (i, layer) in enumerate(ordered):
        status = _status(layer.get("status"))
        name = str(layer.get("name"))
        op = str(layer.get("op") or "")
        cells = [_cell(i, i), _short_cell(name, 32, "l name"), _short_cell(op, 13, "l"), _cell(layer.get("dtype"), None, "l")]
        cells += [_cell(layer.get("scheme") or "", None, "l")] * schemes
        cells.append(_cell(status, _STATUS_RANK.get(status), f"st {status}"))
        for check in modes:
            m = _dict(_dict(layer.get("checks")).get(check))
            st = _status(m.get("status")) if m else "missing"
            v, unit = _error(layer, m)
            share = _num(m.get("exact_share"))
            cos = _cosine(m)
            text = (f"{_fmt(v)} LSB" if unit == "LSB" else _fmt(v)) if v is not None else ("n/a" if st != "pass" else "\u2014")
            tip = f"{check}: {st}" + (f" \u2014 {m.get('message')}" if m.get("message") else "")
            cells += [
                f'<td class="chk {st}" data-v="{_e(_fmt(v, 17) if v is not None else "")}" title="{_e(tip)}">'
                f'{_e(text)}</td>',
                _cell("\u2014" if share is None else f"{share * 100:.2f}%", share),
                f'<td data-v="{_e(_fmt(cos, 17) if cos is not None else "")}" title="cosine {_e(_fmt_cos(cos))}">'
                f'{_e(_fmt(None if cos is None else max(0.0, 1.0 - cos), 2))}</td>',  # as charted: cos > 1 is rounding
                _cell(_fmt(m.get("sqnr_db"), 4), m.get("sqnr_db")),
            ]
            if check == "source" and e2e_col:
                e2e = _dict(m.get("end_to_end"))
                cells.append(_cell(_drift_text(e2e) if e2e else "\u2014",
                                   None if not e2e else (0 if e2e.get("exact") is True else _num(e2e.get("max_lsb")))))
        rows.append(f'<tr id="layer-{i}" class="{status}" data-rank="{rank}">' + "".join(cells) + "</tr>")
    tips = {"error": "max |golden \u2212 reference| (LSB for integer layers)", "exact": "share of elements equal",
            "SQNR": "signal-to-quantization-noise ratio, dB", "1\u2212cos": "1 \u2212 cosine similarity"}
    left = {"layer", "op", "dtype", "scheme"}
    ths = "".join(f'<th class="{"l" if a in left and not b else ""}" title="{_e(tips.get(b, ""))}">{_e(a)}'
                  + (f"<br>{_e(b)}" if b else "") + "</th>" for a, b in head)
    return (f'<div class="tablewrap"><table id="layer-table" class="layers"><thead><tr>{ths}</tr></thead><tbody>'
            + "".join(rows) + "</tbody></table></div>")


def _notes_html(result: dict) -> str:
    """Every note of the result (a check skipped and why, where calibration data came from, ...)."""
    notes = [n for n in _list(result.get("notes")) if n is not None]
    if not notes:
        return '<p id="notes" class="note">No notes.</p>'
    return '<ul id="notes" class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>"


def _drift_html(drift: dict[str, dict | None]) -> str:
    """The header's line on where each chain starts to drift, linked to its table row."""
    parts = []
    for check, start in drift.items():
        if start is None:
            parts.append(f'<span id="drift-{_e(check)}"><b>{_e(check)}</b>: no drift</span>')
        else:
            parts.append(f'<span id="drift-{_e(check)}"><b>{_e(check)}</b>: from '
                         f'<a href="#layer-{_e(start["index"])}" title="{_e(start["name"])}">'
                         f'<code>{_e(_short_name(start["name"], 48))}</code></a> (#{_e(start["index"])}): '
                         f'{_e(start["why"])}</span>')
    return "<br>".join(parts) + f'<details class="note"><summary>the rule</summary>{_e(DRIFT_RULE)}</details>'


def render_report(result: dict) -> str:
    """The report page of an ``irgen verify`` result, as a string."""
    result = _dict(result)
    layers = _layers(result)
    modes = _modes(result, layers)
    thresholds = _dict(result.get("thresholds"))
    verdict = "pass" if result.get("passed") is True else "fail"
    ordered_ir = list(enumerate(layers))
    ordered_worst = sorted(ordered_ir, key=lambda il: (_badness(il[1], modes, thresholds), il[0]))
    title = f"irgen verify: {verdict.upper()} \u2014 {Path(str(_dict(result.get('model')).get('path') or '?')).name}"
    drift = {check: _drift_start(ordered_ir, check, thresholds) for check in modes if check in ("entire", "source")}
    skipped_html, kv_html = _summary_rows(result, modes, thresholds, drift)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_csp()}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title><style>{_CSS}</style></head>
<body>
<header id="summary">
<h1><span id="verdict" class="verdict {verdict}">{verdict.upper()}</span>{skipped_html}irgen verify report</h1>
<table class="kv">{kv_html}</table>
<p class="counts">{_counts_html(_dict(result.get("summary")))}</p>
<h2>Problems</h2>
{_problems_html(result)}
<h2>Notes</h2>
{_notes_html(result)}
</header>
<section><h2>Per-layer error</h2>
<p class="note">One row per layer in IR order. Hover a bar for its values; click a name for its table row.</p>
<div class="scroll">{_chart_svg(ordered_ir, modes, thresholds, {k: v for k, v in drift.items() if v})}</div></section>
<section><h2>Layer graph</h2>
<p class="note">Layers in IR order, top to bottom; edges from each layer's inputs (dashed: skip connections);
colour = status. Click a box for its table row.</p>
<div class="scroll">{_graph_svg(layers)}</div></section>
<section><h2>Layers, worst first</h2>
<p class="note">Click a heading to sort; hover a shortened name for the full one, an error for its check's message.</p>
{_table(ordered_worst, modes)}</section>
<section id="histograms"><h2>Histograms: golden vs reference</h2>
<div class="hists">{_histograms_html(result, ordered_worst)}</div></section>
<script>{_JS}</script>
</body></html>
"""


def _summary_rows(result: dict, modes: list[str], thresholds: dict, drift: dict[str, dict | None]) -> tuple[str, str]:
    """The header's skipped-source badge (or ``""``) and the rows of its key-value table: model,
    sha256, output, producer, checks, thresholds, and the source runtime and chain drift when
    there are any."""
    model = _dict(result.get("model"))
    producer = _dict(result.get("producer"))
    kv = [("model", f"<code>{_e(str(model.get('path') or '?'))}</code>"),
          ("sha256", f"<code>{_e(model.get('sha256') or '?')}</code>"),
          ("output", f"<code>{_e(result.get('out') or '?')}</code>"),
          ("producer", _e(", ".join(f"{k} {v}" for k, v in producer.items() if v is not None) or "?")),
          ("checks", _e(", ".join(modes) or "none")),
          ("thresholds", _e(", ".join(f"{k} {_fmt(v, 6)}" for k, v in thresholds.items()) or "?"))]
    skipped_html, source_html = _source_html(result)
    if source_html:
        kv.append(("source", source_html))
    if drift:
        kv.append(("chain drift", _drift_html(drift)))
    return skipped_html, "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in kv)


def _counts_html(summary: dict) -> str:
    """The summary's counts (layers, passed, failed, unsupported) and time, as they are given."""
    counts = "".join(f'<span>{_e(k)}: <b>{_e(_fmt(summary.get(k), 4))}</b></span>'
                     for k in ("layers", "passed", "failed", "unsupported") if k in summary)
    if _num(summary.get("seconds")) is not None:
        counts += f'<span>time: <b>{_num(summary.get("seconds")):.1f} s</b></span>'
    return counts


def _problems_html(result: dict) -> str:
    """The result's problems as a list (check, layer, message), or a note that there are none."""
    problems = [p for p in _list(result.get("problems")) if isinstance(p, dict)]
    if not problems:
        return '<p id="problems" class="note">No problems.</p>'
    items = "".join(
        f'<li><b>{_e(p.get("check") or "?")}</b>'
        + (f' <code>{_e(p.get("layer"))}</code>' if p.get("layer") is not None else "")
        + f": {_e(p.get('message'))}</li>" for p in problems)
    return f'<ul id="problems" class="problems">{items}</ul>'


def _histograms_html(result: dict, ordered_worst: list[tuple[int, dict]]) -> str:
    """The result's histograms, worst layer first (then by name), or a note that there are none."""
    hists = _dict(result.get("histograms"))
    rank = {str(layer.get("name")): r for r, (_, layer) in enumerate(ordered_worst)}
    hist_names = sorted(hists, key=lambda n: (rank.get(n, len(rank)), n))
    hist_html = "".join(_histogram_svg(k, n, _dict(hists[n])) for k, n in enumerate(hist_names))
    return hist_html or '<p class="note">No histograms in this result.</p>'


def write_report(result: dict, path: str | os.PathLike) -> Path:
    """Write ``render_report(result)`` to ``path`` atomically (temp file in the same folder, then rename)."""
    return write_html(render_report(result), path)


def write_html(text: str, path: str | os.PathLike) -> Path:
    """Write the page ``text`` to ``path`` atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())  # mkstemp's 0600 -> what open() would give, the umask followed
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path
