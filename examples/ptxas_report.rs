//! Prints ptxas's resource report (registers, spills, shared memory) for chosen norm specs.
//! Usage: cargo run --example ptxas_report [sm_90]
use kiln::jit::{Jit, Target};
use kiln::ops::norm::{choose_spec, Kind, Pass};
use kiln::DType;

fn main() {
    let target: Target = std::env::args()
        .nth(1)
        .unwrap_or("sm_90".into())
        .parse()
        .unwrap();
    let jit = Jit::new(kiln::env::Config::from_env().unwrap());
    let nvrtc = jit.nvrtc().unwrap();
    for (pass, kind, dtype, d) in [
        (Pass::Forward, Kind::LayerNorm, DType::F32, 768),
        (Pass::Forward, Kind::LayerNorm, DType::BF16, 768),
        (Pass::Forward, Kind::RmsNorm, DType::BF16, 768),
        (Pass::Forward, Kind::LayerNorm, DType::BF16, 4096),
        (Pass::Forward, Kind::LayerNorm, DType::BF16, 16384),
        (Pass::Vjp, Kind::LayerNorm, DType::F32, 768),
        (Pass::Vjp, Kind::LayerNorm, DType::BF16, 768),
        (Pass::Vjp, Kind::LayerNorm, DType::BF16, 4096),
        (Pass::Vjp, Kind::LayerNorm, DType::BF16, 16384),
    ] {
        let spec = choose_spec(pass, kind, dtype, d, true);
        let parts = jit.key_parts(&spec, target).unwrap();
        let mut options = parts.options.clone();
        options.push(target.nvrtc_option());
        options.push("--ptxas-options=-v".into());
        let out = nvrtc
            .compile("r", &parts.source, &parts.name_expressions, &options, false)
            .unwrap();
        let log = match out {
            Ok(o) => o.log,
            Err(f) => f.log,
        };
        let info: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("Used") || l.contains("spill"))
            .collect();
        println!("d={d:<6} {spec}\n    {}", info.join("\n    "));
    }
}
