"""trim_heap hands a fragmented heap's free pages back (runtime/heap.py).

The pattern is a chunk run's: after one large block is freed, glibc serves 1-32 MiB blocks from the heap,
and small blocks allocated between them keep the freed space from shrinking the heap's top.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from luminal_num.runtime.heap import _malloc_trim

SCRIPT = textwrap.dedent("""
    import os, numpy as np
    from luminal_num.runtime.heap import trim_heap
    def private_mb():
        for line in open(f"/proc/{os.getpid()}/smaps_rollup"):
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) / 1024
    big = np.ones(2 << 20)
    del big                                               # a 16 MiB block freed: the mmap threshold rises to it
    blocks, pins = [], []
    for _ in range(100):
        blocks.append(np.ones(2 << 17))                   # 2 MiB each, from the heap now
        pins.append(np.ones(64))                          # a small live block after each
    del blocks
    before = private_mb()
    assert trim_heap()
    print(before, private_mb())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc's malloc_trim")
def test_trim_returns_the_free_pages_of_a_fragmented_heap():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    before, after = map(float, out.split())
    assert before - after > 150, (before, after)  # of the 200 MiB freed between live blocks


def test_trim_is_harmless_where_nothing_is_free():
    import numpy as np
    from luminal_num.runtime.heap import trim_heap
    a = np.arange(1000.0)
    trim_heap()
    trim_heap()
    assert a.sum() == 499500.0
