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

from typing import Any, Callable, Mapping

import pluggy

from irgen.api import Backend, DumpReader, Frontend, Option, Quantizer, Serializer, Signature

PROJECT = "irgen"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def irgen_register_frontends(register: Callable[[Frontend], None]) -> None:
    """Register model-file frontends (one per model format).

    Call ``register(Frontend(...))`` for each; its ``name`` is what
    ``irgen run --frontend NAME`` selects.
    """


@hookspec
def irgen_register_quantizers(register: Callable[[Quantizer], None]) -> None:
    """Register quantization-fusion schemes (one per way a model is quantized and computed).

    Call ``register(Quantizer(...))`` for each. The quantizer carries all of its scheme:
    ``detect`` and ``realize``, and what ``irgen verify`` asks of a layer whose
    ``quant.scheme`` is its name (``recompute``: kind -> numpy recompute; ``consistency``).
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


@hookspec
def irgen_register_options(register: Callable[[Option], None]) -> None:
    """Register command-line options for ``irgen run`` (and ``irgen verify``), as
    ``pytest_addoption`` does.

    Call ``register(Option(name=..., help=..., kind=...))`` for each. irgen loads the
    plugins first (``--plugin`` is read before anything else), then builds the
    command line with every registered option, grouped under its plugin in
    ``--help``. The value reaches a frontend as ``options[name]`` in
    ``load(path, options)`` and every plugin through :func:`irgen_configure`.
    Two plugins registering one name, or a name that clashes with a core option,
    is an error naming them. ``record=True`` stores the value in
    ``manifest.json`` for ``irgen verify``'s source check; ``runs_code=True`` keeps
    a recorded value from being used without ``irgen verify --allow-pickle``.
    """


@hookspec
def irgen_configure(options: Mapping[str, Any]) -> None:
    """Called once before ``irgen run`` imports the model, with the run's options.

    ``options`` maps every registered :class:`~irgen.api.Option`'s name to its value
    (or default), besides the core ones (``input_shapes``, ``allow_pickle``,
    ``max_tensor_bytes``, ``opt_level``, ``backend``, ...). A backend or serializer
    reads its own options here (e.g. a channel multiple) and keeps them for the run;
    the mapping is read-only.
    """


@hookspec
def irgen_register_signatures(register: Callable[[Signature], None]) -> None:
    """Register hardware-bug signatures for ``irgen compare``'s diagnosis.

    Call ``register(Signature(name=..., code=..., check=...))`` for each. ``irgen compare``
    calls every signature's ``check`` with a :class:`~irgen.api.Mismatch` (a layer output
    the device computed wrong from its own inputs) after the core's own signatures; each
    that returns evidence is reported under its ``code``, one of the fixed vocabulary
    :data:`irgen.api.SIGNATURE_CODES`. A backend adds here what it knows of its hardware
    (its memory words, its padding); a name another plugin registered is an error.
    """


@hookspec
def irgen_register_dump_readers(register: Callable[[DumpReader], None]) -> None:
    """Register readers of device dump files for ``irgen compare``.

    Call ``register(DumpReader(name=..., read=...))`` for each. A reader named after a
    backend reads the dump of an OUT that backend wrote (files laid out as in OUT, in
    its formats); any reader is chosen by a ``--map`` entry's ``format: NAME``. Its
    ``read(path, record)`` returns the physical array (the record's ``storage`` shape and
    dtype); irgen strips the channel padding and transposes to the logical layout.
    """
