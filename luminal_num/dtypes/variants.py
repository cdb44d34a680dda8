"""The precision choices every later stage shares: one frozen record per Gemm / elementwise / reduce
variant, read by the egglog precision rules, the error bounds, the cost model, codegen and the CPU
emulator (`luminal_num.runtime.numerics`, whose docstring defines the arithmetic these fields name).

Conventions. A ScaleSpec's `block` is (rows, cols) of the operand it scales, in that operand's own
axes: A is (M, K), B is (K, N); a block extent of WHOLE (0) spans the whole axis. Leading batch axes
get their own scales (per matrix), except TENSOR, which spans the whole tensor.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

import numpy as np

from .formats import (BF16, E8M0, F8E4M3, F8E5M2, F16, F32, INT8, INT32, TF32, F64, Format, Kind,
                      _ieee)

WHOLE = 0  # a block extent spanning the whole axis
MX_BLOCK = 32  # OCP Microscaling: 32 consecutive elements along K share one E8M0 scale


class Granularity(enum.Enum):
    TENSOR = "tensor"
    CHANNEL = "channel"  # one scale per row of A (token) / per column of B (output channel)
    BLOCK = "block"
    MX = "mx"  # 32-element blocks along K with E8M0 (power-of-two) scales


@dataclass(frozen=True)
class ScaleSpec:
    """How one operand is scaled into its format: x ~= q * s, q in the format, one s per block."""

    granularity: Granularity
    block: tuple[int, int]
    scale_format: Format
    static: bool  # weights: scales computed at compile time; activations: at run time
    margin: float = 1.0  # amax multiplier; >= 1 leaves headroom, < 1 clips on purpose

    def __post_init__(self):
        rows, cols = self.block
        if rows < 0 or cols < 0:
            raise ValueError(f"block extents must be >= 0 (0 = whole axis), got {self.block}")
        if self.scale_format not in (F32, E8M0):
            raise ValueError(f"scale_format must be f32 or e8m0, got {self.scale_format}")
        if not (math.isfinite(self.margin) and self.margin > 0):
            raise ValueError(f"margin must be finite and > 0, got {self.margin!r}")
        expected = {Granularity.TENSOR: {(WHOLE, WHOLE)},
                    Granularity.CHANNEL: {(1, WHOLE), (WHOLE, 1)},
                    Granularity.MX: {(1, MX_BLOCK), (MX_BLOCK, 1)}}.get(self.granularity)
        if expected is not None and self.block not in expected:
            raise ValueError(f"{self.granularity.name} scales need block in {sorted(expected)}, got {self.block}")
        if (self.granularity is Granularity.MX) != (self.scale_format is E8M0):
            raise ValueError("MX granularity goes with E8M0 scales and E8M0 scales with MX granularity")

    def varies_along(self, axis: int) -> bool:
        """Whether the scale changes along operand axis 0 (rows) or 1 (cols), structurally."""
        return self.block[axis] != WHOLE


def limited_accumulator(mantissa_bits: int) -> Format:
    """A tensor-core accumulator keeping `mantissa_bits` stored mantissa bits, with FP32's range."""
    return _ieee(f"acc_m{mantissa_bits}", 1 + 8 + mantissa_bits, mantissa_bits, 8, np.float32, compute_only=True)


def _gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound of n successive roundings."""
    return n * u / (1.0 - n * u) if n * u < 1.0 else math.inf


@dataclass(frozen=True)
class _Rounding:
    """Roundings to `fmt` on the way to one output: each term passes through at most `depth` of them
    (relative gamma_depth(u) on the sum of |terms|), `count` of them happen in all (each may add half
    the smallest subnormal: below min_normal RN errors are absolute). `scaled`: done in the quantized
    domain, so absolute errors are multiplied by the scale."""

    depth: int
    count: int
    fmt: Format
    scaled: bool


OPERAND_FORMATS = (F32, TF32, BF16, F16, F8E4M3, F8E5M2, INT8)


@dataclass(frozen=True)
class GemmPrecision:
    """One way to compute C = A @ B: operand formats, scales, accumulator, promotion.

    promote_every: every N elements along K the (possibly limited) accumulator is scaled and added
        into an FP32 accumulator (DeepSeek-V3's fix for Hopper FP8); None: no promotion.
    acc_mantissa_bits: stored mantissa bits of a limited FP32-range tensor-core accumulator (13 for
        Hopper FP8 as reported by DeepSeek-V3: ~14 significant bits); None: a full FP32 accumulator.
    """

    name: str
    a_format: Format
    b_format: Format
    acc_format: Format
    a_scale: ScaleSpec | None = None
    b_scale: ScaleSpec | None = None
    promote_every: int | None = None
    acc_mantissa_bits: int | None = None
    # per-token dynamic A scales computed in the Gemm's own prologue (an amax pass over each row of A,
    # then convert on load) instead of a QUANTIZE launch: the same arithmetic, one kernel fewer
    a_prologue: bool = False

    def __post_init__(self):
        if self.a_prologue and (self.a_scale is None or self.a_scale.static
                                or self.a_scale.granularity is not Granularity.CHANNEL):
            raise ValueError(f"{self.name}: a prologue quantizes per-token dynamic A scales only")
        for fmt in (self.a_format, self.b_format):
            if fmt not in OPERAND_FORMATS:
                raise ValueError(f"{self.name}: operand format {fmt} not in {OPERAND_FORMATS}")
        integer = self.a_format.kind is Kind.INT
        if integer != (self.b_format.kind is Kind.INT) or integer != (self.acc_format is INT32):
            raise ValueError(f"{self.name}: int8 operands go with each other and an int32 accumulator")
        if self.acc_format not in (F32, F16, INT32):
            raise ValueError(f"{self.name}: accumulator must be f32, f16 or int32, got {self.acc_format}")
        if self.acc_mantissa_bits is not None and not (self.acc_format is F32 and 1 <= self.acc_mantissa_bits < 23):
            raise ValueError(f"{self.name}: acc_mantissa_bits narrows an f32 accumulator to 1..22 bits")
        for fmt, spec in ((self.a_format, self.a_scale), (self.b_format, self.b_scale)):
            if fmt.bits <= 8 and spec is None:
                raise ValueError(f"{self.name}: 8-bit operands ({fmt}) need scales")
        if self.a_scale and self.b_scale and self.a_scale.varies_along(1) and self.b_scale.varies_along(0) \
                and self.a_scale.block[1] != self.b_scale.block[0]:
            raise ValueError(f"{self.name}: A and B scale blocks disagree along K")
        self._check_k_structure()

    def _check_k_structure(self):
        """Chunks never straddle a scale block or an MMA group; K-varying scales need a defined place."""
        step = self.promote_every
        k_block = self.scale_k_block
        if step is not None:
            if step <= 0 or (self.grouped and step % self.mma_k):
                raise ValueError(f"{self.name}: promote_every must be a positive multiple of mma_k={self.mma_k}")
            if k_block is not None and k_block % step:
                raise ValueError(f"{self.name}: promote_every={step} must divide the K scale block {k_block}")
        elif k_block is not None:
            if self.grouped and k_block % self.mma_k:
                raise ValueError(f"{self.name}: the K scale block {k_block} must be a multiple of mma_k")
            pow2 = all(s is None or s.scale_format is E8M0 for s in (self.a_scale, self.b_scale))
            if not self.grouped and not pow2:
                raise ValueError(f"{self.name}: FP32 scales varying along K need promote_every (where they are "
                                 f"applied); only power-of-two scales can be applied exactly per product")

    # -- derived structure -------------------------------------------------------------------------
    @property
    def accumulator(self) -> Format:
        """The format every accumulator update is rounded to."""
        return limited_accumulator(self.acc_mantissa_bits) if self.acc_mantissa_bits else self.acc_format

    @property
    def grouped(self) -> bool:
        """Accumulation in a narrow accumulator, one rounding per MMA group (see numerics)."""
        return self.acc_mantissa_bits is not None or self.acc_format is F16

    @property
    def mma_k(self) -> int:
        """K depth of one tensor-core MMA: 32 bytes of K per row (wgmma k8 tf32, k16 f16/bf16, k32 fp8/int8)."""
        return 32 // self.a_format.storage.itemsize

    @property
    def scale_k_block(self) -> int | None:
        """K extent of a scale block when some scale varies along K, else None."""
        for spec, axis in ((self.a_scale, 1), (self.b_scale, 0)):
            if spec is not None and spec.varies_along(axis):
                return spec.block[axis]
        return None

    @property
    def scales_per_product(self) -> bool:
        """K-varying scales with no promotion are applied inside the MMA, to every product/group."""
        return self.scale_k_block is not None and self.promote_every is None

    # -- the a-priori error bound -------------------------------------------------------------------
    def a_priori_bound(self, k: int, abs_dot, amax_a=None, amax_b=None):
        """Worst-case |computed - exact| of one output; sound, never below the true error.

        k: reduction length; abs_dot: sum_k |a_k| |b_k| (scalar or per-output array); amax_a / amax_b:
        upper bounds of |A| / |B| over the whole tensor. They are needed for soundness: rounding below
        a format's min_normal (times the scale) is absolute, not relative, so its contribution is
        k * half-quantum * max|other operand|, which abs_dot alone cannot bound; they also rule out
        overflow of unscaled operands. Without them the bound is inf unless no such term exists.

        Why it is sound: every rounding is charged its exact worst case (u|x| + half the smallest
        subnormal), errors compose multiplicatively ((1+r1)(1+r2)-1, no first-order truncation), the
        summation term uses gamma_n over the sum of |computed products| (valid for ANY summation order,
        so for BLAS too), and that sum is itself bounded from above by abs_dot plus the operand errors.
        Operands in F32 are taken as exact (the graph's values are FP32).
        """
        abs_dot = np.asarray(abs_dot, dtype=np.float64)
        big_a = math.inf if amax_a is None else float(amax_a)
        big_b = math.inf if amax_b is None else float(amax_b)
        rel_a, abs_a, scale_a, q_max_a = _operand_terms(self.a_format, self.a_scale, big_a)
        rel_b, abs_b, scale_b, q_max_b = _operand_terms(self.b_format, self.b_scale, big_b)
        cross = k * (_times(abs_a * (1 + rel_b), big_b) + _times(abs_b * (1 + rel_a), big_a) + abs_a * abs_b)
        operand_err = (rel_a + rel_b + rel_a * rel_b) * abs_dot + cross
        abs_hat = (1 + rel_a) * (1 + rel_b) * abs_dot + cross  # >= sum_k |a^_k b^_k|
        rel_acc, abs_acc = self._accumulation_terms(k, _times(scale_a, scale_b))
        scaled = self.a_scale is not None or self.b_scale is not None
        q_dot = _times(k * q_max_a, q_max_b)  # |partial sum| in the quantized domain
        if scaled:  # fl32(sa * sb) may underflow: an absolute error up to |partial| * half a subnormal
            abs_acc += _times(q_dot, F32.min_subnormal / 2.0)
        in_accumulator = q_dot if scaled and not self.scales_per_product else abs_hat
        no_overflow = np.asarray(in_accumulator * (1 + rel_acc) <= self.accumulator.max_finite)
        no_overflow = no_overflow & self._fp32_fits(abs_hat * (1 + rel_acc) + abs_acc * (1 + rel_acc),
                                                    (big_a, rel_a, abs_a, scale_a), (big_b, rel_b, abs_b, scale_b))
        bound = operand_err + rel_acc * abs_hat + abs_acc * (1 + rel_acc)
        bound = np.where(no_overflow, bound, math.inf)
        return float(bound) if bound.ndim == 0 else bound

    def _fp32_fits(self, result_abs, a_terms, b_terms) -> np.ndarray:
        """No FP32 intermediate outside the (narrow) accumulator can overflow: the output itself (the
        FP32 cross-chunk total of promoted or per-chunk-scaled sums, which the quantized chunk check
        does not see) and the scale product fl32(sa * sb). Power-of-two scales applied per product (MX)
        need no operand check: an operand q * 2^e beyond FP32 (3.3e38 -> 2^128) sends the emulation to
        its FP64 sum of the exact products (runtime.numerics._per_product_scaled), rounded once."""
        fits = np.asarray(result_abs <= F32.max_finite)
        scaled = self.a_scale is not None or self.b_scale is not None
        exact_prescale = self.scales_per_product and not self.grouped
        if scaled and not exact_prescale:
            fits = fits & (_times(a_terms[3], b_terms[3]) <= F32.max_finite)
        return fits

    def roundings(self, k: int) -> list[_Rounding]:
        """Every rounding between the exact products and one output, in order (numerics defines them)."""
        chunk = min(k, k if self.scales_per_product else (self.promote_every or self.scale_k_block or k))
        chunks, groups = math.ceil(k / chunk), math.ceil(k / self.mma_k)
        scaled = self.a_scale is not None or self.b_scale is not None
        exact_prescale = self.scales_per_product and not self.grouped  # power-of-two scales on operands
        inner_scaled = scaled and not exact_prescale
        out: list[_Rounding] = []
        if self.acc_format is INT32:
            out.append(_Rounding(1, chunks, F32, inner_scaled))  # int32 -> float
        elif self.grouped:
            out.append(_Rounding(self.mma_k, k, F64, inner_scaled))  # group sums (exact for E4M3/INT8)
            if self.scales_per_product:  # term = fl32(fl32(g) * fl32(sa sb)), then the accumulator
                out += [_Rounding(1, groups, F32, True), _Rounding(2, 2 * groups, F32, False),
                        _Rounding(groups, groups, self.accumulator, False)]
                return out
            out.append(_Rounding(math.ceil(chunk / self.mma_k), groups, self.accumulator, inner_scaled))
        else:
            out.append(_Rounding(chunk, k, F32, inner_scaled))  # FP32 BLAS, any order
        if inner_scaled:
            out.append(_Rounding(2, 2 * chunks, F32, False))  # s = fl32(sa sb); fl32(partial * s)
        out.append(_Rounding(chunks - 1, chunks - 1, F32, False))  # FP32 promotion adds, in K order
        return out

    def _accumulation_terms(self, k: int, scale_max: float) -> tuple[float, float]:
        """(relative to sum|a^ b^|, absolute) error of turning the k exact products into the output."""
        rel, absolute = 1.0, 0.0
        for r in self.roundings(k):
            if r.depth > 0:
                rel *= 1 + _gamma(r.depth, r.fmt.unit_roundoff)
            eta = r.count * r.fmt.min_subnormal / 2.0
            absolute += _times(eta, scale_max) if r.scaled else eta
        return rel - 1.0, absolute


def _times(a: float, b: float) -> float:
    """a * b with 0 * inf = 0: an absent error term times an unbounded magnitude is still absent."""
    return 0.0 if a == 0.0 or b == 0.0 else a * b


# TF32 operands have one rounding definition in this project: FP32 -> TF32 to nearest even, in the CPU
# emulator (rounding.round_to) and in every generated CUDA kernel (cuda_body.round_expr, the tiled Gemm).
# cuBLAS's tensor cores under CUBLAS_COMPUTE_32F_FAST_TF32 may instead round ties away or drop the 13
# low bits (tests/test_cuda_runtime.py's probe reports which a device does), so the a-priori bound
# charges truncation, the worst of the three: a whole TF32 step (2u) relative, a whole subnormal
# quantum absolute, instead of half of each.
OPERAND_STEP_FRACTION = {TF32: 1.0}  # of one ulp; round-to-nearest formats: 0.5


def operand_rounding_error(fmt: Format) -> tuple[float, float]:
    """(rel, abs) with |x^ - x| <= rel |x| + abs for an unscaled operand converted to fmt."""
    steps = 2.0 * OPERAND_STEP_FRACTION.get(fmt, 0.5)
    return steps * fmt.unit_roundoff, steps * fmt.min_subnormal / 2.0


def _operand_terms(fmt: Format, spec: ScaleSpec | None, amax: float) -> tuple[float, float, float, float]:
    """(rel, abs, scale_max, max |q|) with |a^ - a| <= rel |a| + abs for every element of the operand.

    Unscaled: RN to fmt (u, half the smallest subnormal; TF32: truncation, operand_rounding_error); amax above max_finite could saturate: inf.
    Scaled: x / s rounded to FP32 (u32 and an FP32 underflow quantum), then to fmt; the absolute part
    is in the scaled domain, so it is multiplied by the largest scale amax can produce.
    """
    if fmt is F32 and spec is None:
        return 0.0, 0.0, 1.0, amax
    if spec is None:
        if not amax <= fmt.max_finite:
            return math.inf, math.inf, 1.0, math.inf
        rel, absolute = operand_rounding_error(fmt)
        return rel, absolute, 1.0, amax
    if spec.margin < 1.0 or not math.isfinite(amax):
        return math.inf, math.inf, math.inf, fmt.max_finite
    ratio = amax * spec.margin / fmt.max_finite
    if spec.scale_format is E8M0:
        scale_max = max(2.0 * ratio, E8M0.min_normal)  # ceil to a power of two at most doubles
    else:
        scale_max = max(ratio * (1 + 2.0 ** -23), F32.min_normal)  # FP32 rounding of the ratio, clamp
    f32_underflow = F32.min_subnormal / 2.0
    if fmt.kind is Kind.INT:
        rel, absolute = F32.unit_roundoff, 0.5 + f32_underflow
    else:
        rel = F32.unit_roundoff + fmt.unit_roundoff * (1 + F32.unit_roundoff)
        absolute = fmt.min_subnormal / 2.0 + f32_underflow * (1 + fmt.unit_roundoff)
    return rel, absolute * scale_max, scale_max, fmt.max_finite


# -- the catalogue ----------------------------------------------------------------------------------

def _operand_scales(granularity: Granularity) -> tuple[ScaleSpec, ScaleSpec]:
    """(A, B) scales: A dynamic per token/block of activations, B static per channel/block of weights."""
    blocks = {Granularity.TENSOR: ((WHOLE, WHOLE), (WHOLE, WHOLE)),
              Granularity.CHANNEL: ((1, WHOLE), (WHOLE, 1)),
              Granularity.BLOCK: ((1, 128), (128, 128)),
              Granularity.MX: ((1, MX_BLOCK), (MX_BLOCK, 1))}[granularity]
    scale_format = E8M0 if granularity is Granularity.MX else F32
    return (ScaleSpec(granularity, blocks[0], scale_format, static=False),
            ScaleSpec(granularity, blocks[1], scale_format, static=True))


HOPPER_FP8_ACC_BITS = 13
FP8_PROMOTION = 128


def _fp8(fmt: Format, granularity: Granularity, *, promote: bool = True, suffix: str = "") -> GemmPrecision:
    """Block scales run as DeepSeek-V3 does on Hopper: limited accumulator, promoted every 128 along K."""
    a_scale, b_scale = _operand_scales(granularity)
    block = granularity is Granularity.BLOCK
    return GemmPrecision(f"{fmt.name}_{granularity.value}{suffix}", fmt, fmt, F32, a_scale, b_scale,
                         promote_every=FP8_PROMOTION if block and promote else None,
                         acc_mantissa_bits=HOPPER_FP8_ACC_BITS if block else None)


def _catalogue() -> dict[str, GemmPrecision]:
    plain = [GemmPrecision(fmt.name, fmt, fmt, F32) for fmt in (F32, TF32, BF16, F16)]
    plain.append(GemmPrecision("f16acc16", F16, F16, F16))
    fp8 = [_fp8(fmt, g) for fmt in (F8E4M3, F8E5M2)
           for g in (Granularity.TENSOR, Granularity.CHANNEL, Granularity.BLOCK)]
    fp8.append(_fp8(F8E4M3, Granularity.MX))
    fp8.append(_fp8(F8E4M3, Granularity.BLOCK, promote=False, suffix="_nopromote"))
    int8 = GemmPrecision("int8_channel", INT8, INT8, INT32, *_operand_scales(Granularity.CHANNEL))
    fused = dataclasses.replace(fp8[1], name=f"{fp8[1].name}_prologue", a_prologue=True)  # f8e4m3_channel
    # activation x activation (attention's Q K^T and P V): B scaled at run time too, per tensor or per
    # column of B (for Q K^T one scale per key token); scales factor out of every K sum, as for weights
    dynamic = [dataclasses.replace(v, name=f"{v.name}_dynamic", b_scale=dataclasses.replace(v.b_scale, static=False))
               for v in fp8[:2]]  # f8e4m3_tensor, f8e4m3_channel
    return {v.name: v for v in (*plain, *fp8, int8, fused, *dynamic)}


GEMM_VARIANTS: dict[str, GemmPrecision] = _catalogue()


@dataclass(frozen=True)
class ElementwisePrecision:
    """Elementwise kernels: inputs rounded to `compute`, math in it, result rounded to `storage`."""

    compute: Format
    storage: Format

    def __post_init__(self):
        if self.compute not in (F32, BF16) or self.storage not in (F32, BF16, F16):
            raise ValueError(f"compute must be f32/bf16 and storage f32/bf16/f16, got {self.compute}/{self.storage}")

    @property
    def name(self) -> str:
        return _pair_name(self.compute, self.storage, "compute")


@dataclass(frozen=True)
class ReducePrecision:
    """Reductions: sequential accumulation rounded to `acc` after every add, result stored in `storage`."""

    acc: Format
    storage: Format

    def __post_init__(self):
        if self.storage not in (F32, BF16, F16) or self.acc not in (F32, self.storage):
            raise ValueError(f"storage must be f32/bf16/f16 and acc f32 or the storage format; "
                             f"got {self.acc}/{self.storage}")

    @property
    def name(self) -> str:
        return _pair_name(self.acc, self.storage, "acc")


def _pair_name(arith: Format, storage: Format, role: str) -> str:
    return arith.name if arith is storage else f"{storage.name}_{role}{arith.name}"


_STORAGE = (F32, BF16, F16)
ELEMENTWISE_VARIANTS: dict[str, ElementwisePrecision] = {
    p.name: p for p in [ElementwisePrecision(F32, s) for s in _STORAGE] + [ElementwisePrecision(BF16, BF16)]}
REDUCE_VARIANTS: dict[str, ReducePrecision] = {
    p.name: p for p in (ReducePrecision(acc, s) for s in _STORAGE for acc in dict.fromkeys((F32, s)))}
