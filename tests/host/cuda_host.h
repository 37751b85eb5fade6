// Just enough of CUDA for kiln's plain-C++ kernels to compile and run on the host: each block's
// threads are OS threads, __syncthreads a barrier among them, dynamic shared memory one buffer
// for the block that runs. Asynchronous copies are plain copies; ldmatrix, mma.sync (the
// m16n8k16 shapes kiln uses) and float warp shuffles are emulated warp by warp, named barriers
// group by group. Used by tests/host_direct.rs and tests/host_norm.rs with -DKILN_HOST and
// -DKILN_ARCH=700 (the portable paths) or 800 (the tensor-core paths of a family that has no
// other).
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
// Stronger than a warp's barrier: kiln's kernels call it only where every thread of the block
// does, so the block barrier keeps the same order and cannot deadlock.
inline void __syncwarp(unsigned = 0xffffffffu) { __syncthreads(); }

struct alignas(8) float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct alignas(8) uint2 {
  unsigned x, y;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned __umulhi(unsigned a, unsigned b) {
  return (unsigned)(((unsigned long long)a * b) >> 32);
}
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

// A warp's meeting place for the collective operations below: its 32 threads publish their
// operands, meet, read what each needs from the others, and meet again before the next
// operation overwrites what was published. Every lane must call them, as on the GPU.
struct kiln_host_warp {
  std::barrier<> meet{32};
  const void* addr[32];
  unsigned a[32][4];
  unsigned b[32][2];
  float f[32];
};
inline thread_local kiln_host_warp* kiln_host_this_warp = nullptr;
inline thread_local unsigned kiln_host_lane = 0;

// A warp collective in a block that is not whole warps: not for this harness.
inline kiln_host_warp* kiln_host_warp_or_abort() {
  if (kiln_host_this_warp == nullptr) {
    std::fprintf(stderr, "host emulation: a warp collective in a block of partial warps\n");
    std::abort();
  }
  return kiln_host_this_warp;
}

// __shfl_sync and __shfl_xor_sync on floats over the whole warp (the full mask, width 32): each
// lane publishes its value and reads lane `src`'s.
inline float kiln_host_shuffle(float v, unsigned src) {
  kiln_host_warp* w = kiln_host_warp_or_abort();
  w->f[kiln_host_lane] = v;
  w->meet.arrive_and_wait();
  const float r = w->f[src % 32];
  w->meet.arrive_and_wait();
  return r;
}
inline float __shfl_sync(unsigned, float v, int src) { return kiln_host_shuffle(v, src); }
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  return kiln_host_shuffle(v, kiln_host_lane ^ (unsigned)mask);
}

// A named barrier (bar.sync with a thread count) among the `threads` consecutive threads of this
// thread's group; the runner sets up one barrier per group.
inline thread_local std::barrier<>* kiln_host_group = nullptr;
inline thread_local unsigned kiln_host_group_size = 0;
inline void kiln_host_group_barrier(int threads) {
  if (kiln_host_group == nullptr || kiln_host_group_size != (unsigned)threads) {
    std::fprintf(stderr, "host emulation: a named barrier of %d threads the runner did not set up\n",
                 threads);
    std::abort();
  }
  kiln_host_group->arrive_and_wait();
}

// The GPU's rsqrtf is approximate (within 2 ulp); the exact value is within the tests' bounds.
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }

// ldmatrix .x2 / .x4 (.trans): lane l gives the address of row l % 8 of matrix l / 8 (eight
// 16-bit elements); register m of lane l receives elements (l / 4, 2 (l % 4)) and the next of
// matrix m, of its transpose with TRANS.
template <int X, bool TRANS> inline void kiln_host_ldmatrix(unsigned* r, const void* smem) {
  kiln_host_warp* w = kiln_host_this_warp;
  const unsigned lane = kiln_host_lane;
  w->addr[lane] = smem;
  w->meet.arrive_and_wait();
  for (int m = 0; m < X; ++m) {
    unsigned e[2];
    for (int i = 0; i < 2; ++i) {
      int row = lane / 4, col = 2 * (lane % 4) + i;
      if (TRANS) {
        const int t = row;
        row = col;
        col = t;
      }
      e[i] = static_cast<const unsigned short*>(w->addr[m * 8 + row])[col];
    }
    r[m] = e[0] | (e[1] << 16);
  }
  w->meet.arrive_and_wait();
}

// Publishes this lane's A and B fragments to its warp and waits for every lane's; returns the
// warp, whose fragments the caller reads before its closing arrive_and_wait.
inline kiln_host_warp* kiln_host_share_fragments(const unsigned (&a)[4], unsigned b0,
                                                 unsigned b1) {
  kiln_host_warp* w = kiln_host_this_warp;
  const unsigned lane = kiln_host_lane;
  for (int i = 0; i < 4; ++i) w->a[lane][i] = a[i];
  w->b[lane][0] = b0;
  w->b[lane][1] = b1;
  w->meet.arrive_and_wait();
  return w;
}

// mma.sync m16n8k16 with f32 accumulators: C[16x8] += A[16x16] B[16x8] on the PTX ISA's
// fragments (A's register 0 holds row l / 4, k 2 (l % 4) and the next; 1 the row 8 further; 2
// and 3 the same rows 8 k further; B's 0 and 1 k 2 (l % 4) (+8), column l / 4; C's 0 and 1 row
// l / 4, columns 2 (l % 4) and the next, 2 and 3 the row 8 further). The products are summed in
// f64, then added to C in f32.
inline void kiln_host_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1,
                          float (*widen)(unsigned short)) {
  kiln_host_warp* w = kiln_host_share_fragments(a, b0, b1);
  const unsigned lane = kiln_host_lane;
  auto half = [&](unsigned word, int k) { return widen((unsigned short)(word >> (16 * (k % 2)))); };
  for (int e = 0; e < 4; ++e) {
    const int row = lane / 4 + (e >= 2 ? 8 : 0), col = 2 * (lane % 4) + e % 2;
    double sum = 0.0;
    for (int k = 0; k < 16; ++k) {
      const float av = half(w->a[(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k);
      const float bv = half(w->b[col * 4 + (k % 8) / 2][k >= 8], k);
      sum += (double)av * bv;
    }
    c[e] = (float)(c[e] + sum);
  }
  w->meet.arrive_and_wait();
}

// mma.sync m16n8k8 TF32: C[16x8] += A[16x8] B[8x8] (A's register 0 holds row l / 4, k l % 4;
// 1 the row 8 further; 2 and 3 the same rows 4 k further; B's 0 and 1 k l % 4 (+4), column
// l / 4; C as above). Each word is read as TF32, its low 13 bits dropped, as the hardware does.
inline void kiln_host_mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  kiln_host_warp* w = kiln_host_share_fragments(a, b0, b1);
  const unsigned lane = kiln_host_lane;
  auto tf32 = [](unsigned word) { return __uint_as_float(word & 0xffffe000u); };
  for (int e = 0; e < 4; ++e) {
    const int row = lane / 4 + (e >= 2 ? 8 : 0), col = 2 * (lane % 4) + e % 2;
    double sum = 0.0;
    for (int k = 0; k < 8; ++k) {
      const float av = tf32(w->a[(row % 8) * 4 + k % 4][(row >= 8) + 2 * (k >= 4)]);
      const float bv = tf32(w->b[col * 4 + k % 4][k >= 4]);
      sum += (double)av * bv;
    }
    c[e] = (float)(c[e] + sum);
  }
  w->meet.arrive_and_wait();
}

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
inline float kiln_host_bf16_to_float(unsigned short h) { return __uint_as_float((unsigned)h << 16); }
