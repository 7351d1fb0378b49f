"""The hooks irgen plugins implement.

A plugin is a module (or any object) with functions marked ``@hookimpl`` whose
names match the specs below; it is found through the ``irgen`` entry-point
group or loaded with ``irgen --plugin MODULE_OR_FILE``::

    from irgen import hookimpl
    from irgen.api import Serializer

    @hookimpl
    def irgen_register_serializers(register):
        register(Serializer(name="yaml", write=write_yaml))

Each hook receives a ``register`` callback: call it once per object. The core
owns the registries (see :mod:`irgen.plugins`); registering a name another
plugin already registered is an error that names both plugins.

Plugins must import heavy libraries (tvm, torch, tensorflow, onnx) lazily,
inside the functions they register, never at module level: ``irgen --help``
and ``irgen plugins`` import every plugin.
"""

from __future__ import annotations

from typing import Callable

import pluggy

from irgen.api import Backend, Frontend, Quantizer, Serializer

PROJECT = "irgen"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def irgen_register_frontends(register: Callable[[Frontend], None]) -> None:
    """Register model-file frontends (ONNX, TFLite, torch.export, ...).

    Call ``register(Frontend(...))`` for each; its ``name`` is what
    ``irgen run --frontend NAME`` selects.
    """


@hookspec
def irgen_register_quantizers(register: Callable[[Quantizer], None]) -> None:
    """Register quantization-fusion schemes (``tflite-int8``, ``qdq``, ...).

    Call ``register(Quantizer(...))`` for each.
    """


@hookspec
def irgen_register_backends(register: Callable[[Backend], None]) -> None:
    """Register hardware backends: fusion rules, supported ops, data layout.

    Call ``register(Backend(...))`` for each; its ``name`` is what
    ``irgen run --backend NAME`` selects.
    """


@hookspec
def irgen_register_serializers(register: Callable[[Serializer], None]) -> None:
    """Register IR serializers, which write the custom IR into the output folder.

    Call ``register(Serializer(...))`` for each; its ``name`` is what
    ``irgen run --serializer NAME`` selects.
    """
