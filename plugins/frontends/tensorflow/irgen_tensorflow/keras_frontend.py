"""The ``keras`` frontend: Keras ``.keras``/``.h5`` files and SavedModel folders.

The model is converted in-process with ``tf.lite.TFLiteConverter`` into a
``.tflite`` flatbuffer in memory, which is then imported exactly as the
``tflite`` frontend imports a file (:func:`irgen_tensorflow.import_tflite`), so
``source`` names are the TFLite tensor names (which carry the Keras layer names).

Float by default. ``--calibration DIR`` (a folder of ``.npy`` files, one sample
each, read with :func:`irgen.plugin.load_npy`: no pickle, size checked) makes a full-integer int8 model instead:
the files are the representative dataset, int8 inputs and outputs, builtin int8
kernels only (``TFLITE_BUILTINS_INT8``); the ``tflite-int8`` scheme then picks it up.

Loading a Keras file must not run code from the file: the model config is read
first and Lambda layers (serialized Python bytecode), serialized lambdas, layers
from outside the ``keras`` package (custom classes) and layers that open a path
named in the config are refused before Keras sees the file; Keras itself then
loads with ``safe_mode=True``. A SavedModel holds TF graphs only: loading it runs
no Python code from the folder (it must be a folder of regular files, with no
link leading out of it). The model path is checked before anything opens it: a
FIFO or a device is refused, never waited on.

TensorFlow is imported only when a model is loaded (optional extra
``irgen-tensorflow[keras]``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Iterator

from irgen.plugin import (
    DEFAULT_MAX_TENSOR_BYTES,
    ImportedModel,
    IrgenError,
    file_or_folder,
    human_bytes,
    load_npy,
    open_regular,
    regular_file,
    regular_tree,
)
from irgen_tensorflow.quiet import captured_fds as _captured_fds
from irgen_tensorflow.quiet import captured_text, quiet_tensorflow

KERAS_SUFFIXES = (".keras", ".h5", ".hdf5")
#: the largest ``config.json``/``metadata.json`` read out of a ``.keras`` file
MAX_CONFIG_BYTES = 64 << 20
#: a ``.keras`` member may not expand more than this many times (a zip bomb)
MAX_ZIP_RATIO = 200
#: the most entries a SavedModel folder may hold
MAX_SAVED_MODEL_ENTRIES = 100_000


def claims(path: Path) -> bool:
    """Keras files by suffix; a folder that holds ``saved_model.pb``."""
    path = Path(path)
    if path.suffix.lower() in KERAS_SUFFIXES:
        return True
    return path.is_dir() and (path / "saved_model.pb").is_file()


def _tf():
    quiet_tensorflow()  # before TensorFlow is imported: its C++ and absl logs stay off stderr
    try:
        import tensorflow as tf
    except ImportError:
        raise IrgenError(
            "Keras files and the TFLite interpreter need TensorFlow: pip install tensorflow-cpu==2.21.0"
        ) from None
    tf.get_logger().setLevel("ERROR")
    try:
        import absl.logging

        absl.logging.set_verbosity(absl.logging.ERROR)
    except ImportError:  # pragma: no cover
        pass
    return tf


# ---------------------------------------------------------------- the model path


def _check_path(path: Path) -> None:
    """A Keras file must be a regular file; a SavedModel a folder of regular files.

    Nothing else is opened: a FIFO or a device would block or never end, and a
    link inside a SavedModel folder that leads out of it would make TensorFlow
    read a file the user did not give."""
    file_or_folder(path, "model")
    if not path.is_dir():
        regular_file(path, "model")
        return
    regular_file(path / "saved_model.pb", "SavedModel file")
    regular_tree(path, "SavedModel folder", MAX_SAVED_MODEL_ENTRIES)


# ---------------------------------------------------------------- safety checks


def _keras_config(path: Path) -> Any:
    """The model config stored in a Keras file, read without Keras."""
    if path.suffix.lower() == ".keras":
        import zipfile

        try:
            with open_regular(path, "model") as f, zipfile.ZipFile(f) as z:
                _check_zip(path, z)
                return json.loads(z.read("config.json"))
        except IrgenError:
            raise
        except (zipfile.BadZipFile, KeyError, OSError, ValueError, EOFError, NotImplementedError,
                RuntimeError, RecursionError) as err:  # RuntimeError: an encrypted member
            msg = " ".join(str(err).split())[:200]
            raise IrgenError(f"{path}: not a readable .keras file ({type(err).__name__}: {msg})") from None
    try:
        import h5py
    except ImportError:
        raise IrgenError(f"{path}: reading HDF5 Keras files needs h5py") from None
    try:
        with open_regular(path, "model") as raw, h5py.File(raw, "r") as f:
            cfg = f.attrs.get("model_config")
    except IrgenError:
        raise
    except Exception as err:  # noqa: BLE001  h5py raises OSError, ValueError, KeyError, TypeError...
        raise IrgenError(f"{path}: not a readable HDF5 Keras file ({' '.join(str(err).split())[:200]})") from None
    if cfg is None:
        raise IrgenError(f"{path}: HDF5 file without a Keras model config (weights only?)")
    if isinstance(cfg, bytes):
        cfg = cfg.decode("utf-8", errors="replace")
    if not isinstance(cfg, str) or len(cfg) > MAX_CONFIG_BYTES:
        raise IrgenError(f"{path}: the Keras model config is not a JSON text of at most {MAX_CONFIG_BYTES >> 20} MiB")
    try:
        return json.loads(cfg)
    except (ValueError, RecursionError) as err:
        raise IrgenError(f"{path}: unreadable Keras model config ({' '.join(str(err).split())[:200]})") from None


def _check_zip(path: Path, z) -> None:
    """Sizes a ``.keras`` archive declares, before anything is decompressed."""
    for info in z.infolist():
        if info.filename in ("config.json", "metadata.json") and info.file_size > MAX_CONFIG_BYTES:
            raise IrgenError(f"{path}: {info.filename} would be {human_bytes(info.file_size)}, "
                             f"over {MAX_CONFIG_BYTES >> 20} MiB")
        if info.file_size > (1 << 20) and info.file_size > MAX_ZIP_RATIO * max(info.compress_size, 1):
            raise IrgenError(f"{path}: member {info.filename!r} would expand from "
                             f"{human_bytes(info.compress_size)} to {human_bytes(info.file_size)} "
                             "(a zip bomb?)")


def _walk_layers(cfg: Any) -> Iterator[dict]:
    """Every object with a ``class_name`` in the config, in document order
    (iterative: a deeply nested config cannot exhaust the Python stack)."""
    stack = [cfg]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "class_name" in node:
                yield node
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            stack.extend(reversed(node))


#: classes that run Python code from the file (Lambda: marshalled bytecode;
#: ``__lambda__``: a serialized lambda, e.g. as an activation) or read files the
#: user did not give (TFSMLayer loads a SavedModel from a path in the config)
_REFUSED = {"lambda": "a Lambda layer (serialized Python code)", "__lambda__": "a serialized Python lambda",
            "tfsmlayer": "a TFSMLayer (it loads a SavedModel from a path stored in the file)"}
#: config keys whose string value is a path Keras would open
_PATH_KEYS = {"filepath", "vocabulary", "vocabulary_path", "path", "file_path"}


def _refuse_code(path: Path, cfg: Any) -> None:
    for obj in _walk_layers(cfg):
        cls = str(obj.get("class_name"))
        config = obj.get("config") if isinstance(obj.get("config"), dict) else {}
        name = config.get("name")
        label = f"layer {name!r}" if isinstance(name, str) and name else f"object {cls!r}"
        for key in (cls, str(obj.get("registered_name") or "")):
            short = key.rsplit(">", 1)[-1].rsplit(".", 1)[-1].lower()
            if short in _REFUSED:
                raise IrgenError(
                    f"{path}: {label} is {_REFUSED[short]}; irgen does not load it. "
                    "Replace it with built-in layers, or convert the model to .tflite yourself"
                )
        module = obj.get("module")
        if isinstance(module, str) and module and not (module == "keras" or module.startswith("keras.")):
            raise IrgenError(
                f"{path}: {label} is a custom class {cls!r} from module {module!r}; irgen loads built-in Keras layers only"
            )
        for key in _PATH_KEYS & set(config):
            if isinstance(config[key], str) and config[key]:
                raise IrgenError(f"{path}: {label} names a file {config[key][:100]!r} in its {key!r}; "
                                 "irgen reads only the model file it is given")


#: Keras layers the converter writes as a WHILE loop (docs/layer-ops.md, TFLite recurrent layers)
_LOOPED = {"lstm", "gru", "simplernn", "rnn", "bidirectional", "convlstm1d", "convlstm2d", "convlstm3d"}


def _looped_layer(cfg: Any) -> tuple[str, str] | None:
    """(name, class) of the first layer of the config that converts to a WHILE loop, or None."""
    for obj in _walk_layers(cfg):
        cls = str(obj.get("class_name"))
        if cls.rsplit(".", 1)[-1].lower() in _LOOPED:
            config = obj.get("config") if isinstance(obj.get("config"), dict) else {}
            return str(config.get("name", cls)), cls
    return None


def _refuse_calibrated_loops(path: Path, cfg: Any) -> None:
    """Refuse ``--calibration`` on a recurrent layer: TensorFlow 2.21's converter crashes the
    process (a segmentation fault in its calibrator) on the WHILE loop the layer converts to."""
    found = _looped_layer(cfg)
    if found is not None:
        raise IrgenError(
            f"{path}: layer {found[0]!r} ({found[1]}) converts to a WHILE loop, which TensorFlow's "
            "converter cannot quantize (TF 2.21's calibrator crashes on it); run it without --calibration (float)")


# ---------------------------------------------------------------- calibration


def _calibration_files(folder: Any) -> list[Path]:
    """The ``.npy`` entries of ``folder`` in name order (each checked when it is read)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise IrgenError(f"--calibration {folder}: not a folder")
    try:
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() == ".npy")
    except OSError as err:
        raise IrgenError(f"--calibration {folder}: cannot list ({err.strerror or err})") from None
    if not files:
        raise IrgenError(f"--calibration {folder}: no .npy files (one sample per file)")
    return files


def _calibration(folder: Any, shape: tuple[int, ...], limit: int | None) -> list:
    """The samples in sorted file-name order, float32, shaped like the model input.

    Each file is read with :func:`irgen.plugin.load_npy`: a regular file only (a
    FIFO is refused, not waited on), no pickle, its size checked from the header
    against ``--max-tensor-bytes`` before the data is read."""
    import numpy as np

    samples = []
    for f in _calibration_files(folder):
        a = load_npy(f, "--calibration file", limit)
        if a.dtype.kind not in "fiu":
            raise IrgenError(f"--calibration file {f}: dtype {a.dtype} is not numeric")
        if tuple(a.shape) != tuple(shape):
            if len(shape) >= 1 and shape[0] == 1 and tuple(a.shape) == tuple(shape[1:]):
                a = a[None]
            else:
                raise IrgenError(f"--calibration file {f}: shape {tuple(a.shape)}, the model input needs {tuple(shape)}")
        samples.append(a.astype(np.float32))
    return samples


def _input_shape(shape: Any, where: str) -> tuple[int, ...]:
    dims = [None if d is None else int(d) for d in shape]
    if dims and dims[0] is None:
        dims[0] = 1
    if any(d is None or d < 0 for d in dims):
        raise IrgenError(f"{where}: the model input has an open dimension {shape}; --calibration needs a fixed shape")
    return tuple(dims)


# ---------------------------------------------------------------- conversion


def _weight_sizes(path: Path, cfg: Any, limit: int | None) -> None:
    """Refuse a weight over ``limit`` before Keras allocates it.

    Keras builds the model from its config, initializing every weight, before it
    reads the stored values: a config with ``units=10**9`` would allocate that
    much. Here the model is first built in a ``StatelessScope`` that defers
    initialization, so the weights' shapes are known without allocating them.
    A config that cannot be built this way is left to the real load."""
    if limit is None:
        return
    try:  # Keras 3 internals; without them the real load is the only check
        import keras
        from keras.src.backend.common import global_state
        from keras.src.saving import serialization_lib
    except ImportError:
        return

    from irgen.plugin import check_tensor_size

    try:
        with keras.StatelessScope(initialize_variables=False), serialization_lib.SafeModeScope(True):
            if path.suffix.lower() == ".keras":
                model = serialization_lib.deserialize_keras_object(cfg, safe_mode=True)
            else:
                from keras.src.legacy.saving import saving_utils

                model = saving_utils.model_from_config(cfg)
            weights = [(w.path, tuple(w.shape), w.dtype) for w in model.weights]
    except Exception:  # noqa: BLE001  the real load reports it
        return
    finally:
        global_state.set_global_attribute("uninitialized_variables", [])  # never initialized
    for name, shape, dtype in weights:
        check_tensor_size(f"{path}: weight {name!r}", shape, dtype, limit)


def _converter(tf, path: Path, cfg: Any = None, limit: int | None = None):
    """(converter, input shapes) for a Keras file or SavedModel folder."""
    if path.is_dir():
        try:
            loaded = tf.saved_model.load(str(path))
            sig = loaded.signatures["serving_default"]
            specs = sig.structured_input_signature[1]
            shapes = [tuple(specs[k].shape) for k in sorted(specs)]  # TFLite orders by name
            conv = tf.lite.TFLiteConverter.from_saved_model(str(path))
        except KeyError:
            raise IrgenError(f"{path}: SavedModel has no 'serving_default' signature") from None
        except Exception as err:  # noqa: BLE001  TF's many load errors
            msg = " ".join(str(err).split())[:300]
            raise IrgenError(f"{path}: not a readable SavedModel ({type(err).__name__}: {msg})") from None
        return conv, shapes
    _weight_sizes(path, cfg, limit)
    try:
        model = tf.keras.models.load_model(str(path), compile=False, safe_mode=True)
    except Exception as err:  # noqa: BLE001  Keras raises many kinds
        msg = " ".join(str(err).split())[:300]
        raise IrgenError(f"{path}: cannot load the Keras model ({type(err).__name__}: {msg})") from None
    if cfg is not None and _looped_layer(cfg) is not None and any(i.shape[0] is None for i in model.inputs):
        return _batch_one_converter(tf, model)
    return tf.lite.TFLiteConverter.from_keras_model(model), [tuple(i.shape) for i in model.inputs]


def _batch_one_converter(tf, model):
    """(converter, input shapes) of ``model`` traced at batch 1: the converter lowers a recurrent
    layer's loop (its tensor lists) only when their element shape is static, and a Keras input's
    batch is open (``TensorListReserve ... requires element_shape to be static``)."""
    inputs = [tf.keras.Input(batch_shape=(1, *i.shape[1:]), dtype=i.dtype, name=i.name) for i in model.inputs]
    fixed = tf.keras.Model(inputs, model(inputs if len(inputs) > 1 else inputs[0]))  # the same layers and weights
    return tf.lite.TFLiteConverter.from_keras_model(fixed), [tuple(i.shape) for i in fixed.inputs]


def _conversion_error(path: Path, err: Exception, log: str) -> IrgenError:
    text = f"{err}\n{log}"
    for line in text.splitlines():
        if line.strip().startswith("TF Select ops:"):
            ops = line.split(":", 1)[1].strip()
            return IrgenError(
                f"keras frontend ({path.name}): TFLite's builtin ops cannot express TF ops {ops} "
                "(they need SELECT_TF_OPS / Flex kernels, which irgen cannot import)"
            )
    first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
    return IrgenError(f"keras frontend ({path.name}): TFLite conversion failed: {type(err).__name__}: {first[:300]}")


def convert(path: Path, calibration: Any = None, limit: int | None = DEFAULT_MAX_TENSOR_BYTES) -> bytes:
    """The ``.tflite`` flatbuffer of the model at ``path`` (float, or int8 with ``calibration``);
    ``limit`` is ``--max-tensor-bytes`` (calibration samples)."""
    path = Path(path)
    _check_path(path)  # fail fast, before TensorFlow loads
    cfg = None
    if not path.is_dir():
        cfg = _keras_config(path)
        _refuse_code(path, cfg)
    if calibration is not None:
        _calibration_files(calibration)
        if cfg is not None:
            _refuse_calibrated_loops(path, cfg)
    with _captured_fds() as log, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tf = _tf()  # its import prints to fd 2 too
        conv, shapes = _converter(tf, path, cfg, limit)
        if calibration is not None:
            if len(shapes) != 1:
                raise IrgenError(f"--calibration: the model has {len(shapes)} inputs; only single-input models are supported")
            samples = _calibration(calibration, _input_shape(shapes[0], f"keras frontend ({path.name})"), limit)

            def representative():
                for s in samples:
                    yield [s]

            conv.optimizations = [tf.lite.Optimize.DEFAULT]
            conv.representative_dataset = representative
            conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
            conv.inference_input_type = tf.int8
            conv.inference_output_type = tf.int8
        try:
            return conv.convert()
        except IrgenError:
            raise
        except Exception as err:  # noqa: BLE001  ConverterError and friends
            raise _conversion_error(path, err, captured_text(log)) from None


def load_keras(path: Path, options: dict[str, Any]) -> ImportedModel:
    from irgen_tensorflow import _parse_model, import_tflite, max_tensor_bytes

    path = Path(path)
    where = f"keras frontend ({path.name})"
    limit = max_tensor_bytes(options)
    buf = convert(path, options.get("calibration"), limit)
    label = f"{path} (converted to TFLite)"
    return import_tflite(_parse_model(buf, label, limit), where, options, "keras", label=label)


def source_runner(path: Path, options: dict[str, Any]):
    """The model converted as :func:`load_keras` converts it, in the TFLite interpreter."""
    from irgen_tensorflow import interpreter_runner, max_tensor_bytes

    path = Path(path)
    return interpreter_runner(convert(path, options.get("calibration"), max_tensor_bytes(options)),
                              f"keras frontend ({path.name})", options.get("tflite_kernels", "reference"))
