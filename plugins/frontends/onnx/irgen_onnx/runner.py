"""The ONNX source runner for ``irgen verify --mode source``: ONNX Runtime on the
checked model, every requested tensor made a graph output (:func:`source_runner`), and
a recurrent node's per-step states (:mod:`irgen_onnx.recurrent`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from irgen.plugin import IrgenError

from .loader import _set_entries, deferred
from .prepare import checked_model
from .recurrent import states_values, states_wanted


def _typed(model):
    """``model`` with the types ONNX shape inference finds (``model`` itself if it fails)."""
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001  fall back to untyped outputs
        return model


def _is_quantized(model) -> bool:
    """Whether the graph holds QuantizeLinear or DequantizeLinear nodes (QDQ format), or MatMulNBits
    (one intra-op thread: MLAS gives a thread of one row its vector kernel, another order of sums),
    or DynamicQuantizeLSTM (one intra-op thread: each thread's batch rows quantize their ``h`` with a
    range of their own)."""
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear", "MatMulNBits", "DynamicQuantizeLSTM")
               for n in model.graph.node)


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


#: ONNX Runtime's session config entry that makes its uint8 x int8 kernels exact on every x86
#: CPU: without it a CPU without VNNI (AVX2, AVX-512 without VNNI) multiplies uint8
#: activations by int8 weights with ``vpmaddubsw``, which saturates pairs of products to int16,
#: so ``quantize_static``'s uint8 models differ from the integer arithmetic by up to tens of
#: LSB on some machines only. ORT then runs those kernels as uint8 x uint8; a model with int8
#: activations has no such kernels (ORT refuses it) and needs no such mode.
EXACT_U8S8 = ("session.x64quantprecision", "1")

#: ONNX Runtime's session config entry that makes a weight-only quantized MatMul (a
#: DequantizeLinear of 8- or 4-bit weights into a MatMul on a float or 16-bit activation, which
#: ORT rewrites to MatMulNBits) compute in float32 as the graph says. By default (accuracy
#: level 4) MatMulNBits quantizes the activation to int8 on the fly: ``quantize_static`` with
#: 16-bit activations then differs from DequantizeLinear -> MatMul -> QuantizeLinear by up to
#: ~150 LSB of int16 (measured on a BERT encoder), an approximation of ORT's, not the model's values.
FLOAT_MATMULNBITS = ("session.qdq_matmulnbits_accuracy_level", "1")


def session_options(quantized: bool, int8_kernels: bool = True, exact_u8s8: bool = False,
                    folder: str | None = None):
    """Float models: no graph optimization (each node as written); quantized models: ORT's default
    optimizations and (``int8_kernels``) ``session.qdqisint8allowed=1``, so every Q/DQ group runs
    as an integer kernel, and :data:`FLOAT_MATMULNBITS`; ``exact_u8s8``: :data:`EXACT_U8S8`;
    ``folder``: where the external data of a model given as bytes is (:func:`_data_in_place`)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if folder is not None:
        so.add_session_config_entry(EXTERNAL_FOLDER, folder)
    if not quantized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    else:
        # one intra-op thread: the float convolutions a QDQ model leaves (irgen_qdq.mlas) slice their
        # K by the positions each thread gets, so their last bits would follow the CPU count
        so.intra_op_num_threads = 1
    if quantized and int8_kernels:  # int8-activation Q/DQ groups run as integer kernels too (else ORT runs some in float on x86)
        so.add_session_config_entry("session.qdqisint8allowed", "1")
    if exact_u8s8:
        so.add_session_config_entry(*EXACT_U8S8)
    if quantized:
        so.add_session_config_entry(*FLOAT_MATMULNBITS)
    return so


def inference_session(model: bytes, quantized: bool, int8_kernels: bool = True, folder: str | None = None):
    """An ORT CPU session on the serialized ``model`` whose integer kernels compute the exact
    integer arithmetic whatever the CPU: :data:`EXACT_U8S8` for a quantized model, unless ORT
    has no kernel for it that way (int8 activations: their kernels are exact already) or cannot
    rewrite its weights (one weight shared by two nodes): then ORT's default kernels. ``folder``:
    where the model's external data is (:func:`_data_in_place`)."""
    import onnxruntime as ort

    cpu = ["CPUExecutionProvider"]
    exact = quantized
    if quantized:
        try:
            sess = ort.InferenceSession(model, session_options(True, int8_kernels, exact_u8s8=True, folder=folder),
                                        providers=cpu)
            sess.irgen_exact = True
            return sess
        except Exception as err:
            # NotImplemented: no uint8 x uint8 kernel of an int8 op (int8 activations: their default
            # kernels are exact). Fail "Attempt to replace the existing tensor": ORT's weight rewrite
            # names the uint8 copy after the int8 weight, once per consumer, so a weight two
            # convolutions share (a module called twice) fails: the default uint8 kernels may then
            # round intermediate sums on some CPUs
            if type(err).__name__ not in ("NotImplemented", "Fail"):
                raise
            exact = type(err).__name__ == "NotImplemented"
    sess = ort.InferenceSession(model, session_options(quantized, int8_kernels, folder=folder), providers=cpu)
    sess.irgen_exact = exact
    return sess


#: ONNX Runtime's session config entry naming the folder of the external data of a model given as bytes
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


def _data_in_place(m) -> str | None:
    """Point the large initializers the loader left in their files (:func:`.loader.deferred`:
    the model file itself, or the external data files it names, all checked by the loader) at
    those files as ONNX external data, for ONNX Runtime to map them in place rather than hold
    a copy of every weight in the model's bytes and another in its session; the folder they are
    in (None: ``m`` has no such tensors)."""
    folder = None
    for t in m.graph.initializer:
        info = deferred(t)
        if info is None:
            continue
        if "irgen_file" in info:
            where = Path(info["irgen_file"]).resolve()
            here, location = str(where.parent), where.name
        else:
            here, location = info["irgen_base"], info["irgen_location"]
        folder = folder or here
        if here != folder:  # the loader resolves both in the model's own folder
            raise IrgenError(f"onnx source check: the model's weights are in two folders ({folder}, {here})")
        _set_entries(t, {"location": location, "offset": info["offset"], "length": info["length"]})
    return folder


def source_runner(path: Path, options: dict[str, Any]):
    """ONNX Runtime on the model, every requested tensor made a graph output.

    Types come from an ONNX shape-inferred copy. Float models run without
    graph optimizations (each node as written); quantized (QDQ) models with
    ONNX Runtime's default optimizations and ``session.qdqisint8allowed=1``,
    which fuse every QDQ group into the integer kernels irgen reproduces, made exact
    on every x86 CPU (:func:`inference_session`). A model with OpenVINO ``FakeQuantize``
    nodes runs in OpenVINO instead (:mod:`irgen_onnx.openvino_runner`)."""
    from .openvino_runner import has_fakequantize, openvino_source_runner

    # large weights stay in the model's files: ONNX Runtime maps them (:func:`_data_in_place`)
    model = checked_model(path, options, for_tvm=False, keep_fakequantize=True, defer=True)
    if has_fakequantize(model):
        model = checked_model(path, options, for_tvm=False, keep_fakequantize=True)
        return openvino_source_runner(Path(path), model, options)
    try:
        import onnx  # noqa: F401  the runner's steps import it
        import onnxruntime as ort
    except ImportError as err:
        raise IrgenError(f"onnx source check needs onnxruntime: pip install onnxruntime==1.32.0 ({err})") from None
    model = _typed(model)
    quantized = _is_quantized(model)

    def run(inputs: dict[str, Any], tensors: list[str]) -> dict[str, Any]:
        stepped = states_wanted(model, tensors)  # recurrent nodes whose per-step states are asked for
        m = _with_outputs(model, tensors + [i for n in stepped.values() for i in n.input])
        folder = _data_in_place(m)
        sess = inference_session(m.SerializeToString(), quantized, folder=folder)
        del m
        # ORT's integer kernels in their exact configuration are the arithmetic the qdq scheme reproduces
        run.exact = quantized and getattr(sess, "irgen_exact", False)
        feeds = {i.name: inputs[i.name] for i in sess.get_inputs() if i.name in inputs}
        names = [o.name for o in sess.get_outputs()]
        values = dict(zip(names, sess.run(names, feeds)))
        values.update({k: v for k, v in inputs.items()})
        values.update(states_values(model, stepped, values))
        return {t: values[t] for t in tensors if t in values}

    run.runtime = f"onnxruntime {ort.__version__}"
    run.kernels = ("CPU; Q/DQ groups fused into integer kernels (session.qdqisint8allowed=1)" if quantized
                   else "CPU; no graph optimization")
    return run
