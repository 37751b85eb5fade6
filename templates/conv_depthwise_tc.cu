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
// (cp.async, 16-byte units, even and odd columns apart so that the reads below meet no bank
// twice), turns them into one plane per channel (16-bit pairs of neighbouring columns as
// 32-bit words), and ldmatrix reads A from the planes. Outputs go the same way back: each
// warp's products land in per-channel output planes, which the block turns into pixels of 16
// channels and stores as 16-byte vectors. The next tile's copy is in flight while a tile is
// multiplied.
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

// Elements between two planes of `cells` cells: 32 past a multiple of 64 (128 bytes), so that
// the planes of channels i and 8 + i, which lie side by side, start 16 banks apart.
__device__ __forceinline__ int kiln_plane_stride(int cells) { return (cells + 31) / 64 * 64 + 32; }

// The plane of channel c: channels i and 8 + i side by side (a warp's two channels, and the
// two halves of a pixel's 16 channels that one thread pair moves).
__device__ __forceinline__ int kiln_plane(int c) { return (c % 8) * 2 + c / 8; }

// Word i (channels 2i, 2i + 1) of the 16-byte unit u; its 16-bit halves apart.
__device__ __forceinline__ unsigned kiln_unit_word(const uint4& u, int i) {
  return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}
__device__ __forceinline__ unsigned kiln_half(const uint4& u, int c) {
  return (kiln_unit_word(u, c / 2) >> (16 * (c % 2))) & 0xffffu;
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

// The staged source of a tile: rows, columns (outputs plus a segment's window, at most
// THREADS / 2), column pairs, and the elements between planes.
struct kiln_staged {
  int rows, cols, pairs, plane;
};
__device__ __forceinline__ kiln_staged kiln_staged_of(const kiln_depthwise& p) {
  const int rows = (p.tile_h - 1) * SH + KH, cols = p.tile_w + SEG;
  return {rows, cols, cols / 2, kiln_plane_stride(rows * cols)};
}

// Starts copying the source pixels (channels c0..c0+15) of the tile at `t` into `raw`: unit
// (row, column parity, column pair, half) holds the 8 channels of one half of a pixel; zeros
// outside the source and past its channels. `at` is this thread's pixel slot.
__device__ __forceinline__ void kiln_issue(const T* __restrict__ src, const kiln_depthwise& p,
                                           const kiln_staged& st, const kiln_slot& at,
                                           uint4* raw, kiln_tile t, int c0) {
  if (at.on) {
    const int half = threadIdx.x & 1, c = c0 + half * 8;
    const int h0 = t.oh * SH + p.off_h, w = t.ow + p.off_w + at.item;
    const bool column = w >= 0 && w < p.src_w && c < p.src_c;
    // Offsets within one image fit an int (the plan checks).
    const T* image = src + (long long)t.n * p.src_h * p.src_w * p.src_c + c;
    const int row_elems = p.src_w * p.src_c;
    uint4* d = raw + ((at.row * 2 + (at.item & 1)) * st.pairs + at.item / 2) * 2 + half;
    for (int r = at.row; r < st.rows; r += at.step, d += at.step * st.pairs * 4) {
      const int h = h0 + r;
      const bool ok = column && h >= 0 && h < p.src_h;
      kiln_cp_async<16, false>(d, ok ? image + h * row_elems + w * p.src_c : src, ok);
    }
  }
  kiln_cp_async_commit();
}

// The staged pixels as planes: word (row, pair) of channel c's plane holds columns 2 pair and
// 2 pair + 1. A thread takes one half (8 channels) of two neighbouring pixels; `at` is its
// column-pair slot.
__device__ __forceinline__ void kiln_to_planes(const uint4* raw, unsigned* planes,
                                               const kiln_staged& st, const kiln_slot& at) {
  if (!at.on) return;
  const int half = threadIdx.x & 1;
  unsigned* mine = planes + (half * st.plane) / 2;  // channel half * 8's plane, kiln_plane(8 half)
  for (int r = at.row; r < st.rows; r += at.step) {
    const uint4 even = raw[((r * 2) * st.pairs + at.item) * 2 + half];
    const uint4 odd = raw[((r * 2 + 1) * st.pairs + at.item) * 2 + half];
    const int pair = r * st.pairs + at.item;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      mine[i * st.plane + pair] = kiln_half(even, i) | (kiln_half(odd, i) << 16);
  }
}

// A segment (8 outputs along a row) of the tile: its row and its place in the row, advanced
// 16 segments at a time without dividing.
struct kiln_seg {
  int row, col;
};
__device__ __forceinline__ void kiln_advance(kiln_seg& s, int rows16, int cols16, int per_row) {
  s.row += rows16;
  s.col += cols16;
  if (s.col >= per_row) {
    s.col -= per_row;
    ++s.row;
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
  unsigned* outs = planes + CB * st.plane / 2;

  const unsigned long long by_w = kiln_magic(p.tiles_w), by_h = kiln_magic(p.tiles_h);
  const kiln_slot pixel_at = kiln_slot_of(st.cols), pair_at = kiln_slot_of(st.pairs);
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

  const int per_row = p.tile_w / SEG, mtiles = (p.tile_h * per_row + 15) / 16;
  const int rows16 = 16 / per_row, cols16 = 16 - rows16 * per_row;
  const int out_pairs = p.tile_w / 2;
  const kiln_slot out_at = kiln_slot_of(out_pairs);
  // This warp's two channels' planes (kiln_plane(warp) = 2 warp, kiln_plane(warp + 8) next).
  const unsigned short* mine = reinterpret_cast<const unsigned short*>(planes) + 2 * warp * st.plane;
  unsigned* mine_out = outs + warp * out_plane;
  // The segments of this lane's ldmatrix row (lane % 16) and C rows (lane / 4, lane / 4 + 8)
  // in M tile 0.
  const kiln_seg a0 = {(lane % 16) / per_row, (lane % 16) % per_row};
  const kiln_seg c_lo = {(lane / 4) / per_row, (lane / 4) % per_row};
  const kiln_seg c_hi = {(lane / 4 + 8) / per_row, (lane / 4 + 8) % per_row};
  for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    // This tile's copy has landed: into planes; then the next tile's copy may start.
    kiln_cp_async_wait<0>();
    __syncthreads();
    kiln_to_planes(raw, planes, st, pair_at);
    __syncthreads();
    if (tile + gridDim.x < p.tiles)
      kiln_issue(src, p, st, pixel_at, raw, kiln_tile_at(p, tile + gridDim.x, by_w, by_h), c0);

    // Products, 16 segments at a time.
    kiln_seg a = a0, cs[2] = {c_lo, c_hi};
    for (int mt = 0; mt < mtiles; ++mt) {
      // Lane l gives ldmatrix the row of segment l % 16 (past the last: one in the tile,
      // unused), at source column 8 (l / 16) of its window.
      const unsigned short* a_row =
          mine + min(a.row, p.tile_h - 1) * SH * st.cols + a.col * SEG + 8 * (lane / 16);
      float acc[2][4] = {};
#pragma unroll
      for (int r = 0; r < KH; ++r) {
        unsigned f0[4], f1[4];
        kiln_ldmatrix_x4<false>(f0, a_row + r * st.cols);
        kiln_ldmatrix_x4<false>(f1, a_row + st.plane + r * st.cols);
        kiln_mma<T>::run(acc[0], f0, band[0][r][0], band[0][r][1]);
        kiln_mma<T>::run(acc[1], f1, band[1][r][0], band[1][r][1]);
      }
      // C's rows are segments lane / 4 and lane / 4 + 8, columns 2 (lane % 4) and the next:
      // one word of each channel's output plane.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (cs[half].row < p.tile_h) {
          const int word = cs[half].row * out_pairs + cs[half].col * (SEG / 2) + lane % 4;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            mine_out[h * out_plane / 2 + word] =
                kiln_pack2(T{}, acc[h][2 * half], acc[h][2 * half + 1]);
        }
        kiln_advance(cs[half], rows16, cols16, per_row);
      }
      kiln_advance(a, rows16, cols16, per_row);
    }
    __syncthreads();

    // The output planes as pixels: a thread takes one half (8 channels) of two neighbouring
    // outputs, and stores each as a 16-byte vector.
    const kiln_tile t = kiln_tile_at(p, tile, by_w, by_h);
    const int half = lane & 1, c = c0 + half * 8, ow = t.ow + 2 * out_at.item;
    if (out_at.on && c < p.out_c && ow < p.out_w) {
      const unsigned* from = outs + half * out_plane / 2;  // kiln_plane(8 half)
      T* image = out + (long long)t.n * p.out_h * p.out_w * p.out_c + c;
      const int last = min(p.tile_h, p.out_h - t.oh);
      for (int orow = out_at.row; orow < last; orow += out_at.step) {
        const int pair = orow * out_pairs + out_at.item;
        unsigned w[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = from[i * out_plane + pair];
        const uint4 even = make_uint4((w[0] & 0xffffu) | (w[1] << 16), (w[2] & 0xffffu) | (w[3] << 16),
                                      (w[4] & 0xffffu) | (w[5] << 16), (w[6] & 0xffffu) | (w[7] << 16));
        const uint4 odd = make_uint4((w[0] >> 16) | (w[1] & 0xffff0000u), (w[2] >> 16) | (w[3] & 0xffff0000u),
                                     (w[4] >> 16) | (w[5] & 0xffff0000u), (w[6] >> 16) | (w[7] & 0xffff0000u));
        T* dst = image + ((t.oh + orow) * p.out_w + ow) * p.out_c;
        *reinterpret_cast<uint4*>(dst) = even;
        if (ow + 1 < p.out_w) *reinterpret_cast<uint4*>(dst + p.out_c) = odd;
      }
    }
  }
}
