//! `Array`: a device buffer plus dtype, shape, strides and offset. Views (reshape, split_axis,
//! transpose, swapaxes, slice, broadcast) share the buffer; `contiguous` and `astype` copy
//! through the strided-copy kernel.

use std::sync::Arc;

use cudarc::driver::sys;

use super::allocator::Buffer;
use super::device::Device;
use super::encoder::CommandEncoder;
use crate::dtype::{decode, encode, DType, Element};
use crate::error::{Error, Result};

/// The most dimensions an array may have (also `KILN_MAX_RANK` in the templates).
pub const MAX_RANK: usize = 8;

/// An n-dimensional array on one GPU: a shared device allocation viewed through a dtype, a
/// shape, strides and an offset (all in elements). Cloning is cheap and shares the allocation;
/// views share it too. The allocation lives while any array, or any encoded work that uses it,
/// does. `Send` and `Sync`: arrays may move between threads, but work on them is ordered only by
/// the encoder that runs it (see [`CommandEncoder`]).
///
/// ```
/// fn shareable<T: Send + Sync>() {}
/// shareable::<kiln::runtime::Array>();
/// shareable::<std::sync::Arc<kiln::runtime::Device>>();
/// ```
#[derive(Clone)]
pub struct Array {
    buffer: Arc<Buffer>,
    device: Arc<Device>,
    dtype: DType,
    shape: Vec<usize>,
    /// In elements; 0 for a broadcast axis.
    strides: Vec<isize>,
    /// In elements, from the buffer's start.
    offset: usize,
}

impl std::fmt::Debug for Array {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Array({} {:?} strides {:?} offset {} in {:?})",
            self.dtype, self.shape, self.strides, self.offset, self.buffer
        )
    }
}

fn invalid(arg: &'static str, reason: String) -> Error {
    Error::InvalidArgument { arg, reason }
}

fn check_rank(shape: &[usize]) -> Result<()> {
    if shape.len() > MAX_RANK {
        return Err(invalid(
            "shape",
            format!("rank {} exceeds kiln's maximum, {MAX_RANK}", shape.len()),
        ));
    }
    Ok(())
}

/// Bytes of a contiguous array; an error when the rank or size is too large.
fn byte_size(dtype: DType, shape: &[usize]) -> Result<usize> {
    check_rank(shape)?;
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &n| acc.checked_mul(n))
        .ok_or_else(|| invalid("shape", "too large".into()))
}

/// Row-major strides of a contiguous array of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<isize> {
    let mut strides = vec![0isize; shape.len()];
    let mut step = 1isize;
    for (s, &n) in strides.iter_mut().zip(shape).rev() {
        *s = step;
        step *= n.max(1) as isize;
    }
    strides
}

impl Array {
    /// A new contiguous array with undefined contents, usable by any stream and the host.
    pub fn empty(device: &Arc<Device>, dtype: DType, shape: &[usize]) -> Result<Array> {
        let bytes = byte_size(dtype, shape)?;
        Ok(Array::from_buffer(
            device,
            device.allocator().alloc(bytes)?,
            dtype,
            shape,
        ))
    }

    /// A new contiguous array for work encoded next on `enc` to write first (an op's output):
    /// its memory may come from `enc`'s own earlier work, still in flight.
    pub(crate) fn empty_on(
        enc: &mut CommandEncoder,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Array> {
        let bytes = byte_size(dtype, shape)?;
        let buffer = enc.alloc(bytes)?;
        Ok(Array::from_buffer(enc.device(), buffer, dtype, shape))
    }

    fn from_buffer(
        device: &Arc<Device>,
        buffer: Arc<Buffer>,
        dtype: DType,
        shape: &[usize],
    ) -> Array {
        Array {
            buffer,
            device: device.clone(),
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// Uploads `data` (little-endian `dtype` elements) as a contiguous array on the encoder's
    /// stream, ordered with its other work.
    pub fn from_bytes(
        enc: &mut CommandEncoder,
        dtype: DType,
        shape: &[usize],
        data: &[u8],
    ) -> Result<Array> {
        let a = Array::empty_on(enc, dtype, shape)?;
        if data.len() != a.nbytes() {
            return Err(invalid(
                "data",
                format!(
                    "{} bytes for shape {shape:?} of {dtype} ({} bytes)",
                    data.len(),
                    a.nbytes()
                ),
            ));
        }
        enc.upload(&a, data)?;
        Ok(a)
    }

    /// Uploads `data` (its dtype is `T`'s) as a new contiguous array of `shape`; the element
    /// count must match.
    pub fn from_slice<T: Element>(
        enc: &mut CommandEncoder,
        data: &[T],
        shape: &[usize],
    ) -> Result<Array> {
        let values: Vec<f64> = data.iter().map(|v| v.to_f64()).collect();
        Array::from_f64(enc, T::DTYPE, &values, shape)
    }

    /// Uploads f64 values rounded to `dtype`.
    pub fn from_f64(
        enc: &mut CommandEncoder,
        dtype: DType,
        values: &[f64],
        shape: &[usize],
    ) -> Result<Array> {
        Array::from_bytes(enc, dtype, shape, &encode(dtype, values))
    }

    /// A new contiguous array with every element `value` (rounded to `dtype`), e.g. 0.0 for
    /// zeros. One host upload on the encoder's stream: no kernel to compile.
    pub fn full(
        enc: &mut CommandEncoder,
        dtype: DType,
        shape: &[usize],
        value: f64,
    ) -> Result<Array> {
        let n = byte_size(dtype, shape)? / dtype.size();
        Array::from_f64(enc, dtype, &vec![value; n], shape)
    }

    /// A new contiguous array of zeros ([`Array::full`] with 0.0).
    pub fn zeros(enc: &mut CommandEncoder, dtype: DType, shape: &[usize]) -> Result<Array> {
        Array::full(enc, dtype, shape, 0.0)
    }

    /// Overwrites this (contiguous) array with `data` (little-endian `dtype` elements). Work
    /// already encoded is committed first, so it reads the old contents and later work the new.
    pub fn copy_from_bytes(&self, enc: &mut CommandEncoder, data: &[u8]) -> Result<()> {
        if !self.is_contiguous() {
            return Err(invalid(
                "self",
                "must be contiguous to be uploaded into".into(),
            ));
        }
        if data.len() != self.nbytes() {
            return Err(invalid(
                "data",
                format!(
                    "{} bytes for an array of {} bytes",
                    data.len(),
                    self.nbytes()
                ),
            ));
        }
        enc.commit()?;
        enc.upload(self, data)
    }

    /// [`Array::copy_from_bytes`] from f64 values rounded to the array's dtype.
    pub fn copy_from_f64(&self, enc: &mut CommandEncoder, values: &[f64]) -> Result<()> {
        self.copy_from_bytes(enc, &encode(self.dtype, values))
    }

    /// Downloads the elements in row-major order (waits for the encoder's work first).
    pub fn to_bytes(&self, enc: &mut CommandEncoder) -> Result<Vec<u8>> {
        let c = self.contiguous(enc)?;
        enc.download(&c)
    }

    /// Downloads the elements in row-major order as f64 (waits for the encoder's work first).
    pub fn to_f64(&self, enc: &mut CommandEncoder) -> Result<Vec<f64>> {
        decode(self.dtype, &self.to_bytes(enc)?)
    }

    /// Downloads the elements in row-major order as `T`, which must be the array's dtype (an
    /// error otherwise; use [`Array::astype`] to convert).
    pub fn to_vec<T: Element>(&self, enc: &mut CommandEncoder) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch {
                arg: "T",
                expected: self.dtype,
                got: T::DTYPE,
            });
        }
        Ok(self.to_f64(enc)?.into_iter().map(T::from_f64).collect())
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Extent of each axis, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Elements between neighbours along each axis; 0 along a broadcast axis.
    pub fn strides(&self) -> &[isize] {
        &self.strides
    }
    /// Elements from the allocation's start to the first element.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of axes.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }
    /// Number of elements (1 for a rank-0 array, 0 if any extent is 0).
    pub fn size(&self) -> usize {
        self.shape.iter().product()
    }
    /// Bytes of the elements the array views (not of its allocation).
    pub fn nbytes(&self) -> usize {
        self.size() * self.dtype.size()
    }
    /// The GPU the array lives on.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }
    /// The allocation the array views.
    pub fn buffer(&self) -> &Arc<Buffer> {
        &self.buffer
    }
    /// The allocation this array lives in: views of one allocation share it.
    pub fn buffer_id(&self) -> u64 {
        self.buffer.ptr()
    }
    /// Device address of the first element.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.buffer.ptr() + (self.offset * self.dtype.size()) as u64
    }

    /// Row-major with no gaps (axes of extent 1 may have any stride). Allocation-free: ops call
    /// it on every launch.
    pub fn is_contiguous(&self) -> bool {
        let mut step = 1isize;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n > 1 && s != step {
                return false;
            }
            step *= n.max(1) as isize;
        }
        true
    }

    fn view(&self, shape: Vec<usize>, strides: Vec<isize>, offset: usize) -> Array {
        Array {
            buffer: self.buffer.clone(),
            device: self.device.clone(),
            dtype: self.dtype,
            shape,
            strides,
            offset,
        }
    }

    /// A view with a new shape of the same size; the array must be contiguous.
    pub fn reshape(&self, shape: &[usize]) -> Result<Array> {
        check_reshape(shape, self.size())?;
        if !self.is_contiguous() {
            return Err(invalid(
                "self",
                "reshape of a non-contiguous view: call contiguous() first".into(),
            ));
        }
        Ok(self.view(shape.to_vec(), contiguous_strides(shape), self.offset))
    }

    /// A view with `axis` split into axes of extents `parts` (outermost first), whose product
    /// must be the axis's extent: `[PH, kh]` turns (N, H, W, C) with H = PH x kh into
    /// (N, PH, kh, W, C). Unlike [`Array::reshape`] it takes any view (sliced, transposed,
    /// broadcast): the new axes step through the old one's elements in order.
    pub fn split_axis(&self, axis: usize, parts: &[usize]) -> Result<Array> {
        let (shape, strides) = split_layout(&self.shape, &self.strides, axis, parts)?;
        Ok(self.view(shape, strides, self.offset))
    }

    /// A view with the axes permuted: axis i of the result is axis `perm[i]` of `self`.
    pub fn transpose(&self, perm: &[usize]) -> Result<Array> {
        let mut seen = vec![false; self.ndim()];
        if perm.len() != self.ndim()
            || perm
                .iter()
                .any(|&p| p >= self.ndim() || std::mem::replace(&mut seen[p], true))
        {
            return Err(invalid(
                "perm",
                format!("{perm:?} is not a permutation of {} axes", self.ndim()),
            ));
        }
        let shape = perm.iter().map(|&p| self.shape[p]).collect();
        let strides = perm.iter().map(|&p| self.strides[p]).collect();
        Ok(self.view(shape, strides, self.offset))
    }

    /// A view with axes `a` and `b` exchanged.
    pub fn swapaxes(&self, a: usize, b: usize) -> Result<Array> {
        if a >= self.ndim() || b >= self.ndim() {
            return Err(invalid(
                "axis",
                format!("axes {a}, {b} of a rank-{} array", self.ndim()),
            ));
        }
        let mut perm: Vec<usize> = (0..self.ndim()).collect();
        perm.swap(a, b);
        self.transpose(&perm)
    }

    /// A view of `start..stop` stepping by `step` along `axis` (`stop` is clamped to the extent).
    pub fn slice(&self, axis: usize, start: usize, stop: usize, step: usize) -> Result<Array> {
        if axis >= self.ndim() {
            return Err(invalid(
                "axis",
                format!("axis {axis} of a rank-{} array", self.ndim()),
            ));
        }
        if step == 0 {
            return Err(invalid("step", "must be positive".into()));
        }
        let stop = stop.min(self.shape[axis]);
        let len = if start >= stop {
            0
        } else {
            (stop - start).div_ceil(step)
        };
        let mut shape = self.shape.clone();
        let mut strides = self.strides.clone();
        shape[axis] = len;
        let offset = if len == 0 {
            self.offset
        } else {
            (self.offset as isize + start as isize * self.strides[axis]) as usize
        };
        strides[axis] *= step as isize;
        Ok(self.view(shape, strides, offset))
    }

    /// A view broadcast to `shape` (NumPy rules: size-1 or missing leading axes get stride 0).
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Array> {
        let strides = broadcast_layout(self.dtype, &self.shape, &self.strides, shape)?;
        Ok(self.view(shape.to_vec(), strides, self.offset))
    }

    /// This array if it is contiguous, else a contiguous copy.
    pub fn contiguous(&self, enc: &mut CommandEncoder) -> Result<Array> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        super::copy::copy(enc, self, self.dtype)
    }

    /// A contiguous copy converted to `dtype`.
    pub fn astype(&self, enc: &mut CommandEncoder, dtype: DType) -> Result<Array> {
        if dtype == self.dtype {
            return self.contiguous(enc);
        }
        super::copy::copy(enc, self, dtype)
    }
}

/// [`Array::reshape`]'s check of the new shape against the array's `size`: within the rank,
/// and its extents multiply to `size` (without overflowing, which in release builds would wrap
/// round to any size, 0 included).
fn check_reshape(shape: &[usize], size: usize) -> Result<()> {
    check_rank(shape)?;
    let product = shape.iter().try_fold(1usize, |acc, &n| acc.checked_mul(n));
    if product != Some(size) {
        return Err(invalid(
            "shape",
            format!("{shape:?} does not hold {size} elements"),
        ));
    }
    Ok(())
}

/// The strides of [`Array::broadcast_to`]'s view of an array of `shape` and `strides` as `to`.
/// The view's elements, like an array's, must be countable in bytes.
fn broadcast_layout(
    dtype: DType,
    shape: &[usize],
    strides: &[isize],
    to: &[usize],
) -> Result<Vec<isize>> {
    byte_size(dtype, to)?;
    if to.len() < shape.len() {
        return Err(invalid(
            "shape",
            format!("cannot broadcast {shape:?} to {to:?}"),
        ));
    }
    let lead = to.len() - shape.len();
    let mut out = vec![0isize; to.len()];
    for (i, &n) in to.iter().enumerate().skip(lead) {
        let (have, stride) = (shape[i - lead], strides[i - lead]);
        out[i] = if have == n {
            stride
        } else if have == 1 {
            0
        } else {
            return Err(invalid(
                "shape",
                format!("cannot broadcast {shape:?} to {to:?}"),
            ));
        };
    }
    Ok(out)
}

/// The shape and strides of [`Array::split_axis`]'s view.
pub(crate) fn split_layout(
    shape: &[usize],
    strides: &[isize],
    axis: usize,
    parts: &[usize],
) -> Result<(Vec<usize>, Vec<isize>)> {
    if axis >= shape.len() {
        return Err(invalid(
            "axis",
            format!("axis {axis} of a rank-{} array", shape.len()),
        ));
    }
    if parts.is_empty() {
        return Err(invalid("parts", "needs at least one extent".into()));
    }
    let product = parts.iter().try_fold(1usize, |acc, &p| acc.checked_mul(p));
    if product != Some(shape[axis]) {
        return Err(invalid(
            "parts",
            format!(
                "{parts:?} do not multiply to axis {axis}'s extent {} (shape {shape:?})",
                shape[axis]
            ),
        ));
    }
    let rank = shape.len() - 1 + parts.len();
    if rank > MAX_RANK {
        return Err(invalid(
            "parts",
            format!("the split has rank {rank}, more than kiln's maximum, {MAX_RANK}"),
        ));
    }
    // The innermost part keeps the axis's stride; each outer one steps over the parts inside it.
    let mut split = vec![0isize; parts.len()];
    let mut step = strides[axis];
    for (s, &p) in split.iter_mut().zip(parts).rev() {
        *s = step;
        step = step.wrapping_mul(p as isize);
    }
    let mut new_shape = shape[..axis].to_vec();
    new_shape.extend_from_slice(parts);
    new_shape.extend_from_slice(&shape[axis + 1..]);
    let mut new_strides = strides[..axis].to_vec();
    new_strides.extend_from_slice(&split);
    new_strides.extend_from_slice(&strides[axis + 1..]);
    Ok((new_shape, new_strides))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arg(r: Result<(Vec<usize>, Vec<isize>)>) -> &'static str {
        match r {
            Err(Error::InvalidArgument { arg, .. }) => arg,
            other => panic!("expected an argument error, got {other:?}"),
        }
    }

    #[test]
    fn split_keeps_the_axis_stride_innermost() {
        // A contiguous (2, 6, 5, 3) array: H = 6 split into (3, 2).
        let strides = contiguous_strides(&[2, 6, 5, 3]);
        let (s, t) = split_layout(&[2, 6, 5, 3], &strides, 1, &[3, 2]).unwrap();
        assert_eq!(s, vec![2, 3, 2, 5, 3]);
        assert_eq!(t, vec![90, 30, 15, 3, 1]);
        // The same as reshaping the contiguous array.
        assert_eq!(t, contiguous_strides(&s));
    }

    #[test]
    fn split_of_a_strided_view() {
        // The first 8 columns of a (7, 10) array, split into (2, 4); the rows of a step-2 slice
        // (row stride 20) split into (1, 3).
        let (s, t) = split_layout(&[7, 8], &[10, 1], 1, &[2, 4]).unwrap();
        assert_eq!((s, t), (vec![7, 2, 4], vec![10, 4, 1]));
        let (s, t) = split_layout(&[3, 8], &[20, 1], 0, &[1, 3]).unwrap();
        assert_eq!((s, t), (vec![1, 3, 8], vec![60, 20, 1]));
        // Into three parts, and a broadcast axis (stride 0) stays broadcast.
        let (s, t) = split_layout(&[24], &[2], 0, &[2, 3, 4]).unwrap();
        assert_eq!((s, t), (vec![2, 3, 4], vec![24, 8, 2]));
        let (_, t) = split_layout(&[4, 6], &[0, 1], 0, &[2, 2]).unwrap();
        assert_eq!(t, vec![0, 0, 1]);
        // One part is the axis itself; an empty axis splits into parts with a zero.
        assert_eq!(
            split_layout(&[5, 3], &[3, 1], 0, &[5]).unwrap().1,
            vec![3, 1]
        );
        assert_eq!(
            split_layout(&[0, 3], &[3, 1], 0, &[0, 4]).unwrap().0,
            vec![0, 4, 3]
        );
    }

    fn err_arg<T: std::fmt::Debug>(r: Result<T>) -> &'static str {
        match r {
            Err(Error::InvalidArgument { arg, .. }) => arg,
            other => panic!("expected an argument error, got {other:?}"),
        }
    }

    #[test]
    fn reshape_refuses_a_shape_whose_product_overflows() {
        check_reshape(&[2, 3], 6).unwrap();
        check_reshape(&[], 1).unwrap();
        assert_eq!(err_arg(check_reshape(&[4, 2], 6)), "shape");
        // 2^32 x 2^32 wraps to 0 in release builds: it must not pass as an empty array's shape.
        assert_eq!(err_arg(check_reshape(&[1 << 32, 1 << 32], 0)), "shape");
        assert_eq!(err_arg(check_reshape(&[1 << 32, 1 << 32, 0], 0)), "shape");
        assert_eq!(err_arg(check_reshape(&[1; MAX_RANK + 1], 1)), "shape");
    }

    #[test]
    fn broadcast_refuses_a_shape_too_large_to_count() {
        let t = broadcast_layout(DType::F32, &[3, 1], &[1, 1], &[2, 3, 4]).unwrap();
        assert_eq!(t, vec![0, 1, 0]);
        assert_eq!(
            err_arg(broadcast_layout(DType::F32, &[3], &[1], &[2, 4])),
            "shape"
        );
        assert_eq!(
            err_arg(broadcast_layout(DType::F32, &[3], &[1], &[])),
            "shape"
        );
        // A scalar broadcast to 2^40 x 2^40: `size()` overflowed (a panic in debug builds, a
        // wrapped element count in release).
        assert_eq!(
            err_arg(broadcast_layout(
                DType::F32,
                &[1],
                &[1],
                &[1 << 40, 1 << 40]
            )),
            "shape"
        );
        // Countable in elements but not in bytes.
        assert_eq!(
            err_arg(broadcast_layout(DType::F32, &[1], &[1], &[1 << 62])),
            "shape"
        );
    }

    #[test]
    fn bad_splits_are_argument_errors() {
        let strides = contiguous_strides(&[4, 6]);
        assert_eq!(arg(split_layout(&[4, 6], &strides, 2, &[2, 3])), "axis");
        assert_eq!(arg(split_layout(&[4, 6], &strides, 1, &[4, 2])), "parts");
        assert_eq!(arg(split_layout(&[4, 6], &strides, 1, &[])), "parts");
        assert_eq!(
            arg(split_layout(&[4, 6], &strides, 1, &[usize::MAX, 2])),
            "parts"
        );
        // Rank 7 split into three parts is rank 9.
        let shape = [1, 1, 1, 1, 1, 1, 8];
        let strides = contiguous_strides(&shape);
        assert_eq!(arg(split_layout(&shape, &strides, 6, &[2, 2, 2])), "parts");
    }
}
