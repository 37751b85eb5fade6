//! kiln: a JIT-first CUDA runtime. Kernels are handlebars CUDA templates, specialised per dtype,
//! block dim and N_READS, compiled at run time with NVRTC into a content-addressed disk cache and
//! loaded once per device.

#![warn(missing_docs)]

pub mod dist;
pub mod dtype;
pub mod env;
pub mod error;
pub mod jit;
pub mod ops;
pub mod runtime;
pub mod selfcheck;

pub use dtype::{DType, Element};
pub use error::{Error, Result};

/// The README's examples, compiled as doctests so that they keep to the API.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// `docs/app-families.md`'s examples, compiled as doctests likewise.
#[doc = include_str!("../docs/app-families.md")]
#[cfg(doctest)]
pub struct AppFamiliesDoctests;
