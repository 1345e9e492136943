// The forward on Hopper's warpgroup products (wgmma, sm_90a), for 16-bit problems; forward.cuh
// has the CTA's schedule, softmax and epilogue. A CTA is WARPS / 4 computing warpgroups of 64
// query rows and one producer warpgroup (PRODUCER_THREADS) that only copies: Q once, then each
// key tile's K and V by cp.async into rings of two K and three V buffers, announced on mbarriers
// ("full") once landed; the computing warpgroups free a buffer ("empty") once the product reading
// it is done. No barrier of the whole CTA stands in the loop, so the two computing warpgroups
// need not wait for each other, and the producer takes 40 registers (setmaxnreg) so that they may
// take 232. All tiles lie in wgmma's 128-byte swizzle (Swizzle128), which serves S = Q K^T with
// both operands K-major from shared memory, and O += P V with P from registers and V "MN-major"
// (rows are keys, the product's K dimension).
//
// wgmma's m64nN accumulator gives warp w of a warpgroup rows 16w .. 16w + 15 in the m16n8 atom
// layout of mma.sync, and its A operand from registers takes mma.sync's A fragments: the scores
// turn into P's fragments in registers, as in forward.cu.
//
// The products, their fences and the barriers are wgmma.cuh's.

#define PRODUCER_THREADS 128  // one warpgroup that only copies Q, K and V (variants.PRODUCER_WARPS)
#include "forward.cuh"
#include "wgmma.cuh"

static_assert(TENSOR_CORES && ATOMS == 1 && WARPS % 4 == 0, "one 16-row atom per warp, whole warpgroups");
static_assert(BLOCK_N % 64 == 0 && (BLOCK_N == 64 || BLOCK_N == 128) && (DIM_V == 64 || DIM_V == 128),
              "the products' N: 64 or 128");

// The CTA's barriers: tile t's K lies in K buffer t % 2 and its V in V buffer t % 3; "full" ones
// complete when the producer's copies of a tile (or Q) have landed, "empty" ones when every
// computing thread is done with a buffer. ``sink`` takes the arrivals of the first tile's
// product against the zero tile, which frees no buffer.
struct Barriers {
    u64 full_k[2], empty_k[2], full_v[3], empty_v[3], full_q, sink;
};

// The producer warpgroup (threads THREADS .. THREADS + PRODUCER_THREADS - 1): the computing
// threads' schedule of key tiles (attend_key_tiles), each tile's K and V copied by cp.async into
// the buffers once they are free, and announced once landed. A tile is announced after the next
// one is requested, so that a tile's copies are always in flight.
struct ProducerSm90 : ForwardRows {
    const elem_t *k, *v;
    elem_t *sK, *sV;
    Barriers* bars;
    int tid;            // 0 .. PRODUCER_THREADS - 1
    int buf;            // the schedule's; the buffers follow the tile count
    int requested = 0, announced = 0;

    __device__ __forceinline__ void load_kv(int n) {
        const int t = requested++;
        if (n < end) {
            if (t >= 2) bar_wait(&bars->empty_k[t % 2], (t / 2 - 1) & 1);
            load_tile<BLOCK_N, DIM_QK, Swizzle128<BLOCK_N>, PRODUCER_THREADS>(
                sK + t % 2 * BLOCK_N * DIM_QK, k, p.k_n, p.k_d, n, s.len_k, p.head_dim, tid);
            if (t >= 3) bar_wait(&bars->empty_v[t % 3], (t / 3 - 1) & 1);
            load_tile<BLOCK_N, DIM_V, Swizzle128<BLOCK_N>, PRODUCER_THREADS>(
                sV + t % 3 * BLOCK_N * DIM_V, v, p.v_n, p.v_d, n, s.len_k, p.head_dim_v, tid);
        }
        cp_async_commit();
    }

    template <bool MASKED>
    __device__ __forceinline__ void attend(int, int next) {
        load_kv(next);
        cp_async_wait<1>();  // this tile's copies (and Q's, with the first)
        fence_proxy_async();
        const int t = announced++;
        if (t == 0) bar_arrive(&bars->full_q);
        bar_arrive(&bars->full_k[t % 2]);
        bar_arrive(&bars->full_v[t % 3]);
    }

    __device__ __forceinline__ void finish() {
        if (announced == 0) {  // no key tile: Q alone
            cp_async_wait<0>();
            fence_proxy_async();
            bar_arrive(&bars->full_q);
        }
    }
};

// The computing threads' rows with their products; q_desc: the warpgroup's 64 rows of Q.
//
// A tile's P V is issued after the next tile's S, so that it runs beside that tile's softmax;
// the output's rescale waits for it. The first tile owes a product too, P = 0 against a tile of
// zeros (start_owed): with a branch between a product's issue and its wait, ptxas would wait for
// every product at the branch's end. Each tile waits for its K and the owed V before its
// products, and frees each buffer once the product reading it is done.
struct ForwardCtaSm90 : ForwardRows {
    elem_t *sK, *sV;
    Barriers* bars;
    u64 q_desc;
    int buf;                          // the schedule's; the buffers follow the tile count
    int tiles = 0;                    // key tiles attended
    const elem_t* v_owed;             // the V tile whose product with pf is not yet issued
    u64 *owed_full, *owed_empty;      // its barriers, and the parity of its "full" phase
    u32 owed_parity;
    u32 pf[BLOCK_N / 16][4];          // P of that tile, as the A fragments of 16 keys each
    // Output elements an allowed pair poisons with a non-finite V (bit nt * 4 + e of acc[0][nt][e]),
    // made NaN by finish, so that the rare path leaves the accumulators alone.
    u64 poisoned = 0;

    __device__ __forceinline__ void load_kv(int) {}  // the producer's

    __device__ __forceinline__ void start_owed(const elem_t* zeros) {
        v_owed = zeros;
        owed_full = &bars->full_q, owed_parity = 0, owed_empty = &bars->sink;
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

    // The key tile at n (the schedule's next is the producer's business).
    template <bool MASKED>
    __device__ __forceinline__ void attend(int n, int) {
        const int t = tiles++;
        bar_wait(&bars->full_k[t % 2], (t / 2) & 1);
        bar_wait(owed_full, owed_parity);
        const elem_t* k_tile = sK + t % 2 * BLOCK_N * DIM_QK;
        elem_t* v_tile = sV + t % 3 * BLOCK_N * DIM_V;

        float sc[ATOMS][BLOCK_N / 8][4];
        const u64 k_desc = wgmma_desc(smem_addr(k_tile), 16);
        wgmma_fence();
        wgmma_ss<BLOCK_N, false>(sc[0], q_desc, k_desc);
#pragma unroll
        for (int kk = 1; kk < DIM_QK / 16; ++kk)
            wgmma_ss<BLOCK_N, true>(sc[0], q_desc + desc_step<BLOCK_M>(0, 16 * kk), k_desc + desc_step<BLOCK_N>(0, 16 * kk));
        wgmma_commit();
        issue_pv();
        wgmma_wait<1>();  // S; the owed product runs on
        fence_registers<BLOCK_N>(sc[0]);
        bar_arrive(&bars->empty_k[t % 2]);

        float alpha[ATOMS][2];
        softmax<MASKED, true>(sc, n, alpha);
        wgmma_wait<0>();
        fence_registers<DIM_V>(acc[0]);
        bar_arrive(owed_empty);
        rescale(alpha);

        if constexpr (MASKED) {  // some pair of the tile reads no V
            bar_wait(&bars->full_v[t % 3], (t / 3) & 1);
            // Which elements are not finite is a question of the whole tile, its layout aside.
            if (tile_nonfinite<BLOCK_N, DIM_V, DIM_V>(v_tile)) {
#pragma unroll 1
                for (int j0 = 0; j0 < BLOCK_N; j0 += 64)  // poison_allowed takes 64 keys at a time
                    poison_allowed<ATOMS, 64, DIM_V, Swizzle128<BLOCK_N>>(
                        [&](int r, int j) { return reads_v<MASKED>(wrow + r, n + j0 + j); },
                        v_tile + Swizzle128<BLOCK_N>::offset(j0, 0) / (int)sizeof(elem_t),
                        [this](int, int nt, int e) { poisoned |= 1ull << (nt * 4 + e); });
                compute_sync();
                clear_nonfinite<BLOCK_N, DIM_V, DIM_V>(v_tile);
                fence_proxy_async();
                compute_sync();  // every thread's clearing before either warpgroup's product
            }
        }

        to_fragments<BLOCK_N>(sc[0], pf);
        v_owed = v_tile;
        owed_full = &bars->full_v[t % 3], owed_parity = (t / 3) & 1, owed_empty = &bars->empty_v[t % 3];
    }

    // The last tile's product and the poisoned outputs; then every computing thread is done with
    // Q and K, which O's staging overlies (not V).
    __device__ __forceinline__ void finish() {
        bar_wait(owed_full, owed_parity);
        wgmma_fence();
        issue_pv();
        wgmma_wait<0>();
        fence_registers<DIM_V>(acc[0]);
#pragma unroll
        for (int i = 0; i < DIM_V / 2; ++i)
            if (poisoned >> i & 1) acc[0][i / 4][i % 4] = QUIET_NAN;
        compute_sync();
    }
};

extern "C" __global__ void __launch_bounds__(THREADS + PRODUCER_THREADS, 1) flashx_forward_sm90(const Params p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    elem_t* sQ = (elem_t*)smem;                // Swizzle128<BLOCK_M>: BLOCK_M x DIM_QK
    elem_t* sK = sQ + BLOCK_M * DIM_QK;        // 2 x Swizzle128<BLOCK_N>: BLOCK_N x DIM_QK
    elem_t* sV = sK + 2 * BLOCK_N * DIM_QK;    // 3 x Swizzle128<BLOCK_N>: BLOCK_N x DIM_V
    elem_t* sZero = sV + 3 * BLOCK_N * DIM_V;  // BLOCK_N x DIM_V zeros
    Barriers* bars = (Barriers*)(sZero + BLOCK_N * DIM_V);
    elem_t* sO = (elem_t*)smem;                // BLOCK_M x LD_V, over Q and K once the loop is done
    static_assert(BLOCK_M * LD_V <= (BLOCK_M + 2 * BLOCK_N) * DIM_QK, "O's staging must fit below V");

    int tile, h, b;
    grid_tile(p.tiles_m, p.heads_q, tile, h, b);
    const int hk = h / p.group;
    const Sequence s = sequence(p, b);
    const elem_t* k = (const elem_t*)p.k + row_offset(b, s.start_k, 0, hk, p.k_b, p.k_n, p.k_h);
    const elem_t* v = (const elem_t*)p.v + row_offset(b, s.start_k, 0, hk, p.v_b, p.v_n, p.v_h);
    ForwardRows rows{p, s, h, b, tile * BLOCK_M, 0};
    if (!rows.start()) return;

    if (threadIdx.x == 0) {
        for (int i = 0; i < 2; ++i) bar_init(&bars->full_k[i], PRODUCER_THREADS), bar_init(&bars->empty_k[i], THREADS);
        for (int i = 0; i < 3; ++i) bar_init(&bars->full_v[i], PRODUCER_THREADS), bar_init(&bars->empty_v[i], THREADS);
        bar_init(&bars->full_q, PRODUCER_THREADS);
        bar_init(&bars->sink, THREADS);
    }
    for (int i = threadIdx.x; i < BLOCK_N * DIM_V / CHUNK; i += THREADS + PRODUCER_THREADS) ((uint4*)sZero)[i] = make_uint4(0, 0, 0, 0);
    fence_proxy_async();
    __syncthreads();

    if (threadIdx.x >= THREADS) {  // the producer, with few registers, so that the others may take more
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        ProducerSm90 producer{{p, s, h, b, tile * BLOCK_M, 0}, k, v, sK, sV, bars, (int)threadIdx.x - THREADS};
        producer.start();
        const elem_t* q = (const elem_t*)p.q + row_offset(b, s.start_q, 0, h, p.q_b, p.q_n, p.q_h);
        load_tile<BLOCK_M, DIM_QK, Swizzle128<BLOCK_M>, PRODUCER_THREADS>(sQ, q, p.q_n, p.q_d, producer.m0, s.len_q, p.head_dim, producer.tid);
        cp_async_commit();
        attend_key_tiles(producer);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int warp = threadIdx.x / 32;
    ForwardCtaSm90 cta{{p, s, h, b, tile * BLOCK_M, warp * 16}, sK, sV, bars,
                       wgmma_desc(smem_addr(sQ), 16) + desc_step<BLOCK_M>(warp / 4 * 64, 0)};
    cta.start();
    cta.start_owed(sZero);
    bar_wait(&bars->full_q, 0);
    attend_key_tiles(cta);
    cta.store(sO);
}
