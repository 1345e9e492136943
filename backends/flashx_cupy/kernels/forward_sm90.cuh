// The forward on Hopper's warpgroup products (wgmma, sm_90a), for either element type: the CTA and
// the kernel that forward_sm90.cu (16-bit q, k, v) and forward_fp8_sm90.cu (float8_e4m3fn) build.
// Each includes it last, after forward.cuh (with PRODUCER_THREADS) and wgmma.cuh, and after
// defining ``struct Operands``, what differs between the element types, and FORWARD_SM90, the
// kernel's name (variants.ENTRY_POINTS). forward.cuh has the CTA's schedule, softmax and
// epilogue, wgmma.cuh the products' operands, fences and mbarriers.
//
// A CTA is WARPS / 4 computing warpgroups of 64 query rows and one producer warpgroup
// (PRODUCER_THREADS) that only copies: Q once, then each key tile's K and V, by cp.async or by TMA
// (Operands::TMA_KV), into rings of two K and Operands::V_RING V buffers, announced on mbarriers
// ("full") once landed; the computing warpgroups free a buffer ("empty") once the product reading
// it is done. No barrier of the whole CTA stands in the loop, so the computing warpgroups need not
// wait for each other, and the producer takes few registers (setmaxnreg) so that they may take
// more (PRODUCER_REGISTERS). All tiles lie in wgmma's 128-byte swizzle (Swizzle128); S = Q K^T
// takes both operands K-major from shared memory, and O += P V takes P from registers.
//
// wgmma's m64nN accumulator gives warp w of a warpgroup rows 16w .. 16w + 15 in the m16n8 atom
// layout of mma.sync, so each lane packs P's register operand from its own scores.
//
// Shared memory written by threads (cp.async, or the non-finite clearing) is read by wgmma
// through the async proxy: each writer fences (fence.proxy.async) before the barrier (mbarrier or
// named) after which the products read; TMA writes through the async proxy itself. A product's
// registers are in flight from its issue to its wait_group; the register fences after each wait
// keep the compiler from reading them earlier.
//
// Operands' static members:
//   In                           the inputs' element type in global memory
//   Q_TILE, K_TILE, V_TILE       a tile's size in elem_t (multiples of 1024 bytes: the swizzle's)
//   PRODUCT_K                    the products' K: Q's and K's columns in S, keys in P V, per instruction
//   ss<N, ACCUMULATE>, rs<N>     S's product (both operands in shared memory), P V's (A in registers)
//   v_desc(v), v_step(kk)        a V tile's descriptor in P V, and its step to the keys of k-step kk
//   pack(a, s, kk)               P's keys of k-step kk as the register operand
//   load_rows<ROWS>              Q's and K's copies into a tile; v_at, load_v V's
//   TMA_KV                       whether K's and V's tiles come by TMA (the kernel's KvMaps), not load_rows and load_v
//   V_RING                       the V buffers: 3, or 2 with the zeros in the ring (ZEROS_IN_RING)
//   scaled(p, copy, b, hk)       the Params that the rows read (FP8: the descales folded in)
//   nonfinite, poison, clear     a masked tile's V values that would make 0 * V NaN (exact.cuh)
// Operands is the includer's struct rather than a template parameter of a body that two entries
// call: that call, inlined, renumbers the PTX's registers, and the PTX compared across a refactor
// should differ only where the code does.

#include "tma.cuh"

static_assert(TENSOR_CORES && ATOMS == 1 && WARPS % 4 == 0, "one 16-row atom per warp, whole warpgroups");

// setmaxnreg's split of the SM's 64K registers (one CTA an SM): the producer keeps 40 where the
// computing threads' 232 hold two warpgroups' S of 128 keys, or O at d256 beside S of 80 (FA3's 24
// and 240 there spill the producer's cp.async of a short sequence's last tile); elsewhere it takes
// FA3's 24, which leaves 240 for S of 176 keys, or 160 for a third computing warpgroup.
enum {
    PRODUCER_REGISTERS = (BLOCK_N == 128 || BLOCK_N == 80) && THREADS == 256 ? 40 : 24,
    COMPUTE_REGISTERS = (65536 - PRODUCER_REGISTERS * PRODUCER_THREADS) / THREADS / 8 * 8
};

// V's ring. The first tile's product is owed against a tile of zeros (ForwardCtaSm90); with three
// buffers it has a tile of its own. Where only two fit beside Q and K, the zeros lie in the last
// buffer as tile -1, whose product frees it for tile 1 as any tile's frees its buffer. Two buffers
// take TMA: by cp.async the producer announces a tile only after requesting the next, whose V
// buffer the computing threads free only after that announcement.
enum { V_RING = Operands::V_RING, ZEROS_IN_RING = V_RING == 2 };
static_assert(V_RING == 3 || (ZEROS_IN_RING && Operands::TMA_KV), "three V buffers, or two by TMA");

// The CTA's barriers: tile t's K lies in K buffer t % 2 and its V in V buffer t % V_RING; "full"
// ones complete when the producer's copies of a tile (or Q) have landed, "empty" ones when every
// computing thread is done with a buffer. ``sink`` takes the arrivals of the first tile's
// product against a zero tile of its own, which frees no buffer. By TMA, one producer thread
// arrives on a tile's "full" barriers (FULL_KV_ARRIVALS), with the bytes to land; by cp.async,
// every one.
enum { FULL_KV_ARRIVALS = Operands::TMA_KV ? 1 : PRODUCER_THREADS };
struct Barriers {
    u64 full_k[2], empty_k[2], full_v[V_RING], empty_v[V_RING], full_q, sink;
};

// The kernel's tensor maps of K and V, (head_dim, heads_k, seqlen_k, batch) with boxes of 64
// columns and BLOCK_N rows (flashx_cupy.tma.MAPS); zeros where Operands::TMA_KV is not set.
struct KvMaps {
    TensorMap k, v;
};

// The producer warpgroup (threads THREADS .. THREADS + PRODUCER_THREADS - 1): the computing
// threads' schedule of key tiles (attend_key_tiles), each tile's K and V copied into the buffers
// once they are free. By cp.async, a tile is announced after the next one is requested, so that a
// tile's copies are always in flight. By TMA (load_kv_tma), thread 0 alone waits for the buffers
// and requests the boxes, whose landing completes the "full" phases: the other threads only run
// the schedule, and copy with it the rare tile that TMA cannot.
struct ProducerSm90 : ForwardRows {
    const Operands::In *k, *v;  // head hk's K and V at the sequence's key 0
    elem_t *sK, *sV;
    Barriers* bars;
    int tid;            // 0 .. PRODUCER_THREADS - 1
    const KvMaps& maps;
    int buf;            // the schedule's; the buffers follow the tile count
    int requested = 0, announced = 0;

    __device__ __forceinline__ void load_kv(int n) {
        const int t = requested++;
        if constexpr (Operands::TMA_KV) {
            if (n < end) load_kv_tma(n, t);
            return;
        }
        if (n < end) {
            if (t >= 2) bar_wait(&bars->empty_k[t % 2], (t / 2 - 1) & 1);
            Operands::load_rows<BLOCK_N>(sK + t % 2 * Operands::K_TILE, k, p.k_n, p.k_d, n, s.len_k, p.head_dim, tid);
            wait_v_free(t);
            Operands::load_v(sV + t % V_RING * Operands::V_TILE, v, p.v_n, p.v_d, n, s.len_k, p.head_dim_v, tid);
        }
        cp_async_commit();
    }

    // Until tile t's V buffer is free: the product of the tile V_RING before it, or of the zeros
    // (tile -1), has freed it. The ring's items count the zeros where they lie in it.
    __device__ __forceinline__ void wait_v_free(int t) {
        const int item = t + ZEROS_IN_RING;
        if (item >= V_RING) bar_wait(&bars->empty_v[t % V_RING], (item / V_RING - 1) & 1);
    }

    // The barrier of the producer's threads (barrier 2), which the computing ones skip.
    static __device__ __forceinline__ void producer_sync() {
        asm volatile("bar.sync 2, %0;" ::"n"(PRODUCER_THREADS) : "memory");
    }

    // Tile t at key n, by TMA wherever the map's zeros are the sequence's: every tile but one that
    // reaches past len_k inside the map, where seqlens ends a sequence before seqlen_k (its rows
    // there are padding, NaN in the suite's tests, and 0 * NaN is NaN). That one the producer's
    // threads copy by cp.async, which writes zeros past len_k. Thread 0 alone has waited on every
    // phase of the "empty" barriers (a parity wait that skipped phases could pass on an earlier
    // one), so the others wait for it to find the buffers free, and it announces the tile once all
    // have copied.
    __device__ __forceinline__ void load_kv_tma(int n, int t) {
        const bool by_tma = n + BLOCK_N <= s.len_k || s.len_k == p.seqlen_k;
        elem_t *k_tile = sK + t % 2 * Operands::K_TILE, *v_tile = sV + t % V_RING * Operands::V_TILE;
        u64 *full_k = &bars->full_k[t % 2], *full_v = &bars->full_v[t % V_RING];
        const int hk = h / p.group;
        if (tid == 0) {
            if (t >= 2) bar_wait(&bars->empty_k[t % 2], (t / 2 - 1) & 1);
            if (by_tma) {
                bar_arrive_expect_bytes(full_k, Operands::K_TILE * sizeof(elem_t));
                tma_load_tile<BLOCK_N, DIM_QK>(k_tile, &maps.k, hk, n, b, full_k);
            }
            wait_v_free(t);
            if (by_tma) {
                bar_arrive_expect_bytes(full_v, Operands::V_TILE * sizeof(elem_t));
                tma_load_tile<BLOCK_N, DIM_V>(v_tile, &maps.v, hk, n, b, full_v);
            }
        }
        if (by_tma) return;
        producer_sync();  // both buffers free
        Operands::load_rows<BLOCK_N>(k_tile, k, p.k_n, p.k_d, n, s.len_k, p.head_dim, tid);
        Operands::load_v(v_tile, v, p.v_n, p.v_d, n, s.len_k, p.head_dim_v, tid);
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async();
        producer_sync();  // every thread's copies landed
        if (tid == 0) bar_arrive(full_k), bar_arrive(full_v);
    }

    // Q's copies landed: the computing threads may start.
    __device__ __forceinline__ void announce_q() {
        cp_async_wait<0>();
        fence_proxy_async();
        bar_arrive(&bars->full_q);
    }

    // By TMA, K and V announce themselves, and Q comes with the first tile: before the second's
    // request where the zeros lie in the ring, as that request waits for the zeros' product, which
    // waits for Q.
    template <bool MASKED>
    __device__ __forceinline__ void attend(int, int next) {
        if constexpr (Operands::TMA_KV && ZEROS_IN_RING)
            if (announced++ == 0) announce_q();
        load_kv(next);
        if constexpr (Operands::TMA_KV) {
            if (!ZEROS_IN_RING && announced++ == 0) announce_q();
            return;
        }
        cp_async_wait<1>();  // this tile's copies (and Q's, with the first)
        fence_proxy_async();
        const int t = announced++;
        if (t == 0) bar_arrive(&bars->full_q);
        bar_arrive(&bars->full_k[t % 2]);
        bar_arrive(&bars->full_v[t % V_RING]);
    }

    __device__ __forceinline__ void finish() {
        if (announced == 0) announce_q();  // no key tile: Q alone
    }
};

// The computing threads' rows with their products; q_desc: the warpgroup's 64 rows of Q.
//
// A tile's P V is issued after the next tile's S, so that it runs beside that tile's softmax;
// the output's rescale waits for it. The first tile owes a product too, P = 0 against a tile of
// zeros (start_owed; of its own, or in V's ring, ZEROS_IN_RING): with a branch between a
// product's issue and its wait, ptxas would wait for every product at the branch's end. Each
// tile waits for its K and the owed V before its products, and frees each buffer once the
// product reading it is done.
struct ForwardCtaSm90 : ForwardRows {
    enum { PV_STEPS = BLOCK_N / Operands::PRODUCT_K };
    elem_t *sK, *sV;
    Barriers* bars;
    u64 q_desc;
    int buf;                          // the schedule's; the buffers follow the tile count
    int tiles = 0;                    // key tiles attended
    const elem_t* v_owed;             // the V tile whose product with pf is not yet issued
    u64 *owed_full, *owed_empty;      // its barriers, and the parity of its "full" phase
    u32 owed_parity;
    u32 pf[PV_STEPS][4];              // P of that tile, as the register operands of its k-steps
    // Output elements an allowed pair poisons with a non-finite V (bit i % 64 of word i / 64, i = nt * 4 + e
    // for acc[0][nt][e]), made NaN by finish, so that the rare path leaves the accumulators alone.
    u64 poisoned[(DIM_V / 2 + 63) / 64] = {};

    __device__ __forceinline__ void load_kv(int) {}  // the producer's

    __device__ __forceinline__ void start_owed(const elem_t* zeros) {
        v_owed = zeros;
        owed_full = &bars->full_q, owed_parity = 0, owed_empty = ZEROS_IN_RING ? &bars->empty_v[V_RING - 1] : &bars->sink;
#pragma unroll
        for (int kk = 0; kk < PV_STEPS; ++kk) pf[kk][0] = pf[kk][1] = pf[kk][2] = pf[kk][3] = 0;
    }

    // Issues O += P V for the owed tile, as one wgmma group.
    __device__ __forceinline__ void issue_pv() {
        const u64 v_desc = Operands::v_desc(v_owed);
#pragma unroll
        for (int kk = 0; kk < PV_STEPS; ++kk) Operands::rs<DIM_V>(acc[0], pf[kk], v_desc + Operands::v_step(kk));
        wgmma_commit();
    }

    // The key tile at n (the schedule's next is the producer's business).
    template <bool MASKED>
    __device__ __forceinline__ void attend(int n, int) {
        const int t = tiles++;
        bar_wait(&bars->full_k[t % 2], (t / 2) & 1);
        bar_wait(owed_full, owed_parity);
        const elem_t* k_tile = sK + t % 2 * Operands::K_TILE;
        elem_t* v_tile = sV + t % V_RING * Operands::V_TILE;

        float sc[ATOMS][BLOCK_N / 8][4];
        const u64 k_desc = wgmma_desc(smem_addr(k_tile), 16);
        wgmma_fence();
        Operands::ss<BLOCK_N, false>(sc[0], q_desc, k_desc);
        // A k-step is 32 bytes of Q's and K's rows in either type: 16 elem_t columns.
#pragma unroll
        for (int kk = 1; kk < DIM_QK / Operands::PRODUCT_K; ++kk)
            Operands::ss<BLOCK_N, true>(sc[0], q_desc + desc_step<BLOCK_M>(0, 16 * kk), k_desc + desc_step<BLOCK_N>(0, 16 * kk));
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

        if constexpr (MASKED || DROPOUT) {  // some pair of the tile reads no V
            bar_wait(&bars->full_v[t % V_RING], (t / V_RING) & 1);
            if (Operands::nonfinite(v_tile)) {
                Operands::poison(*this, v_tile, n, [this](int, int nt, int e) { poisoned[(nt * 4 + e) / 64] |= 1ull << (nt * 4 + e) % 64; });
                compute_sync();
                Operands::clear(v_tile);
                fence_proxy_async();
                compute_sync();  // every thread's clearing before either warpgroup's product
            }
        }

#pragma unroll
        for (int kk = 0; kk < PV_STEPS; ++kk) Operands::pack(pf[kk], sc[0], kk);
        v_owed = v_tile;
        owed_full = &bars->full_v[t % V_RING], owed_parity = (t / V_RING) & 1, owed_empty = &bars->empty_v[t % V_RING];
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
            if (poisoned[i / 64] >> i % 64 & 1) acc[0][i / 4][i % 4] = QUIET_NAN;
        compute_sync();
    }
};

// The tensor maps are a parameter of their own, so that taking their address (for the copies, which
// read them in place) leaves the compiler free to keep p's fields in registers.
extern "C" __global__ void __launch_bounds__(THREADS + PRODUCER_THREADS, 1)
    FORWARD_SM90(const Params p, const __grid_constant__ KvMaps maps) {
    typedef Operands::In In;
    extern __shared__ __align__(1024) unsigned char smem[];
    elem_t* sQ = (elem_t*)smem;                         // Swizzle128<BLOCK_M>
    elem_t* sK = sQ + Operands::Q_TILE;                 // 2 x Swizzle128
    elem_t* sV = sK + 2 * Operands::K_TILE;             // V_RING x Swizzle128
    elem_t* sZero = sV + (V_RING - ZEROS_IN_RING) * Operands::V_TILE;  // a V tile of zeros: past the ring, or its last
    Barriers* bars = (Barriers*)(sV + (V_RING + !ZEROS_IN_RING) * Operands::V_TILE);
    elem_t* sO = (elem_t*)smem;                         // BLOCK_M x LD_V, over Q and K once the loop is done
    static_assert(BLOCK_M * LD_V <= Operands::Q_TILE + 2 * Operands::K_TILE, "O's staging must fit below V");

    int tile, h, b;
    grid_tile<false>(p, p.heads_q, tile, h, b);
    const int hk = h / p.group;
    const Sequence s = sequence(p, b);
    const In* k = (const In*)p.k + row_offset(b, s.start_k, 0, hk, p.k_b, p.k_n, p.k_h);
    const In* v = Operands::v_at(p, b, s, hk);
    Params copy;
    const Params& scaled = Operands::scaled(p, copy, b, hk);
    ForwardRows rows{scaled, s, h, b, tile * BLOCK_M, 0};
    if (!rows.start()) return;

    if (threadIdx.x == 0) {
        for (int i = 0; i < 2; ++i) bar_init(&bars->full_k[i], FULL_KV_ARRIVALS), bar_init(&bars->empty_k[i], THREADS);
        for (int i = 0; i < V_RING; ++i) bar_init(&bars->full_v[i], FULL_KV_ARRIVALS), bar_init(&bars->empty_v[i], THREADS);
        bar_init(&bars->full_q, PRODUCER_THREADS);
        bar_init(&bars->sink, THREADS);
    }
    for (int i = threadIdx.x; i < Operands::V_TILE / CHUNK; i += THREADS + PRODUCER_THREADS) ((uint4*)sZero)[i] = make_uint4(0, 0, 0, 0);
    fence_proxy_async();
    __syncthreads();

    if (threadIdx.x >= THREADS) {  // the producer, with few registers, so that the others may take more
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"((int)PRODUCER_REGISTERS));
        ProducerSm90 producer{{scaled, s, h, b, tile * BLOCK_M, 0}, k, v, sK, sV, bars, (int)threadIdx.x - THREADS, maps};
        producer.start();
        const In* q = (const In*)p.q + row_offset(b, s.start_q, 0, h, p.q_b, p.q_n, p.q_h);
        Operands::load_rows<BLOCK_M>(sQ, q, p.q_n, p.q_d, producer.m0, s.len_q, p.head_dim, producer.tid);
        cp_async_commit();
        attend_key_tiles<PRODUCER_THREADS>(producer, producer.tid);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"((int)COMPUTE_REGISTERS));
    const int warp = threadIdx.x / 32;
    ForwardCtaSm90 cta{{scaled, s, h, b, tile * BLOCK_M, warp * 16}, sK, sV, bars,
                                 wgmma_desc(smem_addr(sQ), 16) + desc_step<BLOCK_M>(warp / 4 * 64, 0)};
    cta.start();
    cta.start_owed(sZero);
    bar_wait(&bars->full_q, 0);
    attend_key_tiles(cta);
    cta.store(sO);
}
