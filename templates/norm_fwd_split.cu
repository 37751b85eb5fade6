// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) forward for rows too long for one block's registers
// (sm_90): a thread-block cluster of CLUSTER blocks takes a row, each block a contiguous chunk
// of BLOCK_DIM * ITEMS vectors held in registers, so x is read once and y written once.
// The statistics are exact two-pass sums over the whole row: each block puts its chunk's sum
// in its shared memory, and after a cluster barrier every block adds all CLUSTER of them, read
// through distributed shared memory in rank order (so every block gets the same mean); then the
// same for the squares about that mean.
{{> prelude}}
{{> norm}}
{{> cluster}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr bool RMS = {{RMS}};
constexpr int ITEMS = {{ITEMS}};
constexpr int CLUSTER = {{CLUSTER}};
static_assert(CLUSTER >= 2 && CLUSTER <= 8, "a portable cluster of at least two blocks");

// `local` (a shared variable) as block `rank` of the cluster holds it.
__device__ __forceinline__ float kiln_cluster_read(const float* local, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"((unsigned)__cvta_generic_to_shared(local)), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// The sum over the cluster of each block's `slot`, in rank order.
__device__ __forceinline__ float kiln_cluster_total(const float* slot) {
  float total = 0.0f;
#pragma unroll
  for (int r = 0; r < CLUSTER; ++r) total += kiln_cluster_read(slot, r);
  return total;
}

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(BLOCK_DIM)
    {{kernel}}(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
               T* __restrict__ y, long long rows, int d, long long x_row_stride,
               long long w_stride, long long b_stride, int w_vec, int b_vec, float eps) {
  __shared__ float scratch[KILN_SCRATCH(BLOCK_DIM)];
  // This block's sum, then its sum of squares: two slots, so that a block writing the second
  // never overwrites what a slower block may still be reading of the first.
  __shared__ float partial[2];
  int round = 0;
  // The grid is rows x CLUSTER blocks; a cluster is CLUSTER consecutive blocks.
  const long long row = blockIdx.x / CLUSTER;
  const int base = (int)kiln_cluster_rank() * BLOCK_DIM * ITEMS * N_READS;
  const T* xr = x + row * x_row_stride + base;
  const int left = d - base;  // this chunk's elements run to here (none when <= 0)
  const float inv_d = 1.0f / d;

  float v[ITEMS][N_READS];
  kiln_load_row<ITEMS, N_READS, BLOCK_DIM>(xr, true, threadIdx.x, left, v);

  float mean = 0.0f;
  if (!RMS) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k)
#pragma unroll
      for (int j = 0; j < N_READS; ++j) s += v[k][j];
    s = kiln_group_sum<BLOCK_DIM, BLOCK_DIM>(s, scratch, round);
    if (threadIdx.x == 0) partial[0] = s;
    kiln_cluster_sync();
    mean = kiln_cluster_total(&partial[0]) * inv_d;
  }
  float q = 0.0f;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    if ((k * BLOCK_DIM + (int)threadIdx.x) * N_READS >= left) break;  // zeros past d
#pragma unroll
    for (int j = 0; j < N_READS; ++j) {
      const float c = v[k][j] - mean;
      q += c * c;
    }
  }
  q = kiln_group_sum<BLOCK_DIM, BLOCK_DIM>(q, scratch, round);
  if (threadIdx.x == 0) partial[1] = q;
  kiln_cluster_sync();
  const float rstd = rsqrtf(kiln_cluster_total(&partial[1]) * inv_d + eps);

  T* yr = y + row * (long long)d;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int i = base + (k * BLOCK_DIM + (int)threadIdx.x) * N_READS;
    if (i >= d) break;
    float wv[N_READS], bv[N_READS];
    kiln_load_param<N_READS>(w, w_stride, w_vec, i, d, 1.0f, wv);
    kiln_load_param<N_READS>(RMS ? nullptr : b, b_stride, b_vec, i, d, 0.0f, bv);
#pragma unroll
    for (int j = 0; j < N_READS; ++j) v[k][j] = (v[k][j] - mean) * rstd * wv[j] + bv[j];
    kiln_store_floats<N_READS>(yr, i, d, v[k]);
  }
  // No block may leave while another can still read its partial sums.
  kiln_cluster_sync();
}
