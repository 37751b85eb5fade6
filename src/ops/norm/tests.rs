use super::choose::*;
use super::launch::{check_row, row_length};
use super::reference::*;
use super::*;

fn err_arg<T: std::fmt::Debug>(r: Result<T>) -> &'static str {
    match r {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected an argument error, got {other:?}"),
    }
}

#[test]
fn rows_longer_than_the_kernels_index_are_refused() {
    assert_eq!(row_length(&[4, 768], 1e-5).unwrap(), 768);
    assert_eq!(row_length(&[MAX_ROW], 0.0).unwrap(), MAX_ROW);
    assert_eq!(row_length(&[3, 0], 0.0).unwrap(), 0);
    assert_eq!(err_arg(row_length(&[], 1e-5)), "x");
    assert_eq!(err_arg(row_length(&[4], -1.0)), "eps");
    assert_eq!(err_arg(row_length(&[4], f32::NAN)), "eps");
    // `d as i32` passed 2^31 to the kernels as -2^31, and 2^32 + 8 as 8: every row but its
    // first 8 elements left out.
    assert_eq!(err_arg(row_length(&[1, 1 << 31], 1e-5)), "x");
    assert_eq!(err_arg(row_length(&[(1 << 32) + 8], 1e-5)), "x");
    assert_eq!(err_arg(check_row("partial", MAX_ROW + 1)), "partial");
    check_row("partial", MAX_ROW).unwrap();
}

#[test]
fn a_balanced_grid_gives_every_block_the_same_turns() {
    // bf16 forward 16384x768: 2,048 blocks of 8 rows, 660 at once -> 4 turns on 512 blocks.
    assert_eq!(balanced_grid(2048, 660), 512);
    assert_eq!(balanced_grid(2048, 132), 128);
    assert_eq!(balanced_grid(10, 660), 10);
    assert_eq!(balanced_grid(0, 660), 1);
    for blocks in 1..400 {
        for slots in 1..40 {
            let grid = balanced_grid(blocks, slots);
            let turns = blocks.div_ceil(slots);
            assert!(
                grid <= slots && grid <= blocks,
                "{blocks} on {slots}: {grid}"
            );
            // No more turns than the full grid takes, and no block without work.
            assert!(grid * turns >= blocks && (grid - 1) * turns < blocks);
        }
    }
}

#[test]
fn constants_are_declared() {
    // Every name `constant` reads, in the families that have it.
    for (family, names) in [
        (&FORWARD, &["RMS", "GROUP", "ITEMS", "STAGES"][..]),
        (&VJP, &["RMS", "GROUP", "ITEMS", "STAGES", "RESIDENT"][..]),
        (&FORWARD_SPLIT, &["RMS", "ITEMS", "CLUSTER"][..]),
        (&FORWARD_STAGED, &["RMS", "ITEMS", "CLUSTER", "PAIRED"][..]),
        (
            &VJP_SPLIT,
            &["RMS", "ITEMS", "CLUSTER", "SMEM_SUMS", "PIPELINE"][..],
        ),
    ] {
        for name in names {
            assert!(family.const_names.contains(name), "{} {name}", family.name);
        }
    }
    let spec = choose_spec(
        Pass::Vjp,
        Kind::RmsNorm,
        DType::BF16,
        100_000,
        Rows::Aligned,
        Count::Many,
        Gpu::for_arch(90),
    );
    assert!(is_vjp_split(&spec) && is_rms(&spec));
    assert_eq!(spec.constant("CLUSTER"), Some(spec.consts[2]));
    assert_eq!(spec.constant("GROUP"), None);
}

#[test]
fn every_chosen_spec_is_registered_and_fits() {
    // Turing, Volta, consumer Ampere and Ada, A100, H100 (with and without clusters).
    for limit in [64, 96, 99, 163, 227].map(|k| k * 1024) {
        every_chosen_spec_is_registered_for(Gpu {
            shared_limit: limit,
            clusters: false,
        });
    }
    every_chosen_spec_is_registered_for(Gpu::for_arch(SPLIT_ARCH));
}

fn every_chosen_spec_is_registered_for(gpu: Gpu) {
    let limit = gpu.shared_limit;
    let registered = specs(gpu);
    for pass in [Pass::Forward, Pass::Vjp] {
        for kind in [Kind::LayerNorm, Kind::RmsNorm] {
            for dtype in DType::ALL {
                for d in (1..=70).chain([
                    255,
                    256,
                    768,
                    1000,
                    1024,
                    4096,
                    8192,
                    16384,
                    16392,
                    18432,
                    30000,
                    32768,
                    65536,
                    65537,
                    131072,
                    131073,
                    1 << 20,
                ]) {
                    for (rows, count) in [Rows::Scattered, Rows::Alike, Rows::Aligned]
                        .into_iter()
                        .flat_map(|r| [(r, Count::Few), (r, Count::Many)])
                    {
                        let vectorized = rows == Rows::Aligned;
                        if vectorized && d % dtype.vec_width() != 0 {
                            continue;
                        }
                        let s = choose_spec(pass, kind, dtype, d, rows, count, gpu);
                        assert!(
                            registered.contains(&s),
                            "{s} chosen for d={d} but not registered"
                        );
                        assert!(fits(&s, limit), "{s}: {} bytes", ring_bytes(&s));
                        assert_eq!(
                            is_split(&s) && pass == Pass::Forward,
                            gpu.clusters && pass == Pass::Forward && {
                                // The row's width decides (split specs may shift to vectors).
                                let n_reads = if vectorized { dtype.vec_width() } else { 1 };
                                let vectors = d.div_ceil(n_reads);
                                // Many rows take a block each where the long ring fits.
                                let ring = long_ring_spec(kind, dtype, n_reads, vectors, limit);
                                vectors > 1024 * max_items(pass, n_reads)
                                    && split_spec(kind, dtype, d, rows).is_some()
                                    && (count == Count::Few || ring.is_none())
                            },
                            "{s} for d={d}"
                        );
                        // The split VJP takes what a block's registers and shared memory
                        // do not, up to what a cluster's registers hold.
                        let n_reads = if vectorized { dtype.vec_width() } else { 1 };
                        let vectors = d.div_ceil(n_reads);
                        if pass == Pass::Vjp && gpu.clusters {
                            let beyond_a_block = vectors > 1024 * max_items(pass, n_reads);
                            let fits_cluster = vectors <= vjp_split_row(dtype, n_reads) / n_reads;
                            if beyond_a_block && fits_cluster {
                                assert!(is_vjp_split(&s), "{s} chosen for d={d}");
                            }
                        } else {
                            assert!(!is_vjp_split(&s), "{s} chosen for d={d}");
                        }
                        if is_split(&s) {
                            let (items, cluster) = (constant(&s, "ITEMS"), constant(&s, "CLUSTER"));
                            // Shifted columns cover a vector less one element more.
                            let pad = if shifts_columns(s.template) {
                                split_pad(s.n_reads as usize, rows)
                            } else {
                                0
                            };
                            assert!(
                                split_chunk(d, cluster) + pad <= split_capacity(&s),
                                "{s}: d={d}"
                            );
                            // Unaligned rows take shifted vectors on the ring kernels, but
                            // where the widest clusters' blocks cannot cover a vector more.
                            if rows == Rows::Alike && shifts_columns(s.template) && d <= 130_944 {
                                assert_eq!(s.n_reads as usize, dtype.vec_width(), "{s}: d={d}");
                            }
                            if pass == Pass::Forward {
                                // 16-bit rows through the staged ring (clusters of up to 8),
                                // f32 and longer rows in registers.
                                let staged = dtype.size() == 2 && cluster <= 8;
                                assert_eq!(*s.template == FORWARD_STAGED, staged, "{s}");
                            }
                            let covered = s.block_dim as usize * items * cluster;
                            assert!(
                                covered * s.n_reads as usize >= d,
                                "{s} does not cover d={d}"
                            );
                            assert!(check_chosen(s, pass, kind, dtype, d, rows).is_ok());
                            continue;
                        }
                        let (group, items) = (constant(&s, "GROUP"), constant(&s, "ITEMS"));
                        if items > 0 {
                            assert!(
                                group * items * s.n_reads as usize >= d,
                                "{s} does not cover d={d}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn references_agree_with_finite_differences() {
    // d/dx of sum(g * f(x)) by central differences, against reference_vjp.
    let d = 5;
    let x = [0.3, -1.2, 2.0, 0.7, -0.4, 1.1, 0.0, -0.9, 0.5, 2.2];
    let w = [1.5, -0.5, 0.8, 1.0, 2.0];
    let b = [0.1, 0.2, 0.3, 0.4, 0.5];
    let g = [0.2, -0.7, 1.0, 0.4, -1.3, 0.9, 0.1, -0.2, 0.6, 0.3];
    for kind in [Kind::LayerNorm, Kind::RmsNorm] {
        let f = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
            reference_forward(kind, x, Some(w), Some(b), d, 1e-5)
                .iter()
                .zip(&g)
                .map(|(y, g)| y * g)
                .sum()
        };
        let (dx, dw, db) = reference_vjp(kind, &x, Some(&w), &g, d, 1e-5);
        let h = 1e-6;
        for i in 0..x.len() {
            let (mut p, mut m) = (x, x);
            p[i] += h;
            m[i] -= h;
            let num = (f(&p, &w, &b) - f(&m, &w, &b)) / (2.0 * h);
            assert!(
                (num - dx[i]).abs() < 1e-6,
                "{kind:?} dx[{i}]: {num} vs {}",
                dx[i]
            );
        }
        for j in 0..d {
            let (mut p, mut m) = (w, w);
            p[j] += h;
            m[j] -= h;
            let num = (f(&x, &p, &b) - f(&x, &m, &b)) / (2.0 * h);
            assert!((num - dw[j]).abs() < 1e-6, "{kind:?} dw[{j}]");
            if kind == Kind::LayerNorm {
                let (mut p, mut m) = (b, b);
                p[j] += h;
                m[j] -= h;
                let num = (f(&x, &w, &p) - f(&x, &w, &m)) / (2.0 * h);
                assert!((num - db[j]).abs() < 1e-6, "db[{j}]");
            }
        }
    }
}

#[test]
fn split_rows_pipeline_and_fill_blocks_as_measured() {
    let gpu = Gpu::for_arch(90);
    let chosen = |pass, kind, dtype, d| {
        let spec = choose_spec(pass, kind, dtype, d, Rows::Aligned, Count::Few, gpu);
        assert!(is_split(&spec), "{spec}");
        spec
    };
    // The VJP holds two 16-bit rows of 16 elements a thread in registers at every cluster
    // width (PIPELINE 2); f32 rows are not pipelined. 16-bit rows past 65,536 take 24 elements a
    // thread in clusters of 8, not pipelined, then clusters of 16; f32 rows clusters of 16.
    for kind in [Kind::LayerNorm, Kind::RmsNorm] {
        for dtype in DType::ALL {
            for d in [18432, 30000, 65536, 65544, 70000, 98304, 98312, 131072] {
                let spec = chosen(Pass::Vjp, kind, dtype, d);
                let (items, cluster) = (constant(&spec, "ITEMS"), constant(&spec, "CLUSTER"));
                let elements = items * spec.n_reads as usize;
                let widest = if dtype.size() == 2 { 98304 } else { 65536 };
                let wide_items = dtype.size() == 2 && d > 65536 && d <= widest;
                assert_eq!(cluster == 16, d > widest, "{spec}");
                assert_eq!(elements == 24, wide_items, "{spec}");
                if wide_items {
                    assert_eq!(cluster, 8, "{spec}");
                }
                let pipeline = if dtype.size() == 2 && !wide_items {
                    2
                } else {
                    0
                };
                assert_eq!(spec.constant("PIPELINE"), Some(pipeline), "{spec}");
            }
        }
    }
    // 16-bit rows of one element a vector take 24 elements a thread in the fewest blocks of up
    // to 8 where there is a row for each SM (16,385 on two blocks, 50,257 on five), 16 in more
    // blocks where there are fewer rows, then clusters of 16 of 16 elements.
    for (d, many, few) in [
        (16385, (2, 24), (3, 12)),
        (50257, (5, 24), (7, 16)),
        (65535, (6, 24), (8, 16)),
        (98303, (8, 24), (16, 12)),
        (98305, (16, 16), (16, 16)),
    ] {
        for kind in [Kind::LayerNorm, Kind::RmsNorm] {
            for (count, (cluster, elements)) in [(Count::Many, many), (Count::Few, few)] {
                let spec = choose_spec(Pass::Vjp, kind, DType::F16, d, Rows::Alike, count, gpu);
                assert_eq!(spec.n_reads, 1, "{spec}");
                assert_eq!(constant(&spec, "CLUSTER"), cluster, "{d} {count:?}: {spec}");
                assert_eq!(constant(&spec, "ITEMS"), elements, "{d} {count:?}: {spec}");
            }
        }
    }
    // Rows of one element a vector (16-bit rows of odd length) are not pipelined.
    let odd = choose_spec(
        Pass::Vjp,
        Kind::LayerNorm,
        DType::BF16,
        16385,
        Rows::Alike,
        Count::Few,
        gpu,
    );
    assert_eq!(odd.constant("PIPELINE"), Some(0), "{odd}");
    // Except RMSNorm's in clusters of 16, pipelined from their stages.
    let odd = choose_spec(
        Pass::Vjp,
        Kind::RmsNorm,
        DType::BF16,
        131071,
        Rows::Alike,
        Count::Few,
        gpu,
    );
    assert_eq!(odd.constant("CLUSTER"), Some(16), "{odd}");
    assert_eq!(odd.constant("PIPELINE"), Some(1), "{odd}");
    // 16-bit LayerNorm: up to 32 elements a thread in the fewest blocks; RMSNorm 16 while 8
    // blocks of 16 hold the row. Each thread holds the fewest vectors that cover its block's
    // chunk (18,432 elements on two blocks: 9,216 each, 3 vectors of 512 threads, not 4).
    let layout = |kind, d| {
        let spec = chosen(Pass::Forward, kind, DType::BF16, d);
        (
            spec.constant("ITEMS").unwrap(),
            spec.constant("CLUSTER").unwrap(),
        )
    };
    assert_eq!(layout(Kind::LayerNorm, 18432), (3, 2));
    assert_eq!(layout(Kind::LayerNorm, 30000), (4, 2));
    assert_eq!(layout(Kind::LayerNorm, 65536), (4, 4));
    assert_eq!(layout(Kind::LayerNorm, 131072), (4, 8));
    assert_eq!(layout(Kind::RmsNorm, 18432), (2, 3));
    assert_eq!(layout(Kind::RmsNorm, 65536), (2, 8));
    assert_eq!(layout(Kind::RmsNorm, 131072), (4, 8));
}

#[test]
fn forward_rows_on_a_ring_hold_the_fewest_vectors() {
    let gpu = Gpu::for_arch(90);
    let layout = |dtype, d| {
        let s = choose_spec(
            Pass::Forward,
            Kind::LayerNorm,
            dtype,
            d,
            Rows::Aligned,
            Count::Many,
            gpu,
        );
        (
            constant(&s, "GROUP"),
            constant(&s, "ITEMS"),
            constant(&s, "STAGES"),
        )
    };
    for dtype in [DType::BF16, DType::F16] {
        // Three vectors where two would leave more threads idle past the row.
        assert_eq!(layout(dtype, 3000), (128, 3, 2));
        assert_eq!(layout(dtype, 5120), (256, 3, 2));
        assert_eq!(layout(dtype, 12288), (512, 3, 2));
        // Two on a tie, and where two fill the row.
        assert_eq!(layout(dtype, 4096), (256, 2, 2));
        assert_eq!(layout(dtype, 8192), (512, 2, 2));
        assert_eq!(layout(dtype, 16384), (1024, 2, 2));
        // One warp up to 1,024 elements, as before.
        assert_eq!(layout(dtype, 1024), (32, 4, 2));
    }
    // f32 rows keep the registers without a ring, four vectors a thread on the fewest pairs
    // of warps past 1,024 elements.
    assert_eq!(layout(DType::F32, 3000), (192, 4, 0));
    assert_eq!(layout(DType::F32, 10240), (640, 4, 0));
    assert_eq!(layout(DType::F32, 12288), (768, 4, 0));
    assert_eq!(layout(DType::F32, 8192), (512, 4, 0));
    assert_eq!(layout(DType::F32, 16384), (1024, 4, 0));
    assert_eq!(layout(DType::F32, 1536), (128, 3, 0));
    // Up to 1,024 elements, a power of two of threads as before.
    assert_eq!(layout(DType::F32, 768), (64, 4, 0));
    assert_eq!(layout(DType::F32, 256), (32, 2, 0));
}

#[test]
fn vjp_rows_held_by_one_group_take_the_fewest_pairs_of_warps() {
    let gpu = Gpu::for_arch(90);
    let layout = |kind, dtype, d| {
        let s = choose_spec(Pass::Vjp, kind, dtype, d, Rows::Aligned, Count::Many, gpu);
        (
            constant(&s, "GROUP"),
            constant(&s, "ITEMS"),
            constant(&s, "RESIDENT"),
            s.block_dim as usize,
        )
    };
    for kind in [Kind::LayerNorm, Kind::RmsNorm] {
        for dtype in [DType::BF16, DType::F16] {
            // Two vectors on whole pairs of warps, not a power of two of threads.
            assert_eq!(layout(kind, dtype, 3000), (192, 2, 0, 192));
            assert_eq!(layout(kind, dtype, 5120), (320, 2, 0, 320));
            assert_eq!(layout(kind, dtype, 7168), (448, 2, 0, 448));
            // Three where it holds fewer vectors than two, or two would need more than 512
            // threads, packed; four resident.
            assert_eq!(layout(kind, dtype, 4608), (192, 3, 2, 192));
            assert_eq!(layout(kind, dtype, 12288), (512, 3, 2, 512));
            assert_eq!(layout(kind, dtype, 10240), (320, 4, 1, 320));
            assert_eq!(layout(kind, dtype, 16384), (512, 4, 1, 512));
            // Powers of two where they fit the row.
            assert_eq!(layout(kind, dtype, 4096), (256, 2, 0, 256));
            assert_eq!(layout(kind, dtype, 8192), (512, 2, 0, 512));
            // One vector a thread up to 2,048 elements, as before.
            assert_eq!(layout(kind, dtype, 2048), (256, 1, 0, 256));
        }
        // f32: four vectors a thread on the fewest pairs of warps with a ring (without one
        // where its stages do not fit), then 1,024 threads with their sums in shared memory
        // and the fewest vectors a thread.
        assert_eq!(layout(kind, DType::F32, 3000), (192, 4, 0, 192));
        assert_eq!(layout(kind, DType::F32, 5120), (320, 4, 0, 320));
        assert_eq!(layout(kind, DType::F32, 8192), (512, 4, 0, 512));
        let ring = |d, gpu| {
            let s = choose_spec(
                Pass::Vjp,
                kind,
                DType::F32,
                d,
                Rows::Aligned,
                Count::Many,
                gpu,
            );
            constant(&s, "STAGES")
        };
        assert_eq!(ring(5120, gpu), HELD_STAGES);
        assert_eq!(ring(8192, gpu), HELD_STAGES);
        // 99 KiB of shared memory (consumer Ampere and Ada): 512 x 4 f32 vectors take 128 KiB.
        let small = Gpu {
            shared_limit: 99 * 1024,
            ..gpu
        };
        assert_eq!(ring(8192, small), 0);
        assert_eq!(ring(3000, small), HELD_STAGES);
        assert_eq!(layout(kind, DType::F32, 10240), (1024, 3, 0, 1024));
        assert_eq!(layout(kind, DType::F32, 16384), (1024, 4, 0, 1024));
    }
}

#[test]
fn long_forward_rows_take_a_block_each_where_rows_are_many() {
    let (hopper, ampere) = (Gpu::for_arch(90), Gpu::for_arch(80));
    let spec = |kind, dtype, d, count, gpu| {
        choose_spec(Pass::Forward, kind, dtype, d, Rows::Aligned, count, gpu)
    };
    let ring = |s: KernelSpec| {
        let items = (constant(&s, "ITEMS"), constant(&s, "STAGES"));
        (s.template.name, s.block_dim, items)
    };
    let (layer, rms) = (Kind::LayerNorm, Kind::RmsNorm);
    for dtype in [DType::BF16, DType::F16] {
        // LayerNorm: the ring, the weights and the bias fit up to 24,576 elements.
        for d in [16392, 18432, 24576] {
            let s = spec(layer, dtype, d, Count::Many, hopper);
            assert_eq!(ring(s), ("norm_fwd", 1024, (3, 2)), "{d}");
            assert!(is_split(&spec(layer, dtype, d, Count::Few, hopper)), "{d}");
        }
        assert!(is_split(&spec(layer, dtype, 24584, Count::Many, hopper)));
        // RMSNorm, whose ring holds no bias, up to 32,768.
        let s = spec(rms, dtype, 32768, Count::Many, hopper);
        assert_eq!(ring(s), ("norm_fwd", 1024, (4, 2)));
        assert!(is_split(&spec(rms, dtype, 32776, Count::Many, hopper)));
        // Without clusters the ring serves few rows too, where it fits (Ampere: 163 KiB).
        let s = spec(rms, dtype, 18432, Count::Few, ampere);
        assert_eq!(ring(s), ("norm_fwd", 1024, (3, 2)));
        let s = spec(layer, dtype, 18432, Count::Few, ampere);
        assert_eq!(ring(s), ("norm_fwd", 1024, (0, 0)));
    }
    // f32 rows have no ring: they keep the split kernel.
    assert!(is_split(&spec(
        layer,
        DType::F32,
        18432,
        Count::Many,
        hopper
    )));
}

#[test]
fn unaligned_long_rows_take_vectors_on_the_ring_kernels() {
    let gpu = Gpu::for_arch(90);
    for dtype in DType::ALL {
        for (pass, d) in [
            (Pass::Forward, 16385),
            (Pass::Forward, 100_001),
            (Pass::Vjp, 16385),
        ] {
            for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                let spec = choose_spec(pass, kind, dtype, d, Rows::Alike, Count::Many, gpu);
                assert!(is_split(&spec), "{spec}");
                // The 16-bit forward's ring shifts its columns; the register split forward
                // (f32) and the VJP take one element a vector.
                let shifted = pass == Pass::Forward && dtype.size() == 2;
                let width = if shifted { dtype.vec_width() } else { 1 };
                assert_eq!(spec.n_reads as usize, width, "{spec} for d={d}");
                assert_eq!(
                    spec.constant("SHIFTED").unwrap_or(0),
                    shifted as i32,
                    "{spec}"
                );
                assert!(check_chosen(spec, pass, kind, dtype, d, Rows::Alike).is_ok());
                // Rows laid out otherwise take one element at a time.
                let scattered =
                    choose_spec(pass, kind, dtype, d, Rows::Scattered, Count::Many, gpu);
                assert_eq!(scattered.n_reads, 1, "{scattered}");
                if spec.n_reads > 1 {
                    assert!(check_chosen(spec, pass, kind, dtype, d, Rows::Scattered).is_err());
                    assert!(check_chosen(spec, pass, kind, dtype, d, Rows::Aligned).is_err());
                }
            }
        }
    }
    // Counts of vectors a split-row thread may hold: powers of two and three quarters of them.
    let counts: Vec<usize> = (0..=17).map(split_items).collect();
    assert_eq!(
        counts,
        [1, 1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 24]
    );
    // Each thread holds the fewest vectors that cover its block's chunk: 16,385 elements on
    // three f32 VJP blocks of 5,464 (12 of 512 threads' elements, not 16), on two 16-bit VJP
    // blocks of 8,200 (24, not 32), on two 16-bit LayerNorm forward blocks of 8,200 (3 shifted
    // vectors of 8, not 4).
    let items = |pass, dtype, kind| {
        let s = choose_spec(pass, kind, dtype, 16385, Rows::Alike, Count::Many, gpu);
        (constant(&s, "ITEMS"), constant(&s, "CLUSTER"))
    };
    assert_eq!(items(Pass::Vjp, DType::BF16, Kind::LayerNorm), (24, 2));
    assert_eq!(items(Pass::Vjp, DType::F32, Kind::RmsNorm), (12, 3));
    assert_eq!(items(Pass::Forward, DType::F16, Kind::LayerNorm), (3, 2));
    // The longest rows a layout holds take single elements where shifted vectors would not fit:
    // 8 blocks of 16,384 elements hold aligned rows of 131,072 and unaligned ones of 131,071.
    let forward = |d, rows| {
        choose_spec(
            Pass::Forward,
            Kind::RmsNorm,
            DType::BF16,
            d,
            rows,
            Count::Many,
            gpu,
        )
    };
    let (aligned, unaligned) = (forward(131072, Rows::Aligned), forward(131071, Rows::Alike));
    assert_eq!((aligned.n_reads, unaligned.n_reads), (8, 1));
    assert!(is_split(&unaligned), "{unaligned}");
    // The aligned spec's blocks cover their chunk exactly: a row that may start off a granule
    // needs a vector more, so it is refused there (and takes SHIFTED anyway).
    assert_eq!(split_capacity(&aligned), split_chunk(131072, 8));
    let check = |rows| {
        check_chosen(
            aligned,
            Pass::Forward,
            Kind::RmsNorm,
            DType::BF16,
            131064,
            rows,
        )
    };
    assert!(check(Rows::Aligned).is_ok());
    assert!(check(Rows::Alike).is_err());
}

#[test]
fn the_granule_period_is_the_rows_until_offsets_repeat() {
    use super::launch::granule_period;
    assert_eq!(granule_period(&[16384], 2), 1);
    assert_eq!(granule_period(&[16385], 2), 8);
    assert_eq!(granule_period(&[16386], 2), 4);
    assert_eq!(granule_period(&[16388], 2), 2);
    assert_eq!(granule_period(&[16385], 4), 4);
    assert_eq!(granule_period(&[16386], 4), 2);
    assert_eq!(granule_period(&[16388, 16385], 4), 4);
    assert_eq!(granule_period(&[0, 8], 2), 1);
    assert_eq!(granule_period(&[], 2), 1);
}

#[test]
fn rows_are_aligned_alike_or_scattered() {
    use super::launch::row_layout;
    let bf16 = |d, views: &[(u64, i64)]| row_layout(DType::BF16, d, views);
    assert_eq!(bf16(4096, &[(256, 4096), (512, 4096)]), Rows::Aligned);
    // Odd lengths, contiguous: every operand's row r starts 2r bytes (mod 16) into a granule.
    assert_eq!(bf16(16385, &[(256, 16385), (512, 16385)]), Rows::Alike);
    // A strided view whose rows advance otherwise than the output's (stride 2d).
    assert_eq!(bf16(16385, &[(256, 32770)]), Rows::Scattered);
    // Rows of a wider matrix whose stride matches d's residue are alike.
    assert_eq!(bf16(16385, &[(256, 16393)]), Rows::Alike);
    // A view at an odd offset, or a cotangent laid out otherwise.
    assert_eq!(bf16(16385, &[(262, 16385)]), Rows::Scattered);
    assert_eq!(bf16(4096, &[(256, 4096), (258, 4096)]), Rows::Scattered);
    assert_eq!(
        row_layout(DType::F32, 4099, &[(0, 4099), (64, 8195)]),
        Rows::Alike
    );
    assert_eq!(row_layout(DType::F32, 4099, &[(0, 4100)]), Rows::Scattered);
}

#[test]
fn a_shifted_spec_is_refused_where_a_block_would_hold_none_of_the_row() {
    let gpu = Gpu::for_arch(90);
    let spec = choose_spec(
        Pass::Forward,
        Kind::RmsNorm,
        DType::BF16,
        16385,
        Rows::Alike,
        Count::Many,
        gpu,
    );
    assert_eq!(spec.constant("SHIFTED"), Some(1), "{spec}");
    let cluster = constant(&spec, "CLUSTER");
    assert!(check_chosen(
        spec,
        Pass::Forward,
        Kind::RmsNorm,
        DType::BF16,
        16385,
        Rows::Alike
    )
    .is_ok());
    // Rows so short that the last block's chunk starts past their end.
    let d = (cluster - 1) * 8 - 1;
    assert!((cluster - 1) * split_chunk(d, cluster) >= d);
    assert!(check_chosen(
        spec,
        Pass::Forward,
        Kind::RmsNorm,
        DType::BF16,
        d,
        Rows::Alike
    )
    .is_err());
}

#[test]
fn the_split_sweep_measures_the_chosen_spec_among_others() {
    let gpu = Gpu::for_arch(90);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for d in [16385, 16392, 18432, 30000, 50257, 65536, 70000, 131072] {
            // The sweep's rows are contiguous: odd lengths start alike.
            let rows = super::tuning::contiguous_rows(dtype, d);
            assert_eq!(rows == Rows::Alike, d % dtype.vec_width() != 0);
            for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                for pass in [Pass::Forward, Pass::Vjp] {
                    let candidates = super::tuning::split_candidates(pass, kind, dtype, d);
                    for count in [Count::Few, Count::Many] {
                        let chosen = choose_spec(pass, kind, dtype, d, rows, count, gpu);
                        if is_split(&chosen) {
                            assert!(
                                candidates.contains(&chosen),
                                "{chosen} missing from the sweep of {kind:?} {pass:?} {dtype} {d}"
                            );
                        }
                    }
                    assert!(!candidates.is_empty(), "{kind:?} {pass:?} {dtype} {d}");
                    for spec in &candidates {
                        assert!(check_chosen(*spec, pass, kind, dtype, d, rows).is_ok());
                    }
                    // Unaligned 16-bit forward rows are swept on shifted vectors too.
                    let shifted = candidates.iter().any(|s| s.constant("SHIFTED") == Some(1));
                    let staged = dtype.size() == 2 && pass == Pass::Forward;
                    assert_eq!(
                        shifted,
                        staged && rows == Rows::Alike,
                        "{kind:?} {pass:?} {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn packed_rows_are_a_16_bit_ring_layout_chosen_for_three_vectors_a_thread() {
    let (vjp, ln) = (Pass::Vjp, Kind::LayerNorm);
    let packed = spec_with(vjp, ln, DType::F16, 8, 320, 2, 2, Hold::Packed);
    assert!(check_chosen(packed, vjp, ln, DType::F16, 5120, Rows::Aligned).is_ok());
    // Its ring is the register layout's: no weights in shared memory.
    let floats = spec_with(vjp, ln, DType::F16, 8, 320, 2, 2, Hold::Floats);
    assert_eq!(ring_bytes(&packed), ring_bytes(&floats));
    // f32 has nothing to pack, and packing needs the ring.
    let f32 = spec_with(vjp, ln, DType::F32, 4, 320, 4, 2, Hold::Packed);
    assert!(check_chosen(f32, vjp, ln, DType::F32, 5120, Rows::Aligned).is_err());
    let no_ring = spec_with(vjp, ln, DType::F16, 8, 320, 2, 0, Hold::Packed);
    assert!(check_chosen(no_ring, vjp, ln, DType::F16, 5120, Rows::Aligned).is_err());
    let packed_bf16 = spec_with(vjp, ln, DType::BF16, 8, 320, 2, 2, Hold::Packed);
    assert!(tuning::candidates(vjp, ln, DType::BF16, 5120).contains(&packed_bf16));
    // Chosen for three vectors a thread, and only there.
    for d in (8..=16384).step_by(8) {
        let s = choose_spec(
            vjp,
            ln,
            DType::F16,
            d,
            Rows::Aligned,
            Count::Many,
            Gpu::for_arch(90),
        );
        let packed = constant(&s, "RESIDENT") == Hold::Packed as usize;
        let three = s.template.name == VJP.name && constant(&s, "ITEMS") == 3;
        assert_eq!(packed, three && constant(&s, "STAGES") > 0, "{d}: {s}");
    }
}

#[test]
fn the_staged_forward_pairs_blocks_where_its_chunk_leaves_room() {
    let gpu = Gpu::for_arch(90);
    let spec = |d, rows| {
        choose_spec(
            Pass::Forward,
            Kind::LayerNorm,
            DType::BF16,
            d,
            rows,
            Count::Many,
            gpu,
        )
    };
    // Unaligned rows of 16,385 in clusters of two, 24 elements a thread: a block's chunk of
    // 8,200 takes two thirds of its capacity, which leaves room for two blocks an SM (Hopper:
    // 228 KiB, a block's static scratch besides).
    let short = spec(16385, Rows::Alike);
    assert_eq!(short.template.name, FORWARD_STAGED.name);
    assert_eq!(constant(&short, "CLUSTER"), 2);
    assert_eq!(constant(&short, "PAIRED"), 1);
    assert_eq!(split_capacity(&short), 12288);
    assert!(launch_bytes(&short, 16385) < ring_bytes(&short));
    assert!(2 * (launch_bytes(&short, 16385) + 4096) <= 228 * 1024);
    // Up to three quarters of the capacity, and every paired launch within what `fits` checked.
    for d in (16385..=24559).step_by(2) {
        let s = spec(d, Rows::Alike);
        let paired = constant(&s, "PAIRED") == 1;
        assert_eq!(paired, d <= 18431, "{d}: {s}");
        assert!(launch_bytes(&s, d) <= ring_bytes(&s), "{d}");
        if !paired {
            assert_eq!(launch_bytes(&s, d), ring_bytes(&s), "{d}");
        }
    }
    // Aligned rows (where few) and other kernels take their ring whatever the row.
    let few = choose_spec(
        Pass::Forward,
        Kind::LayerNorm,
        DType::BF16,
        16392,
        Rows::Aligned,
        Count::Few,
        gpu,
    );
    assert_eq!(constant(&few, "PAIRED"), 0, "{few}");
    let block = spec(1001, Rows::Alike);
    assert_eq!(launch_bytes(&block, 1001), ring_bytes(&block));
    // A caller's PAIRED spec must hold 24 elements a thread.
    let mut consts = short.consts;
    consts[1] = 4; // ITEMS: 32 elements
    let wide = KernelSpec::new(&FORWARD_STAGED, DType::BF16, 512, 8, &consts[..5]);
    let check = |s| {
        check_chosen(
            s,
            Pass::Forward,
            Kind::LayerNorm,
            DType::BF16,
            16385,
            Rows::Alike,
        )
    };
    assert!(check(short).is_ok());
    assert!(check(wide).is_err());
}
