//! The streamed-rows kernel's plan (`templates/conv_depthwise_rows.cu`): which layers it can
//! run and which the plan gives it, and its walk of a layer (channel chunks, column bands and
//! row segments) and launch.

use crate::dtype::DType;
use crate::ops::conv::geometry::Pass;
use crate::ops::conv::plan::PlanKey;

use super::{walk_problem, Launch, Shape, LANES, MAX_KERNEL, THREADS};

/// The first architecture the rows kernel runs on: its ring needs `cp.async` to keep copies in
/// flight (older targets would copy a row at once, and the stencil is measured there).
pub const ROWS_ARCH: u32 = 80;
/// Source rows the rows kernel has in flight while one is computed (AHEAD: its ring holds
/// AHEAD + 1 rows, AHEAD + KH for backward-weight).
const ROWS_AHEAD: usize = 3;
/// Channels a rows block takes along x: at most 64 vectors of 4 (kernels up to 3x3); 32 single
/// channels (larger kernels), or all of fewer.
const ROWS_MAX_VECTORS: usize = 64;
const ROWS_MAX_CHANNELS: usize = 32;
/// The tallest 16-bit image (gathered rows) whose forward or backward-data the rows kernel
/// takes with a kernel past 3x3 of `taps` taps at `stride`, 0 for none (the tensor-core kernel
/// and the stencil keep the rest; backward-weight stays on the stencil). H100, rows / the
/// tensor-core kernel: 5x5 on 7x7 images 1.30-1.42x; backward-weight against the stencil
/// 0.74-0.84x. H200, after the rows kernel's stepped addresses, stride 1: 5x5 1.45x on 9x9
/// images, 1.5x on 10x10, 1.51-1.64x on 11x11, 1.38x on 12x12, 1.11-1.16x on 13x13, 0.98-1.21x
/// on 14x14, 0.94x on 20x20; 7x7 1.23-1.36x on 7x7 and 9x9, 1.07-1.16x on 10x10, 0.90-0.99x on
/// 12x12, 0.85-0.88x on 14x14. Stride 2 (the forward) was measured on 7x7 outputs only.
pub(super) fn rows_small_image_most(stride: usize, taps: usize) -> usize {
    match (stride, taps) {
        (1, 0..=25) => 14,
        (1, 0..=49) => 10,
        (2, 0..=25) => 7,
        _ => 0,
    }
}

/// Whether the plan runs `key` (which the family takes) on the rows kernel, where it can
/// ([`rows_fit`]): kernels up to 3x3 always; larger ones (one channel a thread) in f32 and, in
/// 16-bit, only the forward and backward-data on small images (`rows_small_image_most`):
/// elsewhere in 16-bit the tensor-core kernel and the stencil are faster.
pub fn takes_rows(key: &PlanKey) -> bool {
    let g = &key.geometry;
    let gathered_rows = match key.pass {
        Pass::BackwardData => g.input[1],
        _ => g.output[1],
    };
    let taps = g.kernel[1] * g.kernel[2];
    let small_image = gathered_rows <= rows_small_image_most(g.stride[1], taps);
    let larger_ok = key.dtype == DType::F32 || key.pass != Pass::BackwardWeight && small_image;
    rows_fit(key) && (rows_vector([g.kernel[1], g.kernel[2]]) == 4 || larger_ok)
}

/// Whether the rows kernel can run `key` (which the family takes): sm_80 on, one output channel
/// a group, stride 1 (the forward: 1 or 2, the same along both dims), kernels of 2-7 rows and up
/// to 7 columns, aligned operands and channels in whole copies, and offsets within one image of
/// either operand that fit 32 bits.
pub fn rows_fit(key: &PlanKey) -> bool {
    let g = &key.geometry;
    let kernel = [g.kernel[1], g.kernel[2]];
    let image = |e: [usize; 3], c: usize| e.iter().product::<usize>() * c <= i32::MAX as usize;
    key.arch >= ROWS_ARCH
        && g.cout == g.groups
        && g.stride[1] == g.stride[2]
        && (g.stride[1] == 1 || g.stride[1] == 2 && key.pass == Pass::Forward)
        && (2..=MAX_KERNEL).contains(&kernel[0])
        && kernel[1] <= MAX_KERNEL
        && key.aligned
        && g.cin % rows_granule(key.dtype, kernel) == 0
        && image(g.input, g.cin)
        && image(g.output, g.cout)
}

/// Channels a thread of the rows kernel takes (the template's V): a vector of 4 for kernels
/// up to 3x3; one channel for larger ones, so that a thread's weights (49 for 7x7) stay in
/// registers as f32 beside its rows of accumulators.
pub(super) fn rows_vector(kernel: [usize; 2]) -> usize {
    if kernel[0] <= 3 && kernel[1] <= 3 {
        4
    } else {
        1
    }
}

/// Channels one copy of the rows kernel moves (the template's CG): the thread's vector of 4,
/// else 16 bytes. Channel counts and chunks are whole copies.
fn rows_granule(dtype: DType, kernel: [usize; 2]) -> usize {
    match rows_vector(kernel) {
        4 => 4,
        _ => 16 / dtype.size(),
    }
}

/// Output columns a thread of the rows kernel computes (the template's TW): with vectors of 4,
/// four in 16-bit and two in f32, whose windows take twice the registers; with one channel,
/// four.
pub(super) fn rows_columns(dtype: DType, kernel: [usize; 2]) -> usize {
    if dtype == DType::F32 && rows_vector(kernel) == 4 {
        2
    } else {
        4
    }
}

/// How the rows kernel walks a layer: a block's channel vectors (blockDim.x) and column groups
/// (blockDim.y), chunks of channels and bands of columns, and rows a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RowsWalk {
    vectors: usize,
    groups: usize,
    chunks: usize,
    bands: usize,
    segment: usize,
    shared: usize,
}

/// What a backward-weight layer and walk must be for the plan to run it on the rows kernel
/// rather than the stencil (persistent blocks of 32 channels, which fill the GPU at any size):
/// a channel count that leaves some of the stencil's lanes idle (not a multiple of 32: with
/// every lane busy its long per-block sums beat the rows' per-block partials); each block
/// summing at least 512 outputs a channel (rows of its segment times columns of its band), so
/// that its pipeline's start and its f32 partial are a small part of it; and the blocks filling
/// two thirds of the GPU's 16-warp slots at once. H100, 3x3 layers, rows / stencil: walks of
/// 32-392 outputs a block 0.59-0.92x, one of 784 whose blocks held a third of the slots 0.70x;
/// past both floors, 8, 24, 40, 120 and 144 channels 1.00-2.31x, and 32, 96 and 480 channels
/// 0.89-0.98x in 16-bit and for two of three layers in f32.
const ROWS_WEIGHT_OUTPUTS: usize = 512;
const ROWS_WEIGHT_FILL: (usize, usize) = (2, 3);

/// The rows kernel's walk of `key` (which it takes) over the gather's output (backward-weight:
/// the cotangent), on `sms` multiprocessors with `limit` bytes of shared memory a block; None
/// where no block fits. A block of V-channel vectors x column groups (at most [`THREADS`], the
/// widest chunk of channels that fits, columns split evenly into bands); then the segment
/// length with the least modelled time: each wave of blocks takes its segment's source rows
/// plus the ring's first rows in flight, at the pace of one 16-warp SM (the launch bound allows
/// 128 registers: 16 warps an SM), slower in proportion where more warps share an SM (with one
/// channel a thread, whose rows take 25-49 FMAs an output, where more than 8 do: H100, 512
/// channels of 7x7 with a 7x7 kernel, f32, one segment of 8 warps an SM 6.0 TFLOP/s against
/// 4.7 for two of 16);
/// backward-weight adds the f32 partials each block along x writes and the split sum reads, in
/// steps of what the GPU's threads copy in one, and unless `any_walk` takes only channel counts
/// and walks past the floors of [`ROWS_WEIGHT_OUTPUTS`] and [`ROWS_WEIGHT_FILL`]. Narrower chunks
/// (more blocks) are tried where the layer has few.
fn choose_rows(key: &PlanKey, sms: usize, limit: usize, any_walk: bool) -> Option<RowsWalk> {
    let g = &key.geometry;
    let (pass, dtype) = (key.pass, key.dtype);
    let kernel = [g.kernel[1], g.kernel[2]];
    let extents = if pass == Pass::BackwardData {
        g.input
    } else {
        g.output
    };
    let out = [extents[1], extents[2]];
    let (channels, batch) = (g.cin, g.batch);
    let v = rows_vector(kernel);
    // Channel vectors a chunk is made of: whole copies, at most the block's x.
    let per_copy = rows_granule(dtype, kernel) / v;
    let most_vectors = if v == 4 {
        ROWS_MAX_VECTORS
    } else {
        ROWS_MAX_CHANNELS
    };
    let vectors_all = channels / v;
    let tw = rows_columns(dtype, kernel);
    let weight = pass == Pass::BackwardWeight;
    if weight && !any_walk && channels % LANES == 0 {
        return None; // every lane of the stencil busy: it sums faster
    }
    let depth = ROWS_AHEAD + if weight { kernel[0] } else { 1 };
    let stride = g.stride[1];
    // Bytes the GPU's threads copy in one step (source and cotangent windows).
    let step_bytes = sms * 16 * 32 * tw * v * dtype.size() * 2;
    let taps = kernel[0] * kernel[1];
    let column_groups = out[1].div_ceil(tw);
    let fewest_chunks = vectors_all.div_ceil(most_vectors);
    // (walk, cost, thread slots)
    let mut best: Option<(RowsWalk, usize, usize)> = None;
    // One-channel chunks are whole warps (with fewer channels, a warp's lanes of different
    // column groups read the same shared-memory banks): only the fewest chunks are tried.
    let tries = if v == 1 { 1 } else { 3 };
    for chunks in [fewest_chunks, 2 * fewest_chunks, 4 * fewest_chunks]
        .into_iter()
        .take(tries)
    {
        let vectors = if v == 1 {
            vectors_all
                .next_multiple_of(per_copy)
                .min(ROWS_MAX_CHANNELS)
        } else {
            vectors_all.div_ceil(chunks)
        };
        if chunks > fewest_chunks && vectors < 8 {
            break;
        }
        let chunks = vectors_all.div_ceil(vectors);
        let most = (THREADS as usize / vectors).clamp(1, column_groups);
        let bands = column_groups.div_ceil(most);
        let groups = column_groups.div_ceil(bands);
        let warps = (vectors * groups).div_ceil(32);
        let cols = (groups * tw - 1) * stride + kernel[1];
        let chans = vectors * v;
        // The source ring, backward-weight's cotangent ring and its column groups' f32 sums
        // (which reuse the rings).
        let rings = depth * (cols + if weight { groups * tw } else { 0 }) * chans * dtype.size();
        let sums = if weight { groups * taps * chans * 4 } else { 0 };
        let shared = rings.max(sums);
        if shared > limit {
            continue;
        }
        let per_sm = (16 / warps).min((limit + 1024) / (shared + 1024)).max(1);
        let slots = chunks * vectors * bands * groups;
        for segments in 1..=out[0] {
            let segment = out[0].div_ceil(segments);
            if out[0].div_ceil(segment) != segments {
                continue; // the same segments as a shorter one
            }
            let blocks = batch * segments * bands * chunks;
            if weight && !any_walk {
                let (part, whole) = ROWS_WEIGHT_FILL;
                let fills = blocks.min(per_sm * sms) * warps * whole >= sms * 16 * part;
                if segment * groups * tw < ROWS_WEIGHT_OUTPUTS || !fills {
                    continue;
                }
            }
            let waves = blocks.div_ceil(per_sm * sms);
            let resident = per_sm.min(blocks.div_ceil(sms)) * warps;
            let pace = resident.max(if v == 1 { 8 } else { 16 });
            let source_rows = (segment - 1) * stride + kernel[0];
            let mut cost = waves * (source_rows + ROWS_AHEAD) * pace;
            if weight {
                let splits = batch * segments * bands;
                let partials = if splits > 1 {
                    splits * channels * taps * 4 * 2
                } else {
                    0
                };
                cost += partials * 16 / step_bytes;
            }
            let better = match best {
                None => true,
                Some((_, c, s)) => (cost, slots) < (c, s),
            };
            if better {
                let walk = RowsWalk {
                    vectors,
                    groups,
                    chunks,
                    bands,
                    segment,
                    shared,
                };
                best = Some((walk, cost, slots));
            }
        }
    }
    best.map(|(w, ..)| w)
}

/// The rows kernel's launch of `key` (which it can run: [`rows_fit`]), or None where no
/// block fits or, for backward-weight, no walk is past the plan's floors (`any_walk`, for the
/// tests: any walk will do).
pub fn rows_launch(key: &PlanKey, sms: usize, limit: usize, any_walk: bool) -> Option<Launch> {
    let g = &key.geometry;
    let pass = key.pass;
    let shape = Shape::rows(g, key.dtype);
    let walk = choose_rows(key, sms.max(1), limit, any_walk)?;
    let tile = [walk.segment, walk.groups * shape.out_tile[1]];
    let problem = walk_problem(g, pass, tile, walk.bands, walk.chunks)?;
    let tiles = problem.tiles as usize;
    Some(Launch {
        pass,
        shape,
        problem,
        grid: (tiles as u32, walk.chunks as u32, 1),
        block: (walk.vectors as u32, walk.groups as u32, 1),
        shared: walk.shared,
        // Backward-weight: one f32 partial a block along x.
        splits: if pass == Pass::BackwardWeight {
            tiles
        } else {
            1
        },
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::H100_SHARED;
    use super::super::{launch_for, Variant};
    use super::*;
    use crate::ops::conv::geometry::ConvParams;
    use crate::ops::conv::plan::test_key as key;

    #[test]
    fn rows_take_kernels_up_to_7x7_with_whole_copies() {
        let variant = |dtype, pass, c: usize, mg, k: [usize; 2], stride: usize, arch, aligned| {
            let p = ConvParams::default()
                .groups(c)
                .strides(&[stride])
                .padding(&[1]);
            let k = PlanKey {
                arch,
                aligned,
                ..key(dtype, pass, &[64, 56, 56, c], &[c * mg, k[0], k[1], 1], &p)
            };
            launch_for(&k, 132, H100_SHARED).unwrap().shape.variant
        };
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                let rows = |c, mg, k, stride, arch, aligned| {
                    variant(dtype, pass, c, mg, k, stride, arch, aligned) == Variant::Rows
                };
                for k in [[3, 3], [2, 3], [3, 1], [2, 2]] {
                    assert!(rows(144, 1, k, 1, 90, true), "{k:?}");
                }
                // Kernels past 3x3: f32; 16-bit only for images of up to 14 rows (5x5) or 10
                // (7x7), not backward-weight.
                let f32 = dtype == DType::F32;
                for k in [[5, 5], [7, 7], [3, 7], [7, 1]] {
                    assert_eq!(rows(144, 1, k, 1, 90, true), f32, "{k:?}");
                }
                let image = |c, k: usize, hw: usize| {
                    let p = ConvParams::default().groups(c).padding(&[k / 2]);
                    let kk = key(dtype, pass, &[64, hw, hw, c], &[c, k, k, 1], &p);
                    launch_for(&kk, 132, H100_SHARED).unwrap().shape.variant == Variant::Rows
                };
                let small_image = |c, k| image(c, k, 7);
                let gather = pass != Pass::BackwardWeight;
                // (Backward-weight of 7x7 images stays on the stencil in f32 too: its blocks
                // would sum at most 49 outputs a channel.)
                assert_eq!(small_image(1152, 5), gather, "1152 channels 7x7");
                // One channel a thread copies 16 bytes at once.
                assert_eq!(small_image(1156, 7), f32 && gather, "1156 channels 7x7");
                assert!(!small_image(1154, 7), "1154 channels 7x7");
                assert_eq!(image(672, 5, 14), gather, "672 channels 14x14");
                assert_eq!(image(672, 5, 15), f32 && gather, "672 channels 15x15");
                assert_eq!(image(1152, 7, 7), gather, "7x7 kernel, 7x7");
                assert_eq!(image(1152, 7, 10), gather, "7x7 kernel, 10x10");
                assert_eq!(image(1152, 7, 11), f32 && gather, "7x7 kernel, 11x11");
                assert!(rows(144, 1, [3, 3], 1, 80, true));
                assert!(!rows(144, 1, [3, 3], 1, 75, true), "before sm_80");
                assert!(
                    !rows(142, 1, [3, 3], 1, 90, true),
                    "channels not in vectors of 4"
                );
                assert!(!rows(144, 1, [3, 3], 1, 90, false), "unaligned operands");
                assert!(
                    !rows(144, 2, [3, 3], 1, 90, true),
                    "a channel multiplier of 2"
                );
                assert!(!rows(144, 1, [1, 3], 1, 90, true), "one kernel row");
                // Forward and backward-data take any size (but small images go to the column
                // walks: 16-bit always, f32 where they fill the GPU); backward-weight only walks
                // past its floors (a 7x7 image's blocks sum at most 49 outputs a channel).
                let small = |c| {
                    let p = ConvParams::default().groups(c).padding(&[1]);
                    let k = key(dtype, pass, &[64, 7, 7, c], &[c, 3, 3, 1], &p);
                    launch_for(&k, 132, H100_SHARED).unwrap().shape.variant == Variant::Rows
                };
                assert!(!small(960), "960 channels 7x7: 7.8 warps an SM");
                let f32_rows = f32 && pass != Pass::BackwardWeight;
                assert_eq!(small(480), f32_rows, "480 channels 7x7: 3.9 warps an SM");
                // Channels in whole 32-lane blocks keep backward-weight on the stencil.
                let whole = rows(128, 1, [3, 3], 1, 90, true);
                assert_eq!(whole, pass != Pass::BackwardWeight, "128 channels");
            }
            // Stride 2: the forward's alone, the same along both dims.
            for pass in Pass::ALL {
                let strided = variant(dtype, pass, 144, 1, [3, 3], 2, 90, true);
                assert_eq!(strided == Variant::Rows, pass == Pass::Forward, "{pass:?}");
            }
            let p = ConvParams::default()
                .groups(144)
                .strides(&[2, 1])
                .padding(&[1]);
            let kk = key(
                dtype,
                Pass::Forward,
                &[64, 56, 56, 144],
                &[144, 3, 3, 1],
                &p,
            );
            assert!(!rows_fit(&kk), "strides 2 and 1");
        }
    }

    #[test]
    fn rows_launches_cover_the_output_within_the_block_and_shared_memory() {
        for kernel in [[3, 3], [5, 5], [7, 7]] {
            rows_launches_cover(kernel);
        }
    }

    fn rows_launches_cover(kernel: [usize; 2]) {
        let v = rows_vector(kernel);
        let sizes = [
            [2, 1],
            [3, 5],
            [7, 7],
            [14, 14],
            [28, 28],
            [56, 56],
            [112, 112],
            [9, 300],
        ];
        // (pass, stride): stride 2 is the forward's alone.
        let passes = Pass::ALL
            .map(|p| (p, 1))
            .into_iter()
            .chain([(Pass::Forward, 2)]);
        for dtype in DType::ALL {
            for (pass, stride) in passes.clone() {
                for c in [8, 32, 144, 576, 1000] {
                    for size in sizes {
                        for (batch, sms) in [(1, 132), (64, 132), (3, 4)] {
                            let p = ConvParams::default()
                                .groups(c)
                                .strides(&[stride])
                                .padding(&[kernel[0] / 2]);
                            let x = [batch, size[0], size[1], c];
                            let w = [c, kernel[0], kernel[1], 1];
                            let kk = key(dtype, pass, &x, &w, &p);
                            let planned = launch_for(&kk, sms, H100_SHARED).unwrap();
                            // Backward-weight takes the rows past its floors, and 16-bit kernels
                            // past 3x3 only some layers; the other walks (the tests') are
                            // checked all the same.
                            let rows = planned.shape.variant == Variant::Rows;
                            let sixteen_larger = v == 1 && dtype != DType::F32;
                            let columns = matches!(planned.shape.variant, Variant::Columns { .. });
                            let exempt = pass == Pass::BackwardWeight || sixteen_larger || columns;
                            assert!(rows || exempt, "{kk:?}");
                            let l = if rows {
                                planned
                            } else {
                                rows_launch(&kk, sms, H100_SHARED, true).unwrap()
                            };
                            let pr = l.problem;
                            if rows && pass == Pass::BackwardWeight {
                                let outputs = (pr.tile_h * pr.tile_w) as usize;
                                assert!(outputs >= ROWS_WEIGHT_OUTPUTS, "{kk:?}");
                            }
                            let (vectors, groups, _) = l.block;
                            assert!(vectors * groups <= THREADS as u32, "{kk:?}");
                            // Every channel vector, column and row is some block's; chunks are
                            // whole copies.
                            let chans = vectors as usize * v;
                            assert_eq!(chans % rows_granule(dtype, kernel), 0, "{kk:?}");
                            assert!(l.grid.1 as usize * chans >= c, "{kk:?}");
                            assert!((l.grid.1 as usize - 1) * chans < c, "{kk:?}");
                            assert_eq!(pr.tile_w as u32, groups * l.shape.out_tile[1] as u32);
                            assert!(pr.tiles_w * pr.tile_w >= pr.out_w, "{kk:?}");
                            assert!(pr.tiles_h * pr.tile_h >= pr.out_h, "{kk:?}");
                            assert!((pr.tiles_h - 1) * pr.tile_h < pr.out_h, "{kk:?}");
                            assert_eq!(l.grid.0 as i32, batch as i32 * pr.tiles_h * pr.tiles_w);
                            // The ring: AHEAD + 1 rows of the band's columns and halo;
                            // backward-weight AHEAD + KH rows and as many cotangent rows, or
                            // the column groups' f32 sums where they take more.
                            let cols = (pr.tile_w as usize - 1) * stride + kernel[1];
                            let shared = if pass == Pass::BackwardWeight {
                                let rings = (ROWS_AHEAD + kernel[0]) * (cols + pr.tile_w as usize);
                                let sums = groups as usize * kernel[0] * kernel[1] * chans * 4;
                                (rings * chans * dtype.size()).max(sums)
                            } else {
                                (ROWS_AHEAD + 1) * cols * chans * dtype.size()
                            };
                            assert_eq!(l.shared, shared);
                            assert!(l.shared <= H100_SHARED);
                            // Backward-weight: one partial a block along x.
                            let splits = if pass == Pass::BackwardWeight {
                                l.grid.0 as usize
                            } else {
                                1
                            };
                            assert_eq!(l.splits, splits);
                        }
                    }
                }
            }
        }
    }
}
