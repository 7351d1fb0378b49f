"""Models quantized by third-party toolkits, built by code: the toolkit matrix of issue 36.

One builder per toolkit and setting, ``builder(arch, folder) -> (model path, {input name:
array})``: a public architecture with seeded random weights (the zoo's own, :mod:`zoo`),
quantized by the toolkit the way its documentation shows, calibrated on the zoo's seeded
samples (:data:`zoo.CALIBRATION_SAMPLES` of them, 64x64), written under ``folder``. A builder
whose files are already in ``folder`` returns them without importing its toolkit, so a case built
in one virtual environment runs and verifies in another (irgen's test venv).

=================  ===================================================================================
setting            what the toolkit writes
=================  ===================================================================================
nncf-onnx          NNCF ``nncf.quantize`` on the float ONNX model (ONNX backend): QDQ
nncf-torch         NNCF ``nncf.quantize`` on the torch module, ``torch.onnx.export``: OpenVINO
                   ``FakeQuantize`` nodes (domain ``org.openvinotoolkit``)
nncf-torch-strip   the same after ``nncf.strip`` (torch fake-quantize ops), exported: QDQ
quark-a8w8         AMD Quark ``A8W8`` (int8 activations and weights, ``com.microsoft`` Q/DQ)
quark-xint8        AMD Quark ``XINT8`` (power-of-two scales, NPU CNN target)
brevitas-qcdq      Brevitas layers (``brevitas.graph.quantize`` on torchvision, or a small network of
                   ``brevitas.nn`` layers), calibrated, ``export_onnx_qcdq``: Q -> Clip -> DQ
brevitas-qonnx     the same through ``export_qonnx``: QONNX ``Quant`` nodes
inc-qdq            Intel Neural Compressor's ONNX Runtime quantization (``onnx-neural-compressor``,
                   ``StaticQuantConfig``), QDQ format
inc-qop            the same, its default QOperator format (QLinearConv, ...)
aimet-qdq          AIMET ``QuantizationSimModel`` (aimet-onnx), ``to_onnx_qdq()``
aimet-export       AIMET ``sim.export``: the float ONNX model plus its ``.encodings`` JSON sidecar
aeq-a8w8           Google's ai-edge-quantizer on the TFLite converter's float model, recipe
                   ``static_wi8_ai8``
aeq-a16w8          the same, recipe ``static_wi8_ai16`` (int16 activations)
aeq-dynamic        the same, recipe ``dynamic_wi8_afp32`` (int8 weights, float activations)
=================  ===================================================================================

The toolkits do not share one virtual environment with irgen's test pins: AMD Quark 0.13 needs
``onnx<=1.22.0`` (irgen's test extra pins ``onnx==1.23.2``), and the ONNX part of Intel Neural
Compressor (neural-compressor 3.x has none; ``onnx-neural-compressor==1.0``) needs ``numpy<2``.
So the module is also a script that builds one case in whichever venv has the toolkit::

    python tests/toolkits.py --list
    python tests/toolkits.py --build nncf-onnx-resnet18 --out DIR       # prints the model and inputs
    python tests/toolkits.py --build CASE CASE ... --folder DIR         # each in a process of its own
    python tests/toolkits.py --run nncf-onnx-resnet18 --folder DIR      # irgen run + verify (irgen's venv)

A builder whose toolkit is not importable raises :class:`ToolkitMissing`, naming the package.

The committed fixtures (``tests/data/toolkits``, run by ``tests/test_toolkits.py``) are the small
CNN :data:`FIXTURE_ARCH` (32x32) built by the settings of :data:`FIXTURES`, each the same way::

    python tests/toolkits.py --fixtures nncf-onnx quark-a8w8 ...        # or 'all', in the toolkits' venv
    python tests/toolkits.py --fixtures inc-qdq --fixture-dir DIR       # elsewhere (to compare bytes)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo  # noqa: E402  (the zoo's seeded architectures, samples, and run_case)

SIZE = 64
#: the toolkits' packages, at the versions the matrix was built with
PACKAGES = {
    "nncf": "nncf==3.4.0",
    "quark": "amd-quark==0.13",
    "brevitas": "brevitas==0.13.4",
    "qonnx": "qonnx==1.0.0",
    "onnx_neural_compressor": "onnx-neural-compressor==1.0",
    "aimet_onnx": "aimet-onnx==2.42.0",
    "ai_edge_quantizer": "ai-edge-quantizer==0.10.0",
    "tensorflow": "tensorflow-cpu==2.21.0",
    "torch": "torch==2.13.0",
    "onnx": "onnx",
    "onnxruntime": "onnxruntime==1.32.0",
}


class ToolkitMissing(ImportError):
    """A builder's toolkit is not importable in this Python."""


def _need(module: str):
    """``import module``, or :class:`ToolkitMissing` naming the package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = PACKAGES.get(module.split(".")[0], module.split(".")[0])
        raise ToolkitMissing(f"this case needs the package {package} ({module} is not importable in "
                             f"{sys.executable}: {err})") from err


@contextlib.contextmanager
def _quiet():
    """The toolkits print progress bars, banners and warnings: keep them out of the caller's output."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------ shared pieces

def _feeds(name: str = "x", shape=(1, 3, SIZE, SIZE)) -> dict[str, np.ndarray]:
    """The zoo's input (seed 1)."""
    return {name: zoo._sample(shape, np.float32, 1)}


def _calibration(feeds: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The zoo's calibration samples (seeds 100, 101, ...), as ``quantize_static`` gets them."""
    return [{n: zoo._sample(a.shape, a.dtype, 100 + k) for n, a in feeds.items()}
            for k in range(zoo.CALIBRATION_SAMPLES)]


def _reader(feeds: dict[str, np.ndarray]):
    """An onnxruntime ``CalibrationDataReader`` over :func:`_calibration` that can rewind (Intel
    Neural Compressor calls ``rewind``; ORT, Quark and the zoo's reader need only ``get_next``)."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.samples = _calibration(feeds)
            self.rewind()

        def get_next(self):
            return next(self.it, None)

        def rewind(self):
            self.it = iter(self.samples)

    return Reader()


def _builder(tag: str, ext: str = "onnx", doc: str | None = None):
    """A builder ``(arch, folder) -> (model path, feeds)`` from ``make(arch, folder, out) -> feeds``,
    which writes the model to ``out`` (``<arch>.<tag>.<ext>`` in ``folder``); the model and its
    inputs (``inputs.npz``) are kept in ``folder`` and returned from there without calling ``make``
    (nor importing the toolkit) when both exist. ``doc``: the builder's docstring, if not make's."""
    def wrap(make):
        @functools.wraps(make)
        def build(arch: str, folder: Path):
            folder = Path(folder)
            out, inputs = folder / f"{arch}.{tag}.{ext}", folder / "inputs.npz"
            if out.exists() and inputs.exists():
                return out, dict(np.load(inputs))
            folder.mkdir(parents=True, exist_ok=True)
            feeds = make(arch, folder, out)
            np.savez(inputs, **feeds)
            return out, feeds

        if make.__name__ == "make":  # made by a factory (_quark, _brevitas, ...): named after its tag
            build.__name__ = build.__qualname__ = tag.replace("-", "_")
        build.__doc__ = doc or make.__doc__
        return build

    return wrap


def _torch_module(arch: str):
    """The zoo's torchvision model, or :func:`_tk_cnn` (seed 0, batch norms randomized), in eval mode."""
    _need("torch").manual_seed(0)
    model, _ = (_tk_cnn if arch == FIXTURE_ARCH else zoo.TORCH_MODELS[arch])()
    return model.eval()


def _float_onnx(arch: str, folder: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """The zoo's float ONNX export of ``arch`` (TorchScript exporter, opset 17, input ``x``)."""
    _need("torch")
    folder.mkdir(parents=True, exist_ok=True)
    if arch == FIXTURE_ARCH:
        onnx_path, feeds = folder / f"{arch}.onnx", _feeds(shape=(1, 3, FIXTURE_SIZE, FIXTURE_SIZE))
        if not onnx_path.exists():
            _export(_torch_module(arch), feeds, onnx_path)
        return onnx_path, feeds
    onnx_path, _, feeds = zoo._torch_base(arch, folder)
    if not onnx_path.exists():
        raise RuntimeError(f"the float ONNX export of {arch} failed: "
                           f"{(folder / f'{arch}.onnx.error').read_text()[:300]}")
    return onnx_path, feeds


# ------------------------------------------------------------------ the fixtures' architecture

#: the small CNN of the committed fixtures (tests/data/toolkits), in torch and in Keras
FIXTURE_ARCH = "tk_cnn"
FIXTURE_SIZE = 32


def _tk_cnn():
    """A small CNN, ``(module, {input: shape})``: conv+BN+ReLU, max pool, a residual block (two
    conv+BN, the add, a ReLU), a strided conv+BN+ReLU, a depthwise conv+BN+ReLU, global average pool,
    linear; 32x32 inputs, about 3,000 weights, batch norms randomized (the zoo's ranges)."""
    torch = _need("torch")
    from torch import nn

    def cbr(cin, cout, stride=1, groups=1, relu=True):
        layers = [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, *([nn.ReLU()] if relu else []))

    class TkCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.pool = cbr(3, 8), nn.MaxPool2d(2)
            self.conv1, self.conv2, self.relu = cbr(8, 8), cbr(8, 8, relu=False), nn.ReLU()
            self.down, self.dw = cbr(8, 16, stride=2), cbr(16, 16, groups=16)
            self.gap, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

        def forward(self, x):
            x = self.pool(self.stem(x))
            x = self.relu(x + self.conv2(self.conv1(x)))
            return self.fc(torch.flatten(self.gap(self.dw(self.down(x))), 1))

    torch.manual_seed(0)
    model = TkCNN()
    zoo._randomize_bn(model)
    return model.eval(), {"x": (1, 3, FIXTURE_SIZE, FIXTURE_SIZE)}


def _keras_tk_cnn(tf):
    """:func:`_tk_cnn` in Keras (NHWC, every layer named, weights and batch-norm statistics from
    seeded numpy draws, so the same in any process)."""
    layers, rng = tf.keras.layers, np.random.default_rng(0)

    def cbr(x, name, filters, stride=1, depthwise=False, relu=True):
        if depthwise:
            x = layers.DepthwiseConv2D(3, padding="same", use_bias=False, name=f"{name}_dw")(x)
        else:
            x = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False, name=f"{name}_conv")(x)
        x = layers.BatchNormalization(name=f"{name}_bn")(x)
        return layers.ReLU(name=f"{name}_relu")(x) if relu else x

    inp = layers.Input((FIXTURE_SIZE, FIXTURE_SIZE, 3), name="x")
    x = layers.MaxPooling2D(2, name="pool")(cbr(inp, "stem", 8))
    y = cbr(cbr(x, "conv1", 8), "conv2", 8, relu=False)
    x = layers.ReLU(name="relu")(layers.Add(name="add")([x, y]))
    x = cbr(cbr(x, "down", 16, stride=2), "dw", 16, depthwise=True)
    x = layers.Dense(10, name="fc")(layers.GlobalAveragePooling2D(name="gap")(x))
    model = tf.keras.Model(inp, x, name=FIXTURE_ARCH)
    for layer in model.layers:
        weights = layer.get_weights()
        if isinstance(layer, layers.BatchNormalization):  # gamma, beta, mean, variance
            lows, highs = (0.5, -0.2, -0.3, 0.5), (1.5, 0.2, 0.3, 2.0)
            weights = [rng.uniform(lo, hi, w.shape) for w, lo, hi in zip(weights, lows, highs)]
        elif weights:  # He-uniform kernels, small biases
            fan_in = int(np.prod(weights[0].shape[:-1])) if len(weights[0].shape) > 1 else 1
            weights = [rng.uniform(-1, 1, w.shape) * (np.sqrt(6 / fan_in) if w.ndim > 1 else 0.1) for w in weights]
        layer.set_weights([w.astype(np.float32) for w in weights])
    return model


def _float_tflite(arch: str, folder: Path) -> tuple[Path, np.ndarray]:
    """The TFLite converter's float model of a Keras architecture (the zoo's ``keras.applications``
    ones, seed 0, or :func:`_keras_tk_cnn`) and its input (seed 1)."""
    tf = _need("tensorflow")
    if arch != FIXTURE_ARCH:
        float_path, x, _ = zoo._keras(arch, "tflite", folder)
        return float_path, x
    float_path = folder / f"{arch}.float.tflite"
    x = zoo._sample((1, FIXTURE_SIZE, FIXTURE_SIZE, 3), np.float32, 1)
    if not float_path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with _quiet():
            float_path.write_bytes(tf.lite.TFLiteConverter.from_keras_model(_keras_tk_cnn(tf)).convert())
    return float_path, x


# ------------------------------------------------------------------ NNCF

@_builder("nncf-onnx")
def nncf_onnx(arch: str, folder: Path, out: Path):
    """NNCF's ONNX backend: ``nncf.quantize`` on the float ONNX model (its defaults: the
    performance preset, symmetric int8 per-channel weights, calibration on the samples)."""
    nncf, onnx = _need("nncf"), _need("onnx")
    onnx_path, feeds = _float_onnx(arch, folder)
    with _quiet():
        model = nncf.quantize(onnx.load(str(onnx_path)), nncf.Dataset(_calibration(feeds)),
                              subset_size=zoo.CALIBRATION_SAMPLES)
    onnx.save(model, str(out))
    return feeds


def _nncf_torch_model(arch: str, folder: Path):
    """NNCF's torch backend: ``nncf.quantize`` on the torch module; returns (model, feeds). Its
    quantizers run a C++ extension that NNCF compiles on first use (minutes on two cores, more
    than NNCF's default 60 s limit): no limit here unless ``NNCF_EXTENSION_LOAD_TIMEOUT`` says one."""
    os.environ.setdefault("NNCF_EXTENSION_LOAD_TIMEOUT", "0")
    torch, nncf = _need("torch"), _need("nncf")
    _, feeds = _float_onnx(arch, folder)  # the zoo's input, and the same seeded weights
    model = _torch_module(arch)
    samples = [torch.from_numpy(s["x"]) for s in _calibration(feeds)]
    with _quiet():
        model = nncf.quantize(model, nncf.Dataset(samples), subset_size=zoo.CALIBRATION_SAMPLES)
    return model, feeds


def _export(model, feeds: dict[str, np.ndarray], out: Path) -> None:
    """``torch.onnx.export`` as the zoo exports (TorchScript exporter, opset 17)."""
    torch = _need("torch")
    args = tuple(torch.from_numpy(a) for a in feeds.values())
    with _quiet(), torch.no_grad():
        torch.onnx.export(model, args, str(out), input_names=list(feeds), output_names=["y"], dynamo=False,
                          opset_version=17)


@_builder("nncf-torch")
def nncf_torch(arch: str, folder: Path, out: Path):
    """NNCF's torch backend exported to ONNX as it is: NNCF's quantizers export as OpenVINO's
    ``FakeQuantize`` (domain ``org.openvinotoolkit``)."""
    model, feeds = _nncf_torch_model(arch, folder)
    _export(model, feeds, out)
    return feeds


@_builder("nncf-torch-strip")
def nncf_torch_strip(arch: str, folder: Path, out: Path):
    """NNCF's torch backend, ``nncf.strip`` (its default ``StripFormat.NATIVE``: torch's own
    fake-quantize ops), exported to ONNX: QuantizeLinear/DequantizeLinear pairs."""
    model, feeds = _nncf_torch_model(arch, folder)
    nncf, torch = _need("nncf"), _need("torch")
    with _quiet():
        model = nncf.strip(model, example_input=torch.from_numpy(feeds["x"]))
    _export(model, feeds, out)
    return feeds


# ------------------------------------------------------------------ AMD Quark

def _quark(config_name: str):
    def make(arch: str, folder: Path, out: Path):
        _need("quark.onnx")
        onnx_path, feeds = _float_onnx(arch, folder)
        from quark.onnx import ModelQuantizer
        from quark.onnx.quantization.config.config import Config
        from quark.onnx.quantization.config.custom_config import get_default_config

        # Quark writes quantized_info.csv into the current folder: the build folder's
        with _quiet(), contextlib.chdir(folder):
            config = Config(global_quant_config=get_default_config(config_name))
            ModelQuantizer(config).quantize_model(str(onnx_path.resolve()), str(out.resolve()), _reader(feeds))
        return feeds

    return _builder(f"quark-{config_name.lower()}",
                    doc=f"AMD Quark's ONNX quantizer with its default configuration ``{config_name}``.")(make)


quark_a8w8 = _quark("A8W8")
quark_xint8 = _quark("XINT8")


# ------------------------------------------------------------------ Brevitas

def _brevitas_small():
    """A small network of Brevitas layers (int8 weights per tensor, int8/uint8 activations,
    float scales): conv, batch norm, ReLU, max pool, a residual add, global average pool, linear."""
    torch = _need("torch")
    qnn = _need("brevitas.nn")
    from brevitas.quant import Int8ActPerTensorFloat, Int8WeightPerTensorFloat, Uint8ActPerTensorFloat
    from torch import nn

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            kw = dict(weight_quant=Int8WeightPerTensorFloat, bias=True)
            self.inp = qnn.QuantIdentity(act_quant=Int8ActPerTensorFloat, return_quant_tensor=True)
            self.conv1 = qnn.QuantConv2d(3, 16, 3, stride=2, padding=1, **kw)
            self.bn1 = nn.BatchNorm2d(16)
            self.relu1 = qnn.QuantReLU(act_quant=Uint8ActPerTensorFloat, return_quant_tensor=True)
            self.pool = nn.MaxPool2d(2)
            self.conv2 = qnn.QuantConv2d(16, 16, 3, padding=1, **kw)
            self.relu2 = qnn.QuantReLU(act_quant=Uint8ActPerTensorFloat, return_quant_tensor=True)
            self.conv3 = qnn.QuantConv2d(16, 16, 3, padding=1, **kw)
            self.add_quant = qnn.QuantIdentity(act_quant=Int8ActPerTensorFloat, return_quant_tensor=True)
            self.relu3 = qnn.QuantReLU(act_quant=Uint8ActPerTensorFloat, return_quant_tensor=True)
            self.gap = qnn.TruncAdaptiveAvgPool2d((1, 1)) if hasattr(qnn, "TruncAdaptiveAvgPool2d") \
                else nn.AdaptiveAvgPool2d(1)
            self.fc = qnn.QuantLinear(16, 10, **kw)

        def forward(self, x):
            x = self.pool(self.relu1(self.bn1(self.conv1(self.inp(x)))))
            y = self.conv3(self.relu2(self.conv2(x)))
            x = self.relu3(self.add_quant(x) + self.add_quant(y))
            return self.fc(torch.flatten(self.gap(x), 1))

    model = Small()
    zoo._randomize_bn(model)
    return model.eval()


#: Brevitas architectures besides the torchvision ones (quantized by ``brevitas.graph.quantize``)
BREVITAS_OWN = {"brevitas_small": _brevitas_small}


def _brevitas_model(arch: str, feeds: dict[str, np.ndarray]):
    """``arch`` in Brevitas layers, calibrated on the samples (``calibration_mode``), with
    batch norms folded into the convolutions first for the torchvision ones
    (``preprocess_for_quantize``, then ``quantize``: Brevitas's int8 per-tensor defaults)."""
    torch = _need("torch")
    _need("brevitas")
    from brevitas.graph.calibrate import calibration_mode

    torch.manual_seed(0)
    if arch in BREVITAS_OWN:
        model = BREVITAS_OWN[arch]()
    else:
        from brevitas.graph.quantize import preprocess_for_quantize, quantize

        with _quiet():
            model = quantize(preprocess_for_quantize(_torch_module(arch)))
    model.eval()
    with _quiet(), torch.no_grad(), calibration_mode(model):
        for s in _calibration(feeds):
            model(torch.from_numpy(s["x"]))
    return model


def _brevitas(export: str):
    def make(arch: str, folder: Path, out: Path):
        _need("brevitas")
        feeds = _feeds() if arch in BREVITAS_OWN else _float_onnx(arch, folder)[1]
        model = _brevitas_model(arch, feeds)
        torch = _need("torch")
        from brevitas.export import export_onnx_qcdq, export_qonnx

        fn = export_onnx_qcdq if export == "qcdq" else export_qonnx
        with _quiet(), torch.no_grad():
            # the TorchScript exporter: Brevitas's dynamo one (its default with torch 2.13) refuses
            # quantized biases ("QCDQ export with `dynamo=True` does not support quantized bias")
            fn(model, args=torch.from_numpy(feeds["x"]), export_path=str(out), input_names=["x"],
               output_names=["y"], dynamo=False, **({"opset_version": 17} if export == "qcdq" else {}))
        return feeds

    return _builder(f"brevitas-{export}", doc=f"Brevitas, calibrated, exported by "
                    f"``export_{'onnx_qcdq' if export == 'qcdq' else 'qonnx'}``.")(make)


brevitas_qcdq = _brevitas("qcdq")
brevitas_qonnx = _brevitas("qonnx")


# ------------------------------------------------------------------ Intel Neural Compressor

def _inc(fmt: str):
    def make(arch: str, folder: Path, out: Path):
        _need("onnx_neural_compressor")
        onnx_path, feeds = _float_onnx(arch, folder)
        from onnx_neural_compressor.quantization import config, quantize
        from onnxruntime.quantization import QuantFormat

        qformat = QuantFormat.QDQ if fmt == "qdq" else QuantFormat.QOperator
        with _quiet():
            quantize(str(onnx_path), str(out),
                     config.StaticQuantConfig(calibration_data_reader=_reader(feeds), quant_format=qformat))
        return feeds

    return _builder(f"inc-{fmt}", doc=f"Intel Neural Compressor's ONNX Runtime static quantization "
                    f"(``onnx-neural-compressor``, ``StaticQuantConfig`` defaults: MinMax, uint8 activations, "
                    f"int8 weights), ``{'QDQ' if fmt == 'qdq' else 'QOperator'}`` format.")(make)


inc_qdq = _inc("qdq")
inc_qop = _inc("qop")


# ------------------------------------------------------------------ AIMET

def _aimet_sim(arch: str, folder: Path):
    onnx = _need("onnx")
    _need("aimet_onnx")
    onnx_path, feeds = _float_onnx(arch, folder)
    from aimet_onnx.quantsim import QuantizationSimModel

    with _quiet():
        sim = QuantizationSimModel(onnx.load(str(onnx_path)), param_type="int8", activation_type="int8",
                                   quant_scheme="min_max", dummy_input=feeds)
        sim.compute_encodings(_calibration(feeds))
    return sim, feeds


@_builder("aimet-qdq")
def aimet_qdq(arch: str, folder: Path, out: Path):
    """AIMET's ``QuantizationSimModel`` (aimet-onnx defaults: int8, min-max, its default config
    file), calibrated, as a QDQ model: ``sim.to_onnx_qdq()``."""
    sim, feeds = _aimet_sim(arch, folder)
    with _quiet():
        model = sim.to_onnx_qdq()
    _need("onnx").save(model, str(out))
    return feeds


@_builder("aimet")
def aimet_export(arch: str, folder: Path, out: Path):
    """AIMET's own export, ``sim.export``: the float ONNX model, its quantization in the
    ``.encodings`` JSON beside it (``<arch>.aimet.onnx`` and ``<arch>.aimet.encodings``)."""
    sim, feeds = _aimet_sim(arch, folder)
    with _quiet():
        sim.export(str(folder), out.name.removesuffix(".onnx"))
    return feeds


# ------------------------------------------------------------------ ai-edge-quantizer (TFLite)

def _aeq(recipe_name: str, tag: str):
    def make(arch: str, folder: Path, out: Path):
        tf = _need("tensorflow")
        _need("ai_edge_quantizer")
        from ai_edge_quantizer import quantizer, recipe

        tf.keras.backend.clear_session()  # Keras numbers its layer names per process: the same names in any order
        float_path, x = _float_tflite(arch, folder)
        signature = tf.lite.Interpreter(model_path=str(float_path)).get_signature_runner()
        name = next(iter(signature.get_input_details()))
        feeds = {name: x}
        with _quiet():
            qt = quantizer.Quantizer(str(float_path), getattr(recipe, recipe_name)())
            calibration = None
            if "static" in recipe_name:
                calibration = qt.calibrate({"serving_default": _calibration(feeds)})
            qt.quantize(calibration).export_model(str(out), overwrite=True)
        return {name: _tflite_input(out, x)}

    return _builder(f"aeq-{tag}", "tflite",
                    doc=f"ai-edge-quantizer's recipe ``{recipe_name}`` on the TFLite converter's float model.")(make)


def _tflite_input(path: Path, x: np.ndarray) -> np.ndarray:
    """``x`` as the TFLite model's input takes it: quantized with its input's parameters when the
    input is an integer (the static recipes write no QUANTIZE op), else as it is."""
    detail = _need("tensorflow").lite.Interpreter(model_path=str(path)).get_input_details()[0]
    if np.dtype(detail["dtype"]).kind not in "iu":
        return x
    scale, zp = detail["quantization"]
    info = np.iinfo(detail["dtype"])
    return np.clip(np.round(x / scale) + zp, info.min, info.max).astype(detail["dtype"])


aeq_a8w8 = _aeq("static_wi8_ai8", "a8w8")
aeq_a16w8 = _aeq("static_wi8_ai16", "a16w8")
aeq_dynamic = _aeq("dynamic_wi8_afp32", "dynamic")


# ------------------------------------------------------------------ the matrix

TORCHVISION = ("resnet18", "mobilenet_v2", "squeezenet1_1", "efficientnet_b0")
#: Keras MobileNetV2's random-weight activations vanish at 64x64 (block 16 calibrates to a 2e-9 scale): its
#: int8 model is refused by TFLite's reference kernels (no_integer_overflow_from_quantization), its 16x8 one
#: by every kernel; kept for the int8 recipe (the optimized kernels run it), MobileNetV3Small for the others
KERAS = ("MobileNetV2", "MobileNetV3Small", "ResNet50", "EfficientNetB0")

#: setting -> (builder, its architectures); a case is ``<setting>-<arch>``
SETTINGS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "nncf-onnx": (nncf_onnx, TORCHVISION),
    "nncf-torch": (nncf_torch, TORCHVISION[:3]),
    "nncf-torch-strip": (nncf_torch_strip, TORCHVISION[:3]),
    "quark-a8w8": (quark_a8w8, TORCHVISION),
    "quark-xint8": (quark_xint8, TORCHVISION),
    "brevitas-qcdq": (brevitas_qcdq, ("brevitas_small", "resnet18", "mobilenet_v2")),
    "brevitas-qonnx": (brevitas_qonnx, ("brevitas_small", "resnet18", "mobilenet_v2")),
    "inc-qdq": (inc_qdq, TORCHVISION[:3]),
    "inc-qop": (inc_qop, TORCHVISION[:3]),
    "aimet-qdq": (aimet_qdq, TORCHVISION[:3]),
    "aimet-export": (aimet_export, TORCHVISION[:1]),
    "aeq-a8w8": (aeq_a8w8, KERAS),
    "aeq-a16w8": (aeq_a16w8, KERAS[1:2]),
    "aeq-dynamic": (aeq_dynamic, KERAS[1:2]),
}


@dataclass(frozen=True)
class Case:
    """One toolkit x setting x architecture (``id``: ``<setting>-<arch>``); ``model`` and ``fmt``
    as :class:`zoo.Case` names them, so :func:`zoo.run_case` takes it."""
    fmt: str
    model: str

    @property
    def id(self) -> str:
        return f"{self.fmt}-{self.model}"

    @property
    def quantized(self) -> bool:
        return True

    @property
    def toolkit(self) -> str:
        return self.fmt.split("-")[0]


def cases() -> list[Case]:
    return [Case(setting, arch) for setting, (_, archs) in SETTINGS.items() for arch in archs]


#: the settings with a committed fixture (:data:`FIXTURE_ARCH` built by the setting's builder, the
#: file ``tests/data/toolkits/<setting>.<ext>``): each toolkit's export that irgen takes
FIXTURES = ("nncf-onnx", "nncf-torch", "nncf-torch-strip", "quark-a8w8", "quark-xint8", "brevitas-qcdq",
            "brevitas-qonnx", "inc-qdq", "aimet-qdq", "aeq-a8w8")
FIXTURE_DIR = Path(__file__).resolve().parent / "data" / "toolkits"


def fixture(setting: str, folder: Path = FIXTURE_DIR) -> Path:
    """The committed fixture of ``setting``: ``<folder>/<setting>.onnx`` or ``.tflite``."""
    return Path(folder) / f"{setting}.{'tflite' if setting.startswith('aeq-') else 'onnx'}"


def fixture_input(setting: str, folder: Path = FIXTURE_DIR) -> np.ndarray:
    """The input irgen and the runtime get for a fixture: the zoo's seed-1 sample, NCHW for the
    ONNX ones; NHWC for the TFLite one, quantized as its integer input takes it (needs tensorflow)."""
    if not setting.startswith("aeq-"):
        return _feeds(shape=(1, 3, FIXTURE_SIZE, FIXTURE_SIZE))["x"]
    return _tflite_input(fixture(setting, folder), zoo._sample((1, FIXTURE_SIZE, FIXTURE_SIZE, 3), np.float32, 1))


def _inline_external_data(model: Path, dest: Path) -> None:
    """An ONNX model whose weights lie in a file beside it (Intel Neural Compressor writes every
    model so) saved to ``dest`` with them inside: one self-contained file a fixture."""
    if model.suffix != ".onnx":
        return
    onnx = _need("onnx")
    m = onnx.load(str(model), load_external_data=False)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in m.graph.initializer):
        onnx.save(onnx.load(str(model)), str(dest))  # loaded with its external data, saved without


def build_fixtures(settings: list[str], folder: Path = FIXTURE_DIR) -> int:
    """Build each setting's fixture in a process of its own (see :func:`build`), in a scratch
    folder, and copy the model to :func:`fixture`; prints one JSON line a setting (its size and
    sha256, or the error). Returns 0 when every one was built."""
    import hashlib
    import shutil
    import tempfile

    code = 0
    for setting in settings:
        with tempfile.TemporaryDirectory(prefix=f"irgen-fixture-{setting}-") as scratch:
            p = subprocess.run([sys.executable, __file__, "--build", f"{setting}-{FIXTURE_ARCH}", "--out", scratch],
                               capture_output=True, text=True)
            lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
            if p.returncode or not lines or "model" not in lines[-1]:
                print(json.dumps({"fixture": setting, "error": lines[-1].get("error") if lines else p.stderr[-500:]}))
                code = 1
                continue
            dest = fixture(setting, folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(lines[-1]["model"], dest)
            _inline_external_data(Path(lines[-1]["model"]), dest)
        data = dest.read_bytes()
        print(json.dumps({"fixture": setting, "file": str(dest), "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()}), flush=True)
    return code


def case(case_id: str) -> Case:
    found = [c for c in cases() if c.id == case_id]
    if not found and case_id.endswith(f"-{FIXTURE_ARCH}") and case_id.removesuffix(f"-{FIXTURE_ARCH}") in SETTINGS:
        found = [Case(case_id.removesuffix(f"-{FIXTURE_ARCH}"), FIXTURE_ARCH)]  # a fixture's case
    if not found:
        raise KeyError(f"no toolkit case {case_id!r} (python tests/toolkits.py --list)")
    return found[0]


def build(case_id: str, folder: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """Build ``case_id`` into ``folder`` (cached there): (model path, {input name: array}).

    The same bytes every time when built in a fresh process: a toolkit loaded before in the same
    process can change another's file (AIMET registers its custom-op domain with onnxruntime, and
    Quark then lists it in its model's ``opset_import``), so the script builds each case apart."""
    c = case(case_id)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return SETTINGS[c.fmt][0](c.model, folder)


def irgen_args(feeds: dict[str, np.ndarray], folder: Path) -> list[str]:
    """``irgen run``'s ``--input`` arguments for ``feeds``, written as ``.npy`` in ``folder``: ``FILE``
    for a model's one input (the TFLite converter renames it), else ``NAME=FILE`` each."""
    args = []
    for name, a in feeds.items():
        f = Path(folder) / f"input.{name.replace('/', '_').replace(':', '_')}.npy"
        np.save(f, a)
        args += ["--input", str(f) if len(feeds) == 1 else f"{name}={f}"]
    return args


def run_case(c: Case, folder: Path, runner=None) -> dict:
    """:func:`zoo.run_case` on a toolkit case: the model built (or found) in ``folder/<case id>``,
    irgen's output in ``folder/<case id>/out/<case id>``, with ``--no-cache``; the summary has
    ``exact_share`` (of the layers compared with the source runtime) and ``worst_local_lsb``."""
    where = Path(folder) / c.id

    def toolkit_build(_case, _models):
        model, feeds = build(c.id, where)
        return model, [*irgen_args(feeds, where), "--no-cache"]

    saved = zoo.build
    zoo.build = toolkit_build  # zoo.run_case builds through its module's build()
    try:
        return zoo.run_case(c, where, runner=runner)
    finally:
        zoo.build = saved


def row(s: dict) -> str:
    """A markdown row: toolkit | setting | architecture | what irgen says."""
    c = case(s["case"])
    if not s.get("layers"):
        said = "run fails: " + " ".join(s.get("error") or ["?"])
    else:
        share, lsb, rel = s.get("exact_share"), s.get("worst_local_lsb"), s.get("worst_rel")
        runtime = (s.get("runtime") or "?").split(" (")[0]
        share = "" if share is None else f"{share:.0%} of {s.get('compared')} layers equal to {runtime}"
        verdict = ("PASS" if s["source_ran"] else "PASS (no source check)") if s["passed"] else "verify FAILS"
        said = f"{verdict}: {share}" + (f", worst {lsb} LSB" if lsb is not None else
                                        f", float layers, worst relative error {rel:.1e}" if rel is not None else "")
        if not s["passed"] and s.get("problems"):
            said += "; " + s["problems"][0]
    return f"| {c.toolkit} | {c.fmt} | {c.model} | {said.replace('|', '/')} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the case ids")
    ap.add_argument("--build", nargs="+", metavar="CASE", help="build these cases (into --out, or --folder/CASE)")
    ap.add_argument("--out", type=Path, help="with one --build case: the folder to build it in")
    ap.add_argument("--run", nargs="+", metavar="CASE",
                    help="irgen run + verify on these cases (ids, settings, toolkits or architectures; 'all')")
    ap.add_argument("--folder", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "irgen-toolkits")
    ap.add_argument("--json", type=Path, help="with --run: write the summaries (without verify's JSON) here")
    ap.add_argument("--fixtures", nargs="+", metavar="SETTING",
                    help=f"build these settings' fixtures ({FIXTURE_ARCH}; 'all': {', '.join(FIXTURES)}) into "
                         "--fixture-dir, each in a process of its own")
    ap.add_argument("--fixture-dir", type=Path, default=FIXTURE_DIR, help="with --fixtures (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(c.id for c in cases()))
    code = build_fixtures(list(FIXTURES) if args.fixtures == ["all"] else args.fixtures, args.fixture_dir) \
        if args.fixtures else 0
    if args.build and len(args.build) > 1:  # each case in a process of its own (see build())
        for case_id in args.build:
            code |= subprocess.run([sys.executable, __file__, "--build", case_id, "--out",
                                    str(args.folder / case_id)]).returncode
        args.build = []
    for case_id in args.build or []:
        where = args.out or args.folder / case_id
        try:
            model, feeds = build(case_id, where)
        except Exception as err:  # noqa: BLE001  (one line per case: the toolkit's own error)
            print(json.dumps({"case": case_id, "error": f"{type(err).__name__}: {err}"[:500]}), flush=True)
            code = 1
            continue
        print(json.dumps({"case": case_id, "model": str(model), "irgen_args": irgen_args(feeds, where)}), flush=True)
    if args.run:
        todo = [c for c in cases() if "all" in args.run or {c.id, c.fmt, c.toolkit, c.model} & set(args.run)]
        summaries = []
        for c in todo:
            try:
                s = run_case(c, args.folder, runner=zoo._subprocess)
            except Exception as err:  # noqa: BLE001  (a build failure is a row too)
                s = {"case": c.id, "passed": False, "error": [f"build: {type(err).__name__}: {err}"[:300]]}
            s.pop("verify", None)
            summaries.append(s)
            print(row(s), flush=True)
            if args.json:
                args.json.write_text(json.dumps(summaries, indent=1))
        code = code or int(not all(s["passed"] for s in summaries))
    return code


if __name__ == "__main__":
    sys.exit(main())
