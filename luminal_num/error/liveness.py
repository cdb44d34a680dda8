"""When the static analysis may drop a buffer's bound (error/static.py): after the last kernel that may read it.

Why: a 30-layer model's bounds (interval ends, errors, row norms per buffer, FP64 copies of the weights) do not
fit beside the model if all are held to the end; a few layers' worth at a time do.
"""
from __future__ import annotations

from ..codegen.llir import KernelKind, Program


def last_readers(program: Program) -> dict[int, list[int]]:
    """Kernel index -> the buffers no later kernel reads (an unread buffer: its own kernel's). A kernel reads
    its inputs' bounds, and the norm pattern (error/normalize.py) also reaches back through elementwise kernels
    to a SUM kernel, reading that SUM's bound and its inputs': those count as read by the kernel the pattern
    starts from."""
    by_id = {k.id: k for k in program.kernels}
    sums: dict[int, frozenset[int]] = {}  # per elementwise kernel: the SUM kernels reached through elementwise ones
    last: dict[int, int] = {}
    for i, k in enumerate(program.kernels):
        last[k.id] = i  # a buffer no kernel reads (a weight read only through its concatenation) goes at once
        reached: set[int] = set()
        for inp in k.inputs:
            last[inp.buffer] = i
            src = by_id.get(inp.buffer)
            if src is None:
                continue
            if src.kind is KernelKind.SUM:
                reached.add(src.id)
            elif src.kind is KernelKind.ELEMENTWISE:
                reached |= sums.get(src.id, frozenset())
        for s in reached:
            last[s] = i
            for inp in by_id[s].inputs:
                last[inp.buffer] = i
        if k.kind is KernelKind.ELEMENTWISE:
            sums[k.id] = frozenset(reached)
    out: dict[int, list[int]] = {}
    for buf, i in last.items():
        out.setdefault(i, []).append(buf)
    return out
