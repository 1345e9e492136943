// Hopper's warpgroup products (wgmma, sm_90a code), with mbarrier.cuh's barriers beside them, for
// the kernels built on them (forward_sm90.cu, forward_fp8_sm90.cu through forward_sm90.cuh;
// dkdv_sm90.cu, dq_sm90.cu); after common.cuh. The 16-bit products are here, the e4m3 ones in
// wgmma_e4m3.cuh.
//
// A product runs asynchronously from its issue (wgmma_ss, wgmma_rs) to the wait_group that
// covers its commit group: its accumulator registers belong to the tensor cores meanwhile, and
// the register fences after each wait keep the compiler from reading them earlier. Its shared
// operands are read through the async proxy: shared memory that threads write (cp.async, or a
// store) is fenced (fence.proxy.async) by each writer before the barrier after which a product
// reads it.

#include "mbarrier.cuh"

#if DTYPE == 0
#define WGMMA_TYPES ".f32.f16.f16"
#else
#define WGMMA_TYPES ".f32.bf16.bf16"
#endif

// The accumulator operands of a product of N = 32 (16 registers a thread), 64 (32), 128 (64) or
// 176 (88).
#define WGMMA_D4(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define WGMMA_D16(d) WGMMA_D4(d, 0), WGMMA_D4(d, 1), WGMMA_D4(d, 2), WGMMA_D4(d, 3)
#define WGMMA_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define WGMMA_D32(d, i)                                                                             \
    WGMMA_D4(d, i), WGMMA_D4(d, i + 1), WGMMA_D4(d, i + 2), WGMMA_D4(d, i + 3), WGMMA_D4(d, i + 4), \
        WGMMA_D4(d, i + 5), WGMMA_D4(d, i + 6), WGMMA_D4(d, i + 7)
#define WGMMA_R32                                                                                 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WGMMA_R64                                                                                   \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, " \
    "%39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, " \
    "%58, %59, %60, %61, %62, %63}"
// Operand lists of the wider products, numbered by tens: WGMMA_TENS(t) is %t0 .. %t9, WGMMA_EIGHT(t)
// %t0 .. %t7 (t empty: from %0). S of 176 keys (88 registers a thread) or 80 (40), O at d256 (128);
// the FP8 forward's S of 192 (96).
#define WGMMA_EIGHT(t) "%" #t "0, %" #t "1, %" #t "2, %" #t "3, %" #t "4, %" #t "5, %" #t "6, %" #t "7"
#define WGMMA_TENS(t) WGMMA_EIGHT(t) ", %" #t "8, %" #t "9"
#define WGMMA_D88(d)                                                                                      \
    WGMMA_D32(d, 0), WGMMA_D32(d, 8), WGMMA_D4(d, 16), WGMMA_D4(d, 17), WGMMA_D4(d, 18), WGMMA_D4(d, 19), \
        WGMMA_D4(d, 20), WGMMA_D4(d, 21)
#define WGMMA_R88                                                                                     \
    "{" WGMMA_TENS() ", " WGMMA_TENS(1) ", " WGMMA_TENS(2) ", " WGMMA_TENS(3) ", " WGMMA_TENS(4) ", " \
    WGMMA_TENS(5) ", " WGMMA_TENS(6) ", " WGMMA_TENS(7) ", " WGMMA_EIGHT(8) "}"
#define WGMMA_D96(d) WGMMA_D32(d, 0), WGMMA_D32(d, 8), WGMMA_D32(d, 16)
#define WGMMA_R96                                                                                     \
    "{" WGMMA_TENS() ", " WGMMA_TENS(1) ", " WGMMA_TENS(2) ", " WGMMA_TENS(3) ", " WGMMA_TENS(4) ", " \
    WGMMA_TENS(5) ", " WGMMA_TENS(6) ", " WGMMA_TENS(7) ", " WGMMA_TENS(8) ", %90, %91, %92, %93, %94, %95}"
#define WGMMA_D40(d) WGMMA_D32(d, 0), WGMMA_D4(d, 8), WGMMA_D4(d, 9)
#define WGMMA_R40 "{" WGMMA_TENS() ", " WGMMA_TENS(1) ", " WGMMA_TENS(2) ", " WGMMA_TENS(3) "}"
#define WGMMA_D128(d) WGMMA_D32(d, 0), WGMMA_D32(d, 8), WGMMA_D32(d, 16), WGMMA_D32(d, 24)
#define WGMMA_R128                                                                                        \
    "{" WGMMA_TENS() ", " WGMMA_TENS(1) ", " WGMMA_TENS(2) ", " WGMMA_TENS(3) ", " WGMMA_TENS(4) ", "     \
    WGMMA_TENS(5) ", " WGMMA_TENS(6) ", " WGMMA_TENS(7) ", " WGMMA_TENS(8) ", " WGMMA_TENS(9) ", "         \
    WGMMA_TENS(10) ", " WGMMA_TENS(11) ", " WGMMA_EIGHT(12) "}"

// The descriptor of a wgmma operand in Swizzle128 layout at shared address ``addr`` (1024-byte
// aligned, or a column offset within a swizzled row): 8-row groups 1024 bytes apart (the stride
// byte offset); ``lbo`` the leading byte offset, the distance of 64-column panels for an MN-major
// operand (a K-major one in this swizzle ignores it: 16 by convention). Bits 62-63: 1, 128-byte swizzle.
__device__ __forceinline__ u64 wgmma_desc(u32 addr, u32 lbo) {
    return (u64)((addr & 0x3ffff) >> 4) | (u64)(lbo >> 4) << 16 | (u64)(1024 >> 4) << 32 | 1ull << 62;
}

// The descriptor's step to element (r, c) of a Swizzle128<ROWS> tile, from its (0, 0): r a multiple
// of 8 and c of 8, so that the step is a plain address offset.
template <int ROWS>
__device__ __forceinline__ u64 desc_step(int r, int c) {
    return (u64)(Swizzle128<ROWS>::offset(r, c) >> 4);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N / 8][4]) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// D[64 x N] (+)= A[64 x 16] B[16 x N], A and B from shared memory, each K-major, or MN-major where
// A_MN or B_MN says (trans-a, trans-b 1: a tile whose rows are the product's K).
template <int N, bool ACCUMULATE, bool A_MN = false, bool B_MN = false>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], u64 a, u64 b) {
    if constexpr (N == 64)
        asm volatile("{\n.reg .pred acc;\nsetp.ne.b32 acc, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16" WGMMA_TYPES " " WGMMA_R32 ", %32, %33, acc, 1, 1, %35, %36;\n}"
                     : WGMMA_D32(d, 0)
                     : "l"(a), "l"(b), "n"((int)ACCUMULATE), "n"((int)A_MN), "n"((int)B_MN));
    else if constexpr (N == 128)
        asm volatile("{\n.reg .pred acc;\nsetp.ne.b32 acc, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16" WGMMA_TYPES " " WGMMA_R64 ", %64, %65, acc, 1, 1, %67, %68;\n}"
                     : WGMMA_D32(d, 0), WGMMA_D32(d, 8)
                     : "l"(a), "l"(b), "n"((int)ACCUMULATE), "n"((int)A_MN), "n"((int)B_MN));
    else if constexpr (N == 32)
        asm volatile("{\n.reg .pred acc;\nsetp.ne.b32 acc, %18, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k16" WGMMA_TYPES " " WGMMA_R16 ", %16, %17, acc, 1, 1, %19, %20;\n}"
                     : WGMMA_D16(d)
                     : "l"(a), "l"(b), "n"((int)ACCUMULATE), "n"((int)A_MN), "n"((int)B_MN));
    else if constexpr (N == 176)
        asm volatile("{\n.reg .pred acc;\nsetp.ne.b32 acc, %90, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n176k16" WGMMA_TYPES " " WGMMA_R88 ", %88, %89, acc, 1, 1, %91, %92;\n}"
                     : WGMMA_D88(d)
                     : "l"(a), "l"(b), "n"((int)ACCUMULATE), "n"((int)A_MN), "n"((int)B_MN));
    else
        asm volatile("{\n.reg .pred acc;\nsetp.ne.b32 acc, %42, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n80k16" WGMMA_TYPES " " WGMMA_R40 ", %40, %41, acc, 1, 1, %43, %44;\n}"
                     : WGMMA_D40(d)
                     : "l"(a), "l"(b), "n"((int)ACCUMULATE), "n"((int)A_MN), "n"((int)B_MN));
    static_assert(N == 32 || N == 64 || N == 128 || N == 176 || N == 80, "a product's N: 32, 64, 128, 176 or 80");
}

// The descriptor's step along K by k (a multiple of 16) in a Swizzle128<ROWS> tile: along its
// columns if K-major, its rows if MN_MAJOR.
template <int ROWS, bool MN_MAJOR>
__device__ __forceinline__ u64 k_step(int k) {
    return MN_MAJOR ? desc_step<ROWS>(k, 0) : desc_step<ROWS>(0, k);
}

// D (+)= A[64 x K] B[K x N] over the whole of K, A a Swizzle128<ROWS_A> tile and B a
// Swizzle128<ROWS_B> one from the descriptors of their (0, 0), each K-major unless A_MN or B_MN
// says: a product a 16-step of K, issued into the open commit group.
template <int N, int K, int ROWS_A, int ROWS_B, bool A_MN = false, bool B_MN = false, bool ACCUMULATE = false>
__device__ __forceinline__ void wgmma_ss_whole_k(float (&d)[N / 8][4], u64 a, u64 b) {
    wgmma_ss<N, ACCUMULATE, A_MN, B_MN>(d, a, b);
#pragma unroll
    for (int kk = 1; kk < K / 16; ++kk)
        wgmma_ss<N, true, A_MN, B_MN>(d, a + k_step<ROWS_A, A_MN>(16 * kk), b + k_step<ROWS_B, B_MN>(16 * kk));
}

// D[64 x N] += A[64 x 16] B[16 x N], A in registers (each warp its 16 rows as an mma.sync A
// fragment), B MN-major in shared memory (trans-b 1).
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) {
    if constexpr (N == 64)
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16" WGMMA_TYPES " " WGMMA_R32
                     ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;"
                     : WGMMA_D32(d, 0)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else if constexpr (N == 128)
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16" WGMMA_TYPES " " WGMMA_R64
                     ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;"
                     : WGMMA_D32(d, 0), WGMMA_D32(d, 8)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else
        asm volatile("wgmma.mma_async.sync.aligned.m64n256k16" WGMMA_TYPES " " WGMMA_R128
                     ", {%128, %129, %130, %131}, %132, 1, 1, 1, 1;"
                     : WGMMA_D128(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    static_assert(N == 64 || N == 128 || N == 256, "P V's N: 64, 128 or 256");
}

// The backward kernels' tiles (backward.cuh): unpadded, in the 128-byte swizzle, read by the
// products through the async proxy.
struct SwizzledTiles {
    template <int ROWS>
    using QK = Swizzle128<ROWS>;
    template <int ROWS>
    using V = Swizzle128<ROWS>;
    template <int ROWS>
    using DS = Swizzle128<ROWS>;
    enum { QK_PITCH = DIM_QK, V_PITCH = DIM_V };
    static __device__ __forceinline__ void written() { fence_proxy_async(); }
};

// The 16 x 16 blocks of an m64nN accumulator (this warp's 16 rows), rounded to the products'
// type, as A fragments of a product whose K is that N: block kk takes columns 16kk .. 16kk + 15.
template <int N>
__device__ __forceinline__ void to_fragment(u32 (&a)[4], const float (&c)[N / 8][4], int kk) {
    a[0] = pack2(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack2(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack2(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack2(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}
template <int N>
__device__ __forceinline__ void to_fragments(const float (&c)[N / 8][4], u32 (&a)[N / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) to_fragment<N>(a[kk], c, kk);
}
