// What the two dQ kernels share (dq.cu on mma.sync, dq_sm90.cu on wgmma): a CTA's query rows
// (Q and dO resident) and the key tiles they read, two in flight, the pair rule, dS from the
// recomputed scores, the exact path for non-finite K, and the store of dQ. They differ in the
// products, and so in the tiles' layouts (``Tiles``, backward.cuh) and in how a tile waits for
// them. One body serves masked and unmasked tiles, with a record of the allowed pairs (a byte a
// pair of shared memory) that the rare non-finite K reads.

#include "backward.cuh"

// One CTA's query rows of head h, with their dQ sums and the rows' LSE and D.
template <typename Tiles>
struct QueryRows {
    using Layout = Tiles;
    const BackwardParams& p;
    Sequence s;
    int b, h, m0, wrow;  // the CTA's first row; this warp's first row, from m0
    elem_t *sQ, *sDO, *sK, *sV;
    unsigned char* sAllowed;  // BLOCK_M x BLOCK_N: the allowed pairs of a masked tile
    int rows_end;             // the CTA's rows that the sequence has end here
    int lo, end;              // keys [lo, end) hold those that some row of the CTA reads
    float lse2[ATOMS][2], delta[ATOMS][2];  // of this lane's rows (frag_row's two halves)
    float dq[ATOMS][DIM_QK / 8][4];
    ScoreMods mods;

    __device__ __forceinline__ int rows_out() const { return VARLEN ? s.len_q : p.seqlen_q; }
    __device__ __forceinline__ const elem_t* k_rows() const {
        return (const elem_t*)p.k + row_offset(b, s.start_k, 0, h / p.group, p.k_b, p.k_n, p.k_h);
    }
    __device__ __forceinline__ const elem_t* v_rows() const {
        return (const elem_t*)p.v + row_offset(b, s.start_k, 0, h / p.group, p.v_b, p.v_n, p.v_h);
    }

    // Whether the CTA has rows to write, and the keys they read: from tile lo (a multiple of
    // BLOCK_N) to end.
    __device__ __forceinline__ bool schedule() {
        if (m0 >= rows_out()) return false;
        const int diag = s.len_k - s.len_q;
        rows_end = min(m0 + BLOCK_M, s.len_q);
        int first = max(m0 + diag - p.left, 0);
        end = min(rows_end - 1 + diag + p.right + 1, s.len_k);
        if (rows_end <= m0 || end <= first) first = end = 0;
        lo = first / BLOCK_N * BLOCK_N;
        return true;
    }

    // Q and dO requested (no commit), by the GROUP threads numbered tid.
    template <int GROUP = THREADS>
    __device__ __forceinline__ void load_rows(int tid = threadIdx.x) {
        const elem_t* q = (const elem_t*)p.q + row_offset(b, s.start_q, 0, h, p.q_b, p.q_n, p.q_h);
        const elem_t* dout = (const elem_t*)p.dout + row_offset(b, s.start_q, 0, h, p.do_b, p.do_n, p.do_h);
        load_tile<BLOCK_M, DIM_QK, typename Tiles::template QK<BLOCK_M>, GROUP>(sQ, q, p.q_n, p.q_d, m0, s.len_q, p.head_dim, tid);
        load_tile<BLOCK_M, DIM_V, typename Tiles::template V<BLOCK_M>, GROUP>(sDO, dout, p.do_n, p.do_d, m0, s.len_q, p.head_dim_v, tid);
    }

    // Zeroed sums, this lane's row statistics and the score modifications' values.
    __device__ __forceinline__ void start_sums() {
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                row_stats(p, s, h, m0 + wrow + frag_row(mt, 2 * half), lse2[mt][half], delta[mt][half]);
        zero<ATOMS, DIM_QK>(dq);
        mods.load(p, s, h);
    }

    // schedule(), then Q, dO and the first key tile (into buffers 0) requested as one group, and
    // start_sums(). Returns that tile's first key through ``n`` (end or past: none).
    __device__ __forceinline__ bool start(int& n) {
        if (!schedule()) return false;
        load_rows();
        n = allowed_tile(lo);
        if (n < end) load_kv(n, 0);
        cp_async_commit();
        start_sums();
        return true;
    }

    // The first key tile from key n on that the block mask allows (the answer of the GROUP
    // threads numbered tid).
    template <int GROUP = THREADS>
    __device__ __forceinline__ int allowed_tile(int n, int tid = threadIdx.x) const {
        while (n < end && !blocks_allow<GROUP>(p, s, h, m0, rows_end, n, min(n + BLOCK_N, end), tid)) n += BLOCK_N;
        return n;
    }

    // The first key tile from key n on that the block mask does not skip, and its ``cover`` (the
    // answer of the GROUP threads numbered tid, blocks_cover).
    template <int GROUP>
    __device__ __forceinline__ int covered_tile(int n, int& cover, int tid) const {
        cover = COVER_ALL;
        while (n < end && (cover = blocks_cover<GROUP>(p, s, h, m0, rows_end, n, min(n + BLOCK_N, end), tid)) == COVER_NONE)
            n += BLOCK_N;
        return n;
    }

    __device__ __forceinline__ elem_t* k_tile(int buf) const { return sK + buf * BLOCK_N * Tiles::QK_PITCH; }
    __device__ __forceinline__ elem_t* v_tile(int buf) const { return sV + buf * BLOCK_N * Tiles::V_PITCH; }

    // The key tile at n requested into buffers buf (no commit), by the GROUP threads numbered tid.
    template <int GROUP = THREADS>
    __device__ __forceinline__ void load_kv(int n, int buf, int tid = threadIdx.x) {
        load_tile<BLOCK_N, DIM_QK, typename Tiles::template QK<BLOCK_N>, GROUP>(k_tile(buf), k_rows(), p.k_n, p.k_d, n, s.len_k,
                                                                                 p.head_dim, tid);
        load_tile<BLOCK_N, DIM_V, typename Tiles::template V<BLOCK_N>, GROUP>(v_tile(buf), v_rows(), p.v_n, p.v_d, n, s.len_k,
                                                                               p.head_dim_v, tid);
    }

    // The scores S of this warp's rows and the keys from n into dS, in place, from dP; a masked
    // tile records its allowed pairs. PROBS or GRADS alone does one half, as in dkdv.cuh's
    // probs_and_grads: P into sc, or dS from the P in sc (nothing scales P or caps the scores).
    template <bool PROBS = true, bool GRADS = true>
    __device__ __forceinline__ void grads(bool masked, int n, float (&sc)[ATOMS][BLOCK_N / 8][4],
                                          const float (&dp)[ATOMS][BLOCK_N / 8][4]) const {
        static_assert(PROBS || (!DROPOUT && !SOFTCAP), "dS from P needs the unscaled P, and no cap");
        KeepBits<ATOMS, BLOCK_N / 8> keep;
        if constexpr (DROPOUT && GRADS)
            keep.draw(p, [&](int mt, int nt, bool counter_aligned) {
                return dropout_keep_atom(p, b, h, m0 + wrow + 16 * mt, n + 8 * nt, counter_aligned);
            });
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = wrow + frag_row(mt, e), c = frag_col(nt, e);
                    const bool ok = !masked || allowed_pair(p, s, h, m0 + r, n + c);
                    if (PROBS && masked) sAllowed[r * BLOCK_N + c] = ok;
                    float capped = 0.f;
                    const float pr = !PROBS ? sc[mt][nt][e]
                                   : ok ? exp2f(mods.log2_prob(p, sc[mt][nt][e], m0 + r, n + c, lse2[mt][e / 2], capped))
                                        : 0.f;
                    if constexpr (!GRADS) {
                        sc[mt][nt][e] = pr;
                        continue;
                    }
                    const float dpr = !DROPOUT ? dp[mt][nt][e] : keep.kept(mt, nt, e) ? dp[mt][nt][e] * p.drop_scale : 0.f;
                    sc[mt][nt][e] = ok ? through_softcap(pr * (dpr - delta[mt][e / 2]), capped) : 0.f;
                }
            }
    }

    // A masked tile: the sums whose allowed pairs read a non-finite K element made NaN, and those
    // elements cleared before the product (exact.cuh).
    __device__ __forceinline__ void exact_k(elem_t* k) {
        __syncwarp();  // this warp's record of its rows
        if (tile_nonfinite<BLOCK_N, DIM_QK, Tiles::QK_PITCH>(k)) {
            poison_allowed<ATOMS, BLOCK_N, DIM_QK, typename Tiles::template QK<BLOCK_N>>(
                [&](int r, int j) { return sAllowed[(wrow + r) * BLOCK_N + j] != 0; }, k, nan_at<ATOMS, DIM_QK>(dq));
            compute_sync();  // every computing thread is done with the products that read K
            clear_nonfinite<BLOCK_N, DIM_QK, Tiles::QK_PITCH>(k);
            Tiles::written();
            compute_sync();
        }
    }

    // dQ (scaled) of this warp's rows into the output, in the m16n8 accumulator layout.
    __device__ __forceinline__ void store() const {
        elem_t* dq_out = (elem_t*)p.dq + row_offset(b, s.start_q, 0, h, p.dq_b, p.dq_n, p.dq_h);
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = m0 + wrow + frag_row(mt, e);
                if (i >= rows_out()) continue;
#pragma unroll
                for (int nt = 0; nt < DIM_QK / 8; ++nt) {
                    const int c = frag_col(nt, e);
                    if (c < p.head_dim) dq_out[(i64)i * p.dq_n + c] = from_float(dq[mt][nt][e] * p.scale);
                }
            }
    }
};

// The key tiles from n on, each with the next one requested into the other buffers:
// Cta::accumulate(n, buf) computes the tile at n from buffers buf.
template <typename Cta>
__device__ __forceinline__ void accumulate_tiles(Cta& cta, int n) {
    for (int buf = 0; n < cta.end; buf ^= 1) {
        const int next = cta.allowed_tile(n + BLOCK_N);
        cp_async_wait<0>();  // K and V of this tile
        Cta::Layout::written();
        __syncthreads();     // ... for every thread; and every warp is done with the other buffers
        if (next < cta.end) cta.load_kv(next, buf ^ 1);
        cp_async_commit();
        cta.accumulate(n, buf);
        n = next;
    }
    cp_async_wait<0>();
}
