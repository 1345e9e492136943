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

// The delta kernel's lanes a (row of the q tensor, query head): where the operands are ALIGNED, a
// lane reads 16-byte chunks, and a row takes the lanes its DIM_V columns fill, up to the warp (a
// d64 row 8 lanes of 16-bit chunks: four rows a warp); else the warp, element by element. With
// sinks a row is a warp's: whether it has a key is the warp's vote (row_has_key).
constexpr int DELTA_STEP = ALIGNED ? CHUNK : 1;
constexpr int DELTA_LANES = ALIGNED && !SINKS && DIM_V / CHUNK < 32 ? DIM_V / CHUNK : 32;

extern "C" __global__ void flashx_delta(const BackwardParams p, int rows) {
    // rows counts B * Nq (padded) or Tq (varlen); every lane takes part in the sums' shuffles.
    const i64 id = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / DELTA_LANES;
    const int lane = threadIdx.x % DELTA_LANES;
    const bool valid = id < (i64)rows * p.heads_q;
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
    for (int c = lane * DELTA_STEP; valid && c < p.head_dim_v; c += DELTA_LANES * DELTA_STEP) {
        if constexpr (ALIGNED) {  // unit column strides (launch.aligned)
            union { uint4 bits; elem_t x[CHUNK]; } oc, gc;
            oc.bits = *(const uint4*)(o + c);
            gc.bits = *(const uint4*)(dout + c);
#pragma unroll
            for (int j = 0; j < CHUNK; ++j) sum = fmaf(to_float(oc.x[j]), to_float(gc.x[j]), sum);
        } else {
            sum = fmaf(to_float(o[c * p.o_d]), to_float(dout[c * p.do_d]), sum);
        }
    }
#pragma unroll
    for (int offset = DELTA_LANES / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (!valid) return;  // with sinks, the whole warp
    bool has_key = true;
    if constexpr (SINKS) has_key = row_of_tensor_has_key(p, b, n, h);
    if (lane != 0) return;
    ((float*)p.delta)[(i64)b * p.delta_b + (i64)h * p.delta_h + n] = sum;
    if constexpr (SINKS) {
        // d lse / d sink = exp(sink - lse) and d o / d sink = -exp(sink - lse) o give the row's term;
        // a row without an allowed key adds exactly 0, whatever its dO holds.
        const float lse = ((const float*)p.lse)[(i64)b * p.lse_b + (i64)h * p.lse_h + n];
        const float sink = ((const float*)p.sinks)[h];
        ((float*)p.dsinks_rows)[(i64)b * p.delta_b + (i64)h * p.delta_h + n] = has_key ? -expf(sink - lse) * sum : 0.f;
    }
}

// The fused backward's dQ (flashx_dkdv_sm90 or flashx_dkdv adding dQ), from its float32 sums into
// p.dq, rounded: the sums of query heads head0 .. head0 + heads - 1, in panels of DQ_PANEL columns
// (launch._dkdv_adding_dq: (B, heads, panels, Nq, DQ_PANEL), or (heads, panels, Tq, DQ_PANEL)
// packed). A thread takes a panel of a row, and consecutive threads a row's consecutive panels:
// each thread's load is one 32-byte sector of the sums, and a row's stores are contiguous.
struct DqRound {
    u64 sums;
    int rows;  // of the q tensor: B * Nq, or Tq packed
    int head0, heads;
};

extern "C" __global__ void flashx_dq_round(const BackwardParams p, const DqRound r) {
    constexpr int PANELS = DIM_QK / DQ_PANEL;
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const int panel = (int)(t % PANELS), head = (int)(t / PANELS % r.heads);
    const i64 row = t / PANELS / r.heads;
    if (row >= r.rows) return;
    const int sequence_rows = VARLEN ? r.rows : p.seqlen_q;
    const int b = (int)(row / sequence_rows), n = (int)(row % sequence_rows);
    const float* src = (const float*)r.sums + ((((i64)b * r.heads + head) * PANELS + panel) * sequence_rows + n) * DQ_PANEL;
    union { uint4 bits[DQ_PANEL * sizeof(elem_t) / 16]; elem_t x[DQ_PANEL]; } out;
#pragma unroll
    for (int j = 0; j < DQ_PANEL; j += 4) {
        const float4 v = *(const float4*)(src + j);
        out.x[j] = from_float(v.x), out.x[j + 1] = from_float(v.y), out.x[j + 2] = from_float(v.z), out.x[j + 3] = from_float(v.w);
    }
    const int c0 = panel * DQ_PANEL;
    elem_t* dst = (elem_t*)p.dq + (i64)b * p.dq_b + (i64)n * p.dq_n + (i64)(r.head0 + head) * p.dq_h + c0;
    if (p.head_dim % DQ_PANEL == 0) {  // p.dq is the backend's own, rows of whole 16-byte chunks
        if (c0 < p.head_dim) {
#pragma unroll
            for (int i = 0; i < DQ_PANEL * (int)sizeof(elem_t) / 16; ++i) ((uint4*)dst)[i] = out.bits[i];
        }
    } else {
        for (int j = 0; j < DQ_PANEL && c0 + j < p.head_dim; ++j) dst[j] = out.x[j];
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
    grid_tile<false>(p, p.heads_q, tile, h, b);
    QueryCta cta{{p, sequence(p, b), b, h, tile * BLOCK_M, threadIdx.x / 32 * ATOMS * 16, sQ, sDO, sK, sV, sAllowed}, sStage};
    int n;
    if (!cta.start(n)) return;
    accumulate_tiles(cta, n);
    cta.store();
}
