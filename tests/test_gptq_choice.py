"""GPTQ as a storage choice (issue 32): the calibration Hessians the FP64 pass collects, the "+gptq" store
variants the e-graph offers, and the error contract over them.

Truths used: X^T X of each Gemm's activation recomputed from the FP64 evaluator's node values (every node
kept, read through the Mul's own view), quant.gptq on that Hessian (its codes checked against the OBQ
reference in test_gptq.py), and the FP64 evaluation of the graph whose weights are replaced by the stored
GPTQ values (a program holding them computes that function up to FP32 rounding).
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.error.hessians import HessianCollector
from luminal_num.error.interval import Interval
from luminal_num.error.reference import references
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.hlir.graph import Graph
from luminal_num.models.llama import LLAMA_TINY, build_prefill, random_weights
from luminal_num.quant.calibration import CALIBRATION
from luminal_num.quant.gptq import gptq
from luminal_num.quant.stored import MissingCalibration, convert, widened
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.plan import Plan
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace
from bound_checks import assert_within_bounds, errors_of
from hessian_truth import independent_hessians

warnings.filterwarnings("ignore", category=RuntimeWarning)
CFG = LLAMA_TINY.with_layers(1)


@functools.lru_cache(maxsize=None)
def _llama(seq: int = 6):
    """A 1-layer Llama prefill, its calibrated space, two calibration batches, their references and Hessians."""
    m = build_prefill(CFG, random_weights(CFG, seed=0), seq=seq, max_cache=8)
    batches = tuple(m.make_inputs(np.random.default_rng(s).integers(0, CFG.vocab_size, seq), np.arange(seq))
                    for s in (1, 2))
    space = SearchSpace.build(m.graph, calibrated=True)
    collector = HessianCollector(m.graph)
    refs = references(m.graph, batches, space.part, collector)
    return m, space, batches, refs, collector.result()


def test_the_reference_pass_collects_each_weights_hessian_once_per_activation():
    m, space, batches, refs, hs = _llama()
    truth = independent_hessians(m.graph, batches)
    assert set(truth) == {n for n, w in m.graph.weights.items() if hs.of(w) is not None}
    for name, h in truth.items():
        got = hs.of(m.graph.weights[name])
        assert got.rows == 2 * 6
        np.testing.assert_allclose(got.sum_xx, h, rtol=1e-12, atol=1e-12 * np.abs(h).max())
    q, k, v = (hs.of(m.graph.weights[f"model.layers.0.self_attn.{p}_proj.weight"]) for p in "qkv")
    assert q is k is v  # Q, K and V read one activation: one K x K array
    assert len({id(h) for h in hs.by_weight.values()}) == 5  # qkv, o, gate/up, down, lm_head
    again = HessianCollector(m.graph)
    references(m.graph, batches, space.part, again)
    assert all(again.result().by_weight[key].sum_xx.tobytes() == h.sum_xx.tobytes() for key, h in hs.by_weight.items())


def _gptq_values(m, hs, choice: str) -> dict[str, np.ndarray]:
    """Every calibrated weight's GPTQ values, from quant.gptq directly on its collected Hessian."""
    return {n: gptq(w, hs.of(w).matrix, choice).dequantize() for n, w in m.graph.weights.items() if hs.of(w) is not None}


@pytest.mark.parametrize("choice", ["int4_g128", "int8_channel"])
def test_a_gptq_plan_computes_the_fp64_function_of_its_stored_weights(choice):
    m, space, batches, refs, hs = _llama()
    genome = pick(space, lambda t: t == f"store:{choice}+gptq")
    assert genome
    program = space.program(genome)
    filled = [k for k in program.kernels if k.fill is not None]
    assert filled and all(k.fill == "gptq" and k.storage == choice for k in filled)
    stored = _gptq_values(m, hs, choice)
    with CALIBRATION.installed(hs):
        for name, values in stored.items():
            assert np.array_equal(widened(m.graph.weights[name], choice, fill="gptq"), values)
        outs = [CpuRuntime(program, m.graph.weights).run(b).outputs["logits"] for b in batches]
        rtn = [CpuRuntime(space.program(pick(space, lambda t: t == f"store:{choice}")), m.graph.weights).run(b)
               .outputs["logits"] for b in batches]
    swapped = {**m.graph.weights, **stored}
    for b, out, ref, plain in zip(batches, outs, refs, rtn):
        exact = evaluate(Graph(m.graph.nodes, m.graph.inputs, m.graph.outputs, swapped), b)["logits"]
        np.testing.assert_allclose(out, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
        assert not np.array_equal(out, plain)  # another function of the weights than round-to-nearest's


def test_gptq_has_less_output_error_than_round_to_nearest_on_the_calibration_activations():
    """Per Gemm weight, ||X (W^ - W)^T||_F on the calibration activations against FP64, GPTQ vs RTN."""
    m, space, batches, refs, hs = _llama()
    for choice in ("int4_g128", "int8_channel", "mxfp4"):
        gq = _gptq_values(m, hs, choice)
        wins = 0
        for name, values in gq.items():
            w = np.asarray(m.graph.weights[name], dtype=np.float64)
            h = hs.of(m.graph.weights[name]).sum_xx
            err = lambda d: float(np.sum((d @ h) * d))  # noqa: E731  ||X d^T||^2 = tr(d H d^T)
            rtn = convert(m.graph.weights[name], choice).dequantize().astype(np.float64)
            wins += err(values - w) < err(rtn - w)
        assert wins == len(gq), (choice, wins, len(gq))


def test_filled_weights_need_their_hessian_outside_a_compile():
    m, space, batches, refs, hs = _llama()
    w = m.graph.weights["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(MissingCalibration, match="calibration Hessian"):
        widened(w, "int4_g128", fill="gptq")
    program = space.program(pick(space, lambda t: t == "store:int4_g128+gptq"))
    with pytest.raises(MissingCalibration):
        CpuRuntime(program, m.graph.weights).run(batches[0])


def test_a_gptq_plan_reloads_with_the_same_bytes_and_audits_from_its_weights_file(tmp_path):
    """plan.json records the choice, the weights file holds the GPTQ codes (the same bytes from the same
    inputs), and the plan re-lowers to the LLIR it stores and runs and audits with no Hessian installed."""
    from luminal_num.compiler import calibration_ranges
    from luminal_num.error.budget import Budget
    from luminal_num.error.judge import Judge
    from luminal_num.report.audit import audit
    from luminal_num.runtime.latency import modelled_latency
    m, space, batches, refs, hs = _llama()
    genome = pick(space, lambda t: t == "store:int4_g128+gptq")
    program = space.program(genome)
    budget = Budget.parse("atol=1,rtol=1")
    bind = m.graph.bind_symbols(batches[0])
    with CALIBRATION.installed(hs):
        verdict = Judge(m.graph, budget, list(batches)).confirm(program)
        assert verdict.passed, verdict.reason
        out = CpuRuntime(program, m.graph.weights).run(batches[0]).outputs["logits"]
        plans = [Plan.create(space, genome, program, budget, "h200", 0, verdict, modelled_latency(program, "h200", bind),
                             bind, {}, calibration_ranges(m.graph, space.part, refs), m.graph.weights) for _ in range(2)]
    assert plans[0].data["weights_sha256"] == plans[1].data["weights_sha256"]  # same inputs -> the same bytes
    listed = plans[0].data["stored_weights"]
    assert listed and all(r["fill"] == "gptq" and key.endswith("@int4_g128+gptq") for key, r in listed.items())
    assert any(t.endswith("+gptq") for _, _, t, *rest in plans[0].data["genome"])
    loaded = Plan.load(plans[0].save(tmp_path / "plan.json"))
    again, _ = loaded.program(m.graph)  # re-lowered from the recorded choices: the stored LLIR
    assert [k.fill for k in again.kernels] == [k.fill for k in program.kernels]
    rerun = CpuRuntime(again, m.graph.weights, loaded.scales, loaded.stored_weights).run(batches[0]).outputs["logits"]
    assert np.array_equal(out, rerun)  # no Hessian installed: the values come from the weights file
    assert audit(loaded, m.graph, list(batches)).passed


def test_the_static_bound_charges_a_filled_weight_its_own_stored_error():
    """The bound's input error of a GPTQ weight is |its GPTQ values - w| (larger than round-to-nearest's
    half step somewhere: GPTQ moves weights to cancel their neighbours' errors), not the format's RTN error."""
    from luminal_num.error.static import StaticAnalyzer
    m, space, batches, refs, hs = _llama()
    program = space.program(pick(space, lambda t: t == "store:int4_g128+gptq"))
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in batches[0].items()}
    ranges.update({n: Interval.point(np.asarray(w, dtype=np.float64)) for n, w in m.graph.weights.items()})
    an = StaticAnalyzer(program, m.graph.bind_symbols(batches[0]), m.graph.weights)
    filled = frozenset(k.id for k in program.kernels if k.fill is not None and not k.concat)
    with CALIBRATION.installed(hs):
        assert an.run(ranges, keep=filled).overflow is None
    gq = _gptq_values(m, hs, "int4_g128")
    beyond_rtn = 0
    for k in program.kernels:
        if k.fill is None or k.concat:
            continue
        w = np.asarray(m.graph.weights[k.external], dtype=np.float64)
        own = np.abs(gq[k.external] - w)
        assert np.all(an.vals[k.id].err >= own)
        rtn = np.abs(convert(m.graph.weights[k.external], "int4_g128").dequantize() - w)
        beyond_rtn += int(np.max(own) > np.max(rtn))
    assert beyond_rtn > 0
    with pytest.raises(MissingCalibration):
        StaticAnalyzer(program, m.graph.bind_symbols(batches[0])).run(ranges)  # no weights to fill from


@settings(deadline=None, max_examples=8, derandomize=True)
@given(seed=st.integers(0, 2 ** 32 - 1), changes=st.integers(1, 4))
def test_random_genomes_with_gptq_choices_are_soundly_bounded(seed, changes):
    """Genomes of 1-4 changes, at least one a GPTQ fill: measured error vs FP64 within the static bound
    (which reads the filled values: a round-to-nearest storage error would undercut GPTQ's)."""
    m, space, batches, refs, hs = _llama()
    rng = np.random.default_rng(seed)
    picks = space.all_changes()
    gptq_picks = [c for c in picks if c[2].endswith("+gptq")]
    chosen = {}
    first = gptq_picks[int(rng.integers(len(gptq_picks)))]
    chosen[first[:2]] = first
    for i in rng.choice(len(picks), changes - 1, replace=False):
        chosen.setdefault(picks[i][:2], picks[i])
    program = space.program(frozenset(chosen.values()))
    inputs = batches[int(rng.integers(2))]
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    with CALIBRATION.installed(hs):
        rep = static_bound(program, ranges, m.graph.bind_symbols(inputs), m.graph.weights)
        try:
            out = CpuRuntime(program, m.graph.weights).run(inputs).outputs
        except ValueError:  # a run the plan's policy refuses: a verdict, not a bound
            return
    if rep.overflow is not None:
        return
    ref = evaluate(m.graph, inputs)
    assert_within_bounds(rep.error_bounds, errors_of(out, ref), sorted(chosen.values()))


@pytest.mark.slow
def test_a_search_offered_gptq_judges_it_per_layer_against_round_to_nearest():
    """A compile of a 1-layer Llama with calibrated roundings offered (11 s): each Gemm weight's int4 g128
    store is judged alone both ways (its own class after round-to-nearest's); GPTQ's error is below
    round-to-nearest's on every layer judged both ways, and passes where round-to-nearest fails."""
    from luminal_num.compiler import compile
    from luminal_num.error.budget import Budget
    from luminal_num.models.registry import llama_tiny_job
    from luminal_num.search.front import share
    from luminal_num.search.search import SearchOptions
    from luminal_num.search.space import Offers
    job = llama_tiny_job(seq=8, layers=1)
    res = compile(job.graph, Budget.parse("atol=inf,rtol=inf,outputs=logits,rel_l2<=0.03"), "h200", job.calibration,
                  SearchOptions(max_candidates=300, progress=False, workers=1, offers=Offers(calibrated=True)), use_static=False)
    singles = {}
    for e in res.search.evaluated:
        if len(e.genome) == 1:
            ((site, cls, tag),) = e.genome
            singles[(site, cls, tag)] = e
    pairs = [(singles[(s, c, "store:int4_g128")], e) for (s, c, t), e in singles.items()
             if t == "store:int4_g128+gptq" and (s, c, "store:int4_g128") in singles]
    assert len(pairs) >= 6  # q/k/v, o, gate/up, down of the layer and the LM head
    assert all(share(gq) < share(rtn) for rtn, gq in pairs), [(share(r), share(g)) for r, g in pairs]
    assert any(gq.verdict.passed and not rtn.verdict.passed for rtn, gq in pairs)
    filled = sorted(t for _, _, t in res.search.chosen.genome if t.endswith("+gptq"))
    assert set(filled) <= {g[2] for g in res.plan.data["genome"]}  # the plan records what it chose, filled or not


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["int8_channel", "int4_g128"])
def test_minilm_with_gptq_weights_computes_the_fp64_function_of_them_closer_than_rtn(choice):
    """MiniLM (4 real sentences): every Gemm weight GPTQ-filled; the output is the FP64 function of the filled
    weights up to FP32 rounding, and nearer FP64 of the original weights than round-to-nearest's."""
    from luminal_num.models.registry import minilm_job
    job = minilm_job(batch=4)
    g, cal = job.graph, job.calibration[:1]
    space = SearchSpace.build(g, calibrated=True)
    collector = HessianCollector(g)
    refs = references(g, cal, space.part, collector)
    hs = collector.result()
    name = list(g.outputs)[0]
    with CALIBRATION.installed(hs):
        program = space.program(pick(space, lambda t: t == f"store:{choice}+gptq"))
        out = CpuRuntime(program, g.weights).run(cal[0]).outputs[name]
        rtn = CpuRuntime(space.program(pick(space, lambda t: t == f"store:{choice}")), g.weights).run(cal[0]).outputs[name]
    assert sum(k.fill == "gptq" for k in program.kernels) == 36  # 6 layers x (q, k, v, o, up, down)
    stored = {n: gptq(w, hs.of(w).matrix, choice).dequantize() for n, w in g.weights.items() if hs.of(w) is not None}
    exact = evaluate(Graph(g.nodes, g.inputs, g.outputs, {**g.weights, **stored}), cal[0])[name]
    np.testing.assert_allclose(out, exact, rtol=0, atol=1e-5)
    ref = refs[0].outputs(g)[name]
    assert np.linalg.norm(out - ref) < np.linalg.norm(rtn - ref)
