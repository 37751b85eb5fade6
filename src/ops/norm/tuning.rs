//! Entry points that take an explicit specialisation, for benchmarks that compare them. The ops
//! above choose for themselves; these refuse a spec that does not fit.

use super::choose::*;
use super::launch::*;
use super::*;

/// Shared memory a Hopper block may opt into (227 KiB): candidates needing more are left out.
const MAX_SHARED: usize = 227 * 1024;

/// Every vectorised spec that could serve rows of `d` without a wasted half: threads per
/// row (the powers of two, and for each count of vectors a thread the fewest whole warps that
/// cover the row), 1-4 vectors each, with and without a ring of stages, the VJP's rows on a
/// ring held as floats, resident or (16-bit) packed. A superset of what `choose_spec` picks
/// from, for `--sweep` to measure.
pub fn candidates(pass: Pass, kind: Kind, dtype: DType, d: usize) -> Vec<KernelSpec> {
    let n_reads = dtype.vec_width();
    let vectors = d.div_ceil(n_reads).max(1);
    let mut out = Vec::new();
    let layouts = (1..=4).flat_map(|items| {
        let tight = vectors.div_ceil(items).next_multiple_of(32);
        let powers = GROUPS.into_iter().filter(move |&g| g != tight);
        std::iter::once(tight)
            .chain(powers)
            .map(move |g| (g, items))
    });
    let mut layouts: Vec<_> = layouts.collect();
    layouts.sort_unstable();
    for (group, items) in layouts {
        let covers = |g: usize| g * items * n_reads >= d;
        if group > 1024 || !covers(group) || (group > 32 && covers(group / 2)) {
            continue;
        }
        // A ring of stages for every dtype (f32 rows hold 16-byte vectors as 16-bit rows do);
        // for the VJP also resident rows, which keep only the partial sums in registers, and
        // for 16-bit VJP rows packed ones.
        let mut variants = vec![(0, Hold::Floats), (2, Hold::Floats)];
        if pass == Pass::Vjp {
            variants.push((2, Hold::Stage));
            if dtype.size() == 2 {
                variants.push((2, Hold::Packed));
            }
        }
        for (stages, hold) in variants {
            // Past 512 threads a VJP row is resident or keeps SHARED_SUMS (no ring).
            let wide_ok =
                pass == Pass::Vjp && (hold == Hold::Stage || (stages == 0 && n_reads <= 4));
            let spec = spec_with(pass, kind, dtype, n_reads, group, items, stages, hold);
            if group > max_group(pass) && !wide_ok || ring_bytes(&spec) > MAX_SHARED {
                continue;
            }
            out.push(spec);
        }
    }
    out
}

/// Dynamic shared memory the ops give a launch of `spec` on rows of `d` elements: its ring of
/// row stages and staged weights, 0 for a kernel without a ring. (The VJP's one-row-a-block
/// kernel takes `2 * d` floats of partial sums instead when they fit.)
pub fn ring_shared_bytes(spec: &KernelSpec, d: usize) -> usize {
    launch_bytes(spec, d)
}

pub use super::launch::SplitGrid;

/// The grid the ops launch a split-row spec (`spec`, loaded as `kernel`) on, for `rows`
/// contiguous rows of `d` elements (each operand's rows `d` apart), with the dynamic shared memory
/// of `ring_shared_bytes`: for tools that launch a copy of the spec as the ops would
/// (examples/norm_timeline.rs). An error for a spec without clusters.
pub fn split_grid(
    kernel: &LoadedKernel,
    spec: &KernelSpec,
    rows: usize,
    d: usize,
) -> Result<SplitGrid> {
    if !is_split(spec) {
        return Err(bad("spec", format!("{spec} is not a split-row spec")));
    }
    let period = shift_period(spec, contiguous_rows(spec.dtype, d), &[d as i64]);
    let (block, shared) = (spec.block_dim as usize, launch_bytes(spec, d));
    cluster_grid(kernel, spec, block, shared, rows, period)
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

/// How `d`-element rows of `dtype` laid out one after another start: each on a granule where
/// the rows hold whole vectors, else alike (every operand's row as far into its granule).
pub fn contiguous_rows(dtype: DType, d: usize) -> Rows {
    if d % dtype.vec_width() == 0 {
        Rows::Aligned
    } else {
        Rows::Alike
    }
}

/// Every split-row spec (a cluster of blocks a row) that could serve contiguous rows of `d`
/// (`contiguous_rows`): each vector width the family
/// takes there, a power of two of vectors a thread or the fewest of `split_items` that cover a
/// block's chunk, each cluster width that covers the row up to twice the fewest, and for the VJP
/// the partial sums in registers or shared memory, and each way of overlapping rows (PIPELINE 0,
/// 1 or 2). Each passes the same check as a caller's spec. For `--sweep --split` to measure the
/// choices of `split_layouts`, `vjp_split_layouts` and `vjp_split_pipeline`.
pub fn split_candidates(pass: Pass, kind: Kind, dtype: DType, d: usize) -> Vec<KernelSpec> {
    let rows = contiguous_rows(dtype, d);
    let rms = (kind == Kind::RmsNorm) as i32;
    let (family, block) = match pass {
        // Every layout of a dtype is of the same kernel.
        Pass::Forward => (split_layouts(kind, dtype)[0].0, SPLIT_BLOCK),
        Pass::Vjp => (&VJP_SPLIT, VJP_SPLIT_BLOCK),
    };
    let mut specs = Vec::new();
    for n_reads in split_widths(dtype, rows).filter(|&n| split_takes(family, dtype, rows, n)) {
        let pad = split_pad(n_reads, rows);
        // The constants after ITEMS and CLUSTER: the VJP's SMEM_SUMS and PIPELINE, the staged
        // forward's SHIFTED and PAIRED (check_chosen refuses PAIRED where it cannot apply).
        let tails: Vec<Vec<i32>> = match pass {
            Pass::Vjp => (0..2)
                .flat_map(|smem_sums| (0..3).map(move |pipeline| vec![smem_sums, pipeline]))
                .collect(),
            Pass::Forward if *family == FORWARD_STAGED => (0..2)
                .map(|paired| vec![(pad > 0) as i32, paired])
                .collect(),
            Pass::Forward => vec![vec![]],
        };
        let layouts = VJP_SPLIT_CLUSTERS.iter().flat_map(|&cluster| {
            let fewest = split_items((split_chunk(d, cluster) + pad).div_ceil(block * n_reads));
            let powers = [1, 2, 4, 8].into_iter().filter(move |&i| i != fewest);
            std::iter::once(fewest)
                .chain(powers)
                .map(move |items| (items, cluster))
        });
        for (items, cluster) in layouts {
            let base = [rms, items as i32, cluster as i32];
            for tail in &tails {
                let consts: Vec<i32> = base.iter().chain(tail).copied().collect();
                let (block, n_reads) = (block as u16, n_reads as u8);
                specs.push(KernelSpec::new(family, dtype, block, n_reads, &consts));
            }
        }
    }
    let legal: Vec<KernelSpec> = specs
        .into_iter()
        .filter(|&spec| check_chosen(spec, pass, kind, dtype, d, rows).is_ok())
        .collect();
    let fewest = legal
        .iter()
        .map(|spec| constant(spec, "CLUSTER"))
        .min()
        .unwrap_or(0);
    legal
        .into_iter()
        .filter(|spec| constant(spec, "CLUSTER") <= 2 * fewest)
        .collect()
}
