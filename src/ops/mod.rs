//! The ops: argument checks, spec choice and launch geometry. Each op registers every spec it can
//! choose, so `kiln warm` compiles them all ahead of time.

pub mod axpby;
pub mod col_sums;
pub mod conv;
pub mod norm;

/// The strided copy with cast, a runtime built-in (`Array::contiguous`, `Array::astype`).
pub use crate::runtime::copy;
pub use crate::runtime::{grid_stride_blocks, grid_stride_blocks_for};

use crate::jit::{FamilyExtras, KernelSpec, TemplateDef};

/// Architectures whose choices differ (tensor cores, shared memory, the Hopper family), oldest
/// first; every other architecture chooses as one of these does.
pub const DISTINCT_ARCHS: [u32; 6] = [70, 75, 80, 86, 90, 100];

/// Every spec an op can choose on architecture `arch` (compute capability x 10), for GPUs with
/// that architecture's shared memory: what `kiln warm` compiles for it.
pub fn registered_specs_for(arch: u32) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    out.extend(norm::specs(norm::Gpu::for_arch(arch)));
    out.extend(conv::specs(arch));
    out.extend(col_sums::specs());
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
/// names taken. Written out rather than gathered from the registered specs, because the registry
/// is built on a process's first render and enumerating every norm row length on every
/// architecture took about 0.7 s of it; a test checks the list against those specs.
pub fn kiln_families() -> &'static [&'static TemplateDef] {
    static FAMILIES: [&TemplateDef; 23] = [
        &norm::FORWARD,
        &norm::VJP,
        &norm::FORWARD_SPLIT,
        &norm::FORWARD_STAGED,
        &norm::VJP_SPLIT,
        &conv::plan::IGEMM,
        &conv::hopper::WGMMA,
        &conv::depthwise::DEPTHWISE,
        &conv::depthwise::DEPTHWISE_TC,
        &conv::depthwise::DEPTHWISE_ROWS,
        &conv::depthwise::DEPTHWISE_COLS,
        &conv::direct::DIRECT,
        &conv::grouped::GROUPED,
        &conv::stem::STEM,
        &col_sums::REDUCE_COLS,
        &copy::COPY,
        &copy::COPY_INTO,
        &copy::TRANSPOSE,
        &axpby::AXPBY,
        &crate::dist::COLLECTIVE_CHECK,
        STAND_IN_FAMILIES[0],
        STAND_IN_FAMILIES[1],
        STAND_IN_FAMILIES[2],
    ];
    &FAMILIES
}

/// kiln's stand-in families (`KILN_STAND_INS`): a family's template under another name,
/// compiled with [`STAND_IN_EXTRAS`]. Their specs are not registered: `kiln warm` compiles the
/// kernels they stand in for, after which no stand-in is needed.
pub const STAND_IN_FAMILIES: [&TemplateDef; 3] = [
    &conv::stand_in::IGEMM_QUICK,
    &norm::stand_in::FORWARD_QUICK,
    &norm::stand_in::VJP_QUICK,
];

/// What makes a stand-in quick to compile: NVRTC's fast-compile level `mid` (NVRTC 12.8 and
/// later), which cuts the time 3-5x by optimising less; accumulators then live in local memory.
pub const STAND_IN_EXTRAS: FamilyExtras = FamilyExtras {
    partials: &[],
    entry_points: &[],
    options: &["--Ofast-compile=mid"],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kiln_families_have_unique_names() {
        let names: std::collections::HashSet<_> = kiln_families().iter().map(|d| d.name).collect();
        assert_eq!(names.len(), kiln_families().len());
        assert!(names.contains("axpby") && names.contains("collective_check"));
    }

    /// The written-out list is exactly the families of the registered specs (every
    /// architecture's) and the stand-ins: none missing, none stale.
    #[test]
    fn kiln_families_are_those_of_the_registered_specs() {
        let listed = |def: &TemplateDef| kiln_families().iter().any(|d| std::ptr::eq(*d, def));
        let mut used: Vec<&'static TemplateDef> = Vec::new();
        for spec in registered_specs() {
            assert!(
                listed(spec.template),
                "{} is not listed",
                spec.template.name
            );
            if !used.iter().any(|d| std::ptr::eq(*d, spec.template)) {
                used.push(spec.template);
            }
        }
        for stand_in in STAND_IN_FAMILIES {
            assert!(listed(stand_in), "{} is not listed", stand_in.name);
        }
        assert_eq!(kiln_families().len(), used.len() + STAND_IN_FAMILIES.len());
    }
}
