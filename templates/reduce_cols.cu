// out_s[c] = sum over r of partial[(s * rows + r) * d + c] for each set s = blockIdx.y: the column
// sums of f32 [rows, d] matrices, accumulated in f32 and stored as {{dtype_name}}. A block covers
// 32 columns (coalesced) with 32 row lanes, combined in shared memory; each lane keeps four
// independent sums so that four loads are in flight at once.
{{> prelude}}

typedef {{dtype}} T;

constexpr int LANES = {{block_dim}} / 32;
constexpr int UNROLL = 4;

extern "C" __global__ void __launch_bounds__({{block_dim}}) {{kernel}}(
    const float* __restrict__ partial, T* __restrict__ out0, T* __restrict__ out1, long long rows,
    int d) {
  __shared__ float tile[LANES][33];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int c = blockIdx.x * 32 + tx;
  const float* p = partial + (long long)blockIdx.y * rows * d + c;
  T* out = blockIdx.y == 0 ? out0 : out1;
  float s[UNROLL] = {};
  if (c < d) {
    long long r = ty;
    for (; r + (UNROLL - 1) * LANES < rows; r += UNROLL * LANES) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) s[u] += p[(r + u * LANES) * d];
    }
    for (; r < rows; r += LANES) s[0] += p[r * d];
  }
  tile[ty][tx] = (s[0] + s[1]) + (s[2] + s[3]);
  __syncthreads();
  if (ty == 0 && c < d) {
    float t = 0.0f;
#pragma unroll
    for (int i = 0; i < LANES; ++i) t += tile[i][tx];
    out[c] = kiln_from_float<T>(t);
  }
}
