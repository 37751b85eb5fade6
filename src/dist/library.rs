//! Finding and loading NCCL at run time, as kiln finds NVRTC: no build-time dependency.
//!
//! cudarc's NCCL bindings give the C types (the unique id, the communicator handle, the
//! configuration struct); its own loader asks the dynamic linker for names that do not include
//! NCCL's soname (`libnccl.so.2`, the only name NVIDIA's wheels ship) and panics when it finds
//! nothing, so kiln opens the library itself and resolves the few entry points it calls into a
//! table of function pointers. Results and enums cross the boundary as plain integers, so a
//! value a newer NCCL adds can never be an invalid Rust enum.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclUniqueId};

use crate::error::{Error, Result};
use crate::jit::nvrtc::python_library_dirs;

/// NCCL's soname first (system packages and wheels), then the development link.
const NAMES: &[&str] = &["libnccl.so.2", "libnccl.so"];

/// Non-blocking communicators and `ncclCommInitRankConfig` arrived in NCCL 2.14.
pub const MIN_VERSION: (i32, i32) = (2, 14);

/// `ncclSuccess`, `ncclInProgress`: the two results that are not failures.
pub const SUCCESS: c_int = 0;
/// `ncclInProgress`: a call on a non-blocking communicator has not finished yet.
pub const IN_PROGRESS: c_int = 7;

type Res = c_int;
type Comm = ncclComm_t;

/// The entry points kiln calls, resolved once.
pub struct Nccl {
    /// Where the library was found.
    pub path: String,
    /// (major, minor, patch).
    pub version: (i32, i32, i32),
    _lib: libloading::Library,
    /// `ncclGetErrorString`: the text for a result.
    pub get_error_string: unsafe extern "C" fn(Res) -> *const c_char,
    /// `ncclGetLastError`: the last error message for a communicator.
    pub get_last_error: unsafe extern "C" fn(Comm) -> *const c_char,
    /// `ncclGetUniqueId`: a fresh unique id.
    pub get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> Res,
    /// `ncclCommInitRankConfig`: comm, nranks, id, rank, config.
    pub comm_init_rank_config:
        unsafe extern "C" fn(*mut Comm, c_int, ncclUniqueId, c_int, *mut ncclConfig_t) -> Res,
    /// `ncclCommGetAsyncError`: a communicator's state (success, in progress, or its error).
    pub comm_get_async_error: unsafe extern "C" fn(Comm, *mut Res) -> Res,
    /// `ncclCommFinalize`: flushes a communicator's work before it is destroyed.
    pub comm_finalize: unsafe extern "C" fn(Comm) -> Res,
    /// `ncclCommDestroy`.
    pub comm_destroy: unsafe extern "C" fn(Comm) -> Res,
    /// `ncclCommAbort`: stops a communicator's kernels and frees it.
    pub comm_abort: unsafe extern "C" fn(Comm) -> Res,
    /// `ncclGroupStart`.
    pub group_start: unsafe extern "C" fn() -> Res,
    /// `ncclGroupEnd`.
    pub group_end: unsafe extern "C" fn() -> Res,
    /// send, recv, count, datatype, op, comm, stream.
    pub all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        CUstream,
    ) -> Res,
    /// send, recv, send count, datatype, comm, stream.
    pub all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, CUstream) -> Res,
    /// send, recv, receive count, datatype, op, comm, stream.
    pub reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        CUstream,
    ) -> Res,
    /// send, recv, count, datatype, root, comm, stream.
    pub broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        CUstream,
    ) -> Res,
    /// buffer, count, datatype, peer, comm, stream.
    pub send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, CUstream) -> Res,
    /// buffer, count, datatype, peer, comm, stream.
    pub recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, CUstream) -> Res,
}

// SAFETY: plain function pointers into a library that stays loaded for the life of the process;
// NCCL's entry points may be called from any thread.
unsafe impl Send for Nccl {}
unsafe impl Sync for Nccl {}

static NCCL: OnceLock<Result<Nccl>> = OnceLock::new();

impl Nccl {
    /// Finds and loads NCCL once per process. `explicit` is `KILN_NCCL_LIB`.
    pub fn get(explicit: Option<&Path>) -> Result<&'static Nccl> {
        // A failure is remembered and returned again, as the same typed error.
        NCCL.get_or_init(|| load(explicit))
            .as_ref()
            .map_err(Error::clone)
    }

    /// The version as `major.minor.patch`, e.g. `2.27.3`.
    pub fn version_string(&self) -> String {
        let (a, b, c) = self.version;
        format!("{a}.{b}.{c}")
    }

    /// `Ok` for success, `Err` naming the call and NCCL's messages otherwise (`comm` adds its
    /// last error, when there is one). `ncclInProgress` is not an error here: callers of
    /// non-blocking communicators wait for it themselves.
    pub fn check(&self, call: &'static str, status: Res, comm: Option<Comm>) -> Result<()> {
        if status == SUCCESS || status == IN_PROGRESS {
            return Ok(());
        }
        Err(self.error(call, status, comm))
    }

    /// The [`Error::Nccl`] for a failed `call` that returned `status` (with `comm`'s last error
    /// message, when given and NCCL has one).
    pub fn error(&self, call: &'static str, status: Res, comm: Option<Comm>) -> Error {
        // SAFETY: both return NUL-terminated strings NCCL owns (or null); copied at once.
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        let message = text(unsafe { (self.get_error_string)(status) });
        let detail = match comm {
            Some(c) => text(unsafe { (self.get_last_error)(c) }),
            None => String::new(),
        };
        Error::Nccl {
            call,
            message: format!("{message} (ncclResult {status})"),
            detail,
        }
    }
}

/// The places kiln looks for NCCL, in order. An explicit path is never second-guessed.
pub fn search_locations(explicit: Option<&Path>) -> Vec<String> {
    match explicit {
        Some(p) => vec![format!("{} (KILN_NCCL_LIB)", p.display())],
        None => {
            let mut out = vec![format!("the dynamic linker's path ({})", NAMES.join(", "))];
            out.push(
                "Python environments (VIRTUAL_ENV, CONDA_PREFIX, python3's sys.path): \
                 nvidia/nccl/lib, nvidia/cu13/lib, nvidia/cu12/lib"
                    .into(),
            );
            out
        }
    }
}

fn open(path: &Path) -> Option<libloading::Library> {
    // SAFETY: loading libnccl runs its initialisers, which have no preconditions.
    unsafe { libloading::Library::new(path) }.ok()
}

/// Opens the first NCCL found: the explicit path alone, else the dynamic linker's path (a
/// system install), else a wheel in a Python environment (which may start `python3`).
fn find_and_open(explicit: Option<&Path>) -> Result<(String, libloading::Library)> {
    if let Some(p) = explicit {
        return match open(p) {
            Some(lib) => Ok((p.display().to_string(), lib)),
            None => Err(Error::NcclLoad {
                path: p.to_path_buf(),
                reason: "KILN_NCCL_LIB names a file that could not be loaded as a library".into(),
            }),
        };
    }
    for name in NAMES {
        if let Some(lib) = open(Path::new(name)) {
            return Ok((format!("{name} (dynamic linker path)"), lib));
        }
    }
    // The active environment first: asking python3 starts a process.
    let subdirs = ["nvidia/nccl/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"];
    for ask_python in [false, true] {
        for dir in python_library_dirs(&subdirs, ask_python) {
            for name in NAMES {
                let p = dir.join(name);
                if p.exists() {
                    if let Some(lib) = open(&p) {
                        return Ok((p.display().to_string(), lib));
                    }
                }
            }
        }
    }
    Err(Error::NcclNotFound {
        searched: search_locations(None),
    })
}

fn load(explicit: Option<&Path>) -> Result<Nccl> {
    let (path, lib) = find_and_open(explicit)?;
    let not_nccl = |reason: String| Error::NcclLoad {
        path: PathBuf::from(&path),
        reason,
    };
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: the symbol is declared with the signature of NCCL's header (nccl.h, 2.14
            // and later); the library stays loaded while the pointer is used (it is moved into
            // the table below).
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                not_nccl(format!(
                    "not an NCCL library of {}.{} or later: {e}",
                    MIN_VERSION.0, MIN_VERSION.1
                ))
            })?
        }};
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> Res = sym!("ncclGetVersion");
    let mut code: c_int = 0;
    // SAFETY: writes one int.
    if unsafe { get_version(&mut code) } != SUCCESS {
        return Err(not_nccl("ncclGetVersion failed".into()));
    }
    // NCCL_VERSION(X,Y,Z) is X*10000 + Y*100 + Z since 2.9.
    let version = (code / 10000, (code % 10000) / 100, code % 100);
    if (version.0, version.1) < MIN_VERSION {
        return Err(not_nccl(format!(
            "NCCL {}.{}.{} is too old: kiln needs {}.{} or later (non-blocking communicators)",
            version.0, version.1, version.2, MIN_VERSION.0, MIN_VERSION.1
        )));
    }
    Ok(Nccl {
        get_error_string: sym!("ncclGetErrorString"),
        get_last_error: sym!("ncclGetLastError"),
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank_config: sym!("ncclCommInitRankConfig"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        comm_finalize: sym!("ncclCommFinalize"),
        comm_destroy: sym!("ncclCommDestroy"),
        comm_abort: sym!("ncclCommAbort"),
        group_start: sym!("ncclGroupStart"),
        group_end: sym!("ncclGroupEnd"),
        all_reduce: sym!("ncclAllReduce"),
        all_gather: sym!("ncclAllGather"),
        reduce_scatter: sym!("ncclReduceScatter"),
        broadcast: sym!("ncclBroadcast"),
        send: sym!("ncclSend"),
        recv: sym!("ncclRecv"),
        path,
        version,
        _lib: lib,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_path_that_is_not_a_library_names_the_variable() {
        let err = load(Some(Path::new("/nonexistent/libnccl.so.2")))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("/nonexistent/libnccl.so.2"), "{err}");
        assert!(err.contains("KILN_NCCL_LIB"), "{err}");
    }

    #[test]
    fn a_library_that_is_not_nccl_is_refused() {
        // libc loads everywhere and has none of NCCL's symbols.
        let err = load(Some(Path::new("libc.so.6")))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("not an NCCL library"), "{err}");
    }

    #[test]
    fn not_found_says_where_kiln_looked_and_how_to_install() {
        let searched = search_locations(None);
        assert!(searched[0].contains("libnccl.so.2"), "{searched:?}");
        assert!(searched[1].contains("nvidia/nccl/lib"), "{searched:?}");
        let err = Error::NcclNotFound { searched }.to_string();
        for needle in [
            "pip install nvidia-nccl-cu13",
            "KILN_NCCL_LIB",
            "libnccl.so.2",
        ] {
            assert!(err.contains(needle), "{needle}: {err}");
        }
        let explicit = search_locations(Some(Path::new("/opt/x/libnccl.so.2")));
        assert_eq!(explicit, ["/opt/x/libnccl.so.2 (KILN_NCCL_LIB)"]);
    }
}
