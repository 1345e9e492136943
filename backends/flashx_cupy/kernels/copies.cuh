// Copies into shared memory: its 32-bit addresses, cp.async, ldmatrix, and the tiles' layouts and
// loads.

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Shared memory is addressed by 32-bit offsets in the shared window, each taken once per tile:
// the products' constant offsets then fold into the instructions, where 64-bit generic pointers
// would cost several integer instructions per access.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    // src-size 0 fills the 16 bytes with zeros without reading src.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

#if TENSOR_CORES
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
#endif

// Tiles in shared memory. A layout places element (r, c) of a tile at byte ``offset(r, c)``;
// ``offset(r + PERIOD, c) = offset(r, c) + PERIOD * ROW_BYTES``, so that a copy loop advances by
// a constant.

// Rows LD elements apart: the mma.sync products' layout (the padding spreads ldmatrix's rows over
// the banks).
template <int LD>
struct Padded {
    static constexpr int ROW_BYTES = LD * (int)sizeof(elem_t), PERIOD = 1;
    static __device__ __forceinline__ int offset(int r, int c) { return (r * LD + c) * (int)sizeof(elem_t); }
    static __device__ __forceinline__ elem_t& at(elem_t* s, int r, int c) { return s[r * LD + c]; }
    static __device__ __forceinline__ elem_t at(const elem_t* s, int r, int c) { return s[r * LD + c]; }
};

#if TENSOR_CORES
// wgmma's 128-byte swizzle, for 16-bit elements: the tile's columns in panels of 64 (128 bytes a
// row), panel after panel of ROWS rows each; the 16-byte chunk k of row r lies at chunk k ^ (r % 8)
// of its row. The same bytes serve wgmma as a K-major operand (rows are M or N, columns K: Q, K)
// and as an MN-major one (rows are K, columns N: V); the swizzle is a function of the address
// bits, so a tile starts on a 1024-byte boundary.
template <int ROWS>
struct Swizzle128 {
    static constexpr int ROW_BYTES = 128, PERIOD = 8;
    static __device__ __forceinline__ int offset(int r, int c) {
        return c / 64 * ROWS * 128 + r * 128 + ((c / 8 % 8) ^ (r % 8)) * 16 + c % 8 * 2;
    }
    static __device__ __forceinline__ elem_t& at(elem_t* s, int r, int c) { return *(elem_t*)((char*)s + offset(r, c)); }
    static __device__ __forceinline__ elem_t at(const elem_t* s, int r, int c) {
        return *(const elem_t*)((const char*)s + offset(r, c));
    }
};
#endif

// Rows [row0, row0 + ROWS) of one head's (length, width) matrix at ``base`` (its row 0) into a
// tile in ``Layout``, zero at rows >= rows_valid and columns >= width, so padding and the columns
// past the head dim are never read; by the GROUP threads numbered tid = 0 .. GROUP - 1.
template <int ROWS, int COLS, typename Layout, int GROUP = THREADS>
__device__ __forceinline__ void load_tile(elem_t* s, const elem_t* base, i64 row_stride, i64 col_stride, int row0,
                                          int rows_valid, int width, int tid = threadIdx.x) {
    if constexpr (ALIGNED) {
        // Each thread copies one 16-byte column chunk of every STEP-th row.
        constexpr int PER_ROW = COLS / CHUNK, STEP = GROUP / PER_ROW;
        static_assert(GROUP % PER_ROW == 0, "a thread keeps its column");
        if constexpr (STEP % Layout::PERIOD != 0) {
            // Too few threads to keep a thread's rows a period apart (a swizzled tile of 256 columns by
            // 128 threads): each half of the columns in turn, a tile of whole 64-column panels of its own.
            constexpr int HALF = COLS / 2;
            static_assert(HALF % 64 == 0, "the halves are whole panels");
            load_tile<ROWS, HALF, Layout, GROUP>(s, base, row_stride, col_stride, row0, rows_valid, width, tid);
            load_tile<ROWS, HALF, Layout, GROUP>((elem_t*)((char*)s + Layout::offset(0, HALF)), base + HALF, row_stride,
                                                 col_stride, row0, rows_valid, width - HALF, tid);
            return;
        }
        const int c = tid % PER_ROW * CHUNK, r0 = tid / PER_ROW;
        const elem_t* src = base + (i64)(row0 + r0) * row_stride + c;
        const i64 src_step = STEP * row_stride;
        const u32 dst = smem_addr(s) + Layout::offset(r0, c);
        const int rows_left = c < width ? rows_valid - row0 - r0 : 0;  // rows of this thread's column to read
#pragma unroll
        for (int i = 0; i < (ROWS + STEP - 1) / STEP; ++i, src += src_step) {
            if (ROWS % STEP != 0 && r0 + i * STEP >= ROWS) break;
            const bool valid = i * STEP < rows_left;
            cp_async16(dst + i * STEP * Layout::ROW_BYTES, valid ? src : base, valid);
        }
    } else {
        for (int idx = tid; idx < ROWS * COLS; idx += GROUP) {
            const int r = idx / COLS, c = idx % COLS;
            const bool valid = row0 + r < rows_valid && c < width;
            Layout::at(s, r, c) = valid ? base[(i64)(row0 + r) * row_stride + c * col_stride] : from_float(0.f);
        }
    }
}
