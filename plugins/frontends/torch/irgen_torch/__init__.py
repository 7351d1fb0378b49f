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
are fixed: ``--input-shape`` must name one of its inputs with its exact shape.

The graph is translated without ATen decomposition, so FX node names and ops
(``aten.conv2d.default``, ...) are the ones ``ExportedProgram.graph`` shows.
TVM's importer names its bindings ``lv``, ``lv1``, ...; this frontend renames
the binding that holds each FX node's result after the FX node
(``t_<node name>``) and records it in :class:`irgen.plugin.Provenance` as
(FX node name, ATen op name, FX node name). Values that do not depend on the
user inputs (masks and index tensors built from shapes) are computed by torch
and imported as constants (:mod:`irgen_torch.fold`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from irgen.plugin import (
    Frontend,
    ImportedModel,
    InputSpec,
    IrgenError,
    Option,
    Provenance,
    UnsupportedOpsError,
    hookimpl,
    regular_file,
)

from .fold import constant_nodes
from .loader import load_pt2, load_pth

__version__ = "0.1.0"

_SUFFIXES = (".pt2", ".pth", ".pt")


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


def _check_ops(ep, importer, where: str, computed=()) -> None:
    known = set(importer.convert_map)
    missing = []
    for node in ep.graph.nodes:
        if node.name in computed:
            continue
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


def _named(ep, specs: list[InputSpec], names: list[str], where: str) -> list[InputSpec]:
    """The user inputs under the names the user gave (``--input-shape NAME=DIMS`` of a ``.pth``)."""
    taken = {n.name for n in ep.graph.nodes} - {s.name for s in specs}
    for name in names:
        if name in taken:
            raise IrgenError(f"{where}: input name {name!r} (--input-shape) is also the name of a node in the "
                             f"exported graph; choose another")
    return [InputSpec(n, s.shape, s.dtype) for n, s in zip(names, specs)]


def translate(ep, where: str, input_names: list[str] | None = None) -> ImportedModel:
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    from irgen.plugin import SafeNames, identifier

    specs = _user_inputs(ep)
    if input_names:
        specs = _named(ep, specs, input_names, where)
    namer = SafeNames(lambda n: "t_" + identifier(n))
    for s in specs:
        namer(s.name)  # inputs keep their names; no binding may take them
    provenance = Provenance()
    renames: dict[str, str] = {}  # importer's var name -> irgen name
    current: list[Any] = [None]
    # placeholder name -> the buffer/parameter/constant tensor it is bound to (quantization parameters, weights)
    bound: dict[str, Any] = {}
    _state = {**dict(ep.named_buffers()), **dict(ep.constants), **dict(ep.named_parameters())}
    for spec in ep.graph_signature.input_specs:
        if spec.target in _state:
            bound[spec.arg.name] = _state[spec.target]

    computed = constant_nodes(ep)  # input-independent values, computed by torch (masks, index tensors)

    class NamingImporter(ExportedProgramImporter):
        """Names the binding of each FX node's result after the node."""

        def _translate_fx_graph(self, graph_module, nodes, inputs_vars, custom_ops=None):
            rest = []
            for node in nodes:
                if node.name not in computed:
                    rest.append(node)
                elif computed[node.name] is not None:
                    self.env[node] = relax.const(computed[node.name].numpy())
            return super()._translate_fx_graph(graph_module, rest, inputs_vars, custom_ops)

        def _check_unsupported_func_type(self, nodes):
            return super()._check_unsupported_func_type([n for n in nodes if n.name not in computed])

        def create_convert_map(self):
            cmap = super().create_convert_map()
            # TVM 0.27 reads aten.batch_norm's (training, momentum) as (momentum, eps)
            # and always sets training=True: convert it here with the real signature.
            cmap["batch_norm.default"] = self._aten_batch_norm
            # TVM 0.27 refuses a bool attn_mask and ignores scale=
            cmap["scaled_dot_product_attention.default"] = self._aten_sdpa
            # relax.nn.pixel_shuffle has no legalization in TVM 0.27 (no topi.nn.pixel_shuffle): torch's own
            # definition, reshape / permute / reshape; aten.diff has no converter: slices and a subtract
            cmap["pixel_shuffle.default"] = self._aten_pixel_shuffle
            cmap["diff.default"] = self._aten_diff
            # torch quantization: quantized_decomposed Q/DQ ops (FX reference flow) and fake quant (QAT)
            for k in ("quantize_per_tensor.default", "quantize_per_tensor.tensor", "quantize_per_channel.default"):
                cmap[k] = self._q_quantize
            for k in ("dequantize_per_tensor.default", "dequantize_per_tensor.tensor", "dequantize_per_channel.default"):
                cmap[k] = self._q_dequantize
            for k in ("fused_moving_avg_obs_fake_quant.default", "fake_quantize_per_tensor_affine.default",
                      "fake_quantize_per_tensor_affine.tensor_qparams", "fake_quantize_per_channel_affine.default"):
                cmap[k] = self._q_fake
            return {k: self._wrap(v) for k, v in cmap.items()}

        # ---- quantization ops: relax.quantize / relax.dequantize
        def _q_arr(self, node, a):
            import numpy as np

            if isinstance(a, (int, float)):
                return np.asarray(a)
            if hasattr(a, "op") and a.name in bound:
                return bound[a.name].detach().cpu().numpy()
            e = self.env.get(a) if hasattr(a, "op") else None
            if isinstance(e, tvm.ir.Constant):
                return e.value.numpy()
            raise IrgenError(f"{where}: node {node.name!r} ({node.target}) has quantization parameters that are not constants")

        def _q_dtype(self, node, qmin, qmax, dtype=None):
            import numpy as np

            name = str(dtype).replace("torch.", "") if dtype is not None else None
            if name is None:
                name = "uint8" if int(qmin) >= 0 else "int8"
            if name not in ("int8", "uint8"):
                raise IrgenError(f"{where}: node {node.name!r} ({node.target}) quantizes to {name}; int8/uint8 only")
            info = np.iinfo(name)
            return name, (int(qmin), int(qmax)) == (int(info.min), int(info.max))

        def _q_params(self, node, scale, zp, dtype, per_channel):
            import numpy as np

            s = np.asarray(self._q_arr(node, scale), np.float32).reshape(-1)
            z = np.asarray(self._q_arr(node, zp)).astype(np.int64).reshape(-1)
            s_c = relax.const(s if per_channel and s.size > 1 else s.reshape(()), "float32")
            z_c = relax.const((z if per_channel and z.size > 1 else z.reshape(())).astype(dtype), dtype)
            return s_c, z_c

        def _q_const(self, node, x, values):
            """quantize of a constant (weights): torch computes the integers at import time."""
            import torch

            args = [bound[a.name] if hasattr(a, "op") else a for a in node.args]
            with torch.no_grad():
                out = node.target(*args, **node.kwargs)
            return relax.const(out.numpy() if values is None else values(out))

        def _q_quantize(self, node):
            # quantized_decomposed.quantize_per_tensor(x, scale, zp, qmin, qmax, dtype)
            # quantized_decomposed.quantize_per_channel(x, scales, zps, axis, qmin, qmax, dtype)
            pc = "per_channel" in str(node.target)
            a = node.args
            x = self.env[a[0]]
            qmin, qmax, dt = (a[4], a[5], a[6]) if pc else (a[3], a[4], a[5])
            dtype, full = self._q_dtype(node, qmin, qmax, dt)
            if getattr(a[0], "name", None) in bound:
                return self._q_const(node, x, None)
            if not full:
                raise IrgenError(f"{where}: node {node.name!r} quantizes to [{qmin}, {qmax}], not the full {dtype} range; "
                                 f"not supported (use observers without reduce_range)")
            s, z = self._q_params(node, a[1], a[2], dtype, pc)
            return self.block_builder.emit(relax.op.quantize(x, s, z, axis=int(a[3]) if pc else -1, out_dtype=dtype))

        def _q_dequantize(self, node):
            pc = "per_channel" in str(node.target)
            a = node.args
            x = self.env[a[0]]
            dtype = str(x.ty.dtype)
            s, z = self._q_params(node, a[1], a[2], dtype, pc)
            return self.block_builder.emit(relax.op.dequantize(x, s, z, axis=int(a[3]) if pc else -1, out_dtype="float32"))

        def _q_fake(self, node):
            """fake quant (QAT) -> quantize + dequantize; weights are quantized at import time by torch."""
            import numpy as np

            import torch

            a = node.args
            t = str(node.target)
            if "fused_moving_avg_obs_fake_quant" in t:
                # (x, observer_on, fake_quant_on, running_min, running_max, scale, zp, avg, qmin, qmax, ch_axis, per_row, sym)
                if int(self._q_arr(node, a[1]).reshape(-1)[0]) != 0:
                    raise IrgenError(f"{where}: node {node.name!r} (fake quant) still has its observer enabled, so torch "
                                     f"updates its scale while running; call model.apply(torch.ao.quantization.disable_observer) before export")
                if int(self._q_arr(node, a[2]).reshape(-1)[0]) == 0:
                    return self.env[a[0]]
                scale, zp, qmin, qmax = a[5], a[6], a[8], a[9]
                per_row = bool(a[11]) if len(a) > 11 else False
                axis = int(a[10]) if per_row else -1
            elif "per_channel" in t:  # (x, scale, zp, axis, qmin, qmax)
                scale, zp, axis, qmin, qmax = a[1], a[2], int(a[3]), a[4], a[5]
            else:  # (x, scale, zp, qmin, qmax)
                scale, zp, axis, qmin, qmax = a[1], a[2], -1, a[3], a[4]
            x = self.env[a[0]]
            dtype, full = self._q_dtype(node, qmin, qmax)
            s_np = np.asarray(self._q_arr(node, scale), np.float32).reshape(-1)
            z_np = np.asarray(self._q_arr(node, zp)).astype(np.int64).reshape(-1)
            if getattr(a[0], "name", None) in bound:
                w = bound[a[0].name].detach()
                ax = axis if axis >= 0 else 0
                shp = [-1 if i == ax else 1 for i in range(w.ndim)]
                inv = (1.0 / torch.from_numpy(s_np)).reshape(shp) if s_np.size > 1 else 1.0 / float(s_np[0])
                zz = torch.from_numpy(z_np).reshape(shp) if z_np.size > 1 else int(z_np[0])
                q = torch.clamp(torch.round(w * inv) + zz, int(qmin), int(qmax)).to(getattr(torch, dtype))
                xq = relax.const(q.numpy())
            else:
                if s_np.size > 1:  # QAT conv+BatchNorm modules fake-quantize weight * bn_scale, computed in the graph
                    raise IrgenError(f"{where}: node {node.name!r} fake-quantizes a computed tensor per channel "
                                     f"({a[0].name!r}; a QAT conv+BatchNorm module?); fold BatchNorm into the "
                                     f"convolutions before prepare_qat_fx, or convert the model with "
                                     f"_convert_to_reference_decomposed_fx")
                if not full:
                    raise IrgenError(f"{where}: node {node.name!r} fake-quantizes to [{qmin}, {qmax}], not the full "
                                     f"{dtype} range; not supported")
                s, z = self._q_params(node, scale, zp, dtype, True)
                # the integer tensor: source node = the fake-quant node (whose float value is dequantize(it)), tensor <node>_q
                qname = namer(f"{node.name}_q")
                provenance.by_var[qname] = (node.name, str(node.target), f"{node.name}_q")
                xq = self.block_builder.emit(relax.op.quantize(x, s, z, axis=axis, out_dtype=dtype), name_hint=qname)
            s, z = self._q_params(node, scale, zp, dtype, True)
            return self.block_builder.emit(relax.op.dequantize(xq, s, z, axis=axis if s_np.size > 1 else -1, out_dtype="float32"))

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

        def _aten_sdpa(self, node):
            # aten::scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *,
            #                                    scale=None, enable_gqa=False); q (..., L, E), k (..., S, E)
            import numpy as np

            def arg(i, key, default):
                return node.args[i] if len(node.args) > i else node.kwargs.get(key, default)

            q, k, v = (self.env[a] for a in node.args[:3])
            if float(arg(4, "dropout_p", 0.0)) != 0.0:
                raise IrgenError(f"{where}: node {node.name!r} (scaled_dot_product_attention) has dropout; export in eval mode")
            ndim = len(q.ty.shape)
            if ndim not in (3, 4) or len(k.ty.shape) != ndim or len(v.ty.shape) != ndim:
                raise IrgenError(f"{where}: node {node.name!r} (scaled_dot_product_attention): inputs of rank "
                                 f"{ndim}; 3 or 4 supported")
            if [int(d) for d in list(q.ty.shape)[:-2]] != [int(d) for d in list(k.ty.shape)[:-2]]:
                raise IrgenError(f"{where}: node {node.name!r} (scaled_dot_product_attention): query and key heads "
                                 f"differ (grouped-query attention); not supported")
            bb = self.block_builder
            if ndim == 3:
                q, k, v = (bb.emit(relax.op.expand_dims(t, 0)) for t in (q, k, v))
            bsnh = [0, 2, 1, 3]  # torch (B, H, L, E) <-> relax.nn.attention (B, L, H, E)
            q, k, v = (bb.emit(relax.op.permute_dims(t, bsnh)) for t in (q, k, v))
            mask = arg(3, "attn_mask", None)
            bias = None
            if mask is not None:
                m = self.env[mask]
                dtype = str(q.ty.dtype)
                if str(m.ty.dtype) == "bool":  # True = attend: a bias of 0 or the most negative float
                    lowest = float(np.finfo(dtype).min)
                    if isinstance(m, tvm.ir.Constant):
                        m = relax.const(np.where(m.value.numpy(), 0.0, lowest).astype(dtype))
                    else:
                        m = bb.emit(relax.op.where(m, relax.const(0.0, dtype), relax.const(lowest, dtype)))
                while len(m.ty.shape) < 4:
                    m = relax.const(np.expand_dims(m.value.numpy(), 0)) if isinstance(m, tvm.ir.Constant) \
                        else bb.emit(relax.op.expand_dims(m, 0))
                bias = m
            scale = node.kwargs.get("scale", None)
            causal = "TopLeft" if arg(5, "is_causal", False) else None
            out = bb.emit(relax.op.nn.attention(q, k, v, bias=bias, scale=None if scale is None else float(scale),
                                                causal_mask=causal))
            out = relax.op.permute_dims(out, bsnh)
            return relax.op.squeeze(bb.emit(out), [0]) if ndim == 3 else out

        def _aten_pixel_shuffle(self, node):
            x = self.env[node.args[0]]
            r = int(node.args[1])
            *lead, c, h, w = (int(d) for d in x.ty.shape)
            bb = self.block_builder
            k = len(lead)
            y = bb.emit(relax.op.reshape(x, [*lead, c // (r * r), r, r, h, w]))
            y = bb.emit(relax.op.permute_dims(y, [*range(k), k, k + 3, k + 1, k + 4, k + 2]))
            return relax.op.reshape(y, [*lead, c // (r * r), h * r, w * r])

        def _aten_diff(self, node):
            # aten::diff(x, n=1, dim=-1, prepend=None, append=None)
            def arg(i, key, default):
                return node.args[i] if len(node.args) > i else node.kwargs.get(key, default)

            bb = self.block_builder
            x = self.env[node.args[0]]
            n, dim = int(arg(1, "n", 1)), int(arg(2, "dim", -1))
            rank = len(x.ty.shape)
            dim %= rank
            pre, app = arg(3, "prepend", None), arg(4, "append", None)
            parts = ([self.env[pre]] if pre is not None else []) + [x] + ([self.env[app]] if app is not None else [])
            if len(parts) > 1:
                x = bb.emit(relax.op.concat(parts, axis=dim))
            for step in range(n):
                size = int(x.ty.shape[dim])
                hi = bb.emit(relax.op.strided_slice(x, [dim], [1], [size]))
                lo = bb.emit(relax.op.strided_slice(x, [dim], [0], [size - 1]))
                d = relax.op.subtract(hi, lo) if str(x.ty.dtype) != "bool" else relax.op.not_equal(hi, lo)
                x = d if step == n - 1 else bb.emit(d)
            return x

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
    _check_ops(ep, importer, where, computed)
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


def _check_input_shapes(specs: list[InputSpec], shapes: dict[str, tuple[int, ...]]) -> None:
    """A ``.pt2`` program's input shapes are fixed: every ``--input-shape`` must name one of its
    inputs and give exactly its shape."""
    declared = {s.name: s for s in specs}
    for name, shape in shapes.items():
        given = f"--input-shape {name}={','.join(map(str, shape))}"
        if name not in declared:
            listing = ", ".join(f"{s.name!r} {tuple(s.shape)}" for s in specs) or "none"
            raise IrgenError(f"{given}: the model has no input {name!r} (its inputs: {listing})")
        if tuple(declared[name].shape) != tuple(shape):
            raise IrgenError(f"{given}: the model's input {name!r} has the fixed shape {tuple(declared[name].shape)}")


def load_torch(path: Path, options: dict[str, Any]) -> ImportedModel:
    where = f"torch frontend ({path.name})"
    regular_file(path, "model")  # a FIFO or a device is refused before torch opens it
    if path.suffix.lower() == ".pt2":
        ep = load_pt2(path, options)
        _check_input_shapes(_user_inputs(ep), options.get("input_shapes") or {})
        return translate(ep, where)
    ep, name = load_pth(path, options)
    return translate(ep, where, [name])  # the input is called what --input-shape calls it


def record_nodes(ep, inputs: list) -> dict[str, Any]:
    """Every FX node's tensor value (by node name) when ``ep``'s graph runs on ``inputs``
    (the user inputs in order), through ``torch.fx.Interpreter``."""
    import torch

    seen: dict[str, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                seen[n.name] = out.detach().numpy().copy()
            return out

    state = {**ep.state_dict, **dict(ep.named_buffers()), **ep.constants}
    user = iter(inputs)
    args = [next(user) if s.kind == torch.export.graph_signature.InputKind.USER_INPUT else state[s.target]
            for s in ep.graph_signature.input_specs]
    with torch.no_grad():
        Recorder(ep.graph_module).run(*args)
    return seen


def source_runner(path: Path, options: dict[str, Any]):
    """The exported program (``.pt2`` as saved, ``.pth`` exported as ``load`` does)
    under an FX interpreter; tensors by FX node name."""
    try:
        import torch
    except ImportError as err:
        raise IrgenError(f"torch source check needs torch ({err})") from None
    regular_file(path, "model")
    ep = load_pt2(path, options) if path.suffix.lower() == ".pt2" else load_pth(path, options)[0]
    names = [s.name for s in _user_inputs(ep)]

    def run(inputs: dict[str, Any], tensors: list[str]) -> dict[str, Any]:
        feeds = [torch.from_numpy(inputs[n] if n in inputs else list(inputs.values())[k]) for k, n in enumerate(names)]
        seen = record_nodes(ep, feeds)
        return {t: seen[t] for t in tensors if t in seen}

    return run


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
