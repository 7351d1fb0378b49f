"""Hostile specs and sweep folders for ``irgen sweep``.

Each case asserts what ``tests/hostile.py`` says (exit 2 and one ``irgen: error:`` line,
no traceback, nothing outside OUT touched) and, where an input could make irgen take
gigabytes, the peak memory of the ``irgen`` child alone (:func:`hostile.measured`): well under
300 MiB. The child's address space is capped, so a regression fails the test instead
of taking the machine.

- links planted inside OUT (a model, sample or job folder, ``sweep.json``, the record's
  temporary file) are refused, never followed, before any job runs and again in the
  worker just before a job writes;
- YAML aliases ("billion laughs") are refused before expansion; a spec's nesting and
  number of values are bounded (YAML and JSON);
- no message repeats an unbounded value of the spec;
- a spec of more jobs than ``--max-jobs`` (default 10000) is refused before the jobs
  are built, and an ``inputs`` folder is not listed past that limit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hostile import Sentinel, assert_refused, irgen, measured
from irgen.api import IrgenError
from irgen.sweep import RECORD, expand, run_job, sweep

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_cnn.onnx"
#: the address space an ``irgen`` child may take here (a regression fails, not the machine)
CAP = 3 << 30
#: what a refused hostile spec may take at the most (peak RSS of the child)
PEAK_MIB = 300
#: a message names a value of the spec in at most this many characters
LINE_MAX = 600


def sweep_measured(*argv) -> tuple[subprocess.CompletedProcess, float, float]:
    """``irgen ARGV`` with its address space capped at :data:`CAP` (:func:`hostile.measured`):
    (result, peak RSS of that child in MiB, seconds)."""
    proc, peak, seconds = measured(*argv, cap=CAP, timeout=180)
    return proc, peak / (1 << 20), seconds


def bounded_refusal(proc: subprocess.CompletedProcess, peak: float, *names: str) -> str:
    """One short error line naming ``names``, taken in bounded memory."""
    line = assert_refused(proc, None, *names)
    assert len(line) < LINE_MAX, line[:LINE_MAX]
    assert peak < PEAK_MIB, f"peak RSS {peak:.0f} MiB"
    return line


# ------------------------------------------------------------------ links inside OUT


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[Path, Path]:
    """(spec, OUT) of one finished sweep: tiny_cnn, seed 0, opt level 1 (one job)."""
    d = tmp_path_factory.mktemp("swept")
    spec = d / "spec.yaml"
    spec.write_text(f"models: [{EXAMPLE}]\nseeds: [0]\nopt_levels: [1]\n")
    proc = irgen("sweep", spec, "-o", d / "out", "-j", "1", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return spec, d / "out"


def _copy(out: Path, to: Path) -> Path:
    shutil.copytree(out, to, symlinks=True)
    return to


@pytest.mark.parametrize("where", ["tiny_cnn", "tiny_cnn/seed0", "tiny_cnn/seed0/O1", "tiny_cnn/seed0/O1/auto",
                                   RECORD])
def test_link_inside_out_is_refused_not_followed(swept, tmp_path, where):
    """A sweep run again after a link to a folder outside was put in OUT (at a model, sample,
    level or job folder, or at sweep.json): refused naming the link; nothing outside is opened,
    written or deleted (today the job ran through the link, and ``--force`` replaced the
    folder it points to)."""
    spec, done = swept
    out = _copy(done, tmp_path / "out")
    with Sentinel(tmp_path / "outside") as sentinel:
        link = out / where
        shutil.rmtree(link) if link.is_dir() else link.unlink()
        link.symlink_to(sentinel.secret if where == RECORD else sentinel.folder)
        proc = irgen("sweep", spec, "-o", out, "-j", "1", "--no-progress")
        line = assert_refused(proc, None, str(link), "symbolic link")
        sentinel.assert_untouched()
    assert sorted(p.name for p in sentinel.folder.iterdir()) == ["secret.txt"]
    assert sentinel.secret.read_text().startswith("sentinel:")
    assert len(line) < LINE_MAX


def test_link_at_the_record_temp_file_is_refused(swept, tmp_path):
    """The record is written to ``OUT/.sweep.json.PID.tmp`` and renamed: a link planted there
    (the PID is easy to guess) is refused, not written through."""
    spec, done = swept
    out = _copy(done, tmp_path / "out")
    with Sentinel(tmp_path / "outside") as sentinel:
        tmp = out / f".{RECORD}.{os.getpid()}.tmp"
        tmp.symlink_to(sentinel.secret)
        with pytest.raises(IrgenError, match="symbolic link") as err:
            sweep(spec, out, workers=1)
        assert str(tmp) in str(err.value)
        sentinel.assert_untouched()
    assert sentinel.secret.read_text().startswith("sentinel:")


@pytest.mark.parametrize("case", ["huge", "row-not-a-mapping", "row-without-fields", "row-of-wrong-types"])
def test_hostile_record_in_out(swept, tmp_path, case):
    """``OUT/sweep.json`` is OUT's too: one of 40 MB is refused unread, in bounded memory (today it
    was parsed whole: ~13 million lists); a job's record that is not a mapping, or lacks a field,
    or holds a field of another type (with the right status and fingerprint) is dropped and the
    job runs again (today: an internal error)."""
    spec, done = swept
    out = _copy(done, tmp_path / "out")
    record = json.loads((out / RECORD).read_text())
    if case == "huge":
        record["jobs"] = {"x": [[]] * 13_000_000}
        (out / RECORD).write_text(json.dumps(record, separators=(",", ":")))
        proc, peak, _ = sweep_measured("sweep", spec, "-o", out, "--no-progress")
        bounded_refusal(proc, peak, str(out / RECORD), "--force")
        return
    [key] = record["jobs"]
    rec = record["jobs"][key]
    record["jobs"][key] = {"row-not-a-mapping": 5,
                           "row-without-fields": {k: rec[k] for k in ("status", "fingerprint")},
                           "row-of-wrong-types": {**rec, "attempts": "x" * 100, "layers": [[]]}}[case]
    (out / RECORD).write_text(json.dumps(record))
    proc = irgen("sweep", spec, "-o", out, "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["counts"] == {"ok": 1, "failed": 0, "reused": 0}


def test_worker_refuses_a_link_put_in_after_the_check(tmp_path):
    """The worker checks the path again just before the job writes: a link put in OUT after the
    sweep's own check fails the job, and nothing is written outside."""
    spec = {"models": [str(EXAMPLE)], "seeds": [0], "opt_levels": [1]}
    out = tmp_path / "out"
    out.mkdir()
    [job] = expand(spec, tmp_path, out)
    with Sentinel(tmp_path / "outside") as sentinel:
        (out / "tiny_cnn").symlink_to(sentinel.folder)
        result = run_job(job.payload())
        sentinel.assert_untouched()
    assert not result["ok"] and "symbolic link" in result["error"] and str(out / "tiny_cnn") in result["error"]
    assert sorted(p.name for p in sentinel.folder.iterdir()) == ["secret.txt"]


@pytest.mark.parametrize("scheme", ["../../../escape", "a/b", ".hidden", "-x", ""])
def test_scheme_that_is_not_a_folder_name_is_refused(tmp_path, scheme):
    """A scheme names a job folder: one that would leave OUT (or is not a plain name) is refused
    even without a plugin host to look it up (the Python API)."""
    spec = {"models": [str(EXAMPLE)], "schemes": [scheme]}
    with pytest.raises(IrgenError, match="scheme"):
        expand(spec, tmp_path, tmp_path / "out")


# ------------------------------------------------------------------ YAML aliases, nesting, size


def _laughs(levels: int = 9) -> str:
    """A ~400-byte YAML "billion laughs": ``models`` holds a list that expands to 9**9 items."""
    lines = ["opt_levels:", "- &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    names = "abcdefghijkl"
    for k in range(1, levels):
        alias = f"*{names[k - 1]}"
        lines.append(f"- &{names[k]} [{', '.join([alias] * 9)}]")
    lines.append(f"models: [*{names[levels - 1]}]")
    return "\n".join(lines) + "\n"


def test_yaml_aliases_are_refused_before_expansion(tmp_path):
    spec = tmp_path / "laughs.yaml"
    spec.write_text(_laughs())
    assert len(spec.read_bytes()) < 600
    proc, peak, seconds = sweep_measured("sweep", spec, "-o", tmp_path / "out", "--no-progress")
    bounded_refusal(proc, peak, str(spec), "alias", "line 3")
    assert seconds < 30
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["yaml-values", "json-values", "yaml-deep", "json-deep", "json-too-deep"])
def test_spec_nesting_and_size_are_bounded(tmp_path, case):
    """A 1 MiB spec of half a million values, or nested hundreds of levels deep: refused
    with one short line, in bounded memory (today a YAML list of 500k values took ~360 MiB
    and a deep one was repeated whole in the message)."""
    n = 500_000 if "values" in case else (5000 if case == "json-too-deep" else 600)
    if case.endswith("values"):
        text = ("seeds: [" if case.startswith("yaml") else '{"seeds": [') + ",".join(["0"] * n) + "]"
        text = f"{text}\nmodels: [{EXAMPLE}]\n" if case.startswith("yaml") else f'{text}, "models": ["{EXAMPLE}"]}}'
        names = ("more than", "values")
    else:
        nest = "[" * n + "1" + "]" * n
        text = f"models: {nest}\n" if case.startswith("yaml") else f'{{"models": {nest}}}'
        names = ("nested",)
    spec = tmp_path / ("spec.yaml" if case.startswith("yaml") else "spec.json")
    spec.write_text(text)
    assert len(spec.read_bytes()) <= 1 << 20
    proc, peak, _ = sweep_measured("sweep", spec, "-o", tmp_path / "out", "--no-progress")
    bounded_refusal(proc, peak, str(spec), *names)


# ------------------------------------------------------------------ bounded messages


@pytest.fixture(scope="module")
def empty_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("empty")


BIG = 200_000


@pytest.mark.parametrize("case", ["holds", "unknown-key", "model-path", "model-nul", "input-path", "input-folder",
                                  "opt-level", "scheme", "backend", "key-types", "model-link-loop"])
def test_messages_never_repeat_an_unbounded_value(tmp_path, empty_folder, case):
    """Every message naming a value of the spec names it in a bounded number of characters
    (today most of these printed the whole value, up to 200 KB on one line; a NUL in a path,
    keys of several types and a model that is a link loop were internal errors)."""
    model = str(EXAMPLE)
    spec = {
        "holds": {"models": [["x" * BIG]]},
        "unknown-key": {"models": [model], "k" * BIG: 1},
        "model-path": {"models": ["m" * 5000]},
        "model-nul": {"models": ["a\x00b.onnx"]},
        "input-path": {"models": [model], "inputs": ["i" * 5000]},
        "input-folder": {"models": [model], "inputs": ["/" + "./" * (BIG // 2) + str(empty_folder)[1:]]},
        "opt-level": {"models": [model], "opt_levels": [int("9" * 4000)]},
        "scheme": {"models": [model], "schemes": ["s" * BIG]},
        "backend": {"models": [model], "backend": "b" * BIG},
        "model-link-loop": {"models": ["loop.onnx"]},
    }.get(case)
    (tmp_path / "loop.onnx").symlink_to("loop.onnx")
    path = tmp_path / "spec.json"
    if case == "key-types":  # keys of several types (YAML): listed, not compared
        path = tmp_path / "spec.yaml"
        path.write_text(f"models: [{model}]\n1: x\nzz: y\n")
        names: tuple[str, ...] = ("unknown key", "'zz'")
    else:
        path.write_text(json.dumps(spec))
        names = ()
    proc = irgen("sweep", path, "-o", tmp_path / "out", "--no-progress", timeout=120)
    line = assert_refused(proc, tmp_path / "out", *names)
    assert len(line) < LINE_MAX, (len(line), line[:LINE_MAX])


# ------------------------------------------------------------------ the number of jobs


def test_job_count_is_refused_before_the_jobs_are_built(tmp_path):
    """1000 models × 1000 seeds × 5 opt levels × 4 schemes: twenty million jobs, refused
    naming the number, the limit and --max-jobs, in bounded memory (today every job was built)."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"models": [str(EXAMPLE)] * 1000, "seeds": list(range(1000)),
                                "opt_levels": [0, 1, 2, 3, 4], "schemes": [None, "qdq", "pow2", "tflite-int8"]}))
    proc, peak, seconds = sweep_measured("sweep", spec, "-o", tmp_path / "out", "--no-progress")
    bounded_refusal(proc, peak, "20000000 jobs", "10000", "--max-jobs")
    assert seconds < 30


def test_max_jobs_option(tmp_path):
    """``--max-jobs N`` sets the limit: 6 jobs are refused at 5 (before OUT is made), built at 6."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"models: [{EXAMPLE}]\nseeds: [0, 1, 2]\nopt_levels: [0, 1]\n")
    out = tmp_path / "out"
    assert_refused(irgen("sweep", spec, "-o", out, "--max-jobs", "5", "--no-progress"), out, "6 jobs", "5",
                   "--max-jobs")
    assert_refused(irgen("sweep", spec, "-o", out, "--max-jobs", "0", "--no-progress"), out, "--max-jobs")
    jobs = expand({"models": [str(EXAMPLE)], "seeds": [0, 1, 2], "opt_levels": [0, 1]}, tmp_path, out, max_jobs=6)
    assert len(jobs) == 6


def test_inputs_folder_is_not_listed_past_the_limit(tmp_path, monkeypatch):
    """An ``inputs`` folder of 3000 .npy files with a limit of 100 jobs: refused, and no more
    than about the limit's number of entries were read from the folder (today all were listed,
    and every job built)."""
    folder = tmp_path / "samples"
    folder.mkdir()
    for k in range(3000):
        (folder / f"x{k:05d}.npy").touch()
    read = [0]
    real_scandir, real_listdir = os.scandir, os.listdir

    class Counting:
        def __init__(self, path):
            self.it = real_scandir(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.it.close()

        def __iter__(self):
            return self

        def __next__(self):
            entry = next(self.it)
            read[0] += 1
            return entry

        def close(self):
            self.it.close()

    def listdir(path="."):
        names = real_listdir(path)
        read[0] += len(names)
        return names

    monkeypatch.setattr(os, "scandir", Counting)
    monkeypatch.setattr(os, "listdir", listdir)
    spec = {"models": [str(EXAMPLE)], "inputs": ["samples"], "opt_levels": [1]}
    with pytest.raises(IrgenError, match=r"at least 101 jobs, more than the limit of 100 .*--max-jobs"):
        expand(spec, tmp_path, tmp_path / "out", max_jobs=100)
    assert 0 < read[0] <= 200, read[0]
    monkeypatch.undo()
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    proc = irgen("sweep", path, "-o", tmp_path / "out", "--max-jobs", "100", "--no-progress")
    assert_refused(proc, tmp_path / "out", "at least 101 jobs", "limit of 100", "--max-jobs")
