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

/// The f64 CPU reference: `x` is `rows x d` row-major, `w` and `b` have `d` elements.
pub fn reference_forward(
    x: &[f64],
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    d: usize,
    eps: f64,
) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(d.max(1)) {
        let mean = row.iter().sum::<f64>() / d as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for (j, v) in row.iter().enumerate() {
            let mut o = (v - mean) * rstd;
            if let Some(w) = w {
                o *= w[j];
            }
            if let Some(b) = b {
                o += b[j];
            }
            y.push(o);
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_normalises_rows() {
        let x = [1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 10.0, 10.0];
        let eps = 1e-6;
        let y = reference_forward(&x, Some(&[2.0; 4]), Some(&[1.0; 4]), 4, eps);
        let rstd = 1.0 / (1.25f64 + eps).sqrt();
        let want = [-1.5 * rstd, -0.5 * rstd, 0.5 * rstd, 1.5 * rstd];
        for j in 0..4 {
            assert!((y[j] - (want[j] * 2.0 + 1.0)).abs() < 1e-12);
            assert_eq!(y[4 + j], 1.0); // constant row: zero variance, only the bias
        }
    }

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
