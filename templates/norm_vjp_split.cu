// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) VJP for rows too long for one block (sm_90), with the
// formulas of norm_vjp.cu. A thread-block cluster of CLUSTER blocks takes a row, each block a
// contiguous chunk of BLOCK_DIM * ITEMS vectors of x and the cotangent held in registers, so
// each is read once. The clusters loop over rows (a grid no larger than the GPU holds), loading
// the next row while the current one is reduced, and each block keeps the partial sums of
// dweight and dbias of its own columns in registers over all its rows: one partial row per
// cluster at the end, which kiln_reduce_cols sums. Row sums are exact two-pass statistics over
// the whole row, combined through distributed shared memory (kiln_cluster_sum2: no cluster
// barrier per row).
{{> prelude}}
{{> norm}}
{{> cluster}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr bool RMS = {{RMS}};
constexpr int ITEMS = {{ITEMS}};
constexpr int CLUSTER = {{CLUSTER}};
// SMEM_SUMS: the partial sums of dweight and dbias in shared memory (each thread its own), not in
// registers, so that 64 registers suffice and two blocks (two rows) share each SM: one row's
// exchanges wait while the other computes (16-bit rows, whose bytes per row are few for the
// exchanges' latency).
constexpr bool SMEM_SUMS = {{SMEM_SUMS}};
static_assert(CLUSTER >= 2 && CLUSTER <= 16, "a cluster of at least two blocks");

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(BLOCK_DIM, SMEM_SUMS ? 2 : 1)
    {{kernel}}(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ g,
               T* __restrict__ dx, float* __restrict__ partial_w, float* __restrict__ partial_b,
               long long rows, int d, long long x_row_stride, long long g_row_stride,
               long long w_stride, int w_vec, float eps, int /* smem_partials: unused */) {
  __shared__ kiln_cluster_sums<CLUSTER, BLOCK_DIM> sums;
  kiln_cluster_sums_init(sums);
  int exchange = 0;
  const long long cluster = blockIdx.x / CLUSTER, clusters = gridDim.x / CLUSTER;
  const int base = (int)kiln_cluster_rank() * BLOCK_DIM * ITEMS * N_READS;
  const int left = d - base;  // this chunk's elements run to here (none when <= 0)
  const float inv_d = 1.0f / d;
  // Vector k of this thread lies at chunk element (k * BLOCK_DIM + threadIdx.x) * N_READS.
  auto inside = [&](int k) { return (k * BLOCK_DIM + (int)threadIdx.x) * N_READS < left; };

  // The weights of this thread's columns, in shared memory (registers hold two rows of x and g
  // and the partial sums), then with SMEM_SUMS the partial sums; each thread writes and reads
  // only its own.
  typedef kiln_vec<float, N_READS> F;
  extern __shared__ F w_own[];
  F* dw_own = w_own + ITEMS * BLOCK_DIM;
  F* db_own = dw_own + ITEMS * BLOCK_DIM;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    float wk[N_READS];
    kiln_load_param<N_READS>(w, w_stride, w_vec,
                             base + (k * BLOCK_DIM + (int)threadIdx.x) * N_READS, d, 1.0f, wk);
    F f;
#pragma unroll
    for (int j = 0; j < N_READS; ++j) f.v[j] = wk[j];
    w_own[k * BLOCK_DIM + threadIdx.x] = f;
  }
  auto weights = [&](int k, float(&wk)[N_READS]) {
    const F f = w_own[k * BLOCK_DIM + threadIdx.x];
#pragma unroll
    for (int j = 0; j < N_READS; ++j) wk[j] = f.v[j];
  };

  float dw[SMEM_SUMS ? 1 : ITEMS][N_READS], db[SMEM_SUMS ? 1 : ITEMS][N_READS];
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    F zero;
#pragma unroll
    for (int j = 0; j < N_READS; ++j) {
      zero.v[j] = 0.0f;
      if constexpr (!SMEM_SUMS) dw[k][j] = db[k][j] = 0.0f;
    }
    if constexpr (SMEM_SUMS) dw_own[k * BLOCK_DIM + threadIdx.x] = db_own[k * BLOCK_DIM + threadIdx.x] = zero;
  }
  // Vector k of the thread's partial sums: registers, or a copy of its shared memory slots.
  auto partials = [&](int k, float(&pw)[N_READS], float(&pb)[N_READS]) {
    if constexpr (SMEM_SUMS) {
      const F a = dw_own[k * BLOCK_DIM + threadIdx.x], b = db_own[k * BLOCK_DIM + threadIdx.x];
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        pw[j] = a.v[j];
        pb[j] = b.v[j];
      }
    } else {
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        pw[j] = dw[k][j];
        pb[j] = db[k][j];
      }
    }
  };
  auto keep = [&](int k, const float(&pw)[N_READS], const float(&pb)[N_READS]) {
    if constexpr (SMEM_SUMS) {
      F a, b;
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        a.v[j] = pw[j];
        b.v[j] = pb[j];
      }
      dw_own[k * BLOCK_DIM + threadIdx.x] = a;
      db_own[k * BLOCK_DIM + threadIdx.x] = b;
    } else {
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        dw[k][j] = pw[j];
        db[k][j] = pb[j];
      }
    }
  };

  // This chunk of row r of x and g (zeros past d, or for rows past the end).
  auto load = [&](long long r, float(&xv)[ITEMS][N_READS], float(&gv)[ITEMS][N_READS]) {
    const bool active = r < rows;
    const long long rr = active ? r : 0;
    kiln_load_row<ITEMS, N_READS, BLOCK_DIM>(x + rr * x_row_stride + base, active, threadIdx.x,
                                            left, xv);
    kiln_load_row<ITEMS, N_READS, BLOCK_DIM>(g + rr * g_row_stride + base, active, threadIdx.x,
                                            left, gv);
  };
  float xv[ITEMS][N_READS], gv[ITEMS][N_READS];
  load(cluster, xv, gv);
  for (long long row = cluster; row < rows; row += clusters) {
    // The next row's loads go out before this row's barriers.
    float nx[ITEMS][N_READS], ng[ITEMS][N_READS];
    load(row + clusters, nx, ng);

    float mean = 0.0f, c2 = 0.0f;
    if constexpr (!RMS) {
      float s_x = 0.0f, s_wg = 0.0f;
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        float wk[N_READS];
        weights(k, wk);
#pragma unroll
        for (int j = 0; j < N_READS; ++j) {
          s_x += xv[k][j];
          s_wg += wk[j] * gv[k][j];
        }
      }
      kiln_cluster_sum2(s_x, s_wg, sums, exchange);
      mean = s_x * inv_d;
      c2 = s_wg * inv_d;
    }
    float q = 0.0f, t = 0.0f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (!inside(k)) break;  // zeros past d: their c would be -mean
      float wk[N_READS];
      weights(k, wk);
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        const float c = xv[k][j] - mean;
        q += c * c;
        t += wk[j] * gv[k][j] * c;
      }
    }
    kiln_cluster_sum2(q, t, sums, exchange);
    const float rstd = rsqrtf(q * inv_d + eps);
    const float c1 = rstd * t * inv_d;  // mean(wg * xhat)

    T* dxr = dx + row * (long long)d;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (!inside(k)) break;
      const int i = base + (k * BLOCK_DIM + (int)threadIdx.x) * N_READS;
      float wk[N_READS], o[N_READS], pw[N_READS], pb[N_READS];
      weights(k, wk);
      partials(k, pw, pb);
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        // Vectors past d are never reached (d is a multiple of N_READS).
        const float xh = (xv[k][j] - mean) * rstd;
        pw[j] += gv[k][j] * xh;
        pb[j] += gv[k][j];
        o[j] = rstd * (wk[j] * gv[k][j] - c2 - xh * c1);
      }
      keep(k, pw, pb);
      kiln_store_floats<N_READS>(dxr, i, d, o);
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k)
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        xv[k][j] = nx[k][j];
        gv[k][j] = ng[k][j];
      }
  }

  // This cluster's partial sums of its columns: one row of partial_w / partial_b.
  float* pw = partial_w + cluster * d;
  float* pb = partial_b + cluster * d;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    if (!inside(k)) break;
    const int i = base + (k * BLOCK_DIM + (int)threadIdx.x) * N_READS;
    float sw[N_READS], sb[N_READS];
    partials(k, sw, sb);
    if (partial_w) kiln_store_floats<N_READS>(pw, i, d, sw);
    if (partial_b) kiln_store_floats<N_READS>(pb, i, d, sb);
  }
  // No block may leave while another's pushes into it may still be in flight.
  kiln_cluster_sync();
}
