"""irgen frontend for PyTorch models, through TVM's Relax ExportedProgram importer.

Two kinds of files:

- ``.pt2``: an ``ExportedProgram`` written by ``torch.export.save``;
- ``.pth``: a state dict, with ``--model-class package.module:Class`` (the
  module must be importable: installed, on ``PYTHONPATH``, or in the current
  directory), optional ``--model-args JSON`` (constructor keyword arguments)
  and ``--input-shape NAME=DIMS`` (the example input shape, required). The
  class is instantiated, the state dict loaded with ``strict=True`` and the
  model exported with ``torch.export.export`` on a zero input of that shape.
  A ``.pth`` that holds a whole pickled module is refused unless
  ``--allow-pickle`` is given: unpickling runs arbitrary code from the file.

The graph is translated without ATen decomposition, so FX node names and ops
(``aten.conv2d.default``, ...) are the ones ``ExportedProgram.graph`` shows.
TVM's importer names its bindings ``lv``, ``lv1``, ...; this frontend renames
the binding that holds each FX node's result after the FX node
(``t_<node name>``) and records it in :class:`irgen.api.Provenance` as
(FX node name, ATen op name, FX node name).
"""

from __future__ import annotations

import importlib
import json
import pickle
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

from irgen import hookimpl
from irgen.api import Frontend, ImportedModel, InputSpec, IrgenError, Provenance, UnsupportedOpsError

__version__ = "0.1.0"

_SUFFIXES = (".pt2", ".pth", ".pt")


# ---------------------------------------------------------------- loading


def _load_pt2(path: Path):
    import torch

    try:
        return torch.export.load(str(path))
    except Exception as err:  # noqa: BLE001  torch raises many kinds on a bad archive
        msg = " ".join(str(err).split())[:300]
        raise IrgenError(f"{path}: not a readable torch.export program ({type(err).__name__}: {msg})") from None


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


def _load_pth(path: Path, options: dict[str, Any]):
    """Build the model from a .pth file; returns an ExportedProgram."""
    import torch

    allow_pickle = bool(options.get("allow_pickle"))
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if not allow_pickle:
            first = " ".join(str(err).split()).split(". ")[0][:200]
            raise IrgenError(
                f"{path}: not a plain state dict (the weights-only loader refused it: {first}); "
                f"loading a pickled module runs arbitrary code from the file: pass --allow-pickle only if you trust it"
            ) from None
        state = None
    except (RuntimeError, OSError, EOFError, zipfile.BadZipFile, ValueError) as err:
        msg = " ".join(str(err).split())[:300]
        raise IrgenError(f"{path}: not a readable torch file ({type(err).__name__}: {msg})") from None

    if state is None:  # --allow-pickle: the user trusts the file
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001
            msg = " ".join(str(err).split())[:300]
            raise IrgenError(f"{path}: cannot unpickle ({type(err).__name__}: {msg})") from None
        if isinstance(obj, torch.nn.Module):
            model = obj
        elif _is_state_dict(obj):
            state = obj
            model = None
        else:
            raise IrgenError(f"{path}: holds a {type(obj).__name__}, neither a torch.nn.Module nor a state dict")
    else:
        if isinstance(state, dict) and "state_dict" in state and _is_state_dict(state["state_dict"]):
            state = state["state_dict"]
        if not _is_state_dict(state):
            raise IrgenError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
        model = None

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
            msg = " ".join(str(err).split())[:300]
            raise IrgenError(f"{path}: state dict does not fit {options.get('model_class')}: {msg}") from None
    model.eval()

    shapes = options.get("input_shapes") or {}
    if len(shapes) != 1:
        raise IrgenError(f"{path}: give the example input shape with exactly one --input-shape NAME=DIMS (got {len(shapes)})")
    (name, shape), = shapes.items()
    example = torch.zeros(*shape, dtype=torch.float32)
    try:
        with torch.no_grad():
            ep = torch.export.export(model, (example,))
    except Exception as err:  # noqa: BLE001
        msg = " ".join(str(err).split())[:300]
        raise IrgenError(f"{path}: torch.export.export failed on an input of shape {tuple(shape)}: {type(err).__name__}: {msg}") from None
    return ep, name


# ---------------------------------------------------------------- translation


def _user_inputs(ep) -> list[InputSpec]:
    specs = []
    names = set(ep.graph_signature.user_inputs)
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            val = node.meta.get("val", node.meta.get("tensor_meta"))
            if val is None or not hasattr(val, "shape"):
                raise IrgenError(f"input {node.name!r} is not a tensor; irgen can only feed tensors")
            shape = []
            for d in val.shape:
                try:
                    shape.append(int(d))
                except Exception:  # noqa: BLE001  a symbolic dim
                    raise IrgenError(f"input {node.name!r} has a dynamic dimension {d}; export with static shapes") from None
            specs.append(InputSpec(node.name, tuple(shape), str(val.dtype).replace("torch.", "")))
    return specs


def _check_ops(ep, importer, where: str) -> None:
    known = set(importer.convert_map)
    missing = []
    for node in ep.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", str(node.target)) not in known:
            missing.append(str(node.target))
        elif node.op not in ("placeholder", "call_function", "output", "get_attr"):
            missing.append(f"{node.op}:{node.target}")
    if missing:
        raise UnsupportedOpsError(where, missing)


def _rename(mod, names: dict[str, str]):
    """Rebuild ``main`` with binding vars renamed (old name_hint -> new name)."""
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class Renamer(PyExprMutator):
        def visit_dataflow_var_def_(self, var):
            new = names.get(var.name)
            if new is None:
                return var
            return relax.DataflowVar(new, var.ty)

        def visit_var_def_(self, var):
            new = names.get(var.name)
            if new is None or isinstance(var, relax.DataflowVar):
                return var
            return relax.Var(new, var.ty)

    func = mod["main"]
    new_func = Renamer().visit_expr(func)
    mod = mod.__class__({"main": new_func}) if len(mod.functions) == 1 else mod
    if len(mod.functions) != 1:
        mod["main"] = new_func
    return relax.transform.Normalize()(mod)


def translate(ep, where: str) -> ImportedModel:
    from tvm import relax
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    from irgen.names import SafeNames, identifier

    specs = _user_inputs(ep)
    namer = SafeNames(lambda n: "t_" + identifier(n))
    for s in specs:
        namer(s.name)  # inputs keep their names; no binding may take them
    provenance = Provenance()
    renames: dict[str, str] = {}  # importer's var name -> irgen name
    current: list[Any] = [None]

    class NamingImporter(ExportedProgramImporter):
        """Names the binding of each FX node's result after the node."""

        def create_convert_map(self):
            cmap = super().create_convert_map()
            # TVM 0.27 reads aten.batch_norm's (training, momentum) as (momentum, eps)
            # and always sets training=True: convert it here with the real signature.
            cmap["batch_norm.default"] = self._aten_batch_norm
            return {k: self._wrap(v) for k, v in cmap.items()}

        def _wrap(self, fn):
            def convert(node, *rest):
                current[0] = node
                before = self._known_names()
                out = fn(node, *rest)
                return self._name(node, out, before)

            return convert

        def _aten_batch_norm(self, node):
            # aten::batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
            import numpy as np

            def arg(i, key, default):
                return node.args[i] if len(node.args) > i else node.kwargs.get(key, default)

            if arg(5, "training", False):
                raise IrgenError(f"{where}: node {node.name!r} (aten.batch_norm) runs in training mode; "
                                 f"export the model after model.eval()")
            x = self.env[node.args[0]]
            channel = int(self.shape_of(x)[1])
            dtype = x.ty.dtype.dtype

            def tensor(i, fill):
                n = node.args[i] if len(node.args) > i else None
                return self.env[n] if n is not None else relax.const(np.full(channel, fill), dtype=dtype)

            if node.args[3] is None or node.args[4] is None:
                raise IrgenError(f"{where}: node {node.name!r} (aten.batch_norm) has no running statistics")
            bn = self.block_builder.emit(
                relax.op.nn.batch_norm(
                    data=x, gamma=tensor(1, 1.0), beta=tensor(2, 0.0),
                    moving_mean=self.env[node.args[3]], moving_var=self.env[node.args[4]],
                    axis=1, epsilon=float(arg(7, "eps", 1e-5)),
                    scale=node.args[1] is not None, center=node.args[2] is not None,
                    momentum=float(arg(6, "momentum", 0.1)), training=False,
                )
            )
            return self.block_builder.emit(bn[0])

        def _known_names(self) -> set[str]:
            return {v.name for v in self.env.values() if isinstance(v, relax.Var)}

        def _name(self, node, out, before: set[str]):
            op_type = str(node.target)

            def one(expr, tensor: str):
                if isinstance(expr, (relax.Call, relax.TupleGetItem)):
                    var = namer(tensor)
                    provenance.by_var[var] = (node.name, op_type, tensor)
                    return self.block_builder.emit(expr, name_hint=var)
                if isinstance(expr, relax.Var) and expr.name not in before and expr.name not in renames \
                        and not any(p.name == expr.name for p in self._params):
                    var = namer(tensor)
                    renames[expr.name] = var
                    provenance.by_var[var] = (node.name, op_type, tensor)
                return expr

            if isinstance(out, relax.Tuple):
                return relax.Tuple([one(f, f"{node.name}_{k}") for k, f in enumerate(out.fields)])
            if isinstance(out, (tuple, list)):
                return type(out)(one(f, f"{node.name}_{k}") if isinstance(f, relax.Expr) else f for k, f in enumerate(out))
            if isinstance(out, relax.Expr):
                return one(out, node.name)
            return out

        def create_input_vars(self, exported_program):
            params, users, ranges = super().create_input_vars(exported_program)
            self._params = list(params.values()) + list(users.values())
            return params, users, ranges

    importer = NamingImporter()
    _check_ops(ep, importer, where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importer.from_exported_program(
                ep,
                keep_params_as_input=False,
                unwrap_unit_return_tuple=True,
                no_bind_return_tuple=False,
                custom_convert_map=None,
            )
    except IrgenError:
        raise
    except Exception as err:  # noqa: BLE001  the importer's errors: name the node
        node = current[0]
        at = f"node {node.name!r} ({node.target})" if node is not None else "the graph"
        msg = " ".join(str(err).split())[:300] or type(err).__name__
        raise IrgenError(f"{where}: cannot import {at}: {type(err).__name__}: {msg}") from None
    if renames:
        mod = _rename(mod, renames)
    func = mod["main"]
    blocks = func.body.blocks if isinstance(func.body, relax.SeqExpr) else []
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        raise IrgenError(f"{where}: the program has side effects or control flow (no single dataflow block); irgen needs a pure graph")
    outs = [s for s in ep.graph_signature.user_outputs]
    return ImportedModel(mod=mod, inputs=specs, provenance=provenance, frontend="torch", output_names=outs)


def load_torch(path: Path, options: dict[str, Any]) -> ImportedModel:
    where = f"torch frontend ({path.name})"
    if path.is_dir():
        raise IrgenError(f"{path}: is a folder, not a .pt2/.pth file")
    if path.suffix.lower() == ".pt2":
        ep = _load_pt2(path)
        shapes = options.get("input_shapes") or {}
        imported = translate(ep, where)
        for s in imported.inputs:
            if s.name in shapes and tuple(shapes[s.name]) != tuple(s.shape):
                raise IrgenError(f"input {s.name!r}: the program was exported for shape {s.shape}, not {tuple(shapes[s.name])}")
        return imported
    ep, _ = _load_pth(path, options)
    return translate(ep, where)


def _claims(path: Path) -> bool:
    return path.suffix.lower() in _SUFFIXES


@hookimpl
def irgen_register_frontends(register):
    register(
        Frontend(
            name="torch",
            suffixes=_SUFFIXES,
            load=load_torch,
            claims=_claims,
            description="PyTorch: torch.export .pt2 programs, .pth state dicts with --model-class",
        )
    )
