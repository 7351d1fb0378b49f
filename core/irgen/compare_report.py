"""The HTML report of ``irgen compare``: one self-contained file, in verify's report style.

On top, the verdict and the diagnosis: every locally wrong layer with the signatures its
difference matches (code and evidence), where it differs (channels, rows, columns,
tiles), a per-channel bar chart and a spatial heat map (mismatching values per H x W
position, summed over the other axes). Below, the notes and a table of every layer in IR
order (click a heading to sort). The style sheet, the sorting script and the
Content-Security-Policy are :mod:`irgen.report`'s; every string from the result is
escaped (layer names come from model files).

Element ids: ``summary``, ``verdict``, ``diagnosis``, ``notes``, ``layer-table``; each
local layer's block is ``local-<index>``, its charts ``channels-<index>`` and ``heat-<index>``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from irgen.report import _CSS, _JS, _csp, _e, _fmt, write_html

__all__ = ["render_compare", "write_compare_report"]

_EXTRA_CSS = """
.local{border:1px solid #e4e7eb;border-left:4px solid #c81d32;padding:6px 12px;margin:10px 0}
.local h3{font-size:15px;margin:2px 0 6px}.code{font-weight:700;color:#c81d32}
.charts{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}
.st.equal,.st.within{color:#1b7f5f}.st.differs{color:#c81d32}tr.differs{background:#fff5f6}
"""


def _bars(counts: list[int], index: int) -> str:
    """Mismatching values per channel, one bar each."""
    if not counts:
        return ""
    top = max(max(counts), 1)
    bw = max(2.0, min(14.0, 420.0 / len(counts)))
    w, h = 40 + bw * len(counts), 120
    bars = "".join(f'<rect x="{36 + i * bw:.1f}" y="{10 + 90 * (1 - c / top):.1f}" width="{bw * 0.85:.1f}" '
                   f'height="{90 * c / top:.1f}" fill="#d7263d"><title>channel {i}: {c}</title></rect>'
                   for i, c in enumerate(counts))
    return (f'<svg id="channels-{index}" width="{w:.0f}" height="{h}" role="img" aria-label="per channel">'
            f'<text x="2" y="12" class="tick">{top}</text><text x="2" y="100" class="tick">0</text>{bars}'
            f'<text x="36" y="116" class="tick">mismatches per channel (0..{len(counts) - 1})</text></svg>')


def _heat(grid: list[list[int]], index: int) -> str:
    """The spatial heat map: one cell per (summed) H x W position, darker for more mismatches."""
    if not grid or not grid[0]:
        return ""
    rows, cols = len(grid), len(grid[0])
    cell = max(3.0, min(14.0, 320.0 / max(rows, cols)))
    top = max(max(r) for r in grid) or 1
    cells = "".join(f'<rect x="{x * cell:.1f}" y="{14 + y * cell:.1f}" width="{cell:.1f}" height="{cell:.1f}" '
                    f'fill="#d7263d" fill-opacity="{0.06 + 0.94 * v / top:.2f}"><title>({y}, {x}): {v}</title></rect>'
                    for y, row in enumerate(grid) for x, v in enumerate(row) if v)
    return (f'<svg id="heat-{index}" width="{cols * cell:.0f}" height="{14 + rows * cell:.0f}" role="img" '
            f'aria-label="spatial heat map"><rect x="0" y="14" width="{cols * cell:.1f}" height="{rows * cell:.1f}" '
            f'fill="#eef3f8"/>{cells}<text x="0" y="10" class="tick">mismatches over H x W</text></svg>')


def _where(where: dict) -> str:
    parts = []
    for key in ("channels", "rows", "cols", "tiles"):
        w = where.get(key)
        if w and w.get("count"):
            shown = ", ".join(str(i) for i in w["list"][:16]) + (" ..." if w["count"] > 16 else "")
            size = f" of {w['size'][0]}x{w['size'][1]}" if key == "tiles" else ""
            parts.append(f"{key}{size}: {w['count']} of {w['of']} ({shown})")
    return "; ".join(parts)


def _local(row: dict) -> str:
    i, where = row["index"], row.get("where") or {}
    codes = "".join(f'<li><span class="code">{_e(d["code"])}</span>: {_e(d["detail"])}</li>' for d in row["diagnosis"])
    codes = codes or "<li>no known signature matches this difference</li>"
    local = row.get("local") or {}
    lsb = f", up to {_e(local['max_lsb'])} LSB" if local.get("max_lsb") is not None else ""
    return (f'<div class="local" id="local-{i}"><h3><a href="#layer-{i}">#{i} <code>{_e(row["name"])}</code></a> '
            f'({_e(row["op"])})</h3><p>{_e(local.get("mismatches", row["mismatches"]))} values differ from what the '
            f'layer computes from the device\'s own inputs{lsb}. {_e(_where(where))}</p><ul>{codes}</ul>'
            f'<div class="charts">{_bars(where.get("per_channel") or [], i)}{_heat(where.get("heat") or [], i)}</div></div>')


def _table(rows: list[dict]) -> str:
    head = ["#", "layer", "op", "status", "mismatches", "share", "max err", "cosine", "SQNR dB", "origin", "diagnosis"]
    body = []
    for r in rows:
        o = next((o for o in r["outputs"] if o["status"] == r["status"]), r["outputs"][0])
        err = f"{r['max_lsb']} LSB" if r["max_lsb"] is not None else _fmt(o.get("max_abs"))
        cells = [(r["index"], r["index"]), (r["name"], None), (r["op"], None), (r["status"], None),
                 (r["mismatches"], r["mismatches"]), (f"{100 * r['share']:.2f}%", r["share"]), (err, None),
                 (_fmt(o.get("cosine"), 7), o.get("cosine")), (_fmt(o.get("sqnr_db"), 4), o.get("sqnr_db")),
                 (r["origin"] or "\u2014", None), (", ".join(d["code"] for d in r["diagnosis"]) or "\u2014", None)]
        tds = "".join(f'<td class="{"st " + _e(r["status"]) if k == 3 else ("l" if k in (1, 2, 9, 10) else "")}" '
                      f'data-v="{_e(v if v is not None else t)}">{_e(t)}</td>' for k, (t, v) in enumerate(cells))
        body.append(f'<tr id="layer-{r["index"]}" class="{_e(r["status"])}">{tds}</tr>')
    ths = "".join(f"<th>{_e(h)}</th>" for h in head)
    return (f'<div class="tablewrap"><table id="layer-table" class="layers"><thead><tr>{ths}</tr></thead><tbody>'
            + "".join(body) + "</tbody></table></div>")


def render_compare(result: dict[str, Any]) -> str:
    """The report page of one :func:`irgen.compare.compare_output` result."""
    from irgen.compare import verdict_line

    passed = result.get("passed") is True
    verdict = "pass" if passed else "fail"
    rows = result.get("layers") or []
    local = [r for r in rows if r.get("origin") == "local"]
    producer = result.get("producer") or {}
    kv = [("output", f"<code>{_e(result.get('out'))}</code>"), ("dump", f"<code>{_e(result.get('dump'))}</code>"),
          ("producer", _e(", ".join(f"{k} {v}" for k, v in producer.items() if v is not None) or "?")),
          ("thresholds", _e(", ".join(f"{k} {v}" for k, v in (result.get("thresholds") or {}).items()))),
          ("verdict", _e(verdict_line(result)))]
    kv_html = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in kv)
    diag = "".join(_local(r) for r in local) or '<p class="note">No layer is wrong locally.</p>'
    notes = result.get("notes") or []
    notes_html = ('<ul id="notes" class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>") if notes \
        else '<p id="notes" class="note">No notes.</p>'
    title = f"irgen compare: {verdict.upper()} \u2014 {Path(str(result.get('dump') or '?')).name}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_csp()}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title><style>{_CSS}{_EXTRA_CSS}</style></head>
<body>
<header id="summary">
<h1><span id="verdict" class="verdict {verdict}">{verdict.upper()}</span>irgen compare report</h1>
<table class="kv">{kv_html}</table>
</header>
<section id="diagnosis"><h2>Diagnosis: the layers wrong locally</h2>
<p class="note">Each recomputed from the device's own inputs; the first one is where the hardware goes wrong.</p>
{diag}</section>
<section><h2>Notes</h2>{notes_html}</section>
<section><h2>Layers, in IR order</h2>
<p class="note">Click a heading to sort. Origin: local (wrong from the device's own inputs) or inherited.</p>
{_table(rows)}</section>
<script>{_JS}</script>
</body></html>
"""


def write_compare_report(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write :func:`render_compare` of ``result`` to ``path`` atomically."""
    return write_html(render_compare(result), path)
