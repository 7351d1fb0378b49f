"""Diagnosis: which known hardware bug a locally wrong layer output looks like.

:data:`SIGNATURES` is the table ``irgen compare`` checks, one :class:`irgen.api.Signature`
per row: its ``code`` (the fixed vocabulary :data:`irgen.api.SIGNATURE_CODES`), the check
and what it looks for. A check gets an :class:`irgen.api.Mismatch` (the device's value,
what the layer computes from the device's own inputs, the layer's record) and returns its
evidence, a sentence, or None. Every check builds *candidates*, what the device would
have written with that bug, and asks :meth:`irgen.api.Mismatch.explains` whether one
matches the device where it is wrong and breaks nothing where it is right; plugins add
rows through ``irgen_register_signatures`` (checked first: a backend knows its hardware).

Most integer checks reason on the layer's requantization as real numbers,
:class:`Requant`: ``y = clamp(round(pre) + zp)`` with ``pre`` the accumulator times the
real multiplier ``s_x * s_w / s_y`` of a convolution or dense layer (the accumulator
recomputed from the inputs, the weights and the ``quant`` record's zero points and bias),
or the rescaled inputs of an add. Its rounding is calibrated on the layer's own expected
output, and a model that does not reproduce it (98% of the values) is not used. A
variant's candidate is the expected output plus what the variant changes in the model
(:meth:`Requant.candidate`), so the model's own rounding noise cancels out.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from irgen.api import SIGNATURE_CODES, Mismatch, Signature

__all__ = ["SIGNATURES", "ROUNDINGS", "Requant", "requant_model", "diagnose", "SIGNATURE_CODES"]

#: the rounding modes a requantization may use
ROUNDINGS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "half to even": np.rint,
    "half away from zero": lambda x: np.sign(x) * np.floor(np.abs(x) + 0.5),
    "half up": lambda x: np.floor(x + 0.5),
    "half down": lambda x: np.ceil(x - 0.5),
    "floor": np.floor,
    "ceil": np.ceil,
    "truncation": np.trunc,
}
#: a model that reproduces less of the expected output is not used
MIN_FIT = 0.98
_SHIFTS = (1, -1, 2, -2, 3, -3, 4, -4)


def _scalar(v: Any) -> float:
    return float(np.asarray(v, np.float64).reshape(-1)[0])


def _vector(v: Any) -> np.ndarray:
    return np.asarray(v, np.float64).reshape(-1)


def _along(v: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """A per-channel vector shaped to broadcast along ``axis`` of an ``ndim``-D array."""
    shape = [1] * ndim
    shape[axis] = -1
    return np.asarray(v).reshape(shape)


@dataclass
class Requant:
    """A requantizing layer's output as real arithmetic: ``clamp(round(pre) + zp, lo, hi)``.

    ``pre`` (float64, the output's shape) is the value rounded; ``zp`` the output zero
    point; ``lo``/``hi`` the layer's clamp and ``dmin``/``dmax`` its dtype's range;
    ``rounding`` the mode (:data:`ROUNDINGS`) that reproduces the expected output best, on
    ``fit`` of its values (``reliable``: where it does; variants are judged there only);
    ``wraps``: the golden data wraps into the dtype rather than saturating. A convolution
    or dense layer also has ``acc`` (the int64 accumulator, ``bias`` included), ``scales``
    (its real multiplier per output channel) along ``axis``, and
    ``pre_with(zp_factor)`` (``pre`` with the input zero point left out, 0, or applied
    twice, 2); an add has ``pre_with`` only."""

    pre: np.ndarray
    zp: int
    lo: int
    hi: int
    dmin: int
    dmax: int
    rounding: str = "half to even"
    fit: float = 0.0
    wraps: bool = False
    reliable: np.ndarray | None = field(default=None, repr=False)
    acc: np.ndarray | None = None
    bias: np.ndarray | None = None
    scales: np.ndarray | None = None
    axis: int | None = None
    pre_with: Callable[[int], np.ndarray] | None = field(default=None, repr=False)

    def out(self, pre: np.ndarray | None = None, zp: int | None = None, rounding: str | None = None,
            lo: int | None = None, hi: int | None = None, wrap: bool | None = None) -> np.ndarray:
        """The output (int64) with any part of the arithmetic replaced."""
        v = ROUNDINGS[rounding or self.rounding](self.pre if pre is None else pre) + (self.zp if zp is None else zp)
        if self.wraps if wrap is None else wrap:
            span = self.dmax - self.dmin + 1
            return (np.mod(v - self.dmin, span) + self.dmin).astype(np.int64)
        return np.clip(v, self.lo if lo is None else lo, self.hi if hi is None else hi).astype(np.int64)

    @property
    def slack(self) -> float:
        """The share of values a variant's candidate may miss: the model's own noise (near a
        rounding tie the model and the layer's arithmetic can differ), four times over."""
        return max(0.001, 4 * (1.0 - self.fit))

    def candidate(self, expected: np.ndarray, **variant: Any) -> np.ndarray:
        """``expected`` changed where, and as, the variant changes the model's output."""
        return expected.astype(np.int64) + self.out(**variant) - self.out()

    def channel_pre(self, scales: np.ndarray, acc: np.ndarray | None = None) -> np.ndarray:
        """``pre`` with other per-channel multipliers (or another accumulator)."""
        return (self.acc if acc is None else acc) * _along(scales, self.axis, self.acc.ndim)


def _weight_zero(q: dict, w: np.ndarray) -> np.ndarray:
    zp = _vector(q["weight"].get("zero_point") or 0)
    axis = q["weight"].get("axis")
    if zp.size == 1 or axis is None:
        return np.int64(int(zp[0]))
    return _along(zp.astype(np.int64), int(axis), w.ndim)


def _mac(m: Mismatch, q: dict) -> tuple[Callable[[int], np.ndarray], int, np.ndarray] | None:
    """(accumulator of the inputs less ``factor`` times the input zero point, channel axis, bias)
    of a convolution or dense layer, bias included."""
    from irgen import reference

    if "weight" not in m.params or not m.inputs:
        return None
    x = np.asarray(m.inputs[0]).astype(np.int64)
    w = np.asarray(m.params["weight"]).astype(np.int64) - _weight_zero(q, np.asarray(m.params["weight"]))
    zx = int(_scalar(q["inputs"][0].get("zero_point") or 0))
    if m.layer["op"] == "dense":
        layout = ((m.layer.get("params") or {}).get("weight") or {}).get("layout") or "IO"
        wm = w.T if layout == "OI" else w
        acc = lambda factor: np.matmul(x - factor * zx, wm)  # noqa: E731
        axis = x.ndim - 1
    else:
        attrs = {**(m.layer.get("attrs") or {}), "out_dtype": "int64"}
        conv = reference.conv3d if w.ndim == 5 else reference.conv2d
        acc = lambda factor: conv(x - factor * zx, w, attrs)  # noqa: E731
        axis = str(attrs.get("out_layout") or attrs.get("data_layout") or "NCHW").index("C")
    bias = m.params.get("bias")
    if bias is None:
        return acc, axis, np.int64(0)
    b = _along(np.asarray(bias).astype(np.int64).reshape(-1), axis, x.ndim)
    return (lambda factor: acc(factor) + b), axis, b


def _mac_model(m: Mismatch, q: dict) -> Requant | None:
    mac = _mac(m, q)
    if mac is None:
        return None
    acc_of, axis, bias = mac
    s_x, s_y = _scalar(q["inputs"][0]["scale"]), _scalar(q["output"]["scale"])
    scales = s_x * _vector(q["weight"]["scale"]) / s_y
    acc = acc_of(1)
    if acc.shape != m.expected.shape or scales.size not in (1, acc.shape[axis]):
        return None
    scales = np.broadcast_to(scales, (acc.shape[axis],)).copy()
    model = _requant(m, q, acc * _along(scales, axis, acc.ndim))
    model.acc, model.scales, model.axis, model.bias = acc, scales, axis, bias
    model.pre_with = lambda factor: acc_of(factor) * _along(scales, axis, acc.ndim)
    return model


def _add_model(m: Mismatch, q: dict) -> Requant | None:
    ins = q.get("inputs") or []
    if len(ins) != 2 or len(m.inputs) != 2:
        return None
    s_y = _scalar(q["output"]["scale"])
    a, b = (np.asarray(v).astype(np.float64) for v in m.inputs[:2])
    (sa, za), (sb, zb) = ((_scalar(r["scale"]), _scalar(r.get("zero_point") or 0)) for r in ins)

    def pre_with(factor: int) -> np.ndarray:
        return (a - factor * za) * (sa / s_y) + (b - factor * zb) * (sb / s_y)

    pre = pre_with(1)
    if pre.shape != m.expected.shape:
        return None
    model = _requant(m, q, pre)
    model.pre_with = pre_with
    return model


def _requant(m: Mismatch, q: dict, pre: np.ndarray) -> Requant:
    """The model of ``pre``'s requantization, its rounding and saturation calibrated on the expected output."""
    info = np.iinfo(m.expected.dtype)
    lo, hi = (int(v) for v in (q.get("clamp") or (info.min, info.max)))
    model = Requant(pre, int(_scalar(q["output"].get("zero_point") or 0)), lo, hi, int(info.min), int(info.max))
    rq = q.get("requant") or {}
    said = f"{rq.get('rounding')} {rq.get('rounding_rule')}".lower().replace("_", " ")
    modes = sorted(ROUNDINGS, key=lambda name: name not in said)  # on a tie, the mode the record names
    best = (-1.0, "", False)
    for wraps in (False, True):
        for name in modes:
            fit = float(np.mean(model.out(rounding=name, wrap=wraps) == m.expected))
            if fit > best[0]:
                best = (fit, name, wraps)
    model.fit, model.rounding, model.wraps = best
    model.reliable = model.out() == m.expected
    return model


#: quant record kind -> the model of its requantization
MODELS: dict[str, Callable[[Mismatch, dict], Requant | None]] = {
    **dict.fromkeys(("conv2d", "depthwise_conv2d", "conv3d", "depthwise_conv3d", "dense"), _mac_model),
    "add": _add_model}


def requant_model(m: Mismatch) -> Requant | None:
    """The :class:`Requant` model of the mismatched layer (cached on ``m``), or None: not an
    integer layer of a modelled kind, a merged or followed layer, or a model that does not
    reproduce the expected output."""
    if "_requant" not in m.__dict__:
        m.__dict__["_requant"] = None
        q = m.layer.get("quant") or {}
        build = MODELS.get(str(q.get("kind")))
        if build is not None and m.integer and m.output == 0 and not q.get("steps") and not q.get("fused_after"):
            try:
                model = build(m, q)
            except (KeyError, TypeError, ValueError, IndexError, NotImplementedError):
                model = None
            if model is not None and model.fit >= MIN_FIT:
                m.__dict__["_requant"] = model
    return m.__dict__["_requant"]


def _first(m: Mismatch, candidates, model: Requant | None = None) -> str | None:
    """The evidence of the first (evidence, candidate) whose candidate explains the difference;
    a ``model``'s candidates are judged where it is reliable, with its noise as slack."""
    where, slack = (None, 0.001) if model is None else (model.reliable, model.slack)
    for detail, cand in candidates:
        if cand is not None and m.explains(cand, where=where, slack=slack):
            return detail
    return None


def _changed(model: Requant, expected: np.ndarray, **variant: Any) -> np.ndarray | None:
    """The model's candidate of a variant, or None when the variant changes nothing."""
    cand = model.candidate(expected, **variant)
    return None if np.array_equal(cand, expected) else cand


# ------------------------------------------------------------------ data order: layout, byte order, offset


def _orders(ndim: int):
    return [p for p in itertools.permutations(range(ndim)) if p != tuple(range(ndim))] if 2 <= ndim <= 5 else []


def _reorders(a: np.ndarray):
    """(order, whether the array was written in that order (else read as if it were), the
    array so) for every other axis order: all the writes first."""
    for wrote in (True, False):
        for p in _orders(a.ndim):
            if wrote:
                yield p, True, np.ascontiguousarray(a.transpose(p)).reshape(a.shape)
            else:
                yield p, False, np.ascontiguousarray(a.reshape([a.shape[i] for i in p]).transpose(np.argsort(p)))


def _letters(layout: str | None, ndim: int) -> str:
    return layout if layout and len(layout) == ndim else "abcdefgh"[:ndim]


def check_layout(m: Mismatch) -> str | None:
    """The output stored in another axis order, or computed with a weight read in one."""
    phys = m.to_physical(m.expected)
    letters = _letters(m.physical_layout or m.layout, phys.ndim)
    for p, wrote, cand in _reorders(phys):
        order = "".join(letters[i] for i in p)
        if m.explains(m.to_logical(cand)):
            return (f"the output is stored in {order} order where {letters} is expected" if wrote
                    else f"the output is {letters} data addressed as {order}")
    weight = m.params.get("weight")
    if weight is None or np.ndim(weight) < 2:
        return None
    w_letters = _letters(((m.layer.get("params") or {}).get("weight") or {}).get("layout"), np.ndim(weight))
    seen = {np.asarray(weight).tobytes()}
    for p, wrote, w in _reorders(np.asarray(weight)):
        order = "".join(w_letters[i] for i in p)
        if w.tobytes() in seen:
            continue
        seen.add(w.tobytes())
        got = m.recompute(params={**m.params, "weight": w})
        if got is not None and m.explains(got[m.output]):
            how = f"read in {order} order where it is {w_letters}" if wrote else f"({w_letters}) addressed as {order}"
            return f"the output is computed with the weight {how}"
    return None


def check_byte_order(m: Mismatch) -> str | None:
    """Bytes swapped within each value, or values reversed within each memory word."""
    phys = m.to_physical(m.expected)
    size, flat = phys.dtype.itemsize, phys.reshape(-1)
    candidates = []
    if size > 1:
        candidates.append((f"the bytes of each {size * 8}-bit value are swapped (the other byte order)",
                           m.to_logical(phys.byteswap())))
    for k in (2, 4, 8):
        if k * size <= 8 and flat.size % k == 0:
            words = flat.reshape(-1, k)[:, ::-1].reshape(phys.shape)
            candidates.append((f"the {size * 8}-bit values are reversed within each {k * size * 8}-bit word "
                               "(the other byte order of a word)", m.to_logical(words)))
    return _first(m, candidates)


_AXIS_NAMES = {"C": "channel", "H": "row", "W": "column", "T": "token", "N": "sample", "D": "depth slice"}


def check_offset(m: Mismatch) -> str | None:
    """The data shifted in memory by one element, row or channel (the rest of it right)."""
    phys = m.to_physical(m.expected)
    flat, shape = phys.reshape(-1), phys.shape
    letters = _letters(m.physical_layout or m.layout, phys.ndim)
    strides = {}
    for axis in range(phys.ndim - 1, -1, -1):
        stride = int(np.prod(shape[axis + 1:], dtype=np.int64))
        if shape[axis] > 1 and stride not in strides and stride < flat.size:
            strides[stride] = letters[axis]
    for stride, letter in strides.items():
        for s in (stride, -stride):
            shifted, valid = np.zeros_like(flat), np.zeros(flat.size, bool)
            if s > 0:
                shifted[s:], valid[s:] = flat[:-s], True
            else:
                shifted[:s], valid[:s] = flat[-s:], True
            cand, where = m.to_logical(shifted.reshape(shape)), m.to_logical(valid.reshape(shape))
            if m.explains(cand, where=where):
                unit = "element" if stride == 1 and letter not in _AXIS_NAMES else _AXIS_NAMES.get(letter, "element")
                return (f"the data is shifted by one {unit} ({abs(s)} element(s) in memory, "
                        f"{'later' if s > 0 else 'earlier'} than expected)")
    return None


# ------------------------------------------------------------------ stale data, padding, border, clamp


def check_stale(m: Mismatch) -> str | None:
    """Zeros, a constant fill, another layer's golden output or another sample's, or a
    buffer written only in part."""
    dev, exp = m.device, m.expected
    if not np.any(dev) and np.any(exp):
        return "the output is all zeros: not written, or cleared"
    if dev.size > 1 and np.all(dev == dev.flat[0]) and not np.all(exp == exp.flat[0]):
        return f"every value is {dev.flat[0].item()}: a fill pattern, not the layer's output"
    for n, (label, other) in enumerate(m.others("output")):
        if n >= 64:
            break
        if m.explains(other):
            return f"the output equals {label}: a stale buffer"
    return _partial(m)


def _partial(m: Mismatch) -> str | None:
    """A buffer written in part: in memory order, every wrong value lies in a tail (or a head)
    that holds one value throughout."""
    real = m.to_physical(np.ones(m.device.shape, bool)).reshape(-1)
    wrong = m.to_physical(~m.same(m.device, m.expected)).reshape(-1)[real]
    values = m.to_physical(m.device).reshape(-1)[real]
    if np.count_nonzero(wrong) < 2:
        return None
    first, last = int(np.argmax(wrong)), int(wrong.size - 1 - np.argmax(wrong[::-1]))
    if first > 0 and np.all(values[first:] == values[first]):
        return f"only the first {first} of {wrong.size} values were written; the rest hold {values[first].item()}"
    if last < wrong.size - 1 and np.all(values[:last + 1] == values[0]):
        return f"the first {last + 1} of {wrong.size} values were not written; they hold {values[0].item()}"
    return None


def check_channel_padding(m: Mismatch) -> str | None:
    """Values that are not zero in the storage's channel padding."""
    pad = m.padding
    if pad is None or not np.any(pad):
        return None
    n = int(np.count_nonzero(pad))
    return f"{n} of {np.size(pad)} values in the channel padding are not zero (max |value| {np.abs(pad).max().item()})"


def _pads(layer: dict) -> tuple[int, int, int, int] | None:
    attrs = layer.get("attrs") or {}
    pad = attrs.get("padding", ((layer.get("quant") or {}).get("pool") or {}).get("padding"))
    if isinstance(pad, int):
        pad = [pad] * 4
    if not isinstance(pad, list) or len(pad) not in (2, 4) or not all(isinstance(p, int) for p in pad):
        return None
    return tuple(pad) if len(pad) == 4 else (pad[0], pad[1], pad[0], pad[1])


def _touched(n_out: int, n_in: int | None, before: int, after: int, stride: int, span: int | None) -> np.ndarray:
    """Output positions whose window reaches into the padding on one spatial axis."""
    r = np.arange(n_out) * stride - before
    if n_in is None or span is None:
        return (np.arange(n_out) < -(-before // stride)) | (np.arange(n_out) >= n_out - -(-after // stride))
    return (r < 0) | (r + span - 1 >= n_in)


def _window(m: Mismatch, axis: str) -> int | None:
    """The span of the layer's window (dilation included) along ``axis`` (``H`` or ``W``)."""
    attrs = m.layer.get("attrs") or {}
    size = attrs.get("pool_size") or ((m.layer.get("quant") or {}).get("pool") or {}).get("size")
    k = axis == "W"
    if isinstance(size, list) and len(size) == 2:
        return int(size[k])
    w = (m.layer.get("params") or {}).get("weight") or {}
    layout = str(attrs.get("kernel_layout") or w.get("layout") or "")
    if axis not in layout or len(layout) != len(w.get("shape") or ()):
        return None
    dil = attrs.get("dilation") or [1, 1]
    return (int(w["shape"][layout.index(axis)]) - 1) * int(dil[k]) + 1


def check_border(m: Mismatch) -> str | None:
    """Only the outputs whose window reaches into a convolution's or pool's padding differ."""
    letters, pads = m.layout, _pads(m.layer)
    if not pads or not any(pads) or not letters or "H" not in letters or "W" not in letters:
        return None
    if len(letters) != m.device.ndim:
        return None
    h, w = letters.index("H"), letters.index("W")
    wrong = ~m.same(m.device, m.expected)
    plane = wrong.any(axis=tuple(a for a in range(wrong.ndim) if a not in (h, w)))
    plane = plane if h < w else plane.T
    attrs = m.layer.get("attrs") or {}
    strides = attrs.get("strides") or ((m.layer.get("quant") or {}).get("pool") or {}).get("strides") or [1, 1]
    x = np.asarray(m.inputs[0]) if m.inputs else None
    in_layout = str(attrs.get("data_layout") or letters)
    size = (lambda a: int(x.shape[in_layout.index(a)]) if x is not None and len(in_layout) == x.ndim else None)
    rows = _touched(plane.shape[0], size("H"), pads[0], pads[2], int(strides[0]), _window(m, "H"))
    cols = _touched(plane.shape[1], size("W"), pads[1], pads[3], int(strides[1]), _window(m, "W"))
    ring = rows[:, None] | cols[None, :]
    if not plane.any() or (plane & ~ring).any() or ring.all():
        return None
    return (f"only the border differs: {int(np.count_nonzero(wrong))} values in positions whose window reaches "
            f"into the padding {list(pads)}; the interior is exact")


def _pre_activation(m: Mismatch) -> np.ndarray | None:
    """A float layer's output without its last op when that op is an activation (relu, clip)."""
    ops = m.layer.get("fused_ops") or []
    if m.integer or len(ops) < 2 or (ops[-1].get("relax_op") or ops[-1].get("op")) not in (
            "relax.nn.relu", "relax.clip", "relax.nn.relu6"):
        return None
    if (ops[-1].get("args") or [None])[0] != f"op:{len(ops) - 2}" or len(m.layer["outputs"]) != 1:
        return None
    got = m.recompute(layer={**m.layer, "results": [f"op:{len(ops) - 2}"]})
    return None if got is None else np.asarray(got[0]).astype(m.device.dtype)


def check_clamp(m: Mismatch) -> str | None:
    """An activation's bounds missing, or other bounds than the layer's."""
    dev, exp = m.device, m.expected
    lo, hi = dev.min().item(), dev.max().item()
    if lo >= hi or np.mean((dev > lo) & (dev < hi)) < 0.1:
        return None
    if (lo > exp.min() or hi < exp.max()) and m.explains(np.clip(exp, lo, hi)):
        return f"the output is clamped to [{lo}, {hi}] where the layer's values span [{exp.min().item()}, {exp.max().item()}]"
    model = requant_model(m)
    if model is not None and (model.lo, model.hi) != (model.dmin, model.dmax):
        return _first(m, [
            (f"the activation's bounds [{model.lo}, {model.hi}] are missing: saturated at the dtype's only",
             _changed(model, exp, lo=model.dmin, hi=model.dmax)),
            (f"the activation clamps to [{lo}, {hi}] where the layer's bounds are [{model.lo}, {model.hi}]",
             _changed(model, exp, lo=int(lo), hi=int(hi)))], model)
    pre = _pre_activation(m)
    if pre is None:
        return None
    return _first(m, [("the activation is missing: the output is the value before it", pre),
                      (f"the activation clamps to [{lo}, {hi}]", np.clip(pre, lo, hi))])


# ------------------------------------------------------------------ requantization


def check_rounding(m: Mismatch) -> str | None:
    """Another rounding mode in the requantization."""
    model = requant_model(m)
    if model is None:
        return None
    found = []
    for mode in ROUNDINGS:
        cand = None if mode == model.rounding else _changed(model, m.expected, rounding=mode)
        if cand is not None and m.explains(cand, where=model.reliable, slack=model.slack):
            found.append((mode, int(np.count_nonzero(cand != m.expected))))
    if not found:
        return None
    same = f" (or {', '.join(mode for mode, _ in found[1:])}: the same on these values)" if len(found) > 1 else ""
    return (f"the requantization rounds {found[0][0]}{same} where the layer rounds {model.rounding} "
            f"({found[0][1]} values one LSB off)")


def check_shift(m: Mismatch) -> str | None:
    """The requantization (or a float output) off by a power of two."""
    model = requant_model(m)
    if model is not None:
        return _first(m, ((f"the requantization is off by 2^{k} (a shift of {abs(k)} bit(s) too far "
                           f"{'left' if k > 0 else 'right'})", _changed(model, m.expected, pre=model.pre * 2.0 ** k))
                          for k in _SHIFTS), model)
    if m.integer:
        return None
    return _first(m, ((f"the output is off by 2^{k}", m.expected * m.expected.dtype.type(2.0 ** k)) for k in _SHIFTS))


def check_zero_point(m: Mismatch) -> str | None:
    """A zero point missing or applied twice: the output's, or the input's of the accumulation."""
    model, exp = requant_model(m), m.expected
    if model is not None:
        cands = []
        if model.zp:
            cands += [(f"the output zero point {model.zp} is missing", _changed(model, exp, zp=0)),
                      (f"the output zero point {model.zp} is applied twice", _changed(model, exp, zp=2 * model.zp))]
        if model.pre_with is not None:
            cands += [("the input zero point is missing", _changed(model, exp, pre=model.pre_with(0))),
                      ("the input zero point is applied twice", _changed(model, exp, pre=model.pre_with(2)))]
        return _first(m, cands, model)
    q = m.layer.get("quant") or {}
    zp = int(_scalar((q.get("output") or {}).get("zero_point") or 0)) if m.integer else 0
    if not zp:
        return None
    info = np.iinfo(exp.dtype)
    inner = (exp > info.min) & (exp < info.max)
    wide = exp.astype(np.int64)
    for how, cand in ((f"the output zero point {zp} is missing", wide - zp), (f"applied twice", wide + zp)):
        if m.explains(np.clip(cand, info.min, info.max), where=inner):
            return how if how.startswith("the") else f"the output zero point {zp} is {how}"
    return None


def check_bias(m: Mismatch) -> str | None:
    """The bias missing, doubled, or another layer's."""
    bias = m.params.get("bias")
    if bias is None:
        return None
    bias = np.asarray(bias)
    flat = bias.reshape(-1)
    variants = [("the bias is missing", np.zeros_like(bias)), ("the bias is added twice", bias * bias.dtype.type(2))]
    if np.unique(flat).size > 1:
        variants += [(f"the bias is applied to the channels {how}", v.reshape(bias.shape)) for how, v in (
            ("shifted by one", np.roll(flat, 1)), ("shifted back by one", np.roll(flat, -1)),
            ("in reverse order", flat[::-1].copy()))]
    variants += [(f"the bias is {label}", other) for n, (label, other) in enumerate(m.others("bias")) if n < 32]
    model = requant_model(m)
    for how, b in variants:
        got = m.recompute(params={**m.params, "bias": b})
        if got is not None and m.explains(got[m.output]):
            return how
        if model is not None and model.acc is not None and np.size(b) == np.size(model.bias):
            acc = model.acc - model.bias + _along(np.asarray(b).astype(np.int64).reshape(-1), model.axis, model.acc.ndim)
            if _first(m, [(how, _changed(model, m.expected, pre=model.channel_pre(model.scales, acc)))], model):
                return how
    return None


def check_per_channel(m: Mismatch) -> str | None:
    """One scale for every channel where they are per channel, or the channels' scales out of order."""
    model = requant_model(m)
    if model is None or model.scales is None or np.unique(model.scales).size < 2:
        return None
    s = model.scales
    one = [(f"channel {k}'s scale", s[k]) for k in (0, s.size - 1)] + [("the mean scale", s.mean())]
    cands = [(f"one scale ({what}) is used for every channel where they are per channel",
              _changed(model, m.expected, pre=model.channel_pre(np.full_like(s, v)))) for what, v in one]
    cands += [(f"the per-channel scales are applied {how}", _changed(model, m.expected, pre=model.channel_pre(v)))
              for how, v in (("in reverse channel order", s[::-1]), ("shifted by one channel", np.roll(s, 1)),
                             ("shifted back by one channel", np.roll(s, -1)))]
    return _first(m, cands, model)


def check_accumulator(m: Mismatch) -> str | None:
    """An accumulator narrower than the golden one: it wraps (or saturates) where the sum exceeds its width."""
    model = requant_model(m)
    if model is None or model.acc is None:
        return None
    acc = model.acc
    for bits in (16, 18, 20, 24, 32):
        lim = 1 << (bits - 1)
        over = int(np.count_nonzero((acc < -lim) | (acc >= lim)))
        if not over:
            continue
        scale = _along(model.scales, model.axis, acc.ndim)
        found = _first(m, [
            (f"the accumulator wraps at {bits} bits", _changed(model, m.expected, pre=(np.mod(acc + lim, 2 * lim) - lim) * scale)),
            (f"the accumulator saturates at {bits} bits", _changed(model, m.expected, pre=np.clip(acc, -lim, lim - 1) * scale))],
            model)
        if found:
            return f"{found}: {over} accumulator(s) exceed ±2^{bits - 1}"
    return None


def check_saturation(m: Mismatch) -> str | None:
    """Wrap-around where the golden data saturates, or saturation where it wraps."""
    model = requant_model(m)
    if model is None:
        return None
    beyond = int(np.count_nonzero((model.out(lo=-(1 << 62), hi=1 << 62) < model.dmin)
                                  | (model.out(lo=-(1 << 62), hi=1 << 62) > model.dmax)))
    if not beyond:
        return None
    if model.wraps:
        return _first(m, [(f"{beyond} values beyond [{model.dmin}, {model.dmax}] saturate where the golden data "
                           "wraps around", _changed(model, m.expected, wrap=False, lo=model.dmin, hi=model.dmax))],
                      model)
    return _first(m, [(f"{beyond} values beyond [{model.dmin}, {model.dmax}] wrap around where the golden data "
                       "saturates", _changed(model, m.expected, wrap=True))], model)


#: The signatures ``irgen compare`` checks, in this order (plugins' ones before them).
SIGNATURES: list[Signature] = [
    Signature("layout", "layout", check_layout, check_layout.__doc__),
    Signature("byte_order", "byte_order", check_byte_order, check_byte_order.__doc__),
    Signature("offset", "offset", check_offset, check_offset.__doc__),
    Signature("stale", "stale", check_stale, check_stale.__doc__),
    Signature("channel_padding", "channel_padding", check_channel_padding, check_channel_padding.__doc__),
    Signature("border", "border", check_border, check_border.__doc__),
    Signature("rounding", "rounding", check_rounding, check_rounding.__doc__),
    Signature("shift", "shift", check_shift, check_shift.__doc__),
    Signature("zero_point", "zero_point", check_zero_point, check_zero_point.__doc__),
    Signature("bias", "bias", check_bias, check_bias.__doc__),
    Signature("per_channel", "per_channel", check_per_channel, check_per_channel.__doc__),
    Signature("accumulator", "accumulator", check_accumulator, check_accumulator.__doc__),
    Signature("saturation", "saturation", check_saturation, check_saturation.__doc__),
    Signature("clamp", "clamp", check_clamp, check_clamp.__doc__),
]


def diagnose(m: Mismatch, extra: list[Signature] | tuple = ()) -> tuple[list[dict[str, str]], list[str]]:
    """Every signature of ``extra`` (plugins': a backend knows its hardware, so they come
    first) and :data:`SIGNATURES` whose check gives evidence: ``[{code, detail,
    signature}]``, one per code (the first signature of a code that matches), and notes on
    checks that failed (a check must not raise; one that does is named and skipped)."""
    found: list[dict[str, str]] = []
    notes: list[str] = []
    for sig in [*extra, *SIGNATURES]:
        if any(f["code"] == sig.code for f in found):
            continue
        try:
            detail = sig.check(m)
        except Exception as err:  # noqa: BLE001  a signature's own failure: named, the others go on
            notes.append(f"signature {sig.name!r} failed on layer {m.layer.get('name')!r:.80}: "
                         f"{type(err).__name__}: {' '.join(str(err).split())[:200]}")
            continue
        if detail:
            found.append({"code": sig.code, "detail": str(detail), "signature": sig.name})
    return found, notes
