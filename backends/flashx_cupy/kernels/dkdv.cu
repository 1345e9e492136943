// flashx_dkdv: dK and dV, and with DQ_ATOMIC dQ's float32 sums (backward.cuh says how).

#include "backward.cuh"

// One CTA's keys (K and V resident), its stream of query tiles and its dK and dV sums. Step
// ``step`` is query tile step % tiles of query head hk * group + step / tiles.
struct KeyCta {
    const Params& p;
    Sequence s;
    int b, hk, n0, wrow;
    int tile_lo, tiles;  // the query tiles from row tile_lo on that some key of the CTA reads
    elem_t *sK, *sV, *sQ, *sDO, *sDS;
    float *sLse, *sDelta, *sStage;
    int buf;  // the Q/dO buffers of the step being computed; the other pair is loading
    bool k_nonfinite;  // K holds a NaN or an infinity (DQ_ATOMIC: masked tiles take the exact dQ)
    // DQ_ATOMIC: the step whose dS^T waits in the other dS^T buffer for its dQ product (head, row;
    // dq_head < 0: none). The product runs one step late, after the barrier that starts the next
    // step, so that it needs no barrier of its own.
    int dq_head, dq_row;
    bool dq_masked;
#if DKDV_PARTS & 1
    float dk[ATOMS][DIM_QK / 8][4];
#endif
#if DKDV_PARTS & 2
    float dv[ATOMS][DIM_V / 8][4];
#endif

    __device__ __forceinline__ int steps() const { return tiles * p.group; }
    __device__ __forceinline__ int head_of(int step) const { return hk * p.group + step / tiles; }
    __device__ __forceinline__ int row_of(int step) const { return tile_lo + step % tiles * BLOCK_N; }

    // Requests the rows of ``step`` (none past the last step) into the other buffers: Q, dO and
    // the rows' LSE and D, one group.
    __device__ __forceinline__ void load_rows(int step) {
        if (step < steps()) {
            const int h = head_of(step), m = row_of(step), other = buf ^ 1;
            const elem_t* q = (const elem_t*)p.q + row_offset(b, s.start_q, 0, h, p.q_b, p.q_n, p.q_h);
            load_tile<BLOCK_N, DIM_QK, Padded<LD_QK>>(sQ + other * BLOCK_N * LD_QK, q, p.q_n, p.q_d, m, s.len_q, p.head_dim);
            // The LSE (natural log) and D of each row, 0 past the sequence, copied like the tiles
            // so that no thread waits on them before its products.
            const float* lse = (const float*)p.lse + (i64)b * p.lse_b + (i64)h * p.lse_h + s.start_q + m;
            const float* delta = (const float*)p.delta + (i64)b * p.delta_b + (i64)h * p.delta_h + s.start_q + m;
            for (int r = threadIdx.x; r < BLOCK_N; r += THREADS) {
                const bool valid = m + r < s.len_q;
                cp_async4(smem_addr(sLse + other * BLOCK_N + r), valid ? lse + r : lse, valid);
                cp_async4(smem_addr(sDelta + other * BLOCK_N + r), valid ? delta + r : delta, valid);
            }
            const elem_t* dout = (const elem_t*)p.dout + row_offset(b, s.start_q, 0, h, p.do_b, p.do_n, p.do_h);
            load_tile<BLOCK_N, DIM_V, Padded<LD_V>>(sDO + other * BLOCK_N * LD_V, dout, p.do_n, p.do_d, m, s.len_q, p.head_dim_v);
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
#if DROPOUT
        return allowed<MASKED>(h, m, r, j) && dropout_keep(p, b, h, m + j, n0 + wrow + r);
#else
        return allowed<MASKED>(h, m, r, j);
#endif
    }

    // Step ``step``, and the requests for step ``next``.
    template <bool MASKED>
    __device__ __forceinline__ void accumulate(int step, int next) {
        constexpr bool EXACT = MASKED || DROPOUT;  // some pair of the tile reads no dO (and, if masked, no Q)
        cp_async_wait<0>();  // Q and dO of this step
        __syncthreads();     // ... for every thread; and every warp is done with the other buffers
        load_rows(next);
#if DQ_ATOMIC
        add_dq();  // the previous step's
#endif
        const int h = head_of(step), m = row_of(step);
        ScoreMods mods;
        mods.load(p, s, h);
        elem_t* q_tile = sQ + buf * BLOCK_N * LD_QK;
        elem_t* do_tile = sDO + buf * BLOCK_N * LD_V;
        const float* lse = sLse + buf * BLOCK_N;
        const float* delta = sDelta + buf * BLOCK_N;

        float pt[ATOMS][BLOCK_N / 8][4];  // P^T, then P^T Z / (1 - p)
        zero<ATOMS, BLOCK_N>(pt);
        gemm_abt<ATOMS, BLOCK_N, DIM_QK, LD_QK, LD_QK>(pt, sK + wrow * LD_QK, q_tile);

#if DKDV_PARTS & 1
        float dst[ATOMS][BLOCK_N / 8][4];  // dP^T, then dS^T
        zero<ATOMS, BLOCK_N>(dst);
        gemm_abt<ATOMS, BLOCK_N, DIM_V, LD_V, LD_V>(dst, sV + wrow * LD_V, do_tile);
#endif
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#if DROPOUT
                const u32 kept = dropout_keep_atom_t(p, b, h, m + 8 * nt, n0 + wrow + 16 * mt);
#endif
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = frag_row(mt, e), c = frag_col(nt, e);
                    const bool ok = allowed<MASKED>(h, m, r, c);
                    float capped;
                    const float pr = ok ? exp2f(mods.log2_prob(p, pt[mt][nt][e], m + c, n0 + wrow + r, lse[c] * LOG2E, capped)) : 0.f;
#if DROPOUT
                    const bool keep = kept >> e & 1;
                    pt[mt][nt][e] = keep ? pr * p.drop_scale : 0.f;
#if DKDV_PARTS & 1
                    const float dpr = keep ? dst[mt][nt][e] * p.drop_scale : 0.f;
#endif
#else
                    pt[mt][nt][e] = pr;
#if DKDV_PARTS & 1
                    const float dpr = dst[mt][nt][e];
#endif
#endif
#if DKDV_PARTS & 1
                    dst[mt][nt][e] = ok ? through_softcap(pr * (dpr - delta[c]), capped) : 0.f;
#endif
                }
            }

        if constexpr (EXACT) {
#if DKDV_PARTS & 2
            const bool bad_do = tile_nonfinite<BLOCK_N, DIM_V, LD_V>(do_tile);
            if (bad_do)
                poison_allowed<ATOMS, BLOCK_N, DIM_V, Padded<LD_V>>([this, h, m](int r, int j) { return reads_do<MASKED>(h, m, r, j); }, do_tile, nan_at<ATOMS, DIM_V>(dv));
#else
            const bool bad_do = false;
#endif
#if DKDV_PARTS & 1
            // Dropped pairs still read Q (dS = -P D): only masked tiles need the exact dK.
            const bool bad_q = MASKED && tile_nonfinite<BLOCK_N, DIM_QK, LD_QK>(q_tile);
            if (bad_q)
                poison_allowed<ATOMS, BLOCK_N, DIM_QK, Padded<LD_QK>>([this, h, m](int r, int j) { return allowed<MASKED>(h, m, r, j); }, q_tile, nan_at<ATOMS, DIM_QK>(dk));
#else
            const bool bad_q = false;
#endif
            if (bad_do || bad_q) {
                __syncthreads();
                if (bad_do) clear_nonfinite<BLOCK_N, DIM_V, LD_V>(do_tile);
                if (bad_q) clear_nonfinite<BLOCK_N, DIM_QK, LD_QK>(q_tile);
                __syncthreads();
            }
        }
#if DQ_ATOMIC
        store_ds(dst);
#endif
#if DKDV_PARTS & 2
        gemm_areg<ATOMS, BLOCK_N, DIM_V, LD_V>(dv, pt, do_tile, sStage + wrow * BLOCK_N);
#endif
#if DKDV_PARTS & 1
        gemm_areg<ATOMS, BLOCK_N, DIM_QK, LD_QK>(dk, dst, q_tile, sStage + wrow * BLOCK_N);
#endif
#if DQ_ATOMIC
        dq_head = h;
        dq_row = m;
        dq_masked = MASKED;
#endif
        buf ^= 1;
    }

#if DQ_ATOMIC
    // This warp's rows of dS^T into this step's buffer, rounded as the products' operands are.
    __device__ __forceinline__ void store_ds(const float (&dst)[ATOMS][BLOCK_N / 8][4]) {
        elem_t* ds = sDS + buf * BLOCK_M * LD_DS;
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    store_pair(ds + (wrow + frag_row(mt, 2 * half)) * LD_DS + frag_col(nt, 0), dst[mt][nt][2 * half],
                               dst[mt][nt][2 * half + 1]);
    }

    // dQ += scale * dS K for the pending step's queries (row dq_row of head dq_head), dS^T from the
    // buffer the next step does not write. Each warp takes QATOMS atoms of 16 queries (two where
    // the tile has no more atoms than warps: each ldmatrix of K then serves two atoms) and COLS
    // columns, the GROUPS warps of a set of atoms splitting the head dim, PASS columns at a time:
    // fewer live accumulators beside dK and dV.
    __device__ __forceinline__ void add_dq() {
        constexpr int ATOMS_N = BLOCK_N / 16, QATOMS = ATOMS_N > WARPS ? ATOMS_N / WARPS : ATOMS_N < 2 ? 1 : 2;
        constexpr int GROUPS = WARPS * QATOMS / ATOMS_N, COLS = DIM_QK / GROUPS, PASS = COLS < 64 ? COLS : 64;
        static_assert(ATOMS_N % QATOMS == 0 && (WARPS * QATOMS) % ATOMS_N == 0 && COLS % 16 == 0, "whole atoms a warp");
        if (dq_head < 0) return;
        const int m = dq_row;
        const elem_t* ds = sDS + (buf ^ 1) * BLOCK_M * LD_DS;
        float* dq = (float*)p.dq + row_offset(b, s.start_q, m, dq_head - p.kv_head0 * p.group, p.dq_b, p.dq_n, p.dq_h);
        if (dq_masked && k_nonfinite) {
            exact_dq(ds, dq);
            return;
        }
        const int warp = threadIdx.x / 32;
        const int qrow = warp % (WARPS / GROUPS) * QATOMS * 16, col0 = warp / (WARPS / GROUPS) * COLS;
#pragma unroll 1
        for (int c0 = col0; c0 < col0 + COLS; c0 += PASS) {
            float acc[QATOMS][PASS / 8][4];
            zero<QATOMS, PASS>(acc);
            gemm_atb<QATOMS, PASS, BLOCK_M, LD_DS, LD_QK>(acc, ds + qrow, sK + c0);
#pragma unroll
            for (int mt = 0; mt < QATOMS; ++mt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int i = qrow + frag_row(mt, 2 * half);
                    if (m + i >= s.len_q) continue;
#pragma unroll
                    for (int nt = 0; nt < PASS / 8; ++nt)
                        reduce_add_pair(dq + (i64)i * p.dq_n + c0 + frag_col(nt, 0), acc[mt][nt][2 * half] * p.scale,
                                        acc[mt][nt][2 * half + 1] * p.scale);
                }
        }
    }

    // The same sums for a masked tile when K holds a NaN or an infinity, element by element over
    // the allowed pairs only: a disallowed pair must not add 0 * inf. An element is NaN where an
    // allowed pair reads a non-finite K (the contract: NaN in, NaN out).
    __device__ void exact_dq(const elem_t* ds, float* dq) const {
        const int h = dq_head, m = dq_row;
        for (int idx = threadIdx.x; idx < BLOCK_N * DIM_QK; idx += THREADS) {
            const int i = idx / DIM_QK, c = idx % DIM_QK;
            if (m + i >= s.len_q) continue;
            float sum = 0.f;
            for (int j = 0; j < BLOCK_M && sum == sum; ++j) {
                if (!allowed_pair(p, s, h, m + i, n0 + j)) continue;
                const elem_t kv = sK[j * LD_QK + c];
                sum = finite_bits(kv) ? fmaf(to_float(ds[j * LD_DS + i]), to_float(kv), sum) : QUIET_NAN;
            }
            reduce_add(dq + (i64)i * p.dq_n + c, sum * p.scale);
        }
    }
#endif
};

// One CTA an SM is asked for: left free, ptxas holds the float32 d64 variant to 168 registers
// (three CTAs an SM) and spills.
extern "C" __global__ void __launch_bounds__(THREADS, 1) flashx_dkdv(const Params p) {
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* sK = (elem_t*)smem;                                            // BLOCK_M x LD_QK
    elem_t* sV = sK + BLOCK_M * LD_QK;                                     // BLOCK_M x LD_V
    elem_t* sQ = sV + BLOCK_M * LD_V;                                      // 2 x BLOCK_N x LD_QK
    elem_t* sDO = sQ + 2 * BLOCK_N * LD_QK;                                // 2 x BLOCK_N x LD_V
    float* sLse = (float*)(sDO + 2 * BLOCK_N * LD_V);                      // 2 x BLOCK_N
    float* sDelta = sLse + 2 * BLOCK_N;                                    // 2 x BLOCK_N
    float* sStage = sDelta + 2 * BLOCK_N;                                  // float32: BLOCK_M x BLOCK_N
    elem_t* sDS = (elem_t*)(sStage + (TENSOR_CORES ? 0 : BLOCK_M * BLOCK_N));  // DQ_ATOMIC: 2 x BLOCK_M x LD_DS

    int tile, hk, b;
    grid_tile(p.tiles_m, p.kv_heads, tile, hk, b);
    hk += p.kv_head0;
    const Sequence s = sequence(p, b);
    const int n0 = tile * BLOCK_M;
    const int keys_out = VARLEN ? s.len_k : p.seqlen_k;  // padded keys past len_k still get dk = dv = 0
    if (n0 >= keys_out) return;
    const int warp = threadIdx.x / 32;
    const int wrow = warp * ATOMS * 16;

    // Query rows [first, end) use some key of this tile.
    const int diag = s.len_k - s.len_q;
    const int keys_end = min(n0 + BLOCK_M, s.len_k);
    int first = max(n0 - diag - p.right, 0);
    int end = min(keys_end - 1 - diag + p.left + 1, s.len_q);
    if (keys_end <= n0 || end <= first) first = end = 0;
    const int tile_lo = first / BLOCK_N * BLOCK_N;

    KeyCta cta{p, s, b, hk, n0, wrow, tile_lo, (end - tile_lo + BLOCK_N - 1) / BLOCK_N, sK, sV, sQ, sDO, sDS, sLse,
               sDelta, sStage, 1, false, -1, 0, false};
#if DKDV_PARTS & 1
    zero<ATOMS, DIM_QK>(cta.dk);
#endif
#if DKDV_PARTS & 2
    zero<ATOMS, DIM_V>(cta.dv);
#endif
    const int steps = cta.steps();
    auto allowed_step = [&](int step) {  // the first step from ``step`` on that the block mask allows
        while (step < steps && !blocks_allow(p, s, cta.head_of(step), cta.row_of(step),
                                             min(cta.row_of(step) + BLOCK_N, end), n0, keys_end))
            ++step;
        return step;
    };

    const elem_t* k = (const elem_t*)p.k + row_offset(b, s.start_k, 0, hk, p.k_b, p.k_n, p.k_h);
    const elem_t* v = (const elem_t*)p.v + row_offset(b, s.start_k, 0, hk, p.v_b, p.v_n, p.v_h);
    load_tile<BLOCK_M, DIM_QK, Padded<LD_QK>>(sK, k, p.k_n, p.k_d, n0, s.len_k, p.head_dim);
    load_tile<BLOCK_M, DIM_V, Padded<LD_V>>(sV, v, p.v_n, p.v_d, n0, s.len_k, p.head_dim_v);
    int step = allowed_step(0);
    cta.load_rows(step);  // into buffers 0, in K and V's group
    cta.buf = 0;
#if DQ_ATOMIC
    cp_async_wait<0>();
    __syncthreads();
    cta.k_nonfinite = tile_nonfinite<BLOCK_M, DIM_QK, LD_QK>(sK);
#endif

    // One uniform branch a step picks the body.
    while (step < steps) {
        const int next = allowed_step(step + 1);
        const int m = cta.row_of(step);
        if (tile_unmasked(p, s, m, m + BLOCK_N, n0, n0 + BLOCK_M))
            cta.accumulate<false>(step, next);
        else
            cta.accumulate<true>(step, next);
        step = next;
    }
    cp_async_wait<0>();
#if DQ_ATOMIC
    __syncthreads();  // the last step's dS^T
    cta.add_dq();
#endif

    elem_t* dk_out = (elem_t*)p.dk + row_offset(b, s.start_k, 0, hk, p.dk_b, p.dk_n, p.dk_h);
    elem_t* dv_out = (elem_t*)p.dv + row_offset(b, s.start_k, 0, hk, p.dv_b, p.dv_n, p.dv_h);
#pragma unroll
    for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = n0 + wrow + frag_row(mt, e);
            if (j >= keys_out) continue;
#if DKDV_PARTS & 1
#pragma unroll
            for (int nt = 0; nt < DIM_QK / 8; ++nt) {
                const int c = frag_col(nt, e);
                if (c < p.head_dim) dk_out[(i64)j * p.dk_n + c] = from_float(cta.dk[mt][nt][e] * p.scale);
            }
#endif
#if DKDV_PARTS & 2
#pragma unroll
            for (int nt = 0; nt < DIM_V / 8; ++nt) {
                const int c = frag_col(nt, e);
                if (c < p.head_dim_v) dv_out[(i64)j * p.dv_n + c] = from_float(cta.dv[mt][nt][e]);
            }
#endif
        }
}
