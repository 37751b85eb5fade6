// Strided copy into a strided destination, {{dtype_name}} to {{dtype_name}}, with zeros past the
// source's extents. The index space has `rank` axes (innermost last) held at the back of the
// arrays in `p`; for each coordinate c, dst[sum c * dst_strides] = src[sum c * src_strides]
// where every c[d] < bound[d], else zero (everywhere when src is null: a fill). Axes the host
// could merge are merged, so most copies decode two to five axes.
{{> prelude}}

typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};

struct kiln_into_layout {
  long long extent[KILN_MAX_RANK];
  long long src_strides[KILN_MAX_RANK];  // in elements
  long long dst_strides[KILN_MAX_RANK];
  long long bound[KILN_MAX_RANK];        // the source's extent along each axis
  // Division by extent[d] as a multiply-high and a shift (as CUTLASS's FastDivmod), valid for
  // dividends below 2^31; magic 0 means extent 1.
  unsigned int magic[KILN_MAX_RANK];
  unsigned int shift[KILN_MAX_RANK];
};

extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const T* __restrict__ src, T* __restrict__ dst, long long n, int rank, int narrow,
    kiln_into_layout p) {
  const int first = KILN_MAX_RANK - rank;
  if (narrow) {
    // Every index and offset fits in 31 bits: 32-bit arithmetic, no division instruction.
    for (unsigned int i = blockIdx.x * BLOCK_DIM + threadIdx.x; i < (unsigned int)n;
         i += gridDim.x * BLOCK_DIM) {
      unsigned int rem = i;
      int from = 0, to = 0;
      bool inside = src != nullptr;
#pragma unroll
      for (int d = KILN_MAX_RANK - 1; d >= 0; --d) {
        if (d >= first) {
          const unsigned int q = p.magic[d] ? __umulhi(rem, p.magic[d]) >> p.shift[d] : rem;
          const int c = (int)(rem - q * (unsigned int)p.extent[d]);
          from += c * (int)p.src_strides[d];
          to += c * (int)p.dst_strides[d];
          inside = inside && c < (int)p.bound[d];
          rem = q;
        }
      }
      if (inside) {
        dst[to] = src[from];
      } else {
        dst[to] = T{};
      }
    }
  } else {
    for (long long i = blockIdx.x * (long long)BLOCK_DIM + threadIdx.x; i < n;
         i += (long long)gridDim.x * BLOCK_DIM) {
      long long rem = i, from = 0, to = 0;
      bool inside = src != nullptr;
#pragma unroll
      for (int d = KILN_MAX_RANK - 1; d >= 0; --d) {
        if (d >= first) {
          const long long c = rem % p.extent[d];
          from += c * p.src_strides[d];
          to += c * p.dst_strides[d];
          inside = inside && c < p.bound[d];
          rem /= p.extent[d];
        }
      }
      if (inside) {
        dst[to] = src[from];
      } else {
        dst[to] = T{};
      }
    }
  }
}
