//! A convolution's shapes and parameters: MLX's `conv_general` arguments, their checks, and the
//! normal form the kernels take (always three spatial dims, leading ones of extent 1).

use crate::error::{Error, Result};
use crate::runtime::divider::divider;

/// The most spatial dimensions a convolution has.
pub const MAX_SPATIAL: usize = 3;

/// MLX's `conv_general` parameters, less the arrays. Each per-dimension list has one entry per
/// spatial dimension, or a single entry used for all of them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConvParams {
    /// Output step in input positions, per spatial dim (at least 1).
    pub strides: Vec<usize>,
    /// Zeros added before the (dilated) input, per spatial dim.
    pub padding_lo: Vec<usize>,
    /// Zeros added after the (dilated) input, per spatial dim.
    pub padding_hi: Vec<usize>,
    /// Distance between the kernel's taps, per spatial dim (1: adjacent).
    pub kernel_dilation: Vec<usize>,
    /// Distance between input elements, per spatial dim: `d` puts `d - 1` zeros between
    /// neighbours (1: none).
    pub input_dilation: Vec<usize>,
    /// Channel groups: input and output channels are split into this many groups, each
    /// convolved with its own slice of the weight (at least 1; divides both channel counts).
    pub groups: usize,
    /// Convolution proper (the kernel flipped along every spatial dim) instead of
    /// cross-correlation.
    pub flip: bool,
}

impl Default for ConvParams {
    /// Stride 1, no padding, no dilation, one group, cross-correlation.
    fn default() -> Self {
        ConvParams {
            strides: vec![1],
            padding_lo: vec![0],
            padding_hi: vec![0],
            kernel_dilation: vec![1],
            input_dilation: vec![1],
            groups: 1,
            flip: false,
        }
    }
}

impl ConvParams {
    /// These [`strides`](ConvParams::strides) (builder style, as the other setters).
    pub fn strides(mut self, v: &[usize]) -> Self {
        self.strides = v.to_vec();
        self
    }
    /// The same padding before and after.
    pub fn padding(mut self, v: &[usize]) -> Self {
        self.padding_lo = v.to_vec();
        self.padding_hi = v.to_vec();
        self
    }
    /// Padding before only.
    pub fn padding_lo(mut self, v: &[usize]) -> Self {
        self.padding_lo = v.to_vec();
        self
    }
    /// Padding after only.
    pub fn padding_hi(mut self, v: &[usize]) -> Self {
        self.padding_hi = v.to_vec();
        self
    }
    /// This [`kernel_dilation`](ConvParams::kernel_dilation).
    pub fn kernel_dilation(mut self, v: &[usize]) -> Self {
        self.kernel_dilation = v.to_vec();
        self
    }
    /// This [`input_dilation`](ConvParams::input_dilation).
    pub fn input_dilation(mut self, v: &[usize]) -> Self {
        self.input_dilation = v.to_vec();
        self
    }
    /// This many [`groups`](ConvParams::groups).
    pub fn groups(mut self, groups: usize) -> Self {
        self.groups = groups;
        self
    }
    /// Convolution proper (true) or cross-correlation (false, the default).
    pub fn flip(mut self, flip: bool) -> Self {
        self.flip = flip;
        self
    }
}

fn bad(arg: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument {
        arg,
        reason: reason.into(),
    }
}

/// A validated convolution in normal form: spatial extents are `[d, h, w]`, with the dims the
/// convolution lacks set to 1 (stride 1, no padding, no dilation) at the front.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    /// Spatial dims of the caller's arrays (1 to 3).
    pub spatial: usize,
    /// Images in the batch (N).
    pub batch: usize,
    /// The input's spatial extents.
    pub input: [usize; 3],
    /// The output's spatial extents.
    pub output: [usize; 3],
    /// The weight's spatial extents.
    pub kernel: [usize; 3],
    /// See [`ConvParams::strides`].
    pub stride: [usize; 3],
    /// See [`ConvParams::padding_lo`].
    pub pad_lo: [usize; 3],
    /// See [`ConvParams::padding_hi`].
    pub pad_hi: [usize; 3],
    /// See [`ConvParams::kernel_dilation`].
    pub kernel_dilation: [usize; 3],
    /// See [`ConvParams::input_dilation`].
    pub input_dilation: [usize; 3],
    /// Input channels, over all groups.
    pub cin: usize,
    /// Output channels, over all groups.
    pub cout: usize,
    /// See [`ConvParams::groups`].
    pub groups: usize,
    /// See [`ConvParams::flip`].
    pub flip: bool,
}

/// One value per spatial dim from a list of 1 or `spatial` entries, at the back of a 3-array
/// whose unused front holds `fill`.
fn per_dim(
    arg: &'static str,
    v: &[usize],
    spatial: usize,
    fill: usize,
    min: usize,
) -> Result<[usize; 3]> {
    if v.len() != 1 && v.len() != spatial {
        return Err(bad(
            arg,
            format!(
                "needs 1 or {spatial} entries (one per spatial dim), got {}",
                v.len()
            ),
        ));
    }
    let mut out = [fill; 3];
    for i in 0..spatial {
        let x = if v.len() == 1 { v[0] } else { v[i] };
        if x < min {
            return Err(bad(arg, format!("must be at least {min}, got {v:?}")));
        }
        if x > INDEX_LIMIT {
            return Err(bad(
                arg,
                format!("{x} exceeds kiln's 32-bit indexing ({INDEX_LIMIT})"),
            ));
        }
        out[3 - spatial + i] = x;
    }
    Ok(out)
}

/// Extents that the kernels index with 32-bit integers.
const INDEX_LIMIT: usize = i32::MAX as usize;

/// An error naming `arg` unless the extents of `shape`, an empty one counting as 1, multiply to
/// at most [`INDEX_LIMIT`]. That bounds every extent, and every product of some of them (pixels,
/// taps, the elements), which the kernels take as 32-bit ints, even where another extent is 0.
fn check_extents(arg: &'static str, shape: &[usize]) -> Result<()> {
    let product = shape
        .iter()
        .try_fold(1usize, |acc, &n| acc.checked_mul(n.max(1)));
    if product.map_or(true, |n| n > INDEX_LIMIT) {
        return Err(bad(
            arg,
            format!(
                "shape {shape:?} exceeds kiln's 32-bit indexing: its extents (an empty one \
                 counting as 1) multiply to more than {INDEX_LIMIT}"
            ),
        ));
    }
    Ok(())
}

impl Geometry {
    /// Checks the forward convolution of `input` (N, spatial..., C_in) with `weight`
    /// (C_out, spatial..., C_in / groups) and works out the output.
    pub fn new(input: &[usize], weight: &[usize], p: &ConvParams) -> Result<Geometry> {
        let rank = input.len();
        if !(3..=2 + MAX_SPATIAL).contains(&rank) {
            return Err(bad(
                "input",
                format!(
                    "needs rank 3 to 5 (batch, 1-3 spatial dims, channels), got shape {input:?}"
                ),
            ));
        }
        if weight.len() != rank {
            return Err(bad(
                "weight",
                format!("needs the input's rank {rank}, got shape {weight:?}"),
            ));
        }
        let spatial = rank - 2;
        let stride = per_dim("strides", &p.strides, spatial, 1, 1)?;
        let pad_lo = per_dim("padding_lo", &p.padding_lo, spatial, 0, 0)?;
        let pad_hi = per_dim("padding_hi", &p.padding_hi, spatial, 0, 0)?;
        let kernel_dilation = per_dim("kernel_dilation", &p.kernel_dilation, spatial, 1, 1)?;
        let input_dilation = per_dim("input_dilation", &p.input_dilation, spatial, 1, 1)?;
        let groups = p.groups;
        let (cin, cout) = (input[rank - 1], weight[0]);
        if groups == 0 {
            return Err(bad("groups", "must be at least 1"));
        }
        if cin % groups != 0 {
            return Err(bad(
                "groups",
                format!("input channels ({cin}) are not divisible by groups ({groups})"),
            ));
        }
        if cout % groups != 0 {
            return Err(bad(
                "groups",
                format!("output channels ({cout}) are not divisible by groups ({groups})"),
            ));
        }
        if weight[rank - 1] != cin / groups {
            return Err(bad(
                "weight",
                format!(
                    "last dim must be input channels / groups = {}, got shape {weight:?}",
                    cin / groups
                ),
            ));
        }
        // Bounded before any arithmetic on them: every size computed below then fits.
        check_extents("input", input)?;
        check_extents("weight", weight)?;
        let phases = stride.iter().try_fold(1usize, |acc, &s| acc.checked_mul(s));
        if phases.map_or(true, |n| n > INDEX_LIMIT) {
            // Backward-data runs a GEMM per stride phase, one per product of the strides.
            return Err(bad(
                "strides",
                format!("{stride:?} multiply to more than kiln's 32-bit indexing ({INDEX_LIMIT})"),
            ));
        }
        let mut g = Geometry {
            spatial,
            batch: input[0],
            input: [1; 3],
            output: [1; 3],
            kernel: [1; 3],
            stride,
            pad_lo,
            pad_hi,
            kernel_dilation,
            input_dilation,
            cin,
            cout,
            groups,
            flip: p.flip,
        };
        for i in 0..spatial {
            let d = 3 - spatial + i;
            g.input[d] = input[1 + i];
            g.kernel[d] = weight[1 + i];
            if g.kernel[d] == 0 {
                return Err(bad(
                    "weight",
                    format!("spatial dims must be at least 1, got shape {weight:?}"),
                ));
            }
            // Sizes in the dilated, padded input.
            let dilated = if g.input[d] == 0 {
                0
            } else {
                (g.input[d] - 1) * input_dilation[d] + 1
            };
            let padded = dilated + pad_lo[d] + pad_hi[d];
            let span = (g.kernel[d] - 1) * kernel_dilation[d] + 1;
            if padded < span {
                return Err(bad(
                    "input",
                    format!(
                        "spatial dim {i} gives an output of size <= 0: input {} (dilated {dilated}, \
                         padded {padded}) is smaller than the kernel's span {span}",
                        g.input[d]
                    ),
                ));
            }
            g.output[d] = (padded - span) / stride[d] + 1;
        }
        check_extents("output", &g.output_shape())?;
        Ok(g)
    }

    fn shape(&self, spatial: &[usize; 3], channels: usize, lead: usize) -> Vec<usize> {
        let mut s = vec![lead];
        s.extend_from_slice(&spatial[3 - self.spatial..]);
        s.push(channels);
        s
    }
    /// The input's shape as the caller's arrays have it: (N, spatial..., C_in).
    pub fn input_shape(&self) -> Vec<usize> {
        self.shape(&self.input, self.cin, self.batch)
    }
    /// The output's shape: (N, spatial..., C_out).
    pub fn output_shape(&self) -> Vec<usize> {
        self.shape(&self.output, self.cout, self.batch)
    }
    /// The weight's shape: (C_out, spatial..., C_in / groups).
    pub fn weight_shape(&self) -> Vec<usize> {
        self.shape(&self.kernel, self.cin / self.groups, self.cout)
    }
    /// Taps of the kernel: the product of its spatial extents.
    pub fn kernel_size(&self) -> usize {
        self.kernel.iter().product()
    }
    /// Spatial positions of one input image.
    pub fn input_pixels(&self) -> usize {
        self.input.iter().product()
    }
    /// Spatial positions of one output image.
    pub fn output_pixels(&self) -> usize {
        self.output.iter().product()
    }
    /// Multiply-adds of one pass (the same for all three): N x P x Q x K x C x R x S / groups.
    pub fn macs(&self) -> u64 {
        (self.batch * self.output_pixels()) as u64
            * self.cout as u64
            * (self.kernel_size() * self.cin / self.groups) as u64
    }
}

/// The three passes, as one GEMM each (per group).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    /// The output, from the input and the weight.
    Forward = 0,
    /// The input's gradient, from the output's cotangent and the weight.
    BackwardData = 1,
    /// The weight's gradient, from the input and the output's cotangent.
    BackwardWeight = 2,
}

impl Pass {
    /// The three passes, in declaration order.
    pub const ALL: [Pass; 3] = [Pass::Forward, Pass::BackwardData, Pass::BackwardWeight];

    /// Its snake-case name (`forward`, `backward_data`, `backward_weight`).
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::BackwardData => "backward_data",
            Pass::BackwardWeight => "backward_weight",
        }
    }

    /// Stride phases backward-data runs as separate GEMMs: the product of the strides when some
    /// stride exceeds 1 and nothing is dilated (then each input pixel's phase, its position plus
    /// padding modulo the stride, selects the only taps that reach it); otherwise 1.
    pub fn phases(self, g: &Geometry) -> usize {
        let phased = self == Pass::BackwardData
            && g.stride.iter().any(|&s| s > 1)
            && g.kernel_dilation.iter().all(|&d| d == 1)
            && g.input_dilation.iter().all(|&d| d == 1);
        if phased {
            g.stride.iter().product()
        } else {
            1
        }
    }

    /// (m, n, k) of the largest GEMM one block works on: a group's, or with phases the largest
    /// phase's (phase 0 has the most pixels and the most taps).
    pub fn block_gemm(self, g: &Geometry) -> (usize, usize, usize) {
        let (m, n, k) = self.gemm(g);
        if self.phases(g) == 1 {
            return (m, n, k);
        }
        let pixels: usize = (0..3).map(|d| g.input[d].div_ceil(g.stride[d])).product();
        let taps: usize = (0..3).map(|d| g.kernel[d].div_ceil(g.stride[d])).product();
        (g.batch * pixels, n, taps * (g.cout / g.groups))
    }

    /// (m, n, k) of one group's GEMM.
    pub fn gemm(self, g: &Geometry) -> (usize, usize, usize) {
        let (cin_g, cout_g) = (g.cin / g.groups, g.cout / g.groups);
        let ks = g.kernel_size();
        match self {
            Pass::Forward => (g.batch * g.output_pixels(), cout_g, ks * cin_g),
            Pass::BackwardData => (g.batch * g.input_pixels(), cin_g, ks * cout_g),
            Pass::BackwardWeight => (cout_g, ks * cin_g, g.batch * g.output_pixels()),
        }
    }
}

/// The kernel's view of a problem: `struct kiln_conv` in `templates/conv_igemm.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Problem {
    /// [`Geometry::batch`].
    pub batch: i32,
    /// [`Geometry::input`].
    pub input: [i32; 3],
    /// [`Geometry::output`].
    pub output: [i32; 3],
    /// [`Geometry::kernel`].
    pub kernel: [i32; 3],
    /// [`Geometry::stride`].
    pub stride: [i32; 3],
    /// [`Geometry::pad_lo`] (the padding after follows from the extents).
    pub pad: [i32; 3],
    /// [`Geometry::kernel_dilation`].
    pub kernel_dilation: [i32; 3],
    /// [`Geometry::input_dilation`].
    pub input_dilation: [i32; 3],
    /// Input channels, over all groups.
    pub cin: i32,
    /// Output channels, over all groups.
    pub cout: i32,
    /// Input channels per group.
    pub cin_g: i32,
    /// Output channels per group.
    pub cout_g: i32,
    /// Taps of the kernel ([`Geometry::kernel_size`]).
    pub ksize: i32,
    /// 1 for convolution proper, 0 for cross-correlation.
    pub flip: i32,
    /// Rows of the largest GEMM one block works on ([`Pass::block_gemm`]).
    pub m: i32,
    /// Its columns.
    pub n: i32,
    /// Its reduction depth.
    pub k: i32,
    /// K tiles each split of the reduction covers (at least 1; all of them without a split).
    pub k_tiles_per_split: i32,
    /// 1 when every pair of neighbouring output columns (an even one and the next) is adjacent
    /// in memory and 2-aligned, so that the kernel stores each pair in one write.
    pub pair_store: i32,
    /// Stride phases ([`Pass::phases`]; 1: not phased).
    pub phases: i32,
    /// The [`divider`] magic of each stride: the kernel's gathers divide by the strides.
    pub stride_magic: [u32; 3],
    /// The [`divider`] shift of each stride.
    pub stride_shift: [u32; 3],
    /// The [`divider`] magic of each input dilation, which the gathers divide by too.
    pub input_dilation_magic: [u32; 3],
    /// The [`divider`] shift of each input dilation.
    pub input_dilation_shift: [u32; 3],
}

fn i3(v: [usize; 3]) -> [i32; 3] {
    v.map(|x| x as i32)
}

impl Problem {
    /// Every extent fits in i32: `Geometry::new` bounds the tensors' sizes.
    pub fn new(g: &Geometry, pass: Pass, k_tiles_per_split: usize, splits: usize) -> Problem {
        let (m, n, k) = pass.block_gemm(g);
        let (cin_g, cout_g) = (g.cin / g.groups, g.cout / g.groups);
        let pair_store = match pass {
            Pass::Forward => g.cout % 2 == 0 && cout_g % 2 == 0,
            Pass::BackwardData => g.cin % 2 == 0 && cin_g % 2 == 0,
            // Columns are (kernel pos, channel): pairs stay within one tap when cin_g is even,
            // and each split's partials start 2-aligned when the weight's size is even.
            Pass::BackwardWeight => {
                cin_g % 2 == 0 && (splits == 1 || (g.cout * g.kernel_size() * cin_g) % 2 == 0)
            }
        };
        let (stride_div, dilation_div) = (g.stride.map(divider), g.input_dilation.map(divider));
        Problem {
            batch: g.batch as i32,
            input: i3(g.input),
            output: i3(g.output),
            kernel: i3(g.kernel),
            stride: i3(g.stride),
            pad: i3(g.pad_lo),
            kernel_dilation: i3(g.kernel_dilation),
            input_dilation: i3(g.input_dilation),
            cin: g.cin as i32,
            cout: g.cout as i32,
            cin_g: cin_g as i32,
            cout_g: cout_g as i32,
            ksize: g.kernel_size() as i32,
            flip: g.flip as i32,
            m: m as i32,
            n: n as i32,
            k: k as i32,
            k_tiles_per_split: k_tiles_per_split.max(1) as i32,
            pair_store: pair_store as i32,
            phases: pass.phases(g) as i32,
            stride_magic: stride_div.map(|(magic, _)| magic),
            stride_shift: stride_div.map(|(_, shift)| shift),
            input_dilation_magic: dilation_div.map(|(magic, _)| magic),
            input_dilation_shift: dilation_div.map(|(_, shift)| shift),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_arg(r: Result<Geometry>) -> &'static str {
        match r {
            Err(Error::InvalidArgument { arg, .. }) => arg,
            other => panic!("expected an argument error, got {other:?}"),
        }
    }

    #[test]
    fn output_sizes_follow_mlx() {
        // 2-D, stride 2, padding 1/2, kernel dilation 2, input dilation 3.
        let p = ConvParams::default()
            .strides(&[2])
            .padding_lo(&[1])
            .padding_hi(&[2])
            .kernel_dilation(&[2])
            .input_dilation(&[3]);
        let g = Geometry::new(&[2, 5, 4, 6], &[8, 3, 2, 6], &p).unwrap();
        // dilated 13 and 10, padded 16 and 13, spans 5 and 3.
        assert_eq!(g.output_shape(), vec![2, 6, 6, 8]);
        assert_eq!(g.input, [1, 5, 4]);
        assert_eq!(g.stride, [1, 2, 2]);
        assert_eq!(g.pad_lo, [0, 1, 1]);
        assert_eq!(g.weight_shape(), vec![8, 3, 2, 6]);
        let g1 = Geometry::new(&[1, 7, 3], &[4, 7, 3], &ConvParams::default()).unwrap();
        assert_eq!(g1.output_shape(), vec![1, 1, 4]);
    }

    #[test]
    fn bad_input_names_the_argument() {
        let ok = ConvParams::default();
        assert_eq!(err_arg(Geometry::new(&[2, 3], &[2, 3], &ok)), "input");
        assert_eq!(
            err_arg(Geometry::new(&[2, 5, 5, 3], &[4, 3, 3], &ok)),
            "weight"
        );
        assert_eq!(
            err_arg(Geometry::new(
                &[2, 5, 5, 6],
                &[4, 3, 3, 3],
                &ok.clone().groups(4)
            )),
            "groups"
        );
        assert_eq!(
            err_arg(Geometry::new(
                &[2, 5, 5, 6],
                &[3, 3, 3, 3],
                &ok.clone().groups(2)
            )),
            "groups"
        );
        assert_eq!(
            err_arg(Geometry::new(&[2, 5, 5, 6], &[4, 3, 3, 3], &ok)),
            "weight"
        );
        assert_eq!(
            err_arg(Geometry::new(
                &[2, 5, 5, 3],
                &[4, 3, 3, 3],
                &ok.clone().strides(&[0])
            )),
            "strides"
        );
        assert_eq!(
            err_arg(Geometry::new(
                &[2, 5, 5, 3],
                &[4, 3, 3, 3],
                &ok.clone().strides(&[1, 1, 1])
            )),
            "strides"
        );
        assert_eq!(
            err_arg(Geometry::new(
                &[2, 5, 5, 3],
                &[4, 3, 3, 3],
                &ok.clone().kernel_dilation(&[0])
            )),
            "kernel_dilation"
        );
        assert_eq!(
            err_arg(Geometry::new(
                &[2, 5, 5, 3],
                &[4, 3, 3, 3],
                &ok.clone().input_dilation(&[0])
            )),
            "input_dilation"
        );
        assert_eq!(
            err_arg(Geometry::new(&[2, 2, 5, 3], &[4, 3, 3, 3], &ok)),
            "input"
        );
        assert_eq!(
            err_arg(Geometry::new(&[2, 5, 5, 3], &[4, 0, 3, 3], &ok)),
            "weight"
        );
        assert_eq!(
            err_arg(Geometry::new(&[2, 5, 5, 3], &[4, 3, 3, 3], &ok.groups(0))),
            "groups"
        );
    }

    #[test]
    fn sizes_past_32_bits_are_refused_not_wrapped() {
        let ok = ConvParams::default();
        // Element counts that wrapped to 0 (2^32 x 2^32) and passed the size check in release
        // builds (a debug build panicked on the multiplication).
        assert_eq!(
            err_arg(Geometry::new(&[1 << 32, 1 << 32, 1], &[1, 1, 1], &ok)),
            "input"
        );
        assert_eq!(
            err_arg(Geometry::new(&[1, 4, 1], &[1 << 32, 1, 1 << 32], &ok)),
            "weight"
        );
        // The dilated extent overflowed before any size was checked.
        assert_eq!(
            err_arg(Geometry::new(
                &[1, 1 << 40, 1],
                &[1, 1, 1],
                &ok.clone().input_dilation(&[1 << 30])
            )),
            "input"
        );
        // An empty batch hid any spatial extent from the element counts, but not from the
        // pixel counts and the kernels' 32-bit extents.
        assert_eq!(
            err_arg(Geometry::new(
                &[0, 1 << 20, 1 << 20, 1 << 20, 3],
                &[1, 1, 1, 1, 3],
                &ok
            )),
            "input"
        );
        Geometry::new(&[0, 1 << 20, 3], &[2, 3, 3], &ok).unwrap();
    }

    #[test]
    fn parameters_past_32_bits_are_refused_not_truncated() {
        let ok = ConvParams::default();
        // Padding 2^32 reached the kernels as 0: the one output read the input's first element
        // instead of padding.
        let p = ok.clone().strides(&[INDEX_LIMIT]).padding_lo(&[1 << 32]);
        assert_eq!(
            err_arg(Geometry::new(&[1, 4, 1], &[1, 1, 1], &p)),
            "padding_lo"
        );
        let p = ok.clone().padding_hi(&[1 << 32]);
        assert_eq!(
            err_arg(Geometry::new(&[1, 4, 1], &[1, 1, 1], &p)),
            "padding_hi"
        );
        for p in [
            ok.clone().strides(&[1 << 32]),
            ok.clone().kernel_dilation(&[1 << 32]),
            ok.clone().input_dilation(&[1 << 32]),
        ] {
            let arg = err_arg(Geometry::new(&[1, 4, 1], &[1, 1, 1], &p));
            assert!(
                ["strides", "kernel_dilation", "input_dilation"].contains(&arg),
                "{p:?}: {arg}"
            );
        }
        // Strides whose product (backward-data's stride phases) overflowed.
        let p = ok.clone().strides(&[1 << 30]);
        assert_eq!(
            err_arg(Geometry::new(&[1, 1, 1, 1, 1], &[1, 1, 1, 1, 1], &p)),
            "strides"
        );
        let g = Geometry::new(&[1, 1, 1, 1, 1], &[1, 1, 1, 1, 1], &p.strides(&[1 << 10])).unwrap();
        assert_eq!(Pass::BackwardData.phases(&g), 1 << 30);
    }

    #[test]
    fn gemm_extents_per_pass() {
        let g = Geometry::new(
            &[2, 6, 6, 8],
            &[12, 3, 3, 4],
            &ConvParams::default().groups(2).padding(&[1]),
        )
        .unwrap();
        assert_eq!(Pass::Forward.gemm(&g), (72, 6, 36));
        assert_eq!(Pass::BackwardData.gemm(&g), (72, 4, 54));
        assert_eq!(Pass::BackwardWeight.gemm(&g), (6, 36, 72));
        assert_eq!(g.macs(), 72 * 12 * 36);
        assert_eq!(Pass::BackwardData.phases(&g), 1);
    }

    #[test]
    fn strided_backward_data_runs_by_phase() {
        let p = ConvParams::default().strides(&[2, 3]).padding(&[1]);
        let g = Geometry::new(&[2, 7, 8, 4], &[6, 3, 3, 4], &p).unwrap();
        assert_eq!(Pass::BackwardData.phases(&g), 6);
        assert_eq!(Pass::Forward.phases(&g), 1);
        // Phase 0: ceil(7/2) x ceil(8/3) pixels, ceil(3/2) x ceil(3/3) taps.
        assert_eq!(Pass::BackwardData.block_gemm(&g), (2 * 4 * 3, 4, 2 * 6));
        let dilated =
            Geometry::new(&[2, 7, 8, 4], &[6, 3, 3, 4], &p.kernel_dilation(&[2])).unwrap();
        assert_eq!(Pass::BackwardData.phases(&dilated), 1);
    }
}
