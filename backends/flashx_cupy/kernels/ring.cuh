// The ring of buffers between the producer warpgroup and the computing warpgroups of the wgmma
// backward kernels (dkdv_sm90.cu, dq_sm90.cu); after wgmma.cuh.
//
// The producer walks the CTA's schedule, an increasing sequence of items (query steps, or key
// tiles) below ``end``: it copies item t's operands by cp.async into buffers t % STAGES, writes
// the item and the block mask's cover of it (BlockCover) beside them, and announces them on "full"
// once landed; after the last item it announces ``end`` itself. The computing threads read the
// schedule rather than compute it (a block mask's votes included), and free the buffers on
// "empty" once the products reading them are done. No barrier of the whole CTA stands in either loop. An item is announced after the next
// one is requested, so that an item's copies are always in flight.
//
// The CTA's three warpgroups share its 168 registers a thread (384 threads, one CTA an SM):
// setmaxnreg leaves the producer 24 and gives the two computing warpgroups 240 each
// (128 * (24 + 2 * 240) = 384 * 168), as FA3 does; at 232, the forward's split, ptxas serializes
// the dK/dV kernel's d128 products (info C7512).

#ifndef RING_STAGES
#define RING_STAGES 3  // the buffers of a ring (variants.Variant.ring_stages)
#endif

__device__ __forceinline__ void producer_registers() { asm volatile("setmaxnreg.dec.sync.aligned.u32 24;"); }
__device__ __forceinline__ void compute_registers() { asm volatile("setmaxnreg.inc.sync.aligned.u32 240;"); }

template <int STAGES = RING_STAGES>
struct Ring {
    u64 full[STAGES], empty[STAGES];
    int item[STAGES], cover[STAGES];

    // By one thread, before a barrier of the whole CTA.
    __device__ __forceinline__ void init() {
        for (int i = 0; i < STAGES; ++i) bar_init(&full[i], PRODUCER_THREADS), bar_init(&empty[i], THREADS);
    }

    // The producer's thread tid, from ``item`` and its ``cover``: load(item, buffer) requests an
    // item's copies as one group (an empty one for ``end``), next(item, cover) is the schedule's
    // next, its cover set.
    template <typename Load, typename Next>
    __device__ __forceinline__ void produce(int item, int cover, int end, int tid, Load load, Next next) {
        int t = 0;
        for (;; ++t) {
            const int slot = t % STAGES;
            if (t >= STAGES) bar_wait(&empty[slot], (t / STAGES - 1) & 1);
            load(item, slot);
            if (tid == 0) this->item[slot] = item, this->cover[slot] = cover;
            if (t > 0) announce<1>(t - 1);
            if (item >= end) break;
            item = next(item, cover);
        }
        announce<0>(t);  // the end
    }

    // Item t announced once its copies have landed (all but the newest PENDING groups).
    template <int PENDING>
    __device__ __forceinline__ void announce(int t) {
        cp_async_wait<PENDING>();
        fence_proxy_async();
        bar_arrive(&full[t % STAGES]);
    }

    // The computing threads: until the first item's buffers, and what was requested with them, have
    // landed (consume waits for them again, at once).
    __device__ __forceinline__ void first_landed() { bar_wait(&full[0], 0); }

    // The computing threads: body(item, cover, buffer) for each item announced before ``end``; the
    // body waits for the products that read its buffers.
    template <typename Body>
    __device__ __forceinline__ void consume(int end, Body body) {
        for (int t = 0;; ++t) {
            const int slot = t % STAGES;
            bar_wait(&full[slot], (t / STAGES) & 1);
            const int item = this->item[slot];
            if (item >= end) break;
            body(item, this->cover[slot], slot);
            bar_arrive(&empty[slot]);
        }
    }
};
