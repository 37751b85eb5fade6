//! The runtime layer: GPUs, device memory, arrays and the command encoder.

pub mod allocator;
pub mod args;
pub mod array;
pub mod copy;
pub mod divider;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod deps;
pub mod device;
pub mod encoder;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod tensor_map;
mod timeline;

pub use allocator::{Allocator, Buffer, MemoryStats};
pub use args::KernelArgs;
pub use array::{Array, MAX_RANK};
pub use device::Device;
pub use encoder::{CommandEncoder, EncoderStats};
pub(crate) use timeline::Watch;

use cudarc::driver::{result, sys};

use crate::error::{Error, Result};
use crate::jit::Target;

/// One GPU as the driver reports it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuInfo {
    /// The driver's device number, from 0.
    pub ordinal: usize,
    /// The product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// (major, minor), e.g. (9, 0).
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors (SMs).
    pub multiprocessors: u32,
    /// Total device memory in bytes.
    pub memory_bytes: u64,
    /// The most shared memory one block may use, after opting in.
    pub max_shared_per_block: u32,
}

impl GpuInfo {
    /// The exact target kiln compiles for on this GPU.
    pub fn target(&self) -> Target {
        Target::for_compute_capability(self.compute_capability.0, self.compute_capability.1)
    }
}

/// Whether the CUDA driver library can be loaded at all (it never is on a machine without one).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver's library names.
    unsafe { sys::is_culib_present() }
}

/// Initialises the driver, or says clearly why it cannot be used.
pub fn init_driver() -> Result<()> {
    if !driver_present() {
        return Err(Error::NoDriver(
            "libcuda.so was not found (no NVIDIA driver on this machine)".into(),
        ));
    }
    result::init().map_err(|e| Error::NoDriver(format!("cuInit failed: {e}")))
}

/// The GPUs on this machine; an error when there is no usable driver.
pub fn gpus() -> Result<Vec<GpuInfo>> {
    init_driver()?;
    let count = result::device::get_count()?;
    let mut out = Vec::with_capacity(count.max(0) as usize);
    for ordinal in 0..count {
        let dev = result::device::get(ordinal)?;
        let attr = |a| unsafe { result::device::get_attribute(dev, a) };
        out.push(GpuInfo {
            ordinal: ordinal as usize,
            name: result::device::get_name(dev)?,
            compute_capability: (
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
            ),
            multiprocessors: attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )? as u32,
            memory_bytes: unsafe { result::device::total_mem(dev) }? as u64,
            max_shared_per_block: attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )? as u32,
        });
    }
    Ok(out)
}

/// Blocks for a grid-stride kernel over `n` elements on `enc`'s device: enough to cover them, at
/// most 16 per SM (each thread then loops), at least one. Public for applications' own kernels.
pub fn grid_stride_blocks(enc: &CommandEncoder, n: usize, block: u16) -> usize {
    let sms = enc.device().info().multiprocessors as usize;
    grid_stride_blocks_for(sms, n, block)
}

/// [`grid_stride_blocks`] for a GPU of `sms` multiprocessors (a pure function).
pub fn grid_stride_blocks_for(sms: usize, n: usize, block: u16) -> usize {
    n.div_ceil(block.max(1) as usize).clamp(1, sms.max(1) * 16)
}

#[cfg(test)]
mod grid_tests {
    use super::*;

    #[test]
    fn grid_stride_blocks_cover_and_cap() {
        assert_eq!(grid_stride_blocks_for(132, 0, 256), 1);
        assert_eq!(grid_stride_blocks_for(132, 1000, 256), 4);
        assert_eq!(grid_stride_blocks_for(132, 1 << 30, 256), 132 * 16);
        assert_eq!(grid_stride_blocks_for(0, 10, 0), 10);
    }
}
