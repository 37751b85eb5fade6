//! Convolution forward, backward-data and backward-weight against the f64 CPU reference on the
//! GPU, over MLX's whole configuration space: 1/2/3-D, strides (also larger than the kernel),
//! asymmetric padding, kernel and input dilation, groups (depthwise too), flip, 1x1, C_in = 3,
//! channels that are not a multiple of 8, batch 1, outputs of size 1; every dtype; graph and
//! direct mode; every tile kiln registers. Skipped without a GPU (unless KILN_REQUIRE_GPU=1).
//!
//! Tolerance per element: |out - ref| <= r * |ref| + 2e-5 * S, where S is the sum of |terms|
//! (which bounds any summation order's rounding) and r is the output type's rounding: 1e-6
//! (f32), 1e-3 (f16, half an ulp is 4.9e-4), 8e-3 (bf16, half an ulp is 3.9e-3). Inputs are
//! exact in their dtype, so products are exact in f32 and only the sums round; except f32 on
//! tensor cores (sm_80 on), whose operands are split into two TF32 parts each: a product's error
//! is then below 2^-20 of its magnitude, well within the 2e-5 S term. One TF32 product
//! (`KILN_ALLOW_TF32`) is held to 2e-3 S instead.

mod common;

use common::conv_cases::{random, worst, worst_tf32};

use std::sync::{Arc, Mutex};

use kiln::env::{Config, ConvPath};
use kiln::jit::KernelSpec;
use kiln::ops::conv::{
    self, depthwise, direct, grouped, hopper, plan, reference, stem, tuning, widen, ConvParams,
    Geometry, Pass,
};
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::DType;

/// The plan cache is process-wide and one test counts its hits: the tests run one at a time.
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

fn case(name: &'static str, x: &[usize], w: &[usize], p: ConvParams) -> Case {
    Case {
        name,
        x: x.to_vec(),
        w: w.to_vec(),
        p,
    }
}

fn cases() -> Vec<Case> {
    let d = ConvParams::default;
    let direct = common::conv_cases::direct()
        .into_iter()
        .chain(common::conv_cases::depthwise())
        .chain(common::conv_cases::grouped())
        .chain(common::conv_cases::stem())
        .map(|c| Case {
            name: c.name,
            x: c.x,
            w: c.w,
            p: c.p,
        });
    let mut all = vec![
        // Column walks in f32 and at stride 2 take only launches that fill the GPU: the first
        // and third cases do on 132 SMs (1,120 warps; the 16-bit stride-2 forward, 576); the
        // second (4 blocks) checks that the plan then keeps the kernel it had.
        case(
            "depthwise 3x3 on 7x7 images, 480 channels, batch 140",
            &[140, 7, 7, 480],
            &[480, 3, 3, 1],
            d().groups(480).padding(&[1]),
        ),
        case(
            "depthwise 3x3 stride 2 on 13x14 images, padding 1/0, 64 channels",
            &[4, 13, 14, 64],
            &[64, 3, 3, 1],
            d().groups(64)
                .strides(&[2])
                .padding_lo(&[1])
                .padding_hi(&[0]),
        ),
        case(
            "depthwise 3x3 stride 2 on 14x14 images, padding 1/0, 384 channels, batch 96",
            &[96, 14, 14, 384],
            &[384, 3, 3, 1],
            d().groups(384)
                .strides(&[2])
                .padding_lo(&[1])
                .padding_hi(&[0]),
        ),
        // 16-bit 7x7 kernels run on the streamed rows on images of up to 10 rows.
        case(
            "depthwise 7x7 on 9x10 images, 48 channels",
            &[3, 9, 10, 48],
            &[48, 7, 7, 1],
            d().groups(48).padding(&[3]),
        ),
        case("1d pad 1", &[2, 17, 8], &[16, 3, 8], d().padding(&[1])),
        case(
            "1d stride 3 > kernel 2, pad 0/2",
            &[3, 20, 8],
            &[8, 2, 8],
            d().strides(&[3]).padding_lo(&[0]).padding_hi(&[2]),
        ),
        case(
            "2d 3x3 pad 1",
            &[2, 9, 9, 16],
            &[32, 3, 3, 16],
            d().padding(&[1]),
        ),
        case(
            "2d stride 2, pad 1/0 and 0/2",
            &[2, 11, 10, 16],
            &[24, 4, 3, 16],
            d().strides(&[2]).padding_lo(&[1, 0]).padding_hi(&[0, 2]),
        ),
        case(
            "2d stride (3, 4) > kernel 2",
            &[1, 13, 14, 8],
            &[8, 2, 2, 8],
            d().strides(&[3, 4]),
        ),
        case(
            "2d kernel dilation (2, 3)",
            &[2, 12, 13, 8],
            &[16, 3, 3, 8],
            d().kernel_dilation(&[2, 3]).padding(&[2]),
        ),
        case(
            "2d input dilation 2, pad 1",
            &[2, 6, 7, 16],
            &[8, 3, 3, 16],
            d().input_dilation(&[2]).padding(&[1]),
        ),
        case(
            "2d input dilation (3, 2), stride 2, kernel dilation 2",
            &[1, 5, 6, 8],
            &[16, 2, 3, 8],
            d().input_dilation(&[3, 2])
                .strides(&[2])
                .kernel_dilation(&[2, 1])
                .padding_lo(&[2, 0])
                .padding_hi(&[0, 1]),
        ),
        case(
            "2d groups 2",
            &[2, 8, 8, 32],
            &[16, 3, 3, 16],
            d().groups(2).padding(&[1]),
        ),
        case(
            "2d flip, stride 2, pad 2/1",
            &[2, 9, 8, 16],
            &[8, 3, 2, 16],
            d().flip(true)
                .strides(&[2])
                .padding_lo(&[2])
                .padding_hi(&[1]),
        ),
        case("2d 1x1", &[2, 7, 7, 24], &[40, 1, 1, 24], d()),
        case(
            "2d 1x1 stride 2",
            &[2, 8, 8, 32],
            &[16, 1, 1, 32],
            d().strides(&[2]),
        ),
        case(
            "2d C_in 3, 7x7 stride 2 pad 3",
            &[2, 20, 20, 3],
            &[16, 7, 7, 3],
            d().strides(&[2]).padding(&[3]),
        ),
        // 720 tiles of 2 x 16 pixels: more than an H100's persistent stem grid holds at once
        // (132 SMs x the blocks the driver says fit), so blocks walk several tiles; few pixels
        // a tile keep backward-weight's sums inside f16's range.
        case(
            "stem 3x3 over 720 tiles",
            &[720, 2, 16, 3],
            &[32, 3, 3, 3],
            d().padding(&[1]),
        ),
        case(
            "2d channels 5 -> 7, groups 1",
            &[2, 6, 7, 5],
            &[7, 3, 3, 5],
            d().padding(&[1]),
        ),
        case(
            "2d channels 12 -> 6 groups 3",
            &[1, 7, 6, 12],
            &[6, 2, 3, 4],
            d().groups(3),
        ),
        case("batch 1, output 1x1", &[1, 5, 5, 8], &[6, 5, 5, 8], d()),
        // Large enough that backward-weight runs on the depthwise rows kernel too (one channel
        // a thread, the last chunk partial).
        case(
            "depthwise 7x7, 40 channels, 56x56 batch 32",
            &[32, 56, 56, 40],
            &[40, 7, 7, 1],
            d().groups(40).padding(&[3]),
        ),
        case(
            "output 1 after stride",
            &[3, 4, 4, 16],
            &[8, 3, 3, 16],
            d().strides(&[5]),
        ),
        case(
            "3d stride (1, 2, 1), pad (1, 0, 1)",
            &[2, 5, 6, 7, 8],
            &[8, 3, 2, 3, 8],
            d().strides(&[1, 2, 1]).padding(&[1, 0, 1]),
        ),
        // Channels per group a multiple of 32: every k tile is one kernel tap (TAP_TILES) for
        // 16-bit types too, in forward and backward-data.
        case(
            "2d tap tiles, groups 2, stride 2, pad 1/2",
            &[2, 9, 11, 64],
            &[64, 3, 3, 32],
            d().groups(2)
                .strides(&[2])
                .padding_lo(&[1])
                .padding_hi(&[2]),
        ),
        case(
            "2d tap tiles, flip, kernel dilation 2, 64 -> 96",
            &[2, 10, 9, 64],
            &[96, 3, 2, 64],
            d().flip(true).kernel_dilation(&[2]).padding(&[2]),
        ),
        case(
            "3d tap tiles, stride (2, 1, 3)",
            &[1, 5, 6, 7, 32],
            &[32, 3, 2, 2, 32],
            d().strides(&[2, 1, 3]).padding(&[1]),
        ),
        case(
            "2d tap tiles, input dilation 2",
            &[1, 5, 6, 32],
            &[32, 3, 3, 32],
            d().input_dilation(&[2]).padding(&[1]),
        ),
        // The Hopper path (sm_90): channel counts off its 64-channel boxes, pixel counts off its
        // 128-row tiles, every tile width, 1-D and 3-D maps, strides, dilation and flip.
        case(
            "wgmma 2d 3x3 72 -> 80",
            &[3, 13, 11, 72],
            &[80, 3, 3, 72],
            d().padding(&[1]),
        ),
        case(
            "wgmma 2d stride 2, dilation 2, flip, pad 2/1, 64 -> 136",
            &[2, 15, 12, 64],
            &[136, 3, 3, 64],
            d().strides(&[2])
                .kernel_dilation(&[2])
                .flip(true)
                .padding_lo(&[2])
                .padding_hi(&[1]),
        ),
        case(
            "wgmma 1d kernel 5, 16 -> 24",
            &[3, 50, 16],
            &[24, 5, 16],
            d().padding(&[2]),
        ),
        case(
            "wgmma 3d 3x3x3, 32 -> 40",
            &[2, 5, 6, 7, 32],
            &[40, 3, 3, 3, 32],
            d().padding(&[1]),
        ),
        case(
            "wgmma 2d 192 -> 264, wide tiles",
            &[2, 12, 12, 192],
            &[264, 3, 3, 192],
            d().padding(&[1]),
        ),
        case(
            "wgmma 2d 1x1 stride 2, 128 -> 64",
            &[4, 15, 15, 128],
            &[64, 1, 1, 128],
            d().strides(&[2]),
        ),
        // Several tiles in every direction, and a reduction long enough to split.
        case(
            "2d 3x3 64 -> 144 channels",
            &[4, 14, 14, 64],
            &[144, 3, 3, 64],
            d().padding(&[1]),
        ),
        case(
            "2d long reduction (backward-weight splits)",
            &[8, 30, 30, 16],
            &[24, 3, 3, 16],
            d().padding(&[1]),
        ),
    ];
    all.extend(direct);
    all
}

/// A kernel chosen by the test instead of the plan: a tile and a split of each family.
#[derive(Clone, Copy)]
enum Explicit {
    Igemm(plan::Tile, usize),
    Wgmma(hopper::Tile, usize),
    StandIn,
}

/// Runs one pass on the GPU and returns (got, reference, geometry, the spec the plan picks;
/// None for an explicit tile).
fn run_pass(
    enc: &mut CommandEncoder,
    dtype: DType,
    c: &Case,
    pass: Pass,
    explicit: Option<Explicit>,
    seed: u64,
) -> (Vec<f64>, reference::Reference, Geometry, Option<KernelSpec>) {
    let g = Geometry::new(&c.x, &c.w, &c.p).unwrap();
    let mut rng = TestRng::new(seed);
    let x = random(&mut rng, dtype, c.x.iter().product());
    let w = random(&mut rng, dtype, c.w.iter().product());
    let dy = random(&mut rng, dtype, g.output_shape().iter().product());
    let up = |enc: &mut CommandEncoder, v: &[f64], s: &[usize]| {
        Array::from_f64(enc, dtype, v, s).unwrap()
    };
    let (want, first, second) = match pass {
        Pass::Forward => (
            reference::forward(&g, &x, &w),
            up(enc, &x, &c.x),
            up(enc, &w, &c.w),
        ),
        Pass::BackwardData => (
            reference::backward_data(&g, &dy, &w),
            up(enc, &dy, &g.output_shape()),
            up(enc, &w, &c.w),
        ),
        Pass::BackwardWeight => (
            reference::backward_weight(&g, &x, &dy),
            up(enc, &x, &c.x),
            up(enc, &dy, &g.output_shape()),
        ),
    };
    let spec = if explicit.is_none() {
        let (xa, wa, dya) = (
            up(enc, &x, &c.x),
            up(enc, &w, &c.w),
            up(enc, &dy, &g.output_shape()),
        );
        Some(
            conv::plan_for(enc, pass, &c.p, &xa, &wa, &dya)
                .unwrap()
                .spec,
        )
    } else {
        None
    };
    let out = match explicit {
        Some(Explicit::Igemm(t, splits)) => {
            tuning::run_with(enc, pass, &g, &first, &second, t, splits).unwrap()
        }
        Some(Explicit::Wgmma(t, splits)) => {
            tuning::run_hopper_with(enc, pass, &g, &first, &second, t, splits).unwrap()
        }
        Some(Explicit::StandIn) => tuning::run_stand_in(enc, pass, &g, &first, &second).unwrap(),
        None => match pass {
            Pass::Forward => conv::conv_forward(enc, &first, &second, &c.p).unwrap(),
            Pass::BackwardData => {
                conv::conv_backward_data(enc, &first, &second, &c.x, &c.p).unwrap()
            }
            Pass::BackwardWeight => {
                conv::conv_backward_weight(enc, &first, &second, &c.w, &c.p).unwrap()
            }
        },
    };
    (out.to_f64(enc).unwrap(), want, g, spec)
}

/// The plan key a call on `dev` gets for operands of `g` whose channels and bases allow 16-byte
/// loads.
fn aligned_key(dev: &Device, dtype: DType, pass: Pass, g: Geometry) -> plan::PlanKey {
    plan::PlanKey {
        device: dev.ordinal(),
        arch: dev.arch(),
        dtype,
        pass,
        geometry: g,
        vec_a: true,
        vec_b: true,
        aligned: true,
        tf32: false,
    }
}

fn matrix(graphs: bool) {
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, graphs);
    let mut failures = Vec::new();
    let (mut checked, mut on_hopper, mut on_direct, mut on_stem) = (0, 0, 0, 0);
    let (mut on_depthwise, mut on_depthwise_tc, mut on_grouped) = (0, 0, 0);
    let (mut on_depthwise_rows, mut on_depthwise_columns, mut widened) = (0, 0, 0);
    let mut on_depthwise_wide = 0;
    let path = Config::from_env().unwrap().conv_path;
    for (ci, c) in cases().iter().enumerate() {
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                let (got, want, g, spec) =
                    run_pass(&mut enc, dtype, c, pass, None, ci as u64 * 7 + 1);
                let family = spec.expect("the plan's spec").template.name;
                let (ratio, at) = worst(dtype, &got, &want);
                checked += 1;
                // A GEMM whose channels do not fill whole vectors runs widened: over channels
                // padded to them, which another family may then take.
                let (vec_a, vec_b) = plan::channel_vectors(dtype, pass, &g);
                let mut key = aligned_key(&dev, dtype, pass, g);
                let mut widen = false;
                let (depthwise, grouped, direct, stem) = loop {
                    let depthwise = depthwise::unsupported(path, &key).is_none();
                    let grouped = !depthwise && grouped::unsupported(path, &key).is_none();
                    let direct =
                        !depthwise && !grouped && direct::unsupported(path, &key).is_none();
                    let stem = !depthwise
                        && !grouped
                        && !direct
                        && stem::unsupported(path, &key).is_none();
                    let gemm = !depthwise && !grouped && !direct && !stem;
                    if gemm && !widen && !(vec_a && vec_b) {
                        widen = true;
                        key = widen::key(&key);
                        continue;
                    }
                    break (depthwise, grouped, direct, stem);
                };
                widened += widen as usize;
                let hopper = !depthwise
                    && !grouped
                    && !direct
                    && !stem
                    && hopper::unsupported(&key).is_none()
                    && path == ConvPath::Auto;
                on_hopper += hopper as usize;
                on_depthwise += depthwise as usize;
                on_grouped += grouped as usize;
                on_direct += direct as usize;
                on_stem += stem as usize;
                let shape = depthwise
                    .then(|| {
                        depthwise::launch_for(
                            &key,
                            dev.info().multiprocessors as usize,
                            dev.shared_limit(),
                        )
                    })
                    .flatten()
                    .map(|l| l.shape);
                on_depthwise_wide +=
                    (shape.map(|s| s.out_tile) == Some(depthwise::WIDE_TILE)) as usize;
                let variant = shape.map(|s| s.variant);
                on_depthwise_tc += (variant == Some(depthwise::Variant::Tensor)) as usize;
                on_depthwise_rows += (variant == Some(depthwise::Variant::Rows)) as usize;
                let columns = matches!(variant, Some(depthwise::Variant::Columns { .. }));
                on_depthwise_columns += columns as usize;
                let expected = if variant == Some(depthwise::Variant::Tensor) {
                    "conv_depthwise_tc"
                } else if variant == Some(depthwise::Variant::Rows) {
                    "conv_depthwise_rows"
                } else if columns {
                    "conv_depthwise_cols"
                } else if depthwise {
                    "conv_depthwise"
                } else if grouped {
                    "conv_grouped"
                } else if direct {
                    "conv_direct"
                } else if stem {
                    "conv_stem"
                } else if hopper {
                    "conv_wgmma"
                } else {
                    "conv_igemm"
                };
                if family != expected {
                    failures.push(format!("{} {dtype} {}: ran {family}", c.name, pass.name()));
                }
                if ratio > 1.0 {
                    failures.push(format!(
                        "{} {dtype} {}: error {ratio:.2}x tolerance at {at}: got {} want {}",
                        c.name,
                        pass.name(),
                        got[at],
                        want.values[at]
                    ));
                }
            }
        }
    }
    eprintln!(
        "conv matrix ({}): {checked} checks ({on_hopper} on the Hopper path, {on_depthwise} on \
         the depthwise family ({on_depthwise_tc} on its tensor cores, {on_depthwise_rows} on its \
         streamed rows, {on_depthwise_columns} on its column walks, {on_depthwise_wide} on its \
         stencil's 4 x 7 sub-tiles), {on_grouped} on the grouped family, \
         {on_direct} on the direct family, {on_stem} on the stem family, {widened} widened), {} \
         failed",
        if graphs { "graph" } else { "direct" },
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Where the plan takes the stencil's 4 x 7 sub-tiles on this GPU for a layer that has
    // them on the H100 (the sub-tile choice depends on the SMs and shared memory), some case
    // of the matrix must run them.
    let layer = Geometry::new(
        &[64, 56, 56, 240],
        &[240, 5, 5, 1],
        &ConvParams::default().groups(240).padding(&[2]),
    )
    .unwrap();
    let key = aligned_key(&dev, DType::F16, Pass::BackwardWeight, layer);
    let sms = dev.info().multiprocessors as usize;
    let wide = depthwise::launch_for(&key, sms, dev.shared_limit())
        .is_some_and(|l| l.shape.out_tile == depthwise::WIDE_TILE);
    assert!(
        !wide || on_depthwise_wide > 0,
        "no case ran the stencil's 4 x 7 sub-tiles"
    );
}

/// Device 0 with a JIT of its own that has `KILN_ALLOW_TF32` on.
fn tf32_device() -> Arc<Device> {
    let mut config = Config::from_env().unwrap();
    config.allow_tf32 = true;
    let jit: &'static kiln::jit::Jit = Box::leak(Box::new(kiln::jit::Jit::new(config)));
    Device::with_jit(0, jit).unwrap()
}

/// f32 on the `mma.sync` family: three TF32 products (TENSOR 1) from sm_80 on, within f32's
/// bound (the matrix checks that), and never the Hopper family; with `KILN_ALLOW_TF32` on a
/// device of its own, one TF32 product (TENSOR 2, or the Hopper family's forward on sm_90),
/// within TF32's bound and, on some case, past f32's: the opt-in ran.
#[test]
fn f32_tf32_only_when_allowed() {
    if common::gpus_or_skip("f32_tf32_only_when_allowed").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let exact = Device::get(0).unwrap();
    if exact.arch() < 80 {
        eprintln!(
            "f32_tf32_only_when_allowed: sm_{} has no TF32, skipped",
            exact.arch()
        );
        return;
    }
    let tf32 = tf32_device();
    let (mut past_f32, mut failures, mut checked) = (0, Vec::new(), 0);
    for (ci, c) in cases().iter().enumerate() {
        for pass in Pass::ALL {
            for (dev, products) in [(&exact, 1), (&tf32, 2)] {
                let mut enc = encoder(dev, false);
                let (got, want, _, spec) =
                    run_pass(&mut enc, DType::F32, c, pass, None, ci as u64 * 7 + 1);
                let spec = spec.expect("the plan's spec");
                let wgmma = spec.template.name == hopper::WGMMA.name;
                if !wgmma && spec.template.name != plan::IGEMM.name {
                    continue;
                }
                checked += 1;
                // Only the TF32 opt-in may take the Hopper family.
                let expected = if wgmma {
                    products == 2
                } else {
                    spec.constant("TENSOR") == Some(products)
                };
                if !expected {
                    failures.push(format!("{} {}: {spec}", c.name, pass.name()));
                }
                if products == 2 {
                    let tf32_bound = worst_tf32(&got, &want);
                    if tf32_bound > 1.0 {
                        failures.push(format!(
                            "{} {}: {tf32_bound:.2}x TF32's bound",
                            c.name,
                            pass.name()
                        ));
                    }
                    past_f32 += (worst(DType::F32, &got, &want).0 > 1.0) as usize;
                }
            }
        }
    }
    eprintln!("f32 tf32: {checked} checks, {past_f32} TF32 runs past f32's bound");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        past_f32 > 0,
        "no KILN_ALLOW_TF32 run was less exact than f32: did TF32 run?"
    );
}

#[test]
fn matrix_graph_mode() {
    if common::gpus_or_skip("matrix_graph_mode").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    matrix(true);
}

#[test]
fn matrix_direct_mode() {
    if common::gpus_or_skip("matrix_direct_mode").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    matrix(false);
}

/// Every registered tile and vector width, whichever the plans would pick: a case whose
/// channels allow 16-byte vectors, one whose channels do not, and one whose k tiles each lie
/// within one kernel tap (the TAP_TILES kernels), split and unsplit.
#[test]
fn every_tile_and_vector_width() {
    if common::gpus_or_skip("every_tile_and_vector_width").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, true);
    let d = ConvParams::default;
    let shapes = [
        case(
            "vectors",
            &[2, 10, 9, 32],
            &[40, 3, 3, 32],
            d().padding(&[1]).strides(&[1, 2]),
        ),
        // Channels that do not fill vectors: every tile runs the layer widened.
        case(
            "padded channels",
            &[2, 9, 10, 6],
            &[10, 3, 2, 3],
            d().groups(2).padding_lo(&[1]).flip(true),
        ),
        case(
            "tap tiles",
            &[2, 10, 9, 64],
            &[96, 3, 3, 64],
            d().padding(&[1]).strides(&[2, 1]).flip(true),
        ),
    ];
    let tap = &shapes[2];
    for dtype in DType::ALL {
        for pass in [Pass::Forward, Pass::BackwardData] {
            let g = Geometry::new(&tap.x, &tap.w, &tap.p).unwrap();
            let key = aligned_key(&dev, dtype, pass, g);
            assert!(plan::tap_tiles(&key), "{dtype} {}", pass.name());
        }
    }
    let mut failures = Vec::new();
    let mut checked = 0;
    for c in &shapes {
        for dtype in DType::ALL {
            let tensor = plan::Math::of(dtype, dev.arch(), false).tensor();
            for &t in plan::tiles(tensor) {
                for pass in Pass::ALL {
                    // A tile larger than the GPU's shared memory is never chosen (Turing).
                    let g = Geometry::new(&c.x, &c.w, &c.p).unwrap();
                    let tap = plan::tap_tiles(&aligned_key(&dev, dtype, pass, g));
                    if plan::shared_bytes(dtype, pass, tensor, t, tap) > dev.shared_limit() {
                        continue;
                    }
                    let splits: &[usize] = if pass == Pass::BackwardWeight {
                        &[1, 3]
                    } else {
                        &[1]
                    };
                    for &s in splits {
                        let (got, want, _, _) =
                            run_pass(&mut enc, dtype, c, pass, Some(Explicit::Igemm(t, s)), 5);
                        let (ratio, at) = worst(dtype, &got, &want);
                        checked += 1;
                        if ratio > 1.0 {
                            failures.push(format!(
                                "{} {dtype} {} {t:?} splits {s}: {ratio:.2}x tolerance at {at}",
                                c.name,
                                pass.name()
                            ));
                        }
                    }
                }
            }
        }
    }
    eprintln!("every tile: {checked} checks, {} failed", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every Hopper tile, alone and paired, split and unsplit, on layers off its tile and
/// channel-block sizes in 1, 2 and 3 spatial dims, strided backward-data among them, both 16-bit
/// types, graph and direct mode. Skipped on GPUs other than sm_90.
#[test]
fn every_hopper_tile() {
    let Some(gpus) = common::gpus_or_skip("every_hopper_tile") else {
        return;
    };
    if Device::get(gpus[0].ordinal).unwrap().arch() != hopper::ARCH {
        eprintln!("every_hopper_tile: skipped (needs sm_90 code paths: an H100 without KILN_EMULATE_ARCH)");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let tf32 = tf32_device();
    let d = ConvParams::default;
    let shapes = [
        // 1,600 pixels: an odd number of row tiles of 128 and of 256 (a paired tile's last
        // cluster has a row tile past the rows), several rounds of the persistent grid.
        case(
            "2d 3x3 64 -> 64 on 4x20x20",
            &[4, 20, 20, 64],
            &[64, 3, 3, 64],
            d().padding(&[1]),
        ),
        case(
            "2d 3x3 72 -> 136, stride 2, flip",
            &[3, 13, 11, 72],
            &[136, 3, 3, 72],
            d().padding(&[1]).strides(&[2, 1]).flip(true),
        ),
        case(
            "1d kernel 4, 40 -> 24",
            &[2, 70, 40],
            &[24, 4, 40],
            d().padding(&[2]),
        ),
        case(
            "3d 2x3x2 dilated, 16 -> 264",
            &[2, 4, 7, 6, 16],
            &[264, 2, 3, 2, 16],
            d().padding(&[1]).kernel_dilation(&[1, 2, 1]),
        ),
        // Backward-data by stride phase: phases without taps (stride above the kernel), and
        // phases of unequal sizes and tap counts in 3-D.
        case(
            "1d stride 3 > kernel 2, 24 -> 48",
            &[2, 50, 24],
            &[48, 2, 24],
            d().strides(&[3]).padding(&[1]),
        ),
        case(
            "3d 3x2x3 stride (2, 1, 2), 16 -> 40",
            &[2, 5, 6, 7, 16],
            &[40, 3, 2, 3, 16],
            d().padding(&[1]).strides(&[2, 1, 2]),
        ),
    ];
    prewarm_hopper_tiles(&dev, &tf32, &shapes);
    let mut failures = Vec::new();
    let mut checked = 0;
    for (graph, c) in [true, false]
        .into_iter()
        .flat_map(|g| shapes.iter().map(move |c| (g, c)))
    {
        let mut enc = encoder(&dev, graph);
        for dtype in [DType::F16, DType::BF16] {
            for pass in Pass::ALL {
                for t in hopper::tiles(dtype, pass) {
                    let splits: &[usize] = if pass == Pass::BackwardWeight {
                        &[1, 3]
                    } else {
                        &[1]
                    };
                    for &s in splits {
                        let (got, want, _, _) =
                            run_pass(&mut enc, dtype, c, pass, Some(Explicit::Wgmma(t, s)), 9);
                        let (ratio, at) = worst(dtype, &got, &want);
                        checked += 1;
                        if ratio > 1.0 {
                            failures.push(format!(
                                "{} {dtype} {} {t:?} splits {s} ({}): {ratio:.2}x tolerance at \
                                 {at}",
                                c.name,
                                pass.name(),
                                if graph { "graph" } else { "direct" }
                            ));
                        }
                    }
                }
            }
        }
        // f32 as TF32 products (KILN_ALLOW_TF32), every pass (backward-weight on its swapped
        // tiles, also split, where the pixels are a multiple of 4: the cotangent turned round
        // is a map of 16-byte rows): TF32's bound.
        let mut enc = encoder(&tf32, graph);
        let g = Geometry::new(&c.x, &c.w, &c.p).unwrap();
        for pass in Pass::ALL {
            if pass == Pass::BackwardWeight && g.batch * g.output_pixels() % 4 != 0 {
                continue;
            }
            for t in hopper::tiles(DType::F32, pass) {
                let splits: &[usize] = if pass == Pass::BackwardWeight {
                    &[1, 3]
                } else {
                    &[1]
                };
                for &s in splits {
                    let explicit = Some(Explicit::Wgmma(t, s));
                    let (got, want, _, _) = run_pass(&mut enc, DType::F32, c, pass, explicit, 9);
                    let ratio = worst_tf32(&got, &want);
                    checked += 1;
                    if ratio > 1.0 {
                        failures.push(format!(
                            "{} f32 (TF32) {} {t:?} splits {s} ({}): {ratio:.2}x TF32's bound",
                            c.name,
                            pass.name(),
                            if graph { "graph" } else { "direct" }
                        ));
                    }
                }
            }
        }
    }
    eprintln!(
        "every Hopper tile: {checked} checks, {} failed",
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Compiles the modules `every_hopper_tile` launches on every core before it runs them: most
/// are not in `kiln warm`'s set (paired and TF32 tiles), and one compile at a time they take
/// minutes on an empty cache. f32 goes through `tf32`'s JIT, which launches it.
fn prewarm_hopper_tiles(dev: &Device, tf32: &Device, shapes: &[Case]) {
    for (device, dtypes) in [(dev, &[DType::F16, DType::BF16][..]), (tf32, &[DType::F32])] {
        let mut work = Vec::new();
        for c in shapes {
            let g = Geometry::new(&c.x, &c.w, &c.p).unwrap();
            for &dtype in dtypes {
                for pass in Pass::ALL {
                    for t in hopper::tiles(dtype, pass) {
                        let key = aligned_key(device, dtype, pass, g);
                        let item = (hopper::launch_for(&key, t, 1, 1).0, device.target());
                        if !work.contains(&item) {
                            work.push(item);
                        }
                    }
                }
            }
        }
        let report = device.jit().warm(&work, 0, &|_| {});
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        eprintln!(
            "every Hopper tile: {} modules ready in {:.1} s ({} compiled)",
            report.specs, report.seconds, report.compiled
        );
    }
}

/// Operands that start off a 16-byte boundary (contiguous views at an odd element offset), with
/// channels that fill whole vectors: every pass runs widened (on copies that load in vectors)
/// and matches the reference, every dtype, graph and direct mode.
#[test]
fn misaligned_operands_run_widened() {
    if common::gpus_or_skip("misaligned_operands_run_widened").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let p = ConvParams::default().padding(&[1]).strides(&[2, 1]);
    let (xs, ws) = ([2, 9, 7, 16], [24, 3, 3, 16]);
    let g = Geometry::new(&xs, &ws, &p).unwrap();
    let mut failures = Vec::new();
    for graphs in [false, true] {
        let mut enc = encoder(&dev, graphs);
        for dtype in DType::ALL {
            let mut rng = TestRng::new(23);
            let x = random(&mut rng, dtype, xs.iter().product());
            let w = random(&mut rng, dtype, ws.iter().product());
            let dy = random(&mut rng, dtype, g.output_shape().iter().product());
            // One element in front: the view starts 2 or 4 bytes into its allocation.
            let mut odd = |v: &[f64], shape: &[usize]| {
                let mut padded = vec![0.5];
                padded.extend_from_slice(v);
                let flat = Array::from_f64(&mut enc, dtype, &padded, &[padded.len()]).unwrap();
                flat.slice(0, 1, padded.len(), 1)
                    .unwrap()
                    .reshape(shape)
                    .unwrap()
            };
            let (xa, wa, dya) = (odd(&x, &xs), odd(&w, &ws), odd(&dy, &g.output_shape()));
            for pass in Pass::ALL {
                let before = widen::taken();
                let got = conv::conv_pass(&mut enc, pass, &p, &xa, &wa, &dya).unwrap();
                let want = match pass {
                    Pass::Forward => reference::forward(&g, &x, &w),
                    Pass::BackwardData => reference::backward_data(&g, &dy, &w),
                    Pass::BackwardWeight => reference::backward_weight(&g, &x, &dy),
                };
                let (ratio, at) = worst(dtype, &got.to_f64(&mut enc).unwrap(), &want);
                let name = format!("{dtype} {} graphs={graphs}", pass.name());
                if widen::taken() == before {
                    failures.push(format!("{name}: did not run widened"));
                }
                if ratio > 1.0 {
                    failures.push(format!("{name}: {ratio:.2}x tolerance at {at}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Non-contiguous operands are copied once and give the same result.
#[test]
fn strided_input_is_copied() {
    if common::gpus_or_skip("strided_input_is_copied").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, false);
    let p = ConvParams::default().padding(&[1]);
    let g = Geometry::new(&[2, 6, 5, 8], &[8, 3, 3, 8], &p).unwrap();
    let mut rng = TestRng::new(11);
    let x = random(&mut rng, DType::F32, 2 * 6 * 5 * 8);
    let w = random(&mut rng, DType::F32, 8 * 9 * 8);
    // x stored as (2, 5, 6, 8) and viewed with its spatial axes swapped.
    let mut xt = vec![0.0; x.len()];
    for b in 0..2 {
        for i in 0..6 {
            for j in 0..5 {
                for c in 0..8 {
                    xt[((b * 5 + j) * 6 + i) * 8 + c] = x[((b * 6 + i) * 5 + j) * 8 + c];
                }
            }
        }
    }
    let xv = Array::from_f64(&mut enc, DType::F32, &xt, &[2, 5, 6, 8])
        .unwrap()
        .swapaxes(1, 2)
        .unwrap();
    let wa = Array::from_f64(&mut enc, DType::F32, &w, &[8, 3, 3, 8]).unwrap();
    let y = conv::conv_forward(&mut enc, &xv, &wa, &p).unwrap();
    let want = reference::forward(&g, &x, &w);
    let (ratio, _) = worst(DType::F32, &y.to_f64(&mut enc).unwrap(), &want);
    assert!(ratio <= 1.0, "{ratio}");
}

#[test]
fn bad_arguments_are_errors() {
    if common::gpus_or_skip("bad_arguments_are_errors").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, false);
    let arr = |enc: &mut CommandEncoder, dtype, shape: &[usize]| {
        Array::from_f64(enc, dtype, &vec![0.0; shape.iter().product()], shape).unwrap()
    };
    let x = arr(&mut enc, DType::F32, &[1, 5, 5, 4]);
    let w = arr(&mut enc, DType::F32, &[8, 3, 3, 4]);
    let wh = arr(&mut enc, DType::F16, &[8, 3, 3, 4]);
    let d = ConvParams::default();
    let arg = |r: kiln::Result<Array>| match r {
        Err(e) if e.argument().is_some() => e.argument().unwrap_or_default(),
        other => panic!(
            "expected an argument error, got {:?}",
            other.map(|a| a.shape().to_vec())
        ),
    };
    assert_eq!(arg(conv::conv_forward(&mut enc, &x, &wh, &d)), "weight");
    assert_eq!(
        arg(conv::conv_forward(
            &mut enc,
            &x,
            &w,
            &d.clone().strides(&[0])
        )),
        "strides"
    );
    assert_eq!(
        arg(conv::conv_forward(&mut enc, &x, &w, &d.clone().groups(3))),
        "groups"
    );
    assert_eq!(
        arg(conv::conv_general(
            &mut enc,
            &x,
            &w,
            &[1],
            &[0],
            &[0],
            &[1],
            &[0],
            1,
            false
        )),
        "input_dilation"
    );
    let small = arr(&mut enc, DType::F32, &[1, 2, 2, 4]);
    assert_eq!(arg(conv::conv_forward(&mut enc, &small, &w, &d)), "input");
    let dy_wrong = arr(&mut enc, DType::F32, &[1, 4, 3, 8]);
    assert_eq!(
        arg(conv::conv_backward_data(
            &mut enc,
            &dy_wrong,
            &w,
            &[1, 5, 5, 4],
            &d
        )),
        "cotangent"
    );
    assert_eq!(
        arg(conv::conv_backward_weight(
            &mut enc,
            &x,
            &dy_wrong,
            &[8, 3, 3, 4],
            &d
        )),
        "cotangent"
    );
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
    let d = ConvParams::default().padding(&[1]);
    for dtype in DType::ALL {
        let x = Array::from_f64(&mut enc, dtype, &[], &[0, 5, 5, 8]).unwrap();
        let w = Array::from_f64(&mut enc, dtype, &vec![1.0; 8 * 9 * 8], &[8, 3, 3, 8]).unwrap();
        let y = conv::conv_forward(&mut enc, &x, &w, &d).unwrap();
        assert_eq!(y.shape(), &[0, 5, 5, 8]);
        let dx = conv::conv_backward_data(&mut enc, &y, &w, &[0, 5, 5, 8], &d).unwrap();
        assert_eq!(dx.shape(), &[0, 5, 5, 8]);
        let dw = conv::conv_backward_weight(&mut enc, &x, &y, &[8, 3, 3, 8], &d).unwrap();
        assert_eq!(dw.shape(), &[8, 3, 3, 8]);
        assert!(dw.to_f64(&mut enc).unwrap().iter().all(|&v| v == 0.0));
    }
}

/// A repeated convolution reuses its plan; a different one (here: input dilation only, which
/// MLX's key leaves out) gets its own.
#[test]
fn plans_are_cached() {
    if common::gpus_or_skip("plans_are_cached").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, false);
    let x = Array::from_f64(
        &mut enc,
        DType::F16,
        &vec![0.5; 2 * 7 * 7 * 8],
        &[2, 7, 7, 8],
    )
    .unwrap();
    let w = Array::from_f64(&mut enc, DType::F16, &vec![0.25; 8 * 9 * 8], &[8, 3, 3, 8]).unwrap();
    let p = ConvParams::default().padding(&[1]);
    let (h0, m0, _) = plan::cache_stats();
    conv::conv_forward(&mut enc, &x, &w, &p).unwrap();
    conv::conv_forward(&mut enc, &x, &w, &p).unwrap();
    conv::conv_forward(&mut enc, &x, &w, &p.clone().input_dilation(&[2])).unwrap();
    enc.synchronize().unwrap();
    let (h1, m1, _) = plan::cache_stats();
    assert_eq!((h1 - h0, m1 - m0), (1, 2));
}

/// `KILN_CONV_AUTOTUNE`'s measurement: each pass gets one of the Hopper tiles, noted in the disk
/// cache so that a second call reads it instead of measuring, and that tile's result matches the
/// reference. Skipped on GPUs other than sm_90.
#[test]
fn autotune_measures_once_and_keeps_its_choice() {
    let Some(gpus) = common::gpus_or_skip("autotune_measures_once_and_keeps_its_choice") else {
        return;
    };
    if Device::get(gpus[0].ordinal).unwrap().arch() != hopper::ARCH {
        eprintln!("autotune_measures_once_and_keeps_its_choice: skipped (needs sm_90 code paths: an H100 without KILN_EMULATE_ARCH)");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, true);
    let writable = kiln::jit::Jit::global().unwrap().disk_cache().is_writable();
    let c = case(
        "2d 3x3 stride 2, 72 -> 136",
        &[3, 19, 17, 72],
        &[136, 3, 3, 72],
        ConvParams::default().padding(&[1]).strides(&[2]),
    );
    let g = Geometry::new(&c.x, &c.w, &c.p).unwrap();
    let dtype = DType::BF16;
    let mut rng = TestRng::new(17);
    let mut up = |enc: &mut CommandEncoder, s: &[usize]| {
        let v = random(&mut rng, dtype, s.iter().product());
        Array::from_f64(enc, dtype, &v, s).unwrap()
    };
    let (x, w, dy) = (
        up(&mut enc, &c.x),
        up(&mut enc, &c.w),
        up(&mut enc, &g.output_shape()),
    );
    for pass in Pass::ALL {
        let (first, second) = match pass {
            Pass::Forward => (&x, &w),
            Pass::BackwardData => (&dy, &w),
            Pass::BackwardWeight => (&x, &dy),
        };
        let once = tuning::autotune_hopper(&mut enc, pass, &g, first, second).unwrap();
        let again = tuning::autotune_hopper(&mut enc, pass, &g, first, second).unwrap();
        assert!(
            hopper::tiles(DType::BF16, pass).contains(&once.tile),
            "{once:?}"
        );
        assert_eq!((once.tile, once.splits), (again.tile, again.splits));
        if writable {
            assert!(!again.measured, "{}: measured twice", pass.name());
        }
        let got =
            tuning::run_hopper_with(&mut enc, pass, &g, first, second, once.tile, once.splits)
                .unwrap()
                .to_f64(&mut enc)
                .unwrap();
        let (xs, ws, dys) = (
            x.to_f64(&mut enc).unwrap(),
            w.to_f64(&mut enc).unwrap(),
            dy.to_f64(&mut enc).unwrap(),
        );
        let want = match pass {
            Pass::Forward => reference::forward(&g, &xs, &ws),
            Pass::BackwardData => reference::backward_data(&g, &dys, &ws),
            Pass::BackwardWeight => reference::backward_weight(&g, &xs, &dys),
        };
        let (ratio, at) = worst(dtype, &got, &want);
        assert!(
            ratio <= 1.0,
            "{} {once:?}: {ratio:.2}x tolerance at {at}",
            pass.name()
        );
    }
}

/// An invalid `KILN_CONV_PATH` is an error naming the variable when a plan must be made (it used
/// to fall back to `auto` silently). Every test of this file holds SERIAL, so the variable is
/// seen by this one only.
#[test]
fn an_invalid_conv_path_is_an_error() {
    let Some(_) = common::gpus_or_skip("an_invalid_conv_path_is_an_error") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut enc = encoder(&dev, false);
    // A geometry no other test plans, so that the plan cache cannot answer.
    let x = Array::from_f64(
        &mut enc,
        DType::F16,
        &vec![0.5; 11 * 13 * 24],
        &[1, 11, 13, 24],
    );
    let w = Array::from_f64(
        &mut enc,
        DType::F16,
        &vec![0.25; 16 * 2 * 2 * 24],
        &[16, 2, 2, 24],
    );
    let (x, w) = (x.unwrap(), w.unwrap());
    std::env::set_var("KILN_CONV_PATH", "fastest");
    let result = conv::conv_forward(&mut enc, &x, &w, &ConvParams::default());
    std::env::remove_var("KILN_CONV_PATH");
    match result {
        Err(e) => assert!(e.to_string().contains("KILN_CONV_PATH"), "{e}"),
        Ok(_) => panic!("an invalid KILN_CONV_PATH was accepted"),
    }
    // With the variable gone the same call plans and runs.
    conv::conv_forward(&mut enc, &x, &w, &ConvParams::default()).unwrap();
}

/// The cold-start stand-ins (`KILN_STAND_INS`) on every case of the matrix, every dtype and
/// pass, graph mode and direct mode alternating by case: one generic kernel per dtype and pass
/// takes every geometry the families take.
#[test]
fn stand_ins_match_the_reference() {
    if common::gpus_or_skip("stand_ins_match_the_reference").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::get(0).unwrap();
    let mut encoders = [encoder(&dev, true), encoder(&dev, false)];
    let mut failures = Vec::new();
    let mut checked = 0;
    for (ci, c) in cases().iter().enumerate() {
        let enc = &mut encoders[ci % 2];
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                let seed = ci as u64 * 5 + 3;
                let (got, want, _, _) =
                    run_pass(enc, dtype, c, pass, Some(Explicit::StandIn), seed);
                let (ratio, at) = worst(dtype, &got, &want);
                checked += 1;
                if ratio > 1.0 {
                    failures.push(format!(
                        "{} {dtype} {}: error {ratio:.2}x tolerance at {at}: got {} want {}",
                        c.name,
                        pass.name(),
                        got[at],
                        want.values[at]
                    ));
                }
            }
        }
    }
    eprintln!("stand-ins: {checked} checks, {} failed", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A cold start end to end, on a device of its own over an empty cache with stand-ins on: the
/// first call's plan is the stand-in and its result is right; once the background compiles are
/// done, the same call gets the chosen kernel's plan, cached.
#[test]
fn a_cold_start_runs_the_stand_in_until_the_chosen_kernel_is_compiled() {
    if common::gpus_or_skip("a_cold_start_runs_the_stand_in").is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::from_env().unwrap();
    config.cache_dir = Some(dir.path().to_path_buf());
    config.stand_ins = true;
    config.compile_threads = 2;
    let jit: &'static kiln::jit::Jit = Box::leak(Box::new(kiln::jit::Jit::new(config)));
    let dev = Device::with_jit(0, jit).unwrap();
    let mut enc = encoder(&dev, false);
    let c = case(
        "2d 3x3 pad 1, 64 -> 64",
        &[2, 9, 7, 64],
        &[64, 3, 3, 64],
        ConvParams::default().padding(&[1]),
    );
    let mut rng = TestRng::new(5);
    let g = Geometry::new(&c.x, &c.w, &c.p).unwrap();
    let x = random(&mut rng, DType::BF16, c.x.iter().product());
    let w = random(&mut rng, DType::BF16, c.w.iter().product());
    let want = reference::forward(&g, &x, &w);
    let xa = Array::from_f64(&mut enc, DType::BF16, &x, &c.x).unwrap();
    let wa = Array::from_f64(&mut enc, DType::BF16, &w, &c.w).unwrap();
    let dy = Array::zeros(&mut enc, DType::BF16, &g.output_shape()).unwrap();
    let spec = |enc: &CommandEncoder| {
        conv::plan_for(enc, Pass::Forward, &c.p, &xa, &wa, &dy)
            .unwrap()
            .spec
    };
    let stand_in = conv::stand_in::specs(&aligned_key(&dev, DType::BF16, Pass::Forward, g))[0];
    assert_eq!(spec(&enc), stand_in);
    let y = conv::conv_forward(&mut enc, &xa, &wa, &c.p).unwrap();
    let (ratio, at) = worst(DType::BF16, &y.to_f64(&mut enc).unwrap(), &want);
    assert!(ratio <= 1.0, "stand-in: {ratio:.2}x tolerance at {at}");
    let started = std::time::Instant::now();
    while !jit.background_idle() {
        assert!(
            started.elapsed().as_secs() < 300,
            "background compiles never finished"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let chosen = spec(&enc);
    assert_ne!(
        chosen, stand_in,
        "the model chose the stand-in's tile: pick another layer"
    );
    let (h0, _, _) = plan::cache_stats();
    let y = conv::conv_forward(&mut enc, &xa, &wa, &c.p).unwrap();
    assert_eq!(plan::cache_stats().0, h0 + 1, "the chosen plan is cached");
    let (ratio, at) = worst(DType::BF16, &y.to_f64(&mut enc).unwrap(), &want);
    assert!(ratio <= 1.0, "{chosen}: {ratio:.2}x tolerance at {at}");
}
