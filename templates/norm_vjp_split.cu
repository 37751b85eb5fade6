// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) VJP for rows too long for one block (sm_90), with the
// formulas of norm_vjp.cu. A thread-block cluster of CLUSTER blocks takes a row, each block a
// contiguous chunk of it (kiln_split_chunk elements) of x and the cotangent, so each is read
// once. The clusters loop over rows (a grid no larger than the GPU holds); each block's chunks
// arrive through a ring of shared-memory stages filled by bulk copies (bulk.cuh), so the next
// rows are in flight while one is reduced whatever the registers, and each block keeps the
// partial sums of dweight and dbias of its own columns over all its rows: one partial row per
// cluster at the end, which kiln_reduce_cols sums. A row's statistics take one exchange through
// distributed shared memory (cluster.cuh: no cluster barrier per row), a push from each warp or
// (BY_BLOCK) each block, LayerNorm's as exact two-pass sums (kiln_cluster_wait_moments); with
// PIPELINE each row's exchange overlaps the next row's.
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
// PIPELINE: each row's exchange overlapped with the next row's (see the row loop). 1: the next
// row's sums read from its stage, which costs a second read of each staged chunk (it pays where
// exchanges are slowest, in clusters of 16); 2: both rows held in registers as loaded (vectors of
// T, widened at each use), so each chunk is read from its stage once.
constexpr int PIPELINE = {{PIPELINE}};
static_assert(PIPELINE >= 0 && PIPELINE <= 2, "PIPELINE is 0, 1 or 2");
static_assert(CLUSTER >= 2 && CLUSTER <= 16, "a cluster of at least two blocks");
// BY_BLOCK: each block's warps' sums combined before they are pushed, one push a block
// (kiln_cluster_push_block), where an exchange would otherwise receive more than 128 pushes,
// every warp of every block reading them all: in clusters of 16 (256 pushes), H100, LayerNorm
// 1.11-1.13x at 100,000 and 131,072 16-bit elements (131,072: 61% -> 67-68% of copy) and 1.14x
// at 70,000 f32 ones (79% -> 91%), RMSNorm 1.00-1.05x. In clusters of up to 8 the block's
// barrier and combine on each exchange's path cost more than the reads they save: LayerNorm
// 0.84-0.97x (16,385 to 70,000), RMSNorm 0.97-1.01x.
constexpr bool BY_BLOCK = CLUSTER * (BLOCK_DIM / 32) > 128;
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
  __shared__ kiln_cluster_sums<CLUSTER, BLOCK_DIM, RMS ? 2 : 4, BY_BLOCK> sums;
  __shared__ float pair_elements[CLUSTER * BLOCK_DIM / 32];  // LayerNorm's warps' n_w
  __shared__ float block_elements[BY_BLOCK ? CLUSTER : 1];   // and its blocks' n_b (BY_BLOCK)
  __shared__ unsigned long long full[STAGES];
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) kiln_mbarrier_init(&full[s], 1);
  }
  // Its cluster barrier also makes the stages' mbarriers visible before the first copy.
  if constexpr (!RMS) {
    kiln_split_pair_elements<CLUSTER, BLOCK_DIM, N_READS>(pair_elements, d,
                                                           kiln_split_chunk(d, CLUSTER), 0);
    if constexpr (BY_BLOCK)
      kiln_split_block_elements<CLUSTER>(block_elements, d, kiln_split_chunk(d, CLUSTER));
  }
  kiln_cluster_sums_init(sums);
  // The previous kernel's writes visible (launch_dependent); no global access before this.
  kiln_wait_for_previous_grid();
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
  typedef kiln_vec<T, N_READS> V;
  extern __shared__ __align__(128) unsigned char smem[];
  F* w_own = reinterpret_cast<F*>(smem + STAGES * 2 * CHUNK_BYTES);
  F* dw_own = w_own + ITEMS * BLOCK_DIM;
  F* db_own = dw_own + ITEMS * BLOCK_DIM;
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
  // The weights load after the first rows' copies have gone out, so that their latency is spent
  // with rows in flight.
  {
    float wk[ITEMS][N_READS];
    kiln_load_params<ITEMS, N_READS>(w, w_stride, w_vec, base + at(0), BLOCK_DIM * N_READS,
                                     base + len, 1.0f, wk);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      F f;
#pragma unroll
      for (int j = 0; j < N_READS; ++j) f.v[j] = wk[k][j];
      w_own[k * BLOCK_DIM + threadIdx.x] = f;
    }
  }
  // Vector k of this thread in a staged chunk as floats (zeros past the chunk: a vector lies
  // wholly inside it or wholly past it, len being a multiple of N_READS when N_READS > 1).
  auto unstage = [&](const unsigned char* chunk_at, int offset, int k, float(&v)[N_READS]) {
    if (inside(k)) {
      const V r = reinterpret_cast<const V*>(reinterpret_cast<const T*>(chunk_at) + offset)
          [k * BLOCK_DIM + threadIdx.x];
      kiln_widen(r, v);
    } else {
#pragma unroll
      for (int j = 0; j < N_READS; ++j) v[j] = 0.0f;
    }
  };
  // The stage of turn `turn` (row cluster + turn * clusters), once its copies have landed, and
  // where in it the row's chunks of x and g start (vectorised rows are 16-byte aligned, the op
  // checks, so their chunks start on a granule).
  struct Staged {
    const unsigned char* x;
    const unsigned char* g;
    int x_offset, g_offset;
  };
  auto staged = [&](long long r, int turn) {
    const int stage = turn % STAGES;
    kiln_mbarrier_wait(&full[stage], (turn / STAGES) & 1);
    const unsigned char* at_stage = smem + stage * 2 * CHUNK_BYTES;
    return Staged{at_stage, at_stage + CHUNK_BYTES,
                  N_READS > 1 ? 0 : kiln_granule_offset(x + r * x_row_stride + base),
                  N_READS > 1 ? 0 : kiln_granule_offset(g + r * g_row_stride + base)};
  };
  // The row's values vector k by vector k: from `st`, the stage of the row after the one in
  // registers (PIPELINE 1), or from registers when st is null: floats, or with PIPELINE 2 the
  // current row's vectors as loaded (xr, gr) or, with `next`, the next row's (xn, gn).
  constexpr int HELD = PIPELINE == 2 ? ITEMS : 1;
  float xv[PIPELINE == 2 ? 1 : ITEMS][N_READS], gv[PIPELINE == 2 ? 1 : ITEMS][N_READS];
  V xr[HELD], gr[HELD], xn[HELD], gn[HELD];
  auto widen = [&](const V& r, int k, float(&v)[N_READS]) {
    kiln_widen(r, v);
#pragma unroll
    for (int j = 0; j < N_READS; ++j) v[j] = inside(k) ? v[j] : 0.0f;
  };
  // PIPELINE 2: vector k of a staged row into registers as it is (past the chunk: never read).
  auto hold = [&](const Staged& st, int k, V& xk, V& gk) {
    if (inside(k)) {
      xk = reinterpret_cast<const V*>(reinterpret_cast<const T*>(st.x) + st.x_offset)
          [k * BLOCK_DIM + threadIdx.x];
      gk = reinterpret_cast<const V*>(reinterpret_cast<const T*>(st.g) + st.g_offset)
          [k * BLOCK_DIM + threadIdx.x];
    }
  };
  auto values = [&](const Staged* st, int k, float(&xk)[N_READS], float(&gk)[N_READS],
                    bool next = false) {
    if (st) {
      unstage(st->x, st->x_offset, k, xk);
      unstage(st->g, st->g_offset, k, gk);
    } else if constexpr (PIPELINE == 2) {
      widen(next ? xn[k] : xr[k], k, xk);
      widen(next ? gn[k] : gr[k], k, gk);
    } else {
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        xk[j] = xv[k][j];
        gk[j] = gv[k][j];
      }
    }
  };
  // 1 / the elements this warp holds of a row, for LayerNorm's warp means.
  const float inv_warp_elements =
      RMS ? 0.0f : kiln_split_own_inv_elements<BLOCK_DIM>(pair_elements);
  const float own_block_elements = BY_BLOCK && !RMS ? block_elements[kiln_cluster_rank()] : 0.0f;
  const float inv_block_elements = own_block_elements > 0.0f ? 1.0f / own_block_elements : 0.0f;
  // Pushes a row's one exchange. RMSNorm: the sums of x * x and w * g * x. LayerNorm: the warp's
  // mean m_w of x, then its sums of (x - m_w)^2, w * g and w * g * (x - m_w), which
  // kiln_cluster_wait_moments (and with BY_BLOCK the block's push first) turn into exact
  // two-pass sums about the row's mean.
  auto push_row = [&](const Staged* st, bool next = false) {
    float sum = 0.0f, m_w = 0.0f;
    if constexpr (!RMS) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        float xk[N_READS], gk[N_READS];
        values(st, k, xk, gk, next);  // zeros past the chunk add nothing
#pragma unroll
        for (int j = 0; j < N_READS; ++j) sum += xk[j];
      }
      m_w = kiln_warp_sum(sum) * inv_warp_elements;
    }
    float q = 0.0f, swg = 0.0f, t = 0.0f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      // Zeros past the chunk add nothing to RMSNorm's sums, but LayerNorm's deviation would be
      // -m_w.
      if (!RMS && !inside(k)) break;
      float xk[N_READS], gk[N_READS], wk[N_READS];
      values(st, k, xk, gk, next);
      weights(k, wk);
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        const float c = xk[j] - m_w, wg = wk[j] * gk[j];
        q += c * c;
        swg += wg;
        t += wg * c;
      }
    }
    const float s_q = kiln_warp_sum(q), s_t = kiln_warp_sum(t);
    const float rms[2] = {s_q, s_t}, layer[4] = {m_w, s_q, kiln_warp_sum(swg), s_t};
    // This block's warps' n_w and 1 / n_b, for BY_BLOCK's combine of LayerNorm's moments.
    const float* own_warps = pair_elements + kiln_cluster_rank() * (BLOCK_DIM / 32);
    return kiln_cluster_push(RMS ? rms : layer, sums, exchange, 0, RMS ? nullptr : own_warps,
                             inv_block_elements);
  };

  // With PIPELINE, rows overlap: a row's exchange is pushed, then the next row's (summed from
  // its stage), and only then is the first awaited, so that each exchange's latency is spent on
  // the other's work. Every warp still waits on an exchange before it pushes the one two after
  // it (kiln_cluster_push's rule).
  // PIPELINE 2 holds a row in registers a turn before its outputs: the row of `turn` is loaded
  // from its stage, which then takes the row STAGES turns ahead, and its exchange pushed.
  // LayerNorm's copies are issued by the block's last warp after its push, off warp 0's path
  // (warp 0 pushes, with block pushes after it has combined the block's sums, then waits on the
  // exchange). On an H100, 16-bit rows, against thread 0 issuing them before its push: 18,432
  // elements (clusters of 3) 1.05-1.08x; at 100,000 and 131,072 (clusters of 16), with the block
  // pushes' one round of sums (cluster.cuh), 1.20-1.28x. RMSNorm, whose push is shorter, issues
  // them first (thread 0): after its push (warp 0) it ran 0.94-0.99x at 100,000 and 131,072.
  auto hold_next = [&](long long r, int turn) {
    const Staged st = staged(r, turn);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) hold(st, k, xn[k], gn[k]);
    __syncthreads();
    auto refill = [&](unsigned by) {
      if (threadIdx.x == by && r + STAGES * clusters < rows) {
        kiln_bulk_fence();
        fetch(r + STAGES * clusters, turn % STAGES);
      }
    };
    if constexpr (RMS) refill(0);
    const int n = push_row(nullptr, true);
    if constexpr (!RMS) refill(BLOCK_DIM - 32);
    return n;
  };
  int pushed = 0;
  if (PIPELINE == 1 && cluster < rows) {
    const Staged first = staged(cluster, 0);
    pushed = push_row(&first);
  }
  if (PIPELINE == 2 && cluster < rows) pushed = hold_next(cluster, 0);
  int turn = 0;
  for (long long row = cluster; row < rows; row += clusters, ++turn) {
    int this_row;
    if constexpr (PIPELINE == 2) {
      // The row pushed a turn ago moves to the current registers; the next is held and pushed.
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        xr[k] = xn[k];
        gr[k] = gn[k];
      }
      this_row = pushed;
      if (row + clusters < rows) pushed = hold_next(row + clusters, turn + 1);
    } else {
      const Staged st = staged(row, turn);
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) values(&st, k, xv[k], gv[k]);
      // Every thread has its values: the stage takes the row STAGES turns ahead.
      __syncthreads();
      if (threadIdx.x == 0 && row + STAGES * clusters < rows) {
        kiln_bulk_fence();
        fetch(row + STAGES * clusters, turn % STAGES);
      }
      this_row = PIPELINE ? pushed : push_row(nullptr);
      if (PIPELINE && row + clusters < rows) {
        const Staged next = staged(row + clusters, turn + 1);
        pushed = push_row(&next);
      }
    }
    // The row's statistics: mean, the centred sum of squares q, mean(w * g) and the sum of
    // w * g * (x - mean) (RMSNorm: x itself, mean 0).
    float mean = 0.0f, q, c2 = 0.0f, t;
    if constexpr (RMS) {
      kiln_cluster_wait2(sums, this_row, q, t);
    } else {
      float swg;
      const float* pushers = BY_BLOCK ? block_elements : pair_elements;
      kiln_cluster_wait_moments(sums, this_row, pushers, inv_d, mean, q, swg, t);
      c2 = swg * inv_d;
    }
    const float rstd = rsqrtf(q * inv_d + eps);
    const float c1 = rstd * t * inv_d;  // mean(wg * xhat)

    T* dxr = dx + row * (long long)d + base;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (!inside(k)) break;
      float wk[N_READS], o[N_READS], pw[N_READS], pb[N_READS], xk[N_READS], gk[N_READS];
      weights(k, wk);
      partials(k, pw, pb);
      values(nullptr, k, xk, gk);
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        // Vectors past d are never reached (d is a multiple of N_READS).
        const float xh = (xk[j] - mean) * rstd;
        pw[j] += gk[j] * xh;
        pb[j] += gk[j];
        o[j] = rstd * (wk[j] * gk[j] - c2 - xh * c1);
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
