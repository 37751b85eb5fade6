//! The ops: argument checks, spec choice and launch geometry. Each op registers every spec it can
//! choose, so `kiln warm` compiles them all ahead of time.

pub mod axpby;
pub mod conv;
pub mod copy;
pub mod norm;

use std::sync::OnceLock;

use crate::jit::{KernelSpec, TemplateDef};
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

/// kiln's own kernel families, each once: the family registry (`jit::family`) starts with these
/// names taken.
pub fn kiln_families() -> &'static [&'static TemplateDef] {
    static FAMILIES: OnceLock<Vec<&'static TemplateDef>> = OnceLock::new();
    FAMILIES.get_or_init(|| {
        let mut out: Vec<&'static TemplateDef> = Vec::new();
        for spec in registered_specs() {
            if !out.iter().any(|d| std::ptr::eq(*d, spec.template)) {
                out.push(spec.template);
            }
        }
        out
    })
}

/// Blocks for a grid-stride kernel over `n` elements on `enc`'s device: enough to cover them, at
/// most 16 per SM (each thread then loops), at least one. Public for applications' own kernels.
pub fn grid_stride_blocks(enc: &CommandEncoder, n: usize, block: u16) -> usize {
    let sms = enc.device().info().multiprocessors as usize;
    grid_stride_blocks_for(sms, n, block)
}

/// [`grid_stride_blocks`] for a GPU of `sms` multiprocessors (a pure function).
pub fn grid_stride_blocks_for(sms: usize, n: usize, block: u16) -> usize {
    n.div_ceil(block.max(1) as usize).clamp(1, sms.max(1) * 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_stride_blocks_cover_and_cap() {
        assert_eq!(grid_stride_blocks_for(132, 0, 256), 1);
        assert_eq!(grid_stride_blocks_for(132, 1000, 256), 4);
        assert_eq!(grid_stride_blocks_for(132, 1 << 30, 256), 132 * 16);
        assert_eq!(grid_stride_blocks_for(0, 10, 0), 10);
    }

    #[test]
    fn kiln_families_have_unique_names() {
        let names: std::collections::HashSet<_> = kiln_families().iter().map(|d| d.name).collect();
        assert_eq!(names.len(), kiln_families().len());
        assert!(names.contains("axpby") && names.contains("collective_check"));
    }
}
