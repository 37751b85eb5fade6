// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) forward for 16-bit rows too long for one block
// (sm_90; f32 rows take norm_fwd_split.cu, whose registers hold enough of their bytes in flight
// at less cost). A thread-block cluster of CLUSTER blocks takes a row, each block a contiguous
// chunk of it (kiln_split_chunk elements), so x is read once and y written once. The clusters
// loop over rows (a grid no larger than the GPU holds), claiming them at run time where the
// host passes a counter and their columns are not shifted (cluster.cuh's kiln_cluster_send_row:
// clusters on a GPU run at different speeds, so fixed rows leave the fastest idle at the end).
// Each block's chunks arrive through a ring of STAGES shared-memory stages filled by bulk copies
// (bulk.cuh), so STAGES - 1 rows are in flight while one is reduced whatever the registers; the
// block keeps its columns of the weight and bias in shared memory for all its rows. The
// statistics are exact two-pass sums over the whole row in one exchange a row through
// distributed shared memory, without cluster barriers (kiln_cluster_sum2; LayerNorm's combined
// from each warp's, kiln_cluster_wait_moments).
// SHIFTED: rows that do not start on a 16-byte granule (odd lengths) still move whole vectors:
// a thread's columns are shifted onto the granules of the cluster's first row (bulk.cuh), and
// the host makes every row a cluster takes start like it. A constant, so that aligned rows keep
// their code, which has no element of a vector to mask.
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
constexpr bool SHIFTED = {{SHIFTED}};
// Two blocks an SM for blocks of 24 elements a thread (the host's `paired`): 64 registers a
// thread, and stages sized by the row's chunk, not the block's capacity (which the host passes
// as the launch's shared memory). Blocks of up to 16 elements hold two an SM anyway.
constexpr bool PAIRED = {{PAIRED}};
static_assert(!PAIRED || (ITEMS * N_READS > 16 && ITEMS * N_READS <= 24), "paired: 24 elements");
// Rows claimed at run time where the host passes a counter (row_claims), never with shifted
// columns: the host makes every row a cluster takes there start in its granules as the first
// does, which fixed rows keep.
constexpr bool CLAIMS = !SHIFTED;
static_assert(!SHIFTED || N_READS > 1, "columns shift by parts of a vector");
static_assert(CLUSTER >= 2 && CLUSTER <= 16, "a cluster of at least two blocks");
// Elements of a row one block holds: ITEMS vectors of N_READS per thread.
constexpr int CAPACITY = BLOCK_DIM * ITEMS * N_READS;
// Three stages: two rows' copies in flight while the third is reduced (the host's ring_bytes
// counts the same).
constexpr int STAGES = 3;
// Claimed rows: the row of turn t + LEAD is claimed at turn t, a turn before its copy goes out.
constexpr int LEAD = STAGES + 1;
static_assert(LEAD <= 4, "kiln_claimed_rows' ring holds rows four turns ahead");
constexpr int CHUNK_BYTES = kiln_chunk_bytes<T, CAPACITY>();
// Chunks of 16 KiB leave room for two blocks an SM; longer ones (up to a 164 KiB ring and
// weights) for one, which may then take all of its registers, unless PAIRED.
constexpr int BLOCKS_PER_SM = ITEMS * N_READS <= 16 || PAIRED ? 2 : 1;

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1)
    __launch_bounds__(BLOCK_DIM, BLOCKS_PER_SM) {{kernel}}(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
               T* __restrict__ y, long long rows, int d, long long x_row_stride,
               long long w_stride, long long b_stride, int w_vec, int b_vec, float eps,
               unsigned long long* __restrict__ row_claims) {
  __shared__ kiln_cluster_sums<CLUSTER, BLOCK_DIM> sums;
  __shared__ float pair_elements[CLUSTER * BLOCK_DIM / 32];  // LayerNorm's warps' n_w
  __shared__ unsigned long long full[STAGES];
  __shared__ kiln_claimed_rows claimed;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) kiln_mbarrier_init(&full[s], 1);
  }
  const long long cluster = blockIdx.x / CLUSTER, clusters = gridDim.x / CLUSTER;
  const bool claims = CLAIMS && row_claims != nullptr;
  auto row_at = [&](int turn) {
    return claims ? kiln_row_at<LEAD>(claimed, cluster, clusters, turn) : cluster + turn * clusters;
  };
  // Rank 0, thread 0: the claim for the next row to send (kiln_cluster_send_row).
  unsigned long long ticket = KILN_NO_TICKET;
  const int chunk = kiln_split_chunk(d, CLUSTER);
  const int base = (int)kiln_cluster_rank() * chunk;
  const int len = min(chunk, d - base);  // this block's elements of a row (none when <= 0)
  // The columns' shift onto the granules: the first row's offset (the same in every block).
  const int shift =
      SHIFTED && cluster < rows ? kiln_granule_offset(x + cluster * x_row_stride + base) : 0;
  // Its cluster barrier also makes the stages' mbarriers visible before the first copy.
  if constexpr (!RMS)
    kiln_split_pair_elements<CLUSTER, BLOCK_DIM, N_READS>(pair_elements, d, chunk, shift);
  kiln_cluster_sums_init(sums);
  // The previous kernel's writes visible (launch_dependent); no global access before this.
  kiln_wait_for_previous_grid();
  if (claims && kiln_cluster_rank() == 0 && threadIdx.x == 0) ticket = atomicAdd(row_claims, 1ull);
  int exchange = 0;
  const float inv_d = 1.0f / d;
  // 1 / the elements this warp holds of a row, for LayerNorm's warp means.
  const float inv_warp_elements =
      RMS ? 0.0f : kiln_split_own_inv_elements<BLOCK_DIM>(pair_elements);
  // Vector k of this thread lies at chunk element (k * BLOCK_DIM + threadIdx.x) * N_READS.
  auto at = [&](int k) { return (k * BLOCK_DIM + (int)threadIdx.x) * N_READS; };

  // Dynamic shared memory: the stages, then this block's columns of the weight and bias (as T,
  // each thread writing and reading only its own vectors). PAIRED: each stage sized by the chunk
  // and only the vectors the stores read (the chunk, shifted by less than a vector), so that
  // two blocks fit an SM; the host's launch_bytes counts the same.
  typedef kiln_vec<T, N_READS> V;
  extern __shared__ __align__(128) unsigned char smem[];
  const int chunk_bytes = PAIRED ? kiln_chunk_bytes_of<T>(chunk) : CHUNK_BYTES;
  const int own_vectors = PAIRED ? min(ITEMS * BLOCK_DIM, chunk / N_READS + 1) : ITEMS * BLOCK_DIM;
  V* w_own = reinterpret_cast<V*>(smem + STAGES * chunk_bytes);
  V* b_own = w_own + own_vectors;

  // Thread 0: row r's chunk into `stage`.
  auto fetch = [&](long long r, int stage) {
    const kiln_span span = kiln_granules(x + r * x_row_stride + base, len);
    kiln_bulk_arrive(&full[stage], span.bytes);
    kiln_bulk_copy(smem + stage * chunk_bytes, span, &full[stage]);
  };
  // The first rows' copies go out before the weights load, so that the weights' latency is
  // spent with rows in flight.
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s)
      if (row_at(s) < rows) fetch(row_at(s), s);
  }
  {
    float wk[ITEMS][N_READS], bk[ITEMS][N_READS];
    const int step = BLOCK_DIM * N_READS;
    kiln_load_params_shifted<ITEMS, N_READS>(w, w_stride, w_vec, base, at(0), step, len, shift,
                                             1.0f, wk);
    kiln_load_params_shifted<ITEMS, N_READS>(RMS ? nullptr : b, b_stride, b_vec, base, at(0),
                                             step, len, shift, 0.0f, bk);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (PAIRED && k * BLOCK_DIM + (int)threadIdx.x >= own_vectors) break;
      V vw, vb;
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        vw.v[j] = kiln_from_float<T>(wk[k][j]);
        vb.v[j] = kiln_from_float<T>(bk[k][j]);
      }
      w_own[k * BLOCK_DIM + threadIdx.x] = vw;
      if constexpr (!RMS) b_own[k * BLOCK_DIM + threadIdx.x] = vb;
    }
  }

  for (int turn = 0;; ++turn) {
    const long long row = row_at(turn);
    if (row >= rows) break;
    const int stage = turn % STAGES;
    kiln_mbarrier_wait(&full[stage], (turn / STAGES) & 1);
    // Vectorised rows are 16-byte aligned (the op checks), so their chunks start on a granule;
    // shifted ones as far into it as the shift.
    const int offset = N_READS > 1 ? 0 : kiln_granule_offset(x + row * x_row_stride + base);
    if constexpr (SHIFTED) kiln_check_shift(kiln_granule_offset(x + row * x_row_stride + base), shift);
    const T* staged = reinterpret_cast<const T*>(smem + stage * chunk_bytes) + offset;
    float v[ITEMS][N_READS];
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if constexpr (SHIFTED) {
        kiln_unstage_shifted<N_READS>(staged, shift, at(k), len, v[k]);
        continue;
      }
      // A vector lies wholly inside the chunk or wholly past it (len is a multiple of N_READS
      // when N_READS > 1).
      if (at(k) < len) {
        const V r = reinterpret_cast<const V*>(staged)[k * BLOCK_DIM + threadIdx.x];
        kiln_widen(r, v[k]);
      } else {
#pragma unroll
        for (int j = 0; j < N_READS; ++j) v[k][j] = 0.0f;
      }
    }
    // Every thread has its values: the stage takes the row STAGES turns ahead. RMSNorm's thread 0
    // issues the copies now; LayerNorm's last warp after its push (below), off warp 0's path to
    // the exchange, as the split VJP does.
    __syncthreads();
    auto refill = [&](unsigned by) {
      if (threadIdx.x == by && row_at(turn + STAGES) < rows) {
        kiln_bulk_fence();
        fetch(row_at(turn + STAGES), stage);
      }
    };
    if constexpr (RMS) refill(0);

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
      // Zeros outside the chunk: their deviation would be -m_w.
      if (!RMS && at(k) - shift >= len) break;
      const bool whole = RMS || !SHIFTED || kiln_whole<N_READS>(at(k), shift, len);
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        const float c = whole || kiln_inside(at(k), shift, j, len) ? v[k][j] - m_w : 0.0f;
        q += c * c;
      }
    }
    if (claims && kiln_cluster_rank() == 0 && threadIdx.x < 32) {
      kiln_cluster_send_row<LEAD>(row_claims, ticket, rows, clusters, turn + LEAD, claimed, sums,
                                  exchange);
    }
    const int sent = claims ? 8 : 0;  // the claimed row's bytes on the exchange
    if constexpr (RMS) {
      kiln_cluster_sum2(q, unused, sums, exchange, sent);
    } else {
      const float pushed[2] = {m_w, kiln_warp_sum(q)};
      const int n = kiln_cluster_push(pushed, sums, exchange, sent);
      refill(BLOCK_DIM - 32);
      kiln_cluster_wait_moments(sums, n, pair_elements, inv_d, mean, q, unused, unused);
    }
    const float rstd = rsqrtf(q * inv_d + eps);

    T* yr = y + row * (long long)d + base;
    if constexpr (SHIFTED) kiln_check_shift(kiln_granule_offset(yr), shift);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (at(k) - shift >= len) break;
      const V vw = w_own[k * BLOCK_DIM + threadIdx.x];
      V vb;
      if constexpr (!RMS) vb = b_own[k * BLOCK_DIM + threadIdx.x];
      float o[N_READS], wf[N_READS], bf[N_READS];
      kiln_widen(vw, wf);
      if constexpr (!RMS) kiln_widen(vb, bf);
#pragma unroll
      for (int j = 0; j < N_READS; ++j) {
        o[j] = (v[k][j] - mean) * rstd * wf[j];
        if constexpr (!RMS) o[j] += bf[j];
      }
      if constexpr (SHIFTED) {
        kiln_store_shifted<N_READS>(yr, shift, at(k), len, o);
      } else {
        kiln_store_floats<N_READS>(yr, at(k), len, o);
      }
    }
  }
  // A ticket never sent (a cluster with no rows) may still be the grid's last.
  if (claims && kiln_cluster_rank() == 0 && threadIdx.x == 0 && ticket != KILN_NO_TICKET)
    kiln_ticket_taken(row_claims, ticket, kiln_last_ticket(rows, LEAD * clusters, clusters));
  // No block may leave while another's pushes into it may still be in flight.
  kiln_cluster_sync();
}
