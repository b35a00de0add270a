"""Triton source emission for :class:`~zeroc.codegen.kernel_ir.KernelIR`.

Pointwise kernels use 1-D flat tiling: program ``p`` handles elements
``[p * BLOCK, (p + 1) * BLOCK)``. Reduction kernels handle ``BLOCK_R`` rows per program; a
*persistent* kernel holds a whole row in one ``BLOCK_C >= cols`` tile, a *looped* one walks
the row in ``BLOCK_C`` chunks, once per reduction stage (values that vary along columns are
recomputed in every loop that needs them, as Inductor's looped reductions do).

Only core ``tl`` math is used (exp, log, sqrt, rsqrt, erf, sigmoid, sum/max, where) so the
same source runs under ``TRITON_INTERPRET=1``; tanh is ``2 * sigmoid(2x) - 1``. Every value is
computed in fp32 and converted to the output dtype when stored.

NaN and infinities follow eager PyTorch. ``tl.maximum``/``tl.minimum`` return the non-NaN
operand and ``tl.max``/``tl.min`` skip NaN, whereas ``torch.maximum``, ``relu``, ``clamp`` and
``amax`` return NaN when an operand (a row element) is NaN. So pointwise max/min pass
``propagate_nan=tl.PropagateNan.ALL``, and a max/min reduction also counts the NaNs of its row
(an integer ``tl.max`` of ``x != x``, fast in the interpreter too) and returns NaN for a row
that has one. Masked-off columns hold the reduction's identity (``-inf`` for max, ``inf`` for
min), so rows of infinities reduce as eager does.
"""

from __future__ import annotations

from zeroc.codegen.kernel_ir import (
    COL,
    Const,
    KernelIR,
    Load,
    Pointwise,
    Reduce,
    Stmt,
    TensorSpec,
    reduction_stages,
    stmt_uses,
)

TL_DTYPE = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16",
            "bool": "tl.int1"}

_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">",
           "ge": ">=", "eq": "==", "ne": "!=", "and": "&", "or": "|"}
_UNARY_TL = {"exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt", "rsqrt": "tl.rsqrt",
             "abs": "tl.abs", "sigmoid": "tl.sigmoid", "erf": "tl.erf"}
_REDUCE_INIT = {"sum": "0.0", "max": 'float("-inf")', "min": 'float("inf")'}
_REDUCE_TL = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}
_NAN = "tl.PropagateNan.ALL"
_REDUCE_COMBINE = {"sum": "{acc} + {x}",
                   "max": "tl.maximum({acc}, {x}, propagate_nan=" + _NAN + ")",
                   "min": "tl.minimum({acc}, {x}, propagate_nan=" + _NAN + ")"}

HEADER = "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
INDEX_32BIT_LIMIT = 2**31 - 1


def _literal(value: float | int | bool) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    value = float(value)
    if value != value:
        return 'float("nan")'
    if value in (float("inf"), float("-inf")):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return repr(value)


def pointwise_expr(fn: str, args: tuple[str, ...], full_shape: str) -> str:
    """The Triton expression of one pointwise op applied to value names ``args``."""
    if fn in _BINARY:
        return f"({args[0]} {_BINARY[fn]} {args[1]})"
    if fn in _UNARY_TL:
        return f"{_UNARY_TL[fn]}({args[0]})"
    table = {
        "neg": "(-{0})",
        "reciprocal": "(1.0 / {0})",
        "tanh": "(2.0 * tl.sigmoid(2.0 * {0}) - 1.0)",
        "not": "({0} == 0)",
        "maximum": "tl.maximum({0}, {1}, propagate_nan=" + _NAN + ")",
        "minimum": "tl.minimum({0}, {1}, propagate_nan=" + _NAN + ")",
        "where": "tl.where({0}, {1}, {2})",
        "round_float16": "{0}.to(tl.float16).to(tl.float32)",
        "round_bfloat16": "{0}.to(tl.bfloat16).to(tl.float32)",
        "broadcast": "tl.broadcast_to({0}, " + full_shape + ")",
    }
    return table[fn].format(*args)


def reduce_expr(fn: str, x: str) -> str:
    """The per-row (``[BLOCK_R, 1]``) reduction ``fn`` of the 2-D tile ``x`` along columns.

    ``max``/``min`` return NaN for a row holding a NaN, as ``torch.amax``/``amin`` do.
    """
    reduced = f"{_REDUCE_TL[fn]}({x}, 1)[:, None]"
    if fn == "sum":
        return reduced
    has_nan = f"tl.max(tl.where({x} != {x}, 1, 0), 1)[:, None] > 0"
    return f"tl.where({has_nan}, float(\"nan\"), {reduced})"


def _signature(ir: KernelIR, extra: str) -> list[str]:
    params = [f"in{i}" for i in range(len(ir.inputs))]
    params += [f"out{i}" for i in range(len(ir.outputs))]
    return [f"def {ir.name}({', '.join(params)}, {extra}):"]


def _load(stmt: Load, spec: TensorSpec, index: dict[str, tuple[str, str]]) -> str:
    convert = ".to(tl.int1)" if spec.dtype == "bool" else ".to(tl.float32)"
    if spec.access == "scalar":
        return f"{stmt.out} = tl.load(in{stmt.input}){convert}"
    offset, mask = index[spec.access]
    return (f"{stmt.out} = tl.load(in{stmt.input} + {offset}, mask={mask}, other=0)"
            f"{convert}")


def _stmt_line(ir: KernelIR, stmt: Stmt, index: dict[str, tuple[str, str]],
               full_shape: str) -> str:
    if isinstance(stmt, Load):
        return _load(stmt, ir.inputs[stmt.input], index)
    if isinstance(stmt, Const):
        return f"{stmt.out} = {_literal(stmt.value)}"
    if isinstance(stmt, Pointwise):
        return f"{stmt.out} = {pointwise_expr(stmt.fn, stmt.args, full_shape)}"
    masked = f"tl.where(mask, {stmt.arg}, {_REDUCE_INIT[stmt.fn]})"
    if stmt.fn == "sum":
        return f"{stmt.out} = {reduce_expr(stmt.fn, masked)}"
    # max/min read the masked tile twice (values and NaN count): name it once.
    return f"{stmt.out}_x = {masked}\n{stmt.out} = {reduce_expr(stmt.fn, stmt.out + '_x')}"


def _stmt_lines(ir: KernelIR, stmts: list[Stmt] | tuple[Stmt, ...],
                index: dict[str, tuple[str, str]], full_shape: str, indent: str) -> list[str]:
    """The source lines of ``stmts``, each indented by ``indent``."""
    return [indent + line for s in stmts
            for line in _stmt_line(ir, s, index, full_shape).split("\n")]


def _store_line(ir: KernelIR, output: int, value: str, index: dict[str, tuple[str, str]],
                shape: str) -> str:
    spec = ir.outputs[output]
    offset, mask = index[spec.access]
    return (f"tl.store(out{output} + {offset}, tl.broadcast_to({value}, {shape})"
            f".to({TL_DTYPE[spec.dtype]}), mask={mask})")


def emit_pointwise(ir: KernelIR) -> str:
    """Source of a 1-D flat-tiled pointwise kernel."""
    lines = _signature(ir, "numel, C, BLOCK: tl.constexpr")
    pid = "tl.program_id(0)"
    if ir.numel > INDEX_32BIT_LIMIT:
        pid += ".to(tl.int64)"
    lines += [f"    offs = {pid} * BLOCK + tl.arange(0, BLOCK)", "    mask = offs < numel"]
    index = {"full": ("offs", "mask"), "row": ("offs // C", "mask"), "col": ("offs % C", "mask")}
    lines += _stmt_lines(ir, ir.body, index, "[BLOCK]", "    ")
    lines += ["    " + _store_line(ir, st.output, st.value, index, "[BLOCK]") for st in ir.stores]
    return HEADER + "\n".join(lines) + "\n"


def _row_prologue(ir: KernelIR) -> list[str]:
    pid = "tl.program_id(0)"
    if ir.numel > INDEX_32BIT_LIMIT:
        pid += ".to(tl.int64)"
    return [f"    rows = {pid} * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]", "    rmask = rows < R"]


_ROW_INDEX = {"full": ("rows * C + cols", "mask"), "row": ("rows", "rmask"),
              "col": ("cols", "cmask")}
_FULL = "[BLOCK_R, BLOCK_C]"


def emit_persistent(ir: KernelIR) -> str:
    """Source of a reduction kernel whose whole row fits one ``BLOCK_C`` tile."""
    lines = _signature(ir, "R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr")
    lines += _row_prologue(ir)
    lines += ["    cols = tl.arange(0, BLOCK_C)[None, :]", "    cmask = cols < C",
              "    mask = rmask & cmask"]
    lines += _stmt_lines(ir, ir.body, _ROW_INDEX, _FULL, "    ")
    for st in ir.stores:
        shape = _FULL if ir.outputs[st.output].access == "full" else "[BLOCK_R, 1]"
        lines.append("    " + _store_line(ir, st.output, st.value, _ROW_INDEX, shape))
    return HEADER + "\n".join(lines) + "\n"


def _column_closure(ir: KernelIR, roots: list[str], levels: dict[str, int]) -> list[Stmt]:
    """Statements varying along columns that ``roots`` need, in body order."""
    by_name = {s.out: s for s in ir.body}
    needed: set[str] = set()
    stack = [r for r in roots if levels[r] & COL]
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        stack += [u for u in stmt_uses(by_name[name]) if levels[u] & COL]
    return [s for s in ir.body if s.out in needed]


def _loop_header(indent: str) -> list[str]:
    return [f"{indent}for c0 in range(0, C, BLOCK_C):",
            f"{indent}    cols = c0 + tl.arange(0, BLOCK_C)[None, :]",
            f"{indent}    cmask = cols < C",
            f"{indent}    mask = rmask & cmask"]


def emit_looped(ir: KernelIR) -> str:
    """Source of a reduction kernel that loops over column chunks, one loop per stage."""
    levels = ir.levels()
    stages = reduction_stages(ir.body)
    reduces = [s for s in ir.body if isinstance(s, Reduce)]
    n_stages = max((stages[r.arg] + 1 for r in reduces), default=0)
    row_stmts = [s for s in ir.body if not isinstance(s, Reduce) and not levels[s.out] & COL]
    lines = _signature(ir, "R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr")
    lines += _row_prologue(ir)
    for stage in range(n_stages + 1):
        lines += _stmt_lines(ir, [s for s in row_stmts if stages[s.out] == stage], _ROW_INDEX,
                             _FULL, "    ")
        if stage == n_stages:
            break
        loop_reduces = [r for r in reduces if stages[r.arg] == stage]
        for r in loop_reduces:
            init = _REDUCE_INIT[r.fn]
            lines.append(f"    acc_{r.out} = tl.full({_FULL}, {init}, tl.float32)")
        lines += _loop_header("    ")
        lines += _stmt_lines(ir, _column_closure(ir, [r.arg for r in loop_reduces], levels),
                             _ROW_INDEX, _FULL, "        ")
        for r in loop_reduces:
            x = f"tl.where(mask, tl.broadcast_to({r.arg}, {_FULL}), {_REDUCE_INIT[r.fn]})"
            combined = _REDUCE_COMBINE[r.fn].format(acc=f"acc_{r.out}", x=x)
            lines.append(f"        acc_{r.out} = {combined}")
        for r in loop_reduces:
            lines.append(f"    {r.out} = {reduce_expr(r.fn, 'acc_' + r.out)}")
    full_stores = [st for st in ir.stores if ir.outputs[st.output].access == "full"]
    if full_stores:
        lines += _loop_header("    ")
        lines += _stmt_lines(ir, _column_closure(ir, [st.value for st in full_stores], levels),
                             _ROW_INDEX, _FULL, "        ")
        for st in full_stores:
            lines.append("        " + _store_line(ir, st.output, st.value, _ROW_INDEX, _FULL))
    for st in ir.stores:
        if ir.outputs[st.output].access == "row":
            lines.append("    " + _store_line(ir, st.output, st.value, _ROW_INDEX,
                                              "[BLOCK_R, 1]"))
    return HEADER + "\n".join(lines) + "\n"


def emit_source(ir: KernelIR) -> str:
    """The complete Triton module source for ``ir`` (one ``@triton.jit`` function)."""
    ir.validate()
    if ir.kind == "pointwise":
        return emit_pointwise(ir)
    return emit_persistent(ir) if ir.persistent else emit_looped(ir)
