// Depthwise convolution (one input channel a group, MG = 1, 2 or 4 output channels a group),
// 1-D or 2-D, channels last: input (batch, h, w, cin), weight (cout, kh, kw, 1), output (batch,
// oh, ow, cout), output channel oc reading input channel oc / MG. Such a layer moves far more
// bytes than it multiplies, so each block works on 32 channels (one a lane) and walks tiles of
// outputs: it copies a tile's source rows into shared memory as they are (cp.async, zeros
// outside the source) while it computes the previous tile, and each warp computes OTH x OTW
// outputs a lane at a time, walking their source rows with a window of WIN columns in
// registers, so that each staged value is read once per row of outputs it serves. KH, KW, SH
// and SW are compile-time: the taps and the window are unrolled, with no bounds tests inside.
//
// The three passes share the walk (`kiln_walk`):
//   PASS 0 forward:         out = output, src = input; source row of output row P, tap kh:
//                           P * SH + kh + off_h (off = -pad).
//   PASS 1 backward-data:   out = input gradient, src = cotangent; taps walked backwards
//                           (off = pad - (k - 1)); input channel ci sums the MG cotangent
//                           channels ci * MG + m. At stride S the cotangent is read as if
//                           spread S apart with zeros between (the forward's source of the
//                           transposed convolution), and only its real rows and columns are
//                           staged: the tiles start where the spread source has a real row and
//                           column (p.base_h, p.base_w, up to S - 1 before the image), so each
//                           output's real taps are known at compile time and the zeros are
//                           never read or multiplied.
//   PASS 2 backward-weight: the forward's walk with the cotangent (staged beside the source)
//                           as multiplier and the KH x KW tap sums as accumulators; a block
//                           sums its tiles (a split of the batch's), its warps are added in a
//                           fixed order, and splits write f32 partials that reduce_cols.cu adds
//                           up, so the result is deterministic.
{{> prelude}}

typedef {{dtype}} T;
constexpr int PASS = {{PASS}};
constexpr int MG = {{MG}};
constexpr int KH = {{KH}}, KW = {{KW}};
constexpr int SH = {{SH}}, SW = {{SW}};
constexpr int OTH = {{OTH}}, OTW = {{OTW}};
constexpr int THREADS = {{block_dim}};
constexpr int LANES = 32;  // channels a block, one a lane
constexpr int WARPS = THREADS / LANES;
constexpr int KSIZE = KH * KW;
// The walk's source step an output (forward, backward-weight: the stride) and the spread of
// the source (backward-data: the stride; the staged source holds every DH-th spread row).
constexpr int STEP_H = PASS == 1 ? 1 : SH, STEP_W = PASS == 1 ? 1 : SW;
constexpr int DH = PASS == 1 ? SH : 1, DW = PASS == 1 ? SW : 1;
// Staged source rows and columns OTH x OTW outputs read.
constexpr int SRC_ROWS = ((OTH - 1) * STEP_H + KH - 1) / DH + 1;
constexpr int WIN = ((OTW - 1) * STEP_W + KW - 1) / DW + 1;
// Source channels a staged pixel holds: forward and backward-weight the LANES / MG input
// channels of the block's output channels; backward-data the MG cotangent channels of each of
// its input channels. They are contiguous in the source.
constexpr int PER = PASS == 1 ? LANES * MG : LANES / MG;
constexpr int PLANES = PASS == 1 ? MG : 1;  // weights a lane: PLANES x KSIZE
// Blocks an SM must hold (the launch bound): the smaller kernels' taps, sums and window fit
// fewer registers, and more blocks hide more of the copies' and loads' latency (a 5x5 kernel's
// 4 x 7 sub-tile spilled at three).
constexpr int MIN_BLOCKS = KSIZE <= 9 ? 4 : KSIZE <= 25 && OTH * OTW <= 16 ? 3 : 2;
// Elements of a 16-byte copy.
constexpr int V = 16 / (int)sizeof(T);
static_assert(PER % V == 0 && LANES % V == 0, "staged pixels are whole 16-byte copies");
static_assert(OTH % DH == 0 && OTW % DW == 0, "sub-tiles start on a real source row and column");
// Forward and backward-data store a sub-tile's outputs from one base offset stepped by rows and
// columns: with the offset recomputed in 64 bits and the bounds tested an output, a store took
// about 16 instructions, more than a strided backward-data output's FMAs. Stride-1 f32 specs sit
// at their launch bound's registers, where the stepped offset spilled (multiplier-2 layers
// 6-7% slower): they keep the recomputed one. Its tiles start in the image (DH == DW == 1).
constexpr bool STEPPED_STORES = sizeof(T) == 2 || DH > 1 || DW > 1;

// Mirrors ops::conv::depthwise::Problem (repr(C)).
struct kiln_depthwise {
  int batch;
  int src_h, src_w, src_c;  // the source's extents and channels
  int out_h, out_w, out_c;  // the gather's output (backward-weight: the cotangent)
  int off_h, off_w;         // source position of output 0 at tap 0
  int tile_h, tile_w;       // outputs a tile (multiples of OTH and OTW)
  int tiles_h, tiles_w;     // tiles an image
  int tiles;                // batch * tiles_h * tiles_w
  int chunks;               // blocks of LANES gather outputs along the channels
  int reverse;              // the weight's tap is KSIZE - 1 - t
  int vec_src;              // the source may be copied in 16-byte pieces
  int vec_dy;               // backward-weight: so may the cotangent
  int tiles_per_split;      // backward-weight: tiles a block sums
  int base_h, base_w;       // output position of tile 0 (backward-data at stride 2: -1 or 0)
  int split_halo;           // unused (0)
};

// The staged source rows and columns of a tile.
__device__ __forceinline__ int kiln_rows(const kiln_depthwise& p) {
  return ((p.tile_h - 1) * STEP_H + KH - 1) / DH + 1;
}
__device__ __forceinline__ int kiln_cols(const kiln_depthwise& p) {
  return ((p.tile_w - 1) * STEP_W + KW - 1) / DW + 1;
}

// Copies `rows` x `cols` pixels of P channels, from channel c0 of pixel (n, h0, w0) of an
// (n, ext_h, ext_w, chans) array, into s[pixel * P + k] as they are; zeros outside the array.
// With `vec`, in 16-byte pieces that land asynchronously (kiln_cp_async_commit/wait); else one
// element at a time, at once.
// `start`: kiln_copy_start_of(tid / (P / V), THREADS / (P / V), cols), see kiln_walks_of.
template <int P>
__device__ __forceinline__ void kiln_copy_tile(const T* __restrict__ src, T* s, int n, int h0,
                                               int w0, int rows, int cols, int ext_h, int ext_w,
                                               int chans, int c0, bool vec,
                                               const kiln_copy_start& start) {
  const int tid = threadIdx.y * LANES + threadIdx.x;
  const long long image = (long long)n * ext_h;
  if (vec) {
    // A thread copies piece `part` of every STEP-th pixel.
    constexpr int UPP = P / V;  // pieces a pixel
    static_assert(THREADS % UPP == 0, "a thread's pieces are one part of every STEP-th pixel");
    constexpr int STEP = THREADS / UPP;
    const int part = tid % UPP, c = c0 + part * V;
    const bool in_chans = c < chans;  // pieces past the channels are zero-filled
    const kiln_walk_start& w = start.walk;
    if (w.step_q == 0) {  // whole rows a pass: the thread's column, down the rows
      kiln_copy_column(src, s + (w.r * cols + w.q) * P + part * V, w.step_r * cols * P, start,
                       image, h0, w0, rows, ext_h, ext_w, chans, c, in_chans);
      return;
    }
    const int pixels = rows * cols;
    kiln_tile_walk walk(w, cols, image, h0, w0, ext_w, chans, c);
    for (int pixel = tid / UPP; pixel < pixels; pixel += STEP, walk.next()) {
      const bool ok = in_chans && walk.inside(ext_h, ext_w);
      kiln_cp_async<16, false>(s + pixel * P + part * V, ok ? src + walk.at : src, ok);
    }
  } else {
    const int units = rows * cols * P;
    for (int u = tid; u < units; u += THREADS) {
      const int pixel = u / P, k = u - pixel * P;
      const int r = pixel / cols, q = pixel - r * cols;
      const int h = h0 + r, w = w0 + q, c = c0 + k;
      const bool ok = h >= 0 && h < ext_h && w >= 0 && w < ext_w && c < chans;
      s[u] = ok ? src[((image + h) * ext_w + w) * chans + c] : T{};
    }
  }
}

// A tile as its image, row and column of tiles; also a step of several tiles in the same form.
// A block walks tiles first, first + step, ...: the walk adds the step with carries, as the
// divisions of a tile index cost some 70 instructions a warp and tile.
struct kiln_tile_pos {
  int n, th, tw;
};
__device__ __forceinline__ kiln_tile_pos kiln_tile_pos_of(const kiln_depthwise& p, int tile) {
  const int tw = tile % p.tiles_w, rest = tile / p.tiles_w;
  return {rest / p.tiles_h, rest % p.tiles_h, tw};
}
__device__ __forceinline__ kiln_tile_pos kiln_tile_after(const kiln_depthwise& p,
                                                         kiln_tile_pos t,
                                                         const kiln_tile_pos& step) {
  t.n += step.n;
  t.th += step.th;
  t.tw += step.tw;
  if (t.tw >= p.tiles_w) t.tw -= p.tiles_w, ++t.th;  // step.tw < tiles_w: one carry at most
  if (t.th >= p.tiles_h) t.th -= p.tiles_h, ++t.n;
  return t;
}
// The tile's image and its first output row and column.
struct kiln_tile {
  int n, oh, ow;
};
__device__ __forceinline__ kiln_tile kiln_tile_of(const kiln_depthwise& p, const kiln_tile_pos& t) {
  return {t.n, t.th * p.tile_h + p.base_h, t.tw * p.tile_w + p.base_w};
}

// Where a thread's walks over a tile's staged source and (backward-weight) cotangent start;
// the same for every tile.
struct kiln_walks {
  kiln_copy_start src, dy;
};
__device__ __forceinline__ kiln_walks kiln_walks_of(const kiln_depthwise& p) {
  const int tid = threadIdx.y * LANES + threadIdx.x;
  constexpr int SRC_UPP = PER / V, DY_UPP = LANES / V;
  return {kiln_copy_start_of(tid / SRC_UPP, THREADS / SRC_UPP, kiln_cols(p)),
          kiln_copy_start_of(tid / DY_UPP, THREADS / DY_UPP, p.tile_w)};
}

// Starts copying tile `tile`'s source (and for backward-weight its cotangent) into `s`.
__device__ __forceinline__ void kiln_issue(const T* __restrict__ src, const T* __restrict__ dy,
                                           const kiln_depthwise& p, T* s,
                                           const kiln_tile_pos& tile, int c0,
                                           const kiln_walks& walks) {
  const kiln_tile t = kiln_tile_of(p, tile);
  const int rows = kiln_rows(p), cols = kiln_cols(p);
  // The tile's first staged row and column (backward-data at stride 2: spread position
  // t.oh + off_h is a real row, a multiple of DH).
  const int h0 = (t.oh * STEP_H + p.off_h) / DH, w0 = (t.ow * STEP_W + p.off_w) / DW;
  kiln_copy_tile<PER>(src, s, t.n, h0, w0, rows, cols, p.src_h, p.src_w, p.src_c, c0, p.vec_src,
                      walks.src);
  if (PASS == 2)
    kiln_copy_tile<LANES>(dy, s + rows * cols * PER, t.n, t.oh, t.ow, p.tile_h, p.tile_w, p.out_h,
                          p.out_w, p.out_c, blockIdx.y * LANES, p.vec_dy, walks.dy);
  kiln_cp_async_commit();
}

// Elements of one tile buffer.
__device__ __forceinline__ int kiln_buffer(const kiln_depthwise& p) {
  return kiln_rows(p) * kiln_cols(p) * PER + (PASS == 2 ? p.tile_h * p.tile_w * LANES : 0);
}

// One staged source row R of an OTH x OTW block of outputs: the WIN staged values from `row` (a
// lane's channel; consecutive columns PER elements apart) meet output (i, j) at tap
// (R * DH - i * STEP_H, q - j * STEP_W) for the spread columns q = DW * (staged column).
// Forward and backward-data add weight x source to acc[i][j]; backward-weight adds cotangent x
// source to the tap's sum dw.
template <int R>
__device__ __forceinline__ void kiln_walk_row(const T* row, const float (&wt)[KH][KW],
                                              float (&acc)[OTH][OTW], const float (&g)[OTH][OTW],
                                              float (&dw)[KH][KW]) {
  float win[WIN];
#pragma unroll
  for (int q = 0; q < WIN; ++q) win[q] = kiln_to_float(row[q * PER]);
#pragma unroll
  for (int i = 0; i < OTH; ++i) {
    const int kh = R * DH - i * STEP_H;
    if (kh < 0 || kh >= KH) continue;
#pragma unroll
    for (int j = 0; j < OTW; ++j)
#pragma unroll
      for (int kw = 0; kw < KW; ++kw) {
        const int q = j * STEP_W + kw;
        if (q % DW != 0) continue;  // a spread zero
        if (PASS == 2)
          dw[kh][kw] += g[i][j] * win[q / DW];
        else
          acc[i][j] += wt[kh][kw] * win[q / DW];
      }
  }
}

// Every source row of the OTH x OTW outputs whose first source row and column is at `base`.
template <int R = 0>
__device__ __forceinline__ void kiln_walk(const T* base, int cols, const float (&wt)[KH][KW],
                                          float (&acc)[OTH][OTW], const float (&g)[OTH][OTW],
                                          float (&dw)[KH][KW]) {
  if constexpr (R < SRC_ROWS) {
    kiln_walk_row<R>(base + R * cols * PER, wt, acc, g, dw);
    kiln_walk<R + 1>(base, cols, wt, acc, g, dw);
  }
}

// Shared memory: [weights as f32 (forward, backward-data)] then two tile buffers of T.
// Block: (LANES, WARPS); grid: (blocks walking the tiles, or backward-weight's splits; chunks).
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) {{kernel}}(
    const T* __restrict__ src, const T* __restrict__ other, T* __restrict__ out,
    float* __restrict__ partial, kiln_depthwise p) {
  extern __shared__ float4 kiln_w4[];
  const int lane = threadIdx.x, warp = threadIdx.y, chunk = blockIdx.y;
  const int oc = chunk * LANES + lane;  // the lane's output channel of the gather
  constexpr int WEIGHTS = PASS == 2 ? 0 : PLANES * KSIZE * LANES;
  float* ws = reinterpret_cast<float*>(kiln_w4);
  T* bufs = reinterpret_cast<T*>(ws + WEIGHTS);
  const int buffer = kiln_buffer(p);
  const int cols = kiln_cols(p);
  const int subs_w = p.tile_w / OTW, subs = p.tile_h / OTH * subs_w;
  const T* dy = PASS == 2 ? other : nullptr;
  // The first source channel the block stages.
  const int c0 = PASS == 1 ? chunk * LANES * MG : chunk * LANES / MG;
  // Tiles: forward and backward-data walk every gridDim.x-th; backward-weight its split's.
  const int first = PASS == 2 ? blockIdx.x * p.tiles_per_split : blockIdx.x;
  const int end = PASS == 2 ? min(p.tiles, first + p.tiles_per_split) : p.tiles;
  const int step = PASS == 2 ? 1 : gridDim.x;
  const kiln_walks walks = kiln_walks_of(p);
  const kiln_tile_pos step_pos = kiln_tile_pos_of(p, step);
  kiln_tile_pos pos = kiln_tile_pos_of(p, first);
  if (first < end) kiln_issue(src, dy, p, bufs, pos, c0, walks);
  // A warp's sub-tiles s = warp, warp + WARPS, ... of a tile, as rows and columns of sub-tiles:
  // the first, and the step between two, stepped rather than divided for each.
  const int si0 = warp / subs_w, sj0 = warp - si0 * subs_w;
  const int step_si = WARPS / subs_w, step_sj = WARPS - step_si * subs_w;

  float wt[KH][KW];
  float dw[KH][KW];
#pragma unroll
  for (int kh = 0; kh < KH; ++kh)
#pragma unroll
    for (int kw = 0; kw < KW; ++kw) wt[kh][kw] = dw[kh][kw] = 0.0f;
  if (PASS != 2) {
    // The block's weights, taps in walking order: forward, output channels chunk * LANES on;
    // backward-data, the MG cotangent channels of each of its input channels. They are
    // contiguous in the weight.
    const T* weight = other;
    const int row0 = chunk * LANES * PLANES;
    const int rows = p.out_c * PLANES;  // weight rows (the layer's output channels)
    for (int e = warp * LANES + lane; e < PLANES * LANES * KSIZE; e += THREADS) {
      const int row = e / KSIZE, t = e - row * KSIZE;
      const int walked = p.reverse ? KSIZE - 1 - t : t;
      const int l = row / PLANES, m = row - l * PLANES;
      ws[(m * KSIZE + walked) * LANES + l] =
          row0 + row < rows ? kiln_to_float(weight[(long long)(row0 + row) * KSIZE + t]) : 0.0f;
    }
    __syncthreads();
  }
  auto load_weights = [&](int m) {
#pragma unroll
    for (int kh = 0; kh < KH; ++kh)
#pragma unroll
      for (int kw = 0; kw < KW; ++kw) wt[kh][kw] = ws[(m * KSIZE + kh * KW + kw) * LANES + lane];
  };
  if (PASS != 2 && PLANES == 1) load_weights(0);

  int k = 0;
  for (int tile = first; tile < end; tile += step, ++k) {
    // Start the next tile's copy into the other buffer, then wait for this one's.
    const int next = tile + step;
    const kiln_tile_pos next_pos = kiln_tile_after(p, pos, step_pos);
    T* buf = bufs + (k & 1) * buffer;
    if (next < end) {
      kiln_issue(src, dy, p, bufs + ((k + 1) & 1) * buffer, next_pos, c0, walks);
      kiln_cp_async_wait<1>();
    } else {
      kiln_cp_async_wait<0>();
    }
    __syncthreads();
    const kiln_tile t = kiln_tile_of(p, pos);
    pos = next_pos;
    if (oc < p.out_c) {
      int si = si0, sj = sj0;
      for (int s = warp; s < subs; s += WARPS, si += step_si, sj += step_sj) {
        if (sj >= subs_w) sj -= subs_w, ++si;  // step_sj < subs_w: one carry at most
        const int oh = t.oh + si * OTH, ow = t.ow + sj * OTW;
        if (oh >= p.out_h || ow >= p.out_w) continue;
        const T* base =
            buf + (si * OTH * STEP_H / DH * cols + sj * OTW * STEP_W / DW) * PER;
        float acc[OTH][OTW];
        float g[OTH][OTW];
#pragma unroll
        for (int i = 0; i < OTH; ++i)
#pragma unroll
          for (int j = 0; j < OTW; ++j) acc[i][j] = g[i][j] = 0.0f;
        if constexpr (PASS == 2) {
          // The cotangent of these outputs (zeros past the edges, as copied).
          const T* d = buf + kiln_rows(p) * cols * PER;
#pragma unroll
          for (int i = 0; i < OTH; ++i)
#pragma unroll
            for (int j = 0; j < OTW; ++j)
              g[i][j] = kiln_to_float(d[((si * OTH + i) * p.tile_w + sj * OTW + j) * LANES + lane]);
          kiln_walk(base + lane / MG, cols, wt, acc, g, dw);
        } else if constexpr (PLANES == 1) {
          kiln_walk(base + lane / MG, cols, wt, acc, g, dw);
        } else {
#pragma unroll 1
          for (int m = 0; m < PLANES; ++m) {
            load_weights(m);
            kiln_walk(base + lane * MG + m, cols, wt, acc, g, dw);
          }
        }
        if constexpr (PASS != 2 && STEPPED_STORES) {
          // The sub-tile's outputs that lie in the image (tiles of strided backward-data may
          // start before it): rows [i_lo, i_hi) and columns [j_lo, j_hi), stored from one base
          // offset stepped by rows and columns.
          const int i_lo = DH == 1 ? 0 : max(0, -oh), j_lo = DW == 1 ? 0 : max(0, -ow);
          const int i_hi = min(OTH, p.out_h - oh), j_hi = min(OTW, p.out_w - ow);
          const long long pitch = (long long)p.out_w * p.out_c;
          long long line = ((long long)t.n * p.out_h + oh) * pitch + (long long)ow * p.out_c + oc;
#pragma unroll
          for (int i = 0; i < OTH; ++i, line += pitch) {
            if (i < i_lo || i >= i_hi) continue;
#pragma unroll
            for (int j = 0; j < OTW; ++j)
              if (j >= j_lo && j < j_hi) out[line + j * p.out_c] = kiln_from_float<T>(acc[i][j]);
          }
        } else if constexpr (PASS != 2) {
          const long long row0 = (long long)t.n * p.out_h + oh;
#pragma unroll
          for (int i = 0; i < OTH; ++i)
#pragma unroll
            for (int j = 0; j < OTW; ++j)
              if (oh + i < p.out_h && ow + j < p.out_w)
                out[((row0 + i) * p.out_w + ow + j) * p.out_c + oc] = kiln_from_float<T>(acc[i][j]);
        }
      }
    }
    __syncthreads();  // this buffer is read; the next issue may overwrite it
  }
  if constexpr (PASS == 2) {
    // Sum the warps in order: each stores its sums (over the buffers), then a thread a (tap,
    // lane) adds them up and writes the block's partial, or the gradient itself.
    float* sums = reinterpret_cast<float*>(kiln_w4);
#pragma unroll
    for (int kh = 0; kh < KH; ++kh)
#pragma unroll
      for (int kw = 0; kw < KW; ++kw)
        sums[(warp * KSIZE + kh * KW + kw) * LANES + lane] = dw[kh][kw];
    __syncthreads();
    const long long weights = (long long)p.out_c * KSIZE;
    for (int e = warp * LANES + lane; e < KSIZE * LANES; e += THREADS) {
      const int tap = e / LANES, l = e - tap * LANES;
      const int c = chunk * LANES + l;
      if (c >= p.out_c) continue;
      float v = 0.0f;
      for (int w = 0; w < WARPS; ++w) v += sums[(w * KSIZE + tap) * LANES + l];
      const long long at = (long long)c * KSIZE + (p.reverse ? KSIZE - 1 - tap : tap);
      if (partial)
        partial[blockIdx.x * weights + at] = v;
      else
        out[at] = kiln_from_float<T>(v);
    }
  }
}
