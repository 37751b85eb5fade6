// A probe, not part of kiln: depthwise 3x3 stride-1 pad-1 forward, f16 channels-last, small images.
// Build and run on a GPU machine: nvcc -O3 -std=c++17 -arch=sm_90 -o dw depthwise-small-image-probe.cu && ./dw
// A thread: V channels x TX output columns, every output row of its image, rolling 3-row window
// in f32 registers, loads straight from global memory, the next row's loads a step ahead (PF).
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cmath>

struct P { int n, h, w, c; };

template <int V> struct Raw { uint32_t u[V / 2]; };

template <int V>
__device__ __forceinline__ Raw<V> ld(const __half* p, bool ok) {
  Raw<V> r;
  if constexpr (V == 8) {
    uint4 x = ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
    r.u[0] = x.x; r.u[1] = x.y; r.u[2] = x.z; r.u[3] = x.w;
  } else if constexpr (V == 4) {
    uint2 x = ok ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0, 0);
    r.u[0] = x.x; r.u[1] = x.y;
  } else {
    r.u[0] = ok ? __ldg(reinterpret_cast<const unsigned*>(p)) : 0u;
  }
  return r;
}

template <int V>
__device__ __forceinline__ void cvt(const Raw<V>& r, float* f) {
#pragma unroll
  for (int i = 0; i < V / 2; ++i) {
    __half2 h = *reinterpret_cast<const __half2*>(&r.u[i]);
    float2 a = __half22float2(h);
    f[2 * i] = a.x; f[2 * i + 1] = a.y;
  }
}

template <int V, int TX, bool PF>
__global__ void __launch_bounds__(128) dw(const __half* __restrict__ x, const __half* __restrict__ wt,
                                           __half* __restrict__ y, P p) {
  constexpr int WIN = TX + 2;
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.c / V) return;
  const int x0 = blockIdx.y * TX, n = blockIdx.z, c = g * V;
  float w[9][V];
#pragma unroll
  for (int t = 0; t < 9; ++t)
#pragma unroll
    for (int k = 0; k < V; ++k) w[t][k] = __half2float(wt[(c + k) * 9 + t]);
  const long long img = (long long)n * p.h * p.w * p.c;
  const __half* xi = x + img + c;
  __half* yi = y + img + c;
  bool colok[WIN];
#pragma unroll
  for (int j = 0; j < WIN; ++j) colok[j] = (unsigned)(x0 - 1 + j) < (unsigned)p.w;
  const __half* colp = xi + (long long)(x0 - 1) * p.c;
  auto load_row = [&](int row, Raw<V>* dst) {
    const bool rok = (unsigned)row < (unsigned)p.h;
    const __half* rp = colp + (long long)row * p.w * p.c;
#pragma unroll
    for (int j = 0; j < WIN; ++j) dst[j] = ld<V>(rp + j * p.c, rok && colok[j]);
  };
  float r[3][WIN][V];
  Raw<V> raw[WIN];
  load_row(-1, raw);
#pragma unroll
  for (int j = 0; j < WIN; ++j) cvt<V>(raw[j], r[0][j]);
  load_row(0, raw);
#pragma unroll
  for (int j = 0; j < WIN; ++j) cvt<V>(raw[j], r[1][j]);
  if (PF) load_row(1, raw);
  for (int oy = 0; oy < p.h; ++oy) {
    if (!PF) load_row(oy + 1, raw);
#pragma unroll
    for (int j = 0; j < WIN; ++j) cvt<V>(raw[j], r[2][j]);
    if (PF) load_row(oy + 2, raw);
#pragma unroll
    for (int j = 0; j < TX; ++j) {
      if (x0 + j >= p.w) break;
      float acc[V];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = 0.f;
#pragma unroll
      for (int kh = 0; kh < 3; ++kh)
#pragma unroll
        for (int kw = 0; kw < 3; ++kw)
#pragma unroll
          for (int k = 0; k < V; ++k) acc[k] = fmaf(w[kh * 3 + kw][k], r[kh][j + kw][k], acc[k]);
      Raw<V> o;
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {
        __half2 h = __floats2half2_rn(acc[2 * i], acc[2 * i + 1]);
        o.u[i] = *reinterpret_cast<uint32_t*>(&h);
      }
      __half* dst = yi + ((long long)oy * p.w + x0 + j) * p.c;
      if constexpr (V == 8) *reinterpret_cast<uint4*>(dst) = make_uint4(o.u[0], o.u[1], o.u[2 % (V / 2)], o.u[3 % (V / 2)]);
      else if constexpr (V == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(o.u[0], o.u[1 % (V / 2)]);
      else *reinterpret_cast<unsigned*>(dst) = o.u[0];
    }
#pragma unroll
    for (int j = 0; j < WIN; ++j)
#pragma unroll
      for (int k = 0; k < V; ++k) { r[0][j][k] = r[1][j][k]; r[1][j][k] = r[2][j][k]; }
  }
}

__global__ void copyk(const uint4* a, uint4* b, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) b[i] = a[i];
}

static std::vector<__half> hx, hw;

template <int V, int TX, bool PF>
void run(P p, const __half* x, const __half* w, __half* y, double bytes) {
  dim3 block(128), grid((p.c / V + 127) / 128, (p.w + TX - 1) / TX, p.n);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 5; ++i) dw<V, TX, PF><<<grid, block>>>(x, w, y, p);
  cudaEventRecord(a);
  for (int i = 0; i < 100; ++i) dw<V, TX, PF><<<grid, block>>>(x, w, y, p);
  cudaEventRecord(b); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b);
  float us = ms * 10;
  size_t elems = (size_t)p.n * p.h * p.w * p.c;
  std::vector<__half> hy(elems); cudaMemcpy(hy.data(), y, elems * 2, cudaMemcpyDeviceToHost);
  double maxerr = 0;
  for (size_t s = 0; s < 3000; ++s) {
    size_t i = (s * 7919 * 131 + s) % elems; int c = i % p.c; size_t pix = i / p.c; int xx = pix % p.w; int yy = (pix / p.w) % p.h; int n = pix / p.w / p.h;
    double acc = 0;
    for (int kh = 0; kh < 3; ++kh) for (int kw = 0; kw < 3; ++kw) { int r = yy + kh - 1, q = xx + kw - 1; if (r < 0 || r >= p.h || q < 0 || q >= p.w) continue;
      acc += (double)__half2float(hw[c * 9 + kh * 3 + kw]) * __half2float(hx[(((size_t)n * p.h + r) * p.w + q) * p.c + c]); }
    maxerr = fmax(maxerr, fabs(acc - __half2float(hy[i])));
  }
  printf("  V%d TX%d PF%d %6.2f us %3.0f%% err %.4f", V, TX, (int)PF, us, bytes / us / 1e3 / 4164 * 100, maxerr);
  cudaMemset(y, 0, elems * 2);
}

int main() {
  P ps[] = {{64, 7, 7, 960}, {64, 14, 14, 576}, {32, 9, 9, 1280}, {16, 20, 20, 480}, {64, 28, 28, 192}, {64, 56, 56, 144}};
  for (P p : ps) {
    size_t elems = (size_t)p.n * p.h * p.w * p.c;
    hx.resize(elems); hw.resize(p.c * 9);
    for (size_t i = 0; i < elems; ++i) hx[i] = __float2half((float)((i * 2654435761u) % 1000) / 500.f - 1.f);
    for (int i = 0; i < p.c * 9; ++i) hw[i] = __float2half((float)((i * 40503u) % 100) / 50.f - 1.f);
    __half *x, *w, *y; cudaMalloc(&x, elems * 2); cudaMalloc(&w, p.c * 18); cudaMalloc(&y, elems * 2);
    cudaMemcpy(x, hx.data(), elems * 2, cudaMemcpyHostToDevice); cudaMemcpy(w, hw.data(), p.c * 18, cudaMemcpyHostToDevice);
    double bytes = elems * 4.0;
    printf("%dx%dx%dx%d (%.1f MB)", p.n, p.c, p.h, p.w, bytes / 1e6);

    run<2, 1, true>(p, x, w, y, bytes); run<2, 2, true>(p, x, w, y, bytes); run<2, 3, true>(p, x, w, y, bytes); run<2, 4, true>(p, x, w, y, bytes); run<2, 7, true>(p, x, w, y, bytes);
    printf("\n");
    cudaFree(x); cudaFree(w); cudaFree(y);
  }
}
