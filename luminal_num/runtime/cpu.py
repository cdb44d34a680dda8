"""The CPU backend: executes LLIR with numpy, each buffer stored in its plan dtype.

It is the reference executor of the numerics gate: elementwise ops are computed exactly (float64)
and rounded once to FP32 (a correctly rounded FP32 unit); stores round to the buffer's format;
Gemm and reduction variants are emulated bit-exactly by runtime/numerics.py. A QUANTIZE kernel
stores q in its format and keeps the scales beside it (per run, keyed by its kernel id); a Gemm
reading its buffer multiplies q with those scales, as the GPU does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..codegen.llir import FApply, FConstV, FExpr, FLoad, FRoundTo, Kernel, KernelKind, Program
from ..dtypes.formats import F32, Format, Kind, get as get_format
from ..dtypes.rounding import store
from ..hlir.evaluate import softmax
from ..hlir.gemm import gemm_apply, gemm_operand_a
from ..hlir.ops import CUSTOM_KINDS, Op
from ..hlir.symbolic import bind_shapes, evaluate as eval_dim
from ..quant import quantize_tensor
from ..quant.stored import stored_key, widened
from .buffers import BufferPlan, plan_buffers


@dataclass(frozen=True)
class RunResult:
    outputs: dict[str, np.ndarray]                 # float64 copies of the stored values
    kernel_seconds: tuple[tuple[int, float], ...]  # (kernel id, seconds) for launched kernels
    plan: BufferPlan
    exports: dict[int, np.ndarray] | None = None   # graph node id -> value (when asked for)

    @property
    def total_seconds(self) -> float:
        return sum(s for _, s in self.kernel_seconds)


def _round(x: np.ndarray, fmt: Format) -> np.ndarray:
    """Values of x rounded to fmt (as float64); integers pass through."""
    return store(x, fmt)


def bind_program(program: Program, inputs: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Symbolic dims from the shapes of the program's inputs (the same rule as Graph.bind_symbols)."""
    declared = {name: program.kernels[kid].shape for name, kid in program.inputs}
    return bind_shapes(declared, {n: np.shape(a) for n, a in inputs.items()})


class CpuRuntime:
    def __init__(self, program: Program, weights: Mapping[str, np.ndarray] | None = None,
                 static_scales: Mapping[int, np.ndarray] | None = None, stored_weights: Mapping | None = None):
        """`static_scales`: Gemm kernel id -> B's compile-time scales (a plan's scales file); without
        them static scales are computed from the weights, which gives the same values."""
        self.program = program
        self.weights = dict(weights or {})
        self.static_scales = dict(static_scales or {})
        self.stored_weights = dict(stored_weights or {})  # stored_key -> StoredTensor (a plan's weights file)

    def run(self, inputs: Mapping[str, np.ndarray], bindings: Mapping[str, int] | None = None,
            keep_exports: bool = False) -> RunResult:
        feed = {**self.weights, **inputs}
        missing = [n for n, _ in self.program.inputs if n not in feed]
        if missing:
            raise KeyError(f"missing inputs: {missing}")
        bindings = {**bind_program(self.program, feed), **(bindings or {})}
        plan = plan_buffers(self.program, bindings)
        slots = [np.empty(n, dtype=np.uint8) for n in plan.slot_bytes]
        stored: dict[int, np.ndarray] = {}
        scales: dict[int, np.ndarray] = {}  # QUANTIZE kernel id -> the scales beside its buffer
        timings = []
        wanted = {kid: nid for nid, kid in self.program.exports} if keep_exports else {}
        exports: dict[int, np.ndarray] = {}
        for k in self.program.kernels:
            t0 = time.perf_counter()
            value = self._execute(k, stored, scales, feed, bindings)
            shape = tuple(eval_dim(d, bindings) for d in k.shape)
            buf = slots[plan.slot_of[k.id]][: max(int(np.prod(shape, dtype=np.int64)) * k.dtype.storage.itemsize, 0)]
            arr = buf.view(k.dtype.storage).reshape(shape)
            np.copyto(arr, np.asarray(value).astype(k.dtype.storage) if k.dtype.kind is Kind.FLOAT
                      else np.asarray(value).astype(k.dtype.storage), casting="unsafe")
            stored[k.id] = arr
            for nid, kid in self.program.exports if k.id in wanted else ():
                if kid == k.id:
                    exports[nid] = arr.astype(np.float64)  # copied now: the slot may be reused later
            if k.kind.launches:
                timings.append((k.id, time.perf_counter() - t0))
        outputs = {name: stored[kid].astype(np.float64) for name, kid in self.program.outputs}
        return RunResult(outputs, tuple(timings), plan, exports if keep_exports else None)

    # -- kernels --------------------------------------------------------------------------------
    def _read(self, k: Kernel, i: int, stored, bindings) -> np.ndarray:
        inp = k.inputs[i]
        return realize(inp.view, stored[inp.buffer], bindings).astype(np.float64)

    def _execute(self, k: Kernel, stored, scales, feed, bindings) -> np.ndarray:
        kind = k.kind
        if kind is KernelKind.EXTERNAL:
            val = np.asarray(feed[k.external])
            if k.storage is not None:  # a weight held in its storage format: readers see it widened
                return widened(val, k.storage, self.stored_weights.get(stored_key(k.external, k.storage)))
            if k.dtype.kind is Kind.FLOAT and not np.all(np.isfinite(val)):
                raise ValueError(f"input {k.external!r} contains NaN or Inf")
            return _round(val.astype(np.float64), k.dtype) if k.dtype.kind is Kind.FLOAT else val
        if kind is KernelKind.CONST:
            v = k.value if isinstance(k.value, float) else float(eval_dim(k.value, bindings))
            return _round(np.asarray(v), k.dtype)
        if kind is KernelKind.IOTA:
            return _round(np.arange(eval_dim(k.value, bindings), dtype=np.float64), k.dtype)
        if kind is KernelKind.ELEMENTWISE:
            return _round(self._body(k.body, k, stored, bindings), k.dtype)
        if kind is KernelKind.SUM:
            vals = self._body(k.body, k, stored, bindings)
            return _round(reduce_sum(vals, k.axis, k.acc), k.dtype)
        if kind is KernelKind.MAX:
            return _round(np.max(self._body(k.body, k, stored, bindings), axis=k.axis), k.dtype)
        if kind is KernelKind.SOFTMAX:
            x = self._body(k.body, k, stored, bindings)
            compute = None if k.precision in (None, "f32") else get_format(k.precision)
            with np.errstate(all="ignore"):
                if compute is None:
                    return _round(softmax(x, k.axis), k.dtype)
                # a low-precision softmax: inputs and result rounded to the compute format
                return _round(_round(softmax(_round(x, compute), k.axis), compute), k.dtype)
        if kind is KernelKind.QUANTIZE:
            quantized = run_quantize(k, stored, bindings)
            scales[k.id] = quantized.scales
            return quantized.values
        if kind is KernelKind.GEMM:
            a_scales = scales[k.inputs[0].buffer] if self.program.quantized_inputs(k)[0] else None
            return _round(run_gemm(k, stored, bindings, self.static_scales.get(k.id), a_scales), k.dtype)
        if kind is KernelKind.GATHER:
            table = self._read(k, 0, stored, bindings)
            idx = k.inputs[1].view.realize(stored[k.inputs[1].buffer], bindings).astype(np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= table.shape[0]):
                raise IndexError(f"gather: index out of range [0, {table.shape[0]})")
            return table[idx]
        if kind in (KernelKind.SCATTER, KernelKind.SCATTER_NOCOPY):
            dest = self._read(k, 0, stored, bindings)
            src = self._read(k, 1, stored, bindings)
            idx = k.inputs[2].view.realize(stored[k.inputs[2].buffer], bindings).astype(np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= dest.shape[0]):
                raise IndexError(f"scatter: index out of range [0, {dest.shape[0]})")
            dest[idx] = src
            return dest
        raise AssertionError(f"unhandled kernel kind {kind}")  # every KernelKind is handled above

    def _body(self, e: FExpr, k: Kernel, stored, bindings) -> np.ndarray:
        """Evaluate a fused body: exact op in float64, rounded once to FP32 per op."""
        if isinstance(e, FLoad):
            return self._read(k, e.slot, stored, bindings)
        if isinstance(e, FConstV):
            v = e.value if isinstance(e.value, float) else float(eval_dim(e.value, bindings))
            return _round(np.asarray(v), F32)
        if isinstance(e, FRoundTo):
            return _round(self._body(e.x, k, stored, bindings), e.fmt)
        args = [self._body(a, k, stored, bindings) for a in e.args]
        with np.errstate(all="ignore"):
            fn = CUSTOM_KINDS[e.kind].fn if e.op is Op.CUSTOM else e.op.decl.fn
            return _round(fn(*args), F32)


def reduce_sum(vals: np.ndarray, axis: int, acc: Format | None) -> np.ndarray:
    """Sum with the accumulator's rounding: FP32 -> numpy float32 (pairwise), others emulated."""
    if acc is None or acc is F32:
        return np.sum(vals.astype(np.float32), axis=axis).astype(np.float64)
    if acc.name == "f64":
        return np.sum(vals, axis=axis)
    from .numerics import emulate_reduce_sum
    return np.asarray(emulate_reduce_sum(vals, axis, acc), dtype=np.float64)


def realize(view, buffer: np.ndarray, bindings) -> np.ndarray:
    """view.realize(buffer); one-byte ml_dtypes floats (fp8) are read through their bytes, because
    numpy's strided views cannot describe those dtypes (their array interface says '<f1')."""
    if buffer.dtype.itemsize == 1 and buffer.dtype.kind not in "biu":
        return view.realize(buffer.view(np.uint8), bindings).view(buffer.dtype)
    return view.realize(buffer, bindings)


def _operand(k: Kernel, i: int, stored, bindings) -> np.ndarray:
    """A Gemm operand over the full Mul shape as a strided view of its buffer (no broadcast copies)."""
    inp = k.inputs[i]
    return realize(inp.view, stored[inp.buffer], bindings)


def run_quantize(k: Kernel, stored, bindings):
    """A QUANTIZE kernel: its Gemm's A operand as (batch, M, K), quantized with scales from itself."""
    a = gemm_operand_a(_operand(k, 0, stored, bindings), k.layout).astype(np.float32)
    return quantize_tensor(a, k.dtype, k.scale_spec)


def run_gemm(k: Kernel, stored, bindings, b_scales: np.ndarray | None = None,
             a_scales: np.ndarray | None = None) -> np.ndarray:
    """a_scales: given when input 0 is a QUANTIZE kernel's q (its side output); else A is raw."""
    a, b = _operand(k, 0, stored, bindings), _operand(k, 1, stored, bindings)
    if k.precision in (None, "f32"):
        def mm(x, y):
            return np.matmul(x.astype(np.float32), y.astype(np.float32))
    else:
        from ..dtypes.variants import GEMM_VARIANTS
        from .numerics import emulate_gemm

        def mm(x, y):
            raw, quantized = (None, (x, a_scales)) if a_scales is not None else (x.astype(np.float32), None)
            return emulate_gemm(raw, y.astype(np.float32), GEMM_VARIANTS[k.precision], b_scales=b_scales,
                                a_quantized=quantized)
    return np.asarray(gemm_apply(a, b, k.layout, mm), dtype=np.float64)
