// Which tile of which head and sequence a CTA takes.
//
// CTAs start in blockIdx order, so the order decides which CTAs run last, alone on a part of the
// GPU. The grid's x axis (every axis but x is 1: no 65535 limit) takes the sequences in turn, and
// within a sequence either a head at a time, its heaviest tile first, or, where ``p.heads_inner``
// says, the heaviest tile of each head first, then the next heaviest of each. Under a causal band
// a tile's work grows with the rows it reads: a query tile's with its index (the forward, dQ), a
// key tile's the other way (dK/dV, whose first keys every later query reads); a head at a time
// then leaves the last head's heaviest tiles to the end of the grid, which heads innermost do not
// (in a model of in-order dispatch on 132 SMs, B=2, N=8k, causal: within 1% of one heaviest-first
// order over the whole grid, where a head at a time ended 6-16% later). A head at a time keeps the
// running CTAs on fewer heads' rows in L2, which the host keeps where the tail costs less
// (variants.heads_inner says where).

// (tile, head, batch) of this CTA over p.tiles_m tiles per head and ``heads`` heads: tile 0 the
// heaviest where FIRST_HEAVIEST, else tile p.tiles_m - 1.
template <bool FIRST_HEAVIEST>
__device__ __forceinline__ void grid_tile(const Params& p, int heads, int& tile, int& h, int& b) {
    const int tiles = p.tiles_m, per_batch = tiles * heads;
    b = blockIdx.x / per_batch;
    const int rest = blockIdx.x % per_batch, inner = p.heads_inner ? heads : tiles;
    const int outer_index = rest / inner, inner_index = rest % inner;
    h = p.heads_inner ? inner_index : outer_index;
    const int rank = p.heads_inner ? outer_index : inner_index;
    tile = FIRST_HEAVIEST ? rank : tiles - 1 - rank;
}
