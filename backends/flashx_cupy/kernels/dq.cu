// flashx_delta and flashx_dq: D and the sinks' terms, then dQ (backward.cuh says how); one
// module, built with the dQ kernel's macros.

#include "dq.cuh"

// Whether row ``row`` of the q tensor (the delta kernel's b and n) has an allowed key for head h.
// A packed row's sequence is found by bisecting cu_seqlens_q; rows past its end have none.
__device__ bool row_of_tensor_has_key(const BackwardParams& p, int b, int n, int h) {
    if constexpr (VARLEN) {
        const int* cu_q = (const int*)p.cu_q;
        if (n >= cu_q[p.batch]) return false;
        int lo = 0, hi = p.batch;  // cu_q[lo] <= n < cu_q[hi]
        while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (cu_q[mid] <= n) lo = mid; else hi = mid;
        }
        const Sequence s = sequence(p, lo);
        return row_has_key(p, s, h, n - s.start_q);
    } else {
        return row_has_key(p, sequence(p, b), h, n);
    }
}

extern "C" __global__ void flashx_delta(const BackwardParams p, int rows) {
    // One warp per (row of the q tensor, query head); rows counts B * Nq (padded) or Tq (varlen).
    const i64 id = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (id >= (i64)rows * p.heads_q) return;
    const int h = (int)(id % p.heads_q);
    const i64 row = id / p.heads_q;
    int b = 0, n = (int)row;
    if constexpr (!VARLEN) {
        b = (int)(row / p.seqlen_q);
        n = (int)(row % p.seqlen_q);
    }
    const elem_t* o = (const elem_t*)p.o + (i64)b * p.o_b + (i64)n * p.o_n + (i64)h * p.o_h;
    const elem_t* dout = (const elem_t*)p.dout + (i64)b * p.do_b + (i64)n * p.do_n + (i64)h * p.do_h;
    float sum = 0.f;
    for (int c = lane; c < p.head_dim_v; c += 32) sum = fmaf(to_float(o[c * p.o_d]), to_float(dout[c * p.do_d]), sum);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) ((float*)p.delta)[(i64)b * p.delta_b + (i64)h * p.delta_h + n] = sum;
    if constexpr (SINKS) {
        // d lse / d sink = exp(sink - lse) and d o / d sink = -exp(sink - lse) o give the row's term;
        // a row without an allowed key adds exactly 0, whatever its dO holds.
        const bool has_key = row_of_tensor_has_key(p, b, n, h);
        if (lane == 0) {
            const float lse = ((const float*)p.lse)[(i64)b * p.lse_b + (i64)h * p.lse_h + n];
            const float sink = ((const float*)p.sinks)[h];
            ((float*)p.dsinks_rows)[(i64)b * p.delta_b + (i64)h * p.delta_h + n] = has_key ? -expf(sink - lse) * sum : 0.f;
        }
    }
}

// QueryRows with the products on mma.sync.
struct QueryCta : QueryRows<PaddedTiles> {
    float* sStage;

    // The key tile at n, from buffers buf.
    __device__ __forceinline__ void accumulate(int n, int buf) {
        elem_t* k = k_tile(buf);
        const bool masked = !tile_unmasked(p, s, m0, m0 + BLOCK_M, n, n + BLOCK_N);
        float sc[ATOMS][BLOCK_N / 8][4];  // S, then dS
        float dp[ATOMS][BLOCK_N / 8][4];
        zero<ATOMS, BLOCK_N>(sc);
        zero<ATOMS, BLOCK_N>(dp);
        gemm_abt<ATOMS, BLOCK_N, DIM_QK, LD_QK, LD_QK>(sc, sQ + wrow * LD_QK, k);
        gemm_abt<ATOMS, BLOCK_N, DIM_V, LD_V, LD_V>(dp, sDO + wrow * LD_V, v_tile(buf));
        grads(masked, n, sc, dp);
        if (masked) exact_k(k);
        gemm_areg<ATOMS, BLOCK_N, DIM_QK, LD_QK>(dq, sc, k, sStage + wrow * BLOCK_N);
    }
};

extern "C" __global__ void __launch_bounds__(THREADS) flashx_dq(const BackwardParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* sQ = (elem_t*)smem;                                            // BLOCK_M x LD_QK
    elem_t* sDO = sQ + BLOCK_M * LD_QK;                                    // BLOCK_M x LD_V
    elem_t* sK = sDO + BLOCK_M * LD_V;                                     // 2 x BLOCK_N x LD_QK
    elem_t* sV = sK + 2 * BLOCK_N * LD_QK;                                 // 2 x BLOCK_N x LD_V
    unsigned char* sAllowed = (unsigned char*)(sV + 2 * BLOCK_N * LD_V);   // BLOCK_M x BLOCK_N
    float* sStage = (float*)(sAllowed + BLOCK_M * BLOCK_N);                // float32: BLOCK_M x BLOCK_N

    int tile, h, b;
    grid_tile(p.tiles_m, p.heads_q, tile, h, b);
    QueryCta cta{{p, sequence(p, b), b, h, tile * BLOCK_M, threadIdx.x / 32 * ATOMS * 16, sQ, sDO, sK, sV, sAllowed}, sStage};
    int n;
    if (!cta.start(n)) return;
    accumulate_tiles(cta, n);
    cta.store();
}
