// Runs one launch of a norm_fwd or norm_vjp kernel (-DKILN_VJP) on the host (see cuda_host.h).
// KILN_KERNEL names the rendered kernel source, whose static shared arrays the test has made
// `static` (blocks run one at a time, so a block's threads share them as on the GPU) and whose
// dynamic ones (`ring`, `acc_dyn`) are defined here. KILN_ENTRY names the kernel. Usage:
// run_norm IN OUT. IN holds, little-endian: grid and block (u32 each), dynamic shared bytes
// (u64), rows (i64), d (i32), eps (f32), the row strides of x and the cotangent (i64 each), the
// weight's stride (i64) and vector flag (i32), the bias's (forward), the VJP's smem_partials
// flag (i32), then x, the weight, the bias and the cotangent as (bytes u64, data) each (no
// bytes: a null pointer), then the output's bytes and the f32 counts of the dweight and dbias
// partials (u64 each; 0: a null pointer). OUT receives the output, then the partials. Outputs
// start as all-ones bytes (a NaN in every dtype), so an element the kernel never writes shows.
#include "cuda_host.h"
#include "host_input.h"

#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include KILN_KERNEL

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

// The running block's dynamic shared memory, under the names the templates give it.
constexpr size_t kSharedBytes = 256 * 1024;
alignas(16) kiln_vec<T, N_READS> ring[kSharedBytes / sizeof(kiln_vec<T, N_READS>)];
#ifdef KILN_VJP
alignas(16) float acc_dyn[kSharedBytes / sizeof(float)];
#endif

template <typename P> static P* or_null(std::vector<unsigned char>& v) {
  return v.empty() ? nullptr : reinterpret_cast<P*>(v.data());
}

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::ifstream in(argv[1], std::ios::binary);
  const unsigned grid = take<unsigned>(in), block = take<unsigned>(in);
  const uint64_t shared = take<uint64_t>(in);
  const long long rows = take<long long>(in);
  const int d = take<int>(in);
  const float eps = take<float>(in);
  const long long x_stride = take<long long>(in), g_stride = take<long long>(in);
  const long long w_stride = take<long long>(in);
  const int w_vec = take<int>(in);
  const long long b_stride = take<long long>(in);
  const int b_vec = take<int>(in), smem_partials = take<int>(in);
  std::vector<unsigned char> x = take_bytes(in), w = take_bytes(in), b = take_bytes(in),
                             g = take_bytes(in);
  std::vector<unsigned char> out(take<uint64_t>(in), 0xff);
  std::vector<float> pw(take<uint64_t>(in), NAN), pb(take<uint64_t>(in), NAN);
  if (!in || shared > kSharedBytes) return 3;
  if (block != BLOCK_DIM || grid == 0) {
    std::fprintf(stderr, "a launch the kernel does not take: grid %u, block %u (BLOCK_DIM %d)\n",
                 grid, block, BLOCK_DIM);
    return 5;
  }
#if defined(__SANITIZE_ADDRESS__)
  // Shared memory past what the launch asked for is out of bounds.
  ASAN_POISON_MEMORY_REGION(reinterpret_cast<char*>(ring) + shared, kSharedBytes - shared);
#ifdef KILN_VJP
  ASAN_POISON_MEMORY_REGION(reinterpret_cast<char*>(acc_dyn) + shared, kSharedBytes - shared);
#endif
#endif
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};
  // One OS thread a block thread, made once: each walks the blocks in order, and a block ends at
  // a barrier of all its threads (see run_direct.cpp).
  std::barrier<> barrier(block);
  std::vector<kiln_host_warp> warps(block / 32);
  // One named barrier per group of GROUP threads (kiln_group_barrier).
  std::vector<std::unique_ptr<std::barrier<>>> groups;
  for (int i = 0; i < BLOCK_DIM / GROUP; ++i) groups.push_back(std::make_unique<std::barrier<>>(GROUP));
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < block; ++t)
    pool.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      kiln_host_barrier = &barrier;
      kiln_host_this_warp = &warps[t / 32];
      kiln_host_lane = t % 32;
      kiln_host_group = groups[t / GROUP].get();
      kiln_host_group_size = GROUP;
      for (unsigned bx = 0; bx < grid; ++bx) {
        blockIdx = {bx, 0, 0};
#ifdef KILN_VJP
        KILN_ENTRY(or_null<const T>(x), or_null<const T>(w), or_null<const T>(g), or_null<T>(out),
                   pw.empty() ? nullptr : pw.data(), pb.empty() ? nullptr : pb.data(), rows, d,
                   x_stride, g_stride, w_stride, w_vec, eps, smem_partials);
#else
        KILN_ENTRY(or_null<const T>(x), or_null<const T>(w), or_null<const T>(b), or_null<T>(out),
                   rows, d, x_stride, w_stride, b_stride, w_vec, b_vec, eps);
#endif
        barrier.arrive_and_wait();  // the block is done before the next one starts
      }
    });
  for (auto& t : pool) t.join();
  std::ofstream o(argv[2], std::ios::binary);
  o.write(reinterpret_cast<const char*>(out.data()), out.size());
  o.write(reinterpret_cast<const char*>(pw.data()), pw.size() * sizeof(float));
  o.write(reinterpret_cast<const char*>(pb.data()), pb.size() * sizeof(float));
  return o ? 0 : 4;
}
