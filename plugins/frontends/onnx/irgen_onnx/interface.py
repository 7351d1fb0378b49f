"""The model's declared inputs and outputs (``Frontend.interface``), read without importing
it: ``irgen run --decode`` chooses each step's shapes from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from irgen.plugin import DeclaredTensor, ModelInterface

from .checks import _declared, _real_inputs
from .loader import np_dtype, read_model, type_name


def _tensor(vi) -> DeclaredTensor:
    t = vi.type.tensor_type
    shape = tuple(d if isinstance(d, int) and d > 0 else (d if isinstance(d, str) else "?")
                  for d in _declared(vi)) if t.HasField("shape") else ()
    dtype = np_dtype(t.elem_type)
    return DeclaredTensor(vi.name, shape, str(dtype.name) if dtype is not None else type_name(t.elem_type))


def model_interface(path: Path, options: dict[str, Any]) -> ModelInterface:
    """The graph's inputs (initializers excluded) and outputs with their declared shapes; the
    file is parsed, its external data is not read."""
    model = read_model(Path(path), defer=True)
    return ModelInterface(inputs=tuple(_tensor(vi) for vi in _real_inputs(model)),
                          outputs=tuple(_tensor(vi) for vi in model.graph.output))
