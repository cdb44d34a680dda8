"""ONNX Add, Sub, Mul, Div, Neg and Mod on FP32 data and on integer data held exactly in FP32.

FP32 data keeps the graph's FP32 semantics (the FP64 reference computes them exactly). Integer data
(onnx/kinds.py) is computed in forms whose every FP32 result is exact while the values stay within the
ranges that OnnxModel.feed checks per batch (each handler records its range step, onnx/ranges.py):
sums, differences and products are integers; Div truncates toward zero and Mod follows ONNX's sign rules,
built from fmod (exact in any precision) and comparisons.
"""
from __future__ import annotations

from typing import Callable

from ..hlir.tensor import GraphTensor
from .kinds import INTEGER_KINDS, NARROW_FLOAT_KINDS
from .loader import FLOAT, INT
from .round_cast import clamp
from .values import NodeCtx, Tensor, Value

# |dividend| below which the truncating division below is exact: its quotient estimate q(1 + e), |e| <=
# 2^-23 (a reciprocal and a product, each rounded to FP32), is then within 1/4 of q, and adding 1/2
# towards q's sign rounds with an ulp <= 1/8, which keeps it strictly between q and the next integer
DIV_EXACT_LIMIT = float(2 ** 21)


def _is_integer(c: NodeCtx, i: int) -> bool:
    v = c.values[i]
    return (v.dtype.kind in "iu") if hasattr(v, "dtype") else v.kind in INTEGER_KINDS + (INT,)


def _integers(c: NodeCtx) -> tuple[Tensor, Tensor, str]:
    a, b = c.integer(0), c.integer(1)
    kind = c.out_kind() or a.kind
    if kind not in INTEGER_KINDS:
        raise c.refuse(f"integer operands with a {kind} result are not supported")
    return a, b, kind


_FLOAT_FORMS: dict[str, Callable[[GraphTensor, GraphTensor], GraphTensor]] = {
    "Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b, "Div": lambda a, b: a / b}


def trunc(x: GraphTensor) -> GraphTensor:
    return x - x % 1.0  # fmod(x, 1) is exact and has x's sign: x minus it is x rounded toward zero


def int_div(a: GraphTensor, b: GraphTensor) -> GraphTensor:
    """a / b rounded toward zero for integers b != 0, |a| <= DIV_EXACT_LIMIT: (a - fmod(a, b)) is an exact
    multiple of b, its quotient estimate is within 1/4 of the integer q, and q is recovered by truncating
    the estimate moved 1/2 towards its sign."""
    t = (a - a % b) * b.recip()
    sign = (t > 0.0) - (t < 0.0)  # 0 for q = 0 (then t is exactly 0)
    return trunc(t + sign * 0.5)


def floor_mod(a: GraphTensor, b: GraphTensor) -> GraphTensor:
    """ONNX Mod with fmod=0 (the result takes b's sign): fmod, plus b where the remainder is nonzero and its
    sign differs from b's (the two cases below are disjoint, so their sum is 0 or 1)."""
    r = a % b
    fix = (r < 0.0) * (b > 0.0) + (r > 0.0) * (b < 0.0)
    return r + b * fix


def arith(op: str):
    """Add/Sub/Mul/Div: FP32 data as before; integer data exactly, with its range step."""
    def build(c: NodeCtx) -> list[Value]:
        if not (_is_integer(c, 0) or _is_integer(c, 1)):
            return [Tensor(_FLOAT_FORMS[op](c.tensor(0).t, c.tensor(1).t), FLOAT)]
        a, b, kind = _integers(c)
        if op == "Div":
            c.record("div", (0, 1), kind, limit=DIV_EXACT_LIMIT)
            return [Tensor(int_div(a.t, b.t), kind)]
        c.record(op.lower(), (0, 1), kind)
        return [Tensor(_FLOAT_FORMS[op](a.t, b.t), kind)]
    return build


def neg(c: NodeCtx) -> list[Value]:
    if _is_integer(c, 0):
        x = c.integer(0)
        c.record("neg", (0,), x.kind)
        return [Tensor(-x.t, x.kind)]
    x = c.tensor(0, (FLOAT,) + NARROW_FLOAT_KINDS + ("double",))
    return [Tensor(-x.t, x.kind)]  # negation is exact in every float format


def mod(c: NodeCtx) -> list[Value]:
    """fmod=1: fmod, exact (its result is a value of the operands' float type); fmod=0 on integers: the
    floor-mod; fmod=0 on floats is refused (its r + b rounds, and is NaN for an infinite b)."""
    fmod = c.attr("fmod", 0)
    if _is_integer(c, 0) or _is_integer(c, 1):
        a, b, kind = _integers(c)
        c.record("mod", (0, 1), kind)
        return [Tensor(a.t % b.t if fmod else floor_mod(a.t, b.t), kind)]
    if not fmod:
        raise c.refuse("fmod=0 on floats is not supported (the floor-mod's r + b rounds)")
    kinds = (FLOAT,) + NARROW_FLOAT_KINDS
    a, b = c.tensor(0, kinds), c.tensor(1, kinds)
    if a.kind != b.kind:
        raise c.refuse(f"operands of kinds {a.kind} and {b.kind}")
    return [Tensor(a.t % b.t, a.kind)]


# |x| at or past this is an integer in FP32 and FP64 alike: fmod(x, 1) is taken of x clamped to it, so an
# infinite x gives 0 (then floor(inf) = inf - 0) instead of fmod(inf, 1) = NaN
_ALL_INTEGERS = 2.0 ** 52


def floor_ceil(ceil: bool):
    """Floor / Ceil: x minus its fraction fmod(x, 1) (exact: trunc), then -1 / +1 where the fraction is
    negative / positive. NaN stays NaN; +-inf stay (their fraction is 0 through the clamp)."""
    def build(c: NodeCtx) -> list[Value]:
        x = c.tensor(0, (FLOAT, "double") + NARROW_FLOAT_KINDS)  # a float's floor is a value of its type
        frac = clamp(x.t, -_ALL_INTEGERS, _ALL_INTEGERS) % 1.0
        whole = x.t - frac
        return [Tensor(whole + (frac > 0.0) if ceil else whole - (frac < 0.0), x.kind)]
    return build
