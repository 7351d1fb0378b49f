"""The torch source runner for ``irgen verify --mode source``: the exported
program run by torch's FX interpreter, every node's tensor recorded by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from irgen.plugin import IrgenError, recurrent_states_tensor, regular_file

from .converters import fake_quant_fields
from .hops import inline_autocast
from .loader import load_pt2, load_pth
from .recurrent import KINDS as RECURRENT_OPS, step_states
from .translate import user_inputs


def fake_quant_integers(out, *args, target: str):
    """The integers behind a per-tensor fake-quant node's output ``out`` (``(q - zp) * s``), as
    ``irgen run`` names them ``<node>_q`` (the input of the layer's integer ops): ``rint(out / s)
    + zp``, exact for 8-bit ``q`` (``|q - zp| * 2**-23`` is far below half a step), with the
    dtype ``[qmin, qmax]`` names. None for a per-channel node (a weight) or one whose fake quant
    is off."""
    import numpy as np

    fields = fake_quant_fields(target, args, lambda v: int(np.asarray(v).reshape(-1)[0]))
    if fields is None or fields[2] != -1:
        return None
    scale, zp, _, qmin, _ = fields
    s = np.asarray(scale, np.float32).reshape(-1)
    z = np.asarray(zp).astype(np.int64).reshape(-1)
    if s.size != 1 or z.size != 1:
        return None
    steps = np.rint(out.detach().numpy().astype(np.float64) / float(s[0])).astype(np.int64)
    return (steps + int(z[0])).astype("uint8" if int(qmin) >= 0 else "int8")


def record_nodes(ep, inputs: list, wanted: set[str] | None = None) -> dict[str, Any]:
    """Every FX node's tensor value (by node name) when ``ep``'s graph runs on ``inputs``
    (the user inputs in order), through ``torch.fx.Interpreter``; a recurrent op's states
    at every step too (:func:`irgen_torch.recurrent.step_states`). Autocast regions switched
    off are inlined first (in ``ep``), as ``irgen run`` imports them, so their nodes have
    values under the names the layers' provenance gives. ``wanted``: only these names are
    kept (a copy of every node's value would hold every transposed weight too)."""
    import torch

    inline_autocast(ep, "torch source")

    seen: dict[str, Any] = {}
    keep = (lambda name: True) if wanted is None else wanted.__contains__

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_function" and ".".join(str(n.target).split(".")[-2:]) in RECURRENT_OPS:
                # a recurrent op's states at every step (it outputs the last step's): <node>:h, <node>:c
                args = self.fetch_args_kwargs_from_env(n)[0]
                for state, value in step_states(str(n.target), list(args)).items():
                    if keep(recurrent_states_tensor(n.name, state)):
                        seen[recurrent_states_tensor(n.name, state)] = value
            if isinstance(out, torch.Tensor):
                if keep(n.name):
                    seen[n.name] = to_numpy(out)
                if n.op == "call_function" and "fake_quant" in str(n.target) and keep(f"{n.name}_q"):
                    q = fake_quant_integers(out, *self.fetch_args_kwargs_from_env(n)[0], target=str(n.target))
                    if q is not None:
                        seen[f"{n.name}_q"] = q
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
        raise IrgenError(f"torch source check needs torch: pip install torch==2.13.0 ({err})") from None
    regular_file(path, "model")
    ep = load_pt2(path, options) if path.suffix.lower() == ".pt2" else load_pth(path, options)[0]
    names = [s.name for s in user_inputs(ep)]

    def run(inputs: dict[str, Any], tensors: list[str]) -> dict[str, Any]:
        feeds = [from_numpy(inputs[n] if n in inputs else list(inputs.values())[k]) for k, n in enumerate(names)]
        seen = record_nodes(ep, feeds, set(tensors))
        return {t: seen[t] for t in tensors if t in seen}

    return run


def to_numpy(t) -> Any:
    """A copy of a torch tensor as numpy; a bfloat16 one as ml_dtypes' bfloat16 (through float32:
    exact)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy().copy()


def from_numpy(a) -> Any:
    """A torch tensor of a numpy array; ml_dtypes' bfloat16 as torch.bfloat16 (through float32: exact)."""
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.astype("float32")).to(torch.bfloat16)
    return torch.from_numpy(a)
