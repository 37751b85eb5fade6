// Row chunks in flight through shared memory (sm_90): one thread copies a chunk of a row into a
// stage of a ring with one bulk copy (cp.async.bulk), which completes on the stage's mbarrier.
// The copies cost no registers, so a block keeps the next rows' loads in flight, as many bytes
// as its stages hold, while it computes on the current one. Needs tma.cuh.
//
// A bulk copy moves whole 16-byte granules between 16-byte aligned addresses. A chunk that does
// not start or end on a granule (rows of odd length) is copied with the granules around it, and
// its first element lands kiln_granule_offset elements into the stage. The extra bytes belong to
// the same allocation: kiln's allocator hands out blocks of whole 256-byte units at 256-byte
// aligned addresses, so every granule holding a byte of an array lies inside its block.

// Bytes a stage gives one chunk of up to CAPACITY elements: the chunk, a granule on either side,
// rounded to 128 so that every chunk of a stage starts 128-byte aligned.
template <typename T, int CAPACITY>
__host__ __device__ constexpr int kiln_chunk_bytes() {
  return (CAPACITY * (int)sizeof(T) + 32 + 127) / 128 * 128;
}

// Elements between the granule holding p and p itself.
template <typename T>
__device__ __forceinline__ int kiln_granule_offset(const T* p) {
  return (int)(((unsigned long long)p & 15ull) / sizeof(T));
}

// The granules holding the `len` elements at `src`: their first address and byte count (0 when
// len <= 0).
struct kiln_span {
  unsigned long long first;
  unsigned bytes;
};
template <typename T>
__device__ __forceinline__ kiln_span kiln_granules(const T* src, int len) {
  if (len <= 0) return {0ull, 0u};
  const unsigned long long first = (unsigned long long)src & ~15ull;
  const unsigned long long end = ((unsigned long long)(src + len) + 15ull) & ~15ull;
  return {first, (unsigned)(end - first)};
}

// Copies `span` into `stage`, completing on `bar`, whose phase must already expect its bytes.
__device__ __forceinline__ void kiln_bulk_copy(void* stage, kiln_span span, unsigned long long* bar) {
  if (span.bytes == 0) return;
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          kiln_smem_addr(stage)),
      "l"(span.first), "r"(span.bytes), "r"(kiln_smem_addr(bar))
      : "memory");
}

// Arrives (once per phase, one thread, before the copies) on `bar` expecting `bytes` from the
// copies into its stage; with 0 the phase completes on the arrival alone. Relaxed: a release would first
// wait for the thread's own loads and stores in flight.
__device__ __forceinline__ void kiln_bulk_arrive(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.relaxed.cta.shared::cta.b64 _, [%0], %1;" ::"r"(
                   kiln_smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

// After a barrier that saw every thread's reads of a stage, before a bulk copy overwrites it:
// orders those (generic proxy) reads before the copy's (async proxy) writes.
__device__ __forceinline__ void kiln_bulk_fence() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
