//! The ops: argument checks, spec choice and launch geometry. Each op registers every spec it can
//! choose, so `kiln warm` compiles them all ahead of time.

pub mod axpby;
pub mod conv;
pub mod copy;
pub mod norm;

use crate::jit::KernelSpec;
use crate::runtime::CommandEncoder;

/// Architectures whose choices differ (tensor cores, shared memory, the Hopper family), oldest
/// first; every other architecture chooses as one of these does.
pub const DISTINCT_ARCHS: [u32; 6] = [70, 75, 80, 86, 90, 100];

/// Every spec an op can choose on architecture `arch` (compute capability x 10), for GPUs with
/// that architecture's shared memory: what `kiln warm` compiles for it.
pub fn registered_specs_for(arch: u32) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    out.extend(norm::specs(norm::Gpu::for_arch(arch)));
    out.extend(conv::specs(arch));
    out.extend(copy::specs());
    out.extend(axpby::specs());
    out.extend(crate::dist::specs());
    out
}

/// Every spec any op can choose on any architecture, each once.
pub fn registered_specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for arch in DISTINCT_ARCHS {
        for spec in registered_specs_for(arch) {
            if seen.insert(spec) {
                out.push(spec);
            }
        }
    }
    out
}

/// Blocks for a grid-stride kernel over `n` elements: enough to cover them, at most 16 per SM
/// (each thread then loops), at least one.
fn grid_stride_blocks(enc: &CommandEncoder, n: usize, block: u16) -> usize {
    let sms = enc.device().info().multiprocessors as usize;
    n.div_ceil(block as usize).clamp(1, sms * 16)
}
