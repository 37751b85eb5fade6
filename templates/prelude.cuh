// kiln prelude: shared by every template. Self-contained on purpose: including cuda_fp16.h or
// cuda_bf16.h costs tens of milliseconds per NVRTC compile, and these few lines do the same job.

// The architecture whose code paths a kernel takes, as __CUDA_ARCH__ counts (750 for sm_75):
// the target's own, or an older one that KILN_EMULATE_ARCH passes as -DKILN_ARCH to test the
// portable paths on a newer GPU.
#ifndef KILN_ARCH
#define KILN_ARCH __CUDA_ARCH__
#endif

// Programmatic dependent launch (CommandEncoder::launch_dependent, sm_90 and later): a kernel
// launched so may start while the previous kernel on its stream still runs. Every thread waits
// here before its first access to global memory, until that kernel has completed and its writes
// are visible; then it lets the next such kernel launch (its blocks take SMs as this one's
// leave, and wait in turn). Both are no-ops for a kernel launched without it, and below sm_90
// (the real target's architecture, not KILN_ARCH: an emulated older one still runs on sm_90,
// launched the same way).
__device__ __forceinline__ void kiln_wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(KILN_HOST)
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// 16-bit floats as bit patterns; conversions go through inline PTX, or integer arithmetic where
// the target has no instruction for them (bf16 before sm_80).
struct kiln_f16 { unsigned short bits; };
struct kiln_bf16 { unsigned short bits; };

__device__ __forceinline__ float kiln_to_float(float v) { return v; }
__device__ __forceinline__ float kiln_to_float(kiln_f16 v) {
#ifdef KILN_HOST
  return kiln_host_f16_to_float(v.bits);  // host emulation (tests): tests/host/cuda_host.h
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
#endif
}
__device__ __forceinline__ float kiln_to_float(kiln_bf16 v) {
  // bf16 is the top half of an f32: widening is a shift.
  return __uint_as_float(((unsigned int)v.bits) << 16);
}

template <typename T> __device__ __forceinline__ T kiln_from_float(float f);
template <> __device__ __forceinline__ float kiln_from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ kiln_f16 kiln_from_float<kiln_f16>(float f) {
  kiln_f16 r;
#ifdef KILN_HOST
  r.bits = kiln_host_float_to_f16(f);
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#endif
  return r;
}
template <> __device__ __forceinline__ kiln_bf16 kiln_from_float<kiln_bf16>(float f) {
  kiln_bf16 r;
#if KILN_ARCH >= 800 && !defined(KILN_HOST)
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#else
  // Round to nearest even on the bits: add half a unit of the kept part (less one when the
  // kept part is even), then truncate; a carry into the exponent rounds up to infinity as it
  // should. NaN keeps its sign and becomes bf16's canonical quiet NaN.
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    r.bits = (unsigned short)(((u >> 16) & 0x8000u) | 0x7fc0u);
  else
    r.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
  return r;
}

// N elements moved as one aligned access: 16 bytes when N * sizeof(T) == 16.
template <typename T, int N> struct alignas(sizeof(T) * N) kiln_vec { T v[N]; };

// A vector's elements as floats. Pass a vector already loaded into registers: widened through a
// reference into global memory, NVRTC splits its one vector load into a load an element.
template <typename T, int N>
__device__ __forceinline__ void kiln_widen(const kiln_vec<T, N>& r, float (&out)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = kiln_to_float(r.v[j]);
}
// bf16 pairs a 32-bit word at a time: a shift or a mask an element, where taking each half
// apart first costs two instructions.
template <int N>
__device__ __forceinline__ void kiln_widen(const kiln_vec<kiln_bf16, N>& r, float (&out)[N]) {
#pragma unroll
  for (int j = 0; j + 1 < N; j += 2) {
    const unsigned w = *reinterpret_cast<const unsigned*>(&r.v[j]);
    out[j] = __uint_as_float(w << 16);
    out[j + 1] = __uint_as_float(w & 0xffff0000u);
  }
  if (N % 2) out[N - 1] = kiln_to_float(r.v[N - 1]);
}

// Loads N elements starting at p[i] as floats; elements at or past n read as 0. The vector path
// needs p + i aligned to N elements, which the op guarantees when it picks N > 1.
template <int N, typename T>
__device__ __forceinline__ void kiln_load_floats(const T* p, int i, int n, float (&out)[N]) {
  if (i + N <= n) {
    // One vector load into registers first (see kiln_widen).
    const kiln_vec<T, N> v = *reinterpret_cast<const kiln_vec<T, N>*>(p + i);
    kiln_widen(v, out);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = (i + k < n) ? kiln_to_float(p[i + k]) : 0.0f;
  }
}

// Stores N floats to p[i..i+N) as one aligned vector: for callers that know i + N <= n.
template <int N, typename T>
__device__ __forceinline__ void kiln_store_vec(T* p, int i, const float (&in)[N]) {
  kiln_vec<T, N> v;
#pragma unroll
  for (int k = 0; k < N; ++k) v.v[k] = kiln_from_float<T>(in[k]);
  *reinterpret_cast<kiln_vec<T, N>*>(p + i) = v;
}

// Stores N floats to p[i..i+N), dropping elements at or past n.
template <int N, typename T>
__device__ __forceinline__ void kiln_store_floats(T* p, int i, int n, const float (&in)[N]) {
  if (i + N <= n) {
    kiln_store_vec<N>(p, i, in);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (i + k < n) p[i + k] = kiln_from_float<T>(in[k]);
  }
}

__device__ __forceinline__ float kiln_warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The fewest lanes, a power of two, that hold N values one a lane (at most a warp's 32).
template <int N>
__host__ __device__ constexpr int kiln_span_for() {
  int span = 1;
  while (span < N && span < 32) span *= 2;
  return span;
}

// Sum over each aligned group of SPAN lanes (a power of two), returned to each lane of the
// group: the same bits in every lane, as kiln_warp_sum's, in log2(SPAN) steps instead of five.
template <int SPAN>
__device__ __forceinline__ float kiln_span_sum(float v) {
#pragma unroll
  for (int offset = SPAN / 2; offset > 0; offset >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block, returned to every thread. `scratch` holds one float per warp; the
// trailing barrier lets the caller reuse it at once.
template <int BLOCK_DIM>
__device__ __forceinline__ float kiln_block_sum(float v, float* scratch) {
  static_assert(BLOCK_DIM % 32 == 0 && BLOCK_DIM <= 1024, "block dim must be a multiple of 32");
  constexpr int WARPS = BLOCK_DIM / 32;
  v = kiln_warp_sum(v);
  if (WARPS == 1) return v;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < WARPS ? scratch[lane] : 0.0f;
  v = kiln_warp_sum(v);
  __syncthreads();
  return v;
}

// Dtype codes as DType::code() numbers them, for families with a second dtype.
template <int CODE> struct kiln_dtype;
template <> struct kiln_dtype<0> { typedef float type; };
template <> struct kiln_dtype<1> { typedef kiln_f16 type; };
template <> struct kiln_dtype<2> { typedef kiln_bf16 type; };

// The most dimensions an array has (runtime::MAX_RANK).
#define KILN_MAX_RANK 8
struct kiln_layout {
  long long shape[KILN_MAX_RANK];
  long long strides[KILN_MAX_RANK];  // in elements
};

// Sums over each group of GROUP consecutive threads (GROUP a multiple of 32 dividing BLOCK_DIM),
// returned to every thread of the group: kiln_group_sum for one value, kiln_group_sum2 for two
// at the price of one. Every thread of the group must call them (they may hold its barrier).
// `scratch` holds KILN_SCRATCH(BLOCK_DIM) floats and `round` counts the calls: each call writes
// the half the previous one did not, so one barrier per sum is enough (a thread reads sum n's
// half before it reaches sum n + 1's barrier, after which sum n + 2 writes it). A half holds a
// first and a second value per warp, so the two kinds may follow one another.
#define KILN_SCRATCH(BLOCK_DIM) (4 * (BLOCK_DIM) / 32)
// Waits for the threads of this thread's group only: a named barrier per group (1..GROUPS; 0
// is __syncthreads), so that the rows of a block do not wait for one another.
template <int GROUP, int BLOCK_DIM>
__device__ __forceinline__ void kiln_group_barrier() {
  constexpr int GROUPS = BLOCK_DIM / GROUP;
  static_assert(GROUPS <= 15, "16 hardware barriers per block, 0 taken by __syncthreads");
  if constexpr (GROUPS == 1) {
    __syncthreads();
  } else {
#ifdef KILN_HOST
    kiln_host_group_barrier(GROUP);  // host emulation (tests): tests/host/cuda_host.h
#else
    asm volatile("bar.sync %0, %1;" ::"r"(1 + (int)threadIdx.x / GROUP), "n"(GROUP) : "memory");
#endif
  }
}
template <int GROUP, int BLOCK_DIM>
__device__ __forceinline__ float kiln_group_sum(float v, float* scratch, int& round) {
  static_assert(GROUP % 32 == 0 && BLOCK_DIM % GROUP == 0, "groups are whole warps");
  v = kiln_warp_sum(v);
  if (GROUP == 32) return v;
  constexpr int WARPS = GROUP / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* half = scratch + (round++ & 1) * (2 * BLOCK_DIM / 32);
  if (lane == 0) half[warp] = v;
  kiln_group_barrier<GROUP, BLOCK_DIM>();
  const float* mine = half + (warp / WARPS) * WARPS;
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < WARPS; ++i) s += mine[i];
  return s;
}
// The two warp sums share their shuffles: after the first step the lower half-warp carries a
// and the upper half b, so each later step moves one value (5 shuffles, not 10). The additions
// are those of two separate butterflies, so the sums are the same.
template <int GROUP, int BLOCK_DIM>
__device__ __forceinline__ void kiln_group_sum2(float& a, float& b, float* scratch, int& round) {
  static_assert(GROUP % 32 == 0 && BLOCK_DIM % GROUP == 0, "groups are whole warps");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool upper = lane >= 16;
  float v = upper ? b : a;
  v += __shfl_xor_sync(0xffffffffu, upper ? a : b, 16);
#pragma unroll
  for (int offset = 8; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (GROUP == 32) {
    a = __shfl_sync(0xffffffffu, v, 0);
    b = __shfl_sync(0xffffffffu, v, 16);
    return;
  }
  constexpr int WARPS = GROUP / 32;
  float* half = scratch + (round++ & 1) * (2 * BLOCK_DIM / 32);
  if (lane == 0) half[warp] = v;
  if (lane == 16) half[BLOCK_DIM / 32 + warp] = v;
  kiln_group_barrier<GROUP, BLOCK_DIM>();
  const float* mine = half + (warp / WARPS) * WARPS;
  a = b = 0.0f;
#pragma unroll
  for (int i = 0; i < WARPS; ++i) {
    a += mine[i];
    b += mine[BLOCK_DIM / 32 + i];
  }
}

// Whether the target copies global to shared memory asynchronously (cp.async, sm_80+). Before
// sm_80 the three calls below still work, as a plain load and store: the copy is complete when
// kiln_cp_async returns, so every wait is already satisfied.
// (The host emulation of the tests copies at once whatever the architecture.)
#ifdef KILN_HOST
#define KILN_HAS_CP_ASYNC 0
#else
#define KILN_HAS_CP_ASYNC (KILN_ARCH >= 800)
#endif

// An unsigned type of exactly BYTES bytes (2, 4, 8 or 16), for the plain copy.
template <int BYTES> struct kiln_word;
template <> struct kiln_word<2> { typedef unsigned short type; };
template <> struct kiln_word<4> { typedef unsigned int type; };
template <> struct kiln_word<8> { typedef uint2 type; };
template <> struct kiln_word<16> { typedef uint4 type; };

// 16 bytes (or BYTES) copied from global to shared memory without passing through registers;
// complete once kiln_cp_async_wait lets the group it was committed in through (sm_80+).
// L1: keep the line in L1 (.ca), for data the block reads again soon; else L2 only (.cg).
template <int BYTES, bool L1>
__device__ __forceinline__ void kiln_cp_async(void* smem, const void* gmem, bool valid) {
#if KILN_HAS_CP_ASYNC
  const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
  const int src_bytes = valid ? BYTES : 0;  // 0: fill with zeros, read nothing
  if constexpr (BYTES == 16 && !L1)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
                 "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(gmem),
                 "n"(BYTES), "r"(src_bytes));
#else
  typedef typename kiln_word<BYTES>::type W;
  W v{};  // zeros where the copy reads nothing
  if (valid) v = *reinterpret_cast<const W*>(gmem);
  *reinterpret_cast<W*>(smem) = v;
#endif
}
__device__ __forceinline__ void kiln_cp_async_commit() {
#if KILN_HAS_CP_ASYNC
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void kiln_cp_async_wait() {
  // "memory": shared loads of the landed data must not move above the wait.
#if KILN_HAS_CP_ASYNC
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
  asm volatile("" ::: "memory");
#endif
}

// A thread's pixels of a tile of rows x cols pixels starting at pixel (h0, w0) of image n of
// an (batch, ext_h, ext_w, chans) array, for the staging loops of the convolution families:
// pixel `first`, then every `step`-th, row-major. kiln_walk_start holds what does not change
// from tile to tile (the first pixel's row and column, the step in rows and columns), computed
// once a kernel: its two divisions cost more than a whole small tile's copies. kiln_tile_walk
// then steps (r, q), the pixel's row and column in the tile, and `at`, the element offset of
// its channel c in the array, instead of recomputing them (a division and a chain of 64-bit
// multiply-adds a pixel were half of a stride-2 grouped forward's instructions). `at` means
// something only where inside() holds. `image` is the image's first row, n * ext_h.
struct kiln_walk_start {
  int r, q, step_r, step_q;
};
__device__ __forceinline__ kiln_walk_start kiln_walk_start_of(int first, int step, int cols) {
  const int r = first / cols, step_r = step / cols;
  return {r, first - r * cols, step_r, step - step_r * cols};
}
// Where a pass of the block's threads covers whole rows of a tile (step >= cols), a staging loop
// may instead keep each thread on one column and step it down the rows: its column test, and
// the wrap at a row's end, then leave the loop (the depthwise stencil's copies took about 32
// instructions a 16-byte piece, a third of a backward-weight block's, when every copy stepped to
// a new column). kiln_copy_start is such a start: the walk's step is the pass's whole rows
// (walk.step_q == 0), and threads past them idle; where a pass does not cover a row, it is the
// plain walk.
struct kiln_copy_start {
  kiln_walk_start walk;
  bool active;  // row passes: the thread has a column (the pass's pixels past whole rows idle)
};
__device__ __forceinline__ kiln_copy_start kiln_copy_start_of(int first, int step, int cols) {
  if (step < cols) return {kiln_walk_start_of(first, step, cols), true};
  const int whole = step / cols * cols;
  return {kiln_walk_start_of(first, whole, cols), first < whole};
}
// A row pass's copies (start.walk.step_q == 0): the 16-byte piece at channel c of the thread's
// column of rows start.walk.r, + step_r, ... (of `rows`) of a tile whose first pixel is (h0, w0)
// of image rows `image` on of an (.., ext_h, ext_w, chans) array, into dst, dst + dst_step, ...;
// zeros outside the array or past the channels (in_chans false). cp.async: see
// kiln_cp_async_commit/wait.
template <typename T>
__device__ __forceinline__ void kiln_copy_column(const T* __restrict__ src, T* dst, int dst_step,
                                                 const kiln_copy_start& start, long long image,
                                                 int h0, int w0, int rows, int ext_h, int ext_w,
                                                 int chans, int c, bool in_chans) {
  if (!start.active) return;
  const kiln_walk_start& w = start.walk;
  const int col = w0 + w.q;
  const bool col_ok = in_chans && col >= 0 && col < ext_w;
  const long long step_at = (long long)w.step_r * ext_w * chans;
  long long at = ((image + h0 + w.r) * ext_w + col) * chans + c;
  for (int r = w.r; r < rows; r += w.step_r, at += step_at, dst += dst_step) {
    const bool ok = col_ok && (unsigned)(h0 + r) < (unsigned)ext_h;
    kiln_cp_async<16, false>(dst, ok ? src + at : src, ok);
  }
}
struct kiln_tile_walk {
  int r, q, h0, w0, cols, step_r, step_q;
  long long at, step_at, wrap_at;
  __device__ __forceinline__ kiln_tile_walk(const kiln_walk_start& start, int cols_,
                                            long long image, int h0_, int w0_, int ext_w,
                                            int chans, int c)
      : r(start.r), q(start.q), h0(h0_), w0(w0_), cols(cols_), step_r(start.step_r),
        step_q(start.step_q) {
    const long long row_pitch = (long long)ext_w * chans;
    at = ((image + h0 + r) * ext_w + w0 + q) * chans + c;
    step_at = step_r * row_pitch + (long long)step_q * chans;
    wrap_at = row_pitch - (long long)cols * chans;
  }
  __device__ __forceinline__ bool inside(int ext_h, int ext_w) const {
    const int h = h0 + r, w = w0 + q;
    return h >= 0 && h < ext_h && w >= 0 && w < ext_w;
  }
  __device__ __forceinline__ void next() {
    r += step_r;
    q += step_q;
    at += step_at;
    if (q >= cols) {  // step_q < cols: one wrap at most
      q -= cols;
      ++r;
      at += wrap_at;
    }
  }
};

// N parameter values (weight or bias) at p[i * stride ..] as floats: one vector load when
// `vec` (stride 1 and aligned), else strided scalar loads. Missing (p null) reads as `missing`.
template <int N, typename T>
__device__ __forceinline__ void kiln_load_param(const T* p, long long stride, bool vec, int i, int n,
                                                float missing, float (&out)[N]) {
  if (p == nullptr) {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = missing;
  } else if (vec) {
    kiln_load_floats<N>(p, i, n, out);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = (i + k < n) ? kiln_to_float(p[(i + k) * stride]) : 0.0f;
  }
}

// NI vectors of kiln_load_param, vector k at element i0 + k * step, for a kernel's prologue.
// The branches on p and vec are taken once for all NI, so that every load goes out before the
// first is waited for: a branch per vector made each load wait for the one before (the 16-bit
// split forward's 16 scalar weights and 16 biases of a thread took 32 memory latencies in turn).
template <int NI, int N, typename T>
__device__ __forceinline__ void kiln_load_params(const T* p, long long stride, bool vec, int i0,
                                                 int step, int n, float missing,
                                                 float (&out)[NI][N]) {
  if (p == nullptr) {
#pragma unroll
    for (int k = 0; k < NI; ++k)
#pragma unroll
      for (int j = 0; j < N; ++j) out[k][j] = missing;
  } else if (vec) {
    // Whole vectors first (every vector, when n is a multiple of N, as the ops make it), then
    // any vector the end of the row cuts, element by element.
#pragma unroll
    for (int k = 0; k < NI; ++k) {
      const int i = i0 + k * step;
      kiln_vec<T, N> v{};
      if (i + N <= n) v = *reinterpret_cast<const kiln_vec<T, N>*>(p + i);
      kiln_widen(v, out[k]);
    }
#pragma unroll
    for (int k = 0; k < NI; ++k) {
      const int i = i0 + k * step;
      if (i < n && i + N > n) {
#pragma unroll
        for (int j = 0; j < N; ++j) out[k][j] = i + j < n ? kiln_to_float(p[i + j]) : 0.0f;
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < NI; ++k)
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int i = i0 + k * step + j;
        out[k][j] = i < n ? kiln_to_float(p[i * stride]) : 0.0f;
      }
  }
}
