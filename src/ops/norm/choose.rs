//! Which spec runs rows of d elements: threads per row, registers or a ring of stages, shared
//! sums, clusters; and the checks on a spec a caller chose.

use super::*;

pub(super) const MIN_BLOCK: usize = 256;
pub(super) const GROUPS: [usize; 6] = [32, 64, 128, 256, 512, 1024];
/// Threads per row, at most: 1024 forward; 512 for the VJP, whose x and g rows need more than
/// the 64 registers a 1024-thread block leaves each thread.
pub(super) fn max_group(pass: Pass) -> usize {
    match pass {
        Pass::Forward => 1024,
        Pass::Vjp => 512,
    }
}

/// The most vectors a thread holds in registers: 16 floats of x forward (more costs occupancy:
/// measured), 16 each of x and the cotangent in the VJP, whose partial sums of dweight and dbias
/// take as many registers again.
pub(super) fn max_items(_pass: Pass, n_reads: usize) -> usize {
    (16 / n_reads).clamp(1, 4)
}

/// Vectors per thread the choice starts from, from the `--sweep` of benches/norm.rs on an H100:
/// fewer threads per row with more items wins (fewer barriers, more rows per block), except for
/// 16-bit VJPs, whose x, g and four partial sums per element press on registers: they start at
/// one item and take more only once a row would need more than 256 threads.
pub(super) fn preferred_items(pass: Pass, dtype: DType, n_reads: usize, vectors: usize) -> usize {
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
pub(super) fn one_warp_rows(pass: Pass, dtype: DType, n_reads: usize, vectors: usize) -> bool {
    pass == Pass::Forward && dtype.size() == 2 && n_reads > 1 && vectors <= 4 * 32
}

/// Threads and vectors a thread for vectorised 16-bit forward rows of more than one warp's
/// (held in registers, with a ring of stages): of a power of two of threads with two or three
/// vectors each, the layout that holds the fewest vectors (two on a tie), so that fewer threads
/// idle past the row. On an H200 (bf16 LayerNorm, `--sweep --long`, direct mode) against two
/// vectors on twice the threads: 3,000 elements on 128 x 3 at 3,444 GB/s against 3,291 on
/// 256 x 2; 5,120 on 256 x 3 at 3,493 against 3,190 on 512 x 2; 12,288 on 512 x 3 at 3,245
/// against 3,218 on 1,024 x 2. RMSNorm was not swept: with this rule it ran 1.05-1.07x at 5,120
/// and 12,288 but 0.98-0.99x at 3,000 (`notes/norm-bench-forward-layouts.txt`).
pub(super) fn forward_ring_layout(vectors: usize) -> (usize, usize) {
    [2, 3]
        .into_iter()
        .map(|items| {
            let group = vectors.div_ceil(items).next_power_of_two();
            (group.clamp(32, max_group(Pass::Forward)), items)
        })
        .min_by_key(|&(group, items)| group * items)
        .expect("two layouts")
}

/// Threads, in whole pairs of warps, that cover `vectors` at `items` vectors a thread: the
/// fewest, where a power of two of threads could leave almost half of them idle past the row.
fn fewest_pairs_of_warps(vectors: usize, items: usize) -> usize {
    vectors.div_ceil(items).next_multiple_of(64)
}

/// Threads and vectors a thread for vectorised f32 forward rows of more than one warp's four
/// vectors each (1,025 to 16,384 elements, held in registers without a ring): four vectors a
/// thread on the fewest pairs of warps, as the VJP's held rows take, not a power of two of
/// threads, so that few lanes idle past the row. On an H200 (`--sweep --long`, direct mode),
/// LayerNorm / RMSNorm: 12,288 elements on 768 x 4 at 3,839 / 3,892 GB/s against 3,015 / 3,340
/// on 1,024 x 4; 10,240 on 640 x 4 at 3,864 / 3,898 against 2,787 / 3,048; 8,192 on 512 x 4
/// either way.
pub(super) fn register_forward_layout(
    pass: Pass,
    dtype: DType,
    n_reads: usize,
    vectors: usize,
) -> Option<(usize, usize)> {
    let items = max_items(pass, n_reads);
    if pass != Pass::Forward
        || n_reads == 1
        || stages(dtype, n_reads, 1) > 0
        || vectors <= 64 * items
    {
        return None;
    }
    let group = fewest_pairs_of_warps(vectors, items);
    (group <= max_group(pass)).then(|| (group, vectors.div_ceil(group)))
}

/// Whether a row takes one vector per thread on as many whole warps as it needs (96 threads
/// for 768 elements, not 128): vectorised 16-bit VJP rows of up to 256 vectors, whose cost
/// is the instructions each row's threads issue, idle lanes included.
pub(super) fn one_vector_rows(pass: Pass, dtype: DType, n_reads: usize, vectors: usize) -> bool {
    pass == Pass::Vjp && dtype.size() == 2 && n_reads > 1 && vectors <= 256
}

/// Threads, vectors a thread and hold (RESIDENT) of vectorised VJP rows that one group of up
/// to 512 threads holds, past 256 vectors (16-bit rows of 2,049 to 16,384 elements, f32 rows of
/// 1,025 to 8,192), on a ring of `HELD_STAGES`: the fewest pairs of warps, not a power of two of
/// threads, so that few lanes idle past the row (pairs, not single warps, halve the kernels
/// `kiln warm` compiles). 16-bit rows take 2, 3 or 4 vectors a thread, whichever holds the
/// fewest vectors (the fewer on a tie), packed at 3 and resident at 4 (LayerNorm's x,
/// cotangent, weights and two partial sums widened to floats spill past 2; packed, they spill
/// at 512 x 4, ptxas for sm_90); f32 rows take 4 vectors a thread. On an H200
/// (`--sweep --long --rms`, direct mode):
/// - pairs of warps against powers of two: bf16 5,120 elements on 320 x 2 at 2,900 / 3,517
///   GB/s (LayerNorm / RMSNorm) against 2,465 / 2,904 on 512 x 2; f32 5,120 on 320 x 4 at
///   2,970 / 3,302 against 2,768 / 3,107 on 512 x 4 (both without a ring);
/// - packed against resident rows (the stage read on every pass), LayerNorm / RMSNorm: f16
///   4,608 on 192 x 3 3,185 / 3,441 against 3,015 / 3,345, bf16 3,249 / 3,476 against 3,052 /
///   3,359; 12,288 on 512 x 3 f16 3,032 / 3,395 against 2,928 / 3,413, bf16 3,061 / 3,418
///   against 2,948 / 3,403 (9,216 and 4,352 alike). Floats on the ring were faster for f16
///   on up to 384 threads but far slower for bf16 LayerNorm (2,810 at 4,608) and on 512
///   threads (2,133). Packed rows of 2 vectors won at 5,120 (320 x 2) but lost at 3,000 and
///   7,168: floats stay there; packed rows of 4 spill;
/// - the ring for f32, against the same layout without: 4,608 on 320 x 4 3,775 / 3,858
///   against 2,791 / 3,200; 5,120 3,840 / 3,932 against 3,007 / 3,350; 6,144 on 384 x 4
///   3,683 / 3,852 against 3,264 / 3,472; 7,168 on 448 x 4 3,763 / 3,817 against 3,443 /
///   3,644; 0.95-1.06x at 1,536, 2,048, 3,000, 4,000 and 8,192 (the bench reads 86-93% of
///   copy with the ring from 1,536 to 8,192).
pub(super) fn held_vjp_layout(
    pass: Pass,
    dtype: DType,
    n_reads: usize,
    vectors: usize,
) -> Option<(usize, usize, Hold)> {
    let max = max_group(Pass::Vjp);
    if pass != Pass::Vjp || n_reads == 1 || vectors <= 256 {
        return None;
    }
    let (group, items) = if dtype.size() == 2 {
        [2, 3, 4]
            .into_iter()
            .map(|items| (fewest_pairs_of_warps(vectors, items), items))
            .filter(|&(group, _)| group <= max)
            .min_by_key(|&(group, items)| (group * items, items))?
    } else {
        let items = max_items(pass, n_reads);
        let group = fewest_pairs_of_warps(vectors, items);
        (group, vectors.div_ceil(group))
    };
    let hold = match (dtype.size(), items) {
        (2, 3) => Hold::Packed,
        (2, 4) => Hold::Stage,
        _ => Hold::Floats,
    };
    (group <= max).then_some((group, items, hold))
}

/// Stages of the ring of rows `held_vjp_layout` lays out (one row ahead, as `stages`).
pub(super) const HELD_STAGES: usize = 2;

/// Where a VJP row on a ring of stages stays while the kernel's passes read it (the VJP's
/// RESIDENT constant).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Hold {
    /// Widened into floats in registers, once a row.
    Floats = 0,
    /// In its shared memory stage, read there on every pass (rows longer than registers hold).
    Stage = 1,
    /// In registers as loaded (16-bit words, half the registers of floats), widened anew on
    /// every pass.
    Packed = 2,
}

/// Threads per block: whole rows, at least MIN_BLOCK threads where rows are short.
pub(super) fn block_of(group: usize) -> usize {
    group * (MIN_BLOCK / group).max(1)
}

/// The spec for `group` threads per row with `items` vectors each (0: the looped path).
pub(super) fn spec_of(
    pass: Pass,
    kind: Kind,
    dtype: DType,
    n_reads: usize,
    group: usize,
    items: usize,
) -> KernelSpec {
    let stages = stages(dtype, n_reads, items);
    let hold = if resident(pass, dtype, n_reads, group, items) {
        Hold::Stage
    } else {
        Hold::Floats
    };
    spec_with(pass, kind, dtype, n_reads, group, items, stages, hold)
}

/// The spec of every choice spelt out (`spec_of` derives the ring and residency from the rules).
#[allow(clippy::too_many_arguments)]
pub(super) fn spec_with(
    pass: Pass,
    kind: Kind,
    dtype: DType,
    n_reads: usize,
    group: usize,
    items: usize,
    stages: usize,
    hold: Hold,
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
        consts.push(hold as i32);
    }
    KernelSpec::new(def, dtype, block as u16, n_reads as u8, &consts)
}

/// Threads per row of a VJP whose x and cotangent rows stay in their shared memory stages
/// (RESIDENT), and vectors per thread: rows longer than registers hold (16-bit rows of 8,192 to
/// 16,384 elements), with only the partial sums in registers. The stages of two rows of x and g
/// take 128 KiB of shared memory, the weights 32 KiB more. Measured on an H100
/// (notes/performance.md item 12): 512 threads of 4 vectors (118 registers) run 2-6% faster than
/// 1,024 of 2 (64 registers, twice the warps).
pub(super) const RESIDENT_GROUP: usize = 512;
pub(super) const RESIDENT_ITEMS: usize = 4;

/// Threads per row of a VJP whose rows are too long for 512 threads' registers and are not
/// resident (f32 rows of 8,193 to 16,384 elements, unaligned rows of up to 4,096): 1,024
/// threads hold x and g in registers and keep the weights and their partial sums in shared
/// memory (the kernel's SHARED_SUMS), so that the row is read once, all of it in flight at once.
pub(super) const SHARED_SUMS_GROUP: usize = 1024;

/// A norm spec's constant `name`, by name (the families share names, not positions); 0 where
/// the family has none (RESIDENT is the VJP's alone). `constants_are_declared` checks the names.
pub(super) fn constant(spec: &KernelSpec, name: &str) -> usize {
    spec.constant(name).map_or(0, |v| v.max(0) as usize)
}

/// Whether `spec` is for RMSNorm (else LayerNorm).
pub(super) fn is_rms(spec: &KernelSpec) -> bool {
    constant(spec, "RMS") != 0
}

/// Whether a register-path VJP spec keeps its weights and partial sums in shared memory.
pub(super) fn shared_sums(spec: &KernelSpec) -> bool {
    spec.template.name == VJP.name
        && constant(spec, "ITEMS") > 0
        && constant(spec, "RESIDENT") == 0
        && spec.block_dim as usize == SHARED_SUMS_GROUP
}

/// Whether a VJP spec reads x and the cotangent from their stages on every pass instead of
/// holding them in registers: staged rows of more vectors than the register path takes.
pub(super) fn resident(
    pass: Pass,
    dtype: DType,
    n_reads: usize,
    group: usize,
    items: usize,
) -> bool {
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
/// latency-bound (one-warp VJP rows of 256 elements: 1,778 -> 2,111 GB/s with the ring). Two
/// stages (one row ahead): three and four were no faster on an H100 and take more shared memory
/// (notes/performance.md). f32 rows take none here, as they run near copy speed, except the
/// VJP's rows that one group holds (`held_vjp_layout`).
pub(super) fn stages(dtype: DType, n_reads: usize, items: usize) -> usize {
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
pub(super) fn ring_bytes(spec: &KernelSpec) -> usize {
    if is_vjp_split(spec) {
        // The ring (chunks of x and the cotangent), then each thread's weights as floats, and
        // with SMEM_SUMS its partial sums of dw and db.
        let capacity = split_capacity(spec);
        let arrays = if constant(spec, "SMEM_SUMS") != 0 {
            3
        } else {
            1
        };
        return vjp_split_stages(spec.dtype, capacity) * 2 * chunk_bytes(spec.dtype, capacity)
            + arrays * capacity * 4;
    }
    if *spec.template == FORWARD_STAGED {
        // The ring of row chunks, then each thread's weight and bias (RMSNorm: weight) as T.
        let capacity = split_capacity(spec);
        let params = if is_rms(spec) { 1 } else { 2 };
        return SPLIT_STAGES * chunk_bytes(spec.dtype, capacity)
            + params * capacity * spec.dtype.size();
    }
    if is_split(spec) {
        // Each thread's weight and bias as floats.
        let floats = split_capacity(spec);
        return 2 * floats * 4;
    }
    let vjp = spec.template.name == VJP.name;
    let arrays = if vjp { 2 } else { 1 };
    let (rms, group) = (is_rms(spec), constant(spec, "GROUP"));
    let (items, stages) = (constant(spec, "ITEMS"), constant(spec, "STAGES"));
    let vectors = items * spec.block_dim as usize;
    let floats = vectors * spec.n_reads as usize * 4;
    let extra = if vjp && constant(spec, "RESIDENT") == Hold::Stage as usize {
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
pub(super) fn resident_grid(
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
pub(super) fn balanced_grid(blocks: usize, slots: usize) -> usize {
    let turns = blocks.div_ceil(slots.max(1)).max(1);
    blocks.div_ceil(turns).max(1)
}

/// Dynamic shared memory a launch of `spec` on rows of `d` elements takes: `ring_bytes`, except
/// for the staged forward with PAIRED (`paired`), whose stages hold the chunk of a row each block
/// takes, not its capacity, and whose weights (and bias) only the vectors its stores read, so
/// that two blocks fit an SM (`ring_bytes` is the most any row takes, which `fits` checks).
pub(super) fn launch_bytes(spec: &KernelSpec, d: usize) -> usize {
    if *spec.template != FORWARD_STAGED || constant(spec, "PAIRED") == 0 {
        return ring_bytes(spec);
    }
    let chunk = split_chunk(d, constant(spec, "CLUSTER"));
    let n_reads = spec.n_reads as usize;
    // The vectors a block's stores read: its chunk, shifted by less than a vector
    // (norm_fwd_staged.cu's own_vectors).
    let vectors = (chunk / n_reads + 1).min(split_capacity(spec) / n_reads);
    let params = if is_rms(spec) { 1 } else { 2 };
    SPLIT_STAGES * chunk_bytes(spec.dtype, chunk) + params * vectors * n_reads * spec.dtype.size()
}

/// Whether a block of `spec` fits in `shared_limit` bytes of shared memory: its ring (or
/// shared sums) and 1 KiB for the kernel's static scratch.
pub(super) fn fits(spec: &KernelSpec, shared_limit: usize) -> bool {
    ring_bytes(spec) + 1024 <= shared_limit
}

/// Threads per block of the split-row forward.
pub(super) const SPLIT_BLOCK: usize = 512;
/// Stages of the 16-bit split forward's ring of row chunks (`STAGES` in norm_fwd_staged.cu).
pub(super) const SPLIT_STAGES: usize = 3;

/// Bytes a stage of a split kernel's ring gives one chunk of up to `capacity` elements: the
/// chunk and a 16-byte granule on either side, in whole 128 bytes (`kiln_chunk_bytes`).
pub(super) fn chunk_bytes(dtype: DType, capacity: usize) -> usize {
    (capacity * dtype.size() + 32).div_ceil(128) * 128
}

/// Elements of a row one block of a split spec holds: ITEMS vectors of N_READS per thread
/// (`CAPACITY` in the split templates).
pub(super) fn split_capacity(spec: &KernelSpec) -> usize {
    constant(spec, "ITEMS") * spec.block_dim as usize * spec.n_reads as usize
}

/// Elements of a row of `d` that each block of a cluster of `blocks` takes (`kiln_split_chunk`):
/// a multiple of 8, so that chunks of aligned rows start 16-byte aligned.
pub(super) fn split_chunk(d: usize, blocks: usize) -> usize {
    d.div_ceil(blocks).next_multiple_of(8)
}
/// The split-row forward's layouts in order of preference: (kernel, most blocks per cluster,
/// most elements per thread). f32 rows (registers, norm_fwd_split.cu): up to 8 elements (x and
/// the next row's x in 16 registers), two blocks share each SM; longer rows take up to 16
/// elements. 16-bit rows (the staged ring, norm_fwd_staged.cu), in clusters of up to 8 blocks
/// (with Hopper's non-portable 16, compute-sanitizer's synccheck reported "missing init" on the
/// exchange's mbarrier, not understood yet):
/// - RMSNorm: 16 elements, 16 KiB chunks, each worth its exchange, then 32 (32 KiB chunks, one
///   block an SM: 79-81% of copy at 131,072 on an H100, where the register kernel in clusters of
///   16 ran at 47-60%). On an H200, 32 elements in fewer blocks ran at 0.99-1.00x of 16.
/// - LayerNorm: 32 elements, the fewest blocks a row. Its exchange waits on the whole cluster
///   once a row and combines every warp's moments, so fewer, larger blocks pay: on an H200, bf16
///   (`--sweep --split`) 1.04x at 18,432 (clusters of 2 against 3), 1.16x at 30,000 (2 against
///   4), 1.13x at 65,536 (4 against 8).
pub(super) fn split_layouts(kind: Kind, dtype: DType) -> &'static [SplitLayout] {
    static SIXTEEN_BIT: [SplitLayout; 2] = [(&FORWARD_STAGED, 8, 16), (&FORWARD_STAGED, 8, 32)];
    static SIXTEEN_BIT_LAYER: [SplitLayout; 1] = [(&FORWARD_STAGED, 8, 32)];
    static F32: [SplitLayout; 2] = [(&FORWARD_SPLIT, 8, 8), (&FORWARD_SPLIT, 16, 16)];
    match (dtype.size(), kind) {
        (2, Kind::LayerNorm) => &SIXTEEN_BIT_LAYER,
        (2, Kind::RmsNorm) => &SIXTEEN_BIT,
        _ => &F32,
    }
}
/// Whether the staged forward takes two blocks an SM (PAIRED in norm_fwd_staged.cu: 64 registers
/// a thread, stages sized by the chunk) for a row's `chunk` of elements in blocks of `elements`
/// a thread and `capacity` elements: blocks of 24 elements with `shifted` columns whose chunk is
/// at most three quarters of the capacity (16-bit LayerNorm rows of odd length up to 18,432, in
/// clusters of two). Blocks of up to 16 elements hold two an SM anyway; of 32, their chunks do
/// not fit twice; unshifted blocks of 24 spill in 64 registers. Measured on an H100 with every
/// staged spec paired against none (f16 and bf16 LayerNorm, about 2^25 elements, direct mode):
/// 1.13-1.15x at 16,385 (68% -> 77-78% of copy), 1.06-1.07x at 17,001, 1.03-1.04x at 18,001,
/// 0.99-1.00x at 19,001 (a chunk of 9,504 of 12,288), 0.94-0.97x from 20,001 to 23,001, where
/// the registers cost and the chunks leave no room for a second block.
pub(super) fn paired(shifted: bool, elements: usize, chunk: usize, capacity: usize) -> bool {
    shifted && elements == 24 && 4 * chunk <= 3 * capacity
}

/// A split-row forward layout: (kernel, most blocks per cluster, most elements per thread).
pub(super) type SplitLayout = (&'static TemplateDef, usize, usize);
/// The longest rows a split-row forward takes: 16 blocks of 16 elements a thread (f32), or 8 of
/// 32 (16-bit).
pub(super) const SPLIT_ROW: usize = SPLIT_BLOCK * 16 * 16;

/// Whether a split family may shift its columns onto the granules (bulk.cuh; the constant
/// SHIFTED), so that rows which do not start on a 16-byte granule still take 16-byte vectors:
/// the 16-bit forward's staged ring. Measured on an H200 against one element a vector (bf16 and
/// f16, 2047 x 16,385 and 667 x 50,257): the forward 1.02-1.33x. The split VJP gained nothing
/// from it where its grid stayed whole (8178 x 4,103: 0.94-0.99x) and lost where rows laid out
/// alike leave clusters idle (clusters of 7 on 50,257: a grid of 8 clusters, not 15, 0.5x).
pub(super) fn shifts_columns(family: &TemplateDef) -> bool {
    *family == FORWARD_STAGED
}

/// The vector widths split kernels try on `rows`, in order of preference. Shifted columns cover
/// a vector more than the chunk, so the longest unaligned rows a layout holds fall back to single
/// elements.
pub(super) fn split_widths(dtype: DType, rows: Rows) -> impl Iterator<Item = usize> {
    [dtype.vec_width(), 1]
        .into_iter()
        .filter(move |&n_reads| match rows {
            Rows::Aligned => n_reads > 1,
            Rows::Alike => true,
            Rows::Scattered => n_reads == 1,
        })
}

/// Whether `family` takes vectors of `n_reads` on `rows`.
pub(super) fn split_takes(family: &TemplateDef, dtype: DType, rows: Rows, n_reads: usize) -> bool {
    n_reads == 1
        || (n_reads == dtype.vec_width()
            && (rows == Rows::Aligned || (rows == Rows::Alike && shifts_columns(family))))
}

/// Elements a split block's vectors must cover beyond its chunk: shifted columns start up to a
/// vector less one element before it.
pub(super) fn split_pad(n_reads: usize, rows: Rows) -> usize {
    if rows == Rows::Aligned || n_reads == 1 {
        0
    } else {
        n_reads - 1
    }
}

/// Vectors a split-row thread holds to cover `needed`: the next power of two, or three quarters
/// of it where that covers `needed` (1, 2, 3, 4, 6, 8, 12, 16, ...), so that at most a quarter
/// of a thread's lanes idle past its block's chunk, where a power of two alone left up to half,
/// and `kiln warm` compiles two counts for each power of two instead of every count.
pub(super) fn split_items(needed: usize) -> usize {
    let power = needed.max(1).next_power_of_two();
    if power >= 4 && 3 * power / 4 >= needed {
        3 * power / 4
    } else {
        power
    }
}

/// A split-row layout for rows of `d` elements, blocks of `block` threads of `n_reads`-element
/// vectors: (blocks per cluster, vectors per thread), the fewest blocks of `VJP_SPLIT_CLUSTERS`
/// from `least` up to `most` whose threads, each holding `elements` elements at most, cover a
/// block's chunk and `pad` elements more, and the fewest vectors a thread of `split_items` that
/// do (16-bit LayerNorm rows of 18,432 forward on two blocks of 9,216 elements: 512 x 3
/// vectors, not 4; unaligned 16,385 VJP rows on two blocks of 8,200: 24 elements a thread, not
/// 32).
fn fit_cluster(
    block: usize,
    (least, most): (usize, usize),
    elements: usize,
    n_reads: usize,
    d: usize,
    pad: usize,
) -> Option<(usize, usize)> {
    let per_block = block * (elements / n_reads).max(1) * n_reads;
    let cluster = *VJP_SPLIT_CLUSTERS
        .iter()
        .find(|&&c| (least..=most).contains(&c) && split_chunk(d, c) + pad <= per_block)?;
    let items = split_items((split_chunk(d, cluster) + pad).div_ceil(block * n_reads));
    (items * n_reads <= elements).then_some((cluster, items))
}

/// The split-row forward for rows of `d` elements, if a cluster's registers hold them: the
/// first layout that does, with the fewest blocks per cluster (of `VJP_SPLIT_CLUSTERS`, up to
/// the layout's) whose threads, each holding the fewest vectors of `split_items`, cover the row.
pub(super) fn split_spec(kind: Kind, dtype: DType, d: usize, rows: Rows) -> Option<KernelSpec> {
    split_widths(dtype, rows)
        .flat_map(|n_reads| {
            split_layouts(kind, dtype)
                .iter()
                .filter(move |(family, ..)| split_takes(family, dtype, rows, n_reads))
                .map(move |&(family, most, elements)| (family, most, elements, n_reads))
        })
        .find_map(|(family, most, elements, n_reads)| {
            let pad = split_pad(n_reads, rows);
            let (cluster, items) = fit_cluster(SPLIT_BLOCK, (2, most), elements, n_reads, d, pad)?;
            let mut consts = vec![(kind == Kind::RmsNorm) as i32, items as i32, cluster as i32];
            if *family == FORWARD_STAGED {
                let capacity = SPLIT_BLOCK * items * n_reads;
                let chunk = split_chunk(d, cluster);
                let paired = paired(pad > 0, items * n_reads, chunk, capacity);
                consts.extend([(pad > 0) as i32, paired as i32]);
            }
            Some(KernelSpec::new(
                family,
                dtype,
                SPLIT_BLOCK as u16,
                n_reads as u8,
                &consts,
            ))
        })
}

/// Threads per block of the split-row VJP.
pub(super) const VJP_SPLIT_BLOCK: usize = 512;
/// Blocks per cluster of the split-row VJP: the fewest of these whose registers hold the row
/// (2 to the portable 8, then Hopper's non-portable 16). Blocks beyond the row's length would
/// only wait on its exchanges, and every block spared lets another row be in flight.
pub(super) const VJP_SPLIT_CLUSTERS: [usize; 8] = [2, 3, 4, 5, 6, 7, 8, 16];

/// Stages of the split VJP's ring for chunks of `capacity` elements (`STAGES` in
/// norm_vjp_split.cu): three up to 16 KiB a chunk, else two (three would not fit beside the
/// weights).
pub(super) fn vjp_split_stages(dtype: DType, capacity: usize) -> usize {
    if capacity * dtype.size() <= 16 * 1024 {
        3
    } else {
        2
    }
}

/// A split-row VJP layout: the fewest and most blocks per cluster, the most elements a thread
/// holds, and whether its partial sums are kept in shared memory.
#[derive(Clone, Copy, Debug)]
pub(super) struct VjpSplitLayout {
    pub least: usize,
    pub most: usize,
    pub elements: usize,
    pub smem_sums: bool,
}

const fn vjp_layout(least: usize, most: usize, elements: usize) -> VjpSplitLayout {
    VjpSplitLayout {
        least,
        most,
        elements,
        smem_sums: false,
    }
}

/// The split-row VJP's layouts for rows of `n_reads`-element vectors, in order of preference.
/// Rows arrive through the ring of shared-memory stages, so registers hold only the current row,
/// and a row's time is bound by the latency of its exchange more than by its bytes:
/// - 16-bit rows of whole vectors: 16 elements a thread in 2 to 8 blocks (16 KiB chunks; 8 KiB
///   ones ran at 44-45% of copy for LayerNorm at 16,385-30,000 elements against 50-68%, when it
///   took two exchanges a row), then 24 in clusters of 8 (to 98,304 elements), then Hopper's
///   non-portable clusters of 16. H100, bf16, about 2^25 elements: 8 blocks of 24 against 16 of
///   16 read 1.36-1.80x for LayerNorm and 1.18-1.36x for RMSNorm from 70,000 to 98,304, and 8
///   blocks beat the fewest (6 or 7) at 80,000 (1.05-1.06x) and for RMSNorm at 70,000 (1.10x).
/// - 16-bit rows of one element a vector, at least a row for each SM (`Count::Many`): 24
///   elements a thread in 2 to 8 blocks, then clusters of 16: H100, bf16 and f16, 1.18-1.20x
///   the 16-element layout for LayerNorm and 1.02-1.07x for RMSNorm at 16,385 (2 blocks against
///   3) and 50,257 (5 against 7). Fewer rows keep 16 elements in more blocks: 16 rows of the
///   same lengths ran 0.64-0.93x on the fewer blocks.
/// - f32 rows: 16 elements a thread in 2 to 8 blocks, then 16.
///
/// None keeps its partial sums in shared memory now (SMEM_SUMS, which let two
/// register-prefetching blocks share an SM, is still built and accepted).
pub(super) fn vjp_split_layouts(
    dtype: DType,
    n_reads: usize,
    count: Count,
) -> &'static [VjpSplitLayout] {
    static WHOLE_VECTORS: [VjpSplitLayout; 3] = [
        vjp_layout(2, 8, 16),
        vjp_layout(8, 8, 24),
        vjp_layout(16, 16, 16),
    ];
    static ONE_ELEMENT: [VjpSplitLayout; 2] = [vjp_layout(2, 8, 24), vjp_layout(16, 16, 16)];
    static SIXTEEN: [VjpSplitLayout; 2] = [vjp_layout(2, 8, 16), vjp_layout(16, 16, 16)];
    match (dtype.size(), n_reads, count) {
        (2, 1, Count::Many) => &ONE_ELEMENT,
        (2, 1, Count::Few) => &SIXTEEN,
        (2, _, _) => &WHOLE_VECTORS,
        _ => &SIXTEEN,
    }
}

/// Every layout `vjp_split_layouts` gives `dtype` on rows of `n_reads`-element vectors, for any
/// count of rows.
fn all_vjp_split_layouts(dtype: DType, n_reads: usize) -> impl Iterator<Item = VjpSplitLayout> {
    [Count::Few, Count::Many]
        .into_iter()
        .flat_map(move |count| vjp_split_layouts(dtype, n_reads, count).iter().copied())
}

/// The most elements a split-row VJP thread of `dtype` holds per row (of each of x, the
/// cotangent, and the partial sums of dweight and dbias) on rows of `n_reads`-element vectors.
pub(super) fn vjp_split_elements(dtype: DType, n_reads: usize) -> usize {
    let layouts = all_vjp_split_layouts(dtype, n_reads);
    layouts.map(|l| l.elements).max().unwrap_or(0)
}

/// The longest rows of `dtype` in `n_reads`-element vectors a split-row VJP cluster's registers
/// hold.
pub(super) fn vjp_split_row(dtype: DType, n_reads: usize) -> usize {
    let layouts = all_vjp_split_layouts(dtype, n_reads);
    VJP_SPLIT_BLOCK * layouts.map(|l| l.most * l.elements).max().unwrap_or(0)
}

/// How the split-row VJP overlaps each row's exchange with the next row's (PIPELINE in
/// norm_vjp_split.cu): 0 not at all; 1 with the next row's sums read from its stage (a second
/// read of each staged chunk); 2 with both rows held in registers as loaded. `elements`: a
/// thread's elements of a row.
/// - 2: 16-bit rows of whole vectors, 16 elements a thread. H200, direct mode, same call as the
///   tree before it, two rounds: LayerNorm 1.05-1.08x, RMSNorm 1.03-1.18x at 18,432, 30,000
///   and 65,536 elements (clusters of 3, 4 and 8; bf16 RMSNorm at 65,536 67% -> 79% of copy).
///   In Hopper's non-portable clusters of 16 (rows past 65,536), H100, bf16 256 x 131,072:
///   LayerNorm 1,823 GB/s against 1,644 with 0 (55% -> 61% of copy), RMSNorm 2,409 against
///   2,364 with 1.
///   It lost on rows of one element a vector (16-bit rows of 16,385: 0.76-0.96x, whose held
///   rows take a register per element) and on f32 rows (0.86-0.99x: 128 registers). Threads
///   of 24 elements (two rows of 24 held: LayerNorm spills) ran best with 0 on 10 of 12
///   cluster widths and lengths swept (H100, bf16, 70,000 to 98,304 elements; LayerNorm
///   0.89-0.96x with 2; RMSNorm best with 1 on two, by 3-6%).
/// - 1: 16-bit RMSNorm rows of one element a vector in clusters of 16, whose exchanges are the
///   slowest (pipelined whole vectors ran 1.07-1.08x at 131,072 on an H200 before 2 was tried
///   there). LayerNorm, whose exchange from a stage takes two passes over it (the warp's mean,
///   then the sums about it), ran 2-8% slower with 1 at every width. f32 rows with 1:
///   0.93-1.09x with no rule by width or by how full the chunks are that separates the gains
///   from the losses (H200).
pub(super) fn vjp_split_pipeline(
    kind: Kind,
    dtype: DType,
    cluster: usize,
    n_reads: usize,
    elements: usize,
) -> i32 {
    match (dtype.size(), kind, cluster) {
        (2, _, _) if n_reads > 1 && elements <= 16 => 2,
        (2, Kind::RmsNorm, 16) => 1,
        _ => 0,
    }
}

/// The split-row VJP for `count` rows of `d` elements, if a cluster's registers hold them: the
/// first layout of `vjp_split_layouts` that does, with the fewest blocks per cluster (within the
/// layout's) whose threads, each holding the fewest vectors of `split_items` within the layout's
/// elements, cover the row.
pub(super) fn vjp_split_spec(
    kind: Kind,
    dtype: DType,
    d: usize,
    rows: Rows,
    count: Count,
) -> Option<KernelSpec> {
    split_widths(dtype, rows)
        .filter(|&n_reads| split_takes(&VJP_SPLIT, dtype, rows, n_reads))
        .flat_map(|n_reads| {
            let layouts = vjp_split_layouts(dtype, n_reads, count).iter();
            layouts.map(move |&layout| (layout, n_reads))
        })
        .find_map(|(layout, n_reads)| {
            let pad = split_pad(n_reads, rows);
            let clusters = (layout.least, layout.most);
            let (cluster, items) =
                fit_cluster(VJP_SPLIT_BLOCK, clusters, layout.elements, n_reads, d, pad)?;
            let pipeline = vjp_split_pipeline(kind, dtype, cluster, n_reads, items * n_reads);
            let consts = [
                (kind == Kind::RmsNorm) as i32,
                items as i32,
                cluster as i32,
                layout.smem_sums as i32,
                pipeline,
            ];
            Some(KernelSpec::new(
                &VJP_SPLIT,
                dtype,
                VJP_SPLIT_BLOCK as u16,
                n_reads as u8,
                &consts,
            ))
        })
}

/// Whether `spec` is a split-row spec (a cluster per row), forward or VJP.
pub(super) fn is_split(spec: &KernelSpec) -> bool {
    *spec.template == FORWARD_SPLIT || *spec.template == FORWARD_STAGED || is_vjp_split(spec)
}

/// Rows the staged forward's clusters take in a fixed order before they claim rows at run time
/// (`LEAD` in norm_fwd_staged.cu: its ring's stages and one more).
pub(super) const CLAIM_LEAD: usize = 4;

/// Whether a call of `rows` on `spec` with `slots` cluster slots claims its rows at run time
/// (norm_fwd_staged.cu's row_claims): the staged forward with unshifted columns, on more rows
/// than the clusters' fixed first turns take. Clusters that run at different speeds then finish
/// together. Measured on an H100 (bf16 and f16, about 2^25 elements, direct mode): RMSNorm
/// 1.08-1.14x from 40,960 to 131,072 (80% -> 86-88% of copy); LayerNorm, with its ring's copies
/// issued by the last warp after its push, 1.02-1.08x from 30,000 to 131,072 (82-85% -> 87-88%).
pub(super) fn claims_rows(spec: &KernelSpec, rows: usize, slots: usize) -> bool {
    *spec.template == FORWARD_STAGED && constant(spec, "SHIFTED") == 0 && rows > CLAIM_LEAD * slots
}

/// Whether `spec` is a split-row VJP spec.
pub(super) fn is_vjp_split(spec: &KernelSpec) -> bool {
    *spec.template == VJP_SPLIT
}

/// How a call's rows lie in their 16-byte granules, which decides the loads its kernels may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rows {
    /// Every row starts on a granule and holds whole vectors: 16-byte loads on every path.
    Aligned,
    /// Rows that do not (odd lengths), but start as far into their granules as the same row of
    /// every other operand does (the output's, the cotangent's): the 16-bit split forward (a
    /// cluster of blocks a row) shifts its columns onto the granules and still loads 16 bytes at
    /// a time; the other kernels take one element at a time.
    Alike,
    /// Anything else (views at odd offsets or strides): one element at a time.
    Scattered,
}

/// Whether a call has a row for every multiprocessor. 16-bit forward rows too long for one
/// block's registers then run a block a row where the ring fits (`long_ring_spec`); fewer rows
/// split each row over a cluster of blocks on Hopper, so that more of the GPU works.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Count {
    /// Fewer rows than the GPU has multiprocessors.
    Few,
    /// At least one row for each multiprocessor.
    Many,
}

impl Count {
    /// The count of `rows` rows on `device`.
    pub fn of(rows: usize, device: &crate::runtime::Device) -> Count {
        if rows >= device.info().multiprocessors as usize {
            Count::Many
        } else {
            Count::Few
        }
    }
}

/// Vectors a thread holds at most on the one-block ring for forward rows past `max_items`: 16-bit
/// rows of 16,385 to 32,768 elements, 3 or 4 vectors on 1,024 threads, where the ring and the
/// weights fit (LayerNorm to 24,576, RMSNorm to 32,768 on Hopper). Measured on an H200 against
/// the split forward on clusters of 2-4 (bf16, about 2^25 elements, direct mode): LayerNorm
/// 1.29x at 18,432, 1.18x at 20,480, 1.04x at 24,576; RMSNorm 1.01-1.06x.
pub(super) const LONG_RING_ITEMS: usize = 4;

/// The one-block ring for 16-bit forward rows of `vectors` past `max_items`, if its stages and
/// weights fit in `shared_limit` bytes.
pub(super) fn long_ring_spec(
    kind: Kind,
    dtype: DType,
    n_reads: usize,
    vectors: usize,
    shared_limit: usize,
) -> Option<KernelSpec> {
    let group = max_group(Pass::Forward);
    if stages(dtype, n_reads, 1) == 0 || vectors > group * LONG_RING_ITEMS {
        return None;
    }
    let spec = spec_of(
        Pass::Forward,
        kind,
        dtype,
        n_reads,
        group,
        vectors.div_ceil(group),
    );
    fits(&spec, shared_limit).then_some(spec)
}

/// The spec for `count` rows of `d` elements laid out as `rows`, on `gpu` (its blocks may use
/// `gpu.shared_limit` bytes of shared memory:
/// [`Device::shared_limit`](crate::runtime::Device::shared_limit)).
/// Where a ring of stages or resident rows would not fit, rows are held in registers without a
/// ring, or take the looped path (GPUs with 64-99 KiB: Turing, consumer Ampere and Ada).
pub fn choose_spec(
    pass: Pass,
    kind: Kind,
    dtype: DType,
    d: usize,
    rows: Rows,
    count: Count,
    gpu: Gpu,
) -> KernelSpec {
    let shared_limit = gpu.shared_limit;
    let n_reads = if rows == Rows::Aligned {
        dtype.vec_width()
    } else {
        1
    };
    let vectors = d.div_ceil(n_reads).max(1);
    let max = max_items(pass, n_reads);
    if let Some((group, items, hold)) = held_vjp_layout(pass, dtype, n_reads, vectors) {
        let spec = spec_with(pass, kind, dtype, n_reads, group, items, HELD_STAGES, hold);
        if fits(&spec, shared_limit) {
            return spec;
        }
        if hold == Hold::Floats && dtype.size() == 4 {
            // f32 rows fit in registers without the ring, where its stages do not fit.
            return spec_with(pass, kind, dtype, n_reads, group, items, 0, Hold::Floats);
        }
    }
    if vectors > max_group(pass) * max {
        // A block a row where rows are many (or clusters absent): no exchange between blocks.
        if pass == Pass::Forward && (count == Count::Many || !gpu.clusters) {
            if let Some(spec) = long_ring_spec(kind, dtype, n_reads, vectors, shared_limit) {
                return spec;
            }
        }
        if pass == Pass::Forward && gpu.clusters {
            if let Some(spec) = split_spec(kind, dtype, d, rows) {
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
            // Vectorised rows (f32 of 8,193 to 16,384 elements) take the fewest vectors a
            // thread: on an H200, f32 10,240 on 1,024 x 3 at 3,078 / 3,542 GB/s (LayerNorm /
            // RMSNorm) against 2,582 / 3,038 on 1,024 x 4.
            let items = vectors.div_ceil(SHARED_SUMS_GROUP);
            let items = if n_reads > 1 {
                items
            } else {
                items.next_power_of_two()
            };
            let spec = spec_of(pass, kind, dtype, n_reads, SHARED_SUMS_GROUP, items);
            if fits(&spec, shared_limit) {
                return spec;
            }
        }
        if pass == Pass::Vjp && gpu.clusters {
            if let Some(spec) = vjp_split_spec(kind, dtype, d, rows, count) {
                if fits(&spec, shared_limit) {
                    return spec;
                }
            }
        }
        return spec_of(pass, kind, dtype, n_reads, 1024, 0);
    }
    let (group, items) = if one_warp_rows(pass, dtype, n_reads, vectors) {
        (32, vectors.div_ceil(32))
    } else if pass == Pass::Forward && stages(dtype, n_reads, 1) > 0 {
        forward_ring_layout(vectors)
    } else if let Some(layout) = register_forward_layout(pass, dtype, n_reads, vectors) {
        layout
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
        spec_with(pass, kind, dtype, n_reads, group, items, 0, Hold::Floats)
    }
}

/// Every spec the norm ops can choose where blocks may use `shared_limit` bytes of shared
/// memory (their column sums are `ops::col_sums`'): `choose_spec` depends on d only through its
/// count of vectors and is the same past the longest rows held in registers, so every count up
/// to one past those gives every choice. That is about two million choices, so each (pass,
/// kind, dtype) runs on a thread of its own; the list comes out in the same order either way.
pub fn specs(gpu: Gpu) -> Vec<KernelSpec> {
    let mut combos = Vec::new();
    for pass in [Pass::Forward, Pass::Vjp] {
        for kind in [Kind::LayerNorm, Kind::RmsNorm] {
            for dtype in DType::ALL {
                combos.push((pass, kind, dtype));
            }
        }
    }
    let chosen: Vec<Vec<KernelSpec>> = std::thread::scope(|scope| {
        let workers: Vec<_> = combos
            .iter()
            .map(|&(pass, kind, dtype)| scope.spawn(move || choices(pass, kind, dtype, gpu)))
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let mut seen = std::collections::HashSet::new();
    chosen
        .into_iter()
        .flatten()
        .filter(|spec| seen.insert(*spec))
        .collect()
}

/// The specs `choose_spec` picks for one (pass, kind, dtype) over every row length that can
/// differ, in order of first choice, each once.
fn choices(pass: Pass, kind: Kind, dtype: DType, gpu: Gpu) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for rows in [Rows::Scattered, Rows::Alike, Rows::Aligned] {
        let n_reads = if rows == Rows::Aligned {
            dtype.vec_width()
        } else {
            1
        };
        let mut longest = (max_group(pass) * max_items(pass, n_reads))
            .max(RESIDENT_GROUP * RESIDENT_ITEMS)
            .max(SHARED_SUMS_GROUP * max_items(pass, n_reads));
        if pass == Pass::Forward {
            longest = longest.max(max_group(pass) * LONG_RING_ITEMS);
        }
        if pass == Pass::Forward && gpu.clusters {
            longest = longest.max(SPLIT_ROW / n_reads);
        }
        if pass == Pass::Vjp && gpu.clusters {
            longest = longest.max(vjp_split_row(dtype, n_reads) / n_reads);
        }
        // The forward's choice, and the split VJP's on rows of one element a vector, depend on
        // the count of rows.
        for count in [Count::Many, Count::Few] {
            let mut last = None;
            for vectors in 1..=longest + 1 {
                let spec = choose_spec(pass, kind, dtype, vectors * n_reads, rows, count, gpu);
                // Neighbouring lengths mostly choose alike: hash only a change.
                if last != Some(spec) && seen.insert(spec) {
                    out.push(spec);
                }
                last = Some(spec);
            }
        }
    }
    out
}

/// Checks a caller-chosen spec: the right family, kind and dtype, a legal vector width, enough
/// registers for the row and a ring only where it can run (a wrong one would compute garbage or
/// fault on misaligned loads). Structural, not a lookup: it runs on every tuned call.
pub(super) fn check_chosen(
    spec: KernelSpec,
    pass: Pass,
    kind: Kind,
    dtype: DType,
    d: usize,
    rows: Rows,
) -> Result<KernelSpec> {
    let family = match pass {
        Pass::Forward => &FORWARD,
        Pass::Vjp => &VJP,
    };
    let n_reads = spec.n_reads as usize;
    let legal_width = n_reads == 1 || (rows == Rows::Aligned && n_reads == dtype.vec_width());
    if legal_width && spec == super::stand_in::spec(pass, kind, dtype, n_reads) {
        return Ok(spec);
    }
    // A split family that shifts its columns takes vectors on alike rows too, covering a vector
    // more than its chunk there.
    let (legal_width, pad) = if split_takes(spec.template, dtype, rows, n_reads) {
        (true, split_pad(n_reads, rows))
    } else {
        (legal_width, 0)
    };
    if is_vjp_split(&spec) {
        // Vectors a thread of `split_items`, within its registers, that cover the row.
        let (items, cluster) = (constant(&spec, "ITEMS"), constant(&spec, "CLUSTER"));
        let ok = pass == Pass::Vjp
            && spec.dtype == dtype
            && legal_width
            && split_items(items) == items
            && items * n_reads <= vjp_split_elements(dtype, n_reads)
            && VJP_SPLIT_CLUSTERS.contains(&cluster)
            && spec.block_dim as usize == VJP_SPLIT_BLOCK
            && split_chunk(d, cluster) + pad <= split_capacity(&spec)
            && constant(&spec, "RMS") == (kind == Kind::RmsNorm) as usize
            && match constant(&spec, "SMEM_SUMS") {
                0 => true,
                1 => items * n_reads <= 8,
                _ => false,
            }
            && spec
                .constant("PIPELINE")
                .is_some_and(|p| (0..=2).contains(&p));
        if !ok {
            return Err(bad(
                "spec",
                format!("{spec} cannot run {pass:?} {kind:?} {dtype} rows of {d}"),
            ));
        }
        return Ok(spec);
    }
    if is_split(&spec) {
        // Vectors a thread of `split_items` that, over the cluster, cover the row, within one of
        // the dtype's layouts.
        let (items, cluster) = (constant(&spec, "ITEMS"), constant(&spec, "CLUSTER"));
        let in_layout = split_layouts(kind, dtype)
            .iter()
            .any(|&(family, most, elements)| {
                *spec.template == *family && cluster <= most && items * n_reads <= elements
            });
        let ok = pass == Pass::Forward
            && spec.dtype == dtype
            && legal_width
            && split_items(items) == items
            && in_layout
            && VJP_SPLIT_CLUSTERS.contains(&cluster)
            && spec.block_dim as usize == SPLIT_BLOCK
            && split_chunk(d, cluster) + pad <= split_capacity(&spec)
            // Shifted columns exactly where the rows need them, and on blocks that each hold
            // part of the row (their masks take a chunk of at least one element).
            && (*spec.template != FORWARD_STAGED
                || spec.constant("SHIFTED") == Some((pad > 0) as i32)
                    && match constant(&spec, "PAIRED") {
                        0 => true,
                        1 => items * n_reads > 16 && items * n_reads <= 24,
                        _ => false,
                    })
            && (pad == 0 || (cluster - 1) * split_chunk(d, cluster) < d)
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
    let hold = match constant(&spec, "RESIDENT") {
        0 => Hold::Floats,
        1 => Hold::Stage,
        _ => Hold::Packed,
    };
    // 1,024 threads: the looped path, and VJP rows resident or with SHARED_SUMS (no ring).
    let max = match pass {
        _ if items == 0 => 1024,
        Pass::Vjp if hold == Hold::Stage || (stages == 0 && n_reads <= 4) => 1024,
        _ => max_group(pass),
    };
    let ok = *spec.template == *family
        && spec.dtype == dtype
        && legal_width
        && group % 32 == 0
        && group <= max
        && items <= 4
        && (items == 0 || group * items * n_reads >= d)
        && (stages == 0 || (stages == 2 && items > 0 && dtype.size() * n_reads == 16))
        && (hold == Hold::Floats || stages > 0)
        && (hold != Hold::Packed || dtype.size() == 2)
        && spec == spec_with(pass, kind, dtype, n_reads, group, items, stages, hold);
    if !ok {
        return Err(bad(
            "spec",
            format!("{spec} cannot run {pass:?} {kind:?} {dtype} rows of {d}"),
        ));
    }
    Ok(spec)
}
