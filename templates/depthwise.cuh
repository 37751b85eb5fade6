// Shared by the depthwise kernels (conv_depthwise_rows.cu, conv_depthwise_cols.cu).

// The end of a depthwise backward-weight block whose threads each hold the KSIZE x V tap sums
// `sum` of their V channels (tx * V on, of the block's `chans` from channel c0) in one column
// group (ty): the groups' sums are added in group order through the shared `sums` (blockDim.y x
// KSIZE x chans f32, free for this), and the block writes its f32 partial (blockIdx.x's of the
// split sum's) or, where `partial` is null, the gradient itself. `out_c` channels in all; the
// weight's tap is KSIZE - 1 - t where `reverse`. Every thread of the block calls it.
template <int KSIZE, int V, typename T>
__device__ __forceinline__ void kiln_depthwise_block_sums(const float (&sum)[KSIZE][V],
                                                          float* sums, int chans, int c0,
                                                          int out_c, bool reverse,
                                                          T* __restrict__ out,
                                                          float* __restrict__ partial) {
  const int tx = threadIdx.x, ty = threadIdx.y, groups = blockDim.y;
#pragma unroll
  for (int t = 0; t < KSIZE; ++t)
#pragma unroll
    for (int v = 0; v < V; ++v) sums[(ty * KSIZE + t) * chans + tx * V + v] = sum[t][v];
  __syncthreads();
  const long long weights = (long long)out_c * KSIZE;
  for (int e = ty * blockDim.x + tx; e < KSIZE * chans; e += blockDim.x * groups) {
    const int t = e / chans, k = e - t * chans;
    if (c0 + k >= out_c) continue;
    float total = 0.0f;
    for (int w = 0; w < groups; ++w) total += sums[(w * KSIZE + t) * chans + k];
    const long long at = (long long)(c0 + k) * KSIZE + (reverse ? KSIZE - 1 - t : t);
    if (partial)
      partial[blockIdx.x * weights + at] = total;
    else
      out[at] = kiln_from_float<T>(total);
  }
}
