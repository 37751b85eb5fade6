//! The stem family (`templates/conv_stem.cu`): the first convolution of an image network, whose
//! input has 1 to 4 channels. The implicit GEMM's k axis (taps x channels) then has too few
//! channels per tap for the other families' channel vectors or 64-channel k steps, so a block
//! stages its output tile's input patch in shared memory and gathers from there (forward,
//! backward-weight: 16-bit on tensor cores where the GPU has them); backward-data stages the
//! cotangent rows an input tile reads and sums each input pixel's taps on the FMA units, a stride
//! phase at a time. Every dtype, every architecture kiln runs on.
//!
//! It takes 2-D convolutions of one group with at most [`MAX_CHANNELS`] input channels, kernels
//! up to [`MAX_KERNEL`] taps a side, strides up to [`MAX_STRIDE`], and no dilation. Specs are
//! specialised by channels, kernel and stride: [`specs`] lists the common stems (`kiln warm`
//! compiles those); any other compiles on its first use.

use crate::dtype::DType;
use crate::env::ConvPath;
use crate::jit::{KernelSpec, TemplateDef};
use crate::runtime::Device;

use super::geometry::{Geometry, Pass};
use super::plan::{tensor_cores, PlanKey};

pub static STEM: TemplateDef = TemplateDef {
    name: "conv_stem",
    source: include_str!("../../../templates/conv_stem.cu"),
    kernel: "kiln_conv_stem",
    const_names: &["PASS", "C", "KH", "KW", "SH", "SW", "NB", "TENSOR"],
    arch_specific: false,
    only_arch: None,
};

/// Threads a block (four warps).
pub const THREADS: u16 = 128;
/// Output pixels a tile: `TILE_H` rows of `TILE_W`.
const TILE_H: usize = 8;
const TILE_W: usize = 16;
pub const MAX_CHANNELS: usize = 4;
pub const MAX_KERNEL: usize = 7;
pub const MAX_STRIDE: usize = 4;

/// What a spec is specialised by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub channels: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    /// Output channels a block: 32 or 64.
    pub nb: usize,
}

impl Shape {
    fn of(g: &Geometry) -> Shape {
        Shape {
            channels: g.cin,
            kernel: [g.kernel[1], g.kernel[2]],
            stride: [g.stride[1], g.stride[2]],
            nb: if g.cout <= 32 { 32 } else { 64 },
        }
    }
}

/// The common stems `kiln warm` compiles: 3 channels, 7x7 stride 2 to 64 channels (ResNet) and
/// 3x3 stride 2 to 32 or more (EfficientNet, MobileNet, RegNet).
const COMMON: [Shape; 3] = [
    Shape {
        channels: 3,
        kernel: [7, 7],
        stride: [2, 2],
        nb: 64,
    },
    Shape {
        channels: 3,
        kernel: [3, 3],
        stride: [2, 2],
        nb: 32,
    },
    Shape {
        channels: 3,
        kernel: [3, 3],
        stride: [2, 2],
        nb: 64,
    },
];

/// Backward-data: phase rows (for strides of at most 4 phases; else half) and columns of a
/// block's input tile, and the cotangent channels a stage holds (as the template's BD_ROWS,
/// BD_COLS, BD_CO).
fn bd_rows(stride: [usize; 2]) -> usize {
    if stride[0] * stride[1] <= 4 {
        8
    } else {
        4
    }
}
const BD_COLS: usize = 32;
const BD_CO: usize = 16;

pub fn spec(dtype: DType, pass: Pass, s: Shape, tensor: bool) -> KernelSpec {
    KernelSpec::new(
        &STEM,
        dtype,
        THREADS,
        1,
        &[
            pass as i32,
            s.channels as i32,
            s.kernel[0] as i32,
            s.kernel[1] as i32,
            s.stride[0] as i32,
            s.stride[1] as i32,
            s.nb as i32,
            tensor as i32,
        ],
    )
}

/// The common stems' specs for architecture `arch`.
pub fn specs(arch: u32) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for dtype in DType::ALL {
        for pass in Pass::ALL {
            for s in COMMON {
                out.push(spec(dtype, pass, s, tensor_cores(dtype, arch)));
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
    if g.spatial != 2 {
        return Some("not 2-D");
    }
    if g.groups != 1 {
        return Some("grouped");
    }
    if g.cin > MAX_CHANNELS {
        return Some("more input channels than a stem has");
    }
    if g.kernel[1..].iter().any(|&k| k > MAX_KERNEL) {
        return Some("a kernel wider than the family's");
    }
    if g.stride[1..].iter().any(|&s| s > MAX_STRIDE) {
        return Some("a stride larger than the family's");
    }
    if g.kernel_dilation != [1; 3] || g.input_dilation != [1; 3] {
        return Some("dilation");
    }
    None
}

/// The kernel's view of a problem: `struct kiln_stem` in the template.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Problem {
    pub batch: i32,
    pub in_h: i32,
    pub in_w: i32,
    pub out_h: i32,
    pub out_w: i32,
    pub cout: i32,
    pub pad_h: i32,
    pub pad_w: i32,
    pub tiles_h: i32,
    pub tiles_w: i32,
    pub flip: i32,
    pub vec: i32,
}

/// A plan's launch: the problem, the grid, dynamic shared memory, and the splits of
/// backward-weight's sum (one f32 partial a block along x).
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    pub pass: Pass,
    pub shape: Shape,
    pub tensor: bool,
    pub problem: Problem,
    pub grid: (u32, u32, u32),
    pub shared: usize,
    pub splits: usize,
}

/// Dynamic shared memory of a block, as the template lays it out: the input patch (16-byte
/// rounded), then the weight (forward; on tensor cores also the output tile on its way out) or
/// the cotangent tile (backward-weight; two on tensor cores); backward-data
/// a stage of the cotangent rows its tile reads and of the weight (16-bit on tensor cores for 3
/// or 4 channels and at most 4 stride phases, else f32).
pub fn shared_bytes(pass: Pass, dtype: DType, s: Shape, tensor: bool) -> usize {
    let (kh, kw) = (s.kernel[0], s.kernel[1]);
    if pass == Pass::BackwardData {
        let (sh, sw) = (s.stride[0], s.stride[1]);
        let rows = (bd_rows(s.stride) * sh + kh - 2) / sh + 2;
        let cols = (BD_COLS * sw + kw - 2) / sw + 2;
        if tensor && sh * sw <= 4 && s.channels >= 3 {
            // 16-bit values on tensor cores: [row][column][BD_CO + 8] and [tap][8][BD_CO + 8].
            return (rows * cols + kh * kw * 8) * (BD_CO + 8) * 2;
        }
        // f32: columns padded to an odd count; the weight in float4s of 4 channels.
        return rows * BD_CO * (cols | 1) * 4 + kh * kw * BD_CO * 16;
    }
    let (cp, kwp) = if tensor {
        (4, kw.div_ceil(4) * 4)
    } else {
        (s.channels, kw)
    };
    let rows = (TILE_H - 1) * s.stride[0] + kh;
    let cols = (TILE_W - 1) * s.stride[1] + kwp;
    let value = if tensor { dtype.size() } else { 4 };
    let patch = (rows * cols * cp * value).div_ceil(16) * 16;
    let second = match (pass, tensor) {
        // The weight, then the output tile on its way out.
        (Pass::Forward, true) => s.nb * (kh * kwp * 4 + 8) * 2 + TILE_H * TILE_W * (s.nb + 8) * 2,
        (Pass::Forward, false) => kh * kw * s.channels * s.nb * 4,
        // Two cotangent tiles: the next one is copied in while this one is multiplied.
        (_, true) => 2 * TILE_H * TILE_W * (s.nb + 8) * 2,
        (_, false) => TILE_H * TILE_W * s.nb * 4,
    };
    patch + second
}

/// Blocks an SM the template's `__launch_bounds__` leaves room for in the forward and
/// backward-weight (their MIN_BLOCKS): the size of their persistent grids until the driver says
/// how many of the compiled kernel's blocks fit (see [`Launch::fill`]). Backward-data launches a
/// block a tile and does not use it.
pub fn min_blocks_per_sm(pass: Pass) -> usize {
    match pass {
        Pass::BackwardWeight => 2,
        _ => 4,
    }
}

/// The launch of `key` on `sms` multiprocessors, with the persistent grids sized by
/// [`min_blocks_per_sm`], or None where the family does not take it.
pub fn launch_for(key: &PlanKey, sms: usize) -> Option<Launch> {
    let g = &key.geometry;
    let shape = Shape::of(g);
    let tensor = tensor_cores(key.dtype, key.arch);
    // Backward-data's tiles cover the input, a phase tile of every stride phase each; the
    // other passes' cover the output.
    let (tiles_h, tiles_w) = match key.pass {
        Pass::BackwardData => (
            g.input[1].div_ceil(bd_rows(shape.stride) * g.stride[1]),
            g.input[2].div_ceil(BD_COLS * g.stride[2]),
        ),
        _ => (g.output[1].div_ceil(TILE_H), g.output[2].div_ceil(TILE_W)),
    };
    let tiles = g.batch * tiles_h * tiles_w;
    if tiles > i32::MAX as usize {
        return None;
    }
    let problem = Problem {
        batch: g.batch as i32,
        in_h: g.input[1] as i32,
        in_w: g.input[2] as i32,
        out_h: g.output[1] as i32,
        out_w: g.output[2] as i32,
        cout: g.cout as i32,
        pad_h: g.pad_lo[1] as i32,
        pad_w: g.pad_lo[2] as i32,
        tiles_h: tiles_h as i32,
        tiles_w: tiles_w as i32,
        flip: g.flip as i32,
        // 16-byte cotangent rows: 8-channel vectors inside cout, from an aligned base.
        vec: (key.aligned && g.cout % 8 == 0) as i32,
    };
    let mut launch = Launch {
        pass: key.pass,
        shape,
        tensor,
        problem,
        // One block a tile; `fill` makes the other passes' grids persistent.
        grid: (
            tiles as u32,
            match key.pass {
                Pass::BackwardData => 1,
                _ => g.cout.div_ceil(shape.nb) as u32,
            },
            1,
        ),
        shared: shared_bytes(key.pass, key.dtype, shape, tensor),
        splits: 1,
    };
    launch.fill(sms, min_blocks_per_sm(key.pass));
    Some(launch)
}

impl Launch {
    /// Sizes the forward's and backward-weight's persistent grids to `per_sm` blocks on each of
    /// `sms` multiprocessors (never more blocks than tiles): the plan passes how many of the
    /// compiled kernel's blocks an SM holds, so that every block is resident from the start (a
    /// second wave would double a pass's time for a few tiles; fewer blocks leave the SMs
    /// without other blocks' math to hide a block's staging). Backward-weight's blocks each
    /// write one f32 partial. Backward-data keeps one block a tile.
    pub fn fill(&mut self, sms: usize, per_sm: usize) {
        if self.pass == Pass::BackwardData {
            return;
        }
        let p = &self.problem;
        let tiles = p.batch as usize * p.tiles_h as usize * p.tiles_w as usize;
        let blocks = tiles.clamp(1, sms.max(1) * per_sm.max(1));
        self.grid.0 = blocks as u32;
        if self.pass == Pass::BackwardWeight {
            self.splits = blocks;
        }
    }
}

/// The spec and launch that run `key`, or None where the family does not take it.
pub fn plan(device: &Device, path: ConvPath, key: &PlanKey) -> Option<(KernelSpec, Launch)> {
    if unsupported(path, key).is_some() {
        return None;
    }
    let launch = launch_for(key, device.info().multiprocessors as usize)?;
    if launch.shared > device.shared_limit() {
        return None;
    }
    let s = spec(key.dtype, key.pass, launch.shape, launch.tensor);
    Some((s, launch))
}

#[cfg(test)]
mod tests {
    use super::super::geometry::ConvParams;
    use super::super::plan::test_key as key;
    use super::*;

    #[test]
    fn takes_stems_and_names_what_it_does_not() {
        let p = ConvParams::default().strides(&[2]).padding(&[3]);
        let fwd = Pass::Forward;
        let resnet = key(DType::BF16, fwd, &[2, 32, 32, 3], &[64, 7, 7, 3], &p);
        assert_eq!(unsupported(ConvPath::Auto, &resnet), None);
        assert!(unsupported(ConvPath::Igemm, &resnet).is_some());
        let wide = key(DType::F32, fwd, &[2, 32, 32, 8], &[64, 7, 7, 8], &p);
        assert!(unsupported(ConvPath::Auto, &wide).is_some());
        let big = key(DType::F32, fwd, &[2, 32, 32, 3], &[64, 9, 9, 3], &p);
        assert!(unsupported(ConvPath::Auto, &big).is_some());
        let one_d = key(DType::F32, fwd, &[2, 32, 3], &[64, 7, 3], &p);
        assert!(unsupported(ConvPath::Auto, &one_d).is_some());
        let dilated = p.clone().kernel_dilation(&[2]);
        let d = key(DType::F32, fwd, &[2, 32, 32, 3], &[64, 7, 7, 3], &dilated);
        assert!(unsupported(ConvPath::Auto, &d).is_some());
    }

    #[test]
    fn common_stems_are_listed_and_fit_shared_memory() {
        for arch in [75, 80, 90] {
            let all = specs(arch);
            for dtype in DType::ALL {
                for pass in Pass::ALL {
                    for (cout, k, pad) in [(64, 7, 3), (32, 3, 1), (48, 3, 1)] {
                        let p = ConvParams::default().strides(&[2]).padding(&[pad]);
                        let mut kk = key(dtype, pass, &[1, 64, 64, 3], &[cout, k, k, 3], &p);
                        kk.arch = arch;
                        let l = launch_for(&kk, 132).unwrap();
                        assert!(
                            all.contains(&spec(dtype, pass, l.shape, l.tensor)),
                            "{kk:?}"
                        );
                    }
                }
            }
        }
        // The largest shape the family takes needs at most 99 KiB a block (two blocks an SM).
        let s = Shape {
            channels: 4,
            kernel: [7, 7],
            stride: [4, 4],
            nb: 64,
        };
        for pass in Pass::ALL {
            for tensor in [false, true] {
                let bytes = shared_bytes(pass, DType::F32, s, tensor);
                assert!(bytes <= 99 * 1024, "{pass:?} {tensor}: {bytes}");
            }
        }
    }

    #[test]
    fn the_grid_covers_every_channel_and_splits_backward_weight_by_block() {
        let p = ConvParams::default().strides(&[2]).padding(&[1]);
        let k = key(
            DType::F16,
            Pass::BackwardWeight,
            &[4, 40, 40, 3],
            &[72, 3, 3, 3],
            &p,
        );
        let l = launch_for(&k, 132).unwrap();
        assert_eq!(l.grid.1, 2, "72 channels in blocks of 64");
        // 20 x 20 outputs: 3 tile rows x 2 tile columns x 4 images.
        assert_eq!(l.grid.0, 24);
        assert_eq!(l.splits, 24);
        let f = launch_for(
            &PlanKey {
                pass: Pass::Forward,
                ..k
            },
            2,
        )
        .unwrap();
        assert_eq!(f.grid.0, 8, "four blocks an SM on two SMs");
        assert_eq!(f.splits, 1);
        // Backward-data: input tiles of 8 x 2 rows by 32 x 2 columns: 3 x 1 an image.
        let d = launch_for(
            &PlanKey {
                pass: Pass::BackwardData,
                ..k
            },
            2,
        )
        .unwrap();
        assert_eq!((d.grid, d.splits), ((12, 1, 1), 1));
    }

    #[test]
    fn persistent_grids_hold_what_the_driver_says_fits() {
        let p = ConvParams::default().strides(&[2]).padding(&[1]);
        // 112 x 112 outputs: 14 x 7 tiles an image, 6272 for 64 images.
        let w = key(
            DType::F32,
            Pass::BackwardWeight,
            &[64, 224, 224, 3],
            &[32, 3, 3, 3],
            &p,
        );
        let mut l = launch_for(&w, 132).unwrap();
        assert_eq!(
            (l.grid.0, l.splits),
            (264, 264),
            "two blocks an SM before the driver says"
        );
        l.fill(132, 5);
        assert_eq!((l.grid.0, l.splits), (660, 660));
        // Never more blocks than tiles.
        l.fill(132, 64);
        assert_eq!((l.grid.0, l.splits), (6272, 6272));
        let mut f = launch_for(
            &PlanKey {
                pass: Pass::Forward,
                ..w
            },
            132,
        )
        .unwrap();
        f.fill(132, 5);
        assert_eq!((f.grid.0, f.splits), (660, 1));
        let mut d = launch_for(
            &PlanKey {
                pass: Pass::BackwardData,
                ..w
            },
            132,
        )
        .unwrap();
        let before = d.grid;
        d.fill(132, 5);
        assert_eq!(d.grid, before, "backward-data keeps one block a tile");
    }
}
