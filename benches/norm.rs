//! LayerNorm / RMSNorm throughput against PyTorch on the shapes of ../shared/ANCHORS.md, all
//! dtypes, in one run with the copy bandwidth they are held to. GB/s as ANCHORS counts them:
//! forward reads x and writes y; the VJP reads x and the cotangent and writes dx.
//!
//! Targets (issue 4): forward >= 85% of copy bandwidth for d >= 768 and >= 1.3x PyTorch on every
//! shape; VJP >= 70% of copy bandwidth for d >= 768 and >= 1.5x PyTorch on every shape.
//!
//! kiln is timed on the host around many calls (graph mode, one synchronise at the end), so its
//! figures include any host time the GPU waits for; PyTorch is timed with CUDA events.
//! `--only TEXT` keeps the rows whose "dtype op" contains TEXT (e.g. `--only "bf16 layer_norm"`),
//! `--no-anchor` skips PyTorch: both for comparing kernel variants quickly, not for the targets.

mod common;

use std::sync::Arc;
use std::time::Instant;

use kiln::ops::norm;
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::DType;

const SHAPES: [(usize, usize); 6] = [
    (16384, 768),
    (8192, 1024),
    (8192, 4096),
    (4096, 8192),
    (2048, 16384),
    (65536, 256),
];
const SETS: usize = 4;
const ITERS: usize = 40;

fn seconds_per_call(
    enc: &mut CommandEncoder,
    mut call: impl FnMut(&mut CommandEncoder, usize),
) -> f64 {
    // Warm up for 20 ms (3 calls at least): after the host has spent a while making the inputs
    // the GPU's clocks need time to come back, which skewed whichever op ran first.
    let warm = Instant::now();
    let mut i = 0;
    while i < 3 || warm.elapsed().as_secs_f64() < 0.02 {
        call(enc, i);
        i += 1;
        if i % 8 == 0 {
            enc.synchronize().unwrap();
        }
    }
    enc.synchronize().unwrap();
    // Median of three timed batches.
    let mut batches: Vec<f64> = (0..3)
        .map(|_| {
            let t = Instant::now();
            for i in 0..ITERS {
                call(enc, i);
            }
            enc.synchronize().unwrap();
            t.elapsed().as_secs_f64() / ITERS as f64
        })
        .collect();
    batches.sort_by(|a, b| a.partial_cmp(b).unwrap());
    batches[1]
}

fn copy_gbs(dev: &Arc<Device>, enc: &mut CommandEncoder) -> f64 {
    let n = 1usize << 28;
    let src = Array::empty(dev, DType::F32, &[n / 4]).unwrap();
    let dst = Array::empty(dev, DType::F32, &[n / 4]).unwrap();
    let t = seconds_per_call(enc, |e, _| e.copy_into(&src, &dst).unwrap());
    2.0 * n as f64 / t / 1e9
}

/// `--sweep`: GB/s of every registered (threads per row, items) choice that fits, for the
/// shapes and dtypes that tune worst, to choose the policy in `choose_spec` from measurements.
fn sweep(enc: &mut CommandEncoder) {
    use kiln::ops::norm::{tuning, Kind, Pass};
    for &(rows, d) in &[
        (16384usize, 768usize),
        (8192, 4096),
        (4096, 8192),
        (2048, 16384),
    ] {
        for dtype in [DType::BF16, DType::F32] {
            let n = rows * d;
            let mut rng = TestRng::new(7);
            let xs: Vec<Array> = (0..SETS)
                .map(|_| Array::from_f64(enc, dtype, &rng.values(n, 2.0, 0.0), &[rows, d]).unwrap())
                .collect();
            let g = Array::from_f64(enc, dtype, &rng.values(n, 1.0, 0.0), &[rows, d]).unwrap();
            let w = Array::from_f64(enc, dtype, &rng.values(d, 1.0, 1.0), &[d]).unwrap();
            let bytes = (n * dtype.size()) as f64;
            let chosen = [Pass::Forward, Pass::Vjp]
                .map(|p| norm::choose_spec(p, Kind::LayerNorm, dtype, d, true));
            for spec in norm::specs() {
                let pass = match spec.template.name {
                    "norm_fwd" => Pass::Forward,
                    "norm_vjp" => Pass::Vjp,
                    _ => continue,
                };
                if spec.dtype != dtype
                    || spec.consts[0] != 0
                    || spec.n_reads as usize != dtype.vec_width()
                {
                    continue;
                }
                let secs = match pass {
                    Pass::Forward => {
                        if tuning::forward_with(
                            enc,
                            Kind::LayerNorm,
                            &xs[0],
                            Some(&w),
                            Some(&w),
                            1e-5,
                            spec,
                        )
                        .is_err()
                        {
                            continue;
                        }
                        seconds_per_call(enc, |e, i| {
                            tuning::forward_with(
                                e,
                                Kind::LayerNorm,
                                &xs[i % SETS],
                                Some(&w),
                                Some(&w),
                                1e-5,
                                spec,
                            )
                            .unwrap();
                        })
                    }
                    Pass::Vjp => {
                        if tuning::vjp_with(
                            enc,
                            Kind::LayerNorm,
                            &xs[0],
                            Some(&w),
                            true,
                            &g,
                            1e-5,
                            spec,
                        )
                        .is_err()
                        {
                            continue;
                        }
                        seconds_per_call(enc, |e, i| {
                            tuning::vjp_with(
                                e,
                                Kind::LayerNorm,
                                &xs[i % SETS],
                                Some(&w),
                                true,
                                &g,
                                1e-5,
                                spec,
                            )
                            .unwrap();
                        })
                    }
                };
                let passes = if pass == Pass::Vjp { 3.0 } else { 2.0 };
                let mark = if chosen.contains(&spec) {
                    " <- chosen"
                } else {
                    ""
                };
                println!(
                    "sweep {rows}x{d} {dtype} {pass:?} GROUP={} ITEMS={}: {:.0} GB/s{mark}",
                    spec.consts[1],
                    spec.consts[2],
                    passes * bytes / secs / 1e9
                );
            }
        }
    }
}

fn main() {
    let dev = match kiln::runtime::gpus() {
        Ok(g) if !g.is_empty() => Device::get(0).unwrap(),
        _ => {
            println!("norm bench: no GPU, skipped");
            return;
        }
    };
    let mut enc = CommandEncoder::new(&dev).unwrap();
    if std::env::args().any(|a| a == "--sweep") {
        sweep(&mut enc);
        return;
    }
    let (only, no_anchor) = common::variant_flags();
    let copy = copy_gbs(&dev, &mut enc);
    let shape_args: Vec<String> = SHAPES.iter().map(|(r, d)| format!("{r},{d}")).collect();
    let torch = if no_anchor {
        None
    } else {
        common::run_anchor("norm_torch.py", &shape_args)
    };
    let torch_copy = torch.as_ref().and_then(|t| t["copy_gbs"].as_f64());
    println!(
        "norm bench on {}: copy bandwidth {copy:.0} GB/s (kiln memcpy node){}",
        dev.info().name,
        torch_copy.map_or(String::new(), |c| format!(", {c:.0} GB/s (PyTorch copy_)"))
    );
    println!(
        "{:<12} {:<5} {:<15} {:>9} {:>7} {:>9} {:>7}  verdict",
        "shape", "dtype", "op", "kiln GB/s", "% copy", "torch", "ratio"
    );
    let mut misses = 0;
    for &(rows, d) in &SHAPES {
        for dtype in DType::ALL {
            let n = rows * d;
            let mut rng = TestRng::new(rows as u64 ^ d as u64);
            let xs: Vec<Array> = (0..SETS)
                .map(|_| {
                    Array::from_f64(&mut enc, dtype, &rng.values(n, 2.0, 0.0), &[rows, d]).unwrap()
                })
                .collect();
            let gs: Vec<Array> = (0..SETS)
                .map(|_| {
                    Array::from_f64(&mut enc, dtype, &rng.values(n, 1.0, 0.0), &[rows, d]).unwrap()
                })
                .collect();
            let w = Array::from_f64(&mut enc, dtype, &rng.values(d, 1.0, 1.0), &[d]).unwrap();
            let b = Array::from_f64(&mut enc, dtype, &rng.values(d, 1.0, 0.0), &[d]).unwrap();
            let bytes = (n * dtype.size()) as f64;
            let wanted = |op: &str| format!("{dtype} {op}").contains(&only);
            let mut runs: Vec<(&str, f64, f64)> = Vec::new();
            if wanted("layer_norm") {
                let secs = seconds_per_call(&mut enc, |e, i| {
                    norm::layer_norm(e, &xs[i % SETS], Some(&w), Some(&b), 1e-5).unwrap();
                });
                runs.push(("layer_norm", 2.0, secs));
            }
            if wanted("rms_norm") {
                let secs = seconds_per_call(&mut enc, |e, i| {
                    norm::rms_norm(e, &xs[i % SETS], Some(&w), 1e-5).unwrap();
                });
                runs.push(("rms_norm", 2.0, secs));
            }
            if wanted("layer_norm_vjp") {
                let secs = seconds_per_call(&mut enc, |e, i| {
                    norm::layer_norm_vjp(e, &xs[i % SETS], Some(&w), Some(&b), &gs[i % SETS], 1e-5)
                        .unwrap();
                });
                runs.push(("layer_norm_vjp", 3.0, secs));
            }
            for (op, passes, secs) in runs {
                let gbs = passes * bytes / secs / 1e9;
                let torch_gbs = torch
                    .as_ref()
                    .and_then(|t| t[format!("{rows}x{d} {dtype} {op}")].as_f64())
                    .map(|s| passes * bytes / s / 1e9);
                let (bw_target, ratio_target) = if op.ends_with("vjp") {
                    (0.70, 1.5)
                } else {
                    (0.85, 1.3)
                };
                let mut verdict = Vec::new();
                if d >= 768 && gbs < bw_target * copy {
                    verdict.push(format!("< {:.0}% copy", bw_target * 100.0));
                }
                if let Some(t) = torch_gbs {
                    if gbs < ratio_target * t {
                        verdict.push(format!("< {ratio_target}x torch"));
                    }
                }
                if !verdict.is_empty() {
                    misses += 1;
                }
                println!(
                    "{:<12} {:<5} {:<15} {:>9.0} {:>6.0}% {:>9} {:>7}  {}",
                    format!("{rows}x{d}"),
                    dtype.name(),
                    op,
                    gbs,
                    100.0 * gbs / copy,
                    torch_gbs.map_or("-".into(), |t| format!("{t:.0}")),
                    torch_gbs.map_or("-".into(), |t| format!("{:.2}x", gbs / t)),
                    if verdict.is_empty() {
                        "met".to_string()
                    } else {
                        verdict.join(", ")
                    }
                );
            }
        }
    }
    println!("{misses} rows miss a target");
}
