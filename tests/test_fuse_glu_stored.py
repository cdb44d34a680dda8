"""Issue 16's last forms: the GLU epilogue (gate and up as one Gemm over [W_gate; W_up] whose epilogue reads
both halves of the accumulator and stores silu(gate) * up only) and horizontal fusion of weights held in a
storage format (KCatStored: the parts' own stored values and scales side by side).

Truths: the unfused program of the same genome (fusion=False: the fused forms are the same arithmetic,
so the outputs agree bit for bit), numpy on integer data (exact dot products), FP64 evaluation of the graph
under genome fuzzing against the static bound, and the CUDA interpreter running the generated code
(the tiled GLU kernel; the dequantize-on-load kernel on the concatenated stored containers).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import warnings

import numpy as np
import pytest
from cuda_interpreter import Buffer, compile_entry, launch

from test_cuda_codegen import interpret, needs_nvrtc, stored_values
from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_gemm_epilogue import glu_offsets
from luminal_num.codegen.cuda_kernels import render_kernel
from luminal_num.codegen.cuda_weight_only import param_name, render_weight_only, weight_only_gemm
from luminal_num.codegen.llir import FAcc, KernelKind, Program, acc_views
from luminal_num.codegen.serialize import program_from_data, program_to_data
from luminal_num.dtypes.formats import BF16, F32
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import Graph, evaluate
from luminal_num.models.llama import LLAMA_TINY, build_decode, build_prefill, random_weights
from luminal_num.quant.concat import concat_quantized, concat_refusal, concat_stored, concat_widened
from luminal_num.quant.storage import STORAGE_FORMATS
from luminal_num.quant.stored import convert_all, widened
from luminal_num.runtime.cpu import CpuRuntime, bind_program
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.weight_only import stored_weight
from luminal_num.search.horizontal import FusionGroup
from luminal_num.search.plan import stored_layout
from luminal_num.search.recipes import STORAGE_RECIPES, pick
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)


@functools.cache
def llama():
    w = random_weights(LLAMA_TINY, seed=0)
    m = build_decode(LLAMA_TINY, w, 8)
    return m.graph, m.make_inputs([3], np.arange(1))


@functools.cache
def space(fusion: bool) -> SearchSpace:
    return SearchSpace.build(llama()[0], fusion=fusion)


def program(fusion: bool, tags=frozenset()) -> Program:
    s = space(fusion)
    return s.program(pick(s, tags.__contains__))


def run(p: Program, inputs=None) -> dict:
    graph, base = llama()
    return CpuRuntime(p, graph.weights).run(base if inputs is None else inputs).outputs


def glu_kernels(p: Program) -> list:
    return [k for k in p.launched() if k.kind is KernelKind.GEMM_EPILOGUE and acc_views(k.body)]


# -- the GLU epilogue ----------------------------------------------------------------------------------
def _glu_graph(x, wg, wu):
    g = Graph()
    h = g.input("x", x.shape)
    gate = h @ g.weight("wg", wg).transpose()
    g.output(gate.silu() * (h @ g.weight("wu", wu).transpose()), "y")
    return g


def test_glu_is_one_kernel_storing_only_the_product():
    """silu(x Wg^T) * (x Wu^T): one launch over [Wg; Wu] whose body reads the accumulator's two column
    halves; it stores (M, F), not (M, 2F); bit for bit the unfused program (the gate's FP32 store is
    the accumulator: no rounding is removed) and within FP32 roundings of FP64 numpy on integer data."""
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, (5, 24)).astype(np.float64)
    wg, wu = (rng.integers(-3, 4, (12, 24)).astype(np.float64) for _ in range(2))
    g = _glu_graph(x, wg, wu)
    fused, unfused = (SearchSpace.build(g, fusion=f) for f in (True, False))
    p = fused.program(pick(fused, lambda t: False))
    p_off = unfused.program(pick(unfused, lambda t: False))
    launched = [k for k in p.launched() if k.kind is not KernelKind.CONST]
    assert [k.kind for k in launched] == [KernelKind.GEMM_EPILOGUE]
    (k,) = launched
    assert tuple(k.shape) == (5, 12) and k.layout.n == 24
    assert p.kernel(k.inputs[1].buffer).concat == ("wg", "wu")
    assert {v.views[0].offset for v in acc_views(k.body)} == {0, 12}
    got = CpuRuntime(p, g.weights).run({"x": x}).outputs["y"]
    np.testing.assert_array_equal(got, CpuRuntime(p_off, g.weights).run({"x": x}).outputs["y"])
    a, b = x @ wg.T, x @ wu.T  # exact (small integers)
    want = a / (1.0 + np.exp(-a)) * b
    np.testing.assert_allclose(got, want, rtol=2.0 ** -16, atol=1e-30)
    works = dict(zip((q.id for q in p.launched()), kernel_works(p, {})))
    assert works[k.id].bytes_written == 5 * 12 * 4  # F wide, no gate round trip
    w_off = dict(zip((q.id for q in p_off.launched()), kernel_works(p_off, {})))
    assert sum(w.bytes_moved for w in works.values()) < sum(w.bytes_moved for w in w_off.values())
    assert program_from_data(program_to_data(p)) == p


def test_glu_fires_in_the_llama_layer_and_keeps_every_output_bit_for_bit():
    off, on = program(False), program(True)
    assert len(glu_kernels(on)) == LLAMA_TINY.num_hidden_layers and not glu_kernels(off)
    y_off, y_on = run(off), run(on)
    for o in y_off:
        np.testing.assert_array_equal(y_on[o], y_off[o], err_msg=o)


def test_glu_is_refused_by_the_tiled_kernel_when_a_view_is_not_a_column_slice():
    p = program(True)
    (k, *_) = glu_kernels(p)
    v = sorted(acc_views(k.body), key=lambda s: s.encode())[0]
    bad = v.permute((1, 0)) if len(v.shape) == 2 else v.reshape(tuple(reversed(v.shape)))
    bad_body = _swap_acc(k.body, v, bad)
    with pytest.raises(ValueError, match="not a column slice"):
        glu_offsets(dataclasses.replace(k, body=bad_body))


def _swap_acc(e, old, new):
    if isinstance(e, FAcc):
        return FAcc(new) if e.view == old else e
    if hasattr(e, "args"):
        return dataclasses.replace(e, args=tuple(_swap_acc(a, old, new) for a in e.args))
    if hasattr(e, "x"):
        return dataclasses.replace(e, x=_swap_acc(e.x, old, new))
    return e


@needs_nvrtc
def test_glu_kernel_compiles_and_the_interpreter_matches_the_cpu_backend_bit_for_bit():
    """The tiled GLU kernel (two accumulators per thread, FP32 fma in K order): NVRTC compiles it, and the
    interpreter's output equals the CPU backend's up to the last bits the interpreter's exp2 / recip may
    differ in (integer data: the dot products are exact in any order)."""
    rng = np.random.default_rng(2)
    x = rng.integers(-3, 4, (3, 40)).astype(np.float64)
    wg, wu = (rng.integers(-3, 4, (20, 40)).astype(np.float64) for _ in range(2))
    g = _glu_graph(x, wg, wu)
    s = SearchSpace.build(g)
    for tags in (frozenset(), frozenset({"gemm:bf16"})):
        p = s.program(pick(s, tags.__contains__))
        (k,) = glu_kernels(p)
        feed = {**g.weights, "x": x}
        stored = stored_values(p, feed)
        src = render_kernel(k, p)
        assert src.gemm is None
        nvrtc.compile_cuda(src.source, src.name)
        got = interpret(p, k, stored, bind_program(p, feed))
        np.testing.assert_allclose(got, stored[k.id].reshape(got.shape), rtol=2.0 ** -21, atol=1e-35)


# -- stored weights concatenated --------------------------------------------------------------------
def test_concatenation_refuses_blocks_that_span_parts_with_the_reason():
    assert concat_refusal("int4_g128", [(64, 256), (32, 256)]) == ""
    assert concat_refusal("int8_channel", [(7, 5), (3, 5)]) == ""
    assert concat_refusal("gguf_q4_1", [(8, 64), (8, 64)]) == ""
    assert "tensor scale" in concat_refusal("nvfp4", [(64, 64), (32, 64)])
    assert "tiles would span" in concat_refusal("f8e4m3_block128", [(64, 256), (128, 256)])
    assert concat_refusal("f8e4m3_block128", [(128, 256), (64, 256)]) == ""  # only the last part may be ragged
    assert "along K" in concat_refusal("int4_g32", [(64, 32), (64, 32)], axis=1)
    assert concat_refusal("bf16", [(64, 32), (64, 16)], axis=1) == ""
    assert "different K" in concat_refusal("int8_channel", [(4, 8), (4, 16)])
    group = FusionGroup(0, (), 0, 1, 0, 256)
    assert group.stored_shapes() == []
    with pytest.raises(ValueError, match="tensor scale"):
        fmt = STORAGE_FORMATS["nvfp4"]
        concat_quantized([fmt.quantize(np.ones((4, 32))), fmt.quantize(np.ones((4, 32)))])


@pytest.mark.parametrize("fmt", ["int4_g32", "int4_g128_asym", "int8_channel", "mxfp4", "f8e4m3_channel", "bf16",
                                 "gguf_q4_1"])
def test_concatenated_stored_tensor_keeps_every_part_value_and_scale(fmt):
    """Joined containers (packed nibbles, scales) = the parts' own, and they dequantize to the parts'
    widened values side by side (what the CPU backend's KCatStored buffer holds)."""
    f = STORAGE_FORMATS[fmt]
    rng = np.random.default_rng(1)
    ws = [(rng.standard_normal((n, 64)) * 10.0 ** rng.uniform(-2, 0, (n, 1))).astype(np.float32) for n in (16, 8, 8)]
    qs = [f.quantize(w) for w in ws]
    joined = concat_stored([f.pack(q) for q in qs])
    for part in f.parts:
        np.testing.assert_array_equal(joined.arrays[part], np.concatenate([f.pack(q).arrays[part] for q in qs]))
    np.testing.assert_array_equal(f.unpack(joined).dequantize(), concat_quantized(qs).dequantize())
    np.testing.assert_array_equal(concat_quantized(qs).dequantize(), concat_widened([widened(w, f) for w in ws], f))


@pytest.mark.parametrize("label", sorted(STORAGE_RECIPES))
def test_stored_parts_fuse_and_equal_the_separate_gemms_bit_for_bit(label):
    """Every storage recipe: q/k/v and gate/up read one concatenated stored weight (its format the parts'),
    the layer drops to the FP32 plan's kernel count, every output equals the unfused program of the same
    recipe bit for bit, and the static bound is the unfused one (the same arithmetic) and holds."""
    tags = STORAGE_RECIPES[label]
    fmt = next(t.split(":", 1)[1] for t in tags if t.startswith("store:"))
    off, on = program(False, tags), program(True, tags)
    cats = [k for k in on.kernels if k.concat]
    assert cats and all(k.storage == fmt for k in cats)
    per_layer = collections.Counter(k.chunk for k in on.launched())
    assert per_layer[1] == collections.Counter(k.chunk for k in program(True).launched())[1] + ("kv:" in str(tags))
    y_off, y_on = run(off), run(on)
    for o in y_off:
        np.testing.assert_array_equal(y_on[o], y_off[o], err_msg=o)
    graph, inputs = llama()
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    b_on = static_bound(on, ranges, graph.bind_symbols(inputs), graph.weights)
    b_off = static_bound(off, ranges, graph.bind_symbols(inputs), graph.weights)
    ref = evaluate(graph, inputs)
    for o in ref:
        assert np.all(np.abs(y_on[o] - ref[o]) <= b_on.error_bounds[o]), o
        # the fused Gemm's a-priori term takes the largest |w| over every part: a hair apart at most (up to
        # 1.2e-4 relative on the cache rows, which carry each written row's own error since the static
        # bound keeps cache rows apart, instead of the hull of every row that blurred the difference)
        np.testing.assert_allclose(b_on.error_bounds[o], b_off.error_bounds[o], rtol=1e-3, err_msg=o)


def test_mixed_storage_keeps_the_parts_apart():
    """One weight knob moved to another format: its fused group cannot be held as one stored tensor, so
    those parts stay separate Gemms (fewer concatenations, more launches) and the outputs still equal the
    unfused program of that genome bit for bit."""
    s = space(True)
    base = pick(s, STORAGE_RECIPES["W4A16 INT4 group 128"].__contains__)
    p = s.program(base)
    moved = next((g, c, t) for g, c, t in sorted(base) if t == "store:int4_g128" and any(
        k.concat and k.storage for k in p.kernels))
    genome = (base - {moved}) | {(moved[0], moved[1], "store:int8_channel")}
    mixed = s.program(genome)
    stored_cats = lambda q: sum(bool(k.concat and k.storage) for k in q.kernels)  # noqa: E731
    if stored_cats(mixed) < stored_cats(p):
        assert len(mixed.launched()) > len(p.launched())
    assert {k.storage for k in mixed.kernels if k.concat} <= {"int4_g128", None}
    s_off = space(False)
    off = s_off.program(frozenset((g, c, t) for g, c, t in genome if any(
        k.cls == c for ks in s_off.knobs.values() for k in ks)))
    y_off, y_on = run(off), run(mixed)
    for o in y_off:
        np.testing.assert_array_equal(y_on[o], y_off[o], err_msg=o)


@needs_nvrtc
@pytest.mark.parametrize("fmt,act", [("int4_g32", BF16), ("int8_channel", F32), ("gguf_q8_0", BF16)])
def test_dequantize_on_load_over_the_concatenation_equals_the_separate_kernels_bit_for_bit(fmt, act):
    """The CUDA dequantize-on-load Gemm run (interpreted) on the concatenated stored containers computes
    exactly the three part Gemms run on their own containers, column for column."""
    f = STORAGE_FORMATS[fmt]
    rng = np.random.default_rng(3)
    m, k = 2, 64
    a = rng.standard_normal((m, k)).astype(np.float32)
    a = a.astype(np.float32) if act is F32 else np.asarray(a, dtype=BF16.storage).astype(np.float32)
    ws = [(rng.standard_normal((n, k)) * 0.1).astype(np.float32) for n in (16, 8, 8)]
    parts = [f.pack(f.quantize(w)) for w in ws]
    fused = _interpret_weight_only(f, act, a, concat_stored(parts))
    separate = np.concatenate([_interpret_weight_only(f, act, a, p) for p in parts], axis=1)
    np.testing.assert_array_equal(fused, separate)


def _interpret_weight_only(fmt, act, a, stored) -> np.ndarray:
    m, k = a.shape
    n = stored.shape[0]
    src = render_weight_only(fmt, act, m, n, k, act)
    fn, params = compile_entry(src.source, src.name)
    out = Buffer(np.zeros(m * n), False)
    args = {"out": out, "a": Buffer(a.astype(np.float64).reshape(-1), False)}
    for part, arr in stored.arrays.items():
        args[param_name(part)] = Buffer(np.asarray(arr).astype(np.float64).reshape(-1), arr.dtype.kind in "iu")
    launch(fn, args, src.grid, src.block)
    return out.values.reshape(m, n).astype(np.float32)


def test_the_gpu_backend_reads_the_parts_own_stored_values():
    """runtime/weight_only.stored_weight for a KCatStored buffer: the joined parts (equal to what the CPU
    backend widens), not a quantization of the joined FP32 weights."""
    p = program(True, STORAGE_RECIPES["W4A16 INT4 group 128"])
    graph, inputs = llama()
    (cat, *_) = [k for k in p.kernels if k.concat and k.storage]
    q = stored_weight(cat, graph.weights)
    parts = [widened(graph.weights[n], cat.storage) for n in cat.concat]
    np.testing.assert_array_equal(q.dequantize(), np.concatenate(parts))
    # the q/k/v Gemm over it runs as the dequantize-on-load kernel (M = 1 decode: no M axis) on those values
    qkv = [k for k in p.launched() if k.kind is KernelKind.GEMM and p.kernel(k.inputs[1].buffer).concat]
    assert qkv and all(weight_only_gemm(k, p) is not None for k in qkv)
    only = dataclasses.replace(p, outputs=(("cat", cat.id),))
    np.testing.assert_array_equal(CpuRuntime(only, graph.weights).run(inputs).outputs["cat"], np.concatenate(parts))


# -- fuzzing with storage shared across parts -------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama_decode", "llama_prefill"])
def test_static_bound_holds_under_genome_fuzzing_with_stored_concatenations(name):
    """Random genomes in which every weight shares one storage tag (so concatenated stored weights are
    chosen) and every other knob is random, activations scaled towards the narrow formats' limits:
    measured error vs FP64 never exceeds the static bound; KCatStored and GLU epilogues are exercised."""
    if name == "llama_decode":
        graph, base = llama()
        s = space(True)
    else:
        m = build_prefill(LLAMA_TINY, random_weights(LLAMA_TINY, seed=1), 4, 8)
        graph, base = m.graph, m.make_inputs([3, 1, 4, 1], np.arange(4))
        s = SearchSpace.build(graph, fusion=True)
    rng = np.random.default_rng(61)
    stores = sorted({t for ks in s.knobs.values() for k in ks for t in k.tags if t.startswith("store:")})
    assert stores
    seen = checked = 0
    for trial in range(8):
        store = str(rng.choice(stores))
        scale = float(rng.choice([1.0, 30.0]))
        inputs = {k: (v * scale if np.issubdtype(np.asarray(v).dtype, np.floating) and k.startswith(("x", "attn"))
                      else v) for k, v in base.items()}
        genome = []
        for gk, ks in s.knobs.items():
            for k in ks:
                if store in k.tags:
                    genome.append((gk, k.cls, store))
                elif rng.random() < 0.5 and not any(t.startswith("store:") for t in k.tags):
                    genome.append((gk, k.cls, str(rng.choice(k.tags))))
        p = s.program(frozenset(genome))
        seen += any(k.concat and k.storage for k in p.kernels)
        ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
        rep = static_bound(p, ranges, graph.bind_symbols(inputs), graph.weights)
        if rep.overflow is not None:
            continue
        ref = evaluate(graph, inputs)
        out = CpuRuntime(p, graph.weights).run(inputs).outputs
        for o in ref:
            bound = rep.error_bounds[o]
            assert np.all((np.abs(out[o] - ref[o]) <= bound) | np.isinf(bound)), (o, trial, store)
        checked += 1
    assert seen and checked


def test_a_plans_weights_file_holds_the_parts_of_a_stored_concatenation():
    """search/plan.stored_layout lists each part of a KCatStored buffer (never the concatenation's name),
    so the weights file converts and holds the parts; a runtime reading that file computes the same."""
    p = program(True, STORAGE_RECIPES["W4A16 INT4 group 128"])
    graph, inputs = llama()
    layout = stored_layout(p)
    cat_parts = {n for k in p.kernels if k.concat and k.storage for n in k.concat}
    assert cat_parts and cat_parts <= {name for name, _, _ in layout.values()}
    assert not any(name.startswith("concat") for name, _, _ in layout.values())
    stored = convert_all(graph.weights, {key: (name, fmt) for key, (name, fmt, _) in layout.items()})
    y_file = CpuRuntime(p, graph.weights, stored_weights=stored).run(inputs).outputs
    y = run(p)
    for o in y:
        np.testing.assert_array_equal(y_file[o], y[o], err_msg=o)


@pytest.mark.parametrize("variant", ["bf16", "f16", "tf32", "f8e4m3_channel_prologue", "f8e4m3_channel", "int8_channel",
                                     "f8e4m3_mx", "f8e4m3_channel_dynamic"])
def test_glu_in_every_gemm_variant_stays_within_its_static_bound(variant):
    """Every Gemm of the llama layer in `variant` (A quantized at run time where the variant says so): the
    GLU epilogue is taken, and its error vs FP64 stays within the static bound, inputs scaled up too."""
    s = space(True)
    want = "gemm:" + variant
    p = s.program(pick(s, want.__eq__))
    assert glu_kernels(p) and {k.precision for k in glu_kernels(p)} == {variant}
    graph, base = llama()
    for scale in (1.0, 40.0):
        inputs = {k: (v * scale if np.issubdtype(np.asarray(v).dtype, np.floating) else v) for k, v in base.items()}
        ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
        rep = static_bound(p, ranges, graph.bind_symbols(inputs), graph.weights)
        if rep.overflow is not None:
            continue
        ref, out = evaluate(graph, inputs), run(p, inputs)
        for o in ref:
            assert np.all(np.abs(out[o] - ref[o]) <= rep.error_bounds[o]), (o, scale)
