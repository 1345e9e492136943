// The forward on Hopper's warpgroup products (wgmma, sm_90a) for float8_e4m3fn q, k and v: the
// contract's FP8 section. o is DTYPE (0 float16, 1 bfloat16: the call's out_dtype), lse float32.
// It is forward_sm90.cu's CTA (a producer warpgroup copying Q once and each key tile's K and V
// into rings of two and three buffers, announced on mbarriers; two computing warpgroups of 64
// query rows; a tile's P V issued after the next tile's S) over e4m3 products, with forward.cuh's
// schedule, softmax and epilogue unchanged:
//
// - S = Q K^T from the e4m3 tiles, products exact and summed in float32 by the tensor cores.
//   q_descale * k_descale (multiplied on the host, passed as ``p.k_descale``, null for 1) joins
//   the scores' scale, and v_descale (``p.v_descale``) o's factor, in the CTA's copy of Params
//   (``descaled``), so that the softmax and the epilogue read them where they read the scale.
// - P is rounded to e4m3 (to nearest, ties to even) against the running max, the row sum taken
//   before the rounding, and multiplied with V in e4m3: the weights of plain attention in FP8.
// - An e4m3 product takes both shared-memory operands K-major, so V's tile is V^T (features x
//   keys). The host lays V out so (flashx_cupy.launch.keys_in_fp8_order): per sequence and head,
//   features x keys, the keys of each 16 in the order that P's register operand wants
//   (wgmma_e4m3.cuh), zero past the keys. The producer then copies V^T by cp.async as it copies K.
//
// Tiles are handled as 16-bit pairs of bytes (wgmma_e4m3.cuh): Q and K rows are one 128-byte
// swizzled row each (a head dim of 64 uses half of it), V^T rows BLOCK_N = 128 keys.

#define PRODUCER_THREADS 128  // one warpgroup that only copies Q, K and V (variants.PRODUCER_WARPS)
#include "forward.cuh"
#include "wgmma.cuh"
#include "wgmma_e4m3.cuh"

static_assert(TENSOR_CORES && ATOMS == 1 && WARPS % 4 == 0, "one 16-row atom per warp, whole warpgroups");
static_assert(BLOCK_N == 128 && (DIM_QK == 64 || DIM_QK == 128) && (DIM_V == 64 || DIM_V == 128),
              "a V^T row of 128 keys is one swizzled row; S's N 128, O's 64 or 128");

typedef unsigned char u8;

#define ROW_BYTES 128                       // a swizzled row: Q's and K's (DIM_QK <= 128 bytes), V^T's (BLOCK_N keys)
#define QK_PAIRS (DIM_QK / 2)               // the pairs of bytes of a Q or K row
#define K_TILE (BLOCK_N * ROW_BYTES / 2)    // a K tile in pairs
#define V_TILE (DIM_V * BLOCK_N / 2)        // a V^T tile in pairs

// Key j of 64 keys from key J0 of a V^T tile (Swizzle128<DIM_V> in pairs), feature c, for
// poison_allowed, which reads whether it is finite: the 16-bit value NaN where the byte is NaN.
template <int J0>
struct KeysOfVt {
    static __device__ __forceinline__ elem_t at(const elem_t* s, int j, int c) {
        const int col = e4m3_key_column(J0 + j);
        const u8 x = *((const u8*)s + Swizzle128<DIM_V>::offset(c, col / 2) + col % 2);
        return e4m3_nan_bytes(x) ? (elem_t)0xffffu : (elem_t)0;
    }
};

// The producer warpgroup (threads THREADS .. THREADS + PRODUCER_THREADS - 1): as forward_sm90.cu's,
// over K (keys x features) and V^T (features x keys) in bytes.
struct ProducerFp8 : ForwardRows {
    const u8 *k, *vt;   // head hk's K at the sequence's key 0, V^T at its key 0
    elem_t *sK, *sV;
    Barriers* bars;
    int tid;            // 0 .. PRODUCER_THREADS - 1
    int buf;            // the schedule's; the buffers follow the tile count
    int requested = 0, announced = 0;

    __device__ __forceinline__ void load_kv(int n) {
        const int t = requested++;
        if (n < end) {
            if (t >= 2) bar_wait(&bars->empty_k[t % 2], (t / 2 - 1) & 1);
            load_tile<BLOCK_N, QK_PAIRS, Swizzle128<BLOCK_N>, PRODUCER_THREADS>(
                sK + t % 2 * K_TILE, (const elem_t*)k, p.k_n / 2, 1, n, s.len_k, p.head_dim / 2, tid);
            if (t >= 3) bar_wait(&bars->empty_v[t % 3], (t / 3 - 1) & 1);
            // V^T's columns are keys: 16-key chunks from the first past the sequence are zeros
            load_tile<DIM_V, BLOCK_N / 2, Swizzle128<DIM_V>, PRODUCER_THREADS>(
                sV + t % 3 * V_TILE, (const elem_t*)(vt + n), p.v_n / 2, 1, 0, p.head_dim_v, (s.len_k - n + 1) / 2, tid);
        }
        cp_async_commit();
    }

    template <bool MASKED>
    __device__ __forceinline__ void attend(int, int next) {
        load_kv(next);
        cp_async_wait<1>();  // this tile's copies (and Q's, with the first)
        fence_proxy_async();
        const int t = announced++;
        if (t == 0) bar_arrive(&bars->full_q);
        bar_arrive(&bars->full_k[t % 2]);
        bar_arrive(&bars->full_v[t % 3]);
    }

    __device__ __forceinline__ void finish() {
        if (announced == 0) {  // no key tile: Q alone
            cp_async_wait<0>();
            fence_proxy_async();
            bar_arrive(&bars->full_q);
        }
    }
};

// The computing threads' rows with their products, as forward_sm90.cu's ForwardCtaSm90 (the owed
// product, the first one against a tile of zeros, the buffers freed once read), over e4m3.
struct ForwardCtaFp8 : ForwardRows {
    elem_t *sK, *sV;
    Barriers* bars;
    u64 q_desc;
    int buf;                          // the schedule's; the buffers follow the tile count
    int tiles = 0;                    // key tiles attended
    const elem_t* v_owed;             // the V^T tile whose product with pf is not yet issued
    u64 *owed_full, *owed_empty;      // its barriers, and the parity of its "full" phase
    u32 owed_parity;
    u32 pf[BLOCK_N / 32][4];          // P of that tile in e4m3, as the A fragments of 32 keys each
    // Output elements an allowed pair poisons with a NaN in V (bit nt * 4 + e of acc[0][nt][e]),
    // made NaN by finish.
    u64 poisoned = 0;

    __device__ __forceinline__ void load_kv(int) {}  // the producer's

    __device__ __forceinline__ void start_owed(const elem_t* zeros) {
        v_owed = zeros;
        owed_full = &bars->full_q, owed_parity = 0, owed_empty = &bars->sink;
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 32; ++kk) pf[kk][0] = pf[kk][1] = pf[kk][2] = pf[kk][3] = 0;
    }

    // Issues O += P V for the owed tile, as one wgmma group.
    __device__ __forceinline__ void issue_pv() {
        const u64 v_desc = wgmma_desc(smem_addr(v_owed), 16);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 32; ++kk) wgmma_rs_e4m3<DIM_V>(acc[0], pf[kk], v_desc + desc_step<DIM_V>(0, 16 * kk));
        wgmma_commit();
    }

    // The key tile at n (the schedule's next is the producer's business).
    template <bool MASKED>
    __device__ __forceinline__ void attend(int n, int) {
        const int t = tiles++;
        bar_wait(&bars->full_k[t % 2], (t / 2) & 1);
        bar_wait(owed_full, owed_parity);
        const elem_t* k_tile = sK + t % 2 * K_TILE;
        elem_t* v_tile = sV + t % 3 * V_TILE;

        float sc[ATOMS][BLOCK_N / 8][4];
        const u64 k_desc = wgmma_desc(smem_addr(k_tile), 16);
        wgmma_fence();
        wgmma_ss_e4m3<BLOCK_N, false>(sc[0], q_desc, k_desc);
#pragma unroll
        for (int kk = 1; kk < DIM_QK / 32; ++kk)
            wgmma_ss_e4m3<BLOCK_N, true>(sc[0], q_desc + desc_step<BLOCK_M>(0, 16 * kk), k_desc + desc_step<BLOCK_N>(0, 16 * kk));
        wgmma_commit();
        issue_pv();
        wgmma_wait<1>();  // S; the owed product runs on
        fence_registers<BLOCK_N>(sc[0]);
        bar_arrive(&bars->empty_k[t % 2]);

        float alpha[ATOMS][2];
        softmax<MASKED, true>(sc, n, alpha);
        wgmma_wait<0>();
        fence_registers<DIM_V>(acc[0]);
        bar_arrive(owed_empty);
        rescale(alpha);

        if constexpr (MASKED) {  // some pair of the tile reads no V
            bar_wait(&bars->full_v[t % 3], (t / 3) & 1);
            if (tile_nan_e4m3<DIM_V * BLOCK_N>(v_tile)) {
                const auto reads = [&](int r, int j) { return reads_v<MASKED>(wrow + r, n + j); };
                const auto poison = [this](int, int nt, int e) { poisoned |= 1ull << (nt * 4 + e); };
                poison_allowed<ATOMS, 64, DIM_V, KeysOfVt<0>>(reads, v_tile, poison);  // 64 keys at a time
                poison_allowed<ATOMS, 64, DIM_V, KeysOfVt<64>>([&](int r, int j) { return reads(r, 64 + j); }, v_tile, poison);
                compute_sync();
                clear_nan_e4m3<DIM_V * BLOCK_N>(v_tile);
                fence_proxy_async();
                compute_sync();  // every thread's clearing before either warpgroup's product
            }
        }

#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 32; ++kk) pack_e4m3_fragment<BLOCK_N>(pf[kk], sc[0], kk);
        v_owed = v_tile;
        owed_full = &bars->full_v[t % 3], owed_parity = (t / 3) & 1, owed_empty = &bars->empty_v[t % 3];
    }

    // The last tile's product and the poisoned outputs; then every computing thread is done with
    // Q and K, which O's staging overlies (not V).
    __device__ __forceinline__ void finish() {
        bar_wait(owed_full, owed_parity);
        wgmma_fence();
        issue_pv();
        wgmma_wait<0>();
        fence_registers<DIM_V>(acc[0]);
#pragma unroll
        for (int i = 0; i < DIM_V / 2; ++i)
            if (poisoned >> i & 1) acc[0][i / 4][i % 4] = QUIET_NAN;
        compute_sync();
    }
};

extern "C" __global__ void __launch_bounds__(THREADS + PRODUCER_THREADS, 1) flashx_forward_fp8_sm90(const Params p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    elem_t* sQ = (elem_t*)smem;                                        // Swizzle128<BLOCK_M>: BLOCK_M x 128 bytes
    elem_t* sK = (elem_t*)(smem + BLOCK_M * ROW_BYTES);               // 2 x Swizzle128<BLOCK_N>: BLOCK_N x 128 bytes
    elem_t* sV = sK + 2 * K_TILE;                                      // 3 x Swizzle128<DIM_V>: DIM_V x BLOCK_N bytes
    elem_t* sZero = sV + 3 * V_TILE;                                   // DIM_V x BLOCK_N zero bytes
    Barriers* bars = (Barriers*)(sZero + V_TILE);
    elem_t* sO = (elem_t*)smem;                                        // BLOCK_M x LD_V, over Q and K once the loop is done
    static_assert(BLOCK_M * LD_V * 2 <= (BLOCK_M + 2 * BLOCK_N) * ROW_BYTES, "O's staging must fit below V");

    int tile, h, b;
    grid_tile(p.tiles_m, p.heads_q, tile, h, b);
    const int hk = h / p.group;
    const Sequence s = sequence(p, b);
    const u8* k = (const u8*)p.k + row_offset(b, s.start_k, 0, hk, p.k_b, p.k_n, p.k_h);
    const u8* vt = (const u8*)p.v + (i64)b * p.v_b + (i64)hk * p.v_h;  // per sequence in every layout
    // The scores' factor and o's: Params with them folded into the scale (softcap's too) and
    // into drop_scale, o's factor in ForwardRows::store (1 otherwise: FP8 takes no dropout).
    Params descaled = p;
    const i64 at = (i64)b * p.heads_k + hk;
    if (p.k_descale) {
        const float factor = ((const float*)p.k_descale)[at];
        descaled.scale_log2 *= factor;
        descaled.softcap_scale *= factor;
    }
    if (p.v_descale) descaled.drop_scale *= ((const float*)p.v_descale)[at];
    ForwardRows rows{descaled, s, h, b, tile * BLOCK_M, 0};
    if (!rows.start()) return;

    if (threadIdx.x == 0) {
        for (int i = 0; i < 2; ++i) bar_init(&bars->full_k[i], PRODUCER_THREADS), bar_init(&bars->empty_k[i], THREADS);
        for (int i = 0; i < 3; ++i) bar_init(&bars->full_v[i], PRODUCER_THREADS), bar_init(&bars->empty_v[i], THREADS);
        bar_init(&bars->full_q, PRODUCER_THREADS);
        bar_init(&bars->sink, THREADS);
    }
    for (int i = threadIdx.x; i < DIM_V * BLOCK_N / 16; i += THREADS + PRODUCER_THREADS) ((uint4*)sZero)[i] = make_uint4(0, 0, 0, 0);
    fence_proxy_async();
    __syncthreads();

    if (threadIdx.x >= THREADS) {  // the producer, with few registers, so that the others may take more
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        ProducerFp8 producer{{descaled, s, h, b, tile * BLOCK_M, 0}, k, vt, sK, sV, bars, (int)threadIdx.x - THREADS};
        producer.start();
        const u8* q = (const u8*)p.q + row_offset(b, s.start_q, 0, h, p.q_b, p.q_n, p.q_h);
        load_tile<BLOCK_M, QK_PAIRS, Swizzle128<BLOCK_M>, PRODUCER_THREADS>(
            sQ, (const elem_t*)q, p.q_n / 2, 1, producer.m0, s.len_q, p.head_dim / 2, producer.tid);
        cp_async_commit();
        attend_key_tiles(producer);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int warp = threadIdx.x / 32;
    ForwardCtaFp8 cta{{descaled, s, h, b, tile * BLOCK_M, warp * 16}, sK, sV, bars,
                      wgmma_desc(smem_addr(sQ), 16) + desc_step<BLOCK_M>(warp / 4 * 64, 0)};
    cta.start();
    cta.start_owed(sZero);
    bar_wait(&bars->full_q, 0);
    attend_key_tiles(cta);
    cta.store(sO);
}
