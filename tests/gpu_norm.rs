//! LayerNorm and RMSNorm, forward and VJP, against the f64 CPU reference on the GPU: every
//! dtype, edge row lengths, with and without weight/bias, strided and broadcast weights,
//! non-contiguous x, graph and direct mode. Skipped without a GPU (unless KILN_REQUIRE_GPU=1).
//!
//! Tolerance: |out - ref| <= tol * (1 + |ref|) per element, tol = 1e-4 (f32), 2e-3 (f16),
//! 1.6e-2 (bf16): a few units in the last place of the output type.

mod common;

use std::sync::Arc;

use kiln::env::Config;
use kiln::jit::KernelSpec;
use kiln::ops::norm::{self, reference_forward, reference_vjp, Kind, Pass};
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::{max_error, tolerance, TestRng};
use kiln::{DType, Error};

const DS: [usize; 13] = [
    1, 3, 31, 32, 33, 256, 768, 1000, 1024, 4096, 8192, 16384, 65536,
];
const ROWS: [usize; 3] = [1, 7, 4096];
/// Larger cases (4096 x 16384 and up) are left out to keep the f64 reference affordable.
const MAX_ELEMENTS: usize = 1 << 25;
const EPS: f64 = 1e-5;

fn encoder(dev: &Arc<Device>, graphs: bool) -> CommandEncoder {
    let mut config = Config::from_env().unwrap();
    config.use_cuda_graphs = graphs;
    CommandEncoder::with_config(dev, &config).unwrap()
}

fn q(dtype: DType, v: Vec<f64>) -> Vec<f64> {
    kiln::dtype::decode(dtype, &kiln::dtype::encode(dtype, &v)).unwrap()
}

/// How the weight is laid out on the device.
#[derive(Clone, Copy, Debug)]
enum WeightLayout {
    Contiguous,
    /// Every other element of a 2d array (stride 2).
    Strided,
    /// One value broadcast to d (stride 0).
    Broadcast,
}

fn upload_param(enc: &mut CommandEncoder, dtype: DType, v: &[f64], layout: WeightLayout) -> Array {
    let d = v.len();
    match layout {
        WeightLayout::Contiguous => Array::from_f64(enc, dtype, v, &[d]).unwrap(),
        WeightLayout::Strided => {
            let wide: Vec<f64> = v.iter().flat_map(|&x| [x, -7.0]).collect();
            Array::from_f64(enc, dtype, &wide, &[2 * d])
                .unwrap()
                .slice(0, 0, 2 * d, 2)
                .unwrap()
        }
        WeightLayout::Broadcast => Array::from_f64(enc, dtype, &v[..1], &[1])
            .unwrap()
            .broadcast_to(&[d])
            .unwrap(),
    }
}

/// How x is laid out on the device.
#[derive(Clone, Copy, Debug)]
enum XLayout {
    Contiguous,
    /// Rows of a wider matrix: row stride 2d, read in place.
    RowSlice,
    /// A transposed matrix: last-axis stride is not 1, so kiln copies it once.
    Transposed,
    /// Rows of a matrix three columns wider, from its fourth column: row stride d + 3, the
    /// first row three elements into a 16-byte granule, read in place.
    Offset,
    /// Rows of a matrix 16 columns wider: row stride d + 16, so each row starts as far into its
    /// 16-byte granule as the output's same row, read in place.
    Padded,
}

fn upload_x(
    enc: &mut CommandEncoder,
    dtype: DType,
    x: &[f64],
    rows: usize,
    d: usize,
    layout: XLayout,
) -> Array {
    match layout {
        XLayout::Contiguous => Array::from_f64(enc, dtype, x, &[rows, d]).unwrap(),
        XLayout::RowSlice => {
            let wide: Vec<f64> = x
                .chunks(d)
                .flat_map(|r| r.iter().copied().chain(std::iter::repeat(9.0).take(d)))
                .collect();
            Array::from_f64(enc, dtype, &wide, &[rows, 2 * d])
                .unwrap()
                .slice(1, 0, d, 1)
                .unwrap()
        }
        XLayout::Offset => {
            let wide: Vec<f64> = x
                .chunks(d)
                .flat_map(|r| [5.0, -6.0, 7.0].into_iter().chain(r.iter().copied()))
                .collect();
            Array::from_f64(enc, dtype, &wide, &[rows, d + 3])
                .unwrap()
                .slice(1, 3, d + 3, 1)
                .unwrap()
        }
        XLayout::Padded => {
            let wide: Vec<f64> = x
                .chunks(d)
                .flat_map(|r| r.iter().copied().chain(std::iter::repeat(-4.0).take(16)))
                .collect();
            Array::from_f64(enc, dtype, &wide, &[rows, d + 16])
                .unwrap()
                .slice(1, 0, d, 1)
                .unwrap()
        }
        XLayout::Transposed => {
            let mut t = vec![0.0; rows * d];
            for r in 0..rows {
                for c in 0..d {
                    t[c * rows + r] = x[r * d + c];
                }
            }
            Array::from_f64(enc, dtype, &t, &[d, rows])
                .unwrap()
                .transpose(&[1, 0])
                .unwrap()
        }
    }
}

struct Case {
    kind: Kind,
    dtype: DType,
    rows: usize,
    d: usize,
    weight: Option<WeightLayout>,
    bias: bool,
    x_layout: XLayout,
    eps: f64,
    /// The value of every row's first element, when set: an outlier far from the row's mean.
    outlier: Option<f64>,
    /// The mean of x's random values (their spread is 2).
    offset: f64,
}

impl Case {
    /// Contiguous x and weight, with a bias for LayerNorm.
    fn plain(kind: Kind, dtype: DType, rows: usize, d: usize, eps: f64) -> Case {
        Case {
            kind,
            dtype,
            rows,
            d,
            weight: Some(WeightLayout::Contiguous),
            bias: kind == Kind::LayerNorm,
            x_layout: XLayout::Contiguous,
            eps,
            outlier: None,
            offset: 0.5,
        }
    }
}

/// Runs forward and VJP for one case; returns the worst error over every output.
fn run_case(enc: &mut CommandEncoder, c: &Case, seed: u64) -> f64 {
    let (dtype, rows, d) = (c.dtype, c.rows, c.d);
    let mut rng = TestRng::new(seed);
    let mut x = q(dtype, rng.values(rows * d, 2.0, c.offset));
    if let Some(v) = c.outlier {
        for row in x.chunks_mut(d) {
            row[0] = q(dtype, vec![v])[0];
        }
    }
    let mut w = q(dtype, rng.values(d, 1.0, 1.0));
    if matches!(c.weight, Some(WeightLayout::Broadcast)) {
        w = vec![w[0]; d];
    }
    let b = q(dtype, rng.values(d, 0.5, 0.0));
    let g = q(dtype, rng.values(rows * d, 1.0, 0.0));
    let xa = upload_x(enc, dtype, &x, rows, d, c.x_layout);
    let ga = Array::from_f64(enc, dtype, &g, &[rows, d]).unwrap();
    let wa = c.weight.map(|l| upload_param(enc, dtype, &w, l));
    let ba = c
        .bias
        .then(|| upload_param(enc, dtype, &b, WeightLayout::Contiguous));
    let (wr, br) = (
        c.weight.map(|_| w.as_slice()),
        c.bias.then_some(b.as_slice()),
    );
    let eps = c.eps as f32;

    let y = match c.kind {
        Kind::LayerNorm => norm::layer_norm(enc, &xa, wa.as_ref(), ba.as_ref(), eps).unwrap(),
        Kind::RmsNorm => norm::rms_norm(enc, &xa, wa.as_ref(), eps).unwrap(),
    };
    assert_eq!((y.shape(), y.dtype()), (&[rows, d][..], dtype));
    let mut err = max_error(
        &y.to_f64(enc).unwrap(),
        &reference_forward(c.kind, &x, wr, br, d, c.eps),
    );

    let (rdx, rdw, rdb) = reference_vjp(c.kind, &x, wr, &g, d, c.eps);
    let (dx, dw, db) = match c.kind {
        Kind::LayerNorm => {
            norm::layer_norm_vjp(enc, &xa, wa.as_ref(), ba.as_ref(), &ga, eps).unwrap()
        }
        Kind::RmsNorm => {
            let (dx, dw) = norm::rms_norm_vjp(enc, &xa, wa.as_ref(), &ga, eps).unwrap();
            (dx, dw, None)
        }
    };
    err = err.max(max_error(&dx.to_f64(enc).unwrap(), &rdx));
    assert_eq!(dw.is_some(), c.weight.is_some());
    assert_eq!(db.is_some(), c.bias && c.kind == Kind::LayerNorm);
    // The weight gradient has the weight's logical shape [d], also for a broadcast weight
    // (summing over the broadcast is the caller's business).
    if let Some(dw) = dw {
        err = err.max(max_error(&dw.to_f64(enc).unwrap(), &rdw));
    }
    if let Some(db) = db {
        err = err.max(max_error(&db.to_f64(enc).unwrap(), &rdb));
    }
    err
}

fn device(test: &str) -> Option<Arc<Device>> {
    common::gpus_or_skip(test)?;
    Some(Device::get(0).unwrap())
}

#[test]
fn every_row_length_rows_and_dtype_match_the_reference() {
    let Some(dev) = device("norm_matrix") else {
        return;
    };
    let mut enc = encoder(&dev, true);
    let mut failures = Vec::new();
    let mut seed = 0;
    for dtype in DType::ALL {
        for &d in &DS {
            for &rows in &ROWS {
                if rows * d > MAX_ELEMENTS {
                    continue;
                }
                for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                    seed += 1;
                    let case = Case::plain(kind, dtype, rows, d, EPS);
                    let err = run_case(&mut enc, &case, seed);
                    if err > tolerance(dtype) {
                        failures.push(format!("{kind:?} {dtype} {rows}x{d}: {err:.3e}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Every kernel the ops choose for vectorised rows, at the shortest and longest row it serves
/// (up to 16,384), on few rows and on more rows than one pass of the grid, eps 1e-5 and 0.
#[test]
fn every_chosen_kernel_matches_the_reference() {
    let Some(dev) = device("norm_kernels") else {
        return;
    };
    let mut enc = encoder(&dev, true);
    let limit = norm::Gpu::of(&dev);
    let mut failures = Vec::new();
    let mut seed = 5000;
    for dtype in DType::ALL {
        let v = dtype.vec_width();
        // (spec pair) -> (shortest d, longest d)
        let mut spans: Vec<((KernelSpec, KernelSpec), usize, usize)> = Vec::new();
        for d in (v..=16384).step_by(v) {
            let pair = (
                norm::choose_spec(
                    Pass::Forward,
                    Kind::LayerNorm,
                    dtype,
                    d,
                    norm::Rows::Aligned,
                    norm::Count::Many,
                    limit,
                ),
                norm::choose_spec(
                    Pass::Vjp,
                    Kind::LayerNorm,
                    dtype,
                    d,
                    norm::Rows::Aligned,
                    norm::Count::Many,
                    limit,
                ),
            );
            match spans.iter_mut().find(|s| s.0 == pair) {
                Some(s) => s.2 = d,
                None => spans.push((pair, d, d)),
            }
        }
        for (_, shortest, longest) in spans {
            for d in [shortest, longest] {
                let many = if d <= 4096 { 300 } else { 40 };
                for (rows, eps) in [(7, EPS), (many, EPS), (7, 0.0)] {
                    for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                        seed += 1;
                        let case = Case::plain(kind, dtype, rows, d, eps);
                        let err = run_case(&mut enc, &case, seed);
                        if err > tolerance(dtype) {
                            failures
                                .push(format!("{kind:?} {dtype} {rows}x{d} eps {eps}: {err:.3e}"));
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn weights_bias_and_layouts_in_graph_and_direct_mode() {
    let Some(dev) = device("norm_layouts") else {
        return;
    };
    let mut failures = Vec::new();
    let mut seed = 1000;
    for graphs in [true, false] {
        let mut enc = encoder(&dev, graphs);
        for dtype in DType::ALL {
            for &d in &[1usize, 33, 768, 1000, 4096, 65536] {
                for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                    let weights = [
                        None,
                        Some(WeightLayout::Contiguous),
                        Some(WeightLayout::Strided),
                        Some(WeightLayout::Broadcast),
                    ];
                    for weight in weights {
                        for bias in [false, true] {
                            if bias && kind == Kind::RmsNorm {
                                continue;
                            }
                            for x_layout in
                                [XLayout::Contiguous, XLayout::RowSlice, XLayout::Transposed]
                            {
                                seed += 1;
                                let case = Case {
                                    kind,
                                    dtype,
                                    rows: 7,
                                    d,
                                    weight,
                                    bias,
                                    x_layout,
                                    eps: EPS,
                                    outlier: None,
                                    offset: 0.5,
                                };
                                let err = run_case(&mut enc, &case, seed);
                                if err > tolerance(dtype) {
                                    failures.push(format!(
                                        "graphs={graphs} {kind:?} {dtype} d={d} weight={weight:?} bias={bias} x={x_layout:?}: {err:.3e}"
                                    ));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures: {failures:#?}",
        failures.len()
    );
}

#[test]
fn an_outlier_far_from_the_mean_keeps_the_statistics_exact() {
    // The first element of each row 1,000 away from the rest (spread about 1): statistics from
    // sums shifted by that element cancel (the kernels that used them: errors up to 2.3e-2 in
    // f32 at d = 65536). Rows held in registers (4096), streamed rows (65536, vectorised; 20001,
    // element by element).
    let Some(dev) = device("norm_outlier") else {
        return;
    };
    let mut failures = Vec::new();
    for graphs in [false, true] {
        let mut enc = encoder(&dev, graphs);
        for dtype in DType::ALL {
            for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                for d in [4096, 20001, 65536] {
                    let case = Case {
                        outlier: Some(1000.0),
                        ..Case::plain(kind, dtype, 3, d, EPS)
                    };
                    let err = run_case(&mut enc, &case, d as u64);
                    if err > tolerance(dtype) {
                        failures.push(format!("graphs={graphs} {kind:?} {dtype} d={d}: {err:.3e}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Long rows, past what one block holds in registers: on Hopper the forward takes a cluster of
/// blocks per row (every vectors-per-thread choice of it is reached: odd d runs element by
/// element), elsewhere the streamed path. Few rows and many, with and without an outlier, every
/// dtype, graph and direct mode, forward and VJP.
#[test]
fn long_rows_match_the_reference() {
    let Some(dev) = device("norm_long_rows") else {
        return;
    };
    let mut failures = Vec::new();
    let mut seed = 9000;
    for graphs in [false, true] {
        let mut enc = encoder(&dev, graphs);
        for dtype in DType::ALL {
            for d in [
                3000, 5120, 12288, 16385, 18432, 30000, 32767, 65535, 65536, 70000, 98304, 131071,
                131072,
            ] {
                // 700 rows: every cluster takes many turns, so the split kernels' rings of
                // stages wrap around several times.
                for (rows, outlier) in [(1, None), (16, Some(1000.0)), (67, None), (700, None)] {
                    if graphs && rows == 67 && d > 65536 {
                        continue; // the f64 reference of the largest cases once is enough
                    }
                    if rows == 700 && (graphs || ![16385, 30000, 65536].contains(&d)) {
                        continue;
                    }
                    for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                        seed += 1;
                        let case = Case {
                            outlier,
                            ..Case::plain(kind, dtype, rows, d, EPS)
                        };
                        let err = run_case(&mut enc, &case, seed);
                        if err > tolerance(dtype) {
                            failures.push(format!(
                                "graphs={graphs} {kind:?} {dtype} {rows}x{d} outlier {outlier:?}: \
                                 {err:.3e}"
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The split-row VJP's layouts by length and count of rows: 16-bit rows of whole vectors past
/// 65,536 on 8 blocks of 24 elements a thread, and rows of one element a vector on 24 elements
/// where there is a row for each SM (8 rows more than SMs) and on 16 where there are fewer (3).
#[test]
fn split_vjp_layouts_match_the_reference() {
    let Some(dev) = device("norm_split_vjp_layouts") else {
        return;
    };
    let many = dev.info().multiprocessors as usize + 8;
    let mut failures = Vec::new();
    let mut seed = 9500;
    for graphs in [false, true] {
        let mut enc = encoder(&dev, graphs);
        for dtype in [DType::F16, DType::BF16] {
            for d in [16385, 50257, 70000, 98304] {
                for rows in [3, many] {
                    if graphs && rows > 3 {
                        continue; // the same kernels as in direct mode
                    }
                    for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                        seed += 1;
                        let case = Case::plain(kind, dtype, rows, d, EPS);
                        let err = run_case(&mut enc, &case, seed);
                        if err > tolerance(dtype) {
                            failures.push(format!(
                                "graphs={graphs} {kind:?} {dtype} {rows}x{d}: {err:.3e}"
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The 16-bit split RMSNorm forward claims its rows at run time from a counter each launch
/// leaves zero, where a call has more rows than four a cluster slot: calls with many rows a
/// cluster (most of them claimed), three calls encoded back to back on different inputs before
/// any result is read (in graph mode independent nodes of one graph, which may run at once and
/// so need counters of their own), both dtypes, graph and direct mode; LayerNorm's fixed rows
/// on the same kernel beside them.
#[test]
fn claimed_rows_match_the_reference() {
    let Some(dev) = device("norm_claimed_rows") else {
        return;
    };
    let mut failures = Vec::new();
    let mut seed = 9700;
    for graphs in [false, true] {
        let mut enc = encoder(&dev, graphs);
        for dtype in [DType::F16, DType::BF16] {
            for (kind, rows, d) in [
                (Kind::LayerNorm, 600, 32768),
                (Kind::LayerNorm, 300, 65536),
                (Kind::RmsNorm, 300, 65536),
                (Kind::RmsNorm, 500, 40960),
                (Kind::RmsNorm, 100, 131072),
            ] {
                let w = q(dtype, TestRng::new(seed).values(d, 1.0, 1.0));
                let b = q(dtype, TestRng::new(seed + 1).values(d, 0.5, 0.0));
                let wa = Array::from_f64(&mut enc, dtype, &w, &[d]).unwrap();
                let ba = Array::from_f64(&mut enc, dtype, &b, &[d]).unwrap();
                let mut calls = Vec::new();
                for _ in 0..3 {
                    seed += 1;
                    let x = q(dtype, TestRng::new(seed).values(rows * d, 2.0, 0.5));
                    let xa = Array::from_f64(&mut enc, dtype, &x, &[rows, d]).unwrap();
                    let y = match kind {
                        Kind::LayerNorm => {
                            norm::layer_norm(&mut enc, &xa, Some(&wa), Some(&ba), EPS as f32)
                        }
                        Kind::RmsNorm => norm::rms_norm(&mut enc, &xa, Some(&wa), EPS as f32),
                    }
                    .unwrap();
                    calls.push((x, y));
                }
                for (i, (x, y)) in calls.iter().enumerate() {
                    let bias = (kind == Kind::LayerNorm).then_some(b.as_slice());
                    let want = reference_forward(kind, x, Some(&w), bias, d, EPS);
                    let err = max_error(&y.to_f64(&mut enc).unwrap(), &want);
                    if err > tolerance(dtype) {
                        failures.push(format!(
                            "graphs={graphs} {kind:?} {dtype} {rows}x{d} call {i}: {err:.3e}"
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A concurrent section is never split at the bound on a commit's launches, so it can hold more
/// claiming calls than the encoder has row counters: those past the counters take their rows in
/// turn, and every call, all of them nodes of one graph that may run at once, stays right.
#[test]
fn claimed_rows_past_the_counters_of_a_commit() {
    let Some(dev) = device("norm_claimed_rows_concurrent") else {
        return;
    };
    let mut config = Config::from_env().unwrap();
    config.use_cuda_graphs = true;
    config.max_ops_per_buffer = Some(2); // three counters
    let mut enc = CommandEncoder::with_config(&dev, &config).unwrap();
    let (dtype, rows, d) = (DType::BF16, 300, 65536);
    let w = q(dtype, TestRng::new(9800).values(d, 1.0, 1.0));
    let wa = Array::from_f64(&mut enc, dtype, &w, &[d]).unwrap();
    let inputs: Vec<_> = (0..6)
        .map(|i| {
            let x = q(dtype, TestRng::new(9801 + i).values(rows * d, 2.0, 0.5));
            let xa = Array::from_f64(&mut enc, dtype, &x, &[rows, d]).unwrap();
            (x, xa)
        })
        .collect();
    enc.begin_concurrent();
    let outputs: Vec<_> = inputs
        .iter()
        .map(|(_, xa)| norm::rms_norm(&mut enc, xa, Some(&wa), EPS as f32).unwrap())
        .collect();
    enc.end_concurrent().unwrap();
    let mut failures = Vec::new();
    for (i, ((x, _), y)) in inputs.iter().zip(&outputs).enumerate() {
        let want = reference_forward(Kind::RmsNorm, x, Some(&w), None, d, EPS);
        let err = max_error(&y.to_f64(&mut enc).unwrap(), &want);
        if err > tolerance(dtype) {
            failures.push(format!("call {i}: {err:.3e}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Calls that each read what the previous call wrote, encoded back to back before any result
/// is read: forward, VJP and the column sums of its parameter gradients, the next forward taking
/// that gradient as its weight. In direct mode on sm_90 these kernels start while the previous
/// one finishes (`launch_dependent`), so a read before the kernel's wait would see half-written
/// inputs. Each step is checked against the reference on the inputs the GPU gave it. Every
/// dtype, graph and direct mode, rows a block each, split rows, and rows claimed at run time.
#[test]
fn chained_calls_match_the_reference() {
    let Some(dev) = device("norm_chained_calls") else {
        return;
    };
    let mut failures = Vec::new();
    for graphs in [false, true] {
        let mut enc = encoder(&dev, graphs);
        for dtype in DType::ALL {
            for (rows, d) in [
                (2048usize, 768usize),
                (200, 32768),
                (300, 65536),
                (3, 131072),
            ] {
                let mut rng = TestRng::new(rows as u64 + d as u64);
                let x = q(dtype, rng.values(rows * d, 2.0, 0.5));
                let w = q(dtype, rng.values(d, 1.0, 1.0));
                let b = q(dtype, rng.values(d, 0.5, 0.0));
                let xa = Array::from_f64(&mut enc, dtype, &x, &[rows, d]).unwrap();
                let wa = Array::from_f64(&mut enc, dtype, &w, &[d]).unwrap();
                let ba = Array::from_f64(&mut enc, dtype, &b, &[d]).unwrap();
                // y1 = rms(x; w), y2 = ln(y1; w, b), (dx, dw, db) = ln_vjp(y2; w, b; g = y1),
                // y3 = rms(dx; dw), (dx3, dw3) = rms_vjp(y3; w; g = y2).
                let y1 = norm::rms_norm(&mut enc, &xa, Some(&wa), EPS as f32).unwrap();
                let y2 = norm::layer_norm(&mut enc, &y1, Some(&wa), Some(&ba), EPS as f32).unwrap();
                let (dx, dw, db) =
                    norm::layer_norm_vjp(&mut enc, &y2, Some(&wa), Some(&ba), &y1, EPS as f32)
                        .unwrap();
                let dw = dw.unwrap();
                let y3 = norm::rms_norm(&mut enc, &dx, Some(&dw), EPS as f32).unwrap();
                let (dx3, dw3) =
                    norm::rms_norm_vjp(&mut enc, &y3, Some(&wa), &y2, EPS as f32).unwrap();
                let [y1, y2, dx, dw, db, y3, dx3, dw3] =
                    [&y1, &y2, &dx, &dw, &db.unwrap(), &y3, &dx3, &dw3.unwrap()]
                        .map(|a| a.to_f64(&mut enc).unwrap());
                let (rms, ln) = (Kind::RmsNorm, Kind::LayerNorm);
                let (rdx, rdw, rdb) = reference_vjp(ln, &y2, Some(&w), &y1, d, EPS);
                let (rdx3, rdw3, _) = reference_vjp(rms, &y3, Some(&w), &y2, d, EPS);
                let steps = [
                    (
                        "y1",
                        &y1,
                        reference_forward(rms, &x, Some(&w), None, d, EPS),
                    ),
                    (
                        "y2",
                        &y2,
                        reference_forward(ln, &y1, Some(&w), Some(&b), d, EPS),
                    ),
                    ("dx", &dx, rdx),
                    ("dw", &dw, rdw),
                    ("db", &db, rdb),
                    (
                        "y3",
                        &y3,
                        reference_forward(rms, &dx, Some(&dw), None, d, EPS),
                    ),
                    ("dx3", &dx3, rdx3),
                    ("dw3", &dw3, rdw3),
                ];
                for (name, got, want) in steps {
                    let err = max_error(got, &want);
                    if err > tolerance(dtype) {
                        failures.push(format!(
                            "graphs={graphs} {dtype} {rows}x{d} {name}: {err:.3e}"
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// 16-bit forward rows of 16,385 to 32,768 elements take a block each (the ring of 3 or 4
/// vectors a thread, where it and the weights fit) when a call has a row for every
/// multiprocessor, and a cluster each on Hopper when it has fewer: both sides of that count (and
/// many turns a block), both norms, every dtype, an outlier, a broadcast weight without bias,
/// graph and direct mode.
#[test]
fn long_rows_a_block_each_match_the_reference() {
    let Some(dev) = device("norm_long_ring") else {
        return;
    };
    let sms = dev.info().multiprocessors as usize;
    let gpu = norm::Gpu::of(&dev);
    let (mut failures, mut on_the_ring) = (Vec::new(), 0);
    let mut seed = 9500;
    for graphs in [false, true] {
        let mut enc = encoder(&dev, graphs);
        for dtype in DType::ALL {
            for d in [16392, 18432, 20480, 24576, 24584, 32768] {
                let counts = if graphs {
                    vec![(sms, Some(1000.0))]
                } else {
                    vec![(sms, Some(1000.0)), (sms - 1, None), (3 * sms + 5, None)]
                };
                for (rows, outlier) in counts {
                    for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                        let count = norm::Count::of(rows, &dev);
                        let spec = norm::choose_spec(
                            Pass::Forward,
                            kind,
                            dtype,
                            d,
                            norm::Rows::Aligned,
                            count,
                            gpu,
                        );
                        if spec.template.name == "norm_fwd" && spec.constant("ITEMS") >= Some(3) {
                            on_the_ring += 1;
                        }
                        let mut cases = vec![Case {
                            outlier,
                            ..Case::plain(kind, dtype, rows, d, EPS)
                        }];
                        if d == 18432 && rows == sms {
                            cases.push(Case {
                                weight: Some(WeightLayout::Broadcast),
                                bias: false,
                                ..Case::plain(kind, dtype, rows, d, EPS)
                            });
                        }
                        for case in cases {
                            seed += 1;
                            let err = run_case(&mut enc, &case, seed);
                            if err > tolerance(dtype) {
                                failures.push(format!(
                                    "graphs={graphs} {kind:?} {dtype} {rows}x{d} {spec}: {err:.3e}"
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    // Hopper's 227 KiB hold the ring of every 16-bit length here but LayerNorm's past 24,576:
    // three counts of many rows (two direct, one graph) x two dtypes x (4 + 6) lengths.
    if gpu.shared_limit >= 227 * 1024 {
        assert_eq!(on_the_ring, 3 * 2 * (4 + 6), "cases on the long ring");
    }
}

/// Rows that do not start on a 16-byte granule, long enough for a cluster a row on Hopper: odd
/// lengths, contiguous or rows of a wider matrix laid out alike (the split kernels shift their
/// columns onto the granules), and x read in place at an offset or with another stride (one
/// element at a time); as many rows as clusters and many more (every cluster takes rows laid out
/// like its first), with an outlier. Every dtype, forward and VJP, direct and graph mode.
#[test]
fn unaligned_long_rows_match_the_reference() {
    let Some(dev) = device("norm_unaligned_long_rows") else {
        return;
    };
    let mut failures = Vec::new();
    let mut seed = 12000;
    for graphs in [false, true] {
        let mut enc = encoder(&dev, graphs);
        for dtype in DType::ALL {
            for (d, rows) in [
                (4103, 700),
                (16385, 67),
                (16385, 700),
                (18432, 300),
                (30001, 150),
                (65535, 40),
                (100_003, 24),
            ] {
                for x_layout in [
                    XLayout::Contiguous,
                    XLayout::Padded,
                    XLayout::Offset,
                    XLayout::RowSlice,
                ] {
                    let scattered = matches!(x_layout, XLayout::Offset | XLayout::RowSlice);
                    if (graphs || scattered) && (rows > 300 || d > 30001) {
                        continue;
                    }
                    for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                        seed += 1;
                        // The weights' element loads on shifted columns, strided and
                        // broadcast too.
                        let weight = match x_layout {
                            XLayout::Offset | XLayout::Padded => WeightLayout::Strided,
                            XLayout::RowSlice => WeightLayout::Broadcast,
                            _ => WeightLayout::Contiguous,
                        };
                        let case = Case {
                            x_layout,
                            weight: Some(weight),
                            outlier: (rows < 100).then_some(1000.0),
                            ..Case::plain(kind, dtype, rows, d, EPS)
                        };
                        let err = run_case(&mut enc, &case, seed);
                        if err > tolerance(dtype) {
                            failures.push(format!(
                                "graphs={graphs} {kind:?} {dtype} {rows}x{d} {x_layout:?}: \
                                 {err:.3e}"
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Rows over several warps (1,032 to 12,288: one block a row) and split rows (a cluster of blocks
/// a row on Hopper) whose mean is large against their spread: LayerNorm's statistics combine
/// each warp's mean and centred sums, and must stay as exact as a two-pass sum over the whole
/// row. Every dtype, forward and VJP, direct mode.
#[test]
fn rows_with_a_large_mean_keep_exact_statistics() {
    let Some(dev) = device("norm_long_mean") else {
        return;
    };
    let mut failures = Vec::new();
    let mut enc = encoder(&dev, false);
    for dtype in DType::ALL {
        for d in [1032, 3000, 12288, 16385, 18432, 30000, 65536] {
            for offset in [300.0, -1000.0] {
                let case = Case {
                    offset,
                    ..Case::plain(Kind::LayerNorm, dtype, 24, d, EPS)
                };
                let err = run_case(&mut enc, &case, d as u64);
                // f32 as the large-mean checks below: the inputs' own rounding at 1000 is 6e-5.
                let bound = if dtype == DType::F32 {
                    5e-3
                } else {
                    tolerance(dtype)
                };
                if err > bound {
                    failures.push(format!("{dtype} 24x{d} mean {offset}: {err:.3e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn higher_rank_x_and_large_means() {
    let Some(dev) = device("norm_rank") else {
        return;
    };
    let mut enc = encoder(&dev, true);
    let (a, b, d) = (3usize, 5usize, 96usize);
    let mut rng = TestRng::new(77);
    // A large mean relative to the spread.
    let x = q(DType::F32, rng.values(a * b * d, 1.0, 1000.0));
    let xa = Array::from_f64(&mut enc, DType::F32, &x, &[a, b, d]).unwrap();
    let y = norm::layer_norm(&mut enc, &xa, None, None, 1e-5).unwrap();
    assert_eq!(y.shape(), &[a, b, d]);
    let err = max_error(
        &y.to_f64(&mut enc).unwrap(),
        &reference_forward(Kind::LayerNorm, &x, None, None, d, EPS),
    );
    assert!(err < 5e-3, "rank 3, mean 1000: {err}");
    // A view whose leading axes do not collapse (every other row of axis 1): copied, then right.
    let wide = Array::from_f64(
        &mut enc,
        DType::F32,
        &q(DType::F32, rng.values(a * 2 * b * d, 2.0, 0.0)),
        &[a, 2 * b, d],
    )
    .unwrap();
    let view = wide.slice(1, 0, 2 * b, 2).unwrap();
    let host = view.to_f64(&mut enc).unwrap();
    let y = norm::rms_norm(&mut enc, &view, None, 1e-5).unwrap();
    let err = max_error(
        &y.to_f64(&mut enc).unwrap(),
        &reference_forward(Kind::RmsNorm, &host, None, None, d, EPS),
    );
    assert!(err < 1e-4, "non-collapsing view: {err}");
    // The long-row loop path with a large mean.
    let d = 65536;
    let x = q(DType::F32, rng.values(2 * d, 1.0, 300.0));
    let xa = Array::from_f64(&mut enc, DType::F32, &x, &[2, d]).unwrap();
    let y = norm::layer_norm(&mut enc, &xa, None, None, 1e-5).unwrap();
    let err = max_error(
        &y.to_f64(&mut enc).unwrap(),
        &reference_forward(Kind::LayerNorm, &x, None, None, d, EPS),
    );
    assert!(err < 5e-3, "loop path, mean 300: {err}");
}

#[test]
fn bad_input_is_an_error_naming_the_argument_and_empty_input_is_empty() {
    let Some(dev) = device("norm_errors") else {
        return;
    };
    let mut enc = encoder(&dev, true);
    let x = Array::from_f64(&mut enc, DType::F32, &[1.0; 12], &[3, 4]).unwrap();
    let w4 = Array::from_f64(&mut enc, DType::F32, &[1.0; 4], &[4]).unwrap();
    let w5 = Array::from_f64(&mut enc, DType::F32, &[1.0; 5], &[5]).unwrap();
    let wh = Array::from_f64(&mut enc, DType::F16, &[1.0; 4], &[4]).unwrap();
    let scalar = Array::from_f64(&mut enc, DType::F32, &[1.0], &[]).unwrap();
    let arg = |e: Error| match e.argument() {
        Some(arg) => arg,
        None => panic!("expected an error naming an argument, got {e}"),
    };
    assert_eq!(
        arg(norm::layer_norm(&mut enc, &scalar, None, None, 1e-5).unwrap_err()),
        "x"
    );
    assert_eq!(
        arg(norm::layer_norm(&mut enc, &x, Some(&w5), None, 1e-5).unwrap_err()),
        "weight"
    );
    assert_eq!(
        arg(norm::layer_norm(&mut enc, &x, None, Some(&w5), 1e-5).unwrap_err()),
        "bias"
    );
    assert_eq!(
        arg(norm::rms_norm(&mut enc, &x, Some(&wh), 1e-5).unwrap_err()),
        "weight"
    );
    assert_eq!(
        arg(norm::layer_norm(&mut enc, &x, Some(&w4), None, -1.0).unwrap_err()),
        "eps"
    );
    assert_eq!(
        arg(norm::rms_norm(&mut enc, &x, None, f32::NAN).unwrap_err()),
        "eps"
    );
    let g_bad = Array::from_f64(&mut enc, DType::F32, &[1.0; 8], &[2, 4]).unwrap();
    assert_eq!(
        arg(norm::layer_norm_vjp(&mut enc, &x, None, None, &g_bad, 1e-5).unwrap_err()),
        "cotangent"
    );
    // Empty input: empty output, zero parameter gradients.
    let e = Array::from_f64(&mut enc, DType::BF16, &[], &[0, 4]).unwrap();
    let wb = Array::from_f64(&mut enc, DType::BF16, &[1.0; 4], &[4]).unwrap();
    let y = norm::layer_norm(&mut enc, &e, Some(&wb), None, 1e-5).unwrap();
    assert_eq!(y.shape(), &[0, 4]);
    let (dx, dw, db) = norm::layer_norm_vjp(&mut enc, &e, Some(&wb), Some(&wb), &e, 1e-5).unwrap();
    assert_eq!(dx.shape(), &[0, 4]);
    assert_eq!(dw.unwrap().to_f64(&mut enc).unwrap(), vec![0.0; 4]);
    assert_eq!(db.unwrap().to_f64(&mut enc).unwrap(), vec![0.0; 4]);
}

#[test]
fn the_column_reduce_sums_any_number_of_rows() {
    let Some(dev) = device("reduce_cols") else {
        return;
    };
    let mut enc = encoder(&dev, true);
    let mut rng = TestRng::new(5);
    // d a multiple of 4 takes 16-byte loads; the VJP's partial sums of d = 768 (528 blocks) and
    // 16384 (132 blocks) take few and many column threads per block; few rows take rows of up
    // to a block of column threads (a split convolution's weight gradient: 1,296 values in 256
    // splits, 294,912 in 16).
    let shapes = [1usize, 3, 31, 40, 300, 1500]
        .into_iter()
        .flat_map(|rows| [1usize, 70, 1000].map(|d| (rows, d)))
        .chain([(528, 768), (132, 16384), (7, 4), (5, 36)])
        .chain([(256, 1296), (16, 294_912), (9, 20_001), (2, 3001)]);
    for (rows, d) in shapes {
        let p = q(DType::F32, rng.values(rows * d, 1.0, 0.0));
        let pa = Array::from_f64(&mut enc, DType::F32, &p, &[rows, d]).unwrap();
        let want: Vec<f64> = (0..d)
            .map(|c| (0..rows).map(|r| p[r * d + c]).sum())
            .collect();
        for dtype in DType::ALL {
            let got = norm::reduce_cols(&mut enc, &pa, dtype)
                .unwrap()
                .to_f64(&mut enc)
                .unwrap();
            let err = max_error(&got, &want);
            assert!(err <= tolerance(dtype), "{rows}x{d} -> {dtype}: {err}");
        }
    }
    // A transposed view is summed as the matrix it shows; zero columns give an empty sum.
    let p = q(DType::F32, rng.values(6 * 10, 1.0, 0.0));
    let pa = Array::from_f64(&mut enc, DType::F32, &p, &[6, 10]).unwrap();
    let got = norm::reduce_cols(&mut enc, &pa.transpose(&[1, 0]).unwrap(), DType::F32)
        .unwrap()
        .to_f64(&mut enc)
        .unwrap();
    let want: Vec<f64> = (0..6)
        .map(|r| p[r * 10..r * 10 + 10].iter().sum())
        .collect();
    assert!(max_error(&got, &want) <= tolerance(DType::F32), "{got:?}");
    let none = Array::from_f64(&mut enc, DType::F32, &[], &[4, 0]).unwrap();
    let got = norm::reduce_cols(&mut enc, &none, DType::F32).unwrap();
    assert_eq!(got.shape(), &[0]);
    // Other ranks and dtypes are errors naming the argument (they used to panic or be misread).
    let flat = Array::from_f64(&mut enc, DType::F32, &[1.0, 2.0], &[2]).unwrap();
    let half = Array::from_f64(&mut enc, DType::F16, &[1.0, 2.0], &[1, 2]).unwrap();
    for bad in [&flat, &half] {
        match norm::reduce_cols(&mut enc, bad, DType::F32) {
            Err(e) => assert_eq!(e.argument(), Some("partial"), "{e}"),
            other => panic!("expected an error naming partial, got {other:?}"),
        }
    }
}

#[test]
fn the_parameter_gradients_are_the_same_on_every_run() {
    let Some(dev) = device("deterministic VJP") else {
        return;
    };
    let mut enc = encoder(&dev, true);
    let mut rng = TestRng::new(9);
    // Short rows put up to eight rows' groups in a block, whose partial sums are combined in
    // shared memory; long rows give many partial rows to the column sum.
    for (rows, d) in [(4096usize, 33usize), (4096, 256), (4096, 768), (64, 16384)] {
        let x = rng.values(rows * d, 2.0, 0.5);
        let g = rng.values(rows * d, 1.0, 0.0);
        let w = rng.values(d, 1.0, 1.0);
        for dtype in DType::ALL {
            let xa = Array::from_f64(&mut enc, dtype, &x, &[rows, d]).unwrap();
            let ga = Array::from_f64(&mut enc, dtype, &g, &[rows, d]).unwrap();
            let wa = Array::from_f64(&mut enc, dtype, &w, &[d]).unwrap();
            let mut runs = Vec::new();
            for _ in 0..4 {
                let (_, dw, db) =
                    norm::layer_norm_vjp(&mut enc, &xa, Some(&wa), Some(&wa), &ga, 1e-5).unwrap();
                let dw = dw.unwrap().to_f64(&mut enc).unwrap();
                let db = db.unwrap().to_f64(&mut enc).unwrap();
                runs.push((dw, db));
            }
            for run in &runs[1..] {
                assert!(
                    *run == runs[0],
                    "{rows}x{d} {dtype}: sums differ between runs"
                );
            }
        }
    }
}

/// The cold-start stand-ins (`KILN_STAND_INS`, the looped kernel of each pass compiled quickly)
/// against the reference: every dtype, both norms, vectorised and scalar rows from 1 element
/// to past what one block holds, graph and direct mode alternating.
#[test]
fn stand_ins_match_the_reference() {
    let Some(dev) = device("norm_stand_ins") else {
        return;
    };
    let mut encoders = [encoder(&dev, true), encoder(&dev, false)];
    let mut failures = Vec::new();
    let mut seed = 9000;
    for dtype in DType::ALL {
        for d in [1, 7, 320, 1000, 4104, 30000] {
            let rows = if d < 4096 { 33 } else { 5 };
            for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                seed += 1;
                let enc = &mut encoders[seed as usize % 2];
                let mut rng = TestRng::new(seed);
                let x = q(dtype, rng.values(rows * d, 2.0, 0.5));
                let w = q(dtype, rng.values(d, 1.0, 1.0));
                let b = q(dtype, rng.values(d, 0.5, 0.0));
                let g = q(dtype, rng.values(rows * d, 1.0, 0.0));
                let up = |enc: &mut CommandEncoder, v: &[f64], s: &[usize]| {
                    Array::from_f64(enc, dtype, v, s).unwrap()
                };
                let (xa, ga) = (up(enc, &x, &[rows, d]), up(enc, &g, &[rows, d]));
                let (wa, ba) = (up(enc, &w, &[d]), up(enc, &b, &[d]));
                let rms = kind == Kind::RmsNorm;
                let bias = (!rms).then_some(&ba);
                let n_reads = if d % dtype.vec_width() == 0 {
                    dtype.vec_width()
                } else {
                    1
                };
                let fwd = norm::stand_in::spec(Pass::Forward, kind, dtype, n_reads);
                let vjp = norm::stand_in::spec(Pass::Vjp, kind, dtype, n_reads);
                let y =
                    norm::tuning::forward_with(enc, kind, &xa, Some(&wa), bias, EPS as f32, fwd)
                        .unwrap();
                let (dx, dw, db) =
                    norm::tuning::vjp_with(enc, kind, &xa, Some(&wa), !rms, &ga, EPS as f32, vjp)
                        .unwrap();
                let br = (!rms).then_some(b.as_slice());
                let want_y = reference_forward(kind, &x, Some(&w), br, d, EPS);
                let (rdx, rdw, rdb) = reference_vjp(kind, &x, Some(&w), &g, d, EPS);
                let mut err = max_error(&y.to_f64(enc).unwrap(), &want_y);
                err = err.max(max_error(&dx.to_f64(enc).unwrap(), &rdx));
                err = err.max(max_error(&dw.unwrap().to_f64(enc).unwrap(), &rdw));
                if let Some(db) = db {
                    err = err.max(max_error(&db.to_f64(enc).unwrap(), &rdb));
                }
                if err > tolerance(dtype) {
                    failures.push(format!("{kind:?} {dtype} {rows}x{d}: {err:.3e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
