"""Dequantize-on-load Gemm on CUDA: y = a @ W^T with W read in its storage format and widened in registers.

The weight stays in device memory as the plan's weights file holds it (luminal_num.quant.storage: the
`StoredTensor` containers, K contiguous per row): 8/16-bit codes as themselves, 4-bit codes packed two
per byte (element 2i in the low nibble), FP32 / FP16 / E4M3 / E8M0 scales, uint4 zero points, FP16
mins, an FP32 tensor scale. Each 16 x 16 block stages a 16 x 32 tile of A and of W into shared memory,
widening W as it loads (the scheme's own dequantize, then the activation format), and every thread
accumulates its one output over K in order:
    acc = fl32(acc + fl32(RN_act(a_k) * RN_act(dequant(w)_k)))       (starting from -0, the identity)
which is runtime/weight_only.py's SumOrder.SEQUENTIAL emulation bit for bit, per scheme:
    IEEE        w = the stored bf16 / f16 value
    AMAX        w = fl32(q * s), s per row (channel), per 128 x 128 tile, or per group along K (FP32 / E8M0)
    INT4        w = q * s (symmetric), (q - z) * s (asymmetric): exact in FP32
    NVFP4       w = fl32(fl32(q * s_b) * s_t)
    GGUF Q4_1   w = fl32(q * d + m) (q * d exact);  Q8_0: w = q * d (exact)
    kept GGUF blocks (the file's bytes, one uint8 part; quant/gguf_blocks.py), as ggml-quants.c decodes:
      Q4_0 / Q5_0  w = (q - 8) d, (q - 16) d (exact);  Q5_1  w = fl32(q d + m)
      Q4_K / Q5_K  w = fl32(fl32(d sc) q) - fl32(dmin m), 6-bit sc and m of the 32-wide sub-block
      Q6_K         w = fl32(fl32(d sc) (q - 32)), int8 sc of the 16-wide sub-block
Shapes are compile-time constants (a source per Gemm shape; NVRTC caches by source).

`dequant_expr` is also how every other Gemm form on a stored weight loads B (`stored_operand`: the tiled
kernel of codegen/cuda_gemm.py reads the same parts); `weight_only_gemm` picks this dedicated kernel for
the plain form.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..dtypes.formats import BF16, E8M0, F4E2M1, F16, F32, INT4, UINT4, UINT8, Format
from ..quant.layout import Layout, Part, Scheme
from ..quant.pack import FOUR_BIT_FORMATS, packed_length
from ..hlir.symbolic import is_const
from ..quant.gguf_blocks import block_type
from ..quant.storage import STORAGE_FORMATS, StorageFormat
from . import ctypes_map
from .cuda_body import round_expr
from .cuda_source import ENTRY, entry_name, source_header
from .llir import Kernel, KernelKind, Program

TILE = 16     # outputs per block along M and N (16 x 16 threads)
K_TILE = 32   # K per shared-memory stage
ACTIVATIONS = (F32, BF16, F16)


@dataclass(frozen=True)
class WeightOnlySource:
    """One compiled-to-be kernel: its source, entry name, pointer parameters in order, launch shape."""

    name: str
    source: str
    params: tuple[str, ...]       # "out", "a", then the weight's parts (param_name, in StorageFormat.parts order)
    grid: tuple[int, int, int]
    block: tuple[int, int, int]


def param_name(part: Part) -> str:
    """The kernel parameter holding a weight part ("w_q", "w_scale", ...: "min" alone would shadow min())."""
    return f"w_{part.value}"


def _part_type(fmt: StorageFormat, part: Part) -> str:
    f = fmt.part_format(part)
    return "unsigned char" if f in FOUR_BIT_FORMATS or f is E8M0 or f is UINT8 else ctypes_map.cuda_type(f)


def _code(f: Format, byte: str, k: str) -> str:
    """The 4-bit code of element k from its packed byte, then its value in format f (quant.pack)."""
    code = f"(({k}) % 2 == 0 ? ({byte}) % 16 : ({byte}) / 16)"
    if f is UINT4:
        return f"static_cast<float>({code})"
    if f is INT4:  # two's complement nibble
        return f"static_cast<float>({code} >= 8 ? {code} - 16 : {code})"
    if f is F4E2M1:  # sign bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
        m = f"({code} % 8)"
        mag = (f"({m} < 4 ? static_cast<float>({m}) * 0.5f : ({m} < 6 ? static_cast<float>({m} - 2) : "
               f"static_cast<float>(({m} - 4) * 2)))")
        return f"({code} >= 8 ? -{mag} : {mag})"
    raise ValueError(f"{f} is not a 4-bit format")


def _load(fmt: StorageFormat, part: Part, index: str, k: str = "") -> str:
    """The FP32 value of part `part` at container element `index` (k: the element index for 4-bit)."""
    f = fmt.part_format(part)
    raw = f"{param_name(part)}[{index}]"
    if f in FOUR_BIT_FORMATS:
        return _code(f, raw, k)
    if f is E8M0:  # the biased exponent: 2^(b - 127); b = 0 is 2^-127, an FP32 subnormal
        return f"({raw} == 0 ? {ctypes_map.c_float_literal(2.0 ** -127)} : __int_as_float(static_cast<int>({raw}) * 8388608))"
    return ctypes_map.to_float_expr(f, raw)


def _dequant_blocks(fmt: StorageFormat, k: int, row: str, col: str) -> str:
    """C expression: element (row, col) of a weight kept as a GGUF file's blocks (the uint8 part `w_blocks`,
    (rows, K / block x block bytes)), widened to FP32 exactly as quant/gguf_blocks.py (and ggml) decode it."""
    t = block_type(fmt.name)
    base = f"({row} * {k // t.block * t.block_bytes}LL + ({col} / {t.block}) * {t.block_bytes}LL)"
    j = f"({col} % {t.block})"

    def byte(offset: str) -> str:
        return f"static_cast<int>(w_blocks[{base} + {offset}])"

    def f16(offset: int) -> str:  # a little-endian fp16 field of the block
        return f"__half2float(__ushort_as_half(static_cast<unsigned short>({byte(offset)} | ({byte(offset + 1)} << 8))))"

    def nibble32(qs: int) -> str:  # 32-blocks: byte i holds element i (low nibble) and i + 16 (high)
        b = byte(f"{qs} + {j} % 16")
        return f"({j} < 16 ? ({b} & 15) : ({b} >> 4))"

    def high32(qh: int) -> str:  # the 32 high bits, one little-endian uint32: bit j of element j
        return f"(({byte(f'{qh} + {j} / 8')} >> ({j} % 8)) & 1)"

    def k_nibble(qs: int) -> str:  # K-quants: 64-element chunks of 32 bytes, low nibbles first
        b = byte(f"{qs} + ({j} / 64) * 32 + {j} % 32")
        return f"(({j} / 32) % 2 == 0 ? ({b} & 15) : ({b} >> 4))"

    def k_scale_min(s: str) -> tuple[str, str]:  # ggml's get_scale_min_k4(s) over the 12 bytes at 4
        q = lambda i: byte(f"4 + {i}")  # noqa: E731
        sc = f"({s} < 4 ? ({q(s)} & 63) : (({q(f'{s} + 4')} & 15) | (({q(f'{s} - 4')} >> 6) << 4)))"
        m = f"({s} < 4 ? ({q(f'{s} + 4')} & 63) : (({q(f'{s} + 4')} >> 4) | (({q(s)} >> 6) << 4)))"
        return f"static_cast<float>({sc})", f"static_cast<float>({m})"

    if t.ggml == "Q4_0":
        return f"__fmul_rn(static_cast<float>({nibble32(2)} - 8), {f16(0)})"
    if t.ggml == "Q5_0":
        return f"__fmul_rn(static_cast<float>(({nibble32(6)} | ({high32(2)} << 4)) - 16), {f16(0)})"
    if t.ggml == "Q5_1":
        return f"__fadd_rn(__fmul_rn(static_cast<float>({nibble32(8)} | ({high32(4)} << 4)), {f16(0)}), {f16(2)})"
    if t.ggml in ("Q4_K", "Q5_K"):
        sc, m = k_scale_min(f"({j} / 32)")
        code = k_nibble(16) if t.ggml == "Q4_K" else \
            f"({k_nibble(48)} | ((({byte(f'16 + {j} % 32')} >> ({j} / 32)) & 1) << 4))"
        return f"__fsub_rn(__fmul_rn(__fmul_rn({f16(0)}, {sc}), static_cast<float>({code})), __fmul_rn({f16(2)}, {m}))"
    if t.ggml == "Q6_K":  # halves of 128: quarter q of a half reads ql[l + 32 (q % 2)] and bits 2q of qh[l]
        half, quarter, lane = f"({j} / 128)", f"(({j} % 128) / 32)", f"({j} % 32)"
        ql = byte(f"64 * {half} + {lane} + 32 * ({quarter} % 2)")
        low = f"({quarter} < 2 ? ({ql} & 15) : ({ql} >> 4))"
        high = f"(({byte(f'128 + 32 * {half} + {lane}')} >> (2 * {quarter})) & 3)"
        sc = f"static_cast<float>(static_cast<signed char>({byte(f'192 + {j} / 16')}))"
        return f"__fmul_rn(__fmul_rn({f16(208)}, {sc}), static_cast<float>(({low} | ({high} << 4)) - 32))"
    raise ValueError(f"{fmt.name}: no dequantize-on-load rendering for GGUF {t.ggml} blocks")


def dequant_expr(fmt: StorageFormat, k: int, row: str = "row", col: str = "col") -> str:
    """C expression: element (row, col) of the stored (rows, k) tensor widened to FP32, exactly as
    fmt.dequantize (the format's blocks run along its last axis, k long); `row` / `col`: C identifiers (or
    parenthesized expressions) of the element's indices."""
    if fmt.layout is Layout.BLOCKS:
        return _dequant_blocks(fmt, k, row, col)
    kb = packed_length(k)
    q = _load(fmt, Part.Q, f"{row} * {kb}LL + {col} / 2" if fmt.element in FOUR_BIT_FORMATS else f"{row} * {k}LL + {col}",
              col)
    if fmt.layout is Layout.NONE:
        return q
    groups = -(-k // fmt.block) if fmt.block else 1
    if fmt.layout is Layout.CHANNEL:
        at = row
    elif fmt.layout is Layout.TILE:
        at = f"({row} / {fmt.block}) * {groups}LL + {col} / {fmt.block}"
    else:
        at = f"{row} * {groups}LL + {col} / {fmt.block}"
    s = _load(fmt, Part.SCALE, at)
    scheme = fmt.scheme
    if scheme in (Scheme.AMAX, Scheme.INT4_SYMMETRIC, Scheme.GGUF_Q8_0):
        return f"__fmul_rn({q}, {s})"
    if scheme is Scheme.INT4_ASYMMETRIC:
        z = _load(fmt, Part.ZERO, f"{row} * {packed_length(groups)}LL + ({col} / {fmt.block}) / 2", f"({col} / {fmt.block})")
        return f"__fmul_rn(__fsub_rn({q}, {z}), {s})"
    if scheme is Scheme.NVFP4:
        return f"__fmul_rn(__fmul_rn({q}, {s}), {_load(fmt, Part.TENSOR_SCALE, '0')})"
    if scheme is Scheme.GGUF_Q4_1:
        return f"__fadd_rn(__fmul_rn({q}, {s}), {_load(fmt, Part.MIN, at)})"
    raise ValueError(f"{fmt.name}: no dequantize-on-load rendering for scheme {scheme.value}")


def render_weight_only(fmt: StorageFormat, act: Format, m: int, n: int, k: int,
                       a_format: Format = F32) -> WeightOnlySource:
    """The kernel computing out (m, n) = a (m, k) @ W^T with W (n, k) stored as `fmt`, the MMA operands
    (and activations) in `act` (F32 / BF16 / F16: runtime/weight_only.py's WeightOnlyGemm(fmt, act)),
    a held as a_format."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activations are {'/'.join(f.name for f in ACTIVATIONS)}, got {act}")
    if min(m, n, k) < 1:
        raise ValueError(f"{fmt.name}: a dequantize-on-load Gemm needs M, N, K >= 1, got {m}, {n}, {k}")
    fmt.check_shape((n, k))
    widen = (lambda x: x) if act is F32 else (lambda x: round_expr(act, x, saturate=False))
    a_value = widen(ctypes_map.to_float_expr(a_format, f"a[lm * {k}LL + lk]"))
    w_value = widen(dequant_expr(fmt, k))
    parts = [param_name(p) for p in fmt.parts]
    params = ["float* __restrict__ out", f"const {ctypes_map.cuda_type(a_format)}* __restrict__ a"]
    params += part_params(fmt)
    body = (f'extern "C" __global__ void {ENTRY}({", ".join(params)}) {{\n'
            f"    __shared__ float ta[{TILE}][{K_TILE + 1}];\n    __shared__ float tw[{TILE}][{K_TILE + 1}];\n"
            f"    const long long M = {m}LL, N = {n}LL, K = {k}LL;\n"
            f"    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * {TILE} + tx;\n"
            f"    for (long long m0 = blockIdx.x * {TILE}LL; m0 < M; m0 += gridDim.x * {TILE}LL)\n"
            f"    for (long long n0 = blockIdx.y * {TILE}LL; n0 < N; n0 += gridDim.y * {TILE}LL) {{\n"
            "        const long long mo = m0 + ty, no = n0 + tx;\n"
            "        float acc = -0.0f;\n"
            f"        for (long long k0 = 0; k0 < K; k0 += {K_TILE}) {{\n"
            f"            for (int e = tid; e < {TILE * K_TILE}; e += {TILE * TILE}) {{\n"
            f"                const long long lm = m0 + e / {K_TILE}, lk = k0 + e % {K_TILE};\n"
            f"                ta[e / {K_TILE}][e % {K_TILE}] = (lm < M && lk < K) ? {a_value} : 0.0f;\n"
            f"                const long long row = n0 + e / {K_TILE}, col = lk;\n"
            f"                tw[e / {K_TILE}][e % {K_TILE}] = (row < N && col < K) ? {w_value} : 0.0f;\n"
            "            }\n"
            "            __syncthreads();\n"
            "            if (mo < M && no < N)\n"
            f"                for (long long kk = 0; kk < min({K_TILE}LL, K - k0); ++kk)\n"
            "                    acc = __fadd_rn(acc, __fmul_rn(ta[ty][kk], tw[tx][kk]));\n"
            "            __syncthreads();\n"
            "        }\n"
            "        if (mo < M && no < N) out[mo * N + no] = acc;\n"
            "    }\n}\n")
    formats = {a_format, act} | stored_formats(fmt)
    source = source_header(formats, body) + body
    name = entry_name("wgemm", source)
    grid = (min(math.ceil(m / TILE), 65535), min(math.ceil(n / TILE), 65535), 1)
    return WeightOnlySource(name, source.replace(ENTRY, name), ("out", "a", *parts), grid, (TILE, TILE, 1))


# -- which LLIR Gemms run as a dequantize-on-load kernel ---------------------------------------------
_ACT_OF_PRECISION = {"f32": F32, "bf16": BF16, "f16": F16}  # plain Gemm variants: the MMA operand format


def row_major_view(view, axes: tuple[int, ...], full) -> bool:
    """`view` reads its buffer row-major over `axes` (in order) and broadcasts (stride 0) every other axis."""
    if len(view.views) != 1:
        return False
    v = view.views[0]
    if v.mask is not None or v.offset != 0:
        return False
    stride, want = 1, {}
    for a in reversed(axes):
        want[a] = stride if full[a] != 1 else v.strides[a]
        stride = stride * full[a]
    return all(v.strides[a] == want.get(a, 0) or full[a] == 1 for a in range(len(full)))


@dataclass(frozen=True)
class StoredOperand:
    """A Gemm's B read straight from a weight's stored parts: the weight's storage format and its layout,
    (N, K) read as W^T (`k_last`: torch Linear, GGUF) or (K, N) read as W (an ONNX MatMul initializer)."""

    fmt: StorageFormat
    k_last: bool

    def element(self, n: int, k: int, n_index: str, k_index: str) -> str:
        """C expression: B[k_index, n_index] of the (K = k, N = n) product, dequantized to FP32."""
        if self.k_last:
            return dequant_expr(self.fmt, k, n_index, k_index)
        return dequant_expr(self.fmt, n, k_index, n_index)


def stored_operand(kernel: Kernel, program: Program) -> StoredOperand | None:
    """How a Gemm reads its B from a weight's stored parts, when B is a weight held in a storage format
    (not a KV cache) read row-major as the whole weight: (N axes, K axis) over an (N, K) weight, or (K axis,
    N axes) over a (K, N) one, every other axis broadcast, N and K concrete. Such a Gemm reads B's stored
    parts, never a widened copy (every form: plain, epilogue, GLU, horizontal, scaled, pre-quantized A);
    None for any other Gemm (it reads B's buffer)."""
    if not kernel.kind.is_gemm:
        return None
    w_src = program.kernel(kernel.inputs[1].buffer)
    if w_src.kind is not KernelKind.EXTERNAL or w_src.storage not in STORAGE_FORMATS \
            or w_src.id in program.cache_buffers():
        return None
    lay = kernel.layout
    full = lay.full_shape
    if not (is_const(lay.n) and is_const(lay.k)) or not all(is_const(full[a]) for a in (*lay.n_axes, lay.k_axis)):
        return None
    shape, n, k, view = tuple(int(d) for d in w_src.shape), int(lay.n), int(lay.k), kernel.inputs[1].view
    for k_last, order, want in ((True, (*lay.n_axes, lay.k_axis), (n, k)), (False, (lay.k_axis, *lay.n_axes), (k, n))):
        if shape == want and row_major_view(view, order, full):
            return StoredOperand(STORAGE_FORMATS[w_src.storage], k_last)
    return None


def stored_formats(fmt: StorageFormat) -> set[Format]:
    """The formats a dequantize expression of `fmt` converts from (the source header's includes)."""
    return {*(fmt.part_format(p) for p in fmt.parts)} | ({F16} if fmt.keeps_only else set())


def part_params(fmt: StorageFormat) -> list[str]:
    """The C parameters of a weight's stored parts, in StorageFormat.parts order."""
    return [f"const {_part_type(fmt, p)}* __restrict__ {param_name(p)}" for p in fmt.parts]


def weight_only_gemm(kernel: Kernel, program: Program) -> WeightOnlySource | None:
    """The dedicated dequantize-on-load kernel for a plain LLIR Gemm on a stored (N, K) B (stored_operand), or
    None when the Gemm is not of that form: a plain f32/bf16/f16 variant with an FP32 output, A read
    row-major as (M, K) from an F32/BF16/F16 buffer, no batch, concrete shapes. Other Gemms on a stored
    B run the tiled kernel reading the stored parts (codegen/cuda_gemm.py)."""
    act = _ACT_OF_PRECISION.get(kernel.precision or "f32")
    if kernel.kind is not KernelKind.GEMM or act is None:
        return None
    stored = stored_operand(kernel, program)
    a_src = program.kernel(kernel.inputs[0].buffer)
    if stored is None or not stored.k_last or a_src.kind is KernelKind.QUANTIZE or a_src.dtype not in ACTIVATIONS:
        return None
    lay = kernel.layout
    full = lay.full_shape
    if not all(is_const(d) for d in full) or lay.batch != 1 or max(lay.m_axes, default=-1) > min(lay.n_axes, default=len(full)):
        return None
    m, n, k = int(lay.m), int(lay.n), int(lay.k)
    if kernel.dtype is not F32 or not row_major_view(kernel.inputs[0].view, (*lay.m_axes, lay.k_axis), full):
        return None
    return render_weight_only(stored.fmt, act, m, n, k, a_src.dtype)
