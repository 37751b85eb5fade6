//! The JIT's front door: spec + target -> rendered source -> key -> disk cache or NVRTC.
//!
//! Compiles of different specs run in parallel on the caller's threads; concurrent requests for
//! the same key wait for one compile (single flight) and share its result.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use dashmap::DashMap;

use super::background::Background;
use super::disk_cache::{DiskCache, Lookup};
use super::entry::{Entry, ImageKind};
use super::key::{CacheKey, KeyParts};
use super::nvrtc::Nvrtc;
use super::spec::KernelSpec;
use super::target::{Target, TargetKind};
use super::template;
use crate::env::Config;
use crate::error::{Error, Result};

/// NVRTC options every kiln kernel is compiled with (the target is added separately).
pub const BASE_OPTIONS: &[&str] = &["--std=c++17", "--fmad=true"];

/// What entries this kiln writes record as their producer, e.g. `kiln 0.1.0`.
pub const PRODUCER: &str = concat!("kiln ", env!("CARGO_PKG_VERSION"));

/// Where a compiled module came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// Already compiled earlier in this process.
    Memory,
    /// Read from the disk cache.
    Disk,
    /// Compiled by NVRTC now.
    Compiled,
}

/// A compiled module and where it came from.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The module and everything that produced it.
    pub entry: Arc<Entry>,
    /// Where it came from on this request.
    pub origin: Origin,
}

/// The compiler: renders specs, keys them, and finds each module in this process's memory, the
/// disk cache or NVRTC, in that order. One per process is usual ([`Jit::global`]); every
/// method takes `&self` and may be called from any thread.
pub struct Jit {
    config: Config,
    cache: DiskCache,
    /// One slot per key: holds the module once compiled; its lock is the single flight.
    modules: DashMap<CacheKey, Arc<Mutex<Option<Arc<Entry>>>>>,
    background: Background,
}

impl Jit {
    /// The process-wide JIT, configured from the environment on first use.
    pub fn global() -> Result<&'static Jit> {
        static GLOBAL: OnceLock<Result<Jit>> = OnceLock::new();
        // An invalid variable is remembered and returned again as the same `Error::Env`.
        GLOBAL
            .get_or_init(|| Config::from_env().map(Jit::new))
            .as_ref()
            .map_err(Error::clone)
    }

    /// A JIT with `config`'s settings, its disk cache opened at `config.cache_dir` (or the
    /// platform cache directory). Never fails: a cache that cannot be written runs memory-only,
    /// and NVRTC is looked for only when first needed.
    pub fn new(config: Config) -> Jit {
        let dir = config.cache_dir.clone().unwrap_or_else(default_cache_dir);
        let cache = DiskCache::open(&dir, config.cache_mode, config.cache_max_bytes);
        Jit {
            config,
            cache,
            modules: DashMap::new(),
            background: Background::new(),
        }
    }

    pub(crate) fn background(&self) -> &Background {
        &self.background
    }

    /// The settings this JIT was made with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The disk cache behind this JIT.
    pub fn disk_cache(&self) -> &DiskCache {
        &self.cache
    }

    /// The process's NVRTC, or why it cannot be loaded. The first call in the process looks for
    /// it (with that JIT's `KILN_NVRTC_LIB`); its outcome is kept for every later call.
    pub fn nvrtc(&self) -> Result<&'static Nvrtc> {
        Nvrtc::get(self.config.nvrtc_lib.as_deref())
    }

    /// The target actually compiled for when `requested` is asked for `spec`: the arch-specific
    /// variant where the family needs it, and PTX for the newest architecture this NVRTC knows
    /// when it cannot emit SASS for the requested one. A target older than every architecture
    /// this NVRTC knows (sm_70 with NVRTC 13) is an error that names the NVRTC that can.
    pub fn resolve_target(&self, spec: &KernelSpec, requested: Target) -> Result<Target> {
        self.check_target(requested)?;
        let mut target = self.sass_or_ptx(requested)?;
        check_builds_for(spec, requested)?;
        if spec.template.arch_specific {
            target = target.arch_specific();
        }
        Ok(target)
    }

    /// `requested`, or PTX for the newest architecture this NVRTC knows when it cannot emit
    /// SASS for `requested`.
    fn sass_or_ptx(&self, requested: Target) -> Result<Target> {
        let nvrtc = self.nvrtc()?;
        if requested.kind == TargetKind::Ptx || nvrtc.supports_sass(requested.arch) {
            return Ok(requested);
        }
        let best = nvrtc
            .supported_archs
            .iter()
            .copied()
            .filter(|&a| a <= requested.arch)
            .max()
            .unwrap_or(requested.arch);
        Ok(Target::ptx(best))
    }

    /// An error when the NVRTC in use cannot compile for `target` at all: it is older than
    /// every architecture this NVRTC knows (sm_70 with NVRTC 13). The error names the NVRTC
    /// that can. (A target newer than it knows is compiled as PTX instead.)
    pub fn check_target(&self, target: Target) -> Result<()> {
        let nvrtc = self.nvrtc()?;
        let oldest = nvrtc.supported_archs.iter().copied().min();
        if oldest.map_or(true, |o| target.arch < o) {
            return Err(Error::TargetUnsupported {
                target: target.to_string(),
                nvrtc: format!("{} ({})", nvrtc.version_string(), nvrtc.path),
                reason: too_old_reason(nvrtc.version.0, oldest),
            });
        }
        Ok(())
    }

    /// NVRTC options for `spec` on `target`: the base options; under `KILN_EMULATE_ARCH` for a
    /// newer target, `-DKILN_ARCH` so that the kernels take the older architecture's code paths;
    /// then the options the spec's family was registered with.
    pub fn options(&self, spec: &KernelSpec, target: Target) -> Result<Vec<String>> {
        let mut options: Vec<String> = BASE_OPTIONS.iter().map(|s| s.to_string()).collect();
        if let Some(arch) = self.config.emulate_arch.filter(|&a| a < target.arch) {
            options.push(format!("-DKILN_ARCH={}", arch * 10));
        }
        let extras = super::family::extras(spec.template)?;
        options.extend(extras.options.iter().map(|o| o.to_string()));
        Ok(options)
    }

    /// The key parts for `spec` on exactly `target` (no target resolution).
    pub fn key_parts(&self, spec: &KernelSpec, target: Target) -> Result<KeyParts> {
        let version = self.nvrtc()?.version_string();
        self.key_parts_for(spec, target, version)
    }

    fn key_parts_for(
        &self,
        spec: &KernelSpec,
        target: Target,
        nvrtc_version: String,
    ) -> Result<KeyParts> {
        let rendered = template::render(spec)?;
        Ok(KeyParts {
            source: rendered.source,
            headers: Vec::new(),
            name_expressions: rendered.name_expressions,
            options: self.options(spec, target)?,
            target: target.to_string(),
            nvrtc_version,
        })
    }

    /// Returns the module for `spec` on `requested`, from memory, disk, or a fresh compile.
    ///
    /// The disk is searched before NVRTC is needed: first for this NVRTC's own entry, then for
    /// one another NVRTC version made for the same exact target (the driver decides whether it
    /// loads; see [`KernelTable`](super::KernelTable)). With no NVRTC at all, a cached entry is
    /// still found and returned; only a miss needs NVRTC (and reports its absence).
    pub fn compile(&self, spec: &KernelSpec, requested: Target) -> Result<Compiled> {
        match self.nvrtc() {
            Ok(_) => self.compile_with(spec, requested, true),
            Err(missing) => self.find_without_nvrtc(spec, requested, missing),
        }
    }

    /// [`Jit::compile`] that takes only this NVRTC's own entries, compiling otherwise: for an
    /// entry of another NVRTC that the driver refused to load.
    pub fn compile_local(&self, spec: &KernelSpec, requested: Target) -> Result<Compiled> {
        self.compile_with(spec, requested, false)
    }

    /// The module for `spec` when it can be had without compiling: this process already holds
    /// it, or the disk cache does (this NVRTC's entry or another's for the same exact target).
    /// None when it must still be compiled, and while another thread compiles it (this call
    /// never waits for a compile). Without NVRTC, [`Jit::compile`] already never compiles.
    pub fn cached(&self, spec: &KernelSpec, requested: Target) -> Result<Option<Compiled>> {
        let nvrtc = match self.nvrtc() {
            Ok(n) => n,
            Err(missing) => return Ok(self.find_without_nvrtc(spec, requested, missing).ok()),
        };
        let target = self.resolve_target(spec, requested)?;
        let parts = self.key_parts(spec, target)?;
        debug_assert_eq!(parts.nvrtc_version, nvrtc.version_string());
        let key = parts.key();
        let slot = self.modules.entry(key).or_default().clone();
        // A held lock is a compile in flight (the slot's lock is the single flight).
        let Ok(mut slot) = slot.try_lock() else {
            return Ok(None);
        };
        if let Some(entry) = slot.as_ref() {
            return Ok(Some(Compiled {
                entry: entry.clone(),
                origin: Origin::Memory,
            }));
        }
        let found = self.disk_entry(&spec.to_string(), target, key, &parts, true);
        Ok(found.map(|entry| {
            let entry = Arc::new(entry);
            *slot = Some(entry.clone());
            Compiled {
                entry,
                origin: Origin::Disk,
            }
        }))
    }

    /// Whether calls may run on stand-ins while their kernels compile (`KILN_STAND_INS`):
    /// only with background compiles to finish those kernels, and an NVRTC to compile them.
    pub fn stand_ins(&self) -> bool {
        self.config.stand_ins && self.config.compile_threads > 0 && self.nvrtc().is_ok()
    }

    fn compile_with(
        &self,
        spec: &KernelSpec,
        requested: Target,
        any_nvrtc: bool,
    ) -> Result<Compiled> {
        let target = self.resolve_target(spec, requested)?;
        let parts = self.key_parts(spec, target)?;
        self.slot_or_load(&spec.to_string(), target, parts, any_nvrtc)
    }

    /// The module `parts` describe on `target`: this process's (its key's slot, whose lock is
    /// the single flight; another NVRTC's module only with `any_nvrtc`), or from disk or NVRTC,
    /// then kept in the slot.
    fn slot_or_load(
        &self,
        what: &str,
        target: Target,
        parts: KeyParts,
        any_nvrtc: bool,
    ) -> Result<Compiled> {
        let key = parts.key();
        let slot = self.modules.entry(key).or_default().clone();
        let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = slot.as_ref() {
            if any_nvrtc || entry.parts.nvrtc_version == parts.nvrtc_version {
                return Ok(Compiled {
                    entry: entry.clone(),
                    origin: Origin::Memory,
                });
            }
        }
        let compiled = self.load_or_compile(what, target, key, parts, any_nvrtc)?;
        *slot = Some(compiled.entry.clone());
        Ok(compiled)
    }

    /// The module a cached entry (`recipe`: its source, options and entry points) describes,
    /// built for `requested` instead of the entry's own target: from memory, disk, or NVRTC.
    /// This is how `kiln warm --arch` serves another GPU type with what the cache holds, the
    /// kernels of applications it has never seen included. The key is made exactly as for the
    /// spec the entry came from, so a process asking for that spec on `requested` finds it.
    pub fn compile_entry_for(&self, recipe: &Entry, requested: Target) -> Result<Compiled> {
        self.check_target(requested)?;
        let own: Target = recipe.parts.target.parse()?;
        let target = if own.kind == TargetKind::SassArchSpecific {
            if own.arch != requested.arch {
                return Err(Error::InvalidArgument {
                    arg: "target",
                    reason: format!(
                        "{} was built for {own}, whose features only sm_{} has, not {requested}",
                        recipe.spec, own.arch
                    ),
                });
            }
            requested.arch_specific()
        } else {
            self.sass_or_ptx(requested)?
        };
        let parts = KeyParts {
            target: target.to_string(),
            nvrtc_version: self.nvrtc()?.version_string(),
            ..recipe.parts.clone()
        };
        self.slot_or_load(&recipe.spec, target, parts, false)
    }

    /// The target `requested` resolves to when there is no NVRTC to ask: the arch-specific
    /// variant where the family needs it (no PTX fallback: that depends on the NVRTC).
    fn resolve_target_offline(&self, spec: &KernelSpec, requested: Target) -> Result<Target> {
        check_builds_for(spec, requested)?;
        Ok(if spec.template.arch_specific {
            requested.arch_specific()
        } else {
            requested
        })
    }

    /// The cached entry of any NVRTC for `spec`, when no NVRTC can be loaded; `missing` (why
    /// NVRTC is unavailable) when there is none.
    fn find_without_nvrtc(
        &self,
        spec: &KernelSpec,
        requested: Target,
        missing: Error,
    ) -> Result<Compiled> {
        let target = self.resolve_target_offline(spec, requested)?;
        let lookup = self
            .key_parts_for(spec, target, String::new())?
            .lookup_key();
        let slot = self.modules.entry(lookup).or_default().clone();
        let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = slot.as_ref() {
            return Ok(Compiled {
                entry: entry.clone(),
                origin: Origin::Memory,
            });
        }
        let entry = Arc::new(self.cache.find_any(&lookup).ok_or(missing)?);
        *slot = Some(entry.clone());
        Ok(Compiled {
            entry,
            origin: Origin::Disk,
        })
    }

    /// The entry for `key` on disk, else (with `any_nvrtc`) another NVRTC's for the same lookup
    /// key. `what` names the module in logs; a corrupt entry is logged and counts as missing.
    fn disk_entry(
        &self,
        what: &str,
        target: Target,
        key: CacheKey,
        parts: &KeyParts,
        any_nvrtc: bool,
    ) -> Option<Entry> {
        match self.cache.load(&key) {
            Lookup::Hit(entry) => return Some(*entry),
            Lookup::Corrupt(why) => {
                tracing::warn!(spec = what, %target, reason = %why, "recompiling a corrupt cache entry");
            }
            Lookup::Miss => {}
        }
        if !any_nvrtc {
            return None;
        }
        let entry = self.cache.find_any(&parts.lookup_key())?;
        tracing::info!(spec = what, %target, nvrtc = %entry.parts.nvrtc_version,
            "using a cache entry another NVRTC version made");
        Some(entry)
    }

    /// The entry for `key` from disk (with `any_nvrtc`, also another NVRTC's for the same
    /// lookup key), or compiled now and stored. `what` names the module in logs and errors.
    fn load_or_compile(
        &self,
        what: &str,
        target: Target,
        key: CacheKey,
        parts: KeyParts,
        any_nvrtc: bool,
    ) -> Result<Compiled> {
        if let Some(entry) = self.disk_entry(what, target, key, &parts, any_nvrtc) {
            return Ok(Compiled {
                entry: Arc::new(entry),
                origin: Origin::Disk,
            });
        }
        let nvrtc = self.nvrtc()?;
        // Compiling what this machine's driver could not load helps no one; another machine's
        // target (`kiln warm --arch`) is compiled all the same when there is no driver here.
        if let Some(driver) = super::compat::driver_version() {
            if let Some(why) = super::compat::refusal(nvrtc.version, driver, target.is_ptx()) {
                return Err(Error::NvrtcDriverMismatch(why));
            }
        }
        let mut options = parts.options.clone();
        options.push(target.nvrtc_option());
        let started = Instant::now();
        let span = tracing::info_span!("kiln.compile", spec = what, %target);
        let _enter = span.enter();
        // The program name appears only in NVRTC's messages: the family's name.
        let program = what.split_whitespace().next().unwrap_or("kiln");
        // Exit waits for the compile and its store (see `exit_wait`).
        let _in_flight = super::exit_wait::Call::start("nvrtcCreateProgram")?;
        let output = nvrtc.compile(
            program,
            &parts.source,
            &parts.name_expressions,
            &options,
            target.is_ptx(),
        )?;
        let output = match output {
            Ok(o) => o,
            Err(failure) => {
                let source_path: Option<PathBuf> =
                    self.cache.save_failed_source(&key, &parts.source);
                return Err(Error::Compile {
                    spec: what.to_string(),
                    target: target.to_string(),
                    log: failure.log,
                    source_path,
                });
            }
        };
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "compiled");
        let entry = Entry {
            key,
            parts,
            spec: what.to_string(),
            producer: PRODUCER.to_string(),
            image_kind: if target.is_ptx() {
                ImageKind::Ptx
            } else {
                ImageKind::Cubin
            },
            lowered_names: output.lowered_names,
            image: output.image,
        };
        self.cache.store(&entry);
        Ok(Compiled {
            entry: Arc::new(entry),
            origin: Origin::Compiled,
        })
    }
}

/// Why an NVRTC of major version `major`, whose oldest target is `oldest`, cannot serve an
/// older one, and which NVRTC can.
fn too_old_reason(major: i32, oldest: Option<u32>) -> String {
    let oldest = oldest.map_or("none".to_string(), |o| format!("sm_{o}"));
    if major >= 13 {
        format!(
            "its oldest target is {oldest}. NVRTC 12 still compiles for Volta (sm_70, sm_72): \
             install it with `pip install nvidia-cuda-nvrtc-cu12` and point KILN_NVRTC_LIB at \
             the libnvrtc.so.12 that wheel puts in site-packages/nvidia/cuda_nvrtc/lib"
        )
    } else {
        format!("its oldest target is {oldest}")
    }
}

/// The platform cache directory (e.g. `~/.cache/kiln` on Linux), or `./.kiln-cache` if the
/// platform has none.
pub fn default_cache_dir() -> PathBuf {
    directories::ProjectDirs::from("", "", "kiln")
        .map(|d| d.cache_dir().to_path_buf())
        .unwrap_or_else(|| PathBuf::from(".kiln-cache"))
}

/// An error unless `spec`'s family can be built for `requested` (families written for one
/// architecture only).
fn check_builds_for(spec: &KernelSpec, requested: Target) -> Result<()> {
    if spec.builds_for(requested.arch) {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        arg: "target",
        reason: format!(
            "{} is written for sm_{} only, not {requested}",
            spec.template.name,
            spec.template.only_arch.unwrap_or_default()
        ),
    })
}
