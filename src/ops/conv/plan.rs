//! Choosing how to run a convolution: the tile, the vector widths, the split of the reduction,
//! and the launch geometry, kept in an LRU keyed like MLX's `ConvCacheKey` (plus input dilation
//! and the pass) so that a repeated convolution skips the choice.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, OnceLock};

use lru::LruCache;

use super::depthwise;
use super::direct;
use super::geometry::{Geometry, Pass, Problem};
use super::grouped;
use super::hopper;
use super::stand_in;
use super::stem;
use super::widen;
use crate::dtype::DType;
use crate::env::{Config, ConvPath, DEFAULT_CONV_CACHE_SIZE};
use crate::error::{Error, Result};
use crate::jit::{KernelSpec, LoadedKernel, TemplateDef};
use crate::ops::col_sums::{self, ColumnSum};
use crate::runtime::Device;

pub static IGEMM: TemplateDef = TemplateDef {
    name: "conv_igemm",
    ..IGEMM_FIELDS
};

/// `IGEMM` but for its name (its stand-in family shares the rest).
pub(super) const IGEMM_FIELDS: TemplateDef = TemplateDef {
    name: "",
    source: include_str!("../../../templates/conv_igemm.cu"),
    kernel: "kiln_conv_igemm",
    const_names: &[
        "PASS",
        "TENSOR",
        "BM",
        "BN",
        "WM",
        "WN",
        "STAGES",
        "VEC_A",
        "VEC_B",
        "TAP_TILES",
    ],
    arch_specific: false,
    only_arch: None,
};

/// A block's tile of C: `bm x bn`, with `wm x wn` warps on tensor cores (unused by the FMA
/// path, whose threads each take a square sub-tile).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tile {
    pub bm: u16,
    pub bn: u16,
    pub wm: u16,
    pub wn: u16,
    pub stages: u16,
    pub threads: u16,
    /// Throughput of an SM full of blocks of this tile, relative to the best tile of its path
    /// (100), as the bench's sweep measured it on the H100.
    efficiency: u8,
}

const fn tile(bm: u16, bn: u16, wm: u16, wn: u16, stages: u16, threads: u16, eff: u8) -> Tile {
    Tile {
        bm,
        bn,
        wm,
        wn,
        stages,
        threads,
        efficiency: eff,
    }
}

/// Whether `dtype` has tensor cores of its own precision (16-bit products) on architecture
/// `arch`: f16 from Turing (sm_75, as pairs of m16n8k8), bf16 from Ampere (sm_80, which brought
/// bf16 tensor cores). The 16-bit types on older GPUs take FMA paths: their operands are widened
/// to f32 as they are read from shared memory.
pub fn tensor_cores(dtype: DType, arch: u32) -> bool {
    match dtype {
        DType::F16 => arch >= 75,
        DType::BF16 => arch >= 80,
        _ => false,
    }
}

/// How the `mma.sync` family (`conv_igemm`) multiplies: its template's `TENSOR`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Math {
    /// The FMA units: f32 before sm_80, and 16-bit types without tensor cores.
    Fma,
    /// Tensor cores at the type's precision: 16-bit products, or (sm_80 on) f32 split into a
    /// TF32 high part and remainder, three TF32 products each (about 22 bits of each operand
    /// kept, where one TF32 product keeps 11).
    Tensor,
    /// f32 as one TF32 product (`KILN_ALLOW_TF32=1`, sm_80 on).
    Tf32,
}

impl Math {
    /// How `dtype` multiplies on `arch`; `allow_tf32`: `KILN_ALLOW_TF32`.
    pub fn of(dtype: DType, arch: u32, allow_tf32: bool) -> Math {
        match dtype {
            DType::F32 if arch >= 80 && allow_tf32 => Math::Tf32,
            DType::F32 if arch >= 80 => Math::Tensor,
            _ if tensor_cores(dtype, arch) => Math::Tensor,
            _ => Math::Fma,
        }
    }

    /// Whether it runs on tensor cores.
    pub fn tensor(self) -> bool {
        self != Math::Fma
    }

    /// The template's `TENSOR`.
    fn template_value(self) -> i32 {
        match self {
            Math::Fma => 0,
            Math::Tensor => 1,
            Math::Tf32 => 2,
        }
    }
}

/// Tensor-core tiles: k steps of 64 bytes (32 16-bit elements, 16 f32).
pub const TENSOR_TILES: [Tile; 5] = [
    tile(128, 128, 2, 4, 4, 256, 100),
    tile(128, 64, 2, 2, 4, 128, 75),
    tile(64, 128, 2, 2, 4, 128, 65),
    tile(64, 64, 2, 2, 4, 128, 65),
    // For few output columns (backward-data of 3 input channels, say).
    tile(128, 32, 4, 1, 4, 128, 55),
];
/// FMA tiles: k steps of 8, square per-thread tiles of 8 x 8.
pub const FMA_TILES: [Tile; 4] = [
    tile(128, 128, 0, 0, 3, 256, 85),
    tile(128, 64, 0, 0, 3, 128, 100),
    tile(64, 64, 0, 0, 3, 64, 95),
    // For few output columns.
    tile(128, 32, 0, 0, 3, 64, 90),
];

/// The tiles of the tensor-core path or the FMA path.
pub fn tiles(tensor: bool) -> &'static [Tile] {
    if tensor {
        &TENSOR_TILES
    } else {
        &FMA_TILES
    }
}

/// The k step of a tile (the template's BK): 64 bytes of a row on tensor cores. FMA
/// backward-weight takes 16: with vector loads both of its operands go straight to shared
/// memory, so the longer step costs no registers and halves the per-step overhead (table,
/// gathers, barrier) against the FMAs.
pub(super) fn block_k(dtype: DType, tensor: bool, pass: Pass) -> usize {
    match (tensor, pass) {
        (true, _) => 64 / dtype.size(),
        (false, Pass::BackwardWeight) => 16,
        (false, _) => 8,
    }
}

/// Elements one vector load moves: 16 bytes on tensor cores; 4 elements on the FMA path, whose
/// per-thread tiles and loaders are laid out in vectors of four (16 bytes of f32, 8 of a 16-bit
/// type).
fn vec_elems(dtype: DType, tensor: bool) -> u8 {
    if tensor {
        dtype.vec_width() as u8
    } else {
        4
    }
}

/// `math`: how it multiplies; `vec_a`, `vec_b`: elements per load of each operand (a vector,
/// or 1 where its channels or base do not allow vectors: only the stand-ins, which take any
/// key, load so; `conv_igemm` runs such keys widened, see `widen`); `tap_tiles`: every k tile
/// lies within one kernel tap (see [`tap_tiles`]).
pub fn igemm_spec(
    dtype: DType,
    pass: Pass,
    math: Math,
    t: Tile,
    vec_a: u8,
    vec_b: u8,
    tap_tiles: bool,
) -> KernelSpec {
    KernelSpec::new(
        &IGEMM,
        dtype,
        t.threads,
        1,
        &[
            pass as i32,
            math.template_value(),
            t.bm as i32,
            t.bn as i32,
            t.wm as i32,
            t.wn as i32,
            t.stages as i32,
            vec_a as i32,
            vec_b as i32,
            tap_tiles as i32,
        ],
    )
}

/// The split sum of `key`'s pass: the column sum of its per-split f32 partials, one row a split
/// and a column an output element (the weight gradient's).
pub fn split_sum_spec(key: &PlanKey) -> KernelSpec {
    col_sums::spec_for(key.dtype, split_sum_columns(key))
}

/// Columns of `key`'s split sum: the weight gradient's elements.
fn split_sum_columns(key: &PlanKey) -> usize {
    key.geometry.weight_shape().iter().product()
}

/// Every spec a plan can choose on architecture `arch` at the default precision (the
/// `KILN_ALLOW_TF32` opt-in's one-product f32 kernels are compiled on first use).
pub fn specs(arch: u32) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for dtype in DType::ALL {
        let math = Math::of(dtype, arch, false);
        let tensor = math.tensor();
        for pass in Pass::ALL {
            let v = vec_elems(dtype, tensor);
            for &t in tiles(tensor) {
                out.push(igemm_spec(dtype, pass, math, t, v, v, false));
                if pass != Pass::BackwardWeight {
                    out.push(igemm_spec(dtype, pass, math, t, v, v, true));
                }
            }
        }
    }
    out.extend(depthwise::specs(arch));
    if arch >= grouped::MIN_ARCH {
        out.extend(grouped::specs());
    }
    out.extend(direct::specs());
    out.extend(stem::specs(arch));
    if arch == hopper::ARCH {
        out.extend(hopper::specs());
    }
    // Each once: passes that run the same code ask for one spec, and shapes may share a spec.
    let mut seen = std::collections::HashSet::new();
    out.retain(|spec| seen.insert(*spec));
    out
}

/// Shared memory a block of `t` needs: STAGES buffers of both operand tiles (rows padded as the
/// template pads them) and, unless tap tiles or backward-weight's cursors replace them, two
/// k-index tables.
pub fn shared_bytes(dtype: DType, pass: Pass, tensor: bool, t: Tile, tap_tiles: bool) -> usize {
    let bk = block_k(dtype, tensor, pass);
    let a_k = pass != Pass::BackwardWeight;
    let b_k = pass == Pass::Forward;
    let stage = |rows: usize, global_k: bool| {
        if tensor && global_k {
            rows * (bk + 16 / dtype.size())
        } else {
            bk * (rows + if tensor { 8 } else { 4 })
        }
    };
    let elems = stage(t.bm as usize, a_k) + stage(t.bn as usize, b_k);
    let tables = !tap_tiles && pass != Pass::BackwardWeight;
    t.stages as usize * elems * dtype.size() + if tables { 2 * bk * 32 } else { 0 }
}

/// What the launch needs, chosen once per problem.
pub struct Plan {
    pub kernel: Arc<LoadedKernel>,
    pub spec: KernelSpec,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub shared: u32,
    /// Blocks along the reduction (backward-weight), each writing one set of f32 partials when
    /// the plan has a `split_sum`.
    pub splits: usize,
    /// The column sum that adds the partials up into the output (one row of `splits` a split),
    /// when the plan's kernel writes f32 partials (a split reduction, or a swapped Hopper tile
    /// even unsplit).
    pub split_sum: Option<ColumnSum>,
    pub kind: Kind,
}

/// The kernel family a plan runs, with its view of the problem.
pub enum Kind {
    /// `mma.sync` / FMA implicit GEMM (`conv_igemm`), operands read through pointers.
    Igemm(Problem),
    /// The Hopper family (`conv_wgmma`), operands read through tensor maps.
    Wgmma(hopper::Launch),
    /// The depthwise family (`conv_depthwise`) for 1-D and 2-D depthwise layers.
    Depthwise(depthwise::Launch),
    /// The grouped family (`conv_grouped`) for few channels a group on 16-bit tensor cores.
    Grouped(grouped::Launch),
    /// The direct family (`conv_direct`) for few channels per group.
    Direct(direct::Launch),
    /// The stem family (`conv_stem`) for 1 to 4 input channels.
    Stem(stem::Launch),
}

/// The plan cache's key: MLX's `ConvCacheKey` fields (device, dtype, shapes, stride, padding,
/// dilation, groups, flip, alignment), plus input dilation and the pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanKey {
    /// The device's [`Device::id`](crate::runtime::Device::id).
    pub device: usize,
    /// The architecture whose code paths the device runs ([`Device::arch`]).
    pub arch: u32,
    pub dtype: DType,
    pub pass: Pass,
    pub geometry: Geometry,
    /// Whether each operand may use 16-byte loads (channels and base addresses allow it).
    pub vec_a: bool,
    pub vec_b: bool,
    /// Whether both operands' base addresses are 16-byte aligned (the direct family's vector
    /// loads need it whatever the channel counts).
    pub aligned: bool,
    /// `KILN_ALLOW_TF32`: f32 may multiply as one TF32 product.
    pub tf32: bool,
}

impl PlanKey {
    /// How the `mma.sync` family multiplies this key.
    pub fn math(&self) -> Math {
        Math::of(self.dtype, self.arch, self.tf32)
    }

    /// Whether the `mma.sync` family runs this key on tensor cores (else on FMA units).
    pub fn tensor(&self) -> bool {
        self.math().tensor()
    }

    /// Whether both GEMM operands may be read in 16-byte vectors (channels and bases allow it).
    pub fn vectors(&self) -> bool {
        self.vec_a && self.vec_b
    }
}

struct PlanCache {
    plans: LruCache<PlanKey, Arc<Plan>>,
    hits: u64,
    misses: u64,
}

fn cache() -> &'static Mutex<PlanCache> {
    static CACHE: OnceLock<Mutex<PlanCache>> = OnceLock::new();
    CACHE.get_or_init(|| {
        // An invalid MLX_CUDA_CONV_CACHE_SIZE is reported by `plan`, which reads the
        // configuration before it makes any plan; until then the default size holds.
        let size = Config::from_env().map_or(DEFAULT_CONV_CACHE_SIZE, |c| c.conv_cache_size);
        Mutex::new(PlanCache {
            plans: LruCache::new(NonZeroUsize::new(size.max(1)).unwrap_or(NonZeroUsize::MIN)),
            hits: 0,
            misses: 0,
        })
    })
}

/// Plan-cache counters: (hits, misses, entries held).
pub fn cache_stats() -> (u64, u64, usize) {
    let c = cache().lock().unwrap_or_else(|e| e.into_inner());
    (c.hits, c.misses, c.plans.len())
}

/// The cached plan for `key`, or a new one. An invalid environment variable (`KILN_CONV_PATH`,
/// `MLX_CUDA_CONV_CACHE_SIZE`, ...) is an error when a plan must be made.
pub fn plan(device: &Device, key: PlanKey) -> Result<Arc<Plan>> {
    match cached(&key) {
        Some(p) => Ok(p),
        None => create(device, key),
    }
}

/// The plan cache's plan for `key`, counted as a hit or a miss.
pub fn cached(key: &PlanKey) -> Option<Arc<Plan>> {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    let found = c.plans.get(key).cloned();
    match found {
        Some(_) => c.hits += 1,
        None => c.misses += 1,
    }
    found
}

/// A new plan for `key` from the model, kept in the plan cache. The kernels the same
/// convolution's other passes would use are queued for compiling in the background first (a
/// training step runs all three), so that their compiles overlap this one's. On a cold start
/// (`KILN_STAND_INS`, the chosen kernels not compiled yet) the chosen kernels are queued too and
/// the call gets a stand-in plan, which is not cached: a later call looks again.
pub fn create(device: &Device, key: PlanKey) -> Result<Arc<Plan>> {
    let path = Config::from_env()?.conv_path;
    let choice = Choice::of(device, path, &key);
    let missing = if device.jit().stand_ins() {
        device.missing(&choice.kernels(&key))?
    } else {
        Vec::new()
    };
    let cold = !missing.is_empty();
    let companions = companion_keys(device, path, &key);
    if cold {
        // The other passes' stand-ins at once: the next calls need them soonest.
        device.prefetch_urgent(
            companions
                .iter()
                .flat_map(stand_in::specs)
                .collect::<Vec<_>>(),
        );
        device.prefetch(missing);
    }
    device.prefetch(companion_specs(device, path, &companions));
    if cold {
        match stand_in::plan(device, &key) {
            Ok(plan) => return Ok(Arc::new(plan)),
            Err(e) => {
                tracing::warn!(error = %e, "conv stand-in failed; compiling the chosen kernel")
            }
        }
    }
    let plan = Arc::new(choice.build(device, &key)?);
    remember(key, plan.clone());
    Ok(plan)
}

/// The family and launch the model picks for a key, before any kernel is loaded.
enum Choice {
    Depthwise(KernelSpec, depthwise::Launch),
    Grouped(KernelSpec, grouped::Launch),
    Direct(KernelSpec, direct::Launch),
    Stem(KernelSpec, stem::Launch),
    Wgmma(KernelSpec, hopper::Launch),
    /// The `mma.sync` / FMA family: its tile and splits.
    Igemm(Tile, usize),
}

impl Choice {
    /// The first family, in order of preference, that takes `key`; `conv_igemm` takes any whose
    /// operands load in vectors (the others run widened: see [`widens`]).
    fn of(device: &Device, path: ConvPath, key: &PlanKey) -> Choice {
        Choice::family(device, path, key).unwrap_or_else(|| {
            let (t, splits) = choose(device, key);
            Choice::Igemm(t, splits)
        })
    }

    /// The first family other than `conv_igemm` that takes `key`, if any.
    fn family(device: &Device, path: ConvPath, key: &PlanKey) -> Option<Choice> {
        if let Some((spec, launch)) = depthwise::plan(device, path, key) {
            Some(Choice::Depthwise(spec, launch))
        } else if let Some((spec, launch)) = grouped::plan(device, path, key) {
            Some(Choice::Grouped(spec, launch))
        } else if let Some((spec, launch)) = direct::plan(device, path, key) {
            Some(Choice::Direct(spec, launch))
        } else if let Some((spec, launch)) = stem::plan(device, path, key) {
            Some(Choice::Stem(spec, launch))
        } else {
            hopper::plan(device, path, key).map(|(spec, launch)| Choice::Wgmma(spec, launch))
        }
    }

    /// The kernels the plan loads: the family's, the split sum where it writes partials, and the
    /// transposing copy where it turns the weight round.
    fn kernels(&self, key: &PlanKey) -> Vec<KernelSpec> {
        let (spec, partials) = match self {
            Choice::Depthwise(spec, l) => (*spec, l.splits > 1),
            Choice::Grouped(spec, l) => (*spec, l.splits > 1),
            Choice::Direct(spec, l) => (*spec, l.splits > 1),
            Choice::Stem(spec, l) => (*spec, l.splits > 1),
            Choice::Wgmma(spec, l) => (*spec, l.writes_partials()),
            Choice::Igemm(t, splits) => (igemm_spec_for(key, *t), *splits > 1),
        };
        let mut out = vec![spec];
        if partials {
            out.push(split_sum_spec(key));
        }
        if matches!(self, Choice::Wgmma(_, l) if l.turns_weight() || l.turns_cotangent()) {
            out.push(crate::runtime::copy::transpose_spec(key.dtype));
        }
        out
    }

    fn build(self, device: &Device, key: &PlanKey) -> Result<Plan> {
        match self {
            Choice::Depthwise(spec, launch) => build_depthwise(device, key, spec, launch),
            Choice::Grouped(spec, launch) => {
                let geometry = (
                    launch.phases[0].grid,
                    grouped::THREADS as u32,
                    launch.shared,
                    launch.splits,
                );
                build_gather(device, key, spec, geometry, Kind::Grouped(launch))
            }
            Choice::Direct(spec, launch) => build_direct(device, key, spec, launch),
            Choice::Stem(spec, launch) => build_stem(device, key, spec, launch),
            Choice::Wgmma(spec, launch) => build_wgmma(device, key, spec, launch),
            Choice::Igemm(t, splits) => build(device, key, t, splits),
        }
    }
}

/// What the tiled stencil families (depthwise, grouped) share in what they take: 1-D and 2-D
/// layers, kernels up to `max_kernel` taps a side, strides up to `max_stride` (for
/// backward-data `max_data_stride`), no dilation. Why not, or None.
pub fn tile_limits(
    key: &PlanKey,
    max_kernel: usize,
    max_stride: usize,
    max_data_stride: usize,
) -> Option<&'static str> {
    let g = &key.geometry;
    if g.spatial > 2 {
        return Some("3-D");
    }
    if g.kernel[1..].iter().any(|&k| k > max_kernel) {
        return Some("a kernel wider than the family's");
    }
    let most = if key.pass == Pass::BackwardData {
        max_data_stride
    } else {
        max_stride
    };
    if g.stride[1..].iter().any(|&s| s > most) {
        return Some("a stride larger than the family's");
    }
    if g.kernel_dilation != [1; 3] || g.input_dilation != [1; 3] {
        return Some("dilation");
    }
    None
}

/// A sm_90 key for `pass` of the convolution of `x` by `w` (aligned operands, no vector flags),
/// for the conv families' unit tests.
#[cfg(test)]
pub fn test_key(
    dtype: DType,
    pass: Pass,
    x: &[usize],
    w: &[usize],
    p: &super::geometry::ConvParams,
) -> PlanKey {
    PlanKey {
        device: 0,
        arch: 90,
        dtype,
        pass,
        geometry: Geometry::new(x, w, p).unwrap(),
        vec_a: false,
        vec_b: false,
        aligned: true,
        tf32: false,
    }
}

/// How a persistent gather family's blocks (depthwise, grouped) share `tiles` tiles: blocks
/// along x for each of `blocks_y` blocks along y, out of `blocks` that the SMs hold at once;
/// returned as (blocks along x, splits, tiles a split). Forward and backward-data blocks walk
/// every x-th tile; backward-weight's each sum a run of tiles (a split, one f32 partial). Rounded
/// down: a block past what the SMs hold would run as a second wave and take as long again.
pub fn persistent_grid(
    pass: Pass,
    blocks: usize,
    blocks_y: usize,
    tiles: usize,
) -> (usize, usize, usize) {
    let tiles = tiles.max(1);
    let per_y = (blocks / blocks_y.max(1)).clamp(1, tiles);
    if pass == Pass::BackwardWeight {
        let per_split = tiles.div_ceil(per_y);
        let splits = tiles.div_ceil(per_split);
        (splits, splits, per_split)
    } else {
        (per_y, 1, 0)
    }
}

/// Whether each GEMM operand of `pass` may use vector loads as far as the channel counts go:
/// the channel run its vectors lie in (see the template's gather) is a multiple of the vector
/// width. (Each array's alignment decides too.)
pub fn channel_vectors(dtype: DType, pass: Pass, g: &Geometry) -> (bool, bool) {
    let (cin_g, cout_g) = (g.cin / g.groups, g.cout / g.groups);
    let w = dtype.vec_width();
    let (run_a, run_b) = match pass {
        Pass::Forward => (cin_g, cin_g),
        Pass::BackwardData => (cout_g, cin_g),
        Pass::BackwardWeight => (cout_g, cin_g),
    };
    (run_a % w == 0, run_b % w == 0)
}

/// Whether `key` runs widened (see `widen`): no family but `conv_igemm` takes it, and its
/// operands do not load in vectors, as `conv_igemm` needs. An invalid `KILN_CONV_PATH` is an
/// error.
pub fn widens(device: &Device, key: &PlanKey) -> Result<bool> {
    let path = Config::from_env()?.conv_path;
    Ok(widens_on(device, path, key))
}

fn widens_on(device: &Device, path: ConvPath, key: &PlanKey) -> bool {
    !key.vectors() && Choice::family(device, path, key).is_none()
}

/// The keys the other two passes of `key`'s convolution run as: with aligned operands, and
/// widened where that is how they run.
fn companion_keys(device: &Device, path: ConvPath, key: &PlanKey) -> Vec<PlanKey> {
    other_passes(key)
        .map(|other| {
            if widens_on(device, path, &other) {
                widen::key(&other)
            } else {
                other
            }
        })
        .collect()
}

/// The kernels `companions` (see [`companion_keys`]) would load, for those not cached yet (the
/// split sum included where a pass splits its reduction).
fn companion_specs(device: &Device, path: ConvPath, companions: &[PlanKey]) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for other in companions {
        if !cached_quietly(other) {
            out.extend(Choice::of(device, path, other).kernels(other));
        }
    }
    out
}

/// The keys of the other two passes of `key`'s convolution, with aligned operands.
fn other_passes(key: &PlanKey) -> impl Iterator<Item = PlanKey> + '_ {
    Pass::ALL
        .into_iter()
        .filter(|&p| p != key.pass)
        .map(|pass| {
            let (vec_a, vec_b) = channel_vectors(key.dtype, pass, &key.geometry);
            PlanKey {
                pass,
                vec_a,
                vec_b,
                aligned: true,
                ..*key
            }
        })
}

/// Whether the plan cache holds `key`, without counting a hit or a miss.
pub(super) fn cached_quietly(key: &PlanKey) -> bool {
    let c = cache().lock().unwrap_or_else(|e| e.into_inner());
    c.plans.contains(key)
}

/// Keeps `plan` as the plan for `key` (a measured choice; see `autotune`).
pub fn remember(key: PlanKey, plan: Arc<Plan>) {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    c.plans.put(key, plan);
}

/// A Hopper plan with `tile` and `splits` (benchmark sweeps); not cached.
pub fn plan_wgmma(
    device: &Device,
    key: PlanKey,
    tile: hopper::Tile,
    splits: usize,
) -> Result<Plan> {
    let sms = device.info().multiprocessors as usize;
    let (spec, launch) = hopper::launch_for(&key, tile, splits, sms);
    build_wgmma(device, &key, spec, launch)
}

/// A plan with the tile and split given (benchmark sweeps); not cached.
pub fn plan_with(device: &Device, key: PlanKey, t: Tile, splits: usize) -> Result<Plan> {
    build(device, &key, t, splits)
}

fn vec_for(dtype: DType, tensor: bool, allowed: bool) -> u8 {
    if allowed {
        vec_elems(dtype, tensor)
    } else {
        1
    }
}

/// Whether every k tile lies within one kernel tap, so the kernel can skip its per-tile table
/// of what each k index means: forward and backward-data whose reduced channels per group are a
/// multiple of the k step, with 16-byte loads on both operands; forward without input dilation
/// (which leaves holes between taps), backward-data by stride phase or at stride 1 (a strided
/// unphased tap may land between cotangent pixels).
pub fn tap_tiles(key: &PlanKey) -> bool {
    let g = &key.geometry;
    let bk = block_k(key.dtype, key.tensor(), key.pass);
    let ones = |v: &[usize; 3]| v.iter().all(|&x| x == 1);
    key.vec_a
        && key.vec_b
        && match key.pass {
            Pass::Forward => (g.cin / g.groups) % bk == 0 && ones(&g.input_dilation),
            Pass::BackwardData => {
                (g.cout / g.groups) % bk == 0 && (key.pass.phases(g) > 1 || ones(&g.stride))
            }
            Pass::BackwardWeight => false,
        }
}

/// The `conv_igemm` spec that runs `key` with tile `t`.
pub(super) fn igemm_spec_for(key: &PlanKey, t: Tile) -> KernelSpec {
    let (math, tensor) = (key.math(), key.tensor());
    igemm_spec(
        key.dtype,
        key.pass,
        math,
        t,
        vec_for(key.dtype, tensor, key.vec_a),
        vec_for(key.dtype, tensor, key.vec_b),
        tap_tiles(key),
    )
}

/// An `mma.sync` family launch, before its kernel is loaded.
pub struct IgemmLaunch {
    pub spec: KernelSpec,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub shared: usize,
    pub splits: usize,
    pub problem: Problem,
}

/// The launch of `key` with tile `t` and (backward-weight) `splits` splits of the reduction, on
/// a GPU whose blocks may use `shared_limit` bytes of shared memory.
pub fn igemm_launch(
    key: &PlanKey,
    t: Tile,
    splits: usize,
    shared_limit: usize,
) -> Result<IgemmLaunch> {
    let (tensor, tap) = (key.tensor(), tap_tiles(key));
    let spec = igemm_spec_for(key, t);
    let shared = shared_bytes(key.dtype, key.pass, tensor, t, tap);
    if shared > shared_limit {
        return Err(Error::InvalidArgument {
            arg: "tile",
            reason: format!(
                "{}x{} with {} stages needs {shared} bytes of shared memory; this GPU's blocks \
                 may use {shared_limit}",
                t.bm, t.bn, t.stages,
            ),
        });
    }
    let g = &key.geometry;
    let (m, n, k) = key.pass.block_gemm(g);
    let k_tiles = k.div_ceil(block_k(key.dtype, tensor, key.pass));
    let per_split = k_tiles.div_ceil(splits.max(1)).max(1);
    let splits = k_tiles.div_ceil(per_split).max(1);
    let z = g.groups * key.pass.phases(g) * splits;
    let y = n.div_ceil(t.bn as usize);
    if z > MAX_GRID_YZ || y > MAX_GRID_YZ {
        return Err(Error::InvalidArgument {
            arg: "groups",
            reason: format!(
                "{} groups x {} stride phases x {splits} splits and {y} column tiles exceed the \
                 grid's limit of {MAX_GRID_YZ} blocks along y and z",
                g.groups,
                key.pass.phases(g)
            ),
        });
    }
    Ok(IgemmLaunch {
        spec,
        grid: (m.div_ceil(t.bm as usize) as u32, y as u32, z as u32),
        threads: t.threads as u32,
        shared,
        splits,
        problem: Problem::new(g, key.pass, per_split, splits),
    })
}

fn build(device: &Device, key: &PlanKey, t: Tile, splits: usize) -> Result<Plan> {
    if !key.vectors() {
        // `conv::run` widens such keys first; reaching here is kiln's own mistake.
        return Err(Error::InvalidArgument {
            arg: "operands",
            reason: "conv_igemm reads its operands in 16-byte vectors; a key whose channels or \
                     bases do not allow it runs widened (ops::conv::widen)"
                .into(),
        });
    }
    build_igemm(
        device,
        key,
        igemm_launch(key, t, splits, device.shared_limit())?,
    )
}

/// The plan of an `mma.sync` family launch (`launch.spec` may be of another family with the
/// same template, such as a stand-in's).
pub(super) fn build_igemm(device: &Device, key: &PlanKey, launch: IgemmLaunch) -> Result<Plan> {
    let kernel = device.kernel(&launch.spec)?;
    kernel.allow_shared(launch.shared)?;
    let split_sum = split_sum_for(device, key, launch.splits > 1)?;
    Ok(Plan {
        kernel,
        spec: launch.spec,
        grid: launch.grid,
        threads: launch.threads,
        shared: launch.shared as u32,
        splits: launch.splits,
        split_sum,
        kind: Kind::Igemm(launch.problem),
    })
}

/// The column sum that adds the f32 partials up, when the plan's kernel writes them.
fn split_sum_for(device: &Device, key: &PlanKey, partials: bool) -> Result<Option<ColumnSum>> {
    if partials {
        let columns = split_sum_columns(key);
        Ok(Some(ColumnSum::load(device, key.dtype, columns)?))
    } else {
        Ok(None)
    }
}

fn build_wgmma(
    device: &Device,
    key: &PlanKey,
    spec: KernelSpec,
    mut launch: hopper::Launch,
) -> Result<Plan> {
    let kernel = device.kernel(&spec)?;
    let shared = hopper::shared_bytes(launch.tile);
    kernel.allow_shared(shared)?;
    if kernel.cluster {
        launch.set_clusters(kernel.max_active_clusters(hopper::THREADS as u32, shared)?);
    }
    let splits = launch.splits;
    let split_sum = split_sum_for(device, key, launch.writes_partials())?;
    Ok(Plan {
        kernel,
        spec,
        // Each phase's launch takes its own grid (Launch::blocks).
        grid: (launch.max_blocks as u32, 1, 1),
        threads: hopper::THREADS as u32,
        shared: shared as u32,
        splits,
        split_sum,
        kind: Kind::Wgmma(launch),
    })
}

fn build_direct(
    device: &Device,
    key: &PlanKey,
    spec: KernelSpec,
    launch: direct::Launch,
) -> Result<Plan> {
    let threads = launch.block.0 * launch.block.1 * launch.block.2;
    let geometry = (launch.grid, threads, launch.shared, launch.splits);
    build_gather(device, key, spec, geometry, Kind::Direct(launch))
}

fn build_depthwise(
    device: &Device,
    key: &PlanKey,
    spec: KernelSpec,
    mut launch: depthwise::Launch,
) -> Result<Plan> {
    let (x, y, z) = launch.block;
    let threads = x * y * z;
    if launch.shape.variant == depthwise::Variant::Tensor {
        let kernel = device.kernel(&spec)?;
        kernel.allow_shared(launch.shared)?;
        let per_sm = kernel.blocks_per_sm(threads, launch.shared)?;
        launch.fill(device.info().multiprocessors as usize, per_sm);
    }
    let geometry = (launch.grid, threads, launch.shared, launch.splits);
    build_gather(device, key, spec, geometry, Kind::Depthwise(launch))
}

fn build_stem(
    device: &Device,
    key: &PlanKey,
    spec: KernelSpec,
    mut launch: stem::Launch,
) -> Result<Plan> {
    let kernel = device.kernel(&spec)?;
    kernel.allow_shared(launch.shared)?;
    let per_sm = kernel.blocks_per_sm(stem::THREADS as u32, launch.shared)?;
    launch.fill(device.info().multiprocessors as usize, per_sm);
    let geometry = (
        launch.grid,
        stem::THREADS as u32,
        launch.shared,
        launch.splits,
    );
    build_gather(device, key, spec, geometry, Kind::Stem(launch))
}

/// A plan for a gather family (depthwise, grouped, direct, stem): its kernel with `shared` bytes allowed, and the
/// split sum when `splits` > 1.
fn build_gather(
    device: &Device,
    key: &PlanKey,
    spec: KernelSpec,
    (grid, threads, shared, splits): ((u32, u32, u32), u32, usize, usize),
    kind: Kind,
) -> Result<Plan> {
    let kernel = device.kernel(&spec)?;
    kernel.allow_shared(shared)?;
    let split_sum = split_sum_for(device, key, splits > 1)?;
    Ok(Plan {
        kernel,
        spec,
        grid,
        threads,
        shared: shared as u32,
        splits,
        split_sum,
        kind,
    })
}

/// Largest grid dims the driver takes along y and z.
pub(super) const MAX_GRID_YZ: usize = 65535;

/// Registers a thread of the kernel uses, roughly as ptxas reports them for sm_90: the
/// 256-thread FMA tile is capped at 128, the tap-tile kernels need fewer than the table ones.
fn registers(tensor: bool, t: Tile, tap_tiles: bool) -> usize {
    match (tensor, t.threads, tap_tiles) {
        (false, 256, _) => 128,
        (false, _, _) => 192,
        (true, _, true) => 168,
        (true, _, false) => 248,
    }
}

/// Picks the tile, and for backward-weight the split of the reduction, with the least modelled
/// time. The model: blocks spread over the SMs, each SM holding as many at once
/// as fit (threads, shared memory, registers) but no more than its share; an SM needs about 8
/// warps to reach its tile's throughput; the time is the rounds of such SM loads times the work
/// of one.
fn choose(device: &Device, key: &PlanKey) -> (Tile, usize) {
    pick(
        device.info().multiprocessors as usize,
        device.shared_limit(),
        key,
    )
}

/// `choose` for a GPU of `sms` multiprocessors and `optin` bytes of shared memory per block.
pub fn pick(sms: usize, optin: usize, key: &PlanKey) -> (Tile, usize) {
    let g = &key.geometry;
    let (m, n, k) = key.pass.block_gemm(g);
    let groups = g.groups * key.pass.phases(g);
    let tensor = key.tensor();
    let bk = block_k(key.dtype, tensor, key.pass);
    let tap = tap_tiles(key);
    let mut best: Option<(f64, Tile, usize)> = None;
    for &t in tiles(tensor) {
        let shared = shared_bytes(key.dtype, key.pass, tensor, t, tap);
        if shared > optin || n.div_ceil(t.bn as usize) > MAX_GRID_YZ {
            continue;
        }
        let threads = t.threads as usize;
        let blocks = m.div_ceil(t.bm as usize) * n.div_ceil(t.bn as usize) * groups;
        let per_sm = (2048 / threads)
            .min(optin / shared.max(1))
            .min(65536 / (registers(tensor, t, tap) * threads))
            .max(1);
        // Backward-weight may split its reduction, each split keeping at least 8 k tiles,
        // within the grid's z limit.
        let most = match key.pass {
            Pass::BackwardWeight => (k.div_ceil(bk) / 8).clamp(1, MAX_GRID_YZ / groups.max(1)),
            _ => 1,
        };
        for splits in 1..=most {
            let total = blocks * splits;
            let at_once = per_sm.min(total.div_ceil(sms)).max(1);
            let rounds = total.div_ceil(sms * at_once) as f64;
            let rate = t.efficiency as f64 * (at_once as f64 * threads as f64 / 256.0).min(1.0);
            // A block also pays about four k steps for its prologue and epilogue.
            let k_work = (k.div_ceil(splits) + 4 * bk) as f64;
            let cost = rounds * at_once as f64 * (t.bm as f64 * t.bn as f64) * k_work / rate;
            if best.map_or(true, |(c, _, _)| cost < c) {
                best = Some((cost, t, splits));
            }
        }
    }
    let last = tiles(tensor)[tiles(tensor).len() - 1];
    let (_, t, splits) = best.unwrap_or((0.0, last, 1));
    (t, splits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_are_distinct_and_cover_every_choice() {
        for arch in [70, 72, 75, 80, 86, 90, 100] {
            let all = specs(arch);
            let unique: std::collections::HashSet<_> = all.iter().collect();
            assert_eq!(unique.len(), all.len());
            for dtype in DType::ALL {
                let math = Math::of(dtype, arch, false);
                let tensor = math.tensor();
                for pass in Pass::ALL {
                    for &t in tiles(tensor) {
                        for a in [true, false] {
                            for b in [true, false] {
                                for tap in [false, true] {
                                    let s = igemm_spec(
                                        dtype,
                                        pass,
                                        math,
                                        t,
                                        vec_for(dtype, tensor, a),
                                        vec_for(dtype, tensor, b),
                                        tap,
                                    );
                                    // conv_igemm loads whole vectors (other keys run
                                    // widened); tap tiles are not for backward-weight.
                                    let possible = a && b && !(tap && pass == Pass::BackwardWeight);
                                    assert_eq!(unique.contains(&s), possible, "{s}");
                                }
                            }
                        }
                    }
                }
            }
            let hopper = all.iter().filter(|s| s.template.name == hopper::WGMMA.name);
            assert_eq!(hopper.count() > 0, arch == 90, "sm_{arch}");
        }
    }

    #[test]
    fn tensor_cores_where_the_architecture_has_them() {
        assert!(!tensor_cores(DType::F16, 70) && !tensor_cores(DType::F16, 72));
        assert!(tensor_cores(DType::F16, 75) && !tensor_cores(DType::BF16, 75));
        assert!(tensor_cores(DType::BF16, 80) && tensor_cores(DType::F16, 90));
        assert!(
            !tensor_cores(DType::F32, 90),
            "no f32 products of f32's precision"
        );
        // f32 splits into TF32 parts from sm_80 on; one TF32 product only when allowed.
        assert_eq!(Math::of(DType::F32, 75, true), Math::Fma);
        assert_eq!(Math::of(DType::F32, 80, false), Math::Tensor);
        assert_eq!(Math::of(DType::F32, 90, true), Math::Tf32);
        assert_eq!(Math::of(DType::BF16, 90, true), Math::Tensor);
        assert_eq!(Math::of(DType::F16, 70, true), Math::Fma);
    }

    #[test]
    fn tap_tiles_where_every_k_tile_is_one_tap() {
        use super::super::geometry::ConvParams;
        let key = |dtype, pass, cin: usize, cout: usize, p: ConvParams| PlanKey {
            device: 0,
            arch: 90,
            dtype,
            pass,
            geometry: Geometry::new(&[2, 9, 9, cin], &[cout, 3, 3, cin / p.groups], &p).unwrap(),
            vec_a: true,
            vec_b: true,
            aligned: true,
            tf32: false,
        };
        let d = ConvParams::default;
        let (f16, f32) = (DType::F16, DType::F32);
        let (fwd, dgrad, wgrad) = (Pass::Forward, Pass::BackwardData, Pass::BackwardWeight);
        assert!(tap_tiles(&key(f16, fwd, 64, 40, d())));
        assert!(
            !tap_tiles(&key(f16, fwd, 48, 64, d())),
            "48 channels span taps"
        );
        assert!(tap_tiles(&key(f32, fwd, 48, 64, d())));
        assert!(
            !tap_tiles(&key(f16, fwd, 64, 64, d().groups(4))),
            "16 per group"
        );
        assert!(tap_tiles(&key(f16, fwd, 64, 64, d().groups(2))));
        assert!(!tap_tiles(&key(f16, fwd, 64, 64, d().input_dilation(&[2]))));
        assert!(tap_tiles(&key(f16, dgrad, 8, 64, d().input_dilation(&[2]))));
        assert!(
            tap_tiles(&key(f16, dgrad, 8, 64, d().strides(&[2]))),
            "phased"
        );
        let unphased = d().strides(&[2]).kernel_dilation(&[2]);
        assert!(!tap_tiles(&key(f16, dgrad, 8, 64, unphased)));
        assert!(!tap_tiles(&key(f16, wgrad, 64, 64, d())));
        let mut scalar = key(f16, fwd, 64, 64, d());
        scalar.vec_b = false;
        assert!(!tap_tiles(&scalar));
    }

    /// The model against the bench's sweep on the H100 (132 SMs, 227 KiB): the tile that
    /// measured fastest, or within a few percent of it.
    #[test]
    fn the_model_picks_the_measured_tiles() {
        let key = |shape: [usize; 9], pass| {
            let [n, c, h, w, k, r, s, stride, pad] = shape;
            let p = super::super::geometry::ConvParams::default()
                .strides(&[stride])
                .padding(&[pad]);
            PlanKey {
                device: 0,
                arch: 90,
                dtype: DType::BF16,
                pass,
                geometry: Geometry::new(&[n, h, w, c], &[k, r, s, c], &p).unwrap(),
                vec_a: true,
                vec_b: true,
                aligned: true,
                tf32: false,
            }
        };
        let picked = |shape, pass| {
            let (t, _) = pick(132, 227 * 1024, &key(shape, pass));
            (t.bm, t.bn)
        };
        let fwd = Pass::Forward;
        // 1x1, 64 -> 256 at 56x56: 52 TFLOP/s against 28-39 for the smaller tiles.
        assert_eq!(picked([32, 64, 56, 56, 256, 1, 1, 1, 0], fwd), (128, 128));
        // 3x3 at 7x7, 512 channels: 106 against 63-80 (few blocks: small tiles fill the GPU).
        assert_eq!(picked([32, 512, 7, 7, 512, 3, 3, 1, 1], fwd), (64, 64));
        // 3x3 at 56x56, 64 channels (n = 64): 83 against 75 for 128x128.
        assert_eq!(picked([32, 64, 56, 56, 64, 3, 3, 1, 1], fwd), (128, 64));
        // 3x3 at 28x28, 128 channels: 111 against 98.
        assert_eq!(picked([32, 128, 28, 28, 128, 3, 3, 1, 1], fwd), (128, 128));
    }

    #[test]
    fn shared_memory_fits_an_a100_and_some_tile_fits_every_gpu() {
        // sm_80's opt-in limit is 163 KiB: every tile fits. Turing's 64 KiB is the smallest
        // limit kiln meets: some tile of each path fits it.
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                for tensor in [true, false] {
                    let fit = |limit: usize| {
                        tiles(tensor)
                            .iter()
                            .filter(|&&t| shared_bytes(dtype, pass, tensor, t, false) <= limit)
                            .count()
                    };
                    assert_eq!(fit(163 * 1024), tiles(tensor).len());
                    assert!(fit(64 * 1024) > 0, "{dtype} {pass:?} tensor={tensor}");
                }
            }
        }
    }

    #[test]
    fn turing_and_volta_pick_tiles_that_fit_them() {
        let g = Geometry::new(
            &[8, 28, 28, 128],
            &[128, 3, 3, 128],
            &super::super::geometry::ConvParams::default().padding(&[1]),
        )
        .unwrap();
        for (arch, optin) in [(75, 64 * 1024), (70, 96 * 1024)] {
            for dtype in DType::ALL {
                for pass in Pass::ALL {
                    let key = PlanKey {
                        device: 0,
                        arch,
                        dtype,
                        pass,
                        geometry: g,
                        vec_a: true,
                        vec_b: true,
                        aligned: true,
                        tf32: false,
                    };
                    let (t, _) = pick(40, optin, &key);
                    assert!(tiles(key.tensor()).contains(&t));
                    let bytes = shared_bytes(dtype, pass, key.tensor(), t, tap_tiles(&key));
                    assert!(bytes <= optin, "sm_{arch} {dtype} {pass:?}: {bytes}");
                }
            }
        }
    }
}
