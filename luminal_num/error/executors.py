"""Where a compile's verdict tasks run: this machine's process pool (default) or a Ray cluster.

A task (error/tasks.py `RunTask`) is a pure function of a lowered program and its inputs; weights are the
graph's, handed to each worker once. Every executor answers `map(tasks)` with the results in task order,
whatever order they finish in, and the judge's calibrator applies them in candidate order: so the chosen
plan, plan.json and the reports are the same bytes whichever executor ran the tasks and however many
workers it had. A task's runtime error (a REJECT overflow: ValueError/FloatingPointError) comes back as the
exception, for the caller to turn into a verdict; a worker lost mid-task costs a retry, not the compile.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, Sequence

from .tasks import RunTask, TaskProgress, TaskTimes


class ExecutorKind(enum.Enum):
    LOCAL = "local"  # forked processes of this machine (error/tasks.py TaskPool)
    RAY = "ray"      # actors of a Ray cluster (error/ray_pool.py RayPool)


@dataclass(frozen=True)
class ExecutorSpec:
    """The user's choice: `address` joins a running Ray cluster ("auto" or "HOST:PORT"; None starts one
    on this machine); `workers` is the number of Ray actors (default: one per CPU of the cluster)."""
    kind: ExecutorKind = ExecutorKind.LOCAL
    address: str | None = None
    workers: int | None = None

    def __post_init__(self):
        if self.kind is not ExecutorKind.RAY and (self.address is not None or self.workers is not None):
            raise ValueError("a Ray address or worker count needs --executor ray")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"Ray workers must be >= 1, not {self.workers}")


class ExecutorUnavailable(RuntimeError):
    """The executor asked for cannot run: the ray package is missing, or its cluster cannot be reached."""


class Executor(Protocol):
    """What the judge and the chunk verdicts run their tasks on."""
    times: TaskTimes
    progress: TaskProgress

    def map(self, tasks: Sequence[RunTask]) -> list: ...

    def close(self) -> None: ...
