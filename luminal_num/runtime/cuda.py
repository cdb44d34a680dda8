"""The CUDA backend: LLIR on a GPU with CuPy buffers, NVRTC kernels, cuBLAS(Lt) Gemms and CUDA graphs.

Same contract as the CPU backend (runtime/cpu.py): `run(inputs, bindings) -> RunResult` with every
buffer stored in its plan dtype and the same liveness plan (runtime/buffers.py), so the two can be
compared output for output. Kernels come from codegen/cuda_kernels.py, compiled by codegen/nvrtc.py
to a CUBIN for the device's architecture (the kernel cache applies) and loaded from those bytes
(cuModuleLoadData: no temp file); when the project's NVRTC is missing, CuPy compiles the same source.
A Gemm runs through cuBLAS (cublasGemmStridedBatchedEx) or cuBLASLt (FP8 per-tensor; FP32-output bias
epilogues) when codegen
says it can and the bound call is legal, else through its fallback kernels (`gemm="kernel"` forces
those: they follow the CPU emulator's arithmetic). A Gemm whose B is a weight held in a storage format
reads the weight's stored bytes (packed codes and scales, uploaded once as the plan's weights file holds
them): a plain one in the dequantize-on-load kernel (codegen/cuda_weight_only.py), every other form in
the tiled kernel reading the stored parts (codegen/cuda_gemm.py; codegen/cuda_dispatch.py decides);
runtime/cublas.py explains why library calls go through ctypes (stream capture). A QUANTIZE kernel's scales live in its scratch (allocated per
binding, never reused by the liveness plan), where the Gemm reading its buffer finds them; a Gemm's static
(weight) scales are written into its scratch once per preparation, after the upload (`_at_load`), not per step.
`profile()` replays one CUDA graph of the whole program between CUDA events.

Stream discipline: everything (allocations, uploads, kernels, cuBLAS, downloads) is ordered on the
runtime's one non-blocking stream; nothing touches the legacy null stream, which that stream does not
wait for.

Without a GPU, constructing a CudaRuntime raises CudaUnavailableError (runtime/cuda_device.py).
"""
from __future__ import annotations

import importlib
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

from ..codegen import nvrtc
from ..codegen.cuda_dispatch import gemm_implementation, kernel_implementation
from ..codegen.cuda_kernels import SCALES_SCRATCH, Arg, KernelSource, Launch, render_kernel
from ..codegen.cuda_source import GemmCall
from ..codegen.cuda_weight_only import WeightOnlySource, stored_operand, weight_only_gemm
from ..codegen.llir import Kernel, KernelKind, Program, external_value
from ..dtypes.formats import F32, Format, Kind
from ..dtypes.rounding import to_storage
from ..quant.storage import storage_format
from ..quant.stored import stored_key, widened
from ..quant.kv import cache_values
from ..hlir.symbolic import evaluate
from .buffers import BufferPlan, plan_buffers
from .cpu import RunResult, bind_program
from .cublas import Cublas, CublasLt, Libraries, load_libraries
from .cuda_device import require_cuda
from .weight_only import stored_weight

WORKSPACE_BYTES = 32 << 20  # cuBLAS(Lt) workspace, set once on the handle: graph capture never allocates


# -- the runtime ------------------------------------------------------------------------------------------

DELAY_CYCLES = 400_000_000  # ~0.2 s at H200 clocks: the device stays busy while the host queues a run


@dataclass
class _Prepared:
    """Device state for one set of bindings: buffers, scratch, dyn-dim arrays, the enqueue steps."""

    bindings: dict[str, int]
    plan: BufferPlan
    slots: list
    staged: dict[int, object] = field(default_factory=dict)   # external kernel id -> device copy
    scratch: dict[tuple[int, int], object] = field(default_factory=dict)
    dyn: dict[tuple[int, ...], object] = field(default_factory=dict)
    graph: object = None
    host: list = field(default_factory=list)  # host arrays of pending async uploads, kept alive
    parts: dict[int, list] = field(default_factory=dict)  # stored weight id -> its parts on the device


class CudaRuntime:
    """Executes an LLIR Program on CUDA device 0. `gemm`: "auto" (cuBLAS where legal) or "kernel".

    `libraries`: the cuBLAS / cuBLASLt libraries (default: load_libraries(), after CuPy loaded its own)."""

    def __init__(self, program: Program, weights: Mapping[str, np.ndarray] | None = None, gemm: str = "auto",
                 libraries: Libraries | None = None, stored_weights: Mapping | None = None):
        found = require_cuda()
        if gemm not in ("auto", "kernel"):
            raise ValueError(f"gemm must be 'auto' or 'kernel', got {gemm!r}")
        import cupy  # an optional dependency: present once require_cuda() succeeded
        self.cp, self.program, self.weights, self.gemm_mode = cupy, program, dict(weights or {}), gemm
        self.stored_weights = dict(stored_weights or {})  # stored_key -> StoredTensor (a plan's weights file)
        self.arch = f"sm_{found.compute_capability}"
        self.kernels = {k.id: k for k in program.kernels}
        self.sources: dict[int, KernelSource] = {k.id: render_kernel(k, program) for k in program.launched()}
        # Gemms whose B is a stored weight: a dequantize-on-load kernel reading the weight's stored bytes
        self.weight_only: dict[int, WeightOnlySource] = {
            k.id: src for k in program.launched() if (src := weight_only_gemm(k, program)) is not None}
        # Gemms reading their B as its stored parts: the dequantize-on-load kernels and every other Gemm form
        # on a stored weight (the tiled kernel's launches pass the parts: Arg role "part")
        self.stored_readers = frozenset(k.id for k in program.launched() if stored_operand(k, program) is not None)
        readers: dict[int, set[int]] = {}
        for k in program.kernels:
            for i in k.inputs:
                readers.setdefault(i.buffer, set()).add(k.id)
        # not uploaded: stored weights only Gemms reading stored parts read (their widened FP32 copy), and
        # inputs nothing reads (a weight's FP32 form once the plan reads it stored)
        outputs = {kid for _, kid in program.outputs}
        self.stored_only = frozenset(k.id for k in program.kernels if k.kind is KernelKind.EXTERNAL and k.id not in outputs
                                     and readers.get(k.id, set()) <= self.stored_readers
                                     and (k.storage or not readers.get(k.id)))
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._functions: dict[str, object] = {}
        self._modules: dict[str, object] = {}
        with self.stream:
            self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
        self.stream.synchronize()
        if libraries is None:
            try:  # CuPy loads its libcublas first, so that load_libraries() finds the very copy CuPy uses
                importlib.import_module("cupy_backends.cuda.libs.cublas")  # what cupy.cuda.cublas loads
            except ImportError:  # CuPy without cuBLAS: load_libraries() searches the wheels and the system
                pass
            libraries = load_libraries()
        self.blas = Cublas(libraries.cublas, self.stream.ptr, self.workspace.data.ptr, WORKSPACE_BYTES)
        self.lt = CublasLt(libraries.cublaslt, self.workspace.data.ptr, WORKSPACE_BYTES)
        for src in self.sources.values():
            self._load(src)
        for src in self.weight_only.values():
            self._load_weight_only(src)

    def close(self) -> None:
        """Destroy the cuBLAS(Lt) handles (also on garbage collection)."""
        for binding in (getattr(self, "lt", None), getattr(self, "blas", None)):
            if binding is not None:
                binding.close()

    def __del__(self):
        self.close()

    # -- modules ----------------------------------------------------------------------------------------
    def _load(self, src: KernelSource) -> None:
        """The CUBIN from NVRTC (or its kernel cache) loaded from bytes; CuPy compiles it without our NVRTC."""
        if src.name in self._modules:
            return
        try:
            compiled = nvrtc.compile_cuda(src.source, src.name, self.arch)
            module = self.cp.cuda.function.Module()
            module.load(compiled.cubin)
        except nvrtc.NvrtcUnavailableError:  # CuPy's own NVRTC compiles the same source
            templates = Path(nvrtc.__file__).parent / "templates"
            module = self.cp.RawModule(code=src.source, options=("--std=c++17", f"-I{templates}"))
        for entry in src.entries:
            self._functions[entry] = module.get_function(entry)
        self._modules[src.name] = module

    def _load_weight_only(self, src: WeightOnlySource) -> None:
        if src.name in self._modules:
            return
        module = self.cp.cuda.function.Module()
        module.load(nvrtc.compile_cuda(src.source, src.name, self.arch).cubin)
        self._functions[src.name] = module.get_function(src.name)
        self._modules[src.name] = module

    def _stored_parts(self, state: "_Prepared", feed: Mapping[str, np.ndarray]) -> None:
        """Each stored weight a Gemm reads as its stored parts, uploaded once per preparation as its
        stored containers (packed 4-bit, scales at their stored size): the bytes the plan charges."""
        for kid in sorted(self.stored_readers):
            w = self.kernels[self.kernels[kid].inputs[1].buffer]
            if w.id in state.parts:
                continue
            fmt = storage_format(w.storage)
            stored = self.stored_weights.get(stored_key(w.external, w.storage, w.fill)) if not w.concat else None
            stored = stored or fmt.pack(stored_weight(w, feed, self.stored_weights))
            state.parts[w.id] = [self._device_copy(state, np.asarray(stored.arrays[p])) for p in fmt.parts]

    # -- buffers ----------------------------------------------------------------------------------------
    def _host_value(self, k: Kernel, value) -> np.ndarray:
        """An input as the CPU backend stores it (rounded to the plan dtype, saturating; FP32 plain)."""
        arr = np.asarray(value)
        if k.storage is not None and k.id in self.program.cache_buffers():  # a KV cache handed in: its format
            return cache_values(arr.astype(np.float32), k.storage)
        if k.storage is not None:  # the values the plan's stored weight holds, widened (a reader other than a Gemm)
            return widened(value, k.storage, self.stored_weights.get(stored_key(k.external, k.storage, k.fill)),
                           k.fill)
        if k.dtype.kind is Kind.FLOAT:
            if not np.all(np.isfinite(arr)):
                raise ValueError(f"input {k.external!r} contains NaN or Inf")
            wide = arr.astype(np.float64)
            return wide.astype(np.float32) if k.dtype is F32 else to_storage(wide, k.dtype)
        return arr.astype(k.dtype.storage)

    def _device_copy(self, state: "_Prepared", host: np.ndarray):
        """A new device array holding `host`, copied on the compute stream (the host copy is kept alive)."""
        host = np.ascontiguousarray(host)
        state.host.append(host)
        device = self.cp.empty(host.shape, dtype=host.dtype)
        device.set(host, stream=self.stream)
        return device

    def _plan(self, bindings: dict[str, int]) -> BufferPlan:
        """Buffer slots for one run: liveness reuse (kernels run one after another)."""
        return plan_buffers(self.program, bindings)

    def _prepare(self, bindings: dict[str, int]) -> "_Prepared":
        cp = self.cp
        plan = self._plan(bindings)
        state = _Prepared(dict(bindings), plan, [cp.empty(max(n, 1), dtype=cp.uint8) for n in plan.slot_bytes])
        for kid, src in self.sources.items():
            for i, scratch in enumerate(src.scratch):
                nbytes = max(int(scratch.numel(bindings) * scratch.dtype.itemsize), 1)
                state.scratch[(kid, i)] = cp.empty(nbytes, dtype=cp.uint8)
            values = src.dyn_values(bindings)
            if values and values not in state.dyn:
                state.dyn[values] = self._device_copy(state, np.asarray(values, dtype=np.int64))
        return state

    def _nbytes(self, k: Kernel, bindings) -> int:
        return int(k.numel(bindings) * k.dtype.storage.itemsize)

    def _upload(self, state: "_Prepared", feed: Mapping[str, np.ndarray]) -> None:
        """Externals with a slot of their own are written once; a shared slot gets its value copied in
        at the external's place in the program (from a staged device copy), so graphs replay correctly."""
        shared = {}
        for k in self.program.kernels:
            shared.setdefault(state.plan.slot_of[k.id], []).append(k.id)
        self._stored_parts(state, feed)
        for k in self.program.kernels:
            if k.kind is not KernelKind.EXTERNAL or k.id in self.stored_only:
                continue
            value = stored_weight(k, feed, self.stored_weights).dequantize().astype(np.float32) \
                if k.storage is not None and k.concat else self._host_value(k, external_value(k, feed))
            host = np.ascontiguousarray(value).view(np.uint8).reshape(-1)
            slot = state.slots[state.plan.slot_of[k.id]]
            if len(shared[state.plan.slot_of[k.id]]) == 1:
                state.host.append(host)
                slot[:host.size].set(host, stream=self.stream)
            else:
                state.staged[k.id] = self._device_copy(state, host)

    def _pointer(self, state: "_Prepared", kid: int, arg: Arg) -> object:
        if arg.role == "scratch":
            return state.scratch[(kid, arg.index)]
        if arg.role == "scales":  # kept beside a QUANTIZE kernel's buffer, in that kernel's scratch
            return state.scratch[(arg.buffer, SCALES_SCRATCH)]
        if arg.role == "part":  # a stored weight's part (packed codes, scales), uploaded by _stored_parts
            return state.parts[arg.buffer][arg.index]
        return state.slots[state.plan.slot_of[arg.buffer]]

    # -- enqueueing ------------------------------------------------------------------------------------
    def _launch(self, state: "_Prepared", kid: int, launch: Launch) -> None:
        grid, block = launch.config(state.bindings)
        if 0 in grid:
            return
        args = [self._pointer(state, kid, a) for a in launch.args]
        values = self.sources[kid].dyn_values(state.bindings)
        if values:
            args.append(state.dyn[values])
        self._functions[launch.entry](grid, block, tuple(args), stream=self.stream)

    def _address(self, state: "_Prepared", kid: int, arg: Arg, offset: int, fmt: Format) -> int:
        return self._pointer(state, kid, arg).data.ptr + offset * fmt.storage.itemsize

    def _gemm(self, state: "_Prepared", k: Kernel) -> bool:
        """Run a Gemm through cuBLAS(Lt); False when the call is absent, illegal for these sizes or
        (cuBLASLt) NOT_SUPPORTED, and the kernels must run (codegen/cuda_dispatch.kernel_implementation: which)."""
        src = self.sources[k.id]
        if self.gemm_mode == "kernel" or not gemm_implementation(k, self.program, state.bindings, src, False).library:
            return False
        call = src.gemm.bind(state.bindings)
        if call.api == "cublasLt":
            return self._gemm_lt(state, k, call)
        formats = {kid: self.kernels[kid].dtype for kid in (call.a.buffer, call.b.buffer)}
        a = self._address(state, k.id, call.a, call.a_offset, formats[call.a.buffer])
        b = self._address(state, k.id, call.b, call.b_offset, formats[call.b.buffer])
        c = self._address(state, k.id, call.c, 0, k.dtype)
        self.blas.gemm(call, a, b, c)
        return True

    def _gemm_lt(self, state: "_Prepared", k: Kernel, call: GemmCall) -> bool:
        ptr = lambda arg: self._pointer(state, k.id, arg).data.ptr  # noqa: E731
        bias = ptr(call.bias) if call.bias is not None else None  # offset 0 (codegen/cuda_gemm_bias.py)
        if self.lt.plan(call, bias).algo is None:
            return False
        for launch in call.prologue:
            self._launch(state, k.id, launch)
        scales = (ptr(call.a_scale), ptr(call.b_scale)) if call.a_scale is not None else None
        return self.lt.matmul(call, ptr(call.a), ptr(call.b), ptr(call.c), self.stream.ptr, scales, bias)

    def _enqueue_kernel(self, state: "_Prepared", k: Kernel) -> None:
        if k.kind is KernelKind.EXTERNAL:
            if k.id in state.staged:
                staged, runtime = state.staged[k.id], self.cp.cuda.runtime
                runtime.memcpyAsync(state.slots[state.plan.slot_of[k.id]].data.ptr, staged.data.ptr, staged.nbytes,
                                    runtime.memcpyDeviceToDevice, self.stream.ptr)
            return
        if k.id in self.weight_only:  # the weight read in its storage format, widened in registers
            src = self.weight_only[k.id]
            slot = lambda buffer: state.slots[state.plan.slot_of[buffer]]  # noqa: E731
            args = (slot(k.id), slot(k.inputs[0].buffer), *state.parts[k.inputs[1].buffer])
            self._functions[src.name](src.grid, src.block, args, stream=self.stream)
            return
        if k.kind.is_gemm and self._gemm(state, k):
            return
        src = self.sources[k.id]
        launches = src.launches
        if k.kind.is_gemm and kernel_implementation(k, self.program, state.bindings).tensor_core_kernel:
            if not src.tensor_core:
                raise RuntimeError(f"kernel {k.id}: the dispatch picks the tensor-core kernel, its source has none")
            launches = src.tensor_core
        for launch in launches:
            self._launch(state, k.id, launch)

    def _enqueue(self, state: "_Prepared") -> None:
        for k in self.program.kernels:
            self._enqueue_kernel(state, k)

    # -- public API ---------------------------------------------------------------------------------------
    def _start(self, inputs, bindings) -> "_Prepared":
        """Buffers allocated and inputs uploaded, all on the compute stream."""
        feed = {**self.weights, **inputs}
        missing = [n for n, _ in self.program.inputs if n not in feed]
        if missing:
            raise KeyError(f"missing inputs: {missing}")
        bound = {**bind_program(self.program, feed), **(bindings or {})}
        with self.stream:
            state = self._prepare(bound)
            self._upload(state, feed)
            self._at_load(state)
        return state

    def _at_load(self, state: "_Prepared") -> None:
        """Each kernel's at-load launches (a Gemm's static B scales: KernelSource.at_load), once per preparation
        after the upload: they read weights alone, and the scratch they write is what every step (and every
        replay of a captured graph) reads. A weight sharing its slot is copied in first (it is again at its
        place in the program)."""
        for kid, src in self.sources.items():
            for launch in src.at_load:
                for arg in launch.args:
                    if arg.role == "in" and self.kernels[arg.buffer].kind is not KernelKind.EXTERNAL:
                        raise ValueError(f"kernel {kid}: static scales over kernel {arg.buffer}'s output, not a weight")
                    if arg.role == "in" and arg.buffer in state.staged:
                        self._enqueue_kernel(state, self.kernels[arg.buffer])
                self._launch(state, kid, launch)

    def _read(self, state: "_Prepared", kid: int) -> np.ndarray:
        k = self.kernels[kid]
        shape = tuple(evaluate(d, state.bindings) for d in k.shape)
        raw = state.slots[state.plan.slot_of[kid]][:self._nbytes(k, state.bindings)].get(stream=self.stream)
        return raw.view(k.dtype.storage).reshape(shape).astype(np.float64)

    def _outputs(self, state: "_Prepared") -> dict[str, np.ndarray]:
        with self.stream:
            return {name: self._read(state, kid) for name, kid in self.program.outputs}

    def run(self, inputs: Mapping[str, np.ndarray], bindings: Mapping[str, int] | None = None) -> RunResult:
        """Execute once; per-kernel seconds from CUDA events around each kernel."""
        state = self._start(inputs, bindings)
        events = []
        with self.stream:
            for k in self.program.kernels:
                if k.kind.launches:
                    start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
                    start.record(self.stream)
                    self._enqueue_kernel(state, k)
                    end.record(self.stream)
                    events.append((k.id, start, end))
                else:
                    self._enqueue_kernel(state, k)
        self.stream.synchronize()
        timings = tuple((kid, self.cp.cuda.get_elapsed_time(s, e) / 1e3) for kid, s, e in events)
        return RunResult(self._outputs(state), timings, state.plan)

    def capture(self, inputs: Mapping[str, np.ndarray], bindings: Mapping[str, int] | None = None) -> "_Prepared":
        """Inputs uploaded and the whole program captured as one CUDA graph (state.graph)."""
        state = self._start(inputs, bindings)
        with self.stream:
            self._enqueue(state)  # eager once: cuBLASLt plans and lazily-initialised library state before capture
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                self._enqueue(state)
            finally:
                state.graph = self.stream.end_capture()
        return state

    def replay(self, state: "_Prepared") -> dict[str, np.ndarray]:
        """Launch the captured graph once and read the outputs."""
        state.graph.launch(self.stream)
        self.stream.synchronize()
        return self._outputs(state)

    def profile_kernels(self, inputs: Mapping[str, np.ndarray], n: int = 5,
                        bindings: Mapping[str, int] | None = None) -> dict[int, float]:
        """Median seconds of each launched kernel over `n` eager runs, with the host ahead of the device.

        Why the delay kernel: a Python launch takes longer than most decode kernels run, so events around
        a kernel enqueued as the device reaches it would time the host. A spinning kernel enqueued first
        keeps the device busy while every kernel and event is queued; then they run back to back."""
        state = self._start(inputs, bindings)
        delay = self._delay_function()
        runs: dict[int, list[float]] = {}
        with self.stream:
            self._enqueue(state)  # warm: modules loaded, cuBLASLt plans made
            self.stream.synchronize()
            for _ in range(n):
                delay((1,), (1,), (np.int64(DELAY_CYCLES),), stream=self.stream)
                events = []
                for k in self.program.kernels:
                    if not k.kind.launches:
                        self._enqueue_kernel(state, k)
                        continue
                    start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
                    start.record(self.stream)
                    self._enqueue_kernel(state, k)
                    end.record(self.stream)
                    events.append((k.id, start, end))
                self.stream.synchronize()
                for kid, start, end in events:
                    runs.setdefault(kid, []).append(self.cp.cuda.get_elapsed_time(start, end) / 1e3)
        return {kid: statistics.median(seconds) for kid, seconds in runs.items()}

    def _delay_function(self):
        if "ln_delay" not in self._functions:
            source = ('extern "C" __global__ void ln_delay(long long cycles) {\n'
                      '    const long long start = clock64();\n    while (clock64() - start < cycles) {}\n}\n')
            module = self.cp.cuda.function.Module()
            module.load(nvrtc.compile_cuda(source, "ln_delay", self.arch).cubin)
            self._modules["ln_delay"] = module
            self._functions["ln_delay"] = module.get_function("ln_delay")
        return self._functions["ln_delay"]

    def profile(self, inputs: Mapping[str, np.ndarray], n: int = 20, warmup: int = 3,
                bindings: Mapping[str, int] | None = None) -> float:
        """Median seconds of one graph replay of the whole program, timed with CUDA events."""
        state = self.capture(inputs, bindings)
        for _ in range(warmup):
            state.graph.launch(self.stream)
        seconds = []
        for _ in range(n):
            start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
            start.record(self.stream)
            state.graph.launch(self.stream)
            end.record(self.stream)
            end.synchronize()
            seconds.append(self.cp.cuda.get_elapsed_time(start, end) / 1e3)
        return statistics.median(seconds)
