// wgmma on float8_e4m3fn operands (sm_90a), for the FP8 forward (forward_fp8_sm90.cu): the two
// products, P's packing into the register operand, and V's key order that this packing asks for.
//
// An e4m3 product takes K = 32 per instruction, and both shared-memory operands K-major (8-bit
// types have no transpose). Its tiles are kept as 16-bit pairs of bytes by the copies and the
// swizzle (copies.cuh's load_tile and Swizzle128 in elem_t units): a 128-byte row is 64 pairs, and
// the descriptor's step of k = 32 bytes is desc_step(0, 16), as the 16-bit kernel's of k = 16.
//
// P from registers. The accumulator of S gives lane (g = lane / 4, t = lane % 4) of each warp the
// columns 2t, 2t + 1 of each 8-column atom, in rows g and g + 8 (element [nt][e]: row g + 8 (e / 2),
// column 8 nt + 2t + e % 2). The register A fragment of an m64nNk32 e4m3 product (the PTX ISA's
// figure for wgmma .m64nNk32 A, the same as mma.m16n8k32's for 8-bit types) gives the same lane,
// in the warp's 16 rows, four .b32 registers of four bytes, the lowest byte first:
//   a0 row g, columns 4t .. 4t + 3;        a1 row g + 8, columns 4t .. 4t + 3;
//   a2 row g, columns 16 + 4t .. 16 + 4t + 3;  a3 row g + 8, the same columns.
// The lane holds the values of other columns than it must hand over; rather than exchange them
// between lanes, each lane packs its own and the product's K axis is relabelled: column 4t + i of
// a 16-column half stands for key 2t + (i & 1) + 8 (i >> 1) of that half, and V's keys are laid
// out in that order (flashx_cupy.launch.keys_in_fp8_order), so that the sum over keys is the same. Element [4kk + 2h + q][2r + x] of S (q, x in {0, 1}) thus lands in byte 2q + x
// of register 2h + r of P's k-step kk.

// Where key k of a tile lies in V's rows (the inverse of the relabelling above): key
// 2t + (i & 1) + 8 (i >> 1) of a group of 16 at column 4t + i, as keys_in_fp8_order lays them out.
__device__ __forceinline__ int e4m3_key_column(int k) {
    return k / 16 * 16 + (k % 8) / 2 * 4 + (k & 1) + (k / 8 % 2) * 2;
}

// Four floats rounded to e4m3 (to nearest, ties to even; satfinite, which keeps NaN), as one
// register, a in its lowest byte. cvt's e4m3x2 puts its first operand in the upper byte.
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
    u32 r;
    asm("{ .reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\ncvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi}; }"
        : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
    return r;
}

// D[64 x N] (+)= A[64 x 32] B[32 x N], e4m3 A and B from shared memory, both K-major: S of 64, 128
// or 192 keys.
#define WGMMA_SS_E4M3(SHAPE, REGS, A, B, ACC)                                                         \
    "{\n.reg .pred acc;\nsetp.ne.b32 acc, %" #ACC ", 0;\nwgmma.mma_async.sync.aligned." SHAPE \
    ".f32.e4m3.e4m3 " REGS ", %" #A ", %" #B ", acc, 1, 1;\n}"
template <int N, bool ACCUMULATE>
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[N / 8][4], u64 a, u64 b) {
    static_assert(N == 64 || N == 128 || N == 192, "S's N: 64, 128 or 192");
    if constexpr (N == 64)
        asm volatile(WGMMA_SS_E4M3("m64n64k32", WGMMA_R32, 32, 33, 34)
                     : WGMMA_D32(d, 0) : "l"(a), "l"(b), "n"((int)ACCUMULATE));
    else if constexpr (N == 128)
        asm volatile(WGMMA_SS_E4M3("m64n128k32", WGMMA_R64, 64, 65, 66)
                     : WGMMA_D32(d, 0), WGMMA_D32(d, 8) : "l"(a), "l"(b), "n"((int)ACCUMULATE));
    else
        asm volatile(WGMMA_SS_E4M3("m64n192k32", WGMMA_R96, 96, 97, 98)
                     : WGMMA_D96(d) : "l"(a), "l"(b), "n"((int)ACCUMULATE));
}

// D[64 x N] += A[64 x 32] B[32 x N], A in registers (the fragment above), B K-major in shared memory.
template <int N>
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) {
    if constexpr (N == 64)
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " WGMMA_R32
                     ", {%32, %33, %34, %35}, %36, 1, 1, 1;"
                     : WGMMA_D32(d, 0)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " WGMMA_R64
                     ", {%64, %65, %66, %67}, %68, 1, 1, 1;"
                     : WGMMA_D32(d, 0), WGMMA_D32(d, 8)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// P's k-step kk (keys 32 kk .. 32 kk + 31 of the tile) from the probabilities s in the accumulator
// layout, as the A fragment above.
template <int N>
__device__ __forceinline__ void pack_e4m3_fragment(u32 (&a)[4], const float (&s)[N / 8][4], int kk) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float(&lo)[4] = s[4 * kk + 2 * h], (&hi)[4] = s[4 * kk + 2 * h + 1];
            a[2 * h + r] = e4m3x4(lo[2 * r], lo[2 * r + 1], hi[2 * r], hi[2 * r + 1]);
        }
}

// e4m3 has one NaN per sign (every exponent and mantissa bit set) and no infinity. Four bytes at
// a time: a byte's low seven bits plus one carry into its top bit only where they were all set.
__device__ __forceinline__ u32 e4m3_nan_bytes(u32 w) { return ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u; }

// Whether a tile of BYTES bytes in shared memory holds a NaN (an answer of the computing threads,
// voted again by the warp, as exact.cuh's tile_nonfinite); clear_nan_e4m3 zeroes those bytes.
template <int BYTES>
__device__ __forceinline__ bool tile_nan_e4m3(const elem_t* s) {
    u32 bad = 0;
    for (int idx = threadIdx.x; idx < BYTES / 4; idx += THREADS) bad |= e4m3_nan_bytes(((const u32*)s)[idx]);
    return __any_sync(0xffffffffu, compute_sync_or(bad != 0));
}

template <int BYTES>
__device__ __forceinline__ void clear_nan_e4m3(elem_t* s) {
    for (int idx = threadIdx.x; idx < BYTES / 4; idx += THREADS) {
        const u32 w = ((const u32*)s)[idx], nan = e4m3_nan_bytes(w);
        if (nan) ((u32*)s)[idx] = w & ~((nan >> 7) * 0xffu);
    }
}
