//! Measured tile choice for the Hopper family (`KILN_CONV_AUTOTUNE=1`). On a plan's first use in
//! a process, the few tiles the model ranks best are each timed on the call's own operands, and
//! the fastest becomes the plan. It is also kept in the disk cache as a note named by the kiln
//! version, the GPU and the plan key, so later processes read it instead of measuring again.
//!
//! Measuring synchronises the encoder, once per candidate: a cost paid on first use only, and
//! the reason the default is off (the model's tile is within 5% of the best measured one on most
//! layers; see the README).

use std::sync::Arc;
use std::time::Instant;

use super::geometry::Pass;
use super::hopper::{self, Tile};
use super::plan::{self, Plan, PlanKey};
use crate::dtype::DType;
use crate::env::{Config, ConvPath};
use crate::error::Result;
use crate::runtime::{Array, CommandEncoder};

/// Tiles timed for a plan: the model's best few.
const CANDIDATES: usize = 3;
/// Timed launches per candidate, after one untimed launch.
const RUNS: usize = 3;

/// A tile and split for the Hopper family, and whether this process measured it (rather than
/// reading an earlier measurement from the disk cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    pub tile: Tile,
    pub splits: usize,
    pub measured: bool,
}

/// Whether a call with `key`, which has no plan yet, should be autotuned: `KILN_CONV_AUTOTUNE`
/// is on and the Hopper path takes the key. An invalid environment variable is an error.
pub(super) fn wanted(key: &PlanKey) -> Result<bool> {
    let config = Config::from_env()?;
    Ok(config.conv_autotune
        && config.conv_path == ConvPath::Auto
        && hopper::unsupported(key).is_none())
}

/// The measured plan for `key`, kept in the plan cache. `a` and `b` are the GEMM operands and
/// `out` the output the call writes (the candidates write it too).
pub(super) fn plan(
    enc: &mut CommandEncoder,
    key: PlanKey,
    a: &Array,
    b: &Array,
    out: &Array,
) -> Result<Arc<Plan>> {
    let choice = choose(enc, &key, a, b, out)?;
    let plan = Arc::new(plan::plan_wgmma(
        enc.device(),
        key,
        choice.tile,
        choice.splits,
    )?);
    plan::remember(key, plan.clone());
    Ok(plan)
}

/// The name of `key`'s note in the disk cache.
fn note_name(enc: &CommandEncoder, key: &PlanKey) -> String {
    let info = enc.device().info();
    let (major, minor) = info.compute_capability;
    // The ordinal is this process's numbering; the GPU's name and architecture identify it.
    let key = PlanKey { device: 0, ..*key };
    format!(
        "conv-hopper kiln {} {} sm_{major}{minor} {key:?}",
        env!("CARGO_PKG_VERSION"),
        info.name
    )
}

/// A note: "bm bn splits", then " swapped" after a swapped tile and " paired" after a tile in
/// clusters of two.
fn encode(tile: Tile, splits: usize) -> String {
    let swapped = if tile.swapped { " swapped" } else { "" };
    let paired = if tile.cluster > 1 { " paired" } else { "" };
    format!("{} {} {splits}{swapped}{paired}\n", tile.bm, tile.bn)
}

/// A note's tile and split, if `pass` can take that tile.
fn decode(dtype: DType, pass: Pass, value: &str) -> Option<(Tile, usize)> {
    let mut words: Vec<&str> = value.split_whitespace().collect();
    let paired = words.last() == Some(&"paired");
    if paired {
        words.pop();
    }
    let swapped = words.last() == Some(&"swapped");
    if swapped {
        words.pop();
    }
    let v: Vec<usize> = words
        .iter()
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    let [bm, bn, splits] = v[..] else {
        return None;
    };
    let cluster = if paired { 2 } else { 1 };
    let tile = Tile {
        bm,
        bn,
        swapped,
        cluster,
    };
    (hopper::tiles(dtype, pass).contains(&tile) && splits >= 1).then_some((tile, splits))
}

/// The tile for `key`: from the disk cache's note, or measured now (and then noted).
pub fn choose(
    enc: &mut CommandEncoder,
    key: &PlanKey,
    a: &Array,
    b: &Array,
    out: &Array,
) -> Result<Choice> {
    let disk = enc.device().jit().disk_cache();
    let name = note_name(enc, key);
    if let Some((tile, splits)) = disk
        .load_note(&name)
        .as_deref()
        .and_then(|note| decode(key.dtype, key.pass, note))
    {
        return Ok(Choice {
            tile,
            splits,
            measured: false,
        });
    }
    let sms = enc.device().info().multiprocessors as usize;
    let mut best: Option<(f64, Tile, usize)> = None;
    for (tile, splits) in hopper::candidates(sms, key.dtype, key.pass, &key.geometry, CANDIDATES) {
        let candidate = plan::plan_wgmma(enc.device(), *key, tile, splits)?;
        super::launch(enc, &candidate, a, b, out)?;
        enc.synchronize()?;
        let start = Instant::now();
        for _ in 0..RUNS {
            super::launch(enc, &candidate, a, b, out)?;
        }
        enc.synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        if best.map_or(true, |(s, _, _)| seconds < s) {
            best = Some((seconds, tile, splits));
        }
    }
    let (_, tile, splits) = best.unwrap_or((0.0, hopper::TILES[1], 1));
    disk.store_note(&name, &encode(tile, splits));
    Ok(Choice {
        tile,
        splits,
        measured: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_round_trip_and_reject_what_kiln_cannot_run() {
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                for t in hopper::tiles(dtype, pass) {
                    assert_eq!(decode(dtype, pass, &encode(t, 3)), Some((t, 3)));
                }
            }
        }
        let wgrad = Pass::BackwardWeight;
        assert_eq!(
            decode(DType::BF16, wgrad, "128 96 1"),
            None,
            "not a Hopper tile"
        );
        assert_eq!(decode(DType::BF16, wgrad, "128 128 0"), None);
        assert_eq!(decode(DType::BF16, wgrad, "128 128"), None);
        assert_eq!(decode(DType::BF16, wgrad, "128 128 1 9"), None);
        assert_eq!(decode(DType::BF16, wgrad, "x 128 1"), None);
        assert_eq!(
            decode(DType::BF16, wgrad, "128 320 2"),
            None,
            "320 columns only swapped"
        );
        assert_eq!(
            decode(DType::BF16, wgrad, "128 128 2 swapped"),
            None,
            "not a swapped tile"
        );
        assert_eq!(
            decode(DType::F32, wgrad, "128 128 2 swapped"),
            Some((hopper::TILES[1].swapped(), 2)),
            "TF32 backward-weight takes every tile swapped"
        );
        assert_eq!(
            decode(DType::F32, wgrad, "128 128 2"),
            None,
            "and none the usual way round"
        );
        assert_eq!(
            decode(DType::BF16, wgrad, "128 128 2 paired swapped"),
            None,
            "flags in their order"
        );
        let swapped = encode(hopper::SWAPPED, 2);
        assert_eq!(
            decode(DType::BF16, Pass::Forward, &swapped),
            None,
            "backward-weight only"
        );
    }
}
