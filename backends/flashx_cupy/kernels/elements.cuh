// Element conversions: 16-bit values as raw bits (no toolkit headers), converted by cvt.

__device__ __forceinline__ float to_float(elem_t x) {
#if DTYPE == 0
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#elif DTYPE == 1
    return __uint_as_float((u32)x << 16);
#else
    return x;
#endif
}

__device__ __forceinline__ elem_t from_float(float f) {
#if DTYPE == 0
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#elif DTYPE == 1
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return f;
#endif
}

__device__ __forceinline__ bool finite_float(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

__device__ __forceinline__ bool finite_bits(elem_t x) {
#if DTYPE == 0
    return (x & 0x7c00u) != 0x7c00u;
#elif DTYPE == 1
    return (x & 0x7f80u) != 0x7f80u;
#else
    return finite_float(x);
#endif
}

#if TENSOR_CORES
// Two floats as one register of two 16-bit values, lo in the low half (an mma A fragment).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if DTYPE == 0
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}
#endif

// Two adjacent elements (an accumulator's columns 2t, 2t + 1), in one store where they are 16-bit.
__device__ __forceinline__ void store_pair(elem_t* dst, float lo, float hi) {
#if TENSOR_CORES
    *(u32*)dst = pack2(lo, hi);
#else
    dst[0] = lo;
    dst[1] = hi;
#endif
}
