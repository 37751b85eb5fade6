//! The FMA stencil's tiles (`templates/conv_depthwise.cu`): the sub-tile a warp computes, the
//! output tile a block stages within shared memory, and where backward-weight takes the wide
//! sub-tile instead of the square one.

use crate::dtype::DType;
use crate::ops::conv::geometry::Pass;

use super::{shared_bytes, Shape, Variant, LANES, TILES_PER_BLOCK, WARPS};

/// The stencil's outputs a warp computes at a time (OTH x OTW). 1-D layers (one row) take 8
/// along the row; 2-D ones 4 x 4, which reads each staged value once per 4 (stride 1) outputs
/// it serves and fits the 7x7 kernel's taps, sums and window in registers. The forward and
/// backward-weight at stride 2 take 2 x 4: their source rows are twice as many, and a block's
/// eight warps still get a sub-tile each from a tile whose source fits. Backward-data's
/// sub-tiles start on real rows and columns of the spread cotangent: whole strides (4 x 4, and
/// 1 x 8 only for rows of stride 1).
pub(super) fn stencil_tile(pass: Pass, one_row: bool, stride: [usize; 2]) -> [usize; 2] {
    match (pass, one_row, stride[0]) {
        (Pass::BackwardData, true, 1) => [1, 8],
        (Pass::BackwardData, ..) => [4, 4],
        (_, true, _) => [1, 8],
        (_, false, 1) => [4, 4],
        _ => [2, 4],
    }
}

/// A second sub-tile for backward-weight of 5x5 to 7x7 kernels at stride 1 (2-D, one output
/// channel a group): 4 x 7 outputs a warp. Tiles 28 or 56 outputs wide then give each of a
/// block's eight warps a sub-tile, where 4 x 4 left two of 16 slots idle (8 x 28 tiles: 14
/// sub-tiles), and each staged value serves 7 outputs of a row instead of 4. The plan takes it
/// where its best tile beats the best square one by a rule measured on the H100
/// (`wide_tile_wins`).
pub const WIDE_TILE: [usize; 2] = [4, 7];

/// Whether `pass` of the stencil shape `s` may take [`WIDE_TILE`].
pub(super) fn takes_wide_tile(pass: Pass, s: &Shape) -> bool {
    pass == Pass::BackwardWeight
        && s.variant == Variant::Stencil
        && s.mg == 1
        && s.stride == [1, 1]
        && s.kernel[0] >= 5
        && s.kernel[1] >= 5
        && s.out_tile == [4, 4]
}

/// Blocks of `shared` bytes an SM holds, with the kernel's launch bound: an SM has about
/// `limit` (a block's most) plus 1 KiB, and reserves 1 KiB a block.
fn blocks_per_sm(s: Shape, shared: usize, limit: usize) -> usize {
    ((limit + 1024) / (shared + 1024)).min(s.min_blocks())
}

/// The output tile of `pass` over `out` (rows, columns) extents within `limit` bytes of shared
/// memory, and the blocks an SM then holds. Preferred, in order: tiles that give each of a
/// block's warps a sub-tile; enough tiles that each block walks several (`want` blocks of
/// TILES_PER_BLOCK), where any does; the least work, counting each staged value as two FMAs of
/// a lane (its share of a copy, the window's read and conversion) and each output slot a warp
/// computes, used or idle, as its taps; two blocks an SM at least.
fn choose_tile(
    dtype: DType,
    pass: Pass,
    s: Shape,
    out: [usize; 2],
    images_x_chunks: usize,
    sms: usize,
    limit: usize,
) -> Option<TileChoice> {
    let [oth, otw] = s.out_tile;
    let (per, _) = s.staged(pass);
    let taps = s.kernel[0] * s.kernel[1];
    let mut best: Option<TileChoice> = None;
    for th in (oth..=out[0].next_multiple_of(oth).min(32)).step_by(oth) {
        for tw in (otw..=out[1].next_multiple_of(otw).min(64)).step_by(otw) {
            let shared = shared_bytes(dtype, pass, s, [th, tw], false);
            let per_sm = blocks_per_sm(s, shared, limit);
            if shared > limit || per_sm < 2 && best.is_some() {
                continue;
            }
            let subs = (th / oth) * (tw / otw);
            let full = subs >= WARPS;
            let tiles = out[0].div_ceil(th) * out[1].div_ceil(tw) * images_x_chunks;
            let enough = tiles >= TILES_PER_BLOCK * per_sm * sms;
            let [rows, cols] = s.source_extent(pass, [th, tw]);
            let staged = tiles * rows * cols;
            let slots = tiles * subs.div_ceil(WARPS) * WARPS * oth * otw;
            let choice = TileChoice {
                tile: [th, tw],
                per_sm,
                full,
                enough,
                cost: staged * per * 2 + slots * LANES * taps,
                staged,
                slots,
            };
            if best.map_or(true, |b| choice.rank() > b.rank()) {
                best = Some(choice);
            }
        }
    }
    best.map(|b| TileChoice {
        per_sm: b.per_sm.max(1),
        ..b
    })
}

/// A stencil tile [`choose_tile`] found, with what it ranks tiles by.
#[derive(Clone, Copy, Debug)]
pub(super) struct TileChoice {
    pub(super) tile: [usize; 2],
    /// Blocks an SM holds.
    pub(super) per_sm: usize,
    /// Every warp of a block has a sub-tile.
    full: bool,
    /// Enough tiles that each block walks several.
    enough: bool,
    /// The model's work (see `choose_tile`).
    cost: usize,
    /// Source values a lane stages over every tile.
    staged: usize,
    /// Outputs the warps compute over every tile, idle sub-tile slots of a block's last round
    /// included.
    slots: usize,
}

impl TileChoice {
    /// Larger is better: two blocks an SM, full warps, enough tiles, then the least work.
    fn rank(&self) -> (bool, bool, bool, std::cmp::Reverse<usize>) {
        (
            self.per_sm >= 2,
            self.full,
            self.enough,
            std::cmp::Reverse(self.cost),
        )
    }
}

/// The stencil's shape and tile for `pass` of `s` (see [`choose_tile`]): backward-weight that
/// may take [`WIDE_TILE`] compares the best tile of each sub-tile (see [`wide_tile_wins`]).
pub(super) fn choose_stencil_tile(
    dtype: DType,
    pass: Pass,
    s: Shape,
    out: [usize; 2],
    images_x_chunks: usize,
    sms: usize,
    limit: usize,
) -> Option<(Shape, TileChoice)> {
    let choose =
        |s: Shape| choose_tile(dtype, pass, s, out, images_x_chunks, sms, limit).map(|c| (s, c));
    let square = choose(s);
    if !takes_wide_tile(pass, &s) {
        return square;
    }
    let wide = choose(Shape {
        out_tile: WIDE_TILE,
        ..s
    });
    match (square, wide) {
        (Some(a), Some(b)) => Some(if wide_tile_wins(&a.1, &b.1) { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// Whether the best [`WIDE_TILE`] tile beats the best 4 x 4 one. Measured on the H100 over 45
/// layers with 5x5 and 7x7 kernels, every dtype, each both ways (`choose_tile`'s FMA count had
/// ranked 4 x 4 first on layers that ran up to 1.19x faster on 4 x 7):
/// - Where wide tiles give every warp a sub-tile (16-bit), they ran 1.03-1.20x as fast where
///   their output slots (idle ones in a block's last round included) are at most 5% more than
///   the square tiles', and 0.92-1.02x at 9-75% more; but they beat the square 5x5 spec bound
///   to three blocks an SM (80 registers) at up to 17% more slots (1.02-1.18x). None that
///   staged 20% or more source values won (0.92-0.95x at 20% more, 0.82x at 41%).
/// - Where they leave warps idle (f32: its full wide tiles do not fit two blocks' shared
///   memory) but the square ones do not, the copy bounds the block: 1.01-1.20x where they stage
///   8-31% fewer source values, 0.77-0.92x where they stage 5-30% more.
/// - Where the square tiles leave warps idle too (images of 7 rows), the wide sub-tile's longer
///   walk is the block's critical path: 0.78-0.81x.
fn wide_tile_wins(square: &TileChoice, wide: &TileChoice) -> bool {
    let at_most = |a: usize, b: usize, percent: usize| a * 100 <= b * percent;
    let wins = match (wide.full, square.full) {
        (true, _) => {
            at_most(wide.staged, square.staged, 119)
                && (at_most(wide.slots, square.slots, 105) || square.per_sm >= 3)
        }
        (false, true) => at_most(wide.staged, square.staged, 92),
        (false, false) => false,
    };
    wins && wide.per_sm >= 2
}

#[cfg(test)]
mod tests {
    use super::super::launch_for;
    use super::super::tests::H100_SHARED;
    use super::*;
    use crate::ops::conv::geometry::ConvParams;
    use crate::ops::conv::plan::test_key as key;

    #[test]
    fn backward_weight_takes_wide_sub_tiles_where_they_ran_faster() {
        let tile = |dtype, pass, (n, c, size, k): (usize, usize, usize, usize)| {
            let p = ConvParams::default().groups(c).padding(&[k / 2]);
            let kk = key(dtype, pass, &[n, size, size, c], &[c, k, k, 1], &p);
            let l = launch_for(&kk, 132, H100_SHARED).unwrap();
            (
                l.shape.variant,
                l.shape.out_tile,
                [l.problem.tile_h, l.problem.tile_w],
            )
        };
        let weight = Pass::BackwardWeight;
        // 56 columns: 8 x 28 tiles, 14 square sub-tiles for 8 warps, or 8 wide ones.
        let wide = (Variant::Stencil, WIDE_TILE, [8, 28]);
        assert_eq!(tile(DType::F16, weight, (64, 240, 56, 5)), wide);
        assert_eq!(tile(DType::BF16, weight, (32, 96, 56, 7)), wide);
        let sub_tile = |dtype, layer| {
            let (v, t, _) = tile(dtype, weight, layer);
            (v, t)
        };
        let (square, wide) = ((Variant::Stencil, [4, 4]), (Variant::Stencil, WIDE_TILE));
        // Square tiles of 3 blocks an SM; wide ones of as many output slots (112- and 96-wide
        // images), or fewer (a 50-wide image: 4 x 56 tiles against 4 x 52, 13 square sub-tiles).
        for layer in [
            (24, 176, 40, 5),
            (64, 112, 20, 5),
            (16, 64, 112, 7),
            (4, 192, 96, 7),
            (16, 144, 50, 5),
        ] {
            assert_eq!(sub_tile(DType::F16, layer), wide, "{layer:?}");
        }
        // Wide tiles of 9-75% more slots (12-, 19-, 30- and 36-wide images) or 23% more staged
        // values (38 wide), and 7x7 images, whose square tiles leave warps idle too.
        for layer in [
            (20, 512, 12, 7),
            (32, 576, 19, 7),
            (32, 136, 30, 7),
            (16, 320, 36, 5),
            (32, 288, 38, 5),
            (64, 1152, 7, 5),
        ] {
            assert_eq!(sub_tile(DType::F16, layer), square, "{layer:?}");
        }
        // f32: its wide tiles leave warps idle, so they must stage fewer values.
        for layer in [(64, 112, 20, 5), (32, 128, 56, 7), (16, 320, 36, 5)] {
            assert_eq!(sub_tile(DType::F32, layer), wide, "{layer:?}");
        }
        for layer in [
            (32, 144, 30, 5),
            (20, 512, 12, 7),
            (8, 96, 56, 7),
            (64, 1152, 7, 5),
        ] {
            assert_eq!(sub_tile(DType::F32, layer), square, "{layer:?}");
        }
        // The other passes keep their sub-tiles.
        for pass in [Pass::Forward, Pass::BackwardData] {
            assert_ne!(tile(DType::F16, pass, (64, 240, 56, 5)).1, WIDE_TILE);
            assert_ne!(tile(DType::F32, pass, (64, 112, 20, 5)).1, WIDE_TILE);
        }
    }
}
