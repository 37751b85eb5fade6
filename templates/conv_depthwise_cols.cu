// Depthwise backward-weight by column walks: one output channel a group, the same stride S
// along both dims (1 or 2), kernels up to 7x7. Same problem as conv_depthwise.cu (struct
// kiln_depthwise): src = input, other = cotangent (out_h, out_w: its extents).
//
// dW[c][tap] sums source x cotangent over every output: each operand is read once and each
// cotangent value multiplies KH x KW source values. A thread takes V channels (one vector) of
// TW consecutive output columns and walks down the source rows of a segment, loading straight
// from global memory (neighbouring threads' windows overlap by KW - S columns, which the L1
// cache serves): each source row is loaded once, a window of WIN columns, and meets the
// cotangent rows open at that step (at most NACC: an output row opens at its tap row 0, where
// its TW x V cotangent values are loaded, and closes after tap row KH - 1). No shared memory and
// no barriers in the walk: the next source row's loads (and those of the cotangent row it
// opens) are issued a step ahead of the row being added, so they are in flight meanwhile.
//
// The sums stay in registers over all of a block's tiles (blocks are persistent: tile
// blockIdx.x, then every gridDim.x-th); then the block adds its column groups in a fixed order
// through shared memory and writes one f32 partial a block along x, which the split sum adds
// up, or the gradient itself where gridDim.x is 1. So the result is deterministic.
//
// The problem's tile fields: tile_h output rows a segment, tile_w output columns a band
// (blockDim.y * TW), tiles_h segments and tiles_w bands an image, tiles = batch * tiles_h *
// tiles_w; chunks of blockDim.x * V channels along the grid's y.
{{> prelude}}
{{> depthwise}}

typedef {{dtype}} T;
constexpr int KH = {{KH}}, KW = {{KW}};
constexpr int TW = {{TW}};  // output columns a thread
constexpr int V = {{V}};    // channels a thread (one vector)
constexpr int S = {{S}};    // the stride along both dims
constexpr int THREADS = {{block_dim}};  // the most a block has (blockDim.x * blockDim.y)
constexpr int KSIZE = KH * KW;
constexpr int WIN = (TW - 1) * S + KW;  // source columns a thread loads a row
// Cotangent rows a source row meets at most, and the steps after which their slots repeat:
// output row o lives in slot o % NACC, and the walk is unrolled by PERIOD source rows so that
// every slot index is a compile-time constant.
constexpr int NACC = (KH + S - 1) / S;
constexpr int PERIOD = S * NACC;
static_assert(V == 1 || V == 2 || V == 4, "a thread takes 1, 2 or 4 channels");
static_assert(S == 1 || S == 2, "strides 1 and 2");

// Mirrors ops::conv::depthwise::Problem (repr(C)).
struct kiln_depthwise {
  int batch;
  int src_h, src_w, src_c;  // the source's extents and channels (src_c == out_c)
  int out_h, out_w, out_c;  // the cotangent's extents and channels
  int off_h, off_w;         // source position of output 0 at tap 0 (-padding)
  int tile_h, tile_w;       // output rows a segment, output columns a band
  int tiles_h, tiles_w;     // segments and bands an image
  int tiles;                // batch * tiles_h * tiles_w
  int chunks;               // blocks of blockDim.x * V channels (the grid along y)
  int reverse;              // the weight's tap is KSIZE - 1 - t (flip)
  int vec_src;              // unused: the plan takes channels in whole vectors
  int vec_dy;               // unused
  int tiles_per_split;      // unused: blocks walk every gridDim.x-th tile
  int base_h, base_w;       // unused (0)
};

typedef kiln_vec<T, V> kiln_chans;  // a thread's channels at one pixel, as stored

// The thread's V channels at p (a whole, aligned vector), or zeros where !ok.
__device__ __forceinline__ kiln_chans kiln_load_chans(const T* __restrict__ p, bool ok) {
  kiln_chans raw{};
  if (ok) raw = *reinterpret_cast<const kiln_chans*>(p);
  return raw;
}

// Adds tile `tile`'s outputs of the thread's channels (from `c`) and columns to `sum`.
__device__ __forceinline__ void kiln_walk_tile(const T* __restrict__ src, const T* __restrict__ dy,
                                               const kiln_depthwise& p, int tile, int c,
                                               float (&sum)[KSIZE][V]) {
  const int band = tile % p.tiles_w, rest = tile / p.tiles_w;
  const int seg = rest % p.tiles_h, n = rest / p.tiles_h;
  const int ow = band * p.tile_w + threadIdx.y * TW;  // the thread's first output column
  if (ow >= p.out_w) return;
  const int oh0 = seg * p.tile_h;
  const int rows = min(p.tile_h, p.out_h - oh0);
  const int steps = (rows - 1) * S + KH;  // source rows the segment reads
  const int ih0 = oh0 * S + p.off_h, iw0 = ow * S + p.off_w;
  const T* x_image = src + (long long)n * p.src_h * p.src_w * p.src_c + c;
  const T* g_image = dy + (long long)n * p.out_h * p.out_w * p.out_c + c;
  // Which of the window's source columns and the thread's cotangent columns exist.
  bool x_col[WIN], g_col[TW];
#pragma unroll
  for (int q = 0; q < WIN; ++q) x_col[q] = (unsigned)(iw0 + q) < (unsigned)p.src_w;
#pragma unroll
  for (int j = 0; j < TW; ++j) g_col[j] = ow + j < p.out_w;
  // Loads source row s of the segment (zeros outside the image and past the segment's rows),
  // and the cotangent of its output row o (zeros past the segment).
  auto load_source = [&](int s, kiln_chans (&xr)[WIN]) {
    const int ih = ih0 + s;
    const bool ok = s < steps && (unsigned)ih < (unsigned)p.src_h;
    const T* line = x_image + ((long long)ih * p.src_w + iw0) * p.src_c;
#pragma unroll
    for (int q = 0; q < WIN; ++q) xr[q] = kiln_load_chans(line + (long long)q * p.src_c, ok && x_col[q]);
  };
  auto load_cotangent = [&](int o, kiln_chans (&gr)[TW]) {
    const T* line = g_image + (long long)(oh0 + o) * p.out_w * p.out_c;
#pragma unroll
    for (int j = 0; j < TW; ++j)
      gr[j] = kiln_load_chans(line + (long long)(ow + j) * p.out_c, o < rows && g_col[j]);
  };

  // The open cotangent rows as f32; a slot no row has opened yet holds zeros.
  float g[NACC][TW][V];
#pragma unroll
  for (int r = 0; r < NACC; ++r)
#pragma unroll
    for (int j = 0; j < TW; ++j)
#pragma unroll
      for (int v = 0; v < V; ++v) g[r][j][v] = 0.0f;
  // The next step's loads, issued a step ahead so that they are in flight while this one adds:
  // its source row and, on the steps where an output row opens (tap row 0), that row's
  // cotangent.
  kiln_chans x_next[WIN], g_next[TW];
  load_source(0, x_next);
  load_cotangent(0, g_next);

  for (int s0 = 0; s0 < steps; s0 += PERIOD) {
#pragma unroll
    for (int u = 0; u < PERIOD; ++u) {
      const int s = s0 + u;
      if (s >= steps) break;
      // Output row s / S opens here.
      if (u % S == 0) {
#pragma unroll
        for (int j = 0; j < TW; ++j)
#pragma unroll
          for (int v = 0; v < V; ++v) g[u / S % NACC][j][v] = kiln_to_float(g_next[j].v[v]);
      }
      kiln_chans x_row[WIN];
#pragma unroll
      for (int q = 0; q < WIN; ++q) x_row[q] = x_next[q];
      // Meant to keep the loads from being hoisted more than a step ahead, where they would
      // take the registers the sums need (ptxas reported the same registers without it).
      asm volatile("" ::: "memory");
      load_source(s + 1, x_next);
      if ((u + 1) % S == 0) load_cotangent((s + 1) / S, g_next);
#pragma unroll
      for (int q = 0; q < WIN; ++q) {
        float x[V];
#pragma unroll
        for (int v = 0; v < V; ++v) x[v] = kiln_to_float(x_row[q].v[v]);
        // Source row s meets output row o at tap row kh = s - o * S.
#pragma unroll
        for (int kh = 0; kh < KH; ++kh) {
          if ((u - kh + PERIOD) % S != 0) continue;
          const int r = (u - kh + PERIOD) / S % NACC;
#pragma unroll
          for (int j = 0; j < TW; ++j) {
            const int kw = q - j * S;
            if (kw < 0 || kw >= KW) continue;
#pragma unroll
            for (int v = 0; v < V; ++v) sum[kh * KW + kw][v] += x[v] * g[r][j][v];
          }
        }
      }
    }
  }
}

// Shared memory: the column groups' sums at the end, blockDim.y x KSIZE x (blockDim.x * V) f32.
// Block: (channel vectors, column groups); grid: (persistent blocks, chunks).
extern "C" __global__ void __launch_bounds__(THREADS, 2) {{kernel}}(
    const T* __restrict__ src, const T* __restrict__ other, T* __restrict__ out,
    float* __restrict__ partial, kiln_depthwise p) {
  extern __shared__ float4 kiln_w4[];  // 16-byte aligned (the host harness's name for it too)
  const int chans = blockDim.x * V;  // channels a block
  const int c0 = blockIdx.y * chans;
  const int c = c0 + threadIdx.x * V;  // the thread's first channel
  float sum[KSIZE][V];
#pragma unroll
  for (int t = 0; t < KSIZE; ++t)
#pragma unroll
    for (int v = 0; v < V; ++v) sum[t][v] = 0.0f;
  if (c < p.out_c)  // the plan keeps out_c a multiple of V
    for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x)
      kiln_walk_tile(src, other, p, tile, c, sum);

  // The column groups' sums, added in order, as the block's partial.
  kiln_depthwise_block_sums(sum, reinterpret_cast<float*>(kiln_w4), chans, c0, p.out_c,
                            p.reverse, out, partial);
}
