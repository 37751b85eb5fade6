//! Convolution throughput against cuDNN (through PyTorch: channels last, cudnn.benchmark, TF32
//! off), forward, backward-data and backward-weight, in one run, on two suites: seven small
//! ResNet-like 2-D shapes and a model-layer suite: every distinct 3x3 and 1x1 layer of
//! ResNet-50 at batch 64 with its strided ones, Stable Diffusion UNet and VGG 3x3 layers, 1-D
//! audio and 3-D video layers; every dtype. TFLOP/s counts 2 * MACs for each pass. With
//! `KILN_ALLOW_TF32=1` kiln's f32 runs one TF32 product and cuDNN's TF32 is turned on too.
//!
//! Targets, per suite, pass and dtype, as geometric means of kiln / cuDNN: on the seven shapes
//! at least 0.5 for f16 and bf16 and 0.8 for f32 (the mma.sync kernels); on the model layers at
//! least 1.0 with no layer below 0.7 for f16 and bf16 (the Hopper family's goal), 1.0 for f32
//! (0.8 for TF32 against cuDNN's TF32). A third suite, `--suite
//! classes` (every dtype), holds layer classes to per-layer floors: depthwise and grouped
//! layers (MobileNetV2, EfficientNet, ConvNeXt, ResNeXt) at least 1.0x cuDNN, depthwise also at
//! least 60% of the copy bandwidth counting the bytes each pass moves (its two operands and its
//! result; the `% copy` column, against a 256 MiB copy; `% sized` is the same bytes against a
//! copy of that many bytes, timed alike, which a layer of a few MB cannot beat either); ViT
//! patch embeddings at least 1.0x; 3-channel stems at least 0.8x (`--suite stems`: just the
//! stems, with the seven shapes' one; `--suite depthwise`, `grouped` or `patch`: one class).
//! `--sweep-hopper` times every Hopper tile on the model layers it takes (bf16; those whose
//! name contains `--only TEXT`), checks each tile's result against the `mma.sync` path's, and
//! counts how often the plan's tile is within 5% of the best. `--paired` times the plan's Hopper
//! tile against it and the large tiles in clusters of two.
//!
//! kiln is timed on the host around many calls in direct mode (stream order, one synchronise at
//! the end); PyTorch with CUDA events. `--sweep` times every tile (and split) kiln has on each shape and
//! marks the plan's choice. `--only TEXT` keeps the rows whose "dtype pass" contains TEXT (e.g.
//! `--only "f32 backward_weight"`), `--no-anchor` skips PyTorch: both for comparing kernel
//! variants quickly, not for the targets. `--layer N,C,H,W,K,R,S,stride,pad[,gG]` (repeatable;
//! the rows' own format, 2-D) times just the layers given, held to no target: for layers the
//! suites do not have.

mod common;

use std::time::Instant;

use kiln::ops::conv::{self, plan, tuning, ConvParams, Geometry, Pass};
use kiln::runtime::{Array, CommandEncoder, Device};
use kiln::selfcheck::TestRng;
use kiln::DType;

/// One convolution layer: batch, input channels, spatial extent (1 to 3 dims), output
/// channels, kernel extent, and a stride and padding for every spatial dim.
#[derive(Clone, Debug)]
struct Layer {
    n: usize,
    c: usize,
    spatial: Vec<usize>,
    k: usize,
    kernel: Vec<usize>,
    stride: usize,
    pad: usize,
    groups: usize,
    /// The layer class whose targets it is held to (the class suite), else "".
    class: &'static str,
}

/// A square (or cubic) layer: `dims` spatial dims of extent `size`, kernel `r` in each.
fn layer(n: usize, c: usize, size: &[usize], k: usize, r: usize, stride: usize) -> Layer {
    Layer {
        n,
        c,
        spatial: size.to_vec(),
        k,
        kernel: vec![r; size.len()],
        stride,
        pad: r / 2,
        groups: 1,
        class: "",
    }
}

/// A layer of the class suite: `groups` channel groups, padding `pad`.
#[allow(clippy::too_many_arguments)]
fn class_layer(
    class: &'static str,
    n: usize,
    c: usize,
    size: &[usize],
    k: usize,
    r: usize,
    stride: usize,
    pad: usize,
    groups: usize,
) -> Layer {
    Layer {
        pad,
        groups,
        class,
        ..layer(n, c, size, k, r, stride)
    }
}

const DEPTHWISE: &str = "depthwise";
const GROUPED: &str = "grouped";
const PATCH: &str = "patch";
const STEM: &str = "stem";
/// The suite of `--layer` arguments: held to no target.
const GIVEN: &str = "given layers";

/// The class suite: depthwise (3x3, 5x5, 7x7; channel multipliers 1 and 2), grouped (4 to 32
/// channels a group; channel multipliers 1, 2 and 4), patch embeddings (14x14 and 16x16) and stems (3 channels, 7x7 and 3x3 at
/// stride 2), from MobileNetV2, EfficientNet, ConvNeXt, ResNeXt-50 (32x4d), ViT and ResNet.
fn class_layers() -> Vec<Layer> {
    vec![
        // MobileNetV2: 144 channels, 3x3 at 56x56, and its stride-2 block; its other stride-1
        // 3x3 layers, from 32 channels at 112x112 to 960 at 7x7.
        class_layer(DEPTHWISE, 64, 144, &[56, 56], 144, 3, 1, 1, 144),
        class_layer(DEPTHWISE, 64, 144, &[56, 56], 144, 3, 2, 1, 144),
        class_layer(DEPTHWISE, 64, 32, &[112, 112], 32, 3, 1, 1, 32),
        class_layer(DEPTHWISE, 64, 192, &[28, 28], 192, 3, 1, 1, 192),
        class_layer(DEPTHWISE, 64, 576, &[14, 14], 576, 3, 1, 1, 576),
        class_layer(DEPTHWISE, 64, 960, &[7, 7], 960, 3, 1, 1, 960),
        // EfficientNet: 5x5 at 28x28 (240 channels) and 14x14 (672).
        class_layer(DEPTHWISE, 64, 240, &[28, 28], 240, 5, 1, 2, 240),
        class_layer(DEPTHWISE, 64, 672, &[14, 14], 672, 5, 1, 2, 672),
        // ConvNeXt-T: 7x7 at 56x56 (96 channels) and 14x14 (384).
        class_layer(DEPTHWISE, 32, 96, &[56, 56], 96, 7, 1, 3, 96),
        class_layer(DEPTHWISE, 64, 384, &[14, 14], 384, 7, 1, 3, 384),
        // Channel multiplier 2 (Xception-style separable stems).
        class_layer(DEPTHWISE, 64, 64, &[56, 56], 128, 3, 1, 1, 64),
        class_layer(DEPTHWISE, 64, 128, &[28, 28], 256, 5, 1, 2, 128),
        // ResNeXt-50 32x4d: 4, 8 and 16 channels a group, and a strided block.
        class_layer(GROUPED, 64, 128, &[56, 56], 128, 3, 1, 1, 32),
        class_layer(GROUPED, 64, 256, &[28, 28], 256, 3, 1, 1, 32),
        class_layer(GROUPED, 64, 256, &[56, 56], 256, 3, 2, 1, 32),
        class_layer(GROUPED, 64, 512, &[14, 14], 512, 3, 1, 1, 32),
        // ResNeXt-101 32x8d (16 a group at 28x28) and ResNeXt-50's last stage (32 a group).
        class_layer(GROUPED, 64, 512, &[28, 28], 512, 3, 1, 1, 32),
        class_layer(GROUPED, 64, 1024, &[7, 7], 1024, 3, 1, 1, 32),
        // Channel multipliers 2 and 4 (8 in and 16 out a group; 4 in and 16 out).
        class_layer(GROUPED, 32, 64, &[56, 56], 128, 3, 1, 1, 8),
        class_layer(GROUPED, 64, 32, &[56, 56], 128, 3, 1, 1, 8),
        // ViT-B/16 and ViT-L/14 patch embeddings at 224x224.
        class_layer(PATCH, 64, 3, &[224, 224], 768, 16, 16, 0, 1),
        class_layer(PATCH, 64, 3, &[224, 224], 1024, 14, 14, 0, 1),
        // ResNet's 7x7 stem and a 3x3 stride-2 stem (EfficientNet, RegNet).
        class_layer(STEM, 64, 3, &[224, 224], 64, 7, 2, 3, 1),
        class_layer(STEM, 64, 3, &[224, 224], 32, 3, 2, 1, 1),
    ]
}

/// The layers of every `--layer N,C,H,W,K,R,S,stride,pad[,gG]` argument (2-D, the rows' format),
/// held to no class's targets; an error names an argument that does not parse.
fn given_layers(args: &[String]) -> Result<Vec<Layer>, String> {
    let mut out = Vec::new();
    for (i, a) in args.iter().enumerate() {
        if a != "--layer" {
            continue;
        }
        let text = args
            .get(i + 1)
            .ok_or("needs N,C,H,W,K,R,S,stride,pad[,gG]")?;
        let fields: Vec<&str> = text.split(',').collect();
        let groups = match fields.get(9) {
            Some(g) => g.strip_prefix('g').and_then(|g| g.parse().ok()),
            None => Some(1),
        };
        let v: Vec<usize> = fields
            .iter()
            .take(9)
            .filter_map(|f| f.parse().ok())
            .collect();
        match (&v[..], groups, fields.len()) {
            (&[n, c, h, w, k, r, s, stride, pad], Some(groups), 9 | 10) => {
                let mut l = class_layer("", n, c, &[h, w], k, r, stride, pad, groups);
                l.kernel = vec![r, s];
                out.push(l);
            }
            _ => return Err(format!("{text:?} is not N,C,H,W,K,R,S,stride,pad[,gG]")),
        }
    }
    Ok(out)
}

/// The class suite's stems, the seven shapes' (batch 32), and stems neither has (3x3 to 64
/// channels, 1 and 4 input channels, another resolution), held to the stems' floor: a quick
/// suite (`--suite stems`) for work on the stem family.
fn stem_layers() -> Vec<Layer> {
    let mut out: Vec<Layer> = class_layers()
        .into_iter()
        .filter(|l| l.class == STEM)
        .collect();
    out.extend(
        small_shapes()
            .into_iter()
            .filter(|l| l.c <= 4)
            .map(|l| Layer { class: STEM, ..l }),
    );
    out.extend([
        class_layer(STEM, 32, 3, &[224, 224], 64, 3, 2, 1, 1),
        class_layer(STEM, 32, 1, &[256, 256], 32, 3, 2, 1, 1),
        class_layer(STEM, 32, 4, &[160, 160], 64, 7, 2, 3, 1),
    ]);
    out
}

/// N, C, H, W, K, R, S, stride, pad: the seven small shapes.
const SHAPES: [[usize; 9]; 7] = [
    [32, 64, 56, 56, 64, 3, 3, 1, 1],
    [32, 128, 28, 28, 128, 3, 3, 1, 1],
    [32, 256, 14, 14, 256, 3, 3, 1, 1],
    [32, 512, 7, 7, 512, 3, 3, 1, 1],
    [32, 64, 56, 56, 256, 1, 1, 1, 0],
    [32, 256, 56, 56, 128, 1, 1, 2, 0],
    [32, 3, 224, 224, 64, 7, 7, 2, 3],
];

fn small_shapes() -> Vec<Layer> {
    SHAPES
        .iter()
        .map(|&[n, c, h, w, k, r, s, stride, pad]| Layer {
            n,
            c,
            spatial: vec![h, w],
            k,
            kernel: vec![r, s],
            stride,
            pad,
            groups: 1,
            class: "",
        })
        .collect()
}

/// The model-layer suite.
fn model_layers() -> Vec<Layer> {
    let mut out = Vec::new();
    // ResNet-50 (v1.5, stride in the 3x3) at batch 64: per stage, map size, width, and the
    // input channels of its first block.
    for (size, width, first_in) in [(56, 64, 64), (28, 128, 256), (14, 256, 512), (7, 512, 1024)] {
        let expanded = width * 4;
        let strided = size != 56;
        let before = if strided { size * 2 } else { size };
        out.push(layer(64, first_in, &[before, before], width, 1, 1));
        out.push(layer(
            64,
            width,
            &[before, before],
            width,
            3,
            1 + strided as usize,
        ));
        out.push(layer(64, width, &[size, size], expanded, 1, 1));
        out.push(layer(64, expanded, &[size, size], width, 1, 1));
        if strided {
            out.push(layer(64, width, &[size, size], width, 3, 1));
            out.push(layer(64, first_in, &[before, before], expanded, 1, 2));
        }
    }
    // Stable Diffusion UNet 3x3 layers (batch 8) and a VGG layer.
    out.push(layer(8, 320, &[64, 64], 320, 3, 1));
    out.push(layer(8, 640, &[32, 32], 640, 3, 1));
    out.push(layer(8, 1280, &[16, 16], 1280, 3, 1));
    out.push(layer(8, 640, &[64, 64], 320, 3, 1));
    out.push(layer(16, 128, &[112, 112], 128, 3, 1));
    // 1-D audio (k = 5 and 3) and 3-D video (3x3x3).
    out.push(layer(32, 512, &[4096], 512, 5, 1));
    out.push(layer(16, 256, &[16000], 256, 3, 1));
    out.push(layer(8, 128, &[16, 28, 28], 128, 3, 1));
    out.push(layer(4, 256, &[8, 14, 14], 256, 3, 1));
    out
}
const ITERS: usize = 10;

fn seconds_per_call(enc: &mut CommandEncoder, mut call: impl FnMut(&mut CommandEncoder)) -> f64 {
    for _ in 0..2 {
        call(enc);
    }
    enc.synchronize().unwrap();
    let mut batches: Vec<f64> = (0..3)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..ITERS {
                call(enc);
            }
            enc.synchronize().unwrap();
            t.elapsed().as_secs_f64() / ITERS as f64
        })
        .collect();
    batches.sort_by(|a, b| a.partial_cmp(b).unwrap());
    batches[1]
}

/// The device's copy bandwidth in GB/s (bytes read plus bytes written), over 256 MiB.
fn copy_gbs(enc: &mut CommandEncoder) -> f64 {
    sized_copy_gbs(enc, 2 << 28)
}

/// The bandwidth in GB/s of a copy that moves `bytes` in all (half read, half written), timed as
/// the layers are. A layer of a few MB cannot move its bytes at the 256 MiB copy's rate (launch
/// and the last wave's tail weigh more): this is what a copy of its own size gets.
fn sized_copy_gbs(enc: &mut CommandEncoder, bytes: usize) -> f64 {
    let n = (bytes / 2).div_ceil(4).max(1);
    let dev = enc.device().clone();
    let src = Array::empty(&dev, DType::F32, &[n]).unwrap();
    let dst = Array::empty(&dev, DType::F32, &[n]).unwrap();
    let secs = seconds_per_call(enc, |e| e.copy_into(&src, &dst).unwrap());
    2.0 * (n * 4) as f64 / secs / 1e9
}

struct Operands {
    g: Geometry,
    params: ConvParams,
    x: Array,
    w: Array,
    dy: Array,
}

impl Operands {
    /// The two operands `pass` takes, as the tuning entry points take them.
    fn of(&self, pass: Pass) -> (&Array, &Array) {
        match pass {
            Pass::Forward => (&self.x, &self.w),
            Pass::BackwardData => (&self.dy, &self.w),
            Pass::BackwardWeight => (&self.x, &self.dy),
        }
    }
}

fn operands(enc: &mut CommandEncoder, l: &Layer, dtype: DType) -> Operands {
    let params = ConvParams::default()
        .strides(&[l.stride])
        .padding(&[l.pad])
        .groups(l.groups);
    let input: Vec<usize> = [&[l.n][..], &l.spatial, &[l.c]].concat();
    let weight: Vec<usize> = [&[l.k][..], &l.kernel, &[l.c / l.groups]].concat();
    let g = Geometry::new(&input, &weight, &params).unwrap();
    let mut rng = TestRng::new(3);
    let mut up = |shape: &[usize]| {
        let len = shape.iter().product();
        Array::from_f64(enc, dtype, &rng.values(len, 2.0, 0.0), shape).unwrap()
    };
    let (x, wt, dy) = (
        up(&g.input_shape()),
        up(&g.weight_shape()),
        up(&g.output_shape()),
    );
    Operands {
        g,
        params,
        x,
        w: wt,
        dy,
    }
}

fn run(enc: &mut CommandEncoder, o: &Operands, pass: Pass) {
    conv::conv_pass(enc, pass, &o.params, &o.x, &o.w, &o.dy).unwrap();
}

/// "N,C,H,W,K,R,S,stride,pad" for 2-D layers (the anchor script's format); other ranks join
/// each extent with 'x': "N,C,D1xD2xD3,K,R1xR2xR3,stride,pad"; ",gG" follows for G groups.
fn name(l: &Layer) -> String {
    let dims = |v: &[usize]| v.iter().map(|d| d.to_string()).collect::<Vec<_>>();
    let (sp, kr) = (dims(&l.spatial), dims(&l.kernel));
    let (sp, kr) = if l.spatial.len() == 2 {
        (sp.join(","), kr.join(","))
    } else {
        (sp.join("x"), kr.join("x"))
    };
    let groups = if l.groups > 1 {
        format!(",g{}", l.groups)
    } else {
        String::new()
    };
    format!(
        "{},{},{sp},{},{kr},{},{}{groups}",
        l.n, l.c, l.k, l.stride, l.pad
    )
}

fn sweep(enc: &mut CommandEncoder) {
    for s in &small_shapes() {
        for dtype in [DType::BF16, DType::F32] {
            let o = operands(enc, s, dtype);
            let flops = 2.0 * o.g.macs() as f64;
            for pass in Pass::ALL {
                let (first, second) = o.of(pass);
                let splits: &[usize] = if pass == Pass::BackwardWeight {
                    &[1, 2, 4, 8, 16, 32]
                } else {
                    &[1]
                };
                let tensor = plan::Math::of(dtype, enc.device().arch(), false).tensor();
                for &t in plan::tiles(tensor) {
                    for &sp in splits {
                        let secs = seconds_per_call(enc, |e| {
                            tuning::run_with(e, pass, &o.g, first, second, t, sp).unwrap();
                        });
                        println!(
                            "sweep {} {dtype} {} {}x{} splits {sp}: {:.1} TFLOP/s",
                            name(s),
                            pass.name(),
                            t.bm,
                            t.bn,
                            flops / secs / 1e12
                        );
                    }
                }
            }
        }
    }
}

/// Calls `f` with each model layer whose name contains `--only TEXT`, its bf16 operands, and
/// each pass whose plan runs on the Hopper family, with that plan's launch.
fn for_hopper_plans(
    enc: &mut CommandEncoder,
    mut f: impl FnMut(&mut CommandEncoder, &Layer, &Operands, Pass, &kiln::ops::conv::hopper::Launch),
) {
    use kiln::ops::conv::plan::Kind;
    let (only, _) = common::variant_flags();
    for l in model_layers().iter().filter(|l| name(l).contains(&only)) {
        let o = operands(enc, l, DType::BF16);
        for pass in Pass::ALL {
            let Ok(plan) = conv::plan_for(enc, pass, &o.params, &o.x, &o.w, &o.dy) else {
                continue;
            };
            let Kind::Wgmma(chosen) = &plan.kind else {
                println!("{} {}: not on the Hopper path", name(l), pass.name());
                continue;
            };
            f(enc, l, &o, pass, chosen);
        }
    }
}

/// `--sweep-hopper`: bf16 TFLOP/s of every Hopper tile (and split, for backward-weight)
/// on each model layer the family takes, with the plan's choice marked.
fn sweep_hopper(enc: &mut CommandEncoder) {
    use kiln::ops::conv::hopper;
    let (mut passes, mut within, mut worst) = (0, 0, 1.0f64);
    for_hopper_plans(enc, |enc, l, o, pass, chosen| {
        let flops = 2.0 * o.g.macs() as f64;
        let (first, second) = o.of(pass);
        let mut splits = if pass == Pass::BackwardWeight {
            vec![1, 2, 3, 4, 6, 8, 12, 16]
        } else {
            vec![1]
        };
        if !splits.contains(&chosen.splits) {
            splits.push(chosen.splits);
        }
        // Every tile's result against the mma.sync path's, so a fast wrong kernel shows.
        let reference =
            tuning::run_with(enc, pass, &o.g, first, second, tuning::TENSOR_TILES[0], 1)
                .unwrap()
                .to_f64(enc)
                .unwrap();
        let scale = reference
            .iter()
            .fold(0.0f64, |m, v| m.max(v.abs()))
            .max(1e-30);
        let (mut best, mut planned) = (0.0f64, 0.0f64);
        // Paired tiles have their own comparison (`--paired`).
        for t in hopper::tiles(DType::BF16, pass)
            .into_iter()
            .filter(|t| t.cluster == 1)
        {
            for &sp in &splits {
                let got = tuning::run_hopper_with(enc, pass, &o.g, first, second, t, sp)
                    .unwrap()
                    .to_f64(enc)
                    .unwrap();
                let off = got
                    .iter()
                    .zip(&reference)
                    .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()))
                    / scale;
                if off > 2e-2 {
                    println!(
                        "sweep {} {} {}x{} splits {sp}: WRONG, off by {off:.3} of the largest \
                             value",
                        name(l),
                        pass.name(),
                        t.bm,
                        t.bn
                    );
                }
                let secs = seconds_per_call(enc, |e| {
                    tuning::run_hopper_with(e, pass, &o.g, first, second, t, sp).unwrap();
                });
                let tflops = flops / secs / 1e12;
                best = best.max(tflops);
                let mark = if t == chosen.tile && sp == chosen.splits {
                    planned = tflops;
                    " <- plan"
                } else {
                    ""
                };
                println!(
                    "sweep {} {} {}x{} splits {sp}: {tflops:.1} TFLOP/s{mark}",
                    name(l),
                    pass.name(),
                    t.bm,
                    t.bn,
                );
            }
        }
        println!(
            "sweep {} {}: plan {planned:.1}, best {best:.1} TFLOP/s ({:.2})",
            name(l),
            pass.name(),
            planned / best
        );
        passes += 1;
        within += (planned >= 0.95 * best) as usize;
        worst = worst.min(planned / best);
    });
    println!(
        "sweep: the plan's tile within 5% of the best on {within} of {passes} layer passes \
         (lowest {worst:.2} of the best)"
    );
}

/// `--paired [--only TEXT]`: on each model layer pass the Hopper family takes (bf16), the plan's
/// tile against the same tile and split paired in clusters of two (B multicast), and the large
/// tiles paired; each paired result checked against the plan's.
fn paired(enc: &mut CommandEncoder) {
    use kiln::ops::conv::hopper;
    let mut per_pass: Vec<(Pass, f64, f64)> = Vec::new();
    println!("plan's tile alone / paired, TFLOP/s, direct mode");
    for_hopper_plans(enc, |enc, l, o, pass, chosen| {
        let flops = 2.0 * o.g.macs() as f64;
        let (first, second) = o.of(pass);
        let (t, sp) = (chosen.tile, chosen.splits);
        let run = |e: &mut CommandEncoder, t: hopper::Tile| {
            tuning::run_hopper_with(e, pass, &o.g, first, second, t, sp).unwrap()
        };
        let want = run(enc, t).to_f64(enc).unwrap();
        let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
        let mut tiles = vec![t, t.paired()];
        for big in [(128, 192), (128, 256), (256, 128)] {
            let p = hopper::Tile {
                bm: big.0,
                bn: big.1,
                swapped: false,
                cluster: 2,
            };
            if !tiles.contains(&p) {
                tiles.push(p);
            }
        }
        let mut line = format!("paired {} {}", name(l), pass.name());
        let mut alone = 0.0;
        let mut best_paired = 0.0f64;
        for (i, &tile) in tiles.iter().enumerate() {
            let got = run(enc, tile).to_f64(enc).unwrap();
            let off = got
                .iter()
                .zip(&want)
                .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()))
                / scale;
            let secs = seconds_per_call(enc, |e| {
                run(e, tile);
            });
            let tflops = flops / secs / 1e12;
            if i == 0 {
                alone = tflops;
            } else {
                best_paired = best_paired.max(tflops);
            }
            let wrong = if off > 2e-2 { " WRONG" } else { "" };
            let p = if tile.cluster > 1 { "p" } else { "" };
            let s = if tile.swapped { "s" } else { "" };
            line += &format!("  {}x{}{s}{p} {tflops:.1}{wrong}", tile.bm, tile.bn);
        }
        println!(
            "{line}  (splits {sp}; best paired / plan {:.2})",
            best_paired / alone
        );
        per_pass.push((pass, alone, best_paired));
    });
    for pass in Pass::ALL {
        let r: Vec<f64> = per_pass
            .iter()
            .filter(|x| x.0 == pass)
            .map(|x| x.2 / x.1)
            .collect();
        if r.is_empty() {
            continue;
        }
        let geo = (r.iter().map(|x| x.ln()).sum::<f64>() / r.len() as f64).exp();
        let (lo, hi) = r
            .iter()
            .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        println!(
            "paired {}: best paired / plan geomean {geo:.3}, range {lo:.2}-{hi:.2} over {}",
            pass.name(),
            r.len()
        );
    }
}

/// `--stand-ins [--only TEXT]`: the cold-start stand-in (see `KILN_STAND_INS`) against the
/// chosen kernel on the model layers, every dtype and pass: TFLOP/s of each and their ratio.
fn stand_ins(enc: &mut CommandEncoder) {
    let (only, _) = common::variant_flags();
    println!("stand-in against the chosen kernel, TFLOP/s, direct mode");
    let mut ratios = Vec::new();
    for l in model_layers() {
        for dtype in DType::ALL {
            let label = format!("{} {}", name(&l), dtype.name());
            if !label.contains(only.as_str()) {
                continue;
            }
            let o = operands(enc, &l, dtype);
            let flops = 2.0 * o.g.macs() as f64;
            for pass in Pass::ALL {
                let chosen = seconds_per_call(enc, |e| run(e, &o, pass));
                let (first, second) = o.of(pass);
                let stand_in = seconds_per_call(enc, |e| {
                    tuning::run_stand_in(e, pass, &o.g, first, second).unwrap();
                });
                ratios.push(chosen / stand_in);
                println!(
                    "{label:<34} {:<15} chosen {:7.1}  stand-in {:7.1}  ({:.3}x)",
                    pass.name(),
                    flops / chosen / 1e12,
                    flops / stand_in / 1e12,
                    chosen / stand_in
                );
            }
        }
    }
    let geo = (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len().max(1) as f64).exp();
    println!(
        "stand-in / chosen speed: geometric mean {geo:.3}x over {} passes",
        ratios.len()
    );
}

fn main() {
    // Timings are of the kernels the ops choose: no cold-start stand-ins (see KILN_STAND_INS),
    // set before anything reads the environment.
    if std::env::var_os("KILN_STAND_INS").is_none() {
        std::env::set_var("KILN_STAND_INS", "0");
    }
    let dev = match kiln::runtime::gpus() {
        Ok(g) if !g.is_empty() => Device::get(0).unwrap(),
        _ => {
            println!("conv bench: no GPU, skipped");
            return;
        }
    };
    // Direct mode: each call runs after the previous in stream order, as cuDNN's calls do
    // under PyTorch. In graph mode independent calls may overlap on the GPU, which would credit
    // a kernel of fewer blocks than SMs with its neighbours' work.
    let mut config = kiln::env::Config::from_env().unwrap();
    config.use_cuda_graphs = false;
    let mut enc = CommandEncoder::with_config(&dev, &config).unwrap();
    if std::env::args().any(|a| a == "--sweep") {
        sweep(&mut enc);
        return;
    }
    if std::env::args().any(|a| a == "--sweep-hopper") {
        sweep_hopper(&mut enc);
        return;
    }
    if std::env::args().any(|a| a == "--paired") {
        paired(&mut enc);
        return;
    }
    if std::env::args().any(|a| a == "--stand-ins") {
        stand_ins(&mut enc);
        return;
    }
    let (only, no_anchor) = common::variant_flags();
    let args: Vec<String> = std::env::args().collect();
    let suite_arg = args
        .iter()
        .position(|a| a == "--suite")
        .and_then(|i| args.get(i + 1))
        .map_or("all", String::as_str);
    let mut suites: Vec<(&str, Vec<Layer>, &[DType])> = Vec::new();
    if suite_arg == "all" || suite_arg == "small" {
        suites.push(("seven small shapes", small_shapes(), &DType::ALL));
    }
    if suite_arg == "all" || suite_arg == "models" {
        suites.push(("model layers", model_layers(), &DType::ALL));
    }
    if suite_arg == "all" || suite_arg == "classes" {
        suites.push(("layer classes", class_layers(), &DType::ALL));
    }
    if suite_arg == "stems" {
        suites.push(("stems", stem_layers(), &DType::ALL));
    }
    // One class of the class suite: `--suite depthwise`, `grouped` or `patch`.
    if [DEPTHWISE, GROUPED, PATCH].contains(&suite_arg) {
        let layers = class_layers()
            .into_iter()
            .filter(|l| l.class == suite_arg)
            .collect();
        suites.push(("layer classes", layers, &DType::ALL));
    }
    let given = match given_layers(&args) {
        Ok(layers) => layers,
        Err(e) => {
            eprintln!("--layer: {e}");
            std::process::exit(2);
        }
    };
    // `--layer`: those layers instead of any suite.
    if !given.is_empty() {
        suites.clear();
        suites.push((GIVEN, given, &DType::ALL));
    }
    let copy = copy_gbs(&mut enc);
    println!(
        "conv bench on {}: copy bandwidth {copy:.0} GB/s (kiln memcpy node)",
        dev.info().name
    );
    let tf32 = dev.jit().config().allow_tf32;
    if tf32 {
        println!("KILN_ALLOW_TF32=1: f32 as one TF32 product, against cuDNN with TF32 on");
    }
    let mut misses = 0;
    for (suite, layers, dtypes) in &suites {
        let mut anchor_args = if tf32 {
            vec!["--tf32".to_string()]
        } else {
            vec![]
        };
        anchor_args.extend([
            "--dtypes".to_string(),
            dtypes
                .iter()
                .map(|d| d.name())
                .collect::<Vec<_>>()
                .join(","),
        ]);
        anchor_args.extend(layers.iter().map(name));
        let torch = if no_anchor {
            None
        } else {
            common::run_anchor("conv_torch.py", &anchor_args)
        };
        println!(
            "anchor: {}",
            torch
                .as_ref()
                .map_or("PyTorch unavailable".to_string(), |t| format!(
                    "PyTorch {} cuDNN {}",
                    t["torch"], t["cudnn"]
                ))
        );
        misses += run_suite(
            &mut enc,
            suite,
            layers,
            dtypes,
            &only,
            torch.as_ref(),
            copy,
            tf32,
        );
    }
    println!("{misses} targets missed");
}

/// Times one suite against the anchor and prints its rows and geometric means; returns the
/// number of targets missed. `copy` is the device's copy bandwidth in GB/s (depthwise layers
/// are held to a share of it); `tf32`: f32 runs one TF32 product on both sides.
#[allow(clippy::too_many_arguments)]
fn run_suite(
    enc: &mut CommandEncoder,
    suite: &str,
    layers: &[Layer],
    dtypes: &[DType],
    only: &str,
    torch: Option<&serde_json::Value>,
    copy: f64,
    tf32: bool,
) -> usize {
    let models = suite == "model layers";
    println!("\n{suite}");
    println!(
        "{:<40} {:<5} {:<16} {:>10} {:>10} {:>7} {:>7} {:>7}",
        "N,C,spatial,K,kernel,stride,pad[,groups]",
        "dtype",
        "pass",
        "kiln TF/s",
        "cuDNN TF/s",
        "ratio",
        "% copy",
        "% sized"
    );
    // Per (class, dtype, pass): log-ratio sum, count, lowest ratio, lowest share of copy, and
    // that layer's share of a copy of its own size.
    type Stats = (f64, usize, f64, f64, f64);
    let mut logs = std::collections::BTreeMap::<(&str, DType, &str), Stats>::new();
    for l in layers {
        for &dtype in dtypes {
            if !Pass::ALL
                .iter()
                .any(|p| format!("{dtype} {}", p.name()).contains(only))
            {
                continue;
            }
            let o = operands(enc, l, dtype);
            let flops = 2.0 * o.g.macs() as f64;
            // Every pass reads two of (input, weight, output) and writes the third.
            let bytes = (o.x.size() + o.w.size() + o.dy.size()) * dtype.size();
            let sized = sized_copy_gbs(enc, bytes);
            for pass in Pass::ALL {
                if !format!("{dtype} {}", pass.name()).contains(only) {
                    continue;
                }
                let secs = seconds_per_call(enc, |e| run(e, &o, pass));
                let tf = flops / secs / 1e12;
                let share = bytes as f64 / secs / 1e9 / copy;
                let sized_share = bytes as f64 / secs / 1e9 / sized;
                let anchor = torch
                    .and_then(|t| t[format!("{} {dtype} {}", name(l), pass.name())].as_f64())
                    .map(|t| flops / t / 1e12);
                if let Some(a) = anchor {
                    let e = logs.entry((l.class, dtype, pass.name())).or_insert((
                        0.0,
                        0,
                        f64::INFINITY,
                        f64::INFINITY,
                        f64::INFINITY,
                    ));
                    e.0 += (tf / a).ln();
                    e.1 += 1;
                    e.2 = e.2.min(tf / a);
                    if share < e.3 {
                        (e.3, e.4) = (share, sized_share);
                    }
                }
                println!(
                    "{:<40} {:<5} {:<16} {:>10.2} {:>10} {:>7} {:>6.0}% {:>6.0}%",
                    name(l),
                    dtype.name(),
                    pass.name(),
                    tf,
                    anchor.map_or("-".into(), |a| format!("{a:.2}")),
                    anchor.map_or("-".into(), |a| format!("{:.2}x", tf / a)),
                    100.0 * share,
                    100.0 * sized_share,
                );
            }
        }
    }
    println!("{suite}: geometric mean of kiln / cuDNN (lowest layer):");
    let mut misses = 0;
    for ((class, dtype, pass), (sum, n, lowest, share, sized_share)) in logs {
        let gm = (sum / n as f64).exp();
        // (geometric mean, every layer, share of copy) each pass is held to.
        let (target, floor, copy_floor) = match (class, models, dtype) {
            _ if suite == GIVEN => (0.0, 0.0, 0.0),
            (DEPTHWISE, _, _) => (0.0, 1.0, 0.6),
            (GROUPED | PATCH, _, _) => (0.0, 1.0, 0.0),
            (STEM, _, _) => (0.0, 0.8, 0.0),
            (_, true, DType::F32) if tf32 => (0.8, 0.0, 0.0),
            (_, true, DType::F32) => (1.0, 0.0, 0.0),
            (_, true, _) => (1.0, 0.7, 0.0),
            (_, false, DType::F32) => (0.8, 0.0, 0.0),
            (_, false, _) => (0.5, 0.0, 0.0),
        };
        let met = gm >= target && lowest >= floor && share >= copy_floor;
        misses += !met as usize;
        let mut held = Vec::new();
        if target > 0.0 {
            held.push(format!("target {target}x"));
        }
        if floor > 0.0 {
            held.push(format!("every layer >= {floor}x"));
        }
        if copy_floor > 0.0 {
            held.push(format!(
                "every layer >= {:.0}% copy, lowest {:.0}% ({:.0}% of a copy of its size)",
                100.0 * copy_floor,
                100.0 * share,
                100.0 * sized_share
            ));
        }
        println!(
            "  {:<9} {dtype:<5} {pass:<16} {gm:.2}x, lowest {lowest:.2}x ({}): {}",
            if class.is_empty() { "all" } else { class },
            held.join(", "),
            if met { "met" } else { "missed" }
        );
    }
    misses
}
