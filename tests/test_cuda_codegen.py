"""CUDA code generation without a GPU: every kernel compiles with NVRTC, and the generated C computes
what the CPU backend computes.

The oracle for the C is tests/cuda_interpreter.py, which runs a kernel entry single-threaded on the
CPU with IEEE intrinsics and luminal_num.dtypes.rounding; the references are the CPU backend
(runtime/cpu.py), ShapeTracker.index_map, luminal_num.quant.scales and a numpy model of cuBLAS's
column-major strided-batched GEMM.
"""
from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_interpreter import Buffer, compile_entry, entry_body, eval_expr, launch, round_format
from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_body import OP_TEMPLATES, SymbolTable, is_exact, op_template, view_index, view_symbols
from luminal_num.codegen.cuda_gemm import COMPUTE_TYPES
from luminal_num.codegen.cuda_kernels import RENDERERS, Arg, gemm_call, render_kernel
from luminal_num.codegen.rows import row_sums
from luminal_num.codegen.llir import (FApply, FConstV, FLoad, FRoundTo, Kernel, KernelInput, KernelKind, Program)
from luminal_num.search.lower import lower_program
from luminal_num.dtypes.formats import BF16, F8E4M3, F16, F32, F64, INT32, Kind
from luminal_num.dtypes.rounding import Overflow, round_to
from luminal_num.dtypes.variants import GEMM_VARIANTS, limited_accumulator
from luminal_num.hlir.gemm import gemm_layouts
from luminal_num.hlir.ops import BINARY_OPS, CUSTOM_KINDS, UNARY_OPS, Op
from luminal_num.hlir.partition import partition
from luminal_num.hlir.shape import ShapeTracker
from luminal_num.hlir.symbolic import evaluate, prod, sym
from luminal_num.models.testnets import all_test_models, transformer
from luminal_num.quant import compute_scales, quantize
from luminal_num.runtime.cpu import CpuRuntime, bind_program
from luminal_num.runtime.cublas import lt_layouts
from luminal_num.search.choice import random_candidate
from luminal_num.search.saturate import saturate_group

needs_nvrtc = pytest.mark.skipif(not (nvrtc.nvrtc_available() and nvrtc.toolchain().include_dirs),
                                 reason="libnvrtc or the CUDA headers are missing")
MODELS = {m.name: m for m in [*all_test_models(), transformer(1, symbolic_seq=True)]}
CANDIDATES = 20


@functools.cache
def programs(name: str, count: int) -> tuple[Program, ...]:
    model = MODELS[name]
    part = partition(model.graph)
    spaces = {g.key: saturate_group(model.graph, g) for g in part.groups}
    rng = np.random.default_rng(11)
    return tuple(lower_program(model.graph, part, spaces,
                               {c.index: random_candidate(spaces[g.key].space, rng) for g in part.groups for c in g.chunks})
                 for _ in range(count))


# -- running generated code on the CPU -----------------------------------------------------------------------

def stored_values(program: Program, feed: dict, weights: dict | None = None) -> dict[int, np.ndarray]:
    """Every buffer as the CPU backend stores it (float64 copies), in-place scatter destinations too;
    `weights`: the graph's weights (a weight held in a storage format is then widened, not a KV cache)."""
    aliased = {k.inputs[0].buffer for k in program.kernels if k.kind.in_place}
    feed = {n: v for n, v in feed.items() if n not in (weights or {})}
    everything = dataclasses.replace(program, outputs=tuple((f"k{k.id}", k.id) for k in program.kernels
                                                            if k.id not in aliased))
    out = {int(n[1:]): v for n, v in CpuRuntime(everything, weights).run(feed).outputs.items()}
    externals = tuple(k for k in program.kernels if k.kind is KernelKind.EXTERNAL)
    sources = Program(externals, program.inputs, tuple((f"k{k.id}", k.id) for k in externals))
    out.update({int(n[1:]): v for n, v in CpuRuntime(sources, weights).run(feed).outputs.items()})
    return out


def stored_parts(program: Program, feed: dict) -> dict[int, list[Buffer]]:
    """Every weight a Gemm reads as its stored parts: those parts (packed codes, scales) as the CUDA runtime
    uploads them (runtime/cuda.py: the plan's conversion, packed), as interpreter buffers."""
    from luminal_num.codegen.cuda_weight_only import stored_operand
    from luminal_num.runtime.weight_only import stored_weight
    out = {}
    for k in program.launched():
        operand = stored_operand(k, program)
        if operand is not None and k.inputs[1].buffer not in out:
            fmt = operand.fmt
            arrays = fmt.pack(stored_weight(program.kernel(k.inputs[1].buffer), feed)).arrays
            out[k.inputs[1].buffer] = [Buffer(np.asarray(arrays[p]).astype(np.float64).reshape(-1),
                                              np.asarray(arrays[p]).dtype.kind in "iu") for p in fmt.parts]
    return out


def run_launches(src, launches, program: Program, stored: dict, bindings: dict, out: Buffer, scratch: list,
                 parts: dict | None = None) -> None:
    """Run launches of a KernelSource in the interpreter (lockstep threads where the entry synchronises);
    `parts`: stored_parts(), for a Gemm reading a stored weight's parts."""
    integer = {k.id: k.dtype.kind is Kind.INT for k in program.kernels}
    for launch_ in launches:
        fn, params = compile_entry(src.source, launch_.entry)
        args = {}
        for name, arg in zip(params, launch_.args):
            if arg.role == "out":
                args[name] = out
            elif arg.role == "scratch":
                args[name] = scratch[arg.index]
            elif arg.role == "part":
                if parts is None or arg.buffer not in parts:
                    raise ValueError(f"{launch_.entry} reads weight {arg.buffer}'s stored parts: pass stored_parts()")
                args[name] = parts[arg.buffer][arg.index]
            else:
                args[name] = Buffer(np.array(stored[arg.buffer], dtype=np.float64).reshape(-1), integer[arg.buffer])
        if src.symbols.symbols:
            args["dyn_dims"] = Buffer(np.asarray(src.dyn_values(bindings), dtype=np.float64), True)
        if "__syncthreads" in entry_body(src.source, launch_.entry)[1]:
            launch(fn, args, *launch_.config(bindings))  # cooperating threads (the tiled Gemm)
        else:
            fn(**args)


def interpret(program: Program, kernel: Kernel, stored: dict[int, np.ndarray], bindings: dict,
              parts: dict | None = None, src=None, tensor_core: bool = False) -> np.ndarray:
    """The kernel's output computed by running its generated C (every launch) in the interpreter (`src`:
    another rendering of it than render_kernel's; `tensor_core`: a Gemm's tensor-core launches instead of
    its tiled ones)."""
    src = src or render_kernel(kernel, program)
    first = stored[kernel.inputs[0].buffer] if kernel.kind.in_place else \
        np.zeros(kernel.numel(bindings))
    out = Buffer(np.array(first, dtype=np.float64).reshape(-1), kernel.dtype.kind is Kind.INT)
    scratch = [Buffer(np.zeros(s.numel(bindings)), False) for s in src.scratch]
    # its at-load launches first (a weight's static scales), as the runtime runs them once after the upload
    run_launches(src, src.at_load + (src.tensor_core if tensor_core else src.launches), program, stored, bindings, out,
                 scratch, parts)
    return out.values.reshape([evaluate(d, bindings) for d in kernel.shape])


def tolerance(kernel: Kernel, ref: np.ndarray, bindings=None) -> float:
    """0 where CUDA and the CPU backend agree bit for bit; else the documented envelope."""
    scale = float(np.max(np.abs(ref), initial=0.0)) + 1.0
    wide_sums = [s for s in row_sums(kernel.body) if s.acc in (F32, F64)] if kernel.kind is KernelKind.ROWS else []
    if wide_sums:  # an FP32 row sum is a block reduce on the GPU (another order): the SUM envelope, with a
        # factor 2 for the row's tail (a norm's rsqrt halves a relative change, the scale by x keeps it)
        return 2 * max(evaluate(s.shape[-1], bindings or {}) for s in wide_sums) * 2.0 ** -23 * scale
    if kernel.kind is KernelKind.SUM:
        narrow = kernel.acc not in (None, F32, F64)
        return 0.0 if narrow else evaluate(kernel.body_shape[kernel.axis], bindings or {}) * 2.0 ** -23 * scale
    if kernel.kind is KernelKind.SOFTMAX:
        return 2.0 ** -18
    if kernel.kind is KernelKind.GEMM_EPILOGUE:  # an FP32 accumulation over K in the kernel's own order, against
        # the CPU backend's BLAS (whose order depends on the kernel the CPU picks): the dot-product envelope
        k = evaluate(kernel.layout.full_shape[kernel.layout.k_axis], bindings or {})
        return k * 2.0 ** -23 * scale + (0.0 if is_exact(kernel.body) else 2.0 ** -18 * scale)
    return 0.0 if is_exact(kernel.body) else 2.0 ** -18 * scale


def check_against_cpu(program: Program, feed: dict, kernels=None) -> int:
    bindings = bind_program(program, feed)
    stored = stored_values(program, feed)
    parts = stored_parts(program, feed)
    checked = 0
    for k in kernels or program.launched():
        if k.kind is KernelKind.GEMM:
            continue
        got, ref = interpret(program, k, stored, bindings, parts), stored[k.id].reshape([evaluate(d, bindings) for d in k.shape])
        np.testing.assert_allclose(got, ref, rtol=0, atol=tolerance(k, ref, bindings), err_msg=f"kernel {k.id} {k.kind}")
        checked += 1
    return checked


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generated_kernels_compute_what_the_cpu_backend_computes(name):
    model = MODELS[name]
    inputs = model.make_inputs(5)
    assert check_against_cpu(programs(name, 2)[1], {**model.graph.weights, **inputs}) > 0


# -- views: the rendered index math is ShapeTracker.index_map ------------------------------------------------

def assert_view_rendering(view: ShapeTracker, bindings: dict) -> None:
    table = SymbolTable.of(view_symbols(view))
    shape = [evaluate(d, bindings) for d in view.shape]
    names = [f"c{i}" for i in range(len(shape))]
    at = view_index(view, names, table)
    pos, valid = view.index_map(bindings)
    dyn = Buffer(np.asarray([bindings[s] for s in table.symbols], dtype=np.float64), True)
    for index in np.ndindex(*shape):
        env = {"dyn_dims": dyn, **dict(zip(names, (int(i) for i in index)))}
        ok = True if at.valid is None else bool(eval_expr(at.valid, env))
        assert ok == bool(valid[index]), (view, index)
        if ok:
            got = at.pos if isinstance(at.pos, int) else eval_expr(at.pos, env)
            assert got == pos[index], (view, index, at.pos)


@st.composite
def views(draw):
    view = ShapeTracker.contiguous(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    for _ in range(draw(st.integers(0, 5))):
        shape = view.shape
        op = draw(st.sampled_from(["permute", "slice", "pad", "expand_dim", "expand", "reshape"]))
        if op == "permute":
            view = view.permute(draw(st.permutations(range(len(shape)))))
        elif op == "slice":
            starts = [draw(st.integers(0, d - 1)) for d in shape]
            view = view.slice([(a, draw(st.integers(a + 1, d))) for a, d in zip(starts, shape)])
        elif op == "pad":
            view = view.pad([(draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in shape])
        elif op == "expand_dim" and len(shape) < 4:
            view = view.expand_dim(draw(st.integers(0, len(shape))), draw(st.integers(1, 3)))
        elif op == "expand" and 1 in shape:
            view = view.expand(draw(st.sampled_from([i for i, d in enumerate(shape) if d == 1])), draw(st.integers(1, 3)))
        elif op == "reshape":
            n = prod(shape)
            a = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
            view = view.reshape((a, n // a) if draw(st.booleans()) else (n // a, a))
    return view


@settings(deadline=None, max_examples=150)
@given(views())
def test_rendered_view_index_is_the_shape_trackers_index_map(view):
    assert_view_rendering(view, {})


def test_symbolic_views_render_through_dyn_dims():
    seen = {inp.view for p in programs("transformer1", 1) for k in p.kernels for inp in k.inputs}
    assert any(view_symbols(v) for v in seen)
    for view in seen:
        for s in (1, 3):
            assert_view_rendering(view, {"s": s})


# -- hand-built kernels of every kind ----------------------------------------------------------------------------

def one_kernel(externals, /, **kernel) -> Program:
    """EXTERNAL kernels for `externals` [(name, shape, dtype)], then the kernel under test (the output)."""
    ks = [Kernel(id=i, kind=KernelKind.EXTERNAL, inputs=(), shape=tuple(shape), dtype=fmt, external=name)
          for i, (name, shape, fmt) in enumerate(externals)]
    ks.append(Kernel(id=len(ks), **{"inputs": (), **kernel}))
    return Program(tuple(ks), tuple((name, i) for i, (name, _, _) in enumerate(externals)), (("y", len(ks) - 1),))


def ld(slot):
    return FLoad(slot)


def ap(op, *args):
    return FApply(op, args)


S = sym("s")
X = ShapeTracker.contiguous((4, 5))
PADDED = ShapeTracker.contiguous((3, 4)).slice([(1, 3), (0, 4)]).pad([(1, 1), (0, 1)])  # (4, 5), masked
STACKED = ShapeTracker.contiguous((4, 5)).permute((1, 0)).reshape((4, 5))  # two views
EW = KernelKind.ELEMENTWISE
HAND_BUILT = {
    "masked_bf16_store": one_kernel([("a", (3, 4), F32), ("b", (4, 5), F32)], kind=EW, shape=(4, 5), dtype=BF16,
                                    inputs=(KernelInput(0, PADDED), KernelInput(1, X)), body_shape=(4, 5),
                                    body=ap(Op.ADD, ap(Op.MUL, ld(0), ld(1)), FConstV(0.1))),
    "stacked_view_exact_ops": one_kernel(
        [("a", (4, 5), F32)], kind=EW, shape=(4, 5), dtype=F16, inputs=(KernelInput(0, STACKED),), body_shape=(4, 5),
        body=ap(Op.ADD, ap(Op.RECIP, ap(Op.SQRT, ap(Op.MUL, ld(0), ld(0)))),
                ap(Op.ADD, ap(Op.MOD, ld(0), FConstV(0.75)), ap(Op.LESS_THAN, ld(0), FConstV(0.0))))),
    "round_to_bf16_and_fp8": one_kernel(
        [("a", (4, 5), F32)], kind=EW, shape=(4, 5), dtype=F8E4M3, inputs=(KernelInput(0, X),), body_shape=(4, 5),
        body=ap(Op.MUL, FRoundTo(ld(0), BF16), FRoundTo(ap(Op.MUL, ld(0), FConstV(300.0)), F8E4M3))),
    "int32_store_truncates": one_kernel([("a", (4, 5), F32)], kind=EW, shape=(4, 5), dtype=INT32,
                                        inputs=(KernelInput(0, X),), body_shape=(4, 5), body=ap(Op.MUL, ld(0), FConstV(7.0))),
    "symbolic_dims": one_kernel([("a", (S, 3), F32)], kind=EW, shape=(S, 3), dtype=F32,
                                inputs=(KernelInput(0, ShapeTracker.contiguous((S, 3))),), body_shape=(S, 3),
                                body=ap(Op.ADD, ld(0), FConstV(S))),
    "sum_bf16_accumulator": one_kernel([("a", (4, 5), BF16)], kind=KernelKind.SUM, shape=(4,), dtype=BF16, acc=BF16,
                                       inputs=(KernelInput(0, ShapeTracker.contiguous((5, 4)).permute((1, 0))),),
                                       body_shape=(4, 5), axis=1, body=ld(0)),
    "sum_f16_accumulator_axis0": one_kernel([("a", (70, 3), F32)], kind=KernelKind.SUM, shape=(3,), dtype=F32,
                                            acc=F16, inputs=(KernelInput(0, ShapeTracker.contiguous((70, 3))),),
                                            body_shape=(70, 3), axis=0, body=ap(Op.MUL, ld(0), ld(0))),
    "sum_f32_long_row": one_kernel([("a", (3, 300), F32)], kind=KernelKind.SUM, shape=(3,), dtype=F32, acc=F32,
                                   inputs=(KernelInput(0, ShapeTracker.contiguous((3, 300))),), body_shape=(3, 300),
                                   axis=1, body=ld(0)),
    "max_over_padding": one_kernel([("a", (3, 4), F32)], kind=KernelKind.MAX, shape=(4,), dtype=F32,
                                   inputs=(KernelInput(0, PADDED),), body_shape=(4, 5), axis=1, body=ld(0)),
    "softmax_axis0_bf16": one_kernel([("a", (4, 5), F32)], kind=KernelKind.SOFTMAX, shape=(5, 4), dtype=BF16,
                                     inputs=(KernelInput(0, X.permute((1, 0))),), body_shape=(5, 4), axis=0,
                                     body=ap(Op.MUL, ld(0), FConstV(3.0)), precision="bf16"),
    "gather_bf16_table": one_kernel([("t", (6, 3), BF16), ("i", (4,), INT32)], kind=KernelKind.GATHER, shape=(4, 3),
                                    dtype=F32, inputs=(KernelInput(0, ShapeTracker.contiguous((6, 3))),
                                                       KernelInput(1, ShapeTracker.contiguous((4,))))),
    "scatter_last_duplicate_wins": one_kernel(
        [("d", (6, 3), F32), ("s", (4, 3), F32), ("i", (4,), INT32)], kind=KernelKind.SCATTER, shape=(6, 3),
        dtype=F32, inputs=tuple(KernelInput(b, ShapeTracker.contiguous(s)) for b, s in ((0, (6, 3)), (1, (4, 3)), (2, (4,))))),
    "scatter_in_place": one_kernel(
        [("d", (6, 3), F32), ("s", (3, 3), F32), ("i", (3,), INT32)], kind=KernelKind.SCATTER_NOCOPY, shape=(6, 3),
        dtype=F32, aliases=0,
        inputs=tuple(KernelInput(b, ShapeTracker.contiguous(s)) for b, s in ((0, (6, 3)), (1, (3, 3)), (2, (3,))))),
    "const_bf16": one_kernel([], kind=KernelKind.CONST, shape=(), dtype=BF16, value=1e-5),
    "iota_symbolic_f16": one_kernel([("a", (S,), F32)], kind=KernelKind.IOTA, shape=(S,), dtype=F16, value=S),
}
def feed_for(program: Program, rng) -> dict:
    feed = {}
    for k in program.kernels:
        if k.kind is KernelKind.EXTERNAL:
            shape = tuple(evaluate(d, {"s": 7}) for d in k.shape)
            if k.dtype is INT32:
                feed[k.external] = np.array([1, 4, 1, 5][:shape[0]] if k.external == "i" and shape[0] == 4
                                            else rng.permutation(6)[:shape[0]], dtype=np.int32)
            else:
                feed[k.external] = rng.standard_normal(shape) * 3.0
    return feed


@pytest.mark.parametrize("case", sorted(HAND_BUILT))
def test_hand_built_kernel_matches_cpu_backend(case):
    program = HAND_BUILT[case]
    assert check_against_cpu(program, feed_for(program, np.random.default_rng(3))) == 1


def test_ln_round_format_is_round_to_and_the_fp8_case_overflows():
    """ln_round_format (as the interpreter runs it) is rounding.round_to for a narrow accumulator under both
    overflow policies; and the fp8 hand-built case really overflows, so its saturation is checked."""
    rng = np.random.default_rng(3)
    a = feed_for(HAND_BUILT["round_to_bf16_and_fp8"], rng)["a"]
    assert np.max(np.abs(a * 300.0)) > F8E4M3.max_finite
    acc = limited_accumulator(13)
    x = np.array([1.0 + 2.0 ** -14, 1.0 + 3 * 2.0 ** -14, 3.4028e38, -7.5e-40, np.inf])
    for overflow in (Overflow.INF, Overflow.SATURATE):
        bound = acc.max_finite if overflow is Overflow.SATURATE else np.inf
        got = [round_format(v, acc.p - 1, acc.min_normal, acc.min_subnormal, acc.max_finite, bound) for v in x]
        np.testing.assert_array_equal(got, round_to(x, acc, overflow))


# -- Gemm: the cuBLAS call reproduces the CPU backend's product; every variant has compiled code -------------

def gemm_program(full, a_shape, a_view, b_shape, b_view, k_axis, precision="f32", variant_index=0) -> Program:
    layout = gemm_layouts(a_view, b_view, k_axis)[variant_index]
    shape = tuple(d for i, d in enumerate(full) if i != k_axis)
    return one_kernel([("a", a_shape, F32), ("b", b_shape, F32)], kind=KernelKind.GEMM, shape=shape, dtype=F32,
                      inputs=(KernelInput(0, a_view), KernelInput(1, b_view)), layout=layout, precision=precision)


def gemm_cases(m: int, n: int, k: int, precision: str = "f32") -> dict:
    """name: (program, whether cuBLAS can express it) for the layouts the lowering produces."""
    a, b = ShapeTracker.contiguous((m, k)), ShapeTracker.contiguous((k, n))
    p = precision
    return {
        "row_major": (gemm_program((m, n, k), (m, k), a.expand_dim(1, n), (k, n), b.permute((1, 0)).expand_dim(0, m), 2,
                                   p), True),
        "a_stored_transposed": (gemm_program((m, n, k), (k, m), ShapeTracker.contiguous((k, m)).permute((1, 0)).expand_dim(1, n),
                                             (k, n), b.permute((1, 0)).expand_dim(0, m), 2, p), True),
        "output_column_major": (gemm_program((n, m, k), (m, k), a.expand_dim(0, n), (k, n), b.permute((1, 0)).expand_dim(1, m),
                                             2, p), True),
        "batched_shared_weight": (gemm_program(
            (3, m, n, k), (3, m, k), ShapeTracker.contiguous((3, m, k)).expand_dim(2, n), (k, n),
            b.permute((1, 0)).expand_dim(0, m).expand_dim(0, 3), 3, p), True),
        "two_batch_axes_collapse": (gemm_program(
            (2, 3, m, n, k), (2, 3, m, k), ShapeTracker.contiguous((2, 3, m, k)).expand_dim(3, n), (2, 3, k, n),
            ShapeTracker.contiguous((2, 3, k, n)).permute((0, 1, 3, 2)).expand_dim(2, m), 4, p), True),
        "batch_axes_do_not_collapse": (gemm_program(
            (2, 3, m, n, k), (3, 2, m, k), ShapeTracker.contiguous((3, 2, m, k)).permute((1, 0, 2, 3)).expand_dim(3, n),
            (2, 3, k, n), ShapeTracker.contiguous((2, 3, k, n)).permute((0, 1, 3, 2)).expand_dim(2, m), 4, p), False),
        "flattened_m_axes": (gemm_program(
            (2, 3, n, k), (2, 3, k), ShapeTracker.contiguous((2, 3, k)).expand_dim(2, n), (k, n),
            b.permute((1, 0)).expand_dim(0, 3).expand_dim(0, 2), 3, p, variant_index=1), True),
    }


M, N, K = 5, 6, 7
GEMMS = gemm_cases(M, N, K)


def simulate_cublas(call, buffers: dict[int, np.ndarray], c_size: int) -> np.ndarray:
    """cublasGemmStridedBatchedEx by its definition: column-major, op(X)[r, c] = X[r + c ld] or X[c + r ld]."""
    assert call.legal()
    c = np.full(c_size, np.nan)
    rows, cols, inner = np.arange(call.m)[:, None], np.arange(call.n)[None, :], np.arange(call.k)
    for i in range(call.batch):
        a_at = call.a_offset + i * call.stride_a + (inner[None, :] + rows * call.lda if call.transa
                                                     else rows + inner[None, :] * call.lda)
        b_at = call.b_offset + i * call.stride_b + (cols + inner[:, None] * call.ldb if call.transb
                                                     else inner[:, None] + cols * call.ldb)
        c[i * call.stride_c + rows + cols * call.ldc] = buffers[call.a.buffer][a_at] @ buffers[call.b.buffer][b_at]
    return c


@pytest.mark.parametrize("case", sorted(GEMMS))
def test_cublas_call_reproduces_the_cpu_gemm(case):
    program, expressible = GEMMS[case]
    feed = feed_for(program, np.random.default_rng(4))
    kernel = program.kernels[-1]
    call = gemm_call(kernel, program)
    assert (call is not None) == expressible
    if call is not None:
        stored = {kid: v.reshape(-1) for kid, v in stored_values(program, feed).items()}
        got = simulate_cublas(call.bind({}), stored, kernel.numel({}))
        np.testing.assert_allclose(got, stored[kernel.id], rtol=0, atol=K * 2.0 ** -22 * np.abs(stored[kernel.id]).max())


def test_model_gemms_map_to_cublas_and_reproduce_the_cpu_gemm():
    model = MODELS["transformer1"]
    program = programs("transformer1", 1)[0]
    feed = {**model.graph.weights, **model.make_inputs(2)}
    stored = {kid: v.reshape(-1) for kid, v in stored_values(program, feed).items()}
    bindings = bind_program(program, feed)
    gemms = [k for k in program.launched() if k.kind is KernelKind.GEMM]
    # an operand read through stacked views (a random structure's reshape) has no single leading dimension:
    # the tiled fallback kernel computes it (checked against the CPU backend by the generated-kernel tests)
    stacked = [k for k in gemms if any(len(i.view.views) > 1 for i in k.inputs)]
    assert all(gemm_call(k, program) is None for k in stacked)
    gemms = [k for k in gemms if k not in stacked]
    assert gemms
    for k in gemms:
        call = gemm_call(k, program)
        assert call is not None and call.compute_type == "CUBLAS_COMPUTE_32F"
        got = simulate_cublas(call.bind(bindings), stored, k.numel(bindings))
        np.testing.assert_allclose(got, stored[k.id], rtol=0, atol=evaluate(k.layout.k, bindings) * 2.0 ** -22
                                   * np.abs(stored[k.id]).max())


EXPECTED_CALLS = {"f32": "CUBLAS_COMPUTE_32F", "tf32": "CUBLAS_COMPUTE_32F_FAST_TF32",
                  "bf16": "CUBLAS_COMPUTE_32F_FAST_16BF", "f16": "CUBLAS_COMPUTE_32F_FAST_16F",
                  "f8e4m3_tensor": "CUBLAS_COMPUTE_32F",
                  "f8e4m3_tensor_dynamic": "CUBLAS_COMPUTE_32F"}  # every other variant: the fallback kernel


@needs_nvrtc
def test_every_gemm_variant_has_a_call_or_a_compiled_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
    base, _ = GEMMS["batched_shared_weight"]
    sources = []
    for name in GEMM_VARIANTS:
        program = dataclasses.replace(base, kernels=base.kernels[:-1] + (
            dataclasses.replace(base.kernels[-1], precision=name),))
        src = render_kernel(program.kernels[-1], program)
        assert (src.gemm is None) == (name not in EXPECTED_CALLS), name
        if src.gemm is not None:
            assert src.gemm.compute_type == EXPECTED_CALLS[name] and src.gemm.compute_type in COMPUTE_TYPES
            assert src.gemm.api == ("cublasLt" if name.startswith("f8") else "cublas")
        sources.append(src)
    with ThreadPoolExecutor(2) as pool:
        compiled = list(pool.map(lambda s: nvrtc.compile_cuda(s.source, s.name), sources))
    for src, kernel in zip(sources, compiled):
        assert all(f".entry {entry}(" in kernel.ptx for entry in src.entries)


SCALED = [name for name, v in GEMM_VARIANTS.items() if v.a_scale is not None]


@pytest.mark.parametrize("name", SCALED)
def test_scale_kernels_compute_the_quantizers_scales(name):
    """Ragged blocks (M=5, K=160, N=130 against 128-blocks), one all-zero row of A (scale 1); for
    cuBLASLt also the FP8 operands its prologue writes K-contiguous."""
    variant = GEMM_VARIANTS[name]
    a_view = ShapeTracker.contiguous((5, 160)).expand_dim(1, 130)
    b_view = ShapeTracker.contiguous((160, 130)).permute((1, 0)).expand_dim(0, 5)
    program = one_kernel([("a", (5, 160), F32), ("b", (160, 130), F32)], kind=KernelKind.GEMM, shape=(5, 130),
                         dtype=F32, inputs=(KernelInput(0, a_view), KernelInput(1, b_view)),
                         layout=gemm_layouts(a_view, b_view, 2)[0], precision=name)
    rng = np.random.default_rng(5)
    a, b = (rng.standard_normal((5, 160)) * 40).astype(np.float32), rng.standard_normal((160, 130)).astype(np.float32)
    a[2] = 0.0
    src = render_kernel(program.kernels[-1], program)
    scratch = [Buffer(np.zeros(s.numel({})), False) for s in src.scratch]
    stored = {0: a, 1: b}
    launches = src.at_load + (src.gemm.prologue if src.gemm is not None else src.launches[:-1])
    run_launches(src, launches, program, stored, {}, None, scratch)
    operands = ((a, variant.a_format, variant.a_scale), (b, variant.b_format, variant.b_scale))
    for slot, (x, fmt, spec) in enumerate(operands):
        expected = compute_scales(x, fmt, spec)
        np.testing.assert_array_equal(scratch[slot].values, expected.reshape(-1))
        if src.gemm is not None:  # A as (M, K), B as (N, K): x / s rounded to fmt, saturating
            q = quantize(x, fmt, expected, spec)
            np.testing.assert_array_equal(scratch[2 + slot].values, (q if slot == 0 else q.T).reshape(-1))
    assert (src.gemm is not None) == (name in EXPECTED_CALLS)


# -- every kernel of every test model compiles, each distinct source once ------------------------------------

@needs_nvrtc
def test_every_kernel_of_every_model_compiles_once_per_distinct_source(tmp_path, monkeypatch):
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
    nvrtc.clear_memory_cache()
    distinct: dict[tuple[str, str], KernelKind] = {}
    gemms = 0
    for name in sorted(MODELS):
        for program in programs(name, CANDIDATES):
            for k in program.launched():
                src = render_kernel(k, program)
                distinct[(src.source, src.name)] = k.kind
                if k.kind is KernelKind.GEMM:
                    gemms += 1
                    assert src.gemm is None or src.gemm.compute_type in COMPUTE_TYPES
    before = nvrtc.compile_stats().compiles
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda key: nvrtc.compile_cuda(key[0], key[1]), distinct))
    assert nvrtc.compile_stats().compiles - before == len(distinct) > 0
    assert len({name for _, name in distinct}) == len(distinct)  # one name per source: the hash
    assert gemms > 0 and KernelKind.GEMM in distinct.values()


FALLBACKS = ["f32", "bf16", "f16acc16", "int8_channel", "f8e4m3_channel", "f8e5m2_block", "f8e4m3_block_nopromote",
             "f8e4m3_mx"]


# M = 3: the decode path (M <= SKINNY_M: split K for FP32-accumulated variants); M = 20: the 16 x 16 tiles, whose
# code the decode path only guards (one plain and one MMA-group variant keep it covered)
@pytest.mark.parametrize("name,m", [(name, 3) for name in FALLBACKS] + [("f32", 20), ("f8e5m2_block", 20)])
def test_fallback_gemm_kernel_follows_the_cpu_emulator(name, m):
    """The tiled kernel, run with 16x16 lockstep threads, against numerics.emulate_gemm (the CPU backend).
    Narrow accumulators and integer sums are order-defined: bit for bit; FP32 sums within K ulps."""
    variant = GEMM_VARIANTS[name]
    k = 160 if variant.scale_k_block or variant.promote_every else 40  # 160: a ragged 128-block
    a_view = ShapeTracker.contiguous((k, m)).permute((1, 0)).expand_dim(1, 5)   # A stored transposed
    b_view = ShapeTracker.contiguous((k, 5)).permute((1, 0)).expand_dim(0, m)
    program = one_kernel([("a", (k, m), F32), ("b", (k, 5), F32)], kind=KernelKind.GEMM, shape=(m, 5), dtype=F32,
                         inputs=(KernelInput(0, a_view), KernelInput(1, b_view)),
                         layout=gemm_layouts(a_view, b_view, 2)[0], precision=name)
    feed = feed_for(program, np.random.default_rng(6))
    stored = stored_values(program, feed)
    got, ref = interpret(program, program.kernels[-1], stored, {}), stored[program.kernels[-1].id]
    exact = variant.grouped or variant.acc_format is INT32
    np.testing.assert_allclose(got, ref, rtol=0, atol=0.0 if exact else k * 2.0 ** -23 * np.abs(ref).max())


# -- cuBLASLt: every FP8 variant on legal shapes, by the layout math ------------------------------------------

def _api(name: str) -> str | None:
    program, _ = gemm_cases(16, 16, 32, name)["row_major"]
    call = render_kernel(program.kernels[-1], program).gemm
    return None if call is None else call.api


LT_VARIANTS = [name for name in GEMM_VARIANTS if _api(name) == "cublasLt"]
LT_CASES = [c for c, (_, expressible) in gemm_cases(16, 16, 32).items() if expressible]


def simulate_cublaslt(call, memory: dict, c_size: int) -> np.ndarray:
    """cublasLtMatmul by its definition for the TN layout: A is (K x M) and B is (K x N) column-major
    (lt_layouts), D[r, c] = scale_a * scale_b * sum_k A[k, r] B[k, c], batch i at i * stride."""
    (_, a_rows, a_cols, lda), (_, b_rows, b_cols, ldb), (_, c_rows, c_cols, ldc) = lt_layouts(call)
    assert (a_rows, a_cols, b_rows, b_cols, c_rows, c_cols) == (call.k, call.m, call.k, call.n, call.m, call.n)
    a, b = memory[call.a], memory[call.b]
    scale = float(np.float32(memory[call.a_scale][0]) * np.float32(memory[call.b_scale][0]))
    rows, cols, inner = np.arange(call.m)[:, None], np.arange(call.n)[None, :], np.arange(call.k)
    c = np.full(c_size, np.nan)
    for i in range(call.batch):
        at_a = i * call.stride_a + inner[None, :] + rows * lda
        at_b = i * call.stride_b + inner[:, None] + cols * ldb
        c[i * call.stride_c + rows + cols * ldc] = scale * (a[at_a] @ b[at_b])
    return c


@pytest.mark.parametrize("case", LT_CASES)
@pytest.mark.parametrize("name", LT_VARIANTS)
def test_cublaslt_calls_on_legal_fp8_shapes_follow_the_layout_math(name, case):
    """K = 32 and M = N = 16 (every ld and batch stride 16-byte aligned): legal, TN, and the simulated
    cublasLtMatmul over the prologue's FP8 operands and scales equals the CPU emulator's product."""
    program, _ = gemm_cases(16, 16, 32, name)[case]
    kernel = program.kernels[-1]
    src = render_kernel(kernel, program)
    call = src.gemm.bind({})
    assert call.api == "cublasLt" and call.transa and not call.transb
    assert call.legal() and call.lt_violations() == ()
    feed = feed_for(program, np.random.default_rng(12))
    stored = {kid: v.reshape(-1) for kid, v in stored_values(program, feed).items()}
    scratch = [Buffer(np.zeros(s.numel({})), False) for s in src.scratch]
    run_launches(src, src.at_load + call.prologue, program, stored, {}, None, scratch)
    memory = {Arg("scratch", i): s.values for i, s in enumerate(scratch)}
    got = simulate_cublaslt(call, memory, kernel.numel({}))
    ref = stored[kernel.id]
    np.testing.assert_allclose(got, ref, rtol=0, atol=32 * 2.0 ** -22 * np.abs(ref).max())


def test_fp8_legality_is_cublaslts_rule():
    """Hand-derived: K and M multiples of 16; lds and (batched) strides multiples of 16 bytes."""
    program, _ = gemm_cases(16, 16, 32, "f8e4m3_tensor")["batched_shared_weight"]
    call = render_kernel(program.kernels[-1], program).gemm.bind({})
    assert call.legal() and (call.m, call.n, call.k, call.batch) == (16, 16, 32, 3)
    for change, broken in (({"k": 24}, "K=24"), ({"m": 8, "ldc": 8}, "M=8"), ({"lda": 40}, "lda=40"),
                           ({"ldc": 18}, "ldc=18"), ({"stride_b": 520}, "stride_b=520"),
                           ({"stride_c": 258}, "stride_c=258")):
        bad = dataclasses.replace(call, **change)
        assert not bad.legal() and any(v.startswith(broken) for v in bad.lt_violations()), change
    single = dataclasses.replace(call, batch=1, stride_c=258)  # one matrix: its batch stride is never read
    assert single.legal()


# -- the renderer tables cover every kind and op ---------------------------------------------------------------

def test_every_launching_kernel_kind_has_exactly_one_renderer():
    assert set(RENDERERS) == {kind for kind in KernelKind if kind.launches}


def test_every_elementwise_op_and_custom_kind_has_a_cuda_template():
    assert set(OP_TEMPLATES) == set(UNARY_OPS + BINARY_OPS)
    for op, template in OP_TEMPLATES.items():
        assert template.count("{0}") >= 1 and ("{1}" in template) == (op in BINARY_OPS), op
    for name, custom in CUSTOM_KINDS.items():
        assert op_template(FApply(Op.CUSTOM, (FLoad(0),), kind=name)) == custom.cuda_fn + "({0})"


@pytest.mark.parametrize("fmt", [BF16, F16], ids=lambda f: f.name)
def test_low_precision_softmax_rounds_inputs_and_result_like_the_cpu_backend(fmt):
    """A bf16/f16 softmax stored as FP32: the CPU backend rounds its inputs and its result to the format;
    the generated kernel must too (it used to compute in FP32 and return off-grid values). Envelope: the
    GPU's expf and block sum differ from the CPU's float64 by ~2^-22 relative, which can move a result
    across one rounding boundary of the format: one ulp of it, nothing more."""
    program = one_kernel([("a", (6, 40), F32)], kind=KernelKind.SOFTMAX, shape=(6, 40), dtype=F32,
                         inputs=(KernelInput(0, ShapeTracker.contiguous((6, 40))),), body_shape=(6, 40), axis=1,
                         body=ap(Op.MUL, ld(0), FConstV(3.0)), precision=fmt.name)
    feed = feed_for(program, np.random.default_rng(11))
    bindings = bind_program(program, feed)
    stored = stored_values(program, feed)
    kernel = program.kernels[-1]
    got, ref = interpret(program, kernel, stored, bindings), stored[kernel.id].reshape(6, 40)
    on_grid = round_to(got, fmt, Overflow.INF)
    np.testing.assert_array_equal(got, on_grid)  # the result is rounded to the format
    np.testing.assert_array_equal(ref, round_to(ref, fmt, Overflow.INF))
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), fmt.min_normal))) - (fmt.p - 1))
    assert np.all(np.abs(got - ref) <= ulp), float(np.max(np.abs(got - ref) / ulp))
    assert np.mean(got == ref) > 0.95  # straddles are rare: the kernel computes the same function
