// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) VJP over the last axis, f32 accumulation. With
// xhat = (x - mean) * rstd (RMS: x * rstd) and wg = w * g:
//   dx = rstd * (wg - mean(wg) - xhat * mean(wg * xhat))      (RMS: without the mean(wg) term)
//   dw = sum over rows of g * xhat,  db = sum over rows of g
// With c = x - mean, the row needs two rounds of group sums (one barrier each): (sum x,
// sum wg) give mean and mean(wg); then (sum c^2, sum wg c) give rstd and
// mean(wg * xhat) = rstd * mean(wg c), exactly as the two-pass statistics do. LayerNorm rows
// held over 12 warps or more (MOMENTS) take the second round about each warp's own mean instead
// and combine the warps after one barrier (kiln_group_vjp_sums), as exact.
// Blocks loop over rows; each writes its f32 partial sums of dw and db as one row of
// `partial_w` / `partial_b` ([gridDim.x, d]), which kiln_reduce_cols then sums. No n_rows x d
// temporary, and the weight gradient is never accumulated in a 16-bit type.
// ITEMS > 0: x and g rows and the thread's partial sums held in registers, the block's groups
// combined once at the end; with RESIDENT the rows stay in their shared memory stage instead and
// each pass reads them there (rows too long for registers, whose partial sums still fit), and
// the weights after the ring; with PACKED they stay in registers as loaded (16-bit words, half
// the registers of floats) with the weights, and each pass widens what it uses;
// ITEMS = 0: one row per block, streamed three times (RMSNorm: twice), partials accumulated in
// shared memory or in place in global memory (each thread owns the same columns for every row).
{{> prelude}}
{{> norm}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr int GROUP = {{GROUP}};
constexpr int ITEMS = {{ITEMS}};
constexpr bool RMS = {{RMS}};
// STAGES > 0: the next STAGES - 1 rows of x and g in flight in a ring of shared memory stages
// while the current row is worked on (see norm_fwd.cu).
constexpr int STAGES = ITEMS > 0 ? {{STAGES}} : 0;
// Where a row on the ring stays during the passes (RESIDENT): 0 widened into floats in
// registers, 1 in its shared memory stage (RESIDENT), 2 in registers as loaded (PACKED).
constexpr int HOLD = STAGES > 0 ? {{RESIDENT}} : 0;
constexpr bool RESIDENT = HOLD == 1;
constexpr bool PACKED = HOLD == 2;
constexpr int GROUPS = BLOCK_DIM / GROUP;
constexpr int NI = ITEMS > 0 ? ITEMS : 1;
// Rows held in registers by 1024 threads, whose 64 registers each hold x and g and no more: the
// weights and the partial sums stay in shared memory, each thread reading and writing its own.
constexpr bool SHARED_SUMS = ITEMS > 0 && !RESIDENT && BLOCK_DIM == 1024;
static_assert(!SHARED_SUMS || (GROUPS == 1 && STAGES == 0 && N_READS <= 4),
              "one row per block, no ring, float4 at most");
static_assert(STAGES == 0 || (STAGES >= 2 && sizeof(T) * N_READS == 16),
              "a ring holds 16-byte vectors of the current row and at least one more");
// LayerNorm rows over 12 warps or more take their sums about each warp's own mean and combine
// them after one barrier a row (kiln_group_vjp_sums), not two rounds of group sums. On an H200:
// 1.13-1.15x on f32 rows of 1,024 threads, 1.00-1.04x on 14-16 warps; on 2-6 warps its extra
// shuffles cost more than the barrier saves (0.95-1.00x), and on 10, 0.98-1.03x.
constexpr bool MOMENTS = !RMS && ITEMS > 0 && GROUP >= 384;
// Shared accumulators to combine the groups of a block (register path with GROUPS > 1).
constexpr int SMEM_D = (ITEMS > 0 && GROUPS > 1) ? GROUP * NI * N_READS : 1;

// A vector's two row sums of the first round: sum x, sum wg (LayerNorm only).
template <int N>
__device__ __forceinline__ void kiln_vjp_round1(const float (&x)[N], const float (&g)[N],
                                                const float (&w)[N], float& sx, float& swg) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    sx += x[j];
    swg += w[j] * g[j];
  }
}

// A vector's two row sums of the second round: sum c^2, sum wg c (c = x - mean). Vectors
// past d (zeros) must not call it: their c is -mean.
template <int N>
__device__ __forceinline__ void kiln_vjp_round2(const float (&x)[N], const float (&g)[N],
                                                const float (&w)[N], float mean, float& q,
                                                float& t) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float c = x[j] - mean;
    q += c * c;
    t += w[j] * g[j] * c;
  }
}

// A vector's share of the column sums (dw += g * xhat, db += g) and its dx, into x. `in`: the
// vector lies in an active row and inside d (elsewhere rstd may be infinite for eps = 0).
template <int N>
__device__ __forceinline__ void kiln_vjp_finish(float (&x)[N], const float (&g)[N],
                                                const float (&w)[N], bool in, float mean,
                                                float rstd, float c1, float c2, float (&dw)[N],
                                                float (&db)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float xh = in ? (x[j] - mean) * rstd : 0.0f;
    dw[j] += g[j] * xh;
    db[j] += g[j];
    x[j] = rstd * (w[j] * g[j] - c2 - xh * c1);
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ g, T* __restrict__ dx,
    float* __restrict__ partial_w, float* __restrict__ partial_b, long long rows, int d,
    long long x_row_stride, long long g_row_stride, long long w_stride, int w_vec, float eps,
    int smem_partials) {
  // The previous kernel's writes visible (launch_dependent); no global access before this.
  kiln_wait_for_previous_grid();
  __shared__ float scratch[KILN_SCRATCH(BLOCK_DIM)];
  __shared__ float4 vjp_sums[MOMENTS ? KILN_MOMENTS(BLOCK_DIM) : 1];
  int round = 0;
  const int group = threadIdx.x / GROUP, lane = threadIdx.x % GROUP;
  const long long step = (long long)gridDim.x * GROUPS;
  const float inv_d = 1.0f / d;  // one division per block, not four per row

  if (ITEMS > 0) {
    __shared__ float acc_w[SMEM_D], acc_b[SMEM_D];
    const kiln_warp_shares shares = kiln_warp_shares_of<GROUP, N_READS>(d);
    float dw[NI][N_READS], db[NI][N_READS];
#pragma unroll
    for (int k = 0; k < NI; ++k)
#pragma unroll
      for (int j = 0; j < N_READS; ++j) dw[k][j] = db[k][j] = 0.0f;

    typedef kiln_vec<T, N_READS> V;
    extern __shared__ V ring[];  // STAGES stages of x and g, NI * BLOCK_DIM vectors each
    constexpr int STAGE = 2 * NI * BLOCK_DIM;

    auto stage = [&](long long row, int s) {
      if constexpr (STAGES > 0) {
        const bool active = row < rows;
        const long long r = active ? row : 0;
        kiln_stage_row<NI, N_READS, GROUP, BLOCK_DIM>(x + r * x_row_stride, active, lane, d,
                                                      ring + s * STAGE);
        kiln_stage_row<NI, N_READS, GROUP, BLOCK_DIM>(g + r * g_row_stride, active, lane, d,
                                                      ring + s * STAGE + NI * BLOCK_DIM);
        kiln_cp_async_commit();
      }
    };
    // The first rows' copies go out before the weights load, so that the weights' latency is
    // spent with rows in flight.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
      stage((long long)blockIdx.x * GROUPS + group + s * step, s);
    // Each thread owns the same columns in every row: its weights load once, into registers, or
    // for resident rows (whose registers hold the partial sums) into shared memory after the
    // ring, laid out like a stage (T is exact for them: x's dtype, or 1 when there is none),
    // which each thread alone writes and reads.
    float wv[NI][N_READS];
    V* w_staged = ring + STAGES * STAGE;
    kiln_load_params<NI, N_READS>(w, w_stride, w_vec, lane * N_READS, GROUP * N_READS, d, 1.0f, wv);
    V w_packed[NI];  // PACKED: the weights as T, in registers
    if constexpr (RESIDENT || PACKED) {
#pragma unroll
      for (int k = 0; k < NI; ++k) {
        V wk;
#pragma unroll
        for (int j = 0; j < N_READS; ++j) wk.v[j] = kiln_from_float<T>(wv[k][j]);
        if constexpr (RESIDENT) {
          w_staged[k * BLOCK_DIM + threadIdx.x] = wk;
        } else {
          w_packed[k] = wk;
        }
      }
    }
    // SHARED_SUMS: the weights, then the partial sums of dw and db, as vectors of floats.
    typedef kiln_vec<float, N_READS> F;
    F* w_shared = reinterpret_cast<F*>(w_staged);
    F* dw_shared = w_shared + NI * BLOCK_DIM;
    F* db_shared = dw_shared + NI * BLOCK_DIM;
    if constexpr (SHARED_SUMS) {
#pragma unroll
      for (int k = 0; k < NI; ++k) {
        F wk, zero;
#pragma unroll
        for (int j = 0; j < N_READS; ++j) {
          wk.v[j] = wv[k][j];
          zero.v[j] = 0.0f;
        }
        w_shared[k * BLOCK_DIM + threadIdx.x] = wk;
        dw_shared[k * BLOCK_DIM + threadIdx.x] = zero;
        db_shared[k * BLOCK_DIM + threadIdx.x] = zero;
      }
    }
    // Vector k of the thread's weights.
    auto weights = [&](int k, float(&wk)[N_READS]) {
      if constexpr (SHARED_SUMS) {
        const F f = w_shared[k * BLOCK_DIM + threadIdx.x];
#pragma unroll
        for (int j = 0; j < N_READS; ++j) wk[j] = f.v[j];
      } else {
#pragma unroll
        for (int j = 0; j < N_READS; ++j) wk[j] = wv[k][j];
      }
    };
    // LayerNorm, after the first round (this thread's sums of x and wg): the centre of the
    // second round, the row's mean or with MOMENTS the warp's own.
    auto centre_of = [&](float& s_x, float& s_wg, float& mean, float& c2) {
      if constexpr (MOMENTS) {
        s_x = kiln_warp_sum(s_x);
        return s_x * shares.inv_own;
      } else {
        kiln_group_sum2<GROUP, BLOCK_DIM>(s_x, s_wg, scratch, round);
        mean = s_x * inv_d;
        c2 = s_wg * inv_d;
        return mean;
      }
    };
    // After the second round (this thread's sums q and t about the centre): the row's mean,
    // c2 = mean(wg) (with MOMENTS), rstd and c1 = rstd * mean(wg c).
    auto row_stats = [&](float q, float t, float s_x, float s_wg, float& mean, float& c2,
                         float& rstd, float& c1) {
      if constexpr (MOMENTS) {
        kiln_warp_sum3_to_lane0(q, t, s_wg);
        kiln_group_vjp_sums<GROUP, BLOCK_DIM>(s_x, q, t, s_wg, shares, vjp_sums, round, inv_d,
                                              mean);
        c2 = s_wg * inv_d;
      } else {
        kiln_group_sum2<GROUP, BLOCK_DIM>(q, t, scratch, round);
      }
      rstd = rsqrtf(q * inv_d + eps);
      c1 = rstd * t * inv_d;
    };
    int s = 0;
    for (long long base = (long long)blockIdx.x * GROUPS; base < rows; base += step) {
      const long long row = base + group;
      const bool active = row < rows;
      // This row's stages of x and g (STAGES > 0).
      const V* sx = ring + s * STAGE;
      const V* sg = sx + NI * BLOCK_DIM;
      if constexpr (STAGES > 0) {
        kiln_cp_async_wait<(STAGES > 2 ? STAGES - 2 : 0)>();  // this row's stage has landed
        // The row STAGES - 1 ahead goes to the stage read one iteration ago.
        stage(row + (STAGES - 1) * step, s == 0 ? STAGES - 1 : s - 1);
        s = s == STAGES - 1 ? 0 : s + 1;
      }
      float mean = 0.0f, c2 = 0.0f, rstd, c1;
      if constexpr (RESIDENT || PACKED) {
        // RESIDENT: x and g stay in their stages; each of the three passes reads them there,
        // one vector at a time: loads hoisted across vectors would hold all of x and g and
        // spill (the partial sums already take 64 registers). PACKED: each pass widens the
        // row's words anew; kiln_opaque keeps the compiler from holding the floats of one pass
        // for the next, which is what would take the registers.
        V x_packed[NI], g_packed[NI];
        if constexpr (PACKED) {
#pragma unroll
          for (int k = 0; k < NI; ++k) {
            x_packed[k] = sx[k * BLOCK_DIM + threadIdx.x];
            g_packed[k] = sg[k * BLOCK_DIM + threadIdx.x];
          }
        }
        auto vector = [&](int k, float(&xk)[N_READS], float(&gk)[N_READS], float(&wk)[N_READS]) {
          if constexpr (PACKED) {
            kiln_opaque(x_packed[k]);
            kiln_opaque(g_packed[k]);
            kiln_opaque(w_packed[k]);
            kiln_widen(x_packed[k], xk);
            kiln_widen(g_packed[k], gk);
            kiln_widen(w_packed[k], wk);
          } else {
            asm volatile("" ::: "memory");
            kiln_unstage_vec<N_READS, BLOCK_DIM>(sx, k, xk);
            kiln_unstage_vec<N_READS, BLOCK_DIM>(sg, k, gk);
            kiln_unstage_vec<N_READS, BLOCK_DIM>(w_staged, k, wk);
          }
        };
        float s_x = 0.0f, s_wg = 0.0f, centre = 0.0f;  // with MOMENTS the warp's mean
        if constexpr (!RMS) {
#pragma unroll
          for (int k = 0; k < NI; ++k) {
            if ((k * GROUP + lane) * N_READS >= d) break;
            float xk[N_READS], gk[N_READS], wk[N_READS];
            vector(k, xk, gk, wk);
            kiln_vjp_round1(xk, gk, wk, s_x, s_wg);
          }
          centre = centre_of(s_x, s_wg, mean, c2);
        }
        float q = 0.0f, t = 0.0f;
#pragma unroll
        for (int k = 0; k < NI; ++k) {
          if ((k * GROUP + lane) * N_READS >= d) break;
          float xk[N_READS], gk[N_READS], wk[N_READS];
          vector(k, xk, gk, wk);
          kiln_vjp_round2(xk, gk, wk, centre, q, t);
        }
        row_stats(q, t, s_x, s_wg, mean, c2, rstd, c1);
        T* dxr = dx + (active ? row : 0) * (long long)d;
#pragma unroll
        for (int k = 0; k < NI; ++k) {
          const int i = (k * GROUP + lane) * N_READS;
          if (i >= d) break;
          float xk[N_READS], gk[N_READS], wk[N_READS];
          vector(k, xk, gk, wk);
          kiln_vjp_finish(xk, gk, wk, active, mean, rstd, c1, c2, dw[k], db[k]);
          if (active) kiln_store_vec<N_READS>(dxr, i, xk);
        }
        continue;
      }
      float xv[NI][N_READS], gv[NI][N_READS];
      if constexpr (STAGES > 0) {
        kiln_unstage_row<NI, N_READS, BLOCK_DIM>(sx, xv);
        kiln_unstage_row<NI, N_READS, BLOCK_DIM>(sg, gv);
      } else {
        const T* xr = x + (active ? row : 0) * x_row_stride;
        const T* gr = g + (active ? row : 0) * g_row_stride;
        kiln_load_row<NI, N_READS, GROUP>(xr, active, lane, d, xv);
        kiln_load_row<NI, N_READS, GROUP>(gr, active, lane, d, gv);
      }
      float s_x = 0.0f, s_wg = 0.0f, centre = 0.0f;  // with MOMENTS the warp's mean
      if constexpr (!RMS) {
#pragma unroll
        for (int k = 0; k < NI; ++k) {
          float wk[N_READS];
          weights(k, wk);
          kiln_vjp_round1(xv[k], gv[k], wk, s_x, s_wg);
        }
        centre = centre_of(s_x, s_wg, mean, c2);
      }
      float q = 0.0f, t = 0.0f;
#pragma unroll
      for (int k = 0; k < NI; ++k) {
        if ((k * GROUP + lane) * N_READS >= d) break;
        float wk[N_READS];
        weights(k, wk);
        kiln_vjp_round2(xv[k], gv[k], wk, centre, q, t);
      }
      row_stats(q, t, s_x, s_wg, mean, c2, rstd, c1);
      T* dxr = dx + (active ? row : 0) * (long long)d;
#pragma unroll
      for (int k = 0; k < NI; ++k) {
        const int i = (k * GROUP + lane) * N_READS;
        float wk[N_READS];
        weights(k, wk);
        if constexpr (SHARED_SUMS) {
          if (i >= d) break;
          F* pdw = dw_shared + k * BLOCK_DIM + threadIdx.x;
          F* pdb = db_shared + k * BLOCK_DIM + threadIdx.x;
          float dwk[N_READS], dbk[N_READS];
#pragma unroll
          for (int j = 0; j < N_READS; ++j) {
            dwk[j] = pdw->v[j];
            dbk[j] = pdb->v[j];
          }
          kiln_vjp_finish(xv[k], gv[k], wk, active, mean, rstd, c1, c2, dwk, dbk);
#pragma unroll
          for (int j = 0; j < N_READS; ++j) {
            pdw->v[j] = dwk[j];
            pdb->v[j] = dbk[j];
          }
        } else {
          kiln_vjp_finish(xv[k], gv[k], wk, active && i < d, mean, rstd, c1, c2, dw[k], db[k]);
        }
        if (active && i < d) {
          if constexpr (STAGES > 0) {
            kiln_store_vec<N_READS>(dxr, i, xv[k]);  // staged rows: d a multiple of N_READS
          } else {
            kiln_store_floats<N_READS>(dxr, i, d, xv[k]);
          }
        }
      }
    }

    if constexpr (STAGES > 0) kiln_cp_async_wait<0>();  // no copy may land after the block has gone

    // This block's partial sums: combine its groups (same columns per lane), then one row out.
    float* pw = partial_w + (long long)blockIdx.x * d;
    float* pb = partial_b + (long long)blockIdx.x * d;
    if (GROUPS == 1) {
      // One store per vector (d is a multiple of N_READS, so pw + i is aligned and the vector
      // whole), not one per float: those 64 stores per thread, each waiting for the one before to
      // read its register, took a third of the resident rows' time (Nsight Compute).
#pragma unroll
      for (int k = 0; k < NI; ++k) {
        const int i = (k * GROUP + lane) * N_READS;
        if (i >= d) break;
        if constexpr (SHARED_SUMS) {
          const int e = k * BLOCK_DIM + threadIdx.x;
          if (partial_w) kiln_store_vec<N_READS>(pw, i, dw_shared[e].v);
          if (partial_b) kiln_store_vec<N_READS>(pb, i, db_shared[e].v);
        } else {
          if (partial_w) kiln_store_vec<N_READS>(pw, i, dw[k]);
          if (partial_b) kiln_store_vec<N_READS>(pb, i, db[k]);
        }
      }
    } else {
      // The groups add in turn, in a fixed order: the same sums on every run.
      for (int turn = 0; turn < GROUPS; ++turn) {
        if (group == turn) {
#pragma unroll
          for (int k = 0; k < NI; ++k) {
            const int i = (k * GROUP + lane) * N_READS;
#pragma unroll
            for (int j = 0; j < N_READS; ++j) {
              if (i + j < d) {
                acc_w[i + j] = turn == 0 ? dw[k][j] : acc_w[i + j] + dw[k][j];
                acc_b[i + j] = turn == 0 ? db[k][j] : acc_b[i + j] + db[k][j];
              }
            }
          }
        }
        __syncthreads();
      }
      for (int i = threadIdx.x; i < d; i += BLOCK_DIM) {
        if (partial_w) pw[i] = acc_w[i];
        if (partial_b) pb[i] = acc_b[i];
      }
    }
  } else {
    // One row per block (GROUP == BLOCK_DIM). The partial sums accumulate in dynamic shared
    // memory when the launch gave room for them (2 * d floats), else in place in global memory.
    extern __shared__ float acc_dyn[];
    const bool has_w = partial_w != nullptr, has_b = partial_b != nullptr;
    float* out_w = partial_w + (long long)blockIdx.x * d;
    float* out_b = partial_b + (long long)blockIdx.x * d;
    float* pw = smem_partials ? acc_dyn : out_w;
    float* pb = smem_partials ? acc_dyn + d : out_b;
    for (int i = lane; i < d; i += GROUP) {
      if (has_w) pw[i] = 0.0f;
      if (has_b) pb[i] = 0.0f;
    }
    __syncthreads();  // zeroed by column stride, accumulated by vector: different owners
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
      const T* xr = x + row * x_row_stride;
      const T* gr = g + row * g_row_stride;
      // The vector at i of x, the cotangent and the weights; each of the three passes reads it.
      auto load = [&](int i, float(&v)[N_READS], float(&gv)[N_READS], float(&wv)[N_READS]) {
        kiln_load_floats<N_READS>(xr, i, d, v);
        kiln_load_floats<N_READS>(gr, i, d, gv);
        kiln_load_param<N_READS>(w, w_stride, w_vec, i, d, 1.0f, wv);
      };
      // The two rounds of row sums of the register path, each a pass over the row: a single
      // pass of sums shifted by one element cancels when that element is an outlier (see
      // kiln_streamed_row_stats). Whole vectors: i < d, and d is a multiple of N_READS when
      // N_READS > 1.
      float mean = 0.0f, c2 = 0.0f;
      if (!RMS) {
        float s_x = 0.0f, s_wg = 0.0f;
        for (int i = lane * N_READS; i < d; i += GROUP * N_READS) {
          float v[N_READS], gv[N_READS], wv[N_READS];
          load(i, v, gv, wv);
          kiln_vjp_round1(v, gv, wv, s_x, s_wg);
        }
        kiln_group_sum2<GROUP, BLOCK_DIM>(s_x, s_wg, scratch, round);
        mean = s_x * inv_d;
        c2 = s_wg * inv_d;
      }
      float q = 0.0f, t = 0.0f;
      for (int i = lane * N_READS; i < d; i += GROUP * N_READS) {
        float v[N_READS], gv[N_READS], wv[N_READS];
        load(i, v, gv, wv);
        kiln_vjp_round2(v, gv, wv, mean, q, t);
      }
      kiln_group_sum2<GROUP, BLOCK_DIM>(q, t, scratch, round);
      const float rstd = rsqrtf(q * inv_d + eps);
      const float c1 = rstd * t * inv_d;  // mean(wg * xhat)
      T* dxr = dx + row * (long long)d;
      for (int i = lane * N_READS; i < d; i += GROUP * N_READS) {
        float v[N_READS], gv[N_READS], wv[N_READS], o[N_READS];
        load(i, v, gv, wv);
#pragma unroll
        for (int j = 0; j < N_READS; ++j) {
          const float xh = (v[j] - mean) * rstd;
          o[j] = rstd * (wv[j] * gv[j] - c2 - xh * c1);
          if (i + j < d) {
            if (has_w) pw[i + j] += gv[j] * xh;
            if (has_b) pb[i + j] += gv[j];
          }
        }
        kiln_store_floats<N_READS>(dxr, i, d, o);
      }
    }
    if (smem_partials) {
      __syncthreads();
      for (int i = lane; i < d; i += GROUP) {
        if (has_w) out_w[i] = pw[i];
        if (has_b) out_b[i] = pb[i];
      }
    }
  }
}
