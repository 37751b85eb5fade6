//! The tensor-core variant's plan (`templates/conv_depthwise_tc.cu`): which layers it takes,
//! its shared memory (the staged source, its channel planes and the output planes), and its
//! tile and plane layout.

use crate::dtype::DType;
use crate::ops::conv::geometry::Pass;
use crate::ops::conv::plan::PlanKey;

use super::{Shape, THREADS, TILES_PER_BLOCK};

/// The first architecture whose `mma.sync` m16n8k16 takes both 16-bit types.
pub const TENSOR_ARCH: u32 = 80;

/// Channels a tensor-core block works on, and the outputs of one MMA row (a segment).
pub(super) const TENSOR_CHANNELS: usize = 16;
pub(super) const SEGMENT: usize = 8;
/// The widest tensor-core tile: its staged columns (plus a segment) are at most half the
/// block's threads, one thread pair a column.
const MAX_TENSOR_TILE_W: usize = THREADS as usize / 2 - SEGMENT;
/// The tensor-core kernel's launch bound (blocks an SM at least), the template's MIN_BLOCKS:
/// three for kernels of up to 5 rows, whose bands take fewer registers.
fn tensor_min_blocks(kernel_rows: usize) -> usize {
    if kernel_rows <= 5 {
        3
    } else {
        2
    }
}

/// Whether the tensor-core kernel takes `key` (which the family takes): 16-bit forward or
/// backward-data on sm_80 on, one output channel a group, a column stride of 1, channels in
/// whole 16-byte units and aligned operands, and offsets within one image of either operand
/// that fit the kernel's 32-bit arithmetic.
pub(super) fn takes_tensor(key: &PlanKey) -> bool {
    let g = &key.geometry;
    let image = |e: [usize; 3], c: usize| e.iter().product::<usize>() * c <= i32::MAX as usize;
    key.arch >= TENSOR_ARCH
        && matches!(key.dtype, DType::F16 | DType::BF16)
        && key.pass != Pass::BackwardWeight
        && g.cout == g.groups
        && g.stride[2] == 1
        && (key.pass == Pass::Forward || g.stride[1] == 1)
        && g.kernel[2] <= 9
        && key.aligned
        && (g.cin * key.dtype.size()) % 16 == 0
        && image(g.input, g.cin)
        && image(g.output, g.cout)
}

/// Elements between two channel planes of `cells` cells, as the tensor-core template spaces
/// them (8 past a multiple of 64: 4 words past a multiple of 32).
fn plane_stride(cells: usize) -> usize {
    cells.div_ceil(64) * 64 + 8
}

/// Elements of a tensor-core source plane for `rows` staged rows of `tile_w` outputs at row
/// stride `stride`, as `kiln_staged_of` lays it out: rows packed (`tile_w / 8 + 1` units of 8
/// elements a row), or with `split_halo` the rows' first `tile_w / 8` units packed and their
/// last units in a second region, each of `stride` classes of rows `span` units in both.
fn tensor_source_plane(rows: usize, tile_w: usize, stride: usize, split_halo: bool) -> usize {
    let per_row = tile_w / SEGMENT;
    if !split_halo {
        return rows * (tile_w + SEGMENT);
    }
    let span = (rows.div_ceil(stride) * per_row + 1).next_multiple_of(8);
    2 * stride * span * 8
}

/// Dynamic shared memory of a tensor-core block with a `tile` of outputs, as the template lays
/// it out: the weights, the raw copy of the tile's source (its rows, the tile's columns plus a
/// segment), the source's channel planes and the output planes.
pub(super) fn tensor_shared_bytes(s: Shape, tile: [usize; 2], split_halo: bool) -> usize {
    let rows = (tile[0] - 1) * s.stride[0] + s.kernel[0];
    let cols = tile[1] + SEGMENT;
    let weights = (TENSOR_CHANNELS * s.kernel[0] * s.kernel[1] * 2).next_multiple_of(16);
    let source = tensor_source_plane(rows, tile[1], s.stride[0], split_halo);
    let planes = plane_stride(source) + plane_stride(tile[0] * tile[1]);
    weights + rows * cols * TENSOR_CHANNELS * 2 + TENSOR_CHANNELS * 2 * planes
}

/// The tensor-core kernel's output tile over `out` (rows, columns) extents within `limit` bytes
/// of shared memory, and the blocks an SM then holds. Rows of up to [`MAX_TENSOR_TILE_W`]
/// outputs are one tile wide (wider ones split evenly), in whole segments. Of the heights whose blocks fit two an
/// SM, preferred: enough tiles that each block walks several, then the least shared-memory
/// traffic (a block's 128-byte wavefronts: the copy lands, is read and lands in the planes;
/// ldmatrix reads four a tap row and 16 segments; the outputs land and are read), counting
/// the segments and rows past the edges that a tile computes.
fn choose_tensor_tile(
    s: Shape,
    out: [usize; 2],
    images_x_chunks: usize,
    sms: usize,
    limit: usize,
    split_halo: bool,
) -> Option<([usize; 2], usize)> {
    let tw = out[1]
        .div_ceil(out[1].div_ceil(MAX_TENSOR_TILE_W))
        .next_multiple_of(SEGMENT);
    let min_blocks = tensor_min_blocks(s.kernel[0]);
    // (tile, enough tiles, cost)
    let mut best: Option<([usize; 2], bool, usize)> = None;
    for th in 1..=out[0].min(64) {
        let shared = tensor_shared_bytes(s, [th, tw], split_halo);
        if shared > limit || (limit + 1024) / (shared + 1024) < min_blocks {
            continue;
        }
        let rows = (th - 1) * s.stride[0] + s.kernel[0];
        let staged = rows * (tw + SEGMENT) * TENSOR_CHANNELS * 2;
        let mtiles = (th * tw / SEGMENT).div_ceil(16);
        let outputs = th * tw * TENSOR_CHANNELS * 2;
        let per_tile =
            3 * staged / 128 + mtiles * TENSOR_CHANNELS * s.kernel[0] * 4 + 2 * outputs / 128;
        let tiles = out[0].div_ceil(th) * out[1].div_ceil(tw) * images_x_chunks;
        let enough = tiles >= TILES_PER_BLOCK * min_blocks * sms;
        let cost = tiles * per_tile;
        let better = match best {
            None => true,
            Some((_, b_enough, b_cost)) => {
                (enough, std::cmp::Reverse(cost)) > (b_enough, std::cmp::Reverse(b_cost))
            }
        };
        if better {
            best = Some(([th, tw], enough, cost));
        }
    }
    // The driver's count, with the registers, replaces the launch bound when the plan is built
    // (`Launch::fill`).
    best.map(|(t, ..)| (t, min_blocks))
}

/// The tensor-core kernel's tile, blocks an SM and plane layout (`split_halo`). The split
/// layout reads the planes without bank conflicts but takes about twice their shared memory,
/// and its staging computes each unit's place: it is chosen where its tile stages at most two
/// source rows an output row, so that the products outweigh the staging. H100, 16-bit, split
/// planes everywhere against the packed kernel before them: 1.06-1.22x on seven 5x5 and 7x7
/// layers whose split tiles stage 1.4-2 rows an output row (64 x 240ch 56x56 5x5: 4 rows a
/// tile against 8 packed, 1.06x); 0.92-0.93x on 64ch 112x112 7x7 (3 rows against 5: 3 staged
/// an output row), which the rule keeps packed (0.98-1.00x). Batch 8 of 96ch 56x56 7x7 (2-row
/// tiles, packed under the rule) reads 0.93-0.97x with either layout: not the layout's loss.
pub(super) fn choose_tensor_launch(
    s: Shape,
    out: [usize; 2],
    images_x_chunks: usize,
    sms: usize,
    limit: usize,
) -> Option<([usize; 2], usize, bool)> {
    let split = choose_tensor_tile(s, out, images_x_chunks, sms, limit, true);
    if let Some((tile, per_sm)) = split {
        let staged = (tile[0] - 1) * s.stride[0] + s.kernel[0];
        if staged <= 2 * tile[0] {
            return Some((tile, per_sm, true));
        }
    }
    choose_tensor_tile(s, out, images_x_chunks, sms, limit, false)
        .map(|(tile, per_sm)| (tile, per_sm, false))
}

#[cfg(test)]
mod tests {
    use super::super::tests::H100_SHARED;
    use super::super::{launch_for, Variant};
    use super::*;
    use crate::ops::conv::geometry::{ConvParams, Geometry};
    use crate::ops::conv::plan::test_key as key;

    #[test]
    fn tensor_planes_split_where_tiles_stage_two_rows_an_output_row_at_most() {
        // (batch, channels, image, kernel): the split layout, or the packed one.
        let layout = |n: usize, c: usize, hw: usize, k: usize| {
            let p = ConvParams::default().groups(c).padding(&[k / 2]);
            let key = key(
                DType::F16,
                Pass::Forward,
                &[n, hw, hw, c],
                &[c, k, k, 1],
                &p,
            );
            let l = launch_for(&key, 132, H100_SHARED).unwrap();
            assert_eq!(l.shape.variant, Variant::Tensor);
            let staged = (l.problem.tile_h - 1) + k as i32;
            assert_eq!(l.problem.split_halo == 1, staged <= 2 * l.problem.tile_h);
            let split = l.problem.split_halo == 1;
            let tile = [l.problem.tile_h as usize, l.problem.tile_w as usize];
            assert_eq!(l.shared, tensor_shared_bytes(l.shape, tile, split));
            split
        };
        assert!(layout(32, 96, 56, 7));
        assert!(layout(64, 240, 28, 5));
        assert!(!layout(8, 96, 56, 7));
        assert!(!layout(16, 64, 112, 7));
        // The split planes take more shared memory for the same tile.
        let s = Shape::tensor(
            &Geometry::new(
                &[1, 56, 56, 96],
                &[96, 7, 7, 1],
                &ConvParams::default().groups(96),
            )
            .unwrap(),
        );
        assert!(tensor_shared_bytes(s, [8, 56], true) > tensor_shared_bytes(s, [8, 56], false));
    }

    #[test]
    fn tensor_cores_take_16_bit_stride_1_columns_with_whole_vectors() {
        // One kernel row of 5: the rows kernel takes kernels of 2-7 rows where the tensor-core
        // kernel would.
        let tensor = |dtype, pass, c: usize, mg, stride: [usize; 2], arch| {
            let p = ConvParams::default()
                .groups(c)
                .strides(&stride)
                .padding(&[2]);
            let k = PlanKey {
                arch,
                ..key(dtype, pass, &[2, 30, 70, c], &[c * mg, 1, 5, 1], &p)
            };
            launch_for(&k, 132, H100_SHARED).unwrap().shape.variant == Variant::Tensor
        };
        for dtype in [DType::F16, DType::BF16] {
            for pass in [Pass::Forward, Pass::BackwardData] {
                assert!(tensor(dtype, pass, 24, 1, [1, 1], 90));
                assert!(tensor(dtype, pass, 24, 1, [1, 1], 80));
                assert!(!tensor(dtype, pass, 24, 1, [1, 1], 75));
                assert!(
                    !tensor(dtype, pass, 20, 1, [1, 1], 90),
                    "channels not in 16-byte units"
                );
                assert!(
                    !tensor(dtype, pass, 24, 2, [1, 1], 90),
                    "a channel multiplier of 2"
                );
            }
            assert!(
                tensor(dtype, Pass::Forward, 24, 1, [2, 1], 90),
                "row stride 2"
            );
            assert!(
                !tensor(dtype, Pass::Forward, 24, 1, [1, 2], 90),
                "column stride 2"
            );
            assert!(!tensor(dtype, Pass::BackwardWeight, 24, 1, [1, 1], 90));
        }
        assert!(!tensor(DType::F32, Pass::Forward, 24, 1, [1, 1], 90));
    }

    #[test]
    fn tensor_tiles_fit_the_staging_threads_and_shared_memory() {
        for width in [1, 7, 14, 56, 112, 120, 121, 224, 1000] {
            // (Kernels of 2-7 rows are the rows kernel's.)
            for k in [1, 5, 7] {
                let p = ConvParams::default().groups(32).padding(&[0, k / 2]);
                let x = [4, 9, width, 32];
                let kk = key(DType::F16, Pass::Forward, &x, &[32, 1, k, 1], &p);
                let l = launch_for(&kk, 132, H100_SHARED).unwrap();
                assert_eq!(l.shape.variant, Variant::Tensor, "{kk:?}");
                let pr = l.problem;
                assert!(pr.tile_w as usize <= MAX_TENSOR_TILE_W && pr.tile_w % 8 == 0);
                assert!(pr.tiles_w * pr.tile_w >= pr.out_w && pr.tiles_h * pr.tile_h >= pr.out_h);
                assert!(l.shared * tensor_min_blocks(k) <= H100_SHARED + 1024);
                assert_eq!(l.grid.1 as usize, 32 / TENSOR_CHANNELS);
                // The template's plane stride: 8 past a multiple of 64, room for every cell.
                for cells in [1, 31, 32, 33, 64, 96, 97, 1000] {
                    let ps = plane_stride(cells);
                    assert!(ps >= cells && ps % 64 == 8, "{cells} {ps}");
                }
            }
        }
    }
}
