// Thread-block cluster helpers (sm_90): a cluster's blocks sum values through distributed
// shared memory. KILN_HOST: the tests' host emulation (tests/host/cuda_host_cluster.h).

// This block's rank in its cluster.
__device__ __forceinline__ unsigned kiln_cluster_rank() {
#ifdef KILN_HOST
  return kiln_host_rank;
#else
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
#endif
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
#ifdef KILN_HOST
  kiln_host_cluster_barrier->arrive_and_wait();
#else
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
#endif
}

// `local` (a shared memory address in this block) as block `rank` of the cluster maps it.
__device__ __forceinline__ unsigned kiln_cluster_map(const void* local, unsigned rank) {
#ifdef KILN_HOST
  return kiln_host_map(local, rank);
#else
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"((unsigned)__cvta_generic_to_shared(local)), "r"(rank));
  return remote;
#endif
}

// Sums over a whole cluster without cluster barriers. A cluster barrier's arrive has release
// semantics: it waits for every earlier load and store of the thread, so a row's barrier also
// waited for the next row's loads issued before it. Instead each warp pushes WIDTH values (its
// sums) into every block's `recv` with st.async, which counts the bytes on the receiving block's
// mbarrier, and each block waits on its own mbarrier for all CLUSTER x WARPS of them.
//
// An exchange is a push (kiln_cluster_push) and a wait (kiln_cluster_wait), so that a kernel
// can push one exchange and do other work, even push the next, before it waits on the first.
// Exchange n uses set n % SETS. The rule that keeps the sets apart: every warp waits on
// exchange n before it pushes n + 2. Then a push of n + 4 comes from a warp that has waited on
// n + 2, which needed every warp of the cluster to push n + 2, which each did only after it had
// read exchange n's values: set n % 4 and its mbarrier phase are free again. (The same holds for
// the mbarrier's arrival, made when the block's thread 0 pushes.)
// A pushed value set: WIDTH floats, moved by one st.async.
template <int WIDTH>
struct alignas(4 * WIDTH) kiln_cluster_slot {
  float v[WIDTH];
};

// BY_BLOCK's own slots: this block's warps' values of the last two exchanges, [n % 2][warp]
// (none, and no bytes, without BY_BLOCK).
template <int WIDTH, int WARPS, bool BY_BLOCK>
struct kiln_cluster_own {
  kiln_cluster_slot<WIDTH> own[2][WARPS];
};
template <int WIDTH, int WARPS>
struct kiln_cluster_own<WIDTH, WARPS, false> {};

template <int CLUSTER, int BLOCK_DIM, int WIDTH = 2, bool BY_BLOCK = false>
struct kiln_cluster_sums : kiln_cluster_own<WIDTH, BLOCK_DIM / 32, BY_BLOCK> {
  static_assert(WIDTH == 2 || WIDTH == 4, "st.async moves 8 or 16 bytes");
  static constexpr int BLOCKS = CLUSTER, THREADS = BLOCK_DIM, VALUES = WIDTH;
  static constexpr bool BLOCK_PUSHES = BY_BLOCK;
  static constexpr int WARPS = BLOCK_DIM / 32;
  // Pushes each block makes an exchange: one a warp, or with BY_BLOCK one (its warps' values
  // combined first, kiln_cluster_push_block).
  static constexpr int PUSHERS = BY_BLOCK ? 1 : WARPS;
  static constexpr int PAIRS = CLUSTER * PUSHERS;  // pushes an exchange receives
  static constexpr int SETS = 4;
  typedef kiln_cluster_slot<WIDTH> Slot;
  // [set][rank * PUSHERS + pusher].
  Slot recv[SETS][PAIRS];
  unsigned long long bar[SETS];
};

// Sets up `s` (in shared memory); every thread of every block calls it once before the first
// exchange, and the cluster barrier at its end keeps pushes off barriers not yet initialised.
template <class S>
__device__ __forceinline__ void kiln_cluster_sums_init(S& s) {
  if (threadIdx.x == 0) {
#ifdef KILN_HOST
    for (int set = 0; set < S::SETS; ++set) kiln_host_mbarrier_init(&s.bar[set], 1);
#else
#pragma unroll
    for (int set = 0; set < S::SETS; ++set)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(
                       (unsigned)__cvta_generic_to_shared(&s.bar[set]))
                   : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
  }
  kiln_cluster_sync();
}

// Exchange n's arrival of this block (thread 0) and its push from the calling warp: lane r sends
// v[0..WIDTH) (the same in every lane) to block r, into this block's slot `pusher` there.
// `extra_bytes`: what else every block receives on the exchange's mbarrier
// (kiln_cluster_send_row's 8 bytes), the same in every block and every exchange of a kernel.
template <class S>
__device__ __forceinline__ void kiln_cluster_send(const float* v, S& s, int n, int pusher,
                                                  int extra_bytes) {
  const int lane = threadIdx.x % 32;
  const int set = n % S::SETS;
  if (threadIdx.x == 0) {
    // This block's one arrival of the phase, expecting every pusher's bytes (pushes that came
    // first have already counted theirs down). Relaxed: a release would wait for this thread's
    // loads in flight, as the cluster barrier did.
#ifdef KILN_HOST
    kiln_host_mbarrier_arrive(&s.bar[set], S::PAIRS * S::VALUES * 4 + extra_bytes);
#else
    asm volatile("mbarrier.arrive.expect_tx.relaxed.cta.shared::cta.b64 _, [%0], %1;" ::"r"(
                     (unsigned)__cvta_generic_to_shared(&s.bar[set])),
                 "r"(S::PAIRS * S::VALUES * 4 + extra_bytes)
                 : "memory");
#endif
  }
  if (lane < S::BLOCKS) {
    const int pair = (int)kiln_cluster_rank() * S::PUSHERS + pusher;
    const unsigned slot = kiln_cluster_map(&s.recv[set][pair], lane);
    const unsigned remote_bar = kiln_cluster_map(&s.bar[set], lane);
#ifdef KILN_HOST
    kiln_host_st_async(slot, v, S::VALUES * 4, remote_bar);
#else
    if constexpr (S::VALUES == 2) {
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::
              "r"(slot),
          "f"(v[0]), "f"(v[1]), "r"(remote_bar)
          : "memory");
    } else {
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, "
          "[%5];" ::"r"(slot),
          "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "r"(remote_bar)
          : "memory");
    }
#endif
  }
}

// kiln_cluster_push's exchange n for BY_BLOCK sums: the block's warps' values are combined in
// the block, and its warp 0 pushes the result, one slot a block. Pushed by each warp, all
// CLUSTER x WARPS of them are read back by every warp of every block: in clusters of 16 blocks of
// 16 warps every warp read 256 slots a row, more shared memory traffic than LayerNorm's VJP
// spent on its rows. The block's combine costs a barrier and a warp's sums on each exchange's
// path instead, which pays only where the pushes are that many (the caller's choice). Values
// are sums (warp_elements null) or, for kiln_cluster_wait_moments, moments: v[0] the warp's mean
// over its warp_elements[warp] elements (this block's warps' n_w, whose sum is 1 /
// inv_block_elements, or none and 0) and the sums about it, which combine as that function
// combines blocks. Warp 0 waits on the others (a named barrier, 1 + n % 2: a warp pushes exchange
// n + 2 only after it has waited on n, whose pushes came after that barrier's), the others go on.
template <class S>
__device__ __forceinline__ void kiln_cluster_push_block(const float* v, S& s, int n,
                                                        const float* warp_elements,
                                                        float inv_block_elements,
                                                        int extra_bytes) {
  constexpr int WIDTH = S::VALUES;
  static_assert(S::BLOCK_PUSHES && S::WARPS <= 32, "warp 0 combines a lane a warp");
  // Lanes [0, LANES) each hold a warp's values (zeros past the warps), the rest copies; LANES
  // covers the cluster's blocks too, the lanes that send.
  constexpr int LANES = kiln_span_for<(S::WARPS > S::BLOCKS ? S::WARPS : S::BLOCKS)>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, from = lane % LANES;
  const int half = n % 2;
  if (lane == 0) {
    typename S::Slot own;
#pragma unroll
    for (int i = 0; i < WIDTH; ++i) own.v[i] = v[i];
    s.own[half][warp] = own;
  }
  // Barrier ids as immediates: a register id would make ptxas reserve all 16 of them.
#ifdef KILN_HOST
  if (warp != 0) {
    kiln_host_named_barrier(1 + half, S::THREADS, false);
    return;
  }
  kiln_host_named_barrier(1 + half, S::THREADS, true);
#else
  if (warp != 0) {
    if (half)
      asm volatile("bar.arrive 2, %0;" ::"n"(S::THREADS) : "memory");
    else
      asm volatile("bar.arrive 1, %0;" ::"n"(S::THREADS) : "memory");
    return;
  }
  if (half)
    asm volatile("bar.sync 2, %0;" ::"n"(S::THREADS) : "memory");
  else
    asm volatile("bar.sync 1, %0;" ::"n"(S::THREADS) : "memory");
#endif
  float e[WIDTH], u[WIDTH];
#pragma unroll
  for (int i = 0; i < WIDTH; ++i) e[i] = from < S::WARPS ? s.own[half][from].v[i] : 0.0f;
  if (warp_elements) {
    // About the block's mean, as kiln_cluster_wait_moments combines, in one round of sums: each
    // warp's mean m_w is taken about warp 0's, m_0 (d_w = m_w - m_0), and with
    // delta = mean - m_0 = sum n_w d_w / n_b,
    //   sum_w v[1] + n_w (m_w - mean)^2 = sum_w (v[1] + n_w d_w^2) - delta sum_w n_w d_w
    //   sum_w v[3] + (m_w - mean) v[2]  = sum_w (v[3] + d_w v[2]) - delta sum_w v[2].
    // The shift is one of the means weighed, so the subtraction cannot cancel much: the centred
    // sum holds n_0 delta^2, so n_b delta^2 is at most n_b / n_0 times the result (warp 0 holds
    // the most elements: at most WARPS times), a loss of at most 4 bits for 16 warps, where a
    // shift of 0 (E[x^2] - E[x]^2) could lose them all. (Empty warps and lanes past the warps add
    // nothing: n_w, and their sums, are zero; a block with no elements pushes zeros.)
    const float n_w = from < S::WARPS ? warp_elements[from] : 0.0f;
    const float m_0 = s.own[half][0].v[0];
    const float d_w = e[0] - m_0;
    const float s_d = kiln_span_sum<LANES>(n_w * d_w);
    const float s_q = kiln_span_sum<LANES>(e[1] + n_w * d_w * d_w);
    const float delta = s_d * inv_block_elements;
    u[0] = m_0 + delta;
    u[1] = s_q - delta * s_d;
    if constexpr (WIDTH == 4) {
      const float s_g = kiln_span_sum<LANES>(e[2]);
      u[2] = s_g;
      u[3] = kiln_span_sum<LANES>(e[3] + d_w * e[2]) - delta * s_g;
    }
  } else {
#pragma unroll
    for (int i = 0; i < WIDTH; ++i) u[i] = kiln_span_sum<LANES>(e[i]);
  }
  kiln_cluster_send(u, s, n, 0, extra_bytes);
}

// Pushes this warp's WIDTH values v[0..WIDTH) (the same in every lane: sums over the warp) to
// every block of the cluster, or with BY_BLOCK its block's combined (kiln_cluster_push_block,
// whose `warp_elements` and `inv_block_elements` say whether they are sums or moments); every
// thread of every block must call it, `exchange` counting the pushes. Returns the exchange's
// number, for kiln_cluster_wait. `extra_bytes`: as kiln_cluster_send's.
template <class S>
__device__ __forceinline__ int kiln_cluster_push(const float* v, S& s, int& exchange,
                                                 int extra_bytes = 0,
                                                 const float* warp_elements = nullptr,
                                                 float inv_block_elements = 0.0f) {
  const int n = exchange++;
  if constexpr (S::BLOCK_PUSHES) {
    kiln_cluster_push_block(v, s, n, warp_elements, inv_block_elements, extra_bytes);
  } else {
    kiln_cluster_send(v, s, n, (int)threadIdx.x / 32, extra_bytes);
  }
  return n;
}

// Waits for exchange `n` (kiln_cluster_push's number) and returns its values: every push,
// [rank * PUSHERS + pusher].
template <class S>
__device__ __forceinline__ const typename S::Slot* kiln_cluster_wait(S& s, int n) {
  const int set = n % S::SETS;
  const unsigned parity = (n / S::SETS) & 1;
#ifdef KILN_HOST
  kiln_host_mbarrier_wait(&s.bar[set], parity);
#else
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
#endif
  return s.recv[set];
}

// Pushes this warp's sums of a and b over its lanes (kiln_cluster_push).
template <int CLUSTER, int BLOCK_DIM>
__device__ __forceinline__ int kiln_cluster_push2(float a, float b,
                                                  kiln_cluster_sums<CLUSTER, BLOCK_DIM, 2>& s,
                                                  int& exchange, int extra_bytes = 0) {
  const float v[2] = {kiln_warp_sum(a), kiln_warp_sum(b)};
  return kiln_cluster_push(v, s, exchange, extra_bytes);
}

// Waits for exchange `n` and returns the sums of its first two values over every thread of the
// cluster (kiln_cluster_push2's a and b) in a and b, the same bits in every thread: every block
// adds all the pushes in the same fixed order.
template <class S>
__device__ __forceinline__ void kiln_cluster_wait2(S& s, int n, float& a, float& b) {
  const typename S::Slot* pushed = kiln_cluster_wait(s, n);
  // Lane l adds pushes l, l + LANES, ...; then an xor butterfly, whose additions commute, gives
  // every lane the same total.
  constexpr int LANES = kiln_span_for<S::PAIRS>();
  const int lane = threadIdx.x % LANES;
  float sa = 0.0f, sb = 0.0f;
#pragma unroll
  for (int p = lane; p < (S::PAIRS + LANES - 1) / LANES * LANES; p += LANES) {
    if (p < S::PAIRS) {
      sa += pushed[p].v[0];
      sb += pushed[p].v[1];
    }
  }
  a = kiln_span_sum<LANES>(sa);
  b = kiln_span_sum<LANES>(sb);
}

// An exchange pushed and awaited at once: a and b summed over every thread of the cluster.
template <int CLUSTER, int BLOCK_DIM>
__device__ __forceinline__ void kiln_cluster_sum2(float& a, float& b,
                                                  kiln_cluster_sums<CLUSTER, BLOCK_DIM, 2>& s,
                                                  int& exchange, int extra_bytes = 0) {
  const int n = kiln_cluster_push2(a, b, s, exchange, extra_bytes);
  kiln_cluster_wait2(s, n, a, b);
}

// The elements each warp of the cluster holds of a split row of d, `chunk` elements a block
// (the last block's fewer, or none), where thread t's vector k covers chunk elements from
// (k * BLOCK_DIM + t) * N_READS - shift (bulk.cuh's shifted columns; every block of a cluster
// has the same shift, chunks being whole granules): [rank * WARPS + warp] as kiln_cluster_sums
// orders pushes, for kiln_cluster_wait_moments and kiln_split_own_inv_elements. Computed once
// per kernel, visible after the next barrier.
template <int CLUSTER, int BLOCK_DIM, int N_READS>
__device__ __forceinline__ void kiln_split_pair_elements(float* elements, int d, int chunk,
                                                         int shift) {
  constexpr int WARPS = BLOCK_DIM / 32;
  for (int p = threadIdx.x; p < CLUSTER * WARPS; p += BLOCK_DIM) {
    const int rank = p / WARPS, warp = p % WARPS;
    const int len = max(0, min(chunk, d - rank * chunk));
    // Each round of the block's vectors gives the warp 32 contiguous vectors.
    int n = 0;
    for (int lo = warp * 32 * N_READS - shift; lo < len; lo += BLOCK_DIM * N_READS)
      n += min(lo + 32 * N_READS, len) - max(lo, 0);
    elements[p] = (float)n;
  }
}

// The elements each block of the cluster holds of a split row of d, `chunk` elements a block:
// [rank], as kiln_cluster_sums orders BY_BLOCK pushes, for kiln_cluster_wait_moments. Computed
// once per kernel, visible after the next barrier.
template <int CLUSTER>
__device__ __forceinline__ void kiln_split_block_elements(float* elements, int d, int chunk) {
  const int rank = threadIdx.x;
  if (rank < CLUSTER) elements[rank] = (float)max(0, min(chunk, d - rank * chunk));
}

// 1 / n_w for this thread's warp (0 when it holds none of the row), from the table of
// kiln_split_pair_elements.
template <int BLOCK_DIM>
__device__ __forceinline__ float kiln_split_own_inv_elements(const float* elements) {
  const float n = elements[kiln_cluster_rank() * (BLOCK_DIM / 32) + threadIdx.x / 32];
  return n > 0.0f ? 1.0f / n : 0.0f;
}

// LayerNorm's statistics in one exchange (two would wait twice a row on the cluster), combined
// as exact two-pass sums. Each warp (with BY_BLOCK each block, kiln_cluster_push_block) pushes
// its own mean m_w over its n_w elements (0 when it has none) and sums about it:
// v[1] = sum (x - m_w)^2, and with WIDTH 4 v[2] = sum wg and v[3] = sum wg (x - m_w) for the
// VJP's w * g. About the row's mean, over every pusher w:
//   sum (x - mean)^2   = sum_w v[1] + n_w (m_w - mean)^2
//   sum wg (x - mean)  = sum_w v[3] + (m_w - mean) v[2]
// (the cross term 2 (m_w - mean) sum (x - m_w) is zero up to the rounding of m_w). So no value
// is a large sum of squares minus a square, as a one-pass E[x^2] - E[x]^2 would be. Waits for
// exchange n and returns the mean, the centred sum of squares, and with WIDTH 4 sum wg and
// sum wg (x - mean); the same bits in every thread (every block combines in one fixed order).
// `elements`: each pusher's n_w (kiln_split_pair_elements, or kiln_split_block_elements).
template <class S>
__device__ __forceinline__ void kiln_cluster_wait_moments(S& s, int n, const float* elements,
                                                          float inv_d, float& mean, float& m2,
                                                          float& swg, float& t) {
  constexpr int WIDTH = S::VALUES;
  const typename S::Slot* pushed = kiln_cluster_wait(s, n);
  // As kiln_cluster_wait2 sums: lane l takes pushes l, l + LANES, ...
  constexpr int LANES = kiln_span_for<S::PAIRS>();
  constexpr int PADDED = (S::PAIRS + LANES - 1) / LANES * LANES;
  const int lane = threadIdx.x % LANES;
  float sx = 0.0f, sg = 0.0f;
#pragma unroll
  for (int p = lane; p < PADDED; p += LANES) {
    if (p < S::PAIRS) {
      sx += elements[p] * pushed[p].v[0];
      if constexpr (WIDTH == 4) sg += pushed[p].v[2];
    }
  }
  mean = kiln_span_sum<LANES>(sx) * inv_d;
  swg = WIDTH == 4 ? kiln_span_sum<LANES>(sg) : 0.0f;
  float q = 0.0f, c = 0.0f;
#pragma unroll
  for (int p = lane; p < PADDED; p += LANES) {
    if (p < S::PAIRS) {
      const float dev = pushed[p].v[0] - mean;
      q += pushed[p].v[1] + elements[p] * dev * dev;
      if constexpr (WIDTH == 4) c += pushed[p].v[3] + dev * pushed[p].v[2];
    }
  }
  m2 = kiln_span_sum<LANES>(q);
  t = WIDTH == 4 ? kiln_span_sum<LANES>(c) : 0.0f;
}

// The forward's LayerNorm exchange pushed and awaited at once: this warp's mean m_w and sum q of
// (x - m_w)^2 over its lanes in, the row's mean and its sum of (x - mean)^2 out
// (kiln_cluster_wait_moments).
template <int CLUSTER, int BLOCK_DIM>
__device__ __forceinline__ void kiln_cluster_sum_moments(
    float m_w, float& q, kiln_cluster_sums<CLUSTER, BLOCK_DIM, 2>& s, int& exchange,
    const float* elements, float inv_d, float& mean, int extra_bytes = 0) {
  const float v[2] = {m_w, kiln_warp_sum(q)};
  const int n = kiln_cluster_push(v, s, exchange, extra_bytes);
  float unused;
  kiln_cluster_wait_moments(s, n, elements, inv_d, mean, q, unused, unused);
}

// Rows claimed at run time. Clusters that loop over rows in a fixed order (row = cluster + turn
// x clusters) finish apart: on an H100 some clusters took 2.0 us a row and others 2.9 (where
// they sit on the GPU), so the first idled for the last quarter of the call. Instead each
// cluster takes its first LEAD rows in that order and then claims one row at a time from a
// counter the grid shares, LEAD turns before it reduces it (its copies go out STAGES = LEAD - 1
// turns ahead). Rank 0 claims a turn before that (a ticket: the atomic's latency is spent on a
// turn's work) and sends the row to every block of the cluster with its exchange of the turn
// (8 bytes more on that exchange's mbarrier: every block has waited on it before it reads the
// row). The counter is a word, zero at launch; the claim that takes the grid's last ticket zeroes
// it for the next launch.
// Claimed rows a block holds: the row of turn t lands with exchange t - LEAD and is read until
// turn t; rank 0 rewrites its slot (for turn t + 8) at exchange t + 8 - LEAD, after it has waited
// on exchange t + 7 - LEAD, which every block pushed after its reads of turn t where LEAD < 7.
constexpr int KILN_ROW_RING = 8;
struct kiln_claimed_rows {
  long long row[KILN_ROW_RING];
};

// A claim not yet made, or none left to make.
// (An enumerator: a namespace-scope constant would draw "declared but never referenced" from
// every template that includes this header without claiming rows.)
enum : unsigned long long { KILN_NO_TICKET = ~0ull };

// The row a cluster takes at `turn`: fixed for the first LEAD turns, then as claimed (rows or
// more: none, and none after it).
template <int LEAD>
__device__ __forceinline__ long long kiln_row_at(const kiln_claimed_rows& claimed, long long cluster,
                                                 long long clusters, int turn) {
  return turn < LEAD ? cluster + turn * clusters : claimed.row[turn % KILN_ROW_RING];
}

// The grid's last ticket. Every cluster claims until a ticket is past the end, then no more
// (the counter only grows), so the tickets are the claimed rows (past the fixed first `fixed`)
// and one past the end for each cluster.
__device__ __forceinline__ unsigned long long kiln_last_ticket(long long rows, long long fixed,
                                                               long long clusters) {
  return (unsigned long long)(max(0ll, rows - fixed) + clusters - 1);
}

// Rank 0, thread 0: a ticket taken. The claim that took the grid's last ticket zeroes the
// counter (no claim comes after it), without a fence or a count of finished clusters at the end.
__device__ __forceinline__ void kiln_ticket_taken(unsigned long long* counter,
                                                  unsigned long long ticket,
                                                  unsigned long long last) {
  if (ticket == last) atomicExch(counter, 0ull);
}

// Rank 0, warp 0 (lane 0 holding `ticket`): sends the row of `ticket` (claims past the fixed
// first LEAD x clusters rows; rows when it is past the end or none) for turn `turn` to every
// block's slot, counted on exchange `n`'s mbarrier there, then claims the next row unless this
// one was past the end. Call it just before the exchange's push; every block then pushes with
// extra_bytes 8.
template <int LEAD, class S>
__device__ __forceinline__ void kiln_cluster_send_row(
    unsigned long long* counter, unsigned long long& ticket, long long rows, long long clusters,
    int turn, kiln_claimed_rows& claimed, S& s, int n) {
  const int lane = threadIdx.x % 32;
  long long row = rows;
  if (lane == 0 && ticket != KILN_NO_TICKET) {
    row = min(rows, LEAD * clusters + (long long)ticket);
    kiln_ticket_taken(counter, ticket, kiln_last_ticket(rows, LEAD * clusters, clusters));
  }
  row = __shfl_sync(0xffffffffu, row, 0);
  if (lane < S::BLOCKS) {
    const unsigned slot = kiln_cluster_map(&claimed.row[turn % KILN_ROW_RING], lane);
    const unsigned remote_bar = kiln_cluster_map(&s.bar[n % S::SETS], lane);
#ifdef KILN_HOST
    kiln_host_st_async(slot, &row, 8, remote_bar);
#else
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];" ::
                     "r"(slot),
                 "l"(row), "r"(remote_bar)
                 : "memory");
#endif
  }
  // Past the end, every later claim would be too.
  if (lane == 0) ticket = row < rows ? atomicAdd(counter, 1ull) : KILN_NO_TICKET;
}
