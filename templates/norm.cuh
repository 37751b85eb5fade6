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
  const kiln_vec<T, N_READS> r = stage[k * BLOCK_DIM + threadIdx.x];  // one vector load
  kiln_widen(r, v);
}

// Marks a ring's 16-byte vector held in registers as changed, so that what the compiler derived
// from it before (its widened floats) is derived anew after: registers for the vector, not its
// floats. (Kernels without a ring, whose vectors may be narrower, compile it without calling it.)
template <typename T, int N>
__device__ __forceinline__ void kiln_opaque(kiln_vec<T, N>& v) {
  if constexpr (sizeof(v) == 16) {
    unsigned* w = reinterpret_cast<unsigned*>(&v);
    asm volatile("" : "+r"(w[0]), "+r"(w[1]), "+r"(w[2]), "+r"(w[3]));
  }
}

// A thread's whole staged row as floats.
template <int NI, int N_READS, int BLOCK_DIM, typename T>
__device__ __forceinline__ void kiln_unstage_row(const kiln_vec<T, N_READS>* stage,
                                                 float (&v)[NI][N_READS]) {
#pragma unroll
  for (int k = 0; k < NI; ++k) kiln_unstage_vec<N_READS, BLOCK_DIM>(stage, k, v[k]);
}

// What the warps of a group hold of a row (vectors k * GROUP + lane of a row of d elements in
// vectors of N_READS), which weighs each warp's mean in LayerNorm's one-barrier statistics
// (kiln_group_moments): 1 / the elements of this thread's warp, and the elements of the group's
// warp that kiln_group_moments gives this thread's lane (lane % kiln_moment_span), with 1 / them
// (0 for none, or past the group's warps).
// Computed once per kernel.
struct kiln_warp_shares {
  float inv_own, n_lane, inv_lane;
};
template <int GROUP, int N_READS>
__device__ __forceinline__ int kiln_warp_elements(int d, int warp) {
  const int vectors = d / N_READS;  // d is a multiple of N_READS when N_READS > 1
  const int rounds = vectors / GROUP, rest = vectors - rounds * GROUP;
  return warp < GROUP / 32 ? N_READS * (32 * rounds + min(32, max(0, rest - 32 * warp))) : 0;
}
// The lanes over which kiln_group_moments sums its warps' values: the next power of two of
// the group's warps (lanes i, i + SPAN, ... take warp i), so that its two butterflies take
// log2(SPAN) steps each, not five.
template <int GROUP>
__host__ __device__ constexpr int kiln_moment_span() {
  return kiln_span_for<GROUP / 32>();
}
template <int GROUP, int N_READS>
__device__ __forceinline__ kiln_warp_shares kiln_warp_shares_of(int d) {
  constexpr int SPAN = kiln_moment_span<GROUP>();
  const int own = kiln_warp_elements<GROUP, N_READS>(d, (int)(threadIdx.x % GROUP) / 32);
  const int lane = kiln_warp_elements<GROUP, N_READS>(d, (int)(threadIdx.x % SPAN));
  return {own > 0 ? 1.0f / own : 0.0f, (float)lane, lane > 0 ? 1.0f / lane : 0.0f};
}

// Per warp of a group, LayerNorm's partial sums for kiln_group_moments. Two halves of
// BLOCK_DIM / 32, used in turn, so that one barrier a row is enough (as kiln_group_sum's
// scratch).
#define KILN_MOMENTS(BLOCK_DIM) (2 * (BLOCK_DIM) / 32)

// LayerNorm's statistics over a group of several warps after one barrier, exact: no value is a
// large sum of squares minus a square. In, this warp's sums (the same in every lane): `sx` of x
// and `q` of (x - m_w)^2 about the warp's own mean m_w = sx / n_w. Out, the row's mean and
// sum (x - mean)^2 = sum_w q_w + n_w (m_w - mean)^2 over its warps (the cross terms
// 2 (m_w - mean) sum (x - m_w) vanish up to the rounding of m_w). Lane i combines warp i; the
// butterflies leave the same bits in every lane. Two group sums (the mean, then the squares
// about it) would wait on the group twice a row.
template <int GROUP, int BLOCK_DIM>
__device__ __forceinline__ void kiln_group_moments(float sx, float q,
                                                   const kiln_warp_shares& shares,
                                                   float2* moments, int& round, float inv_d,
                                                   float& mean, float& m2) {
  static_assert(GROUP > 32 && GROUP % 32 == 0 && BLOCK_DIM % GROUP == 0, "several whole warps");
  constexpr int WARPS = GROUP / 32;
  const int warp = threadIdx.x / 32, i = threadIdx.x % 32;
  float2* half = moments + (round++ & 1) * (BLOCK_DIM / 32);
  if (i == 0) half[warp] = make_float2(sx, q);
  kiln_group_barrier<GROUP, BLOCK_DIM>();
  constexpr int SPAN = kiln_moment_span<GROUP>();
  const float2 p =
      i % SPAN < WARPS ? half[(warp / WARPS) * WARPS + i % SPAN] : make_float2(0.0f, 0.0f);
  mean = kiln_span_sum<SPAN>(p.x) * inv_d;
  const float dev = p.x * shares.inv_lane - mean;
  m2 = kiln_span_sum<SPAN>(p.y + shares.n_lane * dev * dev);
}

// Sums of three values over a warp, into lane 0 alone (the other lanes' results are partial):
// after the first step the two half-warps carry different pairs, after the second each quarter
// one value, so three sums take 8 shuffles (two of them to bring b and c to lane 0), not 15.
__device__ __forceinline__ void kiln_warp_sum3_to_lane0(float& a, float& b, float& c) {
  const int i = threadIdx.x % 32;
  const bool upper = i >= 16;
  // Halves: the lower keeps (a, c), the upper (b, 0).
  float u = upper ? b : a, v = upper ? 0.0f : c;
  u += __shfl_xor_sync(0xffffffffu, upper ? a : b, 16);
  v += __shfl_xor_sync(0xffffffffu, upper ? c : 0.0f, 16);
  // Quarters: lanes 0-7 a, 8-15 c, 16-23 b.
  const bool odd = (i & 8) != 0;
  float w = odd ? v : u;
  w += __shfl_xor_sync(0xffffffffu, odd ? u : v, 8);
#pragma unroll
  for (int offset = 4; offset > 0; offset >>= 1) w += __shfl_xor_sync(0xffffffffu, w, offset);
  a = w;
  b = __shfl_sync(0xffffffffu, w, 16);
  c = __shfl_sync(0xffffffffu, w, 8);
}

// The LayerNorm VJP's row sums over a group of several warps after one barrier, exact as
// kiln_group_moments, whose layout `sums` takes (KILN_MOMENTS(BLOCK_DIM) entries). In: `sx`,
// this warp's sum of x (the same in every lane), and in lane 0 the warp's sums of (x - m_w)^2
// (`q`), of wg (x - m_w) (`t`) and of wg (`swg`) about the warp's own mean m_w = sx / n_w.
// Out, in every lane: the row's mean, q = sum (x - mean)^2 = sum_w q_w + n_w (m_w - mean)^2,
// t = sum wg (x - mean) = sum_w t_w + (m_w - mean) swg_w (an identity: nothing cancels) and
// swg = sum wg. Two rounds of group sums (the mean and sum wg, then the others about the mean)
// would wait on the group twice a row.
template <int GROUP, int BLOCK_DIM>
__device__ __forceinline__ void kiln_group_vjp_sums(float sx, float& q, float& t, float& swg,
                                                    const kiln_warp_shares& shares, float4* sums,
                                                    int& round, float inv_d, float& mean) {
  static_assert(GROUP > 32 && GROUP % 32 == 0 && BLOCK_DIM % GROUP == 0, "several whole warps");
  constexpr int WARPS = GROUP / 32;
  const int warp = threadIdx.x / 32, i = threadIdx.x % 32;
  float4* half = sums + (round++ & 1) * (BLOCK_DIM / 32);
  if (i == 0) half[warp] = make_float4(sx, q, t, swg);
  kiln_group_barrier<GROUP, BLOCK_DIM>();
  constexpr int SPAN = kiln_moment_span<GROUP>();
  const float4 p = i % SPAN < WARPS ? half[(warp / WARPS) * WARPS + i % SPAN]
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  mean = kiln_span_sum<SPAN>(p.x) * inv_d;
  // m_w - mean; past the group's warps its terms vanish (n_lane and swg are 0 there).
  const float dev = p.x * shares.inv_lane - mean;
  q = kiln_span_sum<SPAN>(p.y + shares.n_lane * dev * dev);
  t = kiln_span_sum<SPAN>(p.z + dev * p.w);
  swg = kiln_span_sum<SPAN>(p.w);
}

// Mean (0 for RMSNorm) and 1 / sqrt(var + eps) of a row held in registers, in exact passes: the
// mean, then the squares about it. RMSNorm and one-warp rows: group sums. LayerNorm over
// several warps: the squares about each warp's own mean, combined after one barrier
// (kiln_group_moments). `shares` (kiln_warp_shares_of) and `inv_d` = 1 / d are taken once per
// block. A vector lies wholly inside d or wholly past it (d is a multiple of N_READS when
// N_READS > 1), so the tail check is one per vector. Every thread of the group must call it.
template <bool RMS, int GROUP, int BLOCK_DIM, int NI, int N_READS>
__device__ __forceinline__ void kiln_row_stats(const float (&v)[NI][N_READS], int lane, int d,
                                               float inv_d, const kiln_warp_shares& shares,
                                               float eps, float* scratch, float2* moments,
                                               int& round, float& mean, float& rstd) {
  constexpr bool MOMENTS = !RMS && GROUP > 32;
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < NI; ++k)
#pragma unroll
    for (int j = 0; j < N_READS; ++j) s += v[k][j];
  float centre = 0.0f;  // the row's mean, or with MOMENTS the warp's
  if constexpr (MOMENTS) {
    s = kiln_warp_sum(s);
    centre = s * shares.inv_own;
  } else if constexpr (!RMS) {
    centre = kiln_group_sum<GROUP, BLOCK_DIM>(s, scratch, round) * inv_d;
  }
  float q = 0.0f;
#pragma unroll
  for (int k = 0; k < NI; ++k) {
    if ((k * GROUP + lane) * N_READS >= d) break;  // zeros past d: their c would be -centre
#pragma unroll
    for (int j = 0; j < N_READS; ++j) {
      const float c = v[k][j] - centre;
      q += c * c;
    }
  }
  if constexpr (MOMENTS) {
    kiln_group_moments<GROUP, BLOCK_DIM>(s, kiln_warp_sum(q), shares, moments, round, inv_d, mean,
                                         q);
  } else {
    mean = centre;
    q = kiln_group_sum<GROUP, BLOCK_DIM>(q, scratch, round);
  }
  rstd = rsqrtf(q * inv_d + eps);
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
