"""Small ONNX models for plugin tests: a float CNN and its int8 QDQ quantization.

Each function writes the model to ``path`` and returns ``path``; they import
``onnx`` (and ``onnxruntime`` for :func:`qdq_onnx`) when called, and raise
:class:`pytest.skip.Exception` when those are not installed (under pytest) or ImportError.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SHAPE = (1, 3, 8, 8)


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        try:
            import pytest
        except ImportError:
            raise
        pytest.skip(f"{module} is not installed")


def float_onnx(path: str | Path, seed: int = 0) -> Path:
    """conv+relu, max pool, conv+relu, a residual add, global average pool, flatten, dense
    (input ``x`` of shape ``SHAPE``, output ``y`` of shape (1, 4)); opset 13."""
    onnx = _need("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def init(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    n = helper.make_node
    nodes = [
        n("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"), n("Relu", ["c1"], ["r1"], name="relu1"),
        n("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
        n("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"), n("Relu", ["c2"], ["r2"], name="relu2"),
        n("Add", ["r2", "p1"], ["a"], name="add"), n("GlobalAveragePool", ["a"], ["g"], name="gap"),
        n("Flatten", ["g"], ["f"], name="flat"), n("Gemm", ["f", "wf", "bf"], ["y"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(
        nodes, "irgen_testing", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [init("w1", (8, 3, 3, 3)), init("b1", (8,)), init("w2", (8, 8, 3, 3)), init("b2", (8,)), init("wf", (4, 8)),
         init("bf", (4,))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return Path(path)


def qdq_onnx(path: str | Path, symmetric: bool = False, seed: int = 0, weight_symmetric: bool = True) -> Path:
    """:func:`float_onnx` quantized by ONNX Runtime's ``quantize_static`` (QDQ format, int8
    activations and per-channel int8 weights, calibrated on four seeded random inputs);
    ``symmetric``: activation zero points 0 too; ``weight_symmetric``: weight zero points 0."""
    _need("onnxruntime")
    path = Path(path)
    src = float_onnx(path.with_name(path.stem + ".float.onnx"), seed)
    quantize_qdq(src, path, extra_options={"ActivationSymmetric": symmetric, "WeightSymmetric": weight_symmetric})
    return path


def quantize_qdq(src: str | Path, dst: str | Path, **options) -> Path:
    """``src`` (one input ``x`` of shape ``SHAPE``) quantized by ONNX Runtime's ``quantize_static``
    into ``dst``: QDQ format, int8 activations, per-channel int8 weights, calibrated on four
    seeded random inputs; ``options`` are more ``quantize_static`` arguments."""
    _need("onnxruntime")
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.random.default_rng(k).standard_normal(SHAPE).astype(np.float32)} for k in range(4)])

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, **options)
    return Path(dst)


def input_npy(path: str | Path, shape=SHAPE, seed: int = 7) -> Path:
    """A seeded standard-normal float32 input for ``irgen run --input``."""
    np.save(path, np.random.default_rng(seed).standard_normal(shape).astype(np.float32))
    return Path(path)
