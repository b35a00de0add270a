"""The kernel IR: an immutable description of one fused kernel.

A kernel iterates over a 2-D space of ``rows x cols`` (``cols`` is the last dimension of the
tensors it touches). Every value in the body has a *level* made of two flags: ``ROW`` (it
varies along rows) and ``COL`` (it varies along columns). A full tensor is ``ROW | COL``, a
per-row value (a reduction result, or a ``[..., 1]`` input) is ``ROW``, a bias of shape
``[cols]`` is ``COL``, a scalar is neither.

The body is a tuple of statements in dependency order: :class:`Load` of an input,
:class:`Const`, :class:`Pointwise` ops and :class:`Reduce` over the last dimension. The
:class:`Store` statements say which values become outputs. All records are frozen; a change
builds a new value.
"""

from __future__ import annotations

import dataclasses

ROW = 1
COL = 2
FULL = ROW | COL
SCALAR = 0

ACCESS_LEVEL = {"full": FULL, "row": ROW, "col": COL, "scalar": SCALAR}

POINTWISE_ARITY = {
    "add": 2, "sub": 2, "mul": 2, "div": 2, "maximum": 2, "minimum": 2,
    "lt": 2, "le": 2, "gt": 2, "ge": 2, "eq": 2, "ne": 2, "and": 2, "or": 2,
    "neg": 1, "exp": 1, "log": 1, "sqrt": 1, "rsqrt": 1, "reciprocal": 1, "abs": 1,
    "sigmoid": 1, "tanh": 1, "erf": 1, "not": 1, "broadcast": 1,
    "round_float16": 1, "round_bfloat16": 1, "where": 3,
}
BOOL_RESULT = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"})
REDUCTIONS = frozenset({"sum", "max", "min"})


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A kernel input or output: its dtype (torch name), shape and how it is indexed.

    ``access`` is one of ``"full"`` (one element per (row, col)), ``"row"`` (one per row,
    broadcast along columns), ``"col"`` (one per column, broadcast along rows) or ``"scalar"``.
    """

    dtype: str
    shape: tuple[int, ...]
    access: str


@dataclasses.dataclass(frozen=True)
class Load:
    """``out = inputs[input]`` read with that input's access pattern, converted to fp32."""

    out: str
    input: int


@dataclasses.dataclass(frozen=True)
class Const:
    """``out`` is a compile-time constant (float, int or bool)."""

    out: str
    value: float | int | bool


@dataclasses.dataclass(frozen=True)
class Pointwise:
    """``out = fn(*args)`` elementwise; ``fn`` is a key of ``POINTWISE_ARITY``."""

    out: str
    fn: str
    args: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Reduce:
    """``out = fn(arg)`` over the last dimension; the result has one value per row."""

    out: str
    fn: str
    arg: str


@dataclasses.dataclass(frozen=True)
class Store:
    """``outputs[output] = value`` with that output's access pattern and dtype."""

    output: int
    value: str


Stmt = Load | Const | Pointwise | Reduce


@dataclasses.dataclass(frozen=True)
class KernelIR:
    """One fused kernel. ``kind`` is ``"pointwise"`` (1-D flat tiling) or ``"reduction"``
    (row tiling, columns looped when ``persistent`` is false)."""

    name: str
    kind: str
    rows: int
    cols: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    body: tuple[Stmt, ...]
    stores: tuple[Store, ...]
    persistent: bool = True

    @property
    def numel(self) -> int:
        """Elements in the iteration space."""
        return self.rows * self.cols

    def levels(self) -> dict[str, int]:
        """Level (ROW/COL flags) of every value of the body."""
        return value_levels(self.inputs, self.body)

    def validate(self) -> None:
        """Check the invariants the emitter relies on; raise ValueError if one is broken."""
        levels = self.levels()
        defined: set[str] = set()
        for stmt in self.body:
            uses = stmt_uses(stmt)
            missing = [u for u in uses if u not in defined]
            if missing:
                raise ValueError(f"kernel {self.name}: {stmt} uses undefined {missing}")
            if isinstance(stmt, Pointwise) and len(stmt.args) != POINTWISE_ARITY[stmt.fn]:
                raise ValueError(f"kernel {self.name}: wrong arity in {stmt}")
            if isinstance(stmt, Reduce) and stmt.fn not in REDUCTIONS:
                raise ValueError(f"kernel {self.name}: unknown reduction {stmt.fn}")
            if isinstance(stmt, Load) and not 0 <= stmt.input < len(self.inputs):
                raise ValueError(f"kernel {self.name}: load of missing input {stmt.input}")
            defined.add(stmt.out)
        for store in self.stores:
            spec = self.outputs[store.output]
            if store.value not in defined:
                raise ValueError(f"kernel {self.name}: store of undefined {store.value}")
            if spec.access == "row" and levels[store.value] & COL:
                raise ValueError(f"kernel {self.name}: per-row output {store.output} stores a "
                                 "value that varies along columns")
            if spec.access not in ("full", "row"):
                raise ValueError(f"kernel {self.name}: output access {spec.access!r} "
                                 "(allowed: 'full', 'row')")
        if self.kind == "pointwise" and any(isinstance(s, Reduce) for s in self.body):
            raise ValueError(f"kernel {self.name}: pointwise kernel with a reduction")


def stmt_uses(stmt: Stmt) -> tuple[str, ...]:
    """Values a statement reads."""
    if isinstance(stmt, Pointwise):
        return stmt.args
    if isinstance(stmt, Reduce):
        return (stmt.arg,)
    return ()


def value_levels(inputs: tuple[TensorSpec, ...], body: tuple[Stmt, ...]) -> dict[str, int]:
    """Level of every value: loads take their input's access, ops the union of their args,
    ``broadcast`` makes a value full, reductions keep only the ROW flag."""
    levels: dict[str, int] = {}
    for stmt in body:
        if isinstance(stmt, Load):
            levels[stmt.out] = ACCESS_LEVEL[inputs[stmt.input].access]
        elif isinstance(stmt, Const):
            levels[stmt.out] = SCALAR
        elif isinstance(stmt, Pointwise):
            level = 0
            for arg in stmt.args:
                level |= levels[arg]
            levels[stmt.out] = FULL if stmt.fn == "broadcast" else level
        else:
            levels[stmt.out] = ROW
    return levels


def reduction_stages(body: tuple[Stmt, ...]) -> dict[str, int]:
    """For every value, how many reductions lie on its longest dependency chain.

    A reduction whose argument has stage ``s`` is computed in column loop ``s`` and its result
    has stage ``s + 1``; the looped emitter runs one column loop per stage.
    """
    stages: dict[str, int] = {}
    for stmt in body:
        base = max((stages[u] for u in stmt_uses(stmt)), default=0)
        stages[stmt.out] = base + 1 if isinstance(stmt, Reduce) else base
    return stages


def is_bool_value(body: tuple[Stmt, ...], inputs: tuple[TensorSpec, ...]) -> dict[str, bool]:
    """Whether each value is boolean (comparisons, bool inputs, bool constants, where of bools)."""
    kinds: dict[str, bool] = {}
    for stmt in body:
        if isinstance(stmt, Load):
            kinds[stmt.out] = inputs[stmt.input].dtype == "bool"
        elif isinstance(stmt, Const):
            kinds[stmt.out] = isinstance(stmt.value, bool)
        elif isinstance(stmt, Pointwise):
            if stmt.fn in BOOL_RESULT:
                kinds[stmt.out] = True
            elif stmt.fn == "where":
                kinds[stmt.out] = kinds[stmt.args[1]] and kinds[stmt.args[2]]
            elif stmt.fn == "broadcast":
                kinds[stmt.out] = kinds[stmt.args[0]]
            else:
                kinds[stmt.out] = False
        else:
            kinds[stmt.out] = False
    return kinds
