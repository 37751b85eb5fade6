//! Choosing how to run a convolution: the tile, the vector widths, the split of the reduction,
//! and the launch geometry, kept in an LRU keyed like MLX's `ConvCacheKey` (plus input dilation
//! and the pass) so that a repeated convolution skips the choice.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, OnceLock};

use lru::LruCache;

use super::geometry::{Geometry, Pass, Problem};
use crate::dtype::DType;
use crate::env::Config;
use crate::error::{Error, Result};
use crate::jit::{KernelSpec, LoadedKernel, TemplateDef};
use crate::runtime::Device;

pub static IGEMM: TemplateDef = TemplateDef {
    name: "conv_igemm",
    source: include_str!("../../../templates/conv_igemm.cu"),
    kernel: "kiln_conv_igemm",
    const_names: &["PASS", "BM", "BN", "WM", "WN", "STAGES", "VEC_A", "VEC_B"],
    arch_specific: false,
};

pub static SPLIT_SUM: TemplateDef = TemplateDef {
    name: "conv_split_sum",
    source: include_str!("../../../templates/conv_split_sum.cu"),
    kernel: "kiln_conv_split_sum",
    const_names: &[],
    arch_specific: false,
};

pub const SPLIT_SUM_BLOCK: u16 = 256;

/// A block's tile of C: `bm x bn`, with `wm x wn` warps on tensor cores (unused by the f32 FMA
/// path, whose threads each take a square sub-tile).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tile {
    pub bm: u16,
    pub bn: u16,
    pub wm: u16,
    pub wn: u16,
    pub stages: u16,
    pub threads: u16,
    /// Relative throughput of a block of this tile when the GPU is full (the big tile is 1).
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

/// Tensor-core tiles (f16, bf16): k steps of 32.
pub const TENSOR_TILES: [Tile; 5] = [
    tile(128, 128, 2, 4, 4, 256, 100),
    tile(128, 64, 2, 2, 4, 128, 85),
    tile(64, 128, 2, 2, 4, 128, 85),
    tile(64, 64, 2, 2, 4, 128, 65),
    // For few output columns (backward-data of 3 input channels, say).
    tile(128, 32, 4, 1, 4, 128, 55),
];
/// FMA tiles (f32): k steps of 8, square per-thread tiles of 8 x 8.
pub const FMA_TILES: [Tile; 4] = [
    tile(128, 128, 0, 0, 3, 256, 100),
    tile(128, 64, 0, 0, 3, 128, 90),
    tile(64, 64, 0, 0, 3, 64, 75),
    // For few output columns.
    tile(128, 32, 0, 0, 3, 64, 60),
];

pub fn tiles(dtype: DType) -> &'static [Tile] {
    match dtype {
        DType::F32 => &FMA_TILES,
        _ => &TENSOR_TILES,
    }
}

fn block_k(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 8,
        _ => 32,
    }
}

/// Vector widths kiln compiles: 16 bytes, or one element when a channel count (or an array's
/// alignment) does not allow 16-byte loads.
fn vec_widths(dtype: DType) -> [u8; 2] {
    [dtype.vec_width() as u8, 1]
}

pub fn igemm_spec(dtype: DType, pass: Pass, t: Tile, vec_a: u8, vec_b: u8) -> KernelSpec {
    KernelSpec::new(
        &IGEMM,
        dtype,
        t.threads,
        1,
        &[
            pass as i32,
            t.bm as i32,
            t.bn as i32,
            t.wm as i32,
            t.wn as i32,
            t.stages as i32,
            vec_a as i32,
            vec_b as i32,
        ],
    )
}

pub fn split_sum_spec(dtype: DType) -> KernelSpec {
    KernelSpec::new(&SPLIT_SUM, dtype, SPLIT_SUM_BLOCK, 1, &[])
}

/// Every spec a plan can choose.
pub fn specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for dtype in DType::ALL {
        for pass in Pass::ALL {
            for &t in tiles(dtype) {
                for va in vec_widths(dtype) {
                    for vb in vec_widths(dtype) {
                        out.push(igemm_spec(dtype, pass, t, va, vb));
                    }
                }
            }
        }
        out.push(split_sum_spec(dtype));
    }
    out
}

/// Shared memory a block of `t` needs: STAGES buffers of both operand tiles (rows padded as the
/// template pads them) and two k-index tables.
pub fn shared_bytes(dtype: DType, pass: Pass, t: Tile) -> usize {
    let bk = block_k(dtype);
    let tensor = dtype != DType::F32;
    let a_k = pass != Pass::BackwardWeight;
    let b_k = pass == Pass::Forward;
    let stage = |rows: usize, global_k: bool| {
        if tensor && global_k {
            rows * (bk + 8)
        } else {
            bk * (rows + if tensor { 8 } else { 4 })
        }
    };
    let elems = stage(t.bm as usize, a_k) + stage(t.bn as usize, b_k);
    t.stages as usize * elems * dtype.size() + 2 * bk * 32
}

/// What the launch needs, chosen once per problem.
pub struct Plan {
    pub kernel: Arc<LoadedKernel>,
    pub spec: KernelSpec,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub shared: u32,
    /// Blocks along the reduction (backward-weight); >1 means f32 partials and a split sum.
    pub splits: usize,
    /// The kernel that adds the partials up, when `splits` > 1.
    pub split_sum: Option<Arc<LoadedKernel>>,
    pub problem: Problem,
}

/// The plan cache's key: MLX's `ConvCacheKey` fields (device, dtype, shapes, stride, padding,
/// dilation, groups, flip, alignment), plus input dilation and the pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanKey {
    pub device: usize,
    pub dtype: DType,
    pub pass: Pass,
    pub geometry: Geometry,
    /// Whether each operand may use 16-byte loads (channels and base addresses allow it).
    pub vec_a: bool,
    pub vec_b: bool,
}

struct PlanCache {
    plans: LruCache<PlanKey, Arc<Plan>>,
    hits: u64,
    misses: u64,
}

fn cache() -> &'static Mutex<PlanCache> {
    static CACHE: OnceLock<Mutex<PlanCache>> = OnceLock::new();
    CACHE.get_or_init(|| {
        let size = Config::from_env().map_or(128, |c| c.conv_cache_size).max(1);
        Mutex::new(PlanCache {
            plans: LruCache::new(NonZeroUsize::new(size).expect("size >= 1")),
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

/// The cached plan for `key`, or a new one.
pub fn plan(device: &Device, key: PlanKey) -> Result<Arc<Plan>> {
    {
        let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = c.plans.get(&key).cloned() {
            c.hits += 1;
            return Ok(p);
        }
        c.misses += 1;
    }
    let (t, splits) = choose(device, &key);
    let plan = Arc::new(build(device, &key, t, splits)?);
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    c.plans.put(key, plan.clone());
    Ok(plan)
}

/// A plan with the tile and split given (benchmark sweeps); not cached.
pub fn plan_with(device: &Device, key: PlanKey, t: Tile, splits: usize) -> Result<Plan> {
    build(device, &key, t, splits)
}

fn vec_for(dtype: DType, allowed: bool) -> u8 {
    if allowed {
        dtype.vec_width() as u8
    } else {
        1
    }
}

fn build(device: &Device, key: &PlanKey, t: Tile, splits: usize) -> Result<Plan> {
    let spec = igemm_spec(
        key.dtype,
        key.pass,
        t,
        vec_for(key.dtype, key.vec_a),
        vec_for(key.dtype, key.vec_b),
    );
    let kernel = device.kernel(&spec)?;
    let shared = shared_bytes(key.dtype, key.pass, t);
    if shared > 48 * 1024 {
        // Beyond 48 KiB of dynamic shared memory a kernel must opt in.
        kernel.function.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )?;
    }
    let g = &key.geometry;
    let (m, n, k) = key.pass.block_gemm(g);
    let k_tiles = k.div_ceil(block_k(key.dtype));
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
    let grid = (m.div_ceil(t.bm as usize) as u32, y as u32, z as u32);
    let split_sum = if splits > 1 {
        Some(device.kernel(&split_sum_spec(key.dtype))?)
    } else {
        None
    };
    Ok(Plan {
        kernel,
        spec,
        grid,
        threads: t.threads as u32,
        shared: shared as u32,
        splits,
        split_sum,
        problem: Problem::new(g, key.pass, per_split, splits),
    })
}

/// Largest grid dims the driver takes along y and z.
const MAX_GRID_YZ: usize = 65535;

/// Picks the tile with the least modelled time (waves of blocks, each costing its tile's area
/// over its efficiency) and, for backward-weight, splits the reduction until the GPU is full.
fn choose(device: &Device, key: &PlanKey) -> (Tile, usize) {
    let info = device.info();
    let sms = info.multiprocessors as usize;
    let optin = info.max_shared_per_block as usize;
    let g = &key.geometry;
    let (m, n, k) = key.pass.block_gemm(g);
    let groups = g.groups * key.pass.phases(g);
    let bk = block_k(key.dtype);
    let mut best: Option<(f64, Tile, usize)> = None;
    for &t in tiles(key.dtype) {
        let shared = shared_bytes(key.dtype, key.pass, t);
        if shared > optin || n.div_ceil(t.bn as usize) > MAX_GRID_YZ {
            continue;
        }
        let blocks = m.div_ceil(t.bm as usize) * n.div_ceil(t.bn as usize) * groups;
        // Blocks that fit an SM at once: by threads (2048), shared memory and registers
        // (about 128 per thread for these tiles).
        let per_sm = (2048 / t.threads as usize)
            .min(optin / shared.max(1))
            .min(65536 / (128 * t.threads as usize))
            .max(1);
        let slots = sms * per_sm;
        let mut splits = 1;
        if key.pass == Pass::BackwardWeight {
            // Split the long reduction until about two waves of blocks, each split keeping at
            // least 8 k tiles, within the grid's z limit.
            let k_tiles = k.div_ceil(bk).max(1);
            let want = (2 * slots).div_ceil(blocks.max(1));
            let most = (k_tiles / 8).max(1).min(MAX_GRID_YZ / groups.max(1)).max(1);
            splits = want.clamp(1, most);
        }
        let waves = (blocks * splits).div_ceil(slots) as f64;
        let k_work = k.div_ceil(splits).max(1) as f64;
        let cost = waves * (t.bm as f64 * t.bn as f64) * k_work / t.efficiency as f64;
        if best.map_or(true, |(c, _, _)| cost < c) {
            best = Some((cost, t, splits));
        }
    }
    let (_, t, splits) = best.unwrap_or((0.0, tiles(key.dtype)[tiles(key.dtype).len() - 1], 1));
    (t, splits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_are_distinct_and_cover_every_choice() {
        let all = specs();
        let unique: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(unique.len(), all.len());
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                for &t in tiles(dtype) {
                    for a in [true, false] {
                        for b in [true, false] {
                            let s =
                                igemm_spec(dtype, pass, t, vec_for(dtype, a), vec_for(dtype, b));
                            assert!(unique.contains(&s), "{s} is not registered");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn shared_memory_fits_an_h100_and_an_a100() {
        // sm_80's opt-in limit is 163 KiB, sm_90's 227 KiB.
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                for &t in tiles(dtype) {
                    assert!(shared_bytes(dtype, pass, t) <= 163 * 1024, "{t:?}");
                }
            }
        }
    }
}
