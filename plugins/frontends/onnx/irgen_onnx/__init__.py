"""irgen frontend for ONNX models (``.onnx``), through TVM's Relax ONNX importer.

TVM's importer keeps no source names, so this frontend subclasses it and, as
it walks the ONNX nodes, binds each node's result to a Relax variable named
after the ONNX output tensor; :class:`irgen.plugin.Provenance` maps those names
back to ONNX node and tensor names.

Modules: :mod:`irgen_onnx.translate` (the importer: ``load`` and its naming
importer), :mod:`irgen_onnx.converters` (irgen's converters over TVM's;
:mod:`irgen_onnx.recurrent`: LSTM, GRU and RNN, one layer per time step;
:mod:`irgen_onnx.dynamic_lstm`: ONNX Runtime's DynamicQuantizeLSTM, its int8 arithmetic),
:mod:`irgen_onnx.runner` (the source runner for ``verify``; :mod:`irgen_onnx.openvino_runner`:
OpenVINO for a model with ``FakeQuantize`` nodes, which :mod:`irgen_onnx.fakequant` lowers), :mod:`irgen_onnx.interface`
(the declared inputs and outputs, for ``irgen run --decode``),
:mod:`irgen_onnx.prepare` (every check and graph fix before the importer, in
order), :mod:`irgen_onnx.loader` / :mod:`irgen_onnx.checks` (reading and
checking untrusted files), :mod:`irgen_onnx.qoperator` / :mod:`irgen_onnx.inline`
/ :mod:`irgen_onnx.fold` (graph fixes), :mod:`irgen_onnx.nbits` / :mod:`irgen_onnx.float8`
(MatMulNBits and block DequantizeLinear of 4-bit weights, float8 Q/DQ); this module registers them.
"""

from __future__ import annotations

from irgen.plugin import Frontend, hookimpl

from .interface import model_interface
from .prepare import prepare
from .runner import source_runner
from .translate import load_onnx

__version__ = "0.1.0"
__all__ = ["load_onnx", "prepare", "source_runner"]


@hookimpl
def irgen_register_frontends(register):
    register(
        Frontend(
            name="onnx",
            suffixes=(".onnx",),
            load=load_onnx,
            description="ONNX models through TVM's Relax ONNX importer",
            runner=source_runner,
            quant_dialect="onnx-qdq",
            interface=model_interface,
        )
    )
