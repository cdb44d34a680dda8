"""A Ctrl-C that lands in a finalizer is printed as "Exception ignored" and dropped by Python; the CLI's
handler notes it, and the search raises it at its next candidate (it ran to exit 0 before)."""
from __future__ import annotations

import signal

import pytest

from luminal_num import interrupts
from luminal_num.compiler import compile as compile_plan
from luminal_num.error.budget import Budget
from luminal_num.models.registry import transformer_job
from luminal_num.search.search import SearchOptions


def test_a_ctrl_c_swallowed_by_a_finalizer_stops_the_search_at_its_next_candidate(monkeypatch):
    job = transformer_job(2)
    previous = signal.signal(signal.SIGINT, interrupts.handler)
    try:
        class Finalized:
            def __del__(self):  # where a SIGINT can land: its KeyboardInterrupt is "ignored"
                try:
                    signal.raise_signal(signal.SIGINT)
                except KeyboardInterrupt:
                    pass  # what Python does with an exception raised in a finalizer: drop it

        from luminal_num.search import search as search_module
        real = search_module.Searcher.evaluate
        calls = []

        def evaluate(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                Finalized()  # freed at once: the interrupt is raised and dropped inside __del__
            return real(self, *args, **kwargs)
        monkeypatch.setattr(search_module.Searcher, "evaluate", evaluate)
        result = compile_plan(job.graph, Budget.parse(job.default_budget), "h200", job.calibration,
                              SearchOptions(max_candidates=40, progress=False, workers=1))
        stats = result.search.stats
        assert stats.interrupted and stats.candidates <= 4, stats.candidates
        interrupts.check()  # handled by the search: nothing left pending
    finally:
        signal.signal(signal.SIGINT, previous)
        interrupts.handled()


def test_without_a_pending_ctrl_c_the_check_raises_nothing():
    interrupts.handled()
    interrupts.check()
    with pytest.raises(KeyboardInterrupt):
        interrupts.handler(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        interrupts.check()
    interrupts.handled()
    interrupts.check()
