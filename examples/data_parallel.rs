//! Data-parallel training on two GPUs, checked against one GPU running the whole batch.
//!
//! The model, in f32: x (NHWC 8x16x16x8) -> 3x3 convolution to 16 channels (padding 1) ->
//! LayerNorm over the channels (with weight and bias) -> loss = 0.5 * sum((y - target)^2).
//! Each step computes the gradients of the convolution weight W and of LayerNorm's gamma and
//! beta, then takes an SGD step (p -= lr * dp). Three steps run twice:
//!
//! 1. on GPU 0 alone, with the batch of 8;
//! 2. on GPUs 0 and 1, one thread and one encoder per rank, each rank with 4 of the 8 samples
//!    and the same initial weights. The ranks sum their gradients with an NCCL all-reduce
//!    (`ReduceOp::Sum`: the loss is a sum over samples, so the full batch's gradient is the sum
//!    of the halves' gradients) and apply the same update.
//!
//! The two ranks must end with bitwise identical weights, and those must match the one-GPU
//! weights up to f32 rounding (the sums run in another order); the program fails otherwise.
//!
//! Run it with `cargo run --release --example data_parallel` (graph mode, the default), or add
//! `-- --direct` to launch kernels directly (as `MLX_USE_CUDA_GRAPHS=0` would). It needs two
//! GPUs and NCCL (`KILN_NCCL_LIB`, the dynamic linker's path, or the `nvidia-nccl-cu13` /
//! `-cu12` wheel of the active Python environment); without them it says why and exits 0,
//! unless `KILN_REQUIRE_GPU=1`, which makes that a failure. A rank that fails leaves the other
//! waiting in its next collective for up to `KILN_NCCL_TIMEOUT` seconds.

use std::process::ExitCode;
use std::sync::Arc;

use kiln::dist::{Communicator, Nccl, ReduceOp};
use kiln::env::Config;
use kiln::ops::axpby::axpby;
use kiln::ops::conv::{conv_backward_weight, conv_forward, ConvParams};
use kiln::ops::norm::{layer_norm, layer_norm_vjp};
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::DType;

const BATCH: usize = 8;
const RANKS: usize = 2;
const H: usize = 16;
const W: usize = 16;
const C_IN: usize = 8;
const C_OUT: usize = 16;
const W_SHAPE: [usize; 4] = [C_OUT, 3, 3, C_IN];
const STEPS: usize = 3;
/// The loss sums over the 2,048 pixels of the batch, so its curvature in beta (and, about as
/// much, in gamma) is 2,048: this rate moves them a fifth of the way to their optimum per
/// step, far more than rounding, and stays stable.
const LR: f32 = 1e-4;
const EPS: f32 = 1e-5;
/// Largest difference from the one-GPU weights, relative to the largest weight of the tensor.
const TOLERANCE: f64 = 1e-4;

type BoxError = Box<dyn std::error::Error>;

/// The initial weights and the whole batch, on the host, the same for both runs.
struct Init {
    x: Vec<f64>,
    target: Vec<f64>,
    params: [Vec<f64>; 3],
}

/// What one run (or one rank) ends with: W, gamma and beta after the last step, and the loss
/// of each step (a rank's loss is that of its half of the batch).
struct Run {
    params: [Vec<f64>; 3],
    losses: Vec<f64>,
}

const NAMES: [&str; 3] = ["W", "gamma", "beta"];

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("data_parallel: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), BoxError> {
    let mut direct = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--direct" => direct = true,
            other => return Err(format!("unknown argument {other:?} (only --direct)").into()),
        }
    }

    // Two GPUs and NCCL, or a reason to skip.
    let gpus = match kiln::runtime::gpus() {
        Ok(g) => g,
        Err(e) => return skip(&e.to_string()),
    };
    if gpus.len() < RANKS {
        return skip(&format!(
            "it needs {RANKS} GPUs, this machine has {}",
            gpus.len()
        ));
    }
    // The same lookup the communicators make: NCCL is loaded once per process, from the first
    // place asked for.
    let config = Config::from_env()?;
    let nccl = match Nccl::get(config.nccl_lib.as_deref()) {
        Ok(n) => n,
        Err(e) => return skip(&format!("NCCL is unavailable: {e}")),
    };
    println!(
        "NCCL {} ({}), GPUs: {} and {}, {} mode",
        nccl.version_string(),
        nccl.path,
        gpus[0].name,
        gpus[1].name,
        if direct { "direct" } else { "graph" }
    );

    let init = init(1);
    let devices: Vec<Arc<Device>> = (0..RANKS).map(Device::get).collect::<Result<_, _>>()?;

    // 1. One GPU, the whole batch.
    let reference = {
        let mut enc = encoder(&devices[0], direct)?;
        train(&mut enc, None, &init.x, &init.target, &init.params)?
    };

    // 2. Two GPUs, half the batch each. The communicators are made together (NCCL sets them up
    // as a group); each then moves to its rank's thread, which makes its own encoder there
    // (encoders are not Send).
    let comms = Communicator::init_all(&devices)?;
    let x_shard = init.x.len() / RANKS;
    let t_shard = init.target.len() / RANKS;
    let ranks: Vec<Run> = std::thread::scope(|s| {
        let threads: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                // Samples are the outermost axis: rank r's samples are one contiguous run.
                let x = &init.x[r * x_shard..(r + 1) * x_shard];
                let target = &init.target[r * t_shard..(r + 1) * t_shard];
                let params = &init.params;
                s.spawn(move || -> kiln::Result<Run> {
                    let mut enc = encoder(comm.device(), direct)?;
                    train(&mut enc, Some(&comm), x, target, params)
                })
            })
            .collect();
        threads
            .into_iter()
            .enumerate()
            .map(|(r, t)| match t.join() {
                Ok(run) => run.map_err(|e| format!("rank {r}: {e}").into()),
                Err(_) => Err(format!("rank {r} panicked").into()),
            })
            .collect::<Result<_, BoxError>>()
    })?;

    for step in 0..STEPS {
        let summed: f64 = ranks.iter().map(|r| r.losses[step]).sum();
        println!(
            "step {}: loss {:.6} on one GPU, {:.6} summed over the ranks",
            step + 1,
            reference.losses[step],
            summed
        );
    }

    let mut failures = Vec::new();
    for (i, name) in NAMES.iter().enumerate() {
        let want = &reference.params[i];
        let scale = max_abs(want);
        let moved = max_abs_diff(want, &init.params[i]);
        for (r, rank) in ranks.iter().enumerate() {
            let diff = max_abs_diff(&rank.params[i], want);
            println!(
                "{name:>5} rank {r}: max |diff| {diff:.3e}, relative to max |{name}| \
                 {:.3e} (the steps moved it by up to {moved:.3e})",
                diff / scale
            );
            if diff.is_nan() || diff > TOLERANCE * scale {
                failures.push(format!(
                    "{name} on rank {r} differs from one GPU's by {diff:.3e} (allowed \
                     {TOLERANCE:e} x {scale:.3e})"
                ));
            }
        }
        // Both ranks applied the same all-reduced gradients to the same weights.
        let (a, b) = (&ranks[0].params[i], &ranks[1].params[i]);
        let differing = a
            .iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        if differing > 0 {
            failures.push(format!(
                "{name}: {differing} of {} values differ between the ranks",
                a.len()
            ));
        }
    }
    if !failures.is_empty() {
        return Err(failures.join("; ").into());
    }
    println!("data-parallel weights match one GPU's, and the ranks agree bit for bit");
    Ok(())
}

/// Says why the example does not run: exit 0, or an error if `KILN_REQUIRE_GPU=1`.
fn skip(why: &str) -> Result<(), BoxError> {
    if kiln::env::require_gpu()? {
        return Err(format!("KILN_REQUIRE_GPU=1 but {why}").into());
    }
    println!("data_parallel: skipped: {why}");
    Ok(())
}

/// Graph mode (the default), or direct launches.
fn encoder(device: &Arc<Device>, direct: bool) -> kiln::Result<CommandEncoder> {
    if direct {
        let mut config = Config::from_env()?;
        config.use_cuda_graphs = false;
        CommandEncoder::with_config(device, &config)
    } else {
        CommandEncoder::new(device)
    }
}

fn init(seed: u64) -> Init {
    let mut rng = TestRng::new(seed);
    let pixels = BATCH * H * W;
    // Uniform in [-1, 1) times a scale, plus an offset; W scaled by 1 / sqrt(fan-in).
    let fan_in = (9 * C_IN) as f64;
    Init {
        x: rng.values(pixels * C_IN, 1.0, 0.0),
        target: rng.values(pixels * C_OUT, 1.0, 0.0),
        params: [
            rng.values(W_SHAPE.iter().product(), 1.0 / fan_in.sqrt(), 0.0),
            rng.values(C_OUT, 0.1, 1.0),
            rng.values(C_OUT, 0.1, 0.0),
        ],
    }
}

/// `STEPS` SGD steps on the samples in `x` (with their `target`), from weights `init`. With a
/// communicator, the gradients are summed over its ranks before each update.
fn train(
    enc: &mut CommandEncoder,
    comm: Option<&Communicator>,
    x: &[f64],
    target: &[f64],
    init: &[Vec<f64>; 3],
) -> kiln::Result<Run> {
    let f32 = DType::F32;
    let batch = x.len() / (H * W * C_IN);
    let conv = ConvParams::default().padding(&[1]);
    let x = Array::from_f64(enc, f32, x, &[batch, H, W, C_IN])?;
    let target = Array::from_f64(enc, f32, target, &[batch, H, W, C_OUT])?;
    let w = Array::from_f64(enc, f32, &init[0], &W_SHAPE)?;
    let gamma = Array::from_f64(enc, f32, &init[1], &[C_OUT])?;
    let beta = Array::from_f64(enc, f32, &init[2], &[C_OUT])?;
    // Each step's dL/dy, kept to compute the losses at the end: downloading it now would wait
    // for the GPU in the middle of every step.
    let mut dys = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        // Forward: c is (batch, H, W, C_OUT); LayerNorm normalises its last axis.
        let c = conv_forward(enc, &x, &w, &conv)?;
        let y = layer_norm(enc, &c, Some(&gamma), Some(&beta), EPS)?;
        // dL/dy = y - target, written over y (which nothing else reads).
        axpby(enc, 1.0, &y, -1.0, &target, &y)?;
        let dy = y;

        // Backward: the VJP takes LayerNorm's input c; the weight gradient sums over the batch.
        let (dc, dgamma, dbeta) = layer_norm_vjp(enc, &c, Some(&gamma), Some(&beta), &dy, EPS)?;
        let dgamma = dgamma.expect("a weight was given");
        let dbeta = dbeta.expect("a bias was given");
        let dw = conv_backward_weight(enc, &x, &dc, &W_SHAPE, &conv)?;

        // Data parallel: every rank gets the sum of all ranks' gradients, in place.
        if let Some(comm) = comm {
            for g in [&dw, &dgamma, &dbeta] {
                comm.all_reduce(enc, g, g, ReduceOp::Sum)?;
            }
        }

        // SGD: p = p - lr * dp, in place.
        for (p, g) in [(&w, &dw), (&gamma, &dgamma), (&beta, &dbeta)] {
            axpby(enc, 1.0, p, -LR, g, p)?;
        }
        dys.push(dy);
    }
    let mut losses = Vec::with_capacity(STEPS);
    for dy in &dys {
        losses.push(0.5 * dy.to_f64(enc)?.iter().map(|v| v * v).sum::<f64>());
    }
    Ok(Run {
        params: [w.to_f64(enc)?, gamma.to_f64(enc)?, beta.to_f64(enc)?],
        losses,
    })
}

fn max_abs(a: &[f64]) -> f64 {
    a.iter().fold(0.0, |m, v| m.max(v.abs()))
}

/// Largest |a - b|; NaN if any difference is NaN (so that the check fails).
fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m: f64, (x, y)| {
        let d = (x - y).abs();
        if d.is_nan() || m.is_nan() {
            f64::NAN
        } else {
            m.max(d)
        }
    })
}
