// Thread-block cluster helpers (sm_90): a cluster's blocks sum values through distributed
// shared memory.

// This block's rank in its cluster.
__device__ __forceinline__ unsigned kiln_cluster_rank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Elements of a row of d that each of a cluster's `blocks` takes (the last block may take fewer,
// or none): a multiple of 8, so that every chunk of a 16-byte aligned row starts 16-byte aligned
// for 16-bit and f32 vectors. The host's split_chunk computes the same.
__device__ __forceinline__ int kiln_split_chunk(int d, int blocks) {
  return ((d + blocks - 1) / blocks + 7) / 8 * 8;
}

// Every thread of every block of the cluster arrives: shared memory written before is visible
// to the cluster after.
__device__ __forceinline__ void kiln_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
}

// `local` (a shared memory address in this block) as block `rank` of the cluster maps it.
__device__ __forceinline__ unsigned kiln_cluster_map(const void* local, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"((unsigned)__cvta_generic_to_shared(local)), "r"(rank));
  return remote;
}

// Sums over a whole cluster without cluster barriers. A cluster barrier's arrive has release
// semantics: it waits for every earlier load and store of the thread, so a row's barrier also
// waited for the next row's loads issued before it. Instead each warp pushes its partial sums
// into every block's `recv` with st.async, which counts the bytes on the receiving block's
// mbarrier, and each block waits on its own mbarrier for all CLUSTER x WARPS of them.
template <int CLUSTER, int BLOCK_DIM>
struct kiln_cluster_sums {
  static constexpr int WARPS = BLOCK_DIM / 32;
  // Two sets, used by alternate exchanges: [set][rank * WARPS + warp].
  float2 recv[2][CLUSTER * WARPS];
  unsigned long long bar[2];
};

// Sets up `s` (in shared memory); every thread of every block calls it once before the first
// exchange, and the cluster barrier at its end keeps pushes off barriers not yet initialised.
template <int CLUSTER, int BLOCK_DIM>
__device__ __forceinline__ void kiln_cluster_sums_init(kiln_cluster_sums<CLUSTER, BLOCK_DIM>& s) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int set = 0; set < 2; ++set)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(
                       (unsigned)__cvta_generic_to_shared(&s.bar[set]))
                   : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  kiln_cluster_sync();
}

// Sums a and b over every thread of the cluster, returned to every thread; every thread of
// every block must call it, `exchange` counting the calls. Every block adds all CLUSTER x WARPS
// pairs in the same fixed order, so every thread gets the same bits. Exchange n uses set n % 2:
// set s is written again by exchange n + 2, whose pushes into a block need every warp of the
// cluster (that block's included) to have pushed exchange n + 1, which each does only after it
// read exchange n's sums; the same holds for the set's mbarrier phase.
template <int CLUSTER, int BLOCK_DIM>
__device__ __forceinline__ void kiln_cluster_sum2(float& a, float& b,
                                                  kiln_cluster_sums<CLUSTER, BLOCK_DIM>& s,
                                                  int& exchange) {
  constexpr int WARPS = BLOCK_DIM / 32;
  constexpr int PAIRS = CLUSTER * WARPS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int set = exchange & 1;
  const unsigned parity = (exchange >> 1) & 1;
  ++exchange;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, offset);
    b += __shfl_xor_sync(0xffffffffu, b, offset);
  }
  const unsigned bar = (unsigned)__cvta_generic_to_shared(&s.bar[set]);
  if (threadIdx.x == 0) {
    // This block's one arrival of the phase, expecting every pair's 8 bytes (pushes that came
    // first have already counted theirs down). Relaxed: a release would wait for this thread's
    // loads in flight, as the cluster barrier did.
    asm volatile("mbarrier.arrive.expect_tx.relaxed.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                 "r"(PAIRS * 8)
                 : "memory");
  }
  if (lane < CLUSTER) {
    // Lane r pushes this warp's pair to block r.
    const unsigned me = kiln_cluster_rank();
    const unsigned slot = kiln_cluster_map(&s.recv[set][me * WARPS + warp], lane);
    const unsigned remote_bar = kiln_cluster_map(&s.bar[set], lane);
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(
            slot),
        "f"(a), "f"(b), "r"(remote_bar)
        : "memory");
  }
  for (unsigned done = 0; !done;) {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
  // Lane l adds pairs l, l + 32, ...; then an xor butterfly, whose additions commute, gives
  // every lane the same total.
  float sa = 0.0f, sb = 0.0f;
#pragma unroll
  for (int p = lane; p < (PAIRS + 31) / 32 * 32; p += 32) {
    if (p < PAIRS) {
      const float2 v = s.recv[set][p];
      sa += v.x;
      sb += v.y;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    sa += __shfl_xor_sync(0xffffffffu, sa, offset);
    sb += __shfl_xor_sync(0xffffffffu, sb, offset);
  }
  a = sa;
  b = sb;
}
