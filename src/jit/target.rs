//! The exact compilation target: `sm_90` (SASS), `sm_90a` (SASS with arch-specific features) or
//! `compute_90` (PTX, for a device the NVRTC in use cannot emit SASS for).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The oldest architecture kiln's templates support: Volta (sm_70). Before sm_80 the kernels
/// take portable paths (plain loads for `cp.async`, bf16 on FMA units; f16 tensor cores from
/// sm_75, FMA units on sm_70 and sm_72).
pub const MIN_ARCH: u32 = 70;

/// The most shared memory one block may opt in to on a GPU of architecture `arch` (compute
/// capability x 10), as the CUDA programming guide lists it; 48 KiB, which every GPU kiln
/// supports allows without opting in, for an architecture not listed. kiln asks the driver for
/// a real GPU's limit; this table serves where there is none (`kiln warm`) and for
/// `KILN_EMULATE_ARCH`.
pub fn shared_memory_per_block(arch: u32) -> usize {
    const KIB: usize = 1024;
    match arch {
        70 | 72 => 96 * KIB,
        75 => 64 * KIB,
        80 | 87 => 163 * KIB,
        86 | 89 | 120 | 121 => 99 * KIB,
        90 | 100 | 101 | 103 | 110 => 227 * KIB,
        _ => 48 * KIB,
    }
}

/// What kind of code a [`Target`] asks NVRTC for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TargetKind {
    /// SASS for exactly this architecture (`sm_XY`).
    Sass,
    /// SASS with the arch-specific feature set (`sm_XYa`), e.g. for wgmma on sm_90a.
    SassArchSpecific,
    /// PTX for the driver to compile (`compute_XY`).
    Ptx,
}

/// An exact compilation target: an architecture and the kind of code for it. Parsed from and
/// displayed as `sm_XY`, `sm_XYa` or `compute_XY`; `sm_90`, `sm_90a` and `compute_90` are three
/// different targets with three different cache keys.
///
/// ```
/// use kiln::jit::{Target, TargetKind};
///
/// let t: Target = "sm_90a".parse()?;
/// assert_eq!((t.arch, t.kind), (90, TargetKind::SassArchSpecific));
/// assert_eq!(t.to_string(), "sm_90a");
/// assert_eq!(t, Target::sass(90).arch_specific());
/// assert_eq!(Target::for_compute_capability(8, 6).to_string(), "sm_86");
/// assert!("compute_80".parse::<Target>()?.is_ptx());
///
/// // Not a target, and a target older than kiln supports.
/// assert!(matches!("gfx90a".parse::<Target>(), Err(kiln::Error::InvalidTarget(_))));
/// assert!(matches!(
///     "sm_61".parse::<Target>(),
///     Err(kiln::Error::InvalidArgument { arg: "target", .. })
/// ));
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target {
    /// Compute capability times ten plus minor, e.g. 90 for 9.0.
    pub arch: u32,
    /// SASS, arch-specific SASS or PTX.
    pub kind: TargetKind,
}

impl Target {
    /// SASS for exactly `arch` (compute capability x 10): `sm_XY`.
    pub const fn sass(arch: u32) -> Target {
        Target {
            arch,
            kind: TargetKind::Sass,
        }
    }

    /// PTX for `arch` (compute capability x 10), which the driver compiles for the GPU it
    /// loads on: `compute_XY`.
    pub const fn ptx(arch: u32) -> Target {
        Target {
            arch,
            kind: TargetKind::Ptx,
        }
    }

    /// The target for a device of compute capability `major.minor`. (Numbers past any real
    /// GPU's saturate, into a target NVRTC refuses, rather than overflow.)
    pub fn for_compute_capability(major: u32, minor: u32) -> Target {
        Target::sass(major.saturating_mul(10).saturating_add(minor))
    }

    /// The same architecture with its arch-specific features (`sm_90` -> `sm_90a`).
    pub fn arch_specific(self) -> Target {
        match self.kind {
            TargetKind::Ptx => self,
            _ => Target {
                arch: self.arch,
                kind: TargetKind::SassArchSpecific,
            },
        }
    }

    /// Whether this target is PTX (`compute_XY`) rather than SASS.
    pub fn is_ptx(self) -> bool {
        self.kind == TargetKind::Ptx
    }

    /// The NVRTC option that selects this target.
    pub fn nvrtc_option(self) -> String {
        format!("--gpu-architecture={self}")
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            TargetKind::Sass => write!(f, "sm_{}", self.arch),
            TargetKind::SassArchSpecific => write!(f, "sm_{}a", self.arch),
            TargetKind::Ptx => write!(f, "compute_{}", self.arch),
        }
    }
}

impl FromStr for Target {
    type Err = Error;

    fn from_str(s: &str) -> Result<Target> {
        let bad = || Error::InvalidTarget(s.to_string());
        let t = s.trim().to_ascii_lowercase();
        let (kind, digits) = if let Some(rest) = t.strip_prefix("sm_") {
            match rest.strip_suffix('a') {
                Some(d) => (TargetKind::SassArchSpecific, d.to_string()),
                None => (TargetKind::Sass, rest.to_string()),
            }
        } else if let Some(rest) = t.strip_prefix("compute_") {
            (TargetKind::Ptx, rest.to_string())
        } else {
            return Err(bad());
        };
        if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let arch: u32 = digits.parse().map_err(|_| bad())?;
        if arch < MIN_ARCH {
            return Err(Error::InvalidArgument {
                arg: "target",
                reason: format!("{s} is older than kiln's minimum, sm_{MIN_ARCH}"),
            });
        }
        Ok(Target { arch, kind })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_capabilities_past_any_gpu_saturate() {
        assert_eq!(Target::for_compute_capability(9, 0), Target::sass(90));
        assert_eq!(
            Target::for_compute_capability(u32::MAX, 9),
            Target::sass(u32::MAX)
        );
        assert_eq!(
            Target::for_compute_capability(9, u32::MAX),
            Target::sass(u32::MAX)
        );
    }

    #[test]
    fn round_trips() {
        for s in [
            "sm_70",
            "sm_72",
            "sm_75",
            "compute_75",
            "sm_80",
            "sm_90",
            "sm_90a",
            "compute_90",
            "sm_100",
            "sm_120a",
        ] {
            assert_eq!(s.parse::<Target>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn rejects_malformed_and_old_targets() {
        for s in [
            "",
            "sm90",
            "sm_",
            "sm_9x",
            "gfx90a",
            "sm_61",
            "compute_60",
            "sm_9",
        ] {
            assert!(s.parse::<Target>().is_err(), "{s} parsed");
        }
    }

    #[test]
    fn exact_targets_are_distinct() {
        let a: Target = "sm_90".parse().unwrap();
        assert_ne!(a, a.arch_specific());
        assert_ne!(a, Target::ptx(90));
        assert_eq!(
            a.arch_specific().nvrtc_option(),
            "--gpu-architecture=sm_90a"
        );
    }
}
