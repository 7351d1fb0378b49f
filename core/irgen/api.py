"""The objects plugins hand to irgen, and the errors irgen reports to users.

Everything here is plain Python: importing this module never imports TVM,
torch or TensorFlow, so `irgen --help` and `irgen plugins` stay fast.

Plugins register instances of these classes from the ``irgen_register_*``
hooks in :mod:`irgen.hookspecs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping


class IrgenError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


class UnsupportedOpsError(IrgenError):
    """The model uses ops a frontend or backend cannot handle (all listed at once)."""

    def __init__(self, where: str, ops: list[str]):
        self.ops = sorted(set(ops))
        super().__init__(f"{where}: unsupported ops: {', '.join(self.ops)}")


@dataclass
class InputSpec:
    """One model input: its name in the source model, shape and dtype.

    ``quantization`` is ``(scale, zero_point)`` of an integer input that stands for real
    values (a full-integer model's int8 input): a float ``--input`` file is then
    quantized with it (``round(x / scale) + zero_point``, ties to even, clipped to the
    dtype), as the user would before calling the source runtime."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    quantization: tuple[float, int] | None = None


@dataclass(frozen=True)
class DeclaredTensor:
    """One input or output of a model file as the file declares it, before any shape is
    chosen: ``shape`` holds an int for a fixed dimension and the dimension's symbol (a
    ``str``: ONNX's ``dim_param``, ``"?"`` when unnamed) for an open one. ``path`` (2.4),
    where the frontend knows it, is the tensor's place in the structure the model returns
    (a torch program's output pytree: ``logits``, ``present.0``), for a tensor whose name
    does not say what it is (a torch output is named after its FX node)."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str
    path: str | None = None


@dataclass(frozen=True)
class ModelInterface:
    """A model file's declared inputs and outputs (:attr:`Frontend.interface`), in order."""

    inputs: tuple[DeclaredTensor, ...]
    outputs: tuple[DeclaredTensor, ...]


@dataclass
class Provenance:
    """Where a Relax binding came from in the source model.

    Frontends name every Relax binding that holds a source tensor after the
    (sanitized) tensor name; ``by_var`` maps that Relax variable name to the
    source node that produced it and the source tensor it holds.
    """

    # relax var name -> (source node name, source op type, source tensor name or None)
    by_var: dict[str, tuple[str, str, str | None]] = field(default_factory=dict)
    # relax var name -> names of vars irgen folded into it (e.g. conv into batch norm)
    merged: dict[str, list[str]] = field(default_factory=dict)
    # source node name -> the name of a layer anchored at it, where the node's own name says
    # less than its place in the model (a torch FX node is named after its op, ``conv2d_3``;
    # its module path names it, ``layer1.0.conv1.conv2d``, as ONNX exporters name nodes)
    layer_names: dict[str, str] = field(default_factory=dict)


@dataclass
class ImportedModel:
    """What a frontend returns: a Relax module whose ``main`` is one dataflow block.

    ``mod`` holds parameters as bound constants; ``inputs`` lists the model
    inputs in ``main``'s parameter order.
    """

    mod: Any  # tvm.IRModule
    inputs: list[InputSpec]
    provenance: Provenance
    frontend: str
    #: source runtime's name for each model output, in order
    output_names: list[str] = field(default_factory=list)
    #: what the graph's quantize/dequantize ops mean (default: the frontend's ``quant_dialect``)
    dialect: str | None = None
    #: Relax variable of a quantize -> the integer range it clamps to, when narrower than its
    #: dtype's (torch's ``reduce_range`` observers: uint8 values in [0, 127]); a scheme clamps there
    quant_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Python modules whose code built the graph besides installed libraries (a ``--model-class``
    #: and the local modules it uses: :func:`irgen.plugin.local_modules` finds them). The compile
    #: cache keys on their source, as it does on every file the import opened through
    #: :func:`irgen.safeio.open_regular` (external data)
    code_modules: tuple[str, ...] = ()


#: The quantization dialects of the in-repository frontends: what a graph's
#: quantize/dequantize ops (or int8 tensors) mean. A new frontend names one of these
#: when its graphs mean the same, or a new name (and a scheme that reads it).
QUANT_DIALECTS = {
    "onnx-qdq": "ONNX QuantizeLinear/DequantizeLinear pairs around float ops (onnxruntime's "
                "quantize_static, QDQ or QOperator): round half to even, saturate; ORT's integer kernels",
    "torch-qdq": "torch's quantize_per_tensor/channel and dequantize around float ops "
                 "(reference-quantized and QAT-converted .pt2 programs); torch's rounding",
    "tflite": "TFLite int8 tensors with per-tensor/per-channel scales and zero points; TFLite's "
              "integer kernels (MultiplyByQuantizedMultiplier)",
}


@dataclass
class Frontend:
    """Turns one kind of model file into an :class:`ImportedModel`.

    ``claims(path)`` says whether this frontend reads the file (by suffix or
    content, cheaply: no heavy imports). ``load(path, options)`` imports it;
    ``options`` carries CLI settings such as input shapes.

    ``runner(path, options)``, optional, runs the model in its own runtime for
    ``irgen verify``: see :meth:`source_runner`.

    ``interface(path, options)``, optional, reads the model's declared inputs and outputs
    (:class:`ModelInterface`, open dimensions as symbols) without importing it: ``irgen run
    --decode`` chooses each step's shapes from it (API 2.3).

    ``quant_dialect`` says what the quantize/dequantize ops of the graphs it
    imports mean, so that quantization schemes detect a dialect and never a
    frontend by name (see :data:`QUANT_DIALECTS`). A frontend whose graphs
    hold no quantization leaves it None.
    """

    name: str
    suffixes: tuple[str, ...]
    load: Callable[[Path, dict[str, Any]], ImportedModel]
    claims: Callable[[Path], bool] | None = None
    description: str = ""
    runner: Callable[[Path, dict[str, Any]], Callable[[dict[str, Any], list[str]], dict[str, Any]]] | None = None
    quant_dialect: str | None = None
    interface: Callable[[Path, dict[str, Any]], ModelInterface] | None = None

    def source_runner(self, model_path: Path, options: dict[str, Any]):
        """A callable ``run(inputs, tensors) -> {tensor: array}`` that runs the model
        at ``model_path`` in its source runtime on ``inputs`` (``{input name:
        array}``) and returns the value of every tensor in ``tensors`` (source
        names, as in a layer's ``source.outputs``) that the runtime can give.
        Raises :class:`IrgenError` when this frontend has no runner or its
        runtime is not installed."""
        if self.runner is None:
            raise IrgenError(f"frontend {self.name!r} cannot run models in their source runtime")
        return self.runner(Path(model_path), options)

    def claims_file(self, path: Path) -> bool:
        if self.claims is not None:
            return bool(self.claims(path))
        return path.suffix.lower() in self.suffixes


@dataclass
class Quantizer:
    """A quantization-fusion scheme.

    Both callables get an :class:`irgen.quant.QGraph` (``main``'s bindings).
    ``detect(qgraph)`` says whether the model was quantized the way this
    scheme understands, cheaply and without changing anything; ``realize(qgraph)``
    folds each layer's quantize/dequantize/clip/cast ops into integer Relax
    arithmetic (bound to the layer's output name) and stores the layer's
    ``quant`` record in ``qgraph.quant``. Something the scheme cannot realize
    exactly is an :class:`IrgenError` naming the tensor and the reason.
    ``priority`` orders automatic detection (higher first).

    What ``irgen verify`` asks the scheme of a layer whose ``quant.scheme`` is ``name``:

    * ``recompute``: quant kind -> ``fn(layer, inputs, params) -> np.ndarray``, the integer
      output the layer must produce from its integer inputs and parameters alone (the
      arithmetic a hardware engineer reproduces, read from the ``quant`` record, not from
      ``fused_ops``); the kind ``"*"`` covers every kind without an entry of its own. A layer
      whose kind has none is checked with its ``fused_ops`` alone, and verify says so.
    * ``consistency``: ``fn(layer) -> str | None``, why a conv/dense layer's derived
      requantization values (multipliers, shifts, requant scales) do not follow from the
      scales beside them in its record (a scale edited in ``ir.json`` is caught even where the
      arithmetic does not read it), None when they agree. Without one, verify checks a
      ``requant.scale`` against ``s_x * s_w / s_y``.
    * ``runtime_exact`` (API 2.1): the scheme's integer layers are the source runtime's integer
      kernels bit for bit. When the runtime ran those kernels, verify then allows no LSB of
      difference for a layer recomputed from the runtime's own inputs (``--max-lsb`` still
      applies to float spans). A scheme with arithmetic of its own (a fixed-point
      requantization where the runtime requantizes in float) leaves it False and is held to
      ``--max-lsb``.

    A scheme built on another (its plugin declared as a dependency) starts from that
    scheme's tables, e.g. ``recompute={**base.RECOMPUTE, "conv2d": mine}``.
    """

    name: str
    detect: Callable[[Any], bool]
    realize: Callable[[Any], None]
    priority: int = 0
    description: str = ""
    recompute: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    consistency: Callable[[dict[str, Any]], str | None] | None = None
    runtime_exact: bool = False


@dataclass
class FusionRule:
    """One hardware-layer fusion rule of a backend.

    ``anchor`` is a set of Relax op names that start a layer (e.g.
    ``{"relax.nn.conv2d"}``); ``followers`` are tried in order after it, each a
    set of op names of which at most one is absorbed (e.g. a bias add, then an
    activation). A follower is absorbed only when it consumes the previous
    op's result and that result has no other user. The rules whose anchor
    matches an op are tried in the backend's order; the first that applies forms
    the layer.

    ``required`` (indices into ``followers``) makes a rule apply only when those
    followers are absorbed; otherwise the next matching rule is tried. With
    ``tensor_operands`` a follower may read another tensor besides the previous
    result (attention's mask and values); without it such an op is a layer of its
    own (a residual add). ``op`` names the layers the rule forms in the IR
    (default: the anchor's op name). :data:`ATTENTION_FUSION` is such a rule.

    In a quantized model the rules apply to the scheme's layers (one per source op,
    its integer arithmetic in place of the op), each matched by its compute op
    (``relax.nn.conv2d``, ``relax.matmul``, ``relax.nn.max_pool2d``). Exact *integer*
    followers (max pool, reshape: no requantization of their own) join the anchor's
    layer, whose ``quant`` keeps the anchor's requantization, ``quant.fused_after``
    counting the followers' ops. With ``requantized_followers`` (API 1.2; hardware
    that runs a second requantization stage in the same layer) followers with their
    own requantization join too (a residual add, a relu or sigmoid table), a layer
    that requantizes being matched by the op it stands for (a quantized add is
    ``relax.add``, a relu table ``relax.nn.relu``): the layer's ``quant`` is ``kind:
    "fused"`` with ``steps``, one scheme record per merged layer, each with its own
    requantization; under ``tensor_operands`` a follower's other operand (the
    residual) becomes an input of the layer. The golden data does not change: the
    merged layer's output file is the last follower's. A follower with weights (a
    convolution) or a second table stays a layer of its own; without the flag,
    followers that requantize stay layers of their own.
    """

    name: str
    anchor: frozenset[str]
    followers: tuple[frozenset[str], ...] = ()
    required: frozenset[int] = frozenset()
    tensor_operands: bool = False
    op: str | None = None
    requantized_followers: bool = False


#: Scaled dot-product attention written as its steps (what ONNX exporters and
#: attention modules without ``scaled_dot_product_attention`` produce):
#: ``softmax(q·kᵀ [× or ÷ scale] [+ mask]) · v``, one ``attention`` layer. A backend
#: whose hardware runs attention as one unit puts it before its other rules;
#: without it these are ``matmul``, ``multiply``, ``add``, ``softmax`` layers.
ATTENTION_FUSION = FusionRule(
    "attention",
    frozenset({"relax.matmul"}),
    (frozenset({"relax.multiply", "relax.divide"}), frozenset({"relax.add"}), frozenset({"relax.nn.softmax"}),
     frozenset({"relax.matmul"})),
    required=frozenset({2, 3}),
    tensor_operands=True,
    op="attention",
)


#: what a data file holds (:attr:`TensorInfo.kind`)
TENSOR_KINDS = ("input", "activation", "parameter")


@dataclass(frozen=True)
class TensorInfo:
    """What irgen tells :attr:`Backend.store_tensor` about the tensor it stores.

    ``name`` is the tensor's name in ``ir.json`` (a parameter's is ``<layer>.<role>``);
    ``kind`` one of :data:`TENSOR_KINDS` (a model ``input``, a layer's output
    ``activation``, a layer ``parameter``); ``shape`` and ``dtype`` the logical
    array's (what the record keeps); ``layout`` its logical layout as ``ir.json``
    records it (``NCHW``, ``NHWC``, ``OIHW``, ``IO``, ``NC``, or None when no op
    states one); ``role`` a parameter's role (``weight``, ``bias``, ``w_scale``, ...;
    None otherwise); ``op`` and ``layer`` the op and name of the layer that owns
    the parameter or computes the activation (None for a model input).
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    layout: str | None = None
    role: str | None = None
    op: str | None = None
    layer: str | None = None


@dataclass
class StoredTensor:
    """What :attr:`Backend.store_tensor` wrote for one tensor.

    ``file``: the main data file, which ``read_tensor(file, record)`` reads back as the
    logical array (it becomes the record's ``file``). ``extra_files``: the other files
    written for the same tensor (the same values in other formats), each mapped to the
    ``manifest.json`` fields in which it differs from ``storage`` (e.g. ``{"format":
    "readmemh", "word_bits": 16}``); a list means no difference. ``storage``: how the
    data is laid out in the files, recorded as the tensor record's ``storage`` in
    ``ir.json`` (irgen adds ``files``, the extra files relative to OUT). Its keys are the
    backend's; these have a fixed meaning and are the defaults of every file's
    ``manifest.json`` entry: ``layout`` (the physical layout), ``shape`` (the physical,
    e.g. padded, shape), ``dtype``, ``byte_order`` (``"little"`` or ``"big"``);
    ``padding`` describes padding the backend added; ``word_bits`` a word width.
    All paths are inside the folder of the path irgen gave.
    """

    file: Path
    extra_files: dict[Path, dict[str, Any]] | list[Path] = field(default_factory=dict)
    storage: dict[str, Any] = field(default_factory=dict)


@dataclass
class Backend:
    """What a hardware target can run and how it wants its data.

    ``fusion_rules`` decide which graph ops form one hardware layer;
    ``supported_ops`` (layer op names, None for "all") is checked up front and
    every unsupported one is listed at once; ``layout`` (None for "any") is the
    4-D activation layout the hardware takes: a model whose layers state
    another one is refused, naming them; ``write_tensor(path_without_suffix,
    array)`` writes one data file and returns its path (default: ``.npy``);
    ``read_tensor(path, record)`` reads such a file back as a numpy array
    (``record``: the tensor's record in ``ir.json``, with ``shape`` and ``dtype``).
    ``irgen verify`` reads a backend's files with it, so a backend that writes a
    format of its own (raw ``.bin``, hex) must give both. irgen checks the path
    (inside OUT, a regular file, under ``--max-tensor-bytes``) before calling it,
    and that the array it returns has the record's shape and dtype.

    ``store_tensor(path_without_suffix, array, info) -> StoredTensor`` (API 1.1),
    used instead of ``write_tensor`` when given, is for a backend that stores data
    its own way: ``info`` (:class:`TensorInfo`) says which tensor it is (input,
    activation or parameter; a parameter's role; its logical layout; the layer's
    op), so the backend may transpose (NCHW -> NHWC), pad channels, and write
    several files (``.bin``, hex, ``.npy``). The :class:`StoredTensor` it returns
    names the main file (the record's ``file``), the extra files, and a ``storage``
    dict irgen records in the tensor's ``ir.json`` record as ``storage``; every
    file is listed in ``manifest.json`` with its sha256 and the ``dtype``,
    ``shape``, ``layout`` and ``byte_order`` of its content. The record keeps the
    *logical* shape, dtype and layout: ``read_tensor(file, record)`` gets the record
    with its ``storage`` and returns the logical array, so verify compares it as
    any other.

    ``check_layer(layer) -> list[str]`` states the hardware's constraints: it gets
    each formed layer before anything is compiled (``name``, ``op``, ``attrs``,
    ``quant``, and ``inputs``/``outputs``/``params`` as records with ``shape``,
    ``dtype`` and ``layout``) and returns the constraints the layer breaks, as
    sentences (empty when it fits). A model with any such layer is refused up
    front, every offending layer named with what it breaks; so is one whose 4-D
    activations are not in ``layout``, or whose ops are not in ``supported_ops``.

    ``constraints`` (API 1.1), optional, is the table ``irgen backends show NAME``
    prints: rows of (layer op or topic, the constraint in a sentence), the human
    reading of what ``supported_ops`` and ``check_layer`` enforce.
    """

    name: str
    fusion_rules: list[FusionRule]
    supported_ops: frozenset[str] | None = None
    layout: str | None = None
    write_tensor: Callable[[Path, Any], Path] | None = None
    read_tensor: Callable[[Path, dict[str, Any]], Any] | None = None
    check_layer: Callable[[dict[str, Any]], list[str]] | None = None
    description: str = ""
    store_tensor: Callable[[Path, Any, TensorInfo], StoredTensor] | None = None
    #: the hardware's supported ops and constraints, for ``irgen backends show NAME``:
    #: rows of (layer op or topic, constraint sentence)
    constraints: list[tuple[str, str]] | None = None
    #: (API 1.7) the tile (rows, columns of an output's H x W plane) the hardware computes at a
    #: time, or None; ``irgen compare`` says which tiles of a wrong output differ
    tile: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for field_name in ("write_tensor", "store_tensor"):
            if getattr(self, field_name) is not None and self.read_tensor is None:
                raise IrgenError(f"backend {self.name!r} writes its own data files ({field_name}) but cannot read "
                                 "them back (no read_tensor): irgen verify could not check what it wrote")


@dataclass
class Serializer:
    """Writes the custom IR (a JSON-able dict) into the output folder.

    ``write(ir, out_dir)`` returns the paths it wrote.
    """

    name: str
    write: Callable[[dict[str, Any], Path], list[Path]]
    description: str = ""


#: The fixed vocabulary of ``irgen compare``'s diagnosis: the kinds of hardware bug whose
#: signature in a device's dump it recognizes (a :class:`Signature`'s ``code``).
SIGNATURE_CODES = {
    "layout": "the tensor (or a weight) is stored in another layout: NCHW/NHWC, OIHW/OHWI, a transposed matrix",
    "byte_order": "bytes swapped within a value, or values swapped within a memory word",
    "rounding": "another rounding mode in requantization: half to even, half away from zero, floor, truncation",
    "saturation": "wrap-around where the golden data saturates, or saturation where it wraps",
    "zero_point": "a zero point missing or applied twice (input or output)",
    "bias": "the bias missing, doubled, or another layer's",
    "shift": "the requantization off by a power of two",
    "per_channel": "a per-tensor scale where it is per channel, or the channels' scales out of order",
    "channel_padding": "padded channels not zero, or data in the padding",
    "border": "only the spatial border differs: the padding of a convolution or pool",
    "stale": "zeros, a constant fill, another layer's golden output, or another sample's",
    "accumulator": "an accumulator too narrow: it overflows where the golden accumulator exceeds its width",
    "clamp": "an activation's bounds missing or wrong",
    "offset": "the data shifted by one element, row or channel",
}


@dataclass
class Mismatch:
    """One layer output that is wrong *locally* (recomputed from the device's own inputs,
    it is not what the device wrote): what a :class:`Signature`'s ``check`` examines.

    Arrays are numpy arrays in the record's logical shape and dtype. ``device``: the
    dump's value; ``expected``: what the layer computes from the device's own
    ``inputs`` (the golden files where the dump lacks one); ``golden``: OUT's file.
    ``layer`` is the layer's ``ir.json`` record and ``output`` the index of the output;
    ``params`` its parameters (``{role: array}``); ``layout`` the output's logical layout
    (``NCHW``, ``NHWC``, ``NC``, or None). ``padding``: the values the dump holds in the
    channel padding of its storage (None when it has none; they should be zeros).
    ``to_physical(array)`` puts a logical array in the dump's storage order (layout and
    channel padding, as the device writes memory) and ``to_logical(array)`` takes it back,
    so a signature that reasons about memory (bytes, words, offsets) works there.
    ``physical_layout`` names the storage's axes (None: as ``layout``).
    ``recompute(layer=None, inputs=None, params=None)`` runs the numpy reference of the
    layer with any of the three replaced (a variant: another bias, a permuted weight)
    and returns its outputs, or None when it cannot run. ``others(what)`` yields
    ``(label, array)``: with ``"output"``, golden values elsewhere with this output's
    shape and dtype (other layers' outputs, this tensor in other samples), for stale
    data; with a parameter role (``"bias"``), other layers' parameters of that role with
    this layer's one's shape and dtype. ``close(a, b)`` is the elementwise test of
    "equal" (exact for integers, the float tolerance otherwise).

    :meth:`explains` is the rule every signature uses: a candidate explains the
    difference when it matches the device where the device is wrong and breaks
    (almost) nothing where it is right.
    """

    layer: dict[str, Any]
    output: int
    device: Any
    expected: Any
    golden: Any
    inputs: list[Any]
    params: dict[str, Any]
    layout: str | None = None
    padding: Any = None
    physical_layout: str | None = None
    to_physical: Callable[[Any], Any] = lambda a: a
    to_logical: Callable[[Any], Any] = lambda a: a
    recompute: Callable[..., Any] = lambda layer=None, inputs=None, params=None: None
    others: Callable[[str], Any] = lambda what="output": iter(())
    close: Callable[[Any, Any], Any] | None = None

    @property
    def integer(self) -> bool:
        """Whether the output is an integer tensor (compared exactly)."""
        return getattr(self.device, "dtype", None) is not None and self.device.dtype.kind in "iub"

    def same(self, a: Any, b: Any) -> Any:
        """Elementwise: ``a`` equals ``b`` (integers exactly, floats by ``close``)."""
        import numpy as np

        if self.close is None or self.integer:
            return np.asarray(a) == np.asarray(b)
        return self.close(a, b)

    def explains(self, candidate: Any, where: Any = None, slack: float = 0.001) -> bool:
        """Whether ``candidate`` (an array shaped as ``device``) explains the difference: it
        equals the device on at least 90% of the elements where the device differs from
        ``expected``, and differs from the device on at most ``slack`` of all elements
        (rounding noise of a model of the arithmetic). ``where`` limits the judgement to a
        boolean mask (e.g. the part an offset leaves defined)."""
        import numpy as np

        cand = np.asarray(candidate)
        if cand.shape != self.device.shape:
            return False
        wrong = ~self.same(self.device, self.expected)
        hit = self.same(cand, self.device)
        if where is not None:
            wrong, hit = wrong[where], hit[where]
        n_wrong = int(np.count_nonzero(wrong))
        if n_wrong == 0:
            return False
        fixed = int(np.count_nonzero(wrong & hit))
        missed = int(hit.size - np.count_nonzero(hit))
        return fixed >= 0.9 * n_wrong and missed <= slack * hit.size


@dataclass
class Signature:
    """A known hardware bug's signature, for ``irgen compare``'s diagnosis.

    ``check(mismatch)`` gets a :class:`Mismatch` (a locally wrong layer output) and
    returns the evidence, a sentence, when the difference has this signature (None when
    not). ``code`` is one of :data:`SIGNATURE_CODES`, the fixed vocabulary the JSON
    reports; ``name`` tells signatures apart (one code may have several); the core's
    signatures are named after their code. A check must not raise for a layer it does
    not apply to: it returns None. ``description`` says what it looks for.
    """

    name: str
    code: str
    check: Callable[[Mismatch], str | None]
    description: str = ""

    def __post_init__(self) -> None:
        if self.code not in SIGNATURE_CODES:
            raise IrgenError(f"signature {self.name!r}: code {self.code!r} is not one of "
                             f"{', '.join(SIGNATURE_CODES)}")


@dataclass
class DumpReader:
    """Reads a device's dump file for ``irgen compare``.

    ``read(path, record)`` returns the *physical* array the file holds: the record's
    ``storage`` ``shape`` and ``dtype`` (its ``layout`` the physical layout, ``padding``
    the channel padding), as the device wrote it. irgen checked the path first (inside
    the dump folder, a regular file, under ``--max-tensor-bytes``); it strips the padding
    (keeping its values for the ``channel_padding`` signature) and transposes to the
    record's logical layout itself. ``record`` is the tensor's ``ir.json`` record, its
    ``storage`` replaced by what a ``--map`` entry says. ``name`` is a backend's name (the
    reader of dumps laid out like an OUT that backend wrote) or a format a ``--map``
    entry names (``format: NAME``).
    """

    name: str
    read: Callable[[Path, dict[str, Any]], Any]
    description: str = ""


#: what an :class:`Option`'s value is: how it is parsed, recorded and checked
OPTION_KINDS = {
    "text": "a string",
    "int": "an integer",
    "float": "a number",
    "flag": "true when given (no value)",
    "json": "a JSON object, given as its text; the value is the parsed dict",
    "path": "a file or folder; it is protected from being overwritten by OUT, recorded as an absolute path, "
            "and checked to be there (regular files only) before the source check uses a recorded one",
}


@dataclass
class Option:
    """A command-line option a plugin adds (``irgen_register_options``), as ``pytest_addoption`` does.

    ``name`` is the key of its value in the run's options: the mapping a frontend's
    ``load(path, options)`` and ``source_runner(path, options)`` receive, and that
    ``irgen_configure(options)`` hands every plugin. The option itself is
    ``--`` + ``name`` with ``_`` written as ``-`` (``model_class`` -> ``--model-class``).
    Its value is None (``False`` for a ``flag``) unless given, or ``default``.

    ``kind`` is one of :data:`OPTION_KINDS`. ``commands`` are the subcommands that
    take it (``run``; ``verify`` too when its source check needs it given again).
    ``record``: the value is stored in ``manifest.json`` so that ``irgen verify``'s
    source check loads the model as the run did. ``runs_code``: the value makes a
    frontend run code (e.g. a class to import): a value recorded in ``manifest.json``
    (untrusted) is used only with ``irgen verify --allow-pickle``. ``group`` is its
    heading in ``--help`` (default: the registering plugin's name).
    """

    name: str
    help: str
    kind: str = "text"
    default: Any = None
    metavar: str | None = None
    commands: tuple[str, ...] = ("run",)
    record: bool = False
    runs_code: bool = False
    group: str | None = None

    def __post_init__(self) -> None:
        import re

        if not isinstance(self.name, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,40}", self.name):
            raise IrgenError(f"option {self.name!r}: a name is lower-case letters, digits and '_' "
                             "(it becomes --name-with-dashes)")
        if self.kind not in OPTION_KINDS:
            raise IrgenError(f"option {self.name!r}: kind {self.kind!r} is not one of {', '.join(OPTION_KINDS)}")
        self.commands = tuple(self.commands)
        unknown = [c for c in self.commands if c not in ("run", "verify")]
        if unknown or not self.commands:
            raise IrgenError(f"option {self.name!r}: commands must be 'run' and/or 'verify', got {self.commands!r}")

    @property
    def flag(self) -> str:
        """The command-line spelling, e.g. ``--model-class``."""
        return "--" + self.name.replace("_", "-")
