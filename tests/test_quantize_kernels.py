"""Dynamic activation quantization is its own LLIR kernel (QUANTIZE) on every backend.

Oracles: gemm_operand_a (the layout math the Gemm already trusted), the old fused emulation (a Gemm
over the raw A that quantizes inside, still a valid LLIR form), luminal_num.quant (quantize_tensor,
compute_scales), the FP64 reference, distinct-element counts from ShapeTracker.index_map, and for the
generated C the single-threaded interpreter of tests/cuda_interpreter.py.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_interpreter import Buffer, compile_entry, entry_body, launch
from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_kernels import render_kernel
from luminal_num.codegen.llir import Kernel, KernelInput, KernelKind, Program, quantized_a_view
from luminal_num.dtypes.formats import F32, Kind
from luminal_num.dtypes.variants import GEMM_VARIANTS, Granularity
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.hlir.gemm import gemm_layouts, gemm_operand_a
from luminal_num.hlir.shape import ShapeTracker
from luminal_num.hlir.symbolic import evaluate as eval_dim
from luminal_num.models.testnets import matmul_chain, transformer
from luminal_num.quant import compute_scales, quantize_tensor
from luminal_num.runtime.cpu import CpuRuntime, bind_program, run_quantize
from luminal_num.runtime.latency import kernel_works, modelled_latency
from luminal_num.runtime.numerics import emulate_gemm
from luminal_num.search.plan import op_table
from luminal_num.search.space import SearchSpace

DYNAMIC = sorted(name for name, v in GEMM_VARIANTS.items()
                 if v.a_scale is not None and not v.a_scale.static and not v.a_prologue)  # prologue: no QUANTIZE
needs_nvrtc = pytest.mark.skipif(not (nvrtc.nvrtc_available() and nvrtc.toolchain().include_dirs),
                                 reason="libnvrtc or the CUDA headers are missing")


def test_every_scaled_variant_scales_activations_dynamically():
    # 6 fp8, mx, nopromote, int8, and the two with B scaled at run time too (activation x activation)
    assert len(DYNAMIC) == sum(v.a_scale is not None and not v.a_prologue for v in GEMM_VARIANTS.values()) == 11


# -- the Gemm's view of a QUANTIZE buffer ----------------------------------------------------------------

@st.composite
def gemm_views(draw):
    """Operand views of a random Mul: each non-K axis is batch (both read it), M (A only) or N (B only);
    each operand is stored in a random axis order; extents >= 2 so no stride is canonicalised to 0."""
    roles = draw(st.lists(st.sampled_from("bmn"), min_size=1, max_size=4).filter(lambda r: "m" in r or "n" in r))
    k_axis = draw(st.integers(0, len(roles)))
    roles.insert(k_axis, "k")
    shape = [draw(st.integers(2, 3)) for _ in roles]

    def operand(skip: str) -> ShapeTracker:
        own = [a for a, r in enumerate(roles) if r != skip]
        order = draw(st.permutations(own))
        view = ShapeTracker.contiguous([shape[a] for a in order]).permute([order.index(a) for a in own])
        for axis in (a for a, r in enumerate(roles) if r == skip):
            view = view.expand_dim(axis, shape[axis])
        return view

    return operand("n"), operand("m"), k_axis


@settings(deadline=None, max_examples=60)
@given(gemm_views())
def test_quantized_view_reads_the_buffer_back_as_gemm_operand_a(views):
    va, vb, k_axis = views
    layouts = gemm_layouts(va, vb, k_axis)
    assert layouts
    rng = np.random.default_rng(0)
    raw = rng.standard_normal(int(np.prod(va.views[0].shape))).astype(np.float32)
    for layout in layouts:
        expected_shape = gemm_operand_a(va.realize(raw), layout).shape  # what the fused Gemm quantized
        buffer = np.arange(int(np.prod(expected_shape)), dtype=np.float64)
        view = quantized_a_view(layout)
        assert view.shape == va.shape and view.views[0].mask is None
        np.testing.assert_array_equal(gemm_operand_a(view.realize(buffer), layout), buffer.reshape(expected_shape))
        n_strides = [view.views[0].strides[a] for a in layout.n_axes]
        assert n_strides == [0] * len(n_strides)


# -- numerics: emulate_gemm from an A that is already quantized ------------------------------------------

def _operands(rng, batch=2, m=5, k=160, n=7):
    a = (rng.standard_normal((batch, m, k)) * np.exp(rng.uniform(-3, 3, (batch, m, 1)))).astype(np.float32)
    a[0, 2] = 0.0  # an all-zero token: scale 1
    a[1, 1, 7] = 900.0  # an outlier beyond E4M3's range before scaling
    return a, rng.standard_normal((batch, k, n)).astype(np.float32)


@pytest.mark.parametrize("name", DYNAMIC)
def test_prequantized_a_is_bit_identical_to_quantizing_inside(name):
    variant = GEMM_VARIANTS[name]
    a, b = _operands(np.random.default_rng(1))
    q = quantize_tensor(a, variant.a_format, variant.a_scale)
    b_scales = compute_scales(b, variant.b_format, variant.b_scale)
    for static in (None, b_scales):
        fused = emulate_gemm(a, b, variant, b_scales=static)
        split = emulate_gemm(None, b, variant, b_scales=static, a_quantized=(q.values, q.scales))
        assert fused.dtype == split.dtype == np.float32
        np.testing.assert_array_equal(split, fused)


def test_prequantized_a_is_checked():
    variant = GEMM_VARIANTS["f8e4m3_block"]
    a, b = _operands(np.random.default_rng(2))
    q = quantize_tensor(a, variant.a_format, variant.a_scale)
    with pytest.raises(ValueError, match="not both"):
        emulate_gemm(a, b, variant, a_quantized=(q.values, q.scales))
    with pytest.raises(ValueError, match="do not fit"):
        emulate_gemm(None, b, variant, a_quantized=(q.values, q.scales[..., :1]))
    with pytest.raises(ValueError, match="not scaled"):
        emulate_gemm(None, b, GEMM_VARIANTS["bf16"], a_quantized=(q.values, q.scales))


# -- lowering and the CPU backend ----------------------------------------------------------------------

MODEL = transformer(1, s=5, d=160, heads=4, hidden=192, symbolic_seq=True)  # K = 160 / 192: ragged 128-blocks


@functools.cache
def space() -> SearchSpace:
    return SearchSpace.build(MODEL.graph, fusion=False)  # unfused q/k/v: one QUANTIZE serves three Gemms


@functools.cache
def program(name: str) -> Program:
    """Every Gemm that offers `name` takes it."""
    tag = f"gemm:{name}"
    return space().program(frozenset((gk, k.cls, tag) for gk, ks in space().knobs.items() for k in ks if tag in k.tags))


def fused(p: Program) -> Program:
    """The old form of the same program: each Gemm reads the raw A its QUANTIZE kernel read, and
    quantizes it inside (the QUANTIZE kernels stay, unread)."""
    kernels = []
    for k in p.kernels:
        if k.kind is KernelKind.GEMM and p.quantized_inputs(k)[0]:
            k = dataclasses.replace(k, inputs=(p.kernel(k.inputs[0].buffer).inputs[0], k.inputs[1]))
        kernels.append(k)
    return dataclasses.replace(p, kernels=tuple(kernels))


def inputs_of(seq: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((seq, 160)) * 2.0}


@pytest.mark.parametrize("name", DYNAMIC)
def test_a_dynamic_gemm_reads_a_quantize_kernel(name):
    p = program(name)
    variant = GEMM_VARIANTS[name]
    gemms = [k for k in p.launched() if k.kind is KernelKind.GEMM and k.precision == name]
    quantizes = {k.id: k for k in p.launched() if k.kind is KernelKind.QUANTIZE}
    assert gemms and quantizes
    others = [k for k in p.launched() if k.kind is KernelKind.GEMM and k.precision != name]
    if variant.b_scale.static:  # weights only: attention (activations x activations) keeps its own Gemm
        assert others and not any(p.quantized_inputs(k)[0] for k in others)
    else:  # B scaled at run time: attention takes it too
        assert not others
    for g in gemms:
        q = p.kernel(g.inputs[0].buffer)
        assert q.kind is KernelKind.QUANTIZE and q.id < g.id and q.precision == name
        assert q.dtype is variant.a_format and q.scale_spec is variant.a_scale
        assert q.shape == (g.layout.batch, g.layout.m, g.layout.k) and q.layout == g.layout
        assert g.inputs[0].view == quantized_a_view(g.layout) and g.inputs[0].view.shape == q.inputs[0].view.shape
    # Q, K and V read the same normalised x the same way: one QUANTIZE kernel serves the three
    assert len(quantizes) < len(gemms)
    assert all(k.kind is not KernelKind.QUANTIZE for k in program("bf16").kernels)


@pytest.mark.parametrize("name", DYNAMIC)
def test_cpu_results_are_bit_identical_to_the_fused_emulation(name):
    p = program(name)
    for seq, seed in ((5, 3), (3, 4)):  # the symbolic sequence length binds at run time
        feed = inputs_of(seq, seed)
        split = CpuRuntime(p, MODEL.graph.weights).run(feed).outputs
        old = CpuRuntime(fused(p), MODEL.graph.weights).run(feed).outputs
        assert split.keys() == old.keys()
        for out in split:
            np.testing.assert_array_equal(split[out], old[out])


def test_quantize_kernel_stores_quantize_tensor_of_the_operand():
    p = program("f8e4m3_block")
    feed = {**MODEL.graph.weights, **inputs_of(5, 5)}
    bindings = bind_program(p, feed)
    every = dataclasses.replace(p, outputs=tuple((f"k{k.id}", k.id) for k in p.kernels))
    stored = {int(n[1:]): v for n, v in CpuRuntime(every).run(feed).outputs.items()}
    for k in (k for k in p.kernels if k.kind is KernelKind.QUANTIZE):
        a = gemm_operand_a(k.inputs[0].view.realize(stored[k.inputs[0].buffer], bindings), k.layout)
        expected = quantize_tensor(a.astype(np.float32), k.dtype, k.scale_spec)
        np.testing.assert_array_equal(stored[k.id], expected.values)
        assert k.scales_shape(bindings) == expected.scales.shape == (1, 5, 2)  # (batch, M, ceil(160 / 128))


@pytest.mark.parametrize("name", DYNAMIC)
def test_static_bounds_are_unchanged_and_hold(name):
    """QUANTIZE passes A through: the bound is the fused program's, to the bit, and it holds (a matmul
    chain with ragged K blocks, where the bound is finite)."""
    chain = matmul_chain(m=5, dims=(160, 192, 24))
    chain_space = SearchSpace.build(chain.graph)
    tag = f"gemm:{name}"
    p = chain_space.program(frozenset((gk, k.cls, tag) for gk, ks in chain_space.knobs.items() for k in ks
                                      if tag in k.tags))
    assert sum(k.kind is KernelKind.QUANTIZE for k in p.kernels) == 2
    feed = chain.make_inputs(6)
    feed["x"][1] *= 50.0  # a loud token
    ref = evaluate(chain.graph, feed)["y"]
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in feed.items()}
    report = static_bound(p, ranges, {}, chain.graph.weights)
    old = static_bound(fused(p), ranges, {}, chain.graph.weights)
    np.testing.assert_array_equal(report.error_bounds["y"], old.error_bounds["y"])
    assert np.all(np.isfinite(report.error_bounds["y"]))
    error = np.abs(CpuRuntime(p, chain.graph.weights).run(feed).outputs["y"] - ref)
    assert np.all(error <= report.error_bounds["y"]) and error.max() > 0


# -- cost model and op table -------------------------------------------------------------------------------

def _scale_count(granularity: Granularity, batch: int, m: int, k: int) -> int:
    per_row = {Granularity.TENSOR: 0, Granularity.CHANNEL: 1, Granularity.BLOCK: math.ceil(k / 128),
               Granularity.MX: math.ceil(k / 32)}[granularity]
    return 1 if granularity is Granularity.TENSOR else batch * m * per_row


@pytest.mark.parametrize("name", ["f8e4m3_tensor", "f8e4m3_channel", "f8e5m2_block", "f8e4m3_mx", "int8_channel"])
def test_cost_model_counts_the_quantize_kernel(name):
    p, bindings = program(name), {"s": 5}
    works = {w.name: w for w in kernel_works(p, bindings)}
    old = {w.name: w for w in kernel_works(fused(p), bindings)}
    dtypes = p.dtypes()
    for q in (k for k in p.launched() if k.kind is KernelKind.QUANTIZE):
        batch, m, k_dim = (eval_dim(d, bindings) for d in q.shape)
        scale_bytes = 4 * _scale_count(q.scale_spec.granularity, batch, m, k_dim)
        positions, valid = q.inputs[0].view.index_map(bindings)
        a_bytes = len(np.unique(positions[valid])) * dtypes[q.inputs[0].buffer].itemsize
        work = works[f"k{q.id}:{q.label}"]
        assert work.bytes_read == 2 * a_bytes + scale_bytes  # the amax pass and the convert pass
        assert work.bytes_written == batch * m * k_dim * q.dtype.itemsize + scale_bytes
        assert work.flops == 2 * batch * m * k_dim + scale_bytes // 4 and work.math == "fp32"
        for g in (g for g in p.launched() if g.kind is KernelKind.GEMM and g.inputs[0].buffer == q.id):
            key = f"k{g.id}:{g.label}"
            b_bytes = works[key].bytes_read - batch * m * k_dim * q.dtype.itemsize - scale_bytes
            assert b_bytes == old[key].bytes_read - a_bytes  # A now arrives in 8 bits with its scales
    latency = modelled_latency(p, "h100", bindings)
    quantize_names = [n for n, _ in latency.per_kernel if "quantize A" in n]
    assert len(quantize_names) == sum(k.kind is KernelKind.QUANTIZE for k in p.kernels) > 0


def test_op_table_shows_the_quantize_format_and_granularity():
    for name in ("f8e4m3_block", "int8_channel", "f8e4m3_mx"):
        variant = GEMM_VARIANTS[name]
        rows = op_table(program(name), {"s": 5})
        quantize_rows = [r for r in rows if r["kind"] == "quantize"]
        assert quantize_rows
        mx = "/e8m0" if variant.a_scale.granularity is Granularity.MX else ""
        for r in quantize_rows:
            assert r["precision"] == name and r["dtype"] == variant.a_format.name == r["quant"][2:]
            assert r["scales"] == f"A:{variant.a_scale.granularity.value}/dynamic{mx}"
        gemm_inputs = {r["inputs"].split(",")[0] for r in rows if r["kind"] == "gemm" and r["precision"] == name}
        assert gemm_inputs == {variant.a_format.name}


# -- CUDA: the QUANTIZE kernel's C, and the Gemm reading its buffer -------------------------------------------

def quantized_gemm(name: str, m: int, n: int, k: int) -> Program:
    """a (K x M, stored transposed) -> QUANTIZE -> Gemm with b (K x N), as the lowering builds it."""
    a_view = ShapeTracker.contiguous((k, m)).permute((1, 0)).expand_dim(1, n)
    b_view = ShapeTracker.contiguous((k, n)).permute((1, 0)).expand_dim(0, m)
    layout = gemm_layouts(a_view, b_view, 2)[0]
    kernels = (Kernel(0, KernelKind.EXTERNAL, (), (k, m), F32, external="a"),
               Kernel(1, KernelKind.EXTERNAL, (), (k, n), F32, external="b"),
               Kernel(2, KernelKind.QUANTIZE, (KernelInput(0, a_view),), (layout.batch, layout.m, layout.k),
                      GEMM_VARIANTS[name].a_format, precision=name, layout=layout),
               Kernel(3, KernelKind.GEMM, (KernelInput(2, quantized_a_view(layout)), KernelInput(1, b_view)), (m, n),
                      F32, precision=name, layout=layout))
    return Program(kernels, (("a", 0), ("b", 1)), (("y", 3),))


def interpret(src, launches, stored: dict, scales: dict, out: Buffer, scratch: list, integer: dict) -> None:
    """Run launches in the interpreter; "scales" arguments read the given QUANTIZE scales."""
    for launch_ in launches:
        fn, params = compile_entry(src.source, launch_.entry)
        args = {}
        for param, arg in zip(params, launch_.args):
            args[param] = {"out": lambda: out, "scratch": lambda: scratch[arg.index],
                           "scales": lambda: Buffer(scales[arg.buffer].reshape(-1).astype(np.float64), False),
                           "in": lambda: Buffer(np.asarray(stored[arg.buffer], np.float64).reshape(-1),
                                                integer[arg.buffer])}[arg.role]()
        if "__syncthreads" in entry_body(src.source, launch_.entry)[1]:
            launch(fn, args, *launch_.config({}))
        else:
            fn(**args)


def run_quantize_in_c(p: Program, stored: dict) -> tuple[np.ndarray, np.ndarray]:
    q = p.kernels[2]
    src = render_kernel(q, p)
    out = Buffer(np.zeros(q.numel({})), q.dtype.kind is Kind.INT)
    scratch = [Buffer(np.zeros(s.numel({})), False) for s in src.scratch]
    interpret(src, src.launches, stored, {}, out, scratch, {0: False, 1: False})
    return out.values, scratch[0].values


@pytest.mark.parametrize("name", DYNAMIC)
def test_quantize_kernel_in_c_is_the_cpu_quantize(name):
    """Ragged blocks (K = 160 against 128- and 32-blocks), an all-zero token, an outlier."""
    p = quantized_gemm(name, 5, 3, 160)
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((160, 5)) * 40).astype(np.float32)
    a[:, 2], a[9, 1] = 0.0, 3e4
    stored = {0: a, 1: rng.standard_normal((160, 3)).astype(np.float32)}
    q_c, scales_c = run_quantize_in_c(p, stored)
    expected = run_quantize(p.kernels[2], stored, {})
    np.testing.assert_array_equal(q_c, expected.values.reshape(-1))
    np.testing.assert_array_equal(scales_c, expected.scales.reshape(-1))
    assert render_kernel(p.kernels[2], p).scratch[0].numel({}) == expected.scales.size


FALLBACKS = ["int8_channel", "f8e4m3_channel", "f8e5m2_block", "f8e4m3_block_nopromote", "f8e4m3_mx"]


@pytest.mark.parametrize("name", FALLBACKS)
def test_fallback_gemm_reads_the_quantized_buffer(name):
    """The tiled kernel over q and the QUANTIZE scales against the CPU backend: narrow accumulators and
    integer sums bit for bit, FP32 sums within K ulps (summation order)."""
    variant = GEMM_VARIANTS[name]
    k = 160 if variant.scale_k_block or variant.promote_every else 40
    p = quantized_gemm(name, 3, 5, k)
    rng = np.random.default_rng(8)
    feed = {"a": rng.standard_normal((k, 3)) * 3.0, "b": rng.standard_normal((k, 5))}
    stored = {0: feed["a"].astype(np.float32), 1: feed["b"].astype(np.float32)}
    q_values, scales = run_quantize_in_c(p, stored)
    src = render_kernel(p.kernels[3], p)
    assert src.gemm is None and not any(a.role == "scratch" and a.index > 0 for l_ in src.launches for a in l_.args)
    out = Buffer(np.zeros(15), False)
    scratch = [Buffer(np.zeros(s.numel({})), False) for s in src.scratch]
    interpret(src, src.at_load + src.launches, {**stored, 2: q_values}, {2: scales}, out, scratch,
              {0: False, 1: False, 2: variant.a_format.kind is Kind.INT})
    ref = CpuRuntime(p).run(feed).outputs["y"]
    exact = variant.grouped or variant.acc_format.name == "int32"
    atol = 0.0 if exact else k * 2.0 ** -23 * np.abs(ref).max()
    np.testing.assert_allclose(out.values.reshape(3, 5), ref, rtol=0, atol=atol)


def test_cublaslt_takes_the_quantized_buffer_as_its_a():
    """Per-tensor FP8: cuBLASLt reads the QUANTIZE buffer and scales; B is quantized by the at-load launches.
    cublasLtMatmul simulated by its definition: D = sa * sb * op(A) op(B), column-major."""
    p = quantized_gemm("f8e4m3_tensor", 5, 16, 32)  # N = 16: cuBLASLt FP8 needs N and K multiples of 16
    rng = np.random.default_rng(9)
    feed = {"a": rng.standard_normal((32, 5)), "b": rng.standard_normal((32, 16))}
    stored = {0: feed["a"].astype(np.float32), 1: feed["b"].astype(np.float32)}
    q_values, scales = run_quantize_in_c(p, stored)
    src = render_kernel(p.kernels[3], p)
    call = src.gemm.bind({})
    assert call.api == "cublasLt" and call.legal()
    operands = {(a.role, a.buffer) for a in (call.a, call.b)}
    assert ("in", 2) in operands and ("scales", 2) in {(call.a_scale.role, call.a_scale.buffer),
                                                      (call.b_scale.role, call.b_scale.buffer)}
    # B (a weight's operand: static scales) is scaled and quantized once at load, not in the per-run prologue
    assert call.prologue == () and [x.entry.rsplit("_", 1)[1] for x in src.at_load] == ["scale1", "quant1"]
    scratch = [Buffer(np.zeros(s.numel({})), False) for s in src.scratch]
    interpret(src, src.at_load + call.prologue, stored, {}, None, scratch, {0: False, 1: False})
    memory = {("in", 2): q_values, ("scales", 2): scales}
    memory.update({("scratch", i): s.values for i, s in enumerate(scratch)})
    a, b = (memory[(x.role, x.buffer if x.role != "scratch" else x.index)] for x in (call.a, call.b))
    sa, sb = (memory[(x.role, x.buffer if x.role != "scratch" else x.index)][0] for x in (call.a_scale, call.b_scale))
    rows, cols, inner = np.arange(call.m)[:, None], np.arange(call.n)[None, :], np.arange(call.k)
    a_at = inner[None, :] + rows * call.lda if call.transa else rows + inner[None, :] * call.lda
    b_at = cols + inner[:, None] * call.ldb if call.transb else inner[:, None] + cols * call.ldb
    c = np.full(80, np.nan)
    c[rows + cols * call.ldc] = float(np.float32(sa) * np.float32(sb)) * (a[a_at] @ b[b_at])
    ref = CpuRuntime(p).run(feed).outputs["y"].reshape(-1)
    np.testing.assert_allclose(c, ref, rtol=0, atol=32 * 2.0 ** -22 * np.abs(ref).max())


@needs_nvrtc
def test_quantize_kernels_and_their_gemms_compile(tmp_path, monkeypatch):
    """Every dynamic variant on the hand-built program; two on the symbolic-length model (dyn_dims)."""
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
    sources = {}
    for name in DYNAMIC:
        on_model = [program(name)] if name in ("f8e4m3_tensor", "int8_channel") else []
        for p in (quantized_gemm(name, 5, 6, 160), *on_model):
            for k in p.launched():
                if k.kind is KernelKind.QUANTIZE or (k.kind is KernelKind.GEMM and p.quantized_inputs(k)[0]):
                    src = render_kernel(k, p)
                    sources[src.name] = src
    assert any(s.symbols.symbols for s in sources.values())
    for src in sources.values():
        compiled = nvrtc.compile_cuda(src.source, src.name)
        assert all(f".entry {entry}(" in compiled.ptx for entry in src.entries)
