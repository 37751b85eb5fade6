//! The direct convolution family (`templates/conv_direct.cu`) compiled for the host as plain
//! C++ (`tests/host/cuda_host.h`: a block's threads are OS threads) and run on the launches the
//! plans make, against the f64 reference with the GPU tests' tolerance: its index arithmetic,
//! bounds (AddressSanitizer, shared memory past the launch's size poisoned), barriers and
//! reductions, every pass and dtype, without a GPU. Memory ordering and speed are the GPU
//! tests' and benches' part. Skipped when no C++20 compiler is found (`CXX`, else `g++`, else
//! `c++`); `KILN_REQUIRE_HOST_CXX=1` fails instead.

mod common;

use common::conv_cases::{random, worst};

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln::ops::conv::{direct, plan::PlanKey, reference, ConvParams, Geometry, Pass};
use kiln::selfcheck::TestRng;
use kiln::DType;
use sha2::{Digest, Sha256};

/// Multiprocessors and shared memory of the device the launches are planned for: few
/// multiprocessors keep the grids small, and still split backward-weight's longer sums.
const SMS: usize = 4;
const SHARED: usize = 64 * 1024;

fn compiler() -> Option<String> {
    let candidates = std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["g++".to_string(), "c++".to_string()]);
    for cxx in candidates {
        let ok = Command::new(&cxx)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Some(cxx);
        }
    }
    if std::env::var("KILN_REQUIRE_HOST_CXX").as_deref() == Ok("1") {
        panic!("KILN_REQUIRE_HOST_CXX=1 but no C++ compiler (CXX, g++, c++) runs");
    }
    None
}

fn host_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/host")
}

/// The host executable for `spec`, compiled once per rendered source and harness.
fn executable(cxx: &str, spec: &kiln::jit::KernelSpec) -> PathBuf {
    let source = kiln::jit::template::render(spec).unwrap().source;
    let mut h = Sha256::new();
    h.update(cxx);
    h.update(&source);
    for f in ["cuda_host.h", "run_direct.cpp"] {
        h.update(std::fs::read(host_dir().join(f)).unwrap());
    }
    let key: String = h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = std::env::temp_dir().join("kiln-host-direct");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join(format!("run-{key}"));
    if exe.exists() {
        return exe;
    }
    let kernel = dir.join(format!("kernel-{key}.cu"));
    std::fs::write(&kernel, &source).unwrap();
    let partial = dir.join(format!("run-{key}.{}.tmp", std::process::id()));
    let out = Command::new(cxx)
        .args(["-std=c++20", "-O1", "-g", "-pthread", "-x", "c++"])
        .args(["-fsanitize=address,undefined", "-fno-sanitize-recover=all"])
        .args(["-DKILN_HOST", "-DKILN_ARCH=700", "-Wno-unknown-pragmas"])
        .arg(format!("-DKILN_KERNEL=\"{}\"", kernel.display()))
        .arg(format!("-I{}", host_dir().display()))
        .arg(host_dir().join("run_direct.cpp"))
        .arg("-o")
        .arg(&partial)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{spec}: the host compile failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Renamed into place, so that tests compiling the same spec at once do not collide.
    std::fs::rename(&partial, &exe).unwrap();
    exe
}

fn push_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    buf.extend_from_slice(bytes);
}

/// Runs `pass` of `g` through the host build of the plan's kernel; the result as f64.
fn run_host(cxx: &str, dtype: DType, pass: Pass, g: &Geometry, ops: [&[f64]; 2]) -> Vec<f64> {
    let key = PlanKey {
        device: 0,
        arch: 70,
        dtype,
        pass,
        geometry: *g,
        vec_a: false,
        vec_b: false,
        aligned: true,
    };
    let launch = direct::launch_for(&key, SMS, SHARED).expect("the family takes the case");
    let (cg, mg) = (g.cin / g.groups, g.cout / g.groups);
    let spec = direct::spec(dtype, pass, cg, mg, launch.shape);
    let exe = executable(cxx, &spec);
    let out_len: usize = match pass {
        Pass::Forward => g.output_shape(),
        Pass::BackwardData => g.input_shape(),
        Pass::BackwardWeight => g.weight_shape(),
    }
    .iter()
    .product();
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
    // SAFETY: Problem is repr(C), Copy and all i32: its bytes are its value as the kernel's
    // struct kiln_direct lays it out.
    let problem = unsafe {
        std::slice::from_raw_parts(
            (&launch.problem as *const direct::Problem).cast::<u8>(),
            std::mem::size_of::<direct::Problem>(),
        )
    };
    input.extend_from_slice(problem);
    for op in ops {
        push_bytes(&mut input, &kiln::dtype::encode(dtype, op));
    }
    input.extend_from_slice(&((out_len * dtype.size()) as u64).to_le_bytes());
    input.extend_from_slice(&(partials as u64).to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let (inp, outp) = (dir.path().join("in"), dir.path().join("out"));
    std::fs::write(&inp, &input).unwrap();
    let run = Command::new(&exe).arg(&inp).arg(&outp).output().unwrap();
    assert!(
        run.status.success(),
        "{spec} {launch:?}: the host run failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let bytes = std::fs::read(&outp).unwrap();
    let (out, partial) = bytes.split_at(out_len * dtype.size());
    if partials == 0 {
        return kiln::dtype::decode(dtype, out);
    }
    // Sum the splits in order in f32, as conv_split_sum does, then round to the dtype.
    let partial: Vec<f32> = partial
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let sums: Vec<f64> = (0..out_len)
        .map(|i| (0..launch.splits).fold(0f32, |s, k| s + partial[k * out_len + i]) as f64)
        .collect();
    kiln::dtype::decode(dtype, &kiln::dtype::encode(dtype, &sums))
}

/// `n` random convolutions the direct family takes (seeded): 1 to 3 spatial dims, every group
/// shape, strides, paddings, both dilations and flip, small enough to emulate quickly.
fn random_cases(seed: u64, n: usize) -> Vec<(String, Vec<usize>, Vec<usize>, ConvParams)> {
    let mut rng = TestRng::new(0x5eed + seed);
    let mut pick = |lo: usize, hi: usize| lo + (rng.next_f64() * (hi - lo + 1) as f64) as usize;
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
        for _ in 0..spatial {
            x.push(pick(1, if spatial == 3 { 6 } else { 13 }));
            w.push(pick(1, if spatial == 1 { 11 } else { 5 }));
            strides.push(pick(1, 3));
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

fn check_pass(pass: Pass) {
    let Some(cxx) = compiler() else {
        eprintln!("host_direct: no C++ compiler, skipped");
        return;
    };
    let mut failures = Vec::new();
    let mut checked = 0;
    let fixed = common::conv_cases::direct()
        .into_iter()
        .map(|c| (c.name.to_string(), c.x, c.w, c.p));
    let cases: Vec<_> = fixed.chain(random_cases(pass as u64, 10)).collect();
    for (ci, c) in cases.iter().enumerate() {
        let (name, x_shape, w_shape, params) = c;
        let g = Geometry::new(x_shape, w_shape, params).unwrap();
        for dtype in DType::ALL {
            let mut rng = TestRng::new(ci as u64 * 13 + 5);
            let x = random(&mut rng, dtype, x_shape.iter().product());
            let w = random(&mut rng, dtype, w_shape.iter().product());
            let dy = random(&mut rng, dtype, g.output_shape().iter().product());
            let (got, want) = match pass {
                Pass::Forward => (
                    run_host(&cxx, dtype, pass, &g, [&x, &w]),
                    reference::forward(&g, &x, &w),
                ),
                Pass::BackwardData => (
                    run_host(&cxx, dtype, pass, &g, [&dy, &w]),
                    reference::backward_data(&g, &dy, &w),
                ),
                Pass::BackwardWeight => (
                    run_host(&cxx, dtype, pass, &g, [&x, &dy]),
                    reference::backward_weight(&g, &x, &dy),
                ),
            };
            checked += 1;
            assert_eq!(got.len(), want.values.len());
            let worst = worst(dtype, &got, &want);
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
        "host_direct {}: {checked} checks, {} failed",
        pass.name(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
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
