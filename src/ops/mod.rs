//! The ops: argument checks, spec choice and launch geometry. Each op registers every spec it can
//! choose, so `kiln warm` compiles them all ahead of time.

pub mod axpby;
pub mod conv;
pub mod copy;
pub mod norm;

use crate::jit::KernelSpec;
use crate::runtime::CommandEncoder;

/// Every spec any op can choose.
pub fn registered_specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    out.extend(norm::specs());
    out.extend(conv::specs());
    out.extend(copy::specs());
    out.extend(axpby::specs());
    out
}

/// Blocks for a grid-stride kernel over `n` elements: enough to cover them, at most 16 per SM
/// (each thread then loops), at least one.
fn grid_stride_blocks(enc: &CommandEncoder, n: usize, block: u16) -> usize {
    let sms = enc.device().info().multiprocessors as usize;
    n.div_ceil(block as usize).clamp(1, sms * 16)
}
