"""The megakernel on a CUDA device: one persistent kernel runs a whole program's work queue (issue 33).

Why a runtime of its own: the kernel-by-kernel CUDA runtime shares buffer slots between values whose
lives do not overlap in program order, which is sound only when kernels run one after another. In the
megakernel, tiles of different ops run at once under barriers that order only producer -> consumer
(read after write), so a slot reused by a later op could be overwritten while an earlier op still reads
it. Here every LLIR value gets its own device buffer (an in-place kernel keeps its destination's, as
everywhere). Gemms run their own tiled bodies (never cuBLAS: a library call cannot be inlined); a Gemm
the kernel-by-kernel runtime runs dequantize-on-load runs that body here too, on the weight's stored
parts (uploaded as kernel by kernel), every other Gemm on a stored weight runs its tiled body on those
parts, and any other reader of a stored weight (an embedding Gather) reads it widened.

Per run: the queue's table for the run's shapes (`MegakernelSource.table`), the weight prefetch rows
(`MegakernelSource.prefetch_rows`: which weight bytes each Gemm tile loads into L2 before its wait), the KV-cache
spans (`MegakernelSource.cache_spans`: which cache rows each attention tile loads into L2 before its wait), one
private copy per block of the largest row op a GEMV's tiles recompute (codegen/megakernel.py) and of the largest
A scales they compute privately, zeroed barrier counters and
queue head, then one launch of `ln_megakernel` on a grid of co-resident blocks. The loop's spin on a
barrier gives up after LN_MK_SPIN_LIMIT tries and traps, so a wrong barrier ends the kernel with an
error instead of hanging the device.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..codegen import nvrtc
from ..codegen.llir import Program
from ..codegen.megakernel import build_queue
from ..codegen.megakernel_cuda import BLOCK_THREADS, ENTRY_NAME, render_megakernel
from .buffers import BufferPlan
from .cpu import RunResult
from .cuda import CudaRuntime, _Prepared

# The C structs of the interpreter loop (codegen/megakernel_loop.LOOP), in their C layout.
OP_DTYPE = np.dtype([("body", np.int32), ("first_entry", np.int64), ("tiles", np.int64),
                     ("gx", np.int32), ("gy", np.int32), ("gz", np.int32),
                     ("bx", np.int32), ("by", np.int32), ("bz", np.int32),
                     ("counter_base", np.int64), ("stride", np.int32), ("wait_begin", np.int32),
                     ("wait_end", np.int32), ("elements", np.int64), ("prefetch_begin", np.int32),
                     ("prefetch_end", np.int32), ("recompute", np.int32), ("private_slot", np.int32),
                     ("span_begin", np.int32), ("span_per_tile", np.int32), ("scale_recompute", np.int32),
                     ("scale_slot", np.int32)], align=True)
WAIT_DTYPE = np.dtype([("producer", np.int32), ("read_elements", np.int64)], align=True)
PREFETCH_DTYPE = np.dtype([("row_bytes", np.int64), ("rows", np.int64), ("per", np.int64), ("offset", np.int64),
                           ("n_out", np.int64), ("slot", np.int32)], align=True)
SPAN_DTYPE = np.dtype([("first", np.int64), ("between", np.int64), ("keys", np.int64), ("per_key", np.int64),
                       ("slot", np.int32)], align=True)
PRIVATE_ALIGN = 256  # each block's own copy of a recomputed row op starts on its own 256 bytes


def private_buffers(program: Program, bindings: Mapping[str, int]) -> BufferPlan:
    """One slot per value (no reuse); an aliasing kernel (in-place scatter) writes its destination's."""
    slot_of: dict[int, int] = {}
    slot_bytes: list[int] = []
    for k in program.kernels:
        need = max(int(k.numel(bindings) * k.dtype.storage.itemsize), 1)
        if k.aliases is not None:
            slot = slot_of[k.inputs[k.aliases].buffer]
            slot_bytes[slot] = max(slot_bytes[slot], need)
        else:
            slot = len(slot_bytes)
            slot_bytes.append(need)
        slot_of[k.id] = slot
    return BufferPlan(slot_of, tuple(slot_bytes), sum(slot_bytes))


class MegakernelCudaRuntime(CudaRuntime):
    """Executes a Program as one persistent megakernel on CUDA device 0; `run` returns the outputs and
    the kernel's CUDA-event time as the one (pseudo) kernel's seconds."""

    def __init__(self, program: Program, weights: Mapping[str, np.ndarray] | None = None,
                 blocks_per_sm: int | None = None):
        # the Gemms on stored weights (self.stored_readers) read the weights' stored parts, inlined as
        # bodies of the megakernel; any other reader of a stored weight reads it widened, as kernel by kernel
        super().__init__(program, weights, gemm="kernel")
        self.queue = build_queue(program)
        self.mega = render_megakernel(program, self.queue)
        compiled = nvrtc.compile_cuda(self.mega.source, self.mega.name, self.arch)
        module = self.cp.cuda.function.Module()
        module.load(compiled.cubin)
        self._modules[self.mega.name] = module
        self.entry = module.get_function(ENTRY_NAME)
        device = self.cp.cuda.Device()
        self.sm_count = int(device.attributes["MultiProcessorCount"])
        if blocks_per_sm is None:
            blocks_per_sm = self._resident_blocks_per_sm()
        if blocks_per_sm < 1:
            raise RuntimeError(f"{ENTRY_NAME}: not one block of {BLOCK_THREADS} threads fits on an SM")
        self.grid = self.sm_count * blocks_per_sm

    def _resident_blocks_per_sm(self) -> int:
        try:
            from cupy.cuda import driver
            return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(self.entry.ptr, BLOCK_THREADS, 0))
        except (ImportError, AttributeError):  # older CuPy: one block per SM is co-resident by construction
            return 1

    def _plan(self, bindings: dict[str, int]) -> BufferPlan:
        return private_buffers(self.program, bindings)

    def _slot_pointers(self, state: _Prepared) -> np.ndarray:
        """bufs[]: LLIR values, then what render_megakernel gave each further slot (MegakernelSource.uses):
        a scratch, a dyn_dims array, or a stored weight's part."""
        pointers = np.zeros(self.mega.slots, dtype=np.uint64)
        for k in self.program.kernels:
            pointers[k.id] = state.slots[state.plan.slot_of[k.id]].data.ptr
        for use in self.mega.uses:
            if use.part is not None:
                pointer = state.parts[use.kernel][use.part]
            elif use.index is not None:
                pointer = state.scratch[(use.kernel, use.index)]
            else:
                pointer = state.dyn[self.sources[use.kernel].dyn_values(state.bindings)]
            pointers[use.slot] = pointer.data.ptr
        return pointers

    def _tables(self, state: _Prepared):
        rows, waits = self.mega.table(self.queue, state.bindings)
        ops = np.array(rows, dtype=OP_DTYPE)
        wait_rows = np.array(waits if waits else [(0, 0)], dtype=WAIT_DTYPE)
        prefetch = self.mega.prefetch_rows()
        prefetch_rows = np.array(prefetch if prefetch else [(0, 0, 1, 0, 0, 0)], dtype=PREFETCH_DTYPE)
        spans = self.mega.cache_spans(self.queue, state.bindings)
        span_rows = np.array(spans if spans else [(0, 0, 0, 0, 0)], dtype=SPAN_DTYPE)
        counters = int(sum(r[2] if r[10] else 1 for r in rows))
        total = int(sum(r[2] for r in rows))
        return ops, wait_rows, prefetch_rows, span_rows, counters, total

    def run(self, inputs: Mapping[str, np.ndarray], bindings: Mapping[str, int] | None = None,
            repeats: int = 1) -> RunResult:
        """Upload, then launch the megakernel `repeats` times (counters and head zeroed before each);
        the reported seconds are the median CUDA-event time of one launch."""
        cp = self.cp
        state = self._start(inputs, bindings)
        ops, waits, prefetch, spans, n_counters, total = self._tables(state)
        with self.stream:
            for kid in state.staged:  # an input sharing its slot with an in-place writer (a KV cache): copied in
                self._enqueue_kernel(state, self.kernels[kid])
            d_ops = self._device_copy(state, ops.view(np.uint8))
            d_waits = self._device_copy(state, waits.view(np.uint8))
            d_prefetch = self._device_copy(state, prefetch.view(np.uint8))
            d_spans = self._device_copy(state, spans.view(np.uint8))
            d_bufs = self._device_copy(state, self._slot_pointers(state))
            aligned = lambda n: -(-n // PRIVATE_ALIGN) * PRIVATE_ALIGN  # noqa: E731
            split = aligned(self.mega.private_bytes(self.program, self.queue, state.bindings))
            scale = aligned(self.mega.private_scale_bytes(self.queue, state.bindings))
            private = split + scale  # per block: its recomputed row op's copy, then its private A scales
            privates = cp.zeros(max(self.grid * private, 1), dtype=cp.uint8)  # a recomputing block's own copies
            counters = cp.zeros(max(n_counters, 1), dtype=cp.uint32)
            head = cp.zeros(1, dtype=cp.uint64)
            seconds = []
            for _ in range(repeats):
                counters.fill(0)
                head.fill(0)
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(self.stream)
                self.entry((self.grid,), (BLOCK_THREADS,),
                           (d_ops, np.int32(len(ops)), d_waits, d_prefetch, d_spans, counters, head, np.uint64(total), d_bufs,
                            privates, np.int64(private), np.int64(split)),
                           stream=self.stream)
                end.record(self.stream)
                end.synchronize()
                seconds.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        self.stream.synchronize()
        self.state = state  # kept: a caller may read any value (`_read`) to find the first wrong op
        timing = ((-1, float(np.median(seconds))),)
        return RunResult(self._outputs(state), timing, state.plan)
