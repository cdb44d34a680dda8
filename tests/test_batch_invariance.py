"""Batch-invariant plans (issue 37): a row's bits do not depend on the batch it is in.

Differential: the fixed-order Gemm against an FP64 numpy reference within the FP32 Gemm's static bound,
and against its own definition written out in numpy; row sums and softmax of a row alone vs in a batch;
whole models (MiniLM, SmolLM2 with 2 layers) run alone vs inside batches of 2, 4, 8, and (slow, one process
per setting) with 1 vs 2 threads under the Haswell and Sandybridge OpenBLAS kernels, bit for bit; the
same checks find differences on a plan whose FP8 activation scale spans the batch (default: a control
that fails on any CPU) and on the plain plan (slow: BLAS order per M and per kernel); the CUDA tiled Gemm
of a batch-invariant program gives a row the same bits at M = 1 and M = 8 in the interpreter.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from luminal_num.codegen.attention import AttentionSpec, key_ranges, spec_for
from luminal_num.codegen.invariance import row_coupled_kernels
from luminal_num.codegen.llir import KernelInput, KernelKind
from luminal_num.codegen.serialize import program_from_data, program_to_data
from luminal_num.dtypes.formats import F32
from luminal_num.hlir.gemm import gemm_layouts
from luminal_num.hlir.shape import ShapeTracker
from luminal_num.report.invariance import InvarianceResult, check_invariance, split_items
from luminal_num.runtime import tile_threads
from luminal_num.blas_threads import set_blas_threads
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.fixed_gemm import FIXED_K_GROUP, fixed_matmul
from luminal_num.search.space import SearchSpace

ROOT = Path(__file__).resolve().parent.parent


# -- the fixed-order Gemm ----------------------------------------------------------------------------------

def _definition(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fixed_gemm's order written out: per group of 32 products an FP64 sum (k in order, fma: emulated as
    the exact product plus s rounded once, via float128-free splitting is not needed here because the
    products of float32 values are exact in FP64 and |s| stays small: checked against the kernel only
    where both agree with a second, sequential non-fma sum), then acc = RN_f32(fl64(acc + group))."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    acc = None
    for g in range(0, a.shape[1], FIXED_K_GROUP):
        s = np.zeros((a.shape[0], b.shape[1]))
        for k in range(g, min(g + FIXED_K_GROUP, a.shape[1])):
            s = s + a64[:, k:k + 1] * b64[k]
        acc = s.astype(np.float32) if acc is None else (acc.astype(np.float64) + s).astype(np.float32)
    return acc


def test_fixed_gemm_is_its_definition_and_within_the_fp32_bound():
    """Small integers-times-powers-of-two operands make every FP64 group sum exact (so fma or not is the
    same): the kernel equals the written-out order bit for bit; on normal data it is within the FP32 Gemm's
    static bound gamma_K(2^-24) |a||b| of an FP64 reference (and far inside it)."""
    rng = np.random.default_rng(3)
    a = (rng.integers(-64, 64, (7, 200)) * 2.0 ** -5).astype(np.float32)
    b = (rng.integers(-64, 64, (200, 45)) * 2.0 ** -7).astype(np.float32)
    a[:, ::3] *= np.float32(1.0 / 3.0)  # groups' FP32 accumulations round
    np.testing.assert_array_equal(fixed_matmul(a, b), _definition(a, b))
    a, b = rng.standard_normal((9, 1000)).astype(np.float32), rng.standard_normal((1000, 33)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    k, u = a.shape[1], 2.0 ** -24
    bound = k * u / (1 - k * u) * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
    err = np.abs(fixed_matmul(a, b) - ref)
    assert (err <= bound).all() and err.max() > 0


def test_fixed_gemm_rows_do_not_depend_on_m_position_or_threads(monkeypatch):
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((37, 384)).astype(np.float32), rng.standard_normal((384, 1536)).astype(np.float32)
    full = fixed_matmul(a, b)
    for rows in (slice(0, 1), slice(13, 14), slice(5, 13), slice(36, 37)):
        np.testing.assert_array_equal(fixed_matmul(a[rows], b), full[rows])
    monkeypatch.setattr(tile_threads, "TILE_THREADS", 1)
    np.testing.assert_array_equal(fixed_matmul(a, b), full)
    assert not np.array_equal(np.matmul(a, b), full)  # BLAS's order is another: the comparison can fail


# -- attention split sizes, plan records --------------------------------------------------------------------

def test_invariant_attention_splits_at_fixed_key_boundaries():
    spec = spec_for(0.125, 1, 144, batch_invariant=True)
    assert spec.split_keys == 64 and spec.splits == 3
    assert [[r[0][0], r[-1][1]] for r in key_ranges(144, spec)] == [[0, 64], [64, 128], [128, 144]]
    assert key_ranges(64, spec)[0] == key_ranges(144, spec)[0]  # a shorter cache: the same first range
    assert spec_for(0.125, 1, 144).split_keys == 0 and spec_for(0.125, 1, 144).splits == 4  # counts, not sizes
    assert spec_for(0.125, 7, 144, batch_invariant=True) == AttentionSpec(0.125)  # prefill: one pass already
    with pytest.raises(ValueError):
        AttentionSpec(0.5, split_keys=40)


# -- row reductions: numpy's order follows the row, not the batch ------------------------------------------

@pytest.mark.parametrize("length", [1, 3, 7, 8, 9, 41, 127, 128, 129, 384, 576, 1536, 8193, 49152])
def test_row_sums_and_softmax_of_a_row_do_not_depend_on_the_batch_it_is_in(length):
    """Why invariant plans need no kernel of their own for norms and softmax: the CPU backend's row sum
    (reduce_sum: FP32, FP64 and a non-contiguous view's copy) and its softmax give a row, alone, the bits it
    gets at every slot of batches of 2, 4 and 8 (numpy sums a contiguous row pairwise in blocks that follow
    its length); a middle axis (sequence, pooled per batch) likewise. Lengths cross the pairwise blocks (8,
    128) and the 8192-element buffer size."""
    from luminal_num.dtypes.formats import F64
    from luminal_num.runtime.cpu_bodies import reduce_sum
    from luminal_num.runtime.cpu_softmax import softmax_f64_into
    rng = np.random.default_rng(length)
    rows = (rng.standard_normal((8, length)) * rng.uniform(0.1, 30, (8, 1))).astype(np.float32)
    strided = np.repeat(rows, 2, axis=1)[:, ::2]  # the same values through a non-contiguous view

    def each(fn, a):
        return [fn(a[i:i + 1])[0] for i in range(len(a))]

    for fn in (lambda a: reduce_sum(a, 1, None), lambda a: reduce_sum(a, 1, F64),
               lambda a: softmax_f64_into(a, 1, np.empty(a.shape, np.float32))):
        for values in (rows, strided):
            alone = each(fn, values)
            for b in (2, 4, 8):
                for start in range(0, 8, b):
                    got = fn(values[start:start + b])
                    for slot in range(b):
                        assert np.array_equal(got[slot], alone[start + slot]), (fn, b, slot)
    cube = rows.reshape(8, 1, length).repeat(3, axis=1).transpose(0, 2, 1).copy()  # (batch, length, 3)
    alone = [reduce_sum(cube[i:i + 1], 1, None) for i in range(8)]
    assert all(np.array_equal(reduce_sum(cube, 1, None)[i], alone[i][0]) for i in range(8))


# -- CUDA: the tiled Gemm of a batch-invariant program pins one order ---------------------------------------

def _gemm_program(m: int, name: str, invariant: bool):
    from test_cuda_codegen import one_kernel
    k = 96
    a_view = ShapeTracker.contiguous((m, k)).expand_dim(1, 5)
    b_view = ShapeTracker.contiguous((k, 5)).permute((1, 0)).expand_dim(0, m)
    program = one_kernel([("a", (m, k), F32), ("b", (k, 5), F32)], kind=KernelKind.GEMM, shape=(m, 5), dtype=F32,
                         inputs=(KernelInput(0, a_view), KernelInput(1, b_view)),
                         layout=gemm_layouts(a_view, b_view, 2)[0], precision=name)
    return dataclasses.replace(program, batch_invariant=invariant)


@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_cuda_tiled_gemm_of_an_invariant_program_gives_a_row_the_same_bits_at_m_1_and_8(name):
    from test_cuda_codegen import interpret
    from luminal_num.codegen.cuda_kernels import render_kernel
    rng = np.random.default_rng(11)
    a8 = rng.standard_normal((8, 96)).astype(np.float32)
    b = rng.standard_normal((96, 5)).astype(np.float32)
    rows = {}
    for invariant in (True, False):
        for m in (1, 8):
            program = _gemm_program(m, name, invariant)
            stored = {0: a8[:m].astype(np.float64), 1: b.astype(np.float64)}
            src = render_kernel(program.kernels[-1], program)
            assert (src.gemm is None) == invariant or not invariant  # no library call in an invariant program
            rows[invariant, m] = interpret(program, program.kernels[-1], stored, {}).reshape(m, 5)[0]
    np.testing.assert_array_equal(rows[True, 1], rows[True, 8])
    assert not np.array_equal(rows[False, 1], rows[False, 8])  # the M <= 4 tree vs the sequential loop


# -- whole models ---------------------------------------------------------------------------------------------

def _genome(sp: SearchSpace, tags: tuple[str, ...]) -> frozenset:
    """Each e-class the first of `tags` it offers."""
    return frozenset((gk, k.cls, next(t for t in tags if t in k.tags)) for gk, ks in sp.knobs.items() for k in ks
                     if any(t in k.tags for t in tags))


@functools.lru_cache(maxsize=None)
def _minilm_space(b: int) -> SearchSpace:
    from luminal_num.models.bert import load_minilm
    return SearchSpace.build(load_minilm(b, 41).graph)


def _minilm_runtimes(invariant: bool, tags: tuple[str, ...] = ()):
    def runtime(b: int) -> CpuRuntime:
        sp = _minilm_space(b).with_batch_invariance(invariant)
        return CpuRuntime(sp.program(_genome(sp, tags)), sp.graph.weights)
    return runtime


@pytest.fixture(scope="module")
def minilm_items():
    from luminal_num.models.registry import minilm_job
    job = minilm_job(batch=12)
    assert job.graph.inputs["ids"].shape[1] == 41
    return split_items(job.heldout[:1], 12)[:4]


def test_minilm_invariant_plan_is_bit_identical_alone_and_in_a_batch_and_a_row_coupled_one_is_not(minilm_items):
    """Default (fast): 2 inputs alone and in a batch of 8; the slow tests below run 2, 4 and 8. The control
    that can fail on any CPU: a plan whose FP8 activation scale is the amax of the whole batch (the BLAS-order
    control, which depends on the CPU's kernels, is the slow plain-plan tests')."""
    inv = check_invariance(_minilm_runtimes(True, ("gemm:bf16", "attn:flash_f32")), minilm_items[:2], True, sizes=(8,))
    assert inv.positions == 2 and inv.invariant and inv.passed, inv.summary()
    coupled = check_invariance(_minilm_runtimes(False, ("gemm:f8e4m3_tensor_dynamic",)), minilm_items[:2], False,
                               sizes=(8,))
    assert not coupled.invariant and coupled.passed, coupled.summary()
    assert not InvarianceResult(coupled.rows, batch_invariant=True).passed  # required but not held: a failure


@pytest.mark.slow
def test_minilm_plain_plan_is_not_bit_identical_in_a_batch(minilm_items):
    """BLAS picks another order per M (OpenBLAS on x86: true of every kernel this suite runs under)."""
    plain = check_invariance(_minilm_runtimes(False, ("gemm:bf16", "attn:flash_f32")), minilm_items[:2], False,
                             sizes=(8,))
    assert not plain.invariant and plain.passed, plain.summary()


@pytest.mark.slow
@pytest.mark.parametrize("tags", [(), ("gemm:bf16", "attn:flash_f32"), ("gemm:f8e4m3_channel",), ("gemm:f16acc16",)])
def test_minilm_invariant_plans_in_batches_of_2_4_8(minilm_items, tags):
    inv = check_invariance(_minilm_runtimes(True, tags), minilm_items, True)
    assert inv.positions == 12 and inv.invariant, inv.summary()


def test_a_row_spanning_dynamic_scale_is_refused_for_invariant_plans():
    sp = _minilm_space(8).with_batch_invariance(True)
    def program(tag):
        return sp.program(frozenset((gk, k.cls, tag) for gk, ks in sp.knobs.items() for k in ks if tag in k.tags))
    assert row_coupled_kernels(program("gemm:f8e4m3_tensor_dynamic"))
    assert not row_coupled_kernels(program("gemm:f8e4m3_channel")) and not row_coupled_kernels(program("gemm:bf16"))
    p = program("gemm:bf16")
    again = program_from_data(json.loads(json.dumps(program_to_data(p))))
    assert again.batch_invariant and again == p


SMOL_LAYERS = 2


def _smollm2_runtimes(invariant: bool):
    from luminal_num.models.llm import Workload, build_workload, load_llm
    m = load_llm("smollm2", SMOL_LAYERS)

    def runtime(b: int) -> CpuRuntime:
        g = build_workload(m, Workload.parse(f"decode:{b}@64")).graph
        sp = SearchSpace.build(g).with_batch_invariance(invariant)
        return CpuRuntime(sp.program(_genome(sp, ("attn:flash_f32",))), g.weights)
    return runtime


OFFSETS = {"positions": 64}  # flat cache rows: b * context + position


def _smollm2_items(count: int):
    from luminal_num.models.registry import llm_job
    job = llm_job("smollm2", "decode:8@64", layers=SMOL_LAYERS)
    return split_items(job.heldout[:1], 8, OFFSETS)[:count]


@pytest.mark.slow
def test_smollm2_invariant_decode_is_bit_identical_alone_and_in_a_batch():
    """2 prompts alone and in a batch of 8 (logits and every KV-cache row written); by default an LLM's decode
    is checked on the tiny GGUF model through the CLI (test_cli_llm.py)."""
    inv = check_invariance(_smollm2_runtimes(True), _smollm2_items(2), True, sizes=(8,), offsets=OFFSETS)
    assert inv.positions == 2 and inv.invariant, inv.summary()
    assert set(inv.rows["output"]) >= {"logits", "k_cache_out.0"}


@pytest.mark.slow
def test_smollm2_invariant_decode_in_batches_of_2_4_8():
    inv = check_invariance(_smollm2_runtimes(True), _smollm2_items(8), True, offsets=OFFSETS)
    assert inv.positions == 24 and inv.invariant, inv.summary()


@pytest.mark.slow
def test_smollm2_plain_decode_is_not_bit_identical_in_batches():
    plain = check_invariance(_smollm2_runtimes(False), _smollm2_items(8), False, offsets=OFFSETS)
    assert not plain.invariant, plain.summary()


# -- threads and OpenBLAS kernels: a subprocess per setting ---------------------------------------------------

# (threads, OPENBLAS_CORETYPE): this host has no AVX-512 (SkylakeX would crash at import) and its default core
# is Haswell, so the two kernels are Haswell and Sandybridge, each with 1 and 2 BLAS / tile threads
SETTINGS = ((1, "Haswell"), (2, "Haswell"), (1, "Sandybridge"), (2, "Sandybridge"))

_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
import test_batch_invariance as t
getattr(t, sys.argv[2])(*sys.argv[3:])
"""


class _Recording:
    """A runtime whose every run's outputs are kept, in run order."""

    def __init__(self, runtime: CpuRuntime, runs: list):
        self.runtime, self.runs = runtime, runs

    def run(self, feed):
        result = self.runtime.run(feed)
        self.runs.append(result.outputs)
        return result


def _openblas_core() -> str:
    """The OpenBLAS kernel this process runs (OPENBLAS_CORETYPE is read when numpy loads it)."""
    import ctypes
    from luminal_num.blas_threads import bundled_openblas
    lib = bundled_openblas("scipy_openblas_get_corename64_")
    if lib is None:
        return "not the bundled OpenBLAS"
    fn = lib.scipy_openblas_get_corename64_
    fn.restype = ctypes.c_char_p
    return fn().decode()


def save_items(model: str, out: str) -> None:
    """Run in a fresh process: the model's 8 held-out inputs, saved once for every probe (the job that
    makes them, with its FP64 reference, stays out of the probes' memory)."""
    items = _minilm_items_direct() if model == "minilm" else _smollm2_items(8)
    np.savez(out, **{f"{i}__{name}": a for i, item in enumerate(items) for name, a in item.items()})


PROBE_CACHE_BYTES = 256 << 20  # the weight-derived cache of a probe (values are the same, only fewer kept)


def probe(model: str, invariant: str, threads: str, items_file: str, out: str) -> None:
    """Run in a fresh process: the model's invariance check (every item alone, then in batches of 2, 4, 8)
    with `threads` BLAS and tile threads; saves the verdict, the OpenBLAS core that ran and every output of
    every run in run order (the same order in every process)."""
    from luminal_num.hlir.weightcache import WEIGHTS
    set_blas_threads(int(threads))
    tile_threads.TILE_THREADS = int(threads)
    WEIGHTS.resize(PROBE_CACHE_BYTES)
    required = invariant == "1"
    with np.load(items_file) as saved:
        items = [{} for _ in range(len({key.split("__")[0] for key in saved.files}))]
        for key in saved.files:
            index, name = key.split("__", 1)
            items[int(index)][name] = saved[key]
    runs: list = []
    runtime_at, offsets = (_minilm_runtimes(required, ("gemm:bf16",)), None) if model == "minilm" else \
        (_smollm2_runtimes(required), OFFSETS)
    result = check_invariance(lambda b: _Recording(runtime_at(b), runs), items, required, offsets=offsets)
    arrays = {f"run{i}__{name}": a for i, outs in enumerate(runs) for name, a in outs.items()}
    np.savez(out, core=_openblas_core(), identical=result.identical_positions, positions=result.positions,
             outputs=sorted(set(result.rows["output"])), **arrays)


def _minilm_items_direct():
    from luminal_num.models.registry import minilm_job
    return split_items(minilm_job(batch=12).heldout[:1], 12)[:8]


def _subprocess(coretype: str, *args) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OPENBLAS_CORETYPE": coretype}
    subprocess.run([sys.executable, "-c", _PROBE, str(ROOT / "tests"), *map(str, args)], env=env, check=True,
                   timeout=600)


def _probe(tmp_path, model: str, invariant: bool, threads: int, coretype: str) -> dict:
    items = tmp_path / f"{model}_items.npz"
    if not items.exists():
        _subprocess(coretype, "save_items", model, items)
    out = tmp_path / f"{model}_{int(invariant)}_{threads}_{coretype}.npz"
    _subprocess(coretype, "probe", model, int(invariant), threads, items, out)
    with np.load(out) as saved:
        return {key: saved[key] for key in saved.files}


def _same_runs(a: dict, b: dict) -> bool:
    runs = [key for key in a if key.startswith("run")]
    return sorted(runs) == sorted(key for key in b if key.startswith("run")) and \
        all(a[key].dtype == b[key].dtype and np.array_equal(a[key].view(np.uint8), b[key].view(np.uint8))
            for key in runs)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["minilm", "smollm2"])
def test_invariant_bits_hold_across_batches_threads_and_openblas_kernels(tmp_path, model):
    """MiniLM's embeddings (BF16 Gemms) and SmolLM2's (2 layers, decode:8@64, FP32 Gemms, fused attention)
    logits and KV-cache rows: each of 8 held-out inputs alone and in batches of 2, 4, 8 is bit-identical
    within each setting, and every run's outputs are bit-identical across 1 vs 2 threads and the Haswell vs
    Sandybridge OpenBLAS kernels (each process reports the core it ran). The control: the ordinary plan is
    not invariant in a batch or not the same across settings (so the comparisons can fail)."""
    runs = {s: _probe(tmp_path, model, True, *s) for s in SETTINGS}
    assert {str(r["core"]) for r in runs.values()} == {"Haswell", "Sandybridge"}
    for setting, r in runs.items():
        assert int(r["identical"]) == int(r["positions"]) == 24, (setting, r["identical"], r["positions"])
    expected = {"embedding"} if model == "minilm" else {"logits", "k_cache_out.0", "v_cache_out.1"}
    assert expected <= set(runs[SETTINGS[0]]["outputs"].tolist())
    for setting, r in runs.items():
        assert _same_runs(r, runs[SETTINGS[0]]), setting
    plain = [_probe(tmp_path, model, False, *s) for s in (SETTINGS[0], SETTINGS[3])]
    assert any(int(r["identical"]) < int(r["positions"]) for r in plain) or not _same_runs(*plain)
