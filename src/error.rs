//! kiln's one error type.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything kiln reports. New variants may be added in any release, so matches need a
/// wildcard arm. Errors are `Clone`: one that a process-wide set-up remembers (NVRTC or NCCL
/// failing to load, an invalid environment) is returned again, variant and fields intact, on
/// every later call.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(
        "NVRTC was not found. kiln looked in:\n  {}\nInstall it with `pip install nvidia-cuda-nvrtc` \
         (kiln finds it in the active Python environment), install the CUDA toolkit, or point \
         KILN_NVRTC_LIB at libnvrtc.so",
        searched.join("\n  ")
    )]
    NvrtcNotFound { searched: Vec<String> },

    #[error("could not load NVRTC from {path}: {reason}")]
    NvrtcLoad { path: PathBuf, reason: String },

    /// The NVRTC in use produces code the installed driver cannot load.
    #[error("{0}")]
    NvrtcDriverMismatch(String),

    #[error("NVRTC call {call} failed: {message}")]
    Nvrtc { call: &'static str, message: String },

    #[error("compiling {spec} for {target} failed; source: {}\n{log}",
        source_path.as_ref().map_or("(not saved)".to_string(), |p| p.display().to_string()))]
    Compile {
        spec: String,
        target: String,
        log: String,
        source_path: Option<PathBuf>,
    },

    #[error("rendering template {template} failed: {message}")]
    Template { template: String, message: String },

    #[error("invalid target {0:?}: expected sm_XY, sm_XYa or compute_XY, for example sm_90")]
    InvalidTarget(String),

    /// The NVRTC in use cannot emit code for the target (too old or too new for it).
    #[error("NVRTC {nvrtc} cannot compile for {target}: {reason}")]
    TargetUnsupported {
        target: String,
        nvrtc: String,
        reason: String,
    },

    #[error("environment variable {var}={value:?} is invalid: expected {expected}")]
    Env {
        var: &'static str,
        value: String,
        expected: &'static str,
    },

    #[error("{context}: {path}: {source}")]
    Io {
        context: &'static str,
        path: PathBuf,
        /// Shared, so that the error can be cloned.
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },

    #[error("no CUDA driver: {0}")]
    NoDriver(String),

    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),

    #[error(
        "out of device memory: {requested} bytes requested, {active} bytes in use, \
         {cached_released} cached bytes released before the retry"
    )]
    OutOfMemory {
        requested: usize,
        active: usize,
        cached_released: usize,
    },

    #[error(
        "NCCL was not found. kiln looked in:\n  {}\nInstall it with `pip install nvidia-nccl-cu13` \
         (or `nvidia-nccl-cu12`; kiln finds it in the active Python environment), install NCCL \
         system-wide, or point KILN_NCCL_LIB at libnccl.so.2",
        searched.join("\n  ")
    )]
    NcclNotFound { searched: Vec<String> },

    #[error("could not load NCCL from {path}: {reason}")]
    NcclLoad { path: PathBuf, reason: String },

    /// An NCCL call returned an error (`detail` is NCCL's last error message, when it has one).
    #[error("NCCL call {call} failed: {message}{}", if detail.is_empty() { String::new() } else { format!(" ({detail})") })]
    Nccl {
        call: &'static str,
        message: String,
        detail: String,
    },

    /// A collective did not finish in time; the communicator was aborted.
    #[error(
        "{what} on rank {rank} of {nranks} did not finish within {seconds} s (KILN_NCCL_TIMEOUT): \
         a peer may have died, or the ranks called different collectives; the communicator was \
         aborted"
    )]
    CollectiveTimeout {
        what: String,
        rank: usize,
        nranks: usize,
        seconds: f64,
    },

    /// The ranks called collectives that do not match (another op, dtype, size or root).
    #[error(
        "collective mismatch on rank {rank} of {nranks}: this rank called {ours}, rank {peer} \
         called something else (another op, dtype, element count or root); the communicator \
         was aborted"
    )]
    CollectiveMismatch {
        rank: usize,
        nranks: usize,
        peer: usize,
        ours: String,
    },

    /// The communicator failed or was aborted earlier and can no longer be used.
    #[error("communicator of rank {rank} of {nranks} is unusable: {reason}")]
    CommunicatorFailed {
        rank: usize,
        nranks: usize,
        reason: String,
    },

    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument { arg: &'static str, reason: String },

    /// An array's shape is not the one the call needs.
    #[error("argument `{arg}` must have shape {expected:?}, got {got:?}")]
    ShapeMismatch {
        arg: &'static str,
        expected: Vec<usize>,
        got: Vec<usize>,
    },

    /// An array's element type is not the one the call needs.
    #[error("argument `{arg}` must hold {expected}, got {got}")]
    DTypeMismatch {
        arg: &'static str,
        expected: crate::DType,
        got: crate::DType,
    },
}

impl Error {
    /// The argument a bad-argument error names (`InvalidArgument`, `ShapeMismatch`,
    /// `DTypeMismatch`); None for other errors.
    pub fn argument(&self) -> Option<&'static str> {
        match self {
            Error::InvalidArgument { arg, .. }
            | Error::ShapeMismatch { arg, .. }
            | Error::DTypeMismatch { arg, .. } => Some(arg),
            _ => None,
        }
    }

    pub(crate) fn io(
        context: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        Error::Io {
            context,
            path: path.into(),
            source: std::sync::Arc::new(source),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn argument_errors_name_their_argument_and_survive_a_clone() {
        let shape = Error::ShapeMismatch {
            arg: "cotangent",
            expected: vec![2, 3],
            got: vec![3, 2],
        };
        let dtype = Error::DTypeMismatch {
            arg: "weight",
            expected: DType::BF16,
            got: DType::F32,
        };
        assert_eq!(shape.argument(), Some("cotangent"));
        assert_eq!(dtype.clone().argument(), Some("weight"));
        assert_eq!(
            shape.to_string(),
            "argument `cotangent` must have shape [2, 3], got [3, 2]"
        );
        assert!(dtype.to_string().contains("bf16"), "{dtype}");
        let io = Error::io("reading", "/x", std::io::Error::other("disk on fire"));
        assert_eq!(io.argument(), None);
        assert_eq!(io.clone().to_string(), io.to_string());
    }
}
