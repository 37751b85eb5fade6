// Backward-weight with a split reduction: out[i] = sum over s of partial[s * n + i], as the
// weight's dtype. One f32 partial per split keeps the weight gradient's sum in f32 and the
// result deterministic.
{{> prelude}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const float* __restrict__ partial, T* __restrict__ out, long long n, int splits) {
  for (long long i = blockIdx.x * (long long)BLOCK_DIM + threadIdx.x; i < n;
       i += (long long)gridDim.x * BLOCK_DIM) {
    float s = 0.0f;
    for (int k = 0; k < splits; ++k) s += partial[k * n + i];
    out[i] = kiln_from_float<T>(s);
  }
}
