// Direct convolution for grouped layers with few channels per group (depthwise: one input
// channel per group), channels last: input (batch, d, h, w, cin), weight (cout, kd, kh, kw,
// cg), output (batch, od, oh, ow, cout), cg = cin / groups and mg = cout / groups. Such a layer
// is a stencil, not a GEMM: each output reads cg channels per tap, so it is bound by memory (and
// for large kernels by the FMA units), and this family reads each operand straight from global
// memory (through L1) with the channel axis, contiguous in this layout, in vectors.
//
// Forward and backward-data are one gather: out[n, P, oc] = sum over taps t and the R source
// channels r of oc's group of src[n, Q(P, t), group * R + r] * w(oc, r, t), where along each
// spatial dim the source position is Q = (P * step + t * tap_step + offset) / divisor when that
// divides and lies in the source:
//   PASS 0 forward:       src = input, out = output; step = stride, tap_step = kernel dilation,
//                         offset = -pad, divisor = input dilation.
//   PASS 1 backward-data: src = cotangent, out = input gradient, taps counted backwards; step =
//                         input dilation, tap_step = kernel dilation, offset = pad - (k - 1) *
//                         dilation, divisor = stride.
// A thread computes NO consecutive output channels at OT consecutive positions along w, walking
// `rows` consecutive rows so that the rows its taps share stay in L1. Where step, tap_step and
// divisor are 1 along w (`window`), the sources of OT positions and KT taps are one window of
// OT + KT - 1 positions, each loaded once.
// PASS 2 backward-weight: dw[oc, t, r] = sum over n, P of dy[n, P, oc] * x[n, Q(P, t), ...],
// forward's Q. A thread holds NO cotangent channels x one row of KT taps along w, summing over
// the output positions of its split; the lanes of a block are summed in a fixed order, and
// splits write f32 partials that reduce_cols.cu adds up, so the result is deterministic.
// The weights (forward, backward-data) are staged once per block in shared memory as f32, in
// the order the taps are walked.
{{> prelude}}

typedef {{dtype}} T;
constexpr int PASS = {{PASS}};
constexpr int CG = {{CG}}, MG = {{MG}};
constexpr int NO = {{NO}}, OT = {{OT}}, KT = {{KT}};
constexpr int THREADS = {{block_dim}};
constexpr int MIN_BLOCKS = {{MIN_BLOCKS}};  // blocks an SM must hold (the launch bound)

// The gather's outputs per group and the source channels each output reads. Backward-weight
// walks the forward's roles, its "outputs" being the cotangent channels.
constexpr int OPG = PASS == 1 ? CG : MG;
constexpr int R = PASS == 1 ? MG : CG;
// Source channels a thread reads: the R of each group its NO outputs belong to.
constexpr int NS = NO >= OPG ? NO / OPG * R : R;
static_assert(NO % OPG == 0 || OPG % NO == 0, "a thread's outputs are whole groups or one group's");
// Loads of at most 16 bytes: VS source elements each.
constexpr int VS = (NS * (int)sizeof(T)) % 16 == 0 ? 16 / (int)sizeof(T)
                   : (NS * (int)sizeof(T)) % 8 == 0 ? 8 / (int)sizeof(T)
                   : (NS * (int)sizeof(T)) % 4 == 0 && sizeof(T) <= 4 ? 4 / (int)sizeof(T) : 1;
constexpr int VO = (NO * (int)sizeof(T)) % 16 == 0 ? 16 / (int)sizeof(T)
                   : (NO * (int)sizeof(T)) % 8 == 0 ? 8 / (int)sizeof(T)
                   : (NO * (int)sizeof(T)) % 4 == 0 && sizeof(T) <= 4 ? 4 / (int)sizeof(T) : 1;

// Mirrors ops::conv::direct::Problem (repr(C)).
struct kiln_direct {
  int batch;
  int out[3];       // positions of the gather's output (backward-weight: the cotangent's)
  int src[3];       // positions of the source (backward-weight: the input's)
  int ks[3];        // kernel extents
  int step[3], tap_step[3], offset[3], divisor[3];
  int out_c, src_c; // channels per position of the output and of the source
  int ksize;
  int reverse;      // the weight's tap is ksize - 1 - t
  int window;       // step, tap_step and divisor are 1 along w
  int slots;        // out_c / NO
  int strips;       // strips of OT positions along w: ceil(out[2] / OT)
  int rows;         // rows a task walks (forward, backward-data)
  int row_chunks;   // ceil(out[1] / rows)
  int tasks;        // forward, backward-data: batch * out[0] * row_chunks * strips;
                    // backward-weight: batch * out[0] * out[1] * strips
  int tap_groups;   // backward-weight: ks[0] * ks[1] * ceil(ks[2] / KT)
  int tasks_per_split;
};

// The source position along dim d of output position P and tap t, or -1 where there is none.
__device__ __forceinline__ int kiln_source(const kiln_direct& p, int d, int P, int t) {
  const int num = P * p.step[d] + t * p.tap_step[d] + p.offset[d];
  if (p.divisor[d] == 1) return num >= 0 && num < p.src[d] ? num : -1;  // no division
  if (num < 0) return -1;
  const int q = num / p.divisor[d];
  return q * p.divisor[d] == num && q < p.src[d] ? q : -1;
}

// Loads NS source channels starting at channel c of position `pos` (an element index of its
// first channel), as floats; zeros where `valid` is false.
__device__ __forceinline__ void kiln_load_source(const T* __restrict__ src, long long at, bool valid,
                                                 float (&v)[NS]) {
  if (!valid) {
#pragma unroll
    for (int i = 0; i < NS; ++i) v[i] = 0.0f;
    return;
  }
#pragma unroll
  for (int i = 0; i < NS; i += VS) {
    const kiln_vec<T, VS> x = *reinterpret_cast<const kiln_vec<T, VS>*>(src + at + i);
#pragma unroll
    for (int k = 0; k < VS; ++k) v[i + k] = kiln_to_float(x.v[k]);
  }
}

// Source channel r of output o (both counted within the thread's).
__device__ __forceinline__ constexpr int kiln_src_index(int o, int r) {
  return NO >= OPG ? (o / OPG) * R + r : r;
}

// The weight element that output channel oc takes from its source channel r at weight tap tw.
__device__ __forceinline__ long long kiln_weight_at(int oc, int r, int tw, int ksize) {
  if (PASS == 1) {
    // oc is an input channel (group g, channel ci of it); r one of the group's output channels.
    const int g = oc / CG, ci = oc - g * CG;
    return ((long long)(g * MG + r) * ksize + tw) * CG + ci;
  }
  return ((long long)oc * ksize + tw) * CG + r;
}

// acc[o] += the products of output o's sources in s with its weights in w.
__device__ __forceinline__ void kiln_fma(float (&acc)[NO], const float (&s)[NS],
                                         const float (&w)[4 * ((NO * R + 3) / 4)]) {
#pragma unroll
  for (int o = 0; o < NO; ++o)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[o] += s[kiln_src_index(o, r)] * w[o * R + r];
}

// The weights of one tap for this thread's outputs, from the block's staged [tap][chunk][slot]
// float4s (`ws` at the tap and the thread's slot).
__device__ __forceinline__ void kiln_tap_weights(const float4* ws, int sb,
                                                 float (&wv)[4 * ((NO * R + 3) / 4)]) {
#pragma unroll
  for (int c = 0; c < (NO * R + 3) / 4; ++c) {
    const float4 q = ws[c * sb];
    wv[4 * c] = q.x, wv[4 * c + 1] = q.y, wv[4 * c + 2] = q.z, wv[4 * c + 3] = q.w;
  }
}

#if {{PASS}} != 2  // a preprocessor test: PASS above is a C++ constant
// The weights of tap tw for the thread's NO outputs as floats, [o][r], zero-padded to whole
// float4s. Read in vectors of WV elements along the axis that is contiguous in memory (forward:
// a group's channels r; backward-data, r being the weight's output channel: a group's channels
// o): one load per element made the grouped shapes' staging a large part of their compile time.
constexpr int WRUN = PASS == 1 ? (NO < CG ? NO : CG) : R;  // a run of them next to each other
constexpr int WV = WRUN * (int)sizeof(T) > 16 ? 16 / (int)sizeof(T) : WRUN;
__device__ __forceinline__ void kiln_slot_weights(const T* __restrict__ weight, int oc0, int tw,
                                                  int ksize, float (&v)[4 * ((NO * R + 3) / 4)]) {
#pragma unroll
  for (int i = NO * R; i < 4 * ((NO * R + 3) / 4); ++i) v[i] = 0.0f;
#pragma unroll
  for (int a = 0; a < NO * R; a += WV) {
    // (o, r) counted r first (forward) or o first (backward-data): a run of WV is contiguous.
    const int o = PASS == 1 ? a % NO : a / R, r = PASS == 1 ? a / NO : a % R;
    const kiln_vec<T, WV> x =
        *reinterpret_cast<const kiln_vec<T, WV>*>(weight + kiln_weight_at(oc0 + o, r, tw, ksize));
#pragma unroll
    for (int k = 0; k < WV; ++k)
      v[PASS == 1 ? (o + k) * R + r : o * R + r + k] = kiln_to_float(x.v[k]);
  }
}

// Depthwise forward/backward-data along one source row: OT + KT - 1 window positions from
// element `at` (position `first`, channel sc0) on, each loaded once and meeting output j at tap
// i - j, with the KT taps' weights in `wv`. CHECKED: the window may leave the row (positions
// outside read as zeros) or the kernel may end before KT taps (`kleft`); unchecked, neither,
// and the loop carries no tests.
template <bool CHECKED>
__device__ __forceinline__ void kiln_depthwise_row(float (&acc)[OT][NO], const T* __restrict__ src,
                                                   long long at, int stride, int first, int width,
                                                   int kleft,
                                                   const float (&wv)[KT][4 * ((NO * R + 3) / 4)]) {
#pragma unroll
  for (int i = 0; i < OT + KT - 1; ++i) {
    if (CHECKED && i >= OT + kleft - 1) break;
    float s[NS];
    const int sw = first + i;
    kiln_load_source(src, at + (long long)i * stride, !CHECKED || (sw >= 0 && sw < width), s);
#pragma unroll
    for (int j = 0; j < OT; ++j) {
      // Taps past the kernel are skipped, not weighted by zero: 0 * inf is NaN.
      const int kk = i - j;
      if (kk >= 0 && kk < KT && (!CHECKED || kk < kleft)) kiln_fma(acc[j], s, wv[kk]);
    }
  }
}

// Forward and backward-data. Block: (slots, lanes); grid: (slot blocks, task blocks).
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) {{kernel}}(
    const T* __restrict__ src, const T* __restrict__ weight, T* __restrict__ out, float* unused,
    kiln_direct p) {
  extern __shared__ float4 kiln_w4[];
  const int sb = blockDim.x, slot_l = threadIdx.x, lane = threadIdx.y, lanes = blockDim.y;
  const int slot = blockIdx.x * sb + slot_l;
  const int oc0 = slot * NO;
  constexpr int CH = (NO * R + 3) / 4;  // float4s of weights per (tap, slot), zero-padded
  // Stage the thread's slot's weights as [tap][chunk][slot] float4s, taps in walking order,
  // the block's lanes taking every lanes-th tap (each thread reads back only its own slot).
  if (slot < p.slots) {
    for (int t = lane; t < p.ksize; t += lanes) {
      const int tw = p.reverse ? p.ksize - 1 - t : t;
      float v[4 * CH];
      kiln_slot_weights(weight, oc0, tw, p.ksize, v);
#pragma unroll
      for (int c = 0; c < CH; ++c)
        kiln_w4[((size_t)t * CH + c) * sb + slot_l] =
            make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
    }
  }
  __syncthreads();
  if (slot >= p.slots) return;
  const int sc0 = (oc0 / OPG) * R;
  for (int task = blockIdx.y * lanes + lane; task < p.tasks; task += gridDim.y * lanes) {
    int rest = task;
    const int strip = rest % p.strips;
    rest /= p.strips;
    const int chunk = rest % p.row_chunks;
    rest /= p.row_chunks;
    const int od = rest % p.out[0], n = rest / p.out[0];
    const int ow0 = strip * OT;
    const int oh_end = min(p.out[1], (chunk + 1) * p.rows);
    for (int oh = chunk * p.rows; oh < oh_end; ++oh) {
      float acc[OT][NO];
#pragma unroll
      for (int j = 0; j < OT; ++j)
#pragma unroll
        for (int o = 0; o < NO; ++o) acc[j][o] = 0.0f;
      for (int td = 0; td < p.ks[0]; ++td) {
        const int sd = kiln_source(p, 0, od, td);
        if (sd < 0) continue;
        for (int th = 0; th < p.ks[1]; ++th) {
          const int sh = kiln_source(p, 1, oh, th);
          if (sh < 0) continue;
          const long long row = (((long long)n * p.src[0] + sd) * p.src[1] + sh) * p.src[2];
          const int trow = (td * p.ks[1] + th) * p.ks[2];
          const float4* ws = kiln_w4 + (size_t)trow * CH * sb + slot_l;
          if (p.window) {
            // A window of OT + KT - 1 source positions serves KT taps.
            for (int kw0 = 0; kw0 < p.ks[2]; kw0 += KT) {
              const int kleft = min(KT, p.ks[2] - kw0);
              const int first = ow0 + kw0 + p.offset[2];
              if constexpr (CG == 1) {
                float wv[KT][4 * CH];
#pragma unroll
                for (int kk = 0; kk < KT; ++kk)
                  if (kk < kleft) kiln_tap_weights(ws + (size_t)(kw0 + kk) * CH * sb, sb, wv[kk]);
                const long long at = (row + first) * p.src_c + sc0;
                if (kleft == KT && first >= 0 && first + OT + KT - 1 <= p.src[2])
                  kiln_depthwise_row<false>(acc, src, at, p.src_c, first, p.src[2], kleft, wv);
                else
                  kiln_depthwise_row<true>(acc, src, at, p.src_c, first, p.src[2], kleft, wv);
              } else {
                // Grouped: the window in registers, one tap's (larger) weights at a time.
                constexpr int WIN = OT + KT - 1;
                float win[WIN][NS];
#pragma unroll
                for (int i = 0; i < WIN; ++i) {
                  const int sw = first + i;
                  const bool used = i < OT + kleft - 1;
                  kiln_load_source(src, (row + sw) * p.src_c + sc0,
                                   used && sw >= 0 && sw < p.src[2], win[i]);
                }
#pragma unroll
                for (int kk = 0; kk < KT; ++kk) {
                  if (kk >= kleft) break;
                  float wv[4 * CH];
                  kiln_tap_weights(ws + (size_t)(kw0 + kk) * CH * sb, sb, wv);
#pragma unroll
                  for (int j = 0; j < OT; ++j) kiln_fma(acc[j], win[j + kk], wv);
                }
              }
            }
          } else {
            // One source per (position, tap); the taps stay a loop (nothing is indexed by them
            // in registers), which keeps the kernel small to compile.
#pragma unroll 1
            for (int kw = 0; kw < p.ks[2]; ++kw) {
              float wv[4 * CH];
              kiln_tap_weights(ws + (size_t)kw * CH * sb, sb, wv);
#pragma unroll
              for (int j = 0; j < OT; ++j) {
                float one[NS];
                const int sw = kiln_source(p, 2, ow0 + j, kw);
                kiln_load_source(src, (row + sw) * p.src_c + sc0, sw >= 0 && ow0 + j < p.out[2],
                                 one);
                kiln_fma(acc[j], one, wv);
              }
            }
          }
        }
      }
      const long long base = (((long long)n * p.out[0] + od) * p.out[1] + oh) * p.out[2];
#pragma unroll
      for (int j = 0; j < OT; ++j) {
        if (ow0 + j >= p.out[2]) break;
        T* dst = out + (base + ow0 + j) * p.out_c + oc0;
#pragma unroll
        for (int o = 0; o < NO; o += VO) {
          float v[VO];
#pragma unroll
          for (int k = 0; k < VO; ++k) v[k] = acc[j][o + k];
          kiln_store_vec<VO>(dst, o, v);
        }
      }
    }
  }
}
#else
// Loads the NO cotangent channels at element `at` as floats; zeros where `valid` is false.
__device__ __forceinline__ void kiln_load_dy(const T* __restrict__ dy, long long at, bool valid,
                                             float (&g)[NO]) {
#pragma unroll
  for (int o = 0; o < NO; o += VO) {
    if (valid) {
      const kiln_vec<T, VO> x = *reinterpret_cast<const kiln_vec<T, VO>*>(dy + at + o);
#pragma unroll
      for (int k = 0; k < VO; ++k) g[o + k] = kiln_to_float(x.v[k]);
    } else {
#pragma unroll
      for (int k = 0; k < VO; ++k) g[o + k] = 0.0f;
    }
  }
}

// Backward-weight. Block: (slots, tap groups, lanes); grid: (slot blocks x tap-group blocks,
// splits). `src` is the input, `dy` the cotangent; `out` the weight gradient, or with splits
// the f32 partials, one weight's worth per split.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) {{kernel}}(
    const T* __restrict__ src, const T* __restrict__ dy, T* __restrict__ out,
    float* __restrict__ partial, kiln_direct p) {
  extern __shared__ float4 kiln_w4[];
  float* sum = reinterpret_cast<float*>(kiln_w4);
  const int sb = blockDim.x, tgb = blockDim.y, lanes = blockDim.z;
  const int slot_blocks = (p.slots + sb - 1) / sb;
  const int slot = (blockIdx.x % slot_blocks) * sb + threadIdx.x;
  const int group = (blockIdx.x / slot_blocks) * tgb + threadIdx.y;
  const int lane = threadIdx.z;
  const bool mine = slot < p.slots && group < p.tap_groups;
  const int kw_chunks = (p.ks[2] + KT - 1) / KT;
  const int kw0 = (group % kw_chunks) * KT, th = (group / kw_chunks) % p.ks[1],
            td = group / (kw_chunks * p.ks[1]);
  const int oc0 = slot * NO, sc0 = (oc0 / OPG) * R;
  float acc[KT][NO][R];
#pragma unroll
  for (int k = 0; k < KT; ++k)
#pragma unroll
    for (int o = 0; o < NO; ++o)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[k][o][r] = 0.0f;
  if (mine) {
    const int first = blockIdx.y * p.tasks_per_split;
    const int last = min(p.tasks, first + p.tasks_per_split);
    for (int task = first + lane; task < last; task += lanes) {
      int rest = task;
      const int strip = rest % p.strips;
      rest /= p.strips;
      const int oh = rest % p.out[1];
      rest /= p.out[1];
      const int od = rest % p.out[0], n = rest / p.out[0];
      const int sd = kiln_source(p, 0, od, td), sh = kiln_source(p, 1, oh, th);
      if (sd < 0 || sh < 0) continue;
      const int ow0 = strip * OT;
      const long long row = (((long long)n * p.src[0] + sd) * p.src[1] + sh) * p.src[2];
      const long long dyrow = (((long long)n * p.out[0] + od) * p.out[1] + oh) * p.out[2];
      constexpr int WIN = OT + KT - 1;
      if (p.window) {
        float g[OT][NO];
#pragma unroll
        for (int j = 0; j < OT; ++j)
          kiln_load_dy(dy, (dyrow + ow0 + j) * p.out_c + oc0, ow0 + j < p.out[2], g[j]);
        const int w0 = ow0 + kw0 + p.offset[2];
        const int kleft = min(KT, p.ks[2] - kw0);
#pragma unroll
        for (int i = 0; i < WIN; ++i) {
          if (i >= OT + kleft - 1) break;  // past the kernel's last tap
          float s[NS];
          const int sw = w0 + i;
          kiln_load_source(src, (row + sw) * p.src_c + sc0, sw >= 0 && sw < p.src[2], s);
          // Window position i meets output j at tap i - j.
#pragma unroll
          for (int j = 0; j < OT; ++j) {
            const int kk = i - j;
            if (kk < 0 || kk >= KT || kk >= kleft) continue;
#pragma unroll
            for (int o = 0; o < NO; ++o)
#pragma unroll
              for (int r = 0; r < R; ++r) acc[kk][o][r] += g[j][o] * s[kiln_src_index(o, r)];
          }
        }
      } else {
        // One source per (position, tap). The positions stay a loop (acc is indexed by tap, so
        // the taps are unrolled, but nothing is indexed by position): unrolled KT x OT times,
        // each with kiln_source's division, this branch was most of the kernel's compile time.
#pragma unroll 1
        for (int j = 0; j < OT; ++j) {
          if (ow0 + j >= p.out[2]) break;
          float g[NO];
          kiln_load_dy(dy, (dyrow + ow0 + j) * p.out_c + oc0, true, g);
#pragma unroll
          for (int kk = 0; kk < KT; ++kk) {
            if (kw0 + kk >= p.ks[2]) break;
            float s[NS];
            const int sw = kiln_source(p, 2, ow0 + j, kw0 + kk);
            kiln_load_source(src, (row + sw) * p.src_c + sc0, sw >= 0, s);
#pragma unroll
            for (int o = 0; o < NO; ++o)
#pragma unroll
              for (int r = 0; r < R; ++r) acc[kk][o][r] += g[o] * s[kiln_src_index(o, r)];
          }
        }
      }
    }
  }
  // Sum the lanes in order: lane 0 stores, each next lane adds, one at a time.
  constexpr int PER = KT * NO * R;
  const int cell = (threadIdx.y * sb + threadIdx.x) * PER;
  for (int l = 0; l < lanes; ++l) {
    if (lane == l) {
      // Two loops rather than a test on l an element, which compiles to a branch an element.
      if (l == 0) {
#pragma unroll
        for (int k = 0; k < KT; ++k)
#pragma unroll
          for (int o = 0; o < NO; ++o)
#pragma unroll
            for (int r = 0; r < R; ++r) sum[cell + (k * NO + o) * R + r] = acc[k][o][r];
      } else {
#pragma unroll
        for (int k = 0; k < KT; ++k)
#pragma unroll
          for (int o = 0; o < NO; ++o)
#pragma unroll
            for (int r = 0; r < R; ++r) sum[cell + (k * NO + o) * R + r] += acc[k][o][r];
      }
    }
    __syncthreads();
  }
  if (lane != 0 || !mine) return;
  const long long weights = (long long)p.out_c * p.ksize * CG;
  // Rolled: it runs once a thread, and unrolled, its NO x R stores (each a branch on `partial`)
  // were a large part of the grouped shapes' compile time.
  for (int k = 0; k < KT && kw0 + k < p.ks[2]; ++k) {
    const int t = (td * p.ks[1] + th) * p.ks[2] + kw0 + k;
    const int tw = p.reverse ? p.ksize - 1 - t : t;
#pragma unroll 1
    for (int o = 0; o < NO; ++o) {
#pragma unroll 1
      for (int r = 0; r < R; ++r) {
        const float v = sum[cell + (k * NO + o) * R + r];
        const long long at = ((long long)(oc0 + o) * p.ksize + tw) * CG + r;
        if (partial)
          partial[blockIdx.y * weights + at] = v;
        else
          out[at] = kiln_from_float<T>(v);
      }
    }
  }
}
#endif
