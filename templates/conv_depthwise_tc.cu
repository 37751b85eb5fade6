// Depthwise convolution of 16-bit types on tensor cores (mma.sync m16n8k16, sm_80+): forward,
// and backward-data at stride 1, for one output channel a group and a column stride of 1. Same
// problem as conv_depthwise.cu (struct kiln_depthwise), which takes every other case.
//
// Along a row, one channel's outputs are a product with a banded (Toeplitz) matrix: eight
// outputs x0..x0+7 of tap row r read the 16 source columns x0..x0+15 (from the first tap on) as
// out[j] += sum_k src[k] * T_r[k][j], T_r[k][j] = w[r][k - j] (zero outside 0 <= k - j < KW,
// so KW <= 9). So an MMA takes 16 such segments of 8 outputs (A: 16 segments x 16 source
// columns, one channel) against T_r (B: 16 x 8) for one tap row; the kernel's KH tap rows are
// KH MMAs. Most of T_r is zeros, but the tensor cores have products to spare: what bounds a
// depthwise layer is bytes.
//
// A's rows run along the source row of one channel, while memory has channels innermost. So a
// block works on 16 channels: it copies a tile's source pixels into shared memory as they are
// (cp.async, 16-byte units), turns them into one plane per channel with ldmatrix .trans (a
// matrix of 8 pixels x 8 channels read as 8 channels x 8 pixels: 16-bit pairs of neighbouring
// columns as 32-bit words), and ldmatrix reads A from the planes. Outputs go the same way
// back: each warp's products land in per-channel output planes, which ldmatrix .trans turns
// into pixels again, stored 4 channels (8 bytes) a lane. The next tile's copy is in flight
// while a tile is multiplied.
//
// Non-finite values: T's zeros meet source columns the outputs do not read (a segment's window
// is 16 columns wide), so an infinite or NaN source value may make NaN of outputs up to 15
// columns away, as any tensor-core path that multiplies padding by zero does.
//
//   PASS 0 forward:         out = output, src = input, rows at stride SH.
//   PASS 1 backward-data:   out = input gradient, src = cotangent, stride 1: the forward with
//                           the taps walked backwards (off = pad - (k - 1)).
{{> prelude}}
{{> mma}}

typedef {{dtype}} T;
constexpr int PASS = {{PASS}};
constexpr int KH = {{KH}}, KW = {{KW}};
constexpr int SH = {{SH}};
constexpr int THREADS = {{block_dim}};
constexpr int WARPS = THREADS / 32;
constexpr int KSIZE = KH * KW;
constexpr int CB = 16;   // channels a block
constexpr int SEG = 8;   // outputs a segment (the MMA's n)
// Blocks an SM must hold (the launch bound; ops::conv::depthwise::tensor_min_blocks): three
// for kernels of up to 5 rows, whose bands take fewer registers; the plan sizes tiles to fit them.
constexpr int MIN_BLOCKS = KH <= 5 ? 3 : 2;
static_assert(sizeof(T) == 2, "16-bit types only");
static_assert(KILN_ARCH >= 800, "mma.sync m16n8k16 for both 16-bit types needs sm_80");
static_assert(KW <= 9, "a segment's 16-column window holds 8 outputs' taps for KW <= 9");
static_assert(WARPS * 2 == CB, "a warp takes two channels");
static_assert({{MG}} == 1 && {{SW}} == 1, "one output channel a group, column stride 1");
static_assert(PASS != 1 || SH == 1, "backward-data is stride 1 only");

// Mirrors ops::conv::depthwise::Problem (repr(C)).
struct kiln_depthwise {
  int batch;
  int src_h, src_w, src_c;  // the source's extents and channels
  int out_h, out_w, out_c;  // the gather's output
  int off_h, off_w;         // source position of output 0 at tap 0
  int tile_h, tile_w;       // outputs a tile (tile_w a multiple of SEG)
  int tiles_h, tiles_w;     // tiles an image
  int tiles;                // batch * tiles_h * tiles_w
  int chunks;               // blocks of CB channels
  int reverse;              // the weight's tap is KSIZE - 1 - t
  int vec_src;              // unused: this kernel always copies 16-byte units
  int vec_dy;               // unused
  int tiles_per_split;      // unused
  int base_h, base_w;       // unused (0)
  int split_halo;           // 1: each staged row's last unit apart (kiln_staged_of)
};

// x / d for 0 <= x < 2^32 / d, as a multiply by m = kiln_magic(d) (no division in the loops).
__device__ __forceinline__ unsigned long long kiln_magic(int d) {
  return 0xffffffffull / (unsigned)d + 1;
}
__device__ __forceinline__ int kiln_div(int x, unsigned long long m) {
  return (int)(((unsigned long long)(unsigned)x * m) >> 32);
}

// The tile's image and its first output row and column; by_w and by_h divide by tiles_w and
// tiles_h (the plan keeps tiles below 2^32 / either).
struct kiln_tile {
  int n, oh, ow;
};
__device__ __forceinline__ kiln_tile kiln_tile_at(const kiln_depthwise& p, int tile,
                                                 unsigned long long by_w, unsigned long long by_h) {
  const int rest = kiln_div(tile, by_w), tw = tile - rest * p.tiles_w;
  const int n = kiln_div(rest, by_h), th = rest - n * p.tiles_h;
  return {n, th * p.tile_h, tw * p.tile_w};
}

// Where a thread works in a pass over rows of `width` items (pixels, column pairs): a thread
// pair takes one item, each thread one half of its 16 channels; a pass covers `step` rows
// (THREADS / 2 / width of them, width <= THREADS / 2), this thread row `row` of each, item
// `item`, unless `on` is false (the slots past step x width).
struct kiln_slot {
  int item, row, step;
  bool on;
};
__device__ __forceinline__ kiln_slot kiln_slot_of(int width) {
  const int slot = (threadIdx.y * 32 + threadIdx.x) >> 1, step = (THREADS / 2) / width;
  const int row = slot / width;
  return {slot - row * width, row, step, row < step};
}

// Elements between two planes of `cells` cells: 4 words past a multiple of 32 words (128
// bytes), so that planes 0..7 start in bank groups 0, 4, ..., 28: the transposes' stores (lane
// l writes word l % 4 of plane l / 4) and reads (row i of an ldmatrix from plane i) meet no bank
// twice. 16-byte aligned, as ldmatrix's rows must be.
__device__ __forceinline__ int kiln_plane_stride(int cells) { return (cells + 63) / 64 * 64 + 8; }

// The output plane of channel c (c = 4a + b): the ldmatrix that turns planes into pixels reads
// channels {4a, 4a + 1} (slots 0-7) as one matrix and {4a + 2, 4a + 3} (slots 8-15) as the
// other, so that lane 4 g + t receives channels 4t..4t+3 of pixel g, one 8-byte store.
__device__ __forceinline__ int kiln_out_slot(int c) {
  const int a = c / 4, b = c % 4;
  return 8 * (b / 2) + 2 * a + b % 2;
}

// Two floats rounded to T, as the low and high halves of one word.
__device__ __forceinline__ unsigned kiln_pack2(kiln_f16, float lo, float hi) {
#ifdef KILN_HOST
  return kiln_from_float<kiln_f16>(lo).bits | ((unsigned)kiln_from_float<kiln_f16>(hi).bits << 16);
#else
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}
__device__ __forceinline__ unsigned kiln_pack2(kiln_bf16, float lo, float hi) {
#ifdef KILN_HOST
  return kiln_from_float<kiln_bf16>(lo).bits | ((unsigned)kiln_from_float<kiln_bf16>(hi).bits << 16);
#else
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}

// The staged source of a tile: rows, columns (outputs plus a segment's window, a multiple of 8,
// at most THREADS / 2), groups of 8 columns (units), and the layout of a channel plane.
//
// A plane holds the staged rows as 16-byte units (8 columns), in one of two layouts. An
// ldmatrix matrix reads 8 segments' windows, which run on from one row to the next; packed row
// after row (per_row + 1 units a row), eight segments crossing a row read two units in one bank
// group: two wavefronts for that matrix. With split_halo, each row's first per_row units (its
// body) are packed per_row units apart, so that the units any matrix reads fall in 8 bank
// groups, and its last unit (the halo, the window's end past the tile's outputs) lies in a
// second region, where the next row's first would be. Rows are kept apart by class rho % SH
// (rows SH apart serve neighbouring output rows), `span` units (a multiple of 8) a class:
//   body unit u < per_row:   c * span + q * per_row + u          (c = rho % SH, q = rho / SH)
//   halo (u = per_row):      (SH + c) * span + (q + 1) * per_row
// Both layouts are  c * class_span + q * row_step + u (+ halo_base for the halo): packed rows
// are class_span = groups, row_step = SH x groups, halo_base = 0. The split layout takes about
// twice the shared memory; the plan chooses it where the products, not the staging, dominate.
struct kiln_staged {
  int rows, cols, groups, per_row;
  int class_span, row_step, halo_base, plane;
};
__device__ __forceinline__ kiln_staged kiln_staged_of(const kiln_depthwise& p) {
  const int rows = (p.tile_h - 1) * SH + KH, cols = p.tile_w + SEG, per_row = p.tile_w / SEG;
  const int groups = cols / 8;
  if (!p.split_halo)
    return {rows, cols, groups, per_row, groups, SH * groups, 0, kiln_plane_stride(rows * cols)};
  const int span = ((rows + SH - 1) / SH * per_row + 1 + 7) / 8 * 8;
  const int plane = kiln_plane_stride(2 * SH * span * 8);
  return {rows, cols, groups, per_row, span, per_row, SH * span, plane};
}

// The plane unit (16-byte unit index) of staged row `rho`, unit `u` (0..per_row).
__device__ __forceinline__ int kiln_plane_unit(const kiln_staged& st, int rho, int u) {
  return (rho % SH) * st.class_span + (rho / SH) * st.row_step + u +
         (u == st.per_row ? st.halo_base : 0);
}

// The raw copy's 16-byte unit of pixel `pixel` (row x cols + column) and channel half `half`:
// the halves of pixels 4-7 of each 8 swapped, so that the 8 units an ldmatrix row set reads
// (one half of 8 neighbouring pixels) fall in 8 different bank groups.
__device__ __forceinline__ int kiln_raw_unit(int pixel, int half) {
  return 2 * pixel + (half ^ ((pixel >> 2) & 1));
}

// Starts copying the source pixels (channels c0..c0+15) of the tile at `t` into `raw`; zeros
// outside the source and past its channels. A thread pair takes one pixel (each thread one
// 16-byte half of its 16 channels); `at` is this thread's pixel slot.
__device__ __forceinline__ void kiln_issue(const T* __restrict__ src, const kiln_depthwise& p,
                                           const kiln_staged& st, const kiln_slot& at,
                                           uint4* raw, kiln_tile t, int c0) {
  if (at.on) {
    const int half = threadIdx.x & 1, c = c0 + half * 8;
    const int w = t.ow + p.off_w + at.item;
    const bool column = w >= 0 && w < p.src_w && c < p.src_c;
    // Offsets within one image fit an int (the plan checks).
    const T* image = src + (long long)t.n * p.src_h * p.src_w * p.src_c + c;
    const int row_elems = p.src_w * p.src_c;
    int h = t.oh * SH + p.off_h + at.row;
    // Pointers stepped a pass at a time (a pass is at.step rows); where the row is outside the
    // image the copy reads nothing from `src` (its pointer may then be outside the image).
    const T* from = image + h * row_elems + w * p.src_c;
    const int from_step = at.step * row_elems;
    // Rows are whole groups of 8 pixels: the unit's swap is the item's in every row.
    uint4* d = raw + kiln_raw_unit(at.row * st.cols + at.item, half);
    const int d_step = 2 * at.step * st.cols;
    for (int r = at.row; r < st.rows; r += at.step, d += d_step, from += from_step) {
      const bool ok = column && (unsigned)h < (unsigned)p.src_h;
      kiln_cp_async<16, false>(d, ok ? from : src, ok);
      h += at.step;
    }
  }
  kiln_cp_async_commit();
}

// The staged pixels as planes: word 4 unit + j of channel c's plane holds columns 2j and
// 2j + 1 of that unit (kiln_plane_unit). Warp by warp, 8 pixels at a time: ldmatrix .trans
// over their two halves gives lane 4 g + t channels g and 8 + g of columns 2t and 2t + 1.
__device__ __forceinline__ void kiln_to_planes(const uint4* raw, unsigned* planes,
                                               const kiln_staged& st,
                                               const kiln_walk_start& unit_at) {
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int g = lane / 4, t = lane % 4;
  // Lanes 0-15 name the rows: pixel lane % 8 of the 8, half lane / 8.
  const uint4* from = raw + kiln_raw_unit(lane % 8, (lane / 8) & 1);
  unsigned* to = planes + g * st.plane / 2 + t;
  const int items = st.rows * st.groups, high = 8 * st.plane / 2;
  if (!st.halo_base) {
    // Packed rows: unit = item.
    for (int item = warp; item < items; item += WARPS) {
      unsigned w[2];
      kiln_ldmatrix_x2<true>(w, from + 16 * item);
      to[4 * item] = w[0];
      to[4 * item + high] = w[1];
    }
    return;
  }
  // Pixel 8 item is the group's first (cols = 8 groups): row rho = item / groups, unit u the
  // rest, stepped by WARPS items at a time from `unit_at` (item `warp`).
  int rho = unit_at.r, u = unit_at.q;
  const uint4* at = from + 16 * warp;
  for (int item = warp; item < items; item += WARPS, at += 16 * WARPS) {
    unsigned w[2];
    kiln_ldmatrix_x2<true>(w, at);
    unsigned* unit = to + 4 * kiln_plane_unit(st, rho, u);
    unit[0] = w[0];
    unit[high] = w[1];
    u += unit_at.step_q;
    rho += unit_at.step_r;
    if (u >= st.groups) {
      u -= st.groups;
      ++rho;
    }
  }
}

// The products of M tiles mt..mt + M - 1 (16 segments each) for this warp's two channels: KH
// tap rows, each an ldmatrix and an MMA a channel and M tile, their MMAs side by side so that
// 2 M accumulations are in flight; then C into the output planes. `mine` is the warp's first
// source plane (the second `high` elements further); `out` each channel's output plane at this
// lane's word of C. Segment s is output row s / per_row, outputs 8 (s % per_row)..+7 of it, and
// words 4 s..4 s + 3 of an output plane; at tap row r it reads staged row SH (s / per_row) + r.
template <int M>
__device__ __forceinline__ void kiln_products(int mt, int segments, unsigned long long by_row,
                                              const kiln_staged& st, int high,
                                              const unsigned short* mine,
                                              const unsigned (&band)[2][KH][2],
                                              unsigned* const (&out)[2]) {
  const int lane = threadIdx.x, per_row = st.per_row;
  const unsigned short* a_row[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    // Lane l's ldmatrix row: segment 16 (mt + m) + l % 16 (past the last: the last, unused),
    // unit l / 16 of its window, at tap row 0 (kiln_plane_unit of row SH j, of class 0).
    const int s = min((mt + m) * 16 + lane % 16, segments - 1);
    const int j = kiln_div(s, by_row), u = s - j * per_row + lane / 16;
    const int unit = j * st.row_step + u + (u == per_row ? st.halo_base : 0);
    a_row[m] = mine + 8 * unit;
  }
  float acc[M][2][4] = {};
#pragma unroll
  for (int r = 0; r < KH; ++r) {
    // Tap row r: staged rows r further, class r % SH, r / SH rows on within the class.
    const int tap = 8 * ((r % SH) * st.class_span + (r / SH) * st.row_step);
    unsigned f[M][2][4];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      kiln_ldmatrix_x4<false>(f[m][0], a_row[m] + tap);
      kiln_ldmatrix_x4<false>(f[m][1], a_row[m] + high + tap);
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) kiln_mma<T>::run(acc[m][h], f[m][h], band[h][r][0], band[h][r][1]);
  }
  // C's rows are segments 16 (mt + m) + lane / 4 (+8), columns 2 (lane % 4) and the next: word
  // 64 (mt + m) + lane (+32) of each channel's output plane.
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int c_seg = (mt + m) * 16 + lane / 4, word = 64 * (mt + m);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (c_seg < segments) out[h][word] = kiln_pack2(T{}, acc[m][h][0], acc[m][h][1]);
      if (c_seg + 8 < segments) out[h][word + 32] = kiln_pack2(T{}, acc[m][h][2], acc[m][h][3]);
    }
  }
}

// Shared memory: the block's weights (16-bit, taps in walking order), the raw copy of a tile's
// source, its planes, and the output planes.
// Block: (32, WARPS); grid: (blocks walking the tiles, chunks of CB channels).
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) {{kernel}}(
    const T* __restrict__ src, const T* __restrict__ weight, T* __restrict__ out,
    float* __restrict__ partial, kiln_depthwise p) {
  (void)partial;
  extern __shared__ float4 kiln_w4[];
  const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
  const int c0 = blockIdx.y * CB;
  const kiln_staged st = kiln_staged_of(p);
  const int out_plane = kiln_plane_stride(p.tile_h * p.tile_w);
  constexpr int WEIGHT_UNITS = (CB * KSIZE * 2 + 15) / 16;
  unsigned short* wts = reinterpret_cast<unsigned short*>(kiln_w4);
  uint4* raw = reinterpret_cast<uint4*>(kiln_w4) + WEIGHT_UNITS;
  unsigned* planes = reinterpret_cast<unsigned*>(raw + st.rows * st.cols * 2);
  unsigned short* outs = reinterpret_cast<unsigned short*>(planes + CB * st.plane / 2);

  const unsigned long long by_w = kiln_magic(p.tiles_w), by_h = kiln_magic(p.tiles_h);
  const kiln_slot pixel_at = kiln_slot_of(st.cols);
  if (blockIdx.x < p.tiles)
    kiln_issue(src, p, st, pixel_at, raw, kiln_tile_at(p, blockIdx.x, by_w, by_h), c0);

  // The weights, then each warp's B fragments for its channels warp and warp + 8: tap row r's
  // band T_r[k][n] = w[r][k - n], k = 2 (lane % 4) (+1, +8, +9), n = lane / 4.
  for (int e = tid; e < CB * KSIZE; e += THREADS) {
    const int c = e / KSIZE, t = e - c * KSIZE;
    const int walked = p.reverse ? KSIZE - 1 - t : t;
    wts[c * KSIZE + walked] =
        c0 + c < p.out_c ? weight[(long long)(c0 + c) * KSIZE + t].bits : (unsigned short)0;
  }
  __syncthreads();
  unsigned band[2][KH][2];
  {
    const int n = lane / 4, k = 2 * (lane % 4);
    auto tap = [&](int c, int r, int s) -> unsigned {
      return s >= 0 && s < KW ? wts[c * KSIZE + r * KW + s] : 0u;
    };
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r = 0; r < KH; ++r) {
        const int c = warp + 8 * h;
        band[h][r][0] = tap(c, r, k - n) | (tap(c, r, k + 1 - n) << 16);
        band[h][r][1] = tap(c, r, k + 8 - n) | (tap(c, r, k + 9 - n) << 16);
      }
  }

  // The tile's segments (8 outputs along a row) in row order: segment s is row s / per_row,
  // outputs 8 (s % per_row)..+7, and words 4 s..4 s + 3 of an output plane.
  const int per_row = p.tile_w / SEG, segments = p.tile_h * per_row;
  const unsigned long long by_row = kiln_magic(per_row);
  // This warp's first staged unit for the split planes' transpose, and its step (kiln_to_planes).
  const kiln_walk_start unit_at = kiln_walk_start_of(warp, WARPS, st.groups);
  const int mtiles = (segments + 15) / 16;
  // This warp's two channels' source planes; their output planes, at this lane's word of C.
  const unsigned short* mine = reinterpret_cast<const unsigned short*>(planes) + warp * st.plane;
  const int high = 8 * st.plane;
  unsigned* mine_out[2] = {
      reinterpret_cast<unsigned*>(outs + kiln_out_slot(warp) * out_plane) + lane,
      reinterpret_cast<unsigned*>(outs + kiln_out_slot(warp + 8) * out_plane) + lane};
  // Turning the output planes into pixels: lane l names row l % 8 of matrix l / 8, slot
  // l % 16 (channel planes 0-7, then 8-15) at output 8 (l / 16) of 16; lane 4 g + t then
  // holds channels 4t..4t+3 of outputs g and 8 + g.
  const unsigned short* out_from = outs + (lane % 16) * out_plane + SEG * (lane / 16);
  for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    // This tile's copy has landed: into planes; then the next tile's copy may start.
    kiln_cp_async_wait<0>();
    __syncthreads();
    kiln_to_planes(raw, planes, st, unit_at);
    __syncthreads();
    if (tile + gridDim.x < p.tiles)
      kiln_issue(src, p, st, pixel_at, raw, kiln_tile_at(p, tile + gridDim.x, by_w, by_h), c0);

    // Products, 16 segments (an M tile) at a time, two M tiles together where there are two.
    int mt = 0;
    for (; mt + 1 < mtiles; mt += 2)
      kiln_products<2>(mt, segments, by_row, st, high, mine, band, mine_out);
    if (mt < mtiles) kiln_products<1>(mt, segments, by_row, st, high, mine, band, mine_out);
    __syncthreads();

    // The output planes as pixels, a row a warp, 16 outputs (two segments) at a time: lane
    // 4 g + t stores channels 4t..4t+3 of outputs g and 8 + g as 8-byte words. A row of an odd
    // number of segments reads one past its end (the next row's first, or the plane's
    // padding), which is not stored.
    const kiln_tile t = kiln_tile_at(p, tile, by_w, by_h);
    const int g = lane / 4, c = c0 + 4 * (lane % 4);
    const int last = min(p.tile_h, p.out_h - t.oh);
    const int outputs = min(p.tile_w, p.out_w - t.ow);  // of a row of this tile
    T* image = out + (long long)t.n * p.out_h * p.out_w * p.out_c + c;
    for (int orow = warp; orow < last; orow += WARPS) {
      const unsigned short* from = out_from + orow * p.tile_w;
      T* dst = image + ((t.oh + orow) * p.out_w + t.ow + g) * p.out_c;
      for (int x = 0; x < outputs; x += 2 * SEG, from += 2 * SEG, dst += 2 * SEG * p.out_c) {
        unsigned w[4];
        kiln_ldmatrix_x4<true>(w, from);
        if (c < p.out_c && x + g < outputs) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
        if (c < p.out_c && x + SEG + g < outputs)
          *reinterpret_cast<uint2*>(dst + SEG * p.out_c) = make_uint2(w[2], w[3]);
      }
    }
  }
}
