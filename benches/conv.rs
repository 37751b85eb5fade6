//! Convolution throughput against cuDNN (through PyTorch: channels last, cudnn.benchmark, TF32
//! off) on the seven shapes of ../shared/ANCHORS.md, forward, backward-data and backward-weight,
//! every dtype, in one run. TFLOP/s counts 2 * N * P * Q * K * C * R * S for each pass.
//!
//! Targets (issue 5): per pass, the geometric mean of kiln / cuDNN >= 0.5 for f16 and bf16 and
//! >= 0.8 for f32.
//!
//! kiln is timed on the host around many calls (graph mode, one synchronise at the end);
//! PyTorch with CUDA events. `--sweep` times every tile (and split) kiln has on each shape and
//! marks the plan's choice. `--only TEXT` keeps the rows whose "dtype pass" contains TEXT (e.g.
//! `--only "f32 backward_weight"`), `--no-anchor` skips PyTorch: both for comparing kernel
//! variants quickly, not for the targets.

mod common;

use std::time::Instant;

use kiln::ops::conv::{self, plan, tuning, ConvParams, Geometry, Pass};
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::DType;

/// N, C, H, W, K, R, S, stride, pad.
const SHAPES: [[usize; 9]; 7] = [
    [32, 64, 56, 56, 64, 3, 3, 1, 1],
    [32, 128, 28, 28, 128, 3, 3, 1, 1],
    [32, 256, 14, 14, 256, 3, 3, 1, 1],
    [32, 512, 7, 7, 512, 3, 3, 1, 1],
    [32, 64, 56, 56, 256, 1, 1, 1, 0],
    [32, 256, 56, 56, 128, 1, 1, 2, 0],
    [32, 3, 224, 224, 64, 7, 7, 2, 3],
];
const ITERS: usize = 10;

fn seconds_per_call(enc: &mut CommandEncoder, mut call: impl FnMut(&mut CommandEncoder)) -> f64 {
    for _ in 0..2 {
        call(enc);
    }
    enc.synchronize().unwrap();
    let mut batches: Vec<f64> = (0..3)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..ITERS {
                call(enc);
            }
            enc.synchronize().unwrap();
            t.elapsed().as_secs_f64() / ITERS as f64
        })
        .collect();
    batches.sort_by(|a, b| a.partial_cmp(b).unwrap());
    batches[1]
}

struct Operands {
    g: Geometry,
    params: ConvParams,
    x: Array,
    w: Array,
    dy: Array,
}

fn operands(enc: &mut CommandEncoder, s: &[usize; 9], dtype: DType) -> Operands {
    let [n, c, h, w, k, r, sz, stride, pad] = *s;
    let params = ConvParams::default().strides(&[stride]).padding(&[pad]);
    let g = Geometry::new(&[n, h, w, c], &[k, r, sz, c], &params).unwrap();
    let mut rng = TestRng::new(3);
    let mut up = |shape: &[usize]| {
        let len = shape.iter().product();
        Array::from_f64(enc, dtype, &rng.values(len, 2.0, 0.0), shape).unwrap()
    };
    let (x, wt, dy) = (
        up(&g.input_shape()),
        up(&g.weight_shape()),
        up(&g.output_shape()),
    );
    Operands {
        g,
        params,
        x,
        w: wt,
        dy,
    }
}

fn run(enc: &mut CommandEncoder, o: &Operands, pass: Pass) {
    conv::conv_pass(enc, pass, &o.params, &o.x, &o.w, &o.dy).unwrap();
}

fn name(s: &[usize; 9]) -> String {
    s.map(|v| v.to_string()).join(",")
}

fn sweep(enc: &mut CommandEncoder) {
    for s in &SHAPES {
        for dtype in [DType::BF16, DType::F32] {
            let o = operands(enc, s, dtype);
            let flops = 2.0 * o.g.macs() as f64;
            for pass in Pass::ALL {
                let (first, second) = match pass {
                    Pass::Forward => (&o.x, &o.w),
                    Pass::BackwardData => (&o.dy, &o.w),
                    Pass::BackwardWeight => (&o.x, &o.dy),
                };
                let splits: &[usize] = if pass == Pass::BackwardWeight {
                    &[1, 2, 4, 8, 16, 32]
                } else {
                    &[1]
                };
                for &t in plan::tiles(dtype) {
                    for &sp in splits {
                        let secs = seconds_per_call(enc, |e| {
                            tuning::run_with(e, pass, &o.g, first, second, t, sp).unwrap();
                        });
                        println!(
                            "sweep {} {dtype} {} {}x{} splits {sp}: {:.1} TFLOP/s",
                            name(s),
                            pass.name(),
                            t.bm,
                            t.bn,
                            flops / secs / 1e12
                        );
                    }
                }
            }
        }
    }
}

fn main() {
    let dev = match kiln::runtime::gpus() {
        Ok(g) if !g.is_empty() => Device::get(0).unwrap(),
        _ => {
            println!("conv bench: no GPU, skipped");
            return;
        }
    };
    let mut enc = CommandEncoder::new(&dev).unwrap();
    if std::env::args().any(|a| a == "--sweep") {
        sweep(&mut enc);
        return;
    }
    let (only, no_anchor) = common::variant_flags();
    let shape_args: Vec<String> = SHAPES.iter().map(name).collect();
    let torch = if no_anchor {
        None
    } else {
        common::run_anchor("conv_torch.py", &shape_args)
    };
    println!(
        "conv bench on {}; anchor: {}",
        dev.info().name,
        torch
            .as_ref()
            .map_or("PyTorch unavailable".to_string(), |t| format!(
                "PyTorch {} cuDNN {}",
                t["torch"], t["cudnn"]
            ))
    );
    println!(
        "{:<28} {:<5} {:<16} {:>10} {:>10} {:>7}",
        "N,C,H,W,K,R,S,stride,pad", "dtype", "pass", "kiln TF/s", "cuDNN TF/s", "ratio"
    );
    // log-ratio sums per (dtype, pass) for the geometric means.
    let mut logs = std::collections::BTreeMap::<(DType, &str), (f64, usize)>::new();
    for s in &SHAPES {
        for dtype in DType::ALL {
            if !Pass::ALL
                .iter()
                .any(|p| format!("{dtype} {}", p.name()).contains(&only))
            {
                continue;
            }
            let o = operands(&mut enc, s, dtype);
            let flops = 2.0 * o.g.macs() as f64;
            for pass in Pass::ALL {
                if !format!("{dtype} {}", pass.name()).contains(&only) {
                    continue;
                }
                let secs = seconds_per_call(&mut enc, |e| run(e, &o, pass));
                let tf = flops / secs / 1e12;
                let anchor = torch
                    .as_ref()
                    .and_then(|t| t[format!("{} {dtype} {}", name(s), pass.name())].as_f64())
                    .map(|t| flops / t / 1e12);
                if let Some(a) = anchor {
                    let e = logs.entry((dtype, pass.name())).or_default();
                    e.0 += (tf / a).ln();
                    e.1 += 1;
                }
                println!(
                    "{:<28} {:<5} {:<16} {:>10.1} {:>10} {:>7}",
                    name(s),
                    dtype.name(),
                    pass.name(),
                    tf,
                    anchor.map_or("-".into(), |a| format!("{a:.1}")),
                    anchor.map_or("-".into(), |a| format!("{:.2}x", tf / a)),
                );
            }
        }
    }
    println!("geometric mean of kiln / cuDNN:");
    let mut misses = 0;
    for ((dtype, pass), (sum, n)) in logs {
        let gm = (sum / n as f64).exp();
        let target = if dtype == DType::F32 { 0.8 } else { 0.5 };
        let met = gm >= target;
        misses += !met as usize;
        println!(
            "  {dtype:<5} {pass:<16} {gm:.2}x (target {target}x): {}",
            if met { "met" } else { "missed" }
        );
    }
    println!("{misses} geometric means miss their target");
}
