//! Element types kiln's kernels are specialised for.

use std::fmt;

/// The floating-point element types. f16 and bf16 are stored as `half::f16` / `half::bf16` on the
/// host and as 16-bit words on the device; kernels accumulate in f32. More types may be added in
/// any release, so matches need a wildcard arm.
///
/// ```
/// use kiln::DType;
///
/// assert_eq!(DType::BF16.size(), 2);
/// // One 16-byte vector load holds 8 half-precision elements, 4 of f32.
/// assert_eq!(DType::F16.vec_width(), 8);
/// assert_eq!(DType::F32.vec_width(), 4);
/// assert_eq!(DType::BF16.to_string(), "bf16");
/// assert_eq!(DType::F16.cuda_type(), "kiln_f16");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// IEEE single precision: `f32` on the host, `float` on the device.
    F32,
    /// IEEE half precision: `half::f16` on the host.
    F16,
    /// bfloat16, f32's exponent range with 8 bits of precision: `half::bf16` on the host.
    BF16,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The short name used in specs, cache listings and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// The device-side type the templates use (defined in `templates/prelude.cuh`).
    pub const fn cuda_type(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F16 => "kiln_f16",
            DType::BF16 => "kiln_bf16",
        }
    }

    /// The code templates use to name a dtype (`kiln_dtype<CODE>::type` in the prelude).
    pub const fn code(self) -> i32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
        }
    }

    /// Elements in one 16-byte vector load.
    pub const fn vec_width(self) -> usize {
        16 / self.size()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Host element types that map to a [`DType`].
pub trait Element: Copy + Send + Sync + 'static {
    /// The dtype this host type is stored as on the device.
    const DTYPE: DType;
    /// The value as f64 (exact: f64 holds every value of each element type).
    fn to_f64(self) -> f64;
    /// `v` rounded to the nearest value of this type.
    fn from_f64(v: f64) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        half::f16::from_f64(v)
    }
}

impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        half::bf16::from_f64(v)
    }
}

/// Encodes f64 values as `dtype` elements, little-endian (rounding to nearest).
pub fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &v in values {
        match dtype {
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
        }
    }
    out
}

/// Decodes little-endian `dtype` elements to f64. A length that is not a whole number of
/// elements is an error naming `bytes` (a trailing part-element is never dropped silently).
pub fn decode(dtype: DType, bytes: &[u8]) -> crate::Result<Vec<f64>> {
    if bytes.len() % dtype.size() != 0 {
        return Err(crate::Error::InvalidArgument {
            arg: "bytes",
            reason: format!(
                "{} bytes are not a whole number of {dtype} elements ({} bytes each)",
                bytes.len(),
                dtype.size()
            ),
        });
    }
    Ok(bytes
        .chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
            DType::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f64(),
            DType::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f64(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_round_trips_representable_values() {
        let values = [0.0, 1.0, -2.5, 0.125, 256.0, -0.0078125];
        for dtype in DType::ALL {
            assert_eq!(
                decode(dtype, &encode(dtype, &values)).unwrap(),
                values,
                "{dtype}"
            );
        }
    }

    #[test]
    fn decode_refuses_a_part_element() {
        // Five bytes of f32 decoded as one value, the fifth byte dropped without a word.
        for (dtype, len) in [
            (DType::F32, 5),
            (DType::F32, 3),
            (DType::F16, 1),
            (DType::BF16, 7),
        ] {
            let err = decode(dtype, &vec![0; len]).unwrap_err();
            assert!(
                matches!(err, crate::Error::InvalidArgument { arg: "bytes", .. }),
                "{err:?}"
            );
        }
        assert_eq!(decode(DType::F16, &[]).unwrap(), Vec::<f64>::new());
    }

    #[test]
    fn vector_width_is_sixteen_bytes() {
        for dtype in DType::ALL {
            assert_eq!(dtype.vec_width() * dtype.size(), 16);
        }
    }
}
