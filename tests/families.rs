//! Application kernel families: identity, name clashes, extras (partials, entry points, options).

mod common;

use kiln::jit::{register_family, template, FamilyExtras, KernelSpec, Target, TemplateDef};
use kiln::{DType, Error};

const SOURCE: &str =
    "{{> prelude}}\nextern \"C\" __global__ void {{kernel}}(float* p) { p[0] = {{block_dim}}; }\n";

static FIRST: TemplateDef = TemplateDef {
    name: "test_dup_family",
    source: SOURCE,
    kernel: "test_dup_family",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

static SECOND: TemplateDef = TemplateDef {
    name: "test_dup_family",
    source: "extern \"C\" __global__ void {{kernel}}(float* p) { p[0] = -1; }\n",
    kernel: "test_dup_family",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

/// An application family that took the name of one of kiln's ops.
static APP_AXPBY: TemplateDef = TemplateDef {
    name: "axpby",
    source: "extern \"C\" __global__ void {{kernel}}() {}\n",
    kernel: "kiln_axpby",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

fn clash(err: Error) -> String {
    match err {
        Error::InvalidArgument {
            arg: "template",
            reason,
        } => reason,
        other => panic!("expected a name clash, got {other:?}"),
    }
}

#[test]
fn two_families_with_one_name_are_refused() {
    let a = KernelSpec::try_new(&FIRST, DType::F32, 32, 1, &[]).unwrap();
    let reason = clash(KernelSpec::try_new(&SECOND, DType::F32, 32, 1, &[]).unwrap_err());
    assert!(reason.contains("test_dup_family"), "{reason}");
    assert!(register_family(&SECOND, FamilyExtras::NONE).is_err());
    // A spec built field by field (bypassing try_new) is refused when it is rendered.
    let forged = KernelSpec {
        template: &SECOND,
        ..a
    };
    assert_ne!(a, forged, "specs of different families never compare equal");
    assert!(template::render(&forged).is_err());
    assert!(template::render(&a).unwrap().source.contains("p[0] = 32"));
}

#[test]
fn a_family_named_like_one_of_kilns_is_refused_and_kilns_op_is_untouched() {
    let reason = clash(KernelSpec::try_new(&APP_AXPBY, DType::F32, 256, 1, &[]).unwrap_err());
    assert!(reason.contains("kiln's own"), "{reason}");
    let forged = KernelSpec {
        template: &APP_AXPBY,
        ..kiln::ops::axpby::spec(DType::F32)
    };
    assert_ne!(forged, kiln::ops::axpby::spec(DType::F32));
    assert!(template::render(&forged).is_err());
    // kiln's own axpby still renders its own text.
    let ours = template::render(&kiln::ops::axpby::spec(DType::F32)).unwrap();
    assert!(ours.source.contains("a * kiln_to_float(x[i])"));
}

static WITH_EXTRAS: TemplateDef = TemplateDef {
    name: "test_with_extras",
    source: "{{> prelude}}\n{{> test_helper}}\nextern \"C\" __global__ void {{kernel}}(float* p) { p[0] = helper({{SCALE}}); }\nextern \"C\" __global__ void test_second(float* p) { p[1] = TEST_OPTION; }\n",
    kernel: "test_with_extras",
    const_names: &["SCALE"],
    arch_specific: false,
    only_arch: None,
};

const EXTRAS: FamilyExtras = FamilyExtras {
    partials: &[(
        "test_helper",
        "__device__ float helper(int s) { return s * {{block_dim}}; }",
    )],
    entry_points: &["test_second"],
    options: &["-DTEST_OPTION=3"],
};

#[test]
fn extras_reach_the_source_the_name_expressions_and_the_options() {
    register_family(&WITH_EXTRAS, EXTRAS).unwrap();
    register_family(&WITH_EXTRAS, EXTRAS).unwrap(); // the same again: fine
    let other = FamilyExtras {
        options: &["-DTEST_OPTION=4"],
        ..EXTRAS
    };
    assert!(register_family(&WITH_EXTRAS, other).is_err());
    let spec = KernelSpec::try_new(&WITH_EXTRAS, DType::F32, 64, 1, &[5]).unwrap();
    let r = template::render(&spec).unwrap();
    assert!(r.source.contains("return s * 64;"), "{}", r.source);
    assert_eq!(r.name_expressions, ["test_with_extras", "test_second"]);
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_in(dir.path());
    let options = jit.options(&spec, Target::sass(90)).unwrap();
    assert_eq!(options.last().map(String::as_str), Some("-DTEST_OPTION=3"));
    // It compiles, with both entry points lowered.
    let c = jit.compile(&spec, Target::sass(90)).unwrap();
    assert_eq!(c.entry.lowered_names, ["test_with_extras", "test_second"]);
    // Wrong constants are an error, not a panic.
    assert!(KernelSpec::try_new(&WITH_EXTRAS, DType::F32, 64, 1, &[]).is_err());
    assert!(KernelSpec::try_new(&WITH_EXTRAS, DType::F32, 0, 1, &[5]).is_err());
}

static BAD_EXTRAS: TemplateDef = TemplateDef {
    name: "test_bad_extras",
    source: "",
    kernel: "test_bad_extras",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

#[test]
fn extras_that_would_override_kiln_are_refused() {
    for extras in [
        FamilyExtras {
            partials: &[("prelude", "")],
            ..FamilyExtras::NONE
        },
        FamilyExtras {
            options: &["--gpu-architecture=sm_80"],
            ..FamilyExtras::NONE
        },
        FamilyExtras {
            options: &["--std=c++20"],
            ..FamilyExtras::NONE
        },
        FamilyExtras {
            entry_points: &["test_bad_extras"],
            ..FamilyExtras::NONE
        },
    ] {
        let err = register_family(&BAD_EXTRAS, extras).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    }
}

/// The example application (`examples/app_kernel.rs`), as `cargo test` builds it: beside the
/// test executables' folder, in `examples/`.
fn example_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|d| d.join("examples").join("app_kernel"))
        .unwrap();
    assert!(
        path.exists(),
        "{} not built: run `cargo test` (which builds the examples) or `cargo build --example \
         app_kernel` first",
        path.display()
    );
    path
}

/// Without a GPU the example still registers its family and compiles every spec into the cache
/// (a second run finds them all there), and says it skipped the GPU run.
#[test]
fn the_example_application_warms_its_kernels_without_a_gpu() {
    if kiln::runtime::gpus().is_ok_and(|g| !g.is_empty()) {
        return; // with a GPU it runs the kernels too; covered by running it there
    }
    let dir = tempfile::tempdir().unwrap();
    let run = || {
        let out = std::process::Command::new(example_bin())
            .env("KILN_CACHE_DIR", dir.path())
            .env_remove("KILN_REQUIRE_GPU")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("GPU run skipped"), "{stdout}");
        let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        last
    };
    let first = run();
    assert_eq!(first["specs"], 3);
    assert_eq!(first["compiled"], 3);
    let second = run();
    assert_eq!(second["cached"], 3);
    assert_eq!(second["compiled"], 0);
}

static BROKEN: TemplateDef = TemplateDef {
    name: "test_families_broken",
    source: "extern \"C\" __global__ void {{kernel}}(float* p) { p[0] = nope; }\n",
    kernel: "test_families_broken",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

/// `Jit::warm`: an application's specs with kiln's, in parallel, one progress call per item,
/// failures reported (not fatal), then all hits.
#[test]
fn warm_is_one_library_call_with_progress_and_a_report() {
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_in(dir.path());
    let mut work: Vec<(KernelSpec, Target)> = kiln::ops::copy::specs()
        .into_iter()
        .take(3)
        .map(|s| (s, Target::sass(90)))
        .collect();
    let first = KernelSpec::try_new(&FIRST, DType::F32, 32, 1, &[]).unwrap();
    work.push((first, Target::sass(90)));
    let broken = KernelSpec::try_new(&BROKEN, DType::F32, 32, 1, &[]).unwrap();
    work.push((broken, Target::sass(90)));
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let report = jit.warm(&work, 2, &|p| {
        assert_eq!(p.total, 5);
        assert_eq!(
            p.origin.is_none(),
            p.what.starts_with("test_families_broken ")
        );
        calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    });
    assert_eq!(calls.into_inner(), 5);
    assert_eq!((report.specs, report.compiled, report.cached), (5, 4, 0));
    assert_eq!(report.failures.len(), 1);
    assert!(report.failures[0].contains("nope"), "{:?}", report.failures);
    let again = common::jit_in(dir.path()).warm(&work[..4], 0, &|_| {});
    assert_eq!((again.compiled, again.cached), (0, 4));
}

static REBUILT: TemplateDef = TemplateDef {
    name: "test_families_rebuilt",
    source: "extern \"C\" __global__ void {{kernel}}(float* p) { p[0] = {{block_dim}}; }\n",
    kernel: "test_families_rebuilt",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

static REBUILT_90A: TemplateDef = TemplateDef {
    name: "test_families_rebuilt_90a",
    source: "extern \"C\" __global__ void {{kernel}}(float* p) { p[0] = 2; }\n",
    kernel: "test_families_rebuilt_90a",
    const_names: &[],
    arch_specific: true,
    only_arch: Some(90),
};

/// `Jit::warm_from_cache` (`kiln warm --arch X --from-cache`): a process that has never seen
/// an application family rebuilds its cached modules for another architecture, and the
/// application then finds them there without compiling; arch-specific modules stay on theirs.
#[test]
fn cached_modules_are_rebuilt_for_another_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let plain = KernelSpec::try_new(&REBUILT, DType::F32, 64, 1, &[]).unwrap();
    let specific = KernelSpec::try_new(&REBUILT_90A, DType::F32, 32, 1, &[]).unwrap();
    let app = common::jit_in(dir.path());
    let work = [(plain, Target::sass(90)), (specific, Target::sass(90))];
    let first = app.warm(&work, 2, &|_| {});
    assert_eq!((first.compiled, first.failures.len()), (2, 0), "{first:?}");

    // The build machine's process: only the cache, none of the application's families used.
    let build_box = common::jit_in(dir.path());
    let rebuilt = build_box.warm_from_cache(&[Target::sass(80)], 2, &|p| {
        assert!(p.what.starts_with("test_families_rebuilt "), "{}", p.what);
    });
    assert_eq!(
        (rebuilt.specs, rebuilt.compiled, rebuilt.failures.len()),
        (1, 1, 0),
        "the sm_90a module is not rebuilt for sm_80: {rebuilt:?}"
    );
    let again = build_box.warm_from_cache(&[Target::sass(80)], 2, &|_| {});
    assert_eq!((again.compiled, again.cached), (0, 1));

    let fleet = common::jit_in(dir.path());
    let hit = fleet.compile(&plain, Target::sass(80)).unwrap();
    assert_eq!(hit.origin, kiln::jit::Origin::Disk);
    assert_eq!(hit.entry.parts.target, "sm_80");
    let entry_points = &hit.entry.lowered_names;
    assert_eq!(entry_points.len(), 1);
}
