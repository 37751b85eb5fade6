//! The disk cache: one verified file per entry, published atomically, bounded by an LRU size cap.
//! cache-layout.md is this module's contract.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use sha2::Digest;

use super::entry::{Corruption, Entry};
use super::key::{CacheKey, FORMAT_VERSION};
use crate::env::CacheMode;
use crate::error::{Error, Result};

const ENTRY_EXT: &str = "kiln";
const TEMP_EXT: &str = "tmp";
/// Notes: small text records beside the kernels (measured tuning choices), in their own folder.
const NOTE_DIR: &str = "tune";
const NOTE_EXT: &str = "txt";
/// The NVRTC-version-free index: `index/<lookup key>/<entry key>`, empty marker files.
const INDEX_DIR: &str = "index";
/// A temp file this old is a crashed writer's even if its PID has been reused.
const STALE_TEMP_AGE: Duration = Duration::from_secs(3600);
/// Eviction goes down to this fraction of the cap, so that it does not run on every publish.
const LOW_WATER_PERCENT: u64 = 90;

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// A verified entry for the key.
    Hit(Box<Entry>),
    /// No entry for the key (or the cache is off).
    Miss,
    /// The file was bad; it has been removed (unless the cache is read-only).
    Corrupt(Corruption),
}

/// One entry file, for listings and eviction.
#[derive(Clone, Debug)]
pub struct EntryFile {
    /// The file.
    pub path: PathBuf,
    /// The key its name spells, or None when the name is not a key.
    pub key: Option<CacheKey>,
    /// Its size.
    pub bytes: u64,
    /// Its modification time: the LRU clock, which a load sets to now (in `on` mode).
    pub modified: SystemTime,
}

/// What [`DiskCache::verify`] found.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct VerifyReport {
    /// Entry files read.
    pub checked: usize,
    /// Those that verified.
    pub ok: usize,
    /// (path, reason) of each bad entry; each was removed unless the cache is not `on`.
    pub bad: Vec<(String, String)>,
}

/// What [`DiskCache::gc`] did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GcReport {
    /// Entries removed, least recently used first.
    pub evicted: usize,
    /// Their size in bytes.
    pub evicted_bytes: u64,
    /// Temp files of crashed writers removed.
    pub temp_files_removed: usize,
    /// Entries left.
    pub remaining_entries: usize,
    /// Their size in bytes.
    pub remaining_bytes: u64,
}

/// The on-disk cache of compiled modules under one directory (cache-layout.md). Safe to share
/// between threads and between processes: every file is published atomically and verified on
/// every read.
#[derive(Debug)]
pub struct DiskCache {
    /// `<cache dir>/v<FORMAT_VERSION>`.
    root: PathBuf,
    mode: CacheMode,
    max_bytes: u64,
    /// Cleared after a failed write: from then on the process runs memory-only (one warning).
    writable: AtomicBool,
    /// Bytes on disk as last scanned plus what this process has published since; `u64::MAX`
    /// until the first scan.
    size_estimate: AtomicU64,
    eviction: Mutex<()>,
}

impl DiskCache {
    /// Opens (creating, when writable) the cache under `dir`. Never fails: a directory that cannot
    /// be created gives one warning and memory-only operation.
    pub fn open(dir: &Path, mode: CacheMode, max_bytes: u64) -> DiskCache {
        let root = dir.join(format!("v{FORMAT_VERSION}"));
        let cache = DiskCache {
            root,
            mode,
            max_bytes,
            writable: AtomicBool::new(mode == CacheMode::On),
            size_estimate: AtomicU64::new(u64::MAX),
            eviction: Mutex::new(()),
        };
        if mode == CacheMode::On {
            if let Err(e) = fs::create_dir_all(&cache.root) {
                cache.disable_writes(&cache.root, &e);
            }
        }
        cache
    }

    /// The versioned directory the entries live under: `<cache dir>/v<FORMAT_VERSION>`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The mode it was opened with (`KILN_CACHE`).
    pub fn mode(&self) -> CacheMode {
        self.mode
    }

    /// The size cap in bytes (`KILN_CACHE_MAX_BYTES`): eviction brings the entries down to 90% of
    /// it once they pass it.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Whether entries can still be written (on, and no write has failed).
    pub fn is_writable(&self) -> bool {
        self.writable.load(Ordering::Relaxed)
    }

    fn readable(&self) -> bool {
        self.mode != CacheMode::Off
    }

    /// Where the entry for `key` lives: `<root>/<first two hex digits>/<key in hex>.kiln`,
    /// whether or not it exists.
    pub fn entry_path(&self, key: &CacheKey) -> PathBuf {
        let hex = key.hex();
        self.root.join(&hex[..2]).join(format!("{hex}.{ENTRY_EXT}"))
    }

    fn disable_writes(&self, path: &Path, err: &std::io::Error) {
        if self.writable.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                path = %path.display(),
                error = %err,
                "kiln's disk cache cannot be written; continuing with the in-memory cache only"
            );
        }
    }

    /// Reads and verifies the entry for `key`. A bad entry is removed and reported, never fatal.
    pub fn load(&self, key: &CacheKey) -> Lookup {
        if !self.readable() {
            return Lookup::Miss;
        }
        let path = self.entry_path(key);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(_) => return Lookup::Miss,
        };
        match Entry::decode(&bytes, Some(key)) {
            Ok(entry) => {
                if self.is_writable() {
                    // The modification time is the LRU clock; a failure only ages the entry.
                    let _ = File::options()
                        .write(true)
                        .open(&path)
                        .and_then(|f| f.set_modified(SystemTime::now()));
                }
                Lookup::Hit(Box::new(entry))
            }
            Err(why) => {
                tracing::warn!(path = %path.display(), reason = %why, "discarding a bad kiln cache entry");
                if self.mode == CacheMode::On {
                    let _ = fs::remove_file(&path);
                }
                Lookup::Corrupt(why)
            }
        }
    }

    /// Publishes `entry` atomically: unique temp file in the same directory, fsync, rename.
    /// An entry already present is left as it is. Failures disable writes with one warning.
    pub fn store(&self, entry: &Entry) {
        if !self.is_writable() {
            return;
        }
        let path = self.entry_path(&entry.key);
        if path.exists() {
            self.index(entry);
            return;
        }
        let bytes = entry.encode();
        match publish(&path, &bytes) {
            Ok(()) => {
                self.index(entry);
                let before = self.size_estimate.load(Ordering::Relaxed);
                if before != u64::MAX {
                    self.size_estimate
                        .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                }
                if before == u64::MAX || before.saturating_add(bytes.len() as u64) > self.max_bytes
                {
                    self.enforce_cap();
                }
            }
            Err(e) => self.disable_writes(&path, &e),
        }
    }

    /// Records `entry` under its NVRTC-free lookup key (an empty marker file; creating it is
    /// atomic, so concurrent writers need no lock). Written after the entry itself.
    fn index(&self, entry: &Entry) {
        if !self.is_writable() {
            return;
        }
        let dir = self
            .root
            .join(INDEX_DIR)
            .join(entry.parts.lookup_key().hex());
        let marker = dir.join(entry.key.hex());
        if marker.exists() {
            return;
        }
        if let Err(e) = fs::create_dir_all(&dir).and_then(|_| File::create(&marker).map(drop)) {
            self.disable_writes(&marker, &e);
        }
    }

    /// An entry for `lookup` (the key without the NVRTC version) made by any NVRTC, verified as
    /// on every load; the newest NVRTC's when there are several. Markers whose entry is gone or
    /// bad are removed (in `on` mode).
    pub fn find_any(&self, lookup: &CacheKey) -> Option<Entry> {
        if !self.readable() {
            return None;
        }
        let dir = self.root.join(INDEX_DIR).join(lookup.hex());
        let mut best: Option<Entry> = None;
        for marker in fs::read_dir(&dir).ok()?.flatten() {
            let name = marker.file_name();
            let Some(key) = name.to_str().and_then(CacheKey::from_hex) else {
                continue;
            };
            match self.load(&key) {
                Lookup::Hit(e) if e.parts.lookup_key() == *lookup => {
                    let newer = best.as_ref().map_or(true, |b| {
                        version(&e.parts.nvrtc_version) > version(&b.parts.nvrtc_version)
                    });
                    if newer {
                        best = Some(*e);
                    }
                }
                _ => {
                    if self.mode == CacheMode::On {
                        let _ = fs::remove_file(marker.path());
                    }
                }
            }
        }
        best
    }

    /// Publishes an entry that came from elsewhere (a bundle), already verified by
    /// `Entry::decode`. Returns false when it was already present.
    pub fn import(&self, entry: &Entry) -> Result<bool> {
        if !self.is_writable() {
            return Err(Error::InvalidArgument {
                arg: "KILN_CACHE",
                reason: format!(
                    "the cache at {} cannot be written (mode {})",
                    self.root.display(),
                    self.mode.name()
                ),
            });
        }
        let path = self.entry_path(&entry.key);
        let existed = path.exists();
        if !existed {
            publish(&path, &entry.encode())
                .map_err(|e| Error::io("importing a cache entry", &path, e))?;
        }
        self.index(entry);
        Ok(!existed)
    }

    /// Removes least-recently-used entries until the cache is under its cap (down to the low-water
    /// mark when it was over), and cleans up temp files of crashed writers.
    pub fn gc(&self) -> GcReport {
        let mut report = GcReport::default();
        if self.mode != CacheMode::On {
            let files = self.entry_files();
            report.remaining_entries = files.len();
            report.remaining_bytes = files.iter().map(|f| f.bytes).sum();
            return report;
        }
        let _guard = self.eviction.lock().unwrap_or_else(|e| e.into_inner());
        report.temp_files_removed = self.remove_stale_temp_files();
        let mut files = self.entry_files();
        let mut total: u64 = files.iter().map(|f| f.bytes).sum();
        if total > self.max_bytes {
            let target = self.max_bytes / 100 * LOW_WATER_PERCENT;
            files.sort_by_key(|f| f.modified);
            let mut kept = Vec::new();
            for f in files {
                if total > target && fs::remove_file(&f.path).is_ok() {
                    total -= f.bytes;
                    report.evicted += 1;
                    report.evicted_bytes += f.bytes;
                } else {
                    kept.push(f);
                }
            }
            files = kept;
            if report.evicted > 0 {
                tracing::info!(
                    evicted = report.evicted,
                    bytes = report.evicted_bytes,
                    "kiln cache eviction"
                );
            }
        }
        self.size_estimate.store(total, Ordering::Relaxed);
        report.remaining_entries = files.len();
        report.remaining_bytes = total;
        report
    }

    fn enforce_cap(&self) {
        self.gc();
    }

    /// Every entry file (by name; contents are not read). None with `KILN_CACHE=off`, which
    /// touches no disk: so `verify` and `gc` find nothing either.
    pub fn entry_files(&self) -> Vec<EntryFile> {
        let mut out = Vec::new();
        if !self.readable() {
            return out;
        }
        for path in self.files_with_ext(ENTRY_EXT) {
            let Ok(meta) = fs::metadata(&path) else {
                continue;
            };
            let key = path
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(CacheKey::from_hex);
            out.push(EntryFile {
                key,
                bytes: meta.len(),
                modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                path,
            });
        }
        out
    }

    /// Reads every entry and checks it; bad ones are removed (unless read-only).
    pub fn verify(&self) -> VerifyReport {
        let mut report = VerifyReport::default();
        for f in self.entry_files() {
            report.checked += 1;
            let result = match fs::read(&f.path) {
                Err(e) => Err(e.to_string()),
                Ok(bytes) => match f.key {
                    None => Err("file name is not a cache key".to_string()),
                    // A good entry is (re)indexed: entries written before the index existed
                    // become findable by other NVRTC versions.
                    Some(key) => Entry::decode(&bytes, Some(&key))
                        .map(|e| self.index(&e))
                        .map_err(|e| e.to_string()),
                },
            };
            match result {
                Ok(()) => report.ok += 1,
                Err(why) => {
                    if self.mode == CacheMode::On {
                        let _ = fs::remove_file(&f.path);
                    }
                    report.bad.push((f.path.display().to_string(), why));
                }
            }
        }
        report
    }

    /// Removes every entry and temp file. Returns how many entries were removed.
    pub fn clear(&self) -> Result<usize> {
        if self.mode != CacheMode::On {
            return Err(Error::InvalidArgument {
                arg: "KILN_CACHE",
                reason: format!(
                    "the cache is {}; clearing needs KILN_CACHE=on",
                    self.mode.name()
                ),
            });
        }
        let mut removed = 0;
        for path in self.files_with_ext(ENTRY_EXT) {
            fs::remove_file(&path).map_err(|e| Error::io("removing a cache entry", &path, e))?;
            removed += 1;
        }
        for path in self.files_with_ext(TEMP_EXT) {
            let _ = fs::remove_file(&path);
        }
        let _ = fs::remove_dir_all(self.root.join(INDEX_DIR));
        if let Ok(notes) = fs::read_dir(self.root.join(NOTE_DIR)) {
            for note in notes.flatten() {
                let _ = fs::remove_file(note.path());
            }
        }
        self.size_estimate.store(0, Ordering::Relaxed);
        Ok(removed)
    }

    fn note_path(&self, name: &str) -> PathBuf {
        let hex: String = sha2::Sha256::digest(name.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        self.root.join(NOTE_DIR).join(format!("{hex}.{NOTE_EXT}"))
    }

    /// The note stored under `name`, if there is a readable one. A note is a text file whose
    /// first line is its name and whose rest is its value; one whose name does not match (a
    /// hash collision, or a damaged file) is ignored.
    pub fn load_note(&self, name: &str) -> Option<String> {
        if !self.readable() || name.contains('\n') {
            return None;
        }
        let text = fs::read_to_string(self.note_path(name)).ok()?;
        let (first, value) = text.split_once('\n')?;
        (first == name).then(|| value.to_string())
    }

    /// Publishes `value` under `name` (atomically, like an entry), replacing an older note.
    /// Failures disable writes with one warning, as for entries.
    pub fn store_note(&self, name: &str, value: &str) {
        if !self.is_writable() || name.contains('\n') {
            return;
        }
        let path = self.note_path(name);
        if let Err(e) = publish(&path, format!("{name}\n{value}").as_bytes()) {
            self.disable_writes(&path, &e);
        }
    }

    /// Where the rendered source of a failed compile is kept for the user to read.
    pub fn save_failed_source(&self, key: &CacheKey, source: &str) -> Option<PathBuf> {
        let dir = if self.is_writable() {
            self.root.join("failed")
        } else {
            std::env::temp_dir().join("kiln-failed")
        };
        let path = dir.join(format!("{}.cu", key.hex()));
        fs::create_dir_all(&dir).ok()?;
        fs::write(&path, source).ok()?;
        Some(path)
    }

    fn files_with_ext(&self, ext: &str) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let Ok(shards) = fs::read_dir(&self.root) else {
            return out;
        };
        for shard in shards.flatten() {
            let name = shard.file_name();
            let name = name.to_string_lossy();
            if name.len() != 2 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
                continue;
            }
            let Ok(files) = fs::read_dir(shard.path()) else {
                continue;
            };
            for f in files.flatten() {
                let p = f.path();
                if p.extension().and_then(|e| e.to_str()) == Some(ext) {
                    out.push(p);
                }
            }
        }
        out
    }

    fn remove_stale_temp_files(&self) -> usize {
        let mut removed = 0;
        for path in self.files_with_ext(TEMP_EXT) {
            if temp_file_is_stale(&path) && fs::remove_file(&path).is_ok() {
                removed += 1;
            }
        }
        removed
    }
}

/// `major.minor` as numbers, for choosing the newest NVRTC's entry (unparsable: oldest).
fn version(v: &str) -> (u32, u32) {
    let mut it = v.split('.').map(|p| p.parse().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

/// Temp files are named `.<key>.<pid>.<n>.tmp`: stale when the writer is gone or it is old.
fn temp_file_is_stale(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let pid = name.split('.').nth(2).and_then(|p| p.parse::<u32>().ok());
    let writer_alive = match pid {
        Some(pid) if Path::new("/proc/self").exists() => {
            Path::new(&format!("/proc/{pid}")).exists()
        }
        _ => true,
    };
    let old = fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age > STALE_TEMP_AGE);
    !writer_alive || old
}

fn publish(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().expect("entry paths have a shard directory");
    fs::create_dir_all(dir)?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("entry");
    let temp = dir.join(format!(
        ".{stem}.{}.{}.{TEMP_EXT}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = File::options().write(true).create_new(true).open(&temp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&temp, path)?;
        // Make the rename itself durable.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result
}
