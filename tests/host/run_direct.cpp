// Runs one launch of a conv_direct, conv_depthwise, conv_grouped or conv_stem kernel on the host (see
// cuda_host.h). KILN_KERNEL names the rendered kernel source, KILN_ENTRY its kernel and
// KILN_PROBLEM its problem struct (conv_direct's by default); the families take the same
// arguments. Usage: run_direct IN OUT. IN holds, little-endian: grid and block (3 x
// u32 each), dynamic shared bytes (u64), the problem (sizeof(KILN_PROBLEM) bytes), then the
// source, the second operand and the output as (bytes u64, data) each and the partials' f32
// count (u64). OUT receives the output's bytes, then the partials. The output starts as all-ones
// bytes (a NaN in every dtype), so an element the kernel never writes shows.
#include "cuda_host.h"
#include "host_input.h"

#include <fstream>
#include <thread>
#include <vector>

#include KILN_KERNEL

#ifndef KILN_ENTRY
#define KILN_ENTRY kiln_conv_direct
#define KILN_PROBLEM kiln_direct
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

// The running block's dynamic shared memory (the template's extern __shared__ array).
constexpr size_t kSharedFloat4s = 1 << 16;
float4 kiln_w4[kSharedFloat4s];

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::ifstream in(argv[1], std::ios::binary);
  unsigned g[3], b[3];
  for (auto& x : g) x = take<unsigned>(in);
  for (auto& x : b) x = take<unsigned>(in);
  const uint64_t shared = take<uint64_t>(in);
  const KILN_PROBLEM p = take<KILN_PROBLEM>(in);
  std::vector<unsigned char> src = take_bytes(in), second = take_bytes(in);
  std::vector<unsigned char> out(take<uint64_t>(in), 0xff);
  std::vector<float> partial(take<uint64_t>(in), NAN);
  if (!in || shared > sizeof kiln_w4) return 3;
  // What a CUDA launch refuses: more than 1024 threads a block, 1024 along x or y, 64 along
  // z; more than 65535 blocks along y or z.
  if (b[0] * b[1] * b[2] > 1024 || b[0] > 1024 || b[1] > 1024 || b[2] > 64 || g[1] > 65535 ||
      g[2] > 65535 || g[0] == 0 || g[1] == 0 || g[2] == 0) {
    std::fprintf(stderr, "a launch CUDA refuses: grid %u %u %u, block %u %u %u\n", g[0], g[1], g[2],
                 b[0], b[1], b[2]);
    return 5;
  }
#if defined(__SANITIZE_ADDRESS__)
  // Shared memory past what the launch asked for is out of bounds.
  ASAN_POISON_MEMORY_REGION(reinterpret_cast<char*>(kiln_w4) + shared, sizeof kiln_w4 - shared);
#endif
  gridDim = {g[0], g[1], g[2]};
  blockDim = {b[0], b[1], b[2]};
  const unsigned threads = b[0] * b[1] * b[2];
  // One OS thread a block thread, made once: each walks the blocks in order, and a block ends at
  // a barrier of all its threads (creating a block's threads for every block was most of the
  // harness's time under the sanitizers).
  std::barrier<> barrier(threads);
  // Warps for the collective operations, where the block is whole warps.
  std::vector<kiln_host_warp> warps(threads % 32 == 0 ? threads / 32 : 0);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      threadIdx = {t % b[0], t / b[0] % b[1], t / (b[0] * b[1])};
      kiln_host_barrier = &barrier;
      kiln_host_this_warp = warps.empty() ? nullptr : &warps[t / 32];
      kiln_host_lane = t % 32;
      for (unsigned bz = 0; bz < g[2]; ++bz)
        for (unsigned by = 0; by < g[1]; ++by)
          for (unsigned bx = 0; bx < g[0]; ++bx) {
            blockIdx = {bx, by, bz};
            KILN_ENTRY(reinterpret_cast<const T*>(src.data()),
                       reinterpret_cast<const T*>(second.data()), reinterpret_cast<T*>(out.data()),
                       partial.empty() ? nullptr : partial.data(), p);
            barrier.arrive_and_wait();  // the block is done before the next one starts
          }
    });
  for (auto& t : pool) t.join();
  std::ofstream o(argv[2], std::ios::binary);
  o.write(reinterpret_cast<const char*>(out.data()), out.size());
  o.write(reinterpret_cast<const char*>(partial.data()), partial.size() * sizeof(float));
  return o ? 0 : 4;
}
