//! Non-overlapping patch convolutions (ViT patch embeddings), whose passes run as one 1x1
//! convolution over reshaped operands (`ops::conv::patch`), against the f64 CPU reference on the
//! GPU: 1-D, 2-D (16x16 and 14x14 on 3 channels, the latter with a ragged edge and padded
//! columns; 2x2 on 4 channels; one patch per image) and 3-D (2x4x4, 1x3x3); every dtype and
//! pass; graph and direct mode; one ViT-B/16-sized forward; the rewrite is the path taken, agrees
//! with the geometry run as given, and honours `KILN_CONV_PATH`; strided operands and an empty
//! batch; and the pieces it is built from (`Array::split_axis`, `copy_into`, `zero_into`).
//! Skipped without a GPU (unless KILN_REQUIRE_GPU=1).
//!
//! Tolerance per element as in gpu_conv.rs: |out - ref| <= r * |ref| + 2e-5 * S, S the sum of
//! |terms| and r the output type's rounding. Inputs are exact in their dtype.

mod common;

use common::conv_cases::{random, worst};

use std::sync::{Arc, Mutex};

use kiln::env::{Config, ConvPath};
use kiln::ops::conv::{self, hopper, patch, plan, reference, tuning, ConvParams, Geometry, Pass};
use kiln::ops::copy::{copy_into, zero_into};
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::DType;

/// The patch counter and KILN_CONV_PATH are process-wide: the tests run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn encoder(dev: &Arc<Device>, graphs: bool) -> CommandEncoder {
    let mut config = Config::from_env().unwrap();
    config.use_cuda_graphs = graphs;
    CommandEncoder::with_config(dev, &config).unwrap()
}

struct Case {
    name: &'static str,
    x: Vec<usize>,
    w: Vec<usize>,
    p: ConvParams,
}

/// A patch convolution: strides equal to the kernel's extents.
fn case(name: &'static str, x: &[usize], w: &[usize]) -> Case {
    let kernel = &w[1..w.len() - 1];
    Case {
        name,
        x: x.to_vec(),
        w: w.to_vec(),
        p: ConvParams::default().strides(kernel),
    }
}

fn cases() -> Vec<Case> {
    vec![
        case(
            "1d kernel 5 on 3 channels, ragged, K' 15 -> 16",
            &[2, 23, 3],
            &[8, 5, 3],
        ),
        case(
            "1d kernel 4 on 6 channels (a reshape)",
            &[3, 20, 6],
            &[16, 4, 6],
        ),
        case("2d 16x16 on 3 channels", &[2, 32, 48, 3], &[24, 16, 16, 3]),
        case(
            "2d 14x14 on 3 channels, ragged, K' 588 -> 592",
            &[2, 30, 45, 3],
            &[16, 14, 14, 3],
        ),
        case(
            "2d 14x14 on 3 channels, 20 outputs, batch 1",
            &[1, 28, 28, 3],
            &[20, 14, 14, 3],
        ),
        case("2d 2x2 on 4 channels, ragged", &[2, 9, 8, 4], &[8, 2, 2, 4]),
        case("2d one patch per image", &[3, 4, 4, 3], &[8, 4, 4, 3]),
        case(
            "3d 2x4x4 on 3 channels, ragged",
            &[2, 5, 9, 8, 3],
            &[8, 2, 4, 4, 3],
        ),
        case(
            "3d 1x3x3 on 2 channels, ragged, K' 18 -> 24",
            &[2, 3, 7, 6, 2],
            &[12, 1, 3, 3, 2],
        ),
    ]
}

/// A case's geometry and its three tensors on the GPU.
struct Operands {
    g: Geometry,
    x: Array,
    w: Array,
    dy: Array,
}

fn upload(
    enc: &mut CommandEncoder,
    dtype: DType,
    c: &Case,
    seed: u64,
) -> (Operands, [Vec<f64>; 3]) {
    let g = Geometry::new(&c.x, &c.w, &c.p).unwrap();
    let mut rng = TestRng::new(seed);
    let x = random(&mut rng, dtype, c.x.iter().product());
    let w = random(&mut rng, dtype, c.w.iter().product());
    let dy = random(&mut rng, dtype, g.output_shape().iter().product());
    let ops = Operands {
        g,
        x: Array::from_f64(enc, dtype, &x, &c.x).unwrap(),
        w: Array::from_f64(enc, dtype, &w, &c.w).unwrap(),
        dy: Array::from_f64(enc, dtype, &dy, &g.output_shape()).unwrap(),
    };
    (ops, [x, w, dy])
}

fn want(pass: Pass, g: &Geometry, [x, w, dy]: &[Vec<f64>; 3]) -> reference::Reference {
    match pass {
        Pass::Forward => reference::forward(g, x, w),
        Pass::BackwardData => reference::backward_data(g, dy, w),
        Pass::BackwardWeight => reference::backward_weight(g, x, dy),
    }
}

/// The pass through the public ops.
fn public(enc: &mut CommandEncoder, pass: Pass, c: &Case, o: &Operands) -> Array {
    conv::conv_pass(enc, pass, &c.p, &o.x, &o.w, &o.dy).unwrap()
}

fn check(
    failures: &mut Vec<String>,
    what: String,
    dtype: DType,
    got: &[f64],
    want: &reference::Reference,
) {
    let (ratio, at) = worst(dtype, got, want);
    if ratio > 1.0 {
        failures.push(format!(
            "{what}: error {ratio:.2}x tolerance at {at}: got {} want {}",
            got[at], want.values[at]
        ));
    }
}

/// The kernel family of the 1x1 plan that runs `pass` of patch convolution `g`.
fn inner_family(enc: &mut CommandEncoder, dtype: DType, pass: Pass, g: &Geometry) -> &'static str {
    let one = patch::inner(g).unwrap();
    let zeros = |enc: &mut CommandEncoder, s: &[usize]| Array::zeros(enc, dtype, s).unwrap();
    let (x, w, dy) = (
        zeros(enc, &one.input_shape()),
        zeros(enc, &one.weight_shape()),
        zeros(enc, &one.output_shape()),
    );
    conv::plan_for(enc, pass, &ConvParams::default(), &x, &w, &dy)
        .unwrap()
        .spec
        .template
        .name
}

fn matrix(graphs: bool) {
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, graphs);
    let mut failures = Vec::new();
    let mut checked = 0;
    for (ci, c) in cases().iter().enumerate() {
        for dtype in DType::ALL {
            let (o, host) = upload(&mut enc, dtype, c, ci as u64 * 7 + 1);
            assert!(patch::is_patch(&o.g), "{}: not a patch", c.name);
            for pass in Pass::ALL {
                let before = patch::taken();
                let got = public(&mut enc, pass, c, &o).to_f64(&mut enc).unwrap();
                if patch::taken() != before + 1 {
                    failures.push(format!("{} {dtype} {}: not rewritten", c.name, pass.name()));
                }
                let what = format!("{} {dtype} {}", c.name, pass.name());
                check(&mut failures, what, dtype, &got, &want(pass, &o.g, &host));
                checked += 1;
            }
        }
    }
    eprintln!(
        "patch matrix ({}): {checked} checks, {} failed",
        if graphs { "graph" } else { "direct" },
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn patch_matrix_graph_mode() {
    if common::gpus_or_skip("patch_matrix_graph_mode").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    matrix(true);
}

#[test]
fn patch_matrix_direct_mode() {
    if common::gpus_or_skip("patch_matrix_direct_mode").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    matrix(false);
}

/// The reference forward, its output channels computed in parallel (231 M multiply-adds).
fn parallel_forward(g: &Geometry, x: &[f64], w: &[f64]) -> reference::Reference {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = g.cout.div_ceil(threads).max(1);
    let taps = g.kernel_size() * g.cin;
    let chunks: Vec<(usize, reference::Reference)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..g.cout)
            .step_by(per)
            .map(|start| {
                let n = per.min(g.cout - start);
                s.spawn(move || {
                    let mut shape = g.weight_shape();
                    shape[0] = n;
                    let part = Geometry::new(
                        &g.input_shape(),
                        &shape,
                        &ConvParams::default().strides(&g.stride[3 - g.spatial..]),
                    )
                    .unwrap();
                    let r = reference::forward(&part, x, &w[start * taps..(start + n) * taps]);
                    (start, r)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let pixels = g.batch * g.output_pixels();
    let mut values = vec![0.0; pixels * g.cout];
    let mut magnitude = vec![0.0; pixels * g.cout];
    for (start, r) in chunks {
        let n = r.values.len() / pixels;
        for p in 0..pixels {
            for j in 0..n {
                values[p * g.cout + start + j] = r.values[p * n + j];
                magnitude[p * g.cout + start + j] = r.magnitude[p * n + j];
            }
        }
    }
    reference::Reference { values, magnitude }
}

/// ViT-B/16's patch embedding, N = 2: every dtype against one reference (the values, k / 256
/// with |k| < 256, are exact in all three). On sm_90 the 16-bit forwards run on the Hopper
/// family, which refused the 3-channel geometry before the rewrite.
#[test]
fn vit_b16_forward() {
    if common::gpus_or_skip("vit_b16_forward").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, true);
    let c = case("vit-b/16", &[2, 224, 224, 3], &[768, 16, 16, 3]);
    let g = Geometry::new(&c.x, &c.w, &c.p).unwrap();
    // m / 256 with |m| <= 255: 8 significant bits at most, as bf16 holds.
    let exact = |n: usize, seed: u64| -> Vec<f64> {
        let mut rng = TestRng::new(seed);
        (0..n)
            .map(|_| (((rng.next_f64() + 1.0) / 2.0 * 511.0).floor() - 255.0) / 256.0)
            .collect()
    };
    let x = exact(c.x.iter().product(), 1);
    let w = exact(c.w.iter().product(), 2);
    let want = parallel_forward(&g, &x, &w);
    let auto = Config::from_env().unwrap().conv_path == ConvPath::Auto;
    let mut failures = Vec::new();
    for dtype in DType::ALL {
        let xa = Array::from_f64(&mut enc, dtype, &x, &c.x).unwrap();
        let wa = Array::from_f64(&mut enc, dtype, &w, &c.w).unwrap();
        let before = patch::taken();
        let got = conv::conv_forward(&mut enc, &xa, &wa, &c.p)
            .unwrap()
            .to_f64(&mut enc)
            .unwrap();
        assert_eq!(patch::taken(), before + 1, "{dtype}: not rewritten");
        check(
            &mut failures,
            format!("vit-b/16 {dtype}"),
            dtype,
            &got,
            &want,
        );
        let family = inner_family(&mut enc, dtype, Pass::Forward, &g);
        eprintln!("vit-b/16 {dtype} forward: {family}");
        if dev.arch() == hopper::ARCH && auto && dtype != DType::F32 {
            assert_eq!(family, hopper::WGMMA.name, "{dtype}");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The rewrite agrees with the geometry run as given (an explicit tile, which skips the
/// rewrite): both within tolerance of the reference, ragged edges and pad columns included.
#[test]
fn the_rewrite_agrees_with_the_geometry_as_given() {
    if common::gpus_or_skip("the_rewrite_agrees_with_the_geometry_as_given").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, true);
    let mut failures = Vec::new();
    let all = cases();
    for c in [&all[3], &all[7], &all[8]] {
        for dtype in DType::ALL {
            let (o, host) = upload(&mut enc, dtype, c, 3);
            let tile = if plan::Math::of(dtype, dev.arch(), false).tensor() {
                tuning::TENSOR_TILES[0]
            } else {
                tuning::FMA_TILES[0]
            };
            for pass in Pass::ALL {
                let (first, second) = match pass {
                    Pass::Forward => (&o.x, &o.w),
                    Pass::BackwardData => (&o.dy, &o.w),
                    Pass::BackwardWeight => (&o.x, &o.dy),
                };
                let before = patch::taken();
                let given = tuning::run_with(&mut enc, pass, &o.g, first, second, tile, 1)
                    .unwrap()
                    .to_f64(&mut enc)
                    .unwrap();
                assert_eq!(patch::taken(), before, "an explicit tile was rewritten");
                let rewritten = public(&mut enc, pass, c, &o).to_f64(&mut enc).unwrap();
                let r = want(pass, &o.g, &host);
                let what = |path: &str| format!("{} {dtype} {} {path}", c.name, pass.name());
                check(&mut failures, what("as given"), dtype, &given, &r);
                check(&mut failures, what("rewritten"), dtype, &rewritten, &r);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `KILN_CONV_PATH=igemm` still rewrites, and plans the 1x1 convolutions on the `mma.sync` /
/// FMA kernels. SERIAL keeps the variable from the other tests.
#[test]
fn conv_path_igemm_plans_the_1x1_on_igemm() {
    if common::gpus_or_skip("conv_path_igemm_plans_the_1x1_on_igemm").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, false);
    // A geometry no other test plans, so that the plan cache cannot answer from an auto plan.
    let c = case(
        "2d 6x6 on 3 channels, 40 outputs",
        &[3, 13, 19, 3],
        &[40, 6, 6, 3],
    );
    let dtype = DType::BF16;
    let (o, host) = upload(&mut enc, dtype, &c, 21);
    let mut failures = Vec::new();
    std::env::set_var("KILN_CONV_PATH", "igemm");
    for pass in Pass::ALL {
        let before = patch::taken();
        let got = public(&mut enc, pass, &c, &o).to_f64(&mut enc);
        let family = inner_family(&mut enc, dtype, pass, &o.g);
        let got = got.unwrap();
        if patch::taken() != before + 1 {
            failures.push(format!("{}: not rewritten", pass.name()));
        }
        if family != plan::IGEMM.name {
            failures.push(format!("{}: the 1x1 ran {family}", pass.name()));
        }
        check(
            &mut failures,
            pass.name().to_string(),
            dtype,
            &got,
            &want(pass, &o.g, &host),
        );
    }
    std::env::remove_var("KILN_CONV_PATH");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Transposed input, weight and cotangent views give the same results (the views are read
/// through, or copied once).
#[test]
fn strided_operands() {
    if common::gpus_or_skip("strided_operands").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, true);
    let c = case(
        "2d 5x3 on 3 channels, ragged",
        &[2, 11, 10, 3],
        &[8, 5, 3, 3],
    );
    let dtype = DType::F16;
    let (o, host) = upload(&mut enc, dtype, &c, 5);
    // Each operand stored with its two spatial axes swapped, viewed back as (N, H, W, C).
    let swapped = |enc: &mut CommandEncoder, a: &Array| {
        let t = a.swapaxes(1, 2).unwrap().contiguous(enc).unwrap();
        t.swapaxes(1, 2).unwrap()
    };
    let views = Operands {
        g: o.g,
        x: swapped(&mut enc, &o.x),
        w: swapped(&mut enc, &o.w),
        dy: swapped(&mut enc, &o.dy),
    };
    assert!(!views.x.is_contiguous() && !views.w.is_contiguous() && !views.dy.is_contiguous());
    let mut failures = Vec::new();
    for pass in Pass::ALL {
        let got = public(&mut enc, pass, &c, &views).to_f64(&mut enc).unwrap();
        check(
            &mut failures,
            pass.name().to_string(),
            dtype,
            &got,
            &want(pass, &o.g, &host),
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// An empty batch gives an empty output and input gradient and a zero weight gradient.
#[test]
fn empty_batch() {
    if common::gpus_or_skip("empty_batch").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, true);
    let p = ConvParams::default().strides(&[14]);
    for dtype in DType::ALL {
        let x = Array::from_f64(&mut enc, dtype, &[], &[0, 30, 28, 3]).unwrap();
        let w = Array::full(&mut enc, dtype, &[8, 14, 14, 3], 1.0).unwrap();
        let y = conv::conv_forward(&mut enc, &x, &w, &p).unwrap();
        assert_eq!(y.shape(), &[0, 2, 2, 8]);
        let dx = conv::conv_backward_data(&mut enc, &y, &w, &[0, 30, 28, 3], &p).unwrap();
        assert_eq!(dx.shape(), &[0, 30, 28, 3]);
        let dw = conv::conv_backward_weight(&mut enc, &x, &y, &[8, 14, 14, 3], &p).unwrap();
        assert_eq!(dw.shape(), &[8, 14, 14, 3]);
        assert!(dw.to_f64(&mut enc).unwrap().iter().all(|&v| v == 0.0));
    }
}

/// The pieces: `split_axis` on a sliced view, `copy_into` with zero padding and into a strided
/// destination (32- and 64-bit indexing), `zero_into`, and their argument errors.
#[test]
fn split_axis_copy_into_and_zero_into() {
    let Some(gpus) = common::gpus_or_skip("split_axis_copy_into_and_zero_into") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, true);
    let dtype = DType::F32;
    let iota = |n: usize| (0..n).map(|i| i as f64).collect::<Vec<_>>();
    // (4, 7, 3): axis 1 cut to 6 and split into (3, 2), then the (3, 2) axes swapped.
    let x = Array::from_f64(&mut enc, dtype, &iota(84), &[4, 7, 3]).unwrap();
    let v = x
        .slice(1, 0, 6, 1)
        .unwrap()
        .split_axis(1, &[3, 2])
        .unwrap()
        .swapaxes(1, 2)
        .unwrap();
    assert_eq!(v.shape(), &[4, 2, 3, 3]);
    let mut want = Vec::new();
    for a in 0..4 {
        for k in 0..2 {
            for p in 0..3 {
                for ch in 0..3 {
                    want.push(((a * 7 + p * 2 + k) * 3 + ch) as f64);
                }
            }
        }
    }
    assert_eq!(v.to_f64(&mut enc).unwrap(), want);
    // copy_into: the same view into a fresh array gives the same values.
    let dst = Array::full(&mut enc, dtype, &[4, 2, 3, 3], -1.0).unwrap();
    copy_into(&mut enc, &v, &dst).unwrap();
    assert_eq!(dst.to_f64(&mut enc).unwrap(), want);
    // Rows of 5 into rows of 8: zeros after each row.
    let src = Array::from_f64(&mut enc, dtype, &iota(15), &[3, 5]).unwrap();
    let padded = Array::full(&mut enc, dtype, &[3, 8], 7.0).unwrap();
    copy_into(&mut enc, &src, &padded).unwrap();
    let want: Vec<f64> = (0..24)
        .map(|i| {
            if i % 8 < 5 {
                (i / 8 * 5 + i % 8) as f64
            } else {
                0.0
            }
        })
        .collect();
    assert_eq!(padded.to_f64(&mut enc).unwrap(), want);
    // Into every other column of a (4, 10) array; the rest keeps its 9s. Then zero a
    // transposed view of its first two rows.
    let big = Array::full(&mut enc, dtype, &[4, 10], 9.0).unwrap();
    let src = Array::from_f64(&mut enc, dtype, &iota(20), &[4, 5]).unwrap();
    copy_into(&mut enc, &src, &big.slice(1, 1, 10, 2).unwrap()).unwrap();
    zero_into(
        &mut enc,
        &big.slice(0, 0, 2, 1).unwrap().swapaxes(0, 1).unwrap(),
    )
    .unwrap();
    let want: Vec<f64> = (0..40)
        .map(|i| match (i / 10, i % 10) {
            (r, _) if r < 2 => 0.0,
            (r, c) if c % 2 == 1 => (r * 5 + c / 2) as f64,
            _ => 9.0,
        })
        .collect();
    assert_eq!(big.to_f64(&mut enc).unwrap(), want);
    // Argument errors.
    let arg = |r: kiln::Result<()>| r.unwrap_err().argument().unwrap_or_default();
    let half = Array::zeros(&mut enc, DType::F16, &[3, 5]).unwrap();
    let f = Array::zeros(&mut enc, dtype, &[3, 5]).unwrap();
    assert_eq!(arg(copy_into(&mut enc, &half, &padded)), "src");
    assert_eq!(arg(copy_into(&mut enc, &padded, &f)), "src");
    assert_eq!(
        arg(copy_into(&mut enc, &f.reshape(&[15]).unwrap(), &padded)),
        "src"
    );
    assert_eq!(
        arg(copy_into(
            &mut enc,
            &padded.slice(1, 0, 4, 1).unwrap(),
            &padded
        )),
        "dst"
    );
    let row = Array::zeros(&mut enc, dtype, &[1, 5]).unwrap();
    let broadcast = row.broadcast_to(&[3, 5]).unwrap();
    assert_eq!(arg(copy_into(&mut enc, &f, &broadcast)), "dst");
    assert_eq!(arg(zero_into(&mut enc, &broadcast)), "dst");
    assert_eq!(
        x.split_axis(1, &[2, 2]).unwrap_err().argument(),
        Some("parts")
    );
    assert_eq!(x.split_axis(3, &[1]).unwrap_err().argument(), Some("axis"));
    // Offsets past 2^31 take the 64-bit path: three f16 elements 2^30 apart.
    if gpus[0].memory_bytes >= 16 << 30 {
        let n = (1usize << 31) + 1;
        let huge = Array::empty(&dev, DType::F16, &[n]).unwrap();
        let spread = huge.slice(0, 0, n, 1 << 30).unwrap();
        assert_eq!(spread.shape(), &[3]);
        let src = Array::from_f64(&mut enc, DType::F16, &[1.0, 2.0, 3.0], &[3]).unwrap();
        copy_into(&mut enc, &src, &spread).unwrap();
        assert_eq!(spread.to_f64(&mut enc).unwrap(), vec![1.0, 2.0, 3.0]);
        zero_into(&mut enc, &spread).unwrap();
        assert_eq!(spread.to_f64(&mut enc).unwrap(), vec![0.0; 3]);
    }
}
