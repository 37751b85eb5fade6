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
