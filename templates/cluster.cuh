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
//
// An exchange is a push (kiln_cluster_push2) and a wait (kiln_cluster_wait2), so that a kernel
// can push one exchange and do other work, even push the next, before it waits on the first.
// Exchange n uses set n % SETS. The rule that keeps the sets apart: every warp waits on
// exchange n before it pushes n + 2. Then a push of n + 4 comes from a warp that has waited on
// n + 2, which needed every warp of the cluster to push n + 2, which each did only after it had
// read exchange n's sums: set n % 4 and its mbarrier phase are free again. (The same holds for
// the mbarrier's arrival, made when the block's thread 0 pushes.)
template <int CLUSTER, int BLOCK_DIM>
struct kiln_cluster_sums {
  static constexpr int WARPS = BLOCK_DIM / 32;
  static constexpr int SETS = 4;
  // [set][rank * WARPS + warp].
  float2 recv[SETS][CLUSTER * WARPS];
  unsigned long long bar[SETS];
};

// Sets up `s` (in shared memory); every thread of every block calls it once before the first
// exchange, and the cluster barrier at its end keeps pushes off barriers not yet initialised.
template <int CLUSTER, int BLOCK_DIM>
__device__ __forceinline__ void kiln_cluster_sums_init(kiln_cluster_sums<CLUSTER, BLOCK_DIM>& s) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int set = 0; set < kiln_cluster_sums<CLUSTER, BLOCK_DIM>::SETS; ++set)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(
                       (unsigned)__cvta_generic_to_shared(&s.bar[set]))
                   : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  kiln_cluster_sync();
}

// Pushes this warp's sums of a and b to every block of the cluster; every thread of every block
// must call it, `exchange` counting the pushes. Returns the exchange's number, for
// kiln_cluster_wait2.
template <int CLUSTER, int BLOCK_DIM>
__device__ __forceinline__ int kiln_cluster_push2(float a, float b,
                                                  kiln_cluster_sums<CLUSTER, BLOCK_DIM>& s,
                                                  int& exchange) {
  constexpr int WARPS = BLOCK_DIM / 32;
  constexpr int PAIRS = CLUSTER * WARPS;
  constexpr int SETS = kiln_cluster_sums<CLUSTER, BLOCK_DIM>::SETS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n = exchange++;
  const int set = n % SETS;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, offset);
    b += __shfl_xor_sync(0xffffffffu, b, offset);
  }
  if (threadIdx.x == 0) {
    // This block's one arrival of the phase, expecting every pair's 8 bytes (pushes that came
    // first have already counted theirs down). Relaxed: a release would wait for this thread's
    // loads in flight, as the cluster barrier did.
    asm volatile("mbarrier.arrive.expect_tx.relaxed.cta.shared::cta.b64 _, [%0], %1;" ::"r"(
                     (unsigned)__cvta_generic_to_shared(&s.bar[set])),
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
  return n;
}

// Waits for exchange `n` (kiln_cluster_push2's number) and returns its sums over every thread of
// the cluster in a and b, the same bits in every thread: every block adds all CLUSTER x WARPS
// pairs in the same fixed order.
template <int CLUSTER, int BLOCK_DIM>
__device__ __forceinline__ void kiln_cluster_wait2(kiln_cluster_sums<CLUSTER, BLOCK_DIM>& s, int n,
                                                   float& a, float& b) {
  constexpr int WARPS = BLOCK_DIM / 32;
  constexpr int PAIRS = CLUSTER * WARPS;
  constexpr int SETS = kiln_cluster_sums<CLUSTER, BLOCK_DIM>::SETS;
  const int lane = threadIdx.x % 32;
  const int set = n % SETS;
  const unsigned parity = (n / SETS) & 1;
  const unsigned bar = (unsigned)__cvta_generic_to_shared(&s.bar[set]);
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

// An exchange pushed and awaited at once: a and b summed over every thread of the cluster.
template <int CLUSTER, int BLOCK_DIM>
__device__ __forceinline__ void kiln_cluster_sum2(float& a, float& b,
                                                  kiln_cluster_sums<CLUSTER, BLOCK_DIM>& s,
                                                  int& exchange) {
  const int n = kiln_cluster_push2(a, b, s, exchange);
  kiln_cluster_wait2(s, n, a, b);
}
