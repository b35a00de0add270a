"""Lowering of aten ops to kernel-IR statements.

Each supported ``torch.ops.aten`` overload has a rule ``rule(builder, *args, **kwargs)`` that
appends statements to an :class:`IRBuilder` and returns the value name(s) of its result.
Tensor arguments arrive as value names (``str``), everything else as the Python value the
graph holds. Composite ops (softmax, log-softmax, layer norm and their backwards) are spelled
out with the same formulas as the aten CPU kernels. ``OP_KIND`` says what the fusion pass may
do with a node: ``"pointwise"``, ``"reduction"`` (over the last dimension), ``"view"``
(same elements, new shape), ``"identity"`` (same values) or ``"broadcast"`` (expand).

Ops built on max/min (``relu``, ``clamp*``, ``hardtanh``, ``maximum``/``minimum``,
``amax``/``amin``) lower to the IR's ``maximum``/``minimum`` and ``max``/``min`` reductions,
which ``triton_emit`` makes propagate NaN as eager does; comparisons with NaN are false, so
``threshold``, ``where`` and the backward masks treat NaN as eager's formulas do.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from zeroc.codegen.kernel_ir import (
    Const,
    Load,
    Pointwise,
    Reduce,
    Stmt,
    TensorSpec,
    is_bool_value,
)

aten = torch.ops.aten


class IRBuilder:
    """Collects the statements of one kernel; names values ``v0, v1, ...``."""

    def __init__(self, cols: int) -> None:
        self.cols = cols
        self.body: list[Stmt] = []
        self.inputs: list[TensorSpec] = []
        self._count = 0
        self._consts: dict[tuple[type, float | bool], str] = {}

    def _name(self) -> str:
        self._count += 1
        return f"v{self._count - 1}"

    def load(self, spec: TensorSpec) -> str:
        """Add an input and a load of it; return the loaded value."""
        self.inputs.append(spec)
        out = self._name()
        self.body.append(Load(out, len(self.inputs) - 1))
        return out

    def val(self, x: str | float | int | bool) -> str:
        """A value name for ``x``: names pass through, Python numbers become constants."""
        if isinstance(x, str):
            return x
        value = x if isinstance(x, bool) else float(x)
        key = (type(value), value)
        if key not in self._consts:
            self._consts[key] = self._name()
            self.body.append(Const(self._consts[key], value))
        return self._consts[key]

    def op(self, fn: str, *args: str | float | int | bool) -> str:
        """Append the pointwise op ``fn`` and return its result."""
        names = tuple(self.val(a) for a in args)
        out = self._name()
        self.body.append(Pointwise(out, fn, names))
        return out

    def is_bool(self, name: str) -> bool:
        """Whether value ``name`` is boolean."""
        return is_bool_value(tuple(self.body), tuple(self.inputs))[name]

    def reduce(self, fn: str, arg: str) -> str:
        """Append a last-dimension reduction and return its per-row result."""
        out = self._name()
        self.body.append(Reduce(out, fn, arg))
        return out


Rule = Callable[..., object]


def _scaled(b: IRBuilder, x: str, alpha: float) -> str:
    return x if alpha == 1 else b.op("mul", x, alpha)


def _pow(b: IRBuilder, x: str, exponent: float) -> str:
    if exponent == 0.5:
        return b.op("sqrt", x)
    if exponent == -0.5:
        return b.op("rsqrt", x)
    power = int(abs(exponent))
    result = x
    for _ in range(power - 1):
        result = b.op("mul", result, x)
    return b.op("reciprocal", result) if exponent < 0 else result


def pow_supported(exponent: object) -> bool:
    """Exponents lowered exactly: +-0.5 and non-zero integers up to 4 in magnitude."""
    if not isinstance(exponent, (int, float)) or isinstance(exponent, bool):
        return False
    return exponent in (0.5, -0.5) or (float(exponent).is_integer() and 1 <= abs(exponent) <= 4)


def _gelu(b: IRBuilder, x: str, approximate: str = "none") -> str:
    if approximate == "tanh":
        inner = b.op("mul", b.op("add", x, b.op("mul", 0.044715, _pow(b, x, 3))),
                     math.sqrt(2.0 / math.pi))
        return b.op("mul", b.op("mul", x, 0.5), b.op("add", 1.0, b.op("tanh", inner)))
    cdf = b.op("add", 1.0, b.op("erf", b.op("mul", x, 0.7071067811865476)))
    return b.op("mul", b.op("mul", x, 0.5), cdf)


def _gelu_backward(b: IRBuilder, grad: str, x: str, approximate: str = "none") -> str:
    if approximate == "tanh":
        k_beta = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5
        x_sq = b.op("mul", x, x)
        inner = b.op("mul", k_beta, b.op("add", x, b.op("mul", 0.044715, b.op("mul", x_sq, x))))
        tanh_inner = b.op("tanh", inner)
        left = b.op("mul", 0.5, x)
        right = b.op("add", 1.0, tanh_inner)
        left_d = b.op("mul", 0.5, right)
        right_d = b.op("mul", b.op("mul", left, b.op("sub", 1.0, b.op("mul", tanh_inner,
                                                                     tanh_inner))),
                       b.op("mul", k_beta, b.op("add", 1.0, b.op("mul", 3.0 * 0.044715, x_sq))))
        return b.op("mul", grad, b.op("add", left_d, right_d))
    cdf = b.op("mul", 0.5, b.op("add", 1.0, b.op("erf", b.op("mul", x, 0.7071067811865476))))
    pdf = b.op("mul", b.op("exp", b.op("mul", -0.5, b.op("mul", x, x))), 0.3989422804014327)
    return b.op("mul", grad, b.op("add", cdf, b.op("mul", x, pdf)))


def _mean(b: IRBuilder, x: str) -> str:
    return b.op("div", b.reduce("sum", x), float(b.cols))


def _var_mean(b: IRBuilder, x: str, dims=None, correction=None, keepdim=False):
    mean = _mean(b, x)
    centered = b.op("sub", x, mean)
    denom = b.cols - (1 if correction is None else correction)
    var = b.op("div", b.reduce("sum", b.op("mul", centered, centered)), float(max(denom, 0)))
    return var, mean


def _softmax(b: IRBuilder, x: str, dim=-1, half_to_float=False) -> str:
    e = b.op("exp", b.op("sub", x, b.reduce("max", x)))
    return b.op("div", e, b.reduce("sum", e))


def _log_softmax(b: IRBuilder, x: str, dim=-1, half_to_float=False) -> str:
    shifted = b.op("sub", x, b.reduce("max", x))
    return b.op("sub", shifted, b.op("log", b.reduce("sum", b.op("exp", shifted))))


def _softmax_backward(b: IRBuilder, grad: str, out: str, dim=-1, input_dtype=None) -> str:
    dot = b.reduce("sum", b.op("mul", grad, out))
    return b.op("mul", out, b.op("sub", grad, dot))


def _log_softmax_backward(b: IRBuilder, grad: str, out: str, dim=-1, input_dtype=None) -> str:
    return b.op("sub", grad, b.op("mul", b.op("exp", out), b.reduce("sum", grad)))


def _layer_norm(b: IRBuilder, x: str, normalized_shape, weight=None, bias=None, eps=1e-5):
    mean = _mean(b, x)
    centered = b.op("sub", x, mean)
    var = b.op("div", b.reduce("sum", b.op("mul", centered, centered)), float(b.cols))
    rstd = b.op("rsqrt", b.op("add", var, eps))
    out = b.op("mul", centered, rstd)
    if weight is not None:
        out = b.op("mul", out, weight)
    if bias is not None:
        out = b.op("add", out, bias)
    return out, mean, rstd


def _cast(b: IRBuilder, x: str, dtype=None, **_: object) -> str:
    if dtype is None:
        return x
    if dtype == torch.bool:
        return x if b.is_bool(x) else b.op("ne", x, 0.0)
    if b.is_bool(x):
        return b.op("where", x, 1.0, 0.0)
    if dtype == torch.float16:
        return b.op("round_float16", x)
    if dtype == torch.bfloat16:
        return b.op("round_bfloat16", x)
    return x


def _silu_backward(b: IRBuilder, grad: str, x: str) -> str:
    s = b.op("sigmoid", x)
    return b.op("mul", grad, b.op("mul", s, b.op("add", 1.0, b.op("mul", x, b.op("sub", 1.0, s)))))


def _clamp(b: IRBuilder, x: str, lo: object = None, hi: object = None) -> str:
    """``torch.clamp``: ``min(max(x, lo), hi)``; NaN in ``x`` or a bound gives NaN, and
    ``lo > hi`` gives ``hi``, as eager does (the emitter's max/min propagate NaN)."""
    out = x if lo is None else b.op("maximum", x, lo)
    return out if hi is None else b.op("minimum", out, hi)


def _hardtanh_backward(b: IRBuilder, grad: str, x: str, lo: float, hi: float) -> str:
    """Zero outside ``(lo, hi)``. A NaN ``x`` passes the gradient, as CUDA's kernel and torch's
    decomposition do (CPU eager's vectorized loop gives 0 there, its scalar loop the grad)."""
    outside = b.op("or", b.op("le", x, lo), b.op("ge", x, hi))
    return b.op("where", outside, 0.0, grad)


def _logical(fn: str) -> Rule:
    return lambda b, x, y: b.op(fn, _cast(b, b.val(x), torch.bool), _cast(b, b.val(y), torch.bool))


def _binary(fn: str) -> Rule:
    return lambda b, x, y: b.op(fn, x, y)


def _unary(fn: str) -> Rule:
    return lambda b, x: b.op(fn, x)


POINTWISE_RULES: dict[object, Rule] = {
    aten.add.Tensor: lambda b, x, y, alpha=1: b.op("add", x, _scaled(b, b.val(y), alpha)),
    aten.add.Scalar: lambda b, x, y, alpha=1: b.op("add", x, _scaled(b, b.val(y), alpha)),
    aten.sub.Tensor: lambda b, x, y, alpha=1: b.op("sub", x, _scaled(b, b.val(y), alpha)),
    aten.sub.Scalar: lambda b, x, y, alpha=1: b.op("sub", x, _scaled(b, b.val(y), alpha)),
    aten.rsub.Scalar: lambda b, x, y, alpha=1: b.op("sub", y, _scaled(b, x, alpha)),
    aten.rsub.Tensor: lambda b, x, y, alpha=1: b.op("sub", y, _scaled(b, x, alpha)),
    aten.mul.Tensor: _binary("mul"), aten.mul.Scalar: _binary("mul"),
    aten.div.Tensor: _binary("div"), aten.div.Scalar: _binary("div"),
    aten.maximum.default: _binary("maximum"), aten.minimum.default: _binary("minimum"),
    aten.pow.Tensor_Scalar: lambda b, x, e: _pow(b, x, e),
    aten.where.self: lambda b, c, x, y: b.op("where", c, x, y),
    aten.neg.default: _unary("neg"), aten.exp.default: _unary("exp"),
    aten.log.default: _unary("log"), aten.sqrt.default: _unary("sqrt"),
    aten.rsqrt.default: _unary("rsqrt"), aten.reciprocal.default: _unary("reciprocal"),
    aten.abs.default: _unary("abs"), aten.sigmoid.default: _unary("sigmoid"),
    aten.tanh.default: _unary("tanh"), aten.erf.default: _unary("erf"),
    aten.logical_not.default: _unary("not"),
    aten.relu.default: lambda b, x: b.op("maximum", x, 0.0),
    aten.clamp.default: _clamp, aten.clamp.Tensor: _clamp,
    aten.clamp_min.default: lambda b, x, lo: _clamp(b, x, lo),
    aten.clamp_min.Tensor: lambda b, x, lo: _clamp(b, x, lo),
    aten.clamp_max.default: lambda b, x, hi: _clamp(b, x, None, hi),
    aten.clamp_max.Tensor: lambda b, x, hi: _clamp(b, x, None, hi),
    aten.hardtanh.default: lambda b, x, lo=-1.0, hi=1.0: _clamp(b, x, lo, hi),
    aten.hardtanh_backward.default: _hardtanh_backward,
    aten.threshold.default: lambda b, x, t, value: b.op("where", b.op("le", x, t), value, x),
    aten.isnan.default: lambda b, x: b.op("ne", x, x),
    aten.logical_and.default: _logical("and"), aten.logical_or.default: _logical("or"),
    aten.silu.default: lambda b, x: b.op("mul", x, b.op("sigmoid", x)),
    aten.gelu.default: _gelu,
    aten.gelu_backward.default: _gelu_backward,
    aten.silu_backward.default: _silu_backward,
    aten.sigmoid_backward.default: lambda b, g, y: b.op(
        "mul", g, b.op("mul", y, b.op("sub", 1.0, y))),
    aten.tanh_backward.default: lambda b, g, y: b.op(
        "mul", g, b.op("sub", 1.0, b.op("mul", y, y))),
    aten.threshold_backward.default: lambda b, g, x, t: b.op(
        "where", b.op("le", x, t), 0.0, g),
    aten._to_copy.default: _cast,
    torch.ops.prims.convert_element_type.default: lambda b, x, dtype: _cast(b, x, dtype),
}
for _name, _fn in (("eq", "eq"), ("ne", "ne"), ("lt", "lt"), ("le", "le"), ("gt", "gt"),
                   ("ge", "ge")):
    POINTWISE_RULES[getattr(aten, _name).Tensor] = _binary(_fn)
    POINTWISE_RULES[getattr(aten, _name).Scalar] = _binary(_fn)

# Ops registered lazily (by Inductor's decompositions), matched by name.
NAMED_POINTWISE_RULES: dict[str, Rule] = {
    "prims.fma.default": lambda b, x, y, z: b.op("add", b.op("mul", x, y), z),
}

REDUCTION_RULES: dict[object, Rule] = {
    aten.sum.dim_IntList: lambda b, x, dims, keepdim=False, dtype=None: b.reduce("sum", x),
    aten.mean.dim: lambda b, x, dims, keepdim=False, dtype=None: _mean(b, x),
    aten.amax.default: lambda b, x, dims, keepdim=False: b.reduce("max", x),
    aten.amin.default: lambda b, x, dims, keepdim=False: b.reduce("min", x),
    aten.var_mean.correction: _var_mean,
    aten.var.correction: lambda b, x, dims=None, correction=None, keepdim=False: _var_mean(
        b, x, dims, correction, keepdim)[0],
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _log_softmax,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.native_layer_norm.default: _layer_norm,
}

VIEW_OPS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                      aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                      aten.squeeze.default})
IDENTITY_OPS = frozenset({aten.clone.default, aten.alias.default, aten.detach.default})
BROADCAST_OPS = frozenset({aten.expand.default})


def op_kind(target: object) -> str | None:
    """What the fusion pass may do with a node of this target (None: keep it in aten)."""
    if target in POINTWISE_RULES or str(target) in NAMED_POINTWISE_RULES:
        return "pointwise"
    if target in REDUCTION_RULES:
        return "reduction"
    if target in VIEW_OPS:
        return "view"
    if target in IDENTITY_OPS:
        return "identity"
    if target in BROADCAST_OPS:
        return "broadcast"
    return None


def lower(builder: IRBuilder, target: object, args: tuple, kwargs: dict) -> object:
    """Append the statements of one node; return its value name (or tuple of names)."""
    kind = op_kind(target)
    if kind in ("view", "identity"):
        return args[0]
    if kind == "broadcast":
        return builder.op("broadcast", args[0])
    rule = (POINTWISE_RULES.get(target) or NAMED_POINTWISE_RULES.get(str(target))
            or REDUCTION_RULES[target])
    return rule(builder, *args, **kwargs)
