// Just enough of CUDA for kiln's plain-C++ kernels (no tensor cores, no warp shuffles, no
// asynchronous copies) to compile and run on the host: each block's threads are OS threads,
// __syncthreads a barrier among them, dynamic shared memory one buffer for the block that runs.
// Used by tests/host_direct.rs with -DKILN_HOST -DKILN_ARCH=700 (the portable paths).
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__
#define __launch_bounds__(...)

struct kiln_dim3 {
  unsigned x, y, z;
};
inline thread_local kiln_dim3 threadIdx, blockIdx;
inline kiln_dim3 blockDim, gridDim;
inline thread_local std::barrier<>* kiln_host_barrier = nullptr;

inline void __syncthreads() { kiln_host_barrier->arrive_and_wait(); }

struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Warp shuffles cannot be emulated thread by thread: a kernel that reaches one is not for this
// harness.
inline float kiln_host_no_warps() {
  std::fprintf(stderr, "host emulation: warp shuffles are not emulated\n");
  std::abort();
}
inline float __shfl_xor_sync(unsigned, float, int) { return kiln_host_no_warps(); }
inline float __shfl_sync(unsigned, float, int) { return kiln_host_no_warps(); }

// f16 <-> f32 in software, rounding to nearest even as cvt.rn.f16.f32 does.
inline float kiln_host_f16_to_float(unsigned short h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (exp == 0)
    v = std::ldexp((float)man, -24);
  else if (exp == 31)
    v = man ? NAN : INFINITY;
  else
    v = std::ldexp((float)(man | 0x400), exp - 25);
  return sign ? -v : v;
}
inline unsigned short kiln_host_float_to_f16(float f) {
  const unsigned u = __float_as_uint(f);
  const unsigned short sign = (u >> 16) & 0x8000u;
  const unsigned a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504: infinity
  if (a >= 0x38800000u) {                       // a normal f16: drop 13 bits, ties to even
    const unsigned r = a + 0xfffu + ((a >> 13) & 1u);
    return sign | (unsigned short)((r >> 13) - (112u << 10));
  }
  // Subnormal (or zero): a multiple of 2^-24, rounded to nearest even.
  return sign | (unsigned short)std::nearbyint(std::fabs(f) * 16777216.0f);
}
