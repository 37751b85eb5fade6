//! The direct family (`templates/conv_direct.cu`): grouped convolutions with few channels per
//! group, depthwise ones above all, as stencils over channel vectors instead of GEMMs (a
//! group's GEMM would have as few columns as the group has channels, wasting almost all of a
//! tensor-core tile). All three passes, every dtype, every architecture kiln runs on.
//!
//! It takes groups of `cg` input and `mg` output channels for the pairs in [`GROUP_SHAPES`]
//! (depthwise with channel multipliers 1, 2 and 4; 2 to 16 channels in and out; 2 to 8 in and
//! twice as many out, in f32 at stride 1), operands whose
//! base addresses are 16-byte aligned, and kernels whose weights fit the shared memory it
//! stages them in. Other grouped convolutions run on the implicit GEMM.

use crate::dtype::DType;
use crate::env::ConvPath;
use crate::jit::{KernelSpec, TemplateDef};
use crate::runtime::Device;

use super::geometry::{Geometry, Pass};
use super::plan::PlanKey;

pub static DIRECT: TemplateDef = TemplateDef {
    name: "conv_direct",
    source: include_str!("../../../templates/conv_direct.cu"),
    kernel: "kiln_conv_direct",
    const_names: &["PASS", "CG", "MG", "NO", "OT", "KT", "MIN_BLOCKS"],
    arch_specific: false,
    only_arch: None,
};

/// Threads a block may have (the template's launch bound).
pub const THREADS: u16 = 256;

/// (input, output) channels per group the family takes.
pub const GROUP_SHAPES: [(usize, usize); 10] = [
    (1, 1),
    (1, 2),
    (1, 4),
    (2, 2),
    (4, 4),
    (8, 8),
    (16, 16),
    (2, 4),
    (4, 8),
    (8, 16),
];

/// The most threads a block may have along z (along x and y: 1024).
const MAX_BLOCK_Z: usize = 64;

/// Shared memory the family asks for at most: its blocks should share an SM (three of them, the
/// depthwise kernels' launch bound).
const SHARED_BUDGET: usize = 64 * 1024;

/// How a thread's work is shaped: `no` output channels (backward-weight: cotangent channels) at
/// `ot` positions along w, `kt` taps along w per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub no: usize,
    pub ot: usize,
    pub kt: usize,
}

/// The gather's outputs per group and the source channels each reads (as the template's OPG
/// and R).
fn roles(pass: Pass, cg: usize, mg: usize) -> (usize, usize) {
    match pass {
        Pass::BackwardData => (cg, mg),
        _ => (mg, cg),
    }
}

/// The thread shape for these channels: with `full`, the most output channels a thread that
/// registers allow (up to one 16-byte vector), else one.
///
/// Depthwise shapes (one input channel a group) walk a window of KT taps along w, KT the
/// kernel's width rounded up to 3, 5 or 7 (`kw`), with the KT taps' weights (backward-weight:
/// their accumulators) in registers, and must fit 80 registers so that three blocks share an SM
/// (the template's `MIN_BLOCKS`): KT x NO x R weights, OT x NO accumulators (backward-weight:
/// cotangents) and one source vector within 60 floats. Grouped shapes hold the window of sources
/// (within 80 floats) and one tap's weights (within 64).
fn shape_with(dtype: DType, pass: Pass, cg: usize, mg: usize, kw: usize, full: bool) -> Shape {
    let (opg, r) = roles(pass, cg, mg);
    let (ot, kt) = match (pass, cg) {
        (_, 1) if kw <= 3 => (8, 3),
        (_, 1) if kw <= 5 => (8, 5),
        (_, 1) => (4, 7),
        // Three taps a thread reuse each source window (f32, groups up to 8: 1.28-1.70x one tap
        // on the H200; 16 a group, one output channel a thread under the register bound, 0.91x).
        (Pass::BackwardWeight, c) if c <= 8 && dtype == DType::F32 => (4, 3),
        (Pass::BackwardWeight, _) => (4, 1),
        (_, c) if c >= 16 => (2, 3),
        _ => (4, 3),
    };
    let sources = |no: usize| if no >= opg { no / opg * r } else { r };
    let fits = |no: usize| {
        let whole = no % opg == 0 || opg % no == 0;
        let held = if cg == 1 {
            kt * no * r + ot * no + sources(no) <= 60
        } else {
            match pass {
                Pass::BackwardWeight => kt * no * r <= 64,
                _ => (ot + kt - 1) * sources(no) <= 80 && no * r <= 64,
            }
        };
        whole && held
    };
    let mut no = if full { dtype.vec_width() } else { 1 };
    while no > 1 && !fits(no) {
        no /= 2;
    }
    Shape { no, ot, kt }
}

/// The output's channel count (the template's out_c) for `pass`.
fn out_channels(pass: Pass, g: &Geometry) -> usize {
    match pass {
        Pass::BackwardData => g.cin,
        _ => g.cout,
    }
}

/// The thread shape `pass` of `g` takes, or `None` where the full channel vector does not
/// divide the output's channels and one channel a thread is used.
pub fn shape(dtype: DType, pass: Pass, g: &Geometry) -> Shape {
    let (cg, mg) = (g.cin / g.groups, g.cout / g.groups);
    let kw = g.kernel[2];
    let full = shape_with(dtype, pass, cg, mg, kw, true);
    let (opg, _) = roles(pass, cg, mg);
    let fits = out_channels(pass, g) % full.no == 0 && (full.no % opg == 0 || opg % full.no == 0);
    if fits {
        full
    } else {
        shape_with(dtype, pass, cg, mg, kw, false)
    }
}

/// Blocks an SM must hold (the kernel's launch bound): three for the depthwise shapes, whose
/// registers [`shape_with`] bounds so that 24 warps hide a stencil's memory latency; one for the
/// grouped shapes, which hold more sources and weights a thread and would spill under that
/// bound.
fn min_blocks(cg: usize) -> usize {
    if cg == 1 {
        3
    } else {
        1
    }
}

/// The PASS constant `pass` is compiled with. With one input and one output channel a group
/// (depthwise), backward-data's roles and weight index are the forward's and the rest lies in
/// the problem's fields: its PASS 1 code is the PASS 0 code (checked in SASS), so both passes
/// share one module, one compile and one cache entry.
fn compiled_pass(pass: Pass, cg: usize, mg: usize) -> i32 {
    match pass {
        Pass::BackwardData if cg == 1 && mg == 1 => Pass::Forward as i32,
        _ => pass as i32,
    }
}

pub fn spec(dtype: DType, pass: Pass, cg: usize, mg: usize, s: Shape) -> KernelSpec {
    KernelSpec::new(
        &DIRECT,
        dtype,
        THREADS,
        1,
        &[
            compiled_pass(pass, cg, mg),
            cg as i32,
            mg as i32,
            s.no as i32,
            s.ot as i32,
            s.kt as i32,
            min_blocks(cg) as i32,
        ],
    )
}

/// Whether [`specs`] lists the group shape (`cg`, `mg`): not those with a channel multiplier,
/// which few models have (they compile on first use).
fn warmed((cg, mg): (usize, usize)) -> bool {
    cg == mg
}

/// The specs `kiln warm` compiles: every spec the family may choose for its group shapes of as
/// many output as input channels (grouped layers with a channel multiplier are rare). The
/// depthwise family takes the common depthwise layers (kernels up to 7x7, strides up to 2, every
/// multiplier), so this one sees only dilated, 3-D, wider or more strided ones, which seldom
/// have a channel multiplier; those compile on first use.
pub fn specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for dtype in DType::ALL {
        for pass in Pass::ALL {
            for (cg, mg) in GROUP_SHAPES.into_iter().filter(|&s| warmed(s)) {
                // Depthwise shapes differ by kernel width (3, 5, 7 and wider); grouped do not.
                for kw in [3, 5, 7] {
                    for full in [true, false] {
                        let shape = shape_with(dtype, pass, cg, mg, kw, full);
                        out.push(spec(dtype, pass, cg, mg, shape));
                    }
                }
            }
        }
    }
    out
}

/// Whether the family takes `key` on the plan's path, and if not, why.
pub fn unsupported(path: ConvPath, key: &PlanKey) -> Option<&'static str> {
    let g = &key.geometry;
    if path == ConvPath::Igemm {
        return Some("KILN_CONV_PATH=igemm");
    }
    if g.groups == 1 {
        return Some("one group");
    }
    let (cg, mg) = (g.cin / g.groups, g.cout / g.groups);
    if !GROUP_SHAPES.contains(&(cg, mg)) {
        return Some("channels per group not among the direct family's");
    }
    if cg > 1 && mg != cg && (key.dtype != DType::F32 || g.stride.iter().any(|&s| s > 1)) {
        // Measured on the H200 in f32: 1.0-4.3x the implicit GEMM at stride 1, but 0.44-0.79x
        // it at stride 2 (8 in and 16 out a group). 16-bit ones were not measured here.
        return Some("a grouped layer with a channel multiplier that is strided or not f32");
    }
    if !key.aligned {
        return Some("operands not 16-byte aligned");
    }
    None
}

/// The kernel's view of a problem: `struct kiln_direct` in the template.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Problem {
    pub batch: i32,
    pub out: [i32; 3],
    pub src: [i32; 3],
    pub ks: [i32; 3],
    pub step: [i32; 3],
    pub tap_step: [i32; 3],
    pub offset: [i32; 3],
    pub divisor: [i32; 3],
    pub out_c: i32,
    pub src_c: i32,
    pub ksize: i32,
    pub reverse: i32,
    pub window: i32,
    pub slots: i32,
    pub strips: i32,
    pub rows: i32,
    pub row_chunks: i32,
    pub tasks: i32,
    pub tap_groups: i32,
    pub tasks_per_split: i32,
}

/// A plan's launch: the problem, the grid and block, dynamic shared memory, and the splits of
/// backward-weight's sum (each writing f32 partials).
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    pub pass: Pass,
    pub problem: Problem,
    pub shape: Shape,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared: usize,
    pub splits: usize,
}

fn i3(v: [usize; 3]) -> [i32; 3] {
    v.map(|x| x as i32)
}

/// The spec and launch that run `key`, or `None` where the family does not take it (see
/// [`unsupported`]) or its weights do not fit shared memory.
pub fn plan(device: &Device, path: ConvPath, key: &PlanKey) -> Option<(KernelSpec, Launch)> {
    if unsupported(path, key).is_some() {
        return None;
    }
    let sms = device.info().multiprocessors as usize;
    let limit = device.shared_limit().min(SHARED_BUDGET);
    let launch = launch_for(key, sms, limit)?;
    let g = &key.geometry;
    let s = spec(
        key.dtype,
        key.pass,
        g.cin / g.groups,
        g.cout / g.groups,
        launch.shape,
    );
    Some((s, launch))
}

/// The launch of `key` on `sms` multiprocessors with `limit` bytes of shared memory a block.
pub fn launch_for(key: &PlanKey, sms: usize, limit: usize) -> Option<Launch> {
    let g = &key.geometry;
    let pass = key.pass;
    let shape = shape(key.dtype, pass, g);
    let (cg, mg) = (g.cin / g.groups, g.cout / g.groups);
    let (_, r) = roles(pass, cg, mg);
    let ksize = g.kernel_size();
    let mut p = Problem {
        batch: g.batch as i32,
        ks: i3(g.kernel),
        ksize: ksize as i32,
        ..Problem::default()
    };
    // Source position along each dim: (P * step + t * tap_step + offset) / divisor.
    for d in 0..3 {
        let span = ((g.kernel[d] - 1) * g.kernel_dilation[d]) as i32;
        let (step, offset, divisor) = match pass {
            Pass::BackwardData => (
                g.input_dilation[d] as i32,
                g.pad_lo[d] as i32 - span,
                g.stride[d] as i32,
            ),
            _ => (
                g.stride[d] as i32,
                -(g.pad_lo[d] as i32),
                g.input_dilation[d] as i32,
            ),
        };
        p.step[d] = step;
        p.tap_step[d] = g.kernel_dilation[d] as i32;
        p.offset[d] = offset;
        p.divisor[d] = divisor;
    }
    p.window = (p.step[2] == 1 && p.tap_step[2] == 1 && p.divisor[2] == 1) as i32;
    // Backward-data walks the taps backwards: its weight tap is reversed unless flipped.
    p.reverse = (g.flip != (pass == Pass::BackwardData)) as i32;
    let (out, src, out_c, src_c) = match pass {
        Pass::Forward => (g.output, g.input, g.cout, g.cin),
        Pass::BackwardData => (g.input, g.output, g.cin, g.cout),
        Pass::BackwardWeight => (g.output, g.input, g.cout, g.cin),
    };
    p.out = i3(out);
    p.src = i3(src);
    p.out_c = out_c as i32;
    p.src_c = src_c as i32;
    let slots = out_c / shape.no;
    p.slots = slots as i32;
    let strips = out[2].div_ceil(shape.ot);
    p.strips = strips as i32;
    let threads = THREADS as usize;
    if pass == Pass::BackwardWeight {
        let tap_groups = g.kernel[0] * g.kernel[1] * g.kernel[2].div_ceil(shape.kt);
        let per = shape.kt * shape.no * cg;
        let mut sb = slots.min(32);
        let mut tgb = tap_groups.min(threads / sb).min(MAX_BLOCK_Z);
        while sb * tgb * per * 4 > limit {
            if tgb > 1 {
                tgb = tgb.div_ceil(2);
            } else if sb > 1 {
                sb = sb.div_ceil(2);
            } else {
                return None;
            }
        }
        let lanes = (threads / (sb * tgb)).clamp(1, MAX_BLOCK_Z);
        let x = slots.div_ceil(sb) * tap_groups.div_ceil(tgb);
        let tasks = g.batch * out[0] * out[1] * strips;
        // Enough blocks for four a multiprocessor, each split keeping 16 tasks a lane.
        let most = (tasks / (lanes * 16)).max(1);
        let splits = (4 * sms).div_ceil(x).clamp(1, most).min(65535);
        let per_split = tasks.div_ceil(splits).max(1);
        let splits = tasks.div_ceil(per_split).max(1);
        p.tap_groups = tap_groups as i32;
        p.tasks = tasks as i32;
        p.tasks_per_split = per_split as i32;
        p.rows = 1;
        p.row_chunks = out[1] as i32;
        return Some(Launch {
            pass,
            problem: p,
            shape,
            grid: (x as u32, splits as u32, 1),
            block: (sb as u32, tgb as u32, lanes as u32),
            shared: sb * tgb * per * 4,
            splits,
        });
    }
    // Forward, backward-data: a block's weights are ksize x ceil(no * r / 4) float4s a slot.
    let per_slot = ksize * (shape.no * r).div_ceil(4) * 16;
    let sb = slots.min(32).min(limit / per_slot);
    if sb == 0 {
        return None;
    }
    let slot_blocks = slots.div_ceil(sb);
    let sb = slots.div_ceil(slot_blocks);
    let lanes = threads / sb;
    let tasks_for = |rows: usize| g.batch * out[0] * out[1].div_ceil(rows) * strips;
    // The longest row walk that still gives enough blocks: depthwise blocks are small in work
    // and three fit an SM, so they aim at twelve an SM (measured better than two waves of
    // longer-lived blocks); grouped blocks at four.
    let target = if cg == 1 { 12 * sms } else { 4 * sms };
    let mut rows = 8.min(out[1]);
    while rows > 1 && slot_blocks * tasks_for(rows).div_ceil(lanes) < target {
        rows /= 2;
    }
    let tasks = tasks_for(rows);
    p.rows = rows as i32;
    p.row_chunks = out[1].div_ceil(rows) as i32;
    p.tasks = tasks as i32;
    let task_blocks = tasks.div_ceil(lanes).min(65535);
    Some(Launch {
        pass,
        problem: p,
        shape,
        grid: (slot_blocks as u32, task_blocks as u32, 1),
        block: (sb as u32, lanes as u32, 1),
        shared: sb * per_slot,
        splits: 1,
    })
}

#[cfg(test)]
mod tests {
    use super::super::geometry::ConvParams;
    use super::super::plan::test_key as key;
    use super::*;

    #[test]
    fn depthwise_backward_data_shares_the_forwards_module() {
        for dtype in DType::ALL {
            for (cg, mg) in GROUP_SHAPES {
                for kw in [3, 5, 7] {
                    for full in [true, false] {
                        let shape = shape_with(dtype, Pass::BackwardData, cg, mg, kw, full);
                        let data = spec(dtype, Pass::BackwardData, cg, mg, shape);
                        let forward = spec(dtype, Pass::Forward, cg, mg, shape);
                        assert_eq!(data == forward, cg == 1 && mg == 1, "{cg} {mg}");
                        let weight = spec(dtype, Pass::BackwardWeight, cg, mg, shape);
                        assert_eq!(weight.constant("PASS"), Some(2));
                    }
                }
            }
        }
    }

    #[test]
    fn takes_the_group_shapes_it_compiles() {
        let p = |groups| ConvParams::default().padding(&[1]).groups(groups);
        let fwd = Pass::Forward;
        let f16 = DType::F16;
        for (cg, mg) in GROUP_SHAPES {
            let groups = 6;
            let k = key(
                DType::F32,
                fwd,
                &[2, 9, 9, cg * groups],
                &[mg * groups, 3, 3, cg],
                &p(groups),
            );
            assert_eq!(unsupported(ConvPath::Auto, &k), None, "{cg} {mg}");
            assert!(unsupported(ConvPath::Igemm, &k).is_some());
        }
        // Grouped layers with a channel multiplier: f32 at stride 1 only (depthwise ones at
        // any stride and dtype).
        let strided = ConvParams::default().padding(&[1]).groups(6).strides(&[2]);
        let (x, w) = ([2, 9, 9, 48], [96, 3, 3, 8]);
        let f32_key = |p: &ConvParams| key(DType::F32, fwd, &x, &w, p);
        assert_eq!(unsupported(ConvPath::Auto, &f32_key(&p(6))), None);
        assert!(unsupported(ConvPath::Auto, &f32_key(&strided)).is_some());
        assert!(unsupported(ConvPath::Auto, &key(f16, fwd, &x, &w, &p(6))).is_some());
        let depthwise = key(f16, fwd, &[2, 9, 9, 6], &[12, 3, 3, 1], &strided);
        assert_eq!(unsupported(ConvPath::Auto, &depthwise), None);
        let one_group = key(f16, fwd, &[2, 9, 9, 8], &[8, 3, 3, 8], &p(1));
        assert!(unsupported(ConvPath::Auto, &one_group).is_some());
        let wide = key(f16, fwd, &[2, 9, 9, 64], &[64, 3, 3, 32], &p(2));
        assert!(unsupported(ConvPath::Auto, &wide).is_some());
    }

    #[test]
    fn every_chosen_spec_of_a_warmed_shape_is_listed() {
        let all = specs();
        // Channel multipliers are not warmed.
        assert!(all.iter().all(|s| !s.to_string().contains(" CG=1 MG=2 ")));
        assert!(all.iter().all(|s| !s.to_string().contains(" CG=1 MG=4 ")));
        assert!(all.iter().all(|s| !s.to_string().contains(" CG=8 MG=16 ")));
        let p = ConvParams::default().padding(&[1]);
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                for (cg, mg) in GROUP_SHAPES.into_iter().filter(|&s| warmed(s)) {
                    // Channel counts that allow the full vector, and odd ones that do not;
                    // kernel widths of each depthwise class.
                    for (groups, kw) in [8, 3, 5]
                        .into_iter()
                        .flat_map(|g| [1, 2, 3, 4, 5, 6, 7, 9].map(|kw| (g, kw)))
                    {
                        let x = [1, 5, 11, cg * groups];
                        let w = [mg * groups, 3, kw, cg];
                        let k = key(dtype, pass, &x, &w, &p.clone().groups(groups));
                        let s = shape(dtype, pass, &k.geometry);
                        assert!(all.contains(&spec(dtype, pass, cg, mg, s)), "{k:?}");
                        let (opg, _) = roles(pass, cg, mg);
                        assert_eq!(out_channels(pass, &k.geometry) % s.no, 0);
                        assert!(s.no % opg == 0 || opg % s.no == 0);
                    }
                }
            }
        }
    }

    #[test]
    fn launches_fit_the_block_and_shared_memory() {
        // (input spatial, kernel): 2-D 7x7, 1-D kernels short and long, 3-D 3x3x3 and 9x9x9.
        let shapes: [(&[usize], &[usize]); 5] = [
            (&[14, 14], &[7, 7]),
            (&[40], &[3]),
            (&[40], &[31]),
            (&[5, 6, 7], &[3, 3, 3]),
            (&[9, 9, 9], &[9, 9, 9]),
        ];
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                for (cg, mg) in GROUP_SHAPES {
                    for groups in [1, 2, 3, 96 / cg] {
                        for (size, kernel) in shapes {
                            let x = [[4].as_slice(), size, &[cg * groups]].concat();
                            let w = [[mg * groups].as_slice(), kernel, &[cg]].concat();
                            let p = ConvParams::default().groups(groups).padding(&[1]);
                            let k = key(dtype, pass, &x, &w, &p);
                            let Some(l) = launch_for(&k, 132, SHARED_BUDGET) else {
                                // Only weights too large for shared memory are refused.
                                assert!(k.geometry.kernel_size() > 27, "{k:?}");
                                continue;
                            };
                            let (bx, by, bz) = l.block;
                            assert!(bx * by * bz <= THREADS as u32, "{k:?}");
                            assert!(bx <= 1024 && by <= 1024, "{k:?}");
                            assert!(bz as usize <= MAX_BLOCK_Z, "{k:?}");
                            assert!(l.shared <= SHARED_BUDGET, "{k:?}");
                            let (gx, gy, gz) = l.grid;
                            assert!(gx >= 1 && (1..=65535).contains(&gy) && gz == 1, "{k:?}");
                        }
                    }
                }
            }
        }
    }
}
