// The forward (FlashAttention-2): one CTA per (query tile, query head, sequence), all on the
// grid's x axis. Q stays in shared memory; K/V tiles stream through two shared buffers, the
// next one loading (cp.async) while the current one is used. Online softmax in base 2: scores
// are scaled by softmax_scale * log2(e) before the row max, so a negative scale takes the max
// of the scaled scores; the LSE leaves in natural log.
//
// Only tiles that cross the band, a sequence end or a mask test pairs ("masked" tiles); key
// tiles that no row of the CTA may use are never visited, and block-mask tiles it disallows
// are skipped unread.

#include "common.cuh"

extern "C" __global__ void __launch_bounds__(THREADS) flashx_forward(const Params p) {
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* sQ = (elem_t*)smem;                                            // BLOCK_M x LD_QK
    elem_t* sK = sQ + BLOCK_M * LD_QK;                                     // 2 x BLOCK_N x LD_QK
    elem_t* sV = sK + 2 * BLOCK_N * LD_QK;                                 // 2 x BLOCK_N x LD_V
    unsigned char* sAllowed = (unsigned char*)(sV + 2 * BLOCK_N * LD_V);   // BLOCK_M x BLOCK_N pairs read
    float* sStage = (float*)(sAllowed + BLOCK_M * BLOCK_N);                // float32: BLOCK_M x BLOCK_N

    int tile, h, b;
    grid_tile(p.tiles_m, p.heads_q, tile, h, b);
    const Sequence s = sequence(p, b);
    const int m0 = tile * BLOCK_M;
    const int rows_out = VARLEN ? s.len_q : p.seqlen_q;  // padded rows past len_q still get o = 0, lse = -inf
    if (m0 >= rows_out) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wrow = warp * ATOMS * 16;  // this warp's first row in the tile
    const int hk = h / p.group;

    const elem_t* q = (const elem_t*)p.q + row_offset(b, s.start_q, 0, h, p.q_b, p.q_n, p.q_h);
    const elem_t* k = (const elem_t*)p.k + row_offset(b, s.start_k, 0, hk, p.k_b, p.k_n, p.k_h);
    const elem_t* v = (const elem_t*)p.v + row_offset(b, s.start_k, 0, hk, p.v_b, p.v_n, p.v_h);

    // Keys [first, end) are used by some row of this tile.
    const int diag = s.len_k - s.len_q;
    const int rows_end = min(m0 + BLOCK_M, s.len_q);
    int first = max(m0 + diag - p.left, 0);
    int end = min(rows_end - 1 + diag + p.right + 1, s.len_k);
    if (rows_end <= m0 || end <= first) first = end = 0;
    auto allowed_tile = [&](int n) {  // the first tile from n on that the block mask allows
        while (n < end && !blocks_allow(p, s, h, m0, rows_end, n, min(n + BLOCK_N, end))) n += BLOCK_N;
        return n;
    };
    auto load_kv = [&](int n, int buf) {
        load_tile<BLOCK_N, DIM_QK, LD_QK>(sK + buf * BLOCK_N * LD_QK, k, p.k_n, p.k_d, n, s.len_k, p.head_dim);
        load_tile<BLOCK_N, DIM_V, LD_V>(sV + buf * BLOCK_N * LD_V, v, p.v_n, p.v_d, n, s.len_k, p.head_dim_v);
    };

    load_tile<BLOCK_M, DIM_QK, LD_QK>(sQ, q, p.q_n, p.q_d, m0, s.len_q, p.head_dim);
    int n = allowed_tile(first / BLOCK_N * BLOCK_N);
    if (n < end) load_kv(n, 0);
    cp_async_commit();

    float acc[ATOMS][DIM_V / 8][4];
    zero<ATOMS, DIM_V>(acc);
    float row_max[ATOMS][2], row_sum[ATOMS][2];  // per lane: its columns' share of the row sum
#pragma unroll
    for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) row_max[mt][half] = NEG_INF, row_sum[mt][half] = 0.f;

    for (int buf = 0; n < end; buf ^= 1) {
        const int next = allowed_tile(n + BLOCK_N);
        if (next < end) load_kv(next, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        elem_t* k_tile = sK + buf * BLOCK_N * LD_QK;
        elem_t* v_tile = sV + buf * BLOCK_N * LD_V;
        const bool masked = !tile_unmasked(p, s, m0, m0 + BLOCK_M, n, n + BLOCK_N);
        const bool exact = masked || DROPOUT;  // some pair of the tile reads no V

        float sc[ATOMS][BLOCK_N / 8][4];
        zero<ATOMS, BLOCK_N>(sc);
        gemm_abt<ATOMS, BLOCK_N, DIM_QK, LD_QK, LD_QK>(sc, sQ + wrow * LD_QK, k_tile);

        float tile_max[ATOMS][2];
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt) tile_max[mt][0] = tile_max[mt][1] = NEG_INF;
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = sc[mt][nt][e] * p.scale_log2;
                    if (masked) x = allowed_pair(p, s, h, m0 + wrow + frag_row(mt, e), n + frag_col(nt, e)) ? x : NEG_INF;
                    sc[mt][nt][e] = x;
                    tile_max[mt][e / 2] = fmaxf(tile_max[mt][e / 2], x);
                }

#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float mx = tile_max[mt][half];
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(row_max[mt][half], mx);
                // A row with no allowed key so far shifts by 0, so that exp2(-inf) gives 0, not NaN.
                const float m_ref = m_new == NEG_INF ? 0.f : m_new;
                const float alpha = exp2f(row_max[mt][half] - m_ref);
                row_max[mt][half] = m_new;
                row_sum[mt][half] *= alpha;
#pragma unroll
                for (int nt = 0; nt < DIM_V / 8; ++nt) acc[mt][nt][2 * half] *= alpha, acc[mt][nt][2 * half + 1] *= alpha;
#pragma unroll
                for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
                    for (int e = 2 * half; e < 2 * half + 2; ++e) {
                        const int r = wrow + frag_row(mt, e), c = frag_col(nt, e);
                        const float pr = exp2f(sc[mt][nt][e] - m_ref);
                        row_sum[mt][half] += pr;  // the LSE is taken before dropout
#if DROPOUT
                        const bool keep = dropout_keep(p, b, h, m0 + r, n + c);
#else
                        const bool keep = true;
#endif
                        if (exact) sAllowed[r * BLOCK_N + c] = keep && sc[mt][nt][e] != NEG_INF ? 2 : 0;
                        sc[mt][nt][e] = keep ? pr : 0.f;
                    }
            }

        if (exact) {
            __syncwarp();
            if (tile_nonfinite<BLOCK_N, DIM_V, LD_V>(v_tile)) {
                poison_allowed<ATOMS, BLOCK_N, DIM_V, LD_V>(acc, sAllowed + wrow * BLOCK_N, 2, v_tile);
                __syncthreads();
                clear_nonfinite<BLOCK_N, DIM_V, LD_V>(v_tile);
                __syncthreads();
            }
        }
        gemm_areg<ATOMS, BLOCK_N, DIM_V, LD_V>(acc, sc, v_tile, sStage + wrow * BLOCK_N);
        __syncthreads();  // every warp is done with this buffer before it is refilled
        n = next;
    }
    cp_async_wait<0>();

    float* lse = (float*)p.lse + (i64)b * p.lse_b + (i64)h * p.lse_h + s.start_q;
    elem_t* o = (elem_t*)p.o + row_offset(b, s.start_q, 0, h, p.o_b, p.o_n, p.o_h);
#pragma unroll
    for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float total = row_sum[mt][half];
            total += __shfl_xor_sync(0xffffffffu, total, 1);
            total += __shfl_xor_sync(0xffffffffu, total, 2);
            const int i = m0 + wrow + frag_row(mt, 2 * half);
            const bool empty = total == 0.f;
            const float out_scale = empty ? 0.f : p.drop_scale / total;
            if (i < rows_out) {
                if (lane % 4 == 0) lse[i] = empty ? NEG_INF : (row_max[mt][half] + log2f(total)) * LN2;
#pragma unroll
                for (int nt = 0; nt < DIM_V / 8; ++nt)
#pragma unroll
                    for (int e = 2 * half; e < 2 * half + 2; ++e) {
                        const int c = frag_col(nt, e);
                        if (c < p.head_dim_v) o[(i64)i * p.o_n + c * p.o_d] = from_float(empty ? 0.f : acc[mt][nt][e] * out_scale);
                    }
            }
        }
}
