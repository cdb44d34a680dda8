"""CUDA C for the fused attention kernel (KernelKind.ATTENTION): the order of operations and
roundings of runtime/cpu_attention.py, one output element (score row, V column) per `splits` threads.

A block holds OUT_THREADS threads: OUT_THREADS / splits outputs, each computed by `splits` threads
that run the online softmax over their own contiguous key tiles and leave (m, l, o) in shared
memory; after one __syncthreads the first of them combines the partials (flash decoding; with one
split the combine is exact: w = e(0) = 1, 0 + l * 1 = l). Blocks loop grid-stride over the groups of
outputs, as the grid is capped at MAX_GRID blocks. Q, K, bias and V are read through their
views (GQA and the KV cache are strides), so scores are never stored. exp is FP64 exp rounded once
to FP32 (the CPU emulation's e()); products and sums are __fmul_rn / __fadd_rn (no FMA contraction).
"""
from __future__ import annotations

from ..dtypes.formats import BF16, F16, F32, Format
from ..hlir.symbolic import prod
from .attention import ATTENTION_VARIANTS
from .cuda_body import float_literal, store, unravel
from .cuda_source import ENTRY, Arg, Launch, indent, per

OUT_THREADS = 32
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
    outs = OUT_THREADS // splits
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
    total = prod(k.shape)
    group = [f"long long i = g * {outs} + t / SPLITS;", "const long long live = i < total;",
             "if (i >= total) i = total - 1;", *coord_lines,
             f"float m = {NEG_INF};", "float l = 0.0f;", "float o = 0.0f;",
             "for (long long tile = sp * per_split; tile < min((sp + 1) * per_split, tiles); ++tile) {",
             *("    " + line for line in tile_loop), "}",
             "part_m[t] = m;", "part_l[t] = l;", "part_o[t] = o;", "__syncthreads();",
             "if (sp == 0 && live) {", *("    " + line for line in combine), "}",
             "__syncthreads();  // the partials are read before the next group overwrites them"]
    body = [f"__shared__ float part_m[{OUT_THREADS}];", f"__shared__ float part_l[{OUT_THREADS}];",
            f"__shared__ float part_o[{OUT_THREADS}];",
            f"const long long total = {cx.c_dim(total)};", f"const long long len = {cx.c_dim(k.body_shape[-1])};",
            "const long long t = threadIdx.x;", "const long long sp = t % SPLITS;",
            "const long long tiles = ln_ceil_div(len, TILE);", "const long long per_split = ln_ceil_div(tiles, SPLITS);",
            f"const long long groups = ln_ceil_div(total, {outs}LL);",
            # grid-stride over groups of outputs: the grid is capped at MAX_GRID blocks (cuda_source.Launch);
            # the bound is the same for every thread of a block, so both __syncthreads are reached by all
            "for (long long g = blockIdx.x; g < groups; g += gridDim.x) {", *("    " + line for line in group), "}"]
    text = "\n".join(body).replace("TILE", f"{spec.key_tile}LL").replace("SPLITS", f"{splits}LL")
    src = (f"// fused attention: {variant.name}, key tile {spec.key_tile}, {splits} split(s)\n"
           f'extern "C" __global__ void {ENTRY}({cx.params("out", slots)}) {{\n' + indent(text.splitlines(), 1)
           + "}\n")
    return src, (Launch(ENTRY, (per(total, outs),), (OUT_THREADS,), (Arg("out"),) + tuple(Arg("in", s) for s in slots)),)
