//! LayerNorm: the kernel families and how a call picks its specialisation.

use crate::dtype::DType;
use crate::jit::{KernelSpec, TemplateDef};

pub static FORWARD: TemplateDef = TemplateDef {
    name: "layer_norm_fwd",
    source: include_str!("../../templates/layer_norm.cu"),
    kernel: "kiln_layer_norm_fwd",
    const_names: &["HAS_W", "HAS_B"],
    arch_specific: false,
};

/// Block dims the forward kernel is specialised for.
pub const BLOCK_DIMS: [u16; 6] = [32, 64, 128, 256, 512, 1024];

/// The forward spec for rows of `d` elements. `vectorized` says whether every row starts on a
/// 16-byte boundary with `d` a multiple of the vector width, so 16-byte loads are legal.
pub fn forward_spec(
    dtype: DType,
    d: usize,
    vectorized: bool,
    has_w: bool,
    has_b: bool,
) -> KernelSpec {
    let n_reads = if vectorized { dtype.vec_width() } else { 1 };
    // Enough threads to cover the row in one step, as a power of two in [32, 1024].
    let threads = d.div_ceil(n_reads).clamp(32, 1024).next_power_of_two();
    KernelSpec::new(
        &FORWARD,
        dtype,
        threads as u16,
        n_reads as u8,
        &[has_w as i32, has_b as i32],
    )
}

/// Every spec the forward pass can choose.
pub fn specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for dtype in DType::ALL {
        for block in BLOCK_DIMS {
            for n_reads in [1, dtype.vec_width() as u8] {
                for has_w in [0, 1] {
                    for has_b in [0, 1] {
                        out.push(KernelSpec::new(
                            &FORWARD,
                            dtype,
                            block,
                            n_reads,
                            &[has_w, has_b],
                        ));
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chosen_spec_is_registered() {
        let registered = specs();
        for dtype in DType::ALL {
            for d in [
                1,
                3,
                31,
                32,
                33,
                256,
                768,
                1000,
                1024,
                4096,
                8192,
                16384,
                65536,
                1 << 20,
            ] {
                for vectorized in [false, true] {
                    let s = forward_spec(dtype, d, vectorized, true, false);
                    assert!(
                        registered.contains(&s),
                        "{s} chosen for d={d} but not registered"
                    );
                }
            }
        }
    }
}
