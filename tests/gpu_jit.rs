//! On a GPU: kernels from the JIT launch and match the f64 reference, and a fresh process loads
//! them from the disk cache that `kiln warm` filled. Skipped without a GPU (unless
//! KILN_REQUIRE_GPU=1).

mod common;

use std::process::Command;

use kiln::ops::norm::{self, Kind, Pass};

#[test]
fn the_self_check_passes_on_every_gpu() {
    let Some(gpus) = common::gpus_or_skip("self_check") else {
        return;
    };
    for gpu in &gpus {
        let results = kiln::selfcheck::check_gpu(gpu).unwrap();
        for r in &results {
            println!(
                "gpu{} {} {} {}: max err {:.2e} (tol {:.1e}) {:?} {:.2} ms",
                r.gpu, r.op, r.spec, r.shape, r.max_error, r.tolerance, r.origin, r.load_ms
            );
        }
        let failed: Vec<_> = results.iter().filter(|r| !r.passed).collect();
        assert!(failed.is_empty(), "{failed:#?}");
        // Every convolution pass is checked, on every dtype.
        for op in ["conv_forward", "conv_backward_data", "conv_backward_weight"] {
            let want = kiln::DType::ALL.len() * kiln::selfcheck::conv_cases().len();
            assert_eq!(results.iter().filter(|r| r.op == op).count(), want, "{op}");
        }
        // A second request is a table hit: the same loaded kernel.
        let dev = kiln::runtime::Device::get(gpu.ordinal).unwrap();
        let spec = norm::choose_spec(
            Pass::Forward,
            Kind::LayerNorm,
            kiln::DType::BF16,
            4096,
            norm::Rows::Aligned,
            norm::Count::Many,
            norm::Gpu::of(&dev),
        );
        let a = dev.kernel(&spec).unwrap();
        let b = dev.kernel(&spec).unwrap();
        assert!(std::sync::Arc::ptr_eq(&a, &b));
    }
}

#[test]
fn a_fresh_process_launches_kernels_from_the_warmed_cache() {
    let Some(gpus) = common::gpus_or_skip("fresh_process") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let arch = gpus[0].target().to_string();
    let warm = Command::new(common::kiln_bin())
        .args(["warm", "--arch", &arch, "--json"])
        .env("KILN_CACHE_DIR", dir.path())
        .output()
        .unwrap();
    assert!(
        warm.status.success(),
        "{}",
        String::from_utf8_lossy(&warm.stderr)
    );
    println!("warm: {}", String::from_utf8_lossy(&warm.stdout).trim());

    let check = Command::new(common::kiln_bin())
        .args(["check", "--json"])
        .env("KILN_CACHE_DIR", dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&check.stdout);
    println!("{stdout}");
    assert!(
        check.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let checks: Vec<_> = lines.iter().filter(|l| l.get("spec").is_some()).collect();
    // Per dtype: LayerNorm on every shape, its VJP on two, three passes per convolution case.
    let per_dtype = kiln::selfcheck::SHAPES.len() + 2 + 3 * kiln::selfcheck::conv_cases().len();
    assert_eq!(checks.len(), gpus.len() * 3 * per_dtype);
    for c in &checks {
        assert_eq!(c["passed"], true, "{c}");
        // Every kernel came from the disk (or from this process's memory, for a repeated spec).
        let origin = c["origin"].as_str().unwrap();
        assert!(origin == "disk" || origin == "memory", "{c}");
    }
    assert!(checks.iter().any(|c| c["origin"] == "disk"));
}

/// A cache entry another NVRTC made for this exact target, which the driver refuses to load (a
/// damaged image stands in for one its driver cannot take), is not an error: kiln compiles the
/// spec with its own NVRTC, launches it, and keeps the result.
#[test]
fn an_entry_the_driver_refuses_is_replaced_by_a_local_compile() {
    let Some(gpus) = common::gpus_or_skip("driver_refusal") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let target = gpus[0].target();
    let spec = kiln::ops::axpby::spec(kiln::DType::F32);
    let own = common::jit_in(dir.path()).compile(&spec, target).unwrap();
    let mut foreign = (*own.entry).clone();
    foreign.parts.nvrtc_version = "12.0".into();
    foreign.key = foreign.parts.key();
    foreign.image = b"not a module any driver loads".to_vec();
    let jit = common::jit_in(dir.path());
    jit.disk_cache().store(&foreign);
    std::fs::remove_file(jit.disk_cache().entry_path(&own.entry.key)).unwrap();
    let found = jit.compile(&spec, target).unwrap();
    assert_eq!(
        found.entry.parts.nvrtc_version, "12.0",
        "the foreign entry is found first"
    );

    let jit = common::jit_in(dir.path());
    let ctx = cudarc::driver::CudaContext::new(gpus[0].ordinal).unwrap();
    let table = kiln::jit::KernelTable::new();
    let kernel = table.get_or_load(&jit, &ctx, target, &spec).unwrap();
    assert_eq!(kernel.origin, kiln::jit::Origin::Compiled);
    assert!(jit.disk_cache().entry_path(&own.entry.key).exists());
}

/// A device given its own JIT compiles into that JIT's cache, not the process-wide one, and
/// computes what the default device computes.
#[test]
fn a_device_with_its_own_jit_uses_its_cache() {
    let Some(gpus) = common::gpus_or_skip("device_with_jit") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let jit: &'static kiln::jit::Jit = Box::leak(Box::new(common::jit_in(dir.path())));
    let own = kiln::runtime::Device::with_jit(gpus[0].ordinal, jit).unwrap();
    let shared = kiln::runtime::Device::get(gpus[0].ordinal).unwrap();
    assert!(!std::sync::Arc::ptr_eq(&own, &shared));
    assert_ne!(own.id(), shared.id());
    let mut rng = kiln::selfcheck::TestRng::new(3);
    let values = rng.values(8 * 1000, 1.0, 0.0);
    let mut results = Vec::new();
    for dev in [&own, &shared] {
        let mut enc = kiln::runtime::CommandEncoder::new(dev).unwrap();
        let x = kiln::runtime::Array::from_f64(&mut enc, kiln::DType::F32, &values, &[8, 1000])
            .unwrap();
        let y = kiln::ops::norm::rms_norm(&mut enc, &x, None, 1e-5).unwrap();
        results.push(y.to_f64(&mut enc).unwrap());
    }
    assert_eq!(results[0], results[1]);
    assert!(
        !jit.disk_cache().entry_files().is_empty(),
        "the device's own JIT compiled into its own cache"
    );
}
