// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) forward over the last axis, f32 accumulation:
//   LayerNorm: y = (x - mean) * rsqrt(var + eps) * w + b
//   RMSNorm:   y = x * rsqrt(mean(x^2) + eps) * w
// GROUP threads handle ROWS rows; a block holds BLOCK_DIM / GROUP groups. With ITEMS > 0 the
// rows are held in registers (ITEMS vectors of N_READS per thread and row: one read of x, exact
// two-pass variance, the ROWS rows reduced together, which doubles the bytes in flight per
// barrier for 16-bit rows); with ITEMS = 0 (and ROWS = 1) the row is streamed twice (shifted
// sums, then the write).
{{> prelude}}
{{> norm}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr int GROUP = {{GROUP}};
constexpr int ITEMS = {{ITEMS}};
constexpr bool RMS = {{RMS}};
constexpr int ROWS = {{ROWS}};
constexpr int GROUPS = BLOCK_DIM / GROUP;

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    long long rows, int d, long long x_row_stride, long long w_stride, long long b_stride,
    int w_vec, int b_vec, float eps) {
  __shared__ float scratch[ROWS * BLOCK_DIM / 32];
  const int group = threadIdx.x / GROUP, lane = threadIdx.x % GROUP;
  const long long first_row = ((long long)blockIdx.x * GROUPS + group) * ROWS;

  if (ITEMS > 0) {
    constexpr int NI = ITEMS > 0 ? ITEMS : 1;
    float v[ROWS][NI][N_READS], mean[ROWS], rstd[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const bool active = first_row + r < rows;
      kiln_load_row<NI, N_READS, GROUP>(x + (active ? first_row + r : 0) * x_row_stride, active,
                                        lane, d, v[r]);
    }
    kiln_rows_stats<RMS, GROUP, BLOCK_DIM>(v, lane, d, eps, scratch, mean, rstd);
#pragma unroll
    for (int k = 0; k < NI; ++k) {
      const int i = (k * GROUP + lane) * N_READS;
      if (i >= d) break;
      float wv[N_READS], bv[N_READS];
      kiln_load_param<N_READS>(w, w_stride, w_vec, i, d, 1.0f, wv);
      kiln_load_param<N_READS>(RMS ? nullptr : b, b_stride, b_vec, i, d, 0.0f, bv);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (first_row + r >= rows) break;
#pragma unroll
        for (int j = 0; j < N_READS; ++j) v[r][k][j] = (v[r][k][j] - mean[r]) * rstd[r] * wv[j] + bv[j];
        kiln_store_floats<N_READS>(y + (first_row + r) * (long long)d, i, d, v[r][k]);
      }
    }
  } else {
    // ROWS == 1 here (the op never pairs rows on the looped path).
    const long long row = first_row;
    const bool active = row < rows;
    const T* xr = x + (active ? row : 0) * x_row_stride;
    T* yr = y + (active ? row : 0) * (long long)d;
    // One row per block (GROUP == BLOCK_DIM).
    float mean, rstd;
    kiln_streamed_row_stats<RMS, GROUP, BLOCK_DIM, N_READS>(xr, active, lane, d, eps, scratch, mean, rstd);
    if (!active) return;
    for (int i = lane * N_READS; i < d; i += GROUP * N_READS) {
      float v[N_READS], wv[N_READS], bv[N_READS];
      kiln_load_floats<N_READS>(xr, i, d, v);
      kiln_load_param<N_READS>(w, w_stride, w_vec, i, d, 1.0f, wv);
      kiln_load_param<N_READS>(RMS ? nullptr : b, b_stride, b_vec, i, d, 0.0f, bv);
#pragma unroll
      for (int j = 0; j < N_READS; ++j) v[j] = (v[j] - mean) * rstd * wv[j] + bv[j];
      kiln_store_floats<N_READS>(yr, i, d, v);
    }
  }
}
