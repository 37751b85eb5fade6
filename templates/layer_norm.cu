// LayerNorm forward: y = (x - mean) / sqrt(var + eps) * w + b over each row's last axis.
// One block per row; each thread handles N_READS consecutive elements per step. Accumulation
// is in f32, and the variance is taken around the mean (two passes) for accuracy.
{{> prelude}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};
constexpr int N_READS = {{n_reads}};
constexpr bool HAS_W = {{HAS_W}};
constexpr bool HAS_B = {{HAS_B}};

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    int d, long long x_row_stride, long long w_stride, long long b_stride, float eps) {
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  x += row * x_row_stride;
  y += row * (long long)d;
  const int start = threadIdx.x * N_READS;
  constexpr int STEP = BLOCK_DIM * N_READS;

  float sum = 0.0f;
  for (int i = start; i < d; i += STEP) {
    float v[N_READS];
    kiln_load_floats<N_READS>(x, i, d, v);
#pragma unroll
    for (int k = 0; k < N_READS; ++k) sum += v[k];
  }
  const float mean = kiln_block_sum<BLOCK_DIM>(sum, scratch) / d;

  float sq = 0.0f;
  for (int i = start; i < d; i += STEP) {
    float v[N_READS];
    kiln_load_floats<N_READS>(x, i, d, v);
#pragma unroll
    for (int k = 0; k < N_READS; ++k) {
      const float c = (i + k < d) ? v[k] - mean : 0.0f;
      sq += c * c;
    }
  }
  const float rstd = rsqrtf(kiln_block_sum<BLOCK_DIM>(sq, scratch) / d + eps);

  for (int i = start; i < d; i += STEP) {
    float v[N_READS];
    kiln_load_floats<N_READS>(x, i, d, v);
#pragma unroll
    for (int k = 0; k < N_READS; ++k) {
      const int j = i + k < d ? i + k : 0;
      float o = (v[k] - mean) * rstd;
      if (HAS_W) o *= kiln_to_float(w[j * w_stride]);
      if (HAS_B) o += kiln_to_float(b[j * b_stride]);
      v[k] = o;
    }
    kiln_store_floats<N_READS>(y, i, d, v);
  }
}
