"""``irgen sweep``: jobs on a process pool and on Ray give the files single ``irgen run`` calls
give; a worker killed mid-sweep and a job that always fails; resume after an interruption.

The Ray tests share one local Ray instance (module-scoped) and are skipped, saying so, when
Ray (the ``ray`` extra) is not installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import time
from pathlib import Path

import pytest

from irgen.cli import main as irgen_main
from irgen.sweep import sweep
from irgen.testing.models import float_onnx, input_npy, qdq_onnx

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_cnn.onnx"
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed (pip install 'irgen[ray]'): the --ray executor is untested")

#: a test plugin: scheme ``die_once`` kills its worker process the first time any job uses it
#: (the marker file says it happened), then realizes nothing; ``always_fails`` always raises
FLAKY = """
    import os
    import signal
    from pathlib import Path

    from irgen.plugin import IrgenError, Quantizer, hookimpl

    MARKER = Path(MARKER_PATH)


    def die_once(qg):
        if not MARKER.exists():
            MARKER.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


    def always_fails(qg):
        raise IrgenError("always_fails: this scheme never works")


    @hookimpl
    def irgen_register_quantizers(register):
        register(Quantizer(name="die_once", detect=lambda qg: False, realize=die_once))
        register(Quantizer(name="always_fails", detect=lambda qg: False, realize=always_fails))
"""


def tree_digests(root: Path) -> dict[str, str]:
    """sha256 of every file below ``root``; manifest.json without its ``command`` (the ``-o`` differs)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "sweep.json":
            data = p.read_bytes()
            if p.name == "manifest.json":
                manifest = json.loads(data)
                manifest.pop("command")
                data = json.dumps(manifest, sort_keys=True).encode()
            out[p.relative_to(root).as_posix()] = hashlib.sha256(data).hexdigest()
    return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    """Three tiny models (two float CNNs, one QDQ) × eight .npy inputs at opt level 3: the spec."""
    d = tmp_path_factory.mktemp("zoo")
    float_onnx(d / "cnn_a.onnx", seed=0)
    float_onnx(d / "cnn_b.onnx", seed=1)
    qdq_onnx(d / "cnn_q.onnx", seed=2)
    (d / "samples").mkdir()
    for k in range(8):
        input_npy(d / "samples" / f"x{k}.npy", seed=100 + k)
    spec = d / "spec.yaml"
    spec.write_text("models: [cnn_a.onnx, cnn_b.onnx, cnn_q.onnx]\ninputs: samples\nopt_levels: [3]\n")
    return spec


@pytest.fixture(scope="module")
def pool_sweep(zoo, tmp_path_factory):
    out = tmp_path_factory.mktemp("pool") / "out"
    t0 = time.perf_counter()
    summary = sweep(zoo, out, workers=2)
    print(f"process pool sweep of 24 jobs: {time.perf_counter() - t0:.1f} s")
    return out, summary


@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance (2 CPUs) for the module's Ray tests; the sweeps use it as it is."""
    ray = pytest.importorskip("ray")
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    print(f"local Ray instance up in {time.perf_counter() - t0:.1f} s")
    yield ray
    ray.shutdown()


def test_pool_sweep_writes_what_single_runs_write(zoo, pool_sweep, tmp_path):
    out, summary = pool_sweep
    assert summary["counts"] == {"ok": 24, "failed": 0, "reused": 0}
    assert [r["attempts"] for r in summary["jobs"]] == [1] * 24
    assert {r["job"].split("/")[0] for r in summary["jobs"]} == {"cnn_a", "cnn_b", "cnn_q"}
    assert len({r["job"].split("/")[1] for r in summary["jobs"]}) == 8
    for row in summary["jobs"]:
        model, sample, level, scheme = row["job"].split("/")
        assert (level, scheme) == ("O3", "auto")
        single = tmp_path / row["job"]
        single.parent.mkdir(parents=True, exist_ok=True)
        argv = ["run", str(zoo.parent / f"{model}.onnx"), "-o", str(single), "--input",
                str(zoo.parent / "samples" / f"{sample}.npy"), "--opt-level", "3", "--no-progress"]
        assert irgen_main(argv) == 0
        job_files = tree_digests(out / row["job"])
        assert job_files == tree_digests(single), row["job"]
        assert row["layers"] == len(json.loads((single / "ir.json").read_text())["layers"]) > 0
        # the job's command line, recorded as a single run records its own: it reruns the job by hand
        command = json.loads((out / row["job"] / "manifest.json").read_text())["command"]
        assert command.startswith(f"irgen run {zoo.parent / f'{model}.onnx'} -o {out / row['job']} ")
    # the QDQ model's jobs are quantized (the scheme detected in the worker), the others float
    scheme = {m: json.loads((out / m / "x0" / "O3" / "auto" / "ir.json").read_text())["producer"]["quantizer"]
              for m in ("cnn_a", "cnn_q")}
    assert scheme == {"cnn_a": None, "cnn_q": "qdq"}
    record = json.loads((out / "sweep.json").read_text())
    assert record["summary"] == summary and set(record["jobs"]) == {r["job"] for r in summary["jobs"]}


@needs_ray
@pytest.mark.slow  # a local Ray cluster; the default suite sweeps with the process pool
def test_ray_sweep_writes_what_the_pool_writes(zoo, pool_sweep, ray_instance, tmp_path):
    t0 = time.perf_counter()
    summary = sweep(zoo, tmp_path / "out", ray="local")
    print(f"Ray sweep of 24 jobs: {time.perf_counter() - t0:.1f} s")
    assert summary["executor"].startswith("Ray local")
    assert summary["counts"] == {"ok": 24, "failed": 0, "reused": 0}
    pool_out = pool_sweep[0]
    ray_files = tree_digests(tmp_path / "out")
    assert len(ray_files) > 24 * 5
    assert ray_files == tree_digests(pool_out)


def _flaky_sweep(tmp_path: Path, plugin_file, executor: str, capsys) -> tuple[int, dict]:
    marker = tmp_path / "died"
    plugin = plugin_file("flaky", FLAKY.replace("MARKER_PATH", repr(str(marker))))
    model = qdq_onnx(tmp_path / "cnn_q.onnx", seed=2)  # a forced scheme needs a quantized model
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"models: [{model}]\nseeds: [0, 1]\nopt_levels: [1]\nschemes: [null, die_once, always_fails]\n")
    argv = ["sweep", str(spec), "-o", str(tmp_path / "out"), "-j", "2", "--json", "--no-progress",
            "--plugin", str(plugin)]
    capsys.readouterr()
    code = irgen_main(argv + (["--ray", "local"] if executor == "ray" else []))
    out = capsys.readouterr().out
    # stdout holds the summary alone (Ray's note on the killed worker went to stderr), unless that
    # note arrived after the sweep: the Ray instance is the test module's and outlives the command
    summary, _ = json.JSONDecoder().raw_decode(out[out.index('{\n "out"'):])
    assert marker.exists(), "no worker was killed"
    return code, summary


@pytest.mark.parametrize("executor", ["pool", pytest.param("ray", marks=[needs_ray, pytest.mark.slow])])
def test_killed_worker_and_failing_job(executor, tmp_path, plugin_file, capsys, request):
    """One worker is SIGKILLed mid-sweep: its job is tried again and succeeds, the jobs running
    beside it are not charged; a job that always fails is reported after two attempts; the rest
    complete. The plugin (--plugin FILE) reaches every worker."""
    if executor == "ray":
        request.getfixturevalue("ray_instance")
    code, summary = _flaky_sweep(tmp_path, plugin_file, executor, capsys)
    assert code == 1  # a job failed
    rows = {r["job"]: r for r in summary["jobs"]}
    assert len(rows) == 6
    died = [k for k, r in rows.items() if r["attempts"] == 2 and r["status"] == "ok"]
    assert len(died) == 1 and "/die_once" in died[0], rows
    for key, row in rows.items():
        if key.endswith("/always_fails"):
            assert (row["status"], row["attempts"]) == ("failed", 2)
            assert "always_fails: this scheme never works" in row["error"]
            assert not (tmp_path / "out" / key).exists()
        else:
            assert row["status"] == "ok"
            assert (row["attempts"] == 2) == (key in died)
            ir = json.loads((tmp_path / "out" / key / "ir.json").read_text())
            assert row["layers"] == len(ir["layers"]) > 0
            assert ir["producer"]["quantizer"] == ("qdq" if key.endswith("/auto") else "die_once")
    assert summary["counts"] == {"ok": 4, "failed": 2, "reused": 0}
    # no partial folder of the killed attempt is left behind
    assert not [p for p in (tmp_path / "out").rglob(".*") if p.is_dir()]


@pytest.mark.slow  # test_pool_sweep_writes_what_single_runs_write and test_cache_key's resume test run by default
def test_resume_runs_only_what_is_missing(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"models: [{EXAMPLE}]\nseeds: [0, 1, 2]\nopt_levels: [1]\n")
    out = tmp_path / "out"
    first = sweep(spec, out, workers=1)
    assert first["counts"] == {"ok": 3, "failed": 0, "reused": 0}
    keys = [r["job"] for r in first["jobs"]]
    assert keys == [f"tiny_cnn/seed{s}/O1/auto" for s in range(3)]
    inode = {k: (out / k / "ir.json").stat().st_ino for k in keys}
    before = tree_digests(out)

    # an interrupted sweep: seed1's output never appeared; seed2 finished but was not recorded
    shutil.rmtree(out / keys[1])
    record = json.loads((out / "sweep.json").read_text())
    del record["jobs"][keys[2]]
    (out / "sweep.json").write_text(json.dumps(record))
    again = sweep(spec, out, workers=1)
    assert [(r["job"], r["reused"], r["status"]) for r in again["jobs"]] == [
        (keys[0], True, "ok"), (keys[1], False, "ok"), (keys[2], False, "ok")]
    assert (out / keys[0] / "ir.json").stat().st_ino == inode[keys[0]]  # not written again
    assert (out / keys[2] / "ir.json").stat().st_ino != inode[keys[2]]
    assert tree_digests(out) == before  # the same files as the uninterrupted sweep

    # nothing left to do: nothing runs
    third = sweep(spec, out, workers=1)
    assert third["counts"] == {"ok": 3, "failed": 0, "reused": 3} and third["executor"] is None

    # another spec into the same OUT is refused, unless --force (the unchanged jobs are kept)
    spec.write_text(f"models: [{EXAMPLE}]\nseeds: [2, 0]\nopt_levels: [1]\n")
    assert irgen_main(["sweep", str(spec), "-o", str(out), "--no-progress"]) == 2
    assert "different spec" in capsys.readouterr().err
    assert irgen_main(["sweep", str(spec), "-o", str(out), "--no-progress", "--force", "--json"]) == 0
    forced = json.loads(capsys.readouterr().out)
    assert [(r["job"], r["reused"]) for r in forced["jobs"]] == [(keys[2], True), (keys[0], True)]
    assert set(json.loads((out / "sweep.json").read_text())["jobs"]) == {keys[0], keys[2]}
