// Turns a contiguous (rows, mid, cols) array into (cols, mid, rows): a copy through 32 x 32 tiles
// in shared memory, so that both the reads and the writes run along 32 consecutive elements.
{{> prelude}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};
constexpr int TILE = 32, ROWS_PER_PASS = BLOCK_DIM / TILE;
static_assert(BLOCK_DIM % TILE == 0, "whole rows of a tile per pass");

// Block (x, y, z) moves the tile of columns 32x, rows 32y at middle index z.
extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const T* __restrict__ src, T* __restrict__ dst, int rows, int mid, int cols) {
  __shared__ T tile[TILE][TILE + 1];  // a padded row: a column's 32 elements on 32 banks
  const int c0 = blockIdx.x * TILE, r0 = blockIdx.y * TILE, m = blockIdx.z;
  const int lane = threadIdx.x % TILE;
  for (int i = threadIdx.x / TILE; i < TILE; i += ROWS_PER_PASS) {
    const int r = r0 + i, c = c0 + lane;
    if (r < rows && c < cols) tile[i][lane] = src[((long long)r * mid + m) * cols + c];
  }
  __syncthreads();
  for (int i = threadIdx.x / TILE; i < TILE; i += ROWS_PER_PASS) {
    const int c = c0 + i, r = r0 + lane;
    if (r < rows && c < cols) dst[((long long)c * mid + m) * rows + r] = tile[lane][i];
  }
}
