//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod conv_cases;
pub mod host;

use std::path::Path;

use kiln::env::{CacheMode, Config};
use kiln::jit::Jit;

/// A JIT over its own cache directory, configured like the environment but for the cache.
pub fn jit_with(dir: &Path, mode: CacheMode, max_bytes: u64) -> Jit {
    let mut config = Config::from_env().expect("environment parses");
    config.cache_dir = Some(dir.to_path_buf());
    config.cache_mode = mode;
    config.cache_max_bytes = max_bytes;
    Jit::new(config)
}

pub fn jit_in(dir: &Path) -> Jit {
    jit_with(dir, CacheMode::On, 1 << 30)
}

/// The `kiln` binary: `KILN_BIN`, else cargo's build, else `../bin/kiln` beside the staged test
/// executable (the layout `.gpu/` uses on the GPU machine).
pub fn kiln_bin() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("KILN_BIN") {
        return p.into();
    }
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kiln"));
    if built.exists() {
        return built;
    }
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("bin").join("kiln"))
        .expect("staged layout")
}

/// The GPUs, or `None` after printing that the test is skipped. With `KILN_REQUIRE_GPU=1` a
/// missing GPU fails the test instead.
pub fn gpus_or_skip(test: &str) -> Option<Vec<kiln::runtime::GpuInfo>> {
    // The GPU tests check the kernel each op chooses: stand-ins off unless KILN_STAND_INS says
    // (the stand-in tests make JITs of their own). Set once, before any test touches the driver.
    static STAND_INS: std::sync::Once = std::sync::Once::new();
    STAND_INS.call_once(|| {
        if std::env::var_os("KILN_STAND_INS").is_none() {
            std::env::set_var("KILN_STAND_INS", "0");
        }
    });
    match kiln::runtime::gpus() {
        Ok(g) if !g.is_empty() => Some(g),
        other => {
            let why = match other {
                Ok(_) => "no GPU".to_string(),
                Err(e) => e.to_string(),
            };
            if kiln::env::require_gpu().unwrap_or_else(|e| panic!("{test}: {e}")) {
                panic!("{test}: KILN_REQUIRE_GPU=1 but {why}");
            }
            eprintln!("{test}: skipped ({why})");
            None
        }
    }
}

pub mod train_step;
