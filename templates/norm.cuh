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

// Rows in flight (STAGES > 0): a ring of row stages in dynamic shared memory, filled by
// cp.async so that the loads of the next rows cost no registers. A stage holds each thread's NI
// vectors at stage[k * BLOCK_DIM + threadIdx.x]; each thread copies and later reads only its own
// vectors, so it waits for its own copies and needs no barrier. Zeros where the row is inactive
// or past d, as for kiln_load_row. Needs 16-byte vectors (d a multiple of N_READS, rows aligned).
template <int NI, int N_READS, int GROUP, int BLOCK_DIM, typename T>
__device__ __forceinline__ void kiln_stage_row(const T* row, bool active, int lane, int d,
                                               kiln_vec<T, N_READS>* stage) {
#pragma unroll
  for (int k = 0; k < NI; ++k) {
    const int i = (k * GROUP + lane) * N_READS;
    const bool valid = active && i < d;
    kiln_cp_async<16, false>(stage + k * BLOCK_DIM + threadIdx.x, valid ? row + i : row, valid);
  }
}

// Vector k of a thread's staged row as floats (after kiln_cp_async_wait let its group through).
template <int N_READS, int BLOCK_DIM, typename T>
__device__ __forceinline__ void kiln_unstage_vec(const kiln_vec<T, N_READS>* stage, int k,
                                                 float (&v)[N_READS]) {
  const kiln_vec<T, N_READS> r = stage[k * BLOCK_DIM + threadIdx.x];
#pragma unroll
  for (int j = 0; j < N_READS; ++j) v[j] = kiln_to_float(r.v[j]);
}

// A thread's whole staged row as floats.
template <int NI, int N_READS, int BLOCK_DIM, typename T>
__device__ __forceinline__ void kiln_unstage_row(const kiln_vec<T, N_READS>* stage,
                                                 float (&v)[NI][N_READS]) {
#pragma unroll
  for (int k = 0; k < NI; ++k) kiln_unstage_vec<N_READS, BLOCK_DIM>(stage, k, v[k]);
}

// Mean (0 for RMSNorm) and 1 / sqrt(var + eps) of a row held in registers, in two exact passes
// (for RMSNorm var is the mean square); inv_d is 1 / d, once per block. A vector lies wholly
// inside d or wholly past it (d is a multiple of N_READS when N_READS > 1), so the tail check
// is one per vector. Every thread of the group must call it.
template <bool RMS, int GROUP, int BLOCK_DIM, int NI, int N_READS>
__device__ __forceinline__ void kiln_row_stats(const float (&v)[NI][N_READS], int lane, int d,
                                               float inv_d, float eps, float* scratch, int& round,
                                               float& mean, float& rstd) {
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < NI; ++k)
#pragma unroll
    for (int j = 0; j < N_READS; ++j) s += v[k][j];
  mean = RMS ? 0.0f : kiln_group_sum<GROUP, BLOCK_DIM>(s, scratch, round) * inv_d;
  float q = 0.0f;
#pragma unroll
  for (int k = 0; k < NI; ++k) {
    if ((k * GROUP + lane) * N_READS >= d) break;  // zeros past d: their c would be -mean
#pragma unroll
    for (int j = 0; j < N_READS; ++j) {
      const float c = v[k][j] - mean;
      q += c * c;
    }
  }
  rstd = rsqrtf(kiln_group_sum<GROUP, BLOCK_DIM>(q, scratch, round) * inv_d + eps);
}

// The same statistics for a row streamed from memory (one row per block), in the same two exact
// passes: mean first, then the squares about it. One pass of sums shifted by a single element
// cancels whenever that element lies far from the mean (x[0] an outlier of 1,000 in a row of
// 65,536 standard normals: 3.6e-3 relative error in f32), so the row is read once more instead
// (RMSNorm, whose mean is 0, reads it once).
template <bool RMS, int GROUP, int BLOCK_DIM, int N_READS, typename T>
__device__ __forceinline__ void kiln_streamed_row_stats(const T* row, bool active, int lane, int d,
                                                        float inv_d, float eps, float* scratch,
                                                        int& round, float& mean, float& rstd) {
  mean = 0.0f;
  if (!RMS) {
    float s = 0.0f;
    if (active) {
      for (int i = lane * N_READS; i < d; i += GROUP * N_READS) {
        float v[N_READS];
        kiln_load_floats<N_READS>(row, i, d, v);  // zeros past d
#pragma unroll
        for (int j = 0; j < N_READS; ++j) s += v[j];
      }
    }
    mean = kiln_group_sum<GROUP, BLOCK_DIM>(s, scratch, round) * inv_d;
  }
  float q = 0.0f;
  if (active) {
    // Whole vectors: i < d, and d is a multiple of N_READS when N_READS > 1.
    for (int i = lane * N_READS; i < d; i += GROUP * N_READS) {
      float v[N_READS];
      kiln_load_floats<N_READS>(row, i, d, v);
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        const float c = v[j] - mean;
        q += c * c;
      }
    }
  }
  rstd = rsqrtf(kiln_group_sum<GROUP, BLOCK_DIM>(q, scratch, round) * inv_d + eps);
}
