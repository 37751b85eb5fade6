//! Errors that a process-wide set-up remembers keep their type on every later call: a missing
//! NVRTC stays an NVRTC error with its fields, an invalid environment variable an `Error::Env`
//! naming it. (Its own test binary: both set-ups happen once per process.)

use kiln::jit::nvrtc::Nvrtc;
use kiln::jit::Jit;
use kiln::Error;

#[test]
fn remembered_failures_come_back_typed() {
    let missing = std::path::Path::new("/nonexistent/libnvrtc.so.13");
    for _ in 0..2 {
        match Nvrtc::get(Some(missing)) {
            Err(Error::NvrtcLoad { path, reason }) => {
                assert_eq!(path, missing);
                assert!(!reason.is_empty());
            }
            Err(Error::NvrtcNotFound { searched }) => assert!(!searched.is_empty()),
            other => panic!("expected a typed NVRTC error, got {other:?}"),
        }
    }

    std::env::set_var("MLX_CUDA_GRAPH_CACHE_SIZE", "many");
    for _ in 0..2 {
        match Jit::global() {
            Err(Error::Env { var, value, .. }) => {
                assert_eq!(var, "MLX_CUDA_GRAPH_CACHE_SIZE");
                assert_eq!(value, "many");
            }
            Err(other) => panic!("expected Error::Env, got {other:?}"),
            Ok(_) => panic!("an invalid MLX_CUDA_GRAPH_CACHE_SIZE was accepted"),
        }
    }
}

/// A file that is not a cache bundle, or one of another bundle version, is `Error::BadBundle`
/// naming the file (it was `InvalidArgument { arg: "bundle" }`, the path only in its text);
/// a bundle cut short is still a report of what was left out, not an error.
#[test]
fn a_file_that_is_no_bundle_is_a_typed_error() {
    use kiln::env::CacheMode;
    use kiln::jit::bundle::{import, BUNDLE_MAGIC};
    use kiln::jit::disk_cache::DiskCache;

    let dir = tempfile::tempdir().unwrap();
    let cache = DiskCache::open(&dir.path().join("cache"), CacheMode::On, 1 << 20);
    let junk = dir.path().join("junk.bin");
    let mut other_version = BUNDLE_MAGIC.to_vec();
    other_version.extend_from_slice(&99u32.to_le_bytes());
    other_version.extend_from_slice(&0u64.to_le_bytes());
    for (bytes, why) in [
        (b"not a bundle at all".to_vec(), "not a kiln cache bundle"),
        (BUNDLE_MAGIC.to_vec(), "not a kiln cache bundle"),
        (other_version, "bundle version 99"),
    ] {
        std::fs::write(&junk, &bytes).unwrap();
        match import(&cache, &junk, &[]) {
            Err(Error::BadBundle { path, reason }) => {
                assert_eq!(path, junk);
                assert!(reason.contains(why), "{reason}");
            }
            other => panic!("expected Error::BadBundle, got {other:?}"),
        }
    }
    // A bundle of one entry, cut short: imported nothing, reported the entry as damaged.
    let mut cut = BUNDLE_MAGIC.to_vec();
    cut.extend_from_slice(&1u32.to_le_bytes());
    cut.extend_from_slice(&1u64.to_le_bytes());
    cut.extend_from_slice(&1000u64.to_le_bytes());
    std::fs::write(&junk, &cut).unwrap();
    let report = import(&cache, &junk, &[]).unwrap();
    assert_eq!((report.entries, report.damaged.len()), (0, 1));
}
