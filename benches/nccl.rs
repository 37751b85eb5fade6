//! all_reduce bus bandwidth over NCCL on 2 GPUs: kiln's `Communicator::all_reduce` against
//! PyTorch's `torch.distributed.all_reduce` (backend "nccl", through `benches/nccl_torch.py`),
//! measured in the same run, one process per GPU on both sides.
//!
//! What is timed: in-place sum of f32 buffers of every power of two from 1 MiB to 1 GiB
//! (`--quick`: 1, 4, 16 and 64 MiB, fewer batches). For each size, one batch of calls warms up, then
//! each timed batch starts after a 1-element all_reduce (so that both ranks start together) and
//! is timed with CUDA events on the stream the calls run on; a rank's figure is the median
//! batch, and the slower rank's figure is reported. Bus bandwidth = bytes / time x 2(n-1)/n,
//! n = 2 ranks (so equal to the algorithm bandwidth here), in GB/s.
//!
//! kiln variants: direct mode and graph mode (`use_cuda_graphs`), each with the collective check
//! on and off (`KILN_NCCL_CHECK`). The check setting is read when a communicator is created, so
//! the bench starts two pairs of rank processes: one with `KILN_NCCL_CHECK=1`, one with
//! `KILN_NCCL_CHECK=0`; each rank process times direct mode and then graph mode with encoders
//! made from `Config::from_env()` with `use_cuda_graphs` set. kiln's default is graph mode with
//! the check on.
//!
//! NVLink multicast (NVLS) stays off on both sides: `NCCL_NVLS_ENABLE=0` in every rank
//! process's environment (and `TORCH_SYMM_MEM_DISABLE_MULTICAST=1` for PyTorch).
//!
//! Target: every kiln variant >= 0.95x PyTorch's bus bandwidth at every size.
//!
//! Run: `cargo bench --bench nccl` (`-- --quick` for the smaller sizes, `-- --no-anchor` to skip
//! PyTorch). On a machine with fewer than 2 GPUs, or where NCCL cannot be loaded, it says so
//! and exits successfully. The bench binary launches itself once per rank: a process with
//! `KILN_BENCH_NCCL_RANK` set is a rank, and prints one JSON line with its timings.

mod common;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::ptr;
use std::time::Duration;

use cudarc::driver::sys;
use kiln::dist::{Communicator, Nccl, ReduceOp, UniqueId};
use kiln::env::Config;
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::DType;
use serde_json::{json, Value};

const WORLD: usize = 2;
const RANK_VAR: &str = "KILN_BENCH_NCCL_RANK";
const TARGET: f64 = 0.95;

/// The kiln variants: (column label, long name, graph mode, check on). kiln's default first.
const VARIANTS: [(&str, &str, bool, bool); 4] = [
    (
        "graph+chk",
        "kiln graph mode, check on (kiln's default)",
        true,
        true,
    ),
    ("graph", "kiln graph mode, check off", true, false),
    ("direct+chk", "kiln direct mode, check on", false, true),
    ("direct", "kiln direct mode, check off", false, false),
];

fn quick() -> bool {
    std::env::args().any(|a| a == "--quick")
}

/// Timed batches per size, and (bytes, calls per batch) for each size. Both sides use it.
fn plan(quick: bool) -> (usize, Vec<(usize, usize)>) {
    // Every power of two from 1 MiB to 1 GiB (`--quick`: every other one, to 64 MiB).
    let sizes: Vec<usize> = if quick {
        (20..=26).step_by(2).map(|p| 1 << p).collect()
    } else {
        (20..=30).map(|p| 1 << p).collect()
    };
    let (repeats, batch_bytes, most) = if quick {
        (3, 2usize << 30, 100)
    } else {
        (7, 4usize << 30, 200)
    };
    let cases = sizes
        .iter()
        .map(|&b| (b, (batch_bytes / b).clamp(10, most)))
        .collect();
    (repeats, cases)
}

fn size_name(bytes: usize) -> String {
    if bytes >= 1 << 30 {
        format!("{} GiB", bytes >> 30)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

fn bus_gbs(bytes: usize, seconds: f64) -> f64 {
    let n = WORLD as f64;
    bytes as f64 / seconds * (2.0 * (n - 1.0) / n) / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn check(status: sys::CUresult) {
    assert_eq!(status, sys::cudaError_enum::CUDA_SUCCESS);
}

/// A CUDA event with timing, on the current context.
struct Event(sys::CUevent);

impl Event {
    fn new() -> Event {
        let mut e = ptr::null_mut();
        // SAFETY: writes one event handle; the caller has bound the device's context.
        check(unsafe { sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) });
        Event(e)
    }

    fn record(&self, stream: sys::CUstream) {
        // SAFETY: the event and the stream are live and belong to the same context.
        check(unsafe { sys::cuEventRecord(self.0, stream) });
    }

    /// Seconds from `start` to this event, once this one has completed.
    fn seconds_since(&self, start: &Event) -> f64 {
        let mut ms = 0f32;
        // SAFETY: both events are live and recorded; waits for this one, then reads the time.
        check(unsafe { sys::cuEventSynchronize(self.0) });
        check(unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.0, self.0) });
        ms as f64 / 1e3
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by cuEventCreate, destroyed once; the work recording it has finished.
        unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// A zeroed f32 array of `n` elements, zeroed in stream order on `enc`'s stream.
fn zeros(enc: &mut CommandEncoder, n: usize) -> kiln::Result<Array> {
    let a = Array::empty(enc.device(), DType::F32, &[n])?;
    enc.commit()?;
    enc.device().bind()?;
    // SAFETY: the range is the array's own (n 32-bit words); later work on this stream, the
    // encoder's direct launches and graph launches alike, runs after the memset.
    check(unsafe { sys::cuMemsetD32Async(a.device_ptr(), 0, n, enc.stream()) });
    Ok(a)
}

/// Seconds per in-place all_reduce of `buf`: median of `repeats` batches of `iters` calls.
fn seconds_per_call(
    comm: &Communicator,
    enc: &mut CommandEncoder,
    flag: &Array,
    buf: &Array,
    iters: usize,
    repeats: usize,
) -> kiln::Result<f64> {
    let reduce = |enc: &mut CommandEncoder, a: &Array| comm.all_reduce(enc, a, a, ReduceOp::Sum);
    // Warm-up: the batch's graph executables (graph mode), NCCL's connections (first call).
    for _ in 0..iters {
        reduce(enc, buf)?;
    }
    enc.synchronize()?;
    enc.device().bind()?;
    let (start, end) = (Event::new(), Event::new());
    let mut per_call = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        // The start event completes when this 1-element collective has, which needs the peer:
        // both ranks' batches start together, whichever host got here first.
        reduce(enc, flag)?;
        enc.commit()?;
        start.record(enc.stream());
        for _ in 0..iters {
            reduce(enc, buf)?;
        }
        enc.commit()?;
        end.record(enc.stream());
        enc.synchronize()?;
        per_call.push(end.seconds_since(&start) / iters as f64);
    }
    Ok(median(per_call))
}

/// One rank process: times direct mode, then graph mode, with the check as the environment
/// says; returns its JSON line.
fn rank_main(rank: usize) -> kiln::Result<Value> {
    let dev = Device::get(rank)?;
    let comm = Communicator::from_env(&dev)?;
    let config = Config::from_env()?;
    let nccl = Nccl::get(config.nccl_lib.as_deref())?;
    let (repeats, cases) = plan(quick());
    let mut out = json!({
        "rank": rank,
        "check": config.nccl_check,
        "gpu": dev.info().name,
        "nccl": nccl.version_string(),
        "nccl_path": nccl.path,
    });
    for (mode, graphs) in [("direct", false), ("graph", true)] {
        let mut c = config.clone();
        c.use_cuda_graphs = graphs;
        let mut enc = CommandEncoder::with_config(&dev, &c)?;
        let flag = zeros(&mut enc, 1)?;
        let mut times = serde_json::Map::new();
        for &(bytes, iters) in &cases {
            let buf = zeros(&mut enc, bytes / 4)?;
            let secs = seconds_per_call(&comm, &mut enc, &flag, &buf, iters, repeats)?;
            times.insert(bytes.to_string(), secs.into());
        }
        enc.synchronize()?;
        out[mode] = times.into();
    }
    Ok(out)
}

/// Starts the two rank processes with the check on or off and returns their JSON lines (rank
/// order), or why they failed.
fn run_ranks(check_on: bool) -> Result<Vec<Value>, String> {
    let id = UniqueId::new().map_err(|e| format!("ncclGetUniqueId: {e}"))?;
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..WORLD {
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .env(RANK_VAR, rank.to_string())
            .env("KILN_RANK", rank.to_string())
            .env("KILN_WORLD_SIZE", WORLD.to_string())
            .env("KILN_NCCL_ID", id.to_hex())
            .env_remove("KILN_NCCL_ID_FILE")
            .env("KILN_NCCL_CHECK", if check_on { "1" } else { "0" })
            // Mandatory: NVLink multicast stays off.
            .env("NCCL_NVLS_ENABLE", "0")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // A rank whose peer died would otherwise wait kiln's default 10 minutes.
        if std::env::var_os("KILN_NCCL_TIMEOUT").is_none() {
            cmd.env("KILN_NCCL_TIMEOUT", "60");
        }
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("starting rank {rank}: {e}"));
            }
        }
    }
    // Read each rank's stdout on its own thread (NCCL_DEBUG may write a lot there), and wait
    // for the ranks; when one fails, end the other rather than let it wait for its peer.
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let mut stdout = c.stdout.take().unwrap();
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = stdout.read_to_string(&mut s);
                s
            })
        })
        .collect();
    let mut status = [None; WORLD];
    let mut killed = [false; WORLD];
    while status.iter().any(|s| s.is_none()) {
        for (rank, c) in children.iter_mut().enumerate() {
            if status[rank].is_none() {
                status[rank] = c.try_wait().map_err(|e| format!("rank {rank}: {e}"))?;
            }
        }
        if status.iter().flatten().any(|s| !s.success()) {
            for (rank, c) in children.iter_mut().enumerate() {
                if status[rank].is_none() {
                    let _ = c.kill();
                    killed[rank] = true;
                    status[rank] = c.wait().ok();
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let failed: Vec<String> = (0..WORLD)
        .filter(|&r| !killed[r] && !status[r].is_some_and(|s| s.success()))
        .map(|r| format!("rank {r} ({:?})", status[r]))
        .collect();
    if !failed.is_empty() {
        return Err(format!(
            "{} failed (its stderr is above); a rank still running was ended",
            failed.join(", ")
        ));
    }
    let mut lines = Vec::new();
    for (rank, reader) in readers.into_iter().enumerate() {
        let text = reader.join().unwrap_or_default();
        let line = text
            .lines()
            .rev()
            .find_map(|l| {
                serde_json::from_str::<Value>(l)
                    .ok()
                    .filter(Value::is_object)
            })
            .ok_or_else(|| format!("rank {rank} printed no JSON line"))?;
        lines.push(line);
    }
    Ok(lines)
}

fn main() {
    if let Some(rank) = std::env::var(RANK_VAR)
        .ok()
        .and_then(|r| r.parse::<usize>().ok())
    {
        match rank_main(rank) {
            Ok(line) => println!("{line}"),
            Err(e) => {
                eprintln!("nccl bench rank {rank}: {e}");
                std::process::exit(1);
            }
        }
        return;
    }

    // Fewer than 2 GPUs is a skip even under KILN_REQUIRE_GPU (the single-GPU machines run
    // every bench with it set).
    let gpus = match kiln::runtime::gpus() {
        Ok(g) if g.len() >= WORLD => g,
        Ok(g) => {
            println!("nccl bench: needs {WORLD} GPUs, found {}, skipped", g.len());
            return;
        }
        Err(e) => {
            println!("nccl bench: no GPU ({e}), skipped");
            return;
        }
    };
    let nccl_lib = Config::from_env().ok().and_then(|c| c.nccl_lib);
    if let Err(e) = Nccl::get(nccl_lib.as_deref()) {
        println!("nccl bench: NCCL could not be loaded, skipped: {e}");
        return;
    }
    let (_, no_anchor) = common::variant_flags();
    let quick = quick();
    let (repeats, cases) = plan(quick);

    // kiln: one pair of rank processes per check setting, one after the other.
    let mut kiln_runs: Vec<(bool, Vec<Value>)> = Vec::new();
    for check_on in [true, false] {
        match run_ranks(check_on) {
            Ok(lines) => kiln_runs.push((check_on, lines)),
            Err(e) => {
                eprintln!(
                    "nccl bench: kiln ranks with KILN_NCCL_CHECK={}: {e}",
                    check_on as u8
                );
                std::process::exit(1);
            }
        }
    }
    // PyTorch afterwards, on the same sizes and batches (the kiln processes have exited).
    let torch = if no_anchor {
        None
    } else {
        let mut args = vec![format!("repeats={repeats}")];
        args.extend(cases.iter().map(|(b, i)| format!("{b}:{i}")));
        common::run_anchor("nccl_torch.py", &args)
    };

    // Seconds per call of a kiln variant: the slower rank's median.
    let kiln_secs = |graphs: bool, check_on: bool, bytes: usize| -> f64 {
        let mode = if graphs { "graph" } else { "direct" };
        kiln_runs
            .iter()
            .find(|(c, _)| *c == check_on)
            .map(|(_, lines)| {
                lines
                    .iter()
                    .map(|l| l[mode][bytes.to_string()].as_f64().unwrap_or(f64::NAN))
                    .fold(f64::NEG_INFINITY, f64::max)
            })
            .unwrap_or(f64::NAN)
    };
    let torch_secs = |bytes: usize| torch.as_ref().and_then(|t| t[bytes.to_string()].as_f64());

    let first = &kiln_runs[0].1[0];
    println!(
        "nccl bench: all_reduce(sum) of f32 in place, {WORLD} ranks, one process per GPU ({}), \
         NCCL_NVLS_ENABLE=0; bus bandwidth GB/s = bytes / time x 2(n-1)/n; median of {repeats} \
         batches, slower rank",
        gpus.iter()
            .take(WORLD)
            .map(|g| format!("{}: {}", g.ordinal, g.name))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "kiln: NCCL {} ({})",
        first["nccl"].as_str().unwrap_or("?"),
        first["nccl_path"].as_str().unwrap_or("?")
    );
    match &torch {
        Some(t) => println!(
            "PyTorch {}: NCCL {}",
            t["torch"].as_str().unwrap_or("?"),
            t["nccl"].as_str().unwrap_or("?")
        ),
        None if no_anchor => println!("PyTorch: skipped (--no-anchor)"),
        None => println!(
            "PyTorch: not available (benches/nccl_torch.py did not run: python3, torch, or 2 GPUs missing)"
        ),
    }
    println!(
        "columns: kiln bus GB/s (kiln / torch); graph+chk = graph mode with the collective check \
         on, kiln's default; graph = graph mode, check off; direct(+chk) = direct mode"
    );
    print!("{:<8}", "size");
    for (label, ..) in VARIANTS {
        print!(" {label:>17}");
    }
    println!(" {:>7}  verdict (>= {TARGET}x torch)", "torch");
    // Per variant: the sizes below the target, as "size ratio".
    let mut misses: Vec<Vec<String>> = vec![Vec::new(); VARIANTS.len()];
    for &(bytes, _) in &cases {
        let torch_gbs = torch_secs(bytes).map(|s| bus_gbs(bytes, s));
        print!("{:<8}", size_name(bytes));
        let mut below = Vec::new();
        for (v, &(label, _, graphs, check_on)) in VARIANTS.iter().enumerate() {
            let gbs = bus_gbs(bytes, kiln_secs(graphs, check_on, bytes));
            let cell = match torch_gbs {
                Some(t) => {
                    let ratio = gbs / t;
                    if ratio.is_nan() || ratio < TARGET {
                        below.push(label);
                        misses[v].push(format!("{} {ratio:.2}x", size_name(bytes)));
                    }
                    format!("{gbs:.1} ({ratio:.2}x)")
                }
                None => format!("{gbs:.1}"),
            };
            print!(" {cell:>17}");
        }
        let verdict = match (torch_gbs, below.is_empty()) {
            (None, _) => "no anchor".to_string(),
            (Some(_), true) => "met".to_string(),
            (Some(_), false) => format!("below: {}", below.join(", ")),
        };
        println!(
            " {:>7}  {verdict}",
            torch_gbs.map_or("-".into(), |t| format!("{t:.1}"))
        );
    }
    println!("target: kiln >= {TARGET}x PyTorch's bus bandwidth at every size");
    for (v, &(_, name, ..)) in VARIANTS.iter().enumerate() {
        let verdict = if torch.is_none() {
            "not judged (no PyTorch figures)".to_string()
        } else if misses[v].is_empty() {
            "met".to_string()
        } else {
            format!("MISSED at {}", misses[v].join(", "))
        };
        println!("  {name:<44} {verdict}");
    }
}
