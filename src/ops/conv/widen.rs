//! Convolutions that `conv_igemm` runs but whose operands do not load in 16-byte vectors, run as
//! the same convolution over channels padded with zeros to whole vectors.
//!
//! `conv_igemm` reads each GEMM operand in vectors along a run of channels (a group's input or
//! output channels), so each run must be a multiple of the vector width (8 16-bit elements or 4
//! f32: 16 bytes) and each operand must start on a 16-byte boundary. Where a layer misses either
//! and no other family takes it (a 255-channel detection head, three-channel groups, an
//! operand that is a view at an odd offset), its pass runs on copies whose runs are padded with
//! zeros to the next multiple of the width:
//!
//! - forward: the input channels of the input and the weight (the reduction's run);
//! - backward-data: the output channels of the cotangent and the weight (the reduction's run),
//!   and the weight's input channels, whose columns are then dropped from dX;
//! - backward-weight: the cotangent's output channels and the input's channels, whose rows and
//!   columns are then dropped from dW.
//!
//! A padded channel holds zeros in both operands wherever the reduction meets it, and a padded
//! row or column of the result is dropped, so the result is the convolution's. Each copy is one
//! `copy_into` launch, which reads and writes its tensor once and writes the zeros where the
//! destination's rows are longer; an operand whose runs are whole and whose base is aligned is
//! used as it is. The padded convolution is planned like any other (on sm_90 the Hopper family
//! may take it). So `conv_igemm` has one variant a tile, pass and dtype: loading element by
//! element took as many variants again, which compile to about twice the code. Only its
//! stand-ins (`stand_in`), which run any key on a cold start, still load so.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::dtype::DType;
use crate::error::Result;
use crate::runtime::copy::copy_into;
use crate::runtime::{Array, CommandEncoder};

use super::geometry::{Geometry, Pass};
use super::plan::PlanKey;
use super::Chosen;

/// The geometry `pass` of `g` runs as: each channel run the pass reads padded to a multiple of
/// the vector width. The forward's output channels are the output's, not a run it reads.
pub fn geometry(dtype: DType, pass: Pass, g: &Geometry) -> Geometry {
    let width = dtype.vec_width();
    let (cin_g, cout_g) = (g.cin / g.groups, g.cout / g.groups);
    let cout_g = match pass {
        Pass::Forward => cout_g,
        _ => cout_g.next_multiple_of(width),
    };
    Geometry {
        cin: cin_g.next_multiple_of(width) * g.groups,
        cout: cout_g * g.groups,
        ..*g
    }
}

/// The plan key of `key`'s widened convolution: its geometry, with operands that load in
/// vectors (fresh copies, or the operands as they were where they already could).
pub fn key(key: &PlanKey) -> PlanKey {
    PlanKey {
        geometry: geometry(key.dtype, key.pass, &key.geometry),
        vec_a: true,
        vec_b: true,
        aligned: true,
        ..*key
    }
}

/// How one tensor of a pass maps onto its widened tensor: both viewed with one axis a channel
/// run (`from` and `to`, `to` no smaller along any axis), and the widened tensor's shape.
#[derive(Debug, PartialEq)]
struct Padding {
    from: Vec<usize>,
    to: Vec<usize>,
    shape: Vec<usize>,
}

/// An activation of `g` (the input's layout when `input`, else the output's) as (pixels,
/// groups, channels a group), and its widened form in `wide`.
fn activation(g: &Geometry, wide: &Geometry, input: bool) -> Padding {
    let (shape, pixels, c, cw) = if input {
        (wide.input_shape(), g.input_pixels(), g.cin, wide.cin)
    } else {
        (wide.output_shape(), g.output_pixels(), g.cout, wide.cout)
    };
    let rows = g.batch * pixels;
    Padding {
        from: vec![rows, g.groups, c / g.groups],
        to: vec![rows, g.groups, cw / g.groups],
        shape,
    }
}

/// The weight of `g` as (groups, output channels a group, taps, input channels a group), and
/// its widened form in `wide`.
fn weight(g: &Geometry, wide: &Geometry) -> Padding {
    let (groups, taps) = (g.groups, g.kernel_size());
    Padding {
        from: vec![groups, g.cout / groups, taps, g.cin / groups],
        to: vec![groups, wide.cout / groups, taps, wide.cin / groups],
        shape: wide.weight_shape(),
    }
}

/// The paddings of `pass`'s GEMM operands (see `conv::run`) and of its result, in that order.
fn paddings(pass: Pass, g: &Geometry, wide: &Geometry) -> [Padding; 3] {
    match pass {
        Pass::Forward => [
            activation(g, wide, true),
            weight(g, wide),
            activation(g, wide, false),
        ],
        Pass::BackwardData => [
            activation(g, wide, false),
            weight(g, wide),
            activation(g, wide, true),
        ],
        Pass::BackwardWeight => [
            activation(g, wide, false),
            activation(g, wide, true),
            weight(g, wide),
        ],
    }
}

/// `src` (contiguous) written into the corner of a new zeroed array of the widened shape; or
/// `src` itself where nothing is padded and its base allows vector loads.
fn pad(enc: &mut CommandEncoder, src: &Array, p: &Padding) -> Result<Array> {
    if p.from == p.to && super::aligned(src) {
        return Ok(src.clone());
    }
    let dst = Array::empty_on(enc, src.dtype(), &p.shape)?;
    copy_into(enc, &src.reshape(&p.from)?, &dst.reshape(&p.to)?)?;
    Ok(dst)
}

/// The result's own elements out of `wide` (contiguous, of the widened shape): the corner
/// `p.from` of `p.to`, as an array of `shape`.
fn narrow(enc: &mut CommandEncoder, wide: &Array, p: &Padding, shape: &[usize]) -> Result<Array> {
    if p.from == p.to {
        return Ok(wide.clone());
    }
    let mut corner = wide.reshape(&p.to)?;
    for (axis, (&keep, &all)) in p.from.iter().zip(&p.to).enumerate() {
        if keep < all {
            corner = corner.slice(axis, 0, keep, 1)?;
        }
    }
    let out = Array::empty_on(enc, wide.dtype(), shape)?;
    copy_into(enc, &corner, &out.reshape(&p.from)?)?;
    Ok(out)
}

static TAKEN: AtomicU64 = AtomicU64::new(0);

/// Passes this process has run widened, for tests that check it is taken.
pub fn taken() -> u64 {
    TAKEN.load(Ordering::Relaxed)
}

/// Runs `pass` of `g` widened. `a` and `b` are the GEMM operands as `conv::run` takes them,
/// contiguous and of `g`'s shapes; `out_shape`, the result's; `chosen`, an explicit
/// `conv_igemm` tile, if any.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    enc: &mut CommandEncoder,
    pass: Pass,
    g: &Geometry,
    dtype: DType,
    a: &Array,
    b: &Array,
    out_shape: &[usize],
    chosen: Option<Chosen>,
) -> Result<Array> {
    TAKEN.fetch_add(1, Ordering::Relaxed);
    let wide = geometry(dtype, pass, g);
    let [pa, pb, pout] = paddings(pass, g, &wide);
    let a = pad(enc, a, &pa)?;
    let b = pad(enc, b, &pb)?;
    let out = super::run(enc, pass, &wide, dtype, &a, &b, chosen)?;
    narrow(enc, &out, &pout, out_shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::conv::geometry::ConvParams;
    use crate::ops::conv::reference;

    fn geometry_of(x: &[usize], w: &[usize], p: ConvParams) -> Geometry {
        Geometry::new(x, w, &p).unwrap()
    }

    /// Row-major offsets of the corner `inner` of an array of extents `outer`.
    fn corner(inner: &[usize], outer: &[usize]) -> Vec<usize> {
        let mut out = vec![0];
        for (&n, &m) in inner.iter().zip(outer) {
            out = out
                .iter()
                .flat_map(|&o| (0..n).map(move |i| o * m + i))
                .collect();
        }
        out
    }

    /// `pad` on the host: `v` in the corner of zeros.
    fn pad_host(v: &[f64], p: &Padding) -> Vec<f64> {
        let mut out = vec![0.0; p.to.iter().product()];
        for (i, o) in corner(&p.from, &p.to).into_iter().enumerate() {
            out[o] = v[i];
        }
        out
    }

    /// `narrow` on the host: the corner of `v`.
    fn narrow_host(v: &[f64], p: &Padding) -> Vec<f64> {
        corner(&p.from, &p.to).into_iter().map(|o| v[o]).collect()
    }

    fn values(n: usize, seed: usize) -> Vec<f64> {
        (0..n)
            .map(|i| ((i * 7919 + seed * 104729) % 17) as f64 - 8.0)
            .collect()
    }

    #[test]
    fn only_the_runs_each_pass_reads_are_padded() {
        let g = geometry_of(
            &[2, 5, 6, 6],
            &[9, 3, 3, 2],
            ConvParams::default().groups(3),
        );
        let f = geometry(DType::F16, Pass::Forward, &g);
        assert_eq!((f.cin, f.cout), (24, 9));
        for pass in [Pass::BackwardData, Pass::BackwardWeight] {
            let w = geometry(DType::BF16, pass, &g);
            assert_eq!((w.cin, w.cout), (24, 24), "{}", pass.name());
            assert_eq!(w.output, g.output);
        }
        // f32 vectors hold 4; runs that are whole already stay.
        let g = geometry_of(&[1, 4, 4, 8], &[255, 1, 1, 8], ConvParams::default());
        let b = geometry(DType::F32, Pass::BackwardData, &g);
        assert_eq!((b.cin, b.cout), (8, 256));
        let f = geometry(DType::F32, Pass::Forward, &g);
        assert_eq!((f.cin, f.cout), (8, 255));
    }

    #[test]
    fn the_widened_key_loads_in_vectors() {
        let p = ConvParams::default().padding(&[1]);
        let k = PlanKey {
            vec_a: false,
            aligned: false,
            ..super::super::plan::test_key(
                DType::F16,
                Pass::BackwardWeight,
                &[2, 6, 7, 5],
                &[7, 3, 3, 5],
                &p,
            )
        };
        let w = key(&k);
        assert!(w.vectors() && w.aligned);
        assert_eq!((w.geometry.cin, w.geometry.cout), (8, 8));
        let (va, vb) = super::super::plan::channel_vectors(w.dtype, w.pass, &w.geometry);
        assert!(va && vb);
    }

    /// Every pass through the rewrite (its paddings applied on the host, the widened convolution
    /// by the f64 reference) equals the reference of the layer as given: groups, odd channels on
    /// either side, 1-D to 3-D, strides, dilations and flip.
    #[test]
    fn the_rewrite_matches_the_reference_on_the_host() {
        let d = ConvParams::default;
        let cases = [
            geometry_of(&[2, 6, 7, 5], &[7, 3, 3, 5], d().padding(&[1])),
            geometry_of(&[1, 7, 6, 12], &[6, 2, 3, 4], d().groups(3)),
            geometry_of(&[2, 9, 10, 6], &[10, 3, 2, 3], d().groups(2).flip(true)),
            geometry_of(&[3, 11, 3], &[255, 3, 3], d().strides(&[2]).padding(&[1])),
            geometry_of(
                &[1, 4, 5, 6, 3],
                &[5, 2, 3, 2, 3],
                d().kernel_dilation(&[1, 2, 1]),
            ),
            geometry_of(&[2, 5, 6, 8], &[4, 3, 3, 8], d().input_dilation(&[2])),
        ];
        for g in &cases {
            let count = |s: &[usize]| s.iter().product::<usize>();
            let x = values(count(&g.input_shape()), 1);
            let w = values(count(&g.weight_shape()), 2);
            let dy = values(count(&g.output_shape()), 3);
            for dtype in [DType::F32, DType::F16] {
                for pass in Pass::ALL {
                    let wide = geometry(dtype, pass, g);
                    let [pa, pb, pout] = paddings(pass, g, &wide);
                    for p in [&pa, &pb, &pout] {
                        assert_eq!(count(&p.to), count(&p.shape), "{p:?}");
                    }
                    let (a, b) = (pad_host, pad_host);
                    let (got, want) = match pass {
                        Pass::Forward => (
                            reference::forward(&wide, &a(&x, &pa), &b(&w, &pb)),
                            reference::forward(g, &x, &w),
                        ),
                        Pass::BackwardData => (
                            reference::backward_data(&wide, &a(&dy, &pa), &b(&w, &pb)),
                            reference::backward_data(g, &dy, &w),
                        ),
                        Pass::BackwardWeight => (
                            reference::backward_weight(&wide, &b(&x, &pb), &a(&dy, &pa)),
                            reference::backward_weight(g, &x, &dy),
                        ),
                    };
                    assert_eq!(
                        narrow_host(&got.values, &pout),
                        want.values,
                        "{dtype} {} {g:?}",
                        pass.name()
                    );
                }
            }
        }
    }
}
