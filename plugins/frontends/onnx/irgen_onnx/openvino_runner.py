"""The source runner of an ONNX model with OpenVINO ``FakeQuantize`` nodes (NNCF's torch
backend exported without ``nncf.strip``): OpenVINO's CPU plugin, the runtime such a model is
written for (ONNX Runtime has no kernel for FakeQuantize).

OpenVINO reads the checked model as the file has it, FakeQuantize nodes included, and its
low-precision transformations run the quantized convolutions as int8 kernels (u8 or i8
activations, i8 weights) whose requantization, the next FakeQuantize, is fused into the
kernel in float32. irgen's golden data computes the QuantizeLinear/DequantizeLinear graph the
FakeQuantize nodes are lowered to (:mod:`.fakequant`) as ONNX Runtime's integer kernels do;
the two differ where a value lies on a rounding boundary, so this runner is not ``exact``:
verify allows its ``max_lsb`` (:data:`MAX_LSB`) per layer, not 0.

Every tensor the check asks for is made an output of the model before it is compiled
(``Model.add_outputs``). A tensor irgen's layers name that the file does not have (the
integers of a lowered activation FakeQuantize, ``<output>_quantized``) is computed from the
FakeQuantize's float output, which lies on its quantization grid:
``clip(round(value / scale) + zero point)``. Exposing an intermediate tensor keeps OpenVINO
from fusing across it, so the model then runs with more kernel boundaries than without (on an
NNCF ResNet-18, 302 of the 512 values of the last quantizer move, by up to 6 LSB); each layer is
checked within that one run, from its own inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from irgen.plugin import IrgenError

from .fakequant import DOMAINS, is_fakequantize, lower_fakequantize

#: the OpenVINO release irgen is tested with (the ``test`` extra pins it)
OPENVINO = "openvino==2026.4.1"
#: CPU plugin settings: float ops in float32 (not bf16 or f16 on CPUs that have them), one thread
CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1}
#: the LSB a layer may differ from OpenVINO by, recomputed from OpenVINO's own inputs: its kernels
#: requantize in float32 with a float bias where ONNX Runtime's add an int32 bias and round once
MAX_LSB = 1


def has_fakequantize(model) -> bool:
    """Whether the model's top-level graph holds an OpenVINO ``FakeQuantize`` node."""
    return any(is_fakequantize(n) for n in model.graph.node)


def _requantized(value: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: int | None) -> np.ndarray:
    """The integers of a FakeQuantize's float output (on its grid): ``clip(round(value / scale) + zero)``."""
    value = np.asarray(value, np.float32)
    shape = [1] * value.ndim
    if axis is not None:
        shape[axis] = -1
    info = np.iinfo(zero.dtype)
    ints = np.round(value / np.asarray(scale, np.float32).reshape(shape)) + zero.astype(np.int64).reshape(shape)
    return np.clip(ints, info.min, info.max).astype(zero.dtype)


def _kernels(compiled) -> str:
    """What OpenVINO's CPU plugin compiled: how many convolutions and matrix products run in int8."""
    counts: dict[str, list[int]] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        kind = info["layerType"].astype(str) if "layerType" in info else ""
        if kind in ("Convolution", "FullyConnected", "MatMul"):
            prec = info["runtimePrecision"].astype(str) if "runtimePrecision" in info else ""
            total = counts.setdefault(kind.lower(), [0, 0])
            total[0] += prec in ("u8", "i8")
            total[1] += 1
    ops = ", ".join(f"{n} of {t} {kind}s" for kind, (n, t) in sorted(counts.items()))
    return (f"CPU, low-precision transformations ({ops or 'no convolution'} in int8), float ops in float32, "
            f"every compared tensor made an output")


def openvino_source_runner(path: Path, model, options: dict[str, Any]):
    """OpenVINO's CPU plugin on ``model`` (checked, its FakeQuantize nodes kept), every
    requested tensor made an output; see the module text."""
    try:
        import openvino as ov
    except ImportError as err:
        raise IrgenError(f"onnx source check of {path.name}: its OpenVINO FakeQuantize nodes (domain "
                         f"{DOMAINS[0]}) run in OpenVINO, ONNX Runtime has no kernel for them: pip install "
                         f"{OPENVINO} ({err})") from None
    lowered = type(model)()
    lowered.CopyFrom(model)
    quantizers: dict[str, tuple] = {}
    lower_fakequantize(lowered, path, quantizers)  # the names irgen's layers give the integers
    produced = {o for n in model.graph.node for o in n.output if o} | {i.name for i in model.graph.input}
    data = model.SerializeToString()

    def run(inputs: dict[str, Any], tensors: list[str]) -> dict[str, Any]:
        core = ov.Core()
        m = core.read_model(data)
        sources = {t: t if t in produced else quantizers[t][0] for t in tensors if t in produced or t in quantizers}
        have = {name for o in m.outputs for name in o.get_names()}
        inputs_by_name = {name for i in m.inputs for name in i.get_names()}
        for name in sorted(set(sources.values()) - have - inputs_by_name):
            try:
                m.add_outputs([name])
            except RuntimeError:  # a tensor OpenVINO's reader did not keep: not given
                continue
        compiled = core.compile_model(m, "CPU", CONFIG)
        feeds = {i.get_any_name(): np.asarray(inputs[n]) for i in compiled.inputs
                 for n in i.get_names() if n in inputs}
        result = compiled.create_infer_request().infer(feeds)
        values: dict[str, Any] = {}
        for port, value in result.items():
            values.update((name, np.array(value)) for name in port.get_names())
        values.update(inputs)
        out = {}
        for t, src in sources.items():
            if src not in values:
                continue
            out[t] = _requantized(values[src], *quantizers[t][1:]) if t in quantizers and t not in produced \
                else values[src]
        run.kernels = _kernels(compiled)
        return out

    run.runtime = f"openvino {ov.__version__.split('-')[0]}"
    run.kernels = "CPU, low-precision transformations"
    run.exact = False  # OpenVINO's kernels are not the integer arithmetic the qdq scheme reproduces
    run.max_lsb = MAX_LSB
    return run
