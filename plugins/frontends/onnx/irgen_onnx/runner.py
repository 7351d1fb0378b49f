"""The ONNX source runner for ``irgen verify --mode source``: ONNX Runtime on the
checked model, every requested tensor made a graph output (:func:`source_runner`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from irgen.plugin import IrgenError

from .prepare import checked_model


def _typed(model):
    """``model`` with the types ONNX shape inference finds (``model`` itself if it fails)."""
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001  fall back to untyped outputs
        return model


def _is_quantized(model) -> bool:
    """Whether the graph holds QuantizeLinear or DequantizeLinear nodes (QDQ format)."""
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)


def _with_outputs(model, tensors: list[str]):
    """A copy of ``model`` whose graph outputs also hold every tensor of ``tensors`` a node produces."""
    import onnx

    produced = {o for n in model.graph.node for o in n.output if o}
    value_info = {v.name: v for v in model.graph.value_info}
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for name in tensors:
        if name in produced and name not in have:
            m.graph.output.append(value_info[name] if name in value_info else onnx.ValueInfoProto(name=name))
            have.add(name)
    return m


def _session_options(quantized: bool):
    """Float models: no graph optimization (each node as written); quantized models: ORT's default
    optimizations and ``session.qdqisint8allowed=1``, so every Q/DQ group runs as an integer kernel."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if not quantized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    else:  # int8-activation Q/DQ groups run as integer kernels too (else ORT runs some in float on x86)
        so.add_session_config_entry("session.qdqisint8allowed", "1")
    return so


def source_runner(path: Path, options: dict[str, Any]):
    """ONNX Runtime on the model, every requested tensor made a graph output.

    Types come from an ONNX shape-inferred copy. Float models run without
    graph optimizations (each node as written); quantized (QDQ) models with
    ONNX Runtime's default optimizations and ``session.qdqisint8allowed=1``,
    which fuse every QDQ group into the integer kernels irgen reproduces."""
    try:
        import onnx  # noqa: F401  the runner's steps import it
        import onnxruntime as ort
    except ImportError as err:
        raise IrgenError(f"onnx source check needs onnxruntime ({err})") from None
    model = _typed(checked_model(path, options, for_tvm=False))
    quantized = _is_quantized(model)

    def run(inputs: dict[str, Any], tensors: list[str]) -> dict[str, Any]:
        m = _with_outputs(model, tensors)
        sess = ort.InferenceSession(m.SerializeToString(), _session_options(quantized), providers=["CPUExecutionProvider"])
        feeds = {i.name: inputs[i.name] for i in sess.get_inputs() if i.name in inputs}
        names = [o.name for o in sess.get_outputs()]
        values = dict(zip(names, sess.run(names, feeds)))
        values.update({k: v for k, v in inputs.items()})
        return {t: values[t] for t in tensors if t in values}

    run.runtime = f"onnxruntime {ort.__version__}"
    run.kernels = ("CPU; Q/DQ groups fused into integer kernels (session.qdqisint8allowed=1)" if quantized
                   else "CPU; no graph optimization")
    return run
