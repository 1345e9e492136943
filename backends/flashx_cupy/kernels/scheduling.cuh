// Which tile of which head and sequence a CTA takes.

// The tile of the grid's x axis (every axis but x is 1: no 65535 limit), heaviest first:
// (tile, head, batch) from blockIdx.x over ``tiles`` tiles per head.
__device__ __forceinline__ void grid_tile(int tiles, int heads, int& tile, int& h, int& b) {
    const int per_batch = tiles * heads;
    b = blockIdx.x / per_batch;
    const int rest = blockIdx.x % per_batch;
    h = rest / tiles;
    tile = tiles - 1 - rest % tiles;
}
