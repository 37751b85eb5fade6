// Runs one launch of a split-row norm kernel (norm_fwd_split, norm_fwd_staged with
// -DKILN_STAGED, norm_vjp_split with -DKILN_VJP) on the host, a cluster at a time, its blocks at
// once (see cuda_host_cluster.h). KILN_KERNEL names the rendered kernel source, whose shared
// declarations the test has rewritten into kiln_host_shared / kiln_host_dynamic_shared calls.
// Usage: run_norm_split IN OUT. IN holds, little-endian: grid and block (u32 each), dynamic
// shared bytes (u64), rows (i64), d (i32), eps (f32), the row strides of x and the cotangent
// (i64 each), the weight's stride (i64) and vector flag (i32), the bias's, the VJP's
// smem_partials flag (i32), whether the staged forward gets a rows' counter (i32), then x, the
// weight, the bias and the cotangent as (bytes u64, data) each (no bytes: a null pointer), then
// the output's bytes and the f32 counts of the dweight and dbias partials (u64 each; 0: a null
// pointer). OUT receives the output, the partials, then the counter's final value (u64).
// Outputs start as all-ones bytes (a NaN in every dtype), so an element never written shows.
#include "cuda_host_cluster.h"
#include "host_input.h"

#include <memory>
#include <thread>

#include KILN_KERNEL

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

template <typename P> static P* or_null(std::vector<unsigned char>& v) {
  return v.empty() ? nullptr : reinterpret_cast<P*>(v.data());
}

// An input as the GPU's allocator would hold it: whole 256-byte units at a 256-byte aligned
// address (the kernels' bulk copies read the 16-byte granules around a row's ends).
struct Device {
  std::unique_ptr<unsigned char[], void (*)(void*)> data{nullptr, std::free};
  size_t bytes = 0;
  explicit Device(const std::vector<unsigned char>& v) : bytes(v.size()) {
    if (v.empty()) return;
    const size_t padded = (v.size() + 255) / 256 * 256;
    data.reset(static_cast<unsigned char*>(std::aligned_alloc(256, padded)));
    std::memset(data.get(), 0xff, padded);
    std::memcpy(data.get(), v.data(), v.size());
  }
  template <typename P> P* get() { return reinterpret_cast<P*>(data.get()); }
};

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::ifstream in(argv[1], std::ios::binary);
  const unsigned grid = take<unsigned>(in), block = take<unsigned>(in);
  const uint64_t shared = take<uint64_t>(in);
  const long long rows = take<long long>(in);
  const int d = take<int>(in);
  const float eps = take<float>(in);
  // Each entry point takes some of these (KILN_VJP, KILN_STAGED or neither).
  [[maybe_unused]] const long long x_stride = take<long long>(in), g_stride = take<long long>(in);
  [[maybe_unused]] const long long w_stride = take<long long>(in);
  [[maybe_unused]] const int w_vec = take<int>(in);
  [[maybe_unused]] const long long b_stride = take<long long>(in);
  [[maybe_unused]] const int b_vec = take<int>(in), smem_partials = take<int>(in),
                             counted = take<int>(in);
  Device x(take_bytes(in)), w(take_bytes(in)), b(take_bytes(in)), g(take_bytes(in));
  std::vector<unsigned char> out(take<uint64_t>(in), 0xff);
  std::vector<float> pw(take<uint64_t>(in), NAN), pb(take<uint64_t>(in), NAN);
  if (!in || shared > kiln_host_arena_bytes - kiln_host_static_bytes) return 3;
  if (block != BLOCK_DIM || grid == 0 || grid % CLUSTER != 0) {
    std::fprintf(stderr,
                 "a launch the kernel does not take: grid %u, block %u (BLOCK_DIM %d, CLUSTER %d)\n",
                 grid, block, BLOCK_DIM, CLUSTER);
    return 5;
  }
  unsigned long long counter = 0;

  // The cluster's arenas, poisoned past each block's dynamic shared bytes.
  const size_t arena_bytes = CLUSTER * kiln_host_arena_bytes;
  std::unique_ptr<unsigned char[], void (*)(void*)> arenas(
      static_cast<unsigned char*>(std::aligned_alloc(256, arena_bytes)), std::free);
  kiln_host_arenas = arenas.get();
  kiln_host_cluster_size = CLUSTER;
  std::memset(kiln_host_arenas, 0xa5, arena_bytes);
#if defined(__SANITIZE_ADDRESS__)
  for (int r = 0; r < CLUSTER; ++r)
    ASAN_POISON_MEMORY_REGION(kiln_host_arena(r) + kiln_host_static_bytes + shared,
                              kiln_host_arena_bytes - kiln_host_static_bytes - shared);
#endif
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};

  // Per block: its barrier, warps and named barriers 1 and 2; one barrier for the cluster.
  struct Block {
    std::barrier<> barrier{BLOCK_DIM};
    std::vector<kiln_host_warp> warps = std::vector<kiln_host_warp>(BLOCK_DIM / 32);
    std::barrier<> named1{BLOCK_DIM}, named2{BLOCK_DIM};
  };
  std::vector<std::unique_ptr<Block>> blocks;
  for (int r = 0; r < CLUSTER; ++r) blocks.push_back(std::make_unique<Block>());
  std::barrier<> cluster(CLUSTER * BLOCK_DIM);
  // A run that hangs (a cluster barrier some thread never reaches) fails instead.
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::minutes(5));
    std::fprintf(stderr, "host emulation: the launch did not end in 5 minutes\n");
    std::abort();
  }).detach();
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < CLUSTER * block; ++t)
    pool.emplace_back([&, t] {
      const unsigned rank = t / block;
      Block& own = *blocks[rank];
      threadIdx = {t % block, 0, 0};
      kiln_host_rank = rank;
      kiln_host_barrier = &own.barrier;
      kiln_host_this_warp = &own.warps[(t % block) / 32];
      kiln_host_lane = t % 32;
      kiln_host_cluster_barrier = &cluster;
      kiln_host_named[1] = &own.named1;
      kiln_host_named[2] = &own.named2;
      for (unsigned c = 0; c < grid / CLUSTER; ++c) {
        blockIdx = {c * CLUSTER + rank, 0, 0};
        kiln_host_static_cursor = 0;
#if defined(KILN_VJP)
        KILN_ENTRY(x.get<const T>(), w.get<const T>(), g.get<const T>(), or_null<T>(out),
                   pw.empty() ? nullptr : pw.data(), pb.empty() ? nullptr : pb.data(), rows, d,
                   x_stride, g_stride, w_stride, w_vec, eps, smem_partials);
#elif defined(KILN_STAGED)
        KILN_ENTRY(x.get<const T>(), w.get<const T>(), b.get<const T>(), or_null<T>(out), rows, d,
                   x_stride, w_stride, b_stride, w_vec, b_vec, eps, counted ? &counter : nullptr);
#else
        KILN_ENTRY(x.get<const T>(), w.get<const T>(), b.get<const T>(), or_null<T>(out), rows, d,
                   x_stride, w_stride, b_stride, w_vec, b_vec, eps);
#endif
        // The next cluster starts on shared memory this one left (as garbage: not zeroed).
        cluster.arrive_and_wait();
      }
    });
  for (auto& t : pool) t.join();
  std::ofstream o(argv[2], std::ios::binary);
  o.write(reinterpret_cast<const char*>(out.data()), out.size());
  o.write(reinterpret_cast<const char*>(pw.data()), pw.size() * sizeof(float));
  o.write(reinterpret_cast<const char*>(pb.data()), pb.size() * sizeof(float));
  o.write(reinterpret_cast<const char*>(&counter), sizeof counter);
  return o ? 0 : 4;
}
