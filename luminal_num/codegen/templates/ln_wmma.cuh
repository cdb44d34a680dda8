// luminal_num: the warp-level MMA subset the tensor-core Gemm uses (codegen/cuda_gemm_tc.py), written on
// PTX's wmma instructions.
//
// Why not <mma.h>: CUDA's header includes "crt/mma.h", which the nvidia-cuda-runtime wheels this project
// compiles with do not ship (only a full toolkit has it), so a kernel including it fails to compile on a
// machine with wheels only. The PTX instructions need no header. The names and signatures follow
// nvcuda::wmma (fragment, fill_fragment, load_matrix_sync, mma_sync, store_matrix_sync, __float_to_tf32)
// for the combinations used here: A row-major and B column-major in f16 / bf16 (m16n16k16), tf32
// (m16n16k8) and s8 (m16n16k16); FP32 or INT32 accumulators, stored row-major. Fragment registers hold
// elements in the instruction's (unspecified) lane layout; kernels only move whole fragments.
// Integer MMA without .satfinite wraps modulo 2^32, as the tiled kernel's unsigned accumulator does.
#pragma once
#include <cuda_fp16.h>  // __half and __nv_bfloat16 name the fragment types: the header needs them first
#include <cuda_bf16.h>

namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
namespace precision { struct tf32 {}; }
enum layout_t { mem_row_major };

template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment;

#define LN_WMMA_FRAGMENT(USE, K, T, LAYOUT, REG, COUNT)                                            \
    template <> struct fragment<USE, 16, 16, K, T, LAYOUT> {                                        \
        REG x[COUNT];                                                                                  \
        static constexpr int num_elements = COUNT;                                                     \
    };
LN_WMMA_FRAGMENT(matrix_a, 16, __half, row_major, unsigned int, 8)
LN_WMMA_FRAGMENT(matrix_b, 16, __half, col_major, unsigned int, 8)
LN_WMMA_FRAGMENT(matrix_a, 16, __nv_bfloat16, row_major, unsigned int, 4)
LN_WMMA_FRAGMENT(matrix_b, 16, __nv_bfloat16, col_major, unsigned int, 4)
LN_WMMA_FRAGMENT(matrix_a, 8, precision::tf32, row_major, unsigned int, 4)
LN_WMMA_FRAGMENT(matrix_b, 8, precision::tf32, col_major, unsigned int, 4)
LN_WMMA_FRAGMENT(matrix_a, 16, signed char, row_major, unsigned int, 2)
LN_WMMA_FRAGMENT(matrix_b, 16, signed char, col_major, unsigned int, 2)
LN_WMMA_FRAGMENT(accumulator, 16, float, void, float, 8)
LN_WMMA_FRAGMENT(accumulator, 8, float, void, float, 8)
LN_WMMA_FRAGMENT(accumulator, 16, int, void, int, 8)
#undef LN_WMMA_FRAGMENT

template <int K> __device__ __forceinline__ void fill_fragment(fragment<accumulator, 16, 16, K, float>& f, float v) {
    for (int i = 0; i < 8; ++i) f.x[i] = v;
}
__device__ __forceinline__ void fill_fragment(fragment<accumulator, 16, 16, 16, int>& f, int v) {
    for (int i = 0; i < 8; ++i) f.x[i] = v;
}

// cvt.rna.tf32.f32: round to TF32, ties away from zero (the identity on a value that is already TF32)
__device__ __forceinline__ float __float_to_tf32(float x) {
    unsigned int r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return __uint_as_float(r);
}

#define LN_R8(f) "=r"(f.x[0]), "=r"(f.x[1]), "=r"(f.x[2]), "=r"(f.x[3]), "=r"(f.x[4]), "=r"(f.x[5]), "=r"(f.x[6]), "=r"(f.x[7])
#define LN_R4(f) "=r"(f.x[0]), "=r"(f.x[1]), "=r"(f.x[2]), "=r"(f.x[3])
#define LN_R2(f) "=r"(f.x[0]), "=r"(f.x[1])

__device__ __forceinline__ void load_matrix_sync(fragment<matrix_a, 16, 16, 16, __half, row_major>& f, const __half* p, unsigned ldm) {
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;" : LN_R8(f) : "l"(p), "r"(ldm) : "memory");
}
__device__ __forceinline__ void load_matrix_sync(fragment<matrix_b, 16, 16, 16, __half, col_major>& f, const __half* p, unsigned ldm) {
    asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;" : LN_R8(f) : "l"(p), "r"(ldm) : "memory");
}
__device__ __forceinline__ void load_matrix_sync(fragment<matrix_a, 16, 16, 16, __nv_bfloat16, row_major>& f, const __nv_bfloat16* p, unsigned ldm) {
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.bf16 {%0,%1,%2,%3}, [%4], %5;" : LN_R4(f) : "l"(p), "r"(ldm) : "memory");
}
__device__ __forceinline__ void load_matrix_sync(fragment<matrix_b, 16, 16, 16, __nv_bfloat16, col_major>& f, const __nv_bfloat16* p, unsigned ldm) {
    asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.bf16 {%0,%1,%2,%3}, [%4], %5;" : LN_R4(f) : "l"(p), "r"(ldm) : "memory");
}
__device__ __forceinline__ void load_matrix_sync(fragment<matrix_a, 16, 16, 8, precision::tf32, row_major>& f, const float* p, unsigned ldm) {
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k8.tf32 {%0,%1,%2,%3}, [%4], %5;" : LN_R4(f) : "l"(p), "r"(ldm) : "memory");
}
__device__ __forceinline__ void load_matrix_sync(fragment<matrix_b, 16, 16, 8, precision::tf32, col_major>& f, const float* p, unsigned ldm) {
    asm volatile("wmma.load.b.sync.aligned.col.m16n16k8.tf32 {%0,%1,%2,%3}, [%4], %5;" : LN_R4(f) : "l"(p), "r"(ldm) : "memory");
}
__device__ __forceinline__ void load_matrix_sync(fragment<matrix_a, 16, 16, 16, signed char, row_major>& f, const signed char* p, unsigned ldm) {
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.s8 {%0,%1}, [%2], %3;" : LN_R2(f) : "l"(p), "r"(ldm) : "memory");
}
__device__ __forceinline__ void load_matrix_sync(fragment<matrix_b, 16, 16, 16, signed char, col_major>& f, const signed char* p, unsigned ldm) {
    asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.s8 {%0,%1}, [%2], %3;" : LN_R2(f) : "l"(p), "r"(ldm) : "memory");
}
#undef LN_R8
#undef LN_R4
#undef LN_R2

#define LN_D8(d, c) "=f"(d.x[0]), "=f"(d.x[1]), "=f"(d.x[2]), "=f"(d.x[3]), "=f"(d.x[4]), "=f"(d.x[5]), "=f"(d.x[6]), "=f"(d.x[7])
#define LN_C8(c) "f"(c.x[0]), "f"(c.x[1]), "f"(c.x[2]), "f"(c.x[3]), "f"(c.x[4]), "f"(c.x[5]), "f"(c.x[6]), "f"(c.x[7])
#define LN_I8(d) "=r"(d.x[0]), "=r"(d.x[1]), "=r"(d.x[2]), "=r"(d.x[3]), "=r"(d.x[4]), "=r"(d.x[5]), "=r"(d.x[6]), "=r"(d.x[7])
#define LN_J8(c) "r"(c.x[0]), "r"(c.x[1]), "r"(c.x[2]), "r"(c.x[3]), "r"(c.x[4]), "r"(c.x[5]), "r"(c.x[6]), "r"(c.x[7])
#define LN_A8(a) "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(a.x[4]), "r"(a.x[5]), "r"(a.x[6]), "r"(a.x[7])
#define LN_A4(a) "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3])
#define LN_A2(a) "r"(a.x[0]), "r"(a.x[1])

__device__ __forceinline__ void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                                         const fragment<matrix_a, 16, 16, 16, __half, row_major>& a,
                                         const fragment<matrix_b, 16, 16, 16, __half, col_major>& b,
                                         const fragment<accumulator, 16, 16, 16, float>& c) {
    asm volatile("wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                 "{%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19,%20,%21,%22,%23}, "
                 "{%24,%25,%26,%27,%28,%29,%30,%31};" : LN_D8(d, c) : LN_A8(a), LN_A8(b), LN_C8(c));
}
__device__ __forceinline__ void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                                         const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, row_major>& a,
                                         const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, col_major>& b,
                                         const fragment<accumulator, 16, 16, 16, float>& c) {
    asm volatile("wmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                 "{%8,%9,%10,%11}, {%12,%13,%14,%15}, {%16,%17,%18,%19,%20,%21,%22,%23};"
                 : LN_D8(d, c) : LN_A4(a), LN_A4(b), LN_C8(c));
}
__device__ __forceinline__ void mma_sync(fragment<accumulator, 16, 16, 8, float>& d,
                                         const fragment<matrix_a, 16, 16, 8, precision::tf32, row_major>& a,
                                         const fragment<matrix_b, 16, 16, 8, precision::tf32, col_major>& b,
                                         const fragment<accumulator, 16, 16, 8, float>& c) {
    asm volatile("wmma.mma.sync.aligned.row.col.m16n16k8.f32.tf32.tf32.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                 "{%8,%9,%10,%11}, {%12,%13,%14,%15}, {%16,%17,%18,%19,%20,%21,%22,%23};"
                 : LN_D8(d, c) : LN_A4(a), LN_A4(b), LN_C8(c));
}
__device__ __forceinline__ void mma_sync(fragment<accumulator, 16, 16, 16, int>& d,
                                         const fragment<matrix_a, 16, 16, 16, signed char, row_major>& a,
                                         const fragment<matrix_b, 16, 16, 16, signed char, col_major>& b,
                                         const fragment<accumulator, 16, 16, 16, int>& c) {
    asm volatile("wmma.mma.sync.aligned.row.col.m16n16k16.s32.s8.s8.s32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                 "{%8,%9}, {%10,%11}, {%12,%13,%14,%15,%16,%17,%18,%19};"
                 : LN_I8(d) : LN_A2(a), LN_A2(b), LN_J8(c));
}
#undef LN_D8
#undef LN_C8
#undef LN_I8
#undef LN_J8
#undef LN_A8
#undef LN_A4
#undef LN_A2

#define LN_S8(f, T) T(f.x[0]), T(f.x[1]), T(f.x[2]), T(f.x[3]), T(f.x[4]), T(f.x[5]), T(f.x[6]), T(f.x[7])
template <int K> __device__ __forceinline__ void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, K, float>& f,
                                                                  unsigned ldm, layout_t) {
    if (K == 8) {
        asm volatile("wmma.store.d.sync.aligned.row.m16n16k8.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
                     :: "l"(p), LN_S8(f, "f"), "r"(ldm) : "memory");
    } else {
        asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
                     :: "l"(p), LN_S8(f, "f"), "r"(ldm) : "memory");
    }
}
__device__ __forceinline__ void store_matrix_sync(int* p, const fragment<accumulator, 16, 16, 16, int>& f, unsigned ldm,
                                                  layout_t) {
    asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.s32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
                 :: "l"(p), LN_S8(f, "r"), "r"(ldm) : "memory");
}
#undef LN_S8

}  // namespace wmma
