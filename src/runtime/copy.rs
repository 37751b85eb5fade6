//! Strided copy with cast: makes any view contiguous and converts between dtypes. A runtime
//! built-in (arrays need it for `contiguous` and `astype`), so the runtime calls no op. Also
//! [`copy_into`] and [`zero_into`], which write into a view of an existing array (a strided
//! destination, zero padding) for ops that rearrange their operands, and [`swap_outer_inner`],
//! a transposing copy that keeps both its reads and its writes coalesced.

use super::divider::divider;
use super::{Array, CommandEncoder, KernelArgs, MAX_RANK};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::jit::{KernelSpec, TemplateDef};

/// The family: `templates/copy.cu`, specialised on the source dtype and, as `OUT_DTYPE`, the
/// destination's ([`DType::code`]).
pub static COPY: TemplateDef = TemplateDef {
    name: "copy",
    source: include_str!("../../templates/copy.cu"),
    kernel: "kiln_copy",
    const_names: &["OUT_DTYPE"],
    arch_specific: false,
    only_arch: None,
};

const BLOCK_DIM: u16 = 256;

/// Matches `kiln_layout` in the prelude.
#[repr(C)]
#[derive(Clone, Copy)]
struct Layout {
    shape: [i64; MAX_RANK],
    strides: [i64; MAX_RANK],
}

/// The spec that copies `from` elements into `to` elements.
pub fn spec(from: DType, to: DType) -> KernelSpec {
    KernelSpec::new(&COPY, from, BLOCK_DIM, 1, &[to.code()])
}

/// Every spec `copy` can choose, one per (from, to) pair of dtypes, then the one spec per dtype
/// of [`copy_into`] and [`zero_into`], then of [`swap_outer_inner`].
pub fn specs() -> Vec<KernelSpec> {
    DType::ALL
        .iter()
        .flat_map(|&from| DType::ALL.iter().map(move |&to| spec(from, to)))
        .chain(DType::ALL.iter().map(|&d| into_spec(d)))
        .chain(DType::ALL.iter().map(|&d| transpose_spec(d)))
        .collect()
}

/// The family of [`swap_outer_inner`]: `templates/transpose.cu`, specialised on the dtype.
pub static TRANSPOSE: TemplateDef = TemplateDef {
    name: "transpose",
    source: include_str!("../../templates/transpose.cu"),
    kernel: "kiln_transpose",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

/// The spec of [`swap_outer_inner`] on `dtype` elements.
pub fn transpose_spec(dtype: DType) -> KernelSpec {
    KernelSpec::new(&TRANSPOSE, dtype, BLOCK_DIM, 1, &[])
}

/// Whether [`swap_outer_inner`] takes an array of `shape` (its grid's limits: rows / 32 and the
/// middle extent at most 65,535, fewer than 2^31 elements), so callers can choose another way.
pub fn swap_outer_inner_takes(shape: [usize; 3]) -> bool {
    let [rows, mid, cols] = shape;
    rows.div_ceil(32) <= 65_535 && mid <= 65_535 && rows * mid * cols <= i32::MAX as usize
}

/// A contiguous (c, b, a) copy of a 3-D array (a, b, c) (`src.swapaxes(0, 2)` made contiguous,
/// at the speed of a plain copy: a strided gather would read one element per 32-byte sector).
pub fn swap_outer_inner(enc: &mut CommandEncoder, src: &Array) -> Result<Array> {
    let [rows, mid, cols] = src.shape()[..] else {
        return Err(Error::InvalidArgument {
            arg: "src",
            reason: format!(
                "shape {:?}: swap_outer_inner takes a 3-D array",
                src.shape()
            ),
        });
    };
    let src = src.contiguous(enc)?;
    let dst = Array::empty_on(enc, src.dtype(), &[cols, mid, rows])?;
    if src.size() == 0 {
        return Ok(dst);
    }
    let grid = (cols.div_ceil(32), rows.div_ceil(32), mid);
    if !swap_outer_inner_takes([rows, mid, cols]) {
        return Err(Error::InvalidArgument {
            arg: "src",
            reason: format!(
                "shape {:?}: past the transpose's grid (rows / 32 and the middle extent at most \
                 65,535, fewer than 2^31 elements)",
                src.shape()
            ),
        });
    }
    let kernel = enc.device().kernel(&transpose_spec(src.dtype()))?;
    let mut args = KernelArgs::new();
    args.push(src.device_ptr())
        .push(dst.device_ptr())
        .push(rows as i32)
        .push(mid as i32)
        .push(cols as i32);
    // SAFETY: the arguments are the template's (src, dst, rows, mid, cols) in order and type;
    // src is contiguous (rows, mid, cols) and dst holds its (cols, mid, rows), and every block's
    // reads and writes are bounded by those extents.
    unsafe {
        enc.launch(
            &kernel,
            (grid.0 as u32, grid.1 as u32, grid.2 as u32),
            BLOCK_DIM as u32,
            0,
            args,
            &[&src],
            &[&dst],
        )
    }?;
    Ok(dst)
}

/// A contiguous copy of `src` as `to`.
pub fn copy(enc: &mut CommandEncoder, src: &Array, to: DType) -> Result<Array> {
    let dst = Array::empty_on(enc, to, src.shape())?;
    let n = src.size();
    if n == 0 {
        return Ok(dst);
    }
    let kernel = enc.device().kernel(&spec(src.dtype(), to))?;
    let mut layout = Layout {
        shape: [1; MAX_RANK],
        strides: [0; MAX_RANK],
    };
    for (i, (&e, &s)) in src.shape().iter().zip(src.strides()).enumerate() {
        layout.shape[i] = e as i64;
        layout.strides[i] = s as i64;
    }
    let mut args = KernelArgs::new();
    args.push(src.device_ptr())
        .push(dst.device_ptr())
        .push(n as i64)
        .push(src.ndim() as i32)
        .push(layout);
    let blocks = super::grid_stride_blocks(enc, n, BLOCK_DIM);
    // SAFETY: the arguments are the template's (src, dst, n, rank, layout) in order and type; the
    // layout is src's own shape and strides, so every element read lies in src, and dst, written,
    // holds its n elements.
    unsafe {
        enc.launch(
            &kernel,
            blocks as u32,
            BLOCK_DIM as u32,
            0,
            args,
            &[src],
            &[&dst],
        )
    }?;
    Ok(dst)
}

/// The family of [`copy_into`] and [`zero_into`]: `templates/copy_into.cu`, specialised on the
/// dtype (source and destination share it).
pub static COPY_INTO: TemplateDef = TemplateDef {
    name: "copy_into",
    source: include_str!("../../templates/copy_into.cu"),
    kernel: "kiln_copy_into",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

/// The spec of [`copy_into`] and [`zero_into`] on `dtype` elements.
pub fn into_spec(dtype: DType) -> KernelSpec {
    KernelSpec::new(&COPY_INTO, dtype, BLOCK_DIM, 1, &[])
}

/// Matches `kiln_into_layout` in `templates/copy_into.cu`: the axes sit at the back.
#[repr(C)]
#[derive(Clone, Copy)]
struct IntoLayout {
    extent: [i64; MAX_RANK],
    src_strides: [i64; MAX_RANK],
    dst_strides: [i64; MAX_RANK],
    bound: [i64; MAX_RANK],
    magic: [u32; MAX_RANK],
    shift: [u32; MAX_RANK],
}

/// One axis of a [`copy_into`]: its extent, its step in the source and in the destination, and
/// the source's extent (`bound`), at and past which zeros are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Axis {
    extent: usize,
    src: isize,
    dst: isize,
    bound: usize,
}

/// The axes (outermost first) with those of extent 1 dropped (each has bound >= 1, so its one
/// coordinate is inside) and each merged into the axis outside it where both arrays step
/// through the two as through one and the inner one has no zeros: every axis merged away is
/// one division less per element.
fn merge_axes(axes: &[Axis]) -> Vec<Axis> {
    let mut out: Vec<Axis> = Vec::new();
    for &a in axes.iter().filter(|a| a.extent != 1) {
        if let Some(outer) = out.last_mut() {
            let e = a.extent as isize;
            if outer.src == a.src * e && outer.dst == a.dst * e && a.bound == a.extent {
                *outer = Axis {
                    extent: outer.extent * a.extent,
                    src: a.src,
                    dst: a.dst,
                    bound: outer.bound * a.extent,
                };
                continue;
            }
        }
        out.push(a);
    }
    out
}

/// The furthest element (in elements from the first) an array of these axes' steps reaches.
fn span(axes: &[Axis], step: impl Fn(&Axis) -> isize) -> usize {
    axes.iter()
        .map(|a| (a.extent - 1).saturating_mul(step(a).unsigned_abs()))
        .fold(0usize, |acc, x| acc.saturating_add(x))
}

fn into_error(arg: &'static str, reason: String) -> Error {
    Error::InvalidArgument { arg, reason }
}

/// Writes `src` into `dst`, a view of another array (strided, sliced, split or transposed; it
/// is not reallocated): element for element along their common axes, with zeros where `dst`
/// extends past `src` (so `src` of shape (M, K) into `dst` of shape (M, Kp) pads each row). The
/// two must have one dtype and rank, `src`'s extents at most `dst`'s, `dst` no broadcast
/// (stride-0) axis, and the two different allocations. One kernel launch.
pub fn copy_into(enc: &mut CommandEncoder, src: &Array, dst: &Array) -> Result<()> {
    if src.dtype() != dst.dtype() {
        return Err(Error::DTypeMismatch {
            arg: "src",
            expected: dst.dtype(),
            got: src.dtype(),
        });
    }
    if src.ndim() != dst.ndim() || src.shape().iter().zip(dst.shape()).any(|(s, d)| s > d) {
        return Err(into_error(
            "src",
            format!(
                "shape {:?} does not fit in the destination's {:?} (same rank, no extent larger)",
                src.shape(),
                dst.shape()
            ),
        ));
    }
    // Empty arrays own no allocation (their addresses are all 0), so only non-empty ones can
    // share one.
    if src.size() > 0 && dst.size() > 0 && src.buffer_id() == dst.buffer_id() {
        return Err(into_error(
            "dst",
            "shares the source's allocation: copy_into does not copy within one array".into(),
        ));
    }
    launch_into(enc, Some(src), dst)
}

/// Writes zeros into every element of `dst`, a view of an array (no broadcast axis). One kernel
/// launch.
pub fn zero_into(enc: &mut CommandEncoder, dst: &Array) -> Result<()> {
    launch_into(enc, None, dst)
}

fn launch_into(enc: &mut CommandEncoder, src: Option<&Array>, dst: &Array) -> Result<()> {
    if dst
        .shape()
        .iter()
        .zip(dst.strides())
        .any(|(&n, &s)| n > 1 && s == 0)
    {
        return Err(into_error(
            "dst",
            format!(
                "has a broadcast axis (shape {:?}, strides {:?}): its elements are not distinct",
                dst.shape(),
                dst.strides()
            ),
        ));
    }
    let n = dst.size();
    if n == 0 {
        return Ok(());
    }
    // A source with an empty axis has nothing to read: the copy is a fill.
    let src = src.filter(|s| s.size() > 0);
    let axes: Vec<Axis> = (0..dst.ndim())
        .map(|d| Axis {
            extent: dst.shape()[d],
            src: src.map_or(0, |s| s.strides()[d]),
            dst: dst.strides()[d],
            bound: src.map_or(dst.shape()[d], |s| s.shape()[d]),
        })
        .collect();
    let axes = merge_axes(&axes);
    let limit = i32::MAX as usize;
    let narrow = n <= limit && span(&axes, |a| a.src) <= limit && span(&axes, |a| a.dst) <= limit;
    let mut layout = IntoLayout {
        extent: [1; MAX_RANK],
        src_strides: [0; MAX_RANK],
        dst_strides: [0; MAX_RANK],
        bound: [1; MAX_RANK],
        magic: [0; MAX_RANK],
        shift: [0; MAX_RANK],
    };
    let first = MAX_RANK - axes.len();
    for (i, a) in axes.iter().enumerate() {
        let (magic, shift) = divider(a.extent);
        layout.extent[first + i] = a.extent as i64;
        layout.src_strides[first + i] = a.src as i64;
        layout.dst_strides[first + i] = a.dst as i64;
        layout.bound[first + i] = a.bound as i64;
        layout.magic[first + i] = magic;
        layout.shift[first + i] = shift;
    }
    let kernel = enc.device().kernel(&into_spec(dst.dtype()))?;
    let mut args = KernelArgs::new();
    args.push(src.map_or(0, |s| s.device_ptr()))
        .push(dst.device_ptr())
        .push(n as i64)
        .push(axes.len() as i32)
        .push(narrow as i32)
        .push(layout);
    let blocks = super::grid_stride_blocks(enc, n, BLOCK_DIM);
    let reads: Vec<&Array> = src.into_iter().collect();
    // SAFETY: the arguments are the template's (src, dst, n, rank, narrow, layout) in order and
    // type. The axes are dst's own (merged only where the offsets stay the same), so every
    // element written lies in dst; a source element is read only at coordinates below its
    // extents, with its own strides, so it lies in src. The 32-bit path is taken only where n
    // and both arrays' offsets fit in 31 bits.
    unsafe {
        enc.launch(
            &kernel,
            blocks as u32,
            BLOCK_DIM as u32,
            0,
            args,
            &reads,
            &[dst],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn axis(extent: usize, src: isize, dst: isize, bound: usize) -> Axis {
        Axis {
            extent,
            src,
            dst,
            bound,
        }
    }

    #[test]
    fn axes_merge_where_both_arrays_step_as_one() {
        // A contiguous (2, 3, 4) copy is one axis of 24.
        let contiguous = [axis(2, 12, 12, 2), axis(3, 4, 4, 3), axis(4, 1, 1, 4)];
        assert_eq!(merge_axes(&contiguous), vec![axis(24, 1, 1, 24)]);
        // Space-to-depth of one row of 4x4 patches of a (2, 4, 12, 3) image as (N, PW, kh, kw,
        // C), into rows of 48 padded to 56: kw and C merge in both arrays, nothing else does.
        let patch = [
            axis(2, 144, 168, 2),
            axis(3, 12, 56, 3),
            axis(4, 36, 12, 4),
            axis(4, 3, 3, 4),
            axis(3, 1, 1, 3),
        ];
        assert_eq!(
            merge_axes(&patch),
            vec![
                axis(2, 144, 168, 2),
                axis(3, 12, 56, 3),
                axis(4, 36, 12, 4),
                axis(12, 1, 1, 12)
            ]
        );
        // Axes of extent 1 go; a padded inner axis (bound < extent) blocks a merge, a padded
        // outer one merges and keeps its bound.
        let padded = [axis(1, 0, 7, 1), axis(5, 3, 4, 5), axis(4, 1, 1, 3)];
        assert_eq!(
            merge_axes(&padded),
            vec![axis(5, 3, 4, 5), axis(4, 1, 1, 3)]
        );
        let outer = [axis(5, 4, 4, 2), axis(4, 1, 1, 4)];
        assert_eq!(merge_axes(&outer), vec![axis(20, 1, 1, 8)]);
        // A fill (source steps 0, bounds the extents) merges as its destination does.
        let fill = [axis(6, 0, 10, 6), axis(2, 0, 1, 2)];
        assert_eq!(merge_axes(&fill), fill.to_vec());
        let fill = [axis(6, 0, 2, 6), axis(2, 0, 1, 2)];
        assert_eq!(merge_axes(&fill), vec![axis(12, 0, 1, 12)]);
        // Nothing but extent-1 axes: one element, rank 0.
        assert!(merge_axes(&[axis(1, 5, 5, 1)]).is_empty());
    }

    #[test]
    fn spans_bound_the_offsets() {
        let axes = [axis(3, 10, -2, 3), axis(4, 1, 6, 4)];
        assert_eq!(span(&axes, |a| a.src), 2 * 10 + 3);
        assert_eq!(span(&axes, |a| a.dst), 2 * 2 + 3 * 6);
    }
}
