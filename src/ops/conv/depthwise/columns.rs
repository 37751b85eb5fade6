//! The column walks' plan (`templates/conv_depthwise_cols.cu`): which layers they can run and
//! which the plan gives them (backward-weight with many idle lanes, the forward and
//! backward-data of small images), and their launch.

use crate::dtype::DType;
use crate::ops::conv::geometry::Pass;
use crate::ops::conv::plan::PlanKey;

use super::{walk_problem, Launch, Shape, Variant, LANES, MAX_KERNEL, THREADS};

/// Channels a column walk's thread takes at most (its vector), by kernel size: 4 up to 3x3,
/// 2 up to 25 taps, else 1, so that its KH x KW x V sums stay in registers beside its window;
/// half that (at least 1) in f32, whose window a step ahead takes twice the registers (at 4,
/// ptxas spilled 388 bytes of the 3x3 kernel).
pub(super) fn columns_most_vector(dtype: DType, kernel: [usize; 2]) -> usize {
    let most = match kernel[0] * kernel[1] {
        0..=9 => 4,
        10..=25 => 2,
        _ => 1,
    };
    if dtype == DType::F32 {
        (most / 2).max(1)
    } else {
        most
    }
}

/// Output columns a thread of the column walks takes in backward-weight (the template's TW).
pub(super) const COLUMNS_TW: usize = 2;
/// Output columns a thread of the column walks takes in the forward and backward-data: a
/// whole row of 7 or 14 columns (two threads), else 3 ([`columns_output_tw`]).
pub(super) const COLUMNS_OUTPUT_TW: [usize; 2] = [3, 7];
/// Channels a thread of the column walks takes in the forward and backward-data: two, whose
/// window, sums and weights fit the registers at up to 7 columns (a standalone probe of this
/// walk on an H200, f16 3x3: 4-byte vectors 1.2-1.7x the 8- and 16-byte ones on 7x7 to 28x28
/// images).
pub(super) const COLUMNS_OUTPUT_VECTOR: usize = 2;
/// The widest images whose 16-bit forward and backward-data the column walks take at stride 1
/// (rows and columns; f32 and stride 2: half). H200, 16-bit 3x3, against the streamed rows:
/// 0.99-1.40x forward and 0.97-1.31x backward-data on 7x7 to 20x20 images, 0.6-1.0x on 28x28.
const COLUMNS_OUTPUT_MOST: usize = 20;

/// Output columns a thread of the column walks takes in the forward and backward-data of
/// images `width` columns wide: one of [`COLUMNS_OUTPUT_TW`].
fn columns_output_tw(width: usize) -> usize {
    if width % 7 == 0 && width <= 14 {
        7
    } else {
        3
    }
}
/// Channel vectors a column-walk block takes at most along x.
const COLUMNS_MAX_VECTORS: usize = 64;

/// Whether the column walks can run `key` (which the family takes): one output channel a
/// group, kernels of 2-7 rows, the same stride along both dims (backward-data: 1), and offsets
/// within one image of either operand that fit 32 bits. Any architecture: plain loads.
pub fn columns_fit(key: &PlanKey) -> bool {
    let g = &key.geometry;
    let image = |e: [usize; 3], c: usize| e.iter().product::<usize>() * c <= i32::MAX as usize;
    (key.pass != Pass::BackwardData || g.stride[1] == 1)
        && g.cout == g.groups
        && g.stride[1] == g.stride[2]
        && (2..=MAX_KERNEL).contains(&g.kernel[1])
        && g.kernel[2] <= MAX_KERNEL
        && image(g.input, g.cin)
        && image(g.output, g.cout)
}

/// Whether the plan runs `key` (backward-weight, which the family takes) on the column walks,
/// given whether the rows kernel would (`rows_runs`): where they can ([`columns_fit`]), kernels
/// of up to 9 taps, and a channel count that leaves many of the other kernels' 32-channel lanes
/// idle: fewer than 3 in 5 busy (6, 8, 16, 17, 36 channels), or at stride 1 fewer than 4 in 5
/// where the rows kernel does not run the layer (the stencil would: 20, 100 channels).
/// H200, column walks / the kernels before them, 3x3 layers, two rounds, every dtype: fewer
/// than 3 in 5 busy 1.15-13.1x (3-36 channels, strides 1 and 2); 20 and 100 channels at 28x28
/// (stencil) 0.98-3.2x; where the rows kernel runs 40-72 channels 0.82-1.26x (f32 and bf16
/// slower), so it keeps them; the stencil's 40 channels at stride 2 0.86-1.08x; full chunks
/// (32-1,280 channels) 0.53-1.21x and 5x5 and 7x7 kernels 0.53-0.96x.
pub fn takes_columns(key: &PlanKey, rows_runs: bool) -> bool {
    let g = &key.geometry;
    if key.pass != Pass::BackwardWeight {
        return takes_columns_output(key);
    }
    let lanes = LANES * g.cin.div_ceil(LANES);
    let sparse = 5 * g.cin < 3 * lanes;
    let stencil_sparse = !rows_runs && g.stride[1] == 1 && 5 * g.cin < 4 * lanes;
    columns_fit(key) && g.kernel[1] * g.kernel[2] <= 9 && (sparse || stencil_sparse)
}

/// Whether the plan runs the forward or backward-data of `key` on the column walks: 3x3 (or
/// smaller) kernels on small images, channels in pairs and aligned operands. The gather's
/// output is at most [`COLUMNS_OUTPUT_MOST`] rows and columns for 16-bit at stride 1, half that
/// for f32 at stride 1 and for the 16-bit forward at stride 2 (about the same source image);
/// those two also only where the launch fills the GPU ([`columns_fill`]).
/// H200, against the streamed rows: f32 on 7x7 to 10x10 images 1.02-1.42x (six layers), on
/// 11x11 to 20x20 0.85-1.22x with no rule found that parts them; 16-bit stride-2 forwards of
/// 7x7 to 10x10 outputs 1.03-1.43x, of 11x11 to 20x20 0.85-1.24x.
fn takes_columns_output(key: &PlanKey) -> bool {
    let g = &key.geometry;
    let out = if key.pass == Pass::BackwardData {
        g.input
    } else {
        g.output
    };
    let most = match (g.stride[1], key.dtype) {
        (1, DType::F16 | DType::BF16) => COLUMNS_OUTPUT_MOST,
        (1, _) | (2, DType::F16 | DType::BF16) => COLUMNS_OUTPUT_MOST / 2,
        _ => 0,
    };
    columns_fit(key)
        && g.kernel[1] <= 3
        && g.kernel[2] <= 3
        && out[1] <= most
        && out[2] <= most
        && g.cin % COLUMNS_OUTPUT_VECTOR == 0
        && key.aligned
}

/// Whether the plan keeps a launch of the column walks for `key` on `sms` multiprocessors:
/// backward-weight (persistent blocks) and 16-bit at stride 1 always; the forward and
/// backward-data of f32 and at stride 2 where the launch fills the
/// GPU without a second round, 4 to 16 warps an SM (a block walks a whole image, so there is
/// no finer unit to share out). H200, against the streamed rows: f32 0.87x at 23 warps an SM
/// (128 x 384 channels at 12x12: 384 blocks where 264 are resident) and 0.89x at 3.9 (32 x 128
/// channels at 20x20, 64 blocks); 16-bit stride-2 0.93x at 2.9 (96 x 144 channels, 14x14 to
/// 7x7). 16-bit stride-1 layers outside the range read 0.96-1.09x (64 x 320 channels at 13x13,
/// 17.5 warps an SM: 1.05-1.09x), so they keep the walks.
pub(super) fn columns_fill(launch: &Launch, key: &PlanKey, sms: usize) -> bool {
    if key.pass == Pass::BackwardWeight || key.dtype != DType::F32 && key.geometry.stride[1] == 1 {
        return true;
    }
    let (vectors, groups, _) = launch.block;
    let warps = launch.grid.0 as usize * (vectors * groups).div_ceil(32) as usize;
    (4 * sms..=16 * sms).contains(&warps)
}

/// The column walks' vector: the widest of 4, 2 and 1 that the kernel allows
/// ([`columns_most_vector`]) and the channel count divides, 1 for operands not 16-byte aligned.
fn columns_vector(dtype: DType, kernel: [usize; 2], channels: usize, aligned: bool) -> usize {
    let most = if aligned {
        columns_most_vector(dtype, kernel)
    } else {
        1
    };
    [4, 2, 1]
        .into_iter()
        .find(|&v| v <= most && channels % v == 0)
        .unwrap_or(1)
}

/// The column walks' launch of `key` (which they can run: [`columns_fit`]) on `sms`
/// multiprocessors with `limit` bytes of shared memory a block, or None where the block's sums
/// do not fit. A block takes a chunk of at most `COLUMNS_MAX_VECTORS` channel vectors (chunks
/// balanced) and as many column groups of TW columns as [`THREADS`] allows (bands balanced).
/// Backward-weight: blocks are persistent, as many as the SMs hold at 16 warps each (the launch
/// bound allows 128 registers), over the segments of least modelled time. Forward and
/// backward-data: one segment an image and a block a (chunk, tile).
pub fn columns_launch(key: &PlanKey, sms: usize, limit: usize) -> Option<Launch> {
    let g = &key.geometry;
    let pass = key.pass;
    let weight = pass == Pass::BackwardWeight;
    let kernel = [g.kernel[1], g.kernel[2]];
    let stride = g.stride[1];
    // The gather's output (backward-weight: the cotangent).
    let out = if pass == Pass::BackwardData {
        g.input
    } else {
        g.output
    };
    let widest = columns_vector(key.dtype, kernel, g.cin, key.aligned);
    let (v, tw) = if weight {
        (widest, COLUMNS_TW)
    } else {
        (widest.min(COLUMNS_OUTPUT_VECTOR), columns_output_tw(out[2]))
    };
    let vectors_all = g.cin / v;
    let chunks = vectors_all.div_ceil(COLUMNS_MAX_VECTORS);
    let vectors = vectors_all.div_ceil(chunks);
    let column_groups = out[2].div_ceil(tw);
    let most = (THREADS as usize / vectors).clamp(1, column_groups);
    let bands = column_groups.div_ceil(most);
    let groups = column_groups.div_ceil(bands);
    let shared = if weight {
        groups * kernel[0] * kernel[1] * vectors * v * 4
    } else {
        0
    };
    if shared > limit {
        return None;
    }
    let warps = (vectors * groups).div_ceil(32);
    let per_sm = (16 / warps).clamp(1, ((limit + 1024) / (shared + 1024)).max(1));
    let slots = (per_sm * sms.max(1) / chunks).max(1);
    // Forward and backward-data walk whole images, a block a tile: on small images the
    // segments' halo rows and the persistent blocks' second rounds cost more than the wider
    // grid.
    let segment = if weight {
        least_cost_segment(out[1], g.batch * bands, stride, kernel[0], slots)?
    } else {
        (out[1] > 0).then_some(out[1])?
    };
    let problem = walk_problem(g, pass, [segment, groups * tw], bands, chunks)?;
    // Backward-weight: persistent blocks along x, chunks along y. Forward and backward-data: a
    // block a (chunk, tile), chunks fastest, along x.
    let grid = if weight {
        ((problem.tiles as usize).min(slots), chunks)
    } else {
        (problem.tiles as usize * chunks, 1)
    };
    if grid.0 > i32::MAX as usize {
        return None;
    }
    Some(Launch {
        pass,
        shape: Shape {
            out_tile: [1, tw],
            variant: Variant::Columns { vector: v },
            ..Shape::of(pass, g)
        },
        problem,
        grid: (grid.0 as u32, grid.1 as u32, 1),
        block: (vectors as u32, groups as u32, 1),
        shared,
        // Backward-weight: one f32 partial a block along x.
        splits: if weight { grid.0 } else { 1 },
    })
}

/// Backward-weight's segment of an image `rows` output rows high (`tiles_a_row` tiles a
/// segment row: batch times bands), with the least modelled time on `slots` persistent blocks:
/// the busiest block's tiles times the source rows a tile walks (shorter segments give more
/// tiles to share out and read KH - S halo rows more each). None for an empty image.
fn least_cost_segment(
    rows: usize,
    tiles_a_row: usize,
    stride: usize,
    kernel_rows: usize,
    slots: usize,
) -> Option<usize> {
    // (cost, segment)
    let mut best: Option<(usize, usize)> = None;
    for segments in 1..=rows {
        let segment = rows.div_ceil(segments);
        if rows.div_ceil(segment) != segments {
            continue; // the same segments as a shorter one
        }
        let tiles = tiles_a_row * segments;
        let source_rows = (segment - 1) * stride + kernel_rows;
        let cost = tiles.div_ceil(tiles.min(slots)) * source_rows;
        if best.map_or(true, |(c, _)| cost < c) {
            best = Some((cost, segment));
        }
    }
    best.map(|(_, segment)| segment)
}

#[cfg(test)]
mod tests {
    use super::super::launch_for;
    use super::super::tests::H100_SHARED;
    use super::*;
    use crate::ops::conv::geometry::ConvParams;
    use crate::ops::conv::plan::test_key as key;

    #[test]
    fn columns_take_3x3_backward_weight_with_many_idle_lanes() {
        let variant = |dtype, pass, c: usize, k: usize, stride: usize, arch, aligned| {
            let p = ConvParams::default()
                .groups(c)
                .strides(&[stride])
                .padding(&[k / 2]);
            let kk = PlanKey {
                arch,
                aligned,
                ..key(dtype, pass, &[8, 33, 47, c], &[c, k, k, 1], &p)
            };
            launch_for(&kk, 132, H100_SHARED).unwrap().shape.variant
        };
        for dtype in DType::ALL {
            let columns = |c, k, stride, arch, aligned| {
                let v = variant(dtype, Pass::BackwardWeight, c, k, stride, arch, aligned);
                matches!(v, Variant::Columns { .. })
            };
            for c in [1, 6, 8, 16, 17, 33, 36] {
                assert!(columns(c, 3, 1, 90, true), "{c} channels");
                assert!(columns(c, 3, 2, 75, false), "{c} channels, stride 2, sm_75");
            }
            // Up to 4 in 5 lanes busy at stride 1 where the rows kernel does not run it: here
            // on 8 images of 33x47 it does not (its blocks would fill too little of the GPU),
            // nor before sm_80.
            for c in [20, 24, 40, 70, 100] {
                assert!(columns(c, 3, 1, 90, true), "{c} channels");
                assert!(columns(c, 3, 1, 75, true), "{c} channels, sm_75");
                assert!(!columns(c, 3, 2, 90, true), "{c} channels, stride 2");
            }
            for c in [32, 144, 192] {
                assert!(!columns(c, 3, 1, 90, true), "{c} channels");
            }
            // Where the rows kernel runs 40 channels (150x150 images), it keeps them.
            let p = ConvParams::default().groups(40).padding(&[1]);
            let large = key(
                dtype,
                Pass::BackwardWeight,
                &[32, 150, 150, 40],
                &[40, 3, 3, 1],
                &p,
            );
            let v = launch_for(&large, 132, H100_SHARED).unwrap().shape.variant;
            assert_eq!(v, Variant::Rows, "{dtype:?}");
            assert!(!columns(36, 5, 1, 90, true), "5x5");
            for pass in [Pass::Forward, Pass::BackwardData] {
                let v = variant(dtype, pass, 36, 3, 1, 90, true);
                assert!(!matches!(v, Variant::Columns { .. }), "{pass:?}");
                // Small images are the column walks', two channels a thread and a row of 7 a
                // thread: 16-bit at stride 1 up to 20x20, f32 up to 10x10 where the launch fills
                // the GPU, the 16-bit forward at stride 2 up to 10x10 outputs (likewise).
                let small = |c: usize, hw: usize, stride: usize, aligned: bool| {
                    let p = ConvParams::default()
                        .groups(c)
                        .strides(&[stride])
                        .padding(&[1]);
                    let kk = PlanKey {
                        aligned,
                        ..key(dtype, pass, &[64, hw, hw, c], &[c, 3, 3, 1], &p)
                    };
                    launch_for(&kk, 132, H100_SHARED).unwrap().shape
                };
                let s = small(960, 7, 1, true);
                assert_eq!(
                    s.variant,
                    Variant::Columns { vector: 2 },
                    "{dtype:?} {pass:?}"
                );
                assert_eq!(s.out_tile, [1, 7]);
                let on = |s: Shape| matches!(s.variant, Variant::Columns { .. });
                let sixteen = dtype != DType::F32;
                assert!(!on(small(960, 7, 1, false)), "unaligned");
                assert!(!on(small(576, 56, 1, true)), "56x56");
                assert_eq!(on(small(256, 20, 1, true)), sixteen, "20x20");
                assert!(on(small(256, 10, 1, true)), "10x10");
                // 64 x 480 channels at 7x7: 256 blocks of 2 warps, 3.9 warps an SM.
                assert_eq!(on(small(480, 7, 1, true)), sixteen, "7x7, few blocks");
                let forward = pass == Pass::Forward;
                assert_eq!(on(small(576, 14, 2, true)), sixteen && forward, "stride 2");
                assert!(!on(small(576, 24, 2, true)), "stride 2, 12x12 outputs");
            }
            // Vectors: as wide as the kernel and dtype allow and the channels divide.
            let vector = |c, aligned| {
                let v = variant(dtype, Pass::BackwardWeight, c, 3, 1, 90, aligned);
                match v {
                    Variant::Columns { vector } => vector,
                    _ => 0,
                }
            };
            let widest = if dtype == DType::F32 { 2 } else { 4 };
            assert_eq!(vector(36, true), widest);
            assert_eq!(vector(6, true), 2);
            assert_eq!(vector(17, true), 1);
            assert_eq!(vector(36, false), 1);
        }
    }

    /// The GPU tests' stride-2 column-walk case (`gpu_conv`, 96 x 384 channels 14x14 onto 7x7)
    /// runs on the walks in 16-bit on an H100/H200's 132 SMs; the 4-image case keeps its kernel.
    #[test]
    fn columns_take_16_bit_stride_2_forwards_that_fill_the_gpu() {
        let walks = |dtype, batch: usize, c: usize, hw: [usize; 2]| {
            let p = ConvParams::default()
                .groups(c)
                .strides(&[2])
                .padding_lo(&[1])
                .padding_hi(&[0]);
            let kk = key(
                dtype,
                Pass::Forward,
                &[batch, hw[0], hw[1], c],
                &[c, 3, 3, 1],
                &p,
            );
            let v = launch_for(&kk, 132, H100_SHARED).unwrap().shape.variant;
            matches!(v, Variant::Columns { .. })
        };
        for dtype in [DType::F16, DType::BF16] {
            assert!(walks(dtype, 96, 384, [14, 14]), "{dtype:?} 96 x 384");
            assert!(!walks(dtype, 4, 64, [13, 14]), "{dtype:?} 4 x 64");
        }
        assert!(!walks(DType::F32, 96, 384, [14, 14]), "f32 at stride 2");
    }

    #[test]
    fn columns_launches_cover_the_output_within_the_block_and_shared_memory() {
        let cases = [([3, 3], 1), ([3, 3], 2), ([2, 3], 1), ([7, 7], 2)];
        let sizes = [[1, 1], [5, 3], [7, 7], [33, 47], [112, 112], [9, 300]];
        for dtype in DType::ALL {
            for (kernel, stride) in cases {
                for c in [1, 6, 17, 36, 100, 1000] {
                    for size in sizes {
                        for (batch, sms) in [(1, 132), (64, 132), (3, 4)] {
                            for pass in Pass::ALL {
                                if pass == Pass::BackwardData && stride > 1 {
                                    continue;
                                }
                                let shape = (kernel, stride, c, size);
                                columns_launch_covers(dtype, pass, shape, batch, sms);
                            }
                        }
                    }
                }
            }
        }
    }

    /// `shape`: the kernel, stride, channels and image of a depthwise layer.
    #[allow(clippy::type_complexity)]
    fn columns_launch_covers(
        dtype: DType,
        pass: Pass,
        shape: ([usize; 2], usize, usize, [usize; 2]),
        batch: usize,
        sms: usize,
    ) {
        let (kernel, stride, c, size) = shape;
        let pad = kernel[0] / 2;
        let p = ConvParams::default()
            .groups(c)
            .strides(&[stride])
            .padding(&[pad]);
        let x = [batch, size[0], size[1], c];
        let w = [c, kernel[0], kernel[1], 1];
        let kk = key(dtype, pass, &x, &w, &p);
        assert!(columns_fit(&kk), "{kk:?}");
        let l = columns_launch(&kk, sms, H100_SHARED).unwrap();
        let Variant::Columns { vector } = l.shape.variant else {
            panic!("{kk:?}");
        };
        let pr = l.problem;
        assert_eq!(c % vector, 0, "{kk:?}");
        let (vectors, groups, _) = l.block;
        assert!(vectors * groups <= THREADS as u32, "{kk:?}");
        // Every channel, column and row is some tile's.
        let weight = pass == Pass::BackwardWeight;
        let chans = vectors as usize * vector;
        let chunks = pr.chunks as usize;
        assert!(chunks * chans >= c, "{kk:?}");
        assert!((chunks - 1) * chans < c, "{kk:?}");
        let tw = if weight {
            COLUMNS_TW
        } else {
            columns_output_tw(pr.out_w as usize)
        };
        assert_eq!(l.shape.out_tile, [1, tw]);
        assert_eq!(pr.tile_w as usize, groups as usize * tw);
        assert!(pr.tiles_w * pr.tile_w >= pr.out_w, "{kk:?}");
        assert!((pr.tiles_w - 1) * pr.tile_w < pr.out_w, "{kk:?}");
        assert!(pr.tiles_h * pr.tile_h >= pr.out_h, "{kk:?}");
        assert!((pr.tiles_h - 1) * pr.tile_h < pr.out_h, "{kk:?}");
        assert_eq!(pr.tiles, batch as i32 * pr.tiles_h * pr.tiles_w);
        let off = |d: usize| match pass {
            Pass::BackwardData => pad as i32 - (kernel[d] as i32 - 1),
            _ => -(pad as i32),
        };
        assert_eq!([pr.off_h, pr.off_w], [off(0), off(1)]);
        // Backward-weight: persistent blocks along x, each with a tile and one partial, chunks
        // along y. Forward and backward-data: a block a (chunk, tile).
        let taps = kernel[0] * kernel[1];
        if weight {
            assert!(l.grid.0 >= 1 && l.grid.0 as i32 <= pr.tiles, "{kk:?}");
            assert_eq!(l.grid.1 as usize, chunks);
            assert_eq!(l.splits, l.grid.0 as usize);
            assert_eq!(l.shared, groups as usize * taps * chans * 4);
            assert!(l.shared <= H100_SHARED);
        } else {
            assert_eq!(l.grid.0 as usize, pr.tiles as usize * chunks, "{kk:?}");
            assert_eq!(l.grid.1, 1);
            // Whole images: one segment.
            assert_eq!(pr.tiles_h, 1, "{kk:?}");
            assert_eq!((l.splits, l.shared), (1, 0));
            assert!(vector <= COLUMNS_OUTPUT_VECTOR);
        }
    }
}
