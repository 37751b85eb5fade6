// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) VJP for rows too long for one block (sm_90), with the
// formulas of norm_vjp.cu. A thread-block cluster of CLUSTER blocks takes a row, each block a
// contiguous chunk of it (kiln_split_chunk elements) of x and the cotangent, so each is read
// once. The clusters loop over rows (a grid no larger than the GPU holds); each block's chunks
// arrive through a ring of shared-memory stages filled by bulk copies (bulk.cuh), so the next
// rows are in flight while one is reduced whatever the registers, and each block keeps the
// partial sums of dweight and dbias of its own columns over all its rows: one partial row per
// cluster at the end, which kiln_reduce_cols sums. Row sums are exact two-pass statistics over
// the whole row, combined through distributed shared memory (kiln_cluster_sum2: no cluster
// barrier per row).
{{> prelude}}
{{> tma}}
{{> cluster}}
{{> bulk}}

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
// Elements of a row one block holds: ITEMS vectors of N_READS per thread.
constexpr int CAPACITY = BLOCK_DIM * ITEMS * N_READS;
constexpr int CHUNK_BYTES = kiln_chunk_bytes<T, CAPACITY>();
// A stage holds a chunk of x and one of the cotangent. Three stages (two rows in flight while
// one is reduced) for chunks of up to 16 KiB, else two (f32 rows of 16 elements a thread, whose
// three stages would not fit beside the weights); the host's vjp_split_stages says the same.
constexpr int STAGES = CAPACITY * (int)sizeof(T) <= 16 * 1024 ? 3 : 2;

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(BLOCK_DIM, SMEM_SUMS ? 2 : 1)
    {{kernel}}(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ g,
               T* __restrict__ dx, float* __restrict__ partial_w, float* __restrict__ partial_b,
               long long rows, int d, long long x_row_stride, long long g_row_stride,
               long long w_stride, int w_vec, float eps, int /* smem_partials: unused */) {
  __shared__ kiln_cluster_sums<CLUSTER, BLOCK_DIM> sums;
  __shared__ unsigned long long full[STAGES];
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) kiln_mbarrier_init(&full[s], 1);
  }
  // Its cluster barrier also makes the stages' mbarriers visible before the first copy.
  kiln_cluster_sums_init(sums);
  int exchange = 0;
  const long long cluster = blockIdx.x / CLUSTER, clusters = gridDim.x / CLUSTER;
  const int chunk = kiln_split_chunk(d, CLUSTER);
  const int base = (int)kiln_cluster_rank() * chunk;
  const int len = min(chunk, d - base);  // this block's elements of a row (none when <= 0)
  const float inv_d = 1.0f / d;
  // Vector k of this thread lies at chunk element (k * BLOCK_DIM + threadIdx.x) * N_READS.
  auto at = [&](int k) { return (k * BLOCK_DIM + (int)threadIdx.x) * N_READS; };
  auto inside = [&](int k) { return at(k) < len; };

  // The weights of this thread's columns, in shared memory (registers hold a row's x and g and
  // the partial sums), then with SMEM_SUMS the partial sums; each thread writes and reads
  // only its own.
  // Dynamic shared memory: the stages (x then the cotangent), then the weights and partial sums.
  typedef kiln_vec<float, N_READS> F;
  extern __shared__ __align__(128) unsigned char smem[];
  F* w_own = reinterpret_cast<F*>(smem + STAGES * 2 * CHUNK_BYTES);
  F* dw_own = w_own + ITEMS * BLOCK_DIM;
  F* db_own = dw_own + ITEMS * BLOCK_DIM;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    float wk[N_READS];
    kiln_load_param<N_READS>(w, w_stride, w_vec, base + at(k), base + len, 1.0f, wk);
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

  // Thread 0: row r's chunks of x and g into `stage`.
  auto fetch = [&](long long r, int stage) {
    unsigned char* into = smem + stage * 2 * CHUNK_BYTES;
    const kiln_span sx = kiln_granules(x + r * x_row_stride + base, len);
    const kiln_span sg = kiln_granules(g + r * g_row_stride + base, len);
    kiln_bulk_arrive(&full[stage], sx.bytes + sg.bytes);
    kiln_bulk_copy(into, sx, &full[stage]);
    kiln_bulk_copy(into + CHUNK_BYTES, sg, &full[stage]);
  };
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s)
      if (cluster + s * clusters < rows) fetch(cluster + s * clusters, s);
  }
  // This thread's vectors of a staged chunk as floats (zeros past the chunk: a vector lies
  // wholly inside it or wholly past it, len being a multiple of N_READS when N_READS > 1).
  typedef kiln_vec<T, N_READS> V;
  auto unstage = [&](const unsigned char* at_stage, int offset, float(&v)[ITEMS][N_READS]) {
    const V* staged = reinterpret_cast<const V*>(reinterpret_cast<const T*>(at_stage) + offset);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (inside(k)) {
        const V r = staged[k * BLOCK_DIM + threadIdx.x];
#pragma unroll
        for (int j = 0; j < N_READS; ++j) v[k][j] = kiln_to_float(r.v[j]);
      } else {
#pragma unroll
        for (int j = 0; j < N_READS; ++j) v[k][j] = 0.0f;
      }
    }
  };

  int turn = 0;
  for (long long row = cluster; row < rows; row += clusters, ++turn) {
    const int stage = turn % STAGES;
    kiln_mbarrier_wait(&full[stage], (turn / STAGES) & 1);
    // Vectorised rows are 16-byte aligned (the op checks), so their chunks start on a granule.
    const int x_offset = N_READS > 1 ? 0 : kiln_granule_offset(x + row * x_row_stride + base);
    const int g_offset = N_READS > 1 ? 0 : kiln_granule_offset(g + row * g_row_stride + base);
    float xv[ITEMS][N_READS], gv[ITEMS][N_READS];
    unstage(smem + stage * 2 * CHUNK_BYTES, x_offset, xv);
    unstage(smem + stage * 2 * CHUNK_BYTES + CHUNK_BYTES, g_offset, gv);
    // Every thread has its values: the stage takes the row STAGES turns ahead.
    __syncthreads();
    if (threadIdx.x == 0 && row + STAGES * clusters < rows) {
      kiln_bulk_fence();
      fetch(row + STAGES * clusters, stage);
    }

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

    T* dxr = dx + row * (long long)d + base;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (!inside(k)) break;
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
      kiln_store_floats<N_READS>(dxr, at(k), len, o);
    }
  }

  // This cluster's partial sums of its columns: one row of partial_w / partial_b.
  float* pw = partial_w + cluster * d + base;
  float* pb = partial_b + cluster * d + base;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    if (!inside(k)) break;
    float sw[N_READS], sb[N_READS];
    partials(k, sw, sb);
    if (partial_w) kiln_store_floats<N_READS>(pw, at(k), len, sw);
    if (partial_b) kiln_store_floats<N_READS>(pb, at(k), len, sb);
  }
  // No block may leave while another's pushes into it may still be in flight.
  kiln_cluster_sync();
}
