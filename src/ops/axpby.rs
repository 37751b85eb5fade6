//! `out = a * x + b * y` over contiguous arrays: kiln's smallest kernel, used by the encoder's
//! tests and launch-overhead benchmark.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::jit::{KernelSpec, TemplateDef};
use crate::runtime::{Array, CommandEncoder, KernelArgs};

/// The family: `templates/axpby.cu`, computing in f32 whatever the dtype.
pub static AXPBY: TemplateDef = TemplateDef {
    name: "axpby",
    source: include_str!("../../templates/axpby.cu"),
    kernel: "kiln_axpby",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

const BLOCK_DIM: u16 = 256;

/// The one spec for `dtype` (256 threads per block, grid-stride).
pub fn spec(dtype: DType) -> KernelSpec {
    KernelSpec::new(&AXPBY, dtype, BLOCK_DIM, 1, &[])
}

/// Every spec `axpby` can choose: one per dtype.
pub fn specs() -> Vec<KernelSpec> {
    DType::ALL.iter().map(|&d| spec(d)).collect()
}

/// Writes `a * x + b * y` into `out` (which may be `x` or `y`, or view the same buffer).
pub fn axpby(
    enc: &mut CommandEncoder,
    a: f32,
    x: &Array,
    b: f32,
    y: &Array,
    out: &Array,
) -> Result<()> {
    for (name, arr) in [("x", x), ("y", y), ("out", out)] {
        if !arr.is_contiguous() {
            return Err(Error::InvalidArgument {
                arg: name,
                reason: "must be contiguous".into(),
            });
        }
        if arr.dtype() != out.dtype() || arr.size() != out.size() {
            return Err(Error::InvalidArgument {
                arg: name,
                reason: format!(
                    "{} of {} elements; out is {} of {}",
                    arr.dtype(),
                    arr.size(),
                    out.dtype(),
                    out.size()
                ),
            });
        }
    }
    let n = out.size();
    if n == 0 {
        return Ok(());
    }
    let kernel = enc.device().kernel(&spec(out.dtype()))?;
    let mut args = KernelArgs::new();
    args.push(x.device_ptr())
        .push(y.device_ptr())
        .push(out.device_ptr())
        .push(n as i64)
        .push(a)
        .push(b);
    let blocks = super::grid_stride_blocks(enc, n, BLOCK_DIM);
    // SAFETY: the arguments are the template's (x, y, out, n, a, b) in order and type; x and y,
    // read, and out, written, hold n elements each.
    unsafe {
        enc.launch(
            &kernel,
            blocks as u32,
            BLOCK_DIM as u32,
            0,
            args,
            &[x, y],
            &[out],
        )
    }
}
