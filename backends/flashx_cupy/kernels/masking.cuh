// Sequences and the pair rule: the contract's "Scores and masking".

struct Sequence {
    int b, start_q, len_q, start_k, len_k;
};

__device__ __forceinline__ Sequence sequence(const Params& p, int b) {
    Sequence s;
    s.b = b;
    if constexpr (VARLEN) {
        const int* cu_q = (const int*)p.cu_q;
        const int* cu_k = (const int*)p.cu_k;
        s.start_q = cu_q[b];
        s.len_q = cu_q[b + 1] - s.start_q;
        s.start_k = cu_k[b];
        s.len_k = cu_k[b + 1] - s.start_k;
    } else {
        s.start_q = s.start_k = 0;
        if constexpr (SEQLENS_Q) s.len_q = ((const int*)p.seqlens_q)[b];
        else s.len_q = p.seqlen_q;
        if constexpr (SEQLENS_K) s.len_k = ((const int*)p.seqlens_k)[b];
        else s.len_k = p.seqlen_k;
    }
    return s;
}

// The offset of row ``row`` (within the sequence) of head ``h`` in a (B, N, H, D) or (T, H, D) array.
__device__ __forceinline__ i64 row_offset(int b, int start, int row, int h, i64 sb, i64 sn, i64 sh) {
    if constexpr (VARLEN) sb = 0;
    return (i64)b * sb + (i64)(start + row) * sn + (i64)h * sh;
}

// Key j may be used by query i (both within the sequence) for query head h: the contract's rule.
// ``left``/``right`` hold the band with -1 replaced by a reach no pair exceeds.
__device__ __forceinline__ bool allowed_pair(const Params& p, const Sequence& s, int h, int i, int j) {
    const int diag = s.len_k - s.len_q;
    bool ok = i < s.len_q && j < s.len_k && j >= i + diag - p.left && j <= i + diag + p.right;
    if (MASK && ok)
        ok = ((const unsigned char*)p.mask)[(i64)s.b * p.mask_b + (i64)h * p.mask_h + (i64)i * p.mask_i +
                                            (i64)j * p.mask_j] != 0;
    if (BLOCK_MASK && ok)
        ok = ((const unsigned char*)p.blocks)[(i64)s.b * p.blocks_b + (i64)h * p.blocks_h +
                                              (i64)(i / p.block_q) * p.blocks_i + (i64)(j / p.block_k) * p.blocks_j] != 0;
    return ok;
}

// What a block mask allows of a tile's pairs (blocks_cover): none (the tile is skipped unread),
// some (it tests every pair), or all (it needs none of the block mask's tests).
enum BlockCover { COVER_NONE, COVER_SOME, COVER_ALL };

// Whether every pair of query rows [i0, i1) and keys [j0, j1) is allowed without looking: inside
// both lengths and the band, no bool mask, and a block mask's ``cover`` of the tile all. Tiles for
// which it holds skip the pair rule.
__device__ __forceinline__ bool tile_unmasked(const Params& p, const Sequence& s, int i0, int i1, int j0, int j1,
                                              int cover = COVER_SOME) {
    if constexpr (MASK) return false;
    if constexpr (BLOCK_MASK)
        if (cover != COVER_ALL) return false;
    const int diag = s.len_k - s.len_q;
    return i1 <= s.len_q && j1 <= s.len_k && j0 >= (i1 - 1) + diag - p.left && j1 - 1 <= i0 + diag + p.right;
}

// What the block mask allows of the pairs of rows [i0, i1) and keys [j0, j1) (BlockCover), the
// answer of the GROUP threads numbered tid (the computing threads', or a producer's,
// group_sync_or). Without WHOLE, one vote: COVER_SOME then stands for some or all. Without VOTE,
// the calling thread's own answer over all the blocks (GROUP 1, tid 0), no barrier.
template <int GROUP = THREADS, bool WHOLE = true, bool VOTE = true>
__device__ __forceinline__ int blocks_cover(const Params& p, const Sequence& s, int h, int i0, int i1, int j0, int j1,
                                            int tid = threadIdx.x) {
    if constexpr (!BLOCK_MASK) return COVER_ALL;
    const int bi0 = i0 / p.block_q, bi1 = (i1 - 1) / p.block_q + 1;
    const int bj0 = j0 / p.block_k, bj1 = (j1 - 1) / p.block_k + 1;
    const int n = (bi1 - bi0) * (bj1 - bj0);
    bool any = false, all = true;
    for (int idx = tid; idx < n; idx += GROUP) {
        const int bi = bi0 + idx / (bj1 - bj0), bj = bj0 + idx % (bj1 - bj0);
        const bool allowed = ((const unsigned char*)p.blocks)[(i64)s.b * p.blocks_b + (i64)h * p.blocks_h +
                                                              (i64)bi * p.blocks_i + (i64)bj * p.blocks_j] != 0;
        any |= allowed, all &= allowed;
    }
    if constexpr (!VOTE) {
        return !any ? COVER_NONE : all ? COVER_ALL : COVER_SOME;
    } else {
        if (!group_sync_or<GROUP>(any)) return COVER_NONE;
        if constexpr (!WHOLE) return COVER_SOME;
        return group_sync_or<GROUP>(!all) ? COVER_SOME : COVER_ALL;
    }
}

// Whether the block mask allows some pair of rows [i0, i1) and keys [j0, j1) (blocks_cover's one
// vote); a tile it disallows is skipped unread.
template <int GROUP = THREADS>
__device__ __forceinline__ bool blocks_allow(const Params& p, const Sequence& s, int h, int i0, int i1, int j0, int j1,
                                             int tid = threadIdx.x) {
    return blocks_cover<GROUP, false>(p, s, h, i0, i1, j0, j1, tid) != COVER_NONE;
}
