//! The ops: argument checks, spec choice and launch geometry. Each op registers every spec it can
//! choose, so `kiln warm` compiles them all ahead of time.

pub mod axpby;
pub mod copy;
pub mod norm;

use crate::jit::KernelSpec;

/// Every spec any op can choose.
pub fn registered_specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    out.extend(norm::specs());
    out.extend(copy::specs());
    out.extend(axpby::specs());
    out
}
