//! `kiln check`: run LayerNorm forward and VJP, and the three convolution passes, through the
//! ops and the command encoder on each GPU, on random data, and compare with the f64 CPU
//! references. Proves the whole path: template, NVRTC, cache, driver, encoder.

use std::time::Instant;

use crate::dtype::{decode, encode, DType};
use crate::error::{Error, Result};
use crate::jit::Origin;
use crate::ops::conv::{self, reference, ConvParams, Geometry};
use crate::ops::norm::{self, Kind, Pass};
use crate::runtime::{Array, CommandEncoder, Device, GpuInfo};

/// Shapes (rows, d) the self-check runs: a single element, odd and unaligned rows, a long row.
pub const SHAPES: &[(usize, usize)] = &[(7, 1), (5, 33), (4, 1000), (3, 4096), (2, 65536)];

/// Convolutions the self-check runs, as (input shape, weight shape, params): a strided, padded
/// 3x3 whose channels take 16-byte loads, a 3-channel stem (a shape `kiln warm` compiles), a
/// depthwise 3x3 and a 4x4 patch embedding of 6 channels (the 1x1 rewrite; with 1-4 channels
/// the stem family's plan for the geometry as given, which is not warmed, would be reported).
#[doc(hidden)]
pub fn conv_cases() -> Vec<(Vec<usize>, Vec<usize>, ConvParams)> {
    vec![
        (
            vec![2, 9, 9, 32],
            vec![64, 3, 3, 32],
            ConvParams::default().strides(&[2]).padding(&[1]),
        ),
        (
            vec![2, 12, 10, 3],
            vec![16, 3, 3, 3],
            ConvParams::default().strides(&[2]).padding(&[1]),
        ),
        // Depthwise (the direct family) and a patch embedding (a 1x1 convolution over the
        // patches laid out as channels).
        (
            vec![2, 9, 9, 32],
            vec![32, 3, 3, 1],
            ConvParams::default().groups(32).padding(&[1]),
        ),
        (
            vec![2, 18, 16, 6],
            vec![8, 4, 4, 6],
            ConvParams::default().strides(&[4]),
        ),
    ]
}

/// Per-element tolerance |out - ref| <= tol * (1 + |ref|), per dtype: a few units in the last
/// place of the output type (f32 accumulation error is far below the f16/bf16 rounding).
#[doc(hidden)]
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
    }
}

/// One case of the self-check: an op on one dtype and shape, on one GPU, against the reference.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CheckResult {
    /// The GPU's ordinal.
    pub gpu: usize,
    /// The op: `layer_norm`, `layer_norm_vjp`, or a convolution pass.
    pub op: &'static str,
    /// The kernel spec that ran, as its `Display` writes it.
    pub spec: String,
    /// rows x d for the norms; N,H,W,C_in * C_out,R,S,C_in/groups for convolutions.
    pub shape: String,
    /// Where the kernel's module came from.
    pub origin: Origin,
    /// Time to get the loaded kernel (compile or disk read, plus module load), in ms.
    pub load_ms: f64,
    /// The error measure and the bound it must stay under. Norms: the largest
    /// |out - ref| / (1 + |ref|). Convolutions: the largest |out - ref| / (r * |ref| + 2e-5 * S),
    /// S the sum of |terms| and r the output type's rounding, with bound 1.
    pub max_error: f64,
    /// The bound `max_error` may not pass.
    pub tolerance: f64,
    /// Whether `max_error` stayed within `tolerance`.
    pub passed: bool,
}

/// A small deterministic generator for test data (xorshift64*), uniform in [-1, 1).
#[doc(hidden)]
pub struct TestRng(u64);

impl TestRng {
    pub fn new(seed: u64) -> TestRng {
        TestRng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
        bits as f64 / (1u64 << 52) as f64 - 1.0
    }

    /// A whole number from `lo` to `hi` (both included), each about equally likely.
    pub fn pick(&mut self, lo: usize, hi: usize) -> usize {
        let unit = (self.next_f64() + 1.0) / 2.0; // [0, 1)
        (lo + (unit * (hi - lo + 1) as f64) as usize).min(hi)
    }

    pub fn values(&mut self, n: usize, scale: f64, offset: f64) -> Vec<f64> {
        (0..n).map(|_| self.next_f64() * scale + offset).collect()
    }
}

/// Largest |got - want| / (1 + |want|); infinite for a NaN or a length mismatch.
#[doc(hidden)]
pub fn max_error(got: &[f64], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    got.iter().zip(want).fold(0.0, |m, (g, w)| {
        let e = (g - w).abs() / (1.0 + w.abs());
        if e.is_nan() {
            f64::INFINITY
        } else {
            m.max(e)
        }
    })
}

/// Runs LayerNorm forward on every dtype and shape in [`SHAPES`], the VJP on two shapes, and
/// every convolution pass on every dtype and [`conv_cases`].
pub fn check_gpu(gpu: &GpuInfo) -> Result<Vec<CheckResult>> {
    let mut out = check_norms(gpu)?;
    out.extend(check_convs(gpu)?);
    Ok(out)
}

fn check_norms(gpu: &GpuInfo) -> Result<Vec<CheckResult>> {
    let dev = Device::get(gpu.ordinal)?;
    let mut enc = CommandEncoder::new(&dev)?;
    let mut out = Vec::new();
    let eps = 1e-5;
    for dtype in DType::ALL {
        let tol = tolerance(dtype);
        for (i, &(rows, d)) in SHAPES.iter().enumerate() {
            let mut rng = TestRng::new(i as u64 + 1);
            // Quantise the inputs first, so the reference sees exactly what the GPU sees.
            let q = |v: Vec<f64>| decode(dtype, &encode(dtype, &v));
            let (x, w, b) = (
                q(rng.values(rows * d, 2.0, 0.5))?,
                q(rng.values(d, 1.0, 1.0))?,
                q(rng.values(d, 0.5, 0.0))?,
            );
            let xa = Array::from_f64(&mut enc, dtype, &x, &[rows, d])?;
            let wa = Array::from_f64(&mut enc, dtype, &w, &[d])?;
            let ba = Array::from_f64(&mut enc, dtype, &b, &[d])?;
            // Fresh allocations are 256-byte aligned, so rows vectorise whenever d allows, and
            // are alike otherwise.
            let rows_layout = if d % dtype.vec_width() == 0 {
                norm::Rows::Aligned
            } else {
                norm::Rows::Alike
            };
            let limit = norm::Gpu::of(&dev);
            let spec = norm::choose_spec(
                Pass::Forward,
                Kind::LayerNorm,
                dtype,
                d,
                rows_layout,
                norm::Count::of(rows, &dev),
                limit,
            );
            let started = Instant::now();
            let origin = dev.kernel(&spec)?.origin;
            let load_ms = started.elapsed().as_secs_f64() * 1e3;
            let y = norm::layer_norm(&mut enc, &xa, Some(&wa), Some(&ba), eps as f32)?;
            let want = norm::reference_forward(Kind::LayerNorm, &x, Some(&w), Some(&b), d, eps);
            let err = max_error(&y.to_f64(&mut enc)?, &want);
            out.push(CheckResult {
                gpu: gpu.ordinal,
                op: "layer_norm",
                spec: spec.to_string(),
                shape: format!("{rows}x{d}"),
                origin,
                load_ms,
                max_error: err,
                tolerance: tol,
                passed: err <= tol,
            });
            if d == 1000 || d == 65536 {
                let g = q(rng.values(rows * d, 1.0, 0.0))?;
                let ga = Array::from_f64(&mut enc, dtype, &g, &[rows, d])?;
                let vspec = norm::choose_spec(
                    Pass::Vjp,
                    Kind::LayerNorm,
                    dtype,
                    d,
                    rows_layout,
                    norm::Count::of(rows, &dev),
                    limit,
                );
                let started = Instant::now();
                let origin = dev.kernel(&vspec)?.origin;
                let load_ms = started.elapsed().as_secs_f64() * 1e3;
                let (dx, dw, db) =
                    norm::layer_norm_vjp(&mut enc, &xa, Some(&wa), Some(&ba), &ga, eps as f32)?;
                let (rdx, rdw, rdb) =
                    norm::reference_vjp(Kind::LayerNorm, &x, Some(&w), &g, d, eps);
                let missing = || Error::InvalidArgument {
                    arg: "vjp",
                    reason: "a requested gradient is missing".into(),
                };
                let err = max_error(&dx.to_f64(&mut enc)?, &rdx)
                    .max(max_error(&dw.ok_or_else(missing)?.to_f64(&mut enc)?, &rdw))
                    .max(max_error(&db.ok_or_else(missing)?.to_f64(&mut enc)?, &rdb));
                out.push(CheckResult {
                    gpu: gpu.ordinal,
                    op: "layer_norm_vjp",
                    spec: vspec.to_string(),
                    shape: format!("{rows}x{d}"),
                    origin,
                    load_ms,
                    max_error: err,
                    tolerance: tol,
                    passed: err <= tol,
                });
            }
        }
    }
    Ok(out)
}

/// An output element's error over the convolution bound |out - ref| <= r * |ref| + 2e-5 * S + h
/// (r: [`conv_rounding`], S: the sum of the |terms|, h: half the spacing of the dtype's
/// subnormals, the least error a rounded output can have near zero), which the GPU tests use
/// too: at most 1 passes; a non-finite output is infinitely far. An element no term reaches (ref
/// and S zero: backward-data's pixels past a strided kernel's last window) must be exactly zero.
#[doc(hidden)]
pub fn conv_error(dtype: DType, got: f64, reference: f64, magnitude: f64) -> f64 {
    let subnormal_half_step = match dtype {
        DType::F32 => 2f64.powi(-150),
        DType::F16 => 2f64.powi(-25),
        DType::BF16 => 2f64.powi(-134),
    };
    let floor = if magnitude > 0.0 {
        subnormal_half_step
    } else {
        0.0
    };
    let bound = conv_rounding(dtype) * reference.abs() + 2e-5 * magnitude + floor;
    let e = (got - reference).abs();
    match () {
        _ if !got.is_finite() => f64::INFINITY,
        _ if bound == 0.0 => {
            if e == 0.0 {
                0.0
            } else {
                f64::INFINITY
            }
        }
        _ => e / bound,
    }
}

/// The rounding of one output element of `dtype` (relative), for the convolution bound
/// |out - ref| <= r * |ref| + 2e-5 * S (the GPU tests use the same).
#[doc(hidden)]
pub fn conv_rounding(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-6,
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
    }
}

/// `[2, 9, 9]` as `2,9,9`.
fn dims(shape: &[usize]) -> String {
    shape
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn check_convs(gpu: &GpuInfo) -> Result<Vec<CheckResult>> {
    let dev = Device::get(gpu.ordinal)?;
    let mut enc = CommandEncoder::new(&dev)?;
    let mut out = Vec::new();
    for dtype in DType::ALL {
        for (i, (x_shape, w_shape, params)) in conv_cases().into_iter().enumerate() {
            let g = Geometry::new(&x_shape, &w_shape, &params)?;
            let mut rng = TestRng::new(100 + i as u64);
            let q = |v: Vec<f64>| decode(dtype, &encode(dtype, &v));
            let count = |s: &[usize]| s.iter().product::<usize>();
            let x = q(rng.values(count(&x_shape), 1.0, 0.0))?;
            let w = q(rng.values(count(&w_shape), 1.0, 0.0))?;
            let dy = q(rng.values(count(&g.output_shape()), 1.0, 0.0))?;
            let xa = Array::from_f64(&mut enc, dtype, &x, &x_shape)?;
            let wa = Array::from_f64(&mut enc, dtype, &w, &w_shape)?;
            let dya = Array::from_f64(&mut enc, dtype, &dy, &g.output_shape())?;
            for pass in conv::Pass::ALL {
                let started = Instant::now();
                let plan = conv::plan_for(&enc, pass, &params, &xa, &wa, &dya)?;
                let load_ms = started.elapsed().as_secs_f64() * 1e3;
                let got = conv::conv_pass(&mut enc, pass, &params, &xa, &wa, &dya)?;
                let want = match pass {
                    conv::Pass::Forward => reference::forward(&g, &x, &w),
                    conv::Pass::BackwardData => reference::backward_data(&g, &dy, &w),
                    conv::Pass::BackwardWeight => reference::backward_weight(&g, &x, &dy),
                };
                let got = got.to_f64(&mut enc)?;
                let err = if got.len() == want.values.len() {
                    got.iter()
                        .zip(want.values.iter().zip(&want.magnitude))
                        .map(|(&g, (&r, &s))| conv_error(dtype, g, r, s))
                        .fold(0.0, f64::max)
                } else {
                    f64::INFINITY
                };
                out.push(CheckResult {
                    gpu: gpu.ordinal,
                    op: match pass {
                        conv::Pass::Forward => "conv_forward",
                        conv::Pass::BackwardData => "conv_backward_data",
                        conv::Pass::BackwardWeight => "conv_backward_weight",
                    },
                    spec: plan.spec.to_string(),
                    shape: format!("{}*{}", dims(&x_shape), dims(&w_shape)),
                    origin: plan.kernel.origin,
                    load_ms,
                    max_error: err,
                    tolerance: 1.0,
                    passed: err <= 1.0,
                });
            }
        }
    }
    Ok(out)
}

/// Runs the self-check on every GPU. `Ok(None)` when there is no GPU to check.
pub fn run() -> Result<Option<Vec<CheckResult>>> {
    let gpus = match crate::runtime::gpus() {
        Ok(g) if !g.is_empty() => g,
        Ok(_) | Err(Error::NoDriver(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for gpu in &gpus {
        out.extend(check_gpu(gpu)?);
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_error_holds_untouched_elements_to_zero_and_never_divides_by_zero() {
        // Backward-data's pixels past a strided kernel's last window: no term, so the reference
        // and its magnitude are 0. 0 / 0 made `kiln check` fail a correct kernel.
        assert_eq!(conv_error(DType::F16, 0.0, 0.0, 0.0), 0.0);
        assert_eq!(conv_error(DType::F16, -0.0, 0.0, 0.0), 0.0);
        assert_eq!(conv_error(DType::F32, 1e-30, 0.0, 0.0), f64::INFINITY);
        assert_eq!(conv_error(DType::F32, f64::NAN, 0.0, 0.0), f64::INFINITY);
        assert_eq!(
            conv_error(DType::F32, f64::INFINITY, 1.0, 1.0),
            f64::INFINITY
        );
        // Otherwise the bound r |ref| + 2e-5 S.
        let e = conv_error(DType::F32, 1.0 + 1e-6 + 2e-5, 1.0, 1.0);
        assert!((e - 1.0).abs() < 1e-9, "{e}");
        assert!(conv_error(DType::BF16, 1.004, 1.0, 1.0) < 1.0);
        // One product near zero in f16: the correctly rounded subnormal output (273 steps of
        // 2^-24) passes, one step off does not.
        let (r, s) = (-1.6246092854999006e-5, 1.6246092854999006e-5);
        assert!(conv_error(DType::F16, -273.0 * 2f64.powi(-24), r, s) <= 1.0);
        assert!(conv_error(DType::F16, -274.0 * 2f64.powi(-24), r, s) > 1.0);
    }
}
