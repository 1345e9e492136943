// The forward on Hopper's warpgroup products (wgmma, sm_90a), for 16-bit problems; forward.cuh
// has the CTA's schedule, softmax and epilogue. A CTA is WARPS / 4 warpgroups of 64 query rows.
// Q stays in shared memory; K and V tiles stream through shared buffers (two for K, three for V),
// requested by cp.async one tile ahead as separate groups (K, then V), like forward.cu. All lie in
// wgmma's 128-byte swizzle (Swizzle128), which serves S = Q K^T with both operands K-major from
// shared memory, and O += P V with P from registers and V "MN-major" (rows are keys, the
// product's K dimension).
//
// wgmma's m64nN accumulator gives warp w of a warpgroup rows 16w .. 16w + 15 in the m16n8 atom
// layout of mma.sync, and its A operand from registers takes mma.sync's A fragments: the scores
// turn into P's fragments in registers, as in forward.cu.
//
// Shared memory written by threads (cp.async, or the non-finite clearing) is read by wgmma
// through the async proxy: each writer fences (fence.proxy.async) before the barrier after which
// the products read. A product's registers are in flight from its issue to its wait_group; the
// register fences after each wait keep the compiler from reading them earlier.

#include "forward.cuh"

static_assert(TENSOR_CORES && ATOMS == 1 && WARPS % 4 == 0, "one 16-row atom per warp, whole warpgroups");
static_assert(BLOCK_N % 64 == 0 && (BLOCK_N == 64 || BLOCK_N == 128) && (DIM_V == 64 || DIM_V == 128),
              "the products' N: 64 or 128");

#if DTYPE == 0
#define WGMMA_TYPES ".f32.f16.f16"
#else
#define WGMMA_TYPES ".f32.bf16.bf16"
#endif

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

// D[64 x N] (+)= A[64 x 16] B[16 x N], A and B from shared memory, both K-major.
template <int N, bool ACCUMULATE>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], u64 a, u64 b) {
    if constexpr (N == 64)
        asm volatile("{\n.reg .pred acc;\nsetp.ne.b32 acc, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16" WGMMA_TYPES " " WGMMA_R32 ", %32, %33, acc, 1, 1, 0, 0;\n}"
                     : WGMMA_D32(d, 0)
                     : "l"(a), "l"(b), "n"((int)ACCUMULATE));
    else
        asm volatile("{\n.reg .pred acc;\nsetp.ne.b32 acc, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16" WGMMA_TYPES " " WGMMA_R64 ", %64, %65, acc, 1, 1, 0, 0;\n}"
                     : WGMMA_D32(d, 0), WGMMA_D32(d, 8)
                     : "l"(a), "l"(b), "n"((int)ACCUMULATE));
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
    else
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16" WGMMA_TYPES " " WGMMA_R64
                     ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;"
                     : WGMMA_D32(d, 0), WGMMA_D32(d, 8)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// A CTA's rows with its K/V stream and products; q_desc: its warpgroup's 64 rows of Q.
//
// A tile's P V is issued after the next tile's S, so that it runs beside that tile's softmax;
// the output's rescale waits for it. V therefore takes a ring of three buffers: while a tile's
// V is read late, the next one's lies ready and the one after loads. A tile's V is ready for
// its product once the next tile's K is (cp.async groups complete in order), so an unmasked
// tile waits at one barrier; a masked one waits for its V at a second, to clear V's non-finite
// elements first. The first tile owes a product too, P = 0 against the ring's third buffer
// cleared to zeros (start_owed): with a branch between a product's issue and its wait, ptxas
// would wait for every product at the branch's end.
struct ForwardCtaSm90 : ForwardRows {
    const elem_t *k, *v;
    elem_t *sK, *sV;
    u64 q_desc;
    int buf;                              // the K buffer of the tile being read; the other is loading
    int v_read = 0, v_write = 0;          // V's ring: the tile being read, the next request
    const elem_t* v_owed;                 // the V tile whose product with pf is not yet issued
    u32 pf[BLOCK_N / 16][4];              // P of that tile, as the A fragments of 16 keys each
    // Output elements an allowed pair poisons with a non-finite V (bit nt * 4 + e of acc[0][nt][e]),
    // made NaN by finish, so that the rare path leaves the accumulators alone.
    u64 poisoned = 0;

    // Requests the tile at n (none at end): two groups, K into the other K buffer, then V.
    __device__ __forceinline__ void load_kv(int n) {
        if (n < end) load_tile<BLOCK_N, DIM_QK, Swizzle128<BLOCK_N>>(sK + (buf ^ 1) * BLOCK_N * DIM_QK, k, p.k_n, p.k_d, n, s.len_k, p.head_dim);
        cp_async_commit();
        if (n < end) load_tile<BLOCK_N, DIM_V, Swizzle128<BLOCK_N>>(sV + v_write * BLOCK_N * DIM_V, v, p.v_n, p.v_d, n, s.len_k, p.head_dim_v);
        cp_async_commit();
        v_write = v_write == 2 ? 0 : v_write + 1;
    }

    // P = 0 against zeros, which ring slot 2 holds until the third tile loads into it.
    __device__ __forceinline__ void start_owed() {
        v_owed = sV + 2 * BLOCK_N * DIM_V;
        for (int i = threadIdx.x; i < BLOCK_N * DIM_V / CHUNK; i += THREADS) ((uint4*)v_owed)[i] = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) pf[kk][0] = pf[kk][1] = pf[kk][2] = pf[kk][3] = 0;
    }

    // Issues O += P V for the owed tile, as one wgmma group.
    __device__ __forceinline__ void issue_pv() {
        const u64 v_desc = wgmma_desc(smem_addr(v_owed), BLOCK_N * 128);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) wgmma_rs<DIM_V>(acc[0], pf[kk], v_desc + desc_step<BLOCK_N>(16 * kk, 0));
        wgmma_commit();
    }

    // The key tile at n, and the requests for the tile at next.
    template <bool MASKED>
    __device__ __forceinline__ void attend(int n, int next) {
        cp_async_wait<1>();  // K of this tile, and the owed tile's V
        fence_proxy_async();
        __syncthreads();  // ... for every thread; and every warpgroup is done with the buffers that load
        const elem_t* k_tile = sK + buf * BLOCK_N * DIM_QK;
        elem_t* v_tile = sV + v_read * BLOCK_N * DIM_V;

        float sc[ATOMS][BLOCK_N / 8][4];
        const u64 k_desc = wgmma_desc(smem_addr(k_tile), 16);
        wgmma_fence();
        wgmma_ss<BLOCK_N, false>(sc[0], q_desc, k_desc);
#pragma unroll
        for (int kk = 1; kk < DIM_QK / 16; ++kk)
            wgmma_ss<BLOCK_N, true>(sc[0], q_desc + desc_step<BLOCK_M>(0, 16 * kk), k_desc + desc_step<BLOCK_N>(0, 16 * kk));
        wgmma_commit();
        issue_pv();
        load_kv(next);  // its copies issue while the products run
        wgmma_wait<1>();  // S; the owed product runs on
        fence_registers<BLOCK_N>(sc[0]);

        float alpha[ATOMS][2];
        softmax<MASKED, true>(sc, n, alpha);
        wgmma_wait<0>();
        fence_registers<DIM_V>(acc[0]);
        rescale(alpha);

        if constexpr (MASKED) {  // some pair of the tile reads no V
            cp_async_wait<2>();  // V of this tile (the next tile's K and V may still be in flight)
            fence_proxy_async();
            __syncthreads();
            // Which elements are not finite is a question of the whole tile, its layout aside.
            if (tile_nonfinite<BLOCK_N, DIM_V, DIM_V>(v_tile)) {
#pragma unroll 1
                for (int j0 = 0; j0 < BLOCK_N; j0 += 64)  // poison_allowed takes 64 keys at a time
                    poison_allowed<ATOMS, 64, DIM_V, Swizzle128<BLOCK_N>>(
                        [&](int r, int j) { return reads_v<MASKED>(wrow + r, n + j0 + j); },
                        v_tile + Swizzle128<BLOCK_N>::offset(j0, 0) / (int)sizeof(elem_t),
                        [this](int, int nt, int e) { poisoned |= 1ull << (nt * 4 + e); });
                __syncthreads();
                clear_nonfinite<BLOCK_N, DIM_V, DIM_V>(v_tile);
                fence_proxy_async();
            }
        }

#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            pf[kk][0] = pack2(sc[0][2 * kk][0], sc[0][2 * kk][1]);
            pf[kk][1] = pack2(sc[0][2 * kk][2], sc[0][2 * kk][3]);
            pf[kk][2] = pack2(sc[0][2 * kk + 1][0], sc[0][2 * kk + 1][1]);
            pf[kk][3] = pack2(sc[0][2 * kk + 1][2], sc[0][2 * kk + 1][3]);
        }
        v_owed = v_tile;
        buf ^= 1;
        v_read = v_read == 2 ? 0 : v_read + 1;
    }

    // The last tile's product, once its V is ready for every thread, and the poisoned outputs.
    // O's staging overlies Q and K, which no product reads any more, not V.
    __device__ __forceinline__ void finish() {
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();
        wgmma_fence();
        issue_pv();
        wgmma_wait<0>();
        fence_registers<DIM_V>(acc[0]);
#pragma unroll
        for (int i = 0; i < DIM_V / 2; ++i)
            if (poisoned >> i & 1) acc[0][i / 4][i % 4] = QUIET_NAN;
    }
};

extern "C" __global__ void __launch_bounds__(THREADS, 1) flashx_forward_sm90(const Params p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    elem_t* sQ = (elem_t*)smem;              // Swizzle128<BLOCK_M>: BLOCK_M x DIM_QK
    elem_t* sK = sQ + BLOCK_M * DIM_QK;      // 2 x Swizzle128<BLOCK_N>: BLOCK_N x DIM_QK
    elem_t* sV = sK + 2 * BLOCK_N * DIM_QK;  // 3 x Swizzle128<BLOCK_N>: BLOCK_N x DIM_V
    elem_t* sO = (elem_t*)smem;              // BLOCK_M x LD_V, over Q and K once the loop is done
    static_assert(BLOCK_M * LD_V <= (BLOCK_M + 2 * BLOCK_N) * DIM_QK, "O's staging must fit below V");

    int tile, h, b;
    grid_tile(p.tiles_m, p.heads_q, tile, h, b);
    const int warp = threadIdx.x / 32;
    const int hk = h / p.group;
    const Sequence s = sequence(p, b);
    ForwardCtaSm90 cta{{p, s, h, b, tile * BLOCK_M, warp * 16},
                       (const elem_t*)p.k + row_offset(b, s.start_k, 0, hk, p.k_b, p.k_n, p.k_h),
                       (const elem_t*)p.v + row_offset(b, s.start_k, 0, hk, p.v_b, p.v_n, p.v_h),
                       sK, sV, wgmma_desc(smem_addr(sQ), 16) + desc_step<BLOCK_M>(warp / 4 * 64, 0)};
    if (!cta.start()) return;

    const elem_t* q = (const elem_t*)p.q + row_offset(b, s.start_q, 0, h, p.q_b, p.q_n, p.q_h);
    load_tile<BLOCK_M, DIM_QK, Swizzle128<BLOCK_M>>(sQ, q, p.q_n, p.q_d, cta.m0, s.len_q, p.head_dim);
    cta.start_owed();  // its writes reach wgmma through the first tile's fence and barrier
    attend_key_tiles(cta);
    cta.store(sO);
}
