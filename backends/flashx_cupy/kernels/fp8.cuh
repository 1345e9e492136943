// float8_e4m3fn KV caches in the decoding kernels (the contract's FP8 section): a cache's bytes
// widened to the queries' 16-bit type for the tensor-core products, and new tokens quantized into
// the cache. Both use the e4m3 conversions of compute capability 8.9 and newer (cvt ... e4m3x2),
// on which flashx_cupy's decode_reasons insists.
//
// Widening is exact: float16 and bfloat16 hold every e4m3 value, subnormals included, and NaN
// (e4m3 has no infinity) becomes NaN, which the kernels' NaN rule then sees as any 16-bit NaN.

#if !TENSOR_CORES
#error "an FP8 cache is read under 16-bit queries only"
#endif

typedef unsigned char u8;

// Four e4m3 values, the bytes of w from the lowest, as two pairs of elem_t (the lowest byte in
// the low half of .x). sm_89/sm_90 convert e4m3 pairs to float16 pairs only; bfloat16 takes them on
// through float32 (as the toolkit's cuda_fp8.hpp does below sm_100), each step exact.
__device__ __forceinline__ uint2 widen_e4m3x4(u32 w) {
    u32 lo, hi;
    asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.rn.f16x2.e4m3x2 %0, a; cvt.rn.f16x2.e4m3x2 %1, b; }"
        : "=r"(lo), "=r"(hi) : "r"(w));
#if DTYPE == 1
    float f[4];
    asm("{ .reg .b16 a, b, c, d; mov.b32 {a, b}, %4; mov.b32 {c, d}, %5;\n"
        "cvt.f32.f16 %0, a; cvt.f32.f16 %1, b; cvt.f32.f16 %2, c; cvt.f32.f16 %3, d; }"
        : "=f"(f[0]), "=f"(f[1]), "=f"(f[2]), "=f"(f[3]) : "r"(lo), "r"(hi));
    lo = pack2(f[0], f[1]);
    hi = pack2(f[2], f[3]);
#endif
    return make_uint2(lo, hi);
}

// An FP8 stage of ROWS x COLS bytes (rows unpadded) widened into a 16-bit tile of pitch LD, by
// every thread of the CTA: eight bytes a thread at a time, one 8-byte load and one 16-byte store,
// so that a half warp's loads read 128 contiguous bytes and a quarter warp's stores write 128
// contiguous bytes of one row (COLS >= 64): no bank conflicts either way.
template <int ROWS, int COLS, int LD>
__device__ __forceinline__ void widen_tile(elem_t* dst, const u8* src) {
    constexpr int UNITS = ROWS * COLS / 8, PER_ROW = COLS / 8;
    static_assert(UNITS % THREADS == 0 && PER_ROW >= 8, "whole rounds of whole 128-byte runs");
#pragma unroll
    for (int u = threadIdx.x; u < UNITS; u += THREADS) {
        const int r = u / PER_ROW, c = u % PER_ROW * 8;
        const uint2 bytes = *(const uint2*)(src + r * COLS + c);
        const uint2 lo = widen_e4m3x4(bytes.x), hi = widen_e4m3x4(bytes.y);
        *(uint4*)(dst + r * LD + c) = make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
}

// The e4m3 byte of float32 x by the contract's rule for new cache tokens: the nearest value, ties
// to even; magnitudes past 448, infinities included, 448 with x's sign; NaN a NaN. cvt's
// .satfinite saturates so and keeps NaN; the NaN byte (0x7f, as the NumPy reference writes it) is
// chosen here all the same, so that the rule rests on this function and not on an instruction's
// reading of NaN.
__device__ __forceinline__ u8 e4m3_of(float x) {
    u16 pair;  // x in the low byte, 0 in the high one
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(x));
    return x != x ? (u8)0x7f : (u8)pair;
}
