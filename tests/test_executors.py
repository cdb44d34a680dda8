"""The executor interface without a cluster: the local pool's counts and times, the spec's refusals, and
a missing ray package said in one line (tests/test_ray_executor.py runs the Ray side)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from luminal_num.cli import main
from luminal_num.error.chunks import ChunkEffects, Propagation
from luminal_num.error.executors import ExecutorKind, ExecutorSpec, ExecutorUnavailable
from luminal_num.error.reference import references
from luminal_num.error.tasks import Fp32Exact, TaskPool, TaskProgress, packed, run_task, unpacked
from luminal_num.models.registry import transformer_job
from luminal_num.search.space import SearchSpace


@pytest.fixture(scope="module")
def tasks():
    job = transformer_job(2)
    space = SearchSpace.build(job.graph)
    refs = references(job.graph, job.calibration)
    eff = ChunkEffects(job.graph, space.part, refs, space.lower_chunk, space.candidates(frozenset()),
                       Propagation.SCALED)
    return job, [eff.runner.task(space.part.chunks[i], c, refs) for i, c in space.candidates(frozenset()).items()]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_local_pool_counts_every_task_done_and_times_it(tasks, workers):
    job, todo = tasks
    with TaskPool(job.graph.weights, workers) as pool:
        first = pool.map(todo)
        again = pool.map(todo)
        progress, times = pool.progress, pool.times
    assert progress.queued == 0 and progress.nodes["local"].running == 0
    assert progress.nodes["local"].done == times.tasks == 2 * len(todo)
    assert 0 < times.own_s and times.retries == 0
    assert (times.worker_extra_s > 0) == (workers > 1)  # reading, decoding and packing a sent task: pool only
    here = [run_task(t, job.graph.weights) for t in todo]
    for a, b, c in zip(first, again, here):  # the same task, the same outputs, the bits of a run here
        for x, y, z in zip(a, b, c):
            for k in x:
                assert x[k].dtype == y[k].dtype == z[k].dtype == np.float64
                np.testing.assert_array_equal(x[k].view(np.uint64), z[k].view(np.uint64))
                np.testing.assert_array_equal(y[k].view(np.uint64), z[k].view(np.uint64))


def test_outputs_travel_as_fp32_only_where_widening_gives_back_every_bit():
    f32 = np.array([1.5, -0.0, np.inf, -np.inf, np.float32(1 / 3), 3.4e38, 1e-45], np.float32).astype(np.float64)
    not_f32 = np.array([1 / 3, 0.0])            # 1/3 in FP64 has bits FP32 drops
    beyond = np.array([1e39, 2.0])              # past FP32's range: would become inf
    tiny = np.array([1e-46, 1.0])               # below FP32's subnormals: would become 0
    bits = np.array([np.nan, 1.0]).view(np.uint64).copy()
    bits[0] |= np.uint64(1)                     # a NaN payload bit FP32 cannot keep
    odd_nan = bits.view(np.float64)             # (any array holding NaN travels as FP64)
    out = packed([{"a": f32, "b": not_f32, "c": beyond, "d": tiny, "e": odd_nan}])
    assert isinstance(out[0]["a"], Fp32Exact) and out[0]["a"].values.dtype == np.float32
    assert all(out[0][k] is v for k, v in (("b", not_f32), ("c", beyond), ("d", tiny), ("e", odd_nan)))
    back = unpacked(out)[0]
    for k, want in (("a", f32), ("b", not_f32), ("c", beyond), ("d", tiny), ("e", odd_nan)):
        assert back[k].dtype == np.float64
        np.testing.assert_array_equal(back[k].view(np.uint64), want.view(np.uint64))
    err = ValueError("overflow")
    assert packed(err) is err and unpacked(err) is err


def test_progress_text_names_queued_and_each_node():
    p = TaskProgress()
    p.submitted(3)
    p.started("node a")
    p.started("node b")
    p.finished("node a")
    p.lost("node b")  # its task goes back to the queue
    assert p.text() == "2 queued | node a: 0 running, 1 done | node b: 0 running, 0 done"


def test_a_ray_option_without_the_ray_executor_is_refused():
    with pytest.raises(ValueError, match="needs --executor ray"):
        ExecutorSpec(ExecutorKind.LOCAL, address="auto")
    with pytest.raises(ValueError, match=">= 1"):
        ExecutorSpec(ExecutorKind.RAY, workers=0)


def test_the_cli_refuses_a_ray_address_without_ray_in_one_line(capsys, tmp_path):
    rc = main(["compile", "--model", "transformer", "--quiet", "--out", str(tmp_path / "o"), "--ray-address", "auto"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "needs --executor ray" in err[0]
    assert not (tmp_path / "o").exists()


def test_without_the_ray_package_the_ray_executor_says_how_to_get_it(monkeypatch):
    from luminal_num.error import ray_pool
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    with pytest.raises(ExecutorUnavailable, match=r"pip install 'luminal_num\[ray\]'"):
        ray_pool.RayPool({})


def test_the_reference_and_verdicts_run_on_one_blas_thread_and_the_count_comes_back():
    """What makes the driver's own runs compute the bits a worker's would (luminal_num/blas_threads.py); the FP64
    reference's small-M products run on one thread too (a second one only waits beside a busy process)."""
    from luminal_num.cli_jobs import parse_budget
    from luminal_num.compiler import compile as compile_plan
    from luminal_num.blas_threads import blas_threads, set_blas_threads
    from luminal_num.search.search import SearchOptions
    if blas_threads() is None:
        pytest.skip("numpy's BLAS is not its bundled OpenBLAS: its thread count cannot be set")
    job = transformer_job(2)
    set_blas_threads(2)
    seen = {}
    compile_plan(job.graph, parse_budget(job.default_budget), "h200", job.calibration,
                 SearchOptions(max_candidates=4, progress=False, workers=1),
                 on_stage=lambda name, s: seen.__setitem__(name, blas_threads()))
    assert seen["partition"] == 2 and seen["reference"] == seen["headroom"] == seen["search"] == seen["confirm"] == 1, seen
    assert blas_threads() == 2


def test_small_products_take_one_blas_thread_and_large_ones_keep_the_count():
    from luminal_num.blas_threads import SMALL_PRODUCT_ROWS, blas_threads, set_blas_threads, threads_for_rows
    if blas_threads() is None:
        pytest.skip("numpy's BLAS is not its bundled OpenBLAS: its thread count cannot be set")
    before = blas_threads()
    set_blas_threads(2)
    try:
        with threads_for_rows(SMALL_PRODUCT_ROWS - 1):
            assert blas_threads() == 1
        assert blas_threads() == 2
        with threads_for_rows(SMALL_PRODUCT_ROWS):
            assert blas_threads() == 2
    finally:
        set_blas_threads(before)


@pytest.mark.slow
def test_smollm2_plans_are_the_same_bytes_for_one_and_two_local_workers(tmp_path):
    """The property the one-thread rule exists for: with 2 BLAS threads in the driver, 1 local worker (every
    verdict run here) and 2 (run in the pool) chose different bytes before it."""
    from luminal_num.cli_jobs import parse_budget
    from luminal_num.compiler import compile as compile_plan
    from luminal_num.memory import plan_memory
    from luminal_num.models.registry import llm_job
    from luminal_num.report.compile_report import write_compile_report
    from luminal_num.blas_threads import set_blas_threads
    from luminal_num.search.search import SearchOptions
    job = llm_job("smollm2", layers=3)
    set_blas_threads(2)
    files = []
    for workers in (1, 2):
        result = compile_plan(job.graph, parse_budget(job.default_budget), "h200", job.calibration,
                              SearchOptions(max_candidates=8, progress=False, workers=workers),
                              memory=plan_memory(job.graph.weights, workers=workers))
        write_compile_report(result, tmp_path / str(workers), "smollm2")
        files.append({p.name: p.read_bytes() for p in sorted((tmp_path / str(workers)).iterdir())})
    assert files[0].keys() == files[1].keys()
    assert [n for n in files[0] if files[0][n] != files[1][n]] == []
