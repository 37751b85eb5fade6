// Bulk tensor copies (sm_90): a tensor map passed by value (`const __grid_constant__
// kiln_tensor_map`), copies of one box into shared memory that complete on an mbarrier.
// KILN_HOST: the tests' host emulation of clusters (tests/host/cuda_host_cluster.h).
#pragma once

// The layout of the driver's CUtensorMap as a kernel parameter.
struct __align__(64) kiln_tensor_map {
  unsigned long long opaque[16];
};

__device__ __forceinline__ unsigned kiln_smem_addr(const void* p) {
#ifdef KILN_HOST
  return kiln_host_smem_addr(p);
#else
  return (unsigned)__cvta_generic_to_shared(p);
#endif
}

// One thread: an mbarrier expecting `arrivals` arrivals per phase, visible to the copy engine.
__device__ __forceinline__ void kiln_mbarrier_init(unsigned long long* bar, unsigned arrivals) {
#ifdef KILN_HOST
  kiln_host_mbarrier_init(bar, arrivals);
#else
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(kiln_smem_addr(bar)), "r"(arrivals));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Arrives on `bar` and adds `bytes` to the bytes its current phase waits for.
__device__ __forceinline__ void kiln_mbarrier_expect_bytes(unsigned long long* bar, unsigned bytes) {
#ifdef KILN_HOST
  kiln_host_mbarrier_arrive(bar, bytes);
#else
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(kiln_smem_addr(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// Waits until phase `parity` (0, 1, 0, ...) of `bar` has completed.
__device__ __forceinline__ void kiln_mbarrier_wait(unsigned long long* bar, unsigned parity) {
#ifdef KILN_HOST
  kiln_host_mbarrier_wait(bar, parity);
#else
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(kiln_smem_addr(bar)), "r"(parity)
        : "memory");
  }
#endif
}

// Copies the box at element coordinates (x innermost, y) of a 2-D map into `smem` (16-byte
// aligned; 128 with a swizzle); completion counts the box's bytes on `bar`.
__device__ __forceinline__ void kiln_tma_load_2d(void* smem, const kiln_tensor_map* map, int x, int y,
                                                 unsigned long long* bar) {
#ifdef KILN_HOST
  kiln_host_unsupported("cp.async.bulk.tensor");
#else
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(kiln_smem_addr(smem)), "l"(map), "r"(x), "r"(y), "r"(kiln_smem_addr(bar))
      : "memory");
#endif
}
