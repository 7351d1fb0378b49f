"""``fuzz/fuzz_loaders.py`` works: a short bounded run of two targets finds nothing
and reports the executions it ran (the long runs are documented in docs/security.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

SCRIPT = Path(__file__).resolve().parents[1] / "fuzz" / "fuzz_loaders.py"


@pytest.mark.parametrize("target,runs", [("npy", 400), ("manifest", 60)])
def test_bounded_fuzz_run_finds_nothing(tmp_path, target, runs) -> None:
    tmp = tmp_path / "tmp"  # the run's own temporary folder: nothing may be left in it
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--target", target, "--runs", str(runs), "--seconds", "120",
         "--corpus", str(tmp_path / "corpus"), "--findings", str(tmp_path / "findings")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert not list(tmp.iterdir()), list(tmp.iterdir())  # the fuzzing child's scratch folder too
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(rf"^{target}\s+(\d+) executions\s+ok$", proc.stdout, re.M)
    assert m and int(m.group(1)) >= runs, proc.stdout
    assert re.search(r"^total\s+\d+ executions, 0 finding\(s\)$", proc.stdout, re.M), proc.stdout
    assert any((tmp_path / "corpus" / target).iterdir())  # seeds were made
