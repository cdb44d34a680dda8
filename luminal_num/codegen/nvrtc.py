"""Compile CUDA C to PTX / CUBIN with NVRTC through ctypes, with an in-memory and on-disk kernel cache.

Why ctypes and not CuPy: NVRTC needs no GPU and no driver, so CI (which has neither) compiles every
generated kernel and catches codegen errors; CuPy is only needed to *launch* kernels. The library
comes from CUDA 13's wheels (nvidia/cu13/lib), the `nvidia-cuda-nvrtc-cu12` wheel, a CUDA toolkit
($CUDA_HOME, /usr/local/cuda) or `LUMINAL_NVRTC_LIB`; NVRTC has no built-in CUDA headers, so the
first include folder holding them (beside the library, CUDA 13's nvidia/cu13/include, the
`nvidia-cuda-runtime-cu12` wheel's, a toolkit's) goes on the include path for cuda_fp16.h /
cuda_bf16.h / cuda_fp8.h (cuda_fp8.h pulls in the other two plus vector_types.h from the same folder; <nv/target>, <cstring> and <utility> are
skipped under NVRTC, which provides them implicitly).

Every `*.cuh` in codegen/templates is handed to NVRTC as an in-memory header, so generated sources
`#include "common.cuh"`; their text is part of the cache key, so editing a header invalidates the
cached binaries that could have used it.
"""
from __future__ import annotations

import base64
import ctypes
import ctypes.util
import functools
import hashlib
import importlib.resources
import importlib.util
import json
import os
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

LIBRARY_ENV = "LUMINAL_NVRTC_LIB"
CACHE_ENV = "LUMINAL_KERNEL_CACHE"  # a folder, or "off" to keep the cache in memory only
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "luminal_num" / "kernels"
DEFAULT_OPTIONS = ("--std=c++17",)
_CACHE_FORMAT = 1  # bump when the on-disk entry layout changes
_ARCH = re.compile(r"^(sm|compute)_\d+[af]?$")
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")
_LOG_ERROR = re.compile(r"^(?P<file>[^\s(]+)\((?P<line>\d+)\): (?:catastrophic )?error", re.MULTILINE)
_MAX_ERRORS_SHOWN = 5


class NvrtcUnavailableError(RuntimeError):
    """No usable libnvrtc: the message lists every place that was tried."""


class NvrtcError(RuntimeError):
    """A kernel failed to compile. Carries the NVRTC log and the numbered source it refers to."""

    def __init__(self, name: str, arch: str, source: str, log: str, status: str):
        self.name, self.arch, self.source, self.log, self.status = name, arch, source, log, status
        super().__init__(self._describe())

    @property
    def numbered_source(self) -> str:
        lines = self.source.splitlines()
        width = len(str(len(lines)))
        return "\n".join(f"{number:>{width}} | {text}" for number, text in enumerate(lines, start=1))

    def _describe(self) -> str:
        """First errors with the offending source lines (and a line either side), then the full log."""
        lines = self.source.splitlines()
        parts = [f"NVRTC could not compile kernel {self.name!r} for {self.arch} ({self.status})"]
        errors = [m for m in _LOG_ERROR.finditer(self.log) if m["file"] == f"{self.name}.cu"]
        for match in errors[:_MAX_ERRORS_SHOWN]:
            parts.append(self.log[match.start():].splitlines()[0])
            bad = int(match["line"])
            for number in range(max(1, bad - 1), min(len(lines), bad + 1) + 1):
                parts.append(f"  {'>' if number == bad else ' '} {number:>4} | {lines[number - 1]}")
        if len(errors) > _MAX_ERRORS_SHOWN:
            parts.append(f"... {len(errors) - _MAX_ERRORS_SHOWN} more error(s)")
        parts.append("--- NVRTC log ---")
        parts.append(self.log.strip() or "(empty)")
        return "\n".join(parts)


@dataclass(frozen=True)
class CompiledKernel:
    """A compiled kernel. `arch="sm_XX"` gives a CUBIN (plus PTX when NVRTC keeps it), `compute_XX` PTX."""

    name: str  # the extern "C" entry point a launcher looks up
    arch: str
    ptx: str | None
    cubin: bytes | None
    log: str  # NVRTC's log; warnings survive a successful compile
    key: str  # cache key (sha256 hex)
    compile_seconds: float  # wall time of the NVRTC compile that produced it (also for cache hits)


@dataclass(frozen=True)
class NvrtcToolchain:
    """The libnvrtc in use and the include folders handed to it."""

    library: Path
    version: tuple[int, int]
    include_dirs: tuple[Path, ...]


@dataclass(frozen=True)
class CompileStats:
    """Process-wide counters; tests count compiles with these, never with timings."""

    compiles: int
    memory_hits: int
    disk_hits: int
    compile_seconds: float


# ---------------------------------------------------------------- library loading


# Where NVRTC and the CUDA headers live, newest layout first: CUDA 13's wheels put every library of the
# toolkit under nvidia/cu13/{lib,include}; CUDA 12's give each its own package (nvidia/cuda_nvrtc/lib,
# nvidia/cuda_runtime/include); a toolkit has lib64/ and include/ under $CUDA_HOME (or /usr/local/cuda).
LIBRARY_PACKAGES = ("nvidia.cu13", "nvidia.cuda_nvrtc", "nvidia.cu12")
HEADER_PACKAGES = ("nvidia.cu13", "nvidia.cuda_runtime", "nvidia.cu12")
TOOLKIT_ENVS = ("CUDA_HOME", "CUDA_PATH")
DEFAULT_TOOLKIT = Path("/usr/local/cuda")
HEADER = "cuda_fp16.h"


def _wheel_dirs(package: str) -> list[Path]:
    """Folders of a namespace package such as nvidia.cuda_nvrtc (empty when the wheel is absent)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ModuleNotFoundError, ValueError):
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def _toolkits() -> list[Path]:
    """CUDA toolkit roots: $CUDA_HOME, $CUDA_PATH, then /usr/local/cuda (those that exist)."""
    roots = [Path(os.environ[env]) for env in TOOLKIT_ENVS if os.environ.get(env)] + [DEFAULT_TOOLKIT]
    return [root for root in dict.fromkeys(roots) if root.is_dir()]


def _library_candidates(override: str | None) -> list[str]:
    """LUMINAL_NVRTC_LIB alone when set (an explicit choice must not silently fall back), else the
    wheels' library (CUDA 13 then 12 layout), a toolkit's, then whatever the system linker finds."""
    if override:
        return [override]
    folders = [d / "lib" for package in LIBRARY_PACKAGES for d in _wheel_dirs(package)]
    folders += [root / sub for root in _toolkits() for sub in ("lib64", "lib")]
    libs = [str(lib) for folder in folders for lib in sorted(folder.glob("libnvrtc.so*"))]
    system = ctypes.util.find_library("nvrtc")
    return list(dict.fromkeys(libs + ([system] if system else [])))


def _include_dirs(library: Path) -> tuple[Path, ...]:
    """The first folder holding cuda_fp16.h: next to the library (a toolkit or the CUDA 13 wheel), the
    header wheels', then a toolkit's."""
    candidates = [library.resolve().parent.parent / "include", library.parent.parent / "include"]
    candidates += [d / "include" for package in HEADER_PACKAGES for d in _wheel_dirs(package)]
    candidates += [root / "include" for root in _toolkits()]
    for folder in dict.fromkeys(candidates):
        if (folder / HEADER).is_file():
            return (folder,)
    return ()


_PROGRAM, _PROGRAM_OUT = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
_STRINGS, _INT_OUT, _SIZE_OUT = ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_size_t)
# name -> (restype, argtypes) of the NVRTC calls used here; checked against nvrtc.h by tests/test_cuda_headers.py.
SIGNATURES: Mapping[str, tuple[object, tuple]] = MappingProxyType({
    "nvrtcVersion": (ctypes.c_int, (_INT_OUT, _INT_OUT)),
    "nvrtcCreateProgram": (ctypes.c_int, (_PROGRAM_OUT, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, _STRINGS,
                                          _STRINGS)),
    "nvrtcDestroyProgram": (ctypes.c_int, (_PROGRAM_OUT,)),
    "nvrtcCompileProgram": (ctypes.c_int, (_PROGRAM, ctypes.c_int, _STRINGS)),
    "nvrtcGetProgramLogSize": (ctypes.c_int, (_PROGRAM, _SIZE_OUT)),
    "nvrtcGetProgramLog": (ctypes.c_int, (_PROGRAM, ctypes.c_char_p)),
    "nvrtcGetPTXSize": (ctypes.c_int, (_PROGRAM, _SIZE_OUT)),
    "nvrtcGetPTX": (ctypes.c_int, (_PROGRAM, ctypes.c_char_p)),
    "nvrtcGetCUBINSize": (ctypes.c_int, (_PROGRAM, _SIZE_OUT)),
    "nvrtcGetCUBIN": (ctypes.c_int, (_PROGRAM, ctypes.c_char_p)),
    "nvrtcGetErrorString": (ctypes.c_char_p, (ctypes.c_int,)),
})


def _declare(lib: ctypes.CDLL) -> None:
    """Argument types for the NVRTC calls used here (ctypes would otherwise guess int)."""
    for function, (restype, argtypes) in SIGNATURES.items():
        getattr(lib, function).argtypes = list(argtypes)
        getattr(lib, function).restype = restype


@functools.cache
def _load(override: str | None) -> tuple[ctypes.CDLL, NvrtcToolchain] | str:
    """Load libnvrtc once per LUMINAL_NVRTC_LIB value; returns the library or why none loaded."""
    failures = []
    for candidate in _library_candidates(override):
        try:
            lib = ctypes.CDLL(candidate)
            _declare(lib)
        except (OSError, AttributeError) as error:
            failures.append(f"{candidate}: {error}")
            continue
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        path = Path(candidate)
        return lib, NvrtcToolchain(path, (major.value, minor.value), _include_dirs(path))
    tried = "; ".join(failures) or (f"{LIBRARY_ENV}={override}" if override else
                                    "no libnvrtc.so* under nvidia/cu13/lib, nvidia/cuda_nvrtc/lib, $CUDA_HOME, "
                                    "/usr/local/cuda or the system linker's path")
    return (f"libnvrtc could not be loaded (tried: {tried}). Install it with "
            f"`pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12` or point {LIBRARY_ENV} at a libnvrtc.so")


def _library() -> tuple[ctypes.CDLL, NvrtcToolchain]:
    loaded = _load(os.environ.get(LIBRARY_ENV) or None)
    if isinstance(loaded, str):
        raise NvrtcUnavailableError(loaded)
    return loaded


def toolchain() -> NvrtcToolchain:
    """The libnvrtc in use; raises NvrtcUnavailableError (saying what was tried) when there is none."""
    return _library()[1]


def nvrtc_available() -> bool:
    """True when a libnvrtc loads. Never raises."""
    return not isinstance(_load(os.environ.get(LIBRARY_ENV) or None), str)


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC; raises NvrtcUnavailableError when there is none."""
    return toolchain().version


# ---------------------------------------------------------------- headers and keys


@functools.cache
def template_headers() -> Mapping[str, str]:
    """Every codegen/templates/*.cuh by file name: the headers generated kernels may #include."""
    folder = importlib.resources.files("luminal_num.codegen") / "templates"
    return MappingProxyType({entry.name: entry.read_text(encoding="utf-8")
                             for entry in sorted(folder.iterdir(), key=lambda e: e.name)
                             if entry.name.endswith(".cuh")})


def kernel_cache_key(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> str:
    """sha256 over everything that decides the binary: source, entry name, arch, options, the
    template headers and the NVRTC version (a toolchain upgrade must not reuse old binaries)."""
    identity = {"format": _CACHE_FORMAT, "source": source, "name": name, "arch": arch,
                "options": list(options), "headers": dict(template_headers()),
                "nvrtc": list(nvrtc_version())}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- compiling


def _status(lib: ctypes.CDLL, code: int) -> str:
    return lib.nvrtcGetErrorString(code).decode()


def _read_output(lib: ctypes.CDLL, program: ctypes.c_void_p, what: str) -> bytes | None:
    """The program's log, PTX or CUBIN; None when NVRTC did not produce that output."""
    size = ctypes.c_size_t()
    if getattr(lib, f"nvrtcGet{what}Size")(program, ctypes.byref(size)) != 0 or size.value == 0:
        return None
    buffer = ctypes.create_string_buffer(size.value)
    if getattr(lib, f"nvrtcGet{what}")(program, buffer) != 0:
        return None
    return buffer.raw[:size.value]


def _text(raw: bytes | None) -> str:
    return (raw or b"").rstrip(b"\0").decode("utf-8", errors="replace")


def _nvrtc_compile(source: str, name: str, arch: str, options: tuple[str, ...], key: str) -> CompiledKernel:
    lib, tools = _library()
    headers = template_headers()
    header_sources = (ctypes.c_char_p * len(headers))(*(text.encode() for text in headers.values()))
    header_names = (ctypes.c_char_p * len(headers))(*(n.encode() for n in headers))
    flags = [f"--gpu-architecture={arch}", *(f"--include-path={d}" for d in tools.include_dirs),
             *DEFAULT_OPTIONS, *options]
    flag_array = (ctypes.c_char_p * len(flags))(*(flag.encode() for flag in flags))
    program = ctypes.c_void_p()
    started = time.perf_counter()
    code = lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(),
                                  len(headers), header_sources, header_names)
    if code != 0:
        raise NvrtcError(name, arch, source, "", _status(lib, code))
    try:
        code = lib.nvrtcCompileProgram(program, len(flags), flag_array)
        log = _text(_read_output(lib, program, "ProgramLog"))
        if code != 0:
            if "cannot open source file" in log and not tools.include_dirs:
                log += ("\nno CUDA include folder was found: install nvidia-cuda-runtime-cu12 (or CUDA 13's "
                        "nvidia-cuda-runtime: cuda_fp16.h, cuda_bf16.h, cuda_fp8.h) or set CUDA_HOME to a toolkit")
            raise NvrtcError(name, arch, source, log, _status(lib, code))
        ptx = _read_output(lib, program, "PTX")
        cubin = _read_output(lib, program, "CUBIN") if arch.startswith("sm_") else None
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))
    elapsed = time.perf_counter() - started
    ptx_text = _text(ptx) if ptx else None
    if ptx_text is not None and not re.search(rf"\.entry\s+{re.escape(name)}\s*\(", ptx_text):
        raise NvrtcError(name, arch, source, log + f"\nno kernel entry named {name!r} in the output: "
                         f"declare it `extern \"C\" __global__ void {name}(...)` so its name is not mangled",
                         "missing entry point")
    return CompiledKernel(name, arch, ptx_text, cubin, log, key, elapsed)


# ---------------------------------------------------------------- caching


class _Cache:
    """Memory cache + per-key locks (one compile per key even under concurrent callers) + counters."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kernels: dict[str, CompiledKernel] = {}
        self.key_locks: dict[str, threading.Lock] = {}
        self.compiles = self.memory_hits = self.disk_hits = 0
        self.compile_seconds = 0.0


_CACHE = _Cache()


def cache_dir() -> Path | None:
    """The on-disk cache folder ($LUMINAL_KERNEL_CACHE, default ~/.cache/luminal_num/kernels); None if "off"."""
    setting = os.environ.get(CACHE_ENV)
    if setting == "off":
        return None
    return Path(setting).expanduser() if setting else DEFAULT_CACHE_DIR


def _disk_load(folder: Path, key: str) -> CompiledKernel | None:
    """A cached entry, or None when missing or unreadable (a damaged entry is recompiled, not fatal)."""
    try:
        record = json.loads((folder / f"{key}.json").read_text(encoding="utf-8"))
        cubin = record.pop("cubin")
        kernel = CompiledKernel(**record, cubin=None if cubin is None else base64.b64decode(cubin))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return kernel if kernel.key == key else None


def _disk_store(folder: Path, kernel: CompiledKernel) -> None:
    """Atomic write (temp file in the same folder + os.replace): readers never see half an entry."""
    record = asdict(kernel)
    record["cubin"] = None if kernel.cubin is None else base64.b64encode(kernel.cubin).decode("ascii")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False, encoding="utf-8") as handle:
            json.dump(record, handle)
        os.replace(handle.name, folder / f"{kernel.key}.json")
    except OSError as error:
        warnings.warn(f"kernel cache not written to {folder}: {error}", RuntimeWarning, stacklevel=3)


def compile_cuda(source: str, name: str, arch: str = "sm_90", options: tuple[str, ...] = ()) -> CompiledKernel:
    """Compile `source` whose extern "C" kernel `name` the runtime will launch.

    Returns the cached CompiledKernel when this (source, name, arch, options) was compiled before, in
    this process (the same object) or on disk. Raises NvrtcError on a compile error and
    NvrtcUnavailableError when there is no libnvrtc. Thread-safe.
    """
    if not _IDENTIFIER.match(name):
        raise ValueError(f"kernel name must be a C identifier, got {name!r}")
    if not _ARCH.match(arch):
        raise ValueError(f"arch must look like 'sm_90' (CUBIN) or 'compute_90' (PTX), got {arch!r}")
    options = tuple(options)
    key = kernel_cache_key(source, name, arch, options)
    with _CACHE.lock:
        if key in _CACHE.kernels:
            _CACHE.memory_hits += 1
            return _CACHE.kernels[key]
        key_lock = _CACHE.key_locks.setdefault(key, threading.Lock())
    with key_lock:
        with _CACHE.lock:
            if key in _CACHE.kernels:  # another thread compiled it while this one waited
                _CACHE.memory_hits += 1
                return _CACHE.kernels[key]
        folder = cache_dir()
        kernel = _disk_load(folder, key) if folder else None
        from_disk = kernel is not None
        if kernel is None:
            kernel = _nvrtc_compile(source, name, arch, options, key)
            if folder:
                _disk_store(folder, kernel)
        with _CACHE.lock:
            _CACHE.kernels[key] = kernel
            _CACHE.key_locks.pop(key, None)
            if from_disk:
                _CACHE.disk_hits += 1
            else:
                _CACHE.compiles += 1
                _CACHE.compile_seconds += kernel.compile_seconds
    return kernel


def compile_stats() -> CompileStats:
    """A snapshot of the process-wide compile / cache-hit counters."""
    with _CACHE.lock:
        return CompileStats(_CACHE.compiles, _CACHE.memory_hits, _CACHE.disk_hits, _CACHE.compile_seconds)


def clear_memory_cache() -> None:
    """Forget compiled kernels held in memory (the disk cache and the counters stay)."""
    with _CACHE.lock:
        _CACHE.kernels.clear()
