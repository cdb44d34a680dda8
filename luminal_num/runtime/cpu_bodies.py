"""The CPU backend's evaluation of fused bodies (ELEMENTWISE, reductions, Gemm epilogues, ROWS).

Every op of a body is one correctly rounded FP32 operation. add, mul, recip, sqrt, fmod and compare
are computed in numpy float32, which IEEE makes correctly rounded (the same value as float64 then one
rounding); exp2/log2/sin/tanh are not correctly rounded in float32, so they stay float64 + one
rounding. A body whose loads are wider than FP32 (int64 indices, f64) takes the float64 path.

A value is computed once per run: a subexpression twice in one body (GELU's bias add, a layer norm's
centred input) or again in a later kernel over the same buffers (fusion recomputes a layer norm's mean
and variance in the kernels that read them), kept in the run's `shared` values under a key that names
what it computes (loads as buffer and view).
"""
from __future__ import annotations

import numpy as np

from ..codegen.llir import FApply, FAt, FConstV, FExpr, FLoad, FRoundTo, FRowSum, Kernel
from ..dtypes.formats import F32, Format, Kind
from ..dtypes.rounding import Overflow, round_to, store
from ..hlir.ops import CUSTOM_KINDS, Op
from ..hlir.symbolic import evaluate as eval_dim
from .cpu_compiled import Step, body_constant, read_view
from .numerics import emulate_reduce_sum

# Ops whose float32 numpy result equals the float64 result rounded once to FP32 (IEEE: correctly
# rounded, and double rounding through float64 is innocuous for p' >= 2p + 2); the rest are computed
# in float64 and rounded once. Keyed by every elementwise Op (a test checks the coverage).
CORRECTLY_ROUNDED_F32: dict[Op, bool] = {
    Op.EXP2: False, Op.LOG2: False, Op.SIN: False,  # libm-style approximations, not correctly rounded
    Op.RECIP: True, Op.SQRT: True, Op.ADD: True, Op.MUL: True,
    Op.MOD: True,        # fmod is exact
    Op.LESS_THAN: True,  # exact 0 / 1
    Op.CUSTOM: False,    # decided per kind by F32_EXACT_CUSTOM
}
# Custom kinds whose float32 loop gives exactly float32(fn(float64(x))) on all 2^32 float32 inputs.
# erf: scipy's float32 loop is xsf::erf(float) = erf(static_cast<double>(x)) rounded on return, the
# identity by construction; bench/erf_f32.py checked every input (reports/bench/erf_f32.csv). tanh:
# numpy's float32 tanh is its own SIMD approximation and differs on many inputs, so float64 it stays.
F32_EXACT_CUSTOM: dict[str, bool] = {"erf": True, "tanh": False}

# bytes of fused-body values a run keeps for later kernels (least recently used dropped): enough for a
# layer norm's values to outlive the Gemm epilogue between it and its recomputation
SHARED_BYTES = 64 << 20


def store32(x, fmt: Format) -> np.ndarray:
    """store(x, fmt) kept in float32 where fmt fits it (same values; float64 stays float64, except that
    an FP32 store of it is numpy's one IEEE conversion to float32, as store itself does it)."""
    x = np.asarray(x)
    if fmt is F32 and x.dtype == np.float64:
        return x.astype(np.float32)
    if fmt.kind is not Kind.FLOAT or fmt.name == "f64" or x.dtype != np.float32:
        return store(x, fmt)
    if fmt is F32:
        return x
    return round_to(x, fmt, Overflow.SATURATE if fmt.bits <= 8 else Overflow.INF)  # store's policy, from float32


def reduce_sum(vals: np.ndarray, axis: int, acc: Format | None) -> np.ndarray:
    """Sum with the accumulator's rounding: FP32 -> numpy float32 (pairwise), others emulated."""
    if acc is None or acc is F32:
        # pairwise blocks follow the memory layout: a C-contiguous float32 array is summed as it lies,
        # anything else as its float32 copy (the layout astype gives it)
        contiguous = isinstance(vals, np.ndarray) and vals.dtype == np.float32 and vals.flags.c_contiguous
        return np.sum(vals if contiguous else vals.astype(np.float32), axis=axis)
    if acc.name == "f64":
        return np.sum(np.asarray(vals, dtype=np.float64), axis=axis)
    return np.asarray(emulate_reduce_sum(vals, axis, acc), dtype=np.float32)


# -- reading inputs ---------------------------------------------------------------------------------
def read_input(k: Kernel, i: int, state) -> np.ndarray:
    """Input i over the kernel's iteration space, in its storage dtype (a strided view where possible)."""
    inp = k.inputs[i]
    return read_view(inp.view, state.compiled.read(k, i, state.bindings), state.stored[inp.buffer], state.bindings)


def read64(k: Kernel, i: int, state) -> np.ndarray:
    return read_input(k, i, state).astype(np.float64)


def _fits_f32(buffer: np.ndarray) -> bool:
    """Whether every value of the buffer is exactly a float32 (narrow floats widen exactly)."""
    return buffer.dtype.itemsize <= 4 and buffer.dtype.kind not in "biu" or buffer.dtype.itemsize <= 2


def fits_body(k: Kernel, state) -> bool:
    loads = state.compiled.body(k.body, k, state.bindings).loads
    return all(_fits_f32(state.stored[k.inputs[i].buffer]) for i in loads)


# -- the float64 path -------------------------------------------------------------------------------
def _apply(e: FApply, args):
    return CUSTOM_KINDS[e.kind].fn(*args) if e.op is Op.CUSTOM else e.op.decl.fn(*args)


def body64(e: FExpr, k: Kernel, state) -> np.ndarray:
    """A fused body exactly: each op in float64, rounded once to FP32 (kept as float64)."""
    if isinstance(e, FLoad):
        return read64(k, e.slot, state)
    if isinstance(e, FConstV):
        return store(np.asarray(body_constant(e, state.bindings)), F32)
    if isinstance(e, FRoundTo):
        return store(body64(e.x, k, state), e.fmt)
    return store(_apply(e, [body64(a, k, state) for a in e.args]), F32)


def rows64(e: FExpr, k: Kernel, state) -> np.ndarray:
    """A ROWS body (codegen/llir.py FRowSum, FAt) on the float64 path: exactly the values of the
    unfused kernels. A row sum is the SUM kernel's (its body, accumulator, stored rounding); FAt reads
    a value as a load reads the buffer it would have been stored in."""
    if isinstance(e, FRowSum):
        shape = tuple(eval_dim(d, state.bindings) for d in e.shape)
        vals = np.broadcast_to(rows64(e.body, k, state), shape)
        return store32(reduce_sum(vals, len(shape) - 1, e.acc), e.dt).astype(np.float64)
    if isinstance(e, FAt):
        src = tuple(eval_dim(d, state.bindings) for d in e.src_shape)
        return e.view.realize(np.ascontiguousarray(np.broadcast_to(rows64(e.x, k, state), src)), state.bindings)
    if isinstance(e, FApply):
        return store(_apply(e, [rows64(a, k, state) for a in e.args]), F32)
    if isinstance(e, FRoundTo):
        return store(rows64(e.x, k, state), e.fmt)
    return body64(e, k, state)


# -- the float32 path -------------------------------------------------------------------------------
def _exact_in_f32(e: FApply) -> bool:
    return F32_EXACT_CUSTOM[e.kind] if e.op is Op.CUSTOM else CORRECTLY_ROUNDED_F32[e.op]


def body32(e: FExpr, k: Kernel, state, out: np.ndarray | None = None):
    """The same values as body64 (rows64 for row sums and FAt), in float32: correctly rounded ops
    natively, the others via float64. Values are shared within the run (state.shared), so never
    mutated. `out`: the kernel's FP32 output buffer, where the body's last op (an exact ufunc, see
    body_into_out) writes its value (noted as the buffer's value for the kernels reading it)."""
    steps = state.compiled.body(e, k, state.bindings).steps
    if out is not None:
        state.compiled.note_stored(k.id, steps[-1].key, out.shape, state.bindings)
    vals: list = [None] * len(steps)
    last = len(steps) - 1
    stored, bindings, shared = state.stored, state.bindings, state.shared
    for i, st in enumerate(steps):
        node = st.node
        if isinstance(node, FLoad):
            inp = k.inputs[node.slot]
            x = read_view(inp.view, st.read, stored[inp.buffer], bindings)
            vals[i] = x if x.dtype == np.float32 else x.astype(np.float32)
            continue
        if isinstance(node, FConstV):
            vals[i] = st.const
            continue
        v = shared.get(st.key)
        if v is None:
            args = [vals[a] for a in st.args]
            if i == last and out is not None:
                _ufunc(node)(*args, out=out)
                return out
            v = _compute32(st, args, bindings)
            shared.put(st.key, v, v.nbytes)
        vals[i] = v
    if out is not None:
        np.copyto(out, vals[last])
        return out
    return vals[last]


def _compute32(st: Step, args: list, bindings):
    e = st.node
    if isinstance(e, FRoundTo):
        return store32(np.asarray(args[0], dtype=np.float32), e.fmt)
    if isinstance(e, FRowSum):
        summed = store32(reduce_sum(_spread(args[0], st.shape), len(st.shape) - 1, e.acc), e.dt)
        return np.asarray(summed, dtype=np.float32)
    if isinstance(e, FAt):
        return read_view(e.view, st.read, np.ascontiguousarray(_spread(args[0], st.shape)), bindings)
    if not _exact_in_f32(e):
        args = [np.asarray(a, dtype=np.float64) for a in args]
    out = np.asarray(_apply(e, args))
    return out if out.dtype == np.float32 else out.astype(np.float32)


def _spread(x, shape: tuple[int, ...]):
    """x broadcast to shape (np.broadcast_to costs ~10 us; an array already of that shape is itself)."""
    return x if isinstance(x, np.ndarray) and x.shape == shape else np.broadcast_to(x, shape)


def _ufunc(e: FApply):
    return CUSTOM_KINDS[e.kind].fn if e.op is Op.CUSTOM else e.op.decl.fn


def body_values(k: Kernel, state) -> np.ndarray:
    """The body over its iteration space: float32 when every load fits FP32, else float64 (same values)."""
    if fits_body(k, state):
        return np.asarray(body32(k.body, k, state), dtype=np.float32)
    return body64(k.body, k, state)


def rows_values(k: Kernel, state) -> np.ndarray:
    """A ROWS (or computed scatter) body: float32 when every load fits FP32, else float64 (same values)."""
    if fits_body(k, state):
        return np.asarray(body32(k.body, k, state), dtype=np.float32)
    return rows64(k.body, k, state)


def body_into_out(k: Kernel, state) -> bool:
    """Evaluate an FP32 body whose last op is a correctly rounded ufunc straight into the kernel's output
    buffer (state.out, broadcasting the operands to it); False (nothing written) for any other body.
    The last value is not shared: the buffer is overwritten once it dies."""
    e = k.body
    if not (k.dtype is F32 and isinstance(e, FApply) and _exact_in_f32(e)):
        return False
    if not isinstance(_ufunc(e), np.ufunc) or not fits_body(k, state):
        return False
    body32(e, k, state, out=state.out)
    return True
