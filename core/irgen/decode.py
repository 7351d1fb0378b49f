"""``irgen run --decode N``: golden data for an LLM's generation trace, a prefill and ``N``
decode steps against a KV cache.

The model is a decoder exported with its cache as inputs and outputs (transformers' cache
in ONNX's naming: ``past_key_values.I.key`` / ``.value`` in, ``present.I.key`` / ``.value``
out; an output whose name says nothing, one named after a graph node, is known by its place
in what the model returns, :attr:`~irgen.api.DeclaredTensor.path`, such as ``present.0``:
see :func:`label`). Each step is one complete ``irgen run`` into ``OUT/step_NNN`` (step 0
the prefill over the prompt with an empty cache, each later step one token), and each step's
inputs come from the golden data of the step before it: the next token is the argmax of the
last position's logits (greedy), the cache is the previous step's ``present`` outputs, the
attention mask is all ones over the cache and the new tokens, the positions continue.
``OUT/trace.json`` lists the steps, their tokens, cache lengths and the input each output
feeds. ``irgen verify OUT`` checks every step (its source check runs the source runtime on
the step's own inputs).

Which input plays which part is read from the model's declared interface
(``Frontend.interface``): :func:`roles` explains every refusal.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from irgen.api import DeclaredTensor, IrgenError, ModelInterface
from irgen.inputs import parse_input_shapes
from irgen.irfile import read_ir
from irgen.output import OutputFolder, Progress
from irgen.runners import TensorFiles
from irgen.safeio import load_npy

TRACE_FILE = "trace.json"
#: a step's folder name
STEP_NAME = "step_{:03d}"
MAX_STEPS = 4096

_CACHE_WORDS = re.compile(r"(past_key_values|past_key_value|key_values|present|past|cache)", re.I)


@dataclass(frozen=True)
class CachePair:
    """A cache input, the output that gives its next value, and the axis that grows."""

    past: str
    present: str
    axis: int


@dataclass(frozen=True)
class Roles:
    """The part each declared input plays in a decode step."""

    tokens: DeclaredTensor
    logits: str
    pairs: tuple[CachePair, ...]
    mask: DeclaredTensor | None
    positions: DeclaredTensor | None
    cache_position: DeclaredTensor | None
    vocab: int | None


def label(t: DeclaredTensor) -> str:
    """What a declared tensor is called for its role: its path in the model's returned
    structure where the frontend gives one (an output named after a graph node), else its
    name."""
    return t.path or t.name


def _cache_key(name: str) -> str:
    """``past_key_values.0.key`` and ``present.0.key`` both give ``0.key``."""
    return re.sub(r"^[._/-]+|[._/-]+$", "", _CACHE_WORDS.sub("", name)).lower()


def _shown(t: DeclaredTensor) -> str:
    return t.name if t.path in (None, t.name) else f"{t.name} ({t.path})"


def _pairs(iface: ModelInterface, batch: str | int) -> tuple[CachePair, ...]:
    past = [t for t in iface.inputs if re.search(r"past|cache", label(t), re.I) and label(t) != "cache_position"]
    present = {_cache_key(label(t)): t for t in iface.outputs if re.search(r"present|cache", label(t), re.I)}
    if not past:
        raise IrgenError("--decode: the model has no cache inputs (inputs named past_key_values.I.key/.value, "
                         f"or past*; its inputs: {', '.join(t.name for t in iface.inputs)})")
    pairs = []
    for t in past:
        out = present.pop(_cache_key(label(t)), None)
        if out is None:
            raise IrgenError(f"--decode: no output gives the next value of cache input {t.name!r} (expected one "
                             f"named like {label(t).replace('past_key_values', 'present')!r}, the same name once "
                             "past_key_values/past/present/cache is taken out, or at such a path in what the model "
                             "returns, e.g. {'logits': ..., 'present': [tensors]}; outputs: "
                             f"{', '.join(_shown(o) for o in iface.outputs)})")
        open_axes = [k for k, d in enumerate(t.shape) if isinstance(d, str) and d != batch]
        if len(open_axes) != 1 or len(out.shape) != len(t.shape):
            raise IrgenError(f"--decode: cache input {t.name!r} has the declared shape {list(t.shape)}: expected one "
                             "open dimension, the cache length, besides the batch (a fixed-size cache is not "
                             "supported)")
        pairs.append(CachePair(t.name, out.name, open_axes[0]))
    return tuple(pairs)


def roles(iface: ModelInterface) -> Roles:
    """Which input is the token ids, the attention mask, the positions and the cache, and which
    output the logits; an IrgenError names what does not fit."""
    by_name = {t.name: t for t in iface.inputs}
    tokens = by_name.get("input_ids")
    if tokens is None or len(tokens.shape) != 2 or not tokens.dtype.startswith(("int", "uint")):
        raise IrgenError("--decode: the model needs an integer input 'input_ids' of shape [batch, sequence] "
                         f"(its inputs: {', '.join(f'{t.name} {list(t.shape)}' for t in iface.inputs)})")
    pairs = _pairs(iface, tokens.shape[0])
    known = {"input_ids", "attention_mask", "position_ids", "cache_position", *(p.past for p in pairs)}
    other = [t.name for t in iface.inputs if t.name not in known]
    if other:
        raise IrgenError(f"--decode: cannot tell what to feed input(s) {', '.join(map(repr, other))} at each step "
                         "(known: input_ids, attention_mask, position_ids, cache_position and the cache)")
    paired = {p.present for p in pairs}
    logits = next((t for t in iface.outputs if label(t) == "logits"), None) \
        or next((t for t in iface.outputs if t.name not in paired), None)
    if logits is None or len(logits.shape) != 3:
        raise IrgenError("--decode: the model needs a logits output of shape [batch, sequence, vocabulary]")
    vocab = logits.shape[-1] if isinstance(logits.shape[-1], int) else None
    return Roles(tokens, logits.name, pairs, by_name.get("attention_mask"), by_name.get("position_ids"),
                 by_name.get("cache_position"), vocab)


def _cache_shape(t: DeclaredTensor, axis: int, length: int, batch: int, batch_dim) -> tuple[int, ...]:
    shape = []
    for k, d in enumerate(t.shape):
        if k == axis:
            shape.append(length)
        elif isinstance(d, int):
            shape.append(d)
        elif d == batch_dim:
            shape.append(batch)
        else:
            raise IrgenError(f"--decode: cache input {t.name!r} dimension {k} ({d!r}) is open; export the model "
                             "with fixed heads and head size")
    return tuple(shape)


def step_feeds(r: Roles, iface: ModelInterface, tokens: np.ndarray, cache: dict[str, np.ndarray],
               length: int) -> dict[str, np.ndarray]:
    """The inputs of one step: ``tokens`` [batch, new], the cache (``length`` positions each;
    empty at the prefill), a mask of ones over both and the positions that follow the cache."""
    batch, new = tokens.shape
    feeds = {r.tokens.name: tokens.astype(r.tokens.dtype)}
    by_name = {t.name: t for t in iface.inputs}
    for p in r.pairs:
        t = by_name[p.past]
        shape = _cache_shape(t, p.axis, length, batch, r.tokens.shape[0])
        feeds[p.past] = cache[p.past] if length else np.zeros(shape, t.dtype)
        if feeds[p.past].shape != shape:
            raise IrgenError(f"--decode: output {p.present!r} has the shape {feeds[p.past].shape}, not {shape} "
                             f"as input {p.past!r} needs (the cache grows on axis {p.axis})")
    if r.mask is not None:
        feeds[r.mask.name] = np.ones((batch, length + new), r.mask.dtype)
    if r.positions is not None:
        feeds[r.positions.name] = np.broadcast_to(np.arange(length, length + new), (batch, new)).astype(
            r.positions.dtype)
    if r.cache_position is not None:
        feeds[r.cache_position.name] = np.arange(length, length + new).astype(r.cache_position.dtype)
    return feeds


def prompt_tokens(r: Roles, given: list[str], shapes: list[str], seed: int, limit: int | None) -> np.ndarray:
    """The prompt: ``--input input_ids=FILE`` (or one FILE), else ``--input-shape
    input_ids=B,P`` ids drawn with ``--seed`` below the logits' vocabulary size."""
    name = r.tokens.name
    files = [g.partition("=")[2] if g.startswith(f"{name}=") else g for g in given]
    if len(files) > 1 or any("=" in g and not g.startswith(f"{name}=") and not Path(g).exists() for g in given):
        raise IrgenError(f"--decode: give only the prompt, with --input {name}=FILE (the other inputs follow from it)")
    if files:
        ids = load_npy(Path(files[0]), "--input", limit)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or 0 in ids.shape:
            raise IrgenError(f"--input {files[0]}: the prompt must be integer token ids of shape [batch, length], "
                             f"not {ids.dtype} {list(ids.shape)}")
        return ids
    parsed = parse_input_shapes(shapes, limit)
    if set(parsed) != {name} or r.vocab is None:
        raise IrgenError(f"--decode: give the prompt with --input {name}=FILE (token ids, [batch, length])"
                         + ("" if r.vocab is None else f" or its shape with --input-shape {name}=B,P alone"))
    return np.random.default_rng(seed).integers(0, r.vocab, parsed[name]).astype(r.tokens.dtype)


def _read_outputs(folder: Path, names: list[str], backend, limit: int | None) -> dict[str, np.ndarray]:
    """The golden values of the step's model outputs ``names``, read back from its folder."""
    ir = read_ir(folder)
    files = TensorFiles(folder, ir, limit, backend=lambda: backend)
    by_name = {rec["name"]: rec for rec in ir["outputs"]}
    return {n: files.load(by_name[n]) for n in names}


def run_decode(fe, model: Path, out: Path, steps: int, run_step, progress: Progress, force: bool, seed: int,
               given: list[str], shapes: list[str], limit: int | None, backend) -> dict[str, Any]:
    """Write the trace of the model read by frontend ``fe`` into ``out``:
    ``run_step(step_folder, input_shapes, arrays)`` is one ``irgen run``
    (:func:`irgen.pipeline.run` with the command's other settings); ``backend`` reads the
    steps' outputs back. Returns the trace record (``trace.json``)."""
    if not 1 <= steps <= MAX_STEPS:
        raise IrgenError(f"--decode {steps}: must be 1..{MAX_STEPS}")
    if fe.interface is None:
        raise IrgenError(f"--decode: the {fe.name} frontend cannot read a model's declared inputs "
                         "(Frontend.interface); --decode needs it")
    iface = fe.interface(model, {})
    r = roles(iface)
    tokens = prompt_tokens(r, given, shapes, seed, limit)
    cache: dict[str, np.ndarray] = {}
    length, record = 0, []
    protect = [("the model", model), *(("the prompt", Path(g.partition("=")[2] or g)) for g in given)]
    with OutputFolder(out, force, protect) as folder:
        for k in range(steps + 1):
            progress.step("decode steps", k, steps + 1)
            feeds = step_feeds(r, iface, tokens, cache, length)
            name = STEP_NAME.format(k)
            run_step(folder.tmp / name, {n: tuple(a.shape) for n, a in feeds.items()},
                     {n: (a, f"step {k}'s {n}") for n, a in feeds.items()})
            values = _read_outputs(folder.tmp / name, [r.logits, *(p.present for p in r.pairs)], backend, limit)
            nxt = np.argmax(values[r.logits][:, -1, :], axis=-1).astype(r.tokens.dtype)[:, None]
            record.append({"step": k, "folder": name, "cache_length": length, "tokens": tokens.tolist(),
                           "next_token": nxt[:, 0].tolist()})
            length += tokens.shape[1]
            cache = {p.past: values[p.present] for p in r.pairs}
            tokens = nxt
        progress.step("decode steps", steps + 1, steps + 1)
        trace = {"model": str(model), "steps": record, "logits": r.logits,
                 "cache": [{"input": p.past, "output": p.present, "axis": p.axis} for p in r.pairs]}
        (folder.tmp / TRACE_FILE).write_text(json.dumps(trace, indent=1) + "\n")
    return trace
