// flashx_dq_sm90: dQ on Hopper's warpgroup products (wgmma, sm_90a), for 16-bit problems, beside
// flashx_dkdv_sm90 (backward.cuh says how the kernels divide the work). The semantics are dq.cuh's,
// shared with flashx_dq: only the products and the layout of the tiles differ. flashx_delta stays
// in dq.cu's module.
//
// The forward's shape: a CTA holds 128 query rows, two computing warpgroups of 64, with Q and dO
// resident, and streams key tiles of BLOCK_N: 64, or 32 at d256, where Q and dO take 128 KiB and a
// ring of two stages fits beside them (variants.Variant.ring_stages). A producer warpgroup, as in
// flashx_dkdv_sm90, runs the schedule and copies Q and dO, then each key tile's K and V by
// cp.async into a ring of RING_STAGES buffers on mbarriers (ring.cuh): no barrier of the whole
// CTA stands in the loop.
// Every tile lies in wgmma's 128-byte swizzle, so that one copy of a K tile serves both products
// that read it:
//   S   = Q K^T    A = Q, B = K, both K-major (the head dim is the product's K): wgmma_ss;
//   dP  = dO V^T   A = dO, B = V, both K-major: wgmma_ss;
//   dQ += dS K     A = dS from registers, B = K MN-major (its rows, the keys, are the product's
//                  K): wgmma_rs.
// wgmma's m64nN accumulator gives warp w of a warpgroup rows 16w .. 16w + 15 in mma.sync's m16n8
// layout, which dq.cuh's pair rule, dropout and exact path are written for (one 16-row atom a
// warp), and dS turns into the register A operand as the forward turns P. Where dS needs nothing
// but P and dP (no dropout or softcap), dP is waited for only once P is computed.

#define PRODUCER_THREADS 128  // one warpgroup that only copies (variants.PRODUCER_WARPS)
#include "dq.cuh"
#include "wgmma.cuh"
#include "ring.cuh"

static_assert(TENSOR_CORES && ATOMS == 1 && WARPS == 8, "two warpgroups, one 16-row atom a warp");
static_assert(BLOCK_M == 128 && (BLOCK_N == 64 || BLOCK_N == 32), "64 rows a warpgroup; 32 or 64 keys a tile (poison_allowed's bits)");
static_assert(DIM_QK % 64 == 0 && DIM_V % 64 == 0, "the products' N: 64, 128 or 256");

// The producer warpgroup (threads THREADS .. THREADS + PRODUCER_THREADS - 1): the schedule of key
// tiles, Q and dO with the first, each tile's K and V into the ring.
struct QueryProducerSm90 : QueryRows<SwizzledTiles> {
    Ring<>* ring;
    int tid;  // 0 .. PRODUCER_THREADS - 1

    __device__ __forceinline__ void run() {
        load_rows<PRODUCER_THREADS>(tid);  // in the first tile's group
        int cover;
        const int first = covered_tile<PRODUCER_THREADS>(lo, cover, tid);
        ring->produce(first, cover, end, tid,
                      [this](int n, int slot) {
                          if (n < end) load_kv<PRODUCER_THREADS>(n, slot, tid);
                          cp_async_commit();
                      },
                      [this](int n, int& cover) { return covered_tile<PRODUCER_THREADS>(n + BLOCK_N, cover, tid); });
    }
};

// QueryRows with the products on wgmma; q_desc and do_desc: this warpgroup's 64 rows of Q and dO.
struct QueryCtaSm90 : QueryRows<SwizzledTiles> {
    u64 q_desc, do_desc;
    Ring<>* ring;

    __device__ __forceinline__ void run() {
        ring->consume(end, [this](int n, int cover, int slot) { accumulate(n, cover, slot); });
    }

    // The key tile at n, from buffers buf; cover: the block mask's of it.
    __device__ __forceinline__ void accumulate(int n, int cover, int buf) {
        constexpr bool SPLIT = !DROPOUT && !SOFTCAP;  // dS from P and dP alone, after P
        elem_t* k = k_tile(buf);
        const u32 k_addr = smem_addr(k);
        const bool masked = !tile_unmasked(p, s, m0, m0 + BLOCK_M, n, n + BLOCK_N, cover);

        // K-major operands in this swizzle ignore the leading byte offset (16 by convention); a
        // step of 16 along the head dim is an offset within the 128-byte rows, or the next panel.
        float sc[1][BLOCK_N / 8][4];  // S, then P, then dS
        float dp[1][BLOCK_N / 8][4];
        const u64 k_k = wgmma_desc(k_addr, 16), v_k = wgmma_desc(smem_addr(v_tile(buf)), 16);
        wgmma_fence();
        wgmma_ss_whole_k<BLOCK_N, DIM_QK, BLOCK_M, BLOCK_N>(sc[0], q_desc, k_k);
        wgmma_commit();
        wgmma_ss_whole_k<BLOCK_N, DIM_V, BLOCK_M, BLOCK_N>(dp[0], do_desc, v_k);
        wgmma_commit();
        if constexpr (SPLIT) {
            wgmma_wait<1>();  // S; dP runs on
            fence_registers<BLOCK_N>(sc[0]);
            grads<true, false>(masked, n, sc, dp);
        }
        wgmma_wait<0>();
        if constexpr (!SPLIT) fence_registers<BLOCK_N>(sc[0]);
        fence_registers<BLOCK_N>(dp[0]);

        grads<!SPLIT, true>(masked, n, sc, dp);
        if (masked) exact_k(k);

        // K as the MN-major B operand: its rows (keys) are the product's K, 16 rows a step of
        // 16 * 128 bytes; the leading byte offset is the distance of the 64-column panels of the
        // head dim, BLOCK_N rows of 128 bytes.
        u32 dsf[BLOCK_N / 16][4];
        to_fragments<BLOCK_N>(sc[0], dsf);
        const u64 k_mn = wgmma_desc(k_addr, BLOCK_N * 128);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) wgmma_rs<DIM_QK>(dq[0], dsf[kk], k_mn + desc_step<BLOCK_N>(16 * kk, 0));
        wgmma_commit();
        wgmma_wait<0>();  // the fragments die with the tile, and the buffers are free
        fence_registers<DIM_QK>(dq[0]);
    }
};

extern "C" __global__ void __launch_bounds__(THREADS + PRODUCER_THREADS, 1) flashx_dq_sm90(const BackwardParams p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    elem_t* sQ = (elem_t*)smem;                                                   // Swizzle128<BLOCK_M>: BLOCK_M x DIM_QK
    elem_t* sDO = sQ + BLOCK_M * DIM_QK;                                          // Swizzle128<BLOCK_M>: BLOCK_M x DIM_V
    elem_t* sK = sDO + BLOCK_M * DIM_V;                                           // RING_STAGES x Swizzle128<BLOCK_N>: BLOCK_N x DIM_QK
    elem_t* sV = sK + RING_STAGES * BLOCK_N * DIM_QK;                             // RING_STAGES x Swizzle128<BLOCK_N>: BLOCK_N x DIM_V
    unsigned char* sAllowed = (unsigned char*)(sV + RING_STAGES * BLOCK_N * DIM_V);  // BLOCK_M x BLOCK_N
    Ring<>* ring = (Ring<>*)(sAllowed + BLOCK_M * BLOCK_N);

    int tile, h, b;
    grid_tile<false>(p, p.heads_q, tile, h, b);
    const int warp = threadIdx.x / 32;
    QueryRows<SwizzledTiles> rows{p, sequence(p, b), b, h, tile * BLOCK_M, warp % WARPS * 16, sQ, sDO, sK, sV, sAllowed};
    if (!rows.schedule()) return;

    if (threadIdx.x == 0) ring->init();
    __syncthreads();

    if (threadIdx.x >= THREADS) {  // the producer, with few registers, so that the others may take more
        producer_registers();
        QueryProducerSm90 producer{rows, ring, (int)threadIdx.x - THREADS};
        producer.run();
        return;
    }
    compute_registers();
    const u64 first = desc_step<BLOCK_M>(warp / 4 * 64, 0);  // the warpgroup's first row
    QueryCtaSm90 cta{rows, wgmma_desc(smem_addr(sQ), 16) + first, wgmma_desc(smem_addr(sDO), 16) + first, ring};
    cta.start_sums();
    cta.run();
    cta.store();
}
