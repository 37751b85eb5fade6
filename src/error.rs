//! kiln's one error type.

use std::path::PathBuf;

/// `Result` with kiln's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything kiln reports. New variants may be added in any release, so matches need a
/// wildcard arm. Errors are `Clone`: one that a process-wide set-up remembers (NVRTC or NCCL
/// failing to load, an invalid environment) is returned again, variant and fields intact, on
/// every later call.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No libnvrtc was found in any of the places kiln looks (see `KILN_NVRTC_LIB`).
    #[error(
        "NVRTC was not found. kiln looked in:\n  {}\nInstall it with `pip install nvidia-cuda-nvrtc` \
         (kiln finds it in the active Python environment), install the CUDA toolkit, or point \
         KILN_NVRTC_LIB at libnvrtc.so",
        searched.join("\n  ")
    )]
    NvrtcNotFound {
        /// Each place looked in, in order, as the message lists it.
        searched: Vec<String>,
    },

    /// A libnvrtc was found (or named by `KILN_NVRTC_LIB`) but cannot be used: it does not load,
    /// is not NVRTC, is older than 12, or the dynamic linker would hand cudarc another library
    /// than the one kiln opened.
    #[error("could not load NVRTC from {path}: {reason}")]
    NvrtcLoad {
        /// The file kiln found (or `KILN_NVRTC_LIB` named).
        path: PathBuf,
        /// Why it was refused, with the fix where there is one.
        reason: String,
    },

    /// The NVRTC in use produces code the installed driver cannot load.
    #[error("{0}")]
    NvrtcDriverMismatch(String),

    /// An NVRTC API call failed for a reason other than the source failing to compile (that is
    /// [`Error::Compile`]).
    #[error("NVRTC call {call} failed: {message}")]
    Nvrtc {
        /// The NVRTC function, e.g. `nvrtcCreateProgram`.
        call: &'static str,
        /// NVRTC's text for the result code.
        message: String,
    },

    /// NVRTC rejected a kernel's rendered source.
    #[error("compiling {spec} for {target} failed; source: {}\n{log}",
        source_path.as_ref().map_or("(not saved)".to_string(), |p| p.display().to_string()))]
    Compile {
        /// The spec that failed, as its `Display` writes it (family, dtype, block, constants).
        spec: String,
        /// The exact target compiled for, e.g. `sm_90a`.
        target: String,
        /// NVRTC's compile log.
        log: String,
        /// Where the rendered source was saved for reading, or None when it could not be.
        source_path: Option<PathBuf>,
    },

    /// A family's template or one of its partials failed to parse or render (templates render
    /// in strict mode: a misspelt variable is an error).
    #[error("rendering template {template} failed: {message}")]
    Template {
        /// The family's name.
        template: String,
        /// handlebars' message.
        message: String,
    },

    /// A target string that is not `sm_XY`, `sm_XYa` or `compute_XY` (the string as given).
    #[error("invalid target {0:?}: expected sm_XY, sm_XYa or compute_XY, for example sm_90")]
    InvalidTarget(String),

    /// The NVRTC in use cannot emit code for the target (too old or too new for it).
    #[error("NVRTC {nvrtc} cannot compile for {target}: {reason}")]
    TargetUnsupported {
        /// The target asked for.
        target: String,
        /// The NVRTC's version and where it was loaded from.
        nvrtc: String,
        /// What it supports, and which NVRTC to install instead.
        reason: String,
    },

    /// An environment variable kiln reads has a value it cannot use, or one that a launch
    /// needs is missing (see [`crate::env`]).
    #[error("environment variable {var}={value:?} is invalid: expected {expected}")]
    Env {
        /// The variable's name.
        var: &'static str,
        /// The value found; empty when the variable is missing.
        value: String,
        /// What it should be, in words.
        expected: &'static str,
    },

    /// A file operation failed.
    #[error("{context}: {path}: {source}")]
    Io {
        /// What kiln was doing, e.g. `writing a cache bundle`.
        context: &'static str,
        /// The file it was doing it to.
        path: PathBuf,
        /// Shared, so that the error can be cloned.
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },

    /// The CUDA driver cannot be used: libcuda is missing, or `cuInit` failed (the reason).
    #[error("no CUDA driver: {0}")]
    NoDriver(String),

    /// A CUDA driver call failed.
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),

    #[error(
        "out of device memory: {requested} bytes requested, {active} bytes in use, \
         {cached_released} cached bytes released before the retry"
    )]
    /// A device allocation failed even after the allocator waited for launched work and
    /// released its cache, or asked for more than the device has.
    OutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// Bytes held by live buffers (in size classes) when it failed.
        active: usize,
        /// Cached bytes given back to the driver before the retry (0 when there was none).
        cached_released: usize,
    },

    /// No libnccl was found in any of the places kiln looks (see `KILN_NCCL_LIB`).
    #[error(
        "NCCL was not found. kiln looked in:\n  {}\nInstall it with `pip install nvidia-nccl-cu13` \
         (or `nvidia-nccl-cu12`; kiln finds it in the active Python environment), install NCCL \
         system-wide, or point KILN_NCCL_LIB at libnccl.so.2",
        searched.join("\n  ")
    )]
    NcclNotFound {
        /// Each place looked in, in order.
        searched: Vec<String>,
    },

    /// A libnccl was found (or named by `KILN_NCCL_LIB`) but cannot be used: it does not load,
    /// lacks an entry point kiln calls, or is older than 2.14.
    #[error("could not load NCCL from {path}: {reason}")]
    NcclLoad {
        /// The file kiln found (or `KILN_NCCL_LIB` named).
        path: PathBuf,
        /// Why it was refused.
        reason: String,
    },

    /// An NCCL call returned an error (`detail` is NCCL's last error message, when it has one).
    #[error("NCCL call {call} failed: {message}{}", if detail.is_empty() { String::new() } else { format!(" ({detail})") })]
    Nccl {
        /// The NCCL function, e.g. `ncclCommInitRankConfig`.
        call: &'static str,
        /// NCCL's text for the result, with its number.
        message: String,
        /// NCCL's last error message for the communicator; empty when there is none.
        detail: String,
    },

    /// A collective did not finish in time; the communicator was aborted.
    #[error(
        "{what} on rank {rank} of {nranks} did not finish within {seconds} s (KILN_NCCL_TIMEOUT): \
         a peer may have died, or the ranks called different collectives; the communicator was \
         aborted"
    )]
    CollectiveTimeout {
        /// What was waited for, e.g. `communicator set-up` or `a collective`.
        what: String,
        /// This rank.
        rank: usize,
        /// Ranks in the communicator.
        nranks: usize,
        /// The deadline, `KILN_NCCL_TIMEOUT`, in seconds.
        seconds: f64,
    },

    /// The ranks called collectives that do not match (another op, dtype, size or root).
    #[error(
        "collective mismatch on rank {rank} of {nranks}: this rank called {ours}, rank {peer} \
         called something else (another op, dtype, element count or root); the communicator \
         was aborted"
    )]
    CollectiveMismatch {
        /// This rank.
        rank: usize,
        /// Ranks in the communicator.
        nranks: usize,
        /// A rank whose collective differs from this one's.
        peer: usize,
        /// The collective this rank called, described.
        ours: String,
    },

    /// The communicator failed or was aborted earlier and can no longer be used.
    #[error("communicator of rank {rank} of {nranks} is unusable: {reason}")]
    CommunicatorFailed {
        /// This rank.
        rank: usize,
        /// Ranks in the communicator.
        nranks: usize,
        /// Why it failed or was aborted, as recorded then.
        reason: String,
    },

    /// An argument kiln cannot use: a shape, dtype, spec, target or option that does not fit,
    /// or an operation the current mode does not allow.
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        /// The argument's name (or the setting's, e.g. `KILN_CACHE`).
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// An array's shape is not the one the call needs.
    #[error("argument `{arg}` must have shape {expected:?}, got {got:?}")]
    ShapeMismatch {
        /// The argument's name.
        arg: &'static str,
        /// The shape the call needs.
        expected: Vec<usize>,
        /// The array's shape.
        got: Vec<usize>,
    },

    /// An array lives on another GPU than the call runs on (the encoder's, or the GPU of the
    /// array or communicator the call pairs it with).
    #[error(
        "argument `{arg}` lives on GPU {got}, but the call runs on GPU {expected}{}",
        if got == expected { " (another kiln Device of the same GPU: see Device::with_jit)" } else { "" }
    )]
    DeviceMismatch {
        /// The argument's name.
        arg: &'static str,
        /// The ordinal of the GPU the call runs on.
        expected: usize,
        /// The ordinal of the GPU the argument lives on.
        got: usize,
    },

    /// A file given as a cache bundle is not one this kiln can read: not a bundle at all, or
    /// another bundle format version. (Damage inside a readable bundle is not an error: the
    /// import report lists the entries it left out.)
    #[error("{path} is not a usable cache bundle: {reason}")]
    BadBundle {
        /// The file.
        path: PathBuf,
        /// What is wrong with it, and what to do.
        reason: String,
    },

    /// An array's element type is not the one the call needs.
    #[error("argument `{arg}` must hold {expected}, got {got}")]
    DTypeMismatch {
        /// The argument's name.
        arg: &'static str,
        /// The dtype the call needs.
        expected: crate::DType,
        /// The array's dtype.
        got: crate::DType,
    },
}

impl Error {
    /// The argument a bad-argument error names (`InvalidArgument`, `ShapeMismatch`,
    /// `DTypeMismatch`, `DeviceMismatch`); None for other errors.
    pub fn argument(&self) -> Option<&'static str> {
        match self {
            Error::InvalidArgument { arg, .. }
            | Error::ShapeMismatch { arg, .. }
            | Error::DTypeMismatch { arg, .. }
            | Error::DeviceMismatch { arg, .. } => Some(arg),
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
        let device = Error::DeviceMismatch {
            arg: "x",
            expected: 0,
            got: 1,
        };
        assert_eq!(device.clone().argument(), Some("x"));
        assert_eq!(
            device.to_string(),
            "argument `x` lives on GPU 1, but the call runs on GPU 0"
        );
        assert_eq!(io.clone().to_string(), io.to_string());
    }
}
