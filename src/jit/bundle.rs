//! Cache bundles: a warmed cache as one file, to ship to machines that run the same kernels
//! (`kiln cache export` / `kiln cache import`; cache-layout.md, "Bundles").
//!
//! The format is kiln's own and small: a header, then each entry file's bytes, length-prefixed.
//! Entries verify themselves (checksum, key recomputed from their contents), so the bundle adds
//! no checksum of its own: import decodes every entry exactly as a load does and publishes only
//! those that pass.

use std::fs;
use std::io::Write;
use std::path::Path;

use super::disk_cache::DiskCache;
use super::entry::Entry;
use super::target::Target;
use crate::error::{Error, Result};

/// The first 8 bytes of every bundle.
pub const BUNDLE_MAGIC: &[u8; 8] = b"KILNPACK";
/// The bundle format this kiln writes and reads (the entries inside carry their own version).
pub const BUNDLE_VERSION: u32 = 1;

/// What an export or an import did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct BundleReport {
    /// Entries written to the bundle (export) or published into the cache (import).
    pub entries: usize,
    /// Import: entries the cache already had.
    pub already_present: usize,
    /// Entries left out by `--arch`.
    pub skipped_arch: usize,
    /// (where, why) of each damaged entry: never exported, never imported.
    pub damaged: Vec<(String, String)>,
    /// Size of the bundle file in bytes (written on export, read on import).
    pub bytes: u64,
}

/// Whether an entry's target is one of `archs` (by architecture number; all when empty).
fn wanted(entry: &Entry, archs: &[u32]) -> bool {
    archs.is_empty()
        || entry
            .parts
            .target
            .parse::<Target>()
            .is_ok_and(|t| archs.contains(&t.arch))
}

/// Writes every good entry of `cache` (of `archs`, when given) to `path`, atomically (a temp
/// file renamed into place). Bad entries are reported and left out.
pub fn export(cache: &DiskCache, path: &Path, archs: &[u32]) -> Result<BundleReport> {
    let mut report = BundleReport::default();
    let mut chosen: Vec<Vec<u8>> = Vec::new();
    let mut files = cache.entry_files();
    files.sort_by(|a, b| a.path.cmp(&b.path));
    for f in files {
        let decoded = fs::read(&f.path).map_err(|e| e.to_string()).and_then(|b| {
            let entry = Entry::decode(&b, f.key.as_ref()).map_err(|e| e.to_string())?;
            Ok((b, entry))
        });
        match decoded {
            Ok((bytes, entry)) if wanted(&entry, archs) => chosen.push(bytes),
            Ok(_) => report.skipped_arch += 1,
            Err(why) => report.damaged.push((f.path.display().to_string(), why)),
        }
    }
    let mut out = Vec::new();
    out.extend_from_slice(BUNDLE_MAGIC);
    out.extend_from_slice(&BUNDLE_VERSION.to_le_bytes());
    out.extend_from_slice(&(chosen.len() as u64).to_le_bytes());
    for bytes in &chosen {
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(bytes);
    }
    let temp = path.with_extension(format!("tmp.{}", std::process::id()));
    let written = fs::File::create(&temp)
        .and_then(|mut f| f.write_all(&out).and_then(|_| f.sync_all()))
        .and_then(|_| fs::rename(&temp, path));
    if let Err(e) = written {
        let _ = fs::remove_file(&temp);
        return Err(Error::io("writing a cache bundle", path, e));
    }
    report.entries = chosen.len();
    report.bytes = out.len() as u64;
    Ok(report)
}

/// Publishes every entry of the bundle at `path` (of `archs`, when given) that verifies;
/// damaged ones are reported and never imported. A bundle whose framing is broken (cut short, a
/// damaged length) imports the entries before the damage and reports the rest as damaged. A
/// file that is not a bundle, or one of another bundle version, is [`Error::BadBundle`].
pub fn import(cache: &DiskCache, path: &Path, archs: &[u32]) -> Result<BundleReport> {
    let bytes = fs::read(path).map_err(|e| Error::io("reading a cache bundle", path, e))?;
    let bad_bundle = |reason: String| Error::BadBundle {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.len() < 20 || &bytes[..8] != BUNDLE_MAGIC {
        return Err(bad_bundle("not a kiln cache bundle".into()));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != BUNDLE_VERSION {
        return Err(bad_bundle(format!(
            "bundle version {version}; this kiln reads {BUNDLE_VERSION} (export it again with \
             this kiln)"
        )));
    }
    let count = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let mut report = BundleReport {
        bytes: bytes.len() as u64,
        ..BundleReport::default()
    };
    let mut rest = &bytes[20..];
    let mut read = 0u64;
    while read < count {
        let Some(len) = rest
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| l <= rest.len() - 8)
        else {
            report.damaged.push((
                format!("entries {} to {count}", read + 1),
                "the bundle is cut short or a length is damaged; not read".into(),
            ));
            return Ok(report);
        };
        let entry_bytes = &rest[8..8 + len];
        rest = &rest[8 + len..];
        read += 1;
        match Entry::decode(entry_bytes, None) {
            Ok(entry) if !wanted(&entry, archs) => report.skipped_arch += 1,
            Ok(entry) => {
                if cache.import(&entry)? {
                    report.entries += 1;
                } else {
                    report.already_present += 1;
                }
            }
            Err(why) => report
                .damaged
                .push((format!("entry {read} of {count}"), why.to_string())),
        }
    }
    if !rest.is_empty() {
        report.damaged.push((
            "the end of the bundle".into(),
            format!("{} bytes after the last entry", rest.len()),
        ));
    }
    Ok(report)
}
