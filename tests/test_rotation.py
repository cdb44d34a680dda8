"""Hadamard rotation of a Gemm's K as a search choice (issue 32): x W^T = (x H)(W H)^T.

Truths used: scipy.linalg.hadamard (Sylvester's +-1 matrix, an independent construction) normalized by
1/sqrt(b); FP64 numpy products written here; the FP64 evaluation of the graph (hlir.evaluate) for whole
programs; the FP32 dot-product envelope gamma_b(u32) |x| |H| for the online rotation kernel (not its bits:
the BLAS kernel picks the summation order).
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import scipy.linalg
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.codegen.llir import Kernel, KernelKind, verify
from luminal_num.codegen.serialize import program_from_data, program_to_data
from luminal_num.dtypes.formats import F32
from luminal_num.error.interval import Interval
from luminal_num.error.reference import references
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.hlir.rotation import ROTATION_BLOCKS, Rotation, rotate_rows, rotated_weight, rotation_block
from luminal_num.models.llama import LLAMA_TINY, build_prefill, random_weights
from luminal_num.quant.calibration import CALIBRATION, hessian_of
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.recipes import pick, rotated_recipe
from luminal_num.search.space import SearchSpace
from tiny_llama import llama_with_hessians
from bound_checks import assert_random_genome_bounded

warnings.filterwarnings("ignore", category=RuntimeWarning)
CFG = LLAMA_TINY.with_layers(1)
U32 = 2.0 ** -24
W4 = frozenset({"store:int4_g128", "gemm:bf16"})


def _blockdiag_h(k: int, b: int) -> np.ndarray:
    """The independent H: K/b copies of scipy's Sylvester matrix / sqrt(b) on the diagonal."""
    return scipy.linalg.block_diag(*[scipy.linalg.hadamard(b) / np.sqrt(b)] * (k // b))


def _outlier_rows(rng, rows: int, k: int) -> np.ndarray:
    x = rng.standard_normal((rows, k))
    x[:, rng.choice(k, 3, replace=False)] *= 80.0  # a few outlier channels, as LLM activations have
    return x


@pytest.mark.parametrize("b", ROTATION_BLOCKS)
def test_hadamard_blocks_are_scipys_normalized_and_exact_in_fp32(b):
    from luminal_num.hlir.rotation import hadamard
    h = hadamard(b)
    assert np.array_equal(h, scipy.linalg.hadamard(b) / np.sqrt(b))
    assert np.array_equal(h.astype(np.float32).astype(np.float64), h)  # 1/sqrt(b) is a power of 2
    np.testing.assert_allclose(h @ h.T, np.eye(b), atol=1e-15)


@pytest.mark.parametrize("k", [576, 1536, 64, 320])
def test_the_rewrite_computes_the_same_function_in_fp64(k):
    """x W^T = (x H)(W H)^T to 1e-12 relative (SmolLM2's K = 576 and 1536 among them); rotate_rows is the
    product with the independent block-diagonal H."""
    rng = np.random.default_rng(k)
    x, w = _outlier_rows(rng, 7, k), rng.standard_normal((11, k))
    b = rotation_block(k)
    assert b == {576: 64, 1536: 256, 64: 64, 320: 64}[k]
    h = _blockdiag_h(k, b)
    np.testing.assert_allclose(rotate_rows(x, b), x @ h, rtol=0, atol=1e-13 * np.abs(x).max())
    exact = x @ w.T
    rotated = rotate_rows(x, b) @ rotate_rows(w, b).T
    assert np.linalg.norm(rotated - exact) <= 1e-12 * np.linalg.norm(exact)
    # what rotation is for: the outlier channels are spread, the largest |x H| is far below the largest |x|
    assert np.abs(rotate_rows(x, b)).max() < 0.5 * np.abs(x).max()


def test_blocks_that_divide_no_k_are_not_offered():
    assert rotation_block(100) is None and rotation_block(48) is None and rotation_block("seq") is None
    with pytest.raises(ValueError, match="offered blocks"):
        Rotation(32, "w")


def _llama(seq: int = 6):
    return llama_with_hessians(CFG, seq)


def test_every_weight_gemm_gets_a_rotation_knob_and_the_rotated_weight_every_format():
    m, space, _, _ = _llama()
    tags = {t for ks in space.knobs.values() for k in ks for t in k.tags}
    assert "rot:hadamard64" in tags
    program = space.program(rotated_recipe(space, W4))
    rotated = [k for k in program.kernels if k.rotation is not None and k.rotation.source is not None]
    weights = {n for n in m.graph.weights if np.ndim(m.graph.weights[n]) == 2} - {"model.embed_tokens.weight"}  # gathered
    assert {k.rotation.source for k in rotated} == weights  # q k v o gate up down and the head
    assert all(k.storage == "int4_g128" and k.external == k.rotation.name for k in rotated)
    # Q, K and V read one activation: one online rotation serves the three
    online = [k for k in program.kernels if k.kind.is_gemm and program.kernel(k.inputs[1].buffer).rotation is not None
              and program.kernel(k.inputs[1].buffer).rotation.source is None]
    assert len(online) == 5  # qkv, o, gate/up, down, head
    assert all("Hadamard rotation" in k.label for k in online)  # op tables say what the extra Gemm is
    plain = space.program(pick(space, W4.__contains__))
    assert not any(k.rotation for k in plain.kernels)  # the knob left at BASE: nothing rotated


def test_the_online_rotation_kernel_against_fp64_numpy():
    """Each online rotation Gemm's FP32 output, exposed as a program output, is x H within the FP32 dot
    product envelope gamma_b(u32) |x| |H| of the independent FP64 product (x: the FP32 values it read)."""
    m, space, batches, _ = _llama()
    program = space.program(rotated_recipe(space, frozenset()))  # every Gemm rotated, everything FP32
    online = [k for k in program.kernels if k.kind.is_gemm and program.kernel(k.inputs[1].buffer).rotation is not None
              and program.kernel(k.inputs[1].buffer).rotation.source is None]
    assert online
    exposed = dataclasses.replace(program, outputs=program.outputs + tuple(
        item for k in online for item in ((f"xh{k.id}", k.id), (f"x{k.id}", k.inputs[0].buffer))))
    out = CpuRuntime(exposed, m.graph.weights).run(batches[0]).outputs
    for k in online:
        b = program.kernel(k.inputs[1].buffer).rotation.block
        full = k.inputs[0].view.realize(out[f"x{k.id}"], m.graph.bind_symbols(batches[0]))  # (M.., K/b, b, b)
        x = full[..., 0, :].reshape(-1, full.shape[-3] * b)  # (rows, K): the activation as the kernel read it
        got = out[f"xh{k.id}"].reshape(x.shape)
        h = _blockdiag_h(x.shape[-1], b)
        gamma = b * U32 / (1 - b * U32)
        assert np.all(np.abs(got - x @ h) <= gamma * (np.abs(x) @ np.abs(h)) + 1e-30), k.label


def test_a_rotated_fp32_program_computes_the_graphs_function_within_its_static_bound():
    m, space, batches, _ = _llama()
    program = space.program(rotated_recipe(space, frozenset()))
    for batch in batches:
        ref = evaluate(m.graph, batch)["logits"]
        out = CpuRuntime(program, m.graph.weights).run(batch).outputs["logits"]
        ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in batch.items()}
        rep = static_bound(program, ranges, m.graph.bind_symbols(batch), m.graph.weights)
        assert np.all(np.abs(out - ref) <= rep.error_bounds["logits"])
        assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()  # FP32-level: the rotation is exact


def test_rotated_weights_are_w_times_h_and_their_storage_error_is_charged():
    """The derived EXTERNAL's value is the independent W H; in a storage format the static bound's input error
    is at least |stored - W H| (the bound is taken against the FP64 rotation, not the format's nominal step)."""
    from luminal_num.error.static import StaticAnalyzer
    from luminal_num.quant.stored import widened
    m, space, batches, _ = _llama()
    program = space.program(rotated_recipe(space, W4))
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in batches[0].items()}
    ranges.update({n: Interval.point(np.asarray(w, dtype=np.float64)) for n, w in m.graph.weights.items()})
    an = StaticAnalyzer(program, m.graph.bind_symbols(batches[0]), m.graph.weights)
    rotated = frozenset(k.id for k in program.kernels if k.rotation is not None)
    assert an.run(ranges, keep=rotated).overflow is None  # their bounds kept past their last reader
    for k in program.kernels:
        if k.rotation is None or k.rotation.source is None:
            continue
        w = np.asarray(m.graph.weights[k.rotation.source], dtype=np.float64)
        exact = w @ _blockdiag_h(w.shape[1], k.rotation.block)
        stored = widened(rotated_weight(m.graph.weights[k.rotation.source], k.rotation.block), k.storage)
        assert np.all(an.vals[k.id].err >= np.abs(stored - exact) * (1 - 1e-12))


def test_gptq_of_a_rotated_weight_uses_the_rotated_hessian():
    """The rotated weight meets x H: its Hessian is H^T (sum x x^T) H, computed from its source's."""
    m, space, batches, hs = _llama()
    name = "model.layers.0.mlp.down_proj.weight"
    w = m.graph.weights[name]
    b = rotation_block(w.shape[1])
    with CALIBRATION.installed(hs):
        source, rotated = hessian_of(w), hessian_of(rotated_weight(w, b))
    h = _blockdiag_h(w.shape[1], b)
    np.testing.assert_allclose(rotated.sum_xx, h.T @ source.sum_xx @ h, rtol=0, atol=1e-12 * np.abs(source.sum_xx).max())
    assert rotated.rows == source.rows
    genome = rotated_recipe(space, frozenset({"store:int4_g128+gptq", "gemm:bf16"}))
    with CALIBRATION.installed(hs):
        program = space.program(genome)
        out = CpuRuntime(program, m.graph.weights).run(batches[0]).outputs["logits"]
    assert any(k.rotation is not None and k.fill == "gptq" for k in program.kernels)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("tags", [W4, frozenset({"store:f8e4m3_channel", "gemm:f8e4m3_channel_prologue"})],
                         ids=["w4a16", "fp8_w8a8"])
def test_a_rotated_plan_round_trips_its_llir_and_weights_file(tmp_path, tags):
    from luminal_num.compiler import calibration_ranges
    from luminal_num.error.budget import Budget
    from luminal_num.error.judge import Judge
    from luminal_num.runtime.latency import modelled_latency
    from luminal_num.search.plan import Plan
    m, space, batches, hs = _llama()
    genome = rotated_recipe(space, tags)
    program = space.program(genome)
    assert program_from_data(program_to_data(program)).kernels == program.kernels
    budget = Budget.parse("atol=10,rtol=1")
    bind = m.graph.bind_symbols(batches[0])
    refs = references(m.graph, batches, space.part)
    verdict = Judge(m.graph, budget, list(batches)).confirm(program)
    assert verdict.passed, verdict.reason
    plan = Plan.create(space, genome, program, budget, "h200", 0, verdict, modelled_latency(program, "h200", bind),
                       bind, {}, calibration_ranges(m.graph, space.part, refs), m.graph.weights)
    listed = plan.data["stored_weights"]
    fmt = next(t for t in tags if t.startswith("store:")).removeprefix("store:")
    assert any(key.startswith("hadamard64(") and key.endswith(f"@{fmt}") for key in listed)
    if "gemm:f8e4m3_channel_prologue" in tags:  # static weight scales of the rotated weights, kept with the plan
        assert plan.scales
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    again, _ = loaded.program(m.graph)
    out = CpuRuntime(program, m.graph.weights).run(batches[0]).outputs["logits"]
    rerun = CpuRuntime(again, m.graph.weights, loaded.scales, loaded.stored_weights).run(batches[0]).outputs["logits"]
    assert np.array_equal(out, rerun)
    from luminal_num.report.audit import audit
    assert audit(loaded, m.graph, list(batches)).passed  # re-judged from the plan file, its weights file and the model


def test_the_llir_verifier_refuses_a_rotation_it_cannot_hold():
    bad = Kernel(id=0, kind=KernelKind.EXTERNAL, inputs=(), shape=(4, 48), dtype=F32, external="hadamard64(w)",
                 rotation=Rotation(64, "w"))
    with pytest.raises(ValueError, match="rotation"):
        verify(_one_kernel_program(bad))


def _one_kernel_program(k: Kernel):
    from luminal_num.codegen.llir import Program
    return Program(kernels=(k,), inputs=(), outputs=(("y", 0),))


@settings(deadline=None, max_examples=10, derandomize=True)
@given(seed=st.integers(0, 2 ** 32 - 1), scale=st.sampled_from([1.0, 300.0]))
def test_random_genomes_with_rotations_are_soundly_bounded(seed, scale):
    """A random alternative for every e-class of the rotated space (rotations, the rotated Gemms' variants,
    the rotated weights' formats and fills, fusions) per chunk: measured error <= static bound."""
    _, space, batches, hs = _llama()
    w = random_weights(CFG, seed=0)
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * scale
    m = build_prefill(CFG, w, seq=6, max_cache=8)
    # Hessians of the unscaled weights: a fill is any rounding, still bounded
    assert_random_genome_bounded(m.graph, space, batches[seed % 2], hs, seed)


def _rotated_linear():
    from luminal_num.hlir.graph import Graph
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((20, 256)) / 16).astype(np.float32)
    g = Graph()
    x = g.input("x", (2, 256))
    g.output(x @ g.weight("w", w).transpose(), "y")
    space = SearchSpace.build(g, rotation=True)
    program = space.program(rotated_recipe(space, frozenset({"store:int4_g128"})))
    assert [k.rotation.block for k in program.kernels if k.rotation is not None] == [256, 256]
    return g, program, {"x": _outlier_rows(rng, 2, 256).astype(np.float32)}


from test_cuda_dequant import fake  # noqa: E402,F401  (the executing CUDA stand-in, a fixture)
from test_cuda_codegen import needs_nvrtc  # noqa: E402


@needs_nvrtc
def test_a_rotated_int4_gemm_runs_on_the_executing_cuda_stand_in(fake):  # noqa: F811
    """The CUDA backend uploads H_b and the rotated weight's stored bytes as the CPU backend reads them and runs
    both Gemms: the CPU backend's output up to FP32 sums in another order."""
    from luminal_num.runtime.cuda import CudaRuntime
    g, program, inputs = _rotated_linear()
    got = CudaRuntime(program, g.weights).run(inputs).outputs["y"]
    want = CpuRuntime(program, g.weights).run(inputs).outputs["y"]
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -22 * 256 * 2 * np.abs(want).max())
    assert np.abs(want - evaluate(g, inputs)["y"]).max() > 0  # int4: not the FP32 function, a rounded one


def test_a_compile_offered_rotations_judges_each_storage_recipe_rotated():
    """compile with Offers(rotation=True): the search's uniform stage starts from every storage recipe with its
    Gemms rotated; those candidates are judged like any other (chunk verdicts, pruning)."""
    from luminal_num.compiler import compile
    from luminal_num.error.budget import Budget
    from luminal_num.models.registry import llama_tiny_job
    from luminal_num.search.search import SearchOptions
    from luminal_num.search.space import Offers
    job = llama_tiny_job(seq=8, layers=1)
    res = compile(job.graph, Budget.parse("atol=inf,rtol=inf,outputs=logits,rel_l2<=0.03"), "h200", job.calibration,
                  SearchOptions(max_candidates=30, progress=False, workers=1, offers=Offers(rotation=True)))
    rotated = {e.label: e for e in res.search.evaluated if any(t.startswith("rot:") for _, _, t in e.genome)}
    assert {"W4A16 INT4 group 128 + Hadamard rotation", "W8A16 INT8 per-channel + Hadamard rotation"} <= set(rotated)
    assert all(e.verdict.reason for e in rotated.values())
    assert rotated["W8A16 INT8 per-channel + Hadamard rotation"].verdict.passed


@pytest.mark.slow
def test_smollm2_rotated_recipes_are_soundly_bounded_on_real_weights():
    """Two real SmolLM2 layers (K = 576 and 1536: blocks 64 and 256, outlier channels in real activations):
    each storage recipe with every Gemm rotated runs within its static bound of FP64, every output."""
    from luminal_num.models.llm import Prompt
    from luminal_num.models.registry import llm_job
    from luminal_num.search.recipes import rotated_recipes
    prompts = ["The capital of France is", "def add(a, b):"]
    job = llm_job("smollm2", "decode:2@48", calibration=[Prompt(p, False) for p in prompts],
                  heldout=[Prompt(p, False) for p in prompts], layers=2, positions_minimum=0)
    space = SearchSpace.build(job.graph, rotation=True)
    batch = job.calibration[0]
    ref = evaluate(job.graph, batch)
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in batch.items()}
    recipes = rotated_recipes(space)
    assert len(recipes) == 4  # W8A16, W4A16, FP8 W8A8, BF16 weights + FP8 KV cache
    for name, genome in recipes.items():
        program = space.program(genome)
        assert {k.rotation.block for k in program.kernels if k.rotation is not None} == {64, 256}, name
        rep = static_bound(program, ranges, job.graph.bind_symbols(batch), job.graph.weights)
        assert rep.overflow is None, name
        out = CpuRuntime(program, job.graph.weights).run(batch).outputs
        for o, r in ref.items():
            assert np.all(np.abs(np.asarray(out[o], dtype=np.float64) - r) <= rep.error_bounds[o]), (name, o)
