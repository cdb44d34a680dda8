"""CUDA C for the fused attention kernel (KernelKind.ATTENTION): the order of operations and
roundings of runtime/cpu_attention.py, bit for bit.

Row path (a score row of at most MAX_ROW_KEYS keys): one block per score row (a query of a head),
COLUMN_THREADS x splits threads. The block computes each score s_j once (the dot over the head
dimension in order, then scale and bias) into shared memory, each key tile's max (max is exact in
any order), then per split the running max m' after each of its tiles and the rescale e(m - m'),
then p_j = e(s_j - m') in place. Each (V column, split) thread then runs exactly the emulation's
sequence over its split's tiles: l = l * alpha, o = o * alpha, then l + p_j and o + r(p_j) v_j per
key in order; the split's first thread combines the partials (flash decoding; with one split the
combine is exact). An H200 ran the earlier kernel, which recomputed the whole Q.K row per output
column and twice per key, at ~270 us per SmolLM2 decode layer (reports/bench/gpu_kernels.csv).
Longer rows than shared memory holds take that earlier form: one output per `splits` threads, each
recomputing its scores. Blocks loop grid-stride over rows (or groups of outputs), as the grid is capped
at MAX_GRID blocks. Q, K, bias and V are read through their views (GQA and the KV cache are strides).
exp is FP64 exp rounded once to FP32 (the CPU emulation's e()); products and sums are __fmul_rn /
__fadd_rn (no FMA contraction).
"""
from __future__ import annotations

from ..dtypes.formats import BF16, F16, F32, Format
from ..hlir.symbolic import prod
from .attention import ATTENTION_VARIANTS
from .cuda_body import float_literal, store, unravel
from .cuda_source import ENTRY, Arg, Launch, indent, per

COLUMN_THREADS = 32   # V columns a block computes at once, each by `splits` threads
MAX_ROW_KEYS = 4096   # a score row up to this long is held in shared memory (16 KB): each score computed once
NEG_INF = "(-__int_as_float(0x7f800000))"


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


def render_attention(cx) -> tuple[str, tuple[Launch, ...]]:
    """`cx`: cuda_kernels._Context of the kernel (reads through views, the symbol table)."""
    k = cx.k
    variant, spec = ATTENTION_VARIANTS[k.precision], k.value
    cx.extra_formats |= {variant.qk, variant.pv} - {F32}
    rows_dims = [cx.dim(d) for d in k.shape]
    coord_lines, coords = cx.declare("c", unravel("i", rows_dims))
    row, col = coords[:-1], coords[-1]
    q = _round_operand(variant.qk, cx.read_float(0, [*row, "j", "d"]))
    kk = _round_operand(variant.qk, cx.read_float(1, [*row, "j", "d"]))
    bias = cx.read_float(2, [*row, "j"])
    v = _round_operand(variant.pv, cx.read_float(3, [*row, col, "j"]))
    depth = cx.c_dim(k.inputs[0].view.shape[-1])
    score = ["float acc = 0.0f;",
             f"for (long long d = 0; d < {depth}; ++d) {{", f"    acc = __fadd_rn(acc, __fmul_rn({q}, {kk}));", "}",
             f"const float s = __fadd_rn(__fmul_rn(acc, {float_literal(spec.scale)}), {bias});"]
    splits = spec.splits
    tile_loop = [
        "const long long j0 = tile * TILE;", "const long long j1 = min(j0 + TILE, len);",
        f"float mt = {NEG_INF};",
        "for (long long j = j0; j < j1; ++j) {", *("    " + line for line in score), "    mt = fmaxf(mt, s);", "}",
        "const float mn = fmaxf(m, mt);",
        f"const float alpha = {_exp(_shifted('m', 'mn'))};",
        "l = __fmul_rn(l, alpha);", "o = __fmul_rn(o, alpha);",
        "for (long long j = j0; j < j1; ++j) {", *("    " + line for line in score),
        f"    const float p = {_exp(_shifted('s', 'mn'))};",
        "    l = __fadd_rn(l, p);",
        f"    o = __fadd_rn(o, __fmul_rn({_round_operand(variant.pv, 'p')}, {v}));", "}",
        "m = mn;"]
    combine = [
        "float big = part_m[t];",
        "for (long long r = 1; r < SPLITS; ++r) {", "    big = fmaxf(big, part_m[t + r]);", "}",
        "float tl = 0.0f;", "float to = 0.0f;",
        "for (long long r = 0; r < SPLITS; ++r) {",
        f"    const float w = {_exp(_shifted('part_m[t + r]', 'big'))};",
        "    tl = __fadd_rn(tl, __fmul_rn(part_l[t + r], w));",
        "    to = __fadd_rn(to, __fmul_rn(part_o[t + r], w));", "}",
        f"out[i] = {store(k.dtype, '__fdiv_rn(to, tl)')};"]
    slots = (0, 1, 2, 3)
    total, rows = prod(k.shape), prod(k.shape[:-1])
    threads = COLUMN_THREADS * splits
    # the row path: one block per score row; scores once, then each column's sequence from shared memory
    row_scores = ["for (long long j = t; j < len; j += THREADS) {", *("    " + line for line in score),
                  "    sc[j] = s;", "}"]
    row_path = [
        "for (long long srow = blockIdx.x; srow < rows; srow += gridDim.x) {",
        "    {  // every score of the row, once",
        "        const long long i = srow * dv;", *("        " + line for line in coord_lines),
        *("        " + line for line in row_scores), "    }",
        "    __syncthreads();",
        "    for (long long tile = t; tile < tiles; tile += THREADS) {  // each tile's max (max is exact: any order)",
        f"        float mt = {NEG_INF};",
        "        for (long long j = tile * TILE; j < min(tile * TILE + TILE, len); ++j) {", "            mt = fmaxf(mt, sc[j]);", "        }",
        "        tmax[tile] = mt;", "    }",
        "    __syncthreads();",
        "    if (t < SPLITS) {  // each split's running max after each of its tiles, and the tile's rescale",
        f"        float m = {NEG_INF};",
        "        for (long long tile = t * per_split; tile < min((t + 1) * per_split, tiles); ++tile) {",
        "            const float mn = fmaxf(m, tmax[tile]);",
        f"            talpha[tile] = {_exp(_shifted('m', 'mn'))};",
        "            tmax[tile] = mn;", "            m = mn;", "        }",
        "        split_m[t] = m;", "    }",
        "    __syncthreads();",
        "    for (long long j = t; j < len; j += THREADS) {  // p_j = e(s_j - m') with its tile's m'",
        f"        sc[j] = {_exp(_shifted('sc[j]', 'tmax[j / TILE]'))};", "    }",
        "    __syncthreads();",
        "    for (long long vcol = 0; vcol < dv; vcol += COLUMNS) {",
        "        const long long live = vcol + t / SPLITS < dv;",
        "        const long long i = srow * dv + min(vcol + t / SPLITS, dv - 1);", *("        " + line for line in coord_lines),
        "        float l = 0.0f;", "        float o = 0.0f;",
        "        for (long long tile = sp * per_split; tile < min((sp + 1) * per_split, tiles); ++tile) {",
        "            const float alpha = talpha[tile];",
        "            l = __fmul_rn(l, alpha);", "            o = __fmul_rn(o, alpha);",
        "            for (long long j = tile * TILE; j < min(tile * TILE + TILE, len); ++j) {",
        "                const float p = sc[j];", "                l = __fadd_rn(l, p);",
        f"                o = __fadd_rn(o, __fmul_rn({_round_operand(variant.pv, 'p')}, {v}));", "            }", "        }",
        "        part_l[t] = l;", "        part_o[t] = o;", "        part_m[t] = split_m[sp];",
        "        __syncthreads();",
        "        if (sp == 0 && live) {", *("            " + line for line in combine), "        }",
        "        __syncthreads();", "    }", "}"]
    group = [f"long long i = g * (THREADS / SPLITS) + t / SPLITS;", "const long long live = i < total;",
             "if (i >= total) i = total - 1;", *coord_lines,
             f"float m = {NEG_INF};", "float l = 0.0f;", "float o = 0.0f;",
             "for (long long tile = sp * per_split; tile < min((sp + 1) * per_split, tiles); ++tile) {",
             *("    " + line for line in tile_loop), "}",
             "part_m[t] = m;", "part_l[t] = l;", "part_o[t] = o;", "__syncthreads();",
             "if (sp == 0 && live) {", *("    " + line for line in combine), "}",
             "__syncthreads();  // the partials are read before the next group overwrites them"]
    body = [f"__shared__ float sc[{MAX_ROW_KEYS}];", f"__shared__ float tmax[{MAX_ROW_KEYS // spec.key_tile + 1}];",
            f"__shared__ float talpha[{MAX_ROW_KEYS // spec.key_tile + 1}];", f"__shared__ float split_m[{splits}];",
            f"__shared__ float part_m[{threads}];", f"__shared__ float part_l[{threads}];", f"__shared__ float part_o[{threads}];",
            f"const long long total = {cx.c_dim(total)};", f"const long long len = {cx.c_dim(k.body_shape[-1])};",
            f"const long long dv = {cx.c_dim(k.shape[-1])};", f"const long long rows = {cx.c_dim(rows)};",
            "const long long t = threadIdx.x;", "const long long sp = t % SPLITS;",
            "const long long tiles = ln_ceil_div(len, TILE);",
            # a fixed split size (a batch-invariant plan): ranges from key 0 whatever len; else SPLITS equal runs
            f"const long long per_split = {spec.split_keys // spec.key_tile}LL;" if spec.split_keys
            else "const long long per_split = ln_ceil_div(tiles, SPLITS);",
            "const long long groups = ln_ceil_div(total, THREADS / SPLITS);",
            f"if (len <= {MAX_ROW_KEYS}) {{", *("    " + line for line in row_path), "}",
            # longer rows than shared memory holds: each output recomputes its scores (the grid-stride loop
            # over groups of outputs); the bounds are the same for every thread of a block, so every
            # __syncthreads is reached by all
            f"if (len > {MAX_ROW_KEYS}) {{",
            "    for (long long g = blockIdx.x; g < groups; g += gridDim.x) {", *("        " + line for line in group),
            "    }", "}"]
    text = "\n".join(body).replace("THREADS", f"{threads}LL").replace("COLUMNS", f"{COLUMN_THREADS}LL")
    text = text.replace("TILE", f"{spec.key_tile}LL").replace("SPLITS", f"{splits}LL")
    src = (f"// fused attention: {variant.name}, key tile {spec.key_tile}, {splits} split(s)\n"
           f'extern "C" __global__ void {ENTRY}({cx.params("out", slots)}) {{\n' + indent(text.splitlines(), 1)
           + "}\n")
    return src, (Launch(ENTRY, (per(rows, 1),), (threads,), (Arg("out"),) + tuple(Arg("in", s) for s in slots)),)
