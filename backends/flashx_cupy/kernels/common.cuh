// What the forward and backward kernels share: element types, the warp-level products, tile
// loads into shared memory, the pair rule of the contract's "Scores and masking" section and the
// dropout draw of its "Dropout" section.
//
// Compile-time configuration comes from -D macros set by flashx_cupy.variants:
//   DTYPE 0 float16, 1 bfloat16, 2 float32; DIM_QK, DIM_V the head-dim classes (64, 128, 256);
//   BLOCK_M the rows a CTA owns (queries, or keys in the dK/dV kernel), split among WARPS warps;
//   BLOCK_N the rows of the operand it streams through shared memory, two tiles in flight;
//   VARLEN, SEQLENS_Q, SEQLENS_K, BAND, MASK, BLOCK_MASK, DROPOUT (0/1): the features used
//   (SOFTCAP, ALIBI, SINKS: score_mods.cuh);
//   ALIGNED: every operand may be read in 16-byte chunks (cp.async), else element by element.
//
// Every product leaves its result in the accumulator layout of mma.sync.m16n8k16: lane
// (g = lane / 4, t = lane % 4) holds rows g and g + 8, columns 2t and 2t + 1 of each 16 x 8 atom.
// The float32 path computes the same elements with IEEE fma from shared memory (no TF32), so
// the softmax, masking and dropout code is one for all dtypes.
//
// Headers of the toolkit are not used, so NVRTC needs no include path: 16-bit values are raw
// bits, converted with cvt instructions.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

#if DTYPE == 2
typedef float elem_t;
#define TENSOR_CORES 0
#else
typedef u16 elem_t;
#define TENSOR_CORES 1
#endif

#define THREADS (WARPS * 32)
#ifndef PRODUCER_THREADS
#define PRODUCER_THREADS 0  // threads past THREADS that only load tiles (the wgmma forward's producer)
#endif
#define ATOMS (BLOCK_M / (16 * WARPS))             // 16-row atoms of the resident operand per warp
#define CHUNK (16 / (int)sizeof(elem_t))        // elements per 16-byte copy
#define LD_QK (DIM_QK + CHUNK)                  // shared-memory row pitch: 16 bytes of padding
#define LD_V (DIM_V + CHUNK)                    // keeps ldmatrix free of bank conflicts
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF __int_as_float(0xff800000u)
#define QUIET_NAN __int_as_float(0x7fffffff)

// The arguments of every kernel, packed on the host by flashx_cupy.launch.PARAMS (same order,
// 8-byte fields first so that no padding differs between numpy and C).
struct Params {
    u64 q, k, v, o, lse, dout, dq, dk, dv, delta, cu_q, cu_k, seqlens_q, seqlens_k, mask, blocks;
    u64 alibi_slopes, sinks;  // float32: slopes (Hq,) or (B, Hq), sinks (Hq,)
    u64 dsinks_rows;          // float32, shaped and strided like delta: each row's term of dsinks
    // decoding (decode.cu): int32 cache_seqlens (B,) and block_table (B, max_pages); the new tokens;
    // float32 partial results of the splits, (splits, B * Nq * Hq, DIM_V) and (splits, B * Nq * Hq);
    // an FP8 cache's float32 descales (B, Hk), null for 1
    u64 cache_seqlens, block_table, k_new, v_new, o_part, lse_part, k_descale, v_descale;
    i64 q_b, q_n, q_h, q_d, k_b, k_n, k_h, k_d, v_b, v_n, v_h, v_d;
    i64 o_b, o_n, o_h, o_d, do_b, do_n, do_h, do_d;
    i64 dq_b, dq_n, dq_h, dk_b, dk_n, dk_h, dv_b, dv_n, dv_h;
    i64 lse_b, lse_h, delta_b, delta_h, mask_b, mask_h, mask_i, mask_j, blocks_b, blocks_h, blocks_i, blocks_j;
    i64 alibi_b;  // 0 for slopes per head, Hq for slopes per sequence and head
    i64 table_b, kn_b, kn_n, kn_h, kn_d, vn_b, vn_n, vn_h, vn_d;  // block_table's row, k_new's and v_new's strides
    u64 seed;
    int batch, heads_q, heads_k, group, seqlen_q, seqlen_k, head_dim, head_dim_v;
    int left, right, block_q, block_k, rng_offset, drop_threshold, tiles_m, drop_row0, drop_col0;
    int kv_head0, kv_heads;  // the dK/dV kernel's launch covers kv heads [kv_head0, kv_head0 + kv_heads)
    int new_tokens, page_size, splits;  // decoding: Nn, page_size (0: a contiguous cache), splits of each sequence's keys
    float scale, scale_log2, drop_scale;
    float softcap_scale, softcap_log2;  // scale / c and log2(e) c (score_mods.cuh)
};

// ---------------------------------------------------------------------------------------------
// Element conversions.

__device__ __forceinline__ float to_float(elem_t x) {
#if DTYPE == 0
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#elif DTYPE == 1
    return __uint_as_float((u32)x << 16);
#else
    return x;
#endif
}

__device__ __forceinline__ elem_t from_float(float f) {
#if DTYPE == 0
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#elif DTYPE == 1
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return f;
#endif
}

__device__ __forceinline__ bool finite_bits(elem_t x) {
#if DTYPE == 0
    return (x & 0x7c00u) != 0x7c00u;
#elif DTYPE == 1
    return (x & 0x7f80u) != 0x7f80u;
#else
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
#endif
}

#if TENSOR_CORES
// Two floats as one register of two 16-bit values, lo in the low half (an mma A fragment).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if DTYPE == 0
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}
#endif

// Two adjacent elements (an accumulator's columns 2t, 2t + 1), in one store where they are 16-bit.
__device__ __forceinline__ void store_pair(elem_t* dst, float lo, float hi) {
#if TENSOR_CORES
    *(u32*)dst = pack2(lo, hi);
#else
    dst[0] = lo;
    dst[1] = hi;
#endif
}

// ---------------------------------------------------------------------------------------------
// Shared memory, cp.async, ldmatrix, mma.

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Shared memory is addressed by 32-bit offsets in the shared window, each taken once per tile:
// the products' constant offsets then fold into the instructions, where 64-bit generic pointers
// would cost several integer instructions per access.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    // src-size 0 fills the 16 bytes with zeros without reading src.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

#if TENSOR_CORES
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if DTYPE == 0
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// ---------------------------------------------------------------------------------------------
// The two products. Each warp owns MT atoms of 16 rows: rows [16 * MT * warp, 16 * MT * (warp + 1))
// of the resident operand.

// C[MT][N / 8] += A[rows of this warp][0:K] * B[0:N][0:K]^T, A and B row-major in shared memory.
template <int MT, int N, int K, int LDA, int LDB>
__device__ __forceinline__ void gemm_abt(float (&c)[MT][N / 8][4], const elem_t* a, const elem_t* b) {
    const int lane = threadIdx.x % 32;
#if TENSOR_CORES
    const u32 a_lane = smem_addr(a + (lane % 16) * LDA + (lane / 16) * 8);
    const u32 b_lane = smem_addr(b + (lane % 8 + (lane / 16) * 8) * LDB + ((lane / 8) % 2) * 8);
#pragma unroll
    for (int kk = 0; kk < K; kk += 16) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], a_lane + sizeof(elem_t) * (mt * 16 * LDA + kk));
#pragma unroll
        for (int nt = 0; nt < N / 8; nt += 2) {
            u32 bf[4];
            ldmatrix_x4(bf, b_lane + sizeof(elem_t) * (nt * 8 * LDB + kk));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(c[mt][nt], af[mt], bf[0], bf[1]);
                mma16816(c[mt][nt + 1], af[mt], bf[2], bf[3]);
            }
        }
    }
#else
    const int g = lane / 4, t = lane % 4;
#pragma unroll 4
    for (int kk = 0; kk < K; ++kk) {
        float lo[MT], hi[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            lo[mt] = a[(mt * 16 + g) * LDA + kk];
            hi[mt] = a[(mt * 16 + g + 8) * LDA + kk];
        }
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt) {
            const float b0 = b[(nt * 8 + 2 * t) * LDB + kk], b1 = b[(nt * 8 + 2 * t + 1) * LDB + kk];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                c[mt][nt][0] = fmaf(lo[mt], b0, c[mt][nt][0]);
                c[mt][nt][1] = fmaf(lo[mt], b1, c[mt][nt][1]);
                c[mt][nt][2] = fmaf(hi[mt], b0, c[mt][nt][2]);
                c[mt][nt][3] = fmaf(hi[mt], b1, c[mt][nt][3]);
            }
        }
    }
#endif
}

// C[MT][N / 8] += A * B[0:K][0:N], A (this warp's rows x K) given in accumulator layout in
// registers, B row-major in shared memory. The float32 path stages A in ``stage`` (this warp's
// 16 * MT rows of K floats).
template <int MT, int K, int N, int LDB>
__device__ __forceinline__ void gemm_areg(float (&c)[MT][N / 8][4], const float (&a)[MT][K / 8][4], const elem_t* b,
                                          float* stage) {
    const int lane = threadIdx.x % 32;
#if TENSOR_CORES
    const u32 b_lane = smem_addr(b + (lane % 8 + ((lane / 8) % 2) * 8) * LDB + (lane / 16) * 8);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            af[mt][0] = pack2(a[mt][2 * kk][0], a[mt][2 * kk][1]);
            af[mt][1] = pack2(a[mt][2 * kk][2], a[mt][2 * kk][3]);
            af[mt][2] = pack2(a[mt][2 * kk + 1][0], a[mt][2 * kk + 1][1]);
            af[mt][3] = pack2(a[mt][2 * kk + 1][2], a[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int nt = 0; nt < N / 8; nt += 2) {
            u32 bf[4];
            ldmatrix_x4_trans(bf, b_lane + sizeof(elem_t) * (kk * 16 * LDB + nt * 8));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(c[mt][nt], af[mt], bf[0], bf[1]);
                mma16816(c[mt][nt + 1], af[mt], bf[2], bf[3]);
            }
        }
    }
#else
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < K / 8; ++nt) {
            stage[(mt * 16 + g) * K + nt * 8 + 2 * t] = a[mt][nt][0];
            stage[(mt * 16 + g) * K + nt * 8 + 2 * t + 1] = a[mt][nt][1];
            stage[(mt * 16 + g + 8) * K + nt * 8 + 2 * t] = a[mt][nt][2];
            stage[(mt * 16 + g + 8) * K + nt * 8 + 2 * t + 1] = a[mt][nt][3];
        }
    __syncwarp();
#pragma unroll 4
    for (int kk = 0; kk < K; ++kk) {
        float lo[MT], hi[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            lo[mt] = stage[(mt * 16 + g) * K + kk];
            hi[mt] = stage[(mt * 16 + g + 8) * K + kk];
        }
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt) {
            const float b0 = b[kk * LDB + nt * 8 + 2 * t], b1 = b[kk * LDB + nt * 8 + 2 * t + 1];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                c[mt][nt][0] = fmaf(lo[mt], b0, c[mt][nt][0]);
                c[mt][nt][1] = fmaf(lo[mt], b1, c[mt][nt][1]);
                c[mt][nt][2] = fmaf(hi[mt], b0, c[mt][nt][2]);
                c[mt][nt][3] = fmaf(hi[mt], b1, c[mt][nt][3]);
            }
        }
    }
    __syncwarp();
#endif
}

#if TENSOR_CORES
// C[MT][N / 8] += A * B[0:K][0:N], A given transposed: A^T (K x this warp's rows) and B row-major in
// shared memory; ldmatrix.trans turns A^T's 8 x 8 blocks into A fragments.
template <int MT, int N, int K, int LDA, int LDB>
__device__ __forceinline__ void gemm_atb(float (&c)[MT][N / 8][4], const elem_t* at, const elem_t* b) {
    const int lane = threadIdx.x % 32;
    const u32 a_lane = smem_addr(at + (lane % 8 + (lane / 16) * 8) * LDA + ((lane / 8) % 2) * 8);
    const u32 b_lane = smem_addr(b + (lane % 8 + ((lane / 8) % 2) * 8) * LDB + (lane / 16) * 8);
#pragma unroll
    for (int kk = 0; kk < K; kk += 16) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4_trans(af[mt], a_lane + sizeof(elem_t) * (kk * LDA + mt * 16));
#pragma unroll
        for (int nt = 0; nt < N / 8; nt += 2) {
            u32 bf[4];
            ldmatrix_x4_trans(bf, b_lane + sizeof(elem_t) * (kk * LDB + nt * 8));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(c[mt][nt], af[mt], bf[0], bf[1]);
                mma16816(c[mt][nt + 1], af[mt], bf[2], bf[3]);
            }
        }
    }
}

// Adds x to a float in global memory, unordered.
__device__ __forceinline__ void reduce_add(float* dst, float x) {
    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;" ::"l"(dst), "f"(x) : "memory");
}

// Adds (lo, hi) to two adjacent floats, as one vector reduction where sm_90 has it.
__device__ __forceinline__ void reduce_add_pair(float* dst, float lo, float hi) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(lo), "f"(hi) : "memory");
#else
    reduce_add(dst, lo);
    reduce_add(dst + 1, hi);
#endif
}
#endif

// Row (0 .. 16 * MT) and column of element e of atom (mt, nt) of this lane.
__device__ __forceinline__ int frag_row(int mt, int e) { return mt * 16 + (threadIdx.x % 32) / 4 + (e >= 2 ? 8 : 0); }
__device__ __forceinline__ int frag_col(int nt, int e) { return nt * 8 + 2 * (threadIdx.x % 4) + (e & 1); }

// The online softmax's step for a row meeting a new key tile whose scores this lane's columns max
// to ``lane_max`` (the row's quad of lanes shares the max): the row's max moves and its sum is
// rescaled. Returns the shift of the tile's exponents, 0 for a row with no allowed key so far, so
// that exp2(-inf) gives 0, not NaN; ``alpha`` is the move's factor, which the output owes too.
__device__ __forceinline__ float move_row_max(float& row_max, float& row_sum, float lane_max, float& alpha) {
    float mx = fmaxf(lane_max, __shfl_xor_sync(0xffffffffu, lane_max, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(row_max, mx);
    const float m_ref = m_new == NEG_INF ? 0.f : m_new;
    alpha = exp2f(row_max - m_ref);
    row_max = m_new;
    row_sum *= alpha;
    return m_ref;
}

template <int MT, int N>
__device__ __forceinline__ void zero(float (&c)[MT][N / 8][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[mt][nt][e] = 0.f;
}

// ---------------------------------------------------------------------------------------------
// Masked products with non-finite operands.
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

// Whether rows [0, ROWS) of a shared tile hold a NaN or an infinity (an answer of the computing
// threads). The warp votes on it once more so that ptxas sees it uniform: a branch on it that it
// takes for divergent makes it serialize every wgmma of the kernel.
template <int ROWS, int COLS, int LD>
__device__ __forceinline__ bool tile_nonfinite(const elem_t* s) {
    int bad = 0;
    for (int idx = threadIdx.x; idx < ROWS * COLS; idx += THREADS) bad |= !finite_bits(s[(idx / COLS) * LD + idx % COLS]);
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

// ---------------------------------------------------------------------------------------------
// Tiles in shared memory. A layout places element (r, c) of a tile at byte ``offset(r, c)``;
// ``offset(r + PERIOD, c) = offset(r, c) + PERIOD * ROW_BYTES``, so that a copy loop advances by
// a constant.

// Rows LD elements apart: the mma.sync products' layout (the padding spreads ldmatrix's rows over
// the banks).
template <int LD>
struct Padded {
    static constexpr int ROW_BYTES = LD * (int)sizeof(elem_t), PERIOD = 1;
    static __device__ __forceinline__ int offset(int r, int c) { return (r * LD + c) * (int)sizeof(elem_t); }
    static __device__ __forceinline__ elem_t& at(elem_t* s, int r, int c) { return s[r * LD + c]; }
    static __device__ __forceinline__ elem_t at(const elem_t* s, int r, int c) { return s[r * LD + c]; }
};

#if TENSOR_CORES
// wgmma's 128-byte swizzle, for 16-bit elements: the tile's columns in panels of 64 (128 bytes a
// row), panel after panel of ROWS rows each; the 16-byte chunk k of row r lies at chunk k ^ (r % 8)
// of its row. The same bytes serve wgmma as a K-major operand (rows are M or N, columns K: Q, K)
// and as an MN-major one (rows are K, columns N: V); the swizzle is a function of the address
// bits, so a tile starts on a 1024-byte boundary.
template <int ROWS>
struct Swizzle128 {
    static constexpr int ROW_BYTES = 128, PERIOD = 8;
    static __device__ __forceinline__ int offset(int r, int c) {
        return c / 64 * ROWS * 128 + r * 128 + ((c / 8 % 8) ^ (r % 8)) * 16 + c % 8 * 2;
    }
    static __device__ __forceinline__ elem_t& at(elem_t* s, int r, int c) { return *(elem_t*)((char*)s + offset(r, c)); }
    static __device__ __forceinline__ elem_t at(const elem_t* s, int r, int c) {
        return *(const elem_t*)((const char*)s + offset(r, c));
    }
};
#endif

// Rows [row0, row0 + ROWS) of one head's (length, width) matrix at ``base`` (its row 0) into a
// tile in ``Layout``, zero at rows >= rows_valid and columns >= width, so padding and the columns
// past the head dim are never read; by the GROUP threads numbered tid = 0 .. GROUP - 1.
template <int ROWS, int COLS, typename Layout, int GROUP = THREADS>
__device__ __forceinline__ void load_tile(elem_t* s, const elem_t* base, i64 row_stride, i64 col_stride, int row0,
                                          int rows_valid, int width, int tid = threadIdx.x) {
#if ALIGNED
    // Each thread copies one 16-byte column chunk of every STEP-th row.
    constexpr int PER_ROW = COLS / CHUNK, STEP = GROUP / PER_ROW;
    static_assert(GROUP % PER_ROW == 0, "a thread keeps its column");
    static_assert(STEP % Layout::PERIOD == 0, "a thread's rows are a constant stride apart");
    const int c = tid % PER_ROW * CHUNK, r0 = tid / PER_ROW;
    const elem_t* src = base + (i64)(row0 + r0) * row_stride + c;
    const i64 src_step = STEP * row_stride;
    const u32 dst = smem_addr(s) + Layout::offset(r0, c);
    const int rows_left = c < width ? rows_valid - row0 - r0 : 0;  // rows of this thread's column to read
#pragma unroll
    for (int i = 0; i < (ROWS + STEP - 1) / STEP; ++i, src += src_step) {
        if (ROWS % STEP != 0 && r0 + i * STEP >= ROWS) break;
        const bool valid = i * STEP < rows_left;
        cp_async16(dst + i * STEP * Layout::ROW_BYTES, valid ? src : base, valid);
    }
#else
    for (int idx = tid; idx < ROWS * COLS; idx += GROUP) {
        const int r = idx / COLS, c = idx % COLS;
        const bool valid = row0 + r < rows_valid && c < width;
        Layout::at(s, r, c) = valid ? base[(i64)(row0 + r) * row_stride + c * col_stride] : from_float(0.f);
    }
#endif
}

// ---------------------------------------------------------------------------------------------
// Sequences and the pair rule.

struct Sequence {
    int b, start_q, len_q, start_k, len_k;
};

__device__ __forceinline__ Sequence sequence(const Params& p, int b) {
    Sequence s;
    s.b = b;
#if VARLEN
    const int* cu_q = (const int*)p.cu_q;
    const int* cu_k = (const int*)p.cu_k;
    s.start_q = cu_q[b];
    s.len_q = cu_q[b + 1] - s.start_q;
    s.start_k = cu_k[b];
    s.len_k = cu_k[b + 1] - s.start_k;
#else
    s.start_q = s.start_k = 0;
#if SEQLENS_Q
    s.len_q = ((const int*)p.seqlens_q)[b];
#else
    s.len_q = p.seqlen_q;
#endif
#if SEQLENS_K
    s.len_k = ((const int*)p.seqlens_k)[b];
#else
    s.len_k = p.seqlen_k;
#endif
#endif
    return s;
}

// The offset of row ``row`` (within the sequence) of head ``h`` in a (B, N, H, D) or (T, H, D) array.
__device__ __forceinline__ i64 row_offset(int b, int start, int row, int h, i64 sb, i64 sn, i64 sh) {
#if VARLEN
    sb = 0;
#endif
    return (i64)b * sb + (i64)(start + row) * sn + (i64)h * sh;
}

// Key j may be used by query i (both within the sequence) for query head h: the contract's rule.
// ``left``/``right`` hold the band with -1 replaced by a reach no pair exceeds.
__device__ __forceinline__ bool allowed_pair(const Params& p, const Sequence& s, int h, int i, int j) {
    const int diag = s.len_k - s.len_q;
    bool ok = i < s.len_q && j < s.len_k && j >= i + diag - p.left && j <= i + diag + p.right;
#if MASK
    if (ok)
        ok = ((const unsigned char*)p.mask)[(i64)s.b * p.mask_b + (i64)h * p.mask_h + (i64)i * p.mask_i +
                                            (i64)j * p.mask_j] != 0;
#endif
#if BLOCK_MASK
    if (ok)
        ok = ((const unsigned char*)p.blocks)[(i64)s.b * p.blocks_b + (i64)h * p.blocks_h +
                                              (i64)(i / p.block_q) * p.blocks_i + (i64)(j / p.block_k) * p.blocks_j] != 0;
#endif
    return ok;
}

// Whether every pair of query rows [i0, i1) and keys [j0, j1) is allowed without looking
// (inside both lengths and the band; no mask). Tiles for which it holds skip the pair rule.
__device__ __forceinline__ bool tile_unmasked(const Params& p, const Sequence& s, int i0, int i1, int j0, int j1) {
#if MASK || BLOCK_MASK
    return false;
#else
    const int diag = s.len_k - s.len_q;
    return i1 <= s.len_q && j1 <= s.len_k && j0 >= (i1 - 1) + diag - p.left && j1 - 1 <= i0 + diag + p.right;
#endif
}

// Whether the block mask allows some pair of rows [i0, i1) and keys [j0, j1) (block-wide);
// a tile it disallows is skipped unread.
__device__ __forceinline__ bool blocks_allow(const Params& p, const Sequence& s, int h, int i0, int i1, int j0, int j1) {
#if BLOCK_MASK
    const int bi0 = i0 / p.block_q, bi1 = (i1 - 1) / p.block_q + 1;
    const int bj0 = j0 / p.block_k, bj1 = (j1 - 1) / p.block_k + 1;
    const int n = (bi1 - bi0) * (bj1 - bj0);
    int any = 0;
    for (int idx = threadIdx.x; idx < n && !any; idx += THREADS) {
        const int bi = bi0 + idx / (bj1 - bj0), bj = bj0 + idx % (bj1 - bj0);
        any = ((const unsigned char*)p.blocks)[(i64)s.b * p.blocks_b + (i64)h * p.blocks_h + (i64)bi * p.blocks_i +
                                               (i64)bj * p.blocks_j] != 0;
    }
    return __syncthreads_or(any);
#else
    return true;
#endif
}

// ---------------------------------------------------------------------------------------------
// Dropout: Z[b, h, i, j] = word j' % 4 of Philox4x32-10((j' / 4, i', b * Hq + h, rng_offset), seed)
// >= floor(p * 2^32), compared as integers, at positions i' = i + drop_row0 and j' = j + drop_col0
// (dropout_offsets).

// The four words of Philox4x32-10 at counter (c0, c1, c2, c3), in c0 .. c3.
__device__ __forceinline__ void philox(u32& c0, u32& c1, u32& c2, u32& c3, u64 seed) {
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

// The keep bits of query row i (before drop_row0) at Philox counter column ``counter``: bit w for
// word w, the key whose offset column (j + drop_col0) is 4 counter + w. One Philox call.
__device__ __forceinline__ u32 dropout_keep4(const Params& p, int b, int h, int i, u32 counter) {
    u32 c0 = counter, c1 = (u32)(i + p.drop_row0), c2 = (u32)(b * p.heads_q + h), c3 = (u32)p.rng_offset;
    philox(c0, c1, c2, c3, p.seed);
    const u32 t = (u32)p.drop_threshold;
    return (u32)(c0 >= t) | (u32)(c1 >= t) << 1 | (u32)(c2 >= t) << 2 | (u32)(c3 >= t) << 3;
}

__device__ __forceinline__ bool dropout_keep(const Params& p, int b, int h, int i, int j) {
    const u32 col = (u32)(j + p.drop_col0);
    return dropout_keep4(p, b, h, i, col / 4) >> (col % 4) & 1;
}

// Whether (i, j) and (i, j + 1) are kept, bits 0 and 1: one Philox call serves both unless they
// straddle two counters (j + drop_col0 = 3 mod 4), which an even drop_col0 never makes.
__device__ __forceinline__ u32 dropout_keep_pair(const Params& p, int b, int h, int i, int j) {
    const u32 col = (u32)(j + p.drop_col0), word = col % 4;
    const u32 bits = dropout_keep4(p, b, h, i, col / 4) >> word;
    return word < 3 ? bits & 3 : bits | (u32)dropout_keep(p, b, h, i, j + 1) << 1;
}

// Whether a lane's four elements of the m16n8 atom at (i0, j0) are kept, bit e for element e
// (frag_row and frag_col): rows g and g + 8, columns 2q and 2q + 1 (g = lane / 4, q = lane % 4).
// Where drop_col0 is a multiple of 4, one Philox counter covers the columns of lanes q and q ^ 1:
// each of the two draws one row's four words, the even lane row g and the odd one row g + 8, and
// they trade the halves the other needs, one Philox call a lane instead of two. The whole warp
// calls it.
__device__ __forceinline__ u32 dropout_keep_atom(const Params& p, int b, int h, int i0, int j0) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    if (p.drop_col0 % 4 != 0)
        return dropout_keep_pair(p, b, h, i0 + g, j0 + 2 * q) | dropout_keep_pair(p, b, h, i0 + g + 8, j0 + 2 * q) << 2;
    const bool odd = q & 1;
    const u32 row = dropout_keep4(p, b, h, i0 + g + (odd ? 8 : 0), (u32)(j0 + 4 * (q / 2) + p.drop_col0) / 4);
    const u32 mine = odd ? row >> 2 : row & 3, theirs = odd ? row & 3 : row >> 2;
    const u32 traded = __shfl_xor_sync(0xffffffffu, theirs, 1);  // the other row, this lane's columns
    return odd ? traded | mine << 2 : mine | traded << 2;
}

// The same for an atom of transposed scores (the dK/dV kernel's P^T: rows are keys from j0,
// columns queries from i0), bit e for the key j0 + frag_row and the query i0 + frag_col. Where
// drop_col0 is a multiple of 4, the warp's 32 counters (four groups of four keys, eight queries)
// are one a lane: lane (g, q) draws key group g % 4 for query 2q + g / 4, and each element's bit
// is a word of another lane's draw: one Philox call a lane instead of four.
__device__ __forceinline__ u32 dropout_keep_atom_t(const Params& p, int b, int h, int i0, int j0) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    u32 bits = 0;
    if (p.drop_col0 % 4 != 0) {
#pragma unroll
        for (int e = 0; e < 4; ++e) bits |= (u32)dropout_keep(p, b, h, i0 + 2 * q + (e & 1), j0 + g + 8 * (e >> 1)) << e;
        return bits;
    }
    const u32 drawn = dropout_keep4(p, b, h, i0 + 2 * q + g / 4, (u32)(j0 + 4 * (g % 4) + p.drop_col0) / 4);
#pragma unroll
    for (int e = 0; e < 4; ++e)  // key g (+ 8) is word g % 4 of group g / 4 (+ 2), drawn by lane (4 (e & 1) + that group, q)
        bits |= (__shfl_sync(0xffffffffu, drawn, 4 * (4 * (e & 1) + g / 4 + 2 * (e >> 1)) + q) >> (g % 4) & 1) << e;
    return bits;
}

// The tile of the grid's x axis (every axis but x is 1: no 65535 limit), heaviest first:
// (tile, head, batch) from blockIdx.x over ``tiles`` tiles per head.
__device__ __forceinline__ void grid_tile(int tiles, int heads, int& tile, int& h, int& b) {
    const int per_batch = tiles * heads;
    b = blockIdx.x / per_batch;
    const int rest = blockIdx.x % per_batch;
    h = rest / tiles;
    tile = tiles - 1 - rest % tiles;
}
