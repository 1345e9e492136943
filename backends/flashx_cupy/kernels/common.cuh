// What every kernel shares: the compile-time configuration, the element types and ``Params``,
// then one header per concept: element conversions (elements.cuh), copies into shared memory and
// the tiles' layouts (copies.cuh), the warp-level products (mma.cuh), masked products with
// non-finite operands (exact.cuh), sequences and the pair rule of the contract's "Scores and
// masking" (masking.cuh), its "Dropout" draw (dropout.cuh), and the CTA's tile (scheduling.cuh).
//
// Compile-time configuration comes from -D macros set by flashx_cupy.variants:
//   DTYPE 0 float16, 1 bfloat16, 2 float32; DIM_QK, DIM_V the head-dim classes (64, 128, 256);
//   BLOCK_M the rows a CTA owns (queries, or keys in the dK/dV kernel), split among WARPS warps;
//   BLOCK_N the rows of the operand it streams through shared memory, two tiles in flight;
//   VARLEN, SEQLENS_Q, SEQLENS_K, BAND, MASK, BLOCK_MASK, DROPOUT (0/1): the features used
//   (SOFTCAP, ALIBI, SINKS: score_mods.cuh);
//   ALIGNED: every operand may be read in 16-byte chunks (cp.async), else element by element.
//
// Every product leaves its result in the accumulator layout of mma.sync.m16n8k16: lane
// (g = lane / 4, t = lane % 4) holds rows g and g + 8, columns 2t and 2t + 1 of each 16 x 8 atom.
// The float32 path computes the same elements with IEEE fma from shared memory (no TF32), so
// the softmax, masking and dropout code is one for all dtypes.
//
// Headers of the toolkit are not used, so NVRTC needs no include path: 16-bit values are raw
// bits, converted with cvt instructions.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

#if DTYPE == 2
typedef float elem_t;
#define TENSOR_CORES 0
#else
typedef u16 elem_t;
#define TENSOR_CORES 1
#endif

#define THREADS (WARPS * 32)
#ifndef PRODUCER_THREADS
#define PRODUCER_THREADS 0  // threads past THREADS that only load tiles (the wgmma forward's producer)
#endif
#define ATOMS (BLOCK_M / (16 * WARPS))             // 16-row atoms of the resident operand per warp
#define CHUNK (16 / (int)sizeof(elem_t))        // elements per 16-byte copy
#define LD_QK (DIM_QK + CHUNK)                  // shared-memory row pitch: 16 bytes of padding
#define LD_V (DIM_V + CHUNK)                    // keeps ldmatrix free of bank conflicts
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF __int_as_float(0xff800000u)
#define QUIET_NAN __int_as_float(0x7fffffff)

// The arguments of the forward kernels and what every kernel reads: the problem, Q, K, V, O and
// the LSE, the lengths, the masks, the score modifications, dropout and FP8's descales. Packed on
// the host by flashx_cupy.launch.PARAMS (same order, 8-byte fields first so that no padding
// differs between numpy and C); the backward's and decoding's kernels take a struct derived from
// it (BackwardParams in backward.cuh, DecodeParams in decode.cu), whose fields follow these.
struct Params {
    u64 q, k, v, o, lse, cu_q, cu_k, seqlens_q, seqlens_k, mask, blocks;
    u64 alibi_slopes, sinks;  // float32: slopes (Hq,) or (B, Hq), sinks (Hq,)
    // float32 descales, null for 1: the FP8 forward's q_descale * k_descale and v_descale (B, Hk),
    // an FP8 cache's k_descale and v_descale (B, Hk)
    u64 k_descale, v_descale;
    i64 q_b, q_n, q_h, q_d, k_b, k_n, k_h, k_d, v_b, v_n, v_h, v_d, o_b, o_n, o_h, o_d;
    i64 lse_b, lse_h, mask_b, mask_h, mask_i, mask_j, blocks_b, blocks_h, blocks_i, blocks_j;
    i64 alibi_b;  // 0 for slopes per head, Hq for slopes per sequence and head
    u64 seed;
    int batch, heads_q, heads_k, group, seqlen_q, seqlen_k, head_dim, head_dim_v;
    int left, right, block_q, block_k, rng_offset, drop_threshold, tiles_m, drop_row0, drop_col0;
    int heads_inner;  // the grid's order (scheduling.cuh, variants.heads_inner)
    float scale, scale_log2, drop_scale;
    float softcap_scale, softcap_log2;  // scale / c and log2(e) c (score_mods.cuh)
};

#include "elements.cuh"
#include "copies.cuh"
#include "mma.cuh"
#include "exact.cuh"
#include "masking.cuh"
#include "dropout.cuh"
#include "scheduling.cuh"
