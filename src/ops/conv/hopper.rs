//! The Hopper path (sm_90): the three passes as one warp-specialised kernel family whose operand
//! tiles the tensor memory accelerator copies (im2col boxes of the activations, tiled boxes of
//! the weight or the cotangent) and whose products `wgmma.mma_async` takes from shared memory.
//! See `templates/conv_wgmma.cu`.
//!
//! It takes 16-bit convolutions of one group, no input dilation, channel counts that are a
//! multiple of 8 (the copy engine steps rows in 16-byte units), and backward-data of at most
//! 16 stride phases (one launch each); with `KILN_ALLOW_TF32` also f32, as TF32 products
//! (`wgmma` takes TF32 operands from shared memory K-major only: backward-data's weight and
//! backward-weight's cotangent are copied turned round first, and backward-weight runs on
//! swapped tiles, whose A the kernel loads into registers); everything else runs on the
//! `mma.sync` path. `KILN_CONV_PATH` picks the path for tests and comparisons.

use crate::dtype::DType;
use crate::env::ConvPath;
use crate::error::Result;
use crate::jit::{KernelSpec, TemplateDef};
use crate::runtime::tensor_map::{im2col, tiled, Im2colWindow, Swizzle, TensorMap};
use crate::runtime::{Array, CommandEncoder, Device};

use super::geometry::{Geometry, Pass};
use super::plan::PlanKey;

/// The one architecture the family runs on (its instructions exist only on sm_90a).
pub const ARCH: u32 = 90;

pub static WGMMA: TemplateDef = TemplateDef {
    name: "conv_wgmma",
    source: include_str!("../../../templates/conv_wgmma.cu"),
    kernel: "kiln_conv_wgmma",
    const_names: &["PASS", "BM", "BN", "STAGES", "SPATIAL", "CLUSTER"],
    arch_specific: true,
    only_arch: Some(ARCH),
};

/// Three warpgroups: one issues the copies, two multiply.
pub const THREADS: u16 = 384;
/// The k step of one stage: one 128-byte swizzled row of each operand.
const ROW_BYTES: usize = 128;

/// Elements of `dtype` in a k step: 64 16-bit ones, 32 f32.
fn bk(dtype: DType) -> usize {
    ROW_BYTES / dtype.size()
}

/// A tile of C: `bm` rows (each consumer warpgroup takes half, in slices of 64) by `bn`
/// columns (one `wgmma` of n = bn per slice and k step of 16; two above 256).
///
/// A `swapped` tile is backward-weight's GEMM turned round: rows are the weight's (tap, input
/// channel) pairs and columns its output channels, so that an output channel count such as 320
/// fills the n side exactly where it would leave part of a 128-row tile empty.
///
/// A tile with `cluster` 2 runs its blocks in thread-block clusters of two, which take
/// neighbouring row tiles of the same column tile: each copies half of their common B operand
/// and the copy engine multicasts it to both, halving B's reads from L2.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tile {
    pub bm: usize,
    pub bn: usize,
    pub swapped: bool,
    pub cluster: usize,
}

const fn tile(bm: usize, bn: usize) -> Tile {
    Tile {
        bm,
        bn,
        swapped: false,
        cluster: 1,
    }
}

impl Tile {
    /// The same tile in clusters of two blocks sharing B.
    pub const fn paired(self) -> Tile {
        Tile { cluster: 2, ..self }
    }

    /// The same tile turned round (backward-weight only).
    pub const fn swapped(self) -> Tile {
        Tile {
            swapped: true,
            ..self
        }
    }
}

/// The tiles kiln compiles for every pass. 256-row tiles stop at 128 columns: their
/// accumulators (bn registers a thread) must fit the consumers' 232 registers.
pub const TILES: [Tile; 6] = [
    tile(128, 64),
    tile(128, 128),
    tile(128, 192),
    tile(128, 256),
    tile(256, 64),
    tile(256, 128),
];
/// Backward-weight's swapped tile: 320 output channels a tile (160 accumulators a thread).
pub const SWAPPED: Tile = Tile {
    bm: 128,
    bn: 320,
    swapped: true,
    cluster: 1,
};

/// The tiles `pass` may take in `dtype`: [`TILES`] and each of them paired, and for 16-bit
/// backward-weight also [`SWAPPED`] alone and paired. f32 (TF32) backward-weight takes only
/// swapped tiles (each of [`TILES`] turned round, and [`SWAPPED`]): TF32 products read B from
/// shared memory along k, which the cotangent turned round is, and A from registers.
pub fn tiles(dtype: DType, pass: Pass) -> Vec<Tile> {
    let mut out = TILES.to_vec();
    if pass == Pass::BackwardWeight {
        if dtype == DType::F32 {
            out = TILES.iter().map(|t| t.swapped()).collect();
        }
        out.push(SWAPPED);
    }
    let paired: Vec<Tile> = out.iter().map(|t| t.paired()).collect();
    out.extend(paired);
    out
}

/// Shared memory the operand stages may fill (of the 227 KiB a block may have): a swapped
/// tile stages no stores, so its stages may take that room too.
fn stage_budget(t: Tile) -> usize {
    if t.swapped {
        224 * 1024
    } else {
        192 * 1024
    }
}

/// Stages of tile `t`: as many as fit the budget.
pub fn stages(t: Tile) -> usize {
    stage_budget(t) / ((t.bm + t.bn) * ROW_BYTES)
}

/// Shared memory each of the eight consumer warps stores its tile through (16 rows of 64
/// 16-bit columns); a swapped tile writes f32 partials straight from its registers. (f32
/// output leaves from the registers too, but keeps the room: one layout for every dtype.)
fn epilogue_warp_bytes(t: Tile) -> usize {
    if t.swapped {
        0
    } else {
        16 * 64 * 2
    }
}

/// Dynamic shared memory of a block: the stages, the consumers' store staging, two barriers per
/// stage and 1 KiB to align the swizzled tiles.
pub fn shared_bytes(t: Tile) -> usize {
    let s = stages(t);
    s * (t.bm + t.bn) * ROW_BYTES + 8 * epilogue_warp_bytes(t) + 2 * 8 * s + 1024
}

/// The template's PASS: the pass, or 3 for backward-weight on a swapped tile.
fn template_pass(pass: Pass, t: Tile) -> i32 {
    if t.swapped {
        3
    } else {
        pass as i32
    }
}

pub fn spec(dtype: DType, pass: Pass, t: Tile, spatial: usize) -> KernelSpec {
    KernelSpec::new(
        &WGMMA,
        dtype,
        THREADS,
        1,
        &[
            template_pass(pass, t),
            t.bm as i32,
            t.bn as i32,
            stages(t) as i32,
            spatial as i32,
            t.cluster as i32,
        ],
    )
}

/// Every spec the Hopper path can choose: the tiles alone. Paired tiles run only when asked for
/// (`tuning::run_hopper_with`, the bench's `--paired`): on the H100 they were no faster than
/// the same tile alone on any model layer measured (see the README), so neither the model nor
/// the autotuner offers them and `kiln warm` does not compile them. Nor does it compile the
/// f32 (TF32) specs: like the `mma.sync` family's, the `KILN_ALLOW_TF32` opt-in's kernels compile
/// on first use.
pub fn specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for pass in Pass::ALL {
            for t in tiles(dtype, pass).into_iter().filter(|t| t.cluster == 1) {
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
    pub taps_per_dim: [i32; 3],
    pub tap_step: [i32; 3],
    pub taps: i32,
    pub kernel: [i32; 3],
    pub weight_first: [i32; 3],
    pub weight_step: [i32; 3],
    pub out_pix: [i32; 3],
    pub out_first: [i32; 3],
    pub out_step: [i32; 3],
    pub ldc: i64,
    pub split_elems: i64,
}

/// What a launch of the Hopper kernel needs besides its tensors: one kernel launch per phase
/// (backward-data at stride s runs s^dims phases, each a stride-1 problem over the cotangent;
/// every other pass is one phase).
#[derive(Clone, Debug)]
pub struct Launch {
    pub dtype: DType,
    pub pass: Pass,
    pub tile: Tile,
    pub splits: usize,
    /// Blocks of each phase's persistent grid: at most this many (one per SM; for a paired
    /// tile twice the clusters the GPU holds at once, which `set_clusters` sets).
    pub max_blocks: usize,
    pub phases: Vec<Phase>,
}

/// One kernel launch of a [`Launch`].
#[derive(Clone, Debug)]
pub struct Phase {
    pub problem: Problem,
    /// The window the activations' im2col map walks, per spatial dim (outermost first).
    pub window: Im2colWindow,
}

fn i3(v: [usize; 3]) -> [i32; 3] {
    v.map(|x| x as i32)
}

/// The fewest rows of C, the weight's (tap, input channel) pairs, for which TF32 backward-weight
/// takes the Hopper family (see `unsupported`).
const MIN_TF32_WEIGHT_ROWS: usize = 256;

/// Backward-data phases a Hopper launch may run; more (large strides in 2-D and 3-D) go to the
/// `mma.sync` path, which runs phases as one grid.
const MAX_PHASES: usize = 16;

/// Why the Hopper path cannot take `key`, or None.
pub fn unsupported(key: &PlanKey) -> Option<&'static str> {
    let g = &key.geometry;
    if key.arch != ARCH {
        return Some("not an sm_90 GPU (or KILN_EMULATE_ARCH names an older one)");
    }
    if key.dtype == DType::F32 && !key.tf32 {
        return Some("exact f32 runs on the mma.sync path (three TF32 products)");
    }
    if key.dtype == DType::F32 && key.pass == Pass::BackwardWeight {
        // The cotangent turned round, (cout, pixels), is a tensor map of 16-byte rows, made by
        // `turned_cotangent`'s transposing copy.
        let pixels = g.batch * g.output_pixels();
        if pixels % 4 != 0 {
            return Some("TF32 backward-weight of a pixel count not a multiple of 4");
        }
        if !crate::runtime::copy::swap_outer_inner_takes([pixels, 1, g.cout]) {
            return Some("TF32 backward-weight of a cotangent past the transposing copy's grid");
        }
        // Under 256 rows of C (1x1 layers of 64 or 128 input channels) the transposing copy
        // costs more than the product saves: H100, 64 -> 256 channels at 56x56, 56 TFLOP/s on
        // one TF32 mma.sync product against 25 here.
        if g.kernel_size() * g.cin < MIN_TF32_WEIGHT_ROWS {
            return Some("TF32 backward-weight of fewer than 256 (tap, channel) rows");
        }
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
    if g.cin % 8 != 0 || g.cout % 8 != 0 {
        return Some("channels not a multiple of 8");
    }
    if !key.vec_a || !key.vec_b {
        return Some("operands not 16-byte aligned");
    }
    let phases = phases(key.pass, g);
    if phases.len() > MAX_PHASES {
        return Some("more stride phases than the Hopper path launches");
    }
    let bits = [16, 8, 5][g.spatial - 1];
    let (lo, hi) = (-(1i64 << (bits - 1)), (1i64 << (bits - 1)) - 1);
    let fits = |axes: &[Axis; 3]| {
        let w = window(g, axes);
        let corners = w.lower.iter().chain(&w.upper);
        let offsets = axes
            .iter()
            .all(|a| a.taps.saturating_sub(1) * a.tap_step < 1 << 16);
        corners
            .into_iter()
            .all(|&c| (lo..=hi).contains(&(c as i64)))
            && offsets
            && axes.iter().all(|a| a.step <= 8)
    };
    if !phases.iter().all(fits) {
        return Some("padding, dilation or stride beyond the copy engine's fields");
    }
    None
}

/// How one launch walks one dim (outermost first; dims the arrays lack walk one pixel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Axis {
    /// Pixels of C's pixel space along the dim.
    walked: usize,
    /// The activation position pixel i reads at tap 0: `lower + i * step`.
    lower: i64,
    step: usize,
    /// The activation operand's extent.
    extent: usize,
    /// Taps of the launch; tap t reads `t * tap_step` positions further.
    taps: usize,
    tap_step: usize,
    /// The weight's tap for tap t: `weight_first + t * weight_step`.
    weight_first: i64,
    weight_step: i64,
    /// C's pixel i is output position `out_first + i * out_step` (backward-data's phases).
    out_first: usize,
    out_step: usize,
}

/// The weight taps of geometric taps `first`, `first + step`, ...: the kernel is applied
/// turned round when the geometry flips it.
fn weight_taps(g: &Geometry, d: usize, first: i64, step: i64) -> (i64, i64) {
    if g.flip {
        (g.kernel[d] as i64 - 1 - first, -step)
    } else {
        (first, step)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The axes of the launches of `pass` along dim `d`: one, or one per stride phase of
/// backward-data.
fn axes(pass: Pass, g: &Geometry, d: usize) -> Vec<Axis> {
    let (k, dil, s) = (g.kernel[d], g.kernel_dilation[d], g.stride[d]);
    let pad = g.pad_lo[d] as i64;
    if pass != Pass::BackwardData {
        let (weight_first, weight_step) = weight_taps(g, d, 0, 1);
        return vec![Axis {
            walked: g.output[d],
            lower: -pad,
            step: s,
            extent: g.input[d],
            taps: k,
            tap_step: dil,
            weight_first,
            weight_step,
            out_first: 0,
            out_step: 1,
        }];
    }
    // Input position x gets tap r of output o where o * s - pad + r * dil = x. Phase f holds the
    // positions x = f + i * s; its taps are those with (f + pad - r * dil) divisible by s, every
    // `rho`-th from the first, and tap r reads output i + (f + pad - r * dil) / s. Ordered by
    // what they read (r descending), consecutive taps read `rho * dil / s` outputs apart.
    let rho = s / gcd(s, dil);
    (0..s)
        .map(|f| {
            let walked = g.input[d].saturating_sub(f).div_ceil(s);
            let reads = |r: usize| f as i64 + pad - (r * dil) as i64;
            let first = (0..k.min(rho)).find(|&r| reads(r).rem_euclid(s as i64) == 0);
            let Some(r0) = first else {
                // No tap reaches these positions: the launch writes their zeros.
                return Axis {
                    walked,
                    lower: 0,
                    step: 1,
                    extent: g.output[d],
                    taps: 0,
                    tap_step: 1,
                    weight_first: 0,
                    weight_step: 1,
                    out_first: f,
                    out_step: s,
                };
            };
            let taps = (k - 1 - r0) / rho + 1;
            let last = r0 + (taps - 1) * rho;
            let (weight_first, weight_step) = weight_taps(g, d, last as i64, -(rho as i64));
            Axis {
                walked,
                lower: reads(last) / s as i64,
                step: 1,
                extent: g.output[d],
                taps,
                tap_step: rho * dil / s,
                weight_first,
                weight_step,
                out_first: f,
                out_step: s,
            }
        })
        .collect()
}

/// The axes of every launch of `pass`, phases in row-major order of their first positions.
fn phases(pass: Pass, g: &Geometry) -> Vec<[Axis; 3]> {
    let per_dim = [axes(pass, g, 0), axes(pass, g, 1), axes(pass, g, 2)];
    let mut out = Vec::new();
    for &a in &per_dim[0] {
        for &b in &per_dim[1] {
            for &c in &per_dim[2] {
                out.push([a, b, c]);
            }
        }
    }
    out
}

/// The im2col window of a launch's activation operand (input, or the cotangent for
/// backward-data), per spatial dim of the arrays: pixel i of a row reads position
/// `lower + i * stride`, for as many pixels as the launch's pixel space has. A launch without
/// taps copies nothing and takes the plain window.
fn window(g: &Geometry, axes: &[Axis; 3]) -> Im2colWindow {
    let dims = 3 - g.spatial..3;
    let copies = axes.iter().all(|a| a.taps > 0 && a.walked > 0);
    let (mut lower, mut upper, mut stride) = (vec![], vec![], vec![]);
    for a in &axes[dims] {
        let (lo, hi) = if copies {
            // Half-open: `walked` positions `step` apart span (walked - 1) * step + 1 from lo.
            let hi = a.lower + ((a.walked - 1) * a.step + 1) as i64 - a.extent as i64;
            (a.lower, hi)
        } else {
            (0, 0)
        };
        lower.push(lo.clamp(i32::MIN as i64, i32::MAX as i64) as i32);
        upper.push(hi.clamp(i32::MIN as i64, i32::MAX as i64) as i32);
        stride.push(if copies { a.step as u32 } else { 1 });
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
/// What a tile costs beyond its k steps (filling the stages, storing the tile), in k steps. Fitted
/// to the bench's `--sweep-hopper` on the H100: with 6, the model's tile and split is within 5%
/// of the best measured one on 88 of 93 bf16 layer passes, lowest 0.89 (with 2: 85, lowest 0.84,
/// split backward-weight of 1x1 layers taking too many splits).
const TILE_OVERHEAD_STEPS: usize = 6;
/// Device memory bytes per second, for backward-weight's split partials.
const MEMORY_BYTES_PER_S: f64 = 3.0e12;

/// Seconds of one k step of tile `t` on one SM.
fn step_seconds(t: Tile) -> f64 {
    // 64 16-bit products deep; TF32's 32 at half the rate take as long.
    let multiply = (t.bm * t.bn * 64) as f64 / SM_MACS_PER_S;
    let copy = ((t.bm + t.bn) * ROW_BYTES) as f64 / SM_COPY_BYTES_PER_S;
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

fn gemm(dtype: DType, pass: Pass, g: &Geometry, axes: &[Axis; 3]) -> Gemm {
    let bk = bk(dtype);
    let taps: usize = axes.iter().map(|a| a.taps).product();
    let pix = axes.map(|a| a.walked);
    let pixels = g.batch * pix.iter().product::<usize>();
    let per_tap = |channels: usize, cols: usize| Gemm {
        rows: pixels,
        cols,
        groups: 1,
        pix,
        cblocks: channels.div_ceil(bk),
        k_iters: taps * channels.div_ceil(bk),
        ldc: cols,
    };
    match pass {
        Pass::Forward => per_tap(g.cin, g.cout),
        Pass::BackwardData => per_tap(g.cout, g.cin),
        Pass::BackwardWeight => Gemm {
            rows: g.cout,
            cols: g.cin,
            groups: taps,
            pix,
            cblocks: 0,
            k_iters: pixels.div_ceil(bk),
            ldc: taps * g.cin,
        },
    }
}

impl Gemm {
    /// 64-column chunks of one group's columns.
    fn chunks(&self) -> usize {
        self.cols.div_ceil(64)
    }

    /// Tiles of C before any split: row tiles times column tiles. The groups' chunks lie end to
    /// end (backward-weight's tiles may span taps); a swapped tile takes them as its rows.
    fn tiles(&self, t: Tile) -> (usize, usize) {
        let chunked = self.groups * self.chunks() * 64;
        if t.swapped {
            (chunked.div_ceil(t.bm), self.rows.div_ceil(t.bn))
        } else {
            (self.rows.div_ceil(t.bm), chunked.div_ceil(t.bn))
        }
    }
}

/// The GEMMs of the launches of `pass` that have pixels to write, with their axes.
fn gemms(dtype: DType, pass: Pass, g: &Geometry) -> Vec<(Gemm, [Axis; 3])> {
    phases(pass, g)
        .into_iter()
        .map(|axes| (gemm(dtype, pass, g, &axes), axes))
        .filter(|(gm, _)| gm.rows > 0)
        .collect()
}

/// The tile and the split of backward-weight's pixels with the least modelled time on `sms`
/// multiprocessors (one block each), summed over the launches: rounds of tiles over the SMs
/// times the time of one tile (its k steps plus [`TILE_OVERHEAD_STEPS`]), plus for a
/// split the f32 partials written and read back.
fn choose(sms: usize, dtype: DType, pass: Pass, g: &Geometry) -> (Tile, usize) {
    candidates(sms, dtype, pass, g, 1)
        .first()
        .copied()
        .unwrap_or((TILES[1], 1))
}

/// The `n` tiles of least modelled time, each with its best split, best first.
pub fn candidates(
    sms: usize,
    dtype: DType,
    pass: Pass,
    g: &Geometry,
    n: usize,
) -> Vec<(Tile, usize)> {
    let gemms = gemms(dtype, pass, g);
    let most = match pass {
        Pass::BackwardWeight => (gemms[0].0.k_iters / MIN_K_PER_SPLIT).clamp(1, 64),
        _ => 1,
    };
    let mut per_tile: Vec<(f64, Tile, usize)> = Vec::new();
    // Paired tiles are left out: see `specs`.
    for t in tiles(dtype, pass).into_iter().filter(|t| t.cluster == 1) {
        let mut best: Option<(f64, Tile, usize)> = None;
        for splits in 1..=most {
            let mut cost = 0.0;
            for (gm, _) in &gemms {
                let (m_tiles, n_tiles) = gm.tiles(t);
                let per = gm.k_iters.div_ceil(splits);
                let rounds = (m_tiles * n_tiles * splits).div_ceil(sms) as f64;
                cost += rounds * (per + TILE_OVERHEAD_STEPS) as f64 * step_seconds(t);
            }
            if splits > 1 || t.swapped {
                cost +=
                    (2 * splits * g.cout * g.kernel_size() * g.cin * 4) as f64 / MEMORY_BYTES_PER_S;
            }
            if best.map_or(true, |(c, _, _)| cost < c) {
                best = Some((cost, t, splits));
            }
        }
        per_tile.extend(best);
    }
    // A stable sort: ties keep the order of `tiles`.
    per_tile.sort_by(|a, b| a.0.total_cmp(&b.0));
    per_tile
        .into_iter()
        .take(n)
        .map(|(_, t, s)| (t, s))
        .collect()
}

/// The launch for `key` on `device`, or None when the Hopper path does not take it (or
/// `KILN_CONV_PATH` says not to).
pub fn plan(device: &Device, path: ConvPath, key: &PlanKey) -> Option<(KernelSpec, Launch)> {
    if path == ConvPath::Igemm {
        return None;
    }
    if unsupported(key).is_some() {
        return None;
    }
    let sms = device.info().multiprocessors as usize;
    let (tile, splits) = choose(sms, key.dtype, key.pass, &key.geometry);
    Some(launch_for(key, tile, splits, sms))
}

/// The spec and launch of `key` with `tile` and `splits` (backward-weight), on `sms`
/// multiprocessors.
pub fn launch_for(key: &PlanKey, tile: Tile, splits: usize, sms: usize) -> (KernelSpec, Launch) {
    let g = &key.geometry;
    let mut chosen_splits = 1;
    let phases = gemms(key.dtype, key.pass, g)
        .into_iter()
        .map(|(gm, axes)| {
            let (m_tiles, n_tiles) = gm.tiles(tile);
            let k_iters = gm.k_iters;
            let splits = splits.clamp(1, k_iters.max(1));
            let k_per_split = k_iters.div_ceil(splits).max(1);
            let splits = k_iters.div_ceil(k_per_split).max(1);
            chosen_splits = splits;
            let window = window(g, &axes);
            let field = |f: fn(&Axis) -> i64| axes.map(|a| f(&a) as i32);
            let problem = Problem {
                rows: gm.rows as i32,
                cols: gm.cols as i32,
                m_tiles: m_tiles as i32,
                n_tiles: n_tiles as i32,
                splits: splits as i32,
                k_per_split: k_per_split as i32,
                k_iters: k_iters as i32,
                cblocks: gm.cblocks as i32,
                col_blocks: gm.chunks() as i32,
                batch: g.batch as i32,
                pix: i3(gm.pix),
                stride: field(|a| a.step as i64),
                lower: field(|a| a.lower),
                taps_per_dim: field(|a| a.taps as i64),
                tap_step: field(|a| a.tap_step as i64),
                taps: axes.iter().map(|a| a.taps).product::<usize>() as i32,
                kernel: i3(g.kernel),
                weight_first: field(|a| a.weight_first),
                weight_step: field(|a| a.weight_step),
                out_pix: i3(match key.pass {
                    Pass::BackwardData => g.input,
                    _ => gm.pix,
                }),
                out_first: field(|a| a.out_first as i64),
                out_step: field(|a| a.out_step as i64),
                ldc: gm.ldc as i64,
                split_elems: (g.cout * g.kernel_size() * g.cin) as i64,
            };
            Phase { problem, window }
        })
        .collect();
    (
        spec(key.dtype, key.pass, tile, g.spatial),
        Launch {
            dtype: key.dtype,
            pass: key.pass,
            tile,
            splits: chosen_splits,
            max_blocks: sms.max(1),
            phases,
        },
    )
}

impl Phase {
    /// Tiles of the phase's schedule.
    pub fn tiles(&self) -> usize {
        let p = &self.problem;
        (p.m_tiles * p.n_tiles * p.splits) as usize
    }

    /// Units of the schedule of a tile in clusters of `cluster`: tiles, or pairs of row tiles
    /// (`kiln_wg_units`).
    fn units(&self, cluster: usize) -> usize {
        let p = &self.problem;
        (p.m_tiles as usize).div_ceil(cluster) * (p.n_tiles * p.splits) as usize
    }
}

impl Launch {
    /// Tiles of every phase's schedule.
    pub fn tiles(&self) -> usize {
        self.phases.iter().map(Phase::tiles).sum()
    }

    /// Blocks of `phase`'s persistent grid: a whole number of clusters.
    pub fn blocks(&self, phase: &Phase) -> u32 {
        let c = self.tile.cluster;
        let clusters = (self.max_blocks / c).max(1);
        (phase.units(c).clamp(1, clusters) * c) as u32
    }

    /// Caps a paired tile's grid at `clusters`, the clusters of two the GPU holds at once (which
    /// fit in its processing clusters, so fewer than half the SMs may be usable).
    pub fn set_clusters(&mut self, clusters: usize) {
        if self.tile.cluster > 1 {
            self.max_blocks = clusters.max(1) * self.tile.cluster;
        }
    }

    /// Whether the kernel writes f32 partial sums (one set a split) for the column sum to add
    /// up, instead of the output: a split backward-weight, and every swapped tile.
    pub fn writes_partials(&self) -> bool {
        self.splits > 1 || self.tile.swapped
    }

    /// Whether B is the weight turned round, (cin, taps, cout) (see [`turned_weight`]): TF32's
    /// backward-data, whose `wgmma` wants B along k (cout) where the weight runs along cin.
    pub fn turns_weight(&self) -> bool {
        self.dtype == DType::F32 && self.pass == Pass::BackwardData
    }

    /// Whether the cotangent is turned round, (cout, pixels) (see [`turned_cotangent`]): TF32's
    /// backward-weight, whose `wgmma` wants B (the cotangent, on a swapped tile) along k (the
    /// pixels) where the cotangent runs along cout.
    pub fn turns_cotangent(&self) -> bool {
        self.dtype == DType::F32 && self.pass == Pass::BackwardWeight
    }

    /// The tensor maps of each phase, in order, over GEMM operands `a` and `b` (see
    /// `ops::conv::run`): forward (input, weight), backward-data (cotangent, weight),
    /// backward-weight (cotangent, input). Only the im2col map of the activations depends on the
    /// phase; the other map is built once and shared.
    pub fn maps(&self, a: &Array, b: &Array) -> Result<Vec<(TensorMap, TensorMap)>> {
        let (bm, bk) = (self.tile.bm, bk(self.dtype));
        let w = Swizzle::B128;
        let weight_3d = |wt: &Array| {
            let s = wt.shape();
            let taps: usize = s[1..s.len() - 1].iter().product();
            wt.reshape(&[s[0], taps, s[s.len() - 1]])
        };
        let shared = match self.pass {
            // The weight (turned round when `turns_weight`) in boxes of 64 rows by a k step's
            // channels of one tap (16-bit backward-data: 64 of each): a tile copies only the
            // boxes that hold part of its output.
            Pass::Forward | Pass::BackwardData => tiled(&weight_3d(b)?, &[64, 1, bk], w)?,
            // The cotangent as (pixels, cout) in boxes of a k step's pixels by 64 channels, or
            // turned round, (cout, pixels), in boxes of 64 channels by a k step's pixels.
            Pass::BackwardWeight if self.turns_cotangent() => {
                let cout = a.shape()[0];
                tiled(&a.reshape(&[cout, a.size() / cout])?, &[64, bk], w)?
            }
            Pass::BackwardWeight => {
                let s = a.shape();
                let cout = s[s.len() - 1];
                tiled(&a.reshape(&[a.size() / cout, cout])?, &[bk, 64], w)?
            }
        };
        self.phases
            .iter()
            .map(|phase| {
                Ok(match self.pass {
                    // A k step's pixels by 128 bytes of channels: the kernel copies a 64-channel
                    // chunk of f32 as two boxes.
                    Pass::BackwardWeight => (shared, im2col(b, &phase.window, bk, bk, w)?),
                    _ => (im2col(a, &phase.window, bk, bm, w)?, shared),
                })
            })
            .collect()
    }
}

/// The cotangent (batch, pixels..., cout) copied as (cout, 1, batch x pixels), for
/// [`Launch::turns_cotangent`].
pub fn turned_cotangent(enc: &mut CommandEncoder, cotangent: &Array) -> Result<Array> {
    let s = cotangent.shape();
    let cout = s[s.len() - 1];
    let pixels = cotangent.size() / cout;
    crate::runtime::copy::swap_outer_inner(enc, &cotangent.reshape(&[pixels, 1, cout])?)
}

/// The weight (cout, taps..., cin) copied as (cin, taps, cout), for [`Launch::turns_weight`].
pub fn turned_weight(enc: &mut CommandEncoder, weight: &Array) -> Result<Array> {
    let s = weight.shape();
    let taps: usize = s[1..s.len() - 1].iter().product();
    crate::runtime::copy::swap_outer_inner(enc, &weight.reshape(&[s[0], taps, s[s.len() - 1]])?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::conv::geometry::ConvParams;

    fn key(pass: Pass, input: &[usize], weight: &[usize], p: &ConvParams) -> PlanKey {
        PlanKey {
            device: 0,
            arch: ARCH,
            dtype: DType::BF16,
            pass,
            geometry: Geometry::new(input, weight, p).unwrap(),
            vec_a: true,
            vec_b: true,
            aligned: true,
            tf32: false,
        }
    }

    fn first_window(pass: Pass, g: &Geometry) -> Im2colWindow {
        window(g, &phases(pass, g)[0])
    }

    /// f32 takes the family only as TF32 (`KILN_ALLOW_TF32`); a k step is then 32 channels (or
    /// pixels). Backward-data turns the weight round, backward-weight the cotangent, and
    /// backward-weight takes only swapped tiles (A from registers, B along k). The opt-in's
    /// specs are not registered (they compile on first use).
    #[test]
    fn f32_runs_as_tf32() {
        let p = ConvParams::default().padding(&[1]);
        let registered = specs();
        for pass in Pass::ALL {
            let mut k = key(pass, &[8, 20, 20, 96], &[64, 3, 3, 96], &p);
            k.dtype = DType::F32;
            assert!(unsupported(&k).is_some(), "exact f32 {pass:?}");
            k.tf32 = true;
            assert!(unsupported(&k).is_none(), "{pass:?}");
            let wgrad = pass == Pass::BackwardWeight;
            let all = tiles(DType::F32, pass);
            assert!(all.iter().all(|t| t.swapped == wgrad), "{pass:?}: {all:?}");
            let tile = all[1];
            assert!(!registered.contains(&spec(DType::F32, pass, tile, 2)));
            let (gm, _) = &gemms(DType::F32, pass, &k.geometry)[0];
            let (gb, _) = &gemms(DType::BF16, pass, &k.geometry)[0];
            if wgrad {
                assert_eq!(gm.k_iters, (8 * 20 * 20usize).div_ceil(32));
                assert_eq!(gb.k_iters, (8 * 20 * 20usize).div_ceil(64));
            } else {
                let channels: usize = if pass == Pass::Forward { 96 } else { 64 };
                assert_eq!(gm.cblocks, channels.div_ceil(32));
                assert_eq!(gm.k_iters, 9 * gm.cblocks);
                assert_eq!(gb.cblocks, channels.div_ceil(64));
            }
            let (_, launch) = launch_for(&k, tile, 1, 132);
            assert_eq!(launch.turns_weight(), pass == Pass::BackwardData);
            assert_eq!(launch.turns_cotangent(), wgrad);
            let (t, _) = choose(132, DType::F32, pass, &k.geometry);
            assert_eq!(t.swapped, wgrad, "{pass:?}");
        }
        // Backward-weight falls back where the transposing copy costs more than it saves (1x1
        // layers of up to 128 channels), and where the turned cotangent cannot be made: pixels
        // not a multiple of 4, or past the transposing copy's 65,535 x 32 rows.
        let one = ConvParams::default();
        for (weight, takes) in [([256, 1, 1, 128], false), ([256, 1, 1, 256], true)] {
            let mut k = key(Pass::BackwardWeight, &[8, 20, 20, weight[3]], &weight, &one);
            (k.dtype, k.tf32) = (DType::F32, true);
            assert_eq!(unsupported(&k).is_none(), takes, "1x1 {weight:?}");
        }
        for (input, cout, takes) in [
            ([8, 20, 20, 96], 1280, true),
            ([1, 7, 7, 96], 1280, false),
            ([1, 1280, 1280, 96], 1280, true),
            ([2, 1280, 1280, 96], 8, false),
        ] {
            let mut k = key(Pass::BackwardWeight, &input, &[cout, 3, 3, 96], &p);
            (k.dtype, k.tf32) = (DType::F32, true);
            assert_eq!(unsupported(&k).is_none(), takes, "{input:?} -> {cout}");
        }
    }

    /// Paired tiles are tiles the family accepts but never chooses or registers.
    #[test]
    fn paired_tiles_run_on_request_only() {
        let registered = specs();
        for pass in Pass::ALL {
            let all = tiles(DType::BF16, pass);
            assert_eq!(all.iter().filter(|t| t.cluster == 2).count(), all.len() / 2);
            for t in all {
                let registered_here = registered.contains(&spec(DType::BF16, pass, t, 2));
                assert_eq!(registered_here, t.cluster == 1, "{pass:?} {t:?}");
            }
        }
        let p = ConvParams::default().padding(&[1]);
        let g = Geometry::new(&[8, 64, 64, 320], &[320, 3, 3, 320], &p).unwrap();
        for pass in Pass::ALL {
            for (t, _) in candidates(132, DType::BF16, pass, &g, 20) {
                assert_eq!(t.cluster, 1, "{pass:?}");
            }
        }
    }

    /// A paired tile's grid is a whole number of clusters, at most the clusters the GPU holds.
    #[test]
    fn paired_grids_are_whole_clusters() {
        let p = ConvParams::default().padding(&[1]);
        let g = Geometry::new(&[4, 20, 20, 64], &[64, 3, 3, 64], &p).unwrap();
        let k = PlanKey {
            device: 0,
            arch: ARCH,
            dtype: DType::BF16,
            pass: Pass::Forward,
            geometry: g,
            vec_a: true,
            vec_b: true,
            aligned: true,
            tf32: false,
        };
        let (_, mut l) = launch_for(&k, tile(128, 64).paired(), 1, 132);
        // 1,600 pixels: 13 row tiles, 7 pairs.
        assert_eq!(l.blocks(&l.phases[0]), 14);
        l.set_clusters(5);
        assert_eq!(l.blocks(&l.phases[0]), 10);
        let (_, mut alone) = launch_for(&k, tile(128, 64), 1, 132);
        alone.set_clusters(5);
        assert_eq!(alone.blocks(&alone.phases[0]), 13, "not a cluster kernel");
    }

    #[test]
    fn stages_fill_the_budget_and_fit_a_block() {
        for t in tiles(DType::BF16, Pass::BackwardWeight)
            .into_iter()
            .chain(tiles(DType::F32, Pass::BackwardWeight))
        {
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
        let w = first_window(Pass::Forward, &k.geometry);
        assert_eq!(walk(&w, 0, 9), vec![-1, 1, 3, 5, 7]);
        // Uneven padding: lo 2, hi 0, kernel 5 on 7 -> 5 outputs from -2.
        let p = ConvParams::default().padding_lo(&[2]).padding_hi(&[0]);
        let k = key(Pass::Forward, &[1, 7, 8], &[8, 5, 8], &p);
        assert_eq!(
            walk(&first_window(Pass::Forward, &k.geometry), 0, 7),
            vec![-2, -1, 0, 1, 2]
        );
        // Backward-data of 3x3 pad 1 stride 1 on 6: 6 input pixels, the cotangent read from -1.
        let p = ConvParams::default().padding(&[1]);
        let k = key(Pass::BackwardData, &[1, 6, 6, 8], &[8, 3, 3, 8], &p);
        let w = first_window(Pass::BackwardData, &k.geometry);
        assert_eq!(walk(&w, 1, 6), vec![-1, 0, 1, 2, 3, 4]);
    }

    #[test]
    fn unsupported_names_what_the_copy_engine_cannot_take() {
        let d = ConvParams::default;
        let x = [2, 8, 8, 64];
        let wt = [64, 3, 3, 64];
        assert_eq!(unsupported(&key(Pass::Forward, &x, &wt, &d())), None);
        for arch in [75, 80, 100] {
            let older = PlanKey {
                arch,
                ..key(Pass::Forward, &x, &wt, &d())
            };
            assert!(unsupported(&older).is_some(), "sm_{arch}");
        }
        let grouped = key(Pass::Forward, &x, &[64, 3, 3, 32], &d().groups(2));
        assert!(unsupported(&grouped).is_some());
        let strided = d().strides(&[2]);
        assert_eq!(unsupported(&key(Pass::Forward, &x, &wt, &strided)), None);
        assert_eq!(
            unsupported(&key(Pass::BackwardData, &x, &wt, &strided)),
            None
        );
        // Stride 3 in 3-D: 27 phases.
        let many = key(
            Pass::BackwardData,
            &[1, 6, 6, 6, 8],
            &[8, 3, 3, 3, 8],
            &d().strides(&[3]),
        );
        assert!(unsupported(&many).is_some());
        let odd = key(Pass::Forward, &[2, 8, 8, 12], &[64, 3, 3, 12], &d());
        assert!(unsupported(&odd).is_some());
        // A 3-D map's corners take 5 bits: a pad of 20 does not fit.
        let big_pad = key(
            Pass::Forward,
            &[1, 4, 4, 4, 8],
            &[8, 1, 1, 1, 8],
            &d().padding(&[20]),
        );
        assert!(unsupported(&big_pad).is_some());
        let empty = key(Pass::BackwardWeight, &[0, 8, 8, 64], &wt, &d());
        assert!(unsupported(&empty).is_some());
        let mut f32 = key(Pass::Forward, &x, &wt, &d());
        f32.dtype = DType::F32;
        assert!(unsupported(&f32).is_some());
    }

    #[test]
    fn backward_weight_splits_a_long_reduction() {
        let p = ConvParams::default().padding(&[1]);
        let g = Geometry::new(&[64, 56, 56, 64], &[64, 3, 3, 64], &p).unwrap();
        let (tile, splits) = choose(132, DType::BF16, Pass::BackwardWeight, &g);
        let (_, l) = launch_for(
            &PlanKey {
                device: 0,
                arch: ARCH,
                dtype: DType::BF16,
                pass: Pass::BackwardWeight,
                geometry: g,
                vec_a: true,
                vec_b: true,
                aligned: true,
                tf32: false,
            },
            tile,
            splits,
            132,
        );
        assert!(splits > 1, "{tile:?} {splits}");
        assert!(l.tiles() >= 66, "{} tiles", l.tiles());
        assert_eq!(l.phases.len(), 1);
        assert!(l.phases[0].problem.k_per_split as usize >= MIN_K_PER_SPLIT);
    }

    /// Output channels that leave part of a 128-row tile empty (320: 83% of three) take the
    /// swapped tile, whose 320 columns they fill; 256 and 512 keep the usual orientation. A
    /// swapped tile counts the (tap, channel) chunks as rows and cout as columns.
    #[test]
    fn backward_weight_of_320_channels_takes_the_swapped_tile() {
        let p = ConvParams::default().padding(&[1]);
        for (cin, cout, swapped) in [
            (640, 320, true),
            (320, 320, true),
            (256, 256, false),
            (512, 512, false),
        ] {
            let g = Geometry::new(&[8, 64, 64, cin], &[cout, 3, 3, cin], &p).unwrap();
            let (tile, _) = choose(132, DType::BF16, Pass::BackwardWeight, &g);
            assert_eq!(tile.swapped, swapped, "{cin} -> {cout}: {tile:?}");
        }
        let g = Geometry::new(&[8, 64, 64, 640], &[320, 3, 3, 640], &p).unwrap();
        let (gm, _) = &gemms(DType::BF16, Pass::BackwardWeight, &g)[0];
        assert_eq!(gm.tiles(SWAPPED), (9 * 640 / 128, 1));
        assert_eq!(gm.tiles(tile(128, 256)), (3, (9 * 640usize).div_ceil(256)));
        assert!(!tiles(DType::BF16, Pass::Forward).contains(&SWAPPED));
        assert!(!tiles(DType::BF16, Pass::BackwardData).contains(&SWAPPED));
    }

    /// Backward-data's phases along one dim, against every (input position, tap, output)
    /// triple of the convolution: each one read exactly once, by the launch that writes that
    /// input position, through the right weight tap; positions no tap reaches are written as
    /// zeros by a launch without taps.
    #[test]
    fn phases_cover_every_contribution_once() {
        let mut cases = 0;
        for input in 1..=9usize {
            for k in 1..=4usize {
                for s in 1..=4usize {
                    for dil in 1..=3usize {
                        for pad in 0..=(k - 1) * dil {
                            for flip in [false, true] {
                                let p = ConvParams::default()
                                    .strides(&[s])
                                    .padding(&[pad])
                                    .kernel_dilation(&[dil])
                                    .flip(flip);
                                let Ok(g) = Geometry::new(&[1, input, 8], &[8, k, 8], &p) else {
                                    continue;
                                };
                                check_phases(&g);
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(cases > 500, "{cases} geometries");
    }

    fn check_phases(g: &Geometry) {
        let (k, s, dil, pad) = (
            g.kernel[2] as i64,
            g.stride[2] as i64,
            g.kernel_dilation[2] as i64,
            g.pad_lo[2] as i64,
        );
        let out = g.output[2] as i64;
        let mut want = vec![];
        for x in 0..g.input[2] as i64 {
            for r in 0..k {
                let o = x + pad - r * dil;
                if o % s == 0 && (0..out).contains(&(o / s)) {
                    let w = if g.flip { k - 1 - r } else { r };
                    want.push((x, w, o / s));
                }
            }
        }
        let mut got = vec![];
        let mut written = vec![0; g.input[2]];
        for a in axes(Pass::BackwardData, g, 2) {
            for i in 0..a.walked {
                let x = (a.out_first + i * a.out_step) as i64;
                written[x as usize] += 1;
                for t in 0..a.taps {
                    let o = a.lower + i as i64 + (t * a.tap_step) as i64;
                    let w = a.weight_first + t as i64 * a.weight_step;
                    assert!((0..k).contains(&w), "{g:?}: weight tap {w}");
                    if (0..out).contains(&o) {
                        got.push((x, w, o));
                    }
                }
            }
        }
        want.sort();
        got.sort();
        assert_eq!(got, want, "{g:?}");
        assert!(written.iter().all(|&n| n == 1), "{g:?}: {written:?}");
    }
}
