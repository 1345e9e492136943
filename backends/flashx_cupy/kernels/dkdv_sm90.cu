// flashx_dkdv_sm90: dK and dV on Hopper's warpgroup products (wgmma, sm_90a), for 16-bit
// problems, beside flashx_dq_sm90, or with DQ_ATOMIC adding dQ itself (backward.cuh says how the
// kernels divide the work). The semantics are dkdv.cuh's, shared with flashx_dkdv: only the
// products, the layout of the tiles and who copies them differ.
//
// A CTA holds 128 keys, two computing warpgroups of 64, and streams query tiles of BLOCK_N rows. A
// producer warpgroup (PRODUCER_THREADS, as in forward_sm90.cu) runs the schedule and copies K and
// V, then each step's Q, dO, LSE and D by cp.async into a ring of RING_STAGES buffers on mbarriers
// (ring.cuh). No barrier of the whole CTA stands in the loop, so the two computing warpgroups
// drift apart and one's pointwise work overlaps the other's products. The accumulators stay in
// registers: dK and dV (64 x DIM per warpgroup, DIM / 2 floats a thread each) beside the step's
// S^T and dP^T (64 x BLOCK_N, BLOCK_N / 2 floats each), which is why a query tile is at most 64
// rows, and why the producer gives up its registers to the computing threads (ring.cuh). At d256
// a launch holds one of dK and dV (DKDV_PARTS: 128 floats a thread), and a query tile is 32 rows,
// so that a ring of three fits beside the resident K and V (128 KiB).
//
// Every tile lies in wgmma's 128-byte swizzle (Swizzle128), so that one copy of a Q tile serves
// both products that read it, and likewise dO:
//   S^T  = K Q^T    A = K, B = Q, both K-major (the head dim is the product's K): wgmma_ss;
//   dP^T = V dO^T   A = V, B = dO, both K-major: wgmma_ss;
//   dV  += P^T dO   A = P^T from registers, B = dO MN-major (its rows, the queries, are the
//                   product's K): wgmma_rs;
//   dK  += dS^T Q   A = dS^T from registers, B = Q MN-major: wgmma_rs.
// wgmma's m64nN accumulator gives warp w of a warpgroup rows 16w .. 16w + 15 in mma.sync's m16n8
// layout, which is the layout dkdv.cuh's pair rule, dropout and exact path are written for (one
// 16-key atom a warp, ATOMS = 1), and its register A operand takes mma.sync A fragments: P^T and
// dS^T turn into them in registers, as the forward turns P.
//
// Within a step the products run ahead of the pointwise work: where dS^T needs nothing but P^T and
// dP^T (no dropout or softcap), dP^T is issued with S^T and waited for only once P^T is computed,
// and in unmasked tiles, where no operand is cleared first, dV's product is issued before dP^T is
// waited for and runs beside dS^T. A step ends waiting for its last products, since their register
// operands die with it.
//
// With DQ_ATOMIC each warpgroup stages its rows of dS^T, rounded to 16 bits, in a Swizzle128 tile
// of the CTA's 128 keys x the step's 64 queries (two tiles, steps alternating), and after a
// barrier of the computing threads, the step's one, the products read it from there:
//   dK  += dS^T Q   A = this warpgroup's rows of dS^T, K-major; B = Q MN-major: wgmma_ss;
//   dQ_step = dS K  A = dS, MN-major from dS^T (the keys are the product's K, the queries its M);
//                   B = K MN-major: wgmma_ss. Each warpgroup takes 64 columns (DQ_KEYS).
// dK from shared memory spares the registers of dS^T's fragments, which the dQ accumulator (32
// floats) takes. Once its products are done, each warpgroup stages its step's share of dQ, float32,
// in a tile of its own laid out as p.dq's sums are (launch._dkdv_adding_dq), and one of its threads
// adds the tile to them by TMA's bulk reductions (bulk_reduce.cuh), a few instructions where
// per-thread reductions took 32 floats a thread; dkdv.cuh keeps the exact sums of a masked step
// over a non-finite K.

#define PRODUCER_THREADS 128  // one warpgroup that only copies (variants.PRODUCER_WARPS)
#include "dkdv.cuh"
#include "wgmma.cuh"
#include "ring.cuh"
#include "bulk_reduce.cuh"

static_assert(TENSOR_CORES && ATOMS == 1 && WARPS == 8, "two warpgroups, one 16-key atom a warp");
static_assert(BLOCK_M == 128 && (BLOCK_N == 64 || BLOCK_N == 32), "64 keys a warpgroup; 32 or 64 queries a step (poison_allowed's bits)");
static_assert(DIM_QK % 64 == 0 && DIM_V % 64 == 0, "the products' N: 64, 128 or 256");
static_assert((DKDV_PARTS == 3) == (DIM_QK <= 128 && DIM_V <= 128), "both sums in one launch up to d128, one of them at d256");

// The producer warpgroup (threads THREADS .. THREADS + PRODUCER_THREADS - 1): the schedule of
// steps, K and V with the first, each step's rows into the ring (ring.cuh).
struct KeyProducerSm90 : KeyRows<SwizzledTiles> {
    Ring<>* ring;
    int tid;  // 0 .. PRODUCER_THREADS - 1

    __device__ __forceinline__ void run() {
        load_keys<PRODUCER_THREADS>(tid);  // in the first step's group
        int cover;
        const int first = covered_step<PRODUCER_THREADS>(0, cover, tid);
        ring->produce(first, cover, steps(), tid,
                      [this](int step, int slot) { load_rows<PRODUCER_THREADS>(step, slot, tid); },
                      [this](int step, int& cover) { return covered_step<PRODUCER_THREADS>(step + 1, cover, tid); });
    }
};

// KeyRows with the products on wgmma; k_desc and v_desc: this warpgroup's 64 keys of K and V.
struct KeyCtaSm90 : KeyRows<SwizzledTiles> {
    u64 k_desc, v_desc;
    Ring<>* ring;
#if DQ_ATOMIC
    // The fused dQ (start_dq): a step's dS^T in one of two buffers, steps alternating; this
    // warpgroup's staging tile of its share (stage_dq); the descriptor of K as B of the share's
    // product, and its first column.
    elem_t* sDS;
    float* sDQ;
    int ds_buf;
    u64 k_dq_desc;
    int dq_col0;
    bool k_nonfinite;              // K holds a NaN or an infinity: masked steps take the exact dQ
    float dq_share[1][64 / 8][4];  // the step's product of this warpgroup's share

    // A warpgroup's share of dQ's product: 64 columns of DQ_KEYS keys, all 128 at d128; at d64 each
    // warpgroup takes its own 64 keys, so that no MN-major operand starts within a swizzled row.
    static constexpr int DQ_KEYS = BLOCK_M * DIM_QK / 128;
#endif

    // Issues D += A B for A (64 x N, this warp's 16 rows) in fragments and B MN-major at ``b``: the
    // rows of Q and dO (queries) are the product's K, 16 rows a step of 16 * 128 bytes; the
    // leading byte offset is the distance of the 64-column panels of the head dim, BLOCK_N rows
    // of 128 bytes.
    template <int N>
    __device__ __forceinline__ void issue_rs(float (&d)[N / 8][4], const u32 (&a)[BLOCK_N / 16][4], u32 b) {
        const u64 b_mn = wgmma_desc(b, BLOCK_N * 128);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) wgmma_rs<N>(d, a[kk], b_mn + desc_step<BLOCK_N>(16 * kk, 0));
    }

    // The producer's steps, each with its body (accumulate_steps' choice).
    __device__ __forceinline__ void run() {
        ring->consume(steps(), [this](int step, int cover, int slot) {
            buf = slot;
            const int m = row_of(step);
            const bool unmasked = tile_unmasked(p, s, m, m + BLOCK_N, n0, n0 + BLOCK_M, cover);
            if (unmasked)
                accumulate<false>(step);
            else
                accumulate<true>(step);
#if DQ_ATOMIC
            add_dq(!unmasked, head_of(step), m);  // once, after either body: a copy in each made ptxas serialize the products
#endif
        });
#if DQ_ATOMIC
        if (dq_issuer()) bulk_wait_read<0>();  // the last tile is read before the CTA's shared memory goes
#endif
    }

    // Step ``step``, whose rows lie in buffers ``buf``.
    template <bool MASKED>
    __device__ __forceinline__ void accumulate(int step) {
        constexpr bool DK = DKDV_PARTS & 1, DV = DKDV_PARTS & 2;
        constexpr bool EXACT = MASKED || DROPOUT;  // some pair of the tile reads no dO (and, if masked, no Q)
        constexpr bool SPLIT = DK && !DROPOUT && !SOFTCAP;  // dS^T from P^T and dP^T alone, after P^T
        constexpr bool EARLY_DV = DV && SPLIT && !EXACT;    // ... and no operand to clear before dV's product
        const int h = head_of(step), m = row_of(step);
        const u32 q_addr = smem_addr(q_tile()), do_addr = smem_addr(do_tile());

        // K-major operands in this swizzle ignore the leading byte offset (16 by convention); a
        // step of 16 along the head dim is an offset within the 128-byte rows, or the next panel.
        float pt[1][BLOCK_N / 8][4];   // S^T, then P^T, then P^T Z / (1 - p)
        float dst[1][BLOCK_N / 8][4];  // dP^T, then dS^T (DK)
        const u64 q_k = wgmma_desc(q_addr, 16), do_k = wgmma_desc(do_addr, 16);
        wgmma_fence();
        wgmma_ss_whole_k<BLOCK_N, DIM_QK, BLOCK_M, BLOCK_N>(pt[0], k_desc, q_k);
        wgmma_commit();
        if constexpr (DK) {
            wgmma_ss_whole_k<BLOCK_N, DIM_V, BLOCK_M, BLOCK_N>(dst[0], v_desc, do_k);
            wgmma_commit();
        }

        u32 pf[BLOCK_N / 16][4];
        if constexpr (SPLIT) {
            wgmma_wait<1>();  // S^T; dP^T runs on
            fence_registers<BLOCK_N>(pt[0]);
            probs_and_grads<MASKED, true, false>(h, m, pt, dst);
            if constexpr (EARLY_DV) {
                to_fragments<BLOCK_N>(pt[0], pf);
                wgmma_fence();
                issue_rs<DIM_V>(dv[0], pf, do_addr);
                wgmma_commit();
            }
        }
        wgmma_wait<EARLY_DV ? 1 : 0>();  // dP^T (and S^T); dV's product runs on
        if constexpr (!SPLIT) fence_registers<BLOCK_N>(pt[0]);
        if constexpr (DK) fence_registers<BLOCK_N>(dst[0]);
        probs_and_grads<MASKED, !SPLIT, true>(h, m, pt, dst);
        if constexpr (EXACT) exact_operands<MASKED>(h, m);
        if constexpr (DV && !EARLY_DV) {
            to_fragments<BLOCK_N>(pt[0], pf);
            wgmma_fence();
            issue_rs<DIM_V>(dv[0], pf, do_addr);
        }
#if DQ_ATOMIC
        store_ds(ds_tile(), dst);
        issue_dk_dq(q_addr);
#else
        if constexpr (DK) {
            u32 dsf[BLOCK_N / 16][4];
            to_fragments<BLOCK_N>(dst[0], dsf);
            wgmma_fence();
            issue_rs<DIM_QK>(dk[0], dsf, q_addr);
        }
#endif
        wgmma_commit();
        wgmma_wait<0>();  // the fragments die with the step, and the buffers are free
        if constexpr (DV) fence_registers<DIM_V>(dv[0]);
        if constexpr (DK) fence_registers<DIM_QK>(dk[0]);
#if DQ_ATOMIC
        fence_registers<64>(dq_share[0]);
#endif
    }

#if DQ_ATOMIC
    __device__ __forceinline__ elem_t* ds_tile() const { return sDS + ds_buf * BLOCK_M * BLOCK_N; }
    __device__ __forceinline__ int dq_key0() const { return threadIdx.x / 128 * 64 / DIM_QK * DQ_KEYS; }

    // The thread of this warpgroup that issues its bulk reductions, and so waits for them.
    __device__ __forceinline__ bool dq_issuer() const { return threadIdx.x % 128 == 0; }

    // The fused dQ's state, and whether K is finite (the first step's buffers land with K).
    __device__ __forceinline__ void start_dq(elem_t* ds, float* staging) {
        sDS = ds;
        sDQ = staging + threadIdx.x / 128 * BLOCK_N * 64;
        ds_buf = 0;
        dq_col0 = threadIdx.x / 128 * 64 % DIM_QK;
        k_dq_desc = wgmma_desc(smem_addr(sK), BLOCK_M * 128) + desc_step<BLOCK_M>(dq_key0(), dq_col0);
        ring->first_landed();
        k_nonfinite = tile_nonfinite<BLOCK_M, DIM_QK, SwizzledTiles::QK_PITCH>(sK);
    }

    // dK += dS^T Q and this warpgroup's share of dQ = dS K, from the step's dS^T in ds_tile() once
    // both warpgroups have staged their rows there, issued into the open commit group. The other
    // buffer is free: each warpgroup waited for its products of the step before last before it
    // reached this barrier. The barrier also frees each warpgroup's dQ staging tile: its issuer
    // waits first for the previous step's reductions to read it.
    //   dK: A = this warpgroup's 64 rows of dS^T, K-major (the queries are the product's K);
    //       B = Q MN-major, as issue_rs reads it.
    //   dQ: A = dS, MN-major from dS^T, and B = K, MN-major: their rows, the keys, are the
    //       product's K, 16 rows a step of 16 * 128 bytes; the leading byte offset is the distance
    //       of their 64-column panels, BLOCK_M rows of 128 bytes.
    __device__ __forceinline__ void issue_dk_dq(u32 q_addr) {
        fence_proxy_async();  // this thread's rows of dS^T, for the products of both warpgroups
        warpgroup_sync();     // this warpgroup's rows, dK's operand: its product runs while the other catches up
        const u32 ds = smem_addr(ds_tile());
        const u64 ds_k = wgmma_desc(ds, 16) + desc_step<BLOCK_M>(threadIdx.x / 128 * 64, 0);
        const u64 ds_mn = wgmma_desc(ds, BLOCK_M * 128) + desc_step<BLOCK_M>(dq_key0(), 0);
        wgmma_fence();
        wgmma_ss_whole_k<DIM_QK, BLOCK_N, BLOCK_M, BLOCK_N, false, true, true>(dk[0], ds_k, wgmma_desc(q_addr, BLOCK_N * 128));
        if (dq_issuer()) bulk_wait_read<0>();
        compute_sync();       // both warpgroups' rows, dQ's operand
        wgmma_ss_whole_k<64, DQ_KEYS, BLOCK_M, BLOCK_M, true, true>(dq_share[0], ds_mn, k_dq_desc);
    }

    // The barrier of this warpgroup's 128 threads (exact.cuh takes 1 and 2), named by a register:
    // with a constant in each of two branches ptxas spilled at d128.
    static __device__ __forceinline__ void warpgroup_sync() {
        asm volatile("bar.sync %0, 128;" ::"r"(3 + threadIdx.x / 128) : "memory");
    }

    // The step's dQ share (queries from row m of head h) added to the sums, once its product is
    // done; a masked step over a non-finite K takes the exact sums instead, over both shares.
    __device__ __forceinline__ void add_dq(bool masked, int h, int m) {
        if (masked && k_nonfinite)
            exact_dq(ds_tile(), h, m);
        else
            stage_dq(h, m);
        ds_buf ^= 1;
    }

    // The share, scaled, into this warpgroup's staging tile, then added to the sums by its issuer:
    // a bulk reduction a panel of DQ_PANEL columns, of the rows within the sequence. The tile holds
    // the share's panels one after another, each BLOCK_N rows of DQ_PANEL floats as in the sums, so
    // that a warp's stores of one atom fill 256 contiguous bytes, free of bank conflicts.
    __device__ __forceinline__ void stage_dq(int h, int m) {
        static_assert(DQ_PANEL == 8, "an atom's columns, one panel");
        const int qrow = threadIdx.x % 128 / 32 * 16;
#pragma unroll
        for (int nt = 0; nt < 64 / 8; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                *(float2*)(sDQ + (nt * BLOCK_N + qrow + frag_row(0, 2 * half)) * DQ_PANEL + frag_col(0, 0)) =
                    make_float2(dq_share[0][nt][2 * half] * p.scale, dq_share[0][nt][2 * half + 1] * p.scale);
        fence_proxy_async();
        warpgroup_sync();
        if (dq_issuer()) {
            const u32 bytes = min(BLOCK_N, s.len_q - m) * DQ_PANEL * sizeof(float);
#pragma unroll
            for (int nt = 0; nt < 64 / 8; ++nt)
                bulk_reduce_add(dq_panel(h, m, dq_col0 / DQ_PANEL + nt), smem_addr(sDQ + nt * BLOCK_N * DQ_PANEL), bytes);
            bulk_commit();
        }
    }
#endif
};

extern "C" __global__ void __launch_bounds__(THREADS + PRODUCER_THREADS, 1) flashx_dkdv_sm90(const BackwardParams p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    elem_t* sK = (elem_t*)smem;                                  // Swizzle128<BLOCK_M>: BLOCK_M x DIM_QK
    elem_t* sV = sK + BLOCK_M * DIM_QK;                          // Swizzle128<BLOCK_M>: BLOCK_M x DIM_V
    elem_t* sQ = sV + BLOCK_M * DIM_V;                           // RING_STAGES x Swizzle128<BLOCK_N>: BLOCK_N x DIM_QK
    elem_t* sDO = sQ + RING_STAGES * BLOCK_N * DIM_QK;            // RING_STAGES x Swizzle128<BLOCK_N>: BLOCK_N x DIM_V
    elem_t* sDS = sDO + RING_STAGES * BLOCK_N * DIM_V;            // DQ_ATOMIC: 2 x Swizzle128<BLOCK_M>: BLOCK_M x BLOCK_N
    float* sDQ = (float*)(sDS + (DQ_ATOMIC ? 2 * BLOCK_M * BLOCK_N : 0));  // DQ_ATOMIC: 2 x 8 x BLOCK_N x DQ_PANEL (stage_dq)
    float* sLse = sDQ + (DQ_ATOMIC ? 2 * BLOCK_N * 64 : 0);       // RING_STAGES x BLOCK_N
    float* sDelta = sLse + RING_STAGES * BLOCK_N;                 // RING_STAGES x BLOCK_N
    Ring<>* ring = (Ring<>*)(sDelta + RING_STAGES * BLOCK_N);

    int tile, hk, b;
    grid_tile<true>(p, p.kv_heads, tile, hk, b);  // the first keys are read by the most queries
    hk += p.kv_head0;
    const int warp = threadIdx.x / 32;
    KeyRows<SwizzledTiles> rows{p, sequence(p, b), b, hk, tile * BLOCK_M, warp % WARPS * 16, sK, sV, sQ, sDO, sLse, sDelta};
    if (!rows.schedule()) return;

    if (threadIdx.x == 0) ring->init();
    __syncthreads();

    if (threadIdx.x >= THREADS) {  // the producer, with few registers, so that the others may take more
        producer_registers();
        KeyProducerSm90 producer{rows, ring, (int)threadIdx.x - THREADS};
        producer.run();
        return;
    }
    compute_registers();
    const u64 keys = desc_step<BLOCK_M>(warp / 4 * 64, 0);  // the warpgroup's first key
    KeyCtaSm90 cta{rows, wgmma_desc(smem_addr(sK), 16) + keys, wgmma_desc(smem_addr(sV), 16) + keys, ring};
    cta.zero_sums();
#if DQ_ATOMIC
    cta.start_dq(sDS, sDQ);
#endif
    cta.run();
    cta.store();
}
