"""irgen frontend for PyTorch models, through TVM's Relax ExportedProgram importer.

Two kinds of files:

- ``.pt2``: an ``ExportedProgram`` written by ``torch.export.save``;
- ``.pth``: a state dict, with ``--model-class package.module:Class`` (the
  module must be importable: installed, on ``PYTHONPATH``, or in the current
  directory), optional ``--model-args JSON`` (constructor keyword arguments)
  and ``--input-shape NAME=DIMS`` (the example input shape, required). The
  class is instantiated, the state dict loaded with ``strict=True`` and the
  model exported with ``torch.export.export`` on a zero input of that shape;
  the input is named NAME, whatever forward()'s argument is called.
  A ``.pth`` that holds a whole pickled module is refused unless
  ``--allow-pickle`` is given: unpickling runs arbitrary code from the file.

Both are untrusted input (:mod:`irgen_torch.loader`): only regular files are
opened; a ``.pt2`` is inspected before torch reads it (:mod:`irgen_torch.archive`:
member and tensor sizes, pickled members, symbolic expressions torch would
``eval``, AOTInductor code) and loaded under a guard that keeps torch from
unpickling anything but plain tensors (:mod:`irgen_torch.guard`), unless
``--allow-pickle`` says the file is trusted. A ``.pt2`` program's input shapes
are fixed, except the dynamic dimensions of a program exported with ``dynamic_shapes``:
``--input-shape`` gives those (:mod:`irgen_torch.dynamic` specializes the graph to the
shapes and reads the program's declared interface for ``irgen run --decode``).

The graph is translated without ATen decomposition, so FX node names and ops
(``aten.conv2d.default``, ...) are the ones ``ExportedProgram.graph`` shows.
TVM's importer names its bindings ``lv``, ``lv1``, ...; this frontend renames
the binding that holds each FX node's result after the FX node
(``t_<node name>``) and records it in :class:`irgen.plugin.Provenance` as
(FX node name, ATen op name, FX node name). Values that do not depend on the
user inputs (masks and index tensors built from shapes) are computed by torch
and imported as constants (:mod:`irgen_torch.fold`).

Modules: :mod:`irgen_torch.translate` (the importer: ``load`` and the
translation driver), :mod:`irgen_torch.converters` (irgen's converters, one per
ATen op, over TVM's; :mod:`irgen_torch.recurrent`: ``nn.LSTM``, ``GRU`` and ``RNN``, one
layer per time step), :mod:`irgen_torch.runner` (the source runner for
``verify``), :mod:`irgen_torch.loader` / :mod:`irgen_torch.archive` /
:mod:`irgen_torch.guard` (reading untrusted files), :mod:`irgen_torch.fold`
(input-independent values), :mod:`irgen_torch.dynamic` (a program's declared
interface, ``Frontend.interface``, and its graph at the ``--input-shape`` of its
dynamic dimensions); this module registers them.
"""

from __future__ import annotations

from irgen.plugin import Frontend, Option, hookimpl

from .dynamic import model_interface
from .runner import record_nodes, source_runner
from .translate import load_torch, translate

__version__ = "0.1.0"
__all__ = ["load_torch", "record_nodes", "source_runner", "translate"]

_SUFFIXES = (".pt2", ".pth", ".pt")


@hookimpl
def irgen_register_frontends(register):
    register(
        Frontend(
            name="torch",
            suffixes=_SUFFIXES,
            load=load_torch,
            description="PyTorch: torch.export .pt2 programs, .pth state dicts with --model-class",
            runner=source_runner,
            quant_dialect="torch-qdq",
            interface=model_interface,
        )
    )


@hookimpl
def irgen_register_options(register):
    group = "torch .pth state dicts"
    register(Option(
        name="model_class", metavar="MODULE:CLASS", group=group, record=True, runs_code=True,
        help="nn.Module class a .pth state dict belongs to, e.g. mypkg.nets:Net; the module must be importable "
             "(installed, on PYTHONPATH or in the current directory); needs --input-shape NAME=DIMS for the "
             "example input",
    ))
    register(Option(
        name="model_args", kind="json", metavar="JSON", group=group, record=True,
        help="constructor keyword arguments for --model-class, a JSON object",
    ))
