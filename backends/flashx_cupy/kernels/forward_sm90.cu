// The wgmma forward (forward_sm90.cuh) for 16-bit q, k and v: its Operands. The tiles keep the
// rows of Q, K and V as they lie in global memory, in Swizzle128: S = Q K^T reads Q and K
// K-major, O += P V reads V "MN-major" (rows are keys, the product's K dimension). P's register
// operand is mma.sync's A fragment, which each lane holds in the scores' accumulator layout (as
// in forward.cu).

#define PRODUCER_THREADS 128  // one warpgroup that only copies Q, K and V (variants.PRODUCER_WARPS)
#include "forward.cuh"
#include "wgmma.cuh"

static_assert((BLOCK_N == 64 || BLOCK_N == 128 || BLOCK_N == 176 || BLOCK_N == 80) &&
                  (DIM_V == 64 || DIM_V == 128 || DIM_V == 256),
              "the products' N: S's 64, 128, 176 or 80 (wgmma_ss), O's 64, 128 or 256 (wgmma_rs)");

// What forward_sm90.cuh's CTA takes from the element type (its members are listed there).
struct Operands {
    typedef elem_t In;
    enum { Q_TILE = BLOCK_M * DIM_QK, K_TILE = BLOCK_N * DIM_QK, V_TILE = BLOCK_N * DIM_V, PRODUCT_K = 16 };
    // K's and V's tiles by TMA: their (head_dim, heads_k, seqlen_k, batch) maps' boxes of 64
    // columns and BLOCK_N rows are Swizzle128's panels (tma.cuh).
    enum { TMA_KV = TMA };
    // The buffers of V's ring (flashx_cupy.variants.FORWARD_SM90_TILES): three, or two where
    // three and a tile of zeros would not fit (176 keys at d128, every tile at d256).
    enum { V_RING = V_BUFFERS };

    template <int N, bool ACCUMULATE>
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], u64 a, u64 b) { wgmma_ss<N, ACCUMULATE>(d, a, b); }
    template <int N>
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) { wgmma_rs<N>(d, a, b); }

    // MN-major: the tile's 64-column panels lie BLOCK_N rows of 128 bytes apart; k-step kk is
    // V's rows 16 kk .. 16 kk + 15.
    static __device__ __forceinline__ u64 v_desc(const elem_t* v) { return wgmma_desc(smem_addr(v), BLOCK_N * 128); }
    static __device__ __forceinline__ u64 v_step(int kk) { return desc_step<BLOCK_N>(16 * kk, 0); }

    static __device__ __forceinline__ void pack(u32 (&a)[4], const float (&s)[BLOCK_N / 8][4], int kk) {
        to_fragment<BLOCK_N>(a, s, kk);
    }

    template <int ROWS>
    static __device__ __forceinline__ void load_rows(elem_t* dst, const elem_t* src, i64 row_stride, i64 col_stride,
                                                     int row0, int rows_valid, int width, int tid) {
        load_tile<ROWS, DIM_QK, Swizzle128<ROWS>, PRODUCER_THREADS>(dst, src, row_stride, col_stride, row0, rows_valid, width, tid);
    }

    static __device__ __forceinline__ const elem_t* v_at(const Params& p, int b, const Sequence& s, int hk) {
        return (const elem_t*)p.v + row_offset(b, s.start_k, 0, hk, p.v_b, p.v_n, p.v_h);
    }

    static __device__ __forceinline__ void load_v(elem_t* dst, const elem_t* v, i64 row_stride, i64 col_stride, int n,
                                                  int len_k, int width, int tid) {
        load_tile<BLOCK_N, DIM_V, Swizzle128<BLOCK_N>, PRODUCER_THREADS>(dst, v, row_stride, col_stride, n, len_k, width, tid);
    }

    // No descales: the rows read the kernel's Params.
    static __device__ __forceinline__ const Params& scaled(const Params& p, Params&, int, int) { return p; }

    // Which elements are not finite is a question of the whole tile, its layout aside.
    static __device__ __forceinline__ bool nonfinite(const elem_t* v) { return tile_nonfinite<BLOCK_N, DIM_V, DIM_V>(v); }

    // poison_allowed takes at most 64 keys at a time, from a row that is a multiple of 8 (the
    // swizzle's period): the largest power of two that divides BLOCK_N, up to 64 (16 of 176 or 80).
    enum { POISON_KEYS = (BLOCK_N & -BLOCK_N) < 64 ? (BLOCK_N & -BLOCK_N) : 64 };
    template <typename Poison>
    static __device__ __forceinline__ void poison(const ForwardRows& rows, const elem_t* v, int n, Poison mark) {
#pragma unroll 1
        for (int j0 = 0; j0 < BLOCK_N; j0 += POISON_KEYS)
            poison_allowed<ATOMS, POISON_KEYS, DIM_V, Swizzle128<BLOCK_N>>(
                [&](int r, int j) { return rows.reads_v<true>(rows.wrow + r, n + j0 + j); },
                v + Swizzle128<BLOCK_N>::offset(j0, 0) / (int)sizeof(elem_t), mark);
    }

    static __device__ __forceinline__ void clear(elem_t* v) { clear_nonfinite<BLOCK_N, DIM_V, DIM_V>(v); }
};

#define FORWARD_SM90 flashx_forward_sm90
#include "forward_sm90.cuh"
