//! The grouped family (`templates/conv_grouped.cu`): grouped convolutions with few channels a
//! group in f16 and bf16 on tensor cores: 2 to 32 input channels a group and as many output
//! channels (ResNeXt, RegNet), or 2 and more with two or four times as many output channels, up
//! to 32 a group. It can run depthwise layers too (one channel a group), but the plan gives every
//! depthwise layer it takes to the depthwise family, which comes first. A block works on 64
//! output channels (of the gather: backward-data's are the layer's input channels) and walks
//! tiles of outputs, copying the next tile's source pixels (the source channels its 64 read)
//! into shared memory while it multiplies this one with `mma.sync`; each group's weights between
//! 16 output channels and the source channels they read are block-diagonal 16 x 16 matrices (one
//! a k chunk of 16 source channels: two for 32-channel groups, two or four for a multiplier's
//! backward-data), so one code path takes every group width and the zeros cost only MMAs, which
//! such layers have to spare.
//!
//! It takes 1-D and 2-D layers with kernels up to [`MAX_KERNEL`] taps a side (for strided
//! backward-data, each stride phase's), strides up to [`MAX_STRIDE`] and no dilation, on GPUs
//! with 16-bit tensor cores for the dtype from sm_80 on. Backward-data of a strided layer runs
//! one launch a stride phase: the input pixels whose rows and columns leave one remainder by the
//! strides take every stride-th tap of the kernel, a stride-1 gather of the cotangent with a
//! smaller kernel (2x2 for a 3x3 at stride 2). The direct family takes the other grouped layers
//! (f32, older GPUs, wider kernels). [`specs`] lists the common specs (`kiln warm` compiles
//! those); any other compiles on its first use.

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
    const_names: &["PASS", "CG", "MUL", "KH", "KW", "SH", "SW", "MIN_BLOCKS"],
    arch_specific: false,
    only_arch: None,
};

/// Rows and columns the staging walk's offsets may reach past an image (its padding and the
/// tiles past its edges), which [`unsupported`] counts in its 32-bit bound.
const STAGING_MARGIN: usize = 192;

/// Threads a block: 8 warps, two a 16-channel chunk.
pub const THREADS: u16 = 256;
/// Channels a block works on (four 16-channel chunks).
const CHANNELS: usize = 64;
/// Elements of padding a staged pixel takes in shared memory past its channels (16 bytes).
const PAD: usize = 8;
pub const MAX_KERNEL: usize = 3;
pub const MAX_STRIDE: usize = 2;
/// Input channels a group the family takes.
pub const GROUP_WIDTHS: [usize; 6] = [1, 2, 4, 8, 16, 32];
/// Output channels a group per input channel (the channel multiplier) the family takes, where
/// [`takes_multiplier`] allows.
pub const MULTIPLIERS: [usize; 3] = [1, 2, 4];
/// Most output channels a group (those of a 16-channel chunk's group fit two k chunks).
pub const MAX_OUT_GROUP: usize = 32;

/// Whether the family takes `cg` input channels a group with a channel multiplier `mul`: any
/// group width as many out as in; 2 or more with two or four times as many out, up to
/// [`MAX_OUT_GROUP`].
pub fn takes_multiplier(cg: usize, mul: usize) -> bool {
    GROUP_WIDTHS.contains(&cg)
        && MULTIPLIERS.contains(&mul)
        && (mul == 1 || (cg >= 2 && cg * mul <= MAX_OUT_GROUP))
}
/// The first architecture whose `mma.sync` m16n8k16 takes both 16-bit types.
pub const MIN_ARCH: u32 = 80;

/// What a spec is specialised by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Input channels a group.
    pub cg: usize,
    /// Output channels a group per input channel.
    pub mul: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
}

impl Shape {
    /// The gather `pass` of `g` runs: backward-data gathers at stride 1, a stride phase's taps
    /// (every stride-th: the kernel divided by the stride, rounded up) at a time.
    fn of(pass: Pass, g: &Geometry) -> Shape {
        let cg = g.cin / g.groups;
        let mul = g.cout / g.cin;
        let kernel = [g.kernel[1], g.kernel[2]];
        let stride = [g.stride[1], g.stride[2]];
        if pass == Pass::BackwardData {
            Shape {
                cg,
                mul,
                kernel: [0, 1].map(|d| kernel[d].div_ceil(stride[d])),
                stride: [1, 1],
            }
        } else {
            Shape {
                cg,
                mul,
                kernel,
                stride,
            }
        }
    }

    /// The gather `pass` runs for a `k` x `k` kernel at stride `s` with `cg` input channels a
    /// group and multiplier `mul` (backward-data: a stride phase's taps at stride 1), as
    /// [`Shape::of`] derives it from such a layer.
    pub fn square(pass: Pass, cg: usize, mul: usize, k: usize, s: usize) -> Shape {
        let (kernel, stride) = if pass == Pass::BackwardData {
            (k.div_ceil(s), 1)
        } else {
            (k, s)
        };
        Shape {
            cg,
            mul,
            kernel: [kernel; 2],
            stride: [stride; 2],
        }
    }

    /// Channels a group of the gather's output (backward-weight: of the cotangent) and of the
    /// source it reads (the template's OPG and SPG).
    fn group_roles(&self, pass: Pass) -> (usize, usize) {
        match pass {
            Pass::BackwardData => (self.cg, self.cg * self.mul),
            _ => (self.cg * self.mul, self.cg),
        }
    }

    /// Source channels a block stages a pixel: those its 64 channels read (the template's SPER).
    fn source_channels(&self, pass: Pass) -> usize {
        let (opg, spg) = self.group_roles(pass);
        CHANNELS / opg * spg
    }

    /// Source channels a 16-channel output chunk reads (the template's READS).
    fn reads(&self, pass: Pass) -> usize {
        let (opg, spg) = self.group_roles(pass);
        if opg <= 16 {
            16 / opg * spg
        } else {
            spg
        }
    }

    /// Those channels in chunks of 16 (the template's KC).
    fn k_chunks(&self, pass: Pass) -> usize {
        self.reads(pass).max(16) / 16
    }

    /// Whether backward-weight's two warps of a chunk sum alternate M tiles of its 8 source
    /// channels and add their sums through shared memory (the template's SPLIT_M).
    fn split_m(&self, pass: Pass) -> bool {
        pass == Pass::BackwardWeight && self.reads(pass) < 16
    }

    /// Blocks an SM must hold: the template's launch bound MIN_BLOCKS. Two for backward-weight,
    /// whose sums (taps x k chunks x 4 floats) and every tap's B must all be live for its loads
    /// to go out together (at three, 80 registers, each MMA waited for its own load), and for a
    /// multiplier's backward-data (two or four k chunks), which spilled 46-90 bytes at three (at
    /// two, 0-10: 1.04-1.19x on the H200); three elsewhere.
    fn min_blocks(&self, pass: Pass) -> usize {
        let multiplier_data = pass == Pass::BackwardData && self.mul >= 2;
        if pass == Pass::BackwardWeight || multiplier_data {
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
            s.mul as i32,
            s.kernel[0] as i32,
            s.kernel[1] as i32,
            s.stride[0] as i32,
            s.stride[1] as i32,
            s.min_blocks(pass) as i32,
        ],
    )
}

/// The common grouped layers `kiln warm` compiles: 3x3 at strides 1 and 2 with 4, 8, 16 and
/// 32 channels a group (ResNeXt, RegNet), f16 and bf16 (backward-data at stride 2 gathers 2x2
/// phases). (Depthwise layers, which the family could take, are the depthwise family's; layers
/// with a channel multiplier, which few models have, compile on first use.)
pub fn specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for pass in Pass::ALL {
            for cg in [4, 8, 16, 32] {
                for s in [1, 2] {
                    out.push(spec(dtype, pass, Shape::square(pass, cg, 1, 3, s)));
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
    if g.groups < 2 || g.cin % g.groups != 0 || g.cout % g.cin != 0 {
        return Some("not a grouped layer with a whole number of output channels an input one");
    }
    let (cg, mul) = (g.cin / g.groups, g.cout / g.cin);
    if !GROUP_WIDTHS.contains(&cg) {
        return Some("a group width the family does not take");
    }
    if !takes_multiplier(cg, mul) {
        return Some("a channel multiplier the family does not take");
    }
    // The staging walk keeps a tile's offsets in 32 bits from its image's first element.
    let offsets_fit = |h: usize, w: usize, c: usize| {
        let margin = STAGING_MARGIN;
        (h + margin).saturating_mul(w + margin).saturating_mul(c) < 1 << 31
    };
    if !offsets_fit(g.input[1], g.input[2], g.cin) || !offsets_fit(g.output[1], g.output[2], g.cout)
    {
        return Some("an image of 2^31 elements or more");
    }
    if g.cin % 2 != 0 {
        // Outputs are stored as channel pairs (only one channel a group can leave one over).
        return Some("an odd channel count");
    }
    // Backward-data gathers a stride phase's taps: up to MAX_KERNEL of a kernel MAX_STRIDE
    // times as wide.
    let widest = if key.pass == Pass::BackwardData {
        MAX_KERNEL * MAX_STRIDE
    } else {
        MAX_KERNEL
    };
    if let Some(why) = tile_limits(key, widest, MAX_STRIDE, MAX_STRIDE) {
        return Some(why);
    }
    if Shape::of(key.pass, g)
        .kernel
        .iter()
        .any(|&k| k > MAX_KERNEL)
    {
        return Some("a kernel wider than the family's");
    }
    None
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
    pub src_chans: i32,
    pub dst_h: i32,
    pub dst_w: i32,
    pub out_h0: i32,
    pub out_w0: i32,
    pub out_step_h: i32,
    pub out_step_w: i32,
    pub w_kh: i32,
    pub w_kw: i32,
    pub tap_h0: i32,
    pub tap_w0: i32,
    pub tap_step_h: i32,
    pub tap_step_w: i32,
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

/// One launch: its problem and grid.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Phase {
    pub problem: Problem,
    pub grid: (u32, u32, u32),
}

/// A plan's launches (one, or one a stride phase of backward-data, each writing its own pixels
/// of the output), dynamic shared memory, and the splits of backward-weight's sum (one f32
/// partial a block along x).
#[derive(Clone, Debug)]
pub struct Launch {
    pub pass: Pass,
    pub shape: Shape,
    /// The launches, in order; together they write every element of the output once.
    pub phases: Vec<Phase>,
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
/// forward and backward-data the chunks' weights (16 x 16 blocks), then two tile buffers: the
/// source's slots (its staged channels and PAD elements each), and for backward-weight the
/// cotangent's, a slot an output of 64 channels and PAD; at least, where backward-weight's warps
/// add their sums through shared memory, the f32 sums of four warps.
pub fn shared_bytes(pass: Pass, s: Shape, tile: [usize; 2]) -> usize {
    let taps = s.kernel[0] * s.kernel[1];
    let mut buffer = source_slots(s, tile) * (s.source_channels(pass) + PAD);
    let weights = if pass == Pass::BackwardWeight {
        buffer += tile[0] * tile[1] * (CHANNELS + PAD);
        0
    } else {
        CHANNELS / 16 * taps * s.k_chunks(pass) * 256
    };
    let exchange = if s.split_m(pass) {
        CHANNELS / 16 * 32 * taps * 4 * 4
    } else {
        0
    };
    ((weights + 2 * buffer) * 2).max(exchange)
}

/// Blocks of `shared` bytes an SM holds, with the kernel's launch bound: an SM has about
/// `limit` (a block's most) plus 1 KiB, and reserves 1 KiB a block.
fn blocks_per_sm(pass: Pass, s: Shape, shared: usize, limit: usize) -> usize {
    ((limit + 1024) / (shared + 1024)).min(s.min_blocks(pass))
}

/// Costs of the tile model, in staged slots (64 channels copied into shared memory; a source
/// slot of other widths counts in proportion): an MMA
/// unit (an M tile at a tap and k chunk, used or idle), and a tile's fixed work (its barriers,
/// setup and pipeline turn). Fitted to a sweep of eight tile shapes on the six ResNeXt layers,
/// every pass (H100, f16).
const MMA_UNIT_SLOTS: f64 = 4.0;
const TILE_SLOTS: f64 = 800.0;
/// How the time falls with the blocks at work at once: as their count to this power (more
/// warps hide latency, but less than in proportion).
const PARALLEL_POWER: f64 = 0.75;

/// The output tile of `pass` over `out` (rows, columns) extents within `limit` bytes of shared
/// memory, and the blocks an SM then holds. Tiles are rows of 8, 16, 24 or 32 outputs, a
/// multiple of 16 outputs in all. The model: the work is the staged slots (halos included),
/// the MMA units (M tiles rounded up to a pair, one a warp of a chunk) and a fixed cost a tile,
/// summed over the tiles; the time is the work over the blocks at work at once (those an SM
/// holds on every SM, or as many as there are tiles) to the power PARALLEL_POWER. Larger tiles
/// than the most blocks an SM would allow often win: a 14x14 map in one 14x16 tile ran 1.3x
/// faster on the H100 than in 4x8 tiles at three blocks an SM (the earlier rule).
fn choose_tile(
    pass: Pass,
    s: Shape,
    out: [usize; 2],
    images_x_blocks: usize,
    sms: usize,
    limit: usize,
) -> Option<([usize; 2], usize)> {
    let taps = s.kernel[0] * s.kernel[1];
    // (tile, blocks an SM, modelled time)
    let mut best: Option<([usize; 2], usize, f64)> = None;
    for tw in [8, 16, 24, 32] {
        // Past the output's width only as far as a one-row tile of 16 needs.
        if tw > out[1].next_multiple_of(8).max(16) {
            break;
        }
        // Up to an even row count past the output's height (7 rows: one tile of 8x8).
        for th in 1..=out[0].next_multiple_of(2).min(32) {
            if (th * tw) % 16 != 0 {
                continue;
            }
            let shared = shared_bytes(pass, s, [th, tw]);
            if shared > limit {
                continue;
            }
            let per_sm = blocks_per_sm(pass, s, shared, limit).max(1);
            let tiles = out[0].div_ceil(th) * out[1].div_ceil(tw) * images_x_blocks;
            let mut slots =
                (source_slots(s, [th, tw]) * s.source_channels(pass)) as f64 / CHANNELS as f64;
            if pass == Pass::BackwardWeight {
                slots += (th * tw) as f64;
            }
            let mma_units = (th * tw / 16).next_multiple_of(2) * taps * s.k_chunks(pass);
            let work = tiles as f64 * (slots + MMA_UNIT_SLOTS * mma_units as f64 + TILE_SLOTS);
            let at_once = tiles.min(per_sm * sms) as f64;
            let time = work / at_once.powf(PARALLEL_POWER);
            if best.map_or(true, |(_, _, t)| time < t) {
                best = Some(([th, tw], per_sm, time));
            }
        }
    }
    best.map(|(t, per_sm, _)| (t, per_sm))
}

/// The launch of `key` on `sms` multiprocessors with `limit` bytes of shared memory a block, or
/// None where the family does not take it or no tile fits.
pub fn launch_for(key: &PlanKey, sms: usize, limit: usize) -> Option<Launch> {
    if unsupported(ConvPath::Auto, key).is_some() {
        return None;
    }
    let g = &key.geometry;
    let pass = key.pass;
    let shape = Shape::of(pass, g);
    // The gather's output and source extents and channels (backward-weight: the cotangent's
    // and the input's).
    let (out, src, chans, src_chans) = match pass {
        Pass::BackwardData => (g.input, g.output, g.cin, g.cout),
        _ => (g.output, g.input, g.cout, g.cin),
    };
    let phases = gather_phases(pass, g);
    let blocks_y = chans.div_ceil(CHANNELS);
    let sms = sms.max(1);
    // Phase 0 has the most outputs; every phase takes its tile.
    let (tile, per_sm) = choose_tile(
        pass,
        shape,
        phases[0].map(|d| d.outputs),
        g.batch * blocks_y,
        sms,
        limit,
    )?;
    if blocks_y > 65535 {
        return None;
    }
    let mut launch = Launch {
        pass,
        shape,
        phases: Vec::new(),
        shared: shared_bytes(pass, shape, tile),
        splits: 1,
    };
    for [h, w] in phases {
        let tiles_h = h.outputs.div_ceil(tile[0]);
        let tiles_w = w.outputs.div_ceil(tile[1]);
        let tiles = g.batch * tiles_h * tiles_w;
        if tiles == 0 || tiles > i32::MAX as usize {
            return None;
        }
        let (blocks_x, splits, per_split) = persistent_grid(pass, per_sm * sms, blocks_y, tiles);
        launch.splits = splits;
        let problem = Problem {
            batch: g.batch as i32,
            src_h: src[1] as i32,
            src_w: src[2] as i32,
            out_h: h.outputs as i32,
            out_w: w.outputs as i32,
            chans: chans as i32,
            src_chans: src_chans as i32,
            dst_h: out[1] as i32,
            dst_w: out[2] as i32,
            out_h0: h.first as i32,
            out_w0: w.first as i32,
            out_step_h: h.step as i32,
            out_step_w: w.step as i32,
            w_kh: g.kernel[1] as i32,
            w_kw: g.kernel[2] as i32,
            tap_h0: h.tap0 as i32,
            tap_w0: w.tap0 as i32,
            tap_step_h: h.tap_step as i32,
            tap_step_w: w.tap_step as i32,
            off_h: h.off as i32,
            off_w: w.off as i32,
            tile_h: tile[0] as i32,
            tile_w: tile[1] as i32,
            tiles_h: tiles_h as i32,
            tiles_w: tiles_w as i32,
            tiles: tiles as i32,
            reverse: g.flip as i32,
            vec: (key.aligned && g.cin % 8 == 0) as i32,
            tiles_per_split: per_split as i32,
        };
        launch.phases.push(Phase {
            problem,
            grid: (blocks_x as u32, blocks_y as u32, 1),
        });
    }
    Some(launch)
}

/// How one axis of a gather maps onto the layer: outputs `first`, `first + step`, ... of the
/// output array (`outputs` of them), the source position `off` of output 0 at staged tap 0, and
/// the kernel position `tap0 + tap_step * t` of staged tap t (outside the kernel: no tap).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AxisMap {
    outputs: usize,
    first: usize,
    step: usize,
    off: i64,
    tap0: i64,
    tap_step: i64,
}

/// The gathers `pass` of `g` runs, each as (rows, columns): one, or for backward-data one a
/// stride phase that has outputs, phase 0 first.
fn gather_phases(pass: Pass, g: &Geometry) -> Vec<[AxisMap; 2]> {
    let axis = |d: usize, phase: usize| -> AxisMap {
        let (k, s, pad) = (g.kernel[d] as i64, g.stride[d] as i64, g.pad_lo[d] as i64);
        // A flipped kernel is read from its far end.
        let oriented = |tap0: i64, step: i64| {
            if g.flip {
                (k - 1 - tap0, -step)
            } else {
                (tap0, step)
            }
        };
        if pass != Pass::BackwardData {
            let (tap0, tap_step) = oriented(0, 1);
            return AxisMap {
                outputs: g.output[d],
                first: 0,
                step: 1,
                off: -pad,
                tap0,
                tap_step,
            };
        }
        // Input pixel a + s i takes the kernel taps r = r0 + s t (r0 = (a + pad) mod s) from
        // cotangent pixel i + q - t (q = (a + pad) div s); staged tap u is t = taps - 1 - u, so
        // that the cotangent is read forwards: pixel i + (q - taps + 1) + u.
        let a = phase as i64;
        let taps = (k + s - 1) / s;
        let (r0, q) = ((a + pad) % s, (a + pad) / s);
        let (tap0, tap_step) = oriented(r0 + s * (taps - 1), -s);
        AxisMap {
            outputs: (g.input[d].saturating_sub(phase)).div_ceil(s as usize),
            first: phase,
            step: s as usize,
            off: q - taps + 1,
            tap0,
            tap_step,
        }
    };
    let phases = |d: usize| {
        if pass == Pass::BackwardData {
            g.stride[d]
        } else {
            1
        }
    };
    let mut out = Vec::new();
    for ph in 0..phases(1) {
        for pw in 0..phases(2) {
            let maps = [axis(1, ph), axis(2, pw)];
            if maps.iter().all(|m| m.outputs > 0) {
                out.push(maps);
            }
        }
    }
    out
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
        // Two or four times as many output channels as input ones, from 2 a group to 32 out.
        for pass in Pass::ALL {
            for cg in GROUP_WIDTHS {
                for mul in [2, 4] {
                    let p = params(64, cg, 3, 1);
                    let k = key(f16, pass, &[2, 9, 9, 64], &[64 * mul, 3, 3, cg], &p);
                    let taken = unsupported(ConvPath::Auto, &k).is_none();
                    assert_eq!(taken, cg >= 2 && cg * mul <= 32, "{cg} x{mul} {pass:?}");
                }
            }
        }
        // 64-channel groups, other multipliers or fewer output channels than input ones, wide
        // kernels, 3-D and dilation are other families'. (Depthwise layers are the depthwise
        // family's where it takes them.)
        let [x, w] = grouped(128, 64, [9, 9], 3);
        assert!(unsupported(
            ConvPath::Auto,
            &key(f16, Pass::Forward, &x, &w, &params(128, 64, 3, 1))
        )
        .is_some());
        let p = params(64, 8, 3, 1);
        for cout in [32, 192, 384, 512] {
            let k = key(f16, Pass::Forward, &[2, 9, 9, 64], &[cout, 3, 3, 8], &p);
            assert!(unsupported(ConvPath::Auto, &k).is_some(), "{cout}");
        }
        let [x, w] = grouped(64, 8, [9, 9], 5);
        assert!(unsupported(
            ConvPath::Auto,
            &key(f16, Pass::Forward, &x, &w, &params(64, 8, 5, 1))
        )
        .is_some());
        let [x, w] = grouped(64, 8, [9, 9], 3);
        let p = params(64, 8, 3, 2);
        for pass in Pass::ALL {
            assert_eq!(
                unsupported(ConvPath::Auto, &key(f16, pass, &x, &w, &p)),
                None
            );
        }
        // Strided backward-data of kernels up to 6 wide: phases of up to 3 taps a side.
        let [x, w] = grouped(64, 8, [9, 9], 5);
        let bd = |s| key(f16, Pass::BackwardData, &x, &w, &params(64, 8, 5, s));
        assert_eq!(unsupported(ConvPath::Auto, &bd(2)), None);
        assert!(unsupported(ConvPath::Auto, &bd(1)).is_some());
        let [x, w] = grouped(64, 8, [9, 9], 7);
        let p = params(64, 8, 7, 2);
        assert!(unsupported(ConvPath::Auto, &key(f16, Pass::BackwardData, &x, &w, &p)).is_some());
        // Images whose staging offsets would pass 32 bits go to the implicit GEMM.
        let p = params(64, 8, 3, 1);
        let big = key(f16, Pass::Forward, &[1, 5700, 5700, 64], &[64, 3, 3, 8], &p);
        assert!(unsupported(ConvPath::Auto, &big).is_some());
        let large = key(f16, Pass::Forward, &[1, 4000, 4000, 64], &[64, 3, 3, 8], &p);
        assert_eq!(unsupported(ConvPath::Auto, &large), None);
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
            let shapes = GROUP_WIDTHS
                .map(|cg| (cg, 1))
                .into_iter()
                .chain([2, 4, 8, 16].map(|cg| (cg, 2)))
                .chain([2, 4, 8].map(|cg| (cg, 4)));
            for (cg, mul) in shapes {
                for k in [1, 2, 3] {
                    for s in [1, 2] {
                        for size in sizes {
                            let kh = if size[0] == 1 { 1 } else { k };
                            let c = 96.max(cg * 2);
                            let p = ConvParams::default()
                                .groups(c / cg)
                                .strides(&[s])
                                .padding_lo(&[kh / 2, k / 2])
                                .padding_hi(&[kh / 2, k / 2]);
                            let x = [3, size[0], size[1], c];
                            let w = [c * mul, kh, k, cg];
                            let kk = key(DType::F16, pass, &x, &w, &p);
                            let l = launch_for(&kk, 132, H100_SHARED).unwrap();
                            assert!(l.shared <= H100_SHARED, "{kk:?}");
                            // The launches write every output pixel once.
                            let (out_h, out_w) = match pass {
                                Pass::BackwardData => (kk.geometry.input[1], kk.geometry.input[2]),
                                _ => (kk.geometry.output[1], kk.geometry.output[2]),
                            };
                            let mut written = vec![0; out_h * out_w];
                            for ph in l.phases {
                                let pr = ph.problem;
                                for i in 0..pr.out_h {
                                    for j in 0..pr.out_w {
                                        let h = pr.out_h0 + i * pr.out_step_h;
                                        let w = pr.out_w0 + j * pr.out_step_w;
                                        written[h as usize * out_w + w as usize] += 1;
                                    }
                                }
                                assert_eq!(pr.tile_w % 8, 0);
                                assert_eq!(pr.tile_h * pr.tile_w % 16, 0);
                                assert!(pr.tiles_h * pr.tile_h >= pr.out_h, "{kk:?}");
                                assert!(pr.tiles_w * pr.tile_w >= pr.out_w, "{kk:?}");
                                assert_eq!(pr.tiles, 3 * pr.tiles_h * pr.tiles_w);
                                let chans = if pass == Pass::BackwardData {
                                    c
                                } else {
                                    c * mul
                                };
                                assert_eq!(ph.grid.1 as usize, chans.div_ceil(64));
                                if pass == Pass::BackwardWeight {
                                    // Every split has a tile; all tiles are covered.
                                    let s = l.splits as i32;
                                    assert!((s - 1) * pr.tiles_per_split < pr.tiles, "{kk:?}");
                                    assert!(s * pr.tiles_per_split >= pr.tiles, "{kk:?}");
                                } else {
                                    assert!(ph.grid.0 >= 1 && ph.grid.0 as i32 <= pr.tiles);
                                    // One wave: no more blocks than the SMs hold at once.
                                    let blocks = ph.grid.0 * ph.grid.1;
                                    assert!(blocks <= 3 * 132 || ph.grid.0 == 1, "{kk:?}");
                                }
                            }
                            assert!(written.iter().all(|&n| n == 1), "{kk:?}");
                        }
                    }
                }
            }
        }
    }

    /// Each stride phase of backward-data gathers exactly the (cotangent pixel, kernel tap)
    /// pairs that reach each of its input pixels, checked against the definition along one
    /// axis: kernels 1 to 6, strides 1 and 2, paddings 0 to 3 a side, flip.
    #[test]
    fn stride_phases_gather_exactly_the_taps_that_reach_each_pixel() {
        for k in 1..=6usize {
            for s in 1..=2usize {
                for lo in 0..=3usize {
                    for hi in 0..=3usize {
                        for flip in [false, true] {
                            let p = ConvParams::default()
                                .groups(8)
                                .strides(&[s])
                                .padding_lo(&[lo])
                                .padding_hi(&[hi])
                                .flip(flip);
                            let Ok(g) = Geometry::new(&[1, 9, 64], &[64, k, 8], &p) else {
                                continue;
                            };
                            check_phases_along_the_row(&g, flip);
                        }
                    }
                }
            }
        }
    }

    fn check_phases_along_the_row(g: &Geometry, flip: bool) {
        let (k, s, pad) = (g.kernel[2], g.stride[2], g.pad_lo[2] as i64);
        let (x_len, o_len) = (g.input[2], g.output[2]);
        let mut seen = vec![false; x_len];
        let taps = Shape::of(Pass::BackwardData, g).kernel[1];
        for [_, m] in gather_phases(Pass::BackwardData, g) {
            for i in 0..m.outputs {
                let x = m.first + i * m.step;
                seen[x] = true;
                let mut got: Vec<(i64, i64)> = (0..taps as i64)
                    .map(|u| (i as i64 + m.off + u, m.tap0 + m.tap_step * u))
                    .filter(|&(o, r)| o >= 0 && o < o_len as i64 && r >= 0 && r < k as i64)
                    .collect();
                let mut want: Vec<(i64, i64)> = (0..o_len as i64)
                    .flat_map(|o| (0..k as i64).map(move |r| (o, r)))
                    .filter(|&(o, r)| o * s as i64 - pad + r == x as i64)
                    .map(|(o, r)| (o, if flip { k as i64 - 1 - r } else { r }))
                    .collect();
                got.sort();
                want.sort();
                assert_eq!(got, want, "{g:?} pixel {x}");
            }
        }
        assert!(seen.iter().all(|&v| v), "{g:?}");
    }
}
