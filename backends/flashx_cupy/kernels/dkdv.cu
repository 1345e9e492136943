// flashx_dkdv: dK and dV, and with DQ_ATOMIC dQ's float32 sums (backward.cuh says how).

#include "dkdv.cuh"

// KeyRows with the products on mma.sync, and with DQ_ATOMIC the dQ sums.
struct KeyCta : KeyRows<PaddedTiles> {
    elem_t* sDS;
    float* sStage;
    bool k_nonfinite;  // K holds a NaN or an infinity (DQ_ATOMIC: masked tiles take the exact dQ)
    // DQ_ATOMIC: the step whose dS^T waits in the other dS^T buffer for its dQ product (head, row;
    // dq_head < 0: none). The product runs one step late, after the barrier that starts the next
    // step, so that it needs no barrier of its own.
    int dq_head, dq_row;
    bool dq_masked;

    // Step ``step``, and the requests for step ``next``.
    template <bool MASKED>
    __device__ __forceinline__ void accumulate(int step, int next) {
        constexpr bool EXACT = MASKED || DROPOUT;  // some pair of the tile reads no dO (and, if masked, no Q)
        cp_async_wait<0>();  // Q and dO of this step
        __syncthreads();     // ... for every thread; and every warp is done with the other buffers
        load_rows(next, buf ^ 1);
#if DQ_ATOMIC
        add_dq();  // the previous step's
#endif
        const int h = head_of(step), m = row_of(step);
        elem_t* q = q_tile();
        elem_t* dout = do_tile();

        float pt[ATOMS][BLOCK_N / 8][4];  // P^T, then P^T Z / (1 - p)
        zero<ATOMS, BLOCK_N>(pt);
        gemm_abt<ATOMS, BLOCK_N, DIM_QK, LD_QK, LD_QK>(pt, sK + wrow * LD_QK, q);

        float dst[ATOMS][BLOCK_N / 8][4];  // dP^T, then dS^T
        if constexpr (DKDV_PARTS & 1) {
            zero<ATOMS, BLOCK_N>(dst);
            gemm_abt<ATOMS, BLOCK_N, DIM_V, LD_V, LD_V>(dst, sV + wrow * LD_V, dout);
        }
        probs_and_grads<MASKED>(h, m, pt, dst);
        if constexpr (EXACT) exact_operands<MASKED>(h, m);
#if DQ_ATOMIC
        store_ds(sDS + buf * BLOCK_M * LD_DS, dst);
#endif
        if constexpr (DKDV_PARTS & 2) gemm_areg<ATOMS, BLOCK_N, DIM_V, LD_V>(dv, pt, dout, sStage + wrow * BLOCK_N);
        if constexpr (DKDV_PARTS & 1) gemm_areg<ATOMS, BLOCK_N, DIM_QK, LD_QK>(dk, dst, q, sStage + wrow * BLOCK_N);
#if DQ_ATOMIC
        dq_head = h;
        dq_row = m;
        dq_masked = MASKED;
#endif
        buf ^= 1;
    }

#if DQ_ATOMIC
    // dQ += scale * dS K for the pending step's queries (row dq_row of head dq_head), dS^T from the
    // buffer the next step does not write. Each warp takes QATOMS atoms of 16 queries (two where
    // the tile has no more atoms than warps: each ldmatrix of K then serves two atoms) and COLS
    // columns, the GROUPS warps of a set of atoms splitting the head dim, PASS columns at a time:
    // fewer live accumulators beside dK and dV.
    __device__ __forceinline__ void add_dq() {
        constexpr int ATOMS_N = BLOCK_N / 16, QATOMS = ATOMS_N > WARPS ? ATOMS_N / WARPS : ATOMS_N < 2 ? 1 : 2;
        constexpr int GROUPS = WARPS * QATOMS / ATOMS_N, COLS = DIM_QK / GROUPS, PASS = COLS < 64 ? COLS : 64;
        static_assert(ATOMS_N % QATOMS == 0 && (WARPS * QATOMS) % ATOMS_N == 0 && COLS % 16 == 0, "whole atoms a warp");
        if (dq_head < 0) return;
        const int m = dq_row;
        const elem_t* ds = sDS + (buf ^ 1) * BLOCK_M * LD_DS;
        if (dq_masked && k_nonfinite) {
            exact_dq(ds, dq_head, m);
            return;
        }
        const int warp = threadIdx.x / 32;
        const int qrow = warp % (WARPS / GROUPS) * QATOMS * 16, col0 = warp / (WARPS / GROUPS) * COLS;
#pragma unroll 1
        for (int c0 = col0; c0 < col0 + COLS; c0 += PASS) {
            float acc[QATOMS][PASS / 8][4];
            zero<QATOMS, PASS>(acc);
            gemm_atb<QATOMS, PASS, BLOCK_M, LD_DS, LD_QK>(acc, ds + qrow, sK + c0);
            add_dq_sums<QATOMS, PASS>(dq_head, m, qrow, c0, acc);
        }
    }

    // dQ += scale * acc, an m16n8 accumulator of MT atoms of queries from qrow and N columns from c0
    // (a multiple of DQ_PANEL), into the sums of the queries from row m of head h, by reductions; a
    // row past the sequence adds nothing.
    template <int MT, int N>
    __device__ __forceinline__ void add_dq_sums(int h, int m, int qrow, int c0, const float (&acc)[MT][N / 8][4]) const {
        static_assert(DQ_PANEL == 8, "an atom's columns, one panel");
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = qrow + frag_row(mt, 2 * half);
                if (m + i >= s.len_q) continue;
                float* row = dq_panel(h, m + i, c0 / DQ_PANEL) + frag_col(0, 0);  // atom nt: the panel nt dq_h further
#pragma unroll
                for (int nt = 0; nt < N / 8; ++nt)
                    reduce_add_pair(row + nt * p.dq_h, acc[mt][nt][2 * half] * p.scale,
                                    acc[mt][nt][2 * half + 1] * p.scale);
            }
    }
#endif
};

// One CTA an SM is asked for: left free, ptxas holds the float32 d64 variant to 168 registers
// (three CTAs an SM) and spills.
extern "C" __global__ void __launch_bounds__(THREADS, 1) flashx_dkdv(const BackwardParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* sK = (elem_t*)smem;                                            // BLOCK_M x LD_QK
    elem_t* sV = sK + BLOCK_M * LD_QK;                                     // BLOCK_M x LD_V
    elem_t* sQ = sV + BLOCK_M * LD_V;                                      // 2 x BLOCK_N x LD_QK
    elem_t* sDO = sQ + 2 * BLOCK_N * LD_QK;                                // 2 x BLOCK_N x LD_V
    float* sLse = (float*)(sDO + 2 * BLOCK_N * LD_V);                      // 2 x BLOCK_N
    float* sDelta = sLse + 2 * BLOCK_N;                                    // 2 x BLOCK_N
    float* sStage = sDelta + 2 * BLOCK_N;                                  // float32: BLOCK_M x BLOCK_N
    elem_t* sDS = (elem_t*)(sStage + (TENSOR_CORES ? 0 : BLOCK_M * BLOCK_N));  // DQ_ATOMIC: 2 x BLOCK_M x LD_DS

    int tile, hk, b;
    grid_tile<true>(p, p.kv_heads, tile, hk, b);  // the first keys are read by the most queries
    hk += p.kv_head0;
    KeyCta cta{{p, sequence(p, b), b, hk, tile * BLOCK_M, threadIdx.x / 32 * ATOMS * 16, sK, sV, sQ, sDO, sLse, sDelta},
               sDS, sStage, false, -1, 0, false};
    int step;
    if (!cta.start(step)) return;
#if DQ_ATOMIC
    cp_async_wait<0>();
    __syncthreads();
    cta.k_nonfinite = tile_nonfinite<BLOCK_M, DIM_QK, LD_QK>(sK);
#endif
    accumulate_steps(cta, step);
    cp_async_wait<0>();
#if DQ_ATOMIC
    __syncthreads();  // the last step's dS^T
    cta.add_dq();
#endif
    cta.store();
}
