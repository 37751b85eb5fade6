//! NCCL collectives on two GPUs, against host computations: every collective and reduction,
//! every dtype, direct and graph mode, with one process driving both GPUs (a thread per rank)
//! and with one process per GPU (this test executable started twice, meeting through an id
//! file). Failures must be errors, never hangs: ranks that disagree on a collective's dtype or
//! size, and a peer that died.
//!
//! Skipped without two GPUs or without NCCL; `KILN_REQUIRE_MULTI_GPU=1` turns the skip into a
//! failure (`KILN_REQUIRE_GPU` does not, so that single-GPU machines still pass).

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln::dist::{Communicator, ReduceOp};
use kiln::env::Config;
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::{DType, Error};

/// Tests that use both GPUs run one at a time.
static GPUS: Mutex<()> = Mutex::new(());

const SCENARIO: &str = "KILN_TEST_NCCL_SCENARIO";

fn two_gpus_or_skip(test: &str) -> bool {
    let why = match kiln::runtime::gpus() {
        Ok(g) if g.len() >= 2 => match kiln::dist::Nccl::get(None) {
            Ok(_) => return true,
            Err(e) => e.to_string(),
        },
        Ok(g) => format!("{} GPU(s), two needed", g.len()),
        Err(e) => e.to_string(),
    };
    if std::env::var("KILN_REQUIRE_MULTI_GPU").is_ok_and(|v| v == "1") {
        panic!("{test}: KILN_REQUIRE_MULTI_GPU=1 but {why}");
    }
    eprintln!("{test}: skipped ({why})");
    false
}

fn encoder(device: &Arc<Device>, graphs: bool) -> CommandEncoder {
    let mut config = Config::from_env().unwrap();
    config.use_cuda_graphs = graphs;
    CommandEncoder::with_config(device, &config).unwrap()
}

/// Rank `r`'s value at index `i`: small integers, so that sums, products and averages of two
/// ranks are exact in every dtype and the check can ask for equality.
fn value(i: usize, r: usize) -> f64 {
    ((i * 7 + r * 3 + i / 5) % 9) as f64 - 4.0
}

fn values(n: usize, r: usize) -> Vec<f64> {
    (0..n).map(|i| value(i, r)).collect()
}

fn reduce(op: ReduceOp, xs: &[f64]) -> f64 {
    match op {
        ReduceOp::Sum => xs.iter().sum(),
        ReduceOp::Prod => xs.iter().product(),
        ReduceOp::Max => xs.iter().cloned().fold(f64::MIN, f64::max),
        ReduceOp::Min => xs.iter().cloned().fold(f64::MAX, f64::min),
        ReduceOp::Avg => xs.iter().sum::<f64>() / xs.len() as f64,
    }
}

fn expect_equal(what: &str, got: &[f64], want: &[f64]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        return Err(format!("{what}: [{i}] = {}, expected {}", got[i], want[i]));
    }
    Ok(())
}

/// Every collective on this rank, checked against the host; the same calls on every rank.
fn run_matrix(comm: &Communicator, graphs: bool) -> Result<(), String> {
    let (rank, n_ranks) = (comm.rank(), comm.nranks());
    let mut enc = encoder(comm.device(), graphs);
    let e = |e: Error| e.to_string();
    let mode = if graphs { "graph" } else { "direct" };
    let verbose = std::env::var_os("KILN_TEST_VERBOSE").is_some();
    for dtype in DType::ALL {
        for n in [1usize, 1000, 65537] {
            let at = |what: &str| format!("{mode} {dtype} n={n} rank {rank}: {what}");
            if verbose {
                eprintln!("{}", at("start"));
            }
            let x = Array::from_f64(&mut enc, dtype, &values(n, rank), &[n]).map_err(e)?;
            let out = Array::empty(comm.device(), dtype, &[n]).map_err(e)?;
            for op in ReduceOp::ALL {
                if verbose {
                    eprintln!("{}", at(op.name()));
                }
                comm.all_reduce(&mut enc, &x, &out, op).map_err(e)?;
                let want: Vec<f64> = (0..n)
                    .map(|i| reduce(op, &(0..n_ranks).map(|r| value(i, r)).collect::<Vec<_>>()))
                    .collect();
                let got = out.to_f64(&mut enc).map_err(e)?;
                expect_equal(&at(&format!("all_reduce {}", op.name())), &got, &want)?;
            }
            // In place, twice: a repeated graph is launched from the executable cache.
            for round in 0..2 {
                let y =
                    Array::from_f64(&mut enc, dtype, &values(n, rank + round), &[n]).map_err(e)?;
                comm.all_reduce(&mut enc, &y, &y, ReduceOp::Max)
                    .map_err(e)?;
                let want: Vec<f64> = (0..n)
                    .map(|i| {
                        (0..n_ranks)
                            .map(|r| value(i, r + round))
                            .fold(f64::MIN, f64::max)
                    })
                    .collect();
                let got = y.to_f64(&mut enc).map_err(e)?;
                expect_equal(
                    &at(&format!("in-place all_reduce round {round}")),
                    &got,
                    &want,
                )?;
            }

            // The same call again and again on one buffer: from the second call on, its kept
            // capture is launched again (in graph mode several times within one graph).
            let z = Array::from_f64(&mut enc, dtype, &values(n, rank), &[n]).map_err(e)?;
            // After the first call every rank holds the sums; each further call multiplies
            // them by the number of ranks.
            let mut want: Vec<f64> = (0..n)
                .map(|i| (0..n_ranks).map(|r| value(i, r)).sum())
                .collect();
            let mut first = true;
            for calls in [3, 1] {
                for _ in 0..calls {
                    comm.all_reduce(&mut enc, &z, &z, ReduceOp::Sum)
                        .map_err(e)?;
                    if !first {
                        want.iter_mut().for_each(|w| *w *= n_ranks as f64);
                    }
                    first = false;
                }
                let got = z.to_f64(&mut enc).map_err(e)?;
                expect_equal(&at(&format!("{calls} repeated all_reduce")), &got, &want)?;
            }

            if verbose {
                eprintln!("{}", at("gather, scatter, broadcast, send"));
            }
            let gathered = Array::empty(comm.device(), dtype, &[n_ranks * n]).map_err(e)?;
            comm.all_gather(&mut enc, &x, &gathered).map_err(e)?;
            let want: Vec<f64> = (0..n_ranks).flat_map(|r| values(n, r)).collect();
            let got = gathered.to_f64(&mut enc).map_err(e)?;
            expect_equal(&at("all_gather"), &got, &want)?;

            // reduce_scatter: every rank contributes n_ranks * n values; rank r keeps slice r.
            let wide_values: Vec<Vec<f64>> = (0..n_ranks).map(|r| values(n_ranks * n, r)).collect();
            let wide =
                Array::from_f64(&mut enc, dtype, &wide_values[rank], &[n_ranks * n]).map_err(e)?;
            for op in ReduceOp::ALL {
                comm.reduce_scatter(&mut enc, &wide, &out, op).map_err(e)?;
                let want: Vec<f64> = (0..n)
                    .map(|i| {
                        let j = rank * n + i;
                        reduce(
                            op,
                            &(0..n_ranks).map(|r| wide_values[r][j]).collect::<Vec<_>>(),
                        )
                    })
                    .collect();
                let got = out.to_f64(&mut enc).map_err(e)?;
                expect_equal(&at(&format!("reduce_scatter {}", op.name())), &got, &want)?;
            }

            for root in 0..n_ranks {
                comm.broadcast(&mut enc, &x, &out, root).map_err(e)?;
                let got = out.to_f64(&mut enc).map_err(e)?;
                expect_equal(
                    &at(&format!("broadcast from {root}")),
                    &got,
                    &values(n, root),
                )?;
            }

            // A ring of sends: rank r sends to r+1 and receives from r-1. Even ranks send first,
            // so that two ranks never both wait to send.
            let next = (rank + 1) % n_ranks;
            let prev = (rank + n_ranks - 1) % n_ranks;
            if rank % 2 == 0 {
                comm.send(&mut enc, &x, next).map_err(e)?;
                comm.recv(&mut enc, &out, prev).map_err(e)?;
            } else {
                comm.recv(&mut enc, &out, prev).map_err(e)?;
                comm.send(&mut enc, &x, next).map_err(e)?;
            }
            let got = out.to_f64(&mut enc).map_err(e)?;
            expect_equal(&at(&format!("recv from {prev}")), &got, &values(n, prev))?;
        }
    }
    enc.synchronize().map_err(e)?;
    Ok(())
}

#[test]
fn one_process_every_collective_every_dtype_direct_and_graph() {
    let _gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    if !two_gpus_or_skip("one_process_every_collective") {
        return;
    }
    verbose_log();
    let devices: Vec<Arc<Device>> = (0..2).map(|i| Device::get(i).unwrap()).collect();
    let comms = Communicator::init_all(&devices).unwrap();
    assert_eq!(comms.iter().map(|c| c.rank()).collect::<Vec<_>>(), [0, 1]);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                s.spawn(move || {
                    run_matrix(comm, false)?;
                    run_matrix(comm, true)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        r.unwrap();
    }
}

#[test]
fn arguments_are_checked_before_anything_runs() {
    let _gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    if !two_gpus_or_skip("arguments_are_checked") {
        return;
    }
    let devices: Vec<Arc<Device>> = (0..2).map(|i| Device::get(i).unwrap()).collect();
    let comms = Communicator::init_all(&devices).unwrap();
    let comm = &comms[0];
    let mut enc = encoder(&devices[0], true);
    let x = Array::empty(&devices[0], DType::F32, &[8]).unwrap();
    let f16 = Array::empty(&devices[0], DType::F16, &[8]).unwrap();
    let short = Array::empty(&devices[0], DType::F32, &[7]).unwrap();
    let other_gpu = Array::empty(&devices[1], DType::F32, &[8]).unwrap();
    let strided = Array::empty(&devices[0], DType::F32, &[4, 4])
        .unwrap()
        .slice(1, 0, 4, 2)
        .unwrap();
    let cases: Vec<(&str, kiln::Result<()>)> = vec![
        ("dtype", comm.all_reduce(&mut enc, &x, &f16, ReduceOp::Sum)),
        ("size", comm.all_reduce(&mut enc, &x, &short, ReduceOp::Sum)),
        (
            "gpu",
            comm.all_reduce(&mut enc, &other_gpu, &other_gpu, ReduceOp::Sum),
        ),
        (
            "contiguous",
            comm.all_reduce(&mut enc, &strided, &strided, ReduceOp::Sum),
        ),
        ("gather size", comm.all_gather(&mut enc, &x, &x)),
        (
            "scatter split",
            comm.reduce_scatter(&mut enc, &short, &x, ReduceOp::Sum),
        ),
        ("root", comm.broadcast(&mut enc, &x, &x, 2)),
        ("peer self", comm.send(&mut enc, &x, 0)),
        ("peer range", comm.recv(&mut enc, &x, 5)),
    ];
    for (what, result) in cases {
        match result {
            Err(Error::InvalidArgument { .. }) => {}
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
    }
    // Nothing was encoded: the communicators are still in step and usable.
    drop(enc);
    drop(comms);
}

/// What a child process does, by scenario; returns what its rank saw.
fn verbose_log() {
    if std::env::var_os("KILN_TEST_VERBOSE").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("kiln=debug"))
            .with_writer(std::io::stderr)
            .try_init();
    }
}

fn child(scenario: &str) -> Result<(), String> {
    verbose_log();
    let rank: usize = std::env::var("KILN_RANK").unwrap().parse().unwrap();
    let device = Device::get(rank).map_err(|e| e.to_string())?;
    let comm = Communicator::from_env(&device).map_err(|e| e.to_string())?;
    eprintln!("rank {rank}: communicator ready ({scenario})");
    let e = |e: Error| e.to_string();
    match scenario {
        "matrix" => {
            run_matrix(&comm, false)?;
            run_matrix(&comm, true)
        }
        "dtype_mismatch" | "count_mismatch" => {
            let (dtype, n) = match (scenario, rank) {
                ("dtype_mismatch", 0) => (DType::F16, 4096),
                ("dtype_mismatch", _) => (DType::BF16, 4096),
                (_, 0) => (DType::F32, 4096),
                _ => (DType::F32, 1 << 20),
            };
            let mut enc = encoder(&device, true);
            let x = Array::from_f64(&mut enc, dtype, &values(n, rank), &[n]).map_err(e)?;
            comm.all_reduce(&mut enc, &x, &x, ReduceOp::Sum)
                .map_err(e)?;
            eprintln!("rank {rank}: encoded");
            enc.synchronize().map_err(e)
        }
        "dead_peer" => {
            if rank == 1 {
                // Dies after joining, before the collective its peer waits for.
                std::process::exit(0);
            }
            let mut enc = encoder(&device, false);
            let x =
                Array::from_f64(&mut enc, DType::F32, &values(1024, rank), &[1024]).map_err(e)?;
            comm.all_reduce(&mut enc, &x, &x, ReduceOp::Sum)
                .map_err(e)?;
            enc.synchronize().map_err(e)
        }
        "one_op" => {
            let op = std::env::var("KILN_TEST_OP").unwrap();
            let n: usize = std::env::var("KILN_TEST_N").unwrap().parse().unwrap();
            let mut enc = encoder(&device, std::env::var_os("KILN_TEST_GRAPH").is_some());
            let x =
                Array::from_f64(&mut enc, DType::F32, &values(2 * n, rank), &[2 * n]).map_err(e)?;
            let half = x.slice(0, 0, n, 1).map_err(e)?;
            let out = Array::empty(&device, DType::F32, &[n]).map_err(e)?;
            match op.as_str() {
                "all_reduce" => comm.all_reduce(&mut enc, &half, &out, ReduceOp::Sum),
                "all_gather" => {
                    let wide = Array::empty(&device, DType::F32, &[2 * n]).map_err(e)?;
                    comm.all_gather(&mut enc, &half, &wide)
                }
                "reduce_scatter" => comm.reduce_scatter(&mut enc, &x, &out, ReduceOp::Sum),
                "broadcast" => comm.broadcast(&mut enc, &half, &out, 0),
                "send" if rank == 0 => comm.send(&mut enc, &half, 1),
                _ => comm.recv(&mut enc, &out, 0),
            }
            .map_err(e)?;
            eprintln!("rank {rank}: encoded {op}");
            enc.synchronize().map_err(e)
        }
        other => Err(format!("unknown scenario {other}")),
    }
}

/// The entry point of the child processes; does nothing in a normal test run.
#[test]
fn rank_child() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    match child(&scenario) {
        Ok(()) => println!("KILN_RESULT ok"),
        Err(e) => println!("KILN_RESULT err {}", e.replace('\n', " ")),
    }
}

/// The last 20 lines of a child's output, on one line.
fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join(" | ")
}

/// Starts two ranks of `scenario` and returns what each printed as its result, and how long
/// the slower took. A rank that outlives `limit` is killed and reported as hung.
fn two_processes(scenario: &str, timeout_s: u32, limit: Duration) -> (Vec<String>, Duration) {
    two_processes_with(scenario, timeout_s, limit, &[])
}

fn two_processes_with(
    scenario: &str,
    timeout_s: u32,
    limit: Duration,
    vars: &[(&str, String)],
) -> (Vec<String>, Duration) {
    let exe = std::env::current_exe().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let id_file = dir.path().join("nccl-id");
    let start = Instant::now();
    let logs: Vec<_> = (0..2)
        .map(|rank| dir.path().join(format!("rank{rank}.out")))
        .collect();
    let mut children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", "rank_child", "--nocapture", "--test-threads=1"])
                .env(SCENARIO, scenario)
                .env("KILN_RANK", rank.to_string())
                .env("KILN_WORLD_SIZE", "2")
                .env("KILN_NCCL_ID_FILE", &id_file)
                .env("KILN_NCCL_TIMEOUT", timeout_s.to_string())
                // NVLink multicast stays off on shared machines (it can take the GPUs down).
                .env("NCCL_NVLS_ENABLE", "0")
                .envs(vars.iter().map(|(k, v)| (k, v)))
                .stdout(std::fs::File::create(&logs[rank]).unwrap())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut results = vec![String::new(); 2];
    loop {
        let mut running = 0;
        for (rank, c) in children.iter_mut().enumerate() {
            if results[rank].is_empty() {
                match c.try_wait().unwrap() {
                    Some(status) => {
                        let text = std::fs::read_to_string(&logs[rank]).unwrap_or_default();
                        results[rank] = text
                            .lines()
                            .find_map(|l| l.split_once("KILN_RESULT ").map(|(_, r)| r.to_string()))
                            .unwrap_or_else(|| {
                                format!(
                                    "exited ({status}) without a result; its output ends: {}",
                                    tail(&text)
                                )
                            });
                    }
                    None => running += 1,
                }
            }
        }
        if running == 0 {
            break;
        }
        if start.elapsed() > limit {
            for (rank, c) in children.iter_mut().enumerate() {
                if results[rank].is_empty() {
                    let _ = c.kill();
                    let text = std::fs::read_to_string(&logs[rank]).unwrap_or_default();
                    results[rank] = format!("hung; its output ends: {}", tail(&text));
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (results, start.elapsed())
}

#[test]
fn two_processes_every_collective_every_dtype_direct_and_graph() {
    let _gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    if !two_gpus_or_skip("two_processes_every_collective") {
        return;
    }
    let (results, _) = two_processes("matrix", 60, Duration::from_secs(300));
    assert_eq!(results, ["ok", "ok"]);
}

#[test]
fn ranks_that_disagree_on_the_dtype_get_a_mismatch_error() {
    let _gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    if !two_gpus_or_skip("dtype_mismatch") {
        return;
    }
    // f16 and bf16 have the same size: NCCL itself would run this and return garbage.
    let (results, _) = two_processes("dtype_mismatch", 20, Duration::from_secs(120));
    for (rank, r) in results.iter().enumerate() {
        assert!(r.contains("collective mismatch"), "rank {rank}: {r}");
    }
    assert!(
        results[0].contains("all_reduce(sum) of 4096 f16"),
        "{}",
        results[0]
    );
    assert!(
        results[1].contains("all_reduce(sum) of 4096 bf16"),
        "{}",
        results[1]
    );
}

#[test]
fn ranks_that_disagree_on_the_size_get_an_error_not_a_hang() {
    let _gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    if !two_gpus_or_skip("count_mismatch") {
        return;
    }
    let (results, took) = two_processes("count_mismatch", 10, Duration::from_secs(120));
    for (rank, r) in results.iter().enumerate() {
        assert!(
            r.contains("collective mismatch") || r.contains("did not finish within"),
            "rank {rank}: {r}"
        );
    }
    eprintln!("count mismatch: {results:?} after {took:?}");
}

#[test]
fn a_peer_that_died_is_a_timeout_not_a_hang() {
    let _gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    if !two_gpus_or_skip("dead_peer") {
        return;
    }
    let (results, took) = two_processes("dead_peer", 10, Duration::from_secs(120));
    assert!(
        results[0].contains("did not finish within 10 s") || results[0].contains("NCCL call"),
        "rank 0: {}",
        results[0]
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");
    eprintln!("dead peer: {results:?} after {took:?}");
}

/// Diagnosis: each collective alone, in its own pair of processes (run with `--ignored`).
#[test]
#[ignore]
fn each_collective_alone() {
    let _gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    if !two_gpus_or_skip("each_collective_alone") {
        return;
    }
    for check in ["1", "0"] {
        for n in ["65537", "1000"] {
            for op in [
                "all_gather",
                "reduce_scatter",
                "broadcast",
                "send",
                "all_reduce",
            ] {
                let vars = [
                    ("KILN_TEST_OP", op.to_string()),
                    ("KILN_TEST_N", n.to_string()),
                    ("KILN_NCCL_CHECK", check.to_string()),
                ];
                let (r, took) = two_processes_with("one_op", 6, Duration::from_secs(15), &vars);
                eprintln!("ALONE check={check} n={n} {op}: {took:?} {r:?}");
            }
        }
    }
}
