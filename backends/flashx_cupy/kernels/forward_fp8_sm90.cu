// The wgmma forward (forward_sm90.cuh) for float8_e4m3fn q, k and v: the contract's FP8 section,
// as the Operands of its CTA. o is DTYPE (0 float16, 1 bfloat16: the call's out_dtype), lse float32.
//
// - S = Q K^T from the e4m3 tiles, products exact and summed in float32 by the tensor cores.
//   q_descale * k_descale (multiplied on the host, passed as ``p.k_descale``, null for 1) joins
//   the scores' scale, and v_descale (``p.v_descale``) o's factor, in the CTA's copy of Params
//   (``scaled``), so that the softmax and the epilogue read them where they read the scale.
// - P is rounded to e4m3 (to nearest, ties to even) against the running max, the row sum taken
//   before the rounding, and multiplied with V in e4m3: the weights of plain attention in FP8.
// - An e4m3 product takes both shared-memory operands K-major, so V's tile is V^T (features x
//   keys). The host lays V out so (flashx_cupy.launch.keys_in_fp8_order): per sequence and head,
//   features x keys, the keys of each 16 in the order that P's register operand wants
//   (wgmma_e4m3.cuh), zero past the keys. The producer then copies V^T by cp.async as it copies K.
//
// Tiles are handled as 16-bit pairs of bytes (wgmma_e4m3.cuh): Q and K rows are one 128-byte
// swizzled row each (a head dim of 64 uses half of it), V^T rows whole 128-byte panels of keys
// (VT_KEYS), of which P V reads the tile's BLOCK_N.

#define PRODUCER_THREADS 128  // one warpgroup that only copies Q, K and V (variants.PRODUCER_WARPS)
#define WEIGHTS_E4M3 1         // the exact running max (forward.cuh's LAZY_MAX)
#include "forward.cuh"
#include "wgmma.cuh"
#include "wgmma_e4m3.cuh"

static_assert((BLOCK_N == 128 || BLOCK_N == 192) && (DIM_QK == 64 || DIM_QK == 128) && (DIM_V == 64 || DIM_V == 128),
              "S's N 128 or 192 (a multiple of the k-step's 32 keys), O's 64 or 128");

// A V^T row's keys in whole swizzled panels of 128: a copy of 16-byte chunks needs the panel's
// eight, and keys past BLOCK_N are copied as zeros, never read.
enum { VT_KEYS = (BLOCK_N + 127) / 128 * 128 };

typedef unsigned char u8;

// Key j of up to 64 keys from key J0 of a V^T tile (Swizzle128<DIM_V> in pairs), feature c, for
// poison_allowed, which reads whether it is finite: the 16-bit value NaN where the byte is NaN.
template <int J0>
struct KeysOfVt {
    static __device__ __forceinline__ elem_t at(const elem_t* s, int j, int c) {
        const int col = e4m3_key_column(J0 + j);
        const u8 x = *((const u8*)s + Swizzle128<DIM_V>::offset(c, col / 2) + col % 2);
        return e4m3_nan_bytes(x) ? (elem_t)0xffffu : (elem_t)0;
    }
};

// What forward_sm90.cuh's CTA takes from the element type (its members are listed there).
struct Operands {
    typedef u8 In;
    // In pairs of bytes: Q's and K's rows 128 bytes whatever DIM_QK, V^T's VT_KEYS keys.
    enum { Q_TILE = BLOCK_M * 128 / 2, K_TILE = BLOCK_N * 128 / 2, V_TILE = DIM_V * VT_KEYS / 2, PRODUCT_K = 32 };
    enum { TMA_KV = 0 };  // K and V^T by cp.async (no tensor maps for the FP8 layouts)
    enum { V_RING = 3 };  // V^T's buffers

    template <int N, bool ACCUMULATE>
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], u64 a, u64 b) { wgmma_ss_e4m3<N, ACCUMULATE>(d, a, b); }
    template <int N>
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) { wgmma_rs_e4m3<N>(d, a, b); }

    // K-major V^T: k-step kk is its columns (keys) 32 kk .. 32 kk + 31, 16 pairs, in panel kk / 4.
    static __device__ __forceinline__ u64 v_desc(const elem_t* vt) { return wgmma_desc(smem_addr(vt), 16); }
    static __device__ __forceinline__ u64 v_step(int kk) { return desc_step<DIM_V>(0, 16 * kk); }

    static __device__ __forceinline__ void pack(u32 (&a)[4], const float (&s)[BLOCK_N / 8][4], int kk) {
        pack_e4m3_fragment<BLOCK_N>(a, s, kk);
    }

    // Rows of bytes with contiguous features (the host copies q and k where they are not).
    template <int ROWS>
    static __device__ __forceinline__ void load_rows(elem_t* dst, const u8* src, i64 row_stride, i64, int row0,
                                                     int rows_valid, int width, int tid) {
        load_tile<ROWS, DIM_QK / 2, Swizzle128<ROWS>, PRODUCER_THREADS>(
            dst, (const elem_t*)src, row_stride / 2, 1, row0, rows_valid, width / 2, tid);
    }

    static __device__ __forceinline__ const u8* v_at(const Params& p, int b, const Sequence&, int hk) {
        return (const u8*)p.v + (i64)b * p.v_b + (i64)hk * p.v_h;  // per sequence in every layout
    }

    // V^T's columns are keys: 16-key chunks from the first past the sequence or the tile are zeros.
    static __device__ __forceinline__ void load_v(elem_t* dst, const u8* vt, i64 row_stride, i64, int n, int len_k,
                                                  int width, int tid) {
        load_tile<DIM_V, VT_KEYS / 2, Swizzle128<DIM_V>, PRODUCER_THREADS>(
            dst, (const elem_t*)(vt + n), row_stride / 2, 1, 0, width, min(len_k - n + 1, BLOCK_N) / 2, tid);
    }

    // The scores' factor and o's folded into the scale (softcap's too) and into drop_scale, o's
    // factor in ForwardRows::store (1 otherwise: FP8 takes no dropout).
    static __device__ __forceinline__ const Params& scaled(const Params& p, Params& descaled, int b, int hk) {
        descaled = p;
        const i64 at = (i64)b * p.heads_k + hk;
        if (p.k_descale) {
            const float factor = ((const float*)p.k_descale)[at];
            descaled.scale_log2 *= factor;
            descaled.softcap_scale *= factor;
        }
        if (p.v_descale) descaled.drop_scale *= ((const float*)p.v_descale)[at];
        return descaled;
    }

    static __device__ __forceinline__ bool nonfinite(const elem_t* vt) { return tile_nan_e4m3<DIM_V * VT_KEYS>(vt); }

    template <typename Poison>
    static __device__ __forceinline__ void poison(const ForwardRows& rows, const elem_t* vt, int n, Poison mark) {
        poison_from<0>([&](int r, int j) { return rows.reads_v<true>(rows.wrow + r, n + j); }, vt, mark);
    }

    // Keys J0 .. BLOCK_N - 1, 64 at a time (poison_allowed's most).
    template <int J0, typename Reads, typename Poison>
    static __device__ __forceinline__ void poison_from(Reads reads, const elem_t* vt, Poison mark) {
        if constexpr (J0 < BLOCK_N) {
            constexpr int KEYS = BLOCK_N - J0 < 64 ? BLOCK_N - J0 : 64;
            poison_allowed<ATOMS, KEYS, DIM_V, KeysOfVt<J0>>([&](int r, int j) { return reads(r, J0 + j); }, vt, mark);
            poison_from<J0 + 64>(reads, vt, mark);
        }
    }

    static __device__ __forceinline__ void clear(elem_t* vt) { clear_nan_e4m3<DIM_V * VT_KEYS>(vt); }
};

#define FORWARD_SM90 flashx_forward_fp8_sm90
#include "forward_sm90.cuh"
