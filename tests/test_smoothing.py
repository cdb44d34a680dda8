"""Per-channel smoothing of a Gemm's K as a search choice (issue 32, SmoothQuant): x W^T = (x diag(s)^-1)(W diag(s))^T.

Truths used: FP64 numpy norms and products written here (the fold into an RMSNorm's and a LayerNorm's weight);
SmoothQuant's formula s_j = max|x_j|^a / max|W_j|^(1-a) computed here from the FP64 evaluator's node values;
the FP64 evaluation of the graph (hlir.evaluate) for whole programs; the unsmoothed program (the smoothed FP32
program multiplies by powers of two only, so it computes the same sums).
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.codegen.llir import Kernel, KernelKind, Program, verify
from luminal_num.codegen.serialize import program_from_data, program_to_data
from luminal_num.dtypes.formats import F32
from luminal_num.error.hessians import HessianCollector
from luminal_num.error.interval import Interval
from luminal_num.error.reference import references
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.hlir.evaluate import evaluate_nodes
from luminal_num.hlir.smoothing import Smoothing, smoothed_weight
from luminal_num.models.llama import LLAMA_TINY, build_prefill, random_weights
from luminal_num.quant.calibration import CALIBRATION, MissingStatistics, hessian_of
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.recipes import pick, smoothed_recipe
from luminal_num.search.space import SearchSpace
from bound_checks import assert_random_genome_bounded, assert_within_bounds, errors_of

warnings.filterwarnings("ignore", category=RuntimeWarning)
CFG = LLAMA_TINY.with_layers(1)
W4 = frozenset({"store:int4_g128", "gemm:bf16"})
W8A8 = frozenset({"store:f8e4m3_channel", "gemm:f8e4m3_channel_prologue"})


def _outlier_rows(rng, rows: int, k: int) -> np.ndarray:
    x = rng.standard_normal((rows, k))
    x[:, rng.choice(k, 3, replace=False)] *= 80.0  # a few outlier channels, as LLM activations have
    return x


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_the_rewrite_folded_into_a_norm_computes_the_same_function_in_fp64(norm):
    """norm(x) W^T with the norm's weight g (and bias b) = norm(x) with g / s (and b / s) times (W diag(s))^T,
    to 1e-12 relative, for any positive s (not only the powers of two the compiler uses)."""
    rng = np.random.default_rng(0 if norm == "rms" else 1)
    k = 96
    x, w = _outlier_rows(rng, 9, k), rng.standard_normal((3, 40, k))  # three Gemms reading one norm (Q/K/V)
    g, b = 1 + 0.3 * rng.standard_normal(k), 0.1 * rng.standard_normal(k)
    s = np.exp(rng.uniform(-3, 3, k))
    if norm == "rms":
        z = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        y, y_s = z * g, z * (g / s)
    else:
        c = x - x.mean(axis=-1, keepdims=True)
        z = c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + 1e-5)
        y, y_s = z * g + b, z * (g / s) + b / s
    for wi in w:
        exact = y @ wi.T
        assert np.linalg.norm(y_s @ (wi * s).T - exact) <= 1e-12 * np.linalg.norm(exact)


@functools.lru_cache(maxsize=None)
def _llama():
    """A 1-layer Llama prefill, its smoothable space (GPTQ offered too), two batches and their statistics."""
    m = build_prefill(CFG, random_weights(CFG, seed=0), seq=6, max_cache=8)
    batches = tuple(m.make_inputs(np.random.default_rng(s).integers(0, CFG.vocab_size, 6), np.arange(6))
                    for s in (1, 2))
    space = SearchSpace.build(m.graph, calibrated=True, smoothing=True)
    collector = HessianCollector(m.graph)
    references(m.graph, batches, space.part, collector)
    return m, space, batches, collector.result()


def _independent_exponents(m, batches, reader: str, group: tuple[str, ...]) -> np.ndarray:
    """round(log2 s) of SmoothQuant's s (a = 0.5) for the Gemms `group`, whose activation is the A operand of
    the Gemm named by `reader`'s weight, its channel max taken over both batches' FP64 node values here."""
    graph = m.graph
    node = next(n for n in graph.nodes if n.op.name == "MUL" and any(
        graph.weight_name(s.node) == reader for s in n.srcs))
    act = next(s for s in node.srcs if graph.weight_name(s.node) != reader)
    amax = 0
    for batch in batches:
        x = np.asarray(evaluate_nodes(graph, batch)[act.node], dtype=np.float64)
        amax = np.maximum(amax, np.abs(x.reshape(-1, x.shape[-1])).max(axis=0))
    wmax = np.max([np.abs(np.asarray(graph.weights[n], dtype=np.float64)).max(axis=0) for n in group], axis=0)
    return np.rint(np.log2(np.sqrt(amax) / np.sqrt(wmax)))


def test_every_weight_gemm_gets_a_smoothing_whose_exponents_are_smoothquants():
    """Each weight Gemm's knob offers smooth:sq50; Q/K/V and gate/up share one scale vector (one group), and the
    lowered exponents are round(log2(max|x_j|^0.5 / max|W_j|^0.5)) over the group's weights, computed here."""
    m, space, batches, hs = _llama()
    with CALIBRATION.installed(hs):
        program = space.program(smoothed_recipe(space, frozenset()))
    smoothed = [k for k in program.kernels if k.smoothing is not None]
    weights = {k.smoothing.source: k.smoothing for k in smoothed if k.smoothing.source is not None}
    assert set(weights) == {n for n in m.graph.weights if n.endswith("proj.weight")} | {"lm_head.weight"}
    vectors = [k.smoothing for k in smoothed if k.smoothing.source is None]
    assert len(vectors) == 5  # qkv, o, gate/up, down, lm_head: one scaled activation each
    qkv = tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    assert set(weights[qkv[0]].group) == set(qkv) and weights[qkv[0]].exponents == weights[qkv[2]].exponents
    gate_up = tuple(f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up"))
    for group in (qkv, gate_up, ("model.layers.0.mlp.down_proj.weight",), ("lm_head.weight",)):
        want = _independent_exponents(m, batches, group[0], group)
        assert np.array_equal(np.asarray(weights[group[0]].exponents), want), group


def test_awq_exponents_minimize_the_output_error_over_the_grid_on_the_activations_themselves():
    """AWQ's choice for gate/up (one activation, two weights) is, among the grid's power-of-two scales
    (s = rms^a / sqrt(max * min), rms and the errors computed here from the FP64 activation rows, not from
    the Hessian), the one with the least sum ||X (Q(W 2^e) 2^-e - W)^T||^2, Q int4 g128 round-to-nearest; no
    worse than not smoothing (a = 0)."""
    from luminal_num.quant.storage import storage_format
    m, space, batches, hs = _llama()
    group = tuple(f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up"))
    with CALIBRATION.installed(hs):
        program = space.program(smoothed_recipe(space, frozenset(), "awq_int4_g128"))
    chosen = next(k.smoothing for k in program.kernels if k.smoothing is not None and k.smoothing.source == group[0])
    assert chosen.group == group
    graph = m.graph
    node = next(n for n in graph.nodes if n.op.name == "MUL" and any(graph.weight_name(s.node) == group[0]
                                                                     for s in n.srcs))
    act = next(s for s in node.srcs if graph.weight_name(s.node) != group[0])
    x = np.concatenate([np.asarray(evaluate_nodes(graph, b)[act.node], dtype=np.float64).reshape(-1, 64)
                        for b in batches])
    rms = np.sqrt(np.mean(x * x, axis=0))
    fmt = storage_format("int4_g128")

    def error(e):
        total = 0.0
        for name in group:
            w = np.asarray(graph.weights[name], dtype=np.float32)
            back = fmt.quantize(w * 2.0 ** e).dequantize().astype(np.float64) * 2.0 ** -e
            total += np.sum((x @ (back - w).T) ** 2)
        return total
    grid = []
    for a in np.arange(21) / 20:
        s = rms ** a
        s = s / np.sqrt(s.max() * s.min())
        grid.append(np.clip(np.rint(np.log2(s)), -16, 16))
    errors = [error(e) for e in grid]
    got = error(np.asarray(chosen.exponents, dtype=np.float64))
    assert got <= min(errors) * (1 + 1e-9) and got <= errors[0] * (1 + 1e-9)
    assert any(np.array_equal(np.asarray(chosen.exponents), e) for e in grid)


def test_a_smoothed_fp32_program_computes_the_unsmoothed_sums_within_its_static_bound():
    """Scaling by powers of two is exact: the smoothed FP32 program (its 2^-e multiply fused into the norm's
    row kernel) gives the unsmoothed program's logits, within its static bound of the FP64 function."""
    m, space, batches, hs = _llama()
    with CALIBRATION.installed(hs):
        program = space.program(smoothed_recipe(space, frozenset()))
    plain = space.program(frozenset())
    rows = [k for k in program.kernels if k.kind is KernelKind.ROWS]
    scale_ids = {k.id for k in program.kernels if k.smoothing is not None and k.smoothing.source is None}
    assert any(i.buffer in scale_ids for k in rows for i in k.inputs)  # folded into a norm's kernel
    for batch in batches:
        ref = evaluate(m.graph, batch)["logits"]
        out = CpuRuntime(program, m.graph.weights).run(batch).outputs["logits"]
        base = CpuRuntime(plain, m.graph.weights).run(batch).outputs["logits"]
        np.testing.assert_allclose(out, base, rtol=0, atol=1e-6 * np.abs(ref).max())
        ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in batch.items()}
        rep = static_bound(program, ranges, m.graph.bind_symbols(batch), m.graph.weights)
        assert np.all(np.abs(out - ref) <= rep.error_bounds["logits"])


def test_the_smoothed_weight_is_exact_and_its_storage_error_is_charged():
    from luminal_num.error.static import StaticAnalyzer
    from luminal_num.quant.stored import widened
    m, space, batches, hs = _llama()
    with CALIBRATION.installed(hs):
        program = space.program(smoothed_recipe(space, W4))
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in batches[0].items()}
    an = StaticAnalyzer(program, m.graph.bind_symbols(batches[0]), m.graph.weights)
    kept = frozenset(k.id for k in program.kernels if k.smoothing is not None)
    assert an.run(ranges, keep=kept).overflow is None
    checked = 0
    for k in program.kernels:
        if k.smoothing is None or k.smoothing.source is None:
            continue
        w = np.asarray(m.graph.weights[k.smoothing.source], dtype=np.float64)
        exact = w * 2.0 ** np.asarray(k.smoothing.exponents, dtype=np.float64)
        value = smoothed_weight(m.graph.weights[k.smoothing.source], k.smoothing.exponents)
        assert np.array_equal(np.asarray(value, dtype=np.float64), exact)  # powers of two: exact in FP32
        stored = widened(value, k.storage) if k.storage else exact
        assert np.all(an.vals[k.id].err >= np.abs(stored - exact) * (1 - 1e-12))
        checked += 1
    assert checked == 8


def test_gptq_of_a_smoothed_weight_uses_the_smoothed_hessian():
    """The smoothed weight meets x diag(2^-e): its Hessian is diag(2^-e) (sum x x^T) diag(2^-e)."""
    m, space, batches, hs = _llama()
    w = m.graph.weights["model.layers.0.mlp.down_proj.weight"]
    e = np.random.default_rng(3).integers(-4, 5, w.shape[1])
    with CALIBRATION.installed(hs):
        source, smoothed = hessian_of(w), hessian_of(smoothed_weight(w, e))
    d = np.diag(2.0 ** -e)
    assert np.array_equal(smoothed.sum_xx, d @ source.sum_xx @ d) and smoothed.rows == source.rows
    with CALIBRATION.installed(hs):
        program = space.program(smoothed_recipe(space, frozenset({"store:int4_g128+gptq", "gemm:bf16"})))
        out = CpuRuntime(program, m.graph.weights).run(batches[0]).outputs["logits"]
    assert any(k.smoothing is not None and k.fill == "gptq" for k in program.kernels)
    assert np.all(np.isfinite(out))


def test_lowering_a_smoothing_without_its_statistics_is_refused_in_one_line():
    m, space, _, _ = _llama()
    with pytest.raises(MissingStatistics, match="calibration statistics"):
        space.program(smoothed_recipe(space, frozenset()))


@pytest.mark.parametrize("tags", [W4, W8A8], ids=["w4a16", "fp8_w8a8"])
def test_a_smoothed_plan_round_trips_its_llir_and_weights_file_and_audits(tmp_path, tags):
    """The exponents travel in the LLIR: the saved plan reloads, runs the same bytes and audits with no
    calibration installed."""
    from luminal_num.compiler import calibration_ranges
    from luminal_num.error.budget import Budget
    from luminal_num.error.judge import Judge
    from luminal_num.report.audit import audit
    from luminal_num.runtime.latency import modelled_latency
    from luminal_num.search.plan import Plan
    m, space, batches, hs = _llama()
    genome = smoothed_recipe(space, tags)
    budget = Budget.parse("atol=10,rtol=1")
    bind = m.graph.bind_symbols(batches[0])
    with CALIBRATION.installed(hs):
        program = space.program(genome)
        assert program_from_data(program_to_data(program)).kernels == program.kernels
        refs = references(m.graph, batches, space.part)
        verdict = Judge(m.graph, budget, list(batches)).confirm(program)
        assert verdict.passed, verdict.reason
        plan = Plan.create(space, genome, program, budget, "h200", 0, verdict,
                           modelled_latency(program, "h200", bind), bind, {},
                           calibration_ranges(m.graph, space.part, refs), m.graph.weights)
    fmt = next(t for t in tags if t.startswith("store:")).removeprefix("store:")
    assert any(key.startswith("smooth_sq50(") and key.endswith(f"@{fmt}") for key in plan.data["stored_weights"])
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    again, _ = loaded.program(m.graph)
    out = CpuRuntime(program, m.graph.weights).run(batches[0]).outputs["logits"]
    rerun = CpuRuntime(again, m.graph.weights, loaded.scales, loaded.stored_weights).run(batches[0]).outputs["logits"]
    assert np.array_equal(out, rerun)
    assert audit(loaded, m.graph, list(batches)).passed


def test_the_llir_verifier_refuses_a_smoothing_it_cannot_hold():
    sm = Smoothing("sq50", ("w",), (0, 1, 2), "w")
    bad = Kernel(id=0, kind=KernelKind.EXTERNAL, inputs=(), shape=(4, 5), dtype=F32, external=sm.name, smoothing=sm)
    with pytest.raises(ValueError, match="smoothing"):
        verify(Program(kernels=(bad,), inputs=(), outputs=(("y", 0),)))
    with pytest.raises(ValueError, match="exponents"):
        Smoothing("sq50", ("w",), (40,), "w")


def test_a_layernorm_transformer_smooths_through_its_norms():
    """LayerNorm (weight and bias) producers: the 2^-e multiply joins the norm's kernel, and the FP32 smoothed
    program computes the graph's function within its static bound."""
    from luminal_num.models.bert import BertConfig, build_bert
    from test_bert import encoded_batch, random_weights as bert_weights, tiny_config
    config = tiny_config(1, heads=2)
    model = build_bert(BertConfig.from_dict(config), bert_weights(config, np.random.default_rng(0)), 2, 5)
    g, batch = model.graph, model.make_inputs(encoded_batch([[5, 6, 7, 8, 9], [3, 4, 2]]))
    space = SearchSpace.build(g, smoothing=True)
    collector = HessianCollector(g)
    references(g, [batch], space.part, collector)
    with CALIBRATION.installed(collector.result()):
        program = space.program(smoothed_recipe(space, frozenset()))
    assert sum(1 for k in program.kernels if k.smoothing is not None and k.smoothing.source is not None) >= 4
    scale_ids = {k.id for k in program.kernels if k.smoothing is not None and k.smoothing.source is None}
    assert any(i.buffer in scale_ids for k in program.kernels if k.kind is KernelKind.ROWS for i in k.inputs)
    ref = evaluate(g, batch)
    out = CpuRuntime(program, g.weights).run(batch).outputs
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in batch.items()}
    rep = static_bound(program, ranges, g.bind_symbols(batch), g.weights)
    assert_within_bounds(rep.error_bounds, errors_of(out, ref))


@settings(deadline=None, max_examples=10, derandomize=True)
@given(seed=st.integers(0, 2 ** 32 - 1), scale=st.sampled_from([1.0, 300.0]))
def test_random_genomes_with_smoothing_are_soundly_bounded(seed, scale):
    """A random alternative for every e-class of the smoothed space (smoothings, the smoothed Gemms' variants,
    the smoothed weights' formats and GPTQ fills, fusions) per chunk: measured error <= static bound."""
    _, space, batches, hs = _llama()
    w = random_weights(CFG, seed=0)
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * scale
    m = build_prefill(CFG, w, seq=6, max_cache=8)
    # statistics of the unscaled model (the Gemm weights are its): any s is exact
    assert_random_genome_bounded(m.graph, space, batches[seed % 2], hs, seed)


def test_a_compile_offered_smoothing_judges_each_storage_recipe_smoothed():
    """compile with Offers(smoothing=True): the reference stage collects the statistics, the search's uniform
    stage starts from every storage recipe smoothed (SmoothQuant; AWQ for int4 g128), judged like any other."""
    from luminal_num.compiler import compile
    from luminal_num.error.budget import Budget
    from luminal_num.models.registry import llama_tiny_job
    from luminal_num.search.search import SearchOptions
    from luminal_num.search.space import Offers
    job = llama_tiny_job(seq=8, layers=1)
    res = compile(job.graph, Budget.parse("atol=inf,rtol=inf,outputs=logits,rel_l2<=0.03"), "h200", job.calibration,
                  SearchOptions(max_candidates=30, progress=False, workers=1, offers=Offers(smoothing=True)))
    smoothed = {e.label: e for e in res.search.evaluated if any(t.startswith("smooth:") for _, _, t in e.genome)}
    assert {"W4A16 INT4 group 128 + SmoothQuant smoothing", "W4A16 INT4 group 128 + AWQ smoothing",
            "W8A16 INT8 per-channel + SmoothQuant smoothing"} <= set(smoothed)
    assert all(e.verdict.reason for e in smoothed.values())
    assert smoothed["W8A16 INT8 per-channel + SmoothQuant smoothing"].verdict.passed


from test_cuda_dequant import fake  # noqa: E402,F401  (the executing CUDA stand-in, a fixture)
from test_cuda_codegen import needs_nvrtc  # noqa: E402


@needs_nvrtc
def test_a_smoothed_int4_gemm_runs_on_the_executing_cuda_stand_in(fake):  # noqa: F811
    """The CUDA backend uploads the 2^-e vector and the smoothed weight's stored bytes as the CPU backend reads
    them and runs the scaling and the Gemm: the CPU backend's output up to FP32 sums in another order."""
    from luminal_num.hlir.graph import Graph
    from luminal_num.runtime.cuda import CudaRuntime
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((20, 256)) / 16).astype(np.float32)
    g = Graph()
    x = g.input("x", (2, 256))
    g.output(x @ g.weight("w", w).transpose(), "y")
    inputs = {"x": _outlier_rows(rng, 2, 256).astype(np.float32)}
    space = SearchSpace.build(g, smoothing=True)
    collector = HessianCollector(g)
    references(g, [inputs], space.part, collector)
    with CALIBRATION.installed(collector.result()):
        program = space.program(smoothed_recipe(space, frozenset({"store:int4_g128"})))
    assert sum(1 for k in program.kernels if k.smoothing is not None) == 2
    got = CudaRuntime(program, g.weights).run(inputs).outputs["y"]
    want = CpuRuntime(program, g.weights).run(inputs).outputs["y"]
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -22 * 256 * 2 * np.abs(want).max())


from test_llm_positions import tiny  # noqa: E402,F401  (the tiny Llama GGUF and its prompts, a fixture)


@pytest.mark.slow
def test_cli_compile_smooth_gptq_on_positions_judges_the_smoothed_recipes(tiny):  # noqa: F811
    """`compile --smooth --gptq` on an LLM decode workload end to end: statistics from its teacher-forced
    positions, the SmoothQuant and AWQ recipes judged and listed in pareto.csv, the plan saved (~15 s)."""
    import pandas as pd
    from luminal_num.cli import EXIT_OK, main
    root, model = tiny
    out = root / "smooth_plan"
    assert main(["compile", "--model", str(model), "--workload", "decode:2@16", "--candidates", "30", "--quiet",
                 "--calibration", str(root / "mine.txt"), "--positions", "40", "--smooth", "--gptq",
                 "--budget", "atol=inf,rtol=inf,outputs=logits,kl<=10", "--out", str(out)]) == EXIT_OK
    rows = pd.read_csv(out / "pareto.csv")
    smoothed = rows[rows["variants"].str.contains("smooth:")]
    assert {"gemm:bf16 smooth:awq_int4_g128 store:int4_g128",
            "gemm:f8e4m3_channel_prologue smooth:sq50 store:f8e4m3_channel"} <= set(smoothed["variants"])
    assert smoothed["passes"].all()  # kl <= 10: every exact rewrite with any format passes
    assert (out / "plan.json").is_file()
