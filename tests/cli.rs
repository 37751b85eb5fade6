//! The `kiln` command as a user runs it, on a CPU-only machine or with a GPU.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

/// A subset of the registered specs (the nine strided-copy casts), to keep each run short.
const SUBSET: &str = "copy ";

fn kiln(cache: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(common::kiln_bin());
    c.args(args)
        .env("KILN_CACHE_DIR", cache)
        .env_remove("KILN_CACHE");
    c
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("kiln runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "kiln panicked: {stderr}");
    out
}

/// The JSON object on the last line of stdout.
fn last_json(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn warm(cache: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["warm", "--arch", "sm_90", "--only", SUBSET, "--json"];
    args.extend_from_slice(extra);
    let out = run(&mut kiln(cache, &args));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    last_json(&out)
}

fn subset_size() -> u64 {
    let n = kiln::ops::registered_specs()
        .iter()
        .filter(|s| s.to_string().contains(SUBSET))
        .count() as u64;
    assert!(n > 1, "the subset {SUBSET:?} must select several specs");
    n
}

#[test]
fn a_second_warm_is_all_hits() {
    let dir = tempfile::tempdir().unwrap();
    let n = subset_size();
    let first = warm(dir.path(), &[]);
    assert_eq!(first["specs"], n);
    assert_eq!(first["compiled"], n);
    assert_eq!(first["failed"], 0);
    let second = warm(dir.path(), &[]);
    assert_eq!(second["cached"], n);
    assert_eq!(second["compiled"], 0);
}

#[test]
fn four_concurrent_warms_on_an_empty_cache_all_succeed_and_verify_clean() {
    let dir = tempfile::tempdir().unwrap();
    let children: Vec<_> = (0..4)
        .map(|_| {
            kiln(
                dir.path(),
                &[
                    "warm", "--arch", "sm_90", "--only", SUBSET, "--jobs", "1", "--json",
                ],
            )
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(last_json(&out)["failed"], 0);
    }
    let out = run(&mut kiln(dir.path(), &["cache", "verify", "--json"]));
    assert!(out.status.success());
    let report = last_json(&out);
    assert_eq!(report["checked"], subset_size());
    assert_eq!(report["bad"].as_array().unwrap().len(), 0);
    // No temp file was left behind.
    let out = run(&mut kiln(dir.path(), &["cache", "gc", "--json"]));
    assert_eq!(last_json(&out)["temp_files_removed"], 0);
}

#[test]
fn cache_off_ro_and_unwritable_directories_still_warm() {
    let dir = tempfile::tempdir().unwrap();
    let n = subset_size();

    let off = run(kiln(
        dir.path(),
        &["warm", "--arch", "sm_90", "--only", SUBSET, "--json"],
    )
    .env("KILN_CACHE", "off"));
    assert!(off.status.success());
    assert_eq!(last_json(&off)["compiled"], n);
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "off wrote files"
    );

    let ro = run(kiln(
        dir.path(),
        &["warm", "--arch", "sm_90", "--only", SUBSET, "--json"],
    )
    .env("KILN_CACHE", "ro"));
    assert!(ro.status.success());
    assert_eq!(last_json(&ro)["cache_entries"], 0);

    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let out = run(&mut kiln(
        &blocker.join("cache"),
        &["warm", "--arch", "sm_90", "--only", SUBSET, "--json"],
    ));
    assert!(out.status.success());
    let summary = last_json(&out);
    assert_eq!(summary["compiled"], n);
    assert_eq!(summary["cache_writable"], false);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.matches("cannot be written").count(),
        1,
        "one warning: {stderr}"
    );
}

#[test]
fn stats_ls_clear_report_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    warm(dir.path(), &["--arch", "sm_80"]);
    let n = subset_size() * 2;
    let stats = last_json(&run(&mut kiln(dir.path(), &["cache", "stats", "--json"])));
    assert_eq!(stats["entries"], n);
    assert!(stats["bytes"].as_u64().unwrap() > 0);

    let ls = run(&mut kiln(dir.path(), &["cache", "ls", "--json"]));
    let lines: Vec<Value> = String::from_utf8_lossy(&ls.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len() as u64, n);
    assert!(lines
        .iter()
        .all(|l| l["spec"].as_str().unwrap().contains(SUBSET)));
    assert!(lines.iter().any(|l| l["target"] == "sm_80"));

    let path = run(&mut kiln(dir.path(), &["cache", "path"]));
    assert!(String::from_utf8_lossy(&path.stdout)
        .trim()
        .starts_with(dir.path().to_str().unwrap()));

    let clear = run(&mut kiln(dir.path(), &["cache", "clear"]));
    assert!(clear.status.success());
    let stats = last_json(&run(&mut kiln(dir.path(), &["cache", "stats", "--json"])));
    assert_eq!(stats["entries"], 0);
}

#[test]
fn verify_fails_on_a_damaged_entry_and_removes_it() {
    let dir = tempfile::tempdir().unwrap();
    warm(dir.path(), &[]);
    let ls = run(&mut kiln(dir.path(), &["cache", "ls", "--json"]));
    let first: Value =
        serde_json::from_str(String::from_utf8_lossy(&ls.stdout).lines().next().unwrap()).unwrap();
    let key = first["key"].as_str().unwrap();
    let entry = dir
        .path()
        .join("v1")
        .join(&key[..2])
        .join(format!("{key}.kiln"));
    let len = std::fs::metadata(&entry).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&entry)
        .unwrap()
        .set_len(len - 10)
        .unwrap();

    let out = run(&mut kiln(dir.path(), &["cache", "verify", "--json"]));
    assert!(
        !out.status.success(),
        "verify must fail when it finds a bad entry"
    );
    assert_eq!(last_json(&out)["bad"].as_array().unwrap().len(), 1);
    assert!(!entry.exists());
    // The next warm puts it back.
    assert_eq!(warm(dir.path(), &[])["compiled"], 1);
}

#[test]
fn info_reports_nvrtc_cache_and_environment() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(kiln(dir.path(), &["info", "--json"]).env("MLX_MAX_OPS_PER_BUFFER", "40"));
    assert!(out.status.success());
    let info = last_json(&out);
    assert_eq!(info["nvrtc"]["found"], true, "{info}");
    assert!(info["nvrtc"]["version"].as_str().unwrap().contains('.'));
    assert!(info["cache"]["dir"]
        .as_str()
        .unwrap()
        .starts_with(dir.path().to_str().unwrap()));
    assert_eq!(info["env"]["MLX_MAX_OPS_PER_BUFFER"], "40");
    assert!(info["registered_specs"].as_u64().unwrap() > 0);
    assert!(info["gpus"].is_array() || info["gpus"]["error"].is_string());
    // Found or not, NCCL is reported; missing, with the reason.
    let nccl = &info["nccl"];
    assert!(
        nccl["found"] == true && nccl["version"].is_string()
            || nccl["found"] == false && nccl["error"].as_str().unwrap().contains("NCCL"),
        "{info}"
    );
}

#[test]
fn a_missing_nvrtc_is_a_clear_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let out =
        run(kiln(dir.path(), &["warm"]).env("KILN_NVRTC_LIB", dir.path().join("libnvrtc.so.404")));
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("KILN_NVRTC_LIB"), "{stderr}");
    assert!(stderr.contains("libnvrtc.so.404"), "{stderr}");
}

#[test]
fn bad_arguments_and_environment_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    // Older than Volta, and not a target at all.
    for arch in ["sm_61", "gfx90a"] {
        let out = run(&mut kiln(dir.path(), &["warm", "--arch", arch]));
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains(arch));
    }
    let out = run(kiln(dir.path(), &["warm", "--only", "copy "]).env("KILN_EMULATE_ARCH", "75"));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("KILN_EMULATE_ARCH"));
    let out = run(kiln(dir.path(), &["cache", "stats"]).env("KILN_CACHE", "sometimes"));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("KILN_CACHE"));
}

#[test]
fn check_without_a_gpu_skips_unless_one_is_required() {
    if kiln::runtime::gpus().is_ok_and(|g| !g.is_empty()) {
        return; // covered by the GPU tests
    }
    let dir = tempfile::tempdir().unwrap();
    let out = run(kiln(dir.path(), &["check"]).env_remove("KILN_REQUIRE_GPU"));
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("skipped"));
    let out = run(kiln(dir.path(), &["check"]).env("KILN_REQUIRE_GPU", "1"));
    assert!(!out.status.success());
    // A value that is not a boolean is an error naming the variable, not a silent "no".
    let out = run(kiln(dir.path(), &["check"]).env("KILN_REQUIRE_GPU", "perhaps"));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("KILN_REQUIRE_GPU"));
}

/// The NVRTC 12 library `scripts/setup.sh` installs in the project's Python environment (the
/// `nvidia-cuda-nvrtc-cu12` wheel), or `KILN_NVRTC12_LIB`.
fn nvrtc_12() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("KILN_NVRTC12_LIB") {
        return p.into();
    }
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/lib");
    std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            e.path()
                .join("site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
        })
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "no libnvrtc.so.12 under {}: run scripts/setup.sh (it installs \
                 nvidia-cuda-nvrtc-cu12) or set KILN_NVRTC12_LIB",
                lib.display()
            )
        })
}

/// Volta (sm_70, Jetson Xavier's sm_72) needs NVRTC 12: CUDA 13's NVRTC refuses the targets and
/// names the wheel that has it; with that wheel every spec kiln registers for Volta compiles.
#[test]
fn volta_warms_with_nvrtc_12_which_nvrtc_13_names() {
    let dir = tempfile::tempdir().unwrap();
    let refused = run(kiln(dir.path(), &["warm", "--arch", "sm_70"]).env_remove("KILN_NVRTC_LIB"));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    if refused.status.success() {
        // An NVRTC 12 found first (a CUDA 12 toolkit) compiles for Volta itself.
        assert!(
            stderr.is_empty() || !stderr.contains("cannot compile"),
            "{stderr}"
        );
    } else {
        assert_eq!(refused.status.code(), Some(2));
        assert!(
            stderr.contains("sm_70") && stderr.contains("nvidia-cuda-nvrtc-cu12"),
            "{stderr}"
        );
    }

    let out = run(kiln(
        dir.path(),
        &[
            "warm", "--arch", "sm_70", "--arch", "sm_72", "--jobs", "2", "--json",
        ],
    )
    .env("KILN_NVRTC_LIB", nvrtc_12()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = last_json(&out);
    assert!(
        report["nvrtc"].as_str().unwrap().starts_with("12."),
        "{report}"
    );
    let volta = kiln::ops::registered_specs_for(70);
    assert_eq!(kiln::ops::registered_specs_for(72), volta);
    assert_eq!(report["specs"], 2 * volta.len() as u64, "{report}");
    assert_eq!(report["failed"], 0, "{report}");
}

/// `kiln cache export` then `import` into an empty cache: the importing side's warm is all hits,
/// and `--arch` keeps only that architecture's entries.
#[test]
fn an_exported_bundle_imports_into_an_all_hit_warm() {
    let (from, to) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let n = subset_size();
    warm(from.path(), &["--arch", "sm_80"]);
    let bundle = from.path().join("cache.kilnpack");
    let b = bundle.to_str().unwrap();
    let out = run(&mut kiln(from.path(), &["cache", "export", b, "--json"]));
    assert!(out.status.success());
    assert_eq!(last_json(&out)["entries"], 2 * n);
    let only80 = from.path().join("sm80.kilnpack");
    let out = run(&mut kiln(
        from.path(),
        &[
            "cache",
            "export",
            only80.to_str().unwrap(),
            "--arch",
            "sm_80",
            "--json",
        ],
    ));
    assert_eq!(last_json(&out)["entries"], n);

    let out = run(&mut kiln(to.path(), &["cache", "import", b, "--json"]));
    assert!(out.status.success());
    let report = last_json(&out);
    assert_eq!(report["entries"], 2 * n, "{report}");
    assert_eq!(report["damaged"].as_array().unwrap().len(), 0);
    let again = warm(to.path(), &["--arch", "sm_80"]);
    assert_eq!(
        (again["cached"].clone(), again["compiled"].clone()),
        (json(2 * n), json(0))
    );
    // A second import finds everything present.
    let out = run(&mut kiln(to.path(), &["cache", "import", b, "--json"]));
    assert_eq!(last_json(&out)["already_present"], 2 * n);
}

fn json(n: u64) -> Value {
    Value::from(n)
}

/// A bundle with one flipped byte inside an entry: that entry is reported and left out, every
/// other one is imported, and the cache verifies clean.
#[test]
fn a_damaged_bundle_leaves_nothing_bad_in_the_cache() {
    let (from, to) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let n = subset_size();
    warm(from.path(), &[]);
    let bundle = from.path().join("cache.kilnpack");
    let b = bundle.to_str().unwrap();
    assert!(run(&mut kiln(from.path(), &["cache", "export", b]))
        .status
        .success());
    let mut bytes = std::fs::read(&bundle).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&bundle, &bytes).unwrap();

    let out = run(&mut kiln(to.path(), &["cache", "import", b, "--json"]));
    assert_eq!(
        out.status.code(),
        Some(1),
        "a damaged entry fails the import"
    );
    let report = last_json(&out);
    assert_eq!(report["damaged"].as_array().unwrap().len(), 1, "{report}");
    assert_eq!(report["entries"], n - 1, "{report}");
    let verify = run(&mut kiln(to.path(), &["cache", "verify", "--json"]));
    assert!(verify.status.success());
    assert_eq!(last_json(&verify)["checked"], n - 1);
    assert_eq!(warm(to.path(), &[])["compiled"], 1);
    // Not a bundle at all: an error, nothing imported.
    let junk = from.path().join("junk");
    std::fs::write(&junk, b"hello").unwrap();
    let out = run(&mut kiln(
        to.path(),
        &["cache", "import", junk.to_str().unwrap()],
    ));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a kiln cache bundle"));
}

/// With no NVRTC at all (KILN_NVRTC_LIB names nothing, so nothing else is searched), a warmed
/// cache still serves every spec up to the point of loading: warm reports all hits.
#[test]
fn a_warmed_cache_serves_every_spec_without_nvrtc() {
    let dir = tempfile::tempdir().unwrap();
    let n = subset_size();
    warm(dir.path(), &[]);
    let no_nvrtc = dir.path().join("no-libnvrtc.so");
    let out = run(kiln(
        dir.path(),
        &["warm", "--arch", "sm_90", "--only", SUBSET, "--json"],
    )
    .env("KILN_NVRTC_LIB", &no_nvrtc));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = last_json(&out);
    assert_eq!(report["cached"], n, "{report}");
    assert_eq!(report["nvrtc"], "none");
    let verify =
        run(kiln(dir.path(), &["cache", "verify", "--json"]).env("KILN_NVRTC_LIB", &no_nvrtc));
    assert!(verify.status.success());
    assert_eq!(last_json(&verify)["ok"], n);
    // A spec the cache lacks names the missing NVRTC.
    let out = run(
        kiln(dir.path(), &["warm", "--arch", "sm_80", "--only", SUBSET])
            .env("KILN_NVRTC_LIB", &no_nvrtc),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs NVRTC"));
}

/// Entries another NVRTC version made for the same exact target are used when this NVRTC has
/// none: a cache warmed with NVRTC 12 is all hits for NVRTC 13.
#[test]
fn another_nvrtc_versions_entries_are_hits() {
    let dir = tempfile::tempdir().unwrap();
    let n = subset_size();
    let out = run(kiln(
        dir.path(),
        &["warm", "--arch", "sm_80", "--only", SUBSET, "--json"],
    )
    .env("KILN_NVRTC_LIB", nvrtc_12()));
    let first = last_json(&out);
    assert!(
        first["nvrtc"].as_str().unwrap().starts_with("12."),
        "{first}"
    );
    assert_eq!(first["compiled"], n);
    let out = run(&mut kiln(
        dir.path(),
        &["warm", "--arch", "sm_80", "--only", SUBSET, "--json"],
    ));
    let second = last_json(&out);
    if second["nvrtc"] == first["nvrtc"] {
        return; // the default NVRTC is NVRTC 12 here: nothing to show
    }
    assert_eq!(second["cached"], n, "{second}");
    assert_eq!(second["compiled"], 0, "{second}");
}
