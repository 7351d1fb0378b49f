"""Shared fixtures, and the session-wide self-check of every output irgen writes.

Every ``irgen.pipeline.run`` in this process (``irgen.cli.main(["run", ...])``
and direct calls alike) is followed by ``irgen verify`` in ``single`` and
``entire`` modes on the fresh output folder: a run whose golden data the numpy
reference cannot reproduce (integer layers exactly) fails the test that made
it. ``IRGEN_TEST_VERIFY=0`` turns the check off; the time it took is printed
at the end of the session.

Every ``ir.json`` a test leaves under its ``tmp_path`` (also those written by
``irgen run`` in a child process) must validate against the IR's JSON Schema
(:mod:`irgen.schema`): the test fails naming the file and the violations. A
test that writes invalid ones on purpose says so with ``@pytest.mark.corrupts_ir``.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

if not os.environ.get("IRGEN_CACHE_DIR"):  # before irgen reads it; child processes inherit it
    import atexit
    import shutil
    import tempfile

    _SESSION_CACHE = tempfile.mkdtemp(prefix="irgen-test-cache-")
    os.environ["IRGEN_CACHE_DIR"] = _SESSION_CACHE
    atexit.register(shutil.rmtree, _SESSION_CACHE, True)

import irgen.pipeline  # noqa: E402
from irgen.verify import format_table, verify_output  # noqa: E402

_run = irgen.pipeline.run
VERIFIED = {"outputs": 0, "seconds": 0.0}


def _run_and_verify(host, model, out, *args, **kwargs):
    ir = _run(host, model, out, *args, **kwargs)
    t0 = time.perf_counter()
    result = verify_output(out, modes=("single", "entire"), host=host)  # the run's backend reads its files
    VERIFIED["outputs"] += 1
    VERIFIED["seconds"] += time.perf_counter() - t0
    assert result["passed"], f"irgen verify failed on {out} (from {model}):\n{format_table(result)}"
    return ir


if os.environ.get("IRGEN_TEST_VERIFY", "1") != "0":
    # before the test modules are imported, so `from irgen.pipeline import run` gets the wrapper too
    irgen.pipeline.run = _run_and_verify


#: parametrized variants moved to the slow suite for the default suite's time budget (15 minutes
#: in CI), each beside the default case that keeps its path covered (docs/contributing.md)
SLOW_VARIANTS = {
    "tests/test_zoo.py::test_zoo_case_runs_and_verifies_against_its_source_runtime[vit-pt2e-arm]": "vit-qdq-pre",
    "tests/test_zoo.py::test_zoo_case_runs_and_verifies_against_its_source_runtime[bert-onnx]": "hf_llama-pt2",
    "tests/test_float_zoo_patterns.py::test_backend_that_asks_for_fused_attention_gets_one_attention_layer"
    "[sdpa_attention-pt2]": "sdpa_attention-onnx",
    "tests/test_float_zoo_patterns.py::test_pattern_runs_and_verifies[encoder_block-pt2-O3]": "sdpa_attention-pt2-O3",
    "tests/test_video_3d.py::test_float_model[variants-pt2]": "variants-onnx",
    "tests/test_video_3d.py::test_float_model[scaled-pt2]": "video-pt2",
    "tests/test_video_3d.py::test_float_model[where-pt2]": "where-onnx",
    "tests/test_video_3d.py::test_float_model[decoder-pt2]": "decoder-onnx",
    "tests/test_report.py::test_report_fits_a_1280_pixel_window[tflite]": "the other formats",
    "tests/test_reference_ops.py::test_model[attention-pt2]": "mlp_ops-pt2, attention-onnx",
    "tests/test_float_transformers.py::test_transformer_pattern_runs_and_verifies[shuffle_diff-pt2-O0]": "bool_mask_attention-pt2-O3",
    "tests/test_float_transformers.py::test_transformer_pattern_runs_and_verifies[position_mask-pt2-O3]": "bool_mask_attention-pt2-O3",
    "tests/test_hostile_sweep.py::test_hostile_record_in_out[row-without-fields]": "row-not-a-mapping",
    "tests/test_hostile_sweep.py::test_hostile_record_in_out[row-of-wrong-types]": "row-not-a-mapping",
    "tests/test_torch_quant.py::test_group_norm_in_a_float_span[pt2e]": "the other quantizer",
    "tests/test_torch_quant.py::test_reduce_range_of_the_default_mappings[ptq]": "the other flow",
    "tests/test_hostile_surfaces.py::test_every_file_irgen_writes_follows_the_umask[2]": "umask 63",
    "tests/test_torch_frontend.py::test_model_class_errors[no-colon]": "the other model-class errors",
    "tests/test_qdq_spans.py::test_run_and_verify_against_onnxruntime[linear_attention-a16]": "transformer-a16",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    config.addinivalue_line("markers", "corrupts_ir: the test writes invalid ir.json files on purpose "
                                       "(they are not checked against the IR schema)")


def _ir_files(root: Path):
    """Every regular ``ir.json`` below ``root`` (symbolic links are not followed)."""
    for folder, _, files in os.walk(root):
        path = Path(folder) / "ir.json"
        if "ir.json" in files and path.is_file() and not path.is_symlink():
            yield path


def _schema_violations(root: Path) -> list[str]:
    from irgen.schema import validate_ir

    found = []
    for path in _ir_files(root):
        try:
            problems = validate_ir(json.loads(path.read_bytes()))
        except ValueError as err:
            problems = [f"not JSON ({err})"]
        if problems:
            shown = "\n    ".join(problems[:10]) + (f"\n    ... and {len(problems) - 10} more" if len(problems) > 10 else "")
            found.append(f"{path}:\n    {shown}")
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After a test that used ``tmp_path``: every ir.json it left there is valid against the schema."""
    result = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if tmp is not None and item.get_closest_marker("corrupts_ir") is None:
        bad = _schema_violations(Path(tmp))
        if bad:
            pytest.fail("ir.json not valid against the IR schema (irgen/schemas/ir.schema.json):\n" + "\n".join(bad),
                        pytrace=False)
    return result


def pytest_terminal_summary(terminalreporter):
    if VERIFIED["outputs"]:
        terminalreporter.write_line(
            f"irgen verify (single, entire) on {VERIFIED['outputs']} generated outputs: {VERIFIED['seconds']:.1f} s"
        )


@pytest.fixture
def plugin_file(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write a plugin module: ``plugin_file("myplugin", source)`` -> ``tmp_path/myplugin.py``."""

    def write(name: str, source: str) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        return path

    return write
