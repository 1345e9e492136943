// The backward, in three kernels (dkdv.cu, and dq.cu with the delta kernel; each on wgmma too):
//   flashx_delta  D = rowsum(dO * O) per query row, float32;
//   flashx_dkdv   one CTA per (key tile, kv head, sequence), K and V resident, streaming the
//                 query tiles of every query head of its group: dV = P^T dO, dK = dS^T Q, summed
//                 over the group in registers. Scores are held transposed (keys x queries), so
//                 the warps own keys and the products are those of the forward;
//   flashx_dq     one CTA per (query tile, query head, sequence), Q and dO resident, streaming
//                 key tiles: dQ = dS K.
// Without atomics the backward is deterministic, and flashx_dq computes S and dP again: seven
// products. With DQ_ATOMIC, flashx_dkdv also adds each tile's dS K to a float32 dQ (p.dq, of the
// launch's kv heads) by unordered reductions, and flashx_dq is not launched: five products, the
// sum's order left to the hardware. The host picks it for 16-bit problems unless the call asks
// for determinism, under a band only on wgmma with every sum in one launch (variants.fused_dq).
// P is recomputed from the LSE; with dropout, Z is drawn again from (seed, rng_offset):
//   dV = (P Z / (1 - p))^T dO,  dS = P (Z dP / (1 - p) - D),  dP = dO V^T;
// a dropped pair reads no dO (its dP is 0), but its dS = -P D still reaches dQ and dK. The score
// modifications (score_mods.cuh) recompute S as the forward did, multiply dS by the softcap's
// derivative, and leave dsinks to flashx_delta: a term of each row, -exp(sink - lse) D where the
// row has an allowed key, which the host sums in a fixed order.
// DKDV_PARTS (bit 0: dK, bit 1: dV) lets the widest head dims compute dK and dV in two launches,
// each holding one accumulator in registers.
//
// In flashx_dkdv, as in the forward, each query tile runs one of two compiled bodies, picked by
// one uniform branch: masked tiles (the band's edges, a sequence's end, any mask) test every
// pair, the others test none, so that the steady state carries no pair-test registers (one
// body with run-time tests spilled at d128). A tile's Q and dO arrive as one cp.async group,
// requested when the previous tile starts: one wait and one barrier a tile. Splitting them into
// a group per product, as the forward does for K and V, costs the registers that d128 lacks.
// Masked tiles work out which pairs read what only in the rare tile with non-finite operands,
// rather than record every pair. flashx_dq keeps one body, which fits without spills, and its
// record of allowed pairs (a byte a pair of shared memory); it too waits and syncs once a tile.
//
// On compute capability 9.0, 16-bit problems of head-dim classes 64 and 128 take flashx_dq_sm90
// and flashx_dkdv_sm90 instead (dq_sm90.cu, dkdv_sm90.cu), or flashx_dkdv_sm90 with DQ_ATOMIC
// alone where the host picks the fused dQ: the same CTAs and semantics (dq.cuh, dkdv.cuh) on
// Hopper's warpgroup products, two warpgroups of 64 resident rows beside a producer warpgroup that
// copies (ring.cuh). Each kernel's semantics live once, in its .cuh, so that the two products'
// kernels cannot drift apart; a kernel file holds only its products, its tiles' layout and its
// producer.


#include "common.cuh"
#include "score_mods.cuh"

// The backward kernels' arguments: Params, then dO and the gradients, D and each row's term of
// dsinks, and the kv heads of a dK/dV launch (flashx_cupy.launch.BACKWARD_PARAMS).
struct BackwardParams : Params {
    u64 dout, dq, dk, dv, delta;
    u64 dsinks_rows;  // float32, shaped and strided like delta: each row's term of dsinks
    i64 do_b, do_n, do_h, do_d, dq_b, dq_n, dq_h, dk_b, dk_n, dk_h, dv_b, dv_n, dv_h, delta_b, delta_h;
    int kv_head0, kv_heads;  // the dK/dV kernel's launch covers kv heads [kv_head0, kv_head0 + kv_heads)
};

#ifndef DKDV_PARTS
#define DKDV_PARTS 3
#endif
#ifndef DQ_ATOMIC
#define DQ_ATOMIC 0
#endif
#define LD_DS (BLOCK_N + CHUNK)  // dS^T in shared memory: keys x queries
#define DQ_PANEL 8               // DQ_ATOMIC: the float32 dQ sums' columns a panel (launch.DQ_PANEL)
static_assert(!DQ_ATOMIC || (TENSOR_CORES && DKDV_PARTS == 3), "the fused dQ takes dS of both parts' kernel, on tensor cores");

// The LSE of query row i (within the sequence) in base 2, and D.
__device__ __forceinline__ void row_stats(const BackwardParams& p, const Sequence& s, int h, int i, float& lse2, float& delta) {
    if (i < s.len_q) {
        lse2 = ((const float*)p.lse)[(i64)s.b * p.lse_b + (i64)h * p.lse_h + s.start_q + i] * LOG2E;
        delta = ((const float*)p.delta)[(i64)s.b * p.delta_b + (i64)h * p.delta_h + s.start_q + i];
    } else {
        lse2 = delta = 0.f;  // a row past the sequence: every pair of it is disallowed
    }
}

// How a backward kernel lays out its tiles in shared memory (``Tiles`` of dkdv.cuh and dq.cuh):
//   QK<ROWS>, V<ROWS>    the layouts of Q and K, and of dO and V, tiles of ROWS rows;
//   DS<ROWS>             the layout of a step's dS^T (ROWS keys x BLOCK_N queries), the fused
//                        dQ's operand;
//   QK_PITCH, V_PITCH    their elements a row as whole-tile loops (tile_nonfinite) see them;
//   written()            what a thread does after writing a tile that the products then read.
// mma.sync reads its operands by ldmatrix from padded rows; wgmma's are SwizzledTiles (wgmma.cuh).
struct PaddedTiles {
    template <int ROWS>
    using QK = Padded<LD_QK>;
    template <int ROWS>
    using V = Padded<LD_V>;
    template <int ROWS>
    using DS = Padded<LD_DS>;
    enum { QK_PITCH = LD_QK, V_PITCH = LD_V };
    static __device__ __forceinline__ void written() {}
};
