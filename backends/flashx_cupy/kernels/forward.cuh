// What the two forwards share, forward.cu (mma.sync) and forward_sm90.cu (wgmma): one CTA per
// (query tile, query head, sequence), all on the grid's x axis; the order of its key tiles; the
// online softmax; the epilogue. Both products leave a tile's scores in the m16n8 accumulator
// layout (wgmma's m64nN accumulator gives each warp of a warpgroup 16 rows in it), so everything
// between the products is one code.
//
// The key tiles of a CTA come in two kinds, each its own compiled body: masked tiles (the band's
// edges, a sequence's end, any bool or block mask), which test every pair, and the unmasked
// steady state between them, which tests none. The masked tiles run first, then the unmasked
// ones; key tiles that no row of the CTA may use are never visited, and block-mask tiles it
// disallows are skipped unread.
//
// Online softmax in base 2: scores are softmax_scale * log2(e) times the dot products (then capped
// and biased, score_mods.cuh); the LSE leaves in natural log, the sink folded in once at the end.
// O leaves through shared memory in 16-byte rows.
//
// The unmasked tiles of the wgmma forwards, where a score is a non-negative multiple of its dot
// product (no softcap or ALiBi, and a scale >= 0: NEGATIVE_SCALE is the host's), take the row max
// over the dot products themselves, scaled once a row, and each weight's exponent is one FFMA,
// dot * scale - max, as FA3 has it: a multiply a score fewer. Scaling by a non-negative number
// keeps the order, so the max is the same number. Masked tiles, a negative scale and the
// modifications take the max of the scaled scores: a masked pair's -inf times a scale of 0 (or
// one that flushes to 0) would be NaN. The mma.sync forward keeps that way throughout: at its 255
// registers the scale held through the exponentials spills at d128.

#include "common.cuh"
#include "score_mods.cuh"

#ifndef NEGATIVE_SCALE
#define NEGATIVE_SCALE 0
#endif
constexpr bool UNMASKED_MAX_OF_DOTS = PRODUCER_THREADS > 0 && !SOFTCAP && !ALIBI && !NEGATIVE_SCALE;

// The wgmma forwards move a row's max lazily (move_row_max), which 16-bit weights allow: the weight
// of a maximum the reference lags behind, up to 2^8, rounds as a normalised weight would in plain
// attention. e4m3 weights (WEIGHTS_E4M3, the FP8 forward) keep the exact max, as the contract's FP8
// exactness asks: with four significant bits that weight, the one that counts most, must be 1.
#ifndef WEIGHTS_E4M3
#define WEIGHTS_E4M3 0
#endif
constexpr bool LAZY_MAX = PRODUCER_THREADS > 0 && !WEIGHTS_E4M3;
// A block mask whose blocks a tile spans at most this many of: each lane tests a tile alone (visited).
constexpr int WARP_SCAN_BLOCKS = 9;

// A CTA's query rows, the keys they use and their running softmax and output. Each warp owns
// ATOMS atoms of 16 rows from row wrow of the tile.
struct ForwardRows {
    const Params& p;
    Sequence s;
    int h, b, m0, wrow;
    // Set by start(): rows [m0, rows_out) are written, [m0, rows_end) are in the sequence; keys
    // [lo, end) hold the used ones, tiles [unmasked_lo, unmasked_hi) need no pair test (empty
    // when unmasked_lo == unmasked_hi == end).
    int rows_out, rows_end, lo, end, unmasked_lo, unmasked_hi;
    float acc[ATOMS][DIM_V / 8][4];
    float row_max[ATOMS][2], row_sum[ATOMS][2];  // per lane: its columns' share of the row sum
    ScoreMods mods;
    // The warp's last scan of the block mask (visited): of the 32 tiles from rank scan_rank on,
    // those allowed in some pairs (bits of scan_some) and in all (scan_all).
    int scan_rank;
    u32 scan_some, scan_all;

    // Whether the CTA has rows to write; if so, its key range and empty running state.
    __device__ __forceinline__ bool start() {
        rows_out = VARLEN ? s.len_q : p.seqlen_q;  // padded rows past len_q still get o = 0, lse = -inf
        if (m0 >= rows_out) return false;
        const int diag = s.len_k - s.len_q;
        rows_end = min(m0 + BLOCK_M, s.len_q);
        int first = max(m0 + diag - p.left, 0);
        end = min(rows_end - 1 + diag + p.right + 1, s.len_k);
        if (rows_end <= m0 || end <= first) first = end = 0;
        lo = first / BLOCK_N * BLOCK_N;
        unmasked_lo = unmasked_hi = end;
        if constexpr (!MASK) {
            if (m0 + BLOCK_M <= s.len_q) {
                const int from = max(m0 + BLOCK_M - 1 + diag - p.left, lo);  // every row of the tile reaches back
                const int to = min(s.len_k, m0 + diag + p.right + 1);        // and forward
                const int a = (from + BLOCK_N - 1) / BLOCK_N * BLOCK_N, z = to > 0 ? to / BLOCK_N * BLOCK_N : 0;
                if (a < z) unmasked_lo = a, unmasked_hi = z;
            }
        }
        zero<ATOMS, DIM_V>(acc);
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) row_max[mt][half] = NEG_INF, row_sum[mt][half] = 0.f;
        mods.load(p, s, h);
        scan_rank = -32;
        return true;
    }

    // The tile visited after the tile at n, the block mask aside: the band's masked tiles [lo,
    // unmasked_lo) and [unmasked_hi, end) first, then its unmasked ones.
    __device__ __forceinline__ int after(int n) const {
        if (n >= unmasked_lo && n < unmasked_hi) return n + BLOCK_N < unmasked_hi ? n + BLOCK_N : end;
        n += BLOCK_N;
        if (n == unmasked_lo) n = unmasked_hi;
        return n < end ? n : unmasked_lo;  // after the last masked tile, the first unmasked one
    }

    // The first tile visited, the block mask aside, or end.
    __device__ __forceinline__ int first_tile() const {
        if (lo != unmasked_lo) return lo;
        return unmasked_hi < end ? unmasked_hi : unmasked_lo;
    }

    // The tiles in the order visited (after()): the band's masked ones before and after its
    // unmasked ones, then those; rank r's tile, or end past the last.
    __device__ __forceinline__ int masked_before() const { return (unmasked_lo - lo + BLOCK_N - 1) / BLOCK_N; }
    __device__ __forceinline__ int masked_after() const { return (end - unmasked_hi + BLOCK_N - 1) / BLOCK_N; }
    __device__ __forceinline__ int tile_of_rank(int r) const {
        const int before = masked_before(), masked = before + masked_after();
        if (r < before) return lo + r * BLOCK_N;
        if (r < masked) return unmasked_hi + (r - before) * BLOCK_N;
        const int n = unmasked_lo + (r - masked) * BLOCK_N;
        return n < unmasked_hi ? n : end;
    }
    __device__ __forceinline__ int rank_of(int n) const {
        if (n >= unmasked_lo && n < unmasked_hi) return masked_before() + masked_after() + (n - unmasked_lo) / BLOCK_N;
        if (n >= unmasked_hi) return masked_before() + (n - unmasked_hi) / BLOCK_N;
        return (n - lo) / BLOCK_N;
    }

    // The first tile visited from n on that the block mask does not skip, or end, and its cover.
    // In the wgmma forwards, where a tile spans few blocks, every warp of the GROUP threads that run
    // the schedule finds it alone, with no barrier: a scan tests 32 tiles (a lane a tile, a ballot)
    // and serves the calls until the schedule passes them. Elsewhere the GROUP threads vote on one
    // tile at a time (blocks_cover). (In the mma.sync forward the lanes' scan spills beside its
    // registers at d128.)
    template <int GROUP>
    __device__ __forceinline__ int visited(int n, int& cover, int tid) {
        cover = COVER_ALL;
        if constexpr (BLOCK_MASK && PRODUCER_THREADS > 0) {
            if ((BLOCK_M / p.block_q + 1) * (BLOCK_N / p.block_k + 1) <= WARP_SCAN_BLOCKS) {
                for (int r = rank_of(n); n < end; r = scan_rank + 32, n = tile_of_rank(r)) {
                    if ((unsigned)(r - scan_rank) >= 32u) {
                        const int mine = tile_of_rank(r + threadIdx.x % 32);
                        const int held = mine < end ? blocks_cover<1, true, false>(p, s, h, m0, rows_end, mine,
                                                                                    min(mine + BLOCK_N, end), 0)
                                                    : COVER_NONE;
                        scan_rank = r;
                        scan_some = __ballot_sync(0xffffffffu, held != COVER_NONE);
                        scan_all = __ballot_sync(0xffffffffu, held == COVER_ALL);
                    }
                    const u32 ahead = scan_some >> (r - scan_rank);
                    if (ahead) {
                        const int first = r - scan_rank + __ffs(ahead) - 1;
                        cover = scan_all >> first & 1 ? COVER_ALL : COVER_SOME;
                        return tile_of_rank(scan_rank + first);
                    }
                }
                return n;
            }
        }
        while (n < end && (cover = blocks_cover<GROUP>(p, s, h, m0, rows_end, n, min(n + BLOCK_N, end), tid)) == COVER_NONE)
            n = after(n);
        return n;
    }

    // Whether row r of the tile reads key j through V: allowed (masked tiles test it) and kept.
    template <bool MASKED>
    __device__ __forceinline__ bool reads_v(int r, int j) const {
        if (MASKED && !allowed_pair(p, s, h, m0 + r, j)) return false;
        if constexpr (DROPOUT) return dropout_keep(p, b, h, m0 + r, j);
        return true;
    }

    // The dot products of the key tile at n become its probabilities (zero where dropped); the running
    // max, sum and output move to the tile's max, alpha[mt][half] the factor of the move. DEFERRED
    // leaves the output's move to rescale(alpha), so that a product still adding to the output
    // may finish in between; with LAZY_MAX it moves the max lazily, so that most tiles owe none.
    template <bool MASKED, bool DEFERRED = false>
    __device__ __forceinline__ void softmax(float (&sc)[ATOMS][BLOCK_N / 8][4], int n, float (&alpha)[ATOMS][2]) {
        constexpr bool MAX_OF_DOTS = UNMASKED_MAX_OF_DOTS && !MASKED;
        float tile_max[ATOMS][2];
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt) tile_max[mt][0] = tile_max[mt][1] = NEG_INF;
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = MAX_OF_DOTS ? sc[mt][nt][e]
                                          : mods.score2(p, sc[mt][nt][e], m0 + wrow + frag_row(mt, e), n + frag_col(nt, e));
                    if (MASKED && !allowed_pair(p, s, h, m0 + wrow + frag_row(mt, e), n + frag_col(nt, e))) x = NEG_INF;
                    sc[mt][nt][e] = x;
                    tile_max[mt][e / 2] = fmaxf(tile_max[mt][e / 2], x);
                }
        if constexpr (MAX_OF_DOTS)
#pragma unroll
            for (int mt = 0; mt < ATOMS; ++mt) tile_max[mt][0] *= p.scale_log2, tile_max[mt][1] *= p.scale_log2;

        KeepBits<ATOMS, BLOCK_N / 8> keep;
        if constexpr (DROPOUT)
            keep.draw(p, [&](int mt, int nt, bool counter_aligned) {
                return dropout_keep_atom(p, b, h, m0 + wrow + 16 * mt, n + 8 * nt, counter_aligned);
            });
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float m_ref = move_row_max<DEFERRED && LAZY_MAX>(row_max[mt][half], row_sum[mt][half], tile_max[mt][half], alpha[mt][half]);
                if constexpr (!DEFERRED)
#pragma unroll
                    for (int nt = 0; nt < DIM_V / 8; ++nt) acc[mt][nt][2 * half] *= alpha[mt][half], acc[mt][nt][2 * half + 1] *= alpha[mt][half];
#pragma unroll
                for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
                    for (int e = 2 * half; e < 2 * half + 2; ++e) {
                        const float pr = exp2f(MAX_OF_DOTS ? fmaf(sc[mt][nt][e], p.scale_log2, -m_ref) : sc[mt][nt][e] - m_ref);
                        row_sum[mt][half] += pr;  // the LSE is taken before dropout
                        sc[mt][nt][e] = !DROPOUT || keep.kept(mt, nt, e) ? pr : 0.f;
                    }
            }
        }
    }

    // The output's move of a DEFERRED softmax: a thread whose rows kept their max (alpha exactly 1;
    // most tiles under LAZY_MAX) skips the multiplies.
    __device__ __forceinline__ void rescale(const float (&alpha)[ATOMS][2]) {
        bool moved = false;
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt) moved |= alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
        if (!moved) return;
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int nt = 0; nt < DIM_V / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][nt][e] *= alpha[mt][e / 2];
    }

    // O = acc / row sum and the LSE, O staged through sO (BLOCK_M rows of LD_V elements; each
    // warp stages and stores its own rows). A row with no allowed key has o = 0 and lse = -inf, or
    // the sink.
    __device__ __forceinline__ void store(elem_t* sO) const {
        const int lane = threadIdx.x % 32;
        float* lse = (float*)p.lse + (i64)b * p.lse_b + (i64)h * p.lse_h + s.start_q;
        const float sink = SINKS ? ((const float*)p.sinks)[h] : 0.f;
#pragma unroll
        for (int mt = 0; mt < ATOMS; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float total = row_sum[mt][half];
                total += __shfl_xor_sync(0xffffffffu, total, 1);
                total += __shfl_xor_sync(0xffffffffu, total, 2);
                const int r = wrow + frag_row(mt, 2 * half);
                const bool empty = total == 0.f;
                float out_scale;
                if constexpr (SINKS) {
                    float keys_share;
                    const float lse2 = with_sink(row_max[mt][half], total, sink * LOG2E, keys_share);
                    out_scale = empty ? 0.f : p.drop_scale * keys_share;
                    if (m0 + r < rows_out && lane % 4 == 0) lse[m0 + r] = empty ? sink : lse2 * LN2;
                } else {
                    out_scale = empty ? 0.f : p.drop_scale / total;
                    if (m0 + r < rows_out && lane % 4 == 0)
                        lse[m0 + r] = empty ? NEG_INF : (row_max[mt][half] + log2f(total)) * LN2;
                }
#pragma unroll
                for (int nt = 0; nt < DIM_V / 8; ++nt)
                    store_pair(sO + r * LD_V + frag_col(nt, 0), empty ? 0.f : acc[mt][nt][2 * half] * out_scale,
                               empty ? 0.f : acc[mt][nt][2 * half + 1] * out_scale);
            }
        __syncwarp();

        elem_t* o = (elem_t*)p.o + row_offset(b, s.start_q, 0, h, p.o_b, p.o_n, p.o_h);
        if constexpr (ALIGNED) {  // o is the backend's own contiguous allocation: aligned whenever the inputs are
            constexpr int PER_ROW = DIM_V / CHUNK;
            for (int idx = lane; idx < ATOMS * 16 * PER_ROW; idx += 32) {
                const int r = wrow + idx / PER_ROW, c = idx % PER_ROW * CHUNK;
                if (m0 + r < rows_out && c < p.head_dim_v)
                    *(uint4*)(o + (i64)(m0 + r) * p.o_n + c) = *(const uint4*)(sO + r * LD_V + c);
            }
        } else {
            for (int idx = lane; idx < ATOMS * 16 * DIM_V; idx += 32) {
                const int r = wrow + idx / DIM_V, c = idx % DIM_V;
                if (m0 + r < rows_out && c < p.head_dim_v) o[(i64)(m0 + r) * p.o_n + c * p.o_d] = sO[r * LD_V + c];
            }
        }
    }
};

// Every key tile of the CTA through cta.attend<MASKED>(n, next), which reads the tile at n from
// buffers cta.buf and requests the tile at next (none at end) into the others: the band's masked
// tiles, then its unmasked ones (ForwardRows::after), one uniform branch a tile picking the body; a
// tile that the block mask allows in part takes the masked body, one it allows nowhere is not
// visited. The first tile is requested here into buffers 0, in one group with what the caller
// requested before (Q). cta.finish() ends the products and hands the buffers over to O's staging.
// The block mask's votes are among the GROUP threads numbered tid that run the schedule: all of
// them, or one role's.
template <int GROUP = THREADS, typename Cta>
__device__ __forceinline__ void attend_key_tiles(Cta& cta, int tid = threadIdx.x) {
    int cover;
    const int first = cta.template visited<GROUP>(cta.first_tile(), cover, tid);
    cta.buf = 1;
    cta.load_kv(first);
    cta.buf = 0;
    const int end = cta.end, unmasked_lo = cta.unmasked_lo, unmasked_hi = cta.unmasked_hi;
    for (int n = first; n < end;) {
        const bool masked = n < unmasked_lo || n >= unmasked_hi || cover != COVER_ALL;
        const int next = cta.template visited<GROUP>(cta.after(n), cover, tid);
        if (masked) cta.template attend<true>(n, next);
        else cta.template attend<false>(n, next);
        n = next;
    }
    cta.finish();
}
