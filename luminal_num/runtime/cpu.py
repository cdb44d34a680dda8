"""The CPU backend: executes LLIR with numpy, each buffer stored in its plan dtype.

It is the reference executor of the numerics gate, so it must compute exactly what the plan says:
every fused elementwise op is one correctly rounded FP32 operation; stores round to the buffer's
format; Gemm and reduction variants are emulated bit-exactly by runtime/numerics.py. A QUANTIZE
kernel stores q in its format and keeps the scales beside it (per run, keyed by its kernel id); a
Gemm reading its buffer multiplies q with those scales, as the GPU does.

Speed without changing a bit (issue 18): fused bodies are evaluated in float32 where that gives
the float64-then-round values, each value once per run (runtime/cpu_bodies.py); reads and bodies are
compiled once per runtime (runtime/cpu_compiled.py); a kernel's last op, an FP32 Gemm's C, writes
straight into its output buffer where it can, and the buffers are kept for the next run; FP32 Gemm
operands go to BLAS uncopied where numpy would treat the copy alike (runtime/cpu_gemm.py). Weights
are stored once per process (hlir.weightcache), and so are the Gemm B operands read from them.
Each kernel kind is one function in KERNELS.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from ..codegen.llir import FApply, FConstV, FLoad, Kernel, KernelKind, Program, epilogue_as_elementwise, external_value
from ..dtypes.codec import encode_into
from ..dtypes.formats import F32, get as get_format
from ..dtypes.rounding import store
from ..hlir.evaluate import softmax
from ..hlir.symbolic import bind_shapes, evaluate as eval_dim
from ..hlir.store import STREAMING, WeightArray, digest, keyed
from ..hlir.weightcache import WEIGHTS, ByteLRU
from ..quant.codes import quantize_into_codes
from ..quant.concat import concat_widened
from ..quant.kv import cache_values
from ..quant.quantize import quantize_tensor
from ..quant.calibration import hessian_of
from ..quant.stored import stored_key, widened
from .buffers import BufferPlan, plan_buffers
from .cpu_attention import run_attention
# the tables and body evaluators are named here too, where the tests and other stages look for them
from .cpu_bodies import (CORRECTLY_ROUNDED_F32, F32_EXACT_CUSTOM, SHARED_BYTES, body32 as _body32,  # noqa: F401
                         body64 as _body64, body_into_out, body_values, read64, read_input, reduce_sum,
                         rows_values, store32)
from .cpu_compiled import KernelCache
from .cpu_inputs import f32_into, store_input
from .cpu_outputs import Float64Outputs
from .cpu_pages import PageReleases, external_last_reads, page_releases
from .cpu_softmax import softmax_f64_into
from .cpu_gemm import quantize_input, run_gemm, run_quantize  # noqa: F401 (run_quantize: named here for the tests)
from . import fixed_gemm
from .fixed_gemm import FixedOrderUnavailable


@dataclass(frozen=True)
class RunResult:
    outputs: Mapping[str, np.ndarray]              # float64 copies of the stored values (each made when first read)
    kernel_seconds: tuple[tuple[int, float], ...]  # (kernel id, seconds) for launched kernels
    plan: BufferPlan
    exports: dict[int, np.ndarray] | None = None   # graph node id -> value (when asked for)

    @property
    def total_seconds(self) -> float:
        return sum(s for _, s in self.kernel_seconds)


def bind_program(program: Program, inputs: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Symbolic dims from the shapes of the program's inputs (the same rule as Graph.bind_symbols)."""
    declared = {name: program.kernels[kid].shape for name, kid in program.inputs}
    return bind_shapes(declared, {n: np.shape(a) for n, a in inputs.items()})


@dataclass
class _Run:
    """The state of one run: stored buffers, QUANTIZE scales, the feed and the shape bindings."""
    stored: dict[int, np.ndarray]
    scales: dict[int, np.ndarray]
    feed: Mapping[str, np.ndarray]
    bindings: Mapping[str, int]
    weight_names: frozenset[str]  # feed entries that are the runtime's (immutable) weights
    compiled: KernelCache         # the runtime's compiled reads and fused bodies
    out: np.ndarray | None = None  # the running kernel's output buffer (a kernel may write into it)
    # fused-body values by what they compute (structure, loads as (buffer, view)), for the next
    # kernels: fusion recomputes a layer norm's input in its mean, variance and output kernels
    shared: ByteLRU = field(default_factory=lambda: ByteLRU(SHARED_BYTES))


@dataclass
class _Pending:
    """One batch's run in progress (CpuRuntime.run_many): its state, buffer plan, output views, the
    exports it keeps and its kernel timings."""
    state: _Run
    key: tuple
    plan: BufferPlan
    outs: dict[int, np.ndarray]
    wanted: set[int]
    timings: list[tuple[int, float]]
    exports: dict[int, np.ndarray]


class CpuRuntime:
    def __init__(self, program: Program, weights: Mapping[str, np.ndarray] | None = None,
                 static_scales: Mapping[int, np.ndarray] | None = None, stored_weights: Mapping | None = None):
        """`static_scales`: Gemm kernel id -> B's compile-time scales (a plan's scales file); without
        them static scales are computed from the weights, which gives the same values.
        `weights` are treated as immutable: values derived from them are cached per process."""
        if program.batch_invariant and not fixed_gemm.available():
            raise FixedOrderUnavailable("a batch-invariant plan needs the fixed-order Gemm kernel, which needs numba "
                                        "(installed, and LUMINAL_NUM_JIT not 0)")
        self.program = program
        self.weights = {n: keyed(w) for n, w in (weights or {}).items()}  # what is derived: cached by content
        self.static_scales = dict(static_scales or {})
        self._plans: dict[tuple, BufferPlan] = {}
        self.stored_weights = dict(stored_weights or {})  # stored_key -> StoredTensor (a plan's weights file)
        self._held_digests: dict[str, str] = {}  # stored_key -> digest of a filled weight's file entry
        self._widened: dict[str, np.ndarray] = {}  # stored_key -> its widened values (read-only)
        self._concats: dict[str, np.ndarray] = {}  # concatenated weights (immutable: built once per runtime)
        self._epilogues: dict[int, Kernel] = {}  # Gemm epilogue kernel id -> its body as an ELEMENTWISE kernel
        self._compiled = KernelCache()
        # the last run's output buffers (bindings key -> kernel id -> its view of a slot), for the next
        # run of the same shapes: no fresh pages to fault in, the same arrays for compiled reads; and that
        # run's outputs (cpu_outputs.Float64Outputs), settled before the buffers are reused
        self._outputs: tuple[tuple, dict[int, np.ndarray], weakref.ref] | None = None
        self._drops: dict[int, tuple[int, ...]] | None = None  # kernel id -> EXTERNALs it reads last
        self._releases: PageReleases | None = None  # streaming (hlir.store.STREAMING): which pages go when

    def run(self, inputs: Mapping[str, np.ndarray], bindings: Mapping[str, int] | None = None,
            keep_exports: bool = False) -> RunResult:
        return self.run_many([inputs], [bindings], keep_exports)[0]

    def run_many(self, batches: Sequence[Mapping[str, np.ndarray]],
                 bindings: Sequence[Mapping[str, int] | None] | None = None,
                 keep_exports: bool = False) -> list[RunResult]:
        """run() of each batch, kernel by kernel over all of them: a weight's stored form or Gemm operand
        the cache cannot keep is made once for every batch (WEIGHTS.step), not once per batch. Each
        batch's results are the ones its own run() gives. `bindings`: one mapping (or None) per batch."""
        each = [None] * len(batches) if bindings is None else list(bindings)
        if len(each) != len(batches):
            raise ValueError(f"{len(batches)} batches but {len(each)} bindings")
        runs = [self._begin(inputs, bind, keep_exports, reuse=(i == 0))
                for i, (inputs, bind) in enumerate(zip(batches, each))]
        drops = self._weight_drops()
        if STREAMING.on and self._releases is None:
            self._releases = page_releases(self.program, self.weights)
        try:
            with np.errstate(all="ignore"), STREAMING.by_last_reader():
                for k in self.program.kernels:
                    dropped: list[np.ndarray] = []
                    with WEIGHTS.step():
                        for r in runs:
                            self._step(r, k, drops, dropped)
                    if STREAMING.on:  # after every batch ran k: no later kernel of the run reads these pages
                        STREAMING.release(self._releases.after.get(k.id, ()))
                        STREAMING.release(v for v in dropped if self._releases.foreign(v))
        finally:  # the makers close over the run's state: a cycle that held every buffer of the run (and the
            for r in runs:  # runtime) until the cyclic GC came by: GBs in a pool worker between collections
                r.state.stored.make = {}
        out = []
        for r in runs:
            outputs = Float64Outputs({name: r.state.stored[kid] for name, kid in self.program.outputs})
            out.append(RunResult(outputs, tuple(r.timings), r.plan, r.exports if keep_exports else None))
        self._outputs = (runs[0].key, runs[0].outs, weakref.ref(out[0].outputs))
        return out

    def _begin(self, inputs: Mapping[str, np.ndarray], bindings: Mapping[str, int] | None, keep_exports: bool,
               reuse: bool) -> "_Pending":
        """One batch's run, before its first kernel (`reuse`: it may take the last run's output buffers)."""
        feed = _Feed({**self.weights, **inputs})
        missing = [n for n, _ in self.program.inputs if n not in feed]
        if missing:
            raise KeyError(f"missing inputs: {missing}")
        weight_concats = self._weight_concats(inputs)
        feed.lazy = {k.external: k for k in self.program.kernels if k.external in weight_concats}
        feed.update(self._concatenated(feed, inputs, skip=weight_concats))
        bindings = {**bind_program(self.program, feed), **(bindings or {})}
        weight_names = frozenset(n for n in self.weights if n not in inputs) | weight_concats
        from_cache = frozenset(k.id for k in self.program.kernels  # never written to a slot: no slot
                               if k.kind is KernelKind.EXTERNAL and k.external in weight_names)
        key = (tuple(sorted(bindings.items())), from_cache)
        if key not in self._plans:
            self._plans[key] = plan_buffers(self.program, bindings, from_cache)
        plan = self._plans[key]
        held = None
        if reuse:
            held, self._outputs = self._outputs, None  # a run that starts meanwhile allocates its own
        if held is not None and held[0] == key:
            last = held[2]()
            if last is not None:  # the last run's outputs not read yet are read now: their buffers are this run's
                last.settle()
            outs = held[1]
        else:
            outs = self._output_views(plan, bindings)
        stored = _Stored()
        state = _Run(stored, {}, feed, bindings, weight_names, self._compiled)
        wanted = {kid for _, kid in self.program.exports} if keep_exports else set()
        kept = wanted | {kid for _, kid in self.program.outputs}
        # a weight's stored form is made when its first reader reads it (EXTERNALs come first in a
        # program: made in order, every weight's derived forms would be alive at once)
        stored.make = {k.id: (lambda k=k: _external(self, k, state)) for k in self.program.kernels
                       if k.kind is KernelKind.EXTERNAL and k.external in state.weight_names and k.id not in kept}
        return _Pending(state, key, plan, outs, wanted, [], {})

    def _step(self, r: "_Pending", k: Kernel, drops: Mapping[int, tuple[int, ...]],
              dropped: list[np.ndarray] | None = None) -> None:
        """Kernel `k` of one batch's run (`dropped` gets the weights' stored forms it was the last reader of)."""
        state, stored = r.state, r.state.stored
        t0 = time.perf_counter()
        if k.id in stored.make:
            pass  # made by its first reader (_Stored)
        elif k.kind is KernelKind.EXTERNAL and k.external in state.weight_names:
            stored[k.id] = _external(self, k, state)  # the cached stored weight (never written)
        else:
            state.out = r.outs[k.id]
            value = KERNELS[k.kind](self, k, state)
            if value is not state.out:
                np.copyto(state.out, value, casting="unsafe")
            stored[k.id] = state.out
        if k.id in r.wanted:
            for nid, kid in self.program.exports:
                if kid == k.id:
                    r.exports[nid] = stored[k.id].astype(np.float64)  # the slot may be reused
        if k.kind.launches:
            r.timings.append((k.id, time.perf_counter() - t0))
        for buf in drops.get(k.id, ()):  # a weight's stored form after its last reader: the cache's
            value = stored.pop(buf, None)  # to keep or evict, not this run's to pin until the end
            if dropped is not None and value is not None:
                dropped.append(value)

    def _output_views(self, plan: BufferPlan, bindings) -> dict[int, np.ndarray]:
        """Every computed kernel's output: its shape and storage dtype over its slot of the plan."""
        slots = [np.empty(n, dtype=np.uint8) for n in plan.slot_bytes]
        outs = {}
        for k in self.program.kernels:
            if k.id not in plan.slot_of:  # read from the weight cache (plan_buffers' `unbacked`)
                continue
            shape = tuple(eval_dim(d, bindings) for d in k.shape)
            nbytes = max(int(np.prod(shape, dtype=np.int64)) * k.dtype.storage.itemsize, 0)
            outs[k.id] = slots[plan.slot_of[k.id]][:nbytes].view(k.dtype.storage).reshape(shape)
        return outs

    def _weight_concats(self, inputs) -> frozenset[str]:
        """The derived EXTERNALs (concatenated or rotated weights) made from this runtime's weights only."""
        return frozenset(k.external for k in self.program.kernels
                         if k.derived and all(n in self.weights and n not in inputs for n in k.weight_sources))

    def _weight_drops(self) -> dict[int, tuple[int, ...]]:
        """Kernel id -> the EXTERNAL buffers it is the last reader of (program outputs excluded); an
        EXTERNAL nothing reads (a weight read only in a storage format) is dropped right after itself."""
        if self._drops is None:
            kernels, outputs = self.program.kernels, {kid for _, kid in self.program.outputs}
            drops: dict[int, list[int]] = {}
            for buf, pos in external_last_reads(self.program).items():
                if buf not in outputs:
                    drops.setdefault(kernels[pos].id, []).append(buf)
            self._drops = {r: tuple(b) for r, b in drops.items()}
        return self._drops

    def _concatenated(self, feed, inputs, skip: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
        """The value of every concatenated-weights EXTERNAL (a horizontally fused Gemm's B) not in `skip`:
        built once per runtime when all its parts are this runtime's weights, else from this run's feed.
        (A run skips the weights' own: its feed reads them from the weight cache when a kernel needs them.)"""
        out = {}
        for k in self.program.kernels:
            if not k.derived or k.external in skip:
                continue
            if any(n in inputs or n not in self.weights for n in k.weight_sources):
                out[k.external] = external_value(k, feed)
                self._concats.pop(k.external, None)
            else:
                if k.external not in self._concats:
                    self._concats[k.external] = external_value(k, self.weights)
                out[k.external] = self._concats[k.external]
        return out

    def static_b_scales(self, kid: int) -> np.ndarray | None:
        return self.static_scales.get(kid)

    def epilogue_body(self, k: Kernel) -> Kernel:
        """A Gemm epilogue's body over its accumulator (_accumulator_id), built once per runtime."""
        if k.id not in self._epilogues:
            self._epilogues[k.id] = epilogue_as_elementwise(k, _accumulator_id(k))
        return self._epilogues[k.id]


class _Stored(dict):
    """A run's buffers by kernel id; a weight's stored form (`make`: kernel id -> how) is made when it is
    first read and kept until its last reader has run (CpuRuntime.run drops it then)."""

    make: Mapping[int, Callable[[], np.ndarray]] = {}

    def __missing__(self, kid: int) -> np.ndarray:
        if kid not in self.make:
            raise KeyError(kid)
        value = self[kid] = self.make[kid]()
        return value


class _Feed(dict):
    """A run's inputs by name; a concatenation of weights is looked up in the weight cache each time it
    is read (codegen.llir.external_value), never held by the run: a whole-model run reads every fused
    weight once, and holding them all (2.5 GB of a 1B model's) is what the cache's budget is for."""

    lazy: Mapping[str, Kernel] = {}

    def __missing__(self, name: str):
        k = self.lazy.get(name)
        if k is None:
            raise KeyError(name)
        return external_value(k, self)


# -- one function per kernel kind -------------------------------------------------------------------
def _external(rt: CpuRuntime, k: Kernel, state: _Run) -> np.ndarray:
    val = state.feed[k.external]
    if k.storage is not None and k.concat:  # weights held in one format, concatenated: each part as stored
        fills = tuple(_fill_key(rt, k, n, state.feed[n]) for n in k.concat)
        return WEIGHTS.get(val, ("widened concat", k.storage, k.fill, fills, k.dtype.name, k.concat),
                           lambda: _stored_concat(rt, k, state))
    if k.storage is not None and k.external not in state.weight_names:  # a KV cache handed in: held in its format
        return cache_values(store_input(k, val), k.storage)
    if k.storage is not None:  # a weight held in its storage format: readers see it widened
        key = stored_key(k.external, k.storage, k.fill)
        held = rt.stored_weights.get(key)

        def widen() -> np.ndarray:
            # widened() gives a fresh array (a weights file's entry) or the conversion cache's read-only one:
            # neither needs a copy, only a conversion where the kernel's dtype is not FP32
            out = np.asarray(widened(val, k.storage, held, k.fill), dtype=k.dtype.storage)
            out.flags.writeable = False
            return out
        if held is not None:  # a plan's weights file: unpacked once per runtime
            if key not in rt._widened:
                rt._widened[key] = widen()
            return rt._widened[key]
        if k.external in state.weight_names:
            if isinstance(val, WeightArray) and val.dtype == k.dtype.storage == np.float32:
                # quant.stored's cache holds this very array (read-only), found by the weight's own content key
                return widened(val, k.storage, None, k.fill)
            return WEIGHTS.get(val, ("widened", k.storage, k.fill, _fill_key(rt, k, k.external, val), k.dtype.name),
                               widen)
        return widen()
    if k.external in state.weight_names:
        return WEIGHTS.get(val, ("stored", k.dtype.name), lambda: store_input(k, val))
    if k.dtype is F32 and state.out is not None and f32_into(k, val, state.out):  # the step's own slot, no copy
        return state.out
    return store_input(k, val)


def _stored_concat(rt: CpuRuntime, k: Kernel, state: _Run) -> np.ndarray:
    """A KCatStored buffer: every part widened as its own stored weight (a plan's weights file or its
    compile-time conversion), side by side (quant/concat.py checks that no block spans parts)."""
    parts = [widened(state.feed[n], k.storage, rt.stored_weights.get(stored_key(n, k.storage, k.fill)), k.fill)
             for n in k.concat]
    out = np.array(concat_widened(parts, k.storage, k.concat_axis), dtype=k.dtype.storage)
    out.flags.writeable = False
    return out


def _fill_key(rt: CpuRuntime, k: Kernel, name: str, val) -> tuple | None:
    """What a filled weight's values depend on beyond the weight, for process-wide caches: the plan's
    weights-file entry (its bytes) when the runtime holds one, else the installed Hessian (none: the
    conversion refuses it, quant.stored.MissingCalibration)."""
    if k.fill is None:
        return None
    key = stored_key(name, k.storage, k.fill)
    held = rt.stored_weights.get(key)
    if held is not None:
        if key not in rt._held_digests:
            arrays = held.arrays if hasattr(held, "arrays") else held.values
            rt._held_digests[key] = digest(np.concatenate([np.ascontiguousarray(a).view(np.uint8).ravel()
                                                           for _, a in sorted(arrays.items(), key=lambda kv: kv[0].value)]))
        return ("file", rt._held_digests[key])
    h = hessian_of(val)
    return None if h is None else ("hessian", h.key)


def _const_kernel(rt, k: Kernel, state: _Run) -> np.ndarray:
    v = k.value if isinstance(k.value, float) else float(eval_dim(k.value, state.bindings))
    return store(np.asarray(v), k.dtype)


def _iota(rt, k: Kernel, state: _Run) -> np.ndarray:
    return store(np.arange(eval_dim(k.value, state.bindings), dtype=np.float64), k.dtype)


def _elementwise(rt, k: Kernel, state: _Run) -> np.ndarray:
    if body_into_out(k, state):
        return state.out
    return store32(body_values(k, state), k.dtype)


def _sum(rt, k: Kernel, state: _Run) -> np.ndarray:
    return store32(reduce_sum(body_values(k, state), k.axis, k.acc), k.dtype)


def _max(rt, k: Kernel, state: _Run) -> np.ndarray:
    return store32(np.max(body_values(k, state), axis=k.axis), k.dtype)


def _softmax(rt, k: Kernel, state: _Run) -> np.ndarray:
    x = body_values(k, state)
    if k.precision in (None, "f32") and k.dtype is F32 and x.dtype == np.float32:
        return softmax_f64_into(x, k.axis, state.out)
    x = x.astype(np.float64)  # a fused op: float64 throughout, one rounding
    if k.precision in (None, "f32"):
        return store32(softmax(x, k.axis, out=x), k.dtype)  # x is a fresh copy: computed in place
    compute = get_format(k.precision)  # a low-precision softmax: inputs and result rounded to it
    return store(store(softmax(store(x, compute), k.axis), compute), k.dtype)


def _quantize(rt, k: Kernel, state: _Run) -> np.ndarray:
    """q into its float8 buffer straight as codes (quant.codes: two numba passes), else quantized by
    numpy and stored by its codes where dtypes.codec can (the values are exact in it), else by the run
    loop's cast: the same bits each way, the first ~10x faster than numpy's passes."""
    a = quantize_input(k, state.stored, state.bindings)
    scales = quantize_into_codes(a, k.dtype, k.scale_spec, state.out)
    if scales is not None:
        state.scales[k.id] = scales
        return state.out
    quantized = quantize_tensor(a, k.dtype, k.scale_spec)
    state.scales[k.id] = quantized.scales
    return state.out if encode_into(quantized.values, state.out) else quantized.values


def _gemm(rt: CpuRuntime, k: Kernel, state: _Run) -> np.ndarray:
    if k.dtype is F32:
        return gemm_accumulator(rt, k, state, out=state.out)
    return store32(gemm_accumulator(rt, k, state), k.dtype)


def _accumulator_id(k: Kernel) -> int:
    """The buffer id a Gemm epilogue's accumulator is held under while its body runs: negative (no
    kernel has it) and one per kernel, because computed values are shared between the kernels of a run
    by the buffer ids they load (state.shared): one id for every accumulator made a second epilogue with
    the same body return the first one's values."""
    return -1 - k.id


def _gemm_epilogue(rt: CpuRuntime, k: Kernel, state: _Run) -> np.ndarray:
    """The Gemm's FP32 accumulator, the epilogue body on it (each op one FP32 rounding, as the unfused
    elementwise kernel computes it), one store in the kernel's dtype."""
    acc = _accumulator_id(k)
    body = rt.epilogue_body(k)
    in_out = k.dtype is F32 and _only_new_values(body.body)
    state.stored[acc] = gemm_accumulator(rt, k, state, out=state.out if in_out else None)
    try:
        if body_into_out(body, state):
            return state.out
        return store32(body_values(body, state), k.dtype)
    finally:
        del state.stored[acc]


def _only_new_values(e) -> bool:
    """Whether every value a body derives is a new array (ops on loads and constants: no FAt or
    rounding, which may give a view of their operand). Then an FP32 epilogue's accumulator may live
    in the output buffer: the last op overwrites it, and no shared value is a view of it."""
    if isinstance(e, FApply):
        return all(_only_new_values(a) for a in e.args)
    return isinstance(e, (FLoad, FConstV))


def gemm_accumulator(rt: CpuRuntime, k: Kernel, state: _Run, out: np.ndarray | None = None) -> np.ndarray:
    """A Gemm kernel's C as float32, before its store (the variant's arithmetic, scales applied); an
    FP32 Gemm may compute it into `out` (float32, the output's shape), and then returns `out`."""
    a_scales = state.scales[k.inputs[0].buffer] if rt.program.quantized_inputs(k)[0] else None
    b_source = rt.program.kernel(k.inputs[1].buffer)
    weight = b_source.external if b_source.kind is KernelKind.EXTERNAL else None
    b_key = None
    if weight in state.weight_names:
        def operand_key() -> tuple:
            scales = rt.static_b_scales(k.id)
            return ("gemm_b", k.inputs[1].view.encode(), k.layout.encode(), k.precision, b_source.dtype.name,
                    b_source.storage,  # the same weight held in two formats prepares two operands
                    b_source.fill, tuple(_fill_key(rt, b_source, n, state.feed[n])  # ... or filled two ways
                                         for n in (b_source.concat or (b_source.external,))),
                    tuple(sorted(state.bindings.items())), None if scales is None else scales.tobytes())
        b_key = (state.feed[weight], state.compiled.get(k, "gemm_b_key", state.bindings, operand_key))
    reads = tuple(state.compiled.read(k, i, state.bindings) for i in (0, 1))
    parts = tuple(int(np.shape(state.feed[n])[b_source.concat_axis]) for n in b_source.concat) \
        if b_source.kind is KernelKind.EXTERNAL and b_source.concat else ()
    return run_gemm(k, state.stored, state.bindings, rt.static_b_scales(k.id), a_scales, b_key, reads, out, parts,
                    fixed_order=rt.program.batch_invariant)


def _gather(rt, k: Kernel, state: _Run) -> np.ndarray:
    table = read_input(k, 0, state)
    idx = k.inputs[1].view.realize(state.stored[k.inputs[1].buffer], state.bindings).astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= table.shape[0]):
        raise IndexError(f"gather: index out of range [0, {table.shape[0]})")
    rows = table[idx]
    return rows if rows.dtype == k.dtype.storage else rows.astype(np.float64)


def _scatter(rt, k: Kernel, state: _Run) -> np.ndarray:
    return _scatter_rows(k, read64(k, 1, state), state, index_slot=2)


def _scatter_rows(k: Kernel, src: np.ndarray, state: _Run, index_slot: int = 1) -> np.ndarray:
    """dest (input 0) with rows `idx` replaced by `src` (float64). Where dest is stored as the output is, it is
    copied into the output as it lies and only the rows are cast to it: the bits its exact float64 copy gave,
    cast back, without that copy's two passes over a whole KV cache per step; else through that float64 copy."""
    dest = read_input(k, 0, state)
    idx = k.inputs[index_slot].view.realize(state.stored[k.inputs[index_slot].buffer], state.bindings).astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= dest.shape[0]):
        raise IndexError(f"scatter: index out of range [0, {dest.shape[0]})")
    rows = src if k.storage is None else cache_values(src, k.storage)  # a KV cache: rows written converted
    out = state.out
    if out is not None and dest.shape == out.shape and dest.dtype == out.dtype:
        np.copyto(out, dest)  # overlapping (an in-place plan): numpy copies through a buffer
        out[idx] = rows
        return out
    dest = dest.astype(np.float64)
    dest[idx] = rows
    return dest


def _attention(rt, k: Kernel, state: _Run) -> np.ndarray:
    return store32(run_attention(k, tuple(read_input(k, i, state) for i in range(len(k.inputs))), state.bindings), k.dtype)


def _rows(rt, k: Kernel, state: _Run) -> np.ndarray:
    """A row kernel: per row its sums, then the elementwise tail per element, one store."""
    shape = tuple(eval_dim(d, state.bindings) for d in k.shape)
    if body_into_out(k, state):
        return state.out
    return store32(np.broadcast_to(rows_values(k, state), shape), k.dtype)


def _scatter_ew(rt, k: Kernel, state: _Run) -> np.ndarray:
    """An in-place scatter of rows its body computes: the copy of the source it replaces wrote the same."""
    shape = tuple(eval_dim(d, state.bindings) for d in k.body_shape)
    src = np.broadcast_to(rows_values(k, state), shape).astype(np.float64)
    return _scatter_rows(k, src, state)


KERNELS: dict[KernelKind, Callable[[CpuRuntime, Kernel, _Run], np.ndarray]] = {
    KernelKind.EXTERNAL: _external, KernelKind.CONST: _const_kernel, KernelKind.IOTA: _iota,
    KernelKind.ELEMENTWISE: _elementwise, KernelKind.SUM: _sum, KernelKind.MAX: _max,
    KernelKind.SOFTMAX: _softmax, KernelKind.QUANTIZE: _quantize, KernelKind.GEMM: _gemm,
    KernelKind.GATHER: _gather, KernelKind.SCATTER: _scatter, KernelKind.SCATTER_NOCOPY: _scatter,
    KernelKind.GEMM_EPILOGUE: _gemm_epilogue,
    KernelKind.ATTENTION: _attention,
    KernelKind.ROWS: _rows, KernelKind.SCATTER_EW: _scatter_ew,
}
