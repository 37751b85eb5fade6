// Depthwise convolution by streamed rows: every pass at stride 1, and the forward at stride 2,
// with one output channel a group and kernels up to 7x7. Same problem as conv_depthwise.cu
// (struct kiln_depthwise), which takes every other case.
//
// Such a layer reads each source value KH x KW times and multiplies it once a read, so what
// bounds it is keeping enough bytes in flight and few instructions an output. A block takes a
// chunk of blockDim.x * V channels (V a thread: a vector of 4 for kernels up to 3x3, one
// channel for larger ones, whose KH x KW weights a channel then fit in registers) and a band of
// blockDim.y * TW output columns, and walks a segment of output rows down the image. Each
// source row is copied once into a ring of DEPTH shared buffers (cp.async in granules of CG
// channels, AHEAD rows ahead of the row being computed, so copies are in flight without
// holding registers); each
// thread reads its window of (TW - 1) * S + KW columns from the ring and adds it into the rows
// of accumulators of the output rows the source row meets (KH at stride 1, 2 of a 3x3 at
// stride 2). That ring of accumulators is indexed at compile time: the walk is unrolled by
// PERIOD source rows. An output row is stored when its last tap row has been added.
//
//   PASS 0 forward:         out = output, src = input.
//   PASS 1 backward-data:   out = input gradient, src = cotangent: the forward with the taps
//                           walked backwards (off = pad - (k - 1)).
//   PASS 2 backward-weight: src = input, other = cotangent (out_h, out_w: its extents), each
//                           cotangent row copied beside the source row of the same index; a
//                           source row meets the KH cotangent rows it pairs with, and each thread
//                           sums every tap over its columns and rows. The block adds its column
//                           groups in order and writes one f32 partial a block along x (the
//                           split sum adds them up), or the gradient itself where it is alone.
//
// The problem's tile fields describe the walk: tile_h output rows a segment, tile_w output
// columns a band, tiles_h segments and tiles_w bands an image; the grid is (batch * tiles_h *
// tiles_w, chunks), one block a segment of a band.
{{> prelude}}
{{> depthwise}}

typedef {{dtype}} T;
constexpr int PASS = {{PASS}};
constexpr int KH = {{KH}}, KW = {{KW}};
constexpr int TW = {{TW}};        // output columns a thread
constexpr int V = {{V}};          // channels a thread
constexpr int S = {{S}};          // the stride along both dims (2: forward only)
// Channels a copy moves: the thread's vector where it is one (8 or 16 bytes), else 16 bytes.
constexpr int CG = V == 4 ? 4 : 16 / (int)sizeof(T);
constexpr int AHEAD = 3;          // source rows in flight while one is computed
// Rows the ring holds: those in flight, the one computed and, for backward-weight, the KH - 1
// cotangent rows before it that the computed source row still meets.
constexpr int DEPTH = AHEAD + (PASS == 2 ? KH : 1);
constexpr int THREADS = {{block_dim}};  // the most a block has (blockDim.x * blockDim.y)
constexpr int WIN = (TW - 1) * S + KW;  // source columns a thread reads a row
constexpr int KSIZE = KH * KW;
constexpr int CBYTES = CG * (int)sizeof(T);
static_assert(V == 1 || V == 4, "a thread takes one channel or a vector of 4");
static_assert(CBYTES == 8 || CBYTES == 16, "a copy moves 8 or 16 bytes");
static_assert(PASS >= 0 && PASS <= 2, "forward, backward-data, backward-weight");
static_assert(S == 1 || (S == 2 && PASS == 0), "stride 2 is the forward's");

// Mirrors ops::conv::depthwise::Problem (repr(C)).
struct kiln_depthwise {
  int batch;
  int src_h, src_w, src_c;  // the source's extents and channels (src_c == out_c)
  int out_h, out_w, out_c;  // the gather's output
  int off_h, off_w;         // source position of output 0 at tap 0
  int tile_h, tile_w;       // output rows a segment, output columns a band
  int tiles_h, tiles_w;     // segments and bands an image
  int tiles;                // batch * tiles_h * tiles_w (the grid along x)
  int chunks;               // blocks of blockDim.x * V channels (the grid along y)
  int reverse;              // the weight's tap is KSIZE - 1 - t
  int vec_src;              // unused: the plan takes only whole, aligned copies
  int vec_dy;               // unused
  int tiles_per_split;      // unused
  int base_h, base_w;       // unused (0)
  int split_halo;           // unused (0)
};

// Backward-weight's walk of a block's segment (the kernel's copies of its first AHEAD rows
// issued): at step s, source row s meets cotangent rows s - kh (tap row kh) of the segment;
// sum[kh * KW + kw][v] adds source column j + kw times cotangent column j over the thread's TW
// columns. Then the block's column groups are added in order (through shared memory, once the
// ring is done) into one partial a block along x, or the gradient where there is one block.
template <typename Issue>
__device__ __forceinline__ void kiln_rows_backward_weight(const kiln_depthwise& p, T* ring,
                                                          const T* dy_ring, int cols, int chans,
                                                          int rows, int steps, Issue& issue,
                                                          T* __restrict__ out,
                                                          float* __restrict__ partial) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  float sum[KSIZE][V];
#pragma unroll
  for (int t = 0; t < KSIZE; ++t)
#pragma unroll
    for (int v = 0; v < V; ++v) sum[t][v] = 0.0f;
  // The cotangent rows source row s meets, widened once: row s - kh in slot (s - kh) % KH (the
  // walk is unrolled by KH, so every slot index is known at compile time); rows before the
  // segment are zeros.
  float g[KH][TW][V];
#pragma unroll
  for (int kh = 0; kh < KH; ++kh)
#pragma unroll
    for (int j = 0; j < TW; ++j)
#pragma unroll
      for (int v = 0; v < V; ++v) g[kh][j][v] = 0.0f;
  for (int s0 = 0; s0 < steps; s0 += KH) {
#pragma unroll
    for (int u = 0; u < KH; ++u) {
      const int s = s0 + u;
      if (s >= steps) break;
      kiln_cp_async_wait<AHEAD - 1>();
      __syncthreads();
      issue(s + AHEAD);
      {
        // Cotangent row s (zeros past the segment) into slot u.
        const bool live = s < rows;
        const T* dy = dy_ring + (s % DEPTH) * p.tile_w * chans + tx * V + ty * TW * chans;
#pragma unroll
        for (int j = 0; j < TW; ++j) {
          kiln_vec<T, V> raw{};
          if (live) raw = *reinterpret_cast<const kiln_vec<T, V>*>(dy + j * chans);
#pragma unroll
          for (int v = 0; v < V; ++v) g[u][j][v] = live ? kiln_to_float(raw.v[v]) : 0.0f;
        }
      }
      const T* row = ring + (s % DEPTH) * cols * chans + tx * V + ty * TW * chans;
#pragma unroll
      for (int q = 0; q < TW + KW - 1; ++q) {
        const kiln_vec<T, V> raw = *reinterpret_cast<const kiln_vec<T, V>*>(row + q * chans);
        float x[V];
#pragma unroll
        for (int v = 0; v < V; ++v) x[v] = kiln_to_float(raw.v[v]);
#pragma unroll
        for (int kh = 0; kh < KH; ++kh)
#pragma unroll
          for (int j = 0; j < TW; ++j) {
            const int kw = q - j;
            if (kw < 0 || kw >= KW) continue;
            const int slot = (u - kh + KH) % KH;
#pragma unroll
            for (int v = 0; v < V; ++v) sum[kh * KW + kw][v] += x[v] * g[slot][j][v];
          }
      }
    }
  }
  // The ring is done: it becomes the column groups' sums, added in order as the block's
  // partial.
  kiln_cp_async_wait<0>();
  __syncthreads();
  kiln_depthwise_block_sums(sum, reinterpret_cast<float*>(ring), chans, blockIdx.y * chans,
                            p.out_c, p.reverse, out, partial);
}

// Shared memory: DEPTH buffers of (tile_w + KW - 1) columns x (blockDim.x * V) channels of T;
// for backward-weight then DEPTH buffers of tile_w cotangent columns, the whole reused at the
// end for the column groups' sums (blockDim.y x KSIZE x channels f32).
// Block: (channel vectors, column groups); grid: (tiles, chunks).
extern "C" __global__ void __launch_bounds__(THREADS, 2) {{kernel}}(
    const T* __restrict__ src, const T* __restrict__ other, T* __restrict__ out,
    float* __restrict__ partial, kiln_depthwise p) {
  extern __shared__ float4 kiln_w4[];  // 16-byte aligned (the host harness's name for it too)
  T* ring = reinterpret_cast<T*>(kiln_w4);
  const int tx = threadIdx.x, ty = threadIdx.y, groups = blockDim.y;
  const int chans = blockDim.x * V;  // channels a staged column
  const int cols = (p.tile_w - 1) * S + KW;  // source columns a band reads
  const int band = blockIdx.x % p.tiles_w, rest = blockIdx.x / p.tiles_w;
  const int seg = rest % p.tiles_h, n = rest / p.tiles_h;
  const int c = blockIdx.y * chans + tx * V;  // the thread's first channel
  const bool has_c = c < p.out_c;             // the plan keeps out_c a multiple of V
  const int ow = band * p.tile_w + ty * TW;   // the thread's first output column
  const int iw0 = band * p.tile_w * S + p.off_w;  // the band's first source column
  const int oh0 = seg * p.tile_h;
  const int rows = min(p.tile_h, p.out_h - oh0);
  const int steps = (rows - 1) * S + KH;  // source rows the segment reads
  // The copies: granule `cg` (CG channels) of columns q_first, q_first + q_step, ... A thread
  // with a vector of 4 copies its own channels (cg = tx, q_first = ty, q_step = groups).
  const int tid = ty * blockDim.x + tx, granules = chans / CG;
  const int cg = tid % granules, q_first = tid / granules;
  const int q_step = blockDim.x * groups / granules;
  const int cc = blockIdx.y * chans + cg * CG;  // the granule's first channel
  const bool has_cc = cc < p.out_c;             // the plan keeps out_c a multiple of CG
  // A copy's addresses are stepped, not recomputed: the source offset of the thread's first
  // column (column q_first of the segment's first source row, at granule cc), what q_step
  // columns move it, and the same in the ring. With 64-bit address products a copy took about
  // 28 instructions, stepped 16: on a 7x7 image a block issued about as many for its copies
  // as for its products.
  const int iw_first = iw0 + q_first;
  const long long src_pitch = (long long)p.src_w * p.src_c;
  const long long src_first =
      ((long long)n * p.src_h + oh0 * S + p.off_h) * src_pitch + (long long)iw_first * p.src_c + cc;
  const int src_step = q_step * p.src_c, ring_step = q_step * chans;
  // Backward-weight: the cotangent's ring and the thread's first column of it.
  T* dy_ring = ring + DEPTH * cols * chans;
  const int dw_first = band * p.tile_w + q_first;
  const long long dy_pitch = (long long)p.out_w * p.out_c;
  const long long dy_first =
      ((long long)n * p.out_h + oh0) * dy_pitch + (long long)dw_first * p.out_c + cc;
  const int dy_step = q_step * p.out_c;

  // Copies source row `s` of the segment into its ring buffer (zeros outside the source).
  // Always commits a group, so that the waits below count rows.
  auto issue = [&](int s) {
    if (s < steps) {
      const int ih = oh0 * S + p.off_h + s;
      const bool row_ok = has_cc && (unsigned)ih < (unsigned)p.src_h;
      T* dst = ring + (s % DEPTH) * cols * chans + q_first * chans + cg * CG;
      long long at = src_first + s * src_pitch;
      int iw = iw_first;
      for (int q = q_first; q < cols; q += q_step) {
        const bool ok = row_ok && (unsigned)iw < (unsigned)p.src_w;
        kiln_cp_async<CBYTES, true>(dst, ok ? src + at : src, ok);
        iw += q_step;
        at += src_step;
        dst += ring_step;
      }
      if (PASS == 2) {
        // Cotangent row s of the segment, zeros past its last row and column.
        const bool dy_ok = has_cc && s < rows;
        T* dy_dst = dy_ring + (s % DEPTH) * p.tile_w * chans + q_first * chans + cg * CG;
        long long dy_at = dy_first + s * dy_pitch;
        int w = dw_first;
        for (int q = q_first; q < p.tile_w; q += q_step) {
          const bool ok = dy_ok && w < p.out_w;
          kiln_cp_async<CBYTES, true>(dy_dst, ok ? other + dy_at : other, ok);
          w += q_step;
          dy_at += dy_step;
          dy_dst += ring_step;
        }
      }
    }
    kiln_cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) issue(s);
  if constexpr (PASS == 2) {
    kiln_rows_backward_weight(p, ring, dy_ring, cols, chans, rows, steps, issue, out, partial);
    return;
  }

  // The thread's weights as f32, taps in walking order (reversed for a flipped walk).
  const T* weight = other;
  float wt[KSIZE][V];
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int t = 0; t < KSIZE; ++t) {
      const int tap = p.reverse ? KSIZE - 1 - t : t;
      wt[t][v] = has_c ? kiln_to_float(weight[(long long)(c + v) * KSIZE + tap]) : 0.0f;
    }

  // The thread's first output of the segment, and its columns that lie in the image.
  const long long out_pitch = (long long)p.out_w * p.out_c;
  T* dst = out + ((long long)n * p.out_h + oh0) * out_pitch + (long long)ow * p.out_c + c;
  const int live_cols = min(TW, p.out_w - ow);
  // Source row s meets output row o of the segment at tap row s - o * S, so NACC output rows
  // are open at once; acc[o % NACC] holds row o. The walk is unrolled by PERIOD source rows (a
  // multiple of S and of NACC rows), which makes each row's slot a compile-time index.
  constexpr int NACC = (KH + S - 1) / S;
  constexpr int PERIOD = S * NACC;
  float acc[NACC][TW][V];
  for (int s0 = 0; s0 < steps; s0 += PERIOD) {
#pragma unroll
    for (int u = 0; u < PERIOD; ++u) {
      const int s = s0 + u;
      if (s >= steps) break;
      // Row s has landed for every thread, and every thread is done with the buffer the next
      // copy overwrites (row s - 1's).
      kiln_cp_async_wait<AHEAD - 1>();
      __syncthreads();
      issue(s + AHEAD);
      const T* row = ring + (s % DEPTH) * cols * chans + tx * V + ty * TW * S * chans;
      // Output row s / S begins at tap row 0.
      if (u % S == 0) {
#pragma unroll
        for (int j = 0; j < TW; ++j)
#pragma unroll
          for (int v = 0; v < V; ++v) acc[u / S % NACC][j][v] = 0.0f;
      }
      // A row of the padding (zeros) adds nothing: small images have one in every few.
      if ((unsigned)(oh0 * S + p.off_h + s) < (unsigned)p.src_h) {
#pragma unroll
        for (int q = 0; q < WIN; ++q) {
          const kiln_vec<T, V> raw = *reinterpret_cast<const kiln_vec<T, V>*>(row + q * chans);
          float x[V];
#pragma unroll
          for (int v = 0; v < V; ++v) x[v] = kiln_to_float(raw.v[v]);
#pragma unroll
          for (int kh = 0; kh < KH; ++kh) {
            if ((u - kh + PERIOD) % S != 0) continue;  // no output row meets row s at tap row kh
            const int r = (u - kh + PERIOD) / S % NACC;
#pragma unroll
            for (int j = 0; j < TW; ++j) {
              const int kw = q - j * S;
              if (kw < 0 || kw >= KW) continue;
#pragma unroll
              for (int v = 0; v < V; ++v) acc[r][j][v] += wt[kh * KW + kw][v] * x[v];
            }
          }
        }
      }
      // Output row (s - (KH - 1)) / S has had its last tap row.
      constexpr int LAST = KH - 1;
      const int done = (s - LAST) / S;
      if ((u - LAST + PERIOD) % S == 0 && has_c && s >= LAST && done < rows) {
        const int r = (u - LAST + PERIOD) / S % NACC;
        T* line = dst + done * out_pitch;
#pragma unroll
        for (int j = 0; j < TW; ++j)
          if (j < live_cols) kiln_store_vec<V>(line, j * p.out_c, acc[r][j]);
      }
    }
  }
  kiln_cp_async_wait<0>();
}
