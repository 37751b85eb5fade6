//! The in-memory kernel table: loaded functions keyed by (device ordinal, spec). A hit is one
//! `DashMap` lookup: no rendering, hashing, allocation or file access.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use dashmap::DashMap;
use rustc_hash::FxBuildHasher;

use super::compiler::{Jit, Origin};
use super::entry::{Entry, ImageKind};
use super::key::CacheKey;
use super::spec::KernelSpec;
use super::target::Target;
use crate::error::{Error, Result};

/// A kernel loaded into one device's context.
#[derive(Debug)]
pub struct LoadedKernel {
    /// The entry point's driver handle.
    pub function: CudaFunction,
    /// The loaded module, shared by every entry point taken from it.
    pub module: Arc<CudaModule>,
    /// The cache key of the module's entry.
    pub key: CacheKey,
    /// Where its module came from when it was loaded.
    pub origin: Origin,
    /// Whether the kernel declares thread-block cluster dimensions (`__cluster_dims__`): graph
    /// executables holding it are re-instantiated, never updated in place.
    pub cluster: bool,
    /// Blocks per cluster it declares (0: none).
    pub cluster_width: usize,
    /// The dynamic shared memory launches may use, as last raised by `allow_shared`.
    shared_allowed: AtomicUsize,
    /// Answers of `blocks_per_sm`: (block threads, dynamic shared bytes, blocks).
    occupancy: Mutex<Vec<(u32, usize, usize)>>,
    /// Answers of `max_active_clusters`, likewise.
    cluster_occupancy: Mutex<Vec<(u32, usize, usize)>>,
    /// (name expression, lowered name) of every entry point the module exposes, the family's
    /// kernel first.
    entry_points: Vec<(String, String)>,
}

impl LoadedKernel {
    /// Another entry point of the same module (a family registered with
    /// `FamilyExtras::entry_points`), by its name expression, as a kernel the encoder can launch.
    /// Each call loads the function anew: keep the result.
    pub fn entry_point(&self, name: &str) -> Result<Arc<LoadedKernel>> {
        let (_, lowered) = self
            .entry_points
            .iter()
            .find(|(expr, _)| expr == name)
            .ok_or_else(|| Error::InvalidArgument {
                arg: "name",
                reason: format!(
                    "{name:?} is not an entry point of this module (it has {:?})",
                    self.entry_points.iter().map(|e| &e.0).collect::<Vec<_>>()
                ),
            })?;
        let function = self.module.load_function(lowered)?;
        let cluster_width = cluster_width_of(&function)?;
        Ok(Arc::new(LoadedKernel {
            function,
            module: self.module.clone(),
            key: self.key,
            origin: self.origin,
            cluster: cluster_width > 0,
            cluster_width,
            shared_allowed: AtomicUsize::new(0),
            occupancy: Mutex::new(Vec::new()),
            cluster_occupancy: Mutex::new(Vec::new()),
            entry_points: self.entry_points.clone(),
        }))
    }

    /// Lets launches use `bytes` of dynamic shared memory. The driver refuses a launch whose
    /// static and dynamic shared memory pass 48 KiB unless the kernel opted in to that much;
    /// opting in costs a driver call, so it is made only when `bytes` passes what was allowed.
    pub fn allow_shared(&self, bytes: usize) -> Result<()> {
        if bytes > self.shared_allowed.load(Ordering::Relaxed) {
            let value = i32::try_from(bytes).map_err(|_| Error::InvalidArgument {
                arg: "bytes",
                reason: format!("{bytes} bytes of shared memory is past what a kernel may ask"),
            })?;
            self.function.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                value,
            )?;
            self.shared_allowed.fetch_max(bytes, Ordering::Relaxed);
        }
        Ok(())
    }

    /// How many blocks of `block` threads and `shared` dynamic bytes one multiprocessor holds at
    /// once (at least 1), asked of the driver once per pair: kernels that size their grid by it
    /// ask on every launch.
    pub fn blocks_per_sm(&self, block: u32, shared: usize) -> Result<usize> {
        let mut known = self.occupancy.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&(_, _, n)) = known.iter().find(|&&(b, s, _)| b == block && s == shared) {
            return Ok(n);
        }
        let n = self
            .function
            .occupancy_max_active_blocks_per_multiprocessor(block, shared, None)?
            .max(1) as usize;
        known.push((block, shared, n));
        Ok(n)
    }

    /// How many of its clusters of `block`-thread blocks with `shared` dynamic bytes the whole GPU
    /// holds at once (at least 1), asked of the driver once per pair. Clusters must fit in one
    /// GPU processing cluster, so this is not the SMs divided by the cluster width. A kernel
    /// without clusters is an error.
    pub fn max_active_clusters(&self, block: u32, shared: usize) -> Result<usize> {
        if self.cluster_width == 0 {
            return Err(Error::InvalidArgument {
                arg: "kernel",
                reason: "declares no thread-block clusters".into(),
            });
        }
        let mut known = self
            .cluster_occupancy
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(&(_, _, n)) = known.iter().find(|&&(b, s, _)| b == block && s == shared) {
            return Ok(n);
        }
        let config = sys::CUlaunchConfig {
            gridDimX: self.cluster_width as u32,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared as u32,
            hStream: std::ptr::null_mut(),
            attrs: std::ptr::null_mut(),
            numAttrs: 0,
        };
        let mut clusters = 0;
        // SAFETY: the function handle lives as long as `self.module`; `config` names no
        // attributes and outlives the call.
        let status = unsafe {
            sys::cuOccupancyMaxActiveClusters(&mut clusters, self.function.cu_function(), &config)
        };
        if status != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(Error::Driver(cudarc::driver::DriverError(status)));
        }
        let n = clusters.max(1) as usize;
        known.push((block, shared, n));
        Ok(n)
    }
}

/// Blocks per cluster `function` declares (0: none). More than the portable 8 (Hopper takes 16)
/// must be allowed before a launch, which this does.
fn cluster_width_of(function: &CudaFunction) -> Result<usize> {
    let width = function
        .get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH)?
        .max(0) as usize;
    if width > 8 {
        function.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
            1,
        )?;
    }
    Ok(width)
}

/// The kernels loaded so far, by (device ordinal, spec); each [`Device`](crate::runtime::Device)
/// has one. Lookups and loads may come from any thread.
#[derive(Default)]
pub struct KernelTable {
    map: DashMap<(usize, KernelSpec), Arc<LoadedKernel>, FxBuildHasher>,
}

impl KernelTable {
    /// An empty table.
    pub fn new() -> KernelTable {
        KernelTable::default()
    }

    /// The fast path: the kernel if it is already loaded on device `ordinal`.
    #[inline]
    pub fn get(&self, ordinal: usize, spec: &KernelSpec) -> Option<Arc<LoadedKernel>> {
        self.map.get(&(ordinal, *spec)).map(|k| k.value().clone())
    }

    /// Returns the loaded kernel, compiling (or reading from disk) and loading it on a miss.
    pub fn get_or_load(
        &self,
        jit: &Jit,
        ctx: &Arc<CudaContext>,
        target: Target,
        spec: &KernelSpec,
    ) -> Result<Arc<LoadedKernel>> {
        let ordinal = ctx.ordinal();
        if let Some(k) = self.get(ordinal, spec) {
            return Ok(k);
        }
        let mut compiled = jit.compile(spec, target)?;
        let module = match load(ctx, &compiled.entry) {
            Ok(m) => m,
            // An entry another NVRTC made may be one this driver cannot load: compile with ours.
            Err(e)
                if jit
                    .nvrtc()
                    .is_ok_and(|n| n.version_string() != compiled.entry.parts.nvrtc_version) =>
            {
                tracing::warn!(%spec, error = %e, nvrtc = %compiled.entry.parts.nvrtc_version,
                    "the driver refused another NVRTC's cache entry; compiling");
                compiled = jit.compile_local(spec, target)?;
                load(ctx, &compiled.entry)?
            }
            Err(e) => return Err(e),
        };
        let entry = &compiled.entry;
        let name = entry
            .lowered_names
            .first()
            .ok_or_else(|| Error::InvalidArgument {
                arg: "spec",
                reason: format!("{spec} names no kernel"),
            })?;
        let function = module.load_function(name)?;
        let cluster_width = cluster_width_of(&function)?;
        let loaded = Arc::new(LoadedKernel {
            function,
            module,
            key: entry.key,
            origin: compiled.origin,
            cluster: cluster_width > 0,
            cluster_width,
            shared_allowed: AtomicUsize::new(0),
            occupancy: Mutex::new(Vec::new()),
            cluster_occupancy: Mutex::new(Vec::new()),
            entry_points: entry
                .parts
                .name_expressions
                .iter()
                .cloned()
                .zip(entry.lowered_names.iter().cloned())
                .collect(),
        });
        // Two threads may load the same kernel at once; the first insert wins, both are valid.
        Ok(self
            .map
            .entry((ordinal, *spec))
            .or_insert(loaded)
            .value()
            .clone())
    }

    /// Kernels loaded, counting each (device, spec) pair once.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no kernel has been loaded yet.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Loads an entry's image (cubin or PTX) into `ctx`.
fn load(ctx: &Arc<CudaContext>, entry: &Entry) -> Result<Arc<CudaModule>> {
    let span = tracing::debug_span!("kiln.load", spec = %entry.spec);
    let _enter = span.enter();
    let image = match entry.image_kind {
        ImageKind::Cubin => Ptx::from_binary(entry.image.clone()),
        ImageKind::Ptx => {
            let text = entry.image.split(|&b| b == 0).next().unwrap_or(&[]);
            Ptx::from_src(String::from_utf8_lossy(text).into_owned())
        }
    };
    Ok(ctx.load_module(image)?)
}
