// The contract's "Score modifications": softcap, ALiBi and attention sinks, each a compile-time
// option (SOFTCAP, ALIBI, SINKS: 0/1, set by flashx_cupy.variants), so that a call without them
// compiles to exactly the code it had before they existed.
//
// The kernels take scores in base 2 (times log2(e)), as the online softmax uses them. For the dot
// product s = q . k of query i and key j (positions within the sequence, Lk - Lq = diag):
//   plain     x = log2(e) scale s
//   softcap   x = log2(e) c tanh(scale s / c)       p.softcap_log2 = log2(e) c, p.softcap_scale = scale / c
//   ALiBi     x -= log2(e) a |i + diag - j|
// then the masks (a select, after these). The tanh is the GPU's tanh.approx (one special-function
// op, relative error under 2^-10.9) for 16-bit inputs, whose own rounding of a score (2^-9 for
// bfloat16, 2^-11 for float16) is no smaller, and tanhf (2 ulp, a dozen instructions) for float32
// problems, which are held to float32 rounding. The backward multiplies dS by the
// cap's derivative 1 - tanh^2. The sink enters each row once, after its last key tile
// (ForwardRows::store), and its gradient is a term of each row in the delta kernel.

#ifndef SOFTCAP
#define SOFTCAP 0
#endif
#ifndef ALIBI
#define ALIBI 0
#endif
#ifndef SINKS
#define SINKS 0
#endif

__device__ __forceinline__ float softcap_tanh(float x) {
    if constexpr (DTYPE == 2) {
        return tanhf(x);
    } else {
        float y;
        asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
        return y;
    }
}

// The modifications of one query head in one sequence: ALiBi's slope is read once, when a
// program (or, in the dK/dV kernel, a step) takes the head.
struct ScoreMods {
    // ALiBi's (unused without it)
    float slope_log2;  // log2(e) a: alibi_slopes[h] or alibi_slopes[b, h] (alibi_b = 0 or Hq)
    int diag;          // Lk - Lq: the distance is from the bottom-right aligned diagonal

    __device__ __forceinline__ void load(const Params& p, const Sequence& s, int h) {
        if constexpr (ALIBI) {
            slope_log2 = ((const float*)p.alibi_slopes)[(i64)s.b * p.alibi_b + h] * LOG2E;
            diag = s.len_k - s.len_q;
        }
    }

    // The base-2 score of query i and key j whose dot product is ``dot``; ``capped`` receives
    // tanh(scale dot / c), of which the backward takes the cap's derivative.
    __device__ __forceinline__ float score2(const Params& p, float dot, int i, int j, float& capped) const {
        float x;
        if constexpr (SOFTCAP) {
            capped = softcap_tanh(dot * p.softcap_scale);
            x = capped * p.softcap_log2;
        } else {
            x = dot * p.scale_log2;
        }
        // a NaN slope makes every score NaN, an infinite one NaN on the diagonal (inf * 0): IEEE, as the contract says
        if constexpr (ALIBI) x = fmaf(-slope_log2, fabsf((float)(i + diag - j)), x);
        return x;
    }

    __device__ __forceinline__ float score2(const Params& p, float dot, int i, int j) const {
        float capped;
        return score2(p, dot, i, j, capped);
    }

    // log2 P of the pair from its row's base-2 LSE: the backward's recomputation.
    __device__ __forceinline__ float log2_prob(const Params& p, float dot, int i, int j, float lse2, float& capped) const {
        if constexpr (SOFTCAP || ALIBI) return score2(p, dot, i, j, capped) - lse2;
        return fmaf(dot, p.scale_log2, -lse2);  // fused, as the kernels had it before the modifications
    }
};

// dS of a pair as the scaled score's gradient: times the cap's derivative 1 - tanh^2, which is 0
// where the capped score saturates (an infinite one included).
__device__ __forceinline__ float through_softcap(float ds, float capped) {
    if constexpr (SOFTCAP) return ds * fmaf(-capped, capped, 1.f);
    return ds;
}

// The sink of head h in base 2 joins a row's softmax as one more column, with no value: the row's
// keys gave ``sum`` in units of 2^row_max (0: no allowed key). Returns the row's base-2 LSE and
// sets ``keys_share`` to the keys' weight exp(lse_keys - lse) per unit of ``sum``. The common
// reference is max(row_max, sink), so that neither exponent is positive; a NaN or +inf sink makes
// the row NaN (fmaxf drops a NaN, but exp2f(NaN) does not; +inf - +inf is NaN).
__device__ __forceinline__ float with_sink(float row_max, float sum, float sink2, float& keys_share) {
    const float top = fmaxf(row_max, sink2);
    keys_share = exp2f(row_max - top);
    const float total = fmaf(sum, keys_share, exp2f(sink2 - top));
    keys_share /= total;
    return top + log2f(total);
}

// Whether query row i of sequence s has an allowed key for head h: the keys of its band, 32 at
// a time by the whole warp. Without a bool or block mask the band's first key answers.
__device__ __forceinline__ bool row_has_key(const Params& p, const Sequence& s, int h, int i) {
    if (i >= s.len_q) return false;
    const int diag = s.len_k - s.len_q, lane = threadIdx.x % 32;
    const int lo = max(i + diag - p.left, 0), hi = min(i + diag + p.right + 1, s.len_k);
    for (int j0 = lo; j0 < hi; j0 += 32)
        if (__any_sync(0xffffffffu, j0 + lane < hi && allowed_pair(p, s, h, i, j0 + lane))) return true;
    return false;
}
