"""``irgen.report``: the verify report as one self-contained HTML file.

The results are ``irgen.verify.verify_output``'s on a real irgen output of
``examples/tiny_cnn.onnx`` (and on a copy of it with one golden activation
file corrupted, for a failing result). The browser test opens the report in
headless Chromium (the distribution's ``/usr/bin/chromium``, which ``.ci/run``
installs), checks that the page logged nothing to the console and that its
script ran, and finds the error chart's bars in the screenshot by their
colours.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from irgen import reference
from irgen.cli import main as irgen_main
from irgen.report import COLORS, render_report, write_report
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
    if os.environ.get("IRGEN_REPORT_SCREENSHOT"):  # keep the screenshot to look at
        shutil.copy(shot, os.environ["IRGEN_REPORT_SCREENSHOT"])


def test_integer_model_report(tmp_path):
    """A real quantized (QDQ int8) output: integer layers are charted in LSB and say their scheme."""
    from test_qdq import quantized

    model = quantized("small_cnn", True, "s8", tmp_path)
    out = tmp_path / "out"
    assert irgen_main(["run", str(model), "-o", str(out), "--no-progress"]) == 0
    result = _verify(out)
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
