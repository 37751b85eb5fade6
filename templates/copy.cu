// Strided copy with cast: gathers any view (shape, strides in elements) into a contiguous array,
// converting {{dtype_name}} to the OUT_DTYPE type through f32 (exact for every pair kiln has).
{{> prelude}}

typedef {{dtype}} TIn;
typedef kiln_dtype<{{OUT_DTYPE}}>::type TOut;
constexpr int BLOCK_DIM = {{block_dim}};

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const TIn* __restrict__ src, TOut* __restrict__ dst, long long n, int rank, kiln_layout layout) {
  for (long long i = blockIdx.x * (long long)BLOCK_DIM + threadIdx.x; i < n;
       i += (long long)gridDim.x * BLOCK_DIM) {
    long long rem = i, offset = 0;
    for (int d = rank - 1; d >= 0; --d) {
      const long long extent = layout.shape[d];
      offset += (rem % extent) * layout.strides[d];
      rem /= extent;
    }
    dst[i] = kiln_from_float<TOut>(kiln_to_float(src[offset]));
  }
}
