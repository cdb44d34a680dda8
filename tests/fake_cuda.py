"""A recording stand-in for CuPy, libcublas and libcublasLt: the CUDA runtime's call discipline, checked
without a GPU.

Nothing here computes: every device-side operation (upload, download, copy, launch, cuBLAS call) is
appended to `Recorder.log` with the stream it was ordered on and whether that stream was capturing a
CUDA graph. The CuPy part behaves as CuPy 14 does where the runtime's correctness depends on it:
`cupy.cuda.cublas` wrappers call setStream before every call, which raises NotImplementedError while
a stream captures (cupy_backends/cuda/libs/cublas.pyx), and there is no `cublas.setWorkspace`; an
upload without an explicit stream goes to the current stream (the legacy null stream, ptr 0, outside
any `with stream:`).
"""
from __future__ import annotations

import ctypes
import itertools
import types
from dataclasses import dataclass, field

import numpy as np

CAPTURE_ERROR = "calling cuBLAS API during stream capture is currently unsupported"


@dataclass
class Recorder:
    log: list = field(default_factory=list)
    streams: list = field(default_factory=list)   # the `with stream:` stack
    addresses: itertools.count = field(default_factory=lambda: itertools.count(1 << 20, 1 << 20))
    capturing: set = field(default_factory=set)

    def current(self) -> int:
        return self.streams[-1].ptr if self.streams else 0

    def any_capturing(self) -> bool:
        return bool(self.capturing)

    def record(self, op: str, stream: int, **details) -> None:
        self.log.append({"op": op, "stream": stream, "capturing": stream in self.capturing, **details})

    def ops(self, op: str) -> list[dict]:
        return [e for e in self.log if e["op"] == op]


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


class FakeArray:
    """Host-backed bytes with a fake device address; slicing keeps the address (a prefix view)."""

    def __init__(self, rec: Recorder, values: np.ndarray, ptr: int | None = None):
        self.rec, self.values = rec, values
        self.data = _Pointer(next(rec.addresses) if ptr is None else ptr)

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
        self.rec, self.ptr, self.non_blocking = rec, next(rec.addresses), non_blocking

    def __enter__(self):
        self.rec.streams.append(self)
        return self

    def __exit__(self, *exc):
        self.rec.streams.pop()

    def begin_capture(self) -> None:
        self.rec.capturing.add(self.ptr)

    def end_capture(self) -> "FakeGraph":
        self.rec.capturing.discard(self.ptr)
        return FakeGraph(self.rec)

    def is_capturing(self) -> bool:
        return self.ptr in self.rec.capturing

    def synchronize(self) -> None:
        self.rec.record("synchronize", self.ptr)


class FakeGraph:
    def __init__(self, rec: Recorder):
        self.rec = rec

    def launch(self, stream=None) -> None:
        self.rec.record("graph_launch", stream.ptr if stream is not None else self.rec.current())


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
        self.rec.record("launch", stream.ptr if stream is not None else self.rec.current(), entry=self.name,
                        grid=grid, block=block)


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
        memcpyAsync=lambda dst, src, n, kind, stream: rec.record("memcpy", stream, nbytes=n))
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
    cupy.empty = lambda shape, dtype=np.float32: FakeArray(rec, np.zeros(shape, dtype=dtype))
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.function": function,
            "cupy_backends.cuda.libs.cublas": cuda.cublas}


# -- libcublas / libcublasLt stand-ins (the ctypes functions the runtime's binding calls) ---------------

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

    def cublasGemmStridedBatchedEx(self, handle, *args):
        assert len(args) == 22, len(args)
        self.rec.record("gemm", self.rec.current(), api="cublas", handle=_value(handle), m=args[2], n=args[3],
                        k=args[4], compute=args[20], capturing_any=self.rec.any_capturing())
        return 0


class FakeCublasLtLib:
    """libcublasLt: `heuristic_results` algorithms from the heuristic, `matmul_status` from cublasLtMatmul."""

    def __init__(self, rec: Recorder, heuristic_results: int = 1, matmul_status: int = 0):
        self.rec, self.heuristic_results, self.matmul_status = rec, heuristic_results, matmul_status
        self.objects = itertools.count(1)

    def _create(self, out, op: str, **details):
        _value(out).value = next(self.objects)
        self.rec.record(op, 0, id=_value(out).value, **details)
        return 0

    def cublasLtCreate(self, handle):
        return self._create(handle, "ltCreate")

    def cublasLtDestroy(self, handle):
        return 0

    def cublasLtMatmulDescCreate(self, desc, compute, scale):
        return self._create(desc, "ltDescCreate", compute=compute, scale=scale)

    def cublasLtMatrixLayoutCreate(self, layout, dtype, rows, cols, ld):
        return self._create(layout, "ltLayoutCreate", dtype=dtype, rows=rows, cols=cols, ld=ld)

    def cublasLtMatmulPreferenceCreate(self, pref):
        return self._create(pref, "ltPreferenceCreate")

    def _attribute(self, op, obj, attr, buf, size):
        value = _value(buf)
        assert ctypes.sizeof(value) == size
        self.rec.record(op, 0, obj=_value(obj), attr=attr, value=value.value)
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
        self.rec.record("gemm", _stream_of(stream), api="cublasLt", algo=_value(algo).data[0],
                        workspace=_value(workspace), nbytes=nbytes, status=self.matmul_status)
        return self.matmul_status

    def cublasLtMatrixLayoutDestroy(self, layout):
        return 0

    def cublasLtMatmulDescDestroy(self, desc):
        return 0

    def cublasLtMatmulPreferenceDestroy(self, pref):
        return 0
