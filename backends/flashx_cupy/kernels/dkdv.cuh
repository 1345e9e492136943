// What the two dK/dV kernels share (dkdv.cu on mma.sync, dkdv_sm90.cu on wgmma): a CTA's keys
// and the query rows that read them, the stream of query tiles of every head of the group, the
// pair rule, P^T and dS^T from the recomputed scores, the exact path for non-finite operands,
// and the stores of dK and dV. They differ in the products, and so in the tiles' layouts
// (``Tiles``: PaddedTiles or SwizzledTiles, backward.cuh says what one holds) and in how a step
// waits for them.

#include "backward.cuh"

// One CTA's keys (K and V resident), its stream of query tiles and its dK and dV sums. Step
// ``step`` is query tile step % tiles of query head hk * group + step / tiles.
template <typename Tiles>
struct KeyRows {
    const BackwardParams& p;
    Sequence s;
    int b, hk, n0, wrow;  // the CTA's first key; this warp's first key, from n0
    elem_t *sK, *sV, *sQ, *sDO;
    float *sLse, *sDelta;
    int keys_end;        // the CTA's keys that the sequence has end here
    int end;             // query rows [.., end) use some key of the CTA
    int tile_lo, tiles;  // the query tiles from row tile_lo on that some key of the CTA reads
    int buf;             // the Q/dO buffers of the step being computed
    // The sums; a build of one of them (DKDV_PARTS) never touches the other, which the compiler drops.
    float dk[ATOMS][DIM_QK / 8][4];
    float dv[ATOMS][DIM_V / 8][4];

    // Whether the CTA has keys to write (padded keys past len_k still get dk = dv = 0), and its
    // query tiles.
    __device__ __forceinline__ bool schedule() {
        if (n0 >= keys_out()) return false;
        const int diag = s.len_k - s.len_q;
        keys_end = min(n0 + BLOCK_M, s.len_k);
        int first = max(n0 - diag - p.right, 0);
        end = min(keys_end - 1 - diag + p.left + 1, s.len_q);
        if (keys_end <= n0 || end <= first) first = end = 0;
        tile_lo = first / BLOCK_N * BLOCK_N;
        tiles = (end - tile_lo + BLOCK_N - 1) / BLOCK_N;
        return true;
    }

    __device__ __forceinline__ void zero_sums() {
        if constexpr (DKDV_PARTS & 1) zero<ATOMS, DIM_QK>(dk);
        if constexpr (DKDV_PARTS & 2) zero<ATOMS, DIM_V>(dv);
    }

    // K and V requested (no commit), by the GROUP threads numbered tid.
    template <int GROUP = THREADS>
    __device__ __forceinline__ void load_keys(int tid = threadIdx.x) {
        const elem_t* k = (const elem_t*)p.k + row_offset(b, s.start_k, 0, hk, p.k_b, p.k_n, p.k_h);
        const elem_t* v = (const elem_t*)p.v + row_offset(b, s.start_k, 0, hk, p.v_b, p.v_n, p.v_h);
        load_tile<BLOCK_M, DIM_QK, typename Tiles::template QK<BLOCK_M>, GROUP>(sK, k, p.k_n, p.k_d, n0, s.len_k, p.head_dim, tid);
        load_tile<BLOCK_M, DIM_V, typename Tiles::template V<BLOCK_M>, GROUP>(sV, v, p.v_n, p.v_d, n0, s.len_k, p.head_dim_v, tid);
    }

    // schedule(), zeroed sums, and K and V requested, with the first step's rows in the same
    // group. Returns that first step through ``step``.
    __device__ __forceinline__ bool start(int& step) {
        if (!schedule()) return false;
        zero_sums();
        load_keys();
        step = allowed_step(0);
        load_rows(step, 0);
        buf = 0;
        return true;
    }

    __device__ __forceinline__ int keys_out() const { return VARLEN ? s.len_k : p.seqlen_k; }
    __device__ __forceinline__ int steps() const { return tiles * p.group; }
    __device__ __forceinline__ int head_of(int step) const { return hk * p.group + step / tiles; }
    __device__ __forceinline__ int row_of(int step) const { return tile_lo + step % tiles * BLOCK_N; }

    // The first step from ``step`` on that the block mask allows (the answer of the GROUP threads
    // numbered tid).
    template <int GROUP = THREADS>
    __device__ __forceinline__ int allowed_step(int step, int tid = threadIdx.x) const {
        while (step < steps() && !blocks_allow<GROUP>(p, s, head_of(step), row_of(step), min(row_of(step) + BLOCK_N, end),
                                                      n0, keys_end, tid))
            ++step;
        return step;
    }

    // The first step from ``step`` on that the block mask does not skip, and its ``cover`` (the
    // answer of the GROUP threads numbered tid, blocks_cover).
    template <int GROUP>
    __device__ __forceinline__ int covered_step(int step, int& cover, int tid) const {
        cover = COVER_ALL;
        while (step < steps() && (cover = blocks_cover<GROUP>(p, s, head_of(step), row_of(step),
                                                                min(row_of(step) + BLOCK_N, end), n0, keys_end, tid)) == COVER_NONE)
            ++step;
        return step;
    }

    __device__ __forceinline__ elem_t* q_tile() const { return sQ + buf * BLOCK_N * Tiles::QK_PITCH; }
    __device__ __forceinline__ elem_t* do_tile() const { return sDO + buf * BLOCK_N * Tiles::V_PITCH; }

    // Requests the rows of ``step`` (none past the last step) into buffers ``into``: Q, dO and the
    // rows' LSE and D, one group; by the GROUP threads numbered tid.
    template <int GROUP = THREADS>
    __device__ __forceinline__ void load_rows(int step, int into, int tid = threadIdx.x) {
        if (step < steps()) {
            const int h = head_of(step), m = row_of(step);
            const elem_t* q = (const elem_t*)p.q + row_offset(b, s.start_q, 0, h, p.q_b, p.q_n, p.q_h);
            load_tile<BLOCK_N, DIM_QK, typename Tiles::template QK<BLOCK_N>, GROUP>(
                sQ + into * BLOCK_N * Tiles::QK_PITCH, q, p.q_n, p.q_d, m, s.len_q, p.head_dim, tid);
            // The LSE (natural log) and D of each row, 0 past the sequence, copied like the tiles
            // so that no thread waits on them before its products.
            const float* lse = (const float*)p.lse + (i64)b * p.lse_b + (i64)h * p.lse_h + s.start_q + m;
            const float* delta = (const float*)p.delta + (i64)b * p.delta_b + (i64)h * p.delta_h + s.start_q + m;
            static_assert(GROUP >= BLOCK_N, "a row a thread");
            if (tid < BLOCK_N) {
                const bool valid = m + tid < s.len_q;
                cp_async4(smem_addr(sLse + into * BLOCK_N + tid), valid ? lse + tid : lse, valid);
                cp_async4(smem_addr(sDelta + into * BLOCK_N + tid), valid ? delta + tid : delta, valid);
            }
            const elem_t* dout = (const elem_t*)p.dout + row_offset(b, s.start_q, 0, h, p.do_b, p.do_n, p.do_h);
            load_tile<BLOCK_N, DIM_V, typename Tiles::template V<BLOCK_N>, GROUP>(
                sDO + into * BLOCK_N * Tiles::V_PITCH, dout, p.do_n, p.do_d, m, s.len_q, p.head_dim_v, tid);
        }
        cp_async_commit();
    }

    // Whether query j of the tile at row m, head h, and key r of this warp make an allowed pair
    // (masked tiles test it), and whether that pair also reads dO (kept by dropout).
    template <bool MASKED>
    __device__ __forceinline__ bool allowed(int h, int m, int r, int j) const {
        return !MASKED || allowed_pair(p, s, h, m + j, n0 + wrow + r);
    }
    template <bool MASKED>
    __device__ __forceinline__ bool reads_do(int h, int m, int r, int j) const {
        if constexpr (DROPOUT) return allowed<MASKED>(h, m, r, j) && dropout_keep(p, b, h, m + j, n0 + wrow + r);
        return allowed<MASKED>(h, m, r, j);
    }

    // The scores S^T of this warp's keys and the step's queries (at row m, head h) into P^T, then
    // P^T Z / (1 - p), in place; dP^T into dS^T, in place (DKDV_PARTS & 1). PROBS or GRADS alone
    // does one half, so that a product may read P^T before dP^T is known: GRADS alone reads P^T
    // from pt, which is P^T itself only where nothing scales it or caps the scores.
    template <bool MASKED, bool PROBS = true, bool GRADS = true>
    __device__ __forceinline__ void probs_and_grads(int h, int m, float (&pt)[ATOMS][BLOCK_N / 8][4],
                                                    float (&dst)[ATOMS][BLOCK_N / 8][4]) const {
        static_assert(PROBS || (!DROPOUT && !SOFTCAP), "dS^T from P^T needs the unscaled P^T, and no cap");
        ScoreMods mods;
        mods.load(p, s, h);
        const float* lse = sLse + buf * BLOCK_N;
        const float* delta = sDelta + buf * BLOCK_N;
        KeepBits<ATOMS, BLOCK_N / 8> keep;
        if constexpr (DROPOUT)
            keep.draw(p, [&](int mt, int nt, bool counter_aligned) {
                return dropout_keep_atom_t(p, b, h, m + 8 * nt, n0 + wrow + 16 * mt, counter_aligned);
            });
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = frag_row(mt, e), c = frag_col(nt, e);
                    const bool ok = allowed<MASKED>(h, m, r, c);
                    float capped = 0.f;
                    const float pr = !PROBS ? pt[mt][nt][e]
                                   : ok ? exp2f(mods.log2_prob(p, pt[mt][nt][e], m + c, n0 + wrow + r, lse[c] * LOG2E, capped))
                                        : 0.f;
                    const bool kept = !DROPOUT || keep.kept(mt, nt, e);
                    if (PROBS) pt[mt][nt][e] = !DROPOUT ? pr : kept ? pr * p.drop_scale : 0.f;
                    if constexpr (DKDV_PARTS & 1) {
                        const float dpr = !DROPOUT ? dst[mt][nt][e] : kept ? dst[mt][nt][e] * p.drop_scale : 0.f;
                        if (GRADS) dst[mt][nt][e] = ok ? through_softcap(pr * (dpr - delta[c]), capped) : 0.f;
                    }
                }
            }
    }

    // Whether a row statistic of the step (``stats``: its BLOCK_N LSEs or Ds) is non-finite. A row's
    // D (rowsum(dO * O) in float32) is non-finite wherever its dO is, as inf * 0 and inf - inf are
    // NaN; so is its LSE wherever its Q is, every allowed score then being infinite or NaN, unless
    // a softcap caps the scores or a sink keeps the LSE of scores all -inf finite (p.sinks: the
    // dK/dV kernels are built without SINKS, as P comes from the LSE). Every warp reads the same
    // values and agrees without a barrier.
    __device__ __forceinline__ bool rows_nonfinite(const float* stats) const {
        bool bad = false;
        for (int i = threadIdx.x % 32; i < BLOCK_N; i += 32) bad |= !finite_float(stats[i]);
        return __any_sync(0xffffffffu, bad);
    }

    // A tile of which some pair reads no dO (and, if masked, no Q): the outputs whose allowed
    // pairs read a non-finite dO or Q element made NaN, and those elements cleared before the
    // products (exact.cuh). A tile is scanned only where its rows' D (for dO) or LSE (for Q) leave
    // it in doubt (rows_nonfinite): each scan is a barrier of the computing threads, which every
    // masked step, and with dropout every step, would otherwise meet.
    template <bool MASKED>
    __device__ __forceinline__ void exact_operands(int h, int m) {
        elem_t* q = q_tile();
        elem_t* dout = do_tile();
        bool bad_do = false, bad_q = false;
        if constexpr (DKDV_PARTS & 2) {
            bad_do = rows_nonfinite(sDelta + buf * BLOCK_N) && tile_nonfinite<BLOCK_N, DIM_V, Tiles::V_PITCH>(dout);
            if (bad_do)
                poison_allowed<ATOMS, BLOCK_N, DIM_V, typename Tiles::template V<BLOCK_N>>(
                    [this, h, m](int r, int j) { return reads_do<MASKED>(h, m, r, j); }, dout, nan_at<ATOMS, DIM_V>(dv));
        }
        if constexpr (DKDV_PARTS & 1) {
            // Dropped pairs still read Q (dS = -P D): only masked tiles need the exact dK.
            bad_q = MASKED && (SOFTCAP || p.sinks || rows_nonfinite(sLse + buf * BLOCK_N))
                    && tile_nonfinite<BLOCK_N, DIM_QK, Tiles::QK_PITCH>(q);
            if (bad_q)
                poison_allowed<ATOMS, BLOCK_N, DIM_QK, typename Tiles::template QK<BLOCK_N>>(
                    [this, h, m](int r, int j) { return allowed<MASKED>(h, m, r, j); }, q, nan_at<ATOMS, DIM_QK>(dk));
        }
        if (bad_do || bad_q) {  // every computing thread is done with the products that read them
            compute_sync();
            if (bad_do) clear_nonfinite<BLOCK_N, DIM_V, Tiles::V_PITCH>(dout);
            if (bad_q) clear_nonfinite<BLOCK_N, DIM_QK, Tiles::QK_PITCH>(q);
            Tiles::written();
            compute_sync();
        }
    }

#if DQ_ATOMIC
    // The fused dQ's parts that do not depend on its product (backward.cuh says what it adds).

    // This warp's rows of dS^T into a step's buffer ``ds`` (Tiles::DS<BLOCK_M>), rounded as the
    // products' operands are.
    __device__ __forceinline__ void store_ds(elem_t* ds, const float (&dst)[ATOMS][BLOCK_N / 8][4]) const {
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    store_pair(&Tiles::template DS<BLOCK_M>::at(ds, wrow + frag_row(mt, 2 * half), frag_col(nt, 0)),
                               dst[mt][nt][2 * half], dst[mt][nt][2 * half + 1]);
    }

    // The float32 sums of dQ from query row m of head h, columns DQ_PANEL * panel on: p.dq holds
    // those of the launch's kv heads, each head's columns in panels of DQ_PANEL, each panel's rows
    // contiguous (launch._dkdv_adding_dq), so that the rows of a step in a panel are one range.
    __device__ __forceinline__ float* dq_panel(int h, int m, int panel) const {
        const int index = (h - p.kv_head0 * p.group) * (DIM_QK / DQ_PANEL) + panel;
        return (float*)p.dq + row_offset(b, s.start_q, m, index, p.dq_b, p.dq_n, p.dq_h);
    }

    // The dQ sums of a masked step (queries from row m of head h) when K holds a NaN or an
    // infinity, in place of its product: element by element over the allowed pairs only, from the
    // step's dS^T in ``ds``, since a disallowed pair must not add 0 * inf. An element is NaN where an
    // allowed pair reads a non-finite K (the contract: NaN in, NaN out).
    __device__ void exact_dq(const elem_t* ds, int h, int m) const {
        for (int idx = threadIdx.x; idx < BLOCK_N * DIM_QK; idx += THREADS) {
            const int i = idx / DIM_QK, c = idx % DIM_QK;
            if (m + i >= s.len_q) continue;
            float sum = 0.f;
            for (int j = 0; j < BLOCK_M && sum == sum; ++j) {
                if (!allowed_pair(p, s, h, m + i, n0 + j)) continue;
                const elem_t kv = Tiles::template QK<BLOCK_M>::at(sK, j, c);
                sum = finite_bits(kv) ? fmaf(to_float(Tiles::template DS<BLOCK_M>::at(ds, j, i)), to_float(kv), sum)
                                      : QUIET_NAN;
            }
            reduce_add(dq_panel(h, m + i, c / DQ_PANEL) + c % DQ_PANEL, sum * p.scale);
        }
    }
#endif

    // dK (scaled) and dV of this warp's keys into the outputs, in the m16n8 accumulator layout.
    __device__ __forceinline__ void store() const {
        elem_t* dk_out = (elem_t*)p.dk + row_offset(b, s.start_k, 0, hk, p.dk_b, p.dk_n, p.dk_h);
        elem_t* dv_out = (elem_t*)p.dv + row_offset(b, s.start_k, 0, hk, p.dv_b, p.dv_n, p.dv_h);
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = n0 + wrow + frag_row(mt, e);
                if (j >= keys_out()) continue;
                if constexpr (DKDV_PARTS & 1)
#pragma unroll
                    for (int nt = 0; nt < DIM_QK / 8; ++nt) {
                        const int c = frag_col(nt, e);
                        if (c < p.head_dim) dk_out[(i64)j * p.dk_n + c] = from_float(dk[mt][nt][e] * p.scale);
                    }
                if constexpr (DKDV_PARTS & 2)
#pragma unroll
                    for (int nt = 0; nt < DIM_V / 8; ++nt) {
                        const int c = frag_col(nt, e);
                        if (c < p.head_dim_v) dv_out[(i64)j * p.dv_n + c] = from_float(dv[mt][nt][e]);
                    }
            }
    }
};

// The steps from ``step`` on, each with the next one's rows requested: one uniform branch a step
// picks the masked body or the other (Cta::accumulate<MASKED>(step, next)).
template <typename Cta>
__device__ __forceinline__ void accumulate_steps(Cta& cta, int step) {
    while (step < cta.steps()) {
        const int next = cta.allowed_step(step + 1);
        const int m = cta.row_of(step);
        if (tile_unmasked(cta.p, cta.s, m, m + BLOCK_N, cta.n0, cta.n0 + BLOCK_M))
            cta.template accumulate<false>(step, next);
        else
            cta.template accumulate<true>(step, next);
        step = next;
    }
}
