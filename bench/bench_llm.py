"""Issue 39's memory figures: ``irgen run`` and ``irgen verify`` on a Qwen2-0.5B-shaped decoder.

The decoder is transformers' ``Qwen2ForCausalLM`` with Qwen2-0.5B's shape (24 layers, hidden 896,
MLP 4864, 14 query and 2 key/value heads, vocabulary 151,936, tied embeddings: 494 M parameters,
1.84 GiB of float32 weights) and seeded random weights, over a prompt of ``--tokens`` tokens, in
the formats of ``--format`` (``onnx``: ``torch.onnx.export``; ``pt2``: ``torch.export.save``).
For each: ``irgen run`` cold (an empty compile cache), ``irgen verify`` (single, entire and the
source check) and the source runtime dumping every tensor irgen writes (ONNX Runtime for ONNX;
torch's eager forward for ``.pt2``), each a whole process timed by ``os.wait4`` (wall time and
peak RSS), side by side in one run.

Targets (issue 39, point 4), printed PASS or MISS:

* peak RSS of run and of verify <= 1.5 x the weights + the largest layer's activations;
* verify's wall time <= 2 x the run's.

``--layers N`` builds a shorter decoder of the same width (a quick look; the targets are for 24).

    python bench/bench_llm.py [--format onnx --format pt2] [--layers 24] [--tokens 16] [--json out.json]
                              [--work DIR [--reuse]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_resnet import timed  # noqa: E402  (no heavy imports at its top)

HERE = Path(__file__).resolve().parent
SHAPE = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
             vocab_size=151936, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=1e6)

BUILD = r'''
import sys, json
import numpy as np, torch
sys.path.insert(0, {tests!r})
import zoo
zoo.import_torchvision()  # transformers imports torchvision when it is installed
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(0)
cfg = Qwen2Config(num_hidden_layers={layers}, attn_implementation="eager", **{shape!r})  # eager: the TorchScript exporter refuses SDPA masks
model = Qwen2ForCausalLM(cfg).eval()


class Logits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.m = model

    def forward(self, input_ids):
        # a mask of ones: without one transformers looks for packed sequences (aten::diff, no ONNX op)
        return self.m(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits


ids = torch.from_numpy(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, {tokens}), dtype=np.int64))
np.save({ids_path!r}, ids.numpy())
weights = sum(p.numel() * p.element_size() for p in {{id(p): p for p in model.parameters()}}.values())
with torch.no_grad():
    if {fmt!r} == "onnx":
        torch.onnx.export(Logits(), (ids,), {path!r}, input_names=["input_ids"], output_names=["logits"],
                          opset_version=17, dynamo=False)
    else:
        torch.export.save(torch.export.export(Logits(), (ids,)), {path!r})
json.dump({{"weights_bytes": weights, "parameters": sum(p.numel() for p in model.parameters()),
           "logits_bytes": {tokens} * cfg.vocab_size * 4}}, open({meta!r}, "w"))
'''

ORT_DUMP = r'''
import os, sys, numpy as np, onnx, onnxruntime as ort
m = onnx.load(sys.argv[1], load_external_data=False)  # a model over 2 GB keeps its weights in external data
have = {o.name for o in m.graph.output}
m.graph.output.extend(onnx.ValueInfoProto(name=o) for n in m.graph.node for o in n.output if o and o not in have)
so = ort.SessionOptions(); so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                            os.path.dirname(os.path.abspath(sys.argv[1])))
s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
names = [o.name for o in s.get_outputs()]
for k, v in enumerate(s.run(names, {"input_ids": np.load(sys.argv[2])})):
    np.save(f"{sys.argv[3]}/{k}.npy", v)
'''


def build(work: Path, fmt: str, layers: int, tokens: int, reuse: bool = False) -> tuple[Path, Path, dict]:
    path = work / f"qwen2_{layers}l.{fmt}"
    ids, meta = work / "input_ids.npy", work / f"meta_{fmt}.json"
    if reuse and path.exists() and ids.exists() and meta.exists() and np_len(ids) == tokens:
        return path, ids, json.loads(meta.read_text())
    script = BUILD.format(tests=str(HERE.parent / "tests"), layers=layers, shape=SHAPE, tokens=tokens,
                          ids_path=str(ids), fmt=fmt, path=str(path), meta=str(meta))
    timed([sys.executable, "-c", script], work / f"build_{fmt}.log")
    return path, ids, json.loads(meta.read_text())


def np_len(ids: Path) -> int:
    import numpy as np

    return int(np.load(ids).shape[-1])


def bench_format(work: Path, fmt: str, layers: int, tokens: int, reuse: bool = False) -> dict:
    model, ids, meta = build(work, fmt, layers, tokens, reuse)
    env_cache = work / f"cache_{fmt}"
    os.environ["IRGEN_CACHE_DIR"] = str(env_cache)
    out = work / f"out_{fmt}"
    irgen = [sys.executable, "-m", "irgen"]
    run = timed([*irgen, "run", str(model), "-o", str(out), "--input", f"input_ids={ids}", "--force",
                 "--no-progress", "--no-cache"], work / f"run_{fmt}.log")
    verify = timed([*irgen, "verify", str(out), "--no-progress", "--no-report"], work / f"verify_{fmt}.log")
    row = {"format": fmt, "layers": layers, "tokens": tokens, **meta, "run": run, "verify": verify}
    if fmt == "onnx":
        dump = work / "ort_dump"
        dump.mkdir(exist_ok=True)
        row["source_dump"] = timed([sys.executable, "-c", ORT_DUMP, str(model), str(ids), str(dump)],
                                   work / "ort_dump.log")
    bound = (1.5 * meta["weights_bytes"] + meta["logits_bytes"]) / 2**20
    row["targets"] = {
        "run_peak_le_1.5x_weights": run["peak_rss_mib"] <= bound,
        "verify_peak_le_1.5x_weights": verify["peak_rss_mib"] <= bound,
        "verify_le_2x_run_time": verify["wall_s"] <= 2 * run["wall_s"],
    }
    row["ratios"] = {"run_peak_per_weights": run["peak_rss_mib"] * 2**20 / meta["weights_bytes"],
                     "verify_peak_per_weights": verify["peak_rss_mib"] * 2**20 / meta["weights_bytes"],
                     "verify_time_per_run_time": verify["wall_s"] / run["wall_s"]}
    return row


def report(row: dict) -> None:
    w = row["weights_bytes"] / 2**30
    print(f"\n{row['format']}: {row['layers']} layers, {row['parameters'] / 1e6:.0f} M parameters, {w:.2f} GiB "
          f"of weights, {row['tokens']} tokens")
    for part in ("run", "verify", "source_dump"):
        if part in row:
            r = row[part]
            print(f"  {part:12s} {r['wall_s']:7.1f} s  peak {r['peak_rss_mib'] / 1024:6.2f} GiB "
                  f"({r['peak_rss_mib'] * 2**20 / row['weights_bytes']:.2f} x the weights)")
    for name, ok in row["targets"].items():
        print(f"  {'PASS' if ok else 'MISS'} {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", action="append", choices=("onnx", "pt2"), default=None)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--work", type=Path, default=None, help="keep the models and outputs here")
    ap.add_argument("--reuse", action="store_true", help="use the models already in --work (same --layers and --tokens)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_llm_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for fmt in args.format or ["onnx", "pt2"]:
        rows.append(bench_format(work, fmt, args.layers, args.tokens, args.reuse))
        report(rows[-1])
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(all(r["targets"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
