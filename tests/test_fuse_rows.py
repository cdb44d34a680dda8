"""Row fusion and launch-free constants (search/rules/fuse_rows.py, issue 16).

A norm (RMSNorm, LayerNorm as models/llama.py and models/bert.py build them) becomes one ROWS kernel and
scalar constants launch nothing. The fused kernel keeps every rounding of the unfused chain, so the
oracles are: the unfused program (bit for bit, every genome), a slow per-element reference of the row
kernel written here, FP64 within the static bound (fuzzed, magnitudes near format limits), and the
CUDA interpreter / NVRTC for the generated C.
"""
from __future__ import annotations

import collections
import dataclasses
import warnings

import ml_dtypes
import numpy as np
import pandas as pd
import pytest

from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_kernels import render_kernel
from luminal_num.codegen.llir import FApply, FAt, FConstV, FLoad, FRoundTo, FRowSum, Kernel, KernelInput, KernelKind
from luminal_num.codegen.rows import unfused
from luminal_num.codegen.serialize import program_from_data, program_to_data
from luminal_num.dtypes.formats import BF16, F16, F32, INT32
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.hlir.ops import Op
from luminal_num.hlir.shape import ShapeTracker, View
from luminal_num.models.llama import LLAMA_TINY, build_decode, random_weights
from luminal_num.models.registry import minilm_job
from luminal_num.models.testnets import mlp, transformer
from luminal_num.report.compile_report import kernels_per_chunk
from luminal_num.runtime.cpu import CpuRuntime, bind_program
from luminal_num.runtime.latency import kernel_works, modelled_latency
from luminal_num.search.choice import random_candidate
from luminal_num.search.lower import lower_program
from luminal_num.search.plan import op_table
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace
from test_cuda_codegen import interpret, needs_nvrtc, one_kernel, stored_values

warnings.filterwarnings("ignore", category=RuntimeWarning)
LAYERS = 2


@pytest.fixture(scope="module")
def decode():
    cfg = LLAMA_TINY.with_layers(LAYERS)
    model = build_decode(cfg, random_weights(cfg, seed=0), max_cache=16)
    return model, model.make_inputs(np.array([7]), np.array([3]))


@pytest.fixture(scope="module")
def decode_spaces(decode):
    return {f: SearchSpace.build(decode[0].graph, fusion=f) for f in (False, True)}


def per_layer(program, layer: int = 1) -> collections.Counter:
    return collections.Counter(k.kind for k in program.launched() if k.chunk == layer)


def test_llama_norms_are_one_row_kernel_and_constants_launch_nothing(decode_spaces):
    before, after = (s.program(pick(s, lambda t: False)) for s in (decode_spaces[False], decode_spaces[True]))
    for layer in range(1, LAYERS + 1):
        old, new = per_layer(before, layer), per_layer(after, layer)
        assert old[KernelKind.CONST] == 6 and old[KernelKind.SUM] == 2  # today's layer: what fusion removes
        # two norms and q's RoPE (its rotate-half negation read through a pad, computed in place); k's RoPE
        # is computed by the KV-cache write itself
        assert new[KernelKind.CONST] == 0 and new[KernelKind.SUM] == 0 and new[KernelKind.ROWS] == 3
        assert new[KernelKind.SCATTER_EW] == 1 and new[KernelKind.SCATTER_NOCOPY] == 1  # v is a Gemm: a copy
        # constants, 3 -> 1 per norm, 2 -> 1 for q's RoPE, 3 -> 1 for k's RoPE and its cache write (at
        # least: the Gemm and attention fusions take more)
        assert sum(old.values()) - sum(new.values()) >= 6 + 2 * 2 + 1 + 2
    assert not any(k.kind is KernelKind.CONST for k in after.launched())


def test_minilm_layer_norms_fuse_and_constants_launch_nothing():
    job = minilm_job()
    before, after = (SearchSpace.build(job.graph, fusion=f) for f in (False, True))
    old, new = (s.program(pick(s, lambda t: False)) for s in (before, after))
    for layer in range(1, 7):
        counts = per_layer(new, layer)
        # both LayerNorms are row kernels (other elementwise values may be too), no reduction or constant left
        assert counts[KernelKind.ROWS] >= 2 and counts[KernelKind.SUM] == 0 and counts[KernelKind.CONST] == 0
        assert per_layer(old, layer)[KernelKind.SUM] == 4  # mean and variance of both LayerNorms
    assert len(new.launched()) < len(old.launched())


def test_fusion_off_is_the_space_without_row_nodes(decode_spaces):
    off = {n.op for g in decode_spaces[False].groups.values() for ns in g.space.classes.values() for n in ns}
    on = {n.op for g in decode_spaces[True].groups.values() for ns in g.space.classes.values() for n in ns}
    assert not off & {"KRows", "RowBody", "FRowSum", "FAt"}
    assert {"KRows", "RowBody", "FRowSum", "FAt"} <= on


def _genomes(space: SearchSpace, rng) -> dict:
    changes = space.all_changes()
    out = {"f32": frozenset(), "bf16": pick(space, lambda t: "bf16" in t),
           "f16 sums": pick(space, lambda t: t.startswith("sum:f16")), "bf16 sums": pick(space, lambda t: t == "sum:bf16")}
    for i in range(3):
        chosen, seen = [], set()
        for j in rng.permutation(len(changes))[:12]:
            g, c, t = changes[j]
            if (g, c) not in seen:
                seen.add((g, c))
                chosen.append(changes[j])
        out[f"random{i}"] = frozenset(chosen)
    return out


@pytest.mark.parametrize("which", ["llama", "mlp", "transformer"])
def test_fused_and_unfused_compute_the_same_bits(which, decode, decode_spaces):
    """Fusion removes no rounding (every stored format is kept as FRound / the row sum's dt), so the fused
    and unfused programs of one genome agree bit for bit, for every precision choice."""
    if which == "llama":
        graph, inputs, spaces = decode[0].graph, decode[1], decode_spaces
    else:
        model = mlp() if which == "mlp" else transformer(2)
        graph, inputs = model.graph, model.make_inputs(3)
        spaces = {f: SearchSpace.build(graph, fusion=f) for f in (False, True)}
    fused_rows = 0
    # the fusion phases run after the precision phase: every unfused knob is a knob of the fused space with
    # at least its tags (attention adds attn: tags to the P V class), so the unfused genomes apply to both
    for gk, ks in spaces[False].knobs.items():
        fused = {k.cls: set(k.tags) for k in spaces[True].knobs[gk]}
        assert all(set(k.tags) <= fused.get(k.cls, set()) for k in ks)
    for name, genome in _genomes(spaces[False], np.random.default_rng(5)).items():
        outs = []
        for f in (False, True):
            program = spaces[f].program(genome)
            fused_rows += f and sum(k.kind in (KernelKind.ROWS, KernelKind.SCATTER_EW) for k in program.kernels)
            outs.append(CpuRuntime(program, graph.weights).run(inputs).outputs)
        for out in outs[0]:
            assert np.array_equal(outs[0][out], outs[1][out]), (name, out)
    assert fused_rows > 0


# -- the row kernel against a slow reference ------------------------------------------------------------------

def _bf16(x) -> np.float32:
    return np.float32(ml_dtypes.bfloat16(np.float32(x)))


def _rms_layer_norm_kernel(rows: int, n: int):
    """y = (x - mean) * rsqrt(mean((x - mean)^2) + eps) * g: both sums accumulated in BF16 (index order),
    the mean stored in BF16, the variance in F32; a nested row sum (the mean inside the variance)."""
    x_view, g_view = ShapeTracker.contiguous((rows, n)), ShapeTracker.contiguous((n,)).expand_dim(0, rows)
    per_row = ShapeTracker.contiguous((rows,)).expand_dim(1, n)
    mean = FAt(FRowSum(FLoad(0), BF16, BF16, (rows, n)), per_row, (rows,))
    mean = FApply(Op.MUL, (mean, FConstV(1.0 / n)))
    centred = FApply(Op.ADD, (FLoad(0), FApply(Op.MUL, (mean, FConstV(-1.0)))))
    var = FAt(FRowSum(FRoundTo(FApply(Op.MUL, (centred, centred)), BF16), BF16, F32, (rows, n)), per_row, (rows,))
    scale = FApply(Op.RECIP, (FApply(Op.SQRT, (FApply(Op.ADD, (FApply(Op.MUL, (var, FConstV(1.0 / n))),
                                                               FConstV(1e-5))),)),))
    body = FApply(Op.MUL, (FApply(Op.MUL, (centred, scale)), FLoad(1)))
    return one_kernel([("x", (rows, n), F32), ("g", (n,), F32)], kind=KernelKind.ROWS, shape=(rows, n), dtype=F16,
                      inputs=(KernelInput(0, x_view), KernelInput(1, g_view)), body=body, body_shape=(rows, n),
                      axis=1)


def _slow_reference(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The same arithmetic element by element: FP32 ops, BF16 accumulators rounded after every add."""
    f = np.float32
    out = np.zeros(x.shape)
    n = x.shape[1]
    for i in range(x.shape[0]):
        acc = f(0)
        for j in range(n):
            acc = _bf16(np.float64(acc) + np.float64(x[i, j]))
        mean = f(acc * f(1.0 / n))
        centred = [f(f(x[i, j]) + f(mean * f(-1.0))) for j in range(n)]
        acc = f(0)
        for c in centred:
            acc = _bf16(np.float64(acc) + np.float64(_bf16(f(c * c))))
        scale = f(1) / f(np.sqrt(f(f(acc * f(1.0 / n)) + f(1e-5)), dtype=np.float32))
        for j in range(n):
            out[i, j] = np.float16(f(f(centred[j] * scale) * f(g[j])))
    return out


def test_row_kernel_emulation_matches_a_slow_reference():
    rng = np.random.default_rng(3)
    program = _rms_layer_norm_kernel(5, 24)
    x, g = (3 * rng.standard_normal((5, 24))).astype(np.float32), (1 + rng.standard_normal(24)).astype(np.float32)
    got = CpuRuntime(program).run({"x": x, "g": g}).outputs["y"]
    np.testing.assert_array_equal(got, _slow_reference(x, g))
    # and the unfused chain codegen/rows.py builds for the static bound computes the same bits
    mini, ext = unfused(program.kernels[-1], program.kernels[:2])
    feed = {f"%{b}": v for b, v in zip(ext, (x, g))}
    np.testing.assert_array_equal(CpuRuntime(mini).run(feed).outputs["out"], got)


def test_row_kernel_generated_c_matches_the_cpu_backend():
    program = _rms_layer_norm_kernel(3, 40)
    rng = np.random.default_rng(4)
    feed = {"x": rng.standard_normal((3, 40)).astype(np.float32), "g": rng.standard_normal(40).astype(np.float32)}
    stored = stored_values(program, feed)
    k = program.kernels[-1]
    got = interpret(program, k, stored, bind_program(program, feed))
    np.testing.assert_array_equal(got, stored[k.id].reshape(3, 40))  # narrow sums: the same order, exact


def test_model_row_kernels_generated_c_matches_the_cpu_backend(decode, decode_spaces):
    model, inputs = decode
    space = decode_spaces[True]
    checked = 0
    for genome in (frozenset(), pick(space, lambda t: "bf16" in t)):
        program = space.program(genome)
        feed = {**model.graph.weights, **inputs}
        stored = stored_values(program, feed)
        bindings = bind_program(program, feed)
        for k in program.launched():
            if k.kind in (KernelKind.ROWS, KernelKind.SCATTER_EW):
                ref = stored[k.id].reshape([int(d) for d in k.shape])
                n = int(k.shape[-1])  # FP32 row sums may add in another order: n ulps, through rsqrt
                tol = n * 2.0 ** -22 * (1 + float(np.max(np.abs(ref))))
                np.testing.assert_allclose(interpret(program, k, stored, bindings), ref, rtol=0, atol=tol)
                checked += 1
    assert checked == 2 * (4 * LAYERS + 1)  # two norms, q's RoPE, k's cache write per layer, the final norm


@needs_nvrtc
def test_row_kernels_compile_with_nvrtc(decode, decode_spaces):
    job = minilm_job()
    minilm = SearchSpace.build(job.graph)
    sources = {}
    for space in (decode_spaces[True], minilm):
        for genome in (frozenset(), pick(space, lambda t: "bf16" in t), pick(space, lambda t: t == "sum:f16")):
            program = space.program(genome)
            for k in program.launched():
                if k.kind in (KernelKind.ROWS, KernelKind.SCATTER_EW):
                    src = render_kernel(k, program)
                    sources[src.source] = src
    assert len(sources) >= 4
    for src in sources.values():
        nvrtc.compile_cuda(src.source, src.name)


# -- soundness, cost, plans ----------------------------------------------------------------------------------

@pytest.mark.parametrize("which,scale", [("mlp", 1.0), ("mlp", 2.0 ** 7), ("mlp", 2.0 ** 62), ("transformer", 1.0),
                                         ("transformer", 2.0 ** 6), ("llama", 1.0)])
def test_static_bound_covers_the_fused_error_under_genome_fuzzing(which, scale, decode):
    """Random candidates (structure and precision, fusion on) at magnitudes near format limits (f16 squares
    overflow from ~2^8, f32 squares from 2^64): measured error vs FP64 never exceeds the static bound."""
    if which == "llama":
        graph, inputs = decode[0].graph, decode[1]
    else:
        model = mlp() if which == "mlp" else transformer(1)
        graph = model.graph
        inputs = {k: v * scale for k, v in model.make_inputs(2).items()}
    space = SearchSpace.build(graph)
    ref = evaluate(graph, inputs)
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    rng = np.random.default_rng(int(scale) % 1000 + len(which))
    rows = 0
    for _ in range(12):
        choices = {c.index: random_candidate(space.groups[g.key].space, rng) for g in space.part.groups for c in g.chunks}
        program = lower_program(graph, space.part, space.groups, choices)
        rows += sum(k.kind in (KernelKind.ROWS, KernelKind.SCATTER_EW) for k in program.kernels)
        rep = static_bound(program, ranges, graph.bind_symbols(inputs), graph.weights)
        if rep.overflow is not None:
            continue
        out = CpuRuntime(program, graph.weights).run(inputs).outputs
        for name in ref:
            bad = ~(np.abs(out[name] - ref[name]) <= rep.error_bounds[name])
            assert not np.any(bad & ~np.isnan(out[name])) and not np.any(np.isnan(out[name]) & np.isfinite(
                rep.error_bounds[name])), name
    assert rows > 0


def test_fusion_removes_launches_and_intermediate_bytes(decode, decode_spaces):
    model, inputs = decode
    bindings = model.graph.bind_symbols(inputs)
    progs = {f: s.program(frozenset()) for f, s in decode_spaces.items()}
    moved = {f: sum(w.bytes_moved for w in kernel_works(p, bindings)) for f, p in progs.items()}
    lat = {f: modelled_latency(p, "h200", bindings).total_s for f, p in progs.items()}
    assert moved[True] < moved[False] and lat[True] < lat[False]
    removed = len(progs[False].launched()) - len(progs[True].launched())
    assert removed >= LAYERS * 13 + 2  # per layer 6 constants, 2 x 2 norm, 3 RoPE kernels; the final norm


def test_row_kernels_survive_the_plan_format(decode_spaces):
    space = decode_spaces[True]
    program = space.program(pick(space, lambda t: "bf16" in t))
    assert any(k.kind is KernelKind.ROWS for k in program.kernels)
    assert program_from_data(program_to_data(program)) == program


def test_compile_report_counts_kernels_per_layer(decode, decode_spaces):
    space = decode_spaces[True]
    program = space.program(frozenset())
    ops = pd.DataFrame(op_table(program, decode[0].graph.bind_symbols(decode[1])))
    table = kernels_per_chunk(ops, [[c.index for c in g.chunks] for g in space.part.groups])
    layers = table[table.chunk.between(1, LAYERS)]
    assert list(layers.kernels) == [sum(per_layer(program, c).values()) for c in range(1, LAYERS + 1)]
    assert list(layers.rows) == [3] * LAYERS and list(layers.scatter_ew) == [1] * LAYERS and layers.group.nunique() == 1
    assert table.kernels.sum() == len(program.launched())


def test_computed_scatter_matches_a_slow_reference_in_emulation_and_generated_c():
    """A KV-cache write computing its rows (x * c + the negated x shifted by 2 through a masked view, stored
    as BF16) against element-by-element Python, then the generated C in the interpreter."""
    shifted = ShapeTracker((View.create((2, 4), (4, 1), offset=-2, mask=((0, 2), (2, 4))),))
    neg = FAt(FApply(Op.MUL, (FLoad(2), FConstV(-1.0))), shifted, (2, 4))
    body = FRoundTo(FApply(Op.ADD, (FApply(Op.MUL, (FLoad(2), FLoad(3))), neg)), BF16)
    c2 = ShapeTracker.contiguous((2, 4))
    program = one_kernel([("d", (6, 4), F32), ("i", (2,), INT32), ("x", (2, 4), F32), ("c", (2, 4), F32)],
                         kind=KernelKind.SCATTER_EW, shape=(6, 4), dtype=F32, aliases=0, body=body, body_shape=(2, 4),
                         inputs=(KernelInput(0, ShapeTracker.contiguous((6, 4))),
                                 KernelInput(1, ShapeTracker.contiguous((2,))), KernelInput(2, c2), KernelInput(3, c2)))
    rng = np.random.default_rng(8)
    feed = {"d": rng.standard_normal((6, 4)).astype(np.float32), "i": np.array([4, 1], dtype=np.int32),
            "x": rng.standard_normal((2, 4)).astype(np.float32), "c": rng.standard_normal((2, 4)).astype(np.float32)}
    want = feed["d"].astype(np.float64)
    f = np.float32
    for r in range(2):
        for j in range(4):
            shifted_neg = f(feed["x"][r, j - 2] * f(-1.0)) if j >= 2 else f(0.0)
            want[feed["i"][r], j] = _bf16(f(f(feed["x"][r, j] * feed["c"][r, j]) + shifted_neg))
    got = CpuRuntime(program).run(feed).outputs["y"]
    np.testing.assert_array_equal(got, want)
    stored = stored_values(program, feed)
    np.testing.assert_array_equal(interpret(program, program.kernels[-1], stored, bind_program(program, feed)), want)


@pytest.mark.parametrize("which", ["mlp", "transformer", "llama"])
def test_fused_static_bound_is_no_looser_than_unfused(which, decode):
    """The bound follows the unfused chain (codegen/rows.py), correlated norm bound included: fusing never
    turns a finite bound infinite or looser (it may be tighter: constants are FConst, not stored). Up to 1%:
    each store keeps the smaller of two sound bounds (elementwise and row norm, error/static_ball.py), and
    fused and unfused forms store at different points (measured: at most 0.08% looser)."""
    if which == "llama":
        graph, inputs = decode[0].graph, decode[1]
    else:
        model = mlp() if which == "mlp" else transformer(1)
        graph, inputs = model.graph, model.make_inputs(4)
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    spaces = {f: SearchSpace.build(graph, fusion=f) for f in (False, True)}
    for genome in (frozenset(), pick(spaces[False], lambda t: "bf16" in t)):
        bounds = [static_bound(spaces[f].program(genome), ranges, graph.bind_symbols(inputs), graph.weights)
                  for f in (False, True)]
        for name, unfused_bound in bounds[0].error_bounds.items():
            assert np.all(bounds[1].error_bounds[name] <= unfused_bound * (1 + 1e-2)), name


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_computed_scatter_into_an_unscaled_kv_cache_writes_rows_converted(fmt):
    """RoPE-style computed rows written into a KV cache held in F16/BF16: the CPU backend and the generated C
    (interpreter) both store each row rounded to the cache's format, the rows already there converted on
    entry; element-by-element reference with numpy / ml_dtypes casts. A scaled FP8 cache is refused by the
    renderer in one line (the plain in-place scatter writes those: extraction keeps it first)."""
    cast = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}[fmt]
    body = FApply(Op.ADD, (FApply(Op.MUL, (FLoad(2), FLoad(3))), FLoad(2)))
    c2 = ShapeTracker.contiguous((2, 4))
    program = one_kernel([("d", (6, 4), F32), ("i", (2,), INT32), ("x", (2, 4), F32), ("c", (2, 4), F32)],
                         kind=KernelKind.SCATTER_EW, shape=(6, 4), dtype=F32, aliases=0, body=body, body_shape=(2, 4),
                         storage=fmt, inputs=(KernelInput(0, ShapeTracker.contiguous((6, 4))),
                                              KernelInput(1, ShapeTracker.contiguous((2,))), KernelInput(2, c2),
                                              KernelInput(3, c2)))
    program = dataclasses.replace(program, kernels=(dataclasses.replace(program.kernels[0], storage=fmt),
                                                    *program.kernels[1:]))
    rng = np.random.default_rng(9)
    feed = {"d": rng.standard_normal((6, 4)).astype(np.float32) * 300, "i": np.array([5, 0], dtype=np.int32),
            "x": rng.standard_normal((2, 4)).astype(np.float32) * 300, "c": rng.standard_normal((2, 4)).astype(np.float32)}
    want = feed["d"].astype(cast).astype(np.float64)
    f = np.float32
    for r in range(2):
        for j in range(4):
            want[feed["i"][r], j] = float(cast(f(f(feed["x"][r, j] * feed["c"][r, j]) + feed["x"][r, j])))
    got = CpuRuntime(program).run(feed).outputs["y"]
    np.testing.assert_array_equal(got, want)
    stored = stored_values(program, feed)
    np.testing.assert_array_equal(interpret(program, program.kernels[-1], stored, bind_program(program, feed)), want)
    fp8 = dataclasses.replace(program.kernels[-1], storage="f8e4m3_channel")
    with pytest.raises(ValueError, match="per-row scales"):
        render_kernel(fp8, dataclasses.replace(program, kernels=(dataclasses.replace(program.kernels[0],
                                                                                     storage="f8e4m3_channel"),
                                                                 *program.kernels[1:-1], fp8)))
