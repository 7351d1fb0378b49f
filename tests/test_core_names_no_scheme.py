"""Core names no quantization scheme: a scheme's arithmetic, its recompute and its checks live in
its plugin, and core reaches them through the plugin API (``Quantizer.recompute``,
``Quantizer.consistency``), never by a scheme's name.

Every ``.py`` file under ``core/irgen`` is searched for the in-repo schemes' names and the runtimes
whose arithmetic they copy (``qdq``, ``pow2``, ``tflite``, ``ort``, ``onnxruntime``), comments
and docstrings included, and for a branch on a scheme's own record (``"reference": "torch"``). What may name them is listed in :data:`ALLOWED`, each with its reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "core" / "irgen"
#: the schemes' and their runtimes' names, and a branch on a scheme's own record (its torch dialect's)
PATTERN = re.compile(r"qdq|pow2|tflite|\bort\b|onnxruntime|[\"']reference[\"']\)?\s*==\s*[\"']torch", re.IGNORECASE)

#: file (relative to core/irgen) -> (the top-level names whose lines may name them, or None for the
#: whole file; why)
ALLOWED: dict[str, tuple[frozenset[str] | None, str]] = {
    "api.py": (frozenset({"QUANT_DIALECTS"}),
               "the quantization dialects frontends declare and schemes detect: what each model format's "
               "quantize/dequantize ops mean (ONNX QDQ, torch's, TFLite's), not a scheme"),
    "testing/models.py": (None, "the plugin kit's test models: ONNX files quantized in the QDQ format by "
                                "onnxruntime's quantize_static"),
    "testing/conformance.py": (frozenset({"__doc__", "check_scheme", "check_backend"}),
                               "the conformance suite's default model is the kit's ONNX QDQ model "
                               "(testing/models.py)"),
}


def _allowed_lines(path: Path, names: frozenset[str]) -> set[int]:
    """The line numbers of the top-level definitions (and the module docstring: ``__doc__``) named."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines: set[int] = set()
    for i, node in enumerate(tree.body):
        if i == 0 and "__doc__" in names and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            lines.update(range(node.lineno, node.end_lineno + 1))
        targets = [getattr(node, "name", None)] + [getattr(t, "id", None) for t in getattr(node, "targets", [])]
        if names & set(filter(None, targets)):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def scheme_mentions(root: Path = CORE) -> list[str]:
    """``file:line: text`` of every line under ``root`` that names a scheme, less :data:`ALLOWED`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        names, _ = ALLOWED.get(rel, (frozenset(), ""))
        if names is None:
            continue
        allowed = _allowed_lines(path, names) if names else set()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if PATTERN.search(line) and n not in allowed:
                found.append(f"core/irgen/{rel}:{n}: {line.strip()}")
    return found


def test_core_names_no_scheme():
    found = scheme_mentions()
    assert not found, ("core names a quantization scheme (its code belongs in the scheme's plugin, reached "
                       "through Quantizer.recompute/consistency; or allow it in ALLOWED with a reason):\n"
                       + "\n".join(found))


def test_the_allow_list_is_small_and_each_entry_is_needed():
    assert len(ALLOWED) <= 3
    for rel, (names, why) in ALLOWED.items():
        path = CORE / rel
        assert path.is_file() and why, rel
        text = path.read_text(encoding="utf-8")
        if names is None:
            assert PATTERN.search(text), f"{rel} names no scheme: drop it from ALLOWED"
        else:
            lines = text.splitlines()
            assert any(PATTERN.search(lines[n - 1]) for n in _allowed_lines(path, names)), \
                f"{rel}: {sorted(names)} name no scheme: drop them from ALLOWED"


def test_the_check_finds_a_mention(tmp_path):
    (tmp_path / "x.py").write_text('"""Realized as ONNX Runtime does."""\nif qr.get("reference") == "torch":\n'
                                   '    from irgen.qdq import realize\nscale = table  # as ORT rounds\n')
    assert [f.split(":")[1] for f in scheme_mentions(tmp_path)] == ["2", "3", "4"]
