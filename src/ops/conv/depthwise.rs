//! The depthwise family (`templates/conv_depthwise.cu`): 1-D and 2-D depthwise convolutions
//! (one input channel a group, a channel multiplier of 1, 2 or 4) as stencils over shared-memory
//! tiles. A block works on 32 channels and walks tiles of outputs, copying the next tile's source
//! rows into shared memory (asynchronously, as they are in memory) while it computes this one;
//! each lane computes one channel's outputs, a few at a time, with the kernel's taps unrolled and
//! a window of source columns in registers. Such layers move more bytes than they multiply, so
//! the family's aim is to read each operand about once and keep the per-tap work out of the
//! inner loop. Every dtype, every architecture kiln runs on.
//!
//! From sm_80 on, 16-bit forward and stride-1 backward-data with one output channel a group,
//! a column stride of 1 and channels in 16-byte units run on a tensor-core variant
//! (`templates/conv_depthwise_tc.cu`): along a row, eight outputs of one channel and one tap row
//! are a product of 16 source columns with a banded matrix of the tap row's weights, so an
//! `mma.sync` takes 16 such segments; a block works on 16 channels, turning its staged pixels
//! into one plane per channel for `ldmatrix` and its outputs back into pixels.
//!
//! From sm_80 on, every pass at stride 1, and the forward at stride 2, with one output channel
//! a group, kernels of 2-7 rows and up to 7 columns, aligned operands and channels in whole
//! copies runs on streamed rows (`templates/conv_depthwise_rows.cu`), every dtype: a block
//! takes a chunk of channels and a band of columns and walks a segment of rows down the image,
//! copying each source row once into a ring of shared buffers a few rows ahead of the one it
//! computes; a thread computes 4 channels (one 8- or 16-byte vector; kernels up to 3x3) or
//! one channel (larger kernels, whose 25-49 weights then fit in registers) of a few columns,
//! its window read from the ring and added into one row of accumulators for each output row
//! the source row meets (KH at stride 1; two for a 3x3 at stride 2). Backward-weight copies
//! the cotangent rows beside, and each thread sums every tap; one f32 partial a block along x;
//! where its blocks would sum few outputs, the stencil takes the layer instead. In 16-bit,
//! kernels past 3x3 run there only forward and backward-data on small images (at stride 1 5x5
//! up to 14 rows, 7x7 up to 10; the stride-2 forward 5x5 up to 7); the tensor-core kernel
//! (stride 1) or the stencil (stride 2) keeps the others, and the tensor-core kernel the layers
//! with one kernel row (1-D) or strides of 2 and 1.
//!
//! Backward-weight of kernels up to 3x3 whose channel count would leave many of the 32-channel
//! lanes idle (6, 8, 16, 36 channels) runs on column walks (`templates/conv_depthwise_cols.cu`),
//! any architecture, strides up to 2: a thread takes a vector of up to 4 channels of two output
//! columns and walks down a segment of source rows straight from global memory, one row's loads
//! in flight ahead of the one it adds, keeping the cotangent rows still open and its KH x KW
//! sums in registers; blocks are persistent and write one f32 partial each. The forward and
//! stride-1 backward-data of 3x3 layers on small images (16-bit up to 20x20, f32 up to 10x10;
//! the 16-bit stride-2 forward up to 10x10 outputs) walk the same way, two channels and a whole
//! or a third of a row a thread, a block an image and channel chunk.
//!
//! Strided backward-data runs on the stencil as the forward of the transposed convolution: its
//! source is the cotangent spread by the stride with zeros between, of which only the real rows
//! and columns are staged, and tiles start where the spread source has a real row and column
//! (up to a stride before the image), so each output's live taps are compile-time and the zeros
//! are never read or multiplied.
//!
//! It takes kernels up to [`MAX_KERNEL`] taps a side, strides up to [`MAX_STRIDE`] and no
//! dilation; the direct family takes the other depthwise layers. Specs are
//! specialised by kernel, stride and channel multiplier: [`specs`] lists the common ones
//! (`kiln warm` compiles those); any other compiles on its first use.

use crate::dtype::DType;
use crate::env::ConvPath;
use crate::jit::{KernelSpec, TemplateDef};
use crate::runtime::Device;

use super::geometry::{Geometry, Pass};
use super::plan::{persistent_grid, tile_limits, PlanKey};

pub static DEPTHWISE: TemplateDef = TemplateDef {
    name: "conv_depthwise",
    source: include_str!("../../../templates/conv_depthwise.cu"),
    kernel: "kiln_conv_depthwise",
    const_names: &["PASS", "MG", "KH", "KW", "SH", "SW", "OTH", "OTW"],
    arch_specific: false,
    only_arch: None,
};

/// The tensor-core variant (`templates/conv_depthwise_tc.cu`): 16-bit forward and stride-1
/// backward-data with one output channel a group and a column stride of 1, from sm_80 on.
pub static DEPTHWISE_TC: TemplateDef = TemplateDef {
    name: "conv_depthwise_tc",
    source: include_str!("../../../templates/conv_depthwise_tc.cu"),
    kernel: "kiln_conv_depthwise_tc",
    const_names: &["PASS", "MG", "KH", "KW", "SH", "SW", "OTH", "OTW"],
    arch_specific: false,
    only_arch: None,
};
/// The streamed-rows variant (`templates/conv_depthwise_rows.cu`): every pass at stride 1 and
/// the forward at stride 2, one output channel a group, kernels of 2-7 rows and up to 7
/// columns, from sm_80 on.
pub static DEPTHWISE_ROWS: TemplateDef = TemplateDef {
    name: "conv_depthwise_rows",
    source: include_str!("../../../templates/conv_depthwise_rows.cu"),
    kernel: "kiln_conv_depthwise_rows",
    const_names: &["PASS", "KH", "KW", "TW", "V", "S"],
    arch_specific: false,
    only_arch: None,
};
/// The column-walks variant (`templates/conv_depthwise_cols.cu`): one output channel a group,
/// the same stride (1 or 2) along both dims, kernels up to 7x7, any architecture; every pass
/// (backward-data at stride 1).
pub static DEPTHWISE_COLS: TemplateDef = TemplateDef {
    name: "conv_depthwise_cols",
    source: include_str!("../../../templates/conv_depthwise_cols.cu"),
    kernel: "kiln_conv_depthwise_cols",
    const_names: &["PASS", "KH", "KW", "TW", "V", "S"],
    arch_specific: false,
    only_arch: None,
};
/// The first architecture whose `mma.sync` m16n8k16 takes both 16-bit types.
pub const TENSOR_ARCH: u32 = 80;
/// The first architecture the rows kernel runs on: its ring needs `cp.async` to keep copies in
/// flight (older targets would copy a row at once, and the stencil is measured there).
pub const ROWS_ARCH: u32 = 80;
/// Source rows the rows kernel has in flight while one is computed (AHEAD: its ring holds
/// AHEAD + 1 rows, AHEAD + KH for backward-weight).
const ROWS_AHEAD: usize = 3;
/// Channels a rows block takes along x: at most 64 vectors of 4 (kernels up to 3x3); 32 single
/// channels (larger kernels), or all of fewer.
const ROWS_MAX_VECTORS: usize = 64;
const ROWS_MAX_CHANNELS: usize = 32;
/// The tallest 16-bit image (gathered rows) whose forward or backward-data the rows kernel
/// takes with a kernel past 3x3 of `taps` taps at `stride`, 0 for none (the tensor-core kernel
/// and the stencil keep the rest; backward-weight stays on the stencil). H100, rows / the
/// tensor-core kernel: 5x5 on 7x7 images 1.30-1.42x; backward-weight against the stencil
/// 0.74-0.84x. H200, after the rows kernel's stepped addresses, stride 1: 5x5 1.45x on 9x9
/// images, 1.5x on 10x10, 1.51-1.64x on 11x11, 1.38x on 12x12, 1.11-1.16x on 13x13, 0.98-1.21x
/// on 14x14, 0.94x on 20x20; 7x7 1.23-1.36x on 7x7 and 9x9, 1.07-1.16x on 10x10, 0.90-0.99x on
/// 12x12, 0.85-0.88x on 14x14. Stride 2 (the forward) was measured on 7x7 outputs only.
fn rows_small_image_most(stride: usize, taps: usize) -> usize {
    match (stride, taps) {
        (1, 0..=25) => 14,
        (1, 0..=49) => 10,
        (2, 0..=25) => 7,
        _ => 0,
    }
}

/// Channels a tensor-core block works on, and the outputs of one MMA row (a segment).
const TENSOR_CHANNELS: usize = 16;
const SEGMENT: usize = 8;
/// The widest tensor-core tile: its staged columns (plus a segment) are at most half the
/// block's threads, one thread pair a column.
const MAX_TENSOR_TILE_W: usize = THREADS as usize / 2 - SEGMENT;
/// The tensor-core kernel's launch bound (blocks an SM at least), the template's MIN_BLOCKS:
/// three for kernels of up to 5 rows, whose bands take fewer registers.
fn tensor_min_blocks(kernel_rows: usize) -> usize {
    if kernel_rows <= 5 {
        3
    } else {
        2
    }
}

/// Threads a block: 32 channel lanes x 8 warps.
pub const THREADS: u16 = 256;
const LANES: usize = 32;
const WARPS: usize = THREADS as usize / LANES;
pub const MAX_KERNEL: usize = 7;
pub const MAX_STRIDE: usize = 2;
/// Output channels a group (channel multipliers) the family takes.
pub const MULTIPLIERS: [usize; 3] = [1, 2, 4];
/// What a spec is specialised by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Output channels a group.
    pub mg: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    /// Outputs a warp computes at a time: `out_tile[0]` rows of `out_tile[1]` (the tensor-core
    /// kernel: one segment of 8; the rows kernel: a thread's columns of a row).
    pub out_tile: [usize; 2],
    /// Which kernel runs it.
    pub variant: Variant,
}

/// The family's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// The FMA stencil over shared-memory tiles (`conv_depthwise.cu`): every case the family
    /// takes.
    Stencil,
    /// Tensor cores (`conv_depthwise_tc.cu`): 16-bit forward and stride-1 backward-data.
    Tensor,
    /// Streamed rows (`conv_depthwise_rows.cu`): kernels up to 7x7, every pass at stride 1 and
    /// the forward at stride 2.
    Rows,
    /// Column walks (`conv_depthwise_cols.cu`): `vector` channels a thread; backward-weight
    /// with few channels, forward and stride-1 backward-data of small images.
    Columns { vector: usize },
}

impl Shape {
    fn of(pass: Pass, g: &Geometry) -> Shape {
        let one_row = g.input[1] == 1 && g.kernel[1] == 1;
        let stride = [g.stride[1], g.stride[2]];
        Shape {
            mg: g.cout / g.groups,
            kernel: [g.kernel[1], g.kernel[2]],
            stride,
            out_tile: stencil_tile(pass, one_row, stride),
            variant: Variant::Stencil,
        }
    }

    /// The tensor-core kernel's shape for `g`.
    fn tensor(g: &Geometry) -> Shape {
        Shape {
            out_tile: [1, SEGMENT],
            variant: Variant::Tensor,
            ..Shape::of(Pass::Forward, g)
        }
    }

    /// The rows kernel's shape for `g` in `dtype`.
    fn rows(g: &Geometry, dtype: DType) -> Shape {
        Shape {
            out_tile: [1, rows_columns(dtype, [g.kernel[1], g.kernel[2]])],
            variant: Variant::Rows,
            ..Shape::of(Pass::Forward, g)
        }
    }

    /// Blocks an SM must hold: the template's launch bound MIN_BLOCKS, by kernel size (and
    /// sub-tile: a 5x5 kernel's 4 x 7 sub-tile does not fit three blocks' registers).
    fn min_blocks(&self) -> usize {
        match self.kernel[0] * self.kernel[1] {
            0..=9 => 4,
            10..=25 if self.out_tile[0] * self.out_tile[1] <= 16 => 3,
            _ => 2,
        }
    }

    /// The staged source rows and columns of a stencil `tile` of outputs (the template's
    /// `kiln_rows` and `kiln_cols`): forward and backward-weight step the stride an output;
    /// backward-data stages the real rows and columns of the cotangent spread by the stride.
    fn source_extent(&self, pass: Pass, tile: [usize; 2]) -> [usize; 2] {
        std::array::from_fn(|d| {
            let (step, spread) = if pass == Pass::BackwardData {
                (1, self.stride[d])
            } else {
                (self.stride[d], 1)
            };
            ((tile[d] - 1) * step + self.kernel[d] - 1) / spread + 1
        })
    }

    /// Channels staged a pixel (the template's PER) and planes they lie in (PLANES).
    fn staged(&self, pass: Pass) -> (usize, usize) {
        if pass == Pass::BackwardData {
            (LANES * self.mg, self.mg)
        } else {
            (LANES / self.mg, 1)
        }
    }
}

/// The stencil's outputs a warp computes at a time (OTH x OTW). 1-D layers (one row) take 8
/// along the row; 2-D ones 4 x 4, which reads each staged value once per 4 (stride 1) outputs
/// it serves and fits the 7x7 kernel's taps, sums and window in registers. The forward and
/// backward-weight at stride 2 take 2 x 4: their source rows are twice as many, and a block's
/// eight warps still get a sub-tile each from a tile whose source fits. Backward-data's
/// sub-tiles start on real rows and columns of the spread cotangent: whole strides (4 x 4, and
/// 1 x 8 only for rows of stride 1).
fn stencil_tile(pass: Pass, one_row: bool, stride: [usize; 2]) -> [usize; 2] {
    match (pass, one_row, stride[0]) {
        (Pass::BackwardData, true, 1) => [1, 8],
        (Pass::BackwardData, ..) => [4, 4],
        (_, true, _) => [1, 8],
        (_, false, 1) => [4, 4],
        _ => [2, 4],
    }
}

/// A second sub-tile for backward-weight of 5x5 to 7x7 kernels at stride 1 (2-D, one output
/// channel a group): 4 x 7 outputs a warp. Tiles 28 or 56 outputs wide then give each of a
/// block's eight warps a sub-tile, where 4 x 4 left two of 16 slots idle (8 x 28 tiles: 14
/// sub-tiles), and each staged value serves 7 outputs of a row instead of 4. The plan takes it
/// where its best tile beats the best square one by a rule measured on the H100
/// (`wide_tile_wins`).
pub const WIDE_TILE: [usize; 2] = [4, 7];

/// Whether `pass` of the stencil shape `s` may take [`WIDE_TILE`].
fn takes_wide_tile(pass: Pass, s: &Shape) -> bool {
    pass == Pass::BackwardWeight
        && s.variant == Variant::Stencil
        && s.mg == 1
        && s.stride == [1, 1]
        && s.kernel[0] >= 5
        && s.kernel[1] >= 5
        && s.out_tile == [4, 4]
}

/// The PASS constant the kernel of `s` is compiled with. With one output channel a group, every
/// kernel of the family runs backward-data at stride 1 as the forward's gather over the
/// cotangent, the problem's fields walking the taps backwards: its PASS 1 code is the PASS 0
/// code (the same machine code: `tests/jit_compile.rs` checks every registered spec), so both
/// passes share one module, one compile and one cache entry. Other strides and multipliers keep
/// PASS 1 (the walks' templates refuse it at compile time).
fn compiled_pass(pass: Pass, s: &Shape) -> i32 {
    match pass {
        Pass::BackwardData if s.stride == [1, 1] && s.mg == 1 => Pass::Forward as i32,
        _ => pass as i32,
    }
}

pub fn spec(dtype: DType, pass: Pass, s: Shape) -> KernelSpec {
    if let Variant::Columns { vector } = s.variant {
        return KernelSpec::new(
            &DEPTHWISE_COLS,
            dtype,
            THREADS,
            1,
            &[
                compiled_pass(pass, &s),
                s.kernel[0] as i32,
                s.kernel[1] as i32,
                s.out_tile[1] as i32,
                vector as i32,
                s.stride[0] as i32,
            ],
        );
    }
    if s.variant == Variant::Rows {
        return KernelSpec::new(
            &DEPTHWISE_ROWS,
            dtype,
            THREADS,
            1,
            &[
                compiled_pass(pass, &s),
                s.kernel[0] as i32,
                s.kernel[1] as i32,
                s.out_tile[1] as i32,
                rows_vector(s.kernel) as i32,
                s.stride[0] as i32,
            ],
        );
    }
    KernelSpec::new(
        if s.variant == Variant::Tensor {
            &DEPTHWISE_TC
        } else {
            &DEPTHWISE
        },
        dtype,
        THREADS,
        1,
        &[
            compiled_pass(pass, &s),
            s.mg as i32,
            s.kernel[0] as i32,
            s.kernel[1] as i32,
            s.stride[0] as i32,
            s.stride[1] as i32,
            s.out_tile[0] as i32,
            s.out_tile[1] as i32,
        ],
    )
}

/// The common 2-D depthwise layers `kiln warm` compiles for `arch`: square 3x3, 5x5 and 7x7
/// kernels at strides 1 and 2 (MobileNet, EfficientNet, ConvNeXt), every pass, and channel
/// multiplier 2 at stride 1 for 3x3 and 5x5. From sm_80 on, at multiplier 1, forward (strides 1
/// and 2) and backward-data (stride 1) are the rows kernel's (16-bit 5x5 and 7x7: the
/// tensor-core kernel's at stride 1 and the stencil's at stride 2, and the rows kernel's too at
/// stride 1 and for 5x5 at stride 2, which takes small images), and stride-1 backward-weight is
/// listed on both the rows kernel (large images) and the stencil (16-bit 5x5 and 7x7: the
/// stencil, in both of its sub-tiles); 3x3 backward-weight also on the column walks, which
/// take few channels (16: MobileNetV3).
pub fn specs(arch: u32) -> Vec<KernelSpec> {
    let mut shapes = Vec::new();
    for k in [3, 5, 7] {
        for s in [1, 2] {
            shapes.push((1, k, s));
        }
    }
    shapes.extend([(2, 3, 1), (2, 5, 1)]);
    let mut out = Vec::new();
    for dtype in DType::ALL {
        for pass in Pass::ALL {
            for &(mg, k, s) in &shapes {
                let gather = pass != Pass::BackwardWeight;
                let rows_stride = s == 1 || pass == Pass::Forward;
                // Kernels past 3x3 take the rows kernel in f32, and in 16-bit on small images
                // (forward and backward-data; `rows_small_image_most`): both it and the
                // tensor-core kernel (stride 1) or the stencil (stride 2) are listed.
                let larger = k > 3;
                let sixteen = dtype != DType::F32;
                let small_image_ok = gather && rows_small_image_most(s, k * k) > 0;
                let rows = arch >= ROWS_ARCH
                    && mg == 1
                    && rows_stride
                    && (!larger || !sixteen || small_image_ok);
                let tensor =
                    arch >= TENSOR_ARCH && mg == 1 && s == 1 && gather && sixteen && larger;
                let small_images_only = sixteen && larger;
                // Backward-weight of small images stays on the stencil: both are listed.
                let variants: &[Variant] = match (rows, tensor) {
                    (true, true) => &[Variant::Tensor, Variant::Rows],
                    (true, false) if gather && !small_images_only => &[Variant::Rows],
                    (true, false) => &[Variant::Rows, Variant::Stencil],
                    (false, true) => &[Variant::Tensor],
                    (false, false) => &[Variant::Stencil],
                };
                for &variant in variants {
                    let shape = Shape {
                        mg,
                        kernel: [k, k],
                        stride: [s, s],
                        out_tile: match variant {
                            Variant::Rows => [1, rows_columns(dtype, [k, k])],
                            Variant::Tensor => [1, SEGMENT],
                            Variant::Stencil => stencil_tile(pass, false, [s, s]),
                            Variant::Columns { .. } => [1, COLUMNS_TW],
                        },
                        variant,
                    };
                    out.push(spec(dtype, pass, shape));
                    if takes_wide_tile(pass, &shape) {
                        let wide = Shape {
                            out_tile: WIDE_TILE,
                            ..shape
                        };
                        out.push(spec(dtype, pass, wide));
                    }
                }
                // Forward and backward-data of 3x3 layers on small images are the column walks',
                // a row or part of one a thread (stride 2: the 16-bit forward).
                if gather && mg == 1 && k == 3 && (s == 1 || pass == Pass::Forward && sixteen) {
                    for tw in COLUMNS_OUTPUT_TW {
                        let columns = Shape {
                            mg,
                            kernel: [k, k],
                            stride: [s, s],
                            out_tile: [1, tw],
                            variant: Variant::Columns {
                                vector: COLUMNS_OUTPUT_VECTOR,
                            },
                        };
                        out.push(spec(dtype, pass, columns));
                    }
                }
                // Backward-weight of 3x3 layers with few channels (16: MobileNetV3) is the
                // column walks'.
                if !gather && mg == 1 && k == 3 {
                    let columns = Shape {
                        mg,
                        kernel: [k, k],
                        stride: [s, s],
                        out_tile: [1, COLUMNS_TW],
                        variant: Variant::Columns {
                            vector: columns_most_vector(dtype, [k, k]),
                        },
                    };
                    out.push(spec(dtype, pass, columns));
                }
            }
        }
    }
    out
}

/// Whether the tensor-core kernel takes `key` (which the family takes): 16-bit forward or
/// backward-data on sm_80 on, one output channel a group, a column stride of 1, channels in
/// whole 16-byte units and aligned operands, and offsets within one image of either operand
/// that fit the kernel's 32-bit arithmetic.
fn takes_tensor(key: &PlanKey) -> bool {
    let g = &key.geometry;
    let image = |e: [usize; 3], c: usize| e.iter().product::<usize>() * c <= i32::MAX as usize;
    key.arch >= TENSOR_ARCH
        && matches!(key.dtype, DType::F16 | DType::BF16)
        && key.pass != Pass::BackwardWeight
        && g.cout == g.groups
        && g.stride[2] == 1
        && (key.pass == Pass::Forward || g.stride[1] == 1)
        && g.kernel[2] <= 9
        && key.aligned
        && (g.cin * key.dtype.size()) % 16 == 0
        && image(g.input, g.cin)
        && image(g.output, g.cout)
}

/// Whether the plan runs `key` (which the family takes) on the rows kernel, where it can
/// ([`rows_fit`]): kernels up to 3x3 always; larger ones (one channel a thread) in f32 and, in
/// 16-bit, only the forward and backward-data on small images (`rows_small_image_most`):
/// elsewhere in 16-bit the tensor-core kernel and the stencil are faster.
pub fn takes_rows(key: &PlanKey) -> bool {
    let g = &key.geometry;
    let gathered_rows = match key.pass {
        Pass::BackwardData => g.input[1],
        _ => g.output[1],
    };
    let taps = g.kernel[1] * g.kernel[2];
    let small_image = gathered_rows <= rows_small_image_most(g.stride[1], taps);
    let larger_ok = key.dtype == DType::F32 || key.pass != Pass::BackwardWeight && small_image;
    rows_fit(key) && (rows_vector([g.kernel[1], g.kernel[2]]) == 4 || larger_ok)
}

/// Whether the rows kernel can run `key` (which the family takes): sm_80 on, one output channel
/// a group, stride 1 (the forward: 1 or 2, the same along both dims), kernels of 2-7 rows and up
/// to 7 columns, aligned operands and channels in whole copies, and offsets within one image of
/// either operand that fit 32 bits.
pub fn rows_fit(key: &PlanKey) -> bool {
    let g = &key.geometry;
    let kernel = [g.kernel[1], g.kernel[2]];
    let image = |e: [usize; 3], c: usize| e.iter().product::<usize>() * c <= i32::MAX as usize;
    key.arch >= ROWS_ARCH
        && g.cout == g.groups
        && g.stride[1] == g.stride[2]
        && (g.stride[1] == 1 || g.stride[1] == 2 && key.pass == Pass::Forward)
        && (2..=MAX_KERNEL).contains(&kernel[0])
        && kernel[1] <= MAX_KERNEL
        && key.aligned
        && g.cin % rows_granule(key.dtype, kernel) == 0
        && image(g.input, g.cin)
        && image(g.output, g.cout)
}

/// Channels a thread of the rows kernel takes (the template's V): a vector of 4 for kernels
/// up to 3x3; one channel for larger ones, so that a thread's weights (49 for 7x7) stay in
/// registers as f32 beside its rows of accumulators.
fn rows_vector(kernel: [usize; 2]) -> usize {
    if kernel[0] <= 3 && kernel[1] <= 3 {
        4
    } else {
        1
    }
}

/// Channels one copy of the rows kernel moves (the template's CG): the thread's vector of 4,
/// else 16 bytes. Channel counts and chunks are whole copies.
fn rows_granule(dtype: DType, kernel: [usize; 2]) -> usize {
    match rows_vector(kernel) {
        4 => 4,
        _ => 16 / dtype.size(),
    }
}

/// Output columns a thread of the rows kernel computes (the template's TW): with vectors of 4,
/// four in 16-bit and two in f32, whose windows take twice the registers; with one channel,
/// four.
fn rows_columns(dtype: DType, kernel: [usize; 2]) -> usize {
    if dtype == DType::F32 && rows_vector(kernel) == 4 {
        2
    } else {
        4
    }
}

/// How the rows kernel walks a layer: a block's channel vectors (blockDim.x) and column groups
/// (blockDim.y), chunks of channels and bands of columns, and rows a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RowsWalk {
    vectors: usize,
    groups: usize,
    chunks: usize,
    bands: usize,
    segment: usize,
    shared: usize,
}

/// What a backward-weight layer and walk must be for the plan to run it on the rows kernel
/// rather than the stencil (persistent blocks of 32 channels, which fill the GPU at any size):
/// a channel count that leaves some of the stencil's lanes idle (not a multiple of 32: with
/// every lane busy its long per-block sums beat the rows' per-block partials); each block
/// summing at least 512 outputs a channel (rows of its segment times columns of its band), so
/// that its pipeline's start and its f32 partial are a small part of it; and the blocks filling
/// two thirds of the GPU's 16-warp slots at once. H100, 3x3 layers, rows / stencil: walks of
/// 32-392 outputs a block 0.59-0.92x, one of 784 whose blocks held a third of the slots 0.70x;
/// past both floors, 8, 24, 40, 120 and 144 channels 1.00-2.31x, and 32, 96 and 480 channels
/// 0.89-0.98x in 16-bit and for two of three layers in f32.
const ROWS_WEIGHT_OUTPUTS: usize = 512;
const ROWS_WEIGHT_FILL: (usize, usize) = (2, 3);

/// The rows kernel's walk of `key` (which it takes) over the gather's output (backward-weight:
/// the cotangent), on `sms` multiprocessors with `limit` bytes of shared memory a block; None
/// where no block fits. A block of V-channel vectors x column groups (at most [`THREADS`], the
/// widest chunk of channels that fits, columns split evenly into bands); then the segment
/// length with the least modelled time: each wave of blocks takes its segment's source rows
/// plus the ring's first rows in flight, at the pace of one 16-warp SM (the launch bound allows
/// 128 registers: 16 warps an SM), slower in proportion where more warps share an SM (with one
/// channel a thread, whose rows take 25-49 FMAs an output, where more than 8 do: H100, 512
/// channels of 7x7 with a 7x7 kernel, f32, one segment of 8 warps an SM 6.0 TFLOP/s against
/// 4.7 for two of 16);
/// backward-weight adds the f32 partials each block along x writes and the split sum reads, in
/// steps of what the GPU's threads copy in one, and unless `any_walk` takes only channel counts
/// and walks past the floors of [`ROWS_WEIGHT_OUTPUTS`] and [`ROWS_WEIGHT_FILL`]. Narrower chunks
/// (more blocks) are tried where the layer has few.
fn choose_rows(key: &PlanKey, sms: usize, limit: usize, any_walk: bool) -> Option<RowsWalk> {
    let g = &key.geometry;
    let (pass, dtype) = (key.pass, key.dtype);
    let kernel = [g.kernel[1], g.kernel[2]];
    let extents = if pass == Pass::BackwardData {
        g.input
    } else {
        g.output
    };
    let out = [extents[1], extents[2]];
    let (channels, batch) = (g.cin, g.batch);
    let v = rows_vector(kernel);
    // Channel vectors a chunk is made of: whole copies, at most the block's x.
    let per_copy = rows_granule(dtype, kernel) / v;
    let most_vectors = if v == 4 {
        ROWS_MAX_VECTORS
    } else {
        ROWS_MAX_CHANNELS
    };
    let vectors_all = channels / v;
    let tw = rows_columns(dtype, kernel);
    let weight = pass == Pass::BackwardWeight;
    if weight && !any_walk && channels % LANES == 0 {
        return None; // every lane of the stencil busy: it sums faster
    }
    let depth = ROWS_AHEAD + if weight { kernel[0] } else { 1 };
    let stride = g.stride[1];
    // Bytes the GPU's threads copy in one step (source and cotangent windows).
    let step_bytes = sms * 16 * 32 * tw * v * dtype.size() * 2;
    let taps = kernel[0] * kernel[1];
    let column_groups = out[1].div_ceil(tw);
    let fewest_chunks = vectors_all.div_ceil(most_vectors);
    // (walk, cost, thread slots)
    let mut best: Option<(RowsWalk, usize, usize)> = None;
    // One-channel chunks are whole warps (with fewer channels, a warp's lanes of different
    // column groups read the same shared-memory banks): only the fewest chunks are tried.
    let tries = if v == 1 { 1 } else { 3 };
    for chunks in [fewest_chunks, 2 * fewest_chunks, 4 * fewest_chunks]
        .into_iter()
        .take(tries)
    {
        let vectors = if v == 1 {
            vectors_all
                .next_multiple_of(per_copy)
                .min(ROWS_MAX_CHANNELS)
        } else {
            vectors_all.div_ceil(chunks)
        };
        if chunks > fewest_chunks && vectors < 8 {
            break;
        }
        let chunks = vectors_all.div_ceil(vectors);
        let most = (THREADS as usize / vectors).clamp(1, column_groups);
        let bands = column_groups.div_ceil(most);
        let groups = column_groups.div_ceil(bands);
        let warps = (vectors * groups).div_ceil(32);
        let cols = (groups * tw - 1) * stride + kernel[1];
        let chans = vectors * v;
        // The source ring, backward-weight's cotangent ring and its column groups' f32 sums
        // (which reuse the rings).
        let rings = depth * (cols + if weight { groups * tw } else { 0 }) * chans * dtype.size();
        let sums = if weight { groups * taps * chans * 4 } else { 0 };
        let shared = rings.max(sums);
        if shared > limit {
            continue;
        }
        let per_sm = (16 / warps).min((limit + 1024) / (shared + 1024)).max(1);
        let slots = chunks * vectors * bands * groups;
        for segments in 1..=out[0] {
            let segment = out[0].div_ceil(segments);
            if out[0].div_ceil(segment) != segments {
                continue; // the same segments as a shorter one
            }
            let blocks = batch * segments * bands * chunks;
            if weight && !any_walk {
                let (part, whole) = ROWS_WEIGHT_FILL;
                let fills = blocks.min(per_sm * sms) * warps * whole >= sms * 16 * part;
                if segment * groups * tw < ROWS_WEIGHT_OUTPUTS || !fills {
                    continue;
                }
            }
            let waves = blocks.div_ceil(per_sm * sms);
            let resident = per_sm.min(blocks.div_ceil(sms)) * warps;
            let pace = resident.max(if v == 1 { 8 } else { 16 });
            let source_rows = (segment - 1) * stride + kernel[0];
            let mut cost = waves * (source_rows + ROWS_AHEAD) * pace;
            if weight {
                let splits = batch * segments * bands;
                let partials = if splits > 1 {
                    splits * channels * taps * 4 * 2
                } else {
                    0
                };
                cost += partials * 16 / step_bytes;
            }
            let better = match best {
                None => true,
                Some((_, c, s)) => (cost, slots) < (c, s),
            };
            if better {
                let walk = RowsWalk {
                    vectors,
                    groups,
                    chunks,
                    bands,
                    segment,
                    shared,
                };
                best = Some((walk, cost, slots));
            }
        }
    }
    best.map(|(w, ..)| w)
}

/// The rows kernel's launch of `key` (which it can run: [`rows_fit`]), or None where no
/// block fits or, for backward-weight, no walk is past the plan's floors (`any_walk`, for the
/// tests: any walk will do).
pub fn rows_launch(key: &PlanKey, sms: usize, limit: usize, any_walk: bool) -> Option<Launch> {
    let g = &key.geometry;
    let pass = key.pass;
    let shape = Shape::rows(g, key.dtype);
    let walk = choose_rows(key, sms.max(1), limit, any_walk)?;
    let tile = [walk.segment, walk.groups * shape.out_tile[1]];
    let problem = walk_problem(g, pass, tile, walk.bands, walk.chunks)?;
    let tiles = problem.tiles as usize;
    Some(Launch {
        pass,
        shape,
        problem,
        grid: (tiles as u32, walk.chunks as u32, 1),
        block: (walk.vectors as u32, walk.groups as u32, 1),
        shared: walk.shared,
        // Backward-weight: one f32 partial a block along x.
        splits: if pass == Pass::BackwardWeight {
            tiles
        } else {
            1
        },
    })
}

/// The problem of a rows or column-walks launch over `g`'s gather output for `pass`: segments of
/// `tile[0]` rows, bands of `tile[1]` columns (`bands` an image), `chunks` of channels; whole
/// copies, no tile base. None where the tiles or chunks overflow the grid.
fn walk_problem(
    g: &Geometry,
    pass: Pass,
    tile: [usize; 2],
    bands: usize,
    chunks: usize,
) -> Option<Problem> {
    let (out, src) = match pass {
        Pass::BackwardData => (g.input, g.output),
        _ => (g.output, g.input),
    };
    let tiles_h = out[1].div_ceil(tile[0]);
    let tiles = g.batch * tiles_h * bands;
    if tiles > i32::MAX as usize || chunks > 65535 {
        return None;
    }
    let off = |d: usize| source_offset(g, pass, d) as i32;
    Some(Problem {
        batch: g.batch as i32,
        src_h: src[1] as i32,
        src_w: src[2] as i32,
        src_c: g.cin as i32,
        out_h: out[1] as i32,
        out_w: out[2] as i32,
        out_c: g.cin as i32,
        off_h: off(1),
        off_w: off(2),
        tile_h: tile[0] as i32,
        tile_w: tile[1] as i32,
        tiles_h: tiles_h as i32,
        tiles_w: bands as i32,
        tiles: tiles as i32,
        chunks: chunks as i32,
        reverse: (g.flip != (pass == Pass::BackwardData)) as i32,
        vec_src: 1,
        vec_dy: 0,
        tiles_per_split: 0,
        base_h: 0,
        base_w: 0,
        split_halo: 0,
    })
}

/// Channels a column walk's thread takes at most (its vector), by kernel size: 4 up to 3x3,
/// 2 up to 25 taps, else 1, so that its KH x KW x V sums stay in registers beside its window;
/// half that (at least 1) in f32, whose window a step ahead takes twice the registers (at 4,
/// ptxas spilled 388 bytes of the 3x3 kernel).
fn columns_most_vector(dtype: DType, kernel: [usize; 2]) -> usize {
    let most = match kernel[0] * kernel[1] {
        0..=9 => 4,
        10..=25 => 2,
        _ => 1,
    };
    if dtype == DType::F32 {
        (most / 2).max(1)
    } else {
        most
    }
}

/// Output columns a thread of the column walks takes in backward-weight (the template's TW).
const COLUMNS_TW: usize = 2;
/// Output columns a thread of the column walks takes in the forward and backward-data: a
/// whole row of 7 or 14 columns (two threads), else 3 ([`columns_output_tw`]).
const COLUMNS_OUTPUT_TW: [usize; 2] = [3, 7];
/// Channels a thread of the column walks takes in the forward and backward-data: two, whose
/// window, sums and weights fit the registers at up to 7 columns (a standalone probe of this
/// walk on an H200, f16 3x3: 4-byte vectors 1.2-1.7x the 8- and 16-byte ones on 7x7 to 28x28
/// images).
const COLUMNS_OUTPUT_VECTOR: usize = 2;
/// The widest images whose 16-bit forward and backward-data the column walks take at stride 1
/// (rows and columns; f32 and stride 2: half). H200, 16-bit 3x3, against the streamed rows:
/// 0.99-1.40x forward and 0.97-1.31x backward-data on 7x7 to 20x20 images, 0.6-1.0x on 28x28.
const COLUMNS_OUTPUT_MOST: usize = 20;

/// Output columns a thread of the column walks takes in the forward and backward-data of
/// images `width` columns wide: one of [`COLUMNS_OUTPUT_TW`].
fn columns_output_tw(width: usize) -> usize {
    if width % 7 == 0 && width <= 14 {
        7
    } else {
        3
    }
}
/// Channel vectors a column-walk block takes at most along x.
const COLUMNS_MAX_VECTORS: usize = 64;

/// Whether the column walks can run `key` (which the family takes): one output channel a
/// group, kernels of 2-7 rows, the same stride along both dims (backward-data: 1), and offsets
/// within one image of either operand that fit 32 bits. Any architecture: plain loads.
pub fn columns_fit(key: &PlanKey) -> bool {
    let g = &key.geometry;
    let image = |e: [usize; 3], c: usize| e.iter().product::<usize>() * c <= i32::MAX as usize;
    (key.pass != Pass::BackwardData || g.stride[1] == 1)
        && g.cout == g.groups
        && g.stride[1] == g.stride[2]
        && (2..=MAX_KERNEL).contains(&g.kernel[1])
        && g.kernel[2] <= MAX_KERNEL
        && image(g.input, g.cin)
        && image(g.output, g.cout)
}

/// Whether the plan runs `key` (backward-weight, which the family takes) on the column walks,
/// given whether the rows kernel would (`rows_runs`): where they can ([`columns_fit`]), kernels
/// of up to 9 taps, and a channel count that leaves many of the other kernels' 32-channel lanes
/// idle: fewer than 3 in 5 busy (6, 8, 16, 17, 36 channels), or at stride 1 fewer than 4 in 5
/// where the rows kernel does not run the layer (the stencil would: 20, 100 channels).
/// H200, column walks / the kernels before them, 3x3 layers, two rounds, every dtype: fewer
/// than 3 in 5 busy 1.15-13.1x (3-36 channels, strides 1 and 2); 20 and 100 channels at 28x28
/// (stencil) 0.98-3.2x; where the rows kernel runs 40-72 channels 0.82-1.26x (f32 and bf16
/// slower), so it keeps them; the stencil's 40 channels at stride 2 0.86-1.08x; full chunks
/// (32-1,280 channels) 0.53-1.21x and 5x5 and 7x7 kernels 0.53-0.96x.
pub fn takes_columns(key: &PlanKey, rows_runs: bool) -> bool {
    let g = &key.geometry;
    if key.pass != Pass::BackwardWeight {
        return takes_columns_output(key);
    }
    let lanes = LANES * g.cin.div_ceil(LANES);
    let sparse = 5 * g.cin < 3 * lanes;
    let stencil_sparse = !rows_runs && g.stride[1] == 1 && 5 * g.cin < 4 * lanes;
    columns_fit(key) && g.kernel[1] * g.kernel[2] <= 9 && (sparse || stencil_sparse)
}

/// Whether the plan runs the forward or backward-data of `key` on the column walks: 3x3 (or
/// smaller) kernels on small images, channels in pairs and aligned operands. The gather's
/// output is at most [`COLUMNS_OUTPUT_MOST`] rows and columns for 16-bit at stride 1, half that
/// for f32 at stride 1 and for the 16-bit forward at stride 2 (about the same source image);
/// those two also only where the launch fills the GPU ([`columns_fill`]).
/// H200, against the streamed rows: f32 on 7x7 to 10x10 images 1.02-1.42x (six layers), on
/// 11x11 to 20x20 0.85-1.22x with no rule found that parts them; 16-bit stride-2 forwards of
/// 7x7 to 10x10 outputs 1.03-1.43x, of 11x11 to 20x20 0.85-1.24x.
fn takes_columns_output(key: &PlanKey) -> bool {
    let g = &key.geometry;
    let out = if key.pass == Pass::BackwardData {
        g.input
    } else {
        g.output
    };
    let most = match (g.stride[1], key.dtype) {
        (1, DType::F16 | DType::BF16) => COLUMNS_OUTPUT_MOST,
        (1, _) | (2, DType::F16 | DType::BF16) => COLUMNS_OUTPUT_MOST / 2,
        _ => 0,
    };
    columns_fit(key)
        && g.kernel[1] <= 3
        && g.kernel[2] <= 3
        && out[1] <= most
        && out[2] <= most
        && g.cin % COLUMNS_OUTPUT_VECTOR == 0
        && key.aligned
}

/// Whether the plan keeps a launch of the column walks for `key` on `sms` multiprocessors:
/// backward-weight (persistent blocks) and 16-bit at stride 1 always; the forward and
/// backward-data of f32 and at stride 2 where the launch fills the
/// GPU without a second round, 4 to 16 warps an SM (a block walks a whole image, so there is
/// no finer unit to share out). H200, against the streamed rows: f32 0.87x at 23 warps an SM
/// (128 x 384 channels at 12x12: 384 blocks where 264 are resident) and 0.89x at 3.9 (32 x 128
/// channels at 20x20, 64 blocks); 16-bit stride-2 0.93x at 2.9 (96 x 144 channels, 14x14 to
/// 7x7). 16-bit stride-1 layers outside the range read 0.96-1.09x (64 x 320 channels at 13x13,
/// 17.5 warps an SM: 1.05-1.09x), so they keep the walks.
fn columns_fill(launch: &Launch, key: &PlanKey, sms: usize) -> bool {
    if key.pass == Pass::BackwardWeight || key.dtype != DType::F32 && key.geometry.stride[1] == 1 {
        return true;
    }
    let (vectors, groups, _) = launch.block;
    let warps = launch.grid.0 as usize * (vectors * groups).div_ceil(32) as usize;
    (4 * sms..=16 * sms).contains(&warps)
}

/// The column walks' vector: the widest of 4, 2 and 1 that the kernel allows
/// ([`columns_most_vector`]) and the channel count divides, 1 for operands not 16-byte aligned.
fn columns_vector(dtype: DType, kernel: [usize; 2], channels: usize, aligned: bool) -> usize {
    let most = if aligned {
        columns_most_vector(dtype, kernel)
    } else {
        1
    };
    [4, 2, 1]
        .into_iter()
        .find(|&v| v <= most && channels % v == 0)
        .unwrap_or(1)
}

/// The column walks' launch of `key` (which they can run: [`columns_fit`]) on `sms`
/// multiprocessors with `limit` bytes of shared memory a block, or None where the block's sums
/// do not fit. A block takes a chunk of at most `COLUMNS_MAX_VECTORS` channel vectors (chunks
/// balanced) and as many column groups of TW columns as [`THREADS`] allows (bands balanced).
/// Backward-weight: blocks are persistent, as many as the SMs hold at 16 warps each (the launch
/// bound allows 128 registers), over the segments of least modelled time. Forward and
/// backward-data: one segment an image and a block a (chunk, tile).
pub fn columns_launch(key: &PlanKey, sms: usize, limit: usize) -> Option<Launch> {
    let g = &key.geometry;
    let pass = key.pass;
    let weight = pass == Pass::BackwardWeight;
    let kernel = [g.kernel[1], g.kernel[2]];
    let stride = g.stride[1];
    // The gather's output (backward-weight: the cotangent).
    let out = if pass == Pass::BackwardData {
        g.input
    } else {
        g.output
    };
    let widest = columns_vector(key.dtype, kernel, g.cin, key.aligned);
    let (v, tw) = if weight {
        (widest, COLUMNS_TW)
    } else {
        (widest.min(COLUMNS_OUTPUT_VECTOR), columns_output_tw(out[2]))
    };
    let vectors_all = g.cin / v;
    let chunks = vectors_all.div_ceil(COLUMNS_MAX_VECTORS);
    let vectors = vectors_all.div_ceil(chunks);
    let column_groups = out[2].div_ceil(tw);
    let most = (THREADS as usize / vectors).clamp(1, column_groups);
    let bands = column_groups.div_ceil(most);
    let groups = column_groups.div_ceil(bands);
    let shared = if weight {
        groups * kernel[0] * kernel[1] * vectors * v * 4
    } else {
        0
    };
    if shared > limit {
        return None;
    }
    let warps = (vectors * groups).div_ceil(32);
    let per_sm = (16 / warps).clamp(1, ((limit + 1024) / (shared + 1024)).max(1));
    let slots = (per_sm * sms.max(1) / chunks).max(1);
    // Forward and backward-data walk whole images, a block a tile: on small images the
    // segments' halo rows and the persistent blocks' second rounds cost more than the wider
    // grid.
    let segment = if weight {
        least_cost_segment(out[1], g.batch * bands, stride, kernel[0], slots)?
    } else {
        (out[1] > 0).then_some(out[1])?
    };
    let problem = walk_problem(g, pass, [segment, groups * tw], bands, chunks)?;
    // Backward-weight: persistent blocks along x, chunks along y. Forward and backward-data: a
    // block a (chunk, tile), chunks fastest, along x.
    let grid = if weight {
        ((problem.tiles as usize).min(slots), chunks)
    } else {
        (problem.tiles as usize * chunks, 1)
    };
    if grid.0 > i32::MAX as usize {
        return None;
    }
    Some(Launch {
        pass,
        shape: Shape {
            out_tile: [1, tw],
            variant: Variant::Columns { vector: v },
            ..Shape::of(pass, g)
        },
        problem,
        grid: (grid.0 as u32, grid.1 as u32, 1),
        block: (vectors as u32, groups as u32, 1),
        shared,
        // Backward-weight: one f32 partial a block along x.
        splits: if weight { grid.0 } else { 1 },
    })
}

/// Backward-weight's segment of an image `rows` output rows high (`tiles_a_row` tiles a
/// segment row: batch times bands), with the least modelled time on `slots` persistent blocks:
/// the busiest block's tiles times the source rows a tile walks (shorter segments give more
/// tiles to share out and read KH - S halo rows more each). None for an empty image.
fn least_cost_segment(
    rows: usize,
    tiles_a_row: usize,
    stride: usize,
    kernel_rows: usize,
    slots: usize,
) -> Option<usize> {
    // (cost, segment)
    let mut best: Option<(usize, usize)> = None;
    for segments in 1..=rows {
        let segment = rows.div_ceil(segments);
        if rows.div_ceil(segment) != segments {
            continue; // the same segments as a shorter one
        }
        let tiles = tiles_a_row * segments;
        let source_rows = (segment - 1) * stride + kernel_rows;
        let cost = tiles.div_ceil(tiles.min(slots)) * source_rows;
        if best.map_or(true, |(c, _)| cost < c) {
            best = Some((cost, segment));
        }
    }
    best.map(|(_, segment)| segment)
}

/// The source position of the gather's output 0 at tap 0 along dim `d` (the problem's off_h,
/// off_w): backward-data walks the taps backwards over the cotangent.
fn source_offset(g: &Geometry, pass: Pass, d: usize) -> i64 {
    match pass {
        Pass::BackwardData => g.pad_lo[d] as i64 - (g.kernel[d] as i64 - 1),
        _ => -(g.pad_lo[d] as i64),
    }
}

/// Why the family does not take `key`, or None.
pub fn unsupported(path: ConvPath, key: &PlanKey) -> Option<&'static str> {
    let g = &key.geometry;
    if path == ConvPath::Igemm {
        return Some("KILN_CONV_PATH=igemm");
    }
    if g.groups != g.cin || g.groups < 1 {
        return Some("not depthwise");
    }
    if !MULTIPLIERS.contains(&(g.cout / g.groups)) {
        return Some("a channel multiplier the family does not take");
    }
    tile_limits(key, MAX_KERNEL, MAX_STRIDE, MAX_STRIDE)
}

/// The kernel's view of a problem: `struct kiln_depthwise` in the template.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Problem {
    pub batch: i32,
    pub src_h: i32,
    pub src_w: i32,
    pub src_c: i32,
    pub out_h: i32,
    pub out_w: i32,
    pub out_c: i32,
    pub off_h: i32,
    pub off_w: i32,
    pub tile_h: i32,
    pub tile_w: i32,
    pub tiles_h: i32,
    pub tiles_w: i32,
    pub tiles: i32,
    pub chunks: i32,
    pub reverse: i32,
    pub vec_src: i32,
    pub vec_dy: i32,
    pub tiles_per_split: i32,
    pub base_h: i32,
    pub base_w: i32,
    /// The tensor-core kernel's plane layout: 1 keeps each staged row's last 16-byte unit in a
    /// second region, so that its ldmatrix reads meet no bank twice (`kiln_staged_of`).
    pub split_halo: i32,
}

/// A plan's launch: the problem, the grid and block, dynamic shared memory, and the splits of
/// backward-weight's sum (one f32 partial a block along x).
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    pub pass: Pass,
    pub shape: Shape,
    pub problem: Problem,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared: usize,
    pub splits: usize,
}

/// Dynamic shared memory of a block with a `tile` of outputs, as the template lays it out:
/// forward and backward-data the weights as f32, then two tile buffers (the source rows, and
/// for backward-weight the cotangent) as they are in memory; backward-weight reuses them for
/// its warps' sums. The tensor-core kernel's also depends on its planes' layout (`split_halo`,
/// see [`Problem::split_halo`]).
pub fn shared_bytes(
    dtype: DType,
    pass: Pass,
    s: Shape,
    tile: [usize; 2],
    split_halo: bool,
) -> usize {
    if s.variant == Variant::Tensor {
        return tensor_shared_bytes(s, tile, split_halo);
    }
    let (per, planes) = s.staged(pass);
    let [rows, cols] = s.source_extent(pass, tile);
    let taps = s.kernel[0] * s.kernel[1];
    let mut buffer = rows * cols * per;
    if pass == Pass::BackwardWeight {
        buffer += tile[0] * tile[1] * LANES;
    }
    let buffers = 2 * buffer * dtype.size();
    match pass {
        Pass::BackwardWeight => buffers.max(WARPS * taps * LANES * 4),
        _ => planes * taps * LANES * 4 + buffers,
    }
}

/// Blocks of `shared` bytes an SM holds, with the kernel's launch bound: an SM has about
/// `limit` (a block's most) plus 1 KiB, and reserves 1 KiB a block.
fn blocks_per_sm(s: Shape, shared: usize, limit: usize) -> usize {
    ((limit + 1024) / (shared + 1024)).min(s.min_blocks())
}

/// The output tile of `pass` over `out` (rows, columns) extents within `limit` bytes of shared
/// memory, and the blocks an SM then holds. Preferred, in order: tiles that give each of a
/// block's warps a sub-tile; enough tiles that each block walks several (`want` blocks of
/// TILES_PER_BLOCK), where any does; the least work, counting each staged value as two FMAs of
/// a lane (its share of a copy, the window's read and conversion) and each output slot a warp
/// computes, used or idle, as its taps; two blocks an SM at least.
fn choose_tile(
    dtype: DType,
    pass: Pass,
    s: Shape,
    out: [usize; 2],
    images_x_chunks: usize,
    sms: usize,
    limit: usize,
) -> Option<TileChoice> {
    let [oth, otw] = s.out_tile;
    let (per, _) = s.staged(pass);
    let taps = s.kernel[0] * s.kernel[1];
    let mut best: Option<TileChoice> = None;
    for th in (oth..=out[0].next_multiple_of(oth).min(32)).step_by(oth) {
        for tw in (otw..=out[1].next_multiple_of(otw).min(64)).step_by(otw) {
            let shared = shared_bytes(dtype, pass, s, [th, tw], false);
            let per_sm = blocks_per_sm(s, shared, limit);
            if shared > limit || per_sm < 2 && best.is_some() {
                continue;
            }
            let subs = (th / oth) * (tw / otw);
            let full = subs >= WARPS;
            let tiles = out[0].div_ceil(th) * out[1].div_ceil(tw) * images_x_chunks;
            let enough = tiles >= TILES_PER_BLOCK * per_sm * sms;
            let [rows, cols] = s.source_extent(pass, [th, tw]);
            let staged = tiles * rows * cols;
            let slots = tiles * subs.div_ceil(WARPS) * WARPS * oth * otw;
            let choice = TileChoice {
                tile: [th, tw],
                per_sm,
                full,
                enough,
                cost: staged * per * 2 + slots * LANES * taps,
                staged,
                slots,
            };
            if best.map_or(true, |b| choice.rank() > b.rank()) {
                best = Some(choice);
            }
        }
    }
    best.map(|b| TileChoice {
        per_sm: b.per_sm.max(1),
        ..b
    })
}

/// A stencil tile [`choose_tile`] found, with what it ranks tiles by.
#[derive(Clone, Copy, Debug)]
struct TileChoice {
    tile: [usize; 2],
    /// Blocks an SM holds.
    per_sm: usize,
    /// Every warp of a block has a sub-tile.
    full: bool,
    /// Enough tiles that each block walks several.
    enough: bool,
    /// The model's work (see `choose_tile`).
    cost: usize,
    /// Source values a lane stages over every tile.
    staged: usize,
    /// Outputs the warps compute over every tile, idle sub-tile slots of a block's last round
    /// included.
    slots: usize,
}

impl TileChoice {
    /// Larger is better: two blocks an SM, full warps, enough tiles, then the least work.
    fn rank(&self) -> (bool, bool, bool, std::cmp::Reverse<usize>) {
        (
            self.per_sm >= 2,
            self.full,
            self.enough,
            std::cmp::Reverse(self.cost),
        )
    }
}

/// The stencil's shape and tile for `pass` of `s` (see [`choose_tile`]): backward-weight that
/// may take [`WIDE_TILE`] compares the best tile of each sub-tile (see [`wide_tile_wins`]).
fn choose_stencil_tile(
    dtype: DType,
    pass: Pass,
    s: Shape,
    out: [usize; 2],
    images_x_chunks: usize,
    sms: usize,
    limit: usize,
) -> Option<(Shape, TileChoice)> {
    let choose =
        |s: Shape| choose_tile(dtype, pass, s, out, images_x_chunks, sms, limit).map(|c| (s, c));
    let square = choose(s);
    if !takes_wide_tile(pass, &s) {
        return square;
    }
    let wide = choose(Shape {
        out_tile: WIDE_TILE,
        ..s
    });
    match (square, wide) {
        (Some(a), Some(b)) => Some(if wide_tile_wins(&a.1, &b.1) { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// Whether the best [`WIDE_TILE`] tile beats the best 4 x 4 one. Measured on the H100 over 45
/// layers with 5x5 and 7x7 kernels, every dtype, each both ways (`choose_tile`'s FMA count had
/// ranked 4 x 4 first on layers that ran up to 1.19x faster on 4 x 7):
/// - Where wide tiles give every warp a sub-tile (16-bit), they ran 1.03-1.20x as fast where
///   their output slots (idle ones in a block's last round included) are at most 5% more than
///   the square tiles', and 0.92-1.02x at 9-75% more; but they beat the square 5x5 spec bound
///   to three blocks an SM (80 registers) at up to 17% more slots (1.02-1.18x). None that
///   staged 20% or more source values won (0.92-0.95x at 20% more, 0.82x at 41%).
/// - Where they leave warps idle (f32: its full wide tiles do not fit two blocks' shared
///   memory) but the square ones do not, the copy bounds the block: 1.01-1.20x where they stage
///   8-31% fewer source values, 0.77-0.92x where they stage 5-30% more.
/// - Where the square tiles leave warps idle too (images of 7 rows), the wide sub-tile's longer
///   walk is the block's critical path: 0.78-0.81x.
fn wide_tile_wins(square: &TileChoice, wide: &TileChoice) -> bool {
    let at_most = |a: usize, b: usize, percent: usize| a * 100 <= b * percent;
    let wins = match (wide.full, square.full) {
        (true, _) => {
            at_most(wide.staged, square.staged, 119)
                && (at_most(wide.slots, square.slots, 105) || square.per_sm >= 3)
        }
        (false, true) => at_most(wide.staged, square.staged, 92),
        (false, false) => false,
    };
    wins && wide.per_sm >= 2
}

/// Elements between two channel planes of `cells` cells, as the tensor-core template spaces
/// them (8 past a multiple of 64: 4 words past a multiple of 32).
fn plane_stride(cells: usize) -> usize {
    cells.div_ceil(64) * 64 + 8
}

/// Elements of a tensor-core source plane for `rows` staged rows of `tile_w` outputs at row
/// stride `stride`, as `kiln_staged_of` lays it out: rows packed (`tile_w / 8 + 1` units of 8
/// elements a row), or with `split_halo` the rows' first `tile_w / 8` units packed and their
/// last units in a second region, each of `stride` classes of rows `span` units in both.
fn tensor_source_plane(rows: usize, tile_w: usize, stride: usize, split_halo: bool) -> usize {
    let per_row = tile_w / SEGMENT;
    if !split_halo {
        return rows * (tile_w + SEGMENT);
    }
    let span = (rows.div_ceil(stride) * per_row + 1).next_multiple_of(8);
    2 * stride * span * 8
}

/// Dynamic shared memory of a tensor-core block with a `tile` of outputs, as the template lays
/// it out: the weights, the raw copy of the tile's source (its rows, the tile's columns plus a
/// segment), the source's channel planes and the output planes.
fn tensor_shared_bytes(s: Shape, tile: [usize; 2], split_halo: bool) -> usize {
    let rows = (tile[0] - 1) * s.stride[0] + s.kernel[0];
    let cols = tile[1] + SEGMENT;
    let weights = (TENSOR_CHANNELS * s.kernel[0] * s.kernel[1] * 2).next_multiple_of(16);
    let source = tensor_source_plane(rows, tile[1], s.stride[0], split_halo);
    let planes = plane_stride(source) + plane_stride(tile[0] * tile[1]);
    weights + rows * cols * TENSOR_CHANNELS * 2 + TENSOR_CHANNELS * 2 * planes
}

/// The tensor-core kernel's output tile over `out` (rows, columns) extents within `limit` bytes
/// of shared memory, and the blocks an SM then holds. Rows of up to [`MAX_TENSOR_TILE_W`]
/// outputs are one tile wide (wider ones split evenly), in whole segments. Of the heights whose blocks fit two an
/// SM, preferred: enough tiles that each block walks several, then the least shared-memory
/// traffic (a block's 128-byte wavefronts: the copy lands, is read and lands in the planes;
/// ldmatrix reads four a tap row and 16 segments; the outputs land and are read), counting
/// the segments and rows past the edges that a tile computes.
fn choose_tensor_tile(
    s: Shape,
    out: [usize; 2],
    images_x_chunks: usize,
    sms: usize,
    limit: usize,
    split_halo: bool,
) -> Option<([usize; 2], usize)> {
    let tw = out[1]
        .div_ceil(out[1].div_ceil(MAX_TENSOR_TILE_W))
        .next_multiple_of(SEGMENT);
    let min_blocks = tensor_min_blocks(s.kernel[0]);
    // (tile, enough tiles, cost)
    let mut best: Option<([usize; 2], bool, usize)> = None;
    for th in 1..=out[0].min(64) {
        let shared = tensor_shared_bytes(s, [th, tw], split_halo);
        if shared > limit || (limit + 1024) / (shared + 1024) < min_blocks {
            continue;
        }
        let rows = (th - 1) * s.stride[0] + s.kernel[0];
        let staged = rows * (tw + SEGMENT) * TENSOR_CHANNELS * 2;
        let mtiles = (th * tw / SEGMENT).div_ceil(16);
        let outputs = th * tw * TENSOR_CHANNELS * 2;
        let per_tile =
            3 * staged / 128 + mtiles * TENSOR_CHANNELS * s.kernel[0] * 4 + 2 * outputs / 128;
        let tiles = out[0].div_ceil(th) * out[1].div_ceil(tw) * images_x_chunks;
        let enough = tiles >= TILES_PER_BLOCK * min_blocks * sms;
        let cost = tiles * per_tile;
        let better = match best {
            None => true,
            Some((_, b_enough, b_cost)) => {
                (enough, std::cmp::Reverse(cost)) > (b_enough, std::cmp::Reverse(b_cost))
            }
        };
        if better {
            best = Some(([th, tw], enough, cost));
        }
    }
    // The driver's count, with the registers, replaces the launch bound when the plan is built
    // (`Launch::fill`).
    best.map(|(t, ..)| (t, min_blocks))
}

/// The tensor-core kernel's tile, blocks an SM and plane layout (`split_halo`). The split
/// layout reads the planes without bank conflicts but takes about twice their shared memory,
/// and its staging computes each unit's place: it is chosen where its tile stages at most two
/// source rows an output row, so that the products outweigh the staging. H100, 16-bit, split
/// planes everywhere against the packed kernel before them: 1.06-1.22x on seven 5x5 and 7x7
/// layers whose split tiles stage 1.4-2 rows an output row (64 x 240ch 56x56 5x5: 4 rows a
/// tile against 8 packed, 1.06x); 0.92-0.93x on 64ch 112x112 7x7 (3 rows against 5: 3 staged
/// an output row), which the rule keeps packed (0.98-1.00x). Batch 8 of 96ch 56x56 7x7 (2-row
/// tiles, packed under the rule) reads 0.93-0.97x with either layout: not the layout's loss.
fn choose_tensor_launch(
    s: Shape,
    out: [usize; 2],
    images_x_chunks: usize,
    sms: usize,
    limit: usize,
) -> Option<([usize; 2], usize, bool)> {
    let split = choose_tensor_tile(s, out, images_x_chunks, sms, limit, true);
    if let Some((tile, per_sm)) = split {
        let staged = (tile[0] - 1) * s.stride[0] + s.kernel[0];
        if staged <= 2 * tile[0] {
            return Some((tile, per_sm, true));
        }
    }
    choose_tensor_tile(s, out, images_x_chunks, sms, limit, false)
        .map(|(tile, per_sm)| (tile, per_sm, false))
}

/// Tiles a block should walk at least, where the layer has them, so that copies overlap work.
const TILES_PER_BLOCK: usize = 3;

/// The launch of `key` on `sms` multiprocessors with `limit` bytes of shared memory a block, or
/// None where the family does not take it or no tile fits.
pub fn launch_for(key: &PlanKey, sms: usize, limit: usize) -> Option<Launch> {
    if unsupported(ConvPath::Auto, key).is_some() {
        return None;
    }
    let g = &key.geometry;
    let pass = key.pass;
    let dtype = key.dtype;
    // The gather's output and source: extents, channels; the source position of output 0's
    // tap 0 along each dim.
    let (out, src, out_c, src_c) = match pass {
        Pass::BackwardData => (g.input, g.output, g.cin, g.cout),
        _ => (g.output, g.input, g.cout, g.cin),
    };
    let off = |d: usize| source_offset(g, pass, d);
    let sms = sms.max(1);
    let rows = takes_rows(key)
        .then(|| rows_launch(key, sms, limit, false))
        .flatten();
    if takes_columns(key, rows.is_some()) {
        if let Some(launch) = columns_launch(key, sms, limit) {
            if columns_fill(&launch, key, sms) {
                return Some(launch);
            }
        }
    }
    if rows.is_some() {
        return rows;
    }
    let extents = [out[1], out[2]];
    // The tensor-core kernel where it takes the layer and a tile fits, else the FMA stencil.
    let tensor = takes_tensor(key)
        .then(|| {
            let chunks = out_c.div_ceil(TENSOR_CHANNELS);
            let shape = Shape::tensor(g);
            choose_tensor_launch(shape, extents, g.batch * chunks, sms, limit)
                .map(|(tile, per_sm, split)| (shape, chunks, tile, per_sm, split))
        })
        .flatten();
    let (shape, chunks, tile, per_sm, split_halo) = match tensor {
        Some(t) => t,
        None => {
            let chunks = out_c.div_ceil(LANES);
            let (shape, choice) = choose_stencil_tile(
                dtype,
                pass,
                Shape::of(pass, g),
                extents,
                g.batch * chunks,
                sms,
                limit,
            )?;
            (shape, chunks, choice.tile, choice.per_sm, false)
        }
    };
    let blocks = per_sm * sms;
    // Backward-data's tiles start where the spread cotangent has a real row and column: up to
    // stride - 1 outputs before the image (their outputs are not stored).
    let base = |d: usize| match pass {
        Pass::BackwardData => -off(d).rem_euclid(g.stride[d] as i64),
        _ => 0,
    };
    let (base_h, base_w) = (base(1), base(2));
    // Outputs from the first tile's start to the image's end, along dim d.
    let span = |d: usize, base: i64| (out[d] as i64 - base) as usize;
    let tiles_h = span(1, base_h).div_ceil(tile[0]);
    let tiles_w = span(2, base_w).div_ceil(tile[1]);
    let tiles = g.batch * tiles_h * tiles_w;
    let (blocks_x, splits, per_split) = persistent_grid(pass, blocks, chunks, tiles);
    if tiles == 0 || tiles > i32::MAX as usize || chunks > 65535 {
        return None;
    }
    // The tensor-core kernel divides tile indices by tiles_w and tiles_h as multiplies.
    let tensor = shape.variant == Variant::Tensor;
    if tensor && tiles.saturating_mul(tiles_w.max(tiles_h)) >= 1 << 32 {
        return None;
    }
    let vec = |c: usize| key.aligned && (c * dtype.size()) % 16 == 0;
    let problem = Problem {
        batch: g.batch as i32,
        src_h: src[1] as i32,
        src_w: src[2] as i32,
        src_c: src_c as i32,
        out_h: out[1] as i32,
        out_w: out[2] as i32,
        out_c: out_c as i32,
        off_h: off(1) as i32,
        off_w: off(2) as i32,
        tile_h: tile[0] as i32,
        tile_w: tile[1] as i32,
        tiles_h: tiles_h as i32,
        tiles_w: tiles_w as i32,
        tiles: tiles as i32,
        chunks: chunks as i32,
        // Backward-data walks the taps backwards: its weight tap is reversed unless flipped.
        reverse: (g.flip != (pass == Pass::BackwardData)) as i32,
        vec_src: (tensor || vec(src_c)) as i32,
        vec_dy: (pass == Pass::BackwardWeight && vec(out_c)) as i32,
        tiles_per_split: per_split as i32,
        base_h: base_h as i32,
        base_w: base_w as i32,
        split_halo: split_halo as i32,
    };
    Some(Launch {
        pass,
        shape,
        problem,
        grid: (blocks_x as u32, chunks as u32, 1),
        block: (LANES as u32, WARPS as u32, 1),
        shared: shared_bytes(dtype, pass, shape, tile, split_halo),
        splits,
    })
}

impl Launch {
    /// A tensor-core launch's persistent grid for `per_sm` blocks an SM (the driver's count for
    /// the loaded kernel: registers may hold fewer blocks than shared memory); other launches
    /// keep theirs.
    pub fn fill(&mut self, sms: usize, per_sm: usize) {
        if self.shape.variant != Variant::Tensor {
            return;
        }
        let blocks = sms.max(1) * per_sm.max(1);
        let (x, ..) = persistent_grid(
            self.pass,
            blocks,
            self.grid.1 as usize,
            self.problem.tiles as usize,
        );
        self.grid.0 = x as u32;
    }
}

/// The spec and launch that run `key`, or None where the family does not take it.
pub fn plan(device: &Device, path: ConvPath, key: &PlanKey) -> Option<(KernelSpec, Launch)> {
    if unsupported(path, key).is_some() {
        return None;
    }
    let sms = device.info().multiprocessors as usize;
    let launch = launch_for(key, sms, device.shared_limit())?;
    Some((spec(key.dtype, key.pass, launch.shape), launch))
}

#[cfg(test)]
mod tests {
    use super::super::geometry::ConvParams;
    use super::super::plan::test_key as key;
    use super::*;

    const H100_SHARED: usize = 227 * 1024;

    fn depthwise(
        c: usize,
        mg: usize,
        size: [usize; 2],
        k: usize,
        stride: usize,
    ) -> (Vec<usize>, Vec<usize>, ConvParams) {
        let p = ConvParams::default()
            .groups(c)
            .strides(&[stride])
            .padding(&[k / 2]);
        (vec![2, size[0], size[1], c], vec![c * mg, k, k, 1], p)
    }

    #[test]
    fn takes_depthwise_layers_only() {
        let f16 = DType::F16;
        for pass in Pass::ALL {
            for mg in MULTIPLIERS {
                let (x, w, p) = depthwise(24, mg, [9, 9], 3, 1);
                assert_eq!(
                    unsupported(ConvPath::Auto, &key(f16, pass, &x, &w, &p)),
                    None
                );
                assert!(unsupported(ConvPath::Igemm, &key(f16, pass, &x, &w, &p)).is_some());
            }
        }
        let (x, w, p) = depthwise(24, 3, [9, 9], 3, 1);
        assert!(unsupported(ConvPath::Auto, &key(f16, Pass::Forward, &x, &w, &p)).is_some());
        let (x, w, p) = depthwise(24, 1, [9, 9], 9, 1);
        assert!(unsupported(ConvPath::Auto, &key(f16, Pass::Forward, &x, &w, &p)).is_some());
        // Stride 2 in every pass; stride 3 in none.
        for pass in Pass::ALL {
            let (x, w, p) = depthwise(24, 1, [9, 9], 3, 2);
            assert_eq!(
                unsupported(ConvPath::Auto, &key(f16, pass, &x, &w, &p)),
                None
            );
            let (x, w, p) = depthwise(24, 1, [9, 9], 3, 3);
            assert!(unsupported(ConvPath::Auto, &key(f16, pass, &x, &w, &p)).is_some());
        }
        let grouped = ConvParams::default().groups(12).padding(&[1]);
        let k = key(f16, Pass::Forward, &[2, 9, 9, 24], &[24, 3, 3, 2], &grouped);
        assert!(unsupported(ConvPath::Auto, &k).is_some());
        let dilated = ConvParams::default().groups(24).kernel_dilation(&[2]);
        let k = key(f16, Pass::Forward, &[2, 9, 9, 24], &[24, 3, 3, 1], &dilated);
        assert!(unsupported(ConvPath::Auto, &k).is_some());
    }

    #[test]
    fn backward_weight_takes_wide_sub_tiles_where_they_ran_faster() {
        let tile = |dtype, pass, (n, c, size, k): (usize, usize, usize, usize)| {
            let p = ConvParams::default().groups(c).padding(&[k / 2]);
            let kk = key(dtype, pass, &[n, size, size, c], &[c, k, k, 1], &p);
            let l = launch_for(&kk, 132, H100_SHARED).unwrap();
            (
                l.shape.variant,
                l.shape.out_tile,
                [l.problem.tile_h, l.problem.tile_w],
            )
        };
        let weight = Pass::BackwardWeight;
        // 56 columns: 8 x 28 tiles, 14 square sub-tiles for 8 warps, or 8 wide ones.
        let wide = (Variant::Stencil, WIDE_TILE, [8, 28]);
        assert_eq!(tile(DType::F16, weight, (64, 240, 56, 5)), wide);
        assert_eq!(tile(DType::BF16, weight, (32, 96, 56, 7)), wide);
        let sub_tile = |dtype, layer| {
            let (v, t, _) = tile(dtype, weight, layer);
            (v, t)
        };
        let (square, wide) = ((Variant::Stencil, [4, 4]), (Variant::Stencil, WIDE_TILE));
        // Square tiles of 3 blocks an SM; wide ones of as many output slots (112- and 96-wide
        // images), or fewer (a 50-wide image: 4 x 56 tiles against 4 x 52, 13 square sub-tiles).
        for layer in [
            (24, 176, 40, 5),
            (64, 112, 20, 5),
            (16, 64, 112, 7),
            (4, 192, 96, 7),
            (16, 144, 50, 5),
        ] {
            assert_eq!(sub_tile(DType::F16, layer), wide, "{layer:?}");
        }
        // Wide tiles of 9-75% more slots (12-, 19-, 30- and 36-wide images) or 23% more staged
        // values (38 wide), and 7x7 images, whose square tiles leave warps idle too.
        for layer in [
            (20, 512, 12, 7),
            (32, 576, 19, 7),
            (32, 136, 30, 7),
            (16, 320, 36, 5),
            (32, 288, 38, 5),
            (64, 1152, 7, 5),
        ] {
            assert_eq!(sub_tile(DType::F16, layer), square, "{layer:?}");
        }
        // f32: its wide tiles leave warps idle, so they must stage fewer values.
        for layer in [(64, 112, 20, 5), (32, 128, 56, 7), (16, 320, 36, 5)] {
            assert_eq!(sub_tile(DType::F32, layer), wide, "{layer:?}");
        }
        for layer in [
            (32, 144, 30, 5),
            (20, 512, 12, 7),
            (8, 96, 56, 7),
            (64, 1152, 7, 5),
        ] {
            assert_eq!(sub_tile(DType::F32, layer), square, "{layer:?}");
        }
        // The other passes keep their sub-tiles.
        for pass in [Pass::Forward, Pass::BackwardData] {
            assert_ne!(tile(DType::F16, pass, (64, 240, 56, 5)).1, WIDE_TILE);
            assert_ne!(tile(DType::F32, pass, (64, 112, 20, 5)).1, WIDE_TILE);
        }
    }

    #[test]
    fn tensor_planes_split_where_tiles_stage_two_rows_an_output_row_at_most() {
        // (batch, channels, image, kernel): the split layout, or the packed one.
        let layout = |n: usize, c: usize, hw: usize, k: usize| {
            let p = ConvParams::default().groups(c).padding(&[k / 2]);
            let key = key(
                DType::F16,
                Pass::Forward,
                &[n, hw, hw, c],
                &[c, k, k, 1],
                &p,
            );
            let l = launch_for(&key, 132, H100_SHARED).unwrap();
            assert_eq!(l.shape.variant, Variant::Tensor);
            let staged = (l.problem.tile_h - 1) + k as i32;
            assert_eq!(l.problem.split_halo == 1, staged <= 2 * l.problem.tile_h);
            let split = l.problem.split_halo == 1;
            let tile = [l.problem.tile_h as usize, l.problem.tile_w as usize];
            assert_eq!(l.shared, tensor_shared_bytes(l.shape, tile, split));
            split
        };
        assert!(layout(32, 96, 56, 7));
        assert!(layout(64, 240, 28, 5));
        assert!(!layout(8, 96, 56, 7));
        assert!(!layout(16, 64, 112, 7));
        // The split planes take more shared memory for the same tile.
        let s = Shape::tensor(
            &Geometry::new(
                &[1, 56, 56, 96],
                &[96, 7, 7, 1],
                &ConvParams::default().groups(96),
            )
            .unwrap(),
        );
        assert!(tensor_shared_bytes(s, [8, 56], true) > tensor_shared_bytes(s, [8, 56], false));
    }

    #[test]
    fn tensor_cores_take_16_bit_stride_1_columns_with_whole_vectors() {
        // One kernel row of 5: the rows kernel takes kernels of 2-7 rows where the tensor-core
        // kernel would.
        let tensor = |dtype, pass, c: usize, mg, stride: [usize; 2], arch| {
            let p = ConvParams::default()
                .groups(c)
                .strides(&stride)
                .padding(&[2]);
            let k = PlanKey {
                arch,
                ..key(dtype, pass, &[2, 30, 70, c], &[c * mg, 1, 5, 1], &p)
            };
            launch_for(&k, 132, H100_SHARED).unwrap().shape.variant == Variant::Tensor
        };
        for dtype in [DType::F16, DType::BF16] {
            for pass in [Pass::Forward, Pass::BackwardData] {
                assert!(tensor(dtype, pass, 24, 1, [1, 1], 90));
                assert!(tensor(dtype, pass, 24, 1, [1, 1], 80));
                assert!(!tensor(dtype, pass, 24, 1, [1, 1], 75));
                assert!(
                    !tensor(dtype, pass, 20, 1, [1, 1], 90),
                    "channels not in 16-byte units"
                );
                assert!(
                    !tensor(dtype, pass, 24, 2, [1, 1], 90),
                    "a channel multiplier of 2"
                );
            }
            assert!(
                tensor(dtype, Pass::Forward, 24, 1, [2, 1], 90),
                "row stride 2"
            );
            assert!(
                !tensor(dtype, Pass::Forward, 24, 1, [1, 2], 90),
                "column stride 2"
            );
            assert!(!tensor(dtype, Pass::BackwardWeight, 24, 1, [1, 1], 90));
        }
        assert!(!tensor(DType::F32, Pass::Forward, 24, 1, [1, 1], 90));
    }

    #[test]
    fn rows_take_kernels_up_to_7x7_with_whole_copies() {
        let variant = |dtype, pass, c: usize, mg, k: [usize; 2], stride: usize, arch, aligned| {
            let p = ConvParams::default()
                .groups(c)
                .strides(&[stride])
                .padding(&[1]);
            let k = PlanKey {
                arch,
                aligned,
                ..key(dtype, pass, &[64, 56, 56, c], &[c * mg, k[0], k[1], 1], &p)
            };
            launch_for(&k, 132, H100_SHARED).unwrap().shape.variant
        };
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                let rows = |c, mg, k, stride, arch, aligned| {
                    variant(dtype, pass, c, mg, k, stride, arch, aligned) == Variant::Rows
                };
                for k in [[3, 3], [2, 3], [3, 1], [2, 2]] {
                    assert!(rows(144, 1, k, 1, 90, true), "{k:?}");
                }
                // Kernels past 3x3: f32; 16-bit only for images of up to 14 rows (5x5) or 10
                // (7x7), not backward-weight.
                let f32 = dtype == DType::F32;
                for k in [[5, 5], [7, 7], [3, 7], [7, 1]] {
                    assert_eq!(rows(144, 1, k, 1, 90, true), f32, "{k:?}");
                }
                let image = |c, k: usize, hw: usize| {
                    let p = ConvParams::default().groups(c).padding(&[k / 2]);
                    let kk = key(dtype, pass, &[64, hw, hw, c], &[c, k, k, 1], &p);
                    launch_for(&kk, 132, H100_SHARED).unwrap().shape.variant == Variant::Rows
                };
                let small_image = |c, k| image(c, k, 7);
                let gather = pass != Pass::BackwardWeight;
                // (Backward-weight of 7x7 images stays on the stencil in f32 too: its blocks
                // would sum at most 49 outputs a channel.)
                assert_eq!(small_image(1152, 5), gather, "1152 channels 7x7");
                // One channel a thread copies 16 bytes at once.
                assert_eq!(small_image(1156, 7), f32 && gather, "1156 channels 7x7");
                assert!(!small_image(1154, 7), "1154 channels 7x7");
                assert_eq!(image(672, 5, 14), gather, "672 channels 14x14");
                assert_eq!(image(672, 5, 15), f32 && gather, "672 channels 15x15");
                assert_eq!(image(1152, 7, 7), gather, "7x7 kernel, 7x7");
                assert_eq!(image(1152, 7, 10), gather, "7x7 kernel, 10x10");
                assert_eq!(image(1152, 7, 11), f32 && gather, "7x7 kernel, 11x11");
                assert!(rows(144, 1, [3, 3], 1, 80, true));
                assert!(!rows(144, 1, [3, 3], 1, 75, true), "before sm_80");
                assert!(
                    !rows(142, 1, [3, 3], 1, 90, true),
                    "channels not in vectors of 4"
                );
                assert!(!rows(144, 1, [3, 3], 1, 90, false), "unaligned operands");
                assert!(
                    !rows(144, 2, [3, 3], 1, 90, true),
                    "a channel multiplier of 2"
                );
                assert!(!rows(144, 1, [1, 3], 1, 90, true), "one kernel row");
                // Forward and backward-data take any size (but small images go to the column
                // walks: 16-bit always, f32 where they fill the GPU); backward-weight only walks
                // past its floors (a 7x7 image's blocks sum at most 49 outputs a channel).
                let small = |c| {
                    let p = ConvParams::default().groups(c).padding(&[1]);
                    let k = key(dtype, pass, &[64, 7, 7, c], &[c, 3, 3, 1], &p);
                    launch_for(&k, 132, H100_SHARED).unwrap().shape.variant == Variant::Rows
                };
                assert!(!small(960), "960 channels 7x7: 7.8 warps an SM");
                let f32_rows = f32 && pass != Pass::BackwardWeight;
                assert_eq!(small(480), f32_rows, "480 channels 7x7: 3.9 warps an SM");
                // Channels in whole 32-lane blocks keep backward-weight on the stencil.
                let whole = rows(128, 1, [3, 3], 1, 90, true);
                assert_eq!(whole, pass != Pass::BackwardWeight, "128 channels");
            }
            // Stride 2: the forward's alone, the same along both dims.
            for pass in Pass::ALL {
                let strided = variant(dtype, pass, 144, 1, [3, 3], 2, 90, true);
                assert_eq!(strided == Variant::Rows, pass == Pass::Forward, "{pass:?}");
            }
            let p = ConvParams::default()
                .groups(144)
                .strides(&[2, 1])
                .padding(&[1]);
            let kk = key(
                dtype,
                Pass::Forward,
                &[64, 56, 56, 144],
                &[144, 3, 3, 1],
                &p,
            );
            assert!(!rows_fit(&kk), "strides 2 and 1");
        }
    }

    #[test]
    fn rows_launches_cover_the_output_within_the_block_and_shared_memory() {
        for kernel in [[3, 3], [5, 5], [7, 7]] {
            rows_launches_cover(kernel);
        }
    }

    fn rows_launches_cover(kernel: [usize; 2]) {
        let v = rows_vector(kernel);
        let sizes = [
            [2, 1],
            [3, 5],
            [7, 7],
            [14, 14],
            [28, 28],
            [56, 56],
            [112, 112],
            [9, 300],
        ];
        // (pass, stride): stride 2 is the forward's alone.
        let passes = Pass::ALL
            .map(|p| (p, 1))
            .into_iter()
            .chain([(Pass::Forward, 2)]);
        for dtype in DType::ALL {
            for (pass, stride) in passes.clone() {
                for c in [8, 32, 144, 576, 1000] {
                    for size in sizes {
                        for (batch, sms) in [(1, 132), (64, 132), (3, 4)] {
                            let p = ConvParams::default()
                                .groups(c)
                                .strides(&[stride])
                                .padding(&[kernel[0] / 2]);
                            let x = [batch, size[0], size[1], c];
                            let w = [c, kernel[0], kernel[1], 1];
                            let kk = key(dtype, pass, &x, &w, &p);
                            let planned = launch_for(&kk, sms, H100_SHARED).unwrap();
                            // Backward-weight takes the rows past its floors, and 16-bit kernels
                            // past 3x3 only some layers; the other walks (the tests') are
                            // checked all the same.
                            let rows = planned.shape.variant == Variant::Rows;
                            let sixteen_larger = v == 1 && dtype != DType::F32;
                            let columns = matches!(planned.shape.variant, Variant::Columns { .. });
                            let exempt = pass == Pass::BackwardWeight || sixteen_larger || columns;
                            assert!(rows || exempt, "{kk:?}");
                            let l = if rows {
                                planned
                            } else {
                                rows_launch(&kk, sms, H100_SHARED, true).unwrap()
                            };
                            let pr = l.problem;
                            if rows && pass == Pass::BackwardWeight {
                                let outputs = (pr.tile_h * pr.tile_w) as usize;
                                assert!(outputs >= ROWS_WEIGHT_OUTPUTS, "{kk:?}");
                            }
                            let (vectors, groups, _) = l.block;
                            assert!(vectors * groups <= THREADS as u32, "{kk:?}");
                            // Every channel vector, column and row is some block's; chunks are
                            // whole copies.
                            let chans = vectors as usize * v;
                            assert_eq!(chans % rows_granule(dtype, kernel), 0, "{kk:?}");
                            assert!(l.grid.1 as usize * chans >= c, "{kk:?}");
                            assert!((l.grid.1 as usize - 1) * chans < c, "{kk:?}");
                            assert_eq!(pr.tile_w as u32, groups * l.shape.out_tile[1] as u32);
                            assert!(pr.tiles_w * pr.tile_w >= pr.out_w, "{kk:?}");
                            assert!(pr.tiles_h * pr.tile_h >= pr.out_h, "{kk:?}");
                            assert!((pr.tiles_h - 1) * pr.tile_h < pr.out_h, "{kk:?}");
                            assert_eq!(l.grid.0 as i32, batch as i32 * pr.tiles_h * pr.tiles_w);
                            // The ring: AHEAD + 1 rows of the band's columns and halo;
                            // backward-weight AHEAD + KH rows and as many cotangent rows, or
                            // the column groups' f32 sums where they take more.
                            let cols = (pr.tile_w as usize - 1) * stride + kernel[1];
                            let shared = if pass == Pass::BackwardWeight {
                                let rings = (ROWS_AHEAD + kernel[0]) * (cols + pr.tile_w as usize);
                                let sums = groups as usize * kernel[0] * kernel[1] * chans * 4;
                                (rings * chans * dtype.size()).max(sums)
                            } else {
                                (ROWS_AHEAD + 1) * cols * chans * dtype.size()
                            };
                            assert_eq!(l.shared, shared);
                            assert!(l.shared <= H100_SHARED);
                            // Backward-weight: one partial a block along x.
                            let splits = if pass == Pass::BackwardWeight {
                                l.grid.0 as usize
                            } else {
                                1
                            };
                            assert_eq!(l.splits, splits);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn columns_take_3x3_backward_weight_with_many_idle_lanes() {
        let variant = |dtype, pass, c: usize, k: usize, stride: usize, arch, aligned| {
            let p = ConvParams::default()
                .groups(c)
                .strides(&[stride])
                .padding(&[k / 2]);
            let kk = PlanKey {
                arch,
                aligned,
                ..key(dtype, pass, &[8, 33, 47, c], &[c, k, k, 1], &p)
            };
            launch_for(&kk, 132, H100_SHARED).unwrap().shape.variant
        };
        for dtype in DType::ALL {
            let columns = |c, k, stride, arch, aligned| {
                let v = variant(dtype, Pass::BackwardWeight, c, k, stride, arch, aligned);
                matches!(v, Variant::Columns { .. })
            };
            for c in [1, 6, 8, 16, 17, 33, 36] {
                assert!(columns(c, 3, 1, 90, true), "{c} channels");
                assert!(columns(c, 3, 2, 75, false), "{c} channels, stride 2, sm_75");
            }
            // Up to 4 in 5 lanes busy at stride 1 where the rows kernel does not run it: here
            // on 8 images of 33x47 it does not (its blocks would fill too little of the GPU),
            // nor before sm_80.
            for c in [20, 24, 40, 70, 100] {
                assert!(columns(c, 3, 1, 90, true), "{c} channels");
                assert!(columns(c, 3, 1, 75, true), "{c} channels, sm_75");
                assert!(!columns(c, 3, 2, 90, true), "{c} channels, stride 2");
            }
            for c in [32, 144, 192] {
                assert!(!columns(c, 3, 1, 90, true), "{c} channels");
            }
            // Where the rows kernel runs 40 channels (150x150 images), it keeps them.
            let p = ConvParams::default().groups(40).padding(&[1]);
            let large = key(
                dtype,
                Pass::BackwardWeight,
                &[32, 150, 150, 40],
                &[40, 3, 3, 1],
                &p,
            );
            let v = launch_for(&large, 132, H100_SHARED).unwrap().shape.variant;
            assert_eq!(v, Variant::Rows, "{dtype:?}");
            assert!(!columns(36, 5, 1, 90, true), "5x5");
            for pass in [Pass::Forward, Pass::BackwardData] {
                let v = variant(dtype, pass, 36, 3, 1, 90, true);
                assert!(!matches!(v, Variant::Columns { .. }), "{pass:?}");
                // Small images are the column walks', two channels a thread and a row of 7 a
                // thread: 16-bit at stride 1 up to 20x20, f32 up to 10x10 where the launch fills
                // the GPU, the 16-bit forward at stride 2 up to 10x10 outputs (likewise).
                let small = |c: usize, hw: usize, stride: usize, aligned: bool| {
                    let p = ConvParams::default()
                        .groups(c)
                        .strides(&[stride])
                        .padding(&[1]);
                    let kk = PlanKey {
                        aligned,
                        ..key(dtype, pass, &[64, hw, hw, c], &[c, 3, 3, 1], &p)
                    };
                    launch_for(&kk, 132, H100_SHARED).unwrap().shape
                };
                let s = small(960, 7, 1, true);
                assert_eq!(
                    s.variant,
                    Variant::Columns { vector: 2 },
                    "{dtype:?} {pass:?}"
                );
                assert_eq!(s.out_tile, [1, 7]);
                let on = |s: Shape| matches!(s.variant, Variant::Columns { .. });
                let sixteen = dtype != DType::F32;
                assert!(!on(small(960, 7, 1, false)), "unaligned");
                assert!(!on(small(576, 56, 1, true)), "56x56");
                assert_eq!(on(small(256, 20, 1, true)), sixteen, "20x20");
                assert!(on(small(256, 10, 1, true)), "10x10");
                // 64 x 480 channels at 7x7: 256 blocks of 2 warps, 3.9 warps an SM.
                assert_eq!(on(small(480, 7, 1, true)), sixteen, "7x7, few blocks");
                let forward = pass == Pass::Forward;
                assert_eq!(on(small(576, 14, 2, true)), sixteen && forward, "stride 2");
                assert!(!on(small(576, 24, 2, true)), "stride 2, 12x12 outputs");
            }
            // Vectors: as wide as the kernel and dtype allow and the channels divide.
            let vector = |c, aligned| {
                let v = variant(dtype, Pass::BackwardWeight, c, 3, 1, 90, aligned);
                match v {
                    Variant::Columns { vector } => vector,
                    _ => 0,
                }
            };
            let widest = if dtype == DType::F32 { 2 } else { 4 };
            assert_eq!(vector(36, true), widest);
            assert_eq!(vector(6, true), 2);
            assert_eq!(vector(17, true), 1);
            assert_eq!(vector(36, false), 1);
        }
    }

    /// The GPU tests' stride-2 column-walk case (`gpu_conv`, 96 x 384 channels 14x14 onto 7x7)
    /// runs on the walks in 16-bit on an H100/H200's 132 SMs; the 4-image case keeps its kernel.
    #[test]
    fn columns_take_16_bit_stride_2_forwards_that_fill_the_gpu() {
        let walks = |dtype, batch: usize, c: usize, hw: [usize; 2]| {
            let p = ConvParams::default()
                .groups(c)
                .strides(&[2])
                .padding_lo(&[1])
                .padding_hi(&[0]);
            let kk = key(
                dtype,
                Pass::Forward,
                &[batch, hw[0], hw[1], c],
                &[c, 3, 3, 1],
                &p,
            );
            let v = launch_for(&kk, 132, H100_SHARED).unwrap().shape.variant;
            matches!(v, Variant::Columns { .. })
        };
        for dtype in [DType::F16, DType::BF16] {
            assert!(walks(dtype, 96, 384, [14, 14]), "{dtype:?} 96 x 384");
            assert!(!walks(dtype, 4, 64, [13, 14]), "{dtype:?} 4 x 64");
        }
        assert!(!walks(DType::F32, 96, 384, [14, 14]), "f32 at stride 2");
    }

    #[test]
    fn columns_launches_cover_the_output_within_the_block_and_shared_memory() {
        let cases = [([3, 3], 1), ([3, 3], 2), ([2, 3], 1), ([7, 7], 2)];
        let sizes = [[1, 1], [5, 3], [7, 7], [33, 47], [112, 112], [9, 300]];
        for dtype in DType::ALL {
            for (kernel, stride) in cases {
                for c in [1, 6, 17, 36, 100, 1000] {
                    for size in sizes {
                        for (batch, sms) in [(1, 132), (64, 132), (3, 4)] {
                            for pass in Pass::ALL {
                                if pass == Pass::BackwardData && stride > 1 {
                                    continue;
                                }
                                let shape = (kernel, stride, c, size);
                                columns_launch_covers(dtype, pass, shape, batch, sms);
                            }
                        }
                    }
                }
            }
        }
    }

    /// `shape`: the kernel, stride, channels and image of a depthwise layer.
    #[allow(clippy::type_complexity)]
    fn columns_launch_covers(
        dtype: DType,
        pass: Pass,
        shape: ([usize; 2], usize, usize, [usize; 2]),
        batch: usize,
        sms: usize,
    ) {
        let (kernel, stride, c, size) = shape;
        let pad = kernel[0] / 2;
        let p = ConvParams::default()
            .groups(c)
            .strides(&[stride])
            .padding(&[pad]);
        let x = [batch, size[0], size[1], c];
        let w = [c, kernel[0], kernel[1], 1];
        let kk = key(dtype, pass, &x, &w, &p);
        assert!(columns_fit(&kk), "{kk:?}");
        let l = columns_launch(&kk, sms, H100_SHARED).unwrap();
        let Variant::Columns { vector } = l.shape.variant else {
            panic!("{kk:?}");
        };
        let pr = l.problem;
        assert_eq!(c % vector, 0, "{kk:?}");
        let (vectors, groups, _) = l.block;
        assert!(vectors * groups <= THREADS as u32, "{kk:?}");
        // Every channel, column and row is some tile's.
        let weight = pass == Pass::BackwardWeight;
        let chans = vectors as usize * vector;
        let chunks = pr.chunks as usize;
        assert!(chunks * chans >= c, "{kk:?}");
        assert!((chunks - 1) * chans < c, "{kk:?}");
        let tw = if weight {
            COLUMNS_TW
        } else {
            columns_output_tw(pr.out_w as usize)
        };
        assert_eq!(l.shape.out_tile, [1, tw]);
        assert_eq!(pr.tile_w as usize, groups as usize * tw);
        assert!(pr.tiles_w * pr.tile_w >= pr.out_w, "{kk:?}");
        assert!((pr.tiles_w - 1) * pr.tile_w < pr.out_w, "{kk:?}");
        assert!(pr.tiles_h * pr.tile_h >= pr.out_h, "{kk:?}");
        assert!((pr.tiles_h - 1) * pr.tile_h < pr.out_h, "{kk:?}");
        assert_eq!(pr.tiles, batch as i32 * pr.tiles_h * pr.tiles_w);
        let off = |d: usize| match pass {
            Pass::BackwardData => pad as i32 - (kernel[d] as i32 - 1),
            _ => -(pad as i32),
        };
        assert_eq!([pr.off_h, pr.off_w], [off(0), off(1)]);
        // Backward-weight: persistent blocks along x, each with a tile and one partial, chunks
        // along y. Forward and backward-data: a block a (chunk, tile).
        let taps = kernel[0] * kernel[1];
        if weight {
            assert!(l.grid.0 >= 1 && l.grid.0 as i32 <= pr.tiles, "{kk:?}");
            assert_eq!(l.grid.1 as usize, chunks);
            assert_eq!(l.splits, l.grid.0 as usize);
            assert_eq!(l.shared, groups as usize * taps * chans * 4);
            assert!(l.shared <= H100_SHARED);
        } else {
            assert_eq!(l.grid.0 as usize, pr.tiles as usize * chunks, "{kk:?}");
            assert_eq!(l.grid.1, 1);
            // Whole images: one segment.
            assert_eq!(pr.tiles_h, 1, "{kk:?}");
            assert_eq!((l.splits, l.shared), (1, 0));
            assert!(vector <= COLUMNS_OUTPUT_VECTOR);
        }
    }

    #[test]
    fn tensor_tiles_fit_the_staging_threads_and_shared_memory() {
        for width in [1, 7, 14, 56, 112, 120, 121, 224, 1000] {
            // (Kernels of 2-7 rows are the rows kernel's.)
            for k in [1, 5, 7] {
                let p = ConvParams::default().groups(32).padding(&[0, k / 2]);
                let x = [4, 9, width, 32];
                let kk = key(DType::F16, Pass::Forward, &x, &[32, 1, k, 1], &p);
                let l = launch_for(&kk, 132, H100_SHARED).unwrap();
                assert_eq!(l.shape.variant, Variant::Tensor, "{kk:?}");
                let pr = l.problem;
                assert!(pr.tile_w as usize <= MAX_TENSOR_TILE_W && pr.tile_w % 8 == 0);
                assert!(pr.tiles_w * pr.tile_w >= pr.out_w && pr.tiles_h * pr.tile_h >= pr.out_h);
                assert!(l.shared * tensor_min_blocks(k) <= H100_SHARED + 1024);
                assert_eq!(l.grid.1 as usize, 32 / TENSOR_CHANNELS);
                // The template's plane stride: 8 past a multiple of 64, room for every cell.
                for cells in [1, 31, 32, 33, 64, 96, 97, 1000] {
                    let ps = plane_stride(cells);
                    assert!(ps >= cells && ps % 64 == 8, "{cells} {ps}");
                }
            }
        }
    }

    #[test]
    fn the_common_layers_are_listed() {
        let all = specs(90);
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                for (k, s) in [(3, 1), (3, 2), (5, 1), (5, 2), (7, 1)] {
                    for size in [56, 7] {
                        let (x, w, p) = depthwise(96, 1, [size, size], k, s);
                        let kk = key(dtype, pass, &x, &w, &p);
                        let l = launch_for(&kk, 132, H100_SHARED).unwrap();
                        assert!(
                            all.contains(&spec(dtype, pass, l.shape)),
                            "{k} {s} {size} {pass:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn stride_one_backward_data_of_one_channel_a_group_shares_the_forwards_module() {
        let mut variants = std::collections::HashSet::new();
        for dtype in DType::ALL {
            for size in [56, 7] {
                for k in [3, 5, 7] {
                    for (stride, mg) in [(1, 1), (2, 1), (1, 2)] {
                        let (x, w, p) = depthwise(96, mg, [size, size], k, stride);
                        let kk = key(dtype, Pass::BackwardData, &x, &w, &p);
                        let l = launch_for(&kk, 132, H100_SHARED).unwrap();
                        variants.insert(format!("{:?}", l.shape.variant));
                        let as_forward = spec(dtype, Pass::Forward, l.shape);
                        let shared = spec(dtype, Pass::BackwardData, l.shape) == as_forward;
                        let why = format!("{dtype} {size} {k} {stride} {mg}");
                        assert_eq!(shared, stride == 1 && mg == 1, "{why}");
                        let pass = spec(dtype, Pass::BackwardData, l.shape).constant("PASS");
                        assert_eq!(pass, Some(if shared { 0 } else { 1 }), "{why}");
                    }
                }
            }
        }
        assert!(variants.len() >= 3, "{variants:?}");
    }

    #[test]
    fn launches_fit_shared_memory_and_cover_the_output() {
        let sizes = [[1, 1], [5, 3], [14, 14], [56, 56], [112, 112], [1, 300]];
        for dtype in DType::ALL {
            for pass in Pass::ALL {
                for mg in MULTIPLIERS {
                    for (k, stride) in [(1, 1), (3, 1), (5, 1), (7, 1), (3, 2), (4, 2)] {
                        for size in sizes {
                            let kh = if size[0] == 1 { 1 } else { k };
                            let p = ConvParams::default()
                                .groups(40)
                                .strides(&[stride])
                                .padding_lo(&[kh / 2, k / 2]);
                            let p = p.padding_hi(&[kh / 2, k / 2]);
                            let x = [3, size[0], size[1], 40];
                            let w = [40 * mg, kh, k, 1];
                            let kk = key(dtype, pass, &x, &w, &p);
                            let l = launch_for(&kk, 132, H100_SHARED).unwrap();
                            let pr = l.problem;
                            assert!(l.shared <= H100_SHARED, "{kk:?}");
                            assert_eq!(pr.tile_h as usize % l.shape.out_tile[0], 0);
                            assert_eq!(pr.tile_w as usize % l.shape.out_tile[1], 0);
                            // Tiles start at base (backward-data at stride 2: where the
                            // spread cotangent has a real row and column) and cover the output.
                            let spread = match pass {
                                Pass::BackwardData => stride as i32,
                                _ => 1,
                            };
                            for (base, off) in [(pr.base_h, pr.off_h), (pr.base_w, pr.off_w)] {
                                assert!(base <= 0 && base > -spread, "{kk:?}");
                                assert_eq!((base + off).rem_euclid(spread), 0, "{kk:?}");
                            }
                            let tile = [l.shape.out_tile, [pr.tile_h as usize, pr.tile_w as usize]];
                            for t in tile {
                                assert!(t.iter().all(|&e| e as i32 % spread == 0), "{kk:?}");
                            }
                            assert!(pr.base_h + pr.tiles_h * pr.tile_h >= pr.out_h, "{kk:?}");
                            assert!(pr.base_w + pr.tiles_w * pr.tile_w >= pr.out_w, "{kk:?}");
                            assert_eq!(pr.tiles, 3 * pr.tiles_h * pr.tiles_w);
                            assert_eq!(l.grid.1 as i32, pr.chunks);
                            if l.shape.variant == Variant::Rows {
                                // Not persistent; its own test checks the rest.
                                assert_eq!(l.grid.0 as i32, pr.tiles);
                            } else if let Variant::Columns { .. } = l.shape.variant {
                                // Backward-weight: persistent blocks, one partial each;
                                // forward and backward-data: a block a (chunk, tile). Its own
                                // test checks the rest.
                                let weight = pass == Pass::BackwardWeight;
                                let most = if weight { 1 } else { pr.chunks };
                                assert!(l.grid.0 >= 1 && l.grid.0 as i32 <= most * pr.tiles);
                                let splits = if weight { l.grid.0 as usize } else { 1 };
                                assert_eq!(l.splits, splits);
                            } else if pass == Pass::BackwardWeight {
                                // Every split has a tile; all tiles are covered.
                                let s = l.splits as i32;
                                assert!((s - 1) * pr.tiles_per_split < pr.tiles, "{kk:?}");
                                assert!(s * pr.tiles_per_split >= pr.tiles, "{kk:?}");
                            } else {
                                assert!(l.grid.0 >= 1 && l.grid.0 as i32 <= pr.tiles);
                                // One wave: no more blocks than the SMs hold at once.
                                let blocks = l.grid.0 * l.grid.1;
                                assert!(blocks <= 4 * 132 || l.grid.0 == 1, "{kk:?}");
                            }
                        }
                    }
                }
            }
        }
    }
}
