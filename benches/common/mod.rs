//! Shared by the benches: running a PyTorch anchor script.

use std::process::Command;

/// Runs `benches/<script>` with `args` under python3 and parses the JSON object it prints, or
/// `None` when Python, PyTorch or the GPU is missing. Looks for the script beside the working
/// directory first (the staged `.gpu/` layout), then in the source tree.
pub fn run_anchor(script: &str, args: &[String]) -> Option<serde_json::Value> {
    let local = format!("benches/{script}");
    let source = format!("{}/benches/{script}", env!("CARGO_MANIFEST_DIR"));
    let path = if std::path::Path::new(&local).exists() {
        local
    } else {
        source
    };
    Command::new("python3")
        .arg(path)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| serde_json::from_slice(&o.stdout).ok())
}

/// The variant-comparison flags of the benches: `--only TEXT` (empty when absent: every row) and
/// whether `--no-anchor` asks to skip the anchor.
#[allow(dead_code)] // each bench compiles this module; not every one compares variants
pub fn variant_flags() -> (String, bool) {
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_default();
    (only, args.iter().any(|a| a == "--no-anchor"))
}
