// The forward on mma.sync (FlashAttention-2), for every dtype and feature; forward.cuh has the
// CTA's schedule, softmax and epilogue. Q stays in shared memory; K and V tiles stream through
// two shared buffers each. Every tile's K and V are requested (cp.async) one tile ahead, as
// separate groups, so that QK^T waits only for K and PV only for V.

#include "forward.cuh"

// A CTA's rows with its K/V stream and products.
struct ForwardCta : ForwardRows {
    const elem_t *k, *v;
    elem_t *sQ, *sK, *sV;
    float* sStage;
    int buf;  // the K/V buffers of the tile being read; the other pair is loading

    // Requests the tile at n (none at end) into the other buffers: two groups, K then V.
    __device__ __forceinline__ void load_kv(int n) {
        if (n < end) load_tile<BLOCK_N, DIM_QK, Padded<LD_QK>>(sK + (buf ^ 1) * BLOCK_N * LD_QK, k, p.k_n, p.k_d, n, s.len_k, p.head_dim);
        cp_async_commit();
        if (n < end) load_tile<BLOCK_N, DIM_V, Padded<LD_V>>(sV + (buf ^ 1) * BLOCK_N * LD_V, v, p.v_n, p.v_d, n, s.len_k, p.head_dim_v);
        cp_async_commit();
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

        float alpha[ATOMS][2];
        softmax<MASKED>(sc, n, alpha);

        cp_async_wait<2>();  // V of this tile (the next tile's K and V may still be in flight)
        __syncthreads();
        if constexpr (EXACT) {
            if (tile_nonfinite<BLOCK_N, DIM_V, LD_V>(v_tile)) {
                poison_allowed<ATOMS, BLOCK_N, DIM_V, Padded<LD_V>>([&](int r, int j) { return reads_v<MASKED>(wrow + r, n + j); }, v_tile, nan_at<ATOMS, DIM_V>(acc));
                __syncthreads();
                clear_nonfinite<BLOCK_N, DIM_V, LD_V>(v_tile);
                __syncthreads();
            }
        }
        gemm_areg<ATOMS, BLOCK_N, DIM_V, LD_V>(acc, sc, v_tile, sStage + wrow * BLOCK_N);
        buf ^= 1;
    }

    __device__ __forceinline__ void finish() {
        cp_async_wait<0>();
        __syncthreads();  // the buffers may become O's staging
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
    grid_tile<false>(p, p.heads_q, tile, h, b);
    const int warp = threadIdx.x / 32;
    const int hk = h / p.group;
    const Sequence s = sequence(p, b);
    ForwardCta cta{{p, s, h, b, tile * BLOCK_M, warp * ATOMS * 16},
                   (const elem_t*)p.k + row_offset(b, s.start_k, 0, hk, p.k_b, p.k_n, p.k_h),
                   (const elem_t*)p.v + row_offset(b, s.start_k, 0, hk, p.v_b, p.v_n, p.v_h),
                   sQ, sK, sV, sStage};
    if (!cta.start()) return;

    const elem_t* q = (const elem_t*)p.q + row_offset(b, s.start_q, 0, h, p.q_b, p.q_n, p.q_h);
    load_tile<BLOCK_M, DIM_QK, Padded<LD_QK>>(sQ, q, p.q_n, p.q_d, cta.m0, s.len_q, p.head_dim);
    attend_key_tiles(cta);
    cta.store(sO);
}
