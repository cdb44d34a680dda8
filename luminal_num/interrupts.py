"""Ctrl-C that a finalizer cannot swallow.

Python's SIGINT handler raises KeyboardInterrupt in whatever Python code runs when the signal lands; inside a
weakref callback or a __del__ (numpy, Ray and the caches run many) the exception is printed as "Exception
ignored" and dropped, and the compile ran to exit 0 (seen in the Ray Ctrl-C test). The CLI's handler also
notes the interrupt; the compile checks the note before each stage and the search at every candidate, and
each raises what was dropped. A note lives from a command's start (noted()) until a KeyboardInterrupt is
acted on (handled()), so one dropped while the Ray cluster starts is not forgotten when the search begins.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_pending = False


def handler(signum, frame) -> None:
    """SIGINT: noted, then raised as Python's own handler would."""
    global _pending
    _pending = True
    raise KeyboardInterrupt


@contextmanager
def noted():
    """While a command runs: SIGINT noted as well as raised. In the main thread, over Python's default handler
    only (an ignored SIGINT stays ignored); the previous handler comes back after."""
    handled()  # a note left by an earlier command in this process is not this one's Ctrl-C
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def check() -> None:
    """Raise a Ctrl-C that arrived but was dropped on its way (noted and not yet handled)."""
    if _pending:
        raise KeyboardInterrupt


def pending() -> bool:
    """A Ctrl-C was noted and nothing has acted on it yet."""
    return _pending


def handled() -> None:
    """A KeyboardInterrupt was caught and acted on: nothing is pending."""
    global _pending
    _pending = False


def python_handlers() -> tuple:
    """The handlers that raise KeyboardInterrupt (code that takes SIGINT over for a while accepts either)."""
    return signal.default_int_handler, handler
