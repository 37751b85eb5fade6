//! Device memory behind a caching allocator: freed buffers go back to per-size-class free lists
//! and are reused lowest address first, so a steady-state loop makes no driver calls and sees
//! the same addresses every iteration (which lets a cached CUDA graph replay unchanged): which
//! block a request gets depends on the set of free blocks, not on the order they were freed in.
//!
//! A free block keeps fences: the commits of each stream that may still touch it. Later work on
//! one of those streams may reuse it before they finish (stream order runs that work after
//! them); anyone else gets it only once the fences are done, and the driver only after a wait.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext};

use super::timeline::{Fence, Reuser, Timeline};
use crate::error::{Error, Result};

/// Statistics in bytes (of size classes, not of requests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryStats {
    /// Held by live buffers.
    pub active: usize,
    /// Free, kept for reuse.
    pub cached: usize,
    /// The most `active` has been.
    pub peak: usize,
    /// Calls to the driver's allocator so far.
    pub driver_allocs: u64,
}

/// The size class a request is served from: powers of two up to 1 MiB (at least 256 bytes), then
/// multiples of 2 MiB.
pub fn size_class(bytes: usize) -> usize {
    const SMALL_MAX: usize = 1 << 20;
    const LARGE_STEP: usize = 2 << 20;
    if bytes <= SMALL_MAX {
        bytes.max(256).next_power_of_two()
    } else {
        bytes.div_ceil(LARGE_STEP) * LARGE_STEP
    }
}

/// A free block: its address, and the work that may still touch it.
struct FreeBlock {
    ptr: sys::CUdeviceptr,
    fences: Vec<Fence>,
}

/// The free blocks of one size class: fences by address.
type FreeList = BTreeMap<sys::CUdeviceptr, Vec<Fence>>;

/// The free lists and counters: pure bookkeeping, no driver calls.
#[derive(Default)]
struct Pool {
    free: BTreeMap<usize, FreeList>,
    stats: MemoryStats,
}

impl Pool {
    /// Takes the lowest-addressed block of `class` that `reuser` may use (see
    /// [`Fence::allows`]). Its fences that are not yet done come with it.
    fn take(&mut self, class: usize, reuser: Option<Reuser>) -> Option<FreeBlock> {
        let list = self.free.get_mut(&class)?;
        let ptr = list
            .iter()
            .find(|(_, fences)| fences.iter().all(|f| f.allows(reuser)))
            .map(|(&ptr, _)| ptr)?;
        let mut fences = list.remove(&ptr).unwrap_or_default();
        fences.retain(|f| !f.is_done());
        self.stats.cached -= class;
        Some(FreeBlock { ptr, fences })
    }

    fn give(&mut self, class: usize, block: FreeBlock) {
        self.free
            .entry(class)
            .or_default()
            .insert(block.ptr, block.fences);
        self.stats.cached += class;
    }

    /// The timelines whose unfinished work holds back free blocks of `class` (each once).
    fn blocking_timelines(&self, class: Option<usize>) -> Vec<Arc<Timeline>> {
        let mut out: Vec<Arc<Timeline>> = Vec::new();
        let lists = self
            .free
            .iter()
            .filter(|(c, _)| class.map_or(true, |k| **c == k));
        for f in lists.flat_map(|(_, l)| l.values()).flatten() {
            if !f.is_done() && !out.iter().any(|t| t.id() == f.timeline().id()) {
                out.push(f.timeline().clone());
            }
        }
        out
    }
}

struct Inner {
    ctx: Arc<CudaContext>,
    /// The device's memory: a larger request fails without asking the driver.
    device_bytes: usize,
    pool: Mutex<Pool>,
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One device's allocator. Cheap to clone.
#[derive(Clone)]
pub struct Allocator {
    inner: Arc<Inner>,
}

/// A device allocation. Dropping it returns the memory to its allocator's free list (never to
/// the driver), together with the work that may still use it: that memory goes to other streams
/// only once the work is done, and to later work on the same stream at once.
pub struct Buffer {
    ptr: sys::CUdeviceptr,
    class: usize,
    allocator: Arc<Inner>,
    /// Per timeline, the newest commit that uses (or may use) this memory.
    uses: Mutex<Vec<Fence>>,
    /// The (timeline, commit) last recorded, so that repeated uses skip the lock.
    last_use: AtomicU64,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({:#x}, {} bytes)", self.ptr, self.class)
    }
}

impl Buffer {
    /// The device address (0 for an empty buffer).
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Usable bytes (the size class).
    pub fn capacity(&self) -> usize {
        self.class
    }

    /// Records that commit `seq` of `timeline` uses this memory.
    pub(crate) fn record_use(&self, timeline: &Arc<Timeline>, seq: u64) {
        // Commit numbers stay far below 2^40 and timeline ids below 2^24.
        let tag = (timeline.id() << 40) | seq;
        if self.class == 0 || self.last_use.load(Ordering::Relaxed) == tag {
            return;
        }
        let mut uses = self.uses.lock().unwrap_or_else(|e| e.into_inner());
        uses.retain(|f| !f.is_done());
        if !uses.iter_mut().any(|f| f.advance(timeline, seq)) {
            uses.push(Fence::new(timeline, seq));
        }
        self.last_use.store(tag, Ordering::Relaxed);
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.class == 0 {
            return;
        }
        let fences = std::mem::take(self.uses.get_mut().unwrap_or_else(|e| e.into_inner()));
        let mut pool = self.allocator.lock();
        pool.stats.active -= self.class;
        pool.give(
            self.class,
            FreeBlock {
                ptr: self.ptr,
                fences,
            },
        );
    }
}

impl Allocator {
    /// An allocator for the context's device, which has `device_bytes` of memory.
    pub fn new(ctx: Arc<CudaContext>, device_bytes: usize) -> Allocator {
        Allocator {
            inner: Arc::new(Inner {
                ctx,
                device_bytes,
                pool: Mutex::new(Pool::default()),
            }),
        }
    }

    /// The counters now (a copy).
    pub fn stats(&self) -> MemoryStats {
        self.inner.lock().stats
    }

    /// Allocates at least `bytes`, for use by anyone (the host, any stream). Free memory that
    /// unfinished work may still touch is skipped; on out-of-memory, the allocator waits for
    /// launched work, releases its cache and retries once before `Error::OutOfMemory`.
    pub fn alloc(&self, bytes: usize) -> Result<Arc<Buffer>> {
        self.alloc_for(bytes, None)
    }

    /// Allocates at least `bytes` for work encoded on `reuser`'s stream, which may reuse memory
    /// that the stream's own earlier work (launched or still being encoded) has released: stream
    /// order runs the new work after it. The memory keeps those uses as fences, so it reaches
    /// no other stream before they finish.
    pub(crate) fn alloc_on(&self, bytes: usize, reuser: Reuser) -> Result<Arc<Buffer>> {
        self.alloc_for(bytes, Some(reuser))
    }

    fn alloc_for(&self, bytes: usize, reuser: Option<Reuser>) -> Result<Arc<Buffer>> {
        if bytes == 0 {
            return Ok(self.wrap(0, 0, Vec::new()));
        }
        let class = size_class(bytes);
        let mut pool = self.inner.lock();
        if class > self.inner.device_bytes {
            // It can never fit: neither the driver nor the cache is troubled.
            return Err(Error::OutOfMemory {
                requested: bytes,
                active: pool.stats.active,
                cached_released: 0,
            });
        }
        let mut block = pool.take(class, reuser);
        if block.is_none() {
            // Before going to the driver, notice what finished since the last look.
            let blocking = pool.blocking_timelines(Some(class));
            if !blocking.is_empty() {
                for t in &blocking {
                    t.poll()?;
                }
                block = pool.take(class, reuser);
            }
        }
        let block = match block {
            Some(b) => b,
            None => {
                let ptr = match self.driver_alloc(class) {
                    Ok(ptr) => ptr,
                    Err(sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY) => {
                        let cached_before = pool.stats.cached;
                        self.release_locked(&mut pool)?;
                        match self.driver_alloc(class) {
                            Ok(ptr) => ptr,
                            Err(sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY) => {
                                return Err(Error::OutOfMemory {
                                    requested: bytes,
                                    active: pool.stats.active,
                                    cached_released: cached_before - pool.stats.cached,
                                })
                            }
                            Err(e) => return Err(driver_error(e)),
                        }
                    }
                    Err(e) => return Err(driver_error(e)),
                };
                pool.stats.driver_allocs += 1;
                FreeBlock {
                    ptr,
                    fences: Vec::new(),
                }
            }
        };
        pool.stats.active += class;
        pool.stats.peak = pool.stats.peak.max(pool.stats.active);
        drop(pool);
        Ok(self.wrap(block.ptr, class, block.fences))
    }

    fn wrap(&self, ptr: sys::CUdeviceptr, class: usize, fences: Vec<Fence>) -> Arc<Buffer> {
        Arc::new(Buffer {
            ptr,
            class,
            allocator: self.inner.clone(),
            uses: Mutex::new(fences),
            last_use: AtomicU64::new(0),
        })
    }

    fn driver_alloc(
        &self,
        class: usize,
    ) -> std::result::Result<sys::CUdeviceptr, sys::cudaError_enum> {
        self.inner.ctx.bind_to_thread().map_err(|e| e.0)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; ptr receives the allocation.
        let status = unsafe { sys::cuMemAlloc_v2(&mut ptr, class) };
        if status != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(status);
        }
        Ok(ptr)
    }

    /// Returns cached (free) memory to the driver: every block whose work is done, after
    /// waiting for launched work that still uses some; memory used by work still being encoded
    /// (not yet committed) stays cached.
    pub fn release_cache(&self) -> Result<()> {
        let mut pool = self.inner.lock();
        self.release_locked(&mut pool)
    }

    fn release_locked(&self, pool: &mut Pool) -> Result<()> {
        self.inner.ctx.bind_to_thread()?;
        for t in pool.blocking_timelines(None) {
            // The newest commit launched: waiting for it covers the older ones.
            t.wait_for(t.next_seq() - 1)?;
        }
        let mut kept: BTreeMap<usize, FreeList> = BTreeMap::new();
        for (class, list) in std::mem::take(&mut pool.free) {
            for (ptr, fences) in list {
                if !fences.iter().all(|f| f.allows(None)) {
                    kept.entry(class).or_default().insert(ptr, fences);
                    continue;
                }
                // SAFETY: ptr came from cuMemAlloc, no live Buffer refers to it, and the work
                // that used it is done.
                let status = unsafe { sys::cuMemFree_v2(ptr) };
                if status != sys::cudaError_enum::CUDA_SUCCESS {
                    pool.free = kept;
                    return Err(driver_error(status));
                }
                pool.stats.cached -= class;
            }
        }
        pool.free = kept;
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every Buffer holds an Arc<Inner>, so none is alive here: free the whole cache.
        let pool = self.pool.get_mut().unwrap_or_else(|e| e.into_inner());
        if self.ctx.bind_to_thread().is_ok() {
            for (_, list) in std::mem::take(&mut pool.free) {
                for ptr in list.into_keys() {
                    // SAFETY: as in release_locked; errors at teardown have nowhere to go.
                    unsafe { sys::cuMemFree_v2(ptr) };
                }
            }
        }
    }
}

fn driver_error(status: sys::cudaError_enum) -> Error {
    Error::Driver(cudarc::driver::DriverError(status))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes() {
        assert_eq!(size_class(1), 256);
        assert_eq!(size_class(256), 256);
        assert_eq!(size_class(257), 512);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), 2 << 20);
        assert_eq!(size_class(5 << 20), 6 << 20);
        for n in [1usize, 300, 4097, 1 << 21, 123_456_789] {
            assert!(size_class(n) >= n);
        }
    }

    fn block(ptr: u64, fences: &[(&Arc<Timeline>, u64)]) -> FreeBlock {
        FreeBlock {
            ptr,
            fences: fences.iter().map(|(t, s)| Fence::new(t, *s)).collect(),
        }
    }

    #[test]
    fn free_blocks_wait_for_other_streams_but_not_their_own() {
        let (a, b) = (Timeline::new(), Timeline::new());
        a.fake_progress(5, 3); // commits 4 and 5 of `a` still run
        b.fake_progress(2, 2);
        let mut pool = Pool::default();
        pool.give(256, block(4, &[(&a, 6)])); // used by `a`'s batch being encoded
        pool.give(256, block(3, &[(&a, 3), (&b, 2)]));
        pool.give(256, block(2, &[(&a, 4)]));
        pool.give(256, block(1, &[]));
        assert_eq!(pool.stats.cached, 4 * 256);
        // Anyone: the lowest block whose work is done, whatever the order of release.
        assert_eq!(pool.take(256, None).unwrap().ptr, 1);
        let got = pool.take(256, None).unwrap();
        assert_eq!((got.ptr, got.fences.len()), (3, 0));
        assert!(pool.take(256, None).is_none());
        // Stream `b` may not use memory `a` still uses.
        let on = |t, through| {
            Some(Reuser {
                timeline: t,
                through,
            })
        };
        assert!(pool.take(256, on(&b, 3)).is_none());
        // `a` may reuse what its launched commits released, and (through 6) what the batch it
        // is encoding did; the fence comes along.
        let got = pool.take(256, on(&a, 5)).unwrap();
        assert_eq!((got.ptr, got.fences.len()), (2, 1));
        assert!(pool.take(256, on(&a, 5)).is_none());
        pool.give(256, got);
        assert_eq!(pool.take(256, on(&a, 6)).unwrap().ptr, 2);
        let got = pool.take(256, on(&a, 6)).unwrap();
        assert_eq!((got.ptr, got.fences.len()), (4, 1));
        pool.give(256, block(2, &[(&a, 4)]));
        assert_eq!(pool.blocking_timelines(None).len(), 1);
        // Once `a` has finished, block 2 is anyone's.
        a.fake_progress(6, 6);
        assert!(pool.blocking_timelines(Some(256)).is_empty());
        assert_eq!(pool.take(256, None).unwrap().ptr, 2);
        assert_eq!(pool.stats.cached, 0);
        assert!(pool.take(512, None).is_none());
    }

    #[test]
    fn blocking_timelines_are_listed_once() {
        let (a, b) = (Timeline::new(), Timeline::new());
        a.fake_progress(2, 0);
        b.fake_progress(2, 0);
        let mut pool = Pool::default();
        pool.give(256, block(1, &[(&a, 1)]));
        pool.give(512, block(2, &[(&a, 2), (&b, 1)]));
        pool.give(512, block(3, &[(&b, 2)]));
        let ids = |v: Vec<Arc<Timeline>>| v.iter().map(|t| t.id()).collect::<Vec<_>>();
        assert_eq!(ids(pool.blocking_timelines(None)), vec![a.id(), b.id()]);
        assert_eq!(ids(pool.blocking_timelines(Some(256))), vec![a.id()]);
    }
}
