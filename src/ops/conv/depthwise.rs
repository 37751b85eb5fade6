//! The depthwise family (`templates/conv_depthwise.cu`): 1-D and 2-D depthwise convolutions
//! (one input channel a group, a channel multiplier of 1, 2 or 4) as stencils over shared-memory
//! tiles. A block works on 32 channels and walks tiles of outputs, copying the next tile's source
//! rows into shared memory (asynchronously, as they are in memory) while it computes this one;
//! each lane computes one channel's outputs, a few at a time, with the kernel's taps unrolled and
//! a window of source columns in registers. Such layers move more bytes than they multiply, so
//! the family's aim is to read each operand about once and keep the per-tap work out of the
//! inner loop. Every dtype, every architecture kiln runs on.
//!
//! It takes kernels up to [`MAX_KERNEL`] taps a side, strides up to [`MAX_STRIDE`] (1 for
//! backward-data) and no dilation; the direct family takes the other grouped layers. Specs are
//! specialised by kernel, stride and channel multiplier: [`specs`] lists the common ones
//! (`kiln warm` compiles those); any other compiles on its first use.

use crate::dtype::DType;
use crate::env::ConvPath;
use crate::jit::{KernelSpec, TemplateDef};
use crate::runtime::Device;

use super::geometry::{Geometry, Pass};
use super::plan::{persistent_grid, tile_limits, PlanKey};

pub static DEPTHWISE: TemplateDef = TemplateDef {
    name: "conv_depthwise",
    source: include_str!("../../../templates/conv_depthwise.cu"),
    kernel: "kiln_conv_depthwise",
    const_names: &["PASS", "MG", "KH", "KW", "SH", "SW", "OTH", "OTW"],
    arch_specific: false,
    only_arch: None,
};

/// Threads a block: 32 channel lanes x 8 warps.
pub const THREADS: u16 = 256;
const LANES: usize = 32;
const WARPS: usize = THREADS as usize / LANES;
pub const MAX_KERNEL: usize = 7;
pub const MAX_STRIDE: usize = 2;
/// Output channels a group (channel multipliers) the family takes.
pub const MULTIPLIERS: [usize; 3] = [1, 2, 4];
/// What a spec is specialised by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Output channels a group.
    pub mg: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    /// Outputs a warp computes at a time: `out_tile[0]` rows of `out_tile[1]`.
    pub out_tile: [usize; 2],
}

impl Shape {
    fn of(g: &Geometry) -> Shape {
        // 1-D layers (one row) take 8 outputs along the row; 2-D ones 4 x 4, which reads each
        // staged value once per 4 (stride 1) outputs it serves and fits the 7x7 kernel's taps,
        // sums and window in registers.
        // Stride 2 takes 2 x 4: its source rows are twice as many, and a block's eight warps
        // still get a sub-tile each from a tile whose source fits.
        let one_row = g.input[1] == 1 && g.kernel[1] == 1;
        let out_tile = match (one_row, g.stride[1]) {
            (true, _) => [1, 8],
            (false, 1) => [4, 4],
            _ => [2, 4],
        };
        Shape {
            mg: g.cout / g.groups,
            kernel: [g.kernel[1], g.kernel[2]],
            stride: [g.stride[1], g.stride[2]],
            out_tile,
        }
    }

    /// Blocks an SM must hold: the template's launch bound MIN_BLOCKS, by kernel size.
    fn min_blocks(&self) -> usize {
        match self.kernel[0] * self.kernel[1] {
            0..=9 => 4,
            10..=25 => 3,
            _ => 2,
        }
    }

    /// Channels staged a pixel (the template's PER) and planes they lie in (PLANES).
    fn staged(&self, pass: Pass) -> (usize, usize) {
        if pass == Pass::BackwardData {
            (LANES * self.mg, self.mg)
        } else {
            (LANES / self.mg, 1)
        }
    }
}

pub fn spec(dtype: DType, pass: Pass, s: Shape) -> KernelSpec {
    KernelSpec::new(
        &DEPTHWISE,
        dtype,
        THREADS,
        1,
        &[
            pass as i32,
            s.mg as i32,
            s.kernel[0] as i32,
            s.kernel[1] as i32,
            s.stride[0] as i32,
            s.stride[1] as i32,
            s.out_tile[0] as i32,
            s.out_tile[1] as i32,
        ],
    )
}

/// The common 2-D depthwise layers `kiln warm` compiles: square 3x3, 5x5 and 7x7 kernels at
/// strides 1 and 2 (MobileNet, EfficientNet, ConvNeXt), and channel multiplier 2 at stride 1
/// for 3x3 and 5x5; backward-data at stride 1.
pub fn specs() -> Vec<KernelSpec> {
    let mut shapes = Vec::new();
    for k in [3, 5, 7] {
        for s in [1, 2] {
            shapes.push((1, k, s));
        }
    }
    shapes.extend([(2, 3, 1), (2, 5, 1)]);
    let mut out = Vec::new();
    for dtype in DType::ALL {
        for pass in Pass::ALL {
            for &(mg, k, s) in &shapes {
                if pass == Pass::BackwardData && s > 1 {
                    continue;
                }
                let shape = Shape {
                    mg,
                    kernel: [k, k],
                    stride: [s, s],
                    out_tile: if s == 1 { [4, 4] } else { [2, 4] },
                };
                out.push(spec(dtype, pass, shape));
            }
        }
    }
    out
}

/// Why the family does not take `key`, or None.
pub fn unsupported(path: ConvPath, key: &PlanKey) -> Option<&'static str> {
    let g = &key.geometry;
    if path == ConvPath::Igemm {
        return Some("KILN_CONV_PATH=igemm");
    }
    if g.groups != g.cin || g.groups < 1 {
        return Some("not depthwise");
    }
    if !MULTIPLIERS.contains(&(g.cout / g.groups)) {
        return Some("a channel multiplier the family does not take");
    }
    tile_limits(key, MAX_KERNEL, MAX_STRIDE)
}

/// The kernel's view of a problem: `struct kiln_depthwise` in the template.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Problem {
    pub batch: i32,
    pub src_h: i32,
    pub src_w: i32,
    pub src_c: i32,
    pub out_h: i32,
    pub out_w: i32,
    pub out_c: i32,
    pub off_h: i32,
    pub off_w: i32,
    pub tile_h: i32,
    pub tile_w: i32,
    pub tiles_h: i32,
    pub tiles_w: i32,
    pub tiles: i32,
    pub chunks: i32,
    pub reverse: i32,
    pub vec_src: i32,
    pub vec_dy: i32,
    pub tiles_per_split: i32,
}

/// A plan's launch: the problem, the grid, dynamic shared memory, and the splits of
/// backward-weight's sum (one f32 partial a block along x).
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    pub pass: Pass,
    pub shape: Shape,
    pub problem: Problem,
    pub grid: (u32, u32, u32),
    pub shared: usize,
    pub splits: usize,
}

/// Dynamic shared memory of a block with a `tile` of outputs, as the template lays it out:
/// forward and backward-data the weights as f32, then two tile buffers (the source rows, and
/// for backward-weight the cotangent) as they are in memory; backward-weight reuses them for
/// its warps' sums.
pub fn shared_bytes(dtype: DType, pass: Pass, s: Shape, tile: [usize; 2]) -> usize {
    let (per, planes) = s.staged(pass);
    let rows = (tile[0] - 1) * s.stride[0] + s.kernel[0];
    let cols = (tile[1] - 1) * s.stride[1] + s.kernel[1];
    let taps = s.kernel[0] * s.kernel[1];
    let mut buffer = rows * cols * per;
    if pass == Pass::BackwardWeight {
        buffer += tile[0] * tile[1] * LANES;
    }
    let buffers = 2 * buffer * dtype.size();
    match pass {
        Pass::BackwardWeight => buffers.max(WARPS * taps * LANES * 4),
        _ => planes * taps * LANES * 4 + buffers,
    }
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
) -> Option<([usize; 2], usize)> {
    let [oth, otw] = s.out_tile;
    let (per, _) = s.staged(pass);
    let taps = s.kernel[0] * s.kernel[1];
    // (tile, blocks an SM, full warps, enough tiles, cost)
    let mut best: Option<([usize; 2], usize, bool, bool, usize)> = None;
    for th in (oth..=out[0].next_multiple_of(oth).min(32)).step_by(oth) {
        for tw in (otw..=out[1].next_multiple_of(otw).min(64)).step_by(otw) {
            let shared = shared_bytes(dtype, pass, s, [th, tw]);
            let per_sm = blocks_per_sm(s, shared, limit);
            if shared > limit || per_sm < 2 && best.is_some() {
                continue;
            }
            let subs = (th / oth) * (tw / otw);
            let full = subs >= WARPS;
            let tiles = out[0].div_ceil(th) * out[1].div_ceil(tw) * images_x_chunks;
            let enough = tiles >= TILES_PER_BLOCK * per_sm * sms;
            let rows = (th - 1) * s.stride[0] + s.kernel[0];
            let cols = (tw - 1) * s.stride[1] + s.kernel[1];
            let slots = subs.div_ceil(WARPS) * WARPS * oth * otw;
            let cost = tiles * (rows * cols * per * 2 + slots * LANES * taps);
            let better = match best {
                None => true,
                Some((_, b_sm, b_full, b_enough, b_cost)) => {
                    (per_sm >= 2, full, enough, std::cmp::Reverse(cost))
                        > (b_sm >= 2, b_full, b_enough, std::cmp::Reverse(b_cost))
                }
            };
            if better {
                best = Some(([th, tw], per_sm, full, enough, cost));
            }
        }
    }
    best.map(|(t, per_sm, ..)| (t, per_sm.max(1)))
}

/// Tiles a block should walk at least, where the layer has them, so that copies overlap work.
const TILES_PER_BLOCK: usize = 3;

/// The launch of `key` on `sms` multiprocessors with `limit` bytes of shared memory a block, or
/// None where the family does not take it or no tile fits.
pub fn launch_for(key: &PlanKey, sms: usize, limit: usize) -> Option<Launch> {
    if unsupported(ConvPath::Auto, key).is_some() {
        return None;
    }
    let g = &key.geometry;
    let pass = key.pass;
    let dtype = key.dtype;
    let shape = Shape::of(g);
    // The gather's output and source: extents, channels; the source position of output 0's
    // tap 0 along each dim.
    let (out, src, out_c, src_c) = match pass {
        Pass::BackwardData => (g.input, g.output, g.cin, g.cout),
        _ => (g.output, g.input, g.cout, g.cin),
    };
    let off = |d: usize| match pass {
        Pass::BackwardData => g.pad_lo[d] as i64 - (g.kernel[d] as i64 - 1),
        _ => -(g.pad_lo[d] as i64),
    };
    let chunks = out_c.div_ceil(LANES);
    let sms = sms.max(1);
    let (tile, per_sm) = choose_tile(
        dtype,
        pass,
        shape,
        [out[1], out[2]],
        g.batch * chunks,
        sms,
        limit,
    )?;
    let blocks = per_sm * sms;
    let tiles_h = out[1].div_ceil(tile[0]);
    let tiles_w = out[2].div_ceil(tile[1]);
    let tiles = g.batch * tiles_h * tiles_w;
    let (blocks_x, splits, per_split) = persistent_grid(pass, blocks, chunks, tiles);
    if tiles == 0 || tiles > i32::MAX as usize || chunks > 65535 {
        return None;
    }
    let vec = |c: usize| key.aligned && (c * dtype.size()) % 16 == 0;
    let problem = Problem {
        batch: g.batch as i32,
        src_h: src[1] as i32,
        src_w: src[2] as i32,
        src_c: src_c as i32,
        out_h: out[1] as i32,
        out_w: out[2] as i32,
        out_c: out_c as i32,
        off_h: off(1) as i32,
        off_w: off(2) as i32,
        tile_h: tile[0] as i32,
        tile_w: tile[1] as i32,
        tiles_h: tiles_h as i32,
        tiles_w: tiles_w as i32,
        tiles: tiles as i32,
        chunks: chunks as i32,
        // Backward-data walks the taps backwards: its weight tap is reversed unless flipped.
        reverse: (g.flip != (pass == Pass::BackwardData)) as i32,
        vec_src: vec(src_c) as i32,
        vec_dy: (pass == Pass::BackwardWeight && vec(out_c)) as i32,
        tiles_per_split: per_split as i32,
    };
    Some(Launch {
        pass,
        shape,
        problem,
        grid: (blocks_x as u32, chunks as u32, 1),
        shared: shared_bytes(dtype, pass, shape, tile),
        splits,
    })
}

/// The spec and launch that run `key`, or None where the family does not take it.
pub fn plan(device: &Device, path: ConvPath, key: &PlanKey) -> Option<(KernelSpec, Launch)> {
    if unsupported(path, key).is_some() {
        return None;
    }
    let sms = device.info().multiprocessors as usize;
    let launch = launch_for(key, sms, device.shared_limit())?;
    Some((spec(key.dtype, key.pass, launch.shape), launch))
}

#[cfg(test)]
mod tests {
    use super::super::geometry::ConvParams;
    use super::super::plan::test_key as key;
    use super::*;

    const H100_SHARED: usize = 227 * 1024;

    fn depthwise(
        c: usize,
        mg: usize,
        size: [usize; 2],
        k: usize,
        stride: usize,
    ) -> (Vec<usize>, Vec<usize>, ConvParams) {
        let p = ConvParams::default()
            .groups(c)
            .strides(&[stride])
            .padding(&[k / 2]);
        (vec![2, size[0], size[1], c], vec![c * mg, k, k, 1], p)
    }

    #[test]
    fn takes_depthwise_layers_only() {
        let f16 = DType::F16;
        for pass in Pass::ALL {
            for mg in MULTIPLIERS {
                let (x, w, p) = depthwise(24, mg, [9, 9], 3, 1);
                assert_eq!(
                    unsupported(ConvPath::Auto, &key(f16, pass, &x, &w, &p)),
                    None
                );
                assert!(unsupported(ConvPath::Igemm, &key(f16, pass, &x, &w, &p)).is_some());
            }
        }
        let (x, w, p) = depthwise(24, 3, [9, 9], 3, 1);
        assert!(unsupported(ConvPath::Auto, &key(f16, Pass::Forward, &x, &w, &p)).is_some());
        let (x, w, p) = depthwise(24, 1, [9, 9], 9, 1);
        assert!(unsupported(ConvPath::Auto, &key(f16, Pass::Forward, &x, &w, &p)).is_some());
        // Strided backward-data is the direct family's; strided forward is this one's.
        let (x, w, p) = depthwise(24, 1, [9, 9], 3, 2);
        assert!(unsupported(ConvPath::Auto, &key(f16, Pass::BackwardData, &x, &w, &p)).is_some());
        assert_eq!(
            unsupported(ConvPath::Auto, &key(f16, Pass::Forward, &x, &w, &p)),
            None
        );
        let grouped = ConvParams::default().groups(12).padding(&[1]);
        let k = key(f16, Pass::Forward, &[2, 9, 9, 24], &[24, 3, 3, 2], &grouped);
        assert!(unsupported(ConvPath::Auto, &k).is_some());
        let dilated = ConvParams::default().groups(24).kernel_dilation(&[2]);
        let k = key(f16, Pass::Forward, &[2, 9, 9, 24], &[24, 3, 3, 1], &dilated);
        assert!(unsupported(ConvPath::Auto, &k).is_some());
    }

    #[test]
    fn the_common_layers_are_listed() {
        let all = specs();
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                for (k, s) in [(3, 1), (3, 2), (5, 1), (5, 2), (7, 1)] {
                    if pass == Pass::BackwardData && s > 1 {
                        continue;
                    }
                    let (x, w, p) = depthwise(96, 1, [56, 56], k, s);
                    let l = launch_for(&key(dtype, pass, &x, &w, &p), 132, H100_SHARED).unwrap();
                    assert!(
                        all.contains(&spec(dtype, pass, l.shape)),
                        "{k} {s} {pass:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn launches_fit_shared_memory_and_cover_the_output() {
        let sizes = [[1, 1], [5, 3], [14, 14], [56, 56], [112, 112], [1, 300]];
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                for mg in MULTIPLIERS {
                    for k in [1, 3, 5, 7] {
                        for size in sizes {
                            let kh = if size[0] == 1 { 1 } else { k };
                            let p = ConvParams::default()
                                .groups(40)
                                .padding_lo(&[kh / 2, k / 2]);
                            let p = p.padding_hi(&[kh / 2, k / 2]);
                            let x = [3, size[0], size[1], 40];
                            let w = [40 * mg, kh, k, 1];
                            let kk = key(dtype, pass, &x, &w, &p);
                            let l = launch_for(&kk, 132, H100_SHARED).unwrap();
                            let pr = l.problem;
                            assert!(l.shared <= H100_SHARED, "{kk:?}");
                            assert_eq!(pr.tile_h as usize % l.shape.out_tile[0], 0);
                            assert_eq!(pr.tile_w as usize % l.shape.out_tile[1], 0);
                            assert!(pr.tiles_h * pr.tile_h >= pr.out_h, "{kk:?}");
                            assert!(pr.tiles_w * pr.tile_w >= pr.out_w, "{kk:?}");
                            assert_eq!(pr.tiles, 3 * pr.tiles_h * pr.tiles_w);
                            assert_eq!(l.grid.1 as i32, pr.chunks);
                            if pass == Pass::BackwardWeight {
                                // Every split has a tile; all tiles are covered.
                                let s = l.splits as i32;
                                assert!((s - 1) * pr.tiles_per_split < pr.tiles, "{kk:?}");
                                assert!(s * pr.tiles_per_split >= pr.tiles, "{kk:?}");
                            } else {
                                assert!(l.grid.0 >= 1 && l.grid.0 as i32 <= pr.tiles);
                                // One wave: no more blocks than the SMs hold at once.
                                let blocks = l.grid.0 * l.grid.1;
                                assert!(blocks <= 4 * 132 || l.grid.0 == 1, "{kk:?}");
                            }
                        }
                    }
                }
            }
        }
    }
}
