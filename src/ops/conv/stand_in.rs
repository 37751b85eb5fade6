//! Stand-ins for a cold start (`KILN_STAND_INS`). While a convolution's chosen kernel compiles
//! in the background, the call runs on the `mma.sync` family's 64x64 tile, compiled as a family
//! of its own, `conv_igemm_quick`, with NVRTC's `--Ofast-compile=mid`: 0.2 s on one core
//! against 0.3-2.5 s for the tiles and families the model prefers. It takes every geometry any
//! family takes, at 2-3% of the chosen kernel's speed on the H100's model layers (5-15 TFLOP/s
//! in bf16; fully optimised it would run 10x faster but compile 1.5-5x slower, and on a first
//! step the compile is what a call waits for). A stand-in depends only on the dtype, the pass
//! and which operands allow vector loads, so a model's first step compiles a few and every
//! layer shares them.

use super::geometry::Pass;
use super::plan::{self, Plan, PlanKey, IGEMM_FIELDS};
use crate::error::Result;
use crate::jit::{KernelSpec, TemplateDef};
use crate::runtime::Device;

/// `conv_igemm` built for compile time rather than speed.
pub static IGEMM_QUICK: TemplateDef = TemplateDef {
    name: "conv_igemm_quick",
    ..IGEMM_FIELDS
};

/// The stand-in's tile: the 64x64 tile of the key's path.
fn tile(key: &PlanKey) -> plan::Tile {
    *plan::tiles(key.tensor())
        .iter()
        .find(|t| t.bm == 64 && t.bn == 64)
        .expect("both paths have a 64x64 tile")
}

/// Splits of backward-weight's reduction: enough blocks for every SM twice, each split keeping
/// at least 8 k tiles (a few large layers would otherwise run on a handful of blocks).
fn splits(sms: usize, key: &PlanKey, t: plan::Tile) -> usize {
    if key.pass != Pass::BackwardWeight {
        return 1;
    }
    let g = &key.geometry;
    let (m, n, k) = key.pass.block_gemm(g);
    let blocks = m.div_ceil(t.bm as usize) * n.div_ceil(t.bn as usize) * g.groups;
    let k_tiles = k.div_ceil(plan::block_k(key.dtype, key.tensor(), key.pass));
    (2 * sms)
        .div_ceil(blocks.max(1))
        .min(k_tiles / 8)
        .min(plan::MAX_GRID_YZ / g.groups.max(1))
        .max(1)
}

/// The stand-in spec of `key`: the 64x64 tile's `conv_igemm` spec, in the quick family.
pub fn spec(key: &PlanKey) -> KernelSpec {
    KernelSpec {
        template: &IGEMM_QUICK,
        ..plan::igemm_spec_for(key, tile(key))
    }
}

/// The stand-in's kernels for `key`: its spec, and the split sum.
pub fn specs(key: &PlanKey) -> [KernelSpec; 2] {
    [spec(key), plan::split_sum_spec(key)]
}

/// A plan that runs `key` on its stand-in (compiled now if it is not yet). Not cached.
pub fn plan(device: &Device, key: &PlanKey) -> Result<Plan> {
    let t = tile(key);
    let sms = device.info().multiprocessors as usize;
    let mut launch = plan::igemm_launch(key, t, splits(sms, key, t), device.shared_limit())?;
    launch.spec = spec(key);
    plan::build_igemm(device, key, launch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::ops::conv::geometry::ConvParams;

    #[test]
    fn layers_of_one_alignment_share_a_stand_in() {
        let p = ConvParams::default();
        for pass in [Pass::Forward, Pass::BackwardWeight] {
            let vectors = |k: PlanKey| PlanKey {
                vec_a: true,
                vec_b: true,
                ..k
            };
            let a = vectors(plan::test_key(
                DType::BF16,
                pass,
                &[2, 9, 9, 72],
                &[72, 3, 3, 72],
                &p,
            ));
            let b = vectors(plan::test_key(
                DType::BF16,
                pass,
                &[1, 5, 7, 8],
                &[16, 1, 1, 8],
                &p,
            ));
            assert_eq!(specs(&a), specs(&b));
            let [s, _] = specs(&a);
            assert_eq!(s.template.name, "conv_igemm_quick");
            assert_eq!((s.constant("BM"), s.constant("BN")), (Some(64), Some(64)));
            assert_eq!(s.constant("VEC_A"), Some(8));
            assert_eq!(s.constant("TAP_TILES"), Some(0));
        }
        let odd = PlanKey {
            vec_a: false,
            ..plan::test_key(DType::F16, Pass::Forward, &[1, 5, 7, 3], &[8, 1, 1, 3], &p)
        };
        assert_eq!(specs(&odd)[0].constant("VEC_A"), Some(1));
    }

    #[test]
    fn backward_weight_splits_only_what_has_few_blocks() {
        let p = ConvParams::default();
        let key =
            |x: &[usize], w: &[usize]| plan::test_key(DType::F16, Pass::BackwardWeight, x, w, &p);
        // 64 x 576 outputs: 9 blocks for 132 SMs, 8 x 56 x 56 / 32 = 784 k tiles.
        let few = key(&[8, 56, 56, 64], &[64, 3, 3, 64]);
        assert_eq!(splits(132, &few, tile(&few)), 30);
        // A short reduction is not split below 8 k tiles a split.
        let short = key(&[1, 4, 4, 64], &[64, 3, 3, 64]);
        assert_eq!(splits(132, &short, tile(&short)), 1);
        let fwd = plan::test_key(
            DType::F16,
            Pass::Forward,
            &[8, 56, 56, 64],
            &[64, 3, 3, 64],
            &p,
        );
        assert_eq!(splits(132, &fwd, tile(&fwd)), 1);
    }
}
