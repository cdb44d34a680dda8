"""The kernel vocabulary is declared once (codegen/kinds.py) and every stage derives from it; every
choice is made in the e-graph (QUANTIZE, in-place scatter) and `llir.verify` checks each lowering."""
import dataclasses
import json
import sys

import numpy as np
import pytest

from luminal_num.codegen import llir
from luminal_num.codegen.kinds import (DECL_OF_KIND, DECLS, LOWERED_KINDS, TENSOR_DECLS, Sort, assert_covers,
                                       backend_table)
from luminal_num.codegen.llir import KernelKind, ProgramError, verify
from luminal_num.codegen.serialize import LlirDataError, program_from_data, program_to_data
from luminal_num.compiler import compile
from luminal_num.dtypes.variants import GEMM_VARIANTS
from luminal_num.error.budget import Budget
from luminal_num.hlir import Graph, evaluate, index_input
from luminal_num.hlir.partition import partition
from luminal_num.models.testnets import mlp, transformer
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.latency import kernel_works
from luminal_num.search import egraph as E
from luminal_num.search.extract import extract, node_tag
from luminal_num.search.lower import _TENSOR, lower_program
from luminal_num.search.saturate import saturate_group
from luminal_num.search.search import SearchOptions
from luminal_num.search.space import SearchSpace

EVALUATE = sys.modules["luminal_num.hlir.evaluate"]


# -- the registry -----------------------------------------------------------------------------------
def test_every_kind_is_produced_by_exactly_one_declaration_or_is_external():
    assert LOWERED_KINDS == set(KernelKind)
    assert len(DECL_OF_KIND) == sum(1 for d in TENSOR_DECLS if d.kind is not None)


def test_egglog_constructors_are_generated_from_the_declarations():
    sample = {Sort.T: E.KExt(0, "f32"), Sort.F: E.Load(E.KExt(0, "f32"), 0), Sort.B: E.ConsumedBuffer(E.KExt(0, "f32")),
              Sort.I64: 3, Sort.STR: "bf16"}
    assert set(E.CTOR) == set(DECLS)
    for name, d in DECLS.items():
        args = [sample[p.sort] for p in d.params]
        by_name = E.CTOR[name](**{p.name: a for p, a in zip(d.params, args)})
        assert str(by_name) == str(E.CTOR[name](*args)) and str(by_name).startswith(name + "(")


def test_backend_tables_cover_every_kind():
    assert_covers(llir._FLOPS, KernelKind, "llir flops")
    assert_covers(llir._SHAPE_CHECK, KernelKind, "llir verify")
    assert set(_TENSOR) == {d.name for d in TENSOR_DECLS}
    with pytest.raises(AssertionError, match="missing kinds \\['gemm'\\]"):
        backend_table("toy", {k: 0 for k in KernelKind if k is not KernelKind.GEMM})


def test_named_access_reads_the_declared_position():
    space = saturate_group(mlp().graph, partition(mlp().graph).groups[0], precision_rules=None).space
    gemm = next(n for nodes in space.classes.values() for n in nodes if n.op == "KGemm")
    d = DECLS["KGemm"]
    assert gemm.arg("prec") == gemm.children[d.index("prec")] == "f32" and node_tag(gemm) == "f32"
    assert gemm.cls("a") == gemm.children[0].id
    with pytest.raises(KeyError, match="KGemm has no parameter 'nope'"):
        gemm.arg("nope")
    assert all(p.sort in (Sort.T, Sort.I64, Sort.STR) for p in d.params)


# -- QUANTIZE is an e-graph choice --------------------------------------------------------------------
def _dynamic_variant() -> str:
    return next(n for n, v in GEMM_VARIANTS.items() if v.a_scale is not None and not v.a_scale.static)


def test_dynamic_a_scale_variant_is_a_quantize_enode_and_lowering_only_translates():
    model = mlp()
    space = SearchSpace.build(model.graph)
    tag = "gemm:" + _dynamic_variant()
    change = next(c for c in space.all_changes() if c[2] == tag)
    gs = space.groups[change[0]].space
    chosen = [gs.classes[c][i] for c, i in space.candidates(frozenset([change]))[0].choices]
    gemm = next(n for n in chosen if n.op == "KGemm" and node_tag(n) == tag)
    q = next(n for n in gs.classes[gemm.cls("a")] if n.op == "KQuantize")
    assert q.arg("prec") == tag.split(":", 1)[1] and q.arg("dt") == GEMM_VARIANTS[q.arg("prec")].a_format.name
    prog = space.program(frozenset([change]))
    quant = [k for k in prog.kernels if k.kind is KernelKind.QUANTIZE]
    assert len(quant) == 1 and quant[0].label.endswith(f"quantize A: {q.arg('prec')})")
    inputs = model.make_inputs(0)
    out = CpuRuntime(prog, model.graph.weights).run(inputs).outputs["y"]
    ref = evaluate(model.graph, inputs)["y"]
    assert np.max(np.abs(out - ref)) <= 0.2 * np.max(np.abs(ref))  # an 8-bit Gemm, not a wrong function


def test_quantize_kernel_costs_its_two_reads_and_its_scales():
    space = SearchSpace.build(mlp().graph)
    change = next(c for c in space.all_changes() if c[2] == "gemm:" + _dynamic_variant())
    prog = space.program(frozenset([change]))
    q = next(k for k in prog.kernels if k.kind is KernelKind.QUANTIZE)
    b = {}
    src = prog.kernels[q.inputs[0].buffer]
    assert q.bytes_loaded(b, prog.dtypes()) == 2 * src.numel(b) * src.dtype.itemsize + q.scales_bytes(b)
    works = {w.name: w for w in kernel_works(prog, b)}
    assert works[f"k{q.id}:{q.label}"].flops == 2 * q.numel(b) + q.scales_bytes(b) // 4


# -- in-place legality over every chunk of a group ------------------------------------------------------
def _two_layer_cache_graph() -> Graph:
    """Two identical chunks writing their own cache; only layer 1's cache has another reader (later)."""
    g = Graph()
    src = g.input("src", (2, 4))
    pos = index_input(g, "pos", (2,))
    caches = [g.input(f"cache{i}", (8, 4)) for i in range(2)]
    for i, c in enumerate(caches):
        g.output(c.scatter(src, pos).sum(-1), f"y{i}")
        g.graph_break()
    g.output(caches[1].sum(0), "old")
    return g


def test_inplace_is_decided_for_the_whole_group_before_extraction():
    g = _two_layer_cache_graph()
    part = partition(g)
    group = next(gr for gr in part.groups if len(gr.chunks) == 2)  # the two scatter layers share a space
    spaces = {gr.key: saturate_group(g, gr) for gr in part.groups}
    ops = {n.op for nodes in spaces[group.key].space.classes.values() for n in nodes}
    assert "KScatterNoCopy" not in ops  # layer 1 may not overwrite its cache, so the group may not either
    choices = {c.index: extract(spaces[gr.key].space) for gr in part.groups for c in gr.chunks}
    prog = lower_program(g, part, spaces, choices)  # verify() ran inside: no illegal aliasing got through
    assert not any(k.kind is KernelKind.SCATTER_NOCOPY for k in prog.kernels)
    inputs = {"src": -np.ones((2, 4)), "pos": np.array([1, 6]), "cache0": np.arange(32.0).reshape(8, 4),
              "cache1": np.arange(32.0).reshape(8, 4) * 2}
    out, ref = CpuRuntime(prog).run(inputs).outputs, evaluate(g, inputs)
    for k in ref:
        np.testing.assert_array_equal(out[k], ref[k])


# -- the verifier ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lowered():
    space = SearchSpace.build(transformer(1).graph)
    return space.program(frozenset())


def _swap(prog, kid, **kw):
    ks = list(prog.kernels)
    ks[kid] = dataclasses.replace(ks[kid], **kw)
    return dataclasses.replace(prog, kernels=tuple(ks))


def test_verify_accepts_lowered_programs(lowered):
    assert verify(lowered) is lowered


def test_verify_rejects_a_read_before_write(lowered):
    k = next(k for k in lowered.kernels if k.inputs)
    bad = _swap(lowered, k.id, inputs=(dataclasses.replace(k.inputs[0], buffer=k.id + 1),) + k.inputs[1:])
    with pytest.raises(ProgramError, match="before it is written"):
        verify(bad)


def test_verify_rejects_wrong_shapes_and_aliasing(lowered):
    gemm = next(k for k in lowered.kernels if k.kind is KernelKind.GEMM)
    with pytest.raises(ProgramError, match="is not the layout's"):
        verify(_swap(lowered, gemm.id, shape=gemm.shape[:-1]))
    with pytest.raises(ProgramError, match="only in-place scatters alias"):
        verify(_swap(lowered, gemm.id, aliases=0))
    ew = next(k for k in lowered.kernels if k.kind is KernelKind.ELEMENTWISE)
    with pytest.raises(ProgramError, match="is not"):
        verify(_swap(lowered, ew.id, shape=(*ew.shape, 1)))


def test_verify_rejects_an_inplace_scatter_whose_destination_is_read_again():
    g = Graph()
    cache, src = g.input("cache", (8, 4)), g.input("src", (2, 4))
    pos = index_input(g, "pos", (2,))
    g.output(cache.scatter(src, pos).sum(-1), "y")
    space = SearchSpace.build(g)
    prog = space.program(frozenset())
    sc = next(k for k in prog.kernels if k.kind is KernelKind.SCATTER_NOCOPY)
    extra = dataclasses.replace(prog.kernels[-1], id=len(prog.kernels), inputs=(sc.inputs[0],) * len(prog.kernels[-1].inputs))
    bad = dataclasses.replace(prog, kernels=prog.kernels + (extra,))
    with pytest.raises(ProgramError, match="in place, but it has 2 readers"):
        verify(bad)


# -- one FP64 reference per calibration batch ------------------------------------------------------------
def test_compile_evaluates_the_fp64_reference_once_per_batch(monkeypatch):
    model = transformer(2)
    batches = [model.make_inputs(i) for i in range(2)]
    space = SearchSpace.build(model.graph)
    calls = []
    original = EVALUATE.evaluate_nodes

    def counted(*a, **kw):
        calls.append(1)
        return original(*a, **kw)
    for mod in list(sys.modules.values()):  # every module that imported it by name, and the module itself
        if getattr(mod, "__name__", "").startswith("luminal_num") and getattr(mod, "evaluate_nodes", None) is original:
            monkeypatch.setattr(mod, "evaluate_nodes", counted)
    res = compile(model.graph, Budget.parse("atol=1e-3,rtol=1e-3"), "h200", batches,
                  SearchOptions(seed=0, max_candidates=6, progress=False, headroom=0.5), space=space)
    assert len(calls) == len(batches)
    assert res.program is res.search.chosen.program  # the judged program is the plan's: no second lowering
    v = res.search.chosen.verdict
    assert v.share.user_allclose == pytest.approx(v.share.allclose * 0.5, rel=1e-12)  # tightened vs the user's budget
    assert res.plan.verdict.error == v.share.user_allclose and res.plan.headroom == 0.5


# -- LLIR serialization ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [mlp(), transformer(2, symbolic_seq=True)], ids=["mlp", "symbolic"])
def test_llir_round_trips_exactly_through_json(model):
    space = SearchSpace.build(model.graph)
    rng = np.random.default_rng(3)
    changes = space.all_changes()
    for _ in range(4):
        pick = rng.choice(len(changes), size=min(3, len(changes)), replace=False)
        genome = frozenset({(c[0], c[1]): c for c in (changes[i] for i in pick)}.values())
        prog = space.program(genome)
        back = program_from_data(json.loads(json.dumps(program_to_data(prog))))
        assert back == prog
    with pytest.raises(LlirDataError, match="this compiler reads 1"):
        program_from_data({**program_to_data(prog), "llir_format": 99})
