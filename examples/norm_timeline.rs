//! A timeline of the 16-bit split-row forward (norm_fwd_staged.cu) or of the split-row VJP
//! (norm_vjp_split.cu): where a call's time goes.
//!
//! It builds the spec the ops choose for DTYPE OP ROWS D as an application family whose text is
//! the kernel's with `%globaltimer` stamps added (thread 0 of each block: start, after the
//! setup's cluster barrier, after the weights load, and at each row: its chunk arrived, its
//! statistics exchanged, its stores issued; then before and after the last cluster barrier).
//! CALLS launches run back to back on one stream, each stamping its own region, and the
//! stamps are printed as CSV (`call,block,event,ns`, ns from the first call's earliest stamp)
//! after a summary line per call, and checks that the rows' claim counter is zero again. Events:
//! 0 start, 1 after the setup's cluster barrier, 2 the weights in shared memory, then for turn t
//! (the t-th row the cluster takes) 5 + 3t its chunk arrived, 6 + 3t its statistics exchanged,
//! 7 + 3t its stores issued; 3 after the last row, 4 after the last cluster barrier, 255 the end
//! (turns past the 83rd go unstamped: no slots left). The VJP (OP layer_norm_vjp or rms_norm_vjp,
//! any dtype) stamps 0, 1, 3, 4 and 255 alike, 2 before its row loop, and for turn t: 5 + 11t
//! the row's chunk arrived, 6 + 11t its exchange pushed, 7 + 11t its statistics in, 8 + 11t its
//! dx stores issued; with rows held (PIPELINE 2) 12 + 11t past the barrier after the hold,
//! 13 + 11t the copies into its stage issued; LayerNorm's 14 + 11t the warp's mean, 15 + 11t its
//! second sums done; with block pushes 9 + 11t warp 0 at the block's barrier, 10 + 11t past it,
//! 11 + 11t the block's values combined (turns past the 21st go unstamped). A diagnostic: the stamps cost the kernel a
//! store each. Without a GPU it only compiles the stamped spec (sm_90, many rows).
//!
//! Usage: cargo run --release --example norm_timeline -- DTYPE OP ROWS D [CALLS]
//! with OP layer_norm or rms_norm and a 16-bit DTYPE, or layer_norm_vjp or rms_norm_vjp; rows
//! that do not start on a 16-byte granule (odd D) run as the op runs them (shifted columns, or
//! one element a vector).
use kiln::jit::{register_family, FamilyExtras, KernelSpec, TemplateDef};
use kiln::ops::norm::{self, tuning, Count, Gpu, Kind, Pass};
use kiln::runtime::{Array, CommandEncoder, Device, KernelArgs};
use kiln::selfcheck::TestRng;
use kiln::DType;

/// Stamps a block may write a call; the last slot is the kernel's end.
const SLOTS: usize = 256;

/// The stamp macros, writing through the pointer named STAMPS: thread 0's `%globaltimer` into
/// its block's slot i (KILN_STAMP) or its last slot (KILN_STAMP_END).
const STAMP_MACROS: &str = r#"
#define KILN_STAMP(i)                                                              \
  do {                                                                             \
    if (threadIdx.x == 0 && (i) < 255) {                                           \
      unsigned long long t_;                                                       \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                       \
      STAMPS[blockIdx.x * 256ull + (i)] = t_;                                      \
    }                                                                              \
  } while (0)
#define KILN_STAMP_END()                                                           \
  do {                                                                             \
    if (threadIdx.x == 0) {                                                        \
      unsigned long long t_;                                                       \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                       \
      STAMPS[blockIdx.x * 256ull + 255] = t_;                                      \
    }                                                                              \
  } while (0)
"#;

/// The stamp macros writing through `pointer`.
fn stamp_macros(pointer: &str) -> String {
    STAMP_MACROS.replace("STAMPS", pointer)
}

/// Replaces each edit point, which must occur exactly once.
fn edited(source: &str, edits: &[(&str, String)]) -> String {
    let mut text = source.to_string();
    for (from, to) in edits {
        assert_eq!(text.matches(from).count(), 1, "edit point {from:?}");
        text = text.replace(from, to);
    }
    text
}

/// The VJP's stamps write through a pointer to this call's region in shared memory (a load far
/// cheaper than from global memory), so that cluster.cuh's functions (inlined below, edited)
/// stamp too; each block's thread 0, the one that stamps, sets it first.
fn vjp_stamp_macros() -> String {
    format!(
        "\n__shared__ unsigned long long* kiln_stamps_at;{}",
        stamp_macros("kiln_stamps_at")
    )
}

/// cluster.cuh with stamps in the block push (exchange n): 9 + 11n warp 0 at the named barrier,
/// 10 + 11n past it, 11 + 11n the block's values combined.
fn stamped_cluster() -> String {
    let edits: [(&str, String); 3] = [
        (
            "  if (half)\n    asm volatile(\"bar.sync 2",
            "  KILN_STAMP(9 + 11 * n);\n  if (half)\n    asm volatile(\"bar.sync 2".into(),
        ),
        (
            "  float e[WIDTH], u[WIDTH];\n",
            "  KILN_STAMP(10 + 11 * n);\n  float e[WIDTH], u[WIDTH];\n".into(),
        ),
        (
            "  kiln_cluster_send(u, s, n, 0, extra_bytes);\n",
            "  KILN_STAMP(11 + 11 * n);\n  kiln_cluster_send(u, s, n, 0, extra_bytes);\n".into(),
        ),
    ];
    edited(include_str!("../templates/cluster.cuh"), &edits)
}

/// The split VJP's text with stamps (events in the module's header).
fn stamped_vjp(source: &str) -> String {
    let edits: [(&str, String); 15] = [
        (
            "int /* smem_partials: unused */) {\n",
            "int /* smem_partials: unused */, unsigned long long* __restrict__ kiln_stamps) {\n  \
             if (threadIdx.x == 0) kiln_stamps_at = kiln_stamps;\n"
                .into(),
        ),
        (
            "  __shared__ unsigned long long full[STAGES];\n",
            "  __shared__ unsigned long long full[STAGES];\n  KILN_STAMP(0);\n".into(),
        ),
        (
            "  int exchange = 0;\n",
            "  int exchange = 0;\n  KILN_STAMP(1);\n".into(),
        ),
        (
            "    kiln_mbarrier_wait(&full[stage], (turn / STAGES) & 1);\n",
            "    kiln_mbarrier_wait(&full[stage], (turn / STAGES) & 1);\n    KILN_STAMP(5 + 11 * turn);\n"
                .into(),
        ),
        (
            "    for (int k = 0; k < ITEMS; ++k) hold(st, k, xn[k], gn[k]);\n    __syncthreads();\n",
            "    for (int k = 0; k < ITEMS; ++k) hold(st, k, xn[k], gn[k]);\n    __syncthreads();\n    \
             KILN_STAMP(12 + 11 * turn);\n"
                .into(),
        ),
        (
            "        fetch(r + STAGES * clusters, turn % STAGES);\n      }\n",
            "        fetch(r + STAGES * clusters, turn % STAGES);\n      }\n      KILN_STAMP(13 + 11 * turn);\n"
                .into(),
        ),
        (
            "      m_w = kiln_warp_sum(sum) * inv_warp_elements;\n",
            "      m_w = kiln_warp_sum(sum) * inv_warp_elements;\n      KILN_STAMP(14 + 11 * exchange);\n"
                .into(),
        ),
        (
            "    const float s_q = kiln_warp_sum(q), s_t = kiln_warp_sum(t);\n",
            "    KILN_STAMP(15 + 11 * exchange);\n    const float s_q = kiln_warp_sum(q), s_t = kiln_warp_sum(t);\n"
                .into(),
        ),
        (
            "    const int n = push_row(nullptr, true);\n",
            "    const int n = push_row(nullptr, true);\n    KILN_STAMP(6 + 11 * turn);\n".into(),
        ),
        (
            "        pushed = push_row(&next);\n",
            "        pushed = push_row(&next);\n        KILN_STAMP(17 + 11 * turn);\n".into(),
        ),
        (
            "  int turn = 0;\n",
            "  KILN_STAMP(2);\n  int turn = 0;\n".into(),
        ),
        (
            "    const float rstd = rsqrtf(q * inv_d + eps);\n",
            "    const float rstd = rsqrtf(q * inv_d + eps);\n    KILN_STAMP(7 + 11 * turn);\n".into(),
        ),
        (
            "      kiln_store_floats<N_READS>(dxr, at(k), len, o);\n    }\n  }\n",
            "      kiln_store_floats<N_READS>(dxr, at(k), len, o);\n    }\n    KILN_STAMP(8 + 11 * turn);\n  }\n  KILN_STAMP(3);\n"
                .into(),
        ),
        (
            "  kiln_cluster_sync();\n}",
            "  kiln_cluster_sync();\n  KILN_STAMP(4);\n  KILN_STAMP_END();\n}".into(),
        ),
        // Last: the inlined header has its own kiln_cluster_sync.
        (
            "{{> cluster}}\n",
            format!("{}\n{}\n", vjp_stamp_macros(), stamped_cluster()),
        ),
    ];
    edited(source, &edits)
}

/// The staged forward's text with stamps: each edit replaces a line that occurs once.
fn stamped(source: &str) -> String {
    let edits: [(&str, String); 9] = [
        ("{{> bulk}}\n", format!("{{{{> bulk}}}}\n{}", stamp_macros("kiln_stamps"))),
        (
            "float eps,\n",
            "float eps, unsigned long long* __restrict__ kiln_stamps,\n".into(),
        ),
        (
            "  __shared__ unsigned long long full[STAGES];\n",
            "  __shared__ unsigned long long full[STAGES];\n  KILN_STAMP(0);\n".into(),
        ),
        (
            "  int exchange = 0;\n",
            "  int exchange = 0;\n  KILN_STAMP(1);\n".into(),
        ),
        (
            "  for (int turn = 0;; ++turn) {\n",
            "  KILN_STAMP(2);\n  for (int turn = 0;; ++turn) {\n".into(),
        ),
        (
            "    kiln_mbarrier_wait(&full[stage], (turn / STAGES) & 1);\n",
            "    kiln_mbarrier_wait(&full[stage], (turn / STAGES) & 1);\n    KILN_STAMP(5 + 3 * turn);\n"
                .into(),
        ),
        (
            "    const float rstd = rsqrtf(q * inv_d + eps);\n",
            "    const float rstd = rsqrtf(q * inv_d + eps);\n    KILN_STAMP(6 + 3 * turn);\n".into(),
        ),
        (
            "    }\n  }\n  // A ticket never sent",
            "    }\n    KILN_STAMP(7 + 3 * turn);\n  }\n  KILN_STAMP(3);\n  // A ticket never sent"
                .into(),
        ),
        (
            "  kiln_cluster_sync();\n}",
            "  kiln_cluster_sync();\n  KILN_STAMP(4);\n  KILN_STAMP_END();\n}".into(),
        ),
    ];
    edited(source, &edits)
}

fn main() -> kiln::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dtype, op, rows, d, rest @ ..] = args.as_slice() else {
        panic!("usage: norm_timeline DTYPE OP ROWS D [CALLS]");
    };
    let dtype = DType::ALL
        .into_iter()
        .find(|t| t.name() == dtype)
        .expect("dtype: f16 or bf16");
    let (kind, pass) = match op.as_str() {
        "layer_norm" => (Kind::LayerNorm, Pass::Forward),
        "rms_norm" => (Kind::RmsNorm, Pass::Forward),
        "layer_norm_vjp" => (Kind::LayerNorm, Pass::Vjp),
        "rms_norm_vjp" => (Kind::RmsNorm, Pass::Vjp),
        other => panic!("OP is layer_norm, rms_norm or their _vjp, not {other}"),
    };
    let vjp = pass == Pass::Vjp;
    let (rows, d): (usize, usize) = (rows.parse().expect("ROWS"), d.parse().expect("D"));
    let calls: usize = rest.first().map_or(5, |c| c.parse().expect("CALLS"));

    // Without a GPU: compile the stamped spec for sm_90 (many rows) and stop.
    let dev = Device::get(0).ok();
    let (count, gpu) = match &dev {
        Some(dev) => (Count::of(rows, dev), Gpu::of(dev)),
        None => (Count::Many, Gpu::for_arch(90)),
    };
    let layout = tuning::contiguous_rows(dtype, d);
    let chosen = norm::choose_spec(pass, kind, dtype, d, layout, count, gpu);
    let (wanted, text, probe) = if vjp {
        let text = stamped_vjp(chosen.template.source);
        ("norm_vjp_split", text, "probe_norm_vjp_split")
    } else {
        let text = stamped(chosen.template.source);
        ("norm_fwd_staged", text, "probe_norm_fwd_staged")
    };
    assert_eq!(
        chosen.template.name, wanted,
        "the chosen spec is not the split {wanted}"
    );
    let source: &'static str = Box::leak(text.into_boxed_str());
    let def: &'static TemplateDef = Box::leak(Box::new(TemplateDef {
        name: probe,
        source,
        kernel: probe,
        ..*chosen.template
    }));
    register_family(def, FamilyExtras::NONE)?;
    let names = chosen.template.const_names.len();
    let spec = KernelSpec::try_new(
        def,
        dtype,
        chosen.block_dim,
        chosen.n_reads,
        &chosen.consts[..names],
    )?;
    let Some(dev) = dev else {
        let compiled = kiln::jit::Jit::global()?.compile(&spec, "sm_90".parse()?)?;
        eprintln!("no GPU: compiled {spec} for sm_90 ({:?})", compiled.origin);
        return Ok(());
    };
    let mut enc = CommandEncoder::new(&dev)?;
    let kernel = dev.kernel(&spec)?;
    let shared = tuning::ring_shared_bytes(&chosen, d);
    kernel.allow_shared(shared)?;
    let block = chosen.block_dim as usize;
    // As the op launches it: claimed rows or a balanced grid, shifted columns' period.
    let tuning::SplitGrid {
        blocks,
        clusters,
        slots,
        claims,
    } = tuning::split_grid(&kernel, &chosen, rows, d)?;
    let turns = rows.div_ceil(clusters);
    let width = blocks / clusters;
    eprintln!(
        "spec {} ITEMS={:?} PIPELINE={:?} SHIFTED={:?} CLUSTER={width} block {block} n_reads {} \
         shared {shared}: slots {slots}, clusters {clusters}, turns {turns}, rows claimed: {claims}",
        chosen.template.name,
        chosen.constant("ITEMS"),
        chosen.constant("PIPELINE"),
        chosen.constant("SHIFTED"),
        chosen.n_reads
    );

    let mut rng = TestRng::new(1);
    let x = Array::from_f64(&mut enc, dtype, &rng.values(rows * d, 2.0, 0.0), &[rows, d])?;
    let w = Array::from_f64(&mut enc, dtype, &rng.values(d, 1.0, 1.0), &[d])?;
    let y = Array::zeros(&mut enc, dtype, &[rows, d])?;
    // The VJP's cotangent and its dweight/dbias partial rows, one per cluster.
    let g = Array::from_f64(&mut enc, dtype, &rng.values(rows * d, 1.0, 0.0), &[rows, d])?;
    let partials = Array::zeros(&mut enc, DType::F32, &[2, clusters, d])?;
    // The rows' claim counter (a u64, left zero by each call), and u64 stamps, both in f32
    // arrays of twice the count.
    let counter = Array::zeros(&mut enc, DType::F32, &[2])?;
    let stamps = Array::zeros(&mut enc, DType::F32, &[calls * blocks * SLOTS * 2])?;
    let launch = |enc: &mut CommandEncoder, call: usize| -> kiln::Result<()> {
        let stamps_at = stamps.device_ptr() + (call * blocks * SLOTS * 8) as u64;
        let mut a = KernelArgs::new();
        if vjp {
            a.push(x.device_ptr())
                .push(w.device_ptr())
                .push(g.device_ptr())
                .push(y.device_ptr())
                .push(partials.device_ptr())
                .push(partials.device_ptr() + (clusters * d * 4) as u64)
                .push(rows as i64)
                .push(d as i32)
                .push(d as i64)
                .push(d as i64)
                .push(1i64)
                .push(1i32)
                .push(1e-5f32)
                .push(0i32)
                .push(stamps_at);
            // SAFETY: the split VJP's arguments in order and type with the stamps last; x, w
            // and g read, y (as dx), the [2, clusters, d] partial rows and the call's stamp
            // region written, all in bounds.
            return unsafe {
                enc.launch(
                    &kernel,
                    blocks as u32,
                    block as u32,
                    shared as u32,
                    a,
                    &[&x, &w, &g],
                    &[&y, &partials, &stamps],
                )
            };
        }
        a.push(x.device_ptr())
            .push(w.device_ptr())
            .push(w.device_ptr())
            .push(y.device_ptr())
            .push(rows as i64)
            .push(d as i32)
            .push(d as i64)
            .push(1i64)
            .push(1i64)
            .push(1i32)
            .push(1i32)
            .push(1e-5f32)
            .push(stamps_at)
            .push(if claims { counter.device_ptr() } else { 0 });
        // SAFETY: the staged forward's arguments in order and type with the stamps last; x read,
        // w as weight and bias, y and the call's stamp region written, all in bounds.
        unsafe {
            enc.launch(
                &kernel,
                blocks as u32,
                block as u32,
                shared as u32,
                a,
                &[&x, &w],
                &[&y, &stamps],
            )
        }
    };
    // Warm up (load, clocks), then the timed calls back to back.
    for _ in 0..3 {
        launch(&mut enc, 0)?;
    }
    enc.synchronize()?;
    let t = std::time::Instant::now();
    for call in 0..calls {
        launch(&mut enc, call)?;
    }
    enc.synchronize()?;
    let host_us = t.elapsed().as_secs_f64() * 1e6 / calls as f64;
    let bytes = stamps.to_bytes(&mut enc)?;
    let at = |call: usize, block: usize, slot: usize| -> u64 {
        let i = ((call * blocks + block) * SLOTS + slot) * 8;
        u64::from_le_bytes(bytes[i..i + 8].try_into().unwrap())
    };
    let left = counter.to_bytes(&mut enc)?;
    assert!(
        left.iter().all(|&b| b == 0),
        "the claim counter was left {left:?}"
    );
    let origin = (0..blocks).map(|b| at(0, b, 0)).min().unwrap();
    // Bytes a call must move: x and y (the VJP: x, g and dx).
    let moved = if vjp { 3.0 } else { 2.0 } * (rows * d * dtype.size()) as f64;
    println!("# host {host_us:.1} us a call over {calls} calls");
    for call in 0..calls {
        let start = (0..blocks).map(|b| at(call, b, 0)).min().unwrap();
        let last_start = (0..blocks).map(|b| at(call, b, 0)).max().unwrap();
        let end = (0..blocks).map(|b| at(call, b, SLOTS - 1)).max().unwrap();
        let span = (end - start) as f64 / 1e3;
        println!(
            "# call {call}: starts {:.2}-{:.2} us, ends {:.2} us, span {span:.2} us ({:.0} GB/s)",
            (start - origin) as f64 / 1e3,
            (last_start - origin) as f64 / 1e3,
            (end - origin) as f64 / 1e3,
            moved / span / 1e3
        );
    }
    println!("call,block,event,ns");
    for call in 0..calls {
        for b in 0..blocks {
            for slot in 0..SLOTS {
                let v = at(call, b, slot);
                if v != 0 {
                    println!("{call},{b},{slot},{}", v as i64 - origin as i64);
                }
            }
        }
    }
    Ok(())
}
