// Stems: the first convolution of an image network, whose input has 1 to 4 channels and whose
// kernel is at most 7x7 (2-D, one group, no dilation). The implicit GEMM's k axis (taps x
// channels) has too few channels per tap for the other families' channel vectors or 64-channel
// k steps, so a block stages the input patch its output tile reads in shared memory, with the
// weight (forward) or the cotangent tile (backward-weight), and each thread gathers its
// operands from there at offsets that are mostly known at compile time.
//   PASS 0 forward:         out[pixel, cout] = sum over (kh, kw, c) patch(pixel) * weight
//   PASS 1 backward-data:   in[pixel, c] = sum over the taps that reach it and cout of
//                           cotangent * weight, on the FMA units in f32 for every dtype: each
//                           block stages the cotangent rows its input tile reads (and the
//                           weight) 32 channels at a time; a warp walks one stride phase at a
//                           time, so that its lanes share their taps.
//   PASS 2 backward-weight: part[cout, (kh, kw, c)] = sum over the block's pixels of
//                           cotangent[pixel, cout] * patch(pixel), in f32, one partial a block
//                           (blockIdx.x), which reduce_cols.cu adds up in a fixed order.
// A tile is TH x TW output pixels of one image; blocks are persistent, walking the tiles with a
// grid stride; blockIdx.y picks NB output channels.
// TENSOR (16-bit types where the GPU has tensor cores): mma.sync m16n8k16. The patch keeps 4
// channels a pixel (zeros past C) and each kernel row is padded to a multiple of 4 taps, so that
// a k step of 16 is 4 taps x 4 channels of one kernel row and a thread's pair of k elements is
// one aligned 32-bit word of the patch. Otherwise the FMA units, in f32: the patch keeps C
// channels a pixel, converted once as it is staged.
{{> prelude}}
{{> mma}}

typedef {{dtype}} T;
constexpr int PASS = {{PASS}};
constexpr int C = {{C}}, KH = {{KH}}, KW = {{KW}}, SH = {{SH}}, SW = {{SW}}, NB = {{NB}};
constexpr bool TENSOR = {{TENSOR}} != 0;
constexpr int THREADS = 128, TH = 8, TW = 16, PIXELS = TH * TW;
// Blocks an SM must hold: four (forward, backward-data), so that others' math hides a block's
// staging; backward-weight's accumulators, and backward-data's on tensor cores, need more
// registers. Mirrored by
// ops::conv::stem::min_blocks_per_sm; the persistent grids hold as many as the driver says fit.
constexpr int MIN_BLOCKS = PASS == 2 ? 2 : PASS == 1 && TENSOR && SH * SW <= 4 && C >= 3 ? 3 : 4;
static_assert(NB == 32 || NB == 64, "32 or 64 output channels a block");

template <bool B, typename X, typename Y> struct kiln_if { typedef X type; };
template <typename X, typename Y> struct kiln_if<false, X, Y> { typedef Y type; };
// What the patch holds: the 16-bit values themselves for tensor cores, else floats.
typedef typename kiln_if<TENSOR, T, float>::type PT;

constexpr int CP = TENSOR ? 4 : C;                       // channels a patch pixel holds
constexpr int KWP = TENSOR ? (KW + 3) / 4 * 4 : KW;      // taps a kernel row holds
constexpr int PR = (TH - 1) * SH + KH, PC = (TW - 1) * SW + KWP;  // the patch's rows, columns
constexpr int KK = KH * KW * C;                          // the weight's elements a channel
// Forward, tensor cores: the weight as rows of k (kh, kw padded, 4 channels) per output
// channel, 8 more elements a row so that ldmatrix's rows fall in different banks.
constexpr int WK = KH * KWP * 4 + 8;
// Backward-weight: the cotangent tile, a row a pixel (tensor cores: padded for ldmatrix).
constexpr int DY_LD = TENSOR ? NB + 8 : NB;
// Forward, tensor cores: the output tile on its way out, a row a pixel.
constexpr int OUT_LD = NB + 8;

// Shared memory (mirrored by ops::conv::stem::shared_bytes): the patch, then the weight (and,
// tensor-core forward, the output tile on its way out) or the cotangent tile (two of them on
// tensor cores).
constexpr int PATCH_BYTES = (PR * PC * CP * (int)sizeof(PT) + 15) / 16 * 16;
constexpr int WEIGHT_BYTES = TENSOR ? NB * WK * 2 : KK * NB * 4;
constexpr int OUT_BYTES = TENSOR ? PIXELS * OUT_LD * 2 : 0;  // after the weight
constexpr int DY_BYTES = PIXELS * DY_LD * (TENSOR ? 2 : 4);

// Mirrors ops::conv::stem::Problem (repr(C)).
struct kiln_stem {
  int batch, in_h, in_w, out_h, out_w, cout;
  int pad_h, pad_w;       // padding before the first row and column
  int tiles_h, tiles_w;   // tiles an image along h and w
  int flip;               // the weight is applied turned round
  int vec;                // cotangent rows in 16-byte vectors (backward-data, backward-weight
                          // on tensor cores): cout % 8 == 0 and aligned arrays
};

// --- staging --------------------------------------------------------------------------------

// A staged value as the patch holds it (explicit specialisations, so that both compile for
// every T).
template <bool TC> struct kiln_patch_of;
template <> struct kiln_patch_of<true> {
  static __device__ __forceinline__ T get(T v) { return v; }
};
template <> struct kiln_patch_of<false> {
  static __device__ __forceinline__ float get(T v) { return kiln_to_float(v); }
};

// The input patch of the tile at (oh0, ow0) of image `img`: patch[pr][pc][c] is the input at
// row oh0 * SH - pad_h + pr, column ow0 * SW - pad_w + pc, channel c; zero outside the image,
// past C, and outside what the tile's real pixels read, so that no value outside a pixel's
// window (an infinity, say) meets a padded tap or a pixel past the edge.
__device__ __forceinline__ void kiln_stage_patch(PT* patch, const T* __restrict__ x,
                                                 const kiln_stem& p, int img, int oh0, int ow0) {
  const int ih0 = oh0 * SH - p.pad_h, iw0 = ow0 * SW - p.pad_w;
  const int rows = (min(p.out_h - oh0, TH) - 1) * SH + KH;
  const int cols = (min(p.out_w - ow0, TW) - 1) * SW + KW;
  const T* image = x + (long long)img * p.in_h * p.in_w * C;
  for (int i = threadIdx.x; i < PR * PC * CP; i += THREADS) {
    const int c = i % CP, pc = (i / CP) % PC, pr = i / (CP * PC);
    const int ih = ih0 + pr, iw = iw0 + pc;
    PT v{};
    if (c < C && pr < rows && pc < cols && ih >= 0 && ih < p.in_h && iw >= 0 && iw < p.in_w)
      v = kiln_patch_of<TENSOR>::get(image[((long long)ih * p.in_w + iw) * C + c]);
    patch[i] = v;
  }
}

// Tensor cores: the same patch, loaded a pixel at a time into registers (a pixel's 4 channels are
// two 32-bit words) so that a block can load the next tile's patch while it multiplies this one.
// Thread t holds patch pixels t, t + THREADS, ...
constexpr int PATCH_PX = PR * PC, PATCH_REGS = (PATCH_PX + THREADS - 1) / THREADS;
struct kiln_patch_regs {
  uint2 px[PATCH_REGS];
};
__device__ __forceinline__ unsigned kiln_bits(kiln_f16 v) { return v.bits; }
__device__ __forceinline__ unsigned kiln_bits(kiln_bf16 v) { return v.bits; }
__device__ __forceinline__ unsigned kiln_bits(float) { return 0u; }  // f32 runs on the FMA path

__device__ __forceinline__ void kiln_load_patch(kiln_patch_regs& r, const T* __restrict__ x,
                                                const kiln_stem& p, int img, int oh0, int ow0) {
  const int ih0 = oh0 * SH - p.pad_h, iw0 = ow0 * SW - p.pad_w;
  const int rows = (min(p.out_h - oh0, TH) - 1) * SH + KH;
  const int cols = (min(p.out_w - ow0, TW) - 1) * SW + KW;
  const T* image = x + (long long)img * p.in_h * p.in_w * C;
#pragma unroll
  for (int j = 0; j < PATCH_REGS; ++j) {
    const int i = threadIdx.x + j * THREADS;
    const int pr = i / PC, pc = i % PC;
    const int ih = ih0 + pr, iw = iw0 + pc;
    unsigned h[4] = {0u, 0u, 0u, 0u};
    if (i < PATCH_PX && pr < rows && pc < cols && ih >= 0 && ih < p.in_h && iw >= 0 &&
        iw < p.in_w) {
      const T* at = image + ((long long)ih * p.in_w + iw) * C;
#pragma unroll
      for (int c = 0; c < C; ++c) h[c] = kiln_bits(at[c]);
    }
    r.px[j] = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
  }
}

__device__ __forceinline__ void kiln_put_patch(PT* patch, const kiln_patch_regs& r) {
#pragma unroll
  for (int j = 0; j < PATCH_REGS; ++j) {
    const int i = threadIdx.x + j * THREADS;
    if (i < PATCH_PX) reinterpret_cast<uint2*>(patch)[i] = r.px[j];
  }
}

// Index into the weight (cout, KH, KW, C) of tap (kh, kw) as the convolution applies it.
__device__ __forceinline__ long long kiln_weight_index(const kiln_stem& p, int co, int kh, int kw,
                                                       int c) {
  if (p.flip) {
    kh = KH - 1 - kh;
    kw = KW - 1 - kw;
  }
  return (((long long)co * KH + kh) * KW + kw) * C + c;
}

// Forward: output channels n0.. of the weight. Tensor cores: wt[n][(kh * KWP + kw) * 4 + c],
// zeros in the padding; FMA: wt[(kh * KW + kw) * C + c][n] as floats.
__device__ __forceinline__ void kiln_stage_weight(unsigned char* smem, const T* __restrict__ w,
                                                  const kiln_stem& p, int n0) {
  if constexpr (TENSOR) {
    T* wt = reinterpret_cast<T*>(smem);
    for (int i = threadIdx.x; i < NB * WK; i += THREADS) {
      const int n = i / WK, k = i % WK;
      const int c = k % 4, kw = (k / 4) % KWP, kh = k / (4 * KWP);
      T v{};
      if (kh < KH && kw < KW && c < C && n0 + n < p.cout) v = w[kiln_weight_index(p, n0 + n, kh, kw, c)];
      wt[i] = v;
    }
  } else {
    float* wt = reinterpret_cast<float*>(smem);
    for (int i = threadIdx.x; i < KK * NB; i += THREADS) {
      const int n = i % NB, k = i / NB;
      const int c = k % C, kw = (k / C) % KW, kh = k / (C * KW);
      wt[i] = n0 + n < p.cout ? kiln_to_float(w[kiln_weight_index(p, n0 + n, kh, kw, c)]) : 0.0f;
    }
  }
}

// Backward-weight: the cotangent rows of the tile's pixels, channels n0..n0 + NB; zeros for
// pixels past the edges and channels past cout. (Tensor cores with 16-byte rows copy them with
// kiln_copy_cotangent_async instead, a tile ahead.)
__device__ __forceinline__ void kiln_stage_cotangent(unsigned char* smem,
                                                     const T* __restrict__ dy,
                                                     const kiln_stem& p, int img, int oh0,
                                                     int ow0, int n0) {
  const long long image = (long long)img * p.out_h;
  for (int i = threadIdx.x; i < PIXELS * NB; i += THREADS) {
    const int px = i / NB, n = i % NB;
    const int oh = oh0 + px / TW, ow = ow0 + px % TW;
    const bool real = oh < p.out_h && ow < p.out_w && n0 + n < p.cout;
    const long long at = ((image + oh) * p.out_w + ow) * p.cout + n0 + n;
    if constexpr (TENSOR) {
      T v{};
      if (real) v = dy[at];
      reinterpret_cast<T*>(smem)[px * DY_LD + n] = v;
    } else {
      reinterpret_cast<float*>(smem)[px * DY_LD + n] = real ? kiln_to_float(dy[at]) : 0.0f;
    }
  }
}

// --- forward --------------------------------------------------------------------------------

// Tensor cores: warp w multiplies output rows 2w and 2w + 1 of the tile (an m tile of 16
// pixels each) by all NB channels.
constexpr int FWD_NT = NB / 8;

__device__ __forceinline__ void kiln_forward_tensor(const unsigned* words, const T* wt,
                                                    float (&acc)[2][FWD_NT][4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, q = lane % 4, r = lane / 4;
  // The 32-bit word of this thread's pair at tap (0, 0) of its pixels: columns r and r + 8 of
  // rows 2 warp + mt; a pixel is two words, and the pair is word q of taps q / 2 ...
  int base[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) base[mt][h] = ((2 * warp + mt) * SH * PC + (r + 8 * h) * SW) * 2 + q;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < FWD_NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
#pragma unroll
  for (int kh = 0; kh < KH; ++kh) {
#pragma unroll
    for (int kb = 0; kb < KWP / 4; ++kb) {
      // k step (kh, kb): k = 4 (tap - 4 kb) + channel. A thread's k pair 2q of each half is
      // tap 4 kb + 2 half + q / 2, channels 2 (q % 2) and the next.
      unsigned a[2][4];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int off = (kh * PC + kb * 4 + 2 * half) * 2;
        // Taps past the kernel's width read as zero whatever the patch holds there.
        const bool real = kb * 4 + 2 * half + 2 <= KW || kb * 4 + 2 * half + q / 2 < KW;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          a[mt][2 * half] = real ? words[base[mt][0] + off] : 0u;
          a[mt][2 * half + 1] = real ? words[base[mt][1] + off] : 0u;
        }
      }
      const int k0 = (kh * KWP + kb * 4) * 4;
#pragma unroll
      for (int np = 0; np < FWD_NT / 2; ++np) {
        unsigned b[4];
        kiln_ldmatrix_x4<false>(
            b, wt + (np * 16 + lane % 8 + 8 * (lane / 16)) * WK + k0 + 8 * ((lane / 8) % 2));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          kiln_mma<T>::run(acc[mt][2 * np], a[mt], b[0], b[1]);
          kiln_mma<T>::run(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
}

// Writes the warp's two tile rows. With cout a multiple of 8 they pass through the warp's part
// of `stage` (OUT_LD channels a pixel, padded so that the fragments' 4-byte writes miss each
// other's banks) and leave as 16-byte vectors of consecutive channels, lane l moving vectors
// l, l + 32, ... of the warp's 32 pixels x NB / 8: whole 32-byte sectors, where the fragments'
// own stores would write each pixel's channels in 4-byte pieces.
__device__ __forceinline__ void kiln_store_forward_tensor(T* __restrict__ out, T* stage,
                                                          const kiln_stem& p, int img, int oh0,
                                                          int ow0, int n0,
                                                          const float (&acc)[2][FWD_NT][4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, q = lane % 4, r = lane / 4;
  if (p.cout % 8 == 0) {
    T* mine = stage + warp * 32 * OUT_LD;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < FWD_NT; ++nt) {
          kiln_vec<T, 2> v;
          v.v[0] = kiln_from_float<T>(acc[mt][nt][2 * h]);
          v.v[1] = kiln_from_float<T>(acc[mt][nt][2 * h + 1]);
          const int px = 16 * mt + r + 8 * h;
          *reinterpret_cast<kiln_vec<T, 2>*>(mine + px * OUT_LD + nt * 8 + 2 * q) = v;
        }
    __syncwarp();
    constexpr int CHUNKS = NB / 8;  // 16-byte vectors a pixel
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int v = lane + 32 * i, px = v / CHUNKS, co = n0 + v % CHUNKS * 8;
      const int oh = oh0 + 2 * warp + px / 16, ow = ow0 + px % 16;
      if (oh < p.out_h && ow < p.out_w && co < p.cout)
        *reinterpret_cast<uint4*>(out + (((long long)img * p.out_h + oh) * p.out_w + ow) * p.cout +
                                  co) = *reinterpret_cast<const uint4*>(mine + px * OUT_LD +
                                                                        v % CHUNKS * 8);
    }
    __syncwarp();  // the next tile's writes come after these reads
    return;
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int oh = oh0 + 2 * warp + mt;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ow = ow0 + r + 8 * h;
      if (oh >= p.out_h || ow >= p.out_w) continue;
      T* row = out + (((long long)img * p.out_h + oh) * p.out_w + ow) * p.cout;
#pragma unroll
      for (int nt = 0; nt < FWD_NT; ++nt) {
        const int co = n0 + nt * 8 + 2 * q;
        const float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1];
        if (p.cout % 2 == 0 && co + 1 < p.cout) {
          kiln_vec<T, 2> v;
          v.v[0] = kiln_from_float<T>(v0);
          v.v[1] = kiln_from_float<T>(v1);
          *reinterpret_cast<kiln_vec<T, 2>*>(row + co) = v;
        } else {
          if (co < p.cout) row[co] = kiln_from_float<T>(v0);
          if (co + 1 < p.cout) row[co + 1] = kiln_from_float<T>(v1);
        }
      }
    }
  }
}

// FMA: thread t computes channels 16 v + 4 (t % 4) + 0..3 (v < NB / 16) of pixels t / 4 + 32 i
// (i < 4); interleaved so that the four channel groups of a warp read different banks.
constexpr int FMA_V = NB / 16;

__device__ __forceinline__ void kiln_forward_fma(const float* patch, const float* wt,
                                                 T* __restrict__ out, const kiln_stem& p, int img,
                                                 int oh0, int ow0, int n0) {
  const int cg = threadIdx.x % 4, pg = threadIdx.x / 4;
  int base[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int px = pg + 32 * i;
    base[i] = ((px / TW) * SH * PC + (px % TW) * SW) * C;
  }
  float acc[4][FMA_V][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int v = 0; v < FMA_V; ++v)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][v][e] = 0.0f;
#pragma unroll 1
  for (int kh = 0; kh < KH; ++kh) {
#pragma unroll
    for (int kw = 0; kw < KW; ++kw) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int off = (kh * PC + kw) * C + c, k = (kh * KW + kw) * C + c;
        float x[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = patch[base[i] + off];
#pragma unroll
        for (int v = 0; v < FMA_V; ++v) {
          const float4 w4 = *reinterpret_cast<const float4*>(wt + k * NB + 16 * v + 4 * cg);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[i][v][0] += x[i] * w4.x;
            acc[i][v][1] += x[i] * w4.y;
            acc[i][v][2] += x[i] * w4.z;
            acc[i][v][3] += x[i] * w4.w;
          }
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int px = pg + 32 * i, oh = oh0 + px / TW, ow = ow0 + px % TW;
    if (oh >= p.out_h || ow >= p.out_w) continue;
    T* row = out + (((long long)img * p.out_h + oh) * p.out_w + ow) * p.cout;
#pragma unroll
    for (int v = 0; v < FMA_V; ++v) {
      const int co = n0 + 16 * v + 4 * cg;
      if (p.cout % 4 == 0 && co + 4 <= p.cout) {
        kiln_store_vec<4>(row, co, acc[i][v]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (co + e < p.cout) row[co + e] = kiln_from_float<T>(acc[i][v][e]);
      }
    }
  }
}

// --- backward-weight ------------------------------------------------------------------------

// Tensor cores: C = cotangent^T (NB x pixels) x patch (pixels x k), k = (kh, kw, c) as the
// forward's weight rows lay it out; a k step of 16 is one row of the tile. Warp w takes the
// n tiles (8 k indices each) w, w + 4, ..., all NB / 16 m tiles.
constexpr int WG_MT = NB / 16;
constexpr int WG_NTT = KH * KWP / 2;
constexpr int WG_NTW = (WG_NTT + 3) / 4;

// FMA: thread t sums channels 4 (t % 8) + 32 j + 0..3 (j < NB / 32) for k indices t / 8 + 16 v.
constexpr int WG_FMA_J = NB / 32;
constexpr int WG_FMA_V = (KK + 15) / 16;


__device__ __forceinline__ void kiln_wgrad_tensor(const unsigned short* p16, const T* dys,
                                                  float (&acc)[WG_MT][WG_NTW][4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, q = lane % 4, r = lane / 4;
  // This thread's B elements: pixel columns 2q, 2q + 1, 2q + 8, 2q + 9 of each row; k index
  // 8 nt + r, which is tap 2 nt + r / 4, channel r % 4.
  int col[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) col[e] = (2 * q + (e % 2) + 8 * (e / 2)) * SW * 4;
  int koff[WG_NTW];
#pragma unroll
  for (int u = 0; u < WG_NTW; ++u) {
    const int tap = 2 * (warp + 4 * u) + r / 4;
    koff[u] = ((tap / KWP) * PC + tap % KWP) * 4 + r % 4;
  }
#pragma unroll
  for (int i = 0; i < TH; ++i) {
    unsigned a[WG_MT][4];
#pragma unroll
    for (int mt = 0; mt < WG_MT; ++mt)
      kiln_ldmatrix_x4<true>(
          a[mt], dys + (16 * i + 8 * (lane / 16) + lane % 8) * DY_LD + 16 * mt + 8 * ((lane / 8) % 2));
    const int row = i * SH * PC * 4;
#pragma unroll
    for (int u = 0; u < WG_NTW; ++u) {
      if (WG_NTT % 4 != 0 && warp + 4 * u >= WG_NTT) continue;
      const unsigned short* at = p16 + row + koff[u];
      const unsigned b0 = (unsigned)at[col[0]] | ((unsigned)at[col[1]] << 16);
      const unsigned b1 = (unsigned)at[col[2]] | ((unsigned)at[col[3]] << 16);
#pragma unroll
      for (int mt = 0; mt < WG_MT; ++mt) kiln_mma<T>::run(acc[mt][u], a[mt], b0, b1);
    }
  }
}

__device__ __forceinline__ void kiln_wgrad_fma(const float* patch, const float* dys,
                                               float (&acc)[WG_FMA_V][WG_FMA_J][4]) {
  const int cg = threadIdx.x % 8, kg = threadIdx.x / 8;
  int koff[WG_FMA_V];
#pragma unroll
  for (int v = 0; v < WG_FMA_V; ++v) {
    const int k = min(kg + 16 * v, KK - 1);  // past KK: any valid offset, never stored
    const int c = k % C, kw = (k / C) % KW, kh = k / (C * KW);
    koff[v] = (kh * PC + kw) * C + c;
  }
#pragma unroll 1
  for (int i = 0; i < TH; ++i) {
#pragma unroll 4
    for (int j = 0; j < TW; ++j) {
      const int px = i * TW + j;
      const float* at = patch + (i * SH * PC + j * SW) * C;
      float4 d[WG_FMA_J];
#pragma unroll
      for (int jj = 0; jj < WG_FMA_J; ++jj)
        d[jj] = *reinterpret_cast<const float4*>(dys + px * DY_LD + 32 * jj + 4 * cg);
#pragma unroll
      for (int v = 0; v < WG_FMA_V; ++v) {
        const float x = at[koff[v]];
#pragma unroll
        for (int jj = 0; jj < WG_FMA_J; ++jj) {
          acc[v][jj][0] += x * d[jj].x;
          acc[v][jj][1] += x * d[jj].y;
          acc[v][jj][2] += x * d[jj].z;
          acc[v][jj][3] += x * d[jj].w;
        }
      }
    }
  }
}

// Writes the block's sums: f32 partials (split `split` of the weight's shape), or the weight
// gradient itself when the block is the only split.
__device__ __forceinline__ void kiln_wgrad_put(T* __restrict__ out, float* __restrict__ partial,
                                               const kiln_stem& p, int split, int co, int kh,
                                               int kw, int c, float v) {
  if (co >= p.cout || kh >= KH || kw >= KW || c >= C) return;
  const long long at = kiln_weight_index(p, co, kh, kw, c);
  if (partial)
    partial[(long long)split * p.cout * KK + at] = v;
  else
    out[at] = kiln_from_float<T>(v);
}

__device__ __forceinline__ void kiln_wgrad_store_tensor(T* __restrict__ out,
                                                        float* __restrict__ partial,
                                                        const kiln_stem& p, int n0,
                                                        const float (&acc)[WG_MT][WG_NTW][4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, q = lane % 4, r = lane / 4;
#pragma unroll
  for (int mt = 0; mt < WG_MT; ++mt)
#pragma unroll
    for (int u = 0; u < WG_NTW; ++u) {
      const int nt = warp + 4 * u;
      if (nt >= WG_NTT) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // C's element e: row r (+8 for e >= 2), column 2q (+1 for odd e) of the tile.
        const int co = n0 + 16 * mt + r + 8 * (e / 2), k = 8 * nt + 2 * q + e % 2;
        const int tap = k / 4;
        kiln_wgrad_put(out, partial, p, blockIdx.x, co, tap / KWP, tap % KWP, k % 4, acc[mt][u][e]);
      }
    }
}

__device__ __forceinline__ void kiln_wgrad_store_fma(T* __restrict__ out,
                                                     float* __restrict__ partial,
                                                     const kiln_stem& p, int n0,
                                                     const float (&acc)[WG_FMA_V][WG_FMA_J][4]) {
  const int cg = threadIdx.x % 8, kg = threadIdx.x / 8;
#pragma unroll
  for (int v = 0; v < WG_FMA_V; ++v) {
    const int k = kg + 16 * v;
    if (k >= KK) continue;
    const int c = k % C, kw = (k / C) % KW, kh = k / (C * KW);
#pragma unroll
    for (int jj = 0; jj < WG_FMA_J; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        kiln_wgrad_put(out, partial, p, blockIdx.x, n0 + 32 * jj + 4 * cg + e, kh, kw, c,
                       acc[v][jj][e]);
  }
}

// --- backward-data --------------------------------------------------------------------------

// A block computes BD_ROWS x BD_COLS pixels of every stride phase: an input tile of BD_TH x BD_TW
// (tiles_h x tiles_w of them an image). Warp w takes phase rows w + 4 r (r < BD_PX), lane l
// phase column l: BD_PX pixels a thread share each weight read (two, unless the phases are many
// and their accumulators would not fit).
constexpr int BD_PX = SH * SW <= 4 ? 2 : 1;
constexpr int BD_ROWS = 4 * BD_PX, BD_COLS = 32;
constexpr int BD_TH = BD_ROWS * SH, BD_TW = BD_COLS * SW;
constexpr int BD_CO = 16;  // cotangent channels a stage
// The cotangent rows and columns a tile reads, from floor((origin + pad - (K - 1)) / S) on;
// columns padded to an odd count so that staging stores (stride BD_DCP) miss each other's banks.
constexpr int BD_DR = (BD_TH + KH - 2) / SH + 2, BD_DC = (BD_TW + KW - 2) / SW + 2;
constexpr int BD_DCP = BD_DC | 1;
constexpr int BD_DY_BYTES = BD_DR * BD_CO * BD_DCP * 4;
constexpr int BD_W_BYTES = KH * KW * BD_CO * 16;

// The tap (kh * KW + kw) at which backward-data applies the weight's stored tap `tap`: turned
// round when the convolution flips the kernel.
__device__ __forceinline__ int kiln_stage_tap(const kiln_stem& p, int tap) {
  return p.flip ? KH * KW - 1 - tap : tap;
}

__device__ __forceinline__ int kiln_floor_div(int a, int b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// The block's input tile: its image, first input row and column, and the first cotangent row
// and column its pixels read (floor((origin + pad - (K - 1)) / S)).
struct kiln_bd_tile {
  int img, ih0, iw0, oh_base, ow_base;
};
__device__ __forceinline__ kiln_bd_tile kiln_bd_tile_at(const kiln_stem& p) {
  const int t = blockIdx.x;
  const int ih0 = (t / p.tiles_w) % p.tiles_h * BD_TH, iw0 = t % p.tiles_w * BD_TW;
  return {t / (p.tiles_h * p.tiles_w), ih0, iw0, kiln_floor_div(ih0 + p.pad_h - (KH - 1), SH),
          kiln_floor_div(iw0 + p.pad_w - (KW - 1), SW)};
}

__device__ __forceinline__ void kiln_backward_data(const T* __restrict__ dy,
                                                   const T* __restrict__ w, T* __restrict__ dx,
                                                   unsigned char* smem, const kiln_stem& p) {
  float* dys = reinterpret_cast<float*>(smem);                     // [row][channel][column]
  float4* ws = reinterpret_cast<float4*>(smem + BD_DY_BYTES);     // [kh][kw][channel], 4 c
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const kiln_bd_tile at = kiln_bd_tile_at(p);
  const int img = at.img, ih0 = at.ih0, iw0 = at.iw0, oh_base = at.oh_base, ow_base = at.ow_base;
  const long long image = (long long)img * p.out_h;
  float acc[SH * SW][BD_PX][4];
#pragma unroll
  for (int f = 0; f < SH * SW; ++f)
#pragma unroll
    for (int r = 0; r < BD_PX; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[f][r][c] = 0.0f;
  if (C < 4)
    for (int i = threadIdx.x; i < KH * KW * BD_CO; i += THREADS) ws[i] = make_float4(0, 0, 0, 0);
  for (int co0 = 0; co0 < p.cout; co0 += BD_CO) {
    __syncthreads();  // the previous stage's reads are done
    // Channels innermost in the loop, so that the global reads coalesce: 16-byte vectors where
    // the rows allow (p.vec: cout a multiple of 8, aligned arrays), else one value a read.
    if (p.vec) {
      constexpr int V = 16 / (int)sizeof(T), CV = BD_CO / V;  // values a vector, vectors a stage
      for (int i = threadIdx.x; i < BD_DR * BD_DC * CV; i += THREADS) {
        const int ch = i % CV * V, col = (i / CV) % BD_DC, row = i / (CV * BD_DC);
        const int oh = oh_base + row, ow = ow_base + col;
        uint4 raw = make_uint4(0, 0, 0, 0);
        // cout % 8 == 0: a vector is all inside cout or all past it.
        if (oh >= 0 && oh < p.out_h && ow >= 0 && ow < p.out_w && co0 + ch < p.cout)
          raw = *reinterpret_cast<const uint4*>(dy + ((image + oh) * p.out_w + ow) * p.cout +
                                                co0 + ch);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int e = 0; e < V; ++e) dys[(row * BD_CO + ch + e) * BD_DCP + col] = kiln_to_float(v[e]);
      }
    } else {
      for (int i = threadIdx.x; i < BD_DR * BD_DC * BD_CO; i += THREADS) {
        const int co = i % BD_CO, col = (i / BD_CO) % BD_DC, row = i / (BD_CO * BD_DC);
        const int oh = oh_base + row, ow = ow_base + col;
        float v = 0.0f;
        if (oh >= 0 && oh < p.out_h && ow >= 0 && ow < p.out_w && co0 + co < p.cout)
          v = kiln_to_float(dy[((image + oh) * p.out_w + ow) * p.cout + co0 + co]);
        dys[(row * BD_CO + co) * BD_DCP + col] = v;
      }
    }
    // The stage's BD_CO weight rows (KK contiguous values each) in order, so that the reads
    // coalesce; channels past C stay as zeroed before the loop.
    float* wf = reinterpret_cast<float*>(ws);
    for (int i = threadIdx.x; i < BD_CO * KK; i += THREADS) {
      const int co = i / KK, k = i % KK;
      const float v = co0 + co < p.cout ? kiln_to_float(w[(long long)(co0 + co) * KK + k]) : 0.0f;
      wf[(kiln_stage_tap(p, k / C) * BD_CO + co) * 4 + k % C] = v;
    }
    __syncthreads();
#pragma unroll
    for (int ph = 0; ph < SH; ++ph) {
#pragma unroll
      for (int pw = 0; pw < SW; ++pw) {
        // Input pixel (ih, iw) is reached by taps kh = (ih + pad) mod S, + S, ... from output
        // (ih + pad - kh) / S: the same taps for the whole warp.
        // Pixel r's cotangent row is 4 rows below pixel r - 1's.
        const int ih = ih0 + ph + SH * warp, iw = iw0 + pw + SW * lane;
        float (&a)[BD_PX][4] = acc[ph * SW + pw];
        for (int kh = (ph + p.pad_h) % SH; kh < KH; kh += SH) {
          const int row = (ih + p.pad_h - kh) / SH - oh_base;
          for (int kw = (pw + p.pad_w) % SW; kw < KW; kw += SW) {
            const float* d = dys + row * BD_CO * BD_DCP + (iw + p.pad_w - kw) / SW - ow_base;
            const float4* wt = ws + (kh * KW + kw) * BD_CO;
#pragma unroll 8
            for (int co = 0; co < BD_CO; ++co) {
              const float4 w4 = wt[co];
#pragma unroll
              for (int r = 0; r < BD_PX; ++r) {
                const float v = d[(4 * r * BD_CO + co) * BD_DCP];
                a[r][0] += v * w4.x;
                a[r][1] += v * w4.y;
                a[r][2] += v * w4.z;
                a[r][3] += v * w4.w;
              }
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int ph = 0; ph < SH; ++ph)
#pragma unroll
    for (int pw = 0; pw < SW; ++pw)
#pragma unroll
      for (int r = 0; r < BD_PX; ++r) {
        const int ih = ih0 + ph + SH * (warp + 4 * r), iw = iw0 + pw + SW * lane;
        if (ih >= p.in_h || iw >= p.in_w) continue;
        T* px = dx + (((long long)img * p.in_h + ih) * p.in_w + iw) * C;
#pragma unroll
        for (int c = 0; c < C; ++c) px[c] = kiln_from_float<T>(acc[ph * SW + pw][r][c]);
      }
}

// Tensor cores (16-bit types, 3 or 4 channels, at most 4 stride phases; with fewer channels
// most of an MMA's 8 columns would be padding): for each tap of a phase, the warp's
// pixels x 8 channels += cotangent (pixels x 16 cout) x weight (16 cout x 8 channels), one
// m16n8k16 a 16-pixel m tile, channels C..7 zero. The stage keeps 16-bit values: the cotangent as
// [row][column][BDT_LD] (16 channels, padded so that an ldmatrix's 8 rows fall in different
// banks; a tile's 16 pixels read 16 consecutive columns), the weight as [tap][channel (8)]
// [BDT_LD]. Warp w takes phase rows w + 4 r (r < BD_PX) of every phase, two m tiles a row.
constexpr bool BD_TENSOR = TENSOR && SH * SW <= 4 && C >= 3;
constexpr int BDT_LD = BD_CO + 8;
constexpr int BDT_DY_BYTES = BD_DR * BD_DC * BDT_LD * 2;

__device__ __forceinline__ void kiln_backward_data_tensor(const T* __restrict__ dy,
                                                          const T* __restrict__ w,
                                                          T* __restrict__ dx, unsigned char* smem,
                                                          const kiln_stem& p) {
  T* dys = reinterpret_cast<T*>(smem);
  T* ws = reinterpret_cast<T*>(smem + BDT_DY_BYTES);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, q = lane % 4, r = lane / 4;
  const kiln_bd_tile at = kiln_bd_tile_at(p);
  const int img = at.img, ih0 = at.ih0, iw0 = at.iw0, oh_base = at.oh_base, ow_base = at.ow_base;
  const long long image = (long long)img * p.out_h;
  float acc[SH * SW][BD_PX][2][4];
#pragma unroll
  for (int f = 0; f < SH * SW; ++f)
#pragma unroll
    for (int rr = 0; rr < BD_PX; ++rr)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[f][rr][mt][e] = 0.0f;
  for (int i = threadIdx.x; i < KH * KW * 8 * BDT_LD; i += THREADS) ws[i] = T{};
  for (int co0 = 0; co0 < p.cout; co0 += BD_CO) {
    __syncthreads();  // the previous stage's reads are done
    if (p.vec) {
      // Two 16-byte vectors a (row, column); cout % 8 == 0, so each is inside cout or past it.
      for (int i = threadIdx.x; i < BD_DR * BD_DC * 2; i += THREADS) {
        const int half = i % 2, col = (i / 2) % BD_DC, row = i / (2 * BD_DC);
        const int oh = oh_base + row, ow = ow_base + col;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (oh >= 0 && oh < p.out_h && ow >= 0 && ow < p.out_w && co0 + 8 * half < p.cout)
          v = *reinterpret_cast<const uint4*>(dy + ((image + oh) * p.out_w + ow) * p.cout + co0 +
                                              8 * half);
        *reinterpret_cast<uint4*>(dys + (row * BD_DC + col) * BDT_LD + 8 * half) = v;
      }
    } else {
      for (int i = threadIdx.x; i < BD_DR * BD_DC * BD_CO; i += THREADS) {
        const int co = i % BD_CO, col = (i / BD_CO) % BD_DC, row = i / (BD_CO * BD_DC);
        const int oh = oh_base + row, ow = ow_base + col;
        T v{};
        if (oh >= 0 && oh < p.out_h && ow >= 0 && ow < p.out_w && co0 + co < p.cout)
          v = dy[((image + oh) * p.out_w + ow) * p.cout + co0 + co];
        dys[(row * BD_DC + col) * BDT_LD + co] = v;
      }
    }
    // As the FMA path stages it: the weight rows in order; channels C..7 stay zero.
    for (int i = threadIdx.x; i < BD_CO * KK; i += THREADS) {
      const int co = i / KK, k = i % KK;
      T v{};
      if (co0 + co < p.cout) v = w[(long long)(co0 + co) * KK + k];
      ws[(kiln_stage_tap(p, k / C) * 8 + k % C) * BDT_LD + co] = v;
    }
    __syncthreads();
#pragma unroll
    for (int ph = 0; ph < SH; ++ph) {
#pragma unroll
      for (int pw = 0; pw < SW; ++pw) {
        float (&a)[BD_PX][2][4] = acc[ph * SW + pw];
        for (int kh = (ph + p.pad_h) % SH; kh < KH; kh += SH) {
          for (int kw = (pw + p.pad_w) % SW; kw < KW; kw += SW) {
            // B: channel r, cout pairs 2q and 2q + 8 of the tap.
            const unsigned* wt =
                reinterpret_cast<const unsigned*>(ws + ((kh * KW + kw) * 8 + r) * BDT_LD) + q;
            const unsigned b0 = wt[0], b1 = wt[4];
            // The cotangent column phase column 0 reads at this tap (exact: the tap is the
            // phase's).
            const int col0 = (iw0 + pw + p.pad_w - kw) / SW - ow_base;
#pragma unroll
            for (int rr = 0; rr < BD_PX; ++rr) {
              const int row = (ih0 + ph + SH * (warp + 4 * rr) + p.pad_h - kh) / SH - oh_base;
#pragma unroll
              for (int mt = 0; mt < 2; ++mt) {
                unsigned af[4];
                kiln_ldmatrix_x4<false>(
                    af, dys + (row * BD_DC + col0 + 16 * mt + lane % 16) * BDT_LD + 8 * (lane / 16));
                kiln_mma<T>::run(a[rr][mt], af, b0, b1);
              }
            }
          }
        }
      }
    }
  }
  // C's element e: pixel r (+8 for e >= 2) of the m tile, channel 2q (+1 for odd e).
#pragma unroll
  for (int ph = 0; ph < SH; ++ph)
#pragma unroll
    for (int pw = 0; pw < SW; ++pw)
#pragma unroll
      for (int rr = 0; rr < BD_PX; ++rr)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = 2 * q + e % 2, j = 16 * mt + r + 8 * (e / 2);
            const int ih = ih0 + ph + SH * (warp + 4 * rr), iw = iw0 + pw + SW * j;
            if (c >= C || ih >= p.in_h || iw >= p.in_w) continue;
            dx[(((long long)img * p.in_h + ih) * p.in_w + iw) * C + c] =
                kiln_from_float<T>(acc[ph * SW + pw][rr][mt][e]);
          }
}

// --- the kernel -----------------------------------------------------------------------------

// Output tile t of the forward and backward-weight: its image and first output row and column.
struct kiln_tile {
  int img, oh0, ow0;
};
__device__ __forceinline__ kiln_tile kiln_tile_at(const kiln_stem& p, int t) {
  return {t / (p.tiles_h * p.tiles_w), (t / p.tiles_w) % p.tiles_h * TH, t % p.tiles_w * TW};
}

// Forward: (input, weight); backward-weight: (input, cotangent).
// Walks the block's tiles: stages each one (`stage`) and multiplies it (`step`).
template <typename Stage, typename Step>
__device__ __forceinline__ void kiln_tiles(const kiln_stem& p, Stage stage, Step step) {
  const int tiles = p.batch * p.tiles_h * p.tiles_w;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const kiln_tile at = kiln_tile_at(p, t);
    __syncthreads();  // the previous tile's reads of shared memory are done
    stage(at.img, at.oh0, at.ow0);
    __syncthreads();
    step(at.img, at.oh0, at.ow0);
  }
}

// The tiles again, with the patch loaded into registers a tile ahead (tensor-core forward): the
// next tile's loads are in flight while this one is multiplied and stored.
template <typename Step>
__device__ __forceinline__ void kiln_tiles_ahead(const kiln_stem& p, const T* __restrict__ x,
                                                 PT* patch, Step step) {
  const int tiles = p.batch * p.tiles_h * p.tiles_w;
  auto load = [&](kiln_patch_regs& r, int t) {
    const kiln_tile at = kiln_tile_at(p, t);
    kiln_load_patch(r, x, p, at.img, at.oh0, at.ow0);
  };
  kiln_patch_regs ahead;
  if (blockIdx.x < tiles) load(ahead, blockIdx.x);
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    __syncthreads();  // the previous tile's reads of shared memory are done
    kiln_put_patch(patch, ahead);
    __syncthreads();
    if (t + gridDim.x < tiles) load(ahead, t + gridDim.x);
    const kiln_tile at = kiln_tile_at(p, t);
    step(at.img, at.oh0, at.ow0);
  }
}

// Backward-weight's cotangent tile (tensor cores, 16-byte rows: p.vec) copied into `d` by
// cp.async, committed as one group.
__device__ __forceinline__ void kiln_copy_cotangent_async(T* d, const T* __restrict__ dy,
                                                          const kiln_stem& p, int img, int oh0,
                                                          int ow0, int n0) {
  const long long image = (long long)img * p.out_h;
#pragma unroll
  for (int i = threadIdx.x; i < PIXELS * (NB / 8); i += THREADS) {
    const int px = i / (NB / 8), ch = (i % (NB / 8)) * 8;
    const int oh = oh0 + px / TW, ow = ow0 + px % TW;
    const bool real = oh < p.out_h && ow < p.out_w && n0 + ch < p.cout;
    const T* from = real ? dy + ((image + oh) * p.out_w + ow) * p.cout + n0 + ch : dy;
    kiln_cp_async<16, false>(d + px * DY_LD + ch, from, real);
  }
  kiln_cp_async_commit();
}

// Backward-weight's tiles on tensor cores with 16-byte cotangent rows: while a tile is
// multiplied, the next one's cotangent is copied into the other of two buffers (`dys`, DY_BYTES
// apart) and its patch loaded into registers. `step(d)` multiplies the tile whose cotangent is
// at d.
template <typename Step>
__device__ __forceinline__ void kiln_wgrad_tiles_ahead(const kiln_stem& p, const T* __restrict__ x,
                                                       const T* __restrict__ dy, PT* patch,
                                                       unsigned char* dys, int n0, Step step) {
  const int tiles = p.batch * p.tiles_h * p.tiles_w;
  auto buffer = [&](int b) { return reinterpret_cast<T*>(dys + b * DY_BYTES); };
  auto fetch = [&](kiln_patch_regs& r, int t, int b) {
    const kiln_tile at = kiln_tile_at(p, t);
    kiln_load_patch(r, x, p, at.img, at.oh0, at.ow0);
    kiln_copy_cotangent_async(buffer(b), dy, p, at.img, at.oh0, at.ow0, n0);
  };
  kiln_patch_regs ahead;
  if (blockIdx.x < tiles) fetch(ahead, blockIdx.x, 0);
  int b = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x, b ^= 1) {
    kiln_cp_async_wait<0>();  // this thread's copies of the tile have landed
    __syncthreads();          // everyone's have; the previous tile's reads are done
    kiln_put_patch(patch, ahead);
    __syncthreads();
    if (t + gridDim.x < tiles) fetch(ahead, t + gridDim.x, b ^ 1);
    step(buffer(b));
  }
}

// Forward: (input, weight); backward-data: (cotangent, weight); backward-weight: (input,
// cotangent).
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) {{kernel}}(
    const T* __restrict__ x, const T* __restrict__ other, T* __restrict__ out,
    float* __restrict__ partial, const kiln_stem p) {
  extern __shared__ float4 kiln_w4[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(kiln_w4);
  PT* patch = reinterpret_cast<PT*>(smem);
  unsigned char* second = smem + PATCH_BYTES;
  const int n0 = blockIdx.y * NB;
  if constexpr (PASS == 1) {
    if constexpr (BD_TENSOR)
      kiln_backward_data_tensor(x, other, out, smem, p);
    else
      kiln_backward_data(x, other, out, smem, p);
  } else if constexpr (PASS == 0) {
    kiln_stage_weight(second, other, p, n0);
    auto stage = [&](int img, int oh0, int ow0) { kiln_stage_patch(patch, x, p, img, oh0, ow0); };
    if constexpr (TENSOR) {
      kiln_tiles_ahead(p, x, patch, [&](int img, int oh0, int ow0) {
        float acc[2][FWD_NT][4];
        kiln_forward_tensor(reinterpret_cast<const unsigned*>(patch),
                            reinterpret_cast<const T*>(second), acc);
        kiln_store_forward_tensor(out, reinterpret_cast<T*>(second + WEIGHT_BYTES), p, img, oh0,
                                  ow0, n0, acc);
      });
    } else {
      kiln_tiles(p, stage, [&](int img, int oh0, int ow0) {
        kiln_forward_fma(reinterpret_cast<const float*>(patch),
                         reinterpret_cast<const float*>(second), out, p, img, oh0, ow0, n0);
      });
    }
  } else {
    auto stage = [&](int img, int oh0, int ow0) {
      kiln_stage_patch(patch, x, p, img, oh0, ow0);
      kiln_stage_cotangent(second, other, p, img, oh0, ow0, n0);
    };
    if constexpr (TENSOR) {
      float acc[WG_MT][WG_NTW][4] = {};
      auto step = [&](const T* dys) {
        kiln_wgrad_tensor(reinterpret_cast<const unsigned short*>(patch), dys, acc);
      };
      if (p.vec)
        kiln_wgrad_tiles_ahead(p, x, other, patch, second, n0, step);
      else
        kiln_tiles(p, stage, [&](int, int, int) { step(reinterpret_cast<const T*>(second)); });
      kiln_wgrad_store_tensor(out, partial, p, n0, acc);
    } else {
      float acc[WG_FMA_V][WG_FMA_J][4] = {};
      kiln_tiles(p, stage, [&](int, int, int) {
        kiln_wgrad_fma(reinterpret_cast<const float*>(patch),
                       reinterpret_cast<const float*>(second), acc);
      });
      kiln_wgrad_store_fma(out, partial, p, n0, acc);
    }
  }
}
