// TMA (sm_90): bulk copies of a tensor's box from global into shared memory by one thread,
// described by a tensor map (TensorMap, written by flashx_cupy.tma) and counted in bytes on an
// mbarrier (mbarrier.cuh's); after wgmma.cuh.
//
// The maps of 16-bit tensors take the 128-byte swizzle and boxes of 64 columns (128 bytes): a box
// row's 16-byte chunk k lands at chunk k ^ (row % 8) of its 128-byte row, the pattern keyed to the
// address from a 1024-byte boundary, which is one 64-column panel of a Swizzle128 tile
// (copies.cuh). Elements outside the map (rows past its last, columns past the head dim) land as
// zeros. The copies write through the async proxy, as wgmma reads: once the mbarrier's phase
// completes, the waiting threads and their products read the bytes without a fence.

// A tensor map (the driver's CUtensorMap): 128 opaque bytes that cuTensorMapEncodeTiled writes on
// the host, read by the copies where they arrive, in a ``__grid_constant__`` kernel parameter (one
// that the kernel reads in place, so that it keeps its 64-byte alignment and has an address).
struct alignas(64) TensorMap {
    u64 opaque[16];
};

// The box of a rank-4 map at coordinates (c0, c1, c2, c3), innermost first, into shared address
// ``dst``; its bytes count on ``bar``. The map is read where it lies, in parameter memory.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, int c0, int c1, int c2, int c3, u64* bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar)) : "memory");
}

// Rows [row, row + ROWS) of head ``head`` of sequence ``b`` from a (features, heads, rows,
// sequences) map of 16-bit elements into a Swizzle128<ROWS> tile of COLS columns, a box per
// 64-column panel: ROWS * COLS * 2 bytes on ``bar``, zeros included.
template <int ROWS, int COLS>
__device__ __forceinline__ void tma_load_tile(elem_t* s, const TensorMap* map, int head, int row, int b, u64* bar) {
#pragma unroll
    for (int c = 0; c < COLS; c += 64) tma_load_4d(smem_addr(s) + Swizzle128<ROWS>::offset(0, c), map, c, head, row, b, bar);
}
