//! The disk cache under corruption, size pressure, read-only and unwritable directories.

mod common;

use std::fs;

use kiln::env::CacheMode;
use kiln::jit::disk_cache::DiskCache;
use kiln::jit::{KernelSpec, Origin, Target};
use kiln::DType;

fn specs(n: usize) -> Vec<KernelSpec> {
    kiln::ops::registered_specs()
        .into_iter()
        .filter(|s| s.dtype == DType::F32)
        .take(n)
        .collect()
}

const SM90: Target = Target::sass(90);

fn damage_and_recompile(damage: impl Fn(&mut Vec<u8>)) {
    let dir = tempfile::tempdir().unwrap();
    let spec = specs(1)[0];
    let first = common::jit_in(dir.path()).compile(&spec, SM90).unwrap();
    let jit = common::jit_in(dir.path());
    let path = jit.disk_cache().entry_path(&first.entry.key);
    let mut bytes = fs::read(&path).unwrap();
    damage(&mut bytes);
    fs::write(&path, &bytes).unwrap();

    let again = jit.compile(&spec, SM90).unwrap();
    assert_eq!(
        again.origin,
        Origin::Compiled,
        "a damaged entry must be recompiled"
    );
    assert_eq!(again.entry.image, first.entry.image);
    // The recompiled entry was published again, intact.
    let third = common::jit_in(dir.path()).compile(&spec, SM90).unwrap();
    assert_eq!(third.origin, Origin::Disk);
}

#[test]
fn a_truncated_entry_is_detected_and_recompiled() {
    damage_and_recompile(|b| b.truncate(b.len() / 2));
}

#[test]
fn a_bit_flipped_entry_is_detected_and_recompiled() {
    damage_and_recompile(|b| {
        let i = b.len() / 3;
        b[i] ^= 0x10;
    });
}

#[test]
fn an_empty_entry_is_detected_and_recompiled() {
    damage_and_recompile(|b| b.clear());
}

#[test]
fn verify_reports_and_removes_bad_entries() {
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_in(dir.path());
    let mut paths = Vec::new();
    for spec in specs(3) {
        let c = jit.compile(&spec, SM90).unwrap();
        paths.push(jit.disk_cache().entry_path(&c.entry.key));
    }
    let report = jit.disk_cache().verify();
    assert_eq!((report.checked, report.ok, report.bad.len()), (3, 3, 0));

    let mut bytes = fs::read(&paths[1]).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    fs::write(&paths[1], bytes).unwrap();
    let report = jit.disk_cache().verify();
    assert_eq!((report.checked, report.ok, report.bad.len()), (3, 2, 1));
    assert!(!paths[1].exists(), "the bad entry is removed");
    assert!(paths[0].exists() && paths[2].exists());
}

#[test]
fn eviction_keeps_the_cache_under_its_cap_and_keeps_recent_entries() {
    let dir = tempfile::tempdir().unwrap();
    // Measure one entry, then cap the cache at about four of them.
    let probe = tempfile::tempdir().unwrap();
    let one = common::jit_in(probe.path())
        .compile(&specs(1)[0], SM90)
        .unwrap();
    let entry_bytes = one.entry.encode().len() as u64;
    let cap = entry_bytes * 4 + entry_bytes / 2;

    let jit = common::jit_with(dir.path(), CacheMode::On, cap);
    let all = specs(12);
    for (i, spec) in all.iter().enumerate() {
        jit.compile(spec, SM90).unwrap();
        let total: u64 = jit.disk_cache().entry_files().iter().map(|f| f.bytes).sum();
        assert!(
            total <= cap,
            "after {} compiles: {total} bytes > cap {cap}",
            i + 1
        );
        // mtime granularity: make the LRU order unambiguous.
        std::thread::sleep(std::time::Duration::from_millis(15));
    }
    // The most recent entry survives.
    let newest = jit.key_parts(all.last().unwrap(), SM90).unwrap().key();
    assert!(jit.disk_cache().entry_path(&newest).exists());
    assert!(jit.disk_cache().entry_files().len() >= 3);
}

#[test]
fn cache_off_writes_nothing_and_still_compiles() {
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_with(dir.path(), CacheMode::Off, 1 << 30);
    let c = jit.compile(&specs(1)[0], SM90).unwrap();
    assert_eq!(c.origin, Origin::Compiled);
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        0,
        "off touches no files"
    );
}

#[test]
fn read_only_mode_reads_entries_and_writes_none() {
    let dir = tempfile::tempdir().unwrap();
    let [a, b] = [specs(2)[0], specs(2)[1]];
    common::jit_in(dir.path()).compile(&a, SM90).unwrap();
    let before = common::jit_in(dir.path()).disk_cache().entry_files().len();

    let jit = common::jit_with(dir.path(), CacheMode::ReadOnly, 1 << 30);
    assert_eq!(jit.compile(&a, SM90).unwrap().origin, Origin::Disk);
    assert_eq!(jit.compile(&b, SM90).unwrap().origin, Origin::Compiled);
    assert_eq!(
        jit.disk_cache().entry_files().len(),
        before,
        "ro wrote an entry"
    );
    assert!(jit.disk_cache().clear().is_err(), "ro refuses to clear");
}

#[test]
fn an_unwritable_directory_means_memory_only_operation() {
    let dir = tempfile::tempdir().unwrap();
    // A cache directory below a regular file can never be created, even by root.
    let blocker = dir.path().join("not-a-dir");
    fs::write(&blocker, b"x").unwrap();
    let jit = common::jit_in(&blocker.join("cache"));
    assert!(!jit.disk_cache().is_writable());
    let spec = specs(1)[0];
    assert_eq!(jit.compile(&spec, SM90).unwrap().origin, Origin::Compiled);
    assert_eq!(jit.compile(&spec, SM90).unwrap().origin, Origin::Memory);
}

#[test]
fn a_read_only_directory_with_entries_still_serves_them() {
    let dir = tempfile::tempdir().unwrap();
    let spec = specs(1)[0];
    common::jit_in(dir.path()).compile(&spec, SM90).unwrap();
    let root = common::jit_in(dir.path()).disk_cache().root().to_path_buf();
    set_read_only(&root, true);
    let jit = common::jit_in(dir.path());
    let other = specs(2)[1];
    let hit = jit.compile(&spec, SM90).unwrap().origin;
    let new = jit.compile(&other, SM90).unwrap().origin;
    set_read_only(&root, false);
    assert_eq!(hit, Origin::Disk);
    assert_eq!(new, Origin::Compiled);
}

fn set_read_only(root: &std::path::Path, ro: bool) {
    use std::os::unix::fs::PermissionsExt;
    let mode = if ro { 0o555 } else { 0o755 };
    for shard in fs::read_dir(root).unwrap().flatten() {
        fs::set_permissions(shard.path(), fs::Permissions::from_mode(mode)).unwrap();
    }
    fs::set_permissions(root, fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn gc_removes_temp_files_of_dead_writers_only() {
    let dir = tempfile::tempdir().unwrap();
    let jit = common::jit_in(dir.path());
    let c = jit.compile(&specs(1)[0], SM90).unwrap();
    let shard = jit.disk_cache().entry_path(&c.entry.key);
    let shard = shard.parent().unwrap();
    let hex = c.entry.key.hex();
    // PID 4194304 is above Linux's maximum, so its writer cannot be alive.
    let dead = shard.join(format!(".{hex}.4194304.0.tmp"));
    let live = shard.join(format!(".{hex}.{}.99.tmp", std::process::id()));
    fs::write(&dead, b"partial").unwrap();
    fs::write(&live, b"in progress").unwrap();
    let report = jit.disk_cache().gc();
    assert_eq!(report.temp_files_removed, 1);
    assert!(!dead.exists());
    assert!(live.exists(), "a live writer's temp file is left alone");
    // Temp files are never mistaken for entries.
    assert_eq!(jit.disk_cache().verify().bad.len(), 0);
}

#[test]
fn opening_creates_a_versioned_root() {
    let dir = tempfile::tempdir().unwrap();
    let cache = DiskCache::open(dir.path(), CacheMode::On, 1 << 20);
    assert!(cache.root().ends_with("v1"));
    assert!(cache.root().is_dir());
    assert!(cache.is_writable());
}

/// Notes (measured tuning choices): stored and read back by name, replaced by a newer value,
/// never confused with another name's, removed by clear; ro reads but does not write, off
/// neither.
#[test]
fn notes_are_kept_by_name_and_follow_the_cache_mode() {
    let dir = tempfile::tempdir().unwrap();
    let on = DiskCache::open(dir.path(), CacheMode::On, 1 << 30);
    assert_eq!(on.load_note("conv a"), None);
    on.store_note("conv a", "128x256 1");
    on.store_note("conv b", "256x128 3");
    assert_eq!(on.load_note("conv a").as_deref(), Some("128x256 1"));
    assert_eq!(on.load_note("conv b").as_deref(), Some("256x128 3"));
    on.store_note("conv a", "128x128 2");
    assert_eq!(on.load_note("conv a").as_deref(), Some("128x128 2"));
    assert_eq!(on.load_note("conv a\nforged"), None, "names are one line");

    let ro = DiskCache::open(dir.path(), CacheMode::ReadOnly, 1 << 30);
    assert_eq!(ro.load_note("conv b").as_deref(), Some("256x128 3"));
    ro.store_note("conv c", "x");
    assert_eq!(on.load_note("conv c"), None, "ro wrote a note");
    let off = DiskCache::open(dir.path(), CacheMode::Off, 1 << 30);
    assert_eq!(off.load_note("conv b"), None);

    on.clear().unwrap();
    assert_eq!(on.load_note("conv a"), None);
    assert_eq!(on.load_note("conv b"), None);
}

/// `KILN_CACHE=off` touches no disk: over a directory full of entries it lists none, verifies
/// none and removes nothing.
#[test]
fn an_off_cache_reads_and_removes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let on = common::jit_in(dir.path());
    let spec = kiln::ops::axpby::spec(kiln::DType::F32);
    on.compile(&spec, kiln::jit::Target::sass(90)).unwrap();
    let files = on.disk_cache().entry_files().len();
    assert_eq!(files, 1);
    let off = DiskCache::open(dir.path(), CacheMode::Off, 1 << 30);
    assert!(off.entry_files().is_empty());
    let report = off.verify();
    assert_eq!((report.checked, report.bad.len()), (0, 0));
    let gc = off.gc();
    assert_eq!(gc.remaining_entries, 0);
    assert_eq!(
        on.disk_cache().entry_files().len(),
        files,
        "off removed an entry"
    );
}
