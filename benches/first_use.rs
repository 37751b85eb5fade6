//! First use: 30 mixed training-step cases (15 convolutions, each forward, backward-data and
//! backward-weight; 15 LayerNorm/RMSNorm forward + VJP), in bf16, f16 and f32, run once each in
//! one process, as an application meets them on its first steps. Prints each case's time
//! (compiles included; making its random operands on the host is not) and the total.
//!
//! Run: `first_use [--cache DIR]` on a GPU machine. Without `--cache` the disk cache is a fresh
//! temporary directory (the cold first run); run it twice with the same `--cache` for the warm
//! figure. `KILN_COMPILE_THREADS=0` turns the background compiles off, `KILN_STAND_INS=0` the
//! cold-start stand-ins, for comparison. After the first run it waits for the background
//! compiles and runs the 30 cases again in the same process.

use std::time::Instant;

use kiln::ops::conv::{conv_backward_data, conv_backward_weight, conv_forward, ConvParams};
use kiln::ops::norm::{layer_norm, layer_norm_vjp, rms_norm, rms_norm_vjp};
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::DType;

/// Input (NHWC), weight (OHWI), stride, padding.
struct Conv {
    dtype: DType,
    input: [usize; 4],
    weight: [usize; 4],
    stride: usize,
    padding: usize,
}

struct Norm {
    dtype: DType,
    rms: bool,
    rows: usize,
    d: usize,
}

enum Case {
    Conv(Conv),
    Norm(Norm),
}

fn cases() -> Vec<Case> {
    use DType::{BF16, F16, F32};
    let conv = |dtype, input, weight, stride, padding| {
        Case::Conv(Conv {
            dtype,
            input,
            weight,
            stride,
            padding,
        })
    };
    let norm = |dtype, rms, rows, d| {
        Case::Norm(Norm {
            dtype,
            rms,
            rows,
            d,
        })
    };
    vec![
        conv(BF16, [8, 56, 56, 64], [64, 3, 3, 64], 1, 1),
        norm(BF16, false, 4096, 768),
        conv(BF16, [8, 56, 56, 64], [256, 1, 1, 64], 1, 0),
        norm(F16, false, 4096, 1024),
        conv(BF16, [8, 28, 28, 128], [128, 3, 3, 128], 1, 1),
        norm(BF16, true, 4096, 4096),
        conv(BF16, [8, 56, 56, 128], [128, 3, 3, 128], 2, 1),
        norm(F16, true, 2048, 5120),
        conv(F16, [4, 64, 64, 320], [320, 3, 3, 320], 1, 1),
        norm(F32, false, 2048, 1024),
        conv(F16, [4, 32, 32, 640], [640, 3, 3, 640], 1, 1),
        norm(F32, true, 1024, 4096),
        conv(F16, [4, 64, 64, 640], [320, 1, 1, 640], 1, 0),
        norm(BF16, false, 1024, 8192),
        conv(F16, [8, 14, 14, 256], [256, 3, 3, 256], 1, 1),
        norm(BF16, true, 512, 16384),
        conv(F32, [8, 56, 56, 64], [64, 3, 3, 64], 1, 1),
        norm(F16, false, 8192, 320),
        conv(F32, [8, 28, 28, 128], [256, 1, 1, 128], 1, 0),
        norm(BF16, false, 256, 30000),
        conv(BF16, [8, 224, 224, 3], [64, 7, 7, 3], 2, 3),
        norm(F16, true, 4096, 2048),
        conv(F16, [16, 7, 7, 512], [512, 3, 3, 512], 1, 1),
        norm(F32, false, 4096, 512),
        conv(BF16, [4, 128, 128, 128], [128, 3, 3, 128], 1, 1),
        norm(BF16, true, 2048, 3072),
        conv(F32, [4, 32, 32, 320], [320, 3, 3, 320], 1, 1),
        norm(F16, false, 1024, 12288),
        conv(BF16, [8, 14, 14, 1024], [256, 1, 1, 1024], 1, 0),
        norm(F32, true, 512, 8192),
    ]
}

fn random(enc: &mut CommandEncoder, rng: &mut TestRng, dtype: DType, shape: &[usize]) -> Array {
    let n = shape.iter().product();
    Array::from_f64(enc, dtype, &rng.values(n, 1.0, 0.0), shape).expect("upload")
}

/// A case's operands, made before its timing starts (host random numbers are slow).
struct Inputs {
    a: Array,
    b: Array,
    c: Array,
    d: Option<Array>,
    /// The conv's output cotangent's shape.
    out: Vec<usize>,
}

fn inputs(enc: &mut CommandEncoder, rng: &mut TestRng, case: &Case) -> Inputs {
    match case {
        Case::Conv(c) => {
            let g = kiln::ops::conv::Geometry::new(&c.input, &c.weight, &params(c)).expect("shape");
            let out = g.output_shape();
            Inputs {
                a: random(enc, rng, c.dtype, &c.input),
                b: random(enc, rng, c.dtype, &c.weight),
                c: random(enc, rng, c.dtype, &out),
                d: None,
                out,
            }
        }
        Case::Norm(n) => Inputs {
            a: random(enc, rng, n.dtype, &[n.rows, n.d]),
            b: random(enc, rng, n.dtype, &[n.rows, n.d]),
            c: random(enc, rng, n.dtype, &[n.d]),
            d: (!n.rms).then(|| random(enc, rng, n.dtype, &[n.d])),
            out: Vec::new(),
        },
    }
}

fn params(c: &Conv) -> ConvParams {
    ConvParams::default()
        .strides(&[c.stride])
        .padding(&[c.padding])
}

fn run(enc: &mut CommandEncoder, case: &Case, i: &Inputs) -> String {
    match case {
        Case::Conv(c) => {
            let params = params(c);
            let y = conv_forward(enc, &i.a, &i.b, &params).expect("forward");
            assert_eq!(y.shape(), &i.out[..]);
            conv_backward_data(enc, &i.c, &i.b, &c.input, &params).expect("backward-data");
            conv_backward_weight(enc, &i.a, &i.c, &c.weight, &params).expect("backward-weight");
            format!(
                "conv {} {:?} * {:?} s{} p{}",
                c.dtype, c.input, c.weight, c.stride, c.padding
            )
        }
        Case::Norm(n) => {
            let (x, g, w) = (&i.a, &i.b, &i.c);
            if n.rms {
                rms_norm(enc, x, Some(w), 1e-5).expect("forward");
                rms_norm_vjp(enc, x, Some(w), g, 1e-5).expect("vjp");
            } else {
                let b = i.d.as_ref().expect("bias");
                layer_norm(enc, x, Some(w), Some(b), 1e-5).expect("forward");
                layer_norm_vjp(enc, x, Some(w), Some(b), g, 1e-5).expect("vjp");
            }
            let name = if n.rms { "rms_norm" } else { "layer_norm" };
            format!("{name} {} {}x{}", n.dtype, n.rows, n.d)
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // CUDA 13's NVRTC keeps its own cache of compiled programs (~/.nv/ComputeCache, across
    // processes): with it, a "cold" compile of a source compiled before is a lookup.
    std::env::set_var("CUDA_CACHE_DISABLE", "1");
    let temp = tempfile::tempdir().expect("temporary directory");
    let cache = match args.iter().position(|a| a == "--cache") {
        Some(i) => std::path::PathBuf::from(args.get(i + 1).expect("--cache DIR")),
        None => temp.path().to_path_buf(),
    };
    // Before anything reads the environment: this process's JIT uses `cache`.
    std::env::set_var("KILN_CACHE_DIR", &cache);
    let entries_before = kiln::jit::Jit::global()
        .expect("JIT")
        .disk_cache()
        .entry_files()
        .len();
    let dev = match Device::get(0) {
        Ok(d) => d,
        Err(e) => {
            println!("first_use: no GPU ({e}); nothing measured");
            return;
        }
    };
    let mut enc = CommandEncoder::new(&dev).expect("encoder");
    let mut rng = TestRng::new(11);
    let threads = kiln::env::Config::from_env()
        .expect("environment")
        .compile_threads;
    println!(
        "first_use: {} ({}), cache {} ({entries_before} entries before), {threads} background \
         compile threads",
        dev.info().name,
        dev.target(),
        cache.display()
    );
    // The first context use and a first launch, outside the timing (a warm process has paid
    // for them before its first new layer).
    let one = Array::zeros(&mut enc, DType::F32, &[1]).expect("zeros");
    let _ = one.to_f64(&mut enc).expect("read back");
    let mut total = 0.0;
    for (i, case) in cases().iter().enumerate() {
        let operands = inputs(&mut enc, &mut rng, case);
        enc.synchronize().expect("synchronize");
        let t = Instant::now();
        let what = run(&mut enc, case, &operands);
        enc.synchronize().expect("synchronize");
        let seconds = t.elapsed().as_secs_f64();
        total += seconds;
        println!("{:>2} {what:<58} {:>8.1} ms", i + 1, seconds * 1e3);
    }
    println!("total {total:.2} s for 30 cases (target: <= 5 s on an empty cache)");
    // What the first run left compiling in the background, then the same cases again in this
    // process: stand-ins (KILN_STAND_INS) give way to the chosen kernels once those are ready.
    let jit = kiln::jit::Jit::global().expect("JIT");
    let t = Instant::now();
    while !jit.background_idle() {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let entries = jit.disk_cache().entry_files().len();
    println!(
        "background compiles done {:.2} s later; {} cache entries written",
        t.elapsed().as_secs_f64(),
        entries - entries_before
    );
    let mut again = 0.0;
    for case in cases().iter() {
        let operands = inputs(&mut enc, &mut rng, case);
        enc.synchronize().expect("synchronize");
        let t = Instant::now();
        run(&mut enc, case, &operands);
        enc.synchronize().expect("synchronize");
        again += t.elapsed().as_secs_f64();
    }
    println!("second run, same process: {again:.2} s for 30 cases");
}
