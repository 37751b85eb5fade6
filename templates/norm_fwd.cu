// LayerNorm (RMS = 0) or RMSNorm (RMS = 1) forward over the last axis, f32 accumulation:
//   LayerNorm: y = (x - mean) * rsqrt(var + eps) * w + b
//   RMSNorm:   y = x * rsqrt(mean(x^2) + eps) * w
// GROUP threads handle one row; a block holds BLOCK_DIM / GROUP rows. With ITEMS > 0 the row
// is held in registers (ITEMS vectors of N_READS per thread: one read of x, exact two-pass
// variance); with ITEMS = 0 the row is streamed: the mean, the squares about it, then the write.
{{> prelude}}
{{> norm}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr int GROUP = {{GROUP}};
constexpr int ITEMS = {{ITEMS}};
constexpr bool RMS = {{RMS}};
// STAGES > 0 (16-bit rows held in registers over several warps): the grid is what the GPU
// holds at once and each group loops over rows, with the next rows in flight in a ring of
// shared memory stages (norm.cuh) while the current row is reduced and written. 16-bit rows
// carry few bytes each, and one row at a time left the loads latency-bound. Otherwise each
// group takes one row.
constexpr int STAGES = ITEMS > 0 ? {{STAGES}} : 0;
constexpr int GROUPS = BLOCK_DIM / GROUP;
static_assert(STAGES == 0 || (STAGES >= 2 && sizeof(T) * N_READS == 16),
              "a ring holds 16-byte vectors of the current row and at least one more");

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    long long rows, int d, long long x_row_stride, long long w_stride, long long b_stride,
    int w_vec, int b_vec, float eps) {
  // The previous kernel's writes visible (launch_dependent); no global access before this.
  kiln_wait_for_previous_grid();
  __shared__ float scratch[KILN_SCRATCH(BLOCK_DIM)];
  __shared__ float2 moments[KILN_MOMENTS(BLOCK_DIM)];
  int round = 0;
  const int group = threadIdx.x / GROUP, lane = threadIdx.x % GROUP;

  if (ITEMS > 0) {
    constexpr int NI = ITEMS > 0 ? ITEMS : 1;
    const float inv_d = 1.0f / d;  // one division per block, not two per row
    const kiln_warp_shares shares = kiln_warp_shares_of<GROUP, N_READS>(d);
    typedef kiln_vec<T, N_READS> V;
    // STAGES > 0: STAGES stages of NI * BLOCK_DIM vectors, then the weights and (LayerNorm) the
    // bias, NI * GROUP vectors each. A lane's columns are the same in every row and every group:
    // their weights and bias are staged once, as T (exact: x's dtype, or 1 and 0 when missing),
    // instead of loaded, checked and converted from global memory for every row.
    extern __shared__ V ring[];
    V* params = ring + STAGES * NI * BLOCK_DIM;
    // Stages the weights and bias (the first group), after the first rows' copies have gone
    // out, so that their loads wait with rows in flight.
    auto stage_params = [&]() {
      if (group == 0) {
        float wv[NI][N_READS], bv[NI][N_READS];
        const int step = GROUP * N_READS;
        kiln_load_params<NI, N_READS>(w, w_stride, w_vec, lane * N_READS, step, d, 1.0f, wv);
        kiln_load_params<NI, N_READS>(RMS ? nullptr : b, b_stride, b_vec, lane * N_READS, step, d,
                                      0.0f, bv);
#pragma unroll
        for (int k = 0; k < NI; ++k) {
          V wk, bk;
#pragma unroll
          for (int j = 0; j < N_READS; ++j) {
            wk.v[j] = kiln_from_float<T>(wv[k][j]);
            bk.v[j] = kiln_from_float<T>(bv[k][j]);
          }
          params[k * GROUP + lane] = wk;
          if (!RMS) params[(NI + k) * GROUP + lane] = bk;
        }
      }
      __syncthreads();  // staged by the first group, read by every group
    };
    // Normalises a row held in registers and writes it.
    auto write = [&](T* yr, float(&v)[NI][N_READS], float mean, float rstd) {
#pragma unroll
      for (int k = 0; k < NI; ++k) {
        const int i = (k * GROUP + lane) * N_READS;
        if (i >= d) break;
        float wv[N_READS], bv[N_READS];
        if constexpr (STAGES > 0) {
          const V wk = params[k * GROUP + lane];
          const V bk = RMS ? V{} : params[(NI + k) * GROUP + lane];  // zeros for RMSNorm
          kiln_widen(wk, wv);
          kiln_widen(bk, bv);
        } else {
          kiln_load_param<N_READS>(w, w_stride, w_vec, i, d, 1.0f, wv);
          kiln_load_param<N_READS>(RMS ? nullptr : b, b_stride, b_vec, i, d, 0.0f, bv);
        }
#pragma unroll
        for (int j = 0; j < N_READS; ++j) v[k][j] = (v[k][j] - mean) * rstd * wv[j] + bv[j];
        if constexpr (STAGES > 0) {
          kiln_store_vec<N_READS>(yr, i, v[k]);  // staged rows: d a multiple of N_READS
        } else {
          kiln_store_floats<N_READS>(yr, i, d, v[k]);
        }
      }
    };
    if constexpr (STAGES > 0) {
      // Rows r, r + step, ...; the loop runs on the block's first row, so every group of the
      // block takes the same iterations (a row past the end computes and writes nothing). The
      // rows' x and y advance as pointers instead of being recomputed from 64-bit products
      // every row.
      const long long step = (long long)gridDim.x * GROUPS;
      long long row = (long long)blockIdx.x * GROUPS + group;
      long long ahead = row;  // the next row to stage
      const T* x_ahead = x + row * x_row_stride;
      T* yr = y + row * (long long)d;
      const long long x_step = step * x_row_stride, y_step = step * (long long)d;
      // Stages row `ahead` into stage s and moves on to the next.
      auto stage = [&](int s) {
        const bool active = ahead < rows;
        kiln_stage_row<NI, N_READS, GROUP, BLOCK_DIM>(active ? x_ahead : x, active, lane, d,
                                                      ring + s * NI * BLOCK_DIM);
        kiln_cp_async_commit();
        ahead += step;
        x_ahead += x_step;
      };
      // One-warp rows (the shortest, fewest bytes a row) keep every stage in flight: a thread
      // copies into and reads only its own vectors, so the row STAGES ahead may go to the stage
      // just read once a __syncwarp has ordered the reads before the copy. Rows of several warps
      // send the row STAGES - 1 ahead to the stage read one turn ago, before their statistics:
      // measured on an H100, one-warp rows of 256 to 1,024 elements ran 1.01-1.10x with every
      // stage in flight (bf16 RMSNorm of 1,024: 0.97x, above the copy rate either way), rows of
      // 12,288 to 18,432 on 512 or 1,024 threads 0.96-0.98x (their copy waits for the barrier).
      constexpr bool EVERY_STAGE = GROUP == 32;
      constexpr int AHEAD = EVERY_STAGE ? STAGES : STAGES - 1;  // rows in flight
#pragma unroll
      for (int s = 0; s < AHEAD; ++s) stage(s);
      stage_params();
      int s = 0;
      for (long long first = row - group; first < rows; first += step, row += step, yr += y_step) {
        kiln_cp_async_wait<(AHEAD > 0 ? AHEAD - 1 : 0)>();  // this row's stage has landed
        float v[NI][N_READS], mean, rstd;
        kiln_unstage_row<NI, N_READS, BLOCK_DIM>(ring + s * NI * BLOCK_DIM, v);
        if constexpr (!EVERY_STAGE) {
          stage(s == 0 ? STAGES - 1 : s - 1);  // the stage read one turn ago
          s = s == STAGES - 1 ? 0 : s + 1;
        }
        kiln_row_stats<RMS, GROUP, BLOCK_DIM>(v, lane, d, inv_d, shares, eps, scratch, moments,
                                              round, mean, rstd);
        if constexpr (EVERY_STAGE) {
          __syncwarp();
          stage(s);  // the stage just read
          s = s == STAGES - 1 ? 0 : s + 1;
        }
        if (row < rows) write(yr, v, mean, rstd);
      }
      kiln_cp_async_wait<0>();  // no copy may land after the block has gone
    } else {
      const long long row = (long long)blockIdx.x * GROUPS + group;
      const bool active = row < rows;
      float v[NI][N_READS], mean, rstd;
      kiln_load_row<NI, N_READS, GROUP>(x + (active ? row : 0) * x_row_stride, active, lane, d, v);
      kiln_row_stats<RMS, GROUP, BLOCK_DIM>(v, lane, d, inv_d, shares, eps, scratch, moments,
                                            round, mean, rstd);
      if (active) write(y + row * (long long)d, v, mean, rstd);
    }
  } else {
    // One row per block (GROUP == BLOCK_DIM).
    const long long row = blockIdx.x;
    const bool active = row < rows;
    const T* xr = x + (active ? row : 0) * x_row_stride;
    T* yr = y + (active ? row : 0) * (long long)d;
    float mean, rstd;
    kiln_streamed_row_stats<RMS, GROUP, BLOCK_DIM, N_READS>(xr, active, lane, d, 1.0f / d, eps,
                                                            scratch, round, mean, rstd);
    if (!active) return;
    for (int i = lane * N_READS; i < d; i += GROUP * N_READS) {
      float v[N_READS], wv[N_READS], bv[N_READS];
      kiln_load_floats<N_READS>(xr, i, d, v);
      kiln_load_param<N_READS>(w, w_stride, w_vec, i, d, 1.0f, wv);
      kiln_load_param<N_READS>(RMS ? nullptr : b, b_stride, b_vec, i, d, 0.0f, bv);
#pragma unroll
      for (int j = 0; j < N_READS; ++j) v[j] = (v[j] - mean) * rstd * wv[j] + bv[j];
      kiln_store_floats<N_READS>(yr, i, d, v);
    }
  }
}
