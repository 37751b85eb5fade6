//! Prints ptxas's resource report (registers, spills, shared memory) for registered specs.
//! Usage: cargo run --example ptxas_report [sm_90] [TEXT]: specs whose description contains TEXT
//! (default: the norm forward and VJP kernels). `--candidates`: the f16, bf16 and f32 candidates
//! of the norm bench's `--sweep` (both norms, rows of 768 to 16,384) instead of the registered
//! specs; `--tf32`: the Hopper convolution family's f32 (`KILN_ALLOW_TF32`) specs, which
//! `kiln warm` leaves to first use;
//! `--multipliers`: the grouped family's channel-multiplier specs, likewise; `--split`: the
//! split-row norm layouts `--sweep --split --long` times (f16, bf16 and f32). `--cubin=DIR` also
//! writes each spec's cubin into DIR (for `cuobjdump --dump-sass`).
use kiln::jit::{Jit, Target};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1).filter(|a| !a.starts_with("--"));
    let target: Target = args.next().unwrap_or("sm_90".into()).parse()?;
    let only = args.next().unwrap_or("norm_".into());
    let jit = Jit::new(kiln::env::Config::from_env()?);
    let nvrtc = jit.nvrtc()?;
    let specs = if std::env::args().any(|a| a == "--candidates") {
        use kiln::ops::norm::{tuning, Kind, Pass};
        let mut all = Vec::new();
        for dtype in [kiln::DType::F16, kiln::DType::BF16, kiln::DType::F32] {
            for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                for d in [768, 1024, 3000, 4096, 5120, 8192, 10240, 12288, 16384] {
                    for pass in [Pass::Forward, Pass::Vjp] {
                        all.extend(tuning::candidates(pass, kind, dtype, d));
                    }
                }
            }
        }
        all.sort_by_key(|s| s.to_string());
        all.dedup();
        all
    } else if std::env::args().any(|a| a == "--split") {
        // Every split-row layout `--sweep --split --long` times, both norms and passes, 16-bit
        // and f32, on rows of 18,432 and 65,536 elements.
        use kiln::ops::norm::{tuning, Kind, Pass};
        let mut all = Vec::new();
        for dtype in [kiln::DType::F16, kiln::DType::BF16, kiln::DType::F32] {
            for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                for d in [18432, 65536] {
                    for pass in [Pass::Forward, Pass::Vjp] {
                        all.extend(tuning::split_candidates(pass, kind, dtype, d));
                    }
                }
            }
        }
        all.sort_by_key(|s| s.to_string());
        all.dedup();
        all
    } else if std::env::args().any(|a| a == "--tf32") {
        use kiln::ops::conv::{hopper, Pass};
        let mut all = Vec::new();
        for pass in Pass::ALL {
            for t in hopper::tiles(kiln::DType::F32, pass) {
                all.push(hopper::spec(kiln::DType::F32, pass, t, 2));
            }
        }
        all
    } else if std::env::args().any(|a| a == "--multipliers") {
        // The grouped family's channel-multiplier specs (3x3 at strides 1 and 2; backward-data
        // gathers 2x2 phases at stride 2), which `kiln warm` leaves to first use.
        use kiln::ops::conv::{grouped, Pass};
        let mut all = Vec::new();
        for dtype in [kiln::DType::F16, kiln::DType::BF16] {
            for pass in Pass::ALL {
                for mul in [2, 4] {
                    for cg in [2, 4, 8, 16] {
                        if !grouped::takes_multiplier(cg, mul) {
                            continue;
                        }
                        for s in [1, 2] {
                            let shape = grouped::Shape::square(pass, cg, mul, 3, s);
                            all.push(grouped::spec(dtype, pass, shape));
                        }
                    }
                }
            }
        }
        all
    } else {
        kiln::ops::registered_specs()
    };
    for spec in specs {
        if !spec.to_string().contains(&only) {
            continue;
        }
        if !spec.builds_for(target.arch) {
            continue;
        }
        let target = jit.resolve_target(&spec, target)?;
        let parts = jit.key_parts(&spec, target)?;
        let mut options = parts.options.clone();
        options.push(target.nvrtc_option());
        options.push("--ptxas-options=-v".into());
        let out = nvrtc.compile("r", &parts.source, &parts.name_expressions, &options, false)?;
        let log = match out {
            Ok(o) => {
                if let Some(dir) = cubin_dir() {
                    let file = format!("{dir}/{}.cubin", spec.to_string().replace(' ', "_"));
                    std::fs::write(file, &o.image)?;
                }
                o.log
            }
            Err(f) => f.log,
        };
        let info: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("Used") || l.contains("spill") || l.contains("error"))
            .map(|l| l.trim())
            .collect();
        println!("{spec}\n    {}", info.join("\n    "));
    }
    Ok(())
}

/// `--cubin=DIR`: where to write each spec's cubin (for cuobjdump), if given.
fn cubin_dir() -> Option<String> {
    std::env::args().find_map(|a| a.strip_prefix("--cubin=").map(str::to_owned))
}
