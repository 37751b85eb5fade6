//! One disk-cache entry and its self-describing file format (cache-layout.md, "Entry file").

use sha2::{Digest, Sha256};

use super::key::{CacheKey, KeyParts, FORMAT_VERSION};

/// The first 8 bytes of every entry file.
pub const MAGIC: &[u8; 8] = b"KILNJIT\0";
const CHECKSUM_LEN: usize = 32;

/// What an entry's image is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageKind {
    /// SASS for one architecture (an ELF file).
    Cubin,
    /// PTX text, NUL-terminated, that the driver compiles when it loads the module.
    Ptx,
}

impl ImageKind {
    /// How the entry file spells it: `cubin` or `ptx`.
    pub fn name(self) -> &'static str {
        match self {
            ImageKind::Cubin => "cubin",
            ImageKind::Ptx => "ptx",
        }
    }

    fn parse(s: &str) -> Option<ImageKind> {
        match s {
            "cubin" => Some(ImageKind::Cubin),
            "ptx" => Some(ImageKind::Ptx),
            _ => None,
        }
    }
}

/// A compiled kernel module with everything that produced it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The key, `parts.key()`: also the file's name.
    pub key: CacheKey,
    /// Everything the key was made from: source, options, target, NVRTC version.
    pub parts: KeyParts,
    /// The spec, human-readable (for `kiln cache ls`).
    pub spec: String,
    /// kiln's name and version that wrote the entry.
    pub producer: String,
    /// Cubin or PTX: PTX when the target is `compute_XY`.
    pub image_kind: ImageKind,
    /// Lowered names, one per `parts.name_expressions` entry.
    pub lowered_names: Vec<String>,
    /// The compiled module: a cubin, or PTX text with its NUL terminator.
    pub image: Vec<u8>,
}

/// Why an entry file was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Corruption {
    /// Shorter than the fixed header and checksum (its length in bytes).
    #[error("truncated ({0} bytes)")]
    Truncated(usize),
    /// Does not start with [`MAGIC`].
    #[error("bad magic")]
    BadMagic,
    /// Another format version than this kiln's (the one found).
    #[error("format {0}, expected {FORMAT_VERSION}")]
    WrongFormat(u32),
    /// The bytes do not match their SHA-256 checksum.
    #[error("checksum mismatch")]
    Checksum,
    /// The checksum holds but the fields do not parse (which part failed).
    #[error("malformed: {0}")]
    Malformed(&'static str),
    /// The recorded key is not what the recorded parts hash to, or not the key looked up (the
    /// recorded key in hex).
    #[error("key mismatch: the file holds {0}")]
    KeyMismatch(String),
}

impl Entry {
    /// The entry file's bytes (cache-layout.md, "Entry file"), checksum last.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.image.len() + self.parts.source.len() + 1024);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&self.key.0);
        let p = &self.parts;
        for s in [
            &self.spec,
            &self.producer,
            self.image_kind.name(),
            &p.target,
            &p.nvrtc_version,
            &p.source,
        ] {
            put_bytes(&mut out, s.as_bytes());
        }
        put_u32(&mut out, p.headers.len());
        for (name, text) in &p.headers {
            put_bytes(&mut out, name.as_bytes());
            put_bytes(&mut out, text.as_bytes());
        }
        for list in [&p.name_expressions, &self.lowered_names, &p.options] {
            put_u32(&mut out, list.len());
            for s in list {
                put_bytes(&mut out, s.as_bytes());
            }
        }
        put_bytes(&mut out, &self.image);
        let checksum: [u8; CHECKSUM_LEN] = Sha256::digest(&out).into();
        out.extend_from_slice(&checksum);
        out
    }

    /// Decodes and verifies a file's bytes: magic, format, checksum, structure, and that the
    /// recorded key parts hash to the recorded key (and to `expected`, when given).
    pub fn decode(bytes: &[u8], expected: Option<&CacheKey>) -> Result<Entry, Corruption> {
        let min = MAGIC.len() + 4 + 32 + CHECKSUM_LEN;
        if bytes.len() < min {
            return Err(Corruption::Truncated(bytes.len()));
        }
        if &bytes[..MAGIC.len()] != MAGIC {
            return Err(Corruption::BadMagic);
        }
        let format = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
        if format != FORMAT_VERSION {
            return Err(Corruption::WrongFormat(format));
        }
        let (body, checksum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
        if Sha256::digest(body).as_slice() != checksum {
            return Err(Corruption::Checksum);
        }
        let mut r = Reader { rest: &body[12..] };
        let key = CacheKey(r.take(32)?.try_into().unwrap());
        let spec = r.string()?;
        let producer = r.string()?;
        let image_kind =
            ImageKind::parse(&r.string()?).ok_or(Corruption::Malformed("image kind"))?;
        let target = r.string()?;
        let nvrtc_version = r.string()?;
        let source = r.string()?;
        let n_headers = r.count()?;
        let mut headers = Vec::with_capacity(n_headers.min(64));
        for _ in 0..n_headers {
            headers.push((r.string()?, r.string()?));
        }
        let name_expressions = r.strings()?;
        let lowered_names = r.strings()?;
        let options = r.strings()?;
        let image = r.bytes()?.to_vec();
        if !r.rest.is_empty() {
            return Err(Corruption::Malformed("trailing bytes"));
        }
        if lowered_names.len() != name_expressions.len() {
            return Err(Corruption::Malformed("lowered names"));
        }
        let parts = KeyParts {
            source,
            headers,
            name_expressions,
            options,
            target,
            nvrtc_version,
        };
        if parts.key() != key {
            return Err(Corruption::KeyMismatch(key.hex()));
        }
        if let Some(expected) = expected {
            if *expected != key {
                return Err(Corruption::KeyMismatch(key.hex()));
            }
        }
        Ok(Entry {
            key,
            parts,
            spec,
            producer,
            image_kind,
            lowered_names,
            image,
        })
    }
}

fn put_u32(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&(n as u32).to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Corruption> {
        if self.rest.len() < n {
            return Err(Corruption::Malformed("field runs past the end"));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn count(&mut self) -> Result<usize, Corruption> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()) as usize)
    }

    fn bytes(&mut self) -> Result<&'a [u8], Corruption> {
        let len = u64::from_le_bytes(self.take(8)?.try_into().unwrap());
        let len = usize::try_from(len).map_err(|_| Corruption::Malformed("length"))?;
        self.take(len)
    }

    fn string(&mut self) -> Result<String, Corruption> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| Corruption::Malformed("utf-8"))
    }

    fn strings(&mut self) -> Result<Vec<String>, Corruption> {
        let n = self.count()?;
        let mut out = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            out.push(self.string()?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Entry {
        let parts = KeyParts {
            source: "extern \"C\" __global__ void k() {}".into(),
            headers: vec![],
            name_expressions: vec!["k".into()],
            options: vec!["--std=c++17".into()],
            target: "sm_90".into(),
            nvrtc_version: "13.5".into(),
        };
        Entry {
            key: parts.key(),
            parts,
            spec: "test".into(),
            producer: "kiln test".into(),
            image_kind: ImageKind::Cubin,
            lowered_names: vec!["k".into()],
            image: (0..=255u8).cycle().take(5000).collect(),
        }
    }

    #[test]
    fn round_trips() {
        let e = sample();
        let bytes = e.encode();
        assert_eq!(Entry::decode(&bytes, Some(&e.key)).unwrap(), e);
    }

    #[test]
    fn every_truncation_is_detected() {
        let bytes = sample().encode();
        for len in 0..bytes.len() {
            assert!(Entry::decode(&bytes[..len], None).is_err(), "len {len}");
        }
    }

    #[test]
    fn every_bit_flip_is_detected() {
        let bytes = sample().encode();
        for i in (0..bytes.len()).step_by(7) {
            let mut b = bytes.clone();
            b[i] ^= 1 << (i % 8);
            assert!(Entry::decode(&b, None).is_err(), "byte {i}");
        }
    }

    #[test]
    fn wrong_expected_key_is_rejected() {
        let bytes = sample().encode();
        let other = CacheKey([7; 32]);
        assert!(matches!(
            Entry::decode(&bytes, Some(&other)),
            Err(Corruption::KeyMismatch(_))
        ));
    }
}
