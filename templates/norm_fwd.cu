// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) forward over the last axis, f32 accumulation:
//   LayerNorm: y = (x - mean) * rsqrt(var + eps) * w + b
//   RMSNorm:   y = x * rsqrt(mean(x^2) + eps) * w
// GROUP threads handle one row; a block holds BLOCK_DIM / GROUP rows. With ITEMS > 0 the row
// is held in registers (ITEMS vectors of N_READS per thread: one read of x, exact two-pass
// variance); with ITEMS = 0 the row is streamed twice (shifted sums, then the write).
{{> prelude}}
{{> norm}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr int GROUP = {{GROUP}};
constexpr int ITEMS = {{ITEMS}};
constexpr bool RMS = {{RMS}};
constexpr bool PREFETCH = {{PREFETCH}} != 0 && ITEMS > 0;
constexpr int GROUPS = BLOCK_DIM / GROUP;

// PREFETCH (16-bit rows held in registers over several warps): the grid is what the GPU holds
// at once and each group loops over rows, with the next row's loads in flight while the current
// row is reduced and written. 16-bit rows carry few bytes each, and one row at a time left the
// loads latency-bound. Otherwise each group takes one row.
extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    long long rows, int d, long long x_row_stride, long long w_stride, long long b_stride,
    int w_vec, int b_vec, float eps) {
  __shared__ float scratch[BLOCK_DIM / 32];
  const int group = threadIdx.x / GROUP, lane = threadIdx.x % GROUP;

  if (ITEMS > 0) {
    constexpr int NI = ITEMS > 0 ? ITEMS : 1;
    // Normalises a row held in registers and writes it.
    auto write = [&](long long row, float(&v)[NI][N_READS], float mean, float rstd) {
      T* yr = y + row * (long long)d;
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
    };
    if constexpr (PREFETCH) {
      kiln_vec<T, N_READS> raw[NI];
      auto fetch = [&](long long row) {
        kiln_fetch_row<NI, N_READS, GROUP>(x + row * x_row_stride, row < rows, lane, d, raw);
      };
      // Rows r, r + step, ...; the block's groups step together (the statistics use block
      // barriers), so the loop runs on the block's first row.
      const long long step = (long long)gridDim.x * GROUPS;
      long long row = (long long)blockIdx.x * GROUPS + group;
      fetch(row);
      for (long long first = row - group; first < rows; first += step, row += step) {
        float v[NI][N_READS], mean, rstd;
        kiln_unpack_row(raw, v);
        fetch(row + step);
        kiln_row_stats<RMS, GROUP, BLOCK_DIM>(v, lane, d, eps, scratch, mean, rstd);
        if (row < rows) write(row, v, mean, rstd);
      }
    } else {
      const long long row = (long long)blockIdx.x * GROUPS + group;
      const bool active = row < rows;
      float v[NI][N_READS], mean, rstd;
      kiln_load_row<NI, N_READS, GROUP>(x + (active ? row : 0) * x_row_stride, active, lane, d, v);
      kiln_row_stats<RMS, GROUP, BLOCK_DIM>(v, lane, d, eps, scratch, mean, rstd);
      if (active) write(row, v, mean, rstd);
    }
  } else {
    // One row per block (GROUP == BLOCK_DIM).
    const long long row = blockIdx.x;
    const bool active = row < rows;
    const T* xr = x + (active ? row : 0) * x_row_stride;
    T* yr = y + (active ? row : 0) * (long long)d;
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
