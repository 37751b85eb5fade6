//! The split-row LayerNorm and RMSNorm kernels (a thread-block cluster a row:
//! `templates/norm_fwd_split.cu`, `norm_fwd_staged.cu`, `norm_vjp_split.cu`) compiled for the
//! host as plain C++ and run a cluster at a time, its blocks' threads as OS threads
//! (`tests/host/cuda_host_cluster.h`: distributed shared memory, mbarriers, `st.async`, bulk
//! copies and cluster barriers emulated), against the f64 reference with the GPU tests'
//! tolerance: their chunks' index arithmetic, shifted columns, the exchanges' protocol (a count
//! of bytes or arrivals that is off hangs or aborts), rows claimed at run time, and bounds
//! (AddressSanitizer; shared memory past the launch's size poisoned), without a GPU. Copies
//! land at once, so memory ordering and speed stay the GPU tests' and benches' part. Skipped
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

/// One launch to check: a split spec on `rows` rows of `d` elements, on `clusters` clusters.
#[derive(Clone, Copy, Debug)]
struct Case {
    spec: KernelSpec,
    kind: Kind,
    pass: Pass,
    d: usize,
    rows: usize,
    clusters: usize,
    /// Whether the staged forward gets a rows' counter (claims its rows at run time).
    counted: bool,
}

fn q(dtype: DType, v: Vec<f64>) -> Vec<f64> {
    kiln::dtype::decode(dtype, &kiln::dtype::encode(dtype, &v)).unwrap()
}

fn constant(spec: &KernelSpec, name: &str) -> usize {
    spec.constant(name).expect("a split spec's constant") as usize
}

fn is_split(spec: &KernelSpec) -> bool {
    [
        norm::FORWARD_SPLIT.name,
        norm::FORWARD_STAGED.name,
        norm::VJP_SPLIT.name,
    ]
    .contains(&spec.template.name)
}

/// Whether `spec` shifts its columns onto the granules (rows that do not start on one).
fn shifted(spec: &KernelSpec) -> bool {
    spec.template.name == norm::FORWARD_STAGED.name && constant(spec, "SHIFTED") == 1
}

/// Rows after which contiguous rows of `d` start as far into their 16-byte granules as the first
/// (the ops make shifted kernels' grids a multiple of it).
fn granule_period(dtype: DType, d: usize) -> usize {
    let bytes = d * dtype.size() % 16;
    if bytes == 0 {
        1
    } else {
        16 >> bytes.trailing_zeros()
    }
}

/// A case: two clusters, or the granule period's where the columns are shifted, the first of
/// which takes two rows; with `counted`, the staged forward with unshifted columns claims its
/// rows past the fixed first ones.
fn case(spec: KernelSpec, kind: Kind, pass: Pass, d: usize, counted: bool) -> Case {
    let counted = counted && spec.template.name == norm::FORWARD_STAGED.name && !shifted(&spec);
    let clusters = if shifted(&spec) {
        granule_period(spec.dtype, d)
    } else {
        2
    };
    // Claimed rows: past the fixed first turns (LEAD = 4 a cluster). Otherwise the first
    // cluster takes two rows.
    let rows = if counted {
        4 * clusters + 2
    } else {
        clusters + 1
    };
    Case {
        spec,
        kind,
        pass,
        d,
        rows,
        clusters,
        counted,
    }
}

/// Runs `c` through the host build of its kernel; the worst error over its outputs, and the rows'
/// counter as the kernel left it.
fn run(cxx: &str, c: &Case, seed: u64) -> (f64, u64) {
    let (dtype, d, rows) = (c.spec.dtype, c.d, c.rows);
    let mut rng = TestRng::new(seed);
    let x = q(dtype, rng.values(rows * d, 2.0, 0.5));
    let w = q(dtype, rng.values(d, 1.0, 1.0));
    let b = q(dtype, rng.values(d, 0.5, 0.0));
    let g = q(dtype, rng.values(rows * d, 1.0, 0.0));
    let w_vec = (tuning::contiguous_rows(dtype, d) == Rows::Aligned) as i32;
    let lnorm = c.kind == Kind::LayerNorm;
    let vjp = c.pass == Pass::Vjp;
    let blocks = c.clusters * constant(&c.spec, "CLUSTER");
    let shared = tuning::ring_shared_bytes(&c.spec, d);

    let mut input = Vec::new();
    input.extend_from_slice(&(blocks as u32).to_le_bytes());
    input.extend_from_slice(&(c.spec.block_dim as u32).to_le_bytes());
    input.extend_from_slice(&(shared as u64).to_le_bytes());
    input.extend_from_slice(&(rows as i64).to_le_bytes());
    input.extend_from_slice(&(d as i32).to_le_bytes());
    input.extend_from_slice(&1e-5f32.to_le_bytes());
    input.extend_from_slice(&(d as i64).to_le_bytes()); // x's row stride
    input.extend_from_slice(&(d as i64).to_le_bytes()); // the cotangent's
    input.extend_from_slice(&1i64.to_le_bytes()); // the weight's stride
    input.extend_from_slice(&w_vec.to_le_bytes());
    input.extend_from_slice(&1i64.to_le_bytes()); // the bias's
    input.extend_from_slice(&w_vec.to_le_bytes());
    input.extend_from_slice(&0i32.to_le_bytes()); // smem_partials (the split VJP ignores it)
    input.extend_from_slice(&(c.counted as i32).to_le_bytes());
    let encode = |v: &[f64]| kiln::dtype::encode(dtype, v);
    push_bytes(&mut input, &encode(&x));
    push_bytes(&mut input, &encode(&w));
    push_bytes(&mut input, &if lnorm && !vjp { encode(&b) } else { vec![] });
    push_bytes(&mut input, &if vjp { encode(&g) } else { vec![] });
    input.extend_from_slice(&((rows * d * dtype.size()) as u64).to_le_bytes());
    // One partial row of dweight (and dbias) a cluster.
    let partial = if vjp { c.clusters * d } else { 0 };
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
        "{} on {rows}x{d}, {} clusters: the host run failed:\n{}",
        c.spec,
        c.clusters,
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&outp).unwrap();
    let (y, rest) = bytes.split_at(rows * d * dtype.size());
    let y = kiln::dtype::decode(dtype, y).unwrap();
    let (rest, counter) = rest.split_at(rest.len() - 8);
    let counter = u64::from_le_bytes(counter.try_into().unwrap());
    let floats: Vec<f32> = rest
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    // The partial rows summed in order, in f32, then rounded to the dtype, as reduce_cols does.
    let column_sums = |p: &[f32]| {
        let sums: Vec<f64> = (0..d)
            .map(|i| (0..c.clusters).fold(0f32, |s, r| s + p[r * d + i]) as f64)
            .collect();
        q(dtype, sums)
    };
    let b_ref = lnorm.then_some(b.as_slice());
    if !vjp {
        let reference = reference_forward(c.kind, &x, Some(&w), b_ref, d, 1e-5);
        return (max_error(&y, &reference), counter);
    }
    let (rdx, rdw, rdb) = reference_vjp(c.kind, &x, Some(&w), &g, d, 1e-5);
    let mut err = max_error(&y, &rdx);
    err = err.max(max_error(&column_sums(&floats[..partial]), &rdw));
    if lnorm {
        err = err.max(max_error(&column_sums(&floats[partial..]), &rdb));
    }
    (err, counter)
}

/// The rendered source of `spec` with its shared memory declarations as the host harness's:
/// `__shared__ TYPE NAME[...];` becomes a reference into the block's arena
/// (`kiln_host_shared`), `extern __shared__ ... TYPE NAME[];` a pointer to its dynamic shared
/// memory.
fn host_source(spec: &KernelSpec) -> String {
    let source = kiln::jit::template::render(spec).unwrap().source;
    let mut out = String::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap();
        let indent = &line[..line.len() - line.trim_start().len()];
        let trimmed = code.trim();
        let rewritten = if let Some(rest) = trimmed.strip_prefix("extern __shared__ ") {
            let rest = match rest.strip_prefix("__align__(") {
                Some(r) => r.split_once(") ").unwrap().1,
                None => rest,
            };
            let decl = rest.strip_suffix("[];").expect("a dynamic shared array");
            let (ty, name) = decl.rsplit_once(' ').unwrap();
            format!("{indent}{ty}* {name} = reinterpret_cast<{ty}*>(kiln_host_dynamic_shared());")
        } else if let Some(rest) = trimmed.strip_prefix("__shared__ ") {
            let decl = rest
                .strip_suffix(';')
                .expect("one shared declaration a line");
            let (head, dims) = decl.split_at(decl.find('[').unwrap_or(decl.len()));
            let (ty, name) = head.trim_end().rsplit_once(' ').unwrap();
            format!(
                "{indent}using kiln_shared_{name} = {ty} {dims}; \
                 kiln_shared_{name}& {name} = kiln_host_shared<kiln_shared_{name}>();"
            )
        } else {
            line.to_string()
        };
        assert!(
            !rewritten.split("//").next().unwrap().contains("__shared__"),
            "a shared declaration the harness does not take: {line}"
        );
        out.push_str(&rewritten);
        out.push('\n');
    }
    out
}

/// The host executable for `spec`: `run_norm_split.cpp` around `host_source`.
fn executable(cxx: &str, spec: &KernelSpec) -> std::path::PathBuf {
    let entry = format!("KILN_ENTRY={}", spec.template.kernel);
    let mut defines = vec![entry.as_str()];
    if spec.template.name == norm::VJP_SPLIT.name {
        defines.push("KILN_VJP");
    }
    if spec.template.name == norm::FORWARD_STAGED.name {
        defines.push("KILN_STAGED");
    }
    host::executable(
        cxx,
        &host_source(spec),
        "run_norm_split.cpp",
        &defines,
        spec,
    )
}

/// Runs every case (`host::run_cases`); the failures.
fn run_all(cxx: &str, cases: &[Case], seed: u64) -> Vec<String> {
    host::run_cases(cases, |i, c| {
        let (err, counter) = run(cxx, c, seed + i as u64);
        let what = format!(
            "{} ({:?}) {}x{} on {} clusters{}",
            c.spec,
            c.pass,
            c.rows,
            c.d,
            c.clusters,
            if c.counted { ", rows claimed" } else { "" }
        );
        let mut failures = Vec::new();
        if err > tolerance(c.spec.dtype) {
            failures.push(format!("{what}: error {err:.3e}"));
        }
        if counter != 0 {
            failures.push(format!(
                "{what}: the rows' counter left at {counter}, not zero"
            ));
        }
        failures
    })
}

/// Every split spec the ops choose on Hopper for a few rows of these lengths, each once: both
/// norms and passes, aligned rows and rows of odd length (the staged forward's shifted columns,
/// two blocks an SM at 16,385), clusters of 2 to 16 blocks (16: the VJP's pushes a block), the
/// fixed rows and rows claimed at run time. Every dtype at the shortest lengths; f16 shares its
/// code with bf16 but for the conversions, and the longest rows (thousands of threads a
/// cluster) take the longest, so the longer ones run in fewer dtypes.
#[test]
fn chosen_split_kernels_match_the_reference_on_the_host() {
    let Some(cxx) = compiler() else {
        eprintln!("skipped: no C++ compiler");
        return;
    };
    const DS: [(usize, &[DType]); 4] = [
        (16_385, &DType::ALL),
        (18_432, &DType::ALL),
        (40_960, &[DType::F32, DType::BF16]),
        (131_072, &[DType::BF16]),
    ];
    let gpu = Gpu::for_arch(90);
    let mut seen = HashSet::new();
    let mut cases = Vec::new();
    for (d, dtypes) in DS {
        for &dtype in dtypes {
            let layout = tuning::contiguous_rows(dtype, d);
            for pass in [Pass::Forward, Pass::Vjp] {
                for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                    let spec = norm::choose_spec(pass, kind, dtype, d, layout, Count::Few, gpu);
                    if is_split(&spec) && seen.insert(spec) {
                        cases.push(case(spec, kind, pass, d, true));
                    }
                }
            }
        }
    }
    let width = |c: &Case| constant(&c.spec, "CLUSTER");
    assert!(
        cases.len() >= 12,
        "only {} split kernels chosen",
        cases.len()
    );
    assert!(cases.iter().any(|c| shifted(&c.spec)), "no shifted columns");
    assert!(cases.iter().any(|c| c.counted), "no rows claimed");
    assert!(
        cases.iter().any(|c| width(c) == 16),
        "no cluster of 16 blocks"
    );
    let failures = run_all(&cxx, &cases, 1);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The split VJP's layouts the bench's sweep measures (`tuning::split_candidates`) for rows of
/// 18,432: partial sums in registers or shared memory (SMEM_SUMS) and each way of overlapping
/// rows (PIPELINE 0, 1 and 2), chosen or not, each in the narrowest cluster it comes in.
#[test]
fn split_vjp_candidates_match_the_reference_on_the_host() {
    let Some(cxx) = compiler() else {
        eprintln!("skipped: no C++ compiler");
        return;
    };
    let mut cases = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        for kind in [Kind::LayerNorm, Kind::RmsNorm] {
            let mut specs = tuning::split_candidates(Pass::Vjp, kind, dtype, 18_432);
            specs.sort_by_key(|s| constant(s, "CLUSTER"));
            let mut seen = HashSet::new();
            for spec in specs {
                let way = (constant(&spec, "SMEM_SUMS"), constant(&spec, "PIPELINE"));
                if seen.insert(way) {
                    cases.push(case(spec, kind, Pass::Vjp, 18_432, false));
                }
            }
        }
    }
    for (name, values) in [("SMEM_SUMS", [0, 1].as_slice()), ("PIPELINE", &[0, 1, 2])] {
        for &v in values {
            let found = cases.iter().any(|c| constant(&c.spec, name) == v);
            assert!(found, "no candidate with {name}={v}");
        }
    }
    let failures = run_all(&cxx, &cases, 20_000);
    assert!(failures.is_empty(), "{failures:#?}");
}
