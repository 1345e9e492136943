// flashx_delta and flashx_dq: D and the sinks' terms, then dQ (backward.cuh says how); one
// module, built with the dQ kernel's macros.

#include "backward.cuh"

#if SINKS
// Whether row ``row`` of the q tensor (the delta kernel's b and n) has an allowed key for head h.
// A packed row's sequence is found by bisecting cu_seqlens_q; rows past its end have none.
__device__ bool row_of_tensor_has_key(const Params& p, int b, int n, int h) {
#if VARLEN
    const int* cu_q = (const int*)p.cu_q;
    if (n >= cu_q[p.batch]) return false;
    int lo = 0, hi = p.batch;  // cu_q[lo] <= n < cu_q[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (cu_q[mid] <= n) lo = mid; else hi = mid;
    }
    const Sequence s = sequence(p, lo);
    return row_has_key(p, s, h, n - s.start_q);
#else
    return row_has_key(p, sequence(p, b), h, n);
#endif
}
#endif

extern "C" __global__ void flashx_delta(const Params p, int rows) {
    // One warp per (row of the q tensor, query head); rows counts B * Nq (padded) or Tq (varlen).
    const i64 id = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (id >= (i64)rows * p.heads_q) return;
    const int h = (int)(id % p.heads_q);
    const i64 row = id / p.heads_q;
    int b = 0, n = (int)row;
#if !VARLEN
    b = (int)(row / p.seqlen_q);
    n = (int)(row % p.seqlen_q);
#endif
    const elem_t* o = (const elem_t*)p.o + (i64)b * p.o_b + (i64)n * p.o_n + (i64)h * p.o_h;
    const elem_t* dout = (const elem_t*)p.dout + (i64)b * p.do_b + (i64)n * p.do_n + (i64)h * p.do_h;
    float sum = 0.f;
    for (int c = lane; c < p.head_dim_v; c += 32) sum = fmaf(to_float(o[c * p.o_d]), to_float(dout[c * p.do_d]), sum);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) ((float*)p.delta)[(i64)b * p.delta_b + (i64)h * p.delta_h + n] = sum;
#if SINKS
    // d lse / d sink = exp(sink - lse) and d o / d sink = -exp(sink - lse) o give the row's term;
    // a row without an allowed key adds exactly 0, whatever its dO holds.
    const bool has_key = row_of_tensor_has_key(p, b, n, h);
    if (lane == 0) {
        const float lse = ((const float*)p.lse)[(i64)b * p.lse_b + (i64)h * p.lse_h + n];
        const float sink = ((const float*)p.sinks)[h];
        ((float*)p.dsinks_rows)[(i64)b * p.delta_b + (i64)h * p.delta_h + n] = has_key ? -expf(sink - lse) * sum : 0.f;
    }
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS) flashx_dq(const Params p) {
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* sQ = (elem_t*)smem;                                            // BLOCK_M x LD_QK
    elem_t* sDO = sQ + BLOCK_M * LD_QK;                                    // BLOCK_M x LD_V
    elem_t* sK = sDO + BLOCK_M * LD_V;                                     // 2 x BLOCK_N x LD_QK
    elem_t* sV = sK + 2 * BLOCK_N * LD_QK;                                 // 2 x BLOCK_N x LD_V
    unsigned char* sAllowed = (unsigned char*)(sV + 2 * BLOCK_N * LD_V);   // BLOCK_M x BLOCK_N
    float* sStage = (float*)(sAllowed + BLOCK_M * BLOCK_N);                // float32: BLOCK_M x BLOCK_N

    int tile, h, b;
    grid_tile(p.tiles_m, p.heads_q, tile, h, b);
    const Sequence s = sequence(p, b);
    const int m0 = tile * BLOCK_M;
    const int rows_out = VARLEN ? s.len_q : p.seqlen_q;
    if (m0 >= rows_out) return;
    const int warp = threadIdx.x / 32;
    const int wrow = warp * ATOMS * 16;
    const int hk = h / p.group;

    const elem_t* q = (const elem_t*)p.q + row_offset(b, s.start_q, 0, h, p.q_b, p.q_n, p.q_h);
    const elem_t* dout = (const elem_t*)p.dout + row_offset(b, s.start_q, 0, h, p.do_b, p.do_n, p.do_h);
    const elem_t* k = (const elem_t*)p.k + row_offset(b, s.start_k, 0, hk, p.k_b, p.k_n, p.k_h);
    const elem_t* v = (const elem_t*)p.v + row_offset(b, s.start_k, 0, hk, p.v_b, p.v_n, p.v_h);

    const int diag = s.len_k - s.len_q;
    const int rows_end = min(m0 + BLOCK_M, s.len_q);
    int first = max(m0 + diag - p.left, 0);
    int end = min(rows_end - 1 + diag + p.right + 1, s.len_k);
    if (rows_end <= m0 || end <= first) first = end = 0;
    auto allowed_tile = [&](int n) {
        while (n < end && !blocks_allow(p, s, h, m0, rows_end, n, min(n + BLOCK_N, end))) n += BLOCK_N;
        return n;
    };
    auto load_kv = [&](int n, int buf) {
        load_tile<BLOCK_N, DIM_QK, Padded<LD_QK>>(sK + buf * BLOCK_N * LD_QK, k, p.k_n, p.k_d, n, s.len_k, p.head_dim);
        load_tile<BLOCK_N, DIM_V, Padded<LD_V>>(sV + buf * BLOCK_N * LD_V, v, p.v_n, p.v_d, n, s.len_k, p.head_dim_v);
    };

    load_tile<BLOCK_M, DIM_QK, Padded<LD_QK>>(sQ, q, p.q_n, p.q_d, m0, s.len_q, p.head_dim);
    load_tile<BLOCK_M, DIM_V, Padded<LD_V>>(sDO, dout, p.do_n, p.do_d, m0, s.len_q, p.head_dim_v);
    int n = allowed_tile(first / BLOCK_N * BLOCK_N);
    if (n < end) load_kv(n, 0);
    cp_async_commit();

    float lse2[ATOMS][2], delta[ATOMS][2];
#pragma unroll
    for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            row_stats(p, s, h, m0 + wrow + frag_row(mt, 2 * half), lse2[mt][half], delta[mt][half]);

    float dq[ATOMS][DIM_QK / 8][4];
    zero<ATOMS, DIM_QK>(dq);
    ScoreMods mods;
    mods.load(p, s, h);

    for (int buf = 0; n < end; buf ^= 1) {
        const int next = allowed_tile(n + BLOCK_N);
        cp_async_wait<0>();  // K and V of this tile
        __syncthreads();     // ... for every thread; and every warp is done with the other buffers
        if (next < end) load_kv(next, buf ^ 1);
        cp_async_commit();
        elem_t* k_tile = sK + buf * BLOCK_N * LD_QK;
        elem_t* v_tile = sV + buf * BLOCK_N * LD_V;
        const bool masked = !tile_unmasked(p, s, m0, m0 + BLOCK_M, n, n + BLOCK_N);

        float sc[ATOMS][BLOCK_N / 8][4];  // S, then dS
        float dp[ATOMS][BLOCK_N / 8][4];
        zero<ATOMS, BLOCK_N>(sc);
        zero<ATOMS, BLOCK_N>(dp);
        gemm_abt<ATOMS, BLOCK_N, DIM_QK, LD_QK, LD_QK>(sc, sQ + wrow * LD_QK, k_tile);
        gemm_abt<ATOMS, BLOCK_N, DIM_V, LD_V, LD_V>(dp, sDO + wrow * LD_V, v_tile);
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#if DROPOUT
                const u32 kept = dropout_keep_atom(p, b, h, m0 + wrow + 16 * mt, n + 8 * nt);
#endif
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = wrow + frag_row(mt, e), c = frag_col(nt, e);
                    const bool ok = !masked || allowed_pair(p, s, h, m0 + r, n + c);
                    if (masked) sAllowed[r * BLOCK_N + c] = ok;
                    float capped;
                    const float pr = ok ? exp2f(mods.log2_prob(p, sc[mt][nt][e], m0 + r, n + c, lse2[mt][e / 2], capped)) : 0.f;
#if DROPOUT
                    const float dpr = kept >> e & 1 ? dp[mt][nt][e] * p.drop_scale : 0.f;
#else
                    const float dpr = dp[mt][nt][e];
#endif
                    sc[mt][nt][e] = ok ? through_softcap(pr * (dpr - delta[mt][e / 2]), capped) : 0.f;
                }
            }

        if (masked) {
            __syncwarp();
            if (tile_nonfinite<BLOCK_N, DIM_QK, LD_QK>(k_tile)) {
                poison_allowed<ATOMS, BLOCK_N, DIM_QK, Padded<LD_QK>>([&](int r, int j) { return sAllowed[(wrow + r) * BLOCK_N + j] != 0; }, k_tile, nan_at<ATOMS, DIM_QK>(dq));
                __syncthreads();
                clear_nonfinite<BLOCK_N, DIM_QK, LD_QK>(k_tile);
                __syncthreads();
            }
        }
        gemm_areg<ATOMS, BLOCK_N, DIM_QK, LD_QK>(dq, sc, k_tile, sStage + wrow * BLOCK_N);
        n = next;
    }
    cp_async_wait<0>();

    elem_t* dq_out = (elem_t*)p.dq + row_offset(b, s.start_q, 0, h, p.dq_b, p.dq_n, p.dq_h);
#pragma unroll
    for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = m0 + wrow + frag_row(mt, e);
            if (i >= rows_out) continue;
#pragma unroll
            for (int nt = 0; nt < DIM_QK / 8; ++nt) {
                const int c = frag_col(nt, e);
                if (c < p.head_dim) dq_out[(i64)i * p.dq_n + c] = from_float(dq[mt][nt][e] * p.scale);
            }
        }
}
