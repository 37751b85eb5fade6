//! Convolution with MLX's `conv_general` semantics, channels last, 1 to 3 spatial dims: the
//! forward pass and both gradients, each an implicit GEMM (`templates/conv_igemm.cu`, and on
//! sm_90 `conv_wgmma.cu`), for 1-D and 2-D depthwise layers a stencil over shared-memory tiles
//! (`conv_depthwise.cu`), for 16-bit groups of 2-32 channels tensor-core tiles
//! (`conv_grouped.cu`), for other few-channel groups a stencil (`conv_direct.cu`), for 1-4
//! input channels (image stems) a gather from a staged patch (`conv_stem.cu`); patch
//! convolutions run as a 1x1 convolution over rearranged operands (`patch`), and implicit GEMMs
//! whose channels do not fill whole vectors over zero-padded channels (`widen`).
//!
//! Layouts: input (N, spatial..., C_in), weight (C_out, spatial..., C_in / groups), output
//! (N, spatial..., C_out). f16 and bf16 multiply on tensor cores with f32 accumulation, f32 on
//! the FMA units; the weight gradient of a long reduction is split over blocks and summed in f32.

// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod autotune;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod depthwise;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod direct;
pub mod geometry;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod grouped;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod hopper;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod patch;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod plan;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod reference;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod stand_in;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod stem;
// Internal: public for kiln's own tests, benches and CLI; not part of the stable API.
#[doc(hidden)]
pub mod widen;

pub use geometry::{ConvParams, Geometry, Pass};

use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::jit::KernelSpec;
use crate::runtime::{Array, CommandEncoder, KernelArgs};
use plan::{Kind, Plan, PlanKey, Tile};

/// Every spec the convolutions can choose on architecture `arch`.
pub fn specs(arch: u32) -> Vec<KernelSpec> {
    plan::specs(arch)
}

fn bad(arg: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument {
        arg,
        reason: reason.into(),
    }
}

fn check_dtypes(pairs: &[(&'static str, &Array)]) -> Result<DType> {
    let dtype = pairs[0].1.dtype();
    for (name, a) in &pairs[1..] {
        if a.dtype() != dtype {
            // The first array sets the dtype the others must hold.
            return Err(Error::DTypeMismatch {
                arg: name,
                expected: dtype,
                got: a.dtype(),
            });
        }
    }
    Ok(dtype)
}

fn check_shape(name: &'static str, a: &Array, want: &[usize]) -> Result<()> {
    if a.shape() != want {
        return Err(Error::ShapeMismatch {
            arg: name,
            expected: want.to_vec(),
            got: a.shape().to_vec(),
        });
    }
    Ok(())
}

/// MLX's `conv_general`: the forward convolution with every parameter spelled out.
#[allow(clippy::too_many_arguments)]
pub fn conv_general(
    enc: &mut CommandEncoder,
    input: &Array,
    weight: &Array,
    strides: &[usize],
    padding_lo: &[usize],
    padding_hi: &[usize],
    kernel_dilation: &[usize],
    input_dilation: &[usize],
    groups: usize,
    flip: bool,
) -> Result<Array> {
    let params = ConvParams {
        strides: strides.to_vec(),
        padding_lo: padding_lo.to_vec(),
        padding_hi: padding_hi.to_vec(),
        kernel_dilation: kernel_dilation.to_vec(),
        input_dilation: input_dilation.to_vec(),
        groups,
        flip,
    };
    conv_forward(enc, input, weight, &params)
}

/// The output of convolving `input` with `weight`.
pub fn conv_forward(
    enc: &mut CommandEncoder,
    input: &Array,
    weight: &Array,
    params: &ConvParams,
) -> Result<Array> {
    let dtype = check_dtypes(&[("input", input), ("weight", weight)])?;
    let g = Geometry::new(input.shape(), weight.shape(), params)?;
    run(enc, Pass::Forward, &g, dtype, input, weight, None)
}

/// The input gradient of the forward convolution of an input of `input_shape` with `weight`,
/// given the output's cotangent.
pub fn conv_backward_data(
    enc: &mut CommandEncoder,
    cotangent: &Array,
    weight: &Array,
    input_shape: &[usize],
    params: &ConvParams,
) -> Result<Array> {
    let dtype = check_dtypes(&[("cotangent", cotangent), ("weight", weight)])?;
    let g = Geometry::new(input_shape, weight.shape(), params)?;
    check_shape("cotangent", cotangent, &g.output_shape())?;
    run(enc, Pass::BackwardData, &g, dtype, cotangent, weight, None)
}

/// The weight gradient (shape `weight_shape`) of the forward convolution of `input`, given the
/// output's cotangent.
pub fn conv_backward_weight(
    enc: &mut CommandEncoder,
    input: &Array,
    cotangent: &Array,
    weight_shape: &[usize],
    params: &ConvParams,
) -> Result<Array> {
    let dtype = check_dtypes(&[("input", input), ("cotangent", cotangent)])?;
    let g = Geometry::new(input.shape(), weight_shape, params)?;
    check_shape("cotangent", cotangent, &g.output_shape())?;
    run(enc, Pass::BackwardWeight, &g, dtype, cotangent, input, None)
}

/// Runs `pass` on the forward's tensors: forward reads (input, weight), backward-data
/// (cotangent, weight) and the input's shape, backward-weight (input, cotangent) and the weight's
/// shape. For callers that hold the pass as a value (tests, benchmarks, the self-check).
pub fn conv_pass(
    enc: &mut CommandEncoder,
    pass: Pass,
    params: &ConvParams,
    input: &Array,
    weight: &Array,
    cotangent: &Array,
) -> Result<Array> {
    match pass {
        Pass::Forward => conv_forward(enc, input, weight, params),
        Pass::BackwardData => conv_backward_data(enc, cotangent, weight, input.shape(), params),
        Pass::BackwardWeight => conv_backward_weight(enc, input, cotangent, weight.shape(), params),
    }
}

/// The plan [`conv_pass`] runs with these tensors: from the plan cache, or built (its kernel
/// loaded or compiled) and cached now; for a layer that runs widened, the plan of the widened
/// convolution ([`widen::key`]). For a patch convolution ([`patch::is_patch`]) it is the plan of
/// the geometry as given, which explicit tiles run; `conv_pass` runs the 1x1 plan of
/// [`patch::inner`] instead.
pub fn plan_for(
    enc: &CommandEncoder,
    pass: Pass,
    params: &ConvParams,
    input: &Array,
    weight: &Array,
    cotangent: &Array,
) -> Result<Arc<Plan>> {
    let g = Geometry::new(input.shape(), weight.shape(), params)?;
    let (a, b) = match pass {
        Pass::Forward => (input, weight),
        Pass::BackwardData => (cotangent, weight),
        Pass::BackwardWeight => (cotangent, input),
    };
    let key = plan_key(enc, pass, &g, a, b);
    if runs_widened(enc, &key, None)? {
        return plan::plan(enc.device(), widen::key(&key));
    }
    plan::plan(enc.device(), key)
}

/// Explicit tile and split choices, for benchmark sweeps. The arguments are checked as by the
/// public ops; the plan is built fresh and not cached.
#[doc(hidden)]
pub mod tuning {
    use super::*;

    pub use super::plan::{Tile, FMA_TILES, TENSOR_TILES};

    /// Runs `pass` with operands as the public op takes them: forward (input, weight),
    /// backward-data (cotangent, weight), backward-weight (input, cotangent).
    pub fn run_with(
        enc: &mut CommandEncoder,
        pass: Pass,
        g: &Geometry,
        first: &Array,
        second: &Array,
        tile: Tile,
        splits: usize,
    ) -> Result<Array> {
        let (dtype, a, b) = gemm_operands(pass, first, second)?;
        run(enc, pass, g, dtype, a, b, Some(Chosen::Igemm(tile, splits)))
    }

    /// [`run_with`] on the stand-in a cold start runs while the chosen kernel compiles (see
    /// `KILN_STAND_INS`), whatever the kernel cache holds.
    pub fn run_stand_in(
        enc: &mut CommandEncoder,
        pass: Pass,
        g: &Geometry,
        first: &Array,
        second: &Array,
    ) -> Result<Array> {
        let (dtype, a, b) = gemm_operands(pass, first, second)?;
        run(enc, pass, g, dtype, a, b, Some(Chosen::StandIn))
    }

    /// [`run_with`] on the Hopper family with `tile` (one of [`hopper::tiles`] of the pass) and
    /// `splits` of backward-weight's pixels; an error where that family cannot run the pass.
    pub fn run_hopper_with(
        enc: &mut CommandEncoder,
        pass: Pass,
        g: &Geometry,
        first: &Array,
        second: &Array,
        tile: hopper::Tile,
        splits: usize,
    ) -> Result<Array> {
        let (dtype, a, b) = gemm_operands(pass, first, second)?;
        let tiles = hopper::tiles(dtype, pass);
        if !tiles.contains(&tile) {
            return Err(bad(
                "tile",
                format!(
                    "{tile:?} is not one of the Hopper tiles of {}: {tiles:?}",
                    pass.name()
                ),
            ));
        }
        run(enc, pass, g, dtype, a, b, Some(Chosen::Wgmma(tile, splits)))
    }

    /// The Hopper tile `KILN_CONV_AUTOTUNE` would choose for `pass` on these operands (whatever
    /// that variable says): read from the disk cache's note of an earlier measurement, or
    /// measured now and noted. An error where the Hopper family cannot run the pass.
    pub fn autotune_hopper(
        enc: &mut CommandEncoder,
        pass: Pass,
        g: &Geometry,
        first: &Array,
        second: &Array,
    ) -> Result<autotune::Choice> {
        let (dtype, a, b) = gemm_operands(pass, first, second)?;
        let (out_shape, prepared) = prepare(enc, pass, g, a, b)?;
        let Some(Prepared { a, b, key }) = prepared else {
            return Err(bad("pass", "the output is empty: nothing to tune"));
        };
        hopper_can_run(&key)?;
        let out = Array::empty_on(enc, dtype, &out_shape)?;
        autotune::choose(enc, &key, &a, &b, &out)
    }
}

/// The dtype and the GEMM operands (see [`run`]) of operands as the public op takes them.
fn gemm_operands<'a>(
    pass: Pass,
    first: &'a Array,
    second: &'a Array,
) -> Result<(DType, &'a Array, &'a Array)> {
    let dtype = check_dtypes(&[("first", first), ("second", second)])?;
    Ok(match pass {
        Pass::BackwardWeight => (dtype, second, first),
        _ => (dtype, first, second),
    })
}

/// A plan's choices given explicitly (sweeps), instead of by the model.
#[derive(Clone, Copy)]
enum Chosen {
    Igemm(Tile, usize),
    Wgmma(hopper::Tile, usize),
    /// The cold-start stand-in (`stand_in`), whatever the kernel cache holds.
    StandIn,
}

/// Whether `a` may be read with 16-byte vectors: its base is 16-byte aligned, or it is not
/// contiguous and so will be read from a fresh (aligned) copy.
fn aligned(a: &Array) -> bool {
    !a.is_contiguous() || (a.offset() * a.dtype().size()) % 16 == 0
}

/// The plan cache's key for GEMM operands `a` and `b` (see [`run`]).
fn plan_key(enc: &CommandEncoder, pass: Pass, g: &Geometry, a: &Array, b: &Array) -> PlanKey {
    let (vec_a, vec_b) = plan::channel_vectors(a.dtype(), pass, g);
    PlanKey {
        device: enc.device().id(),
        arch: enc.device().arch(),
        dtype: a.dtype(),
        pass,
        geometry: *g,
        vec_a: vec_a && aligned(a),
        vec_b: vec_b && aligned(b),
        aligned: aligned(a) && aligned(b),
        tf32: enc.device().jit().config().allow_tf32,
    }
}

/// An error naming why, where the Hopper family cannot run `key` on the encoder's GPU.
fn hopper_can_run(key: &PlanKey) -> Result<()> {
    match hopper::unsupported(key) {
        Some(why) => Err(bad(
            "pass",
            format!("the Hopper kernels cannot run it: {why}"),
        )),
        None => Ok(()),
    }
}

/// A pass's checked operands (row-major) and plan key.
struct Prepared {
    a: Array,
    b: Array,
    key: PlanKey,
}

/// Checks the shapes of a pass's GEMM operands (see [`run`]) against `g`, naming the argument
/// that differs; returns the output's shape.
fn check_operands(pass: Pass, g: &Geometry, a: &Array, b: &Array) -> Result<Vec<usize>> {
    let (a_shape, b_shape, out_shape) = match pass {
        Pass::Forward => (g.input_shape(), g.weight_shape(), g.output_shape()),
        Pass::BackwardData => (g.output_shape(), g.weight_shape(), g.input_shape()),
        Pass::BackwardWeight => (g.output_shape(), g.input_shape(), g.weight_shape()),
    };
    let (a_name, b_name) = match pass {
        Pass::Forward => ("input", "weight"),
        Pass::BackwardData => ("cotangent", "weight"),
        Pass::BackwardWeight => ("cotangent", "input"),
    };
    check_shape(a_name, a, &a_shape)?;
    check_shape(b_name, b, &b_shape)?;
    Ok(out_shape)
}

/// Checks a pass's operands; the operands (row-major) and key, or None where the output is
/// empty (nothing to launch). Returns the output's shape too.
fn prepare(
    enc: &mut CommandEncoder,
    pass: Pass,
    g: &Geometry,
    a: &Array,
    b: &Array,
) -> Result<(Vec<usize>, Option<Prepared>)> {
    let out_shape = check_operands(pass, g, a, b)?;
    let (m, n, _) = pass.gemm(g);
    if m == 0 || n == 0 {
        return Ok((out_shape, None));
    }
    // The kernels read row-major tensors; anything else is copied once.
    let a = a.contiguous(enc)?;
    let b = b.contiguous(enc)?;
    let key = plan_key(enc, pass, g, &a, &b);
    Ok((out_shape, Some(Prepared { a, b, key })))
}

/// Whether `key` runs widened (see [`widen`]): `conv_igemm` would run it (the model's choice,
/// or an explicit tile) but its operands do not load in vectors. Aligned keys answer at once; an
/// unaligned one that a plan is cached for (a stem, say) after one lookup.
fn runs_widened(enc: &CommandEncoder, key: &PlanKey, chosen: Option<Chosen>) -> Result<bool> {
    if key.vectors() {
        return Ok(false);
    }
    match chosen {
        Some(Chosen::Igemm(..)) => Ok(true),
        // Stand-ins load element by element where they must; the Hopper family refuses.
        Some(Chosen::StandIn | Chosen::Wgmma(..)) => Ok(false),
        None if plan::cached_quietly(key) => Ok(false),
        None => plan::widens(enc.device(), key),
    }
}

/// Runs one pass. `a` and `b` are the GEMM's operand tensors: forward (input, weight),
/// backward-data (cotangent, weight), backward-weight (cotangent, input).
fn run(
    enc: &mut CommandEncoder,
    pass: Pass,
    g: &Geometry,
    dtype: DType,
    a: &Array,
    b: &Array,
    chosen: Option<Chosen>,
) -> Result<Array> {
    // Non-overlapping patches run as a 1x1 convolution (see patch.rs); explicit tiles (sweeps)
    // run the geometry as given.
    if chosen.is_none() && patch::is_patch(g) {
        return patch::run(enc, pass, g, dtype, a, b);
    }
    let (out_shape, prepared) = prepare(enc, pass, g, a, b)?;
    let Some(Prepared { a, b, key }) = prepared else {
        return Array::empty_on(enc, dtype, &out_shape);
    };
    if runs_widened(enc, &key, chosen)? {
        return widen::run(enc, pass, g, dtype, &a, &b, &out_shape, chosen);
    }
    let out = Array::empty_on(enc, dtype, &out_shape)?;
    let plan = match chosen {
        Some(Chosen::Igemm(t, splits)) => Arc::new(plan::plan_with(enc.device(), key, t, splits)?),
        Some(Chosen::StandIn) => Arc::new(stand_in::plan(enc.device(), &key)?),
        Some(Chosen::Wgmma(tile, splits)) => {
            hopper_can_run(&key)?;
            Arc::new(plan::plan_wgmma(enc.device(), key, tile, splits)?)
        }
        None => match plan::cached(&key) {
            Some(p) => p,
            None if autotune::wanted(&key)? => autotune::plan(enc, key, &a, &b, &out)?,
            None => plan::create(enc.device(), key)?,
        },
    };
    launch(enc, &plan, &a, &b, &out)?;
    Ok(out)
}

/// Launches a gather family's kernel (`conv_depthwise`, `conv_grouped`, `conv_direct`, `conv_stem`): arguments (source, weight or
/// cotangent, out, partial, problem). Forward and backward-data read (source, weight),
/// backward-weight (input, cotangent): the GEMM operands `ab` (cotangent, input) in the other
/// order. It writes `out`, or the f32 partials when the plan splits.
#[allow(clippy::too_many_arguments)]
fn launch_gather<P: Copy + 'static>(
    enc: &mut CommandEncoder,
    plan: &Plan,
    pass: Pass,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    problem: P,
    out: &Array,
    partial: Option<&Array>,
    ab: [&Array; 2],
) -> Result<()> {
    let [a, b] = ab;
    let (src, other) = match pass {
        Pass::BackwardWeight => (b, a),
        _ => (a, b),
    };
    let mut args = KernelArgs::new();
    args.push(src.device_ptr())
        .push(other.device_ptr())
        .push(out.device_ptr())
        .push(partial.map_or(0, |p| p.device_ptr()))
        .push(problem);
    let target = partial.unwrap_or(out);
    // SAFETY: the arguments are the family's (source, weight or cotangent, out, partial,
    // problem); the problem was built from the geometry the operands and the output were
    // checked against (for a split, grid and partial hold one partial a split), and only the
    // target is written.
    unsafe {
        enc.launch(
            &plan.kernel,
            grid,
            block,
            plan.shared,
            args,
            &[a, b],
            &[target],
        )
    }
}

fn launch(enc: &mut CommandEncoder, plan: &Plan, a: &Array, b: &Array, out: &Array) -> Result<()> {
    // A split reduction writes one f32 partial weight gradient per split (a swapped Hopper tile
    // even one unsplit).
    let partial = if plan.split_sum.is_some() {
        Some(Array::empty_on(
            enc,
            DType::F32,
            &[plan.splits * out.size()],
        )?)
    } else {
        None
    };
    let partial_ptr = partial.as_ref().map_or(0, |p| p.device_ptr());
    let target = partial.as_ref().unwrap_or(out);
    match &plan.kind {
        Kind::Igemm(problem) => {
            let mut args = KernelArgs::new();
            args.push(a.device_ptr())
                .push(b.device_ptr())
                .push(out.device_ptr())
                .push(partial_ptr)
                .push(*problem);
            // SAFETY: the arguments are conv_igemm's (a, b, out, partial, problem) in order and
            // type; the problem was built from the geometry a, b and the output were checked
            // against, and the kernel writes only the target (out, or the partial sums when
            // splitting).
            unsafe {
                enc.launch(
                    &plan.kernel,
                    plan.grid,
                    plan.threads,
                    plan.shared,
                    args,
                    &[a, b],
                    &[target],
                )
            }?;
        }
        Kind::Wgmma(launch) => {
            // TF32 takes its shared-memory operand along k: the weight or the cotangent turned
            // round first.
            let turned;
            let (a, b) = if launch.turns_weight() {
                turned = hopper::turned_weight(enc, b)?;
                (a, &turned)
            } else if launch.turns_cotangent() {
                turned = hopper::turned_cotangent(enc, a)?;
                (&turned, b)
            } else {
                (a, b)
            };
            // Backward-data's stride phases write disjoint pixels of `out`, one launch each. The
            // maps hold the operands' addresses: built per call, checked by the driver.
            for (phase, (amap, bmap)) in launch.phases.iter().zip(launch.maps(a, b)?) {
                let mut args = KernelArgs::new();
                args.push(amap)
                    .push(bmap)
                    .push(out.device_ptr())
                    .push(partial_ptr)
                    .push(phase.problem);
                // SAFETY: the arguments are conv_wgmma's (two tensor maps, out, partial, problem);
                // the maps describe a and b as they are, the problem matches the checked geometry,
                // and only the target is written.
                unsafe {
                    enc.launch(
                        &plan.kernel,
                        launch.blocks(phase),
                        plan.threads,
                        plan.shared,
                        args,
                        &[a, b],
                        &[target],
                    )
                }?;
            }
        }
        Kind::Stem(l) => {
            let block = (plan.threads, 1, 1);
            let split = partial.as_ref();
            launch_gather(
                enc,
                plan,
                l.pass,
                l.grid,
                block,
                l.problem,
                out,
                split,
                [a, b],
            )?;
        }
        Kind::Grouped(l) => {
            let block = (32, plan.threads / 32, 1);
            let split = partial.as_ref();
            // Backward-data's stride phases write disjoint pixels of `out`, one launch each.
            for phase in &l.phases {
                launch_gather(
                    enc,
                    plan,
                    l.pass,
                    phase.grid,
                    block,
                    phase.problem,
                    out,
                    split,
                    [a, b],
                )?;
            }
        }
        Kind::Depthwise(l) => {
            let split = partial.as_ref();
            launch_gather(
                enc,
                plan,
                l.pass,
                l.grid,
                l.block,
                l.problem,
                out,
                split,
                [a, b],
            )?;
        }
        Kind::Direct(l) => {
            let split = partial.as_ref();
            launch_gather(
                enc,
                plan,
                l.pass,
                l.grid,
                l.block,
                l.problem,
                out,
                split,
                [a, b],
            )?;
        }
    }
    if let (Some(p), Some(sum)) = (&partial, &plan.split_sum) {
        sum.launch(enc, p, plan.splits, out.size(), &[out])?;
    }
    Ok(())
}
