// luminal_num: device helpers shared by every generated kernel.
//
// Generated sources write `#include "common.cuh"`; the compile layer (luminal_num/codegen/nvrtc.py)
// hands this file to NVRTC as an in-memory header and folds its text into the kernel cache key, so
// editing it invalidates cached binaries. It includes no CUDA headers itself: a kernel that stores
// f16/bf16/fp8 includes the headers listed by ctypes_map.headers_for(), so f32-only kernels do not
// pay for parsing cuda_fp8.h.
//
// Conventions
// * Every kernel is `extern "C"` (unmangled name, so the runtime finds it by its plan name).
// * Symbolic dimensions: a kernel whose shapes depend on run-time sizes (sequence length, batch)
//   takes `const long long* dyn_dims` as its LAST parameter; entry k holds the value of symbol k in
//   the order the plan lists its symbols. Index expressions read them through LN_DYN(k).
// * Indices and offsets are `long long`: a 2^31-element buffer is ordinary on an H200.
#pragma once

#define LN_DYN(k) (dyn_dims[(k)])

// Grid-stride loop over [0, n): correct for any grid size, so launch configuration is a tuning
// choice rather than a correctness one.
#define LN_GRID_STRIDE_LOOP(i, n) \
    for (long long i = ln_global_thread_index(); i < (long long)(n); i += ln_grid_stride())

static __device__ __forceinline__ long long ln_global_thread_index() {
    return (long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x;
}

static __device__ __forceinline__ long long ln_grid_stride() {
    return (long long)gridDim.x * (long long)blockDim.x;
}

static __host__ __device__ __forceinline__ long long ln_ceil_div(long long a, long long b) {
    return (a + b - 1) / b;
}

// Offset of the `linear`-th element (row-major over `shape`) in a strided view: the device half of
// a ShapeTracker view. A broadcast dimension has stride 0; `base` is the view's element offset.
static __device__ __forceinline__ long long ln_view_offset(long long linear, int ndim,
                                                           const long long* shape,
                                                           const long long* strides,
                                                           long long base) {
    long long offset = base;
    for (int d = ndim - 1; d >= 0; --d) {
        const long long coord = linear % shape[d];
        linear /= shape[d];
        offset += coord * strides[d];
    }
    return offset;
}

// Clamp to [-max_finite, max_finite] keeping NaN as NaN (fminf/fmaxf alone would turn NaN into a
// bound). Infinities clamp to the bound, the same rule as PTX .satfinite and the CPU emulator's clip.
static __device__ __forceinline__ float ln_sat_finite(float x, float max_finite) {
    return (x != x) ? x : fminf(fmaxf(x, -max_finite), max_finite);
}

static __device__ __forceinline__ double ln_sat_finite(double x, double max_finite) {
    return (x != x) ? x : fmin(fmax(x, -max_finite), max_finite);
}

static __device__ __forceinline__ int ln_clamp_int(int x, int lo, int hi) {
    return min(max(x, lo), hi);
}

// Wrap raw fp8 storage bits (what __nv_cvt_float_to_fp8 returns) in an fp8 class such as
// __nv_fp8_e4m3: the intrinsics take the saturation mode explicitly, the class constructors do not.
template <class Fp8>
static __device__ __forceinline__ Fp8 ln_fp8_from_bits(unsigned char bits) {
    Fp8 value;
    value.__x = bits;
    return value;
}

