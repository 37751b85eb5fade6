//! JIT figures: NVRTC start-up, cold compile per spec (kiln vs raw NVRTC on the same source),
//! disk hit (render + key + read + verify, then module load) and memory hit (kernel table).
//!
//! Run: `cargo bench --bench jit` (or `.gpu/run.sh benches` on the GPU machine). Targets (on the
//! H100 machine): cold compile <= 30 ms for a norm spec and <= 150 ms for a convolution spec,
//! disk hit <= 0.3 ms, memory hit <= 200 ns.

use std::hint::black_box;
use std::time::{Duration, Instant};

use kiln::env::{CacheMode, Config};
use kiln::jit::{Jit, KernelSpec, KernelTable, Target};
use kiln::DType;

fn jit(dir: &std::path::Path, mode: CacheMode) -> Jit {
    let mut config = Config::from_env().expect("environment parses");
    config.cache_dir = Some(dir.to_path_buf());
    config.cache_mode = mode;
    Jit::new(config)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn row(what: &str, kiln: f64, anchor: Option<(&str, f64)>, unit: &str, target: Option<f64>) {
    let anchor_s = anchor.map_or(String::from("-"), |(n, a)| format!("{a:.4} {unit} ({n})"));
    let ratio = anchor.map_or(String::from("-"), |(_, a)| format!("{:.2}x", kiln / a));
    let verdict = target.map_or(String::from(""), |t| {
        format!(
            "target <= {t} {unit}: {}",
            if kiln <= t { "met" } else { "MISSED" }
        )
    });
    println!("{what:<44} {kiln:>10.4} {unit:<3} | {anchor_s:<34} | {ratio:>6} | {verdict}");
}

fn main() {
    // `cargo bench` passes --bench; nothing else is taken.
    // CUDA 13's NVRTC keeps its own cache of compiled programs (~/.nv/ComputeCache, across
    // processes): with it, a "cold" compile of a source compiled before is a lookup.
    std::env::set_var("CUDA_CACHE_DISABLE", "1");
    let dir = tempfile::tempdir().unwrap();
    let target = kiln::runtime::gpus()
        .ok()
        .and_then(|g| g.first().map(|g| g.target()))
        .unwrap_or(Target::sass(90));
    // LayerNorm forward specialisations, one per (dtype, threads per row, items).
    let gpu = kiln::ops::norm::Gpu::for_arch(target.arch);
    let specs: Vec<KernelSpec> = kiln::ops::norm::specs(gpu)
        .into_iter()
        .filter(|s| s.template.name == "norm_fwd" && s.consts[0] == 0 && s.n_reads > 1)
        .take(24)
        .collect();
    println!("kiln jit bench: target {target}, {} specs", specs.len());
    println!(
        "{:<44} {:>14} | {:<34} | {:>6} |",
        "what", "kiln", "anchor", "ratio"
    );

    // NVRTC start-up: loading the library, then the first compile in the process.
    let t = Instant::now();
    let cold = jit(dir.path(), CacheMode::Off);
    let nvrtc = cold.nvrtc().expect("NVRTC");
    let load = t.elapsed();
    let t = Instant::now();
    let first = kiln::ops::axpby::spec(DType::F32);
    cold.compile(&first, target).unwrap();
    let first_compile = t.elapsed();
    println!("NVRTC {} at {}", nvrtc.version_string(), nvrtc.path);
    row("NVRTC library load", ms(load), None, "ms", None);
    row(
        "first compile in process (NVRTC start-up)",
        ms(first_compile),
        None,
        "ms",
        None,
    );

    // Cold compile per spec, and raw NVRTC on the same source and options (the anchor).
    let mut kiln_ms = Vec::new();
    let mut raw_ms = Vec::new();
    for spec in &specs {
        let t = Instant::now();
        let c = cold.compile(spec, target).unwrap();
        kiln_ms.push(ms(t.elapsed()));
        let mut options = c.entry.parts.options.clone();
        options.push(target.nvrtc_option());
        let t = Instant::now();
        let out = nvrtc
            .compile(
                spec.template.name,
                &c.entry.parts.source,
                &c.entry.parts.name_expressions,
                &options,
                false,
            )
            .unwrap();
        raw_ms.push(ms(t.elapsed()));
        assert!(out.is_ok());
    }
    row(
        "cold compile per spec (median)",
        median(kiln_ms),
        Some(("raw NVRTC", median(raw_ms))),
        "ms",
        Some(30.0),
    );

    // Cold compile per convolution spec, by family: a spread of each family's registered specs.
    for family in ["conv_wgmma", "conv_igemm"] {
        let all: Vec<KernelSpec> = kiln::ops::conv::specs(target.arch)
            .into_iter()
            .filter(|s| s.template.name == family)
            .collect();
        if all.is_empty() {
            continue;
        }
        let step = (all.len() / 12).max(1);
        let mut times: Vec<f64> = all
            .iter()
            .step_by(step)
            .map(|spec| {
                let t = Instant::now();
                cold.compile(spec, target).unwrap();
                ms(t.elapsed())
            })
            .collect();
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let worst = *times.last().unwrap();
        row(
            &format!("cold compile, {family} ({} specs): median", times.len()),
            median(times),
            None,
            "ms",
            Some(150.0),
        );
        row(
            &format!("  {family}: slowest"),
            worst,
            None,
            "ms",
            Some(150.0),
        );
    }

    // Fill a disk cache, then measure hits from a fresh JIT (empty memory) per request.
    let warm_dir = tempfile::tempdir().unwrap();
    let filler = jit(warm_dir.path(), CacheMode::On);
    for spec in &specs {
        filler.compile(spec, target).unwrap();
    }
    let mut key_ms = Vec::new();
    let mut hit_ms = Vec::new();
    for _ in 0..5 {
        for spec in &specs {
            let fresh = jit(warm_dir.path(), CacheMode::On);
            let t = Instant::now();
            black_box(fresh.key_parts(spec, target).unwrap().key());
            key_ms.push(ms(t.elapsed()));
            let fresh = jit(warm_dir.path(), CacheMode::On);
            let t = Instant::now();
            let c = fresh.compile(spec, target).unwrap();
            hit_ms.push(ms(t.elapsed()));
            assert_eq!(c.origin, kiln::jit::Origin::Disk);
        }
    }
    row("  render + key", median(key_ms), None, "ms", None);
    row(
        "disk hit: render + key + read + verify",
        median(hit_ms.clone()),
        None,
        "ms",
        None,
    );

    let gpus = kiln::runtime::gpus().unwrap_or_default();
    let Some(gpu) = gpus.first() else {
        println!("no GPU: module load and memory hit not measured");
        return;
    };
    let ctx = cudarc::driver::CudaContext::new(gpu.ordinal).unwrap();
    let mut load_ms = Vec::new();
    let mut raw_load_ms = Vec::new();
    for _ in 0..5 {
        for spec in &specs {
            let fresh = jit(warm_dir.path(), CacheMode::On);
            let table = KernelTable::new();
            let t = Instant::now();
            let k = table.get_or_load(&fresh, &ctx, target, spec).unwrap();
            load_ms.push(ms(t.elapsed()));
            // Anchor: the driver alone loading the same cubin and looking up the function.
            let image = fresh.compile(spec, target).unwrap().entry.image.clone();
            let t = Instant::now();
            let m = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(image))
                .unwrap();
            black_box(m.load_function(spec.template.kernel).unwrap());
            raw_load_ms.push(ms(t.elapsed()));
            drop(k);
        }
    }
    row(
        "disk hit + module load (fresh JIT and table)",
        median(load_ms),
        Some(("cuModuleLoadData + get", median(raw_load_ms))),
        "ms",
        Some(0.3),
    );

    // Memory hit: the table lookup an op does on every call.
    let table = KernelTable::new();
    let warm = jit(warm_dir.path(), CacheMode::On);
    for spec in &specs {
        table.get_or_load(&warm, &ctx, target, spec).unwrap();
    }
    let iters = 2_000_000;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for i in 0..iters {
            let spec = &specs[i % specs.len()];
            black_box(table.get(gpu.ordinal, black_box(spec)));
        }
        best = best.min(t.elapsed().as_secs_f64() * 1e9 / iters as f64);
    }
    row(
        "memory hit (kernel table lookup)",
        best,
        None,
        "ns",
        Some(200.0),
    );
}
