//! The runtime on a GPU: arrays and views against the CPU, direct and graph mode agreeing bit for
//! bit on random programs, the executable cache, buffer lifetimes, and out-of-memory.
//! Skipped without a GPU (unless KILN_REQUIRE_GPU=1).

mod common;

use std::sync::{Arc, Mutex, MutexGuard};

use kiln::env::Config;
use kiln::jit::{KernelSpec, TemplateDef};
use kiln::ops::axpby::axpby;
use kiln::runtime::{Array, CommandEncoder, Device, KernelArgs};
use kiln::selfcheck::TestRng;
use kiln::{DType, Error};

/// The tests share one device and its allocator, whose counters some of them check: they run
/// one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn device(test: &str) -> Option<(MutexGuard<'static, ()>, Arc<Device>)> {
    common::gpus_or_skip(test)?;
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    Some((guard, Device::get(0).expect("device 0")))
}

fn encoder(dev: &Arc<Device>, graphs: bool, max_ops: usize, cache: usize) -> CommandEncoder {
    let mut config = Config::from_env().unwrap();
    config.use_cuda_graphs = graphs;
    config.max_ops_per_buffer = Some(max_ops);
    config.graph_cache_size = cache;
    CommandEncoder::with_config(dev, &config).unwrap()
}

#[test]
fn views_and_casts_match_the_cpu() {
    let Some((_serial, dev)) = device("views_and_casts") else {
        return;
    };
    let mut enc = encoder(&dev, true, 20, 16);
    let (a, b, c) = (3usize, 4usize, 5usize);
    let mut rng = TestRng::new(9);
    let host: Vec<f64> = rng.values(a * b * c, 4.0, 0.0);
    for from in DType::ALL {
        let q: Vec<f64> = kiln::dtype::decode(from, &kiln::dtype::encode(from, &host)).unwrap();
        let x = Array::from_f64(&mut enc, from, &host, &[a, b, c]).unwrap();
        let at = |i: usize, j: usize, k: usize| q[(i * b + j) * c + k];
        // transpose (2, 0, 1): out[k][i][j] = x[i][j][k]
        let t = x.transpose(&[2, 0, 1]).unwrap();
        assert!(!t.is_contiguous());
        let mut want = Vec::new();
        for k in 0..c {
            for i in 0..a {
                for j in 0..b {
                    want.push(at(i, j, k));
                }
            }
        }
        assert_eq!(t.to_f64(&mut enc).unwrap(), want, "{from} transpose");
        // slice axis 2 from 1 by 2, then swap axes 0 and 1
        let s = x.slice(2, 1, 5, 2).unwrap().swapaxes(0, 1).unwrap();
        let mut want = Vec::new();
        for j in 0..b {
            for i in 0..a {
                for k in [1, 3] {
                    want.push(at(i, j, k));
                }
            }
        }
        assert_eq!(s.shape(), &[b, a, 2]);
        assert_eq!(s.to_f64(&mut enc).unwrap(), want, "{from} slice");
        // broadcast a row to a matrix
        assert!(
            t.reshape(&[a * b * c]).is_err(),
            "reshape of a non-contiguous view is refused"
        );
        let row = x.slice(0, 1, 2, 1).unwrap().slice(1, 2, 3, 1).unwrap(); // [1, 1, c], contiguous
        let bc = row.reshape(&[c]).unwrap().broadcast_to(&[3, c]).unwrap();
        let want: Vec<f64> = (0..3).flat_map(|_| (0..c).map(|k| at(1, 2, k))).collect();
        assert_eq!(bc.to_f64(&mut enc).unwrap(), want, "{from} broadcast");
        // casts, against the half crate's rounding
        for to in DType::ALL {
            let y = t.astype(&mut enc, to).unwrap();
            assert_eq!(y.dtype(), to);
            let want: Vec<f64> = {
                let mut v = Vec::new();
                for k in 0..c {
                    for i in 0..a {
                        for j in 0..b {
                            v.push(at(i, j, k));
                        }
                    }
                }
                kiln::dtype::decode(to, &kiln::dtype::encode(to, &v)).unwrap()
            };
            assert_eq!(y.to_f64(&mut enc).unwrap(), want, "{from} -> {to}");
        }
    }
    // Empty arrays and rank limits.
    let e = Array::from_f64(&mut enc, DType::F32, &[], &[0, 3]).unwrap();
    assert_eq!(e.to_f64(&mut enc).unwrap(), Vec::<f64>::new());
    assert!(Array::empty(&dev, DType::F32, &[1; 9]).is_err());
}

/// `swap_outer_inner` gives `swapaxes(0, 2)` made contiguous, bit for bit: extents that fill
/// whole 32 x 32 tiles and ones that leave partial tiles on both sides, every dtype, graph and
/// direct mode; a view is copied first; a rank other than 3 is an error.
#[test]
fn swap_outer_inner_matches_the_strided_copy() {
    let Some((_serial, dev)) = device("swap_outer_inner") else {
        return;
    };
    let mut rng = TestRng::new(21);
    for graphs in [true, false] {
        let mut enc = encoder(&dev, graphs, 20, 16);
        for dtype in DType::ALL {
            for shape in [[64, 9, 96], [37, 3, 70], [1, 5, 33], [130, 1, 8]] {
                let host: Vec<f64> = rng.values(shape.iter().product(), 4.0, 0.0);
                let x = Array::from_f64(&mut enc, dtype, &host, &shape).unwrap();
                let got = kiln::runtime::copy::swap_outer_inner(&mut enc, &x).unwrap();
                assert_eq!(got.shape(), &[shape[2], shape[1], shape[0]]);
                let want = x.swapaxes(0, 2).unwrap().to_f64(&mut enc).unwrap();
                assert_eq!(got.to_f64(&mut enc).unwrap(), want, "{dtype} {shape:?}");
            }
            // A view (every other element of the last axis) is made contiguous first.
            let host: Vec<f64> = rng.values(4 * 3 * 10, 4.0, 0.0);
            let x = Array::from_f64(&mut enc, dtype, &host, &[4, 3, 10]).unwrap();
            let view = x.slice(2, 0, 10, 2).unwrap();
            let got = kiln::runtime::copy::swap_outer_inner(&mut enc, &view).unwrap();
            let want = view.swapaxes(0, 2).unwrap().to_f64(&mut enc).unwrap();
            assert_eq!(got.to_f64(&mut enc).unwrap(), want, "{dtype} view");
            let flat = x.reshape(&[120]).unwrap();
            assert!(kiln::runtime::copy::swap_outer_inner(&mut enc, &flat).is_err());
        }
    }
}

/// One op of a random program: out = a*x + b*y, a captured copy, or a concurrent pair.
#[derive(Clone, Debug)]
enum Op {
    Axpby {
        x: usize,
        y: usize,
        out: usize,
        a: f32,
        b: f32,
    },
    Copy {
        src: usize,
        dst: usize,
    },
    Concurrent(Vec<(usize, usize, usize, f32, f32)>),
}

/// Views of 1024 f32: 0..4 in one allocation (disjoint quarters), 4 overlapping the boundary of
/// 1 and 2, 5 and 6 separate allocations.
const N: usize = 1024;
const VIEWS: usize = 7;

fn range(v: usize) -> (usize, usize) {
    match v {
        0..=3 => (0, v * N),
        4 => (0, N + N / 2),
        _ => (v, 0),
    }
}

/// Same allocation and intersecting element ranges, but not the identical view.
fn partially_overlaps(a: usize, b: usize) -> bool {
    let ((ba, sa), (bb, sb)) = (range(a), range(b));
    a != b && ba == bb && sa < sb + N && sb < sa + N
}

fn random_program(seed: u64, len: usize) -> Vec<Op> {
    let mut rng = TestRng::new(seed);
    let mut pick = |n: usize| ((rng.next_f64() + 1.0) / 2.0 * n as f64) as usize % n;
    let mut ops = Vec::new();
    while ops.len() < len {
        let kind = pick(10);
        let (x, y, out) = (pick(VIEWS), pick(VIEWS), pick(VIEWS));
        let a = (pick(1000) as f32 / 1000.0 - 0.5) * 1.4;
        let b = (pick(1000) as f32 / 1000.0 - 0.5) * 1.4;
        if kind < 7 {
            // Within one kernel, out must equal or not touch its inputs.
            if !partially_overlaps(out, x) && !partially_overlaps(out, y) {
                ops.push(Op::Axpby { x, y, out, a, b });
            }
        } else if kind < 9 {
            if x != out && !partially_overlaps(x, out) {
                ops.push(Op::Copy { src: x, dst: out });
            }
        } else {
            // Two independent launches: distinct outputs that neither reads.
            let (o1, o2) = (5, 6);
            let (i1, i2) = (pick(4), pick(4));
            ops.push(Op::Concurrent(vec![(i1, i2, o1, a, b), (i2, i1, o2, b, a)]));
        }
    }
    ops
}

fn make_views(enc: &mut CommandEncoder, seed: u64) -> Vec<Array> {
    let mut rng = TestRng::new(seed ^ 0xABCD);
    let big = Array::from_f64(enc, DType::F32, &rng.values(4 * N, 1.0, 0.0), &[4 * N]).unwrap();
    let mut views: Vec<Array> = (0..4)
        .map(|i| big.slice(0, i * N, (i + 1) * N, 1).unwrap())
        .collect();
    views.push(big.slice(0, N + N / 2, 2 * N + N / 2, 1).unwrap());
    for _ in 0..2 {
        views.push(Array::from_f64(enc, DType::F32, &rng.values(N, 1.0, 0.0), &[N]).unwrap());
    }
    views
}

fn run_program(enc: &mut CommandEncoder, views: &[Array], ops: &[Op]) {
    for op in ops {
        match op {
            Op::Axpby { x, y, out, a, b } => {
                axpby(enc, *a, &views[*x], *b, &views[*y], &views[*out]).unwrap()
            }
            Op::Copy { src, dst } => enc.copy_into(&views[*src], &views[*dst]).unwrap(),
            Op::Concurrent(list) => {
                enc.begin_concurrent();
                for (x, y, out, a, b) in list {
                    axpby(enc, *a, &views[*x], *b, &views[*y], &views[*out]).unwrap();
                }
                enc.end_concurrent().unwrap();
            }
        }
    }
}

fn results(enc: &mut CommandEncoder, views: &[Array]) -> Vec<Vec<u8>> {
    views.iter().map(|v| v.to_bytes(enc).unwrap()).collect()
}

/// The CPU's version of the program, in f64.
fn emulate(seed: u64, ops: &[Op]) -> Vec<Vec<f64>> {
    let mut rng = TestRng::new(seed ^ 0xABCD);
    let q = |v: Vec<f64>| {
        kiln::dtype::decode(DType::F32, &kiln::dtype::encode(DType::F32, &v)).unwrap()
    };
    let mut big = q(rng.values(4 * N, 1.0, 0.0));
    let mut extra = [q(rng.values(N, 1.0, 0.0)), q(rng.values(N, 1.0, 0.0))];
    let read = |big: &Vec<f64>, extra: &[Vec<f64>; 2], v: usize| -> Vec<f64> {
        match range(v) {
            (0, s) => big[s..s + N].to_vec(),
            (b, _) => extra[b - 5].clone(),
        }
    };
    let write =
        |big: &mut Vec<f64>, extra: &mut [Vec<f64>; 2], v: usize, data: Vec<f64>| match range(v) {
            (0, s) => big[s..s + N].copy_from_slice(&data),
            (b, _) => extra[b - 5] = data,
        };
    let axpby = |big: &mut Vec<f64>, extra: &mut [Vec<f64>; 2], x, y, out, a: f32, b: f32| {
        let (xv, yv) = (read(big, extra, x), read(big, extra, y));
        let r = xv
            .iter()
            .zip(&yv)
            .map(|(p, q)| a as f64 * p + b as f64 * q)
            .collect();
        write(big, extra, out, r);
    };
    for op in ops {
        match op {
            Op::Axpby { x, y, out, a, b } => axpby(&mut big, &mut extra, *x, *y, *out, *a, *b),
            Op::Copy { src, dst } => {
                let d = read(&big, &extra, *src);
                write(&mut big, &mut extra, *dst, d);
            }
            Op::Concurrent(list) => {
                for (x, y, out, a, b) in list {
                    axpby(&mut big, &mut extra, *x, *y, *out, *a, *b);
                }
            }
        }
    }
    (0..VIEWS).map(|v| read(&big, &extra, v)).collect()
}

#[test]
fn random_programs_agree_bit_for_bit_in_direct_and_graph_mode() {
    let Some((_serial, dev)) = device("random_programs") else {
        return;
    };
    let mut direct = encoder(&dev, false, 1000, 16);
    for seed in 0..40u64 {
        let len = 1 + (seed as usize * 37) % 200;
        let ops = random_program(seed, len);
        // Small, varying batch limits force commits at every kind of boundary.
        let mut graph = encoder(&dev, true, 1 + (seed as usize % 13), 8);
        let (dv, gv) = (make_views(&mut direct, seed), make_views(&mut graph, seed));
        run_program(&mut direct, &dv, &ops);
        run_program(&mut graph, &gv, &ops);
        let (d, g) = (results(&mut direct, &dv), results(&mut graph, &gv));
        assert_eq!(
            d, g,
            "seed {seed}: direct and graph mode differ ({len} ops)"
        );
        // Both also match the CPU (so neither mode silently did nothing).
        let want = emulate(seed, &ops);
        for (v, bytes) in d.iter().enumerate() {
            let got = kiln::dtype::decode(DType::F32, bytes).unwrap();
            let err = got
                .iter()
                .zip(&want[v])
                .map(|(g, w)| (g - w).abs())
                .fold(0.0, f64::max);
            assert!(err < 1e-4, "seed {seed} view {v}: max error {err}");
        }
        assert!(graph.stats().graph_commits > 0);
    }
}

#[test]
fn a_repeated_program_hits_the_executable_cache() {
    let Some((_serial, dev)) = device("exec_cache_hits") else {
        return;
    };
    let mut enc = encoder(&dev, true, 1000, 16);
    let views = make_views(&mut enc, 1);
    let ops = random_program(1, 100);
    enc.synchronize().unwrap();
    let before = enc.stats();
    let driver_allocs = dev.allocator().stats().driver_allocs;
    for _ in 0..5 {
        run_program(&mut enc, &views, &ops);
        enc.synchronize().unwrap();
    }
    let s = enc.stats();
    assert_eq!(s.graph_commits - before.graph_commits, 5);
    assert_eq!(s.instantiations - before.instantiations, 1, "{s:?}");
    assert_eq!(s.exec_cache_hits - before.exec_cache_hits, 4, "{s:?}");
    // Same buffers, same arguments: launched without any update.
    assert_eq!(s.exec_reuses - before.exec_reuses, 4, "{s:?}");
    assert_eq!(
        dev.allocator().stats().driver_allocs,
        driver_allocs,
        "steady state allocates"
    );
}

#[test]
fn changed_arguments_patch_the_cached_executable() {
    let Some((_serial, dev)) = device("exec_update") else {
        return;
    };
    let mut enc = encoder(&dev, true, 1000, 16);
    let mut direct = encoder(&dev, false, 1000, 16);
    let views = make_views(&mut enc, 2);
    let dviews = make_views(&mut direct, 2);
    for round in 0..3 {
        // Same topology, different scalars each round.
        let s = 0.5 + round as f32 * 0.1;
        for (e, v) in [(&mut enc, &views), (&mut direct, &dviews)] {
            axpby(e, s, &v[0], 1.0, &v[1], &v[5]).unwrap();
            axpby(e, 1.0, &v[5], s, &v[2], &v[6]).unwrap();
        }
        enc.synchronize().unwrap();
    }
    let st = enc.stats();
    assert_eq!(
        (st.instantiations, st.exec_cache_hits, st.updates),
        (1, 2, 2),
        "{st:?}"
    );
    assert_eq!(results(&mut enc, &views), results(&mut direct, &dviews));
}

/// The regression behind failing driver calls: after a whole-graph update (a node's function
/// changed), later node patches must still name the nodes of the graph the executable was
/// instantiated from.
#[test]
fn patches_after_a_whole_graph_update_are_accepted() {
    let Some((_serial, dev)) = device("patch_after_update") else {
        return;
    };
    let mut enc = encoder(&dev, true, 1000, 16);
    let mut direct = encoder(&dev, false, 1000, 16);
    let (views, dviews) = (make_views(&mut enc, 5), make_views(&mut direct, 5));
    let spin = dev
        .kernel(&KernelSpec::try_new(&SPIN_COPY, DType::F32, 256, 1, &[]).unwrap())
        .unwrap();
    // One node: axpby, then the copy kernel (a function change: a whole update), the copy with
    // other arguments (a patch), axpby (a whole update), axpby with other arguments (a patch).
    for (round, use_copy) in [false, true, true, false, false].into_iter().enumerate() {
        for (e, v) in [(&mut enc, &views), (&mut direct, &dviews)] {
            if use_copy {
                let (src, dst) = (&v[round], &v[6]);
                let mut args = KernelArgs::new();
                args.push(src.device_ptr())
                    .push(dst.device_ptr())
                    .push(N as i64)
                    .push(round as i64);
                // SAFETY: the arguments match the kernel's parameters; it touches only the
                // arrays listed, as listed.
                unsafe { e.launch(&spin, 1, 256, 0, args, &[src], &[dst]) }.unwrap();
            } else {
                axpby(e, 0.5 + round as f32, &v[0], 1.0, &v[1], &v[5]).unwrap();
            }
            e.synchronize().unwrap();
        }
    }
    let s = enc.stats();
    assert_eq!(s.refused_patches, 0, "{s:?}");
    assert_eq!((s.instantiations, s.reinstantiations), (1, 0), "{s:?}");
    assert_eq!((s.exec_cache_hits, s.updates), (4, 4), "{s:?}");
    assert_eq!(results(&mut enc, &views), results(&mut direct, &dviews));
}

#[test]
fn a_cache_of_two_evicts_under_three_alternating_topologies() {
    let Some((_serial, dev)) = device("exec_cache_eviction") else {
        return;
    };
    let mut graph = encoder(&dev, true, 1000, 2);
    let mut direct = encoder(&dev, false, 1000, 2);
    let (gv, dv) = (make_views(&mut graph, 3), make_views(&mut direct, 3));
    let programs: Vec<Vec<Op>> = (10..13)
        .map(|s| random_program(s, 20 + s as usize))
        .collect();
    for round in 0..2 {
        for p in &programs {
            run_program(&mut graph, &gv, p);
            graph.synchronize().unwrap();
            run_program(&mut direct, &dv, p);
        }
        let _ = round;
    }
    let s = graph.stats();
    // LRU of 2 under A B C A B C: every commit misses; each insert past two evicts.
    assert_eq!(s.graph_commits, 6, "{s:?}");
    assert_eq!(s.instantiations, 6, "{s:?}");
    assert_eq!(s.evictions, 4, "{s:?}");
    assert_eq!(results(&mut graph, &gv), results(&mut direct, &dv));
}

static SPIN_COPY: TemplateDef = TemplateDef {
    name: "test_spin_copy",
    source: r#"{{> prelude}}
extern "C" __global__ void {{kernel}}(const float* src, float* dst, long long n, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
  for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"#,
    kernel: "test_spin_copy",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

#[test]
fn buffers_are_not_reused_while_the_gpu_may_read_them() {
    let Some((_serial, dev)) = device("buffer_lifetimes") else {
        return;
    };
    for graphs in [false, true] {
        let mut enc = encoder(&dev, graphs, 1000, 4);
        let values: Vec<f64> = (0..N).map(|i| i as f64).collect();
        let src = Array::from_f64(&mut enc, DType::F32, &values, &[N]).unwrap();
        let dst = Array::empty(&dev, DType::F32, &[N]).unwrap();
        let kernel = dev
            .kernel(&KernelSpec::try_new(&SPIN_COPY, DType::F32, 256, 1, &[]).unwrap())
            .unwrap();
        let mut args = KernelArgs::new();
        // About 50 ms of spinning before the kernel reads src.
        args.push(src.device_ptr())
            .push(dst.device_ptr())
            .push(N as i64)
            .push(100_000_000i64);
        // SAFETY: the arguments match the kernel's parameters; it touches only the
        // arrays listed, as listed.
        unsafe { enc.launch(&kernel, 1, 256, 0, args, &[&src], &[&dst]) }.unwrap();
        enc.commit().unwrap();
        let old = src.buffer_id();
        drop(src); // the GPU has not read it yet
                   // A new allocation of the same size must not get the old buffer.
        let other = Array::empty(&dev, DType::F32, &[N]).unwrap();
        assert_ne!(
            other.buffer_id(),
            old,
            "graphs={graphs}: buffer reused while in flight"
        );
        // Scribble over the new buffer from the host, synchronously: had it been the old one,
        // the spinning kernel would copy garbage.
        let junk = vec![0xFFu8; N * 4];
        unsafe {
            dev.bind().unwrap();
            let st = cudarc::driver::sys::cuMemcpyHtoD_v2(
                other.device_ptr(),
                junk.as_ptr().cast(),
                junk.len(),
            );
            assert_eq!(st, cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS);
        }
        assert_eq!(dst.to_f64(&mut enc).unwrap(), values, "graphs={graphs}");
        drop(other);
        // Once the GPU is done, the memory is reused (the cache works): it comes back before
        // the allocator asks the driver for more.
        let allocs = dev.allocator().stats().driver_allocs;
        let mut again = Vec::new();
        while dev.allocator().stats().driver_allocs == allocs {
            let a = Array::empty(&dev, DType::F32, &[N]).unwrap();
            if a.buffer_id() == old {
                break;
            }
            again.push(a);
        }
        assert_eq!(
            dev.allocator().stats().driver_allocs,
            allocs,
            "graphs={graphs}: the old buffer was not reused"
        );
    }
}

#[test]
fn out_of_memory_is_an_error_and_the_encoder_still_works() {
    let Some((_serial, dev)) = device("out_of_memory") else {
        return;
    };
    let mut enc = encoder(&dev, true, 20, 16);
    let huge = 1usize << 50;
    match Array::empty(&dev, DType::F32, &[huge / 4]) {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, huge),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let views = make_views(&mut enc, 4);
    let ops = random_program(4, 30);
    run_program(&mut enc, &views, &ops);
    let got = results(&mut enc, &views);
    let want = emulate(4, &ops);
    for (v, bytes) in got.iter().enumerate() {
        let g = kiln::dtype::decode(DType::F32, bytes).unwrap();
        let err = g
            .iter()
            .zip(&want[v])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-4);
    }
}

#[test]
fn the_allocator_caches_and_releases() {
    let Some((_serial, dev)) = device("allocator") else {
        return;
    };
    let a = dev.allocator();
    a.release_cache().unwrap();
    let before = a.stats();
    let b1 = a.alloc(1000).unwrap();
    let p = b1.ptr();
    drop(b1);
    assert_eq!(a.stats().cached, before.cached + 1024);
    let b2 = a.alloc(700).unwrap(); // same size class
    assert_eq!(b2.ptr(), p);
    drop(b2);
    a.release_cache().unwrap();
    assert_eq!(a.stats().cached, 0);
    assert!(a.stats().peak >= 1024);
}

/// Memory kiln holds from the driver (in use plus cached).
fn held(dev: &Arc<Device>) -> usize {
    let s = dev.allocator().stats();
    s.active + s.cached
}

#[test]
fn a_loop_that_never_synchronises_holds_bounded_memory() {
    let Some((_serial, dev)) = device("bounded_loop") else {
        return;
    };
    // KILN_TEST_LOOP_STEPS shortens the loop under compute-sanitizer (scripts/sanitize.sh).
    let steps: usize = std::env::var("KILN_TEST_LOOP_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let early_step = steps / 10;
    for graphs in [true, false] {
        let mut enc = encoder(&dev, graphs, 50, 400);
        let model = common::train_step::Model::new(&mut enc, 15);
        // What one step takes from the driver on an empty cache: the growth to stay under.
        enc.synchronize().unwrap();
        dev.allocator().release_cache().unwrap();
        let before = held(&dev);
        let (want_dx, want_dw) = model.step(&mut enc);
        let step_bytes = held(&dev) - before;
        let (want_dx, want_dw) = (
            want_dx.to_bytes(&mut enc).unwrap(),
            want_dw.to_bytes(&mut enc).unwrap(),
        );
        assert!(step_bytes >= 1 << 20, "one step takes {step_bytes} bytes");
        let mut early = None;
        let mut last = None;
        for step in 1..=steps {
            let out = model.step(&mut enc);
            if step == early_step {
                early = Some((
                    held(&dev),
                    dev.allocator().stats().driver_allocs,
                    enc.stats(),
                ));
            }
            if step == steps {
                last = Some(out);
            }
        }
        let (held_early, allocs_early, stats_early) = early.unwrap();
        let (held_late, allocs_late, stats_late) = (
            held(&dev),
            dev.allocator().stats().driver_allocs,
            enc.stats(),
        );
        let mode = if graphs { "graph" } else { "direct" };
        eprintln!(
            "{mode}: one step {step_bytes} B; held {held_early} -> {held_late} B; driver \
             allocations {allocs_early} -> {allocs_late}; {stats_late:?}"
        );
        assert!(
            held_late < held_early + step_bytes,
            "{mode}: memory grew from {held_early} to {held_late} bytes (one step: {step_bytes})"
        );
        assert_eq!(allocs_late, allocs_early, "{mode}: driver allocations grew");
        if graphs {
            let commits = stats_late.graph_commits - stats_early.graph_commits;
            let as_is = stats_late.exec_reuses - stats_early.exec_reuses;
            assert!(
                commits > 0 && as_is * 10 >= commits * 9,
                "{mode}: {as_is} of {commits} commits launched as is"
            );
        }
        // Reused memory changed nothing: the last step equals the synchronised first.
        let (dx, dw) = last.unwrap();
        assert!(
            dx.to_bytes(&mut enc).unwrap() == want_dx,
            "{mode}: dx differs"
        );
        assert!(
            dw.to_bytes(&mut enc).unwrap() == want_dw,
            "{mode}: dw differs"
        );
    }
}

#[test]
fn the_host_waits_when_too_much_work_is_in_flight() {
    let Some((_serial, dev)) = device("in_flight_bounds") else {
        return;
    };
    let mut config = Config::from_env().unwrap();
    config.max_ops_per_buffer = Some(1);
    config.max_commits_in_flight = 2;
    let mut enc = CommandEncoder::with_config(&dev, &config).unwrap();
    let kernel = dev
        .kernel(&KernelSpec::try_new(&SPIN_COPY, DType::F32, 256, 1, &[]).unwrap())
        .unwrap();
    let src = Array::from_f64(&mut enc, DType::F32, &[1.0; N], &[N]).unwrap();
    let dst = Array::empty(&dev, DType::F32, &[N]).unwrap();
    for _ in 0..6 {
        let mut args = KernelArgs::new();
        // About 5 ms each.
        args.push(src.device_ptr())
            .push(dst.device_ptr())
            .push(N as i64)
            .push(10_000_000i64);
        // SAFETY: the arguments match the kernel's parameters; it touches only the
        // arrays listed, as listed.
        unsafe { enc.launch(&kernel, 1, 256, 0, args, &[&src], &[&dst]) }.unwrap();
        assert!(enc.commits_in_flight() <= 2, "{}", enc.commits_in_flight());
    }
    assert!(enc.stats().throttled_commits >= 3, "{:?}", enc.stats());
    enc.synchronize().unwrap();
    assert_eq!(enc.commits_in_flight(), 0);
}

static READ_MAP: TemplateDef = TemplateDef {
    name: "test_read_map",
    source: r#"{{> prelude}}
// The layout of a CUDA tensor map: 128 bytes, 64-byte aligned, passed by value.
struct __align__(64) kiln_map { unsigned long long words[16]; };
extern "C" __global__ void {{kernel}}(unsigned int tag, const __grid_constant__ kiln_map map,
                                      unsigned long long* out) {
  int i = threadIdx.x;
  if (i < 16) out[i] = map.words[i] + tag;
}
"#,
    kernel: "test_read_map",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

/// A 64-byte aligned 128-byte parameter (the shape of a tensor map) reaches the kernel intact,
/// launched directly and as a graph node.
#[test]
fn a_tensor_map_sized_argument_passes_by_value() {
    let Some((_serial, dev)) = device("tensor_map_argument") else {
        return;
    };
    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Map([u64; 16]);
    let kernel = dev
        .kernel(&KernelSpec::try_new(&READ_MAP, DType::F32, 32, 1, &[]).unwrap())
        .unwrap();
    for graphs in [false, true] {
        let mut enc = encoder(&dev, graphs, 1000, 4);
        let out = Array::empty(&dev, DType::F32, &[32]).unwrap(); // 16 u64
        let map = Map(std::array::from_fn(|i| (i as u64) << 33 | 7));
        let mut args = KernelArgs::new();
        args.push(1000u32).push(map).push(out.device_ptr());
        // SAFETY: the arguments match the kernel's parameters; it touches only the
        // arrays listed, as listed.
        unsafe { enc.launch(&kernel, 1, 32, 0, args, &[], &[&out]) }.unwrap();
        let bytes = out.to_bytes(&mut enc).unwrap();
        let got: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let want: Vec<u64> = map.0.iter().map(|w| w + 1000).collect();
        assert_eq!(got, want, "graphs={graphs}");
    }
}

static TMA_TILE: TemplateDef = TemplateDef {
    name: "test_tma_tile",
    source: r#"{{> prelude}}
{{> tma}}
// One block copies the 16 x 32 box at (x0, y0) into shared memory with the copy engine, then
// writes it out row by row.
extern "C" __global__ void {{kernel}}(const __grid_constant__ kiln_tensor_map map, {{dtype}}* out,
                                      int x0, int y0) {
  constexpr int ROWS = 16, COLS = 32;
  __shared__ __align__(128) {{dtype}} tile[ROWS * COLS];
  __shared__ __align__(8) unsigned long long bar;
  if (threadIdx.x == 0) kiln_mbarrier_init(&bar, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    kiln_mbarrier_expect_bytes(&bar, sizeof(tile));
    kiln_tma_load_2d(tile, &map, x0, y0, &bar);
  }
  kiln_mbarrier_wait(&bar, 0);
  for (int i = threadIdx.x; i < ROWS * COLS; i += blockDim.x) out[i] = tile[i];
}
"#,
    kernel: "test_tma_tile",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

/// The tensor memory accelerator loads a box through a map passed by value, zero outside the
/// array, in both modes; bad boxes are errors naming the argument.
#[test]
fn a_tensor_map_box_loads_through_the_copy_engine() {
    use kiln::runtime::tensor_map::{tiled, Swizzle};
    let Some((_serial, dev)) = device("tensor_map_load") else {
        return;
    };
    if dev.info().compute_capability.0 < 9 {
        eprintln!("tensor_map_load: skipped (needs sm_90)");
        return;
    }
    let (rows, cols) = (100usize, 72usize);
    for dtype in [DType::F32, DType::BF16] {
        let kernel = dev
            .kernel(&KernelSpec::try_new(&TMA_TILE, dtype, 128, 1, &[]).unwrap())
            .unwrap();
        for graphs in [false, true] {
            let mut enc = encoder(&dev, graphs, 1000, 4);
            let host: Vec<f64> = (0..rows * cols).map(|i| (i % 251) as f64 - 100.0).collect();
            let src = Array::from_f64(&mut enc, dtype, &host, &[rows, cols]).unwrap();
            let map = tiled(&src, &[16, 32], Swizzle::None).unwrap();
            for (x0, y0) in [(8usize, 3usize), (40, 90)] {
                let out = Array::empty(&dev, dtype, &[16 * 32]).unwrap();
                let mut args = KernelArgs::new();
                args.push(map)
                    .push(out.device_ptr())
                    .push(x0 as i32)
                    .push(y0 as i32);
                // SAFETY: the arguments match the kernel's parameters; it touches only the
                // arrays listed, as listed.
                unsafe { enc.launch(&kernel, 1, 128, 0, args, &[&src], &[&out]) }.unwrap();
                let want: Vec<f64> = (0..16 * 32)
                    .map(|i| {
                        let (r, c) = (y0 + i / 32, x0 + i % 32);
                        if r < rows && c < cols {
                            host[r * cols + c]
                        } else {
                            0.0
                        }
                    })
                    .collect();
                assert_eq!(
                    out.to_f64(&mut enc).unwrap(),
                    want,
                    "{dtype} graphs={graphs} box at ({x0}, {y0})"
                );
            }
        }
    }
    // Boxes the copy engine cannot take are errors, never driver failures.
    let mut enc = encoder(&dev, true, 1000, 4);
    let a = Array::from_f64(&mut enc, DType::F32, &[0.0; 64 * 64], &[64, 64]).unwrap();
    for (shape, swizzle) in [
        (&[16usize, 3][..], Swizzle::None), // 12 bytes: not a multiple of 16
        (&[300, 32], Swizzle::None),        // over 256
        (&[16, 64], Swizzle::B128),         // 256 bytes, wider than the swizzle
        (&[16], Swizzle::None),             // wrong rank
    ] {
        match tiled(&a, shape, swizzle) {
            Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, "box_shape"),
            other => panic!("{shape:?} {swizzle:?}: expected an error, got {other:?}"),
        }
    }
    let odd = a.slice(1, 1, 64, 1).unwrap(); // starts 4 bytes in
    assert!(matches!(
        tiled(&odd, &[16, 32], Swizzle::None),
        Err(Error::InvalidArgument { arg: "array", .. })
    ));
}

/// An encoder dropped with work whose commit fails (a block of 2,048 threads, which no kernel
/// can take: the driver refuses it when the graph is built, not at `launch`) cannot return the
/// error; the next encoder made on the device does, once.
#[test]
fn an_error_met_in_drop_comes_back_at_the_next_call() {
    let Some((_serial, dev)) = device("error_in_drop") else {
        return;
    };
    let kernel = dev.kernel(&kiln::ops::axpby::spec(DType::F32)).unwrap();
    {
        let mut enc = encoder(&dev, true, 1000, 4);
        let x = Array::from_f64(&mut enc, DType::F32, &[1.0; 64], &[64]).unwrap();
        enc.synchronize().unwrap();
        let mut args = KernelArgs::new();
        args.push(x.device_ptr())
            .push(x.device_ptr())
            .push(x.device_ptr())
            .push(64i64)
            .push(1.0f32)
            .push(1.0f32);
        // SAFETY: axpby's arguments (x, y, out, n, a, b); x is read and written, 64 elements.
        unsafe { enc.launch(&kernel, 1, 2048, 0, args, &[&x], &[&x]) }.unwrap();
    }
    let mut config = Config::from_env().unwrap();
    config.use_cuda_graphs = true;
    let next = CommandEncoder::with_config(&dev, &config);
    assert!(
        matches!(next, Err(kiln::Error::Driver(_))),
        "{:?}",
        next.err()
    );
    let mut enc = CommandEncoder::with_config(&dev, &config).unwrap();
    enc.synchronize().unwrap();
}

/// Arguments KernelArgs refused (too many) make the launch an error, before anything reaches
/// the driver; the encoder goes on working.
#[test]
fn refused_arguments_are_a_launch_error() {
    let Some((_serial, dev)) = device("refused_arguments") else {
        return;
    };
    let kernel = dev.kernel(&kiln::ops::axpby::spec(DType::F32)).unwrap();
    for graphs in [false, true] {
        let mut enc = encoder(&dev, graphs, 1000, 4);
        let x = Array::from_f64(&mut enc, DType::F32, &[1.0; 64], &[64]).unwrap();
        let mut args = KernelArgs::new();
        for _ in 0..25 {
            args.push(x.device_ptr());
        }
        // SAFETY: refused before the launch; nothing runs.
        let got = unsafe { enc.launch(&kernel, 1, 64, 0, args, &[&x], &[&x]) };
        assert!(
            matches!(&got, Err(kiln::Error::InvalidArgument { arg: "args", .. })),
            "{got:?}"
        );
        enc.synchronize().unwrap();
        assert_eq!(x.to_f64(&mut enc).unwrap(), vec![1.0; 64]);
    }
}

/// With two GPUs: an array of the other GPU is refused by launches, captured work and the ops,
/// in both modes. Skipped with fewer than two GPUs.
#[test]
fn arrays_of_another_gpu_are_refused() {
    let Some(gpus) = common::gpus_or_skip("arrays_of_another_gpu") else {
        return;
    };
    if gpus.len() < 2 {
        eprintln!("arrays_of_another_gpu: skipped (one GPU)");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (dev0, dev1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
    let kernel = dev0.kernel(&kiln::ops::axpby::spec(DType::F32)).unwrap();
    for graphs in [false, true] {
        let mut enc0 = encoder(&dev0, graphs, 1000, 4);
        let mut enc1 = encoder(&dev1, graphs, 1000, 4);
        let mine = Array::from_f64(&mut enc0, DType::F32, &[1.0; 64], &[64]).unwrap();
        let theirs = Array::from_f64(&mut enc1, DType::F32, &[2.0; 64], &[64]).unwrap();
        enc1.synchronize().unwrap();
        let is_refusal = |r: &kiln::Result<_>| {
            matches!(
                r,
                Err(kiln::Error::DeviceMismatch {
                    arg: "reads",
                    expected: 0,
                    got: 1
                })
            )
        };
        let mut args = KernelArgs::new();
        args.push(theirs.device_ptr())
            .push(mine.device_ptr())
            .push(mine.device_ptr())
            .push(64i64)
            .push(1.0f32)
            .push(1.0f32);
        // SAFETY: refused before the launch (theirs is on GPU 1); nothing runs.
        let got = unsafe { enc0.launch(&kernel, 1, 64, 0, args, &[&theirs, &mine], &[&mine]) };
        assert!(is_refusal(&got), "launch: {got:?}");
        // The ops check through the same launch path.
        let sum = kiln::ops::axpby::axpby(&mut enc0, 1.0, &theirs, 1.0, &mine, &mine);
        assert!(is_refusal(&sum), "axpby: {sum:?}");
        let p = kiln::ops::conv::ConvParams::default();
        let x1 = Array::from_f64(&mut enc1, DType::F32, &[1.0; 16], &[1, 4, 4, 1]).unwrap();
        let w0 = Array::from_f64(&mut enc0, DType::F32, &[1.0; 1], &[1, 1, 1, 1]).unwrap();
        let y = kiln::ops::conv::conv_forward(&mut enc0, &x1, &w0, &p);
        assert!(
            matches!(&y, Err(kiln::Error::DeviceMismatch { got: 1, .. })),
            "conv: {y:?}"
        );
        enc0.synchronize().unwrap();
        assert_eq!(mine.to_f64(&mut enc0).unwrap(), vec![1.0; 64]);
    }
}
