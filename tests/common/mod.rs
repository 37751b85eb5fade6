//! Helpers shared by the integration tests.
#![allow(dead_code)]

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
