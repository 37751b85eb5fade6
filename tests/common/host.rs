//! The host harness (`tests/host/`): kiln's kernels compiled as plain C++ and run with each
//! block's threads as OS threads (`cuda_host.h`), for tests that check kernels without a GPU.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use sha2::{Digest, Sha256};

/// The C++20 compiler: `CXX`, else `g++`, else `c++`; `None` (the caller skips) when none runs,
/// unless `KILN_REQUIRE_HOST_CXX=1`, which fails instead.
pub fn compiler() -> Option<String> {
    let candidates = std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["g++".to_string(), "c++".to_string()]);
    for cxx in candidates {
        let ok = Command::new(&cxx)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Some(cxx);
        }
    }
    if std::env::var("KILN_REQUIRE_HOST_CXX").as_deref() == Ok("1") {
        panic!("KILN_REQUIRE_HOST_CXX=1 but no C++ compiler (CXX, g++, c++) runs");
    }
    None
}

pub fn host_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/host")
}

/// The host executable of `runner` (a file in `tests/host/`) around the kernel `source`, compiled
/// once per source, runner, headers and `defines` (`-D` arguments) with AddressSanitizer and
/// UndefinedBehaviorSanitizer; `label` names the kernel in a failure.
pub fn executable(
    cxx: &str,
    source: &str,
    runner: &str,
    defines: &[&str],
    label: &dyn std::fmt::Display,
) -> PathBuf {
    let mut h = Sha256::new();
    h.update(cxx);
    h.update(source);
    for d in defines {
        h.update(d);
    }
    // Every file of the harness (headers and runners), so that an edit to any rebuilds.
    let mut files: Vec<_> = std::fs::read_dir(host_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in files {
        h.update(std::fs::read(f).unwrap());
    }
    h.update(runner);
    let key: String = h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = std::env::temp_dir().join("kiln-host");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join(format!("run-{key}"));
    if exe.exists() {
        return exe;
    }
    // Paths of this call's own: tests run as threads of one process, and two of them may compile
    // the same source at once (one would rename or rewrite the other's files).
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let call = format!(
        "{}.{}",
        std::process::id(),
        CALLS.fetch_add(1, Ordering::Relaxed)
    );
    let kernel = dir.join(format!("kernel-{key}.{call}.cu"));
    std::fs::write(&kernel, source).unwrap();
    let partial = dir.join(format!("run-{key}.{call}.tmp"));
    // The portable paths (sm_70) unless the defines name an architecture.
    let arch = if defines.iter().any(|d| d.starts_with("KILN_ARCH=")) {
        None
    } else {
        Some("-DKILN_ARCH=700")
    };
    let out = Command::new(cxx)
        // -g1: line tables for the sanitizers' reports, a third less compile time than -g.
        .args(["-std=c++20", "-O1", "-g1", "-pthread", "-x", "c++"])
        .args(["-fsanitize=address,undefined", "-fno-sanitize-recover=all"])
        .args(["-DKILN_HOST", "-Wno-unknown-pragmas"])
        .args(arch)
        .args(defines.iter().map(|d| format!("-D{d}")))
        .arg(format!("-DKILN_KERNEL=\"{}\"", kernel.display()))
        .arg(format!("-I{}", host_dir().display()))
        .arg(host_dir().join(runner))
        .arg("-o")
        .arg(&partial)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{label}: the host compile failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Renamed into place, so that tests compiling the same spec at once do not collide.
    std::fs::rename(&partial, &exe).unwrap();
    exe
}

/// Appends `bytes` as the runners read a buffer: its length (u64), then the bytes.
pub fn push_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    buf.extend_from_slice(bytes);
}

/// Runs `check` on every case, on as many threads as the machine has cores (each host run is a
/// process of its own), in no fixed order; the failures `check` reports, each case's in order.
pub fn run_cases<C: Sync>(
    cases: &[C],
    check: impl Fn(usize, &C) -> Vec<String> + Sync,
) -> Vec<String> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(c) = cases.get(i) else { break };
                let found = check(i, c);
                failures.lock().unwrap().extend(found);
            });
        }
    });
    failures.into_inner().unwrap()
}
