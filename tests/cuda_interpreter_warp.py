"""Warp-collective operations for the CUDA interpreter (tests/cuda_interpreter.py): WMMA fragments and the
lock-step driver that runs a block's threads between __syncthreads() and its warps' collective calls.

Each thread is a generator. It yields None at __syncthreads() and a `WarpOp` at a warp-collective call
(wmma::fill_fragment / load_matrix_sync / mma_sync / store_matrix_sync, __syncwarp). The driver (`launch`)
runs every thread to its next yield; a warp whose 32 lanes all wait at the same collective call (same
operation, same fragments, same addresses) has it executed once and its lanes resumed; when every live
thread waits at the barrier, all are released. Lanes that disagree, or a warp split between a collective
call and the barrier, are an error (undefined behaviour on a GPU).

A fragment belongs to its warp (`fragment()` returns the warp's object for the declared name): its layout
over the lanes is unspecified in CUDA, so it is held here as the whole matrix. Each operation is given its
meaning independently of the code generator:
- load: the matrix from memory (A row-major, B column-major, `ldm` elements apart), every element checked
  to be a value of the fragment's element type (F16, BF16, TF32, int8): the kernel must stage exact values;
- mma (floating point): each product in FP32 (exact for these types), added into the FP32 accumulator
  in K order, one numpy float32 rounding per add; (int8) exact integer sums, wrapped to int32;
- store: the accumulator row-major into memory, `ldm` elements apart.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import numpy as np

from luminal_num.dtypes.formats import BF16, F16, TF32
from luminal_num.dtypes.rounding import Overflow, round_to

WARP = 32


@dataclass(frozen=True)
class Dim3:
    x: int
    y: int
    z: int


@dataclass(frozen=True)
class Pointer:
    """`array + offset`: an address into a __shared__ array (pointer arithmetic on its name)."""

    array: np.ndarray
    offset: int

    def key(self) -> tuple[int, int]:
        return id(self.array), self.offset


ELEMENT_FORMATS = {"__half": F16, "__nv_bfloat16": BF16, "wmma::precision::tf32": TF32}


class Fragment:
    """One warp's WMMA fragment: `use` (matrix_a / matrix_b / accumulator), shape, element type, values."""

    def __init__(self, use: str, m: int, n: int, k: int, element: str, layout: str | None):
        self.use, self.m, self.n, self.k, self.element, self.layout = use, m, n, k, element, layout
        rows, cols = {"matrix_a": (m, k), "matrix_b": (k, n), "accumulator": (m, n)}[use]
        self.values = np.full((rows, cols), np.nan) if element != "int" else np.zeros((rows, cols), np.int64)
        self.loaded = False

    @property
    def integer(self) -> bool:
        return self.element in ("int", "signed char")


def fragment(warp: dict, name: str, spec: list[str]) -> Fragment:
    """The warp's fragment `name` declared as wmma::fragment<spec...> (the same object for all its lanes)."""
    use, m, n, k, element = spec[0].removeprefix("wmma::"), int(spec[1]), int(spec[2]), int(spec[3]), spec[4]
    layout = spec[5].removeprefix("wmma::") if len(spec) > 5 else None
    frag = warp.get(name)
    if frag is None or (frag.use, frag.m, frag.n, frag.k, frag.element, frag.layout) != (use, m, n, k, element, layout):
        frag = warp[name] = Fragment(use, m, n, k, element, layout)
    return frag


@dataclass(frozen=True)
class WarpOp:
    """A lane's request at a warp-collective call."""

    name: str
    args: tuple

    def key(self) -> tuple:
        return (self.name,) + tuple(a.key() if isinstance(a, Pointer) else id(a) if isinstance(a, Fragment) else a
                                    for a in self.args)


def float_to_tf32(x) -> np.float32:
    """wmma::__float_to_tf32 (cvt.rna.tf32.f32): 10 stored mantissa bits, ties away from zero (half a step
    added to the magnitude's bits, the 13 low bits cleared)."""
    x = np.float32(x)
    if not np.isfinite(x):
        return x
    bits = (int(np.array([x]).view(np.uint32)[0]) + 0x1000) & ~0x1FFF
    return np.array([bits & 0xFFFFFFFF], np.uint32).view(np.float32)[0]


def _check_element(frag: Fragment, values: np.ndarray) -> None:
    if frag.integer:
        ok = np.all((values == np.round(values)) & (values >= -128) & (values <= 127))
    else:
        fmt = ELEMENT_FORMATS[frag.element]
        ok = np.array_equal(round_to(values.astype(np.float32), fmt, Overflow.INF).astype(np.float64), values)
    if not ok:
        raise ValueError(f"load_matrix_sync: staged values are not {frag.element} values")


def _load(frag: Fragment, ptr: Pointer, ldm: int) -> None:
    rows, cols = frag.values.shape
    if frag.use == "accumulator" or (frag.use == "matrix_a") != (frag.layout == "row_major"):
        raise ValueError(f"load_matrix_sync: {frag.use} {frag.layout} is not modelled")
    flat = ptr.array.reshape(-1)
    if frag.use == "matrix_a":  # element (r, c) at r * ldm + c
        index = ptr.offset + np.arange(rows)[:, None] * ldm + np.arange(cols)[None, :]
    else:  # column-major B: element (k, n) at n * ldm + k
        index = ptr.offset + np.arange(cols)[None, :] * ldm + np.arange(rows)[:, None]
    if index.min() < 0 or index.max() >= flat.size:
        raise IndexError(f"load_matrix_sync reads past a {flat.size}-element array")
    values = flat[index].astype(np.float64)
    _check_element(frag, values)
    frag.values = values.astype(np.int64) if frag.integer else values
    frag.loaded = True


def _mma(d: Fragment, a: Fragment, b: Fragment, c: Fragment) -> None:
    if not (a.loaded and b.loaded and c.loaded):
        raise ValueError("mma_sync on a fragment that was never loaded or filled")
    if a.integer:
        total = c.values.astype(np.int64) + a.values.astype(np.int64) @ b.values.astype(np.int64)
        d.values = ((total + 2 ** 31) % 2 ** 32) - 2 ** 31  # the int32 accumulator wraps
    else:
        acc = c.values.astype(np.float32)
        av, bv = a.values.astype(np.float32), b.values.astype(np.float32)
        with np.errstate(all="ignore"):
            for k in range(av.shape[1]):
                acc = acc + av[:, k:k + 1] * bv[k:k + 1, :]  # FP32 products (exact here), one FP32 add each
        d.values = acc.astype(np.float64)
    d.loaded = True


def _store(ptr: Pointer, frag: Fragment, ldm: int, layout: str) -> None:
    if frag.use != "accumulator" or layout != "mem_row_major":
        raise ValueError(f"store_matrix_sync: {frag.use} {layout} is not modelled")
    rows, cols = frag.values.shape
    flat = ptr.array.reshape(-1)
    index = ptr.offset + np.arange(rows)[:, None] * ldm + np.arange(cols)[None, :]
    if index.min() < 0 or index.max() >= flat.size:
        raise IndexError(f"store_matrix_sync writes past a {flat.size}-element array")
    flat[index] = frag.values


def _fill(frag: Fragment, value) -> None:
    frag.values = np.full(frag.values.shape, value, dtype=frag.values.dtype)
    frag.loaded = True


def execute(op: WarpOp) -> None:
    """Run one warp-collective operation once for its warp."""
    if op.name == "syncwarp":
        return
    {"fill_fragment": _fill, "load_matrix_sync": lambda f, p, ldm: _load(f, p, int(ldm)),
     "mma_sync": _mma, "store_matrix_sync": lambda p, f, ldm, layout: _store(p, f, int(ldm), layout)}[op.name](*op.args)


def launch(fn, args: dict, grid: tuple[int, int, int], block: tuple[int, int, int]) -> None:
    """Every block of the grid; a block's threads in lock step between __syncthreads() and warp calls."""
    threads_per_block = block[0] * block[1] * block[2]
    for bz in range(grid[2]):
        for by in range(grid[1]):
            for bx in range(grid[0]):
                shared: dict = {}
                warps = [dict() for _ in range(-(-threads_per_block // WARP))]
                threads = [fn(**args, blockIdx=Dim3(bx, by, bz), threadIdx=Dim3(tx, ty, tz), blockDim=Dim3(*block),
                              gridDim=Dim3(*grid), _shared=shared,
                              _warp=warps[(tx + block[0] * (ty + block[1] * tz)) // WARP])
                           for tz in range(block[2]) for ty in range(block[1]) for tx in range(block[0])]
                if not isinstance(threads[0], types.GeneratorType):
                    raise ValueError("launch() runs kernels that synchronise; call the others directly")
                _run_block(threads)


_DONE = object()


def _run_block(threads: list) -> None:
    waiting: list = [None] * len(threads)  # per thread: None (runnable), "barrier", a WarpOp, or _DONE
    runnable = list(range(len(threads)))
    while True:
        for t in runnable:
            try:
                waiting[t] = next(threads[t]) or "barrier"
            except StopIteration:
                waiting[t] = _DONE
        runnable = []
        for w in range(0, len(threads), WARP):
            lanes = range(w, min(w + WARP, len(threads)))
            ops = [waiting[t] for t in lanes if isinstance(waiting[t], WarpOp)]
            if not ops:
                continue
            if len(ops) != len(lanes) or len({op.key() for op in ops}) != 1:
                raise AssertionError(f"warp {w // WARP}: lanes diverge at a warp-collective call ({ops[0].name})")
            execute(ops[0])
            runnable += lanes
        if runnable:
            continue
        done = sum(1 for s in waiting if s is _DONE)
        if done == len(threads):
            return
        assert done == 0, "threads disagree on the number of __syncthreads()"
        runnable = list(range(len(threads)))  # every thread at the barrier: release them all
