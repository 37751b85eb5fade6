//! LayerNorm and RMSNorm, forward and VJP, over the last axis (MLX's `fast::layer_norm` and
//! `fast::rms_norm` semantics). Output dtype is x's; accumulation is f32.
//!
//! Spec choice: GROUP threads per row, as a power of two in [32, 1024]; rows that fit stay in
//! registers (ITEMS vectors of 16 bytes per thread), several short rows share a block, longer
//! rows loop. Vectorised 16-bit rows keep the next row in flight in shared memory (STAGES), and
//! 16-bit VJP rows too long for registers are read from there on every pass (RESIDENT); other VJP
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
    source: include_str!("../../templates/norm_fwd.cu"),
    kernel: "kiln_norm_fwd",
    const_names: &["RMS", "GROUP", "ITEMS", "STAGES"],
    arch_specific: false,
    only_arch: None,
};

/// The VJP: dx, and per-block f32 partial sums of dweight and dbias (`templates/norm_vjp.cu`).
pub static VJP: TemplateDef = TemplateDef {
    name: "norm_vjp",
    source: include_str!("../../templates/norm_vjp.cu"),
    kernel: "kiln_norm_vjp",
    const_names: &["RMS", "GROUP", "ITEMS", "STAGES", "RESIDENT"],
    arch_specific: false,
    only_arch: None,
};

/// Forward rows too long for one block's registers, on GPUs with thread-block clusters: a
/// cluster per row (see `split_spec`).
pub static FORWARD_SPLIT: TemplateDef = TemplateDef {
    name: "norm_fwd_split",
    source: include_str!("../../templates/norm_fwd_split.cu"),
    kernel: "kiln_norm_fwd_split",
    const_names: &["RMS", "ITEMS", "CLUSTER"],
    arch_specific: false,
    only_arch: Some(SPLIT_ARCH),
};

/// VJP rows too long for one block, on GPUs with thread-block clusters: a cluster per row, the
/// clusters looping over rows (see `vjp_split_spec`).
pub static VJP_SPLIT: TemplateDef = TemplateDef {
    name: "norm_vjp_split",
    source: include_str!("../../templates/norm_vjp_split.cu"),
    kernel: "kiln_norm_vjp_split",
    const_names: &["RMS", "ITEMS", "CLUSTER", "SMEM_SUMS"],
    arch_specific: false,
    only_arch: Some(SPLIT_ARCH),
};

/// Column sums of f32 matrices, stored as the dtype: the VJP's partial sums into dweight and
/// dbias (`templates/reduce_cols.cu`).
pub static REDUCE_COLS: TemplateDef = TemplateDef {
    name: "reduce_cols",
    source: include_str!("../../templates/reduce_cols.cu"),
    kernel: "kiln_reduce_cols",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
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

const MIN_BLOCK: usize = 256;
const GROUPS: [usize; 6] = [32, 64, 128, 256, 512, 1024];
/// Threads per row, at most: 1024 forward; 512 for the VJP, whose x and g rows need more than
/// the 64 registers a 1024-thread block leaves each thread.
fn max_group(pass: Pass) -> usize {
    match pass {
        Pass::Forward => 1024,
        Pass::Vjp => 512,
    }
}

/// The most vectors a thread holds in registers: 16 floats of x forward (more costs occupancy:
/// measured), 16 each of x and the cotangent in the VJP, whose partial sums of dweight and dbias
/// take as many registers again.
fn max_items(_pass: Pass, n_reads: usize) -> usize {
    (16 / n_reads).clamp(1, 4)
}

/// Vectors per thread the choice starts from, from the `--sweep` of benches/norm.rs on an H100:
/// fewer threads per row with more items wins (fewer barriers, more rows per block), except for
/// 16-bit VJPs, whose x, g and four partial sums per element press on registers: they start at
/// one item and take more only once a row would need more than 256 threads.
fn preferred_items(pass: Pass, dtype: DType, n_reads: usize, vectors: usize) -> usize {
    let max = max_items(pass, n_reads);
    if pass == Pass::Vjp && dtype.size() == 2 && vectors <= 256 {
        return 1;
    }
    max
}

/// Whether a row takes one warp with up to four vectors per thread, whatever the item rule:
/// vectorised 16-bit forward rows of up to 128 vectors (1,024 elements). Their statistics need
/// no barrier, and with a ring of stages they beat wider groups of fewer items (`--sweep` on an
/// H100, bf16 LayerNorm: 16384x768 2,639 GB/s for 32 x 3 against 2,378 for 64 x 2; 8192x1024
/// 2,645 for 32 x 4 against 2,499 for 64 x 2).
fn one_warp_rows(pass: Pass, dtype: DType, n_reads: usize, vectors: usize) -> bool {
    pass == Pass::Forward && dtype.size() == 2 && n_reads > 1 && vectors <= 4 * 32
}

/// Whether a row takes one vector per thread on as many whole warps as it needs (96 threads
/// for 768 elements, not 128): vectorised 16-bit VJP rows of up to 256 vectors, whose cost
/// is the instructions each row's threads issue, idle lanes included.
fn one_vector_rows(pass: Pass, dtype: DType, n_reads: usize, vectors: usize) -> bool {
    pass == Pass::Vjp && dtype.size() == 2 && n_reads > 1 && vectors <= 256
}

/// Threads per block: whole rows, at least MIN_BLOCK threads where rows are short.
fn block_of(group: usize) -> usize {
    group * (MIN_BLOCK / group).max(1)
}

/// The spec for `group` threads per row with `items` vectors each (0: the looped path).
fn spec_of(
    pass: Pass,
    kind: Kind,
    dtype: DType,
    n_reads: usize,
    group: usize,
    items: usize,
) -> KernelSpec {
    let stages = stages(dtype, n_reads, items);
    let resident = resident(pass, dtype, n_reads, group, items);
    spec_with(pass, kind, dtype, n_reads, group, items, stages, resident)
}

/// The spec of every choice spelt out (`spec_of` derives the ring and residency from the rules).
#[allow(clippy::too_many_arguments)]
fn spec_with(
    pass: Pass,
    kind: Kind,
    dtype: DType,
    n_reads: usize,
    group: usize,
    items: usize,
    stages: usize,
    resident: bool,
) -> KernelSpec {
    let def = match pass {
        Pass::Forward => &FORWARD,
        Pass::Vjp => &VJP,
    };
    let block = block_of(group);
    let mut consts = vec![
        (kind == Kind::RmsNorm) as i32,
        group as i32,
        items as i32,
        stages as i32,
    ];
    if pass == Pass::Vjp {
        consts.push(resident as i32);
    }
    KernelSpec::new(def, dtype, block as u16, n_reads as u8, &consts)
}

/// Threads per row of a VJP whose x and cotangent rows stay in their shared memory stages
/// (RESIDENT), and vectors per thread: rows longer than registers hold (16-bit rows of 8,192 to
/// 16,384 elements), with only the partial sums in registers. The stages of two rows of x and g
/// take 128 KiB of shared memory, the weights 32 KiB more. Measured on an H100
/// (notes/performance.md item 12): 512 threads of 4 vectors (118 registers) run 2-6% faster than
/// 1,024 of 2 (64 registers, twice the warps).
const RESIDENT_GROUP: usize = 512;
const RESIDENT_ITEMS: usize = 4;

/// Threads per row of a VJP whose rows are too long for 512 threads' registers and are not
/// resident (f32 rows of 8,193 to 16,384 elements, unaligned rows of up to 4,096): 1,024
/// threads hold x and g in registers and keep the weights and their partial sums in shared
/// memory (the kernel's SHARED_SUMS), so that the row is read once, all of it in flight at once.
const SHARED_SUMS_GROUP: usize = 1024;

/// A norm spec's constant `name`, by name (the families share names, not positions); 0 where
/// the family has none (RESIDENT is the VJP's alone). `constants_are_declared` checks the names.
fn constant(spec: &KernelSpec, name: &str) -> usize {
    spec.constant(name).map_or(0, |v| v.max(0) as usize)
}

/// Whether `spec` is for RMSNorm (else LayerNorm).
fn is_rms(spec: &KernelSpec) -> bool {
    constant(spec, "RMS") != 0
}

/// Whether a register-path VJP spec keeps its weights and partial sums in shared memory.
fn shared_sums(spec: &KernelSpec) -> bool {
    spec.template.name == VJP.name
        && constant(spec, "ITEMS") > 0
        && constant(spec, "RESIDENT") == 0
        && spec.block_dim as usize == SHARED_SUMS_GROUP
}

/// Whether a VJP spec reads x and the cotangent from their stages on every pass instead of
/// holding them in registers: staged rows of more vectors than the register path takes.
fn resident(pass: Pass, dtype: DType, n_reads: usize, group: usize, items: usize) -> bool {
    pass == Pass::Vjp
        && group * items > max_group(pass) * max_items(pass, n_reads)
        && stages(dtype, n_reads, items) > 0
}

/// Rows a kernel keeps in flight (the current one included) in a ring of shared memory stages
/// filled by cp.async, 0 for none: vectorised 16-bit rows held in registers (and the VJP's
/// resident rows). One-warp forward rows of one vector ran 2-3% faster without while each row
/// loaded its own weights; with the weights staged once per block the ring wins there too
/// (`--sweep`, bf16 65536x256: 2,763 GB/s against 2,529). The kernel then runs on a grid no
/// larger than the GPU holds at once, each block looping over rows. 16-bit rows carry half the
/// bytes of f32 rows for the same work per row, and one row at a time left their loads
/// latency-bound (one-warp VJP rows of 256 elements: 1,778 -> 2,111 GB/s with the ring). Two stages (one row ahead): three and four were
/// no faster on an H100 and take more shared memory (notes/performance.md). f32 rows take none:
/// they already run near copy speed.
fn stages(dtype: DType, n_reads: usize, items: usize) -> usize {
    if dtype.size() == 2 && n_reads > 1 && items > 0 {
        2
    } else {
        0
    }
}

/// Dynamic shared memory of a spec's ring of stages: 16 bytes per vector, one row of x (and one
/// of the cotangent in the VJP) per stage; resident VJP rows add their weights (one more row),
/// SHARED_SUMS rows their weights and partial sums of dw and db as floats, and forward rings
/// one row's weights and bias (RMSNorm: weights only), shared by the block's groups.
fn ring_bytes(spec: &KernelSpec) -> usize {
    if is_vjp_split(spec) {
        // Each thread's weights as floats, and with SMEM_SUMS its partial sums of dw and db.
        let floats = constant(spec, "ITEMS") * spec.block_dim as usize * spec.n_reads as usize;
        return floats
            * 4
            * if constant(spec, "SMEM_SUMS") != 0 {
                3
            } else {
                1
            };
    }
    if is_split(spec) {
        // Each thread's weight and bias as floats.
        let floats = constant(spec, "ITEMS") * spec.block_dim as usize * spec.n_reads as usize;
        return 2 * floats * 4;
    }
    let vjp = spec.template.name == VJP.name;
    let arrays = if vjp { 2 } else { 1 };
    let (rms, group) = (is_rms(spec), constant(spec, "GROUP"));
    let (items, stages) = (constant(spec, "ITEMS"), constant(spec, "STAGES"));
    let vectors = items * spec.block_dim as usize;
    let floats = vectors * spec.n_reads as usize * 4;
    let extra = if vjp && constant(spec, "RESIDENT") != 0 {
        vectors * 16
    } else if shared_sums(spec) {
        3 * floats
    } else if !vjp && stages > 0 {
        let params = if rms { 1 } else { 2 };
        params * items * group * 16
    } else {
        0
    };
    stages * arrays * vectors * 16 + extra
}

/// The grid of a kernel whose blocks loop over rows, `blocks` being what one row per group
/// would take: no more blocks than the GPU holds at once (of `block` threads and `shared`
/// dynamic bytes), and as few as give every block the same number of turns, so that no last
/// turn runs with a few blocks alone (bf16 forward 16384x768, 5 blocks per SM: 3.1 turns each
/// on average meant a fourth turn for a tenth of the blocks).
fn resident_grid(
    enc: &CommandEncoder,
    kernel: &LoadedKernel,
    block: usize,
    shared: usize,
    blocks: usize,
) -> Result<usize> {
    let sms = enc.device().info().multiprocessors as usize;
    let per_sm = kernel.blocks_per_sm(block as u32, shared)?;
    Ok(balanced_grid(blocks, sms * per_sm))
}

/// The fewest blocks, at most `slots`, that take `blocks` turns of work in as few turns each as
/// `slots` blocks would (the last block may take fewer).
fn balanced_grid(blocks: usize, slots: usize) -> usize {
    let turns = blocks.div_ceil(slots.max(1)).max(1);
    blocks.div_ceil(turns).max(1)
}

/// Whether a block of `spec` fits in `shared_limit` bytes of shared memory: its ring (or
/// shared sums) and 1 KiB for the kernel's static scratch.
fn fits(spec: &KernelSpec, shared_limit: usize) -> bool {
    ring_bytes(spec) + 1024 <= shared_limit
}

/// Threads per block of the split-row forward.
const SPLIT_BLOCK: usize = 512;
/// The split-row forward's layouts in order of preference: (most blocks per cluster, most
/// elements per thread). Up to 8 elements (x and the next row's x in 16 registers), two blocks
/// share each SM; longer rows take up to 16 elements and Hopper's non-portable 16 blocks.
const SPLIT_LAYOUTS: [(usize, usize); 2] = [(8, 8), (16, 16)];
/// The most elements a split-row forward thread holds per row.
const SPLIT_ELEMENTS: usize = 16;

/// The split-row forward for rows of `vectors` vectors, if a cluster's registers hold them: the
/// first layout that does, with the fewest blocks per cluster (of `VJP_SPLIT_CLUSTERS`, up to
/// the layout's) whose threads, each holding a power of two of vectors, cover the row.
fn split_spec(kind: Kind, dtype: DType, n_reads: usize, vectors: usize) -> Option<KernelSpec> {
    SPLIT_LAYOUTS.iter().find_map(|&(most, elements)| {
        let per_block = SPLIT_BLOCK * (elements / n_reads).max(1);
        let cluster = *VJP_SPLIT_CLUSTERS
            .iter()
            .find(|&&c| c <= most && c * per_block >= vectors)?;
        let items = vectors.div_ceil(SPLIT_BLOCK * cluster).next_power_of_two();
        (items * n_reads <= elements).then(|| {
            let consts = [(kind == Kind::RmsNorm) as i32, items as i32, cluster as i32];
            KernelSpec::new(
                &FORWARD_SPLIT,
                dtype,
                SPLIT_BLOCK as u16,
                n_reads as u8,
                &consts,
            )
        })
    })
}

/// Threads per block of the split-row VJP.
const VJP_SPLIT_BLOCK: usize = 512;
/// Blocks per cluster of the split-row VJP: the fewest of these whose registers hold the row
/// (2 to the portable 8, then Hopper's non-portable 16). Blocks beyond the row's length would
/// only wait on its exchanges, and every block spared lets another row be in flight.
const VJP_SPLIT_CLUSTERS: [usize; 8] = [2, 3, 4, 5, 6, 7, 8, 16];
/// The most elements a split-row VJP thread holds per row: 16 each of x, the cotangent, the next
/// row's x and cotangent, and the partial sums of dweight and dbias (96 registers of 128).
const VJP_SPLIT_ELEMENTS: usize = 16;

/// The split-row VJP's layouts in order of preference: (most blocks per cluster, most elements
/// per thread, partial sums in shared memory). A row's time is bound by the latency of its two
/// exchanges more than by its bytes, so 16-bit rows (half the bytes of f32 rows) keep their
/// partial sums of dweight and dbias in shared memory, where 64 registers suffice and two blocks,
/// two rows, share each SM (1118 x 30,000 f16 LayerNorm: 38% of copy against 29%). At 16
/// elements such a thread spills, so longer rows hold their sums in registers, one block per SM
/// (512 x 65,536 f16: 37% of copy, against 33% for 16 blocks of 8 elements with shared sums,
/// which compute-sanitizer's synccheck also flagged, "missing init" of a pushed-to mbarrier).
fn vjp_split_layouts(dtype: DType) -> &'static [(usize, usize, bool)] {
    if dtype.size() == 2 {
        &[(8, 8, true), (8, 16, false), (16, 16, false)]
    } else {
        &[(8, 16, false), (16, 16, false)]
    }
}

/// The split-row VJP for rows of `vectors` vectors, if a cluster's registers hold them: the
/// first layout of `vjp_split_layouts` that does, with the fewest blocks per cluster (up to the
/// layout's) whose threads, each holding a power of two of vectors within the layout's elements,
/// cover the row.
fn vjp_split_spec(kind: Kind, dtype: DType, n_reads: usize, vectors: usize) -> Option<KernelSpec> {
    vjp_split_layouts(dtype)
        .iter()
        .find_map(|&(most, elements, smem_sums)| {
            let per_block = VJP_SPLIT_BLOCK * (elements / n_reads).max(1);
            let cluster = *VJP_SPLIT_CLUSTERS
                .iter()
                .find(|&&c| c <= most && c * per_block >= vectors)?;
            let items = vectors
                .div_ceil(VJP_SPLIT_BLOCK * cluster)
                .next_power_of_two();
            (items * n_reads <= elements).then(|| {
                let consts = [
                    (kind == Kind::RmsNorm) as i32,
                    items as i32,
                    cluster as i32,
                    smem_sums as i32,
                ];
                KernelSpec::new(
                    &VJP_SPLIT,
                    dtype,
                    VJP_SPLIT_BLOCK as u16,
                    n_reads as u8,
                    &consts,
                )
            })
        })
}

/// Whether `spec` is a split-row spec (a cluster per row), forward or VJP.
fn is_split(spec: &KernelSpec) -> bool {
    *spec.template == FORWARD_SPLIT || is_vjp_split(spec)
}

/// Whether `spec` is a split-row VJP spec.
fn is_vjp_split(spec: &KernelSpec) -> bool {
    *spec.template == VJP_SPLIT
}

/// The spec for rows of `d` elements on a GPU whose blocks may use `shared_limit` bytes of
/// shared memory ([`Device::shared_limit`](crate::runtime::Device::shared_limit)).
/// `vectorized`: 16-byte loads are legal (rows aligned, `d` a multiple of the vector width).
/// Where a ring of stages or resident rows would not fit, rows are held in registers without a
/// ring, or take the looped path (GPUs with 64-99 KiB: Turing, consumer Ampere and Ada).
pub fn choose_spec(
    pass: Pass,
    kind: Kind,
    dtype: DType,
    d: usize,
    vectorized: bool,
    gpu: Gpu,
) -> KernelSpec {
    let shared_limit = gpu.shared_limit;
    let n_reads = if vectorized { dtype.vec_width() } else { 1 };
    let vectors = d.div_ceil(n_reads).max(1);
    let max = max_items(pass, n_reads);
    if vectors > max_group(pass) * max {
        if pass == Pass::Forward && gpu.clusters {
            if let Some(spec) = split_spec(kind, dtype, n_reads, vectors) {
                return spec;
            }
        }
        if vectors <= RESIDENT_GROUP * RESIDENT_ITEMS
            && resident(pass, dtype, n_reads, RESIDENT_GROUP, RESIDENT_ITEMS)
        {
            let spec = spec_of(pass, kind, dtype, n_reads, RESIDENT_GROUP, RESIDENT_ITEMS);
            if fits(&spec, shared_limit) {
                return spec;
            }
        }
        if pass == Pass::Vjp && vectors <= SHARED_SUMS_GROUP * max {
            let items = vectors.div_ceil(SHARED_SUMS_GROUP).next_power_of_two();
            let spec = spec_of(pass, kind, dtype, n_reads, SHARED_SUMS_GROUP, items);
            if fits(&spec, shared_limit) {
                return spec;
            }
        }
        if pass == Pass::Vjp && gpu.clusters {
            if let Some(spec) = vjp_split_spec(kind, dtype, n_reads, vectors) {
                if fits(&spec, shared_limit) {
                    return spec;
                }
            }
        }
        return spec_of(pass, kind, dtype, n_reads, 1024, 0);
    }
    let (group, items) = if one_warp_rows(pass, dtype, n_reads, vectors) {
        (32, vectors.div_ceil(32))
    } else if one_vector_rows(pass, dtype, n_reads, vectors) {
        (vectors.next_multiple_of(32), 1)
    } else {
        let group = vectors
            .div_ceil(preferred_items(pass, dtype, n_reads, vectors))
            .next_power_of_two()
            .clamp(32, max_group(pass));
        (group, vectors.div_ceil(group).next_power_of_two())
    };
    let spec = spec_of(pass, kind, dtype, n_reads, group, items);
    if fits(&spec, shared_limit) {
        spec
    } else {
        // The same rows in registers, without the ring.
        spec_with(pass, kind, dtype, n_reads, group, items, 0, false)
    }
}

/// Every spec the norm ops can choose where blocks may use `shared_limit` bytes of shared
/// memory, and the column reductions: `choose_spec` depends on d only through its count of
/// vectors and is the same past the longest rows held in registers, so every count up to one
/// past those gives every choice.
pub fn specs(gpu: Gpu) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for pass in [Pass::Forward, Pass::Vjp] {
        for kind in [Kind::LayerNorm, Kind::RmsNorm] {
            for dtype in DType::ALL {
                for n_reads in [1, dtype.vec_width()] {
                    let longest = max_group(pass) * max_items(pass, n_reads);
                    let mut longest = longest
                        .max(RESIDENT_GROUP * RESIDENT_ITEMS)
                        .max(SHARED_SUMS_GROUP * max_items(pass, n_reads));
                    if pass == Pass::Forward && gpu.clusters {
                        longest = longest.max(SPLIT_BLOCK * 16 * SPLIT_ELEMENTS / n_reads);
                    }
                    if pass == Pass::Vjp && gpu.clusters {
                        let widest = VJP_SPLIT_CLUSTERS[VJP_SPLIT_CLUSTERS.len() - 1];
                        longest =
                            longest.max(VJP_SPLIT_BLOCK * widest * VJP_SPLIT_ELEMENTS / n_reads);
                    }
                    for vectors in 1..=longest + 1 {
                        let d = vectors * n_reads;
                        let spec = choose_spec(pass, kind, dtype, d, n_reads > 1, gpu);
                        if seen.insert(spec) {
                            out.push(spec);
                        }
                    }
                }
            }
        }
    }
    for dtype in DType::ALL {
        for columns_per_thread in [1, 4] {
            out.push(reduce_cols_spec(dtype, columns_per_thread));
        }
    }
    out
}

/// The column sum storing `dtype`, each thread summing `columns_per_thread` adjacent columns
/// (4: one 16-byte load per row).
pub fn reduce_cols_spec(dtype: DType, columns_per_thread: usize) -> KernelSpec {
    KernelSpec::new(
        &REDUCE_COLS,
        dtype,
        REDUCE_BLOCK as u16,
        columns_per_thread as u8,
        &[],
    )
}

const REDUCE_BLOCK: usize = 256;

/// Column threads per block of the column sum (the rest of the block are row lanes): as many
/// as 32 (whole 128-byte rows per warp), fewer while that leaves the GPU's SMs with under two
/// blocks each, down to one 32-byte sector per row.
fn reduce_col_threads(d: usize, sets: usize, columns_per_thread: usize, sms: usize) -> usize {
    let fewest = 8 / columns_per_thread;
    let mut col_threads = 32;
    while col_threads > fewest && d.div_ceil(col_threads * columns_per_thread) * sets < 2 * sms {
        col_threads /= 2;
    }
    col_threads
}

fn bad(arg: &'static str, reason: String) -> Error {
    Error::InvalidArgument { arg, reason }
}

/// Checks x, eps, and an optional 1-D parameter of length d and x's dtype.
fn check_inputs(x: &Array, params: &[(&'static str, Option<&Array>)], eps: f32) -> Result<usize> {
    if x.ndim() == 0 {
        return Err(bad(
            "x",
            "must have at least one axis (normalised over the last)".into(),
        ));
    }
    if eps.is_nan() || eps < 0.0 || eps.is_infinite() {
        return Err(bad("eps", format!("must be finite and >= 0, got {eps}")));
    }
    let d = *x.shape().last().expect("ndim >= 1");
    for (name, p) in params {
        let Some(p) = p else { continue };
        if p.shape() != [d] {
            // 1-D, of x's last axis' length.
            return Err(Error::ShapeMismatch {
                arg: name,
                expected: vec![d],
                got: p.shape().to_vec(),
            });
        }
        if p.dtype() != x.dtype() {
            return Err(Error::DTypeMismatch {
                arg: name,
                expected: x.dtype(),
                got: p.dtype(),
            });
        }
        if p.device().ordinal() != x.device().ordinal() {
            return Err(bad(name, "is on another device than x".into()));
        }
    }
    Ok(d)
}

/// x as rows of d elements with unit stride: (the array to read, its row stride). Views whose
/// leading axes collapse into one stride are read in place; anything else is copied once.
fn as_rows(enc: &mut CommandEncoder, x: &Array) -> Result<(Array, i64)> {
    let n = x.ndim();
    let d = x.shape()[n - 1];
    let unit_last = d <= 1 || x.strides()[n - 1] == 1;
    let mut row_stride: Option<isize> = None;
    let mut collapses = unit_last;
    // Walk the leading axes inwards-out: each must step over the whole of the ones inside it.
    let mut inner: Option<(isize, usize)> = None; // (stride, extent) of the next inner axis > 1
    for i in (0..n - 1).rev() {
        let (extent, stride) = (x.shape()[i], x.strides()[i]);
        if extent <= 1 {
            continue;
        }
        match inner {
            None => row_stride = Some(stride),
            Some((s, e)) => collapses &= stride == s * e as isize,
        }
        inner = Some((stride, extent));
    }
    if collapses && row_stride.unwrap_or(0) >= 0 {
        return Ok((x.clone(), row_stride.unwrap_or(d as isize) as i64));
    }
    let c = x.contiguous(enc)?;
    Ok((c, d as i64))
}

fn aligned(a: &Array) -> bool {
    a.device_ptr() % 16 == 0
}

/// Whether 16-byte loads are legal on these row views and parameters.
fn can_vectorize(dtype: DType, d: usize, rows: &[(&Array, i64)]) -> bool {
    let v = dtype.vec_width();
    d % v == 0
        && rows
            .iter()
            .all(|(a, stride)| aligned(a) && stride % v as i64 == 0)
}

fn param_args(p: Option<&Array>, vectorized: bool) -> (u64, i64, i32) {
    match p {
        None => (0, 0, 0),
        Some(p) => {
            let stride = p.strides()[0] as i64;
            let vec = vectorized && stride == 1 && aligned(p);
            (p.device_ptr(), stride, vec as i32)
        }
    }
}

fn geometry(spec: &KernelSpec) -> (usize, usize) {
    let block = spec.block_dim as usize;
    if is_split(spec) {
        return (block, 1);
    }
    let group = constant(spec, "GROUP");
    (block, block / group)
}

fn forward(
    enc: &mut CommandEncoder,
    kind: Kind,
    x: &Array,
    w: Option<&Array>,
    b: Option<&Array>,
    eps: f32,
    chosen: Option<KernelSpec>,
) -> Result<Array> {
    let d = check_inputs(x, &[("weight", w), ("bias", b)], eps)?;
    let y = Array::empty_on(enc, x.dtype(), x.shape())?;
    if x.size() == 0 {
        return Ok(y);
    }
    let rows = x.size() / d;
    let (xr, x_stride) = as_rows(enc, x)?;
    let vectorized = can_vectorize(x.dtype(), d, &[(&xr, x_stride)]);
    let spec = match chosen {
        Some(spec) => check_chosen(spec, Pass::Forward, kind, x.dtype(), d, vectorized)?,
        None => {
            let mut gpu = Gpu::of(enc.device());
            // Where clusters pay, from `--long` on an H100: with fewer rows than SMs, where the
            // one-block-per-row streamed path leaves SMs idle; for f32 at any row count (82-92%
            // of copy from 16,385 to 131,072 elements). Many 16-bit rows stream faster
            // (512 x 65,536 LayerNorm: 55% against 35% split).
            let sms = enc.device().info().multiprocessors as usize;
            gpu.clusters &= x.dtype() == DType::F32 || rows < sms;
            choose_spec(Pass::Forward, kind, x.dtype(), d, vectorized, gpu)
        }
    };
    if !enc.device().has_kernel(&spec) {
        // A first forward of this shape: training calls the VJP next (with a cotangent laid out
        // like x), whose kernel and column sums compile in the background meanwhile.
        let gpu = Gpu::of(enc.device());
        let columns_per_thread = if d % 4 == 0 { 4 } else { 1 };
        enc.device().prefetch([
            choose_spec(Pass::Vjp, kind, x.dtype(), d, vectorized, gpu),
            reduce_cols_spec(x.dtype(), columns_per_thread),
        ]);
    }
    let kernel = enc.device().kernel(&spec)?;
    let (wp, ws, wv) = param_args(w, vectorized);
    let (bp, bs, bv) = param_args(b, vectorized);
    let mut args = KernelArgs::new();
    args.push(xr.device_ptr())
        .push(wp)
        .push(bp)
        .push(y.device_ptr())
        .push(rows as i64)
        .push(d as i32)
        .push(x_stride)
        .push(ws)
        .push(bs)
        .push(wv)
        .push(bv)
        .push(eps);
    let (block, groups) = geometry(&spec);
    let shared = ring_bytes(&spec);
    let grid = if is_split(&spec) {
        // Clusters of consecutive blocks loop over rows: as many as the GPU holds at once.
        kernel.allow_shared(shared)?;
        let cluster = constant(&spec, "CLUSTER");
        let slots = kernel.max_active_clusters(block as u32, shared)?;
        balanced_grid(rows, slots) * cluster
    } else if shared > 0 {
        // Each block loops over rows, with the next rows' loads in flight.
        kernel.allow_shared(shared)?;
        resident_grid(enc, &kernel, block, shared, rows.div_ceil(groups))?
    } else {
        rows.div_ceil(groups)
    };
    let mut reads = vec![&xr];
    reads.extend(w);
    reads.extend(b);
    // SAFETY: the arguments are norm_fwd's (or norm_fwd_split's) in order and type; x's rows, the
    // weight and bias (when given) are read and y written, within the rows x d elements and
    // strides checked above.
    unsafe {
        enc.launch(
            &kernel,
            grid as u32,
            block as u32,
            shared as u32,
            args,
            &reads,
            &[&y],
        )
    }?;
    Ok(y)
}

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last axis.
pub fn layer_norm(
    enc: &mut CommandEncoder,
    x: &Array,
    weight: Option<&Array>,
    bias: Option<&Array>,
    eps: f32,
) -> Result<Array> {
    forward(enc, Kind::LayerNorm, x, weight, bias, eps, None)
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last axis.
pub fn rms_norm(
    enc: &mut CommandEncoder,
    x: &Array,
    weight: Option<&Array>,
    eps: f32,
) -> Result<Array> {
    forward(enc, Kind::RmsNorm, x, weight, None, eps, None)
}

fn zeros(enc: &mut CommandEncoder, dtype: DType, n: usize) -> Result<Array> {
    Array::from_f64(enc, dtype, &vec![0.0; n], &[n])
}

/// (dx, dweight if weight, dbias if want_db).
#[allow(clippy::too_many_arguments)]
fn vjp(
    enc: &mut CommandEncoder,
    kind: Kind,
    x: &Array,
    w: Option<&Array>,
    want_db: bool,
    g: &Array,
    eps: f32,
    chosen: Option<KernelSpec>,
) -> Result<(Array, Option<Array>, Option<Array>)> {
    let d = check_inputs(x, &[("weight", w)], eps)?;
    if g.shape() != x.shape() {
        return Err(Error::ShapeMismatch {
            arg: "cotangent",
            expected: x.shape().to_vec(),
            got: g.shape().to_vec(),
        });
    }
    if g.dtype() != x.dtype() {
        return Err(Error::DTypeMismatch {
            arg: "cotangent",
            expected: x.dtype(),
            got: g.dtype(),
        });
    }
    let dx = Array::empty_on(enc, x.dtype(), x.shape())?;
    let dtype = x.dtype();
    if x.size() == 0 {
        // No rows: the parameter gradients are sums over nothing.
        let dw = w.map(|_| zeros(enc, dtype, d)).transpose()?;
        let db = if want_db {
            Some(zeros(enc, dtype, d)?)
        } else {
            None
        };
        return Ok((dx, dw, db));
    }
    let rows = x.size() / d;
    let (xr, xs) = as_rows(enc, x)?;
    let (gr, gs) = as_rows(enc, g)?;
    let vectorized = can_vectorize(dtype, d, &[(&xr, xs), (&gr, gs)]);
    let spec = match chosen {
        Some(spec) => check_chosen(spec, Pass::Vjp, kind, dtype, d, vectorized)?,
        None => choose_spec(Pass::Vjp, kind, dtype, d, vectorized, Gpu::of(enc.device())),
    };
    let kernel = enc.device().kernel(&spec)?;
    let (block, groups) = geometry(&spec);
    // The looped path keeps its partial sums in shared memory when two rows of d floats fit.
    let looped = constant(&spec, "ITEMS") == 0;
    let smem_bytes = 2 * d * 4;
    let smem_partials =
        looped && (w.is_some() || want_db) && smem_bytes + 1024 <= enc.device().shared_limit();
    let shared = if smem_partials {
        smem_bytes
    } else {
        ring_bytes(&spec)
    };
    kernel.allow_shared(shared)?;
    // Each block (split rows: each cluster) loops over rows, writing one partial row of dweight
    // and dbias, so fewer blocks means fewer partial rows to reduce.
    let (grid, partial_rows) = if is_vjp_split(&spec) {
        let cluster = constant(&spec, "CLUSTER");
        let slots = kernel.max_active_clusters(block as u32, shared)?;
        let clusters = balanced_grid(rows, slots);
        (clusters * cluster, clusters)
    } else {
        let grid = resident_grid(enc, &kernel, block, shared, rows.div_ceil(groups))?;
        (grid, grid)
    };
    // The partial sums of dweight then dbias, [sets, partial_rows, d], reduced in one launch.
    let sets = w.is_some() as usize + want_db as usize;
    let partial = (sets > 0)
        .then(|| Array::empty_on(enc, DType::F32, &[sets, partial_rows, d]))
        .transpose()?;
    let set_ptr = |set: usize| {
        partial
            .as_ref()
            .map_or(0, |p| p.device_ptr() + (set * partial_rows * d * 4) as u64)
    };
    let (pw, pb) = match (w.is_some(), want_db) {
        (true, true) => (set_ptr(0), set_ptr(1)),
        (true, false) => (set_ptr(0), 0),
        (false, true) => (0, set_ptr(0)),
        (false, false) => (0, 0),
    };
    let (wp, ws, wv) = param_args(w, vectorized);
    let mut args = KernelArgs::new();
    args.push(xr.device_ptr())
        .push(wp)
        .push(gr.device_ptr())
        .push(dx.device_ptr())
        .push(pw)
        .push(pb)
        .push(rows as i64)
        .push(d as i32)
        .push(xs)
        .push(gs)
        .push(ws)
        .push(wv)
        .push(eps)
        .push(smem_partials as i32);
    let mut reads = vec![&xr, &gr];
    reads.extend(w);
    let mut writes = vec![&dx];
    writes.extend(partial.as_ref());
    // SAFETY: the arguments are the VJP templates' in order and type; x, the cotangent and the
    // weight are read, dx and the f32 partial rows written, within the shapes checked above and
    // the partial rows sized for this grid.
    unsafe {
        enc.launch(
            &kernel,
            grid as u32,
            block as u32,
            shared as u32,
            args,
            &reads,
            &writes,
        )
    }?;
    let dw = w.map(|_| Array::empty_on(enc, dtype, &[d])).transpose()?;
    let db = if want_db {
        Some(Array::empty_on(enc, dtype, &[d])?)
    } else {
        None
    };
    if let Some(partial) = &partial {
        let outs: Vec<&Array> = dw.iter().chain(db.iter()).collect();
        reduce_col_sets(enc, partial, partial_rows, d, &outs)?;
    }
    Ok((dx, dw, db))
}

/// Column sums of an f32 [rows, d] array, as `dtype`. Another rank or dtype is an error.
pub fn reduce_cols(enc: &mut CommandEncoder, partial: &Array, dtype: DType) -> Result<Array> {
    let &[rows, d] = partial.shape() else {
        return Err(bad(
            "partial",
            format!("must be 2-D [rows, d], got shape {:?}", partial.shape()),
        ));
    };
    if partial.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch {
            arg: "partial",
            expected: DType::F32,
            got: partial.dtype(),
        });
    }
    if d == 0 {
        return Array::empty_on(enc, dtype, &[0]);
    }
    // The kernel reads rows `d` apart: a view is copied once.
    let partial = partial.contiguous(enc)?;
    let partial = &partial;
    let out = Array::empty_on(enc, dtype, &[d])?;
    reduce_col_sets(enc, partial, rows, d, &[&out])?;
    Ok(out)
}

/// Column sums of `outs.len()` f32 [rows, d] matrices stored one after another in `partial`,
/// into `outs` (one launch for all).
fn reduce_col_sets(
    enc: &mut CommandEncoder,
    partial: &Array,
    rows: usize,
    d: usize,
    outs: &[&Array],
) -> Result<()> {
    // 16-byte loads when every row starts 16-byte aligned.
    let columns_per_thread = if d % 4 == 0 { 4 } else { 1 };
    let spec = reduce_cols_spec(outs[0].dtype(), columns_per_thread);
    let kernel = enc.device().kernel(&spec)?;
    let sms = enc.device().info().multiprocessors as usize;
    let col_threads = reduce_col_threads(d, outs.len(), columns_per_thread, sms);
    let mut args = KernelArgs::new();
    args.push(partial.device_ptr())
        .push(outs[0].device_ptr())
        .push(outs.last().expect("one output at least").device_ptr())
        .push(rows as i64)
        .push(d as i32)
        .push(col_threads as i32);
    let blocks = d.div_ceil(col_threads * columns_per_thread);
    // SAFETY: the arguments are reduce_cols' in order and type; partial holds rows x d f32 per
    // output, every output d elements.
    unsafe {
        enc.launch(
            &kernel,
            (blocks as u32, outs.len() as u32, 1),
            REDUCE_BLOCK as u32,
            0,
            args,
            &[partial],
            outs,
        )
    }
}

/// LayerNorm's VJP: (dx, dweight if weight is given, dbias if bias is given).
pub fn layer_norm_vjp(
    enc: &mut CommandEncoder,
    x: &Array,
    weight: Option<&Array>,
    bias: Option<&Array>,
    cotangent: &Array,
    eps: f32,
) -> Result<(Array, Option<Array>, Option<Array>)> {
    if let Some(b) = bias {
        check_inputs(x, &[("bias", Some(b))], eps)?;
    }
    vjp(
        enc,
        Kind::LayerNorm,
        x,
        weight,
        bias.is_some(),
        cotangent,
        eps,
        None,
    )
}

/// RMSNorm's VJP: (dx, dweight if weight is given).
pub fn rms_norm_vjp(
    enc: &mut CommandEncoder,
    x: &Array,
    weight: Option<&Array>,
    cotangent: &Array,
    eps: f32,
) -> Result<(Array, Option<Array>)> {
    let (dx, dw, _) = vjp(enc, Kind::RmsNorm, x, weight, false, cotangent, eps, None)?;
    Ok((dx, dw))
}

/// Checks a caller-chosen spec: the right family, kind and dtype, a legal vector width, enough
/// registers for the row and a ring only where it can run (a wrong one would compute garbage or
/// fault on misaligned loads). Structural, not a lookup: it runs on every tuned call.
fn check_chosen(
    spec: KernelSpec,
    pass: Pass,
    kind: Kind,
    dtype: DType,
    d: usize,
    vectorized: bool,
) -> Result<KernelSpec> {
    let family = match pass {
        Pass::Forward => &FORWARD,
        Pass::Vjp => &VJP,
    };
    let n_reads = spec.n_reads as usize;
    let legal_width = n_reads == 1 || (vectorized && n_reads == dtype.vec_width());
    if is_vjp_split(&spec) {
        // Any power of two of vectors a thread, within its registers, that covers the row.
        let (items, cluster) = (constant(&spec, "ITEMS"), constant(&spec, "CLUSTER"));
        let ok = pass == Pass::Vjp
            && spec.dtype == dtype
            && legal_width
            && items.is_power_of_two()
            && items * n_reads <= VJP_SPLIT_ELEMENTS
            && VJP_SPLIT_CLUSTERS.contains(&cluster)
            && spec.block_dim as usize == VJP_SPLIT_BLOCK
            && VJP_SPLIT_BLOCK * cluster * items * n_reads >= d
            && constant(&spec, "RMS") == (kind == Kind::RmsNorm) as usize
            && match constant(&spec, "SMEM_SUMS") {
                0 => true,
                1 => items * n_reads <= 8,
                _ => false,
            };
        if !ok {
            return Err(bad(
                "spec",
                format!("{spec} cannot run {pass:?} {kind:?} {dtype} rows of {d}"),
            ));
        }
        return Ok(spec);
    }
    if is_split(&spec) {
        // Any power of two of vectors a thread that, over the cluster, covers the row.
        let (items, cluster) = (constant(&spec, "ITEMS"), constant(&spec, "CLUSTER"));
        let ok = pass == Pass::Forward
            && spec.dtype == dtype
            && legal_width
            && items.is_power_of_two()
            && items * n_reads <= SPLIT_ELEMENTS
            && VJP_SPLIT_CLUSTERS.contains(&cluster)
            && spec.block_dim as usize == SPLIT_BLOCK
            && SPLIT_BLOCK * cluster * items * n_reads >= d
            && constant(&spec, "RMS") == (kind == Kind::RmsNorm) as usize;
        if !ok {
            return Err(bad(
                "spec",
                format!("{spec} cannot run {pass:?} {kind:?} {dtype} rows of {d}"),
            ));
        }
        return Ok(spec);
    }
    let (group, items) = (constant(&spec, "GROUP"), constant(&spec, "ITEMS"));
    let stages = constant(&spec, "STAGES");
    let resident = spec.consts.get(4).is_some_and(|&r| r != 0);
    // 1,024 threads: the looped path, and VJP rows resident or with SHARED_SUMS (no ring).
    let max = match pass {
        _ if items == 0 => 1024,
        Pass::Vjp if resident || (stages == 0 && n_reads <= 4) => 1024,
        _ => max_group(pass),
    };
    let ok = *spec.template == *family
        && spec.dtype == dtype
        && legal_width
        && group % 32 == 0
        && (group <= 256 || GROUPS.contains(&group))
        && group <= max
        && items <= 4
        && (items == 0 || group * items * n_reads >= d)
        && (stages == 0 || (stages == 2 && items > 0 && dtype.size() * n_reads == 16))
        && (!resident || stages > 0)
        && spec == spec_with(pass, kind, dtype, n_reads, group, items, stages, resident);
    if !ok {
        return Err(bad(
            "spec",
            format!("{spec} cannot run {pass:?} {kind:?} {dtype} rows of {d}"),
        ));
    }
    Ok(spec)
}

/// Entry points that take an explicit specialisation, for benchmarks that compare them. The ops
/// above choose for themselves; these refuse a spec that does not fit.
#[doc(hidden)]
pub mod tuning {
    use super::*;

    /// Every vectorised spec that could serve rows of `d` without a wasted half: threads per
    /// row, 1-4 vectors each, with and without a ring of stages (16-bit), resident or not (VJP).
    /// A superset of what `choose_spec` picks from, for `--sweep` to measure.
    /// Shared memory a Hopper block may opt into (227 KiB): candidates needing more are left out.
    const MAX_SHARED: usize = 227 * 1024;

    pub fn candidates(pass: Pass, kind: Kind, dtype: DType, d: usize) -> Vec<KernelSpec> {
        let n_reads = dtype.vec_width();
        let mut out = Vec::new();
        let groups = (1..8).map(|w| 32 * w).chain(GROUPS.into_iter().skip(3));
        for group in groups {
            for items in 1..=4 {
                let covers = |g: usize| g * items * n_reads >= d;
                if !covers(group) || (group > 32 && covers(group / 2)) {
                    continue;
                }
                let mut variants = vec![(0, false)];
                if dtype.size() == 2 {
                    variants.push((2, false));
                    if pass == Pass::Vjp {
                        variants.push((2, true));
                    }
                }
                for (stages, resident) in variants {
                    // Past 512 threads a VJP row is resident or keeps SHARED_SUMS (no ring).
                    let wide_ok = pass == Pass::Vjp && (resident || (stages == 0 && n_reads <= 4));
                    let spec =
                        spec_with(pass, kind, dtype, n_reads, group, items, stages, resident);
                    if group > max_group(pass) && !wide_ok || ring_bytes(&spec) > MAX_SHARED {
                        continue;
                    }
                    out.push(spec);
                }
            }
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    pub fn forward_with(
        enc: &mut CommandEncoder,
        kind: Kind,
        x: &Array,
        w: Option<&Array>,
        b: Option<&Array>,
        eps: f32,
        spec: KernelSpec,
    ) -> Result<Array> {
        forward(enc, kind, x, w, b, eps, Some(spec))
    }

    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub fn vjp_with(
        enc: &mut CommandEncoder,
        kind: Kind,
        x: &Array,
        w: Option<&Array>,
        want_db: bool,
        g: &Array,
        eps: f32,
        spec: KernelSpec,
    ) -> Result<(Array, Option<Array>, Option<Array>)> {
        vjp(enc, kind, x, w, want_db, g, eps, Some(spec))
    }
}

/// The f64 CPU reference of the forward pass: `x` row-major `rows x d`.
#[doc(hidden)]
pub fn reference_forward(
    kind: Kind,
    x: &[f64],
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    d: usize,
    eps: f64,
) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(d.max(1)) {
        let (mean, rstd) = stats(kind, row, eps);
        for (j, v) in row.iter().enumerate() {
            let mut o = (v - mean) * rstd * w.map_or(1.0, |w| w[j]);
            if kind == Kind::LayerNorm {
                o += b.map_or(0.0, |b| b[j]);
            }
            y.push(o);
        }
    }
    y
}

fn stats(kind: Kind, row: &[f64], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = match kind {
        Kind::LayerNorm => row.iter().sum::<f64>() / n,
        Kind::RmsNorm => 0.0,
    };
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// The f64 CPU reference of the VJP: (dx, dweight, dbias) for cotangent `g`.
#[doc(hidden)]
pub fn reference_vjp(
    kind: Kind,
    x: &[f64],
    w: Option<&[f64]>,
    g: &[f64],
    d: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut dx = Vec::with_capacity(x.len());
    let (mut dw, mut db) = (vec![0.0; d], vec![0.0; d]);
    for (row, grow) in x.chunks(d.max(1)).zip(g.chunks(d.max(1))) {
        let (mean, rstd) = stats(kind, row, eps);
        let n = d as f64;
        let xh: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
        let wg: Vec<f64> = grow
            .iter()
            .enumerate()
            .map(|(j, g)| g * w.map_or(1.0, |w| w[j]))
            .collect();
        let c1 = wg.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / n;
        let c2 = match kind {
            Kind::LayerNorm => wg.iter().sum::<f64>() / n,
            Kind::RmsNorm => 0.0,
        };
        for j in 0..d {
            dx.push(rstd * (wg[j] - c2 - xh[j] * c1));
            dw[j] += grow[j] * xh[j];
            db[j] += grow[j];
        }
    }
    (dx, dw, db)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_balanced_grid_gives_every_block_the_same_turns() {
        // bf16 forward 16384x768: 2,048 blocks of 8 rows, 660 at once -> 4 turns on 512 blocks.
        assert_eq!(balanced_grid(2048, 660), 512);
        assert_eq!(balanced_grid(2048, 132), 128);
        assert_eq!(balanced_grid(10, 660), 10);
        assert_eq!(balanced_grid(0, 660), 1);
        for blocks in 1..400 {
            for slots in 1..40 {
                let grid = balanced_grid(blocks, slots);
                let turns = blocks.div_ceil(slots);
                assert!(
                    grid <= slots && grid <= blocks,
                    "{blocks} on {slots}: {grid}"
                );
                // No more turns than the full grid takes, and no block without work.
                assert!(grid * turns >= blocks && (grid - 1) * turns < blocks);
            }
        }
    }

    #[test]
    fn constants_are_declared() {
        // Every name `constant` reads, in the families that have it.
        for (family, names) in [
            (&FORWARD, &["RMS", "GROUP", "ITEMS", "STAGES"][..]),
            (&VJP, &["RMS", "GROUP", "ITEMS", "STAGES", "RESIDENT"][..]),
            (&FORWARD_SPLIT, &["RMS", "ITEMS", "CLUSTER"][..]),
            (&VJP_SPLIT, &["RMS", "ITEMS", "CLUSTER", "SMEM_SUMS"][..]),
        ] {
            for name in names {
                assert!(family.const_names.contains(name), "{} {name}", family.name);
            }
        }
        let spec = choose_spec(
            Pass::Vjp,
            Kind::RmsNorm,
            DType::BF16,
            100_000,
            true,
            Gpu::for_arch(90),
        );
        assert!(is_vjp_split(&spec) && is_rms(&spec));
        assert_eq!(spec.constant("CLUSTER"), Some(spec.consts[2]));
        assert_eq!(spec.constant("GROUP"), None);
    }

    #[test]
    fn every_chosen_spec_is_registered_and_fits() {
        // Turing, Volta, consumer Ampere and Ada, A100, H100 (with and without clusters).
        for limit in [64, 96, 99, 163, 227].map(|k| k * 1024) {
            every_chosen_spec_is_registered_for(Gpu {
                shared_limit: limit,
                clusters: false,
            });
        }
        every_chosen_spec_is_registered_for(Gpu::for_arch(SPLIT_ARCH));
    }

    fn every_chosen_spec_is_registered_for(gpu: Gpu) {
        let limit = gpu.shared_limit;
        let registered = specs(gpu);
        for pass in [Pass::Forward, Pass::Vjp] {
            for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                for dtype in DType::ALL {
                    for d in (1..=70).chain([
                        255,
                        256,
                        768,
                        1000,
                        1024,
                        4096,
                        8192,
                        16384,
                        16392,
                        18432,
                        30000,
                        32768,
                        65536,
                        65537,
                        131072,
                        131073,
                        1 << 20,
                    ]) {
                        for vectorized in [false, true] {
                            if vectorized && d % dtype.vec_width() != 0 {
                                continue;
                            }
                            let s = choose_spec(pass, kind, dtype, d, vectorized, gpu);
                            assert!(
                                registered.contains(&s),
                                "{s} chosen for d={d} but not registered"
                            );
                            assert!(fits(&s, limit), "{s}: {} bytes", ring_bytes(&s));
                            assert_eq!(
                                *s.template == FORWARD_SPLIT,
                                gpu.clusters && pass == Pass::Forward && {
                                    let n_reads = s.n_reads as usize;
                                    d.div_ceil(n_reads) > 1024 * max_items(pass, n_reads)
                                        && split_spec(kind, dtype, n_reads, d.div_ceil(n_reads))
                                            .is_some()
                                }
                            );
                            // The split VJP takes what a block's registers and shared memory
                            // do not, up to what a cluster's registers hold.
                            let n_reads = s.n_reads as usize;
                            let vectors = d.div_ceil(n_reads);
                            if pass == Pass::Vjp && gpu.clusters {
                                let beyond_a_block = vectors > 1024 * max_items(pass, n_reads);
                                let fits_cluster =
                                    vectors <= VJP_SPLIT_BLOCK * 16 * VJP_SPLIT_ELEMENTS / n_reads;
                                if beyond_a_block && fits_cluster {
                                    assert!(is_vjp_split(&s), "{s} chosen for d={d}");
                                }
                            } else {
                                assert!(!is_vjp_split(&s), "{s} chosen for d={d}");
                            }
                            if is_split(&s) {
                                let (items, cluster) =
                                    (constant(&s, "ITEMS"), constant(&s, "CLUSTER"));
                                let covered = s.block_dim as usize * items * cluster;
                                assert!(
                                    covered * s.n_reads as usize >= d,
                                    "{s} does not cover d={d}"
                                );
                                assert!(check_chosen(s, pass, kind, dtype, d, vectorized).is_ok());
                                continue;
                            }
                            let (group, items) = (constant(&s, "GROUP"), constant(&s, "ITEMS"));
                            if items > 0 {
                                assert!(
                                    group * items * s.n_reads as usize >= d,
                                    "{s} does not cover d={d}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn references_agree_with_finite_differences() {
        // d/dx of sum(g * f(x)) by central differences, against reference_vjp.
        let d = 5;
        let x = [0.3, -1.2, 2.0, 0.7, -0.4, 1.1, 0.0, -0.9, 0.5, 2.2];
        let w = [1.5, -0.5, 0.8, 1.0, 2.0];
        let b = [0.1, 0.2, 0.3, 0.4, 0.5];
        let g = [0.2, -0.7, 1.0, 0.4, -1.3, 0.9, 0.1, -0.2, 0.6, 0.3];
        for kind in [Kind::LayerNorm, Kind::RmsNorm] {
            let f = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
                reference_forward(kind, x, Some(w), Some(b), d, 1e-5)
                    .iter()
                    .zip(&g)
                    .map(|(y, g)| y * g)
                    .sum()
            };
            let (dx, dw, db) = reference_vjp(kind, &x, Some(&w), &g, d, 1e-5);
            let h = 1e-6;
            for i in 0..x.len() {
                let (mut p, mut m) = (x, x);
                p[i] += h;
                m[i] -= h;
                let num = (f(&p, &w, &b) - f(&m, &w, &b)) / (2.0 * h);
                assert!(
                    (num - dx[i]).abs() < 1e-6,
                    "{kind:?} dx[{i}]: {num} vs {}",
                    dx[i]
                );
            }
            for j in 0..d {
                let (mut p, mut m) = (w, w);
                p[j] += h;
                m[j] -= h;
                let num = (f(&x, &p, &b) - f(&x, &m, &b)) / (2.0 * h);
                assert!((num - dw[j]).abs() < 1e-6, "{kind:?} dw[{j}]");
                if kind == Kind::LayerNorm {
                    let (mut p, mut m) = (b, b);
                    p[j] += h;
                    m[j] -= h;
                    let num = (f(&x, &w, &p) - f(&x, &w, &m)) / (2.0 * h);
                    assert!((num - db[j]).abs() < 1e-6, "db[{j}]");
                }
            }
        }
    }
}
