// out[i] = a * x[i] + b * y[i] over contiguous arrays (out may alias x or y), in f32.
{{> prelude}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const T* x, const T* y, T* out, long long n, float a, float b) {
  for (long long i = blockIdx.x * (long long)BLOCK_DIM + threadIdx.x; i < n;
       i += (long long)gridDim.x * BLOCK_DIM) {
    out[i] = kiln_from_float<T>(a * kiln_to_float(x[i]) + b * kiln_to_float(y[i]));
  }
}
