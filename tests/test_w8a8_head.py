"""INT8 W8A8 (per-token dynamic INT8 activations x per-channel INT8 weights, INT32 sums) and 4-bit plans with the
LM head kept at INT8 (search/recipes.head_kept), as genomes of the search space (issue 32).

Truths used: an INT8 W8A8 linear written here in FP64 numpy (scales amax/127, round half to even, exact integer
sums); the FP64 evaluation of the graph (hlir.evaluate) with the static bound's soundness check (bound_checks);
the graph's own weight names for which Gemm is the head.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.hlir.graph import Graph
from luminal_num.models.llama import LLAMA_TINY
from luminal_num.quant.calibration import CALIBRATION
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.recipes import head_classes, head_kept, pick, rotated_recipe, smoothed_recipe
from luminal_num.search.space import SearchSpace
from tiny_llama import llama_with_hessians
from bound_checks import assert_plan_bounded, assert_within_bounds, errors_of

warnings.filterwarnings("ignore", category=RuntimeWarning)
CFG = LLAMA_TINY.with_layers(1)
INT8_W8A8 = frozenset({"store:int8_channel", "gemm:int8_channel"})
INT8_W8A8_GPTQ = frozenset({"store:int8_channel+gptq", "gemm:int8_channel"})
W4 = frozenset({"store:int4_g128", "gemm:bf16"})
W4_G32_GPTQ = frozenset({"store:int4_g32_asym+gptq", "gemm:bf16"})
HEAD = frozenset({"store:int8_channel", "gemm:bf16"})
U32 = 2.0 ** -24


def _llama(seq: int = 6):
    return llama_with_hessians(CFG, seq, smoothing=True)


def _weight_gemms(program, weights):
    """(Gemm kernel, the stored weight it reads) for every Gemm whose B is a weight (not H_b, not the cache)."""
    out = []
    for k in program.kernels:
        if k.kind.is_gemm:
            b = program.kernel(k.inputs[1].buffer)
            if b.weight_sources and all(s in weights for s in b.weight_sources):
                out.append((k, b))
    return out


def _int8_w8a8_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x W^T as INT8 W8A8 runs it, in FP64: one scale amax/127 per row of x (token) and per row of W (output
    channel), codes rounded half to even, the integer dot products exact, then both scales applied."""
    sa = np.abs(x).max(axis=1, keepdims=True) / 127.0
    sb = np.abs(w).max(axis=1, keepdims=True) / 127.0
    qa, qb = np.rint(x / sa), np.rint(w / sb)
    return (qa @ qb.T) * sa * sb.T


def test_an_int8_w8a8_linear_is_the_numpy_int8_product():
    """One Linear, the space's gemm:int8_channel with the weight stored int8_channel: the FP64 numpy INT8 product
    up to the FP32 rounding of the scales and the result (a few u32 of |y|), and far from the FP32 function."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    g = Graph()
    x = g.input("x", (5, 128))
    g.output(x @ g.weight("w", w).transpose(), "y")
    space = SearchSpace.build(g)
    program = space.program(pick(space, INT8_W8A8.__contains__))
    (k, b), = _weight_gemms(program, g.weights)
    assert k.precision == "int8_channel" and b.storage == "int8_channel"
    xs = rng.standard_normal((5, 128)).astype(np.float32)
    xs[:, 3] *= 40.0  # an outlier channel
    got = CpuRuntime(program, g.weights).run({"x": xs}).outputs["y"].astype(np.float64)
    want = _int8_w8a8_linear(xs.astype(np.float64), w.astype(np.float64))
    scale = np.abs(xs).max(axis=1, keepdims=True) * np.abs(w).max(axis=1)[None, :] / 127.0 ** 2
    assert np.all(np.abs(got - want) <= 8 * U32 * (np.abs(want) + scale))
    exact = xs.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(want - exact).max() > 1e3 * 8 * U32 * np.abs(exact).max()  # the test can tell INT8 from FP32


@pytest.mark.parametrize("transform", [None, "rot", "sq50"])
def test_int8_w8a8_runs_on_every_weight_gemm_and_within_its_static_bound_of_fp64(transform):
    """INT8 W8A8 plain, with every Gemm rotated, or smoothed (GPTQ-filled weights): every weight Gemm (the head
    included) runs int8_channel on an int8_channel weight, no other Gemm does, and the logits are within the
    static bound of the FP64 graph on both batches."""
    m, space, batches, hs = _llama()
    tags = INT8_W8A8 if transform is None else INT8_W8A8_GPTQ
    genome = (pick(space, tags.__contains__) if transform is None else rotated_recipe(space, tags)
              if transform == "rot" else smoothed_recipe(space, tags, transform))
    with CALIBRATION.installed(hs):
        program = space.program(genome)
        weighted = _weight_gemms(program, m.graph.weights)
        sources = {s for _, b in weighted for s in b.weight_sources}
        assert sources == {n for n, w in m.graph.weights.items() if np.ndim(w) == 2} - {"model.embed_tokens.weight"}
        assert all(k.precision == "int8_channel" and b.storage == "int8_channel" for k, b in weighted)
        assert all(b.fill == (None if transform is None else "gptq") for _, b in weighted)
        others = [k for k in program.kernels if k.kind.is_gemm and all(k is not w for w, _ in weighted)]
        assert others and all(k.precision != "int8_channel" for k in others)  # attention (and x H_b) Gemms
        for batch in batches:
            ranges = {n: Interval.point(np.asarray(v, dtype=np.float64)) for n, v in batch.items()}
            rep = static_bound(program, ranges, m.graph.bind_symbols(batch), m.graph.weights)
            assert rep.overflow is None
            out = CpuRuntime(program, m.graph.weights).run(batch).outputs
            errors = errors_of(out, evaluate(m.graph, batch))
            assert_within_bounds(rep.error_bounds, errors, transform)
            assert np.isfinite(rep.error_bounds["logits"]).all() and errors["logits"].max() > 0


@pytest.mark.parametrize("tags,transform", [(W4, None), (W4, "rot"), (W4_G32_GPTQ, "rot"), (W4, "sq50")])
def test_head_kept_holds_exactly_the_head_at_int8_and_every_other_gemm_in_the_recipe(tags, transform):
    m, space, batches, hs = _llama()
    base = (pick(space, tags.__contains__) if transform is None else rotated_recipe(space, tags)
            if transform == "rot" else smoothed_recipe(space, tags, transform))
    genome = head_kept(space, base, HEAD)
    fmt = next(t for t in tags if t.startswith("store:")).removeprefix("store:")
    stored, fill = fmt.partition("+")[::2]
    with CALIBRATION.installed(hs):
        program = space.program(genome)
    weighted = _weight_gemms(program, m.graph.weights)
    head = [(k, b) for k, b in weighted if b.weight_sources == ("lm_head.weight",)]
    rest = [(k, b) for k, b in weighted if b.weight_sources != ("lm_head.weight",)]
    assert len(head) == 1 and rest
    (hk, hb), = head
    assert hb.storage == "int8_channel" and hb.fill is None and hk.precision == "bf16"
    assert all(b.storage == stored and (b.fill or "") == fill and k.precision == "bf16" for k, b in rest)
    rotated = transform == "rot"
    assert (hb.rotation is not None) == rotated and all((b.rotation is not None) == rotated for _, b in rest)
    assert (hb.smoothing is not None) == (transform == "sq50")
    # the genome differs from the recipe's on the head's knobs only
    heads = {(g, c) for g, cs in head_classes(space).items() for c in cs}
    assert {(g, c) for g, c, _ in genome ^ base} <= heads
    # and it still runs within its static bound of FP64
    batch = batches[0]
    assert_plan_bounded(program, m.graph, batch, hs)


def test_head_classes_find_only_the_output_gemm_and_refuse_a_graph_without_one():
    m, space, _, _ = _llama()
    heads = head_classes(space)
    assert len(heads) == 1  # one group: the head's chunk
    (gk, classes), = heads.items()
    node_of = space.groups[gk].space.class_node
    assert {m.graph.nodes[n].op.name for c in classes if (n := node_of.get(c)) is not None} <= {"OUTPUT", "SUM_REDUCE",
                                                                                              "INPUT"}
    g = Graph()
    x = g.input("x", (2, 64))
    g.output((x @ g.weight("w", np.ones((8, 64), np.float32)).transpose()).exp2(), "y")
    plain = SearchSpace.build(g)
    with pytest.raises(ValueError, match="no Gemm's value is a graph output"):
        head_kept(plain, pick(plain, W4.__contains__), HEAD)
