//! Non-overlapping patch convolutions (a ViT's patch embedding: a 16x16 or 14x14 kernel at its
//! own stride over 3 channels), every pass run as one 1x1 convolution over reshaped operands.
//!
//! Output pixel p of such a convolution reads exactly the input block p x k .. p x k + k, and
//! no two blocks overlap. Lay each block's (taps..., channels) end to end as the channels of one
//! pixel (space-to-depth: X', of shape (N, output spatial..., Kp)), the weight the same way (W',
//! (C_out, 1.., Kp)), and the convolution is the 1x1 convolution of X' with W':
//!
//! - forward: Y = conv(X', W');
//! - backward-data: dX' = conv_backward_data(dY, W'), then depth-to-space into dX, zero where
//!   no patch reaches (the rows and columns past the last whole patch, which the forward never
//!   reads);
//! - backward-weight: dW' = conv_backward_weight(X', dY), reshaped to the weight's shape.
//!
//! The GEMMs' reduction is then Kp contiguous channels instead of runs of C (3 for an RGB
//! image): it loads in 16-byte vectors, and on sm_90 the Hopper family takes it. Kp is
//! K' = taps x C rounded up to a multiple of 8 (the 16-bit vector width, and the Hopper
//! family's requirement); the columns past K' hold zeros in X' and W' (so the forward's
//! products over them vanish) and are dropped from dX' and dW'. 16 x 16 x 3 = 768 needs no
//! padding, 14 x 14 x 3 = 588 gets 4 columns.
//!
//! The rearrangements are views (the input cut to its whole patches, each spatial axis split
//! into (patches, taps), transposed to (N, patches..., taps..., C)) copied by
//! [`copy_into`](crate::runtime::copy::copy_into), one launch each that reads and writes each
//! element once. Work beyond the 1x1 convolution, per pass (X core: the input less its ragged
//! edge, N x patches x K' elements):
//!
//! - forward: X' (one launch, X core read and written; one more to zero the pad columns when
//!   Kp > K') and W' (one launch reading and writing the weight, only when Kp > K');
//! - backward-data: W' as in the forward, then dX (one launch, X core read and written; one
//!   zero launch per spatial axis with a ragged edge);
//! - backward-weight: X' as in the forward, then dW (one launch reading and writing the weight,
//!   only when Kp > K').
//!
//! Where the layouts coincide (Kp = K' and, say, 1-D without a ragged edge, or images that are
//! one patch each) X' and dX are reshapes of X and dX', with no copy.
//!
//! `KILN_CONV_PATH` is honoured by the 1x1 convolutions, which are planned like any other:
//! `igemm` runs them on the `mma.sync` / FMA kernels, `auto` lets the Hopper family take them.
//! The patch rewrite itself is not a kernel family and applies under both. Explicit tiles
//! (`conv::tuning`, benchmark sweeps) run the patch convolution as it is, without the rewrite.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::dtype::DType;
use crate::error::Result;
use crate::runtime::copy::{copy_into, zero_into};
use crate::runtime::{Array, CommandEncoder};

use super::geometry::{ConvParams, Geometry, Pass};

/// Columns of X' and W' are padded to a multiple of this.
pub const COLUMN_MULTIPLE: usize = 8;

/// Whether `g` is a patch convolution that [`conv_forward`](super::conv_forward) and the
/// gradients run as a 1x1 convolution: one group, no flip, strides equal to the kernel's
/// extents, no padding, no dilation, a kernel larger than 1 in some spatial dim, and input
/// channels that are not a multiple of [`COLUMN_MULTIPLE`]. (With such a multiple the GEMM
/// already reads whole 16-byte vectors of channels, and the rewrite would only add a copy of
/// the input.)
pub fn is_patch(g: &Geometry) -> bool {
    g.groups == 1
        && !g.flip
        && g.cin % COLUMN_MULTIPLE != 0
        && g.kernel_size() > 1
        && (0..3).all(|d| {
            g.stride[d] == g.kernel[d]
                && g.pad_lo[d] == 0
                && g.pad_hi[d] == 0
                && g.kernel_dilation[d] == 1
                && g.input_dilation[d] == 1
        })
}

/// K': one patch's elements, taps x input channels.
pub fn patch_len(g: &Geometry) -> usize {
    g.kernel_size() * g.cin
}

/// Kp: the columns of X' and W', K' rounded up to a multiple of [`COLUMN_MULTIPLE`].
pub fn columns(g: &Geometry) -> usize {
    patch_len(g).next_multiple_of(COLUMN_MULTIPLE)
}

/// The 1x1 convolution that runs patch convolution `g`: input X' (N, output spatial..., Kp),
/// weight W' (C_out, 1.., Kp), and `g`'s output.
pub fn inner(g: &Geometry) -> Result<Geometry> {
    let s = g.spatial;
    let kp = columns(g);
    let mut x = vec![g.batch];
    x.extend_from_slice(&g.output[3 - s..]);
    x.push(kp);
    let mut w = vec![g.cout];
    w.resize(1 + s, 1);
    w.push(kp);
    Geometry::new(&x, &w, &ConvParams::default())
}

static TAKEN: AtomicU64 = AtomicU64::new(0);

/// Passes this process has run through the rewrite, for tests that check it is taken.
pub fn taken() -> u64 {
    TAKEN.load(Ordering::Relaxed)
}

/// Runs `pass` of patch convolution `g` (see [`is_patch`]) as a 1x1 convolution. `a` and `b`
/// are the GEMM operands as `conv::run` takes them: forward (input, weight), backward-data
/// (cotangent, weight), backward-weight (cotangent, input).
pub(super) fn run(
    enc: &mut CommandEncoder,
    pass: Pass,
    g: &Geometry,
    dtype: DType,
    a: &Array,
    b: &Array,
) -> Result<Array> {
    // The views below rely on the operands' shapes.
    super::check_operands(pass, g, a, b)?;
    let one = inner(g)?;
    TAKEN.fetch_add(1, Ordering::Relaxed);
    match pass {
        Pass::Forward => {
            let xp = space_to_depth(enc, g, &one, a)?;
            let wp = weight_rows(enc, g, &one, b)?;
            super::run(enc, pass, &one, dtype, &xp, &wp, None)
        }
        Pass::BackwardData => {
            let wp = weight_rows(enc, g, &one, b)?;
            let dxp = super::run(enc, pass, &one, dtype, a, &wp, None)?;
            depth_to_space(enc, g, &dxp)
        }
        Pass::BackwardWeight => {
            let xp = space_to_depth(enc, g, &one, b)?;
            let dwp = super::run(enc, pass, &one, dtype, a, &xp, None)?;
            weight_from_rows(enc, g, &dwp)
        }
    }
}

/// The view operations the rearrangements take, so that the unit tests can run the same code
/// on host layouts.
trait View: Sized {
    fn rank(&self) -> usize;
    fn cut(&self, axis: usize, start: usize, stop: usize) -> Result<Self>;
    fn split(&self, axis: usize, parts: &[usize]) -> Result<Self>;
    fn permute(&self, perm: &[usize]) -> Result<Self>;
}

impl View for Array {
    fn rank(&self) -> usize {
        self.ndim()
    }
    fn cut(&self, axis: usize, start: usize, stop: usize) -> Result<Self> {
        self.slice(axis, start, stop, 1)
    }
    fn split(&self, axis: usize, parts: &[usize]) -> Result<Self> {
        self.split_axis(axis, parts)
    }
    fn permute(&self, perm: &[usize]) -> Result<Self> {
        self.transpose(perm)
    }
}

/// An input-shaped array (N, spatial..., C) as its whole patches, (N, patches..., taps..., C).
fn blocks<V: View>(x: &V, g: &Geometry) -> Result<V> {
    let s = g.spatial;
    let (p, k) = (&g.output[3 - s..], &g.kernel[3 - s..]);
    let mut v = x.cut(1, 0, p[0] * k[0])?;
    for i in 1..s {
        v = v.cut(1 + i, 0, p[i] * k[i])?;
    }
    // Last axis first, so that the earlier ones keep their indices: (N, P0, k0, P1, k1, .., C).
    for i in (0..s).rev() {
        v = v.split(1 + i, &[p[i], k[i]])?;
    }
    let mut perm = vec![0];
    perm.extend((0..s).map(|i| 1 + 2 * i));
    perm.extend((0..s).map(|i| 2 + 2 * i));
    perm.push(1 + 2 * s);
    v.permute(&perm)
}

/// An array whose last axis holds Kp columns, its first K' as (taps..., C).
fn rows<V: View>(xp: &V, g: &Geometry) -> Result<V> {
    let last = xp.rank() - 1;
    let mut parts = g.kernel[3 - g.spatial..].to_vec();
    parts.push(g.cin);
    xp.cut(last, 0, patch_len(g))?.split(last, &parts)
}

/// X' (see the module's docs) of input `x`.
fn space_to_depth(
    enc: &mut CommandEncoder,
    g: &Geometry,
    one: &Geometry,
    x: &Array,
) -> Result<Array> {
    let src = blocks(x, g)?;
    let shape = one.input_shape();
    let (kp, k) = (columns(g), patch_len(g));
    if kp == k && src.is_contiguous() {
        return src.reshape(&shape);
    }
    let xp = Array::empty_on(enc, x.dtype(), &shape)?;
    copy_into(enc, &src, &rows(&xp, g)?)?;
    if kp > k {
        zero_into(enc, &xp.slice(shape.len() - 1, k, kp, 1)?)?;
    }
    Ok(xp)
}

/// dX from dX' (contiguous): each row's first K' columns back to their patch, zeros past the
/// last whole patch.
fn depth_to_space(enc: &mut CommandEncoder, g: &Geometry, dxp: &Array) -> Result<Array> {
    let s = g.spatial;
    let shape = g.input_shape();
    let ragged = (3 - s..3).any(|d| g.input[d] != g.output[d] * g.kernel[d]);
    if !ragged && columns(g) == patch_len(g) {
        let same = dxp.reshape(&shape)?;
        if blocks(&same, g)?.is_contiguous() {
            return Ok(same);
        }
    }
    let dx = Array::empty_on(enc, dxp.dtype(), &shape)?;
    copy_into(enc, &rows(dxp, g)?, &blocks(&dx, g)?)?;
    // The ragged edge, axis by axis: past the whole patches along axis i, within them along
    // the axes before it (so that no element is written twice).
    let mut core = dx.clone();
    for i in 0..s {
        let d = 3 - s + i;
        let whole = g.output[d] * g.kernel[d];
        if g.input[d] > whole {
            zero_into(enc, &core.slice(1 + i, whole, g.input[d], 1)?)?;
        }
        core = core.slice(1 + i, 0, whole, 1)?;
    }
    Ok(dx)
}

/// W': the weight's rows, each (taps..., C) then zeros up to Kp.
fn weight_rows(enc: &mut CommandEncoder, g: &Geometry, one: &Geometry, w: &Array) -> Result<Array> {
    let shape = one.weight_shape();
    let w = w.contiguous(enc)?;
    let (kp, k) = (columns(g), patch_len(g));
    if kp == k {
        return w.reshape(&shape);
    }
    let wp = Array::empty_on(enc, w.dtype(), &shape)?;
    let mut unpadded = shape.clone();
    unpadded[shape.len() - 1] = k;
    // The source's rows are K' long, the destination's Kp: copy_into pads them with zeros.
    copy_into(enc, &w.reshape(&unpadded)?, &wp)?;
    Ok(wp)
}

/// dW from dW' (contiguous): the first K' columns of each row, in the weight's shape.
fn weight_from_rows(enc: &mut CommandEncoder, g: &Geometry, dwp: &Array) -> Result<Array> {
    let shape = g.weight_shape();
    let (kp, k) = (columns(g), patch_len(g));
    if kp == k {
        return dwp.reshape(&shape);
    }
    let dw = Array::empty_on(enc, dwp.dtype(), &shape)?;
    copy_into(enc, &rows(&dwp.reshape(&[g.cout, kp])?, g)?, &dw)?;
    Ok(dw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::conv::reference;
    use crate::runtime::array::{contiguous_strides, split_layout};

    fn geometry(x: &[usize], w: &[usize], p: ConvParams) -> Geometry {
        Geometry::new(x, w, &p).unwrap()
    }

    fn strided(k: &[usize]) -> ConvParams {
        ConvParams::default().strides(k)
    }

    #[test]
    fn patches_are_recognised() {
        let yes = [
            // ViT-B/16 and /14 (ragged: 230 = 16 x 14 + 6), 1-D, 3-D, and a kernel of 1 in
            // one dim (stride 1 there).
            geometry(&[2, 224, 224, 3], &[768, 16, 16, 3], strided(&[16])),
            geometry(&[2, 230, 229, 3], &[32, 14, 14, 3], strided(&[14])),
            geometry(&[2, 9, 8, 4], &[8, 2, 2, 4], strided(&[2])),
            geometry(&[3, 19, 6], &[8, 4, 6], strided(&[4])),
            geometry(&[2, 4, 9, 8, 3], &[8, 2, 4, 4, 3], strided(&[2, 4, 4])),
            geometry(&[1, 3, 9, 9, 3], &[8, 1, 3, 3, 3], strided(&[1, 3, 3])),
            // The input is one patch; padding_hi and strides given per dim as zeros and kernels.
            geometry(
                &[1, 4, 4, 3],
                &[8, 4, 4, 3],
                strided(&[4, 4]).padding_hi(&[0, 0]),
            ),
        ];
        for g in &yes {
            assert!(is_patch(g), "{g:?}");
        }
        let p16 = || strided(&[16]);
        let x = [2, 64, 64, 3];
        let w = [8, 16, 16, 3];
        let no = [
            geometry(&x, &w, ConvParams::default()),
            geometry(&x, &w, strided(&[8])),
            geometry(&x, &w, strided(&[32])),
            geometry(&x, &w, strided(&[16, 8])),
            geometry(&x, &w, p16().padding(&[1])),
            geometry(&x, &w, p16().padding_hi(&[0, 2])),
            geometry(&x, &w, p16().padding_lo(&[2, 0])),
            geometry(&x, &w, p16().flip(true)),
            geometry(&x, &w, p16().kernel_dilation(&[2])),
            geometry(&x, &w, p16().input_dilation(&[2])),
            geometry(&[2, 64, 64, 6], &w, p16().groups(2)),
            // 1x1 (also strided): already a plain GEMM.
            geometry(&[2, 8, 8, 16], &[8, 1, 1, 16], ConvParams::default()),
            geometry(&[2, 8, 8, 16], &[8, 1, 1, 16], strided(&[1])),
            geometry(&[2, 8, 8, 16], &[8, 1, 1, 16], strided(&[2])),
            geometry(&[2, 9, 3], &[8, 1, 3], ConvParams::default()),
            // 16 channels: whole vectors already (a ConvNeXt-style downsampling).
            geometry(&[2, 8, 8, 16], &[8, 2, 2, 16], strided(&[2])),
        ];
        for g in &no {
            assert!(!is_patch(g), "{g:?}");
        }
    }

    #[test]
    fn the_inner_convolution_is_1x1_over_padded_columns() {
        let g = geometry(&[2, 224, 224, 3], &[768, 16, 16, 3], strided(&[16]));
        let one = inner(&g).unwrap();
        assert_eq!((patch_len(&g), columns(&g)), (768, 768));
        assert_eq!(one.input_shape(), vec![2, 14, 14, 768]);
        assert_eq!(one.weight_shape(), vec![768, 1, 1, 768]);
        assert_eq!(one.output_shape(), g.output_shape());
        assert_eq!(one.macs(), g.macs());
        assert!(!is_patch(&one));
        let g = geometry(&[2, 230, 229, 3], &[32, 14, 14, 3], strided(&[14]));
        let one = inner(&g).unwrap();
        assert_eq!((patch_len(&g), columns(&g)), (588, 592));
        assert_eq!(one.input_shape(), vec![2, 16, 16, 592]);
        assert_eq!(one.output_shape(), g.output_shape());
        let g = geometry(&[3, 19, 5], &[8, 3, 5], strided(&[3]));
        assert_eq!(inner(&g).unwrap().weight_shape(), vec![8, 1, 16]);
        let g = geometry(&[2, 4, 9, 8, 3], &[8, 2, 4, 4, 3], strided(&[2, 4, 4]));
        let one = inner(&g).unwrap();
        assert_eq!(one.input_shape(), vec![2, 2, 2, 2, 96]);
        assert_eq!(one.weight_shape(), vec![8, 1, 1, 1, 96]);
    }

    /// A host layout with Array's view semantics.
    #[derive(Clone, Debug)]
    struct Host {
        shape: Vec<usize>,
        strides: Vec<isize>,
        offset: usize,
    }

    impl Host {
        fn new(shape: &[usize]) -> Host {
            Host {
                shape: shape.to_vec(),
                strides: contiguous_strides(shape),
                offset: 0,
            }
        }

        /// The offset of every element, in row-major order of the view.
        fn offsets(&self) -> Vec<usize> {
            let mut out = vec![self.offset as isize];
            for (&n, &s) in self.shape.iter().zip(&self.strides) {
                out = out
                    .iter()
                    .flat_map(|&o| (0..n).map(move |i| o + i as isize * s))
                    .collect();
            }
            out.into_iter().map(|o| o as usize).collect()
        }
    }

    impl View for Host {
        fn rank(&self) -> usize {
            self.shape.len()
        }
        fn cut(&self, axis: usize, start: usize, stop: usize) -> Result<Self> {
            let mut v = self.clone();
            v.shape[axis] = stop.min(self.shape[axis]) - start;
            v.offset += start * self.strides[axis] as usize;
            Ok(v)
        }
        fn split(&self, axis: usize, parts: &[usize]) -> Result<Self> {
            let (shape, strides) = split_layout(&self.shape, &self.strides, axis, parts)?;
            Ok(Host {
                shape,
                strides,
                offset: self.offset,
            })
        }
        fn permute(&self, perm: &[usize]) -> Result<Self> {
            Ok(Host {
                shape: perm.iter().map(|&p| self.shape[p]).collect(),
                strides: perm.iter().map(|&p| self.strides[p]).collect(),
                offset: self.offset,
            })
        }
    }

    /// copy_into on the host: `dst`'s elements get `src`'s, element for element.
    fn copy(src: &[f64], from: &Host, dst: &mut [f64], to: &Host) {
        assert_eq!(from.shape, to.shape);
        for (f, t) in from.offsets().into_iter().zip(to.offsets()) {
            dst[t] = src[f];
        }
    }

    fn values(n: usize, seed: usize) -> Vec<f64> {
        (0..n)
            .map(|i| ((i * 7919 + seed * 104729) % 17) as f64 - 8.0)
            .collect()
    }

    /// The three passes through the rewrite (the views as the GPU path builds them, copied and
    /// multiplied on the host) equal the reference, ragged edges and pad columns included.
    #[test]
    fn the_rewrite_matches_the_reference_on_the_host() {
        let cases = [
            geometry(&[2, 11, 3], &[4, 5, 3], strided(&[5])),
            geometry(&[2, 12, 5], &[3, 4, 5], strided(&[4])),
            geometry(&[2, 9, 8, 4], &[5, 2, 2, 4], strided(&[2])),
            geometry(&[2, 16, 17, 3], &[4, 7, 5, 3], strided(&[7, 5])),
            geometry(&[1, 5, 9, 8, 3], &[3, 2, 4, 4, 3], strided(&[2, 4, 4])),
            geometry(&[2, 3, 7, 6, 2], &[3, 1, 3, 3, 2], strided(&[1, 3, 3])),
        ];
        for g in &cases {
            assert!(is_patch(g), "{g:?}");
            let one = inner(g).unwrap();
            let (kp, m) = (columns(g), g.batch * g.output_pixels());
            let count = |s: &[usize]| s.iter().product::<usize>();
            let x = values(count(&g.input_shape()), 1);
            let w = values(count(&g.weight_shape()), 2);
            let dy = values(count(&g.output_shape()), 3);
            // X' and W', zeros past K'.
            let mut xp = vec![0.0; m * kp];
            let to = rows(&Host::new(&one.input_shape()), g).unwrap();
            copy(
                &x,
                &blocks(&Host::new(&g.input_shape()), g).unwrap(),
                &mut xp,
                &to,
            );
            let mut wp = vec![0.0; g.cout * kp];
            let to = rows(&Host::new(&[g.cout, kp]), g).unwrap();
            let from = Host::new(&to.shape);
            copy(&w, &from, &mut wp, &to);
            let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
            let row = |v: &[f64], r: usize| v[r * kp..(r + 1) * kp].to_vec();
            // Forward: y[m, co] = X'[m] . W'[co].
            let y: Vec<f64> = (0..m)
                .flat_map(|r| (0..g.cout).map(move |co| (r, co)))
                .map(|(r, co)| dot(&row(&xp, r), &row(&wp, co)))
                .collect();
            assert_eq!(y, reference::forward(g, &x, &w).values, "{g:?}");
            // Backward-data: dX'[m, j] = sum over co of dy[m, co] W'[co, j], then depth-to-space.
            let mut dxp = vec![0.0; m * kp];
            for r in 0..m {
                for co in 0..g.cout {
                    for j in 0..kp {
                        dxp[r * kp + j] += dy[r * g.cout + co] * wp[co * kp + j];
                    }
                }
            }
            let mut dx = vec![0.0; count(&g.input_shape())];
            let from = rows(&Host::new(&one.input_shape()), g).unwrap();
            copy(
                &dxp,
                &from,
                &mut dx,
                &blocks(&Host::new(&g.input_shape()), g).unwrap(),
            );
            assert_eq!(dx, reference::backward_data(g, &dy, &w).values, "{g:?}");
            // Backward-weight: dW'[co, j] = sum over m of dy[m, co] X'[m, j], then its rows.
            let mut dwp = vec![0.0; g.cout * kp];
            for r in 0..m {
                for co in 0..g.cout {
                    for j in 0..kp {
                        dwp[co * kp + j] += dy[r * g.cout + co] * xp[r * kp + j];
                    }
                }
            }
            let from = rows(&Host::new(&[g.cout, kp]), g).unwrap();
            let mut dw = vec![0.0; count(&g.weight_shape())];
            let to = Host::new(&from.shape);
            copy(&dwp, &from, &mut dw, &to);
            assert_eq!(dw, reference::backward_weight(g, &x, &dy).values, "{g:?}");
        }
    }
}
