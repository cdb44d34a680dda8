"""A recording stand-in for CuPy, libcublas and libcublasLt: the CUDA runtime's call discipline, checked
without a GPU.

Nothing here computes: every device-side operation (upload, download, copy, launch, cuBLAS call) is
appended to `Recorder.log` with the stream it was ordered on and whether that stream was capturing a
CUDA graph. The CuPy part behaves as CuPy 14 does where the runtime's correctness depends on it:
`cupy.cuda.cublas` wrappers call setStream before every call, which raises NotImplementedError while
a stream captures (cupy_backends/cuda/libs/cublas.pyx), and there is no `cublas.setWorkspace`; an
upload without an explicit stream goes to the current stream (the legacy null stream, ptr 0, outside
any `with stream:`).

With `Recorder(execute=True)` the stand-in also executes: device memory is
host bytes at fake addresses, a kernel launch runs its entry in tests/cuda_interpreter.py, cuBLAS and
cuBLASLt calls are computed from their column-major definitions (float64 sums of the operands as the
compute type rounds them, one rounding to the output type), and a captured graph replays the
operations recorded while capturing. Then the runtime's pointer plumbing (slots, offsets, scratch,
scales, dyn dims, staged copies, graph replay) meets the CPU backend without a GPU.
"""
from __future__ import annotations

import ctypes
import itertools
import sys
import types
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from cuda_interpreter import Buffer, compile_entry, entry_body, launch
from luminal_num.dtypes.formats import BF16, F16, TF32
from luminal_num.dtypes.rounding import round_to

CAPTURE_ERROR = "calling cuBLAS API during stream capture is currently unsupported"


C_TYPES = {"float": (np.float32, False), "double": (np.float64, False), "__half": (np.float16, False),
           "__nv_bfloat16": (ml_dtypes.bfloat16, False), "__nv_fp8_e4m3": (ml_dtypes.float8_e4m3fn, False),
           "__nv_fp8_e5m2": (ml_dtypes.float8_e5m2, False), "signed char": (np.int8, True), "int": (np.int32, True),
           "unsigned char": (np.uint8, True),
           "long long": (np.int64, True)}
ALIGN = 256


@dataclass
class Recorder:
    log: list = field(default_factory=list)
    streams: list = field(default_factory=list)   # the `with stream:` stack
    capturing: dict = field(default_factory=dict)  # stream ptr -> operations recorded into its graph
    execute: bool = False                          # run launches and library calls, not only record them
    sources: dict = field(default_factory=dict)    # entry -> CUDA source (filled by install()'s render_kernel)
    allocations: dict = field(default_factory=dict)  # base address -> root FakeArray
    next_address: int = 1 << 20
    _entries: dict = field(default_factory=dict)

    def current(self) -> int:
        return self.streams[-1].ptr if self.streams else 0

    def any_capturing(self) -> bool:
        return bool(self.capturing)

    def record(self, op: str, stream: int, **details) -> None:
        self.log.append({"op": op, "stream": stream, "capturing": stream in self.capturing, **details})

    def ops(self, op: str) -> list[dict]:
        return [e for e in self.log if e["op"] == op]

    def submit(self, stream: int, operation) -> None:
        """A device operation: recorded into the graph of a capturing stream, else run now (when executing)."""
        if stream in self.capturing:
            self.capturing[stream].append(operation)
        elif self.execute:
            operation()

    # -- fake device memory ---------------------------------------------------------------------------
    def allocate(self, array: "FakeArray") -> int:
        ptr = self.next_address
        self.next_address += -(-max(array.values.nbytes, 1) // ALIGN) * ALIGN + ALIGN
        self.allocations[ptr] = array
        return ptr

    def memory(self, address: int) -> np.ndarray:
        """The bytes from `address` to the end of the allocation holding it."""
        for base, root in self.allocations.items():
            if base <= address < base + max(root.values.nbytes, 1):
                return root.values.reshape(-1).view(np.uint8)[address - base:]
        raise AssertionError(f"address {address:#x} is in no allocation")

    def typed(self, address: int, dtype) -> np.ndarray:
        raw = self.memory(address)
        size = np.dtype(dtype).itemsize
        return raw[:raw.size // size * size].view(dtype)

    # -- running a kernel entry in the interpreter ------------------------------------------------------------
    def run_kernel(self, entry: str, args, grid, block) -> None:
        if entry not in self._entries:
            source = self.sources[entry]
            start = source.index(f"void {entry}(")
            declared = source[start + len(entry) + 6:source.index(")", start)].split(",")
            params = []
            for decl in declared:
                ctype = " ".join(w for w in decl.replace("*", " ").split()[:-1] if w not in ("const", "__restrict__"))
                params.append((*C_TYPES[ctype], decl.strip().startswith("const")))
            fn, names = compile_entry(source, entry)
            self._entries[entry] = (fn, names, params, "__syncthreads" in entry_body(source, entry)[1])
        fn, names, params, cooperative = self._entries[entry]
        assert len(args) == len(names), (entry, len(args), names)
        buffers, outputs = {}, []
        for name, (dtype, integer, const), arg in zip(names, params, args):
            typed = self.typed(arg.data.ptr, dtype)
            buffers[name] = Buffer(typed.astype(np.float64), integer)
            if not const:
                outputs.append((typed, buffers[name]))
        if cooperative:
            launch(fn, buffers, grid, block)
        else:
            fn(**buffers)
        for typed, buffer in outputs:
            typed[...] = buffer.values.astype(typed.dtype)


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


class FakeArray:
    """Host-backed bytes at a fake device address; slicing keeps the address (a prefix view)."""

    def __init__(self, rec: Recorder, values: np.ndarray, ptr: int | None = None):
        self.rec, self.values = rec, values
        self.data = _Pointer(rec.allocate(self) if ptr is None else ptr)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes

    def __getitem__(self, key) -> "FakeArray":
        return FakeArray(self.rec, self.values[key], self.data.ptr)

    def set(self, host, stream=None) -> None:
        self.rec.record("upload", stream.ptr if stream is not None else self.rec.current(), nbytes=host.nbytes)
        self.values[...] = np.asarray(host).reshape(self.values.shape)

    def get(self, stream=None) -> np.ndarray:
        self.rec.record("download", stream.ptr if stream is not None else self.rec.current(), nbytes=self.nbytes)
        return self.values.copy()


class FakeStream:
    def __init__(self, rec: Recorder, non_blocking: bool = False):
        rec.next_address += ALIGN
        self.rec, self.ptr, self.non_blocking = rec, rec.next_address, non_blocking  # a unique handle, not memory
        rec.next_address += ALIGN

    def __enter__(self):
        self.rec.streams.append(self)
        return self

    def __exit__(self, *exc):
        self.rec.streams.pop()

    def begin_capture(self) -> None:
        self.rec.capturing[self.ptr] = []

    def end_capture(self) -> "FakeGraph":
        return FakeGraph(self.rec, self.rec.capturing.pop(self.ptr))

    def is_capturing(self) -> bool:
        return self.ptr in self.rec.capturing

    def synchronize(self) -> None:
        self.rec.record("synchronize", self.ptr)


class FakeGraph:
    def __init__(self, rec: Recorder, operations: list):
        self.rec, self.operations = rec, operations

    def launch(self, stream=None) -> None:
        self.rec.record("graph_launch", stream.ptr if stream is not None else self.rec.current())
        if self.rec.execute:
            for operation in self.operations:
                operation()


class FakeEvent:
    def __init__(self, rec: Recorder):
        self.rec = rec

    def record(self, stream=None) -> None:
        self.rec.record("event", stream.ptr if stream is not None else self.rec.current())

    def synchronize(self) -> None:
        pass


class FakeFunction:
    def __init__(self, rec: Recorder, name: str):
        self.rec, self.name = rec, name

    def __call__(self, grid, block, args, shared_mem=0, stream=None) -> None:
        ptr = stream.ptr if stream is not None else self.rec.current()
        self.rec.record("launch", ptr, entry=self.name, grid=grid, block=block)
        self.rec.submit(ptr, lambda: self.rec.run_kernel(self.name, args, grid, block))


class FakeModule:
    def __init__(self, rec: Recorder):
        self.rec = rec

    def load(self, cubin: bytes) -> None:
        assert isinstance(cubin, bytes) and cubin, "Module.load takes the CUBIN's bytes"
        self.rec.record("module_load", 0, nbytes=len(cubin))

    def get_function(self, name: str) -> FakeFunction:
        return FakeFunction(self.rec, name)


def _cupy_cublas(rec: Recorder) -> types.ModuleType:
    """cupy.cuda.cublas as CuPy 14 has it: setStream inside every wrapper, no setWorkspace."""
    module = types.ModuleType("cupy.cuda.cublas")

    def set_stream(handle, stream):
        if rec.any_capturing():
            raise NotImplementedError(CAPTURE_ERROR)
        rec.record("cupy_cublas_setStream", stream)

    def gemm(handle, *args):
        set_stream(handle, rec.current())
        rec.record("gemm", rec.current(), api="cupy")

    module.create = lambda: 1
    module.destroy = lambda handle: None
    module.setPointerMode = module.setMathMode = lambda handle, mode: None
    module.setStream, module.gemmStridedBatchedEx = set_stream, gemm
    return module


def _memcpy(rec: Recorder, dst: int, src: int, nbytes: int, stream: int) -> None:
    rec.record("memcpy", stream, nbytes=nbytes)

    def copy():
        rec.memory(dst)[:nbytes] = rec.memory(src)[:nbytes]
    rec.submit(stream, copy)


def fake_cupy(rec: Recorder) -> dict[str, types.ModuleType]:
    """sys.modules entries for `cupy`, `cupy.cuda`, `cupy.cuda.function` and the cuBLAS wrappers
    (`cupy_backends.cuda.libs.cublas`, which `cupy.cuda.cublas` names)."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    function = types.ModuleType("cupy.cuda.function")
    function.Module = lambda: FakeModule(rec)
    runtime = types.SimpleNamespace(
        getDeviceProperties=lambda i: {"name": b"Fake H200", "major": 9, "minor": 0},
        memcpyDeviceToDevice=3,
        memcpyAsync=lambda dst, src, n, kind, stream: _memcpy(rec, dst, src, n, stream))
    cuda.runtime, cuda.function, cuda.cublas = runtime, function, _cupy_cublas(rec)
    cuda.Stream = lambda non_blocking=False: FakeStream(rec, non_blocking)
    cuda.Event = lambda: FakeEvent(rec)
    cuda.get_elapsed_time = lambda start, end: 0.5

    def raw_module(code=None, path=None, options=()):
        rec.record("raw_module", 0, path=path)
        return FakeModule(rec)

    def asarray(x):
        host = np.ascontiguousarray(x)
        rec.record("upload", rec.current(), nbytes=host.nbytes)
        return FakeArray(rec, host.copy())

    cupy.is_available = lambda: True
    cupy.cuda, cupy.RawModule, cupy.asarray, cupy.uint8 = cuda, raw_module, asarray, np.uint8
    cupy.empty = lambda shape, dtype=np.float32: FakeArray(rec, np.full(shape, 0xA5, dtype=np.uint8).view(dtype)
                                                           if np.dtype(dtype) == np.uint8 else np.zeros(shape, dtype))
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.function": function,
            "cupy_backends.cuda.libs.cublas": cuda.cublas}


# -- libcublas / libcublasLt stand-ins (the ctypes functions the runtime's binding calls) ---------------

# cudaDataType_t, compute types and cuBLASLt attribute ids as NVIDIA's headers number them (the tests'
# own copy: tests/test_cuda_headers.py checks the runtime's against the headers).
DATA_TYPES = {0: np.float32, 2: np.float16, 3: np.int8, 10: np.int32, 14: ml_dtypes.bfloat16,
              28: ml_dtypes.float8_e4m3fn, 29: ml_dtypes.float8_e5m2}
COMPUTE_16F, COMPUTE_ROUNDING = 64, {77: TF32, 75: BF16, 74: F16}  # FAST_TF32 / FAST_16BF / FAST_16F
ATTR = {"TRANSA": 3, "TRANSB": 4, "A_SCALE": 17, "B_SCALE": 18, "BATCH_COUNT": 5, "BATCH_STRIDE": 6,
        "EPILOGUE": 7, "BIAS_POINTER": 8, "BIAS_BATCH_STRIDE": 10, "BIAS_DATA_TYPE": 26}
EPILOGUE_DEFAULT, EPILOGUE_BIAS = 1, 4


def _rounded(values: np.ndarray, compute: int) -> np.ndarray:
    """Operands as the compute type reads them (RNE to TF32/BF16/FP16 for the FAST types), in float64."""
    wide = values.astype(np.float64)
    return round_to(wide, COMPUTE_ROUNDING[compute]) if compute in COMPUTE_ROUNDING else wide


def _value(arg):
    """What a ctypes argument carries: a byref's object, a simple type's value, or the Python value."""
    if hasattr(arg, "_obj"):
        return arg._obj
    return arg.value if isinstance(arg, ctypes._SimpleCData) else arg


def _stream_of(arg) -> int:
    return _value(arg) or 0


class FakeCublasLib:
    """libcublas: a setStream while a stream captures raises, as calling it there would reset the workspace."""

    def __init__(self, rec: Recorder):
        self.rec = rec

    def cublasCreate_v2(self, handle):
        _value(handle).value = 0xB1A5
        self.rec.record("cublasCreate", 0)
        return 0

    def cublasDestroy_v2(self, handle):
        return 0

    def cublasSetPointerMode_v2(self, handle, mode):
        self.rec.record("cublasSetPointerMode", 0, mode=mode)
        return 0

    def cublasSetMathMode(self, handle, mode):
        self.rec.record("cublasSetMathMode", 0, mode=mode)
        return 0

    def cublasSetStream_v2(self, handle, stream):
        if self.rec.any_capturing():
            raise AssertionError("cublasSetStream during stream capture")
        self.rec.record("cublasSetStream", _stream_of(stream))
        return 0

    def cublasSetWorkspace_v2(self, handle, workspace, nbytes):
        self.rec.record("cublasSetWorkspace", 0, workspace=_value(workspace), nbytes=nbytes)
        return 0

    def _bound_stream(self) -> int:
        streams = self.rec.ops("cublasSetStream")
        return streams[-1]["stream"] if streams else 0

    def cublasGemmStridedBatchedEx(self, handle, transa, transb, m, n, k, alpha, a, a_type, lda, stride_a, b, b_type,
                                   ldb, stride_b, beta, c, c_type, ldc, stride_c, batch, compute, algo):
        stream = self._bound_stream()
        self.rec.record("gemm", stream, api="cublas", handle=_value(handle), m=m, n=n, k=k, compute=compute)
        scalar = np.float16 if compute == COMPUTE_16F else np.float32
        assert float(np.asarray(_value(alpha).value, np.uint16).view(np.float16) if scalar is np.float16
                     else _value(alpha).value) == 1.0

        def run():
            rd = lambda ptr, t: _rounded(self.rec.typed(_value(ptr), DATA_TYPES[t]), compute)  # noqa: E731
            a_values, b_values = rd(a, a_type), rd(b, b_type)
            out = self.rec.typed(_value(c), DATA_TYPES[c_type])
            rows, cols, inner = np.arange(m)[:, None], np.arange(n)[None, :], np.arange(k)
            for i in range(batch):
                at_a = i * stride_a + (inner[None, :] + rows * lda if transa else rows + inner[None, :] * lda)
                at_b = i * stride_b + (cols + inner[:, None] * ldb if transb else inner[:, None] + cols * ldb)
                out[i * stride_c + rows + cols * ldc] = (a_values[at_a] @ b_values[at_b]).astype(out.dtype)
        self.rec.submit(stream, run)
        return 0


class FakeCublasLtLib:
    """libcublasLt: `heuristic_results` algorithms from the heuristic, `matmul_status` from cublasLtMatmul."""

    def __init__(self, rec: Recorder, heuristic_results: int = 1, matmul_status: int = 0):
        self.rec, self.heuristic_results, self.matmul_status = rec, heuristic_results, matmul_status
        self.objects = itertools.count(1)
        self.attributes: dict[int, dict[int, object]] = {}   # descriptor / layout id -> attribute -> value
        self.layouts: dict[int, tuple] = {}                  # layout id -> (data type, rows, cols, ld)
        self.computes: dict[int, int] = {}                   # descriptor id -> compute type

    def _create(self, out, op: str, **details):
        _value(out).value = next(self.objects)
        self.rec.record(op, 0, id=_value(out).value, **details)
        return 0

    def cublasLtCreate(self, handle):
        return self._create(handle, "ltCreate")

    def cublasLtDestroy(self, handle):
        return 0

    def cublasLtMatmulDescCreate(self, desc, compute, scale):
        status = self._create(desc, "ltDescCreate", compute=compute, scale=scale)
        self.computes[_value(desc).value] = compute
        return status

    def cublasLtMatrixLayoutCreate(self, layout, dtype, rows, cols, ld):
        status = self._create(layout, "ltLayoutCreate", dtype=dtype, rows=rows, cols=cols, ld=ld)
        self.layouts[_value(layout).value] = (dtype, rows, cols, ld)
        return status

    def cublasLtMatmulPreferenceCreate(self, pref):
        return self._create(pref, "ltPreferenceCreate")

    def _attribute(self, op, obj, attr, buf, size):
        value = _value(buf)
        assert ctypes.sizeof(value) == size
        self.rec.record(op, 0, obj=_value(obj), attr=attr, value=value.value)
        self.attributes.setdefault(_value(obj), {})[attr] = value.value
        return 0

    def cublasLtMatmulDescSetAttribute(self, desc, attr, buf, size):
        return self._attribute("ltDescAttribute", desc, attr, buf, size)

    def cublasLtMatrixLayoutSetAttribute(self, layout, attr, buf, size):
        return self._attribute("ltLayoutAttribute", layout, attr, buf, size)

    def cublasLtMatmulPreferenceSetAttribute(self, pref, attr, buf, size):
        return self._attribute("ltPreferenceAttribute", pref, attr, buf, size)

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, a, b, c, d, pref, requested, results, count):
        self.rec.record("ltHeuristic", 0, requested=requested)
        _value(count).value = min(requested, self.heuristic_results)
        _value(results).state = 0
        _value(results).algo.data[0] = 0xA160
        return 0

    def cublasLtMatmul(self, handle, desc, alpha, a, la, b, lb, beta, c, lc, d, ld, algo, workspace, nbytes, stream):
        attrs = dict(self.attributes[_value(desc)])
        self.rec.record("gemm", _stream_of(stream), api="cublasLt", algo=_value(algo).data[0],
                        workspace=_value(workspace), nbytes=nbytes, status=self.matmul_status,
                        epilogue=attrs.get(ATTR["EPILOGUE"], EPILOGUE_DEFAULT), bias=attrs.get(ATTR["BIAS_POINTER"]),
                        bias_type=attrs.get(ATTR["BIAS_DATA_TYPE"]))
        if self.matmul_status == 0:  # the descriptor is read now, as the library does when it enqueues
            compute = self.computes[_value(desc)]
            self.rec.submit(_stream_of(stream), lambda: self._matmul(attrs, compute, _value(a), _value(la), _value(b),
                                                                     _value(lb), _value(d), _value(ld)))
        return self.matmul_status

    def _matmul(self, attrs, compute, a, la, b, lb, d, ld):
        """D = scale_a scale_b op(A) op(B) (scales: 1 where unset), operands read as `compute` reads them; with
        CUBLASLT_EPILOGUE_BIAS the FP32 product plus the bias vector (one per row of D, batch stride 0) in FP32."""
        transa, transb = attrs.get(ATTR["TRANSA"], 0), attrs.get(ATTR["TRANSB"], 0)
        (a_type, a_rows, a_cols, lda), (b_type, b_rows, b_cols, ldb), (d_type, m, n, ldd) = \
            (self.layouts[x] for x in (la, lb, ld))
        k = a_rows if transa else a_cols
        assert (a_cols if transa else a_rows, b_cols if transb else b_rows, b_rows if transb else b_cols) == (m, k, n)
        batch = self.attributes[la][ATTR["BATCH_COUNT"]]
        strides = [self.attributes[x][ATTR["BATCH_STRIDE"]] for x in (la, lb, ld)]
        sa, sb = (float(self.rec.typed(attrs[ATTR[s]], np.float32)[0]) if ATTR[s] in attrs else 1.0
                  for s in ("A_SCALE", "B_SCALE"))
        epilogue = attrs.get(ATTR["EPILOGUE"], EPILOGUE_DEFAULT)
        assert epilogue in (EPILOGUE_DEFAULT, EPILOGUE_BIAS), f"epilogue {epilogue} is not modelled"
        a_values = _rounded(self.rec.typed(a, DATA_TYPES[a_type]), compute)
        b_values = _rounded(self.rec.typed(b, DATA_TYPES[b_type]), compute)
        out = self.rec.typed(d, DATA_TYPES[d_type])
        rows, cols, inner = np.arange(m)[:, None], np.arange(n)[None, :], np.arange(k)
        for i in range(batch):
            at_a = i * strides[0] + (inner[None, :] + rows * lda if transa else rows + inner[None, :] * lda)
            at_b = i * strides[1] + (cols + inner[:, None] * ldb if transb else inner[:, None] + cols * ldb)
            product = a_values[at_a] @ b_values[at_b]
            if epilogue == EPILOGUE_BIAS:  # the FP32 accumulator, + the bias in FP32: one rounding
                assert attrs.get(ATTR["BIAS_BATCH_STRIDE"], 0) == 0 and sa == sb == 1.0
                bias = self.rec.typed(attrs[ATTR["BIAS_POINTER"]], DATA_TYPES[attrs[ATTR["BIAS_DATA_TYPE"]]])[:m]
                value = product.astype(np.float32) + bias.astype(np.float32)[:, None]
            else:
                value = np.float32(sa) * np.float32(sb) * product
            out[i * strides[2] + rows + cols * ldd] = value.astype(out.dtype)

    def cublasLtMatrixLayoutDestroy(self, layout):
        return 0

    def cublasLtMatmulDescDestroy(self, desc):
        return 0

    def cublasLtMatmulPreferenceDestroy(self, pref):
        return 0


def install(monkeypatch, rec: Recorder, cuda_module, cuda_device) -> dict:
    """Put the stand-in in place for one test: CuPy in sys.modules, the libraries the runtime loads
    (returned: swap "cublaslt" for another FakeCublasLtLib), every source the runtime renders noted
    (so launches can be executed), a fresh device probe."""
    for name, module in fake_cupy(rec).items():
        monkeypatch.setitem(sys.modules, name, module)
    render = cuda_module.render_kernel

    def noting_render(kernel, program):
        src = render(kernel, program)
        rec.sources.update({entry: src.source for entry in src.entries})
        return src
    monkeypatch.setattr(cuda_module, "render_kernel", noting_render)
    libs = {"cublas": FakeCublasLib(rec), "cublaslt": FakeCublasLtLib(rec)}
    monkeypatch.setattr(cuda_module, "load_libraries", lambda: types.SimpleNamespace(**libs), raising=False)
    cuda_device.probe.cache_clear()
    return libs


def executing_stand_in(monkeypatch, tmp_path):
    """A fixture body (`yield from`): the stand-in installed with launches run in the interpreter, NVRTC's
    cache in `tmp_path`, and the dedicated dequantize-on-load kernels noted as rendered, so that they too
    execute; the device probe is cleared after the test."""
    import luminal_num.runtime.cuda as cuda_module
    from luminal_num.codegen import nvrtc
    from luminal_num.runtime import cuda_device
    rec = Recorder(execute=True)
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
    install(monkeypatch, rec, cuda_module, cuda_device)
    plan = cuda_module.weight_only_gemm

    def noting_plan(kernel, program):
        src = plan(kernel, program)
        if src is not None:
            rec.sources[src.name] = src.source
        return src
    monkeypatch.setattr(cuda_module, "weight_only_gemm", noting_plan)
    yield rec
    cuda_device.probe.cache_clear()
