// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) forward for f32 rows too long for one block's
// registers (sm_90; 16-bit rows take norm_fwd_staged.cu, whose ring of shared-memory stages
// keeps more of their bytes in flight than registers can). A thread-block cluster of CLUSTER blocks takes a row, each block a contiguous chunk
// of BLOCK_DIM * ITEMS vectors of x held in registers, so x is read once and y written once.
// The clusters loop over rows (a grid no larger than the GPU holds), loading the next row while
// the current one is reduced; each block keeps its columns of the weight and bias in shared
// memory for all its rows. The statistics are exact two-pass sums over the whole row in one
// exchange a row through distributed shared memory, without cluster barriers (kiln_cluster_sum2;
// LayerNorm's combined from each warp's, kiln_cluster_wait_moments).
{{> prelude}}
{{> norm}}
{{> cluster}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr bool RMS = {{RMS}};
constexpr int ITEMS = {{ITEMS}};
constexpr int CLUSTER = {{CLUSTER}};
static_assert(CLUSTER >= 2 && CLUSTER <= 16, "a cluster of at least two blocks");
// Up to 8 elements a thread (x and the next row's: 16 registers), two blocks share an SM, so
// that one row's exchanges wait while the other's computes.
constexpr int MIN_BLOCKS = ITEMS * N_READS <= 8 ? 2 : 1;

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(BLOCK_DIM, MIN_BLOCKS)
    {{kernel}}(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
               T* __restrict__ y, long long rows, int d, long long x_row_stride,
               long long w_stride, long long b_stride, int w_vec, int b_vec, float eps) {
  __shared__ kiln_cluster_sums<CLUSTER, BLOCK_DIM> sums;
  __shared__ float pair_elements[CLUSTER * BLOCK_DIM / 32];  // LayerNorm's warps' n_w
  if constexpr (!RMS)
    kiln_split_pair_elements<CLUSTER, BLOCK_DIM, N_READS>(pair_elements, d,
                                                           BLOCK_DIM * ITEMS * N_READS, 0);
  kiln_cluster_sums_init(sums);
  // The previous kernel's writes visible (launch_dependent); no global access before this.
  kiln_wait_for_previous_grid();
  int exchange = 0;
  const long long cluster = blockIdx.x / CLUSTER, clusters = gridDim.x / CLUSTER;
  const int base = (int)kiln_cluster_rank() * BLOCK_DIM * ITEMS * N_READS;
  const int left = d - base;  // this chunk's elements run to here (none when <= 0)
  const float inv_d = 1.0f / d;
  // 1 / the elements this warp holds of a row, for LayerNorm's warp means.
  const float inv_warp_elements =
      RMS ? 0.0f : kiln_split_own_inv_elements<BLOCK_DIM>(pair_elements);
  auto inside = [&](int k) { return (k * BLOCK_DIM + (int)threadIdx.x) * N_READS < left; };

  // This chunk of row r (zeros past d, or for rows past the end).
  auto load = [&](long long r, float(&v)[ITEMS][N_READS]) {
    const bool active = r < rows;
    kiln_load_row<ITEMS, N_READS, BLOCK_DIM>(x + (active ? r : 0) * x_row_stride + base, active,
                                            threadIdx.x, left, v);
  };
  // The first row's loads go out before the weights', so that their latencies overlap.
  float v[ITEMS][N_READS];
  load(cluster, v);

  // The weight and bias of this thread's columns, as floats; each thread writes and reads only
  // its own.
  typedef kiln_vec<float, N_READS> F;
  extern __shared__ F w_own[];
  F* b_own = w_own + ITEMS * BLOCK_DIM;
  {
    float wk[ITEMS][N_READS], bk[ITEMS][N_READS];
    const int i0 = base + (int)threadIdx.x * N_READS, step = BLOCK_DIM * N_READS;
    kiln_load_params<ITEMS, N_READS>(w, w_stride, w_vec, i0, step, d, 1.0f, wk);
    kiln_load_params<ITEMS, N_READS>(RMS ? nullptr : b, b_stride, b_vec, i0, step, d, 0.0f, bk);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      F fw, fb;
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        fw.v[j] = wk[k][j];
        fb.v[j] = bk[k][j];
      }
      w_own[k * BLOCK_DIM + threadIdx.x] = fw;
      b_own[k * BLOCK_DIM + threadIdx.x] = fb;
    }
  }
  for (long long row = cluster; row < rows; row += clusters) {
    // The next row's loads go out before this row's exchanges.
    float nv[ITEMS][N_READS];
    load(row + clusters, nv);

    // The row's statistics in one exchange. RMSNorm: the sum of x * x. LayerNorm: each warp's
    // mean m_w and its sum of (x - m_w)^2, which kiln_cluster_wait_moments turns into the exact
    // two-pass sum about the row's mean.
    float m_w = 0.0f;
    if constexpr (!RMS) {
      float s = 0.0f;
#pragma unroll
      for (int k = 0; k < ITEMS; ++k)
#pragma unroll
        for (int j = 0; j < N_READS; ++j) s += v[k][j];  // zeros past the chunk add nothing
      m_w = kiln_warp_sum(s) * inv_warp_elements;
    }
    float mean = 0.0f, q = 0.0f, unused = 0.0f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (!RMS && !inside(k)) break;  // zeros past the chunk: their deviation would be -m_w
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        const float c = v[k][j] - m_w;
        q += c * c;
      }
    }
    if constexpr (RMS) {
      kiln_cluster_sum2(q, unused, sums, exchange);
    } else {
      kiln_cluster_sum_moments(m_w, q, sums, exchange, pair_elements, inv_d, mean);
    }
    const float rstd = rsqrtf(q * inv_d + eps);

    T* yr = y + row * (long long)d;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (!inside(k)) break;
      const int i = base + (k * BLOCK_DIM + (int)threadIdx.x) * N_READS;
      const F fw = w_own[k * BLOCK_DIM + threadIdx.x], fb = b_own[k * BLOCK_DIM + threadIdx.x];
      float o[N_READS];
#pragma unroll
      for (int j = 0; j < N_READS; ++j) o[j] = (v[k][j] - mean) * rstd * fw.v[j] + fb.v[j];
      kiln_store_floats<N_READS>(yr, i, d, o);
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k)
#pragma unroll
      for (int j = 0; j < N_READS; ++j) v[k][j] = nv[k][j];
  }
  // No block may leave while another's pushes into it may still be in flight.
  kiln_cluster_sync();
}
