"""A ROWS kernel as the unfused kernels it stands for (one SUM per row sum, one ELEMENTWISE per value
read through a view, the tail), so analyses written for kernel chains apply to it unchanged.

Why it is exact: the row-fusion rules (search/rules/fuse_rows.py) keep every rounding of the chain
(a row sum is stored as its SUM kernel would store it; a value read through FAt is rounded as its
kernel would store it), so the fused kernel and this program compute the same values.
"""
from __future__ import annotations

from typing import Sequence

from ..dtypes.formats import F32
from ..hlir.shape import ShapeTracker
from .llir import FApply, FAt, FConstV, FExpr, FLoad, FRoundTo, FRowSum, Kernel, KernelInput, KernelKind, Program


def is_row_view(st: ShapeTracker) -> bool:
    """A read whose value is the same along the reader's last axis (so once per row of a row kernel)."""
    view = st.views[-1]
    return len(st.views) == 1 and view.mask is None and bool(view.shape) and view.strides[-1] == 0


class _Unfuse:
    def __init__(self, k: Kernel, sources: Sequence[Kernel]):
        self.k = k
        self.kernels: list[Kernel] = []
        self.ext: dict[int, int] = {}  # buffer id -> EXTERNAL kernel id here
        self.made: dict[tuple, int] = {}  # a materialised value -> its kernel: one per distinct value, as unfused
        for src in sources:
            if src.id not in self.ext:
                self.ext[src.id] = self._add(kind=KernelKind.EXTERNAL, inputs=(), shape=src.shape, dtype=src.dtype,
                                             external=f"%{src.id}", label=src.label)

    def _add(self, **kw) -> int:
        self.kernels.append(Kernel(id=len(self.kernels), chunk=self.k.chunk, **kw))
        return len(self.kernels) - 1

    def _slot(self, ki: KernelInput, inputs: list[KernelInput]) -> FLoad:
        if ki not in inputs:
            inputs.append(ki)
        return FLoad(inputs.index(ki))

    def expr(self, e: FExpr, inputs: list[KernelInput]) -> FExpr:
        """`e` as the body of a kernel whose inputs are `inputs` (row sums and FAt values materialised)."""
        if isinstance(e, FLoad):
            inp = self.k.inputs[e.slot]
            return self._slot(KernelInput(self.ext[inp.buffer], inp.view), inputs)
        if isinstance(e, FRoundTo):
            return FRoundTo(self.expr(e.x, inputs), e.fmt, e.origin)
        if isinstance(e, FApply):
            return FApply(e.op, tuple(self.expr(a, inputs) for a in e.args), e.kind)
        if isinstance(e, FRowSum):
            buf = self._sum(e)
            return self._slot(KernelInput(buf, ShapeTracker.contiguous(e.shape[:-1])), inputs)
        if isinstance(e, FAt):
            key = (e.x, tuple(e.src_shape))
            if key not in self.made:
                self.made[key] = self._sum(e.x) if isinstance(e.x, FRowSum) else self._elementwise(e.x, e.src_shape, F32)
            return self._slot(KernelInput(self.made[key], e.view), inputs)
        if isinstance(e, FConstV):
            return e
        raise TypeError(f"not a body expression: {e!r}")

    def _sum(self, e: FRowSum) -> int:
        if e in self.made:
            return self.made[e]
        inputs: list[KernelInput] = []
        body = self.expr(e.body, inputs)
        axis = len(e.shape) - 1
        self.made[e] = self._add(kind=KernelKind.SUM, inputs=tuple(inputs), shape=tuple(e.shape[:-1]), dtype=e.dt,
                                 body=body, body_shape=tuple(e.shape), axis=axis, acc=e.acc,
                                 label=f"{self.k.label} (row sum)")
        return self.made[e]

    def _elementwise(self, e: FExpr, shape, dtype) -> int:
        inputs: list[KernelInput] = []
        body = self.expr(e, inputs)
        return self._add(kind=KernelKind.ELEMENTWISE, inputs=tuple(inputs), shape=tuple(shape), dtype=dtype,
                         body=body, body_shape=tuple(shape), label=self.k.label)


def row_sums(e: FExpr | None) -> list[FRowSum]:
    """Every row sum in a body (outermost first)."""
    if isinstance(e, FRowSum):
        return [e, *row_sums(e.body)]
    if isinstance(e, (FRoundTo, FAt)):
        return row_sums(e.x)
    if isinstance(e, FApply):
        return [s for a in e.args for s in row_sums(a)]
    return []


def unfused(k: Kernel, sources: Sequence[Kernel]) -> tuple[Program, dict[int, int]]:
    """(the program, buffer id -> its EXTERNAL kernel there); its output is the ROWS kernel's value (a
    computed scatter's source rows).
    `sources`: the kernels producing k's inputs."""
    if k.kind not in (KernelKind.ROWS, KernelKind.SCATTER_EW):
        raise ValueError(f"kernel {k.id} is {k.kind.value}: only row kernels and computed scatters have a body "
                         "standing for other kernels")
    u = _Unfuse(k, sources)
    # a computed scatter's body is its source rows, held in FP32 (the body's own rounding is exact there)
    out = u._elementwise(k.body, k.body_shape, k.dtype if k.kind is KernelKind.ROWS else F32)
    inputs = tuple((f"%{b}", kid) for b, kid in u.ext.items())
    return Program(tuple(u.kernels), inputs, (("out", out),)), dict(u.ext)
