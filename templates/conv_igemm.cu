// Implicit-GEMM convolution, channels last: input (batch, d, h, w, cin), weight
// (cout, kd, kh, kw, cin / groups), output (batch, od, oh, ow, cout). Fewer spatial dims are
// leading extents of 1. Each group is one GEMM, C[m, n] = sum_k A[m, k] * B[k, n], whose A and B
// tiles are gathered from the tensors as they are loaded (no im2col buffer):
//   PASS 0 forward:         m = (batch, out pos), n = out channel, k = (kernel pos, in channel)
//   PASS 1 backward-data:   m = (batch, in pos),  n = in channel,  k = (kernel pos, out channel)
//   PASS 2 backward-weight: m = out channel, n = (kernel pos, in channel), k = (batch, out pos)
// A block computes BM x BN of C, stepping BK along k through STAGES shared-memory buffers.
// TENSOR 1: tensor cores at the type's precision, WM x WN warps, f32 accumulators. 16-bit types
// take mma.sync m16n8k16 (on Turing two m16n8k8). f32 (sm_80 on) is split into a TF32 high part
// and a TF32 remainder, and each product is three TF32 MMAs (high*low + low*high + high*high),
// which keeps about 22 bits of each operand: f32 accuracy, where one TF32 MMA keeps 11.
// TENSOR 2: f32 as one TF32 MMA per product (the KILN_ALLOW_TF32 opt-in). TENSOR 0: the FMA
// units, each thread a square tile: f32, and 16-bit types where the GPU has no tensor cores for
// them (bf16 before sm_80, everything before sm_75), widened to f32 as they leave shared memory. Before sm_80 there is no cp.async:
// operands go through registers (fetched a tile ahead, stored after the tile's math). Backward-weight may split k over blocks
// (blockIdx.z), writing f32 partial sums that reduce_cols.cu adds up. Strided backward-data
// without dilation runs one GEMM per stride phase (blockIdx.z too): input pixels whose position
// plus padding is congruent to the phase modulo the stride are reached only by the kernel taps
// congruent to it, so no block gathers taps that can only read zeros.
// TAP_TILES (forward and backward-data, when the channels per group are a multiple of BK): every
// k tile lies within one kernel tap, so a tile's k indices mean one tap and a first channel for
// the whole block. Then no k table is built, and a row of A is bounds-checked once per tile
// instead of once per vector. Tiles then run through the taps first and the channels second, so
// that consecutive tiles of A read neighbouring pixels, which its loads keep in L1.
// Backward-weight needs no table either: k is (batch, output position), which each thread keeps
// decoded for its first row of B and steps by adding digits (kiln_out_cursor).
{{> prelude}}
{{> mma}}

typedef {{dtype}} T;
constexpr int PASS = {{PASS}};
constexpr int BM = {{BM}}, BN = {{BN}}, WM = {{WM}}, WN = {{WN}}, STAGES = {{STAGES}};
constexpr int VEC_A = {{VEC_A}}, VEC_B = {{VEC_B}};
constexpr bool TAP_TILES = {{TAP_TILES}} != 0;
constexpr int THREADS = {{block_dim}};
constexpr bool TENSOR = {{TENSOR}} != 0;
constexpr bool TF32 = TENSOR && sizeof(T) == 4;            // f32 on tensor cores
constexpr int TF32_PRODUCTS = {{TENSOR}} == 2 ? 1 : 3;     // per product, when TF32
static_assert({{TENSOR}} != 2 || TF32, "one TF32 product is an f32 choice");
template <typename U> struct kiln_is_f16 { static constexpr bool value = false; };
template <> struct kiln_is_f16<kiln_f16> { static constexpr bool value = true; };
static_assert(!TENSOR || KILN_ARCH >= 800 || (KILN_ARCH >= 750 && kiln_is_f16<T>::value),
              "tensor cores: f16 from sm_75, bf16 and TF32 from sm_80");
// A k step is 64 bytes of each row on tensor cores (32 16-bit elements, 16 f32). FMA
// backward-weight steps 16: with vector loads both operands go by cp.async, so the longer step
// holds no tile in registers.
constexpr int BK = TENSOR ? 64 / (int)sizeof(T) : (PASS == 2 ? 16 : 8);
// Elements in 16 bytes: a vector, the padding of a k-contiguous row, an ldmatrix row.
constexpr int E16 = 16 / (int)sizeof(T);

// Mirrors ops::conv::Problem (repr(C)).
struct kiln_conv {
  int batch;
  int in[3], out[3], ks[3];
  int stride[3], pad[3], kdil[3], idil[3];
  int cin, cout, cin_g, cout_g, ksize;  // ksize = ks[0] * ks[1] * ks[2]
  int flip;
  int m, n, k;                          // GEMM extents, per group
  int k_tiles_per_split;
  int pair_store;                       // outputs (n, n + 1) are adjacent and 2-aligned
  int phases;                           // backward-data stride phases (1: not phased)
  // q / stride[d] and q / idil[d] as __umulhi(q, magic) >> shift (see kiln_div_by).
  unsigned stride_magic[3], stride_shift[3], idil_magic[3], idil_shift[3];
};

// q / d for 0 <= q < 2^31, by the (magic, shift) the host computed for d > 1: a multiply-high
// and a shift, where an integer division is a sequence of some twenty instructions (the gathers
// below would unroll one per element).
__device__ __forceinline__ int kiln_div_by(int q, unsigned magic, unsigned shift) {
  return (int)(__umulhi((unsigned)q, magic) >> shift);
}

// One block's GEMM extents, and for a stride phase of backward-data the pixels and taps it has:
// input positions first + j * stride (j < cnt), kernel taps tap0 + t * stride (t < taps).
struct kiln_extent {
  int m, k;
  int first[3], cnt[3], tap0[3], taps[3];
};

__device__ __forceinline__ kiln_extent block_extent(const kiln_conv& p, int phase) {
  kiln_extent e;
  e.m = p.m;
  e.k = p.k;
  if (PASS == 1 && p.phases > 1) {
    const int ph[3] = {phase / (p.stride[1] * p.stride[2]), (phase / p.stride[2]) % p.stride[1],
                       phase % p.stride[2]};
    int pixels = 1, taps = 1;
#pragma unroll
    for (int d = 0; d < 3; ++d) {
      const int s = p.stride[d];
      e.first[d] = ((ph[d] - p.pad[d]) % s + s) % s;
      e.cnt[d] = p.in[d] > e.first[d] ? (p.in[d] - e.first[d] + s - 1) / s : 0;
      e.tap0[d] = ph[d];
      e.taps[d] = p.ks[d] > ph[d] ? (p.ks[d] - ph[d] + s - 1) / s : 0;
      pixels *= e.cnt[d];
      taps *= e.taps[d];
    }
    e.m = p.batch * pixels;
    e.k = taps * p.cout_g;
  }
  return e;
}

// What a k index means. Forward and backward-data decode it once per tile into shared memory;
// backward-weight per thread, through kiln_out_cursor.
//   forward:         t = kk * kdil,            c = in channel, w = offset in the weight row
//   backward-data:   t = -kk * kdil,           c = out channel, w = weight offset (o, kernel pos)
//   backward-weight: t = out pos * stride - pad, c = k (cotangent row), w = batch * in pixels
struct kiln_kinfo {
  int t[3];
  int c, w, valid, pad0, pad1;
};

// What a row m (of A) or column n (of B) means, decoded once per thread.
struct kiln_mninfo {
  int t[3];
  int base;  // sample base in pixels, a channel, or a weight row offset (see mn_info)
  int valid;
};

// Taps along dim d that a k index runs over: the phase's for phased backward-data, else the
// kernel's. (Values, not a pointer to either array: a pointer would put x in local memory.)
__device__ __forceinline__ int tap_count(const kiln_conv& p, const kiln_extent& x, int d) {
  return PASS == 1 && p.phases > 1 ? x.taps[d] : p.ks[d];
}

// Tap number `tap` (counted as tap_count counts) as a position per dim.
__device__ __forceinline__ void tap_position(const kiln_conv& p, const kiln_extent& x, int tap,
                                             int (&t)[3]) {
  const int n1 = tap_count(p, x, 1), n2 = tap_count(p, x, 2);
  t[0] = tap / (n1 * n2);
  const int r = tap - t[0] * n1 * n2;
  t[1] = r / n2;
  t[2] = r - t[1] * n2;
}

// The kernel position kp of tap position t, and its offset in taps within a weight row
// (counted from the far end for flip).
__device__ __forceinline__ int kernel_tap(const kiln_conv& p, const kiln_extent& x,
                                          const int (&t)[3], int (&kp)[3]) {
  const bool phased = PASS == 1 && p.phases > 1;
#pragma unroll
  for (int d = 0; d < 3; ++d) kp[d] = phased ? x.tap0[d] + t[d] * p.stride[d] : t[d];
  const int ks = (kp[0] * p.ks[1] + kp[1]) * p.ks[2] + kp[2];
  return p.flip ? p.ksize - 1 - ks : ks;
}

__device__ __forceinline__ kiln_kinfo k_info(const kiln_conv& p, const kiln_extent& x, int k) {
  kiln_kinfo e;
  e.valid = k < x.k;
  e.pad0 = e.pad1 = 0;
  if (!e.valid) k = 0;
  const int chans = PASS == 0 ? p.cin_g : p.cout_g;
  const int tap = k / chans, c = k - tap * chans;
  int t[3], kp[3];
  tap_position(p, x, tap, t);
  const int ks_w = kernel_tap(p, x, t, kp);
  const int sign = PASS == 0 ? 1 : -1;
#pragma unroll
  for (int d = 0; d < 3; ++d) e.t[d] = sign * kp[d] * p.kdil[d];
  e.c = c;
  e.w = PASS == 0 ? ks_w * p.cin_g + c : (c * p.ksize + ks_w) * p.cin_g;
  return e;
}

// Backward-weight: k index k as (batch b, output position o). A step adds another cursor's
// digits with carries, so the k loop divides nothing.
struct kiln_out_cursor {
  int k, b, o[3];

  __device__ __forceinline__ void start(const kiln_conv& p, int k0) {
    k = k0;
    const int plane = p.out[1] * p.out[2];
    b = k0 / (p.out[0] * plane);
    int r = k0 - b * p.out[0] * plane;
    o[0] = r / plane;
    r -= o[0] * plane;
    o[1] = r / p.out[2];
    o[2] = r - o[1] * p.out[2];
  }

  // Moves by step.k, step being a cursor started there. Each digit stays below its extent, so
  // one subtraction carries.
  __device__ __forceinline__ void advance(const kiln_conv& p, const kiln_out_cursor& step) {
    k += step.k;
    int carry = 0;
#pragma unroll
    for (int d = 2; d >= 0; --d) {
      o[d] += step.o[d] + carry;
      carry = o[d] >= p.out[d];
      if (carry) o[d] -= p.out[d];
    }
    b += step.b + carry;
  }

  __device__ __forceinline__ kiln_kinfo info(const kiln_conv& p) const {
    kiln_kinfo e;
    e.valid = k < p.k;
#pragma unroll
    for (int d = 0; d < 3; ++d) e.t[d] = o[d] * p.stride[d] - p.pad[d];
    e.c = k;
    e.w = b * p.in[0] * p.in[1] * p.in[2];
    e.pad0 = e.pad1 = 0;
    return e;
  }
};

// TAP_TILES: the tap and first channel of the tile being fetched, stepped one tile at a time,
// taps first. Taps count within the phase's taps for phased backward-data.
struct kiln_tap_cursor {
  int t[3], c0;

  __device__ __forceinline__ void start(const kiln_conv& p, const kiln_extent& x, int k0) {
    // Tile i is channel block i / taps at tap i % taps.
    const int taps = tap_count(p, x, 0) * tap_count(p, x, 1) * tap_count(p, x, 2);
    const int i = k0 / BK;
    c0 = i / taps * BK;
    tap_position(p, x, i % taps, t);
  }

  __device__ __forceinline__ void advance(const kiln_conv& p, const kiln_extent& x) {
    if (++t[2] < tap_count(p, x, 2)) return;
    t[2] = 0;
    if (++t[1] < tap_count(p, x, 1)) return;
    t[1] = 0;
    if (++t[0] < tap_count(p, x, 0)) return;
    t[0] = 0;
    c0 += BK;
  }

  // The tap's offset, in taps, within a weight row.
  __device__ __forceinline__ int weight_tap(const kiln_conv& p, const kiln_extent& x) const {
    int kp[3];
    return kernel_tap(p, x, t, kp);
  }
};

// IS_A: row m of A, else column n of B; g is the group.
// Row m of A as (batch, pixel position): an output pixel (forward) or an input pixel
// (backward-data; within a phase, the phase's pixels).
__device__ __forceinline__ void row_pixel(const kiln_conv& p, const kiln_extent& x, int m, int& b,
                                          int (&pos)[3]) {
  const bool phased = PASS == 1 && p.phases > 1;
  int e[3];
#pragma unroll
  for (int d = 0; d < 3; ++d) e[d] = PASS == 0 ? p.out[d] : (phased ? x.cnt[d] : p.in[d]);
  const int pixels = e[0] * e[1] * e[2];
  b = m / pixels;
  const int r = m - b * pixels;
  pos[0] = r / (e[1] * e[2]);
  const int r2 = r - pos[0] * e[1] * e[2];
  pos[1] = r2 / e[2];
  pos[2] = r2 - pos[1] * e[2];
  if (phased) {
#pragma unroll
    for (int d = 0; d < 3; ++d) pos[d] = x.first[d] + pos[d] * p.stride[d];
  }
}

template <bool IS_A>
__device__ __forceinline__ kiln_mninfo mn_info(const kiln_conv& p, const kiln_extent& ext, int i,
                                               int g) {
  kiln_mninfo e;
  e.valid = i < (IS_A ? ext.m : p.n);
  if (!e.valid) i = 0;
  e.t[0] = e.t[1] = e.t[2] = 0;
  if (IS_A && PASS != 2) {
    int b, x[3];
    row_pixel(p, ext, i, b, x);
#pragma unroll
    for (int d = 0; d < 3; ++d)
      e.t[d] = PASS == 0 ? x[d] * p.stride[d] - p.pad[d] : x[d] * p.idil[d] + p.pad[d];
    e.base = b * (PASS == 0 ? p.in[0] * p.in[1] * p.in[2] : p.out[0] * p.out[1] * p.out[2]);
  } else if (IS_A) {
    e.base = g * p.cout_g + i;  // backward-weight: a cotangent channel
  } else if (PASS == 0) {
    e.base = (g * p.cout_g + i) * p.ksize * p.cin_g;  // forward: a weight row
  } else if (PASS == 1) {
    e.base = i;  // backward-data: an input channel
  } else {
    // backward-weight: (kernel pos, in channel)
    const int ks = i / p.cin_g, c = i - ks * p.cin_g;
    const int kd = ks / (p.ks[1] * p.ks[2]), r = ks - kd * p.ks[1] * p.ks[2];
    const int kh = r / p.ks[2], kw = r - kh * p.ks[2];
    e.t[0] = kd * p.kdil[0];
    e.t[1] = kh * p.kdil[1];
    e.t[2] = kw * p.kdil[2];
    e.base = c;
  }
  return e;
}

// Element offset of A[m, k] (IS_A) or B[k, n] in its tensor, or -1 where the gathered value is
// padding (or past the edge of the GEMM).
template <bool IS_A>
// Offsets fit in int: the host bounds every tensor to fewer than 2^31 elements.
__device__ __forceinline__ int gather(const kiln_conv& p, const kiln_mninfo& mn,
                                            const kiln_kinfo& ki, int g) {
  static_assert(!(IS_A && PASS == 2), "backward-weight's A is read by fetch_out");
  if (!(mn.valid && ki.valid)) return -1;
  if ((IS_A && PASS == 0) || (!IS_A && PASS == 2)) {
    // An input pixel: the position in the dilated input must land on a real pixel.
    int pos[3];
#pragma unroll
    for (int d = 0; d < 3; ++d) {
      int q = mn.t[d] + ki.t[d];
      if (q < 0) return -1;
      if (p.idil[d] != 1) {
        const int r = kiln_div_by(q, p.idil_magic[d], p.idil_shift[d]);
        if (r * p.idil[d] != q) return -1;
        q = r;
      }
      if (q >= p.in[d]) return -1;
      pos[d] = q;
    }
    const int sample = IS_A ? mn.base : ki.w;
    const int chan = IS_A ? ki.c : mn.base;
    const int pixel = sample + (pos[0] * p.in[1] + pos[1]) * p.in[2] + pos[2];
    return pixel * p.cin + g * p.cin_g + chan;
  }
  if (IS_A && PASS == 1) {
    // A cotangent pixel: the output position that reads this input pixel through this tap.
    int pos[3];
#pragma unroll
    for (int d = 0; d < 3; ++d) {
      int q = mn.t[d] + ki.t[d];
      if (q < 0) return -1;
      if (p.stride[d] != 1) {
        const int r = kiln_div_by(q, p.stride_magic[d], p.stride_shift[d]);
        if (r * p.stride[d] != q) return -1;
        q = r;
      }
      if (q >= p.out[d]) return -1;
      pos[d] = q;
    }
    const int pixel = mn.base + (pos[0] * p.out[1] + pos[1]) * p.out[2] + pos[2];
    return pixel * p.cout + g * p.cout_g + ki.c;
  }
  if (PASS == 0) return mn.base + ki.w;  // forward: weight row + (tap, channel)
  return g * p.cout_g * p.ksize * p.cin_g + ki.w + mn.base;  // backward-data
}

// ---- Operand tiles: global -> shared -------------------------------------------------------

// Whether an operand is contiguous along k in global memory (else along m or n).
constexpr bool A_GLOBAL_K = PASS != 2;
constexpr bool B_GLOBAL_K = PASS == 0;

template <bool IS_A> struct kiln_operand {
  static constexpr int ROWS = IS_A ? BM : BN;  // extent along m (A) or n (B)
  static constexpr int VEC = IS_A ? VEC_A : VEC_B;
  static constexpr bool GLOBAL_K = IS_A ? A_GLOBAL_K : B_GLOBAL_K;
  // Tensor cores read fragments with ldmatrix, which transposes as needed, so shared memory
  // keeps the global order. The FMA path wants [k][m] and [k][n].
  static constexpr bool SHARED_K = TENSOR && GLOBAL_K;
  // Row padding keeps ldmatrix, float4 and TF32 fragment reads free of bank conflicts: 16
  // bytes on a k-contiguous row; on an m- or n-contiguous one 16 bytes for ldmatrix .trans and 8
  // f32 for TF32 (k rows then start 8 banks apart, so the four k rows a fragment reads meet
  // eight columns each on distinct banks).
  static constexpr int PITCH = SHARED_K ? BK + E16 : ROWS + (TENSOR ? 8 : 4);
  static constexpr int STAGE_ELEMS = SHARED_K ? ROWS * PITCH : BK * PITCH;
  // The tile moves in vectors of VEC elements along the global contiguous dim. A line is what
  // shares one mn_info: a row (GLOBAL_K; its vectors run along k) or a vector's span of rows
  // (its vectors are the BK k rows).
  static constexpr int LINES_TOTAL = GLOBAL_K ? ROWS : ROWS / VEC;
  static constexpr int PER_LINE = GLOBAL_K ? BK / VEC : BK;
  static constexpr int CHUNKS = LINES_TOTAL * PER_LINE / THREADS;  // vectors per thread
  // GLOBAL_K: a thread takes CHUNKS consecutive vectors (of one row, or of whole rows), so
  // neighbouring threads read neighbouring bytes. Else thread t takes lines t, t + THREADS, ...
  // of k row after k row, for the same reason.
  static constexpr int LINES = GLOBAL_K ? (CHUNKS > PER_LINE ? CHUNKS / PER_LINE : 1)
                                        : (LINES_TOTAL > THREADS ? LINES_TOTAL / THREADS : 1);
  static constexpr bool ASYNC = KILN_HAS_CP_ASYNC && (SHARED_K == GLOBAL_K) && VEC * sizeof(T) >= 4;
  static_assert(CHUNKS >= 1 && CHUNKS * THREADS == LINES_TOTAL * PER_LINE,
                "the block's threads share the tile evenly");
  static_assert(GLOBAL_K ? (PER_LINE % CHUNKS == 0 || CHUNKS % PER_LINE == 0)
                         : (THREADS % LINES_TOTAL == 0 || LINES_TOTAL % THREADS == 0),
                "each thread's vectors cover whole lines or part of one");
};

// One operand's loader: its fixed row (or column), on the register path the values in flight
// between the global load and the shared store, and for backward-weight's B the k of its first
// k row in the next tile.
template <bool IS_A> struct kiln_loader {
  typedef kiln_operand<IS_A> O;
  kiln_mninfo mn[O::LINES];
  kiln_vec<T, O::VEC> held[O::ASYNC ? 1 : O::CHUNKS];
  // Backward-weight's B: chunk c reads k row first + (c / LINES) * ROW_STEP (see chunk), which
  // row_step adds; tile_step moves first by BK.
  static constexpr int ROW_STEP = THREADS < O::LINES_TOTAL ? 1 : THREADS / O::LINES_TOTAL;
  kiln_out_cursor first, row_step, tile_step;

  // Chunk c of this thread: its line (index into mn), k row and row within the tile.
  __device__ __forceinline__ void chunk(int c, int& li, int& kl, int& row) const {
    const int t = threadIdx.x;
    if (O::GLOBAL_K) {
      const int id = t * O::CHUNKS + c;
      li = O::LINES > 1 ? c / O::PER_LINE : 0;  // a constant, so mn stays in registers
      kl = (id % O::PER_LINE) * O::VEC;
      row = id / O::PER_LINE;
    } else {
      const int id = t + c * THREADS;
      li = c % O::LINES;
      kl = id / O::LINES_TOTAL;
      row = (id % O::LINES_TOTAL) * O::VEC;
    }
  }

  // k0: the block's first k (backward-weight's B starts its cursors there).
  __device__ __forceinline__ void init(const kiln_conv& p, const kiln_extent& x, int row0, int g,
                                       int k0) {
    const int t = threadIdx.x;
    if constexpr (PASS == 2 && !IS_A) {
      static_assert(!O::GLOBAL_K, "backward-weight's B runs along n");
      int li, kl, row;
      chunk(0, li, kl, row);
      first.start(p, k0 + kl);
      row_step.start(p, ROW_STEP);
      tile_step.start(p, BK);
    }
#pragma unroll
    for (int li = 0; li < O::LINES; ++li) {
      const int line = O::GLOBAL_K ? t * O::CHUNKS / O::PER_LINE + li
                                   : t % O::LINES_TOTAL + li * THREADS;
      mn[li] = mn_info<IS_A>(p, x, row0 + (O::GLOBAL_K ? line : line * O::VEC), g);
      if (TAP_TILES && IS_A && PASS == 1 && p.phases > 1) {
        // In output pixels, less the phase's first tap: the cotangent row a phase tap t reads
        // is then t[d] = mn.t[d] - t (exact: the pixel and tap share the phase).
#pragma unroll
        for (int d = 0; d < 3; ++d) mn[li].t[d] = (mn[li].t[d] - x.tap0[d]) / p.stride[d];
      }
    }
  }

  // TAP_TILES: the offset of this line's element at the tile's first k (kl = 0), or -1 where
  // the line reads padding (or lies past the edge of the GEMM).
  __device__ __forceinline__ int tap_line(const kiln_conv& p, const kiln_extent& x,
                                          const kiln_tap_cursor& tap, const kiln_mninfo& e,
                                          int g) const {
    if (!e.valid) return -1;
    if (IS_A) {
      // An input pixel (forward) or a cotangent pixel (backward-data) at this tap.
      int extent[3], q[3];
#pragma unroll
      for (int d = 0; d < 3; ++d) {
        extent[d] = PASS == 0 ? p.in[d] : p.out[d];
        q[d] = PASS == 0 ? e.t[d] + tap.t[d] * p.kdil[d] : e.t[d] - tap.t[d] * p.kdil[d];
        if (q[d] < 0 || q[d] >= extent[d]) return -1;
      }
      const int pixel = e.base + (q[0] * extent[1] + q[1]) * extent[2] + q[2];
      return PASS == 0 ? pixel * p.cin + g * p.cin_g + tap.c0
                       : pixel * p.cout + g * p.cout_g + tap.c0;
    }
    const int w_tap = tap.weight_tap(p, x);
    if (PASS == 0) return e.base + w_tap * p.cin_g + tap.c0;
    return g * p.cout_g * p.ksize * p.cin_g + (tap.c0 * p.ksize + w_tap) * p.cin_g + e.base;
  }

  __device__ __forceinline__ T* slot(T* stage, int kl, int row) const {
    return O::SHARED_K ? stage + row * O::PITCH + kl : stage + kl * O::PITCH + row;
  }

  // Starts the loads of one tile through its k table.
  __device__ __forceinline__ void fetch(const kiln_conv& p, const T* src, const kiln_kinfo* table,
                                        T* stage, int g) {
    load(src, stage, [&](int, int li, int kl) { return gather<IS_A>(p, mn[li], table[kl], g); });
  }

  // Backward-weight: starts the loads of the tile at k0 (the next in order): A as cotangent
  // rows k, B at the pixels of `first` and the rows after it; then `first` steps a tile.
  __device__ __forceinline__ void fetch_out(const kiln_conv& p, int k0, const T* src, T* stage,
                                            int g) {
    if constexpr (IS_A) {
      load(src, stage, [&](int, int li, int kl) {
        const int k = k0 + kl;
        return mn[li].valid && k < p.k ? k * p.cout + mn[li].base : -1;
      });
    } else {
      int off[O::CHUNKS];
      kiln_out_cursor row = first;
#pragma unroll
      for (int c = 0; c < O::CHUNKS; ++c) {
        if (c > 0 && c % O::LINES == 0) row.advance(p, row_step);
        off[c] = gather<false>(p, mn[c % O::LINES], row.info(p), g);
      }
      load(src, stage, [&](int c, int, int) { return off[c]; });
      first.advance(p, tile_step);
    }
  }

  // TAP_TILES: starts the loads of the tile at `tap`, one offset per line.
  __device__ __forceinline__ void fetch_tap(const kiln_conv& p, const kiln_extent& x,
                                            const kiln_tap_cursor& tap, const T* src, T* stage,
                                            int g) {
    int line[O::LINES];
#pragma unroll
    for (int li = 0; li < O::LINES; ++li) line[li] = tap_line(p, x, tap, mn[li], g);
    // Along k a line steps through channels; only backward-data's weight (B, contiguous along
    // n) steps through weight rows.
    const int k_step = O::GLOBAL_K ? 1 : p.ksize * p.cin_g;
    load(src, stage,
         [&](int, int li, int kl) { return line[li] < 0 ? -1 : line[li] + kl * k_step; });
  }

  // Starts the loads of one tile, each vector's element offset from offset(chunk, line, kl)
  // (-1: zeros): straight to shared memory (cp.async) or into registers.
  template <typename Offset>
  __device__ __forceinline__ void load(const T* src, T* stage, Offset offset) {
#pragma unroll
    for (int c = 0; c < O::CHUNKS; ++c) {
      int li, kl, row;
      chunk(c, li, kl, row);
      const int off = offset(c, li, kl);
      if constexpr (O::ASYNC) {
        // TAP_TILES: the next tile of A reads the pixels next to this one's.
        kiln_cp_async<O::VEC * sizeof(T), TAP_TILES && IS_A>(
            slot(stage, kl, row), off >= 0 ? src + off : src, off >= 0);
      } else if (off >= 0) {
        held[c] = *reinterpret_cast<const kiln_vec<T, O::VEC>*>(src + off);
      } else {
#pragma unroll
        for (int v = 0; v < O::VEC; ++v) held[c].v[v] = kiln_from_float<T>(0.0f);
      }
    }
  }

  // Register path: writes what fetch loaded (transposing when shared memory is [k][rows]).
  __device__ __forceinline__ void stash(T* stage) const {
    if constexpr (!O::ASYNC) {
#pragma unroll
      for (int c = 0; c < O::CHUNKS; ++c) {
        int li, kl, row;
        chunk(c, li, kl, row);
        if (O::SHARED_K == O::GLOBAL_K) {
          *reinterpret_cast<kiln_vec<T, O::VEC>*>(slot(stage, kl, row)) = held[c];
        } else {
#pragma unroll
          for (int v = 0; v < O::VEC; ++v) *slot(stage, kl + v, row) = held[c].v[v];
        }
      }
    }
  }
};

// ---- Tensor-core tiles ---------------------------------------------------------------------

constexpr int WTM = TENSOR ? BM / WM : 1, WTN = TENSOR ? BN / WN : 1;
constexpr int MT = TENSOR ? WTM / 16 : 1, NT = TENSOR ? WTN / 8 : 2;

struct kiln_tensor_tile {
  float acc[MT][NT][4];

  __device__ __forceinline__ void compute(const T* sa, const T* sb) {
    if constexpr (TF32) {
      compute_tf32(sa, sb);
      return;
    }
    typedef kiln_operand<true> OA;
    typedef kiln_operand<false> OB;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, j = lane / 8, r8 = lane % 8;
    const int wm = warp % WM, wn = warp / WM;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned a[MT][4], b[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int m = wm * WTM + mt * 16;
        if (OA::SHARED_K)
          kiln_ldmatrix_x4<false>(a[mt], sa + (m + r8 + 8 * (j % 2)) * OA::PITCH + kk + 8 * (j / 2));
        else
          kiln_ldmatrix_x4<true>(a[mt], sa + (kk + 8 * (j / 2) + r8) * OA::PITCH + m + 8 * (j % 2));
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        const int n = wn * WTN + np * 16;
        unsigned r[4];
        if (OB::SHARED_K)
          kiln_ldmatrix_x4<false>(r, sb + (n + r8 + 8 * (j / 2)) * OB::PITCH + kk + 8 * (j % 2));
        else
          kiln_ldmatrix_x4<true>(r, sb + (kk + 8 * (j % 2) + r8) * OB::PITCH + n + 8 * (j / 2));
        b[2 * np][0] = r[0];
        b[2 * np][1] = r[1];
        b[2 * np + 1][0] = r[2];
        b[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) kiln_mma<T>::run(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
    }
  }

  // f32 on TF32 tensor cores, k steps of 8 (fragments as kiln_mma_tf32 lays them out). A
  // k-contiguous operand is read with ldmatrix: its 16-bit pairs are the f32 words, and a row of
  // an 8x8 16-bit matrix is four k of one row. An m- or n-contiguous one is read a word at a time
  // (ldmatrix .trans would split the words).
  __device__ __forceinline__ void compute_tf32(const T* sa, const T* sb) {
    typedef kiln_operand<true> OA;
    typedef kiln_operand<false> OB;
    const unsigned* wa = reinterpret_cast<const unsigned*>(sa);
    const unsigned* wb = reinterpret_cast<const unsigned*>(sb);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, j = lane / 8, r8 = lane % 8;
    const int gid = lane / 4, tig = lane % 4;
    const int wm = warp % WM, wn = warp / WM;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 8) {
      unsigned a[MT][4], b[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int m = wm * WTM + mt * 16;
        if (OA::SHARED_K)
          kiln_ldmatrix_x4<false>(a[mt], sa + (m + r8 + 8 * (j % 2)) * OA::PITCH + kk + 4 * (j / 2));
        else
#pragma unroll
          for (int r = 0; r < 4; ++r)
            a[mt][r] = wa[(kk + tig + 4 * (r / 2)) * OA::PITCH + m + gid + 8 * (r % 2)];
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        const int n = wn * WTN + np * 16;
        if (OB::SHARED_K) {
          unsigned r[4];
          kiln_ldmatrix_x4<false>(r, sb + (n + r8 + 8 * (j / 2)) * OB::PITCH + kk + 4 * (j % 2));
          b[2 * np][0] = r[0];
          b[2 * np][1] = r[1];
          b[2 * np + 1][0] = r[2];
          b[2 * np + 1][1] = r[3];
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int r = 0; r < 2; ++r)
              b[2 * np + h][r] = wb[(kk + tig + 4 * r) * OB::PITCH + n + 8 * h + gid];
        }
      }
      // High parts (and with three products, remainders) of both operands.
      unsigned ah[MT][4], al[MT][4], bh[NT][2], bl[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) kiln_tf32_split<TF32_PRODUCTS>(a[mt][r], ah[mt][r], al[mt][r]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) kiln_tf32_split<TF32_PRODUCTS>(b[nt][r], bh[nt][r], bl[nt][r]);
      // One product term over every accumulator, then the next: consecutive MMAs add into
      // different accumulators, so none waits for the one before. The small terms come first,
      // so that they are not lost against the large one.
      if (TF32_PRODUCTS == 3) {
        tf32_products(al, bh);
        tf32_products(ah, bl);
      }
      tf32_products(ah, bh);
    }
  }

  __device__ __forceinline__ void tf32_products(const unsigned (&a)[MT][4],
                                                const unsigned (&b)[NT][2]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) kiln_mma_tf32(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
  }

  // Calls store(row, col, m, n, v0, v1) for each pair of adjacent columns this thread holds,
  // with row = row_base(m) computed once per row and col[i] = col_base(n + i) once per column
  // (not once per row and column: col_base may divide).
  template <typename Row, typename Col, typename Store>
  __device__ __forceinline__ void each_pair(Row row_base, Col col_base, Store store) const {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp % WM, wn = warp / WM;
    int col[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int n = wn * WTN + nt * 8 + (lane % 4) * 2;
      col[nt][0] = col_base(n);
      col[nt][1] = col_base(n + 1);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = wm * WTM + mt * 16 + lane / 4 + 8 * h;
        const int row = row_base(m);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int n = wn * WTN + nt * 8 + (lane % 4) * 2;
          store(row, col[nt], m, n, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
        }
      }
  }
};

// ---- FMA tiles -------------------------------------------------------------------------------

__host__ __device__ constexpr int isqrt_exact(int v) {
  int r = 1;
  while (r * r < v) ++r;
  return r;
}
constexpr int TT = TENSOR ? 4 : isqrt_exact(BM * BN / THREADS);  // each thread: TT x TT
constexpr int TY = BM / TT, TX = BN / TT;
static_assert(TENSOR || (TT * TT * THREADS == BM * BN && TT % 4 == 0 && TY * TX == THREADS),
              "FMA tile: square per-thread tiles of a multiple of 4");
static_assert(!TENSOR || (WM * WN * 32 == THREADS && WTM % 16 == 0 && WTN % 16 == 0),
              "tensor tile: warps cover the tile in 16 x 16 steps");

struct kiln_fma_tile {
  float acc[TT][TT];

  // Shared memory holds T, [k][m] and [k][n]; four consecutive elements are one aligned
  // vector (rows are padded to a multiple of 4), widened to f32 here.
  __device__ __forceinline__ void compute(const T* sa, const T* sb) {
    typedef kiln_operand<true> OA;
    typedef kiln_operand<false> OB;
    const int ty = threadIdx.x / TX, tx = threadIdx.x % TX;
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      float a[TT], b[TT];
#pragma unroll
      for (int i = 0; i < TT / 4; ++i) {
        const kiln_vec<T, 4> va =
            *reinterpret_cast<const kiln_vec<T, 4>*>(sa + k * OA::PITCH + i * TY * 4 + ty * 4);
        const kiln_vec<T, 4> vb =
            *reinterpret_cast<const kiln_vec<T, 4>*>(sb + k * OB::PITCH + i * TX * 4 + tx * 4);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          a[4 * i + j] = kiln_to_float(va.v[j]);
          b[4 * i + j] = kiln_to_float(vb.v[j]);
        }
      }
#pragma unroll
      for (int i = 0; i < TT; ++i)
#pragma unroll
        for (int j = 0; j < TT; ++j) acc[i][j] += a[i] * b[j];
    }
  }

  template <typename Row, typename Col, typename Store>
  __device__ __forceinline__ void each_pair(Row row_base, Col col_base, Store store) const {
    const int ty = threadIdx.x / TX, tx = threadIdx.x % TX;
    int col[TT / 2][2];
#pragma unroll
    for (int j = 0; j < TT; j += 2) {
      const int n = (j / 4) * TX * 4 + tx * 4 + j % 4;
      col[j / 2][0] = col_base(n);
      col[j / 2][1] = col_base(n + 1);
    }
#pragma unroll
    for (int i = 0; i < TT; ++i) {
      const int m = (i / 4) * TY * 4 + ty * 4 + i % 4;
      const int row = row_base(m);
#pragma unroll
      for (int j = 0; j < TT; j += 2) {
        const int n = (j / 4) * TX * 4 + tx * 4 + j % 4;
        store(row, col[j / 2], m, n, acc[i][j], acc[i][j + 1]);
      }
    }
  }
};

// The offset of C[m, n] in the output tensor is row_offset(m) + col_offset(n).
__device__ __forceinline__ int row_offset(const kiln_conv& p, const kiln_extent& x, int m, int g) {
  if (PASS == 0) return m * p.cout + g * p.cout_g;
  if (PASS == 1) {
    int b, pos[3];
    row_pixel(p, x, m, b, pos);
    const int pixel = ((b * p.in[0] + pos[0]) * p.in[1] + pos[1]) * p.in[2] + pos[2];
    return pixel * p.cin + g * p.cin_g;
  }
  return (g * p.cout_g + m) * p.ksize * p.cin_g;
}
__device__ __forceinline__ int col_offset(const kiln_conv& p, int n) {
  if (PASS != 2 || !p.flip) return n;
  const int ks = n / p.cin_g, c = n - ks * p.cin_g;
  return (p.ksize - 1 - ks) * p.cin_g + c;
}

// The 256-thread f32 tile asks for 128 registers a thread, so that two blocks share an SM
// (measured: it helps f32; capping the tensor tiles the same way made them slower).
constexpr int MIN_BLOCKS = !TENSOR && THREADS == 256 ? 2 : 1;

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) {{kernel}}(
    const T* __restrict__ a_src, const T* __restrict__ b_src, T* __restrict__ out,
    float* __restrict__ partial, kiln_conv p) {
  extern __shared__ float4 kiln_w4[];  // 16-byte aligned (the host harness's name for it too)
  typedef kiln_operand<true> OA;
  typedef kiln_operand<false> OB;
  T* sa = reinterpret_cast<T*>(kiln_w4);
  T* sb = sa + STAGES * OA::STAGE_ELEMS;
  kiln_kinfo* tables = reinterpret_cast<kiln_kinfo*>(sb + STAGES * OB::STAGE_ELEMS);  // [2][BK]

  // blockIdx.z = (group * phases + phase) * splits + split.
  const int per_split = p.k_tiles_per_split;  // >= 1
  const int n_splits = max(((p.k + BK - 1) / BK + per_split - 1) / per_split, 1);
  const int split = blockIdx.z % n_splits, gp = blockIdx.z / n_splits;
  const int g = gp / p.phases;
  const kiln_extent ext = block_extent(p, gp % p.phases);
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  if (m0 >= ext.m) return;  // a phase with fewer pixels than the largest
  const int k_tiles = (ext.k + BK - 1) / BK;
  const int kt0 = split * per_split;
  const int kt_end = min(k_tiles, kt0 + per_split);
  const int tiles = max(kt_end - kt0, 0);

  kiln_loader<true> la;
  kiln_loader<false> lb;
  la.init(p, ext, m0, g, kt0 * BK);
  lb.init(p, ext, n0, g, kt0 * BK);

  // Each tile's k table is built by one warp, a different one each tile; TAP_TILES and
  // backward-weight step cursors instead (tiles are fetched in order).
  constexpr bool TABLES = !TAP_TILES && PASS != 2;
  constexpr int WARPS = THREADS / 32;
  auto build_table = [&](int t) {
    const int lane = threadIdx.x % 32;
    if constexpr (TABLES)
      if (threadIdx.x / 32 == t % WARPS && lane < BK)
        tables[(t % 2) * BK + lane] = k_info(p, ext, (kt0 + t) * BK + lane);
  };
  kiln_tap_cursor tap;
  if (TAP_TILES) tap.start(p, ext, kt0 * BK);
  auto fetch = [&](int t) {
    T* a_stage = sa + (t % STAGES) * OA::STAGE_ELEMS;
    T* b_stage = sb + (t % STAGES) * OB::STAGE_ELEMS;
    if constexpr (PASS == 2) {
      la.fetch_out(p, (kt0 + t) * BK, a_src, a_stage, g);
      lb.fetch_out(p, (kt0 + t) * BK, b_src, b_stage, g);
    } else if constexpr (TAP_TILES) {
      la.fetch_tap(p, ext, tap, a_src, a_stage, g);
      lb.fetch_tap(p, ext, tap, b_src, b_stage, g);
      tap.advance(p, ext);
    } else {
      const kiln_kinfo* table = tables + (t % 2) * BK;
      la.fetch(p, a_src, table, a_stage, g);
      lb.fetch(p, b_src, table, b_stage, g);
    }
  };
  auto stash = [&](int t) {
    la.stash(sa + (t % STAGES) * OA::STAGE_ELEMS);
    lb.stash(sb + (t % STAGES) * OB::STAGE_ELEMS);
  };

  // The accumulators of whichever path this dtype takes.
  kiln_tensor_tile tc;
  kiln_fma_tile fm;
  if (TENSOR) {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) tc.acc[i][j][r] = 0.0f;
  } else {
#pragma unroll
    for (int i = 0; i < TT; ++i)
#pragma unroll
      for (int j = 0; j < TT; ++j) fm.acc[i][j] = 0.0f;
  }

  // Prologue: tiles 0 .. STAGES-2 in flight, the table for STAGES-1 built.
#pragma unroll 1
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < tiles) build_table(s);
    __syncthreads();
    if (s < tiles) {
      fetch(s);
      stash(s);
    }
    kiln_cp_async_commit();
  }
  if (STAGES - 1 < tiles) build_table(STAGES - 1);

#pragma unroll 1
  for (int t = 0; t < tiles; ++t) {
    kiln_cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile t is in shared memory; tile t-1's buffers are free
    const int next = t + STAGES - 1;
    if (next < tiles) fetch(next);
    kiln_cp_async_commit();
    if (next + 1 < tiles) build_table(next + 1);
    if constexpr (TENSOR)
      tc.compute(sa + (t % STAGES) * OA::STAGE_ELEMS, sb + (t % STAGES) * OB::STAGE_ELEMS);
    else
      fm.compute(sa + (t % STAGES) * OA::STAGE_ELEMS, sb + (t % STAGES) * OB::STAGE_ELEMS);
    if (next < tiles) stash(next);
  }
  kiln_cp_async_wait<0>();

  const long long total = (long long)p.cout * p.ksize * p.cin_g;  // backward-weight partials
  auto row_base = [&](int mi) { return m0 + mi < ext.m ? row_offset(p, ext, m0 + mi, g) : 0; };
  auto col_base = [&](int ni) { return col_offset(p, n0 + ni); };
  auto store = [&](int row, const int (&col)[2], int mi, int ni, float v0, float v1) {
    const int m = m0 + mi, n = n0 + ni;
    if (m >= ext.m || n >= p.n) return;
    const int o = row + col[0];
    const bool both = n + 1 < p.n;
    if (partial != nullptr) {
      float* dst = partial + split * total;
      if (both && p.pair_store) {
        *reinterpret_cast<float2*>(dst + o) = make_float2(v0, v1);
      } else {
        dst[o] = v0;
        if (both) dst[row + col[1]] = v1;
      }
    } else if (both && p.pair_store) {
      kiln_vec<T, 2> v;
      v.v[0] = kiln_from_float<T>(v0);
      v.v[1] = kiln_from_float<T>(v1);
      *reinterpret_cast<kiln_vec<T, 2>*>(out + o) = v;
    } else {
      out[o] = kiln_from_float<T>(v0);
      if (both) out[row + col[1]] = kiln_from_float<T>(v1);
    }
  };
  if constexpr (TENSOR)
    tc.each_pair(row_base, col_base, store);
  else
    fm.each_pair(row_base, col_base, store);
}
