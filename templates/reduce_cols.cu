// out_s[c] = sum over r of partial[(s * rows + r) * d + c] for each set s = blockIdx.y: the column
// sums of f32 [rows, d] matrices, accumulated in f32 and stored as {{dtype_name}}.
// A block covers col_threads * N_READS columns (N_READS = 4: one 16-byte load per thread and
// row) with BLOCK_DIM / col_threads row lanes. The launch picks col_threads (a power of two up
// to 32) so that narrow matrices still spread over every SM: few columns and many rows (the
// norm VJP's partial sums of d = 768 over hundreds of blocks) take few column threads and many
// row lanes. Each lane keeps four independent sums so that four loads are in flight at once;
// the lanes of a column are combined in a fixed order (shuffles, then shared memory), so the
// result does not change from run to run.
{{> prelude}}

typedef {{dtype}} T;

constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr int WARPS = BLOCK_DIM / 32;
constexpr int UNROLL = 4;

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const float* __restrict__ partial, T* __restrict__ out0, T* __restrict__ out1, long long rows,
    int d, int col_threads) {
  __shared__ float tile[WARPS][32 * N_READS];
  const int ct = threadIdx.x & (col_threads - 1);
  const int lane = threadIdx.x / col_threads, lanes = BLOCK_DIM / col_threads;
  const int c = (blockIdx.x * col_threads + ct) * N_READS;
  const float* p = partial + (long long)blockIdx.y * rows * d + c;
  T* out = blockIdx.y == 0 ? out0 : out1;
  float s[UNROLL][N_READS] = {};
  if (c < d) {
    long long r = lane;
    for (; r + (UNROLL - 1) * lanes < rows; r += UNROLL * lanes) {
      float v[UNROLL][N_READS];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) kiln_load_floats<N_READS>(p + (r + u * lanes) * d, 0, d - c, v[u]);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int j = 0; j < N_READS; ++j) s[u][j] += v[u][j];
    }
    for (; r < rows; r += lanes) {
      float v[N_READS];
      kiln_load_floats<N_READS>(p + r * d, 0, d - c, v);
#pragma unroll
      for (int j = 0; j < N_READS; ++j) s[0][j] += v[j];
    }
  }
  // The lanes of one column thread within a warp are col_threads apart.
  float t[N_READS];
#pragma unroll
  for (int j = 0; j < N_READS; ++j) {
    t[j] = (s[0][j] + s[1][j]) + (s[2][j] + s[3][j]);
    for (int offset = col_threads; offset < 32; offset <<= 1)
      t[j] += __shfl_xor_sync(0xffffffffu, t[j], offset);
  }
  const int warp = threadIdx.x / 32, wl = threadIdx.x % 32;
  if (wl < col_threads) {
#pragma unroll
    for (int j = 0; j < N_READS; ++j) tile[warp][wl * N_READS + j] = t[j];
  }
  __syncthreads();
  // One thread per column of the block sums its warps' values in order.
  const int col = blockIdx.x * col_threads * N_READS + threadIdx.x;
  if (threadIdx.x < col_threads * N_READS && col < d) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += tile[w][threadIdx.x];
    out[col] = kiln_from_float<T>(sum);
  }
}
