"""The checks and graph fixes before TVM's importer (:func:`prepare`), and the op check
(:func:`check_ops`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from irgen.plugin import UnsupportedOpsError

from . import checks, loader
from .constants import fold_quantization_constants
from .fakequant import lower_fakequantize
from .fold import (explicit_auto_pads, fold_4bit_weights, fold_requantized_weights,
                   fold_shape_computations, fuse_erf_gelu, quantize_inputs_first, standard_8bit_qdq)
from .inline import inline_constant_ifs
from .loader import all_graphs
from .float8 import check_float8_nodes, fold_float8_weights
from .nbits import lower_block_weights
from .order import sort_graphs
from .propagate import propagate_qdq
from .qonnx import IRGEN_MARK, lower_qonnx


def prepare(path: Path, options: dict[str, Any], for_tvm: bool = True, keep_fakequantize: bool = False,
            defer: bool | None = None):
    """The model in ``path``, checked and ready for import, and its input specs.

    Every check runs before TVM's importer (which folds constants, so a size
    bomb would be allocated while importing): the file and its external data
    (:mod:`.loader`), the graph's structure and tensors, ``onnx.checker``, the
    ops TVM knows, ``--input-shape``, and the size of every tensor whose shape
    is known statically (:mod:`.checks`). Nodes out of topological order are sorted
    as ONNX Runtime sorts them (:mod:`.order`), and QONNX ``Quant`` nodes lowered to the
    QuantizeLinear/DequantizeLinear they compute (:mod:`.qonnx`: neither TVM nor ONNX Runtime runs them),
    and so are OpenVINO ``FakeQuantize`` nodes (:mod:`.fakequant`; ``keep_fakequantize``: not, for
    OpenVINO). ``If`` nodes with a constant
    condition are replaced by their branch (:mod:`.inline`). ``for_tvm=False``
    (ONNX Runtime, which runs any op and any If) skips the op check and keeps
    an If with a condition computed at run time. For TVM, values computed from the
    fixed input shapes are folded to constants, and so are the constant subgraphs that end in a
    Q/DQ operand, as ONNX Runtime folds them (:mod:`.constants`), Q/DQ pairs are propagated
    past data movements as ONNX Runtime propagates them (:mod:`.propagate`), ``auto_pad`` becomes explicit ``pads``
    and the erf form of GELU becomes one ``Gelu`` node (:mod:`.fold`). ``defer`` (default: ``for_tvm``):
    large top-level initializers stay in their file until read (:func:`.loader.tensor_array`)."""
    path = Path(path)
    limit = checks.default_limit(options)
    model = loader.load_model(path, limit, defer=for_tvm if defer is None else defer)
    for node in loader.all_nodes(model):  # only irgen marks nodes ("irgen: ...": fold.INVENTED, nbits.SOURCE_OP,
        if node.doc_string.startswith(IRGEN_MARK):  # qonnx.RANGE), never the file
            node.doc_string = ""
    checks.check_structure(model, path)
    sort_graphs(model, path)  # as ONNX Runtime sorts on load; before anything that walks the nodes in order
    checks.check_tensors(model, path, limit)
    lower_qonnx(model, path)  # QONNX Quant -> Q/DQ, for TVM and ONNX Runtime alike (neither has a kernel for it)
    if not keep_fakequantize:  # kept for OpenVINO, the source runtime of such a model (:mod:`.openvino_runner`)
        lower_fakequantize(model, path)  # OpenVINO FakeQuantize -> Q/DQ
    if for_tvm:
        from .qoperator import to_qdq

        to_qdq(model)  # QOperator-format nodes -> their QDQ node units (ONNX Runtime runs the original)
        lower_block_weights(model, path)  # MatMulNBits, block DequantizeLinear of 4-bit weights (.nbits)
        check_float8_nodes(model, path)  # float8 Q/DQ: what is not realized, refused naming the node (.float8)
        fold_float8_weights(model, path)  # float8 weights -> float32, as ONNX Runtime dequantizes them
        check_ops(model, path)
    checks.run_checker(checks.skeleton(model), path)
    inline_constant_ifs(model, path, refuse_dynamic=for_tvm)
    specs = checks.input_specs(model, options.get("input_shapes") or {}, limit, path)
    checks.check_sizes(model, checks.skeleton(model), specs, limit, path)
    if for_tvm:
        fold_4bit_weights(model)  # first: a 4-bit constant may feed the shape arithmetic
        standard_8bit_qdq(model)
        fold_quantization_constants(model, path, limit)  # Clip/Identity/Q... of initializers, as ORT folds them
        fold_shape_computations(model, specs)
        fold_requantized_weights(model)
        quantize_inputs_first(model)
        propagate_qdq(model)  # Q/DQ pairs moved past MaxPool, Reshape..., as ORT's QDQPropagationTransformer
        explicit_auto_pads(model, specs)
        fuse_erf_gelu(model)
    return model, specs


def checked_model(path: Path, options: dict[str, Any] | None = None, for_tvm: bool = True,
                  keep_fakequantize: bool = False, defer: bool | None = None):
    """The checked model (see :func:`prepare`)."""
    return prepare(path, options or {}, for_tvm, keep_fakequantize, defer)[0]


def check_ops(model, path: Path) -> None:
    """Refuse a model with ops neither TVM's importer nor irgen's own converters
    (:data:`.converters.CONVERTERS`: LSTM, GRU, RNN) convert (``If`` and ``Constant`` are
    handled by the importer itself), naming up to 50 of them."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    from .converters import CONVERTERS

    known = set(_get_convert_map()) | set(CONVERTERS) | {"If", "Constant"}
    missing = sorted({n.op_type for g in all_graphs(model.graph) for n in g.node if n.op_type not in known})
    if missing:
        raise UnsupportedOpsError(f"onnx frontend ({path.name})", [loader.q(m)[1:-1] for m in missing[:50]])
