//! Tensor maps for Hopper's tensor memory accelerator: the driver's description of a tiled view
//! of an array in device memory, which a kernel takes by value (a `const __grid_constant__`
//! parameter) and names in bulk tensor copies (`cp.async.bulk.tensor`, see the `tma` partial).
//! Each copy moves one box of elements into shared memory; elements outside the array read as
//! zero.

use cudarc::driver::sys;

use super::array::Array;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// How the copy engine lays a box out in shared memory; a kernel must read it the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Swizzle {
    None,
    /// 16-byte chunks permuted within 32-, 64- or 128-byte spans (the innermost box extent may
    /// be at most that many bytes).
    B32,
    B64,
    B128,
}

impl Swizzle {
    fn span(self) -> Option<usize> {
        match self {
            Swizzle::None => None,
            Swizzle::B32 => Some(32),
            Swizzle::B64 => Some(64),
            Swizzle::B128 => Some(128),
        }
    }

    fn driver(self) -> sys::CUtensorMapSwizzle {
        use sys::CUtensorMapSwizzle::*;
        match self {
            Swizzle::None => CU_TENSOR_MAP_SWIZZLE_NONE,
            Swizzle::B32 => CU_TENSOR_MAP_SWIZZLE_32B,
            Swizzle::B64 => CU_TENSOR_MAP_SWIZZLE_64B,
            Swizzle::B128 => CU_TENSOR_MAP_SWIZZLE_128B,
        }
    }
}

/// An encoded tensor map (128 bytes), pushed as a kernel argument by value. It holds the
/// array's address: the array must outlive every launch that uses the map.
#[derive(Clone, Copy, Debug)]
#[repr(transparent)]
pub struct TensorMap(sys::CUtensorMap);

fn invalid(arg: &'static str, reason: String) -> Error {
    Error::InvalidArgument { arg, reason }
}

/// The driver's description of an array: its element type, extents and byte strides, each
/// list innermost first as the driver takes them. Checked against the driver's limits.
struct Layout {
    data_type: sys::CUtensorMapDataType,
    dims: Vec<u64>,
    byte_strides: Vec<u64>,
}

fn layout(array: &Array, ranks: std::ops::RangeInclusive<usize>) -> Result<Layout> {
    let rank = array.ndim();
    let elem = array.dtype().size();
    if !ranks.contains(&rank) {
        return Err(invalid(
            "array",
            format!(
                "rank {rank}: this tensor map takes {} to {}",
                ranks.start(),
                ranks.end()
            ),
        ));
    }
    if array.device_ptr() % 16 != 0 {
        return Err(invalid(
            "array",
            "its first element is not 16-byte aligned".into(),
        ));
    }
    let (shape, strides) = (array.shape(), array.strides());
    if shape[rank - 1] > 1 && strides[rank - 1] != 1 {
        return Err(invalid(
            "array",
            "its innermost axis is not contiguous".into(),
        ));
    }
    // The driver takes every list innermost first; strides in bytes for all but the innermost.
    let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
    let mut byte_strides = Vec::with_capacity(rank - 1);
    for axis in (0..rank - 1).rev() {
        let bytes = strides[axis] * elem as isize;
        if bytes <= 0 || bytes % 16 != 0 || bytes >= 1 << 40 {
            return Err(invalid(
                "array",
                format!("axis {axis} steps {bytes} bytes: a tensor map needs a positive multiple of 16 below 2^40"),
            ));
        }
        byte_strides.push(bytes as u64);
    }
    if let Some(d) = shape.iter().find(|&&d| d == 0 || d as u64 > 1 << 32) {
        return Err(invalid(
            "array",
            format!("extent {d}: a tensor map takes 1 to 2^32"),
        ));
    }
    let data_type = match array.dtype() {
        DType::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    };
    Ok(Layout {
        data_type,
        dims,
        byte_strides,
    })
}

/// Checks the bytes of a box's innermost extent against 16-byte granules and the swizzle span.
fn check_inner_bytes(inner_bytes: usize, swizzle: Swizzle) -> Result<()> {
    if inner_bytes % 16 != 0 {
        return Err(invalid(
            "box_shape",
            format!("the innermost extent spans {inner_bytes} bytes, not a multiple of 16"),
        ));
    }
    if let Some(span) = swizzle.span().filter(|&s| inner_bytes > s) {
        return Err(invalid(
            "box_shape",
            format!(
                "the innermost extent spans {inner_bytes} bytes, more than the {span}-byte swizzle"
            ),
        ));
    }
    Ok(())
}

fn finish(
    status: sys::CUresult,
    map: std::mem::MaybeUninit<sys::CUtensorMap>,
) -> Result<TensorMap> {
    if status != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(Error::Driver(cudarc::driver::DriverError(status)));
    }
    // SAFETY: the driver filled the map in.
    Ok(TensorMap(unsafe { map.assume_init() }))
}

/// A tensor map over `array` (rank 1 to 5, innermost axis contiguous) whose copies move boxes of
/// `box_shape` elements, one extent per axis in the array's order (outermost first).
pub fn tiled(array: &Array, box_shape: &[usize], swizzle: Swizzle) -> Result<TensorMap> {
    let l = layout(array, 1..=5)?;
    let rank = array.ndim();
    if box_shape.len() != rank {
        return Err(invalid(
            "box_shape",
            format!("{} extents for a rank-{rank} array", box_shape.len()),
        ));
    }
    if let Some(b) = box_shape.iter().find(|&&b| !(1..=256).contains(&b)) {
        return Err(invalid(
            "box_shape",
            format!("extent {b}: boxes take 1 to 256"),
        ));
    }
    check_inner_bytes(box_shape[rank - 1] * array.dtype().size(), swizzle)?;
    let boxes: Vec<u32> = box_shape.iter().rev().map(|&b| b as u32).collect();
    let element_strides = vec![1u32; rank];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    array.device().bind()?;
    // SAFETY: every list has `rank` entries (strides `rank - 1`), checked above against the
    // driver's limits; the map is written by the call.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            l.data_type,
            rank as u32,
            array.device_ptr() as *mut std::ffi::c_void,
            l.dims.as_ptr(),
            l.byte_strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle.driver(),
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    finish(status, map)
}

/// The window an im2col copy walks, per spatial dim in the array's order (outermost first):
/// pixels run from `lower` to the extent plus `upper` (exclusive), `stride` apart, wrapping to
/// the next row, then the next image, like the output pixels of a convolution. A copy names
/// its first pixel and per-dim offsets (the kernel tap) that shift every pixel it reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Im2colWindow {
    pub lower: Vec<i32>,
    pub upper: Vec<i32>,
    pub stride: Vec<u32>,
}

/// An im2col tensor map over `array` (batch, 1 to 3 spatial dims, channels; channels
/// contiguous): each copy moves `pixels` pixels of the window, `channels` channels each, as a
/// (pixels, channels) box. Elements outside the array read as zero.
pub fn im2col(
    array: &Array,
    window: &Im2colWindow,
    channels: usize,
    pixels: usize,
    swizzle: Swizzle,
) -> Result<TensorMap> {
    let l = layout(array, 3..=5)?;
    let rank = array.ndim();
    let spatial = rank - 2;
    if window.lower.len() != spatial
        || window.upper.len() != spatial
        || window.stride.len() != spatial
    {
        return Err(invalid(
            "window",
            format!("needs {spatial} entries per list for a rank-{rank} array"),
        ));
    }
    // The corners are signed fields whose width shrinks with the rank.
    let bits = [16, 8, 5][spatial - 1];
    let (lo, hi) = (-(1i32 << (bits - 1)), (1i32 << (bits - 1)) - 1);
    if let Some(c) = window
        .lower
        .iter()
        .chain(&window.upper)
        .find(|&&c| !(lo..=hi).contains(&c))
    {
        return Err(invalid(
            "window",
            format!("corner {c}: a rank-{rank} im2col map takes {lo} to {hi}"),
        ));
    }
    if let Some(s) = window.stride.iter().find(|&&s| !(1..=8).contains(&s)) {
        return Err(invalid(
            "window",
            format!("stride {s}: the copy engine steps 1 to 8"),
        ));
    }
    if !(1..=256).contains(&channels) {
        return Err(invalid(
            "channels",
            format!("{channels}: an im2col box takes 1 to 256 channels"),
        ));
    }
    if !(1..=1024).contains(&pixels) {
        return Err(invalid(
            "pixels",
            format!("{pixels}: an im2col box takes 1 to 1024 pixels"),
        ));
    }
    check_inner_bytes(channels * array.dtype().size(), swizzle)?;
    // Innermost first: channels, the spatial dims reversed, batch.
    let lower: Vec<i32> = window.lower.iter().rev().copied().collect();
    let upper: Vec<i32> = window.upper.iter().rev().copied().collect();
    let mut element_strides = vec![1u32];
    element_strides.extend(window.stride.iter().rev());
    element_strides.push(1);
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    array.device().bind()?;
    // SAFETY: dims and element strides have `rank` entries, byte strides `rank - 1`, corners
    // `rank - 2`, all checked above against the driver's limits; the map is written by the call.
    let status = unsafe {
        sys::cuTensorMapEncodeIm2col(
            map.as_mut_ptr(),
            l.data_type,
            rank as u32,
            array.device_ptr() as *mut std::ffi::c_void,
            l.dims.as_ptr(),
            l.byte_strides.as_ptr(),
            lower.as_ptr(),
            upper.as_ptr(),
            channels as u32,
            pixels as u32,
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle.driver(),
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    finish(status, map)
}
