"""LLIR: the kernel graph a backend executes. One `Kernel` per launch; fused bodies are `FExpr` trees.

Every kernel knows its output shape (symbolic), dtype, input views, bytes moved, flops, and whether
its output aliases an input buffer (in-place scatter). Shapes bind at run time.

Dynamic activation scales are a kernel of their own (QUANTIZE): it reads a Gemm's A operand through
the Gemm's view and writes it contiguous as (batch, M, K) in the variant's A format. Its scales are a
side output, not a second buffer: the LLIR keeps one output per kernel (liveness, aliasing and the
op table stay one buffer per id), and the scales are tiny (one float per tensor / token / block), so
each runtime keeps them beside the buffer, keyed by the QUANTIZE kernel's id; `scales_shape` says
their shape. There is no DEQUANTIZE kind: the only reader of quantized data is the Gemm, which
applies the scales itself exactly where its variant says (after each chunk, or per product), so a
kernel widening q * s back to values would change the arithmetic, not just move it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Mapping, Union

import numpy as np

from ..dtypes.formats import F32, Format
from ..dtypes.variants import GEMM_VARIANTS, ScaleSpec
from ..hlir.gemm import GemmLayout
from ..hlir.rotation import Rotation, rotation_value
from ..hlir.smoothing import Smoothing, smoothing_value
from ..hlir.store import WeightArray, derived_key, keyed
from ..hlir.weightcache import WEIGHTS
from ..hlir.ops import Op
from ..hlir.shape import ShapeTracker, View, contiguous_strides
from ..hlir.symbolic import Dim, evaluate, prod
from ..quant.scales import scale_shape
from ..quant.kv import is_kv_format
from ..quant.calibration import Fill
from ..quant.storage import STORAGE_FORMATS
from .attention import attention_flops, check_attention


class KernelKind(enum.Enum):
    EXTERNAL = "external"        # a graph input buffer (no launch)
    CONST = "const"
    IOTA = "iota"
    ELEMENTWISE = "elementwise"  # a fused chain of elementwise ops
    SUM = "sum"
    MAX = "max"
    SOFTMAX = "softmax"
    GEMM = "gemm"
    QUANTIZE = "quantize"        # a Gemm's A operand -> (batch, M, K) in its format, scales beside it
    GATHER = "gather"
    SCATTER = "scatter"
    SCATTER_NOCOPY = "scatter_nocopy"
    GEMM_EPILOGUE = "gemm_epilogue"  # a Gemm whose body (FAcc = the FP32 accumulator) runs before its one store
    ATTENTION = "attention"      # softmax(Q K^T * scale + bias) V in one kernel (codegen/attention.py)
    ROWS = "rows"                # one block per row: row sums (FRowSum) then an elementwise tail, one store
    SCATTER_EW = "scatter_ew"    # an in-place scatter whose source rows its body computes (RoPE + KV write)

    @property
    def launches(self) -> bool:
        return self is not KernelKind.EXTERNAL

    @property
    def is_gemm(self) -> bool:
        """A Gemm kernel (inputs A, B first; scales, variants and the cuBLAS geometry apply)."""
        return self in (KernelKind.GEMM, KernelKind.GEMM_EPILOGUE)

    @property
    def in_place(self) -> bool:
        """Overwrites its input 0 (the destination), writing only the scattered rows."""
        return self in (KernelKind.SCATTER_NOCOPY, KernelKind.SCATTER_EW)


# -- fused scalar bodies ------------------------------------------------------------------------
@dataclass(frozen=True)
class FLoad:
    slot: int  # index into Kernel.inputs


@dataclass(frozen=True)
class FConstV:
    value: object  # float or symbolic Dim


@dataclass(frozen=True)
class FRoundTo:
    x: "FExpr"
    fmt: Format
    origin: str = ""  # the HLIR op whose value is rounded (a fused low-precision producer), for messages


@dataclass(frozen=True)
class FApply:
    op: Op                      # a UNARY/BINARY primop, or Op.CUSTOM with `kind`
    args: tuple["FExpr", ...]
    kind: str | None = None


@dataclass(frozen=True)
class FAcc:
    """A GEMM_EPILOGUE body's read of its own FP32 accumulator at the output element (never stored).
    `view`: the accumulator (over the Gemm's output shape) read through this view instead, e.g. a
    GLU epilogue reading both column halves of one Gemm over [W_gate; W_up] (search/rules/fuse_gemm.py);
    the kernel's shape is then the body's, not the Gemm's."""
    view: ShapeTracker | None = None


@dataclass(frozen=True)
class FRowSum:
    """Inside a ROWS kernel: the sum of `body` (over its own space `shape`) along its last axis, with
    the accumulator `acc`, rounded once to `dt` (what a SUM kernel would have stored); its value lives
    on `shape` without that axis."""
    body: "FExpr"
    acc: Format
    dt: Format
    shape: tuple[Dim, ...]


@dataclass(frozen=True)
class FAt:
    """`x`, a value over `src_shape` (row-major), read through `view` (as a load reads a buffer).
    In a ROWS kernel `view` has stride 0 along the last axis, so the value is constant per row."""
    x: "FExpr"
    view: ShapeTracker
    src_shape: tuple[Dim, ...]


FExpr = Union[FLoad, FConstV, FRoundTo, FApply, FAcc, FRowSum, FAt]


def count_ops(e: FExpr) -> int:
    if isinstance(e, FApply):
        return 1 + sum(count_ops(a) for a in e.args)
    if isinstance(e, (FRoundTo, FAt)):
        return count_ops(e.x)
    if isinstance(e, FRowSum):
        return 1 + count_ops(e.body)
    return 0


@dataclass(frozen=True)
class KernelInput:
    buffer: int          # id of the producing kernel
    view: ShapeTracker   # how this kernel reads it


@dataclass(frozen=True)
class Kernel:
    id: int
    kind: KernelKind
    inputs: tuple[KernelInput, ...]
    shape: tuple[Dim, ...]
    dtype: Format
    body: FExpr | None = None          # ELEMENTWISE / SUM / MAX / SOFTMAX
    body_shape: tuple[Dim, ...] = ()   # iteration space of the body (un-reduced)
    axis: int | None = None
    acc: Format | None = None          # reduction accumulator
    precision: str | None = None       # Gemm variant name / softmax compute precision
    layout: GemmLayout | None = None
    aliases: int | None = None         # input index whose buffer the output overwrites
    chunk: int = -1
    external: str | None = None        # graph input name (EXTERNAL)
    value: object = None               # CONST value / IOTA length
    label: str = ""                    # where it came from (graph node), for op tables
    eclass: str = ""                   # provenance: the e-class (in its chunk's group space) it implements
    storage: str | None = None         # EXTERNAL weights: held in this StorageFormat, widened on load
    fill: str | None = None            # ... its codes chosen by this calibrated rounding (quant.calibration.Fill;
                                       # None: the format's round-to-nearest)
    concat: tuple[str, ...] = ()       # EXTERNAL: these weights concatenated (`external` names the result) ...
    concat_axis: int = 0               # ... along this axis
    rotation: Rotation | None = None   # EXTERNAL: a weight rotated along K (or H_b itself), hlir/rotation.py
    smoothing: Smoothing | None = None  # EXTERNAL: a weight smoothed along K (or the 2^-e vector), hlir/smoothing.py

    def numel(self, bindings: Mapping[str, int]) -> int:
        return int(evaluate(prod(self.shape), bindings)) if self.shape else 1

    @property
    def derived(self) -> bool:
        """An EXTERNAL whose value the compiler makes from named weights (external_value), not an input."""
        return bool(self.concat) or self.rotation is not None or self.smoothing is not None

    @property
    def weight_sources(self) -> tuple[str, ...]:
        """The graph inputs an EXTERNAL's value is made from: its concatenated parts, a rotated weight's
        source (none for H_b itself), else the input it names."""
        if self.rotation is not None:
            return () if self.rotation.source is None else (self.rotation.source,)
        if self.smoothing is not None:
            return () if self.smoothing.source is None else (self.smoothing.source,)
        return self.concat or ((self.external,) if self.external else ())

    # -- QUANTIZE: the scales kept beside the buffer ---------------------------------------------
    @property
    def scale_spec(self) -> ScaleSpec:
        """How a QUANTIZE kernel scales its operand: its Gemm variant's A scale."""
        if self.kind is not KernelKind.QUANTIZE:
            raise ValueError(f"kernel {self.id} is {self.kind.value}: only QUANTIZE kernels have scales")
        return GEMM_VARIANTS[self.precision].a_scale

    def scales_shape(self, bindings: Mapping[str, int]) -> tuple[int, ...]:
        """Shape of the scales beside a QUANTIZE kernel's (batch, M, K) buffer (luminal_num.quant)."""
        return scale_shape(self.scale_spec, tuple(evaluate(d, bindings) for d in self.shape))

    def scales_bytes(self, bindings: Mapping[str, int]) -> int:
        """Bytes of those scales: FP32 each (E8M0 scales too: kernels hold them unpacked as float)."""
        if self.kind is not KernelKind.QUANTIZE:
            return 0
        return int(np.prod(self.scales_shape(bindings), dtype=np.int64) * F32.itemsize)

    # -- cost ----------------------------------------------------------------------------------
    def stored_bytes_per_element(self, bindings: Mapping[str, int]) -> float:
        """Bytes one element of this buffer occupies in memory: its dtype, or its storage format's
        stored bytes (packed 4-bit is half a byte, scales and zero points at their stored size) spread
        over its elements."""
        if self.storage is None:
            return float(self.dtype.itemsize)
        shape = tuple(int(evaluate(d, bindings)) for d in self.shape)
        return STORAGE_FORMATS[self.storage].stored_bytes(shape) / max(1, int(np.prod(shape, dtype=np.int64)))

    def bytes_stored(self, bindings: Mapping[str, int]) -> int:
        if not self.kind.launches:
            return 0
        if self.kind is KernelKind.SCATTER_NOCOPY:  # in place: only the scattered rows are written (in a
            # KV cache's format: its codes and their share of the scales)
            return int(round(float(evaluate(prod(self.inputs[1].view.shape), bindings))
                             * self.stored_bytes_per_element(bindings)))
        if self.kind is KernelKind.SCATTER_EW:  # in place: the rows its body computes (in a KV cache's format)
            return int(round(float(evaluate(prod(self.body_shape), bindings)) * self.stored_bytes_per_element(bindings)))
        return int(self.numel(bindings) * self.dtype.itemsize) + self.scales_bytes(bindings)

    def input_bytes(self, slot: int, bindings: Mapping[str, int], dtypes: Mapping[int, Format],
                    element_bytes: Mapping[int, float] | None = None) -> float:
        """Bytes one pass over input `slot` reads: each distinct element it touches once (broadcasts are
        cached), at its stored size; a Gather's table only the rows its indices name."""
        inp = self.inputs[slot]
        v = inp.view.views[0]
        distinct = prod(d for d, s in zip(v.shape, v.strides) if s != 0) if len(inp.view.views) == 1 \
            else prod(inp.view.shape)
        n = float(evaluate(distinct, bindings))
        if slot == 0 and self.kind is KernelKind.GATHER and inp.view.shape:
            rows = float(evaluate(inp.view.shape[0], bindings))
            n = min(n, n / max(rows, 1.0) * float(evaluate(prod(self.inputs[1].view.shape), bindings)))
        return n * (element_bytes or {}).get(inp.buffer, dtypes[inp.buffer].itemsize)

    def bytes_loaded(self, bindings: Mapping[str, int], dtypes: Mapping[int, Format],
                     element_bytes: Mapping[int, float] | None = None) -> int:
        """Each input read once per distinct element it touches (broadcasts are cached), at its stored
        size (`element_bytes`: buffer id -> bytes per element, else its dtype's); a Gather reads the rows
        its indices name, not the table; an in-place Scatter does not read its destination; a QUANTIZE
        kernel reads its operand twice (an amax pass, then the convert pass) and its scales once."""
        element_bytes = element_bytes or {}
        total = 0.0
        reads: list[float] = []
        for i in range(len(self.inputs)):
            if i == 0 and self.kind.in_place:
                continue
            reads.append(self.input_bytes(i, bindings, dtypes, element_bytes))
            total += reads[-1]
        if self.kind is KernelKind.QUANTIZE:
            total = 2 * total + self.scales_bytes(bindings)
        if self.kind.is_gemm and GEMM_VARIANTS[self.precision or "f32"].a_prologue:
            a = self.inputs[0]  # the prologue's amax pass reads A once more
            total += float(evaluate(prod(a.view.shape), bindings)) / max(1.0, float(evaluate(
                self.layout.n, bindings))) * element_bytes.get(a.buffer, dtypes[a.buffer].itemsize)
        b_scale = GEMM_VARIANTS[self.precision or "f32"].b_scale if self.kind is KernelKind.GEMM else None
        if b_scale is not None and not b_scale.static:  # B scaled at run time: an amax pass reads B once more
            total += reads[1]
        return int(round(total))

    def flops(self, bindings: Mapping[str, int]) -> int:
        return _FLOPS[self.kind](self, bindings)


def _body_n(k: Kernel, bindings: Mapping[str, int]) -> int:
    return int(evaluate(prod(k.body_shape), bindings)) if k.body_shape else 1


def _gemm_flops(k: Kernel, bindings: Mapping[str, int]) -> int:
    lay = k.layout
    return int(2 * evaluate(lay.batch * lay.m * lay.n * lay.k, bindings))


def _no_flops(k: Kernel, bindings: Mapping[str, int]) -> int:
    return 0


# Arithmetic per kernel kind (the cost model's flops), one entry per kind.
_FLOPS = {
    KernelKind.EXTERNAL: _no_flops, KernelKind.CONST: _no_flops, KernelKind.IOTA: _no_flops,
    KernelKind.ELEMENTWISE: lambda k, b: k.numel(b) * max(count_ops(k.body), 1),
    KernelKind.SUM: lambda k, b: _body_n(k, b) * (count_ops(k.body) + 1),
    KernelKind.MAX: lambda k, b: _body_n(k, b) * (count_ops(k.body) + 1),
    KernelKind.SOFTMAX: lambda k, b: _body_n(k, b) * (count_ops(k.body) + 5),
    KernelKind.GEMM: _gemm_flops,
    # a max per element, a division per element, one per scale
    KernelKind.QUANTIZE: lambda k, b: 2 * k.numel(b) + int(k.scales_bytes(b) // F32.itemsize),
    KernelKind.GATHER: _no_flops, KernelKind.SCATTER: _no_flops, KernelKind.SCATTER_NOCOPY: _no_flops,
    KernelKind.GEMM_EPILOGUE: lambda k, b: _gemm_flops(k, b) + k.numel(b) * count_ops(k.body),
    KernelKind.ATTENTION: attention_flops,
    # row sums and the tail, each op once per element of the row (the sums' bodies run over the row too)
    KernelKind.ROWS: lambda k, b: k.numel(b) * max(count_ops(k.body), 1),
    KernelKind.SCATTER_EW: lambda k, b: _body_n(k, b) * count_ops(k.body),
}
assert set(_FLOPS) == set(KernelKind), "every kernel kind has a flop count"


def quantized_a_view(layout: GemmLayout) -> ShapeTracker:
    """How a Gemm reads its QUANTIZE buffer: over the Mul's full shape, (batch axes, M axes, K axis)
    mapped row-major into the contiguous (batch, M, K) buffer, stride 0 along the N axes; so
    gemm_operand_a of what it reads is the buffer itself."""
    full = layout.full_shape
    order = (*layout.batch_axes, *layout.m_axes, layout.k_axis)
    stride_of = dict(zip(order, contiguous_strides([full[a] for a in order])))
    return ShapeTracker((View.create(full, [stride_of.get(a, 0) for a in range(len(full))]),))


@dataclass(frozen=True)
class Program:
    kernels: tuple[Kernel, ...]
    inputs: tuple[tuple[str, int], ...]    # graph input name -> EXTERNAL kernel id
    outputs: tuple[tuple[str, int], ...]   # graph output name -> kernel id
    exports: tuple[tuple[int, int], ...] = ()  # (graph node id, kernel id) of every chunk export (audits)
    # every kernel's reduction order fixed per output row, whatever the batch, the row's place in it, the KV
    # length and the thread count (issue 37): backends run their fixed-order kernels, never an M-dependent one
    batch_invariant: bool = False

    def dtypes(self) -> dict[int, Format]:
        return {k.id: k.dtype for k in self.kernels}

    def element_bytes(self, bindings: Mapping[str, int]) -> dict[int, float]:
        """Buffer id -> bytes per element in memory, for the buffers held in a storage format."""
        return {k.id: k.stored_bytes_per_element(bindings) for k in self.kernels if k.storage is not None}

    def cache_buffers(self) -> frozenset[int]:
        """EXTERNAL buffers held in a KV-cache format: the destinations of in-place Scatters with a storage
        (runtime inputs converted on entry, unlike weights, which the compiler converts once)."""
        return frozenset(k.inputs[0].buffer for k in self.kernels
                         if k.kind is KernelKind.SCATTER_NOCOPY and k.storage is not None)

    def launched(self) -> list[Kernel]:
        return [k for k in self.kernels if k.kind.launches]

    def kernel(self, kid: int) -> Kernel:
        """The kernel with id `kid` (ids are positions in lowered programs; searched otherwise)."""
        k = self.kernels[kid] if 0 <= kid < len(self.kernels) else None
        return k if k is not None and k.id == kid else next(p for p in self.kernels if p.id == kid)

    def quantized_inputs(self, kernel: Kernel) -> tuple[bool, ...]:
        """Per input of `kernel`: whether it is a QUANTIZE kernel's buffer (q, read with its scales)."""
        return tuple(self.kernel(inp.buffer).kind is KernelKind.QUANTIZE for inp in kernel.inputs)


class ProgramError(ValueError):
    """A lowered program that breaks an LLIR invariant: a bug in a rule or in the lowering."""


def verify(p: Program) -> Program:
    """Check a lowered program (tinygrad's type_verify): ids, order, shapes, dtypes and aliasing.

    Every buffer is written before it is read (producers have smaller ids), every kernel's inputs are
    read through views of the shape its kind expects, and an in-place kernel overwrites a buffer no
    other kernel reads and no output names. Returns `p` so lowering can end with `return verify(...)`.
    """
    readers: dict[int, int] = {}
    for pos, k in enumerate(p.kernels):
        if k.id != pos:
            raise ProgramError(f"kernel at position {pos} has id {k.id} (ids are positions)")
        if not isinstance(k.dtype, Format):
            raise ProgramError(f"kernel {k.id}: dtype {k.dtype!r} is not a Format")
        for inp in k.inputs:
            if not 0 <= inp.buffer < k.id:
                raise ProgramError(f"kernel {k.id} ({k.kind.value}) reads buffer {inp.buffer} before it is written")
            readers[inp.buffer] = readers.get(inp.buffer, 0) + 1
            if p.kernels[inp.buffer].kind is KernelKind.QUANTIZE and (not k.kind.is_gemm or inp is not k.inputs[0]):
                raise ProgramError(f"kernel {k.id} ({k.kind.value}) reads QUANTIZE buffer {inp.buffer}: only a Gemm's A may")
        if k.storage is not None and k.kind is not KernelKind.EXTERNAL and not k.kind.in_place:
            raise ProgramError(f"kernel {k.id} ({k.kind.value}) has storage {k.storage!r}: only weights and "
                               "KV caches (held by an in-place scatter) do")
        if (k.aliases is not None) != k.kind.in_place or k.aliases not in (None, 0):
            raise ProgramError(f"kernel {k.id} ({k.kind.value}) aliases input {k.aliases!r}: only in-place scatters "
                               "alias, their destination (input 0)")
        problem = _SHAPE_CHECK[k.kind](k)
        if problem:
            raise ProgramError(f"kernel {k.id} ({k.kind.value}, {k.label}): {problem}")
    names = {"input": p.inputs, "output": p.outputs}
    for role, pairs in names.items():
        for name, kid in pairs:
            if not 0 <= kid < len(p.kernels):
                raise ProgramError(f"{role} {name!r} names kernel {kid}, which does not exist")
    for name, kid in p.inputs:
        if p.kernels[kid].kind is not KernelKind.EXTERNAL or p.kernels[kid].external != name:
            raise ProgramError(f"input {name!r} is kernel {kid}, not its EXTERNAL buffer")
    for nid, kid in p.exports:
        if not 0 <= kid < len(p.kernels):
            raise ProgramError(f"export of node {nid} names kernel {kid}, which does not exist")
    outs = {kid for _, kid in p.outputs}
    for k in p.kernels:
        if k.kind.in_place:
            dest = k.inputs[0].buffer
            if readers[dest] > 1 or dest in outs:
                raise ProgramError(f"kernel {k.id} overwrites buffer {dest} in place, but it has {readers[dest]} "
                                   f"readers{' and is an output' if dest in outs else ''}")
            if p.kernels[dest].dtype != k.dtype:
                raise ProgramError(f"kernel {k.id} overwrites a {p.kernels[dest].dtype.name} buffer as {k.dtype.name}")
            if p.kernels[dest].storage != k.storage or (k.storage is not None and not is_kv_format(k.storage)):
                raise ProgramError(f"kernel {k.id} writes rows as {k.storage!r} into a buffer held as "
                                   f"{p.kernels[dest].storage!r} (a KV cache and its scatter share one KV format)")
    return p


def _views_shaped(k: Kernel, shape, n: int | None = None) -> str:
    if n is not None and len(k.inputs) != n:
        return f"has {len(k.inputs)} inputs, its kind takes {n}"
    bad = [i for i, inp in enumerate(k.inputs) if tuple(inp.view.shape) != tuple(shape)]
    return f"inputs {bad} are not read over {tuple(shape)}" if bad else ""


def _check_body(k: Kernel, out_shape) -> str:
    if k.body is None:
        return "has no body"
    if tuple(k.shape) != tuple(out_shape):
        return f"shape {k.shape} is not {tuple(out_shape)} (from its body shape {k.body_shape})"
    slots = load_slots(k.body)
    if slots and max(slots) >= len(k.inputs):
        return f"body loads slot {max(slots)} of {len(k.inputs)} inputs"
    return _views_shaped(k, k.body_shape)


def load_slots(e: FExpr | None) -> set[int]:
    """The input slots a body reads (through rounds, FAt and row sums)."""
    if isinstance(e, FLoad):
        return {e.slot}
    if isinstance(e, (FRoundTo, FAt)):
        return load_slots(e.x)
    if isinstance(e, FRowSum):
        return load_slots(e.body)
    if isinstance(e, FApply):
        return set().union(*(load_slots(a) for a in e.args))
    return set()


def _check_rows(k: Kernel) -> str:
    """A ROWS kernel: rows along its last axis; its loads read spaces of their own (row sums, FAt)."""
    if k.body is None or tuple(k.shape) != tuple(k.body_shape) or not k.shape or k.axis != len(k.shape) - 1:
        return f"a row kernel needs a body over its shape {k.shape} with rows along its last axis (axis {k.axis})"
    slots = load_slots(k.body)
    if slots and max(slots) >= len(k.inputs):
        return f"body loads slot {max(slots)} of {len(k.inputs)} inputs"
    return ""


def _check_reduce(k: Kernel) -> str:
    if k.axis is None or not 0 <= k.axis < len(k.body_shape):
        return f"axis {k.axis} outside its body shape {k.body_shape}"
    if k.kind is KernelKind.SOFTMAX:
        return _check_body(k, k.body_shape)
    return _check_body(k, k.body_shape[:k.axis] + k.body_shape[k.axis + 1:])


def _check_gemm(k: Kernel) -> str:
    lay = k.layout
    if lay is None or k.precision not in GEMM_VARIANTS:
        return f"needs a layout and a Gemm variant, has {lay!r} / {k.precision!r}"
    want = tuple(d for i, d in enumerate(lay.full_shape) if i != lay.k_axis)
    if tuple(k.shape) != want:
        return f"shape {k.shape} is not the layout's {want}"
    return _views_shaped(k, lay.full_shape, 2)


def gemm_output_shape(k: Kernel) -> tuple:
    """The shape of a Gemm kernel's accumulator: its layout's output (a GLU epilogue stores less)."""
    return tuple(d for i, d in enumerate(k.layout.full_shape) if i != k.layout.k_axis)


def acc_views(e: FExpr | None) -> set:
    """The views of the FAcc reads of a body that read the accumulator through one (FAcc.view)."""
    if isinstance(e, FAcc):
        return set() if e.view is None else {e.view}
    if isinstance(e, (FRoundTo, FAt)):
        return acc_views(e.x)
    if isinstance(e, FApply):
        return set().union(*(acc_views(a) for a in e.args))
    return set()


def acc_reads(e: FExpr | None) -> list:
    """Each way a body reads its accumulator, in the order epilogue_as_elementwise appends them as inputs:
    at the element (None, always first), then through each view (FAcc.view)."""
    return [None] + sorted(acc_views(e), key=lambda v: v.encode())


def _check_gemm_epilogue(k: Kernel) -> str:
    """A Gemm (A, B over the Mul shape) plus epilogue operands read over its output shape (a body reading
    the accumulator through views: over the body's shape, each view reading the Gemm's output)."""
    views = acc_views(k.body)
    if views and k.layout is not None:
        acc_shape = gemm_output_shape(k)
        bad = [v for v in views if tuple(v.shape) != tuple(k.shape)]
        if bad:
            return f"accumulator views {bad} are not read over {tuple(k.shape)}"
        gemm = _check_gemm(replace(k, inputs=k.inputs[:2], shape=acc_shape))
    else:
        gemm = _check_gemm(replace(k, inputs=k.inputs[:2]))
    if gemm or k.body is None:
        return gemm or "has no epilogue body"
    slots = load_slots(k.body)
    if slots & {0, 1} or (slots and max(slots) >= len(k.inputs)):
        return f"epilogue loads slots {sorted(slots)}: only inputs 2..{len(k.inputs) - 1} (A and B are the Gemm's)"
    bad = [i for i, inp in enumerate(k.inputs[2:], 2) if tuple(inp.view.shape) != tuple(k.shape)]
    return f"epilogue inputs {bad} are not read over {tuple(k.shape)}" if bad else ""


def epilogue_as_elementwise(k: Kernel, acc_buffer: int) -> Kernel:
    """A GEMM_EPILOGUE's body as an ELEMENTWISE kernel over its output whose last input is the accumulator
    (buffer `acc_buffer`, a backend's own id for it): the backends and the static bound evaluate it with
    their elementwise code, so the epilogue is the same arithmetic as the unfused consumer."""
    reads = acc_reads(k.body)
    accs = tuple(KernelInput(acc_buffer, ShapeTracker.contiguous(k.shape) if v is None else v) for v in reads)
    slots = {v: len(k.inputs) + i for i, v in enumerate(reads)}
    return replace(k, kind=KernelKind.ELEMENTWISE, inputs=(*k.inputs, *accs), body=_acc_to_load(k.body, slots),
                   body_shape=k.shape, layout=None, precision=None)


def _acc_to_load(e: FExpr, slots: Mapping) -> FExpr:
    if isinstance(e, FAcc):
        return FLoad(slots[e.view])
    if isinstance(e, FRoundTo):
        return replace(e, x=_acc_to_load(e.x, slots))
    if isinstance(e, FApply):
        return replace(e, args=tuple(_acc_to_load(a, slots) for a in e.args))
    return e


def _check_quantize(k: Kernel) -> str:
    v = GEMM_VARIANTS.get(k.precision)
    if k.layout is None or v is None or v.a_scale is None or v.a_scale.static:
        return f"variant {k.precision!r} does not scale A at run time"
    if k.dtype != v.a_format or tuple(k.shape) != (k.layout.batch, k.layout.m, k.layout.k):
        return f"stores {k.dtype.name} {k.shape}, its variant wants {v.a_format.name} (batch, M, K)"
    return _views_shaped(k, k.layout.full_shape, 1)


def _concatenated(parts, axis: int) -> np.ndarray:
    """Weights side by side: itself a weight (read-only, shared by every runtime), keyed by its parts, so
    what is derived from it (its Gemm operand per variant) is cached too; other inputs: a plain array."""
    out = np.concatenate([np.asarray(p) for p in parts], axis=axis)
    if all(isinstance(p, WeightArray) for p in parts):
        return keyed(out, derived_key("concat", axis, tuple(p.content_key for p in parts)))
    return out


def external_value(k: Kernel, feed: Mapping[str, object]) -> np.ndarray:
    """An EXTERNAL kernel's value from graph inputs by name: the input, its weights concatenated, a weight
    rotated (FP64, hlir/rotation.py; the kernel's dtype or storage format rounds it) or smoothed (hlir/smoothing.py)."""
    if k.rotation is not None:
        return rotation_value(k.rotation, feed)
    if k.smoothing is not None:
        return smoothing_value(k.smoothing, feed)
    if k.concat:  # the same parts give the same array, kept process-wide: what is derived from it (its Gemm
        # operand per variant, hlir.weightcache) is then kept too, not rebuilt by every runtime
        parts = [feed[n] for n in k.concat]
        return WEIGHTS.get_joint(parts, ("concat", k.concat_axis), lambda: _concatenated(parts, k.concat_axis))
    return np.asarray(feed[k.external])


def _check_source(k: Kernel) -> str:
    if k.storage is not None and (k.kind is not KernelKind.EXTERNAL or k.storage not in STORAGE_FORMATS
                                  or len(k.shape) != 2):
        return f"storage {k.storage!r}: only a 2-D EXTERNAL weight is held in a (known) storage format"
    if k.fill is not None and (k.storage is None or k.fill not in set(Fill)):
        return f"fill {k.fill!r}: only a weight held in a storage format is filled, by a known calibrated rounding"
    if k.concat and (k.kind is not KernelKind.EXTERNAL or len(k.shape) != 2):
        return f"concatenates {k.concat}: only a 2-D EXTERNAL weight (stored or not) is a concatenation"
    if k.rotation is not None and (k.kind is not KernelKind.EXTERNAL or len(k.shape) != 2 or k.concat
                                   or k.external != k.rotation.name or k.shape[-1] % k.rotation.block):
        return (f"rotation {k.rotation}: only a 2-D EXTERNAL weight named {k.rotation.name!r} with K divisible by "
                "its block is rotated")
    if k.smoothing is not None and (k.kind is not KernelKind.EXTERNAL or k.concat or k.rotation is not None
                                    or k.external != k.smoothing.name or k.shape[-1] != len(k.smoothing.exponents)
                                    or len(k.shape) != (1 if k.smoothing.source is None else 2)):
        return (f"smoothing {k.smoothing.name}: only an EXTERNAL of that name, its last axis one per exponent, "
                "a 2-D weight or the 1-D scale vector, is smoothed")
    if k.inputs:
        return "a source kernel reads nothing"
    if k.kind is KernelKind.EXTERNAL and not k.external:
        return "an EXTERNAL buffer needs its input name"
    if k.kind is KernelKind.IOTA and tuple(k.shape) != (k.value,):
        return f"an arange of length {k.value} has shape {k.shape}"
    return ""


def _check_scatter(k: Kernel) -> str:
    if len(k.inputs) != 3:
        return f"has {len(k.inputs)} inputs, a scatter takes (dest, src, indices)"
    return "" if tuple(k.shape) == tuple(k.inputs[0].view.shape) else f"shape {k.shape} is not its destination's"


def _check_gather(k: Kernel) -> str:
    if len(k.inputs) != 2:
        return f"has {len(k.inputs)} inputs, a gather takes (table, indices)"
    want = tuple(k.inputs[1].view.shape) + tuple(k.inputs[0].view.shape[1:])
    return "" if tuple(k.shape) == want else f"shape {k.shape} is not indices + table rows {want}"


def _check_scatter_ew(k: Kernel) -> str:
    """(dest, indices, the body's loads...): the body computes the source rows (indices + dest rows)."""
    if len(k.inputs) < 2 or k.body is None:
        return "a scatter of computed rows takes (dest, indices, body loads...) and a body"
    if tuple(k.shape) != tuple(k.inputs[0].view.shape):
        return f"shape {k.shape} is not its destination's"
    want = tuple(k.inputs[1].view.shape) + tuple(k.shape[1:])
    if tuple(k.body_shape) != want:
        return f"body shape {k.body_shape} is not indices + destination rows {want}"
    slots = load_slots(k.body)
    return f"body loads slot {max(slots)} of {len(k.inputs)} inputs" if slots and max(slots) >= len(k.inputs) else ""


# What each kind's kernel must look like, one entry per kind.
_SHAPE_CHECK = {
    KernelKind.EXTERNAL: _check_source, KernelKind.CONST: _check_source, KernelKind.IOTA: _check_source,
    KernelKind.ELEMENTWISE: lambda k: _check_body(k, k.body_shape), KernelKind.SUM: _check_reduce,
    KernelKind.MAX: _check_reduce, KernelKind.SOFTMAX: _check_reduce, KernelKind.GEMM: _check_gemm,
    KernelKind.QUANTIZE: _check_quantize, KernelKind.GATHER: _check_gather, KernelKind.SCATTER: _check_scatter,
    KernelKind.SCATTER_NOCOPY: _check_scatter,
    KernelKind.GEMM_EPILOGUE: lambda k: _check_gemm_epilogue(k),
    KernelKind.ATTENTION: check_attention,
    KernelKind.SCATTER_NOCOPY: _check_scatter, KernelKind.ROWS: _check_rows,
    KernelKind.SCATTER_EW: _check_scatter_ew,
}
assert set(_SHAPE_CHECK) == set(KernelKind), "every kernel kind has a verifier entry"
