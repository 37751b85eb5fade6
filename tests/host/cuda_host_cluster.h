// Thread-block clusters on the host, for the split-row norm kernels (tests/host_norm_split.rs),
// on top of cuda_host.h: a cluster's blocks run at once, each block's threads OS threads. What
// the kernels use of sm_90, emulated:
// - shared memory: each block of the cluster has an arena (static variables first, bump-allocated
//   in declaration order, then the dynamic shared memory); a shared address (the 32-bit
//   `.shared::cluster` addresses of mapa, st.async and the bulk copies) is an offset into the
//   cluster's arenas, so that mapa is arithmetic;
// - mbarriers: the 64-bit word holds the phase, the arrivals still expected and the transaction
//   bytes, changed under one lock; a waiter sleeps on a condition variable until its phase ends;
// - st.async and bulk copies (cp.async.bulk): copied at once, then their bytes counted down on
//   the receiving barrier, so a waiter sees the data;
// - cluster barriers, named barriers (bar.arrive / bar.sync), the atomics on the rows' counter.
// Memory ordering and timing are the GPU tests' part: this checks index arithmetic, bounds, the
// exchanges' protocol (a wrong count of bytes or arrivals hangs or aborts) and the results.
#pragma once

#include "cuda_host.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>

#define __align__(n) alignas(n)
#define __cluster_dims__(...)

[[noreturn]] inline void kiln_host_unsupported(const char* what) {
  std::fprintf(stderr, "host emulation: %s is not emulated\n", what);
  std::abort();
}
[[noreturn]] inline void __trap() {
  std::fprintf(stderr, "host emulation: the kernel trapped\n");
  std::abort();
}

inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_add(v);
}
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).exchange(v);
}

// __shfl_sync on a 64-bit integer, as two words through the warp's fragment slots.
inline long long __shfl_sync(unsigned, long long v, int src) {
  kiln_host_warp* w = kiln_host_warp_or_abort();
  unsigned long long u = (unsigned long long)v;
  w->a[kiln_host_lane][0] = (unsigned)u;
  w->a[kiln_host_lane][1] = (unsigned)(u >> 32);
  w->meet.arrive_and_wait();
  const unsigned lo = w->a[src % 32][0], hi = w->a[src % 32][1];
  w->meet.arrive_and_wait();
  return (long long)(((unsigned long long)hi << 32) | lo);
}

// The cluster's shared memory: CLUSTER arenas of kiln_host_arena_bytes, one after another.
constexpr size_t kiln_host_static_bytes = 64 * 1024;
constexpr size_t kiln_host_arena_bytes = kiln_host_static_bytes + 256 * 1024;
inline unsigned char* kiln_host_arenas = nullptr;
inline unsigned kiln_host_cluster_size = 0;
inline thread_local unsigned kiln_host_rank = 0;
// This thread's next static shared variable: every thread of a block declares the same ones in
// the same order, so all find each at the same place.
inline thread_local size_t kiln_host_static_cursor = 0;
inline thread_local std::barrier<>* kiln_host_cluster_barrier = nullptr;
// This block's named barriers 1 and 2 (kiln_cluster_push_block); [0] unused.
inline thread_local std::barrier<>* kiln_host_named[3] = {};

inline unsigned char* kiln_host_arena(unsigned rank) {
  return kiln_host_arenas + rank * kiln_host_arena_bytes;
}

// A `__shared__` variable of type X (the test rewrites each declaration into a call).
template <class X> X& kiln_host_shared() {
  constexpr size_t align = alignof(X) < 16 ? 16 : alignof(X);
  const size_t at = (kiln_host_static_cursor + align - 1) / align * align;
  kiln_host_static_cursor = at + sizeof(X);
  if (kiln_host_static_cursor > kiln_host_static_bytes)
    kiln_host_unsupported("this much static shared memory");
  return *reinterpret_cast<X*>(kiln_host_arena(kiln_host_rank) + at);
}
// The block's dynamic shared memory (`extern __shared__`).
inline unsigned char* kiln_host_dynamic_shared() {
  return kiln_host_arena(kiln_host_rank) + kiln_host_static_bytes;
}

// A pointer into this cluster's shared memory as a shared address, and back.
inline unsigned kiln_host_smem_addr(const void* p) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  const size_t total = kiln_host_cluster_size * kiln_host_arena_bytes;
  if (c < kiln_host_arenas || c >= kiln_host_arenas + total) {
    std::fprintf(stderr, "host emulation: a shared address of memory that is not shared\n");
    std::abort();
  }
  return (unsigned)(c - kiln_host_arenas);
}
inline unsigned char* kiln_host_smem_ptr(unsigned addr) {
  if (addr >= kiln_host_cluster_size * kiln_host_arena_bytes) {
    std::fprintf(stderr, "host emulation: a shared address past the cluster's blocks\n");
    std::abort();
  }
  return kiln_host_arenas + addr;
}
// mapa: `local` (in this block) as block `rank` of the cluster maps it.
inline unsigned kiln_host_map(const void* local, unsigned rank) {
  if (rank >= kiln_host_cluster_size) {
    std::fprintf(stderr, "host emulation: mapa to rank %u of a cluster of %u\n", rank,
                 kiln_host_cluster_size);
    std::abort();
  }
  const unsigned offset = kiln_host_smem_addr(local) % kiln_host_arena_bytes;
  return (unsigned)(rank * kiln_host_arena_bytes + offset);
}

// mbarriers. The word: bits 0-31 the transaction bytes still expected (signed: a copy may count
// its bytes down before the arrival that expects them), 32-46 the arrivals still expected, 47-61
// the arrivals a phase takes, 63 the phase's parity.
struct kiln_host_mbarrier_state {
  std::mutex lock;
  std::condition_variable changed[64];
};
inline kiln_host_mbarrier_state kiln_host_mbarriers;

struct kiln_host_mbar {
  int tx;
  unsigned pending, count, phase;
  static kiln_host_mbar of(unsigned long long w) {
    return {(int)(unsigned)w, (unsigned)(w >> 32) & 0x7fff, (unsigned)(w >> 47) & 0x7fff,
            (unsigned)(w >> 63)};
  }
  unsigned long long word() const {
    return (unsigned long long)(unsigned)tx | (unsigned long long)pending << 32 |
           (unsigned long long)count << 47 | (unsigned long long)phase << 63;
  }
};

inline std::condition_variable& kiln_host_changed(const unsigned long long* bar) {
  return kiln_host_mbarriers.changed[((size_t)bar / 8) % 64];
}

inline void kiln_host_mbarrier_init(unsigned long long* bar, unsigned arrivals) {
  std::lock_guard<std::mutex> g(kiln_host_mbarriers.lock);
  *bar = kiln_host_mbar{0, arrivals, arrivals, 0}.word();
}

// Under the lock: `arrivals` arrivals and `bytes` more expected (an arrive.expect_tx), or bytes
// landed (negative, complete_tx); ends the phase when nothing more is expected.
inline void kiln_host_mbarrier_update(unsigned long long* bar, unsigned arrivals, long long bytes) {
  kiln_host_mbar m = kiln_host_mbar::of(*bar);
  if (m.count == 0) kiln_host_unsupported("an mbarrier used before its init");
  if (arrivals > m.pending)
    kiln_host_unsupported("more arrivals on an mbarrier than its phase takes");
  m.tx += (int)bytes;
  m.pending -= arrivals;
  if (m.pending == 0 && m.tx == 0) {
    m.phase ^= 1;
    m.pending = m.count;
    kiln_host_changed(bar).notify_all();
  } else if (m.pending == 0 && m.tx < 0) {
    kiln_host_unsupported("more bytes on an mbarrier than its phase expected");
  }
  *bar = m.word();
}

inline void kiln_host_mbarrier_arrive(unsigned long long* bar, unsigned bytes) {
  std::lock_guard<std::mutex> g(kiln_host_mbarriers.lock);
  kiln_host_mbarrier_update(bar, 1, bytes);
}

// Waits until the phase of parity `parity` has ended; a minute without its end is a hang (bytes
// or arrivals that never come), reported rather than waited on.
inline void kiln_host_mbarrier_wait(unsigned long long* bar, unsigned parity) {
  std::unique_lock<std::mutex> g(kiln_host_mbarriers.lock);
  const bool ended = kiln_host_changed(bar).wait_for(g, std::chrono::seconds(60), [&] {
    return kiln_host_mbar::of(*bar).phase != parity;
  });
  if (!ended) {
    const kiln_host_mbar m = kiln_host_mbar::of(*bar);
    std::fprintf(stderr,
                 "host emulation: an mbarrier's phase never ended (block %u thread %u: %u arrivals "
                 "and %d bytes still expected)\n",
                 blockIdx.x, threadIdx.x, m.pending, m.tx);
    std::abort();
  }
}

// st.async: `bytes` of `data` to the shared address `remote`, counted on the barrier at
// `remote_bar`.
inline void kiln_host_st_async(unsigned remote, const void* data, unsigned bytes,
                               unsigned remote_bar) {
  std::lock_guard<std::mutex> g(kiln_host_mbarriers.lock);
  std::memcpy(kiln_host_smem_ptr(remote), data, bytes);
  kiln_host_mbarrier_update(reinterpret_cast<unsigned long long*>(kiln_host_smem_ptr(remote_bar)),
                            0, -(long long)bytes);
}

// cp.async.bulk from global memory into `stage`, counted on `bar`.
inline void kiln_host_bulk_copy(void* stage, unsigned long long src, unsigned bytes,
                                unsigned long long* bar) {
  kiln_host_smem_addr(stage);  // shared memory, or abort
  std::lock_guard<std::mutex> g(kiln_host_mbarriers.lock);
  std::memcpy(stage, reinterpret_cast<const void*>(src), bytes);
  kiln_host_mbarrier_update(bar, 0, -(long long)bytes);
}

// bar.sync (`wait`) or bar.arrive on this block's named barrier `id` of `threads` threads.
inline void kiln_host_named_barrier(int id, int threads, bool wait) {
  // The runner makes barriers 1 and 2 of the whole block, as the kernels use them.
  std::barrier<>* b = kiln_host_named[id];
  if (b == nullptr || threads != (int)blockDim.x) kiln_host_unsupported("this named barrier");
  if (wait) {
    b->arrive_and_wait();
  } else {
    (void)b->arrive();
  }
}
