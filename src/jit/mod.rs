//! The JIT: kernel specs, template rendering, NVRTC, the disk cache and the in-memory table.

// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod background;
pub mod bundle;
pub mod compat;
pub mod compiler;
pub mod disk_cache;
pub mod entry;
mod exit_wait;
pub mod family;
pub mod kernels;
pub mod key;
pub mod nvrtc;
pub mod spec;
pub mod target;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod template;
pub mod warm;

pub use compiler::{Compiled, Jit, Origin};
pub use family::{register_family, FamilyExtras};
pub use kernels::{KernelTable, LoadedKernel};
pub use key::CacheKey;
pub use spec::{KernelSpec, TemplateDef};
pub use target::{Target, TargetKind};
pub use warm::{WarmProgress, WarmReport};
