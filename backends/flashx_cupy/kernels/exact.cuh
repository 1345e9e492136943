// Masked products with non-finite operands: the exact path.
//
// A product over a masked tile adds 0 * B[j, :] for each disallowed pair (i, j), which is NaN
// where B holds a NaN or an infinity that row i may not read. In masked tiles the kernels ask
// ``tile_nonfinite`` of B once; where it holds such values, ``poison_allowed`` sets to NaN each
// output element whose allowed pairs read one (the contract: NaN in, NaN out), and
// ``clear_nonfinite`` zeroes them in shared memory before the product.

// The barrier of the THREADS threads that compute (threads 0 .. THREADS - 1): the CTA's, or
// barrier 1 where a producer's threads take no part; and its OR of a predicate.
__device__ __forceinline__ void compute_sync() {
    if constexpr (PRODUCER_THREADS == 0) __syncthreads();
    else asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
}
__device__ __forceinline__ bool compute_sync_or(bool x) {
    if constexpr (PRODUCER_THREADS == 0) return __syncthreads_or(x);
    u32 any;
    asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, 1, %2, p;\nselp.u32 %0, 1, 0, q;\n}"
                 : "=r"(any) : "r"((u32)x), "n"(THREADS) : "memory");
    return any;
}
// The OR of a predicate over the GROUP threads of one role: the computing threads (compute_sync_or),
// or the producer's (barrier 2), which may not wait for each other.
template <int GROUP>
__device__ __forceinline__ bool group_sync_or(bool x) {
    if constexpr (GROUP == THREADS) {
        return compute_sync_or(x);
    } else {
        static_assert(GROUP == PRODUCER_THREADS, "a role's threads");
        u32 any;
        asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, 2, %2, p;\nselp.u32 %0, 1, 0, q;\n}"
                     : "=r"(any) : "r"((u32)x), "n"(GROUP) : "memory");
        return __any_sync(0xffffffffu, any);  // voted again, so that ptxas keeps what follows from it uniform
    }
}

// Whether rows [0, ROWS) of a shared tile hold a NaN or an infinity (an answer of the computing
// threads). The warp votes on it once more so that ptxas sees it uniform: a branch on it that it
// takes for divergent makes it serialize every wgmma of the kernel.
// 16-bit tiles are read in 16-byte chunks (rows 16-byte aligned): with dropout every tile asks.
template <int ROWS, int COLS, int LD>
__device__ __forceinline__ bool tile_nonfinite(const elem_t* s) {
    int bad = 0;
    if constexpr (sizeof(elem_t) == 2 && COLS % 8 == 0 && LD % 8 == 0) {
        for (int idx = threadIdx.x; idx < ROWS * COLS / 8; idx += THREADS) {
            const uint4 chunk = *(const uint4*)(s + idx / (COLS / 8) * LD + idx % (COLS / 8) * 8);
            const elem_t* x = (const elem_t*)&chunk;
#pragma unroll
            for (int e = 0; e < 8; ++e) bad |= !finite_bits(x[e]);
        }
    } else {
        for (int idx = threadIdx.x; idx < ROWS * COLS; idx += THREADS) bad |= !finite_bits(s[(idx / COLS) * LD + idx % COLS]);
    }
    return __any_sync(0xffffffffu, compute_sync_or(bad));
}

template <int ROWS, int COLS, int LD>
__device__ __forceinline__ void clear_nonfinite(elem_t* s) {
    for (int idx = threadIdx.x; idx < ROWS * COLS; idx += THREADS) {
        elem_t& x = s[(idx / COLS) * LD + idx % COLS];
        if (!finite_bits(x)) x = from_float(0.f);
    }
}

// poison(mt, nt, e) for each element [mt][nt][e] of an m16n8 accumulator C (MT x N / 8 atoms: this
// warp's rows r, N columns c) where some j has reads(r, j) (j < K) and B[j][c] is not finite, B in
// shared memory in ``Layout``; nan_at(C) makes them NaN. ``reads`` tells whether the pair reads B:
// allowed, and for V and dO kept by dropout (a dropped pair reads no V and no dO). Each lane takes
// its rows one at a time, as the set of j it reads (bit j), and meets it with the set of j where B
// is not finite in each of its columns: a few registers, so that this rare path leaves the
// accumulators where they are.
template <int MT, int N>
__device__ __forceinline__ auto nan_at(float (&c)[MT][N / 8][4]) {
    return [&c](int mt, int nt, int e) { c[mt][nt][e] = QUIET_NAN; };
}

template <int MT, int K, int N, typename Layout, typename Reads, typename Poison>
__device__ __forceinline__ void poison_allowed(Reads reads, const elem_t* b, Poison poison) {
    static_assert(K <= 64, "one bit per row of B");
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the atom
            u64 row_reads = 0;
#pragma unroll 1
            for (int j = 0; j < K; ++j) row_reads |= (u64)reads(frag_row(mt, 2 * half), j) << j;
            if (row_reads == 0) continue;
#pragma unroll
            for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = frag_col(nt, e);
                    u64 bad = 0;
#pragma unroll 1
                    for (int j = 0; j < K; ++j) bad |= (u64)!finite_bits(Layout::at(b, j, col)) << j;
                    if (row_reads & bad) poison(mt, nt, 2 * half + e);
                }
        }
}
