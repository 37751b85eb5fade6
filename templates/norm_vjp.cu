// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) VJP over the last axis, f32 accumulation. With
// xhat = (x - mean) * rstd (RMS: x * rstd) and wg = w * g:
//   dx = rstd * (wg - mean(wg) - xhat * mean(wg * xhat))      (RMS: without the mean(wg) term)
//   dw = sum over rows of g * xhat,  db = sum over rows of g
// Blocks loop over rows; each writes its f32 partial sums of dw and db as one row of
// `partial_w` / `partial_b` ([gridDim.x, d]), which kiln_reduce_cols then sums. No n_rows x d
// temporary, and the weight gradient is never accumulated in a 16-bit type.
// ITEMS > 0: x and g rows and the thread's partial sums held in registers, the block's groups
// combined once at the end; ITEMS = 0: one row per block, streamed three times, partials
// accumulated in place in global memory (each thread owns the same columns for every row).
{{> prelude}}
{{> norm}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr int GROUP = {{GROUP}};
constexpr int ITEMS = {{ITEMS}};
constexpr bool RMS = {{RMS}};
// The next row's x and g loads in flight while the current row is worked on (see norm_fwd.cu).
constexpr bool PREFETCH = {{PREFETCH}} != 0 && ITEMS > 0;
constexpr int GROUPS = BLOCK_DIM / GROUP;
constexpr int NI = ITEMS > 0 ? ITEMS : 1;
// Shared accumulators to combine the groups of a block (register path with GROUPS > 1).
constexpr int SMEM_D = (ITEMS > 0 && GROUPS > 1) ? GROUP * NI * N_READS : 1;

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ g, T* __restrict__ dx,
    float* __restrict__ partial_w, float* __restrict__ partial_b, long long rows, int d,
    long long x_row_stride, long long g_row_stride, long long w_stride, int w_vec, float eps,
    int smem_partials) {
  __shared__ float scratch[BLOCK_DIM / 32];
  const int group = threadIdx.x / GROUP, lane = threadIdx.x % GROUP;
  const long long step = (long long)gridDim.x * GROUPS;

  if (ITEMS > 0) {
    __shared__ float acc_w[SMEM_D], acc_b[SMEM_D];
    float dw[NI][N_READS], db[NI][N_READS];
#pragma unroll
    for (int k = 0; k < NI; ++k)
#pragma unroll
      for (int j = 0; j < N_READS; ++j) dw[k][j] = db[k][j] = 0.0f;

    kiln_vec<T, N_READS> raw_x[NI], raw_g[NI];  // unused (and removed) without PREFETCH
    auto fetch = [&](long long row) {
      if constexpr (PREFETCH) {
        const bool active = row < rows;
        kiln_fetch_row<NI, N_READS, GROUP>(x + (active ? row : 0) * x_row_stride, active, lane, d,
                                           raw_x);
        kiln_fetch_row<NI, N_READS, GROUP>(g + (active ? row : 0) * g_row_stride, active, lane, d,
                                           raw_g);
      }
    };
    fetch((long long)blockIdx.x * GROUPS + group);
    for (long long base = (long long)blockIdx.x * GROUPS; base < rows; base += step) {
      const long long row = base + group;
      const bool active = row < rows;
      float xv[NI][N_READS], gv[NI][N_READS], mean, rstd;
      if constexpr (PREFETCH) {
        kiln_unpack_row(raw_x, xv);
        kiln_unpack_row(raw_g, gv);
        fetch(row + step);
      } else {
        const T* xr = x + (active ? row : 0) * x_row_stride;
        const T* gr = g + (active ? row : 0) * g_row_stride;
        kiln_load_row<NI, N_READS, GROUP>(xr, active, lane, d, xv);
        kiln_load_row<NI, N_READS, GROUP>(gr, active, lane, d, gv);
      }
      kiln_row_stats<RMS, GROUP, BLOCK_DIM>(xv, lane, d, eps, scratch, mean, rstd);
      // xhat in place of x; wg in place of g (dw, db take g first).
      float s_wg = 0.0f, s_wgx = 0.0f;
#pragma unroll
      for (int k = 0; k < NI; ++k) {
        const int i = (k * GROUP + lane) * N_READS;
        float wv[N_READS];
        kiln_load_param<N_READS>(w, w_stride, w_vec, i, d, 1.0f, wv);
#pragma unroll
        for (int j = 0; j < N_READS; ++j) {
          const bool in = i + j < d;
          const float xh = in ? (xv[k][j] - mean) * rstd : 0.0f;
          dw[k][j] += gv[k][j] * xh;
          db[k][j] += gv[k][j];
          const float wg = in ? wv[j] * gv[k][j] : 0.0f;
          xv[k][j] = xh;
          gv[k][j] = wg;
          s_wg += wg;
          s_wgx += wg * xh;
        }
      }
      const float c2 = RMS ? 0.0f : kiln_group_sum<GROUP, BLOCK_DIM>(s_wg, scratch) / d;
      const float c1 = kiln_group_sum<GROUP, BLOCK_DIM>(s_wgx, scratch) / d;
      if (active) {
        T* dxr = dx + row * (long long)d;
#pragma unroll
        for (int k = 0; k < NI; ++k) {
          const int i = (k * GROUP + lane) * N_READS;
          if (i >= d) break;
          float o[N_READS];
#pragma unroll
          for (int j = 0; j < N_READS; ++j) o[j] = rstd * (gv[k][j] - c2 - xv[k][j] * c1);
          kiln_store_floats<N_READS>(dxr, i, d, o);
        }
      }
    }

    // This block's partial sums: combine its groups (same columns per lane), then one row out.
    float* pw = partial_w + (long long)blockIdx.x * d;
    float* pb = partial_b + (long long)blockIdx.x * d;
    if (GROUPS == 1) {
#pragma unroll
      for (int k = 0; k < NI; ++k) {
        const int i = (k * GROUP + lane) * N_READS;
#pragma unroll
        for (int j = 0; j < N_READS; ++j) {
          if (i + j < d) {
            if (partial_w) pw[i + j] = dw[k][j];
            if (partial_b) pb[i + j] = db[k][j];
          }
        }
      }
    } else {
      for (int i = threadIdx.x; i < d; i += BLOCK_DIM) acc_w[i] = acc_b[i] = 0.0f;
      __syncthreads();
#pragma unroll
      for (int k = 0; k < NI; ++k) {
        const int i = (k * GROUP + lane) * N_READS;
#pragma unroll
        for (int j = 0; j < N_READS; ++j) {
          if (i + j < d) {
            atomicAdd(&acc_w[i + j], dw[k][j]);
            atomicAdd(&acc_b[i + j], db[k][j]);
          }
        }
      }
      __syncthreads();
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
      float mean, rstd;
      kiln_streamed_row_stats<RMS, GROUP, BLOCK_DIM, N_READS>(xr, true, lane, d, eps, scratch, mean, rstd);
      float s_wg = 0.0f, s_wgx = 0.0f;
      for (int i = lane * N_READS; i < d; i += GROUP * N_READS) {
        float v[N_READS], gv[N_READS], wv[N_READS];
        kiln_load_floats<N_READS>(xr, i, d, v);
        kiln_load_floats<N_READS>(gr, i, d, gv);
        kiln_load_param<N_READS>(w, w_stride, w_vec, i, d, 1.0f, wv);
#pragma unroll
        for (int j = 0; j < N_READS; ++j) {
          if (i + j < d) {
            const float wg = wv[j] * gv[j];
            s_wg += wg;
            s_wgx += wg * (v[j] - mean) * rstd;
          }
        }
      }
      const float c2 = RMS ? 0.0f : kiln_group_sum<GROUP, BLOCK_DIM>(s_wg, scratch) / d;
      const float c1 = kiln_group_sum<GROUP, BLOCK_DIM>(s_wgx, scratch) / d;
      T* dxr = dx + row * (long long)d;
      for (int i = lane * N_READS; i < d; i += GROUP * N_READS) {
        float v[N_READS], gv[N_READS], wv[N_READS], o[N_READS];
        kiln_load_floats<N_READS>(xr, i, d, v);
        kiln_load_floats<N_READS>(gr, i, d, gv);
        kiln_load_param<N_READS>(w, w_stride, w_vec, i, d, 1.0f, wv);
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
