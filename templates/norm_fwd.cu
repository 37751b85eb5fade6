// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) forward over the last axis, f32 accumulation:
//   LayerNorm: y = (x - mean) * rsqrt(var + eps) * w + b
//   RMSNorm:   y = x * rsqrt(mean(x^2) + eps) * w
// GROUP threads handle one row; a block holds BLOCK_DIM / GROUP rows. With ITEMS > 0 the row
// is held in registers (ITEMS vectors of N_READS per thread: one read of x, exact two-pass
// variance); with ITEMS = 0 the row is streamed twice (shifted sums, then the write).
{{> prelude}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr int GROUP = {{GROUP}};
constexpr int ITEMS = {{ITEMS}};
constexpr bool RMS = {{RMS}};
constexpr int GROUPS = BLOCK_DIM / GROUP;

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    long long rows, int d, long long x_row_stride, long long w_stride, long long b_stride,
    int w_vec, int b_vec, float eps) {
  __shared__ float scratch[BLOCK_DIM / 32];
  const int group = threadIdx.x / GROUP, lane = threadIdx.x % GROUP;
  const long long row = (long long)blockIdx.x * GROUPS + group;
  const bool active = row < rows;
  const T* xr = x + (active ? row : 0) * x_row_stride;
  T* yr = y + (active ? row : 0) * (long long)d;

  if (ITEMS > 0) {
    constexpr int NI = ITEMS > 0 ? ITEMS : 1;
    float v[NI][N_READS];
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < NI; ++k) {
      const int i = (k * GROUP + lane) * N_READS;
      if (active && i < d) {
        kiln_load_floats<N_READS>(xr, i, d, v[k]);
      } else {
#pragma unroll
        for (int j = 0; j < N_READS; ++j) v[k][j] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < N_READS; ++j) s += v[k][j];
    }
    const float mean = RMS ? 0.0f : kiln_group_sum<GROUP, BLOCK_DIM>(s, scratch) / d;
    float q = 0.0f;
#pragma unroll
    for (int k = 0; k < NI; ++k) {
      const int i = (k * GROUP + lane) * N_READS;
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        const float c = (i + j < d) ? v[k][j] - mean : 0.0f;
        q += c * c;
      }
    }
    const float rstd = rsqrtf(kiln_group_sum<GROUP, BLOCK_DIM>(q, scratch) / d + eps);
    if (!active) return;
#pragma unroll
    for (int k = 0; k < NI; ++k) {
      const int i = (k * GROUP + lane) * N_READS;
      if (i >= d) break;
      float wv[N_READS], bv[N_READS];
      kiln_load_param<N_READS>(w, w_stride, w_vec, i, d, 1.0f, wv);
      kiln_load_param<N_READS>(RMS ? nullptr : b, b_stride, b_vec, i, d, 0.0f, bv);
#pragma unroll
      for (int j = 0; j < N_READS; ++j) v[k][j] = (v[k][j] - mean) * rstd * wv[j] + bv[j];
      kiln_store_floats<N_READS>(yr, i, d, v[k]);
    }
  } else {
    // One row per block (GROUP == BLOCK_DIM). Sums are shifted by the row's first element so
    // that sum-of-squares cancellation stays small however large the mean.
    const float shift = (RMS || !active) ? 0.0f : kiln_to_float(xr[0]);
    float s = 0.0f, q = 0.0f;
    if (active) {
      for (int i = lane * N_READS; i < d; i += GROUP * N_READS) {
        float v[N_READS];
        kiln_load_floats<N_READS>(xr, i, d, v);
#pragma unroll
        for (int j = 0; j < N_READS; ++j) {
          const float c = (i + j < d) ? v[j] - shift : 0.0f;
          s += c;
          q += c * c;
        }
      }
    }
    const float sum = kiln_group_sum<GROUP, BLOCK_DIM>(s, scratch) / d;
    const float sq = kiln_group_sum<GROUP, BLOCK_DIM>(q, scratch) / d;
    const float mean = RMS ? 0.0f : shift + sum;
    const float var = RMS ? sq : fmaxf(sq - sum * sum, 0.0f);
    const float rstd = rsqrtf(var + eps);
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
