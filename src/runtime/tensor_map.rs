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

/// A tensor map over `array` (rank 1 to 5, innermost axis contiguous) whose copies move boxes of
/// `box_shape` elements, one extent per axis in the array's order (outermost first).
pub fn tiled(array: &Array, box_shape: &[usize], swizzle: Swizzle) -> Result<TensorMap> {
    let rank = array.ndim();
    let elem = array.dtype().size();
    if !(1..=5).contains(&rank) {
        return Err(invalid(
            "array",
            format!("rank {rank}: a tensor map takes 1 to 5"),
        ));
    }
    if box_shape.len() != rank {
        return Err(invalid(
            "box_shape",
            format!("{} extents for a rank-{rank} array", box_shape.len()),
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
    if let Some(b) = box_shape.iter().find(|&&b| !(1..=256).contains(&b)) {
        return Err(invalid(
            "box_shape",
            format!("extent {b}: boxes take 1 to 256"),
        ));
    }
    let inner_bytes = box_shape[rank - 1] * elem;
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
    let boxes: Vec<u32> = box_shape.iter().rev().map(|&b| b as u32).collect();
    let element_strides = vec![1u32; rank];
    let data_type = match array.dtype() {
        DType::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    };
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    array.device().bind()?;
    // SAFETY: every list has `rank` entries (strides `rank - 1`), checked above against the
    // driver's limits; the map is written by the call.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            rank as u32,
            array.device_ptr() as *mut std::ffi::c_void,
            dims.as_ptr(),
            byte_strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle.driver(),
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if status != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(Error::Driver(cudarc::driver::DriverError(status)));
    }
    // SAFETY: the driver filled the map in.
    Ok(TensorMap(unsafe { map.assume_init() }))
}
