"""The HLIR primops, each declared exactly once.

An `OpDecl` says how many sources the op has, which attributes it carries, its group (tinygrad's
GroupOp) and its FP64 reference semantics. The egglog constructors, the reference evaluator, the
interval analysis and the lowering all read these declarations instead of re-listing the ops.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import numpy as np
import scipy.special


class Group(enum.Enum):
    SOURCE = "source"      # no data sources (Input, Constant, Iota)
    UNARY = "unary"        # elementwise, one source
    BINARY = "binary"      # elementwise, two same-shaped sources
    REDUCE = "reduce"      # reduces one axis
    MOVEMENT_FREE = "cast"  # value-preserving except for rounding
    INDEXING = "indexing"  # Gather / Scatter
    OUTPUT = "output"
    CUSTOM = "custom"


@dataclass(frozen=True)
class OpDecl:
    name: str
    group: Group
    arity: int
    attrs: tuple[str, ...] = ()
    # FP64 semantics of elementwise ops (other groups are evaluated by the evaluator's group handler)
    fn: Callable[..., np.ndarray] | None = None


def _mod(a, b):
    return np.fmod(a, b)  # C semantics (sign of the dividend), as CUDA fmodf


class Op(enum.Enum):
    INPUT = OpDecl("Input", Group.SOURCE, 0, ("name",))
    CONSTANT = OpDecl("Constant", Group.SOURCE, 0, ("value",))
    IOTA = OpDecl("Iota", Group.SOURCE, 0, ("length",))
    CAST = OpDecl("Cast", Group.MOVEMENT_FREE, 1, ())
    EXP2 = OpDecl("Exp2", Group.UNARY, 1, (), np.exp2)
    LOG2 = OpDecl("Log2", Group.UNARY, 1, (), np.log2)
    SIN = OpDecl("Sin", Group.UNARY, 1, (), np.sin)
    RECIP = OpDecl("Recip", Group.UNARY, 1, (), np.reciprocal)
    SQRT = OpDecl("Sqrt", Group.UNARY, 1, (), np.sqrt)
    ADD = OpDecl("Add", Group.BINARY, 2, (), np.add)
    MUL = OpDecl("Mul", Group.BINARY, 2, (), np.multiply)
    MOD = OpDecl("Mod", Group.BINARY, 2, (), _mod)
    LESS_THAN = OpDecl("LessThan", Group.BINARY, 2, (), lambda a, b: (a < b).astype(np.float64))
    SUM_REDUCE = OpDecl("SumReduce", Group.REDUCE, 1, ("axis",))
    MAX_REDUCE = OpDecl("MaxReduce", Group.REDUCE, 1, ("axis",))
    SOFTMAX = OpDecl("Softmax", Group.REDUCE, 1, ("axis",))
    GATHER = OpDecl("Gather", Group.INDEXING, 2, ())    # (table (V, ...), indices) -> table[indices]
    SCATTER = OpDecl("Scatter", Group.INDEXING, 3, ())  # (dest, src, indices) -> dest with rows replaced
    CUSTOM = OpDecl("Custom", Group.CUSTOM, -1, ("kind",))
    OUTPUT = OpDecl("Output", Group.OUTPUT, 1, ("name",))

    @property
    def decl(self) -> OpDecl:
        return self.value

    @property
    def group(self) -> Group:
        return self.value.group

    def __repr__(self) -> str:
        return self.value.name


# Op groups are tuples in declaration order, never sets: egglog numbers e-classes in the order
# constructors and rules are declared, and a set's order changes with PYTHONHASHSEED (a plan's
# recorded e-class ids must mean the same thing in every process).
UNARY_OPS = tuple(o for o in Op if o.group is Group.UNARY)
BINARY_OPS = tuple(o for o in Op if o.group is Group.BINARY)
ELEMENTWISE_OPS = UNARY_OPS + BINARY_OPS + (Op.CAST,)
REDUCE_OPS = tuple(o for o in Op if o.group is Group.REDUCE)


@dataclass(frozen=True)
class CustomKind:
    """An elementwise function that is not a primop (erf for exact GELU): FP64 reference + CUDA name."""

    name: str
    fn: Callable[[np.ndarray], np.ndarray]
    cuda_fn: str  # single-precision CUDA math function of the same name family
    derivative_bound: Callable[[float, float], float]  # max |f'| over [lo, hi], for error propagation


def _erf_deriv(lo: float, hi: float) -> float:
    x = 0.0 if lo <= 0.0 <= hi else min(abs(lo), abs(hi))
    return float(2.0 / np.sqrt(np.pi) * np.exp(-x * x))


def _tanh_deriv(lo: float, hi: float) -> float:
    x = 0.0 if lo <= 0.0 <= hi else min(abs(lo), abs(hi))
    return float(1.0 - np.tanh(x) ** 2)


CUSTOM_KINDS: dict[str, CustomKind] = {
    k.name: k for k in (
        CustomKind("erf", scipy.special.erf, "erff", _erf_deriv),
        CustomKind("tanh", np.tanh, "tanhf", _tanh_deriv),
    )
}
