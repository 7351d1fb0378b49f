"""A default CPU schedule for the kernels LegalizeOps/FuseTIR produce, values unchanged.

TVM's legalized TIR is one naive, single-threaded loop nest per block. This
module rewrites every PrimFunc of the lowered module (``schedule_module``, called
by :func:`irgen.execute.lower` before ``relax.build``) with TensorIR schedule
primitives that move and annotate **spatial** loops only:

* **inline** each elementwise block into its one consumer when that reads it
  once (the chains of casts, adds, shifts and clips that realize requantization,
  the bias add and the activation after a convolution shrink to few loop nests;
  blocks that feed a reduction, such as padding, stay);
* per reduction block (convolution, pooling, dense, mean): the innermost spatial
  loop that walks the output's last (contiguous) axis is split into vectors of one
  register (``_lanes``: 8 lanes, or 7 for a row of 14 or 28) and its inner part moved
  to the innermost position, below the reduction loops, and **vectorized**, when every buffer the block reads is contiguous or
  constant along it; a second spatial loop that one of the block's operands does not
  depend on (a convolution's output channels: the input is the same for each) is split
  by a small factor and its inner part placed, unrolled, between the reduction loops and
  the vector loop: a **register tile** of factor x vector outputs, each value loaded once
  for all of them;
* per block, the spatial loops in front of the reduction loops (of an elementwise
  block: all but the innermost) are fused and run in **parallel** on TVM's thread
  pool (``TVM_NUM_THREADS``).

Reduction loops are never split, fused, reordered among themselves or
parallelized, so every output element is computed by the same operations in
the same order as without the schedule: integer and float results are bit for
bit the same (``tests/test_schedule.py`` compares every activation file). Kernels
with less than ``MIN_WORK`` loop iterations are left alone (not worth the compile
time), as is any function a primitive rejects.

``IRGEN_NO_SCHEDULE=1`` (or ``ENABLED = False``) turns the schedule off.
"""

from __future__ import annotations

from dataclasses import dataclass

from irgen import envflags

#: environment switch: a true value (1, true, yes, on) turns the schedule off
ENV_OFF = "IRGEN_NO_SCHEDULE"
#: module switch (tests and embedders); the environment variable wins when set
ENABLED = True
#: kernels with fewer loop iterations (summed over their blocks) are not scheduled
MIN_WORK = 1 << 14
#: lanes of a vectorized loop (LLVM legalizes them to the target's registers)
VECTOR_LANES = 8
#: at most this many lanes when a whole short innermost loop is vectorized
MAX_WHOLE_LANES = 16
#: outputs per register tile (a second spatial loop, unrolled beside the vector loop) of a
#: reduction block with a float output, and of one with an integer output
TILE_FLOAT = 8
TILE_INT = 4


def enabled() -> bool:
    """Whether :func:`schedule_module` schedules (``IRGEN_NO_SCHEDULE`` unset and ``ENABLED``)."""
    return not envflags.turned_off(ENV_OFF, ENABLED)


def key() -> tuple:
    """What the schedule's result depends on (for compile caches): on/off and its parameters."""
    return ("schedule", 3, enabled(), MIN_WORK, VECTOR_LANES, MAX_WHOLE_LANES, TILE_FLOAT, TILE_INT)


@dataclass
class Stats:
    """What the last :func:`schedule_module` call did."""

    functions: int = 0  # PrimFuncs seen
    scheduled: int = 0  # PrimFuncs rewritten
    small: int = 0  # left alone: less than MIN_WORK iterations
    failed: int = 0  # functions left alone and blocks left partly scheduled: a primitive rejected them
    inlined: int = 0  # blocks inlined
    parallel: int = 0  # loops parallelized
    vectorized: int = 0  # loops vectorized
    tiled: int = 0  # reduction blocks with a register tile


#: statistics of the most recent :func:`schedule_module` call
last = Stats()


def schedule_module(mod):
    """``mod`` with every PrimFunc scheduled (see the module docstring); ``mod`` itself is not changed."""
    import tvm

    global last
    last = Stats()
    if not enabled():
        return mod
    updates = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        last.functions += 1
        new = schedule_func(func, last)
        if new is not None:
            updates[gv] = new
    if not updates:
        return mod
    mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    for gv, func in updates.items():
        mod[gv] = func
    return mod


_UNCHECKED: list = []


def _schedule_class():
    """TVM's ``Schedule`` without the Python type check of every argument of every primitive
    (``type_checked``: ``inspect.signature`` binding and a type walk per call, 3,000 calls and
    0.3-0.8 s on a quantized ResNet-18). The primitives are TVM's own (``__wrapped__``), called
    with the same arguments; irgen passes the types they take."""
    if not _UNCHECKED:
        from tvm.s_tir import Schedule

        plain = {name: fn.__wrapped__ for name, fn in vars(Schedule).items()
                 if callable(fn) and callable(getattr(fn, "__wrapped__", None))}
        _UNCHECKED.append(type("UncheckedSchedule", (Schedule,), plain))
    return _UNCHECKED[0]


def schedule_func(func, stats: Stats | None = None):
    """The scheduled ``func``, or None when it is left as it is."""
    from tvm.s_tir.schedule import ScheduleError

    Schedule = _schedule_class()

    stats = stats if stats is not None else Stats()
    counts = Stats()
    try:
        if _work(func) < MIN_WORK:
            stats.small += 1
            return None
        sch = Schedule(func)
        root = sch.get_sblock("root")
        _inline(sch, root, counts)
        for block in sch.get_child_blocks(root):
            try:
                _schedule_block(sch, block, counts)
            except ScheduleError:  # atomic: the primitives applied so far stand, all value-neutral
                counts.failed += 1
    except Exception as err:  # noqa: BLE001 - any rejection: keep the function as legalized
        if envflags.switch("IRGEN_SCHEDULE_DEBUG"):
            print(f"irgen.schedule: {type(err).__name__}: {err}")
        stats.failed += 1
        return None
    if not (counts.inlined or counts.parallel or counts.vectorized):
        return None
    stats.scheduled += 1
    stats.failed += counts.failed
    stats.inlined += counts.inlined
    stats.parallel += counts.parallel
    stats.vectorized += counts.vectorized
    stats.tiled += counts.tiled
    return sch.mod["main"]


def _work(func) -> int:
    """Iterations of all loops of ``func``, summed over the innermost loops (non-constant: large)."""
    import tvm

    total = [0]

    def visit(node, extent=1):
        if isinstance(node, tvm.tirx.For):
            ext = node.extent
            extent *= int(ext) if isinstance(ext, tvm.tirx.IntImm) else (1 << 20)
            if not _has_loop(node.body):
                total[0] += extent
            visit(node.body, extent)
        else:
            for child in _children(node):
                visit(child, extent)

    visit(func.body)
    return total[0]


def _children(stmt):
    import tvm
    from tvm import s_tir

    T = tvm.tirx
    if isinstance(stmt, T.SeqStmt):
        return list(stmt.seq)
    if isinstance(stmt, s_tir.SBlockRealize):
        return [stmt.block]
    if isinstance(stmt, s_tir.SBlock):
        return [stmt.body] + ([stmt.init] if stmt.init is not None else [])
    if isinstance(stmt, T.For):
        return [stmt.body]
    out = []
    for attr in ("body", "then_case", "else_case"):
        child = getattr(stmt, attr, None)
        if isinstance(child, T.Stmt):
            out.append(child)
    return out


def _has_loop(stmt) -> bool:
    import tvm

    return isinstance(stmt, tvm.tirx.For) or any(_has_loop(c) for c in _children(stmt))


def _walk(stmt, fn) -> None:
    fn(stmt)
    for child in _children(stmt):
        _walk(child, fn)


def _is_reduction(sch, block) -> bool:
    import tvm

    return any(iv.iter_type != tvm.tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def _inline(sch, root, counts: Stats) -> None:
    """Inline every elementwise block into its consumers, unless one of them is a reduction."""
    from tvm.s_tir.schedule import ScheduleError

    for block in sch.get_child_blocks(root):
        if _is_reduction(sch, block):
            continue
        consumers = sch.get_consumers(block)
        if len(consumers) != 1 or _is_reduction(sch, consumers[0]):
            continue
        # inline only what is read once: an expression read twice would be copied twice
        # (and chains of such copies grow exponentially)
        written = sch.get(block).writes
        if len(written) != 1 or str(sch.get(consumers[0]).body).count(written[0].source.name + "[") != 1:
            continue
        try:
            sch.compute_inline(block)
        except ScheduleError:
            continue
        counts.inlined += 1


def _binding(sch, block):
    """Per loop of ``block``: (kind 'S'/'R'/'X', the block iter var it is bound to or None)."""
    import tvm

    T = tvm.tirx
    loops = sch.get_loops(block)
    loop_vars = [sch.get(lp).loop_var for lp in loops]
    iter_vars = list(sch.get(block).iter_vars)
    bindings = _realize_of(sch, block)
    kinds, bound = [], []
    for lv in loop_vars:
        users = [k for k, value in enumerate(bindings) if _uses(value, lv)]
        iv = iter_vars[users[0]] if len(users) == 1 else None
        if iv is not None and bindings[users[0]].same_as(lv) \
                and iv.iter_type in (T.IterVar.DataPar, T.IterVar.CommReduce):
            kinds.append("S" if iv.iter_type == T.IterVar.DataPar else "R")
            bound.append(iv)
        else:  # unused, or bound through an expression
            kinds.append("X")
            bound.append(None)
    return loops, kinds, bound


def _realize_of(sch, block):
    import tvm
    from tvm import s_tir

    target = sch.get(block)
    func = sch.mod["main"]
    found = []

    def f(node):
        if isinstance(node, s_tir.SBlockRealize) and node.block.same_as(target):
            found.append(list(node.iter_values))

    _walk(func.body, f)
    if not found:
        raise LookupError("block realize not found")
    return found[0]


def _uses(expr, var) -> bool:
    import tvm

    return any(v.same_as(var) for v in tvm.tirx.analysis.undefined_vars(expr))


def _contiguous_along(block_stmt, iv) -> bool:
    """Whether every buffer ``block_stmt`` reads or writes is constant or unit-stride along ``iv``."""
    import tvm
    from tvm.sym.pattern import detect_linear_equation

    var = iv.var
    for region in list(block_stmt.reads) + list(block_stmt.writes):
        ranges = list(region.region)
        for k, rng in enumerate(ranges):
            if not _uses(rng.min, var):
                continue
            if k != len(ranges) - 1:
                return False
            coef = detect_linear_equation(rng.min, [var])
            if len(coef) != 2 or not isinstance(coef[0], tvm.tirx.IntImm) or int(coef[0]) != 1:
                return False
    return True


def _extent(sch, loop) -> int | None:
    import tvm

    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tvm.tirx.IntImm) else None


def _schedule_block(sch, block, counts: Stats) -> None:
    loops, kinds, bound = _binding(sch, block)
    if not loops:
        return
    if "X" in kinds:  # unusual bindings: parallelize the leading spatial loops only
        _parallel(sch, _outer(loops, kinds), counts)
        return
    block_stmt = sch.get(block)
    spatial = [i for i, k in enumerate(kinds) if k == "S"]
    reduce = [i for i, k in enumerate(kinds) if k == "R"]
    vec = None
    if not reduce:  # elementwise: parallel outer loops; the inner one is LLVM's (cheaper to compile)
        _parallel(sch, _outer(loops, kinds), counts)
        return
    tile = lanes = None
    if spatial:
        last = spatial[-1]
        write = block_stmt.writes[0].region if block_stmt.writes else []
        on_last_axis = bool(write) and bound[last].var.same_as(write[-1].min)
        ext = _extent(sch, loops[last])
        if on_last_axis and ext is not None and ext > 1:
            lanes = _lanes(ext)
            tile = _register_tile(sch, block_stmt, loops, spatial, bound, last, lanes or VECTOR_LANES)
            # an operand read with a stride (a strided convolution's input) is gathered into
            # the vector: worth it only when a register tile reuses each gathered vector
            if tile is not None or _contiguous_along(block_stmt, bound[last]):
                vec = last
    if vec is None or lanes is None:  # no vector loop, or one of a long prime length
        _parallel(sch, _outer(loops, kinds), counts)
        return
    if lanes != ext:  # vectors of ``lanes`` along the row
        outer_v, inner = sch.split(loops[vec], [None, lanes])
        outer = [loops[i] for i in spatial if i != vec] + [outer_v]
    else:  # the whole short row is the vector
        inner = loops[vec]
        outer = [loops[i] for i in spatial if i != vec]
    red = [loops[i] for i in reduce]
    if tile is not None:  # the tile loop's inner part goes below the reductions too, unrolled
        k, factor = tile
        at = outer.index(loops[k])
        tile_outer, tile_inner = sch.split(loops[k], [None, factor])
        outer[at] = tile_outer
        sch.reorder(*outer, *red, tile_inner, inner)
        sch.unroll(tile_inner)
        counts.tiled += 1
    else:
        sch.reorder(*outer, *red, inner)
    # the init statement stays in the block: it runs at the first reduction step, on the vector
    sch.vectorize(inner)
    counts.vectorized += 1
    _parallel(sch, outer, counts)


def _lanes(ext: int) -> int | None:
    """The lanes of the vector over a loop of ``ext``: the largest divisor of ``ext`` up to
    VECTOR_LANES when it is at least half of them (a loop of 14 gets 2 vectors of 7, of 28
    4 of 7: one register each); else the whole loop when it is short (MAX_WHOLE_LANES at
    most: 9, 11, 13, or 2-3); else None (not vectorized: a long loop of a prime length)."""
    best = max(d for d in range(1, VECTOR_LANES + 1) if ext % d == 0)
    if best >= VECTOR_LANES // 2:
        return best
    return ext if ext <= MAX_WHOLE_LANES else None


def _register_tile(sch, block_stmt, loops, spatial, bound, vec, lanes: int) -> tuple[int, int] | None:
    """(index of a spatial loop, factor) to tile below the reduction loops beside the vector
    loop, or None: the longest spatial loop (other than the vector one) that some buffer the
    block reads does not depend on, so each value read of it serves ``factor`` outputs (a
    convolution's input pixel for several output channels); its extent divisible by the factor
    (:data:`TILE_FLOAT` for float outputs, :data:`TILE_INT` otherwise: the widened integer
    operands need more registers), divided by the registers a vector of ``lanes`` takes (a
    whole loop of 9-16 lanes takes two: 14 lanes by 8 outputs did not fit the 16 vector
    registers and spilled, 3x slower on ResNet-18's 14x14 convolutions)."""
    write = block_stmt.writes[0].source if block_stmt.writes else None
    base = TILE_FLOAT if write is not None and str(write.dtype).startswith("float") else TILE_INT
    factor = base // -(-lanes // VECTOR_LANES)
    if factor < 2:
        return None
    best = None
    for i in spatial:
        if i == vec:
            continue
        ext = _extent(sch, loops[i])
        if ext is None or ext < factor or ext % factor:
            continue
        var = bound[i].var
        if not any(all(not (_uses(r.min, var) or _uses(r.extent, var)) for r in region.region)
                   for region in block_stmt.reads):
            continue  # every operand changes along it: no reuse
        if best is None or ext > best[1]:
            best = (i, ext)
    return None if best is None else (best[0], factor)


def _outer(loops, kinds):
    """The spatial loops in front of the first other loop (the loop order stays); of a
    purely spatial nest all but the innermost, which LLVM may vectorize itself."""
    out = []
    for lp, k in zip(loops, kinds):
        if k != "S":
            return out
        out.append(lp)
    return out[:-1] if len(out) > 1 else out


def _parallel(sch, loops, counts: Stats) -> None:
    if not loops:
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    ext = _extent(sch, fused)
    if ext is not None and ext < 2:
        return
    sch.parallel(fused)
    counts.parallel += 1
