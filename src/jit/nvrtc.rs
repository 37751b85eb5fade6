//! Finding, loading and calling NVRTC.
//!
//! cudarc loads libnvrtc by library name through the dynamic linker. kiln first finds a concrete
//! file (an explicit path, a CUDA install, the linker path, or a Python environment with the
//! `nvidia-cuda-nvrtc` wheel) and opens it; the dynamic linker then hands cudarc that same,
//! already-loaded library when it asks for it by soname. kiln checks that both agree on the
//! version, so a second, different libnvrtc on the linker path is an error instead of a surprise.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::OnceLock;

use cudarc::nvrtc::sys;

use crate::error::{Error, Result};

/// The library file names kiln tries, newest first. cudarc asks the linker for these sonames.
const SONAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// A loaded NVRTC.
#[derive(Debug)]
pub struct Nvrtc {
    /// Where the library was found ("(linker path)" plus the name when dlopen found it by name).
    pub path: String,
    /// (major, minor), e.g. (13, 0).
    pub version: (i32, i32),
    /// Virtual architectures this NVRTC can emit SASS for (e.g. 80, 86, 89, 90, 100, ...).
    pub supported_archs: Vec<u32>,
}

/// What NVRTC produced for one program.
pub struct Output {
    /// The cubin, or the PTX text with its NUL terminator.
    pub image: Vec<u8>,
    /// Lowered names, one per name expression, in order.
    pub lowered_names: Vec<String>,
    /// NVRTC's log (its warnings, if any).
    pub log: String,
}

/// A failed compile: the NVRTC log.
pub struct CompileFailure {
    /// NVRTC's log, with the errors.
    pub log: String,
}

static NVRTC: OnceLock<Result<Nvrtc>> = OnceLock::new();
static LIBRARY: OnceLock<libloading::Library> = OnceLock::new();
static EXIT_WAIT: std::sync::Once = std::sync::Once::new();

impl Nvrtc {
    /// Finds and loads NVRTC once per process. `explicit` is `KILN_NVRTC_LIB`.
    pub fn get(explicit: Option<&Path>) -> Result<&'static Nvrtc> {
        // A failure is remembered and returned again, as the same typed error.
        NVRTC
            .get_or_init(|| load(explicit))
            .as_ref()
            .map_err(Error::clone)
    }

    /// The version as `major.minor`, as cache keys record it.
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version.0, self.version.1)
    }

    /// Whether this NVRTC can emit SASS for architecture `arch` (e.g. 90).
    pub fn supports_sass(&self, arch: u32) -> bool {
        self.supported_archs.contains(&arch)
    }

    /// Compiles `source`; the image is a cubin unless the options name a `compute_XY` target.
    pub fn compile(
        &self,
        program_name: &str,
        source: &str,
        name_expressions: &[String],
        options: &[String],
        ptx: bool,
    ) -> Result<std::result::Result<Output, CompileFailure>> {
        EXIT_WAIT.call_once(|| {
            // A trivial compile first creates what NVRTC creates on first use, so that the
            // exit handler registered after it runs before every destructor NVRTC registers.
            let trivial = "extern \"C\" __global__ void kiln_first() {}";
            let _ = self.compile_unguarded("kiln_first", trivial, &[], &[], true);
            super::exit_wait::register_at_exit();
        });
        // Held until the program is destroyed: exit waits for it (see `exit_wait`).
        let _in_flight = super::exit_wait::Call::start("nvrtcCreateProgram")?;
        self.compile_unguarded(program_name, source, name_expressions, options, ptx)
    }

    /// [`Nvrtc::compile`] without the exit guard: its body, and the first, trivial compile.
    fn compile_unguarded(
        &self,
        program_name: &str,
        source: &str,
        name_expressions: &[String],
        options: &[String],
        ptx: bool,
    ) -> Result<std::result::Result<Output, CompileFailure>> {
        let c_source = cstring(source, "source")?;
        let c_name = cstring(program_name, "program name")?;
        let mut prog: sys::nvrtcProgram = ptr::null_mut();
        // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call; no
        // headers are passed (counts 0, null arrays).
        check("nvrtcCreateProgram", unsafe {
            sys::nvrtcCreateProgram(
                &mut prog,
                c_source.as_ptr(),
                c_name.as_ptr(),
                0,
                ptr::null(),
                ptr::null(),
            )
        })?;
        let program = Program(prog);
        let c_names = name_expressions
            .iter()
            .map(|n| cstring(n, "name expression"))
            .collect::<Result<Vec<_>>>()?;
        for n in &c_names {
            // SAFETY: `program` is live; the string outlives the program (NVRTC copies it anyway).
            check("nvrtcAddNameExpression", unsafe {
                sys::nvrtcAddNameExpression(program.0, n.as_ptr())
            })?;
        }
        let c_options = options
            .iter()
            .map(|o| cstring(o, "option"))
            .collect::<Result<Vec<_>>>()?;
        let option_ptrs: Vec<*const c_char> = c_options.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: the option array and its strings are live for the call.
        let status = unsafe {
            sys::nvrtcCompileProgram(program.0, option_ptrs.len() as c_int, option_ptrs.as_ptr())
        };
        let log = program.log()?;
        if status == sys::nvrtcResult::NVRTC_ERROR_COMPILATION {
            return Ok(Err(CompileFailure { log }));
        }
        check("nvrtcCompileProgram", status)?;
        let image = if ptx {
            program.ptx()?
        } else {
            program.cubin()?
        };
        let mut lowered_names = Vec::with_capacity(c_names.len());
        for n in &c_names {
            let mut lowered: *const c_char = ptr::null();
            // SAFETY: the program compiled with this name expression added; NVRTC owns the
            // returned string until the program is destroyed, and we copy it out at once.
            check("nvrtcGetLoweredName", unsafe {
                sys::nvrtcGetLoweredName(program.0, n.as_ptr(), &mut lowered)
            })?;
            let name = unsafe { CStr::from_ptr(lowered) };
            lowered_names.push(name.to_string_lossy().into_owned());
        }
        Ok(Ok(Output {
            image,
            lowered_names,
            log,
        }))
    }
}

/// Destroys the NVRTC program on every path out of `compile`.
struct Program(sys::nvrtcProgram);

impl Program {
    fn log(&self) -> Result<String> {
        let mut size = 0usize;
        check("nvrtcGetProgramLogSize", unsafe {
            sys::nvrtcGetProgramLogSize(self.0, &mut size)
        })?;
        let mut buf = vec![0u8; size.max(1)];
        check("nvrtcGetProgramLog", unsafe {
            sys::nvrtcGetProgramLog(self.0, buf.as_mut_ptr().cast())
        })?;
        Ok(c_buffer_to_string(buf))
    }

    fn cubin(&self) -> Result<Vec<u8>> {
        let mut size = 0usize;
        check("nvrtcGetCUBINSize", unsafe {
            sys::nvrtcGetCUBINSize(self.0, &mut size)
        })?;
        let mut buf = vec![0u8; size];
        check("nvrtcGetCUBIN", unsafe {
            sys::nvrtcGetCUBIN(self.0, buf.as_mut_ptr().cast())
        })?;
        Ok(buf)
    }

    /// PTX text, kept with its NUL terminator so it can be passed to the driver as is.
    fn ptx(&self) -> Result<Vec<u8>> {
        let mut size = 0usize;
        check("nvrtcGetPTXSize", unsafe {
            sys::nvrtcGetPTXSize(self.0, &mut size)
        })?;
        let mut buf = vec![0u8; size];
        check("nvrtcGetPTX", unsafe {
            sys::nvrtcGetPTX(self.0, buf.as_mut_ptr().cast())
        })?;
        Ok(buf)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed only here.
        unsafe {
            sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn c_buffer_to_string(mut buf: Vec<u8>) -> String {
    if let Some(end) = buf.iter().position(|&b| b == 0) {
        buf.truncate(end);
    }
    String::from_utf8_lossy(&buf).trim_end().to_string()
}

fn cstring(s: &str, what: &'static str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidArgument {
        arg: what,
        reason: "contains a NUL byte".into(),
    })
}

fn check(call: &'static str, status: sys::nvrtcResult) -> Result<()> {
    if status == sys::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static string for any status.
    let message = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(status)) }
        .to_string_lossy()
        .into_owned();
    Err(Error::Nvrtc { call, message })
}

/// The places kiln looks for libnvrtc before any Python environment, in order. Directory
/// entries are searched for the known library names (`SONAMES`); the linker entry hands bare
/// sonames to the dynamic linker.
pub fn search_locations(explicit: Option<&Path>) -> Vec<Location> {
    let mut out = Vec::new();
    if let Some(p) = explicit {
        out.push(Location::File(p.to_path_buf()));
        return out; // an explicit choice is never second-guessed
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            let root = PathBuf::from(root);
            out.push(Location::Dir(root.join("lib64")));
            out.push(Location::Dir(root.join("lib")));
        }
    }
    out.push(Location::Dir(PathBuf::from("/usr/local/cuda/lib64")));
    out.push(Location::Linker);
    out
}

/// The last resort, asked only when [`search_locations`] found nothing: library folders of the
/// `nvidia-cuda-nvrtc` wheel in the active Python environment (`ask_python` false), or in that
/// of `python3` on the PATH (true; see [`python_library_dirs`]).
fn python_locations(ask_python: bool) -> Vec<Location> {
    // cu13 wheels put the library in nvidia/cu13/lib, cu12 wheels in nvidia/cuda_nvrtc/lib.
    let subdirs = [
        "nvidia/cu13/lib",
        "nvidia/cuda_nvrtc/lib",
        "nvidia/cu12/lib",
    ];
    python_library_dirs(&subdirs, ask_python)
        .into_iter()
        .map(Location::Dir)
        .collect()
}

/// One place kiln looks for libnvrtc.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// The file `KILN_NVRTC_LIB` names (then the only place looked in).
    File(PathBuf),
    /// A folder searched for the known library names.
    Dir(PathBuf),
    /// The dynamic linker, asked for the known sonames.
    Linker,
    /// No Python environment with the wheel was found (listed so the error says so).
    NoWheel,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::File(p) => write!(f, "{} (KILN_NVRTC_LIB)", p.display()),
            Location::Dir(p) => write!(f, "{}", p.display()),
            Location::Linker => write!(f, "the dynamic linker's path ({})", SONAMES.join(", ")),
            Location::NoWheel => write!(
                f,
                "Python environments (VIRTUAL_ENV, CONDA_PREFIX, python3's sys.path): \
                 no nvidia-cuda-nvrtc wheel"
            ),
        }
    }
}

/// The folders `subdirs` (relative to site-packages, where NVIDIA's wheels put their libraries)
/// that exist in a Python environment: with `ask_python` false the active virtual or conda
/// environment's, with it true those of `python3` on the PATH. Starting `python3` costs 0.1-0.5
/// s (more behind a pyenv shim), so callers ask it only when the active environment's folders
/// did not have what they need.
pub(crate) fn python_library_dirs(subdirs: &[&str], ask_python: bool) -> Vec<PathBuf> {
    if ask_python {
        return existing_subdirs(&python_sys_path(), subdirs);
    }
    let mut site_dirs: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        let Some(prefix) = std::env::var_os(var).filter(|v| !v.is_empty()) else {
            continue;
        };
        let prefix = PathBuf::from(prefix);
        for lib in ["lib", "lib64"] {
            if let Ok(entries) = std::fs::read_dir(prefix.join(lib)) {
                for e in entries.flatten() {
                    if e.file_name().to_string_lossy().starts_with("python") {
                        site_dirs.push(e.path().join("site-packages"));
                    }
                }
            }
        }
    }
    existing_subdirs(&site_dirs, subdirs)
}

/// Each existing `site/sub` of `sites` x `subdirs`, in order, once.
fn existing_subdirs(sites: &[PathBuf], subdirs: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for site in sites {
        for sub in subdirs {
            let dir = site.join(sub);
            if dir.is_dir() && !out.contains(&dir) {
                out.push(dir);
            }
        }
    }
    out
}

/// `sys.path` of `python3` on the PATH, if there is one.
fn python_sys_path() -> Vec<PathBuf> {
    let output = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys; print('\\n'.join(p for p in sys.path if p))",
        ])
        .stderr(std::process::Stdio::null())
        .output();
    match output {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}

fn open(path: &Path) -> std::result::Result<libloading::Library, String> {
    // SAFETY: loading libnvrtc runs its initialisers, which have no preconditions.
    unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())
}

/// Opens the first libnvrtc found. The Python probe (which may start `python3`) runs only when
/// everything before it failed.
fn find_and_open(explicit: Option<&Path>) -> Result<(String, libloading::Library)> {
    let mut searched = Vec::new();
    let mut try_locations = |locations: Vec<Location>| -> Option<(String, libloading::Library)> {
        for loc in locations {
            searched.push(loc.to_string());
            match &loc {
                Location::File(p) => {
                    if let Ok(lib) = open(p) {
                        return Some((p.display().to_string(), lib));
                    }
                }
                Location::Dir(d) => {
                    for name in SONAMES {
                        let p = d.join(name);
                        if p.exists() {
                            if let Ok(lib) = open(&p) {
                                return Some((p.display().to_string(), lib));
                            }
                        }
                    }
                }
                Location::Linker => {
                    for name in SONAMES {
                        if let Ok(lib) = open(Path::new(name)) {
                            return Some((format!("{name} (dynamic linker path)"), lib));
                        }
                    }
                }
                Location::NoWheel => {}
            }
        }
        None
    };
    if let Some(found) = try_locations(search_locations(explicit)) {
        return Ok(found);
    }
    if explicit.is_none() {
        // The active environment first: asking python3 starts a process.
        let active = python_locations(false);
        let none_active = active.is_empty();
        if let Some(found) = try_locations(active) {
            return Ok(found);
        }
        let mut asked = python_locations(true);
        if asked.is_empty() && none_active {
            asked.push(Location::NoWheel);
        }
        if let Some(found) = try_locations(asked) {
            return Ok(found);
        }
    }
    if let Some(p) = explicit {
        return Err(Error::NvrtcLoad {
            path: p.to_path_buf(),
            reason: "KILN_NVRTC_LIB names a file that could not be loaded as a library".into(),
        });
    }
    Err(Error::NvrtcNotFound { searched })
}

fn load(explicit: Option<&Path>) -> Result<Nvrtc> {
    let (path, lib) = find_and_open(explicit)?;
    let version = {
        type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> sys::nvrtcResult;
        // SAFETY: nvrtcVersion has this signature in every NVRTC release.
        let f: libloading::Symbol<VersionFn> =
            unsafe { lib.get(b"nvrtcVersion\0") }.map_err(|e| Error::NvrtcLoad {
                path: PathBuf::from(&path),
                reason: format!("not an NVRTC library: {e}"),
            })?;
        let (mut major, mut minor) = (0, 0);
        check("nvrtcVersion", unsafe { f(&mut major, &mut minor) })?;
        (major, minor)
    };
    // An NVRTC kiln cannot drive (11 or older) is refused by name, before cudarc looks for it.
    super::compat::nvrtc_supported(version).map_err(|reason| Error::NvrtcLoad {
        path: PathBuf::from(&path),
        reason,
    })?;
    // Keep our handle open for the life of the process, so cudarc's lookup by soname finds it.
    let _ = LIBRARY.set(lib);
    // Exit waits for compiles in flight before the destructors NVRTC registered on loading;
    // `Nvrtc::compile` registers the wait again after its first compile (see `exit_wait`).
    super::exit_wait::register_at_exit();
    // SAFETY: is_culib_present only tries to dlopen the candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::NvrtcLoad {
            path: PathBuf::from(&path),
            reason: "its soname is not one cudarc looks for (libnvrtc.so.12 or .13 expected)"
                .into(),
        });
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: cudarc resolves the library we just checked for.
    check("nvrtcVersion", unsafe {
        sys::nvrtcVersion(&mut major, &mut minor)
    })?;
    if (major, minor) != version {
        return Err(Error::NvrtcLoad {
            path: PathBuf::from(&path),
            reason: format!(
                "the dynamic linker resolves a different libnvrtc ({major}.{minor}) than the one \
                 kiln found ({}.{}); set KILN_NVRTC_LIB or fix LD_LIBRARY_PATH",
                version.0, version.1
            ),
        });
    }
    let mut count: c_int = 0;
    check("nvrtcGetNumSupportedArchs", unsafe {
        sys::nvrtcGetNumSupportedArchs(&mut count)
    })?;
    let mut archs = vec![0 as c_int; count.max(0) as usize];
    check("nvrtcGetSupportedArchs", unsafe {
        sys::nvrtcGetSupportedArchs(archs.as_mut_ptr())
    })?;
    Ok(Nvrtc {
        path,
        version,
        supported_archs: archs.into_iter().map(|a| a as u32).collect(),
    })
}
