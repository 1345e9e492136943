// Decoding with a KV cache (the contract's "Decoding with a KV cache"): split-KV attention over a
// contiguous cache (B, S, Hk, D) or a paged one (P, page_size, Hk, D) read through block_table.
// Three kernels of one module, launched in this order on the caller's stream, none of which the
// host waits for (so a call is capturable in a CUDA graph):
//
//   flashx_decode_append  one CTA per new token: its keys and values into their cache slot, at
//                         position cache_seqlens[b] + t.
//   flashx_decode         one CTA per (sequence, kv head, row tile, split). Its rows are the query
//                         rows of every query head that reads the kv head, query-major: row r is
//                         query i = r / group of head hk * group + r % group, so the split's keys
//                         and values are read once for the whole GQA group. Key tiles of BLOCK_N
//                         keys stream through STAGES shared buffers (bulk copies or cp.async,
//                         below);
//                         each of the WARPS warps takes WARP_KEYS keys of every tile for all of
//                         the CTA's rows (tensor cores for 16-bit inputs: the rows padded to 16),
//                         with its own online softmax in base 2, and the warps' states are joined
//                         at the end in a fixed order. With one split it writes o and lse (the
//                         sink joined); with more, each split's normalised o and base-2 LSE.
//   flashx_decode_merge   with more than one split, a warp per (sequence, query row, head): the
//                         splits joined as "Merging partial results" says, then the sink, once.
//
// A split holds a fixed share of the key tiles that its rows may see, computed on the device from
// the sequence's length, so a fixed split count gives the same bits on every call. Keys outside the
// rows' band and past the sequence are never read (their rows of a tile are zero-filled), so stale
// slots and unused pages hold anything. Tiles that every row may use in full run without a pair
// test; the others (the band's edges, the sequence's end, the tree mask's last Nq keys) test every
// pair and keep a NaN or inf stored at a disallowed pair out of the products (common.cuh's
// poison_allowed). In a paged cache each row of a tile is found through the block table, whose
// entries for a tile are read into shared memory one tile before its copies are issued.
//
// A tile's rows arrive one of two ways. With BULK (sm_90), one 1-D bulk copy per cache row (a
// row's Dk or Dv elements are contiguous, and in a paged cache lie in one page): the CTA's first
// BLOCK_N threads copy a K row each and the next BLOCK_N a V row each, so that a thread computes one
// row's address a tile, and the copies complete on the stage's mbarrier (mbarrier.cuh). Thread 0
// announces a tile's bytes to that barrier before the CTA barrier after which its copies are
// issued, and every thread waits on it before reading the stage. Rows of keys the split does not
// use are zeroed by their thread instead, and the columns past the head dim once, before the first
// tile, so that the tiles are the cp.async path's to the bit. Without BULK, each thread copies
// 16-byte chunks of rows by cp.async (zero-filling the rows and columns that are not read), STAGES -
// 1 groups in flight.
//
// An FP8 cache (FP8_CACHE, float8_e4m3fn under 16-bit queries) streams its bytes through the
// STAGES buffers the same way, 16 values a 16-byte copy, at half the bytes of a 16-bit cache. When
// a tile is in, the CTA widens it once into a single 16-bit tile (fp8.cuh), which the products
// read as they read a 16-bit cache's stage; k_descale multiplies each dot product before its
// modifications, v_descale each row's output factor, and flashx_decode_append quantizes new tokens
// by them. The FP8 code is compile-time: a 16-bit cache's build holds none of it.
//
// Macros beyond common.cuh's and score_mods.cuh's (flashx_cupy.variants): STAGES key tiles in
// flight; PAGED 1 for a paged cache; FP8_CACHE 1 for a float8_e4m3fn cache; BULK 1 for bulk
// copies of K and V (sm_90, ALIGNED operands). Params: seqlen_q = Nq,
// left/right the band with an unbounded side as a reach past every key, tiles_m the row tiles,
// splits, new_tokens, page_size; k_descale and v_descale (B, Hk) float32 or null (1).

#include "common.cuh"
#include "score_mods.cuh"
#include "mbarrier.cuh"

// The decoding kernels' arguments: Params, then int32 cache_seqlens (B,) and block_table (B,
// max_pages), the new tokens, the splits' float32 partial results, (splits, B * Nq * Hq, DIM_V) and
// (splits, B * Nq * Hq), and their strides and counts (flashx_cupy.launch.DECODE_PARAMS).
struct DecodeParams : Params {
    u64 cache_seqlens, block_table, k_new, v_new, o_part, lse_part;
    i64 table_b, kn_b, kn_n, kn_h, kn_d, vn_b, vn_n, vn_h, vn_d;  // block_table's row, k_new's and v_new's strides
    int new_tokens, page_size, splits;  // Nn, page_size (0: a contiguous cache), splits of each sequence's keys
};

#if FP8_CACHE
#include "fp8.cuh"
typedef u8 cache_t;  // e4m3 bytes, widened in shared memory
#define CACHE_LD_QK DIM_QK  // a stage's rows unpadded: widen_tile reads them in 128-byte runs
#define CACHE_LD_V DIM_V
#define COMPUTE_TILES 1  // the products read one widened tile...
#define BYTE_STAGES STAGES  // ... from the STAGES buffers of bytes
#else
typedef elem_t cache_t;  // the stages are the products' tiles
#define CACHE_LD_QK LD_QK
#define CACHE_LD_V LD_V
#define COMPUTE_TILES STAGES
#define BYTE_STAGES 0
#endif

#define ROW_ATOMS (BLOCK_M / 16)         // 16-row atoms of the CTA's rows, every warp holding all of them
#define WARP_KEYS (BLOCK_N / WARPS)      // keys of each tile that one warp takes
static_assert(WARP_KEYS % 16 == 0 && WARP_KEYS <= 64, "a warp's keys feed mma in 16s and poison_allowed in 64s");
static_assert(BLOCK_M % 16 == 0 && THREADS >= BLOCK_M, "whole atoms; a thread per row for the row results");
static_assert(STAGES >= 2, "a tile is computed while the next ones load");
static_assert(!BULK || (ALIGNED && THREADS == 2 * BLOCK_N), "bulk copies: 16-byte aligned rows, a thread per K and per V row");

// The result of a row from its base-2 maximum ``m2`` (0 for a row without keys) and its sum of
// 2^(s - m2) over its keys: ``scale`` turns the row's accumulator into o, ``lse`` in natural log,
// the sink of head h joined under SINKS. A sum of 0 means no allowed key: scale 0, lse the sink
// or -inf. NaN stays NaN.
__device__ __forceinline__ void row_result(const DecodeParams& p, int h, float m2, float sum, float& scale, float& lse) {
    const bool empty = sum == 0.f;
    if constexpr (SINKS) {
        const float sink = ((const float*)p.sinks)[h];
        float keys_share;
        const float lse2 = with_sink(m2, sum, sink * LOG2E, keys_share);
        scale = empty ? 0.f : keys_share;
        lse = empty ? sink : lse2 * LN2;
    } else {
        scale = empty ? 0.f : 1.f / sum;
        lse = empty ? NEG_INF : (m2 + log2f(sum)) * LN2;
    }
}

// The index of row (b, i, h) in the splits' partial results: (b, i, h) row-major, as o.
__device__ __forceinline__ i64 part_row(const DecodeParams& p, int b, int i, int h) {
    return ((i64)b * p.seqlen_q + i) * p.heads_q + h;
}

// Rows [0, ROWS) of a tile of T (elem_t, or an FP8 cache's bytes) into shared memory, LD elements
// apart: row r from base + at(r) (an element offset; -1: the row is not read and holds zeros),
// columns >= width zero (all-zero bits: +0 in every element type).
template <int ROWS, int COLS, int LD, typename T, typename RowAt>
__device__ __forceinline__ void load_rows(T* s, const T* base, RowAt at, int width, i64 col_stride) {
    if constexpr (ALIGNED) {
        // Each thread copies one 16-byte column chunk of every STEP-th row.
        constexpr int PER_CHUNK = 16 / (int)sizeof(T), PER_ROW = COLS / PER_CHUNK, STEP = THREADS / PER_ROW;
        static_assert(THREADS % PER_ROW == 0, "a thread keeps its column");
        const int c = threadIdx.x % PER_ROW * PER_CHUNK, r0 = threadIdx.x / PER_ROW;
        const u32 dst = smem_addr(s + r0 * LD + c);
#pragma unroll
        for (int r = r0; r < ROWS; r += STEP) {
            const i64 offset = at(r);
            const bool valid = offset >= 0 && c < width;
            cp_async16(dst + (r - r0) * LD * (int)sizeof(T), valid ? base + offset + c : base, valid);
        }
    } else {
        for (int idx = threadIdx.x; idx < ROWS * COLS; idx += THREADS) {
            const int r = idx / COLS, c = idx % COLS;
            const i64 offset = at(r);
            s[r * LD + c] = offset >= 0 && c < width ? base[offset + c * col_stride] : T(0);
        }
    }
}

// Row r of a tile of T in shared memory (``s``, LD elements a row): ``bytes`` from base + at(r) by
// one bulk copy counted on ``full``, or, where at(r) is -1 (a key the split does not use), zeros
// stored by this thread, fenced for the copy a later tile makes into the row.
template <int LD, typename T, typename RowAt>
__device__ __forceinline__ void bulk_row(T* s, const T* base, RowAt at, int r, u32 bytes, u64* full) {
    const i64 offset = at(r);
    T* row = s + r * LD;
    if (offset >= 0) {
        bulk_load(smem_addr(row), base + offset, bytes, full);
        return;
    }
    for (u32 c = 0; c < bytes; c += 16) *(uint4*)((char*)row + c) = make_uint4(0, 0, 0, 0);
    fence_proxy_async();
}

// Columns [width, COLS) of rows [0, ROWS) zero: the bytes past a row's copy (width a whole number
// of 16-byte chunks).
template <int ROWS, int COLS, int LD, typename T>
__device__ __forceinline__ void zero_columns(T* s, int width) {
    for (int r = threadIdx.x; r < ROWS; r += THREADS)
        for (int c = width; c < COLS; c += 16 / (int)sizeof(T)) *(uint4*)(s + r * LD + c) = make_uint4(0, 0, 0, 0);
}

// A CTA of flashx_decode: its rows, the keys they use, its split's tiles, and each warp's running
// softmax over its keys.
struct DecodeCta {
    const DecodeParams& p;
    int b, hk, split, row0, rows;  // rows [row0, row0 + BLOCK_M) of the group's rows = Nq * group
    int length, diag;              // Lk and Lk - Nq: query i sits at key position diag + i
    int lo, hi;                    // keys [lo, hi) are used by some row of the CTA
    int tile_lo, tile_hi;          // the split's key tiles
    int full_lo, full_hi;          // tiles [full_lo, full_hi) are allowed to every row in full
    int query[ROW_ATOMS][2];       // the query index of this lane's rows (frag_row(mt, 2 * half))
    ScoreMods mods[ROW_ATOMS][2];  // their heads' modifications (rows mix heads)
    float acc[ROW_ATOMS][DIM_V / 8][4];
    float row_max[ROW_ATOMS][2], row_sum[ROW_ATOMS][2];  // per lane: its columns' share of the row sum
    elem_t *sQ, *sK, *sV;    // the tiles the products read (COMPUTE_TILES of each)
    cache_t *sKs, *sVs;      // the STAGES buffers the copies fill: sK and sV themselves for a 16-bit cache
    int2* sPages;  // PAGED: (page, slot) of each row of the next two tiles to request
    u64* sFull;    // BULK: a barrier per stage, whose phase completes when a tile's rows have landed
    float* sStage;

    // The CTA's rows, keys and tiles; the empty running state.
    __device__ __forceinline__ void start() {
        const int seqlen_q = p.seqlen_q;
        length = ((const int*)p.cache_seqlens)[b] + p.new_tokens;
        diag = length - seqlen_q;
        const int first_i = row0 / p.group, last_i = (min(row0 + BLOCK_M, rows) - 1) / p.group;
        lo = max(diag + first_i - p.left, 0);
        hi = max(min(diag + last_i + p.right + 1, length), lo);
        int every_lo = max(diag + last_i - p.left, 0), every_hi = min(diag + first_i + p.right + 1, length);
        if constexpr (MASK) every_hi = min(every_hi, diag);  // the tree mask's keys are tested pair by pair
        // The split's share of the tiles [lo / BLOCK_N, ceil(hi / BLOCK_N)), and its unmasked ones.
        const int first = lo / BLOCK_N, last = hi > lo ? (hi + BLOCK_N - 1) / BLOCK_N : first;
        const int per_split = (last - first + p.splits - 1) / p.splits;
        tile_lo = min(first + split * per_split, last);
        tile_hi = min(tile_lo + per_split, last);
        full_lo = min(max((every_lo + BLOCK_N - 1) / BLOCK_N, tile_lo), tile_hi);
        full_hi = every_hi > 0 ? min(max(every_hi / BLOCK_N, full_lo), tile_hi) : full_lo;

        Sequence s;
        s.b = b;
        s.len_q = seqlen_q;
        s.len_k = length;
#pragma unroll
        for (int mt = 0; mt < ROW_ATOMS; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = min(row0 + frag_row(mt, 2 * half), rows - 1);  // padding rows borrow a real one's head
                query[mt][half] = row / p.group;
                mods[mt][half].load(p, s, hk * p.group + row % p.group);
                row_max[mt][half] = NEG_INF;
                row_sum[mt][half] = 0.f;
            }
        zero<ROW_ATOMS, DIM_V>(acc);
    }

    // Whether row r of the CTA may use key j: the contract's rule at the row's own position.
    __device__ __forceinline__ bool allowed(int r, int j) const {
        const int row = row0 + r;
        if (row >= rows) return false;
        const int i = row / p.group, position = diag + i;
        bool ok = j < length && j >= position - p.left && j <= position + p.right;
        const int column = j - diag;  // the tree mask's column: >= 0 over the last Nq keys
        if (MASK && ok && column >= 0) {
            const int h = hk * p.group + row % p.group;
            ok = ((const unsigned char*)p.mask)[(i64)b * p.mask_b + (i64)h * p.mask_h + (i64)i * p.mask_i +
                                                (i64)column * p.mask_j] != 0;
        }
        return ok;
    }

    // (page, slot) of row ``tid`` of tile t, for the threads tid < BLOCK_N: read from the block
    // table only where the split uses the key (entries past a sequence may hold anything).
    __device__ __forceinline__ int2 page_slot(int t) const {
        int2 at = make_int2(0, 0);
        const int position = t * BLOCK_N + (int)threadIdx.x;
        if (PAGED && threadIdx.x < BLOCK_N && t < tile_hi && position >= lo && position < hi) {
            const int page = position / p.page_size;
            at = make_int2(((const int*)p.block_table)[(i64)b * p.table_b + page], position - page * p.page_size);
        }
        return at;
    }

    __device__ __forceinline__ void keep_pages(int buffer, int2 at) {
        if (PAGED && threadIdx.x < BLOCK_N) sPages[buffer * BLOCK_N + threadIdx.x] = at;
    }

    // Requests the K and V rows of tile t (none past the split) into stage ``stage``; in a paged
    // cache their (page, slot) from page buffer t - tile_lo mod 2.
    __device__ __forceinline__ void request(int t, int stage) {
        if (t >= tile_hi) return;
        const int n = t * BLOCK_N, low = lo, high = hi;
        const int2* pages = sPages + ((t - tile_lo) & 1) * BLOCK_N;
        auto row_at = [=](i64 row_stride, i64 page_stride) {
            return [=](int r) -> i64 {
                const int position = n + r;
                if (position < low || position >= high) return -1;
                if constexpr (PAGED) {
                    const int2 at = pages[r];
                    return (i64)at.x * page_stride + (i64)at.y * row_stride;
                }
                return (i64)position * row_stride;
            };
        };
        const cache_t* k = (const cache_t*)p.k + (PAGED ? 0 : (i64)b * p.k_b) + (i64)hk * p.k_h;
        const cache_t* v = (const cache_t*)p.v + (PAGED ? 0 : (i64)b * p.v_b) + (i64)hk * p.v_h;
        if constexpr (BULK) {
            const int r = threadIdx.x % BLOCK_N;
            if (threadIdx.x < BLOCK_N)
                bulk_row<CACHE_LD_QK>(sKs + stage * BLOCK_N * CACHE_LD_QK, k, row_at(p.k_n, p.k_b), r,
                                      p.head_dim * (u32)sizeof(cache_t), sFull + stage);
            else
                bulk_row<CACHE_LD_V>(sVs + stage * BLOCK_N * CACHE_LD_V, v, row_at(p.v_n, p.v_b), r,
                                     p.head_dim_v * (u32)sizeof(cache_t), sFull + stage);
        } else {
            load_rows<BLOCK_N, DIM_QK, CACHE_LD_QK>(sKs + stage * BLOCK_N * CACHE_LD_QK, k, row_at(p.k_n, p.k_b),
                                                    p.head_dim, p.k_d);
            load_rows<BLOCK_N, DIM_V, CACHE_LD_V>(sVs + stage * BLOCK_N * CACHE_LD_V, v, row_at(p.v_n, p.v_b),
                                                  p.head_dim_v, p.v_d);
        }
    }

    // BULK: thread 0 announces the bytes of tile t (none past the split) to the barrier of stage
    // ``stage``, whose previous phase every thread has waited for: its rows of keys in [lo, hi).
    __device__ __forceinline__ void expect(int t, int stage) {
        if (threadIdx.x != 0 || t >= tile_hi) return;
        const int n = t * BLOCK_N, rows = min(hi - n, BLOCK_N) - max(lo - n, 0);
        bar_arrive_expect_bytes(sFull + stage, rows * (p.head_dim + p.head_dim_v) * (u32)sizeof(cache_t));
    }

    // The barriers, armed for the tiles the prologue requests, and the stages' columns past the
    // head dims zeroed; before a barrier of the CTA.
    __device__ __forceinline__ void prepare_bulk() {
        if (threadIdx.x == 0) {
            for (int stage = 0; stage < STAGES; ++stage) bar_init(sFull + stage, 1);
            fence_proxy_async();  // the initialized barriers, for the copies that complete on them
        }
        for (int ahead = 0; ahead < STAGES - 1; ++ahead) expect(tile_lo + ahead, ahead);
        zero_columns<STAGES * BLOCK_N, DIM_QK, CACHE_LD_QK>(sKs, p.head_dim);
        zero_columns<STAGES * BLOCK_N, DIM_V, CACHE_LD_V>(sVs, p.head_dim_v);
    }

    // Until the tile of ``step`` (its stage step % STAGES) has landed for this thread.
    __device__ __forceinline__ void wait_tile(int step) {
        if constexpr (BULK) bar_wait(sFull + step % STAGES, (step / STAGES) & 1);
        else cp_async_wait<STAGES - 2>();  // all but the newest STAGES - 2 groups
    }

    // The tile of stage ``stage`` as the products read it: which of the COMPUTE_TILES holds it. A
    // 16-bit cache's stage is its own; an FP8 cache's bytes are widened into the one 16-bit tile,
    // once for all the warps (every warp is past its products on the previous tile, and every copy
    // of this one is in: the caller's barrier).
    __device__ __forceinline__ int computed_tile(int stage) {
#if FP8_CACHE
        widen_tile<BLOCK_N, DIM_QK, LD_QK>(sK, sKs + stage * BLOCK_N * DIM_QK);
        widen_tile<BLOCK_N, DIM_V, LD_V>(sV, sVs + stage * BLOCK_N * DIM_V);
        __syncthreads();
        return 0;
#else
        return stage;
#endif
    }

#if FP8_CACHE
    // The descale (b, hk) of the keys (``k`` true) or of the values, 1 without one. The keys' is
    // read for each tile (an L1 hit) and applied right after the scores' product: held through the
    // tile loop, or applied inside the softmax, it made ptxas spill variants at its register targets
    // (mask and ALiBi at 16 rows; flashx_cupy.resources).
    __device__ __forceinline__ float descale(bool k) const {
        const u64 descales = k ? p.k_descale : p.v_descale;
        return descales ? ((const float*)descales)[(i64)b * p.heads_k + hk] : 1.f;
    }
#endif

    // The scores of this warp's keys from key0 become probabilities; the running max, sum and
    // output move to the new max.
    template <bool MASKED>
    __device__ __forceinline__ void softmax(float (&sc)[ROW_ATOMS][WARP_KEYS / 8][4], int key0) {
        float tile_max[ROW_ATOMS][2];
#pragma unroll
        for (int mt = 0; mt < ROW_ATOMS; ++mt) tile_max[mt][0] = tile_max[mt][1] = NEG_INF;
#pragma unroll
        for (int mt = 0; mt < ROW_ATOMS; ++mt)
#pragma unroll
            for (int nt = 0; nt < WARP_KEYS / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = key0 + frag_col(nt, e);
                    float x = mods[mt][e / 2].score2(p, sc[mt][nt][e], query[mt][e / 2], j);
                    if (MASKED && !allowed(frag_row(mt, e), j)) x = NEG_INF;
                    sc[mt][nt][e] = x;
                    tile_max[mt][e / 2] = fmaxf(tile_max[mt][e / 2], x);
                }
#pragma unroll
        for (int mt = 0; mt < ROW_ATOMS; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float alpha;
                const float m_ref = move_row_max(row_max[mt][half], row_sum[mt][half], tile_max[mt][half], alpha);
#pragma unroll
                for (int nt = 0; nt < DIM_V / 8; ++nt) acc[mt][nt][2 * half] *= alpha, acc[mt][nt][2 * half + 1] *= alpha;
#pragma unroll
                for (int nt = 0; nt < WARP_KEYS / 8; ++nt)
#pragma unroll
                    for (int e = 2 * half; e < 2 * half + 2; ++e) {
                        const float pr = exp2f(sc[mt][nt][e] - m_ref);
                        row_sum[mt][half] += pr;
                        sc[mt][nt][e] = pr;
                    }
            }
    }

    // This warp's keys of tile t, in compute tile ``tile``.
    template <bool MASKED>
    __device__ __forceinline__ void attend(int t, int tile) {
        const int warp = threadIdx.x / 32, key0 = t * BLOCK_N + warp * WARP_KEYS;
        const elem_t* k_tile = sK + tile * BLOCK_N * LD_QK;
        elem_t* v_tile = sV + tile * BLOCK_N * LD_V;
        float sc[ROW_ATOMS][WARP_KEYS / 8][4];
        zero<ROW_ATOMS, WARP_KEYS>(sc);
        gemm_abt<ROW_ATOMS, WARP_KEYS, DIM_QK, LD_QK, LD_QK>(sc, sQ, k_tile + warp * WARP_KEYS * LD_QK);
#if FP8_CACHE
        const float k_scale = descale(true);  // q . k8 times it is q . k, which the modifications take
#pragma unroll
        for (int mt = 0; mt < ROW_ATOMS; ++mt)
#pragma unroll
            for (int nt = 0; nt < WARP_KEYS / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[mt][nt][e] *= k_scale;
#endif
        softmax<MASKED>(sc, key0);
        if constexpr (MASKED) {  // the branch is the CTA's: every warp takes it
            if (tile_nonfinite<BLOCK_N, DIM_V, LD_V>(v_tile)) {
                poison_allowed<ROW_ATOMS, WARP_KEYS, DIM_V, Padded<LD_V>>(
                    [&](int r, int j) { return allowed(r, key0 + j); }, v_tile + warp * WARP_KEYS * LD_V,
                    nan_at<ROW_ATOMS, DIM_V>(acc));
                __syncthreads();
                clear_nonfinite<BLOCK_N, DIM_V, LD_V>(v_tile);
                if constexpr (BULK) fence_proxy_async();  // a later tile's copies overwrite the stage
                __syncthreads();
            }
        }
        gemm_areg<ROW_ATOMS, WARP_KEYS, DIM_V, LD_V>(acc, sc, v_tile + warp * WARP_KEYS * LD_V,
                                                     sStage + warp * BLOCK_M * WARP_KEYS);
    }

    // Every tile of the split: STAGES - 1 requested ahead, the block table's entries one more.
    // With BULK, the barriers are armed for the first tiles (prepare_bulk) and Q's cp.async group
    // is the only one.
    __device__ __forceinline__ void attend_split() {
#pragma unroll 1
        for (int ahead = 0; ahead < STAGES - 1; ++ahead) {
            keep_pages(ahead & 1, page_slot(tile_lo + ahead));
            if (PAGED) __syncthreads();
            request(tile_lo + ahead, ahead);
            if (!BULK) cp_async_commit();
        }
        if (BULK) cp_async_wait<0>();  // Q: for every thread after the loop's first barrier
        keep_pages((STAGES - 1) & 1, page_slot(tile_lo + STAGES - 1));
#pragma unroll 1
        for (int t = tile_lo; t < tile_hi; ++t) {
            const int step = t - tile_lo;
            wait_tile(step);  // tile t is in
            if constexpr (BULK)  // tile t - 1's stage, for the copies after the barrier
                expect(t + STAGES - 1, (step + STAGES - 1) % STAGES);
            __syncthreads();  // ... for every thread; and every warp is done with tile t - 1's stage
            request(t + STAGES - 1, (step + STAGES - 1) % STAGES);
            if (!BULK) cp_async_commit();
            const int2 pages = page_slot(t + STAGES);  // its latency hides behind the products
            const int tile = computed_tile(step % STAGES);
            if (t < full_lo || t >= full_hi)
                attend<true>(t, tile);
            else
                attend<false>(t, tile);
            keep_pages((step + STAGES) & 1, pages);  // the buffer tile t + STAGES - 2 was requested from
        }
        if (!BULK) cp_async_wait<0>();  // with BULK every tile requested has been waited for
        __syncthreads();  // the buffers become the join's
    }

    // The warps' states joined in warp order through shared memory (over the K/V buffers), then
    // o and lse (one split) or the split's normalised o and base-2 LSE.
    __device__ __forceinline__ void finish() {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        float* sAcc = (float*)sK;                  // BLOCK_M x DIM_V
        float* sMax = sAcc + BLOCK_M * DIM_V;      // WARPS x BLOCK_M
        float* sSum = sMax + WARPS * BLOCK_M;      // WARPS x BLOCK_M
        float* sScale = sSum + WARPS * BLOCK_M;    // BLOCK_M
#pragma unroll
        for (int mt = 0; mt < ROW_ATOMS; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float sum = row_sum[mt][half];
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                if (lane % 4 == 0) {
                    const int r = frag_row(mt, 2 * half);
                    sMax[warp * BLOCK_M + r] = row_max[mt][half];
                    sSum[warp * BLOCK_M + r] = sum;
                }
            }
        __syncthreads();
        float weight[ROW_ATOMS][2];  // exp2(this warp's max - the row's)
#pragma unroll
        for (int mt = 0; mt < ROW_ATOMS; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) weight[mt][half] = exp2f(row_max[mt][half] - joined_max(sMax, frag_row(mt, 2 * half)));
#pragma unroll 1
        for (int w = 0; w < WARPS; ++w) {
            if (warp == w)
#pragma unroll
                for (int mt = 0; mt < ROW_ATOMS; ++mt)
#pragma unroll
                    for (int nt = 0; nt < DIM_V / 8; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            float& to = sAcc[frag_row(mt, e) * DIM_V + frag_col(nt, e)];
                            const float x = acc[mt][nt][e] * weight[mt][e / 2];
                            to = w == 0 ? x : to + x;
                        }
            __syncthreads();
        }

        if (threadIdx.x < BLOCK_M) {  // a thread per row: its sum, its LSE, its output's factor
            const int r = threadIdx.x, row = row0 + r;
            const float m_ref = joined_max(sMax, r);
            float sum = 0.f;
            for (int w = 0; w < WARPS; ++w) sum += sSum[w * BLOCK_M + r] * exp2f(sMax[w * BLOCK_M + r] - m_ref);
            float scale = 0.f;
            if (row < rows) {
                const int i = row / p.group, h = hk * p.group + row % p.group;
                if (p.splits == 1) {
                    float lse;
                    row_result(p, h, m_ref, sum, scale, lse);
                    ((float*)p.lse)[(i64)b * p.lse_b + (i64)h * p.lse_h + i] = lse;
                } else {  // without the sink, which the merge joins once
                    const bool empty = sum == 0.f;
                    scale = empty ? 0.f : 1.f / sum;
                    ((float*)p.lse_part)[split * (i64)p.batch * p.seqlen_q * p.heads_q + part_row(p, b, i, h)] =
                        empty ? NEG_INF : m_ref + log2f(sum);
                }
            }
#if FP8_CACHE
            scale *= descale(false);  // the products summed v8: o is v's descale times their normalised sum
#endif
            sScale[r] = scale;
        }
        __syncthreads();

        const int width = p.head_dim_v;
        for (int idx = threadIdx.x; idx < BLOCK_M * width; idx += THREADS) {
            const int r = idx / width, c = idx % width, row = row0 + r;
            if (row >= rows) break;  // rows past the group's are the tile's last
            const float scale = sScale[r];
            const float x = scale == 0.f ? 0.f : sAcc[r * DIM_V + c] * scale;  // no key: o = 0, whatever acc holds
            const int i = row / p.group, h = hk * p.group + row % p.group;
            if (p.splits == 1)
                ((elem_t*)p.o)[(i64)b * p.o_b + (i64)i * p.o_n + (i64)h * p.o_h + (i64)c * p.o_d] = from_float(x);
            else
                ((float*)p.o_part)[(split * (i64)p.batch * p.seqlen_q * p.heads_q + part_row(p, b, i, h)) * DIM_V + c] = x;
        }
    }

    // The row's maximum over the warps, 0 where none saw a key (as the online softmax's shift).
    __device__ __forceinline__ float joined_max(const float* sMax, int r) const {
        float m = NEG_INF;
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, sMax[w * BLOCK_M + r]);
        return m == NEG_INF ? 0.f : m;
    }
};

// ptxas's own register targets for some builds with bulk copies spilled (float32 at d64 and 16 rows:
// 96 registers; an FP8 cache at d64 and 32 rows with a mask and softcap: 128); the bound of one CTA an
// SM lets them take what they need, and they keep the CTAs an SM of their cp.async builds: a float32
// CTA's shared memory holds at most two, which no register count up to 255 lowers, and the FP8
// builds' registers fit as many CTAs as their cp.async builds' (flashx_cupy.resources). The 16-bit
// caches' bulk builds keep ptxas's targets: with the bound, one at d64 took 176 registers, a CTA
// fewer an SM.
#if BULK && (DTYPE == 2 || FP8_CACHE)
#define DECODE_BOUNDS __launch_bounds__(THREADS, 1)
#else
#define DECODE_BOUNDS __launch_bounds__(THREADS)
#endif

extern "C" __global__ void DECODE_BOUNDS flashx_decode(const DecodeParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* sQ = (elem_t*)smem;                                // BLOCK_M x LD_QK
    elem_t* sK = sQ + BLOCK_M * LD_QK;                         // COMPUTE_TILES x BLOCK_N x LD_QK
    elem_t* sV = sK + COMPUTE_TILES * BLOCK_N * LD_QK;         // COMPUTE_TILES x BLOCK_N x LD_V
#if FP8_CACHE
    cache_t* sKs = (cache_t*)(sV + BLOCK_N * LD_V);            // STAGES x BLOCK_N x DIM_QK bytes
    cache_t* sVs = sKs + STAGES * BLOCK_N * DIM_QK;            // STAGES x BLOCK_N x DIM_V bytes
    int2* sPages = (int2*)(sVs + STAGES * BLOCK_N * DIM_V);    // PAGED: 2 x BLOCK_N
#else
    cache_t *sKs = sK, *sVs = sV;
    int2* sPages = (int2*)(sV + STAGES * BLOCK_N * LD_V);      // PAGED: 2 x BLOCK_N
#endif
    u64* sFull = (u64*)(sPages + (PAGED ? 2 * BLOCK_N : 0));  // STAGES barriers, used by BULK
    float* sStage = (float*)(sFull + STAGES);                   // float32: WARPS x BLOCK_M x WARP_KEYS
    static_assert((BLOCK_M * DIM_V + (2 * WARPS + 1) * BLOCK_M) * 4 <= COMPUTE_TILES * BLOCK_N * (LD_QK + LD_V) *
                  (int)sizeof(elem_t) + BYTE_STAGES * BLOCK_N * (DIM_QK + DIM_V),
                  "the join must fit the K/V buffers (the tiles and, for an FP8 cache, the stages after them)");

    int x = blockIdx.x;  // (sequence, kv head, row tile, split), the split fastest
    const int split = x % p.splits;
    x /= p.splits;
    const int tile = x % p.tiles_m;
    x /= p.tiles_m;
    const int hk = x % p.heads_k, b = x / p.heads_k;
    DecodeCta cta{p, b, hk, split, tile * BLOCK_M, p.seqlen_q * p.group};
    cta.sQ = sQ, cta.sK = sK, cta.sV = sV, cta.sKs = sKs, cta.sVs = sVs, cta.sPages = sPages, cta.sFull = sFull;
    cta.sStage = sStage;
    cta.start();
    if constexpr (BULK) {
        cta.prepare_bulk();
        __syncthreads();  // the barriers initialized and armed before any copy or wait
    }

    const elem_t* q = (const elem_t*)p.q + (i64)b * p.q_b;
    const int row0 = cta.row0, rows = cta.rows, group = p.group;
    const i64 q_n = p.q_n, q_h = p.q_h;
    load_rows<BLOCK_M, DIM_QK, LD_QK>(sQ, q, [=](int r) -> i64 {
        const int row = row0 + r;
        return row < rows ? (i64)(row / group) * q_n + (i64)(hk * group + row % group) * q_h : -1;
    }, p.head_dim, p.q_d);
    cp_async_commit();  // Q arrives with the first tile (cp.async groups complete in order; BULK: waited alone)
    cta.attend_split();
    cta.finish();
}

// One warp per (sequence, query row, head): lse = logsumexp of the splits' LSEs (and the sink),
// o = their outputs weighted by 2^(lse_split - lse). Splits without a key (LSE -inf) weigh exactly
// 0; NaN propagates. The splits are summed in order: the same bits every call.
extern "C" __global__ void __launch_bounds__(THREADS) flashx_decode_merge(const DecodeParams p) {
    const int lane = threadIdx.x % 32;
    const i64 rows = (i64)p.batch * p.seqlen_q * p.heads_q;
    const i64 row = (i64)blockIdx.x * WARPS + threadIdx.x / 32;  // (b, i, h) row-major: part_row
    if (row >= rows) return;
    const int h = (int)(row % p.heads_q), i = (int)(row / p.heads_q % p.seqlen_q), b = (int)(row / ((i64)p.heads_q * p.seqlen_q));
    const float* lse_part = (const float*)p.lse_part + row;  // split s at s * rows
    float m = NEG_INF;
    for (int s = lane; s < p.splits; s += 32) m = fmaxf(m, lse_part[s * rows]);
#pragma unroll
    for (int shift = 16; shift >= 1; shift /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, shift));
    const float m_ref = m == NEG_INF ? 0.f : m;
    float sum = 0.f;
    for (int s = lane; s < p.splits; s += 32) sum += exp2f(lse_part[s * rows] - m_ref);
#pragma unroll
    for (int shift = 16; shift >= 1; shift /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, shift);
    float scale, lse;
    row_result(p, h, m_ref, sum, scale, lse);
    if (lane == 0) ((float*)p.lse)[(i64)b * p.lse_b + (i64)h * p.lse_h + i] = lse;

    elem_t* o = (elem_t*)p.o + (i64)b * p.o_b + (i64)i * p.o_n + (i64)h * p.o_h;
    for (int c = 4 * lane; c < p.head_dim_v; c += 128) {  // four columns a lane; o_part's rows are DIM_V wide
        float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < p.splits; ++s) {
            const float weight = exp2f(lse_part[s * rows] - m_ref);
            const float4 part = *(const float4*)((const float*)p.o_part + (s * rows + row) * DIM_V + c);
            total.x += weight * part.x, total.y += weight * part.y, total.z += weight * part.z, total.w += weight * part.w;
        }
        const float out[4] = {total.x, total.y, total.z, total.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (c + e < p.head_dim_v) o[(i64)(c + e) * p.o_d] = from_float(scale == 0.f ? 0.f : out[e] * scale);
    }
}

// A new token's element as its cache holds it: itself in a 16-bit cache; in an FP8 cache the
// float32 quotient by the descale of its sequence and head (``descales`` (B, Hk), null: 1) at
// ``at``, correctly rounded, then rounded to e4m3 (the contract's rule).
__device__ __forceinline__ cache_t cached(elem_t x, u64 descales, i64 at) {
#if FP8_CACHE
    const float value = to_float(x);
    return e4m3_of(descales ? __fdiv_rn(value, ((const float*)descales)[at]) : value);
#else
    return x;
#endif
}

// One CTA per new token t of sequence b: its (Hk, D) keys and (Hk, Dv) values into the cache slot
// of position cache_seqlens[b] + t, element by element through every stride (a few kilobytes).
extern "C" __global__ void __launch_bounds__(THREADS) flashx_decode_append(const DecodeParams p) {
    const int b = blockIdx.x / p.new_tokens, t = blockIdx.x % p.new_tokens;
    const int position = ((const int*)p.cache_seqlens)[b] + t;
    int page = b, slot = position;
    if constexpr (PAGED) {
        page = ((const int*)p.block_table)[(i64)b * p.table_b + position / p.page_size];
        slot = position % p.page_size;
    }
    cache_t* k = (cache_t*)p.k + (i64)page * p.k_b + (i64)slot * p.k_n;
    cache_t* v = (cache_t*)p.v + (i64)page * p.v_b + (i64)slot * p.v_n;
    const elem_t* k_new = (const elem_t*)p.k_new + (i64)b * p.kn_b + (i64)t * p.kn_n;
    const elem_t* v_new = (const elem_t*)p.v_new + (i64)b * p.vn_b + (i64)t * p.vn_n;
    const i64 heads = (i64)b * p.heads_k;  // the descales' row of sequence b
    for (int idx = threadIdx.x; idx < p.heads_k * p.head_dim; idx += THREADS) {
        const int h = idx / p.head_dim, d = idx % p.head_dim;
        k[(i64)h * p.k_h + (i64)d * p.k_d] = cached(k_new[(i64)h * p.kn_h + (i64)d * p.kn_d], p.k_descale, heads + h);
    }
    for (int idx = threadIdx.x; idx < p.heads_k * p.head_dim_v; idx += THREADS) {
        const int h = idx / p.head_dim_v, d = idx % p.head_dim_v;
        v[(i64)h * p.v_h + (i64)d * p.v_d] = cached(v_new[(i64)h * p.vn_h + (i64)d * p.vn_d], p.v_descale, heads + h);
    }
}
