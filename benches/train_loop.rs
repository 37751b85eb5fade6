//! An asynchronous training-like loop (bf16 conv forward 8x32x32x64 -> LayerNorm -> its VJP ->
//! conv backward-data and backward-weight) that never synchronises: time per step, the memory
//! kiln holds, driver allocations and how commits launched their graphs, under the encoder's
//! bounds on work in flight (a sweep of KILN_MAX_COMMITS_IN_FLIGHT, "unbounded" being 10^6),
//! against the same loop synchronised every step.

#[path = "../tests/common/train_step.rs"]
mod train_step;

use std::sync::Arc;
use std::time::Instant;

use kiln::env::Config;
use kiln::runtime::{CommandEncoder, Device};

const WARMUP: usize = 1_000;
const STEPS: usize = 10_000;

struct Row {
    name: String,
    us_per_step: f64,
    held_mb: f64,
    driver_allocs: u64,
    stats: kiln::runtime::EncoderStats,
}

fn held(dev: &Arc<Device>) -> usize {
    let s = dev.allocator().stats();
    s.active + s.cached
}

fn run(dev: &Arc<Device>, name: &str, config: &Config, sync_every: usize, steps: usize) -> Row {
    let mut enc = CommandEncoder::with_config(dev, config).unwrap();
    let model = train_step::Model::new(&mut enc, 7);
    for i in 0..WARMUP {
        model.step(&mut enc);
        if (i + 1) % sync_every == 0 {
            enc.synchronize().unwrap();
        }
    }
    enc.synchronize().unwrap();
    let (allocs0, stats0) = (dev.allocator().stats().driver_allocs, enc.stats());
    let t = Instant::now();
    for i in 0..steps {
        model.step(&mut enc);
        if (i + 1) % sync_every == 0 {
            enc.synchronize().unwrap();
        }
    }
    let held_mb = held(dev) as f64 / (1 << 20) as f64;
    enc.synchronize().unwrap();
    let us_per_step = t.elapsed().as_secs_f64() * 1e6 / steps as f64;
    let s = enc.stats();
    let mut stats = s;
    stats.graph_commits -= stats0.graph_commits;
    stats.exec_reuses -= stats0.exec_reuses;
    stats.updates -= stats0.updates;
    stats.instantiations -= stats0.instantiations;
    stats.throttled_commits -= stats0.throttled_commits;
    Row {
        name: name.to_string(),
        us_per_step,
        held_mb,
        driver_allocs: dev.allocator().stats().driver_allocs - allocs0,
        stats,
    }
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    // Timings are of the kernels the ops choose: no cold-start stand-ins (see KILN_STAND_INS),
    // set before anything reads the environment.
    if std::env::var_os("KILN_STAND_INS").is_none() {
        std::env::set_var("KILN_STAND_INS", "0");
    }
    if let Ok(filter) = std::env::var("KILN_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let steps: usize = std::env::var("KILN_BENCH_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(STEPS);
    let dev = match Device::get(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("train_loop: skipped ({e})");
            return;
        }
    };
    let base = Config::from_env().unwrap();
    let mut rows = Vec::new();
    for repeat in 0..2 {
        let tag = |s: &str| format!("{s} #{}", repeat + 1);
        rows.push(run(
            &dev,
            &tag("graph, default bounds"),
            &base,
            usize::MAX,
            steps,
        ));
        rows.push(run(&dev, &tag("graph, sync every step"), &base, 1, steps));
        let mut direct = base.clone();
        direct.use_cuda_graphs = false;
        rows.push(run(
            &dev,
            &tag("direct, default bounds"),
            &direct,
            usize::MAX,
            steps,
        ));
        rows.push(run(
            &dev,
            &tag("direct, sync every step"),
            &direct,
            1,
            steps,
        ));
        for commits in [1usize, 2, 4, 8, 16, 64, 1_000_000] {
            let mut c = base.clone();
            c.max_commits_in_flight = commits;
            c.max_mb_in_flight = Some(usize::MAX >> 21); // no bound on bytes
            rows.push(run(
                &dev,
                &tag(&format!("graph, {commits} commits in flight")),
                &c,
                usize::MAX,
                steps,
            ));
        }
    }
    println!(
        "\n{:<38} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "loop (no sync unless said)",
        "us/step",
        "held MB",
        "allocs",
        "commits",
        "as is",
        "updates",
        "throttled"
    );
    for r in &rows {
        println!(
            "{:<38} {:>9.2} {:>9.1} {:>8} {:>8} {:>8} {:>8} {:>9}",
            r.name,
            r.us_per_step,
            r.held_mb,
            r.driver_allocs,
            r.stats.graph_commits,
            r.stats.exec_reuses,
            r.stats.updates,
            r.stats.throttled_commits
        );
    }
}
