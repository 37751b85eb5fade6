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
//!
//! Each kernel's plan is a module of its own (`stencil`, `tensor`, `rows`, `columns`); this one
//! holds what they share (the templates, shapes, problem and launch, the specs) and the
//! dispatch among them ([`launch_for`]).

use crate::dtype::DType;
use crate::env::ConvPath;
use crate::jit::{KernelSpec, TemplateDef};
use crate::runtime::Device;

use super::geometry::{Geometry, Pass};
use super::plan::{persistent_grid, tile_limits, PlanKey};

mod columns;
mod rows;
mod stencil;
mod tensor;

pub use columns::{columns_fit, columns_launch, takes_columns};
pub use rows::{rows_fit, rows_launch, takes_rows, ROWS_ARCH};
pub use stencil::WIDE_TILE;
pub use tensor::TENSOR_ARCH;

use columns::{
    columns_fill, columns_most_vector, COLUMNS_OUTPUT_TW, COLUMNS_OUTPUT_VECTOR, COLUMNS_TW,
};
use rows::{rows_columns, rows_small_image_most, rows_vector};
use stencil::{choose_stencil_tile, stencil_tile, takes_wide_tile};
use tensor::{choose_tensor_launch, takes_tensor, tensor_shared_bytes, SEGMENT, TENSOR_CHANNELS};

pub static DEPTHWISE: TemplateDef = TemplateDef {
    name: "conv_depthwise",
    source: include_str!("../../../../templates/conv_depthwise.cu"),
    kernel: "kiln_conv_depthwise",
    const_names: &["PASS", "MG", "KH", "KW", "SH", "SW", "OTH", "OTW"],
    arch_specific: false,
    only_arch: None,
};

/// The tensor-core variant (`templates/conv_depthwise_tc.cu`): 16-bit forward and stride-1
/// backward-data with one output channel a group and a column stride of 1, from sm_80 on.
pub static DEPTHWISE_TC: TemplateDef = TemplateDef {
    name: "conv_depthwise_tc",
    source: include_str!("../../../../templates/conv_depthwise_tc.cu"),
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
    source: include_str!("../../../../templates/conv_depthwise_rows.cu"),
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
    source: include_str!("../../../../templates/conv_depthwise_cols.cu"),
    kernel: "kiln_conv_depthwise_cols",
    const_names: &["PASS", "KH", "KW", "TW", "V", "S"],
    arch_specific: false,
    only_arch: None,
};

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

    pub(super) const H100_SHARED: usize = 227 * 1024;

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
