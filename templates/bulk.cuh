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

// Bytes a stage gives a chunk of `elements`: the chunk, a granule on either side, rounded to 128
// so that every chunk of a stage starts 128-byte aligned.
template <typename T>
__host__ __device__ constexpr int kiln_chunk_bytes_of(int elements) {
  return (elements * (int)sizeof(T) + 32 + 127) / 128 * 128;
}

// The same for a chunk of up to CAPACITY elements, known when the kernel is compiled.
template <typename T, int CAPACITY>
__host__ __device__ constexpr int kiln_chunk_bytes() {
  return kiln_chunk_bytes_of<T>(CAPACITY);
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
#ifdef KILN_HOST
  kiln_host_bulk_copy(stage, span.first, span.bytes, bar);
#else
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          kiln_smem_addr(stage)),
      "l"(span.first), "r"(span.bytes), "r"(kiln_smem_addr(bar))
      : "memory");
#endif
}

// Arrives (once per phase, one thread, before the copies) on `bar` expecting `bytes` from the
// copies into its stage; with 0 the phase completes on the arrival alone. Relaxed: a release would first
// wait for the thread's own loads and stores in flight.
__device__ __forceinline__ void kiln_bulk_arrive(unsigned long long* bar, unsigned bytes) {
#ifdef KILN_HOST
  kiln_host_mbarrier_arrive(bar, bytes);
#else
  asm volatile("mbarrier.arrive.expect_tx.relaxed.cta.shared::cta.b64 _, [%0], %1;" ::"r"(
                   kiln_smem_addr(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// After a barrier that saw every thread's reads of a stage, before a bulk copy overwrites it:
// orders those (generic proxy) reads before the copy's (async proxy) writes.
__device__ __forceinline__ void kiln_bulk_fence() {
#ifndef KILN_HOST  // the host's copies are made at once
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Columns shifted onto the granules, so that rows which do not start on one (odd lengths) still
// move whole vectors. A thread's vector at stage position `at` (a multiple of N, 16 bytes)
// covers the chunk's elements at - shift .. at - shift + N - 1, where `shift` is the granule
// offset of the kernel's first row. The host launches such kernels only on rows that all start
// `shift` elements into a granule (kiln_check_shift stops any other), so every load and store is
// a whole aligned vector; the elements of the two vectors the chunk's ends cut that lie outside
// it read as zero and are never written.

// Whether the vector at `at` lies wholly inside the chunk.
template <int N>
__device__ __forceinline__ bool kiln_whole(int at, int shift, int len) {
  const int p0 = at - shift;
  return p0 >= 0 && p0 + N <= len;
}

// Whether element j of the vector at `at` lies inside the chunk.
__device__ __forceinline__ bool kiln_inside(int at, int shift, int j, int len) {
  return (unsigned)(at - shift + j) < (unsigned)len;
}

// Stops the kernel on a row whose chunk starts `offset` elements into its granule where the
// kernel's columns are shifted by another amount (a launch the host does not make): a trap, not
// a misread row.
__device__ __forceinline__ void kiln_check_shift(int offset, int shift) {
  if (offset != shift) __trap();
}

// The vector at `at` of a staged chunk as floats (`stage`: the stage's first granule).
template <int N, typename T>
__device__ __forceinline__ void kiln_unstage_shifted(const T* stage, int shift, int at, int len,
                                                     float (&v)[N]) {
  if (at - shift >= len) {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = 0.0f;
    return;
  }
  const kiln_vec<T, N> r = *reinterpret_cast<const kiln_vec<T, N>*>(stage + at);
  const bool whole = kiln_whole<N>(at, shift, len);
  kiln_widen(r, v);
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = whole || kiln_inside(at, shift, j, len) ? v[j] : 0.0f;
}

// Stores the vector at `at` into a chunk of `len` elements at `out`, which starts `shift`
// elements into its granule.
template <int N, typename T>
__device__ __forceinline__ void kiln_store_shifted(T* out, int shift, int at, int len,
                                                   const float (&o)[N]) {
  if (kiln_whole<N>(at, shift, len)) {
    kiln_store_vec<N>(out, at - shift, o);  // out + at - shift lies on a granule
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (kiln_inside(at, shift, j, len)) out[at - shift + j] = kiln_from_float<T>(o[j]);
  }
}

// A thread's NI vectors of a weight or bias (kiln_load_params; `missing` when p is null, 0
// outside the chunk) for columns shifted by `shift`: vector k covers row elements
// base + i0 + k * step - shift + j, of which base .. base + len - 1 are the chunk's. Unshifted
// columns keep kiln_load_params' vector loads.
template <int NI, int N, typename T>
__device__ __forceinline__ void kiln_load_params_shifted(const T* p, long long stride, bool vec,
                                                         int base, int i0, int step, int len,
                                                         int shift, float missing,
                                                         float (&out)[NI][N]) {
  if (shift == 0 || p == nullptr) {
    kiln_load_params<NI, N>(p, stride, vec, base + i0, step, base + len, missing, out);
    return;
  }
#pragma unroll
  for (int k = 0; k < NI; ++k)
#pragma unroll
    for (int j = 0; j < N; ++j)
      out[k][j] = kiln_inside(i0 + k * step, shift, j, len)
                      ? kiln_to_float(p[(base + i0 + k * step - shift + j) * stride])
                      : 0.0f;
}
