// Depthwise convolution by column walks: one output channel a group, the same stride S along
// both dims (1 or 2), kernels up to 7x7. Same problem as conv_depthwise.cu (struct
// kiln_depthwise). Every pass walks alike: a thread takes V channels (one vector) of TW
// consecutive output columns and walks down the source rows of a segment, loading straight
// from global memory (neighbouring threads' windows overlap by KW - S columns, which the L1
// cache serves), each row a step ahead of the row being added, with no shared memory and no
// barriers in the walk.
//
// PASS 0 forward and PASS 1 backward-data (stride 1: the forward of the cotangent with the taps
// turned round, as the problem's offsets and `reverse` say): src = input or cotangent, other =
// the weight, out = the gather's output. Source row s meets the output rows open at that step
// (at most NACC: an output row opens at its tap row 0 with zero sums and is stored after tap
// row KH - 1); the KH x KW x V weights stay in registers. On small images (a row or half a row
// a thread) this reads each source value about once where the staged kernels' tiles and rings
// cost more in their copies and barriers than the layer's few FMAs. A block walks one tile (a
// whole image's rows: one segment) of one chunk, chunks fastest along the grid's x.
//
// PASS 2 backward-weight: src = input, other = cotangent (out_h, out_w: its extents).
//
// dW[c][tap] sums source x cotangent over every output: each operand is read once and each
// cotangent value multiplies KH x KW source values. Each source row is loaded once, a window of
// WIN columns, and meets the cotangent rows open at that step (at most NACC: an output row opens
// at its tap row 0, where its TW x V cotangent values are loaded, and closes after tap row
// KH - 1); the next source row's loads (and those of the cotangent row it opens) are issued a
// step ahead of the row being added, so they are in flight meanwhile.
//
// Backward-weight's sums stay in registers over all of a block's tiles (blocks are persistent:
// tile blockIdx.x, then every gridDim.x-th; chunks along the grid's y); then the block adds its
// column groups in a fixed order through shared memory and writes one f32 partial a block
// along x, which the split sum adds up, or the gradient itself where gridDim.x is 1. So the
// result is deterministic.
//
// The problem's tile fields: tile_h output rows a segment, tile_w output columns a band
// (blockDim.y * TW), tiles_h segments and tiles_w bands an image, tiles = batch * tiles_h *
// tiles_w; chunks of blockDim.x * V channels.
{{> prelude}}
{{> depthwise}}

typedef {{dtype}} T;
constexpr int PASS = {{PASS}};
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
static_assert(PASS != 1 || S == 1, "backward-data at stride 1 only");

// Mirrors ops::conv::depthwise::Problem (repr(C)).
struct kiln_depthwise {
  int batch;
  int src_h, src_w, src_c;  // the source's extents and channels (src_c == out_c)
  int out_h, out_w, out_c;  // the cotangent's extents and channels
  int off_h, off_w;         // source position of output 0 at tap 0 (-padding)
  int tile_h, tile_w;       // output rows a segment, output columns a band
  int tiles_h, tiles_w;     // segments and bands an image
  int tiles;                // batch * tiles_h * tiles_w
  int chunks;               // blocks of blockDim.x * V channels
  int reverse;              // the weight's tap is KSIZE - 1 - t (flip; backward-data: no flip)
  int vec_src;              // unused: the plan takes channels in whole vectors
  int vec_dy;               // unused
  int tiles_per_split;      // unused: blocks walk every gridDim.x-th tile
  int base_h, base_w;       // unused (0)
  int split_halo;           // unused (0)
};

typedef kiln_vec<T, V> kiln_chans;  // a thread's channels at one pixel, as stored

// The same bytes as one unsigned word (two or four for 8 and 16 bytes). Loads land in words
// and are split into channels only where they are added: a vector of 16-bit halves, zeroed and
// then conditionally loaded, was split right after its load, so every step waited for the row
// it had only just asked for.
typedef typename kiln_word<sizeof(kiln_chans)>::type kiln_raw;

// The thread's V channels at p (a whole, aligned vector), or zeros where !ok.
__device__ __forceinline__ kiln_raw kiln_load_chans(const T* __restrict__ p, bool ok) {
  kiln_raw raw{};
  if (ok) raw = *reinterpret_cast<const kiln_raw*>(p);
  return raw;
}

// Channel v of a loaded word, as f32.
__device__ __forceinline__ float kiln_chan(const kiln_raw& raw, int v) {
  return kiln_to_float(reinterpret_cast<const kiln_chans*>(&raw)->v[v]);
}

// Loads source row s of a segment into xr: WIN columns from the image at x_image, the window's
// first column iw0, its first row ih0 (zeros outside the image and past the segment's steps).
__device__ __forceinline__ void kiln_load_source(const T* __restrict__ x_image, int ih0, int iw0,
                                                 const bool (&x_col)[WIN], int steps, int s,
                                                 const kiln_depthwise& p, kiln_raw (&xr)[WIN]) {
  const int ih = ih0 + s;
  const bool ok = s < steps && (unsigned)ih < (unsigned)p.src_h;
  const T* line = x_image + ((long long)ih * p.src_w + iw0) * p.src_c;
#pragma unroll
  for (int q = 0; q < WIN; ++q) xr[q] = kiln_load_chans(line + (long long)q * p.src_c, ok && x_col[q]);
}

// The source row added at step u of a period meets output row slot r at tap row kh (where
// u - kh is a multiple of S) and the thread's column j at tap column q - j * S: calls
// meet(tap, r, j, x) with window column q's channels x as f32.
template <typename Meet>
__device__ __forceinline__ void kiln_meet_row(int u, const kiln_raw (&x_row)[WIN], Meet&& meet) {
#pragma unroll
  for (int q = 0; q < WIN; ++q) {
    float x[V];
#pragma unroll
    for (int v = 0; v < V; ++v) x[v] = kiln_chan(x_row[q], v);
#pragma unroll
    for (int kh = 0; kh < KH; ++kh) {
      if ((u - kh + PERIOD) % S != 0) continue;
      const int r = (u - kh + PERIOD) / S % NACC;
#pragma unroll
      for (int j = 0; j < TW; ++j) {
        const int kw = q - j * S;
        if (kw < 0 || kw >= KW) continue;
        meet(kh * KW + kw, r, j, x);
      }
    }
  }
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
  auto load_source = [&](int s, kiln_raw (&xr)[WIN]) {
    kiln_load_source(x_image, ih0, iw0, x_col, steps, s, p, xr);
  };
  // Loads the cotangent of output row o of the segment (zeros past the segment).
  auto load_cotangent = [&](int o, kiln_raw (&gr)[TW]) {
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
  kiln_raw x_next[WIN], g_next[TW];
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
          for (int v = 0; v < V; ++v) g[u / S % NACC][j][v] = kiln_chan(g_next[j], v);
      }
      kiln_raw x_row[WIN];
#pragma unroll
      for (int q = 0; q < WIN; ++q) x_row[q] = x_next[q];
      // Meant to keep the loads from being hoisted more than a step ahead, where they would
      // take the registers the sums need (ptxas reported the same registers without it).
      asm volatile("" ::: "memory");
      load_source(s + 1, x_next);
      if ((u + 1) % S == 0) load_cotangent((s + 1) / S, g_next);
      // Source row s meets output row o at tap row kh = s - o * S.
      kiln_meet_row(u, x_row, [&](int t, int r, int j, const float (&x)[V]) {
#pragma unroll
        for (int v = 0; v < V; ++v) sum[t][v] += x[v] * g[r][j][v];
      });
    }
  }
}

// Forward and backward-data: stores tile `tile`'s outputs of the thread's channels (from `c`)
// and columns, the taps weighted by `wt` (in walking order).
__device__ __forceinline__ void kiln_walk_output_tile(const T* __restrict__ src,
                                                      T* __restrict__ out,
                                                      const kiln_depthwise& p, int tile, int c,
                                                      const float (&wt)[KSIZE][V]) {
  const int band = tile % p.tiles_w, rest = tile / p.tiles_w;
  const int seg = rest % p.tiles_h, n = rest / p.tiles_h;
  const int ow = band * p.tile_w + threadIdx.y * TW;  // the thread's first output column
  if (ow >= p.out_w) return;
  const int oh0 = seg * p.tile_h;
  const int rows = min(p.tile_h, p.out_h - oh0);
  const int steps = (rows - 1) * S + KH;  // source rows the segment reads
  const int ih0 = oh0 * S + p.off_h, iw0 = ow * S + p.off_w;
  const T* x_image = src + (long long)n * p.src_h * p.src_w * p.src_c + c;
  T* y_line = out + ((long long)n * p.out_h + oh0) * p.out_w * p.out_c + (long long)ow * p.out_c + c;
  // Which of the window's source columns and the thread's output columns exist.
  bool x_col[WIN], y_col[TW];
#pragma unroll
  for (int q = 0; q < WIN; ++q) x_col[q] = (unsigned)(iw0 + q) < (unsigned)p.src_w;
#pragma unroll
  for (int j = 0; j < TW; ++j) y_col[j] = ow + j < p.out_w;
  auto load_source = [&](int s, kiln_raw (&xr)[WIN]) {
    kiln_load_source(x_image, ih0, iw0, x_col, steps, s, p, xr);
  };

  // The open output rows' sums: output row o in slot o % NACC, zeroed when it opens (tap row
  // 0); a slot's sums before its first row opens are never stored.
  float acc[NACC][TW][V];
#pragma unroll
  for (int r = 0; r < NACC; ++r)
#pragma unroll
    for (int j = 0; j < TW; ++j)
#pragma unroll
      for (int v = 0; v < V; ++v) acc[r][j][v] = 0.0f;
  kiln_raw x_next[WIN];
  load_source(0, x_next);

  for (int s0 = 0; s0 < steps; s0 += PERIOD) {
#pragma unroll
    for (int u = 0; u < PERIOD; ++u) {
      const int s = s0 + u;
      if (s >= steps) break;
      if (u % S == 0) {  // output row s / S opens here
#pragma unroll
        for (int j = 0; j < TW; ++j)
#pragma unroll
          for (int v = 0; v < V; ++v) acc[u / S % NACC][j][v] = 0.0f;
      }
      kiln_raw x_row[WIN];
#pragma unroll
      for (int q = 0; q < WIN; ++q) x_row[q] = x_next[q];
      asm volatile("" ::: "memory");  // as in kiln_walk_tile
      load_source(s + 1, x_next);
      // Source row s meets output row o at tap row kh = s - o * S.
      kiln_meet_row(u, x_row, [&](int t, int r, int j, const float (&x)[V]) {
#pragma unroll
        for (int v = 0; v < V; ++v) acc[r][j][v] += wt[t][v] * x[v];
      });
      // Output row o = (s - (KH - 1)) / S has met its last tap row: stored.
      if ((u - (KH - 1) + PERIOD) % S == 0 && s >= KH - 1) {
        const int o = (s - (KH - 1)) / S;
        const int r = (u - (KH - 1) + PERIOD) / S % NACC;
        if (o < rows) {
          T* y = y_line + (long long)o * p.out_w * p.out_c;
#pragma unroll
          for (int j = 0; j < TW; ++j) {
            if (!y_col[j]) continue;
            kiln_chans packed;
#pragma unroll
            for (int v = 0; v < V; ++v) packed.v[v] = kiln_from_float<T>(acc[r][j][v]);
            *reinterpret_cast<kiln_chans*>(y + (long long)j * p.out_c) = packed;
          }
        }
      }
    }
  }
}

// Forward and backward-data: no shared memory, a tile a block; grid: (chunks x tiles). Backward-
// weight: the column groups' sums at the end in shared memory, blockDim.y x KSIZE x
// (blockDim.x * V) f32; grid: (persistent blocks, chunks). Block: (channel vectors, column
// groups).
extern "C" __global__ void __launch_bounds__(THREADS, 2) {{kernel}}(
    const T* __restrict__ src, const T* __restrict__ other, T* __restrict__ out,
    float* __restrict__ partial, kiln_depthwise p) {
  extern __shared__ float4 kiln_w4[];  // 16-byte aligned (the host harness's name for it too)
  const int chans = blockDim.x * V;  // channels a block
  // Forward and backward-data: a block a (chunk, tile), chunks fastest, so that the blocks in
  // flight read whole pixels of few images (chunk-major order read every image's first chunk
  // first, short pieces of many DRAM pages at once). Backward-weight: chunks along y.
  const int chunk = PASS != 2 ? blockIdx.x % p.chunks : blockIdx.y;
  const int c0 = chunk * chans;
  const int c = c0 + threadIdx.x * V;  // the thread's first channel
  if constexpr (PASS != 2) {
    if (c >= p.out_c) return;  // the plan keeps out_c a multiple of V; no barriers follow
    // The thread's weights as f32, taps in walking order (reversed for a flipped walk).
    float wt[KSIZE][V];
#pragma unroll
    for (int t = 0; t < KSIZE; ++t)
#pragma unroll
      for (int v = 0; v < V; ++v)
        wt[t][v] = kiln_to_float(other[(long long)(c + v) * KSIZE + (p.reverse ? KSIZE - 1 - t : t)]);
    kiln_walk_output_tile(src, out, p, blockIdx.x / p.chunks, c, wt);
  } else {
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
}
