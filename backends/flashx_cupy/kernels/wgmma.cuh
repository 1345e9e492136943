// What the wgmma forwards share (forward_sm90.cu, 16-bit; forward_fp8_sm90.cu, e4m3), all of it
// sm_90a: the accumulator operands of a product, the shared-memory descriptors of Swizzle128
// tiles, the fences and waits of the async proxy, and the mbarriers of the producer's ring.

// The accumulator operands of a product of N = 64 (32 registers a thread) or 128 (64).
#define WGMMA_D4(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
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
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N / 8][4]) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// mbarriers in shared memory: a phase completes once ``count`` threads have arrived; arrive
// releases and the wait acquires, at CTA scope.
__device__ __forceinline__ void bar_init(u64* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(u64* bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}" ::"r"(smem_addr(bar)) : "memory");
}
// Until the phase of the given parity has completed (the phase before the first completes at once).
__device__ __forceinline__ void bar_wait(u64* bar, u32 parity) {
    asm volatile("{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT;\n}"
                 ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

// The CTA's barriers: tile t's K lies in K buffer t % 2 and its V in V buffer t % 3; "full" ones
// complete when the producer's copies of a tile (or Q) have landed, "empty" ones when every
// computing thread is done with a buffer. ``sink`` takes the arrivals of the first tile's
// product against the zero tile, which frees no buffer.
struct Barriers {
    u64 full_k[2], empty_k[2], full_v[3], empty_v[3], full_q, sink;
};
