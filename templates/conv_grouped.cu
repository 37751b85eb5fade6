// Grouped convolution with few channels a group (CG input and MUL x CG output channels: CG = 1
// to 32, MUL = 1, 2 or 4, at most 32 output channels a group), 1-D or 2-D, channels last, 16-bit
// types on tensor cores (mma.sync m16n8k16, sm_80+): input (batch, h, w, C), weight (MUL x C,
// kh, kw, CG), output (batch, oh, ow, MUL x C). Such layers move many bytes for little
// arithmetic, so a block works on 64 channels of the gather's output and walks tiles of outputs:
// it copies the next tile's source pixels (the SPER channels its 64 read) into shared memory with
// cp.async while it computes this one, and every product reads staged values with ldmatrix.
//
// Every product is an MMA over 16-channel chunks: a group's weights between 16 output channels
// and the 16-channel chunks of source channels they read (one, two or four) form block-diagonal
// 16 x 16 matrices. The zeros cost MMAs, which are cheap next to the bytes, and one code path
// serves every group width; an 8-column half of B that is all zeros is skipped (kiln_live).
//
// A tile is TILE_H x TILE_W outputs (TILE_W a multiple of 8): segments of 8 outputs along a row,
// and M tiles of two segments (16 outputs). A staged pixel (a slot) holds the block's source
// channels, padded by 8 elements so that ldmatrix's eight rows (eight consecutive slots) fall in
// distinct banks and a tap moves every row's address by one constant. Source columns are staged
// by stride phase (column c at (c % SW) * phase_cols + c / SW): the 8 outputs of a segment read
// 8 consecutive slots at every tap, at any stride.
//
// The passes:
//   PASS 0 forward:         out = output, src = input. A warp takes a 16-channel chunk of the
//                           block and every other M tile: A = 16 outputs x 16 source channels
//                           (ldmatrix from the tile), B = the chunk's weights (ldmatrix from
//                           the block's staged weights), a tap and k chunk at a time.
//   PASS 1 backward-data:   out = input gradient, src = cotangent: the forward at stride 1
//                           with the taps walked backwards and each group's weight transposed.
//                           A strided layer runs one launch a stride phase (the input pixels
//                           whose rows and columns have one remainder by the strides): a phase
//                           reads every stride-th tap, and its outputs lie a stride apart.
//   PASS 2 backward-weight: src = input, the cotangent staged beside it. M = the chunk's 16
//                           output channels, N = 8 source channels, K = 16 outputs (A: the
//                           cotangent, B: the source at a tap, both ldmatrix .trans); a warp
//                           holds every tap's sums for its chunk and half of its source
//                           channels over its block's tiles (a split of the batch's) and writes
//                           them, as f32 partials that reduce_cols.cu adds up when the sum is
//                           split, so the result is deterministic.
{{> prelude}}
{{> mma}}

typedef {{dtype}} T;
constexpr int PASS = {{PASS}};
constexpr int CG = {{CG}};    // the layer's input channels a group
constexpr int MUL = {{MUL}};  // its output channels a group, per input channel
constexpr int KH = {{KH}}, KW = {{KW}};
constexpr int SH = {{SH}}, SW = {{SW}};
constexpr int THREADS = {{block_dim}};
constexpr int WARPS = THREADS / 32;
constexpr int CHUNKS = 4;             // 16-channel chunks a block
constexpr int PER = 16 * CHUNKS;      // the block's channels (backward-weight: the cotangent's)
// Channels a group of the gather's output (backward-weight: of the cotangent) and of the
// source it reads.
constexpr int OPG = PASS == 1 ? CG : CG * MUL;
constexpr int SPG = PASS == 1 ? CG * MUL : CG;
// Source channels a staged pixel holds (those the block's PER read), and the slot pitches of
// the source and (backward-weight) the cotangent: 16 bytes past a bank cycle of 128.
constexpr int SPER = PER / OPG * SPG;
constexpr int SPITCH = SPER + 8;
constexpr int DPITCH = PER + 8;
// Source channels an output chunk reads, and the 16-channel k chunks that hold them.
constexpr int READS = OPG <= 16 ? 16 / OPG * SPG : SPG;
constexpr int SPAN = READS < 16 ? 16 : READS;
constexpr int KC = SPAN / 16;
// Backward-weight where a chunk reads 8 source channels or fewer (a multiplier of 2 or 4): both
// warps of the chunk take those 8 and every other M tile, instead of one warp summing zeros.
constexpr bool SPLIT_M = PASS == 2 && READS < 16;
// Whether n tile nt (8 of a chunk's 16 gather-output channels) and its k chunk kc share a
// group, so that their 16 x 8 block of B is not all zeros. Where a chunk has several k chunks
// and whole groups (KC > 1, OPG <= 16), kiln_chunk_source is its first group's first channel,
// so both count groups from it: output channel n is in group n / OPG, source channel k in
// k / SPG. Backward-data of a multiplier skips half its MMAs so.
__device__ constexpr bool kiln_live(int nt, int kc) {
  return KC == 1 || OPG > 16 ||
         ((8 * nt + 7) / OPG >= 16 * kc / SPG && 8 * nt / OPG <= (16 * kc + 15) / SPG);
}
constexpr int KSIZE = KH * KW;
constexpr int MB = 4;  // M tiles a forward warp sums at once, at most
constexpr int MIN_BLOCKS = {{MIN_BLOCKS}};  // the launch bound (grouped::Shape::min_blocks)
static_assert(sizeof(T) == 2, "16-bit types only");
static_assert(KILN_ARCH >= 800, "mma.sync m16n8k16 for both 16-bit types needs sm_80");
static_assert(WARPS == 2 * CHUNKS, "two warps a chunk");
static_assert(THREADS % (SPER / 8) == 0 && THREADS % (PER / 8) == 0,
              "a thread copies one unit of its pixels");
static_assert(16 % CG == 0 || CG == 32, "group widths 1, 2, 4, 8, 16 and 32");
static_assert(MUL == 1 || ((MUL == 2 || MUL == 4) && CG >= 2 && CG * MUL <= 32),
              "multipliers 2 and 4, for 2 or more in and up to 32 out a group");
static_assert(PER % OPG == 0 && SPER % 16 == 0, "whole groups a block, whole k chunks staged");
static_assert(PASS != 1 || (SH == 1 && SW == 1), "backward-data gathers at stride 1");

// Mirrors ops::conv::grouped::Problem (repr(C)).
struct kiln_grouped {
  int batch;
  int src_h, src_w;      // the source's extents
  int out_h, out_w;      // the gather's output (backward-weight: the cotangent)
  int chans;             // channels of the gather's output (backward-weight: the cotangent's)
  int src_chans;         // channels of the source
  int dst_h, dst_w;      // the output array's extents (a stride phase writes part of it)
  int out_h0, out_w0;    // the output pixel of gather output (0, 0)
  int out_step_h, out_step_w;  // output pixels between consecutive gather outputs
  int w_kh, w_kw;        // the layer's kernel extents
  int tap_h0, tap_w0;    // forward, backward-data: the kernel row and column of staged tap 0
  int tap_step_h, tap_step_w;  // and between staged taps (< 0 walks the kernel backwards)
  int off_h, off_w;      // source position of output 0 at tap 0
  int tile_h, tile_w;    // outputs a tile (tile_w a multiple of 8, tile_h * tile_w of 16)
  int tiles_h, tiles_w;  // tiles an image
  int tiles;             // batch * tiles_h * tiles_w
  int reverse;           // backward-weight: the weight's tap is KSIZE - 1 - t
  int vec;               // both staged arrays may be copied in 16-byte pieces
  int tiles_per_split;   // backward-weight: tiles a block sums
};

// The staged source of a tile: rows, columns, columns a stride phase, slots a row; and the
// rounded-up reciprocal (in 16 fractional bits) of the tile's segments a row (tile_w / 8, 1 to
// 4), with which s / (tile_w / 8) is exact for s below 2^13 (kiln_segment_row).
struct kiln_staged {
  int rows, cols, phase_cols, row_slots;
  unsigned seg_magic;
};
__device__ __forceinline__ kiln_staged kiln_staged_of(const kiln_grouped& p) {
  const int rows = (p.tile_h - 1) * SH + KH, cols = (p.tile_w - 1) * SW + KW;
  const int phase_cols = (cols + SW - 1) / SW;
  const unsigned per_row = p.tile_w / 8;
  return {rows, cols, phase_cols, SW * phase_cols, (65536u + per_row - 1) / per_row};
}

// The tile row of segment s (8 outputs along a row): a multiply, not a division, as the
// epilogue and every call's setup need it for every 8 outputs.
__device__ __forceinline__ int kiln_segment_row(const kiln_staged& st, int s) {
  return (int)(((unsigned)s * st.seg_magic) >> 16);
}

// Element offset of 16-byte unit `unit` of staged slot `slot`, slots PITCH_ elements apart.
template <int PITCH_>
__device__ __forceinline__ int kiln_at(int slot, int unit) {
  return slot * PITCH_ + unit * 8;
}

// Channel arithmetic is unsigned: OPG and SPG are powers of two, so that its divisions are
// shifts.
// The first of the block's source channels, those its gather-output channels c0 on read.
__device__ __forceinline__ int kiln_source_base(int c0) { return (unsigned)c0 / OPG * SPG; }

// The first source channel (of the block's staged ones) of chunk j's first group, and of the k
// chunks the chunk reads (rounded down to a whole chunk).
__device__ __forceinline__ int kiln_group_source(int j) { return (unsigned)(16 * j) / OPG * SPG; }
__device__ __forceinline__ int kiln_chunk_source(int j) { return kiln_group_source(j) & ~15u; }

// Whether the block's gather-output channel `o` and staged source channel `s` (both counted
// from the block's first) lie in one group.
__device__ __forceinline__ bool kiln_same_group(int o, int s) {
  return (unsigned)o / OPG == (unsigned)s / SPG;
}

// Copies `rows` x `cols` pixels (channels c0 to c0 + CH - 1) of an (n, ext_h, ext_w, chans) array,
// from pixel (h0, w0) on, into the staged slots of `s` (pixel (r, c) to slot r * S * phase_cols
// + (c % S) * phase_cols + c / S), slots CH + 8 elements apart; zeros outside the array. With
// `vec`, in 16-byte pieces that land asynchronously (kiln_cp_async_commit/wait); else one element
// at a time, at once. `start`: kiln_copy_start_of(tid / (CH / 8), THREADS / (CH / 8), cols), see
// kiln_walks_of.
template <int S, int CH>
__device__ __forceinline__ void kiln_stage(const T* __restrict__ src, T* s, int n, int h0, int w0,
                                           int rows, int cols, int phase_cols, int ext_h,
                                           int ext_w, int chans, int c0, bool vec,
                                           const kiln_copy_start& start) {
  constexpr int UNITS = CH / 8, PITCH_ = CH + 8;
  const int tid = threadIdx.y * 32 + threadIdx.x;
  const long long image = (long long)n * ext_h;
  const int pixels = rows * cols;
  // q >= 0: unsigned, so that % and / by S are a mask and a shift.
  auto slot_of = [&](int r, int q) {
    const unsigned uq = q;
    return (r * S + (int)(uq % S)) * phase_cols + (int)(uq / S);
  };
  if (vec) {
    // A thread copies unit e of every STEP-th pixel.
    constexpr int STEP = THREADS / UNITS;
    const int e = tid % UNITS, c = c0 + e * 8;
    const bool in_chans = c < chans;  // units past the channels are zero-filled
    const kiln_walk_start& w = start.walk;
    if (w.step_q == 0) {  // whole rows a pass: the thread's column, down the rows
      kiln_copy_column(src, s + kiln_at<PITCH_>(slot_of(w.r, w.q), e),
                       w.step_r * S * phase_cols * PITCH_,
                       start, image, h0, w0, rows, ext_h, ext_w, chans, c, in_chans);
      return;
    }
    // The walk over the tile's pixels, in 32-bit offsets from channel c of image n (an image
    // and its padding hold fewer than 2^31 elements: grouped::unsupported): the 64-bit
    // address arithmetic, the four bound tests and the pointer select of kiln_tile_walk cost
    // about 25 instructions a copy, and these copies are half of a strided tile's instructions.
    const T* base = in_chans ? src + (image * ext_w * chans + c) : src;
    int r = w.r, q = w.q;
    int at = ((h0 + r) * ext_w + w0 + q) * chans;
    const int step_at = (w.step_r * ext_w + w.step_q) * chans;
    const int wrap_at = (ext_w - cols) * chans;
    for (int pixel = tid / UNITS; pixel < pixels; pixel += STEP) {
      const bool ok = in_chans && (unsigned)(h0 + r) < (unsigned)ext_h &&
                      (unsigned)(w0 + q) < (unsigned)ext_w;
      // at >= 0 where ok: unsigned, so that it widens without a sign.
      // At stride 1 a pixel's slot is its index in the tile.
      kiln_cp_async<16, false>(s + kiln_at<PITCH_>(S == 1 ? pixel : slot_of(r, q), e),
                               base + (ok ? (unsigned)at : 0u), ok);
      r += w.step_r;
      q += w.step_q;
      at += step_at;
      if (q >= cols) {  // step_q < cols: one wrap at most
        q -= cols;
        ++r;
        at += wrap_at;
      }
    }
  } else {
    for (int u = tid; u < pixels * CH; u += THREADS) {
      const int pixel = u / CH, e = u - pixel * CH;
      const int r = pixel / cols, q = pixel - r * cols;
      const int h = h0 + r, w = w0 + q, c = c0 + e;
      const bool ok = h >= 0 && h < ext_h && w >= 0 && w < ext_w && c < chans;
      s[slot_of(r, q) * PITCH_ + e] = ok ? src[((image + h) * ext_w + w) * chans + c] : T{};
    }
  }
}

// The tile's image and its first output row and column.
struct kiln_tile {
  int n, oh, ow;
};
__device__ __forceinline__ kiln_tile kiln_tile_at(const kiln_grouped& p, int tile) {
  const int tw = tile % p.tiles_w, rest = tile / p.tiles_w;
  const int th = rest % p.tiles_h;
  return {rest / p.tiles_h, th * p.tile_h, tw * p.tile_w};
}

// Slots of a buffer: the source's, then (backward-weight) the cotangent's, a slot an output.
__device__ __forceinline__ int kiln_buffer(const kiln_grouped& p) {
  const kiln_staged st = kiln_staged_of(p);
  return st.rows * st.row_slots * SPITCH + (PASS == 2 ? p.tile_h * p.tile_w * DPITCH : 0);
}

// Where a thread's walks over a tile's staged source and (backward-weight) cotangent start;
// the same for every tile.
struct kiln_walks {
  kiln_copy_start src, dy;
};
// Row passes (kiln_copy_start) only where they keep 3 in 4 of a pass's threads busy: this kernel
// is not bound by its instructions as the depthwise stencil is, and where 14 of a pass's 32
// pixels idled (18 staged columns) the busy threads' longer chains of copies cost 4-6%.
__device__ __forceinline__ kiln_copy_start kiln_stage_start_of(int first, int step, int cols) {
  if (step >= cols && step / cols * cols * 4 < step * 3)
    return {kiln_walk_start_of(first, step, cols), true};
  return kiln_copy_start_of(first, step, cols);
}
__device__ __forceinline__ kiln_walks kiln_walks_of(const kiln_grouped& p) {
  const int tid = threadIdx.y * 32 + threadIdx.x;
  constexpr int SUNITS = SPER / 8, DUNITS = PER / 8;
  return {kiln_stage_start_of(tid / SUNITS, THREADS / SUNITS, kiln_staged_of(p).cols),
          kiln_stage_start_of(tid / DUNITS, THREADS / DUNITS, p.tile_w)};
}

// Starts copying tile `tile`'s source (and for backward-weight its cotangent) into `s`.
__device__ __forceinline__ void kiln_issue(const T* __restrict__ src, const T* __restrict__ dy,
                                           const kiln_grouped& p, T* s, int tile, int c0,
                                           const kiln_walks& walks) {
  const kiln_tile t = kiln_tile_at(p, tile);
  const kiln_staged st = kiln_staged_of(p);
  kiln_stage<SW, SPER>(src, s, t.n, t.oh * SH + p.off_h, t.ow * SW + p.off_w, st.rows, st.cols,
                       st.phase_cols, p.src_h, p.src_w, p.src_chans, kiln_source_base(c0), p.vec,
                       walks.src);
  if (PASS == 2)
    kiln_stage<1, PER>(dy, s + st.rows * st.row_slots * SPITCH, t.n, t.oh, t.ow, p.tile_h,
                       p.tile_w, p.tile_w, p.out_h, p.out_w, p.chans, c0, p.vec, walks.dy);
  kiln_cp_async_commit();
}

// The slot offset of tap (kh, kw) from an output's tap-0 slot.
__device__ __forceinline__ int kiln_tap_slots(const kiln_staged& st, int kh, int kw) {
  return kh * st.row_slots + (kw % SW) * st.phase_cols + kw / SW;
}

// The tap-0 slot of output `i` (0-7) of segment `s` of a tile, its row and column in the tile.
__device__ __forceinline__ int kiln_segment_slot(const kiln_grouped& p, const kiln_staged& st,
                                                 int s, int i) {
  const int per_row = p.tile_w / 8;
  const int row = kiln_segment_row(st, s), col = (s - row * per_row) * 8 + i;
  return row * SH * st.row_slots + col;
}

// Forward and backward-data: M tiles m0, m0 + 2, ... (NQ of them) of chunk j of the staged
// tile `buf`, with the chunk's staged weights `wj`; stores the outputs. NQ is compile-time so
// that the taps' loads and MMAs are straight-line code.
template <int NQ>
__device__ __forceinline__ void kiln_products(const kiln_grouped& p, const kiln_staged& st,
                                              const T* buf, const T* wj, int m0, int j,
                                              const kiln_tile& t, int c0,
                                              T* __restrict__ out) {
  const int lane = threadIdx.x, mi = lane >> 3, r = lane & 7;
  // The first unit of the chunk's source channels in a staged pixel.
  const int span_unit = kiln_chunk_source(j) / 8;
  float acc[NQ][2][4];
  const T* row[NQ];  // this lane's ldmatrix row at tap 0 and k chunk 0, per M tile
#pragma unroll
  for (int q = 0; q < NQ; ++q) {
    const int slot = kiln_segment_slot(p, st, 2 * (m0 + 2 * q) + (mi & 1), r);
    row[q] = buf + kiln_at<SPITCH>(slot, span_unit + (mi >> 1));
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[q][nt][e] = 0.0f;
  }
  // This lane's row of B: output channel n of the chunk, k half mi & 1 (swizzled by n / 4).
  const int n = (mi >> 1) * 8 + r;
  const int b_row = n * 16 + (((mi & 1) ^ ((n >> 2) & 1)) << 3);
#pragma unroll
  for (int kh = 0; kh < KH; ++kh)
#pragma unroll
    for (int kw = 0; kw < KW; ++kw) {
      const int toff = kiln_tap_slots(st, kh, kw);
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        unsigned b[4];
        kiln_ldmatrix_x4<false>(b, wj + ((kh * KW + kw) * KC + kc) * 256 + b_row);
        const int shift = toff * SPITCH + kc * 16;
#pragma unroll
        for (int q = 0; q < NQ; ++q) {
          unsigned a[4];
          kiln_ldmatrix_x4<false>(a, row[q] + shift);
          if (kiln_live(0, kc)) kiln_mma<T>::run(acc[q][0], a, b[0], b[1]);
          if (kiln_live(1, kc)) kiln_mma<T>::run(acc[q][1], a, b[2], b[3]);
        }
      }
    }
  // Accumulator e of n tile nt: output g (+8 for e >= 2: the second segment), channels
  // 16 j + 8 nt + 2 (lane % 4) and the next.
  const int g = lane >> 2, pair = 2 * (lane & 3);
  const int per_row = p.tile_w / 8;
#pragma unroll
  for (int q = 0; q < NQ; ++q) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int s = 2 * (m0 + 2 * q) + h;
      const int row = kiln_segment_row(st, s), col = (s - row * per_row) * 8 + g;
      const int oh = t.oh + row, ow = t.ow + col;
      if (oh >= p.out_h || ow >= p.out_w) continue;
      const int dh = p.out_h0 + oh * p.out_step_h, dw = p.out_w0 + ow * p.out_step_w;
      T* dst = out + (((long long)t.n * p.dst_h + dh) * p.dst_w + dw) * p.chans;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int c = c0 + 16 * j + 8 * nt + pair;  // even, as chans is
        if (c >= p.chans) continue;
        // One 32-bit store for the pair (c even, the output a fresh array).
        const unsigned lo = kiln_from_float<T>(acc[q][nt][2 * h]).bits;
        const unsigned hi = kiln_from_float<T>(acc[q][nt][2 * h + 1]).bits;
        *reinterpret_cast<unsigned*>(dst + c) = lo | hi << 16;
      }
    }
  }
}

// The first 16-byte unit of the source channels backward-weight's warp `half` of chunk j sums:
// the chunk's (SPLIT_M), else that half of its k chunks'.
__device__ __forceinline__ int kiln_weight_unit0(int j, int half) {
  return SPLIT_M ? kiln_group_source(j) / 8 : kiln_chunk_source(j) / 8 + half * KC;
}

// Backward-weight: adds M tile m of the staged tile `buf` (source slots, then the cotangent's)
// to the sums of chunk j and source-channel half `half` (SPLIT_M: of its 8 source channels):
// sums[tap][k tile].
__device__ __forceinline__ void kiln_weight_sums(const kiln_grouped& p, const kiln_staged& st,
                                                 const T* buf, int m, int j, int half,
                                                 float (&sums)[KSIZE][KC][4]) {
  const int lane = threadIdx.x, mi = lane >> 3, r = lane & 7;
  // A: the cotangent of the M tile's 16 outputs (k) at the chunk's 16 channels (m), read
  // transposed: matrix mi holds outputs of segment 2 m + mi / 2, channels 8 (mi % 2) on.
  const T* dy = buf + st.rows * st.row_slots * SPITCH;
  const int per_row = p.tile_w / 8;
  const int s = 2 * m + (mi >> 1);
  const int srow = kiln_segment_row(st, s), dslot = srow * p.tile_w + (s - srow * per_row) * 8 + r;
  unsigned a[4];
  kiln_ldmatrix_x4<true>(a, dy + kiln_at<DPITCH>(dslot, 2 * j + (mi & 1)));
  // B: the source at a tap, 16 outputs (k) x 8 channels (n), read transposed: matrix mi & 1
  // holds segment 2 m + (mi & 1) (lanes 16-31 repeat 0-15; ldmatrix .x2 reads lanes 0-15).
  const int unit0 = kiln_weight_unit0(j, half);
  const T* row = buf + kiln_at<SPITCH>(kiln_segment_slot(p, st, 2 * m + (mi & 1), r), unit0);
  // Every tap's B first, then the MMAs: loaded and used one at a time, each MMA waited for its
  // load and the next load for the MMA to free the register (the launch bound leaves few).
  unsigned b[KSIZE][KC][2];
#pragma unroll
  for (int kh = 0; kh < KH; ++kh)
#pragma unroll
    for (int kw = 0; kw < KW; ++kw) {
      const T* at = row + kiln_tap_slots(st, kh, kw) * SPITCH;
#pragma unroll
      for (int nt = 0; nt < KC; ++nt) kiln_ldmatrix_x2<true>(b[kh * KW + kw][nt], at + nt * 8);
    }
#pragma unroll
  for (int t = 0; t < KSIZE; ++t)
#pragma unroll
    for (int nt = 0; nt < KC; ++nt) kiln_mma<T>::run(sums[t][nt], a, b[t][nt][0], b[t][nt][1]);
}

// The 8 weights of unit u (see kiln_stage_weights), packed in pairs; VEC: one 16-byte load.
template <bool VEC>
__device__ __forceinline__ uint4 kiln_load_weight_unit(const T* __restrict__ weight,
                                                       const kiln_grouped& p, int c0, int u) {
  const int half = u & 1, line = (u >> 1) & 15, block = u >> 5;
  const int kc = block % KC, jt = block / KC;
  const int tap = jt % KSIZE, jj = jt / KSIZE;
  const int wr = p.tap_h0 + tap / KW * p.tap_step_h;
  const int wc = p.tap_w0 + tap % KW * p.tap_step_w;
  // B's (n, k) of the unit's first weight: the block's gather-output channel on0 and staged
  // source channel sk0.
  const int n0 = PASS == 1 ? 8 * half : line, k0 = PASS == 1 ? line : 8 * half;
  const int on0 = 16 * jj + n0, sk0 = kiln_chunk_source(jj) + 16 * kc + k0;
  const int oc0 = c0 + on0, sc0 = kiln_source_base(c0) + sk0;
  // weight[wo][wr][wc][wi % CG] (wo the layer's output channel, wi its input channel), wi
  // moving by one along the unit (with n on backward-data, with k on forward).
  const int wo = PASS == 1 ? sc0 : oc0, wi0 = PASS == 1 ? oc0 : sc0;
  const int wo_chans = PASS == 1 ? p.src_chans : p.chans;
  const int wi_chans = PASS == 1 ? p.chans : p.src_chans;
  const bool tap_ok = wo < wo_chans && wr >= 0 && wr < p.w_kh && wc >= 0 && wc < p.w_kw;
  const T* at = weight + (tap_ok ? (((long long)wo * p.w_kh + wr) * p.w_kw + wc) * CG : 0);
  if constexpr (VEC) {
    const bool ok = tap_ok && wi0 < wi_chans && kiln_same_group(on0, sk0);
    return ok ? *reinterpret_cast<const uint4*>(at + wi0 % CG) : make_uint4(0u, 0u, 0u, 0u);
  } else {
    unsigned short v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int wi = wi0 + e;
      const bool ok = tap_ok && wi < wi_chans &&
                      kiln_same_group(on0 + (PASS == 1 ? e : 0), sk0 + (PASS == 1 ? 0 : e));
      v[e] = ok ? at[wi % CG].bits : (unsigned short)0;
    }
    unsigned words[4];
#pragma unroll
    for (int h = 0; h < 4; ++h) words[h] = v[2 * h] | (unsigned)v[2 * h + 1] << 16;
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// Stores unit u's weights `x` (kiln_load_weight_unit) as B fragments.
__device__ __forceinline__ void kiln_store_weight_unit(T* ws, int u, uint4 x) {
  const int half = u & 1, line = (u >> 1) & 15, block = u >> 5;
  const unsigned words[4] = {x.x, x.y, x.z, x.w};
  T* b = ws + block * 256;
  if constexpr (PASS == 1) {
    const int n0 = 8 * half;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int n = n0 + e;
      b[n * 16 + (((line >> 3) ^ ((n >> 2) & 1)) << 3) + (line & 7)].bits =
          (unsigned short)(words[e / 2] >> (16 * (e & 1)));
    }
  } else {
    *reinterpret_cast<uint4*>(b + line * 16 + ((half ^ ((line >> 2) & 1)) << 3)) = x;
  }
}

// Stages a block's weights as B fragments: chunk j, tap, k chunk kc at [((j * KSIZE + tap) * KC
// + kc) * 256 + n * 16 + k] (the two 8-element halves of row n swapped when n / 4 is odd), the
// weight between gather output channel c0 + 16 j + n and source channel kiln_source_base(c0) +
// kiln_chunk_source(j) + 16 kc + k; zero across groups and at staged taps outside the kernel (a
// stride phase's missing taps).
// Forward: weight[output][tap][source % CG]; backward-data (the gather's output is the layer's
// input): weight[source][tap][output % CG].
//
// A thread takes units of 8 weights that are consecutive in the weight array (its last axis):
// forward 8 k of B's row n, backward-data 8 n of B's column k. With 16-byte vectors (`vec`: the
// weight is aligned; CG >= 8 keeps a unit in one group) a unit is one load, else eight; every
// unit's index work is done once, not once a weight. A thread loads a batch of its units, then
// stores them, so that their loads are in flight at once (a store after each load waited for
// it: the block's first tile waits for these); in batches of at most 10 units (40 registers,
// one batch but for a multiplier of 4's backward-data, whose 18 a thread spilled at once; two
// batches of the 32-channel groups' 9 to 10 ran 3-4% slower on 7x7 maps). The
// fallback for unaligned weights is kept rolled, as it costs compile time in every spec and runs
// only for unaligned weights.
template <int WEIGHTS>
__device__ __forceinline__ void kiln_stage_weights(const T* __restrict__ weight,
                                                   const kiln_grouped& p, T* ws, int c0,
                                                   int tid) {
  constexpr int WUNITS = WEIGHTS / 8, PER_THREAD = (WUNITS + THREADS - 1) / THREADS;
  constexpr int BATCHES = (PER_THREAD + 9) / 10, BATCH = (PER_THREAD + BATCHES - 1) / BATCHES;
  if (CG >= 8 && !p.vec) {
#pragma unroll 1
    for (int u = tid; u < WUNITS; u += THREADS)
      kiln_store_weight_unit(ws, u, kiln_load_weight_unit<false>(weight, p, c0, u));
    return;
  }
#pragma unroll 1
  for (int b0 = 0; b0 < PER_THREAD; b0 += BATCH) {
    uint4 units[BATCH];
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      const int u = tid + (b0 + i) * THREADS;
      if (WUNITS % (BATCH * THREADS) == 0 || u < WUNITS)
        units[i] = kiln_load_weight_unit<(CG >= 8)>(weight, p, c0, u);
    }
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      const int u = tid + (b0 + i) * THREADS;
      if (WUNITS % (BATCH * THREADS) == 0 || u < WUNITS) kiln_store_weight_unit(ws, u, units[i]);
    }
  }
}

// Shared memory: [weights (forward, backward-data): CHUNKS x KSIZE x KC blocks of 16 x 16, B
// fragments' order] then two tile buffers. Block: (32, WARPS); grid: (blocks walking the tiles,
// or backward-weight's splits; blocks of 64 channels).
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) {{kernel}}(
    const T* __restrict__ src, const T* __restrict__ other, T* __restrict__ out,
    float* __restrict__ partial, kiln_grouped p) {
  extern __shared__ float4 kiln_w4[];
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int tid = warp * 32 + lane;
  const int c0 = blockIdx.y * PER;
  const int j = warp % CHUNKS, half = warp / CHUNKS;
  const bool active = c0 + 16 * j < p.chans;
  constexpr int WEIGHTS = PASS == 2 ? 0 : CHUNKS * KSIZE * KC * 256;
  T* ws = reinterpret_cast<T*>(kiln_w4);
  T* bufs = ws + WEIGHTS;
  const int buffer = kiln_buffer(p);
  const kiln_staged st = kiln_staged_of(p);
  const int mtiles = p.tile_h * p.tile_w / 16;
  const T* dy = PASS == 2 ? other : nullptr;
  // Tiles: forward and backward-data walk every gridDim.x-th; backward-weight its split's.
  const int first = PASS == 2 ? blockIdx.x * p.tiles_per_split : blockIdx.x;
  const int end = PASS == 2 ? min(p.tiles, first + p.tiles_per_split) : p.tiles;
  const int step = PASS == 2 ? 1 : gridDim.x;
  const kiln_walks walks = kiln_walks_of(p);
  if (first < end) kiln_issue(src, dy, p, bufs, first, c0, walks);

  if constexpr (PASS != 2) {
    kiln_stage_weights<WEIGHTS>(other, p, ws, c0, tid);
    __syncthreads();
  }

  float sums[KSIZE][KC][4];
#pragma unroll
  for (int t = 0; t < KSIZE; ++t)
#pragma unroll
    for (int nt = 0; nt < KC; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sums[t][nt][e] = 0.0f;

  int k = 0;
  for (int tile = first; tile < end; tile += step, ++k) {
    // Start the next tile's copy into the other buffer, then wait for this one's.
    const int next = tile + step;
    const T* buf = bufs + (k & 1) * buffer;
    if (next < end) {
      kiln_issue(src, dy, p, bufs + ((k + 1) & 1) * buffer, next, c0, walks);
      kiln_cp_async_wait<1>();
    } else {
      kiln_cp_async_wait<0>();
    }
    __syncthreads();
    if (active) {
      if constexpr (PASS == 2) {
        for (int m = SPLIT_M ? half : 0; m < mtiles; m += SPLIT_M ? 2 : 1)
          kiln_weight_sums(p, st, buf, m, j, half, sums);
      } else {
        const kiln_tile t = kiln_tile_at(p, tile);
        const T* wj = ws + j * KSIZE * KC * 256;
        for (int m0 = half; m0 < mtiles; m0 += 2 * MB) {
          const int nq = (mtiles - m0 + 1) / 2;  // this warp's M tiles from m0 on
          if (nq >= 4)
            kiln_products<4>(p, st, buf, wj, m0, j, t, c0, out);
          else if (nq == 3)
            kiln_products<3>(p, st, buf, wj, m0, j, t, c0, out);
          else if (nq == 2)
            kiln_products<2>(p, st, buf, wj, m0, j, t, c0, out);
          else
            kiln_products<1>(p, st, buf, wj, m0, j, t, c0, out);
        }
      }
    }
    __syncthreads();  // this buffer is read; the next issue may overwrite it
  }

  if constexpr (PASS == 2) {
    if constexpr (SPLIT_M) {
      // The chunk's two warps summed alternate M tiles of the same weights: the second hands
      // its sums to the first through shared memory (free: the loop's last barrier saw every
      // read of the tiles), [tap][e][chunk][lane] so that a warp's lanes meet no conflict.
      float* swap = reinterpret_cast<float*>(kiln_w4) + j * 32 + lane;
      if (half == 1) {
#pragma unroll
        for (int t = 0; t < KSIZE; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) swap[(t * 4 + e) * CHUNKS * 32] = sums[t][0][e];
      }
      __syncthreads();
      if (half == 1) return;
#pragma unroll
      for (int t = 0; t < KSIZE; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) sums[t][0][e] += swap[(t * 4 + e) * CHUNKS * 32];
    }
    // Sum e of k tile nt at a tap: the block's output channel 16 j + g (+8 for e >= 2) and
    // staged source channel 8 kiln_weight_unit0(j, half) + 8 nt + 2 (lane % 4) (+1 for odd e).
    if (!active) return;
    const int g = lane >> 2, pair = 2 * (lane & 3);
    const long long weights = (long long)p.chans * KSIZE * CG;
    const int s0 = 8 * kiln_weight_unit0(j, half), sc0 = kiln_source_base(c0);
#pragma unroll
    for (int t = 0; t < KSIZE; ++t)
#pragma unroll
      for (int nt = 0; nt < KC; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int o = 16 * j + g + (e >= 2 ? 8 : 0), s = s0 + 8 * nt + pair + (e & 1);
          const int oc = c0 + o, sc = sc0 + s;
          if (oc >= p.chans || sc >= p.src_chans || !kiln_same_group(o, s)) continue;
          const long long at = ((long long)oc * KSIZE + (p.reverse ? KSIZE - 1 - t : t)) * CG +
                               sc % CG;
          if (partial)
            partial[blockIdx.x * weights + at] = sums[t][nt][e];
          else
            out[at] = kiln_from_float<T>(sums[t][nt][e]);
        }
  }
}
