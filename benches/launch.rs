//! Launch overhead: a chain of 1,000 tiny dependent kernels (x = 1*x + 1*ones), per-op cost
//! (host encode + GPU) in steady state, kiln's direct and graph modes against raw
//! `cuLaunchKernel`, a raw CUDA graph replay, and PyTorch (eager and graph replay, through
//! `benches/launch_torch.py` when torch is importable). Also sweeps the ops-per-commit limit.
//!
//! Targets (issue 3): graph mode <= 2.0 us per op; direct mode within 1.2x of raw cuLaunchKernel.

mod common;

use std::ptr;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;
use kiln::env::Config;
use kiln::ops::axpby::{axpby, spec};
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::DType;

const OPS: usize = 1000;
const REPEATS: usize = 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn check(status: sys::CUresult) {
    assert_eq!(status, sys::cudaError_enum::CUDA_SUCCESS);
}

/// Microseconds per op of `body` (which runs OPS ops and waits for them), median of REPEATS.
fn per_op(mut body: impl FnMut()) -> f64 {
    for _ in 0..3 {
        body();
    }
    median(
        (0..REPEATS)
            .map(|_| {
                let t = Instant::now();
                body();
                t.elapsed().as_secs_f64() * 1e6 / OPS as f64
            })
            .collect(),
    )
}

fn kiln_chain(
    dev: &Arc<Device>,
    graphs: bool,
    max_ops: Option<usize>,
) -> (f64, kiln::runtime::EncoderStats) {
    let mut config = Config::from_env().unwrap();
    config.use_cuda_graphs = graphs;
    config.max_ops_per_buffer = max_ops;
    let mut enc = CommandEncoder::with_config(dev, &config).unwrap();
    let x = Array::from_f64(&mut enc, DType::F32, &[0.0], &[1]).unwrap();
    let ones = Array::from_f64(&mut enc, DType::F32, &[1.0], &[1]).unwrap();
    let mut runs = 0usize;
    let us = per_op(|| {
        for _ in 0..OPS {
            axpby(&mut enc, 1.0, &x, 1.0, &ones, &x).unwrap();
        }
        enc.synchronize().unwrap();
        runs += 1;
    });
    let got = x.to_f64(&mut enc).unwrap()[0];
    assert_eq!(
        got,
        (runs * OPS) as f64,
        "the chain computed the wrong value"
    );
    (us, enc.stats())
}

/// Direct mode without the op layer: the encoder's own cost over cuLaunchKernel.
fn encoder_chain(dev: &Arc<Device>, max_ops: Option<usize>) -> f64 {
    let mut config = Config::from_env().unwrap();
    config.use_cuda_graphs = false;
    config.max_ops_per_buffer = max_ops;
    let mut enc = CommandEncoder::with_config(dev, &config).unwrap();
    let x = Array::from_f64(&mut enc, DType::F32, &[0.0], &[1]).unwrap();
    let ones = Array::from_f64(&mut enc, DType::F32, &[1.0], &[1]).unwrap();
    let kernel = dev.kernel(&spec(DType::F32)).unwrap();
    let mut args = kiln::runtime::KernelArgs::new();
    args.push(x.device_ptr())
        .push(ones.device_ptr())
        .push(x.device_ptr())
        .push(1i64)
        .push(1.0f32)
        .push(1.0f32);
    per_op(|| {
        for _ in 0..OPS {
            // SAFETY: the arguments match the kernel's parameters; it touches only the
            // arrays listed, as listed.
            unsafe { enc.launch(&kernel, 1, 256, 0, args.clone(), &[&x, &ones], &[&x]) }.unwrap();
        }
        enc.synchronize().unwrap();
    })
}

fn main() {
    let dev = match kiln::runtime::gpus() {
        Ok(g) if !g.is_empty() => Device::get(0).unwrap(),
        _ => {
            println!("launch bench: no GPU, skipped");
            return;
        }
    };
    println!(
        "launch bench on {} ({} ops per chain, median of {REPEATS})",
        dev.info().name,
        OPS
    );
    let kernel = dev.kernel(&spec(DType::F32)).unwrap();
    let function = kernel.function.cu_function();

    // Raw driver: the same kernel and arguments, launched directly.
    dev.bind().unwrap();
    let mut stream = ptr::null_mut();
    check(unsafe {
        sys::cuStreamCreate(
            &mut stream,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
        )
    });
    let mut raw_enc = CommandEncoder::new(&dev).unwrap();
    let x = Array::from_f64(&mut raw_enc, DType::F32, &[0.0], &[1]).unwrap();
    let ones = Array::from_f64(&mut raw_enc, DType::F32, &[1.0], &[1]).unwrap();
    raw_enc.synchronize().unwrap();
    let (mut px, mut py, mut po, mut n, mut a, mut b) = (
        x.device_ptr(),
        ones.device_ptr(),
        x.device_ptr(),
        1i64,
        1.0f32,
        1.0f32,
    );
    let mut params: [*mut std::ffi::c_void; 6] = [
        &mut px as *mut _ as *mut _,
        &mut py as *mut _ as *mut _,
        &mut po as *mut _ as *mut _,
        &mut n as *mut _ as *mut _,
        &mut a as *mut _ as *mut _,
        &mut b as *mut _ as *mut _,
    ];
    let raw_launch = per_op(|| {
        for _ in 0..OPS {
            check(unsafe {
                sys::cuLaunchKernel(
                    function,
                    1,
                    1,
                    1,
                    256,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    ptr::null_mut(),
                )
            });
        }
        check(unsafe { sys::cuStreamSynchronize(stream) });
    });

    // Raw CUDA graph: a 1,000-node chain built once, then replayed.
    let mut graph = ptr::null_mut();
    check(unsafe { sys::cuGraphCreate(&mut graph, 0) });
    let mut prev: Option<sys::CUgraphNode> = None;
    for _ in 0..OPS {
        let node_params = sys::CUDA_KERNEL_NODE_PARAMS {
            func: function,
            gridDimX: 1,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: 256,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            kernelParams: params.as_mut_ptr(),
            extra: ptr::null_mut(),
            kern: ptr::null_mut(),
            ctx: ptr::null_mut(),
        };
        let mut node = ptr::null_mut();
        let deps: Vec<sys::CUgraphNode> = prev.into_iter().collect();
        check(unsafe {
            sys::cuGraphAddKernelNode_v2(&mut node, graph, deps.as_ptr(), deps.len(), &node_params)
        });
        prev = Some(node);
    }
    let mut exec = ptr::null_mut();
    check(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) });
    let raw_graph = per_op(|| {
        check(unsafe { sys::cuGraphLaunch(exec, stream) });
        check(unsafe { sys::cuStreamSynchronize(stream) });
    });

    let (direct, _) = kiln_chain(&dev, false, None);
    let encoder_only = encoder_chain(&dev, None);
    let encoder_one_commit = encoder_chain(&dev, Some(1 << 30));
    let raw_again = per_op(|| {
        for _ in 0..OPS {
            check(unsafe {
                sys::cuLaunchKernel(
                    function,
                    1,
                    1,
                    1,
                    256,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    ptr::null_mut(),
                )
            });
        }
        check(unsafe { sys::cuStreamSynchronize(stream) });
    });
    let (graph_1000, stats) = kiln_chain(&dev, true, Some(OPS));
    let (graph_default, _) = kiln_chain(&dev, true, None);
    let default_ops = CommandEncoder::new(&dev).unwrap().limits().0;

    let torch = common::run_anchor("launch_torch.py", &[]);

    println!(
        "{:<52} {:>9} {:>12}",
        "per op (host encode + GPU)", "us/op", "kiln/anchor"
    );
    println!("{:<52} {:>9.3}", "raw cuLaunchKernel loop", raw_launch);
    println!(
        "{:<52} {:>9.3}",
        "raw cuLaunchKernel loop, again (run-to-run spread)", raw_again
    );
    println!(
        "{:<52} {:>9.3} {:>11.2}x  (encoder.launch with prepared arguments)",
        "kiln direct mode, encoder only",
        encoder_only,
        encoder_only / raw_launch
    );
    println!(
        "{:<52} {:>9.3} {:>11.2}x  (no commit, so no event, until the end)",
        "kiln direct mode, encoder only, one commit",
        encoder_one_commit,
        encoder_one_commit / raw_launch
    );
    println!(
        "{:<52} {:>9.3}",
        "raw CUDA graph replay (1,000-node chain)", raw_graph
    );
    if let Some(t) = &torch {
        println!(
            "{:<52} {:>9.3}",
            format!(
                "PyTorch {} eager x.add_(1)",
                t["torch"].as_str().unwrap_or("?")
            ),
            t["eager_us"].as_f64().unwrap_or(f64::NAN)
        );
        println!(
            "{:<52} {:>9.3}",
            "PyTorch CUDA graph replay",
            t["graph_replay_us"].as_f64().unwrap_or(f64::NAN)
        );
    } else {
        println!("PyTorch: not available (benches/launch_torch.py did not run)");
    }
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    println!(
        "{:<52} {:>9.3} {:>11.2}x  vs raw cuLaunchKernel; target <= 1.2x: {}",
        "kiln direct mode",
        direct,
        direct / raw_launch,
        verdict(direct <= 1.2 * raw_launch)
    );
    for (label, us) in [
        (
            format!("kiln graph mode, one graph per {OPS} ops"),
            graph_1000,
        ),
        (
            format!("kiln graph mode, default limit ({default_ops} ops)"),
            graph_default,
        ),
    ] {
        let torch_ratio = torch
            .as_ref()
            .and_then(|t| t["eager_us"].as_f64())
            .map_or(String::new(), |e| {
                format!(", PyTorch eager / kiln = {:.1}x", e / us)
            });
        println!(
            "{label:<52} {us:>9.3} {:>11.2}x  vs raw graph replay; target <= 2.0 us: {}{torch_ratio}",
            us / raw_graph,
            verdict(us <= 2.0)
        );
    }
    println!(
        "graph-mode counters ({OPS}-op graphs): {} commits, {} exec hits, {} reused as is, {} updates, {} instantiations",
        stats.graph_commits, stats.exec_cache_hits, stats.exec_reuses, stats.updates, stats.instantiations
    );
    println!("ops-per-commit sweep (graph mode):");
    for ops in [10, 20, 30, 50, 100, 200, 500] {
        let (us, _) = kiln_chain(&dev, true, Some(ops));
        println!("  MLX_MAX_OPS_PER_BUFFER={ops:<4} {us:>7.3} us/op");
    }
    unsafe {
        sys::cuGraphExecDestroy(exec);
        sys::cuGraphDestroy(graph);
        sys::cuStreamDestroy_v2(stream);
    }
}
