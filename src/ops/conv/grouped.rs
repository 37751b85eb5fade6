//! The grouped family (`templates/conv_grouped.cu`): grouped convolutions with few channels a
//! group (2 to 32 input channels a group, as many output channels: ResNeXt, RegNet) in f16 and
//! bf16 on tensor cores. A block works on 64 channels and walks tiles of outputs, copying the
//! next tile's source pixels into shared memory while it multiplies this one with `mma.sync`;
//! each group's weights between 16 output channels and the source channels they read are a
//! block-diagonal 16 x 16 matrix (two dense ones for 32-channel groups), so one code path takes
//! every group width and the zeros cost only MMAs, which such layers have to spare.
//!
//! It takes 1-D and 2-D layers with kernels up to [`MAX_KERNEL`] taps a side, strides up to
//! [`MAX_STRIDE`] (1 for backward-data) and no dilation, on GPUs with 16-bit tensor cores for
//! the dtype from sm_80 on. The direct family takes the other grouped layers (f32, older GPUs,
//! wider kernels, strided backward-data). [`specs`] lists the common specs (`kiln warm`
//! compiles those); any other compiles on its first use.

use crate::dtype::DType;
use crate::env::ConvPath;
use crate::jit::{KernelSpec, TemplateDef};
use crate::runtime::Device;

use super::geometry::{Geometry, Pass};
use super::plan::{persistent_grid, tile_limits, PlanKey};

pub static GROUPED: TemplateDef = TemplateDef {
    name: "conv_grouped",
    source: include_str!("../../../templates/conv_grouped.cu"),
    kernel: "kiln_conv_grouped",
    const_names: &["PASS", "CG", "KH", "KW", "SH", "SW"],
    arch_specific: false,
    only_arch: None,
};

/// Threads a block: 8 warps, two a 16-channel chunk.
pub const THREADS: u16 = 256;
/// Channels a block works on (four 16-channel chunks).
const CHANNELS: usize = 64;
/// Elements a staged pixel takes in shared memory: its 64 channels and 16 bytes of padding.
const PITCH: usize = CHANNELS + 8;
pub const MAX_KERNEL: usize = 3;
pub const MAX_STRIDE: usize = 2;
/// Channels a group the family takes (input and output alike).
pub const GROUP_WIDTHS: [usize; 5] = [2, 4, 8, 16, 32];
/// The first architecture whose `mma.sync` m16n8k16 takes both 16-bit types.
pub const MIN_ARCH: u32 = 80;

/// What a spec is specialised by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Channels a group.
    pub cg: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
}

impl Shape {
    fn of(g: &Geometry) -> Shape {
        Shape {
            cg: g.cin / g.groups,
            kernel: [g.kernel[1], g.kernel[2]],
            stride: [g.stride[1], g.stride[2]],
        }
    }

    /// Source channels a 16-channel output chunk reads, in chunks of 16 (the template's KC).
    fn k_chunks(&self) -> usize {
        self.cg.max(16) / 16
    }

    /// Blocks an SM must hold: the template's launch bound MIN_BLOCKS.
    fn min_blocks(&self, pass: Pass) -> usize {
        if pass == Pass::BackwardWeight && self.k_chunks() > 1 {
            2
        } else {
            3
        }
    }
}

pub fn spec(dtype: DType, pass: Pass, s: Shape) -> KernelSpec {
    KernelSpec::new(
        &GROUPED,
        dtype,
        THREADS,
        1,
        &[
            pass as i32,
            s.cg as i32,
            s.kernel[0] as i32,
            s.kernel[1] as i32,
            s.stride[0] as i32,
            s.stride[1] as i32,
        ],
    )
}

/// The common grouped layers `kiln warm` compiles: 3x3 at strides 1 and 2 (backward-data at
/// stride 1) with 4, 8, 16 and 32 channels a group (ResNeXt, RegNet), f16 and bf16.
pub fn specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for pass in Pass::ALL {
            for cg in [4, 8, 16, 32] {
                for s in [1, 2] {
                    if pass == Pass::BackwardData && s > 1 {
                        continue;
                    }
                    let shape = Shape {
                        cg,
                        kernel: [3, 3],
                        stride: [s, s],
                    };
                    out.push(spec(dtype, pass, shape));
                }
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
    if !matches!(key.dtype, DType::F16 | DType::BF16) || key.arch < MIN_ARCH {
        return Some("no 16-bit tensor cores of the kind the family uses");
    }
    if g.groups < 2 || g.cin % g.groups != 0 || g.cout != g.cin {
        return Some("not a grouped layer with as many output as input channels");
    }
    if !GROUP_WIDTHS.contains(&(g.cin / g.groups)) {
        return Some("a group width the family does not take");
    }
    tile_limits(key, MAX_KERNEL, MAX_STRIDE)
}

/// The kernel's view of a problem: `struct kiln_grouped` in the template.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Problem {
    pub batch: i32,
    pub src_h: i32,
    pub src_w: i32,
    pub out_h: i32,
    pub out_w: i32,
    pub chans: i32,
    pub off_h: i32,
    pub off_w: i32,
    pub tile_h: i32,
    pub tile_w: i32,
    pub tiles_h: i32,
    pub tiles_w: i32,
    pub tiles: i32,
    pub reverse: i32,
    pub vec: i32,
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

/// Staged slots of a tile's source: rows x (columns rounded up to whole stride phases).
fn source_slots(s: Shape, tile: [usize; 2]) -> usize {
    let rows = (tile[0] - 1) * s.stride[0] + s.kernel[0];
    let cols = (tile[1] - 1) * s.stride[1] + s.kernel[1];
    rows * cols.div_ceil(s.stride[1]) * s.stride[1]
}

/// Dynamic shared memory of a block with a `tile` of outputs, as the template lays it out:
/// forward and backward-data the chunks' weights (16 x 16 blocks), then two tile buffers of
/// PITCH elements a slot (the source, and for backward-weight the cotangent, a slot an output).
pub fn shared_bytes(pass: Pass, s: Shape, tile: [usize; 2]) -> usize {
    let taps = s.kernel[0] * s.kernel[1];
    let mut slots = source_slots(s, tile);
    let weights = if pass == Pass::BackwardWeight {
        slots += tile[0] * tile[1];
        0
    } else {
        CHANNELS / 16 * taps * s.k_chunks() * 256
    };
    (weights + 2 * slots * PITCH) * 2
}

/// Blocks of `shared` bytes an SM holds, with the kernel's launch bound: an SM has about
/// `limit` (a block's most) plus 1 KiB, and reserves 1 KiB a block.
fn blocks_per_sm(pass: Pass, s: Shape, shared: usize, limit: usize) -> usize {
    ((limit + 1024) / (shared + 1024)).min(s.min_blocks(pass))
}

/// Tiles a block should walk at least, where the layer has them, so that copies overlap work.
const TILES_PER_BLOCK: usize = 3;

/// The output tile of `pass` over `out` (rows, columns) extents within `limit` bytes of shared
/// memory, and the blocks an SM then holds. Tiles are rows of 8, 16, 24 or 32 outputs, a
/// multiple of 16 outputs in all. Preferred, in order: as many blocks an SM as the launch bound
/// allows (the kernel is bound by latency, and more warps hide it; measured on the H100: two
/// blocks an SM ran at 25% occupancy, issuing 0.43 instructions a scheduler cycle); an M tile
/// (16 outputs) for each of a chunk's two warps; enough tiles that each block walks several; the least work,
/// counting a staged slot (64 channels copied from L2 or memory) as six of its 128 bytes read by
/// ldmatrix, and each M tile, used or idle, as the ldmatrix reads of its taps.
fn choose_tile(
    pass: Pass,
    s: Shape,
    out: [usize; 2],
    images_x_blocks: usize,
    sms: usize,
    limit: usize,
) -> Option<([usize; 2], usize)> {
    let taps = s.kernel[0] * s.kernel[1];
    // (tile, blocks an SM, both warps busy, enough tiles, cost)
    let mut best: Option<([usize; 2], usize, bool, bool, usize)> = None;
    for tw in [8, 16, 24, 32] {
        // Past the output's width only as far as a one-row tile of 16 needs.
        if tw > out[1].next_multiple_of(8).max(16) {
            break;
        }
        for th in 1..=out[0].min(32) {
            if (th * tw) % 16 != 0 {
                continue;
            }
            let shared = shared_bytes(pass, s, [th, tw]);
            let per_sm = blocks_per_sm(pass, s, shared, limit);
            if shared > limit {
                continue;
            }
            let mtiles = th * tw / 16;
            let busy = mtiles >= 2;
            let tiles = out[0].div_ceil(th) * out[1].div_ceil(tw) * images_x_blocks;
            let enough = tiles >= TILES_PER_BLOCK * per_sm * sms;
            let mut slots = source_slots(s, [th, tw]);
            if pass == Pass::BackwardWeight {
                slots += th * tw;
            }
            let products = mtiles.next_multiple_of(2) * taps * s.k_chunks() * 4 * 512;
            let cost = tiles * (slots * 6 * 128 + products);
            let better = match best {
                None => true,
                Some((_, b_sm, b_busy, b_enough, b_cost)) => {
                    (per_sm, busy, enough, std::cmp::Reverse(cost))
                        > (b_sm, b_busy, b_enough, std::cmp::Reverse(b_cost))
                }
            };
            if better {
                best = Some(([th, tw], per_sm, busy, enough, cost));
            }
        }
    }
    best.map(|(t, per_sm, ..)| (t, per_sm.max(1)))
}

/// The launch of `key` on `sms` multiprocessors with `limit` bytes of shared memory a block, or
/// None where the family does not take it or no tile fits.
pub fn launch_for(key: &PlanKey, sms: usize, limit: usize) -> Option<Launch> {
    if unsupported(ConvPath::Auto, key).is_some() {
        return None;
    }
    let g = &key.geometry;
    let pass = key.pass;
    let shape = Shape::of(g);
    // The gather's output and source extents; the source position of output 0's tap 0.
    let (out, src) = match pass {
        Pass::BackwardData => (g.input, g.output),
        _ => (g.output, g.input),
    };
    let off = |d: usize| match pass {
        Pass::BackwardData => g.pad_lo[d] as i64 - (g.kernel[d] as i64 - 1),
        _ => -(g.pad_lo[d] as i64),
    };
    let blocks_y = g.cin.div_ceil(CHANNELS);
    let sms = sms.max(1);
    let (tile, per_sm) = choose_tile(
        pass,
        shape,
        [out[1], out[2]],
        g.batch * blocks_y,
        sms,
        limit,
    )?;
    let blocks = per_sm * sms;
    let tiles_h = out[1].div_ceil(tile[0]);
    let tiles_w = out[2].div_ceil(tile[1]);
    let tiles = g.batch * tiles_h * tiles_w;
    if tiles == 0 || tiles > i32::MAX as usize || blocks_y > 65535 {
        return None;
    }
    let (blocks_x, splits, per_split) = persistent_grid(pass, blocks, blocks_y, tiles);
    let problem = Problem {
        batch: g.batch as i32,
        src_h: src[1] as i32,
        src_w: src[2] as i32,
        out_h: out[1] as i32,
        out_w: out[2] as i32,
        chans: g.cin as i32,
        off_h: off(1) as i32,
        off_w: off(2) as i32,
        tile_h: tile[0] as i32,
        tile_w: tile[1] as i32,
        tiles_h: tiles_h as i32,
        tiles_w: tiles_w as i32,
        tiles: tiles as i32,
        // Backward-data walks the taps backwards: its weight tap is reversed unless flipped.
        reverse: (g.flip != (pass == Pass::BackwardData)) as i32,
        vec: (key.aligned && g.cin % 8 == 0) as i32,
        tiles_per_split: per_split as i32,
    };
    Some(Launch {
        pass,
        shape,
        problem,
        grid: (blocks_x as u32, blocks_y as u32, 1),
        shared: shared_bytes(pass, shape, tile),
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

    fn grouped(c: usize, cg: usize, size: [usize; 2], k: usize) -> [Vec<usize>; 2] {
        [vec![2, size[0], size[1], c], vec![c, k, k, cg]]
    }

    fn params(c: usize, cg: usize, k: usize, s: usize) -> ConvParams {
        ConvParams::default()
            .groups(c / cg)
            .strides(&[s])
            .padding(&[k / 2])
    }

    #[test]
    fn takes_few_channel_groups_in_16_bit_from_sm_80() {
        for pass in Pass::ALL {
            for cg in GROUP_WIDTHS {
                let [x, w] = grouped(64, cg, [9, 9], 3);
                let p = params(64, cg, 3, 1);
                for dtype in [DType::F16, DType::BF16] {
                    let k = key(dtype, pass, &x, &w, &p);
                    assert_eq!(unsupported(ConvPath::Auto, &k), None);
                    assert!(unsupported(ConvPath::Igemm, &k).is_some());
                    let old = PlanKey { arch: 75, ..k };
                    assert!(unsupported(ConvPath::Auto, &old).is_some());
                }
                let f32 = key(DType::F32, pass, &x, &w, &p);
                assert!(unsupported(ConvPath::Auto, &f32).is_some());
            }
        }
        let f16 = DType::F16;
        // Depthwise, 64-channel groups, output channels unlike input, wide kernels, 3-D,
        // strided backward-data and dilation are other families'.
        let [x, w] = grouped(64, 1, [9, 9], 3);
        assert!(unsupported(
            ConvPath::Auto,
            &key(f16, Pass::Forward, &x, &w, &params(64, 1, 3, 1))
        )
        .is_some());
        let [x, w] = grouped(128, 64, [9, 9], 3);
        assert!(unsupported(
            ConvPath::Auto,
            &key(f16, Pass::Forward, &x, &w, &params(128, 64, 3, 1))
        )
        .is_some());
        let p = params(64, 8, 3, 1);
        let k = key(f16, Pass::Forward, &[2, 9, 9, 64], &[128, 3, 3, 8], &p);
        assert!(unsupported(ConvPath::Auto, &k).is_some());
        let [x, w] = grouped(64, 8, [9, 9], 5);
        assert!(unsupported(
            ConvPath::Auto,
            &key(f16, Pass::Forward, &x, &w, &params(64, 8, 5, 1))
        )
        .is_some());
        let [x, w] = grouped(64, 8, [9, 9], 3);
        let p = params(64, 8, 3, 2);
        assert!(unsupported(ConvPath::Auto, &key(f16, Pass::BackwardData, &x, &w, &p)).is_some());
        assert_eq!(
            unsupported(ConvPath::Auto, &key(f16, Pass::Forward, &x, &w, &p)),
            None
        );
        let dilated = params(64, 8, 3, 1).kernel_dilation(&[2]);
        let k = key(f16, Pass::Forward, &[2, 9, 9, 64], &[64, 3, 3, 8], &dilated);
        assert!(unsupported(ConvPath::Auto, &k).is_some());
    }

    #[test]
    fn the_common_layers_are_listed() {
        let all = specs();
        for dtype in [DType::F16, DType::BF16] {
            for pass in Pass::ALL {
                for cg in [4, 8, 16, 32] {
                    for s in [1, 2] {
                        if pass == Pass::BackwardData && s > 1 {
                            continue;
                        }
                        let [x, w] = grouped(256, cg, [28, 28], 3);
                        let k = key(dtype, pass, &x, &w, &params(256, cg, 3, s));
                        let l = launch_for(&k, 132, H100_SHARED).unwrap();
                        assert!(
                            all.contains(&spec(dtype, pass, l.shape)),
                            "{cg} {s} {pass:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn launches_fit_shared_memory_and_cover_the_output() {
        let sizes = [[1, 1], [5, 3], [14, 14], [28, 28], [56, 56], [1, 300]];
        for pass in Pass::ALL {
            for cg in GROUP_WIDTHS {
                for k in [1, 2, 3] {
                    for s in [1, 2] {
                        if pass == Pass::BackwardData && s > 1 {
                            continue;
                        }
                        for size in sizes {
                            let kh = if size[0] == 1 { 1 } else { k };
                            let c = 96.max(cg * 2);
                            let p = ConvParams::default()
                                .groups(c / cg)
                                .strides(&[s])
                                .padding_lo(&[kh / 2, k / 2])
                                .padding_hi(&[kh / 2, k / 2]);
                            let x = [3, size[0], size[1], c];
                            let w = [c, kh, k, cg];
                            let kk = key(DType::F16, pass, &x, &w, &p);
                            let l = launch_for(&kk, 132, H100_SHARED).unwrap();
                            let pr = l.problem;
                            assert!(l.shared <= H100_SHARED, "{kk:?}");
                            assert_eq!(pr.tile_w % 8, 0);
                            assert_eq!(pr.tile_h * pr.tile_w % 16, 0);
                            assert!(pr.tiles_h * pr.tile_h >= pr.out_h, "{kk:?}");
                            assert!(pr.tiles_w * pr.tile_w >= pr.out_w, "{kk:?}");
                            assert_eq!(pr.tiles, 3 * pr.tiles_h * pr.tiles_w);
                            assert_eq!(l.grid.1 as usize, c.div_ceil(64));
                            if pass == Pass::BackwardWeight {
                                // Every split has a tile; all tiles are covered.
                                let s = l.splits as i32;
                                assert!((s - 1) * pr.tiles_per_split < pr.tiles, "{kk:?}");
                                assert!(s * pr.tiles_per_split >= pr.tiles, "{kk:?}");
                            } else {
                                assert!(l.grid.0 >= 1 && l.grid.0 as i32 <= pr.tiles);
                                // One wave: no more blocks than the SMs hold at once.
                                let blocks = l.grid.0 * l.grid.1;
                                assert!(blocks <= 3 * 132 || l.grid.0 == 1, "{kk:?}");
                            }
                        }
                    }
                }
            }
        }
    }
}
