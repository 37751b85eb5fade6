//! The `kiln` command: fill the kernel cache ahead of time, inspect it, check a GPU.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::{Instant, SystemTime};

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use kiln::jit::entry::Entry;
use kiln::jit::{Jit, Target};

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "kiln: JIT-compiled CUDA kernels with a disk cache"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compile every kernel kiln's ops can use into the disk cache.
    Warm {
        /// Target architecture, e.g. sm_80 or sm_90 (repeatable). Default: each local GPU's,
        /// or sm_90 when there is none.
        #[arg(long = "arch", value_name = "ARCH")]
        arch: Vec<String>,
        /// Parallel compiles (default: the number of CPUs).
        #[arg(long)]
        jobs: Option<usize>,
        /// Only specs whose description contains this text (e.g. "bf16" or "layer_norm_fwd").
        #[arg(long, value_name = "TEXT")]
        only: Option<String>,
        /// Also rebuild, for each --arch, every module the cache holds for another target
        /// (applications' kernels included), from the source each entry records.
        #[arg(long)]
        from_cache: bool,
        /// Print the summary as one JSON object on the last line.
        #[arg(long)]
        json: bool,
    },
    /// Inspect or maintain the disk cache.
    Cache {
        #[command(subcommand)]
        action: CacheAction,
    },
    /// NVRTC, GPUs, the cache and the environment variables in effect.
    Info {
        #[arg(long)]
        json: bool,
    },
    /// Run LayerNorm through the JIT on every GPU and compare with a CPU reference.
    Check {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum CacheAction {
    /// Print the cache directory.
    Path,
    /// Entry count, bytes and cap.
    Stats {
        #[arg(long)]
        json: bool,
    },
    /// List entries.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Re-check every entry; remove bad ones. Exit status 1 if any was bad.
    Verify {
        #[arg(long)]
        json: bool,
    },
    /// Write every good entry (of each --arch, when given) to one bundle file.
    Export {
        file: std::path::PathBuf,
        /// Only entries for this architecture, e.g. sm_90 (repeatable).
        #[arg(long = "arch", value_name = "ARCH")]
        arch: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Publish a bundle's entries into the cache, each verified as on load; damaged ones are
    /// reported and left out (exit status 1).
    Import {
        file: std::path::PathBuf,
        /// Only entries for this architecture, e.g. sm_90 (repeatable).
        #[arg(long = "arch", value_name = "ARCH")]
        arch: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Remove every entry.
    Clear,
    /// Enforce the size cap and remove temp files left by crashed writers.
    Gc {
        #[arg(long)]
        json: bool,
    },
}

/// `println!` that ends the process quietly when stdout is closed (`kiln cache ls | head`).
macro_rules! out {
    ($($arg:tt)*) => { emit(format_args!($($arg)*)) };
}

fn emit(args: std::fmt::Arguments) {
    use std::io::Write;
    if let Err(e) = writeln!(std::io::stdout().lock(), "{args}") {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("kiln: writing to stdout: {e}");
        std::process::exit(2);
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KILN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if matches!(cli.command, Command::Check { .. }) && std::env::var_os("KILN_STAND_INS").is_none()
    {
        // The check is of the kernels the ops choose, not of the cold-start stand-ins; set
        // before the JIT reads the environment, while this is the only thread.
        std::env::set_var("KILN_STAND_INS", "0");
    }
    let jit = match Jit::global() {
        Ok(j) => j,
        Err(e) => {
            eprintln!("kiln: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Warm {
            arch,
            jobs,
            only,
            from_cache,
            json,
        } => warm(jit, &arch, jobs, only.as_deref(), from_cache, json),
        Command::Cache { action } => cache(jit, action),
        Command::Info { json } => info(jit, json),
        Command::Check { json } => check(json),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kiln: {e}");
            ExitCode::from(2)
        }
    }
}

fn warm(
    jit: &Jit,
    arch: &[String],
    jobs: Option<usize>,
    only: Option<&str>,
    from_cache: bool,
    json: bool,
) -> kiln::Result<ExitCode> {
    let started = Instant::now();
    let mut targets: Vec<Target> = arch
        .iter()
        .map(|a| a.parse())
        .collect::<kiln::Result<_>>()?;
    if targets.is_empty() {
        targets = kiln::runtime::gpus()
            .map(|gpus| gpus.iter().map(|g| g.target()).collect())
            .unwrap_or_default();
    }
    if targets.is_empty() {
        targets.push(Target::sass(90));
    }
    targets.sort();
    targets.dedup();
    // Without NVRTC, warm still finds what the cache holds (any NVRTC's entries); with it, a
    // target it cannot serve fails early, with the full explanation.
    let nvrtc = jit.nvrtc();
    if let (true, Err(e)) = (from_cache, &nvrtc) {
        return Err(kiln::Error::InvalidArgument {
            arg: "--from-cache",
            reason: format!("rebuilding cached modules for another target needs NVRTC: {e}"),
        });
    }
    if nvrtc.is_ok() {
        for &t in &targets {
            jit.check_target(t)?;
        }
    }
    let nvrtc_version = nvrtc
        .as_ref()
        .map_or("none".to_string(), |n| n.version_string());

    // Each target gets what the ops choose on it: under KILN_EMULATE_ARCH, on the older
    // architecture whose code paths the process will run.
    let emulate = jit.config().emulate_arch;
    let work: Vec<_> = targets
        .iter()
        .flat_map(|&t| {
            let arch = emulate.map_or(t.arch, |e| e.min(t.arch));
            kiln::ops::registered_specs_for(arch)
                .into_iter()
                .filter(|s| only.map_or(true, |text| s.to_string().contains(text)))
                .filter(move |s| s.builds_for(t.arch))
                .map(move |s| (s, t))
        })
        .collect();
    let bar = if json || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(work.len() as u64).with_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} {msg} [{elapsed}]")
                .expect("static template"),
        )
    };
    let mut report = jit.warm(&work, jobs.unwrap_or(0), &|_| bar.inc(1));
    if from_cache {
        // Rebuilt after the registered specs, so that those are not compiled twice.
        bar.set_length(0);
        bar.set_position(0);
        let rebuilt = jit.warm_from_cache(&targets, jobs.unwrap_or(0), &|p| {
            bar.set_length(p.total as u64);
            bar.inc(1)
        });
        report.absorb(rebuilt);
    }
    bar.finish_and_clear();
    let specs = report.specs;
    let gc = jit.disk_cache().gc();
    let failures = &report.failures;
    let seconds = started.elapsed().as_secs_f64();
    let targets: Vec<String> = targets.iter().map(|t| t.to_string()).collect();
    let summary = json!({
        "targets": targets,
        "specs": specs,
        "compiled": report.compiled,
        "cached": report.cached,
        "failed": failures.len(),
        "seconds": (seconds * 1000.0).round() / 1000.0,
        "jobs": report.jobs,
        "nvrtc": nvrtc_version,
        "cache_dir": jit.disk_cache().root().display().to_string(),
        "cache_writable": jit.disk_cache().is_writable(),
        "cache_entries": gc.remaining_entries,
        "cache_bytes": gc.remaining_bytes,
    });
    match &nvrtc {
        Ok(_) => {
            for f in failures {
                eprintln!("failed: {f}");
            }
        }
        // Every miss fails alike: say why once.
        Err(e) if !failures.is_empty() => {
            eprintln!(
                "kiln: {} of {} kernels are not in the cache, and compiling them needs NVRTC: {e}",
                failures.len(),
                specs
            );
            return Ok(ExitCode::from(2));
        }
        Err(_) => {}
    }
    if !json {
        out!(
            "warmed {} kernels for {} with NVRTC {} in {:.1} s: {} compiled, {} already cached, {} failed",
            specs,
            targets.join(", "),
            nvrtc_version,
            seconds,
            summary["compiled"],
            summary["cached"],
            failures.len()
        );
        out!(
            "cache: {} ({} entries, {})",
            jit.disk_cache().root().display(),
            gc.remaining_entries,
            human_bytes(gc.remaining_bytes)
        );
    }
    if json {
        out!("{summary}");
    }
    Ok(if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn cache(jit: &Jit, action: CacheAction) -> kiln::Result<ExitCode> {
    let disk = jit.disk_cache();
    match action {
        CacheAction::Path => out!("{}", disk.root().display()),
        CacheAction::Stats { json } => {
            let files = disk.entry_files();
            let bytes: u64 = files.iter().map(|f| f.bytes).sum();
            let stats = json!({
                "dir": disk.root().display().to_string(),
                "mode": disk.mode().name(),
                "writable": disk.is_writable(),
                "entries": files.len(),
                "bytes": bytes,
                "max_bytes": disk.max_bytes(),
            });
            if json {
                out!("{stats}");
            } else {
                out!("dir:      {}", disk.root().display());
                out!(
                    "mode:     {}{}",
                    disk.mode().name(),
                    if disk.is_writable() {
                        ""
                    } else {
                        " (not writable)"
                    }
                );
                out!("entries:  {}", files.len());
                out!(
                    "size:     {} of {} cap",
                    human_bytes(bytes),
                    human_bytes(disk.max_bytes())
                );
            }
        }
        CacheAction::Ls { json } => {
            let mut files = disk.entry_files();
            files.sort_by_key(|f| std::cmp::Reverse(f.modified));
            for f in files {
                let entry = std::fs::read(&f.path)
                    .ok()
                    .and_then(|b| Entry::decode(&b, f.key.as_ref()).ok());
                let (spec, target, kind) = match &entry {
                    Some(e) => (e.spec.clone(), e.parts.target.clone(), e.image_kind.name()),
                    None => (
                        "(unreadable: run `kiln cache verify`)".into(),
                        "?".into(),
                        "?",
                    ),
                };
                let key = f.key.map(|k| k.hex()).unwrap_or_default();
                if json {
                    out!(
                        "{}",
                        json!({"key": key, "bytes": f.bytes, "target": target, "image": kind,
                               "spec": spec, "age_s": age_seconds(f.modified)})
                    );
                } else {
                    out!(
                        "{} {:>9} {:<8} {:<5} {}",
                        &key[..16.min(key.len())],
                        f.bytes,
                        target,
                        kind,
                        spec
                    );
                }
            }
        }
        CacheAction::Verify { json } => {
            let report = disk.verify();
            if json {
                out!("{}", serde_json::to_string(&report).expect("serialisable"));
            } else {
                for (path, why) in &report.bad {
                    out!("bad: {path}: {why} (removed)");
                }
                out!(
                    "checked {} entries: {} ok, {} bad",
                    report.checked,
                    report.ok,
                    report.bad.len()
                );
            }
            if !report.bad.is_empty() {
                return Ok(ExitCode::FAILURE);
            }
        }
        CacheAction::Export { file, arch, json } => {
            let report = kiln::jit::bundle::export(disk, &file, &archs(&arch)?)?;
            return bundle_summary("exported", &file, &report, json);
        }
        CacheAction::Import { file, arch, json } => {
            let report = kiln::jit::bundle::import(disk, &file, &archs(&arch)?)?;
            return bundle_summary("imported", &file, &report, json);
        }
        CacheAction::Clear => {
            let n = disk.clear()?;
            out!("removed {n} entries from {}", disk.root().display());
        }
        CacheAction::Gc { json } => {
            let report = disk.gc();
            if json {
                out!("{}", serde_json::to_string(&report).expect("serialisable"));
            } else {
                out!(
                    "evicted {} entries ({}), removed {} stale temp files; {} entries ({}) remain",
                    report.evicted,
                    human_bytes(report.evicted_bytes),
                    report.temp_files_removed,
                    report.remaining_entries,
                    human_bytes(report.remaining_bytes)
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Architecture numbers of `--arch` values (`sm_90`, `sm_90a` and `compute_90` are all 90).
fn archs(values: &[String]) -> kiln::Result<Vec<u32>> {
    values
        .iter()
        .map(|a| a.parse::<Target>().map(|t| t.arch))
        .collect()
}

fn bundle_summary(
    verb: &str,
    file: &std::path::Path,
    report: &kiln::jit::bundle::BundleReport,
    json: bool,
) -> kiln::Result<ExitCode> {
    if json {
        out!("{}", serde_json::to_string(report).expect("serialisable"));
    } else {
        for (place, why) in &report.damaged {
            out!("damaged: {place}: {why} (left out)");
        }
        out!(
            "{verb} {} entries ({} already present, {} other architectures, {} damaged): {}",
            report.entries,
            report.already_present,
            report.skipped_arch,
            report.damaged.len(),
            file.display()
        );
    }
    Ok(if report.damaged.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn info(jit: &Jit, json: bool) -> kiln::Result<ExitCode> {
    let nvrtc = match jit.nvrtc() {
        Ok(n) => json!({"found": true, "path": n.path, "version": n.version_string(),
                        "sass_archs": n.supported_archs}),
        Err(e) => json!({"found": false, "error": e.to_string()}),
    };
    // NCCL is only needed for several GPUs: its absence is information, not an error.
    let nccl_lib = kiln::env::Config::from_env()?.nccl_lib;
    let nccl = match kiln::dist::Nccl::get(nccl_lib.as_deref()) {
        Ok(n) => json!({"found": true, "path": n.path, "version": n.version_string()}),
        Err(e) => json!({"found": false, "error": e.to_string()}),
    };
    // The driver's CUDA version and whether it loads this NVRTC's output (only with a driver).
    let driver = kiln::jit::compat::driver_version().map(|d| {
        let loads = jit
            .nvrtc()
            .ok()
            .map(|n| format!("{:?}", kiln::jit::compat::loadable(n.version, d)).to_lowercase());
        json!({"cuda_version": format!("{}.{}", d.0, d.1), "loads_nvrtc_output": loads})
    });
    let gpus = match kiln::runtime::gpus() {
        Ok(g) => json!(g),
        Err(e) => json!({"error": e.to_string()}),
    };
    let disk = jit.disk_cache();
    let files = disk.entry_files();
    let env: serde_json::Map<String, serde_json::Value> = kiln::env::VARIABLES
        .iter()
        .filter_map(|v| std::env::var(v).ok().map(|val| (v.to_string(), json!(val))))
        .collect();
    let info = json!({
        "kiln": env!("CARGO_PKG_VERSION"),
        "nvrtc": nvrtc,
        "nccl": nccl,
        "driver": driver,
        "gpus": gpus,
        "cache": {
            "dir": disk.root().display().to_string(),
            "mode": disk.mode().name(),
            "writable": disk.is_writable(),
            "entries": files.len(),
            "bytes": files.iter().map(|f| f.bytes).sum::<u64>(),
            "max_bytes": disk.max_bytes(),
        },
        "registered_specs": kiln::ops::registered_specs().len(),
        "env": env,
    });
    if json {
        out!("{info}");
    } else {
        out!(
            "{}",
            serde_json::to_string_pretty(&info).expect("serialisable")
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn check(json: bool) -> kiln::Result<ExitCode> {
    let Some(results) = kiln::selfcheck::run()? else {
        let required = kiln::env::require_gpu()?;
        if json {
            out!("{}", json!({"skipped": "no GPU", "passed": !required}));
        } else {
            out!("check skipped: no GPU on this machine");
        }
        return Ok(if required {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        });
    };
    let passed = results.iter().all(|r| r.passed);
    for r in &results {
        if json {
            out!("{}", serde_json::to_string(r).expect("serialisable"));
        } else {
            out!(
                "{} gpu{} {:<20} {:<60} {:<22} {:<8} load {:>8.3} ms  max err {:.2e}",
                if r.passed { "ok  " } else { "FAIL" },
                r.gpu,
                r.op,
                r.spec,
                r.shape,
                format!("{:?}", r.origin).to_lowercase(),
                r.load_ms,
                r.max_error
            );
        }
    }
    let failed = results.iter().filter(|r| !r.passed).count();
    if json {
        out!(
            "{}",
            json!({"checks": results.len(), "failed": failed, "passed": passed})
        );
    } else {
        out!("self-check: {} checks, {} failed", results.len(), failed);
    }
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn age_seconds(t: SystemTime) -> u64 {
    t.elapsed().map(|d| d.as_secs()).unwrap_or(0)
}
