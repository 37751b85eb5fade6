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

/// One GPU as kiln uses it: its context, properties, caching allocator, the kernels loaded on
/// it and the JIT they come from. Shared as `Arc<Device>` (`Send` and `Sync`); [`Device::get`]
/// returns the one registered device per ordinal.
pub struct Device {
    /// Unique among this process's devices (two devices may share an ordinal: see `with_jit`).
    id: usize,
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
    /// An error that happened where it could not be returned (an encoder's drop), until the
    /// next call that can return it takes it.
    deferred: Mutex<Option<Error>>,
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
        let device = Device::with_jit(ordinal, Jit::global()?)?;
        devices.insert(ordinal, device.clone());
        Ok(device)
    }

    /// A device for `ordinal` whose kernels come from `jit` (its cache, NVRTC and
    /// configuration, `KILN_EMULATE_ARCH` included) rather than from the process-wide JIT that
    /// [`Device::get`] uses. Each call makes a new device, with its own allocator and kernel
    /// table, on the GPU's primary context; it is not registered, so [`Device::get`] never
    /// returns it. `jit` lives for the rest of the process (`Box::leak` one made with
    /// [`Jit::new`]): background compiles may use it at any time.
    pub fn with_jit(ordinal: usize, jit: &'static Jit) -> Result<Arc<Device>> {
        let gpus = super::gpus()?;
        let info = gpus
            .into_iter()
            .find(|g| g.ordinal == ordinal)
            .ok_or_else(|| Error::InvalidArgument {
                arg: "ordinal",
                reason: format!("no GPU with ordinal {ordinal}"),
            })?;
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
        static NEXT_ID: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let device = Arc::new(Device {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            arch,
            shared_limit,
            allocator: Allocator::new(ctx.clone(), info.memory_bytes as usize),
            info,
            ctx,
            kernels: KernelTable::new(),
            jit,
            deferred: Mutex::new(None),
        });
        Ok(device)
    }

    /// This device's identity in the process: distinct for two devices of one GPU (for caches
    /// of what a device has loaded, such as convolution plans).
    pub fn id(&self) -> usize {
        self.id
    }

    /// Keeps an error that could not be returned where it happened (an encoder dropped with
    /// work that failed), for the next encoder made on this device or the next `synchronize`
    /// of one to return. The first such error is kept; later ones are only logged.
    pub(crate) fn record_error(&self, error: Error) {
        tracing::warn!(device = self.info.ordinal, %error, "deferred to the next call");
        let mut slot = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert(error);
    }

    /// The error [`Device::record_error`] kept, if any, which the caller now returns.
    pub(crate) fn take_error(&self) -> Option<Error> {
        self.deferred
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// The JIT this device's kernels come from.
    pub fn jit(&self) -> &'static Jit {
        self.jit
    }

    /// The GPU's ordinal in this process (as CUDA numbers it, after `CUDA_VISIBLE_DEVICES`).
    pub fn ordinal(&self) -> usize {
        self.info.ordinal
    }

    /// The GPU's properties (name, compute capability, multiprocessors, memory, limits).
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// The GPU's primary context, for interoperation with cudarc.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The caching allocator for this device's arrays.
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

    /// The kernel for `spec` if it is already loaded here (one table lookup, no compile).
    pub fn loaded(&self, spec: &KernelSpec) -> Option<Arc<LoadedKernel>> {
        self.kernels.get(self.info.ordinal, spec)
    }

    /// The kernel for `spec` when it can be had without compiling: loaded here, compiled in
    /// this process, or in the disk cache (then loaded now). None while it must still be
    /// compiled, or is being compiled by another thread (see [`Jit::cached`]).
    pub fn ready(&self, spec: &KernelSpec) -> Result<Option<Arc<LoadedKernel>>> {
        if let Some(k) = self.loaded(spec) {
            return Ok(Some(k));
        }
        match self.jit.cached(spec, self.target())? {
            // The module is now in the JIT's memory: this load does not compile.
            Some(_) => self.kernel(spec).map(Some),
            None => Ok(None),
        }
    }

    /// Of `specs`, those whose kernels are not [`ready`](Device::ready) here.
    pub fn missing(&self, specs: &[KernelSpec]) -> Result<Vec<KernelSpec>> {
        let mut out = Vec::new();
        for spec in specs {
            if self.ready(spec)?.is_none() {
                out.push(*spec);
            }
        }
        Ok(out)
    }

    /// Queues `specs` for compiling in the background for this device, where they are not
    /// loaded yet: for the kernels a call's next calls will likely need (see
    /// [`Jit::prefetch`]). Loading still happens on first use.
    pub fn prefetch(&self, specs: impl IntoIterator<Item = KernelSpec>) {
        let missing = specs.into_iter().filter(|s| self.loaded(s).is_none());
        self.jit.prefetch(missing, self.target());
    }

    /// [`Device::prefetch`] for what the very next calls need: each spec not loaded yet is
    /// compiled on a thread of its own at once (see [`Jit::prefetch_urgent`]).
    pub fn prefetch_urgent(&self, specs: impl IntoIterator<Item = KernelSpec>) {
        let missing = specs.into_iter().filter(|s| self.loaded(s).is_none());
        self.jit.prefetch_urgent(missing, self.target());
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        Ok(self.ctx.bind_to_thread()?)
    }
}
