//! On a GPU: kernels from the JIT launch and match the f64 reference, and a fresh process loads
//! them from the disk cache that `kiln warm` filled. Skipped without a GPU (unless
//! KILN_REQUIRE_GPU=1).

mod common;

use std::process::Command;

use kiln::jit::KernelTable;

#[test]
fn layer_norm_forward_matches_the_reference_on_every_gpu() {
    let Some(gpus) = common::gpus_or_skip("layer_norm_forward") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_in(dir.path());
    let table = KernelTable::new();
    for gpu in &gpus {
        let results = kiln::selfcheck::check_gpu(&jit, &table, gpu).unwrap();
        for r in &results {
            println!(
                "gpu{} {} {}x{}: max err {:.2e} (tol {:.1e}) {:?} {:.2} ms",
                r.gpu,
                r.spec,
                r.rows,
                r.d,
                r.max_error,
                kiln::selfcheck::tolerance(
                    kiln::DType::ALL[results.iter().position(|x| x.spec == r.spec).unwrap()
                        / kiln::selfcheck::SHAPES.len()]
                ),
                r.origin,
                r.load_ms
            );
        }
        let failed: Vec<_> = results.iter().filter(|r| !r.passed).collect();
        assert!(failed.is_empty(), "{failed:#?}");
        // A second request is a table hit: same kernel, no load.
        let spec = kiln::ops::layer_norm::forward_spec(kiln::DType::BF16, 4096, true, true, true);
        let a = table.get(gpu.ordinal, &spec).expect("loaded by the check");
        let ctx = cudarc::driver::CudaContext::new(gpu.ordinal).unwrap();
        let b = table.get_or_load(&jit, &ctx, gpu.target(), &spec).unwrap();
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
    assert_eq!(checks.len(), gpus.len() * 3 * kiln::selfcheck::SHAPES.len());
    for c in &checks {
        assert_eq!(c["passed"], true, "{c}");
        // Every kernel came from the disk (or from this process's memory, for a repeated spec).
        let origin = c["origin"].as_str().unwrap();
        assert!(origin == "disk" || origin == "memory", "{c}");
    }
    assert!(checks.iter().any(|c| c["origin"] == "disk"));
}
