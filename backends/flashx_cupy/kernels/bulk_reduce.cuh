// TMA's bulk reductions (sm_90): the copy engine adds a contiguous float32 range of shared memory
// into global memory, element by element, unordered with other adds (as red.global.add is), so
// that one thread's instruction replaces a warpgroup's thousands of reductions. Both addresses are
// 16-byte aligned and the size a multiple of 16 bytes.
//
// The engine reads shared memory through the async proxy: the threads that write the range fence
// (fence.proxy.async) before the barrier after which one thread issues. The issuing thread commits
// its reductions as a bulk group, and the range may be written again once that thread's wait for
// the group's reads has returned and a barrier has told the writers.

__device__ __forceinline__ void bulk_reduce_add(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's bulk groups still read their shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
