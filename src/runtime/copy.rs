//! Strided copy with cast: makes any view contiguous and converts between dtypes. A runtime
//! built-in (arrays need it for `contiguous` and `astype`), so the runtime calls no op.

use super::{Array, CommandEncoder, KernelArgs, MAX_RANK};
use crate::dtype::DType;
use crate::error::Result;
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

/// Every spec `copy` can choose: one per (from, to) pair of dtypes.
pub fn specs() -> Vec<KernelSpec> {
    DType::ALL
        .iter()
        .flat_map(|&from| DType::ALL.iter().map(move |&to| spec(from, to)))
        .collect()
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
