"""Memory of a process tree over time: what a compile (parent and pool workers) really occupies.

Why PSS: forked workers share the parent's pages (weights, inherited caches) copy-on-write, so adding
their RSS counts those pages once per process; the proportional set size splits each shared page among
the processes that map it, so the sum over the tree is what the machine gives them. The sum of RSS is
recorded too (the upper bound `/usr/bin/time -v`-style readings approach), and the largest single RSS.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def tree(pid: int) -> list[int]:
    """pid and all its descendants (now)."""
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _rollup(pid: int) -> tuple[int, int]:
    """(Rss, Pss) in bytes of one process, (0, 0) when it is gone."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss


@dataclass
class Sample:
    t: float
    pss: int       # summed over the tree
    rss_sum: int   # summed over the tree (counts shared pages once per process)
    rss_max: int   # the largest single process
    processes: int


@dataclass
class MemWatch:
    """Samples a process tree every `period` seconds in a thread while in a `with` block."""

    pid: int = field(default_factory=os.getpid)
    period: float = 0.25
    samples: list[Sample] = field(default_factory=list)

    def sample(self) -> Sample:
        rolls = [_rollup(p) for p in tree(self.pid)]
        s = Sample(time.monotonic(), sum(p for _, p in rolls), sum(r for r, _ in rolls),
                   max((r for r, _ in rolls), default=0), len(rolls))
        self.samples.append(s)
        return s

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def __enter__(self) -> "MemWatch":
        self._stop = threading.Event()
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    @property
    def peak_pss(self) -> int:
        return max(s.pss for s in self.samples)

    @property
    def peak_rss_sum(self) -> int:
        return max(s.rss_sum for s in self.samples)

    @property
    def peak_rss_max(self) -> int:
        return max(s.rss_max for s in self.samples)
