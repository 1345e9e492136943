// The forward (FlashAttention-2): one CTA per (query tile, query head, sequence), all on the
// grid's x axis. Q stays in shared memory; K and V tiles stream through two shared buffers
// each. Every tile's K and V are requested (cp.async) one tile ahead, as separate groups, so
// that QK^T waits only for K and PV only for V.
//
// The key tiles of a CTA come in two kinds, each its own compiled body: masked tiles (the band's
// edges, a sequence's end, any bool or block mask), which test every pair, and the unmasked
// steady state between them, which tests none. The masked tiles run first, then the unmasked
// ones; key tiles that no row of the CTA may use are never visited, and block-mask tiles it
// disallows are skipped unread.
//
// Online softmax in base 2: scores are scaled by softmax_scale * log2(e) before the row max, so
// a negative scale takes the max of the scaled scores; the LSE leaves in natural log. O leaves
// through shared memory in 16-byte rows.

#include "common.cuh"

// One CTA's query rows, its key range and buffers, and its rows' running softmax and output.
struct ForwardCta {
    const Params& p;
    Sequence s;
    int h, b, m0, wrow, end;
    const elem_t *k, *v;
    elem_t *sQ, *sK, *sV;
    float* sStage;
    int buf;  // the K/V buffers of the tile being read; the other pair is loading
    float acc[ATOMS][DIM_V / 8][4];
    float row_max[ATOMS][2], row_sum[ATOMS][2];  // per lane: its columns' share of the row sum

    // Requests the tile at n (none at end) into the other buffers: two groups, K then V.
    __device__ __forceinline__ void load_kv(int n) {
        if (n < end) load_tile<BLOCK_N, DIM_QK, LD_QK>(sK + (buf ^ 1) * BLOCK_N * LD_QK, k, p.k_n, p.k_d, n, s.len_k, p.head_dim);
        cp_async_commit();
        if (n < end) load_tile<BLOCK_N, DIM_V, LD_V>(sV + (buf ^ 1) * BLOCK_N * LD_V, v, p.v_n, p.v_d, n, s.len_k, p.head_dim_v);
        cp_async_commit();
    }

    // Whether row r of the tile reads key j through V: allowed (masked tiles test it) and kept.
    template <bool MASKED>
    __device__ __forceinline__ bool reads_v(int r, int j) const {
        if (MASKED && !allowed_pair(p, s, h, m0 + r, j)) return false;
#if DROPOUT
        return dropout_keep(p, b, h, m0 + r, j);
#else
        return true;
#endif
    }

    // The key tile at n, and the requests for the tile at next.
    template <bool MASKED>
    __device__ __forceinline__ void attend(int n, int next) {
        constexpr bool EXACT = MASKED || DROPOUT;  // some pair of the tile reads no V
        cp_async_wait<1>();  // K of this tile (its V may still be in flight)
        __syncthreads();     // ... for every thread; and every warp is done with the other buffers
        load_kv(next);
        const elem_t* k_tile = sK + buf * BLOCK_N * LD_QK;
        elem_t* v_tile = sV + buf * BLOCK_N * LD_V;

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
                    if (MASKED && !allowed_pair(p, s, h, m0 + wrow + frag_row(mt, e), n + frag_col(nt, e))) x = NEG_INF;
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
                for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#if DROPOUT
                    const u32 kept = dropout_keep_pair(p, b, h, m0 + wrow + frag_row(mt, 2 * half), n + frag_col(nt, 0));
#endif
#pragma unroll
                    for (int e = 2 * half; e < 2 * half + 2; ++e) {
                        const float pr = exp2f(sc[mt][nt][e] - m_ref);
                        row_sum[mt][half] += pr;  // the LSE is taken before dropout
#if DROPOUT
                        sc[mt][nt][e] = kept >> (e & 1) & 1 ? pr : 0.f;
#else
                        sc[mt][nt][e] = pr;
#endif
                    }
                }
            }

        cp_async_wait<2>();  // V of this tile (the next tile's K and V may still be in flight)
        __syncthreads();
        if constexpr (EXACT) {
            if (tile_nonfinite<BLOCK_N, DIM_V, LD_V>(v_tile)) {
                poison_allowed<ATOMS, BLOCK_N, DIM_V, LD_V>(acc, [&](int r, int j) { return reads_v<MASKED>(wrow + r, n + j); }, v_tile);
                __syncthreads();
                clear_nonfinite<BLOCK_N, DIM_V, LD_V>(v_tile);
                __syncthreads();
            }
        }
        gemm_areg<ATOMS, BLOCK_N, DIM_V, LD_V>(acc, sc, v_tile, sStage + wrow * BLOCK_N);
        buf ^= 1;
    }
};

extern "C" __global__ void __launch_bounds__(THREADS) flashx_forward(const Params p) {
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* sQ = (elem_t*)smem;                                            // BLOCK_M x LD_QK
    elem_t* sK = sQ + BLOCK_M * LD_QK;                                     // 2 x BLOCK_N x LD_QK
    elem_t* sV = sK + 2 * BLOCK_N * LD_QK;                                 // 2 x BLOCK_N x LD_V
    float* sStage = (float*)(sV + 2 * BLOCK_N * LD_V);                     // float32: BLOCK_M x BLOCK_N
    elem_t* sO = (elem_t*)smem;  // BLOCK_M x LD_V, over Q, K and V once the loop is done
    static_assert(BLOCK_M * LD_V <= BLOCK_M * LD_QK + 2 * BLOCK_N * (LD_QK + LD_V), "O's staging must fit the buffers");

    int tile, h, b;
    grid_tile(p.tiles_m, p.heads_q, tile, h, b);
    const Sequence s = sequence(p, b);
    const int m0 = tile * BLOCK_M;
    const int rows_out = VARLEN ? s.len_q : p.seqlen_q;  // padded rows past len_q still get o = 0, lse = -inf
    if (m0 >= rows_out) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wrow = warp * ATOMS * 16;  // this warp's first row in the tile
    const int hk = h / p.group;

    // Keys [first, end) are used by some row of this tile; tiles [unmasked_lo, unmasked_hi) need
    // no pair test (empty when unmasked_lo == unmasked_hi == end).
    const int diag = s.len_k - s.len_q;
    const int rows_end = min(m0 + BLOCK_M, s.len_q);
    int first = max(m0 + diag - p.left, 0);
    int end = min(rows_end - 1 + diag + p.right + 1, s.len_k);
    if (rows_end <= m0 || end <= first) first = end = 0;
    const int lo = first / BLOCK_N * BLOCK_N;
    int unmasked_lo = end, unmasked_hi = end;
#if !MASK && !BLOCK_MASK
    if (m0 + BLOCK_M <= s.len_q) {
        const int from = max(m0 + BLOCK_M - 1 + diag - p.left, lo);  // every row of the tile reaches back
        const int to = min(s.len_k, m0 + diag + p.right + 1);        // and forward
        const int a = (from + BLOCK_N - 1) / BLOCK_N * BLOCK_N, z = to > 0 ? to / BLOCK_N * BLOCK_N : 0;
        if (a < z) unmasked_lo = a, unmasked_hi = z;
    }
#endif
    auto allowed_tile = [&](int n) {  // the first tile from n on that the block mask allows
        while (n < end && !blocks_allow(p, s, h, m0, rows_end, n, min(n + BLOCK_N, end))) n += BLOCK_N;
        return n;
    };
    auto next_masked = [&](int n) {  // the masked tile after n, or end
        n += BLOCK_N;
        return allowed_tile(n == unmasked_lo ? unmasked_hi : n);
    };

    ForwardCta cta{p, s, h, b, m0, wrow, end,
                   (const elem_t*)p.k + row_offset(b, s.start_k, 0, hk, p.k_b, p.k_n, p.k_h),
                   (const elem_t*)p.v + row_offset(b, s.start_k, 0, hk, p.v_b, p.v_n, p.v_h),
                   sQ, sK, sV, sStage, 1};
    zero<ATOMS, DIM_V>(cta.acc);
#pragma unroll
    for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) cta.row_max[mt][half] = NEG_INF, cta.row_sum[mt][half] = 0.f;

    const int first_masked = allowed_tile(lo == unmasked_lo ? unmasked_hi : lo);
    const elem_t* q = (const elem_t*)p.q + row_offset(b, s.start_q, 0, h, p.q_b, p.q_n, p.q_h);
    load_tile<BLOCK_M, DIM_QK, LD_QK>(sQ, q, p.q_n, p.q_d, m0, s.len_q, p.head_dim);
    cta.load_kv(first_masked < end ? first_masked : unmasked_lo);  // into buffers 0, Q in K's group
    cta.buf = 0;

    // The masked tiles, then the unmasked ones; one uniform branch a tile picks the body.
    for (int n = first_masked < end ? first_masked : unmasked_lo; n < end;) {
        const bool masked = n < unmasked_lo || n >= unmasked_hi;
        int next;
        if (masked) {
            next = next_masked(n);
            next = next < end ? next : unmasked_lo;  // after the last masked tile, the first unmasked one
            cta.attend<true>(n, next);
        } else {
            next = n + BLOCK_N < unmasked_hi ? n + BLOCK_N : end;
            cta.attend<false>(n, next);
        }
        n = next;
    }
    cp_async_wait<0>();
    __syncthreads();  // the buffers become O's staging

    float* lse = (float*)p.lse + (i64)b * p.lse_b + (i64)h * p.lse_h + s.start_q;
#pragma unroll
    for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float total = cta.row_sum[mt][half];
            total += __shfl_xor_sync(0xffffffffu, total, 1);
            total += __shfl_xor_sync(0xffffffffu, total, 2);
            const int r = wrow + frag_row(mt, 2 * half);
            const bool empty = total == 0.f;
            const float out_scale = empty ? 0.f : p.drop_scale / total;
            if (m0 + r < rows_out && lane % 4 == 0)
                lse[m0 + r] = empty ? NEG_INF : (cta.row_max[mt][half] + log2f(total)) * LN2;
#pragma unroll
            for (int nt = 0; nt < DIM_V / 8; ++nt)
                store_pair(sO + r * LD_V + frag_col(nt, 0), empty ? 0.f : cta.acc[mt][nt][2 * half] * out_scale,
                           empty ? 0.f : cta.acc[mt][nt][2 * half + 1] * out_scale);
        }
    __syncwarp();  // each warp stores the rows it staged

    elem_t* o = (elem_t*)p.o + row_offset(b, s.start_q, 0, h, p.o_b, p.o_n, p.o_h);
#if ALIGNED  // o is the backend's own contiguous allocation: aligned whenever the inputs are
    constexpr int PER_ROW = DIM_V / CHUNK;
    for (int idx = lane; idx < ATOMS * 16 * PER_ROW; idx += 32) {
        const int r = wrow + idx / PER_ROW, c = idx % PER_ROW * CHUNK;
        if (m0 + r < rows_out && c < p.head_dim_v)
            *(uint4*)(o + (i64)(m0 + r) * p.o_n + c) = *(const uint4*)(sO + r * LD_V + c);
    }
#else
    for (int idx = lane; idx < ATOMS * 16 * DIM_V; idx += 32) {
        const int r = wrow + idx / DIM_V, c = idx % DIM_V;
        if (m0 + r < rows_out && c < p.head_dim_v) o[(i64)(m0 + r) * p.o_n + c * p.o_d] = sO[r * LD_V + c];
    }
#endif
}
