//! Convolution cases shared by the GPU tests and the host emulation of the direct, depthwise
//! and stem families.

use kiln::ops::conv::{reference, ConvParams};
use kiln::selfcheck::TestRng;
use kiln::DType;

/// A convolution: input and weight shapes and the parameters.
pub struct ConvCase {
    pub name: &'static str,
    pub x: Vec<usize>,
    pub w: Vec<usize>,
    pub p: ConvParams,
}

impl ConvCase {
    pub fn new(name: &'static str, x: &[usize], w: &[usize], p: ConvParams) -> ConvCase {
        ConvCase {
            name,
            x: x.to_vec(),
            w: w.to_vec(),
            p,
        }
    }
}

/// Cases for the direct family (few channels per group).
pub fn direct() -> Vec<ConvCase> {
    let d = ConvParams::default;
    vec![
        // The direct family (few channels per group): depthwise with multipliers 1, 2 and 4,
        // kernels wider than a window step, 1-D causal and 3-D, dilation and flip; groups of 2,
        // 4, 8 and 16 channels, and of twice as many output as input channels; channel counts
        // that leave one channel a thread; a long
        // backward-weight sum that splits.
        ConvCase::new(
            "direct depthwise 7x7, 40 channels",
            &[2, 13, 15, 40],
            &[40, 7, 7, 1],
            d().groups(40).padding(&[3]),
        ),
        ConvCase::new(
            "direct depthwise x2 5x5 stride 2",
            &[2, 11, 12, 16],
            &[32, 5, 5, 1],
            d().groups(16).strides(&[2]).padding(&[2]),
        ),
        ConvCase::new(
            "direct depthwise x4, 5 channels",
            &[1, 7, 9, 5],
            &[20, 3, 3, 1],
            d().groups(5).padding(&[1]),
        ),
        ConvCase::new(
            "direct depthwise 1d kernel 9 causal",
            &[2, 30, 16],
            &[16, 9, 1],
            d().groups(16).padding_lo(&[8]).padding_hi(&[0]),
        ),
        ConvCase::new(
            "direct depthwise 3d 3x3x3",
            &[1, 4, 5, 6, 24],
            &[24, 3, 3, 3, 1],
            d().groups(24).padding(&[1]),
        ),
        ConvCase::new(
            "direct depthwise dilation 2, flip, pad 2/1",
            &[1, 12, 11, 16],
            &[16, 3, 3, 1],
            d().groups(16)
                .kernel_dilation(&[2])
                .flip(true)
                .padding_lo(&[2])
                .padding_hi(&[1]),
        ),
        ConvCase::new(
            "direct depthwise input dilation 2",
            &[1, 6, 5, 8],
            &[8, 3, 3, 1],
            d().groups(8).input_dilation(&[2]).padding(&[1]),
        ),
        ConvCase::new(
            "direct groups of 2",
            &[2, 9, 10, 32],
            &[32, 3, 3, 2],
            d().groups(16).padding(&[1]),
        ),
        ConvCase::new(
            "direct groups of 4, stride 2",
            &[2, 9, 9, 64],
            &[64, 3, 3, 4],
            d().groups(16).strides(&[2]).padding(&[1]),
        ),
        ConvCase::new(
            "direct groups of 8",
            &[2, 10, 9, 64],
            &[64, 3, 3, 8],
            d().groups(8).padding(&[1]),
        ),
        ConvCase::new(
            "direct groups of 16, 5x5",
            &[2, 8, 9, 64],
            &[64, 5, 5, 16],
            d().groups(4).padding(&[2]),
        ),
        ConvCase::new(
            "direct groups of 8 in, 16 out",
            &[2, 10, 9, 32],
            &[64, 3, 3, 8],
            d().groups(4).padding(&[1]),
        ),
        ConvCase::new(
            "direct groups of 2 in, 4 out, 1x5, uneven padding",
            &[2, 9, 11, 12],
            &[24, 1, 5, 2],
            d().groups(6).padding_lo(&[0, 1]).padding_hi(&[0, 3]),
        ),
        ConvCase::new(
            "direct 5 groups of 4 (one channel a thread)",
            &[1, 7, 6, 20],
            &[20, 3, 3, 4],
            d().groups(5).padding(&[1]),
        ),
        ConvCase::new(
            "direct depthwise long backward-weight sum",
            &[8, 30, 30, 16],
            &[16, 3, 3, 1],
            d().groups(16).padding(&[1]),
        ),
        ConvCase::new(
            "2d depthwise",
            &[2, 9, 9, 24],
            &[24, 3, 3, 1],
            d().groups(24).padding(&[1]),
        ),
        ConvCase::new(
            "2d depthwise x2 stride 2",
            &[1, 10, 10, 8],
            &[16, 3, 3, 1],
            d().groups(8).strides(&[2]),
        ),
        ConvCase::new(
            "3d dilations, groups 2, flip",
            &[1, 4, 5, 5, 8],
            &[8, 2, 2, 3, 4],
            d().kernel_dilation(&[2, 1, 2])
                .input_dilation(&[1, 2, 1])
                .groups(2)
                .flip(true)
                .padding_lo(&[1, 0, 2])
                .padding_hi(&[0, 1, 1]),
        ),
    ]
}

/// Cases for the depthwise family (1-D and 2-D depthwise, kernels up to 7x7, strides up to 2):
/// channel multipliers 1, 2 and 4, more than one block of 32 channels with a partial one, odd
/// channel counts (read without vectors), tiles cut by the edges, uneven padding, flip, a long
/// backward-weight sum that splits, strided backward-data whose tiles start before the image.
pub fn depthwise() -> Vec<ConvCase> {
    let d = ConvParams::default;
    vec![
        ConvCase::new(
            "depthwise 7x7, 40 channels",
            &[2, 13, 15, 40],
            &[40, 7, 7, 1],
            d().groups(40).padding(&[3]),
        ),
        ConvCase::new(
            "depthwise 3x3 stride 2, x2, 24 channels",
            &[2, 17, 19, 24],
            &[48, 3, 3, 1],
            d().groups(24).strides(&[2]).padding(&[1]),
        ),
        ConvCase::new(
            "depthwise 5x5 x2, 36 channels",
            &[1, 11, 12, 36],
            &[72, 5, 5, 1],
            d().groups(36).padding(&[2]),
        ),
        ConvCase::new(
            "depthwise 3x3 x4, 5 channels",
            &[2, 7, 9, 5],
            &[20, 3, 3, 1],
            d().groups(5).padding(&[1]),
        ),
        ConvCase::new(
            "depthwise 1d kernel 7 causal, 48 channels",
            &[2, 45, 48],
            &[48, 7, 1],
            d().groups(48).padding_lo(&[6]).padding_hi(&[0]),
        ),
        ConvCase::new(
            "depthwise 4x6 flip, uneven padding, 9 channels",
            &[1, 12, 21, 9],
            &[9, 4, 6, 1],
            d().groups(9)
                .flip(true)
                .padding_lo(&[3, 1])
                .padding_hi(&[0, 2]),
        ),
        ConvCase::new(
            "depthwise 5x5 stride 2x1, 64 channels",
            &[1, 20, 9, 64],
            &[64, 5, 5, 1],
            d().groups(64).strides(&[2, 1]).padding(&[2]),
        ),
        ConvCase::new(
            "depthwise long backward-weight sum",
            &[8, 30, 30, 16],
            &[16, 3, 3, 1],
            d().groups(16).padding(&[1]),
        ),
        ConvCase::new(
            "depthwise 2x3, 520 channels in chunks, uneven padding",
            &[2, 9, 11, 520],
            &[520, 2, 3, 1],
            d().groups(520).padding_lo(&[1, 2]).padding_hi(&[0, 0]),
        ),
        ConvCase::new(
            "depthwise 5x5 flip, 104 channels in chunks of 32, uneven padding",
            &[2, 11, 37, 104],
            &[104, 5, 5, 1],
            d().groups(104)
                .flip(true)
                .padding_lo(&[2, 1])
                .padding_hi(&[1, 3]),
        ),
        ConvCase::new(
            "depthwise 3x3 stride 2, odd image, padding 1/0, 96 channels",
            &[3, 29, 31, 96],
            &[96, 3, 3, 1],
            d().groups(96)
                .strides(&[2])
                .padding_lo(&[1])
                .padding_hi(&[0]),
        ),
        ConvCase::new(
            "depthwise 7x7 stride 2 flip, padding 3/2 and 2/3, 48 channels",
            &[2, 23, 26, 48],
            &[48, 7, 7, 1],
            d().groups(48)
                .strides(&[2])
                .flip(true)
                .padding_lo(&[3, 2])
                .padding_hi(&[2, 3]),
        ),
        ConvCase::new(
            "depthwise 3x3 stride 2 flip, odd image, 36 channels",
            &[3, 25, 19, 36],
            &[36, 3, 3, 1],
            d().groups(36).strides(&[2]).flip(true).padding(&[1]),
        ),
        ConvCase::new(
            "depthwise 2x3, 6 channels, uneven padding, several segments",
            &[5, 61, 13, 6],
            &[6, 2, 3, 1],
            d().groups(6).padding_lo(&[1, 0]).padding_hi(&[0, 2]),
        ),
        ConvCase::new(
            "depthwise 3x3 flip, rows of 150 in two tiles, uneven padding, 24 channels",
            &[1, 5, 150, 24],
            &[24, 3, 3, 1],
            d().groups(24)
                .flip(true)
                .padding_lo(&[0, 2])
                .padding_hi(&[2, 0]),
        ),
        // Small images: 16-bit forward and backward-data on the column walks (a row of 7 and of
        // 3 a thread; two chunks of channel pairs).
        ConvCase::new(
            "depthwise 3x3 on 7x7 images, 96 channels",
            &[3, 7, 7, 96],
            &[96, 3, 3, 1],
            d().groups(96).padding(&[1]),
        ),
        ConvCase::new(
            "depthwise 3x3 flip, 9x20 images, uneven padding, 66 channels",
            &[2, 9, 20, 66],
            &[66, 3, 3, 1],
            d().groups(66)
                .flip(true)
                .padding_lo(&[2, 0])
                .padding_hi(&[0, 2]),
        ),
        ConvCase::new(
            "depthwise 2x3 on 14x13 images, 130 channels in two chunks",
            &[2, 14, 13, 130],
            &[130, 2, 3, 1],
            d().groups(130).padding_lo(&[1, 1]).padding_hi(&[0, 1]),
        ),
    ]
}

/// Cases for the grouped family (2 to 32 channels a group, one, two or four times as many out
/// as in, kernels up to 3x3, 16-bit): every group width, more than one 64-channel block with a partial last one,
/// channel counts that take no 16-byte copies, strides, uneven padding, flip, 1-D, edges that
/// cut tiles, a long backward-weight sum.
pub fn grouped() -> Vec<ConvCase> {
    let d = ConvParams::default;
    vec![
        ConvCase::new(
            "grouped 3x3, 4 a group, 96 channels",
            &[2, 13, 15, 96],
            &[96, 3, 3, 4],
            d().groups(24).padding(&[1]),
        ),
        ConvCase::new(
            "grouped 3x3 stride 2, 8 a group, 64 channels",
            &[2, 17, 19, 64],
            &[64, 3, 3, 8],
            d().groups(8).strides(&[2]).padding(&[1]),
        ),
        ConvCase::new(
            "grouped 3x3, 16 a group, 48 channels",
            &[1, 9, 22, 48],
            &[48, 3, 3, 16],
            d().groups(3).padding(&[1]),
        ),
        ConvCase::new(
            "grouped 3x3, 32 a group, 128 channels",
            &[2, 7, 9, 128],
            &[128, 3, 3, 32],
            d().groups(4).padding(&[1]),
        ),
        ConvCase::new(
            "grouped 2x3 flip, uneven padding, 2 a group, 6 channels",
            &[2, 8, 11, 6],
            &[6, 2, 3, 2],
            d().groups(3)
                .flip(true)
                .padding_lo(&[1, 0])
                .padding_hi(&[0, 2]),
        ),
        ConvCase::new(
            "grouped 3x2 stride 2 flip, uneven padding, 4 a group, 32 channels",
            &[2, 11, 10, 32],
            &[32, 3, 2, 4],
            d().groups(8)
                .strides(&[2])
                .flip(true)
                .padding_lo(&[0, 1])
                .padding_hi(&[2, 0]),
        ),
        ConvCase::new(
            "grouped 3x3, 8 in and 16 out a group, 96 channels in (two blocks, one partial)",
            &[2, 9, 10, 96],
            &[192, 3, 3, 8],
            d().groups(12).padding(&[1]),
        ),
        ConvCase::new(
            "grouped 3x3 stride 2, 16 in and 32 out a group, 32 channels in",
            &[2, 13, 11, 32],
            &[64, 3, 3, 16],
            d().groups(2).strides(&[2]).padding(&[1]),
        ),
        ConvCase::new(
            "grouped 2x3 stride 2 flip, 2 in and 4 out a group, 20 channels in",
            &[1, 9, 12, 20],
            &[40, 2, 3, 2],
            d().groups(10)
                .strides(&[2])
                .flip(true)
                .padding_lo(&[1, 0])
                .padding_hi(&[0, 1]),
        ),
        ConvCase::new(
            "grouped 3x3, 4 in and 16 out a group, 40 channels in (three blocks, one partial)",
            &[2, 11, 9, 40],
            &[160, 3, 3, 4],
            d().groups(10).padding(&[1]),
        ),
        ConvCase::new(
            "grouped 3x3 stride 2, 8 in and 32 out a group, 24 channels in",
            &[2, 12, 13, 24],
            &[96, 3, 3, 8],
            d().groups(3).strides(&[2]).padding(&[1]),
        ),
        ConvCase::new(
            "grouped 3x2 flip, 2 in and 8 out a group, 12 channels in",
            &[1, 8, 17, 12],
            &[48, 3, 2, 2],
            d().groups(6)
                .flip(true)
                .padding_lo(&[2, 0])
                .padding_hi(&[0, 1]),
        ),
        ConvCase::new(
            "grouped 1d kernel 3, 8 a group, 40 channels",
            &[2, 37, 40],
            &[40, 3, 8],
            d().groups(5).padding(&[1]),
        ),
        ConvCase::new(
            "grouped 1x1 stride 2x1, 4 a group, 20 channels",
            &[1, 10, 12, 20],
            &[20, 1, 1, 4],
            d().groups(5).strides(&[2, 1]),
        ),
        ConvCase::new(
            "grouped long backward-weight sum, 8 a group",
            &[8, 20, 20, 16],
            &[16, 3, 3, 8],
            d().groups(2).padding(&[1]),
        ),
    ]
}

/// Cases for the stem family (1 to 4 input channels, 2-D): several tiles in each direction,
/// edges that cut tiles, more than one block of 64 output channels.
pub fn stem() -> Vec<ConvCase> {
    let d = ConvParams::default;
    vec![
        ConvCase::new(
            "stem 7x7 stride 2, 3 -> 64",
            &[2, 37, 29, 3],
            &[64, 7, 7, 3],
            d().strides(&[2]).padding(&[3]),
        ),
        ConvCase::new(
            "stem 3x3 stride 2, 3 -> 32",
            &[2, 33, 35, 3],
            &[32, 3, 3, 3],
            d().strides(&[2]).padding(&[1]),
        ),
        ConvCase::new(
            "stem 5x5 flip, 1 -> 24",
            &[3, 19, 21, 1],
            &[24, 5, 5, 1],
            d().padding(&[2]).flip(true),
        ),
        ConvCase::new(
            "stem 4x7 strides 2x3, uneven padding, 4 -> 72",
            &[2, 23, 40, 4],
            &[72, 4, 7, 4],
            d().strides(&[2, 3]).padding_lo(&[1, 3]).padding_hi(&[2, 0]),
        ),
        ConvCase::new(
            "stem 3x2, 2 -> 10 (odd channel vectors)",
            &[1, 9, 40, 2],
            &[10, 3, 2, 2],
            d().padding(&[1, 0]),
        ),
        ConvCase::new(
            "stem 3x3 flip stride 2, 3 -> 24",
            &[2, 15, 17, 3],
            &[24, 3, 3, 3],
            d().strides(&[2]).padding(&[1]).flip(true),
        ),
    ]
}

/// `n` values in [-1, 1), exact in `dtype`.
pub fn random(rng: &mut TestRng, dtype: DType, n: usize) -> Vec<f64> {
    let v: Vec<f64> = (0..n).map(|_| rng.next_f64()).collect();
    kiln::dtype::decode(dtype, &kiln::dtype::encode(dtype, &v)).unwrap()
}

/// The largest error over the tolerance (<= 1 passes) and where it is.
pub fn worst(dtype: DType, got: &[f64], want: &reference::Reference) -> (f64, usize) {
    assert_eq!(got.len(), want.values.len());
    let mut worst = (0.0, 0);
    for (i, (&g, (&r, &s))) in got
        .iter()
        .zip(want.values.iter().zip(&want.magnitude))
        .enumerate()
    {
        let ratio = kiln::selfcheck::conv_error(dtype, g, r, s);
        if ratio > worst.0 {
            worst = (ratio, i);
        }
    }
    worst
}

/// The largest error over one TF32 product's bound (`KILN_ALLOW_TF32`): operands of 11 bits,
/// so 2e-3 of the sum of the products' magnitudes; <= 1 passes, a non-finite output fails.
pub fn worst_tf32(got: &[f64], want: &reference::Reference) -> f64 {
    assert_eq!(got.len(), want.values.len());
    got.iter()
        .zip(want.values.iter().zip(&want.magnitude))
        .map(|(&g, (&r, &s))| {
            let e = (g - r).abs() / (1e-6 * r.abs() + 2e-3 * s + 1e-30);
            if g.is_finite() {
                e
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}
