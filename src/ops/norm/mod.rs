//! LayerNorm and RMSNorm, forward and VJP, over the last axis (MLX's `fast::layer_norm` and
//! `fast::rms_norm` semantics). Output dtype is x's; accumulation is f32.
//!
//! Spec choice: GROUP threads per row, whole warps up to 1,024; rows that fit stay in
//! registers (ITEMS vectors of 16 bytes per thread), several short rows share a block, longer
//! rows loop. Vectorised 16-bit rows keep the next row in flight in shared memory (STAGES); on
//! Hopper, forward rows past one block's registers take a cluster of blocks each where a call has
//! fewer rows than SMs, and a block each (up to 4 vectors a thread) where it has more. 16-bit
//! VJP rows too long for registers are read from their stages on every pass (RESIDENT); other VJP
//! rows of up to 1,024 threads' registers keep their weights and partial sums in shared memory
//! (SHARED_SUMS). The VJP writes per-block f32 partial sums of dweight/dbias and reduces them
//! with one column-sum launch.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::jit::{KernelSpec, LoadedKernel, TemplateDef};
use crate::runtime::{Array, CommandEncoder, KernelArgs};

/// The forward pass, LayerNorm or RMSNorm, one row per GROUP threads (`templates/norm_fwd.cu`).
pub static FORWARD: TemplateDef = TemplateDef {
    name: "norm_fwd",
    ..FORWARD_FIELDS
};
/// `FORWARD` but for its name (its stand-in family shares the rest).
const FORWARD_FIELDS: TemplateDef = TemplateDef {
    name: "",
    source: include_str!("../../../templates/norm_fwd.cu"),
    kernel: "kiln_norm_fwd",
    const_names: &["RMS", "GROUP", "ITEMS", "STAGES"],
    arch_specific: false,
    only_arch: None,
};

/// The VJP: dx, and per-block f32 partial sums of dweight and dbias (`templates/norm_vjp.cu`).
pub static VJP: TemplateDef = TemplateDef {
    name: "norm_vjp",
    ..VJP_FIELDS
};
/// `VJP` but for its name (its stand-in family shares the rest).
const VJP_FIELDS: TemplateDef = TemplateDef {
    name: "",
    source: include_str!("../../../templates/norm_vjp.cu"),
    kernel: "kiln_norm_vjp",
    const_names: &["RMS", "GROUP", "ITEMS", "STAGES", "RESIDENT"],
    arch_specific: false,
    only_arch: None,
};

/// f32 forward rows too long for one block's registers, on GPUs with thread-block clusters: a
/// cluster per row, each block's chunk of the next row loaded into registers (see `split_spec`).
pub static FORWARD_SPLIT: TemplateDef = TemplateDef {
    name: "norm_fwd_split",
    source: include_str!("../../../templates/norm_fwd_split.cu"),
    kernel: "kiln_norm_fwd_split",
    const_names: &["RMS", "ITEMS", "CLUSTER"],
    arch_specific: false,
    only_arch: Some(SPLIT_ARCH),
};

/// 16-bit forward rows too long for one block, on GPUs with thread-block clusters: a cluster per
/// row, each block's chunks of the next rows in flight in a ring of shared-memory stages filled
/// by bulk copies (see `split_spec`).
pub static FORWARD_STAGED: TemplateDef = TemplateDef {
    name: "norm_fwd_staged",
    source: include_str!("../../../templates/norm_fwd_staged.cu"),
    kernel: "kiln_norm_fwd_staged",
    const_names: &["RMS", "ITEMS", "CLUSTER", "SHIFTED", "PAIRED"],
    arch_specific: false,
    only_arch: Some(SPLIT_ARCH),
};

/// VJP rows too long for one block, on GPUs with thread-block clusters: a cluster per row, the
/// clusters looping over rows (see `vjp_split_spec`).
pub static VJP_SPLIT: TemplateDef = TemplateDef {
    name: "norm_vjp_split",
    source: include_str!("../../../templates/norm_vjp_split.cu"),
    kernel: "kiln_norm_vjp_split",
    const_names: &["RMS", "ITEMS", "CLUSTER", "SMEM_SUMS", "PIPELINE"],
    arch_specific: false,
    only_arch: Some(SPLIT_ARCH),
};

/// What the spec choice needs to know of a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// The most dynamic shared memory one block may use, in bytes.
    pub shared_limit: usize,
    /// Whether the split-row forward (thread-block clusters) runs there.
    pub clusters: bool,
}

impl Gpu {
    /// The GPU `device` runs kiln's code paths for (its own, or the one it emulates).
    pub fn of(device: &crate::runtime::Device) -> Gpu {
        Gpu {
            shared_limit: device.shared_limit(),
            clusters: device.arch() == SPLIT_ARCH,
        }
    }

    /// A GPU of architecture `arch` (compute capability x 10), for `kiln warm`.
    pub fn for_arch(arch: u32) -> Gpu {
        Gpu {
            shared_limit: crate::jit::target::shared_memory_per_block(arch),
            clusters: arch == SPLIT_ARCH,
        }
    }
}

/// The architecture the split-row forward is compiled for (clusters exist from sm_90 on; only
/// Hopper is built and measured so far).
pub const SPLIT_ARCH: u32 = 90;

/// Which normalisation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `(x - mean) / sqrt(var + eps) * weight + bias` over the last axis.
    LayerNorm,
    /// `x / sqrt(mean(x^2) + eps) * weight` over the last axis.
    RmsNorm,
}

/// Which direction a spec computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The normalised output.
    Forward,
    /// The vector-Jacobian product: gradients of x, weight and bias.
    Vjp,
}

/// An argument error naming `arg`.
fn bad(arg: &'static str, reason: String) -> Error {
    Error::InvalidArgument { arg, reason }
}

mod choose;
mod launch;
mod reference;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod stand_in;
#[cfg(test)]
mod tests;
#[doc(hidden)]
pub mod tuning;

pub use crate::ops::col_sums::{reduce_cols_spec, REDUCE_COLS};
pub use choose::{choose_spec, specs, Count, Rows};
pub use launch::{layer_norm, layer_norm_vjp, reduce_cols, rms_norm, rms_norm_vjp, MAX_ROW};
#[doc(hidden)]
pub use reference::{reference_forward, reference_vjp};
