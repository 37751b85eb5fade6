//! Times NVRTC on registered specs, with extra options.
//! Usage: compile_time TARGET TEXT EVERY[+OFFSET] [OPTION ...]: every EVERY-th spec (from the
//! OFFSET-th, default 0) of TARGET's warm set (`kiln warm --arch TARGET`) whose description
//! contains TEXT, compiled for TARGET with the OPTIONs added; prints each spec's time, registers
//! and cubin size (and NVRTC's errors for a spec that does not compile), then the median, the
//! total and the failures (exit status 1 if any). An OPTION `--cubin=DIR` is not NVRTC's: it
//! writes each spec's cubin into DIR (to compare the machine code two sets of options give,
//! with `cuobjdump -sass`).
use kiln::jit::{Jit, Target};
use kiln::Error;
use std::time::Instant;

fn main() -> kiln::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        eprintln!("usage: compile_time TARGET TEXT EVERY[+OFFSET] [OPTION ...]");
        std::process::exit(2);
    }
    let target: Target = args[0].parse()?;
    let only = &args[1];
    // EVERY+OFFSET picks one of EVERY disjoint shards, so shards can run as separate processes.
    let (every, offset) = match args[2].split_once('+') {
        Some((e, o)) => (e.parse::<usize>(), o.parse::<usize>()),
        None => (args[2].parse::<usize>(), Ok(0)),
    };
    let (every, offset) = match (every, offset) {
        (Ok(e), Ok(o)) if e > 0 && o < e => (e, o),
        _ => {
            return Err(Error::InvalidArgument {
                arg: "EVERY[+OFFSET]",
                reason: format!(
                    "{:?} is not a count of 1 or more, optionally with an offset below it",
                    args[2]
                ),
            })
        }
    };
    let cubins = args[3..]
        .iter()
        .find_map(|a| a.strip_prefix("--cubin="))
        .map(str::to_owned);
    let extra: Vec<&String> = args[3..]
        .iter()
        .filter(|a| !a.starts_with("--cubin="))
        .collect();
    let jit = Jit::new(kiln::env::Config::from_env()?);
    let nvrtc = jit.nvrtc()?;
    // What `kiln warm --arch TARGET` compiles: the specs kiln's ops choose on that architecture.
    let specs: Vec<_> = kiln::ops::registered_specs_for(target.arch)
        .into_iter()
        .filter(|s| s.to_string().contains(only.as_str()) && s.builds_for(target.arch))
        .skip(offset)
        .step_by(every)
        .collect();
    let mut times = Vec::new();
    let mut failed = 0;
    for spec in specs {
        let target = jit.resolve_target(&spec, target)?;
        let parts = jit.key_parts(&spec, target)?;
        let mut options = parts.options.clone();
        options.push(target.nvrtc_option());
        options.push("--ptxas-options=-v".into());
        options.extend(extra.iter().map(|o| o.to_string()));
        let start = Instant::now();
        let out = nvrtc.compile("r", &parts.source, &parts.name_expressions, &options, false)?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let (log, size) = match out {
            Ok(o) => {
                if let Some(dir) = &cubins {
                    let file = format!("{dir}/{}.cubin", spec.to_string().replace(' ', "_"));
                    std::fs::write(&file, &o.image).map_err(|e| Error::Io {
                        context: "writing a cubin",
                        path: file.into(),
                        source: std::sync::Arc::new(e),
                    })?;
                }
                (o.log, o.image.len())
            }
            Err(f) => {
                // A spec that does not compile is what matters most here: say so, with why.
                println!("FAILED {spec}:");
                for l in f.log.lines().filter(|l| l.contains("error")) {
                    println!("    {l}");
                }
                failed += 1;
                (f.log, 0)
            }
        };
        let regs: Vec<String> = log
            .lines()
            .filter_map(|l| l.split("Used ").nth(1))
            .map(|r| r.split(' ').next().unwrap_or("").to_string())
            .collect();
        for l in log
            .lines()
            .filter(|l| l.contains("arn") || l.contains("erial"))
        {
            println!("    {l}");
        }
        let spills = log.lines().filter(|l| l.contains(" 0 bytes spill")).count();
        let lines = log.lines().filter(|l| l.contains("spill")).count();
        println!(
            "{ms:8.1} ms  regs {:<12} spill-free {spills}/{lines}  cubin {size:>7}  {spec}",
            regs.join(",")
        );
        times.push(ms);
    }
    if times.is_empty() {
        println!("no registered spec for {target} contains {only:?}");
        return Ok(());
    }
    times.sort_by(f64::total_cmp);
    let total: f64 = times.iter().sum();
    println!(
        "specs {}  median {:.1} ms  max {:.1} ms  total {:.1} s  failed {failed}",
        times.len(),
        times[times.len() / 2],
        times[times.len() - 1],
        total / 1e3
    );
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
