"""Gemm fusion (issue 16): horizontal q/k/v (and any Gemms sharing A over weights) as one Gemm over the
weights concatenated along N, and elementwise consumers computed on the Gemm's FP32 accumulator.

Truths: the unfused program of the same genome (fusion=False: every fused form is the same arithmetic,
so all-FP32 plans agree bit for bit), references computed here in numpy (integer data: exact dot products,
then one FP32 rounding per op), the static bound against measured error under genome fuzzing, and the
CUDA interpreter (tests/cuda_interpreter.py) running the generated code against the CPU backend.
"""
from __future__ import annotations

import collections
import functools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_cuda_codegen import interpret, needs_nvrtc, stored_values
from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_dispatch import library_refusal
from luminal_num.codegen.cuda_kernels import render_kernel
from luminal_num.codegen.llir import FAcc, KernelKind, Program
from luminal_num.codegen.serialize import program_from_data, program_to_data
from luminal_num.dtypes.variants import GEMM_VARIANTS
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import Graph, evaluate
from luminal_num.hlir.symbolic import evaluate as eval_dim
from luminal_num.models.bert import IDS_INPUT, MASK_BIAS_INPUT, POOL_WEIGHTS_INPUT, load_minilm
from luminal_num.models.llama import LLAMA_TINY, build_decode, build_prefill, random_weights
from luminal_num.models.testnets import transformer
from luminal_num.runtime.cpu import CpuRuntime, bind_program
from luminal_num.runtime.latency import kernel_works, modelled_latency
from luminal_num.hlir.shape import ShapeTracker, View
from luminal_num.hlir.symbolic import prod
from luminal_num.search.horizontal import compose, concat_compatible
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)


@functools.cache
def model(name: str):
    """(graph, activation inputs) of each model the rules must fire on."""
    if name.startswith("llama"):
        w = random_weights(LLAMA_TINY, seed=0)
        m = build_decode(LLAMA_TINY, w, 8) if name == "llama_decode" else build_prefill(LLAMA_TINY, w, 4, 8)
        return m.graph, m.make_inputs([3, 1, 4, 1][:m.seq], np.arange(m.seq))
    if name == "minilm":
        m = load_minilm(batch=1, seq=8)
        ids = np.random.default_rng(0).integers(1, 1000, (1, 8))
        return m.graph, {IDS_INPUT: ids, MASK_BIAS_INPUT: np.zeros((1, 1, 1, 8)), POOL_WEIGHTS_INPUT: np.full((1, 8), 1 / 8)}
    t = transformer(2)
    return t.graph, t.make_inputs(5)


@functools.cache
def space(name: str, fusion: bool) -> SearchSpace:
    return SearchSpace.build(model(name)[0], fusion=fusion)


def program(name: str, fusion: bool, pred=lambda t: False) -> Program:
    s = space(name, fusion)
    return s.program(pick(s, pred))


def run(name: str, p: Program) -> dict[str, np.ndarray]:
    graph, inputs = model(name)
    return CpuRuntime(p, graph.weights).run(inputs).outputs


def per_layer(p: Program, chunk: int = 1) -> collections.Counter:
    return collections.Counter(k.kind for k in p.launched() if k.chunk == chunk)


# (launched per layer unfused, fused; Gemm epilogues per layer; concatenated weights per layer). Fused
# counts are with every fusion phase on (Gemm fusion alone: 26, 27, 30, 27; row fusion then folds the
# constants and the norms, and RoPE into the k-cache write)
EXPECTED = {"llama_decode": (30, 12, 3, 2), "llama_prefill": (31, 13, 3, 2), "transformer2": (34, 12, 4, 1),
            "minilm": (31, 14, 7, 0)}
MODELS = sorted(EXPECTED)


@pytest.mark.parametrize("name", MODELS)
def test_rules_fire_and_cut_launches(name):
    """Counts per layer (chunk 1) of the fastest-structure plan, fusion off and on; the horizontal rule
    fires on every model (MiniLM's biased q/k/v keep their three bias epilogues instead: 3 launches, not
    1 Gemm + 3 bias adds)."""
    unfused_n, fused_n, epilogues, concats = EXPECTED[name]
    off, on = program(name, False), program(name, True)
    assert sum(per_layer(off).values()) == unfused_n and not any(k.concat for k in off.kernels)
    assert KernelKind.GEMM_EPILOGUE not in per_layer(off)
    assert sum(per_layer(on).values()) == fused_n
    assert per_layer(on)[KernelKind.GEMM_EPILOGUE] == epilogues
    over_concat = [k for k in on.launched() if k.chunk == 1 and k.kind.is_gemm and on.kernel(k.inputs[1].buffer).concat]
    assert len(over_concat) == concats
    stats = [g.stats for g in space(name, True).groups.values()]
    assert sum(s.matches("KGemmEpi") for s in stats) > 0 and sum(s.matches("KSlice") for s in stats) > 0


@pytest.mark.parametrize("name", MODELS)
def test_fused_equals_unfused_bit_for_bit_in_fp32(name):
    """Every fused form is the unfused arithmetic (the accumulator is what the FP32 Gemm stores; a part's
    columns are the same dot products): all-FP32 plans agree exactly."""
    off, on = run(name, program(name, False)), run(name, program(name, True))
    assert off.keys() == on.keys()
    for out in off:
        np.testing.assert_array_equal(on[out], off[out], err_msg=out)


def test_fusion_off_space_has_no_fused_alternatives():
    for gs in space("llama_decode", False).groups.values():
        ops = {n.op for nodes in gs.space.classes.values() for n in nodes}
        assert not ops & {"KGemmEpi", "KCatW", "KSlice"}
    fused_ops = {n.op for gs in space("llama_decode", True).groups.values()
                 for nodes in gs.space.classes.values() for n in nodes}
    assert {"KGemmEpi", "KCatW", "KSlice"} <= fused_ops


def bounds(name: str, p: Program, inputs=None) -> dict:
    graph, base = model(name)
    inputs = base if inputs is None else inputs
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    return static_bound(p, ranges, graph.bind_symbols(inputs), graph.weights)


@pytest.mark.parametrize("variant", sorted(set(GEMM_VARIANTS) - {"f32"}))
def test_fused_and_unfused_agree_for_every_gemm_variant(variant):
    """Every Gemm in `variant`: the fused plan launches fewer kernels and differs from the unfused one by
    no more than their two static bounds allow (both are the same arithmetic; FP32 sums may take another
    BLAS order, nothing else)."""
    name = "transformer2"
    want = "gemm:" + variant
    off, on = program(name, False, want.__eq__), program(name, True, want.__eq__)
    assert {k.precision for k in on.launched() if k.kind.is_gemm} >= {variant}
    assert len(on.launched()) < len(off.launched())
    if not concat_compatible(variant, [32]):  # a per-tensor weight scale would span the parts: no fusion
        assert not any(k.concat for k in on.kernels)
    else:
        assert any(k.concat for k in on.kernels)
    b_off, b_on = bounds(name, off), bounds(name, on)
    if b_off.overflow or b_on.overflow:
        assert (b_off.overflow is None) == (b_on.overflow is None)
        return
    y_off, y_on = run(name, off), run(name, on)
    for out in y_off:
        assert np.all(np.abs(y_on[out] - y_off[out]) <= b_on.error_bounds[out] + b_off.error_bounds[out]), out


def test_concatenation_keeps_per_part_scales():
    assert concat_compatible("f32", [64, 32, 32]) and concat_compatible("f8e4m3_channel", [64, 32, 32])
    assert concat_compatible("f8e4m3_mx", [64, 32]) and concat_compatible("int8_channel", [7, 5])
    assert not concat_compatible("f8e4m3_tensor", [64, 32])       # one scale over all parts
    assert not concat_compatible("f8e4m3_block", [64, 32])        # 128-column blocks straddle parts
    assert concat_compatible("f8e4m3_block", [128, 256])          # ... unless they tile every part


def _fp32(x):
    return np.asarray(x, dtype=np.float32)


def test_epilogue_chain_matches_an_independent_fp32_reference():
    """y = (x @ W^T) * c + r on integer x, W (exact dot products): the fused kernel is one Gemm with the
    scale and the add on its accumulator, each one FP32 rounding, bit for bit numpy's float32 ops."""
    rng = np.random.default_rng(3)
    x, w = rng.integers(-8, 9, (5, 24)).astype(np.float64), rng.integers(-8, 9, (7, 24)).astype(np.float64)
    r, c = rng.standard_normal((5, 7)), 0.3712
    g = Graph()
    y = (g.input("x", (5, 24)) @ g.weight("w", w).transpose()) * c + g.input("r", (5, 7))
    g.output(y, "y")
    s = SearchSpace.build(g)
    p = s.program(pick(s, lambda t: False))
    (epi,) = [k for k in p.launched() if k.kind is KernelKind.GEMM_EPILOGUE]
    assert len([k for k in p.launched() if k.kind is not KernelKind.CONST]) == 1
    got = CpuRuntime(p, g.weights).run({"x": x, "r": r}).outputs["y"]
    want = _fp32(_fp32(_fp32(x @ w.T) * _fp32(c)) + _fp32(r))
    np.testing.assert_array_equal(got, want)
    assert FAcc() in _leaves(epi.body)


def test_two_epilogues_with_the_same_body_keep_their_own_accumulators():
    """(x @ W1^T) * c and (x @ W2^T) * c: two epilogue kernels with identical bodies and views. The CPU
    backend shares computed values between kernels of a run; each accumulator must be its own value
    (they once shared one pseudo-buffer id, so the second Gemm returned the first's result)."""
    rng = np.random.default_rng(5)
    x = rng.integers(-8, 9, (5, 24)).astype(np.float64)
    w1, w2 = (rng.integers(-8, 9, (7, 24)).astype(np.float64) for _ in range(2))
    c = 0.3712
    g = Graph()
    h = g.input("x", (5, 24))
    g.output((h @ g.weight("w1", w1).transpose()) * c, "y1")
    g.output((h.exp2() @ g.weight("w2", w2).transpose()) * c, "y2")
    s = SearchSpace.build(g)
    p = s.program(pick(s, lambda t: False))
    assert len([k for k in p.launched() if k.kind is KernelKind.GEMM_EPILOGUE]) == 2
    got = CpuRuntime(p, g.weights).run({"x": x}).outputs
    np.testing.assert_array_equal(got["y1"], _fp32(_fp32(x @ w1.T) * _fp32(c)))
    np.testing.assert_array_equal(got["y2"], _fp32(_fp32(_fp32(np.exp2(x)) @ w2.T) * _fp32(c)))


def _leaves(e):
    args = getattr(e, "args", None)
    if args is None:
        inner = getattr(e, "x", None)
        return [e] if inner is None else _leaves(inner)
    return [leaf for a in args for leaf in _leaves(a)]


def test_horizontal_fusion_with_gqa_widths_matches_an_independent_reference():
    """q (N=12) and k (N=4, GQA-narrow) of one x: one Gemm over [Wq; Wk], each part read back through its
    column slice by a reduction; integer data: exact, bit for bit numpy."""
    rng = np.random.default_rng(4)
    x = rng.integers(-4, 5, (6, 16)).astype(np.float64)
    wq, wk = (rng.integers(-4, 5, (n, 16)).astype(np.float64) for n in (12, 4))
    g = Graph()
    h = g.input("x", (6, 16))
    g.output((h @ g.weight("wq", wq).transpose()).sum(-1), "q")
    g.output((h @ g.weight("wk", wk).transpose()).reshape(6, 2, 2).sum(-1), "k")
    s = SearchSpace.build(g)
    p = s.program(pick(s, lambda t: False))
    gemms = [k for k in p.launched() if k.kind.is_gemm]
    assert len(gemms) == 1 and p.kernel(gemms[0].inputs[1].buffer).concat == ("wq", "wk")
    out = CpuRuntime(p, g.weights).run({"x": x}).outputs
    np.testing.assert_array_equal(out["q"], (x @ wq.T).sum(-1))
    np.testing.assert_array_equal(out["k"], (x @ wk.T).reshape(6, 2, 2).sum(-1))
    assert program_from_data(program_to_data(p)) == p


def test_fused_programs_round_trip_through_llir_data():
    p = program("llama_decode", True)
    assert any(k.concat for k in p.kernels) and any(k.kind is KernelKind.GEMM_EPILOGUE for k in p.kernels)
    assert program_from_data(program_to_data(p)) == p


def test_cost_model_counts_fewer_launches_and_bytes():
    """One launch per fused group; the epilogue's extra operands are read, the intermediate buffer is
    neither written nor read back, A is read once for q/k/v."""
    graph, inputs = model("llama_decode")
    bindings = graph.bind_symbols(inputs)
    off, on = program("llama_decode", False), program("llama_decode", True)
    w_off, w_on = kernel_works(off, bindings), kernel_works(on, bindings)
    assert len(w_on) <= len(w_off) - 8  # the Gemm fusions' share (q/k/v, epilogues); row fusion removes more
    moved = lambda ws: sum(w.bytes_read + w.bytes_written for w in ws)  # noqa: E731
    assert moved(w_on) < moved(w_off)
    assert modelled_latency(on, "h100", bindings).total_s < modelled_latency(off, "h100", bindings).total_s


@pytest.mark.parametrize("name", ["transformer2", "llama_decode", "llama_prefill",
                                  pytest.param("minilm", marks=pytest.mark.slow)])  # MiniLM: ~2.5 min
def test_static_bound_holds_under_genome_fuzzing_with_fusion(name):
    """Random genomes (a random tag per knob) with fusion on, activations scaled up to near the narrow
    formats' limits: measured error vs FP64 never exceeds the static bound; fused kernels are exercised."""
    graph, base = model(name)
    s = space(name, True)
    rng = np.random.default_rng(16)
    ref_cache: dict = {}
    fused_seen = checked = 0
    for trial in range(10):
        scale = float(rng.choice([1.0, 30.0, 300.0]))
        inputs = {k: (v * scale if np.issubdtype(np.asarray(v).dtype, np.floating) and k.startswith(("x", "attn", "r"))
                      else v) for k, v in base.items()}
        genome = frozenset((gk, k.cls, str(rng.choice(k.tags))) for gk, ks in s.knobs.items() for k in ks
                           if rng.random() < 0.5)
        p = s.program(genome)
        fused_seen += any(k.kind is KernelKind.GEMM_EPILOGUE or k.concat for k in p.kernels)
        rep = bounds(name, p, inputs)
        if rep.overflow is not None:
            continue  # a certain overflow is a verdict, not a number to compare
        if scale not in ref_cache:
            ref_cache[scale] = evaluate(graph, inputs)
        ref = ref_cache[scale]
        out = CpuRuntime(p, graph.weights).run(inputs).outputs
        for o in ref:
            bound = rep.error_bounds[o]  # NaN/inf outputs need an infinite bound
            assert np.all((np.abs(out[o] - ref[o]) <= bound) | np.isinf(bound)), (o, trial)
        checked += 1
    assert fused_seen and checked


def _gemm_tolerance(k, ref, bindings) -> float:
    """FP32 sums in another order (the tiled kernel's K loop vs BLAS): K ulps of the largest value."""
    return eval_dim(k.layout.k, bindings) * 2.0 ** -22 * (float(np.max(np.abs(ref), initial=0.0)) + 1.0)


@needs_nvrtc
@pytest.mark.parametrize("name", ["llama_decode", "transformer2",
                                  pytest.param("minilm", marks=pytest.mark.slow)])  # MiniLM: ~10 min interpreted
def test_fused_kernels_compile_and_run_as_the_cpu_backend_computes(name):
    """Every Gemm epilogue and the Gemm over concatenated weights: NVRTC compiles the source (sm_90), and
    the CUDA interpreter running it agrees with the CPU backend."""
    graph, inputs = model(name)
    p = program(name, True)
    feed = {**graph.weights, **inputs}
    chunk = [k for k in p.launched() if k.chunk == 1 and (k.kind is KernelKind.GEMM_EPILOGUE or
                                                          (k.kind.is_gemm and p.kernel(k.inputs[1].buffer).concat))]
    assert chunk
    bindings = bind_program(p, feed)
    stored = stored_values(p, feed)
    for k in chunk:
        src = render_kernel(k, p)
        # an epilogue has a library call only as cuBLASLt's FP32 `+ bias` (codegen/cuda_gemm_bias.py); the fallback
        # kernels below are what runs where cuBLASLt answers NOT_SUPPORTED
        assert k.kind is KernelKind.GEMM or (src.gemm is None) == (library_refusal(k, p) is not None)
        nvrtc.compile_cuda(src.source, src.name)
        got = interpret(p, k, stored, bindings)
        ref = stored[k.id].reshape(got.shape)
        np.testing.assert_allclose(got, ref, rtol=0, atol=_gemm_tolerance(k, ref, bindings), err_msg=k.label)


@st.composite
def part_reads(draw):
    """(slice view of part columns [off, off + c) of an (r, total) buffer, a random read of the part)."""
    r, c = draw(st.integers(1, 4)), draw(st.sampled_from([2, 4, 6]))
    off, extra = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    total = off + c + extra
    low = ShapeTracker((View.create((r, c), (total, 1), off),))
    read = ShapeTracker.contiguous((r, c))
    for _ in range(draw(st.integers(0, 4))):
        shape = read.shape
        op = draw(st.sampled_from(["reshape", "permute", "slice", "expand_dim", "pad"]))
        if op == "reshape":
            n = prod(shape)
            a = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
            read = read.reshape((a, n // a))
        elif op == "permute":
            read = read.permute(draw(st.permutations(range(len(shape)))))
        elif op == "slice":
            starts = [draw(st.integers(0, d - 1)) for d in shape]
            read = read.slice([(a, draw(st.integers(a + 1, d))) for a, d in zip(starts, shape)])
        elif op == "expand_dim" and len(shape) < 4:
            read = read.expand_dim(draw(st.integers(0, len(shape))), draw(st.integers(1, 3)))
        elif op == "pad":
            read = read.pad([(draw(st.integers(0, 1)), draw(st.integers(0, 1))) for _ in shape])
    return low, read, total


@settings(deadline=None, max_examples=200)
@given(part_reads())
def test_composed_part_reads_index_the_fused_buffer_as_stacked_views_do(case):
    """compose (merged into one view where it can) reads exactly what the stacked views read."""
    low, read, total = case
    buffer = np.arange(low.views[0].shape[0] * total, dtype=np.float64) + 1.0
    merged = compose(low, read)
    stacked = ShapeTracker(low.views + read.views)
    np.testing.assert_array_equal(merged.realize(buffer), stacked.realize(buffer))


def test_head_reads_of_a_part_stay_one_strided_view():
    """q as (tokens, heads, head_dim), permuted for attention: one view into the fused (tokens, 3d) buffer."""
    low = ShapeTracker((View.create((5, 8), (24, 1), 8),))
    read = ShapeTracker.contiguous((5, 8)).reshape((5, 2, 4)).permute((1, 0, 2))
    merged = compose(low, read)
    assert merged.views == (View.create((2, 5, 4), (4, 24, 1), 8),)
