"""irgen's public plugin API: the one module a plugin imports.

A plugin (a frontend, a quantization scheme, a backend, a serializer) is a
distribution with an ``irgen`` entry point whose module implements the hooks of
:mod:`irgen.hookspecs`. It imports from irgen **this module only**::

    from irgen.plugin import hookimpl, Serializer

Every other irgen module (``irgen.api``, ``irgen.quant``, ``irgen.graph``,
``irgen.reference``, ``irgen.ir``, ``irgen.safeio``, ``irgen.names``, ...) is
private: its names may move or change in any release. ``irgen.hookimpl`` and
``irgen.api`` keep working for existing plugins, but new code imports here.

Versioning
----------

``API_VERSION`` is ``"MAJOR.MINOR"``. The minor number grows when names are
added to this module (or a function gains an optional argument); the major
number grows when a name is removed, renamed, or changes meaning (arguments,
return value, the records it writes). A plugin written against ``1.x`` works
with every ``1.y`` where ``y >= x``; it may check::

    import irgen.plugin
    major, minor = map(int, irgen.plugin.API_VERSION.split("."))
    assert major == 2 and minor >= 0

API 2.0 took every scheme's own arithmetic out of this module into the scheme's plugin
(docs/writing-a-plugin.md, "Schemes built on another scheme", lists where each name went),
renamed a shared primitive to a name that says what it computes, and made a scheme's
recompute and consistency check fields of its ``Quantizer``. API 2.1 added
``Quantizer.runtime_exact``; API 2.2 the recurrent layers' helpers; API 2.3
``Frontend.interface`` with ``ModelInterface`` and ``DeclaredTensor``; API 2.4 ``add_kernel`` and
``DeclaredTensor.path``.

Registration (what the hooks register)
--------------------------------------

* ``hookimpl``: the pluggy marker of a hook implementation
  (``@hookimpl def irgen_register_serializers(register): ...``).
* ``Frontend``, ``Quantizer``, ``Backend``, ``Serializer``: the objects a plugin
  registers; their docstrings give every field.
* ``Quantizer.recompute`` and ``Quantizer.consistency`` (2.0): what ``irgen verify`` asks a
  layer's scheme (the quantizer registered under the name its ``quant.scheme`` holds):
  ``recompute`` maps a quant kind to ``fn(layer, inputs, params) -> np.ndarray``, the integer
  output recomputed from the ``quant`` record, the inputs and the parameters alone (``"*"``:
  every kind without its own entry); ``consistency(layer) -> str | None`` says why a conv/dense
  layer's derived requantization values (multipliers, shifts) do not follow from its scales.
  irgen knows no scheme by name: a scheme without a recompute of a kind has those layers
  checked by their ``fused_ops`` alone, and verify says so. A scheme built on another scheme
  declares that plugin as a dependency and starts from its documented tables
  (``Quantizer(recompute={**base.RECOMPUTE, "conv2d": mine})``).
  ``Quantizer.runtime_exact`` (2.1): the scheme's integer layers are the source runtime's
  integer kernels bit for bit, so verify allows them no LSB of local difference where the
  runtime ran those kernels; a scheme with arithmetic of its own leaves it False.
* ``FusionRule`` and ``ATTENTION_FUSION``: a backend's layer-forming rules
  (``Backend.fusion_rules``); ``ATTENTION_FUSION`` folds softmax attention into one layer.
  ``FusionRule.requantized_followers`` (1.2): in quantized models the rule also merges
  followers that requantize (a residual add after a convolution, a relu table); such a
  layer's ``quant`` is ``kind: "fused"`` with ``steps`` (one scheme record per merged
  layer), which ``check_layer`` and serializers then meet; ``FusionRule``'s docstring
  says which followers join.
* ``ModelInterface``, ``DeclaredTensor`` (2.3): what ``Frontend.interface`` returns, a model
  file's declared inputs and outputs with open dimensions as symbols (``irgen run --decode``);
  ``DeclaredTensor.path`` (2.4): a tensor's place in the structure the model returns.
* ``ImportedModel``, ``InputSpec``, ``Provenance``: what a frontend returns
  (the Relax module, its inputs, and which source nodes each binding came from).
* ``TensorInfo``, ``StoredTensor``, ``TENSOR_KINDS`` (1.1): what
  ``Backend.store_tensor`` is told about a tensor it stores (kind, parameter role,
  logical layout, the layer's op) and what it returns (main file, extra files, the
  ``storage`` record irgen writes into ``ir.json`` and ``manifest.json``).
* ``IrgenError``: the one exception irgen reports as a message, not a traceback;
  ``UnsupportedOpsError`` lists the source ops a frontend cannot import.
* ``QUANT_DIALECTS``: the quantization dialects frontends declare
  (``Frontend.quant_dialect``) and schemes detect (``qg.dialect``), each with what
  its quantize/dequantize ops mean.
* ``Signature``, ``Mismatch``, ``SIGNATURE_CODES`` (1.7): a hardware-bug signature for
  ``irgen compare``'s diagnosis (``irgen_register_signatures``): its ``check`` gets a
  ``Mismatch`` (a layer output the device computed wrong from its own inputs, with
  ``explains(candidate)``) and returns its evidence; ``code`` is one of the fixed
  vocabulary ``SIGNATURE_CODES``. ``DumpReader`` (1.7): reads a device dump file as the
  physical array (``irgen_register_dump_readers``). ``Backend.tile`` (1.7): the tile an
  output is computed in, for compare's localization.

The graph a scheme reads and rewrites
-------------------------------------

* ``QGraph``: ``main``'s bindings as ``Quantizer.detect(qg)`` reads them and
  ``Quantizer.realize(qg)`` rewrites them in place. Read ``qg.mod``,
  ``qg.frontend``, ``qg.bindings`` (in order), ``qg.by_name``, ``qg.users``;
  ``qg.producer(expr)`` is the binding computing a variable (None for inputs and
  constants), ``qg.n_users(name)`` counts its readers (the output counts).
  Build new arithmetic with ``qg.emit(expr)`` (binds one op to a new variable,
  placed before the next replace) and commit a span with
  ``qg.replace(names, expr, quant)``: drops the bindings ``names``, binds
  ``expr`` to the last of them (the layer keeps that name and its provenance)
  and stores the layer's ``quant`` record in ``qg.quant[name]``. A record holds
  ``scheme`` (the registering scheme's name), ``kind``, ``inputs`` and
  ``output`` (``QTensor.record()``) and what the kind's recompute reads.
  ``qg.add_kernel(func, name, op, attrs)`` (2.1) adds a TIR kernel for arithmetic no Relax op
  has (an accumulation order) and returns its ``GlobalVar`` for a ``relax.call_tir``;
  ``kernel_op(name)`` is the ``(op, attrs)`` the kernel of that name computes, as ``fused_ops``
  records it; ``add_kernel(bb, func, name, op, attrs)`` (2.4) does the same through a frontend's
  ``relax.BlockBuilder`` while it imports (a source op's arithmetic no Relax op has).
* ``QTensor``: a tensor's scale, zero point, dtype and per-channel axis.
* ``Binding`` (``name``, ``var``, ``value``, ``op`` such as ``"relax.nn.conv2d"``)
  and ``Constant`` (a Relax constant: ``c.value.numpy()``).
* ``attrs_to_dict``: a Relax op's attributes as plain Python values.
* ``substitute``: rebuild an expression with variables replaced by name.
* ``main_bindings`` (``main`` and its checked bindings), ``module_bindings``
  (every binding of ``main``), ``check_tensor_sizes`` (refuse tensors over a
  byte limit before compiling), ``tuple_output_outside_dataflow`` (a
  multi-output ``main`` returning its tuple): helpers for frontends.
* ``weight_tensor(array)`` (1.5): the TVM tensor a frontend makes of a model's weight
  (instead of ``tvm.runtime.tensor``). During ``irgen run`` a large one is kept in an
  unnamed file beside the output and read from there when needed, so a model's weights
  are not all in memory at once (peak memory flat in the number of layers).
* ``arg_ref``: how ``ir.json`` refers to an op argument (a variable's name,
  ``"param:<role>"``, ``{"value": ...}``, ``{"shape": [...]}``).
* ``op_args(call)`` and ``program_arg(arg, refs)`` (2.0): a ``quant`` record's own program of
  ops in ``fused_ops`` form (a float span's): the arguments of a call as ``fused_ops`` lists
  them, and one argument (a variable by ``refs``, a tensor constant as the layer parameter it
  becomes when the layer is formed).

Recurrent layers (2.2)
----------------------

What a frontend's converter of an LSTM, GRU or RNN uses (``irgen_onnx.recurrent`` and
``irgen_torch.recurrent`` are two; ``docs/layer-ops.md`` has what the layers compute):

* ``RecurrentCell``: one direction of one recurrent layer, its weights in irgen's gate order
  (LSTM ``i, f, g, o``; GRU ``r, z, n``), ``reorder_gates`` puts a framework's order there.
* ``unroll_recurrent(cell, inputs, steps, h0, c0, emit)``: the cell's steps as Relax ops, each
  binding bound by the frontend's ``emit(t, expr, state)``, which records it under the step's
  own provenance node (one per layer, direction and step, of the op's source op type): layer
  forming makes each such step one layer (``lstm``, ``gru``, ``rnn``), its outputs the states.
* ``recurrent_states_tensor(node, state)`` and ``recurrent_state_tensor(node, state, layer,
  direction, step)``: the source tensor names of the per-step states (``<node>:h`` and the
  item ``<node>:h[layer, direction, step]``), which the frontend's source runner gives,
  computed by the runtime's own op one step at a time; ``concat_states`` joins states into
  the op's results.
* ``MAX_RECURRENT_STEPS``: the longest sequence (or loop) a frontend unrolls.

Integer arithmetic
------------------

The primitives schemes share (a scheme's own kernels live in its plugin), in numpy (what
verify recomputes) and the same as Relax ops (what a scheme puts into the graph, so TVM
computes it), side by side so they cannot drift:

* fixed point: ``quantize_multiplier`` (real -> multiplier, shift),
  ``multiply_by_quantized_multiplier`` and ``rx_multiply_by_quantized_multiplier``
  in the rounding ``DOUBLE``, ``SINGLE`` or ``WIDE`` (an int64 accumulator; ``ROUNDING_RULES``
  describes each), and ``rescale_float64`` / ``rx_rescale_float64`` (rounding ``FLOAT64``: an
  int64 sum times a double scale, rounded half away from zero),
  ``round_half_away`` / ``rx_round_half_away`` (C's ``round``, exact),
  ``quantize_half_away`` (2.0: one float quantized with float32 division, rounded half away
  from zero, as a fused activation's bound is), ``divide_round_half_away`` /
  ``rx_divide_round_half_away``.
* float requantization: ``quantize_linear`` (ONNX QuantizeLinear), ``requantize_float`` /
  ``rx_requantize_float`` (MLAS's: a float32 product rounded half to even),
  ``rx_round_to_int``.
* ``accumulate(layer, inputs, params)`` (2.0): a quantized conv/dense layer's int64
  accumulator ``sum((x - zp_x) * w) + bias`` from its ``quant`` record.
* ``per_axis`` (broadcast a per-channel vector), ``rx_const``, ``rx_clamp_cast``, ``float_record``
  (a float tensor's entry in a ``quant`` record),
  ``check_qparams`` (validated ``QTensor`` of a tensor), ``follow_constant``
  (a dequantized integer constant through reshapes and transposes).
* ``requant_scales(quant)`` and ``requant_scale_mismatch(layer, expected=None)`` (2.0): a conv/dense
  record's ``(s_x, s_w, s_y)``, and why its ``requant.scale`` is not ``expected(s_x, s_w, s_y)``
  (default ``s_x * s_w / s_y``, verify's check of a scheme without ``Quantizer.consistency``):
  for a scheme's own consistency check.
* ``register_recompute(scheme, kind, fn)`` and ``register_consistency(scheme, fn)``:
  deprecated since 2.0 (give ``Quantizer.recompute`` and ``Quantizer.consistency``); verify
  still finds what they register, after the scheme's ``Quantizer`` fields.

numpy reference
---------------

* ``run_op(relax_op, args, attrs)``: one Relax op in numpy, as verify runs it.
* ``run_layer(layer, inputs, params)``: an IR layer's ``fused_ops`` in numpy.
* ``sum_in_order(x, axis, keepdims)`` (2.0): a float sum over one axis added in index order
  (TVM's reduction loop; numpy's pairwise sum rounds otherwise).
* ``UnsupportedLayer`` (2.0): what ``run_op``/``run_layer`` raise for an op (or an argument
  form) the numpy reference lacks; a recompute may raise it too.

Command-line options
--------------------

* ``Option`` and ``OPTION_KINDS`` (1.1): an option a plugin adds to ``irgen run``
  (and ``irgen verify``) from its ``irgen_register_options`` hook; its value
  reaches a frontend as ``options[name]`` and every plugin through
  ``irgen_configure(options)``.

Names and files
---------------

* ``SafeNames`` (unique sanitized names; the same source name gets the same
  name) and ``identifier`` (a name that is a C identifier).
* Safe file I/O for frontends reading untrusted models: ``regular_file``,
  ``file_or_folder``, ``regular_tree``, ``open_regular``, ``read_bytes``,
  ``load_npy``, ``inside`` (a path that stays inside a folder),
  ``check_tensor_size`` (refuse a tensor over a byte limit),
  ``DEFAULT_MAX_TENSOR_BYTES``, ``MAX_JSON_BYTES``, ``human_bytes``. A frontend that
  opens every file through ``open_regular`` gets them into the compile cache's key.
* ``local_modules(seeds)`` (1.6): the local (not installed) modules among ``seeds`` and
  those they use, for ``ImportedModel.code_modules``: a frontend that runs the user's
  code (``--model-class``) names it there, so the cache keys on that code.

Names whose module imports TVM (the graph helpers, ``arg_ref``, ``op_args``,
``program_arg``) are loaded on first use, so importing this module to register a plugin
stays light.
"""

from __future__ import annotations

import importlib

from irgen.api import (
    ATTENTION_FUSION,
    Backend,
    DumpReader,
    Frontend,
    FusionRule,
    DeclaredTensor,
    ImportedModel,
    InputSpec,
    ModelInterface,
    IrgenError,
    Mismatch,
    Provenance,
    QUANT_DIALECTS,
    Quantizer,
    Serializer,
    SIGNATURE_CODES,
    Signature,
    StoredTensor,
    TENSOR_KINDS,
    TensorInfo,
    UnsupportedOpsError,
)
from irgen.hookspecs import hookimpl
from irgen.names import SafeNames, identifier
from irgen.quant import (
    DOUBLE,
    ROUNDING_RULES,
    SINGLE,
    WIDE,
    FLOAT64,
    QGraph,
    QTensor,
    add_kernel,
    kernel_op,
    accumulate,
    check_qparams,
    divide_round_half_away,
    float_record,
    follow_constant,
    multiply_by_quantized_multiplier,
    rescale_float64,
    round_half_away,
    per_axis,
    quantize_half_away,
    quantize_linear,
    quantize_multiplier,
    register_consistency,
    requant_scale_mismatch,
    requant_scales,
    register_recompute,
    requantize_float,
    rx_clamp_cast,
    rx_const,
    rx_divide_round_half_away,
    rx_multiply_by_quantized_multiplier,
    rx_requantize_float,
    rx_rescale_float64,
    rx_round_half_away,
    rx_round_to_int,
)
from irgen.api import OPTION_KINDS, Option
from irgen.reference import UnsupportedLayer, run_layer, run_op, sum_in_order
from irgen.runkey import local_modules
from irgen.safeio import (
    DEFAULT_MAX_TENSOR_BYTES,
    MAX_JSON_BYTES,
    check_tensor_size,
    file_or_folder,
    human_bytes,
    inside,
    load_npy,
    open_regular,
    read_bytes,
    regular_file,
    regular_tree,
)

API_VERSION = "2.4"

#: names whose module imports TVM: (module, name there), loaded by :func:`__getattr__`
_LAZY = {
    "Binding": ("irgen.graph", "Binding"),
    "Constant": ("irgen.graph", "Constant"),
    "attrs_to_dict": ("irgen.graph", "attrs_to_dict"),
    "substitute": ("irgen.graph", "substitute"),
    "main_bindings": ("irgen.graph", "main_bindings"),
    "module_bindings": ("irgen.graph", "module_bindings"),
    "check_tensor_sizes": ("irgen.graph", "check_tensor_sizes"),
    "tuple_output_outside_dataflow": ("irgen.graph", "tuple_output_outside_dataflow"),
    "arg_ref": ("irgen.ir", "arg_ref"),
    "op_args": ("irgen.ir", "op_args"),
    "program_arg": ("irgen.ir", "program_arg"),
    "weight_tensor": ("irgen.spill", "weight_tensor"),
    "RecurrentCell": ("irgen.recurrent", "Cell"),
    "unroll_recurrent": ("irgen.recurrent", "unroll"),
    "reorder_gates": ("irgen.recurrent", "reorder"),
    "recurrent_states_tensor": ("irgen.recurrent", "states_tensor"),
    "recurrent_state_tensor": ("irgen.recurrent", "state_tensor"),
    "concat_states": ("irgen.recurrent", "concat_states"),
    "MAX_RECURRENT_STEPS": ("irgen.recurrent", "MAX_STEPS"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'irgen.plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "API_VERSION",
    # registration
    "hookimpl", "Frontend", "Quantizer", "Backend", "Serializer", "FusionRule", "ATTENTION_FUSION",
    "ImportedModel", "InputSpec", "Provenance", "ModelInterface", "DeclaredTensor", "IrgenError", "UnsupportedOpsError", "QUANT_DIALECTS",
    "TensorInfo", "StoredTensor", "TENSOR_KINDS", "Signature", "Mismatch", "SIGNATURE_CODES", "DumpReader",
    # the graph a scheme reads and rewrites
    "QGraph", "QTensor", "kernel_op", "add_kernel", "Binding", "Constant", "attrs_to_dict", "substitute", "main_bindings",
    "module_bindings", "check_tensor_sizes", "tuple_output_outside_dataflow", "arg_ref", "op_args", "program_arg",
    "weight_tensor",
    # recurrent layers
    "RecurrentCell", "unroll_recurrent", "reorder_gates", "recurrent_states_tensor", "recurrent_state_tensor",
    "concat_states", "MAX_RECURRENT_STEPS",
    # integer arithmetic
    "DOUBLE", "SINGLE", "WIDE", "FLOAT64", "ROUNDING_RULES", "rescale_float64", "rx_rescale_float64", "round_half_away",
    "rx_round_half_away", "float_record", "quantize_half_away", "quantize_multiplier",
    "multiply_by_quantized_multiplier",
    "rx_multiply_by_quantized_multiplier", "divide_round_half_away", "rx_divide_round_half_away",
    "quantize_linear", "requantize_float", "rx_requantize_float", "rx_round_to_int", "accumulate",
    "per_axis", "rx_const", "rx_clamp_cast", "check_qparams", "follow_constant",
    "requant_scales", "requant_scale_mismatch", "register_recompute", "register_consistency",
    # numpy reference
    "run_op", "run_layer", "sum_in_order", "UnsupportedLayer",
    # names and files
    "SafeNames", "identifier", "regular_file", "file_or_folder", "regular_tree", "open_regular", "read_bytes",
    "load_npy", "inside", "check_tensor_size", "DEFAULT_MAX_TENSOR_BYTES", "MAX_JSON_BYTES", "human_bytes",
    "local_modules",
    # command-line options
    "Option", "OPTION_KINDS",
]
