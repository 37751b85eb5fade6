//! The content-addressed cache key: SHA-256 over a versioned, length-prefixed encoding of
//! everything that determines the compiled image (see cache-layout.md, "Key").

use std::fmt;

use sha2::{Digest, Sha256};

/// Bumped whenever the key encoding or the entry file format changes.
pub const FORMAT_VERSION: u32 = 1;

/// What goes into a key. Every field that can change the produced image is here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyParts {
    /// The rendered CUDA source.
    pub source: String,
    /// (include name, contents) of every header the source can see; kiln's templates use none.
    pub headers: Vec<(String, String)>,
    /// The kernels the module exposes, as NVRTC name expressions: the family's kernel first.
    pub name_expressions: Vec<String>,
    /// NVRTC options, normalised (kiln generates them in one canonical order; no target here).
    pub options: Vec<String>,
    /// The exact target, e.g. `sm_90`, `sm_90a` or `compute_90`.
    pub target: String,
    /// NVRTC's version, e.g. `13.5`.
    pub nvrtc_version: String,
}

/// A SHA-256 cache key: [`KeyParts::key`] for an entry, [`KeyParts::lookup_key`] for the index
/// of every NVRTC's entries. Displayed as 64 lowercase hex digits, which also name the entry's
/// file.
///
/// ```
/// use kiln::jit::CacheKey;
///
/// let key = CacheKey([0xab; 32]);
/// let hex = key.hex();
/// assert_eq!(hex.len(), 64);
/// assert!(hex.starts_with("abab"));
/// assert_eq!(CacheKey::from_hex(&hex), Some(key));
/// // Upper case is read too; anything but 64 hex digits is not a key.
/// assert_eq!(CacheKey::from_hex(&hex.to_uppercase()), Some(key));
/// assert_eq!(CacheKey::from_hex(&hex[1..]), None);
/// assert_eq!(CacheKey::from_hex(&hex.replace('a', "g")), None);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheKey(pub [u8; 32]);

impl CacheKey {
    /// The key as 64 lowercase hex digits (as `Display` writes it).
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 64 hex digits, either case; None for anything else.
    pub fn from_hex(s: &str) -> Option<CacheKey> {
        if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(CacheKey(out))
    }
}

impl fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CacheKey({})", self.hex())
    }
}

impl fmt::Display for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

/// Feeds length-prefixed fields to a hasher, so that no two different part lists encode alike.
struct Encoder(Sha256);

impl Encoder {
    fn bytes(&mut self, b: &[u8]) {
        self.0.update((b.len() as u64).to_le_bytes());
        self.0.update(b);
    }

    fn list<'a>(&mut self, items: impl ExactSizeIterator<Item = &'a str>) {
        self.0.update((items.len() as u64).to_le_bytes());
        for s in items {
            self.bytes(s.as_bytes());
        }
    }
}

impl KeyParts {
    /// The entry's key: SHA-256 over every part, the NVRTC version included (cache-layout.md,
    /// "Key").
    pub fn key(&self) -> CacheKey {
        let mut e = self.common(b"kiln-jit-key");
        e.bytes(self.nvrtc_version.as_bytes());
        CacheKey(e.0.finalize().into())
    }

    /// The key without the NVRTC version: what every NVRTC's entry for the same source, options
    /// and exact target shares. The disk cache indexes entries by it, so that a process whose
    /// NVRTC has no entry (or that has no NVRTC at all) finds one another NVRTC made.
    pub fn lookup_key(&self) -> CacheKey {
        CacheKey(self.common(b"kiln-jit-lookup").0.finalize().into())
    }

    /// Every field but the NVRTC version, after a domain tag (so the two keys never coincide).
    fn common(&self, tag: &[u8]) -> Encoder {
        let mut e = Encoder(Sha256::new());
        e.bytes(tag);
        e.0.update(FORMAT_VERSION.to_le_bytes());
        e.bytes(self.source.as_bytes());
        e.0.update((self.headers.len() as u64).to_le_bytes());
        for (name, text) in &self.headers {
            e.bytes(name.as_bytes());
            e.bytes(text.as_bytes());
        }
        e.list(self.name_expressions.iter().map(String::as_str));
        e.list(self.options.iter().map(String::as_str));
        e.bytes(self.target.as_bytes());
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts() -> KeyParts {
        KeyParts {
            source: "extern \"C\" __global__ void k() {}".into(),
            headers: vec![],
            name_expressions: vec!["k".into()],
            options: vec!["--std=c++17".into()],
            target: "sm_90".into(),
            nvrtc_version: "13.5".into(),
        }
    }

    #[test]
    fn every_part_changes_the_key() {
        let base = parts().key();
        let mut variants = Vec::new();
        let mut p = parts();
        p.source.push(' ');
        variants.push(p);
        let mut p = parts();
        p.headers.push(("a.h".into(), String::new()));
        variants.push(p);
        let mut p = parts();
        p.name_expressions.push("k2".into());
        variants.push(p);
        let mut p = parts();
        p.options.push("-lineinfo".into());
        variants.push(p);
        let mut p = parts();
        p.target = "sm_90a".into();
        variants.push(p);
        let mut p = parts();
        p.nvrtc_version = "13.0".into();
        variants.push(p);
        for v in variants {
            assert_ne!(v.key(), base, "{v:?}");
        }
    }

    #[test]
    fn the_lookup_key_ignores_only_the_nvrtc_version() {
        let base = parts();
        let mut other = parts();
        other.nvrtc_version = "12.9".into();
        assert_eq!(base.lookup_key(), other.lookup_key());
        assert_ne!(base.key(), other.key());
        assert_ne!(base.key(), base.lookup_key());
        let mut t = parts();
        t.target = "sm_80".into();
        assert_ne!(t.lookup_key(), base.lookup_key());
    }

    #[test]
    fn the_entry_key_encoding_is_unchanged() {
        // Entries written before the lookup key existed stay valid: pin one key.
        assert_eq!(parts().key().hex()[..16], *"1b2b01e21d39e8d3");
    }

    #[test]
    fn length_prefixes_keep_boundaries() {
        // Moving a byte from one field into its neighbour must change the key.
        let mut a = parts();
        a.options = vec!["ab".into(), "c".into()];
        let mut b = parts();
        b.options = vec!["a".into(), "bc".into()];
        assert_ne!(a.key(), b.key());
    }

    #[test]
    fn hex_round_trips() {
        let k = parts().key();
        assert_eq!(CacheKey::from_hex(&k.hex()), Some(k));
        assert_eq!(CacheKey::from_hex("zz"), None);
    }
}
