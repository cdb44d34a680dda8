"""The CPU backend's outputs, every precision tag of every test model, against truths that hold on any CPU.

FP32 sums run on BLAS (numpy's OpenBLAS), whose summation order depends on the kernel the CPU selects
(OPENBLAS_CORETYPE): bits of such outputs are not pinned. Instead each program (each test model, the
Llama-tiny job and MiniLM under every precision tag, each knob offering the tag set to it, plus seeded
mixed genomes) is compared with the FP64 evaluation of its graph (hlir.evaluate, written separately):
- within the static bound wherever that is finite (a bound below the measured error is a bug; the small
  models only: MiniLM's bounds take minutes);
- within an envelope of the variant everywhere: max |y - ref| <= ENVELOPE * u * max |ref|, u the unit
  roundoff of the narrowest format the genome chooses (the formats' own precision, tabled below).
Where the project itself fixes the summation order (the narrow-accumulator Gemms and the rounding loops:
numba kernels, runtime.jit_gemm and dtypes.jit), the whole program is compared bit for bit with the
independently written numpy path (LUMINAL_NUM_JIT=0), in the same process, so BLAS steps are shared.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from luminal_num.dtypes import jit as rounding_jit
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.models.registry import llama_tiny_job, minilm_job
from luminal_num.models.testnets import all_test_models
from luminal_num.runtime import jit_gemm
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.extract import BASE
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)

MINILM_QUICK = ("f32", "gemm:f8e4m3_tensor", "gemm:int8_channel", "gemm:f16acc16", "ew:bf16")
# unit roundoff (relative precision) of each format a tag may name; a tag naming none is FP32 (2^-24).
# Scaled integer formats: half a quantum of amax / qmax relative to amax (int8 1/254, int4 1/14).
PRECISION = {"f8e5m2": 2.0 ** -3, "f8e4m3": 2.0 ** -4, "mxfp4": 2.0 ** -2, "nvfp4": 2.0 ** -2, "int4": 2.0 ** -3,
             "int8": 2.0 ** -7, "bf16": 2.0 ** -8, "f16": 2.0 ** -11, "tf32": 2.0 ** -11}
# error growth through a model, measured 9.4 at most (MiniLM int8_channel, llama-tiny f32 7.6): 3x margin
ENVELOPE = 32.0
# the tags whose arithmetic runs in the project's own loops: numba and numpy paths must agree exactly
OWN_ORDER = ("gemm:f16acc16", "gemm:f8e4m3_block", "gemm:f8e4m3_block_nopromote", "gemm:f8e5m2_block", "sum:bf16",
             "sum:f16", "ew:bf16")


def unit_roundoff(tags) -> float:
    return max([2.0 ** -24] + [u for t in tags for name, u in PRECISION.items() if name in t])


def _tags(space: SearchSpace) -> list[str]:
    return sorted({t for ks in space.knobs.values() for k in ks for t in k.tags})


def _genome(space: SearchSpace, tag: str) -> frozenset:
    return frozenset((gk, k.cls, tag) for gk, ks in space.knobs.items() for k in ks if tag in k.tags and tag != BASE)


def _mixed(space: SearchSpace, seed: int) -> frozenset:
    rng = np.random.default_rng(seed)
    knobs = [(gk, k.cls, k.tags) for gk, ks in space.knobs.items() for k in ks]
    return frozenset((gk, cls, t) for gk, cls, tags in knobs if len(tags) > 1
                     for t in [tags[int(rng.integers(len(tags)))]] if t != BASE)


def _programs(name: str, graph, batch, tags=None, mixed: int = 2):
    """(key, graph, program, batch, tags chosen) for every tag of the space (or `tags`) and `mixed` genomes."""
    space = SearchSpace.build(graph)
    for tag in tags or _tags(space):
        yield f"{name}/{tag}", graph, space.program(_genome(space, tag)), batch, {tag}
    for seed in range(mixed):
        genome = _mixed(space, seed)
        yield f"{name}/mixed{seed}", graph, space.program(genome), batch, {t for *_, t in genome}


def small_cases(tags=None):
    for m in all_test_models():
        yield from _programs(m.name, m.graph, m.make_inputs(1), tags)
    job = llama_tiny_job(layers=2)
    yield from _programs("llama-tiny", job.graph, job.calibration[0], tags)


def minilm_cases(tags=None):
    job = minilm_job()
    yield from _programs("minilm", job.graph, job.calibration[0], tags, mixed=0)


def _check_against_fp64(cases, static: bool = True) -> int:
    """Outputs checked; `static`: also against the static bound (minutes on MiniLM: small models only)."""
    checked = 0
    for key, graph, program, batch, tags in cases:
        got = CpuRuntime(program, graph.weights).run(batch).outputs
        ref = evaluate(graph, batch)
        report = static_bound(program, {n: Interval.point(np.asarray(v, dtype=np.float64)) for n, v in batch.items()},
                              graph.bind_symbols(batch), graph.weights) if static else None
        for name, y in got.items():
            want = np.asarray(ref[name], dtype=np.float64)
            err = np.abs(np.asarray(y, dtype=np.float64) - want)
            assert np.all(np.isfinite(err)), (key, name)
            envelope = ENVELOPE * unit_roundoff(tags) * float(np.abs(want).max())
            assert err.max() <= envelope, (key, name, float(err.max()), envelope)
            if report is not None and report.overflow is None:
                bound = report.error_bounds[name]
                assert np.all((err <= bound) | np.isinf(bound)), (key, name, "static bound below the error")
            checked += 1
    return checked


def test_small_models_match_fp64_within_the_variant_bound():
    assert _check_against_fp64(small_cases()) > 300


def test_minilm_quick_variants_match_fp64_within_the_variant_bound():
    assert _check_against_fp64(minilm_cases(MINILM_QUICK), static=False) == len(MINILM_QUICK)


@pytest.mark.slow
def test_minilm_every_variant_matches_fp64_within_the_variant_bound():
    assert _check_against_fp64(minilm_cases(), static=False) > len(MINILM_QUICK)


def _run(program, graph, batch, jit: bool, monkeypatch) -> dict[str, np.ndarray]:
    with monkeypatch.context() as m:
        m.setattr(jit_gemm, "ENABLED", jit)
        m.setattr(rounding_jit, "ENABLED", jit)
        return CpuRuntime(program, graph.weights).run(batch).outputs


@pytest.mark.skipif(jit_gemm.kernel() is None, reason="numba is off (LUMINAL_NUM_JIT=0 or missing): one path only")
def test_the_projects_own_summation_orders_equal_the_numpy_path_bit_for_bit(monkeypatch):
    """Narrow accumulators and rounding loops: the numba kernels and the numpy path are two implementations
    of one defined arithmetic, so whole programs agree exactly (NaN where NaN)."""
    compared = 0
    for key, graph, program, batch, _ in small_cases(OWN_ORDER):
        if key.endswith(("mixed0", "mixed1")):
            continue
        fast, plain = _run(program, graph, batch, True, monkeypatch), _run(program, graph, batch, False, monkeypatch)
        for name in plain:
            assert fast[name].dtype == plain[name].dtype and np.array_equal(fast[name], plain[name], equal_nan=True), \
                (key, name)
            compared += 1
    assert compared > 50
