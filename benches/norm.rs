//! LayerNorm / RMSNorm throughput against PyTorch on the usual model shapes, all
//! dtypes, in one run with the copy bandwidth they are held to. GB/s counted as
//! forward reads x and writes y; the VJP reads x and the cotangent and writes dx.
//!
//! Targets: forward >= 85% of copy bandwidth for d >= 768 and >= 1.3x PyTorch on every shape;
//! VJP >= 70% of copy bandwidth for d >= 768 and >= 1.5x PyTorch on every shape. `--long`
//! measures long rows instead (d from 3,000 to 131,072, about 2^25 elements and 16 rows of
//! each): forward >= 85% and VJP >= 75% of copy where rows x d >= 2^24, the same ratios to
//! PyTorch everywhere. Where PyTorch is so close to the copy bandwidth that the ratio would
//! exceed it (PyTorch x ratio > copy), 95% of copy stands in for the ratio.
//!
//! kiln is timed on the host around many calls (one synchronise at the end), so its figures
//! include any host time the GPU waits for; PyTorch is timed with CUDA events. The encoder runs
//! in the mode the environment sets (graph mode unless `MLX_USE_CUDA_GRAPHS=0`), printed in the
//! header: in graph mode independent calls may overlap, which stream order (direct mode, as
//! PyTorch runs) never does.
//! `--only TEXT` keeps the rows whose "ROWSxD dtype op" contains TEXT (e.g. `--only "bf16 layer_norm"`),
//! `--ops layer_norm,rms_norm` times those ops alone (of layer_norm, rms_norm, layer_norm_vjp and
//! rms_norm_vjp), `--no-anchor` skips PyTorch: all for comparing kernel variants quickly, not
//! for the targets.
//! `% sized` sets each row against a copy of its own traffic (half each way), not for a target:
//! it tells how much of a row's gap to the copy bandwidth is its size's alone.
//! `--twice` times every op twice and prints both, with the driver allocations each made.
//! `--long --ds 5001,50257` measures other row lengths the same way (held-out checks), and
//! `--rows 66,132` those counts of rows of each length instead of 2^25 elements and 16.
//! `--sweep` measures every candidate spec of the rows one block holds (with `--long`, the long
//! ones up to 32,768 elements, beside the spec the ops choose for fewer and for more rows than
//! SMs, and past 16,384 RMSNorm too; `--rms` RMSNorm at every length); `--sweep --split --long
//! [--dtype f32|f16|bf16]` every split-row layout of the longer rows, both norms, forward and
//! VJP. Both mark the spec the ops choose.

mod common;

use std::sync::Arc;
use std::time::Instant;

use kiln::ops::norm;
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::DType;

const SHAPES: [(usize, usize); 6] = [
    (16384, 768),
    (8192, 1024),
    (8192, 4096),
    (4096, 8192),
    (2048, 16384),
    (65536, 256),
];
/// `--long`: rows past what one block holds in registers, about 2^25 elements in all and 16 rows
/// of each length (rows x d below 2^24 are held to the ratio targets only).
const LONG_DS: [usize; 8] = [3000, 5120, 12288, 16385, 18432, 30000, 65536, 131072];

/// The comma-separated counts after `flag` (`--ds 5001,16385`), if it was given.
fn list_arg(flag: &str) -> Option<Vec<usize>> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == flag)?;
    let list = args.get(i + 1).map_or("", String::as_str);
    Some(
        list.split(',')
            .map(|n| {
                n.parse()
                    .unwrap_or_else(|_| panic!("{flag} takes counts, as 5001,16385"))
            })
            .collect(),
    )
}

/// The ops to time: all four, or those `--ops OP,OP` names.
fn ops_arg() -> Vec<&'static str> {
    const OPS: [&str; 4] = ["layer_norm", "rms_norm", "layer_norm_vjp", "rms_norm_vjp"];
    let args: Vec<String> = std::env::args().collect();
    let Some(i) = args.iter().position(|a| a == "--ops") else {
        return OPS.to_vec();
    };
    let list = args.get(i + 1).map_or("", String::as_str);
    list.split(',')
        .map(|name| {
            OPS.into_iter()
                .find(|op| *op == name)
                .unwrap_or_else(|| panic!("--ops takes names of {OPS:?}, not {name:?}"))
        })
        .collect()
}

/// The `--long` shapes; `--ds D,D,...` measures those row lengths instead of `LONG_DS`, and
/// `--rows R,R,...` those row counts instead of about 2^25 elements and 16.
fn long_shapes() -> Vec<(usize, usize)> {
    let ds = list_arg("--ds").unwrap_or_else(|| LONG_DS.to_vec());
    let counts = list_arg("--rows");
    ds.iter()
        .flat_map(|&d| match &counts {
            Some(counts) => counts.iter().map(|&r| (r, d)).collect::<Vec<_>>(),
            None => vec![(((1usize << 25) / d).max(1), d), (16, d)],
        })
        .collect()
}

/// Bytes of the copy every row is held to (each way).
const COPY_BYTES: usize = 1 << 28;
const SETS: usize = 4;
const ITERS: usize = 40;

fn seconds_per_call(
    enc: &mut CommandEncoder,
    mut call: impl FnMut(&mut CommandEncoder, usize),
) -> f64 {
    if std::env::args().any(|a| a == "--twice") {
        let allocs = |e: &CommandEncoder| e.device().allocator().stats().driver_allocs;
        let a0 = allocs(enc);
        let first = seconds_per_call_once(enc, &mut call);
        let a1 = allocs(enc);
        let second = seconds_per_call_once(enc, &mut call);
        let a2 = allocs(enc);
        println!(
            "  (twice: {:.1} us then {:.1} us; driver allocations {} then {})",
            first * 1e6,
            second * 1e6,
            a1 - a0,
            a2 - a1
        );
        return second;
    }
    seconds_per_call_once(enc, &mut call)
}

fn seconds_per_call_once(
    enc: &mut CommandEncoder,
    call: &mut impl FnMut(&mut CommandEncoder, usize),
) -> f64 {
    // Warm up for 100 ms in batches like the timed ones, so that the caching allocator holds
    // as many buffers as a batch keeps in flight before timing starts: warmed in batches of 8,
    // the first timed batches of 40 allocated from the driver (`--twice` showed f16 LayerNorm
    // 8192x1024 at 25.2 us per call with 40 driver allocations, then 12.7 us with none).
    let warm = Instant::now();
    while warm.elapsed().as_secs_f64() < 0.1 {
        for i in 0..ITERS {
            call(enc, i);
        }
        enc.synchronize().unwrap();
    }
    // Median of seven timed batches: with three, single rows moved by up to 15% between calls.
    let mut batches: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            for i in 0..ITERS {
                call(enc, i);
            }
            enc.synchronize().unwrap();
            t.elapsed().as_secs_f64() / ITERS as f64
        })
        .collect();
    batches.sort_by(|a, b| a.partial_cmp(b).unwrap());
    batches[batches.len() / 2]
}

/// GB/s (read and written) of kiln's memcpy node copying `bytes` (rounded down to whole words).
fn copy_gbs(dev: &Arc<Device>, enc: &mut CommandEncoder, bytes: usize) -> f64 {
    let n = bytes / 4 * 4;
    let src = Array::empty(dev, DType::F32, &[n / 4]).unwrap();
    let dst = Array::empty(dev, DType::F32, &[n / 4]).unwrap();
    let t = seconds_per_call(enc, |e, _| e.copy_into(&src, &dst).unwrap());
    2.0 * n as f64 / t / 1e9
}

/// Compiles `specs` on every core before a sweep times them, printing those that fail.
fn compile_all(enc: &CommandEncoder, specs: &[kiln::jit::KernelSpec]) {
    let jit = kiln::jit::Jit::global().unwrap();
    let target = enc.device().target();
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..std::thread::available_parallelism().map_or(4, |n| n.get()) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(spec) = specs.get(i) else { break };
                if let Err(e) = jit.compile(spec, target) {
                    println!("sweep: {spec} does not compile: {e}");
                }
            });
        }
    });
}

/// A sweep's operands: SETS inputs, which the timed calls take in turn, a cotangent and a weight.
type SweepOperands = (Vec<Array>, Array, Array);

/// A sweep's operands for `rows` x `d` in `dtype`.
fn sweep_operands(enc: &mut CommandEncoder, dtype: DType, rows: usize, d: usize) -> SweepOperands {
    let n = rows * d;
    let mut rng = TestRng::new(7);
    let x_values: Vec<Vec<f64>> = (0..SETS).map(|_| rng.values(n, 2.0, 0.0)).collect();
    let xs = upload_all(enc, dtype, &[rows, d], &x_values);
    let g = Array::from_f64(enc, dtype, &rng.values(n, 1.0, 0.0), &[rows, d]).unwrap();
    let w = Array::from_f64(enc, dtype, &rng.values(d, 1.0, 1.0), &[d]).unwrap();
    (xs, g, w)
}

/// A shape's random inputs, made once for every dtype (each rounds the same values): SETS x's
/// and cotangents, weights and bias, drawn in that order from one generator seeded by the shape.
/// Drawing them again per dtype took most of a `--long` run (2^25 elements an array).
struct ShapeValues {
    xs: Vec<Vec<f64>>,
    gs: Vec<Vec<f64>>,
    w: Vec<f64>,
    b: Vec<f64>,
}

impl ShapeValues {
    fn new(rows: usize, d: usize) -> Self {
        let n = rows * d;
        let mut rng = TestRng::new(rows as u64 ^ d as u64);
        let xs = (0..SETS).map(|_| rng.values(n, 2.0, 0.0)).collect();
        let gs = (0..SETS).map(|_| rng.values(n, 1.0, 0.0)).collect();
        let w = rng.values(d, 1.0, 1.0);
        let b = rng.values(d, 1.0, 0.0);
        ShapeValues { xs, gs, w, b }
    }
}

/// Arrays of `shape` holding each of `values` rounded to `dtype`, rounded on a thread each.
fn upload_all<V: AsRef<[f64]> + Sync>(
    enc: &mut CommandEncoder,
    dtype: DType,
    shape: &[usize],
    values: &[V],
) -> Vec<Array> {
    let bytes: Vec<Vec<u8>> = std::thread::scope(|s| {
        let threads: Vec<_> = values
            .iter()
            .map(|v| s.spawn(move || kiln::dtype::encode(dtype, v.as_ref())))
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    bytes
        .iter()
        .map(|b| Array::from_bytes(enc, dtype, shape, b).unwrap())
        .collect()
}

/// The spec the ops choose for `rows` contiguous rows of `d` elements on `enc`'s GPU.
fn chosen_spec(
    enc: &CommandEncoder,
    pass: norm::Pass,
    kind: norm::Kind,
    dtype: DType,
    rows: usize,
    d: usize,
) -> kiln::jit::KernelSpec {
    let count = norm::Count::of(rows, enc.device());
    chosen_for_count(enc, pass, kind, dtype, count, d)
}

/// The spec the ops choose for `count` contiguous rows of `d` elements on `enc`'s GPU.
fn chosen_for_count(
    enc: &CommandEncoder,
    pass: norm::Pass,
    kind: norm::Kind,
    dtype: DType,
    count: norm::Count,
    d: usize,
) -> kiln::jit::KernelSpec {
    let gpu = norm::Gpu::of(enc.device());
    let layout = norm::tuning::contiguous_rows(dtype, d);
    norm::choose_spec(pass, kind, dtype, d, layout, count, gpu)
}

/// `specs` with the specs the ops choose for few and many contiguous rows of `d` added where
/// missing: past one block's registers they choose by the count of rows (a block a row or a
/// cluster a row), and a sweep times both choices beside its candidates.
fn with_chosen(
    enc: &CommandEncoder,
    mut specs: Vec<kiln::jit::KernelSpec>,
    pass: norm::Pass,
    kind: norm::Kind,
    dtype: DType,
    d: usize,
) -> Vec<kiln::jit::KernelSpec> {
    for count in [norm::Count::Few, norm::Count::Many] {
        let spec = chosen_for_count(enc, pass, kind, dtype, count, d);
        if !specs.contains(&spec) {
            specs.push(spec);
        }
    }
    specs
}

/// One case of a sweep: rows x d, the norm and pass, and the specs to time on it.
type SweepCase = (
    usize,
    usize,
    norm::Kind,
    norm::Pass,
    Vec<kiln::jit::KernelSpec>,
);

/// `--sweep`'s cases: every candidate spec (`tuning::candidates`: threads per row, vectors per
/// thread, ring of stages, resident rows) of LayerNorm on the shapes that tune worst (with
/// `--long`, the long rows one block holds), to choose the policy in `choose_spec` from
/// measurements. `--stand-ins`: the cold-start stand-in (see KILN_STAND_INS) and the looped
/// kernel it is compiled from, fully optimised, beside the chosen kernel.
fn block_cases(enc: &CommandEncoder, dtype: DType) -> Vec<SweepCase> {
    use kiln::ops::norm::{tuning, Kind, Pass};
    let shapes: Vec<(usize, usize)> = if std::env::args().any(|a| a == "--long") {
        long_shapes()
            .into_iter()
            .filter(|&(rows, d)| (rows > 16 || list_arg("--rows").is_some()) && d <= 32768)
            .collect()
    } else {
        SHAPES.to_vec()
    };
    let mut cases = Vec::new();
    for &(rows, d) in &shapes {
        // Rows past one block's registers: RMSNorm too, whose ring holds no bias.
        let kinds: &[Kind] = if d > 16384 || std::env::args().any(|a| a == "--rms") {
            &[Kind::LayerNorm, Kind::RmsNorm]
        } else {
            &[Kind::LayerNorm]
        };
        for (&kind, pass) in kinds
            .iter()
            .flat_map(|k| [(k, Pass::Forward), (k, Pass::Vjp)])
        {
            let candidates = if std::env::args().any(|a| a == "--stand-ins") {
                let chosen = chosen_spec(enc, pass, kind, dtype, rows, d);
                let quick = norm::stand_in::spec(pass, kind, dtype, dtype.vec_width());
                let family = match pass {
                    Pass::Forward => &norm::FORWARD,
                    Pass::Vjp => &norm::VJP,
                };
                let looped = kiln::jit::KernelSpec {
                    template: family,
                    ..quick
                };
                vec![chosen, quick, looped]
            } else {
                with_chosen(
                    enc,
                    tuning::candidates(pass, kind, dtype, d),
                    pass,
                    kind,
                    dtype,
                    d,
                )
            };
            cases.push((rows, d, kind, pass, candidates));
        }
    }
    cases
}

/// `--sweep --split`'s cases: every split-row spec (`tuning::split_candidates`: vectors a
/// thread, cluster widths, the VJP's partial sums and pipelining) for the `--long` rows past one
/// block, both norms, forward and VJP, with the specs the ops choose for few and many rows.
fn split_cases(enc: &CommandEncoder, dtype: DType) -> Vec<SweepCase> {
    use kiln::ops::norm::{tuning, Kind, Pass};
    let mut cases = Vec::new();
    for (rows, d) in long_shapes()
        .into_iter()
        .filter(|&(rows, d)| rows > 16 && d > 16384)
    {
        for kind in [Kind::LayerNorm, Kind::RmsNorm] {
            for pass in [Pass::Forward, Pass::Vjp] {
                let split = tuning::split_candidates(pass, kind, dtype, d);
                let candidates = with_chosen(enc, split, pass, kind, dtype, d);
                cases.push((rows, d, kind, pass, candidates));
            }
        }
    }
    cases
}

/// How many clusters of a split spec the GPU holds at once on rows of `d` (the grid its launches
/// loop over); None for a spec without clusters.
fn cluster_slots(enc: &CommandEncoder, spec: &kiln::jit::KernelSpec, d: usize) -> Option<usize> {
    spec.constant("CLUSTER")?;
    let kernel = enc.device().kernel(spec).ok()?;
    let shared = kiln::ops::norm::tuning::ring_shared_bytes(spec, d);
    kernel.allow_shared(shared).ok()?;
    kernel
        .max_active_clusters(spec.block_dim as u32, shared)
        .ok()
}

/// `--sweep`: GB/s of each case's specs (`block_cases`, or with `--split` `split_cases`), in
/// `--dtype` (bf16 unless given), the spec the ops choose marked. `--only TEXT` keeps the cases
/// whose "ROWSxD Kind Pass" contains TEXT.
fn sweep(enc: &mut CommandEncoder, only: &str) {
    use kiln::ops::norm::{tuning, Kind, Pass};
    let args: Vec<String> = std::env::args().collect();
    let dtype = match args.iter().position(|a| a == "--dtype") {
        Some(i) => match args.get(i + 1).map(String::as_str) {
            Some("f32") => DType::F32,
            Some("f16") => DType::F16,
            Some("bf16") => DType::BF16,
            other => panic!("--dtype takes f32, f16 or bf16, not {other:?}"),
        },
        None => DType::BF16,
    };
    let cases: Vec<SweepCase> = if args.iter().any(|a| a == "--split") {
        split_cases(enc, dtype)
    } else {
        block_cases(enc, dtype)
    }
    .into_iter()
    .filter(|(rows, d, kind, pass, _)| format!("{rows}x{d} {kind:?} {pass:?}").contains(only))
    .collect();
    let specs: Vec<_> = cases.iter().flat_map(|c| c.4.iter().copied()).collect();
    compile_all(enc, &specs);
    let mut operands: Option<((usize, usize), SweepOperands)> = None;
    for (rows, d, kind, pass, candidates) in cases {
        // The cases of a shape follow one another: their operands are made once.
        if operands.as_ref().map(|o| o.0) != Some((rows, d)) {
            operands = Some(((rows, d), sweep_operands(enc, dtype, rows, d)));
        }
        let (xs, g, w) = &operands.as_ref().expect("made above").1;
        let b = (kind == Kind::LayerNorm).then_some(w);
        let bytes = (rows * d * dtype.size()) as f64;
        let chosen = chosen_spec(enc, pass, kind, dtype, rows, d);
        let run = |e: &mut CommandEncoder, i: usize, spec| match pass {
            Pass::Forward => {
                tuning::forward_with(e, kind, &xs[i % SETS], Some(w), b, 1e-5, spec).map(|_| ())
            }
            Pass::Vjp => {
                let x = &xs[i % SETS];
                tuning::vjp_with(e, kind, x, Some(w), b.is_some(), g, 1e-5, spec).map(|_| ())
            }
        };
        for spec in candidates {
            if let Err(e) = run(enc, 0, spec) {
                println!("sweep {rows}x{d} {kind:?} {pass:?} {spec}: {e}");
                continue;
            }
            let secs = seconds_per_call(enc, |e, i| run(e, i, spec).unwrap());
            let passes = if pass == Pass::Vjp { 3.0 } else { 2.0 };
            // The constants but RMS, which the kind gives.
            let consts: Vec<String> = spec
                .named_consts()
                .skip(1)
                .map(|(name, value)| format!("{name}={value}"))
                .collect();
            let slots =
                cluster_slots(enc, &spec, d).map_or(String::new(), |n| format!(" slots={n}"));
            println!(
                "sweep {rows}x{d} {dtype} {kind:?} {pass:?} {} {}: {:.0} GB/s{slots}{}",
                spec.template.name,
                consts.join(" "),
                passes * bytes / secs / 1e9,
                if spec == chosen { " <- chosen" } else { "" }
            );
        }
    }
}

fn main() {
    // Timings are of the kernels the ops choose: no cold-start stand-ins (see KILN_STAND_INS),
    // set before anything reads the environment.
    if std::env::var_os("KILN_STAND_INS").is_none() {
        std::env::set_var("KILN_STAND_INS", "0");
    }
    let dev = match kiln::runtime::gpus() {
        Ok(g) if !g.is_empty() => Device::get(0).unwrap(),
        _ => {
            println!("norm bench: no GPU, skipped");
            return;
        }
    };
    let mut enc = CommandEncoder::new(&dev).unwrap();
    let (only, no_anchor) = common::variant_flags();
    if std::env::args().any(|a| a == "--sweep") {
        sweep(&mut enc, &only);
        return;
    }
    let long = std::env::args().any(|a| a == "--long");
    let shapes = if long { long_shapes() } else { SHAPES.to_vec() };
    let copy = copy_gbs(&dev, &mut enc, COPY_BYTES);
    let mode = if enc.uses_graphs() {
        "graph mode"
    } else {
        "direct mode"
    };
    let shape_args: Vec<String> = shapes.iter().map(|(r, d)| format!("{r},{d}")).collect();
    let torch = if no_anchor {
        None
    } else {
        common::run_anchor("norm_torch.py", &shape_args)
    };
    let torch_copy = torch.as_ref().and_then(|t| t["copy_gbs"].as_f64());
    println!(
        "norm bench on {}, kiln in {mode}: copy bandwidth {copy:.0} GB/s (kiln memcpy node){}",
        dev.info().name,
        torch_copy.map_or(String::new(), |c| format!(", {c:.0} GB/s (PyTorch copy_)"))
    );
    println!(
        "{:<12} {:<5} {:<15} {:>9} {:>7} {:>7} {:>9} {:>7}  verdict",
        "shape", "dtype", "op", "kiln GB/s", "% copy", "% sized", "torch", "ratio"
    );
    let mut misses = 0;
    // Sized copies by bytes each way: ops and dtypes of the same traffic share one timing.
    let mut sized_copies: std::collections::HashMap<usize, f64> = Default::default();
    let ops = ops_arg();
    for &(rows, d) in &shapes {
        let wanted_in = |dtype: DType, op: &str| {
            ops.contains(&op) && format!("{rows}x{d} {dtype} {op}").contains(&only)
        };
        if !DType::ALL
            .into_iter()
            .any(|t| ops.iter().any(|op| wanted_in(t, op)))
        {
            continue; // no inputs to make
        }
        let values = ShapeValues::new(rows, d);
        for dtype in DType::ALL {
            let wanted = |op: &str| wanted_in(dtype, op);
            if !ops.iter().any(|op| wanted(op)) {
                continue; // no inputs to make
            }
            let xs = upload_all(&mut enc, dtype, &[rows, d], &values.xs);
            let gs = upload_all(&mut enc, dtype, &[rows, d], &values.gs);
            let [w, b] = upload_all(&mut enc, dtype, &[d], &[&values.w, &values.b][..])
                .try_into()
                .unwrap();
            let bytes = (rows * d * dtype.size()) as f64;
            let mut runs: Vec<(&str, f64, f64)> = Vec::new();
            if wanted("layer_norm") {
                let secs = seconds_per_call(&mut enc, |e, i| {
                    norm::layer_norm(e, &xs[i % SETS], Some(&w), Some(&b), 1e-5).unwrap();
                });
                runs.push(("layer_norm", 2.0, secs));
            }
            if wanted("rms_norm") {
                let secs = seconds_per_call(&mut enc, |e, i| {
                    norm::rms_norm(e, &xs[i % SETS], Some(&w), 1e-5).unwrap();
                });
                runs.push(("rms_norm", 2.0, secs));
            }
            if wanted("layer_norm_vjp") {
                let secs = seconds_per_call(&mut enc, |e, i| {
                    norm::layer_norm_vjp(e, &xs[i % SETS], Some(&w), Some(&b), &gs[i % SETS], 1e-5)
                        .unwrap();
                });
                runs.push(("layer_norm_vjp", 3.0, secs));
            }
            if wanted("rms_norm_vjp") {
                let secs = seconds_per_call(&mut enc, |e, i| {
                    norm::rms_norm_vjp(e, &xs[i % SETS], Some(&w), &gs[i % SETS], 1e-5).unwrap();
                });
                runs.push(("rms_norm_vjp", 3.0, secs));
            }
            for (op, passes, secs) in runs {
                let gbs = passes * bytes / secs / 1e9;
                // A copy of the op's own traffic (half of it each way): a smaller copy may itself
                // run below the 256 MiB figure, so this tells how much of the gap is the size's.
                let sized = *sized_copies
                    .entry((passes / 2.0 * bytes) as usize)
                    .or_insert_with_key(|&n| copy_gbs(&dev, &mut enc, n));
                let torch_gbs = torch
                    .as_ref()
                    .and_then(|t| t[format!("{rows}x{d} {dtype} {op}")].as_f64())
                    .map(|s| passes * bytes / s / 1e9);
                let vjp = op.ends_with("vjp");
                let (bw_target, ratio_target) = match (vjp, long) {
                    (true, false) => (0.70, 1.5),
                    (true, true) => (0.75, 1.5),
                    (false, _) => (0.85, 1.3),
                };
                let held_to_copy = if long { rows * d >= 1 << 24 } else { d >= 768 };
                let mut verdict = Vec::new();
                if held_to_copy && gbs < bw_target * copy {
                    verdict.push(format!("< {:.0}% copy", bw_target * 100.0));
                }
                if let Some(t) = torch_gbs {
                    // A ratio past the copy bandwidth cannot be met: 95% of copy stands in.
                    let beyond_copy = ratio_target * t > copy;
                    if beyond_copy && gbs < 0.95 * copy {
                        verdict.push(format!("< 95% copy ({ratio_target}x torch > copy)"));
                    } else if !beyond_copy && gbs < ratio_target * t {
                        verdict.push(format!("< {ratio_target}x torch"));
                    }
                }
                if !verdict.is_empty() {
                    misses += 1;
                }
                println!(
                    "{:<12} {:<5} {:<15} {:>9.0} {:>6.0}% {:>6.0}% {:>9} {:>7}  {}",
                    format!("{rows}x{d}"),
                    dtype.name(),
                    op,
                    gbs,
                    100.0 * gbs / copy,
                    100.0 * gbs / sized,
                    torch_gbs.map_or("-".into(), |t| format!("{t:.0}")),
                    torch_gbs.map_or("-".into(), |t| format!("{:.2}x", gbs / t)),
                    if verdict.is_empty() {
                        "met".to_string()
                    } else {
                        verdict.join(", ")
                    }
                );
            }
        }
    }
    println!("{misses} rows miss a target");
}
