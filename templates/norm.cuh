// Row helpers shared by the norm kernels (norm_fwd.cu, norm_vjp.cu). A row held in registers is
// NI vectors of N_READS floats per lane: element (k * GROUP + lane) * N_READS + j, zero past d.

// Loads a row into registers (zeros when the lane's row is inactive or past d).
template <int NI, int N_READS, int GROUP, typename T>
__device__ __forceinline__ void kiln_load_row(const T* row, bool active, int lane, int d,
                                              float (&v)[NI][N_READS]) {
#pragma unroll
  for (int k = 0; k < NI; ++k) {
    const int i = (k * GROUP + lane) * N_READS;
    if (active && i < d) {
      kiln_load_floats<N_READS>(row, i, d, v[k]);
    } else {
#pragma unroll
      for (int j = 0; j < N_READS; ++j) v[k][j] = 0.0f;
    }
  }
}

// Mean (0 for RMSNorm) and 1 / sqrt(var + eps) of R rows held in registers, in two exact passes
// (for RMSNorm var is the mean square), the R rows' sums reduced together. Every thread of the
// block must call it; `scratch` holds R * BLOCK_DIM / 32 floats.
template <bool RMS, int GROUP, int BLOCK_DIM, int R, int NI, int N_READS>
__device__ __forceinline__ void kiln_rows_stats(const float (&v)[R][NI][N_READS], int lane, int d,
                                                float eps, float* scratch, float (&mean)[R],
                                                float (&rstd)[R]) {
  float s[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    s[r] = 0.0f;
#pragma unroll
    for (int k = 0; k < NI; ++k)
#pragma unroll
      for (int j = 0; j < N_READS; ++j) s[r] += v[r][k][j];
  }
  if (!RMS) kiln_group_sum_n<GROUP, BLOCK_DIM, R>(s, scratch);
  float q[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    mean[r] = RMS ? 0.0f : s[r] / d;
    q[r] = 0.0f;
#pragma unroll
    for (int k = 0; k < NI; ++k) {
      const int i = (k * GROUP + lane) * N_READS;
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        const float c = (i + j < d) ? v[r][k][j] - mean[r] : 0.0f;
        q[r] += c * c;
      }
    }
  }
  kiln_group_sum_n<GROUP, BLOCK_DIM, R>(q, scratch);
#pragma unroll
  for (int r = 0; r < R; ++r) rstd[r] = rsqrtf(q[r] / d + eps);
}

// kiln_rows_stats for one row.
template <bool RMS, int GROUP, int BLOCK_DIM, int NI, int N_READS>
__device__ __forceinline__ void kiln_row_stats(const float (&v)[NI][N_READS], int lane, int d,
                                               float eps, float* scratch, float& mean, float& rstd) {
  float m[1], r[1];
  kiln_rows_stats<RMS, GROUP, BLOCK_DIM, 1>(reinterpret_cast<const float(&)[1][NI][N_READS]>(v),
                                            lane, d, eps, scratch, m, r);
  mean = m[0];
  rstd = r[0];
}

// The same statistics for a row streamed from memory (one row per block): one pass of sums
// shifted by the row's first element, so that cancellation stays small however large the mean.
template <bool RMS, int GROUP, int BLOCK_DIM, int N_READS, typename T>
__device__ __forceinline__ void kiln_streamed_row_stats(const T* row, bool active, int lane, int d,
                                                        float eps, float* scratch, float& mean,
                                                        float& rstd) {
  const float shift = (RMS || !active) ? 0.0f : kiln_to_float(row[0]);
  float s = 0.0f, q = 0.0f;
  if (active) {
    for (int i = lane * N_READS; i < d; i += GROUP * N_READS) {
      float v[N_READS];
      kiln_load_floats<N_READS>(row, i, d, v);
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
  mean = RMS ? 0.0f : shift + sum;
  rstd = rsqrtf((RMS ? sq : fmaxf(sq - sum * sum, 0.0f)) + eps);
}
