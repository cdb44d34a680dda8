"""The verdict tasks on a Ray cluster (`--executor ray`): one long-lived actor per CPU, spread over the nodes.

Why actors: each keeps its process's warm caches (converted weights, numba code) from task to task, and
knowing which actor runs which task lets the progress bar say what runs on each node. The weights go into
the object store once; a node fetches them once and its actors read them zero-copy (a weight keeps its
content key: hlir/store.py). A task carries the program as LLIR data and its inputs as object refs,
interned by content (a chunk's FP64 boundary values are the same for every candidate): no weight or input
array travels with it. The driver hands each actor one task at a time and puts results back in task
order, so the cluster's size and timing never reach the plan. A task whose actor or node died goes back
to the queue (a replacement actor is started where the cluster has room); Ctrl-C kills the actors.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .. import interrupts
from ..codegen.serialize import program_to_data
from ..hlir.store import content_key
from ..quant.calibration import NO_HESSIANS, Hessians
from .executors import ExecutorUnavailable
from .tasks import RunTask, TaskProgress, TaskTimes, run_caught, run_sent, unpacked, worker_init

INPUT_CACHE_BYTES = 512 << 20  # interned task inputs kept in the object store (least recently used dropped)
START_TIMEOUT_S = 300.0        # how long map() waits for a replacement actor when no other is alive
WAIT_S = 0.25                  # map() looks for a held Ctrl-C this often while tasks run
# tasks handed to an actor at once: the next waits in the actor's queue while one runs, so the actor never
# idles through a round trip to the driver (the bench measured it; bench/executors.py)
SLOTS = 2


# Ray finds a node's address by the route to the internet, and maps 127.0.0.1 to it; a cluster of this
# machine alone (started for the compile, or a test's ray.cluster_utils.Cluster) belongs on the loopback
# interface: this setting, read when ray is imported, keeps it there (Ray's own switch for single-host use).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray(single_host: bool):
    """The ray module (an optional extra: imported only when a compile asks for it). `single_host`: the
    first import keeps every node of this process's clusters on the loopback interface."""
    if single_host and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    try:
        import ray
    except ImportError:
        raise ExecutorUnavailable("--executor ray needs the ray package: pip install 'luminal_num[ray]'") from None
    return ray


def _lost_worker() -> tuple[type[BaseException], ...]:
    """What a dead worker or node looks like from the driver: the task is run again elsewhere."""
    from ray import exceptions as ex
    return ex.RayActorError, ex.WorkerCrashedError, ex.NodeDiedError, ex.ObjectLostError, ex.OwnerDiedError


class HeldInterrupts:
    """Ctrl-C noted, not raised, while Ray's own code runs, and raised from Python right after: an interrupt
    raised inside a blocking Ray call (ray.wait, ray.init) can leave its core worker in a state that crashes
    the process at exit. Only in the main thread, and only over Python's own handlers (interrupts.py)."""

    def __init__(self):
        self.pending, self._previous = False, None

    def __enter__(self) -> "HeldInterrupts":
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) in interrupts.python_handlers():
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.pending = True

    def check(self) -> None:
        """Raise the Ctrl-C noted since the last check, if any."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(self, exc_type, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if exc_type is None:
            self.check()


class _Worker:
    """A Ray actor: the weights (resolved from the object store when the actor starts) and warm caches."""

    def __init__(self, weights: Mapping[str, np.ndarray], cache_bytes: int | None, hessians: Hessians):
        worker_init(weights, cache_bytes, hessians)
        self.node = import_ray(False).get_runtime_context().get_node_id()

    def where(self) -> tuple[str, int]:
        return f"node {self.node[:6]}", os.getpid()

    def run(self, data: dict, batches: tuple[Mapping[str, object], ...], bindings) -> tuple[object, float, float]:
        return run_sent(data, batches, bindings, read=_fetched)


def _fetched(batches: tuple[Mapping[str, object], ...]) -> tuple[dict[str, np.ndarray], ...]:
    """A task's input refs read from the object store, all in one call (zero-copy on the actor's node)."""
    values = iter(import_ray(False).get([ref for b in batches for ref in b.values()]))
    return tuple({name: next(values) for name in b} for b in batches)


@dataclass
class _Actor:
    handle: object
    node: str = ""
    pid: int = 0
    last_result: float = 0.0  # when the driver last took a result of this actor (perf_counter)


class RayPool:
    """`workers` actors on the cluster at `address` ("auto", "HOST:PORT"; None: a cluster started on this
    machine for the compile, stopped with it). Same interface as tasks.TaskPool."""

    def __init__(self, weights: Mapping[str, np.ndarray], address: str | None = None, workers: int | None = None,
                 cache_bytes: int | None = None, progress: TaskProgress | None = None,
                 hessians: Hessians = NO_HESSIANS):
        self.ray = ray = import_ray(single_host=address is None)
        self.times, self.progress = TaskTimes(), progress or TaskProgress()
        self.weights = weights
        self._connected = False
        self._actors: list[_Actor] = []  # ready ones, idle or running a task
        self._idle: deque[_Actor] = deque()
        self._starting: dict[object, _Actor] = {}  # where() ref -> actor not yet ready
        self._inputs = InputRefs(ray)
        self._interrupted = False
        self._actor_args = None
        try:
            with HeldInterrupts():
                self._join(address, weights)
                # each node fetches the weights (and GPTQ's calibration Hessians) once
                self._actor_args = (ray.put(dict(weights)), cache_bytes, ray.put(hessians))
                self.size = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
                for _ in range(self.size):
                    self._spawn()
        except BaseException:  # Ctrl-C while the cluster starts: leave nothing running (a driver that exits
            self.close()       # still connected can crash at interpreter exit)
            raise

    def _join(self, address: str | None, weights: Mapping[str, np.ndarray]) -> None:
        ray = self.ray
        if ray.is_initialized():  # the caller's own connection: theirs to close
            return
        self._connected = True
        try:
            # "local": a new cluster for this compile, never one found running on this machine
            ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR, **_local_cluster_args(weights, address))
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise ExecutorUnavailable(f"cannot reach a Ray cluster at {address}: {exc}".splitlines()[0]) from None

    # -- actors ---------------------------------------------------------------------------------
    def _spawn(self) -> None:
        handle = self.ray.remote(num_cpus=1, max_restarts=0)(_Worker).options(scheduling_strategy="SPREAD").remote(
            *self._actor_args)
        actor = _Actor(handle)
        self._starting[handle.where.remote()] = actor

    def _started(self, ref) -> None:
        actor = self._starting.pop(ref)
        try:
            actor.node, actor.pid = self.ray.get(ref)
        except _lost_worker():  # it died while starting: start another
            self._spawn()
            return
        self._actors.append(actor)
        self._idle.extend([actor] * SLOTS)

    def wait_for_workers(self, n: int | None = None, timeout_s: float = START_TIMEOUT_S) -> int:
        """Wait until `n` actors (default: all) are ready, or `timeout_s`; the number ready. A compile
        need not wait (tasks go to the actors as they come up); a benchmark times a warm cluster."""
        n = self.size if n is None else n
        deadline = time.perf_counter() + timeout_s
        while len(self._actors) < n and self._starting and time.perf_counter() < deadline:
            done, _ = self.ray.wait(list(self._starting), num_returns=1,
                                    timeout=max(0.0, deadline - time.perf_counter()))
            for ref in done:
                self._started(ref)
        return len(self._actors)

    def worker_pids(self) -> list[int]:
        """The processes of the ready actors (tests kill one)."""
        return [a.pid for a in self._actors]

    # -- tasks ----------------------------------------------------------------------------------
    def payload(self, task: RunTask) -> tuple:
        """What travels with a task: the program as LLIR data, its inputs as refs, the symbol bindings."""
        return (program_to_data(task.program), tuple({n: self._inputs.ref(v) for n, v in b.items()} for b in task.batches),
                tuple(dict(b) for b in task.bindings))

    def map(self, tasks: Sequence[RunTask]) -> list:
        if self._interrupted:  # after Ctrl-C the actors are gone: what is left runs here
            return [run_caught(t, self.weights)[0] for t in tasks]
        payloads = [self.payload(t) for t in tasks]
        results: list = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        running: dict[object, tuple[int, _Actor, float]] = {}  # result ref -> (task, actor, dispatched at)
        self.progress.submitted(len(tasks))
        waiting_since = time.perf_counter()
        try:
            with HeldInterrupts() as held:
                while queue or running:
                    held.check()
                    self._step(queue, running, payloads, results)
                    if running:
                        waiting_since = time.perf_counter()
                    elif time.perf_counter() - waiting_since > START_TIMEOUT_S:
                        raise ExecutorUnavailable(f"no Ray worker alive for {START_TIMEOUT_S:.0f} s: the cluster "
                                                  f"has no free CPU for the compile's actors")
        except KeyboardInterrupt:  # the actors (and their tasks) are stopped when the compile closes the pool
            self._interrupted = True
            raise
        return results

    def _step(self, queue: deque, running: dict, payloads: list, results: list) -> None:
        """Hand idle actors the next tasks, then take what finished (a result, a lost worker, an actor up)."""
        while queue and self._idle:
            i, actor = queue.popleft(), self._idle.popleft()
            running[actor.handle.run.remote(*payloads[i])] = (i, actor, time.perf_counter())
            self.progress.started(actor.node)
        done, _ = self.ray.wait(list(running) + list(self._starting), num_returns=1, timeout=WAIT_S)
        for ref in done:
            if ref in self._starting:
                self._started(ref)
                continue
            i, actor, t0 = running.pop(ref)
            try:
                out, own, extra = self.ray.get(ref)
            except _lost_worker():  # its actor or node died: run the task again on another actor
                self.times.retries += 1
                self.progress.lost(actor.node)
                queue.appendleft(i)
                if actor in self._actors:  # its other task fails the same way: one replacement
                    self._actors.remove(actor)
                    self._idle = deque(a for a in self._idle if a is not actor)
                    self._spawn()
                continue
            now = time.perf_counter()
            results[i] = unpacked(out)
            # from when the actor could start it (its previous result, or the dispatch) to its result here
            self.times.add(own, now - max(t0, actor.last_result), extra)
            actor.last_result = now
            self.progress.finished(actor.node)
            self._idle.append(actor)

    def _kill_actors(self) -> None:
        for actor in [*self._actors, *self._starting.values()]:
            self.ray.kill(actor.handle)
        self._actors.clear()
        self._idle.clear()
        self._starting.clear()

    def close(self) -> None:
        self.progress.close()
        if self.ray.is_initialized():
            self._kill_actors()
        self._inputs.clear()
        self._actor_args = None
        if self._connected:  # also after a ray.init cut short: what it started is stopped
            self.ray.shutdown()  # the driver leaves the cluster (and stops it, when it started it)
            self._connected = False

    def __enter__(self) -> "RayPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InputRefs:
    """Task inputs in the object store, put once per content (a chunk's FP64 boundary values are the same
    for every candidate); the least recently used are dropped past INPUT_CACHE_BYTES."""

    def __init__(self, ray):
        self.ray = ray
        self.refs: OrderedDict[str, tuple[object, int]] = OrderedDict()  # content key -> (ref, bytes)
        self.bytes = 0
        # the key of an array already hashed, while that array lives: the same reference values come with
        # every candidate's task, and hashing megabytes per task sat on the driver's dispatch path
        self._keys: dict[int, tuple[weakref.ref, str]] = {}

    def _key(self, a: np.ndarray) -> str:
        known = self._keys.get(id(a))
        if known is not None and known[0]() is a:
            return known[1]
        key = content_key(a)
        try:
            self._keys[id(a)] = (weakref.ref(a, lambda _, i=id(a): self._keys.pop(i, None)), key)
        except TypeError:  # not weak-referenceable: hashed each time
            pass
        return key

    def ref(self, a: np.ndarray):
        key = self._key(a)
        if key in self.refs:
            self.refs.move_to_end(key)
            return self.refs[key][0]
        ref = self.ray.put(np.asarray(a))
        self.refs[key] = (ref, a.nbytes)
        self.bytes += a.nbytes
        while self.bytes > INPUT_CACHE_BYTES and len(self.refs) > 1:
            _, (_, n) = self.refs.popitem(last=False)
            self.bytes -= n
        return ref

    def clear(self) -> None:
        self.refs.clear()
        self._keys.clear()
        self.bytes = 0


def _local_cluster_args(weights: Mapping[str, np.ndarray], address: str | None) -> dict:
    """A cluster started for this compile: an object store for the weights and inputs, no more (Ray's
    default takes 30% of the machine's memory, which the compile's memory budget does not count)."""
    if address is not None:
        return {}
    total = sum(int(np.asarray(w).nbytes) for w in weights.values())
    return {"object_store_memory": max(256 << 20, 2 * total + INPUT_CACHE_BYTES)}
