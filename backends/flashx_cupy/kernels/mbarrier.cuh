// mbarriers in shared memory and the async proxy's 1-D bulk copies that complete on them (sm_90);
// after common.cuh. The wgmma kernels (through wgmma.cuh) and the decoding kernel (BULK) build
// on them.
//
// A phase of an mbarrier completes once ``count`` threads have arrived and every byte announced to
// it (bar_arrive_expect_bytes) has landed; arrive releases and the wait acquires, at CTA scope. A
// bulk copy writes shared memory through the async proxy, and its bytes count on the mbarrier it
// names: once the phase completes, the waiting threads read them without a fence. Shared memory
// that threads wrote (the generic proxy) and a bulk copy later overwrites is fenced by each writer
// (fence_proxy_async) before the barrier after which the copy is issued.

__device__ __forceinline__ void bar_init(u64* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(u64* bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}" ::"r"(smem_addr(bar)) : "memory");
}
// Arrives on the mbarrier and raises its current phase's expected bytes by ``bytes``: the phase
// completes once the arrivals and the bytes are all in.
__device__ __forceinline__ void bar_arrive_expect_bytes(u64* bar, u32 bytes) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}"
                 ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// Until the phase of the given parity has completed (the phase before the first completes at once).
__device__ __forceinline__ void bar_wait(u64* bar, u32 parity) {
    asm volatile("{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT;\n}"
                 ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

// Orders this thread's generic-proxy accesses of shared memory before async-proxy ones (bulk
// copies, TMA, wgmma's operand reads) that follow a barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ``bytes`` contiguous bytes from global ``src`` into shared address ``dst`` (both 16-byte aligned,
// a multiple of 16 bytes), counted on ``bar``.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
