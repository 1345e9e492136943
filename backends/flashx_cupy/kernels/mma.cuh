// The warp-level products: mma.sync.m16n8k16 and the two tile products built on it (IEEE fma
// from shared memory for float32).

#if TENSOR_CORES
__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if DTYPE == 0
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// The two tile products. Each warp owns MT atoms of 16 rows: rows [16 * MT * warp, 16 * MT * (warp + 1))
// of the resident operand.

// C[MT][N / 8] += A[rows of this warp][0:K] * B[0:N][0:K]^T, A and B row-major in shared memory.
template <int MT, int N, int K, int LDA, int LDB>
__device__ __forceinline__ void gemm_abt(float (&c)[MT][N / 8][4], const elem_t* a, const elem_t* b) {
    const int lane = threadIdx.x % 32;
#if TENSOR_CORES
    const u32 a_lane = smem_addr(a + (lane % 16) * LDA + (lane / 16) * 8);
    const u32 b_lane = smem_addr(b + (lane % 8 + (lane / 16) * 8) * LDB + ((lane / 8) % 2) * 8);
#pragma unroll
    for (int kk = 0; kk < K; kk += 16) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], a_lane + sizeof(elem_t) * (mt * 16 * LDA + kk));
#pragma unroll
        for (int nt = 0; nt < N / 8; nt += 2) {
            u32 bf[4];
            ldmatrix_x4(bf, b_lane + sizeof(elem_t) * (nt * 8 * LDB + kk));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(c[mt][nt], af[mt], bf[0], bf[1]);
                mma16816(c[mt][nt + 1], af[mt], bf[2], bf[3]);
            }
        }
    }
#else
    const int g = lane / 4, t = lane % 4;
#pragma unroll 4
    for (int kk = 0; kk < K; ++kk) {
        float lo[MT], hi[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            lo[mt] = a[(mt * 16 + g) * LDA + kk];
            hi[mt] = a[(mt * 16 + g + 8) * LDA + kk];
        }
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt) {
            const float b0 = b[(nt * 8 + 2 * t) * LDB + kk], b1 = b[(nt * 8 + 2 * t + 1) * LDB + kk];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                c[mt][nt][0] = fmaf(lo[mt], b0, c[mt][nt][0]);
                c[mt][nt][1] = fmaf(lo[mt], b1, c[mt][nt][1]);
                c[mt][nt][2] = fmaf(hi[mt], b0, c[mt][nt][2]);
                c[mt][nt][3] = fmaf(hi[mt], b1, c[mt][nt][3]);
            }
        }
    }
#endif
}

// C[MT][N / 8] += A * B[0:K][0:N], A (this warp's rows x K) given in accumulator layout in
// registers, B row-major in shared memory. The float32 path stages A in ``stage`` (this warp's
// 16 * MT rows of K floats).
template <int MT, int K, int N, int LDB>
__device__ __forceinline__ void gemm_areg(float (&c)[MT][N / 8][4], const float (&a)[MT][K / 8][4], const elem_t* b,
                                          float* stage) {
    const int lane = threadIdx.x % 32;
#if TENSOR_CORES
    const u32 b_lane = smem_addr(b + (lane % 8 + ((lane / 8) % 2) * 8) * LDB + (lane / 16) * 8);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            af[mt][0] = pack2(a[mt][2 * kk][0], a[mt][2 * kk][1]);
            af[mt][1] = pack2(a[mt][2 * kk][2], a[mt][2 * kk][3]);
            af[mt][2] = pack2(a[mt][2 * kk + 1][0], a[mt][2 * kk + 1][1]);
            af[mt][3] = pack2(a[mt][2 * kk + 1][2], a[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int nt = 0; nt < N / 8; nt += 2) {
            u32 bf[4];
            ldmatrix_x4_trans(bf, b_lane + sizeof(elem_t) * (kk * 16 * LDB + nt * 8));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(c[mt][nt], af[mt], bf[0], bf[1]);
                mma16816(c[mt][nt + 1], af[mt], bf[2], bf[3]);
            }
        }
    }
#else
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < K / 8; ++nt) {
            stage[(mt * 16 + g) * K + nt * 8 + 2 * t] = a[mt][nt][0];
            stage[(mt * 16 + g) * K + nt * 8 + 2 * t + 1] = a[mt][nt][1];
            stage[(mt * 16 + g + 8) * K + nt * 8 + 2 * t] = a[mt][nt][2];
            stage[(mt * 16 + g + 8) * K + nt * 8 + 2 * t + 1] = a[mt][nt][3];
        }
    __syncwarp();
#pragma unroll 4
    for (int kk = 0; kk < K; ++kk) {
        float lo[MT], hi[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            lo[mt] = stage[(mt * 16 + g) * K + kk];
            hi[mt] = stage[(mt * 16 + g + 8) * K + kk];
        }
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt) {
            const float b0 = b[kk * LDB + nt * 8 + 2 * t], b1 = b[kk * LDB + nt * 8 + 2 * t + 1];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                c[mt][nt][0] = fmaf(lo[mt], b0, c[mt][nt][0]);
                c[mt][nt][1] = fmaf(lo[mt], b1, c[mt][nt][1]);
                c[mt][nt][2] = fmaf(hi[mt], b0, c[mt][nt][2]);
                c[mt][nt][3] = fmaf(hi[mt], b1, c[mt][nt][3]);
            }
        }
    }
    __syncwarp();
#endif
}

#if TENSOR_CORES
// C[MT][N / 8] += A * B[0:K][0:N], A given transposed: A^T (K x this warp's rows) and B row-major in
// shared memory; ldmatrix.trans turns A^T's 8 x 8 blocks into A fragments.
template <int MT, int N, int K, int LDA, int LDB>
__device__ __forceinline__ void gemm_atb(float (&c)[MT][N / 8][4], const elem_t* at, const elem_t* b) {
    const int lane = threadIdx.x % 32;
    const u32 a_lane = smem_addr(at + (lane % 8 + (lane / 16) * 8) * LDA + ((lane / 8) % 2) * 8);
    const u32 b_lane = smem_addr(b + (lane % 8 + ((lane / 8) % 2) * 8) * LDB + (lane / 16) * 8);
#pragma unroll
    for (int kk = 0; kk < K; kk += 16) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4_trans(af[mt], a_lane + sizeof(elem_t) * (kk * LDA + mt * 16));
#pragma unroll
        for (int nt = 0; nt < N / 8; nt += 2) {
            u32 bf[4];
            ldmatrix_x4_trans(bf, b_lane + sizeof(elem_t) * (kk * LDB + nt * 8));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(c[mt][nt], af[mt], bf[0], bf[1]);
                mma16816(c[mt][nt + 1], af[mt], bf[2], bf[3]);
            }
        }
    }
}

// Adds x to a float in global memory, unordered.
__device__ __forceinline__ void reduce_add(float* dst, float x) {
    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;" ::"l"(dst), "f"(x) : "memory");
}

// Adds (lo, hi) to two adjacent floats, as one vector reduction where sm_90 has it.
__device__ __forceinline__ void reduce_add_pair(float* dst, float lo, float hi) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(lo), "f"(hi) : "memory");
#else
    reduce_add(dst, lo);
    reduce_add(dst + 1, hi);
#endif
}
#endif

// Row (0 .. 16 * MT) and column of element e of atom (mt, nt) of this lane.
__device__ __forceinline__ int frag_row(int mt, int e) { return mt * 16 + (threadIdx.x % 32) / 4 + (e >= 2 ? 8 : 0); }
__device__ __forceinline__ int frag_col(int nt, int e) { return nt * 8 + 2 * (threadIdx.x % 4) + (e & 1); }

// The online softmax's step for a row meeting a new key tile whose scores this lane's columns max
// to ``lane_max`` (the row's quad of lanes shares the max): the row's max moves and its sum is
// rescaled. Returns the shift of the tile's exponents, 0 for a row with no allowed key so far, so
// that exp2(-inf) gives 0, not NaN; ``alpha`` is the move's factor, which the output owes too.
//
// LAZY moves the max only when the tile's exceeds it by more than STALE_MAX_LOG2 (FA4's rule), so
// that most tiles past the first leave it, and with it the output, as they are (alpha exactly 1).
// The max is then only a reference: the weights 2^(s - max) reach at most 2^STALE_MAX_LOG2, which
// float32 sums and 16-bit weights hold with the same relative rounding, and the output and the
// LSE are taken against the same reference, so neither changes but by rounding (forward.cuh's
// LAZY_MAX says why e4m3 weights keep the exact max).
constexpr float STALE_MAX_LOG2 = 8.f;

template <bool LAZY = false>
__device__ __forceinline__ float move_row_max(float& row_max, float& row_sum, float lane_max, float& alpha) {
    float mx = fmaxf(lane_max, __shfl_xor_sync(0xffffffffu, lane_max, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = LAZY ? (mx > row_max + STALE_MAX_LOG2 ? mx : row_max) : fmaxf(row_max, mx);
    const float m_ref = m_new == NEG_INF ? 0.f : m_new;
    alpha = exp2f(row_max - m_ref);
    row_max = m_new;
    row_sum *= alpha;
    return m_ref;
}

template <int MT, int N>
__device__ __forceinline__ void zero(float (&c)[MT][N / 8][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[mt][nt][e] = 0.f;
}
