//! The gather convolution families (`templates/conv_direct.cu`, `conv_depthwise.cu`,
//! `conv_stem.cu`; their portable paths: no tensor cores, copies made at once) compiled for the
//! host as plain C++ (`tests/host/cuda_host.h`: a block's threads are OS threads) and run on the launches the
//! plans make, against the f64 reference with the GPU tests' tolerance: its index arithmetic,
//! bounds (AddressSanitizer, shared memory past the launch's size poisoned), barriers and
//! reductions, every pass and dtype, without a GPU. Memory ordering and speed are the GPU
//! tests' and benches' part. Skipped when no C++20 compiler is found (`CXX`, else `g++`, else
//! `c++`); `KILN_REQUIRE_HOST_CXX=1` fails instead.

mod common;

use common::host::{self, compiler, push_bytes};

use common::conv_cases::{random, worst, worst_tf32};

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln::ops::conv::{
    depthwise, direct, grouped,
    plan::{self, PlanKey},
    reference, stem, ConvParams, Geometry, Pass,
};
use kiln::selfcheck::TestRng;
use kiln::DType;

/// Multiprocessors and shared memory of the device the launches are planned for: few
/// multiprocessors keep the grids small, and still split backward-weight's longer sums.
const SMS: usize = 4;
const SHARED: usize = 64 * 1024;

/// The host executable for `spec` (`run_direct.cpp` around its rendered source) with `defines`
/// (the entry point and problem struct of a family other than the direct one).
fn executable(cxx: &str, spec: &kiln::jit::KernelSpec, defines: &[&str]) -> PathBuf {
    let source = kiln::jit::template::render(spec).unwrap().source;
    host::executable(cxx, &source, "run_direct.cpp", defines, spec)
}

/// One launch of a host-built kernel: its grid, block, dynamic shared memory and problem bytes,
/// the splits of backward-weight's sum (f32 partials) and the output's element count.
struct HostLaunch<'a> {
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared: usize,
    problem: &'a [u8],
    splits: usize,
    out_len: usize,
}

/// The bytes of a repr(C) problem struct of i32 fields.
fn problem_bytes<P: Copy>(p: &P) -> &[u8] {
    // SAFETY: the problem structs are repr(C), Copy and all i32: their bytes are their value as
    // the kernels' structs lay it out.
    unsafe { std::slice::from_raw_parts((p as *const P).cast::<u8>(), std::mem::size_of::<P>()) }
}

/// Runs `launch` of the executable built for `spec` on operands `ops`; the result as f64 (the
/// partials summed in f32 when there are several, in order: the split sum's fixed order differs
/// only in rounding).
fn run_launch(
    exe: &Path,
    spec: &kiln::jit::KernelSpec,
    dtype: DType,
    launch: &HostLaunch,
    ops: [&[f64]; 2],
) -> Vec<f64> {
    let out_len = launch.out_len;
    let partials = if launch.splits > 1 {
        launch.splits * out_len
    } else {
        0
    };
    let mut input = Vec::new();
    for v in [launch.grid.0, launch.grid.1, launch.grid.2] {
        input.extend_from_slice(&v.to_le_bytes());
    }
    for v in [launch.block.0, launch.block.1, launch.block.2] {
        input.extend_from_slice(&v.to_le_bytes());
    }
    input.extend_from_slice(&(launch.shared as u64).to_le_bytes());
    input.extend_from_slice(launch.problem);
    for op in ops {
        push_bytes(&mut input, &kiln::dtype::encode(dtype, op));
    }
    input.extend_from_slice(&((out_len * dtype.size()) as u64).to_le_bytes());
    input.extend_from_slice(&(partials as u64).to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let (inp, outp) = (dir.path().join("in"), dir.path().join("out"));
    std::fs::write(&inp, &input).unwrap();
    let run = Command::new(exe).arg(&inp).arg(&outp).output().unwrap();
    assert!(
        run.status.success(),
        "{spec} grid {:?} block {:?}: the host run failed:\n{}",
        launch.grid,
        launch.block,
        String::from_utf8_lossy(&run.stderr)
    );
    let bytes = std::fs::read(&outp).unwrap();
    let (out, partial) = bytes.split_at(out_len * dtype.size());
    if partials == 0 {
        return kiln::dtype::decode(dtype, out).unwrap();
    }
    let partial: Vec<f32> = partial
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let sums: Vec<f64> = (0..out_len)
        .map(|i| (0..launch.splits).fold(0f32, |s, k| s + partial[k * out_len + i]) as f64)
        .collect();
    kiln::dtype::decode(dtype, &kiln::dtype::encode(dtype, &sums)).unwrap()
}

fn out_len(pass: Pass, g: &Geometry) -> usize {
    match pass {
        Pass::Forward => g.output_shape(),
        Pass::BackwardData => g.input_shape(),
        Pass::BackwardWeight => g.weight_shape(),
    }
    .iter()
    .product()
}

/// A plan key for the host: arch 70, so that every dtype takes the FMA paths.
fn host_key(dtype: DType, pass: Pass, g: &Geometry) -> PlanKey {
    PlanKey {
        device: 0,
        arch: 70,
        dtype,
        pass,
        geometry: *g,
        vec_a: false,
        vec_b: false,
        aligned: true,
        tf32: false,
    }
}

/// Runs `pass` of `g` through the host build of the direct plan's kernel; the result as f64.
fn run_host(cxx: &str, dtype: DType, pass: Pass, g: &Geometry, ops: [&[f64]; 2]) -> Vec<f64> {
    let key = host_key(dtype, pass, g);
    let launch = direct::launch_for(&key, SMS, SHARED).expect("the family takes the case");
    let (cg, mg) = (g.cin / g.groups, g.cout / g.groups);
    let spec = direct::spec(dtype, pass, cg, mg, launch.shape);
    let exe = executable(cxx, &spec, &[]);
    let host = HostLaunch {
        grid: launch.grid,
        block: launch.block,
        shared: launch.shared,
        problem: problem_bytes(&launch.problem),
        splits: launch.splits,
        out_len: out_len(pass, g),
    };
    run_launch(&exe, &spec, dtype, &host, ops)
}

/// Runs `pass` of `g` through the host build of the stem family's kernel (its FMA path).
fn run_host_stem(cxx: &str, dtype: DType, pass: Pass, g: &Geometry, ops: [&[f64]; 2]) -> Vec<f64> {
    let key = host_key(dtype, pass, g);
    let launch = stem::launch_for(&key, SMS).expect("the family takes the case");
    let spec = stem::spec(dtype, pass, launch.shape, launch.tensor);
    let exe = executable(
        cxx,
        &spec,
        &["KILN_ENTRY=kiln_conv_stem", "KILN_PROBLEM=kiln_stem"],
    );
    let host = HostLaunch {
        grid: launch.grid,
        block: (stem::THREADS as u32, 1, 1),
        shared: launch.shared,
        problem: problem_bytes(&launch.problem),
        splits: launch.splits,
        out_len: out_len(pass, g),
    };
    run_launch(&exe, &spec, dtype, &host, ops)
}

/// Runs `launch` of the depthwise family (`pass` of `g`) through the host build of its kernel:
/// the FMA stencil, the streamed rows (copies made at once), or the tensor-core kernel (sm_80)
/// with ldmatrix and mma.sync emulated warp by warp.
fn run_depthwise_launch(
    cxx: &str,
    dtype: DType,
    pass: Pass,
    g: &Geometry,
    ops: [&[f64]; 2],
    launch: depthwise::Launch,
) -> Vec<f64> {
    let spec = depthwise::spec(dtype, pass, launch.shape);
    let entry = format!("KILN_ENTRY={}", spec.template.kernel);
    let mut defines = vec![entry.as_str(), "KILN_PROBLEM=kiln_depthwise"];
    if launch.shape.variant == depthwise::Variant::Tensor {
        defines.push("KILN_ARCH=800");
    }
    let exe = executable(cxx, &spec, &defines);
    let host = HostLaunch {
        grid: launch.grid,
        block: launch.block,
        shared: launch.shared,
        problem: problem_bytes(&launch.problem),
        splits: launch.splits,
        out_len: out_len(pass, g),
    };
    run_launch(&exe, &spec, dtype, &host, ops)
}

/// Runs `pass` of `g` through the host build of the depthwise family's FMA stencil.
fn run_host_depthwise(
    cxx: &str,
    dtype: DType,
    pass: Pass,
    g: &Geometry,
    ops: [&[f64]; 2],
) -> Vec<f64> {
    let key = host_key(dtype, pass, g);
    let launch = depthwise::launch_for(&key, SMS, 227 * 1024).expect("the family takes the case");
    run_depthwise_launch(cxx, dtype, pass, g, ops, launch)
}

/// The depthwise family's tensor-core launch of `pass` of `g` (sm_80), or None where that
/// kernel does not take it.
fn depthwise_tc_launch(dtype: DType, pass: Pass, g: &Geometry) -> Option<depthwise::Launch> {
    let key = PlanKey {
        arch: depthwise::TENSOR_ARCH,
        ..host_key(dtype, pass, g)
    };
    depthwise::launch_for(&key, SMS, 227 * 1024)
        .filter(|l| l.shape.variant == depthwise::Variant::Tensor)
}

/// The depthwise family's streamed-rows launch of `pass` of `g` (sm_80), or None where that
/// kernel cannot run it (whether or not the plan would choose it); backward-weight on any walk,
/// however few outputs its blocks sum (the plan leaves layers whose blocks sum few to the
/// stencil).
fn depthwise_rows_launch(dtype: DType, pass: Pass, g: &Geometry) -> Option<depthwise::Launch> {
    let key = PlanKey {
        arch: depthwise::ROWS_ARCH,
        ..host_key(dtype, pass, g)
    };
    let taken = depthwise::unsupported(kiln::env::ConvPath::Auto, &key).is_none()
        && depthwise::rows_fit(&key);
    taken
        .then(|| depthwise::rows_launch(&key, SMS, 227 * 1024, true))
        .flatten()
}

/// Runs `pass` of `g` through the host build of the depthwise family's streamed rows.
fn run_host_depthwise_rows(
    cxx: &str,
    dtype: DType,
    pass: Pass,
    g: &Geometry,
    ops: [&[f64]; 2],
) -> Vec<f64> {
    let launch = depthwise_rows_launch(dtype, pass, g).expect("the rows kernel takes the case");
    run_depthwise_launch(cxx, dtype, pass, g, ops, launch)
}

/// The depthwise family's column-walks launch of `pass` of `g`, or None where that kernel
/// cannot run it.
fn depthwise_columns_launch(dtype: DType, pass: Pass, g: &Geometry) -> Option<depthwise::Launch> {
    let key = host_key(dtype, pass, g);
    let taken = depthwise::unsupported(kiln::env::ConvPath::Auto, &key).is_none()
        && depthwise::columns_fit(&key);
    taken
        .then(|| depthwise::columns_launch(&key, SMS, 227 * 1024))
        .flatten()
}

/// Runs `pass` of `g` through the host build of the depthwise family's column walks.
fn run_host_depthwise_columns(
    cxx: &str,
    dtype: DType,
    pass: Pass,
    g: &Geometry,
    ops: [&[f64]; 2],
) -> Vec<f64> {
    let launch = depthwise_columns_launch(dtype, pass, g).expect("the column walks take the case");
    run_depthwise_launch(cxx, dtype, pass, g, ops, launch)
}

/// Runs `pass` of `g` through the host build of the depthwise family's tensor-core kernel, in
/// both plane layouts (the plan's and the other, `Problem::split_halo`): they place the staged
/// source differently and must give the same bits.
fn run_host_depthwise_tc(
    cxx: &str,
    dtype: DType,
    pass: Pass,
    g: &Geometry,
    ops: [&[f64]; 2],
) -> Vec<f64> {
    let launch =
        depthwise_tc_launch(dtype, pass, g).expect("the tensor-core kernel takes the case");
    let mut other = launch;
    other.problem.split_halo ^= 1;
    let tile = [
        launch.problem.tile_h as usize,
        launch.problem.tile_w as usize,
    ];
    let split = other.problem.split_halo == 1;
    other.shared = depthwise::shared_bytes(dtype, pass, launch.shape, tile, split);
    let out = run_depthwise_launch(cxx, dtype, pass, g, ops, launch);
    let out_other = run_depthwise_launch(cxx, dtype, pass, g, ops, other);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&out) == bits(&out_other),
        "the two plane layouts differ (plan's split_halo {})",
        launch.problem.split_halo
    );
    out
}

/// Runs `pass` of `g` through the host build of the grouped family's kernel: its tensor-core
/// path (sm_80), with ldmatrix and mma.sync emulated warp by warp. A plan of several launches
/// (backward-data's stride phases) runs each on an output of NaNs, as the harness starts it:
/// every element must be written by exactly one launch. ALIGNED false takes the operands as not
/// 16-byte aligned: the kernel copies the tile and stages the weights an element at a time.
fn run_host_grouped<const ALIGNED: bool>(
    cxx: &str,
    dtype: DType,
    pass: Pass,
    g: &Geometry,
    ops: [&[f64]; 2],
) -> Vec<f64> {
    let key = PlanKey {
        arch: grouped::MIN_ARCH,
        aligned: ALIGNED,
        ..host_key(dtype, pass, g)
    };
    let launch = grouped::launch_for(&key, SMS, 227 * 1024).expect("the family takes the case");
    let spec = grouped::spec(dtype, pass, launch.shape);
    let exe = executable(
        cxx,
        &spec,
        &[
            "KILN_ENTRY=kiln_conv_grouped",
            "KILN_PROBLEM=kiln_grouped",
            "KILN_ARCH=800",
        ],
    );
    let runs: Vec<Vec<f64>> = launch
        .phases
        .iter()
        .map(|phase| {
            let host = HostLaunch {
                grid: phase.grid,
                block: (32, grouped::THREADS as u32 / 32, 1),
                shared: launch.shared,
                problem: problem_bytes(&phase.problem),
                splits: launch.splits,
                out_len: out_len(pass, g),
            };
            run_launch(&exe, &spec, dtype, &host, ops)
        })
        .collect();
    if runs.len() == 1 {
        return runs.into_iter().next().unwrap();
    }
    (0..out_len(pass, g))
        .map(|i| {
            let written: Vec<f64> = runs.iter().map(|r| r[i]).filter(|v| !v.is_nan()).collect();
            assert_eq!(
                written.len(),
                1,
                "{spec}: element {i} written by {} of {} phases",
                written.len(),
                runs.len()
            );
            written[0]
        })
        .collect()
}

/// The `mma.sync` family's launch of `pass` of `g` on sm_80 (16-bit and split-TF32 f32 tensor
/// cores; one TF32 product where `tf32`), with tile `tile` or the model's.
fn igemm_host_launch(
    dtype: DType,
    pass: Pass,
    g: &Geometry,
    tf32: bool,
    tile: Option<plan::Tile>,
) -> plan::IgemmLaunch {
    let (vec_a, vec_b) = plan::channel_vectors(dtype, pass, g);
    let key = PlanKey {
        arch: 80,
        vec_a,
        vec_b,
        tf32,
        ..host_key(dtype, pass, g)
    };
    let (t, splits) = plan::pick(SMS, IGEMM_SHARED, &key);
    plan::igemm_launch(&key, tile.unwrap_or(t), splits, IGEMM_SHARED).unwrap()
}

/// sm_80's shared memory a block: every tile of the `mma.sync` family fits.
const IGEMM_SHARED: usize = 163 * 1024;

fn run_igemm(
    cxx: &str,
    dtype: DType,
    pass: Pass,
    g: &Geometry,
    ops: [&[f64]; 2],
    l: plan::IgemmLaunch,
) -> Vec<f64> {
    let exe = executable(
        cxx,
        &l.spec,
        &[
            "KILN_ENTRY=kiln_conv_igemm",
            "KILN_PROBLEM=kiln_conv",
            "KILN_ARCH=800",
        ],
    );
    // The GEMM's operands: backward-weight's A is the cotangent, B the input (the gather
    // families take them the other way round).
    let ops = match pass {
        Pass::BackwardWeight => [ops[1], ops[0]],
        _ => ops,
    };
    let host = HostLaunch {
        grid: l.grid,
        block: (l.threads, 1, 1),
        shared: l.shared,
        problem: problem_bytes(&l.problem),
        splits: l.splits,
        out_len: out_len(pass, g),
    };
    run_launch(&exe, &l.spec, dtype, &host, ops)
}

/// Runs `pass` of `g` through the host build of the `mma.sync` family's kernel on sm_80's
/// tensor-core paths, ldmatrix and mma.sync emulated warp by warp.
fn run_host_igemm(cxx: &str, dtype: DType, pass: Pass, g: &Geometry, ops: [&[f64]; 2]) -> Vec<f64> {
    run_igemm(
        cxx,
        dtype,
        pass,
        g,
        ops,
        igemm_host_launch(dtype, pass, g, false, None),
    )
}

/// The same with `KILN_ALLOW_TF32`: f32 as one TF32 product.
fn run_host_igemm_tf32(
    cxx: &str,
    dtype: DType,
    pass: Pass,
    g: &Geometry,
    ops: [&[f64]; 2],
) -> Vec<f64> {
    run_igemm(
        cxx,
        dtype,
        pass,
        g,
        ops,
        igemm_host_launch(dtype, pass, g, true, None),
    )
}

/// `n` random convolutions the direct family takes (seeded): 1 to 3 spatial dims, every group
/// shape, strides, paddings, both dilations and flip, small enough to emulate quickly.
fn random_cases(seed: u64, n: usize) -> Vec<Case> {
    let mut rng = TestRng::new(0x5eed + seed);
    let mut pick = |lo: usize, hi: usize| rng.pick(lo, hi);
    let mut out = Vec::new();
    while out.len() < n {
        let (cg, mg) = direct::GROUP_SHAPES[pick(0, direct::GROUP_SHAPES.len() - 1)];
        let groups = pick(1, 6) * if cg == 1 { 4 } else { 1 } + 1;
        let spatial = pick(1, 3);
        let mut x = vec![pick(1, 3)];
        let mut w = vec![mg * groups];
        let mut p = ConvParams::default().groups(groups).flip(pick(0, 3) == 0);
        let (mut strides, mut lo, mut hi, mut kd, mut id) =
            (vec![], vec![], vec![], vec![], vec![]);
        // The family takes grouped layers with a channel multiplier at stride 1 only.
        let most_stride = if cg > 1 && mg != cg { 1 } else { 3 };
        for _ in 0..spatial {
            x.push(pick(1, if spatial == 3 { 6 } else { 13 }));
            w.push(pick(1, if spatial == 1 { 11 } else { 5 }));
            strides.push(pick(1, most_stride));
            lo.push(pick(0, 3));
            hi.push(pick(0, 3));
            kd.push(if pick(0, 3) == 0 { 2 } else { 1 });
            id.push(if pick(0, 5) == 0 { 2 } else { 1 });
        }
        x.push(cg * groups);
        w.push(cg);
        p = p
            .strides(&strides)
            .padding_lo(&lo)
            .padding_hi(&hi)
            .kernel_dilation(&kd)
            .input_dilation(&id);
        if Geometry::new(&x, &w, &p).is_ok() {
            let name = format!("random {x:?} {w:?} {p:?}");
            out.push((name, x, w, p));
        }
    }
    out
}

/// A case: its name, input and weight shapes, and parameters.
type Case = (String, Vec<usize>, Vec<usize>, ConvParams);
/// Runs a pass through a host build: (compiler, dtype, pass, geometry, operands) -> result.
type Runner = fn(&str, DType, Pass, &Geometry, [&[f64]; 2]) -> Vec<f64>;

/// `n` random stems (seeded): 1 to 4 channels, kernels up to 7x7, strides up to 4, uneven
/// padding, flip, any output channel count (over two 64-channel blocks at times).
fn random_stems(seed: u64, n: usize) -> Vec<Case> {
    let mut rng = TestRng::new(0x57e3 + seed);
    let mut pick = |lo: usize, hi: usize| rng.pick(lo, hi);
    let mut out = Vec::new();
    while out.len() < n {
        let c = pick(1, stem::MAX_CHANNELS);
        let k = [pick(1, stem::MAX_KERNEL), pick(1, stem::MAX_KERNEL)];
        let x = vec![pick(1, 2), pick(k[0], 30), pick(k[1], 40), c];
        let w = vec![pick(1, 80), k[0], k[1], c];
        let p = ConvParams::default()
            .strides(&[pick(1, stem::MAX_STRIDE), pick(1, stem::MAX_STRIDE)])
            .padding_lo(&[pick(0, 3), pick(0, 3)])
            .padding_hi(&[pick(0, 3), pick(0, 3)])
            .flip(pick(0, 2) == 0);
        if Geometry::new(&x, &w, &p).is_ok() {
            out.push((format!("random stem {x:?} {w:?} {p:?}"), x, w, p));
        }
    }
    out
}

/// `n` random depthwise layers the depthwise family takes for `pass` (seeded): 1-D and 2-D,
/// channel multipliers 1, 2 and 4, channel counts that span several 32-channel blocks or leave
/// one partial (odd ones read without vectors), kernels up to 7 a side, strides up to 2,
/// uneven padding and flip.
fn random_depthwise(pass: Pass, n: usize) -> Vec<Case> {
    let mut rng = TestRng::new(0xde97 + pass as u64);
    let mut pick = |lo: usize, hi: usize| rng.pick(lo, hi);
    let most_stride = depthwise::MAX_STRIDE;
    let mut out = Vec::new();
    while out.len() < n {
        let c = if pick(0, 1) == 0 {
            pick(1, 9)
        } else {
            4 * pick(1, 18)
        };
        let mg = depthwise::MULTIPLIERS[pick(0, 2)];
        let one_d = pick(0, 3) == 0;
        let k = [
            if one_d {
                1
            } else {
                pick(1, depthwise::MAX_KERNEL)
            },
            pick(1, depthwise::MAX_KERNEL),
        ];
        let size = [if one_d { 1 } else { pick(1, 19) }, pick(1, 40)];
        let (x, w) = if one_d {
            (vec![pick(1, 2), size[1], c], vec![c * mg, k[1], 1])
        } else {
            (
                vec![pick(1, 2), size[0], size[1], c],
                vec![c * mg, k[0], k[1], 1],
            )
        };
        let dims = if one_d { 1 } else { 2 };
        let strides: Vec<usize> = (0..dims).map(|_| pick(1, most_stride)).collect();
        let lo: Vec<usize> = (0..dims).map(|_| pick(0, 3)).collect();
        let hi: Vec<usize> = (0..dims).map(|_| pick(0, 3)).collect();
        let p = ConvParams::default()
            .groups(c)
            .strides(&strides)
            .padding_lo(&lo)
            .padding_hi(&hi)
            .flip(pick(0, 2) == 0);
        if Geometry::new(&x, &w, &p).is_ok() {
            out.push((format!("random depthwise {x:?} {w:?} {p:?}"), x, w, p));
        }
    }
    out
}

/// `n` random layers the depthwise rows kernel takes (seeded): 2-D, one output channel a group,
/// `stride` along both dims, half of them kernels of 2-3 rows and 1-3 columns with channels in
/// vectors of 4 (one to several 64-vector chunks), half kernels of 2-7 rows and 1-7 columns
/// with channels in 16-byte copies (one channel a thread, one to several 32-channel chunks);
/// rows and columns from 1, uneven padding and flip.
fn random_depthwise_rows(seed: u64, n: usize, stride: usize) -> Vec<Case> {
    let mut rng = TestRng::new(0x70a5 + seed);
    let mut pick = |lo: usize, hi: usize| rng.pick(lo, hi);
    let mut out = Vec::new();
    while out.len() < n {
        let small = out.len() % 2 == 0;
        let (c, k) = if small {
            let c = 4 * if pick(0, 3) == 0 {
                pick(60, 70)
            } else {
                pick(1, 12)
            };
            (c, [pick(2, 3), pick(1, 3)])
        } else {
            (8 * pick(1, 12), [pick(2, 7), pick(1, 7)])
        };
        out.extend(random_depthwise_layer(
            &mut pick,
            "rows",
            c,
            k,
            stride,
            [2, 19],
        ));
    }
    out
}

/// A random 2-D depthwise layer (`kind` names it) of `c` channels, kernel `k` and `stride`:
/// uneven padding, flip, batch 1 to `most[0]`, images from what the padded kernel needs for one
/// output row and column up to `most[1]` rows and 40 columns; None where the geometry is invalid.
fn random_depthwise_layer(
    pick: &mut impl FnMut(usize, usize) -> usize,
    kind: &str,
    c: usize,
    k: [usize; 2],
    stride: usize,
    most: [usize; 2],
) -> Option<Case> {
    let lo = [pick(0, k[0] - 1), pick(0, k[1] - 1)];
    let hi = [pick(0, k[0] - 1), pick(0, k[1] - 1)];
    let least = |d: usize| (k[d] + 1).saturating_sub(1 + lo[d] + hi[d]).max(1);
    let x = vec![
        pick(1, most[0]),
        pick(least(0), most[1]),
        pick(least(1), 40),
        c,
    ];
    let w = vec![c, k[0], k[1], 1];
    let p = ConvParams::default()
        .groups(c)
        .strides(&[stride])
        .padding_lo(&lo)
        .padding_hi(&hi)
        .flip(pick(0, 2) == 0);
    Geometry::new(&x, &w, &p).is_ok().then(|| {
        (
            format!("random depthwise {kind} {x:?} {w:?} {p:?}"),
            x,
            w,
            p,
        )
    })
}

/// `n` random layers the depthwise column walks take (seeded): 2-D, one output channel a
/// group, 1 to `most_channels` channels (vectors of 4, 2 and 1; past 64 vectors, two chunks),
/// kernels of 2-7 rows and 1-7 columns at stride 1 to `most_stride`, images from one
/// output row and column to several segments and bands, uneven padding and flip.
fn random_depthwise_columns(
    seed: u64,
    n: usize,
    most_stride: usize,
    most_channels: usize,
) -> Vec<Case> {
    let mut rng = TestRng::new(0xc015 + seed);
    let mut pick = |lo: usize, hi: usize| rng.pick(lo, hi);
    let mut out = Vec::new();
    while out.len() < n {
        let c = pick(1, most_channels);
        let k = [pick(2, 7), pick(1, 7)];
        let stride = pick(1, most_stride);
        out.extend(random_depthwise_layer(
            &mut pick,
            "columns",
            c,
            k,
            stride,
            [3, 21],
        ));
    }
    out
}

/// `n` random grouped layers the grouped family takes for `pass` (seeded): 1-D and 2-D, every
/// group width and channel multiplier, channel counts over several 64-channel blocks or one partial (some without
/// 16-byte copies), kernels up to 3 a side, strides up to 2, uneven padding and flip.
fn random_grouped(pass: Pass, n: usize) -> Vec<Case> {
    let mut rng = TestRng::new(0x9a0c + pass as u64);
    let mut pick = |lo: usize, hi: usize| rng.pick(lo, hi);
    let most_stride = grouped::MAX_STRIDE;
    let mut out = Vec::new();
    while out.len() < n {
        let cg = grouped::GROUP_WIDTHS[pick(0, grouped::GROUP_WIDTHS.len() - 1)];
        // A channel multiplier of 2 or 4 for a third of the group widths that take one.
        let mul = match grouped::MULTIPLIERS[pick(0, grouped::MULTIPLIERS.len() - 1)] {
            m if m > 1 && grouped::takes_multiplier(cg, m) && pick(0, 1) == 0 => m,
            _ => 1,
        };
        // Channels in pairs, as the family stores them.
        let c = cg.max(2) * pick(2, (160 / cg.max(2)).max(2));
        let one_d = pick(0, 3) == 0;
        let k = [
            if one_d {
                1
            } else {
                pick(1, grouped::MAX_KERNEL)
            },
            pick(1, grouped::MAX_KERNEL),
        ];
        let size = [if one_d { 1 } else { pick(1, 19) }, pick(1, 40)];
        let (x, w) = if one_d {
            (vec![pick(1, 2), size[1], c], vec![c * mul, k[1], cg])
        } else {
            (
                vec![pick(1, 2), size[0], size[1], c],
                vec![c * mul, k[0], k[1], cg],
            )
        };
        let dims = if one_d { 1 } else { 2 };
        let strides: Vec<usize> = (0..dims).map(|_| pick(1, most_stride)).collect();
        let lo: Vec<usize> = (0..dims).map(|_| pick(0, 2)).collect();
        let hi: Vec<usize> = (0..dims).map(|_| pick(0, 2)).collect();
        let p = ConvParams::default()
            .groups(c / cg)
            .strides(&strides)
            .padding_lo(&lo)
            .padding_hi(&hi)
            .flip(pick(0, 2) == 0);
        if Geometry::new(&x, &w, &p).is_ok() {
            out.push((format!("random grouped {x:?} {w:?} {p:?}"), x, w, p));
        }
    }
    out
}

fn check_cases(label: &str, pass: Pass, cases: &[Case], run: Runner) {
    check_dtypes(label, pass, cases, run, &DType::ALL)
}

fn check_dtypes(label: &str, pass: Pass, cases: &[Case], run: Runner, dtypes: &[DType]) {
    let failed = check_with(label, pass, cases, run, dtypes, worst);
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// The largest error over a tolerance (<= 1 passes) and where it is.
type Bound = fn(DType, &[f64], &reference::Reference) -> (f64, usize);

/// Runs every case of `pass` in each of `dtypes` through `run`; the failures against `bound`
/// (none when no C++ compiler is found).
fn check_with(
    label: &str,
    pass: Pass,
    cases: &[Case],
    run: Runner,
    dtypes: &[DType],
    bound: Bound,
) -> Vec<String> {
    let Some(cxx) = compiler() else {
        eprintln!("{label}: no C++ compiler, skipped");
        return Vec::new();
    };
    let mut failures = Vec::new();
    let mut checked = 0;
    for (ci, c) in cases.iter().enumerate() {
        let (name, x_shape, w_shape, params) = c;
        let g = Geometry::new(x_shape, w_shape, params).unwrap();
        for &dtype in dtypes {
            let mut rng = TestRng::new(ci as u64 * 13 + 5);
            let x = random(&mut rng, dtype, x_shape.iter().product());
            let w = random(&mut rng, dtype, w_shape.iter().product());
            let dy = random(&mut rng, dtype, g.output_shape().iter().product());
            let (got, want) = match pass {
                Pass::Forward => (
                    run(&cxx, dtype, pass, &g, [&x, &w]),
                    reference::forward(&g, &x, &w),
                ),
                Pass::BackwardData => (
                    run(&cxx, dtype, pass, &g, [&dy, &w]),
                    reference::backward_data(&g, &dy, &w),
                ),
                Pass::BackwardWeight => (
                    run(&cxx, dtype, pass, &g, [&x, &dy]),
                    reference::backward_weight(&g, &x, &dy),
                ),
            };
            checked += 1;
            assert_eq!(got.len(), want.values.len());
            let worst = bound(dtype, &got, &want);
            if worst.0 > 1.0 {
                failures.push(format!(
                    "{name} {dtype} {}: error {:.2}x tolerance at {}: got {} want {}",
                    pass.name(),
                    worst.0,
                    worst.1,
                    got[worst.1],
                    want.values[worst.1]
                ));
            }
        }
    }
    eprintln!(
        "{label} {}: {checked} checks, {} failed",
        pass.name(),
        failures.len()
    );
    failures
}

fn check_pass(pass: Pass) {
    let fixed = common::conv_cases::direct()
        .into_iter()
        .map(|c| (c.name.to_string(), c.x, c.w, c.p));
    let cases: Vec<_> = fixed.chain(random_cases(pass as u64, 10)).collect();
    check_cases("host_direct", pass, &cases, run_host);
}

fn check_stem(pass: Pass) {
    let fixed = common::conv_cases::stem()
        .into_iter()
        .map(|c| (c.name.to_string(), c.x, c.w, c.p));
    let cases: Vec<_> = fixed.chain(random_stems(pass as u64, 5)).collect();
    check_cases("host_stem", pass, &cases, run_host_stem);
}

fn check_depthwise(pass: Pass) {
    let taken = |x: &[usize], w: &[usize], p: &ConvParams| {
        let g = Geometry::new(x, w, p).unwrap();
        let key = host_key(DType::F32, pass, &g);
        depthwise::unsupported(kiln::env::ConvPath::Auto, &key).is_none()
    };
    let fixed = fixed_depthwise(taken);
    let mut cases: Vec<_> = fixed.into_iter().chain(random_depthwise(pass, 6)).collect();
    if pass == Pass::BackwardWeight {
        // Backward-weight on 4 x 7 sub-tiles, every dtype: 5x5 on a 27-wide image (the last
        // tile ragged, the last channel chunk partial) and 7x7.
        let d = ConvParams::default;
        for (x, w, p) in [
            ([1, 8, 27, 40], [40, 5, 5, 1], d().groups(40).padding(&[2])),
            ([1, 16, 14, 24], [24, 7, 7, 1], d().groups(24).padding(&[3])),
        ] {
            let g = Geometry::new(&x, &w, &p).unwrap();
            for dtype in DType::ALL {
                let launch = depthwise::launch_for(&host_key(dtype, pass, &g), SMS, 227 * 1024);
                assert_eq!(
                    launch.unwrap().shape.out_tile,
                    depthwise::WIDE_TILE,
                    "{dtype:?} {x:?} {w:?}"
                );
            }
            let name = format!("depthwise {x:?} {w:?} on 4 x 7 sub-tiles");
            cases.push((name, x.to_vec(), w.to_vec(), p));
        }
    }
    check_cases("host_depthwise", pass, &cases, run_host_depthwise);
}

/// The fixed depthwise cases a kernel takes (`taken` of their operands' shapes and params).
fn fixed_depthwise(taken: impl Fn(&[usize], &[usize], &ConvParams) -> bool) -> Vec<Case> {
    common::conv_cases::depthwise()
        .into_iter()
        .filter(|c| taken(&c.x, &c.w, &c.p))
        .map(|c| (c.name.to_string(), c.x, c.w, c.p))
        .collect()
}

/// The depthwise tensor-core kernel: the fixed and random depthwise cases it takes, 16-bit.
fn check_depthwise_tc(pass: Pass) {
    let taken = |x: &[usize], w: &[usize], p: &ConvParams| {
        let g = Geometry::new(x, w, p).unwrap();
        depthwise_tc_launch(DType::F16, pass, &g).is_some()
    };
    let fixed = fixed_depthwise(taken);
    let random = random_depthwise(pass, 40)
        .into_iter()
        .filter(|(_, x, w, p)| taken(x, w, p))
        .take(6);
    // Rows wider than one tile, a chunk of 8 channels, a row stride, 6-row and one-row kernels.
    let d = ConvParams::default;
    let layer = |x: &[usize], w: &[usize], p: ConvParams| {
        (
            format!("tensor {x:?} {w:?} {p:?}"),
            x.to_vec(),
            w.to_vec(),
            p,
        )
    };
    let strided = d().groups(16).padding_lo(&[3, 2]).padding_hi(&[1, 3]);
    let wide: Vec<Case> = [
        layer(
            &[2, 11, 130, 24],
            &[24, 7, 7, 1],
            d().groups(24).padding(&[3]),
        ),
        layer(
            &[1, 17, 61, 8],
            &[8, 5, 5, 1],
            d().groups(8).padding(&[2]).flip(true),
        ),
        layer(&[2, 40, 35, 16], &[16, 7, 7, 1], strided.strides(&[2, 1])),
        layer(
            &[1, 33, 20, 16],
            &[16, 6, 5, 1],
            d().groups(16).padding_lo(&[2, 1]),
        ),
        layer(
            &[1, 5, 17, 40],
            &[40, 1, 7, 1],
            d().groups(40).padding(&[0, 3]),
        ),
    ]
    .into_iter()
    .filter(|(_, x, w, p)| taken(x, w, p))
    .collect();
    // All five forward, all but the row stride in backward-data.
    assert!(wide.len() >= 4, "the tensor-core kernel takes these layers");
    let cases: Vec<_> = fixed.into_iter().chain(random).chain(wide).collect();
    let sixteen = [DType::F16, DType::BF16];
    check_dtypes(
        "host_depthwise_tc",
        pass,
        &cases,
        run_host_depthwise_tc,
        &sixteen,
    );
}

/// The depthwise rows kernel: the fixed depthwise cases it takes (in every dtype) and random
/// ones, every dtype.
fn check_depthwise_rows(pass: Pass) {
    let taken = |x: &[usize], w: &[usize], p: &ConvParams| {
        let g = Geometry::new(x, w, p).unwrap();
        DType::ALL
            .iter()
            .all(|&dtype| depthwise_rows_launch(dtype, pass, &g).is_some())
    };
    let mut random = random_depthwise_rows(pass as u64, 12, 1);
    if pass == Pass::Forward {
        // The forward also runs at stride 2 (seed 7: apart from the stride-1 seeds, 0-2).
        random.extend(random_depthwise_rows(7, 12, 2));
    }
    assert!(random.iter().all(|(_, x, w, p)| taken(x, w, p)));
    let cases: Vec<_> = fixed_depthwise(taken).into_iter().chain(random).collect();
    check_cases("host_depthwise_rows", pass, &cases, run_host_depthwise_rows);
}

/// The depthwise column walks: the fixed depthwise cases they take for `pass` and random
/// ones (backward-data at stride 1), every dtype.
fn check_depthwise_columns(pass: Pass) {
    let taken = |x: &[usize], w: &[usize], p: &ConvParams| {
        let g = Geometry::new(x, w, p).unwrap();
        DType::ALL
            .iter()
            .all(|&dtype| depthwise_columns_launch(dtype, pass, &g).is_some())
    };
    let most_stride = if pass == Pass::BackwardData { 1 } else { 2 };
    // Backward-weight keeps the seed it had before the other passes joined.
    let seed = match pass {
        Pass::BackwardWeight => 0,
        Pass::Forward => 1,
        Pass::BackwardData => 2,
    };
    // Forward and backward-data also draw layers of two chunks (a block a chunk and tile).
    let most_channels = if pass == Pass::BackwardWeight {
        70
    } else {
        160
    };
    let random = random_depthwise_columns(seed, 10, most_stride, most_channels);
    assert!(random.iter().all(|(_, x, w, p)| taken(x, w, p)));
    let cases: Vec<_> = fixed_depthwise(taken).into_iter().chain(random).collect();
    check_cases(
        "host_depthwise_columns",
        pass,
        &cases,
        run_host_depthwise_columns,
    );
}

/// The grouped family is 16-bit only.
fn check_grouped(pass: Pass) {
    check_grouped_with(pass, 6, run_host_grouped::<true>);
}

fn check_grouped_with(pass: Pass, random: usize, run: Runner) {
    let taken = |c: &common::conv_cases::ConvCase| {
        let g = Geometry::new(&c.x, &c.w, &c.p).unwrap();
        let key = PlanKey {
            arch: grouped::MIN_ARCH,
            ..host_key(DType::F16, pass, &g)
        };
        grouped::unsupported(kiln::env::ConvPath::Auto, &key).is_none()
    };
    let fixed = common::conv_cases::grouped()
        .into_iter()
        .filter(taken)
        .map(|c| (c.name.to_string(), c.x, c.w, c.p));
    let cases: Vec<_> = fixed.chain(random_grouped(pass, random)).collect();
    let sixteen = [DType::F16, DType::BF16];
    check_dtypes("host_grouped", pass, &cases, run, &sixteen);
}

/// Cases for the `mma.sync` family: k tiles within one tap (channels a multiple of 32) and
/// through the k table, stride phases of backward-data, groups, 1-D and 3-D, both dilations,
/// flip, scalar loads (odd channels), two or more tiles each way and a backward-weight sum long
/// enough to split.
fn igemm_cases() -> Vec<Case> {
    let d = ConvParams::default;
    let case = |name: &str, x: &[usize], w: &[usize], p: ConvParams| {
        (name.to_string(), x.to_vec(), w.to_vec(), p)
    };
    vec![
        case(
            "tap tiles, stride 2, pad 1/2",
            &[2, 9, 11, 32],
            &[40, 3, 3, 32],
            d().strides(&[2]).padding_lo(&[1]).padding_hi(&[2]),
        ),
        case(
            "groups 2, flip, kernel dilation 2",
            &[2, 8, 9, 48],
            &[32, 3, 2, 24],
            d().groups(2).flip(true).kernel_dilation(&[2]).padding(&[2]),
        ),
        case(
            "odd channels 5 -> 7",
            &[2, 6, 7, 5],
            &[7, 3, 3, 5],
            d().padding(&[1]),
        ),
        case(
            "1d input dilation 2",
            &[3, 9, 16],
            &[24, 3, 16],
            d().input_dilation(&[2]).padding(&[1]),
        ),
        case(
            "3d stride (1, 2, 1)",
            &[1, 4, 5, 6, 16],
            &[16, 3, 2, 3, 16],
            d().strides(&[1, 2, 1]).padding(&[1, 0, 1]),
        ),
        case(
            "72 -> 136 (k table), two or more tiles each way",
            &[2, 7, 7, 72],
            &[136, 3, 3, 72],
            d().padding(&[1]),
        ),
        case(
            "1x1 over 16x16, a backward-weight sum that splits",
            &[2, 16, 16, 8],
            &[16, 1, 1, 8],
            d(),
        ),
    ]
}

fn check_igemm(pass: Pass) {
    let failed = check_with(
        "host_igemm",
        pass,
        &igemm_cases(),
        run_host_igemm,
        &DType::ALL,
        worst,
    );
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn igemm_forward_matches_the_reference() {
    check_igemm(Pass::Forward);
}

#[test]
fn igemm_backward_data_matches_the_reference() {
    check_igemm(Pass::BackwardData);
}

#[test]
fn igemm_backward_weight_matches_the_reference() {
    check_igemm(Pass::BackwardWeight);
}

/// One TF32 product (`KILN_ALLOW_TF32`) within TF32's bound (two operands of 11 bits: 2e-3 of
/// the sum of the products' magnitudes); and not within f32's, which the three-product split
/// meets above: the bound tells the two apart.
#[test]
fn igemm_one_tf32_product_meets_tf32s_bound_and_not_f32s() {
    let Some(cxx) = compiler() else {
        return;
    };
    let dtype = DType::F32;
    for pass in Pass::ALL {
        let (mut past_tf32, mut past_f32) = (Vec::new(), 0);
        for (ci, (name, x_shape, w_shape, params)) in igemm_cases().iter().enumerate() {
            let g = Geometry::new(x_shape, w_shape, params).unwrap();
            let mut rng = TestRng::new(ci as u64 * 13 + 5);
            let x = random(&mut rng, dtype, x_shape.iter().product());
            let w = random(&mut rng, dtype, w_shape.iter().product());
            let dy = random(&mut rng, dtype, g.output_shape().iter().product());
            let (ops, want) = match pass {
                Pass::Forward => ([&x[..], &w[..]], reference::forward(&g, &x, &w)),
                Pass::BackwardData => ([&dy[..], &w[..]], reference::backward_data(&g, &dy, &w)),
                Pass::BackwardWeight => {
                    ([&x[..], &dy[..]], reference::backward_weight(&g, &x, &dy))
                }
            };
            let got = run_host_igemm_tf32(&cxx, dtype, pass, &g, ops);
            let tf32 = worst_tf32(&got, &want);
            if tf32 > 1.0 {
                past_tf32.push(format!("{name}: {tf32:.2}x TF32's bound"));
            }
            if worst(dtype, &got, &want).0 > 1.0 {
                past_f32 += 1;
            }
        }
        let label = pass.name();
        assert!(past_tf32.is_empty(), "{label}: {}", past_tf32.join("\n"));
        assert!(
            past_f32 > 0,
            "{label}: one TF32 product met f32's bound on every case"
        );
        eprintln!("host_igemm_tf32 {label}: {past_f32} cases past f32's bound, none past TF32's");
    }
}

#[test]
fn depthwise_rows_forward_matches_the_reference() {
    check_depthwise_rows(Pass::Forward);
}

#[test]
fn depthwise_rows_backward_data_matches_the_reference() {
    check_depthwise_rows(Pass::BackwardData);
}

#[test]
fn depthwise_rows_backward_weight_matches_the_reference() {
    check_depthwise_rows(Pass::BackwardWeight);
}

#[test]
fn depthwise_columns_forward_matches_the_reference() {
    check_depthwise_columns(Pass::Forward);
}

#[test]
fn depthwise_columns_backward_data_matches_the_reference() {
    check_depthwise_columns(Pass::BackwardData);
}

#[test]
fn depthwise_columns_backward_weight_matches_the_reference() {
    check_depthwise_columns(Pass::BackwardWeight);
}

#[test]
fn depthwise_tensor_forward_matches_the_reference() {
    check_depthwise_tc(Pass::Forward);
}

#[test]
fn depthwise_tensor_backward_data_matches_the_reference() {
    check_depthwise_tc(Pass::BackwardData);
}

#[test]
fn grouped_forward_matches_the_reference() {
    check_grouped(Pass::Forward);
}

#[test]
fn grouped_backward_data_matches_the_reference() {
    check_grouped(Pass::BackwardData);
}

#[test]
fn grouped_backward_weight_matches_the_reference() {
    check_grouped(Pass::BackwardWeight);
}

/// Unaligned operands take the element-at-a-time copies and weight staging (a rolled loop).
#[test]
fn grouped_unaligned_operands_match_the_reference() {
    for pass in [Pass::Forward, Pass::BackwardData] {
        check_grouped_with(pass, 2, run_host_grouped::<false>);
    }
}

#[test]
fn forward_matches_the_reference() {
    check_pass(Pass::Forward);
}

#[test]
fn backward_data_matches_the_reference() {
    check_pass(Pass::BackwardData);
}

#[test]
fn backward_weight_matches_the_reference() {
    check_pass(Pass::BackwardWeight);
}

#[test]
fn stem_forward_matches_the_reference() {
    check_stem(Pass::Forward);
}

#[test]
fn stem_backward_weight_matches_the_reference() {
    check_stem(Pass::BackwardWeight);
}

#[test]
fn stem_backward_data_matches_the_reference() {
    check_stem(Pass::BackwardData);
}

#[test]
fn depthwise_forward_matches_the_reference() {
    check_depthwise(Pass::Forward);
}

#[test]
fn depthwise_backward_data_matches_the_reference() {
    check_depthwise(Pass::BackwardData);
}

#[test]
fn depthwise_backward_weight_matches_the_reference() {
    check_depthwise(Pass::BackwardWeight);
}
