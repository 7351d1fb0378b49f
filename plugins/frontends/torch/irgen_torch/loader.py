"""Reading ``.pt2`` and ``.pth`` files, which are untrusted input.

Both are opened once, as regular files only (:func:`irgen.plugin.open_regular`:
a FIFO or a device is refused before anything blocks), checked by
:mod:`irgen_torch.archive` and handed to torch as that same open file, under
:func:`irgen_torch.guard.no_code_from_file` unless ``--allow-pickle`` was given,
and with torch's own logging silenced. Every failure is one
:class:`irgen.plugin.IrgenError` naming the file.
"""

from __future__ import annotations

import importlib
import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from irgen.plugin import DEFAULT_MAX_TENSOR_BYTES, IrgenError, check_tensor_size, local_modules, open_regular

from .archive import TRUST, inspect_pt2, inspect_pth, one_line
from .guard import PickledDataError, no_code_from_file, quiet_torch


def _limit(options: dict[str, Any]) -> int | None:
    return options.get("max_tensor_bytes", DEFAULT_MAX_TENSOR_BYTES)


def _register_quantized_ops() -> None:
    try:
        import torch.ao.quantization.fx._decomposed  # noqa: F401  registers quantized_decomposed ops
    except Exception:  # noqa: BLE001
        pass


# ---------------------------------------------------------------- .pt2


def load_pt2(path: Path, options: dict[str, Any] | None = None):
    """The ``ExportedProgram`` in a ``torch.export.save`` archive."""
    import torch

    options = options or {}
    allow_pickle = bool(options.get("allow_pickle"))
    _register_quantized_ops()
    with open_regular(path, "model") as f:
        archive = inspect_pt2(f, path, _limit(options), allow_pickle)
        f.seek(0)
        with quiet_torch() as logged:
            try:
                with nullcontext() if allow_pickle else no_code_from_file(str(path), archive):
                    ep = torch.export.load(f)
            except IrgenError:
                raise
            except MemoryError:
                raise IrgenError(f"{path}: out of memory while torch read the program (lower --max-tensor-bytes "
                                 f"to refuse such models up front)") from None
            except Exception as err:  # noqa: BLE001  torch raises many kinds on a bad archive
                # torch.export.load logs the real error and raises a vague one from its fallback reader
                real = next((e for e in logged.errors if isinstance(e, IrgenError)), None)
                if real is not None:
                    raise IrgenError(str(real)) from None
                cause = logged.errors[0] if logged.errors else err
                raise IrgenError(f"{path}: not a readable torch.export program "
                                 f"({type(cause).__name__}: {one_line(cause, 300)})") from None
    if not allow_pickle and getattr(ep, "_guards_code", None):
        ep._guards_code = []  # Python source from the file, run by ExportedProgram.module(); irgen never needs it
    return ep


# ---------------------------------------------------------------- .pth


def _import_class(spec: str | None, path: Path):
    if not spec:
        raise IrgenError(f"{path}: a .pth state dict needs --model-class package.module:Class")
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise IrgenError(f"--model-class {spec!r}: expected package.module:Class")
    mod_name, qual = spec.split(":")
    added = False
    cwd = str(Path.cwd())
    if "" not in sys.path and cwd not in sys.path:  # the current directory, as `python -m` does
        sys.path.append(cwd)
        added = True
    try:
        module = importlib.import_module(mod_name)
    except ImportError as err:
        raise IrgenError(
            f"--model-class {spec!r}: cannot import module {mod_name!r} ({err}); "
            f"it must be importable (installed, on PYTHONPATH or in the current directory)"
        ) from None
    except Exception as err:  # noqa: BLE001  the module's own import-time error
        raise IrgenError(f"--model-class {spec!r}: importing {mod_name!r} failed: {type(err).__name__}: {err}") from None
    finally:
        if added:
            sys.path.remove(cwd)
    obj: Any = module
    for part in qual.split("."):
        if not hasattr(obj, part):
            raise IrgenError(f"--model-class {spec!r}: module {mod_name!r} has no attribute {qual!r}")
        obj = getattr(obj, part)
    import torch

    if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
        raise IrgenError(f"--model-class {spec!r}: not a torch.nn.Module subclass")
    return obj


def _is_state_dict(obj) -> bool:
    import torch

    return isinstance(obj, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def _keys_msg(kind: str, keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit]) + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")
    return f"{kind} keys ({len(keys)}): {shown}"


def _read_pth(path: Path, options: dict[str, Any]):
    """What a ``.pth`` holds: weights-only, or (``--allow-pickle``) anything."""
    import torch

    allow_pickle = bool(options.get("allow_pickle"))
    with open_regular(path, "model") as f:
        inspect_pth(f, path, _limit(options))
        f.seek(0)
        with quiet_torch():
            try:
                with no_code_from_file(str(path)):
                    return torch.load(f, map_location="cpu", weights_only=True), False
            except PickledDataError as err:
                if not allow_pickle:
                    raise IrgenError(
                        f"{path}: not a plain state dict (the weights-only loader refused it: {err.reason}); "
                        f"loading a pickled module runs arbitrary code from the file: {TRUST}") from None
            except IrgenError:
                raise
            except MemoryError:
                raise IrgenError(f"{path}: out of memory while torch read it (lower --max-tensor-bytes to refuse "
                                 f"such files up front)") from None
            except Exception as err:  # noqa: BLE001
                raise IrgenError(f"{path}: not a readable torch file ({type(err).__name__}: {one_line(err, 300)})") from None
            # --allow-pickle: the user trusts the file
            f.seek(0)
            try:
                return torch.load(f, map_location="cpu", weights_only=False), True
            except Exception as err:  # noqa: BLE001  the user's own trusted file
                raise IrgenError(f"{path}: cannot unpickle ({type(err).__name__}: {one_line(err, 300)})") from None


def load_pth(path: Path, options: dict[str, Any]):
    """Build the model from a .pth file; returns (ExportedProgram, input name, the local
    modules whose code it ran: :func:`irgen.plugin.local_modules` of its classes' modules)."""
    import torch

    obj, pickled = _read_pth(path, options)
    model = None
    state = None
    if pickled:
        if isinstance(obj, torch.nn.Module):
            model = obj
        elif _is_state_dict(obj):
            state = obj
        else:
            raise IrgenError(f"{path}: holds a {type(obj).__name__}, neither a torch.nn.Module nor a state dict")
    else:
        state = obj
        if isinstance(state, dict) and "state_dict" in state and _is_state_dict(state["state_dict"]):
            state = state["state_dict"]
        if not _is_state_dict(state):
            raise IrgenError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")

    if model is None:
        cls = _import_class(options.get("model_class"), path)
        kwargs = options.get("model_args") or {}
        if isinstance(kwargs, str):  # raw --model-args text
            try:
                kwargs = json.loads(kwargs)
            except json.JSONDecodeError as err:
                raise IrgenError(f"--model-args: not valid JSON ({err})") from None
        if not isinstance(kwargs, dict):
            raise IrgenError("--model-args: must be a JSON object of constructor keyword arguments")
        try:
            model = cls(**kwargs)
        except Exception as err:  # noqa: BLE001
            raise IrgenError(f"--model-class {options.get('model_class')!r}: constructing it with {kwargs!r} failed: {type(err).__name__}: {err}") from None
        want = set(model.state_dict())
        missing = sorted(want - set(state))
        unexpected = sorted(set(state) - want)
        if missing or unexpected:
            parts = ([_keys_msg("missing", missing)] if missing else []) + ([_keys_msg("unexpected", unexpected)] if unexpected else [])
            raise IrgenError(f"{path}: state dict does not fit {options.get('model_class')}: {'; '.join(parts)}")
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:  # shape mismatches
            raise IrgenError(f"{path}: state dict does not fit {options.get('model_class')}: {one_line(err, 300)}") from None
    model.eval()
    _refuse_dynamic_modules(model, path)

    shapes = options.get("input_shapes") or {}
    if len(shapes) != 1:
        raise IrgenError(f"{path}: give the example input shape with exactly one --input-shape NAME=DIMS (got {len(shapes)})")
    (name, shape), = shapes.items()
    check_tensor_size(f"--input-shape {name}", shape, "float32", _limit(options))  # before torch.zeros makes it
    example = torch.zeros(*shape, dtype=torch.float32)
    try:
        with torch.no_grad():
            ep = torch.export.export(model, (example,))
    except Exception as err:  # noqa: BLE001
        raise IrgenError(f"{path}: torch.export.export failed on an input of shape {tuple(shape)}: {type(err).__name__}: {one_line(err, 300)}") from None
    return ep, name, local_modules({type(m).__module__ for m in model.modules()})


def _refuse_dynamic_modules(model, path) -> None:
    """A module quantized by ``torch.ao.quantization.quantize_dynamic`` (its ``nn.LSTM``,
    ``GRU``, ``Linear`` replaced by ``torch.ao.nn.quantized.dynamic`` modules) is refused with
    the reason: its activations are quantized while it runs, and ``torch.export`` cannot export
    its packed recurrent weights at all (torch's error otherwise: ``CellParamsBase ... does not
    have a field with name '__obj_flatten__'``)."""
    dynamic = next((name for name, m in model.named_modules()
                    if type(m).__module__.startswith("torch.ao.nn.quantized.dynamic")), None)
    if dynamic is not None:
        kind = type(model.get_submodule(dynamic)).__name__
        raise IrgenError(
            f"{path}: module {dynamic!r} ({kind}) is dynamically quantized (torch's quantize_dynamic): its "
            "activations are quantized with parameters computed while the model runs, and torch.export cannot "
            "export its packed weights; irgen needs static quantization parameters (a float LSTM/GRU/RNN imports "
            "as float cell layers; for int8, quantize statically, or export the float model to ONNX and use "
            "onnxruntime's quantize_dynamic, whose DynamicQuantizeLSTM irgen reproduces)")
