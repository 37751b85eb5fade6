//! Device memory behind a caching allocator: freed buffers go back to per-size-class free lists
//! and are reused last-in first-out, so a steady-state loop makes no driver calls and sees the
//! same addresses every iteration (which lets a cached CUDA graph replay unchanged).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext};

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

struct Pool {
    free: BTreeMap<usize, Vec<sys::CUdeviceptr>>,
    stats: MemoryStats,
}

struct Inner {
    ctx: Arc<CudaContext>,
    pool: Mutex<Pool>,
}

/// One device's allocator. Cheap to clone.
#[derive(Clone)]
pub struct Allocator {
    inner: Arc<Inner>,
}

/// A device allocation. Dropping it returns the memory to its allocator's free list (never to
/// the driver); whoever may still use it on the GPU must hold a clone of the `Arc<Buffer>`.
pub struct Buffer {
    ptr: sys::CUdeviceptr,
    class: usize,
    allocator: Arc<Inner>,
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
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.class == 0 {
            return;
        }
        let mut pool = self
            .allocator
            .pool
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        pool.free.entry(self.class).or_default().push(self.ptr);
        pool.stats.active -= self.class;
        pool.stats.cached += self.class;
    }
}

impl Allocator {
    pub fn new(ctx: Arc<CudaContext>) -> Allocator {
        Allocator {
            inner: Arc::new(Inner {
                ctx,
                pool: Mutex::new(Pool {
                    free: BTreeMap::new(),
                    stats: MemoryStats::default(),
                }),
            }),
        }
    }

    pub fn stats(&self) -> MemoryStats {
        self.inner
            .pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stats
    }

    /// Allocates at least `bytes`. On out-of-memory the cache is released and the allocation
    /// retried once before `Error::OutOfMemory`.
    pub fn alloc(&self, bytes: usize) -> Result<Arc<Buffer>> {
        if bytes == 0 {
            return Ok(Arc::new(Buffer {
                ptr: 0,
                class: 0,
                allocator: self.inner.clone(),
            }));
        }
        let class = size_class(bytes);
        let mut pool = self.inner.pool.lock().unwrap_or_else(|e| e.into_inner());
        let reused = pool.free.get_mut(&class).and_then(|list| list.pop());
        let ptr = match reused {
            Some(ptr) => {
                pool.stats.cached -= class;
                ptr
            }
            None => match self.driver_alloc(class) {
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
                                cached_released: cached_before,
                            })
                        }
                        Err(e) => return Err(driver_error(e)),
                    }
                }
                Err(e) => return Err(driver_error(e)),
            },
        };
        if reused.is_none() {
            pool.stats.driver_allocs += 1;
        }
        pool.stats.active += class;
        pool.stats.peak = pool.stats.peak.max(pool.stats.active);
        Ok(Arc::new(Buffer {
            ptr,
            class,
            allocator: self.inner.clone(),
        }))
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

    /// Returns every cached (free) buffer to the driver.
    pub fn release_cache(&self) -> Result<()> {
        let mut pool = self.inner.pool.lock().unwrap_or_else(|e| e.into_inner());
        self.release_locked(&mut pool)
    }

    fn release_locked(&self, pool: &mut Pool) -> Result<()> {
        self.inner.ctx.bind_to_thread()?;
        for (class, list) in std::mem::take(&mut pool.free) {
            for ptr in list {
                // SAFETY: ptr came from cuMemAlloc and no live Buffer refers to it.
                let status = unsafe { sys::cuMemFree_v2(ptr) };
                if status != sys::cudaError_enum::CUDA_SUCCESS {
                    return Err(driver_error(status));
                }
                pool.stats.cached -= class;
            }
        }
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every Buffer holds an Arc<Inner>, so none is alive here: free the whole cache.
        let pool = self.pool.get_mut().unwrap_or_else(|e| e.into_inner());
        if self.ctx.bind_to_thread().is_ok() {
            for (_, list) in std::mem::take(&mut pool.free) {
                for ptr in list {
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
}
