// out_s[c] = sum over r of partial[(s * rows + r) * d + c] for each set s = blockIdx.y: the column
// sums of f32 [rows, d] matrices, accumulated in f32 and stored as {{dtype_name}}.
// A block covers col_threads * N_READS columns (N_READS = 4: one 16-byte load per thread and
// row) with BLOCK_DIM / col_threads row lanes. The launch picks col_threads (a power of two up
// to BLOCK_DIM) so that narrow matrices still spread over every SM and each lane has rows to
// sum: few columns and many rows (the norm VJP's partial sums of d = 768 over hundreds of
// blocks) take few column threads and many row lanes; many columns and few rows (a grouped
// convolution's weight gradient in 16 splits) take wide rows of column threads. Each lane keeps
// four independent sums so that four loads are in flight at once; the lanes of a column are
// combined in a fixed order (shuffles within a warp, then shared memory across warps), so the
// result does not change from run to run.
{{> prelude}}

typedef {{dtype}} T;

constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr int UNROLL = 4;

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const float* __restrict__ partial, T* __restrict__ out0, T* __restrict__ out1, long long rows,
    int d, int col_threads) {
  // The previous kernel's writes visible (launch_dependent); no global access before this.
  kiln_wait_for_previous_grid();
  __shared__ float tile[BLOCK_DIM * N_READS];
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
  // Lanes across warps: `span` consecutive threads hold one lane's columns (a warp's first
  // col_threads threads where col_threads < 32), lane k of them at tile[k][column].
  const int span = col_threads < 32 ? 32 : col_threads;
  const int k = threadIdx.x / span, cols = col_threads * N_READS;
  if (threadIdx.x % span < col_threads) {
#pragma unroll
    for (int j = 0; j < N_READS; ++j) tile[k * cols + ct * N_READS + j] = t[j];
  }
  __syncthreads();
  // A thread a column of the block (several where the block has more columns than threads)
  // sums the lanes across warps in order.
  for (int i = threadIdx.x; i < cols; i += BLOCK_DIM) {
    const int col = blockIdx.x * cols + i;
    if (col >= d) break;
    float sum = 0.0f;
    for (int w = 0; w < BLOCK_DIM / span; ++w) sum += tile[w * cols + i];
    out[col] = kiln_from_float<T>(sum);
  }
}
