"""Ctrl-C while the command line's modules load: one line and exit 130, as an interrupt anywhere else.

Why: `luminal-num` spends a second or two importing numpy, pandas and matplotlib before `main` runs, and a
Ctrl-C there printed an import traceback (exit 1 or a raw SIGINT death). cli.py imports this module
first, which installs a handler for those imports only, and calls `release` once they are done (main
then turns a KeyboardInterrupt into one line). Nothing has been opened or written while it is installed,
so the handler ends the process at once. An ignored SIGINT (a shell's background job) stays ignored.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_INTERRUPTED = 130  # cli.EXIT_INTERRUPTED: the same code as an interrupt during a command


def _interrupted_while_starting(signum, frame) -> None:
    sys.stderr.write("interrupted: stopped while starting; nothing written\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


_BEFORE = signal.getsignal(signal.SIGINT)
_INSTALLED = threading.current_thread() is threading.main_thread() and _BEFORE is signal.default_int_handler
if _INSTALLED:
    signal.signal(signal.SIGINT, _interrupted_while_starting)


def release() -> None:
    """The imports are done: Ctrl-C raises KeyboardInterrupt again (unless someone else took SIGINT meanwhile)."""
    if _INSTALLED and signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, _BEFORE)
