// flashx_dkdv_sm90: dK and dV on Hopper's warpgroup products (wgmma, sm_90a), for 16-bit
// problems of head-dim classes 64 and 128, beside flashx_dq_sm90 (backward.cuh says how the
// kernels divide the work). The semantics are dkdv.cuh's, shared with flashx_dkdv: only the
// products and the layout of the tiles differ.
//
// A CTA holds 128 keys, two warpgroups of 64, and streams query tiles of 64 rows, two in flight
// as in flashx_dkdv (one cp.async group a step, requested when the previous step starts, one
// barrier a step). Its accumulators stay in registers: dK and dV (64 x DIM per warpgroup, DIM / 2
// floats a thread each) beside the step's S^T and dP^T (64 x 64, 32 floats each), which is why
// a query tile is 64 rows and a thread may take 255 registers (one CTA an SM).
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
// A step waits for each product group before it reads the results; the products of two steps
// never overlap, since the next step's copies land in the buffers that this step's last products
// read. A producer warpgroup (as in forward_sm90.cu) and products issued ahead of the pointwise
// work are the next steps.

#include "dkdv.cuh"
#include "wgmma.cuh"

static_assert(TENSOR_CORES && ATOMS == 1 && WARPS == 8, "two warpgroups, one 16-key atom a warp");
static_assert(BLOCK_M == 128 && BLOCK_N == 64, "64 keys a warpgroup; 64 queries a step (poison_allowed's bits)");
static_assert((DIM_QK == 64 || DIM_QK == 128) && (DIM_V == 64 || DIM_V == 128), "the products' N: 64 or 128");
static_assert(DKDV_PARTS == 3 && !DQ_ATOMIC, "both sums in one launch, dQ by flashx_dq");

// KeyRows with the products on wgmma; k_desc and v_desc: this warpgroup's 64 keys of K and V.
struct KeyCtaSm90 : KeyRows<SwizzledTiles> {
    u64 k_desc, v_desc;

    // Step ``step``, and the requests for step ``next``.
    template <bool MASKED>
    __device__ __forceinline__ void accumulate(int step, int next) {
        constexpr bool EXACT = MASKED || DROPOUT;  // some pair of the tile reads no dO (and, if masked, no Q)
        cp_async_wait<0>();   // Q and dO of this step
        fence_proxy_async();  // ... visible to the products
        __syncthreads();      // ... for every thread; and both warpgroups are done with the other buffers
        load_rows(next);
        const int h = head_of(step), m = row_of(step);
        const u32 q_addr = smem_addr(q_tile()), do_addr = smem_addr(do_tile());

        // K-major operands in this swizzle ignore the leading byte offset (16 by convention); a
        // step of 16 along the head dim is an offset within the 128-byte rows, or the next panel.
        float pt[1][BLOCK_N / 8][4];   // S^T, then P^T, then P^T Z / (1 - p)
        float dst[1][BLOCK_N / 8][4];  // dP^T, then dS^T
        const u64 q_k = wgmma_desc(q_addr, 16), do_k = wgmma_desc(do_addr, 16);
        wgmma_fence();
        wgmma_ss_whole_k<BLOCK_N, DIM_QK, BLOCK_M, BLOCK_N>(pt[0], k_desc, q_k);
        wgmma_ss_whole_k<BLOCK_N, DIM_V, BLOCK_M, BLOCK_N>(dst[0], v_desc, do_k);
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers<BLOCK_N>(pt[0]);
        fence_registers<BLOCK_N>(dst[0]);

        probs_and_grads<MASKED>(h, m, pt, dst);
        if constexpr (EXACT) exact_operands<MASKED>(h, m);

        // The MN-major B operands: rows of Q and dO (queries) are the product's K, 16 rows a step
        // of 16 * 128 bytes; the leading byte offset is the distance of the 64-column panels of
        // the head dim, BLOCK_N rows of 128 bytes.
        u32 pf[BLOCK_N / 16][4], dsf[BLOCK_N / 16][4];
        to_fragments<BLOCK_N>(pt[0], pf);
        to_fragments<BLOCK_N>(dst[0], dsf);
        const u64 do_mn = wgmma_desc(do_addr, BLOCK_N * 128), q_mn = wgmma_desc(q_addr, BLOCK_N * 128);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) wgmma_rs<DIM_V>(dv[0], pf[kk], do_mn + desc_step<BLOCK_N>(16 * kk, 0));
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) wgmma_rs<DIM_QK>(dk[0], dsf[kk], q_mn + desc_step<BLOCK_N>(16 * kk, 0));
        wgmma_commit();
        wgmma_wait<0>();  // before the next step's copies overwrite Q and dO
        fence_registers<DIM_V>(dv[0]);
        fence_registers<DIM_QK>(dk[0]);
        buf ^= 1;
    }
};

extern "C" __global__ void __launch_bounds__(THREADS, 1) flashx_dkdv_sm90(const Params p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    elem_t* sK = (elem_t*)smem;                         // Swizzle128<BLOCK_M>: BLOCK_M x DIM_QK
    elem_t* sV = sK + BLOCK_M * DIM_QK;                 // Swizzle128<BLOCK_M>: BLOCK_M x DIM_V
    elem_t* sQ = sV + BLOCK_M * DIM_V;                  // 2 x Swizzle128<BLOCK_N>: BLOCK_N x DIM_QK
    elem_t* sDO = sQ + 2 * BLOCK_N * DIM_QK;            // 2 x Swizzle128<BLOCK_N>: BLOCK_N x DIM_V
    float* sLse = (float*)(sDO + 2 * BLOCK_N * DIM_V);  // 2 x BLOCK_N
    float* sDelta = sLse + 2 * BLOCK_N;                 // 2 x BLOCK_N

    int tile, hk, b;
    grid_tile(p.tiles_m, p.kv_heads, tile, hk, b);
    hk += p.kv_head0;
    const int warp = threadIdx.x / 32;
    const u64 keys = desc_step<BLOCK_M>(warp / 4 * 64, 0);  // the warpgroup's first key
    KeyCtaSm90 cta{{p, sequence(p, b), b, hk, tile * BLOCK_M, warp * 16, sK, sV, sQ, sDO, sLse, sDelta},
                   wgmma_desc(smem_addr(sK), 16) + keys, wgmma_desc(smem_addr(sV), 16) + keys};
    int step;
    if (!cta.start(step)) return;
    accumulate_steps(cta, step);
    cp_async_wait<0>();
    cta.store();
}
