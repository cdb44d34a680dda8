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
from luminal_num.error.tasks import TaskPool, TaskProgress
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
    for a, b in zip(first, again):  # the same task, the same outputs
        for x, y in zip(a, b):
            for k in x:
                np.testing.assert_array_equal(x[k], y[k])


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
