// out[c] = sum over r of partial[r * d + c]: the column sums of an f32 [rows, d] matrix,
// accumulated in f32 and stored as {{dtype_name}}. A block covers 32 columns (coalesced) with 32
// row lanes, combined in shared memory.
{{> prelude}}

typedef {{dtype}} T;

constexpr int LANES = {{block_dim}} / 32;

extern "C" __global__ void __launch_bounds__({{block_dim}}) {{kernel}}(
    const float* __restrict__ partial, T* __restrict__ out, long long rows, int d) {
  __shared__ float tile[LANES][33];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int c = blockIdx.x * 32 + tx;
  float s = 0.0f;
  if (c < d) {
    for (long long r = ty; r < rows; r += LANES) s += partial[r * d + c];
  }
  tile[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < d) {
    float t = 0.0f;
#pragma unroll
    for (int i = 0; i < LANES; ++i) t += tile[i][tx];
    out[c] = kiln_from_float<T>(t);
  }
}
