"""``irgen.report``: the verify report as one self-contained HTML file.

The results are ``irgen.verify.verify_output``'s on real irgen outputs:
``examples/tiny_cnn.onnx`` (float; a copy with one golden activation file
corrupted, for a failing result; the same with its model gone, for a skipped
source check), a QDQ int8 ONNX model and a full-int8 TFLite model, each verified
once per module. The browser tests open the reports in headless Chromium (the
distribution's ``/usr/bin/chromium``, which ``.ci/run`` installs) at 1280 pixels,
check that the page logged nothing to the console and that its script ran,
measure the page's width with a script added to a copy of the page (no
horizontal overflow), and find the error chart's bars in the screenshot by
their colours. With ``IRGEN_REPORT_SCREENSHOT`` (a folder, or a file name whose
stem each screenshot extends) the screenshots are kept to look at.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
import subprocess
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

from html import escape, unescape

from irgen import reference
from irgen.cli import main as irgen_main
from irgen.report import COLORS, DRIFT_RULE, render_report, write_report
from irgen.verify import verify_output

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "tiny_cnn.onnx"
CORRUPTED = "conv3_Conv"  # the layer whose golden output file the failing case scales
HOSTILE = "<script>alert(1)</script>"


# ------------------------------------------------------------------ results


def _verify(out: Path) -> dict:
    """``irgen verify``'s result of ``out``: all three checks (source: ONNX Runtime)."""
    return verify_output(out)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    """irgen's output of the example model, and a copy with one golden output file scaled by 1.5."""
    base = tmp_path_factory.mktemp("report")
    good = base / "good"
    assert irgen_main(["run", str(MODEL), "-o", str(good), "--no-progress"]) == 0
    bad = base / "bad"
    shutil.copytree(good, bad)
    ir = reference.load_ir(bad)
    rec = next(layer for layer in ir["layers"] if layer["name"] == CORRUPTED)["outputs"][0]
    arr = np.load(bad / rec["file"])
    np.save(bad / rec["file"], (arr * 1.5 + 0.25).astype(arr.dtype))
    return {"good": good, "bad": bad}


@pytest.fixture(scope="module")
def good_result(outputs) -> dict:
    return _verify(outputs["good"])


@pytest.fixture(scope="module")
def bad_result(outputs) -> dict:
    return _verify(outputs["bad"])


@pytest.fixture(scope="module")
def skipped_result(outputs, tmp_path_factory) -> dict:
    """The good output verified with its model gone: the source check is skipped, with a note."""
    gone = tmp_path_factory.mktemp("gone") / "tiny_cnn.onnx"
    return verify_output(outputs["good"], model=gone, source_optional=True)


@pytest.fixture(scope="module")
def qdq_result(tmp_path_factory) -> dict:
    """A QDQ int8 ONNX model (per-channel weights, int8 activations): irgen run, then verify."""
    from test_qdq import quantized

    base = tmp_path_factory.mktemp("report_qdq")
    model = quantized("small_cnn", True, "s8", base)
    assert irgen_main(["run", str(model), "-o", str(base / "out"), "--no-progress"]) == 0
    return _verify(base / "out")


@pytest.fixture(scope="module")
def tflite_result(tmp_path_factory) -> dict:
    """A full-int8 TFLite model made by TensorFlow's converter: irgen run, then verify (TFLite interpreter)."""
    from test_verify_quantized import _keras_int8

    base = tmp_path_factory.mktemp("report_tflite")
    model = _keras_int8(base, tiny_logits=False)
    out = base / "out"
    assert irgen_main(["run", str(model), "-o", str(out), "--input", str(base / "x.npy"), "--no-progress"]) == 0
    return _verify(out)


def _rename(result: dict, old: str, new: str) -> dict:
    """A copy of ``result`` with layer ``old`` called ``new`` everywhere."""
    r = copy.deepcopy(result)
    for layer in r["layers"]:
        if layer["name"] == old:
            layer["name"] = new
        layer["inputs"] = [new if i == old else i for i in layer["inputs"]]
    if old in r["histograms"]:
        r["histograms"][new] = r["histograms"].pop(old)
    for p in r["problems"]:
        if p.get("layer") == old:
            p["layer"] = new
    return r


def _hostile(result: dict) -> dict:
    r = _rename(result, CORRUPTED, HOSTILE)
    r["model"]["path"] = '"><img src=x onerror=alert(2)>.onnx'
    r["problems"].append({"layer": HOSTILE, "check": "manifest", "message": "</ul><b onclick=x>bold</b>"})
    return r


# ------------------------------------------------------------------ unit tests


def test_real_results(good_result, bad_result):
    """The two results the report tests use are what they are meant to be."""
    assert good_result["passed"] is True and not good_result["problems"]
    assert good_result["modes"] == ["single", "entire", "source"]
    assert all(layer["checks"]["source"] for layer in good_result["layers"])
    assert bad_result["passed"] is False
    by_name = {layer["name"]: layer for layer in bad_result["layers"]}
    assert by_name[CORRUPTED]["status"] == "fail"
    assert {c for c, m in by_name[CORRUPTED]["checks"].items() if m["status"] == "fail"} == {"single", "entire", "source"}
    assert any(p.get("layer") == CORRUPTED for p in bad_result["problems"])


def test_passing_report_content(good_result):
    html = render_report(good_result)
    assert '<span id="verdict" class="verdict pass">PASS</span>' in html
    for el in ('id="layer-graph"', 'id="error-chart"', 'id="layer-table"', 'id="histograms"', 'id="problems"'):
        assert el in html
    assert good_result["model"]["sha256"] in html
    assert "No problems." in html
    # every layer: one graph box and one table row; one histogram per entry
    n = len(good_result["layers"])
    assert len(re.findall(r'<g class="node [a-z]+" id="node-\d+"', html)) == n
    assert len(re.findall(r'<tr id="layer-\d+"', html)) == n
    assert html.count('<svg class="histogram"') == len(good_result["histograms"]) > 0
    # the chart draws bars (or exact markers) in the pass colour and none in the fail colour
    chart = html[html.index('id="error-chart"'):]
    chart = chart[:chart.index("</svg>")]
    assert chart.count(f'fill="{COLORS["pass"]}"') >= n and COLORS["fail"] not in chart


def test_failing_report_shows_status_and_problems(bad_result):
    html = render_report(bad_result)
    assert '<span id="verdict" class="verdict fail">FAIL</span>' in html
    problems = html[html.index('id="problems"'):]
    problems = problems[:problems.index("</ul>")]
    assert problems.count("<li>") == len(bad_result["problems"]) > 0
    assert CORRUPTED in problems
    # worst first: the table starts with a failing layer
    first = re.search(r'<tr id="layer-\d+" class="(\w+)" data-rank="0">', html)
    assert first and first.group(1) == "fail"
    assert 'class="bar fail" ' in html and 'class="node fail"' in html


def test_hostile_strings_are_escaped(bad_result):
    html = render_report(_hostile(bad_result))
    assert html.count("<script") == 1  # the report's own script, nothing injected
    assert HOSTILE not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<img" not in html and "<b onclick" not in html
    assert "&lt;img src=x onerror=alert(2)&gt;" in html
    # attribute values are quoted and escaped too (tooltips carry the names)
    assert 'onerror=alert(2)>' not in html


def test_self_contained(bad_result):
    html = render_report(_hostile(bad_result))
    links = [v.strip("\"'") for tag in re.findall(r"<[^>]+>", html)
             for v in re.findall(r"\s(?:src|href|xlink:href|action|data)\s*=\s*(\"[^\"]*\"|'[^']*'|[^\s>]+)", tag)]
    assert links and all(v.startswith("#") for v in links), [v for v in links if not v.startswith("#")]
    assert not re.search(r"https?://", html)
    assert "@import" not in html and not re.search(r"url\((?!#)", html)
    assert "default-src 'none'" in html  # and the browser is told to load nothing else


def test_write_report_atomic(good_result, bad_result, tmp_path, monkeypatch):
    path = tmp_path / "report.html"
    assert write_report(good_result, path) == path
    first = path.read_text()
    assert first == render_report(good_result)
    write_report(bad_result, str(path))  # replaces
    assert "verdict fail" in path.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_report(good_result, path)
    assert "verdict fail" in path.read_text()  # old report untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temp file left


def test_tolerates_none_and_extra_keys():
    layer = {"name": "l0", "op": None, "dtype": None, "integer": None, "scheme": None, "inputs": None,
             "checks": {"single": None, "entire": {"status": "unsupported", "message": None}, "source": None},
             "status": "unsupported", "extra": 1}
    result = {"irgen_verify": 1, "model": None, "producer": None, "modes": None, "thresholds": None,
              "passed": False, "summary": None, "problems": None, "layers": [layer, None],
              "histograms": {"l0": {"check": "single", "edges": [0.0], "golden": [], "reference": None},
                             "ghost": None}, "new_key": {"x": 1}}
    html = render_report(result)
    assert "histogram data malformed" in html and 'id="error-chart"' in html
    assert render_report({})  # even an empty dict renders


def test_large_model_layout():
    """150 layers with skip connections: one box per layer, a bounded width, a column-like height."""
    layers = []
    for i in range(150):
        inputs = ["input"] if i == 0 else [f"l{i - 1}"] + ([f"l{i - 3}"] if i % 3 == 0 and i >= 3 else [])
        m = {"status": "pass", "tensor": f"t{i}", "elements": 10, "exact_share": 0.5, "max_abs": 10.0 ** -(i % 9),
             "max_rel": 0.0, "max_lsb": None, "cosine": 1 - 10.0 ** -(i % 12), "sqnr_db": 80.0, "message": None}
        layers.append({"name": f"l{i}", "op": "conv2d", "dtype": "float32", "integer": False, "scheme": None,
                       "inputs": inputs, "checks": {"single": m, "entire": m, "source": None}, "status": "pass"})
    html = render_report({"passed": True, "modes": ["single", "entire"], "layers": layers,
                          "thresholds": {"max_lsb": 1, "atol": 1e-5, "rtol": 1e-4, "min_cosine": 0.999}})
    graph = re.search(r'<svg id="layer-graph"[^>]* width="(\d+)" height="(\d+)"', html)
    width, height = int(graph.group(1)), int(graph.group(2))
    assert width <= 1200 and 150 * 36 < height < 150 * 80
    assert len(re.findall(r'id="node-\d+"', html)) == 150
    assert html.count('class="edge skip"') == 49


def _mobilenet_names() -> list[str]:
    """108 layer names as torchvision's MobileNetV3 exports them through ONNX: each part repeats its module path."""
    names = []
    for b in range(1, 13):
        blk = f"features_features.{b}_block_block"
        names += [f"{blk}.0_block.0.0_Conv", f"{blk}.0_block.0.2_HardSwish", f"{blk}.1_block.1.0_Conv",
                  f"{blk}.1_block.1.2_HardSwish", f"{blk}.2_avgpool_GlobalAveragePool", f"{blk}.2_fc1_Conv",
                  f"{blk}.2_fc2_Conv", f"{blk}.2_scale_activation_HardSigmoid", f"{blk}.3_block.3.0_Conv"]
    return names


def _metric(err: float | None, cos: float | None, lsb: int | None = None, status: str = "pass", **extra) -> dict:
    return {"status": status, "tensor": "t", "elements": 64, "exact_share": 0.5 if err else 1.0, "exact": err == 0,
            "max_abs": err, "max_rel": err, "max_lsb": lsb, "cosine": cos, "sqnr_db": 120.0, "message": None, **extra}


def _chain(entire: list[float], single: list[float], atol: float = 1e-5) -> dict:
    """A float chain: one layer per error, max|golden| 1 (max_rel = max_abs), so each limit is ``atol``."""
    layers = [{"name": f"l{i}", "op": "conv2d", "dtype": "float32", "integer": False, "scheme": None,
               "inputs": [f"l{i - 1}" if i else "input"], "status": "pass",
               "checks": {"single": _metric(s, 1.0), "entire": _metric(e, 1.0), "source": None}}
              for i, (e, s) in enumerate(zip(entire, single))]
    return {"passed": True, "modes": ["single", "entire"], "layers": layers,
            "thresholds": {"max_lsb": 1, "atol": atol, "rtol": 1e-4, "min_cosine": 0.999}}


def _large(names: list[str]) -> dict:
    """A quantized-looking result of ``names`` (int8, a scheme, all three checks with the source
    check's end-to-end drift): the widest table and chart the report draws."""
    layers = []
    for i, name in enumerate(names):
        if "GlobalAveragePool" in name:  # a float layer between integer ones, as in a QOperator model
            m = _metric(5.960464e-08, 1 - 4.4e-15)
            src = {**m, "exact_share": 0.7513, "verdict": "end_to_end", "end_to_end": {**m, "exact": False}}
            layers.append({"name": name, "op": "global_avg_pool2d", "dtype": "float32", "integer": False,
                           "scheme": None, "inputs": [names[i - 1]], "status": "pass",
                           "checks": {"single": _metric(2.980232e-08, 1 + 2.2e-16),
                                      "entire": _metric(2.980232e-08, 1 - 5.6e-16), "source": src}})
            continue
        local = _metric(0.0, 1.0, 0)
        e2e = {k: local[k] for k in ("status", "exact", "exact_share", "max_lsb", "max_abs", "cosine", "sqnr_db")}
        e2e.update(max_lsb=i % 3, max_abs=0.0123 * (i % 3), exact=i % 3 == 0, exact_share=0.987654)
        src = {**local, "verdict": "local", "end_to_end": e2e, "local": {"exact_share": 1.0, "max_lsb": 0}}
        layers.append({"name": name, "op": "conv2d", "dtype": "int8", "integer": True, "scheme": "tflite-int8",
                       "inputs": [names[i - 1] if i else "input"], "status": "pass",
                       "checks": {"single": _metric(float(i % 2), 1 - 3.58e-7, i % 2),
                                  "entire": _metric(float(i % 2), 1 - 3.58e-7, i % 2), "source": src}})
    return {"passed": True, "modes": ["single", "entire", "source"], "layers": layers,
            "notes": ["a note long enough to wrap: " + "calibration data from /a/long/path/" * 12],
            "model": {"path": "/models/" + "very_long_directory_name/" * 8 + "mobilenet_v3_large.onnx"},
            "thresholds": {"max_lsb": 1, "atol": 1e-5, "rtol": 1e-4, "min_cosine": 0.999}}


def test_long_names_are_shortened_to_their_distinctive_part_with_the_full_name_on_hover():
    """MobileNetV3's names all begin ``features_features.1_block_b``: cut at 28 characters
    they read alike. The chart's labels and the table's names keep what tells them apart,
    are distinct, and carry the full name as a tooltip wherever they shorten it."""
    names = _mobilenet_names()
    assert len({n[:27] for n in names}) <= 12  # what plain truncation shows: one label per block
    html = render_report(_large(names))
    labels = re.findall(r'class="rlabel \w+">([^<]*)<title>([^<]*)</title>', html)
    assert [full for _, full in labels] == names
    assert all(len(label) <= 32 for label, _ in labels)
    assert len({label for label, _ in labels}) == len(names), "shortened labels collide"
    assert sum(label != full for label, full in labels) == len(names)  # all were too long
    cells = re.findall(r'<td class="l name" data-v="([^"]*)"(?: title="([^"]*)")?>([^<]*)</td>', html)
    assert sorted(full for full, _, _ in cells) == sorted(names)
    for full, title, text in cells:
        assert len(text) <= 32 and (title == full if text != full else title == "")
    assert len({text for _, _, text in cells}) == len(names)
    # the graph's boxes shorten too; their tooltip starts with the full name
    boxes = re.findall(r'<title>#\d+ ([^\n<]*)\n', html)
    assert boxes == names


def test_errors_below_the_log_floor_are_marked():
    """0 draws a diamond, a positive value under the axis floor a left-pointing triangle
    (with its value and the floor in the tooltip), each once per panel, and the key shows both."""
    result = _chain([0.0, 1e-12, 1e-3], [0.0, 1e-12, 1e-3])
    result["layers"][1]["checks"]["entire"]["cosine"] = 1 - 1e-13
    result["modes"] = ["entire"]
    html = render_report(result)
    chart = html[html.index('id="error-chart"'):]
    chart = chart[:chart.index("</svg>")]
    assert chart.count('class="bar exact"') == 3  # l0's error and 1 - cosine; l2's 1 - cosine is 0 too
    below = re.findall(r'<path class="bar below pass"[^>]*><title>([^<]*)</title>', chart)
    assert len(below) == 2, below  # l1's error, 1e-12, and its 1 - cosine, 1e-13
    assert "max error 1e-12 abs" in below[0] and "below the axis floor 1e-8" in below[0]
    assert "1 \u2212 cosine 1e-13" in below[1] and "below the axis floor 1e-8" in below[1]
    assert len(re.findall(r'<rect class="bar pass"', chart)) == 1  # l2's error: a real bar
    legend = chart[chart.index('id="chart-legend"'):]
    assert 'class="key exact"' in legend and 'class="key below"' in legend and "below the axis floor" in legend


def test_drift_start_follows_the_stated_rule():
    """Entire errors climbing along a chain: drift starts where one grows past 10x its own
    single-layer error and a tenth of the limit; without that growth, where one passes its limit;
    none when neither happens. The header links the layer, the chart marks its row."""
    single = [1e-7] * 6
    html = render_report(_chain([1e-7, 2e-7, 5e-7, 3e-6, 2e-5, 2e-5], single))
    head = html[html.index('id="drift-entire"'):]
    head = head[:head.index("</span>")]
    assert 'href="#layer-3"' in head and "grows beyond its own single-layer error 1e-07" in head, head
    assert html.count('class="drift-mark"') == 1 and html.count('class="drift-row"') == 2
    assert "chain drifts from l3" in html and html.count(escape(DRIFT_RULE)) == 1  # the rule, stated in the header
    width = float(re.search(r'<svg id="error-chart"[^>]* width="([\d.]+)"', html).group(1))
    lines = textwrap.wrap("Drift: " + DRIFT_RULE, int((width - 16) / 5.2))
    assert all(f">{escape(line)}</text>" in html for line in lines)  # and in the chart's key
    html = render_report(_chain([1e-7, 2e-7, 5e-7, 3e-6, 2e-5, 2e-5], [1e-6] * 6))
    head = html[html.index('id="drift-entire"'):]
    assert 'href="#layer-4"' in head[:head.index("</span>")] and "above its limit 1e-05" in head
    html = render_report(_chain([1e-7, 2e-7, 5e-7, 9e-7], single[:4]))
    assert '<b>entire</b>: no drift' in html and 'class="drift-mark"' not in html
    # integer layers: any LSB beyond the layer's own, here the source check's end to end against its local error
    result = _large(_mobilenet_names()[:5])
    html = render_report(result)
    head = html[html.index('id="drift-source"'):]
    assert 'href="#layer-1"' in head[:head.index("</span>")] and "1 LSB grows beyond its own single-layer error 0 LSB" in head


def test_drift_start_of_real_results(good_result, bad_result, qdq_result):
    """The real results: a float model verified against ONNX Runtime does not drift; the corrupted
    golden file is where the entire chain first exceeds its limit; ORT's int8 kernels equal irgen's."""
    html = render_report(good_result)
    assert '<b>entire</b>: no drift' in html and '<b>source</b>: no drift' in html
    html = render_report(bad_result)
    index = [layer["name"] for layer in bad_result["layers"]].index(CORRUPTED)
    head = html[html.index('id="drift-entire"'):]
    head = head[:head.index("</span>")]
    assert f'href="#layer-{index}"' in head and "above its limit" in head, head
    assert '<b>source</b>: no drift' in render_report(qdq_result)


def test_every_note_is_shown(skipped_result, qdq_result):
    """A source check skipped (its model is gone) is in the result's notes, and the report lists
    every note, escaped, besides the verdict's "source check skipped"."""
    notes = skipped_result["notes"]
    assert any(n.startswith("source check skipped: model ") and "no such file" in n for n in notes), notes
    r = copy.deepcopy(skipped_result)
    r["notes"].append("calibration from " + HOSTILE)
    html = render_report(r)
    block = html[html.index('<ul id="notes"'):]
    block = block[:block.index("</ul>")]
    assert block.count("<li>") == len(r["notes"]) and all(escape(n) in block for n in r["notes"])
    assert HOSTILE not in html and 'id="source-skipped"' in html
    assert '<p id="notes" class="note">No notes.</p>' in render_report(qdq_result) and not qdq_result["notes"]


# ------------------------------------------------------------------ browser

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars",
    "--force-color-profile=srgb", "--force-device-scale-factor=1",
    "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000",
]
# What Chromium logs for the page: console messages (uncaught exceptions,
# console.error, CSP refusals) and resources it could not load.
PAGE_LOG = re.compile(r"CONSOLE[:(]\d+|Refused to|Failed to load|ERR_[A-Z_]+.*file://|Uncaught")


def _chromium() -> str:
    exe = shutil.which("chromium") or ("/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (CI must install it: apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium); outside CI this test is skipped")
    return exe


def _browse(page: Path, tmp: Path, *args: str) -> tuple[str, list[str]]:
    """Open ``page`` in a fresh headless Chromium; returns (stdout, log lines about the page)."""
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    proc = subprocess.run([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "LANG": "C.UTF-8"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, [line for line in proc.stderr.splitlines() if PAGE_LOG.search(line)]


def _png_rgb(path: Path) -> np.ndarray:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) to an (h, w, 3) array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + n
    bpp = 3 if ctype == 2 else 4
    stride = w * bpp
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, stride + 1)
    img = np.zeros((h, stride), np.uint8)
    prev = np.zeros(stride, np.uint8)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:]
        if f == 0:
            cur = line.copy()
        elif f == 2:
            cur = line + prev
        elif f == 1:  # Sub: a running sum per channel (mod 256)
            cur = np.cumsum(line.reshape(w, bpp), axis=0, dtype=np.uint8).reshape(stride)
        else:  # Average / Paeth: sequential along the row
            cur = bytearray(line.tobytes())
            up = prev.tobytes()
            for i in range(stride):
                a = cur[i - bpp] if i >= bpp else 0
                b = up[i]
                if f == 3:
                    cur[i] = (cur[i] + ((a + b) >> 1)) & 255
                else:
                    c = up[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            cur = np.frombuffer(bytes(cur), np.uint8)
        img[y] = prev = cur
    return img.reshape(h, w, bpp)[:, :, :3]


def _rgb(hex_color: str) -> np.ndarray:
    return np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)], np.uint8)


def _mask(img: np.ndarray, hex_color: str) -> np.ndarray:
    return np.all(img == _rgb(hex_color), axis=2)


def test_browser_catches_page_errors(tmp_path):
    """The log check of the browser test is not blind: a script error, a
    console.error and a refused external image are all caught."""
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><head><meta http-equiv=\"Content-Security-Policy\" "
                    "content=\"default-src 'none'; script-src 'unsafe-inline'\"></head><body>"
                    "<img src=\"https://example.invalid/x.png\"><script>console.error('boom');"
                    "notDefined();</script></body></html>")
    _, log = _browse(page, tmp_path, "--dump-dom")
    text = "\n".join(log)
    assert "boom" in text and "notDefined" in text and "example.invalid" in text, text


def test_report_in_headless_chromium(bad_result, tmp_path):
    """The report of a failing real result (with a hostile layer name) opens
    without a single console message; its script runs; the screenshot shows
    the error chart with bars in the pass and fail colours inside its plot areas."""
    page = write_report(_hostile(bad_result), tmp_path / "report.html")

    dom, log = _browse(page, tmp_path, "--dump-dom")
    assert not log, "Chromium logged about the page:\n" + "\n".join(log)
    assert 'class="js-ready"' in dom, "the report's script did not run"
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom and HOSTILE not in dom

    shot = tmp_path / "report.png"
    _, log = _browse(page, tmp_path, "--window-size=1280,1000", f"--screenshot={shot}")
    assert not log, "Chromium logged about the page:\n" + "\n".join(log)
    img = _png_rgb(shot)
    assert img.shape == (1000, 1280, 3)

    plot = _mask(img, COLORS["plot"])  # the chart's plot areas, and nothing else, have this colour
    assert plot.sum() > 5000, "error chart not visible in the screenshot"
    ys, xs = np.nonzero(plot)
    top, bottom, left, right = ys.min(), ys.max(), xs.min(), xs.max()
    assert bottom - top > 10 * len(bad_result["layers"]) and right - left > 400, (top, bottom, left, right)
    region = img[top:bottom + 1, left:right + 1]
    passed, failed = _mask(region, COLORS["pass"]).sum(), _mask(region, COLORS["fail"]).sum()
    assert passed > 200 and failed > 200, (passed, failed)
    # and the bars are the chart's: outside its box neither colour appears
    outside = _mask(img, COLORS["fail"]).sum() - failed
    assert outside == 0, outside
    _keep(shot, "failing")


# A script added to a copy of a report (its hash joins the page's script-src): it writes the
# page's width, the chart's and the table's boxes, their scroll widths and the notes' text into
# the DOM, which --dump-dom prints.
MEASURE = """(function () {
  function box(el) {
    if (!el) return null;
    var r = el.getBoundingClientRect();
    return {left: r.left, right: r.right, top: r.top, bottom: r.bottom,
            scroll: el.scrollWidth, client: el.clientWidth};
  }
  var d = document.documentElement, chart = document.getElementById("error-chart"),
      table = document.getElementById("layer-table"), notes = document.getElementById("notes");
  var out = {page: d.scrollWidth, window: window.innerWidth, chart: box(chart),
             chartBox: box(chart && chart.parentElement), table: box(table),
             tableBox: box(table && table.parentElement), notes: notes ? notes.innerText : null,
             drift: document.querySelectorAll("#error-chart .drift-mark").length};
  var pre = document.createElement("pre");
  pre.id = "measured";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();"""


def _with_measure(html: str) -> str:
    import base64
    import hashlib

    digest = base64.b64encode(hashlib.sha256(MEASURE.encode()).digest()).decode()
    assert html.count("script-src 'sha256-") == 1
    html = html.replace("script-src ", f"script-src 'sha256-{digest}' ", 1)
    return html.replace("</body>", f"<script>{MEASURE}</script></body>")


def _keep(shot: Path, kind: str) -> None:
    """Keep a screenshot to look at when IRGEN_REPORT_SCREENSHOT names a folder (or a file name)."""
    where = os.environ.get("IRGEN_REPORT_SCREENSHOT")
    if not where:
        return
    where = Path(where)
    if where.suffix.lower() != ".png":
        where.mkdir(parents=True, exist_ok=True)
        where = where / "report.png"
    shutil.copy(shot, where.with_name(f"{where.stem}-{kind}{where.suffix}"))


@pytest.mark.parametrize("kind", ["float", "skipped", "qdq", "tflite", "large"])
def test_report_fits_a_1280_pixel_window(kind, request, tmp_path):
    """Real reports of a float model (all three checks; and with its source check skipped), a QDQ
    int8 and a full-int8 TFLite model, and a 108-layer result with MobileNetV3's names, opened in
    Chromium at 1280 pixels: the page is no wider than the window, neither the chart nor the
    table needs a scrollbar of its own, the notes are on the page, and the screenshot shows the
    chart's plot areas and bars whole, inside the window."""
    result = (_large(_mobilenet_names()) if kind == "large" else
              request.getfixturevalue({"float": "good_result", "skipped": "skipped_result", "qdq": "qdq_result",
                                       "tflite": "tflite_result"}[kind]))
    assert result["passed"], result["problems"]
    page = tmp_path / f"report-{kind}.html"
    page.write_text(_with_measure(render_report(result)), encoding="utf-8")
    shot = tmp_path / f"report-{kind}.png"
    dom, log = _browse(page, tmp_path, "--window-size=1280,1200", "--dump-dom", f"--screenshot={shot}")
    assert not log, "Chromium logged about the page:\n" + "\n".join(log)
    _keep(shot, kind)
    m = re.search(r'<pre id="measured">([^<]*)</pre>', dom)
    assert m, "the measuring script did not run"
    got = json.loads(unescape(m.group(1)))
    assert got["window"] == 1280 and got["page"] <= 1280, got  # no horizontal page overflow
    for key in ("chart", "table"):
        assert got[key]["left"] >= 0 and got[key]["right"] <= 1280, (key, got)
        box = got[key + "Box"]
        assert box["scroll"] <= box["client"], (key, got)  # its own container does not scroll sideways
    assert got["chart"]["right"] - got["chart"]["left"] > 600 and got["table"]["right"] - got["table"]["left"] > 500
    for note in result.get("notes") or []:  # every note, as text on the page
        assert " ".join(note.split()) in " ".join(got["notes"].split()), (note, got["notes"])
    if not result.get("notes"):
        assert got["notes"] == "No notes."
    if kind == "skipped":
        assert "source check skipped: model " in got["notes"]

    img = _png_rgb(shot)
    assert img.shape == (1200, 1280, 3)
    plot = _mask(img, COLORS["plot"])
    assert plot.sum() > 5000, "error chart not visible in the screenshot"
    ys, xs = np.nonzero(plot)
    top, left, right = ys.min(), xs.min(), xs.max()
    assert 0 < left and right < 1280 - 20, (left, right)  # every panel whole, inside the window
    region = img[top:, left:right + 1]
    assert _mask(region, COLORS["pass"]).sum() > 100  # bars and markers in the pass colour
    assert _mask(img, COLORS["fail"]).sum() == 0


def test_integer_model_report(qdq_result):
    """A real quantized (QDQ int8) output: integer layers are charted in LSB and say their scheme."""
    result = qdq_result
    integer = [layer for layer in result["layers"] if layer["integer"]]
    assert integer and result["passed"], result["problems"]
    html = render_report(result)
    assert "max error 0 LSB" in html  # the tooltip of an exact integer layer
    assert html.count(">qdq<") >= len(integer)  # the table's scheme column
    assert '<svg class="histogram"' in html


def test_missing_chromium_skips_outside_ci_and_fails_in_ci(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        _chromium()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must install it"):
        _chromium()
