//! Stand-ins for a cold start (`KILN_STAND_INS`). While a norm's chosen kernel compiles in the
//! background, the call runs on the looped kernel of its pass (1,024 threads a row, any row
//! length), compiled as a family of its own with NVRTC's `--Ofast-compile=mid` (about 0.1 s).
//! One stand-in per pass, norm, dtype and vector width serves every row length.

use std::sync::Arc;

use super::choose::{constant, spec_of};
use super::*;
use crate::runtime::Device;

/// `norm_fwd` built for compile time rather than speed.
pub static FORWARD_QUICK: TemplateDef = TemplateDef {
    name: "norm_fwd_quick",
    ..FORWARD_FIELDS
};

/// `norm_vjp` built for compile time rather than speed.
pub static VJP_QUICK: TemplateDef = TemplateDef {
    name: "norm_vjp_quick",
    ..VJP_FIELDS
};

/// The stand-in of `pass` for rows of `dtype` read `n_reads` elements at a time.
pub fn spec(pass: Pass, kind: Kind, dtype: DType, n_reads: usize) -> KernelSpec {
    let looped = spec_of(pass, kind, dtype, n_reads, 1024, 0);
    let template = match pass {
        Pass::Forward => &FORWARD_QUICK,
        Pass::Vjp => &VJP_QUICK,
    };
    KernelSpec { template, ..looped }
}

/// Every norm stand-in: each pass, norm, dtype and vector width.
pub fn specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for pass in [Pass::Forward, Pass::Vjp] {
        for kind in [Kind::LayerNorm, Kind::RmsNorm] {
            for dtype in DType::ALL {
                for n_reads in [1, dtype.vec_width()] {
                    out.push(spec(pass, kind, dtype, n_reads));
                }
            }
        }
    }
    out
}

/// The stand-in for a norm spec (of any family of its pass); None for other kernels.
fn stand_in_of(chosen: &KernelSpec) -> Option<KernelSpec> {
    let name = chosen.template.name;
    let pass = if name.starts_with("norm_fwd") {
        Pass::Forward
    } else if name.starts_with("norm_vjp") {
        Pass::Vjp
    } else {
        return None;
    };
    let kind = if constant(chosen, "RMS") != 0 {
        Kind::RmsNorm
    } else {
        Kind::LayerNorm
    };
    Some(spec(pass, kind, chosen.dtype, chosen.n_reads as usize))
}

/// The kernel that runs a call whose model's choice is `chosen`, and its spec: `chosen`'s when
/// it is ready, else (stand-ins on) its stand-in, with `chosen` queued for compiling in the
/// background. `next`: what the next calls will likely need, queued behind (their stand-ins
/// first).
pub(super) fn kernel_for(
    device: &Device,
    chosen: KernelSpec,
    next: &[KernelSpec],
) -> Result<(KernelSpec, Arc<LoadedKernel>)> {
    if let Some(k) = device.loaded(&chosen) {
        return Ok((chosen, k));
    }
    if device.jit().stand_ins() {
        if let (None, Some(stand_in)) = (device.ready(&chosen)?, stand_in_of(&chosen)) {
            device.prefetch_urgent(next.iter().filter_map(stand_in_of));
            device.prefetch([chosen]);
            device.prefetch(next.iter().copied());
            match device.kernel(&stand_in) {
                Ok(k) => return Ok((stand_in, k)),
                Err(e) => {
                    tracing::warn!(error = %e, "norm stand-in failed; compiling the chosen kernel")
                }
            }
        }
    }
    device.prefetch(next.iter().copied());
    Ok((chosen, device.kernel(&chosen)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_choice_has_the_looped_stand_in_of_its_pass() {
        let gpu = Gpu::for_arch(90);
        for pass in [Pass::Forward, Pass::Vjp] {
            for d in [1, 320, 4096, 30000, 131072] {
                let chosen = choose_spec(
                    pass,
                    Kind::RmsNorm,
                    DType::BF16,
                    d,
                    Rows::Aligned,
                    Count::Many,
                    gpu,
                );
                let s = stand_in_of(&chosen).unwrap();
                assert_eq!(s, spec(pass, Kind::RmsNorm, DType::BF16, 8), "{chosen}");
                assert_eq!((constant(&s, "ITEMS"), s.block_dim), (0, 1024));
                assert_eq!(constant(&s, "RMS"), 1);
            }
        }
        assert_eq!(stand_in_of(&reduce_cols_spec(DType::F32, 4)), None);
    }
}
