"""The C text of the megakernel's persistent interpreter loop (codegen/megakernel_cuda.py fills it in).

`PRELUDE` goes before the inlined bodies: the shared tile the bodies' builtins read (`blockIdx`, `gridDim`,
`blockDim`, `threadIdx` as macros over the current tile, `__syncthreads()` a named barrier over the body's threads).
`LOOP` goes after them: the loop that pops a queue entry, prefetches the tile's weight rows, whole-read inputs and
KV-cache spans into L2, spins on its barrier counters, runs any row op and scale launch it recomputes into its
block's own copies, runs the body and signals. Placeholders: CASES (the switch's cases), ENTRY_NAME, BLOCK
(threads), BAND_ROWS, LINE_BYTES.
Why a module of its own: the loop is fixed C text, the renderer is the code that decides what it runs.
"""

PRELUDE = r"""
struct LnMkTile { uint3 bid; uint3 grid; uint3 bdim; unsigned nthreads; long long tile; int private_slot;
                 void* private_copy; int scale_slot; void* scale_copy; };
__shared__ LnMkTile ln_mk;  // the tile the block runs: what the bodies' builtins read
static __device__ __forceinline__ uint3 ln_mk_tid() {
    const unsigned t = threadIdx.x;
    return make_uint3(t % ln_mk.bdim.x, (t / ln_mk.bdim.x) % ln_mk.bdim.y, t / (ln_mk.bdim.x * ln_mk.bdim.y));
}
static __device__ __forceinline__ void ln_mk_sync() {  // a barrier over the body's threads only
    asm volatile("bar.sync 1, %0;" :: "r"(ln_mk.nthreads) : "memory");
}
static __device__ __forceinline__ unsigned ln_mk_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
#define blockIdx (ln_mk.bid)
#define gridDim (ln_mk.grid)
#define blockDim (ln_mk.bdim)
#define threadIdx (ln_mk_tid())
#define __syncthreads() ln_mk_sync()
"""

LOOP = r"""
#undef blockIdx
#undef gridDim
#undef blockDim
#undef threadIdx
#undef __syncthreads
#define LN_MK_SPIN_LIMIT (1ull << 25)  /* >= 2 s of 64 ns sleeps: far past any producer tile */
#define LN_MK_BAND BAND_ROWS  /* weight rows per grid y of a Gemm body (codegen/weight_stream.BAND) */
#define LN_MK_LINE LINE_BYTES  /* bytes per L2 prefetch */
struct LnMkOp { int body; long long first_entry, tiles; int gx, gy, gz, bx, by, bz; long long counter_base;
                int stride, wait_begin, wait_end; long long elements; int prefetch_begin, prefetch_end;
                int recompute, private_slot; int span_begin, span_per_tile; int scale_recompute, scale_slot; };
struct LnMkWait { int producer; long long read_elements; };
struct LnMkPrefetch { long long row_bytes, rows, per, offset, n_out; int slot; };
struct LnMkSpan { long long first, between, keys, per_key; int slot; };

static __device__ __forceinline__ void* ln_mk_buf(void* const* bufs, int slot) {
    // the value (or the scales) a recomputing tile made in its block's own copies, else the value's buffer
    return slot == ln_mk.private_slot ? ln_mk.private_copy : slot == ln_mk.scale_slot ? ln_mk.scale_copy : bufs[slot];
}
static __device__ __forceinline__ void ln_mk_enter(const LnMkOp& op, long long t) {  // thread 0: the tile bodies see
    ln_mk.bid = make_uint3(t % op.gx, (t / op.gx) % op.gy, t / ((long long)op.gx * op.gy));
    ln_mk.grid = make_uint3(op.gx, op.gy, op.gz);
    ln_mk.bdim = make_uint3(op.bx, op.by, op.bz);
    ln_mk.nthreads = op.bx * op.by * op.bz;
    ln_mk.tile = t;
}
static __device__ void ln_mk_run(int body, void* const* bufs) {
    switch (body) {
CASES
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK) ENTRY_NAME(
        const LnMkOp* __restrict__ ops, int n_ops, const LnMkWait* __restrict__ waits,
        const LnMkPrefetch* __restrict__ prefetch, const LnMkSpan* __restrict__ spans, unsigned* counters,
        unsigned long long* head, unsigned long long total, void* const* bufs, char* privates,
        long long private_bytes, long long private_split) {
    __shared__ unsigned long long entry;
    __shared__ int current;
    for (;;) {
        if (threadIdx.x == 0) entry = atomicAdd(head, 1ULL);
        __syncthreads();
        const unsigned long long e = entry;
        if (e >= total) return;
        if (threadIdx.x == 0) {
            int lo = 0, hi = n_ops - 1;  // the op whose entries hold e
            while (lo < hi) { const int mid = (lo + hi + 1) / 2; if (ops[mid].first_entry <= (long long)e) lo = mid; else hi = mid - 1; }
            ln_mk_enter(ops[lo], (long long)e - ops[lo].first_entry);
            ln_mk.private_slot = -1;
            ln_mk.scale_slot = -1;
            current = lo;
        }
        __syncthreads();
        for (int p = ops[current].prefetch_begin; p < ops[current].prefetch_end; ++p) {
            // the tile's own weight rows depend on no barrier: every thread prefetches lines into L2 before the wait,
            // band by band: bands y, y + grid y, ... (the Gemm bodies loop grid-stride)
            const LnMkPrefetch f = prefetch[p];
            const char* base = (const char*)bufs[f.slot];
            if (f.per == 0) {  // an input every tile reads whole (a norm's weight, a rope table, an index): all of it
                for (long long b = (long long)threadIdx.x * LN_MK_LINE; b < f.row_bytes;
                     b += (long long)blockDim.x * LN_MK_LINE)
                    asm volatile("prefetch.global.L2 [%0];" :: "l"(base + b));
                continue;
            }
            for (long long band = ln_mk.bid.y; band * LN_MK_BAND < f.n_out; band += ln_mk.grid.y) {
                const long long first = band * LN_MK_BAND + f.offset;
                const long long end = min(band * LN_MK_BAND + LN_MK_BAND, f.n_out) + f.offset;
                const long long lo = first / f.per * f.row_bytes, hi = min((end - 1) / f.per + 1, f.rows) * f.row_bytes;
                for (long long b = lo / LN_MK_LINE * LN_MK_LINE + (long long)threadIdx.x * LN_MK_LINE; b < hi;
                     b += (long long)blockDim.x * LN_MK_LINE)
                    asm volatile("prefetch.global.L2 [%0];" :: "l"(base + b));
            }
        }
        for (int p = ops[current].span_begin + (int)ln_mk.tile * ops[current].span_per_tile,
                 p_end = p + ops[current].span_per_tile; p < p_end; ++p) {
            // the KV-cache rows written before the kernel (and this step's, a hint only): lines into L2 before the wait
            const LnMkSpan f = spans[p];
            const long long per_key = (f.per_key + LN_MK_LINE - 1) / LN_MK_LINE + 1;  // lines a key's span can touch
            const char* base = (const char*)bufs[f.slot];
            for (long long q = threadIdx.x; q < f.keys * per_key; q += blockDim.x) {
                const long long lo = f.first + q / per_key * f.between;
                const long long b = (lo / LN_MK_LINE + q % per_key) * LN_MK_LINE;
                if (b < lo + f.per_key) asm volatile("prefetch.global.L2 [%0];" :: "l"(base + b));
            }
        }
        if (threadIdx.x == 0) {
            const LnMkOp op = ops[current];
            const long long t = ln_mk.tile;
            for (int w = op.wait_begin; w < op.wait_end; ++w) {  // the producer tiles this tile reads
                const LnMkOp p = ops[waits[w].producer];
                long long first = 0, last = p.tiles - 1;
                if (waits[w].read_elements > 0 && p.stride == 1) {
                    first = min(t * waits[w].read_elements / p.elements, p.tiles - 1);
                    last = min(((t + 1) * waits[w].read_elements - 1) / p.elements, p.tiles - 1);
                }
                const unsigned need = p.stride ? 1u : (unsigned)p.tiles;
                for (long long j = first; j <= last; ++j) {
                    const unsigned* c = counters + p.counter_base + j * p.stride;
                    unsigned long long spins = 0;  // a wrong barrier traps (an error), never hangs the device
                    while (ln_mk_acquire(c) < need) { __nanosleep(64); if (++spins > LN_MK_SPIN_LIMIT) __trap(); }
                    if (!p.stride) break;
                }
            }
        }
        __syncthreads();
        if (ops[current].recompute >= 0) {  // a one-tile row op this tile recomputes, into its block's own copy
            if (threadIdx.x == 0) {
                ln_mk_enter(ops[ops[current].recompute], 0);
                ln_mk.private_slot = ops[current].private_slot;
                ln_mk.private_copy = privates + (long long)blockIdx.x * private_bytes;
            }
            __syncthreads();
            if (threadIdx.x < ln_mk.nthreads) ln_mk_run(ops[ops[current].recompute].body, bufs);
            __syncthreads();  // the copy is this block's: visible to its threads after the barrier
        }
        if (ops[current].scale_recompute >= 0) {  // then A's scales (reading that copy), into its second copy
            if (threadIdx.x == 0) {
                ln_mk_enter(ops[ops[current].scale_recompute], 0);
                ln_mk.scale_slot = ops[current].scale_slot;
                ln_mk.scale_copy = privates + (long long)blockIdx.x * private_bytes + private_split;
            }
            __syncthreads();
            if (threadIdx.x < ln_mk.nthreads) ln_mk_run(ops[ops[current].scale_recompute].body, bufs);
            __syncthreads();
        }
        if (ops[current].recompute >= 0 || ops[current].scale_recompute >= 0) {
            if (threadIdx.x == 0) ln_mk_enter(ops[current], (long long)entry - ops[current].first_entry);
            __syncthreads();
        }
        if (threadIdx.x < ln_mk.nthreads) ln_mk_run(ops[current].body, bufs);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0)
            atomicAdd(counters + ops[current].counter_base + ln_mk.tile * ops[current].stride, 1u);
        __syncthreads();
    }
}
"""
