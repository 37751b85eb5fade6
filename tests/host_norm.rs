//! The LayerNorm and RMSNorm kernels of one row a group (`templates/norm_fwd.cu`,
//! `norm_vjp.cu`) compiled for the host as plain C++ (`tests/host/cuda_host.h`: a block's
//! threads are OS threads, warp shuffles and named barriers emulated) and run on the launches
//! the ops make, against the f64 reference with the GPU tests' tolerance: their index
//! arithmetic, bounds (AddressSanitizer, shared memory past the launch's size poisoned),
//! barriers, warp sums and row loops, every dtype and layout the ops choose, without a GPU.
//! The rings' copies are made at once, so memory ordering and speed are the GPU tests' and
//! benches' part; the split-row kernels (clusters) are `tests/host_norm_split.rs`'s. Skipped
//! when no C++20 compiler is found (`CXX`, else `g++`, else `c++`); `KILN_REQUIRE_HOST_CXX=1`
//! fails instead.

mod common;

use common::host::{self, compiler, push_bytes};

use std::collections::HashSet;
use std::process::Command;

use kiln::jit::KernelSpec;
use kiln::ops::norm::{
    self, reference_forward, reference_vjp, tuning, Count, Gpu, Kind, Pass, Rows,
};
use kiln::selfcheck::{max_error, tolerance, TestRng};
use kiln::DType;

/// Shared memory a block may take on the GPUs whose choices the tests replay (Hopper's 227 KiB),
/// which decides where the one-row-a-block VJP keeps its partial sums.
const SHARED_LIMIT: usize = 227 * 1024;

/// One launch to check: a spec on rows of `d` elements.
#[derive(Clone, Copy, Debug)]
struct Case {
    spec: KernelSpec,
    kind: Kind,
    pass: Pass,
    d: usize,
    rows: usize,
    eps: f64,
    /// An element of each row this far from the others (the exact statistics' test).
    outlier: Option<f64>,
}

fn q(dtype: DType, v: Vec<f64>) -> Vec<f64> {
    kiln::dtype::decode(dtype, &kiln::dtype::encode(dtype, &v)).unwrap()
}

/// How contiguous rows of `d` elements at an aligned address lie, as the ops see them.
fn contiguous_rows(dtype: DType, d: usize) -> Rows {
    if d % dtype.vec_width() == 0 {
        Rows::Aligned
    } else {
        Rows::Alike
    }
}

fn constant(spec: &KernelSpec, name: &str) -> usize {
    spec.constant(name).expect("a norm spec's constant") as usize
}

/// The grid the case runs on: kernels that loop over rows get two blocks (so that they loop,
/// and some groups find no row), the others a group a row.
fn grid_of(c: &Case) -> usize {
    let items = constant(&c.spec, "ITEMS");
    let groups = c.spec.block_dim as usize / constant(&c.spec, "GROUP");
    let loops = c.pass == Pass::Vjp || constant(&c.spec, "STAGES") > 0;
    if loops {
        2
    } else if items > 0 {
        c.rows.div_ceil(groups)
    } else {
        c.rows
    }
}

/// Runs `c` through the host build of its kernel; the worst error over its outputs.
fn run(cxx: &str, c: &Case, seed: u64) -> f64 {
    let (dtype, d, rows) = (c.spec.dtype, c.d, c.rows);
    let mut rng = TestRng::new(seed);
    let mut x = q(dtype, rng.values(rows * d, 2.0, 0.5));
    if let Some(v) = c.outlier {
        for row in x.chunks_mut(d) {
            row[0] = q(dtype, vec![v])[0];
        }
    }
    let w = q(dtype, rng.values(d, 1.0, 1.0));
    let b = q(dtype, rng.values(d, 0.5, 0.0));
    let g = q(dtype, rng.values(rows * d, 1.0, 0.0));
    let layout = contiguous_rows(dtype, d);
    let w_vec = (layout == Rows::Aligned) as i32;
    let lnorm = c.kind == Kind::LayerNorm;
    let grid = grid_of(c);
    let (shared, smem_partials): (usize, i32) =
        if c.pass == Pass::Vjp && constant(&c.spec, "ITEMS") == 0 {
            let bytes = 2 * d * 4;
            if bytes + 1024 <= SHARED_LIMIT {
                (bytes, 1)
            } else {
                (0, 0)
            }
        } else {
            (tuning::ring_shared_bytes(&c.spec, d), 0)
        };

    let mut input = Vec::new();
    input.extend_from_slice(&(grid as u32).to_le_bytes());
    input.extend_from_slice(&(c.spec.block_dim as u32).to_le_bytes());
    input.extend_from_slice(&(shared as u64).to_le_bytes());
    input.extend_from_slice(&(rows as i64).to_le_bytes());
    input.extend_from_slice(&(d as i32).to_le_bytes());
    input.extend_from_slice(&(c.eps as f32).to_le_bytes());
    input.extend_from_slice(&(d as i64).to_le_bytes()); // x's row stride
    input.extend_from_slice(&(d as i64).to_le_bytes()); // the cotangent's
    input.extend_from_slice(&1i64.to_le_bytes()); // the weight's stride
    input.extend_from_slice(&w_vec.to_le_bytes());
    input.extend_from_slice(&1i64.to_le_bytes()); // the bias's
    input.extend_from_slice(&w_vec.to_le_bytes());
    input.extend_from_slice(&smem_partials.to_le_bytes());
    let encode = |v: &[f64]| kiln::dtype::encode(dtype, v);
    let vjp = c.pass == Pass::Vjp;
    push_bytes(&mut input, &encode(&x));
    push_bytes(&mut input, &encode(&w));
    push_bytes(&mut input, &if lnorm && !vjp { encode(&b) } else { vec![] });
    push_bytes(&mut input, &if vjp { encode(&g) } else { vec![] });
    input.extend_from_slice(&((rows * d * dtype.size()) as u64).to_le_bytes());
    let partial = if vjp { grid * d } else { 0 };
    input.extend_from_slice(&(partial as u64).to_le_bytes());
    let partial_b = if vjp && lnorm { partial } else { 0 };
    input.extend_from_slice(&(partial_b as u64).to_le_bytes());

    let exe = executable(cxx, &c.spec);
    let dir = tempfile::tempdir().unwrap();
    let (inp, outp) = (dir.path().join("in"), dir.path().join("out"));
    std::fs::write(&inp, &input).unwrap();
    let out = Command::new(&exe).arg(&inp).arg(&outp).output().unwrap();
    assert!(
        out.status.success(),
        "{} on {rows}x{d}, grid {grid}: the host run failed:\n{}",
        c.spec,
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&outp).unwrap();
    let (y, rest) = bytes.split_at(rows * d * dtype.size());
    let y = kiln::dtype::decode(dtype, y).unwrap();
    let floats: Vec<f32> = rest
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    // The partial rows summed in order, in f32, then rounded to the dtype, as reduce_cols does.
    let column_sums = |p: &[f32]| {
        let sums: Vec<f64> = (0..d)
            .map(|i| (0..grid).fold(0f32, |s, r| s + p[r * d + i]) as f64)
            .collect();
        q(dtype, sums)
    };
    let b_ref = lnorm.then_some(b.as_slice());
    if !vjp {
        return max_error(
            &y,
            &reference_forward(c.kind, &x, Some(&w), b_ref, d, c.eps),
        );
    }
    let (rdx, rdw, rdb) = reference_vjp(c.kind, &x, Some(&w), &g, d, c.eps);
    let mut err = max_error(&y, &rdx);
    err = err.max(max_error(&column_sums(&floats[..partial]), &rdw));
    if lnorm {
        err = err.max(max_error(&column_sums(&floats[partial..]), &rdb));
    }
    err
}

/// The host executable for `spec`: `run_norm.cpp` around its rendered source, whose static shared
/// arrays become statics (one block runs at a time, so its threads share them) and whose
/// dynamic ones the runner defines.
fn executable(cxx: &str, spec: &KernelSpec) -> std::path::PathBuf {
    let source = kiln::jit::template::render(spec)
        .unwrap()
        .source
        .replace("extern __shared__", "extern")
        .replace("__shared__", "static");
    let entry = format!("KILN_ENTRY={}", spec.template.kernel);
    let mut defines = vec![entry.as_str()];
    if spec.template.name == norm::VJP.name {
        defines.push("KILN_VJP");
    }
    host::executable(cxx, &source, "run_norm.cpp", &defines, spec)
}

/// Runs every case (`host::run_cases`); the failures.
fn run_all(cxx: &str, cases: &[Case], seed: u64) -> Vec<String> {
    host::run_cases(cases, |i, c| {
        let err = run(cxx, c, seed + i as u64);
        if err <= tolerance(c.spec.dtype) {
            return vec![];
        }
        vec![format!(
            "{} ({:?}) {}x{} eps {} outlier {:?}: {err:.3e}",
            c.spec, c.pass, c.rows, c.d, c.eps, c.outlier
        )]
    })
}

/// Whether this harness runs `spec` (the split-row kernels are `tests/host_norm_split.rs`'s).
fn one_row_a_group(spec: &KernelSpec) -> bool {
    spec.template.name == norm::FORWARD.name || spec.template.name == norm::VJP.name
}

/// Every spec the ops choose for contiguous rows of these lengths on Hopper (up to 16,384; past
/// that Hopper splits rows over clusters) and on Ampere (whose long rows take the ring or the
/// one-row-a-block kernels), each once, at the length that chose it: every dtype, both norms and
/// passes, aligned and unaligned rows, one-warp rows, rings, resident rows, shared sums, rows
/// over 12 warps (one barrier a row) and streamed rows.
#[test]
fn every_chosen_kernel_matches_the_reference_on_the_host() {
    let Some(cxx) = compiler() else {
        eprintln!("skipped: no C++ compiler");
        return;
    };
    const DS: [usize; 15] = [
        1, 3, 33, 200, 768, 1000, 2050, 3000, 4096, 5120, 7168, 10240, 16384, 20000, 40000,
    ];
    let mut seen = HashSet::new();
    let mut cases = Vec::new();
    for arch in [90, 80] {
        for dtype in DType::ALL {
            for &d in &DS {
                let rows = contiguous_rows(dtype, d);
                for pass in [Pass::Forward, Pass::Vjp] {
                    for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                        let gpu = Gpu::for_arch(arch);
                        let spec = norm::choose_spec(pass, kind, dtype, d, rows, Count::Many, gpu);
                        if one_row_a_group(&spec) && seen.insert(spec) {
                            let n = if d <= 4096 { 5 } else { 3 };
                            cases.push(Case {
                                spec,
                                kind,
                                pass,
                                d,
                                rows: n,
                                eps: 1e-5,
                                outlier: None,
                            });
                        }
                    }
                }
            }
        }
    }
    assert!(cases.len() > 50, "only {} kernels chosen", cases.len());
    let failures = run_all(&cxx, &cases, 1);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Every layout the bench's sweep measures (the candidates the choice rules are fitted from) for
/// the VJP of bf16 rows of 3,000 and 5,120 elements and of f16 and f32 rows of 5,120, and for
/// the forward of bf16 and f32 rows of 5,120, with an outlier far from the mean in every row and
/// eps 0: the statistics stay exact on all of them, chosen or not.
#[test]
fn sweep_candidates_match_the_reference_on_the_host() {
    let Some(cxx) = compiler() else {
        eprintln!("skipped: no C++ compiler");
        return;
    };
    let mut cases = Vec::new();
    let rows = [
        (Pass::Vjp, DType::BF16, 3000),
        (Pass::Vjp, DType::BF16, 5120),
        (Pass::Vjp, DType::F16, 5120),
        (Pass::Vjp, DType::F32, 5120),
        (Pass::Forward, DType::BF16, 5120),
        (Pass::Forward, DType::F32, 5120),
    ];
    for (pass, dtype, d) in rows {
        for kind in [Kind::LayerNorm, Kind::RmsNorm] {
            for spec in tuning::candidates(pass, kind, dtype, d) {
                cases.push(Case {
                    spec,
                    kind,
                    pass,
                    d,
                    rows: 3,
                    eps: 0.0,
                    outlier: Some(300.0),
                });
            }
        }
    }
    let failures = run_all(&cxx, &cases, 10_000);
    assert!(failures.is_empty(), "{failures:#?}");
}
