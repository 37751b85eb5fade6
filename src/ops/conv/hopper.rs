//! The Hopper path (sm_90): the three passes as one warp-specialised kernel family whose operand
//! tiles the tensor memory accelerator copies (im2col boxes of the activations, tiled boxes of
//! the weight or the cotangent) and whose products `wgmma.mma_async` takes from shared memory.
//! See `templates/conv_wgmma.cu`.
//!
//! It takes 16-bit convolutions of one group, no input dilation, channel counts that are a
//! multiple of 8 (the copy engine steps rows in 16-byte units), and for backward-data stride 1;
//! everything else runs on the `mma.sync` path. `KILN_CONV_PATH` picks the path for tests and
//! comparisons.

use crate::dtype::DType;
use crate::env::ConvPath;
use crate::error::Result;
use crate::jit::{KernelSpec, TemplateDef};
use crate::runtime::tensor_map::{im2col, tiled, Im2colWindow, Swizzle, TensorMap};
use crate::runtime::{Array, Device};

use super::geometry::{Geometry, Pass};
use super::plan::PlanKey;

pub static WGMMA: TemplateDef = TemplateDef {
    name: "conv_wgmma",
    source: include_str!("../../../templates/conv_wgmma.cu"),
    kernel: "kiln_conv_wgmma",
    const_names: &["PASS", "BM", "BN", "STAGES", "SPATIAL"],
    arch_specific: true,
    only_arch: Some(90),
};

/// Three warpgroups: one issues the copies, two multiply.
pub const THREADS: u16 = 384;
/// The k step of one stage: 64 elements, one 128-byte swizzled row.
const BK: usize = 64;

/// A tile of C: `bm` rows (each consumer warpgroup takes half, in slices of 64) by `bn`
/// columns (one `wgmma` of n = bn per slice and k step of 16).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tile {
    pub bm: usize,
    pub bn: usize,
}

/// The tiles kiln compiles. 256-row tiles stop at 128 columns: their accumulators (bn
/// registers a thread) must fit the consumers' 232 registers.
pub const TILES: [Tile; 5] = [
    Tile { bm: 128, bn: 64 },
    Tile { bm: 128, bn: 128 },
    Tile { bm: 128, bn: 256 },
    Tile { bm: 256, bn: 64 },
    Tile { bm: 256, bn: 128 },
];
/// Shared memory the operand stages may fill (of the 227 KiB a block may have).
const STAGE_BUDGET: usize = 192 * 1024;

/// Stages of tile `t`: as many as fit the budget.
pub fn stages(t: Tile) -> usize {
    STAGE_BUDGET / ((t.bm + t.bn) * BK * 2)
}

/// Dynamic shared memory of a block: the stages, two barriers per stage and 1 KiB to align the
/// swizzled tiles.
pub fn shared_bytes(t: Tile) -> usize {
    let s = stages(t);
    s * (t.bm + t.bn) * BK * 2 + 2 * 8 * s + 1024
}

pub fn spec(dtype: DType, pass: Pass, t: Tile, spatial: usize) -> KernelSpec {
    KernelSpec::new(
        &WGMMA,
        dtype,
        THREADS,
        1,
        &[
            pass as i32,
            t.bm as i32,
            t.bn as i32,
            stages(t) as i32,
            spatial as i32,
        ],
    )
}

/// Every spec the Hopper path can choose.
pub fn specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for pass in Pass::ALL {
            for t in TILES {
                for spatial in 1..=3 {
                    out.push(spec(dtype, pass, t, spatial));
                }
            }
        }
    }
    out
}

/// The kernel's view of a problem: `struct kiln_wg_problem` in `templates/conv_wgmma.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Problem {
    pub rows: i32,
    pub cols: i32,
    pub m_tiles: i32,
    pub n_tiles: i32,
    pub splits: i32,
    pub k_per_split: i32,
    pub k_iters: i32,
    pub cblocks: i32,
    pub col_blocks: i32,
    pub batch: i32,
    pub pix: [i32; 3],
    pub stride: [i32; 3],
    pub lower: [i32; 3],
    pub ks: [i32; 3],
    pub dil: [i32; 3],
    pub taps: i32,
    pub flip_w: i32,
    pub ldc: i64,
    pub split_elems: i64,
}

/// What a launch of the Hopper kernel needs besides its tensors.
#[derive(Clone, Debug)]
pub struct Launch {
    pub pass: Pass,
    pub tile: Tile,
    pub problem: Problem,
    /// The window the activations' im2col map walks, per spatial dim (outermost first).
    pub window: Im2colWindow,
}

fn i3(v: [usize; 3]) -> [i32; 3] {
    v.map(|x| x as i32)
}

/// Why the Hopper path cannot take `key` on a GPU of compute capability `cc`, or None.
pub fn unsupported(cc: (u32, u32), key: &PlanKey) -> Option<&'static str> {
    let g = &key.geometry;
    if cc != (9, 0) {
        return Some("not an sm_90 GPU");
    }
    if key.dtype == DType::F32 {
        return Some("f32 runs on the FMA path");
    }
    if g.groups != 1 {
        return Some("grouped");
    }
    if g.batch * g.input_pixels() == 0 {
        // A tensor map has no zero extents; the other path writes the zeros such passes give.
        return Some("an empty input");
    }
    if g.input_dilation.iter().any(|&d| d != 1) {
        return Some("input dilation");
    }
    if key.pass == Pass::BackwardData && g.stride.iter().any(|&s| s != 1) {
        return Some("strided backward-data");
    }
    if g.cin % 8 != 0 || g.cout % 8 != 0 {
        return Some("channels not a multiple of 8");
    }
    if !key.vec_a || !key.vec_b {
        return Some("operands not 16-byte aligned");
    }
    let window = window(key.pass, g);
    let bits = [16, 8, 5][g.spatial - 1];
    let (lo, hi) = (-(1i64 << (bits - 1)), (1i64 << (bits - 1)) - 1);
    let corners_fit = window
        .lower
        .iter()
        .chain(&window.upper)
        .all(|&c| (lo..=hi).contains(&(c as i64)));
    let offsets_fit = (0..3).all(|d| (g.kernel[d] - 1) * g.kernel_dilation[d] < 1 << 16);
    if !corners_fit || !offsets_fit || g.stride.iter().any(|&s| s > 8) {
        return Some("padding, dilation or stride beyond the copy engine's fields");
    }
    None
}

/// The im2col window of the pass's activation operand (input, or the cotangent for
/// backward-data), per spatial dim of the arrays: pixel i of a row reads position
/// `lower + i * stride`, for as many pixels as the GEMM's pixel space has.
fn window(pass: Pass, g: &Geometry) -> Im2colWindow {
    let dims = 3 - g.spatial..3;
    let (mut lower, mut upper, mut stride) = (vec![], vec![], vec![]);
    for d in dims {
        let (lo, s, walked, extent) = match pass {
            // The cotangent with the kernel turned round: tap t' of the window reads
            // position i - ((k - 1) * dilation - pad) + t' * dilation.
            Pass::BackwardData => (
                g.pad_lo[d] as i64 - ((g.kernel[d] - 1) * g.kernel_dilation[d]) as i64,
                1,
                g.input[d],
                g.output[d],
            ),
            _ => (-(g.pad_lo[d] as i64), g.stride[d], g.output[d], g.input[d]),
        };
        // Half-open: `walked` positions `s` apart span (walked - 1) * s + 1 from `lo`.
        let hi = lo + ((walked - 1) * s + 1) as i64 - extent as i64;
        lower.push(lo.clamp(i32::MIN as i64, i32::MAX as i64) as i32);
        upper.push(hi.clamp(i32::MIN as i64, i32::MAX as i64) as i32);
        stride.push(s as u32);
    }
    Im2colWindow {
        lower,
        upper,
        stride,
    }
}

/// Most splits of backward-weight's pixels; each split keeps at least this many k steps.
const MIN_K_PER_SPLIT: usize = 8;
/// What bounds one k step of a tile on one SM, as the bench's sweep measured it on the H100:
/// the tensor cores (dense 16-bit multiply-adds per second, about 90% of 990 TFLOP/s over
/// 132 SMs), or the copies of its operand rows into shared memory (128 bytes each, about 32
/// bytes a clock per SM through the L2).
const SM_MACS_PER_S: f64 = 3.4e12;
const SM_COPY_BYTES_PER_S: f64 = 5.6e10;
/// Device memory bytes per second, for backward-weight's split partials.
const MEMORY_BYTES_PER_S: f64 = 3.0e12;

/// Seconds of one k step of tile `t` on one SM.
fn step_seconds(t: Tile) -> f64 {
    let multiply = (t.bm * t.bn * BK) as f64 / SM_MACS_PER_S;
    let copy = ((t.bm + t.bn) * BK * 2) as f64 / SM_COPY_BYTES_PER_S;
    multiply.max(copy)
}

/// One pass as the kernel's GEMM: C is `rows` x `cols` per column group (`groups`: the taps for
/// backward-weight, else 1), walking the pixel space `pix`; `cblocks` 64-channel blocks per tap
/// (forward, backward-data), `k_iters` k steps in all, `ldc` elements between rows of C.
struct Gemm {
    rows: usize,
    cols: usize,
    groups: usize,
    pix: [usize; 3],
    cblocks: usize,
    k_iters: usize,
    ldc: usize,
}

fn gemm(pass: Pass, g: &Geometry) -> Gemm {
    let taps = g.kernel_size();
    let per_tap = |channels: usize, rows: usize, cols: usize, pix: [usize; 3]| Gemm {
        rows,
        cols,
        groups: 1,
        pix,
        cblocks: channels.div_ceil(BK),
        k_iters: taps * channels.div_ceil(BK),
        ldc: cols,
    };
    match pass {
        Pass::Forward => per_tap(g.cin, g.batch * g.output_pixels(), g.cout, g.output),
        Pass::BackwardData => per_tap(g.cout, g.batch * g.input_pixels(), g.cin, g.input),
        Pass::BackwardWeight => Gemm {
            rows: g.cout,
            cols: g.cin,
            groups: taps,
            pix: g.output,
            cblocks: 0,
            k_iters: (g.batch * g.output_pixels()).div_ceil(BK),
            ldc: taps * g.cin,
        },
    }
}

impl Gemm {
    /// Tiles of C before any split: row tiles times column tiles of every group.
    fn tiles(&self, t: Tile) -> (usize, usize) {
        (
            self.rows.div_ceil(t.bm),
            self.groups * self.cols.div_ceil(t.bn),
        )
    }
}

/// The tile and the split of backward-weight's pixels with the least modelled time on `sms`
/// multiprocessors (one block each): rounds of tiles over the SMs times the time of one tile
/// (its k steps plus about two for filling and storing), plus for a split the f32 partials
/// written and read back.
fn choose(sms: usize, pass: Pass, g: &Geometry) -> (Tile, usize) {
    let gm = gemm(pass, g);
    let k_iters = gm.k_iters;
    let mut best: Option<(f64, Tile, usize)> = None;
    for t in TILES {
        let (m_tiles, n_tiles) = gm.tiles(t);
        let base = m_tiles * n_tiles;
        let most = match pass {
            Pass::BackwardWeight => (k_iters / MIN_K_PER_SPLIT).clamp(1, 64),
            _ => 1,
        };
        for splits in 1..=most {
            let per = k_iters.div_ceil(splits);
            let rounds = (base * splits).div_ceil(sms) as f64;
            let partials = if splits > 1 {
                (2 * splits * g.cout * g.kernel_size() * g.cin * 4) as f64 / MEMORY_BYTES_PER_S
            } else {
                0.0
            };
            let cost = rounds * (per + 2) as f64 * step_seconds(t) + partials;
            if best.map_or(true, |(c, _, _)| cost < c) {
                best = Some((cost, t, splits));
            }
        }
    }
    let (_, t, splits) = best.unwrap_or((0.0, TILES[1], 1));
    (t, splits)
}

/// The launch for `key` on `device`, or None when the Hopper path does not take it (or
/// `KILN_CONV_PATH` says not to).
pub fn plan(device: &Device, path: ConvPath, key: &PlanKey) -> Option<(KernelSpec, Launch)> {
    if path == ConvPath::Igemm {
        return None;
    }
    let info = device.info();
    if unsupported(info.compute_capability, key).is_some() {
        return None;
    }
    let (tile, splits) = choose(info.multiprocessors as usize, key.pass, &key.geometry);
    Some(launch_for(key, tile, splits))
}

/// The spec and launch of `key` with `tile` and `splits` (backward-weight).
pub fn launch_for(key: &PlanKey, tile: Tile, splits: usize) -> (KernelSpec, Launch) {
    let g = &key.geometry;
    let taps = g.kernel_size();
    let gm = gemm(key.pass, g);
    let (m_tiles, n_tiles) = gm.tiles(tile);
    let k_iters = gm.k_iters;
    let splits = splits.clamp(1, k_iters.max(1));
    let k_per_split = k_iters.div_ceil(splits).max(1);
    let splits = k_iters.div_ceil(k_per_split).max(1);
    let window = window(key.pass, g);
    let mut lower = [0i32; 3];
    let mut stride = [1i32; 3];
    for (i, d) in (3 - g.spatial..3).enumerate() {
        lower[d] = window.lower[i];
        stride[d] = window.stride[i] as i32;
    }
    let flip_w = match key.pass {
        Pass::BackwardData => !g.flip,
        _ => g.flip,
    };
    let problem = Problem {
        rows: gm.rows as i32,
        cols: gm.cols as i32,
        m_tiles: m_tiles as i32,
        n_tiles: n_tiles as i32,
        splits: splits as i32,
        k_per_split: k_per_split as i32,
        k_iters: k_iters as i32,
        cblocks: gm.cblocks as i32,
        col_blocks: gm.cols.div_ceil(tile.bn) as i32,
        batch: g.batch as i32,
        pix: i3(gm.pix),
        stride,
        lower,
        ks: i3(g.kernel),
        dil: i3(g.kernel_dilation),
        taps: taps as i32,
        flip_w: flip_w as i32,
        ldc: gm.ldc as i64,
        split_elems: (g.cout * taps * g.cin) as i64,
    };
    (
        spec(key.dtype, key.pass, tile, g.spatial),
        Launch {
            pass: key.pass,
            tile,
            problem,
            window,
        },
    )
}

impl Launch {
    pub fn tiles(&self) -> usize {
        let p = &self.problem;
        (p.m_tiles * p.n_tiles * p.splits) as usize
    }

    /// The tensor maps of GEMM operands `a` and `b` (see `ops::conv::run`): forward (input,
    /// weight), backward-data (cotangent, weight), backward-weight (cotangent, input).
    pub fn maps(&self, a: &Array, b: &Array) -> Result<(TensorMap, TensorMap)> {
        let Tile { bm, bn } = self.tile;
        let w = Swizzle::B128;
        let weight_3d = |wt: &Array| {
            let s = wt.shape();
            let taps: usize = s[1..s.len() - 1].iter().product();
            wt.reshape(&[s[0], taps, s[s.len() - 1]])
        };
        Ok(match self.pass {
            Pass::Forward => (
                im2col(a, &self.window, BK, bm, w)?,
                tiled(&weight_3d(b)?, &[bn, 1, BK], w)?,
            ),
            Pass::BackwardData => (
                im2col(a, &self.window, BK, bm, w)?,
                tiled(&weight_3d(b)?, &[64, 1, BK], w)?,
            ),
            Pass::BackwardWeight => {
                let s = a.shape();
                let cout = s[s.len() - 1];
                let dy = a.reshape(&[a.size() / cout, cout])?;
                (
                    tiled(&dy, &[BK, 64], w)?,
                    im2col(b, &self.window, 64, BK, w)?,
                )
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::conv::geometry::ConvParams;

    fn key(pass: Pass, input: &[usize], weight: &[usize], p: &ConvParams) -> PlanKey {
        PlanKey {
            device: 0,
            dtype: DType::BF16,
            pass,
            geometry: Geometry::new(input, weight, p).unwrap(),
            vec_a: true,
            vec_b: true,
        }
    }

    #[test]
    fn stages_fill_the_budget_and_fit_a_block() {
        for t in TILES {
            assert!(stages(t) >= 4, "{t:?}");
            assert!(shared_bytes(t) <= 227 * 1024, "{t:?}");
        }
    }

    /// The window walks exactly the GEMM's pixels: from `lower`, `stride` apart, up to (not
    /// including) the extent plus `upper`.
    #[test]
    fn windows_walk_the_output_pixels() {
        let walk = |w: &Im2colWindow, i: usize, extent: usize| {
            let (lo, hi, s) = (w.lower[i] as i64, w.upper[i] as i64, w.stride[i] as i64);
            (0..)
                .map(|j| lo + j * s)
                .take_while(|&x| x < extent as i64 + hi)
                .collect::<Vec<_>>()
        };
        // 3x3, stride 2, pad 1 on 9x9: 5 outputs reading from -1, 1, 3, 5, 7.
        let p = ConvParams::default().strides(&[2]).padding(&[1]);
        let k = key(Pass::Forward, &[1, 9, 9, 8], &[8, 3, 3, 8], &p);
        let w = window(Pass::Forward, &k.geometry);
        assert_eq!(walk(&w, 0, 9), vec![-1, 1, 3, 5, 7]);
        // Uneven padding: lo 2, hi 0, kernel 5 on 7 -> 5 outputs from -2.
        let p = ConvParams::default().padding_lo(&[2]).padding_hi(&[0]);
        let k = key(Pass::Forward, &[1, 7, 8], &[8, 5, 8], &p);
        assert_eq!(
            walk(&window(Pass::Forward, &k.geometry), 0, 7),
            vec![-2, -1, 0, 1, 2]
        );
        // Backward-data of 3x3 pad 1 stride 1 on 6: 6 input pixels, the cotangent read from -1.
        let p = ConvParams::default().padding(&[1]);
        let k = key(Pass::BackwardData, &[1, 6, 6, 8], &[8, 3, 3, 8], &p);
        let w = window(Pass::BackwardData, &k.geometry);
        assert_eq!(walk(&w, 1, 6), vec![-1, 0, 1, 2, 3, 4]);
    }

    #[test]
    fn unsupported_names_what_the_copy_engine_cannot_take() {
        let d = ConvParams::default;
        let x = [2, 8, 8, 64];
        let wt = [64, 3, 3, 64];
        let hopper = (9, 0);
        assert_eq!(
            unsupported(hopper, &key(Pass::Forward, &x, &wt, &d())),
            None
        );
        assert!(unsupported((8, 0), &key(Pass::Forward, &x, &wt, &d())).is_some());
        assert!(unsupported((10, 0), &key(Pass::Forward, &x, &wt, &d())).is_some());
        let grouped = key(Pass::Forward, &x, &[64, 3, 3, 32], &d().groups(2));
        assert!(unsupported(hopper, &grouped).is_some());
        let strided = d().strides(&[2]);
        assert_eq!(
            unsupported(hopper, &key(Pass::Forward, &x, &wt, &strided)),
            None
        );
        assert!(unsupported(hopper, &key(Pass::BackwardData, &x, &wt, &strided)).is_some());
        let odd = key(Pass::Forward, &[2, 8, 8, 12], &[64, 3, 3, 12], &d());
        assert!(unsupported(hopper, &odd).is_some());
        // A 3-D map's corners take 5 bits: a pad of 20 does not fit.
        let big_pad = key(
            Pass::Forward,
            &[1, 4, 4, 4, 8],
            &[8, 1, 1, 1, 8],
            &d().padding(&[20]),
        );
        assert!(unsupported(hopper, &big_pad).is_some());
        let empty = key(Pass::BackwardWeight, &[0, 8, 8, 64], &wt, &d());
        assert!(unsupported(hopper, &empty).is_some());
        let mut f32 = key(Pass::Forward, &x, &wt, &d());
        f32.dtype = DType::F32;
        assert!(unsupported(hopper, &f32).is_some());
    }

    #[test]
    fn backward_weight_splits_a_long_reduction() {
        let p = ConvParams::default().padding(&[1]);
        let g = Geometry::new(&[64, 56, 56, 64], &[64, 3, 3, 64], &p).unwrap();
        let (tile, splits) = choose(132, Pass::BackwardWeight, &g);
        let (_, l) = launch_for(
            &PlanKey {
                device: 0,
                dtype: DType::BF16,
                pass: Pass::BackwardWeight,
                geometry: g,
                vec_a: true,
                vec_b: true,
            },
            tile,
            splits,
        );
        assert!(splits > 1, "{tile:?} {splits}");
        assert!(l.tiles() >= 66, "{} tiles", l.tiles());
        assert!(l.problem.k_per_split as usize >= MIN_K_PER_SPLIT);
    }
}
