//! An application's own kernel family, next to kiln's ops: `y = gelu(x + bias)` over the rows of
//! a matrix (bias broadcast along the last axis), fused into one kernel, for f32, f16 and bf16.
//!
//! It uses only kiln's public API, as a crate outside kiln would:
//! - the family is a `static TemplateDef` (template text with kiln's `prelude` partial and one of
//!   its own, a named constant, a second entry point and an NVRTC option, registered once with
//!   `register_family`);
//! - its specs are made with `KernelSpec::try_new` (errors, not panics);
//! - `kiln::jit::warm` compiles them (in parallel) into kiln's disk cache, where `kiln cache ls`
//!   lists them and a later process, `kiln cache export` and `import` find them;
//! - with a GPU, it runs kiln's `axpby` and then its own kernel on the result, and compares with
//!   an f64 reference on the CPU. Without one it says it skipped that part and exits 0 (unless
//!   `KILN_REQUIRE_GPU=1`).
//!
//! Run it with `cargo run --release --example app_kernel` (`-- --arch sm_80` warms for another
//! target; the default is the GPU's, else sm_90). Its last line is a JSON summary.

use std::process::ExitCode;

use kiln::jit::{register_family, FamilyExtras, Jit, KernelSpec, Target, TemplateDef};
use kiln::ops::axpby::axpby;
use kiln::runtime::{Array, CommandEncoder, Device, KernelArgs};
use kiln::DType;

/// The family's own partial: GELU with erf, as `{{> app_gelu}}`.
const GELU_PARTIAL: &str = r#"
__device__ __forceinline__ float app_gelu(float v) {
#if {{EXACT}}
  return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
#else
  // tanh approximation
  const float c = 0.7978845608028654f;
  return 0.5f * v * (1.0f + tanhf(c * (v + 0.044715f * v * v * v)));
#endif
}
"#;

/// The template: kiln's prelude (f16/bf16 conversions), the family's partial, two kernels.
const BIAS_GELU_SOURCE: &str = r#"
{{> prelude}}
{{> app_gelu}}
#ifndef APP_BIAS_GELU
#error "the family's NVRTC option did not arrive"
#endif
typedef {{dtype}} T;
constexpr int BLOCK_DIM = {{block_dim}};

// y[r, c] = gelu(x[r, c] + bias[c]); a grid-stride loop over rows * cols elements.
extern "C" __global__ void __launch_bounds__(BLOCK_DIM) {{kernel}}(
    const T* x, const T* bias, T* y, long long n, long long cols) {
  for (long long i = blockIdx.x * (long long)BLOCK_DIM + threadIdx.x; i < n;
       i += (long long)gridDim.x * BLOCK_DIM) {
    y[i] = kiln_from_float<T>(app_gelu(kiln_to_float(x[i]) + kiln_to_float(bias[i % cols])));
  }
}

// The second entry point: gelu in place, no bias.
extern "C" __global__ void __launch_bounds__(BLOCK_DIM) app_gelu_inplace(T* y, long long n) {
  for (long long i = blockIdx.x * (long long)BLOCK_DIM + threadIdx.x; i < n;
       i += (long long)gridDim.x * BLOCK_DIM) {
    y[i] = kiln_from_float<T>(app_gelu(kiln_to_float(y[i])));
  }
}
"#;

/// The family. Its name carries the application's prefix: kiln refuses a family whose name
/// another family (kiln's included) already has.
static BIAS_GELU: TemplateDef = TemplateDef {
    name: "app_bias_gelu",
    source: BIAS_GELU_SOURCE,
    kernel: "app_bias_gelu",
    const_names: &["EXACT"],
    arch_specific: false,
    only_arch: None,
};

static EXTRAS: FamilyExtras = FamilyExtras {
    partials: &[("app_gelu", GELU_PARTIAL)],
    entry_points: &["app_gelu_inplace"],
    options: &["-DAPP_BIAS_GELU=1"],
};

const BLOCK: u16 = 256;

fn spec(dtype: DType) -> kiln::Result<KernelSpec> {
    KernelSpec::try_new(&BIAS_GELU, dtype, BLOCK, 1, &[1])
}

fn specs() -> kiln::Result<Vec<KernelSpec>> {
    register_family(&BIAS_GELU, EXTRAS)?;
    DType::ALL.iter().map(|&d| spec(d)).collect()
}

/// The exact (erf) GELU in f64: the kernel's EXACT=1 variant.
fn gelu_ref(v: f64) -> f64 {
    0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2))
}

/// erf to about 1e-15 (Taylor series for small |x|, a continued fraction for large).
fn erf(x: f64) -> f64 {
    if x.abs() < 3.0 {
        let (mut term, mut sum, x2) = (x, x, x * x);
        for n in 1..200 {
            term *= -x2 / n as f64;
            let add = term / (2 * n + 1) as f64;
            sum += add;
            if add.abs() < 1e-17 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + 1/2/(x + 1/(x + 3/2/(x + ...))))
        let a = x.abs();
        let mut f = 0.0;
        for k in (1..60).rev() {
            f = (k as f64 / 2.0) / (a + f);
        }
        let erfc = (-a * a).exp() / std::f64::consts::PI.sqrt() / (a + f);
        (1.0 - erfc).copysign(x)
    }
}

/// `y = gelu(x + bias)` with the family's kernel on `enc`'s device.
fn bias_gelu(enc: &mut CommandEncoder, x: &Array, bias: &Array, y: &Array) -> kiln::Result<()> {
    let cols = *x.shape().last().unwrap_or(&1);
    if bias.shape() != [cols] || x.shape() != y.shape() || x.dtype() != y.dtype() {
        return Err(kiln::Error::InvalidArgument {
            arg: "bias",
            reason: "shapes or dtypes do not match".into(),
        });
    }
    let kernel = enc.device().kernel(&spec(x.dtype())?)?;
    let mut args = KernelArgs::new();
    args.push(x.device_ptr())
        .push(bias.device_ptr())
        .push(y.device_ptr())
        .push(x.size() as i64)
        .push(cols as i64);
    let blocks = kiln::ops::grid_stride_blocks(enc, x.size(), BLOCK);
    // SAFETY: the arguments are the template's (x, bias, y, n, cols) in order and type, and the
    // shapes were checked above: x and bias are read, y written.
    unsafe {
        enc.launch(
            &kernel,
            blocks as u32,
            BLOCK as u32,
            0,
            args,
            &[x, bias],
            &[y],
        )
    }
}

fn run_on_gpu(dtype: DType) -> kiln::Result<f64> {
    let device = Device::get(0)?;
    let mut enc = CommandEncoder::new(&device)?;
    let (rows, cols) = (37, 1000);
    let n = rows * cols;
    let a: Vec<f64> = (0..n)
        .map(|i| ((i * 7919 % 2003) as f64 / 1001.0) - 1.0)
        .collect();
    let b: Vec<f64> = (0..n)
        .map(|i| ((i * 104729 % 977) as f64 / 488.0) - 1.0)
        .collect();
    let bias: Vec<f64> = (0..cols).map(|c| (c as f64 / cols as f64) - 0.5).collect();
    let xa = Array::from_f64(&mut enc, dtype, &a, &[rows, cols])?;
    let xb = Array::from_f64(&mut enc, dtype, &b, &[rows, cols])?;
    let sum = Array::zeros(&mut enc, dtype, &[rows, cols])?;
    // kiln's op, then the application's kernel on its output, on one encoder.
    axpby(&mut enc, 0.75, &xa, 1.25, &xb, &sum)?;
    let bias_arr = Array::from_f64(&mut enc, dtype, &bias, &[cols])?;
    let y = Array::zeros(&mut enc, dtype, &[rows, cols])?;
    bias_gelu(&mut enc, &sum, &bias_arr, &y)?;
    let got = y.to_f64(&mut enc)?;
    // The reference from the values as rounded to `dtype`, in f64.
    let round = |v: &[f64]| kiln::dtype::decode(dtype, &kiln::dtype::encode(dtype, v));
    let (ra, rb, rbias) = (round(&a)?, round(&b)?, round(&bias)?);
    let mut max_err: f64 = 0.0;
    for i in 0..n {
        let s = round(&[0.75 * ra[i] + 1.25 * rb[i]])?[0];
        let want = gelu_ref(s + rbias[i % cols]);
        max_err = max_err.max((got[i] - want).abs() / (1.0 + want.abs()));
    }
    Ok(max_err)
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("app_kernel: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> kiln::Result<ExitCode> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut targets = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--arch" => {
                let v = it.next().ok_or_else(|| kiln::Error::InvalidArgument {
                    arg: "--arch",
                    reason: "needs a value such as sm_90".into(),
                })?;
                targets.push(v.parse::<Target>()?);
            }
            other => {
                return Err(kiln::Error::InvalidArgument {
                    arg: "arguments",
                    reason: format!("unknown argument {other:?} (expected --arch sm_XY)"),
                })
            }
        }
    }
    let gpus = kiln::runtime::gpus().unwrap_or_default();
    if targets.is_empty() {
        targets = gpus.iter().map(|g| g.target()).collect();
    }
    if targets.is_empty() {
        targets.push(Target::sass(90));
    }
    let specs = specs()?;
    let jit = Jit::global()?;
    let work: Vec<(KernelSpec, Target)> = targets
        .iter()
        .flat_map(|&t| specs.iter().map(move |&s| (s, t)))
        .collect();
    // One call, in parallel (0: a thread per CPU).
    let report = jit.warm(&work, 0, &|_| {});
    for f in &report.failures {
        eprintln!("failed: {f}");
    }
    println!(
        "warmed {} kernels of app_bias_gelu: {} compiled, {} already cached, {} failed",
        work.len(),
        report.compiled,
        report.cached,
        report.failures.len()
    );
    if !report.failures.is_empty() {
        return Ok(ExitCode::FAILURE);
    }
    let mut checks = Vec::new();
    if gpus.is_empty() {
        if kiln::env::require_gpu()? {
            eprintln!("app_kernel: KILN_REQUIRE_GPU=1 but there is no GPU");
            return Ok(ExitCode::FAILURE);
        }
        println!("GPU run skipped: no GPU on this machine");
    } else {
        for dtype in DType::ALL {
            let err = run_on_gpu(dtype)?;
            // f32: accumulated rounding only; 16-bit: the output's rounding (2^-8 for bf16).
            let tol = match dtype {
                DType::F32 => 1e-5,
                DType::F16 => 2e-3,
                _ => 1e-2,
            };
            println!("{dtype}: max relative error {err:.2e} (tolerance {tol:.0e})");
            checks.push((dtype, err, err <= tol));
        }
    }
    let passed = checks.iter().all(|c| c.2);
    println!(
        "{}",
        serde_json::json!({
            "specs": work.len(),
            "compiled": report.compiled,
            "cached": report.cached,
            "failed": report.failures.len(),
            "gpu_run": !gpus.is_empty(),
            "passed": passed,
        })
    );
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
