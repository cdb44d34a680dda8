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


def test_a_ctrl_c_dropped_before_the_search_stops_the_compile_at_its_next_stage(monkeypatch):
    """The CI failure: dropped while the Ray cluster's actors started, the note was cleared when the search
    began, and the compile ran to exit 0. Now it is raised before the next stage: nothing is returned."""
    job = transformer_job(2)
    from luminal_num import compiler
    real = compiler.reference_stage
    stages_run = []

    def reference_stage(*args, **kwargs):
        refs = real(*args, **kwargs)
        with _handler_installed():
            class Finalized:
                def __del__(self):
                    try:
                        signal.raise_signal(signal.SIGINT)
                    except KeyboardInterrupt:
                        pass  # dropped, as Python drops it in a finalizer
            Finalized()
        return refs
    monkeypatch.setattr(compiler, "reference_stage", reference_stage)
    interrupts.handled()
    try:
        with pytest.raises(KeyboardInterrupt):
            compile_plan(job.graph, Budget.parse(job.default_budget), "h200", job.calibration,
                         SearchOptions(max_candidates=40, progress=False, workers=1),
                         on_stage=lambda name, s: stages_run.append(name))
        assert stages_run == ["partition", "saturate", "reference"], stages_run  # no headroom probe, no search
    finally:
        interrupts.handled()


def test_a_note_from_an_earlier_command_is_cleared_when_the_next_begins():
    interrupts.handled()
    with pytest.raises(KeyboardInterrupt):
        interrupts.handler(signal.SIGINT, None)
    assert interrupts.pending()
    with interrupts.noted():
        assert not interrupts.pending()
    interrupts.handled()


class _handler_installed:
    """The CLI's handler for a while (pytest's own SIGINT handler otherwise)."""

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, interrupts.handler)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)
