"""The on-disk verdict cache (issue 15, item 7): a second compile reuses the first one's measurements
and picks the same plan; a corrupt or foreign cache file is ignored with a warning, never a crash."""
from __future__ import annotations

import json

import numpy as np
import pytest

from luminal_num.compiler import compile as compile_plan
from luminal_num.error.budget import Budget
from luminal_num.error.judge import Verdict
from luminal_num.error.share import Share
from luminal_num.error.verdict_store import VerdictStore, context_key
from luminal_num.search.search import SearchOptions

OPTIONS = SearchOptions(seed=0, max_candidates=25, progress=False)


def test_second_compile_reuses_measured_verdicts_and_chooses_the_same_plan(job, space, tmp_path):
    budget = Budget.parse(job.default_budget)
    first = compile_plan(job.graph, budget, "h200", job.calibration, OPTIONS, space=space, cache_dir=tmp_path)
    files = list(tmp_path.glob("verdicts-*.json"))
    assert len(files) == 1 and not list(tmp_path.glob(".tmp-*"))
    second = compile_plan(job.graph, budget, "h200", job.calibration, OPTIONS, space=space, cache_dir=tmp_path)
    s1, s2 = first.search.stats.gate, second.search.stats.gate
    assert s2.stored > 0 and s2.measured < s1.measured
    assert second.search.chosen.genome == first.search.chosen.genome
    assert second.search.chosen.verdict == first.search.chosen.verdict
    # another budget is another context: nothing is reused
    other = compile_plan(job.graph, Budget.parse("atol=5e-3,rtol=5e-3"), "h200", job.calibration, OPTIONS,
                         space=space, cache_dir=tmp_path)
    assert other.search.stats.gate.stored == 0


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": "other"}), "\x00\x01"])
def test_a_corrupt_cache_file_is_ignored_with_a_warning(job, tmp_path, text):
    budget = Budget.parse(job.default_budget)
    ctx = context_key(job.graph, job.calibration, budget, budget)
    store = VerdictStore(tmp_path, ctx)
    store.path.write_text(text)
    with pytest.warns(RuntimeWarning, match="ignoring the unreadable verdict cache"):
        opened = VerdictStore.open(tmp_path, ctx)
    assert opened.entries == {}
    v = Verdict(True, "measured", Share(np.inf, 0.5, 0.25), 1e-3, None, "ok")
    opened.put("k", v)
    assert VerdictStore.open(tmp_path, ctx).get("k") == v  # inf survives JSON


def test_the_context_changes_with_weights_and_inputs(job):
    budget = Budget.parse(job.default_budget)
    base = context_key(job.graph, job.calibration, budget, budget)
    moved = [{k: (v + 1 if np.asarray(v).dtype.kind == "f" else v) for k, v in b.items()} for b in job.calibration]
    assert context_key(job.graph, moved, budget, budget) != base
    assert context_key(job.graph, job.calibration, budget.tightened(0.5), budget) != base


def test_pool_workers_run_blas_on_one_thread_each():
    """One worker per core: a worker's BLAS must not start threads of its own on top (error/tasks.py)."""
    import pytest
    from luminal_num.error import tasks
    from luminal_num.blas_threads import blas_threads
    if blas_threads() is None:
        pytest.skip("numpy is not using its bundled OpenBLAS: its own threading stands")
    with tasks.TaskPool({}, 2) as pool:
        if pool._pool is None:
            pytest.skip("no fork start method: the pool runs tasks in this process")
        got = pool._pool.map(_threads, range(4))
    assert got == [1, 1, 1, 1]


def _threads(_):
    from luminal_num.blas_threads import blas_threads
    return blas_threads()


def test_a_pool_forks_with_sigint_held_and_restores_the_parents_mask():
    """A Ctrl-C during the fork is held and delivered after it (os.fork's after-fork handlers swallow
    one); the workers keep SIGINT blocked, the parent gets its own mask back."""
    import signal

    import pytest
    from luminal_num.error import tasks
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with tasks.TaskPool({}, 2) as pool:
        if pool._pool is None:
            pytest.skip("no fork start method: the pool runs tasks in this process")
        assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
        assert all(pool._pool.map(_sigint_blocked, range(2)))


def _sigint_blocked(_):
    import signal
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
