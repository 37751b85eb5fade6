//! One `Device` per GPU ordinal, created lazily: its context, properties, allocator and loaded
//! kernels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaContext;

use super::allocator::Allocator;
use super::GpuInfo;
use crate::error::{Error, Result};
use crate::jit::{Jit, KernelSpec, KernelTable, LoadedKernel, Target};

pub struct Device {
    info: GpuInfo,
    ctx: Arc<CudaContext>,
    allocator: Allocator,
    kernels: KernelTable,
    jit: &'static Jit,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({}: {})", self.info.ordinal, self.info.name)
    }
}

impl Device {
    /// The device for `ordinal`, created on first use. A machine without a driver or GPU gets a
    /// clear error, never a panic.
    pub fn get(ordinal: usize) -> Result<Arc<Device>> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<Device>>>> = OnceLock::new();
        let devices = DEVICES.get_or_init(Default::default);
        let mut devices = devices.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = devices.get(&ordinal) {
            return Ok(d.clone());
        }
        let gpus = super::gpus()?;
        let info = gpus
            .into_iter()
            .find(|g| g.ordinal == ordinal)
            .ok_or_else(|| Error::InvalidArgument {
                arg: "ordinal",
                reason: format!("no GPU with ordinal {ordinal}"),
            })?;
        let ctx = CudaContext::new(ordinal)?;
        let device = Arc::new(Device {
            allocator: Allocator::new(ctx.clone(), info.memory_bytes as usize),
            info,
            ctx,
            kernels: KernelTable::new(),
            jit: Jit::global()?,
        });
        devices.insert(ordinal, device.clone());
        Ok(device)
    }

    pub fn ordinal(&self) -> usize {
        self.info.ordinal
    }

    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn allocator(&self) -> &Allocator {
        &self.allocator
    }

    pub fn target(&self) -> Target {
        self.info.target()
    }

    /// The loaded kernel for `spec`: one table lookup when it is already loaded.
    #[inline]
    pub fn kernel(&self, spec: &KernelSpec) -> Result<Arc<LoadedKernel>> {
        if let Some(k) = self.kernels.get(self.info.ordinal, spec) {
            return Ok(k);
        }
        self.kernels
            .get_or_load(self.jit, &self.ctx, self.target(), spec)
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        Ok(self.ctx.bind_to_thread()?)
    }
}
