// Dropout, the contract's Philox stream: Z[b, h, i, j] = word j' % 4 of Philox4x32-10((j' / 4, i', b * Hq + h, rng_offset), seed)
// >= floor(p * 2^32), compared as integers, at positions i' = i + drop_row0 and j' = j + drop_col0
// (dropout_offsets).

// The four words of Philox4x32-10 at counter (c0, c1, c2, c3), in c0 .. c3.
__device__ __forceinline__ void philox(u32& c0, u32& c1, u32& c2, u32& c3, u64 seed) {
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

// The keep bits of query row i (before drop_row0) at Philox counter column ``counter``: bit w for
// word w, the key whose offset column (j + drop_col0) is 4 counter + w. One Philox call.
__device__ __forceinline__ u32 dropout_keep4(const Params& p, int b, int h, int i, u32 counter) {
    u32 c0 = counter, c1 = (u32)(i + p.drop_row0), c2 = (u32)(b * p.heads_q + h), c3 = (u32)p.rng_offset;
    philox(c0, c1, c2, c3, p.seed);
    const u32 t = (u32)p.drop_threshold;
    return (u32)(c0 >= t) | (u32)(c1 >= t) << 1 | (u32)(c2 >= t) << 2 | (u32)(c3 >= t) << 3;
}

__device__ __forceinline__ bool dropout_keep(const Params& p, int b, int h, int i, int j) {
    const u32 col = (u32)(j + p.drop_col0);
    return dropout_keep4(p, b, h, i, col / 4) >> (col % 4) & 1;
}

// Whether (i, j) and (i, j + 1) are kept, bits 0 and 1: one Philox call serves both unless they
// straddle two counters (j + drop_col0 = 3 mod 4), which an even drop_col0 never makes.
__device__ __forceinline__ u32 dropout_keep_pair(const Params& p, int b, int h, int i, int j) {
    const u32 col = (u32)(j + p.drop_col0), word = col % 4;
    const u32 bits = dropout_keep4(p, b, h, i, col / 4) >> word;
    return word < 3 ? bits & 3 : bits | (u32)dropout_keep(p, b, h, i, j + 1) << 1;
}

// Whether a lane's four elements of the m16n8 atom at (i0, j0) are kept, bit e for element e
// (frag_row and frag_col): rows g and g + 8, columns 2q and 2q + 1 (g = lane / 4, q = lane % 4).
// counter_aligned (drop_col0 a multiple of 4): one Philox counter covers the columns of lanes q
// and q ^ 1, each of the two draws one row's four words, the even lane row g and the odd one row
// g + 8, and they trade the halves the other needs, one Philox call a lane instead of two. The
// whole warp calls it.
__device__ __forceinline__ u32 dropout_keep_atom(const Params& p, int b, int h, int i0, int j0, bool counter_aligned) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    if (!counter_aligned)
        return dropout_keep_pair(p, b, h, i0 + g, j0 + 2 * q) | dropout_keep_pair(p, b, h, i0 + g + 8, j0 + 2 * q) << 2;
    const bool odd = q & 1;
    const u32 row = dropout_keep4(p, b, h, i0 + g + (odd ? 8 : 0), (u32)(j0 + 4 * (q / 2) + p.drop_col0) / 4);
    const u32 mine = odd ? row >> 2 : row & 3, theirs = odd ? row & 3 : row >> 2;
    const u32 traded = __shfl_xor_sync(0xffffffffu, theirs, 1);  // the other row, this lane's columns
    return odd ? traded | mine << 2 : mine | traded << 2;
}

// The same for an atom of transposed scores (the dK/dV kernel's P^T: rows are keys from j0,
// columns queries from i0), bit e for the key j0 + frag_row and the query i0 + frag_col.
// counter_aligned: the warp's 32 counters (four groups of four keys, eight queries) are one a
// lane: lane (g, q) draws key group g % 4 for query 2q + g / 4, and each element's bit is a word
// of another lane's draw: one Philox call a lane instead of four.
__device__ __forceinline__ u32 dropout_keep_atom_t(const Params& p, int b, int h, int i0, int j0, bool counter_aligned) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    u32 bits = 0;
    if (!counter_aligned) {
#pragma unroll
        for (int e = 0; e < 4; ++e) bits |= (u32)dropout_keep(p, b, h, i0 + 2 * q + (e & 1), j0 + g + 8 * (e >> 1)) << e;
        return bits;
    }
    const u32 drawn = dropout_keep4(p, b, h, i0 + 2 * q + g / 4, (u32)(j0 + 4 * (g % 4) + p.drop_col0) / 4);
#pragma unroll
    for (int e = 0; e < 4; ++e)  // key g (+ 8) is word g % 4 of group g / 4 (+ 2), drawn by lane (4 (e & 1) + that group, q)
        bits |= (__shfl_sync(0xffffffffu, drawn, 4 * (4 * (e & 1) + g / 4 + 2 * (e >> 1)) + q) >> (g % 4) & 1) << e;
    return bits;
}

// The keep bits of a warp's ATOMS_M x ATOMS_N atoms, drawn for a whole tile before any is read:
// atom(mt, nt, counter_aligned) returns one atom's four bits by dropout_keep_atom or
// dropout_keep_atom_t. drop_col0's alignment is tested once for the tile and reaches the atoms as
// a constant, so that within its branch the atoms' Philox calls are straight-line code, which the
// scheduler interleaves: with a branch an atom, each call's ten dependent rounds sat alone in a
// basic block, and the warps stalled on their latency.
template <int ATOMS_M, int ATOMS_N>
struct KeepBits {
    u32 words[ATOMS_M][(ATOMS_N + 7) / 8];  // atom (mt, nt): bits 4 (nt % 8) .. + 3 of words[mt][nt / 8]

    template <class Atom>
    __device__ __forceinline__ void draw(const Params& p, Atom atom) {
        if (p.drop_col0 % 4 == 0)
            draw_all<true>(atom);
        else
            draw_all<false>(atom);
    }

    __device__ __forceinline__ bool kept(int mt, int nt, int e) const { return words[mt][nt / 8] >> (4 * (nt % 8) + e) & 1; }

  private:
    template <bool COUNTER_ALIGNED, class Atom>
    __device__ __forceinline__ void draw_all(Atom atom) {
#pragma unroll
        for (int mt = 0; mt < ATOMS_M; ++mt) {
#pragma unroll
            for (int w = 0; w < (ATOMS_N + 7) / 8; ++w) words[mt][w] = 0;
#pragma unroll
            for (int nt = 0; nt < ATOMS_N; ++nt) words[mt][nt / 8] |= atom(mt, nt, COUNTER_ALIGNED) << 4 * (nt % 8);
        }
    }
};
