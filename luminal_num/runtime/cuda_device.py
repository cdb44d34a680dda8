"""Is there a CUDA device to run kernels on? One cached probe, answered without ever raising.

Why a probe of its own: the CUDA backend and the GPU tests must degrade to the CPU backend (and to
compile-only checks) on machines without a GPU, the normal case in CI. CuPy imports cleanly without a
GPU and `cupy.is_available()` returns False there; any device call would raise, so nothing else is
touched unless the probe succeeded.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

INSTALL_HINT = "pip install -e '.[gpu]'"


class CudaUnavailableError(RuntimeError):
    """Raised by require_cuda(): says what was tried and how to get a working setup."""


@dataclass(frozen=True)
class CudaProbe:
    """What the probe found: a device name, or the reason there is none."""

    available: bool
    device_name: str | None
    compute_capability: str | None  # e.g. "90" for an H100/H200
    reason: str  # why not available ("" when available)


@functools.cache
def probe() -> CudaProbe:
    """Import CuPy and ask it for device 0, once per process (call probe.cache_clear() to re-probe)."""
    try:
        cupy = importlib.import_module("cupy")
    except Exception as error:  # ImportError, or a broken install raising something else
        return CudaProbe(False, None, None, f"`import cupy` failed ({type(error).__name__}: {error})")
    try:
        if not cupy.is_available():
            return CudaProbe(False, None, None,
                             "cupy imported but cupy.is_available() is False (no CUDA device or driver)")
        properties = cupy.cuda.runtime.getDeviceProperties(0)
        name = properties["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        capability = f"{properties['major']}{properties['minor']}"
    except Exception as error:  # CUDARuntimeError and friends: a broken driver must not crash the caller
        return CudaProbe(False, None, None, f"cupy could not query device 0 ({type(error).__name__}: {error})")
    return CudaProbe(True, name, capability, "")


def cuda_available() -> bool:
    """True when CuPy sees at least one CUDA device. Never raises."""
    return probe().available


def device_name() -> str | None:
    """Name of CUDA device 0 (e.g. 'NVIDIA H200'), or None without one. Never raises."""
    return probe().device_name


def require_cuda() -> CudaProbe:
    """The probe when a device is usable; otherwise CudaUnavailableError saying what was tried."""
    found = probe()
    if not found.available:
        raise CudaUnavailableError(
            f"no CUDA device available: {found.reason}. Tried: import cupy, cupy.is_available(), "
            f"cupy.cuda.runtime.getDeviceProperties(0). Install the GPU extra with `{INSTALL_HINT}` "
            "on a machine with an NVIDIA GPU and driver, or use the CPU backend.")
    return found
