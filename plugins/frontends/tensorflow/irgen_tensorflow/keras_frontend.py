"""The ``keras`` frontend: Keras ``.keras``/``.h5`` files and SavedModel folders.

The model is converted in-process with ``tf.lite.TFLiteConverter`` into a
``.tflite`` flatbuffer in memory, which is then imported exactly as the
``tflite`` frontend imports a file (:func:`irgen_tensorflow.import_tflite`), so
``source`` names are the TFLite tensor names (which carry the Keras layer names).

Float by default. ``--calibration DIR`` (a folder of ``.npy`` files, one sample
each, read with ``allow_pickle=False``) makes a full-integer int8 model instead:
the files are the representative dataset, int8 inputs and outputs, builtin int8
kernels only (``TFLITE_BUILTINS_INT8``); the ``tflite-int8`` scheme then picks it up.

Loading a Keras file must not run code from the file: the model config is read
first and Lambda layers (serialized Python bytecode) and layers from outside the
``keras`` package (custom classes) are refused before Keras sees the file; Keras
itself then loads with ``safe_mode=True``. A SavedModel holds TF graphs only:
loading it runs no Python code from the folder.

TensorFlow is imported only when a model is loaded (optional extra
``irgen-tensorflow[keras]``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

from irgen.api import ImportedModel, IrgenError

KERAS_SUFFIXES = (".keras", ".h5", ".hdf5")


def claims(path: Path) -> bool:
    """Keras files by suffix; a folder that holds ``saved_model.pb``."""
    path = Path(path)
    if path.suffix.lower() in KERAS_SUFFIXES:
        return True
    return path.is_dir() and (path / "saved_model.pb").is_file()


def _tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import tensorflow as tf
    except ImportError:
        raise IrgenError(
            "the keras frontend needs TensorFlow: pip install 'irgen-tensorflow[keras]' (tensorflow-cpu)"
        ) from None
    tf.get_logger().setLevel("ERROR")
    return tf


@contextlib.contextmanager
def _captured_fds() -> Iterator[Any]:
    """Route fd 1 and 2 into a temp file: the converter's C++/MLIR chatter.

    Yields the file, so an error can be built from what was written.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as log:
        saved = (os.dup(1), os.dup(2))
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            yield log
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])


# ---------------------------------------------------------------- safety checks


def _keras_config(path: Path) -> Any:
    """The model config stored in a Keras file, read without Keras."""
    if path.suffix.lower() == ".keras":
        import zipfile

        try:
            with zipfile.ZipFile(path) as z:
                return json.loads(z.read("config.json"))
        except (zipfile.BadZipFile, KeyError, OSError, ValueError) as err:
            raise IrgenError(f"{path}: not a readable .keras file ({type(err).__name__}: {err})") from None
    try:
        import h5py
    except ImportError:
        raise IrgenError(f"{path}: reading HDF5 Keras files needs h5py") from None
    try:
        with h5py.File(path, "r") as f:
            cfg = f.attrs.get("model_config")
    except (OSError, ValueError) as err:
        raise IrgenError(f"{path}: not a readable HDF5 Keras file ({' '.join(str(err).split())[:200]})") from None
    if cfg is None:
        raise IrgenError(f"{path}: HDF5 file without a Keras model config (weights only?)")
    if isinstance(cfg, bytes):
        cfg = cfg.decode("utf-8", errors="replace")
    try:
        return json.loads(cfg)
    except ValueError as err:
        raise IrgenError(f"{path}: unreadable Keras model config ({err})") from None


def _walk_layers(cfg: Any) -> Iterator[dict]:
    if isinstance(cfg, dict):
        if "class_name" in cfg:
            yield cfg
        for v in cfg.values():
            yield from _walk_layers(v)
    elif isinstance(cfg, list):
        for v in cfg:
            yield from _walk_layers(v)


def _refuse_code(path: Path, cfg: Any) -> None:
    for obj in _walk_layers(cfg):
        cls = str(obj.get("class_name"))
        name = (obj.get("config") or {}).get("name") if isinstance(obj.get("config"), dict) else None
        label = f"layer {name!r}" if name else f"object {cls}"
        if cls == "Lambda" or cls.endswith(">Lambda"):
            raise IrgenError(
                f"{path}: {label} is a Lambda layer (serialized Python code); irgen does not load it. "
                "Replace it with built-in layers, or convert the model to .tflite yourself"
            )
        module = obj.get("module")
        if isinstance(module, str) and module and not (module == "keras" or module.startswith("keras.")):
            raise IrgenError(
                f"{path}: {label} is a custom class {cls!r} from module {module!r}; irgen loads built-in Keras layers only"
            )


# ---------------------------------------------------------------- calibration


def _calibration_files(folder: Any) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise IrgenError(f"--calibration {folder}: not a folder")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() == ".npy" and p.is_file())
    if not files:
        raise IrgenError(f"--calibration {folder}: no .npy files (one sample per file)")
    return files


def _calibration(folder: Any, shape: tuple[int, ...]) -> list:
    """The samples in sorted file-name order, float32, shaped like the model input."""
    import numpy as np

    samples = []
    for f in _calibration_files(folder):
        try:
            a = np.load(f, allow_pickle=False)
        except ValueError as err:
            raise IrgenError(f"--calibration {f}: not a plain .npy array ({' '.join(str(err).split())[:150]})") from None
        except (OSError, EOFError) as err:
            raise IrgenError(f"--calibration {f}: cannot read ({type(err).__name__}: {err})") from None
        if not isinstance(a, np.ndarray) or a.dtype.kind not in "fiu":
            raise IrgenError(f"--calibration {f}: dtype {getattr(a, 'dtype', type(a))} is not numeric")
        if tuple(a.shape) != tuple(shape):
            if len(shape) >= 1 and shape[0] == 1 and tuple(a.shape) == tuple(shape[1:]):
                a = a[None]
            else:
                raise IrgenError(f"--calibration {f}: shape {tuple(a.shape)}, the model input needs {tuple(shape)}")
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


def _converter(tf, path: Path):
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
    _refuse_code(path, _keras_config(path))
    try:
        model = tf.keras.models.load_model(str(path), compile=False, safe_mode=True)
    except Exception as err:  # noqa: BLE001  Keras raises many kinds
        msg = " ".join(str(err).split())[:300]
        raise IrgenError(f"{path}: cannot load the Keras model ({type(err).__name__}: {msg})") from None
    return tf.lite.TFLiteConverter.from_keras_model(model), [tuple(i.shape) for i in model.inputs]


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


def convert(path: Path, calibration: Any = None) -> bytes:
    """The ``.tflite`` flatbuffer of the model at ``path`` (float, or int8 with ``calibration``)."""
    if calibration is not None:
        _calibration_files(calibration)  # fail fast, before TensorFlow loads
    with _captured_fds() as log, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tf = _tf()  # its import prints to fd 2 too
        conv, shapes = _converter(tf, path)
        if calibration is not None:
            if len(shapes) != 1:
                raise IrgenError(f"--calibration: the model has {len(shapes)} inputs; only single-input models are supported")
            samples = _calibration(calibration, _input_shape(shapes[0], f"keras frontend ({path.name})"))

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
            log.seek(0)
            raise _conversion_error(path, err, log.read().decode(errors="replace")) from None


def load_keras(path: Path, options: dict[str, Any]) -> ImportedModel:
    from irgen_tensorflow import _parse_model, import_tflite

    path = Path(path)
    where = f"keras frontend ({path.name})"
    buf = convert(path, options.get("calibration"))
    model = _parse_model(buf, f"{path} (converted to TFLite)")
    return import_tflite(model, where, options, "keras")


def source_runner(path: Path, options: dict[str, Any]):
    """The model converted as :func:`load_keras` converts it, in the TFLite interpreter."""
    from irgen_tensorflow import interpreter_runner

    path = Path(path)
    return interpreter_runner(convert(path, options.get("calibration")), f"keras frontend ({path.name})")
