// Documented separately (in progress); remove this allow when done.
#![allow(missing_docs)]
//! One `Device` per GPU ordinal, created lazily: its context, properties, allocator and loaded
//! kernels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaContext;

use super::allocator::Allocator;
use super::GpuInfo;
use crate::error::{Error, Result};
use crate::jit::target::shared_memory_per_block;
use crate::jit::{Jit, KernelSpec, KernelTable, LoadedKernel, Target};

pub struct Device {
    info: GpuInfo,
    /// The architecture whose code paths kiln runs here (compute capability x 10): the GPU's
    /// own, or an older one named by `KILN_EMULATE_ARCH`.
    arch: u32,
    /// The most shared memory a kernel's block may use: the GPU's limit, or under
    /// `KILN_EMULATE_ARCH` the smaller of it and the emulated architecture's.
    shared_limit: usize,
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
        let jit = Jit::global()?;
        let own = info.target().arch;
        let (arch, shared_limit) = match jit.config().emulate_arch {
            Some(a) if a > own => {
                return Err(Error::InvalidArgument {
                    arg: "KILN_EMULATE_ARCH",
                    reason: format!(
                        "sm_{a} is newer than GPU {ordinal} ({}, sm_{own}): only an older \
                         architecture's code paths can run on it",
                        info.name
                    ),
                })
            }
            Some(a) => (
                a,
                (info.max_shared_per_block as usize).min(shared_memory_per_block(a)),
            ),
            None => (own, info.max_shared_per_block as usize),
        };
        let ctx = CudaContext::new(ordinal)?;
        let device = Arc::new(Device {
            arch,
            shared_limit,
            allocator: Allocator::new(ctx.clone(), info.memory_bytes as usize),
            info,
            ctx,
            kernels: KernelTable::new(),
            jit,
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

    /// The architecture whose code paths kiln runs on this device, as compute capability x 10:
    /// the GPU's own, or the older one `KILN_EMULATE_ARCH` names. Ops choose their kernels by it.
    pub fn arch(&self) -> u32 {
        self.arch
    }

    /// The most dynamic shared memory one block may use here, in bytes (see [`Device::arch`]).
    pub fn shared_limit(&self) -> usize {
        self.shared_limit
    }

    /// The exact target kernels are compiled for: always the GPU's own.
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

    /// Whether `spec` is already loaded here (one table lookup).
    pub fn has_kernel(&self, spec: &KernelSpec) -> bool {
        self.kernels.get(self.info.ordinal, spec).is_some()
    }

    /// Queues `specs` for compiling in the background for this device, where they are not
    /// loaded yet: for the kernels a call's next calls will likely need (see
    /// [`Jit::prefetch`]). Loading still happens on first use.
    pub fn prefetch(&self, specs: impl IntoIterator<Item = KernelSpec>) {
        let missing = specs.into_iter().filter(|s| !self.has_kernel(s));
        self.jit.prefetch(missing, self.target());
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        Ok(self.ctx.bind_to_thread()?)
    }
}
