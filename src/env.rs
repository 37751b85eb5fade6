//! Every environment variable kiln reads, parsed in one place.
//!
//! Parsing takes a lookup function so that tests can feed it a map instead of the process
//! environment.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// `KILN_CACHE`: whether the disk cache is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheMode {
    /// Read and write (the default).
    On,
    /// Memory only: no disk access at all.
    Off,
    /// Read existing entries, never write, evict or delete.
    ReadOnly,
}

impl CacheMode {
    /// The canonical spelling, as `KILN_CACHE` takes it: `on`, `off` or `ro`.
    pub fn name(self) -> &'static str {
        match self {
            CacheMode::On => "on",
            CacheMode::Off => "off",
            CacheMode::ReadOnly => "ro",
        }
    }
}

/// `KILN_CONV_PATH`: which convolution kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvPath {
    /// The Hopper kernels (TMA + wgmma) where they apply, `mma.sync` elsewhere (the default).
    Auto,
    /// The `mma.sync` / FMA implicit GEMM everywhere, as on GPUs before Hopper.
    Igemm,
}

impl ConvPath {
    /// The spelling `KILN_CONV_PATH` takes: `auto` or `igemm`.
    pub fn name(self) -> &'static str {
        match self {
            ConvPath::Auto => "auto",
            ConvPath::Igemm => "igemm",
        }
    }
}

/// `KILN_CACHE_MAX_BYTES` when unset: 1 GiB.
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 1 << 30;
/// `MLX_CUDA_GRAPH_CACHE_SIZE` when unset: graph executables each encoder keeps.
pub const DEFAULT_GRAPH_CACHE_SIZE: usize = 400;
/// `MLX_CUDA_CONV_CACHE_SIZE` when unset: convolution plans kept.
pub const DEFAULT_CONV_CACHE_SIZE: usize = 128;
/// `KILN_MAX_COMMITS_IN_FLIGHT` when unset.
pub const DEFAULT_MAX_COMMITS_IN_FLIGHT: usize = 2;
/// As PyTorch's NCCL watchdog: ten minutes.
pub const DEFAULT_NCCL_TIMEOUT_S: f64 = 600.0;

/// The settings kiln takes from the environment.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// `KILN_CACHE_DIR`; `None` means the platform cache directory.
    pub cache_dir: Option<PathBuf>,
    /// `KILN_CACHE` = on | off | ro.
    pub cache_mode: CacheMode,
    /// `KILN_CACHE_MAX_BYTES`: size cap of the disk cache (suffixes K, M, G accepted).
    pub cache_max_bytes: u64,
    /// `KILN_NVRTC_LIB`: an explicit path to libnvrtc.
    pub nvrtc_lib: Option<PathBuf>,
    /// `MLX_USE_CUDA_GRAPHS` (default true).
    pub use_cuda_graphs: bool,
    /// `MLX_CUDA_GRAPH_CACHE_SIZE` (default 400).
    pub graph_cache_size: usize,
    /// `MLX_MAX_OPS_PER_BUFFER`; `None` means the per-architecture default.
    pub max_ops_per_buffer: Option<usize>,
    /// `MLX_MAX_MB_PER_BUFFER`; `None` means the per-architecture default.
    pub max_mb_per_buffer: Option<usize>,
    /// `MLX_CUDA_CONV_CACHE_SIZE` (default 128).
    pub conv_cache_size: usize,
    /// `KILN_MAX_COMMITS_IN_FLIGHT`: commits an encoder may have launched and unfinished before
    /// the next commit waits for the oldest.
    pub max_commits_in_flight: usize,
    /// `KILN_MAX_MB_IN_FLIGHT`: megabytes those commits may touch (counted as
    /// `MLX_MAX_MB_PER_BUFFER` counts them); `None` means four commits' worth.
    pub max_mb_in_flight: Option<usize>,
    /// `KILN_CONV_PATH` = auto | igemm.
    pub conv_path: ConvPath,
    /// `KILN_CONV_AUTOTUNE` (default false): time a few Hopper tiles on a plan's first use and
    /// keep the fastest in the disk cache.
    pub conv_autotune: bool,
    /// `KILN_ALLOW_TF32` (default false): f32 convolutions may multiply as one TF32 product
    /// (11 bits of each operand kept) instead of three, on sm_80 and later. About three times
    /// the tensor-core throughput, at about TF32's accuracy (relative errors near 1e-3).
    pub allow_tf32: bool,
    /// `KILN_EMULATE_ARCH` = sm_XY: run the code paths kiln takes on that older architecture
    /// (and its shared-memory limit) on a newer GPU, to test them where no such GPU is at hand.
    /// Holds the architecture as compute capability x 10 (75 for sm_75).
    pub emulate_arch: Option<u32>,
    /// `KILN_NCCL_LIB`: an explicit path to libnccl.
    pub nccl_lib: Option<PathBuf>,
    /// `KILN_NCCL_TIMEOUT`: seconds a wait on collectives (or a communicator's set-up) may last
    /// before the communicator is aborted and the wait returns an error.
    pub nccl_timeout_s: f64,
    /// `KILN_NCCL_CHECK` (default true): check that the ranks called matching collectives.
    pub nccl_check: bool,
    /// `KILN_COMPILE_THREADS`: threads that compile, in the background, the kernels a call's
    /// next calls will likely need (default: one per CPU; 0: none, every compile is made by
    /// the call that needs it).
    pub compile_threads: usize,
    /// `KILN_STAND_INS` (default true): while a call's kernel compiles in the background, run
    /// the call on a stand-in, a generic kernel of the same op that compiles in a fraction of
    /// the time and serves every shape (see `jit::stand_in`). Needs background compiles
    /// (`KILN_COMPILE_THREADS` > 0); false: the call waits for its own kernel.
    pub stand_ins: bool,
    /// `KILN_DEPENDENT_LAUNCH` (default true): in direct mode on sm_90 and later, the kernels
    /// that wait for their predecessor in their own code (the norms') launch with programmatic
    /// dependent launch, so that their start overlaps the previous kernel's end.
    pub dependent_launch: bool,
}

/// Every variable kiln reads, for `kiln info`.
pub const VARIABLES: &[&str] = &[
    "KILN_CACHE_DIR",
    "KILN_CACHE",
    "KILN_CACHE_MAX_BYTES",
    "KILN_NVRTC_LIB",
    "KILN_REQUIRE_GPU",
    "KILN_LOG",
    "MLX_USE_CUDA_GRAPHS",
    "MLX_CUDA_GRAPH_CACHE_SIZE",
    "MLX_MAX_OPS_PER_BUFFER",
    "MLX_MAX_MB_PER_BUFFER",
    "MLX_CUDA_CONV_CACHE_SIZE",
    "KILN_MAX_COMMITS_IN_FLIGHT",
    "KILN_MAX_MB_IN_FLIGHT",
    "KILN_CONV_PATH",
    "KILN_CONV_AUTOTUNE",
    "KILN_ALLOW_TF32",
    "KILN_EMULATE_ARCH",
    "KILN_NCCL_LIB",
    "KILN_NCCL_TIMEOUT",
    "KILN_NCCL_CHECK",
    "KILN_COMPILE_THREADS",
    "KILN_STAND_INS",
    "KILN_DEPENDENT_LAUNCH",
    "KILN_RANK",
    "KILN_WORLD_SIZE",
    "KILN_NCCL_ID",
    "KILN_NCCL_ID_FILE",
];

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads settings through `get`, which returns a variable's value if it is set. A variable
    /// set to blanks counts as unset; any other value kiln cannot use is [`Error::Env`].
    ///
    /// ```
    /// use kiln::env::{CacheMode, Config};
    ///
    /// let config = Config::from_lookup(|var| match var {
    ///     "KILN_CACHE" => Some("ro".into()),
    ///     "KILN_CACHE_MAX_BYTES" => Some("512M".into()),
    ///     _ => None,
    /// })?;
    /// assert_eq!(config.cache_mode, CacheMode::ReadOnly);
    /// assert_eq!(config.cache_max_bytes, 512 << 20);
    /// assert!(config.use_cuda_graphs); // unset: the default
    ///
    /// let bad = Config::from_lookup(|var| (var == "MLX_USE_CUDA_GRAPHS").then(|| "maybe".into()));
    /// match bad {
    ///     Err(kiln::Error::Env { var, value, .. }) => {
    ///         assert_eq!((var, value.as_str()), ("MLX_USE_CUDA_GRAPHS", "maybe"))
    ///     }
    ///     other => panic!("expected Error::Env, got {other:?}"),
    /// }
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let set = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        Ok(Config {
            cache_dir: set("KILN_CACHE_DIR").map(PathBuf::from),
            cache_mode: match set("KILN_CACHE") {
                None => CacheMode::On,
                Some(v) => parse_cache_mode(&v)?,
            },
            cache_max_bytes: match set("KILN_CACHE_MAX_BYTES") {
                None => DEFAULT_CACHE_MAX_BYTES,
                Some(v) => parse_bytes("KILN_CACHE_MAX_BYTES", &v)?,
            },
            nvrtc_lib: set("KILN_NVRTC_LIB").map(PathBuf::from),
            use_cuda_graphs: match set("MLX_USE_CUDA_GRAPHS") {
                None => true,
                Some(v) => parse_bool("MLX_USE_CUDA_GRAPHS", &v)?,
            },
            graph_cache_size: match set("MLX_CUDA_GRAPH_CACHE_SIZE") {
                None => DEFAULT_GRAPH_CACHE_SIZE,
                Some(v) => parse_count("MLX_CUDA_GRAPH_CACHE_SIZE", &v)?,
            },
            max_ops_per_buffer: set("MLX_MAX_OPS_PER_BUFFER")
                .map(|v| parse_count("MLX_MAX_OPS_PER_BUFFER", &v))
                .transpose()?,
            max_mb_per_buffer: set("MLX_MAX_MB_PER_BUFFER")
                .map(|v| parse_count("MLX_MAX_MB_PER_BUFFER", &v))
                .transpose()?,
            conv_cache_size: match set("MLX_CUDA_CONV_CACHE_SIZE") {
                None => DEFAULT_CONV_CACHE_SIZE,
                Some(v) => parse_count("MLX_CUDA_CONV_CACHE_SIZE", &v)?,
            },
            max_commits_in_flight: match set("KILN_MAX_COMMITS_IN_FLIGHT") {
                None => DEFAULT_MAX_COMMITS_IN_FLIGHT,
                Some(v) => parse_count("KILN_MAX_COMMITS_IN_FLIGHT", &v)?,
            },
            max_mb_in_flight: set("KILN_MAX_MB_IN_FLIGHT")
                .map(|v| parse_count("KILN_MAX_MB_IN_FLIGHT", &v))
                .transpose()?,
            conv_path: match set("KILN_CONV_PATH") {
                None => ConvPath::Auto,
                Some(v) => parse_conv_path(&v)?,
            },
            conv_autotune: match set("KILN_CONV_AUTOTUNE") {
                None => false,
                Some(v) => parse_bool("KILN_CONV_AUTOTUNE", &v)?,
            },
            allow_tf32: match set("KILN_ALLOW_TF32") {
                None => false,
                Some(v) => parse_bool("KILN_ALLOW_TF32", &v)?,
            },
            emulate_arch: set("KILN_EMULATE_ARCH")
                .map(|v| parse_arch("KILN_EMULATE_ARCH", &v))
                .transpose()?,
            nccl_lib: set("KILN_NCCL_LIB").map(PathBuf::from),
            nccl_timeout_s: match set("KILN_NCCL_TIMEOUT") {
                None => DEFAULT_NCCL_TIMEOUT_S,
                Some(v) => parse_seconds("KILN_NCCL_TIMEOUT", &v)?,
            },
            nccl_check: match set("KILN_NCCL_CHECK") {
                None => true,
                Some(v) => parse_bool("KILN_NCCL_CHECK", &v)?,
            },
            compile_threads: match set("KILN_COMPILE_THREADS") {
                None => std::thread::available_parallelism().map_or(1, |n| n.get()),
                Some(v) => v.trim().parse::<usize>().map_err(|_| Error::Env {
                    var: "KILN_COMPILE_THREADS",
                    value: v.clone(),
                    expected: "a number of threads (0 turns background compiles off)",
                })?,
            },
            stand_ins: match set("KILN_STAND_INS") {
                None => true,
                Some(v) => parse_bool("KILN_STAND_INS", &v)?,
            },
            dependent_launch: match set("KILN_DEPENDENT_LAUNCH") {
                None => true,
                Some(v) => parse_bool("KILN_DEPENDENT_LAUNCH", &v)?,
            },
        })
    }
}

/// Whether `KILN_REQUIRE_GPU` asks for a GPU (`kiln check` and the GPU tests then fail instead
/// of skipping where there is none); unset means no. A value that is not a boolean is an error.
pub fn require_gpu() -> Result<bool> {
    require_gpu_from(std::env::var("KILN_REQUIRE_GPU").ok())
}

fn require_gpu_from(value: Option<String>) -> Result<bool> {
    match value.filter(|v| !v.trim().is_empty()) {
        None => Ok(false),
        Some(v) => parse_bool("KILN_REQUIRE_GPU", &v),
    }
}

fn parse_cache_mode(v: &str) -> Result<CacheMode> {
    match v.trim().to_ascii_lowercase().as_str() {
        "on" | "1" | "true" | "rw" => Ok(CacheMode::On),
        "off" | "0" | "false" => Ok(CacheMode::Off),
        "ro" | "readonly" | "read-only" => Ok(CacheMode::ReadOnly),
        _ => Err(Error::Env {
            var: "KILN_CACHE",
            value: v.to_string(),
            expected: "on, off or ro",
        }),
    }
}

fn parse_conv_path(v: &str) -> Result<ConvPath> {
    match v.trim().to_ascii_lowercase().as_str() {
        "auto" => Ok(ConvPath::Auto),
        "igemm" => Ok(ConvPath::Igemm),
        _ => Err(Error::Env {
            var: "KILN_CONV_PATH",
            value: v.to_string(),
            expected: "auto or igemm",
        }),
    }
}

/// An architecture as `sm_XY` (kiln's minimum or newer), as compute capability x 10.
fn parse_arch(var: &'static str, v: &str) -> Result<u32> {
    match v.parse::<crate::jit::Target>() {
        Ok(t) if t.kind == crate::jit::TargetKind::Sass => Ok(t.arch),
        _ => Err(Error::Env {
            var,
            value: v.to_string(),
            expected: "an architecture kiln supports, written sm_XY (sm_70, sm_75, sm_80, ...)",
        }),
    }
}

fn parse_bool(var: &'static str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err(Error::Env {
            var,
            value: v.to_string(),
            expected: "0 or 1",
        }),
    }
}

fn parse_seconds(var: &'static str, v: &str) -> Result<f64> {
    match v.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 => Ok(s),
        _ => Err(Error::Env {
            var,
            value: v.to_string(),
            expected: "a positive number of seconds",
        }),
    }
}

/// Where this process stands in a job of one process per GPU, as a launcher describes it:
/// `KILN_RANK`, `KILN_WORLD_SIZE`, and the NCCL unique id either inline (`KILN_NCCL_ID`, 256 hex
/// digits) or in a file (`KILN_NCCL_ID_FILE`, written by rank 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// `KILN_RANK`: this process's rank, below `world_size`.
    pub rank: usize,
    /// `KILN_WORLD_SIZE`: the number of ranks, at least 1.
    pub world_size: usize,
    /// How the ranks share the NCCL unique id.
    pub id: LaunchId,
}

/// Where a launch's NCCL unique id comes from: exactly one of the two variables is set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LaunchId {
    /// `KILN_NCCL_ID`: the id in hex.
    Hex(String),
    /// `KILN_NCCL_ID_FILE`: rank 0 writes a fresh id there, the others wait for it.
    File(PathBuf),
}

impl Launch {
    /// Reads the process environment.
    pub fn from_env() -> Result<Launch> {
        Launch::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the launch through `get`, as [`Config::from_lookup`] does. [`Error::Env`] when
    /// `KILN_RANK` or `KILN_WORLD_SIZE` is missing or not an integer, when the rank is not below
    /// the world size, or unless exactly one of `KILN_NCCL_ID` and `KILN_NCCL_ID_FILE` is set.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Launch> {
        let set = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let index = |var: &'static str| -> Result<usize> {
            let v = set(var).ok_or(Error::Env {
                var,
                value: String::new(),
                expected: "a rank or world size (a launcher sets it for each process)",
            })?;
            v.trim().parse::<usize>().map_err(|_| Error::Env {
                var,
                value: v.clone(),
                expected: "a non-negative integer",
            })
        };
        let rank = index("KILN_RANK")?;
        let world_size = index("KILN_WORLD_SIZE")?;
        if world_size == 0 || rank >= world_size {
            return Err(Error::Env {
                var: "KILN_RANK",
                value: format!("{rank} (KILN_WORLD_SIZE={world_size})"),
                expected: "a rank below a positive KILN_WORLD_SIZE",
            });
        }
        let id = match (set("KILN_NCCL_ID"), set("KILN_NCCL_ID_FILE")) {
            (Some(hex), None) => LaunchId::Hex(hex.trim().to_string()),
            (None, Some(path)) => LaunchId::File(PathBuf::from(path)),
            (hex, _) => {
                return Err(Error::Env {
                    var: "KILN_NCCL_ID",
                    value: hex.unwrap_or_default(),
                    expected: "exactly one of KILN_NCCL_ID (the id in hex) and KILN_NCCL_ID_FILE",
                })
            }
        };
        Ok(Launch {
            rank,
            world_size,
            id,
        })
    }
}

fn parse_count(var: &'static str, v: &str) -> Result<usize> {
    match v.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(Error::Env {
            var,
            value: v.to_string(),
            expected: "a positive integer",
        }),
    }
}

/// Parses a byte count: a plain integer or one with a K, M or G suffix (powers of 1024; "KiB",
/// "MB" and the like are accepted too).
pub fn parse_bytes(var: &'static str, v: &str) -> Result<u64> {
    let bad = || Error::Env {
        var,
        value: v.to_string(),
        expected: "a byte count such as 1073741824, 512M or 2G",
    };
    let t = v.trim().to_ascii_uppercase();
    // One optional B, then an optional I that must follow a unit ("512MiB"); any other
    // repetition ("5I", "512BB") is not a byte count.
    let t = t.strip_suffix('B').unwrap_or(&t);
    let (t, binary) = t.strip_suffix('I').map_or((t, false), |rest| (rest, true));
    let (digits, shift) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 10),
        Some('M') => (&t[..t.len() - 1], 20),
        Some('G') => (&t[..t.len() - 1], 30),
        Some('T') => (&t[..t.len() - 1], 40),
        _ if binary => return Err(bad()),
        _ => (t, 0),
    };
    let n: u64 = digits.trim().parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<Config> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_when_nothing_is_set() {
        let c = config(&[]).unwrap();
        assert_eq!(c.cache_mode, CacheMode::On);
        assert_eq!(c.cache_max_bytes, DEFAULT_CACHE_MAX_BYTES);
        assert_eq!(c.cache_dir, None);
        assert!(c.use_cuda_graphs);
        assert_eq!(c.graph_cache_size, 400);
        assert_eq!(c.conv_cache_size, 128);
        assert_eq!(c.max_ops_per_buffer, None);
        assert_eq!(c.max_commits_in_flight, DEFAULT_MAX_COMMITS_IN_FLIGHT);
        assert_eq!(c.max_mb_in_flight, None);
        assert_eq!(c.conv_path, ConvPath::Auto);
        assert!(c.dependent_launch);
    }

    #[test]
    fn parses_every_variable() {
        let c = config(&[
            ("KILN_CACHE_DIR", "/tmp/k"),
            ("KILN_CACHE", "ro"),
            ("KILN_CACHE_MAX_BYTES", "512M"),
            ("MLX_USE_CUDA_GRAPHS", "0"),
            ("MLX_CUDA_GRAPH_CACHE_SIZE", "2"),
            ("MLX_MAX_OPS_PER_BUFFER", "20"),
            ("MLX_MAX_MB_PER_BUFFER", "100"),
            ("MLX_CUDA_CONV_CACHE_SIZE", "7"),
            ("KILN_MAX_COMMITS_IN_FLIGHT", "3"),
            ("KILN_MAX_MB_IN_FLIGHT", "64"),
            ("KILN_CONV_PATH", "IGEMM"),
            ("KILN_CONV_AUTOTUNE", "1"),
            ("KILN_EMULATE_ARCH", "sm_75"),
            ("KILN_DEPENDENT_LAUNCH", "off"),
        ])
        .unwrap();
        assert!(!c.dependent_launch);
        assert_eq!(c.cache_dir, Some(PathBuf::from("/tmp/k")));
        assert_eq!(c.cache_mode, CacheMode::ReadOnly);
        assert_eq!(c.cache_max_bytes, 512 << 20);
        assert!(!c.use_cuda_graphs);
        assert_eq!(c.graph_cache_size, 2);
        assert_eq!(c.max_ops_per_buffer, Some(20));
        assert_eq!(c.max_mb_per_buffer, Some(100));
        assert_eq!(c.conv_cache_size, 7);
        assert_eq!(c.max_commits_in_flight, 3);
        assert_eq!(c.max_mb_in_flight, Some(64));
        assert_eq!(c.conv_path, ConvPath::Igemm);
        assert!(c.conv_autotune);
        assert_eq!(c.emulate_arch, Some(75));
        assert_eq!(config(&[]).unwrap().emulate_arch, None);
        assert!(!config(&[]).unwrap().conv_autotune);
        assert!(config(&[("KILN_CONV_PATH", "wgmma")]).is_err());
        assert!(config(&[("KILN_CONV_AUTOTUNE", "maybe")]).is_err());
        assert!(!config(&[]).unwrap().allow_tf32);
        assert!(config(&[("KILN_ALLOW_TF32", "1")]).unwrap().allow_tf32);
        match config(&[("KILN_ALLOW_TF32", "fast")]) {
            Err(Error::Env { var, .. }) => assert_eq!(var, "KILN_ALLOW_TF32"),
            other => panic!("expected KILN_ALLOW_TF32's error, got {other:?}"),
        }
        let c = config(&[
            ("KILN_NCCL_LIB", "/opt/nccl/libnccl.so.2"),
            ("KILN_NCCL_TIMEOUT", "2.5"),
            ("KILN_NCCL_CHECK", "0"),
        ])
        .unwrap();
        assert_eq!(c.nccl_lib, Some(PathBuf::from("/opt/nccl/libnccl.so.2")));
        assert_eq!(c.nccl_timeout_s, 2.5);
        assert!(!c.nccl_check);
        let d = config(&[]).unwrap();
        assert!(d.nccl_check);
        assert_eq!(d.nccl_timeout_s, DEFAULT_NCCL_TIMEOUT_S);
    }

    fn launch(vars: &[(&str, &str)]) -> Result<Launch> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Launch::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn launch_variables() {
        let l = launch(&[
            ("KILN_RANK", "1"),
            ("KILN_WORLD_SIZE", "2"),
            ("KILN_NCCL_ID_FILE", "/tmp/id"),
        ])
        .unwrap();
        assert_eq!((l.rank, l.world_size), (1, 2));
        assert_eq!(l.id, LaunchId::File(PathBuf::from("/tmp/id")));
        let l = launch(&[
            ("KILN_RANK", "0"),
            ("KILN_WORLD_SIZE", "1"),
            ("KILN_NCCL_ID", "ab01"),
        ])
        .unwrap();
        assert_eq!(l.id, LaunchId::Hex("ab01".into()));
        for (vars, named) in [
            (
                vec![("KILN_WORLD_SIZE", "2"), ("KILN_NCCL_ID", "00")],
                "KILN_RANK",
            ),
            (
                vec![("KILN_RANK", "0"), ("KILN_NCCL_ID", "00")],
                "KILN_WORLD_SIZE",
            ),
            (
                vec![
                    ("KILN_RANK", "2"),
                    ("KILN_WORLD_SIZE", "2"),
                    ("KILN_NCCL_ID", "00"),
                ],
                "KILN_RANK",
            ),
            (
                vec![
                    ("KILN_RANK", "x"),
                    ("KILN_WORLD_SIZE", "2"),
                    ("KILN_NCCL_ID", "00"),
                ],
                "KILN_RANK",
            ),
            (
                vec![("KILN_RANK", "0"), ("KILN_WORLD_SIZE", "2")],
                "KILN_NCCL_ID",
            ),
            (
                vec![
                    ("KILN_RANK", "0"),
                    ("KILN_WORLD_SIZE", "2"),
                    ("KILN_NCCL_ID", "00"),
                    ("KILN_NCCL_ID_FILE", "/tmp/id"),
                ],
                "KILN_NCCL_ID",
            ),
        ] {
            let err = launch(&vars).unwrap_err().to_string();
            assert!(err.contains(named), "{vars:?}: {err}");
        }
    }

    #[test]
    fn require_gpu_is_a_boolean_or_an_error() {
        assert!(!require_gpu_from(None).unwrap());
        assert!(!require_gpu_from(Some(" ".into())).unwrap());
        assert!(require_gpu_from(Some("1".into())).unwrap());
        assert!(!require_gpu_from(Some("false".into())).unwrap());
        let e = require_gpu_from(Some("yes please".into())).unwrap_err();
        assert!(e.to_string().contains("KILN_REQUIRE_GPU"), "{e}");
    }

    #[test]
    fn byte_suffixes() {
        assert_eq!(parse_bytes("X", "4096").unwrap(), 4096);
        assert_eq!(parse_bytes("X", "2G").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("X", "3kib").unwrap(), 3 << 10);
        assert_eq!(parse_bytes("X", "10MB").unwrap(), 10 << 20);
        assert!(parse_bytes("X", "lots").is_err());
        assert!(parse_bytes("X", "-1").is_err());
        assert_eq!(parse_bytes("X", "1TiB").unwrap(), 1 << 40);
        assert_eq!(parse_bytes("X", "512b").unwrap(), 512);
    }

    #[test]
    fn malformed_byte_suffixes_are_errors() {
        // Each was read as a plain count (5, 512) or as 1 MiB, whatever the stray letters.
        for value in ["5I", "5IB", "512BB", "1MBB", "1MII"] {
            match parse_bytes("KILN_CACHE_MAX_BYTES", value) {
                Err(Error::Env { var, .. }) => assert_eq!(var, "KILN_CACHE_MAX_BYTES"),
                other => panic!("{value:?}: expected Error::Env, got {other:?}"),
            }
        }
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (var, value) in [
            ("KILN_CACHE", "maybe"),
            ("MLX_USE_CUDA_GRAPHS", "2"),
            ("MLX_CUDA_GRAPH_CACHE_SIZE", "0"),
            ("MLX_MAX_OPS_PER_BUFFER", "x"),
            ("KILN_CACHE_MAX_BYTES", "1Q"),
            ("KILN_MAX_COMMITS_IN_FLIGHT", "0"),
            ("KILN_MAX_MB_IN_FLIGHT", "many"),
            ("KILN_EMULATE_ARCH", "75"),
            ("KILN_EMULATE_ARCH", "sm_61"),
            ("KILN_EMULATE_ARCH", "sm_90a"),
            ("KILN_NCCL_TIMEOUT", "0"),
            ("KILN_NCCL_TIMEOUT", "soon"),
            ("KILN_NCCL_CHECK", "sometimes"),
        ] {
            let err = config(&[(var, value)]).unwrap_err().to_string();
            assert!(err.contains(var), "{err}");
        }
    }

    #[test]
    fn cache_modes() {
        for (v, m) in [
            ("on", CacheMode::On),
            ("OFF", CacheMode::Off),
            ("ro", CacheMode::ReadOnly),
        ] {
            assert_eq!(config(&[("KILN_CACHE", v)]).unwrap().cache_mode, m);
        }
    }
}
