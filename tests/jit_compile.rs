//! Every registered spec renders and compiles; keys, single flight, targets, compile errors.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use kiln::env::CacheMode;
use kiln::jit::entry::ImageKind;
use kiln::jit::{template, Jit, KernelSpec, Origin, Target, TemplateDef};
use kiln::ops::norm::{self, Kind, Pass};
use kiln::{DType, Error};

/// Every registered spec for each target: what the ops choose on its architecture.
fn work_for(targets: &[Target]) -> Vec<(KernelSpec, Target)> {
    targets
        .iter()
        .flat_map(|&t| {
            kiln::ops::registered_specs_for(t.arch)
                .into_iter()
                .filter(move |s| s.builds_for(t.arch))
                .map(move |s| (s, t))
        })
        .collect()
}

/// A digest of a cubin's machine code: its `.text.*` sections (the constants' symbols and the
/// rest of the metadata live in other sections).
fn machine_code(image: &[u8]) -> [u8; 32] {
    use object::{Object, ObjectSection};
    use sha2::Digest;
    let file = object::File::parse(image).expect("a cubin is an ELF file");
    let mut code = sha2::Sha256::new();
    for section in file.sections() {
        if section.name().is_ok_and(|n| n.starts_with(".text.")) {
            code.update(section.data().expect("a section's bytes"));
        }
    }
    code.finalize().into()
}

/// Specs compiled to one target, by family and machine code.
type SameCode = Mutex<HashMap<(Target, &'static str, [u8; 32]), Vec<KernelSpec>>>;

/// Compiles each (spec, target) on two threads; returns how many came from each origin, and
/// records each spec under its target, family and machine code in `code`.
fn compile_all(jit: &kiln::jit::Jit, work: &[(KernelSpec, Target)], code: &SameCode) -> [usize; 3] {
    let next = AtomicUsize::new(0);
    let counts = [0, 1, 2].map(|_| AtomicUsize::new(0));
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((spec, target)) = work.get(i) else {
                    break;
                };
                let c = jit
                    .compile(spec, *target)
                    .unwrap_or_else(|e| panic!("{spec} on {target}: {e}"));
                let resolved = jit.resolve_target(spec, *target).unwrap();
                assert_eq!(c.entry.parts.target, resolved.to_string());
                assert_eq!(c.entry.image_kind, ImageKind::Cubin);
                assert_eq!(&c.entry.image[..4], b"\x7fELF", "{spec}: not a cubin");
                assert_eq!(
                    c.entry.lowered_names,
                    vec![spec.template.kernel.to_string()]
                );
                let key = (*target, spec.template.name, machine_code(&c.entry.image));
                code.lock().unwrap().entry(key).or_default().push(*spec);
                let slot = match c.origin {
                    Origin::Memory => 0,
                    Origin::Disk => 1,
                    Origin::Compiled => 2,
                };
                counts[slot].fetch_add(1, Ordering::Relaxed);
            });
        }
    });
    counts.map(|c| c.into_inner())
}

/// Turing (sm_75, the portable paths with f16 tensor cores), Ampere (sm_80) and Hopper (sm_90,
/// with the arch-specific family); Volta's targets need NVRTC 12 (tests/cli.rs).
#[test]
fn every_registered_spec_compiles_for_sm75_sm80_and_sm90_then_hits_the_disk() {
    let dir = tempfile::tempdir().unwrap();
    let targets = [Target::sass(75), Target::sass(80), Target::sass(90)];
    let work = work_for(&targets);
    let n = work.len();
    // The Hopper family is registered for sm_90 only (built as sm_90a), and says so elsewhere.
    let hopper: Vec<_> = work
        .iter()
        .filter(|(s, _)| s.template.only_arch.is_some())
        .collect();
    assert!(!hopper.is_empty() && hopper.iter().all(|(_, t)| t.arch == 90));
    let err = common::jit_in(dir.path())
        .compile(&hopper[0].0, Target::sass(80))
        .unwrap_err();
    assert!(err.to_string().contains("sm_90 only"), "{err}");
    // Turing registers f16 tensor-core and bf16 FMA convolutions; Ampere both on tensor cores.
    let tensor = |arch: u32, dtype: DType| {
        kiln::ops::registered_specs_for(arch)
            .iter()
            .any(|s| s.template.name == "conv_igemm" && s.dtype == dtype && s.consts[1] == 1)
    };
    assert!(tensor(75, DType::F16) && !tensor(75, DType::BF16));
    assert!(tensor(80, DType::BF16) && !tensor(70, DType::F16));

    let code = SameCode::default();
    let cold = compile_all(&common::jit_in(dir.path()), &work, &code);
    assert_eq!(
        cold,
        [0, 0, n],
        "[memory, disk, compiled] on an empty cache"
    );
    // No two specs of a family compile to the same machine code for one target: passes that run
    // the same code ask for one spec, so `kiln warm` and first use compile it once. Known
    // exceptions: 16-bit moves in f16 and bf16, and the 3x3 stem's backward-data at 32 and 64
    // channels a block (the host sizes the launch's shared memory by NB).
    let exception = |specs: &[KernelSpec]| match specs[0].template.name {
        "copy_into" | "transpose" => specs.iter().all(|s| s.dtype.size() == 2),
        "conv_stem" => specs.iter().all(|s| {
            s.constant("PASS") == Some(1)
                && s.constant("KH") == Some(3)
                && specs[0].dtype == s.dtype
        }),
        _ => false,
    };
    let code = code.into_inner().unwrap();
    let same: Vec<_> = code
        .values()
        .filter(|specs| specs.len() > 1 && !exception(specs))
        .map(|specs| specs.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .collect();
    assert!(
        same.is_empty(),
        "specs compiled to the same code: {same:#?}"
    );
    let excepted = code.values().filter(|specs| specs.len() > 1).count();
    assert!(excepted <= 3 * 5, "{excepted} groups of exceptions");

    // A new JIT (as a new process would have) finds every entry on disk.
    let warm = compile_all(&common::jit_in(dir.path()), &work, &SameCode::default());
    assert_eq!(warm, [0, n, 0], "[memory, disk, compiled] on a warm cache");
}

/// `KILN_EMULATE_ARCH` compiles the older architecture's code paths for the real target: the
/// PTX of an f16 convolution for compute_90 then has Turing's m16n8k8 and no cp.async.
#[test]
fn emulating_an_older_architecture_compiles_its_code_paths() {
    let dir = tempfile::tempdir().unwrap();
    let jit = |emulate: Option<u32>| {
        let mut config = kiln::env::Config::from_env().unwrap();
        config.cache_dir = Some(dir.path().to_path_buf());
        config.emulate_arch = emulate;
        kiln::jit::Jit::new(config)
    };
    let spec = kiln::ops::registered_specs_for(75)
        .into_iter()
        .find(|s| s.template.name == "conv_igemm" && s.dtype == DType::F16 && s.consts[1] == 1)
        .unwrap();
    let ptx = |jit: &kiln::jit::Jit| {
        let c = jit.compile(&spec, Target::ptx(90)).unwrap();
        String::from_utf8_lossy(&c.entry.image).into_owned()
    };
    let native = ptx(&jit(None));
    assert!(native.contains("m16n8k16") && native.contains("cp.async"));
    let turing_jit = jit(Some(75));
    let parts = turing_jit.key_parts(&spec, Target::ptx(90)).unwrap();
    assert!(parts.options.contains(&"-DKILN_ARCH=750".to_string()));
    let turing = ptx(&turing_jit);
    assert!(turing.contains("m16n8k8") && !turing.contains("m16n8k16"));
    assert!(!turing.contains("cp.async"));
    // Emulating the target's own architecture (or a newer one) changes nothing.
    let same = jit(Some(90));
    assert_eq!(
        same.key_parts(&spec, Target::ptx(90)).unwrap().key(),
        jit(None).key_parts(&spec, Target::ptx(90)).unwrap().key()
    );
}

/// An NVRTC too new for a target says so, naming the NVRTC that can.
#[test]
fn a_target_older_than_nvrtc_knows_is_an_error_naming_the_nvrtc_that_can() {
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_in(dir.path());
    let nvrtc = jit.nvrtc().unwrap();
    let spec = kiln::ops::copy::specs()[0];
    let oldest = *nvrtc.supported_archs.iter().min().unwrap();
    if oldest <= 70 {
        eprintln!(
            "NVRTC {} still compiles for sm_70: nothing to check",
            nvrtc.version_string()
        );
        return;
    }
    let err = jit.compile(&spec, Target::sass(70)).unwrap_err();
    assert!(matches!(err, Error::TargetUnsupported { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("nvidia-cuda-nvrtc-cu12") && text.contains("sm_70"),
        "{text}"
    );
}

#[test]
fn templates_are_self_contained_and_families_unique() {
    let mut names = HashSet::new();
    for spec in kiln::ops::registered_specs() {
        let r = template::render(&spec).unwrap();
        assert!(!r.source.contains("#include"), "{spec} includes a header");
        assert!(
            !r.source.contains("{{"),
            "{spec} has an unrendered placeholder"
        );
        names.insert(spec.template.name);
    }
    // Two families may not share a name (the name is their identity in keys and tables).
    let defs: HashSet<*const TemplateDef> = kiln::ops::registered_specs()
        .iter()
        .map(|s| s.template as *const _)
        .collect();
    assert_eq!(names.len(), defs.len());
}

#[test]
fn different_specs_have_different_keys() {
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_in(dir.path());
    let mut keys = HashSet::new();
    let specs = kiln::ops::registered_specs();
    for spec in &specs {
        keys.insert(jit.key_parts(spec, Target::sass(90)).unwrap().key());
    }
    assert_eq!(keys.len(), specs.len());
}

#[test]
fn concurrent_requests_for_one_spec_compile_once() {
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_with(dir.path(), CacheMode::Off, 1 << 30);
    let spec = norm::choose_spec(
        Pass::Forward,
        Kind::LayerNorm,
        DType::BF16,
        768,
        norm::Rows::Aligned,
        norm::Count::Many,
        norm::Gpu::for_arch(90),
    );
    let origins: Vec<Origin> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| scope.spawn(|| jit.compile(&spec, Target::sass(90)).unwrap().origin))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let compiled = origins.iter().filter(|o| **o == Origin::Compiled).count();
    assert_eq!(compiled, 1, "{origins:?}");
    assert!(origins.iter().all(|o| *o != Origin::Disk));
}

/// Background compiles: prefetched specs are compiled off the caller's thread; a caller that
/// then asks for one gets the module from memory, never a second compile; a spec queued twice is
/// compiled once; with KILN_COMPILE_THREADS=0 nothing is compiled in the background.
#[test]
fn prefetched_specs_compile_in_the_background_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = kiln::env::Config::from_env().unwrap();
    config.cache_dir = Some(dir.path().to_path_buf());
    config.compile_threads = 2;
    let jit: &'static Jit = Box::leak(Box::new(Jit::new(config.clone())));
    let specs: Vec<KernelSpec> = kiln::ops::copy::specs().into_iter().take(4).collect();
    jit.prefetch(specs.clone(), Target::sass(90));
    jit.prefetch(specs.clone(), Target::sass(90));
    let started = std::time::Instant::now();
    while !jit.background_idle() {
        assert!(
            started.elapsed().as_secs() < 120,
            "background compiles never finished"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    for spec in &specs {
        let c = jit.compile(spec, Target::sass(90)).unwrap();
        assert_eq!(c.origin, Origin::Memory, "{spec}");
    }
    assert_eq!(jit.disk_cache().entry_files().len(), specs.len());

    let off = tempfile::tempdir().unwrap();
    config.cache_dir = Some(off.path().to_path_buf());
    config.compile_threads = 0;
    let jit: &'static Jit = Box::leak(Box::new(Jit::new(config)));
    jit.prefetch(specs.clone(), Target::sass(90));
    assert!(jit.background_idle());
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(jit.disk_cache().entry_files().is_empty());
}

#[test]
fn an_architecture_nvrtc_cannot_emit_sass_for_falls_back_to_ptx() {
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_in(dir.path());
    let spec = norm::choose_spec(
        Pass::Forward,
        Kind::LayerNorm,
        DType::F32,
        1000,
        norm::Rows::Scattered,
        norm::Count::Many,
        norm::Gpu::for_arch(90),
    );
    // No NVRTC knows sm_990; the newest architecture it knows gets PTX.
    let c = jit.compile(&spec, Target::sass(990)).unwrap();
    assert_eq!(c.entry.image_kind, ImageKind::Ptx);
    assert!(c.entry.parts.target.starts_with("compute_"));
    let text = String::from_utf8_lossy(&c.entry.image);
    assert!(
        text.contains(".entry kiln_norm_fwd"),
        "not PTX: {}",
        &text[..200.min(text.len())]
    );
}

static ARCH_SPECIFIC: TemplateDef = TemplateDef {
    name: "test_arch_specific",
    source: "{{> prelude}}\nextern \"C\" __global__ void {{kernel}}(float* p) { p[threadIdx.x] = {{block_dim}}; }\n",
    kernel: "test_arch_specific",
    const_names: &[],
    arch_specific: true,
    only_arch: None,
};

#[test]
fn arch_specific_families_compile_for_the_a_target() {
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_in(dir.path());
    let spec = KernelSpec::try_new(&ARCH_SPECIFIC, DType::F32, 128, 1, &[]).unwrap();
    let c = jit.compile(&spec, Target::sass(90)).unwrap();
    assert_eq!(c.entry.parts.target, "sm_90a");
    assert_eq!(c.entry.image_kind, ImageKind::Cubin);
}

static BROKEN: TemplateDef = TemplateDef {
    name: "test_broken",
    source: "extern \"C\" __global__ void {{kernel}}(float* p) { p[0] = undeclared_name; }\n",
    kernel: "test_broken",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

/// A spec with the wrong number of constants is an error naming the family's constants, not a
/// panic.
#[test]
fn a_spec_with_the_wrong_constants_is_an_error() {
    match KernelSpec::try_new(&BROKEN, DType::F16, 64, 1, &[1, 2]) {
        Err(Error::InvalidArgument { arg, reason }) => {
            assert_eq!(arg, "consts");
            assert!(reason.contains("test_broken takes 0 constants"), "{reason}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    let many = [0; 12];
    assert!(KernelSpec::try_new(&BROKEN, DType::F16, 64, 1, &many).is_err());
}

#[test]
fn a_compile_error_returns_the_log_the_spec_and_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_in(dir.path());
    let spec = KernelSpec::try_new(&BROKEN, DType::F16, 64, 1, &[]).unwrap();
    match jit.compile(&spec, Target::sass(90)) {
        Err(Error::Compile {
            spec: s,
            target,
            log,
            source_path,
        }) => {
            assert!(s.contains("test_broken f16 block=64"), "{s}");
            assert_eq!(target, "sm_90");
            assert!(log.contains("undeclared_name"), "{log}");
            let path = source_path.expect("source saved");
            let saved = std::fs::read_to_string(&path).unwrap();
            assert!(saved.contains("undeclared_name"));
        }
        Err(other) => panic!("expected a compile error, got {other}"),
        Ok(_) => panic!("a broken kernel compiled"),
    }
}

static BAD_TEMPLATE: TemplateDef = TemplateDef {
    name: "test_bad_template",
    source: "extern \"C\" __global__ void {{kernel}}() { int x = {{no_such_constant}}; }\n",
    kernel: "test_bad_template",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

#[test]
fn a_misspelt_template_variable_is_an_error() {
    let spec = KernelSpec::try_new(&BAD_TEMPLATE, DType::F32, 32, 1, &[]).unwrap();
    let err = template::render(&spec).unwrap_err();
    assert!(matches!(err, Error::Template { .. }), "{err}");
}

/// Every stand-in (`KILN_STAND_INS`: the norms' looped kernels, the 64x64 `conv_igemm` tile
/// of every vector width) compiles for sm_90 with the fast option in its key, the norms' for
/// sm_80 too; and `Jit::cached` finds a module without compiling it: nowhere before the
/// compile, in memory after it, on disk for a new JIT.
#[test]
fn stand_ins_compile_and_are_found_without_compiling() {
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_in(dir.path());
    let mut work: Vec<(KernelSpec, Target)> = Vec::new();
    for arch in [80, 90] {
        let t = Target::sass(arch);
        work.extend(norm::stand_in::specs().into_iter().map(|s| (s, t)));
    }
    let conv = kiln::ops::registered_specs_for(90)
        .into_iter()
        .filter(|s| *s.template == kiln::ops::conv::plan::IGEMM)
        .filter(|s| s.constant("BM") == Some(64) && s.constant("BN") == Some(64))
        .map(|s| KernelSpec {
            template: &kiln::ops::conv::stand_in::IGEMM_QUICK,
            ..s
        });
    work.extend(conv.map(|s| (s, Target::sass(90))));
    for (spec, target) in &work {
        assert!(jit.cached(spec, *target).unwrap().is_none(), "{spec}");
    }
    let started = std::time::Instant::now();
    assert_eq!(
        compile_all(&jit, &work, &SameCode::default()),
        [0, 0, work.len()]
    );
    let per_spec = started.elapsed().as_secs_f64() * 2.0 / work.len() as f64;
    println!("{} stand-ins, {per_spec:.3} s each", work.len());
    for (spec, target) in &work {
        let c = jit.cached(spec, *target).unwrap().expect("compiled");
        assert_eq!(c.origin, Origin::Memory, "{spec}");
        assert!(c
            .entry
            .parts
            .options
            .iter()
            .any(|o| o == "--Ofast-compile=mid"));
        assert!(spec.template.name.ends_with("_quick"), "{spec}");
    }
    let fresh = common::jit_in(dir.path());
    for (spec, target) in &work {
        let c = fresh.cached(spec, *target).unwrap().expect("on disk");
        assert_eq!(c.origin, Origin::Disk, "{spec}");
    }
}

/// A process that exits while background compiles run exits cleanly: exit waits for the
/// compiles in flight instead of tearing NVRTC down under them (before, about one exit in three
/// in the middle of compiles ended in a segfault, an abort or a hang). The test runs itself as
/// a child that queues slow compiles and exits after a delay, at several delays.
#[test]
fn exiting_while_compiles_run_is_clean() {
    const CHILD: &str = "KILN_TEST_EXIT_AFTER_MS";
    const NAME: &str = "exiting_while_compiles_run_is_clean";
    if let Ok(ms) = std::env::var(CHILD) {
        let jit = Jit::global().unwrap();
        // One compile first, so that the queued ones are inside NVRTC by the time of the exit.
        let first = kiln::ops::copy::specs()[0];
        jit.compile(&first, Target::sass(90)).unwrap();
        // Scalar-load implicit-GEMM specs: among the slowest to compile.
        let specs: Vec<KernelSpec> = kiln::ops::registered_specs()
            .into_iter()
            .filter(|s| s.to_string().contains("conv_igemm") && s.builds_for(90))
            .take(8)
            .collect();
        jit.prefetch(specs, Target::sass(90));
        std::thread::sleep(std::time::Duration::from_millis(ms.parse().unwrap()));
        std::process::exit(0);
    }
    for ms in [200, 350, 500, 650, 800, 950] {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--test-threads=1"])
            .env(CHILD, ms.to_string())
            .env("KILN_CACHE_DIR", dir.path())
            .env("KILN_COMPILE_THREADS", "2")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "exit after {ms} ms: {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        // The compiles that were running finished and were stored.
        let cache = kiln::jit::disk_cache::DiskCache::open(dir.path(), CacheMode::On, u64::MAX);
        assert!(
            !cache.entry_files().is_empty(),
            "exit after {ms} ms left no entry"
        );
    }
}
