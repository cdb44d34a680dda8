"""Buffer planning: liveness-based slot reuse and in-place aliasing for an LLIR program."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..codegen.llir import KernelKind, Program


@dataclass(frozen=True)
class BufferPlan:
    slot_of: dict[int, int]        # kernel id -> slot index
    slot_bytes: tuple[int, ...]
    naive_bytes: int               # one buffer per kernel, for comparison

    @property
    def total_bytes(self) -> int:
        return sum(self.slot_bytes)


class PlanningError(RuntimeError):
    pass


def plan_buffers(program: Program, bindings: Mapping[str, int], unbacked: frozenset[int] = frozenset()) -> BufferPlan:
    """Greedy best-fit reuse of dead buffers, in kernel (topological) order.

    A buffer dies after its last reader; graph outputs never die. An aliasing kernel (in-place
    scatter) takes its destination's slot, which must die at that kernel. `unbacked`: kernels whose
    value the runtime holds elsewhere and never writes to a slot (the CPU backend's weights come from
    its weight cache): they get none (a slot per weight sized the plan at the model's weights again,
    and the heap pages it reused were resident: ~0.5 GB per SmolLM2 whole-model run).
    """
    kernels = [k for k in program.kernels if k.id not in unbacked]
    last_use = {k.id: k.id for k in kernels}
    for k in kernels:
        for inp in k.inputs:
            if inp.buffer not in unbacked:
                last_use[inp.buffer] = max(last_use[inp.buffer], k.id)
    pinned = {kid for _, kid in program.outputs}
    need = {k.id: max(int(k.numel(bindings) * k.dtype.storage.itemsize), 1) for k in kernels}
    slot_of: dict[int, int] = {}
    slot_bytes: list[int] = []
    free: list[int] = []
    for k in kernels:
        if k.aliases is not None:
            dest = k.inputs[k.aliases].buffer
            if last_use[dest] != k.id or dest in pinned or dest in unbacked:
                raise PlanningError(f"kernel {k.id} overwrites buffer {dest}, which is read later")
            slot_of[k.id] = slot_of[dest]
            slot_bytes[slot_of[k.id]] = max(slot_bytes[slot_of[k.id]], need[k.id])
        else:
            fits = [s for s in free if slot_bytes[s] >= need[k.id]]
            if fits:
                s = min(fits, key=lambda i: (slot_bytes[i], i))
                free.remove(s)
            else:
                s = len(slot_bytes)
                slot_bytes.append(need[k.id])
            slot_of[k.id] = s
        for inp in k.inputs:
            b = inp.buffer
            if b in unbacked:
                continue
            if last_use[b] == k.id and b not in pinned and slot_of[b] != slot_of[k.id] and slot_of[b] not in free:
                free.append(slot_of[b])
        if last_use[k.id] == k.id and k.id not in pinned and k.kind is not KernelKind.EXTERNAL \
                and slot_of[k.id] not in free:
            free.append(slot_of[k.id])  # produced but never read (dead value)
    return BufferPlan(slot_of, tuple(slot_bytes), sum(need.values()))
