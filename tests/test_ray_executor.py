"""The verdict tasks on Ray (error/ray_pool.py): the same answers as the local pool, byte for byte, on a
2-node cluster inside this machine (ray.cluster_utils.Cluster); a killed worker or node costs a retry;
a task carries no weight or input array."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from luminal_num.error.ray_pool import LOOPBACK_ENV, RayPool, import_ray

ray = import_ray(single_host=True)  # before the cluster starts: its nodes listen on the loopback interface only
from ray.cluster_utils import Cluster  # noqa: E402

from luminal_num.compiler import compile as compile_plan  # noqa: E402
from luminal_num.cli_jobs import parse_budget  # noqa: E402
from luminal_num.error.chunks import ChunkEffects, Propagation  # noqa: E402
from luminal_num.error.executors import ExecutorKind, ExecutorSpec  # noqa: E402
from luminal_num.error.reference import references  # noqa: E402
from luminal_num.error.tasks import TaskPool  # noqa: E402
from luminal_num.memory import plan_memory  # noqa: E402
from luminal_num.report.compile_report import write_compile_report  # noqa: E402
from luminal_num.search.plan import Plan  # noqa: E402
from luminal_num.search.search import SearchOptions  # noqa: E402
from luminal_num.search.space import SearchSpace  # noqa: E402

STORE = 150 << 20  # each node's object store: the test model's weights and inputs are a few MB


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": STORE,
                                                      "include_dashboard": False})
    c.add_node(num_cpus=1, object_store_memory=STORE)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def refs(job):  # job, space: conftest's 2-layer test transformer (its two layers share one group)
    return references(job.graph, job.calibration)


def _tasks(job, space, refs):
    """Every chunk's FP32 and all-BF16 programs on the calibration batches: real chunk verdict tasks."""
    eff = ChunkEffects(job.graph, space.part, refs, space.lower_chunk, space.candidates(frozenset()),
                       Propagation.SCALED)
    group = next(g for g in space.part.groups if len(g.chunks) > 1)
    bf16 = frozenset((group.key, k.cls, "gemm:bf16") for k in space.knobs[group.key] if "gemm:bf16" in k.tags)
    return [eff.runner.task(space.part.chunks[i], choice, refs)
            for genome in (frozenset(), bf16) for i, choice in space.candidates(genome).items()]


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert type(g) is type(w)
        for a, b in zip(g, w):
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])


def _ready(pool: RayPool, n: int) -> None:
    """Both actors up (each imports the compiler when it starts), so each gets tasks."""
    assert pool.wait_for_workers(n, timeout_s=120) == n, "the Ray actors did not start"


@pytest.fixture(scope="module")
def tasks(job, space, refs):
    return _tasks(job, space, refs)


@pytest.fixture(scope="module")
def local_results(job, tasks):
    """The tasks' outputs from the local pool: the truth the Ray runs are compared with."""
    with TaskPool(job.graph.weights, 2) as local:
        return local.map(tasks)


@pytest.fixture(scope="module")
def pool(cluster, job):
    """One pool for the module's task-level tests (its actors start once): two actors, one per node."""
    with RayPool(job.graph.weights, cluster.address) as p:
        _ready(p, 2)
        yield p


def test_the_cluster_listens_on_loopback_only(cluster):
    assert os.environ.get(LOOPBACK_ENV) == "0"
    assert cluster.address.startswith("127.0.0.1:")


def _compile_files(job, out: Path, options: SearchOptions, workers: int) -> dict[str, bytes]:
    result = compile_plan(job.graph, parse_budget(job.default_budget), "h200", job.calibration, options,
                          memory=plan_memory(job.graph.weights, workers=workers))
    write_compile_report(result, out, "transformer: error vs latency (h200)")
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_plan_and_reports_are_the_same_bytes_for_1_or_2_local_workers_and_a_2_node_ray_cluster(cluster, job,
                                                                                                tmp_path):
    """Before any test that holds the module's pool (its actors would hold both nodes' CPUs)."""
    opts = SearchOptions(max_candidates=8, progress=False)
    one = _compile_files(job, tmp_path / "local1", opts, 1)
    two = _compile_files(job, tmp_path / "local2", opts, 2)
    ray_opts = SearchOptions(max_candidates=8, progress=False,
                             executor=ExecutorSpec(ExecutorKind.RAY, address=cluster.address))
    on_ray = _compile_files(job, tmp_path / "ray2", ray_opts, 2)
    assert one.keys() == two.keys() == on_ray.keys() and "plan.json" in one
    for name in one:
        assert one[name] == two[name] == on_ray[name], name


def test_chunk_tasks_on_ray_give_the_local_pool_s_results_in_task_order(pool, tasks, local_results):
    got = pool.map(tasks)
    nodes = pool.progress.nodes
    _same(got, local_results)
    assert len(nodes) == 2 and all(c.done > 0 and c.running == 0 for c in nodes.values()), nodes


def _payload_checks(pool: RayPool, task) -> tuple[int, int]:
    """(pickled bytes of what travels with `task`, bytes of its input arrays); every input travels as a
    ref to the same values."""
    payload = pool.payload(task)
    assert not any(isinstance(x, np.ndarray) for b in payload[1] for x in b.values())
    for refs_of_batch, batch in zip(payload[1], task.batches):
        for name, ref in refs_of_batch.items():
            np.testing.assert_array_equal(ray.get(ref), batch[name])
    return len(ray.cloudpickle.dumps(payload)), sum(v.nbytes for b in task.batches for v in b.values())


def test_a_task_carries_no_arrays(pool, tasks):
    """What travels per task is the program's LLIR data, object refs of its inputs and the bindings."""
    size, _ = _payload_checks(pool, tasks[1])
    assert size < 1 << 20


@pytest.mark.slow
def test_a_smollm2_chunk_task_is_kilobytes_while_its_inputs_are_megabytes(cluster):
    from luminal_num.models.registry import llm_job
    job = llm_job("smollm2", layers=2)
    space = SearchSpace.build(job.graph)
    refs = references(job.graph, job.calibration)
    tasks = _tasks(job, space, refs)
    with RayPool(job.graph.weights, cluster.address) as pool:
        sizes = [_payload_checks(pool, t) for t in tasks]
    size, inputs = max(sizes, key=lambda s: s[1])
    assert inputs > 1 << 20 and size < 64 << 10, sizes


def test_a_killed_worker_costs_a_retry_not_the_answer(pool, tasks, local_results):
    retries = pool.times.retries
    os.kill(pool.worker_pids()[0], signal.SIGKILL)
    got = pool.map(tasks)
    assert pool.times.retries > retries
    _same(got, local_results)
    _ready(pool, 2)  # a replacement started where the killed one was


def test_a_node_lost_between_tasks_costs_a_retry(cluster, pool, tasks, local_results):
    """Last of the task-level tests: the cluster keeps one node afterwards."""
    retries = pool.times.retries
    cluster.remove_node(next(n for n in cluster.worker_nodes))
    got = pool.map(tasks)
    assert pool.times.retries > retries
    _same(got, local_results)


def _raylets() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _as_from_a_terminal() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("after_s", [3.0, pytest.param(0.5, marks=pytest.mark.slow), pytest.param(10.0, marks=pytest.mark.slow)])
def test_ctrl_c_on_a_ray_compile_exits_130_and_leaves_no_cluster_behind(tmp_path, after_s):
    """A compile that started its own cluster, interrupted while its tasks run: one line, exit 130, a plan
    marked partial (or nothing), and the cluster's processes gone."""
    before = _raylets()
    env = {**os.environ, "PYTHONHASHSEED": "0", "MPLBACKEND": "Agg"}
    proc = subprocess.Popen([sys.executable, "-m", "luminal_num.cli", "compile", "--model", "transformer",
                             "--candidates", "200", "--quiet", "--no-verdict-cache", "--out", "OUT", "--executor",
                             "ray"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_from_a_terminal)
    for _ in range(300):
        if proc.stdout.readline().startswith("[luminal-num] budget"):
            break
    deadline = time.monotonic() + 120
    while not (_raylets() - before) and time.monotonic() < deadline:  # the compile's own cluster is up
        time.sleep(0.2)
    time.sleep(after_s)  # while the cluster starts (0.5 s), its actors start (3 s) or the search runs (10 s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (err[-2000:], out[-300:])
    assert [line for line in err.splitlines() if line.strip()][-1].startswith("interrupted: "), err[-2000:]
    if (tmp_path / "OUT" / "plan.json").exists():
        assert Plan.load(tmp_path / "OUT" / "plan.json").data["interrupted"]
    deadline = time.monotonic() + 30
    while (_raylets() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not (_raylets() - before), "the compile's Ray cluster outlived it"
