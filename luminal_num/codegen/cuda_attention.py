"""CUDA C for the fused attention kernel (KernelKind.ATTENTION): the order of operations and
roundings of runtime/cpu_attention.py, bit for bit, with each score computed once at any row length.

One block per score row (a query of a head; blocks loop grid-stride over rows, as the grid is capped
at MAX_GRID blocks), COLUMN_THREADS x lanes threads (lanes = min(splits, MAX_SPLIT_LANES)). The row's
keys are taken in chunks of whole key tiles that fit shared memory (MAX_ROW_KEYS keys; a short row is
one chunk). Per chunk the block computes each score s_j once (the dot over the head dimension in order,
then scale and bias) into shared memory, each key tile's max (exact in any order), then for each split
touching the chunk its running max m' after each of its tiles and the tile's rescale e(m - m'), then
p_j = e(s_j - m') in place; then each (V column, split) runs exactly the emulation's sequence over the
split's tiles in the chunk: l = l * alpha, o = o * alpha, then l + p_j and o + r(p_j) v_j per key in order.
What a split carries from chunk to chunk (its running max m, and (l, o) per V column) and what the
combine reads are the row's partials (m per split, then l and o per split and column: the V width must be
a compile-time constant), read and written once per chunk: (2 Dv + 1) floats per split and chunk. They live
in shared memory up to SHARED_PARTIALS floats (one split, or DECODE_SPLITS of a V width up to 128), else
in a scratch region per row (a fixed split size over a long row: decode rows, few). After the last chunk
each V column's thread combines the splits in order (flash decoding; with one split the combine is exact).
Splits are decoupled from threads: a batch-invariant plan's fixed split size (one split per 64 keys) gives
any number of splits, dealt round-robin to the lanes, without more threads.

An H200 ran an earlier kernel, which recomputed the whole Q.K row per output column and twice per key,
at ~270 us per SmolLM2 decode layer (reports/bench/gpu_kernels.csv); this one has not run on a device.
Q, K, bias and V are read through their views (GQA and the KV cache are strides). exp is FP64 exp
rounded once to FP32 (the CPU emulation's e()); products and sums are __fmul_rn / __fadd_rn (no FMA
contraction).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..dtypes.formats import BF16, F16, F32, Format
from ..hlir.symbolic import prod
from .attention import ATTENTION_VARIANTS, DECODE_SPLITS, AttentionSpec
from .blockops import block_op
from .cuda_body import float_literal, store, unravel
from .cuda_source import ENTRY, Arg, Launch, Scratch, indent, per

COLUMN_THREADS = 32   # V columns a block walks at once, each by `lanes` threads (one split each at a time)
MAX_SPLIT_LANES = DECODE_SPLITS  # splits walked at once per column: at most 128 threads per block
MAX_ROW_KEYS = 4096   # keys per chunk held in shared memory (16 KB of scores), rounded down to whole tiles
# a row's partials up to this many floats (DECODE_SPLITS splits of a 128-wide V: 4 KB) live in shared memory;
# more (a fixed split size over a long row) in a scratch region per row
SHARED_PARTIALS = DECODE_SPLITS * (2 * 128 + 1)
NEG_INF = "(-__int_as_float(0x7f800000))"


@dataclass(frozen=True)
class AttentionPlan:
    """The compile-time shape of one attention kernel's CUDA form: `chunk_tiles` key tiles per chunk (fewer
    for a known shorter row), `splits` key splits per row (for a fixed split size, those of its known key
    length), `lanes` splits walked at once, `dv` the V width; a row's partials are `splits` maxima, then l
    and o per split and V column, in shared memory or (too many for it) in a scratch region per row."""

    chunk_tiles: int
    splits: int
    lanes: int
    dv: int

    @property
    def threads(self) -> int:
        return COLUMN_THREADS * self.lanes

    @property
    def row_floats(self) -> int:
        return self.splits * (2 * self.dv + 1)

    @property
    def shared_partials(self) -> bool:
        return self.row_floats <= SHARED_PARTIALS


def row_splits(spec: AttentionSpec, keys: int) -> int:
    """Key splits of a row of `keys` keys: a fixed split size's as many as the keys need (at least one,
    as key_ranges), else spec.splits equal runs."""
    if not spec.split_keys:
        return spec.splits
    return max(1, math.ceil(math.ceil(keys / spec.key_tile) / (spec.split_keys // spec.key_tile)))


def attention_plan(k) -> AttentionPlan:
    """The plan of kernel `k`; refuses (ValueError, one line) what the CUDA form cannot hold."""
    spec: AttentionSpec = k.value
    dv, keys = k.shape[-1], k.body_shape[-1]
    if not isinstance(dv, int):
        raise ValueError(f"attention kernel {k.id}: the V width {dv} must be a compile-time constant on CUDA")
    chunk_tiles = MAX_ROW_KEYS // spec.key_tile
    if chunk_tiles < 1:
        raise ValueError(f"attention kernel {k.id}: a {spec.key_tile}-key tile does not fit a {MAX_ROW_KEYS}-key chunk")
    if isinstance(keys, int):  # a known shorter row: one chunk of its own length (less shared memory per block)
        chunk_tiles = min(chunk_tiles, max(1, -(-keys // spec.key_tile)))
    if spec.split_keys and not isinstance(keys, int):
        raise ValueError(f"attention kernel {k.id}: a fixed split size needs a known key length, has {keys}")
    splits = row_splits(spec, keys)
    return AttentionPlan(chunk_tiles, splits, min(splits, MAX_SPLIT_LANES), dv)


def attention_scratch(k) -> tuple[Scratch, ...]:
    """Where the partials outgrow shared memory, a region per score row: its splits' running maxima and
    (l, o) per split and V column."""
    plan = attention_plan(k)
    if plan.shared_partials:
        return ()
    return (Scratch("attention_partials", F32, per(prod(k.shape[:-1]), 1) + ((plan.row_floats, 1),)),)


def serial_steps(spec: AttentionSpec, keys: int, depth: int, dv: int) -> int:
    """The steps one block runs in order per score row, the dominant terms (the cost model's serial extent):
    its share of the row's score dots (`depth` products per key over the block's threads) and of the p_j,
    then per group of COLUMN_THREADS V columns a thread's walk over the keys of the splits it is dealt
    (`lanes` splits at once) and the combine over the splits."""
    splits = row_splits(spec, keys)
    lanes = min(splits, MAX_SPLIT_LANES)
    threads = COLUMN_THREADS * lanes
    groups = -(-dv // COLUMN_THREADS)
    return -(-keys * (depth + 1) // threads) + groups * (-(-keys // lanes) + 2 * splits)


def _round_operand(fmt: Format, x: str) -> str:
    """x rounded to the variant's operand format, as a float (overflow to inf, like round_to(INF))."""
    if fmt is F32:
        return x
    if fmt is BF16:
        return f"__bfloat162float(__float2bfloat16_rn({x}))"
    if fmt is F16:
        return f"__half2float(__float2half_rn({x}))"
    raise ValueError(f"no attention operand rounding for {fmt.name}")


def _exp(x: str) -> str:
    return f"static_cast<float>(exp(static_cast<double>({x})))"


def _shifted(x: str, m: str) -> str:
    return f"(({m}) == {NEG_INF}) ? {NEG_INF} : __fsub_rn({x}, {m})"


def _block(lines: list[str], depth: int) -> list[str]:
    return ["    " * depth + line for line in lines]


def render_attention(cx) -> tuple[str, tuple[Launch, ...]]:
    """`cx`: cuda_kernels._Context of the kernel (reads through views, the symbol table)."""
    k = cx.k
    variant, spec, plan = ATTENTION_VARIANTS[k.precision], k.value, attention_plan(k)
    cx.extra_formats |= {variant.qk, variant.pv} - {F32}
    coord_lines, coords = cx.declare("c", unravel("i", [cx.dim(d) for d in k.shape]))
    row, col = coords[:-1], coords[-1]
    q = _round_operand(variant.qk, cx.read_float(0, [*row, "j", "d"]))
    kk = _round_operand(variant.qk, cx.read_float(1, [*row, "j", "d"]))
    bias = cx.read_float(2, [*row, "j"])
    v = _round_operand(variant.pv, cx.read_float(3, [*row, col, "j"]))
    depth = cx.c_dim(k.inputs[0].view.shape[-1])
    tile, ct, threads, lanes, ns, dv = spec.key_tile, plan.chunk_tiles, plan.threads, plan.lanes, plan.splits, plan.dv
    # per row: maxima at base + sp, l at base + ns + sp * dv + col, o at base + ns + ns * dv + sp * dv + col
    l_at, o_off = f"base + {ns}LL + sp * {dv}LL + col", f"{ns * dv}LL"
    score = ["float acc = 0.0f;",
             f"for (long long d = 0; d < {depth}; ++d) {{", f"    acc = __fadd_rn(acc, __fmul_rn({q}, {kk}));", "}",
             f"const float s = __fadd_rn(__fmul_rn(acc, {float_literal(spec.scale)}), {bias});"]
    # a split's tiles within the chunk [ta, tb)
    split_tiles = "long long tl = max(sp * per_split, ta); tl < min((sp + 1) * per_split, tb); ++tl"
    chunk = [
        f"const long long tb = min(ta + {ct}LL, tiles);",
        f"const long long ka = ta * {tile}LL;", f"const long long kb = min(tb * {tile}LL, len);",
        "{  // every score of the chunk, once",
        f"    const long long i = srow * {dv}LL;", *_block(coord_lines, 1),
        f"    for (long long j = ka + t; j < kb; j += {threads}LL) {{", *_block(score, 2),
        "        sc[j - ka] = s;", "    }", "}",
        "__syncthreads();",
        f"for (long long tl = ta + t; tl < tb; tl += {threads}LL) {{  // each tile's max (exact in any order)",
        f"    float mt = {NEG_INF};",
        f"    for (long long j = tl * {tile}LL; j < min(tl * {tile}LL + {tile}LL, len); ++j) {{",
        "        mt = fmaxf(mt, sc[j - ka]);", "    }",
        "    tmax[tl - ta] = mt;", "}",
        "__syncthreads();",
        "const long long sa = ta / per_split;", "const long long sb = (tb - 1) / per_split;",
        f"for (long long sp = sa + t; sp <= sb; sp += {threads}LL) {{  // each split's running max, tile by tile",
        "    float m = part[base + sp];",
        f"    for ({split_tiles}) {{",
        "        const float mn = fmaxf(m, tmax[tl - ta]);",
        f"        talpha[tl - ta] = {_exp(_shifted('m', 'mn'))};",
        "        tmax[tl - ta] = mn;", "        m = mn;", "    }",
        "    part[base + sp] = m;", "}",
        "__syncthreads();",
        f"for (long long j = ka + t; j < kb; j += {threads}LL) {{  // p_j = e(s_j - m') with its tile's m'",
        f"    sc[j - ka] = {_exp(_shifted('sc[j - ka]', f'tmax[(j - ka) / {tile}LL]'))};", "}",
        "__syncthreads();",
        f"for (long long vcol = 0; vcol < {dv}LL; vcol += {COLUMN_THREADS}LL) {{  // each (V column, split)'s sequence",
        f"    const long long col = vcol + t / {lanes}LL;",
        f"    if (col < {dv}LL) {{",
        f"        const long long i = srow * {dv}LL + col;", *_block(coord_lines, 2),
        f"        for (long long sp = sa + t % {lanes}LL; sp <= sb; sp += {lanes}LL) {{",
        f"            float l = part[{l_at}];", f"            float o = part[{l_at} + {o_off}];",
        f"            for ({split_tiles}) {{",
        "                const float alpha = talpha[tl - ta];",
        "                l = __fmul_rn(l, alpha);", "                o = __fmul_rn(o, alpha);",
        f"                for (long long j = tl * {tile}LL; j < min(tl * {tile}LL + {tile}LL, len); ++j) {{",
        "                    const float p = sc[j - ka];", "                    l = __fadd_rn(l, p);",
        f"                    o = __fadd_rn(o, __fmul_rn({_round_operand(variant.pv, 'p')}, {v}));",
        "                }", "            }",
        f"            part[{l_at}] = l;", f"            part[{l_at} + {o_off}] = o;", "        }", "    }", "}",
        "__syncthreads();  // the chunk's scores are read before the next chunk overwrites them"]
    combine = [
        f"const long long i = srow * {dv}LL + col;",
        "float big = part[base];",
        f"for (long long sp = 1; sp < {ns}LL; ++sp) {{", "    big = fmaxf(big, part[base + sp]);", "}",
        "float tl = 0.0f;", "float to = 0.0f;",
        f"for (long long sp = 0; sp < {ns}LL; ++sp) {{",
        f"    const float w = {_exp(_shifted('part[base + sp]', 'big'))};",
        f"    tl = __fadd_rn(tl, __fmul_rn(part[{l_at}], w));",
        f"    to = __fadd_rn(to, __fmul_rn(part[{l_at} + {o_off}], w));", "}",
        f"out[i] = {store(k.dtype, '__fdiv_rn(to, tl)')};"]
    per_split = (f"const long long per_split = {spec.split_keys // tile}LL;" if spec.split_keys
                 else f"const long long per_split = ln_ceil_div(tiles, {ns}LL);")  # fixed ranges from key 0, else equal runs
    body = [
        f"__shared__ float sc[{ct * tile}];", f"__shared__ float tmax[{ct}];", f"__shared__ float talpha[{ct}];",
        *([f"__shared__ float part[{plan.row_floats}];"] if plan.shared_partials else []),
        f"const long long len = {cx.c_dim(k.body_shape[-1])};",
        f"const long long rows = {cx.c_dim(prod(k.shape[:-1]))};",
        "const long long t = threadIdx.x;",
        f"const long long tiles = ln_ceil_div(len, {tile}LL);", per_split,
        "for (long long srow = blockIdx.x; srow < rows; srow += gridDim.x) {",
        f"    const long long base = {'0LL' if plan.shared_partials else f'srow * {plan.row_floats}LL'};",
        f"    for (long long e = t; e < {plan.row_floats}LL; e += {threads}LL) {{  // m = -inf, l = o = 0 per split",
        f"        part[base + e] = (e < {ns}LL) ? {NEG_INF} : 0.0f;", "    }",
        "    __syncthreads();",
        f"    for (long long ta = 0; ta < tiles; ta += {ct}LL) {{  // a chunk: tiles [ta, tb)",
        *_block(chunk, 2), "    }",
        f"    for (long long col = t; col < {dv}LL; col += {threads}LL) {{  // the combine, splits in order",
        *_block(combine, 2), "    }",
        "    __syncthreads();  // the partials are read before the next row overwrites them",
        "}"]
    slots = (0, 1, 2, 3)
    scratch = () if plan.shared_partials else ("float* __restrict__ part",)
    src = (f"// fused attention: {variant.name}, key tile {tile}, {ns} split(s), {ct}-tile chunks\n"
           f'extern "C" __global__ void {ENTRY}({cx.params("out", slots, scratch)}) {{\n'
           + indent(body, 1) + "}\n")
    args = (Arg("out"),) + tuple(Arg("in", s) for s in slots) + ((Arg("scratch", 0),) if scratch else ())
    return src, (Launch(ENTRY, (block_op(k).tiles.factors,), (threads,), args),)  # one block per score row
