//! `kiln check`: load LayerNorm kernels through the JIT on each GPU, run them on random data and
//! compare with the f64 CPU reference. Proves the whole path: template, NVRTC, cache, driver.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};

use crate::dtype::{decode, encode, DType};
use crate::error::{Error, Result};
use crate::jit::{Jit, KernelTable, Origin};
use crate::ops::layer_norm;
use crate::runtime::GpuInfo;

/// Shapes (rows, d) the self-check runs: a single element, odd and unaligned rows, a long row.
pub const SHAPES: &[(usize, usize)] = &[(7, 1), (5, 33), (4, 1000), (3, 4096), (2, 65536)];

/// Per-element tolerance |out - ref| <= tol * (1 + |ref|), per dtype: a few units in the last
/// place of the output type (f32 accumulation error is far below the f16/bf16 rounding).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct CheckResult {
    pub gpu: usize,
    pub spec: String,
    pub rows: usize,
    pub d: usize,
    pub origin: Origin,
    /// Time to get the loaded kernel (compile or disk read, plus module load), in ms.
    pub load_ms: f64,
    /// Largest |out - ref| / (1 + |ref|), and the bound it must stay under.
    pub max_error: f64,
    pub tolerance: f64,
    pub passed: bool,
}

/// A small deterministic generator for test data (xorshift64*), uniform in [-1, 1).
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

    pub fn values(&mut self, n: usize, scale: f64, offset: f64) -> Vec<f64> {
        (0..n).map(|_| self.next_f64() * scale + offset).collect()
    }
}

/// Runs LayerNorm forward on one GPU for every dtype and shape in [`SHAPES`].
pub fn check_gpu(jit: &Jit, table: &KernelTable, gpu: &GpuInfo) -> Result<Vec<CheckResult>> {
    let ctx = CudaContext::new(gpu.ordinal)?;
    let mut out = Vec::new();
    for dtype in DType::ALL {
        for (i, &(rows, d)) in SHAPES.iter().enumerate() {
            out.push(check_one(jit, table, &ctx, gpu, dtype, rows, d, i as u64)?);
        }
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn check_one(
    jit: &Jit,
    table: &KernelTable,
    ctx: &Arc<CudaContext>,
    gpu: &GpuInfo,
    dtype: DType,
    rows: usize,
    d: usize,
    seed: u64,
) -> Result<CheckResult> {
    let eps = 1e-5;
    let mut rng = TestRng::new(seed + 1);
    // Quantise the inputs first, so the reference sees exactly what the GPU sees.
    let q = |v: Vec<f64>| decode(dtype, &encode(dtype, &v));
    let x = q(rng.values(rows * d, 2.0, 0.5));
    let w = q(rng.values(d, 1.0, 1.0));
    let b = q(rng.values(d, 0.5, 0.0));
    let want = layer_norm::reference_forward(&x, Some(&w), Some(&b), d, eps);

    let vectorized = d % dtype.vec_width() == 0;
    let spec = layer_norm::forward_spec(dtype, d, vectorized, true, true);
    let started = Instant::now();
    let kernel = table.get_or_load(jit, ctx, gpu.target(), &spec)?;
    let load_ms = started.elapsed().as_secs_f64() * 1e3;

    let stream = ctx.default_stream();
    let x_dev = stream.clone_htod(&encode(dtype, &x))?;
    let w_dev = stream.clone_htod(&encode(dtype, &w))?;
    let b_dev = stream.clone_htod(&encode(dtype, &b))?;
    // Poison the output (all bits set is NaN in every dtype) so unwritten elements show.
    let mut y_dev = stream.clone_htod(&vec![0xFFu8; rows * d * dtype.size()])?;
    let (d_arg, row_stride, unit_stride, eps_arg) = (d as i32, d as i64, 1i64, eps as f32);
    let mut launch = stream.launch_builder(&kernel.function);
    launch
        .arg(&x_dev)
        .arg(&w_dev)
        .arg(&b_dev)
        .arg(&mut y_dev)
        .arg(&d_arg)
        .arg(&row_stride)
        .arg(&unit_stride)
        .arg(&unit_stride)
        .arg(&eps_arg);
    let config = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (spec.block_dim as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the argument list matches kiln_layer_norm_fwd's signature; every buffer holds
    // rows * d (x, y) or d (w, b) elements of `dtype`.
    unsafe { launch.launch(config) }?;
    let got = decode(dtype, &stream.clone_dtoh(&y_dev)?);

    let tol = tolerance(dtype);
    let mut max_error: f64 = 0.0;
    let mut passed = got.len() == want.len();
    for (g, r) in got.iter().zip(&want) {
        let err = (g - r).abs() / (1.0 + r.abs());
        if !err.is_finite() || err > tol {
            passed = false;
        }
        max_error = if err.is_finite() {
            max_error.max(err)
        } else {
            f64::INFINITY
        };
    }
    Ok(CheckResult {
        gpu: gpu.ordinal,
        spec: spec.to_string(),
        rows,
        d,
        origin: kernel.origin,
        load_ms,
        max_error,
        tolerance: tol,
        passed,
    })
}

/// Runs the self-check on every GPU. `Ok(None)` when there is no GPU to check.
pub fn run(jit: &Jit) -> Result<Option<Vec<CheckResult>>> {
    let gpus = match crate::runtime::gpus() {
        Ok(g) if !g.is_empty() => g,
        Ok(_) | Err(Error::NoDriver(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    let table = KernelTable::new();
    let mut out = Vec::new();
    for gpu in &gpus {
        out.extend(check_gpu(jit, &table, gpu)?);
    }
    Ok(Some(out))
}
