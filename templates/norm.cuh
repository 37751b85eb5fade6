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

// A row's vectors in their own type, for loads kept in flight while other work runs (fewer
// registers than floats until they are used): zeros when the row is inactive or past d. The
// vector path needs d a multiple of N_READS, as for kiln_load_row.
template <int NI, int N_READS, int GROUP, typename T>
__device__ __forceinline__ void kiln_fetch_row(const T* row, bool active, int lane, int d,
                                               kiln_vec<T, N_READS> (&raw)[NI]) {
#pragma unroll
  for (int k = 0; k < NI; ++k) {
    const int i = (k * GROUP + lane) * N_READS;
    if (active && i < d) {
      raw[k] = *reinterpret_cast<const kiln_vec<T, N_READS>*>(row + i);
    } else {
#pragma unroll
      for (int j = 0; j < N_READS; ++j) raw[k].v[j] = kiln_from_float<T>(0.0f);
    }
  }
}

// A fetched row as floats.
template <int NI, int N_READS, typename T>
__device__ __forceinline__ void kiln_unpack_row(const kiln_vec<T, N_READS> (&raw)[NI],
                                                float (&v)[NI][N_READS]) {
#pragma unroll
  for (int k = 0; k < NI; ++k)
#pragma unroll
    for (int j = 0; j < N_READS; ++j) v[k][j] = kiln_to_float(raw[k].v[j]);
}

// Mean (0 for RMSNorm) and 1 / sqrt(var + eps) of a row held in registers, in two exact passes
// (for RMSNorm var is the mean square). Every thread of the block must call it.
template <bool RMS, int GROUP, int BLOCK_DIM, int NI, int N_READS>
__device__ __forceinline__ void kiln_row_stats(const float (&v)[NI][N_READS], int lane, int d,
                                               float eps, float* scratch, float& mean, float& rstd) {
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < NI; ++k)
#pragma unroll
    for (int j = 0; j < N_READS; ++j) s += v[k][j];
  mean = RMS ? 0.0f : kiln_group_sum<GROUP, BLOCK_DIM>(s, scratch) / d;
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
  rstd = rsqrtf(kiln_group_sum<GROUP, BLOCK_DIM>(q, scratch) / d + eps);
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
